"""Two guests on one gsonet: A on port 0 (.2), B on port 1 (.3), and with ``tap``
a tap uplink with the host's addresses (.1) on it; one /24 and one /64 of their own.
"""

from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

from .gsonet import Gsonet
from .guest import Guest
from .hostnet import alloc_subnet, delete_link, set_addr
from .qemu import vhost_user_netdev


@contextmanager
def guest_pair(work: Path, prefix: str, *, tap: str | None = None,
               port_opts: tuple[str, str] = ("", ""),
               props: tuple[dict | None, dict | None] = (None, None)):
    """Starts gsonet and boots A and B (at once, each with its default device, or
    with ``props`` for A and B; ``port_opts`` are added to each port's spec);
    yields a namespace with ``gs``, ``a``, ``b``, ``socks``, ``tap``, the addresses
    ``ip_a``, ``ip_b``, ``ip6_a``, ``ip6_b``, ``host_ip``, ``host_ip6``, and
    ``boot_b(props)``, which reboots B with those device properties unless it runs
    with them already. Both guests go, and gsonet with them, when the block ends."""
    n = alloc_subnet()
    ns = SimpleNamespace(
        ip_a=f"10.77.{n}.2", ip_b=f"10.77.{n}.3",
        ip6_a=f"fd00:77:{n}::2", ip6_b=f"fd00:77:{n}::3",
        host_ip=f"10.77.{n}.1", host_ip6=f"fd00:77:{n}::1",
        tap=tap, socks=[str(work / "a.sock"), str(work / "b.sock")],
        a=None, b=None, b_props={},
    )
    ns.gs = Gsonet([f"socket={s}{o}" for s, o in zip(ns.socks, port_opts)], [f"tap={tap}"] if tap else None,
                   workdir=work, name=f"gsonet-{prefix}")

    def guest(side: str, props: dict | None = None) -> Guest:
        i = "ab".index(side)
        return Guest(f"{prefix}-{side}", vhost_user_netdev(ns.socks[i]), props,
                     ip=f"10.77.{n}.{i + 2}/24", ip6=f"fd00:77:{n}::{i + 2}/64")

    def boot_b(props: dict | None = None) -> Guest:
        props = dict(props or {})
        if ns.b is not None and ns.b_props == props and ns.b.alive():
            return ns.b
        if ns.b is not None:
            ns.b.shutdown()
            ns.b = None
            ns.gs.wait_port(1, False)
        ns.b = guest("b", props)
        ns.b.start()
        ns.b.wait_booted()
        ns.gs.wait_port(1, True)
        ns.b_props = props
        return ns.b

    ns.boot_b = boot_b
    try:
        ns.gs.start()
        if tap:
            set_addr(tap, f"{ns.host_ip}/24", f"{ns.host_ip6}/64")
        ns.a, ns.b = guest("a", props[0]), guest("b", props[1])
        ns.b_props = dict(props[1] or {})
        for g in (ns.a, ns.b):
            g.start()
        for g in (ns.a, ns.b):
            g.wait_booted()
        ns.gs.wait_port(0, True)
        ns.gs.wait_port(1, True)
        yield ns
    finally:
        for g in (ns.a, ns.b):
            if g is not None:
                g.shutdown()
        ns.gs.stop()
        if tap:
            delete_link(tap)

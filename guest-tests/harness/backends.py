"""The backends scripts/measure.py compares (gsonet, QEMU's tap, DPDK testpmd), each
brought up in one topology (guest<->host or guest<->guest) with its guests booted."""

from __future__ import annotations

import shutil
from pathlib import Path

from . import hostnet
from .gsonet import Gsonet
from .guest import Guest
from .iperf import iperf3_guest_client, iperf3_guest_server, iperf3_host_client
from .paths import TESTPMD
from .process import HarnessError
from .qemu import tap_netdev, vhost_user_netdev
from .testpmd import TestPmd

BACKENDS = ["gsonet", "gsonet-nogro", "qemu-tap", "dpdk"]
TOPOLOGIES = ["host", "g2g"]
BASELINE = "qemu-tap"
LABEL = {"gsonet": "gsonet", "gsonet-nogro": "gsonet gro=off", "qemu-tap": "QEMU virtio-net + tap", "dpdk": "DPDK testpmd vhost"}

# testpmd: guest<->host through net_tap with checksum offload and TSO done by the
# csum engine (1434, not 1448, because net_tap counts the Ethernet header in its MTU
# check; mac-swap off or nothing arrives). Guest<->guest: io forwarding.
TESTPMD_ARGS = ["--nb-cores=1", "--rxd=1024", "--txd=1024"]
TESTPMD_HOST_CMDS = [
    "port stop all",
    "port config 0 rx_offload tcp_cksum on",
    "port config 0 rx_offload udp_cksum on",
    "set fwd csum",
    "csum mac-swap off 0",
    "csum mac-swap off 1",
    "csum set ip hw 1",
    "csum set tcp hw 1",
    "csum set udp hw 1",
    "csum parse-tunnel off 1",
    "tso set 1434 1",
    "port start all",
    "start",
]
TESTPMD_G2G_CMDS = ["set fwd io", "start"]


class Setup:
    """One backend in one topology (context manager): ``guests`` booted, ``host_ip``
    (guest<->host) and ``guest_ips`` known, ``commands`` the exact command lines used;
    ``gsonet`` is the daemon when the backend is gsonet."""

    def __init__(self, backend: str, topo: str, work: Path, logs: Path | None = None):
        self.backend, self.topo, self.work, self.logs = backend, topo, work, logs
        self.guests: list[Guest] = []
        self.guest_ips: list[str] = []
        self.host_ip: str | None = None
        self.commands: dict = {}
        self.gsonet: Gsonet | None = None
        self._host_link: str | None = None  # where host_ip goes (guest<->host)
        self._cleanup: list = []

    def __enter__(self) -> "Setup":
        try:
            self._up()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        for f in reversed(self._cleanup):
            try:
                f()
            except Exception:  # noqa: BLE001 - best-effort teardown
                pass
        self._cleanup.clear()

    def _up(self) -> None:
        n = hostnet.alloc_subnet()
        net = f"10.77.{n}"
        nguests = 1 if self.topo == "host" else 2
        socks = [str(self.work / f"{self.backend}-{self.topo}-{i}.sock") for i in range(nguests)]
        if self.backend in ("gsonet", "gsonet-nogro"):
            netdevs = self._gsonet(socks, gro=self.backend == "gsonet")
        elif self.backend == "qemu-tap":
            netdevs = self._qemu_tap(nguests)
        elif self.backend == "dpdk":
            netdevs = self._dpdk(socks)
        else:
            raise ValueError(self.backend)
        if self.topo == "host":
            hostnet.set_addr(self._host_link, f"{net}.1/24")
            self.host_ip = f"{net}.1"
        for i, netdev in enumerate(netdevs):
            g = Guest(f"bench-{self.backend}{i}", netdev, ip=f"{net}.{i + 2}/24",
                      log_dir=self.logs)
            self._cleanup.append(g.shutdown)
            self.guests.append(g)
            self.guest_ips.append(f"{net}.{i + 2}")
        for g in self.guests:
            g.start()
        for g in self.guests:
            g.wait_booted()
        self.commands["qemu"] = [" ".join(g.cmdline()) for g in self.guests]
        # Reachability first: a dead path should fail here, not as an iperf3 hang.
        peer = self.host_ip or self.guest_ips[1]
        rc, out = self.guests[0].run(f"ping -c 1 -W 10 {peer}", timeout=60)
        if rc != 0:
            raise HarnessError(f"guest cannot reach {peer}: {out.strip()[-200:]}")

    def _gsonet(self, socks: list[str], gro: bool = True) -> list[list[str]]:
        uplinks = []
        if self.topo == "host":
            self._host_link = hostnet.unique_name("bg")
            uplinks = [f"tap={self._host_link}"]
            self._cleanup.append(lambda: hostnet.delete_link(self._host_link))
        knob = "" if gro else ",gro=off"
        gs = Gsonet([f"socket={s}{knob}" for s in socks], uplinks,
                    workdir=self.work / f"gsonet-{self.topo}", name=f"bench-{self.topo}",
                    log_dir=self.logs)
        self._cleanup.append(gs.stop)
        gs.start()
        self.gsonet = gs
        self.commands["gsonet"] = " ".join(gs.cmdline())
        return [vhost_user_netdev(s) for s in socks]

    def _qemu_tap(self, nguests: int) -> list[list[str]]:
        taps = [hostnet.unique_name("bq") for _ in range(nguests)]
        self._cleanup.append(lambda: [hostnet.delete_link(t) for t in taps])
        if self.topo == "host":
            self._host_link = hostnet.create_tap(taps[0])
            self.commands["host"] = f"ip tuntap add dev {taps[0]} mode tap vnet_hdr"
        else:
            br = hostnet.unique_name("br")
            self._cleanup.append(lambda: hostnet.delete_link(br))
            hostnet.create_bridge(br, taps)
            self.commands["host"] = (f"ip link add {br} type bridge; "
                                     + "; ".join(f"ip tuntap add dev {t} mode tap vnet_hdr; "
                                                 f"ip link set {t} master {br}" for t in taps))
        return [tap_netdev(t) for t in taps]

    def _dpdk(self, socks: list[str]) -> list[list[str]]:
        if shutil.which(TESTPMD) is None:
            raise HarnessError(f"{TESTPMD} not installed (scripts/setup.sh installs dpdk-dev)")
        if self.topo == "host":
            self._host_link = hostnet.unique_name("bd")
            vdevs = [f"net_vhost0,iface={socks[0]},tso=1", f"net_tap0,iface={self._host_link}"]
            cmds = TESTPMD_HOST_CMDS
            self._cleanup.append(lambda: hostnet.delete_link(self._host_link))
        else:
            vdevs = [f"net_vhost{i},iface={s},tso=1,legacy-ol-flags=1"
                     for i, s in enumerate(socks)]
            cmds = TESTPMD_G2G_CMDS
        tp = TestPmd(f"bench-{self.topo}", vdevs, TESTPMD_ARGS, log_dir=self.logs)
        self._cleanup.append(tp.stop)
        tp.start()
        for c in cmds:
            tp.cmd(c, timeout=60)
        self.commands["testpmd"] = {"argv": " ".join(tp.cmdline()), "interactive": cmds}
        if self.topo == "host" and not hostnet.wait_link(self._host_link):
            raise HarnessError(f"testpmd did not create tap {self._host_link}")
        return [vhost_user_netdev(s) for s in socks]

    def set_offloads(self, on: bool) -> None:
        """ethtool -K eth0 tso/gso on or off in every guest."""
        for g in self.guests:
            g.ethtool_set(tso=on, gso=on)

    def measure(self, case: str, seconds: float) -> float:
        """Gbit/s of one iperf3 run: "g2h", "h2g" (server in the guest; -R makes the
        guest the sender) or "g2g" (guest 0 sends to guest 1)."""
        if case == "g2g":
            a, b = self.guests
            iperf3_guest_server(b)
            return iperf3_guest_client(a, self.guest_ips[1], seconds=seconds)
        iperf3_guest_server(self.guests[0])
        return iperf3_host_client(self.guest_ips[0], seconds=seconds, reverse=(case == "g2h"))

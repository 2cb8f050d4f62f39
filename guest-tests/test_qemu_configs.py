"""qemu-configs/*.sh with PRINT_ONLY=1 print the gsonet and QEMU command lines they would
run: they must equal what the harness builds (Gsonet, qemu.Machine) for the same set-up."""

import os
import subprocess

import pytest

from harness.gsonet import Gsonet
from harness.paths import REPO
from harness.qemu import Machine, vhost_user_netdev

GSONET = "/opt/gsonet/bin/gsonet"
NET = "10.77.0"


def _script(name: str, work, **env) -> dict[str, list[str]]:
    """Runs qemu-configs/NAME in print mode; {"gsonet": argv, "qemu vm1": argv, ...}."""
    clean = {k: v for k, v in os.environ.items()
             if k not in ("KERNEL", "INITRD", "MEM", "ACCEL", "NET", "CONSOLE", "OFFLOADS",
                          "EXTRA_QEMU", "TAP", "QUEUES", "PORT_OPTS", "UPLINK_OPTS",
                          "VM2_OFFLOADS")}
    out = subprocess.run(["bash", str(REPO / "qemu-configs" / name)], check=True,
                         capture_output=True, text=True, timeout=60,
                         env={**clean, "PRINT_ONLY": "1", "WORK": str(work), "GSONET": GSONET,
                              **env}).stdout
    cmds: dict[str, list[str]] = {}
    for line in out.splitlines():
        if line.startswith("--- "):
            cur = cmds.setdefault(line[4:], [])
        else:
            cur.append(line)
    return cmds


def _guest(name: str, host: int, sock, serial: str = "stdio", props=None, **kw) -> list[str]:
    netdev = vhost_user_netdev(sock, **kw.pop("netdev", {}))
    return Machine(name, netdev, props, ip=f"{NET}.{host}/24", ip6=f"fd00:77::{host}/64",
                   serial=serial, **kw).argv()


def _gsonet(ports: list[str], uplinks: list[str], work) -> list[str]:
    # The scripts keep gsonet's default (a persistent tap, reattached on the next run).
    return Gsonet(ports, uplinks, workdir=work, binary=GSONET, transient_taps=False).cmdline()


def test_one_guest_tap(tmp_path):
    cmds = _script("one-guest-tap.sh", tmp_path)
    sock = tmp_path / "vm1.sock"
    assert cmds == {
        "gsonet": _gsonet([f"socket={sock}"], ["tap=gsonet0"], tmp_path),
        "qemu vm1": _guest("vm1", 2, sock),
    }


@pytest.mark.parametrize("vm2_props", ["", "guest_tso4=off"])
def test_two_guests(tmp_path, vm2_props):
    cmds = _script("two-guests.sh", tmp_path, VM2_OFFLOADS=vm2_props)
    s1, s2 = tmp_path / "vm1.sock", tmp_path / "vm2.sock"
    props = dict(p.split("=") for p in vm2_props.split(",") if p)
    assert cmds == {
        "gsonet": _gsonet([f"socket={s1}", f"socket={s2}"], ["tap=gsonet0"], tmp_path),
        "qemu vm1": _guest("vm1", 2, s1, serial=f"file:{tmp_path}/vm1.console"),
        "qemu vm2": _guest("vm2", 3, s2, props=props),
    }


def test_multiqueue(tmp_path):
    cmds = _script("multiqueue.sh", tmp_path)
    sock = tmp_path / "mq.sock"
    assert cmds == {
        "gsonet": _gsonet([f"socket={sock},queues=2"], ["tap=gsonet0,queues=2"], tmp_path),
        "qemu mq": _guest("mq", 2, sock, props={"mq": "on", "vectors": "6"}, smp=2,
                          netdev={"queues": 2}),
    }


def test_client_mode(tmp_path):
    cmds = _script("client-mode.sh", tmp_path)
    sock = tmp_path / "qemu-srv.sock"
    assert cmds == {
        "gsonet": _gsonet([f"socket={sock},client"], ["tap=gsonet0"], tmp_path),
        "qemu vm1": _guest("vm1", 2, sock, netdev={"server": True, "wait": True}),
    }


def test_environment_reaches_the_command_line(tmp_path):
    """CONSOLE=file, MEM, OFFLOADS and EXTRA_QEMU as the scripts document them."""
    cmds = _script("one-guest-tap.sh", tmp_path, CONSOLE="file", MEM="1G",
                   OFFLOADS="host_tso4=off,guest_csum=off", EXTRA_QEMU="-snapshot")
    assert cmds["qemu vm1"] == _guest(
        "vm1", 2, tmp_path / "vm1.sock", serial=f"file:{tmp_path}/vm1.console", mem="1G",
        props={"host_tso4": "off", "guest_csum": "off"}) + ["-snapshot"]

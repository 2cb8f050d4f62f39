"""The QEMU command line of a test guest (TCG, shared memfd RAM, the test image, one
virtio-net-pci NIC): built here for Guest and, through the CLI, for qemu-configs/*.sh."""

from __future__ import annotations

import argparse
import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path

from .paths import INITRD, KERNEL, QEMU

# mrg_rxbuf and 1024-entry rings (QEMU's default 256 drops under load); QEMU 10 takes
# tx_queue_size > 256 only on vhost-user netdevs.
DEFAULT_DEVICE_PROPS = {"mrg_rxbuf": True, "rx_queue_size": 1024, "tx_queue_size": 1024}


def onoff(v) -> str:
    """QEMU and ethtool spelling of a value: booleans become on/off."""
    if v is True:
        return "on"
    if v is False:
        return "off"
    return str(v)


def mac_for(name: str) -> str:
    h = hashlib.sha256(name.encode()).digest()
    return "52:54:00:%02x:%02x:%02x" % (h[0], h[1], h[2])


def vhost_user_netdev(socket_path: str | os.PathLike, *, server: bool = False,
                      wait: bool = False, queues: int | None = None) -> list[str]:
    """-chardev socket + -netdev vhost-user (id n0). server=False: QEMU connects to the
    backend's listening socket (gsonet serve --port socket=...); server=True: QEMU
    listens (gsonet --port socket=...,client), with wait=True only starting the guest
    once the backend is there."""
    chardev = f"socket,id=c0,path={os.fspath(socket_path)}"
    if server:
        chardev += f",server=on,wait={onoff(wait)}"
    netdev = "vhost-user,id=n0,chardev=c0"
    if queues:
        netdev += f",queues={queues}"
    return ["-chardev", chardev, "-netdev", netdev]


def tap_netdev(ifname: str) -> list[str]:
    """QEMU's built-in tap backend (id n0) on an existing (or new) tap ``ifname``."""
    return ["-netdev", f"tap,id=n0,ifname={ifname},script=no,downscript=no,vhost=off"]


@dataclass
class Machine:
    """One guest's QEMU settings. ``netdev``: arguments defining netdev n0 (see
    vhost_user_netdev, tap_netdev), empty for no NIC. ``device_props`` override
    DEFAULT_DEVICE_PROPS on the NIC. ip / ip6 reach the image's init on the kernel
    command line (gsonet.ip=10.77.0.2/24, gsonet.ip6=fd00:77::2/64)."""

    name: str
    netdev: list[str] = field(default_factory=list)
    device_props: dict | None = None
    mem: str = "512M"
    smp: int = 1
    cpu: str = "qemu64"
    accel: str = "tcg"
    mac: str = ""
    ip: str | None = None
    ip6: str | None = None
    kernel: Path | str = KERNEL
    initrd: Path | str = INITRD
    qemu: str = QEMU
    serial: str = "stdio"

    def __post_init__(self) -> None:
        self.netdev = list(self.netdev or [])
        self.mac = self.mac or mac_for(self.name)

    def props(self) -> dict:
        props = dict(DEFAULT_DEVICE_PROPS)
        if not any(a.startswith("vhost-user") for a in self.netdev):
            del props["tx_queue_size"]
        props.update(self.device_props or {})
        return props

    def kernel_args(self) -> str:
        kargs = ["console=ttyS0", "quiet", "loglevel=1", "panic=-1", "mitigations=off",
                 f"gsonet.hostname={self.name}"]
        if self.ip:
            kargs.append(f"gsonet.ip={self.ip}")
        if self.ip6:
            kargs.append(f"gsonet.ip6={self.ip6}")
        return " ".join(kargs)

    def argv(self) -> list[str]:
        args = [
            self.qemu,
            "-name", self.name,
            "-accel", self.accel,
            "-cpu", self.cpu,
            "-m", self.mem,
            "-smp", str(self.smp),
            "-object", f"memory-backend-memfd,id=mem,size={self.mem},share=on",
            "-numa", "node,memdev=mem",
            "-kernel", str(self.kernel),
            "-initrd", str(self.initrd),
            "-append", self.kernel_args(),
            "-nodefaults",
            "-nographic",
            "-serial", self.serial,
            "-monitor", "none",
            "-no-reboot",
        ]
        if self.netdev:
            props = ",".join(f"{k}={onoff(v)}" for k, v in self.props().items())
            args += self.netdev
            args += ["-device", f"virtio-net-pci,netdev=n0,mac={self.mac},{props}"]
        return args


def _props(text: str) -> dict:
    """'k=v,k2=v2' (empty items ignored) as a dict."""
    return dict(item.split("=", 1) for item in text.split(",") if item)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python3 -m harness.qemu",
        description="Print the QEMU argv (one argument a line) of a test guest on a "
                    "vhost-user socket, as the guest tests build it.")
    ap.add_argument("name")
    ap.add_argument("socket", help="vhost-user socket")
    ap.add_argument("--ip", help="guest IPv4 address/prefix")
    ap.add_argument("--ip6", help="guest IPv6 address/prefix")
    ap.add_argument("--server", action="store_true", help="QEMU listens on the socket")
    ap.add_argument("--wait", action="store_true", help="with --server: wait for the backend")
    ap.add_argument("--queues", type=int)
    ap.add_argument("--props", action="append", default=[],
                    help="virtio-net-pci properties k=v,k2=v2 (repeatable)")
    ap.add_argument("--smp", type=int, default=1)
    ap.add_argument("--mem", default="512M")
    ap.add_argument("--accel", default="tcg")
    ap.add_argument("--kernel", default=str(KERNEL))
    ap.add_argument("--initrd", default=str(INITRD))
    ap.add_argument("--serial", default="stdio")
    a = ap.parse_args(argv)
    props: dict = {}
    for text in a.props:
        props.update(_props(text))
    m = Machine(a.name, vhost_user_netdev(a.socket, server=a.server, wait=a.wait,
                                          queues=a.queues),
                props, mem=a.mem, smp=a.smp, accel=a.accel, ip=a.ip, ip6=a.ip6,
                kernel=a.kernel, initrd=a.initrd, serial=a.serial)
    print("\n".join(m.argv()))


if __name__ == "__main__":
    main()

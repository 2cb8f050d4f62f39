"""Host side of the test networks: taps, bridges, addresses, free 10.77.N.0/24
subnets and unique interface names, on interfaces the harness creates itself."""

from __future__ import annotations

import ipaddress
import itertools
import os
import re
import subprocess
import time
from pathlib import Path

_seq = itertools.count(1)


def unique_name(tag: str) -> str:
    """gsn<tag><pid>x<n>: distinct per call and per process (keep tag short: an
    interface name has at most 15 characters)."""
    return f"gsn{tag}{os.getpid() % 100000}x{next(_seq)}"


def _ip(*args: str, check: bool = True) -> None:
    subprocess.run(["ip", *args], check=check, capture_output=True, text=True)


def tun_available() -> bool:
    return os.path.exists("/dev/net/tun")


def link_exists(name: str, netns: str | None = None) -> bool:
    """Whether interface ``name`` exists (in network namespace ``netns``, if given)."""
    if netns is None:
        return Path("/sys/class/net", name).exists()
    return subprocess.run(["ip", "-n", netns, "link", "show", "dev", name],
                          capture_output=True).returncode == 0


def wait_link(name: str, timeout: float = 10.0) -> bool:
    """True once interface ``name`` exists (e.g. a tap another process creates)."""
    deadline = time.monotonic() + timeout
    while not link_exists(name):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def delete_link(name: str) -> None:
    if link_exists(name):
        _ip("link", "del", name, check=False)


def set_addr(name: str, addr: str | None = None, addr6: str | None = None) -> None:
    """Add addresses (IPv6 without DAD) to an existing link and set it up."""
    if addr:
        _ip("addr", "add", addr, "dev", name)
    if addr6:
        subprocess.run(["sysctl", "-qw", f"net.ipv6.conf.{name}.accept_dad=0"],
                       capture_output=True)
        _ip("-6", "addr", "add", addr6, "dev", name, "nodad")
    _ip("link", "set", name, "up")


def create_tap(name: str, addr: str | None = None, addr6: str | None = None) -> str:
    """A persistent tap with vnet_hdr (replacing one of that name), addresses, up."""
    delete_link(name)
    _ip("tuntap", "add", "dev", name, "mode", "tap", "vnet_hdr")
    set_addr(name, addr, addr6)
    return name


def create_bridge(name: str, taps: list[str]) -> str:
    """Linux bridge ``name`` (no STP, no forward delay) enslaving new taps ``taps``, up."""
    delete_link(name)
    _ip("link", "add", name, "type", "bridge")
    _ip("link", "set", name, "type", "bridge", "stp_state", "0", "forward_delay", "0",
        check=False)
    for t in taps:
        create_tap(t)
        _ip("link", "set", t, "master", name)
    _ip("link", "set", name, "up")
    return name


def alloc_subnet(prefix: str = "10.77") -> int:
    """Pick N so that PREFIX.N.0/24 is not configured on any host interface."""
    out = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True,
                         text=True).stdout
    used = [ipaddress.ip_interface(m.group(1)).network
            for m in re.finditer(r"inet (\S+)", out)]
    for n in range(256):
        net = ipaddress.ip_network(f"{prefix}.{n}.0/24")
        if not any(net.overlaps(u) for u in used):
            return n
    raise RuntimeError(f"no free {prefix}.N.0/24")

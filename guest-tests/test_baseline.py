"""Baseline: QEMU's built-in virtio-net with -netdev tap (no gsonet).

Proves the harness (image, console, taps, iperf3, md5 transfers) that the
gsonet guest tests reuse, and gives the reference numbers gsonet is compared
with in the same run.
"""

import socket

import pytest

from harness import paths
from harness.iperf import iperf3_guest_server, iperf3_host_client
from harness.transfer import transfer_guest_to_host, transfer_host_to_guest


def test_boots_612_kernel(tap_guest, record_measurement):
    rc, out = tap_guest.guest.run("uname -r")
    assert rc == 0 and out.strip().startswith(f"{paths.GUEST_KERNEL}."), out
    record_measurement("qemu_tap.boot_seconds", tap_guest.boot_seconds)


def test_tso_on(tap_guest):
    feats = tap_guest.guest.ethtool_features()
    assert feats.get("tcp-segmentation-offload") == "on", feats
    assert feats.get("tx-checksumming") == "on", feats


def test_ping_host(tap_guest):
    rc, out = tap_guest.guest.run(f"ping -c 3 -W 5 {tap_guest.host_ip}", timeout=60)
    assert rc == 0, out


def test_ping6_host(tap_guest):
    rc, out = tap_guest.guest.run(f"ping -6 -c 3 -W 5 {tap_guest.host_ip6}", timeout=60)
    assert rc == 0, out


def test_udp_gso_tool(tap_guest):
    """udpgso_send with UDP_SEGMENT: 4000 bytes at gso 1000 arrive as 4 datagrams."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind((tap_guest.host_ip, 0))
        s.settimeout(10)
        port = s.getsockname()[1]
        out = tap_guest.guest.run_ok(
            f"udpgso_send -g 1000 {tap_guest.host_ip} {port} 4000")
        assert "sent 1 calls 4000 bytes" in out, out
        sizes = [len(s.recv(65536)) for _ in range(4)]
    assert sizes == [1000] * 4


@pytest.mark.slow
def test_iperf3_guest_to_host(tap_guest, record_measurement):
    g = tap_guest.guest
    iperf3_guest_server(g)
    gbps = iperf3_host_client(tap_guest.guest_ip, seconds=3, reverse=True)
    record_measurement("qemu_tap.guest_to_host_gbps", gbps)
    assert gbps > 0.05


@pytest.mark.slow
def test_iperf3_host_to_guest(tap_guest, record_measurement):
    g = tap_guest.guest
    iperf3_guest_server(g)
    gbps = iperf3_host_client(tap_guest.guest_ip, seconds=3, reverse=False)
    record_measurement("qemu_tap.host_to_guest_gbps", gbps)
    assert gbps > 0.05


@pytest.mark.slow
def test_transfer_guest_to_host_32mib(tap_guest):
    r = transfer_guest_to_host(tap_guest.guest, tap_guest.host_ip, mib=32)
    assert r["ok"], r


@pytest.mark.slow
def test_transfer_host_to_guest_32mib(tap_guest):
    r = transfer_host_to_guest(tap_guest.guest, tap_guest.host_ip, mib=32)
    assert r["ok"], r

"""One guest on gsonet (vhost-user) with a tap uplink: the core path.

gsonet creates the tap, the test puts the host addresses on it, a 6.12 guest
boots on the vhost-user port. The checks mirror test_baseline.py (QEMU's
built-in tap), so the numbers recorded here (gsonet.*) sit next to qemu_tap.*
from the same run, plus what only gsonet can show: its counters prove that
frames larger than 1514 bytes crossed intact (GSO passed, nothing segmented),
that offloads survive a QEMU restart behind a running daemon, and that QEMU can
be the socket server (gsonet in client mode).
"""

import os
from types import SimpleNamespace

import pytest

from harness import paths
from harness.gsonet import Gsonet, counters_delta
from harness.guest import Guest
from harness.hostnet import alloc_subnet, delete_link, set_addr
from harness.iperf import (
    HostIperfServer,
    iperf3_guest_client,
    iperf3_guest_server,
    iperf3_host_client,
)
from harness.qemu import vhost_user_netdev
from harness.transfer import transfer_guest_to_host, transfer_host_to_guest


def _host_net(n: int) -> SimpleNamespace:
    return SimpleNamespace(
        host_ip=f"10.77.{n}.1", guest_ip=f"10.77.{n}.2",
        host_ip6=f"fd00:77:{n}::1", guest_ip6=f"fd00:77:{n}::2",
    )


@pytest.fixture(scope="module")
def gsonet_guest(guest_env, tmp_path_factory):
    """gsonet serve with one port and a tap uplink (10.77.N.1/24, fd00:77:N::1/64 on
    the tap), a guest on the port with .2. Namespace: gs, guest, tap, sock, ips."""
    n = alloc_subnet()
    ns = _host_net(n)
    ns.tap = f"gsnu{os.getpid() % 100000}"
    work = tmp_path_factory.mktemp("gsonet")
    ns.sock = str(work / "vm1.sock")
    ns.gs = Gsonet([f"socket={ns.sock}"], [f"tap={ns.tap}"], workdir=work, name="gsonet-core")
    g = None
    try:
        ns.gs.start()
        set_addr(ns.tap, f"{ns.host_ip}/24", f"{ns.host_ip6}/64")
        g = Guest("gsonet", vhost_user_netdev(ns.sock),
                  ip=f"{ns.guest_ip}/24", ip6=f"{ns.guest_ip6}/64")
        g.start()
        ns.boot_seconds = g.wait_booted()
        ns.guest = g
        yield ns
    finally:
        if getattr(ns, "guest", None) is not None:
            ns.guest.shutdown()
        if g is not None:
            g.shutdown()
        ns.gs.stop()
        delete_link(ns.tap)


def test_boots_and_negotiates(gsonet_guest, record_measurement):
    rc, out = gsonet_guest.guest.run("uname -r")
    assert rc == 0 and out.strip().startswith(f"{paths.GUEST_KERNEL}."), out
    record_measurement("gsonet.boot_seconds", gsonet_guest.boot_seconds)
    p = gsonet_guest.gs.port_stats(0)
    assert p["connected"], p
    # the guest acked the TSO offloads both ways
    assert p["guest_tx"]["tso4"] and p["guest_tx"]["tso6"], p
    assert p["guest_rx"]["tso4"] and p["guest_rx"]["tso6"], p


def test_tso_on(gsonet_guest):
    feats = gsonet_guest.guest.ethtool_features()
    assert feats.get("tcp-segmentation-offload") == "on", feats
    assert feats.get("tx-checksumming") == "on", feats


def test_ping_host(gsonet_guest):
    rc, out = gsonet_guest.guest.run(f"ping -c 3 -W 5 {gsonet_guest.host_ip}", timeout=60)
    assert rc == 0, out


def test_ping6_host(gsonet_guest):
    rc, out = gsonet_guest.guest.run(f"ping -6 -c 3 -W 5 {gsonet_guest.host_ip6}", timeout=60)
    assert rc == 0, out


def test_large_frames_pass_intact(gsonet_guest):
    """A TCP stream each way: the guest's TSO frames (> 1514 bytes) reach the tap
    with their GSO header (uplink gso_passed), the kernel's GSO frames reach the
    guest intact (port gso_passed); nothing is segmented in software."""
    gs = gsonet_guest.gs
    before = gs.stats()
    r = transfer_guest_to_host(gsonet_guest.guest, gsonet_guest.host_ip, mib=4)
    assert r["ok"], r
    r = transfer_host_to_guest(gsonet_guest.guest, gsonet_guest.host_ip, mib=4)
    assert r["ok"], r
    after = gs.stats()
    port = counters_delta(before["ports"][0]["stats"], after["ports"][0]["stats"])
    up = counters_delta(before["uplinks"][0]["stats"], after["uplinks"][0]["stats"])
    assert port["tx_max_frame"] > 1514, port
    assert up["gso_passed"] > 0, (up, gs.stats_text())
    assert port["gso_passed"] > 0, (port, gs.stats_text())
    assert port["gso_segmented"] == 0 and up["gso_segmented"] == 0, gs.stats_text()
    bad = {k: v for d in (port["drops"], up["drops"]) for k, v in d.items()
           if k != "rx_queue_full"}
    assert not bad, gs.stats_text()


def _reload_driver(ns) -> None:
    """Unbinds and rebinds the guest's virtio-net driver: a device reset and a new
    feature negotiation on the same vhost-user connection (what a guest reboot does)."""
    g = ns.guest
    dev = g.run_ok("ls /sys/bus/virtio/drivers/virtio_net/ | grep virtio").split()[0]
    g.run_ok(f"echo {dev} > /sys/bus/virtio/drivers/virtio_net/unbind")
    g.run_ok(f"echo {dev} > /sys/bus/virtio/drivers/virtio_net/bind")
    g.run_ok("sleep 1; ip link set eth0 up")
    g.run_ok(f"ip addr add {ns.guest_ip}/24 dev eth0; ip -6 addr add {ns.guest_ip6}/64 dev eth0 nodad || ip -6 addr add {ns.guest_ip6}/64 dev eth0")


def test_driver_reload_resumes_traffic(gsonet_guest):
    """A device reset on the same vhost-user connection (what a guest reboot does):
    the driver negotiates again, traffic resumes and GSO frames still pass intact."""
    ns, gs = gsonet_guest, gsonet_guest.gs
    _reload_driver(ns)
    assert ns.guest.ethtool_features().get("tcp-segmentation-offload") == "on"
    p = gs.wait_port(0, True)
    assert p["guest_tx"]["tso4"] and p["guest_rx"]["tso4"], p
    rc, out = ns.guest.run(f"ping -c 3 -W 5 {ns.host_ip}", timeout=60)
    assert rc == 0, out
    before = gs.stats()
    for move in (transfer_guest_to_host, transfer_host_to_guest):
        r = move(ns.guest, ns.host_ip, mib=2)
        assert r["ok"], r
    after = gs.stats()
    port = counters_delta(before["ports"][0]["stats"], after["ports"][0]["stats"])
    up = counters_delta(before["uplinks"][0]["stats"], after["uplinks"][0]["stats"])
    assert port["gso_passed"] > 0 and up["gso_passed"] > 0, gs.stats_text()


def test_ctl_mask_applies_to_the_next_connection(guest_env, tmp_path_factory):
    """`gsonet ctl port:0 tso=off` on a running gsonet: the next QEMU on that port
    gets no TSO (ethtool shows it off), and no frame over 1514 bytes leaves it."""
    n = alloc_subnet()
    ns = _host_net(n)
    tap = f"gsct{os.getpid() % 100000}"
    work = tmp_path_factory.mktemp("gsonet-ctl")
    sock = str(work / "vm-ctl.sock")
    gs = Gsonet([f"socket={sock}"], [f"tap={tap}"], workdir=work, name="gsonet-ctl")
    g = None
    try:
        gs.start()
        set_addr(tap, f"{ns.host_ip}/24", f"{ns.host_ip6}/64")
        gs.ctl("port:0", "tso=off")
        g = Guest("gsonet-ctl", vhost_user_netdev(sock),
                  ip=f"{ns.guest_ip}/24", ip6=f"{ns.guest_ip6}/64")
        g.start()
        g.wait_booted()
        feats = g.ethtool_features()
        assert feats.get("tcp-segmentation-offload") == "off", feats
        p = gs.wait_port(0, True)
        assert not p["guest_tx"]["tso4"] and not p["guest_rx"]["tso4"], p
        r = transfer_guest_to_host(g, ns.host_ip, mib=2)
        assert r["ok"], r
        st = gs.stats()["ports"][0]["stats"]
        assert st["gso_passed"] == 0 and st["tx_frames"] > 0, gs.stats_text()
        assert st["tx_max_frame"] <= 1514, gs.stats_text()
    finally:
        if g is not None:
            g.shutdown()
        gs.stop()
        delete_link(tap)


@pytest.mark.slow
def test_iperf3_guest_to_host(gsonet_guest, record_measurement):
    iperf3_guest_server(gsonet_guest.guest)
    gbps = iperf3_host_client(gsonet_guest.guest_ip, seconds=3, reverse=True)
    record_measurement("gsonet.guest_to_host_gbps", gbps)
    assert gbps > 0.05


@pytest.mark.slow
def test_iperf3_host_to_guest(gsonet_guest, record_measurement):
    iperf3_guest_server(gsonet_guest.guest)
    gbps = iperf3_host_client(gsonet_guest.guest_ip, seconds=3, reverse=False)
    record_measurement("gsonet.host_to_guest_gbps", gbps)
    assert gbps > 0.05


@pytest.mark.slow
def test_transfer_guest_to_host_32mib(gsonet_guest, record_measurement):
    r = transfer_guest_to_host(gsonet_guest.guest, gsonet_guest.host_ip, mib=32)
    assert r["ok"], r
    record_measurement("gsonet.transfer_32mib_guest_to_host_seconds", r["seconds"])


@pytest.mark.slow
def test_transfer_host_to_guest_32mib(gsonet_guest, record_measurement):
    r = transfer_host_to_guest(gsonet_guest.guest, gsonet_guest.host_ip, mib=32)
    assert r["ok"], r
    record_measurement("gsonet.transfer_32mib_host_to_guest_seconds", r["seconds"])


def test_qemu_restart_while_gsonet_runs(gsonet_guest, record_measurement):
    """Kill QEMU (no clean shutdown), start a new one on the same socket: the
    daemon takes the new frontend, traffic and offloads work again (the tap's
    offloads are re-applied: the kernel's GSO frames reach the new guest intact).
    Runs last in this module: it replaces the module's guest."""
    ns = gsonet_guest
    gs = ns.gs
    old = ns.guest
    old.proc.kill()
    old.proc.wait(timeout=10)
    old.shutdown()
    gs.wait_port(0, False)
    assert gs.alive(), gs.log()[-2000:]
    ns.guest = None
    g = Guest("gsonet-2", vhost_user_netdev(ns.sock), mac=old.mac,
              ip=f"{ns.guest_ip}/24", ip6=f"{ns.guest_ip6}/64")
    ns.guest = g
    g.start()
    record_measurement("gsonet.reboot_boot_seconds", g.wait_booted())
    p = gs.wait_port(0, True)
    assert p["guest_rx"]["tso4"], p
    rc, out = g.run(f"ping -c 3 -W 5 {ns.host_ip}", timeout=60)
    assert rc == 0, out
    rc, out = g.run(f"ping -6 -c 3 -W 5 {ns.host_ip6}", timeout=60)
    assert rc == 0, out
    before = gs.stats()
    r = transfer_guest_to_host(g, ns.host_ip, mib=8)
    assert r["ok"], r
    r = transfer_host_to_guest(g, ns.host_ip, mib=8)
    assert r["ok"], r
    after = gs.stats()
    port = counters_delta(before["ports"][0]["stats"], after["ports"][0]["stats"])
    up = counters_delta(before["uplinks"][0]["stats"], after["uplinks"][0]["stats"])
    assert up["gso_passed"] > 0, gs.stats_text()
    assert port["gso_passed"] > 0, gs.stats_text()


@pytest.mark.full
def test_qemu_server_gsonet_client(guest_env, tmp_path_factory):
    """QEMU listens (chardev server=on), gsonet connects (--port socket=...,client)."""
    n = alloc_subnet()
    ns = _host_net(n)
    tap = f"gsnc{os.getpid() % 100000}"
    work = tmp_path_factory.mktemp("gsonet-client")
    sock = str(work / "qemu.sock")
    g = Guest("gsonet-qsrv", vhost_user_netdev(sock, server=True),
              ip=f"{ns.guest_ip}/24", ip6=f"{ns.guest_ip6}/64")
    gs = Gsonet([f"socket={sock},client"], [f"tap={tap}"], workdir=work,
                name="gsonet-client")
    try:
        g.start()
        g.wait_socket(sock)
        gs.start()
        set_addr(tap, f"{ns.host_ip}/24", f"{ns.host_ip6}/64")
        g.wait_booted()
        p = gs.wait_port(0, True)
        assert p["guest_tx"]["tso4"], p
        rc, out = g.run(f"ping -c 3 -W 5 {ns.host_ip}", timeout=60)
        assert rc == 0, out
        rc, out = g.run(f"ping -6 -c 3 -W 5 {ns.host_ip6}", timeout=60)
        assert rc == 0, out
        r = transfer_guest_to_host(g, ns.host_ip, mib=8)
        assert r["ok"], r
        r = transfer_host_to_guest(g, ns.host_ip, mib=8)
        assert r["ok"], r
        st = gs.stats()
        assert st["uplinks"][0]["stats"]["gso_passed"] > 0, gs.stats_text()
        assert st["ports"][0]["stats"]["gso_passed"] > 0, gs.stats_text()
    finally:
        g.shutdown()
        gs.stop()
        delete_link(tap)


def test_multiqueue_two_pairs(guest_env, tmp_path_factory, record_measurement):
    """queues=2 on the port (the tap follows with two queues): the guest's driver
    brings up two queue pairs and traffic over several flows crosses intact."""
    n = alloc_subnet()
    ns = _host_net(n)
    tap = f"gsmq{os.getpid() % 100000}"
    work = tmp_path_factory.mktemp("gsonet-mq")
    sock = str(work / "vm-mq.sock")
    gs = Gsonet([f"socket={sock},queues=2"], [f"tap={tap}"], workdir=work, name="gsonet-mq")
    g = None
    try:
        gs.start()
        set_addr(tap, f"{ns.host_ip}/24", f"{ns.host_ip6}/64")
        g = Guest("gsonet-mq", vhost_user_netdev(sock, queues=2),
                  device_props={"mq": True, "vectors": 6}, smp=2,
                  ip=f"{ns.guest_ip}/24", ip6=f"{ns.guest_ip6}/64")
        g.start()
        g.wait_booted()
        rc, out = g.run("ethtool -l eth0", timeout=30)
        assert rc == 0, out
        combined = [line.split()[-1] for line in out.splitlines() if line.strip().startswith("Combined")]
        assert combined == ["2", "2"], out  # maximum and current
        rc, out = g.run(f"ping -c 3 -W 5 {ns.host_ip}", timeout=60)
        assert rc == 0, out
        with HostIperfServer(bind=ns.host_ip):
            gbps = iperf3_guest_client(g, ns.host_ip, seconds=3, extra="-P 4")
        record_measurement("gsonet.mq2.guest_to_host_P4_gbps", gbps)
        assert gbps > 0
        r = transfer_guest_to_host(g, ns.host_ip, mib=8)
        assert r["ok"], r
        st = gs.stats()
        assert st["ports"][0]["stats"]["gso_passed"] > 0 or st["uplinks"][0]["stats"]["gso_passed"] > 0, gs.stats_text()
        assert "bad_header" not in st["ports"][0]["stats"]["drops"], gs.stats_text()
    finally:
        if g is not None:
            g.shutdown()
        gs.stop()
        delete_link(tap)

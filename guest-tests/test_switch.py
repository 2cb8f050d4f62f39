"""Two guests on one gsonet (two vhost-user ports, no uplink): guest-to-guest.

iperf3 from guest B (client) to guest A (server) in three cases, and the same
with QEMU's built-in virtio-net on two taps enslaved to a Linux bridge, in the
same run, so the numbers sit side by side (switch.gsonet.* / switch.bridge.*
and switch.ratio.*):

  (a) offload:         both guests offload (TSO frames cross gsonet intact:
                       gso_passed > 0 and gso_segmented == 0 on A's port);
  (b) rx_no_guest_tso: A's device has guest_tso4=off,guest_tso6=off, so gsonet
                       segments B's TSO frames in software (gso_segmented > 0
                       on A's port; the bridge case has the kernel do it);
  (c) tx_tso_off:      B runs `ethtool -K eth0 tso off gso off` (no GSO frames).

Plus a 32 MiB random file each way between the guests (busybox nc) with md5.
Each class boots its own pair of guests: at most two guests run at a time.
"""

import os
from types import SimpleNamespace

import pytest

from harness.gsonet import counters_delta
from harness.guest import Guest
from harness.hostnet import alloc_subnet, create_bridge, delete_link
from harness.iperf import iperf3_guest_client, iperf3_guest_server
from harness.pair import guest_pair
from harness.qemu import tap_netdev, vhost_user_netdev
from harness.transfer import transfer_guest_to_guest

SECONDS = 3
NO_GUEST_TSO = {"guest_tso4": False, "guest_tso6": False}

RESULTS: dict[str, dict[str, float]] = {"gsonet": {}, "bridge": {}}


def _record(record_measurement, backend: str, case: str, gbps: float) -> None:
    RESULTS[backend][case] = gbps
    record_measurement(f"switch.{backend}.{case}_gbps", gbps)
    g, b = RESULTS["gsonet"].get(case), RESULTS["bridge"].get(case)
    if g and b:
        record_measurement(f"switch.ratio.{case}", g / b)


def _pair_net(n: int) -> SimpleNamespace:
    return SimpleNamespace(
        ip_a=f"10.77.{n}.2", ip_b=f"10.77.{n}.3",
        ip6_a=f"fd00:77:{n}::2", ip6_b=f"fd00:77:{n}::3",
    )


def _boot_pair(ns, netdev_a, netdev_b, prefix: str, props_a=None):
    ns.a = Guest(f"{prefix}-a", netdev_a, props_a, ip=f"{ns.ip_a}/24", ip6=f"{ns.ip6_a}/64")
    ns.b = Guest(f"{prefix}-b", netdev_b, ip=f"{ns.ip_b}/24", ip6=f"{ns.ip6_b}/64")
    ns.a.start()
    ns.b.start()
    ns.a.wait_booted()
    ns.b.wait_booted()


def _restart_a(ns, netdev_a, prefix: str, props_a) -> None:
    """Replace guest A (same name, MAC, addresses) with one using ``props_a``."""
    mac = ns.a.mac
    ns.a.shutdown()
    ns.a = Guest(f"{prefix}-a", netdev_a, props_a, mac=mac,
                 ip=f"{ns.ip_a}/24", ip6=f"{ns.ip6_a}/64")
    ns.a.start()
    ns.a.wait_booted()
    # B's neighbour entry for A is still valid (same MAC); make sure the path is up
    rc, out = ns.b.run(f"ping -c 2 -W 5 {ns.ip_a}", timeout=60)
    assert rc == 0, out


def _iperf_b_to_a(ns) -> float:
    iperf3_guest_server(ns.a)
    return iperf3_guest_client(ns.b, ns.ip_a, seconds=SECONDS)


def _ping_both_ways(ns) -> None:
    rc, out = ns.b.run(f"ping -c 3 -W 5 {ns.ip_a}", timeout=60)
    assert rc == 0, out
    rc, out = ns.a.run(f"ping -6 -c 3 -W 5 {ns.ip6_b}", timeout=60)
    assert rc == 0, out


@pytest.fixture(scope="class")
def gsonet_pair(guest_env, tmp_path_factory):
    """Guests A (port 0) and B (port 1) on one gsonet without uplink."""
    with guest_pair(tmp_path_factory.mktemp("gsonet-switch"), "sw") as ns:
        yield ns


class TestGsonetSwitch:
    """Guest B sends to guest A through gsonet."""

    @pytest.fixture
    def pair(self, gsonet_pair):
        return gsonet_pair

    def _port_a(self, ns) -> dict:
        return ns.gs.port_stats(0)["stats"]

    def test_ping_guest_to_guest(self, pair):
        _ping_both_ways(pair)

    @pytest.mark.slow
    def test_iperf3_offload(self, pair, record_measurement):
        """(a) TSO frames from B reach A intact: passed, never segmented."""
        before = self._port_a(pair)
        gbps = _iperf_b_to_a(pair)
        d = counters_delta(before, self._port_a(pair))
        _record(record_measurement, "gsonet", "offload", gbps)
        assert gbps > 0.05
        assert d["gso_passed"] > 0, (d, pair.gs.stats_text())
        assert d["gso_segmented"] == 0, (d, pair.gs.stats_text())
        b = pair.gs.port_stats(1)["stats"]
        assert b["tx_max_frame"] > 1514, b

    @pytest.mark.slow
    def test_transfer_b_to_a_32mib(self, pair):
        r = transfer_guest_to_guest(pair.b, pair.a, pair.ip_a, mib=32)
        assert r["ok"], r

    @pytest.mark.slow
    def test_transfer_a_to_b_32mib(self, pair):
        r = transfer_guest_to_guest(pair.a, pair.b, pair.ip_b, mib=32)
        assert r["ok"], r

    @pytest.mark.slow
    def test_iperf3_sender_tso_off(self, pair, record_measurement):
        """(c) B sends no GSO frames: nothing to pass or segment."""
        before = self._port_a(pair)
        pair.b.ethtool_set(tso=False, gso=False)
        try:
            gbps = _iperf_b_to_a(pair)
        finally:
            pair.b.ethtool_set(tso=True, gso=True)
        d = counters_delta(before, self._port_a(pair))
        _record(record_measurement, "gsonet", "tx_tso_off", gbps)
        assert gbps > 0.01
        assert d["gso_passed"] == 0 and d["gso_segmented"] == 0, d

    @pytest.mark.slow
    def test_iperf3_receiver_without_guest_tso(self, pair, record_measurement):
        """(b) A did not ack GUEST_TSO4/6: gsonet segments B's TSO frames in
        software; the data arrives intact (md5) and the counters say so.
        Runs last in the class: it replaces guest A."""
        _restart_a(pair, vhost_user_netdev(pair.socks[0]), "sw", NO_GUEST_TSO)
        p = pair.gs.port_stats(0)
        assert p["connected"] and not p["guest_rx"]["tso4"] and not p["guest_rx"]["tso6"], p
        before = p["stats"]
        gbps = _iperf_b_to_a(pair)
        _record(record_measurement, "gsonet", "rx_no_guest_tso", gbps)
        r = transfer_guest_to_guest(pair.b, pair.a, pair.ip_a, mib=8)
        d = counters_delta(before, self._port_a(pair))
        assert r["ok"], r
        assert gbps > 0.05
        assert d["gso_segmented"] > 0, (d, pair.gs.stats_text())
        assert d["segments_out"] > d["gso_segmented"], d
        assert d["max_mss"] <= 1460, d
        assert not d["drops"].get("segment_error"), d


@pytest.fixture(scope="class")
def bridge_pair(guest_env):
    """The same guests on QEMU's built-in virtio-net: two taps on a Linux bridge."""
    ns = _pair_net(alloc_subnet())
    tag = os.getpid() % 100000
    ns.br, ns.tap_a, ns.tap_b = f"gsnbr{tag}", f"gsnba{tag}", f"gsnbb{tag}"
    ns.a = ns.b = None
    try:
        create_bridge(ns.br, [ns.tap_a, ns.tap_b])
        _boot_pair(ns, tap_netdev(ns.tap_a), tap_netdev(ns.tap_b), "br")
        yield ns
    finally:
        for g in (ns.a, ns.b):
            if g is not None:
                g.shutdown()
        for link in (ns.br, ns.tap_a, ns.tap_b):
            delete_link(link)


class TestBridgeBaseline:
    """QEMU's built-in virtio-net + Linux bridge, the reference for TestGsonetSwitch."""

    @pytest.fixture
    def pair(self, bridge_pair):
        return bridge_pair

    def test_ping_guest_to_guest(self, pair):
        _ping_both_ways(pair)

    @pytest.mark.slow
    def test_iperf3_offload(self, pair, record_measurement):
        gbps = _iperf_b_to_a(pair)
        _record(record_measurement, "bridge", "offload", gbps)
        assert gbps > 0.05

    @pytest.mark.full
    def test_transfer_b_to_a_32mib(self, pair):
        r = transfer_guest_to_guest(pair.b, pair.a, pair.ip_a, mib=32)
        assert r["ok"], r

    @pytest.mark.slow
    def test_iperf3_sender_tso_off(self, pair, record_measurement):
        pair.b.ethtool_set(tso=False, gso=False)
        try:
            gbps = _iperf_b_to_a(pair)
        finally:
            pair.b.ethtool_set(tso=True, gso=True)
        _record(record_measurement, "bridge", "tx_tso_off", gbps)
        assert gbps > 0.01

    @pytest.mark.full
    def test_iperf3_receiver_without_guest_tso(self, pair, record_measurement):
        """The kernel segments for a tap whose guest lacks GUEST_TSO (TUNSETOFFLOAD)."""
        _restart_a(pair, tap_netdev(pair.tap_a), "br", NO_GUEST_TSO)
        gbps = _iperf_b_to_a(pair)
        _record(record_measurement, "bridge", "rx_no_guest_tso", gbps)
        assert gbps > 0.05

"""GRO toward guests: two guests on one gsonet, the sender B with
`ethtool -K eth0 tso off gso off` (1448-byte segments only), the receiver A with
its default device (GUEST_TSO4/6 acked).

- A file from the host through gsonet's tap uplink, with the tap's own TSO and GSO
  off (the host kernel hands gsonet 1448-byte segments), reaches A coalesced too.
- A 16 MiB random file B->A keeps its md5 and reaches A as GSO frames gsonet built
  (`gro_frames` > 0 on A's port, several segments each); with `gsonet ctl port:0
  gro=off` the same transfer builds none. IPv6 as well.
- (slow) iperf3 B->A with GRO on and off, interleaved in one run (three rounds),
  recorded as `gro.on_gbps`, `gro.off_gbps`, `gro.ratio`, and A's virtio input
  interrupts per GB received in each case (`gro.*_irqs_per_gb`); asserted by counts:
  with GRO A's frames carry at least 3x the bytes they carry without it.
"""

import os
import statistics
import subprocess

import pytest

from harness.gsonet import counters_delta
from harness.guest import Guest
from harness.hostnet import unique_name
from harness.iperf import iperf3_guest_client, iperf3_guest_server
from harness.pair import guest_pair
from harness.transfer import transfer_guest_to_guest, transfer_host_to_guest

SECONDS = int(os.environ.get("GSONET_GRO_SECONDS", "5"))
ROUNDS = int(os.environ.get("GSONET_GRO_ROUNDS", "3"))


@pytest.fixture(scope="module")
def pair(guest_env, tmp_path_factory):
    with guest_pair(tmp_path_factory.mktemp("gro"), "gro", tap=unique_name("gro")) as ns:
        ns.b.ethtool_set(tso=False, gso=False)
        feats = ns.b.ethtool_features()
        assert feats["tcp-segmentation-offload"] == "off", feats
        assert feats["generic-segmentation-offload"] == "off", feats
        rx = ns.gs.port_stats(0)["guest_rx"]
        assert rx["tso4"] and rx["tso6"] and rx["csum"], rx
        yield ns


def _port_a_delta(ns, fn):
    before = ns.gs.port_stats(0)["stats"]
    r = fn()
    after = ns.gs.port_stats(0)["stats"]
    return r, counters_delta(before, after)


def _b_to_a(ns, ip: str, mib: int = 16):
    r, d = _port_a_delta(ns, lambda: transfer_guest_to_guest(ns.b, ns.a, ip, mib=mib))
    assert r["ok"], (r, d, ns.gs.stats_text())
    assert not d["drops"], (d, ns.gs.stats_text())
    # B sent no GSO frame: whatever A got as GSO, gsonet built.
    assert ns.gs.port_stats(1)["stats"]["tx_max_frame"] <= 1514
    return d


@pytest.mark.slow
def test_file_arrives_coalesced_with_md5(pair):
    d = _b_to_a(pair, pair.ip_a)
    assert d["gro_frames"] > 0, (d, pair.gs.stats_text())
    # Several segments per frame on average, not pairs now and then.
    assert d["gro_segments"] >= 3 * d["gro_frames"], d
    assert d["gso_passed"] == 0 and d["gso_segmented"] == 0, d
    assert "gro:" in pair.gs.stats_text()


@pytest.mark.slow
def test_ipv6_file_arrives_coalesced_with_md5(pair):
    d = _b_to_a(pair, pair.ip6_a)
    assert d["gro_frames"] > 0, (d, pair.gs.stats_text())


@pytest.mark.slow
def test_gro_off_builds_nothing(pair):
    pair.gs.ctl("port:0", "gro=off")
    try:
        d = _b_to_a(pair, pair.ip_a, mib=8)
        assert d["gro_frames"] == 0 and d["gro_segments"] == 0, d
        assert d["rx_frames"] > 8 * 1048576 // 1514, d
    finally:
        pair.gs.ctl("port:0", "gro=on")


@pytest.mark.slow
def test_host_segments_from_the_tap_arrive_coalesced(pair):
    # The host kernel segments what it sends through the tap itself.
    subprocess.run(["ethtool", "-K", pair.tap, "tso", "off", "gso", "off"], check=True)
    r, d = _port_a_delta(pair, lambda: transfer_host_to_guest(pair.a, pair.host_ip, mib=16))
    assert r["ok"], (r, d, pair.gs.stats_text())
    up = pair.gs.stats()["uplinks"][0]["stats"]
    assert up["tx_max_frame"] <= 1514, up
    assert d["gro_frames"] > 0 and d["gro_segments"] >= 2 * d["gro_frames"], d
    assert d["gso_passed"] == 0, d


def _input_irqs(g: Guest) -> int:
    """Interrupts of A's virtio-net receive queues so far (/proc/interrupts)."""
    out = g.run_ok("cat /proc/interrupts")
    total = 0
    for line in out.splitlines():
        if "-input" in line and "virtio" in line:
            cols = line.split()
            total += sum(int(c) for c in cols[1:] if c.isdigit())
    return total


@pytest.mark.slow
def test_throughput_with_and_without_gro(pair, record_measurement):
    """Interleaved: on, off, on, off, ... so drift on the shared machine hits both."""
    res = {True: [], False: []}
    irqs = {True: [0, 0], False: [0, 0]}
    frames = {True: 0, False: 0}
    iperf3_guest_server(pair.a)
    try:
        for _ in range(ROUNDS):
            for on in (True, False):
                pair.gs.ctl("port:0", f"gro={'on' if on else 'off'}")
                i0 = _input_irqs(pair.a)
                gbps, d = _port_a_delta(
                    pair, lambda: iperf3_guest_client(pair.b, pair.ip_a, seconds=SECONDS))
                i1 = _input_irqs(pair.a)
                res[on].append(gbps)
                irqs[on][0] += i1 - i0
                irqs[on][1] += d["rx_bytes"]
                frames[on] += d["rx_frames"]
                assert (d["gro_frames"] > 0) == on, (on, d)
                iperf3_guest_server(pair.a)
    finally:
        pair.gs.ctl("port:0", "gro=on")
    on, off = statistics.median(res[True]), statistics.median(res[False])
    record_measurement("gro.on_gbps", on)
    record_measurement("gro.off_gbps", off)
    record_measurement("gro.ratio", on / off)
    for k, (n, b) in irqs.items():
        record_measurement(f"gro.{'on' if k else 'off'}_irqs_per_gb", n / (b / 1e9))
    assert on > 0 and off > 0
    # What GRO is for, by counts rather than time: with it A gets the same bytes in
    # several times fewer frames (B sends 1448-byte segments); without it, none
    # larger than one segment.
    per_frame = {k: irqs[k][1] / frames[k] for k in (True, False)}
    record_measurement("gro.on_bytes_per_frame", per_frame[True])
    record_measurement("gro.off_bytes_per_frame", per_frame[False])
    assert per_frame[False] <= 1514, per_frame
    assert per_frame[True] >= 3 * per_frame[False], per_frame

"""gsonet as a Xen netback (issue 12) on the nested Xen rig (guest-tests/xen/,
harness/xen.py): `gsonet serve --xen-vif auto|domid=D,devid=N --uplink tap=xttap0`
in dom0 (tap 10.99.0.1/24), xen-netback not loaded, PV domUs with xen-netfront and
vif `script=vif-none`. A vif shows in `gsonet stats` as the port `vifD.N`.

Each test is one boot of the rig running guest-tests/xen/scenarios/gsonet.sh with
its switches; the dom0 script reports `RESULT` lines and `gsonet stats --json`
snapshots, the counters are checked here. Skips when the gsonet under test has no
`--xen-vif`.
"""

from pathlib import Path

import pytest

from harness import paths, xen
from harness.gsonet import counters_delta

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def xen_gsonet(xen_env):
    """The rig, with a gsonet under test that serves Xen vifs."""
    if not xen.gsonet_has_xen():
        pytest.skip("the gsonet under test has no `serve --xen-vif`")


def _boot(name: str, **env) -> xen.XenRun:
    return xen.XenRig(f"gsonet-{name}", xen.scenario("gsonet", **env)).run()


def _port(run: xen.XenRun, tag: str, name: str) -> dict:
    """The counters of port or uplink ``name`` in the stats snapshot ``tag``."""
    snap = run.stats.get(tag)
    assert snap is not None, f"no stats snapshot {tag} (have {list(run.stats)}): {run.log_path}"
    for group in snap.values():
        if isinstance(group, list):
            for entry in group:
                # uplinks are named by their spec (tap=NAME)
                if isinstance(entry, dict) and entry.get("name") in (name, f"tap={name}"):
                    return entry.get("stats", entry)
    raise AssertionError(f"no {name} in stats {tag}: {snap}")


def _uplink(run: xen.XenRun, tag: str) -> dict:
    return _port(run, tag, "xttap0")


def _vif(run: xen.XenRun, tag: str, domid_key: str = "gsonet.domid1") -> dict:
    return _port(run, tag, f"vif{run.results[domid_key]}.0")


def _vif_queues(run: xen.XenRun, tag: str, domid_key: str = "gsonet.domid1") -> list[dict]:
    """The per-queue counters (`queues` of the port entry) of the vif in snapshot
    ``tag``."""
    name = f"vif{run.results[domid_key]}.0"
    snap = run.stats.get(tag)
    assert snap is not None, f"no stats snapshot {tag}: {run.log_path}"
    for entry in snap.get("ports", []):
        if entry.get("name") == name:
            return entry.get("queues", [])
    raise AssertionError(f"no {name} in stats {tag}: {snap}")


def _delta(run: xen.XenRun, before: str, after: str, which) -> dict:
    return counters_delta(which(run, before), which(run, after))


def test_domu_ping_iperf3(xen_gsonet, record_measurement):
    """A domU on `--xen-vif auto`: ping, iperf3 both ways, the worker's priority;
    TSO frames cross intact in both directions (the vif's netfront takes GSO:
    gso_passed on the vif; the domU sends frames > 1514 bytes, passed intact to the
    tap); 8 MiB md5-checked each way through buffers granted to dom0 itself."""
    run = _boot("basic", XT_SECONDS=3, XT_MD5_MIB=8)
    assert run.results["gsonet.ping"] == "ok", run.log_path
    # The copy buffers are granted to dom0 itself (the tap queue's arena, the vif's
    # TX buffer), and data crosses them intact both ways.
    assert int(run.results["gsonet.granted_maps"]) >= 2, (run.results, run.log_path)
    assert "gsonet.granted_refused" not in run.results, run.log_path
    assert run.results.get("gsonet.md5_to_domu") == "ok", run.log_path
    assert run.results.get("gsonet.md5_from_domu") == "ok", run.log_path
    # The vif's worker runs a little above the processes it serves (nice=, -5 by
    # default; see docs/xen.md, "The datapath").
    assert run.results.get("gsonet.worker_nice") == "-5", (run.results, run.log_path)
    down = run.number("gsonet.dom0_to_domu_mbps")
    up = run.number("gsonet.domu_to_dom0_mbps")
    record_measurement("xen.gsonet.dom0_to_domu_mbps", down)
    record_measurement("xen.gsonet.domu_to_dom0_mbps", up)
    assert down > 0.1 and up > 0.1, run.results
    to_vif = _delta(run, "start", "after_dom0_to_domu", _vif)
    assert to_vif["gso_passed"] > 0, (to_vif, run.log_path)
    assert to_vif["gso_segmented"] == 0, (to_vif, run.log_path)
    # The vif's worker reads what dom0 answers on the tap at the end of its batches
    # (the uplink's tx_polls count those reads), and the data dom0 sends then
    # reaches the domU from that read as well as from the tap's reader thread.
    tap = _delta(run, "start", "after_dom0_to_domu", _uplink)
    assert tap.get("tx_polls", 0) > 0, (tap, run.log_path)
    to_tap = _delta(run, "after_dom0_to_domu", "after_domu_to_dom0", _uplink)
    assert to_tap["gso_passed"] > 0, (to_tap, run.log_path)
    assert _vif(run, "after_domu_to_dom0")["tx_max_frame"] > 1514


def _irqs(words: str) -> dict[str, int]:
    """domu_queue_irqs' NAME=COUNT words as a dict."""
    return {k: int(v) for k, v in (w.split("=", 1) for w in words.split())}


def test_two_queue_domu(xen_gsonet, record_measurement):
    """A 2-vCPU domU on `--xen-vif auto,queues=2`: its netfront opens two queues
    (multi-queue-num-queues=2), gsonet runs a worker for each, 4 iperf3 streams
    cross both ways, 8 MiB md5-checked each way; and both queues carried traffic in
    both directions, as the domU's own interrupt counts of each queue's TX and RX
    event channels say (RX: gsonet steers each flow by its hash; TX: the netfront
    picks the queue; the run opens dozens of connections), and as gsonet's own
    per-queue counters (`queues` of the vif in `gsonet stats --json`) say."""
    run = _boot("two-queues", XT_SECONDS=3, XT_MD5_MIB=8, XT_DOMU_VCPUS=2,
                XT_VIF_OPTS=",queues=2", XT_IPERF_ARGS="-P 4")
    r = run.results
    assert r.get("gsonet.queues") == "2", (r, run.log_path)
    assert r.get("gsonet.worker_nice") == "-5 -5", (r, run.log_path)
    assert r.get("gsonet.md5_to_domu") == "ok", run.log_path
    assert r.get("gsonet.md5_from_domu") == "ok", run.log_path
    down = run.number("gsonet.dom0_to_domu_mbps")
    up = run.number("gsonet.domu_to_dom0_mbps")
    record_measurement("xen.gsonet.two_queues.dom0_to_domu_mbps", down)
    record_measurement("xen.gsonet.two_queues.domu_to_dom0_mbps", up)
    assert down > 0.1 and up > 0.1, r
    start, end = _irqs(r["gsonet.irqs_start"]), _irqs(r["gsonet.irqs_end"])
    record_measurement("xen.gsonet.two_queues.irqs", {"start": start, "end": end})
    for q in (0, 1):
        for d in ("tx", "rx"):
            name = f"vif0-q{q}-{d}"
            assert name in end, (name, end, run.log_path)
            assert end[name] > start.get(name, 0), (name, start, end, run.log_path)
    # gsonet's own counters of each queue say the same: frames from the netfront
    # (TX, the queue it picked) and to it (RX, the queue the flow hashed to) on both
    # queues, with their events; and the queues add up to the vif's totals.
    q_start, q_end = _vif_queues(run, "start"), _vif_queues(run, "after_domu_to_dom0")
    record_measurement("xen.gsonet.two_queues.queue_counters", q_end)
    assert [q["queue"] for q in q_end] == [0, 1], (q_end, run.log_path)
    before = {q["queue"]: q for q in q_start}
    for q in q_end:
        was = before.get(q["queue"], {})
        for k in ("tx_frames", "rx_frames", "tx_kicks", "rx_calls"):
            assert q[k] > was.get(k, 0), (q["queue"], k, q_start, q_end, run.log_path)
    vif = _vif(run, "after_domu_to_dom0")
    for k in ("tx_frames", "rx_frames", "tx_bytes", "rx_bytes"):
        total = sum(q[k] for q in q_end)
        # read apart from the vif's own, so a frame or a few may fall in between
        slack = 8 if k.endswith("frames") else 8 * 65536
        assert abs(total - vif[k]) <= slack, (k, total, vif[k], run.log_path)


@pytest.mark.full
def test_domu_md5_64mib(xen_gsonet):
    """64 MiB of random data each way between dom0 and a domU, md5-checked."""
    run = _boot("md5", XT_SECONDS=3, XT_MD5_MIB=64)
    assert run.results.get("gsonet.md5_to_domu") == "ok", run.log_path
    assert run.results.get("gsonet.md5_from_domu") == "ok", run.log_path


@pytest.mark.full
def test_domu_copy_buffers_not_granted(xen_gsonet):
    """gntalloc refuses gsonet's copy buffers (its limit set to one page): gsonet
    says so once in its log, copies from and into plain memory instead, and data
    still crosses intact both ways."""
    run = _boot("ungranted", XT_SECONDS=2, XT_MD5_MIB=8, XT_GNTALLOC_LIMIT=1)
    assert run.results.get("gsonet.granted_refused") == "yes", run.log_path
    assert run.results["gsonet.granted_maps"] == "0", run.results
    assert run.results.get("gsonet.md5_to_domu") == "ok", run.log_path
    assert run.results.get("gsonet.md5_from_domu") == "ok", run.log_path


@pytest.mark.full
def test_domu_offload_toggles(xen_gsonet, record_measurement):
    """`ethtool -K eth0 tso off gso off`, then `sg off`, in the domU: data still
    correct (md5 both ways) and no GSO frame from the domU reaches the tap; with
    offloads on again, GSO frames come back."""
    run = _boot("offloads", XT_SECONDS=3, XT_OFFLOADS=1)
    r = run.results
    assert r["gsonet.nooffload.tso"] == "off" and r["gsonet.nosg.sg"] == "off", r
    for key in ("nooffload.md5_from_domu", "nooffload.md5_to_domu", "nosg.md5_from_domu",
                "nosg.md5_to_domu"):
        assert r.get(f"gsonet.{key}") == "ok", (key, run.log_path)
    on = run.number("gsonet.domu_to_dom0_mbps")
    off = run.number("gsonet.nooffload.domu_to_dom0_mbps")
    record_measurement("xen.gsonet.domu_to_dom0_mbps", on)
    record_measurement("xen.gsonet.nooffload.domu_to_dom0_mbps", off)
    record_measurement("xen.gsonet.nosg.domu_to_dom0_mbps",
                       run.number("gsonet.nosg.domu_to_dom0_mbps"))
    tso_off = _delta(run, "before_tso_off", "after_tso_off", _uplink)
    assert tso_off["gso_passed"] == 0 and tso_off["gso_segmented"] == 0, tso_off
    sg_off = _delta(run, "after_tso_off", "after_sg_off", _uplink)
    assert sg_off["gso_passed"] == 0 and sg_off["gso_segmented"] == 0, sg_off
    again = _delta(run, "before_offloads_on_again", "after_offloads_on_again", _uplink)
    assert again["gso_passed"] > 0, again


@pytest.mark.full
def test_domu_destroy_create_reboot(xen_gsonet):
    """`xl destroy` + `xl create` of a domU, then the domU reboots itself: gsonet
    stays up, attaches the new vif each time (a new domid), traffic md5-checked."""
    run = _boot("lifecycle", XT_SECONDS=2, XT_RECREATE=1, XT_REBOOT=1)
    r = run.results
    assert r["gsonet.recreated_domid"] != r["gsonet.domid1"], r
    assert r["gsonet.reboot.domid"] != r["gsonet.recreated_domid"], r
    for key in ("recreate.ping", "recreate.md5_to_domu", "recreate.md5_from_domu",
                "reboot.ping", "reboot.md5_to_domu", "reboot.md5_from_domu"):
        assert r.get(f"gsonet.{key}") == "ok", (key, run.log_path)
    new_vif = _port(run, "after_reboot", f"vif{r['gsonet.reboot.domid']}.0")
    assert new_vif["rx_frames"] > 0, new_vif


def test_two_domus_tso_intact(xen_gsonet, record_measurement):
    """Two domUs, each vif named by `--xen-vif domid=D,devid=0`: domU1 -> domU2 TSO
    frames reach domU2 intact (gso_passed, never segmented); md5 domU1 -> domU2."""
    run = _boot("two", XT_SECONDS=3, XT_DOMUS=2, XT_VIF="domid", XT_MD5_MIB=8)
    record_measurement("xen.gsonet.domu_to_domu_mbps", run.number("gsonet.domu_to_domu_mbps"))
    assert run.results["gsonet.domu2_feature_gso_tcpv4"] == "1", run.results
    d = _delta(run, "before_domu_to_domu", "after_domu_to_domu",
               lambda r, t: _vif(r, t, "gsonet.domid2"))
    assert d["gso_passed"] > 0 and d["gso_segmented"] == 0, (d, run.log_path)
    assert run.results.get("gsonet.md5_domu1_to_domu2") == "ok", run.log_path


@pytest.mark.full
def test_two_domus_receiver_without_gso(xen_gsonet, record_measurement):
    """domU2's netfront says feature-gso-tcpv4=0 (set before any backend read it):
    gsonet segments domU1's TSO frames for it (gso_segmented > 0, none passed
    intact), and they still arrive correct (md5); domU2 -> domU1 stays intact."""
    run = _boot("nogso", XT_SECONDS=3, XT_DOMUS=2, XT_NOGSO2=1, XT_MD5_MIB=8)
    assert run.results["gsonet.domu2_feature_gso_tcpv4"] == "0", run.results
    record_measurement("xen.gsonet.domu_to_domu_nogso_mbps",
                       run.number("gsonet.domu_to_domu_mbps"))
    d = _delta(run, "before_domu_to_domu", "after_domu_to_domu",
               lambda r, t: _vif(r, t, "gsonet.domid2"))
    assert d["gso_segmented"] > 0 and d["gso_passed"] == 0, (d, run.log_path)
    assert d["segments_out"] > d["gso_segmented"], d
    back = _delta(run, "after_domu_to_domu", "after_domu2_to_domu1", _vif)
    assert back["gso_passed"] > 0, (back, run.log_path)
    assert run.results.get("gsonet.md5_domu1_to_domu2") == "ok", run.log_path


# What each hostile netfront case must raise on its vif (examples/xen_netfront.rs).
HOSTILE_COUNTERS = {
    "bad_grant": "xen_bad_grant",
    "too_many_slots": "xen_too_many_slots",
    "slots_mismatch": "xen_slots_mismatch",
    "past_page": "xen_slots_mismatch",
    "oversized": "xen_slots_mismatch",
    "gso_size_zero": "gso_size_zero",
    "gso_bad_type": "xen_bad_gso_type",
    "unknown_extra": "xen_bad_extra",
    "gso_without_csum_blank": "xen_gso_without_csum_blank",
    "too_short": "too_short",
    "rx_bad_grant": "xen_bad_grant",
    "ring_jump": "xen_ring_broken",
}


# The multi-queue cases: each refused (Closing, Closed, `error` saying why, never
# Connected), then two honest queues served on their own rings.
QUEUE_CASES = ["queues_too_many", "queues_zero", "queue_keys_missing", "queue_rings_shared",
               "queue_evtchn_shared", "two_queues"]


def test_malformed_netfront(xen_gsonet, record_measurement):
    """A netfront in dom0 (examples/xen_netfront.rs, on grants of dom0's own pages)
    writes each malformed TX ring of issue 12's list, floods its event channel, posts
    RX buffers it never granted and jumps its ring index: every bad packet is
    answered NETIF_RSP_ERROR and counted, good packets before and after are served,
    the vif comes back after the netfront reconnects, and an honest domU on the same
    gsonet answers every ping meanwhile and moves md5-checked data after. Then it
    asks for more queues than offered, or none, leaves a queue's keys out, shares a
    ring or an event channel between two queues: each refused with a log line; and
    two honest queues are each served."""
    prog = Path(paths.GSONET_BIN).parent / "examples" / "xen_netfront"
    if not prog.is_file():
        pytest.fail(f"{prog} missing (cargo build --release --example xen_netfront)")
    run = xen.XenRig("gsonet-hostile", xen.scenario("hostile-netfront"),
                     files={"xen_netfront": prog.read_bytes()}).run()
    cases = ["valid", "no_event", "flood", "reconnect", *HOSTILE_COUNTERS, *QUEUE_CASES]
    bad = {c: run.results.get(f"hostile.{c}") for c in cases
           if run.results.get(f"hostile.{c}") != "ok"}
    assert not bad, f"{bad}: {run.log_path}"
    refusals = int(run.results["hostile.refusal_log_lines"])
    assert refusals >= len(QUEUE_CASES) - 1, (refusals, run.log_path)
    # vif0.9 took a free auto slot, unused before: its counters are all its own.
    vif = _port(run, "after_hostile", "vif0.9")
    honest = f"vif{run.results['gsonet.domid1']}.0"
    before, after = _port(run, "before_hostile", honest), _port(run, "after_hostile", honest)
    drops = vif.get("drops", {})
    for case, counter in HOSTILE_COUNTERS.items():
        assert drops.get(counter, 0) >= 1, (case, counter, drops, run.log_path)
    # The honest domU: every ping answered while the hostile netfront ran.
    ok, lost = int(run.results["honest.pings_ok"]), int(run.results["honest.pings_lost"])
    record_measurement("xen_hostile_honest_pings", {"ok": ok, "lost": lost,
                                                    "hostile_drops": drops})
    assert ok >= 5 and lost == 0, (ok, lost, run.log_path)
    for key in ("gsonet_alive", "ping_after", "md5_to_domu", "md5_from_domu"):
        assert run.results.get(f"honest.{key}") == "ok", (key, run.log_path)
    assert after["rx_frames"] > before["rx_frames"], run.log_path


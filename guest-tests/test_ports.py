"""Ports at runtime under real guests: a port added and removed while another guest
transfers.

gsonet starts with one port (guest A) and a tap uplink. While A moves data to and
from the host (a host iperf3 client with -R, A sending, and 8 MiB md5-checked
host->guest transfers back to back on A's console), `gsonet ctl port add` makes a
second port; guest B boots on it and reaches A and the host; `gsonet ctl port del`
removes it while A still transfers. Checked: every transfer's md5 matches, the
iperf3 stream carried data after the add and after the del and never failed, B's
device saw its backend go (link down), the socket file is gone, and A's counters
went on without a reset.
"""

import json
import os
import signal
import subprocess
import threading
import time
from types import SimpleNamespace

import pytest

from harness.gsonet import Gsonet
from harness.guest import Guest
from harness.hostnet import alloc_subnet, delete_link, set_addr
from harness.iperf import iperf3_guest_server
from harness.qemu import vhost_user_netdev
from harness.transfer import transfer_host_to_guest


def _port(gs: Gsonet, id_: int) -> dict | None:
    return next((p for p in gs.stats()["ports"] if p["id"] == id_), None)


def _wait(cond, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


@pytest.fixture
def net(guest_env, tmp_path):
    n = alloc_subnet()
    ns = SimpleNamespace(host_ip=f"10.77.{n}.1", ip_a=f"10.77.{n}.2", ip_b=f"10.77.{n}.3",
                         tap=f"gspt{os.getpid() % 100000}")
    ns.sock_a, ns.sock_b = str(tmp_path / "a.sock"), str(tmp_path / "b.sock")
    ns.gs = Gsonet([f"socket={ns.sock_a}"], [f"tap={ns.tap}"], workdir=tmp_path,
                   name="gsonet-ports")
    ns.a = ns.b = None
    try:
        ns.gs.start()
        set_addr(ns.tap, f"{ns.host_ip}/24")
        ns.a = Guest("ports-a", vhost_user_netdev(ns.sock_a), ip=f"{ns.ip_a}/24")
        ns.a.start()
        ns.a.wait_booted()
        yield ns
    finally:
        for g in (ns.b, ns.a):
            if g is not None:
                g.shutdown()
        ns.gs.stop()
        delete_link(ns.tap)


def test_port_add_and_del_while_another_guest_transfers(net, record_measurement):
    gs, a = net.gs, net.a
    iperf3_guest_server(a)
    iperf = subprocess.Popen(["iperf3", "-c", net.ip_a, "-t", "3600", "-i", "1", "-J", "-R"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    t0 = time.monotonic()
    stop = threading.Event()
    transfers: list[tuple[float, dict]] = []
    failure: list[BaseException] = []

    def transfer_loop():
        try:
            while not stop.is_set():
                r = transfer_host_to_guest(a, net.host_ip, mib=8, timeout=300)
                transfers.append((time.monotonic(), r))
        except BaseException as e:  # noqa: BLE001 - reported below
            failure.append(e)

    xfer = threading.Thread(target=transfer_loop, daemon=True)
    try:
        xfer.start()
        _wait(lambda: transfers or failure, 300, "a first transfer")
        a_before = _port(gs, 0)["stats"]

        # A port is added while A transfers; guest B attaches and reaches A and the host.
        t_add = time.monotonic()
        added = gs.ctl("port", "add", f"socket={net.sock_b}")
        record_measurement("ports.add_ms", (time.monotonic() - t_add) * 1000)
        new_id = added["ok"]["id"]
        assert new_id == 1, added
        net.b = Guest("ports-b", vhost_user_netdev(net.sock_b), ip=f"{net.ip_b}/24")
        net.b.start()
        net.b.wait_booted()
        _wait(lambda: (_port(gs, new_id) or {}).get("connected"), 60, "B connected")
        rc, out = net.b.run(f"ping -c 3 -W 5 {net.ip_a}", timeout=60)
        assert rc == 0, out
        rc, out = net.b.run(f"ping -c 3 -W 5 {net.host_ip}", timeout=60)
        assert rc == 0, out
        n_at_del = len(transfers)

        # ... and removed while A still transfers.
        t_del = time.monotonic()
        removed = gs.ctl("port", "del", str(new_id))
        record_measurement("ports.del_ms", (time.monotonic() - t_del) * 1000)
        assert removed["ok"]["removed"] == net.sock_b, removed
        assert not os.path.exists(net.sock_b), "the removed port's socket file is gone"
        assert _port(gs, new_id) is None
        # B's QEMU saw its backend go: its device reports the link down.
        _wait(lambda: net.b.run("cat /sys/class/net/eth0/carrier")[1].strip().endswith("0"),
              30, "B's link down")
        rc, _ = net.b.run(f"ping -c 1 -W 2 {net.ip_a}", timeout=30)
        assert rc != 0, "B still reaches A through a removed port"
        _wait(lambda: len(transfers) >= n_at_del + 2 or failure, 600,
              "two more transfers after the del")
    finally:
        stop.set()
        xfer.join(timeout=600)
        iperf.send_signal(signal.SIGINT)
        out, err = iperf.communicate(timeout=60)

    assert not failure, failure
    assert transfers and all(r["ok"] for _, r in transfers), transfers
    assert any(t > t_del for t, _ in transfers), "a transfer finished after the del"
    result = json.loads(out)
    # SIGINT ends the client: that is the only error it may report.
    assert result.get("error") in (None, "interrupt - the client has terminated"), result
    intervals = [(t0 + i["sum"]["start"], i["sum"]["bytes"], i["sum"]["seconds"])
                 for i in result["intervals"]]
    assert sum(b for t, b, _ in intervals if t > t_add) > 0, "iperf3 carried data after the add"
    assert sum(b for t, b, _ in intervals if t > t_del) > 0, "iperf3 carried data after the del"
    # A's throughput before the add, while B was there, and after the del (figures only).
    for key, lo, hi in (("before", t0, t_add), ("during", t_add, t_del),
                        ("after", t_del, float("inf"))):
        part = [(b, secs) for t, b, secs in intervals if lo <= t < hi]
        if part:
            gbps = sum(b for b, _ in part) * 8 / sum(secs for _, secs in part) / 1e9
            record_measurement(f"ports.a_gbps_{key}", gbps)
    a_after = _port(gs, 0)["stats"]
    for k in ("tx_frames", "rx_frames", "tx_bytes", "rx_bytes"):
        assert a_after[k] > a_before[k], (k, a_before[k], a_after[k])
    assert [p["id"] for p in gs.stats()["ports"]] == [0]

"""gsonet under the tools operators run: a real Prometheus (Debian's `prometheus`
package) scrapes `gsonet serve --metrics` every second while a guest sends with
iperf3; the rate Prometheus computes must match what `gsonet stats` counted over the
same seconds, and `promtool check metrics` must find nothing to lint.

Skips without root/QEMU (conftest) or without the prometheus binaries (setup.sh
installs them).
"""

import json
import os
import shutil
import socket
import subprocess
import threading
import time
import urllib.parse
import urllib.request

import pytest

from harness.gsonet import Gsonet
from harness.guest import Guest
from harness.hostnet import alloc_subnet, delete_link, set_addr
from harness.iperf import iperf3_guest_server, iperf3_host_client
from harness.paths import open_log
from harness.process import stop
from harness.qemu import vhost_user_netdev


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 5) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


@pytest.fixture(scope="module")
def monitored(guest_env, tmp_path_factory):
    """gsonet (one port, a tap uplink, --metrics), a guest on the port, and a
    Prometheus scraping gsonet every second. Namespace: gs, guest, metrics, prom,
    host_ip, guest_ip."""
    for tool in ("prometheus", "promtool"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} not installed (run scripts/setup.sh)")
    n = alloc_subnet()
    work = tmp_path_factory.mktemp("operations")
    tap = f"gsnop{os.getpid() % 100000}"
    sock = str(work / "vm1.sock")
    metrics = f"127.0.0.1:{_free_port()}"
    prom_addr = f"127.0.0.1:{_free_port()}"
    gs = Gsonet([f"socket={sock}"], [f"tap={tap}"], workdir=work, name="gsonet-ops",
                extra=["--metrics", metrics])
    (work / "prometheus.yml").write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        "scrape_configs:\n  - job_name: gsonet\n"
        f"    static_configs:\n      - targets: ['{metrics}']\n"
    )
    g = prom = log = None
    try:
        gs.start()
        set_addr(tap, f"10.77.{n}.1/24")
        log = open_log("prometheus", ".log", None, "prometheus")
        prom = subprocess.Popen(
            ["prometheus", f"--config.file={work / 'prometheus.yml'}",
             f"--storage.tsdb.path={work / 'tsdb'}", f"--web.listen-address={prom_addr}"],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True)
        g = Guest("operations", vhost_user_netdev(sock), ip=f"10.77.{n}.2/24")
        g.start()
        g.wait_booted()
        deadline = time.monotonic() + 60
        while True:
            try:
                if "Ready" in _get(f"http://{prom_addr}/-/ready"):
                    break
            except OSError:
                pass
            assert prom.poll() is None, "prometheus exited (see results/guest-logs)"
            assert time.monotonic() < deadline, "prometheus not ready after 60 s"
            time.sleep(0.2)
        yield type("NS", (), dict(gs=gs, guest=g, metrics=metrics, prom=prom_addr,
                                  host_ip=f"10.77.{n}.1", guest_ip=f"10.77.{n}.2"))
    finally:
        if g is not None:
            g.shutdown()
        stop(prom)
        if log is not None:
            log.close()
        gs.stop()
        delete_link(tap)


def _query(prom: str, expr: str, at: float | None = None) -> list:
    q = {"query": expr}
    if at is not None:
        q["time"] = f"{at:.3f}"
    r = json.loads(_get(f"http://{prom}/api/v1/query?" + urllib.parse.urlencode(q)))
    assert r["status"] == "success", r
    return r["data"]["result"]


def test_promtool_finds_nothing_to_lint(monitored):
    text = _get(f"http://{monitored.metrics}/metrics")
    assert "gsonet_tx_bytes_total" in text
    p = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True,
                       text=True, timeout=30)
    assert p.returncode == 0 and not p.stdout.strip() and not p.stderr.strip(), \
        f"rc={p.returncode}\n{p.stdout}\n{p.stderr}"


def test_prometheus_rate_matches_gsonet_stats(monitored, record_measurement):
    ns = monitored
    # Prometheus scrapes gsonet and sees the guest.
    deadline = time.monotonic() + 30
    while not _query(ns.prom, 'gsonet_port_connected{kind="port",id="0"} == 1'):
        assert time.monotonic() < deadline, _get(f"http://{ns.prom}/api/v1/targets")
        time.sleep(0.5)
    info = _query(ns.prom, "gsonet_port_features_info")
    assert info and "tso4" in info[0]["metric"]["guest_tx"], info

    iperf3_guest_server(ns.guest)
    result = {}
    sender = threading.Thread(target=lambda: result.update(
        gbps=iperf3_host_client(ns.guest_ip, seconds=12, reverse=True)))
    sender.start()
    try:
        time.sleep(3)  # past iperf3's start
        s0, t0 = ns.gs.port_stats(0)["stats"]["tx_bytes"], time.time()
        time.sleep(6)
        s1, t1 = ns.gs.port_stats(0)["stats"]["tx_bytes"], time.time()
    finally:
        sender.join()
    stats_rate = (s1 - s0) / (t1 - t0)
    assert stats_rate > 0
    # What Prometheus computed over the same window from its own 1 s scrapes.
    window = max(int(round(t1 - t0)), 2)
    r = _query(ns.prom, f'rate(gsonet_tx_bytes_total{{kind="port",id="0"}}[{window}s])', at=t1)
    assert r, "no rate: " + _get(f"http://{ns.prom}/api/v1/targets")
    prom_rate = float(r[0]["value"][1])
    record_measurement("operations.stats_tx_bytes_per_s", round(stats_rate))
    record_measurement("operations.prometheus_rate_tx_bytes_per_s", round(prom_rate))
    assert prom_rate > 0
    # Scrape times and the window's edges differ by up to a scrape interval.
    assert abs(prom_rate - stats_rate) <= 0.25 * stats_rate, (prom_rate, stats_rate)
    # The uplink delivered what the guest sent: its rx rate is of the same size.
    up = _query(ns.prom, f'rate(gsonet_rx_bytes_total{{kind="uplink"}}[{window}s])', at=t1)
    assert up and float(up[0]["value"][1]) > 0.5 * stats_rate, up
    assert result.get("gbps", 0) > 0


def test_grafana_dashboard_queries_what_gsonet_exports(monitored):
    """Every query of contrib/grafana/gsonet-dashboard.json is valid PromQL for this
    Prometheus and names only metrics gsonet serves."""
    import re
    from pathlib import Path

    board = json.loads((Path(__file__).parent.parent / "contrib/grafana/gsonet-dashboard.json")
                       .read_text())
    exported = set(re.findall(r"^(gsonet_\w+)", _get(f"http://{monitored.metrics}/metrics"),
                              re.M))
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 8
    for e in exprs:
        names = set(re.findall(r"gsonet_\w+", e))
        assert names and names <= exported, (e, names - exported)
        q = e.replace("$__rate_interval", "1m").replace("$instance", ".*")
        _query(monitored.prom, q)

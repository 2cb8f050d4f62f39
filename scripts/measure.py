#!/usr/bin/env python3
"""iperf3 throughput of gsonet next to QEMU's built-in virtio-net (and DPDK testpmd):
the one measurement behind `make demo` (scripts/demo.sh) and `make bench` (bench.py)."""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "guest-tests"))

from harness import paths  # noqa: E402
from harness.backends import BACKENDS, BASELINE, LABEL, TOPOLOGIES, Setup  # noqa: E402

CASES = {"host": ["g2h", "h2g"], "g2g": ["g2g"]}
CASE_LABEL = {"g2h": "guest->host", "h2g": "host->guest", "g2g": "guest->guest"}
OFFLOADS = {"on": [True], "off": [False], "both": [True, False]}

EPILOG = """\
Topologies and backends:
  host (guest->host, host->guest; one guest, the host end on a tap):
    gsonet     gsonet serve --port socket=S --uplink tap=T
    qemu-tap   -netdev tap (QEMU's built-in virtio-net)
    dpdk       dpdk-testpmd net_vhost + net_tap, csum engine + tap TSO
  g2g (guest->guest, two guests):
    gsonet     gsonet serve --port socket=S0 --port socket=S1
    qemu-tap   two -netdev tap on a Linux bridge
    dpdk       dpdk-testpmd with two net_vhost ports, io forwarding

Offloads: "on" is the guests' default, "off" `ethtool -K eth0 tso off gso off` in every
guest. Rounds are interleaved (A B C A B C ...): round r sets up and measures every
backend before round r+1 starts, so slow drift of a noisy machine hits all backends
alike. A backend that fails is reported n/a with the reason and does not stop the others.

  sudo scripts/measure.py                                     # gsonet vs QEMU tap, 3 s x 1
  sudo scripts/measure.py --backends gsonet,qemu-tap,dpdk --topologies host,g2g \\
      --offloads both --seconds 10 --repeats 3 --out results/mine
"""


def log(msg: str) -> None:
    print(f"[measure] {msg}", file=sys.stderr, flush=True)


def _why(e: BaseException) -> str:
    return f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"


def key(case: str, on: bool, backend: str) -> str:
    return f"{case}|{'on' if on else 'off'}|{backend}"


def run(args) -> dict:
    """Every round: every topology, every backend set up, measured (each offload state,
    each direction) and torn down. Returns {"runs": {key: [Gbit/s...]}, "errors": {key:
    reason}, "commands": {...}, "gsonet_stats": {...}}."""
    res: dict = {"runs": {}, "errors": {}, "commands": {}, "gsonet_stats": {}}
    logs = args.out / "logs" if args.out else None
    for r in range(args.repeats):
        for topo in args.topologies:
            for backend in args.backends:
                log(f"round {r + 1}/{args.repeats}: {backend} {topo}")
                with tempfile.TemporaryDirectory(prefix="gsonet-measure-") as tmp:
                    try:
                        with Setup(backend, topo, Path(tmp), logs) as s:
                            res["commands"][f"{backend}|{topo}"] = s.commands
                            _measure_setup(s, args, res)
                            if s.gsonet is not None:
                                # drops and GSO counters explain a surprising number
                                res["gsonet_stats"][f"{backend}|{topo}|round{r + 1}"] = s.gsonet.stats()
                                if args.gsonet_stats:
                                    print(f"\ngsonet stats after round {r + 1} ({topo}):\n"
                                          f"{s.gsonet.stats_text()}", flush=True)
                    except Exception as e:  # noqa: BLE001 - one backend never stops the others
                        log(f"  {backend} {topo}: setup failed: {_why(e)}")
                        if args.verbose:
                            traceback.print_exc()
                        for case in CASES[topo]:
                            for on in OFFLOADS[args.offloads]:
                                res["errors"].setdefault(key(case, on, backend), _why(e))
    return res


def _measure_setup(s: Setup, args, res: dict) -> None:
    for on in OFFLOADS[args.offloads]:
        s.set_offloads(on)
        for case in CASES[s.topo]:
            k = key(case, on, s.backend)
            try:
                gbps = s.measure(case, args.seconds)
                res["runs"].setdefault(k, []).append(gbps)
                log(f"  {k}: {gbps:.2f} Gbit/s")
            except Exception as e:  # noqa: BLE001 - the next case may still work
                res["errors"][k] = _why(e)
                log(f"  {k}: n/a ({res['errors'][k]})")
            time.sleep(0.5)


def summarize(res: dict, args) -> list[dict]:
    """One row per (direction, offload state): each backend's median, runs and ratio
    to QEMU's built-in virtio-net from the same run, or its error."""
    rows = []
    for case in [c for t in args.topologies for c in CASES[t]]:
        for on in OFFLOADS[args.offloads]:
            row = {"case": case, "offloads": "on" if on else "tso/gso off", "backends": {}}
            base = res["runs"].get(key(case, on, BASELINE))
            base = statistics.median(base) if base else None
            for b in args.backends:
                runs = res["runs"].get(key(case, on, b))
                if runs:
                    m = statistics.median(runs)
                    row["backends"][b] = {"gbps": m, "runs": runs,
                                          "ratio": (m / base) if base else None}
                else:
                    row["backends"][b] = {"gbps": None,
                                          "error": res["errors"].get(key(case, on, b), "not run")}
            rows.append(row)
    return rows


def markdown(rows: list[dict], args) -> str:
    head = ["direction", "guest offloads"]
    for b in args.backends:
        head.append(f"{LABEL[b]} Gbit/s")
        if b != BASELINE and BASELINE in args.backends:
            head.append(f"{b} / QEMU")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    notes: dict = {}
    for row in rows:
        cells = [CASE_LABEL[row["case"]], row["offloads"]]
        for b in args.backends:
            v = row["backends"][b]
            if v["gbps"] is None:
                n = notes.setdefault(v["error"], len(notes) + 1)
                cells.append(f"n/a [{n}]")
            else:
                cells.append(f"{v['gbps']:.2f}")
            if b != BASELINE and BASELINE in args.backends:
                cells.append(f"{v['ratio']:.2f}x" if v.get("ratio") else "n/a")
        lines.append("| " + " | ".join(cells) + " |")
    for why, n in notes.items():
        lines.append(f"\n[{n}] {why}")
    return "\n".join(lines)


def _meta(args, stamp: str, wall: float) -> dict:
    qemu_ver = subprocess.run([paths.QEMU, "--version"], capture_output=True, text=True).stdout
    return {
        "timestamp": stamp,
        "seconds": args.seconds,
        "repeats": args.repeats,
        "wall_seconds": round(wall, 1),
        "host": platform.node(),
        "kernel": platform.release(),
        "cpus": os.cpu_count(),
        "qemu": qemu_ver.splitlines()[0] if qemu_ver else None,
        "guest": "TCG, 1 vCPU, -cpu qemu64, 512 MiB, 6.12 kernel, rx/tx rings 1024 "
                 "(tx 256 on QEMU's tap backend)",
        "offloads_off": "ethtool -K eth0 tso off gso off (in every guest)",
        "iperf3": "TCP, one stream, server in the receiving-side guest or guest A's peer; "
                  "guest->host uses -R",
        "loadavg": os.getloadavg(),
    }


def parse_args(argv: list[str] | None = None, description: str = __doc__,
               **defaults) -> argparse.Namespace:
    """The command line of measure.py; bench.py gives its own description and defaults."""
    ap = argparse.ArgumentParser(description=" ".join(description.split()), epilog=EPILOG,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backends", default="gsonet,qemu-tap",
                    help=f"comma-separated subset of {','.join(BACKENDS)}")
    ap.add_argument("--topologies", default="host",
                    help="host (guest<->host), g2g (guest<->guest), comma-separated")
    ap.add_argument("--offloads", choices=sorted(OFFLOADS), default="on",
                    help="guest TSO/GSO on, off, or both in turn")
    ap.add_argument("--seconds", type=float, default=3, help="per iperf3 run")
    ap.add_argument("--repeats", type=int, default=1, help="rounds (medians are reported)")
    ap.add_argument("--out", type=Path, default=None,
                    help="write results.json, table.md and the logs there")
    ap.add_argument("--gsonet-stats", action="store_true",
                    help="print `gsonet stats` after each gsonet round")
    ap.add_argument("-v", "--verbose", action="store_true")
    ap.set_defaults(**defaults)
    args = ap.parse_args(argv)
    args.backends = [b for b in args.backends.split(",") if b]
    args.topologies = [t for t in args.topologies.split(",") if t]
    for b in args.backends:
        if b not in BACKENDS:
            ap.error(f"unknown backend {b}")
    for t in args.topologies:
        if t not in TOPOLOGIES:
            ap.error(f"unknown topology {t}")
    return args


def measure(args) -> list[dict]:
    """Runs the measurement, prints the table, writes results.json and table.md to
    ``args.out`` (when set); returns the summary rows."""
    if os.geteuid() != 0:
        sys.exit("measuring needs root (taps, bridges, QEMU networking)")
    if not paths.image_ready():
        paths.build_image()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    t0 = time.monotonic()
    res = run(args)
    rows = summarize(res, args)
    table = markdown(rows, args)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(
            {"meta": _meta(args, stamp, time.monotonic() - t0), "rows": rows,
             "runs": res["runs"], "errors": res["errors"], "commands": res["commands"],
             "gsonet_stats": res["gsonet_stats"]}, indent=2) + "\n")
        (args.out / "table.md").write_text(table + "\n")
    print(f"\niperf3 TCP, {args.seconds:g} s per test, median of {args.repeats}; "
          f"ratio = backend / QEMU built-in, same run\n")
    print(table)
    if args.out:
        print(f"\nresults: {args.out}/results.json, table.md, logs/")
    return rows


if __name__ == "__main__":
    measure(parse_args())

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
from harness.hostprof import BUCKETS as HOST_BUCKETS, available as perf_available  # noqa: E402
from harness.backends import BACKENDS, BASELINE, TOPOLOGIES, Setup, known, label  # noqa: E402

CASES = {"host": ["g2h", "h2g"], "g2g": ["g2g"], "g2g-soft": ["g2g-soft"],
         "multihost": ["multihost"]}
CASE_LABEL = {"g2h": "guest->host", "h2g": "host->guest", "g2g": "guest->guest",
              "g2g-soft": "guest->guest, receiver without guest TSO",
              "multihost": "guest->guest across two hosts (EVPN-VXLAN)"}
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
  g2g-soft (guest->guest, the receiver's device with guest_tso4=off,guest_tso6=off):
    the same set-ups; the sender's TSO frames are segmented by gsonet, by the kernel
    (bridge to a tap whose guest takes no TSO) or by testpmd
  multihost (guest->guest across two hosts of an EVPN-VXLAN fabric: network namespaces,
  each with a bridge, a VXLAN device and FRR; docs/multihost.md; guest MTU 1450):
    gsonet     one gsonet per host (in its namespace), its tap in the host's bridge
    qemu-tap   QEMU in each host's namespace, its tap in the bridge

gsonet:K=V+K=V is gsonet with those port options, measured next to the defaults in
the same run (e.g. --backends gsonet,gsonet:tx_poll_us=200,qemu-tap).

Offloads: "on" is the guests' default, "off" `ethtool -K eth0 tso off gso off` in every
guest. Rounds are interleaved (A B C A B C ...): round r sets up and measures every
backend before round r+1 starts, so slow drift of a noisy machine hits all backends
alike. A backend that fails is reported n/a with the reason and does not stop the others.

  sudo scripts/measure.py                                     # gsonet vs QEMU tap, 3 s x 1
  sudo scripts/measure.py --backends gsonet,qemu-tap,dpdk --topologies host,g2g \\
      --offloads both --seconds 10 --repeats 3 --out results/mine
"""


# --brief: the detail lines go to this file (OUT/measure.log), the console gets one
# progress line per set-up and the summary.
_LOG_FILE = None
_BRIEF = False


def log(msg: str) -> None:
    if _LOG_FILE is not None:
        _LOG_FILE.write(f"[measure] {msg}\n")
        _LOG_FILE.flush()
    if not _BRIEF:
        print(f"[measure] {msg}", file=sys.stderr, flush=True)


def progress(msg: str) -> None:
    """A progress line, on the console in --brief mode too."""
    if _LOG_FILE is not None:
        _LOG_FILE.write(f"[measure] {msg}\n")
        _LOG_FILE.flush()
    print(f"[measure] {msg}", file=sys.stderr if not _BRIEF else sys.stdout, flush=True)


def _left(done: list[float], remaining: int) -> str:
    if not done:
        return "first set-up, timing it"
    secs = sum(done) / len(done) * remaining
    return f"about {secs / 60:.0f} min left" if secs >= 90 else f"about {secs:.0f} s left"


def _why(e: BaseException) -> str:
    return f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"


def key(case: str, on: bool, backend: str) -> str:
    return f"{case}|{'on' if on else 'off'}|{backend}"


def run(args) -> dict:
    """Every round: every topology, every backend set up, measured (each offload state,
    each direction) and torn down. Returns {"runs": {key: [Gbit/s...]}, "errors": {key:
    reason}, "commands": {...}, "gsonet_stats": {...}}."""
    res: dict = {"runs": {}, "cost": {}, "latency": {}, "errors": {}, "commands": {},
                 "gsonet_stats": {}}
    logs = args.out / "logs" if args.out else None
    total = args.repeats * len(args.topologies) * len(args.backends)
    took: list[float] = []
    for r in range(args.repeats):
        for topo in args.topologies:
            for backend in args.backends:
                t_setup = time.monotonic()
                progress(f"round {r + 1}/{args.repeats} · {label(backend)} · {TOPO_LABEL.get(topo, topo)} "
                         f"({_left(took, total - len(took))})")
                with tempfile.TemporaryDirectory(prefix="gsonet-measure-") as tmp:
                    try:
                        with Setup(backend, topo, Path(tmp), logs) as s:
                            res["commands"][f"{backend}|{topo}"] = s.commands
                            _measure_setup(s, args, res)
                            if s.gsonet is not None:
                                # drops and GSO counters explain a surprising number
                                res["gsonet_stats"][f"{backend}|{topo}|round{r + 1}"] = s.gsonet.stats()
                                if args.gsonet_stats:
                                    text = (f"\ngsonet stats after round {r + 1} ({topo}):\n"
                                            f"{s.gsonet.stats_text()}")
                                    if _BRIEF and not args.verbose:
                                        log(text)
                                    else:
                                        print(text, flush=True)
                    except Exception as e:  # noqa: BLE001 - one backend never stops the others
                        log(f"  {backend} {topo}: setup failed: {_why(e)}")
                        if args.verbose:
                            traceback.print_exc()
                        for case in CASES[topo]:
                            for on in OFFLOADS[args.offloads]:
                                res["errors"].setdefault(key(case, on, backend), _why(e))
                took.append(time.monotonic() - t_setup)
    return res


def _measure_setup(s: Setup, args, res: dict) -> None:
    if args.latency:
        # the guests' default offloads (on)
        k = f"{s.topo}|{s.backend}"
        try:
            lat = s.latency(args.latency)
            res["latency"].setdefault(k, []).append(lat)
            log(f"  {k} latency: {lat}")
        except Exception as e:  # noqa: BLE001 - throughput is still worth measuring
            res["errors"][f"latency|{k}"] = _why(e)
            log(f"  {k} latency: n/a ({_why(e)})")
    for on in OFFLOADS[args.offloads]:
        s.set_offloads(on)
        for case in CASES[s.topo]:
            k = key(case, on, s.backend)
            try:
                gbps, per_gb = s.measure(case, args.seconds, profile=args.host_profile)
                res["runs"].setdefault(k, []).append(gbps)
                res["cost"].setdefault(k, []).append(per_gb)
                log(f"  {k}: {gbps:.2f} Gbit/s; per GB: {per_gb}")
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
                                          "ratio": (m / base) if base else None,
                                          "per_gb": median_cost(res["cost"].get(key(case, on, b), []))}
                else:
                    row["backends"][b] = {"gbps": None,
                                          "error": res["errors"].get(key(case, on, b), "not run")}
            rows.append(row)
    return rows


def median_cost(costs: list):
    """Field-wise median of per_gb dicts (harness.cost.per_gb) of the repeats."""
    costs = [c for c in costs if c is not None]
    if not costs:
        return None
    first = costs[0]
    if isinstance(first, dict):
        return {k: median_cost([c.get(k) for c in costs if isinstance(c, dict)]) for k in first}
    if isinstance(first, list):
        return [median_cost([c[i] for c in costs if isinstance(c, list) and len(c) > i])
                for i in range(len(first))]
    return statistics.median(costs)


def _k(v) -> str:
    if v is None:
        return "-"
    return f"{v / 1000:.1f}k" if abs(v) >= 1000 else f"{v:.0f}"


def cost_markdown(rows: list[dict], args) -> str:
    """The per-GB table: what each GB moved cost the guests (interrupts, kicks), gsonet
    (kick wake-ups, calls) and the host (CPU seconds), medians of the repeats."""
    head = ["direction", "guest offloads", "backend", "Gbit/s",
            "guest frames tx/rx per GB", "guest irqs in/out per GB", "guest kicks tx/rx per GB",
            "guest vCPU s per GB: user/sys/irq+softirq/idle",
            "gsonet kick wake-ups tx/rx, calls tx/rx per GB", "CPU s per GB: gsonet / QEMU / whole host"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        for b in args.backends:
            v = row["backends"][b]
            c = v.get("per_gb")
            if v["gbps"] is None or not c or not c.get("guests"):
                continue
            names = "AB" if len(c["guests"]) > 1 else "A"
            irqs = " · ".join(f"{n} {_k(g['irq_in'] + g.get('irq_shared', 0))}/{_k(g['irq_out'])}"
                              for n, g in zip(names, c["guests"]))
            kicks = " · ".join(f"{n} {_k(g['kicks_tx'])}/{_k(g['kicks_rx'])}"
                               for n, g in zip(names, c["guests"]))
            frames = " · ".join(f"{n} {_k(g.get('frames_tx'))}/{_k(g.get('frames_rx'))}"
                                for n, g in zip(names, c["guests"]))
            vcpu = " · ".join(
                f"{n} {g['cpu_user']:.2f}/{g['cpu_system']:.2f}/"
                f"{g['cpu_irq'] + g['cpu_softirq']:.2f}/{g['cpu_idle']:.2f}"
                for n, g in zip(names, c["guests"]) if "cpu_user" in g)
            gs = c.get("gsonet")
            gsc = (f"{_k(gs['tx_kicks'])}/{_k(gs['rx_kicks'])}, {_k(gs['tx_calls'])}/"
                   f"{_k(gs['rx_calls'])}" if gs else "-")
            cpu = c.get("cpu_s", {})
            qemu = sum(x for k, x in cpu.items() if k.startswith("qemu"))
            g_cpu = f"{cpu['gsonet']:.2f}" if "gsonet" in cpu else "-"
            host = f"{cpu['host']:.2f}" if "host" in cpu else "-"
            lines.append("| " + " | ".join([
                CASE_LABEL[row["case"]], row["offloads"], label(b), f"{v['gbps']:.2f}",
                frames, irqs, kicks, vcpu or "-", gsc, f"{g_cpu} / {qemu:.2f} / {host}"]) + " |")
    return "\n".join(lines)


def host_split_markdown(rows: list[dict], args) -> str:
    """The host's busy CPU seconds per GB (all its CPUs, /proc/stat), split by a
    host-wide `perf` sample into the guests' QEMU processes (user space: the guest's
    code under TCG and the device models; host kernel), the backend's own process and
    the rest. Medians of the repeats."""
    head = ["direction", "guest offloads", "backend", "Gbit/s", "host busy s per GB",
            "QEMU user (guests under TCG)", "QEMU in host kernel", "backend user",
            "backend in host kernel", "other"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        for b in args.backends:
            v = row["backends"][b]
            c = v.get("per_gb") or {}
            split = c.get("host_split")
            if v["gbps"] is None or not split:
                continue
            lines.append("| " + " | ".join(
                [CASE_LABEL[row["case"]], row["offloads"], label(b), f"{v['gbps']:.2f}",
                 f"{c['cpu_s']['host']:.2f}"]
                + [f"{split[k]:.2f}" for k in HOST_BUCKETS]) + " |")
    return "\n".join(lines)


TOPO_LABEL = {"host": "guest<->host", "g2g": "guest<->guest",
              "g2g-soft": "guest<->guest, receiver without guest TSO",
              "multihost": "guest<->guest across two hosts (EVPN-VXLAN)"}


def latency_markdown(res: dict, args) -> str:
    """Request/response latency per path and backend, medians of the repeats, with the
    p50 ratio to QEMU's built-in virtio-net (below 1 is faster)."""
    head = ["path", "backend", "p50 µs", "p90 µs", "p99 µs", "p50 / QEMU",
            "host context switches per round trip"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for topo in args.topologies:
        base = median_cost(res["latency"].get(f"{topo}|{BASELINE}", []))
        for b in args.backends:
            k = f"{topo}|{b}"
            lat = median_cost(res["latency"].get(k, []))
            if not lat:
                why = res["errors"].get(f"latency|{k}", "not run")
                lines.append(f"| {TOPO_LABEL[topo]} | {label(b)} | n/a | | | {why} | |")
                continue
            ratio = f"{lat['p50_us'] / base['p50_us']:.2f}x" if base else "n/a"
            sw = lat.get("host_ctxt_per_rt")
            lines.append(f"| {TOPO_LABEL[topo]} | {label(b)} | {lat['p50_us']:.0f} | "
                         f"{lat['p90_us']:.0f} | {lat['p99_us']:.0f} | {ratio} | "
                         f"{'-' if sw is None else f'{sw:.1f}'} |")
    return "\n".join(lines)


def markdown(rows: list[dict], args) -> str:
    head = ["direction", "guest offloads"]
    for b in args.backends:
        head.append(f"{label(b)} Gbit/s")
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
                    help=f"comma-separated subset of {','.join(BACKENDS)}; gsonet:K=V+K=V "
                         "is gsonet with port options (e.g. gsonet:tx_poll_us=100)")
    ap.add_argument("--topologies", default="host",
                    help="host (guest<->host), g2g (guest<->guest), g2g-soft (receiver "
                         "without guest TSO), multihost (guest<->guest across two hosts "
                         "of an EVPN-VXLAN fabric; gsonet and qemu-tap), comma-separated")
    ap.add_argument("--offloads", choices=sorted(OFFLOADS), default="on",
                    help="guest TSO/GSO on, off, or both in turn")
    ap.add_argument("--seconds", type=float, default=3, help="per iperf3 run")
    ap.add_argument("--repeats", type=int, default=1, help="rounds (medians are reported)")
    ap.add_argument("--out", type=Path, default=None,
                    help="write results.json, table.md and the logs there")
    ap.add_argument("--latency", type=int, default=2000, metavar="N",
                    help="round trips of the 1-byte TCP latency test per setup (0: skip)")
    ap.add_argument("--gsonet-stats", action="store_true",
                    help="print `gsonet stats` after each gsonet round")
    ap.add_argument("--host-profile", action="store_true",
                    help="sample every host CPU with `perf record -a` during each run and "
                         "split the host's busy CPU seconds per GB by process and code")
    ap.add_argument("--brief", action="store_true",
                    help="(make demo) one progress line per set-up, then the throughput table, "
                         "the latency line and a chart; the detail (per GB, latency "
                         "percentiles, gsonet stats) goes to OUT/measure.log and OUT/table.md")
    ap.add_argument("-v", "--verbose", action="store_true",
                    help="with --brief: the detail on the console too")
    ap.set_defaults(**defaults)
    args = ap.parse_args(argv)
    # "+" joins the port options of one gsonet variant ("," separates backends)
    args.backends = [b.replace("+", ",") for b in args.backends.split(",") if b]
    args.topologies = [t for t in args.topologies.split(",") if t]
    for b in args.backends:
        if not known(b):
            ap.error(f"unknown backend {b} (one of {', '.join(BACKENDS)}, or gsonet:K=V,...)")
    for t in args.topologies:
        if t not in TOPOLOGIES:
            ap.error(f"unknown topology {t}")
    if args.host_profile and not perf_available():
        ap.error("--host-profile needs perf (Debian's linux-perf)")
    return args


def _chart(rows: list[dict], args) -> str:
    """The bar chart of make bench for these rows: 'chart: PATH' or why there is none."""
    import bench  # noqa: PLC0415 - bench imports this module
    path = args.out / "throughput.png"
    try:
        why = bench.chart(rows, args, path)
    except Exception as e:  # noqa: BLE001 - the table is the result; the chart is extra
        why = _why(e)
    return f"chart: {path}" if why is None else f"no chart: {why}"


def latency_line(res: dict, args) -> str:
    """One line: each backend's median p50 round trip on the first topology, and its
    ratio to QEMU's built-in virtio-net."""
    topo = args.topologies[0]
    base = median_cost(res["latency"].get(f"{topo}|{BASELINE}", []))
    parts = []
    for b in args.backends:
        lat = median_cost(res["latency"].get(f"{topo}|{b}", []))
        if not lat:
            parts.append(f"{label(b)} n/a")
            continue
        ratio = (f" ({lat['p50_us'] / base['p50_us']:.2f}x QEMU's)"
                 if base and b != BASELINE else "")
        parts.append(f"{label(b)} {lat['p50_us']:.0f} µs{ratio}")
    return (f"latency, 1-byte TCP round trip {TOPO_LABEL[topo]}, p50: " + ", ".join(parts))


def measure(args) -> list[dict]:
    """Runs the measurement, prints the table, writes results.json and table.md to
    ``args.out`` (when set); returns the summary rows."""
    global _LOG_FILE, _BRIEF
    if os.geteuid() != 0:
        sys.exit("measuring needs root (taps, bridges, QEMU networking)")
    if not paths.image_ready():
        paths.build_image()
    if args.brief:
        if args.out is None:
            sys.exit("--brief needs --out (where the detail goes)")
        args.out.mkdir(parents=True, exist_ok=True)
        _LOG_FILE = open(args.out / "measure.log", "w", encoding="utf-8")
        _BRIEF = not args.verbose
    stamp = time.strftime("%Y%m%d-%H%M%S")
    t0 = time.monotonic()
    res = run(args)
    rows = summarize(res, args)
    table = markdown(rows, args)
    costs = cost_markdown(rows, args)
    latency = latency_markdown(res, args) if args.latency else ""
    split = host_split_markdown(rows, args) if args.host_profile else ""
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(
            {"meta": _meta(args, stamp, time.monotonic() - t0), "rows": rows,
             "runs": res["runs"], "cost": res["cost"], "latency": res["latency"],
             "errors": res["errors"], "commands": res["commands"],
             "gsonet_stats": res["gsonet_stats"]}, indent=2) + "\n")
        (args.out / "table.md").write_text(
            "\n\n".join(t for t in (table, costs, split, latency) if t) + "\n")
    if args.brief and not args.verbose:
        print(f"\niperf3 TCP, {args.seconds:g} s per test, median of {args.repeats}; "
              f"ratio = backend / QEMU built-in, same run\n")
        print(table)
        if args.latency:
            print("\n" + latency_line(res, args))
        print(_chart(rows, args))
        if BASELINE in args.backends and len(args.backends) > 1:
            print("ratio: a backend's Gbit/s over QEMU's built-in virtio-net's, measured in "
                  "the same run on this machine: above 1 it moved more (for latency, above 1 "
                  "is slower); TCG guests, so the ratio means something, the absolute "
                  "numbers little.")
        print(f"detail (per GB costs, latency percentiles, gsonet stats, logs): {args.out}/")
        return rows
    print(f"\niperf3 TCP, {args.seconds:g} s per test, median of {args.repeats}; "
          f"ratio = backend / QEMU built-in, same run\n")
    print(table)
    print("\nper GB moved (A = guest 0, the sender guest->guest; B = guest 1), medians; "
          "guest->host and host->guest have guest A only\n")
    print(costs)
    if split:
        print("\nthe host's busy CPU seconds per GB (all CPUs), split by a host-wide perf "
              "sample, medians\n")
        print(split)
    if args.latency:
        print(f"\nrequest/response latency: 1-byte TCP ping-pong (tcp_rr, TCP_NODELAY), "
              f"{args.latency} round trips, offloads on, medians\n")
        print(latency)
    if args.out:
        print(f"\nresults: {args.out}/results.json, table.md, logs/")
    return rows


if __name__ == "__main__":
    measure(parse_args())

#!/usr/bin/env python3
"""The capacity benchmark (`make capacity`; `make bench` runs it too): how fast a
vhost-user backend switches frames when its "guests" are fast, measured the way
DPDK's own vhost tests do. One dpdk-testpmd with two net_virtio_user ports on CPU 0
loops frames through the backend on CPU 1 (A -> backend -> B -> testpmd -> A, io
forwarding, each port's frames unicast to the other port's MAC); the frames it
receives per second are the frames the backend switched. The backends: gsonet (one
or more builds and port options, --gsonet LABEL=PATH@K=V; by default the build as it
comes and with busy_poll_us=50) and testpmd's vhost PMD (the reference),
interleaved round by round. Rows: 64 B, 1518 B, 8 KB in 4 x 2048 B segments, 64 KB
TSO frames from examples/tso_loadgen.rs; the 64 B and 1518 B rows again with 2
queues per port; and gsonet's CPU use with both frontends connected but quiet."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "guest-tests"))

from harness import capacity as cap  # noqa: E402
from harness.knobs import env_number  # noqa: E402
from harness.paths import GSONET_BIN, TESTPMD  # noqa: E402

IDLE_TARGET_PERCENT = 1.0
# numbers kept per measurement and given as medians
METRICS = ("mpps", "gbps", "cpu_share", "frontend_cpu_share", "cpu_ns_per_frame",
           "cpu_s_per_gb", "syscalls_per_kframe", "frontend_syscalls_per_kframe",
           "kicks_per_kframe", "calls_per_kframe", "notify_per_kframe",
           "others_on_backend_cpu", "steal_backend_cpu")

EPILOG = """\
  sudo python3 scripts/capacity.py                       # 2 rounds x 8 s, every row
  sudo python3 scripts/capacity.py --quick               # smoke run, about a minute
  sudo python3 scripts/capacity.py --gsonet before=/tmp/gsonet-before \\
      --gsonet after=target/release/gsonet --rows 64,1518 --rows2q ""

Rows: 64, 1518, 8k (txpkts 2048,2048,2048,2048), 64k-tso (tso_loadgen; build it with
`cargo build --release --example tso_loadgen`). The 2-queue rows (--rows2q) run with
queues=2 on every port of both frontends and backends; the frontend and the backend
still have one CPU each.
"""


def log(msg: str) -> None:
    print(f"[capacity] {msg}", file=sys.stderr, flush=True)




def parse_gsonet(specs: list[str]) -> list[tuple[str, str, str]]:
    """--gsonet [LABEL=]PATH[@K=V+K=V]: a build and the port options it runs with.
    The default is $GSONET_BIN twice: as it comes, and with busy_poll_us=50 (adaptive
    busy polling, off by default: it is the setting for fast guests with CPUs to
    spare, and this benchmark's frontends are such guests)."""
    if not specs:
        return [("gsonet", GSONET_BIN, ""), ("gsonet-busy50", GSONET_BIN, "busy_poll_us=50")]
    out = []
    for s in specs:
        s, _, opts = s.partition("@")
        label, sep, path = s.partition("=")
        if not sep:
            label, path = (Path(s).name if len(specs) > 1 else "gsonet"), s
        if label == "dpdk" or label in [lb for lb, _, _ in out]:
            raise SystemExit(f"--gsonet: label {label!r} used twice or reserved")
        out.append((label, str(Path(path).resolve()), opts.replace("+", ",")))
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split()), epilog=EPILOG,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gsonet", action="append", default=[],
                    metavar="[LABEL=]PATH[@K=V+K=V]",
                    help="a gsonet binary to measure, with port options after @ "
                         "(repeatable; default $GSONET_BIN or target/release/gsonet, "
                         "as it comes and with busy_poll_us=50)")
    ap.add_argument("--no-dpdk", action="store_true", help="leave out the DPDK reference")
    ap.add_argument("--rounds", type=int, default=int(env_number("CAPACITY_ROUNDS", 2)),
                    help="rounds over every row and backend; medians (env CAPACITY_ROUNDS, "
                         "default 2)")
    ap.add_argument("--seconds", type=float, default=env_number("CAPACITY_SECONDS", 8),
                    help="measured window per row and backend (env CAPACITY_SECONDS, "
                         "default 8)")
    ap.add_argument("--warmup", type=float, default=2.0,
                    help="seconds of traffic before the window (default 2)")
    ap.add_argument("--rows", default="64,1518,8k,64k-tso",
                    help=f"1-queue rows, a subset of {','.join(cap.ROWS)}")
    ap.add_argument("--rows2q", default="64,1518",
                    help="rows measured again with 2 queues per port ('' for none)")
    ap.add_argument("--frontend-devargs", default="",
                    help="more net_virtio_user devargs for the testpmd frontend, e.g. "
                         "packed_vq=1 (packed rings where the backend offers them: "
                         "--gsonet packed=BIN beside --gsonet split=BIN@packed=off)")
    ap.add_argument("--hugepages", action="store_true",
                    help="the testpmd frontend and the reference PMD on hugepages (2 MiB, "
                         "as DPDK deployments and hugepage-backed guests run; needs "
                         f"{cap.HUGEPAGES_NEEDED} free pages on a mounted hugetlbfs) "
                         "instead of 4 KiB pages (--no-huge)")
    ap.add_argument("--bursts", type=int, default=1,
                    help="bursts of 32 frames per port the frontend sends first "
                         "(start tx_first N; default 1)")
    ap.add_argument("--nice", type=int, default=int(env_number("CAPACITY_NICE", -10)),
                    help="nice value of the frontends and backends, so that other work on "
                         "the machine takes less of their CPUs (env CAPACITY_NICE, "
                         "default -10; 0 leaves it)")
    ap.add_argument("--idle-seconds", type=float, default=5.0,
                    help="the idle check's window (0 to skip; default 5)")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: 1 round x 2 s, 1 s warm-up, 2 s idle, 2 queues at "
                         "64 B only")
    ap.add_argument("--out", type=Path,
                    default=ROOT / "results" / f"capacity-{time.strftime('%Y%m%d-%H%M%S')}",
                    help="results.json, table.txt and logs/ go there")
    args = ap.parse_args(argv)
    if args.quick:  # what was not given on the command line
        given = {a.split("=")[0] for a in (argv if argv is not None else sys.argv[1:])}
        for opt, attr, value in (("--rounds", "rounds", 1), ("--seconds", "seconds", 2.0),
                                 ("--warmup", "warmup", 1.0),
                                 ("--idle-seconds", "idle_seconds", 2.0),
                                 ("--rows2q", "rows2q", "64")):
            if opt not in given:
                setattr(args, attr, value)
    args.rows = [r for r in args.rows.split(",") if r]
    args.rows2q = [r for r in args.rows2q.split(",") if r]
    for r in args.rows + args.rows2q:
        if r not in cap.ROWS:
            ap.error(f"unknown row {r!r} (rows: {', '.join(cap.ROWS)})")
    if any("loadgen" in cap.ROWS[r] for r in args.rows2q):
        ap.error("the tso_loadgen row has one queue only")
    args.builds = parse_gsonet(args.gsonet)
    return args


def check(args) -> None:
    if os.geteuid() != 0:
        raise SystemExit("capacity.py needs root (vhost-user sockets, taskset, perf on "
                         "other processes): run it with sudo")
    why = cap.testpmd_missing() or (cap.hugepages_missing() if args.hugepages else None)
    if why:
        raise SystemExit(why)
    for label, path, _ in args.builds:
        if not os.access(path, os.X_OK):
            raise SystemExit(f"gsonet binary {path} ({label}) missing: cargo build --release")
    if (os.cpu_count() or 1) < 2:
        raise SystemExit("needs 2 CPUs (frontend on CPU 0, backend on CPU 1)")
    if subprocess.run(["perf", "--version"], capture_output=True).returncode != 0:
        log("perf not found: system calls per frame are n/a (apt-get install linux-perf)")


def snapshot_binaries(args, into: Path) -> dict:
    """Copies of the gsonet builds and tso_loadgen as they are now, so that a rebuild
    during the run does not change what the later rounds measure; what was copied."""
    info = {}
    copied: dict[str, str] = {}
    for i, (label, path, opts) in enumerate(args.builds):
        if path not in copied:
            dst = into / f"gsonet-{label}"
            shutil.copy2(path, dst)
            copied[path] = str(dst)
        info[label] = {**file_info(path), "port_options": opts}
        args.builds[i] = (label, copied[path], opts)
    if os.access(cap.LOADGEN, os.X_OK):
        dst = into / "tso_loadgen"
        shutil.copy2(cap.LOADGEN, dst)
        info["tso_loadgen"] = file_info(cap.LOADGEN)
        cap.LOADGEN = str(dst)
    return info


def file_info(path: str) -> dict:
    st = os.stat(path)
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    return {"path": path, "sha256": digest,
            "mtime": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(st.st_mtime))}


def git_head() -> str | None:
    p = subprocess.run(["git", "-C", str(ROOT), "describe", "--always", "--dirty"],
                       capture_output=True, text=True)
    return p.stdout.strip() or None


def one(args, backend_label: str, row_name: str, queues: int, logs: Path) -> dict:
    """One measurement: the backend started, measured, stopped; errors as a result."""
    row = cap.ROWS[row_name]
    socks = cap.Sockets()
    try:
        if backend_label == "dpdk":
            be = cap.DpdkBackend(socks, queues, logs, tso="loadgen" in row)
        else:
            build = {lb: (path, opts) for lb, path, opts in args.builds}[backend_label]
            be = cap.GsonetBackend(backend_label, build[0], socks, queues, logs,
                                   opts=build[1])
        if "loadgen" in row:
            return cap.measure_loadgen(be, row, seconds=args.seconds, warmup=args.warmup,
                                       socks=socks, log_dir=logs)
        return cap.measure_testpmd(be, row, queues, seconds=args.seconds,
                                   warmup=args.warmup, bursts=args.bursts, socks=socks,
                                   log_dir=logs)
    except cap.NotBuilt as e:
        return {"error": str(e), "not_built": True}
    except cap.HarnessError as e:
        log(f"{backend_label} {row_name} q{queues}: {e}")
        return {"error": brief(e), "detail": str(e)[-3000:]}
    finally:
        socks.close()


def brief(e: Exception) -> str:
    """An error's first line and, when it goes on, its last (a log's last words)."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()] or [type(e).__name__]
    text = lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}"
    return text[:300]


def median(runs: list[dict], key: str):
    vals = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def summarise(runs: list[dict]) -> dict:
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return {"error": runs[0]["error"] if runs else "not run", "runs": len(runs)}
    out = {k: median(ok, k) for k in METRICS}
    out["runs"] = len(ok)
    # The spread: this machine's rounds fall into fast and slow modes for every
    # backend, so the medians' ratio is read beside the ratio of the best rounds.
    out["mpps_min"] = min(r["mpps"] for r in ok)
    out["mpps_max"] = max(r["mpps"] for r in ok)
    out["gbps_max"] = max(r["gbps"] for r in ok)
    drops: dict[str, int] = {}
    for r in ok:
        for reason, n in (r.get("drops") or {}).items():
            drops[reason] = drops.get(reason, 0) + n
    if drops:
        out["drops"] = drops
    return out


def fmt(v, spec: str = ".2f") -> str:
    return "n/a" if v is None else format(v, spec)


def case_label(row: str, queues: int) -> str:
    return cap.ROWS[row]["label"] + (f", {queues} queues" if queues > 1 else "")


def table(cases: list[tuple[str, int]], backends: list[str], summary: dict) -> str:
    head = ("row", "backend", "Mpps", "rounds' Mpps", "Gbit/s", "CPU %", "CPU ns/frame",
            "CPU s/GB", "syscalls/1k", "fe syscalls/1k", "kicks+calls/1k", "x DPDK",
            "best x DPDK")
    rows: list[tuple] = [head]
    errors: dict[int, str] = {}  # row index -> message, printed after the first columns
    for row, q in cases:
        ref = summary[(row, q)].get("dpdk", {})
        for b in backends:
            s = summary[(row, q)][b]
            if "error" in s:
                errors[len(rows)] = s["error"][:100]
                rows.append((case_label(row, q), b))
                continue
            ratio = s["gbps"] / ref["gbps"] if b != "dpdk" and ref.get("gbps") else None
            best = (s["gbps_max"] / ref["gbps_max"] if b != "dpdk" and ref.get("gbps_max")
                    else None)
            spread = f"{s['mpps_min']:.3f}-{s['mpps_max']:.3f}" if s["runs"] > 1 else "-"
            rows.append((case_label(row, q), b, fmt(s["mpps"], ".3f"), spread,
                         fmt(s["gbps"], ".1f"),
                         fmt(s["cpu_share"] * 100 if s["cpu_share"] is not None else None,
                             ".0f"),
                         fmt(s["cpu_ns_per_frame"], ".0f"), fmt(s["cpu_s_per_gb"], ".3f"),
                         fmt(s["syscalls_per_kframe"], ".1f"),
                         fmt(s["frontend_syscalls_per_kframe"], ".1f"),
                         "-" if b == "dpdk" else fmt(s.get("notify_per_kframe"), ".1f"),
                         "" if b == "dpdk" else fmt(ratio, ".2f"),
                         "" if b == "dpdk" else fmt(best, ".2f")))
    widths = [max(len(r[i]) for r in rows if i < len(r)) for i in range(len(head))]
    out = []
    for n, r in enumerate(rows):
        cells = [c.ljust(w) if i < 2 else c.rjust(w)
                 for i, (c, w) in enumerate(zip(r, widths))]
        if n in errors:
            cells.append(errors[n])
        out.append("  ".join(cells).rstrip())
    return "\n".join(out)


def scaling(backends: list[str], rows2q: list[str], summary: dict) -> str:
    lines = []
    for row in rows2q:
        if (row, 1) not in summary:
            continue
        parts = []
        for b in backends:
            one_q, two_q = summary[(row, 1)].get(b, {}), summary[(row, 2)].get(b, {})
            if one_q.get("mpps") and two_q.get("mpps"):
                parts.append(f"{b} {two_q['mpps'] / one_q['mpps']:.2f}x")
            else:
                parts.append(f"{b} n/a")
        lines.append(f"  {cap.ROWS[row]['label']}: " + ", ".join(parts))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    check(args)
    # SIGTERM and SIGHUP end the run like Ctrl-C (and Ctrl-C works even when started
    # with SIGINT ignored): every context unwinds and stops its processes, the socket
    # directories go, and testpmd's /var/run/dpdk/<prefix> too.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.default_int_handler)
    logs = args.out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    bin_dir = Path(tempfile.mkdtemp(prefix="gsonet-cap-bin-"))
    try:
        return run(args, logs, bin_dir)
    finally:
        shutil.rmtree(bin_dir, ignore_errors=True)


def run(args, logs: Path, bin_dir: Path) -> int:
    cap.NICE = args.nice
    cap.FRONTEND_DEVARGS = args.frontend_devargs
    cap.HUGEPAGES = args.hugepages
    binaries = snapshot_binaries(args, bin_dir)
    backends = [lb for lb, _, _ in args.builds] + ([] if args.no_dpdk else ["dpdk"])
    cases = [(r, 1) for r in args.rows] + [(r, 2) for r in args.rows2q]
    if any("loadgen" in cap.ROWS[r] for r in args.rows) and not os.access(cap.LOADGEN,
                                                                         os.X_OK):
        log(f"{cap.LOADGEN} not built: the 64 KB TSO row is skipped "
            f"({cap.LOADGEN_BUILD})")
    results: dict = {
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "host": platform.node(), "kernel": platform.release(), "git": git_head(),
        "binaries": binaries,
        "config": {"rounds": args.rounds, "seconds": args.seconds, "warmup": args.warmup,
                   "bursts": args.bursts, "nice": args.nice,
                   "frontend_devargs": args.frontend_devargs,
                   "hugepages": args.hugepages, "rows": args.rows,
                   "rows2q": args.rows2q,
                   "testpmd": TESTPMD, "frontend_cpu": cap.FRONTEND_CPU,
                   "backend_cpu": cap.BACKEND_CPU, "macs": [cap.MAC0, cap.MAC1]},
        "runs": [], "idle": {}, "summary": [],
    }
    runs: dict[tuple[str, int, str], list[dict]] = {}
    t_start = time.monotonic()
    try:
        for rnd in range(args.rounds):
            for row, q in cases:
                for b in backends:
                    log(f"round {rnd + 1}/{args.rounds}: {case_label(row, q)}, {b}")
                    res = one(args, b, row, q, logs)
                    res.update({"round": rnd, "row": row, "queues": q, "backend": b})
                    results["runs"].append(res)
                    runs.setdefault((row, q, b), []).append(res)
                    if "error" not in res:
                        log(f"  {res['mpps']:.3f} Mpps, {res['gbps']:.2f} Gbit/s, "
                            f"CPU {fmt(res['cpu_share'])}")
        if args.idle_seconds > 0:
            for label, path, opts in args.builds:
                log(f"idle check: {label}, {args.idle_seconds:g} s")
                try:
                    results["idle"][label] = cap.measure_idle(
                        label, path, seconds=args.idle_seconds, log_dir=logs, opts=opts)
                except cap.HarnessError as e:
                    results["idle"][label] = {"error": brief(e), "detail": str(e)[-3000:]}
    except KeyboardInterrupt:
        log("interrupted: processes stopped, partial results written")
        results["interrupted"] = True
    except Exception:
        results["error"] = traceback.format_exc()
        raise
    finally:
        summary = {(row, q): {b: summarise(runs.get((row, q, b), [])) for b in backends}
                   for row, q in cases}
        results["summary"] = [{"row": row, "queues": q, "backend": b, **s}
                              for (row, q), per in summary.items() for b, s in per.items()]
        results["elapsed_s"] = time.monotonic() - t_start
        (args.out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    memory = "2 MiB hugepages" if args.hugepages else "4 KiB pages"
    text = [f"capacity: median of {args.rounds} x {args.seconds:g} s "
            f"(frontend testpmd/tso_loadgen on CPU {cap.FRONTEND_CPU}, backend on CPU "
            f"{cap.BACKEND_CPU}, both at nice {args.nice}; testpmd's memory on {memory}); "
            f"per 1k = per 1000 frames switched; best x DPDK = the best rounds' ratio",
            table(cases, backends, summary)]
    if args.rows2q:
        text.append("2 queues / 1 queue (Mpps; frontend and backend still one CPU each):")
        text.append(scaling(backends, args.rows2q, summary))
    for label, idle in results["idle"].items():
        if "error" in idle:
            text.append(f"idle {label}: {idle['error']}")
        else:
            verdict = "ok" if idle["cpu_percent"] < IDLE_TARGET_PERCENT else "OVER TARGET"
            text.append(f"idle {label} (both frontends connected, quiet, "
                        f"{idle['seconds']:.1f} s): {idle['cpu_percent']:.2f} % of a CPU, "
                        f"{fmt(idle['syscalls_per_s'], '.1f')} syscalls/s "
                        f"(target < {IDLE_TARGET_PERCENT:g} %: {verdict})")
    busy = [r.get("others_on_backend_cpu") for r in results["runs"]
            if r.get("others_on_backend_cpu") is not None]
    steal = [r["steal_backend_cpu"] for r in results["runs"]
             if r.get("steal_backend_cpu") is not None]
    if busy:
        text.append(f"other processes on the backend's CPU {cap.BACKEND_CPU} during the "
                    f"windows: median {statistics.median(busy) * 100:.0f} %, max "
                    f"{max(busy) * 100:.0f} %; stolen by the hypervisor: median "
                    f"{statistics.median(steal) * 100:.0f} % (a busy-polling backend shows "
                    f"less than 100 % CPU by that much)")
    drops = [f"{b} {cap.ROWS[r]['label']} q{q}: {s['drops']}"
             for (r, q), per in summary.items() for b, s in per.items() if s.get("drops")]
    if drops:
        text.append("gsonet drops in the windows: " + "; ".join(drops))
    text.append(f"results: {args.out}/results.json")
    out = "\n".join(text)
    print(out)
    (args.out / "table.txt").write_text(out + "\n")
    return 130 if results.get("interrupted") else 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""`make bench`, Xen part: gsonet's Xen netback, Linux's kernel netback (+ a bridge)
and QEMU's userspace netback (xen-net-device), side by side in ONE boot of the nested
Xen rig (guest-tests/xen/), so the ratios compare like with like. iperf3 TCP, Mbit/s.

    sudo python3 scripts/xen_bench.py [--seconds 5] [--rounds 3]
    sudo GSONET_XEN_DOM0_VCPUS=2 python3 scripts/xen_bench.py    # the headline

Two configurations, set by the rig's dom0 vCPUs (GSONET_XEN_DOM0_VCPUS):
  1 (the rig's default, the floor): a 1-vCPU domU, one iperf3 stream;
  2 (the headline, what users run): a 2-vCPU domU (its netfront opens a queue per
    vCPU, up to the backend's maximum: gsonet's default is one per dom0 CPU, as the
    kernel netback's), 4 iperf3 streams (-P 4).
--domu-vcpus and --streams override either. Each netback's scenario runs --rounds
times in the boot, in turn (kernel, gsonet, QEMU, kernel, ...), so a drift of the
machine's load spreads over all three; the table gives each cell's median and every
round's value. Prints the ratios of the medians and dom0's CPU seconds per GB moved;
keeps results/xen-bench-<timestamp>.json and the console log (results/guest-logs/).
gsonet's rows are left out (and said so) when the binary under test has no
`serve --xen-vif`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "guest-tests"))

from harness import paths, xen  # noqa: E402

ROWS = [
    ("dom0 -> domU", "dom0_to_domu_mbps"),
    ("domU -> dom0", "domu_to_dom0_mbps"),
    ("domU -> domU", "domu_to_domu_mbps"),
]
PREFIX = {"gsonet": "gsonet", "kernel": "kernel", "qemu": "qemu"}
SCENARIO = {"kernel": "kernel-netback", "gsonet": "gsonet", "qemu": "qemu-netback"}


def fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:9.3g}"


def ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or not b else f"{a / b:8.2f}x"


def median(vals: list[float]) -> float | None:
    return statistics.median(vals) if vals else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=int, default=5, help="iperf3 seconds per run")
    ap.add_argument("--rounds", type=int, default=3, help="runs of each netback in the boot")
    ap.add_argument("--streams", type=int, default=None,
                    help="iperf3 streams (-P); default 4 with 2 dom0 vCPUs, else 1")
    ap.add_argument("--domu-vcpus", type=int, default=None,
                    help="vCPUs of each domU; default 2 with 2 dom0 vCPUs, else 1")
    ap.add_argument("--offloads", action="store_true",
                    help="also gsonet with the domU's TSO/GSO off, then SG off (round 1)")
    ap.add_argument("--timeout", type=float, default=3 * 3600,
                    help="seconds for the whole boot")
    args = ap.parse_args()
    headline = xen.DOM0_VCPUS >= 2
    streams = args.streams or (4 if headline else 1)
    vcpus = args.domu_vcpus or (2 if headline else 1)

    reason = xen.skip_reason()
    if reason:
        print(f"xen bench skipped: {reason}")
        return 0
    xen.build_rig()
    with_gsonet = xen.gsonet_has_xen()
    who = ["kernel"] + (["gsonet"] if with_gsonet else []) + ["qemu"]
    if not with_gsonet:
        print(f"note: {paths.GSONET_BIN} has no `serve --xen-vif`: gsonet rows left out")
    env = {"XT_SECONDS": args.seconds, "XT_DOMUS": 2, "XT_DOMU_VCPUS": vcpus}
    if streams > 1:
        env["XT_IPERF_ARGS"] = f"-P {streams}"
    parts = [xen.scenario(**env)]
    for r in range(1, args.rounds + 1):
        for w in who:
            head = f"export XT_ROUND={r}\n"
            if w == "gsonet":
                head += f"export XT_OFFLOADS={1 if args.offloads and r == 1 else 0}\n"
            parts.append(head + (xen.SCENARIOS / f"{SCENARIO[w]}.sh").read_text())
    script = "\n".join(parts)
    config = (f"dom0 {xen.DOM0_VCPUS} vCPU(s), domU {vcpus} vCPU(s), {streams} stream(s), "
              f"{args.rounds} round(s) of {args.seconds} s")
    run = xen.XenRig("bench", script, gsonet=with_gsonet, qemu=True,
                     timeout=args.timeout).run()

    def got(prefix: str, key: str, r: int) -> float | None:
        try:
            return float(run.results[f"{prefix}.{key}:r{r}"])
        except (KeyError, ValueError):
            return None

    def rounds(prefix: str, key: str) -> list[float]:
        return [v for r in range(1, args.rounds + 1)
                if (v := got(prefix, key, r)) is not None]

    def per_gb(prefix: str, key: str, what: str) -> list[float]:
        """CPU seconds per GB moved, per round: `what` is a measured CPU figure
        (lib.sh `measure`: dom0, gsonet, domains, dom0_xen), or dom0_own: dom0's busy
        time with its steal left out."""
        out = []
        for r in range(1, args.rounds + 1):
            mbps = got(prefix, key, r)
            if what == "dom0_own":
                busy, steal = got(prefix, f"{key}.cpu_dom0", r), got(prefix, f"{key}.cpu_steal", r)
                used = None if busy is None or steal is None else busy - steal
            else:
                used = got(prefix, f"{key}.cpu_{what}", r)
            if mbps and used is not None:
                out.append(used / (mbps * args.seconds / 8000))
        return out

    print(f"\nXen rig, one boot ({run.seconds:.0f} s): {config}; Mbit/s, "
          "median of the rounds [every round]")
    print(f"{'path':<14}{'gsonet':>10}{'kernel':>10}{'QEMU':>10}"
          f"{'g/kernel':>10}{'g/QEMU':>10}{'kernel/QEMU':>12}")
    table: dict = {"config": {"dom0_vcpus": xen.DOM0_VCPUS, "domu_vcpus": vcpus,
                              "streams": streams, "rounds": args.rounds,
                              "seconds": args.seconds}}
    for label, key in ROWS:
        vals = {w: rounds(PREFIX[w], key) for w in ("gsonet", "kernel", "qemu")}
        med = {w: median(v) for w, v in vals.items()}
        table[key] = {"rounds": vals, "median": med}
        print(f"{label:<14}{fmt(med['gsonet']):>10}{fmt(med['kernel']):>10}"
              f"{fmt(med['qemu']):>10}{ratio(med['gsonet'], med['kernel']):>10}"
              f"{ratio(med['gsonet'], med['qemu']):>10}{ratio(med['kernel'], med['qemu']):>12}")
        for w in ("gsonet", "kernel", "qemu"):
            if vals[w]:
                print(f"{'':<16}{w}: " + " ".join(f"{v:.3g}" for v in vals[w]))
    # CPU per byte: what each netback costs dom0, next to what it moves. dom0's own
    # count leaves out its steal (time Xen gave another domain while dom0 waited);
    # gsonet's threads' count cannot (dom0's kernel charges a task by a clock that
    # runs on while it waits), so it is an upper bound with 2 dom0 vCPUs. Xen's count
    # of dom0's vCPUs takes in the time Xen spends on dom0's behalf (grant copies, and
    # under TCG its own spinlocks: docs/xen.md).
    print("\ndom0 CPU seconds per GB moved, median of the rounds: dom0's own count "
          "without steal (gsonet: dom0 / gsonet's threads, steal included); "
          "Xen's count of dom0")
    print(f"{'path':<14}{'gsonet':>16}{'kernel':>10}{'QEMU':>10}{'g/kernel':>10}"
          f"{'Xen: gsonet':>13}{'kernel':>9}")
    for label, key in ROWS:
        cells, xen_cells = {}, {}
        for w in ("gsonet", "kernel", "qemu"):
            cells[w] = median(per_gb(PREFIX[w], key, "dom0_own"))
            xen_cells[w] = median(per_gb(PREFIX[w], key, "dom0_xen"))
        own = median(per_gb("gsonet", key, "gsonet"))
        table[key]["dom0_cpu_s_per_gb"] = cells
        table[key]["dom0_xen_cpu_s_per_gb"] = xen_cells
        table[key]["gsonet_cpu_s_per_gb"] = own
        g = "-" if cells["gsonet"] is None else f"{cells['gsonet']:.1f} / {own or 0:.1f}"
        print(f"{label:<14}{g:>16}{fmt(cells['kernel']):>10}{fmt(cells['qemu']):>10}"
              f"{ratio(cells['gsonet'], cells['kernel']):>10}"
              f"{fmt(xen_cells['gsonet']):>13}{fmt(xen_cells['kernel']):>9}")
    if args.offloads:
        on = got("gsonet", "domu_to_dom0_mbps", 1)
        off = got("gsonet.nooffload", "domu_to_dom0_mbps", 1)
        print(f"gsonet domU -> dom0, offloads on / `tso off gso off` (round 1): "
              f"{ratio(on, off)}")
    tag = f"d{xen.DOM0_VCPUS}u{vcpus}p{streams}"
    out = paths.REPO / "results" / f"xen-bench-{tag}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"seconds": args.seconds, "config": config, "table": table,
                               "results": run.results, "console": run.log_path},
                              indent=2) + "\n")
    print(f"\n{out}\nconsole: {run.log_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""`make bench`, Xen part: gsonet's Xen netback, Linux's kernel netback (+ a bridge)
and QEMU's userspace netback (xen-net-device), side by side in ONE boot of the nested
Xen rig (guest-tests/xen/), so the ratios compare like with like. iperf3 TCP, Mbit/s.

    sudo python3 scripts/xen_bench.py [--seconds 5]

Prints the table and the ratios; keeps results/xen-bench-<timestamp>.json and the
console log (results/guest-logs/). gsonet's rows are left out (and said so) when
the binary under test has no `serve --xen-vif`.
"""

from __future__ import annotations

import argparse
import json
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


def fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:9.3g}"


def ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or not b else f"{a / b:8.2f}x"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=int, default=5, help="iperf3 seconds per run")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds for the whole boot")
    args = ap.parse_args()

    reason = xen.skip_reason()
    if reason:
        print(f"xen bench skipped: {reason}")
        return 0
    xen.build_rig()
    with_gsonet = xen.gsonet_has_xen()
    names = ["kernel-netback"] + (["gsonet"] if with_gsonet else []) + ["qemu-netback"]
    if not with_gsonet:
        print(f"note: {paths.GSONET_BIN} has no `serve --xen-vif`: gsonet rows left out")
    script = xen.scenario(*names, XT_SECONDS=args.seconds, XT_DOMUS=2, XT_OFFLOADS=1)
    run = xen.XenRig("bench", script, gsonet=with_gsonet, qemu=True,
                     timeout=args.timeout).run()

    def get(prefix: str, key: str) -> float | None:
        try:
            return float(run.results[f"{prefix}.{key}"])
        except (KeyError, ValueError):
            return None

    print(f"\nXen rig, one boot ({run.seconds:.0f} s), iperf3 {args.seconds} s, Mbit/s")
    print(f"{'path':<16}{'gsonet':>10}{'kernel':>10}{'QEMU':>10}"
          f"{'g/kernel':>10}{'g/QEMU':>10}{'kernel/QEMU':>12}")
    table = {}
    for label, key in ROWS:
        g, k, q = get("gsonet", key), get("kernel", key), get("qemu", key)
        table[key] = {"gsonet": g, "kernel": k, "qemu": q}
        print(f"{label:<16}{fmt(g):>10}{fmt(k):>10}{fmt(q):>10}{ratio(g, k):>10}"
              f"{ratio(g, q):>10}{ratio(k, q):>12}")
    # CPU per byte: what each netback costs the machine, next to what it moves.
    print("\nCPU seconds per GB moved: dom0 / gsonet's threads (of dom0's) / all domains")
    print(f"{'path':<16}{'gsonet':>26}{'kernel':>20}{'QEMU':>20}")
    for label, key in ROWS:
        cells = []
        for prefix in ("gsonet", "kernel", "qemu"):
            mbps = get(prefix, key)
            gb = mbps * args.seconds / 8000 if mbps else None
            used = {w: get(prefix, f"{key}.cpu_{w}") for w in ("dom0", "gsonet", "domains")}
            per_gb = None
            if gb and used["dom0"] is not None and used["domains"] is not None:
                per_gb = {w: (v or 0) / gb for w, v in used.items()}
            table.setdefault(key, {})[f"{prefix}_cpu_per_gb"] = per_gb
            shown = ("dom0", "gsonet", "domains") if prefix == "gsonet" else ("dom0", "domains")
            cells.append("-" if per_gb is None
                         else " / ".join(f"{per_gb[w]:.0f}" for w in shown))
        print(f"{label:<16}{cells[0]:>26}{cells[1]:>20}{cells[2]:>20}")
    # page-table work: a PV dom0 pays a page-table switch per system call and context
    # switch, and a fault per page its processes touch anew
    print("\nper GB moved: dom0 context switches (gsonet's minor page faults)")
    print(f"{'path':<16}{'gsonet':>26}{'kernel':>20}{'QEMU':>20}")
    for label, key in ROWS:
        cells = []
        for prefix in ("gsonet", "kernel", "qemu"):
            mbps = get(prefix, key)
            gb = mbps * args.seconds / 8000 if mbps else None
            ctxt, flt = get(prefix, f"{key}.dom0_ctxt"), get(prefix, f"{key}.gsonet_minflt")
            if not gb or ctxt is None:
                cells.append("-")
                continue
            per = {"dom0_ctxt": ctxt / gb, "gsonet_minflt": (flt or 0) / gb}
            table[key][f"{prefix}_events_per_gb"] = per
            cells.append(f"{per['dom0_ctxt']:.0f}" + (f" ({per['gsonet_minflt']:.0f})"
                                                      if prefix == "gsonet" else ""))
        print(f"{label:<16}{cells[0]:>26}{cells[1]:>20}{cells[2]:>20}")
    on, off = get("gsonet", "domu_to_dom0_mbps"), get("gsonet.nooffload", "domu_to_dom0_mbps")
    if on is not None:
        print(f"gsonet domU -> dom0, offloads on / `tso off gso off`: {ratio(on, off)}")
    out = paths.REPO / "results" / f"xen-bench-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"seconds": args.seconds, "table": table,
                               "results": run.results, "console": run.log_path},
                              indent=2) + "\n")
    print(f"\n{out}\nconsole: {run.log_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

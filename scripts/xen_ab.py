#!/usr/bin/env python3
"""A/B of gsonet builds as Xen netbacks, in ONE boot of the nested Xen rig: the
variants take turns serving a fresh domU (XT rounds of each), iperf3 both ways.

    python3 scripts/xen_ab.py NAME=BINARY[:VAR=VALUE...] ... [kernel] [--rounds 2]
        [--seconds 5] [--streams N] [--domus 2] [--domu-vcpus N]

A variant may set environment variables for its gsonet (NAME=BINARY:VAR=1), and
words to append to its `--xen-vif auto` and `--uplink tap=xttap0` specs with the
pseudo-variables vif= and tap= (e.g. q1=BINARY:vif=,queues=1). The
variant `kernel` is Linux's xen-netback with the domU's vif on a bridge holding dom0's
address, taking its turns like the others: the ratio to it is measured round by
round in one boot, not once. With --domus 2, each turn boots two domUs and measures
domU 1 -> domU 2 only.

Prints Mbit/s per round and the mean ratio of each variant to the first, with dom0's
CPU seconds and context switches per GB, and for gsonet's runs the vif's frames,
notifications and events per GB (results/guest-logs/ keeps the console).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "guest-tests"))

from harness import xen  # noqa: E402
from harness.gsonet import counters_delta  # noqa: E402

# The vifs' counters shown per GB for gsonet's runs (summed over its vifs): frames
# each way, notifications gsonet sent (rx_calls: RX responses, tx_calls: TX
# responses), events it took.
VIF_COUNTERS = ("rx_frames", "tx_frames", "rx_calls", "tx_calls", "rx_kicks", "tx_kicks")


def vif_stats(snap: dict | None) -> dict | None:
    """The connected vifs' counters in one stats snapshot, summed."""
    vifs = [port["stats"] for port in (snap or {}).get("ports", [])
            if port.get("connected") and port.get("name", "").startswith("vif")]
    if not vifs:
        return None
    return {k: sum(v.get(k, 0) for v in vifs) for k in VIF_COUNTERS}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("variants", nargs="+",
                    help="NAME=BINARY[:VAR=VALUE...] or kernel; the first is the base")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seconds", type=int, default=5, help="iperf3 seconds per run")
    ap.add_argument("--streams", type=int, default=1, help="parallel TCP streams (iperf3 -P)")
    ap.add_argument("--domus", type=int, choices=(1, 2), default=1,
                    help="2: measure domU 1 -> domU 2 instead of dom0 <-> domU")
    ap.add_argument("--domu-vcpus", type=int, default=1,
                    help="vCPUs of each domU (its netfront asks for a queue per vCPU)")
    args = ap.parse_args()
    paths = ("domu_to_domu",) if args.domus == 2 else ("dom0_to_domu", "domu_to_dom0")
    variants = []
    for v in args.variants:
        if v == "kernel":
            variants.append((v, None, []))
            continue
        name, sep, rest = v.partition("=")
        path, *env = rest.split(":")
        if (not sep or not name.isidentifier() or not Path(path).is_file()
                or not all("=" in e for e in env)):
            ap.error(f"{v!r}: want NAME=BINARY[:VAR=VALUE...] with an existing binary")
        variants.append((name, path, env))
    reason = xen.skip_reason()
    if reason:
        print(f"xen A/B skipped: {reason}")
        return 1
    xen.build_rig()
    names = " ".join(n for n, _, _ in variants)
    script = xen.scenario("gsonet-ab", XT_VARIANTS=names, XT_ROUNDS=args.rounds,
                          XT_SECONDS=args.seconds, XT_DOMUS=args.domus,
                          XT_DOMU_VCPUS=args.domu_vcpus,
                          XT_IPERF_ARGS=f"-P {args.streams}" if args.streams > 1 else "")
    files: dict[str, bytes | str] = {}
    for n, p, env in variants:
        if p is None:
            continue
        # vif= and tap=: words for its specs, read by gsonet-ab.sh
        for key in ("vif", "tap"):
            words = [e.split("=", 1)[1] for e in env if e.split("=", 1)[0] == key]
            files[f"gsonet-{n}.{key}"] = "".join(words)
        env = [e for e in env if e.split("=", 1)[0] not in ("vif", "tap")]
        # /xt/gsonet-N starts the build with its environment (exec: the same pid)
        files[f"gsonet-{n}.bin"] = Path(p).read_bytes()
        files[f"gsonet-{n}"] = f"#!/bin/sh\nexec env {' '.join(env)} /xt/gsonet-{n}.bin \"$@\"\n"
    builds = [p for _, p, _ in variants if p is not None]
    if not builds:
        ap.error("at least one gsonet build (NAME=BINARY)")
    run = xen.XenRig("ab", script, gsonet_bin=builds[0], files=files,
                     timeout=600 + 200 * args.domus * args.rounds * len(variants)).run()

    def num(key: str) -> float | None:
        try:
            return float(run.results[key])
        except (KeyError, ValueError):
            return None

    print(f"\nXen rig A/B, one boot ({run.seconds:.0f} s), iperf3 {args.seconds} s,"
          f" {args.streams} stream(s)")
    means: dict[tuple[str, str], float] = {}
    for path in paths:
        print(f"\n{path}: Mbit/s per round | dom0 CPU s/GB | dom0 ctx switches/GB")
        for name, _, _ in variants:
            rates, cpu, ctxt = [], [], []
            counts: dict[str, list[float]] = {k: [] for k in VIF_COUNTERS}
            for r in range(1, args.rounds + 1):
                key = f"ab.{name}.r{r}.{path}_mbps"
                mbps = num(key)
                if mbps is None:
                    continue
                rates.append(mbps)
                gb = mbps * args.seconds / 8000
                if gb > 0:
                    cpu.append((num(f"{key}.cpu_dom0") or 0) / gb)
                    ctxt.append((num(f"{key}.dom0_ctxt") or 0) / gb)
                    first = paths.index(path)
                    a = vif_stats(run.stats.get(f"ab.{name}.r{r}.s{first}"))
                    b = vif_stats(run.stats.get(f"ab.{name}.r{r}.s{first + 1}"))
                    if a and b:
                        moved = counters_delta(a, b)
                        for k in VIF_COUNTERS:
                            counts[k].append(moved.get(k, 0) / gb)
            if not rates:
                print(f"  {name:<12} no result")
                continue
            means[(name, path)] = statistics.mean(rates)
            print(f"  {name:<12} {' '.join(f'{x:7.0f}' for x in rates)}"
                  f"   mean {means[(name, path)]:7.0f}"
                  f" | {statistics.mean(cpu):5.1f} | {statistics.mean(ctxt):8.0f}")
            if all(counts.values()):
                print("  " + " " * 12 + " per GB: " + ", ".join(
                    f"{k} {statistics.mean(v):.0f}" for k, v in counts.items()))
    base = variants[0][0]
    print()
    for name, _, _ in variants[1:]:
        cells = []
        for path in paths:
            a, b = means.get((base, path)), means.get((name, path))
            cells.append(f"{path} {b / a:.2f}x" if a and b else f"{path} -")
        print(f"{name} / {base}: " + ", ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())

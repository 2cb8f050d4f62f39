#!/usr/bin/env python3
"""gsonet's per-GB costs as a Xen netback, counted in the nested rig, for one build or
several in ONE boot: the builds take turns serving a fresh domU (tap uplink in dom0,
as scripts/xen_ab.py), --rounds turns each, iperf3 once each way per turn, and in
the last turn once more under `strace -c`.

    python3 scripts/xen_syscalls.py [--gsonet NAME=BINARY[@VIF-KEYS] ...] [--kernel]
        [--rounds 3] [--seconds 5] [--vif-options uring=off]

(e.g. --gsonet q1=target/release/gsonet@queues=1: that build with `,queues=1`
added to its `--xen-vif auto`; --kernel adds the kernel netback + bridge, untraced.)

Per direction and build, per GB moved (medians over the untraced rounds): Mbit/s,
dom0's CPU seconds without its steal, dom0's context switches, gsonet's threads'
sleeps (voluntary context switches: its wake-ups) and preemptions (involuntary),
and the vif's counters: frames each way, events gsonet sent the netfront
(`tx_calls`, `rx_calls`) and took from it (`tx_kicks`, `rx_kicks`). From the
traced run: system calls per GB by kind, its ioctls split into the events sent (the
vif's count) and grant copies (the rest), and the pages each copy moved on average.

In a PV dom0 each system call is two switches of the guest's page tables through
Xen, and each event one more trip, the costs the kernel netback does not have.
strace slows gsonet down, so the traced rates are not the bench's: read the calls
per GB there, and the untraced rounds for the rest.
"""

from __future__ import annotations

import argparse
import re
import shutil
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "guest-tests"))

from harness import paths, xen  # noqa: E402
from harness.gsonet import counters_delta  # noqa: E402

SCRIPT = r"""
. /xt/lib.sh
S=${XT_SECONDS:-5}
ip1=10.99.0.2
chmod +x /xt/strace.bin /xt/gsonet-*
domu_cfg gdomU1 $ip1 00:16:3e:99:00:12 vif-none
domu_cfg kdomU1 $ip1 00:16:3e:99:00:02 vif-xtbridge

# threads: gsonet's threads' voluntary and involuntary context switches, summed
threads() {
    cat /proc/"$GSONET_PID"/task/*/status 2>/dev/null | awk '
        /^voluntary_ctxt_switches/ {v += $2} /^nonvoluntary_ctxt_switches/ {n += $2}
        END {print v + 0, n + 0}'
}

# once TAG DIR: one untraced iperf3 run, with its costs
once() {
    local a b
    [ "$2" = domu_to_dom0 ] && R=-R || R=
    if [ -z "${GSONET_PID:-}" ]; then
        measure "$1.mbps" iperf_mbps -c $ip1 -t "$S" $R
        return
    fi
    gsonet_stats "$1.s0"
    a="$(threads)"
    measure "$1.mbps" iperf_mbps -c $ip1 -t "$S" $R
    b="$(threads)"
    gsonet_stats "$1.s1"
    set -- "$1" $a $b
    result "$1.sleeps" $(($4 - $2))
    result "$1.preempted" $(($5 - $3))
}

# traced TAG DIR: one iperf3 run with `strace -c` on gsonet's threads (counts only:
# a full trace slows it a hundredfold; the threads a `gsonet stats` starts are left
# out); its table as XT-SC TAG lines
traced() {
    local tracer t tids=""
    [ "$2" = domu_to_dom0 ] && R=-R || R=
    for t in /proc/"$GSONET_PID"/task/*; do tids="$tids -p ${t##*/}"; done
    LD_LIBRARY_PATH=/xt /xt/strace.bin -c -o /tmp/strace.out $tids 2>/dev/null &
    tracer=$!
    sleep 2
    gsonet_stats "$1.s0"
    result "$1.mbps" "$(iperf_mbps -c $ip1 -t "$S" $R)"
    gsonet_stats "$1.s1"
    kill -INT $tracer; wait $tracer
    sed "s/^/XT-SC $1 /" /tmp/strace.out
    rm -f /tmp/strace.out
}

# turn V R: variant V serves a fresh domU (the kernel netback for `kernel`) for
# round R, untraced; in the last round, gsonet's traced runs follow
turn() {
    if [ "$1" = kernel ]; then
        kernel_netback
        domu_create kdomU1
        wait_domu $ip1 300 || fail "kdomU1 does not answer through xen-netback"
    else
        cp "/xt/gsonet-$1" /xt/gsonet
        gsonet_start --xen-vif "auto$(cat "/xt/vif-$1")${XT_VIF_OPTS:+,$XT_VIF_OPTS}" \
            --uplink tap=xttap0
        domu_create gdomU1
        ip addr add 10.99.0.1/24 dev xttap0
        ip link set xttap0 up
        wait_domu $ip1 300 || fail "gdomU1 does not answer through gsonet $1"
    fi
    for dir in dom0_to_domu domu_to_dom0; do once "sc.$1.r$2.$dir" $dir; done
    if [ "$1" != kernel ] && [ "$2" = "${XT_ROUNDS:-3}" ]; then
        for dir in dom0_to_domu domu_to_dom0; do traced "sc.$1.tr.$dir" $dir; done
    fi
    teardown
}
# the variants take turns, round after round, so the machine's drift falls on each
r=1
while [ $r -le "${XT_ROUNDS:-3}" ]; do
    for v in $XT_VARIANTS; do turn "$v" $r; done
    r=$((r + 1))
done
"""

# a row of strace -c's table: % time, seconds, usecs/call, calls, [errors,] name
SC = re.compile(r"^XT-SC sc\.(\S+)\.tr\.(\S+)\s+[\d.]+\s+[\d.]+\s+\d+\s+(\d+)\s+(?:\d+\s+)?(\w+)\s*$")
PATHS = ("dom0_to_domu", "domu_to_dom0")
# The vif's counters shown per GB (summed over its queues, from the port's stats).
VIF = ("rx_frames", "tx_frames", "rx_calls", "tx_calls", "rx_kicks", "tx_kicks")


def vif_delta(run: xen.XenRun, tag: str) -> dict | None:
    """The connected vif's counters moved between TAG.s0 and TAG.s1."""
    def vif(snap: dict | None) -> dict | None:
        for port in (snap or {}).get("ports", []):
            if port.get("connected") and port.get("name", "").startswith("vif"):
                return port["stats"]
        return None
    a, b = vif(run.stats.get(f"{tag}.s0")), vif(run.stats.get(f"{tag}.s1"))
    return counters_delta(a, b) if a and b else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gsonet", action="append", metavar="NAME=BINARY",
                    help="a build to measure (repeat for several, in one boot); "
                         f"default cur={paths.GSONET_BIN}")
    ap.add_argument("--binary", help="one build (as --gsonet cur=BINARY)")
    ap.add_argument("--rounds", type=int, default=3, help="untraced runs each way")
    ap.add_argument("--seconds", type=int, default=5)
    ap.add_argument("--vif-options", default="", help="more --xen-vif keys, e.g. uring=off")
    ap.add_argument("--kernel", action="store_true",
                    help="also the kernel netback (+ bridge), untraced, in the same boot")
    args = ap.parse_args()
    specs = args.gsonet or [f"cur={args.binary or paths.GSONET_BIN}"]
    builds: list[tuple[str, str]] = []
    vif_words: dict[str, str] = {}
    for s in specs + (["kernel"] if args.kernel else []):
        if s == "kernel":
            builds.append(("kernel", ""))
            continue
        name, sep, path = s.partition("=")
        path, _, words = path.partition("@")
        if not sep or not name.isidentifier() or not Path(path).is_file():
            ap.error(f"{s!r}: want NAME=BINARY[@VIF-KEYS] with an existing binary")
        builds.append((name, path))
        vif_words[name] = f",{words}" if words else ""
    reason = xen.skip_reason()
    if reason:
        print(f"skipped: {reason}")
        return 1
    strace = shutil.which("strace")
    if not strace:
        print("skipped: no strace on this machine (apt-get install strace)")
        return 1
    xen.build_rig()
    files: dict[str, bytes | str] = {"strace.bin": Path(strace).read_bytes()}
    for lib in xen.needed_libs(strace):
        # beside it in /xt; the C library is already gsonet's (the same machine's)
        files[Path(lib).name] = Path(lib).read_bytes()
    for name, path in builds:
        if path:
            files[f"gsonet-{name}"] = Path(path).read_bytes()
            files[f"vif-{name}"] = vif_words[name]
    script = (f"export XT_SECONDS={args.seconds} XT_ROUNDS={args.rounds}"
              f" XT_VIF_OPTS='{args.vif_options}'"
              f" XT_VARIANTS='{' '.join(n for n, _ in builds)}'\n" + SCRIPT)
    run = xen.XenRig("syscalls", script, gsonet_bin=next(p for _, p in builds if p), files=files,
                     timeout=600 + len(builds) * args.rounds * (200 + 12 * args.seconds)
                     ).run()
    calls: dict[tuple[str, str], dict[str, int]] = {}
    for line in run.console.splitlines():
        m = SC.match(line.strip())
        if m and m.group(4) != "total":
            calls.setdefault((m.group(1), m.group(2)), {})[m.group(4)] = int(m.group(3))

    def num(key: str) -> float | None:
        try:
            return float(run.results[key])
        except (KeyError, ValueError):
            return None

    def med(vals: list[float]) -> str:
        return f"{statistics.median(vals):,.1f}" if vals else "-"

    print(f"\nXen rig, one boot ({run.seconds:.0f} s), iperf3 {args.seconds} s, one stream;"
          f" medians of {args.rounds} untraced rounds, per GB")
    for path in PATHS:
        print(f"\n{path}")
        for name, _ in builds:
            rows: dict[str, list[float]] = {}
            for r in range(1, args.rounds + 1):
                tag = f"sc.{name}.r{r}.{path}"
                mbps = num(f"{tag}.mbps")
                if not mbps:
                    continue
                gb = mbps * args.seconds / 8000
                rows.setdefault("Mbit/s", []).append(mbps)
                cpu, steal = num(f"{tag}.mbps.cpu_dom0"), num(f"{tag}.mbps.cpu_steal")
                if cpu is not None:
                    rows.setdefault("dom0 CPU s", []).append((cpu - (steal or 0)) / gb)
                for key, label in (("mbps.dom0_ctxt", "dom0 ctx switches"),
                                   ("sleeps", "gsonet sleeps"),
                                   ("preempted", "gsonet preempted")):
                    v = num(f"{tag}.{key}")
                    if v is not None:
                        rows.setdefault(label, []).append(v / gb)
                moved = vif_delta(run, tag)
                for k in VIF if moved else ():
                    rows.setdefault(k, []).append(moved.get(k, 0) / gb)
            if not rows:
                print(f"  {name}: no result")
                continue
            print(f"  {name}: " + ", ".join(f"{k} {med(v)}" for k, v in rows.items()))
            if name == "kernel":
                continue
            tag = f"sc.{name}.tr.{path}"
            mbps, got = num(f"{tag}.mbps"), calls.get((name, path))
            if not mbps or not got:
                print("    traced: no result")
                continue
            gb = mbps * args.seconds / 8000
            total = sum(got.values())
            print(f"    traced ({mbps:.0f} Mbit/s): {total / gb:,.0f} system calls per GB")
            print("      " + ", ".join(
                f"{k} {c / gb:,.0f}" for k, c in sorted(got.items(), key=lambda kv: -kv[1])
                if c / gb >= 50))
            # gsonet's ioctls on the datapath are grant copies and event notifies, and
            # the vif counts the events it sent: the rest are the copies
            moved = vif_delta(run, tag)
            if moved and got.get("ioctl"):
                events = moved.get("rx_calls", 0) + moved.get("tx_calls", 0)
                copies = got["ioctl"] - events
                pages = (moved.get("rx_bytes", 0) + moved.get("tx_bytes", 0)) / 4096
                print(f"      ioctls: {events / gb:,.0f} events sent, {copies / gb:,.0f}"
                      " grant copies" + (f" of {pages / copies:.1f} pages of frames each"
                                         if copies > 0 else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""gsonet's per-GB costs as a Xen netback, counted in the nested rig, for one build or
several in ONE boot: the builds take turns serving a fresh domU (tap uplink in dom0,
as scripts/xen_ab.py), --rounds turns each, iperf3 once each way per turn, and in
the last turn once more with dom0's system calls counted.

    python3 scripts/xen_syscalls.py [--gsonet NAME=BINARY[@VIF-KEYS] ...] [--kernel]
        [--rounds 3] [--seconds 5] [--rate 100M] [--vif-options uring=off]
    python3 scripts/xen_syscalls.py --replay CONSOLE_LOG [--seconds 5] [--rounds 3]

(e.g. --gsonet q1=target/release/gsonet@queues=1: that build with `,queues=1`
added to its `--xen-vif auto`; --kernel adds the kernel netback + bridge.)

Per direction and build, per GB moved (medians over the untraced rounds): Mbit/s,
dom0's CPU seconds without its steal (dom0's own count) and as Xen counts dom0's
vCPU time (`xl list`: with the time in Xen on dom0's behalf), dom0's context
switches, gsonet's threads'
sleeps (voluntary context switches: its wake-ups) and preemptions (involuntary),
the domU's netfront interrupts (the events any netback sent it), and the vif's
counters: frames each way, events gsonet sent the netfront
(`tx_calls`, `rx_calls`) and took from it (`tx_kicks`, `rx_kicks`). From the
counted run: dom0's system calls per GB (every thread's: iperf3's too, for the
kernel netback as well), gsonet's threads' by kind, their ioctls split into the
events sent (the vif's count) and grant copies (the rest), and the pages each copy
moved on average. The kernel counts them (a histogram trigger on
raw_syscalls:sys_enter in dom0's tracefs), so the counted run keeps nearly the
pace of the others.

In a PV dom0 each system call is two switches of the guest's page tables through
Xen, and each event one more trip, the costs the kernel netback does not have.
--rate caps iperf3 (-b): where every build holds it, each moves the same bytes
in the same time, and a round the machine's load slows does not spread the
fixed costs of its seconds over fewer bytes.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "guest-tests"))

from harness import paths, xen  # noqa: E402
from harness.gsonet import counters_delta  # noqa: E402

SCRIPT = r"""
. /xt/lib.sh
S=${XT_SECONDS:-5}
RATE=${XT_RATE:+-b $XT_RATE}
ip1=10.99.0.2
chmod +x /xt/gsonet-*
TR=/sys/kernel/tracing
[ -d $TR/events ] || mount -t tracefs tracefs $TR
domu_cfg gdomU1 $ip1 00:16:3e:99:00:12 vif-none
domu_cfg kdomU1 $ip1 00:16:3e:99:00:02 vif-xtbridge

# threads: gsonet's threads' voluntary and involuntary context switches, summed
threads() {
    cat /proc/"$GSONET_PID"/task/*/status 2>/dev/null | awk '
        /^voluntary_ctxt_switches/ {v += $2} /^nonvoluntary_ctxt_switches/ {n += $2}
        END {print v + 0, n + 0}'
}

# irqs: the domU's netfront interrupts so far (every queue, TX and RX), for any netback
irqs() {
    domu_queue_irqs $ip1 | tr ' ' '\n' | awk -F= '{s += $2} END {print s + 0}'
}

# once TAG DIR: one untraced iperf3 run, with its costs
once() {
    local a b i
    [ "$2" = domu_to_dom0 ] && R=-R || R=
    if [ -z "${GSONET_PID:-}" ]; then
        i="$(irqs)"
        measure "$1.mbps" iperf_mbps -c $ip1 -t "$S" $R $RATE
        result "$1.domu_irqs" $(($(irqs) - i))
        return
    fi
    i="$(irqs)"
    gsonet_stats "$1.s0"
    a="$(threads)"
    measure "$1.mbps" iperf_mbps -c $ip1 -t "$S" $R $RATE
    b="$(threads)"
    gsonet_stats "$1.s1"
    result "$1.domu_irqs" $(($(irqs) - i))
    set -- "$1" $a $b
    result "$1.sleeps" $(($4 - $2))
    result "$1.preempted" $(($5 - $3))
}

# traced TAG DIR: one more iperf3 run with dom0's system calls counted by the
# kernel (a histogram trigger on raw_syscalls:sys_enter, by thread and call: no
# tracer stops anyone, so the run keeps its pace); gsonet's threads as XT-TID TAG
# lines (the threads a `gsonet stats` starts are not among them), the table as
# XT-SC TAG lines
HIST='hist:keys=common_pid,id.syscall:vals=hitcount:size=8192'
traced() {
    local t ev=$TR/events/raw_syscalls/sys_enter
    [ "$2" = domu_to_dom0 ] && R=-R || R=
    if [ -n "${GSONET_PID:-}" ]; then
        for t in /proc/"$GSONET_PID"/task/*; do echo "XT-TID $1 ${t##*/}"; done
        gsonet_stats "$1.s0"
    fi
    echo "$HIST" > $ev/trigger || { echo "XT-SC-NONE $1"; return; }
    result "$1.mbps" "$(iperf_mbps -c $ip1 -t "$S" $R $RATE)"
    grep '^{' $ev/hist | sed "s/^/XT-SC $1 /"
    echo "!$HIST" > $ev/trigger
    [ -z "${GSONET_PID:-}" ] || gsonet_stats "$1.s1"
}

# syscall_cost TAG: dom0's CPU (without steal) per system call right now: busybox
# dd copying 100k single bytes /dev/zero -> /dev/null makes 200k, each a round trip
# through Xen in a PV dom0; as TAG.syscall_us
syscall_cost() {
    local a b
    a="$(awk '/^cpu / {print ($2 + $3 + $4 + $7 + $8) / 100}' /proc/stat)"
    dd if=/dev/zero of=/dev/null bs=1 count=100000 2>/dev/null
    b="$(awk '/^cpu / {print ($2 + $3 + $4 + $7 + $8) / 100}' /proc/stat)"
    result "$1.syscall_us" "$(awk "BEGIN {print ($b - $a) * 1e6 / 200000}")"
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
    syscall_cost "sc.$1.r$2"
    for dir in dom0_to_domu domu_to_dom0; do once "sc.$1.r$2.$dir" $dir; done
    if [ "$2" = "${XT_ROUNDS:-3}" ]; then
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

# a row of the kernel's histogram: { common_pid: TID, id: sys_NAME [NR] } hitcount: N
SC = re.compile(r"^XT-SC sc\.(\S+)\.tr\.(\S+) \{ common_pid:\s*(\d+), id: (\S+)\s*\[\s*\d+\] \}"
                r" hitcount:\s*(\d+)")
TID = re.compile(r"^XT-TID sc\.(\S+)\.tr\.(\S+) (\d+)$")
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
    ap.add_argument("--rate", default="",
                    help="iperf3's target rate (-b, e.g. 100M): every build and the kernel "
                         "move the same bytes in the same time, so a run the machine's load "
                         "slows does not spread its fixed costs over fewer bytes")
    ap.add_argument("--vif-options", default="", help="more --xen-vif keys, e.g. uring=off")
    ap.add_argument("--kernel", action="store_true",
                    help="also the kernel netback (+ bridge), untraced, in the same boot")
    ap.add_argument("--replay", metavar="CONSOLE_LOG",
                    help="print the tables of a boot again from its console log "
                         "(results/guest-logs/*-xen-syscalls-*.console.log; give the "
                         "--seconds and --rounds it ran with)")
    args = ap.parse_args()
    if args.replay:
        run = replayed(Path(args.replay))
        names = list(dict.fromkeys(re.findall(r"^RESULT sc\.(\w+)\.r1\.", run.console, re.M)))
        report(run, [(n, "") for n in names], args)
        return 0
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
    xen.build_rig()
    files: dict[str, bytes | str] = {}
    for name, path in builds:
        if path:
            files[f"gsonet-{name}"] = Path(path).read_bytes()
            files[f"vif-{name}"] = vif_words[name]
    if args.rate and not re.fullmatch(r"\d+(\.\d+)?[KMG]?", args.rate):
        ap.error(f"--rate {args.rate!r}: want iperf3's -b form, e.g. 100M")
    script = (f"export XT_SECONDS={args.seconds} XT_ROUNDS={args.rounds} XT_RATE={args.rate}"
              f" XT_VIF_OPTS='{args.vif_options}'"
              f" XT_VARIANTS='{' '.join(n for n, _ in builds)}'\n" + SCRIPT)
    run = xen.XenRig("syscalls", script, gsonet_bin=next(p for _, p in builds if p), files=files,
                     timeout=600 + len(builds) * args.rounds * (200 + 12 * args.seconds)
                     ).run()
    report(run, builds, args)
    return 0


def replayed(log: Path) -> xen.XenRun:
    """A boot's report, read back from its console log."""
    text = log.read_text(errors="replace").replace("\r", "")
    return xen.XenRun(
        rc=0, results=dict(xen.RESULT.findall(text)),
        stats={t: json.loads(j) for t, j in xen.STATS.findall(text)},
        failures=[], console=text, log_path=str(log), seconds=0.0)


def report(run: xen.XenRun, builds: list[tuple[str, str]], args: argparse.Namespace) -> None:
    """Prints the per-GB tables of a boot."""
    # per (build, path): gsonet's threads' calls by name, and every dom0 thread's
    tids: dict[tuple[str, str], set[int]] = {}
    lines = [ln.strip() for ln in run.console.splitlines()]
    for line in lines:
        m = TID.match(line)
        if m:
            tids.setdefault((m.group(1), m.group(2)), set()).add(int(m.group(3)))
    calls: dict[tuple[str, str], dict[str, int]] = {}
    dom0_calls: dict[tuple[str, str], int] = {}
    for line in lines:
        m = SC.match(line)
        if not m:
            continue
        key, tid, n = (m.group(1), m.group(2)), int(m.group(3)), int(m.group(5))
        dom0_calls[key] = dom0_calls.get(key, 0) + n
        if tid in tids.get(key, ()):
            name = m.group(4).removeprefix("sys_")
            calls.setdefault(key, {})[name] = calls.setdefault(key, {}).get(name, 0) + n
    def num(key: str) -> float | None:
        try:
            return float(run.results[key])
        except (KeyError, ValueError):
            return None

    def med(vals: list[float]) -> str:
        return f"{statistics.median(vals):,.1f}" if vals else "-"

    took = f"{run.seconds:.0f} s" if run.seconds else f"replayed from {run.log_path}"
    print(f"\nXen rig, one boot ({took}), iperf3 {args.seconds} s, one stream"
          f"{f' at {args.rate}bit/s' if args.rate else ''};"
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
                xen_cpu = num(f"{tag}.mbps.cpu_dom0_xen")
                if xen_cpu is not None:
                    rows.setdefault("dom0 CPU s by Xen's count", []).append(xen_cpu / gb)
                for key, label in (("mbps.dom0_ctxt", "dom0 ctx switches"),
                                   ("domu_irqs", "domU netfront interrupts"),
                                   ("sleeps", "gsonet sleeps"),
                                   ("preempted", "gsonet preempted")):
                    v = num(f"{tag}.{key}")
                    if v is not None:
                        rows.setdefault(label, []).append(v / gb)
                us = num(f"sc.{name}.r{r}.syscall_us")
                if us is not None:
                    rows.setdefault("us per system call (dd, not per GB)", []).append(us)
                moved = vif_delta(run, tag)
                for k in VIF if moved else ():
                    rows.setdefault(k, []).append(moved.get(k, 0) / gb)
            if not rows:
                print(f"  {name}: no result")
                continue
            print(f"  {name}: " + ", ".join(f"{k} {med(v)}" for k, v in rows.items()))
            tag = f"sc.{name}.tr.{path}"
            mbps = num(f"{tag}.mbps")
            if not mbps or (name, path) not in dom0_calls:
                print("    counted: no result")
                continue
            gb = mbps * args.seconds / 8000
            print(f"    counted ({mbps:.0f} Mbit/s): dom0 {dom0_calls[(name, path)] / gb:,.0f}"
                  " system calls per GB", end="")
            got = calls.get((name, path))
            if name == "kernel" or not got:
                print()
                continue
            total = sum(got.values())
            us = [u for r in range(1, args.rounds + 1)
                  if (u := num(f"sc.{name}.r{r}.syscall_us")) is not None]
            cost = (f" (about {total / gb * statistics.median(us) / 1e6:.1f} s of dom0's CPU"
                    " at the median dd cost of a call)") if us else ""
            print(f", gsonet's threads {total / gb:,.0f}{cost}:")
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


if __name__ == "__main__":
    sys.exit(main())

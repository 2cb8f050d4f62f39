#!/usr/bin/env python3
"""gsonet's system calls per GB as a Xen netback, counted in the nested rig: gsonet
serves one domU (tap uplink in dom0, as scripts/xen_ab.py), and `strace -c -f` is
attached to it during an iperf3 each way.

    python3 scripts/xen_syscalls.py [--binary target/release/gsonet] [--seconds 5]
        [--vif-options uring=off]

In a PV dom0 each system call is two switches of the guest's page tables through
Xen, the cost the kernel netback does not have; this says which calls there are.
strace slows gsonet down, so the rates here are not the bench's: read the calls per
GB, not the Mbit/s.
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "guest-tests"))

from harness import paths, xen  # noqa: E402

SCRIPT = r"""
. /xt/lib.sh
S=${XT_SECONDS:-5}
ip1=10.99.0.2
chmod +x /xt/strace.bin
domu_cfg gdomU1 $ip1 00:16:3e:99:00:12 vif-none
gsonet_start --xen-vif "auto${XT_VIF_OPTS:+,$XT_VIF_OPTS}" --uplink tap=xttap0
domu_create gdomU1
ip addr add 10.99.0.1/24 dev xttap0
ip link set xttap0 up
wait_domu $ip1 300 || fail "gdomU1 does not answer through gsonet"
for dir in dom0_to_domu domu_to_dom0; do
    [ $dir = domu_to_dom0 ] && R=-R || R=
    LD_LIBRARY_PATH=/xt /xt/strace.bin -c -f -o /tmp/strace.$dir \
        -p "$GSONET_PID" 2>/dev/null &
    tracer=$!
    sleep 2
    result "$dir.mbps" "$(iperf_mbps -c $ip1 -t "$S" $R)"
    kill -INT $tracer; wait $tracer
    sed "s/^/XT-STRACE $dir /" /tmp/strace.$dir
done
teardown
"""

ROW = re.compile(r"^XT-STRACE (\S+)\s+[\d.]+\s+[\d.]+\s+\d+\s+(\d+)\s+(\d+)?\s*(\w+)\s*$")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--binary", default=str(paths.GSONET_BIN))
    ap.add_argument("--seconds", type=int, default=5)
    ap.add_argument("--vif-options", default="", help="more --xen-vif keys, e.g. uring=off")
    args = ap.parse_args()
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
    script = f"export XT_SECONDS={args.seconds} XT_VIF_OPTS='{args.vif_options}'\n" + SCRIPT
    run = xen.XenRig("syscalls", script, gsonet_bin=args.binary, files=files,
                     timeout=900).run()
    for path in ("dom0_to_domu", "domu_to_dom0"):
        mbps = float(run.results.get(f"{path}.mbps", 0) or 0)
        gb = mbps * args.seconds / 8000
        rows = []
        for line in run.console.splitlines():
            m = ROW.match(line.strip())
            if m and m.group(1) == path and m.group(4) != "total":
                rows.append((int(m.group(2)), int(m.group(3) or 0), m.group(4)))
        total = sum(c for c, _, _ in rows)
        print(f"\n{path}: {mbps:.0f} Mbit/s under strace, {total / gb:,.0f} calls per GB"
              if gb else f"\n{path}: no rate")
        for calls, errors, name in sorted(rows, reverse=True):
            per = f"{calls / gb:9,.0f}" if gb else "-"
            err = f"  ({errors / gb:,.0f} failed)" if gb and errors else ""
            print(f"  {name:<16} {per}{err}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Instructions per frame: the capacity benchmark's loop (scripts/capacity.py: one
dpdk-testpmd with two net_virtio_user ports, io forwarding, frames unicast between
gsonet's two ports) with gsonet under valgrind's callgrind, which counts the
instructions gsonet executes. The count is the same run after run, where this
machine's timings are not: it shows what a change to the datapath takes off every
frame, and where the rest goes, without the noise of other work on the CPUs.

Callgrind is switched on for the measured window only (callgrind_control), so
start-up and negotiation are not counted; the frames are those written into the
ports' RX queues in the window (the calls of FRAME_FN). Under callgrind gsonet runs
some 50x slower, so its queues are always full and each batch as large as it gets:
the count is the per-frame cost of a busy backend, not of one that sleeps between
bursts. Memory stalls, which cost gsonet as much as instructions at speed, are not
in it: the ns per frame of capacity.py remain the measure of speed.

With --pmd, testpmd's vhost PMD (capacity.py's reference backend: two net_vhost
ports, io forwarding, one lcore) is counted the same way, the same frames through
the same frontend. Its libraries have no symbol for the function that writes a
frame, so its frames are those the frontend's two ports received in the window
(`show port stats`, read just after the switch-on and just before the
switch-off, so the window holds a little more than the count). gsonet's frames are
counted both ways and printed side by side, which shows how close the two are."""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "guest-tests"))

from harness import capacity as cap  # noqa: E402
from harness.paths import GSONET_BIN, TESTPMD  # noqa: E402

ROWS = {"64": "64", "1518": "1518", "8k": "2048,2048,2048,2048"}


def log(msg: str) -> None:
    print(f"[instructions] {msg}", file=sys.stderr, flush=True)


def wrapper(work: Path, label: str, binary: str) -> Path:
    """A script that starts ``binary`` under callgrind, counting nothing yet."""
    w = work / f"{label}.sh"
    out = work / f"{label}.callgrind"
    w.write_text("#!/bin/sh\n"
                 f"exec valgrind --tool=callgrind --instr-atstart=no --dump-instr=yes "
                 f"--callgrind-out-file={out} {Path(binary).resolve()} \"$@\"\n")
    w.chmod(0o755)
    return w


def callgrind_control(*args: str) -> None:
    subprocess.run(["callgrind_control", *args], check=True, capture_output=True, timeout=60)


# Called once for every frame written into a guest's RX queue: the frames counted.
# (gsonet's own counters cannot be read at the instant callgrind is switched on and
# off: a control request takes a while under valgrind.)
FRAME_FN = "gsonet::ring::rx::write_frame_in"


def frames_written(dump: Path) -> int:
    """Calls of FRAME_FN in the dump (callgrind's `cfn=` / `calls=` lines)."""
    names: dict[str, str] = {}
    callee = None
    n = 0
    for line in dump.read_text(errors="replace").splitlines():
        m = re.match(r"^(c?fn)=\((\d+)\)(?: (.*))?$", line)
        if m:
            kind, ident, name = m.groups()
            if name:
                names[ident] = name
            if kind == "cfn":
                callee = names.get(ident)
            continue
        m = re.match(r"^calls=(\d+)", line)
        if m and callee == FRAME_FN:
            n += int(m.group(1))
    return n


def annotate(dump: Path, frames: int, n: int) -> tuple[int, list[tuple[float, str]]]:
    """The dump's instructions in all, and the ``n`` functions with the most
    instructions of their own, per frame (one callgrind_annotate)."""
    out = subprocess.run(["callgrind_annotate", "--threshold=100", str(dump)],
                         capture_output=True, text=True, check=True).stdout
    total = None
    rows = []
    for line in out.splitlines():
        if "PROGRAM TOTALS" in line:
            total = int(line.split()[0].replace(",", ""))
            continue
        m = re.match(r"^\s*([\d,]+) \([ \d.]+%\)\s+(\S.*)$", line)
        if m:
            name = m.group(2).split(":", 1)[-1].split(" [")[0]
            rows.append((int(m.group(1).replace(",", "")) / frames, name))
    if total is None:
        raise RuntimeError(f"{dump}: no totals")
    return total, rows[:n]


def received(stats: dict[int, dict]) -> int:
    """Frames the frontend's ports have received (``all_port_stats``)."""
    return sum(p["rx_packets"] for p in stats.values())


class CountedPmd(cap.DpdkBackend):
    """The reference backend with its testpmd under callgrind, counting nothing yet.
    (stdbuf, which starts it, execs valgrind: the process's pid is valgrind's.)"""

    def __init__(self, socks: cap.Sockets, work: Path, out: Path):
        super().__init__(socks, 1, work)
        plain = self.tp.cmdline

        def counted() -> list[str]:
            cmd = plain()
            i = cmd.index(TESTPMD)
            return cmd[:i] + ["valgrind", "--tool=callgrind", "--instr-atstart=no", "--dump-instr=yes",
                              f"--callgrind-out-file={out}"] + cmd[i:]
        self.tp.cmdline = counted

    def start(self) -> "CountedPmd":
        # Under callgrind testpmd starts some 50x slower.
        super().start(timeout=300, sockets_within=60)
        return self

    def wait_connected(self) -> None:
        self.tp.wait_link_up(2, timeout=120)


def measure(label: str, binary: str | None, row: str, seconds: float, bursts: int,
            work: Path, top: int) -> dict:
    """Counts one backend: gsonet ``binary``, or the vhost PMD for None."""
    socks = cap.Sockets()
    fe = cap.frontend(socks, 1, work)
    if binary is None:
        backend = CountedPmd(socks, work, work / f"{label}.callgrind")
    else:
        backend = cap.GsonetBackend(label, str(wrapper(work, label, binary)), socks, 1, work)
    try:
        backend.start()
        fe.start()
        try:
            backend.wait_connected()
            for c in cap.loop_commands(ROWS[row], bursts):
                fe.cmd(c)
            time.sleep(2)
            callgrind_control("--zero", str(backend.pid))
            callgrind_control("--instr=on", str(backend.pid))
            first = received(fe.all_port_stats())
            time.sleep(seconds)
            last = received(fe.all_port_stats())
            callgrind_control("--instr=off", str(backend.pid))
            callgrind_control("--dump", str(backend.pid))
        finally:
            fe.stop()
    finally:
        backend.stop()
        socks.close()
    dumps = sorted(work.glob(f"{label}.callgrind*"), key=lambda p: p.stat().st_size)
    dump = dumps[-1]
    by_frontend = last - first
    frames = by_frontend if binary is None else frames_written(dump)
    if frames <= 0:
        raise RuntimeError(f"{label}: no frames forwarded in the window")
    total, funcs = annotate(dump, frames, top)
    return {"label": label, "row": row, "frames": frames, "by_frontend": by_frontend,
            "per_frame": total / frames, "top": funcs}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="  python3 scripts/instructions.py --gsonet "
                                        "before=/tmp/gsonet-before --gsonet "
                                        "after=target/release/gsonet --rows 64")
    ap.add_argument("--gsonet", action="append", metavar="LABEL=PATH",
                    help="a gsonet build to count (repeatable; default "
                         "target/release/gsonet)")
    ap.add_argument("--rows", default="64", help="frame sizes, a subset of 64,1518,8k")
    ap.add_argument("--seconds", type=float, default=8.0, help="counted window per build")
    ap.add_argument("--bursts", type=int, default=8,
                    help="bursts of 32 frames per port in flight (start tx_first N)")
    ap.add_argument("--pmd", action="store_true",
                    help="count testpmd's vhost PMD too, the reference backend")
    ap.add_argument("--top", type=int, default=12, help="functions listed per build")
    ap.add_argument("--keep", metavar="DIR",
                    help="keep the callgrind files in DIR (for callgrind_annotate "
                         "--inclusive=yes or kcachegrind)")
    args = ap.parse_args()
    for tool in ("valgrind", "callgrind_control", "callgrind_annotate"):
        if not shutil.which(tool):
            sys.exit(f"instructions.py: {tool} is not installed (apt install valgrind)")
    if why := cap.testpmd_missing():
        sys.exit(f"instructions.py: {why}")
    builds = []
    for spec in args.gsonet or [f"gsonet={GSONET_BIN}"]:
        label, _, path = spec.rpartition("=")
        if not Path(path).is_file():
            sys.exit(f"instructions.py: no gsonet binary at {path}")
        builds.append((label or Path(path).name, path))
    if args.pmd:
        builds.append(("pmd", None))
    rows = [r for r in args.rows.split(",") if r]
    if bad := [r for r in rows if r not in ROWS]:
        sys.exit(f"instructions.py: unknown rows {bad}; choose from {','.join(ROWS)}")
    if args.keep:
        work = Path(args.keep)
        work.mkdir(parents=True, exist_ok=True)
    else:
        work = Path(tempfile.mkdtemp(prefix="gsonet-instr-"))
    results = []
    try:
        for row in rows:
            for label, path in builds:
                log(f"{row} B, {label}")
                results.append(measure(f"{label}-{row}", path, row, args.seconds,
                                       args.bursts, work, args.top))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    for r in results:
        print(f"\n{r['label']}: {r['per_frame']:,.0f} instructions per frame "
              f"({r['frames']:,} frames; the frontend received {r['by_frontend']:,})")
        for per, name in r["top"]:
            print(f"  {per:8.0f}  {name[:110]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

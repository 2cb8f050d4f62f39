#!/usr/bin/env python3
"""`make bench`: scripts/measure.py over every backend, topology and offload state
(10 s x 3 by default), kept in results/bench-<timestamp>/ with a bar chart."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import measure  # puts guest-tests/ (the harness) on sys.path
from harness.backends import BACKENDS, TOPOLOGIES, label
from harness.knobs import env_number


def ensure_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
        return True
    except ImportError:
        pass
    measure.log("matplotlib missing: installing it with pip (for the chart)")
    for extra in (["--break-system-packages"], []):
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", *extra, "matplotlib"],
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            import matplotlib  # noqa: F401
            return True
        except ImportError:
            continue
    return False


def chart(rows: list[dict], args, path: Path) -> str | None:
    """A bar chart of the medians; None, or why there is none."""
    if not ensure_matplotlib():
        return "matplotlib not available"
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{measure.CASE_LABEL[r['case']]}\n{r['offloads']}" for r in rows]
    width = 0.8 / max(1, len(args.backends))
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(rows)), 4.5))
    for i, b in enumerate(args.backends):
        xs = [j + (i - (len(args.backends) - 1) / 2) * width for j in range(len(rows))]
        ax.bar(xs, [r["backends"][b]["gbps"] or 0 for r in rows], width, label=label(b))
        for x, r in zip(xs, rows):
            if r["backends"][b]["gbps"] is None:
                ax.text(x, 0.02, "n/a", ha="center", va="bottom", fontsize=7, rotation=90)
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels(labels, fontsize=8)
    ax.set_ylabel("Gbit/s (iperf3 TCP, median)")
    ax.set_title(f"TCG guests, 1 vCPU: {args.seconds:g} s x {args.repeats} per point")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None




def main() -> int:
    args = measure.parse_args(
        sys.argv[1:], __doc__,
        backends=",".join(BACKENDS), topologies=",".join(TOPOLOGIES), offloads="both",
        seconds=env_number(("BENCH_SECONDS", "SECONDS"), 10),
        repeats=int(env_number(("BENCH_REPEATS", "REPEATS"), 3)),
        out=measure.ROOT / "results" / f"bench-{time.strftime('%Y%m%d-%H%M%S')}")
    rows = measure.measure(args)
    why = chart(rows, args, args.out / "bench.png")
    print(f"chart: {args.out}/bench.png" if why is None else f"no chart: {why}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

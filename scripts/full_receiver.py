#!/usr/bin/env python3
"""Guest to guest toward a receiver that cannot keep up: the receiver's device
without guest TSO (QEMU's guest_tso4/6=off), so every TSO frame of the sender is
segmented on the way, and the receiving guest (under TCG) takes the segments slower
than they come. Per backend, in one run: iperf3's Gbit/s and the sender's TCP
retransmits per round, and for gsonet the frames dropped toward the receiver
(`rx_queue_full`) and held for it (`tx_held`, `tx_pauses`). Each round may toggle
the sender's TSO and GSO at random (--toggle), as a soak does.

  sudo scripts/full_receiver.py --backends gsonet:bin=/tmp/gsonet-old,gsonet,qemu-tap \\
      --rounds 8 --seconds 4 --toggle --out /tmp/full-receiver.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "guest-tests"))

from harness.backends import Setup, known, label  # noqa: E402
from harness.gsonet import counters_delta  # noqa: E402
from harness.iperf import iperf3_guest_client_json, iperf3_guest_server  # noqa: E402


def one_backend(backend: str, args, rng: random.Random) -> list[dict]:
    rounds = []
    with tempfile.TemporaryDirectory(prefix="gsonet-full-") as tmp:
        with Setup(backend, "g2g-soft", Path(tmp)) as s:
            sender, receiver = s.guests
            iperf3_guest_server(receiver)
            for r in range(args.rounds):
                on = rng.random() < 0.5 if args.toggle else True
                sender.ethtool_set(tso=on, gso=on)
                before = s.gsonet.stats() if s.gsonet else None
                res = iperf3_guest_client_json(sender, s.guest_ips[1], seconds=args.seconds)
                end = res["end"]
                row = {"round": r + 1, "sender_tso": on,
                       "gbps": end["sum_received"]["bits_per_second"] / 1e9,
                       "retransmits": end["sum_sent"].get("retransmits")}
                if before is not None:
                    after = s.gsonet.stats()
                    tx = counters_delta(before["ports"][0]["stats"], after["ports"][0]["stats"])
                    rx = counters_delta(before["ports"][1]["stats"], after["ports"][1]["stats"])
                    row["rx_queue_full"] = rx["drops"].get("rx_queue_full", 0)
                    row["rx_queue_stalled"] = rx["drops"].get("rx_queue_stalled", 0)
                    row["tx_held"] = tx.get("tx_held", 0)
                    row["tx_pauses"] = tx.get("tx_pauses", 0)
                print(f"[full-receiver] {label(backend)} round {r + 1}: {row}", flush=True)
                rounds.append(row)
    return rounds


def summary(results: dict) -> str:
    head = ["backend", "rounds", "Gbit/s median", "retransmits per round (median, min-max)",
            "retransmits in all", "rx_queue_full in all", "tx_held in all"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for b, rows in results.items():
        if not rows:
            continue
        rt = [x["retransmits"] or 0 for x in rows]
        full = sum(x.get("rx_queue_full", 0) for x in rows) if "rx_queue_full" in rows[0] else "-"
        held = sum(x.get("tx_held", 0) for x in rows) if "tx_held" in rows[0] else "-"
        lines.append("| " + " | ".join([
            label(b), str(len(rows)), f"{statistics.median(x['gbps'] for x in rows):.2f}",
            f"{statistics.median(rt):.0f} ({min(rt)}-{max(rt)})", str(sum(rt)),
            str(full), str(held)]) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backends", default="gsonet,qemu-tap",
                    help="comma-separated: gsonet, gsonet:bin=PATH, gsonet:K=V, qemu-tap")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=4)
    ap.add_argument("--toggle", action="store_true",
                    help="each round sets the sender's TSO and GSO on or off at random")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    backends = [b for b in args.backends.split(",") if b]
    for b in backends:
        if not known(b) or b.startswith("dpdk"):
            sys.exit(f"unknown backend {b}")
    if os.geteuid() != 0:
        sys.exit("needs root (QEMU networking, bridges)")
    results = {}
    for b in backends:
        # The same toggles for every backend.
        results[b] = one_backend(b, args, random.Random(args.seed))
    table = summary(results)
    print(table)
    if args.out:
        args.out.write_text(json.dumps({"results": results, "summary": table}, indent=1))


if __name__ == "__main__":
    main()

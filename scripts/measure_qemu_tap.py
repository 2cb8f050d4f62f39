#!/usr/bin/env python3
"""Throughput of QEMU's built-in virtio-net + tap (the usual choice), for
comparison with gsonet in the same run.

Boots the test guest on `-netdev tap`, runs iperf3 both ways (server in the
guest, client on the host) and prints Gbit/s. Needs root and the guest image
(scripts/setup.sh).

    scripts/measure_qemu_tap.py [--seconds 3] [--repeats 1] [--offloads-off] [--json]
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "guest-tests"))

import guest as G  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=3)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--offloads-off", action="store_true",
                    help="ethtool -K eth0 tso off gso off in the guest first")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args()

    if not G.image_ready():
        G.build_image()
    res = G.measure_qemu_tap(seconds=args.seconds, repeats=args.repeats,
                             guest_offloads_off=args.offloads_off)
    g2h = statistics.median(res["guest_to_host"])
    h2g = statistics.median(res["host_to_guest"])
    if args.json:
        print(json.dumps({"backend": "qemu-tap", "guest_to_host_gbps": g2h,
                          "host_to_guest_gbps": h2g, "boot_seconds": res["boot_seconds"],
                          "runs": res}))
    else:
        print(f"qemu-tap boot           {res['boot_seconds']:.1f} s")
        print(f"qemu-tap guest->host    {g2h:.2f} Gbit/s")
        print(f"qemu-tap host->guest    {h2g:.2f} Gbit/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

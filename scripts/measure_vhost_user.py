#!/usr/bin/env python3
"""Throughput of a guest attached to a vhost-user backend (gsonet) whose host
side (the uplink tap) already carries HOST_IP.

Boots the test guest with `-netdev vhost-user` on SOCKET, runs iperf3 both ways
(server in the guest, client on the host) and prints Gbit/s.

    scripts/measure_vhost_user.py SOCKET --host-ip 10.77.0.1 --guest-ip 10.77.0.2
        [--prefix 24] [--seconds 3] [--repeats 1] [--label gsonet] [--json]
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
    ap.add_argument("socket")
    ap.add_argument("--host-ip", required=True)
    ap.add_argument("--guest-ip", required=True)
    ap.add_argument("--prefix", type=int, default=24)
    ap.add_argument("--seconds", type=float, default=3)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--label", default="gsonet")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args()

    if not G.image_ready():
        G.build_image()
    res = G.measure_vhost_user(args.socket, args.host_ip, args.guest_ip, args.prefix,
                               seconds=args.seconds, repeats=args.repeats, name=args.label)
    g2h = statistics.median(res["guest_to_host"])
    h2g = statistics.median(res["host_to_guest"])
    if args.json:
        print(json.dumps({"backend": args.label, "guest_to_host_gbps": g2h,
                          "host_to_guest_gbps": h2g, "boot_seconds": res["boot_seconds"],
                          "runs": res}))
    else:
        print(f"{args.label} boot           {res['boot_seconds']:.1f} s")
        print(f"{args.label} guest->host    {g2h:.2f} Gbit/s")
        print(f"{args.label} host->guest    {h2g:.2f} Gbit/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

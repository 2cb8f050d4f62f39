#!/usr/bin/env bash
# gsonet demo: one TCG guest on gsonet (vhost-user, tap uplink) and the same guest
# image on QEMU's built-in virtio-net + tap, iperf3 both ways, side by side, with
# gsonet's counters (GSO frames passed intact). The measuring is scripts/measure.py.
#
#   sudo scripts/demo.sh            # SECONDS_PER_RUN=3 REPEATS=3 by default
#
# Env: SECONDS_PER_RUN, REPEATS, SKIP_SETUP=1, SKIP_BUILD=1, SKIP_QEMU_TAP=1,
#      GSONET_BIN (default target/release/gsonet).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
say() { printf '\n[demo] %s\n' "$*"; }

if [ "$(id -u)" != 0 ]; then echo "demo.sh must run as root (taps, QEMU networking)" >&2; exit 1; fi

if [ "${SKIP_SETUP:-0}" != 1 ]; then
    say "setup (packages + guest image)"
    "$ROOT/scripts/setup.sh"
fi
if [ "${SKIP_BUILD:-0}" != 1 ]; then
    say "cargo build --release"
    cargo build --release
fi
export GSONET_BIN="${GSONET_BIN:-$ROOT/target/release/gsonet}"
[ -x "$GSONET_BIN" ] || { echo "missing $GSONET_BIN" >&2; exit 1; }

BACKENDS=gsonet,qemu-tap
[ "${SKIP_QEMU_TAP:-0}" = 1 ] && BACKENDS=gsonet
say "gsonet next to QEMU's built-in virtio-net: TCG guests, 1 vCPU; compare ratios, not absolutes"
exec python3 "$ROOT/scripts/measure.py" --backends "$BACKENDS" --topologies host --offloads on \
    --seconds "${SECONDS_PER_RUN:-3}" --repeats "${REPEATS:-3}" --gsonet-stats

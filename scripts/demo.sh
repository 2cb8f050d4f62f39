#!/usr/bin/env bash
# gsonet demo: one TCG guest on gsonet (vhost-user, tap uplink) and the same guest
# image on QEMU's built-in virtio-net + tap, iperf3 both ways and a latency ping-pong,
# side by side. The measuring is scripts/measure.py --brief: one progress line per
# set-up, then the throughput table, the latency line and a chart; the detail (per GB
# costs, latency percentiles, gsonet's counters, logs) goes to results/demo-<time>/.
#
#   sudo scripts/demo.sh [--verbose]   # SECONDS_PER_RUN=3 REPEATS=3 by default
#
# Env: SECONDS_PER_RUN, REPEATS, SKIP_SETUP=1, SKIP_BUILD=1, SKIP_QEMU_TAP=1,
#      GSONET_BIN (default target/release/gsonet), VERBOSE=1 (= --verbose),
#      CI=true (full logs of every step on the console).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
[ "${1:-}" = "--verbose" ] && export VERBOSE=1

if [ "$(id -u)" != 0 ]; then echo "demo.sh must run as root (taps, QEMU networking)" >&2; exit 1; fi

if [ "${SKIP_SETUP:-0}" != 1 ]; then
    bash "$ROOT/scripts/step.sh" setup "packages, QEMU 10, guest images (scripts/setup.sh)" \
        -- "$ROOT/scripts/setup.sh"
fi
if [ "${SKIP_BUILD:-0}" != 1 ]; then
    bash "$ROOT/scripts/step.sh" build "cargo build --release" -- cargo build --release
fi
export GSONET_BIN="${GSONET_BIN:-$ROOT/target/release/gsonet}"
[ -x "$GSONET_BIN" ] || { echo "missing $GSONET_BIN" >&2; exit 1; }

BACKENDS=gsonet,qemu-tap
[ "${SKIP_QEMU_TAP:-0}" = 1 ] && BACKENDS=gsonet
OUT="$ROOT/results/demo-$(date +%Y%m%d-%H%M%S)"
VERBOSE_ARG=()
if [ "${VERBOSE:-0}" = 1 ] || [ "${CI:-}" = true ]; then VERBOSE_ARG=(--verbose); fi
echo "[demo] gsonet next to QEMU's built-in virtio-net: TCG guests, 1 vCPU," \
    "${REPEATS:-3} rounds of ${SECONDS_PER_RUN:-3} s per direction"
exec python3 "$ROOT/scripts/measure.py" --brief --out "$OUT" "${VERBOSE_ARG[@]}" \
    --backends "$BACKENDS" --topologies host --offloads on \
    --seconds "${SECONDS_PER_RUN:-3}" --repeats "${REPEATS:-3}" --gsonet-stats

#!/usr/bin/env bash
# gsonet demo: one TCG guest on gsonet (vhost-user, tap uplink) and the same
# guest image on QEMU's built-in virtio-net + tap, iperf3 both ways, side by side.
#
#   sudo scripts/demo.sh            # SECONDS_PER_RUN=3 REPEATS=3 by default
#
# Env: SECONDS_PER_RUN, REPEATS, SKIP_SETUP=1, SKIP_BUILD=1, SKIP_QEMU_TAP=1,
#      GSONET_BIN (default target/release/gsonet).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
SECS="${SECONDS_PER_RUN:-3}"
REPEATS="${REPEATS:-3}"
DEMO_DIR=/tmp/gsonet-demo
SOCK="$DEMO_DIR/vm1.sock"
CONTROL="$DEMO_DIR/control.sock"
UPLINK="${UPLINK:-gsonet0}"
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
GSONET="${GSONET_BIN:-$ROOT/target/release/gsonet}"
[ -x "$GSONET" ] || { echo "missing $GSONET" >&2; exit 1; }

# The demo subnet must be ours alone: the first 10.77.N.0/24 no interface uses.
NET="$(cd "$ROOT/guest-tests" && python3 -c 'import guest; print(guest.alloc_subnet())')"
HOST_IP="10.77.$NET.1"
GUEST_IP="10.77.$NET.2"
if [ -e "/sys/class/net/$UPLINK" ]; then
    echo "$UPLINK already exists; set UPLINK=NAME to use another tap name" >&2
    exit 1
fi

mkdir -p "$DEMO_DIR" "$ROOT/results"
rm -f "$SOCK"
LOG="$ROOT/results/demo-gsonet.log"
GSONET_PID=
cleanup() {
    if [ -n "$GSONET_PID" ] && kill -0 "$GSONET_PID" 2>/dev/null; then
        kill "$GSONET_PID" 2>/dev/null || true
        wait "$GSONET_PID" 2>/dev/null || true
    fi
    rm -f "$SOCK" "$CONTROL"
}
trap cleanup EXIT

say "starting: gsonet serve --port socket=$SOCK --uplink tap=$UPLINK (log: $LOG)"
"$GSONET" serve --port "socket=$SOCK" --uplink "tap=$UPLINK" --control "$CONTROL" >"$LOG" 2>&1 &
GSONET_PID=$!
for _ in $(seq 1 100); do
    [ -S "$SOCK" ] && [ -e "/sys/class/net/$UPLINK" ] && break
    kill -0 "$GSONET_PID" 2>/dev/null || { echo "gsonet exited:" >&2; cat "$LOG" >&2; exit 1; }
    sleep 0.1
done
[ -S "$SOCK" ] || { echo "gsonet did not create $SOCK" >&2; cat "$LOG" >&2; exit 1; }
[ -e "/sys/class/net/$UPLINK" ] || { echo "gsonet did not create tap $UPLINK" >&2; cat "$LOG" >&2; exit 1; }
ip addr add "$HOST_IP/24" dev "$UPLINK"
ip link set "$UPLINK" up

say "guest on gsonet (vhost-user), iperf3 ${SECS}s x $REPEATS each way"
GSONET_JSON="$("$ROOT/scripts/measure_vhost_user.py" "$SOCK" --host-ip "$HOST_IP" \
    --guest-ip "$GUEST_IP" --seconds "$SECS" --repeats "$REPEATS" --label gsonet --json)"
echo "$GSONET_JSON"
say "gsonet stats (GSO frames passed intact, largest frame from the guest)"
"$GSONET" stats --control "$CONTROL" 2>&1 || true
cleanup
GSONET_PID=

TAP_JSON='{}'
if [ "${SKIP_QEMU_TAP:-0}" != 1 ]; then
    say "same guest on QEMU's built-in virtio-net + tap"
    TAP_JSON="$("$ROOT/scripts/measure_qemu_tap.py" --seconds "$SECS" --repeats "$REPEATS" --json)"
    echo "$TAP_JSON"
fi

say "results (TCG, 1 vCPU, iperf3 TCP ${SECS}s, median of $REPEATS; compare ratios, not absolutes)"
python3 - "$GSONET_JSON" "$TAP_JSON" <<'PY'
import json, sys
rows = [json.loads(a) for a in sys.argv[1:]]
print(f"{'backend':<12} {'guest->host':>14} {'host->guest':>14} {'boot':>7}")
for r in rows:
    if not r:
        continue
    print(f"{r['backend']:<12} {r['guest_to_host_gbps']:>9.2f} Gb/s {r['host_to_guest_gbps']:>9.2f} Gb/s "
          f"{r['boot_seconds']:>5.1f} s")
if len(rows) == 2 and rows[1]:
    g, t = rows
    print(f"{'gsonet/tap':<12} {g['guest_to_host_gbps']/t['guest_to_host_gbps']:>11.2f} x  "
          f"{g['host_to_guest_gbps']/t['host_to_guest_gbps']:>11.2f} x")
PY

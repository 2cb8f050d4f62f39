# Shared by the qemu-configs/*.sh scripts: defaults, starting gsonet, and running a
# guest on a vhost-user port. Source it; do not run it. The QEMU command line comes
# from the guest tests' builder (guest-tests/harness/qemu.py), so a guest started here
# is the guest the tests boot.
#
# Environment (all optional):
#   GSONET     gsonet binary            (default: target/release/gsonet of this tree)
#   KERNEL     guest kernel             (default: guest-tests/.cache/bzImage)
#   INITRD     guest initramfs          (default: guest-tests/.cache/initramfs.cpio.gz)
#   WORK       sockets, logs, consoles  (default: /tmp/gsonet-qemu)
#   MEM        guest RAM                (default: 512M)
#   ACCEL      tcg | kvm                (default: tcg; kvm-pvm on these machines cannot run
#              stock kernels, see docs/troubleshooting.md)
#   NET        first three octets of the test subnet (default: 10.77.0)
#   CONSOLE    stdio (interactive, last guest in the foreground) or file (every guest
#              in the background, console in $WORK/NAME.console; the script waits)
#   OFFLOADS   virtio-net-pci properties for every guest, see below
#   EXTRA_QEMU extra QEMU arguments
#   PRINT_ONLY 1: start nothing, print the gsonet and QEMU command lines (one
#              argument a line, each command after a "--- gsonet" / "--- qemu NAME" line)
#
# The guest image (guest-tests/image) reads gsonet.ip=/gsonet.ip6= from the kernel
# command line; any other Linux image works as well, configure its eth0 yourself.

set -euo pipefail

CONFIGS="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd -P)"
ROOT="$(cd "$CONFIGS/.." && pwd -P)"
GSONET="${GSONET:-$ROOT/target/release/gsonet}"
KERNEL="${KERNEL:-$ROOT/guest-tests/.cache/bzImage}"
INITRD="${INITRD:-$ROOT/guest-tests/.cache/initramfs.cpio.gz}"
WORK="${WORK:-/tmp/gsonet-qemu}"
MEM="${MEM:-512M}"
ACCEL="${ACCEL:-tcg}"
NET="${NET:-10.77.0}"
CONSOLE="${CONSOLE:-stdio}"
EXTRA_QEMU="${EXTRA_QEMU:-}"
PRINT_ONLY="${PRINT_ONLY:-0}"

# OFFLOADS: virtio-net-pci properties, k=v,k2=v2. Every offload defaults to on in
# QEMU (the guests also get mrg_rxbuf=on and 1024-entry rings); turning one off hides
# that feature bit from the guest (gsonet then never sees it acked):
#   csum=off        VIRTIO_NET_F_CSUM: the guest may send partially checksummed frames
#                   (prerequisite of every host_* offload below)
#   guest_csum=off  VIRTIO_NET_F_GUEST_CSUM: gsonet may hand the guest partial checksums
#                   (prerequisite of every guest_* offload below)
#   host_tso4 host_tso6   the guest may send TCP frames up to 64 KiB (TSO)
#   host_ecn              ... with ECN (CWR) set
#   host_ufo              ... UDP fragmentation offload (Linux guests no longer use it)
#   host_uso              ... UDP segmentation (UDP_SEGMENT); QEMU 10 masks it on
#                         vhost-user netdevs (docs/offloads.md)
#   guest_tso4 guest_tso6 gsonet may hand the guest 64 KiB TCP frames
#   guest_ecn guest_ufo   ... with ECN / UFO frames
#   guest_uso4 guest_uso6 ... USO frames (masked by QEMU 10 on vhost-user)
#   mrg_rxbuf             mergeable RX buffers: 64 KiB frames without 64 KiB buffers
#   rx_queue_size=1024,tx_queue_size=1024   256-entry rings drop under load
# e.g. OFFLOADS=guest_tso4=off,guest_tso6=off
OFFLOADS="${OFFLOADS:-}"

PIDS=()
say() { printf '[%s] %s\n' "$(basename "$0")" "$*" >&2; }

need_root() {
    [ "$PRINT_ONLY" = 1 ] && return 0
    if [ "$(id -u)" != 0 ]; then
        say "run as root (gsonet creates a tap; QEMU needs the sockets)"
        exit 1
    fi
    [ -x "$GSONET" ] || { say "missing $GSONET (cargo build --release)"; exit 1; }
    [ -f "$KERNEL" ] && [ -f "$INITRD" ] || {
        say "missing guest image $KERNEL (guest-tests/image/build.sh)"; exit 1; }
    mkdir -p "$WORK"
}

cleanup() {
    local p
    for p in "${PIDS[@]}"; do
        kill "$p" 2>/dev/null || true
    done
    for p in "${PIDS[@]}"; do
        wait "$p" 2>/dev/null || true
    done
}
trap cleanup EXIT INT TERM

# start_gsonet ARGS... : runs `gsonet serve ARGS --control $WORK/control.sock` in the
# background (log: $WORK/gsonet.log) and waits for its control socket.
start_gsonet() {
    local cmd=("$GSONET" serve "$@" --control "$WORK/control.sock")
    if [ "$PRINT_ONLY" = 1 ]; then printf '%s\n' "--- gsonet" "${cmd[@]}"; return; fi
    rm -f "$WORK/control.sock"
    say "${cmd[*]}"
    NO_COLOR=1 "${cmd[@]}" >"$WORK/gsonet.log" 2>&1 &
    PIDS+=($!)
    local i
    for i in $(seq 1 100); do
        [ -S "$WORK/control.sock" ] && return 0
        kill -0 "${PIDS[-1]}" 2>/dev/null || { cat "$WORK/gsonet.log" >&2; exit 1; }
        sleep 0.1
    done
    say "gsonet did not come up:"; cat "$WORK/gsonet.log" >&2; exit 1
}

# host_addr TAP : the host end of the test subnet on gsonet's tap uplink.
host_addr() {
    [ "$PRINT_ONLY" = 1 ] && return 0
    local i
    for i in $(seq 1 50); do [ -e "/sys/class/net/$1" ] && break; sleep 0.1; done
    ip addr replace "$NET.1/24" dev "$1"
    ip -6 addr replace "fd00:77::1/64" dev "$1" nodad 2>/dev/null || true
    ip link set "$1" up
}

# run_guest FOREGROUND NAME HOST SOCKET [OPTIONS...] : a guest at $NET.HOST (and
# fd00:77::HOST) on the vhost-user socket SOCKET. OPTIONS go to the command line
# builder: --server [--wait] (QEMU listens), --queues N, --smp N, --props k=v,...
# The last guest of a stdio script runs in the foreground (Ctrl-A X quits); the
# others, and all of them with CONSOLE=file, in the background with their console in
# a file.
run_guest() {
    local fg="$1" name="$2" host="$3" sock="$4"; shift 4
    local serial="file:$WORK/$name.console" out
    [ "$fg" = 1 ] && [ "$CONSOLE" = stdio ] && serial=stdio
    out="$(PYTHONPATH="$ROOT/guest-tests${PYTHONPATH:+:$PYTHONPATH}" python3 -m harness.qemu \
        "$name" "$sock" --ip "$NET.$host/24" --ip6 "fd00:77::$host/64" --mem "$MEM" \
        --accel "$ACCEL" --kernel "$KERNEL" --initrd "$INITRD" --serial "$serial" \
        --props "$OFFLOADS" "$@")"
    local argv
    mapfile -t argv <<<"$out"
    # shellcheck disable=SC2206
    argv+=($EXTRA_QEMU)
    if [ "$PRINT_ONLY" = 1 ]; then
        printf '%s\n' "--- qemu $name" "${argv[@]}"
    elif [ "$serial" = stdio ]; then
        say "guest $name (console here; Ctrl-A X quits)"
        "${argv[@]}"
    else
        say "guest $name (console: $WORK/$name.console)"
        "${argv[@]}" </dev/null >"$WORK/$name.qemu.log" 2>&1 &
        PIDS+=($!)
    fi
}

# wait_all : with CONSOLE=file, keep the script (and with it gsonet) alive until a
# guest exits or the script is interrupted.
wait_all() {
    if [ "$PRINT_ONLY" != 1 ] && [ "$CONSOLE" != stdio ]; then
        say "running; gsonet stats --control $WORK/control.sock; Ctrl-C stops everything"
        wait -n "${PIDS[@]}" 2>/dev/null || true
    fi
}

# Shared by the qemu-configs/*.sh scripts: defaults, starting gsonet, and the QEMU
# command line of a guest on a vhost-user port. Source it; do not run it.
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
#   OFFLOADS   virtio-net-pci offload properties, see below
#   EXTRA_QEMU extra QEMU arguments
#
# The guest image (guest-tests/image) reads gsonet.ip=/gsonet.ip6= from the kernel
# command line; any other Linux image works as well, configure its eth0 yourself.

set -euo pipefail

CONFIGS="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$CONFIGS/.." && pwd)"
GSONET="${GSONET:-$ROOT/target/release/gsonet}"
KERNEL="${KERNEL:-$ROOT/guest-tests/.cache/bzImage}"
INITRD="${INITRD:-$ROOT/guest-tests/.cache/initramfs.cpio.gz}"
WORK="${WORK:-/tmp/gsonet-qemu}"
MEM="${MEM:-512M}"
ACCEL="${ACCEL:-tcg}"
NET="${NET:-10.77.0}"
CONSOLE="${CONSOLE:-stdio}"
EXTRA_QEMU="${EXTRA_QEMU:-}"

# virtio-net-pci offload properties. Every one defaults to on in QEMU; turning one
# off hides that feature bit from the guest (gsonet then never sees it acked):
#   csum=on        VIRTIO_NET_F_CSUM: the guest may send partially checksummed frames
#                  (prerequisite of every host_* offload below)
#   guest_csum=on  VIRTIO_NET_F_GUEST_CSUM: gsonet may hand the guest partial checksums
#                  (prerequisite of every guest_* offload below)
#   host_tso4=on host_tso6=on   the guest may send TCP frames up to 64 KiB (TSO)
#   host_ecn=on                 ... with ECN (CWR) set
#   host_ufo=on                 ... UDP fragmentation offload (Linux guests no longer use it)
#   host_uso=on                 ... UDP segmentation (UDP_SEGMENT); QEMU 10 masks it on
#                               vhost-user netdevs (docs/offloads.md)
#   guest_tso4=on guest_tso6=on gsonet may hand the guest 64 KiB TCP frames
#   guest_ecn=on guest_ufo=on   ... with ECN / UFO frames
#   guest_uso4=on guest_uso6=on ... USO frames (masked by QEMU 10 on vhost-user)
#   mrg_rxbuf=on                mergeable RX buffers: 64 KiB frames without 64 KiB buffers
#   rx_queue_size=1024,tx_queue_size=1024   256-entry rings drop under load
OFFLOADS="${OFFLOADS:-csum=on,guest_csum=on,host_tso4=on,host_tso6=on,host_ecn=on,host_ufo=on,guest_tso4=on,guest_tso6=on,guest_ecn=on,guest_ufo=on,mrg_rxbuf=on,rx_queue_size=1024,tx_queue_size=1024}"

PIDS=()
say() { printf '[%s] %s\n' "$(basename "$0")" "$*" >&2; }

need_root() {
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
    rm -f "$WORK/control.sock"
    say "gsonet serve $* --control $WORK/control.sock"
    NO_COLOR=1 "$GSONET" serve "$@" --control "$WORK/control.sock" >"$WORK/gsonet.log" 2>&1 &
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
    local i
    for i in $(seq 1 50); do [ -e "/sys/class/net/$1" ] && break; sleep 0.1; done
    ip addr replace "$NET.1/24" dev "$1"
    ip -6 addr replace "fd00:77::1/64" dev "$1" nodad 2>/dev/null || true
    ip link set "$1" up
}

# qemu_args NAME IP CHARDEV NETDEV_EXTRA DEVICE_EXTRA SMP : prints the QEMU argv,
# one per line, for a guest whose NIC is a vhost-user netdev on CHARDEV.
qemu_args() {
    local name="$1" ip="$2" chardev="$3" netdev_extra="$4" device_extra="$5" smp="${6:-1}"
    local mac
    mac="52:54:00:$(printf '%s' "$name" | md5sum | sed 's/^\(..\)\(..\)\(..\).*/\1:\2:\3/')"
    printf '%s\n' \
        -name "$name" -accel "$ACCEL" -cpu qemu64 -m "$MEM" -smp "$smp" \
        -object "memory-backend-memfd,id=mem,size=$MEM,share=on" -numa node,memdev=mem \
        -kernel "$KERNEL" -initrd "$INITRD" \
        -append "console=ttyS0 quiet panic=-1 gsonet.hostname=$name gsonet.ip=$ip/24 gsonet.ip6=fd00:77::${ip##*.}/64" \
        -nodefaults -nographic -monitor none -no-reboot \
        -chardev "$chardev" \
        -netdev "vhost-user,id=n0,chardev=c0$netdev_extra" \
        -device "virtio-net-pci,netdev=n0,mac=$mac,$OFFLOADS$device_extra"
}

# run_guest FOREGROUND NAME ARGS... : starts qemu-system-x86_64 with ARGS. The last
# guest of a stdio script runs in the foreground (Ctrl-A X quits); the others, and
# all of them with CONSOLE=file, in the background with their console in a file.
run_guest() {
    local fg="$1" name="$2"; shift 2
    # shellcheck disable=SC2086
    if [ "$fg" = 1 ] && [ "$CONSOLE" = stdio ]; then
        say "guest $name (console here; Ctrl-A X quits)"
        qemu-system-x86_64 "$@" -serial stdio $EXTRA_QEMU
    else
        say "guest $name (console: $WORK/$name.console)"
        qemu-system-x86_64 "$@" -serial "file:$WORK/$name.console" $EXTRA_QEMU \
            </dev/null >"$WORK/$name.qemu.log" 2>&1 &
        PIDS+=($!)
    fi
}

# wait_all : with CONSOLE=file, keep the script (and with it gsonet) alive until a
# guest exits or the script is interrupted.
wait_all() {
    if [ "$CONSOLE" != stdio ]; then
        say "running; gsonet stats --control $WORK/control.sock; Ctrl-C stops everything"
        wait -n "${PIDS[@]}" 2>/dev/null || true
    fi
}

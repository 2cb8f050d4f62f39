#!/usr/bin/env bash
# Build the gsonet test guest: a Debian bookworm-backports 6.12 kernel and a
# busybox initramfs with virtio_net, virtio_mem, iperf3, ethtool, the UDP GSO tools and tcp_rr.
# Output: guest-tests/.cache/{bzImage,initramfs.cpio.gz,stamp}. Rebuilt only
# when this script, its inputs or the host packages it copies from change.
# Env: GSONET_GUEST_KERNEL=6.1 builds the second guest instead, on Debian 12's
#      stable 6.1 kernel (no USO), into guest-tests/.cache/kernel-6.1/;
#      GSONET_KERNEL_PKG=linux-image-X-amd64 to pin the kernel; FORCE=1 to rebuild.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CACHE="$(cd "$HERE/.." && pwd)/.cache"
SERIES="${GSONET_GUEST_KERNEL:-6.12}"
case "$SERIES" in
    6.12) ;;
    6.1) CACHE="$CACHE/kernel-6.1" ;;
    *) echo "GSONET_GUEST_KERNEL=$SERIES: 6.12 (default) or 6.1" >&2; exit 2 ;;
esac
mkdir -p "$CACHE"
say() { printf '[image] %s\n' "$*"; }

for tool in busybox iperf3 ethtool gcc cpio xz apt-get dpkg modinfo; do
    command -v "$tool" >/dev/null || { echo "missing $tool: run scripts/setup.sh" >&2; exit 1; }
done
BUSYBOX="$(command -v busybox)"
if ! file -L "$BUSYBOX" 2>/dev/null | grep -q 'statically' && ldd "$BUSYBOX" >/dev/null 2>&1; then
    echo "busybox is not static: install busybox-static" >&2
    exit 1
fi

# Which kernel: the one linux-image-amd64 points at in bookworm-backports (6.12) or
# in bookworm (6.1, the newest ABI it lists), unless pinned.
kernel_pkg() {
    if [ -n "${GSONET_KERNEL_PKG:-}" ]; then echo "$GSONET_KERNEL_PKG"; return; fi
    apt-cache show linux-image-amd64 2>/dev/null \
        | awk -v rx="^linux-image-${SERIES//./\\.}[.]" '/^Depends:/ && $2 ~ rx {print $2}' \
        | sort -V | tail -1
}
KPKG="$(kernel_pkg)"
if [ -z "$KPKG" ]; then
    # fall back to the newest unsigned amd64 image of the series apt knows
    case "$SERIES" in
        6.12) rx='^linux-image-6\.12\.[0-9]+\+deb12(\.[0-9]+)?-amd64$' ;;
        6.1) rx='^linux-image-6\.1\.0-[0-9]+-amd64$' ;;
    esac
    KPKG="$(apt-cache search --names-only "$rx" | awk '{print $1}' | sort -V | tail -1)"
fi
if [ -z "$KPKG" ]; then
    # offline re-run: reuse the kernel already extracted into the cache
    KPKG="$(ls -d "$CACHE"/kernel-*/.done 2>/dev/null | sed 's|.*/kernel-||; s|/.done||' | sort -V | tail -1)"
fi
[ -n "$KPKG" ] || { echo "no linux-image-$SERIES.*-amd64 known to apt (bookworm-backports missing? run scripts/setup.sh)" >&2; exit 1; }

# Stamp: this script, the init and C sources, the kernel package name and the
# versions of the host packages copied into the image.
pkgver() { dpkg-query -W -f='${Package}=${Version} ' "$@" 2>/dev/null || true; }
STAMP="$( {
    cat "$HERE/build.sh" "$HERE/init" "$HERE"/*.c
    echo "$KPKG"
    pkgver busybox-static iperf3 libiperf0 ethtool libc6 libssl3 libsctp1 libmnl0
} | sha256sum | cut -d' ' -f1)"
if [ "${FORCE:-0}" != 1 ] && [ -f "$CACHE/stamp" ] && [ "$(cat "$CACHE/stamp")" = "$STAMP" ] \
    && [ -f "$CACHE/bzImage" ] && [ -f "$CACHE/initramfs.cpio.gz" ]; then
    say "up to date ($KPKG)"
    exit 0
fi

# 1. Kernel package -> bzImage + virtio_net and the modules it needs.
KDIR="$CACHE/kernel-$KPKG"
if [ ! -f "$KDIR/.done" ]; then
    say "downloading $KPKG"
    rm -rf "$KDIR"; mkdir -p "$KDIR"
    dl() { ( cd "$KDIR" && apt-get download -q -o APT::Sandbox::User=root "$KPKG" >/dev/null ); }
    if ! dl; then
        if [ "$(id -u)" = 0 ]; then
            say "download failed; apt-get update and retry"
            apt-get update -q >/dev/null
            KPKG="$(kernel_pkg)"; rm -rf "$KDIR"; KDIR="$CACHE/kernel-$KPKG"; mkdir -p "$KDIR"
        fi
        dl || { echo "apt-get download $KPKG failed (run scripts/setup.sh)" >&2; exit 1; }
    fi
    say "extracting $(ls "$KDIR"/*.deb | xargs -n1 basename)"
    dpkg -x "$KDIR"/*.deb "$KDIR/root"
    rm -f "$KDIR"/*.deb
    # keep only what the image uses: vmlinuz, config, virtio_net and what it needs
    # (6.1 has virtio, virtio_ring and virtio_pci as modules; 6.12 builds them in)
    find "$KDIR/root" -name '*.ko*' ! -name 'failover.ko*' ! -name 'net_failover.ko*' \
        ! -name 'virtio*.ko*' -delete
    find "$KDIR/root" -depth -type d -empty -delete
    touch "$KDIR/.done"
fi
VMLINUZ="$(ls "$KDIR"/root/boot/vmlinuz-* | head -1)"
KVER="${VMLINUZ##*/vmlinuz-}"
MODDIR="$KDIR/root/lib/modules/$KVER/kernel"
[ -d "$MODDIR" ] || MODDIR="$KDIR/root/usr/lib/modules/$KVER/kernel"

# 2. initramfs tree.
say "assembling initramfs for $KVER"
T="$CACHE/initramfs.tmp"
rm -rf "$T"
mkdir -p "$T"/{bin,sbin,usr/bin,usr/sbin,lib,lib64,lib/modules,proc,sys,dev,tmp,run,etc,root}
cp "$BUSYBOX" "$T/bin/busybox"
for applet in $("$BUSYBOX" --list); do
    [ "$applet" = busybox ] && continue
    ln -sf busybox "$T/bin/$applet"
done
# virtio_net, virtio_pci and virtio_mem with their dependencies, in load order (a module built
# into the kernel is not there and needs no loading; virtio_net must be one or the other).
: > "$T/lib/modules/load.order"
add_module() {
    local m="$1" ko dep
    grep -qx "$m" "$T/lib/modules/load.order" && return 0
    ko="$(find "$MODDIR" -name "$m.ko*" | head -1)"
    if [ -z "$ko" ]; then
        grep -qE "^CONFIG_$(echo "$m" | tr a-z A-Z)=y" "$KDIR"/root/boot/config-* 2>/dev/null \
            && return 0
        echo "module $m not found in $MODDIR" >&2; exit 1
    fi
    case "$ko" in
        *.xz)  xz -dc "$ko" > "$T/lib/modules/$m.ko" ;;
        *.zst) zstd -qdc "$ko" > "$T/lib/modules/$m.ko" ;;
        *.gz)  gzip -dc "$ko" > "$T/lib/modules/$m.ko" ;;
        *)     cp "$ko" "$T/lib/modules/$m.ko" ;;
    esac
    for dep in $(modinfo -F depends "$T/lib/modules/$m.ko" | tr ',' ' '); do
        add_module "$dep"
    done
    echo "$m" >> "$T/lib/modules/load.order"
}
add_module virtio_pci
add_module virtio_net
# virtio-mem devices (memory grown and shrunk at run time; test_memory_hotplug.py)
add_module virtio_mem

# Dynamic binaries with their shared libraries (ldd), replacing busybox applets
# of the same name where they exist.
copy_with_libs() {
    local bin="$1" dest="$2"
    rm -f "$T$dest"
    cp -L "$bin" "$T$dest"
    ldd "$bin" | awk '/=>/ {print $3} /^\t\/.*ld-linux/ {print $1}' | while read -r lib; do
        [ -f "$lib" ] || continue
        mkdir -p "$T$(dirname "$lib")"
        cp -Ln "$lib" "$T$lib" 2>/dev/null || true
        # make libs findable at /lib too
        [ -e "$T/lib/$(basename "$lib")" ] || cp -L "$lib" "$T/lib/"
    done
}
copy_with_libs "$(command -v iperf3)" /usr/bin/iperf3
copy_with_libs "$(command -v ethtool)" /usr/sbin/ethtool

# UDP GSO tools (static).
gcc -static -O2 -Wall -o "$T/usr/bin/udpgso_send" "$HERE/udpgso_send.c"
gcc -static -O2 -Wall -o "$T/usr/bin/udp_recv" "$HERE/udp_recv.c"
# Request/response latency (static; the host's end is the same binary).
gcc -static -O2 -Wall -o "$T/usr/bin/tcp_rr" "$HERE/tcp_rr.c"
strip "$T/usr/bin/udpgso_send" "$T/usr/bin/udp_recv" "$T/usr/bin/tcp_rr" 2>/dev/null || true

cp "$HERE/init" "$T/init"
chmod +x "$T/init"
echo "root:x:0:0:root:/root:/bin/sh" > "$T/etc/passwd"
echo "root:x:0:" > "$T/etc/group"
printf '127.0.0.1 localhost\n::1 localhost\n' > "$T/etc/hosts"

# 3. Pack.
( cd "$T" && find . -print0 | cpio --null -o -H newc --quiet ) | gzip -1 > "$CACHE/initramfs.cpio.gz.new"
mv "$CACHE/initramfs.cpio.gz.new" "$CACHE/initramfs.cpio.gz"
cp "$VMLINUZ" "$CACHE/bzImage"
cp "$T/usr/bin/tcp_rr" "$CACHE/tcp_rr"
echo "$KVER" > "$CACHE/kernel-version"
rm -rf "$T"
echo "$STAMP" > "$CACHE/stamp"
say "built $CACHE/bzImage ($KVER) and initramfs.cpio.gz ($(du -h "$CACHE/initramfs.cpio.gz" | cut -f1))"

#!/usr/bin/env bash
# Build the nested Xen rig: Xen 4.17 (Debian 12) + the guest image's 6.12 kernel as a
# PV dom0 and PV domUs with xen-netfront, booted under QEMU TCG by harness/xen.py.
# Output in guest-tests/.cache/xen/out/: xen.elf, vmlinuz, dom0.cpio.gz, domU.cpio.gz,
# qemu.cpio.gz (QEMU's userspace netback, appended to dom0's initrd only when asked).
# Packages come from the machine's apt sources (apt-get download + dpkg-deb -x);
# nothing Xen is installed on the host. A stamp makes a second run a no-op.
# Env: FORCE=1 rebuilds.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CACHE="$(cd "$HERE/.." && pwd)/.cache"
X="$CACHE/xen"
DEBS="$X/debs" STAGE="$X/stage" OUT="$X/out"
A=x86_64-linux-gnu
say() { printf '[xen-rig] %s\n' "$*"; }

for tool in busybox iperf3 ethtool cpio xz apt-get dpkg-deb readelf gzip; do
    command -v "$tool" >/dev/null || { echo "missing $tool: run scripts/setup.sh" >&2; exit 1; }
done

# dom0 and domU run the guest image's kernel (guest-tests/image/build.sh chose it).
[ -f "$CACHE/kernel-version" ] || "$HERE/../image/build.sh"
KVER="$(cat "$CACHE/kernel-version")"
KPKG="linux-image-$KVER"

# Xen's tools and their libraries; the libraries the host already has (libc, zlib,
# ...) are taken from the host.
XEN_PKGS=(xen-hypervisor-4.17-amd64 xen-utils-4.17 xen-utils-common xenstore-utils
    libxenstore4 libxengnttab1 libxenevtchn1 libxentoolcore1 libxentoollog1
    libxenforeignmemory1 libxencall1 libxendevicemodel1 libxenhypfs1 libxenmisc4.17
    libyajl2)
# QEMU's userspace netback (xen-net-device), the baseline gsonet is compared with.
QEMU_PKGS=(qemu-system-xen/bookworm-backports libspice-server1 libopus0 liborc-0.4-0
    libgstreamer-plugins-base1.0-0)

STAMP="$( {
    cat "$HERE"/build.sh "$HERE"/dom0-init "$HERE"/domU-init "$HERE"/vif-* "$HERE"/*.cfg
    echo "$KPKG"
    # what apt would fetch now (one call: it is slow on a busy machine)
    apt-cache policy "$KPKG" "${XEN_PKGS[@]}" "${QEMU_PKGS[@]%%/*}" 2>/dev/null
    dpkg-query -W -f='${Package}=${Version} ' busybox-static iperf3 libiperf0 ethtool libc6 \
        libgcc-s1 2>/dev/null || true
} | sha256sum | cut -d' ' -f1)"
if [ "${FORCE:-0}" != 1 ] && [ -f "$X/stamp" ] && [ "$(cat "$X/stamp")" = "$STAMP" ] \
    && [ -f "$OUT/xen.elf" ] && [ -f "$OUT/dom0.cpio.gz" ] && [ -f "$OUT/domU.cpio.gz" ]; then
    say "up to date (Xen 4.17, dom0/domU $KVER)"
    exit 0
fi

# 1. Download (kept in $DEBS; a package already there is not fetched again).
mkdir -p "$DEBS"
download() {
    local spec name have
    for spec in "$@"; do
        name="${spec%%/*}"
        have="$(ls "$DEBS/${name}_"*.deb 2>/dev/null | head -1 || true)"
        [ -n "$have" ] && continue
        say "apt-get download $spec"
        ( cd "$DEBS" && apt-get download -q -o APT::Sandbox::User=root "$spec" >/dev/null )
    done
}
if ! download "$KPKG" "${XEN_PKGS[@]}" "${QEMU_PKGS[@]}"; then
    [ "$(id -u)" = 0 ] || { echo "apt-get download failed (run scripts/setup.sh)" >&2; exit 1; }
    say "download failed; apt-get update and retry"
    apt-get update -q >/dev/null
    download "$KPKG" "${XEN_PKGS[@]}" "${QEMU_PKGS[@]}"
fi

# 2. Extract everything into one staging tree.
rm -rf "$STAGE"; mkdir -p "$STAGE"
for d in "$DEBS"/*.deb; do dpkg-deb -x "$d" "$STAGE"; done
MODDIR="$STAGE/lib/modules/$KVER/kernel"
[ -d "$MODDIR" ] || MODDIR="$STAGE/usr/lib/modules/$KVER/kernel"
XENGZ="$(find "$STAGE/boot" -name 'xen-4.17*-amd64.gz' | sort | head -1)"
[ -n "$XENGZ" ] || { echo "no xen-4.17*.gz in xen-hypervisor-4.17-amd64" >&2; exit 1; }

find_lib() { # a shared library by soname: staged packages first, then the host
    local r d
    for r in "$STAGE" ""; do
        for d in lib/$A usr/lib/$A usr/lib/xen-4.17/lib/$A usr/lib/xen-4.17/lib lib usr/lib; do
            [ -e "$r/$d/$1" ] && { echo "$r/$d/$1"; return 0; }
        done
    done
    return 1
}
copy_needed() { # ROOT BINARY: its DT_NEEDED libraries, recursively, into ROOT/lib/$A
    local root="$1" bin="$2" so src
    for so in $(readelf -d "$bin" | sed -n 's/.*Shared library: \[\(.*\)\]/\1/p'); do
        [ -e "$root/lib/$A/$so" ] && continue
        src="$(find_lib "$so")" || { echo "no $so (needed by $bin)" >&2; exit 1; }
        install -D -m 0644 "$(readlink -f "$src")" "$root/lib/$A/$so"
        copy_needed "$root" "$src"
    done
}
add_bin() { # ROOT SRC DEST
    install -D -m 0755 "$(readlink -f "$2")" "$1$3"
    copy_needed "$1" "$1$3"
}
add_mod() { # ROOT NAME: the module and its depends=, in load order
    local root="$1" name="$2" f dep
    grep -qx "$name" "$root/mod/load.order" 2>/dev/null && return 0
    f="$(find "$MODDIR" -name "$name.ko*" | head -1)"
    [ -n "$f" ] || { echo "no module $name in $MODDIR" >&2; exit 1; }
    case "$f" in
        *.xz) xz -dc "$f" > "$root/mod/$name.ko" ;;
        *.zst) zstd -qdc "$f" > "$root/mod/$name.ko" ;;
        *) cp "$f" "$root/mod/$name.ko" ;;
    esac
    for dep in $(readelf -p .modinfo "$root/mod/$name.ko" | sed -n 's/.*depends=//p' | tr ',' ' '); do
        add_mod "$root" "$dep"
    done
    echo "$name" >> "$root/mod/load.order"
}
base_tree() { # ROOT: busybox, iperf3, ethtool, the dynamic loader
    local root="$1" applet
    rm -rf "$root"
    mkdir -p "$root"/{bin,sbin,usr/bin,usr/sbin,lib/$A,lib64,mod,proc,sys,dev,tmp,run,etc,root,var/log}
    cp "$(command -v busybox)" "$root/bin/busybox"
    for applet in $(busybox --list); do
        [ "$applet" = busybox ] || ln -sf busybox "$root/bin/$applet"
    done
    : > "$root/mod/load.order"
    install -m 0755 "$(readlink -f /lib64/ld-linux-x86-64.so.2)" "$root/lib64/ld-linux-x86-64.so.2"
    rm -f "$root/bin/iperf3" "$root/bin/ethtool"
    add_bin "$root" "$(command -v iperf3)" /usr/bin/iperf3
    add_bin "$root" "$(command -v ethtool)" /usr/sbin/ethtool
    echo "root:x:0:0:root:/root:/bin/sh" > "$root/etc/passwd"
    echo "root:x:0:" > "$root/etc/group"
    printf '127.0.0.1 localhost\n' > "$root/etc/hosts"
}
pack() { # TREE OUT
    (cd "$1" && find . -print0 | LC_ALL=C sort -z | cpio --null -o -H newc --owner=0:0 --quiet) \
        | gzip -6 > "$2.new"
    mv "$2.new" "$2"
}

mkdir -p "$OUT"
WORK="$X/work"; rm -rf "$WORK"; mkdir -p "$WORK"

# 3. domU: busybox + xen-netfront, its own init.
U="$WORK/domU"
base_tree "$U"
add_mod "$U" xen-netfront
install -m 0755 "$HERE/domU-init" "$U/init"
pack "$U" "$OUT/domU.cpio.gz"

# 4. dom0: busybox + the Xen tools + the backend modules, the domU payload.
R="$WORK/dom0"
base_tree "$R"
for m in xen-evtchn xen-gntdev xen-gntalloc xen-privcmd xenfs xen-netback bridge tun; do
    add_mod "$R" "$m"
done
XB=/usr/lib/xen-4.17/bin
for b in xl xenstored xenconsoled xen-init-dom0 libxl-save-helper xenstore-control; do
    add_bin "$R" "$STAGE$XB/$b" "$XB/$b"
done
# the xenstore client is one binary; xenstore-read & co. are its names
add_bin "$R" "$STAGE/usr/bin/xenstore" /usr/bin/xenstore
for t in read write ls list rm exists watch chmod; do ln -sf xenstore "$R/usr/bin/xenstore-$t"; done
# xl calls pthread_cancel at exit, which dlopens libgcc_s
install -m 0644 "$(readlink -f "$(find_lib libgcc_s.so.1)")" "$R/lib/$A/libgcc_s.so.1"
mkdir -p "$R"/etc/xen/scripts "$R"/var/lib/xen "$R"/var/lib/xenstored "$R"/var/log/xen \
    "$R"/var/run "$R"/proc/xen "$R"/xt
cp "$STAGE/etc/xen/xl.conf" "$R/etc/xen/xl.conf"
for s in "$HERE"/vif-*; do install -m 0755 "$s" "$R/etc/xen/scripts/$(basename "$s")"; done
install -m 0755 "$HERE/dom0-init" "$R/init"
cp "$HERE"/*.cfg "$R/xt/"
VMLINUZ="$STAGE/boot/vmlinuz-$KVER"
cp "$VMLINUZ" "$R/xt/vmlinuz"
cp "$OUT/domU.cpio.gz" "$R/xt/domU.cpio.gz"
pack "$R" "$OUT/dom0.cpio.gz"

# 5. QEMU's Xen device model, as a second cpio appended to dom0's initrd on demand.
Q="$WORK/qemu"
mkdir -p "$Q/lib/$A"
QBIN="$STAGE/usr/libexec/xen-qemu-system-i386"
[ -x "$QBIN" ] || { echo "qemu-system-xen: no $QBIN in the package" >&2; exit 1; }
add_bin "$Q" "$QBIN" /usr/libexec/xen-qemu-system-i386
# libraries dom0's image already carries need not come twice
for so in "$Q/lib/$A"/*; do [ -e "$R/lib/$A/$(basename "$so")" ] && rm -f "$so"; done
mkdir -p "$Q/usr/share/qemu"
pack "$Q" "$OUT/qemu.cpio.gz"

zcat "$XENGZ" > "$OUT/xen.elf.new" && mv "$OUT/xen.elf.new" "$OUT/xen.elf"
cp "$VMLINUZ" "$OUT/vmlinuz"
echo "$KVER" > "$OUT/kernel-version"
rm -rf "$WORK"
echo "$STAMP" > "$X/stamp"
say "built $OUT: xen.elf, vmlinuz ($KVER), dom0.cpio.gz ($(du -h "$OUT/dom0.cpio.gz" | cut -f1)), domU.cpio.gz, qemu.cpio.gz ($(du -h "$OUT/qemu.cpio.gz" | cut -f1))"

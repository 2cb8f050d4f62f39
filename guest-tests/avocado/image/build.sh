#!/usr/bin/env bash
# Build the guest of `make avocado`: a small Debian bookworm userland (mmdebstrap,
# from the Debian mirror this machine's apt uses) with openssh-server, tcpdump,
# ethtool, procps and psmisc, which avocado-vt logs in to over ssh and copies files
# to with scp, on the kernel and virtio_net modules of the gsonet guest image
# (guest-tests/image/build.sh). One initramfs, no disk: the guest runs from RAM.
# Output: guest-tests/.cache/avocado/{bzImage,initramfs.cpio.gz,stamp}; rebuilt only
# when this script, the init or the gsonet guest image change (FORCE=1 rebuilds).
# root's password in the guest is `gsonet` (a test guest on a host-only network).
# bash's bracketed paste is off: its escape codes before the prompt would hide the
# prompt from avocado-vt's shell_prompt on the serial console.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
GT="$(cd "$HERE/../.." && pwd)"
BASE="$GT/.cache"
OUT="$BASE/avocado"
say() { printf '[avocado-image] %s\n' "$*"; }

[ "$(id -u)" = 0 ] || { echo "build.sh must run as root (mmdebstrap chroot)" >&2; exit 1; }
command -v mmdebstrap >/dev/null || { echo "missing mmdebstrap: run scripts/setup.sh" >&2; exit 1; }
"$GT/image/build.sh" >/dev/null
PACKAGES=openssh-server,openssh-sftp-server,tcpdump,ethtool,procps,psmisc,iproute2,kmod,netbase

STAMP="$( { cat "$HERE/build.sh" "$HERE/init" "$BASE/stamp"; } | sha256sum | cut -d' ' -f1)"
if [ "${FORCE:-0}" != 1 ] && [ -f "$OUT/stamp" ] && [ "$(cat "$OUT/stamp")" = "$STAMP" ] \
    && [ -f "$OUT/bzImage" ] && [ -f "$OUT/initramfs.cpio.gz" ]; then
    say "up to date"
    exit 0
fi

# The machine's own apt sources for bookworm: mmdebstrap reads a sources file given
# in place of a mirror.
SOURCES="$(mktemp)"
trap 'rm -f "$SOURCES"' EXIT
apt-get indextargets --format '$(REPO_URI) $(RELEASE) $(TARGET_OF)' 'Codename: bookworm' \
    'Component: main' 2>/dev/null | awk '$3 == "deb" {print "deb " $1 " bookworm main"; exit}' > "$SOURCES"
if [ ! -s "$SOURCES" ]; then
    apt-get update -q >/dev/null
    apt-get indextargets --format '$(REPO_URI) $(RELEASE) $(TARGET_OF)' 'Codename: bookworm' \
        'Component: main' | awk '$3 == "deb" {print "deb " $1 " bookworm main"; exit}' > "$SOURCES"
fi
[ -s "$SOURCES" ] || { echo "no bookworm main entry in apt's sources" >&2; exit 1; }

T="$OUT/root.tmp"
rm -rf "$T"
mkdir -p "$OUT"
say "mmdebstrap bookworm ($PACKAGES)"
mmdebstrap --variant=minbase --include="$PACKAGES" \
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-exclude=/usr/share/info/*' \
    --customize-hook='echo root:gsonet | chroot "$1" chpasswd' \
    --customize-hook='printf "PermitRootLogin yes\nPasswordAuthentication yes\nUseDNS no\n" > "$1/etc/ssh/sshd_config.d/gsonet.conf"' \
    --customize-hook='echo "set enable-bracketed-paste off" >> "$1/etc/inputrc"' \
    --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*' \
    bookworm "$T" "$SOURCES"

# The gsonet guest kernel's virtio_net and the modules it needs, in load order.
mkdir -p "$T/lib/modules/gsonet"
( cd "$T/lib/modules/gsonet" && gzip -dc "$BASE/initramfs.cpio.gz" \
    | cpio -id --quiet --no-absolute-filenames 'lib/modules/*' \
    && mv lib/modules/* . && rm -rf lib )
cp "$HERE/init" "$T/init"
chmod +x "$T/init"
( cd "$T" && find . -print0 | cpio --null -o -H newc --quiet ) | gzip -1 > "$OUT/initramfs.cpio.gz.new"
mv "$OUT/initramfs.cpio.gz.new" "$OUT/initramfs.cpio.gz"
cp "$BASE/bzImage" "$OUT/bzImage"
rm -rf "$T"
echo "$STAMP" > "$OUT/stamp"
say "built $OUT/initramfs.cpio.gz ($(du -h "$OUT/initramfs.cpio.gz" | cut -f1))"

#!/usr/bin/env bash
# Install everything gsonet's guest tests and demo need on a Debian 12 machine,
# then build the guest image. Idempotent: a second run on a ready machine only
# checks and returns within seconds. Run as root.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
say() { printf '[setup] %s\n' "$*"; }

if [ "$(id -u)" != 0 ]; then
    echo "setup.sh must run as root" >&2
    exit 1
fi
export DEBIAN_FRONTEND=noninteractive

BPO_LIST=/etc/apt/sources.list.d/bookworm-backports.list
BPO_LINE="deb http://deb.debian.org/debian bookworm-backports main"
need_update=0

# 1. bookworm-backports (QEMU 10, kernel 6.12 for the guest).
if ! grep -rqs "bookworm-backports" /etc/apt/sources.list /etc/apt/sources.list.d/; then
    say "adding bookworm-backports to $BPO_LIST"
    echo "$BPO_LINE" > "$BPO_LIST"
    need_update=1
fi
if ! ls /var/lib/apt/lists/ 2>/dev/null | grep -q 'bookworm-backports.*Packages'; then
    need_update=1
fi

# The image build reads the backports kernel package from apt's lists.
if [ "$need_update" = 1 ]; then
    say "apt-get update (backports lists missing)"
    apt-get update -q
fi

# 2. Packages. Each entry: "package[/release]".
APT_PKGS=(
    iperf3 ethtool busybox-static iproute2 tcpdump
    python3 python3-pytest python3-scapy
    gcc libc6-dev cpio xz-utils zstd kmod
)
missing=()
need_qemu=0
for spec in "${APT_PKGS[@]}"; do
    pkg="${spec%%/*}"
    if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q 'install ok installed'; then
        missing+=("$spec")
    fi
done
# QEMU must be the backports one (>= 10: USO, vhost-user fixes).
qver="$(dpkg-query -W -f='${Version}' qemu-system-x86 2>/dev/null || true)"
if [ -z "$qver" ] || ! dpkg --compare-versions "$qver" ge "1:10"; then
    say "qemu-system-x86 ${qver:-not installed}: need >= 10 from bookworm-backports"
    need_qemu=1
fi

if [ "${#missing[@]}" -gt 0 ] || [ "$need_qemu" = 1 ]; then
    install() {
        if [ "$need_qemu" = 1 ]; then
            say "installing qemu-system-x86 from bookworm-backports"
            apt-get install -y -q --no-install-recommends -t bookworm-backports \
                qemu-system-x86 || return 1
        fi
        if [ "${#missing[@]}" -gt 0 ]; then
            say "installing: ${missing[*]}"
            apt-get install -y -q --no-install-recommends "${missing[@]}" || return 1
        fi
    }
    if ! install; then
        say "install failed, refreshing package lists and retrying"
        apt-get update -q
        install
    fi
else
    say "apt packages: all present"
fi
say "qemu: $(qemu-system-x86_64 --version | head -1)"

# 2b. DPDK (dpdk-testpmd: its net_virtio_user vdev is a second vhost-user frontend
# for guest-tests/test_dpdk_frontend.py). Optional: those tests skip without it.
if dpkg-query -W -f='${Status}' dpdk 2>/dev/null | grep -q 'install ok installed' \
    && command -v dpdk-testpmd >/dev/null; then
    say "dpdk: present"
elif apt-get install -y -q --no-install-recommends dpdk \
    || { apt-get update -q && apt-get install -y -q --no-install-recommends dpdk; }; then
    say "dpdk: installed"
else
    say "WARNING: could not install dpdk; test_dpdk_frontend.py will skip"
fi

# 3. Python test dependencies that apt may lack (none today; pip as fallback).
for mod in pytest scapy; do
    if ! python3 -c "import $mod" 2>/dev/null; then
        say "pip install $mod"
        pip install --break-system-packages -q "$mod" || pip install -q "$mod"
    fi
done

# 4. /dev/net/tun
if [ ! -e /dev/net/tun ]; then
    say "loading tun"
    modprobe tun 2>/dev/null || true
fi

# 5. Guest image (kernel + initramfs); rebuilt only when its inputs change.
say "guest image"
[ -x "$ROOT/guest-tests/image/build.sh" ] && "$ROOT/guest-tests/image/build.sh"
say "done"

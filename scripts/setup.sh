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
need_update=0

# suite_uri SUITE: the URI of the first enabled `deb` entry for SUITE in this
# machine's apt sources, one-line (sources.list, *.list) or deb822 (*.sources).
suite_uri() {
    local f uri
    for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
        [ -f "$f" ] || continue
        uri="$(awk -v suite="$1" '
            $1 == "deb" {
                i = 2
                if ($i ~ /^\[/) { while (i < NF && $i !~ /\]$/) i++; i++ }
                if ($(i + 1) == suite) { print $i; exit }
            }' "$f")"
        [ -n "$uri" ] && { echo "$uri"; return; }
    done
    for f in /etc/apt/sources.list.d/*.sources; do
        [ -f "$f" ] || continue
        uri="$(awk -v suite="$1" '
            BEGIN { RS = ""; FS = "\n" }
            {
                types = ""; uris = ""; suites = ""; enabled = "yes"
                for (i = 1; i <= NF; i++) {
                    if ($i ~ /^[ \t]*#/ || !match($i, /^[A-Za-z-]+:/)) continue
                    key = tolower(substr($i, 1, RLENGTH - 1))
                    val = " " substr($i, RLENGTH + 1) " "
                    gsub(/[ \t]+/, " ", val)
                    if (key == "types") types = val
                    else if (key == "uris") uris = val
                    else if (key == "suites") suites = val
                    else if (key == "enabled") enabled = val
                }
                if (types ~ / deb / && index(suites, " " suite " ") && enabled !~ /no/) {
                    split(uris, u, " "); print u[1]; exit
                }
            }' "$f")"
        [ -n "$uri" ] && { echo "$uri"; return; }
    done
    return 0
}

# 1. bookworm-backports (QEMU 10, kernel 6.12 for the guest), from the mirror the
# machine already uses for bookworm.
if [ -z "$(suite_uri bookworm-backports)" ]; then
    mirror="$(suite_uri bookworm)"
    if [ -z "$mirror" ]; then
        echo "no bookworm entry in /etc/apt/sources.list{,.d/}: cannot tell which Debian" \
            "mirror to take bookworm-backports from; add 'deb MIRROR bookworm-backports main'" \
            "to $BPO_LIST" >&2
        exit 1
    fi
    say "adding bookworm-backports from $mirror to $BPO_LIST"
    echo "deb $mirror bookworm-backports main" > "$BPO_LIST"
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
    prometheus libvirt-clients libxml2-utils
    systemd iputils-ping
    frr
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

# 2b. DPDK (dpdk-testpmd, shipped in dpdk-dev: its net_virtio_user vdev is a second
# vhost-user frontend for guest-tests/test_dpdk_frontend.py, its vhost PMD a backend
# for scripts/bench.py). Optional: those tests skip without it.
if command -v dpdk-testpmd >/dev/null; then
    say "dpdk-testpmd: present"
elif apt-get install -y -q --no-install-recommends dpdk-dev \
    || { apt-get update -q && apt-get install -y -q --no-install-recommends dpdk-dev; }; then
    say "dpdk-testpmd: installed (dpdk-dev)"
else
    say "WARNING: could not install dpdk-dev; test_dpdk_frontend.py will skip"
fi

# 2c. libvirtd (guest-tests/test_libvirt.py starts its own on a private socket and
# defines a domain on gsonet). Optional: that test skips without it.
if command -v libvirtd >/dev/null && [ -e /usr/lib/x86_64-linux-gnu/libvirt/connection-driver/libvirt_driver_qemu.so ]; then
    say "libvirtd: present"
elif apt-get install -y -q --no-install-recommends libvirt-daemon-system libvirt-daemon-driver-qemu \
    || { apt-get update -q && apt-get install -y -q --no-install-recommends libvirt-daemon-system libvirt-daemon-driver-qemu; }; then
    say "libvirtd: installed (libvirt-daemon-system)"
else
    say "WARNING: could not install libvirt-daemon-system; test_libvirt.py will skip its guest"
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
# the second guest kernel (Debian 12's stable 6.1) for `make test-full` and make test's USO test
[ -x "$ROOT/guest-tests/image/build.sh" ] && GSONET_GUEST_KERNEL=6.1 "$ROOT/guest-tests/image/build.sh"

# 6. The nested Xen rig (Xen 4.17, PV dom0/domU images) from apt packages, extracted,
# never installed; a no-op when up to date.
say "xen rig"
[ -x "$ROOT/guest-tests/xen/build.sh" ] && "$ROOT/guest-tests/xen/build.sh"
say "done"

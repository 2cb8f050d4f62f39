# Helpers for dom0 test scripts (sourced: `. /xt/lib.sh`). A script reports with
# `result KEY VALUE` (a `RESULT KEY=VALUE` line harness/xen.py collects) and fails by
# exiting non-zero; `fail MSG` does both with a reason.
# Network: domUs are 10.99.0.N/24, dom0's end (a tap of gsonet, the bridge xtbr0 of
# the kernel netback, or QEMU's tap) is 10.99.0.1.

XT_NET=10.99.0
XT_CMDPORT=7000
GSONET_CTL=/tmp/gsonet-control.sock

up() { cut -d' ' -f1 /proc/uptime; }
# XT_ROUND: a round's results get the suffix :rN (scripts/xen_bench.py runs each
# scenario several times in one boot).
result() { echo "RESULT $1${XT_ROUND:+:r$XT_ROUND}=$2"; }
note() { echo "XT-NOTE $(up) $*"; }
fail() { echo "XT-FAIL $*"; dump_logs; exit 1; }

# A descriptor that never reaches end-of-file: busybox nc ends at EOF on its stdin,
# so a receiving nc reads from this one.
[ -p /tmp/xt.hold ] || mkfifo /tmp/xt.hold
exec 9<>/tmp/xt.hold

# domu_cfg NAME IP MAC SCRIPT [MEMORY] [EXTRA-KERNEL-ARGS]: /tmp/NAME.cfg, one vif.
# SCRIPT "none" gives a domU without vif (QEMU's netback attaches by hand).
# XT_DOMU_VCPUS: the domU's vCPUs (default 1); its netfront asks for a queue per
# vCPU, up to the backend's multi-queue-max-queues.
domu_cfg() {
    local vif="'mac=$3,script=$4'"
    [ "$4" = none ] && vif=""
    # XT_DOMU_CPUS: the physical CPUs the domU may run on (the profile pins it)
    local cpus=""
    [ -n "${XT_DOMU_CPUS:-}" ] && cpus="cpus = \"$XT_DOMU_CPUS\""
    cat > "/tmp/$1.cfg" <<EOF
name = "$1"
type = "pv"
kernel = "/xt/vmlinuz"
ramdisk = "/xt/domU.cpio.gz"
extra = "console=hvc0 loglevel=4 xt.ip=$2/24 xt.name=$1 $6"
memory = ${5:-256}
vcpus = ${XT_DOMU_VCPUS:-1}
$cpus
vif = [$vif]
on_reboot = "restart"
on_crash = "preserve"
EOF
}

# domu_create NAME: xl create /tmp/NAME.cfg; prints nothing, fails the script on error.
domu_create() {
    xl create "/tmp/$1.cfg" > "/tmp/xl-create-$1.log" 2>&1 \
        || { cat "/tmp/xl-create-$1.log"; fail "xl create $1"; }
    note "created $1 domid $(xl domid "$1")"
}

# on_domu IP CMD...: run CMD in the domU's shell (its command port); prints the
# output, returns CMD's exit code (255: no answer).
on_domu() {
    local ip="$1" out rc
    shift
    out="$(printf '%s\necho "XT-RC=$?"\nexit\n' "$*" | timeout 600 nc "$ip" "$XT_CMDPORT" 2>/dev/null)"
    rc="$(printf '%s\n' "$out" | sed -n 's/^XT-RC=//p' | tail -1)"
    printf '%s\n' "$out" | grep -v '^XT-RC='
    return "${rc:-255}"
}

# wait_domu IP [SECONDS]: until the domU answers on its command port.
wait_domu() {
    local i=0
    while [ "$i" -lt "${2:-300}" ]; do
        [ "$(on_domu "$1" echo alive 2>/dev/null)" = alive ] && return 0
        sleep 1; i=$((i + 1))
    done
    return 1
}

# wait_ping IP [TRIES]: one ping a second until one answers.
wait_ping() {
    local i=0
    while [ "$i" -lt "${2:-300}" ]; do
        ping -c1 -W1 "$1" >/dev/null 2>&1 && return 0
        i=$((i + 1))
    done
    return 1
}

# iperf_mbps ARGS...: run iperf3 -f m ARGS (in dom0) and print the receiver's Mbit/s
# (its sender/receiver lines go to stderr, i.e. the console, as XT-IPERF).
iperf_mbps() {
    iperf3 -f m "$@" > /tmp/iperf.out 2>&1
    grep -E 'sender|receiver' /tmp/iperf.out | sed 's/^/XT-IPERF /' >&2
    awk '/receiver/ {v = $(NF-2)} END {print v}' /tmp/iperf.out | grep . \
        || { cat /tmp/iperf.out >&2; echo 0; }
}

# cpu_now: CPU seconds used so far: dom0's vCPUs busy (from /proc/stat: all but idle
# and iowait, steal included), gsonet's threads (user + system, 0 when it is not
# running), every domain's vCPUs (`xl list`'s Time(s)), dom0's own vCPUs as Xen
# counts them (`xl list`, Domain-0) and dom0's steal (/proc/stat). With dom0's vCPUs
# sharing the CPUs with domUs (GSONET_XEN_DOM0_VCPUS=2), dom0's kernel counts a
# task's time by its own clock, which runs on while Xen runs another domain: a
# task's user + system time then takes in time stolen from it, and only Xen's count
# is dom0's use of the CPUs (docs/xen.md, "Measuring with two dom0 vCPUs").
cpu_now() { # dom0 s, gsonet s, all domains s, gsonet minor faults, dom0 context switches, dom0 s (Xen), dom0 steal s
    local dom0 gs=0 flt=0 doms ctxt xdom0 steal
    dom0="$(awk '/^cpu / {print ($2 + $3 + $4 + $7 + $8 + $9) / 100}' /proc/stat)"
    steal="$(awk '/^cpu / {print $9 / 100}' /proc/stat)"
    ctxt="$(awk '/^ctxt / {print $2}' /proc/stat)"
    if [ -n "${GSONET_PID:-}" ] && [ -r "/proc/$GSONET_PID/stat" ]; then
        set -- $(awk '{print ($14 + $15) / 100, $10}' "/proc/$GSONET_PID/stat")
        gs="$1" flt="$2"
    fi
    set -- $(xl list | awk 'NR > 1 {t += $NF} $2 == 0 {d = $NF} END {print t + 0, d + 0}')
    doms="$1" xdom0="$2"
    echo "$dom0 $gs $doms $flt $ctxt $xdom0 $steal"
}

# measure KEY CMD...: `result KEY "$(CMD...)"`, and the CPU seconds it cost as
# KEY.cpu_dom0, KEY.cpu_gsonet, KEY.cpu_domains, KEY.cpu_dom0_xen, KEY.cpu_steal (see
# cpu_now); with gsonet's minor page faults (KEY.gsonet_minflt) and dom0's context
# switches (KEY.dom0_ctxt).
measure() {
    local key="$1" a b v
    shift
    if [ -n "${XT_PROFILE:-}" ]; then
        # for scripts/xen_profile.py: where the kernel and its modules sit
        if [ ! -f /tmp/xt.ksyms-sent ]; then
            awk '$2 ~ /^[tT]$/ {print $1, $3, $4}' /proc/kallsyms | gzip -c | base64 \
                | sed 's/^/XT-KALLSYMS /'
            touch /tmp/xt.ksyms-sent
        fi
        # and where gsonet's code and its libraries sit, for its user-space samples
        if [ -n "${GSONET_PID:-}" ] && [ -r "/proc/$GSONET_PID/maps" ]; then
            awk -v k="$key" '$2 ~ /x/ && $6 != "" {print "XT-MAPS", k, $1, $3, $6}' \
                "/proc/$GSONET_PID/maps"
        fi
    fi
    echo "XT-MEASURE start $key"
    a="$(cpu_now)"
    v="$("$@")"
    b="$(cpu_now)"
    echo "XT-MEASURE stop $key"
    result "$key" "$v"
    set -- $a $b
    result "$key.cpu_dom0" "$(awk "BEGIN {print $8 - $1}")"
    result "$key.cpu_gsonet" "$(awk "BEGIN {print $9 - $2}")"
    result "$key.cpu_domains" "$(awk "BEGIN {print ${10} - $3}")"
    result "$key.gsonet_minflt" "$(awk "BEGIN {print ${11} - $4}")"
    result "$key.dom0_ctxt" "$(awk "BEGIN {print ${12} - $5}")"
    result "$key.cpu_dom0_xen" "$(awk "BEGIN {print ${13} - $6}")"
    result "$key.cpu_steal" "$(awk "BEGIN {print ${14} - $7}")"
}

# domu_queue_irqs IP: the domU's interrupt counts of its netfront's event channels,
# as NAME=COUNT words (netfront names them vifDEVID-qN-tx/-rx: vif0-q0-tx=12
# vif0-q0-rx=40 ...): which queues carried traffic, as the netfront saw it.
domu_queue_irqs() {
    on_domu "$1" cat /proc/interrupts | awk '$NF ~ /^vif[0-9]+-q[0-9]+/ {
        s = 0; for (i = 2; i <= NF; i++) if ($i ~ /^[0-9]+$/) s += $i
        printf "%s=%d ", $NF, s } END { print "" }'
}

# iperf_domu_mbps IP ARGS...: the same, run in the domU at IP.
iperf_domu_mbps() {
    local ip="$1"
    shift
    on_domu "$ip" iperf3 -f m "$@" > /tmp/iperf.out 2>&1
    grep -E 'sender|receiver' /tmp/iperf.out | sed 's/^/XT-IPERF /' >&2
    awk '/receiver/ {v = $(NF-2)} END {print v}' /tmp/iperf.out | grep . \
        || { cat /tmp/iperf.out >&2; echo 0; }
}

# md5_to_domu IP MIB: MIB MiB of random data from dom0 to the domU; 0 if the md5s match.
md5_to_domu() {
    local ip="$1" mib="$2" want got
    head -c $((mib * 1048576)) /dev/urandom > /tmp/xt.send
    want="$(md5sum < /tmp/xt.send | cut -d' ' -f1)"
    on_domu "$ip" "rm -f /tmp/rx.md5; [ -p /tmp/hold ] || mkfifo /tmp/hold;" \
        "(nc -l -p 7001 0<>/tmp/hold | md5sum > /tmp/rx.part; mv /tmp/rx.part /tmp/rx.md5) </dev/null >/dev/null 2>&1 &"
    sleep 1
    timeout 600 nc "$ip" 7001 < /tmp/xt.send
    local i=0
    while [ $i -lt 120 ]; do
        got="$(on_domu "$ip" "cat /tmp/rx.md5 2>/dev/null" | cut -d' ' -f1)"
        [ -n "$got" ] && break
        sleep 1; i=$((i + 1))
    done
    rm -f /tmp/xt.send
    note "md5 dom0->$ip ${mib}MiB want $want got $got"
    [ -n "$got" ] && [ "$got" = "$want" ]
}

# md5_from_domu IP MIB: MIB MiB of random data from the domU to dom0; 0 if they match.
md5_from_domu() {
    local ip="$1" mib="$2" want got
    want="$(on_domu "$ip" "head -c $((mib * 1048576)) /dev/urandom > /tmp/tx.bin; md5sum < /tmp/tx.bin;" \
        "(nc -l -p 7002 < /tmp/tx.bin; rm -f /tmp/tx.bin) </dev/null >/dev/null 2>&1 &" | cut -d' ' -f1)"
    sleep 1
    got="$(timeout 600 nc "$ip" 7002 <&9 | md5sum | cut -d' ' -f1)"
    note "md5 $ip->dom0 ${mib}MiB want $want got $got"
    [ -n "$want" ] && [ "$got" = "$want" ]
}

# md5_domu_to_domu SRC-IP DST-IP MIB: from one domU to another.
md5_domu_to_domu() {
    local src="$1" dst="$2" mib="$3" want got
    on_domu "$dst" "rm -f /tmp/rx.md5; [ -p /tmp/hold ] || mkfifo /tmp/hold;" \
        "(nc -l -p 7001 0<>/tmp/hold | md5sum > /tmp/rx.part; mv /tmp/rx.part /tmp/rx.md5) </dev/null >/dev/null 2>&1 &"
    sleep 1
    want="$(on_domu "$src" "head -c $((mib * 1048576)) /dev/urandom > /tmp/tx.bin; md5sum < /tmp/tx.bin;" \
        "timeout 600 nc $dst 7001 < /tmp/tx.bin; rm -f /tmp/tx.bin" | cut -d' ' -f1)"
    local i=0
    while [ $i -lt 120 ]; do
        got="$(on_domu "$dst" "cat /tmp/rx.md5 2>/dev/null" | cut -d' ' -f1)"
        [ -n "$got" ] && break
        sleep 1; i=$((i + 1))
    done
    note "md5 $src->$dst ${mib}MiB want $want got $got"
    [ -n "$want" ] && [ "$got" = "$want" ]
}

# kernel_netback: Linux's xen-netback, its vifs on the bridge xtbr0 (10.99.0.1).
kernel_netback() {
    insmod /mod/xen-netback.ko || fail "insmod xen-netback"
    brctl addbr xtbr0
    ip addr add "$XT_NET.1/24" dev xtbr0
    ip link set xtbr0 up
}

# gsonet_start ARGS...: /xt/gsonet serve ARGS with a control socket, in the background
# (log /tmp/gsonet.log); waits until it answers `gsonet stats`.
gsonet_start() {
    # gsonet grants its copy buffers to dom0 itself (docs/xen.md): about 2.5k pages
    # per vif and tap queue, above gntalloc's default limit of 1024
    # (XT_GNTALLOC_LIMIT: another limit, e.g. one too low)
    [ -w /sys/module/xen_gntalloc/parameters/limit ] &&
        echo "${XT_GNTALLOC_LIMIT:-65536}" > /sys/module/xen_gntalloc/parameters/limit
    RUST_LOG=gsonet=info /xt/gsonet serve --control "$GSONET_CTL" "$@" > /tmp/gsonet.log 2>&1 &
    GSONET_PID=$!
    local i=0
    while [ $i -lt 100 ]; do
        /xt/gsonet stats --control "$GSONET_CTL" >/dev/null 2>&1 && return 0
        kill -0 "$GSONET_PID" 2>/dev/null || break
        usleep 200000; i=$((i + 1))
    done
    cat /tmp/gsonet.log
    fail "gsonet serve $* did not start"
}

# granted_maps: how many buffers gsonet maps from /dev/xen/gntalloc (its copy
# buffers granted to dom0 itself: each tap queue's arena, each vif's TX buffer).
granted_maps() {
    grep -c /dev/xen/gntalloc /proc/"$GSONET_PID"/maps
}

# worker_nices: the nice value of each of gsonet's vif worker threads (vifD.N),
# space-separated.
worker_nices() {
    local t out=""
    for t in /proc/"$GSONET_PID"/task/*; do
        case "$(cat "$t/comm" 2>/dev/null)" in
            vif[0-9]*.[0-9]*) out="$out $(cut -d' ' -f19 "$t/stat")" ;;
        esac
    done
    echo $out
}

# gsonet_stats TAG: one line `XT-STATS TAG {json}` for harness/xen.py.
gsonet_stats() {
    echo "XT-STATS $1 $(/xt/gsonet stats --control "$GSONET_CTL" --json | tr -d '\n')"
}

# qemu_netback NAME IP MAC: QEMU's userspace netback (xen-net-device) for the
# vif-less domU NAME, on the tap xtqtap0 (10.99.0.1). Needs the qemu module
# (harness: Rig(..., qemu=True)).
qemu_netback() {
    [ -x /usr/libexec/xen-qemu-system-i386 ] || fail "QEMU's Xen device model is not in this boot"
    local d
    d="$(xl domid "$1")"
    /usr/libexec/xen-qemu-system-i386 -xen-domid "$d" -xen-attach -name "$1" -machine xenpv \
        -nodefaults -no-user-config -display none -monitor none -serial none -m 256 \
        -netdev tap,id=n0,ifname=xtqtap0,script=no,downscript=no \
        -device "xen-net-device,netdev=n0,mac=$3" > /var/log/xen/qemu-"$1".log 2>&1 &
    QEMU_PID=$!
    local i=0
    while [ $i -lt 60 ] && [ ! -e /sys/class/net/xtqtap0 ]; do sleep 1; i=$((i + 1)); done
    ip addr add "$XT_NET.1/24" dev xtqtap0
    ip link set xtqtap0 up
}

# dump_logs: the domUs' consoles, gsonet's log and hotplug log, for a failed run.
dump_logs() {
    local f
    for f in /var/log/xen/guest-*.log /tmp/gsonet.log /var/log/xen/vif-hotplug.log /var/log/xen/qemu-*.log; do
        [ -f "$f" ] || continue
        echo "===== $f"
        tail -40 "$f"
    done
}

# teardown: every domU destroyed, the backends of this scenario stopped, its links
# gone, so the next scenario of the same boot starts clean.
teardown() {
    local d
    for d in $(xl list | awk 'NR > 2 {print $1}'); do xl destroy "$d" 2>/dev/null; done
    [ -n "${GSONET_PID:-}" ] && kill "$GSONET_PID" 2>/dev/null && wait "$GSONET_PID" 2>/dev/null
    [ -n "${QEMU_PID:-}" ] && kill "$QEMU_PID" 2>/dev/null && wait "$QEMU_PID" 2>/dev/null
    GSONET_PID= QEMU_PID=
    sleep 2
    rmmod xen-netback 2>/dev/null
    for d in xtbr0 xtqtap0 xttap0; do ip link del "$d" 2>/dev/null; done
    note "teardown done"
}

# xs_wait PATH VALUE [SECONDS]: until xenstore PATH reads VALUE.
xs_wait() {
    local i=0
    while [ "$i" -lt "$((${3:-60} * 5))" ]; do
        [ "$(xenstore-read "$1" 2>/dev/null)" = "$2" ] && return 0
        usleep 200000; i=$((i + 1))
    done
    return 1
}

# prewire_vif NAME: while `xl create` of NAME runs in the background, play the
# backend's first step for its vif 0 (feature keys, state InitWait, as gsonet
# advertises them), let xen-netfront connect, then set the frontend's
# feature-gso-tcpv4 to 0 before any backend has read it: a netfront that does not
# take TCPv4 GSO, deterministically (Linux's netfront always writes 1). The real
# backend (gsonet) attaches afterwards and finds the frontend Connected.
prewire_vif() {
    local name="$1" d="" i=0 be fe
    ( domu_create "$name" ) &
    local creating=$!
    while [ $i -lt 300 ] && [ -z "$d" ]; do
        d="$(xl domid "$name" 2>/dev/null)"
        [ -n "$d" ] || usleep 200000
        i=$((i + 1))
    done
    [ -n "$d" ] || fail "prewire: $name not created"
    be="/local/domain/0/backend/vif/$d/0"
    fe="/local/domain/$d/device/vif/0"
    xs_wait "$be/state" 1 60 || fail "prewire: no backend node $be"
    xenstore-write "$be/feature-sg" 1 "$be/feature-gso-tcpv4" 1 "$be/feature-gso-tcpv6" 1 \
        "$be/feature-ipv6-csum-offload" 1 "$be/feature-rx-copy" 1 "$be/feature-rx-flip" 0 \
        "$be/state" 2
    xs_wait "$fe/state" 4 300 || fail "prewire: frontend $fe not Connected"
    xenstore-write "$fe/feature-gso-tcpv4" 0
    note "prewired $name (domid $d): frontend feature-gso-tcpv4=$(xenstore-read "$fe/feature-gso-tcpv4")"
    wait "$creating"
}

# A/B of gsonet builds in one boot: for each round, for each variant V of XT_VARIANTS
# (binaries /xt/gsonet-V), gsonet V serves a fresh domU (tap 10.99.0.1, as gsonet.sh)
# and iperf3 runs both ways; the variant `kernel` is xen-netback with the domU's vif
# on a bridge with 10.99.0.1 (as kernel-netback.sh). Variants alternate, so the rig's
# drift from one minute to the next falls on each alike.
# Env: XT_VARIANTS (names), XT_ROUNDS (default 2), XT_SECONDS (iperf3, default 5),
# XT_IPERF_ARGS (more iperf3 client words, e.g. "-P 4"), XT_DOMUS=2 (two domUs per
# turn, and iperf3 from domU 1 to domU 2 instead of the two dom0 runs).
# Results: ab.V.rR.dom0_to_domu_mbps, ab.V.rR.domu_to_dom0_mbps (+ their CPU costs);
# stats snapshots ab.V.rR.s0, .s1, .s2 before, between and after the two runs. With
# XT_DOMUS=2: ab.V.rR.domu_to_domu_mbps, snapshots s0 and s1 around it.
. /xt/lib.sh
S=${XT_SECONDS:-5}
ip1=10.99.0.2 ip2=10.99.0.3
NDOM=${XT_DOMUS:-1}
lsmod | grep -q '^xen_netback' && fail "xen-netback is loaded"
domu_cfg gdomU1 $ip1 00:16:3e:99:00:12 vif-none
domu_cfg kdomU1 $ip1 00:16:3e:99:00:02 vif-xtbridge
domu_cfg gdomU2 $ip2 00:16:3e:99:00:13 vif-none
domu_cfg kdomU2 $ip2 00:16:3e:99:00:03 vif-xtbridge

# runs V R: the measured runs of variant V's turn R, the domUs up.
runs() {
    if [ "$NDOM" = 2 ]; then
        gsonet_stats_of "$1" "ab.$1.r$2.s0"
        measure "ab.$1.r$2.domu_to_domu_mbps" iperf_domu_mbps $ip1 -c $ip2 -t "$S" $XT_IPERF_ARGS
        gsonet_stats_of "$1" "ab.$1.r$2.s1"
        return
    fi
    gsonet_stats_of "$1" "ab.$1.r$2.s0"
    measure "ab.$1.r$2.dom0_to_domu_mbps" iperf_mbps -c $ip1 -t "$S" $XT_IPERF_ARGS
    gsonet_stats_of "$1" "ab.$1.r$2.s1"
    measure "ab.$1.r$2.domu_to_dom0_mbps" iperf_mbps -c $ip1 -t "$S" -R $XT_IPERF_ARGS
    gsonet_stats_of "$1" "ab.$1.r$2.s2"
}

# gsonet_stats_of V TAG: a stats snapshot, when V is a gsonet build.
gsonet_stats_of() {
    [ "$1" = kernel ] || gsonet_stats "$2"
}
chmod +x /xt/gsonet-*
chmod -x /xt/gsonet-*.vif /xt/gsonet-*.tap 2>/dev/null
r=1
while [ $r -le "${XT_ROUNDS:-2}" ]; do
    for v in $XT_VARIANTS; do
        if [ "$v" = kernel ]; then
            kernel_netback
            domu_create kdomU1
            [ "$NDOM" = 2 ] && domu_create kdomU2
            wait_domu $ip1 300 || fail "kdomU1 does not answer through xen-netback"
            [ "$NDOM" = 2 ] && { wait_domu $ip2 300 || fail "kdomU2 does not answer"; }
            runs "$v" "$r"
            teardown
            lsmod | grep -q '^xen_netback' && fail "xen-netback stays loaded after its turn"
            continue
        fi
        cp "/xt/gsonet-$v" /xt/gsonet
        # words for its specs (scripts/xen_ab.py: vif=, tap=)
        gsonet_start --xen-vif "auto$(cat "/xt/gsonet-$v.vif" 2>/dev/null)" \
            --uplink "tap=xttap0$(cat "/xt/gsonet-$v.tap" 2>/dev/null)"
        domu_create gdomU1
        [ "$NDOM" = 2 ] && domu_create gdomU2
        ip addr add 10.99.0.1/24 dev xttap0
        ip link set xttap0 up
        wait_domu $ip1 300 || fail "gdomU1 does not answer through gsonet $v"
        [ "$NDOM" = 2 ] && { wait_domu $ip2 300 || fail "gdomU2 does not answer through gsonet $v"; }
        runs "$v" "$r"
        teardown
    done
    r=$((r + 1))
done

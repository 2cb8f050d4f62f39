# gsonet as the netback: `gsonet serve --xen-vif auto --uplink tap=xttap0` in dom0
# (tap 10.99.0.1), xen-netback not loaded, domUs with vif script=vif-none.
# Env: XT_SECONDS (iperf3, default 5); XT_DOMUS (1 or 2); XT_VIF=auto|domid (domid:
# --xen-vif domid=D,devid=0 per domU, gsonet started after they exist); XT_MD5_MIB
# (0: none); XT_OFFLOADS=1 (tso/gso off, then sg off, in domU 1); XT_RECREATE=1
# (xl destroy + xl create domU 1); XT_REBOOT=1 (domU 1 reboots itself); XT_NOGSO2=1
# (domU 2's netfront says feature-gso-tcpv4=0, see prewire_vif); XT_GNTALLOC_LIMIT
# (gntalloc's limit, see gsonet_start); XT_VIF_OPTS (appended to --xen-vif's spec,
# e.g. ",queues=2"); XT_TAP_OPTS (appended to tap=xttap0, e.g. ",queues=2");
# XT_DOMU_VCPUS (lib.sh: a netfront asks for a queue per vCPU); XT_IPERF_ARGS
# (more iperf3 arguments for every measured run, e.g. "-P 4").
# Results: gsonet.* (Mbit/s, ok), stats snapshots XT-STATS <tag>; gsonet.queues (the
# netfront's multi-queue-num-queues), gsonet.irqs_start/irqs_end (domu_queue_irqs).
. /xt/lib.sh
S=${XT_SECONDS:-5}
MIB=${XT_MD5_MIB:-0}
NDOM=${XT_DOMUS:-1}
ip1=10.99.0.2 ip2=10.99.0.3
lsmod | grep -q '^xen_netback' && fail "xen-netback is loaded"
domu_cfg gdomU1 $ip1 00:16:3e:99:00:12 vif-none
[ "$NDOM" = 2 ] && domu_cfg gdomU2 $ip2 00:16:3e:99:00:13 vif-none
if [ "${XT_NOGSO2:-0}" = 1 ]; then
    prewire_vif gdomU2
fi
if [ "${XT_VIF:-auto}" = auto ]; then
    gsonet_start --xen-vif "auto${XT_VIF_OPTS:-}" --uplink "tap=xttap0${XT_TAP_OPTS:-}"
    domu_create gdomU1
    [ "$NDOM" = 2 ] && [ "${XT_NOGSO2:-0}" != 1 ] && domu_create gdomU2
else
    ( domu_create gdomU1 ) &
    creating=$!
    if [ "$NDOM" = 2 ] && [ "${XT_NOGSO2:-0}" != 1 ]; then
        ( domu_create gdomU2 ) &
        creating="$creating $!"
    fi
    i=0
    while [ $i -lt 150 ]; do
        d1="$(xl domid gdomU1 2>/dev/null)"
        d2=""; [ "$NDOM" = 2 ] && d2="$(xl domid gdomU2 2>/dev/null)"
        [ -n "$d1" ] && { [ "$NDOM" = 1 ] || [ -n "$d2" ]; } && break
        usleep 200000; i=$((i + 1))
    done
    set -- --xen-vif "domid=$d1,devid=0${XT_VIF_OPTS:-}"
    [ -n "$d2" ] && set -- "$@" --xen-vif "domid=$d2,devid=0${XT_VIF_OPTS:-}"
    gsonet_start "$@" --uplink "tap=xttap0${XT_TAP_OPTS:-}"
    wait $creating  # the xl creates only: gsonet runs in the background too
fi
ip addr add 10.99.0.1/24 dev xttap0
ip link set xttap0 up
d1="$(xl domid gdomU1)"
result gsonet.domid1 "$d1"
[ "$NDOM" = 2 ] && result gsonet.domid2 "$(xl domid gdomU2)"
wait_domu $ip1 300 || fail "gdomU1 does not answer through gsonet"
# measure once every domU has booted (a booting TCG guest eats the CPU)
[ "$NDOM" = 2 ] && { wait_domu $ip2 300 || fail "gdomU2 does not answer through gsonet"; }
result gsonet.ping "$(ping -c3 -W2 $ip1 >/dev/null && echo ok || echo lost)"
result gsonet.queues "$(xenstore-read "/local/domain/$d1/device/vif/0/multi-queue-num-queues" 2>/dev/null || echo none)"
result gsonet.irqs_start "$(domu_queue_irqs $ip1)"
result gsonet.worker_nice "$(worker_nices)"
result gsonet.granted_maps "$(granted_maps)"
grep -q "cannot grant copy buffers" /tmp/gsonet.log && result gsonet.granted_refused yes
gsonet_stats start
measure gsonet.dom0_to_domu_mbps iperf_mbps -c $ip1 -t "$S" $XT_IPERF_ARGS
gsonet_stats after_dom0_to_domu
measure gsonet.domu_to_dom0_mbps iperf_mbps -c $ip1 -t "$S" -R $XT_IPERF_ARGS
gsonet_stats after_domu_to_dom0
if [ "$MIB" -gt 0 ]; then
    md5_to_domu $ip1 "$MIB" && result gsonet.md5_to_domu ok
    md5_from_domu $ip1 "$MIB" && result gsonet.md5_from_domu ok
fi
result gsonet.irqs_end "$(domu_queue_irqs $ip1)"
if [ "$NDOM" = 2 ]; then
    fe2="/local/domain/$(xl domid gdomU2)/device/vif/0"
    result gsonet.domu2_feature_gso_tcpv4 "$(xenstore-read "$fe2/feature-gso-tcpv4")"
    gsonet_stats before_domu_to_domu
    measure gsonet.domu_to_domu_mbps iperf_domu_mbps $ip1 -c $ip2 -t "$S" $XT_IPERF_ARGS
    gsonet_stats after_domu_to_domu
    measure gsonet.domu2_to_domu1_mbps iperf_domu_mbps $ip2 -c $ip1 -t "$S" $XT_IPERF_ARGS
    gsonet_stats after_domu2_to_domu1
    if [ "$MIB" -gt 0 ]; then
        md5_domu_to_domu $ip1 $ip2 "$MIB" && result gsonet.md5_domu1_to_domu2 ok
    fi
fi
if [ "${XT_OFFLOADS:-0}" = 1 ]; then
    on_domu $ip1 ethtool -K eth0 tso off gso off
    result gsonet.nooffload.tso "$(on_domu $ip1 ethtool -k eth0 | awk '/^tcp-segmentation-offload:/ {print $2}')"
    gsonet_stats before_tso_off
    measure gsonet.nooffload.domu_to_dom0_mbps iperf_mbps -c $ip1 -t "$S" -R
    md5_from_domu $ip1 8 && result gsonet.nooffload.md5_from_domu ok
    md5_to_domu $ip1 8 && result gsonet.nooffload.md5_to_domu ok
    gsonet_stats after_tso_off
    on_domu $ip1 ethtool -K eth0 sg off
    result gsonet.nosg.sg "$(on_domu $ip1 ethtool -k eth0 | awk '/^scatter-gather:/ {print $2}')"
    measure gsonet.nosg.domu_to_dom0_mbps iperf_mbps -c $ip1 -t "$S" -R
    measure gsonet.nosg.dom0_to_domu_mbps iperf_mbps -c $ip1 -t "$S"
    md5_from_domu $ip1 8 && result gsonet.nosg.md5_from_domu ok
    md5_to_domu $ip1 8 && result gsonet.nosg.md5_to_domu ok
    gsonet_stats after_sg_off
    on_domu $ip1 ethtool -K eth0 sg on tso on gso on
    gsonet_stats before_offloads_on_again
    measure gsonet.offload_again.domu_to_dom0_mbps iperf_mbps -c $ip1 -t "$S" -R
    gsonet_stats after_offloads_on_again
fi
if [ "${XT_RECREATE:-0}" = 1 ]; then
    xl destroy gdomU1 || fail "xl destroy gdomU1"
    note "destroyed gdomU1"
    sleep 3
    gsonet_stats after_destroy
    kill -0 "$GSONET_PID" || fail "gsonet exited after xl destroy"
    domu_create gdomU1
    result gsonet.recreated_domid "$(xl domid gdomU1)"
    wait_domu $ip1 300 || fail "recreated gdomU1 does not answer"
    result gsonet.recreate.ping "$(ping -c3 -W2 $ip1 >/dev/null && echo ok || echo lost)"
    md5_to_domu $ip1 4 && result gsonet.recreate.md5_to_domu ok
    md5_from_domu $ip1 4 && result gsonet.recreate.md5_from_domu ok
    gsonet_stats after_recreate
fi
if [ "${XT_REBOOT:-0}" = 1 ]; then
    on_domu $ip1 'echo booted-before > /tmp/marker'
    ( on_domu $ip1 'sync; reboot -f' ) >/dev/null 2>&1 &
    sleep 5
    i=0
    while [ $i -lt 300 ]; do
        [ "$(on_domu $ip1 'cat /tmp/marker 2>/dev/null || echo fresh' 2>/dev/null)" = fresh ] && break
        sleep 1; i=$((i + 1))
    done
    [ $i -lt 300 ] || fail "gdomU1 did not come back after its reboot"
    kill -0 "$GSONET_PID" || fail "gsonet exited after the domU reboot"
    result gsonet.reboot.domid "$(xl domid gdomU1)"
    result gsonet.reboot.ping "$(ping -c3 -W2 $ip1 >/dev/null && echo ok || echo lost)"
    md5_to_domu $ip1 4 && result gsonet.reboot.md5_to_domu ok
    md5_from_domu $ip1 4 && result gsonet.reboot.md5_from_domu ok
    gsonet_stats after_reboot
fi
kill -0 "$GSONET_PID" || fail "gsonet exited"
teardown

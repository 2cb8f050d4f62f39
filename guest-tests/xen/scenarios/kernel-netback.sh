# Baseline: Linux's xen-netback, the vifs on a bridge with dom0's address (10.99.0.1).
# Env: XT_SECONDS (iperf3 seconds, default 5), XT_DOMUS (1 or 2), XT_MD5_MIB (0: none),
# XT_IPERF_ARGS (more iperf3 arguments, e.g. "-P 4"), XT_DOMU_VCPUS (lib.sh).
# Results: kernel.dom0_to_domu_mbps, kernel.domu_to_dom0_mbps, kernel.domu_to_domu_mbps
# (with 2 domUs), kernel.md5_* (ok).
. /xt/lib.sh
S=${XT_SECONDS:-5}
kernel_netback
domu_cfg kdomU1 10.99.0.2 00:16:3e:99:00:02 vif-xtbridge
domu_create kdomU1
if [ "${XT_DOMUS:-1}" = 2 ]; then
    domu_cfg kdomU2 10.99.0.3 00:16:3e:99:00:03 vif-xtbridge
    domu_create kdomU2
fi
wait_domu 10.99.0.2 300 || fail "kdomU1 does not answer"
# measure once every domU has booted (a booting TCG guest eats the CPU)
[ "${XT_DOMUS:-1}" = 2 ] && { wait_domu 10.99.0.3 300 || fail "kdomU2 does not answer"; }
result kernel.ping "$(ping -c3 -W2 10.99.0.2 >/dev/null && echo ok || echo lost)"
measure kernel.dom0_to_domu_mbps iperf_mbps -c 10.99.0.2 -t "$S" $XT_IPERF_ARGS
measure kernel.domu_to_dom0_mbps iperf_mbps -c 10.99.0.2 -t "$S" -R $XT_IPERF_ARGS
if [ "${XT_DOMUS:-1}" = 2 ]; then
    measure kernel.domu_to_domu_mbps iperf_domu_mbps 10.99.0.2 -c 10.99.0.3 -t "$S" $XT_IPERF_ARGS
fi
if [ "${XT_MD5_MIB:-0}" -gt 0 ]; then
    md5_to_domu 10.99.0.2 "$XT_MD5_MIB" && result kernel.md5_to_domu ok
    md5_from_domu 10.99.0.2 "$XT_MD5_MIB" && result kernel.md5_from_domu ok
fi
teardown

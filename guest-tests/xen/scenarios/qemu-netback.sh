# Baseline: QEMU's userspace netback (xen-net-device: no SG, no GSO, a grant map per
# packet) on the tap xtqtap0 (10.99.0.1). Needs the qemu module (XenRig(qemu=True)).
# Env: XT_SECONDS (default 5), XT_IPERF_ARGS, XT_DOMU_VCPUS (lib.sh).
# Results: qemu.dom0_to_domu_mbps, qemu.domu_to_dom0_mbps.
. /xt/lib.sh
S=${XT_SECONDS:-5}
domu_cfg qdomU1 10.99.0.2 00:16:3e:99:00:02 none
domu_create qdomU1
sleep 5
qemu_netback qdomU1 10.99.0.2 00:16:3e:99:00:02
wait_domu 10.99.0.2 300 || fail "qdomU1 does not answer through QEMU's netback"
result qemu.ping "$(ping -c3 -W2 10.99.0.2 >/dev/null && echo ok || echo lost)"
measure qemu.dom0_to_domu_mbps iperf_mbps -c 10.99.0.2 -t "$S" $XT_IPERF_ARGS
measure qemu.domu_to_dom0_mbps iperf_mbps -c 10.99.0.2 -t "$S" -R $XT_IPERF_ARGS
teardown

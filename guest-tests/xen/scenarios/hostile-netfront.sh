# A hostile netfront next to an honest domU: gsonet serves `--xen-vif auto`; dom0 runs
# /xt/xen_netfront (examples/xen_netfront.rs), a netfront of its own on vif 0.9 that
# writes malformed TX rings case by case, floods its event channel, posts RX buffers
# it never granted, and jumps its ring index (then reconnects). Meanwhile dom0 pings
# the honest domU five times a second (the cases take a few seconds on a fast
# machine); after it, a ping and an md5 transfer. The vif offers 4 queues, for the
# program's multi-queue cases.
# Results: hostile.* (from the program), honest.*; stats before_hostile, after_hostile;
# hostile.refusal_log_lines (gsonet's log lines refusing a netfront).
. /xt/lib.sh
ip1=10.99.0.2
lsmod | grep -q '^xen_netback' && fail "xen-netback is loaded"
[ -f /xt/xen_netfront ] || fail "no /xt/xen_netfront in this boot"
chmod +x /xt/xen_netfront
domu_cfg gdomU1 $ip1 00:16:3e:99:00:12 vif-none
gsonet_start --xen-vif auto,queues=4 --uplink tap=xttap0
domu_create gdomU1
ip addr add 10.99.0.1/24 dev xttap0
ip link set xttap0 up
result gsonet.domid1 "$(xl domid gdomU1)"
wait_domu $ip1 300 || fail "gdomU1 does not answer through gsonet"
gsonet_stats before_hostile
rm -f /tmp/hostile.done
( while [ ! -f /tmp/hostile.done ]; do
      if ping -c1 -W2 $ip1 >/dev/null 2>&1; then echo ok; else echo lost; fi
      usleep 200000
  done > /tmp/honest-pings ) &
pinger=$!
/xt/xen_netfront --devid 9 --mac 00:16:3e:99:00:99 --ip 10.99.0.9 --peer-ip 10.99.0.1 \
    || fail "the hostile netfront could not run its cases"
touch /tmp/hostile.done
wait $pinger
gsonet_stats after_hostile
result hostile.refusal_log_lines "$(grep -c 'cannot connect the netfront' /tmp/gsonet.log)"
grep 'cannot connect the netfront' /tmp/gsonet.log | sed 's/^/XT-NOTE /'
result honest.pings_ok "$(grep -c '^ok' /tmp/honest-pings)"
result honest.pings_lost "$(grep -c '^lost' /tmp/honest-pings)"
kill -0 "$GSONET_PID" 2>/dev/null && result honest.gsonet_alive ok
result honest.ping_after "$(ping -c3 -W2 $ip1 >/dev/null && echo ok || echo lost)"
md5_to_domu $ip1 4 && result honest.md5_to_domu ok
md5_from_domu $ip1 4 && result honest.md5_from_domu ok
teardown

#!/usr/bin/env bash
# One guest on gsonet with a tap uplink: the guest reaches the host at $NET.1.
#
#   sudo qemu-configs/one-guest-tap.sh            # console here; Ctrl-A X quits
#   sudo CONSOLE=file qemu-configs/one-guest-tap.sh &
#   ping 10.77.0.2; gsonet stats --control /tmp/gsonet-qemu/control.sock
#
# gsonet:  serve --port socket=$WORK/vm1.sock --uplink tap=$TAP
# QEMU:    -chardev socket,id=c0,path=$WORK/vm1.sock -netdev vhost-user,id=n0,chardev=c0
#          -device virtio-net-pci,netdev=n0,<properties>   (see common.sh)
# Env: TAP (default gsonet0), PORT_OPTS (e.g. ",tso=off"), UPLINK_OPTS (e.g.
# ",gso=software"), and everything in common.sh.
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"
TAP="${TAP:-gsonet0}"
need_root

rm -f "$WORK/vm1.sock"
start_gsonet --port "socket=$WORK/vm1.sock${PORT_OPTS:-}" --uplink "tap=$TAP${UPLINK_OPTS:-}"
host_addr "$TAP"
run_guest 1 vm1 2 "$WORK/vm1.sock"
wait_all

#!/usr/bin/env bash
# Two guests switched by gsonet (and a tap uplink to the host): vm1 is $NET.2,
# vm2 is $NET.3, the host $NET.1. Frames between the guests never touch the host
# kernel; 64 KiB TSO frames go from one guest to the other intact when both
# acked GUEST_TSO*, segmented by gsonet when the receiver did not.
#
#   sudo qemu-configs/two-guests.sh               # vm1 in the background, vm2 here
#   sudo CONSOLE=file qemu-configs/two-guests.sh &
#
# gsonet:  serve --port socket=$WORK/vm1.sock --port socket=$WORK/vm2.sock --uplink tap=$TAP
# Try VM2_OFFLOADS=guest_tso4=off to watch gsonet segment for vm2 (gsonet stats).
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"
TAP="${TAP:-gsonet0}"
need_root

rm -f "$WORK/vm1.sock" "$WORK/vm2.sock"
start_gsonet --port "socket=$WORK/vm1.sock" --port "socket=$WORK/vm2.sock" --uplink "tap=$TAP"
host_addr "$TAP"
run_guest 0 vm1 2 "$WORK/vm1.sock"
run_guest 1 vm2 3 "$WORK/vm2.sock" --props "${VM2_OFFLOADS:-}"
wait_all

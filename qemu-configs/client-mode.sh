#!/usr/bin/env bash
# QEMU owns the socket (server=on), gsonet connects to it (`client`). Useful when
# gsonet starts after, or restarts under, a running guest: gsonet retries every
# 500 ms until the socket is there, and QEMU (reconnect is its side's job in the
# other mode) keeps the guest's device across gsonet restarts.
#
#   sudo qemu-configs/client-mode.sh
#
# gsonet:  serve --port socket=$WORK/qemu-srv.sock,client --uplink tap=$TAP
# QEMU:    -chardev socket,id=c0,path=$WORK/qemu-srv.sock,server=on,wait=on
#          (wait=on: QEMU starts the guest only once gsonet has connected)
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"
TAP="${TAP:-gsonet0}"
need_root

rm -f "$WORK/qemu-srv.sock"
start_gsonet --port "socket=$WORK/qemu-srv.sock,client" --uplink "tap=$TAP"
host_addr "$TAP"
run_guest 1 vm1 2 "$WORK/qemu-srv.sock" --server --wait
wait_all

#!/usr/bin/env bash
# One 2-vCPU guest with two queue pairs on gsonet (one worker thread per pair) and a
# two-queue tap uplink.
#
#   sudo qemu-configs/multiqueue.sh
#
# gsonet:  serve --port socket=$WORK/mq.sock,queues=2 --uplink tap=$TAP,queues=2
# QEMU:    -smp 2 -netdev vhost-user,id=n0,chardev=c0,queues=2
#          -device virtio-net-pci,netdev=n0,mq=on,vectors=6,<properties>
#          (vectors = 2 * queue pairs + 2: one per virtqueue, config, control queue)
# In the guest: ethtool -l eth0 shows "Combined: 2"; the 6.12 driver uses both.
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"
TAP="${TAP:-gsonet0}"
QUEUES="${QUEUES:-2}"
need_root

rm -f "$WORK/mq.sock"
start_gsonet --port "socket=$WORK/mq.sock,queues=$QUEUES" --uplink "tap=$TAP,queues=$QUEUES"
host_addr "$TAP"
run_guest 1 mq 2 "$WORK/mq.sock" --queues "$QUEUES" --smp "$QUEUES" \
    --props "mq=on,vectors=$((2 * QUEUES + 2))"
wait_all

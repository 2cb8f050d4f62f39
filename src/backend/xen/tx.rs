//! The worker thread of one queue of a netfront connection: waits on its event channels, turns
//! runs of TX slots into checked packets (netif::parse_tx), grant-copies a batch of
//! them into a private buffer with one ioctl, answers the slots, and forwards each
//! packet through the switch as any port's frame. RX notifications wake senders
//! holding frames for this vif. It also reads the uplink queue it writes to: at the
//! end of each batch, and as its owner while the netfront is connected
//! (`uplink::reader`), so the host's answers to this guest wake no other thread.

use std::ops::Range;
use std::os::fd::AsFd;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use tracing::warn;

use super::buffers::copy_buffer;
use super::vif::{Conn, VifPort};
use crate::backend::switch::deliver::DeliverCtx;
use crate::backend::switch::{stable, Endpoint, Switch, SwitchUplink};
use crate::frame::validate::tx_frame;
use crate::netif::{self, TxParse, TxPlan, TX_RING_SIZE};
use crate::stats::DropReason;
use crate::sys::io::poll_any;
use crate::sys::sched::set_thread_nice;
use crate::sys::xen::gntdev::{CopyOp, CopyStatus};
use crate::sys::xen::granted::CopyBuf;

/// Packets copied per grant-copy ioctl.
const BATCH: usize = 64;
/// Packets, and bytes of them, forwarded before the worker flushes (tap writes, what
/// they staged for other ports, the tap's answers) while its ring keeps refilling;
/// it flushes too whenever the ring is found empty. Small packets (a stream's ACKs)
/// then share the flush's system calls; a few large ones already pay for theirs.
const FLUSH_PACKETS: usize = BATCH;
const FLUSH_BYTES: usize = 256 << 10;
/// Padding a packet may need: up to a page before each of its slots.
const PAD_MAX: usize = (netif::NR_SLOTS_MIN + 1) * netif::PAGE;
/// Bytes of the private TX buffer: a batch of 64 KiB packets and their padding.
const BUF: usize = BATCH * (65536 + PAD_MAX);

/// One packet of a batch: its slots' ids to answer, and where its bytes went: its
/// copy ops and its runs of bytes in our buffer (ranges of the worker's `ids`, `ops`
/// and `runs`, which a batch reuses: nothing is allocated per packet); then whether
/// it goes on (`Ok`) or is dropped, and why.
struct Pending {
    ids: Range<usize>,
    packet: Result<(TxPlan, Range<usize>, Range<usize>), DropReason>,
}

/// Lays out a packet's slots in our buffer from offset `used` (`base` is the
/// buffer's address): each slot at the same offset in a page of ours as in the
/// netfront's page, so no copy op straddles two of our pages (gntdev splits such an
/// op in two: two page pins, two hypercall entries). Slots that meet end to end stay
/// one run. Pushes the ops and runs; returns the offset after the packet.
fn place(
    frags: &[netif::Fragment],
    dom: crate::sys::xen::DomId,
    base: usize,
    mut used: usize,
    ops: &mut Vec<CopyOp>,
    runs: &mut Vec<Range<usize>>,
) -> usize {
    let mut run_open = false;
    for f in frags {
        let want = usize::from(f.offset) & (netif::PAGE - 1);
        let gap = want.wrapping_sub(base.wrapping_add(used)) & (netif::PAGE - 1);
        if gap != 0 || !run_open {
            used += gap;
            runs.push(used..used);
            run_open = true;
        }
        ops.push(CopyOp {
            dom,
            gref: f.gref,
            guest_off: f.offset,
            len: f.len,
            local_off: used,
        });
        used += usize::from(f.len);
        if let Some(r) = runs.last_mut() {
            r.end = used;
        }
    }
    used
}

struct Worker {
    port: Arc<VifPort>,
    conn: Arc<Conn>,
    /// Which of `conn.queues` this worker serves.
    q: usize,
    switch: Arc<Switch>,
    req_cons: u32,
    rsp_prod: u32,
    broken: bool,
    buf: CopyBuf,
    /// Bytes of `buf` holding packets forwarded since the last flush (stable until
    /// then: destinations may keep their address), and how many packets.
    used: usize,
    unflushed: usize,
    unflushed_bytes: usize,
    /// The batch's slots' ids and its packets' fragments (`netif::parse_tx`).
    ids: Vec<Option<u16>>,
    frags: Vec<netif::Fragment>,
    ops: Vec<CopyOp>,
    status: CopyStatus,
    batch: Vec<Pending>,
    runs: Vec<Range<usize>>,
    ctx: DeliverCtx,
}

/// Serves queue `q` of a connection until `conn.stop` is set.
pub fn run(port: Arc<VifPort>, conn: Arc<Conn>, q: usize, switch: Arc<Switch>) {
    let mut w = Worker {
        port,
        conn,
        q,
        switch,
        req_cons: 0,
        rsp_prod: 0,
        broken: false,
        buf: copy_buffer(BUF, "vif TX buffer"),
        used: 0,
        unflushed: 0,
        unflushed_bytes: 0,
        // A batch's worth, so the datapath allocates nothing after its first batches.
        ids: Vec::with_capacity(TX_RING_SIZE as usize),
        frags: Vec::with_capacity(BATCH * netif::NR_SLOTS_MIN),
        ops: Vec::with_capacity(BATCH * netif::NR_SLOTS_MIN),
        status: CopyStatus::default(),
        batch: Vec::with_capacity(BATCH),
        runs: Vec::with_capacity(BATCH * netif::NR_SLOTS_MIN),
        // The host answers what this vif sends (TCP ACKs) while taking it in: read
        // them at the end of each batch here rather than waking the uplink reader.
        ctx: DeliverCtx::reaping(),
    };
    if let Err(e) = set_thread_nice(w.port.cfg.nice) {
        warn!(vif = %w.port.name(), nice = w.port.cfg.nice,
              "cannot set the worker's priority ({e}): it runs at the process's");
    }
    if w.port.cfg.uring {
        // The batch's frames then reach a tap in one system call at its flush.
        if let Err(e) = w.ctx.batch_writes() {
            warn!(vif = %w.port.name(), "no io_uring ({e}): tap writes go one by one");
        }
    }
    let mut fired = [0u32; 8];
    // The uplink queue this worker reads itself, once it has written to it: the
    // host's answers to the guest (ACKs for its data, data for its ACKs) then wake
    // this thread, not the uplink's reader too (uplink::reader::own).
    let mut served: Option<(Arc<dyn SwitchUplink>, usize)> = None;
    while !w.conn.stop.load(Ordering::Acquire) {
        let (events, queue_ready) = w.wait(served.as_ref());
        if let Some((up, q)) = &served {
            // On a timeout too: `serve` is also where a removed uplink is let go.
            if (queue_ready || !events) && !up.serve(*q) {
                up.disown(*q);
                served = None;
            }
        }
        let n = if events {
            w.queue().evt.pending(&mut fired).unwrap_or(0)
        } else {
            0
        };
        if n > 0 {
            let _ = w.queue().evt.unmask(&fired[..n]);
        }
        let (stats, qstats) = (&w.port.stats, w.port.queue_stats(w.q));
        if fired[..n].contains(&w.queue().tx_port) {
            stats.tx_kicks.fetch_add(1, Ordering::Relaxed);
            qstats.tx_kicks.fetch_add(1, Ordering::Relaxed);
        }
        if fired[..n].contains(&w.queue().rx_port) {
            stats.rx_kicks.fetch_add(1, Ordering::Relaxed);
            qstats.rx_kicks.fetch_add(1, Ordering::Relaxed);
            // The netfront added RX buffers: senders holding frames for it retry.
            w.switch.rx_space();
        }
        // The TX ring is looked at on every wake-up (and every 200 ms), so a
        // lost or withheld event never strands a packet for long; `tx_polls`
        // counts the packets found without an event.
        let before = w.req_cons;
        {
            // The packets' bytes stay as they are until the flush: a vif they go
            // to keeps their address instead of a copy, a tap write waits for it.
            let _stable = stable::declare(w.buf.as_ptr_range());
            w.drain();
            w.flush();
        }
        if n == 0 && w.req_cons != before {
            w.port.stats.tx_polls.fetch_add(1, Ordering::Relaxed);
            w.port
                .queue_stats(w.q)
                .tx_polls
                .fetch_add(1, Ordering::Relaxed);
        }
        let reaped = w.ctx.pending.last_reaped.take();
        if let (None, Some((up, q))) = (&served, reaped) {
            if up.own(q) {
                served = Some((up, q));
            }
        }
    }
    if let Some((up, q)) = served {
        up.disown(q);
    }
}

impl Worker {
    fn queue(&self) -> &super::vif::Queue {
        &self.conn.queues[self.q]
    }

    /// Waits up to 200 ms for an event, or for the served uplink queue to become
    /// readable; says which came.
    fn wait(&self, served: Option<&(Arc<dyn SwitchUplink>, usize)>) -> (bool, bool) {
        let timeout = Duration::from_millis(200);
        let queue = served.and_then(|(up, q)| up.queue_fd(*q));
        let waited = match queue {
            Some(fd) => poll_any(&[self.queue().evt.as_fd(), fd], timeout)
                .map(|bits| (bits & 1 != 0, bits & 2 != 0)),
            None => self.queue().evt.wait(timeout).map(|e| (e, false)),
        };
        waited.unwrap_or_else(|e| {
            warn!(vif = %self.port.name(), "event channel wait: {e}");
            std::thread::sleep(timeout);
            (true, false)
        })
    }

    /// The end of a run of batches: the switch's flush (tap writes, frames staged for
    /// other ports, the tap's answers reaped), after which the buffer is free again.
    fn flush(&mut self) {
        self.ctx.flush();
        self.used = 0;
        self.unflushed = 0;
        self.unflushed_bytes = 0;
    }

    /// Handles TX slots until the ring is empty and the netfront is told to kick,
    /// flushing after FLUSH_PACKETS packets or FLUSH_BYTES bytes (the caller flushes
    /// after): a netfront that refills its ring a packet or two at a time has each
    /// batch copied and answered as it comes, and the system calls that end a batch
    /// (tap writes, the tap's answers, the grant copy and event of what goes back)
    /// paid once for many.
    fn drain(&mut self) {
        let conn = self.conn.clone();
        let ring = &conn.queues[self.q].tx_ring;
        while !self.broken {
            let prod = ring.load(netif::REQ_PROD);
            let avail = prod.wrapping_sub(self.req_cons);
            if avail > TX_RING_SIZE {
                self.ring_broken();
                return;
            }
            if self.unflushed >= FLUSH_PACKETS
                || self.unflushed_bytes >= FLUSH_BYTES
                || self.used + PAD_MAX + usize::from(u16::MAX) > self.buf.len()
            {
                self.flush();
            }
            if avail > 0 && self.batch_once(avail) {
                continue;
            }
            // Nothing (more) whole: ask for an event at the next request after those
            // there, then look once more (RING_FINAL_CHECK_FOR_REQUESTS). The first
            // slots of a packet whose rest is not there yet wait for that event (or
            // the 200 ms look), not in a loop.
            ring.store(netif::REQ_EVENT, prod.wrapping_add(1));
            ring.full_fence();
            if ring.load(netif::REQ_PROD) == prod || self.broken {
                return;
            }
        }
    }

    fn ring_broken(&mut self) {
        self.broken = true;
        self.port.stats.drop(DropReason::XenRingBroken);
        warn!(vif = %self.port.name(), "netfront TX ring index out of range; vif stopped until it reconnects");
    }

    /// Reads, copies, answers and forwards one batch; false if no whole packet was there.
    fn batch_once(&mut self, mut avail: u32) -> bool {
        self.ids.clear();
        self.frags.clear();
        self.ops.clear();
        self.runs.clear();
        self.batch.clear();
        let mut used = self.used;
        while avail > 0 && self.batch.len() < BATCH {
            let (ids0, frags0) = (self.ids.len(), self.frags.len());
            let ring = &self.conn.queues[self.q].tx_ring;
            let req_cons = self.req_cons;
            let slot = |i: u32| {
                let mut b = [0u8; netif::TX_SLOT];
                ring.read(netif::tx_slot_off(req_cons.wrapping_add(i)), &mut b);
                b
            };
            let run = match netif::parse_tx(slot, avail, &mut self.ids, &mut self.frags) {
                TxParse::Incomplete => break,
                TxParse::RingBroken => {
                    self.ring_broken();
                    break;
                }
                TxParse::Run(run) => run,
            };
            if let Ok(plan) = &run.packet {
                if used + PAD_MAX + plan.len > self.buf.len() {
                    // The next batch takes it.
                    self.ids.truncate(ids0);
                    self.frags.truncate(frags0);
                    break;
                }
            }
            self.req_cons = self.req_cons.wrapping_add(run.slots);
            avail -= run.slots;
            let packet = run.packet.map(|plan| {
                let (first_op, first_run) = (self.ops.len(), self.runs.len());
                let base = self.buf.as_ptr() as usize;
                used = place(
                    &self.frags[frags0..],
                    self.conn.dom,
                    base,
                    used,
                    &mut self.ops,
                    &mut self.runs,
                );
                (plan, first_op..self.ops.len(), first_run..self.runs.len())
            });
            self.batch.push(Pending {
                ids: ids0..self.ids.len(),
                packet,
            });
        }
        if self.batch.is_empty() {
            return false;
        }
        self.unflushed_bytes += used - self.used;
        self.used = used;
        self.unflushed += self.batch.len();
        let copied = self.conn.queues[self.q]
            .gnt
            .copy_in(&mut self.buf, &self.ops, &mut self.status)
            .is_ok();
        // Answer every slot first: the netfront may reuse its buffers at once. A
        // packet whose copy failed becomes a drop here.
        let ring = &self.conn.queues[self.q].tx_ring;
        for p in self.batch.iter_mut() {
            if let Ok((_, ops, _)) = &p.packet {
                if !copied || self.status[ops.clone()].iter().any(|&s| s != 0) {
                    p.packet = Err(DropReason::XenBadGrant);
                }
            }
            let status = if p.packet.is_ok() {
                netif::RSP_OKAY
            } else {
                netif::RSP_ERROR
            };
            for id in &self.ids[p.ids.clone()] {
                let bytes = match id {
                    Some(id) => netif::tx_response(*id, status),
                    None => netif::tx_response(0, netif::RSP_NULL),
                };
                ring.write(netif::tx_slot_off(self.rsp_prod), &bytes);
                self.rsp_prod = self.rsp_prod.wrapping_add(1);
            }
        }
        // Told now, not at the flush: the netfront frees a packet's buffers (and its
        // socket may send more) when told of its response.
        self.push_responses();
        let caps = self.port.tx_caps();
        // A packet's runs: at most one per data slot.
        let mut parts: [&[u8]; netif::NR_SLOTS_MIN] = [&[]; netif::NR_SLOTS_MIN];
        let stats = &self.port.stats;
        let qstats = self.port.queue_stats(self.q);
        for p in &self.batch {
            let (plan, runs) = match &p.packet {
                Ok((plan, _, runs)) => (plan, runs),
                Err(r) => {
                    stats.drop(*r);
                    continue;
                }
            };
            let mut n = 0;
            for (slot, r) in parts.iter_mut().zip(&self.runs[runs.clone()]) {
                *slot = &self.buf[r.clone()];
                n += 1;
            }
            let parts = &parts[..n];
            stats.tx(plan.len);
            qstats.tx(plan.len);
            let hdr = match netif::tx_header(plan, parts) {
                Ok(h) => h,
                Err(r) => {
                    stats.drop(r);
                    continue;
                }
            };
            match tx_frame(caps, hdr, parts) {
                Ok(frame) => {
                    self.switch
                        .forward(Endpoint::Port(self.port.id), self.q, &frame, &mut self.ctx)
                }
                Err(r) => stats.drop(r),
            }
        }
        true
    }

    /// RING_PUSH_RESPONSES_AND_CHECK_NOTIFY.
    fn push_responses(&self) {
        let ring = &self.queue().tx_ring;
        let old = ring.load(netif::RSP_PROD);
        let new = self.rsp_prod;
        ring.store(netif::RSP_PROD, new);
        ring.full_fence();
        let event = ring.load(netif::RSP_EVENT);
        if new.wrapping_sub(event) < new.wrapping_sub(old) {
            self.port.stats.tx_calls.fetch_add(1, Ordering::Relaxed);
            self.port
                .queue_stats(self.q)
                .tx_calls
                .fetch_add(1, Ordering::Relaxed);
            if let Err(e) = self.queue().evt.notify(self.queue().tx_port) {
                tracing::debug!(vif = %self.port.name(), "TX notify: {e}");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::netif::{Fragment, PAGE};
    use proptest::prelude::*;

    fn frag() -> impl Strategy<Value = Fragment> {
        (0u16..PAGE as u16).prop_flat_map(|offset| {
            (1u16..=(PAGE as u16 - offset)).prop_map(move |len| Fragment {
                gref: 7,
                offset,
                len,
            })
        })
    }

    proptest! {
        #[test]
        fn slots_never_straddle_our_pages_and_runs_hold_the_bytes_in_order(
            frags in proptest::collection::vec(frag(), 1..=netif::NR_SLOTS_MIN),
            base in 0usize..1 << 20,
            used in 0usize..1 << 16,
        ) {
            let (mut ops, mut runs) = (Vec::new(), Vec::new());
            let end = place(&frags, 3, base, used, &mut ops, &mut runs);
            prop_assert_eq!(ops.len(), frags.len());
            let total: usize = frags.iter().map(|f| usize::from(f.len)).sum();
            prop_assert!(end <= used + PAD_MAX + total);
            for (op, f) in ops.iter().zip(&frags) {
                let at = base + op.local_off;
                prop_assert_eq!(at % PAGE, usize::from(f.offset));
                prop_assert!(at % PAGE + usize::from(op.len) <= PAGE);
                prop_assert_eq!((op.gref, op.guest_off, op.len), (f.gref, f.offset, f.len));
            }
            // The runs, read in order, are the ops' bytes in order, nothing else.
            let from_runs: Vec<usize> = runs.iter().flat_map(|r| r.clone()).collect();
            let from_ops: Vec<usize> = ops
                .iter()
                .flat_map(|o| o.local_off..o.local_off + usize::from(o.len))
                .collect();
            prop_assert_eq!(from_runs, from_ops);
            prop_assert!(runs.first().is_some_and(|r| r.start >= used));
            prop_assert!(runs.last().is_some_and(|r| r.end == end));
        }
    }

    #[test]
    fn page_sized_slots_after_a_short_first_slot_stay_one_run() {
        let f = |offset, len| Fragment {
            gref: 1,
            offset,
            len,
        };
        let frags = [f(3000, 1096), f(0, 4096), f(0, 100)];
        let (mut ops, mut runs) = (Vec::new(), Vec::new());
        let end = place(&frags, 1, 8192, 0, &mut ops, &mut runs);
        assert_eq!(runs, vec![3000..3000 + 1096 + 4096 + 100]);
        assert_eq!(end, 3000 + 1096 + 4096 + 100);
        // A slot starting mid-page opens a second run at its own offset.
        let (mut ops, mut runs) = (Vec::new(), Vec::new());
        place(&[f(0, 200), f(500, 100)], 1, 0, 0, &mut ops, &mut runs);
        assert_eq!(runs, vec![0..200, 500..600]);
    }
}

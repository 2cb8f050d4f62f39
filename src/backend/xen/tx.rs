//! The worker thread of one netfront connection: waits on its event channels, turns
//! runs of TX slots into checked packets (netif::parse_tx), grant-copies a batch of
//! them into a private buffer with one ioctl, answers the slots, and forwards each
//! packet through the switch as any port's frame. RX notifications wake senders
//! holding frames for this vif.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use tracing::warn;

use super::vif::{Conn, VifPort};
use crate::backend::switch::deliver::DeliverCtx;
use crate::backend::switch::{Endpoint, Switch};
use crate::frame::validate::tx_frame;
use crate::netif::{self, TxParse, TxPlan, TX_RING_SIZE};
use crate::stats::DropReason;
use crate::sys::xen::gntdev::CopyOp;

/// Packets copied per grant-copy ioctl.
const BATCH: usize = 64;
/// Bytes of the private TX buffer (a batch of 64 KiB packets, each with up to a
/// page of padding in front).
const BUF: usize = BATCH * (65536 + netif::PAGE);

/// One packet of a batch: the ids to answer, and where its bytes go.
struct Pending {
    ids: Vec<Option<u16>>,
    packet: Result<(TxPlan, usize, std::ops::Range<usize>), DropReason>,
}

struct Worker {
    port: Arc<VifPort>,
    conn: Arc<Conn>,
    switch: Arc<Switch>,
    req_cons: u32,
    rsp_prod: u32,
    broken: bool,
    buf: Vec<u8>,
    ops: Vec<CopyOp>,
    status: Vec<i16>,
    batch: Vec<Pending>,
    ctx: DeliverCtx,
}

/// Serves one connection until `conn.stop` is set.
pub fn run(port: Arc<VifPort>, conn: Arc<Conn>, switch: Arc<Switch>) {
    let mut w = Worker {
        port,
        conn,
        switch,
        req_cons: 0,
        rsp_prod: 0,
        broken: false,
        buf: vec![0u8; BUF],
        ops: Vec::new(),
        status: Vec::new(),
        batch: Vec::new(),
        ctx: DeliverCtx::default(),
    };
    let mut fired = [0u32; 8];
    while !w.conn.stop.load(Ordering::Acquire) {
        if let Err(e) = w.conn.evt.wait(Duration::from_millis(200)) {
            warn!(vif = %w.port.name(), "event channel wait: {e}");
            std::thread::sleep(Duration::from_millis(200));
        }
        let n = w.conn.evt.pending(&mut fired).unwrap_or(0);
        if n > 0 {
            let _ = w.conn.evt.unmask(&fired[..n]);
        }
        let stats = &w.port.stats;
        if fired[..n].contains(&w.conn.tx_port) {
            stats.tx_kicks.fetch_add(1, Ordering::Relaxed);
        }
        if fired[..n].contains(&w.conn.rx_port) {
            stats.rx_kicks.fetch_add(1, Ordering::Relaxed);
            // The netfront added RX buffers: senders holding frames for it retry.
            w.switch.rx_space();
        }
        // The TX ring is looked at on every wake-up (and every 200 ms), so a
        // lost or withheld event never strands a packet for long; `tx_polls`
        // counts the packets found without an event.
        let before = w.req_cons;
        w.drain();
        if n == 0 && w.req_cons != before {
            w.port.stats.tx_polls.fetch_add(1, Ordering::Relaxed);
        }
        w.ctx.flush();
    }
}

impl Worker {
    fn slot(&self, i: u32) -> [u8; netif::TX_SLOT] {
        let mut b = [0u8; netif::TX_SLOT];
        self.conn
            .tx_ring
            .read(netif::tx_slot_off(self.req_cons.wrapping_add(i)), &mut b);
        b
    }

    /// Handles TX slots until the ring is empty and the netfront is told to kick.
    fn drain(&mut self) {
        let conn = self.conn.clone();
        let ring = &conn.tx_ring;
        while !self.broken {
            let prod = ring.load(netif::REQ_PROD);
            let avail = prod.wrapping_sub(self.req_cons);
            if avail > TX_RING_SIZE {
                self.ring_broken();
                return;
            }
            if avail == 0 || !self.batch_once(avail) {
                // Nothing (more) to do now: ask for an event at the next request,
                // then look once more (RING_FINAL_CHECK_FOR_REQUESTS).
                ring.store(netif::REQ_EVENT, self.req_cons.wrapping_add(1));
                ring.full_fence();
                if ring.load(netif::REQ_PROD) == self.req_cons || self.broken {
                    return;
                }
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
        self.ops.clear();
        self.batch.clear();
        let mut used = 0usize;
        while avail > 0 && self.batch.len() < BATCH {
            let parsed = netif::parse_tx(|i| self.slot(i), avail);
            let run = match parsed {
                TxParse::Incomplete => break,
                TxParse::RingBroken => {
                    self.ring_broken();
                    break;
                }
                TxParse::Run(run) => run,
            };
            if let Ok(plan) = &run.packet {
                if used + netif::PAGE + plan.len > self.buf.len() {
                    break; // the next batch takes it
                }
            }
            let n = run.ids.len() as u32;
            self.req_cons = self.req_cons.wrapping_add(n);
            avail -= n;
            let packet = run.packet.map(|plan| {
                // The packet's first slot sits at the same offset in a page of ours as
                // in the netfront's page: page-sized slots after it then fill whole
                // pages of ours, one copy op each rather than two.
                let first_off = plan.frags.first().map_or(0, |f| usize::from(f.offset));
                let addr = self.buf.as_ptr() as usize + used;
                let at = used + (first_off.wrapping_sub(addr) & (netif::PAGE - 1));
                let first = self.ops.len();
                let mut off = at;
                for f in &plan.frags {
                    self.ops.push(CopyOp {
                        dom: self.conn.dom,
                        gref: f.gref,
                        guest_off: f.offset,
                        len: f.len,
                        local_off: off,
                    });
                    off += usize::from(f.len);
                }
                used = at + plan.len;
                (plan, at, first..self.ops.len())
            });
            self.batch.push(Pending {
                ids: run.ids,
                packet,
            });
        }
        if self.batch.is_empty() {
            return false;
        }
        let copied = self
            .conn
            .gnt
            .copy_in(&mut self.buf, &self.ops, &mut self.status)
            .is_ok();
        // Answer every slot first: the netfront may reuse its buffers at once.
        let batch = std::mem::take(&mut self.batch);
        let mut verdicts = Vec::with_capacity(batch.len());
        for p in &batch {
            let verdict = match &p.packet {
                Err(r) => Err(*r),
                Ok((_, _, ops)) => {
                    if copied && self.status[ops.clone()].iter().all(|&s| s == 0) {
                        Ok(())
                    } else {
                        Err(DropReason::XenBadGrant)
                    }
                }
            };
            let status = if verdict.is_ok() {
                netif::RSP_OKAY
            } else {
                netif::RSP_ERROR
            };
            for id in &p.ids {
                let bytes = match id {
                    Some(id) => netif::tx_response(*id, status),
                    None => netif::tx_response(0, netif::RSP_NULL),
                };
                self.conn
                    .tx_ring
                    .write(netif::tx_slot_off(self.rsp_prod), &bytes);
                self.rsp_prod = self.rsp_prod.wrapping_add(1);
            }
            verdicts.push(verdict);
        }
        self.push_responses();
        let caps = self.port.tx_caps();
        for (p, verdict) in batch.iter().zip(verdicts) {
            let Ok((plan, at, _)) = &p.packet else {
                if let Err(r) = verdict {
                    self.port.stats.drop(r);
                }
                continue;
            };
            if let Err(r) = verdict {
                self.port.stats.drop(r);
                continue;
            }
            let bytes = &self.buf[*at..*at + plan.len];
            self.port.stats.tx(plan.len);
            let hdr = match netif::tx_header(plan, bytes) {
                Ok(h) => h,
                Err(r) => {
                    self.port.stats.drop(r);
                    continue;
                }
            };
            let parts = [bytes];
            match tx_frame(caps, hdr, &parts) {
                Ok(frame) => {
                    self.switch
                        .forward(Endpoint::Port(self.port.id), 0, &frame, &mut self.ctx)
                }
                Err(r) => self.port.stats.drop(r),
            }
        }
        // What this batch staged for other ports leaves now, not when the ring is empty.
        self.ctx.flush();
        self.batch = batch;
        true
    }

    /// RING_PUSH_RESPONSES_AND_CHECK_NOTIFY.
    fn push_responses(&self) {
        let ring = &self.conn.tx_ring;
        let old = ring.load(netif::RSP_PROD);
        let new = self.rsp_prod;
        ring.store(netif::RSP_PROD, new);
        ring.full_fence();
        let event = ring.load(netif::RSP_EVENT);
        if new.wrapping_sub(event) < new.wrapping_sub(old) {
            self.port.stats.tx_calls.fetch_add(1, Ordering::Relaxed);
            if let Err(e) = self.conn.evt.notify(self.conn.tx_port) {
                tracing::debug!(vif = %self.port.name(), "TX notify: {e}");
            }
        }
    }
}

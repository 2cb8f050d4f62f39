//! One vif as a switch port: its counters, its place in the switch, and while a
//! netfront is connected, the connection (rings, event channels) and the RX side.
//! Frames for the netfront are staged and grant-copied into its RX buffers with one
//! ioctl per batch, when the sender signals at the end of its batch. Staging keeps
//! the address of bytes the sender declared stable until then (`switch::stable`: an
//! uplink reader's or a vif worker's batch buffer) and copies only the rest.

use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use tracing::debug;

use crate::backend::switch::deliver::Destination;
use crate::backend::switch::{stable, SwitchPort};
use crate::config::XenVifConfig;
use crate::features::Caps;
use crate::l2::{Mac, Vid};
use crate::netif::{self, RxSlot, RX_RING_SIZE};
use crate::stats::{Counters, DropReason};
use crate::sys::xen::evtchn::EvtchnDev;
use crate::sys::xen::gntdev::{CopyOp, Gntdev, MappedPage};
use crate::sys::xen::DomId;
use crate::vnet_hdr::VirtioNetHdr;

/// RX bytes waiting for the copy after which a sender's batch is copied at once.
const STAGE_MAX: usize = 1 << 20;
/// Room for the bytes copied into staging: a frame more than STAGE_MAX and each
/// frame's padding, reserved once so the buffer never moves (the copy ops hold its
/// addresses, and its frames' page alignment holds).
const STAGE_ROOM: usize = STAGE_MAX + 2 * (65536 + netif::PAGE);

/// The frontend end of one connection.
pub struct Conn {
    pub dom: DomId,
    pub gnt: Arc<Gntdev>,
    pub evt: EvtchnDev,
    /// Local event channel ports (the same one unless split).
    pub tx_port: u32,
    pub rx_port: u32,
    pub tx_ring: MappedPage,
    pub rx: Mutex<RxSide>,
    /// What the netfront accepts from us.
    pub rx_caps: Caps,
    /// Set to stop the worker.
    pub stop: AtomicBool,
}

/// The RX ring and the batch staged for it.
pub struct RxSide {
    pub ring: MappedPage,
    req_cons: u32,
    broken: bool,
    /// The connection was replaced or ended: nothing more is staged (see `close`).
    closed: bool,
    /// Copies of the bytes no sender keeps stable.
    staged: Vec<u8>,
    /// Bytes of the frames staged since the last flush.
    pending: usize,
    /// The copies to make; `local_off` is an address (in `staged` or a sender's
    /// stable buffer).
    ops: Vec<CopyOp>,
    /// Responses to write at flush: ring index, bytes, and the copies that fill it.
    resps: Vec<(u32, [u8; netif::RX_SLOT], Option<Range<usize>>)>,
    status: Vec<i16>,
    slots: Vec<RxSlot>,
    /// The frame being staged as runs of local bytes: (address, length).
    runs: Vec<(usize, usize)>,
}

impl RxSide {
    pub fn new(ring: MappedPage) -> RxSide {
        RxSide {
            ring,
            req_cons: 0,
            broken: false,
            closed: false,
            staged: Vec::with_capacity(STAGE_ROOM),
            pending: 0,
            ops: Vec::new(),
            resps: Vec::new(),
            status: Vec::new(),
            slots: Vec::new(),
            runs: Vec::new(),
        }
    }

    /// Forgets what was staged (without writing a response for it), keeping buffers.
    fn clear(&mut self) {
        self.staged.clear();
        self.pending = 0;
        self.ops.clear();
        self.resps.clear();
    }
}

/// Lays `parts` out as runs of local bytes (address, length) in `runs`: a part a
/// sender keeps stable where it is, any other copied into `staged` (a frame copied
/// whole starts on a page of ours: its page-sized slots are then one copy op each,
/// where a slot straddling two of our pages costs gntdev two ops, two page pins and
/// twice the hypercall entries).
fn lay_out(staged: &mut Vec<u8>, runs: &mut Vec<(usize, usize)>, parts: &[&[u8]]) {
    runs.clear();
    if !parts.iter().any(|p| stable::holds(p)) {
        let start = page_aligned(staged);
        staged.resize(start, 0);
    }
    for p in parts.iter().filter(|p| !p.is_empty()) {
        let at = if stable::holds(p) {
            p.as_ptr() as usize
        } else {
            let off = staged.len();
            debug_assert!(off + p.len() <= staged.capacity(), "staging would move");
            staged.extend_from_slice(p);
            staged.as_ptr() as usize + off
        };
        match runs.last_mut() {
            Some((a, n)) if *a + *n == at => *n += p.len(),
            _ => runs.push((at, p.len())),
        }
    }
}

/// Pushes the copy ops that fill `len` bytes of a netfront page (grant `gref` of
/// `dom`) from `runs`, starting `*pos` bytes into them; advances `*pos`.
fn fill_ops(
    runs: &[(usize, usize)],
    pos: &mut usize,
    dom: DomId,
    gref: u32,
    len: usize,
    ops: &mut Vec<CopyOp>,
) {
    let mut skip = *pos;
    let mut guest_off = 0usize;
    for &(at, n) in runs {
        if guest_off == len {
            break;
        }
        if skip >= n {
            skip -= n;
            continue;
        }
        let take = (n - skip).min(len - guest_off);
        ops.push(CopyOp {
            dom,
            gref,
            guest_off: guest_off as u16,
            len: take as u16,
            local_off: at + skip,
        });
        guest_off += take;
        skip = 0;
    }
    *pos += guest_off;
}

impl Conn {
    /// Copies the staged batch into the netfront's buffers (one ioctl), writes the
    /// responses in the slots of their requests and signals it if it asked.
    fn flush(&self, rx: &mut RxSide, stats: &Counters) {
        if rx.resps.is_empty() {
            return;
        }
        let RxSide {
            ring,
            ops,
            resps,
            status,
            ..
        } = rx;
        // Every op's bytes are in `staged` (reserved once, never reallocated, held by
        // the lock on `rx`) or in a buffer a sender declared stable: unchanged and
        // alive until that sender's next flush, which calls this first, or until the
        // connection is closed, which drops the ops (`close`).
        let ok = match self.gnt.copy_out_at(ops, status) {
            Ok(()) => true,
            Err(e) => {
                debug!(dom = self.dom, "grant copy to the netfront failed: {e}");
                false
            }
        };
        let mut last = None;
        for (idx, bytes, copies) in resps.iter_mut() {
            if let Some(copies) = copies.clone() {
                let done = status
                    .get(copies)
                    .is_some_and(|s| s.iter().all(|&s| s == 0));
                if !ok || !done {
                    stats.drop(DropReason::XenBadGrant);
                    bytes[6..8].copy_from_slice(&netif::RSP_ERROR.to_le_bytes());
                }
            }
            ring.write(netif::rx_slot_off(*idx), bytes);
            last = Some(*idx);
        }
        if let Some(last) = last {
            let new = last.wrapping_add(1);
            let old = ring.load(netif::RSP_PROD);
            ring.store(netif::RSP_PROD, new);
            ring.full_fence();
            let event = ring.load(netif::RSP_EVENT);
            if new.wrapping_sub(event) < new.wrapping_sub(old) {
                stats.rx_calls.fetch_add(1, Ordering::Relaxed);
                if let Err(e) = self.evt.notify(self.rx_port) {
                    debug!(dom = self.dom, "RX notify: {e}");
                }
            }
        }
        rx.clear();
    }

    /// The connection is replaced or ends: what was staged is dropped, so no address
    /// of a sender's stable bytes outlives the sender's flush (which signals the new
    /// connection, not this one), and nothing more is staged.
    fn close(&self) {
        let mut rx = self.rx.lock().unwrap_or_else(|e| e.into_inner());
        rx.closed = true;
        rx.clear();
    }

    /// Stages one frame (`len` bytes in `parts`) for the netfront.
    fn stage(
        &self,
        rx: &mut RxSide,
        hdr: &VirtioNetHdr,
        parts: &[&[u8]],
        len: usize,
    ) -> Result<(), DropReason> {
        if rx.closed {
            return Err(DropReason::RxQueueFull);
        }
        if rx.broken {
            return Err(DropReason::XenRingBroken);
        }
        let gso = if hdr.gso.is_gso() {
            // `deliver` passes only what rx_caps accepts: TCP GSO.
            Some((
                netif::gso_type(hdr.gso.kind).ok_or(DropReason::SegmentError)?,
                hdr.gso_size,
            ))
        } else {
            None
        };
        let mut slots = std::mem::take(&mut rx.slots);
        netif::rx_slots(len, gso.is_some(), &mut slots);
        let need = slots.len() as u32;
        let prod = rx.ring.load(netif::REQ_PROD);
        let mut avail = prod.wrapping_sub(rx.req_cons);
        if avail > RX_RING_SIZE {
            rx.broken = true;
            rx.slots = slots;
            return Err(DropReason::XenRingBroken);
        }
        if avail < need {
            // Ask to be told when there is room, then look once more.
            rx.ring
                .store(netif::REQ_EVENT, rx.req_cons.wrapping_add(need));
            rx.ring.full_fence();
            avail = rx.ring.load(netif::REQ_PROD).wrapping_sub(rx.req_cons);
            if avail < need || avail > RX_RING_SIZE {
                rx.slots = slots;
                return Err(DropReason::RxQueueFull);
            }
        }
        lay_out(&mut rx.staged, &mut rx.runs, parts);
        rx.pending += len;
        let data_slots = slots
            .iter()
            .filter(|s| matches!(s, RxSlot::Data { .. }))
            .count();
        let mut data_seen = 0;
        // Bytes of the frame the ops so far cover.
        let mut pos = 0;
        for (k, s) in slots.iter().enumerate() {
            let idx = rx.req_cons.wrapping_add(k as u32);
            let mut req = [0u8; netif::RX_SLOT];
            rx.ring.read(netif::rx_slot_off(idx), &mut req);
            let (id, gref) = netif::rx_request(&req);
            match *s {
                RxSlot::Data { at, len } => {
                    debug_assert_eq!(at, pos);
                    data_seen += 1;
                    let mut flags = 0;
                    if at == 0 {
                        flags |= netif::rx_flags(hdr);
                        if gso.is_some() {
                            flags |= netif::RXF_EXTRA_INFO;
                        }
                    }
                    if data_seen < data_slots {
                        flags |= netif::RXF_MORE_DATA;
                    }
                    let first = rx.ops.len();
                    let RxSide { runs, ops, .. } = &mut *rx;
                    fill_ops(runs, &mut pos, self.dom, gref, len, ops);
                    let resp = netif::rx_response(id, 0, flags, len as i16);
                    let copies = first..rx.ops.len();
                    rx.resps.push((idx, resp, Some(copies)));
                }
                RxSlot::Gso => {
                    let (ty, size) = gso.unwrap_or_default();
                    rx.resps
                        .push((idx, netif::gso_extra(size, ty, false), None));
                }
            }
        }
        rx.req_cons = rx.req_cons.wrapping_add(need);
        rx.slots = slots;
        Ok(())
    }
}

/// The first offset at or after `buf`'s end whose address starts a page.
fn page_aligned(buf: &[u8]) -> usize {
    buf.len() + netif::to_page(buf.as_ptr() as usize + buf.len())
}

/// One vif's port in the switch.
pub struct VifPort {
    pub id: usize,
    pub cfg: XenVifConfig,
    pub stats: Counters,
    /// `vifD.N` while attached, else the slot's own name.
    name: Mutex<String>,
    idle_name: String,
    conn: RwLock<Option<Arc<Conn>>>,
    connected: AtomicBool,
}

impl VifPort {
    pub fn new(id: usize, cfg: XenVifConfig, idle_name: String) -> VifPort {
        VifPort {
            id,
            cfg,
            stats: Counters::default(),
            name: Mutex::new(idle_name.clone()),
            idle_name,
            conn: RwLock::new(None),
            connected: AtomicBool::new(false),
        }
    }

    pub fn name(&self) -> String {
        self.name.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    pub fn set_name(&self, name: Option<String>) {
        *self.name.lock().unwrap_or_else(|e| e.into_inner()) =
            name.unwrap_or_else(|| self.idle_name.clone());
    }

    pub fn conn(&self) -> Option<Arc<Conn>> {
        self.conn.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// A netfront connected (`Some`) or went away (`None`).
    pub fn set_conn(&self, c: Option<Arc<Conn>>) {
        self.connected.store(c.is_some(), Ordering::Release);
        let mut slot = self.conn.write().unwrap_or_else(|e| e.into_inner());
        // Closed before anyone can see its successor: a sender that signals the new
        // connection leaves no address of its bytes in the old one.
        if let Some(old) = slot.take() {
            old.close();
        }
        *slot = c;
    }

    /// What the netfront may send us: what we advertised.
    pub fn tx_caps(&self) -> Caps {
        netif::tx_caps(self.cfg.csum, self.cfg.tso)
    }
}

impl Destination for VifPort {
    fn caps(&self) -> Caps {
        self.conn().map(|c| c.rx_caps).unwrap_or_default()
    }

    fn max_burst(&self) -> Option<usize> {
        None
    }

    fn send(&self, _queue: usize, hdr: &VirtioNetHdr, parts: &[&[u8]]) -> Result<(), DropReason> {
        let Some(conn) = self.conn() else {
            return Err(DropReason::RxQueueFull);
        };
        let mut rx = conn.rx.lock().unwrap_or_else(|e| e.into_inner());
        // The copy ops hold addresses in `staged`: it must never grow past what it
        // reserved (small frames, each from its own page, could otherwise get there
        // before STAGE_MAX bytes are pending).
        let len: usize = parts.iter().map(|p| p.len()).sum();
        if rx.staged.len() + netif::PAGE + len > rx.staged.capacity() {
            conn.flush(&mut rx, &self.stats);
            if netif::PAGE + len > rx.staged.capacity() {
                return Err(DropReason::TooLong);
            }
        }
        conn.stage(&mut rx, hdr, parts, len)?;
        if rx.pending >= STAGE_MAX || rx.resps.len() >= RX_RING_SIZE as usize / 2 {
            conn.flush(&mut rx, &self.stats);
        }
        Ok(())
    }

    fn stats(&self) -> &Counters {
        &self.stats
    }
}

impl SwitchPort for VifPort {
    fn vlan(&self) -> Option<Vid> {
        None
    }

    fn mac(&self) -> Option<Mac> {
        self.cfg.mac
    }

    fn is_connected(&self) -> bool {
        self.connected.load(Ordering::Acquire)
    }

    fn rx_caps(&self) -> Option<Caps> {
        self.conn().map(|c| c.rx_caps)
    }

    fn signal_rx(&self, _queue: usize) {
        if let Some(conn) = self.conn() {
            let mut rx = conn.rx.lock().unwrap_or_else(|e| e.into_inner());
            conn.flush(&mut rx, &self.stats);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The bytes at `runs`' addresses, in order (the addresses are live in the test).
    fn read_runs(runs: &[(usize, usize)], within: &[&[u8]]) -> Vec<u8> {
        let mut out = Vec::new();
        for &(at, n) in runs {
            let buf = within
                .iter()
                .find(|b| {
                    let r = b.as_ptr_range();
                    r.start as usize <= at && at + n <= r.end as usize
                })
                .expect("a run outside every buffer");
            let off = at - buf.as_ptr() as usize;
            out.extend_from_slice(&buf[off..off + n]);
        }
        out
    }

    #[test]
    fn stable_parts_are_kept_in_place_and_the_rest_copied() {
        let sender: Vec<u8> = (0..9000u32).map(|i| i as u8).collect();
        let scratch = [0xeeu8; 16];
        let mut staged = Vec::with_capacity(STAGE_ROOM);
        let mut runs = Vec::new();

        // Nothing declared: the frame is copied, from a page of ours.
        lay_out(&mut staged, &mut runs, &[&sender[..5000]]);
        assert_eq!(runs.len(), 1);
        assert_eq!(runs[0].0 % netif::PAGE, 0);
        assert_eq!(read_runs(&runs, &[&staged]), sender[..5000]);

        let _d = stable::declare(sender.as_ptr_range());
        let before = staged.len();
        // Declared: kept where it is; two parts that meet are one run.
        lay_out(
            &mut staged,
            &mut runs,
            &[&sender[10..100], &sender[100..4000]],
        );
        assert_eq!(runs, vec![(sender.as_ptr() as usize + 10, 3990)]);
        assert_eq!(staged.len(), before, "nothing copied");
        // Mixed (a header built elsewhere, then the sender's bytes): only the
        // header is copied, and the order holds.
        lay_out(&mut staged, &mut runs, &[&scratch, &sender[16..6000]]);
        assert_eq!(runs.len(), 2);
        assert_eq!(staged.len(), before + scratch.len());
        let want: Vec<u8> = [&scratch[..], &sender[16..6000]].concat();
        assert_eq!(read_runs(&runs, &[&staged, &sender]), want);
    }

    proptest! {
        /// The ops of a frame's slots cover its runs' bytes exactly, in order: each
        /// slot from offset 0 of its page, no op longer than what is left of a run.
        #[test]
        fn slot_ops_cover_the_runs_in_order(
            lens in proptest::collection::vec(1usize..9000, 1..6),
        ) {
            let mut runs = Vec::new();
            let mut at = 1 << 20;
            for n in &lens {
                runs.push((at, *n));
                at += n + 4096; // runs apart from one another
            }
            let total: usize = lens.iter().sum();
            let mut slots = Vec::new();
            netif::rx_slots(total, false, &mut slots);
            let (mut ops, mut pos) = (Vec::new(), 0);
            for (k, s) in slots.iter().enumerate() {
                let RxSlot::Data { at, len } = *s else { continue };
                prop_assert_eq!(at, pos);
                let first = ops.len();
                fill_ops(&runs, &mut pos, 1, k as u32, len, &mut ops);
                let mine = &ops[first..];
                prop_assert_eq!(mine.iter().map(|o| usize::from(o.len)).sum::<usize>(), len);
                let mut off = 0;
                for o in mine {
                    prop_assert_eq!((o.gref, usize::from(o.guest_off)), (k as u32, off));
                    off += usize::from(o.len);
                }
            }
            prop_assert_eq!(pos, total);
            // Read back through the ops, the local bytes are the runs' bytes in order.
            let from_ops: Vec<usize> = ops
                .iter()
                .flat_map(|o| o.local_off..o.local_off + usize::from(o.len))
                .collect();
            let from_runs: Vec<usize> = runs.iter().flat_map(|&(a, n)| a..a + n).collect();
            prop_assert_eq!(from_ops, from_runs);
        }
    }
}

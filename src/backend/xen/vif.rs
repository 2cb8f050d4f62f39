//! One vif as a switch port: its counters, its place in the switch, and while a
//! netfront is connected, the connection: one or more queues (a TX and an RX ring,
//! event channels, a worker each). A frame for the netfront goes to the queue its
//! flow hashes to (one flow, one queue, in order), is staged there and grant-copied
//! into the queue's RX buffers with one ioctl per batch, when the sender signals at
//! the end of its batch. Staging keeps
//! the address of bytes the sender declared stable until then (`switch::stable`: an
//! uplink reader's or a vif worker's batch buffer) and copies only the rest.

use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use arc_swap::ArcSwapOption;
use tracing::debug;

use crate::backend::switch::deliver::Destination;
use crate::backend::switch::{stable, SwitchPort};
use crate::config::XenVifConfig;
use crate::features::Caps;
use crate::l2::{Mac, Vid};
use crate::netif::{self, RxSlot, RX_RING_SIZE};
use crate::stats::{Counters, DropReason, QueueCounters, QueueSnapshot};
use crate::sys::xen::evtchn::EvtchnDev;
use crate::sys::xen::gntdev::{CopyOp, CopyStatus, Gntdev, MappedPage};
use crate::sys::xen::DomId;
use crate::vnet_hdr::VirtioNetHdr;

/// RX bytes waiting for the copy after which a sender's batch is copied at once.
const STAGE_MAX: usize = 1 << 20;
/// Room for the bytes copied into staging: a frame more than STAGE_MAX and each
/// frame's padding, reserved once so the buffer never moves (the copy ops hold its
/// addresses, and its frames' page alignment holds).
const STAGE_ROOM: usize = STAGE_MAX + 2 * (65536 + netif::PAGE);

/// Most queues a vif serves (a bit each in `Conn::staged`).
pub const MAX_QUEUES: usize = crate::config::XEN_MAX_QUEUES;
const _: () = assert!(MAX_QUEUES <= 32);

/// The frontend end of one connection: its queues and what it accepts.
pub struct Conn {
    pub dom: DomId,
    /// What the netfront accepts from us.
    pub rx_caps: Caps,
    /// Set to stop the workers.
    pub stop: AtomicBool,
    /// One to `MAX_QUEUES` queues, `queue-N` in xenstore.
    pub queues: Vec<Queue>,
    /// The queues with frames staged since their last flush, a bit each: a sender's
    /// end of batch flushes those, not every queue.
    staged: AtomicU32,
}

/// One queue of a connection: its rings, its event channels (on an evtchn device of
/// its own, so each worker waits for its own events only), and its RX side.
pub struct Queue {
    pub index: usize,
    pub dom: DomId,
    pub gnt: Arc<Gntdev>,
    pub evt: EvtchnDev,
    /// Local event channel ports (the same one unless split).
    pub tx_port: u32,
    pub rx_port: u32,
    pub tx_ring: MappedPage,
    pub rx: Mutex<RxSide>,
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
    status: CopyStatus,
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
            status: CopyStatus::default(),
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
    pub fn new(dom: DomId, rx_caps: Caps, queues: Vec<Queue>) -> Conn {
        debug_assert!(!queues.is_empty() && queues.len() <= MAX_QUEUES);
        Conn {
            dom,
            rx_caps,
            stop: AtomicBool::new(false),
            queues,
            staged: AtomicU32::new(0),
        }
    }

    /// The queue a frame goes to: its flow's, as netback's `xenvif_select_queue`
    /// does, so one flow stays on one queue and in order.
    fn pick(&self, parts: &[&[u8]]) -> &Queue {
        let n = self.queues.len();
        if n == 1 {
            return &self.queues[0];
        }
        let q = (u64::from(flow_hash(parts)) * n as u64) >> 32;
        &self.queues[q as usize]
    }

    /// The connection is replaced or ends (see `Queue::close`).
    fn close(&self) {
        for q in &self.queues {
            q.close();
        }
    }

    /// Flushes every queue something was staged on since its last flush.
    fn flush_staged(&self, port: &VifPort) {
        let mut dirty = self.staged.swap(0, Ordering::AcqRel);
        while dirty != 0 {
            let q = dirty.trailing_zeros() as usize;
            dirty &= dirty - 1;
            if let Some(queue) = self.queues.get(q) {
                let mut rx = queue.rx.lock().unwrap_or_else(|e| e.into_inner());
                queue.flush(&mut rx, port);
            }
        }
    }
}

impl Queue {
    /// Copies the staged batch into the netfront's buffers (one ioctl), writes the
    /// responses in the slots of their requests and signals it if it asked.
    fn flush(&self, rx: &mut RxSide, port: &VifPort) {
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
        let stats = &port.stats;
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
                port.queue_stats(self.index)
                    .rx_calls
                    .fetch_add(1, Ordering::Relaxed);
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

/// A hash of a frame's flow for RX steering: its IPv4 or IPv6 addresses and
/// protocol, and its ports for TCP and UDP (not for a fragment); 0 for anything
/// else, which then takes the first queue. Reads at most the first 128 bytes.
pub fn flow_hash(parts: &[&[u8]]) -> u32 {
    let mut buf = [0u8; 128];
    let mut n = 0;
    for p in parts {
        let take = p.len().min(buf.len() - n);
        buf[n..n + take].copy_from_slice(&p[..take]);
        n += take;
        if n == buf.len() {
            break;
        }
    }
    let h = &buf[..n];
    let be16 = |i: usize| h.get(i..i + 2).map(|b| u16::from_be_bytes([b[0], b[1]]));
    let mut l3 = 14;
    let mut ety = be16(12);
    if matches!(ety, Some(0x8100 | 0x88a8)) {
        l3 += 4;
        ety = be16(16);
    }
    let (addrs, proto, l4) = match ety {
        Some(0x0800) => {
            let Some(&vihl) = h.get(l3) else { return 0 };
            let frag = be16(l3 + 6).is_none_or(|f| f & 0x3fff != 0);
            let l4 = (!frag).then_some(l3 + usize::from(vihl & 0xf) * 4);
            (l3 + 12..l3 + 20, h.get(l3 + 9), l4)
        }
        Some(0x86dd) => (l3 + 8..l3 + 40, h.get(l3 + 6), Some(l3 + 40)),
        _ => return 0,
    };
    let (Some(a), Some(&proto)) = (h.get(addrs), proto) else {
        return 0;
    };
    // FNV-1a over the flow's bytes, then a final mix so the high bits (which pick the
    // queue) depend on all of them.
    let mut x: u32 = 0x811c_9dc5;
    let mut eat = |b: &[u8]| {
        for &c in b {
            x = (x ^ u32::from(c)).wrapping_mul(0x0100_0193);
        }
    };
    eat(a);
    eat(&[proto]);
    if matches!(proto, 6 | 17) {
        if let Some(ports) = l4.and_then(|o| h.get(o..o + 4)) {
            eat(ports);
        }
    }
    x ^= x >> 16;
    x = x.wrapping_mul(0x7feb_352d);
    x ^= x >> 15;
    x
}

/// One vif's port in the switch.
pub struct VifPort {
    pub id: usize,
    pub cfg: XenVifConfig,
    pub stats: Counters,
    /// Each queue's own counters (`queue_stats`), kept across connections like
    /// `stats`; reported for the first `queues_seen`.
    queue_stats: [QueueCounters; MAX_QUEUES],
    /// The most queues a connection of this vif has had.
    queues_seen: AtomicUsize,
    /// `vifD.N` while attached, else the slot's own name.
    name: Mutex<String>,
    idle_name: String,
    /// Read for every frame: a load, no lock.
    conn: ArcSwapOption<Conn>,
    connected: AtomicBool,
}

impl VifPort {
    pub fn new(id: usize, cfg: XenVifConfig, idle_name: String) -> VifPort {
        VifPort {
            id,
            cfg,
            stats: Counters::default(),
            queue_stats: Default::default(),
            queues_seen: AtomicUsize::new(0),
            name: Mutex::new(idle_name.clone()),
            idle_name,
            conn: ArcSwapOption::empty(),
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
        self.conn.load_full()
    }

    /// A netfront connected (`Some`) or went away (`None`).
    pub fn set_conn(&self, c: Option<Arc<Conn>>) {
        if let Some(c) = &c {
            self.queues_seen
                .fetch_max(c.queues.len(), Ordering::Relaxed);
        }
        self.connected.store(c.is_some(), Ordering::Release);
        // Closed before anyone can see its successor: a sender that signals the new
        // connection leaves no address of its bytes in the old one.
        if let Some(old) = self.conn.swap(None) {
            old.close();
        }
        self.conn.store(c);
    }

    /// Queue `q`'s counters (`q` < `MAX_QUEUES`, as every queue's index is).
    pub fn queue_stats(&self, q: usize) -> &QueueCounters {
        &self.queue_stats[q.min(MAX_QUEUES - 1)]
    }

    /// The counters of each queue a connection of this vif has had, in order.
    pub fn queue_snapshots(&self) -> Vec<QueueSnapshot> {
        let n = self.queues_seen.load(Ordering::Relaxed).min(MAX_QUEUES);
        (0..n).map(|q| self.queue_stats[q].snapshot(q)).collect()
    }

    /// What the netfront may send us: what we advertised.
    pub fn tx_caps(&self) -> Caps {
        netif::tx_caps(self.cfg.csum, self.cfg.tso)
    }

    /// How many queues a netfront may ask for (`multi-queue-max-queues`).
    pub fn max_queues(&self) -> usize {
        self.cfg.queues.clamp(1, MAX_QUEUES)
    }
}

impl Destination for VifPort {
    fn caps(&self) -> Caps {
        self.conn
            .load()
            .as_ref()
            .map(|c| c.rx_caps)
            .unwrap_or_default()
    }

    fn max_burst(&self) -> Option<usize> {
        None
    }

    fn send(&self, _queue: usize, hdr: &VirtioNetHdr, parts: &[&[u8]]) -> Result<(), DropReason> {
        let guard = self.conn.load();
        let Some(conn) = guard.as_ref() else {
            return Err(DropReason::RxQueueFull);
        };
        let queue = conn.pick(parts);
        let mut rx = queue.rx.lock().unwrap_or_else(|e| e.into_inner());
        // The copy ops hold addresses in `staged`: it must never grow past what it
        // reserved (small frames, each from its own page, could otherwise get there
        // before STAGE_MAX bytes are pending).
        let len: usize = parts.iter().map(|p| p.len()).sum();
        if rx.staged.len() + netif::PAGE + len > rx.staged.capacity() {
            queue.flush(&mut rx, self);
            if netif::PAGE + len > rx.staged.capacity() {
                return Err(DropReason::TooLong);
            }
        }
        let qstats = self.queue_stats(queue.index);
        match queue.stage(&mut rx, hdr, parts, len) {
            Ok(()) => qstats.rx(len),
            Err(r) => {
                if r == DropReason::RxQueueFull && !rx.closed {
                    qstats.rx_full.fetch_add(1, Ordering::Relaxed);
                }
                return Err(r);
            }
        }
        if rx.pending >= STAGE_MAX || rx.resps.len() >= RX_RING_SIZE as usize / 2 {
            queue.flush(&mut rx, self);
        } else {
            // Under the queue's lock, after staging: a flush_staged that takes the bit
            // away before this finds the frame when it takes the lock.
            let bit = 1u32 << queue.index;
            if conn.staged.load(Ordering::Acquire) & bit == 0 {
                conn.staged.fetch_or(bit, Ordering::AcqRel);
            }
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
        self.conn.load().as_ref().map(|c| c.rx_caps)
    }

    fn signal_rx(&self, _queue: usize) {
        if let Some(conn) = self.conn.load().as_ref() {
            conn.flush_staged(self);
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

    fn flow(v6: bool, tcp: bool, ports: (u16, u16)) -> Vec<u8> {
        use crate::testkit::frames::{build, FrameSpec};
        let spec = FrameSpec {
            ports: Some(ports),
            ..if tcp {
                FrameSpec::tcp(v6, 200)
            } else {
                FrameSpec::udp(v6, 200)
            }
        };
        build(&spec).0
    }

    #[test]
    fn flows_spread_over_queues_and_other_frames_take_the_first() {
        for (v6, tcp) in [(false, true), (false, false), (true, true), (true, false)] {
            let mut per_queue = [0usize; 2];
            for port in 0..64u16 {
                let h = flow_hash(&[&flow(v6, tcp, (40000 + port, 5201))]);
                per_queue[((u64::from(h) * 2) >> 32) as usize] += 1;
            }
            assert!(
                per_queue.iter().all(|&n| n >= 16),
                "{v6} {tcp}: {per_queue:?}"
            );
        }
        // Same flow, same hash, however the frame is split into parts.
        let f = flow(false, true, (40001, 5201));
        let whole = flow_hash(&[&f]);
        for cut in [1, 13, 14, 20, 35, 40, 60, f.len() - 1] {
            assert_eq!(flow_hash(&[&f[..cut], &f[cut..]]), whole, "cut at {cut}");
        }
        assert_ne!(flow_hash(&[&flow(false, true, (40002, 5201))]), whole);
        // Not IP, or too short: 0.
        let mut arp = vec![0xffu8; 12];
        arp.extend_from_slice(&[0x08, 0x06]);
        arp.resize(60, 0);
        assert_eq!(flow_hash(&[&arp]), 0);
        assert_eq!(flow_hash(&[&f[..20]]), 0);
        assert_eq!(flow_hash(&[]), 0);
        // An IPv4 fragment hashes on its addresses only: all its fragments together.
        let mut frag = f.clone();
        frag[14 + 6] |= 0x20; // more fragments
        let mut other = flow(false, true, (40002, 5201));
        other[14 + 6] |= 0x20;
        assert_eq!(flow_hash(&[&frag]), flow_hash(&[&other]));
    }

    proptest! {
        /// Any bytes: a hash, no panic.
        #[test]
        fn flow_hash_takes_any_bytes(b in proptest::collection::vec(any::<u8>(), 0..200), cut in 0usize..200) {
            let cut = cut.min(b.len());
            prop_assert_eq!(flow_hash(&[&b[..cut], &b[cut..]]), flow_hash(&[&b]));
        }

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

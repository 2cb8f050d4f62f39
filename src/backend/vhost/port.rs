//! A vhost-user port: the state one guest's virtio-net device shares between its
//! queue workers, the switch and the uplink readers, and the RX writer other threads
//! use to hand it frames (under the RX queue's own lock, held for the copy only).

use std::num::Wrapping;
use std::sync::atomic::{
    AtomicBool, AtomicU16, AtomicU32, AtomicU64, AtomicU8, AtomicUsize, Ordering,
};
use std::sync::{Arc, Mutex, RwLock, RwLockReadGuard};

use arc_swap::ArcSwapOption;
use std::time::Instant;

use vhost_user_backend::{VringRwLock, VringT};
use virtio_queue::QueueT;
use vm_memory::{GuestAddressSpace, GuestMemoryAtomic};
use vmm_sys_util::eventfd::EventFd;

use super::coalesce::{Announce, RxCoalesce};
use super::pace::{Admit, Pacer};
use crate::backend::ratelimit::{ByteRate, LogLimit, RateAdmit, TokenBucket};
use crate::backend::switch::backpressure::StallClock;
use crate::backend::switch::deliver::{send_each, Destination, SegmentCharge};
use crate::backend::switch::run::RunFrame;
use crate::backend::switch::SwitchPort;
use crate::config::{PackedMode, PortConfig, RateLimit, MAX_TX_COALESCE_USECS};
use crate::features::{self, Caps, FeatureMask, Negotiated};
use crate::l2::{Mac, Vid, VlanSet};
use crate::ring::host::HostMem;
use crate::ring::packed::record::{RecordSlot, RingRecord};
use crate::ring::rx::{self, RxError, RxFormat, RxScratch, Source};
use crate::ring::split::SplitRing;
use crate::ring::tx::GuestTail;
use crate::ring::vq::{UsedPos, Vq};
use crate::ring::GuestMem;
use crate::stats::{Counters, DropReason};
use crate::vnet_hdr::VirtioNetHdr;

/// How many buffers ahead of its write an RX buffer is asked for (`Vq::prefetch_writes`).
const RX_PREFETCH_AHEAD: usize = 8;

/// Segments a guest's GSO frames may cost per second, and in one burst: an honest
/// guest at 10 Gbit/s with 1448-byte segments needs under a million a second; one
/// asking for gso_size 1 (65,000 segments a frame) is held to a few frames a second.
pub const SEGMENTS_PER_SEC: u64 = 4_000_000;
pub const SEGMENTS_BURST: u64 = 262_144;
/// Device resets (SET_FEATURES) a port's frontend may ask for, per second and saved
/// up. QEMU sends one per device start and a few around a migration; a frontend
/// resetting in a loop waits for its turn, and the work it makes (the relay, the
/// vhost crate, the port's set-up) stays bounded.
pub const RESETS_PER_SEC: u64 = 20;
pub const RESETS_BURST: u64 = 40;
/// Memory changes (ADD/REM_MEM_REG) a port's frontend may make, per second and saved
/// up. QEMU maps every region of a guest at each device start (the burst covers a
/// full set of slots twice) and one or a few per DIMM or virtio-mem memslot plugged
/// later; a frontend mapping and unmapping in a loop waits for its turn.
pub const MEM_CHANGES_PER_SEC: u64 = 100;
pub const MEM_CHANGES_BURST: u64 = 2 * super::firewall::MAX_MEM_SLOTS as u64;

pub type Mem = GuestMemoryAtomic<GuestMem>;
pub type Vring = VringRwLock<Mem>;

/// One RX queue as other threads see it: the vring (known once its worker ran) and
/// scratch space, behind the queue's own lock.
#[derive(Default)]
struct RxSlot {
    vring: Option<Vring>,
    scratch: RxScratch,
    /// The guest posted malformed buffers on this queue (until the next connection).
    broken: bool,
    /// The used position when the guest's wish for a call was last looked at.
    announced: Option<UsedPos>,
    /// Frames were written whose used entries are not published yet.
    unpublished: bool,
    /// A packed ring's state between holds of the vring: the used entries written
    /// and not published yet live in it (a split ring has them in guest memory,
    /// behind its used index), and its buffers are reused from write to write.
    packed: Option<Vq>,
    /// The avail index read last and the avail ring it was read from, kept until
    /// the next publish (the end of the sender's batch, or before a ring moves or
    /// stops): the frames of one batch read the driver's index line once.
    avail_seen: Option<(u64, Wrapping<u16>)>,
}

impl RxSlot {
    /// Publishes the used entries written since the last publish.
    fn publish(&mut self, mem: Option<&GuestMem>) {
        self.avail_seen = None;
        if !std::mem::take(&mut self.unpublished) {
            return;
        }
        let (Some(v), Some(mem)) = (&self.vring, mem) else {
            return;
        };
        let hm = HostMem::new(mem);
        match self.packed.as_mut() {
            Some(vq) => {
                vq.publish_used(&hm);
            }
            None => {
                SplitRing::of(v.get_ref().get_queue()).publish_used(&hm);
            }
        }
    }
}

/// The RX ring to write frames into, under the vring's lock: a split ring from the
/// queue, or the packed ring kept since the last write (`kept`, its unpublished used
/// entries with it) while it is still the queue's ring.
fn rx_ring<Q: QueueT>(kept: &mut Option<Vq>, q: &Q, packed: bool) -> Vq {
    if !packed {
        *kept = None;
        return Vq::of(q, false);
    }
    match kept.take() {
        Some(mut vq) => {
            if !vq.keeps(q) {
                // Moved or restarted since: the relay published before the
                // frontend's request, so nothing is left to write.
                vq.reload(q);
            }
            vq
        }
        None => Vq::of(q, true),
    }
}

/// The feature word port `cfg` offers under `mask`: VIRTIO_F_RING_PACKED if
/// `packed` (`Port::offers_packed`), VIRTIO_F_IN_ORDER with `in_order=on` only.
fn port_offer(mask: &FeatureMask, cfg: &PortConfig, packed: bool) -> u64 {
    let packed = if packed { features::RING_PACKED } else { 0 };
    let in_order = if cfg.in_order { features::IN_ORDER } else { 0 };
    features::offer(mask, cfg.queues) | packed | in_order
}

/// State shared by the port's workers, the switch, and the uplink readers.
pub struct Port {
    pub id: usize,
    pub cfg: PortConfig,
    /// The operator's mask and the offer it gives.
    offer: RwLock<(FeatureMask, u64)>,
    /// Read for every frame: lock-free loads.
    negotiated: ArcSwapOption<Negotiated>,
    /// `negotiated`'s RX caps (`Caps::to_bits`; none while not negotiated), which
    /// the switch asks for every frame: one load instead of a guard on `negotiated`.
    rx_caps: AtomicU8,
    /// The guest memory as mapped now (set at each memory table change).
    mem: ArcSwapOption<GuestMem>,
    /// Memory changes so far (tables and added or removed regions): a pass that
    /// keeps anything derived from `mem` past its own end keys it by this.
    mem_generation: AtomicU64,
    /// Whether `rx_rate=` is set: frames for the guest skip the pacer's lock and
    /// clock when it is not.
    rx_limited: AtomicBool,
    /// Whether `rate=` is set: the guest's frames skip its bucket's lock and clock.
    tx_limited: AtomicBool,
    rx: Vec<Mutex<RxSlot>>,
    /// Each split queue's avail position past its used one as last left
    /// (`keep_gap`).
    split_gaps: Box<[AtomicU16]>,
    connected: AtomicBool,
    /// How long the guest has kept its RX queue full.
    stall: StallClock,
    /// Segments its GSO frames may cost the switch, per second (`charge_segments`).
    segment_budget: TokenBucket,
    /// Lines this port may write to the log.
    pub log: LogLimit,
    /// Device resets its frontend may ask for (the relay waits for a token).
    pub resets: TokenBucket,
    /// Memory changes its frontend may make (the relay waits for a token).
    pub mem_changes: TokenBucket,
    /// Runtime `max_burst` (0: none), changed with `gsonet ctl`.
    max_burst: AtomicUsize,
    /// RX interrupt moderation, changed with `gsonet ctl`.
    pub rx_coalesce: RxCoalesce,
    /// Runtime `tx_coalesce_usecs`, changed with `gsonet ctl`.
    tx_coalesce_usecs: AtomicU32,
    /// Runtime `gro`, changed with `gsonet ctl`.
    gro: AtomicBool,
    /// Runtime `rate=`: what the guest may send, and its bucket.
    tx_rate: RwLock<Option<(RateLimit, ByteRate)>>,
    /// Runtime `rx_rate=`: what the guest may receive.
    rx_rate: RwLock<Option<(RateLimit, ByteRate)>>,
    /// Frames for the guest waiting for their departure under `rx_rate=`.
    pub pacer: Pacer,
    /// Per queue (RX 2n, TX 2n+1): the device started (a new connection, a restart)
    /// and the guest has not been called since. An earlier gsonet or connection may
    /// have published used entries and died before its call, and with EVENT_IDX the
    /// guest waits for that call forever; one call after the start is always due.
    owed_call: Box<[AtomicBool]>,
    /// The wake-ups of the port's queue workers (`PortBackend`): each makes its
    /// worker look at what a device start owes (`PortBackend::owed_look`).
    wakes: Mutex<Vec<EventFd>>,
    /// Set by a clean stop (`quiesce`): no ring is written again, so the used indexes
    /// QEMU reads back once the connection is closed are final. A write after that
    /// would put a used index the guest has passed behind what the next gsonet
    /// starts from.
    quiesced: AtomicBool,
    /// Held shared by a TX worker while it drains a queue; `quiesce` takes it
    /// exclusively to wait for the drains in progress.
    tx_gate: RwLock<()>,
    pub stats: Counters,
    /// A packed port's packed rings' published positions, kept in a file beside
    /// its socket for the gsonet after this one (`ring::packed::record`).
    pub rings: Option<Arc<RingRecord>>,
    /// Whether VIRTIO_F_RING_PACKED is offered (`packed=`, and for `auto` whether
    /// `rings` could be opened).
    offers_packed: bool,
    /// Why `packed=auto` offers split rings only (`gsonet stats` shows it).
    pub packed_refused: Option<String>,
}

/// The path of port `cfg`'s record, `SOCKET.rings`; `None` with `packed=off`,
/// which keeps none.
pub fn record_path(cfg: &PortConfig) -> Option<std::path::PathBuf> {
    if cfg.packed == PackedMode::Off {
        return None;
    }
    let mut path = cfg.socket.clone().into_os_string();
    path.push(".rings");
    Some(std::path::PathBuf::from(path))
}

/// What `packed=` makes of port `cfg`: the record of its rings (`SOCKET.rings`),
/// whether it offers packed rings, and if it does not with `packed=auto`, why.
/// `packed=on` offers them without a record too (with a warning): a restart then
/// resumes packed rings where the frontend says, which leaves them stopped.
fn open_record(cfg: &PortConfig) -> (Option<Arc<RingRecord>>, bool, Option<String>) {
    let Some(path) = record_path(cfg) else {
        return (None, false, None);
    };
    match RingRecord::open(&path, 2 * usize::from(cfg.queues)) {
        Ok(r) => (Some(Arc::new(r)), true, None),
        Err(e) if cfg.packed == PackedMode::On => {
            tracing::warn!(port = %cfg.socket.display(), record = %path.display(), "cannot keep the packed rings' positions ({e}): after a restart of gsonet a packed guest's queues stop");
            (None, true, None)
        }
        Err(e) => {
            let why = format!(
                "cannot keep the packed rings' positions in {}: {e}",
                path.display()
            );
            tracing::warn!(port = %cfg.socket.display(), "packed=auto: {why}; split rings only (packed=on offers packed rings anyway, which a restart of gsonet leaves stopped)");
            (None, false, Some(why))
        }
    }
}

impl Port {
    pub fn new(id: usize, cfg: PortConfig) -> std::io::Result<Port> {
        let pairs = cfg.queues as usize;
        let (rings, offers_packed, packed_refused) = open_record(&cfg);
        Ok(Port {
            id,
            offer: RwLock::new((cfg.mask, port_offer(&cfg.mask, &cfg, offers_packed))),
            negotiated: ArcSwapOption::empty(),
            rx_caps: AtomicU8::new(0),
            mem: ArcSwapOption::empty(),
            mem_generation: AtomicU64::new(0),
            rx_limited: AtomicBool::new(cfg.rx_rate.is_some()),
            tx_limited: AtomicBool::new(cfg.rate.is_some()),
            rx: (0..pairs).map(|_| Mutex::new(RxSlot::default())).collect(),
            split_gaps: (0..2 * pairs).map(|_| AtomicU16::new(0)).collect(),
            connected: AtomicBool::new(false),
            max_burst: AtomicUsize::new(cfg.max_burst.unwrap_or(0)),
            gro: AtomicBool::new(cfg.gro),
            tx_rate: RwLock::new(cfg.rate.map(|r| (r, ByteRate::new(r.mbit, r.burst_kb)))),
            rx_rate: RwLock::new(cfg.rx_rate.map(|r| (r, ByteRate::new(r.mbit, r.burst_kb)))),
            stall: StallClock::default(),
            segment_budget: TokenBucket::new(SEGMENTS_PER_SEC, SEGMENTS_BURST),
            log: LogLimit::default(),
            resets: TokenBucket::new(RESETS_PER_SEC, RESETS_BURST),
            mem_changes: TokenBucket::new(MEM_CHANGES_PER_SEC, MEM_CHANGES_BURST),
            rx_coalesce: RxCoalesce::new(pairs, cfg.rx_coalesce_usecs, cfg.rx_coalesce_frames)?,
            tx_coalesce_usecs: AtomicU32::new(cfg.tx_coalesce_usecs.min(MAX_TX_COALESCE_USECS)),
            pacer: Pacer::new(pairs)?,
            owed_call: (0..2 * pairs).map(|_| AtomicBool::new(false)).collect(),
            wakes: Mutex::new(Vec::new()),
            quiesced: AtomicBool::new(false),
            tx_gate: RwLock::new(()),
            stats: Counters::default(),
            rings,
            offers_packed,
            packed_refused,
            cfg,
        })
    }

    /// How long a TX completion call may wait (µs; 0: none).
    pub fn tx_coalesce_usecs(&self) -> u32 {
        self.tx_coalesce_usecs.load(Ordering::Relaxed)
    }

    pub fn set_tx_coalesce_usecs(&self, usecs: u32) {
        self.tx_coalesce_usecs
            .store(usecs.min(MAX_TX_COALESCE_USECS), Ordering::Relaxed);
    }

    pub fn max_burst(&self) -> Option<usize> {
        Some(self.max_burst.load(Ordering::Relaxed)).filter(|&b| b > 0)
    }

    pub fn set_max_burst(&self, b: Option<usize>) {
        self.max_burst.store(b.unwrap_or(0), Ordering::Relaxed);
    }

    /// The guest's `rate=`, if limited.
    pub fn rate(&self) -> Option<RateLimit> {
        if !self.tx_limited.load(Ordering::Acquire) {
            return None;
        }
        let r = self.tx_rate.read().unwrap_or_else(|e| e.into_inner());
        r.as_ref().map(|(l, _)| *l)
    }

    /// A new `rate=` (a fresh bucket), at once.
    pub fn set_rate(&self, r: Option<RateLimit>) {
        let mut rate = self.tx_rate.write().unwrap_or_else(|e| e.into_inner());
        *rate = r.map(|r| (r, ByteRate::new(r.mbit, r.burst_kb)));
        self.tx_limited.store(rate.is_some(), Ordering::Release);
    }

    /// The guest's `rx_rate=`, if limited.
    pub fn rx_rate(&self) -> Option<RateLimit> {
        let r = self.rx_rate.read().unwrap_or_else(|e| e.into_inner());
        r.as_ref().map(|(l, _)| *l)
    }

    /// A new `rx_rate=` (a fresh bucket), at once.
    pub fn set_rx_rate(&self, r: Option<RateLimit>) {
        let mut rate = self.rx_rate.write().unwrap_or_else(|e| e.into_inner());
        *rate = r.map(|r| (r, ByteRate::new(r.mbit, r.burst_kb)));
        self.rx_limited.store(rate.is_some(), Ordering::Release);
    }

    /// `None`: the guest may send now; else how long its TX queue waits (`rate=`).
    pub fn tx_wait(&self) -> Option<std::time::Duration> {
        if !self.tx_limited.load(Ordering::Acquire) {
            return None;
        }
        let r = self.tx_rate.read().unwrap_or_else(|e| e.into_inner());
        r.as_ref()
            .and_then(|(_, b)| b.wait_at(std::time::Instant::now()))
    }

    /// Charges `wire` bytes the guest sent to its `rate=`. Per frame: the check
    /// inlined, the charge out of line.
    #[inline]
    pub fn tx_charge(&self, wire: usize) {
        if self.tx_limited.load(Ordering::Acquire) {
            self.tx_charge_limited(wire);
        }
    }

    #[inline(never)]
    fn tx_charge_limited(&self, wire: usize) {
        let r = self.tx_rate.read().unwrap_or_else(|e| e.into_inner());
        if let Some((_, b)) = r.as_ref() {
            b.charge_at(wire as u64, std::time::Instant::now());
        }
    }

    /// `Destination::rx_rate` of a port with an `rx_rate=`: out of line, so the
    /// check every frame makes stays small.
    #[inline(never)]
    fn rx_rate_limited(&self, wire: usize, may_wait: bool) -> RateAdmit {
        let r = self.rx_rate.read().unwrap_or_else(|e| e.into_inner());
        r.as_ref().map_or(RateAdmit::Now, |(_, b)| {
            b.admit_at(wire as u64, std::time::Instant::now(), may_wait)
        })
    }

    pub fn set_gro(&self, on: bool) {
        self.gro.store(on, Ordering::Relaxed);
    }

    pub fn name(&self) -> String {
        self.cfg.name()
    }

    pub fn queue_pairs(&self) -> usize {
        self.rx.len()
    }

    pub fn offered(&self) -> u64 {
        self.offer.read().unwrap_or_else(|e| e.into_inner()).1
    }

    pub fn mask(&self) -> FeatureMask {
        self.offer.read().unwrap_or_else(|e| e.into_inner()).0
    }

    /// Re-computes the offer after a mask change. It takes effect with the next
    /// frontend connection: QEMU asks a backend for its features once per connection
    /// and keeps them across guest reboots and driver reloads.
    pub fn set_mask(&self, mask: FeatureMask) {
        *self.offer.write().unwrap_or_else(|e| e.into_inner()) =
            (mask, port_offer(&mask, &self.cfg, self.offers_packed));
    }

    pub fn negotiated(&self) -> Option<Negotiated> {
        self.negotiated.load().as_deref().copied()
    }

    pub fn is_connected(&self) -> bool {
        self.connected.load(Ordering::Acquire)
    }

    /// Whether the frontend acked VIRTIO_F_RING_PACKED: every queue is a packed ring.
    pub fn packed(&self) -> bool {
        self.negotiated.load().as_ref().is_some_and(|n| n.packed)
    }

    /// Asks the guest not to kick `vring` (a worker is looking at it anyway). A
    /// packed ring has its own event structure: vhost-user-backend's helper knows
    /// split rings only, and with EVENT_IDX would write past a packed ring's device
    /// area.
    pub fn kicks_off(&self, vring: &Vring) {
        if !self.packed() {
            let _ = vring.disable_notification();
            return;
        }
        let (Some(mem), st) = (self.memory(), vring.get_ref()) else {
            return;
        };
        if st.get_queue().ready() {
            let ring = Vq::of(st.get_queue(), true);
            if let Some(p) = ring.packed_ring() {
                p.disable_kicks(&HostMem::new(&mem));
            }
        }
    }

    /// Asks the guest to kick `vring` when it adds buffers; true if some were added
    /// meanwhile (the caller looks again rather than wait for a kick that may not
    /// come).
    pub fn kicks_on(&self, vring: &Vring) -> bool {
        if !self.packed() {
            return matches!(vring.enable_notification(), Ok(true));
        }
        let (Some(mem), st) = (self.memory(), vring.get_ref()) else {
            return false;
        };
        if !st.get_queue().ready() {
            return false;
        }
        let ring = Vq::of(st.get_queue(), true);
        ring.packed_ring()
            .is_some_and(|p| p.enable_kicks(&HostMem::new(&mem)) == Some(true))
    }

    pub fn set_connected(&self, up: bool) {
        self.connected.store(up, Ordering::Release);
        if !up {
            self.negotiated.store(None);
            self.rx_caps.store(0, Ordering::Release);
            self.mem.store(None);
            for slot in &self.rx {
                if let Ok(mut s) = slot.lock() {
                    s.vring = None;
                    s.broken = false;
                    s.announced = None;
                    s.packed = None;
                    s.unpublished = false;
                }
            }
            for _ in 0..self.pacer.clear() {
                self.stats.drop(DropReason::RateLimited);
            }
        }
    }

    /// Stops writing the guest's rings: waits for the RX writes and TX drains in
    /// progress, after which frames for the guest are dropped and its TX queues are
    /// left alone.
    pub fn quiesce(&self) {
        self.quiesced.store(true, Ordering::Release);
        self.publish_rx();
        drop(self.tx_gate.write());
    }

    /// Leave to drain a TX queue: `None` once quiesced; the drain holds it meanwhile.
    pub fn tx_gate(&self) -> Option<RwLockReadGuard<'_, ()>> {
        let g = self.tx_gate.read().unwrap_or_else(|e| e.into_inner());
        (!self.quiesced.load(Ordering::Acquire)).then_some(g)
    }

    /// Whether every RX queue's vring is known (see `PortBackend::introduce_workers`).
    pub fn rx_known(&self) -> bool {
        self.rx
            .iter()
            .all(|s| s.lock().map(|s| s.vring.is_some()).unwrap_or(false))
    }

    /// The guest acked `acked`: the port is live.
    pub fn set_negotiated(&self, neg: Negotiated) {
        self.negotiated.store(Some(Arc::new(neg)));
        self.rx_caps.store(neg.rx.to_bits(), Ordering::Release);
        self.connected.store(true, Ordering::Release);
        // Features come at every device start: each queue owes the guest a call.
        for c in self.owed_call.iter() {
            c.store(true, Ordering::Release);
        }
    }

    /// The workers to wake when a ring of the port may have started (`wake_workers`).
    pub fn set_wakes(&self, wakes: Vec<EventFd>) {
        *self.wakes.lock().unwrap_or_else(|e| e.into_inner()) = wakes;
    }

    /// A request that may start a ring went to the vhost crate (features, a ring's
    /// kick, call or enable): every worker looks at the calls the start owes.
    pub fn wake_workers(&self) {
        for w in self.wakes.lock().unwrap_or_else(|e| e.into_inner()).iter() {
            let _ = w.write(1);
        }
    }

    /// Whether a queue of pair `pair` still owes its guest a call since the device
    /// started.
    pub fn owes(&self, pair: usize) -> bool {
        let owed = |f: Option<&AtomicBool>| f.is_some_and(|f| f.load(Ordering::Acquire));
        owed(self.owed_call.get(2 * pair)) || owed(self.owed_call.get(2 * pair + 1))
    }

    /// Calls the guest on `queue` if a call is owed since the device started and the
    /// queue has its call fd by now (a spurious call costs the guest a look at the
    /// used ring). True if it called.
    pub fn pay_owed_call(&self, queue: usize, vring: &Vring) -> bool {
        let Some(owed) = self.owed_call.get(queue) else {
            return false;
        };
        if !owed.load(Ordering::Acquire) || vring.get_ref().get_call().is_none() {
            return false;
        }
        if !owed.swap(false, Ordering::AcqRel) {
            return false;
        }
        let _ = vring.signal_used_queue();
        let calls = if queue.is_multiple_of(2) {
            &self.stats.rx_calls
        } else {
            &self.stats.tx_calls
        };
        calls.fetch_add(1, Ordering::Relaxed);
        true
    }

    /// The frontend's memory changed (a table, a region added or removed). Returns
    /// once no pass uses the memory as it was: the TX drains in progress (each loads
    /// the memory after taking `tx_gate`) and the RX writes and publishes in progress
    /// (each loads it under its queue's lock) have ended, so after the reply a
    /// removed region is never touched again and an added one is seen by the next
    /// chain. Passes wait for nothing here but this port's memory.
    pub fn set_mem(&self, mem: Mem) {
        self.mem.store(Some(mem.memory().into_inner()));
        self.mem_generation.fetch_add(1, Ordering::AcqRel);
        drop(self.tx_gate.write().unwrap_or_else(|e| e.into_inner()));
        for slot in &self.rx {
            drop(slot.lock().unwrap_or_else(|e| e.into_inner()));
        }
    }

    /// Memory changes so far (see `mem_generation`).
    pub fn mem_generation(&self) -> u64 {
        self.mem_generation.load(Ordering::Acquire)
    }

    /// The guest memory mapped now: (regions, bytes).
    pub fn mem_mapped(&self) -> (usize, u64) {
        use vm_memory::{GuestMemoryBackend, GuestMemoryRegion};
        self.memory()
            .map(|m| (m.num_regions(), m.iter().map(|r| r.len()).sum()))
            .unwrap_or_default()
    }

    /// Stops dirty-page logging in the guest memory as mapped now (features acked
    /// without LOG_ALL). A later SET_LOG_BASE turns it on again.
    pub fn stop_logging(&self) {
        if let Some(mem) = self.memory() {
            crate::ring::guest_mem::stop_logging(&mem);
        }
    }

    /// Whether writes to the guest's memory are logged now.
    pub fn logging(&self) -> bool {
        self.memory()
            .is_some_and(|m| crate::ring::guest_mem::logging(&m))
    }

    /// The guest memory as mapped now, if the frontend sent a table.
    pub fn memory(&self) -> Option<Arc<GuestMem>> {
        self.mem.load_full()
    }

    /// Where queue `q`'s packed ring records its publishes, if the port keeps a
    /// record.
    pub fn ring_slot(&self, q: usize) -> Option<RecordSlot> {
        self.rings.as_ref().and_then(|r| r.slot_of(q))
    }

    /// At a hold of ready queue `q`: a split ring whose avail position is not as
    /// far past its used one as this port left it (`keep_gap`) was started since
    /// by its frontend (SET_VRING_BASE, SET_VRING_ADDR), and starts at the used
    /// index in guest memory if the frontend's base is not it
    /// (`Vq::start_at_used`), said once per start. The two positions differ by
    /// the heads outside the table skipped without a used entry; a frontend that
    /// sends the base it read back (QEMU) keeps that difference.
    pub fn look_at_start<Q: QueueT>(&self, q: usize, ring: &mut Vq, queue: &mut Q) {
        let Some(kept) = self.split_gaps.get(q) else {
            return;
        };
        if let Some((base, used)) = ring.start_at_used(kept.load(Ordering::Relaxed), queue) {
            kept.store(0, Ordering::Relaxed);
            // A frontend that reconnects in a loop says it each time: the port's
            // log budget bounds the lines.
            if let Some(quiet) = self.log.allow() {
                tracing::info!(port = %self.name(), queue = q, frontend_base = base, used, suppressed = quiet,
                    "split ring started at the used index in guest memory, not at the frontend's base (DPDK's virtio_user sends 0 after a reconnect)");
            }
        }
    }

    /// What `look_at_start` compares with: how far queue `q`'s avail position is
    /// past its used one as a hold leaves it (under the vring's lock).
    pub fn keep_gap(&self, q: usize, ring: &Vq) {
        if let (Some(kept), Some(gap)) = (self.split_gaps.get(q), ring.split_gap()) {
            kept.store(gap, Ordering::Relaxed);
        }
    }

    /// Remembers the vring of RX queue `pair`, seen by its worker.
    pub fn remember_rx(&self, pair: usize, vring: &Vring) {
        if let Some(slot) = self.rx.get(pair) {
            if let Ok(mut s) = slot.lock() {
                if s.vring.is_none() {
                    s.vring = Some(vring.clone());
                }
            }
        }
    }

    /// Writes one frame into RX queue `pair` (modulo the pairs this port has).
    /// The caller signals the guest later, once per batch (`Pending::flush`).
    pub fn receive(&self, pair: usize, hdr: &VirtioNetHdr, parts: &[&[u8]]) -> Result<(), RxError> {
        self.receive_from(pair, hdr, Source::Own(parts))
    }

    /// `receive`, with the frame's bytes from `src` (gsonet's memory, or another
    /// guest's).
    pub fn receive_from(
        &self,
        pair: usize,
        hdr: &VirtioNetHdr,
        src: Source<'_>,
    ) -> Result<(), RxError> {
        let mut out = Ok(());
        self.receive_all(pair, std::iter::once((hdr, src)), &mut |_, r| out = r);
        out
    }

    /// Writes `frames` into RX queue `pair` in order, under one hold of the queue,
    /// telling `each` how the i-th went. Once the queue has no room, the frames left
    /// are not tried (they find it full too).
    fn receive_all<'s>(
        &self,
        pair: usize,
        frames: impl IntoIterator<Item = (&'s VirtioNetHdr, Source<'s>)>,
        each: &mut impl FnMut(usize, Result<(), RxError>),
    ) {
        let mut frames = frames.into_iter().enumerate();
        if let Err(e) = self.write_frames(pair % self.rx.len(), &mut frames, each) {
            for (i, _) in frames {
                each(i, Err(e));
            }
        }
    }

    /// `receive_all`'s writes: an error when the queue took no more (every frame
    /// `frames` still holds fails the same way).
    fn write_frames<'s>(
        &self,
        pair: usize,
        frames: &mut impl Iterator<Item = (usize, (&'s VirtioNetHdr, Source<'s>))>,
        each: &mut impl FnMut(usize, Result<(), RxError>),
    ) -> Result<(), RxError> {
        let Some(neg) = self.negotiated() else {
            return Err(RxError::NoBuffers);
        };
        let mut slot = self.rx[pair].lock().unwrap_or_else(|e| e.into_inner());
        if self.quiesced.load(Ordering::Acquire) {
            return Err(RxError::NoBuffers);
        }
        // Under the queue's lock, so `set_mem` knows when these writes are done with it.
        let mem = self.mem.load();
        let Some(mem) = mem.as_deref() else {
            return Err(RxError::NoBuffers);
        };
        let RxSlot {
            vring,
            scratch,
            broken,
            unpublished,
            avail_seen,
            packed,
            ..
        } = &mut *slot;
        if *broken {
            return Err(RxError::BadChain);
        }
        let Some(vring) = vring else {
            return Err(RxError::NoBuffers);
        };
        let mut state = vring.get_mut();
        if !state.get_queue().ready() || !state.is_enabled() {
            return Err(RxError::NoBuffers);
        }
        let mut ring = rx_ring(packed, state.get_queue(), neg.packed);
        self.look_at_start(2 * pair, &mut ring, state.get_queue_mut());
        ring.record_in(|| self.ring_slot(2 * pair));
        let fmt = RxFormat {
            hdr_len: neg.hdr_len(),
            mrg_rxbuf: neg.mrg_rxbuf,
            indirect: neg.indirect_desc,
        };
        let hm = HostMem::new(mem);
        if let Vq::Split { ring, .. } = &mut ring {
            ring.avail_seen = avail_seen
                .filter(|(ring_at, _)| *ring_at == ring.avail)
                .map(|(_, seen)| seen);
        }
        if ring.pending_cached(&hm).is_none() {
            // A ring whose avail index jumped (or a packed ring whose position is
            // outside it) is not written to again until its device is set up anew:
            // every later frame costs O(1). (A single bad chain is consumed and
            // counted; the queue goes on.) What was written before is still
            // published.
            if ring.is_packed() {
                *packed = Some(ring);
            }
            *broken = true;
            return Err(RxError::BadChain);
        }
        // The used index moves at the end of the sender's batch (`publish_rx`): one
        // store for the batch, not one per frame on a line the guest polls.
        let mut written = 0;
        let mut full = false;
        // Each buffer's first lines are asked for `RX_PREFETCH_AHEAD` buffers before
        // it is written: as many more as each frame took (several for a frame
        // spread over buffers), while the run's frames still need them.
        let mut left = frames.size_hint().0;
        ring.prefetch_writes(&hm, 0, left.min(RX_PREFETCH_AHEAD));
        for (i, (hdr, src)) in frames.by_ref() {
            left = left.saturating_sub(1);
            let mut r = rx::write_frame_in(&mut ring, &hm, scratch, hdr, fmt, src, false);
            if r == Err(RxError::NoBuffers) {
                // Ask the guest to kick when it adds buffers (`Vq::ask_kick`: past
                // those it has now, which were too few). Buffers it added since
                // the ring was last read may have been added after it looked at that
                // wish, with no kick to come: they are tried now, or the queue would
                // count as full, then stalled, while it has room.
                if ring.ask_kick(&hm) == Some(true) {
                    r = rx::write_frame_in(&mut ring, &hm, scratch, hdr, fmt, src, false);
                }
            }
            match r {
                Ok(took) => {
                    written += 1;
                    let took = took.min(RX_PREFETCH_AHEAD);
                    if left.saturating_mul(took) > RX_PREFETCH_AHEAD {
                        ring.prefetch_writes(&hm, RX_PREFETCH_AHEAD - took, took);
                    }
                }
                Err(RxError::NoBuffers) => full = true,
                Err(_) => {}
            }
            each(i, r.map(|_| ()));
            if full {
                break;
            }
        }
        ring.store(state.get_queue_mut());
        self.keep_gap(2 * pair, &ring);
        match ring {
            Vq::Split { ring, .. } => {
                *avail_seen = ring.avail_seen.map(|seen| (ring.avail, seen));
            }
            vq @ Vq::Packed { .. } => *packed = Some(vq),
        }
        *unpublished |= written > 0;
        if written > 0 {
            self.rx_coalesce.frames(pair, written);
            self.stall.room();
        }
        if full {
            self.stall.full();
            return Err(RxError::NoBuffers);
        }
        Ok(())
    }

    /// Publishes the used entries of every frame written into the guest's RX queues
    /// so far (the end of a sender's batch; before the frontend stops or moves a
    /// ring, and at a clean stop).
    pub fn publish_rx(&self) {
        for pair in 0..self.rx.len() {
            self.publish_rx_queue(pair);
        }
    }

    /// Publishes what was written into RX queue `pair`.
    pub fn publish_rx_queue(&self, pair: usize) {
        if let Some(slot) = self.rx.get(pair) {
            let mut slot = slot.lock().unwrap_or_else(|e| e.into_inner());
            // Under the queue's lock (`set_mem`).
            slot.publish(self.mem.load().as_deref());
        }
    }

    /// The guest added RX buffers.
    pub fn rx_refilled(&self) {
        self.stall.room();
    }

    /// `rx_rate=` in bytes a second, if limited.
    fn rx_bytes_per_sec(&self) -> Option<f64> {
        let r = self.rx_rate.read().unwrap_or_else(|e| e.into_inner());
        r.as_ref().map(|(l, _)| l.mbit as f64 * 1e6 / 8.0)
    }

    /// The pace timer of queue `pair` fired (in the port's own worker): writes the
    /// frames that are due, then announces them.
    pub fn pace_fired(&self, pair: usize) {
        if let Some(t) = self.pacer.timer(pair) {
            t.clear();
        }
        let mut due = Vec::new();
        loop {
            self.pacer.take_due(pair, Instant::now(), &mut due);
            if due.is_empty() {
                return;
            }
            for w in due.drain(..) {
                if let Err(r) = self.write_now(pair, &w.hdr, Source::Own(&[&w.data])) {
                    self.stats.drop(r);
                }
            }
            SwitchPort::signal_rx(self, pair);
        }
    }

    /// Writes one frame for the guest now (`Destination::send` once paced, or
    /// `send_guest`).
    fn write_now(
        &self,
        queue: usize,
        hdr: &VirtioNetHdr,
        src: Source<'_>,
    ) -> Result<(), DropReason> {
        // A guest that has not read its queue for a while still has its ring looked
        // at (one lock, one load of its avail index when it shows nothing left): a
        // guest that adds buffers without a kick gets frames again.
        self.receive_from(queue, hdr, src)
            .map_err(|e| self.rx_drop(e))
    }

    /// Why a frame the RX queue refused is dropped: a full queue the guest has not
    /// read for a while is not worth waiting for (`rx_queue_stalled`).
    fn rx_drop(&self, e: RxError) -> DropReason {
        match e {
            RxError::NoBuffers if self.stall.stalled() => DropReason::RxQueueStalled,
            e => e.into(),
        }
    }

    /// Frames for RX queue `pair` go through the pacer: `rx_rate=` is set, or frames
    /// wait in it already (none may pass them).
    fn paced(&self, pair: usize) -> bool {
        self.rx_limited.load(Ordering::Acquire) || self.pacer.busy(pair)
    }

    /// The RX coalescing timer of queue `pair` fired (in the port's own worker):
    /// announce what waits.
    pub fn rx_coalesce_fired(&self, pair: usize) {
        self.rx_coalesce.fired(pair);
        self.signal_rx_queue(pair);
    }

    /// Signals the guest for RX queue `pair` if the ring says it wants it.
    /// Never signals under the RX slot lock other senders need; the call fd is
    /// non-blocking (the relay sees to it), so a full eventfd costs one EAGAIN.
    fn signal_rx_queue(&self, pair: usize) {
        let pair = pair % self.rx.len();
        let (vring, wants) = {
            let mut slot = self.rx[pair].lock().unwrap_or_else(|e| e.into_inner());
            // Under the queue's lock (`set_mem`).
            let mem = self.memory();
            slot.publish(mem.as_deref());
            let Some(v) = slot.vring.clone() else {
                return;
            };
            let ring = Vq::of(v.get_ref().get_queue(), self.packed());
            let since = slot.announced.replace(ring.used_pos());
            let wants = match (&mem, since) {
                (Some(m), Some(since)) => ring.wants_call(&HostMem::new(m), since),
                _ => true,
            };
            (v, wants)
        };
        if self.pay_owed_call(2 * pair, &vring) {
            return;
        }
        if wants {
            self.stats.rx_calls.fetch_add(1, Ordering::Relaxed);
            let _ = vring.signal_used_queue();
        }
    }
}

impl SegmentCharge for Port {
    /// Charges the software segmentation one of this guest's frames costs (its
    /// segment count); false, counted, when the guest has used up its budget.
    fn charge_segments(&self, segments: usize) -> bool {
        let ok = segments <= 1 || self.segment_budget.take(segments as u64);
        if !ok {
            self.stats.drop(DropReason::SegmentBudget);
        }
        ok
    }
}

impl Destination for Port {
    fn caps(&self) -> Caps {
        Caps::from_bits(self.rx_caps.load(Ordering::Acquire))
    }

    fn max_burst(&self) -> Option<usize> {
        Port::max_burst(self)
    }

    fn gro(&self) -> bool {
        self.gro.load(Ordering::Relaxed)
    }

    fn rx_rate(&self, wire: usize, may_wait: bool) -> RateAdmit {
        if !self.rx_limited.load(Ordering::Acquire) {
            return RateAdmit::Now;
        }
        self.rx_rate_limited(wire, may_wait)
    }

    fn send(&self, queue: usize, hdr: &VirtioNetHdr, parts: &[&[u8]]) -> Result<(), DropReason> {
        let pair = queue % self.rx.len();
        if !self.paced(pair) {
            // No rate and nothing waiting: no clock, no pacer lock.
            return self.write_now(pair, hdr, Source::Own(parts));
        }
        match self
            .pacer
            .admit(pair, self.rx_bytes_per_sec(), hdr, parts, Instant::now())
        {
            Admit::Now => self.write_now(pair, hdr, Source::Own(parts)),
            Admit::Queued => Ok(()),
            Admit::Full => Err(DropReason::RateLimited),
        }
    }

    fn takes_guest_bytes(&self, queue: usize) -> bool {
        // A paced frame waits in gsonet's memory: it is made whole first.
        !self.paced(queue % self.rx.len())
    }

    fn send_guest(
        &self,
        queue: usize,
        hdr: &VirtioNetHdr,
        head: &[&[u8]],
        tail: &GuestTail,
    ) -> Result<(), DropReason> {
        // (A rate set since `takes_guest_bytes` said yes lets this one frame through
        // unpaced.)
        let r = self.write_now(queue, hdr, Source::Guest { head, tail });
        if r.is_ok() {
            self.stats.rx_one_copy.fetch_add(1, Ordering::Relaxed);
        }
        r
    }

    fn send_run(
        &self,
        queue: usize,
        frames: &[RunFrame<'_>],
        failed: &mut Vec<(usize, DropReason)>,
    ) {
        let pair = queue % self.rx.len();
        if self.paced(pair) {
            // Paced: frame by frame, through the pacer.
            return send_each(self, queue, frames, failed);
        }
        let before = failed.len();
        self.receive_all(pair, frames.iter().map(run_source), &mut |i, r| {
            if let Err(e) = r {
                failed.push((i, self.rx_drop(e)));
            }
        });
        let one_copy = frames.iter().filter(|f| f.tail.is_some()).count()
            - failed[before..]
                .iter()
                .filter(|&&(i, _)| frames[i].tail.is_some())
                .count();
        if one_copy > 0 {
            self.stats
                .rx_one_copy
                .fetch_add(one_copy as u64, Ordering::Relaxed);
        }
    }

    fn stats(&self) -> &Counters {
        &self.stats
    }
}

/// A frame of a run as the RX ring writes it.
fn run_source<'s>(f: &'s RunFrame<'s>) -> (&'s VirtioNetHdr, Source<'s>) {
    let head = std::slice::from_ref(&f.head);
    let src = match &f.tail {
        Some(tail) => Source::Guest { head, tail },
        None => Source::Own(head),
    };
    (&f.hdr, src)
}

impl SwitchPort for Port {
    fn vlan(&self) -> Option<Vid> {
        self.cfg.vlan
    }

    fn trunk(&self) -> Option<VlanSet> {
        self.cfg.trunk.clone()
    }

    fn mac(&self) -> Option<Mac> {
        self.cfg.mac
    }

    fn mac_lock(&self) -> bool {
        self.cfg.mac_lock
    }

    fn mac_limit(&self) -> usize {
        self.cfg.mac_limit
    }

    fn is_connected(&self) -> bool {
        Port::is_connected(self)
    }

    fn rx_caps(&self) -> Option<Caps> {
        self.negotiated().map(|n| n.rx)
    }

    fn signal_rx(&self, queue: usize) {
        let pair = queue % self.rx.len();
        // Visible at once; only the call waits for RX coalescing
        // (`signal_rx_queue` publishes before it decides).
        if self.rx_coalesce.batch_done(pair) == Announce::Now {
            self.signal_rx_queue(pair);
        } else {
            self.publish_rx_queue(pair);
        }
    }

    fn quiesce(&self) {
        Port::quiesce(self);
    }
}

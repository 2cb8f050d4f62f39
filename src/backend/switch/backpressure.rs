//! RX back-pressure, in one place: what a full guest RX queue means. A guest's stall
//! clock (how long its queue has been full), and the bounded deferral a sender that
//! can hold frames (an uplink reader, a guest's TX queue) keeps per destination: a frame for a full queue
//! is copied aside and re-delivered to the destination already resolved, without
//! learning or classifying again, while the reader goes on serving everyone else.

use std::collections::VecDeque;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering::{Relaxed, SeqCst};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use super::deliver::{Again, DeliverCtx, OnFull, Path, RunFrame, FIRST};
use super::stable;
use super::vlan::ViewBuf;
use super::{Endpoint, Route, Switch};
use crate::frame::validate::validate;
use crate::frame::{gather_whole, Frame, GsoLayout};
use crate::l2::{Mac, Tag};
use crate::stats::DropReason;
use crate::vnet_hdr::VirtioNetHdr;

/// How long a guest may keep its RX queue full before senders stop waiting for it;
/// also how long frames are held for a destination that takes none of them.
pub const RX_STALL: Duration = Duration::from_millis(200);
/// Frames held for one destination; more are dropped (`rx_queue_full`).
pub const HOLD_FRAMES: usize = 256;
/// Bytes one sender holds for all destinations together.
pub const HOLD_BYTES: usize = 8 << 20;
/// Longest pause of a sender's reads while everything it last read went to full
/// queues (`Held::pause_reads`).
pub const HOLD_PAUSE: Duration = Duration::from_millis(1);
/// Unicast destinations a read round keeps track of; a round with more never pauses.
const ROUND_DSTS: usize = 8;

/// How long one guest's RX queue has been full.
pub struct StallClock {
    /// When the queue was first found full, in ms on `epoch` (0: not full).
    full_since: AtomicU64,
    epoch: Instant,
}

impl Default for StallClock {
    fn default() -> Self {
        StallClock {
            full_since: AtomicU64::new(0),
            epoch: Instant::now(),
        }
    }
}

impl StallClock {
    fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    /// A frame found the queue full: start the clock if it is not running.
    pub fn full(&self) {
        let now = self.now_ms().max(1);
        let _ = self.full_since.compare_exchange(0, now, Relaxed, Relaxed);
    }

    /// The queue took a frame, or the guest added buffers.
    pub fn room(&self) {
        self.full_since.store(0, Relaxed);
    }

    /// The guest has let its queue stay full for `RX_STALL` or more: its frames are
    /// dropped at once, so one guest that stops reading costs the others nothing.
    pub fn stalled(&self) -> bool {
        let since = self.full_since.load(Relaxed);
        since != 0 && self.now_ms().saturating_sub(since) >= RX_STALL.as_millis() as u64
    }
}

/// A generation bumped whenever any guest adds RX buffers: a sender holding frames
/// retries them when it moved. Senders waiting for that (`RoomWaiter`) are woken.
#[derive(Default)]
pub struct RxRoom {
    generation: AtomicU64,
    waiters: Mutex<Vec<Weak<dyn RoomWaiter>>>,
}

/// A sender that sleeps while it holds frames and wants to hear of room at once.
pub trait RoomWaiter: Send + Sync {
    /// Some guest added RX buffers; called on that guest's thread, so it must not
    /// block (a doorbell's ring, not a wait).
    fn room(&self);
}

impl RxRoom {
    /// Some guest added RX buffers: the generation moves and the waiters are woken.
    pub fn added(&self) {
        // SeqCst with a waiter's look (`Held::room_since_retry`) after it asked to
        // be rung: either the waiter sees the new generation or its bell rings.
        self.generation.fetch_add(1, SeqCst);
        let waiters: Vec<Arc<dyn RoomWaiter>> = {
            let w = self.waiters.lock().unwrap_or_else(|e| e.into_inner());
            w.iter().filter_map(Weak::upgrade).collect()
        };
        for w in waiters {
            w.room();
        }
    }

    /// `w` hears of every `added` from now on, until it is dropped.
    pub fn subscribe(&self, w: Weak<dyn RoomWaiter>) {
        let mut ws = self.waiters.lock().unwrap_or_else(|e| e.into_inner());
        ws.retain(|w| w.strong_count() > 0);
        ws.push(w);
    }

    pub fn generation(&self) -> u64 {
        self.generation.load(SeqCst)
    }
}

/// One frame held for a full queue: a private copy of the view its destination gets,
/// and how many of its segments already went through.
struct HeldFrame {
    hdr: VirtioNetHdr,
    bytes: Vec<u8>,
    dst_mac: Mac,
    src_mac: Mac,
    tag: Tag,
    gso: Option<GsoLayout>,
    queue: usize,
    /// What the attempts so far did.
    again: Again,
}

impl HeldFrame {
    /// A private copy of `frame`, a one-copy frame's bytes in the sender's guest
    /// buffers included (`None`: they could not be read).
    fn copy(frame: &Frame, queue: usize, again: Again) -> Option<HeldFrame> {
        let mut bytes = Vec::new();
        frame.gather(&mut bytes).ok()?;
        Some(HeldFrame {
            hdr: frame.hdr,
            bytes,
            dst_mac: frame.dst,
            src_mac: frame.src,
            tag: frame.tag,
            gso: frame.gso,
            queue,
            again,
        })
    }

    /// A frame of a sender's run that found its guest queue full: its bytes
    /// (`head`, then `tail` from the sender's buffers) as the sender sent them, with
    /// its header `hdr`, read again for what `Frame` keeps. `None`: they could not be
    /// read, or do not make a frame (they did when they were sent).
    fn of_run(f: &RunFrame, hdr: VirtioNetHdr, queue: usize) -> Option<HeldFrame> {
        let mut bytes = Vec::new();
        gather_whole(&[f.head], f.tail.as_ref(), &mut bytes).ok()?;
        let parts = [&bytes[..]];
        let layout = validate(&hdr, &parts).ok()?.layout;
        let frame = Frame::new(hdr, &parts, layout).ok()?;
        let (dst_mac, src_mac, tag, gso) = (frame.dst, frame.src, frame.tag, frame.gso);
        Some(HeldFrame {
            hdr,
            bytes,
            dst_mac,
            src_mac,
            tag,
            gso,
            queue,
            // Admitted when it joined its run; nothing of it went.
            again: Again {
                sent: 0,
                admitted: true,
            },
        })
    }
}

/// Frames held for one destination, and when it last took one.
struct HeldFor {
    dst: Endpoint,
    frames: VecDeque<HeldFrame>,
    progress: Instant,
}

/// The frames one sender holds, per destination, in arrival order; bounded by
/// `HOLD_FRAMES` per destination and `HOLD_BYTES` in all. A destination that takes
/// none of its frames for `RX_STALL` loses them; one that keeps taking them, however
/// slowly, loses none within the bounds (flow control, as a NIC's pause frames).
#[derive(Default)]
pub struct Held {
    by_dst: Vec<HeldFor>,
    bytes: usize,
    seen_room: u64,
    /// Frames the last `retry` delivered, kept until the next one: the sender flushes
    /// in between, so a destination that copies at the flush (a Xen vif) may keep
    /// their address rather than copy them a second time (`stable`).
    spent: Vec<HeldFrame>,
    /// Where the frames of the sender's current read went (`begin_round`).
    round: Round,
    /// Frames held since `take_fresh` was last asked (the sender's `tx_held` or
    /// `rx_held`).
    fresh: u64,
}

/// Where the frames of one read round went, for `Held::pause_reads`.
#[derive(Default)]
struct Round {
    /// Frames this round found their destination full (held, or dropped at the
    /// hold bounds).
    held: usize,
    /// Unicast destinations that took a frame this round (at most ROUND_DSTS).
    took: Vec<Endpoint>,
    /// A frame was flooded, or went to more destinations than `took` keeps.
    spread: bool,
}

impl Round {
    fn took(&mut self, dst: Endpoint) {
        if self.took.contains(&dst) {
            return;
        }
        if self.took.len() == ROUND_DSTS {
            self.spread = true;
        } else {
            self.took.push(dst);
        }
    }
}

impl Held {
    pub fn is_empty(&self) -> bool {
        self.bytes == 0 && self.by_dst.iter().all(|h| h.frames.is_empty())
    }

    fn queue_of(&mut self, dst: Endpoint) -> &mut HeldFor {
        let i = match self.by_dst.iter().position(|h| h.dst == dst) {
            Some(i) => i,
            None => {
                // Places of destinations with nothing held go first, so the list stays
                // as long as the destinations that wait.
                self.by_dst.retain(|h| !h.frames.is_empty());
                self.by_dst.push(HeldFor {
                    dst,
                    frames: VecDeque::new(),
                    progress: Instant::now(),
                });
                self.by_dst.len() - 1
            }
        };
        &mut self.by_dst[i]
    }

    /// The sender starts reading a batch: `pause_reads` speaks of it from now on.
    pub fn begin_round(&mut self) {
        self.round.held = 0;
        self.round.took.clear();
        self.round.spread = false;
    }

    /// Whether the sender should stop reading for now (until room appears, at most
    /// HOLD_PAUSE): this round held a frame, and every frame it read went to a
    /// destination that now has frames held. More reads would most likely be held
    /// too, each a copy, where left in the device's queue they cost nothing and the
    /// host's sender is slowed by its own queue (as the kernel stops a full vif's
    /// queue). A round with a frame for anyone else (another guest, a flood) never
    /// pauses, so a full guest delays others by one pause at most, not each round.
    pub fn pause_reads(&self) -> bool {
        let r = &self.round;
        r.held > 0 && !r.spread && r.took.iter().all(|d| self.has_for(*d))
    }

    /// Whether what is held for every destination of this round is half way to the
    /// hold bounds: more reads for them would soon be dropped rather than held.
    pub fn near_bounds(&self) -> bool {
        if 2 * self.bytes >= HOLD_BYTES {
            return true;
        }
        let r = &self.round;
        !r.took.is_empty()
            && r.took.iter().all(|d| {
                self.by_dst
                    .iter()
                    .any(|h| h.dst == *d && 2 * h.frames.len() >= HOLD_FRAMES)
            })
    }

    /// Whether frames wait for `dst`: the sender's next frames for it go after them.
    pub(super) fn has_for(&self, dst: Endpoint) -> bool {
        self.by_dst
            .iter()
            .any(|h| h.dst == dst && !h.frames.is_empty())
    }

    /// A frame of this round went to unicast destination `dst`.
    pub(super) fn note_took(&mut self, dst: Endpoint) {
        self.round.took(dst);
    }

    /// A frame of this round was flooded.
    pub(super) fn note_spread(&mut self) {
        self.round.spread = true;
    }

    /// Frames held since the last call.
    pub fn take_fresh(&mut self) -> u64 {
        std::mem::take(&mut self.fresh)
    }

    /// Holds `frame` for `dst`, copied by `copy` once the bounds are known to allow
    /// it; the reason to drop it otherwise (the caller counts it on `dst`).
    fn hold_with(
        &mut self,
        dst: Endpoint,
        len: usize,
        copy: impl FnOnce() -> Option<HeldFrame>,
    ) -> Result<(), DropReason> {
        self.round.held += 1;
        let q_len = self.queue_of(dst).frames.len();
        if q_len >= HOLD_FRAMES || self.bytes + len > HOLD_BYTES {
            return Err(DropReason::RxQueueFull);
        }
        let copy = copy().ok_or(DropReason::BadAddress)?;
        self.bytes += copy.bytes.len();
        self.fresh += 1;
        let held = self.queue_of(dst);
        if held.frames.is_empty() {
            held.progress = Instant::now();
        }
        held.frames.push_back(copy);
        Ok(())
    }

    /// Holds a copy of `frame` (the view `dst` gets, after the attempts `again`) for
    /// `dst` (true), or drops it (counted) when the bounds are reached.
    fn hold(
        &mut self,
        switch: &Switch,
        dst: Endpoint,
        frame: &Frame,
        queue: usize,
        again: Again,
    ) -> bool {
        let r = self.hold_with(dst, frame.len, || HeldFrame::copy(frame, queue, again));
        if let Err(reason) = r {
            switch.count_drop(dst, reason);
        }
        r.is_ok()
    }

    /// Holds a frame of a run (`run`) that found queue `queue` of guest `dst` full:
    /// `hdr` is its header as its sender sent it. The reason to drop it otherwise.
    pub(super) fn hold_run_frame(
        &mut self,
        dst: Endpoint,
        f: &RunFrame,
        hdr: VirtioNetHdr,
        queue: usize,
    ) -> Result<(), DropReason> {
        self.hold_with(dst, f.len(), || HeldFrame::of_run(f, hdr, queue))
    }

    /// Re-delivers held frames, oldest first per destination, until a destination's
    /// queue is full again; a destination that took none for `RX_STALL` loses what is
    /// held for it. Never waits.
    ///
    /// The caller flushes `ctx` before it calls again (the frames delivered stay
    /// where they are until then).
    pub fn retry(&mut self, switch: &Switch, ctx: &mut DeliverCtx) {
        self.spent.clear();
        if self.is_empty() {
            return;
        }
        let room = switch.rx_room().generation();
        let moved = room != self.seen_room;
        self.seen_room = room;
        if moved {
            // A destination taken out of the switch: what is held for it goes, and so
            // does its place (ids are never reused, so nothing else will want it).
            let mut freed = 0;
            self.by_dst.retain(|h| {
                let keep = switch.has(h.dst);
                if !keep {
                    freed += h.frames.iter().map(|f| f.bytes.len()).sum::<usize>();
                }
                keep
            });
            self.bytes -= freed;
        }
        let now = Instant::now();
        for held in self.by_dst.iter_mut() {
            let dst = held.dst;
            while let Some(h) = held.frames.front_mut() {
                if now.duration_since(held.progress) >= RX_STALL {
                    switch.count_drop(dst, DropReason::RxQueueFull);
                } else {
                    // Tried even when no guest said it added buffers: one that adds
                    // them without a kick (it looked at its wish for one before the
                    // queue filled) gets its frames all the same, for one ring look.
                    // Its bytes stay put until after the caller's flush (`spent`).
                    let _stable = stable::declare(h.bytes.as_ptr_range());
                    let parts = [&h.bytes[..]];
                    let frame = Frame {
                        hdr: h.hdr,
                        parts: &parts,
                        guest: None,
                        len: h.bytes.len(),
                        dst: h.dst_mac,
                        src: h.src_mac,
                        tag: h.tag,
                        gso: h.gso,
                    };
                    match switch.deliver_to(dst, h.queue, &frame, ctx, OnFull::Return, h.again) {
                        Some(out) if out.path == Path::Dropped(DropReason::RxQueueFull) => {
                            if out.sent > h.again.sent {
                                held.progress = now;
                            }
                            h.again = Again {
                                sent: out.sent,
                                admitted: true,
                            };
                            break;
                        }
                        _ => held.progress = now,
                    }
                }
                if let Some(done) = held.frames.pop_front() {
                    self.bytes -= done.bytes.len();
                    self.spent.push(done);
                }
            }
        }
    }

    /// Whether some guest added RX buffers since the last `retry` looked: a sender
    /// about to sleep until room appears must not, since that room came already.
    pub fn room_since_retry(&self, switch: &Switch) -> bool {
        switch.rx_room().generation() != self.seen_room
    }

    /// Frames the last `retry` delivered.
    pub fn retried(&self) -> usize {
        self.spent.len()
    }

    /// How long the sender may sleep: `idle` with nothing held; while frames are
    /// held, briefly, or, for a sender woken when room appears (`RoomWaiter`), long
    /// enough for the stall clock only.
    pub fn poll_timeout(&self, idle: Duration, woken_by_room: bool) -> Duration {
        match (self.is_empty(), woken_by_room) {
            (true, _) => idle,
            (false, true) => RX_STALL / 10,
            (false, false) => Duration::from_millis(1),
        }
    }
}

/// Forwards a frame from a sender that can hold frames (an uplink reader, a guest's
/// TX queue). A unicast frame for a guest whose RX queue is full is held (`Held`)
/// and re-delivered when the guest adds buffers, as a NIC with flow control would,
/// for at most `RX_STALL`; frames behind it for the same guest wait their turn.
/// Floods are never held, and holding one guest's frames delays another's by one
/// `HOLD_PAUSE` at most (see `Held::pause_reads`). A one-copy frame (`Frame::guest`)
/// is copied whole only when it is held or flooded. The sender counts what was held
/// by `Held::take_fresh`.
pub fn forward_holding(
    switch: &Switch,
    src: Endpoint,
    queue: usize,
    frame: &Frame,
    ctx: &mut DeliverCtx,
    held: &mut Held,
) {
    let topo = switch.batch_topology();
    if frame.guest.is_some() && !topo.0.untagged_source(src) {
        Switch::made_whole(frame, ctx, |whole, ctx| {
            forward_holding(switch, src, queue, whole, ctx, held);
            Some(())
        });
        return;
    }
    let mut views = ViewBuf::default();
    let now = ctx.now();
    if let Some(route) = switch.route(&topo.0, src, frame, &mut views, now, &mut ctx.fdb_memo) {
        send_holding(switch, route, queue, frame, ctx, held);
    }
}

/// The rest of `forward_holding`, for a frame routed already.
pub(super) fn send_holding(
    switch: &Switch,
    route: Route,
    queue: usize,
    frame: &Frame,
    ctx: &mut DeliverCtx,
    held: &mut Held,
) {
    let Some(dst) = route.unicast() else {
        held.note_spread();
        switch.send_routed(route, queue, frame, ctx);
        return;
    };
    let Some(view) = route.view(dst) else {
        return;
    };
    held.note_took(dst);
    let again = if held.has_for(dst) {
        // Keep the order: this frame goes after those already held for `dst`.
        FIRST
    } else {
        match switch.send(&route, queue, ctx, OnFull::Return) {
            Some(out) if out.path == Path::Dropped(DropReason::RxQueueFull) => Again {
                sent: out.sent,
                admitted: true,
            },
            _ => return,
        }
    };
    held.hold(switch, dst, view, queue, again);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stall_clock_runs_while_full_and_stops_on_room() {
        let c = StallClock::default();
        assert!(!c.stalled());
        c.full();
        assert!(!c.stalled(), "stalled at once");
        // Pretend the queue went full RX_STALL ago.
        c.full_since.store(1, Relaxed);
        std::thread::sleep(RX_STALL + Duration::from_millis(5));
        assert!(c.stalled());
        // Another full frame does not restart the clock; room does.
        c.full();
        assert!(c.stalled());
        c.room();
        assert!(!c.stalled());
    }

    #[test]
    fn room_generation_moves_when_buffers_are_added() {
        let r = RxRoom::default();
        let g = r.generation();
        r.added();
        assert_eq!(r.generation(), g + 1);
    }

    struct Count(AtomicU64);

    impl RoomWaiter for Count {
        fn room(&self) {
            self.0.fetch_add(1, Relaxed);
        }
    }

    #[test]
    fn waiters_hear_of_room_until_dropped() {
        let r = RxRoom::default();
        let a = Arc::new(Count(AtomicU64::new(0)));
        let b = Arc::new(Count(AtomicU64::new(0)));
        r.subscribe(Arc::downgrade(&a) as Weak<dyn RoomWaiter>);
        r.subscribe(Arc::downgrade(&b) as Weak<dyn RoomWaiter>);
        r.added();
        drop(b);
        r.added();
        assert_eq!(a.0.load(Relaxed), 2);
        r.subscribe(Arc::downgrade(&a) as Weak<dyn RoomWaiter>);
        assert_eq!(
            r.waiters.lock().unwrap().len(),
            2,
            "the dropped one is gone"
        );
    }
}

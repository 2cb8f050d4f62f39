//! The TX loop of one queue pair: drain the guest's TX queue in batches, copy each
//! chain out, check it against what the guest negotiated, and hand the typed frame to
//! the switch; signal the guest and the destinations once per batch.

use std::sync::atomic::AtomicBool;
use std::sync::atomic::Ordering::{Relaxed, SeqCst};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use tracing::{debug, warn};
use vhost_user_backend::VringT;
use virtio_queue::QueueT;

use super::completion::TxCompletion;
use super::port::{Port, Vring};
use crate::backend::switch::backpressure::{
    forward_holding, Held, RoomWaiter, RxRoom, HOLD_PAUSE, RX_STALL,
};
use crate::backend::switch::deliver::{DeliverCtx, SegmentCharge};
use crate::backend::switch::run::{Run, RunSpare, Stable};
use crate::backend::switch::{BatchTopology, Endpoint, Switch};
use crate::features::Caps;
use crate::frame::validate::{tx_frame, tx_frame_tail};
use crate::frame::{gather_whole, Frame};
use crate::ring::host::HostMem;
use crate::ring::tx::{self, GuestTail, TxBatch, TxError};
use crate::ring::vq::Vq;
use crate::ring::GuestMem;
use crate::stats::DropReason;
use crate::sys::timer::OneShotTimer;
use crate::vnet_hdr::{VirtioNetHdr, HDR_LEN};

/// How many TX chains one pass handles before signalling the guest.
const TX_BATCH: usize = 256;
/// Bytes one pass may copy out: four of the largest frames, so a batch of large
/// frames still amortises its ring work while the buffer stays small per queue.
const TX_ARENA: usize = 4 * (tx::MAX_FRAME + HDR_LEN);

/// What one queue worker keeps between kicks: the batch of chains it copies out,
/// its delivery state, the timer that makes it look at the queue again without
/// a kick (`tx_poll_us`, or a queue held for its `rate=`) and its TX completions' call.
pub struct TxWorker {
    batch: TxBatch,
    ctx: DeliverCtx,
    /// The queue was held lately (its own `rate=`, or a destination's `rx_rate=`):
    /// take one chain at a time, so a hold stops the queue at the frame that went
    /// over, not a batch later. Cleared by a whole batch without a hold.
    paced: bool,
    /// Batches still taken without one-copy frames: most of the last ones went
    /// where they had to be made whole (to a tap, say), so a copy of them is taken
    /// at once and their chains go back before they are sent.
    one_copy_pause: u32,
    /// Frames for a guest whose RX queue was full, copied aside and re-sent as it
    /// adds buffers (`switch::backpressure`), rather than dropped.
    held: Held,
    /// When the queue was first left alone for a full guest since that guest last
    /// took a held frame (`pause`).
    pause_since: Option<Instant>,
    /// Arms `timer` at once when a guest adds RX buffers while frames are held.
    bell: Option<Arc<TimerBell>>,
    pub timer: Option<Arc<OneShotTimer>>,
    pub completion: TxCompletion,
    /// The allocations of the batch's runs, kept from batch to batch.
    run_spare: RunSpare,
    /// The last batch's ring, whose buffers the next one takes (`Vq::renew`).
    ring_spare: Option<Vq>,
}

/// Wakes a TX worker holding frames as soon as some guest adds RX buffers: its
/// timer fires at once, and the worker retries (`drain`).
struct TimerBell {
    wanted: AtomicBool,
    timer: Arc<OneShotTimer>,
}

impl RoomWaiter for TimerBell {
    fn room(&self) {
        if self.wanted.swap(false, SeqCst) {
            let _ = self.timer.arm(Duration::ZERO);
        }
    }
}

/// Most chains a batch takes while frames are held for a full guest.
const HELD_BATCH: usize = 16;

/// Frames of this many bytes or more go guest to guest with one copy: below it, a
/// second copy of a few cache lines costs less than the pieces' bookkeeping.
const ONE_COPY_FROM: usize = 512;
/// Batches taken without one-copy frames after a batch whose one-copy frames were
/// mostly made whole; then one batch tries again.
const ONE_COPY_PAUSE: u32 = 64;

impl Default for TxWorker {
    fn default() -> Self {
        TxWorker {
            batch: TxBatch::new(TX_BATCH, TX_ARENA),
            ctx: DeliverCtx::holding(),
            paced: false,
            one_copy_pause: 0,
            held: Held::default(),
            pause_since: None,
            bell: None,
            timer: None,
            completion: TxCompletion::default(),
            run_spare: RunSpare::default(),
            ring_spare: None,
        }
    }
}

impl TxWorker {
    /// A worker with its timers (the daemon's workers), charging the software
    /// segmentation of its frames to `budget` (the port's), and woken by `room`
    /// while it holds frames for a full guest.
    pub fn with_timer(budget: Arc<dyn SegmentCharge>, room: &RxRoom) -> std::io::Result<TxWorker> {
        let timer = Arc::new(OneShotTimer::new()?);
        let bell = Arc::new(TimerBell {
            wanted: AtomicBool::new(false),
            timer: timer.clone(),
        });
        room.subscribe(Arc::downgrade(&bell) as Weak<dyn RoomWaiter>);
        let mut w = TxWorker {
            timer: Some(timer),
            bell: Some(bell),
            completion: TxCompletion::with_timer()?,
            ..TxWorker::default()
        };
        w.ctx.segment_charge = Some(budget);
        Ok(w)
    }

    /// Keeps a batch's ring for its buffers only (`Vq::renew`): what it records
    /// into goes with the batch.
    fn keep_ring(&mut self, mut ring: Vq) {
        ring.set_record(None);
        self.ring_spare = Some(ring);
    }

    /// Whether the worker holds frames for full guests rather than drop them: it
    /// has the timer and the bell that end a pause.
    fn holds(&self) -> bool {
        self.bell.is_some()
    }

    /// Held frames go first, as their guests add buffers.
    fn retry_held(&mut self, switch: &Switch) {
        if self.held.is_empty() {
            return;
        }
        self.held.retry(switch, &mut self.ctx);
        if self.held.retried() > 0 {
            // The full guest took some: it may be waited for again.
            self.pause_since = None;
        }
        self.ctx.flush();
    }

    /// The batch just taken all went to guests that now have frames held: the queue
    /// is left alone until some guest adds RX buffers, `HOLD_PAUSE` at most since
    /// those guests last took a held frame, or `RX_STALL` while what is held for them
    /// is half way to the hold bounds (more would be dropped, not held). What follows
    /// in the queue is most likely for them too; left there it costs no copy, and
    /// the guest's own queue slows its sender, as a NIC's pause frames would. A batch
    /// with a frame for anyone else never pauses. False: no pause (its time is up, or
    /// no timer to end it).
    fn pause(&mut self, port: &Port, switch: &Switch) -> bool {
        if !self.held.pause_reads() {
            self.pause_since = None;
            return false;
        }
        let (Some(timer), Some(bell)) = (&self.timer, &self.bell) else {
            return false;
        };
        let since = *self.pause_since.get_or_insert_with(|| {
            port.stats.tx_pauses.fetch_add(1, Relaxed);
            Instant::now()
        });
        let most = if self.held.near_bounds() {
            RX_STALL
        } else {
            HOLD_PAUSE
        };
        let left = most.saturating_sub(since.elapsed());
        if left.is_zero() {
            return false;
        }
        // Asked before the timer is armed: room that appears from now on rings, and
        // room that came since the last retry is taken at once instead.
        bell.wanted.store(true, SeqCst);
        if self.held.room_since_retry(switch) {
            return false;
        }
        timer.arm(left).is_ok()
    }

    /// Frames are still held after a drain that did not pause: some guest adding
    /// buffers wakes the worker to retry them, and the timer does within
    /// `RX_STALL / 10` at the latest, so what a guest never takes is dropped in time
    /// (at once if room came since the last retry).
    fn look_again_for_held(&self, switch: &Switch) {
        if self.held.is_empty() {
            return;
        }
        if let (Some(timer), Some(bell)) = (&self.timer, &self.bell) {
            bell.wanted.store(true, SeqCst);
            let after = if self.held.room_since_retry(switch) {
                Duration::ZERO
            } else {
                RX_STALL / 10
            };
            let _ = timer.arm(after);
        }
    }
}

/// Over its `rate=`, the queue is held: nothing more is popped (the guest's own queue
/// backs up) and the worker's timer wakes it when the debt is paid; never a busy
/// wait. False: no timer to wake it, so the queue is not held.
fn hold(port: &Port, timer: &Option<Arc<OneShotTimer>>, wait: Duration) -> bool {
    let Some(t) = timer else { return false };
    if t.arm(wait.max(Duration::from_micros(1))).is_err() {
        return false;
    }
    port.stats.throttled(wait.as_micros() as u64);
    true
}

/// How a drain left the queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DrainEnd {
    /// The guest's kicks are on (or the queue is not running): the next kick wakes us.
    Kicks,
    /// Polling: the drain found frames and left the guest's kicks off, so the caller
    /// must look again after the port's `tx_poll_us`.
    Poll,
    /// Held for a `rate=`, or left alone for a full guest (`TxWorker::pause`):
    /// kicks stay off and the worker's timer is armed already.
    Held,
}

/// How one batch went.
enum Take {
    /// Not (or no longer) set up and enabled: nothing to pop, and not a fault.
    Stopped,
    /// The avail index is more than a queue ahead of what was popped.
    Broken,
    /// This many chains were taken, sent on and handed back.
    Chains(usize),
}

/// Takes up to `max` chains, sends their frames on and hands the chains back, all
/// under one hold of the vring's lock (a batch copied whole lets go of it once its
/// chains are back, before its frames are sent): each chain is walked, checked and copied into
/// the worker's arena (a one-copy frame: its headers only), the frames go to the
/// switch (a one-copy frame's other bytes straight from the guest's buffers into the
/// receiver's), then every chain gets its used entry and the used index moves once.
/// A chain goes back only after nothing reads its buffers any more. A frontend
/// stopping the queue (GET_VRING_BASE, SET_VRING_ENABLE 0) takes the lock's write
/// side, so it sees either nothing of the batch or all of it, and never a used index
/// short of what was consumed. The lock is this queue's alone; what is done under it
/// is bounded by the batch (`TX_BATCH` chains, `TX_ARENA` bytes).
fn take_and_send(
    s: &Sender,
    txq: &Vring,
    mem: &GuestMem,
    hdr_len: usize,
    w: &mut TxWorker,
    max: usize,
) -> Take {
    let port = s.port;
    let mut st = txq.get_mut();
    if !st.get_queue().ready() || !st.is_enabled() {
        return Take::Stopped;
    }
    let q = st.get_queue_mut();
    let hm = HostMem::new(mem);
    let mut ring = Vq::renew(w.ring_spare.take(), q, s.packed);
    port.look_at_start(2 * s.pair + 1, &mut ring, q);
    ring.record_in(|| port.ring_slot(2 * s.pair + 1));
    // The driver reads a TX completion's id only, never its length.
    ring.batch_used(s.in_order);
    if ring.has_avail(&hm).is_none() {
        w.keep_ring(ring);
        return Take::Broken;
    }
    let one_copy = port.cfg.one_copy && w.one_copy_pause == 0;
    w.one_copy_pause = w.one_copy_pause.saturating_sub(1);
    w.batch.set_one_copy(one_copy.then_some(ONE_COPY_FROM));
    let n = w.batch.take(&mut ring, &hm, hdr_len, max);
    let one_copy_frames = w.batch.one_copy_frames();
    w.ctx.made_whole = 0;
    let (bad_heads, published) = if one_copy_frames == 0 {
        // A batch copied whole goes back before it is sent, and the lock with it:
        // the guest has its buffers, and its frontend the ring, while the frames
        // travel.
        let back = give_back(&mut ring, &hm, w);
        ring.store(q);
        port.keep_gap(2 * s.pair + 1, &ring);
        drop(st);
        send_batch(s, &hm, w);
        back
    } else {
        // One with one-copy frames once they have been read.
        send_batch(s, &hm, w);
        if 2 * w.ctx.made_whole >= one_copy_frames {
            w.one_copy_pause = ONE_COPY_PAUSE;
        }
        let back = give_back(&mut ring, &hm, w);
        ring.store(q);
        port.keep_gap(2 * s.pair + 1, &ring);
        drop(st);
        back
    };
    if bad_heads > 0 || !published {
        if let Some(quiet) = port.log.allow() {
            warn!(port = %port.name(), suppressed = quiet, bad_heads, "TX chains could not be handed back (head outside the ring, or the used ring unmapped)");
        }
    }
    w.keep_ring(ring);
    Take::Chains(n)
}

/// Hands the batch's chains back and publishes them: the heads that could not be
/// handed back, and whether the used index could be written.
fn give_back(ring: &mut Vq, hm: &HostMem<'_>, w: &mut TxWorker) -> (usize, bool) {
    let bad_heads = w.batch.give_back(ring, hm);
    (bad_heads, ring.publish_used(hm))
}

/// Drains the TX queue of `pair`: every chain becomes a frame for the switch. With
/// `poll`, a drain that found frames leaves the guest's kicks off (a guest adding
/// frames meanwhile does not have to notify) and returns `DrainEnd::Poll`; one that
/// found none turns them back on, so an idle queue costs nothing.
pub fn drain(
    port: &Port,
    switch: &Switch,
    pair: usize,
    txq: &Vring,
    w: &mut TxWorker,
    poll: bool,
) -> DrainEnd {
    let Some(mem) = port.memory() else {
        return DrainEnd::Kicks;
    };
    let neg = port.negotiated().unwrap_or_default();
    let sender = Sender {
        port,
        switch,
        pair,
        tx_caps: neg.tx,
        packed: neg.packed,
        in_order: neg.in_order,
    };
    let mut popped = 0;
    loop {
        port.kicks_off(txq);
        // Its own `rate=` (checked per chain) or a destination's `rx_rate=` lately:
        // one chain per take, so a hold stops right at the frame that went over.
        let max = if w.paced || port.rate().is_some() {
            1
        } else {
            TX_BATCH
        };
        let mut done = 0;
        let mut held = false;
        let mut paused = false;
        loop {
            if let Some(wait) = port.tx_wait().max(w.ctx.take_hold()) {
                w.paced = true;
                held = hold(port, &w.timer, wait);
                if held {
                    break;
                }
            }
            w.retry_held(switch);
            w.held.begin_round();
            let mut max = max.min(TX_BATCH - done);
            if !w.held.is_empty() {
                // Frames wait for a full guest: smaller batches, so that the queue
                // pauses (`pause`) before a batch's frames for it pass the hold bounds.
                max = max.min(HELD_BATCH);
            }
            let n = match take_and_send(&sender, txq, &mem, neg.hdr_len(), w, max) {
                Take::Stopped => return DrainEnd::Kicks,
                Take::Broken => {
                    // Counted once per kick; the queue is not touched until it makes sense.
                    port.stats.drop(DropReason::TxRingBroken);
                    return DrainEnd::Kicks;
                }
                Take::Chains(n) => n,
            };
            if n == 0 {
                break;
            }
            // Receivers see the batch (used indexes published, calls decided) before
            // the next one is taken: a chain the guest gets back after this batch's
            // chains came back follows their frames' delivery.
            w.ctx.flush();
            done += n;
            if w.pause(port, switch) {
                paused = true;
                break;
            }
            if done >= TX_BATCH {
                break;
            }
        }
        if done == TX_BATCH && !held {
            // A whole batch without a hold: back to full batches.
            w.paced = w.paced && port.rate().is_some();
        }
        // Receivers were signalled first (above): their calls are on a request's
        // path, the sender's TX completion is not, and on a host with few CPUs the
        // first thread woken runs first.
        w.completion.used(port, txq, done, port.tx_coalesce_usecs());
        if held || paused {
            return DrainEnd::Held; // the timer drains on, notifications stay off meanwhile
        }
        popped += done;
        if done == TX_BATCH {
            continue;
        }
        if poll && popped > 0 {
            w.look_again_for_held(switch);
            return DrainEnd::Poll;
        }
        if done >= WATCH_AFTER && watch(txq, &mem, port.cfg.busy_poll_us, neg.packed) {
            continue;
        }
        if port.kicks_on(txq) {
            continue; // more arrived while notifications were off
        }
        w.look_again_for_held(switch);
        return DrainEnd::Kicks;
    }
}

/// Adaptive busy polling (`busy_poll_us`): watches the guest's avail index, its
/// kicks still off, for up to `us` µs after a drain that found `WATCH_AFTER` frames
/// or more. True as soon
/// as a frame is there. Between looks the CPU goes to any other runnable thread (on
/// a host with few CPUs, the guest's vCPU or another port's worker), so the watch
/// only spends CPU nobody else wants.
fn watch(txq: &Vring, mem: &GuestMem, us: u32, packed: bool) -> bool {
    if us == 0 {
        return false;
    }
    let ring = {
        let st = txq.get_ref();
        if !st.get_queue().ready() || !st.is_enabled() {
            return false;
        }
        Vq::of(st.get_queue(), packed)
    };
    let hm = HostMem::new(mem);
    let deadline = Instant::now() + Duration::from_micros(u64::from(us));
    // A look: the avail index (split) or the next slot's flags (packed).
    let arrived = |ring: &Vq| match ring {
        Vq::Split { ring, .. } => ring.avail_idx(&hm).map(|i| i != ring.next_avail),
        Vq::Packed { ring, .. } => ring.has_avail(&hm),
    };
    loop {
        for _ in 0..WATCH_SPINS {
            match arrived(&ring) {
                Some(true) => return true,
                Some(false) => std::hint::spin_loop(),
                None => return false,
            }
        }
        std::thread::yield_now();
        if Instant::now() >= deadline {
            return false;
        }
    }
}

/// Looks at the avail index between two yields of a watch.
const WATCH_SPINS: usize = 64;
/// Chains a drain must have found before its queue is watched: a guest that fills
/// its ring this fast is faster than its backend (KVM, DPDK); one that sends a few
/// frames a wake-up (an emulated vCPU, a request/response flow) gains nothing from
/// the watch and would lose the CPU it spins on.
const WATCH_AFTER: usize = 32;

/// Who sends a batch's frames on: the port, through its queue pair `pair`, with
/// the TX offloads it negotiated.
struct Sender<'a> {
    port: &'a Port,
    switch: &'a Switch,
    pair: usize,
    tx_caps: Caps,
    /// The queues are packed rings.
    packed: bool,
    /// VIRTIO_F_IN_ORDER: a packed ring's TX chains go back one used descriptor per
    /// batch.
    in_order: bool,
}

impl Sender<'_> {
    /// Hands a checked frame to the switch, or counts why it was refused. Its
    /// segment budget is charged where a destination needs the frame cut
    /// (`DeliverCtx::segments_allowed`), not for frames that go intact. With `held`,
    /// a frame for a guest whose RX queue is full is held there, not dropped.
    fn forward(
        &self,
        checked: Result<Frame, DropReason>,
        ctx: &mut DeliverCtx,
        held: Option<&mut Held>,
    ) {
        match checked {
            Ok(frame) => {
                self.port.tx_charge(frame.wire_len());
                let src = Endpoint::Port(self.port.id);
                match held {
                    Some(held) => forward_holding(self.switch, src, self.pair, &frame, ctx, held),
                    None => self.switch.forward(src, self.pair, &frame, ctx),
                }
            }
            Err(reason) => self.port.stats.drop(reason),
        }
    }

    /// `forward`, for a frame whose bytes (`bytes`) stay in the batch's arena and
    /// the guest's buffers until the batch ends: it may join the batch's `run`.
    ///
    /// The frame is borrowed where its check left it, not moved: a frame is some
    /// 180 bytes, copied again at each call that takes it by value.
    fn forward_in_run<'a>(
        &self,
        topo: &BatchTopology,
        checked: &Result<Frame, DropReason>,
        bytes: Stable<'a>,
        ctx: &mut DeliverCtx,
        run: &mut Run<'a>,
    ) {
        match checked {
            Ok(frame) => {
                self.port.tx_charge(frame.wire_len());
                let src = Endpoint::Port(self.port.id);
                self.switch
                    .forward_in_run(topo, src, self.pair, frame, bytes, ctx, run)
            }
            Err(reason) => self.port.stats.drop(*reason),
        }
    }
}

/// Checks each frame of the batch taken against what the guest negotiated and hands
/// it to the switch. Frames for the same guest queue go there in runs.
fn send_batch(s: &Sender, hm: &HostMem<'_>, w: &mut TxWorker) {
    let port = s.port;
    let holds = w.holds();
    let TxWorker {
        batch,
        ctx,
        run_spare,
        held,
        ..
    } = w;
    let TxBatch {
        arena,
        frames,
        pieces,
        ..
    } = batch;
    let spare = std::mem::take(run_spare);
    let mut run = if holds {
        Run::holding(spare, held)
    } else {
        Run::new(spare)
    };
    // One load of the topology for the batch (a guard per frame costs more than
    // the routing it serves).
    let topo = s.switch.batch_topology();
    let (mut sent, mut bytes, mut largest) = (0u64, 0u64, 0u64);
    for read in frames.drain(..) {
        let f = match read {
            Ok(f) => f,
            Err(e) => {
                debug!(port = %port.name(), "dropping TX chain: {e}");
                port.stats.drop(DropReason::from(&e as &TxError));
                continue;
            }
        };
        let len = f.frame_len() as u64;
        (sent, bytes, largest) = (sent + 1, bytes + len, largest.max(len));
        let stable = Stable {
            head: &arena[f.start..f.start + f.len],
            tail: None,
        };
        let head = [stable.head];
        if f.tail_len == 0 {
            s.forward_in_run(
                &topo,
                &tx_frame(s.tx_caps, f.hdr, &head),
                stable,
                ctx,
                &mut run,
            );
            continue;
        }
        let tail = GuestTail {
            mem: hm.guest_mem(),
            pieces: &pieces[f.tail.clone()],
            len: f.tail_len,
        };
        match tx_frame_tail(s.tx_caps, f.hdr, &head, tail) {
            Ok(frame) => {
                let stable = Stable {
                    tail: Some(tail),
                    ..stable
                };
                s.forward_in_run(&topo, &Ok(frame), stable, ctx, &mut run)
            }
            // Headers past the head, or a bad frame: judged again whole.
            Err(_) => {
                run.flush(ctx);
                send_whole(s, f.hdr, &head, tail, ctx, &mut run)
            }
        }
    }
    run.flush(ctx);
    *run_spare = run.into_spare();
    port.stats.tx_many(sent, bytes, largest);
    let fresh = held.take_fresh();
    if fresh > 0 {
        port.stats.tx_held.fetch_add(fresh, Relaxed);
    }
}

/// A one-copy frame whose head did not pass alone: copied whole and checked as any
/// frame is.
fn send_whole(
    s: &Sender,
    hdr: VirtioNetHdr,
    head: &[&[u8]],
    tail: GuestTail,
    ctx: &mut DeliverCtx,
    run: &mut Run,
) {
    let mut buf = std::mem::take(&mut ctx.whole);
    match gather_whole(head, Some(&tail), &mut buf) {
        Ok(len) => {
            let parts = [&buf[..len]];
            s.forward(tx_frame(s.tx_caps, hdr, &parts), ctx, run.held());
        }
        Err(reason) => s.port.stats.drop(reason),
    }
    ctx.whole = buf;
}

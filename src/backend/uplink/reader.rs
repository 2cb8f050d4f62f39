//! The reader threads of an uplink, one per device queue: read a frame, parse it once
//! into a typed frame, forward it (holding frames for a full guest queue aside, see
//! `backpressure`), and signal the guests written to once per batch. A sender may
//! read a queue too: at the end of its batch (`reap`), or wholly for a while, the
//! reader thread standing by (`own_queue`, `serve_queue`, `disown_queue`).

use std::io;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use tracing::{debug, error, warn};

use super::device::DeviceUplink;
use super::queue::{BatchedReads, Home, QueueReader, QueueSlot, ReadRing, FRAME_ROOM};
use super::UplinkDevice;
use crate::backend::switch::backpressure::{forward_holding, Held, RoomWaiter, HOLD_PAUSE};
use crate::backend::switch::deliver::DeliverCtx;
use crate::backend::switch::{stable, Endpoint, Switch};
use crate::frame::Frame;
use crate::l2::ETH_HDR_LEN;
use crate::netif;
use crate::stats::DropReason;
use crate::sys::io::{poll_any, poll_readable};
use crate::sys::uring::Ring;
use crate::vnet_hdr::{VirtioNetHdr, HDR_LEN};

/// Frames read from one queue before pending guest signals are flushed.
const RX_BATCH: usize = 64;
/// Longest wait for a frame, with nothing held, before the queue is tried anyway.
const POLL_WAIT: Duration = Duration::from_secs(1);
/// While a sender's thread serves the queue, how often the reader looks at it anyway.
const OWNED_LOOK: Duration = Duration::from_millis(200);
/// Longest pause after failed reads: a device that fails every read (a tap deleted
/// under gsonet stays readable and answers EBADFD) costs about one read a second.
const MAX_BACKOFF: Duration = Duration::from_secs(1);

/// The pause after `failures` reads in a row failed: 1, 2, 4 ... ms, up to MAX_BACKOFF.
fn backoff(failures: u32) -> Duration {
    Duration::from_millis(1u64 << failures.min(10)).min(MAX_BACKOFF)
}

/// Starts one reader thread per device queue; `id` is the uplink's id in the switch.
/// The readers end within `POLL_WAIT` once `stop` is set (the uplink is removed).
pub fn start<D: UplinkDevice>(
    uplink: Arc<DeviceUplink<D>>,
    id: usize,
    switch: Arc<Switch>,
    stop: Arc<AtomicBool>,
) -> io::Result<Vec<JoinHandle<()>>> {
    // Senders may read this uplink's queues from now on (see `reap` and `own`).
    let _ = uplink.home.set(Home {
        switch: Arc::downgrade(&switch),
        id,
        stop: stop.clone(),
    });
    for slot in &uplink.queues {
        if let Some(room) = &slot.room {
            switch
                .rx_room()
                .subscribe(Arc::downgrade(room) as Weak<dyn RoomWaiter>);
        }
    }
    let mut readers = Vec::new();
    for q in 0..uplink.dev.queues() {
        let me = uplink.clone();
        let sw = switch.clone();
        let halt = stop.clone();
        let spawned = thread::Builder::new()
            .name(format!("{}{q}-rx", uplink.dev.thread_prefix()))
            .spawn(move || read_loop(&me, id, q, &sw, &halt));
        match spawned {
            Ok(h) => readers.push(h),
            Err(e) => {
                // The readers already running end with the uplink.
                stop.store(true, Ordering::Relaxed);
                return Err(e);
            }
        }
    }
    Ok(readers)
}

fn read_loop<D: UplinkDevice>(
    up: &DeviceUplink<D>,
    id: usize,
    queue: usize,
    switch: &Switch,
    stop: &AtomicBool,
) {
    let fd = up.dev.fd(queue);
    let slot = &up.queues[queue];
    let lock = || slot.reader.lock().unwrap_or_else(|e| e.into_inner());
    let mut owner_reads_seen = slot.sender_reads.load(Ordering::Relaxed);
    // When the reads paused for a full guest began (`Held::pause_reads`).
    let mut pause_since: Option<Instant> = None;
    while !stop.load(Ordering::Relaxed) {
        let failures = lock().failures;
        if failures > 0 {
            thread::sleep(backoff(failures));
        }
        if let (true, Some(wake)) = (slot.owned.load(Ordering::Acquire), &slot.wake) {
            // A sender's thread serves the queue: wait until it lets go, and look at
            // the queue once per OWNED_LOOK meanwhile. Frames found there while the
            // owner read nothing since the last look mean it is stuck in its own
            // guest's work: take the queue back, so no guest's traffic waits on
            // another's for longer than a look.
            let _ = poll_readable(wake.fd(), OWNED_LOOK);
            wake.clear();
            if slot.owned.load(Ordering::Acquire) {
                let reads = slot.sender_reads.load(Ordering::Relaxed);
                let owner_idle = reads == owner_reads_seen;
                owner_reads_seen = reads;
                if read_batch(up, id, queue, switch, &mut lock()) > 0 && owner_idle {
                    slot.owned.store(false, Ordering::Release);
                }
                continue;
            }
        }
        let (timeout, holding, paused) = {
            let mut st = lock();
            let QueueReader { ctx, held, .. } = &mut *st;
            // Asked before the retry: room that appears during it rings too.
            if let Some(room) = &slot.room {
                room.wanted.store(!held.is_empty(), Ordering::Relaxed);
            }
            held.retry(switch, ctx);
            // What GRO took from the retried frames leaves before the wait.
            ctx.flush();
            (
                held.poll_timeout(POLL_WAIT, slot.room.is_some()),
                !held.is_empty(),
                held.pause_reads(),
            )
        };
        let waited = match &slot.room {
            Some(room) if holding && paused => {
                // Only room is waited for, HOLD_PAUSE at most since the last read
                // (room for any guest rings too); when it comes, the held frames go
                // first (the retry at the top), then the queue is read.
                let since = *pause_since.get_or_insert_with(|| {
                    up.stats.rx_pauses.fetch_add(1, Ordering::Relaxed);
                    Instant::now()
                });
                let left = HOLD_PAUSE.saturating_sub(since.elapsed());
                if left.is_zero() {
                    Ok(())
                } else {
                    room.wanted.store(true, Ordering::Relaxed);
                    let rang = poll_readable(room.bell.fd(), left.min(timeout));
                    room.bell.clear();
                    if matches!(rang, Ok(true)) {
                        continue;
                    }
                    rang.map(|_| ())
                }
            }
            Some(room) if holding => {
                room.wanted.store(true, Ordering::Relaxed);
                let r = poll_any(&[fd, room.bell.fd()], timeout).map(|_| ());
                room.bell.clear();
                r
            }
            _ => poll_readable(fd, timeout).map(|_| ()),
        };
        match waited {
            Err(e) if e.kind() != io::ErrorKind::Interrupted => {
                error!(uplink = %up.dev.name(), "poll failed: {e}");
                return;
            }
            _ => {}
        }
        // A sender may have taken the queue over while this thread waited on it:
        // the owner reads it now, and this thread only looks (above).
        if slot.owned.load(Ordering::Acquire) {
            continue;
        }
        pause_since = None;
        read_batch(up, id, queue, switch, &mut lock());
    }
}

/// Reads up to RX_BATCH frames from the queue and forwards them, then signals the
/// guests written to; returns how many reads found a frame.
fn read_batch<D: UplinkDevice>(
    up: &DeviceUplink<D>,
    id: usize,
    queue: usize,
    switch: &Switch,
    st: &mut QueueReader,
) -> usize {
    let QueueReader {
        buf,
        ctx,
        held,
        failures,
        reads,
    } = st;
    if matches!(reads, BatchedReads::Untried) {
        *reads = batched_reads(up);
    }
    // Each frame is read after the one before and stays there until the flush at
    // the end of the batch (or when the arena is full), so destinations that copy at
    // the flush may keep its address.
    let _stable = stable::declare(buf.as_ptr_range());
    let hl = up.dev.hdr_len();
    let mut used = 0;
    let mut got = 0;
    let mut tried = 0;
    let mut slots: [Range<usize>; READS_AT_ONCE] = std::array::from_fn(|_| 0..0);
    held.begin_round();
    while tried < RX_BATCH {
        if buf.len() - used < FRAME_ROOM + netif::PAGE {
            ctx.flush();
            used = 0;
        }
        // Where the next reads go: each frame (after its header) on a page, so a
        // page-sized copy of it touches one page of ours; at most FRAME_ROOM each, as
        // before: a longer frame is still refused as too long.
        let want = match reads {
            BatchedReads::On(_) => READS_AT_ONCE.min(RX_BATCH - tried),
            _ => 1,
        };
        let mut n = 0;
        let mut from = used;
        while n < want {
            let at = from + netif::to_page(buf.as_ptr() as usize + from + hl);
            if at + FRAME_ROOM > buf.len() {
                break;
            }
            slots[n] = at..at + FRAME_ROOM;
            from = at + FRAME_ROOM;
            n += 1;
        }
        let slots = &slots[..n];
        let mut outcomes: [io::Result<Option<Range<usize>>>; READS_AT_ONCE] =
            std::array::from_fn(|_| Ok(None));
        match reads {
            BatchedReads::On(r) => {
                let ReadRing { ring, results } = &mut **r;
                let mut bufs = split_slots(buf, slots);
                ring.read_each(up.dev.fd(queue), &mut bufs, results);
                if results
                    .iter()
                    .any(|r| matches!(r, Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP)))
                {
                    debug!(uplink = %up.dev.name(), "reads cannot be batched here");
                    *reads = BatchedReads::Off;
                    continue;
                }
                for ((o, r), slot) in outcomes.iter_mut().zip(results.drain(..)).zip(slots) {
                    *o = r.map(|len| Some(slot.start..slot.start + len));
                }
            }
            _ => {
                let slot = slots[0].clone();
                outcomes[0] = up
                    .dev
                    .recv(queue, &mut buf[slot.clone()])
                    .map(|r| r.map(|r| slot.start + r.start..slot.start + r.end));
            }
        }
        tried += n;
        let mut empty = false;
        // A device that fails one read fails the ones after it (a deleted tap): one
        // failure per try, so the back-off sees one, as with single reads.
        let mut failed = None;
        for outcome in outcomes.into_iter().take(n) {
            let at = match outcome {
                Ok(Some(at)) => at,
                Ok(None) => continue,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    empty = true;
                    continue;
                }
                Err(e) if e.raw_os_error() == Some(libc::EMSGSIZE) => {
                    up.stats.drop(DropReason::TooLong);
                    continue;
                }
                Err(e) => {
                    failed.get_or_insert(e);
                    continue;
                }
            };
            *failures = 0;
            got += 1;
            used = at.end;
            handle_frame(up, id, queue, &buf[at], switch, ctx, held);
        }
        if let Some(e) = failed {
            *failures = failures.saturating_add(1);
            if *failures == 10 {
                warn!(uplink = %up.dev.name(), "reads keep failing ({e}); retrying about once a second");
            } else {
                debug!(uplink = %up.dev.name(), "read: {e}");
            }
            up.stats.drop(DropReason::UplinkReadError);
            break;
        }
        // What this round read all went to full guests: the rest stays in the
        // device's queue for now (`Held::pause_reads`).
        if empty || held.pause_reads() {
            break;
        }
    }
    ctx.flush();
    got
}

/// Reads one system call makes where they are batched.
const READS_AT_ONCE: usize = 8;

/// Batched reads for a device whose reads are plain reads, where io_uring works.
fn batched_reads<D: UplinkDevice>(up: &DeviceUplink<D>) -> BatchedReads {
    if !up.dev.batchable() {
        return BatchedReads::Off;
    }
    match Ring::new(READS_AT_ONCE as u32, false) {
        Ok(ring) => BatchedReads::On(Box::new(ReadRing {
            ring,
            results: Vec::with_capacity(READS_AT_ONCE),
        })),
        Err(e) => {
            debug!(uplink = %up.dev.name(), "no io_uring ({e}): one read per frame");
            BatchedReads::Off
        }
    }
}

/// The disjoint `slots` (in order) of `buf`, to read into.
fn split_slots<'a>(buf: &'a mut [u8], slots: &[Range<usize>]) -> Vec<&'a mut [u8]> {
    let mut out = Vec::with_capacity(slots.len());
    let mut rest = buf;
    let mut off = 0;
    for s in slots {
        let (_, tail) = std::mem::take(&mut rest).split_at_mut(s.start - off);
        let (slot, tail) = tail.split_at_mut(s.len());
        out.push(slot);
        rest = tail;
        off = s.end;
    }
    out
}

/// The switch and id to forward with, while the uplink is in the switch.
fn home<D: UplinkDevice>(up: &DeviceUplink<D>) -> Option<(Arc<Switch>, usize)> {
    let h = up.home.get()?;
    if h.stop.load(Ordering::Relaxed) {
        return None;
    }
    Some((h.switch.upgrade()?, h.id))
}

/// A sender reading the uplink's queues (`SwitchUplink::reap` and the owning calls).
impl<D: UplinkDevice> DeviceUplink<D> {
    /// The reader slot of the device queue a sender's `queue` writes to (`send`
    /// maps a sender's queue onto the device's queues the same way).
    fn slot_of(&self, queue: usize) -> Option<(usize, &QueueSlot)> {
        let n = self.queues.len();
        let q = queue.checked_rem(n)?;
        Some((q, &self.queues[q]))
    }

    /// A sender that wrote to `queue` ends its batch: what the host answered meanwhile
    /// (TCP ACKs, and for a sender of ACKs the data they released: the kernel sends both
    /// while it takes in the frames written) is read and forwarded on the sender's
    /// thread, so no reader is woken for it. Skipped when someone else is reading the
    /// queue or frames are held back for a full guest queue.
    pub(super) fn reap_queue(&self, queue: usize) {
        let (Some((switch, id)), Some((queue, slot))) = (home(self), self.slot_of(queue)) else {
            return;
        };
        let Ok(mut st) = slot.reader.try_lock() else {
            return;
        };
        if st.held.is_empty() && st.failures == 0 {
            // An uplink has no TX queue of its own to poll: its `tx_polls` count these.
            self.stats.tx_polls.fetch_add(1, Ordering::Relaxed);
            slot.sender_reads.fetch_add(1, Ordering::Relaxed);
            read_batch(self, id, queue, &switch, &mut st);
        }
    }

    /// The calling thread takes over the reading of `queue` from its reader thread (one
    /// owner at a time; none while frames are held back). A Xen vif's worker does, for
    /// the tap queue it writes to: it waits on the queue with its event channel, so the
    /// host's answers to its guest cost no other thread's wake-up.
    pub(super) fn own_queue(&self, queue: usize) -> bool {
        let Some((_, slot)) = self.slot_of(queue) else {
            return false;
        };
        if slot.wake.is_none() || home(self).is_none() {
            return false;
        }
        let Ok(st) = slot.reader.try_lock() else {
            return false;
        };
        st.held.is_empty()
            && st.failures == 0
            && slot
                .owned
                .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
    }

    /// The owner found `queue` readable: reads and forwards a batch. False when the
    /// owner must let go (the uplink left the switch, the reader took the queue back,
    /// a read failed, or frames are held back: the reader thread deals with those).
    pub(super) fn serve_queue(&self, queue: usize) -> bool {
        let (Some((switch, id)), Some((queue, slot))) = (home(self), self.slot_of(queue)) else {
            return false;
        };
        if !slot.owned.load(Ordering::Acquire) {
            return false;
        }
        let mut st = slot.reader.lock().unwrap_or_else(|e| e.into_inner());
        slot.sender_reads.fetch_add(1, Ordering::Relaxed);
        read_batch(self, id, queue, &switch, &mut st);
        st.held.is_empty() && st.failures == 0
    }

    /// The owner lets go of `queue`: its reader thread reads it again.
    pub(super) fn disown_queue(&self, queue: usize) {
        let Some((_, slot)) = self.slot_of(queue) else {
            return;
        };
        if slot.owned.swap(false, Ordering::AcqRel) {
            if let Some(w) = &slot.wake {
                w.ring();
            }
        }
    }
}

/// One frame as read from the device, vnet header first.
fn handle_frame<D: UplinkDevice>(
    up: &DeviceUplink<D>,
    id: usize,
    queue: usize,
    bytes: &[u8],
    switch: &Switch,
    ctx: &mut DeliverCtx,
    held: &mut Held,
) {
    let hl = up.dev.hdr_len();
    if bytes.len() < hl + ETH_HDR_LEN {
        up.stats.drop(DropReason::TooShort);
        return;
    }
    // A 10-byte header is the 12-byte one without num_buffers.
    let mut raw = [0u8; HDR_LEN];
    raw[..hl].copy_from_slice(&bytes[..hl]);
    let Ok(hdr) = VirtioNetHdr::from_bytes(&raw) else {
        up.stats.drop(DropReason::BadHeader);
        return;
    };
    let parts = [&bytes[hl..]];
    up.stats.tx(bytes.len() - hl);
    match Frame::from_device(hdr, &parts) {
        Ok(frame) if !up.admit(frame.wire_len()) => up.stats.drop(DropReason::RateLimited),
        Ok(frame) => {
            forward_holding(switch, Endpoint::Uplink(id), queue, &frame, ctx, held);
            let fresh = held.take_fresh();
            if fresh > 0 {
                up.stats.rx_held.fetch_add(fresh, Ordering::Relaxed);
            }
        }
        Err(reason) => up.stats.drop(reason),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::switch::{SwitchPort, SwitchUplink};
    use crate::backend::uplink::device::TapUplink;
    use crate::backend::uplink::packet::PacketSocket;
    use crate::config::UplinkConfig;
    use crate::testkit::recorder::Recorder;
    use std::time::Instant;

    #[test]
    fn failing_reads_back_off_to_a_second() {
        assert_eq!(backoff(1), Duration::from_millis(2));
        assert!(backoff(5) > backoff(4));
        assert_eq!(backoff(40), MAX_BACKOFF);
    }

    /// The sequence numbers of the test's frames `port` got, in order.
    fn seqs(port: &Recorder) -> Vec<u32> {
        port.frames()
            .iter()
            .filter(|f| f.len() >= 20 && f[12..14] == [0x88, 0xb5])
            .map(|f| u32::from_be_bytes([f[16], f[17], f[18], f[19]]))
            .collect()
    }

    /// Broadcast frames `seqs` into the tap from the host's side (they come out of
    /// the tap's queue to gsonet), tagged with this process and a sequence number.
    fn inject(host: &PacketSocket, seqs: std::ops::Range<u32>) {
        let hdr = [0u8; HDR_LEN];
        for seq in seqs {
            let mut f = vec![0u8; 80];
            f[..6].copy_from_slice(&[0xff; 6]);
            f[6..12].copy_from_slice(&[0x02, 0, 0, 0, 0, 0x42]);
            f[12..14].copy_from_slice(&[0x88, 0xb5]);
            f[14..16].copy_from_slice(&(std::process::id() as u16).to_be_bytes());
            f[16..20].copy_from_slice(&seq.to_be_bytes());
            host.send(0, &[&hdr[..host.hdr_len()], &f]).unwrap();
        }
    }

    /// Owns queue 0, waiting out a reader that is reading it (`own` only tries).
    fn own_soon(up: &TapUplink) {
        let end = Instant::now() + Duration::from_secs(2);
        while !up.own(0) {
            assert!(Instant::now() < end, "queue 0 could not be owned again");
            thread::sleep(Duration::from_millis(5));
        }
    }

    fn wait_for(port: &Recorder, n: usize, within: Duration) -> Vec<u32> {
        let end = Instant::now() + within;
        loop {
            let got = seqs(port);
            if got.len() >= n || Instant::now() > end {
                return got;
            }
            thread::sleep(Duration::from_millis(10));
        }
    }

    /// A sender's thread takes a tap queue over (one owner at a time) and reads it in
    /// order when it serves it; a stalled owner strands nothing: the reader thread
    /// looks at the queue anyway and takes it back. Letting go makes room for a new
    /// owner; a removed uplink makes the owner let go.
    #[test]
    fn an_owned_queue_is_served_in_order_and_never_stranded() {
        if !crate::testkit::can_run(crate::sys::is_root(), "root") {
            return;
        }
        let name = format!("gsown{}", std::process::id() % 100_000);
        let cfg = UplinkConfig::parse(&format!("tap={name},persist=off")).unwrap();
        let up = Arc::new(TapUplink::open(&cfg, &name).expect("tap"));
        let host = PacketSocket::open(&name, 1, false).expect("AF_PACKET on the tap");
        let port = Arc::new(Recorder::default());
        let switch = Arc::new(Switch::new(
            vec![port.clone() as Arc<dyn SwitchPort>],
            vec![up.clone() as Arc<dyn SwitchUplink>],
            Duration::from_secs(300),
        ));
        assert!(!up.own(0), "no one owns a queue before its readers start");
        let stop = Arc::new(AtomicBool::new(false));
        let readers = start(up.clone(), 0, switch, stop.clone()).unwrap();

        assert!(up.own(0));
        assert!(!up.own(0), "a second owner");
        // The reader may still be in its wait on the device: let it see the owner.
        thread::sleep(POLL_WAIT + Duration::from_millis(100));
        // The owner reads what it is woken for. (The reader's look every OWNED_LOOK
        // may come first and take the queue back: then own it again and retry.)
        let fd = up.queue_fd(0).unwrap();
        let mut sent = 0;
        let mut served = false;
        for _ in 0..3 {
            inject(&host, sent..sent + 50);
            sent += 50;
            // A sender's queue 1 is this one-queue tap's queue 0, as `send` maps it.
            if poll_readable(fd, Duration::from_secs(2)).unwrap() && up.serve(1) {
                served = true;
                break;
            }
            // Nothing readable, or not ours: the reader's look came first, read the
            // frames and took the queue back (on a busy machine it may).
            own_soon(&up);
        }
        assert!(served, "the owner never served its queue");
        let got = wait_for(&port, sent as usize, Duration::from_secs(2));
        assert_eq!(got, (0..sent).collect::<Vec<_>>());
        if crate::sys::uring::Ring::new(1, false).is_ok() {
            let st = up.queues[0].reader.lock().unwrap();
            assert!(
                matches!(st.reads, BatchedReads::On(_)),
                "a tap's reads go several to a system call where io_uring works"
            );
        }

        // The owner stalls (reads nothing): the reader's looks deliver, in order, and
        // one that finds frames with no read by the owner since the look before
        // takes the queue back (a stuck owner strands no one's frames).
        for _ in 0..2 {
            inject(&host, sent..sent + 10);
            sent += 10;
            let got = wait_for(&port, sent as usize, Duration::from_secs(3));
            assert_eq!(got, (0..sent).collect::<Vec<_>>());
        }
        assert!(
            !up.serve(0),
            "the reader took the stalled owner's queue back"
        );
        up.disown(0);

        own_soon(&up);
        up.disown(0);
        inject(&host, sent..sent + 10);
        sent += 10;
        let got = wait_for(&port, sent as usize, Duration::from_secs(3));
        assert_eq!(got, (0..sent).collect::<Vec<_>>());

        // The uplink leaves the switch: the owner is told to let go.
        assert!(up.own(0));
        stop.store(true, Ordering::Relaxed);
        assert!(!up.serve(0));
        up.disown(0);
        for r in readers {
            r.join().unwrap();
        }
    }
}

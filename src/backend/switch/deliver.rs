//! The one place that decides, per destination, how a frame leaves: intact with its
//! GSO header when the destination accepts it, segmented in software when it does not,
//! checksum completed when the destination cannot take a partial one.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::write_batch::WriteBatch;
use super::{SwitchPort, SwitchUplink};
use crate::backend::ratelimit::RateAdmit;
use crate::features::Caps;
use crate::frame::Frame;
use crate::ring::tx::GuestTail;
use crate::segment::gro::{Coalescer, Kinds, Merged, Offer};
use crate::segment::{CsumMode, SegmentOpts, Segmenter};
use crate::stats::{Counters, DropReason};
use crate::vnet_hdr::{VirtioNetHdr, F_DATA_VALID, F_NEEDS_CSUM};

/// Where a frame can go: a guest port or an uplink.
pub trait Destination {
    /// What it accepts intact.
    fn caps(&self) -> Caps;
    /// Largest L3 packet the operator lets it receive (`max_burst`), if limited.
    /// GSO frames to such a destination are segmented to fit.
    fn max_burst(&self) -> Option<usize>;
    /// Whether TCP segments and UDP datagrams for it may be coalesced (`gro=`), when
    /// it accepts TSO or USO.
    fn gro(&self) -> bool {
        false
    }
    /// Its `rx_rate=` on a frame of `wire` bytes (`ByteRate::admit_at`): charged
    /// if it goes; refused if the rate is in debt and the sender may not wait
    /// (`may_wait`).
    fn rx_rate(&self, _wire: usize, _may_wait: bool) -> RateAdmit {
        RateAdmit::Now
    }
    /// Hands over one frame through queue `queue`; on failure, why.
    fn send(&self, queue: usize, hdr: &VirtioNetHdr, parts: &[&[u8]]) -> Result<(), DropReason>;
    /// Whether it can take, through `queue` now, a one-copy frame as it is: its
    /// bytes copied straight from the sending guest's buffers into its own.
    fn takes_guest_bytes(&self, _queue: usize) -> bool {
        false
    }
    /// `send` for a one-copy frame: `head`, then `tail` from the sender's buffers.
    /// Called only where `takes_guest_bytes` said yes.
    fn send_guest(
        &self,
        _queue: usize,
        _hdr: &VirtioNetHdr,
        _head: &[&[u8]],
        _tail: &GuestTail,
    ) -> Result<(), DropReason> {
        Err(DropReason::BadAddress)
    }
    /// Hands over `frames` (each intact, its RX header made) through queue `queue`
    /// in order, adding each frame that did not go to `failed` (its index and why,
    /// in order); the others went. A destination that can writes them under one
    /// hold of its queue.
    fn send_run(
        &self,
        queue: usize,
        frames: &[RunFrame<'_>],
        failed: &mut Vec<(usize, DropReason)>,
    ) {
        send_each(self, queue, frames, failed);
    }
    fn stats(&self) -> &Counters;
}

/// `send_run` a frame at a time, through `send` and `send_guest`.
pub fn send_each<D: Destination + ?Sized>(
    dst: &D,
    queue: usize,
    frames: &[RunFrame<'_>],
    failed: &mut Vec<(usize, DropReason)>,
) {
    for (i, f) in frames.iter().enumerate() {
        let head = [f.head];
        let r = match &f.tail {
            Some(tail) => dst.send_guest(queue, &f.hdr, &head, tail),
            None => dst.send(queue, &f.hdr, &head),
        };
        if let Err(reason) = r {
            failed.push((i, reason));
        }
    }
}

/// One frame of a run (`run`), as its guest receives it: its RX header, and its bytes in
/// the sender's memory (`head`) followed, for a one-copy frame, by the rest still
/// in the sending guest's buffers (`tail`).
#[derive(Clone, Copy)]
pub struct RunFrame<'a> {
    pub hdr: VirtioNetHdr,
    pub head: &'a [u8],
    pub tail: Option<GuestTail<'a>>,
}

impl RunFrame<'_> {
    /// Bytes of the frame (without its header).
    pub fn len(&self) -> usize {
        self.head.len() + self.tail.map_or(0, |t| t.len)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// What software segmentation a sender's frames may cost (a guest's segment budget).
pub trait SegmentCharge: Send + Sync {
    /// Charges `segments`; false (the drop counted on the sender) when over budget.
    fn charge_segments(&self, segments: usize) -> bool;
}

/// What an earlier attempt to deliver a frame to one destination did: the frames
/// of it that went (segments are never sent twice), and whether it was admitted
/// (its destination's `rx_rate=`, the sender's segment budget and GRO saw it once,
/// and do not again).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Again {
    pub sent: usize,
    pub admitted: bool,
}

/// No earlier attempt.
pub const FIRST: Again = Again {
    sent: 0,
    admitted: false,
};

/// What a full guest RX queue means to the caller of [`deliver`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OnFull {
    /// Count the frame as dropped (`rx_queue_full`).
    Count,
    /// Leave it uncounted: the caller waits for room and delivers again
    /// (`backpressure`), and counts it if it gives up.
    Return,
}

/// Guest RX queues written during a batch, signalled once at its end; and the uplink
/// queues written, reaped after (`DeliverCtx::reap_uplinks`).
#[derive(Default)]
pub struct Pending {
    rx: Vec<(Arc<dyn SwitchPort>, usize)>,
    uplinks: Vec<(Arc<dyn SwitchUplink>, usize)>,
    /// The last uplink queue reaped, for a sender that may serve it (`own`).
    pub last_reaped: Option<(Arc<dyn SwitchUplink>, usize)>,
}

/// Adds (`end`, `queue`) to `list` unless it is there already.
fn note_once<T: ?Sized>(list: &mut Vec<(Arc<T>, usize)>, end: &Arc<T>, queue: usize) {
    if !list.iter().any(|(e, q)| Arc::ptr_eq(e, end) && *q == queue) {
        list.push((end.clone(), queue));
    }
}

impl Pending {
    pub fn rx_written(&mut self, port: &Arc<dyn SwitchPort>, queue: usize) {
        note_once(&mut self.rx, port, queue);
    }

    pub fn uplink_written(&mut self, up: &Arc<dyn SwitchUplink>, queue: usize) {
        note_once(&mut self.uplinks, up, queue);
    }

    /// Signals every guest queue written since the last flush, then reaps the
    /// uplink queues written.
    pub fn flush(&mut self) {
        for (port, queue) in self.rx.drain(..) {
            port.signal_rx(queue);
        }
        for (up, queue) in self.uplinks.drain(..) {
            up.reap(queue);
            self.last_reaped = Some((up, queue));
        }
    }
}

/// The GRO state of one guest RX queue during a batch.
struct GroQueue {
    port: Arc<dyn SwitchPort>,
    queue: usize,
    co: Coalescer,
}

/// GRO toward guests for one sending thread: a coalescer per guest queue written in
/// the current batch. Nothing stays held past [`DeliverCtx::flush`].
#[derive(Default)]
pub struct Gro {
    queues: Vec<GroQueue>,
    /// Coalescers of past batches, kept for their buffers.
    spare: Vec<Coalescer>,
}

/// What GRO may build for a receiver with these offloads.
fn gro_kinds(caps: Caps) -> Kinds {
    Kinds {
        tcp4: caps.tso4,
        tcp6: caps.tso6,
        udp4: caps.uso4,
        udp6: caps.uso6,
    }
}

/// Whether GRO applies to a guest port: it asks for it, takes TSO or USO with
/// checksum offload, and has no `max_burst` (which would cut the frame again).
pub fn gro_applies(port: &dyn SwitchPort, caps: Caps) -> bool {
    port.gro() && caps.csum && gro_kinds(caps).any() && port.max_burst().is_none()
}

/// Hands one frame the coalescer let go of to its guest, counted as any delivery.
fn send_merged(port: &Arc<dyn SwitchPort>, queue: usize, m: &Merged<'_>, pending: &mut Pending) {
    let stats = port.stats();
    let hdr = rx_header(&m.vnet, port.caps());
    match port.send(queue, &hdr, &[m.bytes]) {
        Ok(()) => {
            stats.rx(m.bytes.len());
            if m.segments > 1 {
                stats.coalesced(m.segments);
            }
            pending.rx_written(port, queue);
        }
        Err(r) => stats.drop(r),
    }
}

/// Frames that may share one clock reading (see [`DeliverCtx::now`]).
const CLOCK_REUSE: u32 = 256;

/// Delivery state of one sending thread (a queue worker or an uplink reader): the
/// segmenter's buffers, the frames GRO is building and the signals it owes. Each
/// thread owns its own.
#[derive(Default)]
pub struct DeliverCtx {
    pub segmenter: Segmenter,
    pub pending: Pending,
    pub gro: Gro,
    /// The sender can be held (a guest's TX queue): a destination over its
    /// `rx_rate=` holds it rather than losing the frame.
    pub can_hold: bool,
    /// The sender reads the uplink queues it wrote to at the end of its batch
    /// (`SwitchUplink::reap`), taking the host's answers without waking a reader.
    pub reap_uplinks: bool,
    /// Tap writes of stable frames put off to the flush, to go in one system call.
    pub writes: Option<WriteBatch>,
    /// The longest hold a destination asked for since the last `take_hold`.
    hold: Option<Duration>,
    /// The sender's segment budget, charged for each frame segmented in software
    /// (never for one that leaves intact).
    pub segment_charge: Option<Arc<dyn SegmentCharge>>,
    /// Where a one-copy frame is made whole for a destination that cannot take
    /// it as it is (grown to the largest frame once, then kept).
    pub whole: Vec<u8>,
    /// One-copy frames made whole (once per flood, else per destination) since the
    /// sender last reset it: how often its one-copy frames did not pay.
    pub made_whole: usize,
    /// The time read once per batch for the FDB (a clock read is a system call where
    /// the vDSO has no usable clock, as in a Xen PV dom0; ages count in seconds), and
    /// how many frames have used it.
    batch_now: Option<(Instant, u32)>,
    /// The FDB's last answer to this sender (`Switch::route`).
    pub fdb_memo: super::fdb::FdbMemo,
    /// Where the sender's last frame that joined a run went (`Switch::forward_in_run`).
    pub join_memo: super::memo::JoinMemo,
}

impl DeliverCtx {
    /// The end of a batch: hands over every frame GRO holds, then signals every guest
    /// queue written since the last flush.
    pub fn flush(&mut self) {
        let DeliverCtx { pending, gro, .. } = self;
        for mut g in gro.queues.drain(..) {
            g.co.flush(|m| send_merged(&g.port, g.queue, m, pending));
            gro.spare.push(g.co);
        }
        // Before the reap: the host answers what it was written.
        if let Some(w) = self.writes.as_mut() {
            w.submit();
        }
        self.pending.flush();
        self.batch_now = None;
        self.join_memo.forget();
    }

    /// The time of the current batch: read at its first frame and kept until `flush`,
    /// for at most `CLOCK_REUSE` frames, so a sender that seldom flushes still dates
    /// what it learns correctly.
    pub fn now(&mut self) -> Instant {
        match &mut self.batch_now {
            Some((t, uses)) if *uses < CLOCK_REUSE => {
                *uses += 1;
                *t
            }
            slot => {
                self.join_memo.forget();
                slot.insert((Instant::now(), 1)).0
            }
        }
    }

    /// The state of a sender that can be held (a guest's TX queue worker).
    pub fn holding() -> DeliverCtx {
        DeliverCtx {
            can_hold: true,
            ..DeliverCtx::default()
        }
    }

    /// The state of a sender that reaps the uplink queues it writes to.
    pub fn reaping() -> DeliverCtx {
        DeliverCtx {
            reap_uplinks: true,
            ..DeliverCtx::default()
        }
    }

    /// Puts off this sender's tap writes of stable frames to its flush (see
    /// `write_batch`); an error where io_uring is unavailable, and writes go at once.
    pub fn batch_writes(&mut self) -> std::io::Result<()> {
        self.writes = Some(WriteBatch::new()?);
        Ok(())
    }

    /// Whether the sender's budget allows `frame` to `dst` (charged if it is cut into
    /// segments there).
    pub fn segments_allowed(&self, dst: &dyn Destination, frame: &Frame) -> bool {
        let (Some(budget), Some(gso)) = (&self.segment_charge, &frame.gso) else {
            return true;
        };
        match choose(&frame.hdr, dst.caps(), dst.max_burst().is_some()) {
            Path::Segmented => budget.charge_segments(gso.plan.segments),
            _ => true,
        }
    }

    /// How long the sender should wait for the destinations it went over the rate
    /// of (`rx_rate=`), once.
    pub fn take_hold(&mut self) -> Option<Duration> {
        self.hold.take()
    }

    /// Whether `frame` may go to `dst` under its `rx_rate=`: charged if so. A
    /// destination in debt holds a sender that can be held (the frame still goes,
    /// the sender waits before its next one) and drops the frame of one that
    /// cannot (`rate_limited`).
    pub fn rx_admit(&mut self, dst: &dyn Destination, frame: &Frame) -> bool {
        match dst.rx_rate(frame.wire_len(), self.can_hold) {
            RateAdmit::Now => true,
            RateAdmit::After(wait) => {
                self.hold = self.hold.max(Some(wait));
                true
            }
            RateAdmit::Refused => {
                dst.stats().drop(DropReason::RateLimited);
                false
            }
        }
    }

    /// Offers `frame` for guest `port`'s queue `queue` to GRO. True: taken (it leaves
    /// with a later frame or at the end of the batch); false: the caller delivers it,
    /// after whatever GRO had to hand over first to keep its flow in order. A GSO
    /// frame is never taken and only its headers are read (a one-copy frame's head).
    pub fn gro_offer(&mut self, port: &Arc<dyn SwitchPort>, queue: usize, frame: &Frame) -> bool {
        let caps = port.caps();
        if !gro_applies(port.as_ref(), caps) {
            return false;
        }
        let DeliverCtx { pending, gro, .. } = self;
        let i = match gro
            .queues
            .iter()
            .position(|g| g.queue == queue && Arc::ptr_eq(&g.port, port))
        {
            Some(i) => i,
            None => {
                gro.queues.push(GroQueue {
                    port: port.clone(),
                    queue,
                    co: gro.spare.pop().unwrap_or_default(),
                });
                gro.queues.len() - 1
            }
        };
        let GroQueue {
            port: p,
            queue: q,
            co,
        } = &mut gro.queues[i];
        co.accept(gro_kinds(caps));
        let headers = frame.gso.as_ref().map(|g| &g.headers);
        let r = co.offer(&frame.hdr, frame.parts, headers, |m| {
            send_merged(p, *q, m, pending)
        });
        r == Offer::Taken
    }
}

/// How `deliver` handled a frame, for tests and counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Path {
    Intact,
    Segmented,
    CsumCompleted,
    Dropped(DropReason),
}

/// What `deliver` did: the path, and how many frames reached the destination.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Outcome {
    pub path: Path,
    pub sent: usize,
}

/// Which path a frame takes to a destination with `caps` (the decision alone);
/// `capped`: the destination limits the size of what it receives.
pub fn choose(hdr: &VirtioNetHdr, caps: Caps, capped: bool) -> Path {
    if hdr.gso.is_gso() {
        // A GSO frame goes intact only with a partial checksum the receiver can finish.
        if caps.accepts(hdr.gso) && hdr.needs_csum() && !capped {
            Path::Intact
        } else {
            Path::Segmented
        }
    } else if hdr.needs_csum() && !caps.csum {
        Path::CsumCompleted
    } else {
        Path::Intact
    }
}

/// The header a frame passed intact carries to a destination with `caps`: only what
/// the virtio spec lets a device set (NEEDS_CSUM, and DATA_VALID for a destination
/// that takes checksums; no RSC_INFO or unknown bits), and the fields that mean
/// nothing for this frame zeroed, as Linux's `virtio_net_hdr_from_skb` leaves them.
/// The sender's header is guest input: none of its other bits reach a peer.
pub fn rx_header(sent: &VirtioNetHdr, caps: Caps) -> VirtioNetHdr {
    let mut keep = F_NEEDS_CSUM;
    if caps.csum {
        keep |= F_DATA_VALID;
    }
    let mut hdr = VirtioNetHdr {
        flags: sent.flags & keep,
        ..VirtioNetHdr::default()
    };
    if hdr.needs_csum() {
        hdr.csum_start = sent.csum_start;
        hdr.csum_offset = sent.csum_offset;
    }
    if sent.gso.is_gso() {
        hdr.gso = sent.gso;
        hdr.gso_size = sent.gso_size;
        hdr.hdr_len = sent.hdr_len;
    }
    hdr
}

/// Counts a drop unless it is a full queue the caller will retry.
fn count_drop(stats: &Counters, reason: DropReason, on_full: OnFull) {
    if !(on_full == OnFull::Return && reason == DropReason::RxQueueFull) {
        stats.drop(reason);
    }
}

/// Delivers `frame` to `dst` through its queue `queue`. `skip`: frames of it an
/// earlier attempt already delivered (segments of a partly delivered frame are never
/// sent twice).
pub fn deliver(
    frame: &Frame,
    dst: &dyn Destination,
    queue: usize,
    segmenter: &mut Segmenter,
    on_full: OnFull,
    skip: usize,
) -> Outcome {
    let caps = dst.caps();
    let max = dst.max_burst();
    let stats = dst.stats();
    let path = choose(&frame.hdr, caps, max.is_some());
    if frame.guest.is_some() && !(path == Path::Intact && dst.takes_guest_bytes(queue)) {
        // The switch makes such a frame whole before it comes here (`Switch::forward`):
        // part of a frame is never sent.
        debug_assert!(
            false,
            "a one-copy frame reached a path that reads its bytes"
        );
        stats.drop(DropReason::BadAddress);
        return Outcome {
            path: Path::Dropped(DropReason::BadAddress),
            sent: 0,
        };
    }
    match path {
        Path::Intact if skip > 0 => Outcome { path, sent: skip },
        Path::Intact => {
            let hdr = rx_header(&frame.hdr, caps);
            let sent = match &frame.guest {
                Some(tail) => dst.send_guest(queue, &hdr, frame.parts, tail),
                None => dst.send(queue, &hdr, frame.parts),
            };
            match sent {
                Ok(()) => {
                    stats.rx_intact(frame.len, hdr.gso.is_gso());
                    Outcome { path, sent: 1 }
                }
                Err(r) => {
                    count_drop(stats, r, on_full);
                    Outcome {
                        path: Path::Dropped(r),
                        sent: 0,
                    }
                }
            }
        }
        Path::Segmented | Path::CsumCompleted => {
            let opts = SegmentOpts {
                csum: if caps.csum {
                    CsumMode::Partial
                } else {
                    CsumMode::Full
                },
                max_frame: max,
            };
            let mut failed = None;
            let mut sent = skip;
            let layout = frame.gso.as_ref().map(|l| (&l.headers, &l.plan));
            let parts = frame.parts;
            let r = segmenter.segment_planned_from(&frame.hdr, layout, parts, &opts, skip, |seg| {
                match dst.send(queue, &seg.vnet, seg.parts) {
                    Ok(()) => {
                        stats.rx(seg.len());
                        sent += 1;
                        true
                    }
                    Err(r) => {
                        failed = Some(r);
                        false
                    }
                }
            });
            let path = match (r, failed) {
                (_, Some(reason)) => {
                    count_drop(stats, reason, on_full);
                    Path::Dropped(reason)
                }
                (Ok(sum), None) => {
                    if path == Path::Segmented {
                        stats.segmented(sum.segments, sum.mss, sum.bytes);
                    } else {
                        stats.csum_completed.fetch_add(1, Relaxed);
                    }
                    path
                }
                (Err(e), None) => {
                    tracing::debug!("cannot segment frame: {e}");
                    stats.drop(DropReason::SegmentError);
                    Path::Dropped(DropReason::SegmentError)
                }
            };
            Outcome { path, sent }
        }
        Path::Dropped(_) => Outcome { path, sent: 0 },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testkit::frames::{build, gso_hdr, FrameSpec};
    use crate::vnet_hdr::{GsoKind, GsoType, F_NEEDS_CSUM, F_RSC_INFO};
    use std::cell::RefCell;

    #[test]
    fn a_batch_reads_the_clock_once_and_a_flush_or_a_long_batch_reads_it_again() {
        let mut ctx = DeliverCtx::default();
        let first = ctx.now();
        std::thread::sleep(Duration::from_millis(2));
        assert_eq!(ctx.now(), first, "the same batch keeps its reading");
        ctx.flush();
        let second = ctx.now();
        assert!(second > first, "a new batch reads the clock again");
        for _ in 1..CLOCK_REUSE {
            assert_eq!(ctx.now(), second);
        }
        std::thread::sleep(Duration::from_millis(2));
        assert!(
            ctx.now() > second,
            "a batch past CLOCK_REUSE frames reads it again"
        );
    }

    /// Records what it is handed: the header and the frame length of each send.
    struct Recorder {
        caps: Caps,
        max_burst: Option<usize>,
        sent: RefCell<Vec<(VirtioNetHdr, usize)>>,
        stats: Counters,
    }

    impl Destination for Recorder {
        fn caps(&self) -> Caps {
            self.caps
        }
        fn max_burst(&self) -> Option<usize> {
            self.max_burst
        }
        fn send(&self, _: usize, hdr: &VirtioNetHdr, parts: &[&[u8]]) -> Result<(), DropReason> {
            self.sent
                .borrow_mut()
                .push((*hdr, parts.iter().map(|p| p.len()).sum()));
            Ok(())
        }
        fn stats(&self) -> &Counters {
            &self.stats
        }
    }

    struct Case {
        name: &'static str,
        hdr: VirtioNetHdr,
        bytes: Vec<u8>,
    }

    fn cases() -> Vec<Case> {
        let tcp4 = FrameSpec {
            payload: vec![7; 4000],
            ..Default::default()
        };
        let tcp6 = FrameSpec {
            v6: true,
            ..tcp4.clone()
        };
        let udp4 = FrameSpec {
            tcp: false,
            ..tcp4.clone()
        };
        let small = FrameSpec {
            payload: vec![1; 100],
            ..Default::default()
        };
        let (f4, l4) = build(&tcp4);
        let (f6, l6) = build(&tcp6);
        let (fu, lu) = build(&udp4);
        let (fs, ls) = build(&small);
        let mut ecn = gso_hdr(GsoKind::TcpV4, 1448, l4, true);
        ecn.gso = GsoType {
            kind: GsoKind::TcpV4,
            ecn: true,
        };
        let partial = VirtioNetHdr {
            flags: F_NEEDS_CSUM,
            csum_start: ls as u16,
            csum_offset: 16,
            ..Default::default()
        };
        let mut no_csum = gso_hdr(GsoKind::TcpV4, 1448, l4, true);
        no_csum.flags = 0;
        vec![
            Case {
                name: "plain",
                hdr: VirtioNetHdr::default(),
                bytes: fs.clone(),
            },
            Case {
                name: "partial csum",
                hdr: partial,
                bytes: fs,
            },
            Case {
                name: "tso4",
                hdr: gso_hdr(GsoKind::TcpV4, 1448, l4, true),
                bytes: f4.clone(),
            },
            Case {
                name: "tso4 ecn",
                hdr: ecn,
                bytes: f4.clone(),
            },
            Case {
                name: "tso4 without NEEDS_CSUM",
                hdr: no_csum,
                bytes: f4,
            },
            Case {
                name: "tso6",
                hdr: gso_hdr(GsoKind::TcpV6, 1428, l6, true),
                bytes: f6,
            },
            Case {
                name: "ufo",
                hdr: gso_hdr(GsoKind::Udp, 1480, lu, false),
                bytes: fu.clone(),
            },
            Case {
                name: "uso",
                hdr: gso_hdr(GsoKind::UdpL4, 1472, lu, false),
                bytes: fu,
            },
        ]
    }

    fn dests() -> Vec<(&'static str, Caps, Option<usize>)> {
        let csum = Caps {
            csum: true,
            ..Caps::default()
        };
        vec![
            ("nothing", Caps::default(), None),
            ("csum", csum, None),
            ("csum+tso4", Caps { tso4: true, ..csum }, None),
            (
                "csum+tso4+tso6+ecn",
                Caps {
                    tso4: true,
                    tso6: true,
                    ecn: true,
                    ..csum
                },
                None,
            ),
            ("csum+ufo", Caps { ufo: true, ..csum }, None),
            ("csum+uso4", Caps { uso4: true, ..csum }, None),
            ("all", Caps::ALL, None),
            ("all, max_burst 1000", Caps::ALL, Some(1000)),
            (
                "tso4 without csum",
                Caps {
                    tso4: true,
                    ..Caps::default()
                },
                None,
            ),
        ]
    }

    /// What a frame of `case` must become at a destination with `caps`.
    fn expected(case: &str, caps: Caps, capped: bool) -> Path {
        let gso_ok = |ok: bool| {
            if ok && caps.csum && !capped {
                Path::Intact
            } else {
                Path::Segmented
            }
        };
        match case {
            "plain" => Path::Intact,
            "partial csum" if caps.csum => Path::Intact,
            "partial csum" => Path::CsumCompleted,
            "tso4" => gso_ok(caps.tso4),
            "tso4 ecn" => gso_ok(caps.tso4 && caps.ecn),
            "tso4 without NEEDS_CSUM" => Path::Segmented,
            "tso6" => gso_ok(caps.tso6),
            "ufo" => gso_ok(caps.ufo),
            "uso" => gso_ok(caps.uso4 || caps.uso6),
            _ => unreachable!(),
        }
    }

    #[test]
    fn every_frame_type_against_every_destination() {
        let mut segmenter = Segmenter::new();
        for c in cases() {
            for (dname, caps, max) in dests() {
                let dst = Recorder {
                    caps,
                    max_burst: max,
                    sent: RefCell::new(vec![]),
                    stats: Counters::default(),
                };
                let parts = [&c.bytes[..]];
                let frame = crate::frame::validate::tx_frame(Caps::ALL, c.hdr, &parts).unwrap();
                let out = deliver(&frame, &dst, 0, &mut segmenter, OnFull::Count, 0);
                let path = out.path;
                assert_eq!(out.sent, dst.sent.borrow().len());
                let want = expected(c.name, caps, max.is_some());
                assert_eq!(path, want, "{} -> {dname}", c.name);
                let sent = dst.sent.borrow();
                match path {
                    Path::Intact => {
                        assert_eq!(sent.len(), 1, "{} -> {dname}", c.name);
                        assert_eq!(
                            sent[0].0.gso, c.hdr.gso,
                            "{} -> {dname}: header changed",
                            c.name
                        );
                        assert_eq!(sent[0].1, c.bytes.len());
                    }
                    Path::Segmented | Path::CsumCompleted => {
                        assert!(!sent.is_empty(), "{} -> {dname}", c.name);
                        for (h, len) in sent.iter() {
                            assert_eq!(
                                h.gso.kind,
                                GsoKind::None,
                                "{} -> {dname}: GSO after segmenting",
                                c.name
                            );
                            // A destination without csum gets complete checksums only.
                            if !caps.csum {
                                assert!(
                                    !h.needs_csum(),
                                    "{} -> {dname}: partial csum to a csum-less peer",
                                    c.name
                                );
                            }
                            let l3_cap = max.unwrap_or(usize::MAX).min(1500 + 60);
                            assert!(
                                *len <= 14 + l3_cap,
                                "{} -> {dname}: {len}-byte segment",
                                c.name
                            );
                        }
                        if path == Path::Segmented && c.hdr.gso.is_gso() {
                            assert!(
                                sent.len() > 1,
                                "{} -> {dname}: {} segments",
                                c.name,
                                sent.len()
                            );
                            assert_eq!(dst.stats.snapshot().gso_segmented, 1);
                        } else {
                            assert_eq!(dst.stats.snapshot().csum_completed, 1);
                        }
                    }
                    Path::Dropped(r) => panic!("{} -> {dname}: dropped ({r})", c.name),
                }
            }
        }
    }

    #[test]
    fn rx_header_keeps_only_what_a_device_may_set() {
        // Found by the hostile-guest e2e test: a guest's RSC_INFO and unknown flag
        // bits, and its junk csum/gso fields, were passed on to peers.
        let junk = VirtioNetHdr {
            flags: F_RSC_INFO | F_DATA_VALID | 0xf0,
            gso: GsoType::NONE,
            hdr_len: 77,
            gso_size: 1234,
            csum_start: 34,
            csum_offset: 17566,
            num_buffers: 9,
        };
        let plain = Caps::default();
        assert_eq!(rx_header(&junk, plain), VirtioNetHdr::default());
        let csum = Caps {
            csum: true,
            ..Caps::default()
        };
        let h = rx_header(&junk, csum);
        assert_eq!(h.flags, F_DATA_VALID);
        assert_eq!(
            (h.csum_start, h.csum_offset, h.gso_size, h.hdr_len),
            (0, 0, 0, 0)
        );

        let tso = VirtioNetHdr {
            flags: F_NEEDS_CSUM | F_RSC_INFO,
            gso: GsoType::new(GsoKind::TcpV4),
            hdr_len: 66,
            gso_size: 1448,
            csum_start: 34,
            csum_offset: 16,
            num_buffers: 0,
        };
        let h = rx_header(&tso, Caps::ALL);
        assert_eq!(
            h,
            VirtioNetHdr {
                flags: F_NEEDS_CSUM,
                num_buffers: 1,
                ..tso
            }
        );
    }

    /// Takes `room` frames, then reports a full queue.
    struct Filling {
        room: std::cell::Cell<usize>,
        got: RefCell<Vec<Vec<u8>>>,
        stats: Counters,
    }

    impl Destination for Filling {
        fn caps(&self) -> Caps {
            Caps::default()
        }
        fn max_burst(&self) -> Option<usize> {
            None
        }
        fn send(&self, _: usize, _: &VirtioNetHdr, parts: &[&[u8]]) -> Result<(), DropReason> {
            if self.room.get() == 0 {
                return Err(DropReason::RxQueueFull);
            }
            self.room.set(self.room.get() - 1);
            self.got.borrow_mut().push(parts.concat());
            Ok(())
        }
        fn stats(&self) -> &Counters {
            &self.stats
        }
    }

    #[test]
    fn a_partly_delivered_frame_is_finished_without_duplicates() {
        let (f, l4) = build(&FrameSpec {
            payload: (0..10 * 1448).map(|i| i as u8).collect(),
            ..Default::default()
        });
        let parts = [&f[..]];
        let hdr = gso_hdr(GsoKind::TcpV4, 1448, l4, true);
        let frame = crate::frame::validate::tx_frame(Caps::ALL, hdr, &parts).unwrap();
        let dst = Filling {
            room: std::cell::Cell::new(4),
            got: RefCell::new(vec![]),
            stats: Counters::default(),
        };
        let mut seg = Segmenter::new();
        let first = deliver(&frame, &dst, 0, &mut seg, OnFull::Return, 0);
        assert_eq!(first.path, Path::Dropped(DropReason::RxQueueFull));
        assert_eq!(first.sent, 4);
        // Not counted: the caller holds the frame and tries again.
        assert!(dst.stats.snapshot().drops.is_empty());
        dst.room.set(100);
        let second = deliver(&frame, &dst, 0, &mut seg, OnFull::Return, first.sent);
        assert_eq!((second.path, second.sent), (Path::Segmented, 10));
        let got = dst.got.borrow();
        assert_eq!(got.len(), 10, "every segment once");
        let seqs: Vec<u32> = got
            .iter()
            .map(|s| u32::from_be_bytes(s[l4 + 4..l4 + 8].try_into().unwrap()))
            .collect();
        let mut sorted = seqs.clone();
        sorted.dedup();
        assert_eq!(sorted.len(), 10, "{seqs:?}");
        assert!(seqs.windows(2).all(|w| w[1] == w[0] + 1448), "{seqs:?}");
    }
}

//! Runs: the frames of one sender's batch that go intact to the same guest RX queue,
//! one after another, written under one hold of that queue (`Destination::send_run`)
//! instead of one hold, one ring look and one set of counter updates per frame.
//!
//! A run lives for one batch and borrows the batch's bytes. It goes (`Run::flush`)
//! when the next frame is for another queue, before any other delivery of the sender
//! (so no frame overtakes an earlier one to the same guest), when it reaches its
//! bounds, and at the end of the batch.

use std::sync::Arc;

use super::backpressure::Held;
use super::deliver::DeliverCtx;
pub use super::deliver::RunFrame;
use super::{Endpoint, SwitchPort};
use crate::ring::tx::GuestTail;
use crate::stats::DropReason;
use crate::vnet_hdr::VirtioNetHdr;

/// Most frames in one run: what another sender to the same guest may wait for.
const RUN_FRAMES: usize = 64;
/// Most bytes in one run (a run of large frames holds the queue as long as 64
/// frames of 4 KB would).
const RUN_BYTES: usize = 256 * 1024;

/// The bytes of a frame the sender keeps for the whole batch: what a frame that
/// joins a run is written from.
#[derive(Clone, Copy)]
pub struct Stable<'a> {
    pub head: &'a [u8],
    pub tail: Option<GuestTail<'a>>,
}

/// What a run keeps from batch to batch: its vectors' allocations.
#[derive(Default)]
pub struct RunSpare {
    frames: Vec<RunFrame<'static>>,
    sent_hdrs: Vec<VirtioNetHdr>,
    full: Vec<usize>,
    failed: Vec<(usize, DropReason)>,
}

/// The run being built: its guest queue and its frames.
pub struct Run<'a> {
    to: Option<(Arc<dyn SwitchPort>, usize, Endpoint)>,
    frames: Vec<RunFrame<'a>>,
    bytes: usize,
    /// A sender that holds frames for full queues (`backpressure`): what it holds.
    held: Option<&'a mut Held>,
    /// With `held`: each frame's header as its sender sent it (what a held frame
    /// is re-sent with), and the frames of the last write that found the queue full.
    sent_hdrs: Vec<VirtioNetHdr>,
    full: Vec<usize>,
    /// The frames of the last write that did not go, and why.
    failed: Vec<(usize, DropReason)>,
}

impl<'a> Run<'a> {
    /// An empty run whose frames go in `spare`'s allocations (see `into_spare`); a
    /// frame that finds its queue full is counted and dropped.
    pub fn new(spare: RunSpare) -> Run<'a> {
        Run {
            to: None,
            frames: recycle(spare.frames),
            bytes: 0,
            held: None,
            sent_hdrs: spare.sent_hdrs,
            full: spare.full,
            failed: spare.failed,
        }
    }

    /// `new`, for a sender that holds frames for full guest queues in `held`
    /// rather than drop them.
    pub fn holding(spare: RunSpare, held: &'a mut Held) -> Run<'a> {
        Run {
            held: Some(held),
            ..Run::new(spare)
        }
    }

    /// The run's allocations, for the next batch's run. Call after `flush`.
    pub fn into_spare(mut self) -> RunSpare {
        self.sent_hdrs.clear();
        RunSpare {
            frames: recycle(self.frames),
            sent_hdrs: self.sent_hdrs,
            full: self.full,
            failed: self.failed,
        }
    }

    /// What the sender holds, if it holds frames.
    pub fn held(&mut self) -> Option<&mut Held> {
        self.held.as_deref_mut()
    }

    /// Whether the run goes to queue `queue` of `port`.
    fn goes_to(&self, port: &Arc<dyn SwitchPort>, queue: usize) -> bool {
        matches!(&self.to, Some((p, q, _)) if *q == queue && Arc::ptr_eq(p, port))
    }

    /// Adds `frame` (sent with header `sent_hdr`) for queue `queue` of `port`
    /// (endpoint `dst`): after the run if it goes there too, else in a new run
    /// once this one has gone.
    #[inline]
    pub fn push(
        &mut self,
        (port, dst): (&Arc<dyn SwitchPort>, Endpoint),
        queue: usize,
        frame: RunFrame<'a>,
        sent_hdr: VirtioNetHdr,
        ctx: &mut DeliverCtx,
    ) {
        if !self.goes_to(port, queue) {
            self.start((port, dst), queue, ctx);
        }
        if let Some(held) = self.held.as_deref_mut() {
            held.note_took(dst);
            self.sent_hdrs.push(sent_hdr);
        }
        self.bytes += frame.len();
        self.frames.push(frame);
        if self.frames.len() >= RUN_FRAMES || self.bytes >= RUN_BYTES {
            self.write(ctx);
        }
    }

    /// Sends the run on and starts one for queue `queue` of `port` (endpoint
    /// `dst`): out of line, since most frames join the run before them.
    #[inline(never)]
    fn start(
        &mut self,
        (port, dst): (&Arc<dyn SwitchPort>, Endpoint),
        queue: usize,
        ctx: &mut DeliverCtx,
    ) {
        self.flush(ctx);
        self.to = Some((port.clone(), queue, dst));
    }

    /// Writes the run's frames and forgets its queue.
    pub fn flush(&mut self, ctx: &mut DeliverCtx) {
        self.write(ctx);
        self.to = None;
    }

    /// Writes the run's frames, counting what went and what was dropped (or, for a
    /// sender that holds frames, holding what found the queue full), and notes the
    /// queue for the batch's signal; the run still goes to the same queue.
    fn write(&mut self, ctx: &mut DeliverCtx) {
        let Some((port, queue, dst)) = &self.to else {
            return;
        };
        if self.frames.is_empty() {
            return;
        }
        let stats = port.stats();
        let frames = &self.frames;
        let failed = &mut self.failed;
        failed.clear();
        port.send_run(*queue, frames, failed);
        // Most runs go whole: count them all, then take back the few that did not.
        let (mut sent, mut bytes, mut gso) = (frames.len() as u64, 0u64, 0u64);
        for f in frames {
            bytes += f.len() as u64;
            gso += u64::from(f.hdr.gso.is_gso());
        }
        let full = &mut self.full;
        full.clear();
        for &(i, reason) in failed.iter() {
            sent = sent.saturating_sub(1);
            bytes = bytes.saturating_sub(frames[i].len() as u64);
            gso = gso.saturating_sub(u64::from(frames[i].hdr.gso.is_gso()));
            match reason {
                DropReason::RxQueueFull if self.held.is_some() => full.push(i),
                reason => stats.drop(reason),
            }
        }
        stats.rx_intact_many(sent, bytes, gso);
        if sent > 0 {
            ctx.pending.rx_written(port, *queue);
        }
        // Held after the queue's locks are let go: a copy, from the sender's buffers
        // for a one-copy frame.
        if let Some(held) = self.held.as_deref_mut() {
            for &i in full.iter() {
                if let Err(reason) =
                    held.hold_run_frame(*dst, &frames[i], self.sent_hdrs[i], *queue)
                {
                    stats.drop(reason);
                }
            }
        }
        self.frames.clear();
        self.sent_hdrs.clear();
        self.bytes = 0;
    }
}

/// An empty vector of one lifetime made from an emptied one of another: the same
/// allocation, reused from batch to batch (the standard library collects an
/// iterator over a vector into the vector's own buffer when the items are the same
/// size; were it not to, this costs an allocation and nothing else).
fn recycle<'x, 'y>(mut v: Vec<RunFrame<'x>>) -> Vec<RunFrame<'y>> {
    v.clear();
    v.into_iter()
        .map(|_| unreachable!("the vector is empty"))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::switch::{Endpoint, Switch, SwitchUplink};
    use crate::frame::Frame;
    use crate::l2::Mac;
    use crate::testkit::frames::{ethernet, pattern};
    use crate::testkit::recorder::Recorder;
    use crate::vnet_hdr::VirtioNetHdr;
    use std::time::Duration;

    fn mac(n: u8) -> Mac {
        Mac([2, 0, 0, 0, 0, n])
    }

    /// A switch of `n` recording ports where port 1's address is learnt, so frames
    /// from port 0 to it are known unicast; nothing recorded yet.
    fn learnt(n: usize) -> (Switch, Vec<Arc<Recorder>>) {
        let ports: Vec<Arc<Recorder>> = (0..n).map(|_| Arc::new(Recorder::default())).collect();
        let sw = Switch::new(
            ports
                .iter()
                .map(|p| p.clone() as Arc<dyn SwitchPort>)
                .collect(),
            Vec::<Arc<dyn SwitchUplink>>::new(),
            Duration::from_secs(60),
        );
        let hello = ethernet(Mac::BROADCAST.0, mac(1).0, &[], 0x0800, &pattern(60));
        let hello_parts = [&hello[..]];
        let f = Frame::new(VirtioNetHdr::default(), &hello_parts, None).unwrap();
        sw.forward(Endpoint::Port(1), 0, &f, &mut DeliverCtx::default());
        ports.iter().for_each(|p| drop(p.take()));
        (sw, ports)
    }

    /// Sends `bytes` from port `src` through `run`.
    fn send_in_run<'a>(
        sw: &Switch,
        src: usize,
        bytes: &'a [u8],
        ctx: &mut DeliverCtx,
        run: &mut Run<'a>,
    ) {
        let parts = [bytes];
        let f = Frame::new(VirtioNetHdr::default(), &parts, None).unwrap();
        let stable = Stable {
            head: bytes,
            tail: None,
        };
        sw.forward_in_run(
            &sw.batch_topology(),
            Endpoint::Port(src),
            0,
            &f,
            stable,
            ctx,
            run,
        );
    }

    #[test]
    fn a_run_goes_before_any_other_delivery_of_its_sender_so_nothing_overtakes() {
        let (sw, ports) = learnt(3);

        let first = ethernet(mac(1).0, mac(0).0, &[], 0x0800, &pattern(61));
        let flood = ethernet(Mac::BROADCAST.0, mac(0).0, &[], 0x0800, &pattern(62));
        let last = ethernet(mac(1).0, mac(0).0, &[], 0x0800, &pattern(63));
        let mut ctx = DeliverCtx::default();
        let mut run = Run::new(RunSpare::default());
        send_in_run(&sw, 0, &first, &mut ctx, &mut run);
        assert!(
            ports[1].take().is_empty(),
            "a unicast frame waits in the run"
        );
        send_in_run(&sw, 0, &flood, &mut ctx, &mut run);
        send_in_run(&sw, 0, &last, &mut ctx, &mut run);
        run.flush(&mut ctx);
        let got: Vec<Vec<u8>> = ports[1].take().into_iter().map(|(_, b)| b).collect();
        assert_eq!(
            got,
            [first.clone(), flood.clone(), last.clone()],
            "in the order sent"
        );
        assert_eq!(ports[2].frames(), [flood], "the flood reached the others");
        assert_eq!(ports[1].stats.snapshot().rx_frames, 3);
    }

    #[test]
    fn a_run_goes_at_its_bound_and_counts_every_frame_once() {
        let (sw, ports) = learnt(2);
        let frames: Vec<Vec<u8>> = (0..RUN_FRAMES + 3)
            .map(|i| ethernet(mac(1).0, mac(0).0, &[], 0x0800, &pattern(60 + i)))
            .collect();
        let mut ctx = DeliverCtx::default();
        let mut run = Run::new(RunSpare::default());
        for f in &frames {
            send_in_run(&sw, 0, f, &mut ctx, &mut run);
        }
        assert_eq!(ports[1].take().len(), RUN_FRAMES, "a full run went");
        run.flush(&mut ctx);
        assert_eq!(ports[1].take().len(), 3, "the rest at the flush");
        let s = ports[1].stats.snapshot();
        assert_eq!(s.rx_frames, frames.len() as u64);
        let bytes: usize = frames.iter().map(|f| f.len()).sum();
        assert_eq!(s.rx_bytes, bytes as u64);
    }

    #[test]
    fn a_run_that_fills_its_queue_counts_what_went_and_drops_the_rest() {
        let (sw, ports) = learnt(2);
        *ports[1].room.lock().unwrap() = Some(2);
        let frames: Vec<Vec<u8>> = (0..5)
            .map(|i| ethernet(mac(1).0, mac(0).0, &[], 0x0800, &pattern(60 + 7 * i)))
            .collect();
        let mut ctx = DeliverCtx::default();
        let mut run = Run::new(RunSpare::default());
        for f in &frames {
            send_in_run(&sw, 0, f, &mut ctx, &mut run);
        }
        run.flush(&mut ctx);
        assert_eq!(
            ports[1].frames(),
            frames[..2],
            "the frames the queue had room for"
        );
        let s = ports[1].stats.snapshot();
        assert_eq!(s.rx_frames, 2);
        assert_eq!(s.rx_bytes, (frames[0].len() + frames[1].len()) as u64);
        assert_eq!(ports[1].stats.drops(DropReason::RxQueueFull), 3);
        assert_eq!(ports[1].drops(), 3, "no other reason");
    }

    #[test]
    fn a_move_of_the_destination_mid_batch_takes_the_next_frame_with_it() {
        let (sw, ports) = learnt(3);
        let to_one = |n: usize| ethernet(mac(1).0, mac(0).0, &[], 0x0800, &pattern(60 + n));
        let (a, b) = (to_one(0), to_one(1));
        let mut ctx = DeliverCtx::default();
        let mut run = Run::new(RunSpare::default());
        send_in_run(&sw, 0, &a, &mut ctx, &mut run);
        // Port 1's address shows up behind port 2, between two frames of the batch
        // (same addresses, same header: the second would reuse the first's answer).
        let moved = ethernet(Mac::BROADCAST.0, mac(1).0, &[], 0x0800, &pattern(70));
        let moved_parts = [&moved[..]];
        let f = Frame::new(VirtioNetHdr::default(), &moved_parts, None).unwrap();
        sw.forward(Endpoint::Port(2), 0, &f, &mut DeliverCtx::default());
        send_in_run(&sw, 0, &b, &mut ctx, &mut run);
        run.flush(&mut ctx);
        // Port 2's own flood reaches port 1 too; port 0's frames are what counts.
        let from_zero = |p: &Recorder| -> Vec<Vec<u8>> {
            p.take()
                .into_iter()
                .map(|(_, f)| f)
                .filter(|f| f[6..12] == mac(0).0)
                .collect()
        };
        assert_eq!(from_zero(&ports[1]), [a]);
        assert_eq!(
            from_zero(&ports[2]),
            [b],
            "the table's new answer, not the memo's"
        );
    }

    #[test]
    fn a_recycled_vector_keeps_its_allocation() {
        let mut v: Vec<RunFrame<'static>> = Vec::with_capacity(64);
        let frame = RunFrame {
            hdr: VirtioNetHdr::default(),
            head: &[1, 2, 3],
            tail: None,
        };
        v.push(frame);
        let before = v.as_ptr() as usize;
        let w: Vec<RunFrame<'_>> = recycle(v);
        assert!(w.is_empty());
        assert!(w.capacity() >= 64);
        assert_eq!(w.as_ptr() as usize, before, "the same buffer");
    }
}

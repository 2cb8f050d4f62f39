//! One device queue of an uplink as its readers share it: the state of reading it
//! (`QueueReader`, held by whoever reads), whether a sender's thread owns it, and the
//! doorbell that gives it back to the reader thread (`reader` has the rules).

use std::io::{self, Read, Write};
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, Weak};

use crate::backend::switch::backpressure::{Held, RoomWaiter};
use crate::backend::switch::deliver::DeliverCtx;
use crate::backend::switch::Switch;
use crate::backend::xen::buffers::copy_buffer;
use crate::sys::uring::Ring;
use crate::sys::xen::granted::CopyBuf;
use crate::vnet_hdr::HDR_LEN;

/// Room for one frame read from a device: header, the largest frame, a VLAN tag
/// put back by an AF_PACKET read.
pub(super) const FRAME_ROOM: usize = HDR_LEN + 65535 + 64;
/// Bytes a batch's frames are read into before the batch is flushed: the frames stay
/// where they were read until then, so a Xen vif keeps their addresses rather than a
/// copy of them (`switch::stable`).
pub(super) const ARENA: usize = 1 << 20;

/// What reading one device queue needs between reads. It is held by whoever reads
/// the queue, so frames read from it are forwarded in the order the device gave them:
/// the queue's reader thread, or a sender (`reap_queue`, `serve_queue`).
pub struct QueueReader {
    /// Where a batch's frames are read, one after another (`ARENA` bytes).
    pub(super) buf: CopyBuf,
    pub(super) ctx: DeliverCtx,
    pub(super) held: Held,
    pub(super) failures: u32,
    /// Several reads in one system call, for a device whose reads are plain reads.
    pub(super) reads: BatchedReads,
}

/// The ring a queue's batched reads go through, and their results.
pub struct ReadRing {
    pub(super) ring: Ring,
    pub(super) results: Vec<io::Result<usize>>,
}

/// Whether the queue's reads go several to a system call (`sys::uring`).
pub enum BatchedReads {
    /// Not tried yet: the first read batch sets it up.
    Untried,
    On(Box<ReadRing>),
    /// The device reads one frame per call (AF_PACKET), io_uring is unavailable, or
    /// the device cannot be read through it without waiting.
    Off,
}

impl Default for QueueReader {
    fn default() -> QueueReader {
        QueueReader {
            buf: copy_buffer(ARENA, "uplink read arena"),
            ctx: DeliverCtx::default(),
            held: Held::default(),
            failures: 0,
            reads: BatchedReads::Untried,
        }
    }
}

/// One device queue of an uplink.
pub struct QueueSlot {
    /// The state of reading the queue, held by whoever reads it.
    pub(super) reader: Mutex<QueueReader>,
    /// A sender's thread serves the queue (`own_queue` in reader.rs); the reader then
    /// waits on `wake` rather than on the device.
    pub(super) owned: AtomicBool,
    /// Rung when the owner lets go. Without it, no one may own the queue.
    pub(super) wake: Option<Doorbell>,
    /// Reads of the queue by senders (reaps, an owner's serves): the reader tells a
    /// busy owner from a stalled one by it.
    pub(super) sender_reads: AtomicU64,
    /// Rung when a guest adds RX buffers while the reader holds frames.
    pub(super) room: Option<Arc<RoomBell>>,
}

/// A reader holding frames for a full guest queue sleeps on this as well as on its
/// device, and retries as soon as any guest adds RX buffers.
pub struct RoomBell {
    /// The reader sleeps holding frames: ring at the next room.
    pub(super) wanted: AtomicBool,
    pub(super) bell: Doorbell,
}

impl RoomBell {
    pub(super) fn new() -> io::Result<RoomBell> {
        Ok(RoomBell {
            wanted: AtomicBool::new(false),
            bell: Doorbell::new()?,
        })
    }
}

impl RoomWaiter for RoomBell {
    fn room(&self) {
        if self.wanted.swap(false, Relaxed) {
            self.bell.ring();
        }
    }
}

/// A wake-up one thread rings and another polls: a non-blocking socket pair.
pub struct Doorbell {
    bell: UnixStream,
    ear: UnixStream,
}

impl Doorbell {
    pub(super) fn new() -> io::Result<Doorbell> {
        let (bell, ear) = UnixStream::pair()?;
        bell.set_nonblocking(true)?;
        ear.set_nonblocking(true)?;
        Ok(Doorbell { bell, ear })
    }

    /// Rings (a full socket buffer means it rang already).
    pub fn ring(&self) {
        let _ = (&self.bell).write(&[1]);
    }

    /// What to poll for a ring.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.ear.as_fd()
    }

    /// Forgets the rings so far.
    pub fn clear(&self) {
        let mut buf = [0u8; 64];
        while matches!((&self.ear).read(&mut buf), Ok(n) if n > 0) {}
    }
}

/// The switch and id the readers forward with, and the uplink's stop flag.
pub struct Home {
    pub(super) switch: Weak<Switch>,
    pub(super) id: usize,
    pub(super) stop: Arc<AtomicBool>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sys::io::poll_readable;
    use std::time::Duration;

    #[test]
    fn a_room_bell_rings_only_for_a_reader_that_asked() {
        let r = RoomBell::new().unwrap();
        r.room();
        assert!(!poll_readable(r.bell.fd(), Duration::ZERO).unwrap());
        r.wanted.store(true, Relaxed);
        r.room();
        assert!(poll_readable(r.bell.fd(), Duration::ZERO).unwrap());
        assert!(!r.wanted.load(Relaxed), "one ring per ask");
    }

    #[test]
    fn a_doorbell_wakes_its_poller_until_cleared() {
        let d = Doorbell::new().unwrap();
        assert!(!poll_readable(d.fd(), Duration::ZERO).unwrap());
        d.ring();
        d.ring();
        assert!(poll_readable(d.fd(), Duration::from_secs(1)).unwrap());
        d.clear();
        assert!(!poll_readable(d.fd(), Duration::ZERO).unwrap());
        // Rung far more than its socket buffer holds: ringing never blocks.
        for _ in 0..1_000_000 {
            d.ring();
        }
        assert!(poll_readable(d.fd(), Duration::ZERO).unwrap());
    }
}

//! Uplink writes a sender puts off to the end of its batch, so a batch of frames to a
//! tap costs one system call (`sys::uring`) instead of a writev each.
//!
//! Only a frame that goes intact, and whose bytes the sender declared stable
//! (`stable`), waits: its parts are kept by address, which stays good until the
//! sender's next flush. Each waiting write holds its uplink, so the device (and the
//! fd number) cannot be closed and reused before the write is submitted. Counters
//! move when the results are known: delivered, or dropped with the reason the device
//! gave, as for a write made at once.

use std::ops::Range;
use std::sync::Arc;

use super::{stable, SwitchUplink};
use crate::frame::Frame;
use crate::stats::DropReason;
use crate::sys::uring::{Part, Ring, Write};
use crate::vnet_hdr::{VirtioNetHdr, HDR_LEN};

/// Writes submitted together at most; a fuller batch submits early.
pub const WRITE_BATCH: usize = 32;

/// A vnet header as a device takes it in front of a frame: its first `len` bytes.
#[derive(Clone, Copy, Debug)]
pub struct WireHdr {
    pub bytes: [u8; HDR_LEN],
    pub len: usize,
}

/// One write put off: where it goes and what it carries.
struct Waiting {
    up: Arc<dyn SwitchUplink>,
    queue: usize,
    hdr: WireHdr,
    /// Its frame's parts, in `WriteBatch::parts`.
    parts: Range<usize>,
    len: usize,
    gso: bool,
}

/// The writes one sending thread has put off since its last flush.
pub struct WriteBatch {
    ring: Ring,
    waiting: Vec<Waiting>,
    /// Header, then frame parts, of each waiting write (its `parts` range); the
    /// header part's address is filled in at submission.
    parts: Vec<Part>,
    results: Vec<std::io::Result<usize>>,
}

impl WriteBatch {
    pub fn new() -> std::io::Result<WriteBatch> {
        Ok(WriteBatch {
            ring: Ring::new(WRITE_BATCH as u32, true)?,
            waiting: Vec::with_capacity(WRITE_BATCH),
            parts: Vec::new(),
            results: Vec::with_capacity(WRITE_BATCH),
        })
    }

    /// Puts off the write of a frame to `up`'s queue `queue` that goes intact with
    /// header `hdr` (decided by `deliver`), when it may wait: its bytes are stable and
    /// the uplink takes batched writes. True if so.
    pub fn put_off(
        &mut self,
        up: &Arc<dyn SwitchUplink>,
        queue: usize,
        hdr: &VirtioNetHdr,
        frame: &Frame,
    ) -> bool {
        if !frame.parts.iter().all(|p| stable::holds(p)) || up.queue_fd(queue).is_none() {
            return false;
        }
        let Some(wire) = up.batched_header(hdr) else {
            return false;
        };
        if self.waiting.len() == WRITE_BATCH {
            self.submit();
        }
        let first = self.parts.len();
        self.parts.push(Part { addr: 0, len: 0 });
        self.parts.extend(frame.parts.iter().map(|p| Part::of(p)));
        self.waiting.push(Waiting {
            up: up.clone(),
            queue,
            hdr: wire,
            parts: first..self.parts.len(),
            len: frame.len,
            gso: hdr.gso.is_gso(),
        });
        true
    }

    /// Writes everything put off, in order, and counts each result.
    pub fn submit(&mut self) {
        if self.waiting.is_empty() {
            return;
        }
        for w in &self.waiting {
            self.parts[w.parts.start] = Part::of(&w.hdr.bytes[..w.hdr.len]);
        }
        let writes: Vec<Write<'_>> = self
            .waiting
            .iter()
            .filter_map(|w| {
                Some(Write {
                    fd: w.up.queue_fd(w.queue)?,
                    parts: &self.parts[w.parts.clone()],
                })
            })
            .collect();
        if writes.len() == self.waiting.len() {
            self.ring.writev_all(&writes, &mut self.results);
        } else {
            // Not reached: a queue's fd lives as long as its uplink, held here.
            self.results.clear();
        }
        drop(writes);
        for (i, w) in self.waiting.drain(..).enumerate() {
            let stats = w.up.stats();
            match self.results.get(i) {
                Some(Ok(_)) => stats.rx_intact(w.len, w.gso),
                Some(Err(e)) => stats.drop(DropReason::of_uplink_write(e)),
                None => stats.drop(DropReason::UplinkError),
            }
        }
        self.parts.clear();
    }
}

impl Drop for WriteBatch {
    /// A sender that stops without a flush: its waiting writes are lost, and counted.
    fn drop(&mut self) {
        for w in self.waiting.drain(..) {
            w.up.stats().drop(DropReason::UplinkError);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::switch::deliver::{DeliverCtx, Destination};
    use crate::backend::switch::{Endpoint, Switch, SwitchPort};
    use crate::backend::uplink::device::TapUplink;
    use crate::backend::uplink::packet::PacketSocket;
    use crate::backend::uplink::UplinkDevice;
    use crate::config::UplinkConfig;
    use crate::sys::io::poll_readable;
    use crate::testkit::recorder::Recorder;
    use std::sync::atomic::Ordering::Relaxed;
    use std::time::Duration;

    const LEN: usize = 80;

    /// A broadcast frame of the test's own ethertype carrying `seq`.
    fn frame_bytes(seq: u32) -> [u8; LEN] {
        let mut f = [0u8; LEN];
        f[..6].copy_from_slice(&[0xff; 6]);
        f[6..12].copy_from_slice(&[0x02, 0, 0, 0, 0, 0x43]);
        f[12..14].copy_from_slice(&[0x88, 0xb5]);
        f[16..20].copy_from_slice(&seq.to_be_bytes());
        f
    }

    /// Sequence numbers of the test's frames the host reads from the tap until it
    /// has been quiet for `quiet`.
    fn host_reads(host: &PacketSocket, quiet: Duration) -> Vec<u32> {
        let mut got = Vec::new();
        let mut buf = vec![0u8; 2048];
        while poll_readable(host.fd(0), quiet).unwrap() {
            let Ok(Some(r)) = host.recv(0, &mut buf) else {
                continue;
            };
            let f = &buf[r.start + host.hdr_len()..r.end];
            if f.len() >= 20 && f[12..14] == [0x88, 0xb5] {
                got.push(u32::from_be_bytes([f[16], f[17], f[18], f[19]]));
            }
        }
        got
    }

    /// Stable frames to a tap wait for the flush and then arrive in order, counted
    /// only then; a frame that cannot wait (not stable) sends those waiting first.
    #[test]
    fn stable_frames_reach_a_tap_at_the_flush_in_order() {
        if !crate::testkit::can_run(crate::sys::is_root(), "root (a tap)") {
            return;
        }
        let mut ctx = DeliverCtx::default();
        let uring = ctx.batch_writes();
        if !crate::testkit::can_run(uring.is_ok(), &format!("io_uring ({uring:?})")) {
            return;
        }
        let name = format!("gswb{}", std::process::id() % 100_000);
        let cfg = UplinkConfig::parse(&format!("tap={name},persist=off")).unwrap();
        let up = Arc::new(TapUplink::open(&cfg, &name).expect("tap"));
        let host = PacketSocket::open(&name, 1, false).expect("AF_PACKET on the tap");
        let port = Arc::new(Recorder::default());
        let switch = Switch::new(
            vec![port as Arc<dyn SwitchPort>],
            vec![up.clone() as Arc<dyn SwitchUplink>],
            Duration::from_secs(300),
        );
        let send = |bytes: &[u8], ctx: &mut DeliverCtx| {
            let parts = [bytes];
            let f = Frame::new(VirtioNetHdr::default(), &parts, None).unwrap();
            switch.forward(Endpoint::Port(0), 0, &f, ctx);
        };
        let rx = || up.stats().rx_frames.load(Relaxed);
        let n = WRITE_BATCH as u32 + 10;
        let buf: Vec<u8> = (0..n).flat_map(frame_bytes).collect();
        let _stable = stable::declare(buf.as_ptr_range());

        for f in buf.chunks(LEN).take(5) {
            send(f, &mut ctx);
        }
        let quiet = Duration::from_millis(200);
        assert_eq!(
            host_reads(&host, quiet),
            Vec::<u32>::new(),
            "written before the flush"
        );
        assert_eq!(rx(), 0, "counted before the flush");
        ctx.flush();
        assert_eq!(host_reads(&host, quiet), (0..5).collect::<Vec<_>>());
        assert_eq!(rx(), 5);

        // A frame outside the stable region goes at once, after the two waiting.
        for f in buf.chunks(LEN).skip(5).take(2) {
            send(f, &mut ctx);
        }
        send(&frame_bytes(1000), &mut ctx);
        assert_eq!(host_reads(&host, quiet), vec![5, 6, 1000]);
        assert_eq!(rx(), 8);

        // More than a batch's worth: the first WRITE_BATCH go as the next is put off.
        for f in buf.chunks(LEN).skip(7) {
            send(f, &mut ctx);
        }
        let early = host_reads(&host, quiet);
        assert_eq!(early, (7..7 + WRITE_BATCH as u32).collect::<Vec<_>>());
        ctx.flush();
        let rest = host_reads(&host, quiet);
        assert_eq!(rest, (7 + WRITE_BATCH as u32..n).collect::<Vec<_>>());
        assert_eq!(rx(), u64::from(n) + 1);
        assert_eq!(up.stats().drops(DropReason::UplinkError), 0);
    }
}

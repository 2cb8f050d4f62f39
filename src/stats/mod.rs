//! Counters of one port or uplink: plain atomics bumped on the datapath, read as a
//! snapshot by the control socket. Drops are counted by reason, one atomic each.

mod drop_reason;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use serde::{Deserialize, Serialize};

pub use drop_reason::DropReason;

const REASONS: usize = DropReason::ALL.len();

#[derive(Default)]
pub struct Counters {
    pub tx_frames: AtomicU64,
    pub tx_bytes: AtomicU64,
    pub rx_frames: AtomicU64,
    pub rx_bytes: AtomicU64,
    /// Largest frame seen leaving the source (bytes after the vnet header).
    pub tx_max_frame: AtomicU64,
    /// GSO frames handed on with their GSO header.
    pub gso_passed: AtomicU64,
    /// GSO frames segmented in software for this destination, and what came out.
    pub gso_segmented: AtomicU64,
    pub segments_out: AtomicU64,
    pub bytes_segmented: AtomicU64,
    pub max_segments: AtomicU64,
    pub min_segments: AtomicU64,
    pub max_mss: AtomicU64,
    pub min_mss: AtomicU64,
    pub csum_completed: AtomicU64,
    /// GSO frames GRO built for this guest, and the segments they hold.
    pub gro_frames: AtomicU64,
    pub gro_segments: AtomicU64,
    /// Frames written into this guest straight from another guest's buffers.
    pub rx_one_copy: AtomicU64,
    /// `rate=`: times the endpoint's TX queue was held, and for how long in all (µs).
    pub tx_holds: AtomicU64,
    pub tx_throttled_us: AtomicU64,
    /// Learned addresses that moved to this endpoint from another.
    pub mac_moves: AtomicU64,
    /// Guest notifications: wake-ups on its TX and RX kick fds (one wake-up may
    /// carry several kicks), and interrupts requested on its call fds.
    pub tx_kicks: AtomicU64,
    pub rx_kicks: AtomicU64,
    pub tx_calls: AtomicU64,
    pub rx_calls: AtomicU64,
    /// Looks at the TX queue by the `tx_poll_us` timer, kicks being off (a Xen vif:
    /// by its 200 ms look); for an uplink, reads of its queue by a sender (`reap`).
    pub tx_polls: AtomicU64,
    /// An uplink's frames set aside for a full guest queue (re-sent as it adds
    /// buffers, or dropped as `rx_queue_full`), and the times its reads paused
    /// because all they got went to full guests (`backpressure::Held::pause_reads`).
    pub rx_held: AtomicU64,
    pub rx_pauses: AtomicU64,
    /// A guest's TX frames set aside for a full guest queue (re-sent as it adds
    /// buffers, or dropped as `rx_queue_full`), and the times its TX queue was left
    /// alone because all a batch held went to full guests (`Held::pause_reads`).
    pub tx_held: AtomicU64,
    pub tx_pauses: AtomicU64,
    drops: DropCounters,
}

/// One counter per `DropReason`.
struct DropCounters([AtomicU64; REASONS]);

impl Default for DropCounters {
    fn default() -> Self {
        DropCounters(std::array::from_fn(|_| AtomicU64::new(0)))
    }
}

/// Counters of one queue of a multi-queue endpoint (a Xen vif's queue, with a worker
/// of its own), beside the endpoint's `Counters`: which queue the traffic and the
/// events went through. Aligned to its own cache lines: each queue's worker bumps its
/// own.
#[derive(Default)]
#[repr(align(128))]
pub struct QueueCounters {
    pub tx_frames: AtomicU64,
    pub tx_bytes: AtomicU64,
    pub rx_frames: AtomicU64,
    pub rx_bytes: AtomicU64,
    pub tx_kicks: AtomicU64,
    pub rx_kicks: AtomicU64,
    pub tx_calls: AtomicU64,
    pub rx_calls: AtomicU64,
    pub tx_polls: AtomicU64,
    /// Frames for this queue that found its RX ring without room (held by the
    /// sender, or dropped as `rx_queue_full`).
    pub rx_full: AtomicU64,
}

/// `QueueCounters` read once, with the queue's index.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, Default)]
pub struct QueueSnapshot {
    pub queue: usize,
    pub tx_frames: u64,
    pub tx_bytes: u64,
    pub rx_frames: u64,
    pub rx_bytes: u64,
    pub tx_kicks: u64,
    pub rx_kicks: u64,
    pub tx_calls: u64,
    pub rx_calls: u64,
    pub tx_polls: u64,
    pub rx_full: u64,
}

impl QueueCounters {
    pub fn tx(&self, bytes: usize) {
        self.tx_frames.fetch_add(1, Relaxed);
        self.tx_bytes.fetch_add(bytes as u64, Relaxed);
    }

    pub fn rx(&self, bytes: usize) {
        self.rx_frames.fetch_add(1, Relaxed);
        self.rx_bytes.fetch_add(bytes as u64, Relaxed);
    }

    pub fn snapshot(&self, queue: usize) -> QueueSnapshot {
        let g = |c: &AtomicU64| c.load(Relaxed);
        QueueSnapshot {
            queue,
            tx_frames: g(&self.tx_frames),
            tx_bytes: g(&self.tx_bytes),
            rx_frames: g(&self.rx_frames),
            rx_bytes: g(&self.rx_bytes),
            tx_kicks: g(&self.tx_kicks),
            rx_kicks: g(&self.rx_kicks),
            tx_calls: g(&self.tx_calls),
            rx_calls: g(&self.rx_calls),
            tx_polls: g(&self.tx_polls),
            rx_full: g(&self.rx_full),
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, Default)]
pub struct Snapshot {
    pub tx_frames: u64,
    pub tx_bytes: u64,
    pub rx_frames: u64,
    pub rx_bytes: u64,
    pub tx_max_frame: u64,
    pub gso_passed: u64,
    pub gso_segmented: u64,
    pub segments_out: u64,
    pub bytes_segmented: u64,
    pub max_segments: u64,
    pub min_segments: u64,
    pub max_mss: u64,
    pub min_mss: u64,
    pub csum_completed: u64,
    #[serde(default)]
    pub mac_moves: u64,
    #[serde(default)]
    pub tx_kicks: u64,
    #[serde(default)]
    pub rx_kicks: u64,
    #[serde(default)]
    pub tx_calls: u64,
    #[serde(default)]
    pub rx_calls: u64,
    #[serde(default)]
    pub tx_polls: u64,
    #[serde(default)]
    pub rx_held: u64,
    #[serde(default)]
    pub rx_pauses: u64,
    #[serde(default)]
    pub tx_held: u64,
    #[serde(default)]
    pub tx_pauses: u64,
    pub gro_frames: u64,
    #[serde(default)]
    pub gro_segments: u64,
    #[serde(default)]
    pub rx_one_copy: u64,
    #[serde(default)]
    pub tx_holds: u64,
    #[serde(default)]
    pub tx_throttled_us: u64,
    /// Non-zero drop counters by `DropReason::name`.
    pub drops: BTreeMap<String, u64>,
}

fn set_max(c: &AtomicU64, v: u64) {
    c.fetch_max(v, Relaxed);
}

/// `min` with 0 meaning "none seen yet".
fn set_min(c: &AtomicU64, v: u64) {
    let mut cur = c.load(Relaxed);
    while cur == 0 || v < cur {
        match c.compare_exchange_weak(cur, v, Relaxed, Relaxed) {
            Ok(_) => return,
            Err(now) => cur = now,
        }
    }
}

impl Counters {
    pub fn drop(&self, reason: DropReason) {
        self.drops.0[reason as usize].fetch_add(1, Relaxed);
    }

    pub fn drops(&self, reason: DropReason) -> u64 {
        self.drops.0[reason as usize].load(Relaxed)
    }

    pub fn tx(&self, bytes: usize) {
        self.tx_frames.fetch_add(1, Relaxed);
        self.tx_bytes.fetch_add(bytes as u64, Relaxed);
        set_max(&self.tx_max_frame, bytes as u64);
    }

    /// `tx` for `frames` frames of `bytes` in all, the largest `largest` bytes.
    pub fn tx_many(&self, frames: u64, bytes: u64, largest: u64) {
        if frames > 0 {
            self.tx_frames.fetch_add(frames, Relaxed);
            self.tx_bytes.fetch_add(bytes, Relaxed);
            set_max(&self.tx_max_frame, largest);
        }
    }

    pub fn rx(&self, bytes: usize) {
        self.rx_frames.fetch_add(1, Relaxed);
        self.rx_bytes.fetch_add(bytes as u64, Relaxed);
    }

    /// One frame of `bytes` handed on intact; `gso`: with its GSO header.
    pub fn rx_intact(&self, bytes: usize, gso: bool) {
        self.rx(bytes);
        if gso {
            self.gso_passed.fetch_add(1, Relaxed);
        }
    }

    /// `frames` frames of `bytes` in all handed on intact, `gso` of them with their
    /// GSO header: `rx_intact` for a run of frames, one update per counter.
    pub fn rx_intact_many(&self, frames: u64, bytes: u64, gso: u64) {
        if frames > 0 {
            self.rx_frames.fetch_add(frames, Relaxed);
            self.rx_bytes.fetch_add(bytes, Relaxed);
        }
        if gso > 0 {
            self.gso_passed.fetch_add(gso, Relaxed);
        }
    }

    /// One frame segmented into `segments` of at most `mss` payload bytes.
    pub fn segmented(&self, segments: usize, mss: usize, bytes: usize) {
        self.gso_segmented.fetch_add(1, Relaxed);
        self.segments_out.fetch_add(segments as u64, Relaxed);
        self.bytes_segmented.fetch_add(bytes as u64, Relaxed);
        set_max(&self.max_segments, segments as u64);
        set_min(&self.min_segments, segments as u64);
        set_max(&self.max_mss, mss as u64);
        set_min(&self.min_mss, mss as u64);
    }

    /// One GSO frame built by GRO from `segments` segments.
    pub fn coalesced(&self, segments: usize) {
        self.gro_frames.fetch_add(1, Relaxed);
        self.gro_segments.fetch_add(segments as u64, Relaxed);
    }

    /// The endpoint's TX queue held for `for_us` µs by its rate limit.
    pub fn throttled(&self, for_us: u64) {
        self.tx_holds.fetch_add(1, Relaxed);
        self.tx_throttled_us.fetch_add(for_us, Relaxed);
    }

    pub fn snapshot(&self) -> Snapshot {
        let g = |c: &AtomicU64| c.load(Relaxed);
        Snapshot {
            tx_frames: g(&self.tx_frames),
            tx_bytes: g(&self.tx_bytes),
            rx_frames: g(&self.rx_frames),
            rx_bytes: g(&self.rx_bytes),
            tx_max_frame: g(&self.tx_max_frame),
            gso_passed: g(&self.gso_passed),
            gso_segmented: g(&self.gso_segmented),
            segments_out: g(&self.segments_out),
            bytes_segmented: g(&self.bytes_segmented),
            max_segments: g(&self.max_segments),
            min_segments: g(&self.min_segments),
            max_mss: g(&self.max_mss),
            min_mss: g(&self.min_mss),
            csum_completed: g(&self.csum_completed),
            mac_moves: g(&self.mac_moves),
            tx_kicks: g(&self.tx_kicks),
            rx_kicks: g(&self.rx_kicks),
            tx_calls: g(&self.tx_calls),
            rx_calls: g(&self.rx_calls),
            tx_polls: g(&self.tx_polls),
            rx_held: g(&self.rx_held),
            rx_pauses: g(&self.rx_pauses),
            tx_held: g(&self.tx_held),
            tx_pauses: g(&self.tx_pauses),
            gro_frames: g(&self.gro_frames),
            gro_segments: g(&self.gro_segments),
            rx_one_copy: g(&self.rx_one_copy),
            tx_holds: g(&self.tx_holds),
            tx_throttled_us: g(&self.tx_throttled_us),
            drops: DropReason::ALL
                .iter()
                .map(|&r| (r.name().to_string(), self.drops(r)))
                .filter(|&(_, n)| n > 0)
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segment_extremes_and_drops() {
        let c = Counters::default();
        c.segmented(45, 1448, 65000);
        c.segmented(2, 1000, 1500);
        c.drop(DropReason::BadHeader);
        c.drop(DropReason::BadHeader);
        let s = c.snapshot();
        assert_eq!((s.gso_segmented, s.segments_out), (2, 47));
        assert_eq!((s.min_segments, s.max_segments), (2, 45));
        assert_eq!((s.min_mss, s.max_mss), (1000, 1448));
        assert_eq!(s.drops.get("bad_header"), Some(&2));
    }
}

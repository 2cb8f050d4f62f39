//! Pacing toward a guest with `rx_rate=`: what gsonet writes to its RX queue leaves
//! at the rate, one frame after another, not as the burst a segmented 64 KiB frame
//! would be. Each frame gets a departure time (the previous one's plus its own wire
//! time); one that is due goes at once, a later one is copied into the queue's pace
//! line and the port's own worker writes it when a timer says it is due. Senders only
//! take the line's lock for O(1) steps and a copy; nothing here waits.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::sys::timer::OneShotTimer;
use crate::vnet_hdr::VirtioNetHdr;

/// Frames due within this much of now leave together: one timer wake-up and one
/// signal for them, instead of one per frame.
pub const SLACK: Duration = Duration::from_micros(50);

/// Bytes one queue's pace line holds at most; past it a frame is dropped
/// (`rate_limited`). Guest senders are held by the `rx_rate=` debt long before
/// that; this bounds what floods and uplink readers can park here.
pub const LINE_BYTES: usize = 1 << 20;

/// One frame waiting for its departure.
pub struct Waiting {
    pub due: Instant,
    pub hdr: VirtioNetHdr,
    pub data: Vec<u8>,
}

#[derive(Default)]
struct Line {
    /// Departure time of the next frame at the earliest.
    next: Option<Instant>,
    waiting: VecDeque<Waiting>,
    bytes: usize,
    /// The worker is writing frames it took from the line: a sender must not pass
    /// them, so it queues behind even when its frame is due.
    draining: bool,
    armed: bool,
}

/// What a sender does with its frame.
#[derive(Debug, PartialEq, Eq)]
pub enum Admit {
    /// Write it now.
    Now,
    /// Copied into the line; the worker writes it when due.
    Queued,
    /// The line is full: drop it.
    Full,
}

/// The pace lines of one port, one per queue pair, each with the timer its worker
/// waits on.
pub struct Pacer {
    lines: Vec<Slot>,
}

struct Slot {
    line: Mutex<Line>,
    timer: OneShotTimer,
    /// Frames wait or are being written: an unlimited sender must take the lock and
    /// queue behind them. False lets it skip the lock.
    busy: AtomicBool,
}

/// Wire bytes of a frame with header `hdr` and `len` bytes: a GSO frame counts the
/// headers of every segment it becomes.
pub fn wire_bytes(hdr: &VirtioNetHdr, len: usize) -> usize {
    let size = usize::from(hdr.gso_size);
    let head = usize::from(hdr.hdr_len).min(len);
    if !hdr.gso.is_gso() || size == 0 || len <= head {
        return len;
    }
    let segments = (len - head).div_ceil(size);
    len + (segments - 1) * head
}

impl Pacer {
    pub fn new(pairs: usize) -> std::io::Result<Pacer> {
        let lines = (0..pairs)
            .map(|_| {
                Ok(Slot {
                    line: Mutex::new(Line::default()),
                    timer: OneShotTimer::new()?,
                    busy: AtomicBool::new(false),
                })
            })
            .collect::<std::io::Result<_>>()?;
        Ok(Pacer { lines })
    }

    /// The timer of queue `pair`, for the port's worker to wait on.
    pub fn timer(&self, pair: usize) -> Option<&OneShotTimer> {
        self.lines.get(pair).map(|s| &s.timer)
    }

    /// A frame for queue `pair` at `rate` bytes a second (`None`: unlimited, but it
    /// still queues behind frames waiting, to keep their order).
    /// Whether frames wait on queue `pair` (a frame may only go now if none do).
    pub fn busy(&self, pair: usize) -> bool {
        self.lines.get(pair).is_some_and(|s| s.busy.load(SeqCst))
    }

    pub fn admit(
        &self,
        pair: usize,
        rate: Option<f64>,
        hdr: &VirtioNetHdr,
        parts: &[&[u8]],
        now: Instant,
    ) -> Admit {
        let Some(slot) = self.lines.get(pair) else {
            return Admit::Now;
        };
        if rate.is_none() && !slot.busy.load(SeqCst) {
            return Admit::Now;
        }
        let mut l = slot.line.lock().unwrap_or_else(|e| e.into_inner());
        let idle = l.waiting.is_empty() && !l.draining;
        let Some(rate) = rate.filter(|r| *r > 0.0) else {
            if idle {
                l.next = None;
                return Admit::Now;
            }
            let due = l.next.unwrap_or(now).max(now);
            return queue(slot, &mut l, due, hdr, parts, now);
        };
        let len: usize = parts.iter().map(|p| p.len()).sum();
        let due = l.next.map_or(now, |n| n.max(now));
        l.next = Some(due + Duration::from_secs_f64(wire_bytes(hdr, len) as f64 / rate));
        if idle && due <= now + SLACK {
            return Admit::Now;
        }
        queue(slot, &mut l, due, hdr, parts, now)
    }

    /// The worker's turn (its timer fired, or it is going on after writing): moves
    /// the frames of `pair` due by `now` into `out` and marks the line draining; the
    /// worker writes them and calls again until nothing is due, which re-arms the
    /// timer for the next frame and lets senders write directly again.
    pub fn take_due(&self, pair: usize, now: Instant, out: &mut Vec<Waiting>) {
        let Some(slot) = self.lines.get(pair) else {
            return;
        };
        let mut l = slot.line.lock().unwrap_or_else(|e| e.into_inner());
        while l.waiting.front().is_some_and(|w| w.due <= now + SLACK) {
            let w = l.waiting.pop_front().expect("front checked");
            l.bytes -= w.data.len();
            out.push(w);
        }
        l.draining = !out.is_empty();
        l.armed = false;
        if let Some(first) = l.waiting.front() {
            l.armed = slot
                .timer
                .arm(first.due.saturating_duration_since(now))
                .is_ok();
        }
        slot.busy.store(l.draining || !l.waiting.is_empty(), SeqCst);
    }

    /// Drops every waiting frame (the guest went away); returns how many.
    pub fn clear(&self) -> usize {
        let mut n = 0;
        for slot in &self.lines {
            let mut l = slot.line.lock().unwrap_or_else(|e| e.into_inner());
            n += l.waiting.len();
            *l = Line::default();
            slot.busy.store(false, SeqCst);
        }
        n
    }
}

fn queue(
    slot: &Slot,
    l: &mut Line,
    due: Instant,
    hdr: &VirtioNetHdr,
    parts: &[&[u8]],
    now: Instant,
) -> Admit {
    let len: usize = parts.iter().map(|p| p.len()).sum();
    if l.bytes + len > LINE_BYTES {
        return Admit::Full;
    }
    let mut data = Vec::with_capacity(len);
    for p in parts {
        data.extend_from_slice(p);
    }
    l.bytes += len;
    slot.busy.store(true, SeqCst);
    l.waiting.push_back(Waiting {
        due,
        hdr: *hdr,
        data,
    });
    // While draining, the worker re-arms when it is done; otherwise the first frame
    // in line arms the timer.
    if !l.armed && !l.draining {
        l.armed = slot.timer.arm(due.saturating_duration_since(now)).is_ok();
    }
    Admit::Queued
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vnet_hdr::{GsoKind, GsoType};

    fn plain() -> VirtioNetHdr {
        VirtioNetHdr::default()
    }

    #[test]
    fn unlimited_and_idle_goes_at_once() {
        let p = Pacer::new(1).unwrap();
        let now = Instant::now();
        assert_eq!(p.admit(0, None, &plain(), &[&[0; 100]], now), Admit::Now);
    }

    #[test]
    fn frames_depart_one_wire_time_apart() {
        // 1,000,000 bytes/s: a 1000-byte frame takes 1 ms.
        let p = Pacer::new(1).unwrap();
        let t0 = Instant::now();
        let f = [0u8; 1000];
        assert_eq!(p.admit(0, Some(1e6), &plain(), &[&f], t0), Admit::Now);
        for _ in 0..3 {
            assert_eq!(p.admit(0, Some(1e6), &plain(), &[&f], t0), Admit::Queued);
        }
        let mut out = Vec::new();
        p.take_due(0, t0, &mut out);
        assert!(out.is_empty(), "nothing due yet");
        p.take_due(0, t0 + Duration::from_micros(1000), &mut out);
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].due, t0 + Duration::from_millis(1));
        out.clear();
        p.take_due(0, t0 + Duration::from_millis(3), &mut out);
        let dues: Vec<_> = out.iter().map(|w| w.due - t0).collect();
        assert_eq!(dues, [Duration::from_millis(2), Duration::from_millis(3)]);
    }

    #[test]
    fn a_sender_never_passes_frames_in_line_or_being_written() {
        let p = Pacer::new(1).unwrap();
        let t0 = Instant::now();
        let f = [0u8; 1000];
        p.admit(0, Some(1e6), &plain(), &[&f], t0);
        assert_eq!(p.admit(0, Some(1e6), &plain(), &[&f], t0), Admit::Queued);
        // The limit is lifted: still behind the frame waiting.
        assert_eq!(p.admit(0, None, &plain(), &[&f], t0), Admit::Queued);
        let mut out = Vec::new();
        p.take_due(0, t0 + Duration::from_secs(1), &mut out);
        assert_eq!(out.len(), 2);
        // The worker is writing them: a due frame queues behind.
        assert_eq!(p.admit(0, None, &plain(), &[&f], t0), Admit::Queued);
        out.clear();
        p.take_due(0, t0 + Duration::from_secs(1), &mut out);
        assert_eq!(out.len(), 1);
        out.clear();
        p.take_due(0, t0 + Duration::from_secs(1), &mut out);
        assert!(out.is_empty());
        assert_eq!(p.admit(0, None, &plain(), &[&f], t0), Admit::Now);
    }

    #[test]
    fn the_line_is_bounded() {
        let p = Pacer::new(1).unwrap();
        let t0 = Instant::now();
        let f = vec![0u8; 65536];
        let mut queued = 0;
        loop {
            match p.admit(0, Some(1e3), &plain(), &[&f], t0) {
                Admit::Now => {}
                Admit::Queued => queued += 1,
                Admit::Full => break,
            }
        }
        assert_eq!(queued, LINE_BYTES / f.len());
        assert_eq!(p.clear(), queued);
        assert_eq!(p.admit(0, Some(1e3), &plain(), &[&f], t0), Admit::Now);
    }

    #[test]
    fn a_gso_frame_is_charged_as_its_segments() {
        let mut h = plain();
        h.gso = GsoType::new(GsoKind::TcpV4);
        h.gso_size = 1000;
        h.hdr_len = 54;
        // 54 + 3000 payload bytes: three segments, each with the 54 header bytes.
        assert_eq!(wire_bytes(&h, 3054), 3054 + 2 * 54);
        assert_eq!(wire_bytes(&plain(), 3054), 3054);
    }
}

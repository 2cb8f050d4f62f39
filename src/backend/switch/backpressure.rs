//! RX back-pressure, in one place: what a full guest RX queue means. A guest's stall
//! clock (how long its queue has been full), the wait a sender that can hold a frame
//! (an uplink reader) grants before giving up, and the retry, which re-delivers to
//! the destination already resolved without learning or classifying again.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use super::deliver::{DeliverCtx, OnFull, Path};
use super::vlan::ViewBuf;
use super::{Endpoint, Switch};
use crate::frame::Frame;
use crate::stats::DropReason;

/// How long a guest may keep its RX queue full before senders stop waiting for it.
pub const RX_STALL: Duration = Duration::from_millis(200);
/// How long a holding sender sleeps between tries when no guest adds buffers.
const RETRY_TICK: Duration = Duration::from_millis(10);

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

    /// The guest has let its queue stay full for `RX_STALL` or more: senders that
    /// could wait for room should not, so one guest that stops reading cannot hold
    /// up traffic for the others.
    pub fn stalled(&self) -> bool {
        let since = self.full_since.load(Relaxed);
        since != 0 && self.now_ms().saturating_sub(since) >= RX_STALL.as_millis() as u64
    }
}

/// A generation bumped whenever any guest adds RX buffers; holding senders wait on it.
#[derive(Default)]
pub struct RxRoom {
    generation: Mutex<u64>,
    changed: Condvar,
}

impl RxRoom {
    /// Some guest added RX buffers.
    pub fn added(&self) {
        *self.generation.lock().unwrap_or_else(|e| e.into_inner()) += 1;
        self.changed.notify_all();
    }

    pub fn generation(&self) -> u64 {
        *self.generation.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Waits until the generation moves past `seen`, or `timeout`.
    pub fn wait(&self, seen: u64, timeout: Duration) {
        let g = self.generation.lock().unwrap_or_else(|e| e.into_inner());
        let _ = self.changed.wait_timeout_while(g, timeout, |g| *g == seen);
    }
}

/// Forwards a frame from a sender that can hold it (an uplink reader): a unicast
/// frame for a guest whose RX queue is full waits up to `RX_STALL` for that guest to
/// add buffers, as a NIC with flow control would; the device's own queue absorbs what
/// arrives meanwhile. Floods and stalled guests are not waited for.
pub fn forward_holding(
    switch: &Switch,
    src: Endpoint,
    queue: usize,
    frame: &Frame,
    ctx: &mut DeliverCtx,
) {
    let mut views = ViewBuf::default();
    let Some(route) = switch.route(src, frame, &mut views) else {
        return;
    };
    let Some(dst) = route.unicast() else {
        switch.send(&route, queue, ctx, OnFull::Count);
        return;
    };
    let deadline = Instant::now() + RX_STALL;
    loop {
        let seen = switch.rx_room().generation();
        match switch.send(&route, queue, ctx, OnFull::Return) {
            Some(Path::Dropped(DropReason::RxQueueFull)) if Instant::now() < deadline => {
                ctx.flush();
                switch.rx_room().wait(seen, RETRY_TICK);
            }
            Some(Path::Dropped(DropReason::RxQueueFull)) => {
                switch.count_drop(dst, DropReason::RxQueueFull);
                return;
            }
            _ => return,
        }
    }
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
    fn room_wakes_a_waiter() {
        let r = std::sync::Arc::new(RxRoom::default());
        let seen = r.generation();
        let r2 = r.clone();
        let t = std::thread::spawn(move || {
            let t0 = Instant::now();
            r2.wait(seen, Duration::from_secs(5));
            t0.elapsed()
        });
        std::thread::sleep(Duration::from_millis(20));
        r.added();
        assert!(t.join().unwrap() < Duration::from_secs(5));
        assert_eq!(r.generation(), seen + 1);
    }
}

//! RX interrupt moderation, with the meaning `ethtool -C` gives `rx-usecs` and
//! `rx-frames`: a frame written to a guest's RX queue is announced at most `usecs`
//! after it arrived, or at once when `frames` are waiting. Senders (other ports' TX
//! workers, uplink readers) only count and arm a timer; the receiving port's own
//! worker signals when the timer fires. Nothing here blocks or waits.

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering::SeqCst};
use std::time::Duration;

use crate::config::{MAX_RX_COALESCE_FRAMES as MAX_FRAMES, MAX_RX_COALESCE_USECS as MAX_USECS};
use crate::sys::timer::OneShotTimer;

/// The moderation settings (changed at runtime with `gsonet ctl`) and, per queue, the
/// frames not yet announced and the timer that announces them.
pub struct RxCoalesce {
    usecs: AtomicU32,
    frames: AtomicU32,
    queues: Vec<Queue>,
}

struct Queue {
    waiting: AtomicU32,
    armed: AtomicBool,
    timer: OneShotTimer,
}

/// What a sender does after a batch to one queue.
#[derive(Debug, PartialEq, Eq)]
pub enum Announce {
    /// Signal the guest now.
    Now,
    /// The timer will (it is armed).
    Later,
}

impl RxCoalesce {
    pub fn new(pairs: usize, usecs: u32, frames: u32) -> std::io::Result<RxCoalesce> {
        let queues = (0..pairs)
            .map(|_| {
                Ok(Queue {
                    waiting: AtomicU32::new(0),
                    armed: AtomicBool::new(false),
                    timer: OneShotTimer::new()?,
                })
            })
            .collect::<std::io::Result<_>>()?;
        Ok(RxCoalesce {
            usecs: AtomicU32::new(usecs.min(MAX_USECS)),
            frames: AtomicU32::new(frames.min(MAX_FRAMES)),
            queues,
        })
    }

    /// (`rx_coalesce_usecs`, `rx_coalesce_frames`).
    pub fn settings(&self) -> (u32, u32) {
        (self.usecs.load(SeqCst), self.frames.load(SeqCst))
    }

    pub fn set(&self, usecs: u32, frames: u32) {
        self.usecs.store(usecs.min(MAX_USECS), SeqCst);
        self.frames.store(frames.min(MAX_FRAMES), SeqCst);
    }

    /// The timer of queue `pair`, for the port's worker to wait on.
    pub fn timer(&self, pair: usize) -> Option<&OneShotTimer> {
        self.queues.get(pair).map(|q| &q.timer)
    }

    /// `n` frames were written to queue `pair`.
    pub fn frames(&self, pair: usize, n: u32) {
        if let Some(q) = self.queues.get(pair) {
            q.waiting.fetch_add(n, SeqCst);
        }
    }

    /// A sender finished a batch to queue `pair` (its frames are in the used ring).
    pub fn batch_done(&self, pair: usize) -> Announce {
        let (usecs, frames) = self.settings();
        let Some(q) = self.queues.get(pair) else {
            return Announce::Now;
        };
        if usecs == 0 || (frames > 0 && q.waiting.load(SeqCst) >= frames) {
            q.waiting.store(0, SeqCst);
            return Announce::Now;
        }
        // The first sender to find the timer idle arms it; a sender that finds it
        // armed knows its frames are in the used ring before the timer's announcement
        // clears `armed` (see `fired`), so they are covered by it.
        if !q.armed.swap(true, SeqCst) && q.timer.arm(Duration::from_micros(usecs.into())).is_err()
        {
            q.armed.store(false, SeqCst);
            return Announce::Now;
        }
        Announce::Later
    }

    /// The timer of queue `pair` fired: the worker announces every waiting frame.
    pub fn fired(&self, pair: usize) {
        if let Some(q) = self.queues.get(pair) {
            q.timer.clear();
            q.waiting.store(0, SeqCst);
            q.armed.store(false, SeqCst);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn off_announces_every_batch_at_once() {
        let c = RxCoalesce::new(1, 0, 0).unwrap();
        c.frames(0, 1);
        assert_eq!(c.batch_done(0), Announce::Now);
    }

    #[test]
    fn a_batch_waits_for_the_timer_until_enough_frames_wait() {
        let c = RxCoalesce::new(2, 5000, 3).unwrap();
        c.frames(1, 1);
        assert_eq!(c.batch_done(1), Announce::Later);
        c.frames(1, 1);
        assert_eq!(c.batch_done(1), Announce::Later);
        c.frames(1, 1);
        assert_eq!(c.batch_done(1), Announce::Now, "3 frames waiting");
        // the other queue is independent
        c.frames(0, 1);
        assert_eq!(c.batch_done(0), Announce::Later);
    }

    #[test]
    fn once_fired_the_next_batch_arms_the_timer_again() {
        let c = RxCoalesce::new(1, 1, 0).unwrap();
        c.frames(0, 1);
        assert_eq!(c.batch_done(0), Announce::Later);
        assert!(c.queues[0].armed.load(SeqCst));
        c.fired(0);
        assert!(!c.queues[0].armed.load(SeqCst));
        c.frames(0, 1);
        assert_eq!(c.batch_done(0), Announce::Later);
        assert!(c.queues[0].armed.load(SeqCst));
    }

    #[test]
    fn settings_are_bounded() {
        let c = RxCoalesce::new(1, 0, 0).unwrap();
        c.set(u32::MAX, u32::MAX);
        assert_eq!(c.settings(), (MAX_USECS, MAX_FRAMES));
    }
}

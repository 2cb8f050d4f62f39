//! Rate limits an outsider cannot exceed: a token bucket (the software segmentation a
//! guest may cause), a byte rate (`rate=`: what a guest may send) and a log limiter
//! (the lines one port may write).

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// A token bucket: `rate` tokens a second, at most `burst` saved up.
pub struct TokenBucket {
    rate: f64,
    burst: f64,
    state: Mutex<(f64, Instant)>,
}

impl TokenBucket {
    pub fn new(rate: u64, burst: u64) -> TokenBucket {
        TokenBucket {
            rate: rate as f64,
            burst: burst as f64,
            state: Mutex::new((burst as f64, Instant::now())),
        }
    }

    /// Takes `n` tokens if the bucket holds them; false (and nothing taken) if not.
    /// The lock is the bucket's own, held for a few instructions.
    pub fn take(&self, n: u64) -> bool {
        self.take_at(n, Instant::now())
    }

    fn take_at(&self, n: u64, now: Instant) -> bool {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let (tokens, last) = *s;
        let refilled = (tokens + now.saturating_duration_since(last).as_secs_f64() * self.rate)
            .min(self.burst);
        let n = n as f64;
        if refilled >= n {
            *s = (refilled - n, now);
            true
        } else {
            *s = (refilled, now);
            false
        }
    }
}

/// At most `per_window` lines per `window` for one source; the rest are counted and
/// reported with the next line let through.
pub struct LogLimit {
    per_window: u64,
    window: Duration,
    epoch: Instant,
    /// Window number (since `epoch`) and lines in it, packed: window << 32 | lines.
    slot: AtomicU64,
    suppressed: AtomicU64,
}

impl LogLimit {
    pub fn new(per_window: u64, window: Duration) -> LogLimit {
        LogLimit {
            per_window,
            window,
            epoch: Instant::now(),
            slot: AtomicU64::new(0),
            suppressed: AtomicU64::new(0),
        }
    }

    /// Whether a line may be written now; `Some(n)`: yes, and `n` lines were
    /// suppressed before it.
    pub fn allow(&self) -> Option<u64> {
        let w = (self.epoch.elapsed().as_nanos() / self.window.as_nanos().max(1)) as u64;
        let mut cur = self.slot.load(Relaxed);
        loop {
            let (cw, lines) = (cur >> 32, cur & 0xffff_ffff);
            let next = if cw == w {
                if lines >= self.per_window {
                    self.suppressed.fetch_add(1, Relaxed);
                    return None;
                }
                (w << 32) | (lines + 1)
            } else {
                (w << 32) | 1
            };
            match self.slot.compare_exchange_weak(cur, next, Relaxed, Relaxed) {
                Ok(_) => return Some(self.suppressed.swap(0, Relaxed)),
                Err(now) => cur = now,
            }
        }
    }
}

impl Default for LogLimit {
    /// Ten lines every ten seconds.
    fn default() -> Self {
        LogLimit::new(10, Duration::from_secs(10))
    }
}

/// What a byte rate says of a frame (`ByteRate::admit_at`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum RateAdmit {
    /// It goes, charged.
    Now,
    /// It goes, charged; the bucket was in debt, paid off after this long: its
    /// sender waits that long before the next frame.
    After(Duration),
    /// It does not go (in debt, and its sender may not wait); nothing charged.
    Refused,
}

/// A byte rate with debt (`rate=MBIT,burst=KB`): a frame is always let through and
/// charged in full, and the sender waits while the bucket is in debt. So a frame larger
/// than the burst still passes, and the average stays at the rate.
pub struct ByteRate {
    /// Bytes a second.
    rate: f64,
    burst: f64,
    state: Mutex<(f64, Instant)>,
}

impl ByteRate {
    /// `mbit` megabits (10^6) a second, `burst_kb` KiB saved up at most.
    pub fn new(mbit: u64, burst_kb: u64) -> ByteRate {
        let burst = (burst_kb * 1024) as f64;
        ByteRate {
            rate: mbit as f64 * 1e6 / 8.0,
            burst,
            state: Mutex::new((burst, Instant::now())),
        }
    }

    /// Charges `bytes` sent at `now`.
    pub fn charge_at(&self, bytes: u64, now: Instant) {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let tokens = self.refilled(*s, now);
        *s = (tokens - bytes as f64, now);
    }

    /// `wait_at` and `charge_at` under one hold of the bucket: a frame of `bytes`
    /// goes at `now` unless the bucket is in debt and its sender may not wait
    /// (`may_wait`), and is charged if it goes.
    pub fn admit_at(&self, bytes: u64, now: Instant, may_wait: bool) -> RateAdmit {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let tokens = self.refilled(*s, now);
        let in_debt = tokens < 0.0;
        if in_debt && !may_wait {
            *s = (tokens, now);
            return RateAdmit::Refused;
        }
        *s = (tokens - bytes as f64, now);
        if in_debt {
            RateAdmit::After(Duration::from_secs_f64(-tokens / self.rate))
        } else {
            RateAdmit::Now
        }
    }

    /// `None`: the sender may go on at `now`; else how long until the debt is paid.
    pub fn wait_at(&self, now: Instant) -> Option<Duration> {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let tokens = self.refilled(*s, now);
        *s = (tokens, now);
        (tokens < 0.0).then(|| Duration::from_secs_f64(-tokens / self.rate))
    }

    fn refilled(&self, (tokens, last): (f64, Instant), now: Instant) -> f64 {
        (tokens + now.saturating_duration_since(last).as_secs_f64() * self.rate).min(self.burst)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bucket_refills_at_its_rate_up_to_its_burst() {
        let b = TokenBucket::new(1000, 100);
        let t0 = Instant::now();
        assert!(b.take_at(100, t0));
        assert!(!b.take_at(1, t0));
        // 50 ms at 1000/s: 50 tokens.
        assert!(b.take_at(50, t0 + Duration::from_millis(50)));
        assert!(!b.take_at(1, t0 + Duration::from_millis(50)));
        // Never more than the burst, however long it rests.
        assert!(!b.take_at(101, t0 + Duration::from_secs(60)));
        assert!(b.take_at(100, t0 + Duration::from_secs(60)));
    }

    #[test]
    fn byte_rate_lets_a_frame_through_and_waits_off_its_debt() {
        // 8 Mbit/s = 1,000,000 bytes/s, 1 KiB burst.
        let r = ByteRate::new(8, 1);
        let t0 = Instant::now();
        assert_eq!(r.wait_at(t0), None);
        // A 64 KiB frame passes at once and leaves 63 KiB of debt.
        r.charge_at(65536, t0);
        let w = r.wait_at(t0).expect("in debt");
        assert_eq!(w.as_micros(), 64512);
        // Half way, half the debt; paid off, the sender goes on.
        let half = r.wait_at(t0 + w / 2).expect("still in debt");
        assert_eq!(half.as_micros(), 32256);
        assert_eq!(r.wait_at(t0 + w), None);
        // Idle time saves up one burst, no more.
        assert_eq!(r.wait_at(t0 + Duration::from_secs(60)), None);
        r.charge_at(1024, t0 + Duration::from_secs(60));
        assert_eq!(r.wait_at(t0 + Duration::from_secs(60)), None);
        r.charge_at(1, t0 + Duration::from_secs(60));
        assert!(r.wait_at(t0 + Duration::from_secs(60)).is_some());
    }

    #[test]
    fn a_frame_is_admitted_charged_held_or_refused_as_the_debt_and_its_sender_allow() {
        // 8 Mbit/s = 1,000,000 bytes/s, 1 KiB burst.
        let r = ByteRate::new(8, 1);
        let t0 = Instant::now();
        // Out of debt: it goes at once, charged in full (63 KiB of debt left).
        assert_eq!(r.admit_at(65536, t0, false), RateAdmit::Now);
        // In debt: refused and not charged for a sender that cannot wait...
        assert_eq!(r.admit_at(1000, t0, false), RateAdmit::Refused);
        assert_eq!(r.wait_at(t0).expect("in debt").as_micros(), 64512);
        // ...let through and charged for one that can: it waits off the debt as it
        // stood before this frame.
        let w = Duration::from_micros(64512);
        assert_eq!(r.admit_at(1000, t0, true), RateAdmit::After(w));
        assert_eq!(r.wait_at(t0).expect("in debt").as_micros(), 65512);
        // Paid off: it goes again.
        let later = t0 + Duration::from_micros(65512);
        assert_eq!(r.admit_at(10, later, false), RateAdmit::Now);
    }

    #[test]
    fn log_limit_lets_a_few_lines_through_and_counts_the_rest() {
        let l = LogLimit::new(3, Duration::from_secs(3600));
        assert_eq!(l.allow(), Some(0));
        assert_eq!(l.allow(), Some(0));
        assert_eq!(l.allow(), Some(0));
        for _ in 0..5 {
            assert_eq!(l.allow(), None);
        }
        let quick = LogLimit::new(1, Duration::from_millis(1));
        assert_eq!(quick.allow(), Some(0));
        assert_eq!(quick.allow(), None);
        std::thread::sleep(Duration::from_millis(3));
        assert_eq!(quick.allow(), Some(1), "the suppressed line is reported");
    }
}

//! A one-shot, non-blocking timerfd for an epoll loop (vmm-sys-util's TimerFd blocks
//! on read, and a timer re-armed after epoll reported its expiry must not).

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::time::Duration;

use super::check;

/// A CLOCK_MONOTONIC timerfd, TFD_NONBLOCK.
pub struct OneShotTimer(OwnedFd);

impl OneShotTimer {
    pub fn new() -> io::Result<OneShotTimer> {
        // SAFETY: no pointers; the returned descriptor is new and owned below.
        let fd = check(unsafe {
            libc::timerfd_create(
                libc::CLOCK_MONOTONIC,
                libc::TFD_NONBLOCK | libc::TFD_CLOEXEC,
            )
        })?;
        // SAFETY: `fd` was just created and nothing else owns it.
        Ok(OneShotTimer(unsafe { OwnedFd::from_raw_fd(fd) }))
    }

    /// Fires once, `after` from now (a zero duration is taken as 1 ns: zero disarms).
    pub fn arm(&self, after: Duration) -> io::Result<()> {
        let after = after.max(Duration::from_nanos(1));
        let spec = libc::itimerspec {
            it_interval: libc::timespec {
                tv_sec: 0,
                tv_nsec: 0,
            },
            it_value: libc::timespec {
                tv_sec: after.as_secs() as libc::time_t,
                tv_nsec: after.subsec_nanos() as libc::c_long,
            },
        };
        // SAFETY: `spec` is a valid itimerspec for the call; the old value is not asked for.
        check(unsafe {
            libc::timerfd_settime(self.0.as_raw_fd(), 0, &spec, std::ptr::null_mut())
        })?;
        Ok(())
    }

    /// Consumes an expiry, if any; never waits.
    pub fn clear(&self) {
        let mut n = 0u64;
        // SAFETY: reads at most 8 bytes into `n`, which is 8 bytes long.
        let _ = unsafe { libc::read(self.0.as_raw_fd(), (&mut n as *mut u64).cast(), 8) };
    }
}

impl AsFd for OneShotTimer {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.0.as_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    #[test]
    fn fires_once_after_the_delay_and_clearing_never_waits() {
        let t = OneShotTimer::new().unwrap();
        let start = Instant::now();
        t.clear(); // nothing pending: returns at once
        t.arm(Duration::from_millis(20)).unwrap();
        let mut pfd = libc::pollfd {
            fd: t.as_fd().as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd for the call.
        let n = unsafe { libc::poll(&mut pfd, 1, 5000) };
        assert_eq!(n, 1);
        assert!(start.elapsed() >= Duration::from_millis(20));
        t.clear();
        // SAFETY: as above.
        let n = unsafe { libc::poll(&mut pfd, 1, 50) };
        assert_eq!(n, 0, "a one-shot timer fired twice");
    }
}

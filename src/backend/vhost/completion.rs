//! TX completion moderation (`tx_coalesce_usecs`, the meaning `ethtool -C tx-usecs`
//! gives it): the call that announces used TX chains waits up to N µs. A guest that
//! reclaims its TX ring meanwhile on its own (Linux virtio-net does it in every RX
//! poll) no longer asks for the call then, and takes one interrupt less.

use std::io;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use vhost_user_backend::VringT;
use virtio_queue::QueueT;

use super::port::{Port, Vring};
use crate::ring::host::HostMem;
use crate::ring::vq::{UsedPos, Vq};
use crate::sys::timer::OneShotTimer;

/// The TX completion state of one queue worker; only that worker touches it.
#[derive(Default)]
pub struct TxCompletion {
    timer: Option<OneShotTimer>,
    armed: bool,
    /// Chains used since the guest's wish was last looked at.
    unannounced: usize,
    /// The used position when the guest's wish was last looked at (`None`: not
    /// since this worker started).
    announced: Option<UsedPos>,
}

impl TxCompletion {
    /// With its timer (the daemon's workers); without one every call goes out at once.
    pub fn with_timer() -> io::Result<TxCompletion> {
        Ok(TxCompletion {
            timer: Some(OneShotTimer::new()?),
            ..TxCompletion::default()
        })
    }

    /// The timer, for the worker's epoll.
    pub fn timer(&self) -> Option<&OneShotTimer> {
        self.timer.as_ref()
    }

    /// `used` chains were handed back by a drain (the queue was running): announce
    /// them now, or leave them to the timer. A ring half full of unannounced chains is
    /// announced at once: the guest may be out of room and waiting for it.
    pub fn used(&mut self, port: &Port, txq: &Vring, used: usize, usecs: u32) {
        if used == 0 {
            return;
        }
        self.unannounced += used;
        if let Some(timer) = self.timer.as_ref().filter(|_| usecs > 0) {
            let half = (txq.get_ref().get_queue().size() as usize / 2).max(1);
            if self.unannounced < half {
                if self.armed {
                    return;
                }
                if timer.arm(Duration::from_micros(usecs.into())).is_ok() {
                    self.armed = true;
                    return;
                }
            }
        }
        self.announce(port, txq);
    }

    /// The timer fired: announce what the guest still asks for, if `may_write` (the
    /// caller holds the port's `tx_gate`).
    pub fn fired(&mut self, port: &Port, txq: &Vring, may_write: bool) {
        if let Some(t) = &self.timer {
            t.clear();
        }
        self.armed = false;
        // The queue may have stopped since the chains were used.
        let running = {
            let st = txq.get_ref();
            st.get_queue().ready() && st.is_enabled()
        };
        if may_write && running && self.unannounced > 0 {
            self.announce(port, txq);
        }
    }

    /// Calls the guest if its `used_event` (EVENT_IDX) asks for it, as of now: chains
    /// it reclaimed since it asked are no longer owed a call. Callers hold the port's
    /// `tx_gate`, so never after a clean stop.
    fn announce(&mut self, port: &Port, txq: &Vring) {
        self.unannounced = 0;
        let wants = {
            let st = txq.get_ref();
            let ring = Vq::of(st.get_queue(), port.packed());
            let since = self.announced.replace(ring.used_pos());
            match (port.memory(), since) {
                (Some(mem), Some(since)) => ring.wants_call(&HostMem::new(&mem), since),
                _ => true,
            }
        };
        if wants {
            port.stats.tx_calls.fetch_add(1, Relaxed);
            let _ = txq.signal_used_queue();
        }
    }
}

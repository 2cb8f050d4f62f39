//! The `VhostUserBackend` of one port: the thin shell rust-vmm's daemon drives. It
//! answers feature and config questions, keeps the port's memory and vrings, and
//! hands TX kicks to the TX loop and RX kicks to the switch.

use std::io;
use std::os::fd::{AsFd, AsRawFd};
use std::sync::atomic::AtomicU32;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tracing::info;
use vhost::vhost_user::message::VhostUserProtocolFeatures;
use vhost_user_backend::VhostUserBackend;
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::event::{
    new_event_consumer_and_notifier, EventConsumer, EventFlag, EventNotifier,
};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use super::port::{Mem, Port, Vring};
use super::tx::{self, DrainEnd, TxWorker};
use crate::backend::switch::Switch;
use crate::features::Negotiated;
use crate::sys::timer::OneShotTimer;

/// The `VhostUserBackend` of one port.
#[derive(Clone)]
pub struct PortBackend {
    port: Arc<Port>,
    switch: Arc<Switch>,
    exits: Arc<Vec<(EventConsumer, EventNotifier)>>,
    /// One per worker (queue pair): its TX buffer and delivery state.
    workers: Arc<Vec<Mutex<TxWorker>>>,
    /// One per worker: signalled once at start so each worker hands its vrings to the
    /// port before the guest kicks anything (see `introduce_workers`).
    hellos: Arc<Vec<EventFd>>,
    /// One per worker: the looks at what a device start owes its queues (`owed_look`).
    owed: Arc<Vec<OwedLooks>>,
}

/// A worker's looks at the calls a device start owes its queues, until they have
/// their call fds: its own timer and the looks since the last wake.
struct OwedLooks {
    timer: OneShotTimer,
    looks: AtomicU32,
}

/// Looks at what a device start owes a queue pair before its call fds are taken as
/// never coming (about 1.2 s of them, `PortBackend::owed_look`).
const OWED_LOOKS: u32 = 16;

/// The protocol features offered (the vhost crate adds REPLY_ACK itself). The relay
/// refuses every request these do not permit. LOG_SHMFD (SET_LOG_BASE) and RARP
/// (SEND_RARP, answered by the relay) are what a live migration needs;
/// CONFIGURE_MEM_SLOTS (ADD/REM_MEM_REG, GET_MAX_MEM_SLOTS answered by the relay)
/// what memory hotplug and virtio-mem need. STATUS (SET/GET_STATUS, answered by the
/// relay) tells a driver that sets the device up afresh, rings and all, from a
/// frontend that resumes its rings (`resume`).
pub const PROTOCOL_FEATURES: VhostUserProtocolFeatures = VhostUserProtocolFeatures::MQ
    .union(VhostUserProtocolFeatures::REPLY_ACK)
    .union(VhostUserProtocolFeatures::LOG_SHMFD)
    .union(VhostUserProtocolFeatures::RARP)
    .union(VhostUserProtocolFeatures::CONFIGURE_MEM_SLOTS)
    .union(VhostUserProtocolFeatures::STATUS);

/// Listener id of the start-up event, past the queue and exit ids.
fn hello_id(queue_pairs: usize) -> u64 {
    queue_pairs as u64 * 2 + 1
}

/// Listener id of a worker's TX timer: `tx_poll_us`, or a queue held for its `rate=`.
fn tx_timer_id(queue_pairs: usize) -> u64 {
    hello_id(queue_pairs) + 1
}

/// Listener id of the RX coalescing timer.
fn rx_coalesce_id(queue_pairs: usize) -> u64 {
    hello_id(queue_pairs) + 2
}

/// Listener id of the pace timer (`rx_rate=`: frames waiting for their departure).
fn pace_id(queue_pairs: usize) -> u64 {
    hello_id(queue_pairs) + 3
}

/// Listener id of a worker's TX completion timer (`tx_coalesce_usecs`).
fn tx_completion_id(queue_pairs: usize) -> u64 {
    hello_id(queue_pairs) + 4
}

/// Listener id of a worker's owed-call timer (`PortBackend::owed_look`).
fn owed_id(queue_pairs: usize) -> u64 {
    hello_id(queue_pairs) + 5
}

impl PortBackend {
    pub fn new(port: Arc<Port>, switch: Arc<Switch>) -> io::Result<PortBackend> {
        let exits = (0..port.queue_pairs())
            .map(|_| new_event_consumer_and_notifier(EventFlag::NONBLOCK))
            .collect::<io::Result<Vec<_>>>()?;
        let hellos = (0..port.queue_pairs())
            .map(|_| EventFd::new(EFD_NONBLOCK))
            .collect::<io::Result<Vec<_>>>()?;
        let workers = (0..port.queue_pairs())
            .map(|_| TxWorker::with_timer(port.clone(), switch.rx_room()).map(Mutex::new))
            .collect::<io::Result<Vec<_>>>()?;
        let owed = (0..port.queue_pairs())
            .map(|_| {
                Ok(OwedLooks {
                    timer: OneShotTimer::new()?,
                    looks: AtomicU32::new(0),
                })
            })
            .collect::<io::Result<Vec<_>>>()?;
        port.set_wakes(
            hellos
                .iter()
                .map(EventFd::try_clone)
                .collect::<io::Result<Vec<_>>>()?,
        );
        Ok(PortBackend {
            port,
            switch,
            exits: Arc::new(exits),
            workers: Arc::new(workers),
            hellos: Arc::new(hellos),
            owed: Arc::new(owed),
        })
    }

    /// Has every worker run once, so the port knows its RX vrings from the start.
    /// Without it the port learns a vring at the worker's first kick, and frames for
    /// the guest that arrive before that (a flood right after the guest posted its
    /// buffers) are lost for want of a queue. `handlers` are the daemon's epoll
    /// handlers, one per worker.
    pub fn introduce_workers<T>(
        &self,
        handlers: &[Arc<vhost_user_backend::VringEpollHandler<T>>],
    ) -> io::Result<()>
    where
        T: VhostUserBackend,
    {
        let id = hello_id(self.port.queue_pairs());
        let tx_timer = tx_timer_id(self.port.queue_pairs());
        let coalesce = rx_coalesce_id(self.port.queue_pairs());
        let pace = pace_id(self.port.queue_pairs());
        let completion = tx_completion_id(self.port.queue_pairs());
        let owed = owed_id(self.port.queue_pairs());
        let pairs = handlers
            .iter()
            .zip(self.hellos.iter())
            .zip(self.workers.iter())
            .zip(self.owed.iter());
        for (pair, (((h, fd), w), o)) in pairs.enumerate() {
            h.register_listener(o.timer.as_fd().as_raw_fd(), EventSet::IN, owed)?;
            let w = w.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(t) = &w.timer {
                h.register_listener(t.as_fd().as_raw_fd(), EventSet::IN, tx_timer)?;
            }
            if let Some(t) = w.completion.timer() {
                h.register_listener(t.as_fd().as_raw_fd(), EventSet::IN, completion)?;
            }
            if let Some(t) = self.port.rx_coalesce.timer(pair) {
                h.register_listener(t.as_fd().as_raw_fd(), EventSet::IN, coalesce)?;
            }
            if let Some(t) = self.port.pacer.timer(pair) {
                h.register_listener(t.as_fd().as_raw_fd(), EventSet::IN, pace)?;
            }
            h.register_listener(fd.as_raw_fd(), EventSet::IN, id)?;
            fd.write(1)?;
        }
        Ok(())
    }

    /// The calls a device start owes queue pair `pair` (`Port::owes`), paid once a
    /// queue has its call fd (`handle_event` pays them at every event). Looked at
    /// when the worker is woken (`Port::wake_workers`: a request that may start a
    /// ring went to the vhost crate, which handles it a moment later) and again by
    /// the pair's own timer, 1 ms after and doubling, until nothing is owed or
    /// `OWED_LOOKS` looks found no call fd. The vhost crate runs a queue's handler
    /// once as it starts (the owed kick), but a frontend may send the call fd after
    /// that (QEMU does when the guest unmasks the queue's vector): a guest whose
    /// completions were lost with an earlier gsonet, and that kicks no more, is
    /// called all the same.
    fn owed_look(&self, pair: usize, woken: bool) {
        let Some(o) = self.owed.get(pair) else {
            return;
        };
        // Woken, a look follows even with nothing owed yet: the request that woke
        // the worker may be the start itself, not handled by the crate yet.
        let looks = if woken { 0 } else { o.looks.load(Relaxed) };
        if !woken && (!self.port.owes(pair) || looks >= OWED_LOOKS) {
            return;
        }
        if o.timer
            .arm(Duration::from_millis(1 << looks.min(7)))
            .is_ok()
        {
            o.looks.store(looks + 1, Relaxed);
        }
    }

    /// Drains TX queue `pair`; when the drain leaves the guest's kicks off to poll, arms
    /// the worker's timer so the queue is looked at again after `tx_poll_us` (a queue
    /// held for its `rate=` has the timer armed by the drain).
    fn drain_tx(&self, pair: usize, txq: &Vring) {
        let Some(w) = self.workers.get(pair) else {
            return;
        };
        let Some(_gate) = self.port.tx_gate() else {
            return;
        };
        let us = self.port.cfg.tx_poll_us;
        let mut w = w.lock().unwrap_or_else(|e| e.into_inner());
        let end = tx::drain(&self.port, &self.switch, pair, txq, &mut w, us > 0);
        if end == DrainEnd::Poll {
            let after = Duration::from_micros(u64::from(us));
            if w.timer.as_ref().is_none_or(|t| t.arm(after).is_err()) {
                // Without the timer nothing would look at the queue again.
                self.port.kicks_on(txq);
            }
        }
    }
}

impl VhostUserBackend for PortBackend {
    type Bitmap = crate::ring::guest_mem::DirtyLog;
    type Vring = Vring;

    fn num_queues(&self) -> usize {
        self.port.queue_pairs() * 2
    }

    fn max_queue_size(&self) -> usize {
        1024
    }

    fn features(&self) -> u64 {
        self.port.offered()
    }

    fn acked_features(&self, acked: u64) {
        let neg = Negotiated::from_acked(acked);
        // A guest can reset its device in a loop: the line is rate-limited per port.
        if let Some(quiet) = self.port.log.allow() {
            info!(port = %self.port.name(), acked = format_args!("{acked:#x}"), rx = ?neg.rx, tx = ?neg.tx, suppressed = quiet, "guest acked features");
        }
        if !neg.log_all {
            // Logging off (never on, or a migration ended or was cancelled): the vhost
            // crate keeps marking pages once a log was set, so the port stops it.
            self.port.stop_logging();
        }
        self.port.set_negotiated(neg);
        self.switch.caps_changed();
    }

    fn protocol_features(&self) -> VhostUserProtocolFeatures {
        PROTOCOL_FEATURES
    }

    fn set_event_idx(&self, _enabled: bool) {}

    fn get_config(&self, offset: u32, size: u32) -> Vec<u8> {
        // struct virtio_net_config: mac[6], status, max_virtqueue_pairs, mtu.
        let mut cfg = Vec::with_capacity(12);
        cfg.extend_from_slice(&self.port.cfg.mac.map(|m| m.0).unwrap_or_default());
        cfg.extend_from_slice(&1u16.to_le_bytes()); // VIRTIO_NET_S_LINK_UP
        cfg.extend_from_slice(&(self.port.queue_pairs() as u16).to_le_bytes());
        cfg.extend_from_slice(&self.port.cfg.mtu.to_le_bytes());
        let start = (offset as usize).min(cfg.len());
        let end = (offset as usize)
            .saturating_add(size as usize)
            .min(cfg.len());
        let mut out = cfg[start..end].to_vec();
        out.resize(size as usize, 0);
        out
    }

    /// GET_VRING_BASE, the ring already marked not ready: no frame is written into
    /// it from here on, so the used entries written since the relay's `publish_rx`
    /// (a sender's batch that got in between) are published now, before the reply
    /// after which the frontend reads the used index as final.
    fn stop_vring(&self, queue_index: u32) -> io::Result<()> {
        if queue_index.is_multiple_of(2) {
            self.port.publish_rx_queue(queue_index as usize / 2);
        }
        Ok(())
    }

    /// SET_MEM_TABLE, ADD_MEM_REG, REM_MEM_REG: the crate replies once this returns,
    /// and `set_mem` returns once no pass uses the memory as it was.
    fn update_memory(&self, mem: Mem) -> io::Result<()> {
        self.port.set_mem(mem);
        Ok(())
    }

    fn queues_per_thread(&self) -> Vec<u64> {
        (0..self.port.queue_pairs())
            .map(|i| 0b11u64 << (2 * i))
            .collect()
    }

    fn exit_event(&self, thread_index: usize) -> Option<(EventConsumer, EventNotifier)> {
        let (c, n) = self.exits.get(thread_index)?;
        Some((c.try_clone().ok()?, n.try_clone().ok()?))
    }

    fn handle_event(
        &self,
        device_event: u16,
        _evset: EventSet,
        vrings: &[Vring],
        thread_id: usize,
    ) -> io::Result<()> {
        // Each worker owns one pair: vrings[0] is its RX queue, vrings[1] its TX queue.
        let pair = thread_id;
        if let Some(rxq) = vrings.first() {
            self.port.remember_rx(pair, rxq);
        }
        for (i, v) in vrings.iter().enumerate().take(2) {
            self.port.pay_owed_call(2 * pair + i, v);
        }
        match device_event {
            0 => {
                // The guest added RX buffers; uplink readers waiting for room retry.
                // Its next refills need no kick until the queue runs out again
                // (`Port::receive` turns kicks back on then).
                if let Some(rxq) = vrings.first() {
                    self.port.kicks_off(rxq);
                }
                self.port.stats.rx_kicks.fetch_add(1, Relaxed);
                self.port.rx_refilled();
                self.switch.rx_space();
                Ok(())
            }
            1 => {
                self.port.stats.tx_kicks.fetch_add(1, Relaxed);
                if let Some(txq) = vrings.get(1) {
                    self.drain_tx(pair, txq);
                }
                Ok(())
            }
            e if e as u64 == pace_id(self.port.queue_pairs()) => {
                self.port.pace_fired(pair);
                Ok(())
            }
            e if e as u64 == tx_completion_id(self.port.queue_pairs()) => {
                let (Some(w), Some(txq)) = (self.workers.get(pair), vrings.get(1)) else {
                    return Ok(());
                };
                let gate = self.port.tx_gate();
                let mut w = w.lock().unwrap_or_else(|e| e.into_inner());
                // After a clean stop the expiry is only consumed.
                w.completion.fired(&self.port, txq, gate.is_some());
                Ok(())
            }
            e if e as u64 == rx_coalesce_id(self.port.queue_pairs()) => {
                self.port.rx_coalesce_fired(pair);
                Ok(())
            }
            e if e as u64 == tx_timer_id(self.port.queue_pairs()) => {
                if let Some(w) = self.workers.get(pair) {
                    if let Some(t) = &w.lock().unwrap_or_else(|e| e.into_inner()).timer {
                        // Consume the expiry (non-blocking: a kick may have re-armed it).
                        t.clear();
                    }
                }
                self.port.stats.tx_polls.fetch_add(1, Relaxed);
                if let Some(txq) = vrings.get(1) {
                    self.drain_tx(pair, txq);
                }
                Ok(())
            }
            e if e as u64 == hello_id(self.port.queue_pairs()) => {
                // The vrings are remembered and owed calls paid above; consume the
                // event, and look again later if a call fd has not come yet.
                if let Some(fd) = self.hellos.get(pair) {
                    let _ = fd.read();
                }
                self.owed_look(pair, true);
                Ok(())
            }
            e if e as u64 == owed_id(self.port.queue_pairs()) => {
                if let Some(o) = self.owed.get(pair) {
                    o.timer.clear();
                }
                self.owed_look(pair, false);
                Ok(())
            }
            _ => Ok(()),
        }
    }
}

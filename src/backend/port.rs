//! A vhost-user port: one guest's virtio-net device. Implements `VhostUserBackend`
//! with a lock per queue (no lock around the whole backend): each queue pair has its
//! own worker thread, and other threads write into this port's RX queues under that
//! queue's lock only.

use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use std::os::fd::AsRawFd;
use tracing::{debug, info, warn};
use vhost::vhost_user::message::VhostUserProtocolFeatures;
use vhost_user_backend::{VhostUserBackend, VringRwLock, VringT};
use virtio_queue::QueueT;
use vm_memory::{GuestAddressSpace, GuestMemoryAtomic};
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::event::{
    new_event_consumer_and_notifier, EventConsumer, EventFlag, EventNotifier,
};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use super::deliver::{DeliverCtx, Frame};
use super::stats::Counters;
use super::switch::{Endpoint, Switch};
use crate::config::PortConfig;
use crate::features::{self, Negotiated};
use crate::ring::rx::{self, RxError, RxScratch};
use crate::ring::tx;
use crate::ring::GuestMem;
use crate::vnet_hdr::{self, VirtioNetHdr};

pub type Mem = GuestMemoryAtomic<GuestMem>;
pub type Vring = VringRwLock<Mem>;

/// How long a guest may keep its RX queue full before senders stop waiting for it.
pub const RX_STALL: Duration = Duration::from_millis(200);

/// How many TX chains one pass handles before signalling the guest.
const TX_BATCH: usize = 256;

/// One RX queue as other threads see it: the vring (known once its worker ran) and
/// scratch space, behind the queue's own lock.
#[derive(Default)]
struct RxSlot {
    vring: Option<Vring>,
    scratch: RxScratch,
}

/// State shared by the port's workers, the switch, and the uplink readers.
pub struct Port {
    pub id: usize,
    pub cfg: PortConfig,
    /// The operator's mask and the offer it gives.
    offer: RwLock<(crate::features::FeatureMask, u64)>,
    negotiated: RwLock<Option<Negotiated>>,
    mem: RwLock<Option<Mem>>,
    rx: Vec<Mutex<RxSlot>>,
    connected: AtomicBool,
    /// When its RX queue was first found full, in ms on `epoch` (0: not full).
    rx_full_since: AtomicU64,
    epoch: Instant,
    /// Runtime `max_burst` (0: none), changed with `gsonet ctl`.
    max_burst: AtomicUsize,
    pub stats: Counters,
}

impl Port {
    pub fn new(id: usize, cfg: PortConfig) -> Port {
        let pairs = cfg.queues as usize;
        Port {
            id,
            offer: RwLock::new((cfg.mask, features::offer(&cfg.mask, cfg.queues))),
            negotiated: RwLock::new(None),
            mem: RwLock::new(None),
            rx: (0..pairs).map(|_| Mutex::new(RxSlot::default())).collect(),
            connected: AtomicBool::new(false),
            max_burst: AtomicUsize::new(cfg.max_burst.unwrap_or(0)),
            rx_full_since: AtomicU64::new(0),
            epoch: Instant::now(),
            stats: Counters::default(),
            cfg,
        }
    }

    pub fn max_burst(&self) -> Option<usize> {
        Some(self.max_burst.load(Ordering::Relaxed)).filter(|&b| b > 0)
    }

    pub fn set_max_burst(&self, b: Option<usize>) {
        self.max_burst.store(b.unwrap_or(0), Ordering::Relaxed);
    }

    pub fn name(&self) -> String {
        self.cfg.name()
    }

    pub fn queue_pairs(&self) -> usize {
        self.rx.len()
    }

    pub fn offered(&self) -> u64 {
        self.offer.read().unwrap_or_else(|e| e.into_inner()).1
    }

    pub fn mask(&self) -> crate::features::FeatureMask {
        self.offer.read().unwrap_or_else(|e| e.into_inner()).0
    }

    /// Re-computes the offer after a mask change. It takes effect with the next
    /// frontend connection: QEMU asks a backend for its features once per connection
    /// and keeps them across guest reboots and driver reloads.
    pub fn set_mask(&self, mask: crate::features::FeatureMask) {
        *self.offer.write().unwrap_or_else(|e| e.into_inner()) =
            (mask, features::offer(&mask, self.cfg.queues));
    }

    pub fn negotiated(&self) -> Option<Negotiated> {
        *self.negotiated.read().unwrap_or_else(|e| e.into_inner())
    }

    pub fn is_connected(&self) -> bool {
        self.connected.load(Ordering::Acquire)
    }

    pub fn set_connected(&self, up: bool) {
        self.connected.store(up, Ordering::Release);
        if !up {
            *self.negotiated.write().unwrap_or_else(|e| e.into_inner()) = None;
            *self.mem.write().unwrap_or_else(|e| e.into_inner()) = None;
            for slot in &self.rx {
                if let Ok(mut s) = slot.lock() {
                    s.vring = None;
                }
            }
        }
    }

    /// Whether every RX queue's vring is known (see `PortBackend::introduce_workers`).
    pub fn rx_known(&self) -> bool {
        self.rx
            .iter()
            .all(|s| s.lock().map(|s| s.vring.is_some()).unwrap_or(false))
    }

    fn remember_rx(&self, pair: usize, vring: &Vring) {
        if let Some(slot) = self.rx.get(pair) {
            if let Ok(mut s) = slot.lock() {
                if s.vring.is_none() {
                    s.vring = Some(vring.clone());
                }
            }
        }
    }

    /// Writes one frame into RX queue `pair` (modulo the pairs this port has).
    /// The caller signals the guest later, once per batch (`DeliverCtx::flush`).
    pub fn receive(&self, pair: usize, hdr: &VirtioNetHdr, parts: &[&[u8]]) -> Result<(), RxError> {
        let Some(neg) = self.negotiated() else {
            return Err(RxError::NoBuffers);
        };
        let mem = match &*self.mem.read().unwrap_or_else(|e| e.into_inner()) {
            Some(m) => m.memory(),
            None => return Err(RxError::NoBuffers),
        };
        let pair = pair % self.rx.len();
        let mut slot = self.rx[pair].lock().unwrap_or_else(|e| e.into_inner());
        let RxSlot { vring, scratch } = &mut *slot;
        let Some(vring) = vring else {
            return Err(RxError::NoBuffers);
        };
        let mut state = vring.get_mut();
        if !state.get_queue().ready() || !state.is_enabled() {
            return Err(RxError::NoBuffers);
        }
        let r = rx::write_frame(
            state.get_queue_mut(),
            &mem,
            scratch,
            hdr,
            neg.hdr_len(),
            parts,
            neg.mrg_rxbuf,
        );
        if r == Err(RxError::NoBuffers) && neg.event_idx {
            // Ask the guest to kick when it adds buffers (avail_event = next_avail).
            let _ = state.enable_notification();
        }
        match r {
            Ok(_) => self.rx_full_since.store(0, Ordering::Relaxed),
            Err(RxError::NoBuffers) => {
                let now = self.clock_ms().max(1);
                let _ = self.rx_full_since.compare_exchange(
                    0,
                    now,
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                );
            }
            Err(_) => {}
        }
        r.map(|_| ())
    }

    fn clock_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    /// The guest has let its RX queue stay full for `RX_STALL` or more: senders that
    /// could wait for room (uplink readers) should not, so one guest that stops
    /// reading cannot hold up traffic for the others.
    pub fn rx_stalled(&self) -> bool {
        let since = self.rx_full_since.load(Ordering::Relaxed);
        since != 0 && self.clock_ms().saturating_sub(since) >= RX_STALL.as_millis() as u64
    }

    /// The guest added RX buffers.
    pub fn rx_refilled(&self) {
        self.rx_full_since.store(0, Ordering::Relaxed);
    }

    /// Signals the guest for RX queue `pair` if the ring says it wants it.
    pub fn signal_rx(&self, pair: usize) {
        let slot = self.rx[pair % self.rx.len()]
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if let Some(v) = &slot.vring {
            if v.needs_notification().unwrap_or(true) {
                let _ = v.signal_used_queue();
            }
        }
    }
}

/// The `VhostUserBackend` of one port.
#[derive(Clone)]
pub struct PortBackend {
    port: Arc<Port>,
    switch: Arc<Switch>,
    exits: Arc<Vec<(EventConsumer, EventNotifier)>>,
    /// One per worker: signalled once at start so each worker hands its vrings to the
    /// port before the guest kicks anything (see `introduce_workers`).
    hellos: Arc<Vec<EventFd>>,
}

/// Listener id of the start-up event, past the queue and exit ids.
fn hello_id(queue_pairs: usize) -> u64 {
    queue_pairs as u64 * 2 + 1
}

impl PortBackend {
    pub fn new(port: Arc<Port>, switch: Arc<Switch>) -> io::Result<PortBackend> {
        let exits = (0..port.queue_pairs())
            .map(|_| new_event_consumer_and_notifier(EventFlag::NONBLOCK))
            .collect::<io::Result<Vec<_>>>()?;
        let hellos = (0..port.queue_pairs())
            .map(|_| EventFd::new(EFD_NONBLOCK))
            .collect::<io::Result<Vec<_>>>()?;
        Ok(PortBackend {
            port,
            switch,
            exits: Arc::new(exits),
            hellos: Arc::new(hellos),
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
        for (h, fd) in handlers.iter().zip(self.hellos.iter()) {
            h.register_listener(fd.as_raw_fd(), EventSet::IN, id)?;
            fd.write(1)?;
        }
        Ok(())
    }

    pub fn port(&self) -> &Arc<Port> {
        &self.port
    }

    /// Drains the TX queue of `pair`: every chain becomes a frame for the switch.
    fn process_tx(&self, pair: usize, txq: &Vring) -> io::Result<()> {
        let Some(mem) = self
            .port
            .mem
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .map(|m| m.memory())
        else {
            return Ok(());
        };
        let neg = self.port.negotiated().unwrap_or_default();
        let port = &self.port;
        DeliverCtx::with(|ctx| {
            loop {
                let _ = txq.disable_notification();
                let mut done = 0;
                while done < TX_BATCH {
                    let (chain, qsize) = {
                        let mut st = txq.get_mut();
                        let q = st.get_queue_mut();
                        (q.pop_descriptor_chain(&*mem), q.size())
                    };
                    let Some(chain) = chain else { break };
                    let head = chain.head_index();
                    match tx::read_chain(&mem, chain, neg.hdr_len(), qsize as usize) {
                        Ok(f) => {
                            port.stats.tx(f.len);
                            let mut head = [0u8; tx::PRIVATE_HEAD];
                            let parts = tx::private_head(&f.parts, &mut head);
                            if let Err(reason) = check_tx(&neg, &f.hdr, &parts) {
                                port.stats.drop(reason);
                            } else {
                                let frame = Frame {
                                    hdr: f.hdr,
                                    parts: &parts,
                                    len: f.len,
                                };
                                self.switch
                                    .forward(Endpoint::Port(port.id), pair, &frame, ctx);
                            }
                        }
                        Err(e) => {
                            debug!(port = %port.name(), "dropping TX chain: {e}");
                            port.stats.drop(e.reason());
                        }
                    }
                    if let Err(e) = txq.add_used(head, 0) {
                        warn!(port = %port.name(), "add_used on TX failed: {e}");
                    }
                    done += 1;
                }
                if done > 0 && txq.needs_notification().unwrap_or(true) {
                    let _ = txq.signal_used_queue();
                }
                ctx.flush();
                if done == TX_BATCH {
                    continue;
                }
                match txq.enable_notification() {
                    Ok(true) => continue, // more arrived while notifications were off
                    _ => break,
                }
            }
        });
        Ok(())
    }
}

/// Checks a TX frame against what this guest negotiated and the header rules.
fn check_tx(neg: &Negotiated, hdr: &VirtioNetHdr, parts: &[&[u8]]) -> Result<(), &'static str> {
    if hdr.gso.is_gso() && !neg.tx.accepts(hdr.gso) {
        return Err("gso_not_negotiated");
    }
    if hdr.needs_csum() && !neg.tx.csum {
        return Err("csum_not_negotiated");
    }
    vnet_hdr::validate(hdr, parts)
        .map(|_| ())
        .map_err(|e| e.reason())
}

impl VhostUserBackend for PortBackend {
    type Bitmap = ();
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
        info!(port = %self.port.name(), acked = format_args!("{acked:#x}"), rx = ?neg.rx, tx = ?neg.tx, "guest acked features");
        *self
            .port
            .negotiated
            .write()
            .unwrap_or_else(|e| e.into_inner()) = Some(neg);
        self.port.connected.store(true, Ordering::Release);
        self.switch.caps_changed();
    }

    fn protocol_features(&self) -> VhostUserProtocolFeatures {
        VhostUserProtocolFeatures::MQ | VhostUserProtocolFeatures::REPLY_ACK
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

    fn update_memory(&self, mem: Mem) -> io::Result<()> {
        *self.port.mem.write().unwrap_or_else(|e| e.into_inner()) = Some(mem);
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
        match device_event {
            0 => {
                // The guest added RX buffers; uplink readers waiting for room retry.
                self.port.rx_refilled();
                self.switch.rx_space(self.port.id);
                Ok(())
            }
            1 => match vrings.get(1) {
                Some(txq) => self.process_tx(pair, txq),
                None => Ok(()),
            },
            e if e as u64 == hello_id(self.port.queue_pairs()) => {
                // The vrings are remembered above; consume the event.
                if let Some(fd) = self.hellos.get(pair) {
                    let _ = fd.read();
                }
                Ok(())
            }
            _ => Ok(()),
        }
    }
}

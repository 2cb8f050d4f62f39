//! `DeviceUplink`: an uplink over any `UplinkDevice`. It is a destination for the
//! switch (one writev per frame, vnet header first) and keeps the operator's
//! settings (`gso=`, `max_burst=`) and the counters.

use std::io;
use std::os::fd::BorrowedFd;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Arc, Mutex, OnceLock, RwLock};

use tracing::info;

use super::packet::{PacketError, PacketSocket};
use super::queue::{Doorbell, Home, QueueSlot, RoomBell};
use super::tap::{Tap, TapError, TapOptions};
use super::{Uplink, UplinkDevice};
use crate::backend::ratelimit::{ByteRate, RateAdmit};
use crate::backend::switch::deliver::Destination;
use crate::backend::switch::write_batch::WireHdr;
use crate::backend::switch::SwitchUplink;
use crate::config::{GsoMode, RateLimit, UplinkConfig};
use crate::features::Caps;
use crate::stats::{Counters, DropReason};
use crate::vnet_hdr::VirtioNetHdr;

/// An uplink over a device: its settings and counters.
pub struct DeviceUplink<D: UplinkDevice> {
    pub(super) dev: D,
    cfg: RwLock<UplinkConfig>,
    pub(super) stats: Counters,
    /// `rate=`: what it may send into gsonet (changed with `gsonet ctl`).
    rate: RwLock<Option<ByteRate>>,
    /// `rx_rate=`: what gsonet may send into it.
    rx_rate: RwLock<Option<ByteRate>>,
    /// Per device queue: the state of reading it and who serves it.
    pub(super) queues: Vec<QueueSlot>,
    /// Where the readers forward to, once they started.
    pub(super) home: OnceLock<Home>,
}

fn bucket(r: Option<RateLimit>) -> Option<ByteRate> {
    r.map(|r| ByteRate::new(r.mbit, r.burst_kb))
}

/// A tap device gsonet creates (or reattaches to).
pub type TapUplink = DeviceUplink<Tap>;
/// An existing interface through AF_PACKET.
pub type PacketUplink = DeviceUplink<PacketSocket>;

impl TapUplink {
    pub fn open(cfg: &UplinkConfig, name: &str) -> Result<TapUplink, TapError> {
        let opts = TapOptions {
            mac: cfg.mac,
            persist: cfg.persist,
        };
        let tap = Tap::open(name, cfg.queues.unwrap_or(1) as usize, opts)?;
        info!(
            tap = name,
            queues = tap.queues(),
            persist = cfg.persist,
            reattached = tap.reattached(),
            "tap uplink ready"
        );
        Ok(DeviceUplink::new(tap, cfg))
    }
}

impl PacketUplink {
    pub fn open(cfg: &UplinkConfig, name: &str, bypass: bool) -> Result<PacketUplink, PacketError> {
        let sock = PacketSocket::open(name, cfg.queues.unwrap_or(1) as usize, bypass)?;
        info!(
            dev = name,
            queues = sock.queues(),
            vnet_hdr = sock.hdr_len(),
            qdisc_bypass = bypass,
            "packet uplink ready"
        );
        Ok(DeviceUplink::new(sock, cfg))
    }
}

impl<D: UplinkDevice> DeviceUplink<D> {
    pub fn new(dev: D, cfg: &UplinkConfig) -> DeviceUplink<D> {
        DeviceUplink {
            cfg: RwLock::new(cfg.clone()),
            stats: Counters::default(),
            rate: RwLock::new(bucket(cfg.rate)),
            rx_rate: RwLock::new(bucket(cfg.rx_rate)),
            queues: (0..dev.queues())
                .map(|_| QueueSlot {
                    reader: Mutex::default(),
                    owned: AtomicBool::new(false),
                    wake: Doorbell::new().ok(),
                    room: RoomBell::new().ok().map(Arc::new),
                    sender_reads: AtomicU64::new(0),
                })
                .collect(),
            home: OnceLock::new(),
            dev,
        }
    }

    /// Whether a frame of `wire` bytes read from it may go on under its `rate=`
    /// (charged if so); over the limit it is dropped at the tail.
    pub(super) fn admit(&self, wire: usize) -> bool {
        let rate = self.rate.read().unwrap_or_else(|e| e.into_inner());
        rate.as_ref().is_none_or(|r| {
            r.admit_at(wire as u64, std::time::Instant::now(), false) == RateAdmit::Now
        })
    }

    /// The header the device takes in front of a frame sent with `hdr`.
    fn wire_hdr(&self, hdr: &VirtioNetHdr) -> WireHdr {
        let mut h = *hdr;
        h.num_buffers = 0;
        WireHdr {
            bytes: h.to_bytes(),
            len: self.dev.hdr_len(),
        }
    }

    /// `f` of the configuration as it is, read in place: the switch asks for the
    /// GSO mode and burst of every frame, and a clone would copy the tap's name.
    fn with_cfg<T>(&self, f: impl FnOnce(&UplinkConfig) -> T) -> T {
        f(&self.cfg.read().unwrap_or_else(|e| e.into_inner()))
    }
}

impl<D: UplinkDevice> Destination for DeviceUplink<D> {
    fn caps(&self) -> Caps {
        match self.with_cfg(|c| c.gso) {
            GsoMode::Pass => Caps::ALL,
            // Segment here; the kernel still finishes partial checksums.
            GsoMode::Software => Caps {
                csum: true,
                ..Caps::default()
            },
        }
    }

    fn max_burst(&self) -> Option<usize> {
        self.with_cfg(|c| c.max_burst)
    }

    fn rx_rate(&self, wire: usize, may_wait: bool) -> RateAdmit {
        let r = self.rx_rate.read().unwrap_or_else(|e| e.into_inner());
        r.as_ref().map_or(RateAdmit::Now, |r| {
            r.admit_at(wire as u64, std::time::Instant::now(), may_wait)
        })
    }

    fn send(&self, queue: usize, hdr: &VirtioNetHdr, parts: &[&[u8]]) -> Result<(), DropReason> {
        let wire = self.wire_hdr(hdr);
        let mut iov: Vec<&[u8]> = Vec::with_capacity(parts.len() + 1);
        iov.push(&wire.bytes[..wire.len]);
        iov.extend_from_slice(parts);
        match self.dev.send(queue, &iov) {
            Ok(_) => Ok(()),
            Err(e) => Err(DropReason::of_uplink_write(&e)),
        }
    }

    fn stats(&self) -> &Counters {
        &self.stats
    }
}

impl<D: UplinkDevice> SwitchUplink for DeviceUplink<D> {
    fn name(&self) -> String {
        self.dev.name()
    }

    fn set_rx_offload(&self, caps: Caps) -> Result<Caps, String> {
        self.dev.set_offload(caps)
    }

    fn batched_header(&self, hdr: &VirtioNetHdr) -> Option<WireHdr> {
        self.dev.batchable().then(|| self.wire_hdr(hdr))
    }

    fn reap(&self, queue: usize) {
        self.reap_queue(queue);
    }

    fn own(&self, queue: usize) -> bool {
        self.own_queue(queue)
    }

    fn queue_fd(&self, queue: usize) -> Option<BorrowedFd<'_>> {
        (queue < self.dev.queues()).then(|| self.dev.fd(queue))
    }

    fn serve(&self, queue: usize) -> bool {
        self.serve_queue(queue)
    }

    fn disown(&self, queue: usize) {
        self.disown_queue(queue);
    }
}

impl<D: UplinkDevice> Uplink for DeviceUplink<D> {
    fn counters(&self) -> &Counters {
        &self.stats
    }

    fn gso_mode(&self) -> GsoMode {
        self.with_cfg(|c| c.gso)
    }

    fn set_gso_mode(&self, mode: GsoMode) {
        self.cfg.write().unwrap_or_else(|e| e.into_inner()).gso = mode;
    }

    fn set_max_burst(&self, max: Option<usize>) {
        self.cfg
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .max_burst = max;
    }

    fn release(&self) -> io::Result<()> {
        self.dev.release()
    }

    fn rates(&self) -> (Option<RateLimit>, Option<RateLimit>) {
        self.with_cfg(|c| (c.rate, c.rx_rate))
    }

    fn set_rate(&self, r: Option<RateLimit>) {
        self.cfg.write().unwrap_or_else(|e| e.into_inner()).rate = r;
        *self.rate.write().unwrap_or_else(|e| e.into_inner()) = bucket(r);
    }

    fn set_rx_rate(&self, r: Option<RateLimit>) {
        self.cfg.write().unwrap_or_else(|e| e.into_inner()).rx_rate = r;
        *self.rx_rate.write().unwrap_or_else(|e| e.into_inner()) = bucket(r);
    }
}

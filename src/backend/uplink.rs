//! Uplinks: host-side endpoints of the switch. A tap device (vnet headers, offloads
//! programmed from what the guests accept) with one reader thread per queue.

use std::io;
use std::sync::{Arc, RwLock};
use std::thread;
use std::time::{Duration, Instant};

use tracing::{debug, error, info};

use super::deliver::{DeliverCtx, Destination, Frame, Path, Pending, RX_FULL};
use super::stats::Counters;
use super::switch::{Endpoint, Switch};
use super::tap::{Tap, TapError};
use crate::config::{GsoMode, UplinkConfig};
use crate::features::Caps;
use crate::vnet_hdr::{VirtioNetHdr, HDR_LEN};

/// How long an uplink reader holds a frame for a guest whose RX queue is full.
const RX_FULL_PATIENCE: Duration = Duration::from_millis(200);
/// Frames read from one queue before pending guest signals are flushed.
const RX_BATCH: usize = 64;

pub trait Uplink: Send + Sync {
    fn name(&self) -> String;
    fn as_destination(&self) -> &dyn Destination;
    /// Tells the device which offloads the guests behind it accept, so it hands us
    /// frames no larger than needed.
    fn set_rx_offload(&self, caps: Caps) -> Result<Caps, String>;
    fn stats(&self) -> &Counters;
    fn gso_mode(&self) -> GsoMode;
    fn set_gso_mode(&self, mode: GsoMode);
    fn set_max_burst(&self, max: Option<usize>);
    /// Starts the reader threads; `id` is this uplink's index in the switch.
    fn start(self: Arc<Self>, id: usize, switch: Arc<Switch>) -> io::Result<()>;
}

pub struct TapUplink {
    tap: Tap,
    cfg: RwLock<UplinkConfig>,
    stats: Counters,
}

impl TapUplink {
    pub fn open(cfg: &UplinkConfig, name: &str) -> Result<TapUplink, TapError> {
        let tap = Tap::open(name, cfg.queues as usize)?;
        info!(tap = name, queues = tap.queues(), "tap uplink ready");
        Ok(TapUplink {
            tap,
            cfg: RwLock::new(cfg.clone()),
            stats: Counters::default(),
        })
    }

    fn cfg(&self) -> UplinkConfig {
        self.cfg.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    fn read_loop(&self, id: usize, queue: usize, switch: &Switch) {
        let mut buf = vec![0u8; HDR_LEN + 65535 + 64];
        let fd = self.tap.fd(queue);
        DeliverCtx::with(|ctx| {
            ctx.defer_full = true;
            loop {
                let mut pfd = libc::pollfd {
                    fd,
                    events: libc::POLLIN,
                    revents: 0,
                };
                // SAFETY: one valid pollfd.
                let r = unsafe { libc::poll(&mut pfd, 1, 1000) };
                if r < 0 && io::Error::last_os_error().kind() != io::ErrorKind::Interrupted {
                    error!(tap = %self.tap.name(), "poll failed: {}", io::Error::last_os_error());
                    return;
                }
                for _ in 0..RX_BATCH {
                    let n = match self.tap.read(queue, &mut buf) {
                        Ok(n) => n,
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                        Err(e) => {
                            debug!(tap = %self.tap.name(), "read: {e}");
                            self.stats.drop("uplink_read_error");
                            break;
                        }
                    };
                    self.handle_frame(id, queue, &buf[..n], switch, ctx);
                }
                ctx.flush();
            }
        });
    }

    fn handle_frame(
        &self,
        id: usize,
        queue: usize,
        bytes: &[u8],
        switch: &Switch,
        ctx: &mut DeliverCtx,
    ) {
        if bytes.len() < HDR_LEN + 14 {
            self.stats.drop("too_short");
            return;
        }
        let hdr = match VirtioNetHdr::from_bytes(&bytes[..HDR_LEN]) {
            Ok(h) => h,
            Err(_) => {
                self.stats.drop("bad_header");
                return;
            }
        };
        let parts = [&bytes[HDR_LEN..]];
        let frame = Frame {
            hdr,
            parts: &parts,
            len: bytes.len() - HDR_LEN,
        };
        self.stats.tx(frame.len);
        let deadline = Instant::now() + RX_FULL_PATIENCE;
        loop {
            let gen = switch.rx_generation();
            match switch.forward(Endpoint::Uplink(id), queue, &frame, ctx) {
                Some(Path::Dropped(RX_FULL)) if Instant::now() < deadline => {
                    // Hold the frame until the guest adds buffers, as a NIC with
                    // flow control would; the tap queue absorbs what arrives meanwhile.
                    ctx.flush();
                    switch.wait_rx_space(gen, Duration::from_millis(10));
                }
                Some(Path::Dropped(RX_FULL)) => {
                    self.stats.drop(RX_FULL);
                    return;
                }
                _ => return,
            }
        }
    }
}

impl Destination for TapUplink {
    fn caps(&self) -> Caps {
        match self.cfg().gso {
            GsoMode::Pass => Caps::ALL,
            // Segment here; the kernel still finishes partial checksums.
            GsoMode::Software => Caps {
                csum: true,
                ..Caps::default()
            },
        }
    }

    fn max_burst(&self) -> Option<usize> {
        self.cfg().max_burst
    }

    fn send(
        &self,
        queue: usize,
        hdr: &VirtioNetHdr,
        parts: &[&[u8]],
        _: &mut Pending,
    ) -> Result<(), &'static str> {
        let mut h = *hdr;
        h.num_buffers = 0;
        let hb = h.to_bytes();
        let mut iov: Vec<&[u8]> = Vec::with_capacity(parts.len() + 1);
        iov.push(&hb);
        iov.extend_from_slice(parts);
        match self.tap.write(queue, &iov) {
            Ok(_) => Ok(()),
            Err(e) => match e.raw_os_error() {
                Some(libc::EINVAL) => Err("uplink_rejected"),
                Some(libc::EAGAIN) => Err("uplink_busy"),
                _ => Err("uplink_error"),
            },
        }
    }

    fn stats(&self) -> &Counters {
        &self.stats
    }
}

impl Uplink for TapUplink {
    fn name(&self) -> String {
        format!("tap={}", self.tap.name())
    }

    fn as_destination(&self) -> &dyn Destination {
        self
    }

    fn set_rx_offload(&self, caps: Caps) -> Result<Caps, String> {
        self.tap.set_offload(caps).map_err(|e| e.to_string())
    }

    fn stats(&self) -> &Counters {
        &self.stats
    }

    fn gso_mode(&self) -> GsoMode {
        self.cfg().gso
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

    fn start(self: Arc<Self>, id: usize, switch: Arc<Switch>) -> io::Result<()> {
        for q in 0..self.tap.queues() {
            let me = self.clone();
            let sw = switch.clone();
            thread::Builder::new()
                .name(format!("tap{q}-rx"))
                .spawn(move || me.read_loop(id, q, &sw))?;
        }
        Ok(())
    }
}

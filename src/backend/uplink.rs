//! Uplinks: host-side endpoints of the switch. Two kinds of device carry frames with a
//! virtio_net_hdr in front: a tap (`tap.rs`) and an existing interface through an
//! AF_PACKET socket (`packet.rs`). Everything above the device — the reader loop,
//! header parsing, forwarding with flow control, and building the iovec for a send —
//! lives here once, in `DeviceUplink`.

use std::io;
use std::os::fd::RawFd;
use std::sync::{Arc, RwLock};
use std::thread;
use std::time::{Duration, Instant};

use tracing::{debug, error, info};

use super::deliver::{DeliverCtx, Destination, Frame, Path, Pending, RX_FULL};
use super::packet::{PacketError, PacketSocket};
use super::stats::Counters;
use super::switch::{Endpoint, Switch};
use super::tap::{Tap, TapError};
use crate::config::{GsoMode, UplinkConfig};
use crate::features::Caps;
use crate::vnet_hdr::{VirtioNetHdr, HDR_LEN};

/// How long an uplink reader holds a frame for a guest whose RX queue is full.
const RX_FULL_PATIENCE: Duration = super::port::RX_STALL;
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

/// What `DeviceUplink` needs from a device: per-queue fds that read and write one
/// frame at a time, each preceded by a virtio_net_hdr of `hdr_len()` bytes.
pub trait UplinkDevice: Send + Sync + 'static {
    /// `kind=NAME`, as on the command line.
    fn name(&self) -> String;
    /// Short prefix for thread names ("tap", "pkt").
    fn thread_prefix(&self) -> &'static str;
    fn queues(&self) -> usize;
    fn fd(&self, queue: usize) -> RawFd;
    /// Length of the virtio_net_hdr in front of every frame: 12, or 10 for an
    /// AF_PACKET socket on a kernel without PACKET_VNET_HDR_SZ.
    fn hdr_len(&self) -> usize;
    /// Reads one frame (header first) into `buf` and says where in `buf` it lies.
    /// `Ok(None)`: a frame to skip (one we sent ourselves); `WouldBlock` when the
    /// queue is empty.
    fn recv(&self, queue: usize, buf: &mut [u8]) -> io::Result<Option<std::ops::Range<usize>>>;
    /// Writes one frame (header first) with a single writev.
    fn send(&self, queue: usize, iov: &[&[u8]]) -> io::Result<usize>;
    /// Tells the device which offloads the guests behind it accept.
    fn set_offload(&self, caps: Caps) -> Result<Caps, String>;
}

/// Writes `iov` to `fd` with one writev (tap and packet sockets alike).
pub fn writev(fd: RawFd, iov: &[&[u8]]) -> io::Result<usize> {
    let iovs: Vec<libc::iovec> = iov
        .iter()
        .map(|s| libc::iovec {
            iov_base: s.as_ptr() as *mut libc::c_void,
            iov_len: s.len(),
        })
        .collect();
    // SAFETY: every iovec points into a live slice for the duration of the call.
    let n = unsafe { libc::writev(fd, iovs.as_ptr(), iovs.len() as libc::c_int) };
    if n < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(n as usize)
    }
}

/// An uplink over any `UplinkDevice`: reader threads, the switch, and `Destination`.
pub struct DeviceUplink<D: UplinkDevice> {
    dev: D,
    cfg: RwLock<UplinkConfig>,
    stats: Counters,
}

/// A tap device gsonet creates.
pub type TapUplink = DeviceUplink<Tap>;
/// An existing interface through AF_PACKET.
pub type PacketUplink = DeviceUplink<PacketSocket>;

impl TapUplink {
    pub fn open(cfg: &UplinkConfig, name: &str) -> Result<TapUplink, TapError> {
        let tap = Tap::open(name, cfg.queues.unwrap_or(1) as usize)?;
        info!(tap = name, queues = tap.queues(), "tap uplink ready");
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
            dev,
            cfg: RwLock::new(cfg.clone()),
            stats: Counters::default(),
        }
    }

    pub fn device(&self) -> &D {
        &self.dev
    }

    fn cfg(&self) -> UplinkConfig {
        self.cfg.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    fn read_loop(&self, id: usize, queue: usize, switch: &Switch) {
        let mut buf = vec![0u8; HDR_LEN + 65535 + 64];
        let fd = self.dev.fd(queue);
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
                    error!(uplink = %self.dev.name(), "poll failed: {}", io::Error::last_os_error());
                    return;
                }
                for _ in 0..RX_BATCH {
                    let at = match self.dev.recv(queue, &mut buf) {
                        Ok(Some(at)) => at,
                        Ok(None) => continue,
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                        Err(e) if e.raw_os_error() == Some(libc::EMSGSIZE) => {
                            self.stats.drop("too_long");
                            continue;
                        }
                        Err(e) => {
                            debug!(uplink = %self.dev.name(), "read: {e}");
                            self.stats.drop("uplink_read_error");
                            break;
                        }
                    };
                    self.handle_frame(id, queue, &buf[at], switch, ctx);
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
        let hl = self.dev.hdr_len();
        if bytes.len() < hl + 14 {
            self.stats.drop("too_short");
            return;
        }
        // A 10-byte header is the 12-byte one without num_buffers.
        let mut raw = [0u8; HDR_LEN];
        raw[..hl].copy_from_slice(&bytes[..hl]);
        let hdr = match VirtioNetHdr::from_bytes(&raw) {
            Ok(h) => h,
            Err(_) => {
                self.stats.drop("bad_header");
                return;
            }
        };
        let parts = [&bytes[hl..]];
        let frame = Frame {
            hdr,
            parts: &parts,
            len: bytes.len() - hl,
        };
        self.stats.tx(frame.len);
        let deadline = Instant::now() + RX_FULL_PATIENCE;
        loop {
            let gen = switch.rx_generation();
            match switch.forward(Endpoint::Uplink(id), queue, &frame, ctx) {
                Some(Path::Dropped(RX_FULL)) if Instant::now() < deadline => {
                    // Hold the frame until the guest adds buffers, as a NIC with
                    // flow control would; the device queue absorbs what arrives meanwhile.
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

impl<D: UplinkDevice> Destination for DeviceUplink<D> {
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
        iov.push(&hb[..self.dev.hdr_len()]);
        iov.extend_from_slice(parts);
        match self.dev.send(queue, &iov) {
            Ok(_) => Ok(()),
            Err(e) => Err(send_error(&e)),
        }
    }

    fn stats(&self) -> &Counters {
        &self.stats
    }
}

/// The drop reason for a failed device write.
fn send_error(e: &io::Error) -> &'static str {
    match e.raw_os_error() {
        Some(libc::EINVAL) => "uplink_rejected",
        Some(libc::EAGAIN) | Some(libc::ENOBUFS) => "uplink_busy",
        Some(libc::EMSGSIZE) => "uplink_too_big",
        Some(libc::ENETDOWN) | Some(libc::ENXIO) => "uplink_down",
        _ => "uplink_error",
    }
}

impl<D: UplinkDevice> Uplink for DeviceUplink<D> {
    fn name(&self) -> String {
        self.dev.name()
    }

    fn as_destination(&self) -> &dyn Destination {
        self
    }

    fn set_rx_offload(&self, caps: Caps) -> Result<Caps, String> {
        self.dev.set_offload(caps)
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
        for q in 0..self.dev.queues() {
            let me = self.clone();
            let sw = switch.clone();
            thread::Builder::new()
                .name(format!("{}{q}-rx", self.dev.thread_prefix()))
                .spawn(move || me.read_loop(id, q, &sw))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn send_errors_have_reasons() {
        let r = |n| send_error(&io::Error::from_raw_os_error(n));
        assert_eq!(r(libc::EINVAL), "uplink_rejected");
        assert_eq!(r(libc::ENOBUFS), "uplink_busy");
        assert_eq!(r(libc::EAGAIN), "uplink_busy");
        assert_eq!(r(libc::EMSGSIZE), "uplink_too_big");
        assert_eq!(r(libc::EIO), "uplink_error");
    }
}

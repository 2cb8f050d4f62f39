//! Uplinks: host-side endpoints of the switch. Two kinds of device carry frames with a
//! virtio_net_hdr in front: a tap (`tap`) and an existing interface through an
//! AF_PACKET socket (`packet`). Everything above the device lives once in
//! `DeviceUplink` (`device`) and its reader threads (`reader`).

pub mod device;
pub mod packet;
pub mod queue;
pub mod reader;
pub mod tap;

use std::io;
use std::os::fd::BorrowedFd;

use crate::backend::switch::SwitchUplink;
use crate::config::{GsoMode, RateLimit};
use crate::features::Caps;
use crate::stats::Counters;

/// An uplink as the control socket sees it: the switch's view plus its settings.
pub trait Uplink: SwitchUplink {
    fn counters(&self) -> &Counters;
    fn gso_mode(&self) -> GsoMode;
    fn set_gso_mode(&self, mode: GsoMode);
    fn set_max_burst(&self, max: Option<usize>);
    /// `rate=` (what it sends into gsonet) and `rx_rate=` (what gsonet sends into it).
    fn rates(&self) -> (Option<RateLimit>, Option<RateLimit>);
    /// A new `rate=` (a fresh bucket), at once.
    fn set_rate(&self, r: Option<RateLimit>);
    /// A new `rx_rate=` (a fresh bucket), at once.
    fn set_rx_rate(&self, r: Option<RateLimit>);
    /// Removed for good: see `UplinkDevice::release`.
    fn release(&self) -> io::Result<()>;
}

/// What `DeviceUplink` needs from a device: per-queue fds that read and write one
/// frame at a time, each preceded by a virtio_net_hdr of `hdr_len()` bytes.
pub trait UplinkDevice: Send + Sync + 'static {
    /// `kind=NAME`, as on the command line.
    fn name(&self) -> String;
    /// Short prefix for thread names ("tap", "pkt").
    fn thread_prefix(&self) -> &'static str;
    fn queues(&self) -> usize;
    /// The fd the reader of `queue` polls.
    fn fd(&self, queue: usize) -> BorrowedFd<'_>;
    /// Length of the virtio_net_hdr in front of every frame: 12, or 10 for an
    /// AF_PACKET socket on a kernel without PACKET_VNET_HDR_SZ.
    fn hdr_len(&self) -> usize;
    /// Reads one frame (header first) into `buf` and says where in `buf` it lies.
    /// `Ok(None)`: a frame to skip (one we sent ourselves); `WouldBlock` when the
    /// queue is empty.
    fn recv(&self, queue: usize, buf: &mut [u8]) -> io::Result<Option<std::ops::Range<usize>>>;
    /// Writes one frame (header first) with a single writev (`sys::io::writev`).
    fn send(&self, queue: usize, iov: &[&[u8]]) -> io::Result<usize>;
    /// Whether `send` is a plain writev of header and frame to `fd(queue)` and
    /// `recv` a plain read from it, so writes and reads may be batched
    /// (`switch::write_batch`, the reader's batched reads).
    fn batchable(&self) -> bool {
        false
    }
    /// Tells the device which offloads the guests behind it accept.
    fn set_offload(&self, caps: Caps) -> Result<Caps, String>;
    /// The device is being removed for good (`gsonet ctl uplink del`, a reload): a
    /// device gsonet made persistent goes with it.
    fn release(&self) -> io::Result<()> {
        Ok(())
    }
}

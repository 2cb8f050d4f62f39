//! An in-process vhost-user *frontend* (the part QEMU plays) for integration tests.
//!
//! It owns a memfd-backed guest memory, performs the real vhost-user handshake through
//! the `vhost` crate's [`Frontend`], lays out a split RX queue (index 0) and TX queue
//! (index 1), and then acts as the guest's virtio-net driver on those rings.
//!
//! ```ignore
//! mod common;
//! use common::frontend::{feat, FrontendOpts, TestFrontend, TxLayout};
//!
//! let opts = FrontendOpts { features: feat::VERSION_1 | feat::MRG_RXBUF, ..Default::default() };
//! let mut fe = TestFrontend::connect(&socket_path, opts)?; // gsonet listens
//! // or: let mut fe = TestFrontend::accept(&listener, opts)?; // gsonet connects (client mode)
//! fe.post_rx(256, 2048)?;
//! fe.send(&VirtioNetHdr::default(), &frame, TxLayout::HeaderSeparate)?;
//! fe.wait_tx_done(Duration::from_secs(2))?;
//! let (hdr, bytes) = other_fe.recv(Duration::from_secs(2)).expect("frame");
//! ```
//!
//! Driver behaviour follows Linux virtio_net closely enough to catch backend bugs:
//! - memory ordering: descriptors and avail entries are written before the avail index
//!   is published with a release store; the used index is read with an acquire load;
//! - notifications are suppressed as a real driver would (EVENT_IDX `avail_event`, or
//!   `VRING_USED_F_NO_NOTIFY`) unless `always_kick` is set, and `recv`/`wait_tx_done`
//!   sleep on the call eventfd (after re-arming `used_event`), so a backend that forgets
//!   to notify makes them time out instead of being rescued by polling;
//! - TX segments are allocated separately with a poisoned gap between them, so a
//!   backend that reads past a descriptor's length sees garbage;
//! - with MRG_RXBUF every RX buffer is one writable descriptor and `recv` gathers
//!   `num_buffers` used entries into one frame; without it `recv` checks
//!   `num_buffers == 1`. Consumed RX buffers are re-posted (`auto_repost`).
//!
//! Malformed input for robustness tests: [`TestFrontend::send_bad`] (canned cases),
//! [`TestFrontend::send_bytes`] (arbitrary header bytes) and [`TestFrontend::push_raw`]
//! (arbitrary descriptors on either queue).
//!
//! The header is always the 12-byte virtio 1.x header: ack VERSION_1 and/or MRG_RXBUF.

#![allow(dead_code)]

use std::collections::{HashMap, VecDeque};
use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{fence, AtomicU32, Ordering};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, ensure, Context, Result};
use gsonet::vnet_hdr::{VirtioNetHdr, HDR_LEN};
use vhost::vhost_user::message::{
    VhostUserHeaderFlag, VhostUserProtocolFeatures, VhostUserVirtioFeatures,
};
use vhost::vhost_user::{Frontend, VhostUserFrontend};
use vhost::{VhostBackend, VhostUserMemoryRegionInfo, VringConfigData};
use virtio_bindings::bindings::virtio_ring::{
    VRING_DESC_F_INDIRECT, VRING_DESC_F_NEXT, VRING_DESC_F_WRITE, VRING_USED_F_NO_NOTIFY,
};
use virtio_queue::desc::split::Descriptor;
use vm_memory::{
    Bytes, FileOffset, GuestAddress, GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion,
};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

/// Queue indices, as QEMU lays them out for one queue pair.
pub const RX_QUEUE: usize = 0;
pub const TX_QUEUE: usize = 1;

/// Feature bits (as masks) a test may ack.
pub mod feat {
    use virtio_bindings::bindings::virtio_config::VIRTIO_F_VERSION_1;
    use virtio_bindings::bindings::virtio_net::*;
    use virtio_bindings::bindings::virtio_ring::{
        VIRTIO_RING_F_EVENT_IDX, VIRTIO_RING_F_INDIRECT_DESC,
    };

    pub const CSUM: u64 = 1 << VIRTIO_NET_F_CSUM;
    pub const GUEST_CSUM: u64 = 1 << VIRTIO_NET_F_GUEST_CSUM;
    pub const CTRL_GUEST_OFFLOADS: u64 = 1 << VIRTIO_NET_F_CTRL_GUEST_OFFLOADS;
    pub const MTU: u64 = 1 << VIRTIO_NET_F_MTU;
    pub const MAC: u64 = 1 << VIRTIO_NET_F_MAC;
    pub const GUEST_TSO4: u64 = 1 << VIRTIO_NET_F_GUEST_TSO4;
    pub const GUEST_TSO6: u64 = 1 << VIRTIO_NET_F_GUEST_TSO6;
    pub const GUEST_ECN: u64 = 1 << VIRTIO_NET_F_GUEST_ECN;
    pub const GUEST_UFO: u64 = 1 << VIRTIO_NET_F_GUEST_UFO;
    pub const HOST_TSO4: u64 = 1 << VIRTIO_NET_F_HOST_TSO4;
    pub const HOST_TSO6: u64 = 1 << VIRTIO_NET_F_HOST_TSO6;
    pub const HOST_ECN: u64 = 1 << VIRTIO_NET_F_HOST_ECN;
    pub const HOST_UFO: u64 = 1 << VIRTIO_NET_F_HOST_UFO;
    pub const MRG_RXBUF: u64 = 1 << VIRTIO_NET_F_MRG_RXBUF;
    pub const STATUS: u64 = 1 << VIRTIO_NET_F_STATUS;
    pub const CTRL_VQ: u64 = 1 << VIRTIO_NET_F_CTRL_VQ;
    pub const MQ: u64 = 1 << VIRTIO_NET_F_MQ;
    pub const GUEST_USO4: u64 = 1 << VIRTIO_NET_F_GUEST_USO4;
    pub const GUEST_USO6: u64 = 1 << VIRTIO_NET_F_GUEST_USO6;
    pub const HOST_USO: u64 = 1 << VIRTIO_NET_F_HOST_USO;
    pub const INDIRECT_DESC: u64 = 1 << VIRTIO_RING_F_INDIRECT_DESC;
    pub const EVENT_IDX: u64 = 1 << VIRTIO_RING_F_EVENT_IDX;
    /// VIRTIO_F_RING_PACKED: packed rings (`TestFrontend::packed_put`).
    pub const RING_PACKED: u64 = 1 << 34;
    /// VIRTIO_F_IN_ORDER: the device uses buffers in the order they were made
    /// available; a packed TX ring may be completed one used descriptor per batch.
    pub const IN_ORDER: u64 = 1 << 35;
    pub const VERSION_1: u64 = 1 << VIRTIO_F_VERSION_1;
    /// VHOST_USER_F_PROTOCOL_FEATURES (bit 30). The frontend acks it by itself whenever
    /// the backend offers it, unless `FrontendOpts::no_protocol_features` is set.
    pub const PROTOCOL_FEATURES: u64 = 1 << 30;

    /// The ring features every modern driver acks.
    pub const RINGS: u64 = VERSION_1 | MRG_RXBUF | EVENT_IDX | INDIRECT_DESC;
    /// Everything a guest may send large: CSUM and every HOST_* offload.
    pub const HOST_ALL: u64 = CSUM | HOST_TSO4 | HOST_TSO6 | HOST_ECN | HOST_UFO | HOST_USO;
    /// Every GUEST_* segmentation offload (GUEST_CSUM not included).
    pub const GUEST_GSO: u64 =
        GUEST_TSO4 | GUEST_TSO6 | GUEST_ECN | GUEST_UFO | GUEST_USO4 | GUEST_USO6;

    /// What a Linux guest with all offloads on typically acks (no control queue, no MQ).
    pub const LINUX_DEFAULT: u64 = VERSION_1
        | CSUM
        | GUEST_CSUM
        | HOST_TSO4
        | HOST_TSO6
        | HOST_ECN
        | GUEST_TSO4
        | GUEST_TSO6
        | GUEST_ECN
        | MRG_RXBUF
        | EVENT_IDX
        | INDIRECT_DESC;
}

/// Options for the handshake and the driver.
#[derive(Clone, Debug)]
pub struct FrontendOpts {
    /// Virtio features the driver wants. The acked set is `features & offered`, plus
    /// PROTOCOL_FEATURES when offered.
    pub features: u64,
    /// Fail the handshake if some bit of `features` is not offered.
    pub require_features: bool,
    /// Protocol features the frontend wants; acked: `wanted & offered`.
    pub protocol_features: VhostUserProtocolFeatures,
    /// Do not ack VHOST_USER_F_PROTOCOL_FEATURES (rings then start enabled).
    pub no_protocol_features: bool,
    /// Size of both queues.
    pub queue_size: u16,
    /// Total guest memory.
    pub mem_size: u64,
    /// Split guest memory into this many regions (same memfd, different mmap offsets,
    /// GPAs 4 GiB apart). Buffers are spread over the regions round-robin.
    pub mem_regions: usize,
    /// Kick after every publication, ignoring the device's notification suppression.
    pub always_kick: bool,
    /// Re-post RX buffers after `recv` consumed them.
    pub auto_repost: bool,
    /// How long `connect`/`accept` wait for the other side.
    pub connect_timeout: Duration,
    /// Seal the guest memory memfd against shrinking and growing, as QEMU's
    /// memory-backend-memfd does (gsonet refuses unsealed memory by default).
    pub seal_memory: bool,
}

impl Default for FrontendOpts {
    fn default() -> Self {
        FrontendOpts {
            features: feat::LINUX_DEFAULT,
            require_features: false,
            protocol_features: VhostUserProtocolFeatures::MQ
                | VhostUserProtocolFeatures::REPLY_ACK
                | VhostUserProtocolFeatures::CONFIG
                | VhostUserProtocolFeatures::CONFIGURE_MEM_SLOTS,
            no_protocol_features: false,
            queue_size: 256,
            mem_size: 64 << 20,
            mem_regions: 1,
            always_kick: false,
            auto_repost: true,
            connect_timeout: Duration::from_secs(5),
            seal_memory: true,
        }
    }
}

/// How the 12-byte header plus frame ("the bytes") are spread over TX descriptors.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TxLayout {
    /// One descriptor holding header and frame.
    Single,
    /// Header alone, then the whole frame in a second descriptor.
    HeaderSeparate,
    /// Split the bytes at these offsets (ascending; out-of-range or repeated offsets
    /// are ignored). Offsets below 12 split the header itself.
    SplitAt(Vec<usize>),
    /// Descriptors of at most this many bytes each (header not treated specially).
    Chunks(usize),
    /// Header alone, then the frame in chunks of this size (Linux: linear part + frags).
    HeaderThenChunks(usize),
    /// The inner layout, placed in an indirect descriptor table.
    Indirect(Box<TxLayout>),
}

impl TxLayout {
    pub fn indirect(inner: TxLayout) -> Self {
        TxLayout::Indirect(Box::new(inner))
    }

    /// A set of layouts covering the interesting cases, for matrix tests.
    pub fn matrix() -> Vec<TxLayout> {
        vec![
            TxLayout::Single,
            TxLayout::HeaderSeparate,
            TxLayout::SplitAt(vec![1]),
            TxLayout::SplitAt(vec![5]),
            TxLayout::SplitAt(vec![10, 11]),
            TxLayout::SplitAt(vec![3, 12, 13, 40, 1000, 1500]),
            TxLayout::SplitAt(vec![14, 34, 54]),
            TxLayout::Chunks(4096),
            TxLayout::Chunks(1000),
            TxLayout::HeaderThenChunks(4096),
            TxLayout::indirect(TxLayout::Single),
            TxLayout::indirect(TxLayout::HeaderSeparate),
            TxLayout::indirect(TxLayout::SplitAt(vec![7, 20])),
            TxLayout::indirect(TxLayout::Chunks(512)),
        ]
    }

    /// (segments as (offset, len), whether in an indirect table).
    fn segments(&self, total: usize) -> (Vec<(usize, usize)>, bool) {
        let cuts: Vec<usize> = match self {
            TxLayout::Single => vec![],
            TxLayout::HeaderSeparate => vec![HDR_LEN],
            TxLayout::SplitAt(v) => v.clone(),
            TxLayout::Chunks(n) => (1..)
                .map(|i| i * (*n).max(1))
                .take_while(|&c| c < total)
                .collect(),
            TxLayout::HeaderThenChunks(n) => std::iter::once(HDR_LEN)
                .chain((1..).map(|i| HDR_LEN + i * (*n).max(1)))
                .take_while(|&c| c < total)
                .collect(),
            TxLayout::Indirect(inner) => {
                let (segs, _) = inner.segments(total);
                return (segs, true);
            }
        };
        let mut segs = Vec::new();
        let mut start = 0;
        for c in cuts {
            if c > start && c < total {
                segs.push((start, c - start));
                start = c;
            }
        }
        if start < total || segs.is_empty() {
            segs.push((start, total - start));
        }
        (segs, false)
    }
}

/// Canned malformed TX chains. Each is published on the TX queue and kicked; a robust
/// backend returns it as used (or ignores it) and keeps serving the queue.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BadTx {
    /// Valid header descriptor, frame descriptor addressed beyond guest memory.
    AddrOutsideMemory,
    /// Header descriptor addressed beyond guest memory.
    HeaderOutsideMemory,
    /// Frame descriptor straddling the end of a memory region.
    AddrStraddlesRegionEnd,
    /// Three descriptors whose `next` goes back to the first.
    DescriptorLoop,
    /// Indirect table with queue_size + 1 entries (a chain longer than the queue).
    ChainLongerThanQueue,
    /// One descriptor of length 0.
    ZeroLengthChain,
    /// A chain of only 6 bytes (shorter than the header).
    ShortHeader,
    /// `next` index beyond the queue size.
    NextOutOfRange,
    /// A device-writable descriptor inside a TX chain.
    WriteOnlyInTx,
    /// An indirect table containing an indirect descriptor.
    NestedIndirect,
    /// Indirect descriptor whose length is not a multiple of 16.
    IndirectBadLen,
    /// Descriptor claiming 4 GiB - 1 bytes.
    HugeLen,
}

impl BadTx {
    pub const ALL: [BadTx; 12] = [
        BadTx::AddrOutsideMemory,
        BadTx::HeaderOutsideMemory,
        BadTx::AddrStraddlesRegionEnd,
        BadTx::DescriptorLoop,
        BadTx::ChainLongerThanQueue,
        BadTx::ZeroLengthChain,
        BadTx::ShortHeader,
        BadTx::NextOutOfRange,
        BadTx::WriteOnlyInTx,
        BadTx::NestedIndirect,
        BadTx::IndirectBadLen,
        BadTx::HugeLen,
    ];
}

/// One descriptor for [`TestFrontend::push_raw`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RawDesc {
    /// Guest physical address.
    pub addr: u64,
    pub len: u32,
    /// Extra flags (WRITE, INDIRECT). NEXT is set from `next`.
    pub flags: u16,
    /// Index of the next descriptor *in the slice* (translated to the real descriptor
    /// id); values >= the slice length are written verbatim (for out-of-range tests).
    pub next: Option<u16>,
}

impl RawDesc {
    pub fn new(addr: u64, len: u32) -> Self {
        RawDesc {
            addr,
            len,
            flags: 0,
            next: None,
        }
    }
    pub fn next(mut self, i: u16) -> Self {
        self.next = Some(i);
        self
    }
    pub fn write(mut self) -> Self {
        self.flags |= VRING_DESC_F_WRITE as u16;
        self
    }
    pub fn indirect(mut self) -> Self {
        self.flags |= VRING_DESC_F_INDIRECT as u16;
        self
    }
}

/// A received frame with the details tests may want to check.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RxFrame {
    pub hdr: VirtioNetHdr,
    /// The 12 header bytes as the device wrote them.
    pub raw_hdr: [u8; HDR_LEN],
    /// The frame after the header.
    pub frame: Vec<u8>,
    /// Used entries (buffers) the frame occupied.
    pub buffers: u16,
}

/// Counters of the driver side.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct QueueStats {
    /// Chains published.
    pub published: u64,
    /// Used entries consumed.
    pub used: u64,
    /// Kicks sent.
    pub kicks: u64,
    /// Publications where notification suppression let us skip the kick.
    pub kicks_suppressed: u64,
    /// Calls (interrupts) received: the sum of the call eventfd's counter as read
    /// while waiting (a call arriving after the last wait is not counted yet).
    pub calls: u64,
}

/// A unique socket path under the temp dir.
pub fn temp_socket_path(tag: &str) -> PathBuf {
    static N: AtomicU32 = AtomicU32::new(0);
    std::env::temp_dir().join(format!(
        "gsonet-{tag}-{}-{}.sock",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ))
}

/// A memfd of `size` bytes, sealed against shrinking and growing when `seal`.
pub fn memfd(size: u64, seal: bool) -> Result<File> {
    Ok(gsonet::sys::fd::guest_memfd(size, seal)?)
}

// ---------------------------------------------------------------------------------------
// Guest memory allocator

/// First-fit allocator over guest-physical ranges, one free list per region.
struct Arena {
    regions: Vec<Vec<(u64, u64)>>,
    rr: usize,
    /// Allocate from this region only (`TestFrontend::pin_region`).
    pin: Option<usize>,
    /// Regions removed (`TestFrontend::remove_region`): what is freed there is gone.
    removed: Vec<usize>,
}

impl Arena {
    fn alloc(&mut self, len: u64, align: u64) -> Option<u64> {
        let n = self.regions.len();
        let len = len.max(1);
        for k in 0..n {
            let r = (self.rr + k) % n;
            if self.pin.is_some_and(|p| p != r) {
                continue;
            }
            let free = &mut self.regions[r];
            for i in 0..free.len() {
                let (start, flen) = free[i];
                let a = start.next_multiple_of(align);
                let pad = a - start;
                if flen >= pad + len {
                    let end = start + flen;
                    free.remove(i);
                    if a + len < end {
                        free.insert(i, (a + len, end - a - len));
                    }
                    if pad > 0 {
                        free.insert(i, (start, pad));
                    }
                    self.rr = (r + 1) % n;
                    return Some(a);
                }
            }
        }
        None
    }

    /// Return a range; regions are 4 GiB apart, so the region is `addr >> 32`.
    fn free(&mut self, addr: u64, len: u64) {
        let len = len.max(1);
        if self.removed.contains(&((addr >> 32) as usize)) {
            return;
        }
        let free = &mut self.regions[(addr >> 32) as usize];
        let pos = free.partition_point(|&(s, _)| s < addr);
        free.insert(pos, (addr, len));
        if pos + 1 < free.len() && free[pos].0 + free[pos].1 == free[pos + 1].0 {
            free[pos].1 += free[pos + 1].1;
            free.remove(pos + 1);
        }
        if pos > 0 && free[pos - 1].0 + free[pos - 1].1 == free[pos].0 {
            free[pos - 1].1 += free[pos].1;
            free.remove(pos);
        }
    }
}

// ---------------------------------------------------------------------------------------
// Driver side of one split virtqueue

#[derive(Debug)]
enum ChainKind {
    Tx,
    /// Writable buffers (gpa, len) in chain order.
    Rx(Vec<(u64, u32)>),
    Raw,
}

#[derive(Debug)]
struct Inflight {
    descs: Vec<u16>,
    /// Guest memory to free on completion (gpa, len).
    allocs: Vec<(u64, u64)>,
    kind: ChainKind,
}

struct DriverQueue {
    size: u16,
    desc: u64,
    avail: u64,
    used: u64,
    free: Vec<u16>,
    /// Shadow of avail->idx.
    avail_idx: u16,
    last_used: u16,
    /// avail->idx at the last notify decision.
    kicked_idx: u16,
    inflight: HashMap<u16, Inflight>,
    /// Heads in flight in the order they were made available (IN_ORDER reading).
    order: VecDeque<u16>,
    /// IN_ORDER: the last buffer (id, len) of the batch being read, from the one
    /// used element the device may write for a whole batch.
    batch_last: Option<(u16, u32)>,
    kick: EventFd,
    call: EventFd,
    stats: QueueStats,
}

impl DriverQueue {
    fn used_event_addr(&self) -> u64 {
        self.avail + 4 + 2 * self.size as u64
    }
    fn avail_event_addr(&self) -> u64 {
        self.used + 4 + 8 * self.size as u64
    }
}

/// The test frontend: one vhost-user connection, one RX and one TX queue.
pub struct TestFrontend {
    vu: Frontend,
    /// The same connection, for requests the `vhost` crate's frontend cannot send.
    raw: UnixStream,
    mem: GuestMemoryMmap<()>,
    arena: Arena,
    queues: [DriverQueue; 2],
    acked_features: u64,
    offered_features: u64,
    acked_protocol: VhostUserProtocolFeatures,
    opts: FrontendOpts,
    /// Used entries of raw chains seen by `recv`/`reclaim_tx` (queue, head, len).
    raw_used: Vec<(usize, u16, u32)>,
    /// (head, used len) of every reclaimed TX chain, oldest first.
    tx_completions: Vec<(u16, u32)>,
    mem_end: u64,
    /// Inside `send_batch`: chains go into the avail ring, the index waits.
    batching: bool,
    /// RING_PACKED was acked: the rings are packed, written slot by slot with
    /// `packed_put` (the split driver's calls do not apply).
    packed: bool,
}

/// One descriptor of a packed ring, as the driver writes it (`packed_put`) or the
/// device leaves it (`packed_get`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PackedRaw {
    pub addr: u64,
    pub len: u32,
    pub id: u16,
    pub flags: u16,
}

const RING_ALIGN: u64 = 4096;

/// Gives the backend ring `i`: its size, first index `base`, addresses and kick
/// descriptor (the call descriptor is the caller's to send).
fn set_up_ring(
    vu: &Frontend,
    mem: &GuestMemoryMmap<()>,
    i: usize,
    qs: u16,
    base: u16,
    q: &DriverQueue,
) -> Result<()> {
    let hva = |gpa: u64| -> Result<u64> {
        Ok(mem
            .get_host_address(GuestAddress(gpa))
            .map_err(|e| anyhow!("hva: {e:?}"))? as u64)
    };
    vu.set_vring_num(i, qs).context("SET_VRING_NUM")?;
    vu.set_vring_base(i, base).context("SET_VRING_BASE")?;
    let cfg = VringConfigData {
        queue_max_size: qs,
        queue_size: qs,
        flags: 0,
        desc_table_addr: hva(q.desc)?,
        used_ring_addr: hva(q.used)?,
        avail_ring_addr: hva(q.avail)?,
        log_addr: None,
    };
    vu.set_vring_addr(i, &cfg).context("SET_VRING_ADDR")?;
    vu.set_vring_kick(i, &q.kick).context("SET_VRING_KICK")
}
/// Gap with poison after every TX segment.
const GUARD: u64 = 16;
const POISON: u8 = 0xEE;

impl TestFrontend {
    /// Connect to a backend listening on `path` (retrying until `opts.connect_timeout`)
    /// and perform the handshake.
    pub fn connect(path: impl AsRef<Path>, opts: FrontendOpts) -> Result<Self> {
        let path = path.as_ref();
        let deadline = Instant::now() + opts.connect_timeout;
        let stream = loop {
            match UnixStream::connect(path) {
                Ok(s) => break s,
                Err(e) if Instant::now() < deadline => {
                    let _ = e;
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(e) => return Err(e).with_context(|| format!("connect {}", path.display())),
            }
        };
        Self::from_stream(stream, opts)
    }

    /// Client mode: wait (up to `opts.connect_timeout`) for the backend to connect to
    /// `listener`, then perform the handshake.
    pub fn accept(listener: &UnixListener, opts: FrontendOpts) -> Result<Self> {
        listener.set_nonblocking(true)?;
        let deadline = Instant::now() + opts.connect_timeout;
        let stream = loop {
            match listener.accept() {
                Ok((s, _)) => break s,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    ensure!(Instant::now() < deadline, "no backend connected in time");
                    std::thread::sleep(Duration::from_millis(10));
                }
                Err(e) => return Err(e.into()),
            }
        };
        listener.set_nonblocking(false)?;
        stream.set_nonblocking(false)?;
        Self::from_stream(stream, opts)
    }

    /// Handshake over an already connected socket.
    pub fn from_stream(stream: UnixStream, opts: FrontendOpts) -> Result<Self> {
        ensure!(
            opts.queue_size.is_power_of_two(),
            "queue size must be a power of two"
        );
        ensure!(opts.mem_regions >= 1, "need at least one memory region");
        let raw = stream.try_clone()?;
        let mut vu = Frontend::from_stream(stream, 2);

        // Same order as QEMU: features, protocol features, queue number, owner; then at
        // device start: SET_FEATURES, SET_MEM_TABLE, per ring NUM/BASE/ADDR/KICK/CALL,
        // and finally SET_VRING_ENABLE.
        let offered = vu.get_features().context("GET_FEATURES")?;
        let mut acked_protocol = VhostUserProtocolFeatures::empty();
        let proto_bit = VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits();
        let use_proto = offered & proto_bit != 0 && !opts.no_protocol_features;
        if use_proto {
            let pf = vu
                .get_protocol_features()
                .context("GET_PROTOCOL_FEATURES")?;
            acked_protocol = pf & opts.protocol_features;
            vu.set_protocol_features(acked_protocol)
                .context("SET_PROTOCOL_FEATURES")?;
            if acked_protocol.contains(VhostUserProtocolFeatures::REPLY_ACK) {
                vu.set_hdr_flags(VhostUserHeaderFlag::NEED_REPLY);
            }
            if acked_protocol.contains(VhostUserProtocolFeatures::MQ) {
                let n = vu.get_queue_num().context("GET_QUEUE_NUM")?;
                ensure!(n >= 2, "backend reports {n} queues");
            }
        }
        vu.set_owner().context("SET_OWNER")?;

        if opts.require_features && opts.features & !offered != 0 {
            bail!(
                "backend does not offer {:#x} (offered {offered:#x})",
                opts.features & !offered
            );
        }
        let mut acked = opts.features & offered & !proto_bit;
        if use_proto {
            acked |= proto_bit;
        }
        ensure!(
            acked & (feat::VERSION_1 | feat::MRG_RXBUF) != 0,
            "neither VERSION_1 nor MRG_RXBUF negotiated: the 10-byte legacy header is not supported here"
        );
        vu.set_features(acked).context("SET_FEATURES")?;

        // Guest memory: one memfd, split into regions.
        let n = opts.mem_regions as u64;
        let per = (opts.mem_size / n) & !0xfff;
        ensure!(per >= 1 << 20, "memory regions too small");
        let file = memfd(per * n, opts.seal_memory)?;
        let mut ranges = Vec::new();
        for i in 0..n {
            let fo = FileOffset::new(file.try_clone()?, i * per);
            ranges.push((GuestAddress(i << 32), per as usize, Some(fo)));
        }
        let mem = GuestMemoryMmap::<()>::from_ranges_with_files(&ranges)
            .map_err(|e| anyhow!("guest memory: {e:?}"))?;
        let regions: Vec<VhostUserMemoryRegionInfo> = mem
            .iter()
            .map(VhostUserMemoryRegionInfo::from_guest_region)
            .collect::<std::result::Result<_, _>>()
            .map_err(|e| anyhow!("region info: {e:?}"))?;
        vu.set_mem_table(&regions).context("SET_MEM_TABLE")?;
        let mem_end = mem
            .iter()
            .map(|r| r.start_addr().0 + r.len())
            .max()
            .unwrap_or(0);

        // Leave the first page of region 0 unused, so that GPA 0 is never a valid buffer.
        let mut arena = Arena {
            regions: (0..n)
                .map(|i| {
                    let base = i << 32;
                    if i == 0 {
                        vec![(base + 4096, per - 4096)]
                    } else {
                        vec![(base, per)]
                    }
                })
                .collect(),
            rr: 0,
            pin: None,
            removed: Vec::new(),
        };

        let qs = opts.queue_size;
        let make_queue = |arena: &mut Arena| -> Result<DriverQueue> {
            let q = qs as u64;
            // Each part on its own page in region 0, as a simple driver would do.
            arena.rr = 0;
            let desc = arena.alloc(16 * q, RING_ALIGN).context("ring memory")?;
            arena.rr = 0;
            let avail = arena.alloc(6 + 2 * q, RING_ALIGN).context("ring memory")?;
            arena.rr = 0;
            let used = arena.alloc(6 + 8 * q, RING_ALIGN).context("ring memory")?;
            Ok(DriverQueue {
                size: qs,
                desc,
                avail,
                used,
                free: (0..qs).rev().collect(),
                avail_idx: 0,
                last_used: 0,
                kicked_idx: 0,
                inflight: HashMap::new(),
                order: VecDeque::new(),
                batch_last: None,
                kick: EventFd::new(EFD_NONBLOCK)?,
                call: EventFd::new(EFD_NONBLOCK)?,
                stats: QueueStats::default(),
            })
        };
        let queues = [make_queue(&mut arena)?, make_queue(&mut arena)?];
        arena.rr = 0;

        // A packed ring starts at slot 0 with both wrap counters at 1 (bit 15 of the
        // vring base); its descriptor ring is `desc`, the driver's and device's event
        // structures are at `avail` and `used`.
        let packed = acked & feat::RING_PACKED != 0;
        let base = if packed { 0x8000 } else { 0 };
        for (i, q) in queues.iter().enumerate() {
            set_up_ring(&vu, &mem, i, qs, base, q)?;
            vu.set_vring_call(i, &q.call).context("SET_VRING_CALL")?;
        }
        if use_proto {
            for i in 0..2 {
                vu.set_vring_enable(i, true).context("SET_VRING_ENABLE")?;
            }
        }

        Ok(TestFrontend {
            vu,
            mem,
            arena,
            queues,
            acked_features: acked,
            offered_features: offered,
            acked_protocol,
            opts,
            raw_used: Vec::new(),
            tx_completions: Vec::new(),
            mem_end,
            raw,
            batching: false,
            packed,
        })
    }

    // -----------------------------------------------------------------------------------
    // Packed rings, slot by slot

    /// Whether the rings are packed (RING_PACKED acked).
    pub fn is_packed(&self) -> bool {
        self.packed
    }

    /// Writes `d` into slot `slot` of packed ring `queue` as a driver makes it
    /// available: address, length and id first, its flags last (release).
    pub fn packed_put(&mut self, queue: usize, slot: u16, d: PackedRaw) -> Result<()> {
        ensure!(self.packed, "not a packed ring");
        let q = &self.queues[queue];
        ensure!(slot < q.size, "slot {slot} outside the ring");
        let at = q.desc + 16 * u64::from(slot);
        self.mem.write_obj(d.addr.to_le(), GuestAddress(at))?;
        self.mem.write_obj(d.len.to_le(), GuestAddress(at + 8))?;
        self.mem.write_obj(d.id.to_le(), GuestAddress(at + 12))?;
        self.mem
            .store(d.flags.to_le(), GuestAddress(at + 14), Ordering::Release)?;
        Ok(())
    }

    /// Slot `slot` of packed ring `queue` as it is now.
    pub fn packed_get(&self, queue: usize, slot: u16) -> Result<PackedRaw> {
        let at = self.queues[queue].desc + 16 * u64::from(slot);
        Ok(PackedRaw {
            addr: u64::from_le(self.mem.read_obj(GuestAddress(at))?),
            len: u32::from_le(self.mem.read_obj(GuestAddress(at + 8))?),
            id: u16::from_le(self.mem.read_obj(GuestAddress(at + 12))?),
            flags: u16::from_le(self.mem.load(GuestAddress(at + 14), Ordering::Acquire)?),
        })
    }

    // -----------------------------------------------------------------------------------
    // Accessors

    pub fn acked_features(&self) -> u64 {
        self.acked_features
    }
    pub fn offered_features(&self) -> u64 {
        self.offered_features
    }
    pub fn acked_protocol_features(&self) -> VhostUserProtocolFeatures {
        self.acked_protocol
    }
    pub fn has(&self, feature_mask: u64) -> bool {
        self.acked_features & feature_mask == feature_mask
    }
    pub fn queue_size(&self) -> u16 {
        self.opts.queue_size
    }
    pub fn stats(&self, queue: usize) -> QueueStats {
        self.queues[queue].stats
    }
    /// Chains published on `queue` and not yet returned.
    pub fn in_flight(&self, queue: usize) -> usize {
        self.queues[queue].inflight.len()
    }
    /// (head, used len) of all reclaimed TX chains, oldest first.
    pub fn tx_completions(&self) -> &[(u16, u32)] {
        &self.tx_completions
    }
    /// Used entries of chains pushed with `push_raw`/`send_bad`: (queue, head, len).
    pub fn raw_used(&self) -> &[(usize, u16, u32)] {
        &self.raw_used
    }
    /// The guest memory (for tests that craft their own buffers).
    pub fn memory(&self) -> &GuestMemoryMmap<()> {
        &self.mem
    }
    /// First guest-physical address past the last memory region.
    pub fn mem_end(&self) -> u64 {
        self.mem_end
    }
    /// The underlying vhost-user connection, for messages not wrapped here
    /// (GET_VRING_BASE, GET_CONFIG, SET_VRING_ENABLE 0, ...).
    /// Sends one request the `vhost` crate's frontend has no call for (SEND_RARP), on
    /// the same connection, version 1 and no reply asked.
    pub fn send_request(&mut self, request: u32, payload: &[u8]) -> Result<()> {
        use std::io::Write;
        let mut m = Vec::with_capacity(12 + payload.len());
        m.extend_from_slice(&request.to_le_bytes());
        m.extend_from_slice(&1u32.to_le_bytes());
        m.extend_from_slice(&(payload.len() as u32).to_le_bytes());
        m.extend_from_slice(payload);
        self.raw.write_all(&m)?;
        Ok(())
    }

    /// Maps `size` more bytes of guest memory at `gpa` (a multiple of 4 GiB, so the
    /// allocator keeps its one-region-per-4-GiB rule), in a memfd of its own, and
    /// tells the backend with ADD_MEM_REG (as QEMU does for a DIMM or a virtio-mem
    /// memslot plugged at run time). Returns once the backend acknowledged it.
    pub fn add_region(&mut self, gpa: u64, size: u64) -> Result<()> {
        ensure!(
            gpa.is_multiple_of(1 << 32) && gpa > 0,
            "regions are 4 GiB apart"
        );
        let file = memfd(size, self.opts.seal_memory)?;
        let region = vm_memory::GuestRegionMmap::<()>::from_range(
            GuestAddress(gpa),
            size as usize,
            Some(FileOffset::new(file, 0)),
        )
        .map_err(|e| anyhow!("region: {e:?}"))?;
        let info = VhostUserMemoryRegionInfo::from_guest_region(&region)
            .map_err(|e| anyhow!("region info: {e:?}"))?;
        self.vu.add_mem_region(&info).context("ADD_MEM_REG")?;
        self.mem = self
            .mem
            .insert_region(std::sync::Arc::new(region))
            .map_err(|e| anyhow!("insert: {e:?}"))?;
        let i = (gpa >> 32) as usize;
        if self.arena.regions.len() <= i {
            self.arena.regions.resize(i + 1, Vec::new());
        }
        self.arena.regions[i] = vec![(gpa, size)];
        self.arena.removed.retain(|&r| r != i);
        Ok(())
    }

    /// Unmaps the region at `gpa` (REM_MEM_REG), as QEMU does once a DIMM is
    /// unplugged. Buffers the driver still has there are forgotten (a guest offlines
    /// the memory first, so an honest one has none).
    pub fn remove_region(&mut self, gpa: u64) -> Result<()> {
        let region = self
            .mem
            .find_region(GuestAddress(gpa))
            .ok_or_else(|| anyhow!("no region at {gpa:#x}"))?;
        let info = VhostUserMemoryRegionInfo::from_guest_region(region)
            .map_err(|e| anyhow!("region info: {e:?}"))?;
        let size = region.len();
        self.vu.remove_mem_region(&info).context("REM_MEM_REG")?;
        self.mem = self
            .mem
            .remove_region(GuestAddress(gpa), size)
            .map_err(|e| anyhow!("remove: {e:?}"))?
            .0;
        if let Some(r) = self.arena.regions.get_mut((gpa >> 32) as usize) {
            r.clear();
        }
        self.arena.removed.push((gpa >> 32) as usize);
        if self.arena.pin == Some((gpa >> 32) as usize) {
            self.arena.pin = None;
        }
        Ok(())
    }

    /// Takes every later buffer (TX frames, RX buffers, tables) from the region at
    /// `gpa` only; `None`: from all regions again.
    pub fn pin_region(&mut self, gpa: Option<u64>) {
        self.arena.pin = gpa.map(|g| (g >> 32) as usize);
    }

    pub fn vhost(&mut self) -> &mut Frontend {
        &mut self.vu
    }

    /// Stop both rings like QEMU does on guest shutdown (GET_VRING_BASE); returns the
    /// backend's next avail index for RX and TX.
    pub fn stop(&mut self) -> Result<[u32; 2]> {
        Ok([
            self.vu
                .get_vring_base(RX_QUEUE)
                .context("GET_VRING_BASE rx")?,
            self.vu
                .get_vring_base(TX_QUEUE)
                .context("GET_VRING_BASE tx")?,
        ])
    }

    /// Copy `bytes` into freshly allocated guest memory (never freed); returns the GPA.
    pub fn alloc_guest(&mut self, bytes: &[u8]) -> Result<u64> {
        let a = self.alloc(bytes.len() as u64, 8)?;
        self.mem.write_slice(bytes, GuestAddress(a))?;
        Ok(a)
    }

    // -----------------------------------------------------------------------------------
    // TX

    /// Send one frame: `hdr` (12 bytes) + `frame`, spread over descriptors per `layout`,
    /// then kick (subject to notification suppression). Returns the head index.
    pub fn send(&mut self, hdr: &VirtioNetHdr, frame: &[u8], layout: TxLayout) -> Result<u16> {
        let mut bytes = Vec::with_capacity(HDR_LEN + frame.len());
        bytes.extend_from_slice(&super::wire_hdr::encode(hdr));
        bytes.extend_from_slice(frame);
        self.send_bytes(&bytes, layout)
    }

    /// Send several frames as one batch: every chain is in the avail ring before the
    /// index moves once, then one kick (subject to suppression), so the device drains
    /// them in one pass, as it would a guest's burst.
    pub fn send_batch(
        &mut self,
        frames: &[(VirtioNetHdr, Vec<u8>)],
        layout: TxLayout,
    ) -> Result<()> {
        ensure!(
            frames.len() <= self.opts.queue_size as usize,
            "a batch larger than the queue"
        );
        self.batching = true;
        let r = frames
            .iter()
            .try_for_each(|(h, f)| self.send(h, f, layout.clone()).map(drop));
        self.batching = false;
        r?;
        self.store_avail_idx(TX_QUEUE, self.queues[TX_QUEUE].avail_idx)?;
        self.notify(TX_QUEUE)
    }

    /// Put frames into the TX avail ring and move its index, without a kick: a
    /// driver whose kick was taken by a backend that then went away.
    pub fn send_unkicked(&mut self, frames: &[(VirtioNetHdr, Vec<u8>)]) -> Result<()> {
        self.batching = true;
        let r = frames
            .iter()
            .try_for_each(|(h, f)| self.send(h, f, TxLayout::Single).map(drop));
        self.batching = false;
        r?;
        self.store_avail_idx(TX_QUEUE, self.queues[TX_QUEUE].avail_idx)
    }

    /// Start the device again after `stop`, as QEMU does when a backend comes back:
    /// SET_FEATURES, then per ring NUM, BASE (`bases`, from `stop`), ADDR and KICK,
    /// then SET_VRING_ENABLE, and the call descriptors 50 ms later (QEMU sends them
    /// when the guest unmasks the queues' vectors). The rings keep their contents, and
    /// nothing is kicked.
    pub fn restart(&mut self, bases: [u32; 2]) -> Result<()> {
        self.vu
            .set_features(self.acked_features)
            .context("SET_FEATURES")?;
        let qs = self.opts.queue_size;
        // New kick and call descriptors, as a frontend started anew has.
        for q in self.queues.iter_mut() {
            q.kick = EventFd::new(EFD_NONBLOCK)?;
            q.call = EventFd::new(EFD_NONBLOCK)?;
        }
        for (i, q) in self.queues.iter().enumerate() {
            set_up_ring(&self.vu, &self.mem, i, qs, bases[i] as u16, q)?;
        }
        if self.acked_features & VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits() != 0 {
            for i in 0..2 {
                self.vu
                    .set_vring_enable(i, true)
                    .context("SET_VRING_ENABLE")?;
            }
        }
        // The rings run (the backend has had time to look at them) before the calls.
        std::thread::sleep(Duration::from_millis(50));
        for (i, q) in self.queues.iter().enumerate() {
            self.vu
                .set_vring_call(i, &q.call)
                .context("SET_VRING_CALL")?;
        }
        Ok(())
    }

    /// Send arbitrary bytes (header included, possibly invalid) per `layout`.
    pub fn send_bytes(&mut self, bytes: &[u8], layout: TxLayout) -> Result<u16> {
        let (segs, indirect) = layout.segments(bytes.len());
        if indirect {
            ensure!(
                self.has(feat::INDIRECT_DESC),
                "INDIRECT_DESC not negotiated"
            );
        }
        let ndesc = if indirect { 1 } else { segs.len() };
        ensure!(
            ndesc <= self.opts.queue_size as usize,
            "{ndesc} descriptors do not fit a queue of {}",
            self.opts.queue_size
        );
        self.make_room(TX_QUEUE, ndesc)?;

        let mut allocs = Vec::new();
        let mut table = Vec::with_capacity(segs.len());
        for &(off, len) in &segs {
            let a = self.alloc_tx(len as u64 + GUARD, 8)?;
            allocs.push((a, len as u64 + GUARD));
            self.mem
                .write_slice(&bytes[off..off + len], GuestAddress(a))?;
            self.mem
                .write_slice(&[POISON; GUARD as usize], GuestAddress(a + len as u64))?;
            table.push(RawDesc::new(a, len as u32));
        }
        let n = table.len();
        for (i, d) in table.iter_mut().enumerate() {
            if i + 1 < n {
                d.next = Some(i as u16 + 1);
            }
        }
        let head = if indirect {
            let t = self.write_indirect_table(&table, &mut allocs)?;
            self.publish_chain(
                TX_QUEUE,
                &[RawDesc::new(t, 16 * n as u32).indirect()],
                allocs,
                ChainKind::Tx,
            )?
        } else {
            self.publish_chain(TX_QUEUE, &table, allocs, ChainKind::Tx)?
        };
        if !self.batching {
            self.notify(TX_QUEUE)?;
        }
        Ok(head)
    }

    /// Publish one of the canned malformed chains on TX and kick. Returns the head.
    pub fn send_bad(&mut self, bad: BadTx) -> Result<u16> {
        let hdr = super::wire_hdr::encode(&VirtioNetHdr::default());
        let frame = vec![0x5a; 64];
        let h = self.alloc_guest(&hdr)?;
        let f = self.alloc_guest(&frame)?;
        let outside = self.mem_end + 0x10_0000;
        let q = self.opts.queue_size;
        let head = match bad {
            BadTx::AddrOutsideMemory => self.push_raw(
                TX_QUEUE,
                &[RawDesc::new(h, 12).next(1), RawDesc::new(outside, 64)],
            )?,
            BadTx::HeaderOutsideMemory => self.push_raw(
                TX_QUEUE,
                &[RawDesc::new(outside, 12).next(1), RawDesc::new(f, 64)],
            )?,
            BadTx::AddrStraddlesRegionEnd => {
                let r = self.mem.iter().last().expect("a region");
                let end = r.start_addr().0 + r.len();
                self.push_raw(
                    TX_QUEUE,
                    &[RawDesc::new(h, 12).next(1), RawDesc::new(end - 32, 64)],
                )?
            }
            BadTx::DescriptorLoop => self.push_raw(
                TX_QUEUE,
                &[
                    RawDesc::new(h, 12).next(1),
                    RawDesc::new(f, 32).next(2),
                    RawDesc::new(f + 32, 32).next(0),
                ],
            )?,
            BadTx::ChainLongerThanQueue => {
                let mut table = vec![RawDesc::new(h, 12).next(1)];
                for i in 1..=q {
                    let mut d = RawDesc::new(f + (i as u64 % 64), 1);
                    if i < q {
                        d = d.next(i + 1);
                    }
                    table.push(d);
                }
                let mut allocs = Vec::new();
                let t = self.write_indirect_table(&table, &mut allocs)?;
                let len = 16 * table.len() as u32;
                self.push_raw(TX_QUEUE, &[RawDesc::new(t, len).indirect()])?
            }
            BadTx::ZeroLengthChain => self.push_raw(TX_QUEUE, &[RawDesc::new(h, 0)])?,
            BadTx::ShortHeader => self.push_raw(TX_QUEUE, &[RawDesc::new(h, 6)])?,
            BadTx::NextOutOfRange => {
                self.push_raw(TX_QUEUE, &[RawDesc::new(h, 12).next(q.wrapping_add(7))])?
            }
            BadTx::WriteOnlyInTx => self.push_raw(
                TX_QUEUE,
                &[RawDesc::new(h, 12).next(1), RawDesc::new(f, 64).write()],
            )?,
            BadTx::NestedIndirect => {
                let mut allocs = Vec::new();
                let inner = self.write_indirect_table(
                    &[RawDesc::new(h, 12).next(1), RawDesc::new(f, 64)],
                    &mut allocs,
                )?;
                let outer =
                    self.write_indirect_table(&[RawDesc::new(inner, 32).indirect()], &mut allocs)?;
                self.push_raw(TX_QUEUE, &[RawDesc::new(outer, 16).indirect()])?
            }
            BadTx::IndirectBadLen => {
                let mut allocs = Vec::new();
                let t = self.write_indirect_table(
                    &[RawDesc::new(h, 12).next(1), RawDesc::new(f, 64)],
                    &mut allocs,
                )?;
                self.push_raw(TX_QUEUE, &[RawDesc::new(t, 24).indirect()])?
            }
            BadTx::HugeLen => self.push_raw(
                TX_QUEUE,
                &[RawDesc::new(h, 12).next(1), RawDesc::new(f, u32::MAX)],
            )?,
        };
        Ok(head)
    }

    /// Publish arbitrary descriptors as one chain on `queue` (head = `descs[0]`) and
    /// kick. The memory they point to is the caller's business (see `alloc_guest`).
    /// Their used entries are recorded in `raw_used`.
    pub fn push_raw(&mut self, queue: usize, descs: &[RawDesc]) -> Result<u16> {
        ensure!(!descs.is_empty(), "empty chain");
        self.make_room(queue, descs.len())?;
        let head = self.publish_chain(queue, descs, Vec::new(), ChainKind::Raw)?;
        self.notify(queue)?;
        Ok(head)
    }

    /// Write `table` into freshly allocated guest memory (never freed) as a
    /// descriptor table (`next` is an index within the table); returns its GPA, for
    /// indirect descriptors pushed with `push_raw`.
    pub fn alloc_table(&mut self, table: &[RawDesc]) -> Result<u64> {
        let mut allocs = Vec::new();
        self.write_indirect_table(table, &mut allocs)
    }

    /// Publish an avail index `ahead` entries past the real one on `queue` (nothing
    /// behind it) and kick: a ring no device can make sense of.
    pub fn jump_avail(&mut self, queue: usize, ahead: u16) -> Result<()> {
        let idx = self.queues[queue].avail_idx.wrapping_add(ahead);
        self.store_avail_idx(queue, idx)?;
        let q = &mut self.queues[queue];
        q.kick.write(1)?;
        q.stats.kicks += 1;
        Ok(())
    }

    /// Kick `queue` regardless of notification suppression.
    pub fn kick(&mut self, queue: usize) -> Result<()> {
        let q = &mut self.queues[queue];
        q.kick.write(1)?;
        q.stats.kicks += 1;
        Ok(())
    }

    /// Calls received on `queue` so far, taking any waiting on its call eventfd now.
    pub fn calls(&mut self, queue: usize) -> u64 {
        let q = &mut self.queues[queue];
        if let Ok(n) = q.call.read() {
            q.stats.calls += n;
        }
        q.stats.calls
    }

    /// Ask for a call on `queue` when a used entry past those taken so far appears
    /// (EVENT_IDX `used_event` = the last used index taken: `virtqueue_enable_cb`).
    pub fn ask_call(&mut self, queue: usize) -> Result<()> {
        let q = &self.queues[queue];
        self.mem.store(
            q.last_used.to_le(),
            GuestAddress(q.used_event_addr()),
            Ordering::Release,
        )?;
        fence(Ordering::SeqCst);
        Ok(())
    }

    /// Fill the counter of `queue`'s call eventfd to its maximum, as a guest that
    /// never takes its interrupts would: the device's next signal finds it full.
    pub fn fill_call(&mut self, queue: usize) -> Result<()> {
        let q = &self.queues[queue];
        let _ = q.call.read();
        q.call.write(u64::MAX - 1)?;
        Ok(())
    }

    /// Reclaim used TX chains until none is in flight; returns how many were reclaimed.
    /// Errors if some are still outstanding after `timeout`.
    pub fn wait_tx_done(&mut self, timeout: Duration) -> Result<usize> {
        let deadline = Instant::now() + timeout;
        let mut n = 0;
        while !self.queues[TX_QUEUE].inflight.is_empty() {
            match self.wait_used(TX_QUEUE, deadline)? {
                Some((id, len)) => {
                    self.complete_tx(id, len)?;
                    n += 1;
                }
                None => bail!(
                    "{} TX chains still in flight after {timeout:?} (reclaimed {n})",
                    self.queues[TX_QUEUE].inflight.len()
                ),
            }
        }
        Ok(n)
    }

    /// Reclaim whatever TX chains are already used, without waiting.
    pub fn reclaim_tx(&mut self) -> Result<usize> {
        let mut n = 0;
        while let Some((id, len)) = self.pop_used(TX_QUEUE)? {
            self.complete_tx(id, len)?;
            n += 1;
        }
        Ok(n)
    }

    fn complete_tx(&mut self, id: u16, len: u32) -> Result<()> {
        let inf = self.retire(TX_QUEUE, id)?;
        if matches!(inf.kind, ChainKind::Raw) {
            self.raw_used.push((TX_QUEUE, id, len));
        }
        self.tx_completions.push((id, len));
        Ok(())
    }

    // -----------------------------------------------------------------------------------
    // RX

    /// Post `count` RX buffers of `buf_size` bytes, each one writable descriptor (what
    /// Linux does with MRG_RXBUF), and kick.
    pub fn post_rx(&mut self, count: usize, buf_size: u32) -> Result<()> {
        self.post_rx_chains(count, &[buf_size])
    }

    /// Post `count` RX chains, each made of writable descriptors of the given sizes
    /// (e.g. `[12, 4096, 4096, ...]` like Linux's "big packets" mode), and kick once.
    pub fn post_rx_chains(&mut self, count: usize, sizes: &[u32]) -> Result<()> {
        self.publish_rx_chains(count, sizes)?;
        self.notify(RX_QUEUE)
    }

    /// Post `count` RX buffers of `buf_size` bytes and move the avail index, without
    /// a kick: a driver that looked at the device's wish for one before the device
    /// moved it.
    pub fn post_rx_unkicked(&mut self, count: usize, buf_size: u32) -> Result<()> {
        self.publish_rx_chains(count, &[buf_size])
    }

    /// `post_rx_chains` without the kick.
    fn publish_rx_chains(&mut self, count: usize, sizes: &[u32]) -> Result<()> {
        ensure!(!sizes.is_empty(), "empty RX chain");
        for _ in 0..count {
            ensure!(
                self.queues[RX_QUEUE].free.len() >= sizes.len(),
                "RX queue full ({} chains in flight)",
                self.queues[RX_QUEUE].inflight.len()
            );
            let mut allocs = Vec::new();
            let mut bufs = Vec::new();
            let mut descs = Vec::new();
            for (i, &s) in sizes.iter().enumerate() {
                let a = self.alloc(s as u64, 64)?;
                allocs.push((a, s as u64));
                bufs.push((a, s));
                let mut d = RawDesc::new(a, s).write();
                if i + 1 < sizes.len() {
                    d = d.next(i as u16 + 1);
                }
                descs.push(d);
            }
            self.publish_chain(RX_QUEUE, &descs, allocs, ChainKind::Rx(bufs))?;
        }
        Ok(())
    }

    /// Wait up to `timeout` for a frame; panics on device protocol violations
    /// (use `try_recv` to inspect them).
    pub fn recv(&mut self, timeout: Duration) -> Option<(VirtioNetHdr, Vec<u8>)> {
        match self.try_recv(timeout) {
            Ok(Some(f)) => Some((f.hdr, f.frame)),
            Ok(None) => None,
            Err(e) => panic!("recv: {e:#}"),
        }
    }

    /// Wait up to `timeout` for a frame. `Ok(None)` on timeout; `Err` when the device
    /// broke the protocol (bad used id or length, bad num_buffers, missing buffers).
    pub fn try_recv(&mut self, timeout: Duration) -> Result<Option<RxFrame>> {
        let deadline = Instant::now() + timeout;
        let mrg = self.has(feat::MRG_RXBUF);
        let (mut data, first_len, bufs_first) = loop {
            let Some((id, len)) = self.wait_used(RX_QUEUE, deadline)? else {
                return Ok(None);
            };
            match self.take_rx(id, len)? {
                Some(d) => break (d, len, 1u16),
                None => continue, // a raw chain, recorded in raw_used
            }
        };
        ensure!(
            first_len as usize >= HDR_LEN,
            "used length {first_len} shorter than the header"
        );
        let mut raw_hdr = [0u8; HDR_LEN];
        raw_hdr.copy_from_slice(&data[..HDR_LEN]);
        let hdr = super::wire_hdr::decode(&raw_hdr).map_err(|e| anyhow!("device header: {e}"))?;
        let nb = hdr.num_buffers;
        let mut buffers = bufs_first;
        if mrg {
            ensure!(nb >= 1, "num_buffers is 0");
            // The rest of the frame must already be there or follow shortly.
            let rest_deadline = deadline.max(Instant::now() + Duration::from_secs(1));
            while buffers < nb {
                let Some((id, len)) = self.wait_used(RX_QUEUE, rest_deadline)? else {
                    bail!("num_buffers {nb} but only {buffers} buffers arrived");
                };
                match self.take_rx(id, len)? {
                    Some(d) => {
                        data.extend_from_slice(&d);
                        buffers += 1;
                    }
                    None => continue,
                }
            }
        } else {
            ensure!(nb == 1, "num_buffers {nb} without MRG_RXBUF (must be 1)");
        }
        let frame = data.split_off(HDR_LEN);
        Ok(Some(RxFrame {
            hdr,
            raw_hdr,
            frame,
            buffers,
        }))
    }

    /// Collect frames until `timeout` passes with nothing new.
    pub fn recv_all(&mut self, idle: Duration) -> Vec<(VirtioNetHdr, Vec<u8>)> {
        let mut v = Vec::new();
        while let Some(f) = self.recv(idle) {
            v.push(f);
        }
        v
    }

    /// Read the data of a used RX chain and re-post (or retire) it. None for raw chains.
    fn take_rx(&mut self, id: u16, len: u32) -> Result<Option<Vec<u8>>> {
        let q = &self.queues[RX_QUEUE];
        let inf = q
            .inflight
            .get(&id)
            .ok_or_else(|| anyhow!("device used RX id {id} that is not in flight"))?;
        let bufs = match &inf.kind {
            ChainKind::Rx(b) => b.clone(),
            _ => {
                self.retire(RX_QUEUE, id)?;
                self.raw_used.push((RX_QUEUE, id, len));
                return Ok(None);
            }
        };
        let cap: u64 = bufs.iter().map(|b| b.1 as u64).sum();
        ensure!(
            len as u64 <= cap,
            "device used {len} bytes of a {cap}-byte RX chain (id {id})"
        );
        let mut out = vec![0u8; len as usize];
        let mut off = 0usize;
        for (a, l) in bufs {
            if off == out.len() {
                break;
            }
            let n = (l as usize).min(out.len() - off);
            self.mem
                .read_slice(&mut out[off..off + n], GuestAddress(a))?;
            off += n;
        }
        if self.opts.auto_repost {
            // The descriptors are untouched: publish the same head again.
            self.republish(RX_QUEUE, id)?;
            self.notify(RX_QUEUE)?;
        } else {
            self.retire(RX_QUEUE, id)?;
        }
        Ok(Some(out))
    }

    // -----------------------------------------------------------------------------------
    // Ring mechanics

    fn alloc(&mut self, len: u64, align: u64) -> Result<u64> {
        self.arena
            .alloc(len, align)
            .ok_or_else(|| anyhow!("guest memory exhausted allocating {len} bytes"))
    }

    /// Ensure `ndesc` free descriptors, reclaiming (and waiting for) TX if needed.
    fn make_room(&mut self, queue: usize, ndesc: usize) -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(2);
        while self.queues[queue].free.len() < ndesc {
            ensure!(
                queue == TX_QUEUE && !self.queues[TX_QUEUE].inflight.is_empty(),
                "queue {queue}: {} free descriptors, need {ndesc}",
                self.queues[queue].free.len()
            );
            match self.wait_used(TX_QUEUE, deadline)? {
                Some((id, len)) => self.complete_tx(id, len)?,
                None => bail!("TX queue full and the backend is not completing chains"),
            }
        }
        Ok(())
    }

    /// Allocate memory for TX data, reclaiming (and waiting for) TX chains if needed.
    fn alloc_tx(&mut self, len: u64, align: u64) -> Result<u64> {
        let deadline = Instant::now() + Duration::from_secs(2);
        loop {
            if let Some(a) = self.arena.alloc(len, align) {
                return Ok(a);
            }
            ensure!(
                !self.queues[TX_QUEUE].inflight.is_empty(),
                "guest memory exhausted allocating {len} bytes"
            );
            match self.wait_used(TX_QUEUE, deadline)? {
                Some((id, l)) => self.complete_tx(id, l)?,
                None => bail!("guest memory full and the backend is not completing TX"),
            }
        }
    }

    fn write_indirect_table(
        &mut self,
        table: &[RawDesc],
        allocs: &mut Vec<(u64, u64)>,
    ) -> Result<u64> {
        let len = 16 * table.len() as u64;
        let t = self.alloc_tx(len, 16)?;
        allocs.push((t, len));
        for (i, d) in table.iter().enumerate() {
            let mut flags = d.flags;
            let mut next = 0;
            if let Some(n) = d.next {
                flags |= VRING_DESC_F_NEXT as u16;
                next = n;
            }
            let desc = Descriptor::new(d.addr, d.len, flags, next);
            self.mem.write_obj(desc, GuestAddress(t + 16 * i as u64))?;
        }
        Ok(t)
    }

    /// Write `descs` into free ring descriptors and make the chain available.
    fn publish_chain(
        &mut self,
        queue: usize,
        descs: &[RawDesc],
        allocs: Vec<(u64, u64)>,
        kind: ChainKind,
    ) -> Result<u16> {
        let q = &mut self.queues[queue];
        ensure!(q.free.len() >= descs.len(), "queue {queue} full");
        let ids: Vec<u16> = (0..descs.len()).map(|_| q.free.pop().unwrap()).collect();
        for (i, d) in descs.iter().enumerate() {
            let mut flags = d.flags;
            let mut next = 0;
            if let Some(n) = d.next {
                flags |= VRING_DESC_F_NEXT as u16;
                next = ids.get(n as usize).copied().unwrap_or(n);
            }
            let desc = Descriptor::new(d.addr, d.len, flags, next);
            self.mem
                .write_obj(desc, GuestAddress(q.desc + 16 * ids[i] as u64))?;
        }
        let head = ids[0];
        q.order.push_back(head);
        q.inflight.insert(
            head,
            Inflight {
                descs: ids,
                allocs,
                kind,
            },
        );
        self.republish(queue, head)?;
        Ok(head)
    }

    /// Put `head` in the avail ring and publish the new avail index (release).
    fn republish(&mut self, queue: usize, head: u16) -> Result<()> {
        let q = &mut self.queues[queue];
        let slot = q.avail + 4 + 2 * (q.avail_idx % q.size) as u64;
        self.mem.write_obj(head.to_le(), GuestAddress(slot))?;
        q.avail_idx = q.avail_idx.wrapping_add(1);
        q.stats.published += 1;
        if self.batching {
            return Ok(());
        }
        let idx = q.avail_idx;
        self.store_avail_idx(queue, idx)
    }

    /// Publish `idx` as `queue`'s avail index. Release: the descriptors and ring
    /// entries written before are visible before it.
    fn store_avail_idx(&self, queue: usize, idx: u16) -> Result<()> {
        let q = &self.queues[queue];
        self.mem
            .store(idx.to_le(), GuestAddress(q.avail + 2), Ordering::Release)?;
        Ok(())
    }

    /// Kick unless the device suppressed notifications (EVENT_IDX avail_event, or
    /// VRING_USED_F_NO_NOTIFY), like virtqueue_kick_prepare().
    fn notify(&mut self, queue: usize) -> Result<()> {
        let event_idx = self.has(feat::EVENT_IDX);
        let q = &mut self.queues[queue];
        fence(Ordering::SeqCst);
        let new = q.avail_idx;
        let old_idx = q.kicked_idx;
        let kick = if self.opts.always_kick {
            true
        } else if event_idx {
            let ev: u16 = self
                .mem
                .load(GuestAddress(q.avail_event_addr()), Ordering::Acquire)?;
            // vring_need_event(event, new, old)
            new.wrapping_sub(ev).wrapping_sub(1) < new.wrapping_sub(old_idx)
        } else {
            let flags: u16 = self.mem.load(GuestAddress(q.used), Ordering::Acquire)?;
            flags & VRING_USED_F_NO_NOTIFY as u16 == 0
        };
        q.kicked_idx = new;
        if kick {
            q.kick.write(1)?;
            q.stats.kicks += 1;
        } else {
            q.stats.kicks_suppressed += 1;
        }
        Ok(())
    }

    /// Pop one used entry if the device produced one (acquire on used->idx).
    fn pop_used(&mut self, queue: usize) -> Result<Option<(u16, u32)>> {
        let in_order = self.has(feat::IN_ORDER);
        let q = &mut self.queues[queue];
        let idx: u16 = self.mem.load(GuestAddress(q.used + 2), Ordering::Acquire)?;
        if idx == q.last_used {
            return Ok(None);
        }
        ensure!(
            idx.wrapping_sub(q.last_used) <= q.size,
            "used idx jumped from {} to {idx} (queue {queue})",
            q.last_used
        );
        let e = q.used + 4 + 8 * (q.last_used % q.size) as u64;
        let read = |mem: &GuestMemoryMmap<()>| -> Result<(u32, u32)> {
            Ok((
                mem.read_obj(GuestAddress(e))?,
                mem.read_obj(GuestAddress(e + 4))?,
            ))
        };
        if in_order {
            // 2.7.9: one used element may stand for a batch, naming its last buffer
            // in the first slot; the buffers up to it are used in the order they
            // were made available.
            let (last, len) = match q.batch_last {
                Some(b) => b,
                None => {
                    let (id, len) = read(&self.mem)?;
                    ensure!(
                        id < q.size as u32 && q.order.contains(&(id as u16)),
                        "queue {queue}: in-order used element names id {id}, not in flight"
                    );
                    (id as u16, len)
                }
            };
            let id = q
                .order
                .pop_front()
                .expect("a batch's buffers are in flight");
            q.batch_last = (id != last).then_some((last, len));
            q.last_used = q.last_used.wrapping_add(1);
            q.stats.used += 1;
            return Ok(Some((id, if id == last { len } else { 0 })));
        }
        let (id, len) = read(&self.mem)?;
        q.last_used = q.last_used.wrapping_add(1);
        q.stats.used += 1;
        ensure!(
            id < q.size as u32 && q.inflight.contains_key(&(id as u16)),
            "queue {queue}: device returned id {id} that is not in flight"
        );
        Ok(Some((id as u16, len)))
    }

    /// Pop a used entry, sleeping on the call eventfd until `deadline`.
    fn wait_used(&mut self, queue: usize, deadline: Instant) -> Result<Option<(u16, u32)>> {
        let event_idx = self.has(feat::EVENT_IDX);
        loop {
            // Account for calls that arrived while we were not sleeping.
            let q = &mut self.queues[queue];
            if let Ok(n) = q.call.read() {
                q.stats.calls += n;
            }
            if let Some(e) = self.pop_used(queue)? {
                return Ok(Some(e));
            }
            // Re-arm: ask for a call when the next used entry appears, then re-check
            // (virtqueue_enable_cb + the race re-check).
            if event_idx {
                self.ask_call(queue)?;
            }
            fence(Ordering::SeqCst);
            if let Some(e) = self.pop_used(queue)? {
                return Ok(Some(e));
            }
            let now = Instant::now();
            if now >= deadline {
                return Ok(None);
            }
            let q = &mut self.queues[queue];
            let ms = (deadline - now).as_millis().clamp(1, i32::MAX as u128) as i32;
            let mut pfd = libc::pollfd {
                fd: q.call.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one valid pollfd.
            let r = unsafe { libc::poll(&mut pfd, 1, ms) };
            if r > 0 {
                if let Ok(n) = q.call.read() {
                    q.stats.calls += n;
                }
            }
        }
    }

    /// Remove a completed chain and free its descriptors and memory.
    fn retire(&mut self, queue: usize, id: u16) -> Result<Inflight> {
        let q = &mut self.queues[queue];
        let inf = q
            .inflight
            .remove(&id)
            .ok_or_else(|| anyhow!("queue {queue}: id {id} not in flight"))?;
        if let Some(at) = q.order.iter().position(|&h| h == id) {
            q.order.remove(at);
        }
        q.free.extend(inf.descs.iter().rev());
        for &(a, l) in &inf.allocs {
            self.arena.free(a, l);
        }
        Ok(Inflight {
            descs: inf.descs,
            allocs: Vec::new(),
            kind: inf.kind,
        })
    }
}

//! A fast vhost-user frontend that loads a virtio-net backend with 64 KB TCP/IPv4 TSO
//! frames, for capacity benchmarks (gsonet, or DPDK testpmd's vhost PMD with `tso=1`).
//! Not part of gsonet.
//!
//! ```text
//! cargo build --release --example tso_loadgen
//! taskset -c 0 target/release/examples/tso_loadgen --a A.sock --b B.sock --seconds 8 --json
//! ```
//!
//! It connects as the frontend (the backend listens) to two ports, A and B, acks
//! VERSION_1, MRG_RXBUF, CSUM, GUEST_CSUM, HOST_TSO4 and GUEST_TSO4 (all required) plus
//! EVENT_IDX and INDIRECT_DESC when offered, and shares a sealed memfd as each port's
//! guest memory. B first sends a gratuitous ARP (so a learning switch knows its MAC),
//! then A's TX queue is kept full of TSO frames (virtio_net_hdr NEEDS_CSUM, gso_type
//! TCPV4, gso_size `--mss`, the TCP checksum field holding the pseudo-header sum over
//! the whole TCP length, as Linux sends them) addressed to B's MAC. Every frame is a
//! header descriptor (virtio header + Ethernet/IPv4/TCP) followed by the payload in
//! 4 KB descriptors, like an skb's linear part and page frags; with INDIRECT_DESC (as
//! Linux uses it for TX) the chain sits in an indirect table.
//!
//! All frames and descriptor chains are built once in guest memory at start-up: while
//! running, TX costs reclaiming a used entry and re-posting its head, RX costs reading
//! the 12-byte header and the L2-L4 headers of the first buffer and re-posting the
//! buffers. Both ports are busy-polled from one thread: calls are suppressed
//! (VRING_AVAIL_F_NO_INTERRUPT, or used_event kept out of reach with EVENT_IDX) and the
//! backend is kicked only when it asks (VRING_USED_F_NO_NOTIFY / avail_event).
//!
//! B's RX counts, over `--seconds` after `--warmup`: frames whose header says GSO TCPv4
//! and whose IPv4/TCP headers are valid (`frames`, `bytes`: Ethernet frame bytes, no
//! virtio header); frames the backend segmented (`segments_rx`, `segment_bytes`);
//! frames delivered whole but without GSO metadata (`nogso_large`); invalid ones
//! (`bad`). `--bidir` also sends B->A and sums both directions.

use std::fs::File;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{fence, AtomicU16, Ordering};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, ensure, Context, Result};
use clap::Parser;
use vhost::vhost_user::message::{
    VhostUserHeaderFlag, VhostUserProtocolFeatures, VhostUserVirtioFeatures,
};
use vhost::vhost_user::{Frontend, VhostUserFrontend};
use vhost::{VhostBackend, VhostUserMemoryRegionInfo, VringConfigData};
use vm_memory::{FileOffset, GuestAddress, GuestMemoryBackend, GuestMemoryMmap};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

// Feature bits.
const F_CSUM: u64 = 1 << 0;
const F_GUEST_CSUM: u64 = 1 << 1;
const F_GUEST_TSO4: u64 = 1 << 7;
const F_HOST_TSO4: u64 = 1 << 11;
const F_MRG_RXBUF: u64 = 1 << 15;
const F_INDIRECT_DESC: u64 = 1 << 28;
const F_EVENT_IDX: u64 = 1 << 29;
const F_PROTOCOL_FEATURES: u64 = 1 << 30;
const F_VERSION_1: u64 = 1 << 32;
const REQUIRED: [(u64, &str); 6] = [
    (F_VERSION_1, "VERSION_1"),
    (F_MRG_RXBUF, "MRG_RXBUF"),
    (F_CSUM, "CSUM"),
    (F_GUEST_CSUM, "GUEST_CSUM"),
    (F_HOST_TSO4, "HOST_TSO4"),
    (F_GUEST_TSO4, "GUEST_TSO4"),
];

// Ring flags.
const DESC_F_NEXT: u16 = 1;
const DESC_F_WRITE: u16 = 2;
const DESC_F_INDIRECT: u16 = 4;
const AVAIL_F_NO_INTERRUPT: u16 = 1;
const USED_F_NO_NOTIFY: u16 = 1;

// virtio_net_hdr_v1.
const HDR_LEN: usize = 12;
const HDR_F_NEEDS_CSUM: u8 = 1;
const GSO_NONE: u8 = 0;
const GSO_TCPV4: u8 = 1;

const ETH_LEN: usize = 14;
const IP_LEN: usize = 20;
const TCP_LEN: usize = 20;
const L2L4: usize = ETH_LEN + IP_LEN + TCP_LEN;
const PIECE: usize = 4096;
const PAGE: u64 = 4096;
const RX_QUEUE: usize = 0;
const TX_QUEUE: usize = 1;

#[derive(Parser, Debug)]
#[command(about = "Load a vhost-user virtio-net backend with 64 KB TCP TSO frames from A to B")]
struct Args {
    /// Socket of port A (the sender); the backend listens on it.
    #[arg(long)]
    a: PathBuf,
    /// Socket of port B (the receiver).
    #[arg(long)]
    b: PathBuf,
    /// Ethernet frame size in bytes (headers included, virtio header not): at most 65549.
    #[arg(long, default_value_t = 65536)]
    size: usize,
    /// TCP segment size written as gso_size.
    #[arg(long, default_value_t = 1448)]
    mss: u16,
    /// Measured seconds.
    #[arg(long, default_value_t = 8.0)]
    seconds: f64,
    /// Seconds of traffic before measuring.
    #[arg(long, default_value_t = 1.0)]
    warmup: f64,
    /// Size of every virtqueue (a power of two).
    #[arg(long, default_value_t = 256)]
    queue_size: u16,
    /// Size of each RX buffer (one writable descriptor each, merged with MRG_RXBUF).
    #[arg(long, default_value_t = 4096)]
    rx_buf: u32,
    /// Also send B -> A (to A's MAC) and count what A receives.
    #[arg(long)]
    bidir: bool,
    /// B acks neither GUEST_TSO4 nor GUEST_CSUM: the backend must segment A's frames
    /// and complete their checksums (counted as segments_rx).
    #[arg(long)]
    b_no_offload: bool,
    /// Do not use indirect descriptors for TX even if offered.
    #[arg(long)]
    no_indirect: bool,
    /// Do not ack EVENT_IDX even if offered.
    #[arg(long)]
    no_event_idx: bool,
    /// Do not seal the guest memory memfd.
    #[arg(long)]
    no_seal: bool,
    /// MAC of port A.
    #[arg(long, default_value = "02:00:00:00:00:0a")]
    mac_a: String,
    /// MAC of port B.
    #[arg(long, default_value = "02:00:00:00:00:0b")]
    mac_b: String,
    /// How long to retry connecting to a socket.
    #[arg(long, default_value_t = 3.0)]
    connect_timeout: f64,
    /// Verify the complete TCP checksum of one received non-GSO frame without
    /// NEEDS_CSUM in this many (0: never).
    #[arg(long, default_value_t = 64)]
    verify_every: u32,
    /// Print one JSON line on stdout (otherwise a readable summary).
    #[arg(long)]
    json: bool,
}

fn parse_mac(s: &str) -> Result<[u8; 6]> {
    let v: Vec<u8> = s
        .split(':')
        .map(|p| u8::from_str_radix(p, 16))
        .collect::<std::result::Result<_, _>>()
        .map_err(|_| anyhow!("bad MAC {s:?}"))?;
    ensure!(v.len() == 6, "bad MAC {s:?}");
    Ok(v.try_into().unwrap())
}

// ---------------------------------------------------------------------------------------
// Guest memory: one sealed memfd mapped once; GPA 0 is its first byte.

struct Memory {
    _mmap: GuestMemoryMmap<()>,
    _file: File,
    base: *mut u8,
    size: u64,
    next: u64,
}

impl Memory {
    fn new(size: u64, seal: bool) -> Result<Self> {
        let file = gsonet::sys::fd::guest_memfd(size, seal)?;
        let fo = FileOffset::new(file.try_clone()?, 0);
        let mmap = GuestMemoryMmap::<()>::from_ranges_with_files([(
            GuestAddress(0),
            size as usize,
            Some(fo),
        )])
        .map_err(|e| anyhow!("guest memory: {e:?}"))?;
        let base = mmap
            .get_host_address(GuestAddress(0))
            .map_err(|e| anyhow!("guest memory: {e:?}"))?;
        Ok(Memory {
            _mmap: mmap,
            _file: file,
            base,
            size,
            // GPA 0 is never a buffer.
            next: PAGE,
        })
    }

    fn regions(&self) -> Result<Vec<VhostUserMemoryRegionInfo>> {
        self._mmap
            .iter()
            .map(VhostUserMemoryRegionInfo::from_guest_region)
            .collect::<std::result::Result<_, _>>()
            .map_err(|e| anyhow!("region info: {e:?}"))
    }

    fn alloc(&mut self, len: u64, align: u64) -> u64 {
        let a = self.next.next_multiple_of(align);
        self.next = a + len;
        assert!(self.next <= self.size, "guest memory layout overflow");
        a
    }

    #[inline(always)]
    fn ptr<T>(&self, gpa: u64) -> *mut T {
        debug_assert!(gpa + std::mem::size_of::<T>() as u64 <= self.size);
        // SAFETY: gpa within the mapping (every address comes from `alloc`, or from a
        // used entry checked against the queue size).
        unsafe { self.base.add(gpa as usize) as *mut T }
    }

    fn hva(&self, gpa: u64) -> u64 {
        self.base as u64 + gpa
    }

    #[inline(always)]
    fn write<T: Copy>(&self, gpa: u64, v: T) {
        // SAFETY: see `ptr`; unaligned-safe.
        unsafe { std::ptr::write_unaligned(self.ptr::<T>(gpa), v) }
    }

    fn write_bytes(&self, gpa: u64, b: &[u8]) {
        assert!(gpa + b.len() as u64 <= self.size);
        // SAFETY: bounds checked above.
        unsafe { std::ptr::copy_nonoverlapping(b.as_ptr(), self.ptr::<u8>(gpa), b.len()) }
    }

    #[inline(always)]
    fn bytes(&self, gpa: u64, len: usize) -> &[u8] {
        assert!(gpa + len as u64 <= self.size);
        // SAFETY: bounds checked; the device may write concurrently only into buffers
        // we do not own, and we read a used buffer only after the acquire on used->idx.
        unsafe { std::slice::from_raw_parts(self.ptr::<u8>(gpa), len) }
    }

    #[inline(always)]
    fn atomic16(&self, gpa: u64) -> &AtomicU16 {
        assert!(gpa.is_multiple_of(2) && gpa + 2 <= self.size);
        // SAFETY: aligned, within the mapping, shared with the device.
        unsafe { &*self.ptr::<AtomicU16>(gpa) }
    }
}

// ---------------------------------------------------------------------------------------
// One split virtqueue, driver side.

struct Vring {
    size: u16,
    desc: u64,
    avail: u64,
    used: u64,
    avail_idx: u16,
    last_used: u16,
    /// avail->idx at the last kick decision.
    kicked_idx: u16,
    kick: EventFd,
    call: EventFd,
    kicks: u64,
    /// Heads the device owns; a used id not among them is a device bug.
    inflight: Vec<bool>,
}

impl Vring {
    fn new(mem: &mut Memory, size: u16) -> Result<Self> {
        let q = size as u64;
        Ok(Vring {
            size,
            desc: mem.alloc(16 * q, PAGE),
            avail: mem.alloc(6 + 2 * q, PAGE),
            used: mem.alloc(6 + 8 * q, PAGE),
            avail_idx: 0,
            last_used: 0,
            kicked_idx: 0,
            kick: EventFd::new(EFD_NONBLOCK)?,
            call: EventFd::new(EFD_NONBLOCK)?,
            kicks: 0,
            inflight: vec![false; size as usize],
        })
    }

    fn set_desc(&self, mem: &Memory, i: u16, addr: u64, len: u32, flags: u16, next: u16) {
        write_desc(mem, self.desc + 16 * i as u64, addr, len, flags, next);
    }

    #[inline(always)]
    fn push_avail(&mut self, mem: &Memory, head: u16) {
        let slot = self.avail + 4 + 2 * (self.avail_idx & (self.size - 1)) as u64;
        mem.write(slot, head.to_le());
        self.inflight[head as usize] = true;
        self.avail_idx = self.avail_idx.wrapping_add(1);
    }

    /// Publish avail->idx (release) and kick if the device asks for it.
    #[inline(always)]
    fn publish(&mut self, mem: &Memory, event_idx: bool) {
        mem.atomic16(self.avail + 2)
            .store(self.avail_idx.to_le(), Ordering::Release);
        fence(Ordering::SeqCst);
        let new = self.avail_idx;
        let old = self.kicked_idx;
        self.kicked_idx = new;
        let kick = if event_idx {
            let ev = u16::from_le(
                mem.atomic16(self.used + 4 + 8 * self.size as u64)
                    .load(Ordering::Acquire),
            );
            // vring_need_event(event, new, old)
            new.wrapping_sub(ev).wrapping_sub(1) < new.wrapping_sub(old)
        } else {
            u16::from_le(mem.atomic16(self.used).load(Ordering::Acquire)) & USED_F_NO_NOTIFY == 0
        };
        if kick {
            let _ = self.kick.write(1);
            self.kicks += 1;
        }
    }

    /// Keep calls suppressed: with EVENT_IDX, used_event half the index space ahead.
    #[inline(always)]
    fn suppress_calls(&self, mem: &Memory, event_idx: bool) {
        if event_idx {
            let ev = self.last_used.wrapping_add(0x8000);
            mem.atomic16(self.avail + 4 + 2 * self.size as u64)
                .store(ev.to_le(), Ordering::Relaxed);
        }
    }

    /// Next used entry (acquire on used->idx).
    #[inline(always)]
    fn pop_used(&mut self, mem: &Memory, used_idx: u16) -> Option<(u16, u32)> {
        if used_idx == self.last_used {
            return None;
        }
        let e = self.used + 4 + 8 * (self.last_used & (self.size - 1)) as u64;
        // SAFETY: within the used ring.
        let (id, len) = unsafe {
            (
                u32::from_le(std::ptr::read_volatile(mem.ptr::<u32>(e))),
                u32::from_le(std::ptr::read_volatile(mem.ptr::<u32>(e + 4))),
            )
        };
        self.last_used = self.last_used.wrapping_add(1);
        if id >= self.size as u32 || !self.inflight[id as usize] {
            eprintln!("tso_loadgen: error: the device returned used id {id}, not in flight");
            std::process::exit(3);
        }
        self.inflight[id as usize] = false;
        Some((id as u16, len))
    }

    #[inline(always)]
    fn used_idx(&self, mem: &Memory) -> u16 {
        u16::from_le(mem.atomic16(self.used + 2).load(Ordering::Acquire))
    }
}

fn write_desc(mem: &Memory, at: u64, addr: u64, len: u32, flags: u16, next: u16) {
    mem.write(at, addr.to_le());
    mem.write(at + 8, len.to_le());
    mem.write(at + 12, flags.to_le());
    mem.write(at + 14, next.to_le());
}

// ---------------------------------------------------------------------------------------
// Counters

#[derive(Clone, Copy, Default, Debug)]
struct Counters {
    tx_frames: u64,
    tx_bytes: u64,
    /// Intact GSO TCPv4 frames (or, when sending frames that need no GSO, frames of the
    /// size sent).
    rx_frames: u64,
    rx_bytes: u64,
    /// Segments the backend made (non-GSO TCP frames of at most 1514 bytes).
    rx_segments: u64,
    rx_segment_bytes: u64,
    /// TCP frames larger than 1514 bytes delivered without GSO metadata.
    rx_nogso_large: u64,
    rx_nogso_large_bytes: u64,
    /// Frames that are not our TCP flow (ARP...).
    rx_other: u64,
    /// Invalid frames (bad IPv4 checksum, length mismatch, wrong MAC...).
    rx_bad: u64,
    rx_buffers: u64,
    /// Frames (ours, any kind) whose header has NEEDS_CSUM.
    rx_needs_csum: u64,
    /// Complete TCP checksums verified (sampled), and those found wrong.
    csum_checked: u64,
    csum_bad: u64,
}

impl Counters {
    fn sub(&self, o: &Counters) -> Counters {
        Counters {
            tx_frames: self.tx_frames - o.tx_frames,
            tx_bytes: self.tx_bytes - o.tx_bytes,
            rx_frames: self.rx_frames - o.rx_frames,
            rx_bytes: self.rx_bytes - o.rx_bytes,
            rx_segments: self.rx_segments - o.rx_segments,
            rx_segment_bytes: self.rx_segment_bytes - o.rx_segment_bytes,
            rx_nogso_large: self.rx_nogso_large - o.rx_nogso_large,
            rx_nogso_large_bytes: self.rx_nogso_large_bytes - o.rx_nogso_large_bytes,
            rx_other: self.rx_other - o.rx_other,
            rx_bad: self.rx_bad - o.rx_bad,
            rx_buffers: self.rx_buffers - o.rx_buffers,
            rx_needs_csum: self.rx_needs_csum - o.rx_needs_csum,
            csum_checked: self.csum_checked - o.csum_checked,
            csum_bad: self.csum_bad - o.csum_bad,
        }
    }
}

// ---------------------------------------------------------------------------------------
// A port: one vhost-user connection, RX queue 0 and TX queue 1.

struct Port {
    name: &'static str,
    vu: Frontend,
    mem: Memory,
    rx: Vring,
    tx: Vring,
    event_idx: bool,
    indirect: bool,
    mac: [u8; 6],
    // TX
    /// Heads of the prebuilt frame chains, ready to post.
    tx_ready: Vec<u16>,
    tx_slots: usize,
    /// Descriptor reserved for one-off frames (the ARP).
    ctl_head: u16,
    ctl_buf: u64,
    ctl_busy: bool,
    gso: bool,
    frame_len: usize,
    // RX
    rx_bufs: u64,
    rx_buf_size: u32,
    /// Buffers still to come for the frame being gathered.
    rx_left: u16,
    rx_cur: RxFrame,
    /// Verify the TCP checksum of one frame in this many (0: never).
    verify_every: u32,
    verify_ctr: u32,
    c: Counters,
}

#[derive(Clone, Copy, Default)]
struct RxFrame {
    len: usize,
    kind: RxKind,
    ip_len: usize,
    /// Verify the TCP checksum of this frame (sampled, frames without NEEDS_CSUM).
    verify: bool,
    sum: u64,
    odd: bool,
    pseudo: u32,
}

#[derive(Clone, Copy, Default, PartialEq, Eq)]
enum RxKind {
    #[default]
    Other,
    Bad,
    Gso,
    Plain,
}

fn connect(path: &Path, timeout: Duration) -> Result<UnixStream> {
    let deadline = Instant::now() + timeout;
    loop {
        match UnixStream::connect(path) {
            Ok(s) => return Ok(s),
            Err(e) if Instant::now() < deadline => {
                let _ = e;
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => {
                return Err(e).with_context(|| format!("cannot connect to {}", path.display()))
            }
        }
    }
}

impl Port {
    #[allow(clippy::too_many_arguments)]
    fn open(
        name: &'static str,
        path: &Path,
        args: &Args,
        mac: [u8; 6],
        peer_mac: [u8; 6],
        send: bool,
        rx_offload: bool,
    ) -> Result<Self> {
        // Without RX offloads the receiver acks neither GUEST_TSO4 nor GUEST_CSUM.
        let required: Vec<(u64, &str)> = REQUIRED
            .iter()
            .copied()
            .filter(|(b, _)| rx_offload || *b & (F_GUEST_TSO4 | F_GUEST_CSUM) == 0)
            .collect();
        let qs = args.queue_size;
        ensure!(
            qs.is_power_of_two() && (64..=32768).contains(&qs),
            "--queue-size must be a power of two in 64..=32768"
        );
        ensure!(
            args.size > L2L4 && args.size <= ETH_LEN + 65535,
            "--size must be in {}..=65549",
            L2L4 + 1
        );
        ensure!(args.rx_buf >= 256, "--rx-buf too small");
        let stream = connect(path, Duration::from_secs_f64(args.connect_timeout))?;
        stream.set_read_timeout(Some(Duration::from_secs(5)))?;
        stream.set_write_timeout(Some(Duration::from_secs(5)))?;
        let mut vu = Frontend::from_stream(stream, 2);

        let offered = vu.get_features().context("GET_FEATURES")?;
        let missing: Vec<&str> = required
            .iter()
            .filter(|(b, _)| offered & b == 0)
            .map(|(_, n)| *n)
            .collect();
        if !missing.is_empty() {
            bail!(
                "backend does not offer {} (offered {offered:#x})",
                missing.join(", ")
            );
        }
        let use_proto = offered & VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits() != 0;
        if use_proto {
            let pf = vu
                .get_protocol_features()
                .context("GET_PROTOCOL_FEATURES")?;
            let want = pf & (VhostUserProtocolFeatures::MQ | VhostUserProtocolFeatures::REPLY_ACK);
            vu.set_protocol_features(want)
                .context("SET_PROTOCOL_FEATURES")?;
            if want.contains(VhostUserProtocolFeatures::REPLY_ACK) {
                vu.set_hdr_flags(VhostUserHeaderFlag::NEED_REPLY);
            }
            if want.contains(VhostUserProtocolFeatures::MQ) {
                let n = vu.get_queue_num().context("GET_QUEUE_NUM")?;
                ensure!(n >= 2, "backend reports {n} queues");
            }
        }
        vu.set_owner().context("SET_OWNER")?;
        let mut acked = required.iter().fold(0, |a, (b, _)| a | b);
        if !args.no_event_idx {
            acked |= offered & F_EVENT_IDX;
        }
        if !args.no_indirect {
            acked |= offered & F_INDIRECT_DESC;
        }
        if use_proto {
            acked |= F_PROTOCOL_FEATURES;
        }
        vu.set_features(acked).context("SET_FEATURES")?;
        let event_idx = acked & F_EVENT_IDX != 0;
        let indirect = acked & F_INDIRECT_DESC != 0;

        // Layout.
        let frame_len = args.size;
        let payload = frame_len - L2L4;
        let pieces = payload.div_ceil(PIECE);
        let chain = 1 + pieces; // header descriptor + payload pieces
        ensure!(
            chain < qs as usize || indirect,
            "a frame needs {chain} descriptors: --queue-size {qs} too small without INDIRECT_DESC"
        );
        let tx_slots = if !send {
            0
        } else if indirect {
            qs as usize - 1
        } else {
            (qs as usize - 1) / chain
        };
        let payload_span = (pieces as u64) * PIECE as u64;
        let need = 16 * PAGE // GPA 0, the control buffer, alignment
            + 2 * (16 + 6 + 2 + 8) * qs as u64 // two rings
            + qs as u64 * args.rx_buf as u64
            + tx_slots as u64 * (payload_span + 128 + 16 * chain as u64);
        let size = (need + (2 << 20)).next_multiple_of(2 << 20);
        let mut mem = Memory::new(size, !args.no_seal)?;
        vu.set_mem_table(&mem.regions()?).context("SET_MEM_TABLE")?;

        let rx = Vring::new(&mut mem, qs)?;
        let tx = Vring::new(&mut mem, qs)?;
        let rx_bufs = mem.alloc(qs as u64 * args.rx_buf as u64, PAGE);
        let ctl_buf = mem.alloc(PAGE, PAGE);

        let mut port = Port {
            name,
            vu,
            mem,
            rx,
            tx,
            event_idx,
            indirect,
            mac,
            tx_ready: Vec::with_capacity(tx_slots),
            tx_slots,
            ctl_head: qs - 1,
            ctl_buf,
            ctl_busy: false,
            gso: payload > args.mss as usize,
            frame_len,
            rx_bufs,
            rx_buf_size: args.rx_buf,
            rx_left: 0,
            rx_cur: RxFrame::default(),
            verify_every: args.verify_every,
            verify_ctr: 0,
            c: Counters::default(),
        };
        port.build_tx(tx_slots, peer_mac, args.mss, chain)?;

        // Rings.
        for (i, q) in [&port.rx, &port.tx].into_iter().enumerate() {
            let vu = &mut port.vu;
            vu.set_vring_num(i, qs).context("SET_VRING_NUM")?;
            vu.set_vring_base(i, 0).context("SET_VRING_BASE")?;
            let cfg = VringConfigData {
                queue_max_size: qs,
                queue_size: qs,
                flags: 0,
                desc_table_addr: port.mem.hva(q.desc),
                used_ring_addr: port.mem.hva(q.used),
                avail_ring_addr: port.mem.hva(q.avail),
                log_addr: None,
            };
            vu.set_vring_addr(i, &cfg).context("SET_VRING_ADDR")?;
            vu.set_vring_kick(i, &q.kick).context("SET_VRING_KICK")?;
            vu.set_vring_call(i, &q.call).context("SET_VRING_CALL")?;
        }
        if use_proto {
            for i in 0..2 {
                port.vu
                    .set_vring_enable(i, true)
                    .context("SET_VRING_ENABLE")?;
            }
        }

        // Interrupts off: we poll.
        for q in [&port.rx, &port.tx] {
            if !event_idx {
                port.mem.write(q.avail, AVAIL_F_NO_INTERRUPT.to_le());
            }
            q.suppress_calls(&port.mem, event_idx);
        }
        // Post every RX buffer.
        for i in 0..qs {
            let a = port.rx_bufs + i as u64 * port.rx_buf_size as u64;
            port.rx
                .set_desc(&port.mem, i, a, port.rx_buf_size, DESC_F_WRITE, 0);
            port.rx.push_avail(&port.mem, i);
        }
        port.rx.publish(&port.mem, event_idx);
        Ok(port)
    }

    /// Build every TX frame and its chain once.
    fn build_tx(&mut self, slots: usize, dst: [u8; 6], mss: u16, chain: usize) -> Result<()> {
        let payload = self.frame_len - L2L4;
        let (sip, dip) = if self.name == "A" {
            ([10, 0, 0, 1], [10, 0, 0, 2])
        } else {
            ([10, 0, 0, 2], [10, 0, 0, 1])
        };
        let pattern: Vec<u8> = (0..payload + 256).map(|i| (i * 7 + 3) as u8).collect();
        let hdr_area = self.mem.alloc(slots as u64 * 128, PAGE);
        let table_area = self.mem.alloc(slots as u64 * 16 * chain as u64, PAGE);
        for k in 0..slots {
            let mut h = [0u8; HDR_LEN + L2L4];
            // virtio_net_hdr_v1
            h[0] = HDR_F_NEEDS_CSUM;
            if self.gso {
                h[1] = GSO_TCPV4;
                h[2..4].copy_from_slice(&(L2L4 as u16).to_le_bytes());
                h[4..6].copy_from_slice(&mss.to_le_bytes());
            } else {
                h[1] = GSO_NONE;
            }
            h[6..8].copy_from_slice(&((ETH_LEN + IP_LEN) as u16).to_le_bytes());
            h[8..10].copy_from_slice(&16u16.to_le_bytes());
            let f = &mut h[HDR_LEN..];
            f[0..6].copy_from_slice(&dst);
            f[6..12].copy_from_slice(&self.mac);
            f[12..14].copy_from_slice(&0x0800u16.to_be_bytes());
            let ip = &mut f[ETH_LEN..ETH_LEN + IP_LEN];
            ip[0] = 0x45;
            ip[2..4].copy_from_slice(&((self.frame_len - ETH_LEN) as u16).to_be_bytes());
            ip[4..6].copy_from_slice(&((k as u16).wrapping_mul(64)).to_be_bytes());
            ip[6] = 0x40; // DF
            ip[8] = 64;
            ip[9] = 6;
            ip[12..16].copy_from_slice(&sip);
            ip[16..20].copy_from_slice(&dip);
            let c = !fold(sum16(ip));
            ip[10..12].copy_from_slice(&c.to_be_bytes());
            let tcp = &mut f[ETH_LEN + IP_LEN..];
            tcp[0..2].copy_from_slice(&40000u16.to_be_bytes());
            tcp[2..4].copy_from_slice(&5201u16.to_be_bytes());
            let seq = 1u32.wrapping_add((k * payload) as u32);
            tcp[4..8].copy_from_slice(&seq.to_be_bytes());
            tcp[8..12].copy_from_slice(&1u32.to_be_bytes());
            tcp[12] = 0x50;
            tcp[13] = 0x18; // ACK|PSH
            tcp[14..16].copy_from_slice(&0xffffu16.to_be_bytes());
            // Pseudo-header sum over the whole TCP length, not inverted (Linux GSO).
            let l4 = (self.frame_len - ETH_LEN - IP_LEN) as u32;
            let mut s: u32 = sum16(&sip) + sum16(&dip) + 6 + (l4 >> 16) + (l4 & 0xffff);
            s = (s & 0xffff) + (s >> 16);
            let p = fold(s);
            tcp[16..18].copy_from_slice(&p.to_be_bytes());

            let hdr_gpa = hdr_area + 128 * k as u64;
            self.mem.write_bytes(hdr_gpa, &h);
            let pay_gpa = self
                .mem
                .alloc((payload.div_ceil(PIECE) * PIECE) as u64, PAGE);
            let off = k % 251;
            self.mem.write_bytes(pay_gpa, &pattern[off..off + payload]);

            let mut descs = Vec::with_capacity(chain);
            descs.push((hdr_gpa, h.len() as u32));
            let mut o = 0;
            while o < payload {
                let n = PIECE.min(payload - o);
                descs.push((pay_gpa + o as u64, n as u32));
                o += n;
            }
            debug_assert_eq!(descs.len(), chain);
            if self.indirect {
                let table = table_area + (16 * chain * k) as u64;
                for (i, &(a, l)) in descs.iter().enumerate() {
                    let last = i + 1 == chain;
                    let flags = if last { 0 } else { DESC_F_NEXT };
                    let next = if last { 0 } else { i as u16 + 1 };
                    write_desc(&self.mem, table + 16 * i as u64, a, l, flags, next);
                }
                let head = k as u16;
                self.tx.set_desc(
                    &self.mem,
                    head,
                    table,
                    16 * chain as u32,
                    DESC_F_INDIRECT,
                    0,
                );
                self.tx_ready.push(head);
            } else {
                let base = (k * chain) as u16;
                for (i, &(a, l)) in descs.iter().enumerate() {
                    let last = i + 1 == chain;
                    let flags = if last { 0 } else { DESC_F_NEXT };
                    let next = if last { 0 } else { base + i as u16 + 1 };
                    self.tx
                        .set_desc(&self.mem, base + i as u16, a, l, flags, next);
                }
                self.tx_ready.push(base);
            }
        }
        Ok(())
    }

    /// Send one small frame (header + frame in one descriptor) on the reserved head.
    fn send_ctl(&mut self, frame: &[u8]) {
        let mut b = vec![0u8; HDR_LEN];
        b.extend_from_slice(frame);
        self.mem.write_bytes(self.ctl_buf, &b);
        self.tx
            .set_desc(&self.mem, self.ctl_head, self.ctl_buf, b.len() as u32, 0, 0);
        self.ctl_busy = true;
        self.tx.push_avail(&self.mem, self.ctl_head);
        self.tx.publish(&self.mem, self.event_idx);
    }

    fn garp(&self) -> Vec<u8> {
        let ip = if self.name == "A" {
            [10, 0, 0, 1]
        } else {
            [10, 0, 0, 2]
        };
        let mut f = vec![0xffu8; 6];
        f.extend_from_slice(&self.mac);
        f.extend_from_slice(&[0x08, 0x06, 0, 1, 0x08, 0, 6, 4, 0, 1]);
        f.extend_from_slice(&self.mac);
        f.extend_from_slice(&ip);
        f.extend_from_slice(&[0; 6]);
        f.extend_from_slice(&ip);
        f.resize(60, 0);
        f
    }

    /// Reclaim used TX chains and post every ready frame.
    #[inline(always)]
    fn poll_tx(&mut self, generate: bool) -> u32 {
        let used = self.tx.used_idx(&self.mem);
        let mut n = 0;
        while let Some((id, _len)) = self.tx.pop_used(&self.mem, used) {
            n += 1;
            if id == self.ctl_head && self.ctl_busy {
                self.ctl_busy = false;
                continue;
            }
            self.c.tx_frames += 1;
            self.c.tx_bytes += self.frame_len as u64;
            self.tx_ready.push(id);
        }
        self.tx.suppress_calls(&self.mem, self.event_idx);
        if generate && !self.tx_ready.is_empty() {
            for i in 0..self.tx_ready.len() {
                let h = self.tx_ready[i];
                self.tx.push_avail(&self.mem, h);
            }
            self.tx_ready.clear();
            self.tx.publish(&self.mem, self.event_idx);
        }
        n
    }

    /// Take used RX buffers, classify the frames, re-post the buffers.
    #[inline(always)]
    fn poll_rx(&mut self) -> u32 {
        let used = self.rx.used_idx(&self.mem);
        let mut n = 0;
        while let Some((id, len)) = self.rx.pop_used(&self.mem, used) {
            n += 1;
            let len = (len as usize).min(self.rx_buf_size as usize);
            let a = self.rx_bufs + id as u64 * self.rx_buf_size as u64;
            if self.rx_left == 0 {
                self.start_frame(a, len);
            } else {
                self.rx_cur.len += len;
                self.rx_left -= 1;
                if self.rx_cur.verify {
                    let b = self.mem.bytes(a, len);
                    csum_add(&mut self.rx_cur.sum, &mut self.rx_cur.odd, b);
                }
            }
            if self.rx_left == 0 {
                self.end_frame();
            }
            self.rx.push_avail(&self.mem, id);
        }
        if n > 0 {
            self.c.rx_buffers += n;
            self.rx.suppress_calls(&self.mem, self.event_idx);
            self.rx.publish(&self.mem, self.event_idx);
        }
        n as u32
    }

    fn start_frame(&mut self, a: u64, len: usize) {
        self.rx_cur = RxFrame::default();
        if len < HDR_LEN {
            self.rx_cur.kind = RxKind::Bad;
            self.rx_left = 0;
            return;
        }
        let b = self.mem.bytes(a, len);
        let nb = u16::from_le_bytes([b[10], b[11]]);
        self.rx_left = nb.saturating_sub(1);
        self.rx_cur.len = len - HDR_LEN;
        let gso_type = b[1] & 0x7f;
        let gso_size = u16::from_le_bytes([b[4], b[5]]);
        let f = &b[HDR_LEN..];
        if nb == 0 {
            self.rx_cur.kind = RxKind::Bad;
            return;
        }
        if f.len() < L2L4 || f[12..14] != [0x08, 0x00] {
            self.rx_cur.kind = RxKind::Other;
            return;
        }
        let ip = &f[ETH_LEN..ETH_LEN + IP_LEN];
        let ok = f[0..6] == self.mac
            && ip[0] == 0x45
            && ip[9] == 6
            && fold(sum16(ip)) == 0xffff
            && f[ETH_LEN + IP_LEN + 12] >> 4 >= 5;
        let ip_len = u16::from_be_bytes([ip[2], ip[3]]) as usize;
        self.rx_cur.ip_len = ip_len;
        self.rx_cur.kind = if !ok {
            RxKind::Bad
        } else if gso_type == GSO_TCPV4 && gso_size > 0 {
            RxKind::Gso
        } else if gso_type == GSO_NONE {
            RxKind::Plain
        } else {
            RxKind::Bad
        };
        let needs_csum = b[0] & HDR_F_NEEDS_CSUM != 0;
        if ok {
            self.c.rx_needs_csum += needs_csum as u64;
        }
        if self.rx_cur.kind == RxKind::Plain && !needs_csum && self.verify_every > 0 {
            self.verify_ctr += 1;
            if self.verify_ctr >= self.verify_every && ip_len >= IP_LEN + TCP_LEN {
                self.verify_ctr = 0;
                let r = &mut self.rx_cur;
                r.verify = true;
                let l4 = (ip_len - IP_LEN) as u32;
                r.pseudo = sum16(&ip[12..20]) + 6 + l4;
                csum_add(&mut r.sum, &mut r.odd, &f[ETH_LEN + IP_LEN..]);
            }
        }
    }

    fn end_frame(&mut self) {
        let f = self.rx_cur;
        let c = &mut self.c;
        let len_ok = f.ip_len + ETH_LEN == f.len;
        match f.kind {
            RxKind::Other => c.rx_other += 1,
            RxKind::Bad => c.rx_bad += 1,
            _ if !len_ok => c.rx_bad += 1,
            _ if f.verify && {
                c.csum_checked += 1;
                // Only the frame's bytes: a buffer's tail past the frame is not summed
                // because used lengths end at the frame's end.
                fold64(f.sum + f.pseudo as u64) != 0xffff
            } =>
            {
                c.csum_bad += 1;
                c.rx_bad += 1;
            }
            RxKind::Gso => {
                c.rx_frames += 1;
                c.rx_bytes += f.len as u64;
            }
            RxKind::Plain if !self.gso && f.len == self.frame_len => {
                c.rx_frames += 1;
                c.rx_bytes += f.len as u64;
            }
            RxKind::Plain if f.len <= 1514 => {
                c.rx_segments += 1;
                c.rx_segment_bytes += f.len as u64;
            }
            RxKind::Plain => {
                c.rx_nogso_large += 1;
                c.rx_nogso_large_bytes += f.len as u64;
            }
        }
    }

    /// Stop the rings (GET_VRING_BASE, as QEMU does) before the connection closes.
    fn stop(&mut self) {
        for i in [RX_QUEUE, TX_QUEUE] {
            if let Err(e) = self.vu.get_vring_base(i) {
                eprintln!("tso_loadgen: {}: GET_VRING_BASE {i}: {e}", self.name);
            }
        }
    }
}

fn sum16(b: &[u8]) -> u32 {
    b.chunks(2)
        .map(|c| u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)]) as u32)
        .sum()
}

/// Adds `b` to a one's complement sum of a byte stream; `odd` says the stream so far has
/// an odd length (the next byte is a low-order one).
fn csum_add(sum: &mut u64, odd: &mut bool, mut b: &[u8]) {
    if b.is_empty() {
        return;
    }
    if *odd {
        *sum += b[0] as u64;
        b = &b[1..];
        *odd = false;
    }
    let mut words = b.chunks_exact(4);
    for w in words.by_ref() {
        *sum += u32::from_be_bytes([w[0], w[1], w[2], w[3]]) as u64;
    }
    let mut rest = words.remainder();
    if rest.len() >= 2 {
        *sum += u16::from_be_bytes([rest[0], rest[1]]) as u64;
        rest = &rest[2..];
    }
    if let [x] = rest {
        *sum += (*x as u64) << 8;
        *odd = true;
    }
}

fn fold64(mut s: u64) -> u16 {
    while s >> 16 != 0 {
        s = (s & 0xffff) + (s >> 16);
    }
    s as u16
}

fn fold(mut s: u32) -> u16 {
    while s >> 16 != 0 {
        s = (s & 0xffff) + (s >> 16);
    }
    s as u16
}

// ---------------------------------------------------------------------------------------

fn run(args: &Args) -> Result<serde_json::Value> {
    let mac_a = parse_mac(&args.mac_a)?;
    let mac_b = parse_mac(&args.mac_b)?;
    ensure!(args.seconds > 0.0, "--seconds must be positive");
    let mut a = Port::open("A", &args.a, args, mac_a, mac_b, true, true)
        .with_context(|| format!("port A ({})", args.a.display()))?;
    let mut b = Port::open(
        "B",
        &args.b,
        args,
        mac_b,
        mac_a,
        args.bidir,
        !args.b_no_offload,
    )
    .with_context(|| format!("port B ({})", args.b.display()))?;
    eprintln!(
        "tso_loadgen: connected; event_idx={} indirect={} tx frames in flight={} frame={} B, gso={}",
        a.event_idx, a.indirect, a.tx_slots, a.frame_len, a.gso
    );

    // Let a learning switch learn the receivers' MACs.
    let garp_b = b.garp();
    b.send_ctl(&garp_b);
    if args.bidir {
        let garp_a = a.garp();
        a.send_ctl(&garp_a);
    }
    let t0 = Instant::now();
    while (b.ctl_busy || a.ctl_busy || t0.elapsed() < Duration::from_millis(100))
        && t0.elapsed() < Duration::from_secs(2)
    {
        a.poll_tx(false);
        b.poll_tx(false);
        a.poll_rx();
        b.poll_rx();
    }
    if b.ctl_busy {
        eprintln!("tso_loadgen: warning: B's ARP was not completed by the backend");
    }

    let start = Instant::now();
    let warm_end = start + Duration::from_secs_f64(args.warmup.max(0.0));
    let end = warm_end + Duration::from_secs_f64(args.seconds);
    let mut snap: Option<(Instant, Counters, Counters)> = None;
    let mut iter: u64 = 0;
    // Polls that found nothing to do, in the measured window: the frontend's headroom.
    let mut idle: u64 = 0;
    let mut polls = (0u64, 0u64);
    let fin = loop {
        let work = a.poll_tx(true) + b.poll_tx(args.bidir) + b.poll_rx() + a.poll_rx();
        idle += (work == 0) as u64;
        iter += 1;
        if iter.is_multiple_of(64) {
            let now = Instant::now();
            if snap.is_none() && now >= warm_end {
                snap = Some((now, a.c, b.c));
                polls = (iter, idle);
            }
            if now >= end {
                polls = (iter - polls.0, idle - polls.1);
                break (now, a.c, b.c);
            }
        }
    };
    let (t1, a1, b1) = snap.unwrap_or((start, Counters::default(), Counters::default()));
    let secs = (fin.0 - t1).as_secs_f64();
    let da = fin.1.sub(&a1);
    let db = fin.2.sub(&b1);
    let kicks = (a.tx.kicks + b.tx.kicks, a.rx.kicks + b.rx.kicks);
    // Drain in-flight work briefly, then stop the rings.
    let t = Instant::now();
    while t.elapsed() < Duration::from_millis(50) {
        a.poll_tx(false);
        b.poll_tx(false);
        a.poll_rx();
        b.poll_rx();
    }
    a.stop();
    b.stop();
    drop(a);
    drop(b);

    // A -> B, plus B -> A with --bidir.
    let mut rx = db;
    let mut tx = da;
    if args.bidir {
        for (s, o) in [(&mut rx, &da), (&mut tx, &db)] {
            s.rx_frames += o.rx_frames;
            s.rx_bytes += o.rx_bytes;
            s.rx_segments += o.rx_segments;
            s.rx_segment_bytes += o.rx_segment_bytes;
            s.rx_nogso_large += o.rx_nogso_large;
            s.rx_nogso_large_bytes += o.rx_nogso_large_bytes;
            s.rx_bad += o.rx_bad;
            s.rx_other += o.rx_other;
            s.rx_needs_csum += o.rx_needs_csum;
            s.csum_checked += o.csum_checked;
            s.csum_bad += o.csum_bad;
            s.tx_frames += o.tx_frames;
            s.tx_bytes += o.tx_bytes;
        }
    }
    let gbit = |b: u64| b as f64 * 8.0 / secs / 1e9;
    let all = rx.rx_bytes + rx.rx_segment_bytes + rx.rx_nogso_large_bytes;
    let r3 = |x: f64| (x * 1000.0).round() / 1000.0;
    let mut v = serde_json::json!({
        "frames": rx.rx_frames,
        "bytes": rx.rx_bytes,
        "seconds": r3(secs),
        "gbit_s": r3(gbit(rx.rx_bytes)),
        "mpps": (rx.rx_frames as f64 / secs).round() / 1e6,
        "segments_rx": rx.rx_segments,
        "segment_bytes": rx.rx_segment_bytes,
        "nogso_large": rx.rx_nogso_large,
        "nogso_large_bytes": rx.rx_nogso_large_bytes,
        "all_gbit_s": r3(gbit(all)),
        "bad": rx.rx_bad,
        "rx_needs_csum": rx.rx_needs_csum,
        "csum_checked": rx.csum_checked,
        "csum_bad": rx.csum_bad,
        "tx_frames": tx.tx_frames,
        "tx_gbit_s": r3(gbit(tx.tx_bytes)),
        "frame_size": args.size,
        "queue_size": args.queue_size,
        "bidir": args.bidir,
        "tx_kicks": kicks.0,
        "rx_kicks": kicks.1,
        "idle_poll_pct": r3(100.0 * polls.1 as f64 / polls.0.max(1) as f64),
    });
    if args.bidir {
        v["a_to_b_gbit_s"] = r3(gbit(db.rx_bytes)).into();
        v["b_to_a_gbit_s"] = r3(gbit(da.rx_bytes)).into();
    }
    Ok(v)
}

fn main() {
    let args = Args::parse();
    match run(&args) {
        Ok(v) => {
            if args.json {
                println!("{v}");
            } else {
                println!(
                    "{:.3} Gbit/s intact ({} frames, {:.4} Mpps) in {} s; segments {}, large non-GSO {}, bad {}, all {} Gbit/s",
                    v["gbit_s"], v["frames"], v["mpps"].as_f64().unwrap_or(0.0), v["seconds"],
                    v["segments_rx"], v["nogso_large"], v["bad"], v["all_gbit_s"]
                );
            }
        }
        Err(e) => {
            eprintln!("tso_loadgen: error: {e:#}");
            std::process::exit(1);
        }
    }
}

//! A hostile guest against the real daemon: randomized, seeded, and checked against
//! invariants rather than expected outputs.
//!
//! Setup: a `gsonet serve` process with four vhost-user ports and, when /dev/net/tun
//! works, a tap uplink. Port A (0) is the hostile guest. B, C and D are well-behaved
//! peers that differ in what they accept: B acks no GUEST_* bit (everything must reach
//! it as wire-size frames with full checksums), C acks GUEST_CSUM only (partial
//! checksums, no GSO), D acks every GUEST_* offload (GSO frames may reach it whole).
//!
//! Each iteration A does one hostile thing (see [`Op`]): random raw descriptor chains,
//! random virtio_net_hdr bytes in front of a valid or truncated frame, a valid
//! TSO/USO/UFO frame with its IP/TCP/UDP headers mutated, or RX abuse (bad RX buffers,
//! or no buffers at all while a peer floods A). Then the peers and A exchange good
//! frames. The seed is printed; `GSONET_FUZZ_SEED` replays a run and
//! `GSONET_FUZZ_SECS` runs longer (default 3 s).
//!
//! What must hold, checked every iteration:
//! - the daemon stays alive and answers every chain (A's TX completes: no hang);
//! - every good frame arrives byte-exact (after finishing a partial checksum): A's
//!   broadcast at B, C and D; each peer's frame at A whenever A has valid buffers;
//! - headers written to a peer are legal for what it acked: flags only NEEDS_CSUM or
//!   DATA_VALID, none without GUEST_CSUM; a GSO type only one it acked (ECN included),
//!   always with NEEDS_CSUM at the L4 header (csum_offset 16 / 6) and a gso_size;
//! - what reaches a peer from A's hostile frame, by what A sent:
//!   * a tagged frame (802.1Q, 802.1ad, 0x9100) reaches no peer: A is an untagged
//!     port, which sends untagged frames only;
//!   * a non-GSO frame is forwarded as a switch would: exactly one frame, byte-exact
//!     once both sides' partial checksums are finished. Its L4 content may be garbage:
//!     a plain frame is not parsed (neither does a Linux bridge), and DATA_VALID from
//!     the sender is passed on to a peer that takes checksums, as Linux tap/vhost do;
//!   * a GSO frame reaches a peer either whole (only one that acked that GSO type; the
//!     bytes unchanged, the header consistent with what etherparse finds) or as
//!     segments/fragments that are each well-formed: etherparse parses them, IPv4
//!     header checksum, IP and UDP lengths and L4 checksums are right, fragments
//!     reassemble into a datagram with a right checksum; their payload, put together,
//!     is exactly the payload A sent (unless the peer's RX queue overflowed);
//!   * a valid GSO frame (no mutation) always arrives, whole or complete;
//!   * raw chains: whatever arrives still obeys the header rules above;
//! - every chain A publishes is counted exactly once: as a TX frame or as one TX drop
//!   reason (`gsonet stats --json`), and every frame lost on its way to A is counted
//!   on A under an RX drop reason;
//! - no counter reason mentions "panic" and the daemon log never says "panicked";
//! - at the end a fresh frontend reconnects to A's socket and exchanges frames.

mod common;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use common::daemon::{tun_available, Daemon, DaemonSpec, CHAIN_REASONS};
use common::frames::{self, finish_csum, Flow, Ips, UdpGso};
use common::frontend::{feat, FrontendOpts, RawDesc, RxFrame, TestFrontend, TxLayout, RX_QUEUE};
use etherparse::{LaxNetSlice, LaxSlicedPacket, NetSlice, SlicedPacket, TransportSlice};
use gsonet::vnet_hdr::{VirtioNetHdr, F_DATA_VALID, F_NEEDS_CSUM, HDR_LEN};
use proptest::prelude::{Rng as _, RngExt};
use proptest::test_runner::{RngAlgorithm, TestRng};
use serde_json::Value;
use vm_memory::{Bytes, GuestAddress};

const T: Duration = Duration::from_secs(5);

/// RX buffers each peer keeps posted, and their size.
const PEER_RX: usize = 256;
const RX_BUF: u32 = 2048;
/// RX buffers A keeps posted (few, so that bad buffers behind them are reached soon).
const A_RX: usize = 16;

/// Drop reasons of frames lost on the way into a guest's RX queue.
const RX_REASONS: [&str; 4] = [
    "rx_queue_full",
    "rx_buffer_too_small",
    "rx_readable_descriptor",
    "rx_bad_address",
];

// ---------------------------------------------------------------------------------------
// The seeded RNG: proptest's ChaCha (`TestRng`), with the draws this test makes.

struct Rng(TestRng);

impl Rng {
    fn new(seed: u64) -> Rng {
        let mut key = [0u8; 32];
        key[..8].copy_from_slice(&seed.to_le_bytes());
        Rng(TestRng::from_seed(RngAlgorithm::ChaCha, &key))
    }
    fn next(&mut self) -> u64 {
        self.0.next_u64()
    }
    /// Uniform in `0..n` (n > 0).
    fn below(&mut self, n: u64) -> u64 {
        self.0.random_range(0..n)
    }
    fn range(&mut self, lo: u64, hi_incl: u64) -> u64 {
        self.0.random_range(lo..=hi_incl)
    }
    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
    fn pick<T: Copy>(&mut self, v: &[T]) -> T {
        v[self.below(v.len() as u64) as usize]
    }
    fn bytes(&mut self, n: usize) -> Vec<u8> {
        let mut b = vec![0u8; n];
        self.0.fill_bytes(&mut b);
        b
    }
}

// ---------------------------------------------------------------------------------------
// Setup

fn a_mac() -> frames::Mac {
    frames::mac(0xa)
}

fn peer_mac(i: usize) -> frames::Mac {
    frames::mac(0xb + i as u8)
}

struct Peer {
    name: &'static str,
    fe: TestFrontend,
    /// The GUEST_* bits it acked.
    rx_feats: u64,
    mac: frames::Mac,
}

fn connect(d: &Daemon, port: usize, features: u64, rx: usize) -> TestFrontend {
    let opts = FrontendOpts {
        features,
        require_features: true,
        mem_size: 64 << 20,
        ..Default::default()
    };
    let mut fe = TestFrontend::connect(&d.sockets[port], opts).expect("frontend");
    fe.post_rx(rx, RX_BUF).expect("post rx");
    fe
}

fn connect_a(d: &Daemon) -> TestFrontend {
    connect(d, 0, feat::RINGS | feat::HOST_ALL | feat::GUEST_CSUM, A_RX)
}

fn seed_from_env() -> u64 {
    match std::env::var("GSONET_FUZZ_SEED") {
        Ok(s) => {
            let s = s.trim();
            let v = s
                .strip_prefix("0x")
                .map(|h| u64::from_str_radix(h, 16))
                .unwrap_or_else(|| s.parse());
            v.expect("GSONET_FUZZ_SEED: a number")
        }
        Err(_) => {
            let t = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap();
            t.as_nanos() as u64 ^ (std::process::id() as u64) << 32
        }
    }
}

/// Operations every run does, whatever GSONET_FUZZ_SECS and the machine's speed (a
/// loaded 2-core machine does about 1000 in the default 3 s).
const MIN_ITERS: u64 = 500;

fn secs_from_env() -> f64 {
    std::env::var("GSONET_FUZZ_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(3.0)
}

// ---------------------------------------------------------------------------------------
// What A sent, and the checks of what a peer got from it

/// A frame A put on its TX queue (header as raw bytes, possibly invalid).
#[derive(Clone, Debug)]
struct Sent {
    hdr: [u8; HDR_LEN],
    frame: Vec<u8>,
    /// A valid frame that must arrive at every peer.
    must_arrive: bool,
}

impl Sent {
    fn flags(&self) -> u8 {
        self.hdr[0]
    }
    fn gso_raw(&self) -> u8 {
        self.hdr[1]
    }
    fn le(&self, i: usize) -> u16 {
        u16::from_le_bytes([self.hdr[i], self.hdr[i + 1]])
    }
    fn gso_size(&self) -> u16 {
        self.le(4)
    }
    fn csum_start(&self) -> u16 {
        self.le(6)
    }
    fn csum_offset(&self) -> u16 {
        self.le(8)
    }
    fn known_gso_type(&self) -> bool {
        matches!(self.gso_raw() & 0x7f, 0 | 1 | 3 | 4 | 5)
    }
    fn is_gso(&self) -> bool {
        self.gso_raw() & 0x7f != 0
    }
}

/// The frame with its partial checksum finished, if it has one (None: out of range).
fn finished(flags: u8, start: u16, offset: u16, frame: &[u8]) -> Option<Vec<u8>> {
    let mut f = frame.to_vec();
    if flags & F_NEEDS_CSUM != 0 {
        finish_csum(&mut f, start as usize, offset as usize).ok()?;
    }
    Some(f)
}

/// Offset of the L3 header after Ethernet and VLAN tags.
fn l3_offset(frame: &[u8]) -> usize {
    let mut off = 12;
    while off + 2 <= frame.len()
        && matches!(
            u16::from_be_bytes([frame[off], frame[off + 1]]),
            0x8100 | 0x88a8 | 0x9100
        )
    {
        off += 4;
    }
    off + 2
}

/// Whether etherparse's slicing found IPv4 (or IPv6), and where its L4 header starts.
fn ip_and_l4(p: &SlicedPacket, frame: &[u8]) -> Option<(bool, usize)> {
    let l3 = l3_offset(frame);
    match &p.net {
        Some(NetSlice::Ipv4(ip)) => Some((true, l3 + ip.header().slice().len())),
        Some(NetSlice::Ipv6(ip)) => Some((
            false,
            l3 + ip.header().slice().len() + ip.extensions().slice().len(),
        )),
        _ => None,
    }
}

/// Header rules for anything a peer receives.
fn check_rx_header(p_feats: u64, h: &VirtioNetHdr, frame: &[u8]) -> Result<(), String> {
    let csum = p_feats & feat::GUEST_CSUM != 0;
    if h.flags & !(F_NEEDS_CSUM | F_DATA_VALID) != 0 {
        return Err(format!("flags {:#x} beyond NEEDS_CSUM|DATA_VALID", h.flags));
    }
    if !csum && h.flags != 0 {
        return Err(format!("flags {:#x} to a peer without GUEST_CSUM", h.flags));
    }
    if h.needs_csum() && h.csum_start as usize + h.csum_offset as usize + 2 > frame.len() {
        return Err(format!(
            "csum {}+{} outside a {}-byte frame",
            h.csum_start,
            h.csum_offset,
            frame.len()
        ));
    }
    if !h.needs_csum() && (h.csum_start, h.csum_offset) != (0, 0) {
        return Err(format!("csum fields without NEEDS_CSUM: {h:?}"));
    }
    if !h.gso.is_gso() && (h.gso_size, h.hdr_len, h.gso.ecn) != (0, 0, false) {
        return Err(format!("GSO fields on a plain frame: {h:?}"));
    }
    use gsonet::vnet_hdr::GsoKind::*;
    let need = match h.gso.kind {
        None => return Ok(()),
        TcpV4 => feat::GUEST_TSO4,
        TcpV6 => feat::GUEST_TSO6,
        Udp => feat::GUEST_UFO,
        UdpL4 => feat::GUEST_USO4 | feat::GUEST_USO6,
    };
    if p_feats & need == 0 || (h.gso.ecn && p_feats & feat::GUEST_ECN == 0) {
        return Err(format!("GSO {:?} to a peer that did not ack it", h.gso));
    }
    if !h.needs_csum() || h.gso_size == 0 {
        return Err(format!("GSO frame without NEEDS_CSUM or gso_size: {h:?}"));
    }
    // The header must describe the frame: etherparse finds the L3/L4 it names.
    let p = SlicedPacket::from_ethernet(frame).map_err(|e| format!("GSO frame: {e}"))?;
    let Some((v4, l4_off)) = ip_and_l4(&p, frame) else {
        return Err(format!("GSO frame without IP: {:?}", p.net));
    };
    let (tcp, off) = match &p.transport {
        Some(TransportSlice::Tcp(_)) => (true, 16),
        Some(TransportSlice::Udp(_)) => (false, 6),
        other => return Err(format!("GSO frame without TCP/UDP: {other:?}")),
    };
    let ok = match h.gso.kind {
        TcpV4 => tcp && v4,
        TcpV6 => tcp && !v4,
        _ => !tcp,
    };
    if !ok || h.csum_start as usize != l4_off || h.csum_offset != off {
        return Err(format!(
            "GSO header {h:?} does not match the frame (v4 {v4}, tcp {tcp}, L4 at {l4_off})"
        ));
    }
    Ok(())
}

/// A complete frame that came out of segmentation, as etherparse sees it.
enum Piece {
    /// TCP or UDP: header bytes before the payload, the payload.
    Whole { hdr_len: usize, payload: Vec<u8> },
    Frag {
        frag: frames::Frag,
        src: Vec<u8>,
        dst: Vec<u8>,
    },
}

/// Strict checks of one segment (its partial checksum already finished).
fn check_wellformed(f: &[u8]) -> Result<Piece, String> {
    let l3 = l3_offset(f);
    // The IP layer is read leniently: a later IPv6 fragment's Fragment header names the
    // first header of the fragmentable part (a Destination Options header, say), which
    // is not in this fragment, and etherparse's strict parse would read the fragment's
    // data as that header. Fragments are checked by `parse_frag`, the rest strictly below.
    let lax = LaxSlicedPacket::from_ethernet(f).map_err(|e| format!("etherparse: {e}"))?;
    let (fragment, src, dst) = match &lax.net {
        Some(LaxNetSlice::Ipv4(ip)) => {
            let h = ip.header().to_header();
            if h.header_checksum != h.calc_header_checksum() {
                return Err("bad IPv4 header checksum".into());
            }
            if l3 + h.total_len as usize != f.len() {
                return Err(format!(
                    "IPv4 total length {} in a {}-byte frame (L3 at {l3})",
                    h.total_len,
                    f.len()
                ));
            }
            (
                ip.is_payload_fragmented(),
                h.source.to_vec(),
                h.destination.to_vec(),
            )
        }
        Some(LaxNetSlice::Ipv6(ip)) => {
            let h = ip.header().to_header();
            if l3 + 40 + h.payload_length as usize != f.len() {
                return Err(format!(
                    "IPv6 payload length {} in a {}-byte frame",
                    h.payload_length,
                    f.len()
                ));
            }
            (
                ip.is_payload_fragmented(),
                h.source.to_vec(),
                h.destination.to_vec(),
            )
        }
        other => return Err(format!("no IP: {other:?}")),
    };
    if fragment {
        let frag = frames::parse_frag(f).map_err(|e| format!("fragment: {e:#}"))?;
        return Ok(Piece::Frag { frag, src, dst });
    }
    let p = SlicedPacket::from_ethernet(f).map_err(|e| format!("etherparse: {e}"))?;
    // L4 checksum over the raw bytes (etherparse's own check rebuilds the TCP header
    // from its fields and loses the reserved bits, which a segment copies as they are).
    let ips = if src.len() == 4 {
        Ips::V4(src[..].try_into().unwrap(), dst[..].try_into().unwrap())
    } else {
        Ips::V6(src[..].try_into().unwrap(), dst[..].try_into().unwrap())
    };
    let (proto, l4_len, payload) = match &p.transport {
        Some(TransportSlice::Tcp(t)) => (6, t.slice().len(), t.payload().to_vec()),
        Some(TransportSlice::Udp(u)) => {
            let len = u.slice().len();
            if u.length() as usize != len {
                return Err(format!("UDP length {} for {len} bytes", u.length()));
            }
            if u.checksum() == 0 {
                return Err("UDP checksum 0 on a segment".into());
            }
            (17, len, u.payload().to_vec())
        }
        other => return Err(format!("segment without TCP/UDP: {other:?}")),
    };
    let l4 = f.len() - l4_len;
    let sum = frames::fold(frames::sum16(
        &f[l4..],
        frames::pseudo_sum(&ips, proto, l4_len),
    ));
    if sum != 0xffff {
        return Err(format!("bad L4 checksum (proto {proto}, sum {sum:#06x})"));
    }
    Ok(Piece::Whole {
        hdr_len: f.len() - payload.len(),
        payload,
    })
}

/// Whether a frame starts with a VLAN tag (802.1Q, 802.1ad, 0x9100), which a guest on
/// an untagged port may not send.
fn is_tagged(f: &[u8]) -> bool {
    f.len() >= 14 && matches!(u16::from_be_bytes([f[12], f[13]]), 0x8100 | 0x88a8 | 0x9100)
}

/// `f` without its VLAN tags, the header's offsets moved to match.
fn untag(h: &mut VirtioNetHdr, f: &mut Vec<u8>) {
    while is_tagged(f) {
        f.drain(12..16);
        if h.needs_csum() {
            h.csum_start -= 4;
        }
        if h.hdr_len != 0 {
            h.hdr_len -= 4;
        }
    }
}

/// Checks what one peer received for one frame A sent.
fn check_outputs(p: &Peer, sent: &Sent, got: &[RxFrame]) -> Result<(), String> {
    for r in got {
        check_rx_header(p.rx_feats, &r.hdr, &r.frame)?;
    }
    if is_tagged(&sent.frame) {
        // A is an untagged port: it sends untagged frames only.
        if got.is_empty() {
            return Ok(());
        }
        return Err(format!("{} frames from a tagged frame", got.len()));
    }
    if !sent.known_gso_type() || sent.frame.len() < 14 {
        if got.is_empty() {
            return Ok(());
        }
        return Err(format!(
            "{} frames from a frame with a bad header",
            got.len()
        ));
    }
    if !sent.is_gso() {
        let want = finished(
            sent.flags(),
            sent.csum_start(),
            sent.csum_offset(),
            &sent.frame,
        );
        let Some(want) = want else {
            return match got.len() {
                0 => Ok(()),
                n => Err(format!("{n} frames from a frame with csum out of range")),
            };
        };
        if sent.flags() & F_NEEDS_CSUM != 0 {
            // A checksum is never completed into the MAC, VLAN or IP headers.
            let l4 = SlicedPacket::from_ethernet(&sent.frame)
                .ok()
                .and_then(|p| ip_and_l4(&p, &sent.frame));
            match l4 {
                Some((_, l4)) if (sent.csum_start() as usize) < l4 => {
                    return match got.len() {
                        0 => Ok(()),
                        n => Err(format!("{n} frames with a checksum before the L4 header")),
                    };
                }
                // Not an IP packet etherparse can slice: gsonet may refuse it too.
                None if got.is_empty() => return Ok(()),
                _ => {}
            }
        }
        if got.len() != 1 {
            return Err(format!("{} frames for one plain frame", got.len()));
        }
        let r = &got[0];
        if r.hdr.needs_csum() && sent.flags() & F_NEEDS_CSUM == 0 {
            return Err("NEEDS_CSUM appeared on a plain frame".into());
        }
        let have = finished(r.hdr.flags, r.hdr.csum_start, r.hdr.csum_offset, &r.frame)
            .ok_or("received csum out of range")?;
        if have != want {
            return Err(format!(
                "plain frame changed on the way ({} vs {} bytes)",
                have.len(),
                want.len()
            ));
        }
        return Ok(());
    }
    // A GSO frame: whole, or well-formed pieces.
    if got.iter().any(|r| r.hdr.gso.is_gso()) {
        if got.len() != 1 {
            return Err(format!("a whole GSO frame and {} more", got.len() - 1));
        }
        let r = &got[0];
        if r.frame != sent.frame || r.hdr.gso_size != sent.gso_size() {
            return Err("GSO frame passed whole but changed".into());
        }
        return Ok(());
    }
    let buffers: usize = got.iter().map(|r| r.buffers as usize).sum();
    let overflowed = buffers + 8 >= PEER_RX;
    if got.is_empty() && sent.must_arrive && !overflowed {
        return Err("a valid GSO frame did not arrive".into());
    }
    let mut whole = Vec::new();
    let mut frags = Vec::new();
    for (i, r) in got.iter().enumerate() {
        let f = finished(r.hdr.flags, r.hdr.csum_start, r.hdr.csum_offset, &r.frame)
            .ok_or("received csum out of range")?;
        match check_wellformed(&f).map_err(|e| format!("segment {i}/{}: {e}", got.len()))? {
            Piece::Whole { hdr_len, payload } => whole.push((hdr_len, payload)),
            Piece::Frag { frag, src, dst } => frags.push((frag, src, dst)),
        }
    }
    if !whole.is_empty() && !frags.is_empty() {
        return Err("segments and fragments from one frame".into());
    }
    if overflowed || got.is_empty() {
        return Ok(());
    }
    // Nothing lost on the way: the payloads together are exactly what A sent.
    if !whole.is_empty() {
        let hl = whole[0].0;
        let all: Vec<u8> = whole.iter().flat_map(|w| w.1.iter().copied()).collect();
        if whole.iter().any(|w| w.0 != hl) {
            return Err("segments with different header lengths".into());
        }
        if sent.frame.len() < hl || sent.frame[hl..] != all[..] {
            return Err(format!(
                "segment payloads ({} bytes after {hl}-byte headers) are not the {}-byte frame's",
                all.len(),
                sent.frame.len()
            ));
        }
    } else {
        let list: Vec<frames::Frag> = frags.iter().map(|f| f.0.clone()).collect();
        let l4 = frames::reassemble_frags(&list).map_err(|e| format!("reassembly: {e:#}"))?;
        let (src, dst) = (&frags[0].1, &frags[0].2);
        let ips = if src.len() == 4 {
            Ips::V4(src[..].try_into().unwrap(), dst[..].try_into().unwrap())
        } else {
            Ips::V6(src[..].try_into().unwrap(), dst[..].try_into().unwrap())
        };
        let payload =
            frames::check_udp_datagram(&ips, &l4).map_err(|e| format!("datagram: {e:#}"))?;
        if !sent.frame.ends_with(&payload) {
            return Err("reassembled datagram is not the one A sent".into());
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Generators

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Op {
    RawTx,
    HeaderFuzz,
    Mutate,
    RxAbuse,
    Good,
}

/// A valid frame of a random kind: (header, frame).
fn valid_frame(rng: &mut Rng, dst: frames::Mac, gso: bool) -> (VirtioNetHdr, Vec<u8>) {
    let v6 = rng.chance(50);
    let ips = if v6 { Ips::v6() } else { Ips::v4() };
    let flow = Flow::new(a_mac(), dst, ips).ports(rng.range(1, 65535) as u16, 7);
    let len = if gso {
        match rng.below(4) {
            0 => rng.range(0, 3000),
            1 => rng.range(0, 20000),
            2 => rng.range(60000, 65000),
            _ => rng.range(1, 300),
        }
    } else {
        rng.range(0, 1400)
    } as usize;
    let data = rng.bytes(len);
    let mss = match rng.below(6) {
        0 => 1,
        1 => rng.range(1, 16),
        2 => 1448,
        3 => rng.range(500, 9000),
        4 => len.clamp(1, 0xfffe) as u64,
        _ => rng.range(1, 0xfffe),
    } as u16;
    let kind = rng.below(3);
    let (h, mut f) = match (kind, gso) {
        (0, g) => frames::tcp(&flow, rng.next() as u32, &data, g.then_some(mss)),
        (1, true) => frames::udp(&flow, &data, UdpGso::Uso(mss)),
        (1, false) | (2, false) => frames::udp(&flow, &data, UdpGso::None),
        _ => frames::udp(&flow, &data, UdpGso::Ufo(mss.max(8))),
    };
    let mut h = h;
    if !gso && rng.chance(30) {
        // A plain frame with a partial checksum, as Linux sends small frames.
        let l4 = l3_offset(&f) + if v6 { 40 } else { 20 };
        let tcp = f[l3_offset(&f) + if v6 { 6 } else { 9 }] == 6;
        let off = if tcp { 16 } else { 6 };
        let ps = frames::pseudo_sum(&ips, if tcp { 6 } else { 17 }, f.len() - l4);
        f[l4 + off..l4 + off + 2].copy_from_slice(&frames::fold(ps).to_be_bytes());
        h.flags = F_NEEDS_CSUM;
        h.csum_start = l4 as u16;
        h.csum_offset = off as u16;
    }
    if rng.chance(15) {
        insert_vlan(&mut h, &mut f, rng.range(1, 2) as usize);
    }
    if v6 && rng.chance(20) {
        insert_hop_by_hop(&mut h, &mut f, rng.range(0, 2) as u8);
    }
    (h, f)
}

fn shift_l4(h: &mut VirtioNetHdr, by: usize) {
    if h.needs_csum() {
        h.csum_start += by as u16;
    }
    if h.hdr_len != 0 {
        h.hdr_len += by as u16;
    }
}

fn insert_vlan(h: &mut VirtioNetHdr, f: &mut Vec<u8>, tags: usize) {
    for i in 0..tags {
        let tpid: u16 = if i + 1 == tags && tags == 2 {
            0x8100
        } else if tags == 2 {
            0x88a8
        } else {
            0x8100
        };
        let mut tag = tpid.to_be_bytes().to_vec();
        tag.extend_from_slice(&(100 + i as u16).to_be_bytes());
        let at = 12 + 4 * i;
        f.splice(at..at, tag);
    }
    shift_l4(h, 4 * tags);
}

/// Inserts an IPv6 hop-by-hop header of `(ext_len + 1) * 8` bytes (PadN inside).
fn insert_hop_by_hop(h: &mut VirtioNetHdr, f: &mut Vec<u8>, ext_len: u8) {
    let l3 = l3_offset(f);
    let n = (ext_len as usize + 1) * 8;
    let mut ext = vec![0u8; n];
    ext[0] = f[l3 + 6];
    ext[1] = ext_len;
    ext[2] = 1; // PadN
    ext[3] = (n - 4) as u8;
    f[l3 + 6] = 0;
    let pl = u16::from_be_bytes([f[l3 + 4], f[l3 + 5]]) as usize + n;
    f[l3 + 4..l3 + 6].copy_from_slice(&(pl as u16).to_be_bytes());
    f.splice(l3 + 40..l3 + 40, ext);
    shift_l4(h, n);
}

fn random_layout(rng: &mut Rng, len: usize) -> TxLayout {
    let base = match rng.below(7) {
        0 => TxLayout::Single,
        1 => TxLayout::HeaderSeparate,
        2 => TxLayout::HeaderThenChunks(rng.range(512, 8192) as usize),
        3 => TxLayout::Chunks(rng.range(1000, 16384) as usize),
        _ => {
            let mut cuts: Vec<usize> = (0..rng.range(1, 5))
                .map(|_| rng.below(len.max(1) as u64) as usize)
                .collect();
            cuts.sort();
            TxLayout::SplitAt(cuts)
        }
    };
    // Keep descriptor counts under the queue size.
    let small = match &base {
        TxLayout::Chunks(n) | TxLayout::HeaderThenChunks(n) => len / n < 200,
        _ => true,
    };
    if small && rng.chance(20) {
        TxLayout::indirect(base)
    } else if small {
        base
    } else {
        TxLayout::Single
    }
}

/// Random header bytes: each field valid, boundary or garbage.
fn fuzz_header(rng: &mut Rng, valid: &VirtioNetHdr, len: usize) -> [u8; HDR_LEN] {
    if rng.chance(10) {
        let mut b = [0u8; HDR_LEN];
        b.copy_from_slice(&rng.bytes(HDR_LEN));
        return b;
    }
    let mut b = common::wire_hdr::encode(valid);
    let fields = rng.range(1, 3);
    for _ in 0..fields {
        let x = rng.next();
        match rng.below(6) {
            0 => b[0] = rng.pick(&[0, 1, 2, 3, 4, 5, 0x80, 0xff, x as u8]),
            1 => b[1] = rng.pick(&[0, 1, 3, 4, 5, 0x81, 0x83, 0x84, 0x85, 0x80, 2, x as u8]),
            2 => {
                let v = rng.pick(&[0u16, 1, 2, 7, 8, 0xffff, 0xfffe, 1448, x as u16]);
                b[4..6].copy_from_slice(&v.to_le_bytes());
            }
            3 => {
                let v = rng.pick(&[
                    0u16,
                    13,
                    14,
                    33,
                    34,
                    53,
                    54,
                    len as u16,
                    len.saturating_sub(1) as u16,
                    0xffff,
                    x as u16,
                    ((x >> 16) % len.max(1) as u64) as u16,
                ]);
                b[6..8].copy_from_slice(&v.to_le_bytes());
            }
            4 => {
                let v = rng.pick(&[0u16, 6, 16, 1, 0xffff, x as u16]);
                b[8..10].copy_from_slice(&v.to_le_bytes());
            }
            _ => {
                // hdr_len and num_buffers are hints / ignored on TX.
                let v = rng.next() as u16;
                b[2..4].copy_from_slice(&v.to_le_bytes());
                b[10..12].copy_from_slice(&(rng.next() as u16).to_le_bytes());
            }
        }
    }
    b
}

/// Flips header bytes of a valid frame (targeted fields or random bytes).
fn mutate_frame(rng: &mut Rng, f: &mut [u8]) {
    let l3 = l3_offset(f);
    let v6 = l3 < f.len() && f[l3] >> 4 == 6;
    let l4 = if v6 {
        l3 + 40
    } else {
        l3 + 4 * (f[l3] & 0xf) as usize
    };
    let hdr_end = (l4 + 40).min(f.len());
    let n = rng.range(1, 4);
    for _ in 0..n {
        let x = rng.next();
        let set = |f: &mut [u8], i: usize, v: u8| {
            if i < f.len() {
                f[i] = v;
            }
        };
        match rng.below(10) {
            // Version / IHL nibbles.
            0 => set(f, l3, (rng.below(16) as u8) << 4 | (f[l3] & 0xf)),
            1 => set(f, l3, (f[l3] & 0xf0) | rng.below(16) as u8),
            // IPv4 total length / IPv6 payload length.
            2 => {
                let v = rng.pick(&[0u16, 1, 20, 40, 0xffff, x as u16]);
                let at = if v6 { l3 + 4 } else { l3 + 2 };
                set(f, at, (v >> 8) as u8);
                set(f, at + 1, v as u8);
            }
            // Protocol / next header (incl. extension headers and fragment).
            3 => {
                let at = if v6 { l3 + 6 } else { l3 + 9 };
                let v = rng.pick(&[0u8, 6, 17, 43, 44, 60, 59, 1, x as u8]);
                set(f, at, v);
            }
            // Fragment bits / offset (IPv4), flow label (IPv6).
            4 => {
                let v = rng.pick(&[0x20u8, 0x40, 0x00, 0x1f, 0xff]);
                set(f, l3 + 6, v);
                set(f, l3 + 7, rng.next() as u8);
            }
            // TCP data offset.
            5 => set(f, l4 + 12, (rng.below(16) as u8) << 4),
            // UDP length.
            6 => {
                let v = rng.pick(&[0u16, 7, 8, 9, 0xffff, x as u16]);
                set(f, l4 + 4, (v >> 8) as u8);
                set(f, l4 + 5, v as u8);
            }
            // An extension header's length byte.
            7 => set(f, l3 + 41, rng.next() as u8),
            // Ethertype.
            8 => {
                let v = rng.pick(&[0x0800u16, 0x86dd, 0x8100, 0x88a8, 0x0806, 0]);
                set(f, 12, (v >> 8) as u8);
                set(f, 13, v as u8);
            }
            // Any header byte.
            _ => {
                let i = rng.range(12, hdr_end.max(13) as u64 - 1) as usize;
                set(f, i, rng.next() as u8);
            }
        }
    }
}

/// Guest-physical address of a scratch area A's raw chains point into.
struct Scratch {
    addr: u64,
    len: u64,
}

fn random_addr(rng: &mut Rng, a: &TestFrontend, s: &Scratch) -> u64 {
    let end = a.mem_end();
    match rng.below(8) {
        0..=2 => s.addr + rng.below(s.len),
        3 => rng.below(end),
        4 => end + rng.below(1 << 30),
        5 => end - rng.range(1, 64),
        6 => rng.pick(&[0, 8, 4095, u64::MAX - 15, u64::MAX]),
        _ => rng.next(),
    }
}

fn random_len(rng: &mut Rng) -> u32 {
    match rng.below(8) {
        0 => rng.pick(&[0, 1, 11, 12, 13, 26]),
        1 | 2 => rng.range(0, 256) as u32,
        3 | 4 => rng.range(0, 4096) as u32,
        5 => rng.pick(&[65535, 65536, 65549, 65550, 65551, 1 << 20]),
        6 => u32::MAX,
        _ => rng.next() as u32,
    }
}

/// A random descriptor table of `n` entries (for the ring or an indirect table).
fn random_descs(rng: &mut Rng, a: &TestFrontend, s: &Scratch, n: usize) -> Vec<RawDesc> {
    (0..n)
        .map(|i| {
            let mut d = RawDesc::new(random_addr(rng, a, s), random_len(rng));
            if rng.chance(8) {
                d = d.write();
            }
            if rng.chance(8) {
                d = d.indirect();
            }
            match rng.below(10) {
                0..=5 if i + 1 < n => d = d.next(i as u16 + 1),
                6 => d = d.next(rng.below(n as u64) as u16), // maybe a loop
                7 => d = d.next(rng.next() as u16),          // maybe out of range
                _ => {}
            }
            d
        })
        .collect()
}

/// Fills the scratch area: random bytes, valid-looking headers and frames, and
/// descriptor tables pointing back into it.
fn fill_scratch(rng: &mut Rng, a: &TestFrontend, s: &Scratch) {
    let mem = a.memory();
    let bytes = rng.bytes(s.len as usize);
    mem.write_slice(&bytes, GuestAddress(s.addr)).unwrap();
    for _ in 0..4 {
        let gso = rng.chance(30);
        let (h, f) = valid_frame(rng, frames::BROADCAST, gso);
        let mut b = common::wire_hdr::encode(&h).to_vec();
        b.extend_from_slice(&f[..f.len().min(2000)]);
        let at = s.addr + rng.below(s.len - b.len() as u64);
        mem.write_slice(&b, GuestAddress(at)).unwrap();
    }
    for _ in 0..4 {
        let n = rng.range(1, 8) as usize;
        let at = (s.addr + rng.below(s.len - 16 * n as u64)) & !15;
        for (i, d) in random_descs(rng, a, s, n).iter().enumerate() {
            let mut flags = d.flags;
            let mut next = 0;
            if let Some(x) = d.next {
                flags |= 1; // NEXT
                next = x;
            }
            let desc = virtio_queue::desc::split::Descriptor::new(d.addr, d.len, flags, next);
            mem.write_obj(desc, GuestAddress(at + 16 * i as u64))
                .unwrap();
        }
    }
}

// ---------------------------------------------------------------------------------------
// The harness

struct Harness {
    d: Daemon,
    a: TestFrontend,
    peers: Vec<Peer>,
    scratch: Scratch,
    tap_mac: Option<[u8; 6]>,
    /// Chains A published on TX (the frontend's own count survives only one connection).
    a_tx_chains: u64,
    /// Good frames sent to A / received by A.
    to_a: u64,
    at_a: u64,
    seq: u32,
    counts: BTreeMap<&'static str, u64>,
}

impl Harness {
    fn alive(&mut self, ctx: &str) {
        if !self.d.alive() {
            panic!("gsonet died ({ctx})\n{}", self.d.log_text());
        }
    }

    /// Drains a peer without waiting; frames from the tap's host side are ignored.
    fn drain(&mut self, i: usize) -> Vec<RxFrame> {
        let mut v = Vec::new();
        loop {
            match self.peers[i].fe.try_recv(Duration::ZERO) {
                Ok(Some(f)) => {
                    if self
                        .tap_mac
                        .is_some_and(|m| f.frame.get(6..12) == Some(&m[..]))
                    {
                        continue;
                    }
                    v.push(f)
                }
                Ok(None) => return v,
                Err(e) => panic!(
                    "{}: device broke the RX protocol: {e:#}",
                    self.peers[i].name
                ),
            }
        }
    }

    /// Waits for one frame at peer `i` (host frames from the tap skipped).
    fn recv_peer(&mut self, i: usize) -> Option<RxFrame> {
        let deadline = Instant::now() + T;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.peers[i].fe.try_recv(left) {
                Ok(Some(f)) => {
                    if self
                        .tap_mac
                        .is_some_and(|m| f.frame.get(6..12) == Some(&m[..]))
                    {
                        continue;
                    }
                    return Some(f);
                }
                Ok(None) => return None,
                Err(e) => panic!(
                    "{}: device broke the RX protocol: {e:#}",
                    self.peers[i].name
                ),
            }
        }
    }

    fn send_a(&mut self, bytes: &[u8], layout: TxLayout) {
        self.a.send_bytes(bytes, layout).expect("A send");
        self.a_tx_chains += 1;
    }

    fn a_done(&mut self, what: &str) {
        // gsonet returns a batch of TX chains as soon as their frames are copied out,
        // before the frames are delivered (a restart never sends them twice), and
        // takes the next batch only once they are. So a fence sent after the frame's
        // chain came back, a chain too short to be a frame (`too_short`, counted as a
        // chain drop), is returned only after the worker delivered the frame.
        self.wait_a(what);
        let fence = [0u8; HDR_LEN + 6];
        self.send_a(&fence, TxLayout::Single);
        self.wait_a(what);
    }

    fn wait_a(&mut self, what: &str) {
        if let Err(e) = self.a.wait_tx_done(T) {
            self.alive(what);
            panic!(
                "A's TX hangs after {what}: {e:#}\n{:#}",
                self.d.stats().unwrap()
            );
        }
    }

    /// After A's frame went through: what each peer got must follow from `sent`.
    fn check_peers(&mut self, sent: &Sent, what: &str) {
        // A peer that takes GSO gets plain frames through GRO, which holds them until
        // the end of the worker's batch: possibly after A's chain (and the fence) came
        // back. A plain frame that reached a peer without GRO is on its way to it too.
        let gro = |p: &Peer| p.rx_feats & feat::GUEST_GSO != 0;
        let mut arrived = false;
        let mut order: Vec<usize> = (0..self.peers.len()).collect();
        order.sort_by_key(|&i| gro(&self.peers[i]));
        for i in order {
            let mut got = self.drain(i);
            if got.is_empty() && arrived && gro(&self.peers[i]) && !sent.is_gso() {
                got.extend(self.recv_peer(i));
                got.extend(self.drain(i));
            }
            arrived |= !got.is_empty();
            let p = &self.peers[i];
            if let Err(e) = check_outputs(p, sent, &got) {
                panic!(
                    "{what}: {} got something it must not: {e}\nsent header {:02x?}, {}-byte frame\n  {:02x?}\nreceived: {:?}",
                    p.name,
                    sent.hdr,
                    sent.frame.len(),
                    &sent.frame[..sent.frame.len().min(96)],
                    got.iter()
                        .map(|r| (r.hdr, r.frame.len()))
                        .take(8)
                        .collect::<Vec<_>>()
                );
            }
        }
    }

    /// After raw chains: only the header rules apply to whatever arrived.
    fn check_peers_raw(&mut self) {
        for i in 0..self.peers.len() {
            for r in self.drain(i) {
                let p = &self.peers[i];
                if let Err(e) = check_rx_header(p.rx_feats, &r.hdr, &r.frame) {
                    panic!("raw chain: {} got a bad header: {e}", p.name);
                }
                *self.counts.entry("raw_chain_frames_forwarded").or_default() += 1;
            }
        }
    }

    fn good_frame(
        &mut self,
        from: frames::Mac,
        to: frames::Mac,
        rng: &mut Rng,
    ) -> (VirtioNetHdr, Vec<u8>) {
        self.seq = self.seq.wrapping_add(1);
        let (mut h, mut f) = valid_frame(rng, to, false);
        f[6..12].copy_from_slice(&from);
        // Every port here is untagged: good frames are too.
        untag(&mut h, &mut f);
        // The partial checksum does not cover the MAC addresses: still valid.
        (h, f)
    }

    /// Every peer sends A a good frame; A must get each byte-exact.
    fn peers_to_a(&mut self, rng: &mut Rng) {
        let mut want = Vec::new();
        for i in 0..self.peers.len() {
            let mac = self.peers[i].mac;
            let (h, f) = self.good_frame(mac, a_mac(), rng);
            let layout = random_layout(rng, f.len() + HDR_LEN);
            self.peers[i].fe.send(&h, &f, layout).expect("peer send");
            want.push(finished(h.flags, h.csum_start, h.csum_offset, &f).unwrap());
            self.to_a += 1;
        }
        while !want.is_empty() {
            let Some(r) = self.recv_a() else {
                self.alive("peers to A");
                panic!(
                    "A did not get {} good frames from its peers\n{:#}",
                    want.len(),
                    self.d.stats().unwrap()
                );
            };
            check_rx_header(
                feat::RINGS | feat::HOST_ALL | feat::GUEST_CSUM,
                &r.hdr,
                &r.frame,
            )
            .unwrap_or_else(|e| panic!("A got a bad header: {e}"));
            let have = finished(r.hdr.flags, r.hdr.csum_start, r.hdr.csum_offset, &r.frame)
                .expect("csum in range");
            let Some(k) = want.iter().position(|w| *w == have) else {
                panic!("A got a frame no peer sent ({} bytes)", have.len());
            };
            want.swap_remove(k);
            self.at_a += 1;
        }
        for p in &mut self.peers {
            p.fe.wait_tx_done(T).expect("peer TX");
        }
    }

    fn recv_a(&mut self) -> Option<RxFrame> {
        let deadline = Instant::now() + T;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.a.try_recv(left) {
                Ok(Some(f)) => {
                    if self
                        .tap_mac
                        .is_some_and(|m| f.frame.get(6..12) == Some(&m[..]))
                    {
                        continue;
                    }
                    return Some(f);
                }
                Ok(None) => return None,
                Err(e) => panic!("A: device broke the RX protocol: {e:#}"),
            }
        }
    }

    /// A broadcasts a good frame: every peer must get exactly it.
    fn marker(&mut self, rng: &mut Rng) {
        let (h, f) = self.good_frame(a_mac(), frames::BROADCAST, rng);
        let mut b = common::wire_hdr::encode(&h).to_vec();
        b.extend_from_slice(&f);
        let layout = random_layout(rng, b.len());
        self.send_a(&b, layout);
        let want = finished(h.flags, h.csum_start, h.csum_offset, &f).unwrap();
        for i in 0..self.peers.len() {
            let Some(r) = self.recv_peer(i) else {
                self.alive("marker");
                panic!(
                    "{} did not get A's good frame\n{:#}",
                    self.peers[i].name,
                    self.d.stats().unwrap()
                );
            };
            check_rx_header(self.peers[i].rx_feats, &r.hdr, &r.frame)
                .unwrap_or_else(|e| panic!("{}: {e}", self.peers[i].name));
            let have = finished(r.hdr.flags, r.hdr.csum_start, r.hdr.csum_offset, &r.frame)
                .expect("csum in range");
            assert!(
                have == want,
                "{} got {} bytes instead of A's {}-byte good frame",
                self.peers[i].name,
                have.len(),
                want.len()
            );
        }
        self.a_done("a good frame");
    }

    fn raw_tx(&mut self, rng: &mut Rng) {
        fill_scratch(rng, &self.a, &self.scratch);
        let n = rng.range(1, 6) as usize;
        let descs = random_descs(rng, &self.a, &self.scratch, n);
        self.a.push_raw(1, &descs).expect("push raw TX");
        self.a_tx_chains += 1;
        self.a_done("a raw chain");
        self.check_peers_raw();
    }

    fn header_fuzz(&mut self, rng: &mut Rng) {
        let gso = rng.chance(60);
        let (h, mut f) = valid_frame(rng, frames::BROADCAST, gso);
        if rng.chance(25) {
            f.truncate(rng.below(f.len() as u64 + 1) as usize);
        }
        let hdr = fuzz_header(rng, &h, f.len());
        self.send_sent(
            rng,
            Sent {
                hdr,
                frame: f,
                must_arrive: false,
            },
            "random header",
        );
    }

    fn mutate(&mut self, rng: &mut Rng) {
        let (h, mut f) = valid_frame(rng, frames::BROADCAST, true);
        let clean = rng.chance(20);
        let uso_ok = h.gso.kind != gsonet::vnet_hdr::GsoKind::UdpL4
            || f.len() - h.hdr_len as usize <= 128 * h.gso_size as usize;
        if !clean {
            mutate_frame(rng, &mut f);
        }
        self.send_sent(
            rng,
            Sent {
                hdr: common::wire_hdr::encode(&h),
                frame: f,
                // USO may ask for at most 128 segments (Linux UDP_MAX_SEGMENTS).
                must_arrive: clean && uso_ok,
            },
            if clean {
                "valid GSO frame"
            } else {
                "mutated GSO frame"
            },
        );
    }

    fn send_sent(&mut self, rng: &mut Rng, sent: Sent, what: &str) {
        let mut b = sent.hdr.to_vec();
        b.extend_from_slice(&sent.frame);
        let layout = random_layout(rng, b.len());
        self.send_a(&b, layout);
        self.a_done(what);
        self.check_peers(&sent, what);
    }

    /// Bad RX buffers behind A's good ones, or none at all, while a peer floods A.
    fn rx_abuse(&mut self, rng: &mut Rng) {
        let before = self.d.stats().expect("stats");
        let bad = rng.range(0, 4) as usize;
        let end = self.a.mem_end();
        let s = self.scratch.addr;
        let mut kinds = Vec::new();
        for _ in 0..bad {
            let k = rng.below(5);
            let chain = match k {
                0 => vec![RawDesc::new(end + rng.below(1 << 20), 4096).write()],
                1 => vec![RawDesc::new(end - rng.range(1, 11), 4096).write()],
                2 => vec![RawDesc::new(s, 4096)],
                3 => vec![RawDesc::new(s, 2048).write().next(1), RawDesc::new(s, 64)],
                _ => {
                    let t = self.scratch.addr + self.scratch.len - 16;
                    let d = virtio_queue::desc::split::Descriptor::new(
                        end + 0x1000,
                        4096,
                        2, // WRITE
                        0,
                    );
                    self.a.memory().write_obj(d, GuestAddress(t)).unwrap();
                    vec![RawDesc::new(t, 16).indirect()]
                }
            };
            kinds.push(if matches!(k, 2 | 3) {
                "rx_readable_descriptor"
            } else {
                "rx_bad_address"
            });
            self.a.push_raw(RX_QUEUE, &chain).expect("push raw RX");
        }
        // A posted A_RX buffers, all free now; the bad ones come after them.
        let flood = A_RX + bad + rng.range(0, 8) as usize;
        let src = rng.below(self.peers.len() as u64) as usize;
        let mut sent = Vec::new();
        for _ in 0..flood {
            let mac = self.peers[src].mac;
            let (h, f) = self.good_frame(mac, a_mac(), rng);
            self.peers[src]
                .fe
                .send(&h, &f, TxLayout::Single)
                .expect("flood");
            sent.push(finished(h.flags, h.csum_start, h.csum_offset, &f).unwrap());
            self.to_a += 1;
        }
        self.peers[src].fe.wait_tx_done(T).expect("flood TX");
        // A's first A_RX buffers took the first frames, and each bad chain lost one,
        // counted; the rest found A's queue full and were held by the peer's TX
        // worker, and arrive in order as A gives its buffers back.
        let arrive = sent.iter().take(A_RX).chain(sent.iter().skip(A_RX + bad));
        for (i, w) in arrive.enumerate() {
            let r = self
                .recv_a()
                .unwrap_or_else(|| panic!("flood frame {i} missing at A"));
            let have =
                finished(r.hdr.flags, r.hdr.csum_start, r.hdr.csum_offset, &r.frame).unwrap();
            assert!(have == *w, "flood frame {i} at A differs");
            self.at_a += 1;
        }
        if let Ok(Some(r)) = self.a.try_recv(Duration::from_millis(20)) {
            panic!("A got a frame beyond its buffers: {:?}", r.hdr);
        }
        let after = self.d.stats().expect("stats");
        let lost = bad as u64;
        let delta = |reason: &str| drop_of(&after, 0, reason) - drop_of(&before, 0, reason);
        let rx_lost: u64 = RX_REASONS.iter().map(|r| delta(r)).sum();
        assert_eq!(
            rx_lost, lost,
            "frames lost at A vs. A's RX drops\n{after:#}"
        );
        for k in ["rx_readable_descriptor", "rx_bad_address"] {
            let n = kinds.iter().filter(|x| **x == k).count() as u64;
            assert_eq!(delta(k), n, "{k} drops for {kinds:?}\n{after:#}");
        }
        // Every bad RX chain came back unused.
        let raw: Vec<_> = self
            .a
            .raw_used()
            .iter()
            .filter(|(q, _, _)| *q == RX_QUEUE)
            .copied()
            .collect();
        assert!(
            raw.iter().all(|&(_, _, len)| len == 0),
            "bad RX chain used: {raw:?}"
        );
    }
}

fn drop_of(stats: &Value, port: usize, reason: &str) -> u64 {
    stats["ports"][port]["stats"]["drops"][reason]
        .as_u64()
        .unwrap_or(0)
}

fn check_counters(h: &Harness) -> Value {
    let s = h.d.stats().expect("stats");
    let text = s.to_string();
    assert!(!text.contains("panic"), "a counter mentions a panic: {s:#}");
    let a = &s["ports"][0]["stats"];
    let tx = a["tx_frames"].as_u64().unwrap_or(0);
    let chain_drops: u64 = CHAIN_REASONS.iter().map(|r| drop_of(&s, 0, r)).sum();
    assert_eq!(
        tx + chain_drops,
        h.a_tx_chains,
        "every chain A published is a TX frame or one chain drop\n{s:#}"
    );
    s
}

fn pick_op(rng: &mut Rng) -> Op {
    match rng.below(100) {
        0..=24 => Op::RawTx,
        25..=54 => Op::HeaderFuzz,
        55..=89 => Op::Mutate,
        90..=94 => Op::RxAbuse,
        _ => Op::Good,
    }
}

#[test]
fn hostile_guest_cannot_hurt_its_peers() {
    let seed = seed_from_env();
    let secs = secs_from_env();
    eprintln!("hostile guest: GSONET_FUZZ_SEED={seed:#x} GSONET_FUZZ_SECS={secs}");
    let mut rng = Rng::new(seed);

    // Without a tap the peers are only guests: that needs GSONET_ALLOW_SKIP=1.
    let tap = tun_available() || gsonet::testkit::can_run(false, "a tap peer (root)");
    let mut spec = DaemonSpec::ports(4);
    if tap {
        spec = spec.with_tap("gso=software");
    }
    let d = Daemon::start(&spec).expect("start gsonet");
    let tap_mac = d.tap.as_ref().and_then(|t| {
        let s = std::fs::read_to_string(format!("/sys/class/net/{t}/address")).ok()?;
        let v: Vec<u8> = s
            .trim()
            .split(':')
            .filter_map(|x| u8::from_str_radix(x, 16).ok())
            .collect();
        v.try_into().ok()
    });
    let mut a = connect_a(&d);
    let peer_feats = [
        ("B", 0u64),
        ("C", feat::GUEST_CSUM),
        ("D", feat::GUEST_CSUM | feat::GUEST_GSO),
    ];
    let peers: Vec<Peer> = peer_feats
        .iter()
        .enumerate()
        .map(|(i, &(name, rx))| Peer {
            name,
            fe: connect(&d, i + 1, feat::RINGS | feat::HOST_ALL | rx, PEER_RX),
            rx_feats: rx,
            mac: peer_mac(i),
        })
        .collect();
    let scratch_len = 64 << 10;
    let scratch = Scratch {
        addr: a.alloc_guest(&vec![0; scratch_len]).expect("scratch"),
        len: scratch_len as u64,
    };
    let _ = &mut a;
    let mut h = Harness {
        d,
        a,
        peers,
        scratch,
        tap_mac,
        a_tx_chains: 0,
        to_a: 0,
        at_a: 0,
        seq: 0,
        counts: BTreeMap::new(),
    };
    // Everyone announces itself, so the switch knows where the good frames go.
    h.marker(&mut rng);
    h.peers_to_a(&mut rng);

    let start = Instant::now();
    let mut iters = 0u64;
    // At least MIN_ITERS operations however slow the machine: the time only adds more.
    while iters < MIN_ITERS || start.elapsed().as_secs_f64() < secs {
        let op = pick_op(&mut rng);
        *h.counts.entry(op_name(op)).or_default() += 1;
        match op {
            Op::RawTx => h.raw_tx(&mut rng),
            Op::HeaderFuzz => h.header_fuzz(&mut rng),
            Op::Mutate => h.mutate(&mut rng),
            Op::RxAbuse => h.rx_abuse(&mut rng),
            Op::Good => {}
        }
        h.alive(op_name(op));
        // Good traffic both ways; peers' frames also re-teach the switch where they
        // are, in case a hostile frame claimed a peer's address.
        h.peers_to_a(&mut rng);
        h.marker(&mut rng);
        iters += 1;
        if iters.is_multiple_of(256) {
            check_counters(&h);
        }
    }
    let elapsed = start.elapsed().as_secs_f64();
    for op in ["raw_tx", "header_fuzz", "mutate", "rx_abuse", "good"] {
        let n = h.counts.get(op).copied().unwrap_or(0);
        assert!(n >= 5, "only {n} {op} operations: {:?}", h.counts);
    }
    let s = check_counters(&h);
    let log = h.d.log_text();
    assert!(!log.contains("panicked"), "the daemon panicked:\n{log}");

    // A reconnects (a rebooted guest) and talks again.
    let Harness {
        d,
        a,
        mut peers,
        counts,
        ..
    } = h;
    drop(a);
    std::thread::sleep(Duration::from_millis(100));
    let mut a = connect_a(&d);
    let flow = Flow::new(a_mac(), peer_mac(0), Ips::v4()).ports(1, 2);
    let (hh, f) = frames::udp(&flow, b"after reconnect", UdpGso::None);
    a.send(&hh, &f, TxLayout::Single).unwrap();
    let got = common::rx::recv_where(&mut peers[0].fe, T, |r| r.frame == f);
    assert!(got.is_some(), "B did not hear the reconnected A");
    let back = Flow::new(peer_mac(0), a_mac(), Ips::v4()).ports(2, 1);
    let (hh, f) = frames::udp(&back, b"welcome back", UdpGso::None);
    peers[0].fe.send(&hh, &f, TxLayout::Single).unwrap();
    let got = common::rx::recv_where(&mut a, T, |r| r.frame == f);
    assert!(got.is_some(), "the reconnected A did not hear B");
    let mut d = d;
    assert!(d.alive(), "gsonet died at the end");

    eprintln!(
        "hostile guest: seed {seed:#x}, {iters} iterations in {elapsed:.1}s ({:.0}/s), tap {tap}, ops {counts:?}",
        iters as f64 / elapsed
    );
    eprintln!("A drops: {}", s["ports"][0]["stats"]["drops"]);
    for i in 1..4 {
        eprintln!(
            "{} drops: {}",
            peer_feats[i - 1].0,
            s["ports"][i]["stats"]["drops"]
        );
    }
    if tap {
        eprintln!("tap drops: {}", s["uplinks"][0]["stats"]["drops"]);
    }
}

fn op_name(op: Op) -> &'static str {
    match op {
        Op::RawTx => "raw_tx",
        Op::HeaderFuzz => "header_fuzz",
        Op::Mutate => "mutate",
        Op::RxAbuse => "rx_abuse",
        Op::Good => "good",
    }
}

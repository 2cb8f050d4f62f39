//! Test frames of a flow (Ethernet + IPv4/IPv6 + TCP/UDP, built by gsonet's testkit)
//! with the virtio_net_hdr a guest driver would put in front of them, and checking
//! what comes out with `etherparse` as the independent oracle.
//!
//! GSO frames carry a partial checksum (the pseudo-header sum, not complemented, in
//! the L4 checksum field) as Linux's virtio_net sends them; plain frames carry a full
//! checksum, completed here by RFC 1071 code of the tests' own.

#![allow(dead_code)]

use std::collections::BTreeMap;

use anyhow::{anyhow, bail, ensure, Result};
use etherparse::{NetSlice, SlicedPacket, TransportSlice};
use gsonet::testkit::frames::{build, gso_hdr, tcp_timestamps, FrameSpec};
use gsonet::vnet_hdr::{GsoKind, VirtioNetHdr};

pub const ETH_LEN: usize = 14;
pub const IPV4_LEN: usize = 20;
pub const IPV6_LEN: usize = 40;
pub const UDP_LEN: usize = 8;
/// TCP header with a 12-byte timestamp option (NOP NOP TS), as Linux sends it.
pub const TCP_LEN: usize = 32;
/// Linux's MSS for IPv4 over a 1500 MTU with TCP timestamps.
pub const MSS4: u16 = 1448;
/// Same for IPv6.
pub const MSS6: u16 = 1428;

pub type Mac = [u8; 6];

pub fn mac(last: u8) -> Mac {
    [0x02, 0x00, 0x5e, 0x10, 0x00, last]
}

pub const BROADCAST: Mac = [0xff; 6];

/// IP addresses of a flow.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ips {
    V4([u8; 4], [u8; 4]),
    V6([u8; 16], [u8; 16]),
}

impl Ips {
    pub fn v4() -> Ips {
        Ips::V4([192, 0, 2, 1], [192, 0, 2, 2])
    }
    pub fn v6() -> Ips {
        let mut a = [0u8; 16];
        a[0] = 0x20;
        a[1] = 0x01;
        a[2] = 0x0d;
        a[3] = 0xb8;
        let mut b = a;
        a[15] = 1;
        b[15] = 2;
        Ips::V6(a, b)
    }
    pub fn is_v6(&self) -> bool {
        matches!(self, Ips::V6(..))
    }
    pub fn ip_len(&self) -> usize {
        if self.is_v6() {
            IPV6_LEN
        } else {
            IPV4_LEN
        }
    }
}

/// Addresses and ports of one flow.
#[derive(Clone, Copy, Debug)]
pub struct Flow {
    pub src_mac: Mac,
    pub dst_mac: Mac,
    pub ips: Ips,
    pub sport: u16,
    pub dport: u16,
}

impl Flow {
    pub fn new(src_mac: Mac, dst_mac: Mac, ips: Ips) -> Flow {
        Flow {
            src_mac,
            dst_mac,
            ips,
            sport: 40000,
            dport: 5201,
        }
    }
    pub fn ports(mut self, sport: u16, dport: u16) -> Flow {
        self.sport = sport;
        self.dport = dport;
        self
    }
}

/// A deterministic, non-repeating-looking payload.
#[allow(unused_imports)] // not every test binary uses it
pub use gsonet::testkit::frames::payload;

// ---------------------------------------------------------------------------------------
// Checksums (RFC 1071), written here independently of gsonet's.

pub fn sum16(data: &[u8], mut acc: u64) -> u64 {
    let mut c = data.chunks_exact(2);
    for w in &mut c {
        acc += u16::from_be_bytes([w[0], w[1]]) as u64;
    }
    if let [b] = c.remainder() {
        acc += (*b as u64) << 8;
    }
    acc
}

pub fn fold(mut acc: u64) -> u16 {
    while acc >> 16 != 0 {
        acc = (acc & 0xffff) + (acc >> 16);
    }
    acc as u16
}

/// Pseudo-header sum for an L4 segment of `l4_len` bytes.
pub fn pseudo_sum(ips: &Ips, proto: u8, l4_len: usize) -> u64 {
    let mut acc = 0;
    match ips {
        Ips::V4(s, d) => {
            acc = sum16(s, acc);
            acc = sum16(d, acc);
        }
        Ips::V6(s, d) => {
            acc = sum16(s, acc);
            acc = sum16(d, acc);
        }
    }
    acc + proto as u64 + l4_len as u64
}

/// Completes a partial checksum as a NIC (or the receiving stack) would: sum from
/// `start` to the end (the field holds the pseudo-header sum) and store the
/// complement at `start + offset`.
pub fn finish_csum(frame: &mut [u8], start: usize, offset: usize) -> Result<()> {
    ensure!(
        start + offset + 2 <= frame.len(),
        "csum_start {start} + csum_offset {offset} beyond the {}-byte frame",
        frame.len()
    );
    let mut c = !fold(sum16(&frame[start..], 0));
    if c == 0 && offset == 6 {
        c = 0xffff; // UDP
    }
    frame[start + offset..start + offset + 2].copy_from_slice(&c.to_be_bytes());
    Ok(())
}

/// Applies a received header's NEEDS_CSUM to the frame (what the guest's stack would
/// do before trusting it), checking csum_start/csum_offset are where the L4 checksum is.
pub fn finish_if_partial(hdr: &VirtioNetHdr, frame: &mut [u8]) -> Result<()> {
    if hdr.needs_csum() {
        finish_csum(frame, hdr.csum_start as usize, hdr.csum_offset as usize)?;
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Building (gsonet's testkit builds the frames; here a flow becomes a frame spec)

impl Flow {
    /// The frame spec of this flow carrying `data` over TCP or UDP.
    pub fn spec(&self, tcp: bool, data: &[u8]) -> FrameSpec {
        let mut s = FrameSpec {
            macs: (self.dst_mac, self.src_mac),
            tcp,
            ports: Some((self.sport, self.dport)),
            payload: data.to_vec(),
            ..FrameSpec::default()
        };
        match self.ips {
            Ips::V4(src, dst) => s.ip4 = (src, dst),
            Ips::V6(src, dst) => (s.v6, s.ip6) = (true, (src, dst)),
        }
        s
    }
}

/// Builds `spec`: with `gso`, a GSO frame of that kind and size with its partial
/// checksum; without, a plain frame with a full checksum.
pub fn build_with(spec: &FrameSpec, gso: Option<(GsoKind, u16)>) -> (VirtioNetHdr, Vec<u8>) {
    let (mut f, l4) = build(spec);
    let Some((kind, size)) = gso else {
        let offset = if spec.tcp { 16 } else { 6 };
        finish_csum(&mut f, l4, offset).expect("checksum inside the frame");
        return (VirtioNetHdr::default(), f);
    };
    let mut hdr = gso_hdr(kind, size, l4, spec.tcp);
    hdr.hdr_len = (f.len() - spec.payload.len()) as u16;
    (hdr, f)
}

/// TCP flags.
pub const FIN: u8 = 0x01;
pub const PSH: u8 = 0x08;
pub const ACK: u8 = 0x10;

/// A TCP frame with `data`. `gso_size`: a GSO frame (TCPV4/TCPV6) with a partial
/// checksum; None: a plain frame with a full checksum.
pub fn tcp(flow: &Flow, seq: u32, data: &[u8], gso_size: Option<u16>) -> (VirtioNetHdr, Vec<u8>) {
    tcp_with_flags(flow, seq, ACK | PSH, data, gso_size)
}

/// A TCP frame with timestamps (header: [`TCP_LEN`] bytes) and `flags`.
pub fn tcp_with_flags(
    flow: &Flow,
    seq: u32,
    flags: u8,
    data: &[u8],
    gso_size: Option<u16>,
) -> (VirtioNetHdr, Vec<u8>) {
    let spec = FrameSpec {
        seq,
        tcp_flags: flags,
        tcp_opts: tcp_timestamps(),
        ..flow.spec(true, data)
    };
    let kind = if flow.ips.is_v6() {
        GsoKind::TcpV6
    } else {
        GsoKind::TcpV4
    };
    build_with(&spec, gso_size.map(|mss| (kind, mss)))
}

/// How a UDP frame asks to be segmented.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UdpGso {
    None,
    /// gso_type UDP (UFO): one datagram, IP-fragmented into pieces of `gso_size`.
    Ufo(u16),
    /// gso_type UDP_L4 (USO): one UDP datagram per `gso_size` bytes of payload.
    Uso(u16),
}

/// A UDP frame with `data`: plain with a full checksum, or UFO/USO with a partial one.
/// IPv4 without Don't Fragment, as UFO needs.
pub fn udp(flow: &Flow, data: &[u8], gso: UdpGso) -> (VirtioNetHdr, Vec<u8>) {
    let spec = FrameSpec {
        ip_id: 0x4321,
        df: false,
        ..flow.spec(false, data)
    };
    let gso = match gso {
        UdpGso::None => None,
        UdpGso::Ufo(size) => Some((GsoKind::Udp, size)),
        UdpGso::Uso(size) => Some((GsoKind::UdpL4, size)),
    };
    build_with(&spec, gso)
}

// ---------------------------------------------------------------------------------------
// Checking what arrives (etherparse is the oracle)

/// A TCP segment as etherparse sees it, checksum verified.
#[derive(Clone, Debug)]
pub struct TcpSeg {
    pub sport: u16,
    pub dport: u16,
    pub seq: u32,
    pub fin: bool,
    pub psh: bool,
    pub ip_id: Option<u16>,
    pub payload: Vec<u8>,
    /// L3 packet length (IPv4 total length / IPv6 header + payload length).
    pub l3_len: usize,
    pub options: Vec<u8>,
}

/// Parses a complete (checksum-finished) Ethernet frame carrying TCP; verifies the
/// IPv4 header checksum and the TCP checksum with etherparse.
pub fn parse_tcp(frame: &[u8]) -> Result<TcpSeg> {
    let p = SlicedPacket::from_ethernet(frame).map_err(|e| anyhow!("etherparse: {e}"))?;
    let Some(TransportSlice::Tcp(tcp)) = &p.transport else {
        bail!("not TCP: {:?}", p.transport);
    };
    let hdr = tcp.to_header();
    let payload = tcp.payload();
    let (want, ip_id, l3_len) = match &p.net {
        Some(NetSlice::Ipv4(ip)) => {
            let h = ip.header().to_header();
            ensure!(
                h.header_checksum == h.calc_header_checksum(),
                "bad IPv4 header checksum"
            );
            ensure!(!ip.is_payload_fragmented(), "fragmented TCP");
            (
                hdr.calc_checksum_ipv4(&h, payload)
                    .map_err(|e| anyhow!("{e}"))?,
                Some(h.identification),
                h.total_len as usize,
            )
        }
        Some(NetSlice::Ipv6(ip)) => {
            let h = ip.header().to_header();
            (
                hdr.calc_checksum_ipv6(&h, payload)
                    .map_err(|e| anyhow!("{e}"))?,
                None,
                IPV6_LEN + h.payload_length as usize,
            )
        }
        other => bail!("no IP: {other:?}"),
    };
    ensure!(
        hdr.checksum == want,
        "bad TCP checksum {:#06x}, expected {want:#06x}",
        hdr.checksum
    );
    Ok(TcpSeg {
        sport: hdr.source_port,
        dport: hdr.destination_port,
        seq: hdr.sequence_number,
        fin: hdr.fin,
        psh: hdr.psh,
        ip_id,
        payload: payload.to_vec(),
        l3_len,
        options: hdr.options.as_slice().to_vec(),
    })
}

/// A UDP datagram as etherparse sees it, checksum verified (unless 0 on IPv4).
#[derive(Clone, Debug)]
pub struct UdpDgram {
    pub sport: u16,
    pub dport: u16,
    pub ip_id: Option<u16>,
    pub payload: Vec<u8>,
    pub l3_len: usize,
}

pub fn parse_udp(frame: &[u8]) -> Result<UdpDgram> {
    let p = SlicedPacket::from_ethernet(frame).map_err(|e| anyhow!("etherparse: {e}"))?;
    let Some(TransportSlice::Udp(udp)) = &p.transport else {
        bail!("not UDP: {:?}", p.transport);
    };
    let hdr = udp.to_header();
    let payload = udp.payload();
    ensure!(
        hdr.length as usize == UDP_LEN + payload.len(),
        "UDP length {} for {} payload bytes",
        hdr.length,
        payload.len()
    );
    let (want, ip_id, l3_len) = match &p.net {
        Some(NetSlice::Ipv4(ip)) => {
            let h = ip.header().to_header();
            ensure!(
                h.header_checksum == h.calc_header_checksum(),
                "bad IPv4 header checksum"
            );
            ensure!(!ip.is_payload_fragmented(), "fragmented UDP");
            (
                hdr.calc_checksum_ipv4(&h, payload)
                    .map_err(|e| anyhow!("{e}"))?,
                Some(h.identification),
                h.total_len as usize,
            )
        }
        Some(NetSlice::Ipv6(ip)) => {
            let h = ip.header().to_header();
            (
                hdr.calc_checksum_ipv6(&h, payload)
                    .map_err(|e| anyhow!("{e}"))?,
                None,
                IPV6_LEN + h.payload_length as usize,
            )
        }
        other => bail!("no IP: {other:?}"),
    };
    ensure!(
        hdr.checksum == want,
        "bad UDP checksum {:#06x}, expected {want:#06x}",
        hdr.checksum
    );
    Ok(UdpDgram {
        sport: hdr.source_port,
        dport: hdr.destination_port,
        ip_id,
        payload: payload.to_vec(),
        l3_len,
    })
}

/// Reassembles TCP payload by sequence number starting at `seq0`; segments may
/// overlap only with identical bytes; the result must have no holes.
pub fn reassemble_tcp(segs: &[TcpSeg], seq0: u32) -> Result<Vec<u8>> {
    let mut by_off: BTreeMap<usize, &[u8]> = BTreeMap::new();
    for s in segs {
        let off = s.seq.wrapping_sub(seq0) as usize;
        ensure!(off < 1 << 20, "segment seq {} far from {seq0}", s.seq);
        if let Some(prev) = by_off.insert(off, &s.payload) {
            ensure!(
                prev == s.payload.as_slice(),
                "two different segments at offset {off}"
            );
        }
    }
    let mut out = Vec::new();
    for (off, data) in by_off {
        ensure!(
            off <= out.len(),
            "hole in the stream: {} bytes then a segment at {off}",
            out.len()
        );
        let overlap = out.len() - off;
        if overlap > 0 {
            let n = overlap.min(data.len());
            ensure!(
                out[off..off + n] == data[..n],
                "overlapping bytes differ at {off}"
            );
        }
        if data.len() > overlap {
            out.extend_from_slice(&data[overlap..]);
        }
    }
    Ok(out)
}

/// An IPv4 fragment: (identification, offset in bytes, more fragments, payload).
#[derive(Clone, Debug)]
pub struct Frag {
    pub id: u32,
    pub offset: usize,
    pub more: bool,
    pub payload: Vec<u8>,
    pub l3_len: usize,
    pub proto: u8,
}

/// Parses an IPv4 or IPv6 fragment with etherparse (IPv4 header checksum verified).
pub fn parse_frag(frame: &[u8]) -> Result<Frag> {
    let p = etherparse::LaxSlicedPacket::from_ethernet(frame)
        .map_err(|e| anyhow!("etherparse: {e}"))?;
    match &p.net {
        Some(etherparse::LaxNetSlice::Ipv4(ip)) => {
            let h = ip.header().to_header();
            ensure!(
                h.header_checksum == h.calc_header_checksum(),
                "bad IPv4 header checksum"
            );
            ensure!(!h.dont_fragment, "DF set on a fragment");
            let pl = ip.payload();
            Ok(Frag {
                id: h.identification as u32,
                offset: h.fragment_offset.byte_offset() as usize,
                more: h.more_fragments,
                payload: pl.payload.to_vec(),
                l3_len: h.total_len as usize,
                proto: h.protocol.0,
            })
        }
        Some(etherparse::LaxNetSlice::Ipv6(ip)) => {
            let h = ip.header().to_header();
            let exts = ip.extensions();
            let fs = exts
                .clone()
                .into_iter()
                .find_map(|e| match e {
                    etherparse::Ipv6ExtensionSlice::Fragment(f) => Some(f),
                    _ => None,
                })
                .ok_or_else(|| anyhow!("IPv6 packet without a fragment header"))?;
            let fh = fs.to_header();
            // The fragment's data is every byte after its Fragment header, extension
            // headers of the fragmentable part included (etherparse would parse those
            // in a first fragment and leave them out of its payload).
            let at = |x: &[u8]| x.as_ptr() as usize - frame.as_ptr() as usize;
            let start = at(fs.slice()) + 8;
            let end = at(ip.header().slice()) + IPV6_LEN + h.payload_length as usize;
            ensure!(
                start <= end && end <= frame.len(),
                "fragment past its frame"
            );
            Ok(Frag {
                id: fh.identification,
                offset: fh.fragment_offset.byte_offset() as usize,
                more: fh.more_fragments,
                payload: frame[start..end].to_vec(),
                l3_len: IPV6_LEN + h.payload_length as usize,
                proto: fh.next_header.0,
            })
        }
        other => bail!("no IP: {other:?}"),
    }
}

/// Reassembles IP fragments: one identification, offsets multiples of 8, MF on all
/// but the last, no holes. Returns the reassembled L4 bytes (after any IPv6 extension
/// headers of the fragmentable part).
pub fn reassemble_frags(frags: &[Frag]) -> Result<Vec<u8>> {
    let first = frags.iter().find(|f| f.offset == 0);
    let mut next = first.map_or(0, |f| f.proto);
    let mut out = reassemble_fragmentable(frags)?;
    // Hop-by-hop, routing and destination options after the Fragment header.
    let mut skip = 0;
    while matches!(next, 0 | 43 | 60) {
        ensure!(out.len() >= skip + 8, "extension header past the datagram");
        next = out[skip];
        skip += 8 * (1 + usize::from(out[skip + 1]));
    }
    ensure!(out.len() >= skip, "extension header past the datagram");
    out.drain(..skip);
    Ok(out)
}

/// The fragments' data put back together, checked as `reassemble_frags` says.
fn reassemble_fragmentable(frags: &[Frag]) -> Result<Vec<u8>> {
    ensure!(!frags.is_empty(), "no fragments");
    let id = frags[0].id;
    let mut sorted: Vec<&Frag> = frags.iter().collect();
    sorted.sort_by_key(|f| f.offset);
    let mut out = Vec::new();
    for (i, f) in sorted.iter().enumerate() {
        ensure!(f.id == id, "fragments with different identifications");
        ensure!(
            f.offset % 8 == 0,
            "fragment offset {} not a multiple of 8",
            f.offset
        );
        ensure!(f.offset == out.len(), "hole/overlap at {}", f.offset);
        let last = i + 1 == sorted.len();
        ensure!(f.more != last, "MF wrong on fragment {i} (last: {last})");
        if !last {
            ensure!(
                f.payload.len() % 8 == 0,
                "non-final fragment payload {} not a multiple of 8",
                f.payload.len()
            );
        }
        out.extend_from_slice(&f.payload);
    }
    Ok(out)
}

/// Verifies a reassembled UDP datagram (header + payload) against its pseudo header.
pub fn check_udp_datagram(ips: &Ips, l4: &[u8]) -> Result<Vec<u8>> {
    let (h, payload) = etherparse::UdpHeader::from_slice(l4).map_err(|e| anyhow!("{e}"))?;
    ensure!(
        h.length as usize == l4.len(),
        "UDP length {} for a {}-byte datagram",
        h.length,
        l4.len()
    );
    let want = match ips {
        Ips::V4(s, d) => h.calc_checksum_ipv4_raw(*s, *d, payload),
        Ips::V6(s, d) => h.calc_checksum_ipv6_raw(*s, *d, payload),
    }
    .map_err(|e| anyhow!("{e}"))?;
    ensure!(
        h.checksum == want,
        "bad UDP checksum {:#06x}, want {want:#06x}",
        h.checksum
    );
    Ok(payload.to_vec())
}

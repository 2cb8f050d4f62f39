//! GRO: coalesces in-order TCP segments of one flow into one TSO frame, and UDP
//! datagrams of one flow into one USO frame, for a receiver that accepts them, by
//! Linux's rules (tcp_gro_receive, udp_gro_receive_segment, inet/ipv6_gro_receive).
//! Pure: frames in, frames out through a callback, no I/O and no clock; the caller
//! decides when a batch ends and calls [`Coalescer::flush`].
//!
//! A TCP segment joins the frame held for its flow when
//! - it is TCP over IPv4 without options and not a fragment, or IPv6 without
//!   extension headers; its IP length matches the frame (no Ethernet padding);
//! - its checksum is partial (NEEDS_CSUM at the TCP checksum), vouched for
//!   (DATA_VALID), or complete and correct (checked here); an IPv4 header checksum
//!   is always checked;
//! - it carries data, no URG, RST, SYN or CWR;
//! - every header byte equals the held frame's except the IP lengths, IPv4 ID and
//!   checksum, TCP sequence number, PSH and FIN, and the TCP checksum: addresses,
//!   tags, TOS/traffic class (so ECN CE does not merge with non-CE, as in Linux),
//!   TTL, DF, ports, ACK number, window and options (timestamps included: Linux
//!   compares the option words as they are);
//! - its sequence number follows the held data, its payload is at most the first
//!   segment's (the MSS), its IPv4 ID is the head's plus the segments held (or the
//!   head's, with DF, "fixed ID");
//! - the frame stays within 64 KiB of L3 and [`MAX_SEGS`] segments.
//!
//! PSH, FIN and a segment shorter than the MSS end the frame (after joining it). A
//! segment that cannot join ends its flow's frame first, so a flow is never reordered.
//! A frame that holds one segment leaves exactly as it came.
//!
//! A UDP datagram joins by the same IP rules, with its UDP length matching the frame
//! and its payload at most the first datagram's (the segment size); a shorter one
//! ends the frame. Its checksum is partial, vouched for, or complete, non-zero and
//! correct: a zero (absent) IPv4 UDP checksum passes alone, since the USO frame would
//! give every datagram one (Linux merges those too; re-cutting could not give them
//! back byte for byte). The frame's UDP length is the whole frame's, as Linux's
//! udp_gro_complete leaves it.

use super::csum::{self, Checksum};
use super::ip::{be16, be32, pseudo, put16};
use super::parse::{gather, parse_prefix, Headers, L3, L4, MAX_HEADERS};
use super::tcp::{TCP_CSUM_OFFSET, TCP_CWR, TCP_FIN, TCP_PSH};
use super::udp::UDP_CSUM_OFFSET;
use crate::vnet_hdr::{GsoKind, GsoType, VirtioNetHdr, F_DATA_VALID, F_NEEDS_CSUM};

/// Segments in one coalesced frame at most.
pub const MAX_SEGS: usize = 64;
/// Flows held at once per coalescer; a new one past it ends the oldest.
pub const MAX_FLOWS: usize = 8;
/// Largest IPv4 total length / IPv6 payload length.
const MAX_L3: usize = 0xffff;

const TCP_RST: u8 = 0x04;
const TCP_SYN: u8 = 0x02;
const TCP_URG: u8 = 0x20;

/// One frame handed out: a coalesced GSO frame, or a frame that held one segment (its
/// original header and bytes).
#[derive(Clone, Copy, Debug)]
pub struct Merged<'a> {
    pub vnet: VirtioNetHdr,
    pub bytes: &'a [u8],
    /// Segments it holds.
    pub segments: usize,
}

/// What [`Coalescer::offer`] did with a frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Offer {
    /// Held (alone or joined to its flow's frame); it leaves with a later emit.
    Taken,
    /// Not for GRO: the caller sends it as it is (after whatever was emitted).
    Pass,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum IdMode {
    Unknown,
    Incrementing,
    Fixed,
}

/// Which frames a receiver takes as GSO, so which may be coalesced for it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Kinds {
    /// TCP over IPv4 (TSO4), over IPv6 (TSO6).
    pub tcp4: bool,
    pub tcp6: bool,
    /// UDP over IPv4 (USO4), over IPv6 (USO6).
    pub udp4: bool,
    pub udp6: bool,
}

impl Kinds {
    pub const ALL: Kinds = Kinds {
        tcp4: true,
        tcp6: true,
        udp4: true,
        udp6: true,
    };

    /// Whether it takes any kind at all.
    pub fn any(&self) -> bool {
        self.tcp4 || self.tcp6 || self.udp4 || self.udp6
    }

    fn takes(&self, h: &Headers) -> bool {
        match (h.l4, h.l3) {
            (L4::Tcp, L3::Ipv4) => self.tcp4,
            (L4::Tcp, L3::Ipv6) => self.tcp6,
            (L4::Udp, L3::Ipv4) => self.udp4,
            (L4::Udp, L3::Ipv6) => self.udp6,
            _ => false,
        }
    }
}

/// The frame held for one flow: the head's headers and bytes, then the payloads.
struct Flow {
    h: Headers,
    vnet: VirtioNetHdr,
    buf: Vec<u8>,
    mss: usize,
    segs: usize,
    next_seq: u32,
    ids: IdMode,
}

impl Flow {
    fn l3_len(&self) -> usize {
        self.buf.len() - self.h.l3_off
    }
}

/// GRO state for one receiver queue: up to [`MAX_FLOWS`] frames being built.
pub struct Coalescer {
    flows: Vec<Flow>,
    /// Buffers of emitted flows, kept for the next ones.
    spare: Vec<Vec<u8>>,
    /// Which frames the receiver takes as GSO.
    kinds: Kinds,
}

impl Default for Coalescer {
    fn default() -> Self {
        Coalescer {
            flows: Vec::new(),
            spare: Vec::new(),
            kinds: Kinds::ALL,
        }
    }
}

/// Whether the headers of `a` and `b` (same shape `h`) agree everywhere a coalesced
/// frame keeps one value for all its segments.
fn same_headers(a: &[u8], b: &[u8], h: &Headers) -> bool {
    let (o, l4, hl) = (h.l3_off, h.l4_off, h.hdr_len());
    let ip_same = match h.l3 {
        // Skipped: total length, ID, header checksum.
        L3::Ipv4 => a[o..o + 2] == b[o..o + 2] && a[o + 6..o + 10] == b[o + 6..o + 10],
        // Skipped: payload length.
        L3::Ipv6 => a[o..o + 4] == b[o..o + 4] && a[o + 6..o + 8] == b[o + 6..o + 8],
    };
    let addrs = match h.l3 {
        L3::Ipv4 => o + 12..o + 20,
        L3::Ipv6 => o + 8..o + 40,
    };
    let same = ip_same && a[..o] == b[..o] && a[addrs.clone()] == b[addrs];
    if h.l4 == L4::Udp {
        // Ports; UDP length and checksum skipped.
        return same && a[l4..l4 + 4] == b[l4..l4 + 4];
    }
    same
        // Ports; then ACK number, data offset; flags but PSH and FIN; window; then
        // urgent pointer and options. Sequence number and checksum skipped.
        && a[l4..l4 + 4] == b[l4..l4 + 4]
        && a[l4 + 8..l4 + 13] == b[l4 + 8..l4 + 13]
        && (a[l4 + 13] ^ b[l4 + 13]) & !(TCP_PSH | TCP_FIN) == 0
        && a[l4 + 14..l4 + 16] == b[l4 + 14..l4 + 16]
        && a[l4 + 18..hl] == b[l4 + 18..hl]
}

/// Whether `a` and `b` belong to one flow (protocol, addresses and ports).
fn same_flow(a: &Headers, ab: &[u8], b: &Headers, bb: &[u8]) -> bool {
    if a.l3 != b.l3 || a.l4 != b.l4 || a.vlan_tags != b.vlan_tags || a.l3_off != b.l3_off {
        return false;
    }
    let o = a.l3_off;
    let addrs = match a.l3 {
        L3::Ipv4 => o + 12..o + 20,
        L3::Ipv6 => o + 8..o + 40,
    };
    ab[..o] == bb[..o]
        && ab[addrs.clone()] == bb[addrs]
        && ab[a.l4_off..a.l4_off + 4] == bb[b.l4_off..b.l4_off + 4]
}

/// Whether the L4 sum over the bytes of `parts` from `l4_off` on, with the
/// pseudo-header, comes out right.
fn l4_verified(parts: &[&[u8]], hdr: &[u8], h: &Headers) -> bool {
    let mut c = pseudo(hdr, h, h.l4_proto(), h.frame_len - h.l4_off);
    let mut skip = h.l4_off;
    for p in parts {
        if skip >= p.len() {
            skip -= p.len();
            continue;
        }
        c.add_bytes(&p[skip..]);
        skip = 0;
    }
    c.fold() == 0xffff
}

/// What one segment offers, decided from its headers alone.
struct Seg {
    h: Headers,
    payload: usize,
    seq: u32,
    flags: u8,
    /// It may be held or join a held frame (every rule on the segment alone holds).
    eligible: bool,
}

fn examine(vnet: &VirtioNetHdr, parts: &[&[u8]], hdr: &[u8], h: Headers) -> Seg {
    let (o, l4) = (h.l3_off, h.l4_off);
    let payload = h.payload_len();
    let udp = h.l4 == L4::Udp;
    let (flags, seq) = if udp {
        (0, 0)
    } else {
        (hdr[l4 + 13], be32(hdr, l4 + 4))
    };
    let l3_total = h.frame_len - o;
    let ip_ok = match h.l3 {
        L3::Ipv4 => {
            h.l3_len == 20
                && !h.ip_fragment
                && usize::from(be16(hdr, o + 2)) == l3_total
                && csum::checksum(&hdr[o..o + 20]) == 0
        }
        L3::Ipv6 => h.l3_len == 40 && usize::from(be16(hdr, o + 4)) + 40 == l3_total,
    };
    let l4_ok = if udp {
        usize::from(be16(hdr, l4 + 4)) == h.frame_len - l4
    } else {
        flags & (TCP_URG | TCP_RST | TCP_SYN | TCP_CWR) == 0
    };
    let csum_ok = || match vnet.flags & (F_NEEDS_CSUM | F_DATA_VALID) {
        F_NEEDS_CSUM => usize::from(vnet.csum_start) == l4 && vnet.csum_offset == csum_offset(&h),
        0 => !(udp && be16(hdr, l4 + 6) == 0) && l4_verified(parts, hdr, &h),
        _ => vnet.flags & F_DATA_VALID != 0 && vnet.flags & F_NEEDS_CSUM == 0,
    };
    let eligible = ip_ok && l4_ok && payload > 0 && csum_ok();
    Seg {
        h,
        payload,
        seq,
        flags,
        eligible,
    }
}

impl Coalescer {
    pub fn new() -> Self {
        Self::default()
    }

    /// Coalesces only the kinds the receiver takes as GSO; frames of the others pass.
    pub fn accept(&mut self, kinds: Kinds) {
        self.kinds = kinds;
    }

    /// Whether no frame is held.
    pub fn is_empty(&self) -> bool {
        self.flows.is_empty()
    }

    /// Offers one frame (`vnet` + `parts`; `headers`: already parsed, for a GSO frame).
    /// Frames it ends are handed to `emit` before it returns; on [`Offer::Pass`] the
    /// caller sends `parts` itself, after them.
    pub fn offer<F>(
        &mut self,
        vnet: &VirtioNetHdr,
        parts: &[&[u8]],
        headers: Option<&Headers>,
        mut emit: F,
    ) -> Offer
    where
        F: FnMut(&Merged<'_>),
    {
        let mut hdr = [0u8; MAX_HEADERS];
        let n = gather(parts, &mut hdr);
        let frame_len = super::parse::frame_len(parts);
        let h = match headers {
            Some(h) => *h,
            None => match parse_prefix(&hdr[..n], frame_len) {
                Ok(h) => h,
                Err(_) => return Offer::Pass,
            },
        };
        if !matches!(h.l4, L4::Tcp | L4::Udp) || h.hdr_len() > n {
            return Offer::Pass;
        }
        let hdr = &hdr[..h.hdr_len()];
        let at = self
            .flows
            .iter()
            .position(|f| same_flow(&f.h, &f.buf, &h, hdr));
        if vnet.gso.is_gso() {
            // A GSO frame of a held flow goes after what is held of it.
            if let Some(i) = at {
                self.finish(i, &mut emit);
            }
            return Offer::Pass;
        }
        let mut seg = examine(vnet, parts, hdr, h);
        seg.eligible &= self.kinds.takes(&h);
        if let Some(i) = at {
            if seg.eligible && self.joins(i, &seg, hdr) {
                let f = &mut self.flows[i];
                copy_from(parts, seg.h.hdr_len(), &mut f.buf);
                if f.h.l4 == L4::Tcp {
                    f.buf[f.h.l4_off + 13] |= seg.flags & (TCP_PSH | TCP_FIN);
                }
                f.segs += 1;
                f.next_seq = seg.seq.wrapping_add(seg.payload as u32);
                let full = f.segs == MAX_SEGS || f.l3_len() + f.mss > MAX_L3;
                if seg.flags & (TCP_PSH | TCP_FIN) != 0 || seg.payload < f.mss || full {
                    self.finish(i, &mut emit);
                }
                return Offer::Taken;
            }
            self.finish(i, &mut emit);
        }
        // A segment that would end its frame at once is not worth holding.
        if !seg.eligible || seg.flags & (TCP_PSH | TCP_FIN) != 0 {
            return Offer::Pass;
        }
        if self.flows.len() == MAX_FLOWS {
            self.finish(0, &mut emit);
        }
        let mut buf = self.spare.pop().unwrap_or_default();
        buf.clear();
        copy_from(parts, 0, &mut buf);
        self.flows.push(Flow {
            h,
            vnet: *vnet,
            buf,
            mss: seg.payload,
            segs: 1,
            next_seq: seg.seq.wrapping_add(seg.payload as u32),
            ids: IdMode::Unknown,
        });
        Offer::Taken
    }

    /// Whether `seg` (eligible) may join flow `i`'s frame; fixes the flow's ID mode.
    fn joins(&mut self, i: usize, seg: &Seg, hdr: &[u8]) -> bool {
        let f = &mut self.flows[i];
        let (a, b) = (&f.h, &seg.h);
        if a.l4_off != b.l4_off || a.l4_len != b.l4_len || a.l3_len != b.l3_len {
            return false;
        }
        if (a.l4 == L4::Tcp && seg.seq != f.next_seq)
            || seg.payload > f.mss
            || f.l3_len() + seg.payload > MAX_L3
            || !same_headers(&f.buf, hdr, &f.h)
        {
            return false;
        }
        if f.h.l3 == L3::Ipv4 {
            let o = f.h.l3_off;
            let head = be16(&f.buf, o + 4);
            let id = be16(hdr, o + 4);
            let df = f.buf[o + 6] & 0x40 != 0;
            let inc = id == head.wrapping_add(f.segs as u16);
            let fixed = id == head && df;
            let mode = match (f.ids, inc, fixed) {
                (IdMode::Unknown | IdMode::Incrementing, true, _) => IdMode::Incrementing,
                (IdMode::Unknown | IdMode::Fixed, _, true) => IdMode::Fixed,
                _ => return false,
            };
            f.ids = mode;
        }
        true
    }

    /// Emits flow `i`'s frame and forgets the flow.
    fn finish<F: FnMut(&Merged<'_>)>(&mut self, i: usize, emit: &mut F) {
        let mut f = self.flows.remove(i);
        if f.segs == 1 {
            emit(&Merged {
                vnet: f.vnet,
                bytes: &f.buf,
                segments: 1,
            });
        } else {
            let vnet = seal(&mut f);
            emit(&Merged {
                vnet,
                bytes: &f.buf,
                segments: f.segs,
            });
        }
        self.spare.push(f.buf);
    }

    /// Emits every held frame, oldest first (the end of a batch).
    pub fn flush<F: FnMut(&Merged<'_>)>(&mut self, mut emit: F) {
        while !self.flows.is_empty() {
            self.finish(0, &mut emit);
        }
    }
}

/// Where the L4 checksum of a TCP or UDP frame sits, from its L4 header.
fn csum_offset(h: &Headers) -> u16 {
    if h.l4 == L4::Udp {
        UDP_CSUM_OFFSET
    } else {
        TCP_CSUM_OFFSET
    }
}

/// Appends the bytes of `parts` from `from` on to `out`.
fn copy_from(parts: &[&[u8]], from: usize, out: &mut Vec<u8>) {
    let mut skip = from;
    for p in parts {
        if skip >= p.len() {
            skip -= p.len();
            continue;
        }
        out.extend_from_slice(&p[skip..]);
        skip = 0;
    }
}

/// Writes a coalesced frame's lengths and checksums (IPv4 header complete, TCP or UDP
/// partial over the pseudo-header) and returns its GSO header.
fn seal(f: &mut Flow) -> VirtioNetHdr {
    let h = f.h;
    let (o, l4) = (h.l3_off, h.l4_off);
    let l3_total = f.l3_len();
    let buf = &mut f.buf[..];
    match h.l3 {
        L3::Ipv4 => {
            put16(buf, o + 2, l3_total as u16);
            put16(buf, o + 10, 0);
            let c = csum::checksum(&buf[o..o + h.l3_len]);
            put16(buf, o + 10, c);
        }
        L3::Ipv6 => put16(buf, o + 4, (l3_total - 40) as u16),
    }
    let l4_len = buf.len() - l4;
    let kind = match (h.l4, h.l3) {
        (L4::Udp, _) => {
            put16(buf, l4 + 4, l4_len as u16);
            GsoKind::UdpL4
        }
        (_, L3::Ipv4) => GsoKind::TcpV4,
        (_, L3::Ipv6) => GsoKind::TcpV6,
    };
    let csum_offset = csum_offset(&h);
    let sum: Checksum = pseudo(buf, &h, h.l4_proto(), l4_len);
    put16(buf, l4 + usize::from(csum_offset), sum.fold());
    VirtioNetHdr {
        flags: F_NEEDS_CSUM,
        gso: GsoType::new(kind),
        hdr_len: h.hdr_len() as u16,
        gso_size: f.mss as u16,
        csum_start: l4 as u16,
        csum_offset,
        ..VirtioNetHdr::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testkit::frames::{build, FrameSpec};
    use crate::testkit::gro::{run, segment, Flow, Twist};

    fn flow() -> Flow {
        Flow {
            udp: false,
            v6: false,
            vlan: false,
            timestamps: true,
            sport: 1000,
            mss: 1448,
            full: false,
            valid: false,
            seq0: u32::MAX - 2000,
            id0: 0xfffe,
        }
    }

    #[test]
    fn in_order_segments_become_one_gso_frame() {
        let f = flow();
        let segs: Vec<_> = (0..10)
            .map(|i| segment(&f, i, i * 1448, 1448, Twist::None))
            .collect();
        let out = run(&mut Coalescer::new(), &segs, 0);
        assert_eq!(out.len(), 1);
        let (h, bytes, n) = &out[0];
        assert_eq!((h.gso.kind, h.gso_size, *n), (GsoKind::TcpV4, 1448, 10));
        assert_eq!(
            (h.csum_start, h.csum_offset, h.flags),
            (34, 16, F_NEEDS_CSUM)
        );
        assert_eq!(usize::from(h.hdr_len), 34 + 32);
        assert_eq!(bytes.len(), 34 + 32 + 10 * 1448);
        // The head's headers but for the IP length and checksums.
        let head = &segs[0].1;
        for r in [0..16, 18..24, 26..34 + 16, 34 + 18..34 + 32] {
            assert_eq!(bytes[r.clone()], head[r]);
        }
    }

    #[test]
    fn udp_datagrams_become_one_uso_frame_for_a_receiver_that_takes_it() {
        let f = Flow {
            udp: true,
            full: true,
            ..flow()
        };
        let dgrams: Vec<_> = (0..6)
            .map(|i| {
                let len = if i == 5 { 700 } else { 1448 };
                segment(&f, i, i * 1448, len, Twist::None)
            })
            .collect();
        let out = run(&mut Coalescer::new(), &dgrams, 0);
        assert_eq!(out.len(), 1);
        let (h, bytes, n) = &out[0];
        assert_eq!((h.gso.kind, h.gso_size, *n), (GsoKind::UdpL4, 1448, 6));
        assert_eq!((h.csum_start, h.csum_offset, h.hdr_len), (34, 6, 42));
        // The UDP length is the whole frame's.
        assert_eq!(usize::from(be16(bytes, 38)), bytes.len() - 34);
        // A receiver without USO4 gets them as they came.
        let mut co = Coalescer::new();
        co.accept(Kinds {
            udp4: false,
            ..Kinds::ALL
        });
        assert_eq!(run(&mut co, &dgrams, 0).len(), 6);
        // A longer datagram cannot join a frame of shorter ones: it starts its own.
        let mut grow = dgrams[..2].to_vec();
        grow.push(segment(&f, 2, 2 * 1448, 1472, Twist::None));
        let out = run(&mut Coalescer::new(), &grow, 0);
        assert_eq!(out.iter().map(|o| o.2).collect::<Vec<_>>(), [2, 1]);
    }

    #[test]
    fn udp_without_a_checksum_or_with_a_wrong_length_passes_alone() {
        let f = Flow {
            udp: true,
            full: true,
            ..flow()
        };
        let mut dgrams: Vec<_> = (0..3)
            .map(|i| segment(&f, i, i * 1448, 1448, Twist::None))
            .collect();
        for d in &mut dgrams {
            d.1[40..42].fill(0);
        }
        let out = run(&mut Coalescer::new(), &dgrams, 0);
        assert_eq!(out.iter().map(|o| o.2).collect::<Vec<_>>(), [1, 1, 1]);
        // A UDP length that disagrees with the frame (checksum left to the device).
        let p = Flow { full: false, ..f };
        let mut dgrams: Vec<_> = (0..3)
            .map(|i| segment(&p, i, i * 1448, 1448, Twist::None))
            .collect();
        dgrams[1].1[39] ^= 1;
        let out = run(&mut Coalescer::new(), &dgrams, 0);
        assert!(
            out.iter().all(|o| o.2 == 1),
            "{:?}",
            out.iter().map(|o| o.2).collect::<Vec<_>>()
        );
    }

    #[test]
    fn fixed_ids_merge_only_with_df() {
        for udp in [false, true] {
            let f = Flow { udp, ..flow() };
            let mut segs: Vec<_> = (0..3)
                .map(|i| segment(&f, i, i * 1448, 1448, Twist::None))
                .collect();
            // Every segment with the head's ID, DF set (the builder's default).
            let id = segs[0].1[18..20].to_vec();
            for s in &mut segs[1..] {
                s.1[18..20].copy_from_slice(&id);
                s.1[24..26].fill(0);
                let c = csum::checksum(&s.1[14..34]);
                s.1[24..26].copy_from_slice(&c.to_be_bytes());
            }
            let out = run(&mut Coalescer::new(), &segs, 0);
            assert_eq!(out.iter().map(|o| o.2).collect::<Vec<_>>(), [3]);
            // Without DF, a fixed ID is no sequence: nothing merges.
            for s in &mut segs {
                s.1[20] &= !0x40;
                s.1[24..26].fill(0);
                let c = csum::checksum(&s.1[14..34]);
                s.1[24..26].copy_from_slice(&c.to_be_bytes());
            }
            let out = run(&mut Coalescer::new(), &segs, 0);
            assert_eq!(out.iter().map(|o| o.2).collect::<Vec<_>>(), [1, 1, 1]);
        }
    }

    #[test]
    fn gso_and_other_frames_pass_and_keep_the_flow_in_order() {
        let f = flow();
        let a = segment(&f, 0, 0, 1448, Twist::None);
        let b = segment(&f, 1, 1448, 1448, Twist::None);
        let mut co = Coalescer::new();
        let mut got = Vec::new();
        for s in [&a, &b] {
            let parts = [&s.1[..]];
            assert_eq!(co.offer(&s.0, &parts, None, |_| panic!()), Offer::Taken);
        }
        // UDP and non-IP frames pass without ending the TCP frame.
        let (udp, _) = build(&FrameSpec::udp(false, 100));
        let arp = vec![0xffu8; 60];
        for fr in [&udp, &arp] {
            let parts = [&fr[..]];
            let r = co.offer(&VirtioNetHdr::default(), &parts, None, |_| panic!());
            assert_eq!(r, Offer::Pass);
        }
        // A GSO frame of the same flow ends it first.
        let mut gso = VirtioNetHdr {
            gso: GsoType::new(GsoKind::TcpV4),
            gso_size: 1448,
            ..a.0
        };
        gso.hdr_len = 66;
        let parts = [&a.1[..]];
        let r = co.offer(&gso, &parts, None, |m| got.push(m.segments));
        assert_eq!((r, got), (Offer::Pass, vec![2]));
        assert!(co.is_empty());
    }

    #[test]
    fn the_oldest_flow_leaves_when_too_many_are_held() {
        let mut co = Coalescer::new();
        let mut left = Vec::new();
        for p in 0..=MAX_FLOWS as u16 {
            let f = Flow {
                sport: 2000 + p,
                ..flow()
            };
            let s = segment(&f, 0, 0, 1448, Twist::None);
            let parts = [&s.1[..]];
            co.offer(&s.0, &parts, None, |m| left.push(m.bytes[35]));
        }
        // The first flow (port 2000 = 0x07d0) left, untouched.
        assert_eq!(left, [0xd0]);
    }
}

//! UDP: segmentation (USO, one UDP header per segment, after Linux `__udp_gso_segment`)
//! and fragmentation of one large datagram (UFO: IPv4 fragments, IPv6 Fragment header).

use super::csum::Checksum;
use super::cursor::{give_back, take_parts, Bufs, Cursor};
use super::ip::{
    be16, first_ip_id, ipv4_base, ipv4_strip_uncopied_options, pseudo, put16, set_l3, IPV4_MF,
};
use super::out::{begin_segment, partial_vnet, send};
use super::parse::{Headers, IPPROTO_UDP, IPV6_FRAGMENT, L3, UDP_LEN};
use super::plan::Plan;
use super::{truncated, CsumMode, Segment, SegmentError, SegmentSummary};
use crate::vnet_hdr::VirtioNetHdr;

/// Offset of the checksum in the UDP header.
pub const UDP_CSUM_OFFSET: u16 = 6;

/// A UDP checksum of 0 means "none"; a computed 0 is sent as 0xffff.
fn udp_csum(v: u16) -> u16 {
    if v == 0 {
        0xffff
    } else {
        v
    }
}

/// USO: segment i carries its own UDP header (length 8 + its payload) and checksum;
/// IPv4 ID id0 + i.
#[allow(clippy::too_many_arguments)]
pub(crate) fn segment<F>(
    b: &mut Bufs<'_>,
    h: &Headers,
    p: &Plan,
    frame: &[&[u8]],
    mode: CsumMode,
    from: usize,
    emit: &mut F,
    out: &mut SegmentSummary,
) -> Result<(), SegmentError>
where
    F: FnMut(&Segment<'_>) -> bool,
{
    let l4 = h.l4_off;
    // Segments before `from` went out earlier: their payload is passed over.
    let from = from.min(p.segments);
    let mut cur = Cursor::at_payload_from(frame, h, from * p.mss)?;
    let id0 = first_ip_id(b.tmpl, h);
    let full = mode == CsumMode::Full;
    let ip_base = ipv4_base(b.tmpl, h);
    let addrs = pseudo(b.tmpl, h, IPPROTO_UDP, 0);
    let mut ports = Checksum::new();
    ports.add_bytes(&b.tmpl[l4..l4 + 4]);

    for i in from..p.segments {
        let (mut parts, len, data) = begin_segment(b, h, p, &mut cur, i, full, &ip_base, id0)?;
        let hdr = &mut b.hdr[..];
        let udp_len = UDP_LEN + len;
        put16(hdr, l4 + 4, udp_len as u16);
        put16(hdr, l4 + 6, 0);
        let mut c = addrs;
        c.add_u32(udp_len as u32);
        let vnet = if full {
            c.combine(&ports);
            c.add_u16(udp_len as u16);
            c.combine(&data);
            put16(hdr, l4 + 6, udp_csum(c.finish()));
            VirtioNetHdr::default()
        } else {
            put16(hdr, l4 + 6, c.fold());
            partial_vnet(l4, UDP_CSUM_OFFSET)
        };

        parts[0] = &b.hdr[..];
        let go = send(emit, vnet, &parts, out);
        give_back(b.spare, parts);
        if !go {
            break;
        }
    }
    Ok(())
}

/// Identifications for IPv6 fragments: one per datagram, not guessable from the
/// previous one (RFC 7739), without a random-number dependency.
#[derive(Clone, Debug)]
pub(crate) struct FragIds {
    state: u64,
}

impl FragIds {
    pub fn new() -> Self {
        let seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0x9e37_79b9_7f4a_7c15);
        FragIds {
            state: seed ^ (&seed as *const u64 as u64),
        }
    }

    /// splitmix64 over a counter.
    pub fn next(&mut self) -> u32 {
        self.state = self.state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        (z ^ (z >> 31)) as u32
    }
}

/// UFO: the UDP checksum is computed over the whole datagram first, then the IP
/// payload is cut into fragments of `p.mss` bytes (a multiple of 8). IPv4: same ID on
/// every fragment, MF on all but the last, DF cleared, uncopied options replaced by
/// NOPs after the first. IPv6: a Fragment header after the unfragmentable part, one
/// identification for all fragments. Only the first fragment carries the UDP header.
pub(crate) fn fragment<F>(
    b: &mut Bufs<'_>,
    h: &Headers,
    p: &Plan,
    frame: &[&[u8]],
    ids: &mut FragIds,
    emit: &mut F,
    out: &mut SegmentSummary,
) -> Result<(), SegmentError>
where
    F: FnMut(&Segment<'_>) -> bool,
{
    let hl = h.hdr_len();
    let l4 = h.l4_off;
    let udp_len = h.frame_len - l4;

    // The datagram's UDP header with its length and full checksum.
    let mut udp = [0u8; UDP_LEN];
    udp.copy_from_slice(&b.tmpl[l4..hl]);
    put16(&mut udp, 4, udp_len as u16);
    put16(&mut udp, 6, 0);
    let mut c = pseudo(b.tmpl, h, IPPROTO_UDP, udp_len);
    c.add_bytes(&udp);
    let mut cur = Cursor::new(frame);
    if !cur.skip(hl) || !cur.sum(h.payload_len(), &mut c) {
        return Err(truncated(h.frame_len, h.frame_len));
    }
    put16(&mut udp, 6, udp_csum(c.finish()));

    let (unfrag, id6) = match h.l3 {
        L3::Ipv4 => (l4, 0),
        L3::Ipv6 => (h.ip6_unfrag_end, ids.next()),
    };
    let id4 = be16(b.tmpl, h.l3_off + 4);
    let fragmentable = h.frame_len - unfrag;
    let mut cur = Cursor::at_payload(frame, h)?;

    for k in 0..p.segments {
        let off = k * p.mss;
        let len = p.mss.min(fragmentable - off);
        let more = k + 1 < p.segments;
        b.hdr.clear();
        b.hdr.extend_from_slice(&b.tmpl[..unfrag]);
        match h.l3 {
            L3::Ipv4 => {
                if k > 0 {
                    ipv4_strip_uncopied_options(&mut b.hdr[h.l3_off + 20..unfrag]);
                }
                let frag = (off / 8) as u16 | if more { IPV4_MF } else { 0 };
                set_l3(b.hdr, h, unfrag - h.l3_off + len, id4, Some(frag));
            }
            L3::Ipv6 => {
                let next = b.tmpl[h.ip6_nexthdr_off];
                b.hdr[h.ip6_nexthdr_off] = IPV6_FRAGMENT;
                let field = off as u16 | u16::from(more);
                b.hdr.extend_from_slice(&[next, 0]);
                b.hdr.extend_from_slice(&field.to_be_bytes());
                b.hdr.extend_from_slice(&id6.to_be_bytes());
                set_l3(b.hdr, h, unfrag + 8 - h.l3_off + len, 0, None);
            }
        }
        // The first fragment starts with the rest of the headers.
        let data = if k == 0 {
            b.hdr.extend_from_slice(&b.tmpl[unfrag..l4]);
            b.hdr.extend_from_slice(&udp);
            len - (hl - unfrag)
        } else {
            len
        };

        let mut parts = take_parts(b.spare);
        parts.push(&[]);
        if !cur.take(data, &mut parts, None) {
            give_back(b.spare, parts);
            return Err(truncated(unfrag + off + len, h.frame_len));
        }
        parts[0] = &b.hdr[..];
        let go = send(emit, VirtioNetHdr::default(), &parts, out);
        give_back(b.spare, parts);
        if !go {
            break;
        }
    }
    Ok(())
}

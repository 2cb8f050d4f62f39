//! TCP segmentation (TSO in software), IPv4 and IPv6: one loop, the per-segment header
//! edits in one place (after Linux `tcp_gso_segment`).

use super::csum::Checksum;
use super::cursor::{give_back, Bufs, Cursor};
use super::ip::{be32, first_ip_id, ipv4_base, pseudo, put16, put32};
use super::out::{begin_segment, partial_vnet, send};
use super::parse::{Headers, IPPROTO_TCP};
use super::plan::Plan;
use super::{CsumMode, Segment, SegmentError, SegmentSummary};
use crate::vnet_hdr::VirtioNetHdr;

pub const TCP_FIN: u8 = 0x01;
pub const TCP_PSH: u8 = 0x08;
pub const TCP_CWR: u8 = 0x80;
/// Offset of the checksum in the TCP header.
pub const TCP_CSUM_OFFSET: u16 = 16;

/// Segment i: seq0 + i*mss; FIN and PSH only on the last segment, CWR only on the
/// first; IPv4 ID id0 + i; options and IPv6 extension headers copied unchanged.
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
    let hl = h.hdr_len();
    let l4 = h.l4_off;
    // Segments before `from` went out earlier: their payload is passed over.
    let from = from.min(p.segments);
    let mut cur = Cursor::at_payload_from(frame, h, from * p.mss)?;
    let seq0 = be32(b.tmpl, l4 + 4);
    let flags0 = b.tmpl[l4 + 13];
    let id0 = first_ip_id(b.tmpl, h);
    let full = mode == CsumMode::Full;
    let ip_base = ipv4_base(b.tmpl, h);
    let addrs = pseudo(b.tmpl, h, IPPROTO_TCP, 0);
    // The TCP header sum without sequence number, flags and checksum (see ipv4_base).
    let mut tcp_base = Checksum::new();
    tcp_base.add_bytes(&b.tmpl[l4..l4 + 4]);
    tcp_base.add_bytes(&b.tmpl[l4 + 8..l4 + 12]);
    tcp_base.add_u16(u16::from(b.tmpl[l4 + 12]) << 8);
    tcp_base.add_bytes(&b.tmpl[l4 + 14..l4 + 16]);
    tcp_base.add_bytes(&b.tmpl[l4 + 18..hl]);

    for i in from..p.segments {
        let start = i * p.mss;
        let (mut parts, len, data) = begin_segment(b, h, p, &mut cur, i, full, &ip_base, id0)?;
        let hdr = &mut b.hdr[..];
        put32(hdr, l4 + 4, seq0.wrapping_add(start as u32));
        let mut flags = flags0;
        if i + 1 < p.segments {
            flags &= !(TCP_FIN | TCP_PSH);
        }
        if i > 0 {
            flags &= !TCP_CWR;
        }
        hdr[l4 + 13] = flags;
        put16(hdr, l4 + 16, 0);
        // Pseudo-header: addresses and protocol summed once, the length per segment.
        let mut c = addrs;
        c.add_u32((h.l4_len + len) as u32);
        let vnet = if full {
            let seq = seq0.wrapping_add(start as u32);
            c.combine(&tcp_base);
            c.add_u32(seq);
            c.add_u16(u16::from(flags));
            c.combine(&data);
            put16(hdr, l4 + 16, c.finish());
            VirtioNetHdr::default()
        } else {
            put16(hdr, l4 + 16, c.fold());
            partial_vnet(l4, TCP_CSUM_OFFSET)
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

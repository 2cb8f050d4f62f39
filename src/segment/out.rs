//! One output segment: starting it from the template headers and a payload cursor,
//! its partial-checksum vnet header, and handing it to the caller's `emit`.

use super::cursor::{give_back, take_parts, Bufs, Cursor};
use super::parse::Headers;
use super::plan::Plan;
use super::{csum, ip, truncated, Segment, SegmentError, SegmentSummary};
use crate::vnet_hdr::{VirtioNetHdr, F_NEEDS_CSUM};

/// Starts segment `i` of a TCP or USO plan: takes its payload from `cur` (summed when
/// `full`), copies the template headers into `b.hdr` and sets the IP total length and
/// ID. Returns the payload slices (slot 0 kept for the headers), their length and sum.
#[allow(clippy::too_many_arguments)]
#[inline]
pub(crate) fn begin_segment<'f>(
    b: &mut Bufs<'_>,
    h: &Headers,
    p: &Plan,
    cur: &mut Cursor<'f>,
    i: usize,
    full: bool,
    ip_base: &csum::Checksum,
    id0: u16,
) -> Result<(Vec<&'f [u8]>, usize, csum::Checksum), SegmentError> {
    let hl = h.hdr_len();
    let start = i * p.mss;
    let len = p.mss.min(h.payload_len() - start);
    let mut parts = take_parts(b.spare);
    parts.push(&[]);
    let mut data = csum::Checksum::new();
    if !cur.take(len, &mut parts, full.then_some(&mut data)) {
        give_back(b.spare, parts);
        return Err(truncated(hl + start + len, h.frame_len));
    }
    b.hdr.clear();
    b.hdr.extend_from_slice(&b.tmpl[..hl]);
    ip::set_l3_fast(
        &mut b.hdr[..],
        h,
        ip_base,
        hl - h.l3_off + len,
        id0.wrapping_add(i as u16),
    );
    Ok((parts, len, data))
}

/// Emits one segment, counts it; false means stop.
#[inline]
pub(crate) fn send<F>(
    emit: &mut F,
    vnet: VirtioNetHdr,
    parts: &[&[u8]],
    out: &mut SegmentSummary,
) -> bool
where
    F: FnMut(&Segment<'_>) -> bool,
{
    out.segments += 1;
    out.bytes += parts.iter().map(|p| p.len()).sum::<usize>();
    let go = emit(&Segment { vnet, parts });
    if !go {
        out.complete = false;
    }
    go
}

/// The vnet header of a segment whose L4 checksum is left partial.
#[inline]
pub(crate) fn partial_vnet(csum_start: usize, csum_offset: u16) -> VirtioNetHdr {
    VirtioNetHdr {
        flags: F_NEEDS_CSUM,
        csum_start: csum_start as u16,
        csum_offset,
        ..VirtioNetHdr::default()
    }
}

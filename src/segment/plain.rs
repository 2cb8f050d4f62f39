//! Frames without GSO: a pending checksum completed in place of the original bytes
//! up to its field, or the frame passed on unchanged.

use super::csum::Checksum;
use super::cursor::{give_back, take_parts, Bufs, Cursor};
use super::out::send;
use super::{ip, parse, truncated, CsumMode, Segment, SegmentError, SegmentSummary};
use crate::vnet_hdr::VirtioNetHdr;

/// The value to store at `csum_start + csum_offset` to complete a partial checksum
/// (NEEDS_CSUM): the one's-complement sum from `csum_start` to the end of the frame,
/// the field's current content (the pseudo-header sum) included, inverted; a result
/// of 0 becomes 0xffff when the field is a UDP checksum (`csum_offset` 6).
pub fn complete_csum(
    frame: &[&[u8]],
    csum_start: u16,
    csum_offset: u16,
) -> Result<u16, SegmentError> {
    let frame_len = parse::frame_len(frame);
    let (start, offset) = (usize::from(csum_start), usize::from(csum_offset));
    if start + offset + 2 > frame_len {
        return Err(SegmentError::CsumOutOfFrame {
            start,
            offset,
            frame_len,
        });
    }
    let mut cur = Cursor::new(frame);
    let mut c = Checksum::new();
    if !cur.skip(start) || !cur.sum(frame_len - start, &mut c) {
        return Err(truncated(frame_len, frame_len));
    }
    let v = c.finish();
    Ok(if v == 0 && offset == 6 { 0xffff } else { v })
}

/// Non-GSO frames: complete a pending checksum (Full) or pass the frame unchanged.
pub(super) fn plain<F>(
    b: &mut Bufs<'_>,
    hdr: &VirtioNetHdr,
    frame: &[&[u8]],
    frame_len: usize,
    mode: CsumMode,
    emit: &mut F,
    out: &mut SegmentSummary,
) -> Result<(), SegmentError>
where
    F: FnMut(&Segment<'_>) -> bool,
{
    let mut parts = take_parts(b.spare);
    if hdr.needs_csum() {
        let start = usize::from(hdr.csum_start);
        let offset = usize::from(hdr.csum_offset);
        let end = start + offset + 2;
        if end > frame_len {
            give_back(b.spare, parts);
            return Err(SegmentError::CsumOutOfFrame {
                start,
                offset,
                frame_len,
            });
        }
        if mode == CsumMode::Full {
            // Like Linux skb_checksum_help: sum from csum_start to the end of the frame
            // with the field (holding the pseudo-header sum) included, store the result.
            let mut cur = Cursor::new(frame);
            b.hdr.clear();
            parts.push(&[]);
            let ok = cur.take(end, &mut parts, None);
            for p in parts.drain(1..) {
                b.hdr.extend_from_slice(p);
            }
            let mut c = Checksum::new();
            c.add_bytes(&b.hdr[start..end]);
            let ok = ok && cur.take(frame_len - end, &mut parts, Some(&mut c));
            if !ok {
                give_back(b.spare, parts);
                return Err(truncated(end, frame_len));
            }
            let mut v = c.finish();
            if v == 0 && offset == 6 {
                v = 0xffff; // UDP: 0 means "no checksum"
            }
            ip::put16(b.hdr, start + offset, v);
            parts[0] = &b.hdr[..];
            send(emit, VirtioNetHdr::default(), &parts, out);
            give_back(b.spare, parts);
            return Ok(());
        }
    }
    parts.push(&[]);
    parts.extend(frame.iter().copied().filter(|s| !s.is_empty()));
    let vnet = VirtioNetHdr {
        num_buffers: 1,
        ..*hdr
    };
    send(emit, vnet, &parts, out);
    give_back(b.spare, parts);
    Ok(())
}

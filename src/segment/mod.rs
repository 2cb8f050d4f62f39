//! Software GSO engine: pure functions over bytes, no I/O. One large frame (a scatter
//! list plus its virtio_net_hdr) becomes wire-sized frames: headers copied, payload by reference.
//!
//! Contract, for every caller:
//! - a frame is the bytes after the virtio_net_hdr, from the Ethernet header on, split
//!   anywhere into slices (empty slices allowed);
//! - each emitted [`Segment`] is `vnet` + `parts`; `parts[0]` holds the rewritten
//!   headers (empty when the frame passes unchanged), the other parts are sub-slices of
//!   the input; write it as `writev([vnet.to_bytes(), parts...])`;
//! - IP/UDP length fields of the input are not trusted: lengths come from the frame;
//! - [`SegmentOpts::max_frame`] caps the L3 size (IP header and everything after it,
//!   Ethernet header and VLAN tags not counted), like an MTU.
//!
//! Emitted `vnet` headers: gso_type NONE, num_buffers 1. In [`CsumMode::Full`] the
//! checksums are complete and flags are 0 (a caller delivering to a guest that acked
//! GUEST_CSUM may add DATA_VALID). In [`CsumMode::Partial`] TCP segments and USO
//! datagrams carry NEEDS_CSUM with csum_start = L4 offset, csum_offset 16 / 6, and the
//! pseudo-header sum in the checksum field; UFO fragments always carry a complete
//! checksum (it spans fragments) and flags 0.
//!
//! Non-GSO frames: with NEEDS_CSUM in Full mode one frame comes out with the checksum
//! completed (the bytes up to the checksum field copied into `parts[0]`); otherwise
//! the frame passes unchanged with its own header (`parts[0]` empty). A GSO frame
//! whose payload fits in gso_size (and the cap) comes out as one complete frame.
//!
//! The segmenter checks structure (headers, lengths, type/protocol match) and never
//! panics on bad input; policy limits on guest headers (USO's 128 segments,
//! csum_offset values, gso_size 0xffff) live in [`crate::vnet_hdr::validate`].

pub mod csum;
#[doc(hidden)]
pub mod fuzz;
mod ip;
pub mod parse;
#[cfg(test)]
mod proptests;
mod tcp;
#[cfg(test)]
mod tests;
#[cfg(test)]
pub(crate) mod testutil;
mod udp;

use thiserror::Error;

use crate::vnet_hdr::{GsoKind, VirtioNetHdr, F_NEEDS_CSUM};
use csum::Checksum;
pub use parse::{parse_bytes, parse_headers, Headers, ParseError, L3, L4};

/// Fragment payload of UFO must be a multiple of this (IP fragment offset unit).
pub const FRAG_UNIT: usize = 8;
/// Largest IPv4 total length / IPv6 payload length / UDP length.
pub const MAX_IP_LEN: usize = 0xffff;

/// How checksums are left in the emitted segments.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum CsumMode {
    /// Every checksum complete; emitted flags 0.
    #[default]
    Full,
    /// TCP/USO segments carry NEEDS_CSUM for a destination that completes them.
    Partial,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SegmentOpts {
    pub csum: CsumMode,
    /// Largest L3 size (IP header + L4 + payload, no L2) of an emitted segment.
    /// `None`: segments are limited by gso_size only. Ignored for non-GSO frames.
    pub max_frame: Option<usize>,
}

/// One output frame.
#[derive(Clone, Copy, Debug)]
pub struct Segment<'a> {
    pub vnet: VirtioNetHdr,
    /// `parts[0]`: rewritten headers (may be empty); the rest: payload from the input.
    pub parts: &'a [&'a [u8]],
}

impl Segment<'_> {
    /// Length of the frame (without the virtio_net_hdr).
    pub fn len(&self) -> usize {
        self.parts.iter().map(|p| p.len()).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The frame as one contiguous buffer (tests, slow paths).
    pub fn to_vec(&self) -> Vec<u8> {
        self.parts.concat()
    }
}

/// What one call did, for statistics (FreeBSD `net.gso.stats` style).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SegmentSummary {
    /// The gso kind that was applied (`None` for checksum-only or pass-through).
    pub kind: GsoKind,
    /// Segments emitted (those that `emit` accepted or refused included).
    pub segments: usize,
    /// Payload bytes per full segment (TCP/USO: L4 payload; UFO: fragment payload);
    /// 0 for non-GSO frames.
    pub mss: usize,
    /// Bytes emitted, L2 included, virtio_net_hdr excluded.
    pub bytes: usize,
    /// Bytes of the input frame.
    pub input_bytes: usize,
    /// False when `emit` returned false before the last segment.
    pub complete: bool,
}

/// Why a frame cannot be segmented. Never a panic: every malformed input lands here.
#[derive(Debug, Error, Clone, Copy, PartialEq, Eq)]
pub enum SegmentError {
    #[error("bad headers: {0}")]
    Parse(#[from] ParseError),
    #[error("gso_size is 0")]
    GsoSizeZero,
    #[error("no segmentation asked for (gso_type NONE)")]
    NotGso,
    #[error("gso type {gso:?} on an {found:?} frame")]
    L3Mismatch { gso: GsoKind, found: L3 },
    #[error("gso type {gso:?} on L4 protocol {proto}")]
    L4Mismatch { gso: GsoKind, proto: u8 },
    #[error("GSO requested on an IPv4 fragment")]
    Ipv4Fragment,
    #[error("checksum field at {start}+{offset} outside a {frame_len}-byte frame")]
    CsumOutOfFrame {
        start: usize,
        offset: usize,
        frame_len: usize,
    },
    #[error("max_frame {cap} leaves no room after {headers} bytes of L3/L4 headers")]
    CapTooSmall { cap: usize, headers: usize },
    #[error("fragment size {size} cannot hold {headers} bytes of fragmentable headers and data")]
    FragmentTooSmall { size: usize, headers: usize },
    #[error("segment of {0} L3 bytes exceeds the 16-bit IP length")]
    LengthOverflow(usize),
    #[error("UDP datagram of {0} bytes too long to fragment")]
    DatagramTooLong(usize),
}

/// How a GSO frame will be cut, decided from its headers alone.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Plan {
    pub method: Method,
    /// Payload per full segment (TCP/USO: L4 payload; UFO: fragmentable bytes).
    pub mss: usize,
    pub segments: usize,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Method {
    Tcp,
    /// One UDP header per segment (USO, and UFO that needs no fragmentation).
    Uso,
    UfoV4,
    UfoV6,
}

fn div_ceil_min1(n: usize, d: usize) -> usize {
    n.div_ceil(d).max(1)
}

/// Checks that a GSO frame with these headers can be cut and decides how.
pub(crate) fn plan(
    kind: GsoKind,
    gso_size: u16,
    h: &Headers,
    cap: Option<usize>,
) -> Result<Plan, SegmentError> {
    let gso = usize::from(gso_size);
    if gso == 0 {
        return Err(SegmentError::GsoSizeZero);
    }
    let want_l3 = match kind {
        GsoKind::TcpV4 => Some(L3::Ipv4),
        GsoKind::TcpV6 => Some(L3::Ipv6),
        _ => None,
    };
    if want_l3.is_some_and(|l3| l3 != h.l3) {
        return Err(SegmentError::L3Mismatch {
            gso: kind,
            found: h.l3,
        });
    }
    let want_l4 = match kind {
        GsoKind::TcpV4 | GsoKind::TcpV6 => L4::Tcp,
        _ => L4::Udp,
    };
    if h.l4 != want_l4 {
        return Err(SegmentError::L4Mismatch {
            gso: kind,
            proto: h.l4_proto(),
        });
    }
    if h.ip_fragment {
        return Err(SegmentError::Ipv4Fragment);
    }
    let l3_total = h.frame_len - h.l3_off;
    let l3_fits = |n: usize| match h.l3 {
        L3::Ipv4 => n <= MAX_IP_LEN,
        L3::Ipv6 => n - 40 <= MAX_IP_LEN,
    };
    // Largest L3 size allowed per segment.
    let cap = cap.unwrap_or(usize::MAX);

    let per_segment = |l3_hdrs: usize| -> Result<Plan, SegmentError> {
        if cap <= l3_hdrs {
            return Err(SegmentError::CapTooSmall {
                cap,
                headers: l3_hdrs,
            });
        }
        let mss = gso.min(cap - l3_hdrs);
        let payload = h.payload_len();
        let first = l3_hdrs + payload.min(mss);
        if !l3_fits(first) {
            return Err(SegmentError::LengthOverflow(first));
        }
        let method = if h.l4 == L4::Tcp {
            Method::Tcp
        } else {
            Method::Uso
        };
        Ok(Plan {
            method,
            mss,
            segments: div_ceil_min1(payload, mss),
        })
    };

    match kind {
        GsoKind::None => Err(SegmentError::NotGso),
        GsoKind::TcpV4 | GsoKind::TcpV6 | GsoKind::UdpL4 => per_segment(h.hdr_len() - h.l3_off),
        GsoKind::Udp => {
            let udp_len = h.frame_len - h.l4_off;
            if udp_len > MAX_IP_LEN {
                return Err(SegmentError::DatagramTooLong(udp_len));
            }
            // Fits as one datagram: no fragmentation, like USO with one segment.
            if udp_len <= gso && l3_total <= cap {
                if !l3_fits(l3_total) {
                    return Err(SegmentError::LengthOverflow(l3_total));
                }
                return Ok(Plan {
                    method: Method::Uso,
                    mss: gso,
                    segments: 1,
                });
            }
            let (unfrag, frag_hdr, method) = match h.l3 {
                L3::Ipv4 => (h.l4_off, 0, Method::UfoV4),
                L3::Ipv6 => (h.ip6_unfrag_end, 8, Method::UfoV6),
            };
            let l3_hdrs = unfrag - h.l3_off + frag_hdr;
            if cap <= l3_hdrs {
                return Err(SegmentError::CapTooSmall {
                    cap,
                    headers: l3_hdrs,
                });
            }
            let size = gso.min(cap - l3_hdrs) & !(FRAG_UNIT - 1);
            // The first fragment holds every header of the fragmentable part.
            let frag_headers = h.hdr_len() - unfrag;
            if size < FRAG_UNIT || size < frag_headers {
                return Err(SegmentError::FragmentTooSmall {
                    size,
                    headers: frag_headers,
                });
            }
            let fragmentable = h.frame_len - unfrag;
            let segments = div_ceil_min1(fragmentable, size);
            // The last fragment's offset must fit the 13-bit field (in 8-byte units).
            if (segments - 1) * size > 0xfff8 {
                return Err(SegmentError::DatagramTooLong(udp_len));
            }
            if !l3_fits(l3_hdrs + size.min(fragmentable)) {
                return Err(SegmentError::LengthOverflow(l3_hdrs + size));
            }
            Ok(Plan {
                method,
                mss: size,
                segments,
            })
        }
    }
}

/// Walks a scatter list forward, handing out sub-slices.
pub(crate) struct Cursor<'f> {
    frame: &'f [&'f [u8]],
    idx: usize,
    off: usize,
}

impl<'f> Cursor<'f> {
    pub fn new(frame: &'f [&'f [u8]]) -> Self {
        Cursor {
            frame,
            idx: 0,
            off: 0,
        }
    }

    /// A cursor at the payload, past the frame's `h.hdr_len()` header bytes.
    pub fn at_payload(frame: &'f [&'f [u8]], h: &Headers) -> Result<Self, SegmentError> {
        let mut cur = Cursor::new(frame);
        if cur.skip(h.hdr_len()) {
            Ok(cur)
        } else {
            Err(truncated(h.hdr_len(), h.frame_len))
        }
    }

    /// Advances `n` bytes; false if the frame ends first.
    pub fn skip(&mut self, n: usize) -> bool {
        self.walk(n, |_| {})
    }

    /// Appends the next `n` bytes as sub-slices to `out`, adding them to `sum` if given.
    #[inline]
    pub fn take<'x>(
        &mut self,
        n: usize,
        out: &mut Vec<&'x [u8]>,
        sum: Option<&mut Checksum>,
    ) -> bool
    where
        'f: 'x,
    {
        match sum {
            Some(c) => self.walk(n, |s| {
                c.add_bytes(s);
                out.push(s);
            }),
            None => self.walk(n, |s| out.push(s)),
        }
    }

    /// Sums the next `n` bytes without handing them out.
    pub fn sum(&mut self, n: usize, c: &mut Checksum) -> bool {
        self.walk(n, |s| c.add_bytes(s))
    }

    #[inline]
    fn walk(&mut self, mut n: usize, mut f: impl FnMut(&'f [u8])) -> bool {
        while n > 0 {
            let Some(s) = self.frame.get(self.idx) else {
                return false;
            };
            let avail = &s[self.off.min(s.len())..];
            if avail.is_empty() {
                self.idx += 1;
                self.off = 0;
                continue;
            }
            let k = n.min(avail.len());
            f(&avail[..k]);
            self.off += k;
            n -= k;
        }
        true
    }
}

/// Reuses the allocation of a slice list across calls whose slices live for different
/// lifetimes (the list is always empty in between).
#[inline]
fn recycle<'a, 'b>(mut v: Vec<&'a [u8]>) -> Vec<&'b [u8]> {
    v.clear();
    v.into_iter().map(|_| -> &'b [u8] { &[] }).collect()
}

/// The per-call working buffers handed to the protocol loops.
pub(crate) struct Bufs<'s> {
    /// Copy of the input's headers (at least `Headers::hdr_len` bytes).
    pub tmpl: &'s [u8],
    /// Headers of the segment being built.
    pub hdr: &'s mut Vec<u8>,
    pub spare: &'s mut Vec<&'static [u8]>,
}

/// An empty slice list on the recycled allocation.
#[inline]
pub(crate) fn take_parts<'x>(spare: &mut Vec<&'static [u8]>) -> Vec<&'x [u8]> {
    recycle(std::mem::take(spare))
}

/// Returns a slice list's allocation for the next segment.
#[inline]
pub(crate) fn give_back(spare: &mut Vec<&'static [u8]>, parts: Vec<&[u8]>) {
    *spare = recycle(parts);
}

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

/// A truncated-frame error for a cursor that ran dry (the plan makes it unreachable).
pub(crate) fn truncated(need: usize, have: usize) -> SegmentError {
    SegmentError::Parse(ParseError::Truncated { need, have })
}

/// Reusable segmentation state: header buffers and slice lists, allocated once.
pub struct Segmenter {
    tmpl: Box<[u8; parse::MAX_HEADERS]>,
    hdr: Vec<u8>,
    spare: Vec<&'static [u8]>,
    frag_ids: udp::FragIds,
}

impl Default for Segmenter {
    fn default() -> Self {
        Self::new()
    }
}

impl Segmenter {
    pub fn new() -> Self {
        Segmenter {
            tmpl: Box::new([0; parse::MAX_HEADERS]),
            hdr: Vec::with_capacity(parse::MAX_HEADERS),
            spare: Vec::with_capacity(64),
            frag_ids: udp::FragIds::new(),
        }
    }

    /// Cuts `frame` as `hdr` asks (see the module docs) and calls `emit` once per
    /// output frame, in order; `emit` returning false stops early (not an error).
    pub fn segment<F>(
        &mut self,
        hdr: &VirtioNetHdr,
        frame: &[&[u8]],
        opts: &SegmentOpts,
        mut emit: F,
    ) -> Result<SegmentSummary, SegmentError>
    where
        F: FnMut(&Segment<'_>) -> bool,
    {
        let frame_len = parse::frame_len(frame);
        let mut out = SegmentSummary {
            kind: hdr.gso.kind,
            segments: 0,
            mss: 0,
            bytes: 0,
            input_bytes: frame_len,
            complete: true,
        };
        let Segmenter {
            tmpl,
            hdr: hbuf,
            spare,
            frag_ids,
        } = self;
        if !hdr.gso.is_gso() {
            let mut b = Bufs {
                tmpl: &tmpl[..],
                hdr: hbuf,
                spare,
            };
            plain(
                &mut b, hdr, frame, frame_len, opts.csum, &mut emit, &mut out,
            )?;
            return Ok(out);
        }
        let n = parse::gather(frame, &mut tmpl[..]);
        let h = parse::parse_prefix(&tmpl[..n], frame_len)?;
        let p = plan(hdr.gso.kind, hdr.gso_size, &h, opts.max_frame)?;
        out.mss = p.mss;
        let mut b = Bufs {
            tmpl: &tmpl[..n],
            hdr: hbuf,
            spare,
        };
        match p.method {
            Method::Tcp => tcp::segment(&mut b, &h, &p, frame, opts.csum, &mut emit, &mut out)?,
            Method::Uso => udp::segment(&mut b, &h, &p, frame, opts.csum, &mut emit, &mut out)?,
            Method::UfoV4 | Method::UfoV6 => {
                udp::fragment(&mut b, &h, &p, frame, frag_ids, &mut emit, &mut out)?
            }
        }
        Ok(out)
    }
}

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
fn plain<F>(
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

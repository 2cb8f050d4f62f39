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
//! csum_offset values, gso_size 0xffff) live in `frame::validate`.
//!
//! Callers that have parsed and planned a frame already (the datapath: see `frame`)
//! use [`Segmenter::segment_planned`]; [`Segmenter::segment`] parses and plans itself.

pub mod csum;
mod cursor;
pub mod gro;
#[cfg(test)]
mod gro_proptests;
mod ip;
mod out;
pub mod parse;
mod plain;
pub mod plan;
#[cfg(test)]
mod proptests;
mod tcp;
#[cfg(test)]
mod tests;
mod udp;

use thiserror::Error;

use crate::vnet_hdr::{GsoKind, VirtioNetHdr};
use cursor::Bufs;
pub use parse::{parse_bytes, parse_headers, Headers, ParseError, L3, L4};
pub use plan::{plan, Method, Plan};

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
    /// Parses and plans a GSO frame first; see [`Segmenter::segment_planned`].
    pub fn segment<F>(
        &mut self,
        hdr: &VirtioNetHdr,
        frame: &[&[u8]],
        opts: &SegmentOpts,
        emit: F,
    ) -> Result<SegmentSummary, SegmentError>
    where
        F: FnMut(&Segment<'_>) -> bool,
    {
        if !hdr.gso.is_gso() {
            return self.segment_planned(hdr, None, frame, opts, emit);
        }
        let h = parse::parse_headers(frame)?;
        let p = plan(hdr.gso.kind, hdr.gso_size, &h, None)?;
        self.segment_planned(hdr, Some((&h, &p)), frame, opts, emit)
    }

    /// As [`Segmenter::segment`], for a frame whose headers `h` were parsed and whose
    /// plan `p` was made without a cap (`None` for a non-GSO frame). The frame is not
    /// parsed again; only with [`SegmentOpts::max_frame`] set is the plan redone.
    pub fn segment_planned<F>(
        &mut self,
        hdr: &VirtioNetHdr,
        layout: Option<(&Headers, &Plan)>,
        frame: &[&[u8]],
        opts: &SegmentOpts,
        emit: F,
    ) -> Result<SegmentSummary, SegmentError>
    where
        F: FnMut(&Segment<'_>) -> bool,
    {
        self.segment_planned_from(hdr, layout, frame, opts, 0, emit)
    }

    /// As [`Segmenter::segment_planned`], from output frame `from` on (the ones
    /// before it went out earlier): TCP and USO start there, at the cost of one
    /// segment's work; a UFO datagram's fragments before `from` are made again and
    /// not emitted (an IPv6 datagram's fragment ID is drawn anew each call, so its
    /// later fragments do not match the earlier ones).
    pub fn segment_planned_from<F>(
        &mut self,
        hdr: &VirtioNetHdr,
        layout: Option<(&Headers, &Plan)>,
        frame: &[&[u8]],
        opts: &SegmentOpts,
        from: usize,
        mut emit: F,
    ) -> Result<SegmentSummary, SegmentError>
    where
        F: FnMut(&Segment<'_>) -> bool,
    {
        let mut out = SegmentSummary {
            kind: hdr.gso.kind,
            segments: 0,
            mss: 0,
            bytes: 0,
            complete: true,
        };
        let Segmenter {
            tmpl,
            hdr: hbuf,
            spare,
            frag_ids,
        } = self;
        let (h, p) = match layout {
            Some(l) if hdr.gso.is_gso() => l,
            None if hdr.gso.is_gso() => return Err(SegmentError::NotGso),
            // A frame without GSO is one output frame.
            _ if from > 0 => return Ok(out),
            _ => {
                let mut b = Bufs {
                    tmpl: &tmpl[..0],
                    hdr: hbuf,
                    spare,
                };
                let frame_len = parse::frame_len(frame);
                plain::plain(
                    &mut b, hdr, frame, frame_len, opts.csum, &mut emit, &mut out,
                )?;
                return Ok(out);
            }
        };
        let capped;
        let p = match opts.max_frame {
            None => p,
            Some(cap) => {
                capped = plan(hdr.gso.kind, hdr.gso_size, h, Some(cap))?;
                &capped
            }
        };
        out.mss = p.mss;
        // The protocol loops copy the headers from one contiguous template. A carried
        // layout is trusted for offsets, never for a size the template cannot hold.
        if h.hdr_len() > tmpl.len() {
            return Err(SegmentError::Parse(ParseError::HeadersTooLong));
        }
        let n = parse::gather(frame, &mut tmpl[..h.hdr_len()]);
        if n < h.hdr_len() {
            return Err(truncated(h.hdr_len(), n));
        }
        let mut b = Bufs {
            tmpl: &tmpl[..n],
            hdr: hbuf,
            spare,
        };
        match p.method {
            Method::Tcp => tcp::segment(&mut b, h, p, frame, opts.csum, from, &mut emit, &mut out)?,
            Method::Uso => udp::segment(&mut b, h, p, frame, opts.csum, from, &mut emit, &mut out)?,
            Method::UfoV4 | Method::UfoV6 => {
                let mut made = 0;
                let mut emit_from = |seg: &Segment<'_>| {
                    made += 1;
                    made <= from || emit(seg)
                };
                udp::fragment(&mut b, h, p, frame, frag_ids, &mut emit_from, &mut out)?
            }
        }
        Ok(out)
    }
}

pub use plain::complete_csum;

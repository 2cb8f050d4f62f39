//! The virtio_net_hdr carried in front of every frame (virtio 1.x layout, 12 bytes,
//! little-endian): its typed form, and conversion to and from the wire bytes.

use thiserror::Error;

use crate::segment::{self, parse, Headers, ParseError, SegmentError, L3, L4};

/// Length of the header with VERSION_1 or MRG_RXBUF (the only layout gsonet speaks).
pub const HDR_LEN: usize = 12;

/// `flags` bits.
pub const F_NEEDS_CSUM: u8 = 1;
pub const F_DATA_VALID: u8 = 2;
pub const F_RSC_INFO: u8 = 4;

/// Raw gso_type values on the wire.
const GSO_NONE: u8 = 0;
const GSO_TCPV4: u8 = 1;
const GSO_UDP: u8 = 3;
const GSO_TCPV6: u8 = 4;
const GSO_UDP_L4: u8 = 5;
const GSO_ECN: u8 = 0x80;

/// What kind of segmentation a frame asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GsoKind {
    None,
    TcpV4,
    /// UFO: one large UDP datagram to be IP-fragmented.
    Udp,
    TcpV6,
    /// USO: UDP segmentation, one UDP header per segment.
    UdpL4,
}

/// gso_type: the kind plus the ECN bit (meaningful for TCP only).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GsoType {
    pub kind: GsoKind,
    pub ecn: bool,
}

impl GsoType {
    pub const NONE: GsoType = GsoType {
        kind: GsoKind::None,
        ecn: false,
    };

    pub fn new(kind: GsoKind) -> Self {
        GsoType { kind, ecn: false }
    }

    pub fn from_raw(raw: u8) -> Result<Self, HdrError> {
        let kind = match raw & !GSO_ECN {
            GSO_NONE => GsoKind::None,
            GSO_TCPV4 => GsoKind::TcpV4,
            GSO_UDP => GsoKind::Udp,
            GSO_TCPV6 => GsoKind::TcpV6,
            GSO_UDP_L4 => GsoKind::UdpL4,
            other => return Err(HdrError::UnknownGsoType(other)),
        };
        Ok(GsoType {
            kind,
            ecn: raw & GSO_ECN != 0,
        })
    }

    pub fn to_raw(self) -> u8 {
        let base = match self.kind {
            GsoKind::None => GSO_NONE,
            GsoKind::TcpV4 => GSO_TCPV4,
            GsoKind::Udp => GSO_UDP,
            GsoKind::TcpV6 => GSO_TCPV6,
            GsoKind::UdpL4 => GSO_UDP_L4,
        };
        if self.ecn {
            base | GSO_ECN
        } else {
            base
        }
    }

    pub fn is_gso(self) -> bool {
        self.kind != GsoKind::None
    }
}

/// A header copied out of guest or socket memory. Parsing checks only what the
/// header alone can tell; `validate` (below) checks it against the frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VirtioNetHdr {
    pub flags: u8,
    pub gso: GsoType,
    pub hdr_len: u16,
    pub gso_size: u16,
    pub csum_start: u16,
    pub csum_offset: u16,
    pub num_buffers: u16,
}

impl Default for VirtioNetHdr {
    fn default() -> Self {
        VirtioNetHdr {
            flags: 0,
            gso: GsoType::NONE,
            hdr_len: 0,
            gso_size: 0,
            csum_start: 0,
            csum_offset: 0,
            num_buffers: 1,
        }
    }
}

#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum HdrError {
    #[error("header is {0} bytes, need {HDR_LEN}")]
    Short(usize),
    #[error("unknown gso_type {0:#x}")]
    UnknownGsoType(u8),
}

impl VirtioNetHdr {
    pub fn from_bytes(b: &[u8]) -> Result<Self, HdrError> {
        if b.len() < HDR_LEN {
            return Err(HdrError::Short(b.len()));
        }
        let le = |i: usize| u16::from_le_bytes([b[i], b[i + 1]]);
        Ok(VirtioNetHdr {
            flags: b[0],
            gso: GsoType::from_raw(b[1])?,
            hdr_len: le(2),
            gso_size: le(4),
            csum_start: le(6),
            csum_offset: le(8),
            num_buffers: le(10),
        })
    }

    pub fn to_bytes(&self) -> [u8; HDR_LEN] {
        let mut b = [0u8; HDR_LEN];
        b[0] = self.flags;
        b[1] = self.gso.to_raw();
        b[2..4].copy_from_slice(&self.hdr_len.to_le_bytes());
        b[4..6].copy_from_slice(&self.gso_size.to_le_bytes());
        b[6..8].copy_from_slice(&self.csum_start.to_le_bytes());
        b[8..10].copy_from_slice(&self.csum_offset.to_le_bytes());
        b[10..12].copy_from_slice(&self.num_buffers.to_le_bytes());
        b
    }

    pub fn needs_csum(&self) -> bool {
        self.flags & F_NEEDS_CSUM != 0
    }
}

/// Most segments a USO frame may ask for (Linux `UDP_MAX_SEGMENTS`).
pub const UDP_MAX_SEGMENTS: usize = 128;
/// Smallest csum_start of a GSO frame over IPv4 / IPv6 (Ethernet + bare IP header).
pub const MIN_CSUM_START_V4: usize = 14 + 20;
pub const MIN_CSUM_START_V6: usize = 14 + 40;

/// A guest TX header that passed [`validate`], with what was learnt on the way.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ValidFrame {
    /// The gso type to act on: the header's, or NONE when the payload fits in one
    /// segment (not an error: such a frame is a plain frame).
    pub gso: GsoType,
    /// Bytes of the frame (after the virtio_net_hdr).
    pub frame_len: usize,
    /// The parsed headers of a GSO frame; `None` for non-GSO frames (not parsed).
    pub headers: Option<Headers>,
    /// Segments software GSO would emit without an MTU cap (1 for plain frames).
    pub segments: usize,
}

/// Why a guest's TX header was refused. Each variant is a drop reason to count.
#[derive(Debug, Error, Clone, Copy, PartialEq, Eq)]
pub enum InvalidHdr {
    #[error("virtio_net_hdr of {0} bytes, need {HDR_LEN}")]
    ShortHeader(usize),
    #[error("unknown gso_type {0:#x}")]
    UnknownGsoType(u8),
    #[error("gso_size 0 on a GSO frame")]
    GsoSizeZero,
    #[error("gso_size 0xffff")]
    GsoSizeMax,
    #[error("checksum field at {start}+{offset} outside a {frame_len}-byte frame")]
    CsumOutOfFrame {
        start: u16,
        offset: u16,
        frame_len: usize,
    },
    #[error("csum_start {start} below {min}")]
    CsumStartTooSmall { start: u16, min: usize },
    #[error("csum_start {start} is not the L4 header at {l4_off}")]
    CsumStartNotL4 { start: u16, l4_off: usize },
    #[error("headers of a GSO frame: {0}")]
    BadHeaders(ParseError),
    #[error("gso type {gso:?} on an {found:?} frame")]
    L3Mismatch { gso: GsoKind, found: L3 },
    #[error("gso type {gso:?} on L4 protocol {proto}")]
    L4Mismatch { gso: GsoKind, proto: u8 },
    #[error("TSO with csum_offset {0}, need 16")]
    TsoCsumOffset(u16),
    #[error("USO without NEEDS_CSUM")]
    UsoNoCsum,
    #[error("USO with csum_offset {0}, need 6")]
    UsoCsumOffset(u16),
    #[error("USO with the ECN bit")]
    UsoEcn,
    #[error("USO frame of {segments} segments, at most {UDP_MAX_SEGMENTS}")]
    UsoTooManySegments { segments: usize },
    #[error("cannot be segmented: {0}")]
    Unsegmentable(SegmentError),
}

impl From<HdrError> for InvalidHdr {
    fn from(e: HdrError) -> Self {
        match e {
            HdrError::Short(n) => InvalidHdr::ShortHeader(n),
            HdrError::UnknownGsoType(t) => InvalidHdr::UnknownGsoType(t),
        }
    }
}

impl InvalidHdr {
    /// A stable name for the drop counter of this reason.
    pub fn reason(&self) -> &'static str {
        match self {
            InvalidHdr::ShortHeader(_) => "short_header",
            InvalidHdr::UnknownGsoType(_) => "unknown_gso_type",
            InvalidHdr::GsoSizeZero => "gso_size_zero",
            InvalidHdr::GsoSizeMax => "gso_size_max",
            InvalidHdr::CsumOutOfFrame { .. } => "csum_out_of_frame",
            InvalidHdr::CsumStartTooSmall { .. } => "csum_start_too_small",
            InvalidHdr::CsumStartNotL4 { .. } => "csum_start_not_l4",
            InvalidHdr::BadHeaders(_) => "bad_headers",
            InvalidHdr::L3Mismatch { .. } => "gso_l3_mismatch",
            InvalidHdr::L4Mismatch { .. } => "gso_l4_mismatch",
            InvalidHdr::TsoCsumOffset(_) => "tso_csum_offset",
            InvalidHdr::UsoNoCsum => "uso_no_csum",
            InvalidHdr::UsoCsumOffset(_) => "uso_csum_offset",
            InvalidHdr::UsoEcn => "uso_ecn",
            InvalidHdr::UsoTooManySegments { .. } => "uso_too_many_segments",
            InvalidHdr::Unsegmentable(_) => "unsegmentable",
        }
    }
}

/// Parses raw header bytes (rule 1: unknown gso_type) and validates them.
pub fn validate_bytes(
    raw: &[u8],
    frame: &[&[u8]],
) -> Result<(VirtioNetHdr, ValidFrame), InvalidHdr> {
    let hdr = VirtioNetHdr::from_bytes(raw)?;
    let v = validate(&hdr, frame)?;
    Ok((hdr, v))
}

/// Checks a guest's TX header against its frame (Linux `__virtio_net_hdr_to_skb`
/// plus the DPDK fixes, REFERENCES.md rules 1-7). `hdr` must be a copy taken once
/// out of guest memory. hdr_len is never used. A frame accepted here can always be
/// segmented by [`crate::segment::Segmenter`] without an MTU cap.
pub fn validate(hdr: &VirtioNetHdr, frame: &[&[u8]]) -> Result<ValidFrame, InvalidHdr> {
    let frame_len = parse::frame_len(frame);
    let kind = hdr.gso.kind;
    // Rule 2.
    if kind != GsoKind::None {
        match hdr.gso_size {
            0 => return Err(InvalidHdr::GsoSizeZero),
            0xffff => return Err(InvalidHdr::GsoSizeMax),
            _ => {}
        }
    }
    // Rule 3, bounds (CVE-2024-11614).
    if hdr.needs_csum() {
        let end = usize::from(hdr.csum_start) + usize::from(hdr.csum_offset) + 2;
        if end > frame_len {
            return Err(InvalidHdr::CsumOutOfFrame {
                start: hdr.csum_start,
                offset: hdr.csum_offset,
                frame_len,
            });
        }
    }
    if kind == GsoKind::None {
        return Ok(ValidFrame {
            gso: GsoType::NONE,
            frame_len,
            headers: None,
            segments: 1,
        });
    }

    let h = parse::parse_headers(frame).map_err(InvalidHdr::BadHeaders)?;
    // Rule 4.
    let want_l3 = match kind {
        GsoKind::TcpV4 => Some(L3::Ipv4),
        GsoKind::TcpV6 => Some(L3::Ipv6),
        _ => None,
    };
    if want_l3.is_some_and(|l3| l3 != h.l3) {
        return Err(InvalidHdr::L3Mismatch {
            gso: kind,
            found: h.l3,
        });
    }
    let tcp = matches!(kind, GsoKind::TcpV4 | GsoKind::TcpV6);
    if h.l4 != if tcp { L4::Tcp } else { L4::Udp } {
        return Err(InvalidHdr::L4Mismatch {
            gso: kind,
            proto: h.l4_proto(),
        });
    }
    // Rule 3, csum_start minimums; and it must name the L4 header we segment by.
    if hdr.needs_csum() {
        let min = match h.l3 {
            L3::Ipv4 => MIN_CSUM_START_V4,
            L3::Ipv6 => MIN_CSUM_START_V6,
        };
        if usize::from(hdr.csum_start) < min {
            return Err(InvalidHdr::CsumStartTooSmall {
                start: hdr.csum_start,
                min,
            });
        }
        if usize::from(hdr.csum_start) != h.l4_off {
            return Err(InvalidHdr::CsumStartNotL4 {
                start: hdr.csum_start,
                l4_off: h.l4_off,
            });
        }
    }
    // Rule 5.
    let gso = usize::from(hdr.gso_size);
    let payload = h.payload_len();
    match kind {
        GsoKind::TcpV4 | GsoKind::TcpV6 => {
            if hdr.needs_csum() && hdr.csum_offset != 16 {
                return Err(InvalidHdr::TsoCsumOffset(hdr.csum_offset));
            }
        }
        GsoKind::UdpL4 => {
            if !hdr.needs_csum() {
                return Err(InvalidHdr::UsoNoCsum);
            }
            if hdr.csum_offset != 6 {
                return Err(InvalidHdr::UsoCsumOffset(hdr.csum_offset));
            }
            if hdr.gso.ecn {
                return Err(InvalidHdr::UsoEcn);
            }
            if payload > gso * UDP_MAX_SEGMENTS {
                return Err(InvalidHdr::UsoTooManySegments {
                    segments: payload.div_ceil(gso),
                });
            }
        }
        GsoKind::Udp | GsoKind::None => {}
    }
    // What segmentation itself needs (lengths, fragment sizes).
    let p = segment::plan(kind, hdr.gso_size, &h, None).map_err(InvalidHdr::Unsegmentable)?;
    // Rule 6: a payload that fits in one segment is a plain frame.
    let fits = match kind {
        GsoKind::Udp => h.frame_len - h.l4_off <= gso,
        _ => payload <= gso,
    };
    let gso_type = if fits { GsoType::NONE } else { hdr.gso };
    Ok(ValidFrame {
        gso: gso_type,
        frame_len,
        headers: Some(h),
        segments: p.segments,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip() {
        let h = VirtioNetHdr {
            flags: F_NEEDS_CSUM,
            gso: GsoType {
                kind: GsoKind::TcpV6,
                ecn: true,
            },
            hdr_len: 74,
            gso_size: 1440,
            csum_start: 54,
            csum_offset: 16,
            num_buffers: 3,
        };
        let b = h.to_bytes();
        assert_eq!(b[1], 0x84);
        assert_eq!(VirtioNetHdr::from_bytes(&b), Ok(h));
    }

    #[test]
    fn rejects_unknown_type_and_short() {
        let mut b = [0u8; HDR_LEN];
        b[1] = 2;
        assert_eq!(
            VirtioNetHdr::from_bytes(&b),
            Err(HdrError::UnknownGsoType(2))
        );
        assert_eq!(VirtioNetHdr::from_bytes(&b[..10]), Err(HdrError::Short(10)));
    }
}

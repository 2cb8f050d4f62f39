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
    #[error("UFO with csum_offset {0}, need 6")]
    UfoCsumOffset(u16),
    #[error("USO with the ECN bit")]
    UsoEcn,
    #[error("USO frame of {segments} segments, at most {UDP_MAX_SEGMENTS}")]
    UsoTooManySegments { segments: usize },
    #[error("cannot be segmented: {0}")]
    Unsegmentable(SegmentError),
    #[error("{field} says {says} bytes, the frame has {actual}")]
    LengthMismatch {
        field: &'static str,
        says: usize,
        actual: usize,
    },
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
            InvalidHdr::UfoCsumOffset(_) => "ufo_csum_offset",
            InvalidHdr::UsoEcn => "uso_ecn",
            InvalidHdr::UsoTooManySegments { .. } => "uso_too_many_segments",
            InvalidHdr::Unsegmentable(_) => "unsegmentable",
            InvalidHdr::LengthMismatch { .. } => "length_mismatch",
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
    // A GSO frame may reach a peer whole: its length fields must describe it.
    check_lengths(&h, frame)?;
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
        GsoKind::Udp => {
            // A UFO frame a peer accepts goes to it whole: its checksum field must be
            // the UDP one, or the peer completes the checksum into other bytes.
            if hdr.needs_csum() && hdr.csum_offset != 6 {
                return Err(InvalidHdr::UfoCsumOffset(hdr.csum_offset));
            }
        }
        GsoKind::None => {}
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

/// The IPv4 total length / IPv6 payload length, and the UDP length, must be the
/// frame's. A GSO frame that passes whole to a peer carries them unchanged, so a
/// frame whose fields disagree with its size would reach the peer malformed (Linux
/// senders always fill them in; a UDP datagram too long for its field is exempt).
fn check_lengths(h: &Headers, frame: &[&[u8]]) -> Result<(), InvalidHdr> {
    let mut buf = [0u8; parse::MAX_HEADERS];
    let n = parse::gather(frame, &mut buf);
    let be16 = |i: usize| -> Option<usize> {
        (i + 2 <= n).then(|| usize::from(u16::from_be_bytes([buf[i], buf[i + 1]])))
    };
    let mismatch = |field, says, actual| InvalidHdr::LengthMismatch {
        field,
        says,
        actual,
    };
    let l3_len = h.frame_len - h.l3_off;
    match h.l3 {
        L3::Ipv4 => {
            let says = be16(h.l3_off + 2).unwrap_or(0);
            if says != l3_len {
                return Err(mismatch("IPv4 total length", says, l3_len));
            }
        }
        L3::Ipv6 => {
            let says = be16(h.l3_off + 4).unwrap_or(0);
            if says != l3_len - 40 {
                return Err(mismatch("IPv6 payload length", says, l3_len - 40));
            }
        }
    }
    if h.l4 == L4::Udp {
        let udp_len = h.frame_len - h.l4_off;
        let says = be16(h.l4_off + 4).unwrap_or(0);
        if udp_len <= segment::MAX_IP_LEN && says != udp_len {
            return Err(mismatch("UDP length", says, udp_len));
        }
    }
    Ok(())
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

    mod validate {
        use super::*;
        use crate::segment::testutil::{build, gso_hdr, pattern, split, FrameSpec};
        use crate::segment::ParseError;

        fn tcp(v6: bool, n: usize) -> (Vec<u8>, usize) {
            build(&FrameSpec {
                v6,
                payload: pattern(n),
                ..FrameSpec::default()
            })
        }

        fn udp(v6: bool, n: usize) -> (Vec<u8>, usize) {
            build(&FrameSpec {
                v6,
                tcp: false,
                payload: pattern(n),
                ..FrameSpec::default()
            })
        }

        fn v(h: &VirtioNetHdr, f: &[u8]) -> Result<ValidFrame, InvalidHdr> {
            // Same answer whatever the split.
            let whole = validate(h, &[f]);
            assert_eq!(validate(h, &split(f, &[1, 13, 35, 60])), whole);
            whole
        }

        #[test]
        fn rule1_unknown_gso_type_and_short_header() {
            let mut raw = [0u8; HDR_LEN];
            for t in [2u8, 6, 0x7f, 0x82] {
                raw[1] = t;
                assert_eq!(
                    validate_bytes(&raw, &[]),
                    Err(InvalidHdr::UnknownGsoType(t & 0x7f))
                );
            }
            assert_eq!(
                validate_bytes(&raw[..10], &[]),
                Err(InvalidHdr::ShortHeader(10))
            );
            raw[1] = 0;
            let (h, ok) = validate_bytes(&raw, &[&[0u8; 60]]).unwrap();
            assert_eq!((h.gso, ok.segments), (GsoType::NONE, 1));
        }

        #[test]
        fn rule2_gso_size_zero_and_max() {
            let (f, l4) = tcp(false, 3000);
            let h = gso_hdr(GsoKind::TcpV4, 0, l4, true);
            assert_eq!(v(&h, &f), Err(InvalidHdr::GsoSizeZero));
            let h = gso_hdr(GsoKind::TcpV4, 0xffff, l4, true);
            assert_eq!(v(&h, &f), Err(InvalidHdr::GsoSizeMax));
            let h = gso_hdr(GsoKind::TcpV4, 0xfffe, l4, true);
            assert!(v(&h, &f).is_ok());
            // gso_size is irrelevant without GSO.
            let h = VirtioNetHdr {
                gso: GsoType::NONE,
                gso_size: 0,
                ..h
            };
            assert!(v(&h, &f).is_ok());
        }

        #[test]
        fn rule3_csum_bounds() {
            let (f, l4) = tcp(false, 100);
            let n = f.len();
            let mut h = gso_hdr(GsoKind::None, 0, l4, true);
            h.gso = GsoType::NONE;
            // Field ends exactly at the frame end: accepted.
            h.csum_start = (n - 18) as u16;
            assert!(v(&h, &f).is_ok());
            h.csum_start = (n - 17) as u16;
            assert_eq!(
                v(&h, &f),
                Err(InvalidHdr::CsumOutOfFrame {
                    start: h.csum_start,
                    offset: 16,
                    frame_len: n
                })
            );
            // No overflow with the largest values.
            h.csum_start = 0xffff;
            h.csum_offset = 0xffff;
            assert!(matches!(v(&h, &f), Err(InvalidHdr::CsumOutOfFrame { .. })));
            // Without NEEDS_CSUM the fields are not looked at.
            h.flags = F_DATA_VALID;
            assert!(v(&h, &f).is_ok());
        }

        #[test]
        fn rule3_csum_start_minimums() {
            let (f, l4) = tcp(false, 3000);
            let mut h = gso_hdr(GsoKind::TcpV4, 1448, l4, true);
            h.csum_start = 33;
            assert_eq!(
                v(&h, &f),
                Err(InvalidHdr::CsumStartTooSmall { start: 33, min: 34 })
            );
            h.csum_start = 34;
            assert!(v(&h, &f).is_ok());
            let (f6, l4) = tcp(true, 3000);
            let mut h = gso_hdr(GsoKind::TcpV6, 1448, l4, true);
            h.csum_start = 53;
            assert_eq!(
                v(&h, &f6),
                Err(InvalidHdr::CsumStartTooSmall { start: 53, min: 54 })
            );
            // Above the minimum but not at the L4 header (IPv4 options present).
            let (fo, l4) = build(&FrameSpec {
                ip4_opts: vec![1, 1, 1, 1],
                payload: pattern(3000),
                ..FrameSpec::default()
            });
            let mut h = gso_hdr(GsoKind::TcpV4, 1448, l4, true);
            h.csum_start = 34;
            assert_eq!(
                v(&h, &fo),
                Err(InvalidHdr::CsumStartNotL4 {
                    start: 34,
                    l4_off: 38
                })
            );
        }

        #[test]
        fn rule4_type_protocol_mismatch() {
            let (f4, l4) = tcp(false, 3000);
            let (f6, l6) = tcp(true, 3000);
            let (u4, lu) = udp(false, 3000);
            let h = gso_hdr(GsoKind::TcpV4, 1448, l6, true);
            assert_eq!(
                v(&h, &f6),
                Err(InvalidHdr::L3Mismatch {
                    gso: GsoKind::TcpV4,
                    found: L3::Ipv6
                })
            );
            let h = gso_hdr(GsoKind::TcpV6, 1448, l4, true);
            assert_eq!(
                v(&h, &f4),
                Err(InvalidHdr::L3Mismatch {
                    gso: GsoKind::TcpV6,
                    found: L3::Ipv4
                })
            );
            let h = gso_hdr(GsoKind::TcpV4, 1448, lu, true);
            assert_eq!(
                v(&h, &u4),
                Err(InvalidHdr::L4Mismatch {
                    gso: GsoKind::TcpV4,
                    proto: 17
                })
            );
            let h = gso_hdr(GsoKind::UdpL4, 1448, l4, false);
            assert_eq!(
                v(&h, &f4),
                Err(InvalidHdr::L4Mismatch {
                    gso: GsoKind::UdpL4,
                    proto: 6
                })
            );
            let h = gso_hdr(GsoKind::Udp, 1448, l4, false);
            assert_eq!(
                v(&h, &f4),
                Err(InvalidHdr::L4Mismatch {
                    gso: GsoKind::Udp,
                    proto: 6
                })
            );
            // tap.c: GSO_UDP with ethertype 0 -> refused.
            let mut e0 = u4.clone();
            e0[12..14].copy_from_slice(&[0, 0]);
            let h = gso_hdr(GsoKind::Udp, 1448, lu, false);
            assert_eq!(
                v(&h, &e0),
                Err(InvalidHdr::BadHeaders(ParseError::UnsupportedEthertype(0)))
            );
            // Truncated headers.
            let h = gso_hdr(GsoKind::TcpV4, 1448, l4, true);
            assert!(matches!(
                validate(&h, &[&f4[..40]]),
                Err(InvalidHdr::CsumOutOfFrame { .. })
            ));
            let h = VirtioNetHdr { flags: 0, ..h };
            assert!(matches!(
                validate(&h, &[&f4[..40]]),
                Err(InvalidHdr::BadHeaders(ParseError::Truncated { .. }))
            ));
        }

        #[test]
        fn gso_frame_length_fields_must_match_the_frame() {
            // Found by the hostile-guest e2e test: a TSO frame with IPv4 total length
            // 0xffff reached a GSO-capable peer whole, malformed.
            let mismatch = |field, says, actual| {
                Err(InvalidHdr::LengthMismatch {
                    field,
                    says,
                    actual,
                })
            };
            let (mut f, l4) = tcp(false, 3000);
            let h = gso_hdr(GsoKind::TcpV4, 1448, l4, true);
            assert!(v(&h, &f).is_ok());
            f[16..18].copy_from_slice(&0xffffu16.to_be_bytes());
            assert_eq!(
                v(&h, &f),
                mismatch("IPv4 total length", 0xffff, f.len() - 14)
            );
            let (mut f, l6) = tcp(true, 3000);
            let h = gso_hdr(GsoKind::TcpV6, 1448, l6, true);
            f[18..20].copy_from_slice(&7u16.to_be_bytes());
            assert_eq!(v(&h, &f), mismatch("IPv6 payload length", 7, f.len() - 54));
            let (mut f, lu) = udp(false, 3000);
            let h = gso_hdr(GsoKind::UdpL4, 1448, lu, false);
            assert!(v(&h, &f).is_ok());
            f[lu + 4..lu + 6].copy_from_slice(&8u16.to_be_bytes());
            assert_eq!(v(&h, &f), mismatch("UDP length", 8, f.len() - lu));
            // Plain frames are not parsed: their lengths are the receiver's business.
            let plain = VirtioNetHdr::default();
            assert!(v(&plain, &f).is_ok());
        }

        #[test]
        fn rule5_tso_csum_offset() {
            let (f, l4) = tcp(false, 3000);
            let mut h = gso_hdr(GsoKind::TcpV4, 1448, l4, true);
            h.csum_offset = 6;
            assert_eq!(v(&h, &f), Err(InvalidHdr::TsoCsumOffset(6)));
            // TSO without NEEDS_CSUM: headers probed, accepted (as Linux does).
            h.flags = 0;
            assert!(v(&h, &f).is_ok());
            // ECN is fine on TCP.
            let h = VirtioNetHdr {
                gso: GsoType {
                    kind: GsoKind::TcpV4,
                    ecn: true,
                },
                ..gso_hdr(GsoKind::TcpV4, 1448, l4, true)
            };
            assert_eq!(v(&h, &f).unwrap().segments, 3);
        }

        #[test]
        fn rule5_uso_requirements() {
            let (f, l4) = udp(true, 3000);
            let ok = gso_hdr(GsoKind::UdpL4, 1452, l4, false);
            assert_eq!(v(&ok, &f).unwrap().segments, 3);
            let h = VirtioNetHdr { flags: 0, ..ok };
            assert_eq!(v(&h, &f), Err(InvalidHdr::UsoNoCsum));
            let h = VirtioNetHdr {
                csum_offset: 16,
                ..ok
            };
            assert_eq!(v(&h, &f), Err(InvalidHdr::UsoCsumOffset(16)));
            let h = VirtioNetHdr {
                gso: GsoType {
                    kind: GsoKind::UdpL4,
                    ecn: true,
                },
                ..ok
            };
            assert_eq!(v(&h, &f), Err(InvalidHdr::UsoEcn));
        }

        #[test]
        fn rule5_ufo_csum_offset() {
            // Found by the hostile-guest e2e test: UFO with csum_offset 1 reached a
            // UFO-capable peer whole, which would write the checksum into the ports.
            let (f, lu) = udp(true, 2424);
            let mut h = gso_hdr(GsoKind::Udp, 1448, lu, false);
            assert!(v(&h, &f).is_ok());
            h.csum_offset = 1;
            assert_eq!(v(&h, &f), Err(InvalidHdr::UfoCsumOffset(1)));
        }

        #[test]
        fn rule5_uso_max_segments() {
            for (n, want) in [
                (1usize, Ok(1usize)),
                (2, Ok(2)),
                (128, Ok(128)),
                (129, Err(129usize)),
            ] {
                let (f, l4) = udp(false, n);
                let h = gso_hdr(GsoKind::UdpL4, 1, l4, false);
                let got = v(&h, &f).map(|ok| ok.segments);
                assert_eq!(
                    got,
                    want.map_err(|segments| InvalidHdr::UsoTooManySegments { segments }),
                    "{n}"
                );
            }
            let (f, l4) = udp(false, 5);
            assert_eq!(
                v(&gso_hdr(GsoKind::UdpL4, 2, l4, false), &f)
                    .unwrap()
                    .segments,
                3
            );
            let (f, l4) = udp(false, 65535 - 28);
            assert_eq!(
                v(&gso_hdr(GsoKind::UdpL4, 1472, l4, false), &f)
                    .unwrap()
                    .segments,
                45
            );
        }

        #[test]
        fn rule6_payload_within_gso_size_is_a_plain_frame() {
            let (f, l4) = udp(false, 1472);
            let r = v(&gso_hdr(GsoKind::UdpL4, 1472, l4, false), &f).unwrap();
            assert_eq!((r.gso, r.segments), (GsoType::NONE, 1));
            let r = v(&gso_hdr(GsoKind::UdpL4, 1473, l4, false), &f).unwrap();
            assert_eq!(r.gso, GsoType::NONE);
            let r = v(&gso_hdr(GsoKind::UdpL4, 1471, l4, false), &f).unwrap();
            assert_eq!((r.gso.kind, r.segments), (GsoKind::UdpL4, 2));
            let (f, l4) = tcp(false, 0);
            let r = v(&gso_hdr(GsoKind::TcpV4, 1448, l4, true), &f).unwrap();
            assert_eq!((r.gso, r.segments), (GsoType::NONE, 1));
        }

        #[test]
        fn rule7_hdr_len_is_ignored() {
            let (f, l4) = tcp(false, 3000);
            for hl in [0u16, 1, 54, 60000, 0xffff] {
                let h = VirtioNetHdr {
                    hdr_len: hl,
                    ..gso_hdr(GsoKind::TcpV4, 1448, l4, true)
                };
                assert_eq!(v(&h, &f).unwrap().segments, 3);
            }
        }

        #[test]
        fn data_valid_frame_accepted_and_ufo_checks() {
            let (f, _) = udp(false, 100);
            let h = VirtioNetHdr {
                flags: F_DATA_VALID,
                ..VirtioNetHdr::default()
            };
            assert!(v(&h, &f).is_ok());
            let (f, l4) = udp(false, 4000);
            let h = VirtioNetHdr {
                flags: 0,
                ..gso_hdr(GsoKind::Udp, 1480, l4, false)
            };
            assert_eq!(v(&h, &f).unwrap().segments, 3);
            let h = VirtioNetHdr { gso_size: 4, ..h };
            assert_eq!(
                v(&h, &f),
                Err(InvalidHdr::Unsegmentable(SegmentError::FragmentTooSmall {
                    size: 0,
                    headers: 8
                }))
            );
        }

        #[test]
        fn reasons_are_distinct() {
            let all = [
                InvalidHdr::ShortHeader(0),
                InvalidHdr::UnknownGsoType(2),
                InvalidHdr::GsoSizeZero,
                InvalidHdr::GsoSizeMax,
                InvalidHdr::CsumOutOfFrame {
                    start: 0,
                    offset: 0,
                    frame_len: 0,
                },
                InvalidHdr::CsumStartTooSmall { start: 0, min: 0 },
                InvalidHdr::CsumStartNotL4 {
                    start: 0,
                    l4_off: 0,
                },
                InvalidHdr::BadHeaders(ParseError::HeadersTooLong),
                InvalidHdr::L3Mismatch {
                    gso: GsoKind::TcpV4,
                    found: L3::Ipv6,
                },
                InvalidHdr::L4Mismatch {
                    gso: GsoKind::TcpV4,
                    proto: 17,
                },
                InvalidHdr::TsoCsumOffset(0),
                InvalidHdr::UsoNoCsum,
                InvalidHdr::UsoCsumOffset(0),
                InvalidHdr::UsoEcn,
                InvalidHdr::UsoTooManySegments { segments: 0 },
                InvalidHdr::Unsegmentable(SegmentError::GsoSizeZero),
            ];
            let mut names: Vec<&str> = all.iter().map(|e| e.reason()).collect();
            names.sort_unstable();
            names.dedup();
            assert_eq!(names.len(), all.len());
        }
    }
}

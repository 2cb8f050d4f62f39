//! The policy for a guest's TX header: what it negotiated, and the rules that keep a
//! header honest about its frame (docs/offloads.md, "Header validation"). A frame that
//! passes leaves here as a typed [`Frame`], parsed and planned once.

use thiserror::Error;

use super::{Frame, GsoLayout};
use crate::features::Caps;
use crate::ring::tx::GuestTail;
use crate::segment::{parse, plan, Headers, ParseError, SegmentError, L3, L4, MAX_IP_LEN};
use crate::stats::DropReason;
use crate::vnet_hdr::{GsoKind, GsoType, VirtioNetHdr};

/// Most segments a USO frame may ask for (Linux `UDP_MAX_SEGMENTS`).
pub const UDP_MAX_SEGMENTS: usize = 128;
/// Smallest csum_start of a GSO frame over IPv4 / IPv6 (Ethernet + bare IP header).
pub const MIN_CSUM_START_V4: usize = 14 + 20;
pub const MIN_CSUM_START_V6: usize = 14 + 40;

/// A guest TX header that passed [`validate`], with what was learnt on the way.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Valid {
    /// The parsed headers and plan of a GSO frame; `None` for a frame without GSO
    /// (not parsed).
    pub layout: Option<GsoLayout>,
}

impl Valid {
    /// Segments software GSO would emit without an MTU cap (1 for plain frames, and
    /// for a GSO frame whose payload fits in gso_size: rule 6).
    pub fn segments(&self) -> usize {
        self.layout.map_or(1, |l| l.plan.segments)
    }
}

/// Why a guest's TX header was refused. Each variant is a drop reason to count.
#[derive(Debug, Error, Clone, Copy, PartialEq, Eq)]
pub enum InvalidHdr {
    #[error("gso type {0:?} not negotiated")]
    GsoNotNegotiated(GsoType),
    #[error("NEEDS_CSUM without CSUM negotiated")]
    CsumNotNegotiated,
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
    #[error("csum_start {start} before the L4 header at {l4_off}")]
    CsumInHeaders { start: u16, l4_off: usize },
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

impl From<InvalidHdr> for DropReason {
    fn from(e: InvalidHdr) -> DropReason {
        match e {
            InvalidHdr::GsoNotNegotiated(_) => DropReason::GsoNotNegotiated,
            InvalidHdr::CsumNotNegotiated => DropReason::CsumNotNegotiated,
            InvalidHdr::GsoSizeZero => DropReason::GsoSizeZero,
            InvalidHdr::GsoSizeMax => DropReason::GsoSizeMax,
            InvalidHdr::CsumOutOfFrame { .. } => DropReason::CsumOutOfFrame,
            InvalidHdr::CsumStartTooSmall { .. } => DropReason::CsumStartTooSmall,
            InvalidHdr::CsumStartNotL4 { .. } => DropReason::CsumStartNotL4,
            InvalidHdr::CsumInHeaders { .. } => DropReason::CsumInHeaders,
            InvalidHdr::BadHeaders(_) => DropReason::BadHeaders,
            InvalidHdr::L3Mismatch { .. } => DropReason::GsoL3Mismatch,
            InvalidHdr::L4Mismatch { .. } => DropReason::GsoL4Mismatch,
            InvalidHdr::TsoCsumOffset(_) => DropReason::TsoCsumOffset,
            InvalidHdr::UsoNoCsum => DropReason::UsoNoCsum,
            InvalidHdr::UsoCsumOffset(_) => DropReason::UsoCsumOffset,
            InvalidHdr::UfoCsumOffset(_) => DropReason::UfoCsumOffset,
            InvalidHdr::UsoEcn => DropReason::UsoEcn,
            InvalidHdr::UsoTooManySegments { .. } => DropReason::UsoTooManySegments,
            InvalidHdr::Unsegmentable(_) => DropReason::Unsegmentable,
            InvalidHdr::LengthMismatch { .. } => DropReason::LengthMismatch,
        }
    }
}

/// A guest's TX frame, checked against what the guest negotiated (`tx`: the HOST_*
/// offloads it acked) and the header rules, and parsed once for everything after.
pub fn tx_frame<'a>(
    tx: Caps,
    hdr: VirtioNetHdr,
    parts: &'a [&'a [u8]],
) -> Result<Frame<'a>, DropReason> {
    if hdr.gso.is_gso() && !tx.accepts(hdr.gso) {
        return Err(InvalidHdr::GsoNotNegotiated(hdr.gso).into());
    }
    if hdr.needs_csum() && !tx.csum {
        return Err(InvalidHdr::CsumNotNegotiated.into());
    }
    if !hdr.gso.is_gso() && !hdr.needs_csum() {
        // Nothing in the header to check against the frame (`validate` passes it
        // unparsed): most frames, one call and a layout's copy less.
        return Frame::new(hdr, parts, None);
    }
    let valid = validate(&hdr, parts)?;
    Frame::new(hdr, parts, valid.layout)
}

/// `tx_frame` for a one-copy frame: `head` holds its first bytes, `tail` the rest,
/// still in the guest's buffers. Only headers are read, so a frame whose headers all
/// lie in `head` is judged exactly as it would be whole; one whose headers run past
/// it fails here, and is checked again whole by the caller.
pub fn tx_frame_tail<'a>(
    tx: Caps,
    hdr: VirtioNetHdr,
    head: &'a [&'a [u8]],
    tail: GuestTail<'a>,
) -> Result<Frame<'a>, DropReason> {
    if hdr.gso.is_gso() && !tx.accepts(hdr.gso) {
        return Err(InvalidHdr::GsoNotNegotiated(hdr.gso).into());
    }
    if hdr.needs_csum() && !tx.csum {
        return Err(InvalidHdr::CsumNotNegotiated.into());
    }
    if !hdr.gso.is_gso() && !hdr.needs_csum() {
        return Frame::with_tail(hdr, head, tail, None);
    }
    let valid = validate_prefix(&hdr, head, parse::frame_len(head) + tail.len)?;
    Frame::with_tail(hdr, head, tail, valid.layout)
}

/// Checks a guest's TX header against its frame (Linux `__virtio_net_hdr_to_skb`
/// plus the DPDK fixes: the rules in docs/offloads.md, "Header validation"). `hdr` must be a copy taken once
/// out of guest memory. hdr_len is never used. A frame accepted here can always be
/// segmented by [`crate::segment::Segmenter`] without an MTU cap.
pub fn validate(hdr: &VirtioNetHdr, frame: &[&[u8]]) -> Result<Valid, InvalidHdr> {
    validate_prefix(hdr, frame, parse::frame_len(frame))
}

/// `validate` for a frame of `frame_len` bytes of which `frame` holds the first.
fn validate_prefix(
    hdr: &VirtioNetHdr,
    frame: &[&[u8]],
    frame_len: usize,
) -> Result<Valid, InvalidHdr> {
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
        if hdr.needs_csum() {
            // The checksum is written where the header says: never into the MAC,
            // VLAN or IP headers the switch classified the frame by.
            let h = parse::parse_headers_of(frame, frame_len).map_err(InvalidHdr::BadHeaders)?;
            if usize::from(hdr.csum_start) < h.l4_off {
                return Err(InvalidHdr::CsumInHeaders {
                    start: hdr.csum_start,
                    l4_off: h.l4_off,
                });
            }
        }
        return Ok(Valid { layout: None });
    }

    let h = parse::parse_headers_of(frame, frame_len).map_err(InvalidHdr::BadHeaders)?;
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
    let p = plan(kind, hdr.gso_size, &h, None).map_err(InvalidHdr::Unsegmentable)?;
    // Rule 6: a payload that fits in one segment is not an error; the plan says 1.
    Ok(Valid {
        layout: Some(GsoLayout {
            headers: h,
            plan: p,
        }),
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
        if udp_len <= MAX_IP_LEN && says != udp_len {
            return Err(mismatch("UDP length", says, udp_len));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::segment::ParseError;
    use crate::testkit::frames::{build, gso_hdr, pattern, split, FrameSpec};
    use crate::vnet_hdr::F_DATA_VALID;

    fn tcp(v6: bool, n: usize) -> (Vec<u8>, usize) {
        build(&FrameSpec::tcp(v6, n))
    }

    fn udp(v6: bool, n: usize) -> (Vec<u8>, usize) {
        build(&FrameSpec::udp(v6, n))
    }

    fn v(h: &VirtioNetHdr, f: &[u8]) -> Result<Valid, InvalidHdr> {
        // Same answer whatever the split.
        let whole = validate(h, &[f]);
        assert_eq!(validate(h, &split(f, &[1, 13, 35, 60])), whole);
        whole
    }

    #[test]
    fn negotiation_comes_first() {
        let (f, l4) = tcp(false, 3000);
        let parts = [&f[..]];
        let h = gso_hdr(GsoKind::TcpV4, 1448, l4, true);
        let tso6 = Caps {
            csum: true,
            tso6: true,
            ..Caps::default()
        };
        assert_eq!(
            tx_frame(tso6, h, &parts).err(),
            Some(DropReason::GsoNotNegotiated)
        );
        let plain = VirtioNetHdr {
            gso: GsoType::NONE,
            ..h
        };
        assert_eq!(
            tx_frame(Caps::default(), plain, &parts).err(),
            Some(DropReason::CsumNotNegotiated)
        );
        let frame = tx_frame(Caps::ALL, h, &parts).unwrap();
        assert_eq!(frame.gso.map(|g| g.plan.segments), Some(3));
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
        assert_eq!(v(&h, &f).unwrap().segments(), 3);
    }

    #[test]
    fn rule5_uso_requirements() {
        let (f, l4) = udp(true, 3000);
        let ok = gso_hdr(GsoKind::UdpL4, 1452, l4, false);
        assert_eq!(v(&ok, &f).unwrap().segments(), 3);
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
            let got = v(&h, &f).map(|ok| ok.segments());
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
                .segments(),
            3
        );
        let (f, l4) = udp(false, 65535 - 28);
        assert_eq!(
            v(&gso_hdr(GsoKind::UdpL4, 1472, l4, false), &f)
                .unwrap()
                .segments(),
            45
        );
    }

    #[test]
    fn rule6_payload_within_gso_size_is_a_plain_frame() {
        let (f, l4) = udp(false, 1472);
        let r = v(&gso_hdr(GsoKind::UdpL4, 1472, l4, false), &f).unwrap();
        assert_eq!(r.segments(), 1);
        let r = v(&gso_hdr(GsoKind::UdpL4, 1473, l4, false), &f).unwrap();
        assert_eq!(r.segments(), 1);
        let r = v(&gso_hdr(GsoKind::UdpL4, 1471, l4, false), &f).unwrap();
        assert_eq!(r.segments(), 2);
        let (f, l4) = tcp(false, 0);
        let r = v(&gso_hdr(GsoKind::TcpV4, 1448, l4, true), &f).unwrap();
        assert_eq!(r.segments(), 1);
    }

    #[test]
    fn rule7_hdr_len_is_ignored() {
        let (f, l4) = tcp(false, 3000);
        for hl in [0u16, 1, 54, 60000, 0xffff] {
            let h = VirtioNetHdr {
                hdr_len: hl,
                ..gso_hdr(GsoKind::TcpV4, 1448, l4, true)
            };
            assert_eq!(v(&h, &f).unwrap().segments(), 3);
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
        assert_eq!(v(&h, &f).unwrap().segments(), 3);
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
    fn drop_reasons_are_distinct() {
        // One sample per variant, each beside the pattern of its variant. The patterns
        // form a match without a wildcard, so a variant added to InvalidHdr does not
        // compile until it has an entry (and with it a sample) here; a repeated
        // pattern is an unreachable-pattern warning, an error under clippy -D warnings.
        macro_rules! every_variant {
            ($($sample:expr => $pat:pat),+ $(,)?) => {{
                #[allow(dead_code)]
                fn exhaustive(e: InvalidHdr) {
                    match e {
                        $($pat => {})+
                    }
                }
                let all = [$($sample),+];
                let pats: [fn(&InvalidHdr) -> bool; 0 $(+ { let _ = stringify!($pat); 1 })+] =
                    [$(|e| matches!(e, $pat)),+];
                for (s, p) in all.iter().zip(pats) {
                    assert!(p(s), "{s:?} is not the variant beside it");
                }
                all
            }};
        }
        let all = every_variant![
            InvalidHdr::GsoNotNegotiated(GsoType::NONE) => InvalidHdr::GsoNotNegotiated(_),
            InvalidHdr::CsumNotNegotiated => InvalidHdr::CsumNotNegotiated,
            InvalidHdr::GsoSizeZero => InvalidHdr::GsoSizeZero,
            InvalidHdr::GsoSizeMax => InvalidHdr::GsoSizeMax,
            InvalidHdr::CsumOutOfFrame {
                start: 0,
                offset: 0,
                frame_len: 0,
            } => InvalidHdr::CsumOutOfFrame { .. },
            InvalidHdr::CsumStartTooSmall { start: 0, min: 0 }
                => InvalidHdr::CsumStartTooSmall { .. },
            InvalidHdr::CsumInHeaders { start: 0, l4_off: 0 } => InvalidHdr::CsumInHeaders { .. },
            InvalidHdr::CsumStartNotL4 {
                start: 0,
                l4_off: 0,
            } => InvalidHdr::CsumStartNotL4 { .. },
            InvalidHdr::BadHeaders(ParseError::HeadersTooLong) => InvalidHdr::BadHeaders(_),
            InvalidHdr::L3Mismatch {
                gso: GsoKind::TcpV4,
                found: L3::Ipv6,
            } => InvalidHdr::L3Mismatch { .. },
            InvalidHdr::L4Mismatch {
                gso: GsoKind::TcpV4,
                proto: 17,
            } => InvalidHdr::L4Mismatch { .. },
            InvalidHdr::TsoCsumOffset(0) => InvalidHdr::TsoCsumOffset(_),
            InvalidHdr::UsoNoCsum => InvalidHdr::UsoNoCsum,
            InvalidHdr::UsoCsumOffset(0) => InvalidHdr::UsoCsumOffset(_),
            InvalidHdr::UfoCsumOffset(0) => InvalidHdr::UfoCsumOffset(_),
            InvalidHdr::UsoEcn => InvalidHdr::UsoEcn,
            InvalidHdr::UsoTooManySegments { segments: 0 } => InvalidHdr::UsoTooManySegments { .. },
            InvalidHdr::Unsegmentable(SegmentError::GsoSizeZero) => InvalidHdr::Unsegmentable(_),
            InvalidHdr::LengthMismatch {
                field: "ip",
                says: 0,
                actual: 0,
            } => InvalidHdr::LengthMismatch { .. },
        ];
        let mut names: Vec<DropReason> = all.iter().map(|&e| e.into()).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), all.len());
    }

    /// A one-copy frame is judged by its head exactly as it is judged whole; one
    /// whose headers run past the head is refused so that it is judged whole.
    #[test]
    fn a_head_with_every_header_is_judged_as_the_whole_frame() {
        use crate::ring::guest_mem::GuestMem;
        use crate::ring::tx::ONE_COPY_HEAD;
        use vm_memory::{Bytes, GuestAddress};
        let mem = GuestMem::from_ranges(&[(GuestAddress(0), 0x20000)]).unwrap();
        let judge = |spec: &FrameSpec| {
            let (f, l4_off) = build(spec);
            let kind = if spec.v6 {
                GsoKind::TcpV6
            } else {
                GsoKind::TcpV4
            };
            let hdr = gso_hdr(kind, 1000, l4_off, true);
            mem.write_slice(&f[ONE_COPY_HEAD..], GuestAddress(0x1000))
                .unwrap();
            let pieces = [(0x1000u64, (f.len() - ONE_COPY_HEAD) as u32)];
            let tail = GuestTail {
                mem: &mem,
                pieces: &pieces,
                len: f.len() - ONE_COPY_HEAD,
            };
            let head = [&f[..ONE_COPY_HEAD]];
            let whole = [&f[..]];
            let by_head = tx_frame_tail(Caps::ALL, hdr, &head, tail).map(|f| (f.len, f.gso));
            let by_whole = tx_frame(Caps::ALL, hdr, &whole).map(|f| (f.len, f.gso));
            (by_head, by_whole)
        };
        let plain = FrameSpec {
            tcp: true,
            v6: true,
            payload: pattern(5000),
            ..Default::default()
        };
        let (head, whole) = judge(&plain);
        assert!(whole.is_ok());
        assert_eq!(head, whole);
        // Three 56-byte extension headers: TCP starts past the head.
        let deep = FrameSpec {
            ip6_exts: vec![(0, 6), (43, 6), (60, 6)],
            ..plain
        };
        let (head, whole) = judge(&deep);
        assert!(whole.is_ok(), "{whole:?}");
        assert!(
            head.is_err(),
            "headers past the head were judged by the head"
        );
        // A bad frame is refused either way.
        let short_ip = FrameSpec {
            payload: pattern(10),
            ..Default::default()
        };
        let (head, whole) = judge(&FrameSpec {
            tcp: true,
            payload: pattern(3000),
            ..short_ip
        });
        assert_eq!(head, whole);
    }
}

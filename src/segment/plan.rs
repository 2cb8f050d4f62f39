//! How a GSO frame will be cut, decided from its parsed headers alone: the method,
//! the payload per segment and the number of segments, or why it cannot be cut.

use super::parse::{Headers, L3, L4};
use super::{SegmentError, FRAG_UNIT, MAX_IP_LEN};
use crate::vnet_hdr::GsoKind;

/// How a GSO frame will be cut, decided from its headers alone.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Plan {
    pub method: Method,
    /// Payload per full segment (TCP/USO: L4 payload; UFO: fragmentable bytes).
    pub mss: usize,
    pub segments: usize,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Method {
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
pub fn plan(
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

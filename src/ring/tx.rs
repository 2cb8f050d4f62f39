//! TX: one descriptor chain -> one frame, copied out of guest memory once into the
//! worker's buffer (`ring::host`). From then on nothing the guest writes into its
//! buffers can change what gsonet checks and switches by. A one-copy frame keeps
//! only its head there (every header); the rest is copied once, later, straight
//! into its receiver, and the guest's writes meanwhile change only payload it sends.

use thiserror::Error;
use virtio_bindings::virtio_ring::VRING_DESC_F_WRITE;

use super::guest_mem::{BadRange, GuestMem};
use super::host::HostMem;
use super::split::{Desc, WalkEnd};
use super::vq::{Head, Vq};
use crate::stats::DropReason;
use crate::vnet_hdr::{HdrError, VirtioNetHdr, HDR_LEN};

/// Largest frame accepted: a full 64 KiB IP packet behind Ethernet and two VLAN tags.
pub const MAX_FRAME: usize = 65535 + 14 + 8;
/// Smallest: an Ethernet header.
pub const MIN_FRAME: usize = 14;

/// Frame bytes a one-copy frame keeps in gsonet's memory: every header the switch
/// reads (Ethernet, two tags, IPv6 or IPv4 with options, TCP with options) fits, and
/// a frame whose headers do not is made whole before it is checked again.
pub const ONE_COPY_HEAD: usize = 192;

/// A guest frame: its header and where its bytes are: the first `len` in the buffer
/// the chain was copied into, then, for a one-copy frame, `tail_len` more still in
/// the guest's buffers (`tail` indexes the batch's `pieces`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TxFrame {
    pub hdr: VirtioNetHdr,
    /// The frame's private bytes (after the virtio_net_hdr) are `buf[start..start + len]`.
    pub start: usize,
    pub len: usize,
    /// Pieces of guest memory (address, bytes) that follow, in order.
    pub tail: std::ops::Range<usize>,
    pub tail_len: usize,
}

impl TxFrame {
    /// Bytes in the whole frame.
    pub fn frame_len(&self) -> usize {
        self.len + self.tail_len
    }
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

impl From<&TxError> for DropReason {
    fn from(e: &TxError) -> DropReason {
        match e {
            TxError::BadAddress(_) => DropReason::BadAddress,
            TxError::WritableDescriptor => DropReason::WritableDescriptor,
            TxError::TooShort(_) => DropReason::TooShort,
            TxError::TooLong => DropReason::TooLong,
            TxError::Header(_) => DropReason::BadHeader,
            TxError::TooManyDescriptors => DropReason::TooManyDescriptors,
            TxError::Broken => DropReason::BrokenChain,
        }
    }
}

/// The buffer a TX worker copies one chain into: room for the largest frame and header.
pub fn tx_buffer() -> Vec<u8> {
    vec![0u8; MAX_FRAME + HDR_LEN]
}

/// Checks a walked chain (`descs`, and how its walk ended) before anything is copied:
/// no device-writable descriptor, no walk that broke off or went past `max_descs`
/// (the queue size), at most `MAX_FRAME` bytes after the header. Returns its bytes.
pub fn chain_bytes(descs: &[Desc], end: WalkEnd, max_descs: usize) -> Result<usize, TxError> {
    if descs.len() > max_descs {
        return Err(TxError::TooManyDescriptors);
    }
    let mut total = 0usize;
    for d in descs {
        if d.is_write_only() {
            return Err(TxError::WritableDescriptor);
        }
        total += d.len as usize;
        if total > MAX_FRAME + HDR_LEN {
            return Err(TxError::TooLong);
        }
    }
    match end {
        WalkEnd::Complete => Ok(total),
        // An unreadable descriptor table (or indirect table) ends the chain where it
        // still points on, as a bad next index does.
        WalkEnd::Broken | WalkEnd::Unreadable => Err(TxError::Broken),
        WalkEnd::TooMany => Err(TxError::TooManyDescriptors),
    }
}

/// Copies a checked chain of `total` bytes (from [`chain_bytes`]) whose virtio_net_hdr
/// is `hdr_len` bytes (12, or 10 for a legacy guest without MRG_RXBUF) into
/// `buf[..total]`, and reads its header from that private copy.
pub fn copy_chain(
    hm: &HostMem<'_>,
    descs: &[Desc],
    total: usize,
    hdr_len: usize,
    buf: &mut [u8],
) -> Result<TxFrame, TxError> {
    copy_head(hm, descs, total, hdr_len, total, buf, &mut Vec::new())
}

/// [`copy_chain`] for the first `keep` bytes only: the rest of the chain is checked
/// (mapped guest memory) and left where it is, its pieces appended to `pieces`.
pub fn copy_head(
    hm: &HostMem<'_>,
    descs: &[Desc],
    total: usize,
    hdr_len: usize,
    keep: usize,
    buf: &mut [u8],
    pieces: &mut Vec<(u64, u32)>,
) -> Result<TxFrame, TxError> {
    if total < hdr_len {
        return Err(TxError::Header(HdrError::Short(total)));
    }
    let len = total - hdr_len;
    if len < MIN_FRAME {
        return Err(TxError::TooShort(len));
    }
    let keep = keep.clamp(hdr_len, total);
    if keep > buf.len() {
        return Err(TxError::TooLong);
    }
    let first = pieces.len();
    let mut at = 0usize;
    for d in descs {
        let n = d.len as usize;
        let here = n.min(keep.saturating_sub(at));
        let pos = at.min(keep);
        let r = if here == n {
            hm.read(d.addr, &mut buf[pos..pos + n])
        } else {
            // The whole descriptor is checked as a copy of it would be.
            hm.check(d.addr, n).and_then(|()| {
                hm.read(d.addr, &mut buf[pos..pos + here])?;
                pieces.push((d.addr + here as u64, (n - here) as u32));
                Ok(())
            })
        };
        if let Err(e) = r {
            pieces.truncate(first);
            return Err(e.into());
        }
        at += n;
    }
    let hdr = if hdr_len == HDR_LEN {
        VirtioNetHdr::from_bytes(&buf[..HDR_LEN])
    } else {
        // A 10-byte legacy header has no num_buffers; the zero tail stands in for it.
        let mut raw = [0u8; HDR_LEN];
        raw[..hdr_len].copy_from_slice(&buf[..hdr_len]);
        VirtioNetHdr::from_bytes(&raw)
    };
    let hdr = hdr.inspect_err(|_| pieces.truncate(first))?;
    Ok(TxFrame {
        hdr,
        start: hdr_len,
        len: keep - hdr_len,
        tail: first..pieces.len(),
        tail_len: total - keep,
    })
}

/// The bytes of a one-copy frame that are still in the sending guest's buffers:
/// checked as mapped when its chain was taken, read only by copies into another
/// guest's buffers or into gsonet's memory, never through a `&[u8]`.
#[derive(Clone, Copy)]
pub struct GuestTail<'a> {
    pub mem: &'a GuestMem,
    pub pieces: &'a [(u64, u32)],
    /// Bytes in `pieces`.
    pub len: usize,
}

impl GuestTail<'_> {
    /// Appends the tail to `out` (unchanged if a piece is not mapped).
    pub fn append_to(&self, out: &mut Vec<u8>) -> Result<(), BadRange> {
        let at = out.len();
        let mem = HostMem::new(self.mem);
        for &(addr, n) in self.pieces {
            if let Err(e) = mem.read_append(addr, n as usize, out) {
                out.truncate(at);
                return Err(e);
            }
        }
        Ok(())
    }
}

/// One chain of a batch between its walk and its copy.
struct Walked {
    head: Head,
    descs: std::ops::Range<usize>,
    bytes: Result<usize, TxError>,
}

/// A batch of TX chains taken off a ring (`Vq`, split or packed): each chain walked,
/// checked and copied into the batch's own arena (a one-copy frame: its head only),
/// then handed back with [`TxBatch::give_back`] once its frames are sent. What the
/// batch keeps is bounded whatever the guest's chains look like: `max_chains` heads,
/// the arena's bytes, and `4 * max_chains` descriptors walked (plus the last chain's,
/// at most a queue's worth), which also bounds `pieces`.
pub struct TxBatch {
    /// The frames' private bytes; `frames` says where each one is.
    pub arena: Vec<u8>,
    /// Each chain taken, in ring order: its frame, or why it was dropped.
    pub frames: Vec<Result<TxFrame, TxError>>,
    /// The guest memory one-copy frames still have their bytes in.
    pub pieces: Vec<(u64, u32)>,
    /// Chains of at least this many bytes are one-copy frames (`None`: none is).
    one_copy_from: Option<usize>,
    max_chains: usize,
    heads: Vec<Head>,
    /// The batch's descriptors as walked, chain after chain.
    walk: Vec<Desc>,
    walked: Vec<Walked>,
}

impl TxBatch {
    /// A batch of at most `max_chains` chains and `arena_bytes` bytes (at least one
    /// largest frame, so every chain can be taken).
    pub fn new(max_chains: usize, arena_bytes: usize) -> TxBatch {
        assert!(arena_bytes >= MAX_FRAME + HDR_LEN && max_chains > 0);
        TxBatch {
            arena: vec![0u8; arena_bytes],
            frames: Vec::with_capacity(max_chains),
            pieces: Vec::new(),
            one_copy_from: None,
            max_chains,
            heads: Vec::with_capacity(max_chains),
            walk: Vec::new(),
            walked: Vec::with_capacity(max_chains),
        }
    }

    /// Chains of `from` bytes or more (after the virtio_net_hdr) keep only their
    /// first [`ONE_COPY_HEAD`] bytes in the arena; the rest is read where the guest
    /// put it, once, by whoever sends the frame on. `None`: every chain is copied
    /// whole.
    pub fn set_one_copy(&mut self, from: Option<usize>) {
        self.one_copy_from = from.map(|f| f.max(ONE_COPY_HEAD + 1));
    }

    /// Takes up to `max` (and `max_chains`) of the chains the ring has available,
    /// replacing `frames`; a chain that would not fit the arena, or one past the walk
    /// budget, stays on the ring for the next batch. Returns how many chains were
    /// taken: each needs [`TxBatch::give_back`] before the ring is published or let
    /// go. Three passes, so the lines the frontend's CPU wrote (descriptors, then
    /// buffers) are asked for the whole batch at once rather than one stall after
    /// another: the heads (a split ring's descriptors prefetched; a packed ring's
    /// are walked as they are taken), the walks (their buffers prefetched), the
    /// copies.
    pub fn take(&mut self, ring: &mut Vq, hm: &HostMem<'_>, hdr_len: usize, max: usize) -> usize {
        let TxBatch {
            arena,
            frames,
            pieces,
            one_copy_from,
            max_chains,
            heads,
            walk,
            walked,
        } = self;
        frames.clear();
        pieces.clear();
        heads.clear();
        walk.clear();
        walked.clear();
        ring.clear();
        let qsize = usize::from(ring.size());
        for _ in 0..max.min(*max_chains) {
            let Some(head) = ring.take(hm, qsize) else {
                break;
            };
            heads.push(head);
        }
        // Bytes a chain of `total` keeps in the arena.
        let keep = |total: usize| match *one_copy_from {
            Some(from) if total >= hdr_len + from => hdr_len + ONE_COPY_HEAD,
            _ => total,
        };
        let walk_budget = 4 * *max_chains;
        let mut planned = 0usize;
        for head in heads.iter() {
            if walk.len() >= walk_budget {
                ring.rewind(head);
                break;
            }
            let start = walk.len();
            let packed = ring.is_packed();
            let (end, indirect) = ring.walk(hm, head, qsize, walk, packed);
            if indirect && packed {
                // DPDK's virtio_user presets every entry of its packed TX indirect
                // tables device-writable and leaves the header's so; DPDK's vhost
                // library reads them all. A TX buffer is only read: so does gsonet.
                for d in &mut walk[start..] {
                    d.flags &= !(VRING_DESC_F_WRITE as u16);
                }
            }
            let bytes = chain_bytes(&walk[start..], end, qsize);
            if let Ok(total) = bytes {
                // A one-copy frame counts whole too: a batch holds as many bytes of
                // the guest's frames either way, and its chains go back as soon.
                if planned + total > arena.len() {
                    walk.truncate(start);
                    ring.rewind(head);
                    break;
                }
                planned += total;
                for d in &walk[start..] {
                    hm.prefetch(d.addr, d.len as usize);
                }
            }
            walked.push(Walked {
                head: *head,
                descs: start..walk.len(),
                bytes,
            });
        }
        let mut used = 0usize;
        for c in walked.iter() {
            let frame = c.bytes.clone().and_then(|total| {
                let at = used;
                let k = keep(total);
                used += k;
                let descs = &walk[c.descs.clone()];
                copy_head(hm, descs, total, hdr_len, k, &mut arena[at..], pieces).map(|f| TxFrame {
                    start: f.start + at,
                    ..f
                })
            });
            frames.push(frame);
        }
        frames.len()
    }

    /// Frames of the last take that are one-copy frames (still to be sent).
    pub fn one_copy_frames(&self) -> usize {
        self.frames
            .iter()
            .filter(|f| f.as_ref().is_ok_and(|f| f.tail_len > 0))
            .count()
    }

    /// Hands the chains of the last take back to the guest (used entries, length 0;
    /// the caller publishes them), once nothing reads their buffers any more: a
    /// one-copy frame's tail is read until its frame is sent. Returns how many heads
    /// could not be handed back (outside the ring, or the used ring unmapped).
    pub fn give_back(&mut self, ring: &mut Vq, hm: &HostMem<'_>) -> usize {
        self.pieces.clear();
        let bad = ring.put_used_all(hm, self.walked.iter().map(|c| &c.head));
        self.walked.clear();
        bad
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ring::GuestMem;
    use crate::testkit::frames::pattern;
    use virtio_bindings::virtio_ring::{VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
    use virtio_queue::desc::split::Descriptor;
    use vm_memory::{Bytes, GuestAddress};

    fn mem() -> GuestMem {
        GuestMem::from_ranges(&[(GuestAddress(0), 0x20000)]).unwrap()
    }

    fn desc(addr: u64, len: u32, flags: u16) -> Descriptor {
        Descriptor::new(addr, len, flags, 0)
    }

    /// Reads a chain into a fresh buffer: the frame and a copy of its bytes.
    fn read<I: IntoIterator<Item = Descriptor>>(
        m: &GuestMem,
        descs: I,
        max: usize,
    ) -> Result<(TxFrame, Vec<u8>), TxError> {
        let descs: Vec<Desc> = descs
            .into_iter()
            .map(|d| Desc {
                addr: d.addr().0,
                len: d.len(),
                flags: d.flags(),
                next: d.next(),
            })
            .collect();
        // As a walk that stopped where the given descriptors end.
        let end = if descs.last().is_some_and(|d| d.has_next()) {
            WalkEnd::Broken
        } else {
            WalkEnd::Complete
        };
        let mut buf = tx_buffer();
        let total = chain_bytes(&descs, end, max)?;
        let f = copy_chain(&HostMem::new(m), &descs, total, HDR_LEN, &mut buf)?;
        let bytes = buf[f.start..f.start + f.len].to_vec();
        Ok((f, bytes))
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
        all.extend(pattern(100));
        // 5 | 9 | rest: the header straddles two descriptors and spills into a third.
        m.write_slice(&all[..5], GuestAddress(0x100)).unwrap();
        m.write_slice(&all[5..14], GuestAddress(0x2000)).unwrap();
        m.write_slice(&all[14..], GuestAddress(0x5003)).unwrap();
        let f = read(
            &m,
            [
                desc(0x100, 5, VRING_DESC_F_NEXT as u16),
                desc(0x2000, 9, VRING_DESC_F_NEXT as u16),
                desc(0x5003, (all.len() - 14) as u32, 0),
            ],
            256,
        )
        .unwrap();
        assert_eq!(f.0.hdr, hdr);
        assert_eq!(f.0.len, 100);
        assert_eq!(f.1, all[HDR_LEN..].to_vec());
    }

    #[test]
    fn rejects_writable_out_of_range_short_and_long() {
        let m = mem();
        assert_eq!(
            read(&m, [desc(0, 64, VRING_DESC_F_WRITE as u16)], 256).unwrap_err(),
            TxError::WritableDescriptor
        );
        assert!(matches!(
            read(&m, [desc(0x1ffff, 64, 0)], 256).unwrap_err(),
            TxError::BadAddress(_)
        ));
        assert_eq!(
            read(&m, [desc(0, 8, 0)], 256).unwrap_err(),
            TxError::Header(HdrError::Short(8))
        );
        assert_eq!(
            read(&m, [desc(0, 20, 0)], 256).unwrap_err(),
            TxError::TooShort(8)
        );
        let long = (0..2).map(|_| desc(0, 0xffff, VRING_DESC_F_NEXT as u16));
        assert_eq!(read(&m, long, 256).unwrap_err(), TxError::TooLong);
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
        all.extend(pattern(300));
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
        let f = read(&m, chain, 16).unwrap();
        assert_eq!(f.0.hdr, hdr);
        assert_eq!(f.0.len, 300);
        assert_eq!(f.1, all[HDR_LEN..].to_vec());
    }

    #[test]
    fn rejects_truncated_and_overlong_chains() {
        let m = mem();
        // The walker stopped while the last descriptor still pointed on.
        let cut = [desc(0, 64, VRING_DESC_F_NEXT as u16)];
        assert_eq!(read(&m, cut, 256).unwrap_err(), TxError::Broken);
        let many = (0..5).map(|_| desc(0, 16, VRING_DESC_F_NEXT as u16));
        assert_eq!(read(&m, many, 4).unwrap_err(), TxError::TooManyDescriptors);
    }
}

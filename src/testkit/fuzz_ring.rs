//! Fuzz entry for the ring code: a fuzzer-built split queue (descriptor table, avail
//! ring, indirect tables) in real guest memory, read as TX chains by
//! `ring::tx::chain_bytes` / `copy_chain` and written as RX chains by
//! `ring::rx::write_frame`.
//!
//! Input layout: 1 byte mode (bit 0 RX, bit 1 MRG_RXBUF, bit 2 INDIRECT_DESC, bit 3
//! 10-byte legacy header, bit 4 deferred RX publish of frames whose tail lies in
//! another guest's memory / TX one-copy frames, bit 5 TX
//! in order) | 1 byte queue size (2 << (b % 8)) | 1 byte avail index |
//! 12 bytes virtio_net_hdr | 1 byte frame count k (mod 4, +1) | k * 2 bytes frame
//! lengths (LE) | one byte per avail ring entry (head index) | 6 bytes per descriptor
//! (addr u16 LE, len u16 LE, flags, next) | the rest: bytes at `DATA` (indirect tables).
//!
//! Guest memory is `[0, 0xc000)` and `[0xd000, 0x10000)`: descriptors may point into
//! the hole, past the end, or at the rings themselves, as a hostile guest's may.

use virtio_queue::desc::split::Descriptor;
use virtio_queue::desc::RawDescriptor;
use virtio_queue::{Queue, QueueT};
use vm_memory::{Bytes, GuestAddress};

use crate::ring::host::HostMem;
use crate::ring::rx::{write_frame, write_frame_in, RxError, RxFormat, RxScratch, Source};
use crate::ring::rx::{MAX_CHAINS_PER_FRAME, MAX_DESCS_PER_FRAME};
use crate::ring::split::{walk_chain, SplitRing, WalkEnd};
use crate::ring::tx::{GuestTail, TxBatch, TxError, MAX_FRAME, MIN_FRAME, ONE_COPY_HEAD};
use crate::ring::vq::Vq;
use crate::ring::GuestMem;
use crate::vnet_hdr::{VirtioNetHdr, HDR_LEN};

/// End of guest memory.
pub const MEM_END: u64 = 0x10000;
/// The unmapped hole.
pub const HOLE: std::ops::Range<u64> = 0xc000..0xd000;
/// Where deferred RX frames come from: another guest's memory (128 KiB).
const SENDER: u64 = 0x100000;
/// Where the input's trailing bytes go: indirect tables live there.
pub const DATA: u64 = 0x4000;
/// Bytes before the avail ring entries.
pub const PREFIX_LEN: usize = 3 + HDR_LEN + 1;

const F_NEXT: u16 = 1;
const F_WRITE: u16 = 2;
const F_INDIRECT: u16 = 4;
/// Descriptors the oracle follows per chain before it stops looking.
const ORACLE_MAX_DESCS: usize = 4 * MAX_DESCS_PER_FRAME;

/// The queue shape and what to do with it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Mode {
    pub rx: bool,
    pub mrg_rxbuf: bool,
    pub indirect: bool,
    pub legacy_hdr: bool,
    /// RX frames written as a sender's batch does: used entries first, the used
    /// index published after the frame (`write_frame_in` without `publish`). TX:
    /// long chains are taken as one-copy frames (`TxBatch::set_one_copy`).
    pub deferred: bool,
    /// TX: VIRTIO_F_IN_ORDER, each batch handed back as one used element
    /// (`SplitRing::put_used_in_order`).
    pub in_order: bool,
}

impl Mode {
    fn byte(self) -> u8 {
        u8::from(self.rx)
            | u8::from(self.mrg_rxbuf) << 1
            | u8::from(self.indirect) << 2
            | u8::from(self.legacy_hdr) << 3
            | u8::from(self.deferred) << 4
            | u8::from(self.in_order) << 5
    }

    fn hdr_len(self) -> usize {
        if self.legacy_hdr {
            10
        } else {
            HDR_LEN
        }
    }
}

/// One descriptor as the input encodes it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Desc {
    pub addr: u16,
    pub len: u16,
    pub flags: u8,
    pub next: u8,
}

/// Encodes a fuzz input (for seed corpora). `size_log` picks a queue of
/// `2 << size_log` entries.
#[allow(clippy::too_many_arguments)]
pub fn encode(
    mode: Mode,
    size_log: u8,
    avail_idx: u8,
    hdr: &VirtioNetHdr,
    frames: &[u16],
    heads: &[u8],
    descs: &[Desc],
    data: &[u8],
) -> Vec<u8> {
    let size = 2usize << (size_log % 8);
    let mut v = vec![mode.byte(), size_log, avail_idx];
    v.extend_from_slice(&hdr.to_bytes());
    let k = frames.len().clamp(1, 4);
    v.push((k - 1) as u8);
    for i in 0..k {
        v.extend_from_slice(&frames.get(i).copied().unwrap_or(0).to_le_bytes());
    }
    for i in 0..usize::from(avail_idx).min(size) {
        v.push(heads.get(i).copied().unwrap_or(0));
    }
    for i in 0..size {
        let d = descs.get(i).copied().unwrap_or_default();
        v.extend_from_slice(&d.addr.to_le_bytes());
        v.extend_from_slice(&d.len.to_le_bytes());
        v.extend_from_slice(&[d.flags, d.next]);
    }
    v.extend_from_slice(data);
    v
}

/// Where the split queue lies in guest memory (from 0: descriptor table, avail ring,
/// used ring), laid out as a driver would.
struct Ring {
    size: u16,
    avail: u64,
    used: u64,
}

impl Ring {
    fn new(size: u16) -> Ring {
        let avail = 16 * u64::from(size);
        let used = (avail + 6 + 2 * u64::from(size) + 3) & !3;
        Ring { size, avail, used }
    }

    /// The end of the used ring: the rings take `[0, end)`.
    fn end(&self) -> u64 {
        self.used + 6 + 8 * u64::from(self.size)
    }

    fn queue(&self) -> Queue {
        let mut q = Queue::new(self.size).expect("queue size");
        q.set_size(self.size);
        q.set_ready(true);
        q.set_desc_table_address(Some(0), Some(0));
        q.set_avail_ring_address(Some(self.avail as u32), Some(0));
        q.set_used_ring_address(Some(self.used as u32), Some(0));
        q
    }

    fn used_idx(&self, m: &GuestMem) -> u16 {
        m.read_obj(GuestAddress(self.used + 2)).expect("used idx")
    }

    /// The used element at ring position `pos` (wrapped): (id, len).
    fn used_at(&self, m: &GuestMem, pos: u16) -> (u32, u32) {
        let at = self.used + 4 + 8 * u64::from(pos % self.size);
        let id: u32 = m.read_obj(GuestAddress(at)).expect("used id");
        let len: u32 = m.read_obj(GuestAddress(at + 4)).expect("used len");
        (id, len)
    }
}

/// Takes `n` bytes, zero-padded when the input runs out.
fn take<'a>(data: &mut &'a [u8], n: usize) -> std::borrow::Cow<'a, [u8]> {
    let k = n.min(data.len());
    let (a, b) = data.split_at(k);
    *data = b;
    if k == n {
        std::borrow::Cow::Borrowed(a)
    } else {
        let mut v = a.to_vec();
        v.resize(n, 0);
        std::borrow::Cow::Owned(v)
    }
}

fn mem() -> GuestMem {
    GuestMem::from_ranges(&[
        (GuestAddress(0), HOLE.start as usize),
        (GuestAddress(HOLE.end), (MEM_END - HOLE.end) as usize),
    ])
    .expect("guest memory")
}

/// Whether `len` bytes at `addr` are guest memory (an empty range reads nothing, so
/// it is never out of bounds).
fn mapped(addr: u64, len: u64) -> bool {
    if len == 0 {
        return true;
    }
    let Some(end) = addr.checked_add(len) else {
        return false;
    };
    end <= MEM_END && (end <= HOLE.start || addr >= HOLE.end)
}

/// Every mapped byte of guest memory, the hole read as zeros.
fn snapshot(m: &GuestMem) -> Vec<u8> {
    let mut v = vec![0u8; MEM_END as usize];
    m.read_slice(&mut v[..HOLE.start as usize], GuestAddress(0))
        .expect("low region");
    m.read_slice(&mut v[HOLE.end as usize..], GuestAddress(HOLE.end))
        .expect("high region");
    v
}

/// A chain as the oracle sees it before the code under test runs.
struct Chain {
    head: u16,
    descs: Vec<Descriptor>,
    head_indirect: bool,
}

/// The next `n` chains from avail position `next_avail`, walked by a second queue
/// over the same memory (virtio-queue's walker: the one the datapath uses).
fn prewalk(ring: &Ring, m: &GuestMem, next_avail: u16, n: usize) -> Vec<Chain> {
    let mut q = ring.queue();
    q.set_next_avail(next_avail);
    let mut out = Vec::new();
    while out.len() < n {
        let Some(c) = q.pop_descriptor_chain(m) else {
            break;
        };
        let head = c.head_index();
        let at = 16 * u64::from(head);
        let head_indirect = m
            .read_obj::<Descriptor>(GuestAddress(at))
            .map(|d| d.refers_to_indirect_table())
            .unwrap_or(false);
        out.push(Chain {
            head,
            descs: c.take(ORACLE_MAX_DESCS).collect(),
            head_indirect,
        });
    }
    out
}

#[doc(hidden)]
pub fn fuzz_one(data: &[u8]) {
    if data.len() < PREFIX_LEN {
        return;
    }
    let mode = Mode {
        rx: data[0] & 1 != 0,
        mrg_rxbuf: data[0] & 2 != 0,
        indirect: data[0] & 4 != 0,
        legacy_hdr: data[0] & 8 != 0,
        deferred: data[0] & 16 != 0,
        in_order: data[0] & 32 != 0,
    };
    let size = 2u16 << (data[1] % 8);
    let avail_idx = u16::from(data[2]);
    let hdr = VirtioNetHdr::from_bytes(&data[3..3 + HDR_LEN]).unwrap_or_default();
    let k = usize::from(data[3 + HDR_LEN] % 4) + 1;
    let mut rest = &data[PREFIX_LEN..];
    let lens: Vec<usize> = take(&mut rest, 2 * k)
        .chunks_exact(2)
        .map(|c| usize::from(u16::from_le_bytes([c[0], c[1]])))
        .collect();

    let m = mem();
    let ring = Ring::new(size);
    let heads = take(&mut rest, usize::from(avail_idx.min(size)));
    for (i, &h) in heads.iter().enumerate() {
        m.write_obj(u16::from(h), GuestAddress(ring.avail + 4 + 2 * i as u64))
            .expect("avail entry");
    }
    m.write_obj(avail_idx, GuestAddress(ring.avail + 2))
        .expect("avail idx");
    for i in 0..size {
        let d = take(&mut rest, 6);
        let flags = u16::from(d[4] & 7) | if d[4] & 0x80 != 0 { 0x8000 } else { 0 };
        let raw = Descriptor::new(
            u64::from(u16::from_le_bytes([d[0], d[1]])),
            u32::from(u16::from_le_bytes([d[2], d[3]])),
            flags,
            u16::from(d[5]),
        );
        m.write_obj(RawDescriptor::from(raw), GuestAddress(16 * u64::from(i)))
            .expect("descriptor");
    }
    let n = rest.len().min((HOLE.start - DATA) as usize);
    m.write_slice(&rest[..n], GuestAddress(DATA))
        .expect("data area");
    let mut q = ring.queue();
    if mode.rx {
        rx(&ring, &m, &mut q, mode, &hdr, &lens);
    } else {
        tx(&ring, &m, &mut q, mode);
    }
}

/// Chains per batch in the fuzz: small, so that a batch also stops at its chain
/// count and walk budget, not only at its arena.
const FUZZ_BATCH_CHAINS: usize = 4;

/// Every available chain taken by `TxBatch` as a TX worker takes it (batches of
/// `FUZZ_BATCH_CHAINS` chains, an arena of one largest frame), each chain checked
/// against what the oracle (virtio-queue's walker) reads.
fn tx(ring: &Ring, m: &GuestMem, q: &mut Queue, mode: Mode) {
    let hdr_len = mode.hdr_len();
    let max_descs = usize::from(q.size());
    let hm = HostMem::new(m);
    let mut vq = Vq::of(q, false);
    vq.batch_used(mode.in_order);
    let split = |vq: &Vq| match vq {
        Vq::Split { ring, .. } => *ring,
        Vq::Packed { .. } => unreachable!("a split ring"),
    };
    let chains = prewalk(ring, m, q.next_avail(), usize::from(q.size()) + 1);
    let pending = split(&vq).pending(&hm);
    let in_range = q
        .avail_idx(m, std::sync::atomic::Ordering::Acquire)
        .is_ok_and(|a| (a - std::num::Wrapping(q.next_avail())).0 <= q.size());
    assert_eq!(
        pending.is_some(),
        in_range,
        "the avail index check disagrees with virtio-queue's reading"
    );
    let Some(pending) = pending else { return };
    assert_eq!(usize::from(pending), chains.len(), "chains available");
    let mut batch = TxBatch::new(FUZZ_BATCH_CHAINS, MAX_FRAME + HDR_LEN);
    // `deferred` on TX: chains past a head's bytes are taken as one-copy frames.
    batch.set_one_copy(mode.deferred.then_some(0));
    let keep = |total: u64| {
        let total = total as usize;
        if mode.deferred && total > hdr_len + ONE_COPY_HEAD {
            hdr_len + ONE_COPY_HEAD
        } else {
            total
        }
    };
    let mut wants = chains.iter();
    let mut left = pending;
    while left > 0 {
        batch.arena.fill(0xa5);
        // The chains this batch may take, read as they are before the take: an
        // earlier batch's used entries may have changed them (a descriptor or
        // indirect table in the used ring), the take itself reads them all before it
        // writes any used entry.
        let next = prewalk(
            ring,
            m,
            split(&vq).next_avail.0,
            usize::from(left).min(FUZZ_BATCH_CHAINS),
        );
        for c in &next {
            check_walk(&hm, &split(&vq), c, max_descs);
        }
        // Only chains short enough to become frames are read: the others are never
        // compared, and reading them would cost gigabytes a batch.
        let before: Vec<Vec<Vec<u8>>> = next
            .iter()
            .map(|c| {
                let total: u64 = c.descs.iter().map(|d| u64::from(d.len())).sum();
                if total > (MAX_FRAME + HDR_LEN) as u64 {
                    return Vec::new();
                }
                c.descs
                    .iter()
                    .map(|d| {
                        let mut b = vec![0u8; d.len() as usize];
                        let _ = m.read_slice(&mut b, GuestAddress(d.addr().0));
                        b
                    })
                    .collect()
            })
            .collect();
        let used_at = split(&vq).next_used;
        let taken = batch.take(&mut vq, &hm, hdr_len, usize::MAX);
        assert!(taken > 0, "a batch takes at least one chain");
        assert_eq!(taken, batch.frames.len());
        left -= taken as u16;
        // What one-copy frames left in the guest's buffers, read before the chains
        // go back (a used entry may land on a buffer).
        let tails: Vec<Vec<u8>> = batch
            .frames
            .iter()
            .map(|r| {
                let Ok(f) = r else { return Vec::new() };
                let mut b = Vec::new();
                for &(addr, n) in &batch.pieces[f.tail.clone()] {
                    let mut piece = vec![0u8; n as usize];
                    m.read_slice(&mut piece, GuestAddress(addr))
                        .expect("a tail piece is mapped");
                    b.extend(piece);
                }
                assert_eq!(b.len(), f.tail_len);
                b
            })
            .collect();
        let bad_heads = batch.give_back(&mut vq, &hm);
        // Where the next chain's bytes go: chains are laid out in ring order.
        let mut at = 0usize;
        let mut outside = 0usize;
        for (k, r) in batch.frames.iter().enumerate() {
            let first = wants.next().expect("no more chains taken than available");
            let want = &next[k];
            assert_eq!(first.head, want.head, "the avail ring changed");
            let descs = &want.descs;
            let total: u64 = descs.iter().map(|d| u64::from(d.len())).sum();
            let too_many = descs.len() > max_descs;
            let writable = descs.iter().any(|d| d.is_write_only());
            let unmapped = descs
                .iter()
                .any(|d| !mapped(d.addr().0, u64::from(d.len())));
            let too_long = total > (MAX_FRAME + HDR_LEN) as u64;
            // A chain without a single descriptor is broken too.
            let broken = descs.last().is_none_or(|d| d.has_next());
            let checked = !(too_many || writable || too_long || broken);
            match r {
                Ok(f) => {
                    assert!(checked && !unmapped);
                    assert_eq!(f.start, at + hdr_len, "chain {k} is not where it belongs");
                    assert_eq!(
                        (f.start + f.len + f.tail_len - at) as u64,
                        total,
                        "frame is not the chain"
                    );
                    assert_eq!(f.tail_len > 0, keep(total) < total as usize);
                    assert!(f.frame_len() >= MIN_FRAME && f.frame_len() <= MAX_FRAME);
                    // The bytes are the descriptors' bytes, in order: those in the
                    // arena, then those left in the guest's buffers.
                    let mut got = batch.arena[at..f.start + f.len].to_vec();
                    got.extend_from_slice(&tails[k]);
                    assert_eq!(got, before[k].concat());
                    let mut raw = [0u8; HDR_LEN];
                    raw[..hdr_len].copy_from_slice(&batch.arena[at..at + hdr_len]);
                    assert_eq!(Ok(f.hdr), VirtioNetHdr::from_bytes(&raw));
                }
                Err(TxError::TooManyDescriptors) => assert!(too_many),
                Err(TxError::WritableDescriptor) => assert!(writable),
                Err(TxError::BadAddress(b)) => {
                    assert!(unmapped);
                    assert!(!mapped(b.addr, b.len as u64));
                }
                Err(TxError::TooLong) => assert!(too_long),
                Err(TxError::Broken) => assert!(broken, "{descs:?}"),
                Err(TxError::TooShort(n)) => {
                    assert_eq!((*n + hdr_len) as u64, total);
                    assert!(*n < MIN_FRAME);
                }
                Err(TxError::Header(_)) => {}
            }
            if r.is_err() && checked && !unmapped {
                // A well-formed chain fails only for what its bytes say.
                assert!(
                    matches!(r, Err(TxError::TooShort(_) | TxError::Header(_))),
                    "{r:?}"
                );
            }
            if checked {
                at += keep(total);
            }
            // Its used entry names it, unless its head is outside the ring (in
            // order: the batch's one entry is checked below).
            if want.head >= split(&vq).size {
                outside += 1;
            } else if !mode.in_order {
                let slot =
                    u64::from((used_at.0.wrapping_add((k - outside) as u16)) % split(&vq).size);
                let mut elem = [0u8; 8];
                m.read_slice(&mut elem, GuestAddress(ring.used + 4 + 8 * slot))
                    .unwrap();
                assert_eq!(&elem[..4], &u32::from(want.head).to_le_bytes());
            }
        }
        assert_eq!(bad_heads, outside);
        let size = split(&vq).size;
        assert_eq!(
            (split(&vq).next_used - used_at).0,
            (taken - outside) as u16,
            "the used position moved by other than the chains handed back"
        );
        if let (true, Some(last)) = (
            mode.in_order,
            next[..taken].iter().rev().find(|c| c.head < size),
        ) {
            // In order: one element, in the batch's first used slot, names its last
            // chain.
            let slot = u64::from(used_at.0 % size);
            let mut elem = [0u8; 8];
            m.read_slice(&mut elem, GuestAddress(ring.used + 4 + 8 * slot))
                .unwrap();
            assert_eq!(&elem[..4], &u32::from(last.head).to_le_bytes());
        }
        let guard = (at + 64).min(batch.arena.len());
        assert!(
            batch.arena[at..guard].iter().all(|&b| b == 0xa5),
            "the batch wrote past its chains' bytes"
        );
    }
    assert!(wants.next().is_none(), "every available chain was taken");
    assert!(vq.publish_used(&hm));
    vq.store(q);
    assert_eq!(
        q.next_avail(),
        q.next_used()
            .wrapping_add(chains.iter().filter(|c| c.head >= q.size()).count() as u16)
    );
}

/// `walk_chain` and `SplitRing::walk` (at most `max` descriptors) agree with virtio-queue's walk of `c`,
/// read from the same memory: the same descriptors, and it ends where that one does.
fn check_walk(hm: &HostMem<'_>, split: &SplitRing, c: &Chain, max: usize) {
    let mut walk = Vec::new();
    let end = walk_chain(hm, split.desc, split.size, c.head, max, &mut walk);
    // The ring's own walk (a lone descriptor taken without the loop) ends alike.
    let mut ring_walk = Vec::new();
    let ring_end = split.walk(hm, c.head, max, &mut ring_walk);
    assert_eq!((ring_end, &ring_walk), (end, &walk), "head {}", c.head);
    let ours: Vec<_> = walk
        .iter()
        .map(|a| (a.addr, a.len, a.flags, a.next))
        .collect();
    let theirs: Vec<_> = c
        .descs
        .iter()
        .map(|b| (b.addr().0, b.len(), b.flags(), b.next()))
        .collect();
    if end == WalkEnd::TooMany {
        assert!(walk.len() == max && theirs.len() > max, "{end:?} {walk:?}");
        assert_eq!(ours[..], theirs[..max], "head {}", c.head);
    } else {
        assert_eq!(ours, theirs, "head {} walk {end:?}", c.head);
        assert_eq!(
            end == WalkEnd::Complete,
            walk.last().is_some_and(|d| !d.has_next()),
            "head {} walk {end:?}",
            c.head
        );
    }
}

fn well_formed(c: &Chain, fmt: RxFormat, size: u16) -> bool {
    (fmt.indirect || !c.head_indirect)
        && c.head < size
        && !c.descs.is_empty()
        && c.descs.last().is_some_and(|d| !d.has_next())
        && c.descs.len() <= usize::from(size)
        && c.descs.iter().all(|d| d.len() > 0 && d.is_write_only())
}

/// Up to `lens.len()` frames through `write_frame`, each checked against the chains
/// the oracle walked before it.
fn rx(ring: &Ring, m: &GuestMem, q: &mut Queue, mode: Mode, hdr: &VirtioNetHdr, lens: &[usize]) {
    let fmt = RxFormat {
        hdr_len: mode.hdr_len(),
        mrg_rxbuf: mode.mrg_rxbuf,
        indirect: mode.indirect,
    };
    let size = q.size();
    let used_base = ring.used;
    let used_end = ring.end();
    let mut scratch = RxScratch::default();
    let sender = GuestMem::from_ranges(&[(GuestAddress(SENDER), 0x20000)]).unwrap();
    for (fi, &len) in lens.iter().enumerate() {
        let frame = pattern(fi * 13, len);
        // Split the frame in two parts to cover the source walk.
        let cut = len / 3;
        let parts: [&[u8]; 2] = [&frame[..cut], &frame[cut..]];
        let need = fmt.hdr_len + len;
        let before = snapshot(m);
        let next_avail = q.next_avail();
        let used_idx = ring.used_idx(m);
        let chains = prewalk(ring, m, next_avail, MAX_CHAINS_PER_FRAME + 1);
        {
            let split = SplitRing::of(q);
            for c in &chains {
                check_walk(&HostMem::new(m), &split, c, usize::from(size));
            }
        }
        let r = if mode.deferred {
            let hm = HostMem::new(m);
            let mut vq = Vq::of(q, false);
            // The frame as another guest sends it: its first part copied out, the
            // rest in two pieces of the sender's memory.
            let rest = &frame[cut..];
            let mid = rest.len() / 2;
            let far = SENDER + 0x10000;
            sender
                .write_slice(&rest[..mid], GuestAddress(SENDER))
                .unwrap();
            sender.write_slice(&rest[mid..], GuestAddress(far)).unwrap();
            let pieces = [(SENDER, mid as u32), (far, (rest.len() - mid) as u32)];
            let tail = GuestTail {
                mem: &sender,
                pieces: &pieces,
                len: rest.len(),
            };
            let head = [&frame[..cut]];
            let src = Source::Guest {
                head: &head,
                tail: &tail,
            };
            let r = write_frame_in(&mut vq, &hm, &mut scratch, hdr, fmt, src, false);
            let Vq::Split { ring: split, .. } = &vq else {
                unreachable!("a split ring")
            };
            // A claimed buffer over the used index holds frame bytes there.
            let claimed = usize::from((split.next_avail - std::num::Wrapping(next_avail)).0);
            let idx = (ring.used + 2, ring.used + 4);
            let over_idx = chains
                .iter()
                .take(claimed)
                .flat_map(|c| c.descs.iter())
                .any(|d| {
                    let (a, l) = (d.addr().0, u64::from(d.len()));
                    d.is_write_only() && a < idx.1 && a.saturating_add(l) > idx.0
                });
            if r.is_ok() && !over_idx {
                assert_eq!(
                    ring.used_idx(m),
                    used_idx,
                    "a frame was published before its batch ended"
                );
            }
            assert!(vq.publish_used(&hm), "the used ring is mapped");
            vq.store(q);
            r
        } else {
            write_frame(q, m, &mut scratch, hdr, fmt, &parts)
        };
        let after = snapshot(m);
        let used_now = ring.used_idx(m);
        let added = used_now.wrapping_sub(used_idx);
        let consumed = usize::from(q.next_avail().wrapping_sub(next_avail));
        let (dbytes, dchains, dwritten) = scratch.capacity();
        assert!(
            dbytes <= 2 * MAX_DESCS_PER_FRAME,
            "scratch grew to {dbytes}"
        );
        assert!(dchains <= 2 * MAX_CHAINS_PER_FRAME && dwritten <= 2 * MAX_CHAINS_PER_FRAME);

        // Which chains were claimed, and the ranges they let the device write. A head
        // outside the table cannot go back to the used ring; every other one does.
        assert!(
            consumed <= chains.len(),
            "consumed more chains than were posted"
        );
        let claimed = &chains[..consumed];
        let returned: Vec<&Chain> = claimed.iter().filter(|c| c.head < size).collect();
        assert_eq!(
            usize::from(added),
            returned.len(),
            "used entries vs chains claimed"
        );
        let mut allowed: Vec<(u64, u64)> = claimed
            .iter()
            .flat_map(|c| c.descs.iter())
            .filter(|d| d.is_write_only())
            .map(|d| (d.addr().0, d.addr().0.saturating_add(u64::from(d.len()))))
            .collect();
        allowed.push((used_base, used_end));
        if let Some(a) = changed_outside(&before, &after, &mut allowed) {
            panic!("write_frame changed byte {a:#x} outside the chains it claimed");
        }
        // Used entries: the claimed chains, in claim order for a frame written (its
        // buffers in order), in any order for chains handed back empty.
        let mut ids: Vec<u32> = (0..added)
            .map(|i| ring.used_at(m, used_idx.wrapping_add(i)).0)
            .collect();
        let mut want: Vec<u32> = returned.iter().map(|c| u32::from(c.head)).collect();
        if r.is_err() {
            ids.sort_unstable();
            want.sort_unstable();
        }
        assert_eq!(ids, want, "used entries are not the chains claimed");
        match r {
            Ok(n) => {
                assert_eq!(n, claimed.len());
                assert!((1..=MAX_CHAINS_PER_FRAME).contains(&n));
                assert!(mode.mrg_rxbuf || n == 1);
                assert_eq!(q.next_avail(), next_avail.wrapping_add(n as u16));
                let descs: usize = claimed.iter().map(|c| c.descs.len()).sum();
                assert!(
                    descs <= MAX_DESCS_PER_FRAME,
                    "{descs} descriptors for one frame"
                );
                let mut sum = 0usize;
                for (i, c) in claimed.iter().enumerate() {
                    assert!(well_formed(c, fmt, size), "claimed a malformed chain: head {} size {size} indirect {} descs {:?} fmt {fmt:?}", c.head, c.head_indirect, c.descs);
                    let (_, l) = ring.used_at(m, used_idx.wrapping_add(i as u16));
                    let cap: usize = c.descs.iter().map(|d| d.len() as usize).sum();
                    assert!(l as usize <= cap, "used length {l} over the chain's {cap}");
                    sum += l as usize;
                }
                assert_eq!(sum, need, "used lengths do not add up to the frame");
                check_bytes(m, claimed, ring, hdr, fmt, n, frame, used_idx);
            }
            Err(RxError::NoBuffers | RxError::TooFragmented | RxError::BufferTooSmall { .. }) => {
                // Nothing claimed, nothing written: the buffers stay for the next frame.
                assert_eq!(added, 0);
                assert_eq!(q.next_avail(), next_avail);
                assert!(
                    before == after,
                    "a frame that did not fit changed guest memory"
                );
                if let Err(RxError::BufferTooSmall { have, need: n }) = r {
                    assert!(!mode.mrg_rxbuf && have < n && n == need);
                }
            }
            Err(e @ (RxError::BadChain | RxError::ReadableDescriptor | RxError::BadAddress)) => {
                // The chains claimed are handed back empty, the ring moves on.
                for i in 0..added {
                    assert_eq!(ring.used_at(m, used_idx.wrapping_add(i)).1, 0);
                }
                if consumed == 0 {
                    // An avail index more than a queue ahead (virtio-queue's reading):
                    // the ring is broken, nothing is claimed or written.
                    let in_range = q
                        .avail_idx(m, std::sync::atomic::Ordering::Acquire)
                        .is_ok_and(|a| (a - std::num::Wrapping(next_avail)).0 <= size);
                    assert!(matches!(e, RxError::BadChain) && !in_range && before == after);
                    continue;
                }
                let last = claimed.last().expect("a claimed chain");
                match e {
                    RxError::BadChain => assert!(
                        (last.head_indirect && !fmt.indirect)
                            || last.descs.is_empty()
                            || last.descs.last().is_some_and(|d| d.has_next())
                            || last.descs.len() > usize::from(size)
                            || last.descs.iter().any(|d| d.len() == 0)
                    ),
                    RxError::ReadableDescriptor => {
                        assert!(last.descs.iter().any(|d| !d.is_write_only()))
                    }
                    _ => assert!(claimed
                        .iter()
                        .flat_map(|c| c.descs.iter())
                        .any(|d| !mapped(d.addr().0, u64::from(d.len())))),
                }
            }
        }
    }
}

/// The first byte that differs between `before` and `after` outside every range of
/// `allowed` (sorted and merged here). Compares in chunks (memcmp) and looks at single
/// bytes only in chunks that differ and are not inside one range: coverage
/// instrumentation makes per-byte loops slow.
fn changed_outside(before: &[u8], after: &[u8], allowed: &mut [(u64, u64)]) -> Option<u64> {
    allowed.sort_unstable();
    let mut merged: Vec<(u64, u64)> = Vec::with_capacity(allowed.len());
    for &(s, e) in allowed.iter() {
        match merged.last_mut() {
            Some(last) if s <= last.1 => last.1 = last.1.max(e),
            _ => merged.push((s, e)),
        }
    }
    // The range that contains `a`, if any.
    let inside = |a: u64, end: u64| {
        let i = merged.partition_point(|&(s, _)| s <= a);
        i > 0 && end <= merged[i - 1].1
    };
    const CHUNK: usize = 256;
    for start in (0..before.len()).step_by(CHUNK) {
        let end = (start + CHUNK).min(before.len());
        if before[start..end] == after[start..end] || inside(start as u64, end as u64) {
            continue;
        }
        for a in start..end {
            if before[a] != after[a] && !inside(a as u64, a as u64 + 1) {
                return Some(a as u64);
            }
        }
    }
    None
}

/// Frame bytes: a fixed pattern, built once.
fn pattern(offset: usize, len: usize) -> &'static [u8] {
    static P: std::sync::OnceLock<Vec<u8>> = std::sync::OnceLock::new();
    let p = P.get_or_init(|| (0..0x10000 + 256).map(|i| (i * 7 + 1) as u8).collect());
    &p[offset % 251..][..len]
}

/// When the claimed buffers overlap neither each other nor the rings, they hold the
/// header (with `num_buffers`) and the frame, in order.
#[allow(clippy::too_many_arguments)]
fn check_bytes(
    m: &GuestMem,
    claimed: &[Chain],
    ring: &Ring,
    hdr: &VirtioNetHdr,
    fmt: RxFormat,
    n: usize,
    frame: &[u8],
    used_idx: u16,
) {
    let mut ranges: Vec<(u64, u64)> = claimed
        .iter()
        .flat_map(|c| c.descs.iter())
        .map(|d| (d.addr().0, d.addr().0.saturating_add(u64::from(d.len()))))
        .collect();
    ranges.push((0, ring.end()));
    ranges.sort_unstable();
    if ranges.windows(2).any(|w| w[1].0 < w[0].1) {
        return;
    }
    let mut got = Vec::new();
    for (i, c) in claimed.iter().enumerate() {
        let (_, mut l) = ring.used_at(m, used_idx.wrapping_add(i as u16));
        for d in &c.descs {
            let k = d.len().min(l);
            let mut b = vec![0u8; k as usize];
            m.read_slice(&mut b, GuestAddress(d.addr().0)).unwrap();
            got.extend_from_slice(&b);
            l -= k;
        }
    }
    let mut out = *hdr;
    out.num_buffers = n as u16;
    let mut want = out.to_bytes()[..fmt.hdr_len].to_vec();
    want.extend_from_slice(frame);
    assert!(got == want, "the guest's buffers do not hold the frame");
}

/// Addresses a descriptor of the seeds may use freely.
const BUFS: u16 = 0x6000;

/// The seed corpus (written by the ignored `target_tests::write_seeds` test): the
/// base seeds, and each RX seed again with its used index published after the frame,
/// as a sender's batch publishes it.
pub fn seeds() -> Vec<Vec<u8>> {
    let base = base_seeds();
    let deferred: Vec<Vec<u8>> = base
        .iter()
        .filter(|s| s[0] & 1 != 0)
        .map(|s| {
            let mut s = s.clone();
            s[0] |= 16;
            s
        })
        .collect();
    base.into_iter().chain(deferred).collect()
}

fn base_seeds() -> Vec<Vec<u8>> {
    let w = F_WRITE as u8;
    let nw = (F_WRITE | F_NEXT) as u8;
    let hdr = VirtioNetHdr {
        gso_size: 1448,
        ..Default::default()
    };
    let mut out = Vec::new();
    let all = |rx, mrg, indirect| Mode {
        rx,
        mrg_rxbuf: mrg,
        indirect,
        legacy_hdr: false,
        deferred: false,
        in_order: false,
    };
    // RX: 8 single-descriptor chains of 1000 bytes, frames spanning several (MRG).
    let descs: Vec<Desc> = (0..8)
        .map(|i| Desc {
            addr: BUFS + i * 0x400,
            len: 1000,
            flags: w,
            next: 0,
        })
        .collect();
    let heads: Vec<u8> = (0..8).collect();
    out.push(encode(
        all(true, true, false),
        3,
        8,
        &hdr,
        &[100, 2500, 60],
        &heads,
        &descs,
        &[],
    ));
    out.push(encode(
        all(true, false, false),
        3,
        8,
        &hdr,
        &[900, 1200],
        &heads,
        &descs,
        &[],
    ));
    // RX: chains of 3 descriptors.
    let descs: Vec<Desc> = (0..12u16)
        .map(|i| Desc {
            addr: BUFS + i * 0x200,
            len: 200,
            flags: if i % 3 == 2 { w } else { nw },
            next: (i + 1) as u8,
        })
        .collect();
    out.push(encode(
        all(true, true, false),
        3,
        4,
        &hdr,
        &[500, 1000],
        &[0, 3, 6, 9],
        &descs,
        &[],
    ));
    // RX and TX: an indirect table at DATA.
    let mut table = Vec::new();
    for i in 0..4u16 {
        let flags = if i < 3 { F_NEXT } else { 0 };
        let d = Descriptor::new(u64::from(BUFS + i * 0x100), 64, flags | F_WRITE, i + 1);
        table.extend_from_slice(vm_memory::ByteValued::as_slice(&RawDescriptor::from(d)));
    }
    let ind = Desc {
        addr: DATA as u16,
        len: 64,
        flags: F_INDIRECT as u8,
        next: 0,
    };
    out.push(encode(
        all(true, true, true),
        2,
        1,
        &hdr,
        &[100],
        &[0],
        &[ind],
        &table,
    ));
    out.push(encode(
        all(true, true, false),
        2,
        1,
        &hdr,
        &[100],
        &[0],
        &[ind],
        &table,
    ));
    // TX: readable chains, one split inside the header.
    let tx_descs = [
        Desc {
            addr: BUFS,
            len: 5,
            flags: F_NEXT as u8,
            next: 1,
        },
        Desc {
            addr: BUFS + 0x100,
            len: 7,
            flags: F_NEXT as u8,
            next: 2,
        },
        Desc {
            addr: BUFS + 0x200,
            len: 300,
            flags: 0,
            next: 0,
        },
        Desc {
            addr: BUFS + 0x400,
            len: 60,
            flags: 0,
            next: 0,
        },
        Desc {
            addr: 0xc100,
            len: 60,
            flags: 0,
            next: 0,
        },
        Desc {
            addr: BUFS,
            len: 64,
            flags: F_WRITE as u8,
            next: 0,
        },
        Desc {
            addr: BUFS,
            len: 64,
            flags: F_NEXT as u8,
            next: 6,
        },
    ];
    out.push(encode(
        all(false, false, false),
        2,
        6,
        &hdr,
        &[0],
        &[0, 3, 4, 5, 6, 2],
        &tx_descs,
        &[],
    ));
    // The same chains in order: each batch back as one used element.
    let in_order = Mode {
        in_order: true,
        ..all(false, false, false)
    };
    out.push(encode(
        in_order,
        2,
        6,
        &hdr,
        &[0],
        &[0, 3, 4, 5, 6, 2],
        &tx_descs,
        &[],
    ));
    let mut table = Vec::new();
    for i in 0..3u16 {
        let flags = if i < 2 { F_NEXT } else { 0 };
        let d = Descriptor::new(u64::from(BUFS + i * 0x100), 40, flags, i + 1);
        table.extend_from_slice(vm_memory::ByteValued::as_slice(&RawDescriptor::from(d)));
    }
    let ind = Desc { len: 48, ..ind };
    let legacy = Mode {
        legacy_hdr: true,
        ..all(false, false, true)
    };
    out.push(encode(legacy, 1, 1, &hdr, &[0], &[0], &[ind], &table));
    // RX and TX: an indirect chain of more than u32::MAX bytes, which virtio-queue
    // ends before its last descriptor (RX once claimed it and wrote the frame into
    // its first buffer).
    for (mode, flags) in [
        (all(true, true, true), F_WRITE),
        (all(false, false, true), 0),
    ] {
        let mut table = Vec::new();
        for i in 0..2u16 {
            let next = if i < 1 { F_NEXT } else { 0 };
            let d = Descriptor::new(
                u64::from(BUFS + i * 0x100),
                0x8000_0000,
                flags | next,
                i + 1,
            );
            table.extend_from_slice(vm_memory::ByteValued::as_slice(&RawDescriptor::from(d)));
        }
        let ind = Desc { len: 32, ..ind };
        out.push(encode(mode, 2, 1, &hdr, &[100], &[0], &[ind], &table));
    }
    out
}

fuzz_target_tests!("ring", 5);

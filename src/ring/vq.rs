//! One virtqueue of either layout, split or packed, as a batch works it: take a
//! buffer (its head, then its descriptors), give buffers back, record used entries,
//! publish them, decide the call. `ring::tx` and `ring::rx` take a `Vq`; the split
//! arm only forwards to `SplitRing`, so the split datapath stays what it is.
//!
//! A packed ring's used position is not taken from the vring's queue: vhost-user's
//! SET_VRING_ADDR (vhost-user-backend 0.24) sets it from what would be a split
//! ring's used index, which in a packed ring is the device's event flags, and
//! SET_VRING_BASE keeps the avail half only. gsonet hands back every buffer it takes
//! before it lets go of the vring (TX within its batch; RX with the frame's used
//! entries, published later from the port's RX slot), so between two holds of the
//! vring the used position is the avail one, and that is what `Vq::of` takes.
//!
//! The two layouts differ in where a buffer's descriptors are: behind a split
//! ring's head index in the descriptor table, in the packed ring's own slots from
//! the head on. A split head is taken alone and walked later (the TX batch asks
//! for every head's descriptor line before it walks any); a packed buffer is walked
//! when taken, since its length says where the next one starts, and its
//! descriptors are kept here until `walk` hands them out.

use std::num::Wrapping;

use virtio_queue::QueueT;

use super::host::HostMem;
use super::packed::record::RecordSlot;
use super::packed::{PackedRing, Pos, UsedMark};
use super::split::{head_is_indirect, Desc, SplitRing, WalkEnd};

/// A buffer taken off a `Vq`: what gives it back, walks it and completes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Head {
    /// The avail position it was taken at (split: the avail index; packed: the
    /// vring base of its first slot).
    at: u16,
    /// Split: the head's descriptor index. Packed: the buffer id.
    pub id: u16,
    /// Ring slots it took (split: 1).
    slots: u16,
    /// Packed: its descriptors in the `Vq`'s store (start, count) and how its walk
    /// ended, and whether its head is indirect.
    walked: Option<(u32, u32, WalkEnd, bool)>,
}

/// Where the used side stood (for `Vq::rewind_used` and `Vq::wants_call`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UsedPos {
    Split(Wrapping<u16>),
    Packed(UsedMark),
}

/// A virtqueue's addresses and positions for one batch, either layout.
#[derive(Debug)]
pub enum Vq {
    Split {
        ring: SplitRing,
        /// Heads the guest made available and this batch has not taken, read once.
        pending: Option<u16>,
    },
    Packed {
        ring: PackedRing,
        /// The descriptors of the buffers taken since `clear`, for `walk`.
        store: Vec<Desc>,
    },
}

impl Vq {
    /// The queue's ring for this batch: packed when the frontend acked
    /// VIRTIO_F_RING_PACKED.
    pub fn of<Q: QueueT>(q: &Q, packed: bool) -> Vq {
        if packed {
            let mut ring = PackedRing::of(q);
            ring.next_used = ring.next_avail;
            Vq::Packed {
                ring,
                store: Vec::new(),
            }
        } else {
            Vq::Split {
                ring: SplitRing::of(q),
                pending: None,
            }
        }
    }

    /// `Vq::of(q, packed)`, in `spare`'s buffers if it is a ring of the same layout
    /// (a packed ring's descriptor store and used entries): a worker that takes its
    /// ring anew each batch allocates them once, not every batch.
    pub fn renew<Q: QueueT>(spare: Option<Vq>, q: &Q, packed: bool) -> Vq {
        match spare {
            Some(mut vq) if packed && vq.is_packed() => {
                vq.reload(q);
                vq.set_record(None);
                vq.batch_used(false);
                vq
            }
            _ => Vq::of(q, packed),
        }
    }

    /// Has a packed ring record its publishes in `r` (`packed::record`); a split
    /// ring needs none.
    pub fn set_record(&mut self, r: Option<RecordSlot>) {
        if let Vq::Packed { ring, .. } = self {
            ring.record = r;
        }
    }

    /// `set_record(r())` for a packed ring that has no record yet.
    pub fn record_in(&mut self, r: impl FnOnce() -> Option<RecordSlot>) {
        if let Vq::Packed { ring, .. } = self {
            if ring.record.is_none() {
                ring.record = r();
            }
        }
    }

    /// Lets a TX ring complete a batch of buffers with one used entry
    /// (VIRTIO_F_IN_ORDER): a packed ring each publish's run of buffers
    /// (`PackedRing::batch_used`), a split ring each `put_used_in_order`.
    pub fn batch_used(&mut self, on: bool) {
        match self {
            Vq::Packed { ring, .. } => ring.batch_used = on,
            Vq::Split { ring, .. } => ring.batch_used = on,
        }
    }

    /// Hands back `heads`, taken in this order, with length 0: as one used entry on
    /// a split ring with `batch_used` (`SplitRing::put_used_in_order`), as runs
    /// joined while they are recorded on a packed one (`PackedRing::put_used_in_order`),
    /// else one `put_used` each.
    /// Returns how many could not go back.
    pub fn put_used_all<'h>(
        &mut self,
        hm: &HostMem<'_>,
        heads: impl Iterator<Item = &'h Head>,
    ) -> usize {
        match self {
            Vq::Split { ring, .. } if ring.batch_used => {
                ring.put_used_in_order(hm, heads.map(|h| h.id))
            }
            Vq::Packed { ring, .. } => ring.put_used_in_order(hm, heads.map(|h| (h.id, h.slots))),
            _ => heads.filter(|h| !self.put_used(hm, h, 0)).count(),
        }
    }

    /// A split ring whose avail position is not `gap` past its used one was
    /// started by its frontend since it was last left so (`Port::look_at_start`):
    /// it starts at the used index in guest memory (`SplitRing::start_at_used`),
    /// the positions go back into `q` at once, and (base, used index) is given
    /// when the base was not it. A packed ring has no used index in memory: its
    /// start is the relay's (`backend::vhost::resume`).
    pub fn start_at_used<Q: QueueT>(&mut self, gap: u16, q: &mut Q) -> Option<(u16, u16)> {
        let Vq::Split { ring, .. } = self else {
            return None;
        };
        if ring.gap() == gap {
            return None;
        }
        let base = ring.start_at_used()?;
        ring.store(q);
        Some((base, ring.next_used.0))
    }

    /// A split ring's avail position past its used one (the heads skipped without
    /// a used entry); `None` for a packed ring.
    pub fn split_gap(&self) -> Option<u16> {
        match self {
            Vq::Split { ring, .. } => Some(ring.gap()),
            Vq::Packed { .. } => None,
        }
    }

    /// Puts the positions back into the vring's queue.
    pub fn store<Q: QueueT>(&self, q: &mut Q) {
        match self {
            Vq::Split { ring, .. } => ring.store(q),
            Vq::Packed { ring, .. } => ring.store(q),
        }
    }

    /// Entries in the ring.
    pub fn size(&self) -> u16 {
        match self {
            Vq::Split { ring, .. } => ring.size,
            Vq::Packed { ring, .. } => ring.size,
        }
    }

    /// Whether a buffer is available; `None` for a broken ring (a split avail index
    /// more than a queue ahead, a packed position outside the ring, unmapped).
    #[inline]
    pub fn has_avail(&mut self, hm: &HostMem<'_>) -> Option<bool> {
        match self {
            Vq::Split { ring, pending } => {
                let n = match *pending {
                    Some(n) => n,
                    None => {
                        let n = ring.pending(hm)?;
                        *pending = Some(n);
                        n
                    }
                };
                Some(n > 0)
            }
            Vq::Packed { ring, .. } => ring.has_avail(hm),
        }
    }

    /// Whether this is a packed ring.
    pub fn is_packed(&self) -> bool {
        matches!(self, Vq::Packed { .. })
    }

    /// The packed ring, for what only it has (its event structures).
    pub fn packed_ring(&self) -> Option<&PackedRing> {
        match self {
            Vq::Packed { ring, .. } => Some(ring),
            Vq::Split { .. } => None,
        }
    }

    /// Whether a ring kept between holds of the vring (a packed RX ring with used
    /// entries not published yet) is still `q`'s ring as it stands. A split ring
    /// keeps nothing: false.
    pub fn keeps<Q: QueueT>(&self, q: &Q) -> bool {
        match self {
            Vq::Packed { ring, .. } => ring.unpublished() > 0 && ring.is_of(q),
            Vq::Split { .. } => false,
        }
    }

    /// `Vq::of` in the same layout, into this value (a packed ring's buffers are
    /// kept; its unpublished entries are dropped).
    pub fn reload<Q: QueueT>(&mut self, q: &Q) {
        match self {
            Vq::Packed { ring, store } => {
                ring.reload(q);
                ring.next_used = ring.next_avail;
                store.clear();
            }
            Vq::Split { .. } => *self = Vq::of(q, false),
        }
    }

    /// Buffers available as last seen, for a writer of many frames (RX): a split
    /// ring's avail index is read again only when the one read last shows nothing
    /// left (`SplitRing::pending_cached`); a packed ring says 1 if the buffer at its
    /// avail position is available (it cannot tell more without walking). `None`
    /// for a broken ring.
    #[inline]
    pub fn pending_cached(&mut self, hm: &HostMem<'_>) -> Option<u16> {
        match self {
            Vq::Split { ring, .. } => ring.pending_cached(hm),
            Vq::Packed { ring, .. } => ring.has_avail(hm).map(u16::from),
        }
    }

    /// Before frames are written: starts loading the first lines of the buffers
    /// `skip..skip + n` places ahead, and of their used entries
    /// (`SplitRing::prefetch_writes`, `PackedRing::prefetch_writes`).
    #[inline]
    pub fn prefetch_writes(&mut self, hm: &HostMem<'_>, skip: usize, n: usize) {
        match self {
            Vq::Split { ring, pending } => {
                let have = usize::from(pending.unwrap_or(0));
                let n = n.min(have.saturating_sub(skip));
                if n > 0 {
                    ring.prefetch_writes(hm, skip as u16, n as u16);
                }
            }
            Vq::Packed { ring, .. } => {
                // The ring checks the positions against its size.
                if let (Ok(skip), Ok(n)) = (u16::try_from(skip), u16::try_from(n)) {
                    ring.prefetch_writes(hm, skip, n);
                }
            }
        }
    }

    /// `pending_cached`, read anew.
    #[inline]
    pub fn pending_fresh(&mut self, hm: &HostMem<'_>) -> Option<u16> {
        match self {
            Vq::Split { ring, .. } => ring.pending_fresh(hm),
            Vq::Packed { ring, .. } => ring.has_avail(hm).map(u16::from),
        }
    }

    /// Takes the next buffer, which the caller knows is available (from
    /// `pending_cached`), walking at most `max` of its descriptors if the layout
    /// walks it now (packed). `None` if the ring cannot be read there.
    #[inline]
    pub fn take_next(&mut self, hm: &HostMem<'_>, max: usize) -> Option<Head> {
        match self {
            Vq::Split { ring, pending } => {
                let at = ring.next_avail.0;
                let id = ring.pop(hm)?;
                *pending = pending.map(|n| n.saturating_sub(1));
                Some(Head {
                    at,
                    id,
                    slots: 1,
                    walked: None,
                })
            }
            Vq::Packed { .. } => self.take(hm, max),
        }
    }

    /// The next buffer, taken if it is one device-writable descriptor that holds
    /// `need` bytes (`take_single_writable` of either layout): its head and the
    /// buffer's address. `None` (nothing taken) otherwise. On a split ring the
    /// caller has seen a chain available (`pending_cached`, `pending_fresh`).
    #[inline]
    pub fn take_single_writable(&mut self, hm: &HostMem<'_>, need: usize) -> Option<(Head, u64)> {
        self.take_writable(hm, need).map(|(head, d)| (head, d.addr))
    }

    /// `take_single_writable` of any length but 0, with the buffer's descriptor:
    /// one of the buffers a frame spreads over. Out of line, so that the one-buffer
    /// path keeps its own inlined copy.
    #[inline(never)]
    pub fn take_lone_writable(&mut self, hm: &HostMem<'_>) -> Option<(Head, Desc)> {
        self.take_writable(hm, 1)
    }

    #[inline(always)]
    fn take_writable(&mut self, hm: &HostMem<'_>, need: usize) -> Option<(Head, Desc)> {
        match self {
            Vq::Split { ring, pending } => {
                let at = ring.next_avail.0;
                let (id, d) = ring.take_single_writable(hm, need)?;
                *pending = pending.map(|n| n.saturating_sub(1));
                let head = Head {
                    at,
                    id,
                    slots: 1,
                    walked: None,
                };
                Some((head, d))
            }
            Vq::Packed { ring, store } => packed_single_writable(ring, store, hm, need),
        }
    }

    /// Takes the next available buffer, walking at most `max` of its descriptors if
    /// the layout walks it now (packed). `None` if none is available.
    #[inline(always)]
    pub fn take(&mut self, hm: &HostMem<'_>, max: usize) -> Option<Head> {
        if !self.has_avail(hm)? {
            return None;
        }
        match self {
            Vq::Split { ring, pending } => {
                let at = ring.next_avail.0;
                let id = ring.pop(hm)?;
                *pending = pending.map(|n| n - 1);
                ring.prefetch_desc(hm, id);
                Some(Head {
                    at,
                    id,
                    slots: 1,
                    walked: None,
                })
            }
            Vq::Packed { ring, store } => {
                let start = store.len();
                let p = ring.pop(hm, max, store)?;
                Some(Head {
                    at: p.at.to_base(),
                    id: p.id,
                    slots: p.slots,
                    walked: Some((
                        start as u32,
                        (store.len() - start) as u32,
                        p.end,
                        p.indirect,
                    )),
                })
            }
        }
    }

    /// Appends `head`'s descriptors (at most `max`) to `out`; returns how its walk
    /// ended and whether its head descriptor points at an indirect table (a split
    /// ring's head is read again for that only with `ask_indirect`, else false).
    #[inline(always)]
    pub fn walk(
        &self,
        hm: &HostMem<'_>,
        head: &Head,
        max: usize,
        out: &mut Vec<Desc>,
        ask_indirect: bool,
    ) -> (WalkEnd, bool) {
        match (self, head.walked) {
            (Vq::Split { ring, .. }, _) => {
                let end = ring.walk(hm, head.id, max, out);
                let indirect = ask_indirect && head_is_indirect(hm, ring.desc, ring.size, head.id);
                (end, indirect)
            }
            (Vq::Packed { store, .. }, Some((start, n, end, indirect))) => {
                let (start, n) = (start as usize, n as usize);
                let Some(descs) = store.get(start..start + n) else {
                    return (WalkEnd::Broken, indirect);
                };
                if n > max {
                    out.extend_from_slice(&descs[..max]);
                    return (WalkEnd::TooMany, indirect);
                }
                out.extend_from_slice(descs);
                (end, indirect)
            }
            // A head taken off a split ring, walked as packed: nothing to walk.
            (Vq::Packed { .. }, None) => (WalkEnd::Broken, false),
        }
    }

    /// Gives back `head` and every buffer taken after it: the next `take` takes
    /// them again. Their used entries must not have been recorded.
    pub fn rewind(&mut self, head: &Head) {
        match self {
            Vq::Split { ring, pending } => {
                let back = (ring.next_avail - Wrapping(head.at)).0;
                ring.unpop(back);
                *pending = pending.map(|n| n + back);
            }
            Vq::Packed { ring, store } => {
                if let Some((start, ..)) = head.walked {
                    store.truncate(start as usize);
                }
                let to = Pos::from_base(head.at, ring.size).unwrap_or(ring.next_avail);
                ring.rewind(to);
            }
        }
    }

    /// Forgets the descriptors kept for `walk` (at the start of a batch).
    pub fn clear(&mut self) {
        if let Vq::Packed { store, .. } = self {
            store.clear();
        }
    }

    /// Records `head`'s used entry with `len` bytes written. `false` if it cannot
    /// go back (a split head outside the table, an unmapped used entry).
    #[inline(always)]
    pub fn put_used(&mut self, hm: &HostMem<'_>, head: &Head, len: u32) -> bool {
        match self {
            Vq::Split { ring, .. } => ring.put_used(hm, head.id, len),
            Vq::Packed { ring, .. } => ring.put_used(hm, head.id, head.slots, len),
        }
    }

    /// Makes the used entries recorded so far visible to the driver.
    pub fn publish_used(&mut self, hm: &HostMem<'_>) -> bool {
        match self {
            Vq::Split { ring, .. } => ring.publish_used(hm),
            Vq::Packed { ring, .. } => ring.publish_used(hm),
        }
    }

    /// Where the used side stands now.
    pub fn used_pos(&self) -> UsedPos {
        match self {
            Vq::Split { ring, .. } => UsedPos::Split(ring.next_used),
            Vq::Packed { ring, .. } => UsedPos::Packed(ring.used_mark()),
        }
    }

    /// Forgets the used entries recorded since `p` (before they are published).
    pub fn rewind_used(&mut self, p: UsedPos) {
        match (self, p) {
            (Vq::Split { ring, .. }, UsedPos::Split(at)) => ring.next_used = at,
            (Vq::Packed { ring, .. }, UsedPos::Packed(m)) => ring.rewind_used(m),
            _ => {}
        }
    }

    /// Asks the driver to kick when it adds buffers past those it has now (an RX
    /// queue whose buffers were too few for a frame): `SplitRing::ask_kick`;
    /// `PackedRing::ask_kick` (with EVENT_IDX at the first slot not available). True
    /// when buffers may have come meanwhile (worth another try); `None` for an
    /// unmapped ring.
    pub fn ask_kick(&self, hm: &HostMem<'_>) -> Option<bool> {
        match self {
            Vq::Split { ring, .. } => ring.ask_kick(hm),
            Vq::Packed { ring, .. } => ring.ask_kick(hm),
        }
    }

    /// Whether the driver wants a call for what was published since `since`.
    pub fn wants_call(&self, hm: &HostMem<'_>, since: UsedPos) -> bool {
        match (self, since) {
            (Vq::Split { ring, .. }, UsedPos::Split(at)) => ring.wants_call(hm, at),
            (Vq::Packed { ring, .. }, UsedPos::Packed(m)) => ring.wants_call(hm, m.pos()),
            // Positions of the other layout: a reset in between; call.
            _ => true,
        }
    }
}

/// `Vq::take_writable` on a packed ring. Out of line: the split ring's is the one
/// callers inline.
#[inline(never)]
fn packed_single_writable(
    ring: &mut PackedRing,
    store: &mut Vec<Desc>,
    hm: &HostMem<'_>,
    need: usize,
) -> Option<(Head, Desc)> {
    let (at, id, d) = ring.take_single_writable(hm, need)?;
    // Kept as `take` keeps a walked buffer's, for a `walk` or `rewind`.
    let start = store.len() as u32;
    store.push(d);
    let head = Head {
        at: at.to_base(),
        id,
        slots: 1,
        walked: Some((start, 1, WalkEnd::Complete, false)),
    };
    Some((head, d))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ring::tx::{chain_bytes, copy_chain, tx_buffer};
    use crate::ring::GuestMem;
    use crate::testkit::packed_driver::Driver;
    use crate::vnet_hdr::{VirtioNetHdr, HDR_LEN};
    use virtio_bindings::virtio_ring::VRING_DESC_F_NEXT;
    use virtio_queue::desc::{split::Descriptor, RawDescriptor};
    use virtio_queue::mock::MockSplitQueue;
    use virtio_queue::Queue;
    use vm_memory::{Bytes, GuestAddress};

    fn mem() -> GuestMem {
        GuestMem::from_ranges(&[(GuestAddress(0), 0x40000)]).unwrap()
    }

    /// Frame `i` as the guest wrote it: a header, then 60 + i bytes of `i`.
    fn frame(i: u8) -> Vec<u8> {
        let mut f = VirtioNetHdr::default().to_bytes().to_vec();
        f.extend(std::iter::repeat_n(i, 60 + usize::from(i)));
        f
    }

    /// What a TX batch does through the `Vq` interface: take up to `budget`
    /// buffers, walk them, give back the last one taken, copy the rest out,
    /// record their used entries and publish. Returns the frames' bytes.
    fn drain(vq: &mut Vq, hm: &HostMem<'_>, budget: usize) -> Vec<Vec<u8>> {
        vq.clear();
        let mut heads = Vec::new();
        while heads.len() < budget {
            let Some(h) = vq.take(hm, 16) else { break };
            heads.push(h);
        }
        // The last one does not fit this batch.
        if heads.len() == budget {
            let last = heads.pop().unwrap();
            vq.rewind(&last);
        }
        let mut out = Vec::new();
        for h in &heads {
            let mut descs = Vec::new();
            let (end, _) = vq.walk(hm, h, 16, &mut descs, false);
            let total = chain_bytes(&descs, end, 16).unwrap();
            let mut buf = tx_buffer();
            let f = copy_chain(hm, &descs, total, HDR_LEN, &mut buf).unwrap();
            out.push(buf[..f.start + f.len].to_vec());
            assert!(vq.put_used(hm, h, 0));
        }
        assert!(vq.publish_used(hm));
        out
    }

    #[test]
    fn a_tx_drain_reads_the_same_frames_from_either_layout() {
        let m = mem();
        let hm = HostMem::new(&m);
        let frames: Vec<Vec<u8>> = (0..6).map(frame).collect();
        // Each frame in two descriptors: its header, then its bytes.
        let place = |i: usize| (0x10000 + 0x1000 * i as u64, 0x18000 + 0x1000 * i as u64);
        for (i, f) in frames.iter().enumerate() {
            let (h, b) = place(i);
            m.write_slice(&f[..HDR_LEN], GuestAddress(h)).unwrap();
            m.write_slice(&f[HDR_LEN..], GuestAddress(b)).unwrap();
        }

        // Split.
        let mock = MockSplitQueue::new(&m, 16);
        let mut descs = Vec::new();
        for (i, f) in frames.iter().enumerate() {
            let (h, b) = place(i);
            let n = 2 * i as u16;
            descs.push(RawDescriptor::from(Descriptor::new(
                h,
                HDR_LEN as u32,
                VRING_DESC_F_NEXT as u16,
                n + 1,
            )));
            descs.push(RawDescriptor::from(Descriptor::new(
                b,
                (f.len() - HDR_LEN) as u32,
                0,
                0,
            )));
        }
        mock.build_multiple_desc_chains(&descs).unwrap();
        let mut q: Queue = mock.create_queue().unwrap();
        let mut split_got = Vec::new();
        for _ in 0..3 {
            let mut vq = Vq::of(&q, false);
            split_got.extend(drain(&mut vq, &hm, 3));
            vq.store(&mut q);
        }
        assert_eq!(split_got, frames);
        assert_eq!(mock.used().idx().load(), 6);

        // Packed, in the same memory, a ring of 8 (the chains cross its end).
        let mut d = Driver::new(&m, 0x8000, 8);
        let mut packed_got = Vec::new();
        let mut pos = Pos::START;
        let mut next = 0;
        while packed_got.len() < frames.len() {
            while next < frames.len() && d.in_flight() < 3 {
                let (h, b) = place(next);
                let len = (frames[next].len() - HDR_LEN) as u32;
                d.add(&m, &[(h, HDR_LEN as u32, false), (b, len, false)]);
                next += 1;
            }
            let mut vq = Vq::Packed {
                ring: PackedRing::new(d.ring, d.driver_area, d.device_area, 8, false),
                store: Vec::new(),
            };
            if let Vq::Packed { ring, .. } = &mut vq {
                ring.next_avail = pos;
                ring.next_used = pos;
            }
            packed_got.extend(drain(&mut vq, &hm, 3));
            if let Vq::Packed { ring, .. } = &vq {
                assert_eq!(ring.next_used, ring.next_avail);
                pos = ring.next_avail;
            }
            while d.get_used(&m).is_some() {}
        }
        assert_eq!(packed_got, frames);
        // Six chains of two slots in a ring of eight: a lap and a half.
        assert_eq!(
            pos,
            Pos {
                idx: 4,
                wrap: false
            }
        );
    }

    #[test]
    fn positions_go_back_alike() {
        let m = mem();
        let hm = HostMem::new(&m);
        let mock = MockSplitQueue::new(&m, 16);
        let descs: Vec<RawDescriptor> = (0..4)
            .map(|i| RawDescriptor::from(Descriptor::new(0x10000 + 0x100 * i, 64, 0, 0)))
            .collect();
        mock.build_multiple_desc_chains(&descs).unwrap();
        let q: Queue = mock.create_queue().unwrap();
        let mut vq = Vq::of(&q, false);
        let a = vq.take(&hm, 16).unwrap();
        let b = vq.take(&hm, 16).unwrap();
        vq.rewind(&a);
        assert_eq!(vq.take(&hm, 16), Some(a));
        assert_eq!(vq.take(&hm, 16), Some(b));
        let used = vq.used_pos();
        assert!(vq.put_used(&hm, &a, 1));
        vq.rewind_used(used);
        assert_eq!(vq.used_pos(), used);
        // Four available, four taken, then none.
        assert!(vq.take(&hm, 16).is_some() && vq.take(&hm, 16).is_some());
        assert_eq!(vq.take(&hm, 16), None);
        assert!(!vq.wants_call(&hm, used));
    }
}

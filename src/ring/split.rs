//! A split virtqueue as the datapath works it, one batch at a time: the avail index
//! read once, heads taken and their chains walked through `HostMem`, used entries
//! written one by one and the used index moved once, the guest's wish for a call
//! decided once (EVENT_IDX, or VRING_AVAIL_F_NO_INTERRUPT without it).
//!
//! virtio-queue keeps the queue's addresses and positions (the frontend sets and reads
//! them through vhost-user); `SplitRing` copies them out under the vring's lock and
//! puts `next_avail` and `next_used` back before the lock is released, so
//! GET_VRING_BASE, a reconnect or a migration sees exactly what was consumed.
//!
//! Chains are walked with virtio-queue's rules (the fuzz target checks the two walk
//! alike): at most `size` descriptors in the table, at most the table's length in an
//! indirect table, no indirect table inside one, a next index inside its table, at
//! most `u32::MAX` bytes in all (VIRTIO 1.2, 2.7.5.2: a driver must not add a chain
//! longer than 2^32 bytes).

use std::num::Wrapping;
use std::sync::atomic::Ordering;

use virtio_bindings::virtio_ring::{
    VRING_AVAIL_F_NO_INTERRUPT, VRING_DESC_F_INDIRECT, VRING_DESC_F_NEXT, VRING_DESC_F_WRITE,
    VRING_USED_F_NO_NOTIFY,
};
use virtio_queue::QueueT;

use super::host::HostMem;

/// Avail ring: flags, idx, then `size` u16 entries, then used_event (EVENT_IDX).
const AVAIL_HEADER: u64 = 4;
/// Used ring: flags, idx, then `size` 8-byte elements, then avail_event.
const USED_HEADER: u64 = 4;
const USED_ELEM: u64 = 8;
const DESC_SIZE: u64 = 16;
/// Largest indirect table virtio-queue follows (its length in a u16 of entries).
const MAX_INDIRECT: u64 = u16::MAX as u64;

/// One descriptor as read from guest memory.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Desc {
    pub addr: u64,
    pub len: u32,
    pub flags: u16,
    pub next: u16,
}

impl Desc {
    fn parse(raw: [u8; 16]) -> Desc {
        Desc {
            addr: u64::from_le_bytes(raw[0..8].try_into().unwrap_or_default()),
            len: u32::from_le_bytes(raw[8..12].try_into().unwrap_or_default()),
            flags: u16::from_le_bytes([raw[12], raw[13]]),
            next: u16::from_le_bytes([raw[14], raw[15]]),
        }
    }

    pub fn has_next(&self) -> bool {
        self.flags & VRING_DESC_F_NEXT as u16 != 0
    }

    pub fn is_write_only(&self) -> bool {
        self.flags & VRING_DESC_F_WRITE as u16 != 0
    }

    pub fn is_indirect(&self) -> bool {
        self.flags & VRING_DESC_F_INDIRECT as u16 != 0
    }
}

/// How a chain walk ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WalkEnd {
    /// The last descriptor had no NEXT.
    Complete,
    /// The walk stopped at a descriptor that still pointed on (a bad next index, a
    /// loop that used up the table, an indirect table inside one or a bad one).
    Broken,
    /// More descriptors than `max` (the caller's bound).
    TooMany,
    /// A descriptor (or indirect table) is not in guest memory.
    Unreadable,
}

/// The walk of one chain: its descriptors in order, up to `max`, appended to `out`.
/// Indirect tables are followed (when `allow_indirect`) exactly as virtio-queue does.
/// Returns how it ended and whether the head itself pointed at an indirect table.
pub fn walk_chain(
    hm: &HostMem<'_>,
    table: u64,
    size: u16,
    head: u16,
    max: usize,
    out: &mut Vec<Desc>,
) -> WalkEnd {
    walk_chain_from(hm, table, size, head, None, max, out)
}

/// `walk_chain`, given the head descriptor if the caller has read it already.
#[inline(never)]
fn walk_chain_from(
    hm: &HostMem<'_>,
    table: u64,
    size: u16,
    head: u16,
    mut first: Option<Desc>,
    max: usize,
    out: &mut Vec<Desc>,
) -> WalkEnd {
    let start = out.len();
    let mut table = table;
    let mut table_len = u64::from(size);
    let mut ttl = u64::from(size);
    let mut index = u64::from(head);
    let mut indirect = false;
    // Bytes of the descriptors so far: virtio-queue ends the chain, without the
    // descriptor, where they would pass `u32::MAX`.
    let mut bytes = 0u32;
    loop {
        if ttl == 0 || index >= table_len {
            // virtio-queue ends the chain silently here; whatever came before shows
            // it by its NEXT flag.
            // A chain without a single descriptor is broken too.
            return if out.len() == start || out.last().is_some_and(|d| d.has_next()) {
                WalkEnd::Broken
            } else {
                WalkEnd::Complete
            };
        }
        let d = match first.take() {
            Some(d) => d,
            None => {
                let Some(at) = table.checked_add(index * DESC_SIZE) else {
                    return WalkEnd::Unreadable;
                };
                let Some(raw) = hm.read_array::<16>(at) else {
                    return WalkEnd::Unreadable;
                };
                Desc::parse(raw)
            }
        };
        if d.is_indirect() {
            let n = u64::from(d.len) / DESC_SIZE;
            if indirect || !u64::from(d.len).is_multiple_of(DESC_SIZE) || n > MAX_INDIRECT {
                return WalkEnd::Broken;
            }
            indirect = true;
            table = d.addr;
            table_len = n;
            ttl = n;
            index = 0;
            continue;
        }
        let Some(more) = bytes.checked_add(d.len) else {
            // Longer than 2^32 bytes: the descriptor before still points on.
            return WalkEnd::Broken;
        };
        bytes = more;
        if out.len() - start == max {
            return WalkEnd::TooMany;
        }
        out.push(d);
        if d.has_next() {
            index = u64::from(d.next);
            ttl -= 1;
        } else {
            return WalkEnd::Complete;
        }
    }
}

/// Whether the head descriptor of chain `head` points at an indirect table.
pub fn head_is_indirect(hm: &HostMem<'_>, table: u64, size: u16, head: u16) -> bool {
    if head >= size {
        return false;
    }
    hm.read_array::<16>(table + u64::from(head) * DESC_SIZE)
        .map(|raw| Desc::parse(raw).is_indirect())
        .unwrap_or(false)
}

/// A split ring's addresses and positions, taken from the vring for one batch.
#[derive(Clone, Copy, Debug)]
pub struct SplitRing {
    pub desc: u64,
    pub avail: u64,
    pub used: u64,
    pub size: u16,
    pub next_avail: Wrapping<u16>,
    pub next_used: Wrapping<u16>,
    pub event_idx: bool,
    /// The avail index as last read (`pending_cached`), if the caller kept it.
    pub avail_seen: Option<Wrapping<u16>>,
    /// A TX batch's chains go back as one used element (`put_used_in_order`):
    /// VIRTIO_F_IN_ORDER was acked.
    pub batch_used: bool,
}

impl SplitRing {
    pub fn of<Q: QueueT>(q: &Q) -> SplitRing {
        SplitRing {
            desc: q.desc_table(),
            avail: q.avail_ring(),
            used: q.used_ring(),
            size: q.size(),
            next_avail: Wrapping(q.next_avail()),
            next_used: Wrapping(q.next_used()),
            event_idx: q.event_idx_enabled(),
            avail_seen: None,
            batch_used: false,
        }
    }

    /// The ring slot of position `pos`. A split ring's size is a power of two
    /// (virtio-queue refuses any other), so this is a mask, not a division, three
    /// times per frame; the division stays for any other size.
    fn slot(&self, pos: Wrapping<u16>) -> u64 {
        let s = self.size;
        u64::from(if s.is_power_of_two() {
            pos.0 & (s - 1)
        } else {
            pos.0 % s
        })
    }

    /// A ring just started: where it starts. SET_VRING_BASE set the avail
    /// position to the frontend's base, SET_VRING_ADDR the used one to the used
    /// index in guest memory (vhost-user-backend). A base that is not the used
    /// index does not say where the driver is; the used index does, so the ring
    /// starts there, as DPDK's vhost library does, and the base put aside is
    /// given back. QEMU sends the used index anyway (after a stop, and after a
    /// backend that went away); DPDK's virtio_user in server mode sends 0 after
    /// it reconnects, however far its ring has gone.
    pub fn start_at_used(&mut self) -> Option<u16> {
        let base = self.next_avail;
        (base != self.next_used).then(|| {
            self.next_avail = self.next_used;
            base.0
        })
    }

    /// Puts the positions back into the vring's queue.
    pub fn store<Q: QueueT>(&self, q: &mut Q) {
        q.set_next_avail(self.next_avail.0);
        q.set_next_used(self.next_used.0);
    }

    /// The guest's avail index (`Acquire`: the entries before it are visible).
    pub fn avail_idx(&self, hm: &HostMem<'_>) -> Option<Wrapping<u16>> {
        hm.load_u16(self.avail + 2, Ordering::Acquire).map(Wrapping)
    }

    /// Chains the guest has made available and we have not taken, if the avail index
    /// is at most a queue ahead; `None` for a broken ring (or an unmapped one).
    pub fn pending(&self, hm: &HostMem<'_>) -> Option<u16> {
        let n = (self.avail_idx(hm)? - self.next_avail).0;
        (n <= self.size && self.size > 0).then_some(n)
    }

    /// `pending`, from the avail index read last while that still shows chains
    /// past `next_avail`: the line the driver writes is read once per run of
    /// buffers, not once per frame (an RX queue written by a batch of frames).
    pub fn pending_cached(&mut self, hm: &HostMem<'_>) -> Option<u16> {
        if let Some(seen) = self.avail_seen {
            let n = (seen - self.next_avail).0;
            if n > 0 && n <= self.size {
                return Some(n);
            }
        }
        self.pending_fresh(hm)
    }

    /// `pending`, the avail index read anew (and kept for `pending_cached`).
    pub fn pending_fresh(&mut self, hm: &HostMem<'_>) -> Option<u16> {
        self.avail_seen = None;
        let idx = self.avail_idx(hm)?;
        let n = (idx - self.next_avail).0;
        if n <= self.size && self.size > 0 {
            self.avail_seen = Some(idx);
            Some(n)
        } else {
            None
        }
    }

    /// Takes the next available head (the caller knows from `pending` that there is
    /// one). `None` if the avail ring is not readable.
    #[inline]
    pub fn pop(&mut self, hm: &HostMem<'_>) -> Option<u16> {
        let slot = self.slot(self.next_avail);
        let head = hm.load_u16(self.avail + AVAIL_HEADER + 2 * slot, Ordering::Relaxed)?;
        self.next_avail += 1;
        Some(head)
    }

    /// Takes the next available chain if it is one device-writable descriptor of at
    /// least `need` bytes (not indirect), returning its head and its buffer's address;
    /// otherwise takes nothing (the caller walks it as any chain). The caller knows
    /// from `pending` that a chain is available.
    #[inline]
    pub fn take_single_writable(&mut self, hm: &HostMem<'_>, need: usize) -> Option<(u16, Desc)> {
        let slot = self.slot(self.next_avail);
        let head = hm.load_u16(self.avail + AVAIL_HEADER + 2 * slot, Ordering::Relaxed)?;
        if head >= self.size {
            return None;
        }
        let d = Desc::parse(hm.read_array::<16>(self.desc + u64::from(head) * DESC_SIZE)?);
        let single = !d.has_next() && !d.is_indirect() && d.is_write_only();
        if !single || (d.len as usize) < need {
            return None;
        }
        self.next_avail += 1;
        Some((head, d))
    }

    /// Starts loading the first lines of the available buffers `skip..skip + n`
    /// places past the next (the caller has seen them available) and of their used
    /// elements, ahead of the frames written into them: their lines were last
    /// written by the frontend's CPU. Only hints (`HostMem::prefetch`); nothing is
    /// taken.
    pub fn prefetch_writes(&self, hm: &HostMem<'_>, skip: u16, n: u16) {
        for i in skip..skip.saturating_add(n) {
            let slot = self.slot(self.next_avail + Wrapping(i));
            let Some(head) = hm.load_u16(self.avail + AVAIL_HEADER + 2 * slot, Ordering::Relaxed)
            else {
                return;
            };
            if head < self.size {
                if let Some(d) = hm.read_array::<16>(self.desc + u64::from(head) * DESC_SIZE) {
                    let d = Desc::parse(d);
                    hm.prefetch(d.addr, d.len as usize);
                }
            }
            // A used element's line once, from its first element on.
            let used = self.used_elem(self.next_used + Wrapping(i));
            if i == skip || used % 64 < USED_ELEM {
                hm.prefetch(used, USED_ELEM as usize);
            }
        }
    }

    /// Starts loading head `head`'s descriptor (see `HostMem::prefetch`).
    #[inline]
    pub fn prefetch_desc(&self, hm: &HostMem<'_>, head: u16) {
        if head < self.size {
            hm.prefetch(self.desc + u64::from(head) * DESC_SIZE, DESC_SIZE as usize);
        }
    }

    /// `walk_chain` of chain `head` in this ring's table. A chain of one descriptor
    /// (no NEXT, no indirect table: how most frames come) is taken without the
    /// walk's general loop, and a longer one is walked on from the head descriptor
    /// read for that, not read again.
    #[inline]
    pub fn walk(&self, hm: &HostMem<'_>, head: u16, max: usize, out: &mut Vec<Desc>) -> WalkEnd {
        let first = (head < self.size)
            .then(|| self.desc.checked_add(u64::from(head) * DESC_SIZE))
            .flatten()
            .and_then(|at| hm.read_array::<16>(at))
            .map(Desc::parse);
        let chained = (VRING_DESC_F_NEXT | VRING_DESC_F_INDIRECT) as u16;
        match first {
            Some(d) if d.flags & chained == 0 && max > 0 => {
                out.push(d);
                WalkEnd::Complete
            }
            _ => walk_chain_from(hm, self.desc, self.size, head, first, max, out),
        }
    }

    /// Gives back the last `n` heads taken (a frame that did not fit).
    pub fn unpop(&mut self, n: u16) {
        self.next_avail -= n;
    }

    /// Where the used element of position `pos` lies.
    fn used_elem(&self, pos: Wrapping<u16>) -> u64 {
        self.used + USED_HEADER + self.slot(pos) * USED_ELEM
    }

    /// How far the avail position is past the used one: the heads outside the
    /// table skipped without a used entry, or a frontend's base since the ring
    /// started (`start_at_used`).
    pub fn gap(&self) -> u16 {
        (self.next_avail - self.next_used).0
    }

    /// Writes used element `head`/`len` at the next used slot, without publishing it.
    /// A head outside the table is not written (no used entry can name it).
    #[inline(always)]
    pub fn put_used(&mut self, hm: &HostMem<'_>, head: u16, len: u32) -> bool {
        if head >= self.size {
            return false;
        }
        if !hm.store_used_elem(self.used_elem(self.next_used), u32::from(head), len) {
            return false;
        }
        self.next_used += 1;
        true
    }

    /// Hands back `heads`, taken in this order, as one used element (VIRTIO_F_IN_ORDER,
    /// 2.7.9 "In-order use of descriptors"): the last head's id, length 0, in the
    /// first head's used slot, and the used position past all of them. A head
    /// outside the table is skipped, as `put_used` skips it. Returns the heads not
    /// handed back: those skipped, or all of them if the used slot is not mapped.
    /// For a TX ring, whose driver reads no length.
    pub fn put_used_in_order(
        &mut self,
        hm: &HostMem<'_>,
        heads: impl Iterator<Item = u16>,
    ) -> usize {
        let first = self.next_used;
        let (mut last, mut taken, mut skipped) = (None, 0u16, 0);
        for head in heads {
            if head >= self.size {
                skipped += 1;
            } else {
                last = Some(head);
                taken += 1;
            }
        }
        let Some(last) = last else {
            return skipped;
        };
        if !hm.store_used_elem(self.used_elem(first), u32::from(last), 0) {
            return skipped + usize::from(taken);
        }
        self.next_used += taken;
        skipped
    }

    /// Publishes every used element written so far (`Release`: the elements and the
    /// buffers' bytes are visible before the index).
    pub fn publish_used(&self, hm: &HostMem<'_>) -> bool {
        hm.store_u16(self.used + 2, self.next_used.0, Ordering::Release)
            .is_some()
    }

    /// Asks the guest to kick when it makes buffers available past those it has now:
    /// an RX queue whose buffers were too few for a frame. With EVENT_IDX the wish
    /// (avail_event) goes at the avail index as it is now, not at `next_avail`: the
    /// buffers in between were looked at and are too few for the frame, and a wish
    /// behind them is past already, so the guest would never kick again. Without it,
    /// VRING_USED_F_NO_NOTIFY is cleared. True when the guest added buffers meanwhile
    /// (worth another try); `None` for an unmapped ring.
    pub fn ask_kick(&self, hm: &HostMem<'_>) -> Option<bool> {
        let seen = self.avail_idx(hm)?;
        if self.event_idx {
            let at = self.used + USED_HEADER + USED_ELEM * u64::from(self.size);
            hm.store_u16(at, seen.0, Ordering::Relaxed)?;
        } else {
            let flags = hm.load_u16(self.used, Ordering::Relaxed)?;
            hm.store_u16(
                self.used,
                flags & !(VRING_USED_F_NO_NOTIFY as u16),
                Ordering::Relaxed,
            )?;
        }
        // Our wish stored before the avail index is read again (the guest stores its
        // index, then reads the wish).
        super::host::store_load_fence();
        Some(self.avail_idx(hm)? != seen)
    }

    /// Whether the guest wants a call for the used entries published since the used
    /// index was `since`: EVENT_IDX's used_event inside (since, next_used], or without
    /// EVENT_IDX, no VRING_AVAIL_F_NO_INTERRUPT. An unreadable ring asks for a call.
    pub fn wants_call(&self, hm: &HostMem<'_>, since: Wrapping<u16>) -> bool {
        let now = self.next_used;
        if now == since {
            return false;
        }
        // Our used index store before the guest's used_event / flags load.
        super::host::store_load_fence();
        if self.event_idx {
            let at = self.avail + AVAIL_HEADER + 2 * u64::from(self.size);
            let Some(event) = hm.load_u16(at, Ordering::Relaxed) else {
                return true;
            };
            // The window since the last decision, more than a ring back: a reset or
            // a position the frontend set; call rather than guess.
            if (now - since).0 > self.size {
                return true;
            }
            (now - Wrapping(event) - Wrapping(1)) < (now - since)
        } else {
            hm.load_u16(self.avail, Ordering::Relaxed)
                .is_none_or(|flags| flags & VRING_AVAIL_F_NO_INTERRUPT as u16 == 0)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ring::vq::Vq;
    use crate::ring::GuestMem;
    use virtio_queue::desc::{split::Descriptor, RawDescriptor};
    use virtio_queue::mock::MockSplitQueue;
    use virtio_queue::Queue;
    use vm_memory::{Bytes, GuestAddress};

    const N: u16 = VRING_DESC_F_NEXT as u16;

    fn mem() -> GuestMem {
        GuestMem::from_ranges(&[(GuestAddress(0), 0x40000)]).unwrap()
    }

    fn chain(mock: &MockSplitQueue<GuestMem>, descs: &[(u64, u32, u16)]) {
        let raw: Vec<RawDescriptor> = descs
            .iter()
            .enumerate()
            .map(|(i, &(a, l, f))| RawDescriptor::from(Descriptor::new(a, l, f, i as u16 + 1)))
            .collect();
        mock.build_desc_chain(&raw).unwrap();
    }

    /// A prefetch ahead takes nothing, whatever the avail ring names: heads outside
    /// the table, buffers outside guest memory or as long as can be, positions
    /// past the end of the ring.
    #[test]
    fn prefetching_ahead_takes_nothing_from_any_ring() {
        let m = mem();
        let mock = MockSplitQueue::new(&m, 16);
        chain(&mock, &[(0x3_ff00, u32::MAX, VRING_DESC_F_WRITE as u16)]);
        chain(&mock, &[(u64::MAX - 8, 64, VRING_DESC_F_WRITE as u16)]);
        chain(&mock, &[(0x9000, 100, VRING_DESC_F_WRITE as u16)]);
        let avail = mock.avail_addr().0 + 4;
        m.write_obj(999u16, GuestAddress(avail + 2 * 2)).unwrap();
        let q: Queue = mock.create_queue().unwrap();
        let h = HostMem::new(&m);
        let mut vq = Vq::of(&q, false);
        assert_eq!(vq.pending_cached(&h), Some(3));
        let before = format!("{vq:?}");
        for (skip, n) in [
            (0, 3),
            (0, 16),
            (2, 1),
            (15, 8),
            (usize::MAX, 1),
            (0, usize::MAX),
        ] {
            vq.prefetch_writes(&h, skip, n);
        }
        assert_eq!(format!("{vq:?}"), before);
    }

    #[test]
    fn pops_and_walks_what_virtio_queue_pops_and_walks() {
        let m = mem();
        let mock = MockSplitQueue::new(&m, 16);
        chain(&mock, &[(0x8000, 12, N), (0x9000, 100, 0)]);
        let mut q: Queue = mock.create_queue().unwrap();
        let h = HostMem::new(&m);
        let mut r = SplitRing::of(&q);
        assert_eq!(r.pending(&h), Some(1));
        let head = r.pop(&h).unwrap();
        let mut out = Vec::new();
        assert_eq!(
            walk_chain(&h, r.desc, r.size, head, 16, &mut out),
            WalkEnd::Complete
        );
        let theirs: Vec<_> = q.pop_descriptor_chain(&m).unwrap().collect();
        assert_eq!(out.len(), theirs.len());
        for (a, b) in out.iter().zip(&theirs) {
            assert_eq!((a.addr, a.len, a.flags), (b.addr().0, b.len(), b.flags()));
        }
        assert!(r.put_used(&h, head, 7));
        assert!(r.publish_used(&h));
        assert_eq!(mock.used().idx().load(), 1);
        let e = mock.used().ring().ref_at(0).unwrap().load();
        assert_eq!((e.id(), e.len()), (u32::from(head), 7));
        r.store(&mut q);
        assert_eq!((q.next_avail(), q.next_used()), (1, 1));
    }

    #[test]
    fn a_start_at_a_base_that_is_not_the_used_index_starts_at_the_used_index() {
        let m = mem();
        let h = HostMem::new(&m);
        let mock = MockSplitQueue::new(&m, 16);
        let mut q: Queue = mock.create_queue().unwrap();
        // A driver far into its ring (3 chains waiting) whose frontend sent base 0;
        // SET_VRING_ADDR took the used index from guest memory.
        mock.avail().idx().store(40_003);
        mock.used().idx().store(40_000);
        q.set_next_avail(0);
        q.set_next_used(40_000);
        assert_eq!(SplitRing::of(&q).pending(&h), None);
        let mut vq = Vq::of(&q, false);
        assert_eq!(vq.start_at_used(0, &mut q), Some((0, 40_000)));
        assert_eq!((q.next_avail(), q.next_used()), (40_000, 40_000));
        assert_eq!(vq.pending_fresh(&h), Some(3));
        assert_eq!(vq.split_gap(), Some(0));
        // A base that is the used index (QEMU's) is nothing to say.
        assert_eq!(Vq::of(&q, false).start_at_used(0, &mut q), None);
        // Nor is one as far past it as the ring was left: heads outside the
        // table skipped without a used entry.
        q.set_next_avail(40_002);
        assert_eq!(Vq::of(&q, false).start_at_used(2, &mut q), None);
        assert_eq!(q.next_avail(), 40_002);
        // Any other is: the ring starts at the used index.
        assert_eq!(
            Vq::of(&q, false).start_at_used(1, &mut q),
            Some((40_002, 40_000))
        );
        assert_eq!(q.next_avail(), 40_000);
    }

    #[test]
    fn an_in_order_batch_goes_back_as_one_used_element_in_its_first_slot() {
        let m = mem();
        let h = HostMem::new(&m);
        let mock = MockSplitQueue::new(&m, 16);
        let mut q: Queue = mock.create_queue().unwrap();
        q.set_next_avail(14);
        q.set_next_used(14);
        let mut r = SplitRing::of(&q);
        // Across the ring's end; a head outside the table is skipped.
        assert_eq!(r.put_used_in_order(&h, [3, 7, 99, 5].into_iter()), 1);
        assert_eq!(r.next_used.0, 17);
        assert!(r.publish_used(&h));
        assert_eq!(mock.used().idx().load(), 17);
        let e = mock.used().ring().ref_at(14).unwrap().load();
        assert_eq!((e.id(), e.len()), (5, 0));
        for slot in [15, 0] {
            assert_eq!(
                mock.used().ring().ref_at(slot).unwrap().load().id(),
                0,
                "slot {slot}"
            );
        }
        // Nothing to hand back but a bad head: nothing written, nothing moved.
        assert_eq!(r.put_used_in_order(&h, [16].into_iter()), 1);
        assert_eq!(r.next_used.0, 17);
    }

    #[test]
    fn the_kept_avail_index_is_read_again_only_when_it_shows_nothing_left() {
        let m = GuestMem::from_ranges(&[(GuestAddress(0), 0x10000)]).unwrap();
        let h = HostMem::new(&m);
        let mock = MockSplitQueue::new(&m, 16);
        let q: Queue = mock.create_queue().unwrap();
        let mut r = SplitRing::of(&q);
        mock.avail().idx().store(2);
        assert_eq!(r.pending_cached(&h), Some(2));
        // The driver posts more: the kept index still shows chains, so it is used.
        mock.avail().idx().store(5);
        assert_eq!(r.pending_cached(&h), Some(2));
        r.next_avail += 2;
        // Nothing left by the kept index: read anew.
        assert_eq!(r.pending_cached(&h), Some(3));
        assert_eq!(r.pending_fresh(&h), Some(3));
        // An index more than a queue ahead is refused and nothing is kept.
        mock.avail().idx().store(40);
        r.next_avail += 3;
        assert_eq!(r.pending_cached(&h), None);
        assert_eq!(r.avail_seen, None);
    }

    #[test]
    fn an_avail_index_more_than_a_queue_ahead_is_out_of_range() {
        let m = GuestMem::from_ranges(&[(GuestAddress(0), 0x10000)]).unwrap();
        let h = HostMem::new(&m);
        let mock = MockSplitQueue::new(&m, 16);
        let q: Queue = mock.create_queue().unwrap();
        let r = SplitRing::of(&q);
        assert_eq!(r.pending(&h), Some(0));
        mock.avail().idx().store(16);
        assert_eq!(r.pending(&h), Some(16));
        mock.avail().idx().store(17);
        assert_eq!(r.pending(&h), None);
        mock.avail().idx().store(0xffff);
        assert_eq!(r.pending(&h), None);
    }

    #[test]
    fn loops_bad_indexes_and_nested_indirect_tables_are_broken() {
        let m = mem();
        let h = HostMem::new(&m);
        let mock = MockSplitQueue::new(&m, 4);
        // A loop: 0 -> 1 -> 0 ...
        let table = mock.desc_table_addr().0;
        for (i, next) in [(0u64, 1u16), (1, 0)] {
            let d = RawDescriptor::from(Descriptor::new(0x8000, 10, N, next));
            m.write_obj(d, GuestAddress(table + 16 * i)).unwrap();
        }
        let mut out = Vec::new();
        assert_eq!(walk_chain(&h, table, 4, 0, 64, &mut out), WalkEnd::Broken);
        assert_eq!(out.len(), 4);
        out.clear();
        assert_eq!(walk_chain(&h, table, 4, 0, 3, &mut out), WalkEnd::TooMany);
        out.clear();
        assert_eq!(walk_chain(&h, table, 4, 9, 64, &mut out), WalkEnd::Broken);
        // An indirect table whose entry is itself indirect.
        let ind = VRING_DESC_F_INDIRECT as u16;
        m.write_obj(
            RawDescriptor::from(Descriptor::new(0x20000, 32, ind, 0)),
            GuestAddress(0x10000),
        )
        .unwrap();
        m.write_obj(
            RawDescriptor::from(Descriptor::new(0x10000, 16, ind, 0)),
            GuestAddress(0x20000),
        )
        .unwrap();
        out.clear();
        assert_eq!(walk_chain(&h, 0x10000, 1, 0, 64, &mut out), WalkEnd::Broken);
        assert!(head_is_indirect(&h, 0x10000, 1, 0));
        out.clear();
        assert_eq!(
            walk_chain(&h, 0x3ffff0, 1, 0, 64, &mut out),
            WalkEnd::Unreadable
        );
    }

    #[test]
    fn a_chain_longer_than_4_gib_is_broken_where_virtio_queue_ends_it() {
        let m = mem();
        let h = HostMem::new(&m);
        // u32::MAX bytes in all is a chain; one byte more ends it before the last
        // descriptor, which leaves the one before pointing on.
        for (last, want) in [
            (0x7fff_ffffu32, WalkEnd::Complete),
            (0x8000_0000, WalkEnd::Broken),
        ] {
            let mock = MockSplitQueue::new(&m, 16);
            chain(&mock, &[(0x8000, 0x8000_0000, N), (0x9000, last, 0)]);
            let mut q: Queue = mock.create_queue().unwrap();
            let mut out = Vec::new();
            let r = SplitRing::of(&q);
            assert_eq!(walk_chain(&h, r.desc, r.size, 0, 16, &mut out), want);
            let theirs: Vec<_> = q.pop_descriptor_chain(&m).unwrap().collect();
            assert_eq!(out.len(), theirs.len());
            assert_eq!(out.last().unwrap().has_next(), want == WalkEnd::Broken);
        }
    }

    #[test]
    fn event_idx_call_window_matches_virtio_queue() {
        let m = mem();
        let h = HostMem::new(&m);
        let mock = MockSplitQueue::new(&m, 16);
        for used_event in [0u16, 1, 2, 3, 5, 65535] {
            for n in 1..5u16 {
                // virtio-queue's answer for n entries added since the last check.
                let mut theirs: Queue = mock.create_queue().unwrap();
                theirs.set_event_idx(true);
                let _ = theirs.needs_notification(&m);
                for _ in 0..n {
                    theirs.add_used(&m, 0, 0).unwrap();
                }
                let at = mock.avail_addr().0 + 4 + 2 * 16;
                m.write_obj(used_event, GuestAddress(at)).unwrap();
                let want = theirs.needs_notification(&m).unwrap();
                let mut r = SplitRing::of(&theirs);
                r.event_idx = true;
                r.next_used = Wrapping(n);
                assert_eq!(
                    r.wants_call(&h, Wrapping(0)),
                    want,
                    "event {used_event} n {n}"
                );
            }
        }
    }

    #[test]
    fn no_interrupt_flag_is_honoured_without_event_idx() {
        let m = mem();
        let h = HostMem::new(&m);
        let mock = MockSplitQueue::new(&m, 16);
        let q: Queue = mock.create_queue().unwrap();
        let mut r = SplitRing::of(&q);
        r.next_used = Wrapping(1);
        assert!(r.wants_call(&h, Wrapping(0)));
        m.write_obj(VRING_AVAIL_F_NO_INTERRUPT as u16, mock.avail_addr())
            .unwrap();
        assert!(!r.wants_call(&h, Wrapping(0)));
        assert!(!r.wants_call(&h, Wrapping(1)));
    }
}

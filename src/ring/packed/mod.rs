//! A packed virtqueue (VIRTIO 1.2, 2.8) as the datapath works it, one batch at a
//! time: buffers taken off the one descriptor ring, their used entries written in
//! place and made visible together, the driver's wish for a call read from its event
//! suppression structure.
//!
//! The TX batch and the RX writer reach it through `ring::vq::Vq` on a port with
//! `packed=on` whose frontend acked VIRTIO_F_RING_PACKED (docs/architecture.md,
//! "Packed rings").
//!
//! The layout, as the spec gives it:
//! - one ring of `size` 16-byte descriptors (addr u64, len u32, id u16, flags u16);
//!   the driver makes a descriptor available by writing AVAIL = its wrap counter and
//!   USED = the opposite, the device marks it used by writing both equal to its own
//!   wrap counter. Both counters start at 1 and flip each time their index passes
//!   the ring's end;
//! - a buffer is one descriptor, a run of descriptors chained by NEXT in consecutive
//!   slots (across the ring's end, where the wrap counter flips), or one descriptor
//!   pointing at an indirect table (len / 16 entries, no NEXT, no nesting). Its
//!   buffer id is in its last descriptor; the driver makes the first available last;
//! - the device writes one used descriptor per buffer, at its own used position,
//!   and moves that position on by the number of ring slots the buffer took;
//! - the driver area holds the driver's event suppression structure (when it wants a
//!   call), the device area the device's (when it wants a kick): off_wrap (offset,
//!   wrap counter in bit 15) and flags (ENABLE, DISABLE, DESC with EVENT_IDX).
//!
//! vhost-user carries a packed ring's position in a vring base as the index with
//! the wrap counter in bit 15 (`Pos::to_base`); the queue state keeps both positions
//! in that form (`PackedRing::of`, `store`).
//!
//! The driver is untrusted. A buffer is walked with the split ring's bounds: at most
//! `size` ring slots (a longer chain would run into itself), at most the caller's
//! descriptor count, at most `u32::MAX` bytes, an indirect table of at most
//! `MAX_INDIRECT` entries and no indirect table inside a chain or a table. A chain
//! whose next descriptor is not available (the driver must make the rest of a chain
//! available before its first) ends there, broken. Buffer ids mean nothing to the
//! device: a reused id is handed back as given.

use std::sync::atomic::Ordering;

use virtio_bindings::virtio_ring::{
    VRING_DESC_F_INDIRECT, VRING_DESC_F_NEXT, VRING_DESC_F_WRITE, VRING_PACKED_DESC_F_AVAIL,
    VRING_PACKED_DESC_F_USED, VRING_PACKED_EVENT_FLAG_DESC, VRING_PACKED_EVENT_FLAG_DISABLE,
    VRING_PACKED_EVENT_FLAG_ENABLE, VRING_PACKED_EVENT_F_WRAP_CTR,
};
use virtio_queue::QueueT;

use super::host::{store_load_fence, HostMem};
use super::split::{Desc, WalkEnd};

pub mod record;

use record::RecordSlot;

const DESC_SIZE: u64 = 16;
const NEXT: u16 = VRING_DESC_F_NEXT as u16;
/// Offsets in a ring descriptor.
const FLAGS_AT: u64 = 14;
/// Largest indirect table followed (as the split ring's walk).
pub const MAX_INDIRECT: u64 = u16::MAX as u64;

pub const F_AVAIL: u16 = 1 << VRING_PACKED_DESC_F_AVAIL;
pub const F_USED: u16 = 1 << VRING_PACKED_DESC_F_USED;
/// The wrap counter's bit in a vring base and in an event's off_wrap.
pub const WRAP_BIT: u16 = 1 << VRING_PACKED_EVENT_F_WRAP_CTR;
pub const EVENT_ENABLE: u16 = VRING_PACKED_EVENT_FLAG_ENABLE as u16;
pub const EVENT_DISABLE: u16 = VRING_PACKED_EVENT_FLAG_DISABLE as u16;
pub const EVENT_DESC: u16 = VRING_PACKED_EVENT_FLAG_DESC as u16;
/// Flags a descriptor keeps in a walk (`Desc::flags`): NEXT, WRITE, INDIRECT.
const DESC_FLAGS: u16 = 0x7;

/// A position in the ring: a slot and the wrap counter that goes with it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Pos {
    pub idx: u16,
    pub wrap: bool,
}

impl Pos {
    /// Where both sides start (VIRTIO 1.2, 2.8.1: wrap counters start at 1).
    pub const START: Pos = Pos { idx: 0, wrap: true };

    /// `n` slots on (`n` at most `size`), the wrap counter flipped past the end.
    pub fn advance(self, n: u16, size: u16) -> Pos {
        let to = u32::from(self.idx) + u32::from(n);
        if to >= u32::from(size) {
            Pos {
                idx: (to - u32::from(size)) as u16,
                wrap: !self.wrap,
            }
        } else {
            Pos {
                idx: to as u16,
                wrap: self.wrap,
            }
        }
    }

    /// The vring base of vhost-user's GET/SET_VRING_BASE for a packed ring: the
    /// index in bits 0-14, the wrap counter in bit 15.
    pub fn to_base(self) -> u16 {
        self.idx | if self.wrap { WRAP_BIT } else { 0 }
    }

    /// A vring base read back; `None` if its index is outside a ring of `size`.
    pub fn from_base(base: u16, size: u16) -> Option<Pos> {
        let p = Pos {
            idx: base & !WRAP_BIT,
            wrap: base & WRAP_BIT != 0,
        };
        (p.idx < size).then_some(p)
    }

    /// Slots from the start of the last lap with the wrap counter set: positions
    /// of two consecutive laps in one count, modulo `2 * size`.
    fn lap(self, size: u16) -> u32 {
        u32::from(self.idx) + if self.wrap { 0 } else { u32::from(size) }
    }

    /// Slots from `self` forward to `to`, less than `2 * size`.
    pub fn distance(self, to: Pos, size: u16) -> u32 {
        let m = 2 * u32::from(size);
        (to.lap(size) + m - self.lap(size) % m) % m
    }
}

/// Whether a descriptor with `flags` is available under wrap counter `wrap`.
pub fn is_avail(flags: u16, wrap: bool) -> bool {
    (flags & F_AVAIL != 0) == wrap && (flags & F_USED != 0) != wrap
}

/// Whether a descriptor with `flags` is used under wrap counter `wrap` (the
/// driver's reading).
pub fn is_used(flags: u16, wrap: bool) -> bool {
    (flags & F_AVAIL != 0) == wrap && (flags & F_USED != 0) == wrap
}

/// One ring descriptor.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PackedDesc {
    pub addr: u64,
    pub len: u32,
    pub id: u16,
    pub flags: u16,
}

impl PackedDesc {
    pub fn parse(raw: [u8; 16]) -> PackedDesc {
        PackedDesc {
            addr: u64::from_le_bytes(raw[0..8].try_into().unwrap_or_default()),
            len: u32::from_le_bytes(raw[8..12].try_into().unwrap_or_default()),
            id: u16::from_le_bytes([raw[12], raw[13]]),
            flags: u16::from_le_bytes([raw[14], raw[15]]),
        }
    }

    pub fn to_bytes(self) -> [u8; 16] {
        let mut b = [0u8; 16];
        b[0..8].copy_from_slice(&self.addr.to_le_bytes());
        b[8..12].copy_from_slice(&self.len.to_le_bytes());
        b[12..14].copy_from_slice(&self.id.to_le_bytes());
        b[14..16].copy_from_slice(&self.flags.to_le_bytes());
        b
    }

    /// As a walk reports it: NEXT, WRITE and INDIRECT kept, no next index.
    fn walked(self, flags: u16) -> Desc {
        Desc {
            addr: self.addr,
            len: self.len,
            flags,
            next: 0,
        }
    }
}

/// One buffer taken off the ring.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Popped {
    /// Where its first descriptor was.
    pub at: Pos,
    /// Its buffer id (from its last descriptor read).
    pub id: u16,
    /// Ring slots it took: its used entry moves the used position on by as many.
    pub slots: u16,
    /// How its walk ended (`WalkEnd::Complete`, or why its descriptors are not all
    /// there: the caller hands it back unused).
    pub end: WalkEnd,
    /// Its first descriptor pointed at an indirect table.
    pub indirect: bool,
}

/// A used entry between `put_used` and `publish_used`.
#[derive(Clone, Copy, Debug)]
struct Used {
    at: Pos,
    id: u16,
    len: u32,
    /// Ring slots its buffer took (a batch's: all of its buffers').
    slots: u16,
}

impl Used {
    /// Whether the entry of a buffer of `slots` slots at `at` joins this run under
    /// VIRTIO_F_IN_ORDER: it comes right after the run, and the run stays within a
    /// ring of `size` slots.
    fn joined_by(&self, at: Pos, slots: u16, size: u16) -> bool {
        self.at.advance(self.slots, size) == at
            && u32::from(self.slots) + u32::from(slots) <= u32::from(size)
    }
}

/// Where the used side stood, to go back to (`PackedRing::used_mark`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UsedMark {
    pos: Pos,
    unpublished: usize,
}

impl UsedMark {
    /// The used position it marks.
    pub fn pos(self) -> Pos {
        self.pos
    }
}

/// A packed ring's addresses and positions, taken from the vring for one batch.
#[derive(Clone, Debug)]
pub struct PackedRing {
    /// The descriptor ring.
    pub desc: u64,
    /// The driver area: the driver's event suppression structure.
    pub driver: u64,
    /// The device area: ours.
    pub device: u64,
    pub size: u16,
    pub next_avail: Pos,
    pub next_used: Pos,
    pub event_idx: bool,
    /// VIRTIO_F_IN_ORDER acked and a ring whose driver needs no entry per buffer
    /// (TX): a publish completes each run of buffers with one used descriptor, at
    /// the run's first slot with its last buffer's id (VIRTIO 1.2, packed
    /// virtqueues, "In-order use of descriptors").
    pub batch_used: bool,
    /// Used entries recorded and not yet written, in ring order. At most `size`
    /// (each takes a slot of its own).
    unpublished: Vec<Used>,
    /// Where each publish is recorded for a gsonet started after this one
    /// (`record`): none outside a port.
    pub record: Option<RecordSlot>,
}

impl PackedRing {
    pub fn new(desc: u64, driver: u64, device: u64, size: u16, event_idx: bool) -> PackedRing {
        PackedRing {
            desc,
            driver,
            device,
            size,
            next_avail: Pos::START,
            next_used: Pos::START,
            event_idx,
            batch_used: false,
            unpublished: Vec::new(),
            record: None,
        }
    }

    /// The ring of a vring's queue, whose positions are vring bases (`Pos::to_base`).
    /// The queue's avail and used ring addresses are the driver and device areas. A
    /// base outside the ring leaves the ring broken (`has_avail` says `None`).
    pub fn of<Q: QueueT>(q: &Q) -> PackedRing {
        let size = q.size();
        let bad = Pos {
            idx: u16::MAX,
            wrap: true,
        };
        PackedRing {
            desc: q.desc_table(),
            driver: q.avail_ring(),
            device: q.used_ring(),
            size,
            next_avail: Pos::from_base(q.next_avail(), size).unwrap_or(bad),
            next_used: Pos::from_base(q.next_used(), size).unwrap_or(bad),
            event_idx: q.event_idx_enabled(),
            batch_used: false,
            unpublished: Vec::new(),
            record: None,
        }
    }

    /// `of`, into this value: its buffers, its record and `batch_used` are kept,
    /// its unpublished entries dropped.
    pub fn reload<Q: QueueT>(&mut self, q: &Q) {
        let mut unpublished = std::mem::take(&mut self.unpublished);
        unpublished.clear();
        let record = self.record.take();
        *self = PackedRing {
            unpublished,
            record,
            batch_used: self.batch_used,
            ..PackedRing::of(q)
        };
    }

    /// Whether this is still `q`'s ring as it stands: same addresses and size, the
    /// avail position `q` holds.
    pub fn is_of<Q: QueueT>(&self, q: &Q) -> bool {
        self.desc == q.desc_table()
            && self.driver == q.avail_ring()
            && self.device == q.used_ring()
            && self.size == q.size()
            && self.next_avail.to_base() == q.next_avail()
    }

    /// Puts the positions back into the vring's queue, as vring bases.
    pub fn store<Q: QueueT>(&self, q: &mut Q) {
        q.set_next_avail(self.next_avail.to_base());
        q.set_next_used(self.next_used.to_base());
    }

    fn slot(&self, idx: u16) -> u64 {
        self.desc + u64::from(idx) * DESC_SIZE
    }

    fn in_ring(&self, p: Pos) -> bool {
        p.idx < self.size
    }

    /// Whether the driver has made the buffer at `next_avail` available
    /// (`Acquire`: its descriptors are visible); `None` for a broken ring (a
    /// position outside it, or the ring unmapped).
    #[inline]
    pub fn has_avail(&self, hm: &HostMem<'_>) -> Option<bool> {
        if !self.in_ring(self.next_avail) {
            return None;
        }
        let flags = hm.load_u16(self.slot(self.next_avail.idx) + FLAGS_AT, Ordering::Acquire)?;
        Some(is_avail(flags, self.next_avail.wrap))
    }

    /// Starts loading the descriptor at `next_avail` (see `HostMem::prefetch`).
    pub fn prefetch_desc(&self, hm: &HostMem<'_>) {
        if self.in_ring(self.next_avail) {
            hm.prefetch(self.slot(self.next_avail.idx), DESC_SIZE as usize);
        }
    }

    /// `SplitRing::prefetch_writes` for a packed ring: the buffers of the
    /// descriptors `skip..skip + n` slots past `next_avail` that are available
    /// and device-writable (an RX buffer of one descriptor takes one slot). Each
    /// slot, where its used entry goes, is loaded by reading it.
    pub fn prefetch_writes(&self, hm: &HostMem<'_>, skip: u16, n: u16) {
        if !self.in_ring(self.next_avail) || n > self.size || skip > self.size - n {
            return;
        }
        for i in skip..skip + n {
            let at = self.next_avail.advance(i, self.size);
            let Some(d) = hm.read_array::<16>(self.slot(at.idx)) else {
                return;
            };
            let d = PackedDesc::parse(d);
            if is_avail(d.flags, at.wrap) && d.flags & VRING_DESC_F_WRITE as u16 != 0 {
                hm.prefetch(d.addr, d.len as usize);
            }
        }
    }

    /// Takes the next available buffer if it is one device-writable descriptor of
    /// at least `need` bytes, the common RX buffer: `next_avail` moved past its
    /// slot; its position, buffer id and descriptor returned. Any other buffer is
    /// left for `pop` to take and check.
    #[inline(always)]
    pub fn take_single_writable(
        &mut self,
        hm: &HostMem<'_>,
        need: usize,
    ) -> Option<(Pos, u16, Desc)> {
        if !self.has_avail(hm)? {
            return None;
        }
        let at = self.next_avail;
        let d = PackedDesc::parse(hm.read_array::<16>(self.slot(at.idx))?);
        let flags = d.flags & DESC_FLAGS;
        let write = VRING_DESC_F_WRITE as u16;
        if flags != write || (d.len as usize) < need {
            return None;
        }
        self.next_avail = at.advance(1, self.size);
        Some((at, d.id, d.walked(flags)))
    }

    /// Takes the next available buffer: its descriptors (at most `max`) appended to
    /// `out`, `next_avail` moved past its slots. `None` if none is available (or
    /// the ring is broken). A buffer is always taken whole, however its walk ends,
    /// so that the used position stays with the available one; a chain that is not
    /// all there ends where it stops being available.
    pub fn pop(&mut self, hm: &HostMem<'_>, max: usize, out: &mut Vec<Desc>) -> Option<Popped> {
        if !self.has_avail(hm)? {
            return None;
        }
        let at = self.next_avail;
        let mut head = hm.read_array::<16>(self.slot(at.idx));
        if let Some(d) = head.map(PackedDesc::parse) {
            // A buffer of one descriptor (how most TX frames come): taken without
            // the loop, as the loop would take it.
            let flags = d.flags & DESC_FLAGS;
            if flags & (NEXT | VRING_DESC_F_INDIRECT as u16) == 0 && max > 0 {
                out.push(d.walked(flags));
                self.next_avail = at.advance(1, self.size);
                return Some(Popped {
                    at,
                    id: d.id,
                    slots: 1,
                    end: WalkEnd::Complete,
                    indirect: false,
                });
            }
        }
        let start = out.len();
        let mut pos = at;
        let mut slots = 0u16;
        let mut bytes = 0u32;
        let mut id = 0u16;
        let mut indirect = false;
        let end = loop {
            // The head as read above, each descriptor after it from the ring.
            let raw = match head.take() {
                Some(raw) if slots == 0 => Some(raw),
                _ => hm.read_array::<16>(self.slot(pos.idx)),
            };
            let Some(raw) = raw else {
                if slots == 0 {
                    // The head's flags were readable, its descriptor is not: take
                    // the slot, so that the ring moves on.
                    slots = 1;
                    pos = pos.advance(1, self.size);
                }
                break WalkEnd::Unreadable;
            };
            let d = PackedDesc::parse(raw);
            // The head was checked with Acquire; the rest must be available too,
            // each under the wrap counter of its own slot.
            if slots > 0 && !is_avail(d.flags, pos.wrap) {
                break WalkEnd::Broken;
            }
            slots += 1;
            pos = pos.advance(1, self.size);
            id = d.id;
            let flags = d.flags & DESC_FLAGS;
            let next = flags & NEXT != 0;
            if flags & VRING_DESC_F_INDIRECT as u16 != 0 {
                indirect |= slots == 1;
                // An indirect table is a buffer on its own: not in a chain, not
                // chained on.
                if slots > 1 || next {
                    let _ = self.skip_rest(hm, &mut pos, &mut slots, &mut id, next);
                    break WalkEnd::Broken;
                }
                break walk_indirect(hm, d, max, out);
            }
            let Some(more) = bytes.checked_add(d.len) else {
                // Longer than 2^32 bytes: ends before this descriptor, which the
                // one before points on to.
                let _ = self.skip_rest(hm, &mut pos, &mut slots, &mut id, next);
                break WalkEnd::Broken;
            };
            bytes = more;
            if out.len() - start == max {
                let e = self.skip_rest(hm, &mut pos, &mut slots, &mut id, next);
                break if e == WalkEnd::Complete {
                    WalkEnd::TooMany
                } else {
                    e
                };
            }
            out.push(d.walked(flags));
            if !next {
                break WalkEnd::Complete;
            }
            if slots == self.size {
                // Every slot of the ring, and it still points on.
                break WalkEnd::Broken;
            }
        };
        self.next_avail = pos;
        Some(Popped {
            at,
            id,
            slots,
            end,
            indirect,
        })
    }

    /// Takes the rest of a chain whose walk stopped (`next`: the last descriptor
    /// read points on), without keeping its descriptors: through its last
    /// descriptor, or to where it stops being available or fills the ring.
    /// `Complete` if the rest is a well-formed end of a chain.
    fn skip_rest(
        &self,
        hm: &HostMem<'_>,
        pos: &mut Pos,
        slots: &mut u16,
        id: &mut u16,
        mut next: bool,
    ) -> WalkEnd {
        let mut end = WalkEnd::Complete;
        while next {
            if *slots == self.size {
                return WalkEnd::Broken;
            }
            let Some(raw) = hm.read_array::<16>(self.slot(pos.idx)) else {
                return WalkEnd::Unreadable;
            };
            let d = PackedDesc::parse(raw);
            if !is_avail(d.flags, pos.wrap) {
                return WalkEnd::Broken;
            }
            *slots += 1;
            *pos = pos.advance(1, self.size);
            *id = d.id;
            next = d.flags & NEXT != 0;
            if d.flags & VRING_DESC_F_INDIRECT as u16 != 0 {
                end = WalkEnd::Broken;
            }
        }
        end
    }

    /// Gives back the buffers taken since `to` (a `Popped::at`): they are taken
    /// again by the next `pop`.
    pub fn rewind(&mut self, to: Pos) {
        self.next_avail = to;
    }

    /// Where the used side stands now (for `rewind_used`).
    pub fn used_mark(&self) -> UsedMark {
        UsedMark {
            pos: self.next_used,
            unpublished: self.unpublished.len(),
        }
    }

    /// Forgets the used entries recorded since `m` (none of them is written yet).
    pub fn rewind_used(&mut self, m: UsedMark) {
        self.next_used = m.pos;
        self.unpublished.truncate(m.unpublished);
    }

    /// Records the used entry of buffer `id`, which took `slots` ring slots, with
    /// `len` bytes written into it, at the used position; `publish_used` writes it.
    /// The used position moves on by `slots` (1 to `size`), as the available one
    /// did, even when the entry cannot be written: `false` then (its slot is not
    /// guest memory, or the position or `slots` is outside the ring). Nothing is
    /// written before the publish, so buffers given back (`rewind`) with their
    /// entries (`rewind_used`) read as they did.
    #[inline]
    pub fn put_used(&mut self, hm: &HostMem<'_>, id: u16, slots: u16, len: u32) -> bool {
        if !self.in_ring(self.next_used) || slots == 0 || slots > self.size {
            return false;
        }
        let at = self.next_used;
        self.next_used = at.advance(slots, self.size);
        if hm.check(self.slot(at.idx), DESC_SIZE as usize).is_err() {
            return false;
        }
        // At most `size` entries: each has a slot of its own until published.
        if self.unpublished.len() < usize::from(self.size) {
            self.unpublished.push(Used { at, id, len, slots });
        }
        true
    }

    /// `put_used` with length 0 for each of `heads` (id, slots), taken in this
    /// order: with `batch_used`, an entry that follows the last one recorded joins
    /// it at once, as `publish_used` would join them (`batch_runs`), instead of
    /// being recorded on its own. For a TX batch handed back whole (nothing
    /// recorded here is rewound). Returns how many could not go back.
    pub fn put_used_in_order(
        &mut self,
        hm: &HostMem<'_>,
        heads: impl Iterator<Item = (u16, u16)>,
    ) -> usize {
        let mut bad = 0;
        for (id, slots) in heads {
            let at = self.next_used;
            let joins = self.batch_used
                && self.in_ring(at)
                && slots > 0
                && self
                    .unpublished
                    .last()
                    .is_some_and(|run| run.joined_by(at, slots, self.size))
                && hm.check(self.slot(at.idx), DESC_SIZE as usize).is_ok();
            match self.unpublished.last_mut() {
                Some(run) if joins => {
                    self.next_used = at.advance(slots, self.size);
                    run.id = id;
                    run.len = 0;
                    run.slots += slots;
                }
                _ => bad += usize::from(!self.put_used(hm, id, slots, 0)),
            }
        }
        bad
    }

    /// The used entry of a taken buffer (`put_used` with its id and slots).
    pub fn put_used_popped(&mut self, hm: &HostMem<'_>, p: &Popped, len: u32) -> bool {
        self.put_used(hm, p.id, p.slots, len)
    }

    /// Makes every used entry recorded so far visible: each one's length and id,
    /// then its flags (`Release`), the first entry last, so the driver, which reads
    /// them in ring order, sees all of them or none. With `batch_used` each run of
    /// entries in consecutive slots is one used descriptor (`batch_runs`). `false`
    /// if an entry could not be written (the ring is broken). The record, if any,
    /// has the used position before and after the publish while it writes, and the
    /// one after it then.
    pub fn publish_used(&mut self, hm: &HostMem<'_>) -> bool {
        if self.batch_used {
            self.batch_runs();
        }
        let mut ok = true;
        if let Some((first, rest)) = self.unpublished.split_first() {
            if let Some(r) = &self.record {
                r.begin(self.desc, first.at, self.next_used);
            }
            for u in rest.iter().chain(std::iter::once(first)) {
                let slot = self.slot(u.at.idx);
                let flags = if u.at.wrap { F_AVAIL | F_USED } else { 0 };
                ok &= hm.store_packed_used(slot, u.len, u.id, flags);
            }
            if let Some(r) = &self.record {
                r.commit(self.next_used);
            }
        }
        self.unpublished.clear();
        ok
    }

    /// Folds each run of unpublished entries whose buffers took consecutive slots
    /// into one entry: at the run's first slot, with its last buffer's id and
    /// length, covering all of its slots. Under VIRTIO_F_IN_ORDER the driver reads
    /// the id and takes every buffer from that slot up to the one with that id as
    /// used (DPDK's `virtio_xmit_cleanup_inorder_packed`); the used position then
    /// moves past the run's slots as it did. A run covers at most `size` slots; an
    /// entry that does not follow the one before (a slot that could not be written
    /// left a gap) starts a run of its own.
    fn batch_runs(&mut self) {
        let size = self.size;
        let mut out = 0usize;
        for i in 1..self.unpublished.len() {
            let u = self.unpublished[i];
            let run = &mut self.unpublished[out];
            if run.joined_by(u.at, u.slots, size) {
                run.id = u.id;
                run.len = u.len;
                run.slots += u.slots;
            } else {
                out += 1;
                self.unpublished[out] = u;
            }
        }
        self.unpublished.truncate(out + 1);
    }

    /// Used entries recorded and not yet visible.
    pub fn unpublished(&self) -> usize {
        self.unpublished.len()
    }

    /// Whether the driver wants a call for the used entries made visible since the
    /// used position was `since`: its event suppression flags ENABLE, or with
    /// EVENT_IDX DESC and its event position inside [since, next_used). DISABLE
    /// never; an unreadable structure, flags it may not use or an event outside the
    /// ring ask for a call.
    pub fn wants_call(&self, hm: &HostMem<'_>, since: Pos) -> bool {
        let now = self.next_used;
        if now == since {
            return false;
        }
        // Our flags stores before the driver's event structure loads.
        store_load_fence();
        let Some(flags) = hm.load_u16(self.driver + 2, Ordering::Relaxed) else {
            return true;
        };
        match flags {
            EVENT_DISABLE => false,
            EVENT_DESC if self.event_idx => {
                let Some(off_wrap) = hm.load_u16(self.driver, Ordering::Relaxed) else {
                    return true;
                };
                let Some(event) = Pos::from_base(off_wrap, self.size) else {
                    return true;
                };
                let moved = since.distance(now, self.size);
                if moved > u32::from(self.size) {
                    // More than a ring since the last decision: a reset or a
                    // position the frontend set; call rather than guess.
                    return true;
                }
                since.distance(event, self.size) < moved
            }
            _ => true,
        }
    }

    /// Asks the driver for a kick when it makes buffers available: with EVENT_IDX at
    /// `next_avail` (DESC), without it for every buffer (ENABLE). Returns whether a
    /// buffer is already available (read after a full fence: one made available
    /// before the driver saw our flags is not missed), `None` for a broken ring.
    pub fn enable_kicks(&self, hm: &HostMem<'_>) -> Option<bool> {
        if self.event_idx {
            hm.store_u16(self.device, self.next_avail.to_base(), Ordering::Relaxed)?;
            hm.store_u16(self.device + 2, EVENT_DESC, Ordering::Release)?;
        } else {
            hm.store_u16(self.device + 2, EVENT_ENABLE, Ordering::Release)?;
        }
        store_load_fence();
        self.has_avail(hm)
    }

    /// Asks the driver to kick when it makes more buffers available than it has
    /// now (a queue whose available buffers were too few for what the device has
    /// to write). With EVENT_IDX: at the first slot from `next_avail` on that is not
    /// available (DESC, that slot and its wrap counter), so the driver kicks once,
    /// when its next buffer lands there, as the split ring's avail_event past the
    /// buffers it has; a wish at `next_avail` would name a buffer already there,
    /// and it would not kick again. Without EVENT_IDX, or with every slot
    /// available, for every buffer (ENABLE). Returns whether that slot (ENABLE: the
    /// one at `next_avail`) is available now, read after a full fence, so a buffer
    /// added while the driver read the old wish is not missed; `None` for a broken
    /// ring.
    pub fn ask_kick(&self, hm: &HostMem<'_>) -> Option<bool> {
        if self.event_idx {
            if let Some(at) = self.first_unavailable(hm)? {
                hm.store_u16(self.device, at.to_base(), Ordering::Relaxed)?;
                hm.store_u16(self.device + 2, EVENT_DESC, Ordering::Release)?;
                store_load_fence();
                let flags = hm.load_u16(self.slot(at.idx) + FLAGS_AT, Ordering::Acquire)?;
                return Some(is_avail(flags, at.wrap));
            }
        }
        hm.store_u16(self.device + 2, EVENT_ENABLE, Ordering::Release)?;
        store_load_fence();
        self.has_avail(hm)
    }

    /// The first slot from `next_avail` on whose descriptor is not available under
    /// its wrap counter (a chain's later descriptors are available as its head is);
    /// `Some(None)` if the whole ring is, `None` for a broken ring.
    fn first_unavailable(&self, hm: &HostMem<'_>) -> Option<Option<Pos>> {
        if !self.in_ring(self.next_avail) {
            return None;
        }
        let mut at = self.next_avail;
        for _ in 0..self.size {
            let flags = hm.load_u16(self.slot(at.idx) + FLAGS_AT, Ordering::Acquire)?;
            if !is_avail(flags, at.wrap) {
                return Some(Some(at));
            }
            at = at.advance(1, self.size);
        }
        Some(None)
    }

    /// Asks the driver not to kick (the device polls while it works).
    pub fn disable_kicks(&self, hm: &HostMem<'_>) -> Option<()> {
        hm.store_u16(self.device + 2, EVENT_DISABLE, Ordering::Relaxed)
    }
}

/// The entries of the indirect table `d` points at, appended to `out` (at most
/// `max`): len / 16 of them in order, NEXT ignored (the driver sets no flag but
/// WRITE there), none itself indirect.
fn walk_indirect(hm: &HostMem<'_>, d: PackedDesc, max: usize, out: &mut Vec<Desc>) -> WalkEnd {
    let n = u64::from(d.len) / DESC_SIZE;
    if n == 0 || !u64::from(d.len).is_multiple_of(DESC_SIZE) || n > MAX_INDIRECT {
        return WalkEnd::Broken;
    }
    let start = out.len();
    let mut bytes = 0u32;
    for i in 0..n {
        let Some(at) = d.addr.checked_add(i * DESC_SIZE) else {
            return WalkEnd::Unreadable;
        };
        let Some(raw) = hm.read_array::<16>(at) else {
            return WalkEnd::Unreadable;
        };
        let e = PackedDesc::parse(raw);
        if e.flags & VRING_DESC_F_INDIRECT as u16 != 0 {
            return WalkEnd::Broken;
        }
        let Some(more) = bytes.checked_add(e.len) else {
            return WalkEnd::Broken;
        };
        bytes = more;
        if out.len() - start == max {
            return WalkEnd::TooMany;
        }
        out.push(e.walked(e.flags & VRING_DESC_F_WRITE as u16));
    }
    WalkEnd::Complete
}

#[cfg(test)]
mod tests;

//! The driver side of a packed virtqueue, written from the VIRTIO 1.2 spec (2.8) as a
//! guest driver works it, to drive `ring::packed` in tests: buffers made available
//! (the rest of a chain first, its first descriptor last, the buffer id in every
//! descriptor as Linux writes it), used entries read back in ring order with the
//! driver's own used wrap counter, and its event suppression structure.
//!
//! It shares no code with `ring::packed` beyond the layout constants.

use std::collections::{HashMap, VecDeque};

use vm_memory::{Bytes, GuestAddress};

use crate::ring::packed::{Pos, F_AVAIL, F_USED};
use crate::ring::GuestMem;

const NEXT: u16 = 1;
const WRITE: u16 = 2;
const INDIRECT: u16 = 4;

/// One piece of a buffer: guest address, length, device-writable.
pub type Piece = (u64, u32, bool);

/// A driver of one packed ring in `mem`.
pub struct Driver {
    pub ring: u64,
    pub driver_area: u64,
    pub device_area: u64,
    pub size: u16,
    /// Where the next buffer goes, and the wrap counter that marks it available.
    pub avail_idx: u16,
    pub avail_wrap: bool,
    /// Where the next used entry is expected.
    pub used_idx: u16,
    pub used_wrap: bool,
    /// Slots each buffer id in flight took.
    in_flight: HashMap<u16, u16>,
    /// The ids in flight in the order they were made available.
    order: VecDeque<u16>,
    next_id: u16,
}

impl Driver {
    /// A ring of `size` descriptors at `ring`, the driver and device areas right
    /// after it, everything zero (as a driver sets it up).
    pub fn new(mem: &GuestMem, ring: u64, size: u16) -> Driver {
        let driver_area = ring + 16 * u64::from(size);
        let device_area = driver_area + 4;
        let zero = vec![0u8; 16 * usize::from(size) + 8];
        mem.write_slice(&zero, GuestAddress(ring)).unwrap();
        Driver {
            ring,
            driver_area,
            device_area,
            size,
            avail_idx: 0,
            avail_wrap: true,
            used_idx: 0,
            used_wrap: true,
            in_flight: HashMap::new(),
            order: VecDeque::new(),
            next_id: 0,
        }
    }

    fn avail_flags(&self, wrap: bool) -> u16 {
        if wrap {
            F_AVAIL
        } else {
            F_USED
        }
    }

    fn write_desc(&self, mem: &GuestMem, idx: u16, addr: u64, len: u32, id: u16, flags: u16) {
        let at = self.ring + 16 * u64::from(idx);
        mem.write_obj(addr, GuestAddress(at)).unwrap();
        mem.write_obj(len, GuestAddress(at + 8)).unwrap();
        mem.write_obj(id, GuestAddress(at + 12)).unwrap();
        mem.write_obj(flags, GuestAddress(at + 14)).unwrap();
    }

    /// A fresh buffer id.
    pub fn fresh_id(&mut self) -> u16 {
        while self.in_flight.contains_key(&self.next_id) {
            self.next_id = (self.next_id + 1) % self.size;
        }
        let id = self.next_id;
        self.next_id = (self.next_id + 1) % self.size;
        id
    }

    /// Makes `pieces` available as one chain with buffer id `id`; returns the slots
    /// it took. The first descriptor's flags are written last.
    pub fn add_with_id(&mut self, mem: &GuestMem, pieces: &[Piece], id: u16) -> u16 {
        assert!(!pieces.is_empty() && pieces.len() <= usize::from(self.size));
        let head_idx = self.avail_idx;
        let mut head = None;
        for (i, &(addr, len, write)) in pieces.iter().enumerate() {
            let mut flags = self.avail_flags(self.avail_wrap);
            if write {
                flags |= WRITE;
            }
            if i + 1 < pieces.len() {
                flags |= NEXT;
            }
            if i == 0 {
                // Its flags last, once the rest of the chain is there.
                head = Some(flags);
                let at = self.ring + 16 * u64::from(head_idx);
                mem.write_obj(addr, GuestAddress(at)).unwrap();
                mem.write_obj(len, GuestAddress(at + 8)).unwrap();
                mem.write_obj(id, GuestAddress(at + 12)).unwrap();
            } else {
                self.write_desc(mem, self.avail_idx, addr, len, id, flags);
            }
            self.step_avail();
        }
        let at = self.ring + 16 * u64::from(head_idx) + 14;
        std::sync::atomic::fence(std::sync::atomic::Ordering::Release);
        mem.write_obj(head.unwrap(), GuestAddress(at)).unwrap();
        let slots = pieces.len() as u16;
        self.in_flight.insert(id, slots);
        self.order.push_back(id);
        slots
    }

    /// `add_with_id` with a fresh id; returns the id.
    pub fn add(&mut self, mem: &GuestMem, pieces: &[Piece]) -> u16 {
        let id = self.fresh_id();
        self.add_with_id(mem, pieces, id);
        id
    }

    /// Makes one descriptor available that points at an indirect table of `pieces`
    /// written at `table`; returns the id.
    pub fn add_indirect(&mut self, mem: &GuestMem, table: u64, pieces: &[Piece]) -> u16 {
        for (i, &(addr, len, write)) in pieces.iter().enumerate() {
            let at = table + 16 * i as u64;
            mem.write_obj(addr, GuestAddress(at)).unwrap();
            mem.write_obj(len, GuestAddress(at + 8)).unwrap();
            mem.write_obj(0u16, GuestAddress(at + 12)).unwrap();
            mem.write_obj(if write { WRITE } else { 0 }, GuestAddress(at + 14))
                .unwrap();
        }
        let id = self.fresh_id();
        let flags = self.avail_flags(self.avail_wrap) | INDIRECT;
        self.write_desc(
            mem,
            self.avail_idx,
            table,
            16 * pieces.len() as u32,
            id,
            flags,
        );
        self.step_avail();
        self.in_flight.insert(id, 1);
        self.order.push_back(id);
        id
    }

    fn step_avail(&mut self) {
        self.avail_idx += 1;
        if self.avail_idx == self.size {
            self.avail_idx = 0;
            self.avail_wrap = !self.avail_wrap;
        }
    }

    /// The used descriptor at the driver's used position, if the device has made
    /// it visible (its flags used under the driver's wrap counter): (id, len).
    fn peek_used(&self, mem: &GuestMem) -> Option<(u16, u32)> {
        let at = self.ring + 16 * u64::from(self.used_idx);
        let flags: u16 = mem.read_obj(GuestAddress(at + 14)).unwrap();
        let avail = flags & F_AVAIL != 0;
        let used = flags & F_USED != 0;
        if avail != self.used_wrap || used != self.used_wrap {
            return None;
        }
        let id: u16 = mem.read_obj(GuestAddress(at + 12)).unwrap();
        let len: u32 = mem.read_obj(GuestAddress(at + 8)).unwrap();
        Some((id, len))
    }

    /// The next used entry, if the device has made one visible: (id, len). The
    /// used position moves on by the slots that id took when it was added.
    pub fn get_used(&mut self, mem: &GuestMem) -> Option<(u16, u32)> {
        let (id, len) = self.peek_used(mem)?;
        let slots = self
            .in_flight
            .remove(&id)
            .unwrap_or_else(|| panic!("used id {id} is not in flight"));
        self.order.retain(|&i| i != id);
        self.step_used(slots);
        Some((id, len))
    }

    fn step_used(&mut self, slots: u16) {
        let to = self.used_idx + slots;
        if to >= self.size {
            self.used_idx = to - self.size;
            self.used_wrap = !self.used_wrap;
        } else {
            self.used_idx = to;
        }
    }

    /// The next used descriptor read as a driver that negotiated VIRTIO_F_IN_ORDER
    /// reads it (packed virtqueues, "In-order use of descriptors"): it completes
    /// every buffer from the oldest in flight up to the one whose id it carries,
    /// and the used position moves past all of their slots. Returns those ids, in
    /// the order they were made available, and the used descriptor's length.
    pub fn get_used_in_order(&mut self, mem: &GuestMem) -> Option<(Vec<u16>, u32)> {
        let (id, len) = self.peek_used(mem)?;
        assert!(
            self.in_flight.contains_key(&id),
            "used id {id} is not in flight"
        );
        let mut done = Vec::new();
        while let Some(first) = self.order.pop_front() {
            let slots = self.in_flight.remove(&first).unwrap();
            self.step_used(slots);
            done.push(first);
            if first == id {
                break;
            }
        }
        Some((done, len))
    }

    /// Buffers made available and not yet used.
    pub fn in_flight(&self) -> usize {
        self.in_flight.len()
    }

    /// Writes the driver's event suppression structure: `flags` (0 enable,
    /// 1 disable, 2 desc) and the event position.
    pub fn set_event(&self, mem: &GuestMem, flags: u16, idx: u16, wrap: bool) {
        let off_wrap = idx | if wrap { 0x8000 } else { 0 };
        mem.write_obj(off_wrap, GuestAddress(self.driver_area))
            .unwrap();
        mem.write_obj(flags, GuestAddress(self.driver_area + 2))
            .unwrap();
    }

    /// The device's event suppression structure: (flags, off_wrap).
    pub fn device_event(&self, mem: &GuestMem) -> (u16, u16) {
        let off_wrap: u16 = mem.read_obj(GuestAddress(self.device_area)).unwrap();
        let flags: u16 = mem.read_obj(GuestAddress(self.device_area + 2)).unwrap();
        (flags, off_wrap)
    }
}

/// Whether a driver that asked for a call at `event` (DESC, with EVENT_IDX) gets
/// one when the used position moves from `old` to `new` (at most a lap): Linux's
/// vring_need_event over ring positions, `old` and the event moved a lap back when
/// they belong to the lap before `new`'s.
pub fn driver_wants_call(size: u16, old: Pos, new: Pos, event: Pos) -> bool {
    let s = i32::from(size);
    let new_i = i32::from(new.idx);
    let mut old_i = i32::from(old.idx);
    if new_i <= old_i {
        old_i -= s;
    }
    let mut ev = i32::from(event.idx);
    if event.wrap != new.wrap {
        ev -= s;
    }
    ((new_i - ev - 1) as u16) < ((new_i - old_i) as u16)
}

//! The one boundary between guest addresses and host memory on the datapath.
//!
//! vm-memory's generic accessors translate and bounds-check a guest range region by
//! region through an iterator of slices on every call; at one call per descriptor,
//! used entry and index that cost more than the rest of a 64-byte frame's trip.
//! `HostMem` does the same checks once per range, with the region the last access
//! fell in or else one binary search over the regions, and copies with the
//! semantics vm-memory uses itself: a plain `memcpy` (`ptr::copy_nonoverlapping`)
//! for anything longer than a word, single volatile accesses for ring fields. No
//! `&[u8]` or `&mut [u8]` is ever formed over guest memory: the guest (and the other
//! guest, guest to guest) may change those bytes at any moment, so they only ever
//! cross this boundary as raw copies into or out of memory gsonet owns, or between
//! two guests' mappings.
//!
//! Every write marks its pages in the region's dirty log (a relaxed load while no
//! migration logs), as vm-memory's accessors do.

// The datapath's only unsafe code outside `sys`: each block states its invariant.
#![allow(unsafe_code)]

use std::cell::Cell;
use std::sync::atomic::{fence, AtomicU16, Ordering};

use vm_memory::bitmap::Bitmap;
use vm_memory::{GuestAddress, GuestMemoryBackend, GuestMemoryRegion};

use super::guest_mem::{BadRange, GuestMem};

/// Bytes of a buffer a prefetch asks for: the lines a copy stalls on first; the
/// hardware prefetcher streams the rest of a long buffer by itself.
const PREFETCH_BYTES: usize = 2 * CACHE_LINE;
const CACHE_LINE: usize = 64;

/// A guest range that lies in one mapped region: where it starts in host memory, and
/// the region (for its dirty log).
#[derive(Clone, Copy)]
struct Span<'a> {
    host: *mut u8,
    region: &'a Region,
    /// Offset of `host` in the region, for the dirty log.
    offset: usize,
    /// Bytes of the range in this region (at most what was asked).
    len: usize,
}

type Region = vm_memory::GuestRegionMmap<super::guest_mem::DirtyLog>;

/// A mapped region as `span` needs it: its guest range, where its mapping starts,
/// and the region itself (for its dirty log).
#[derive(Clone, Copy)]
struct Found {
    start: u64,
    /// Bytes in the region.
    len: u64,
    host: *mut u8,
    region: *const Region,
}

impl Found {
    /// No region: its length is 0, so no address is in it.
    const NONE: Found = Found {
        start: 0,
        len: 0,
        host: std::ptr::null_mut(),
        region: std::ptr::null(),
    };
}

/// Guest memory as the datapath reads and writes it: checked ranges, raw copies.
pub struct HostMem<'a> {
    mem: &'a GuestMem,
    /// The region the last access fell in, found in `mem`: a batch's rings and
    /// buffers nearly always lie in one or two regions, so most accesses skip the
    /// search over the regions and the pointer chase into each one it compares.
    /// Before the first access, `Found::NONE`, which holds no address.
    last: Cell<Found>,
}

impl Clone for HostMem<'_> {
    fn clone(&self) -> Self {
        HostMem {
            mem: self.mem,
            last: self.last.clone(),
        }
    }
}

impl<'a> HostMem<'a> {
    pub fn new(mem: &'a GuestMem) -> HostMem<'a> {
        HostMem {
            mem,
            last: Cell::new(Found::NONE),
        }
    }

    /// The guest memory this reads and writes.
    pub fn guest_mem(&self) -> &'a GuestMem {
        self.mem
    }

    /// The region `addr` is in: the last one found if it holds `addr`, else searched.
    #[inline]
    fn region(&self, addr: u64) -> Option<(Found, &'a Region)> {
        let f = self.last.get();
        if addr.wrapping_sub(f.start) < f.len {
            // SAFETY: `last` holds a region of `self.mem` whenever its length is
            // not 0 (set below, and copied with `mem` by `clone`), which
            // `self.mem` keeps alive and unchanged for 'a.
            return Some((f, unsafe { &*f.region }));
        }
        let region = self.mem.find_region(GuestAddress(addr))?;
        let f = Found {
            start: region.start_addr().0,
            len: region.len(),
            host: region.as_ptr(),
            region,
        };
        self.last.set(f);
        Some((f, region))
    }

    /// The mapped piece of `[addr, addr + len)` that starts at `addr`: all of it, or
    /// the part up to the end of the region `addr` is in. `None` if `addr` is not
    /// mapped or the range wraps the address space.
    #[inline]
    fn span(&self, addr: u64, len: usize) -> Option<Span<'a>> {
        addr.checked_add(len as u64)?;
        let (f, region) = self.region(addr)?;
        let offset = (addr - f.start) as usize;
        let room = f.len as usize - offset;
        // SAFETY: `offset` is inside the region's mapping (`addr` lies in
        // [start, start + len) of the region: find_region, or the check in
        // `region`), so the pointer stays inside that mapping.
        let host = unsafe { f.host.add(offset) };
        Some(Span {
            host,
            region,
            offset,
            len: len.min(room),
        })
    }

    /// Whether `[addr, addr + len)` is mapped (possibly across regions). Inline for
    /// a range in one region, as nearly every one is; the walk over pieces else.
    #[inline]
    pub fn check(&self, addr: u64, len: usize) -> Result<(), BadRange> {
        if self.span(addr, len).is_some_and(|s| s.len == len) {
            return Ok(());
        }
        self.check_pieces(addr, len)
    }

    #[inline(never)]
    fn check_pieces(&self, addr: u64, len: usize) -> Result<(), BadRange> {
        self.walk(addr, len, |_, _| {})
    }

    /// Calls `f(span, done)` for each region piece of `[addr, addr + len)`, in order;
    /// `done` is how many bytes came before the piece. Fails, having called `f` for
    /// nothing, unless all of it is mapped.
    fn walk(
        &self,
        addr: u64,
        len: usize,
        mut f: impl FnMut(Span<'a>, usize),
    ) -> Result<(), BadRange> {
        let bad = BadRange { addr, len };
        if len == 0 {
            // Nothing to touch, wherever it points (as vm-memory's accessors).
            return Ok(());
        }
        // Fast path: one region holds it all (descriptors nearly always are).
        let first = self.span(addr, len).ok_or(bad)?;
        if first.len == len {
            f(first, 0);
            return Ok(());
        }
        // Check every piece before touching any.
        let mut done = first.len;
        while done < len {
            let s = self.span(addr + done as u64, len - done).ok_or(bad)?;
            done += s.len;
        }
        let mut done = 0;
        while done < len {
            let s = self.span(addr + done as u64, len - done).ok_or(bad)?;
            f(s, done);
            done += s.len;
        }
        Ok(())
    }

    /// Copies guest `[addr, addr + dst.len())` into `dst`. Inline for a range in
    /// one region, as nearly every one is (a frame's bytes, a descriptor); the walk
    /// over pieces else.
    #[inline(always)]
    pub fn read(&self, addr: u64, dst: &mut [u8]) -> Result<(), BadRange> {
        match self.span(addr, dst.len()) {
            Some(s) if s.len == dst.len() => {
                // SAFETY: `s` is `dst.len()` mapped bytes of guest memory (`span`),
                // copied into gsonet's own buffer; the two never overlap.
                unsafe { copy(s.host, dst.as_mut_ptr(), s.len) };
                Ok(())
            }
            _ => self.read_pieces(addr, dst),
        }
    }

    #[inline(never)]
    fn read_pieces(&self, addr: u64, dst: &mut [u8]) -> Result<(), BadRange> {
        let out = dst.as_mut_ptr();
        self.walk(addr, dst.len(), |s, done| {
            // SAFETY: `s` is `s.len` mapped bytes of guest memory (checked by `span`),
            // `out + done .. + s.len` lies in `dst`; guest memory and gsonet's own
            // buffer never overlap.
            unsafe { copy(s.host, out.add(done), s.len) }
        })
    }

    /// Appends guest `[addr, addr + len)` to `out`, without first filling the room
    /// it takes with zeros (a held 8 KB frame was zero-filled whole, then copied
    /// over). `out` is unchanged unless all of it is mapped.
    pub fn read_append(&self, addr: u64, len: usize, out: &mut Vec<u8>) -> Result<(), BadRange> {
        out.reserve(len);
        let at = out.len();
        let room = out.spare_capacity_mut().as_mut_ptr() as *mut u8;
        self.walk(addr, len, |s, done| {
            // SAFETY: `s` is `s.len` mapped bytes of guest memory (`span`); `room +
            // done .. + s.len` lies in the `len` bytes just reserved past `out`'s
            // end; guest memory and gsonet's own buffer never overlap.
            unsafe { copy(s.host, room.add(done), s.len) }
        })?;
        // SAFETY: `walk` returned Ok, so it called the copy for every piece of the
        // range, in order: the `len` bytes past `at` are initialised.
        unsafe { out.set_len(at + len) };
        Ok(())
    }

    /// Copies `src` into guest `[addr, addr + src.len())` and marks it dirty.
    pub fn write(&self, addr: u64, src: &[u8]) -> Result<(), BadRange> {
        let from = src.as_ptr();
        self.walk(addr, src.len(), |s, done| {
            // SAFETY: as in `read`, the other way round.
            unsafe { copy(from.add(done), s.host, s.len) };
            s.region.bitmap().mark_dirty(s.offset, s.len);
        })
    }

    /// Guest `[addr, addr + len)` to be written piece by piece with one translation,
    /// if it lies in one region (a frame and its header into one RX buffer); marked
    /// dirty whole now, so whatever of it is written is logged. `None` if it is not
    /// mapped in one region (the caller writes it with `write`, range by range).
    #[inline]
    pub fn writable(&self, addr: u64, len: usize) -> Option<Writable<'_>> {
        let span = self.span(addr, len).filter(|s| s.len == len)?;
        span.region.bitmap().mark_dirty(span.offset, len);
        Some(Writable { addr, span })
    }

    /// Copies `len` bytes from guest `src_addr` in `src` (another guest's memory, or
    /// this one's) to guest `dst_addr` here, with no copy in between.
    pub fn copy_from_guest(
        &self,
        dst_addr: u64,
        src: &HostMem<'_>,
        src_addr: u64,
        len: usize,
    ) -> Result<(), BadRange> {
        // No range is checked whole first: the sender's pieces were checked when its
        // chain was taken, and a destination range found unmapped part-way leaves
        // only bytes in buffers the caller hands back unused.
        src.pieces(src_addr, len, |s, done| {
            let mut piece = 0;
            while piece < s.len {
                let d = self
                    .span(dst_addr + (done + piece) as u64, s.len - piece)
                    .ok_or(BadRange {
                        addr: dst_addr,
                        len,
                    })?;
                // SAFETY: both pieces are mapped for `d.len` bytes (`span`). A guest
                // copying into its own memory could name overlapping ranges: `copy`
                // uses memmove semantics for those.
                unsafe { copy_any(s.host.add(piece), d.host, d.len) };
                d.region.bitmap().mark_dirty(d.offset, d.len);
                piece += d.len;
            }
            Ok(())
        })
    }

    /// Calls `f(span, done)` for each region piece of `[addr, addr + len)` in turn,
    /// as long as the pieces are mapped and `f` succeeds (nothing is checked whole
    /// first; see `walk` for that).
    fn pieces(
        &self,
        addr: u64,
        len: usize,
        mut f: impl FnMut(Span<'a>, usize) -> Result<(), BadRange>,
    ) -> Result<(), BadRange> {
        let mut done = 0;
        while done < len {
            let s = self
                .span(addr + done as u64, len - done)
                .ok_or(BadRange { addr, len })?;
            f(s, done)?;
            done += s.len;
        }
        Ok(())
    }

    /// Asks the CPU to start loading the first cache lines of guest
    /// `[addr, addr + len)`, so that a copy later in the batch finds them near
    /// instead of waiting for each frame's lines in turn. Only a hint: nothing is
    /// read, and a range that is not mapped is ignored (its copy checks it).
    #[inline]
    pub fn prefetch(&self, addr: u64, len: usize) {
        #[cfg(target_arch = "x86_64")]
        if let Some(s) = self.span(addr, len.min(PREFETCH_BYTES)) {
            use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
            let mut off = 0;
            while off < s.len {
                // SAFETY: a prefetch never faults and changes no memory; `s` is
                // mapped for `s.len` bytes besides.
                unsafe { _mm_prefetch::<_MM_HINT_T0>(s.host.add(off) as *const i8) };
                off += CACHE_LINE;
            }
        }
    }

    /// A little-endian `u16` of the ring, read with `Acquire` (an index the other
    /// side publishes). The address must be mapped and 2-byte aligned.
    #[inline(always)]
    pub fn load_u16(&self, addr: u64, order: Ordering) -> Option<u16> {
        let a = self.atomic_u16(addr)?;
        Some(u16::from_le(a.load(order)))
    }

    /// Stores a little-endian `u16` of the ring (an index or flags we publish).
    #[inline]
    pub fn store_u16(&self, addr: u64, v: u16, order: Ordering) -> Option<()> {
        let a = self.atomic_u16(addr)?;
        a.store(v.to_le(), order);
        let s = self.span(addr, 2)?;
        s.region.bitmap().mark_dirty(s.offset, 2);
        Some(())
    }

    #[inline]
    fn atomic_u16(&self, addr: u64) -> Option<&'a AtomicU16> {
        if !addr.is_multiple_of(2) {
            return None;
        }
        let s = self.span(addr, 2).filter(|s| s.len == 2)?;
        // SAFETY: two mapped, aligned bytes; an AtomicU16 has the layout of a u16 and
        // every bit pattern is valid. Accessing guest memory through atomics is how
        // both sides of a virtqueue share its indexes.
        Some(unsafe { &*(s.host as *const AtomicU16) })
    }

    /// Reads `N` bytes at `addr` (a descriptor).
    #[inline]
    pub fn read_array<const N: usize>(&self, addr: u64) -> Option<[u8; N]> {
        let mut v = [0u8; N];
        match self.span(addr, N) {
            // SAFETY: `s` is `N` mapped bytes (`span`), copied into gsonet's own array;
            // a copy of constant size is a few moves, not a call.
            Some(s) if s.len == N => unsafe {
                std::ptr::copy_nonoverlapping(s.host, v.as_mut_ptr(), N)
            },
            _ => self.read_pieces(addr, &mut v).ok()?,
        }
        Some(v)
    }

    /// Writes a split ring's used element (`id`, `len`) at `addr`: two aligned
    /// 32-bit stores rather than a call to copy eight bytes (the element is only
    /// 4-byte aligned). False if the eight bytes are not mapped and aligned.
    #[inline]
    pub fn store_used_elem(&self, addr: u64, id: u32, len: u32) -> bool {
        if !addr.is_multiple_of(4) {
            return self.write_pair(addr, id, len);
        }
        let Some(s) = self.span(addr, 8).filter(|s| s.len == 8) else {
            return self.write_pair(addr, id, len);
        };
        // SAFETY: eight mapped bytes (`span`), 4-byte aligned (checked above).
        unsafe {
            std::ptr::write_volatile(s.host as *mut u32, id.to_le());
            std::ptr::write_volatile(s.host.add(4) as *mut u32, len.to_le());
        }
        s.region.bitmap().mark_dirty(s.offset, 8);
        true
    }

    /// Writes a packed ring's used descriptor at `slot`: `len` (at 8) and `id` (at
    /// 12) as plain stores, then `flags` (at 14) with `Release`, since the driver
    /// reads the entry once it sees them. One translation for the 16 bytes when they
    /// lie in one region, aligned as the ring must be; else range by range. False if
    /// they are not mapped (or the flags not 2-byte aligned).
    #[inline]
    pub fn store_packed_used(&self, slot: u64, len: u32, id: u16, flags: u16) -> bool {
        let one = self.span(slot, 16).filter(|s| s.len == 16);
        let Some(s) = one.filter(|_| slot.is_multiple_of(16)) else {
            let mut entry = [0u8; 6];
            entry[..4].copy_from_slice(&len.to_le_bytes());
            entry[4..].copy_from_slice(&id.to_le_bytes());
            return self.write(slot + 8, &entry).is_ok()
                && self
                    .store_u16(slot + 14, flags, Ordering::Release)
                    .is_some();
        };
        // SAFETY: sixteen mapped bytes (`span`), 16-byte aligned (checked above):
        // the length at 8 and the id at 12 are aligned for their types, the flags
        // at 14 for an AtomicU16, whose layout is a u16's.
        unsafe {
            std::ptr::write_volatile(s.host.add(8) as *mut u32, len.to_le());
            std::ptr::write_volatile(s.host.add(12) as *mut u16, id.to_le());
            (*(s.host.add(14) as *const AtomicU16)).store(flags.to_le(), Ordering::Release);
        }
        s.region.bitmap().mark_dirty(s.offset + 8, 8);
        true
    }

    fn write_pair(&self, addr: u64, id: u32, len: u32) -> bool {
        let mut elem = [0u8; 8];
        elem[..4].copy_from_slice(&id.to_le_bytes());
        elem[4..].copy_from_slice(&len.to_le_bytes());
        self.write(addr, &elem).is_ok()
    }
}

/// A guest range mapped in one region and marked dirty (`HostMem::writable`): copies
/// into it check only that they stay inside it.
pub struct Writable<'a> {
    addr: u64,
    span: Span<'a>,
}

impl Writable<'_> {
    fn outside(&self, off: usize, len: usize) -> Option<BadRange> {
        let inside = off.checked_add(len).is_some_and(|end| end <= self.span.len);
        (!inside).then_some(BadRange {
            addr: self.addr.wrapping_add(off as u64),
            len,
        })
    }

    /// Copies `src` to `off` bytes into the range.
    pub fn write_at(&self, off: usize, src: &[u8]) -> Result<(), BadRange> {
        if let Some(bad) = self.outside(off, src.len()) {
            return Err(bad);
        }
        // SAFETY: `off + src.len()` bytes from the span's start are mapped (checked
        // above against the span `writable` found in one region); gsonet's own
        // buffer never overlaps guest memory.
        unsafe { copy(src.as_ptr(), self.span.host.add(off), src.len()) };
        Ok(())
    }

    /// Bytes in the range.
    pub fn size(&self) -> usize {
        self.span.len
    }

    /// `write_at` for an array: one move of known size, no call.
    #[inline(always)]
    pub fn write_array_at<const N: usize>(
        &self,
        off: usize,
        src: &[u8; N],
    ) -> Result<(), BadRange> {
        if let Some(bad) = self.outside(off, N) {
            return Err(bad);
        }
        // SAFETY: as `write_at`'s: `off + N` bytes from the span's start are mapped
        // and gsonet's own array never overlaps guest memory.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.span.host.add(off), N) };
        Ok(())
    }

    /// Copies `len` bytes from guest `src_addr` in `src` (another guest's memory, or
    /// this one's) to `off` bytes into the range, with no copy in between.
    pub fn copy_from_guest_at(
        &self,
        off: usize,
        src: &HostMem<'_>,
        src_addr: u64,
        len: usize,
    ) -> Result<(), BadRange> {
        if let Some(bad) = self.outside(off, len) {
            return Err(bad);
        }
        src.pieces(src_addr, len, |s, done| {
            // SAFETY: the source piece is mapped for `s.len` bytes (`span`), the
            // destination for `len - done` >= `s.len` from `off + done` (checked
            // above); `copy_any` moves overlapping ranges (a guest copying into its
            // own memory) as memmove does.
            unsafe { copy_any(s.host, self.span.host.add(off + done), s.len) };
            Ok(())
        })
    }
}

/// A full fence before reading what the other side published after our own stores
/// (the EVENT_IDX check after publishing used entries).
pub fn store_load_fence() {
    fence(Ordering::SeqCst);
}

/// Copies `n` bytes between guest memory and gsonet's memory, as vm-memory does:
/// `memcpy` for more than a word, single volatile accesses for a word or less so that
/// a ring field is never torn into bytes.
///
/// # Safety
/// `src` and `dst` are valid for `n` bytes and do not overlap.
unsafe fn copy(src: *const u8, dst: *mut u8, n: usize) {
    match n {
        0 => {}
        2 if (src as usize | dst as usize).is_multiple_of(2) => {
            std::ptr::write_volatile(dst as *mut u16, std::ptr::read_volatile(src as *const u16))
        }
        4 if (src as usize | dst as usize).is_multiple_of(4) => {
            std::ptr::write_volatile(dst as *mut u32, std::ptr::read_volatile(src as *const u32))
        }
        8 if (src as usize | dst as usize).is_multiple_of(8) => {
            std::ptr::write_volatile(dst as *mut u64, std::ptr::read_volatile(src as *const u64))
        }
        n if n < 8 => {
            for i in 0..n {
                std::ptr::write_volatile(dst.add(i), std::ptr::read_volatile(src.add(i)));
            }
        }
        n => std::ptr::copy_nonoverlapping(src, dst, n),
    }
}

/// `copy` for two guest ranges, which a guest may make overlap.
///
/// # Safety
/// `src` and `dst` are valid for `n` bytes.
unsafe fn copy_any(src: *const u8, dst: *mut u8, n: usize) {
    let (s, d) = (src as usize, dst as usize);
    if s.max(d) - s.min(d) < n {
        std::ptr::copy(src, dst, n);
    } else {
        copy(src, dst, n);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vm_memory::Bytes;

    fn two_regions() -> GuestMem {
        GuestMem::from_ranges(&[(GuestAddress(0), 0x1000), (GuestAddress(0x1000), 0x1000)]).unwrap()
    }

    #[test]
    fn reads_and_writes_across_regions_as_vm_memory_does() {
        let m = two_regions();
        let h = HostMem::new(&m);
        let data: Vec<u8> = (0..0x40u8).collect();
        h.write(0xfe0, &data).unwrap();
        let mut back = [0u8; 0x40];
        m.read_slice(&mut back, GuestAddress(0xfe0)).unwrap();
        assert_eq!(&back[..], &data[..]);
        let mut mine = [0u8; 0x40];
        h.read(0xfe0, &mut mine).unwrap();
        assert_eq!(mine, back);
    }

    #[test]
    fn a_packed_used_entry_is_the_same_bytes_in_one_region_or_across_two() {
        let m = two_regions();
        let h = HostMem::new(&m);
        // Aligned in one region; across the regions' border (8 bytes in each).
        for slot in [0x100u64, 0xff8] {
            m.write_slice(&[0xaa; 16], GuestAddress(slot)).unwrap();
            assert!(h.store_packed_used(slot, 0x0102_0304, 0x0506, 0x8080));
            let mut got = [0u8; 16];
            m.read_slice(&mut got, GuestAddress(slot)).unwrap();
            assert_eq!(&got[..8], &[0xaa; 8], "slot {slot:#x}");
            assert_eq!(&got[8..], &[4, 3, 2, 1, 6, 5, 0x80, 0x80], "slot {slot:#x}");
        }
        // Past the end of memory: refused.
        assert!(!h.store_packed_used(0x1ff8, 1, 1, 1));
        // Flags at an odd address cannot be stored as one: refused.
        assert!(!h.store_packed_used(0x201, 1, 1, 1));
    }

    #[test]
    fn refuses_unmapped_wrapping_and_partly_mapped_ranges_untouched() {
        let m = two_regions();
        let h = HostMem::new(&m);
        assert!(h.write(0x1ff0, &[9; 0x20]).is_err());
        assert!(h.write(0x9000, &[1]).is_err());
        assert!(h.write(u64::MAX, &[1, 2]).is_err());
        // Nothing of the refused range was written.
        let mut b = [0u8; 0x10];
        m.read_slice(&mut b, GuestAddress(0x1ff0)).unwrap();
        assert_eq!(b, [0; 0x10]);
        assert!(h.read(0x9000, &mut [0; 1]).is_err());
        assert!(h.read(u64::MAX, &mut [0; 2]).is_err());
        assert!(h.check(u64::MAX - 1, 4).is_err());
        assert!(h.check(0, 0x2000).is_ok());
        assert!(h.check(0, 0x2001).is_err());
    }

    #[test]
    fn the_region_kept_from_the_last_access_never_answers_for_an_address_outside_it() {
        let m = GuestMem::from_ranges(&[
            (GuestAddress(0x1000), 0x1000),
            (GuestAddress(0x3000), 0x1000),
        ])
        .unwrap();
        m.write_slice(&[7; 4], GuestAddress(0x1ffc)).unwrap();
        m.write_slice(&[9; 4], GuestAddress(0x3000)).unwrap();
        let h = HostMem::new(&m);
        let mut b = [0u8; 4];
        for _ in 0..2 {
            h.read(0x1ffc, &mut b).unwrap();
            assert_eq!(b, [7; 4]);
            // Just past the kept region (a hole), and just before it.
            assert!(h.read(0x2000, &mut b).is_err());
            assert!(h.read(0xffc, &mut b).is_err());
            assert!(h.read(0x1ffe, &mut b).is_err(), "runs into the hole");
            h.read(0x3000, &mut b).unwrap();
            assert_eq!(b, [9; 4]);
            let c = h.clone();
            assert!(c.read(0x4000, &mut b).is_err());
            c.read(0x1ffc, &mut b).unwrap();
            assert_eq!(b, [7; 4]);
        }
    }

    #[test]
    fn a_writable_range_lies_in_one_region_and_takes_no_byte_past_its_end() {
        let m = two_regions();
        let h = HostMem::new(&m);
        assert!(h.writable(0xff0, 0x20).is_none(), "across two regions");
        assert!(h.writable(0x1ff0, 0x20).is_none(), "past the mapping");
        let w = h.writable(0x1100, 0x40).unwrap();
        w.write_at(0, &[1; 0x10]).unwrap();
        w.write_at(0x30, &[2; 0x10]).unwrap();
        assert!(w.write_at(0x31, &[3; 0x10]).is_err());
        assert!(w.write_at(usize::MAX, &[3; 2]).is_err());
        // From another region's bytes, which cross into the first one.
        m.write_slice(&[5; 0x20], GuestAddress(0xff0)).unwrap();
        w.copy_from_guest_at(0x10, &h, 0xff0, 0x20).unwrap();
        assert!(w.copy_from_guest_at(0x30, &h, 0xff0, 0x11).is_err());
        let mut back = [0u8; 0x41];
        m.read_slice(&mut back, GuestAddress(0x1100)).unwrap();
        assert_eq!(back[..0x10], [1; 0x10]);
        assert_eq!(back[0x10..0x30], [5; 0x20]);
        assert_eq!(back[0x30..0x40], [2; 0x10]);
        assert_eq!(back[0x40], 0, "nothing past the range");
    }

    #[test]
    fn an_append_adds_the_range_whole_or_nothing() {
        let m = two_regions();
        let h = HostMem::new(&m);
        let data: Vec<u8> = (0..0x40u8).collect();
        m.write_slice(&data, GuestAddress(0xfe0)).unwrap();
        let mut out = vec![9u8; 3];
        h.read_append(0xfe0, 0x40, &mut out).unwrap();
        assert_eq!(out[..3], [9; 3]);
        assert_eq!(out[3..], data[..]);
        assert!(h.read_append(0x1fe0, 0x40, &mut out).is_err());
        assert_eq!(out.len(), 0x43, "nothing of a range partly mapped");
    }

    #[test]
    fn ring_fields_are_aligned_and_mapped() {
        let m = two_regions();
        let h = HostMem::new(&m);
        h.store_u16(0x100, 0xbeef, Ordering::Release).unwrap();
        assert_eq!(m.read_obj::<u16>(GuestAddress(0x100)).unwrap(), 0xbeef);
        assert_eq!(h.load_u16(0x100, Ordering::Acquire), Some(0xbeef));
        assert_eq!(h.load_u16(0x101, Ordering::Acquire), None);
        assert_eq!(h.load_u16(0x2000, Ordering::Acquire), None);
    }

    #[test]
    fn guest_to_guest_copies_cross_regions_on_both_sides() {
        let a = two_regions();
        let b = GuestMem::from_ranges(&[
            (GuestAddress(0x10000), 0x800),
            (GuestAddress(0x10800), 0x800),
        ])
        .unwrap();
        let data: Vec<u8> = (0..=255u8).cycle().take(0x300).collect();
        a.write_slice(&data, GuestAddress(0xf00)).unwrap();
        let (ha, hb) = (HostMem::new(&a), HostMem::new(&b));
        hb.copy_from_guest(0x10700, &ha, 0xf00, 0x300).unwrap();
        let mut back = vec![0u8; 0x300];
        b.read_slice(&mut back, GuestAddress(0x10700)).unwrap();
        assert_eq!(back, data);
        assert!(hb.copy_from_guest(0x10f00, &ha, 0, 0x200).is_err());
        assert!(hb.copy_from_guest(0x10000, &ha, 0x1f00, 0x200).is_err());
        // Overlapping ranges in one region move like memmove.
        ha.copy_from_guest(0xe10, &ha, 0xe00, 0x100)
            .unwrap_or_default();
        a.write_slice(&data[..0x100], GuestAddress(0xe00)).unwrap();
        ha.copy_from_guest(0xe10, &ha, 0xe00, 0x100).unwrap();
        let mut moved = vec![0u8; 0x100];
        a.read_slice(&mut moved, GuestAddress(0xe10)).unwrap();
        assert_eq!(moved, data[..0x100]);
    }
}

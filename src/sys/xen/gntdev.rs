//! `/dev/xen/gntdev`: a guest's shared ring pages mapped once per connection, and
//! packet data moved with `IOCTL_GNTDEV_GRANT_COPY`, many copies per ioctl. No data
//! page is ever mapped: Xen copies between the guest's granted page and our buffer.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::ptr::NonNull;
use std::sync::Arc;

use super::granted::{self, OWN_DOMAIN};
use super::shared_page::SharedPage;
use super::{ioc_none, DomId, GrantRef, PAGE_SIZE};
use crate::sys::check;

#[repr(C)]
struct MapGrantRef {
    count: u32,
    pad: u32,
    index: u64,
    domid: u32,
    gref: u32,
}

#[repr(C)]
struct UnmapGrantRef {
    index: u64,
    count: u32,
    pad: u32,
}

/// `struct gntdev_grant_copy_segment`: source and destination are each a local
/// address or a (ref, offset, domid) triple, 8 bytes either way.
#[repr(C)]
#[derive(Clone, Copy)]
struct CopySegment {
    source: [u64; 1],
    dest: [u64; 1],
    len: u16,
    flags: u16,
    status: i16,
    pad: u16,
}

#[repr(C)]
struct GrantCopy {
    count: u32,
    segments: *mut CopySegment,
}

const IOCTL_GNTDEV_MAP_GRANT_REF: libc::c_ulong =
    ioc_none(b'G', 0, std::mem::size_of::<MapGrantRef>());
const IOCTL_GNTDEV_UNMAP_GRANT_REF: libc::c_ulong =
    ioc_none(b'G', 1, std::mem::size_of::<UnmapGrantRef>());
const IOCTL_GNTDEV_GRANT_COPY: libc::c_ulong = ioc_none(b'G', 8, std::mem::size_of::<GrantCopy>());
const GNTCOPY_SOURCE_GREF: u16 = 1;
const GNTCOPY_DEST_GREF: u16 = 2;

/// A foreign (ref, offset, domid) as the copy segment's union packs it.
fn foreign(gref: GrantRef, offset: u16, dom: DomId) -> u64 {
    u64::from(gref) | (u64::from(offset) << 32) | (u64::from(dom) << 48)
}

/// One open `/dev/xen/gntdev`.
pub struct Gntdev {
    file: File,
}

/// One copy between a guest's granted page and a local buffer: `len` bytes at
/// `guest_off` in grant `gref` of domain `dom`, and at `local_off` in the buffer (an
/// address, for `copy_out_at`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CopyOp {
    pub dom: DomId,
    pub gref: GrantRef,
    pub guest_off: u16,
    pub len: u16,
    pub local_off: usize,
}

/// The outcome of a grant copy, one status per op (GNTST_*, 0: done), and the
/// ioctl's segment array, both kept from one copy to the next so a copy allocates
/// nothing once they have room.
#[derive(Default)]
pub struct CopyStatus {
    status: Vec<i16>,
    segs: Vec<CopySegment>,
}

impl std::ops::Deref for CopyStatus {
    type Target = [i16];
    fn deref(&self) -> &[i16] {
        &self.status
    }
}

impl Gntdev {
    pub fn open() -> io::Result<Gntdev> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_CLOEXEC)
            .open("/dev/xen/gntdev")?;
        Ok(Gntdev { file })
    }

    /// Maps one page granted by `dom` (a shared ring), read and write.
    pub fn map(self: &Arc<Self>, dom: DomId, gref: GrantRef) -> io::Result<MappedPage> {
        let mut arg = MapGrantRef {
            count: 1,
            pad: 0,
            index: 0,
            domid: u32::from(dom),
            gref,
        };
        // SAFETY: the ioctl reads and fills the struct we pass, which lives across the call.
        check(unsafe {
            libc::ioctl(
                self.file.as_raw_fd(),
                IOCTL_GNTDEV_MAP_GRANT_REF,
                &mut arg as *mut MapGrantRef,
            )
        })?;
        // SAFETY: a fresh shared mapping of the page gntdev just set up at `index`; no
        // Rust reference ever points into it (accesses go through MappedPage).
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                PAGE_SIZE,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                self.file.as_raw_fd(),
                arg.index as libc::off_t,
            )
        };
        if p == libc::MAP_FAILED {
            let e = io::Error::last_os_error();
            self.unmap_index(arg.index);
            return Err(e);
        }
        let ptr = NonNull::new(p.cast::<u8>()).ok_or_else(|| io::Error::other("mmap gave NULL"))?;
        Ok(MappedPage {
            dev: self.clone(),
            // SAFETY: a fresh PAGE_SIZE shared mapping, unmapped only by MappedPage's drop.
            page: unsafe { SharedPage::new(ptr) },
            index: arg.index,
        })
    }

    fn unmap_index(&self, index: u64) {
        let mut arg = UnmapGrantRef {
            index,
            count: 1,
            pad: 0,
        };
        // SAFETY: the ioctl reads the struct we pass, which lives across the call.
        let _ = unsafe {
            libc::ioctl(
                self.file.as_raw_fd(),
                IOCTL_GNTDEV_UNMAP_GRANT_REF,
                &mut arg as *mut UnmapGrantRef,
            )
        };
    }

    /// Copies from the guests' grants into `buf`, all of `ops` in one ioctl; `status`
    /// gets each copy's GNTST_* result (0: done).
    pub fn copy_in(
        &self,
        buf: &mut [u8],
        ops: &[CopyOp],
        status: &mut CopyStatus,
    ) -> io::Result<()> {
        self.copy(buf.as_mut_ptr(), buf.len(), ops, true, status)
    }

    /// Copies into the guests' grants, all of `ops` in one ioctl, from bytes named by
    /// address: each op's `local_off` is the address of its `len` bytes (which may lie
    /// in several buffers). The kernel only reads there, and fails an op whose
    /// address is not mapped; which bytes go out is the caller's business.
    pub fn copy_out_at(&self, ops: &[CopyOp], status: &mut CopyStatus) -> io::Result<()> {
        self.copy(std::ptr::null_mut(), usize::MAX, ops, false, status)
    }

    fn copy(
        &self,
        base: *mut u8,
        buf_len: usize,
        ops: &[CopyOp],
        inward: bool,
        out: &mut CopyStatus,
    ) -> io::Result<()> {
        let CopyStatus { status, segs } = out;
        status.clear();
        if ops.is_empty() {
            return Ok(());
        }
        granted::with_lookup(|lookup| {
            segments_into(segs, base as usize, buf_len, ops, inward, lookup)
        })?;
        let mut arg = GrantCopy {
            count: segs.len() as u32,
            segments: segs.as_mut_ptr(),
        };
        // SAFETY: for copies into our memory (copy_in), every segment's local bytes
        // lie within the caller's buffer (checked by `segments`), borrowed mutably for the
        // whole call: given by address, or by the ref and offset of exactly those
        // bytes in our own granted page. Copies toward a grant only read local memory
        // (gntdev pins the pages and fails a segment whose address is not mapped), so
        // no address can make the kernel write to us. The segment array lives across
        // the call.
        check(unsafe {
            libc::ioctl(
                self.file.as_raw_fd(),
                IOCTL_GNTDEV_GRANT_COPY,
                &mut arg as *mut GrantCopy,
            )
        })?;
        op_status(segs, ops, status);
        Ok(())
    }
}

/// The ioctl's segments for `ops` (`local_off` relative to `base`, within
/// `buf_len`), each op's one after another, at least one per op, their lengths
/// adding up to the op's: bytes of ours that `lookup` names by grant (a buffer
/// granted to ourselves) go by ref, one segment per page of ours they touch (a grant
/// is one page); others go by address, whole, which gntdev splits.
#[cfg(test)]
fn segments(
    base: usize,
    buf_len: usize,
    ops: &[CopyOp],
    inward: bool,
    lookup: &dyn Fn(usize) -> Option<(GrantRef, u16)>,
) -> io::Result<Vec<CopySegment>> {
    let mut segs = Vec::new();
    segments_into(&mut segs, base, buf_len, ops, inward, lookup)?;
    Ok(segs)
}

/// `segments` into `segs` (cleared first).
fn segments_into(
    segs: &mut Vec<CopySegment>,
    base: usize,
    buf_len: usize,
    ops: &[CopyOp],
    inward: bool,
    lookup: &dyn Fn(usize) -> Option<(GrantRef, u16)>,
) -> io::Result<()> {
    segs.clear();
    for op in ops {
        let end = op.local_off.checked_add(usize::from(op.len));
        if end.is_none_or(|e| e > buf_len)
            || usize::from(op.guest_off) + usize::from(op.len) > PAGE_SIZE
        {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "copy out of bounds",
            ));
        }
        let local = base.wrapping_add(op.local_off);
        let mut done = 0usize;
        loop {
            let at = local.wrapping_add(done);
            let left = usize::from(op.len) - done;
            let remote = foreign(op.gref, op.guest_off + done as u16, op.dom);
            let (ours, len, flags) = match lookup(at) {
                Some((gref, off)) => (
                    foreign(gref, off, OWN_DOMAIN),
                    left.min(PAGE_SIZE - usize::from(off)),
                    GNTCOPY_SOURCE_GREF | GNTCOPY_DEST_GREF,
                ),
                None if inward => (at as u64, left, GNTCOPY_SOURCE_GREF),
                None => (at as u64, left, GNTCOPY_DEST_GREF),
            };
            segs.push(CopySegment {
                source: [if inward { remote } else { ours }],
                dest: [if inward { ours } else { remote }],
                len: len as u16,
                flags,
                status: 0,
                pad: 0,
            });
            done += len;
            if done >= usize::from(op.len) {
                break;
            }
        }
    }
    Ok(())
}

/// Each op's status into `status`: its first failed segment's, else 0 (`segs` as
/// `segments` made them for `ops`).
fn op_status(segs: &[CopySegment], ops: &[CopyOp], status: &mut Vec<i16>) {
    status.clear();
    let mut next = segs.iter();
    status.extend(ops.iter().map(|op| {
        let (mut first_failed, mut covered) = (0, 0usize);
        for seg in next.by_ref() {
            if first_failed == 0 {
                first_failed = seg.status;
            }
            covered += usize::from(seg.len);
            if covered >= usize::from(op.len) {
                break;
            }
        }
        first_failed
    }));
}

/// A guest page mapped into gsonet (a shared ring), unmapped on drop.
pub struct MappedPage {
    dev: Arc<Gntdev>,
    page: SharedPage,
    index: u64,
}

impl std::ops::Deref for MappedPage {
    type Target = SharedPage;
    fn deref(&self) -> &SharedPage {
        &self.page
    }
}

impl Drop for MappedPage {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the page `map` mapped; nothing refers into it after.
        unsafe { libc::munmap(self.page.ptr.as_ptr().cast(), PAGE_SIZE) };
        self.dev.unmap_index(self.index);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ioctl_layouts_match_the_kernel_headers() {
        assert_eq!(std::mem::size_of::<CopySegment>(), 24);
        assert_eq!(std::mem::size_of::<GrantCopy>(), 16);
        assert_eq!(std::mem::size_of::<MapGrantRef>(), 24);
        assert_eq!(IOCTL_GNTDEV_GRANT_COPY, 0x0010_4708);
        assert_eq!(IOCTL_GNTDEV_MAP_GRANT_REF, 0x0018_4700);
        // ref in the low 32 bits, then offset, then domid.
        assert_eq!(foreign(7, 0x10, 3), 0x0003_0010_0000_0007);
    }

    /// Two pages of ours at 0x10000 granted to ourselves as refs 100 and 101.
    fn granted_at_0x10000(addr: usize) -> Option<(GrantRef, u16)> {
        (0x10000..0x12000).contains(&addr).then(|| {
            (
                100 + ((addr - 0x10000) / PAGE_SIZE) as u32,
                (addr % PAGE_SIZE) as u16,
            )
        })
    }

    fn op(local_off: usize, len: u16, guest_off: u16) -> CopyOp {
        CopyOp {
            dom: 5,
            gref: 9,
            guest_off,
            len,
            local_off,
        }
    }

    #[test]
    fn bytes_of_ours_granted_to_ourselves_go_by_ref_one_segment_per_page() {
        // Out of a granted buffer, straddling its two pages: two segments, both
        // sides by ref, the guest's offset advancing with the first one's length.
        let segs = segments(
            0,
            usize::MAX,
            &[op(0x10f00, 0x300, 0x40)],
            false,
            &granted_at_0x10000,
        )
        .unwrap();
        assert_eq!(segs.len(), 2);
        assert_eq!(segs[0].source[0], foreign(100, 0xf00, OWN_DOMAIN));
        assert_eq!(segs[0].dest[0], foreign(9, 0x40, 5));
        assert_eq!(segs[0].len, 0x100);
        assert_eq!(segs[1].source[0], foreign(101, 0, OWN_DOMAIN));
        assert_eq!(segs[1].dest[0], foreign(9, 0x140, 5));
        assert_eq!(segs[1].len, 0x200);
        for s in &segs {
            assert_eq!(s.flags, GNTCOPY_SOURCE_GREF | GNTCOPY_DEST_GREF);
        }
        // Into it (offsets relative to a base): the guest is the source.
        let segs = segments(
            0x10000,
            0x2000,
            &[op(0x20, 0x80, 0)],
            true,
            &granted_at_0x10000,
        )
        .unwrap();
        assert_eq!(segs.len(), 1);
        assert_eq!(segs[0].source[0], foreign(9, 0, 5));
        assert_eq!(segs[0].dest[0], foreign(100, 0x20, OWN_DOMAIN));
    }

    #[test]
    fn an_op_fails_when_any_of_its_segments_does() {
        let mut segs = segments(
            0,
            usize::MAX,
            &[op(0x10f00, 0x300, 0), op(0x10000, 4, 0)],
            false,
            &granted_at_0x10000,
        )
        .unwrap();
        segs[1].status = -1; // the first op's second page
        let ops = [op(0x10f00, 0x300, 0), op(0x10000, 4, 0)];
        let mut status = vec![7];
        op_status(&segs, &ops, &mut status);
        assert_eq!(status, vec![-1, 0]);
        // The second op's own segment fails, the first op's are done.
        segs[1].status = 0;
        segs[2].status = -3;
        op_status(&segs, &ops, &mut status);
        assert_eq!(status, vec![0, -3]);
    }

    #[test]
    fn an_empty_op_is_still_one_segment_with_its_own_status() {
        // As before buffers were granted: the grant is still checked.
        for lookup in [&granted_at_0x10000 as &dyn Fn(usize) -> _, &|_| None] {
            let ops = [op(0x10100, 0, 0), op(0x10200, 8, 0)];
            let mut segs = segments(0, usize::MAX, &ops, true, lookup).unwrap();
            assert_eq!(segs.len(), 2);
            assert_eq!(segs[0].len, 0);
            segs[0].status = -1;
            let mut status = Vec::new();
            op_status(&segs, &ops, &mut status);
            assert_eq!(status, vec![-1, 0]);
        }
    }

    #[test]
    fn other_bytes_go_by_address_whole_and_ops_outside_the_buffer_are_refused() {
        let ops = [op(0x30f00, 0x300, 0), op(0x11000, 0x10, 0)];
        let segs = segments(0, usize::MAX, &ops, false, &granted_at_0x10000).unwrap();
        assert_eq!(segs.len(), 2, "one segment per op");
        assert_eq!(segs[0].source[0], 0x30f00, "by address, not split");
        assert_eq!((segs[0].len, segs[0].flags), (0x300, GNTCOPY_DEST_GREF));
        assert_eq!(segs[1].source[0], foreign(101, 0, OWN_DOMAIN));
        let segs = segments(
            0x40000,
            0x1000,
            &[op(0x10, 0x20, 0)],
            true,
            &granted_at_0x10000,
        )
        .unwrap();
        assert_eq!(
            (segs[0].dest[0], segs[0].flags),
            (0x40010, GNTCOPY_SOURCE_GREF)
        );
        // Past the caller's buffer, or past the guest's page: nothing is copied.
        assert!(segments(0, 0x1000, &[op(0xff0, 0x20, 0)], true, &|_| None).is_err());
        assert!(segments(0, usize::MAX, &[op(0, 0x20, 0xff0)], false, &|_| None).is_err());
    }
}

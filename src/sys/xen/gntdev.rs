//! `/dev/xen/gntdev`: a guest's shared ring pages mapped once per connection, and
//! packet data moved with `IOCTL_GNTDEV_GRANT_COPY`, many copies per ioctl. No data
//! page is ever mapped: Xen copies between the guest's granted page and our buffer.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::ptr::NonNull;
use std::sync::atomic::{fence, AtomicU32, Ordering};
use std::sync::Arc;

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
    pub fn copy_in(&self, buf: &mut [u8], ops: &[CopyOp], status: &mut Vec<i16>) -> io::Result<()> {
        self.copy(buf.as_mut_ptr(), buf.len(), ops, true, status)
    }

    /// Copies into the guests' grants, all of `ops` in one ioctl, from bytes named by
    /// address: each op's `local_off` is the address of its `len` bytes (which may lie
    /// in several buffers). The kernel only reads there, and fails an op whose
    /// address is not mapped; which bytes go out is the caller's business.
    pub fn copy_out_at(&self, ops: &[CopyOp], status: &mut Vec<i16>) -> io::Result<()> {
        self.copy(std::ptr::null_mut(), usize::MAX, ops, false, status)
    }

    fn copy(
        &self,
        base: *mut u8,
        buf_len: usize,
        ops: &[CopyOp],
        inward: bool,
        status: &mut Vec<i16>,
    ) -> io::Result<()> {
        status.clear();
        if ops.is_empty() {
            return Ok(());
        }
        let mut segs = Vec::with_capacity(ops.len());
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
            // The address stays within `buf` (checked above; for copy_out_at `buf` is all
            // of memory); it is only handed to the kernel.
            let local = base.wrapping_add(op.local_off) as u64;
            let remote = foreign(op.gref, op.guest_off, op.dom);
            segs.push(CopySegment {
                source: [if inward { remote } else { local }],
                dest: [if inward { local } else { remote }],
                len: op.len,
                flags: if inward {
                    GNTCOPY_SOURCE_GREF
                } else {
                    GNTCOPY_DEST_GREF
                },
                status: 0,
                pad: 0,
            });
        }
        let mut arg = GrantCopy {
            count: segs.len() as u32,
            segments: segs.as_mut_ptr(),
        };
        // SAFETY: for copies into our memory (copy_in), every segment's local address
        // lies within the caller's buffer (checked above), borrowed mutably for the
        // whole call. Copies toward a grant only read local memory (gntdev pins the
        // pages and fails a segment whose address is not mapped), so no address can
        // make the kernel write to us. The segment array lives across the call.
        check(unsafe {
            libc::ioctl(
                self.file.as_raw_fd(),
                IOCTL_GNTDEV_GRANT_COPY,
                &mut arg as *mut GrantCopy,
            )
        })?;
        status.extend(segs.iter().map(|s| s.status));
        Ok(())
    }
}

/// A page shared with another domain (a ring): the other side writes it at any
/// time, so it is only read and written through volatile and atomic accesses, never
/// as a Rust slice.
pub struct SharedPage {
    ptr: NonNull<u8>,
}

// SAFETY: the page is plain shared memory; all accesses are atomic.
unsafe impl Send for SharedPage {}
// SAFETY: as above; concurrent accesses are the ring protocol's business.
unsafe impl Sync for SharedPage {}

impl SharedPage {
    /// SAFETY: `ptr` is a page-aligned mapping of PAGE_SIZE bytes that outlives the
    /// value.
    pub(super) unsafe fn new(ptr: NonNull<u8>) -> SharedPage {
        SharedPage { ptr }
    }

    fn at32(&self, off: usize) -> &AtomicU32 {
        assert!(
            off.is_multiple_of(4) && off + 4 <= PAGE_SIZE,
            "ring offset {off}"
        );
        // SAFETY: aligned, in bounds (asserted), and the page lives as long as self.
        unsafe { &*self.ptr.as_ptr().add(off).cast::<AtomicU32>() }
    }

    /// Reads a ring index (acquire: what the other side wrote before it is visible).
    pub fn load(&self, off: usize) -> u32 {
        self.at32(off).load(Ordering::Acquire)
    }

    /// Writes a ring index (release: what we wrote before it is visible first).
    pub fn store(&self, off: usize, v: u32) {
        self.at32(off).store(v, Ordering::Release)
    }

    /// Copies `out.len()` bytes at `off` (4-aligned) out of the page.
    pub fn read(&self, off: usize, out: &mut [u8]) {
        for (i, chunk) in out.chunks_mut(4).enumerate() {
            let w = self.at32(off + 4 * i).load(Ordering::Relaxed).to_le_bytes();
            chunk.copy_from_slice(&w[..chunk.len()]);
        }
    }

    /// Writes `bytes` at `off` (4-aligned); a last partial word is zero-padded.
    pub fn write(&self, off: usize, bytes: &[u8]) {
        for (i, c) in bytes.chunks(4).enumerate() {
            let mut w = [0u8; 4];
            w[..c.len()].copy_from_slice(c);
            self.at32(off + 4 * i)
                .store(u32::from_le_bytes(w), Ordering::Relaxed);
        }
    }

    /// A full barrier between our index writes and the other side's event index reads.
    pub fn full_fence(&self) {
        fence(Ordering::SeqCst);
    }
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
}

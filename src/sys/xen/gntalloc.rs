//! `/dev/xen/gntalloc`: pages of our own granted to a domain, as a frontend shares its
//! rings and buffers. The Xen rig's hostile netfront (examples/xen_netfront.rs) plays
//! a guest inside dom0 with them; gsonet's netback grants its copy buffers to its own
//! domain with them (`granted`), so grant copies name them by ref.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::ptr::NonNull;

use super::shared_page::SharedPage;
use super::{ioc_none, DomId, GrantRef, PAGE_SIZE};
use crate::sys::check;

/// Pages allocated by one call, at most. The module's `limit` parameter bounds what
/// all its users hold together (1024 pages by default).
pub const MAX_PAGES: usize = 1 << 16;

/// `struct ioctl_gntalloc_alloc_gref` without its trailing refs (`count` of them
/// follow it in the same buffer).
#[repr(C)]
struct AllocGref {
    domid: u16,
    flags: u16,
    count: u32,
    index: u64,
}

const GNTALLOC_FLAG_WRITABLE: u16 = 1;
/// The kernel's size for the struct is that of its one-element form (24 bytes).
const IOCTL_GNTALLOC_ALLOC_GREF: libc::c_ulong = ioc_none(b'G', 5, 24);

/// `count` zeroed pages granted (read-write) to one domain, mapped here. The grants
/// end when the value is dropped (the pages are freed once the other side unmaps).
pub struct GrantedPages {
    _file: File,
    base: NonNull<u8>,
    pages: Vec<SharedPage>,
    grefs: Vec<GrantRef>,
}

// SAFETY: the mapping is plain memory owned by the value; accesses go through
// SharedPage (atomic) or through `granted::GrantedBuf`, which borrows it.
unsafe impl Send for GrantedPages {}
// SAFETY: as above: `&GrantedPages` hands out only SharedPages and addresses.
unsafe impl Sync for GrantedPages {}

impl GrantedPages {
    pub fn alloc(dom: DomId, count: usize) -> io::Result<GrantedPages> {
        if count == 0 || count > MAX_PAGES {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{count} pages: 1..={MAX_PAGES} at once"),
            ));
        }
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_CLOEXEC)
            .open("/dev/xen/gntalloc")?;
        // The header, then room for `count` refs, in one 8-byte aligned buffer.
        let head = std::mem::size_of::<AllocGref>();
        let mut arg = vec![0u64; (head + 4 * count).div_ceil(8)];
        let header = AllocGref {
            domid: dom,
            flags: GNTALLOC_FLAG_WRITABLE,
            count: count as u32,
            index: 0,
        };
        // SAFETY: `arg` is 8-aligned and longer than the header.
        unsafe { arg.as_mut_ptr().cast::<AllocGref>().write(header) };
        // SAFETY: the kernel reads the header and writes `count` refs after it, for
        // which `arg` has room; the buffer lives across the call.
        check(unsafe {
            libc::ioctl(
                file.as_raw_fd(),
                IOCTL_GNTALLOC_ALLOC_GREF,
                arg.as_mut_ptr(),
            )
        })?;
        // SAFETY: the header, as the kernel left it (with `index` set).
        let index = unsafe { arg.as_ptr().cast::<AllocGref>().read() }.index;
        // SAFETY: the `count` refs after the header, all within `arg`.
        let refs = unsafe {
            std::slice::from_raw_parts(arg.as_ptr().cast::<u8>().add(head).cast::<u32>(), count)
        };
        let grefs = refs.to_vec();
        let len = count * PAGE_SIZE;
        // SAFETY: maps the pages the ioctl allocated at `index`; checked below.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                index as libc::off_t,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let base =
            NonNull::new(p.cast::<u8>()).ok_or_else(|| io::Error::other("mmap gave NULL"))?;
        let pages = (0..count)
            .map(|i| {
                // SAFETY: page i of the mapping, which lives until our drop (after the
                // pages vector is gone).
                unsafe { SharedPage::new(base.add(i * PAGE_SIZE)) }
            })
            .collect();
        Ok(GrantedPages {
            _file: file,
            base,
            pages,
            grefs,
        })
    }

    /// The first byte of the pages, which lie one after another.
    pub fn base(&self) -> NonNull<u8> {
        self.base
    }

    /// Bytes mapped: the number of pages times PAGE_SIZE.
    pub fn bytes(&self) -> usize {
        self.grefs.len() * PAGE_SIZE
    }

    /// The grant ref of each page, in order.
    pub fn grefs(&self) -> &[GrantRef] {
        &self.grefs
    }

    pub fn page(&self, i: usize) -> &SharedPage {
        &self.pages[i]
    }

    pub fn gref(&self, i: usize) -> GrantRef {
        self.grefs[i]
    }
}

impl Drop for GrantedPages {
    fn drop(&mut self) {
        self.pages.clear();
        // SAFETY: unmaps exactly the mapping `alloc` made; no SharedPage is left.
        unsafe { libc::munmap(self.base.as_ptr().cast(), self.bytes()) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ioctl_layout_matches_the_kernel_header() {
        // domid, flags, count, index, then the refs: the first at offset 16.
        assert_eq!(std::mem::offset_of!(AllocGref, index), 8);
        assert_eq!(std::mem::size_of::<AllocGref>(), 16);
        assert_eq!(IOCTL_GNTALLOC_ALLOC_GREF, 0x0018_4705);
    }
}

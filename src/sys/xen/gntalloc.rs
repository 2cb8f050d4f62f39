//! `/dev/xen/gntalloc`: pages of our own granted to another domain, as a frontend
//! shares its rings and buffers. gsonet's netback never needs it; the Xen rig's
//! hostile netfront (examples/xen_netfront.rs) does, to play a guest inside dom0.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::ptr::NonNull;

use super::gntdev::SharedPage;
use super::{ioc_none, DomId, GrantRef, PAGE_SIZE};
use crate::sys::check;

/// Pages allocated by one call (kept small: a netfront's rings and a few buffers).
pub const MAX_PAGES: usize = 64;

/// `struct ioctl_gntalloc_alloc_gref` with room for MAX_PAGES grant refs.
#[repr(C)]
struct AllocGref {
    domid: u16,
    flags: u16,
    count: u32,
    index: u64,
    gref_ids: [u32; MAX_PAGES],
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
        let mut arg = AllocGref {
            domid: dom,
            flags: GNTALLOC_FLAG_WRITABLE,
            count: count as u32,
            index: 0,
            gref_ids: [0; MAX_PAGES],
        };
        // SAFETY: the kernel reads the header and writes `count` refs into gref_ids,
        // which has room for MAX_PAGES >= count; the struct lives across the call.
        check(unsafe {
            libc::ioctl(
                file.as_raw_fd(),
                IOCTL_GNTALLOC_ALLOC_GREF,
                &mut arg as *mut AllocGref,
            )
        })?;
        let len = count * PAGE_SIZE;
        // SAFETY: maps the pages the ioctl allocated at `index`; checked below.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                arg.index as libc::off_t,
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
            grefs: arg.gref_ids[..count].to_vec(),
        })
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
        let len = self.pages.len() * PAGE_SIZE;
        self.pages.clear();
        // SAFETY: unmaps exactly the mapping `alloc` made; no SharedPage is left.
        unsafe { libc::munmap(self.base.as_ptr().cast(), len) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ioctl_layout_matches_the_kernel_header() {
        // domid, flags, count, index, then the refs: the first at offset 16.
        assert_eq!(std::mem::offset_of!(AllocGref, index), 8);
        assert_eq!(std::mem::offset_of!(AllocGref, gref_ids), 16);
        assert_eq!(IOCTL_GNTALLOC_ALLOC_GREF, 0x0018_4705);
    }
}

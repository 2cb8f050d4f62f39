//! Copy buffers whose pages we grant to our own domain, so that grant copies name
//! them by grant ref instead of by address. gntdev pins every local page of a copy
//! given by address and releases it afterwards, which in a PV dom0 walks the page
//! tables and translates frame numbers for each 4 KiB (about 5 % of dom0's time
//! per byte moved, docs/benchmarks.md); by ref, Xen takes the page through our own
//! grant table and the kernel does nothing per page.
//!
//! Every such buffer is listed, while it lives, in a process-wide table that
//! `gntdev`'s copies consult for each local address. Only our own domain holds
//! these grants, so the pages are ours alone, as any other buffer. (A netfront
//! names its grants with its own domain id, so no guest can reach them; a frontend
//! inside dom0 itself could, but dom0 can do anything to us anyway.)

use std::io;
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::RwLock;

use super::gntalloc::GrantedPages;
use super::{DomId, GrantRef, PAGE_SIZE};

/// The domain gsonet runs in: dom0 (it serves `/local/domain/0/backend/vif`).
pub const OWN_DOMAIN: DomId = 0;

/// A listed buffer: its address range and its pages' refs.
struct Listed {
    start: usize,
    end: usize,
    grefs: Vec<GrantRef>,
}

static LISTED: RwLock<Vec<Listed>> = RwLock::new(Vec::new());

/// Pages all listed buffers may hold together: 64 MiB, half of the 32768 grant
/// refs of a dom0 grant table at Xen's default size, so the rest of dom0 keeps refs
/// of its own. Past it, buffers are refused (and callers use plain memory).
pub const MAX_GRANTED_PAGES: usize = 16384;

/// Pages reserved for listed buffers (or about to be), at most MAX_GRANTED_PAGES.
static RESERVED: AtomicUsize = AtomicUsize::new(0);

/// Takes `n` pages of the budget, or says why not.
fn reserve(n: usize) -> io::Result<()> {
    RESERVED
        .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |held| {
            held.checked_add(n).filter(|&t| t <= MAX_GRANTED_PAGES)
        })
        .map(|_| ())
        .map_err(|held| {
            io::Error::other(format!(
                "{n} more pages would pass gsonet's own cap of {MAX_GRANTED_PAGES} granted \
                 pages ({held} held)"
            ))
        })
}

fn unreserve(n: usize) {
    RESERVED.fetch_sub(n, Ordering::Relaxed);
}

/// Bytes in whole pages granted to our own domain, listed while the value lives.
pub struct GrantedBuf {
    pages: GrantedPages,
}

impl GrantedBuf {
    /// At least `len` bytes (rounded up to pages), zeroed.
    pub fn new(len: usize) -> io::Result<GrantedBuf> {
        let n = len.div_ceil(PAGE_SIZE).max(1);
        reserve(n)?;
        let pages = GrantedPages::alloc(OWN_DOMAIN, n).inspect_err(|_| unreserve(n))?;
        let start = pages.base().as_ptr() as usize;
        LISTED
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .push(Listed {
                start,
                end: start + pages.bytes(),
                grefs: pages.grefs().to_vec(),
            });
        Ok(GrantedBuf { pages })
    }
}

impl Drop for GrantedBuf {
    fn drop(&mut self) {
        let start = self.pages.base().as_ptr() as usize;
        LISTED
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|l| l.start != start);
        unreserve(self.pages.bytes() / PAGE_SIZE);
    }
}

impl Deref for GrantedBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: the mapping is `len` bytes, lives as long as `pages`, and no other
        // domain holds its grants: only we (and Xen, copying for us while we lend
        // it mutably) write it.
        unsafe { std::slice::from_raw_parts(self.pages.base().as_ptr(), self.pages.bytes()) }
    }
}

impl DerefMut for GrantedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `deref`; `&mut self` makes this the only borrow.
        unsafe { std::slice::from_raw_parts_mut(self.pages.base().as_ptr(), self.pages.bytes()) }
    }
}

/// A copy buffer: granted to ourselves where gntalloc allows, plain memory else.
pub enum CopyBuf {
    Granted(GrantedBuf),
    Plain(Vec<u8>),
}

impl CopyBuf {
    /// `len` bytes of plain memory.
    pub fn plain(len: usize) -> CopyBuf {
        CopyBuf::Plain(vec![0u8; len])
    }

    /// `len` bytes granted to ourselves, or the reason they are not (and plain
    /// memory instead).
    pub fn granted(len: usize) -> (CopyBuf, Option<io::Error>) {
        match GrantedBuf::new(len) {
            Ok(g) => (CopyBuf::Granted(g), None),
            Err(e) => (CopyBuf::plain(len), Some(e)),
        }
    }
}

impl Deref for CopyBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            CopyBuf::Granted(g) => g,
            CopyBuf::Plain(v) => v,
        }
    }
}

impl DerefMut for CopyBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        match self {
            CopyBuf::Granted(g) => g,
            CopyBuf::Plain(v) => v,
        }
    }
}

/// Calls `f` with a lookup from a local address to the grant ref and page offset
/// that name it, for addresses in a listed buffer. The table is read-locked for the
/// call: a buffer cannot leave it meanwhile (and one an address lies in cannot be
/// freed anyway while a copy uses that address, by the copy's own contract).
pub(super) fn with_lookup<R>(f: impl FnOnce(&dyn Fn(usize) -> Option<(GrantRef, u16)>) -> R) -> R {
    let listed = LISTED.read().unwrap_or_else(|e| e.into_inner());
    let lookup = |addr: usize| {
        let l = listed.iter().find(|l| l.start <= addr && addr < l.end)?;
        let off = addr - l.start;
        Some((l.grefs[off / PAGE_SIZE], (off % PAGE_SIZE) as u16))
    };
    f(&lookup)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_page_budget_refuses_past_its_cap_and_gives_back() {
        // The only test touching the budget (no gntalloc here: nothing else takes it).
        reserve(MAX_GRANTED_PAGES - 10).unwrap();
        let e = reserve(11).unwrap_err();
        assert!(e.to_string().contains("cap of 16384"), "{e}");
        reserve(10).unwrap();
        assert!(reserve(1).is_err());
        unreserve(MAX_GRANTED_PAGES);
        reserve(1).unwrap();
        unreserve(1);
    }

    #[test]
    fn an_address_outside_every_listed_buffer_is_named_by_address() {
        let v = [0u8; 64];
        assert_eq!(with_lookup(|l| l(v.as_ptr() as usize)), None);
    }
}

//! A page shared with another domain (a ring, or a page a test netfront grants):
//! the other side may write it at any time, so it is read and written only through
//! atomic accesses.

use std::ptr::NonNull;
use std::sync::atomic::{fence, AtomicU32, Ordering};

use super::PAGE_SIZE;

/// A page shared with another domain (a ring): the other side writes it at any
/// time, so it is only read and written through volatile and atomic accesses, never
/// as a Rust slice.
pub struct SharedPage {
    pub(super) ptr: NonNull<u8>,
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

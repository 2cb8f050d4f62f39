//! Guest memory as mapped from the frontend's memory table. It is only ever read and
//! written through vm-memory's accessors (volatile copies): the guest may change
//! these bytes at any time, so gsonet never holds a plain `&[u8]` over them. Every
//! write through them also marks its pages in the frontend's dirty log while a live
//! migration has logging on (`DirtyLog`).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use thiserror::Error;
use vhost_user_backend::bitmap::{AtomicBitmapMmap, BitmapMmapRegion, BitmapReplace};
use vm_memory::bitmap::{Bitmap, RefSlice, WithBitmapSlice};
use vm_memory::mmap::NewBitmap;
use vm_memory::GuestMemoryMmap;

/// Guest memory as mapped from the frontend's memory table, each region with its
/// dirty-page log.
pub type GuestMem = GuestMemoryMmap<DirtyLog>;

/// The dirty-page log of one memory region: the vhost crate's `BitmapMmapRegion`, which
/// SET_LOG_BASE points at the frontend's shared log (one bit per 4 KiB guest page),
/// behind a switch. SET_LOG_BASE turns it on; features acked without LOG_ALL (the
/// migration ended or was cancelled) turn it off, which the crate alone cannot do.
/// While off, a write costs one relaxed load; slices borrow the region's log instead
/// of cloning it on every access.
#[derive(Clone, Debug, Default)]
pub struct DirtyLog {
    inner: BitmapMmapRegion,
    on: Arc<AtomicBool>,
}

impl DirtyLog {
    /// Whether writes are being logged.
    pub fn logging(&self) -> bool {
        self.on.load(Ordering::Acquire)
    }

    /// Stops logging (the mapping stays until the next SET_LOG_BASE replaces it).
    pub fn stop(&self) {
        self.on.store(false, Ordering::Release);
    }
}

impl<'a> WithBitmapSlice<'a> for DirtyLog {
    type S = RefSlice<'a, DirtyLog>;
}

impl Bitmap for DirtyLog {
    fn mark_dirty(&self, offset: usize, len: usize) {
        if self.on.load(Ordering::Relaxed) {
            self.inner.mark_dirty(offset, len);
        }
    }

    fn dirty_at(&self, offset: usize) -> bool {
        self.on.load(Ordering::Relaxed) && self.inner.dirty_at(offset)
    }

    fn slice_at(&self, offset: usize) -> RefSlice<'_, DirtyLog> {
        RefSlice::new(self, offset)
    }
}

impl NewBitmap for DirtyLog {
    fn with_len(_len: usize) -> Self {
        DirtyLog::default()
    }
}

impl BitmapReplace for DirtyLog {
    type InnerBitmap = AtomicBitmapMmap;

    fn replace(&self, bitmap: AtomicBitmapMmap) {
        self.inner.replace(bitmap);
        self.on.store(true, Ordering::Release);
    }
}

/// Stops dirty logging in every region of `mem`.
pub fn stop_logging(mem: &GuestMem) {
    use vm_memory::GuestMemoryBackend;
    for r in mem.iter() {
        let region: &vm_memory::MmapRegion<DirtyLog> = r;
        region.bitmap().stop();
    }
}

/// Whether any region of `mem` logs its writes.
pub fn logging(mem: &GuestMem) -> bool {
    use vm_memory::GuestMemoryBackend;
    mem.iter().any(|r| {
        let region: &vm_memory::MmapRegion<DirtyLog> = r;
        region.bitmap().logging()
    })
}

#[derive(Debug, Error, Clone, Copy, PartialEq, Eq)]
#[error("guest range {addr:#x}+{len} is not mapped")]
pub struct BadRange {
    pub addr: u64,
    pub len: usize,
}

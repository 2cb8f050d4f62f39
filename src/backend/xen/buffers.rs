//! Where gsonet's Xen copy buffers come from: the tap queues' read arenas and each
//! vif worker's TX buffer are pages granted to gsonet's own domain when Xen vifs are
//! configured, so grant copies from and into them pin nothing (`sys::xen::granted`);
//! plain memory otherwise, or when gntalloc refuses (then logged once).

use std::sync::atomic::{AtomicBool, Ordering};

use tracing::{debug, warn};

use crate::sys::xen::granted::CopyBuf;
use crate::sys::xen::PAGE_SIZE;

static WANTED: AtomicBool = AtomicBool::new(false);
static REFUSED: AtomicBool = AtomicBool::new(false);

/// From now on, copy buffers are granted to ourselves (set when Xen vifs are
/// configured, before any uplink is opened).
pub fn want_granted() {
    WANTED.store(true, Ordering::Relaxed);
}

/// `len` bytes for frames that Xen copies from or into; `what` names them in the log.
pub fn copy_buffer(len: usize, what: &str) -> CopyBuf {
    if !WANTED.load(Ordering::Relaxed) {
        return CopyBuf::plain(len);
    }
    let (buf, refused) = CopyBuf::granted(len);
    match refused {
        None => debug!(
            buffer = what,
            bytes = len,
            "copy buffer granted to our own domain"
        ),
        Some(e) if !REFUSED.swap(true, Ordering::Relaxed) => warn!(
            buffer = what,
            pages = len.div_ceil(PAGE_SIZE),
            "cannot grant copy buffers to our own domain ({e}): grant copies pin their \
             pages instead, which costs dom0 more per byte (docs/xen.md: xen_gntalloc \
             and its limit)"
        ),
        Some(e) => debug!(buffer = what, "copy buffer not granted: {e}"),
    }
    buf
}

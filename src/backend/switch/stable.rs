//! Bytes a sending thread keeps as they are until its next `DeliverCtx::flush`.
//!
//! A destination that copies late (a Xen vif grant-copies a whole batch when the
//! sender flushes) may keep the address of such bytes instead of a copy of them. A
//! sender declares its frame buffer for the span of a batch; a destination asks
//! `holds` of each part it is given. Anything outside (a segment the segmenter
//! wrote, a VLAN header built on the stack) is copied as before.
//!
//! The promise the declaring thread makes: no byte of the region handed to a
//! destination in this span changes, nor is freed, before the thread's next flush of
//! the `DeliverCtx` it sent with (which signals that destination, and it copies
//! then). Destinations keep such addresses only until that signal, or until they
//! drop what they staged.

use std::cell::Cell;
use std::marker::PhantomData;
use std::ops::Range;

thread_local! {
    static REGION: Cell<Range<usize>> = const { Cell::new(0..0) };
}

/// This thread's declaration; the one before it is back when it drops.
pub struct Declared {
    before: Range<usize>,
    // Neither Send nor Sync: the declaration is this thread's.
    _thread: PhantomData<*const ()>,
}

/// Declares `region` (start and end address of the sender's buffer) stable for the
/// span of the returned value: see the module's promise, which the caller keeps.
pub fn declare(region: Range<*const u8>) -> Declared {
    let now = region.start as usize..region.end as usize;
    Declared {
        before: REGION.replace(now),
        _thread: PhantomData,
    }
}

impl Drop for Declared {
    fn drop(&mut self) {
        REGION.set(self.before.clone());
    }
}

/// Whether `part` lies wholly in what this thread declared stable.
pub fn holds(part: &[u8]) -> bool {
    let r = part.as_ptr_range();
    let region = REGION.with(|r| {
        let now = r.take();
        r.set(now.clone());
        now
    });
    !part.is_empty() && region.start <= r.start as usize && r.end as usize <= region.end
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_parts_inside_the_declared_region_on_this_thread_are_stable() {
        let buf = vec![7u8; 4096];
        let other = [1u8; 64];
        assert!(!holds(&buf[..10]), "nothing is declared yet");
        {
            let _d = declare(buf.as_ptr_range());
            assert!(holds(&buf[..]));
            assert!(holds(&buf[100..200]));
            assert!(!holds(&other[..]));
            assert!(!holds(&buf[..0]), "an empty part has no address to keep");
            let inner = [2u8; 16];
            {
                let _n = declare(inner.as_ptr_range());
                assert!(holds(&inner[..]));
                assert!(!holds(&buf[..10]));
            }
            assert!(holds(&buf[..10]), "the outer declaration is back");
            let seen = std::thread::scope(|s| s.spawn(|| holds(&buf[..10])).join().unwrap());
            assert!(!seen, "another thread declared nothing");
        }
        assert!(!holds(&buf[..10]));
    }
}

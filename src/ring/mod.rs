//! Virtqueue access: a TX descriptor chain is copied out into a `TxFrame`, a frame is
//! written into RX chains (MRG_RXBUF aware).

pub mod guest_mem;
pub mod host;
pub mod rx;
pub mod split;
pub mod tx;

pub use guest_mem::GuestMem;

use std::num::Wrapping;
use std::sync::atomic::Ordering;

use virtio_queue::QueueT;

/// Whether the guest's avail index is at most one queue ahead of what was consumed.
/// A jump further is a broken ring: virtio-queue then yields no chain while still
/// reporting work, and a loop that trusted it would spin.
pub fn avail_in_range<Q: QueueT>(q: &Q, mem: &GuestMem) -> bool {
    match q.avail_idx(mem, Ordering::Acquire) {
        Ok(avail) => (avail - Wrapping(q.next_avail())).0 <= q.size(),
        Err(_) => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use virtio_queue::mock::MockSplitQueue;
    use virtio_queue::Queue;
    use vm_memory::GuestAddress;

    #[test]
    fn an_avail_index_more_than_a_queue_ahead_is_out_of_range() {
        let m = GuestMem::from_ranges(&[(GuestAddress(0), 0x10000)]).unwrap();
        let mock = MockSplitQueue::new(&m, 16);
        let q: Queue = mock.create_queue().unwrap();
        assert!(avail_in_range(&q, &m));
        mock.avail().idx().store(16);
        assert!(avail_in_range(&q, &m));
        mock.avail().idx().store(17);
        assert!(!avail_in_range(&q, &m));
        mock.avail().idx().store(0xffff);
        assert!(!avail_in_range(&q, &m));
    }
}

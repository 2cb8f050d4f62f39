//! Virtqueue access: a TX descriptor chain is copied out into a `TxFrame`, a frame is
//! written into RX chains (MRG_RXBUF aware).

pub mod guest_mem;
pub mod host;
pub mod packed;
pub mod rx;
pub mod split;
pub mod tx;
pub mod vq;

pub use guest_mem::GuestMem;

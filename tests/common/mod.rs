//! Shared helpers for integration tests.

pub mod afpacket;
pub mod daemon;
pub mod frames;
pub mod frontend;
pub mod rx;
pub mod wire_hdr;

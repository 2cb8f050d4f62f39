//! gsonet as a Xen netback: each configured vif (and each of `auto`'s slots) is a
//! port of the switch, "disconnected" until a netfront connects. `xenbus` runs the
//! xenstore side (InitWait, Connected, Closing, Closed) for every vif in one thread,
//! `vif` is the port (RX: frames for the netfront, grant-copied in batches), `tx` the
//! worker thread of one connection (TX ring -> switch). docs/xen.md says more.

pub mod buffers;
pub mod tx;
pub mod vif;
pub mod xenbus;

pub use vif::VifPort;

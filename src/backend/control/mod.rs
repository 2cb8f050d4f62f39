//! The control socket: one JSON request per line, one JSON answer per line, both
//! typed (`protocol`). `gsonet stats` and `gsonet ctl` are its clients.

pub mod protocol;
pub mod server;

pub use protocol::{request, Reply, Request};
pub use server::{serve, Lifecycle, Members, Registry};

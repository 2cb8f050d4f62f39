//! The vhost-user side of a port: the relay in front of the vhost crate and the
//! control-plane firewall it applies, the port's shared state and RX writer, the
//! `VhostUserBackend` shell and the TX loop.

pub mod announce;
pub mod backend;
pub mod coalesce;
pub mod completion;
pub mod firewall;
pub mod pace;
pub mod port;
pub mod relay;
pub mod resume;
pub mod tx;

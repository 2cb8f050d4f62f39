//! The daemon: vhost-user ports (`vhost`), the switch between them (`switch`),
//! Xen netback vifs (`xen`), uplinks (`uplink`), the control socket (`control`),
//! Prometheus metrics (`metrics`), `lifecycle` (sockets from systemd, the clean
//! stop), and `daemon`, which wires them up from a `Config` and serves until stopped.
//!
//! The rooms import downwards only: `daemon` -> `control` -> `vhost`, `xen`, `uplink` ->
//! `switch`. The switch knows ports and uplinks through its own traits.

pub mod control;
pub mod daemon;
pub mod lifecycle;
pub mod metrics;
pub mod ratelimit;
pub mod socket;
pub mod switch;
pub mod uplink;
pub mod vhost;
pub mod xen;

pub use daemon::{run, DaemonError};

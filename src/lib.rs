//! gsonet: a vhost-user virtio-net backend that negotiates checksum and segmentation
//! offloads with each guest and segments in software only for peers that need it.
//!
//! Rooms, lowest first (a room imports only from rooms below it):
//! `l2`, `vnet_hdr`, `stats` -> `features`, `segment` -> `config`, `frame`, `ring`
//! -> `backend`. Under all of them, `sys` holds every syscall and ioctl behind
//! safe functions.
//!
//! `unsafe` is denied everywhere but in `sys`, `ring::host` (guest memory as the
//! datapath copies it) and the one SIMD call in `segment::csum`;
//! each unsafe block states its invariant in a `// SAFETY:` comment.

#![deny(unsafe_code)]
#![warn(clippy::undocumented_unsafe_blocks)]

pub mod backend;
pub mod config;
pub mod features;
pub mod frame;
pub mod l2;
pub mod netif;
pub mod ring;
pub mod segment;
pub mod stats;
pub mod sys;
#[cfg(any(test, feature = "testkit"))]
pub mod testkit;
pub mod vnet_hdr;

//! The kernel boundary: every syscall and ioctl gsonet makes, behind safe, typed functions:
//! tap queues (`tun`), AF_PACKET sockets (`packet`), interfaces (`netdev`), fds (`io`, `scm`,
//! and `fd` for what a descriptor from another process is), Unix listening sockets
//! (`sock`), socket peers and groups (`cred`), epoll timers (`timer`), readiness for
//! systemd (`notify`), sockets systemd passed us (`activation`), batches of writes in
//! one call (`uring`), a thread's priority (`sched`).

// The one room allowed to call into libc; every block states its invariant.
#![allow(unsafe_code)]

pub mod activation;
pub mod cred;
pub mod fd;
pub mod io;
pub mod netdev;
pub mod notify;
pub mod packet;
pub mod sched;
pub mod scm;
pub mod sock;
pub mod timer;
pub mod tun;
pub mod uring;
pub mod xen;

use std::io::Error;

/// A libc return value as a Result: -1 (any negative) means errno says why.
fn check(r: libc::c_int) -> std::io::Result<libc::c_int> {
    if r < 0 {
        Err(Error::last_os_error())
    } else {
        Ok(r)
    }
}

/// A byte count from read/write-like calls as a Result.
fn check_len(r: libc::ssize_t) -> std::io::Result<usize> {
    usize::try_from(r).map_err(|_| Error::last_os_error())
}

/// Whether this process runs with an effective uid of 0 (tests that need root).
pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// This process's effective uid.
pub fn euid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

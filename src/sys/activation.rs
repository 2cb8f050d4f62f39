//! Listening sockets handed over by a service manager (systemd socket activation:
//! `LISTEN_FDS`, `LISTEN_FDNAMES`, checked against `LISTEN_PID` by `sd-notify`).

use std::io;
use std::net::TcpListener;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixListener;

use super::check;

/// One inherited listening socket and the name the manager gave it
/// (`FileDescriptorName=`; systemd's default is the socket unit's name).
#[derive(Debug)]
pub enum Inherited {
    Unix {
        name: String,
        listener: UnixListener,
    },
    Tcp {
        name: String,
        listener: TcpListener,
    },
}

fn sockopt_int(fd: BorrowedFd<'_>, opt: libc::c_int) -> io::Result<libc::c_int> {
    let mut v: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into `v`, an int borrowed
    // exclusively for the call, and the new length into `len`.
    check(unsafe {
        libc::getsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            opt,
            (&mut v as *mut libc::c_int).cast(),
            &mut len,
        )
    })?;
    Ok(v)
}

/// Takes the sockets passed to this process (none when `LISTEN_PID` names another
/// process or nothing was passed) and clears the variables, so that nothing started
/// later inherits them. Every descriptor must be a listening stream socket, Unix or
/// TCP; anything else is an error naming it.
pub fn take() -> io::Result<Vec<Inherited>> {
    // Variables meant for another process (a parent that did not clear them) are not
    // ours, names included (`sd-notify` would reject names without descriptors).
    if std::env::var("LISTEN_PID").ok().as_deref() != Some(&std::process::id().to_string()) {
        return Ok(Vec::new());
    }
    // SAFETY: called once at start-up, before any other thread of ours runs, so
    // nothing reads the environment while the variables are removed.
    let fds = unsafe { sd_notify::listen_fds_with_names_and_unset_env() }?;
    let mut out = Vec::new();
    for (raw, name) in fds {
        // SAFETY: the manager passed `raw` to this process for it to own (LISTEN_PID
        // is ours) and `sd-notify` hands each one out once; nothing else here holds it.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let what = |e: &str| io::Error::other(format!("inherited fd {raw} ({name}): {e}"));
        let domain = sockopt_int(fd.as_fd(), libc::SO_DOMAIN).map_err(|_| what("not a socket"))?;
        if sockopt_int(fd.as_fd(), libc::SO_TYPE)? != libc::SOCK_STREAM
            || sockopt_int(fd.as_fd(), libc::SO_ACCEPTCONN)? == 0
        {
            return Err(what("not a listening stream socket"));
        }
        out.push(match domain {
            libc::AF_UNIX => Inherited::Unix {
                name,
                listener: UnixListener::from(fd),
            },
            libc::AF_INET | libc::AF_INET6 => Inherited::Tcp {
                name,
                listener: TcpListener::from(fd),
            },
            _ => return Err(what("neither a Unix nor a TCP socket")),
        });
    }
    for i in &out {
        let fd = match i {
            Inherited::Unix { listener, .. } => listener.as_fd(),
            Inherited::Tcp { listener, .. } => listener.as_fd(),
        };
        // The accept loops block; the manager may have passed them non-blocking.
        set_blocking(fd)?;
    }
    Ok(out)
}

fn set_blocking(fd: BorrowedFd<'_>) -> io::Result<()> {
    // SAFETY: F_GETFL takes no pointer and only reads the descriptor's flags.
    let flags = check(unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GETFL) })?;
    if flags & libc::O_NONBLOCK != 0 {
        // SAFETY: F_SETFL takes the new flags by value.
        check(unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETFL, flags & !libc::O_NONBLOCK) })?;
    }
    Ok(())
}

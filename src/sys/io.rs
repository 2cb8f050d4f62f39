//! Plain I/O on any descriptor: one writev per frame, read, and a poll on one fd.
//! Descriptors come in borrowed, so each is open for the whole call.

use std::io::{self, IoSlice};
use std::os::fd::{AsRawFd, BorrowedFd};
use std::time::Duration;

use super::{check, check_len};

/// Writes `iov` to `fd` with one writev (tap queues and packet sockets alike).
pub fn writev(fd: BorrowedFd<'_>, iov: &[&[u8]]) -> io::Result<usize> {
    let slices: Vec<IoSlice<'_>> = iov.iter().map(|s| IoSlice::new(s)).collect();
    let count = libc::c_int::try_from(slices.len())
        .map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
    // SAFETY: `IoSlice` is ABI-compatible with `struct iovec` on Unix, and each one
    // points into a slice borrowed for the duration of the call; `count` is their number.
    let n = unsafe { libc::writev(fd.as_raw_fd(), slices.as_ptr().cast(), count) };
    check_len(n)
}

/// Reads once from `fd` into `buf`; WouldBlock on an empty non-blocking fd.
pub fn read(fd: BorrowedFd<'_>, buf: &mut [u8]) -> io::Result<usize> {
    // SAFETY: the kernel writes at most `buf.len()` bytes into `buf`, which is
    // exclusively borrowed for the call.
    let n = unsafe { libc::read(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
    check_len(n)
}

/// Waits up to `timeout` (whole milliseconds) for `fd` to become readable. Ok(false)
/// when the time ran out; an interrupted wait is an `Interrupted` error.
pub fn poll_readable(fd: BorrowedFd<'_>, timeout: Duration) -> io::Result<bool> {
    poll_any(&[fd], timeout).map(|ready| ready != 0)
}

/// Waits up to `timeout` for any of `fds` to become readable (or to report an error
/// or hang-up a read will meet); returns which did, a bit per fd (at most 8 fds).
pub fn poll_any(fds: &[BorrowedFd<'_>], timeout: Duration) -> io::Result<u8> {
    let mut pfds = [libc::pollfd {
        fd: -1,
        events: libc::POLLIN,
        revents: 0,
    }; 8];
    let n = fds.len().min(pfds.len());
    for (p, fd) in pfds.iter_mut().zip(fds) {
        p.fd = fd.as_raw_fd();
    }
    let ms = libc::c_int::try_from(timeout.as_millis()).unwrap_or(libc::c_int::MAX);
    // SAFETY: the first `n` entries of `pfds` are valid pollfds, exclusively borrowed
    // for the call.
    check(unsafe { libc::poll(pfds.as_mut_ptr(), n as libc::nfds_t, ms) })?;
    Ok(pfds[..n]
        .iter()
        .enumerate()
        .filter(|(_, p)| p.revents != 0)
        .fold(0, |m, (i, _)| m | 1 << i))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;
    use std::os::unix::net::UnixStream;

    #[test]
    fn writev_read_and_poll_on_a_socket_pair() {
        let (a, b) = UnixStream::pair().unwrap();
        b.set_nonblocking(true).unwrap();
        assert!(!poll_readable(b.as_fd(), Duration::ZERO).unwrap());
        let mut buf = [0u8; 16];
        let e = read(b.as_fd(), &mut buf).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::WouldBlock);

        assert_eq!(writev(a.as_fd(), &[b"ab", b"", b"cde"]).unwrap(), 5);
        assert!(poll_readable(b.as_fd(), Duration::from_secs(1)).unwrap());
        // b readable, a not: only b's bit
        assert_eq!(
            poll_any(&[a.as_fd(), b.as_fd()], Duration::ZERO).unwrap(),
            0b10
        );
        assert_eq!(read(b.as_fd(), &mut buf).unwrap(), 5);
        assert_eq!(&buf[..5], b"abcde");
    }
}

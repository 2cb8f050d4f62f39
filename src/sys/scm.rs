//! Descriptor passing on a Unix stream (SCM_RIGHTS) through vmm-sys-util's
//! `ScmSocket`: the vhost-user relay forwards messages with the fds attached.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;

use vmm_sys_util::sock_ctrl_msg::ScmSocket;

use super::check;

/// Sends `buf` in one sendmsg with `fds` attached to its first byte; returns how many
/// bytes went (the caller writes the rest).
pub fn send_with_fds(s: &UnixStream, buf: &[u8], fds: &[BorrowedFd<'_>]) -> io::Result<usize> {
    let raw: Vec<RawFd> = fds.iter().map(|f| f.as_raw_fd()).collect();
    Ok(s.send_with_fds(&[buf], &raw)?)
}

/// Receives up to `buf.len()` bytes and up to `max_fds` descriptors, which come back
/// owned and close-on-exec. Ok((0, _)) at end of stream; ENOBUFS (and no descriptors)
/// if more than `max_fds` were sent.
pub fn recv_with_fds(
    s: &UnixStream,
    buf: &mut [u8],
    max_fds: usize,
) -> io::Result<(usize, Vec<OwnedFd>)> {
    let mut raw: Vec<RawFd> = vec![-1; max_fds];
    let mut iov = [libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    }];
    // SAFETY: the one iovec covers `buf`, exclusively borrowed for the call, where any
    // bytes may be written.
    let (n, count) = unsafe { s.recv_with_fds(&mut iov, &mut raw)? };
    let fds: Vec<OwnedFd> = raw[..count]
        .iter()
        // SAFETY: recv_with_fds hands the caller ownership of the first `count`
        // descriptors it stored, fresh from SCM_RIGHTS and owned by nothing else.
        .map(|&fd| unsafe { OwnedFd::from_raw_fd(fd) })
        .collect();
    for fd in &fds {
        // ScmSocket receives without MSG_CMSG_CLOEXEC; set it right away.
        // SAFETY: F_SETFD on a descriptor we own takes an int and no pointers.
        check(unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETFD, libc::FD_CLOEXEC) })?;
    }
    Ok((n, fds))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::os::fd::AsFd;

    #[test]
    fn bytes_and_descriptors_arrive_together() {
        let (a, b) = UnixStream::pair().unwrap();
        let (mut x, y) = UnixStream::pair().unwrap();
        assert_eq!(send_with_fds(&a, b"hello", &[y.as_fd()]).unwrap(), 5);
        drop(y);
        let mut buf = [0u8; 8];
        let (n, fds) = recv_with_fds(&b, &mut buf, 4).unwrap();
        assert_eq!((&buf[..n], fds.len()), (&b"hello"[..], 1));
        // SAFETY: F_GETFD only reads the flags of a descriptor we own.
        let flags = unsafe { libc::fcntl(fds[0].as_raw_fd(), libc::F_GETFD) };
        assert_eq!(flags & libc::FD_CLOEXEC, libc::FD_CLOEXEC);
        let mut peer = UnixStream::from(fds.into_iter().next().unwrap());
        peer.write_all(b"x").unwrap();
        let mut one = [0u8; 1];
        x.read_exact(&mut one).unwrap();

        // Without descriptors, and at end of stream.
        assert_eq!(send_with_fds(&a, b"ab", &[]).unwrap(), 2);
        let (n, fds) = recv_with_fds(&b, &mut buf, 4).unwrap();
        assert_eq!((n, fds.len()), (2, 0));
        drop(a);
        assert_eq!(recv_with_fds(&b, &mut buf, 4).unwrap().0, 0);
    }
}

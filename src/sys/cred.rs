//! Who is on the other side: a Unix socket peer's credentials (SO_PEERCRED), and
//! group names resolved to gids (getgrnam_r) for the sockets gsonet creates.

use std::ffi::CString;
use std::io;
use std::mem;
use std::os::fd::{AsRawFd, BorrowedFd};

use super::check;

/// The process at the other end of a Unix socket, as the kernel recorded it when the
/// connection was made (connect or listen).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PeerCred {
    pub pid: i32,
    pub uid: u32,
    pub gid: u32,
}

/// The credentials of the peer of a connected Unix stream socket.
pub fn peer_cred(fd: BorrowedFd<'_>) -> io::Result<PeerCred> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: SO_PEERCRED writes at most `len` bytes, the size of the `ucred` we pass,
    // which is exclusively borrowed for the call; `len` is updated in place.
    check(unsafe {
        libc::getsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    })?;
    if len as usize != mem::size_of::<libc::ucred>() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "short SO_PEERCRED answer",
        ));
    }
    Ok(PeerCred {
        pid: cred.pid,
        uid: cred.uid,
        gid: cred.gid,
    })
}

/// The gid of group `name` (through NSS, as `getent group` sees it); Ok(None) when
/// there is no such group.
pub fn group_id(name: &str) -> io::Result<Option<u32>> {
    let c = CString::new(name).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
    let mut buf: Vec<libc::c_char> = vec![0; 1024];
    loop {
        // SAFETY: `group` is plain C data (pointers and integers) for which all-zero
        // bytes are a valid value; getgrnam_r fills it in.
        let mut grp: libc::group = unsafe { mem::zeroed() };
        let mut found: *mut libc::group = std::ptr::null_mut();
        // SAFETY: `c` is NUL-terminated and outlives the call; `grp`, `buf` (of the
        // length passed) and `found` are exclusively borrowed for it. The strings the
        // answer points at live in `buf`; we read only the integer gid.
        let r = unsafe {
            libc::getgrnam_r(
                c.as_ptr(),
                &mut grp,
                buf.as_mut_ptr(),
                buf.len(),
                &mut found,
            )
        };
        match r {
            0 if found.is_null() => return Ok(None),
            0 => return Ok(Some(grp.gr_gid)),
            libc::ERANGE if buf.len() < 1 << 20 => buf.resize(buf.len() * 4, 0),
            // "Not found" may come back as one of these instead of a null result.
            libc::ENOENT | libc::ESRCH | libc::EBADF | libc::EPERM => return Ok(None),
            e => return Err(io::Error::from_raw_os_error(e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;
    use std::os::unix::net::UnixStream;

    #[test]
    fn a_socket_pair_peer_is_this_process() {
        let (a, _b) = UnixStream::pair().unwrap();
        let c = peer_cred(a.as_fd()).unwrap();
        assert_eq!(c.pid, std::process::id() as i32);
        // SAFETY: getuid and getgid have no preconditions and cannot fail.
        let (uid, gid) = unsafe { (libc::geteuid(), libc::getegid()) };
        assert_eq!((c.uid, c.gid), (uid, gid));
    }

    #[test]
    fn groups_by_name() {
        // Group 0 exists on every Linux system that has a group database.
        if let Ok(text) = std::fs::read_to_string("/etc/group") {
            if let Some(name) = text
                .lines()
                .find(|l| l.split(':').nth(2) == Some("0"))
                .and_then(|l| l.split(':').next())
            {
                assert_eq!(group_id(name).unwrap(), Some(0));
            }
        }
        assert_eq!(group_id("no-such-group-gsonet-test").unwrap(), None);
        assert!(group_id("a\0b").is_err());
    }
}

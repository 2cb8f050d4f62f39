//! A Unix listening socket whose file never appears with looser permissions than
//! asked for: the socket's mode is set before bind, which creates the file from it.

use std::io;
use std::mem;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::net::UnixListener;
use std::path::Path;

use super::check;

/// Connections the kernel queues before `accept`.
const BACKLOG: libc::c_int = 128;

/// Binds and listens on `path`, a file created with `mode` (less what the umask
/// removes; the caller sets the exact bits afterwards). Linux takes the new file's
/// mode from the socket's own inode, which fchmod sets before bind.
pub fn listen_unix(path: &Path, mode: u32) -> io::Result<UnixListener> {
    let bytes = path.as_os_str().as_bytes();
    // SAFETY: sockaddr_un is plain C data (a family and a byte array) for which
    // all-zero bytes are a valid value.
    let mut addr: libc::sockaddr_un = unsafe { mem::zeroed() };
    if bytes.is_empty() || bytes.contains(&0) || bytes.len() >= addr.sun_path.len() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "a socket path is 1 to {} bytes without NUL",
                addr.sun_path.len() - 1
            ),
        ));
    }
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    for (d, s) in addr.sun_path.iter_mut().zip(bytes) {
        *d = *s as libc::c_char;
    }
    let len = (mem::offset_of!(libc::sockaddr_un, sun_path) + bytes.len() + 1) as libc::socklen_t;
    // SAFETY: socket takes no pointers; a non-negative result is a new descriptor.
    let raw =
        check(unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) })?;
    // SAFETY: `raw` was just returned by socket and is owned by nothing else.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    // SAFETY: fchmod on a descriptor we own takes an integer mode and no pointers.
    check(unsafe { libc::fchmod(fd.as_raw_fd(), mode as libc::mode_t) })?;
    // SAFETY: `addr` is a valid sockaddr_un, borrowed for the call, and `len` covers
    // its family, the path and the path's terminating NUL, all inside `addr`.
    check(unsafe {
        libc::bind(
            fd.as_raw_fd(),
            (&addr as *const libc::sockaddr_un).cast(),
            len,
        )
    })?;
    // SAFETY: listen on a bound socket we own; no pointers.
    check(unsafe { libc::listen(fd.as_raw_fd(), BACKLOG) })?;
    Ok(UnixListener::from(fd))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    use std::os::unix::net::UnixStream;

    #[test]
    fn the_file_is_created_with_the_mode_and_answers() {
        let dir = std::env::temp_dir().join(format!("gsonet-sock-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("l.sock");
        let l = listen_unix(&path, 0o600).unwrap();
        let m = std::fs::symlink_metadata(&path).unwrap();
        assert!(m.file_type().is_socket());
        // Never more than asked for, whatever the umask.
        assert_eq!(m.mode() & 0o777 & !0o600, 0);
        let _c = UnixStream::connect(&path).unwrap();
        l.accept().unwrap();
        assert_eq!(
            listen_unix(&path, 0o600).unwrap_err().kind(),
            io::ErrorKind::AddrInUse
        );
        let long = dir.join("x".repeat(120));
        assert_eq!(
            listen_unix(&long, 0o600).unwrap_err().kind(),
            io::ErrorKind::InvalidInput
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}

//! Binding a Unix listening socket at a path without stealing it: a socket a live
//! process still answers on is refused, a stale one is replaced.

use std::io;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;

/// Binds `path`, creating its directory. Fails with `AddrInUse` when a running
/// process serves the socket there.
pub fn bind_exclusive(path: &Path) -> io::Result<UnixListener> {
    if path.exists() {
        if UnixStream::connect(path).is_ok() {
            return Err(io::Error::new(
                io::ErrorKind::AddrInUse,
                "in use by a running process (another gsonet?)",
            ));
        }
        let _ = std::fs::remove_file(path);
    }
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    UnixListener::bind(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn live_sockets_are_kept_and_stale_ones_replaced() {
        let dir = std::env::temp_dir().join(format!("gsonet-bind-{}", std::process::id()));
        let path = dir.join("sub/x.sock");
        let live = bind_exclusive(&path).unwrap();
        assert_eq!(
            bind_exclusive(&path).unwrap_err().kind(),
            io::ErrorKind::AddrInUse
        );
        drop(live);
        // The file is left behind by the closed listener: stale, replaced.
        assert!(path.exists());
        bind_exclusive(&path).unwrap();
        let _ = std::fs::remove_dir_all(&dir);
    }
}

//! systemd's readiness protocol (sd_notify): one datagram such as `READY=1` to the
//! socket named in `$NOTIFY_SOCKET`, a path or, with a leading `@`, an abstract name.

use std::io;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixDatagram};

/// Where `$NOTIFY_SOCKET` points.
#[derive(Debug, PartialEq, Eq)]
pub enum NotifyTarget {
    Path(std::path::PathBuf),
    /// An abstract socket: the name after the `@`.
    Abstract(Vec<u8>),
}

/// Reads a `$NOTIFY_SOCKET` value; `None` for an empty one or a relative path
/// (systemd only ever hands out absolute paths and abstract names).
pub fn parse_target(v: &std::ffi::OsStr) -> Option<NotifyTarget> {
    use std::os::unix::ffi::OsStrExt;
    let b = v.as_bytes();
    match b.first()? {
        b'@' => Some(NotifyTarget::Abstract(b[1..].to_vec())),
        b'/' => Some(NotifyTarget::Path(v.into())),
        _ => None,
    }
}

/// Sends `state` (e.g. `"READY=1"`) to the service manager. `Ok(false)`: not started
/// by one (no `$NOTIFY_SOCKET`), nothing sent.
pub fn notify(state: &str) -> io::Result<bool> {
    let Some(v) = std::env::var_os("NOTIFY_SOCKET") else {
        return Ok(false);
    };
    let target = parse_target(&v).ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("NOTIFY_SOCKET={v:?} is neither an absolute path nor @abstract"),
        )
    })?;
    let addr = match &target {
        NotifyTarget::Path(p) => SocketAddr::from_pathname(p)?,
        NotifyTarget::Abstract(name) => SocketAddr::from_abstract_name(name)?,
    };
    let sock = UnixDatagram::unbound()?;
    let sent = sock.send_to_addr(state.as_bytes(), &addr)?;
    if sent != state.len() {
        return Err(io::Error::new(
            io::ErrorKind::WriteZero,
            "short notify datagram",
        ));
    }
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::OsStr;

    #[test]
    fn targets() {
        assert_eq!(
            parse_target(OsStr::new("/run/systemd/notify")),
            Some(NotifyTarget::Path("/run/systemd/notify".into()))
        );
        assert_eq!(
            parse_target(OsStr::new("@/org/freedesktop/systemd1/notify/123")),
            Some(NotifyTarget::Abstract(
                b"/org/freedesktop/systemd1/notify/123".to_vec()
            ))
        );
        assert_eq!(parse_target(OsStr::new("")), None);
        assert_eq!(parse_target(OsStr::new("relative/sock")), None);
    }

    #[test]
    fn a_datagram_reaches_an_abstract_socket() {
        let name = format!("gsonet-notify-test-{}", std::process::id());
        let addr = SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
        let rx = UnixDatagram::bind_addr(&addr).unwrap();
        let target = SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
        UnixDatagram::unbound()
            .unwrap()
            .send_to_addr(b"READY=1", &target)
            .unwrap();
        let mut buf = [0u8; 64];
        let n = rx.recv(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"READY=1");
    }
}

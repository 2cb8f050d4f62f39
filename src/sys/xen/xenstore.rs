//! The xenstore wire protocol (docs/misc/xenstore.txt): 16-byte headers
//! (type, req_id, tx_id, len) and NUL-separated payloads, over xenstored's Unix socket
//! or `/dev/xen/xenbus`. Watch events arrive on the same connection between replies;
//! they are queued and handed out by [`Xenstore::next_event`].
//!
//! Written here rather than taken from a crate: the Rust xenstore clients on crates.io
//! are GPL-licensed (xenstore-rs, krata-xenstore) or need libxenstore at build time,
//! and gsonet needs five requests of a small, stable protocol.

use std::collections::VecDeque;
use std::fs::OpenOptions;
use std::io::{self, Read, Write};
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use thiserror::Error;

const XS_DIRECTORY: u32 = 1;
const XS_READ: u32 = 2;
const XS_WATCH: u32 = 4;
const XS_UNWATCH: u32 = 5;
const XS_WRITE: u32 = 11;
const XS_RM: u32 = 13;
const XS_WATCH_EVENT: u32 = 15;
const XS_ERROR: u32 = 16;
/// Largest payload xenstored sends or takes (XENSTORE_PAYLOAD_MAX).
pub const PAYLOAD_MAX: usize = 4096;

#[derive(Debug, Error)]
pub enum XsError {
    #[error("xenstore: {0}")]
    Io(#[from] io::Error),
    /// xenstored answered with an error name (ENOENT, EACCES, ...).
    #[error("xenstore error {0}")]
    Remote(String),
    #[error("xenstore: malformed reply ({0})")]
    Malformed(&'static str),
}

impl XsError {
    /// Whether the path does not exist.
    pub fn is_enoent(&self) -> bool {
        matches!(self, XsError::Remote(e) if e == "ENOENT")
    }
}

/// One message header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    pub ty: u32,
    pub req_id: u32,
    pub tx_id: u32,
    pub len: u32,
}

impl Header {
    pub fn encode(&self) -> [u8; 16] {
        let mut b = [0u8; 16];
        for (i, v) in [self.ty, self.req_id, self.tx_id, self.len]
            .iter()
            .enumerate()
        {
            b[4 * i..4 * i + 4].copy_from_slice(&v.to_le_bytes());
        }
        b
    }

    pub fn decode(b: &[u8; 16]) -> Header {
        let w = |i: usize| u32::from_le_bytes([b[4 * i], b[4 * i + 1], b[4 * i + 2], b[4 * i + 3]]);
        Header {
            ty: w(0),
            req_id: w(1),
            tx_id: w(2),
            len: w(3),
        }
    }
}

/// A watch event: the path that changed and the token of the watch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WatchEvent {
    pub path: String,
    pub token: String,
}

/// Splits a NUL-separated payload into its strings (a trailing NUL ends the last).
pub fn split_strings(payload: &[u8]) -> Vec<String> {
    let body = payload.strip_suffix(&[0]).unwrap_or(payload);
    if body.is_empty() {
        return Vec::new();
    }
    body.split(|&b| b == 0)
        .map(|s| String::from_utf8_lossy(s).into_owned())
        .collect()
}

trait Conn: Read + Write + Send {
    fn fd(&self) -> BorrowedFd<'_>;
}

impl Conn for UnixStream {
    fn fd(&self) -> BorrowedFd<'_> {
        self.as_fd()
    }
}

impl Conn for std::fs::File {
    fn fd(&self) -> BorrowedFd<'_> {
        self.as_fd()
    }
}

/// A connection to xenstored.
pub struct Xenstore {
    conn: Box<dyn Conn>,
    events: VecDeque<WatchEvent>,
    next_id: u32,
}

impl Xenstore {
    /// Connects to xenstored's socket, or else through `/dev/xen/xenbus`.
    pub fn open() -> Result<Xenstore, XsError> {
        let conn: Box<dyn Conn> = ["/run/xenstored/socket", "/var/run/xenstored/socket"]
            .iter()
            .find_map(|p| UnixStream::connect(p).ok())
            .map(|s| Box::new(s) as Box<dyn Conn>)
            .map_or_else(
                || {
                    OpenOptions::new()
                        .read(true)
                        .write(true)
                        .open("/dev/xen/xenbus")
                        .map(|f| Box::new(f) as Box<dyn Conn>)
                },
                Ok,
            )?;
        Ok(Xenstore {
            conn,
            events: VecDeque::new(),
            next_id: 1,
        })
    }

    fn recv(&mut self) -> Result<(Header, Vec<u8>), XsError> {
        let mut h = [0u8; 16];
        self.conn.read_exact(&mut h)?;
        let h = Header::decode(&h);
        if h.len as usize > PAYLOAD_MAX {
            return Err(XsError::Malformed("payload too long"));
        }
        let mut p = vec![0u8; h.len as usize];
        self.conn.read_exact(&mut p)?;
        Ok((h, p))
    }

    fn queue_event(&mut self, payload: &[u8]) {
        let mut s = split_strings(payload).into_iter();
        if let (Some(path), Some(token)) = (s.next(), s.next()) {
            self.events.push_back(WatchEvent { path, token });
        }
    }

    fn request(&mut self, ty: u32, payload: &[u8]) -> Result<Vec<u8>, XsError> {
        if payload.len() > PAYLOAD_MAX {
            return Err(XsError::Malformed("request too long"));
        }
        let id = self.next_id;
        self.next_id = self.next_id.wrapping_add(1);
        let h = Header {
            ty,
            req_id: id,
            tx_id: 0,
            len: payload.len() as u32,
        };
        // One write: /dev/xen/xenbus takes a message per write.
        let mut msg = h.encode().to_vec();
        msg.extend_from_slice(payload);
        self.conn.write_all(&msg)?;
        loop {
            let (rh, p) = self.recv()?;
            if rh.ty == XS_WATCH_EVENT {
                self.queue_event(&p);
                continue;
            }
            if rh.ty == XS_ERROR {
                return Err(XsError::Remote(split_strings(&p).concat()));
            }
            return Ok(p);
        }
    }

    fn path(p: &str) -> Vec<u8> {
        let mut v = p.as_bytes().to_vec();
        v.push(0);
        v
    }

    pub fn read(&mut self, path: &str) -> Result<String, XsError> {
        let p = self.request(XS_READ, &Self::path(path))?;
        Ok(String::from_utf8_lossy(p.strip_suffix(&[0]).unwrap_or(&p)).into_owned())
    }

    /// The value at `path`, or `None` if it does not exist.
    pub fn try_read(&mut self, path: &str) -> Result<Option<String>, XsError> {
        match self.read(path) {
            Ok(v) => Ok(Some(v)),
            Err(e) if e.is_enoent() => Ok(None),
            Err(e) => Err(e),
        }
    }

    pub fn write(&mut self, path: &str, value: &str) -> Result<(), XsError> {
        let mut p = Self::path(path);
        p.extend_from_slice(value.as_bytes());
        self.request(XS_WRITE, &p).map(|_| ())
    }

    pub fn directory(&mut self, path: &str) -> Result<Vec<String>, XsError> {
        match self.request(XS_DIRECTORY, &Self::path(path)) {
            Ok(p) => Ok(split_strings(&p)),
            Err(e) if e.is_enoent() => Ok(Vec::new()),
            Err(e) => Err(e),
        }
    }

    pub fn rm(&mut self, path: &str) -> Result<(), XsError> {
        match self.request(XS_RM, &Self::path(path)) {
            Err(e) if !e.is_enoent() => Err(e),
            _ => Ok(()),
        }
    }

    /// Watches `path` and everything below it; events carry `token`.
    pub fn watch(&mut self, path: &str, token: &str) -> Result<(), XsError> {
        let mut p = Self::path(path);
        p.extend_from_slice(&Self::path(token));
        self.request(XS_WATCH, &p).map(|_| ())
    }

    pub fn unwatch(&mut self, path: &str, token: &str) -> Result<(), XsError> {
        let mut p = Self::path(path);
        p.extend_from_slice(&Self::path(token));
        match self.request(XS_UNWATCH, &p) {
            Err(e) if !e.is_enoent() => Err(e),
            _ => Ok(()),
        }
    }

    /// The next watch event, waiting up to `timeout`; `None` if none came.
    pub fn next_event(&mut self, timeout: Duration) -> Result<Option<WatchEvent>, XsError> {
        if let Some(e) = self.events.pop_front() {
            return Ok(Some(e));
        }
        if !crate::sys::io::poll_readable(self.conn.fd(), timeout)? {
            return Ok(None);
        }
        let (h, p) = self.recv()?;
        if h.ty == XS_WATCH_EVENT {
            self.queue_event(&p);
        }
        Ok(self.events.pop_front())
    }

    /// Drops queued events (after a full rescan they tell nothing new).
    pub fn clear_events(&mut self) {
        self.events.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_and_payloads_round_trip() {
        let h = Header {
            ty: XS_WRITE,
            req_id: 7,
            tx_id: 0,
            len: 12,
        };
        assert_eq!(Header::decode(&h.encode()), h);
        assert_eq!(h.encode()[0], 11);
        assert_eq!(split_strings(b"a\0bc\0"), vec!["a", "bc"]);
        assert_eq!(split_strings(b"one"), vec!["one"]);
        assert!(split_strings(b"").is_empty());
    }
}

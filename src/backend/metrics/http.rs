//! The smallest HTTP/1.x responder Prometheus needs: `GET /metrics`, one answer per
//! connection, then close. Bounded like the control socket: at most `MAX_CLIENTS`
//! connections at once, a request head of at most `MAX_HEAD` bytes, `IDLE` to send it
//! or to take the answer.
//!
//! Written on std's TcpListener rather than taken from an HTTP crate: the small
//! synchronous ones (tiny_http) start a thread per connection without a bound and
//! read headers without a size limit, and the bounded ones (hyper, axum) bring an
//! async runtime into a daemon that has none, for one fixed GET.

use std::io::{self, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::AtomicUsize;
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use tracing::{debug, warn};

use crate::backend::control::server::Slot;
use crate::backend::control::Registry as Endpoints;
use crate::backend::ratelimit::LogLimit;

/// Connections served at once; another is answered 503 and closed.
pub const MAX_CLIENTS: usize = 8;
/// Longest request head (request line and headers); a longer one gets 431.
pub const MAX_HEAD: usize = 8192;
/// Time a client has to send its request head, or to take the whole answer.
pub const IDLE: Duration = Duration::from_secs(10);

/// What the request head asked for.
#[derive(Debug, PartialEq, Eq)]
enum Ask {
    Metrics { head_only: bool },
    NotFound,
    BadMethod,
    Bad,
}

fn parse_request_line(head: &[u8]) -> Ask {
    let line_end = head.iter().position(|&b| b == b'\n').unwrap_or(head.len());
    let Ok(line) = std::str::from_utf8(&head[..line_end]) else {
        return Ask::Bad;
    };
    let mut words = line.trim_end_matches('\r').split(' ');
    let (Some(method), Some(target), Some(version), None) =
        (words.next(), words.next(), words.next(), words.next())
    else {
        return Ask::Bad;
    };
    if !version.starts_with("HTTP/1.") {
        return Ask::Bad;
    }
    let path = target.split_once('?').map_or(target, |(p, _)| p);
    let head_only = match method {
        "GET" => false,
        "HEAD" => true,
        _ => return Ask::BadMethod,
    };
    if path == "/metrics" {
        Ask::Metrics { head_only }
    } else {
        Ask::NotFound
    }
}

enum Head {
    Complete,
    TooLong,
}

/// Reads until the blank line ending the head, within `IDLE` and `MAX_HEAD`.
fn read_head(s: &mut TcpStream, buf: &mut Vec<u8>) -> io::Result<Head> {
    let deadline = Instant::now() + IDLE;
    let mut chunk = [0u8; 1024];
    loop {
        if buf.windows(4).any(|w| w == b"\r\n\r\n") || buf.windows(2).any(|w| w == b"\n\n") {
            return Ok(Head::Complete);
        }
        if buf.len() >= MAX_HEAD {
            return Ok(Head::TooLong);
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::ErrorKind::TimedOut.into());
        }
        s.set_read_timeout(Some(left))?;
        let room = (MAX_HEAD - buf.len()).min(chunk.len());
        match s.read(&mut chunk[..room]) {
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
}

fn respond(s: &mut TcpStream, status: &str, ctype: &str, body: &str, head_only: bool) {
    let mut out = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    if !head_only {
        out.extend_from_slice(body.as_bytes());
    }
    // The whole answer within IDLE: a client that stops reading loses its slot.
    let deadline = Instant::now() + IDLE;
    let mut rest = &out[..];
    while !rest.is_empty() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() || s.set_write_timeout(Some(left)).is_err() {
            return;
        }
        match s.write(rest) {
            Ok(0) => return,
            Ok(n) => rest = &rest[n..],
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => return,
        }
    }
}

fn client(endpoints: Arc<Endpoints>, mut s: TcpStream, _slot: Slot) {
    let mut buf = Vec::with_capacity(1024);
    let text = "text/plain; charset=utf-8";
    match read_head(&mut s, &mut buf) {
        Ok(Head::Complete) => {}
        Ok(Head::TooLong) => {
            respond(
                &mut s,
                "431 Request Header Fields Too Large",
                text,
                "request head too long\n",
                false,
            );
            return;
        }
        Err(e) => {
            debug!("metrics client: {e}");
            return;
        }
    }
    match parse_request_line(&buf) {
        Ask::Metrics { head_only } => match super::render(&endpoints) {
            Ok(body) => respond(&mut s, "200 OK", &super::content_type(), &body, head_only),
            Err(_) => respond(
                &mut s,
                "500 Internal Server Error",
                text,
                "encoding failed\n",
                head_only,
            ),
        },
        Ask::NotFound => respond(
            &mut s,
            "404 Not Found",
            text,
            "metrics are at /metrics\n",
            false,
        ),
        Ask::BadMethod => respond(
            &mut s,
            "405 Method Not Allowed",
            text,
            "GET or HEAD only\n",
            false,
        ),
        Ask::Bad => respond(&mut s, "400 Bad Request", text, "bad request line\n", false),
    }
    linger(&mut s);
}

/// Ends the answer and reads what the client still sends (at most 64 KiB, within
/// `IDLE`) until it closes: closing with unread bytes would reset the connection, and
/// the reset can overtake the answer.
fn linger(s: &mut TcpStream) {
    let _ = s.shutdown(std::net::Shutdown::Write);
    let deadline = Instant::now() + IDLE;
    let mut sink = [0u8; 4096];
    let mut left: usize = 64 * 1024;
    while left > 0 {
        let t = deadline.saturating_duration_since(Instant::now());
        if t.is_zero() || s.set_read_timeout(Some(t)).is_err() {
            return;
        }
        match s.read(&mut sink) {
            Ok(0) => return,
            Ok(n) => left = left.saturating_sub(n),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => return,
        }
    }
}

/// Serves `/metrics` on `l` (bound by the caller) forever.
pub fn serve(l: TcpListener, endpoints: Arc<Endpoints>) {
    let open = Arc::new(AtomicUsize::new(0));
    let log = LogLimit::default();
    for s in l.incoming() {
        let mut s = match s {
            Ok(s) => s,
            Err(e) => {
                debug!("metrics accept: {e}");
                thread::sleep(Duration::from_millis(10));
                continue;
            }
        };
        let Some(slot) = Slot::take(&open, MAX_CLIENTS) else {
            if let Some(suppressed) = log.allow() {
                warn!(
                    suppressed,
                    "metrics: {MAX_CLIENTS} connections open; refusing another"
                );
            }
            let _ = s.set_nonblocking(true);
            let _ = s.write_all(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
            continue;
        };
        let e = endpoints.clone();
        let _ = thread::Builder::new()
            .name("metrics".into())
            .spawn(move || client(e, s, slot));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_lines() {
        let m = |s: &str| parse_request_line(s.as_bytes());
        assert_eq!(
            m("GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"),
            Ask::Metrics { head_only: false }
        );
        assert_eq!(
            m("GET /metrics?x=1 HTTP/1.0\r\n\r\n"),
            Ask::Metrics { head_only: false }
        );
        assert_eq!(
            m("HEAD /metrics HTTP/1.1\r\n\r\n"),
            Ask::Metrics { head_only: true }
        );
        assert_eq!(m("GET / HTTP/1.1\r\n\r\n"), Ask::NotFound);
        assert_eq!(m("POST /metrics HTTP/1.1\r\n\r\n"), Ask::BadMethod);
        assert_eq!(m("GET /metrics\r\n\r\n"), Ask::Bad);
        assert_eq!(m("GET /metrics SPDY/3\r\n\r\n"), Ask::Bad);
        assert_eq!(m("\u{0}\u{ff}"), Ask::Bad);
    }
}

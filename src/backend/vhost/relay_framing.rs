//! The relay's message framing (`recv`, `send`) opened to the fuzz target
//! (`testkit::fuzz_relay`); built with the `testkit` feature only.

use std::io;
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;

use super::{recv, send, Msg, HDR, MAX_FDS, MAX_PAYLOAD};

/// Bytes of a vhost-user message header.
pub const HEADER_LEN: usize = HDR;
/// Largest payload the relay accepts.
pub const MAX_PAYLOAD_LEN: usize = MAX_PAYLOAD;
/// Most descriptors the relay takes with one message.
pub const MAX_FDS_PER_MSG: usize = MAX_FDS;

/// One message as the relay framed it.
pub struct Message {
    pub hdr: [u8; HDR],
    pub payload: Vec<u8>,
    pub fds: Vec<OwnedFd>,
}

/// The relay's `recv`: one message, `Ok(None)` at end of stream.
pub fn recv_message(s: &mut UnixStream) -> io::Result<Option<Message>> {
    Ok(recv(s)?.map(|m| Message {
        hdr: m.hdr,
        payload: m.payload,
        fds: m.fds,
    }))
}

/// The relay's `send`: one message in one sendmsg, descriptors attached.
pub fn send_message(s: &UnixStream, m: Message) -> io::Result<()> {
    send(
        s,
        &Msg {
            hdr: m.hdr,
            payload: m.payload,
            fds: m.fds,
        },
    )
}

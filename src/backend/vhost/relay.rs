//! A relay in front of the vhost crate's request handler. QEMU's virtio-net sends
//! SET_VRING_ENABLE at every device reset, before SET_FEATURES, and does not repeat it
//! when the device starts; the vhost crate treats an early one as a fatal protocol
//! error and closes the connection. The relay answers early requests itself, keeps
//! the last state asked for each ring, and replays it right after SET_FEATURES. Every
//! other message passes through unchanged, file descriptors included.

use std::io::{self, Read, Write};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex};
use std::thread;

use tracing::debug;

use crate::sys::scm;

const HDR: usize = 12;
const SET_FEATURES: u32 = 2;
const SET_VRING_ENABLE: u32 = 18;
const FLAG_VERSION: u32 = 0x1;
const FLAG_REPLY: u32 = 0x4;
const FLAG_NEED_REPLY: u32 = 0x8;
/// Largest payload a vhost-user message may carry (memory tables, config space).
const MAX_PAYLOAD: usize = 0x1000 + 256;
const MAX_FDS: usize = 32;

#[cfg(feature = "testkit")]
#[path = "relay_framing.rs"]
pub mod framing;

/// One message: header fields, payload and the descriptors that came with it.
struct Msg {
    hdr: [u8; HDR],
    payload: Vec<u8>,
    fds: Vec<OwnedFd>,
}

impl Msg {
    fn request(&self) -> u32 {
        u32::from_le_bytes([self.hdr[0], self.hdr[1], self.hdr[2], self.hdr[3]])
    }

    fn flags(&self) -> u32 {
        u32::from_le_bytes([self.hdr[4], self.hdr[5], self.hdr[6], self.hdr[7]])
    }
}

/// Reads one message; Ok(None) at end of stream.
fn recv(s: &mut UnixStream) -> io::Result<Option<Msg>> {
    let mut hdr = [0u8; HDR];
    let (n, fds) = scm::recv_with_fds(s, &mut hdr, MAX_FDS)?;
    if n == 0 {
        return Ok(None);
    }
    if n < HDR {
        s.read_exact(&mut hdr[n..])?;
    }
    let size = u32::from_le_bytes([hdr[8], hdr[9], hdr[10], hdr[11]]) as usize;
    if size > MAX_PAYLOAD {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("vhost-user payload of {size} bytes"),
        ));
    }
    let mut payload = vec![0u8; size];
    s.read_exact(&mut payload)?;
    Ok(Some(Msg { hdr, payload, fds }))
}

/// Writes one message in a single sendmsg, descriptors attached to its first byte.
fn send(s: &UnixStream, m: &Msg) -> io::Result<()> {
    let mut bytes = Vec::with_capacity(HDR + m.payload.len());
    bytes.extend_from_slice(&m.hdr);
    bytes.extend_from_slice(&m.payload);
    let fds: Vec<BorrowedFd<'_>> = m.fds.iter().map(|f| f.as_fd()).collect();
    let n = scm::send_with_fds(s, &bytes, &fds)?;
    if n < bytes.len() {
        (&*s).write_all(&bytes[n..])?;
    }
    Ok(())
}

/// The answer to an early SET_VRING_ENABLE that asked for one: success.
fn ack(req: &Msg) -> Msg {
    let mut hdr = [0u8; HDR];
    hdr[..4].copy_from_slice(&req.request().to_le_bytes());
    hdr[4..8].copy_from_slice(&(FLAG_VERSION | FLAG_REPLY).to_le_bytes());
    hdr[8..12].copy_from_slice(&8u32.to_le_bytes());
    Msg {
        hdr,
        payload: vec![0; 8],
        fds: Vec::new(),
    }
}

/// Sends a recorded SET_VRING_ENABLE (no reply asked, so none comes back).
fn replay(back: &UnixStream, payload: &[u8]) -> io::Result<()> {
    let mut hdr = [0u8; HDR];
    hdr[..4].copy_from_slice(&SET_VRING_ENABLE.to_le_bytes());
    hdr[4..8].copy_from_slice(&FLAG_VERSION.to_le_bytes());
    hdr[8..12].copy_from_slice(&(payload.len() as u32).to_le_bytes());
    send(
        back,
        &Msg {
            hdr,
            payload: payload.to_vec(),
            fds: Vec::new(),
        },
    )
}

/// Relays between `front` (QEMU) and `back` (the vhost crate's handler) until either
/// side closes; returns at once, the work happens in two threads.
pub fn spawn(front: UnixStream, back: UnixStream, name: String) -> io::Result<()> {
    let front_w = Arc::new(Mutex::new(front.try_clone()?));
    let (mut front_r, back_w) = (front, back.try_clone()?);
    let mut back_r = back;
    let fw = front_w.clone();
    let n2 = name.clone();
    thread::Builder::new().name("vu-relay-in".into()).spawn(move || {
        let mut features_set = false;
        let mut early: std::collections::BTreeMap<u32, Vec<u8>> = Default::default();
        while let Ok(Some(m)) = recv(&mut front_r) {
            tracing::trace!(port = %n2, request = m.request(), flags = m.flags(), fds = m.fds.len(), "vhost-user request");
            match m.request() {
                SET_VRING_ENABLE if !features_set => {
                    debug!(port = %n2, "answering SET_VRING_ENABLE sent before SET_FEATURES");
                    if m.payload.len() >= 8 {
                        let ring = u32::from_le_bytes([m.payload[0], m.payload[1], m.payload[2], m.payload[3]]);
                        early.insert(ring, m.payload.clone());
                    }
                    if m.flags() & FLAG_NEED_REPLY != 0 {
                        let w = fw.lock().unwrap_or_else(|e| e.into_inner());
                        if send(&w, &ack(&m)).is_err() {
                            break;
                        }
                    }
                    continue;
                }
                SET_FEATURES => features_set = true,
                _ => {}
            }
            if send(&back_w, &m).is_err() {
                break;
            }
            if m.request() == SET_FEATURES && early.values().any(|p| replay(&back_w, p).is_err()) {
                break;
            }
        }
        let _ = back_w.shutdown(std::net::Shutdown::Both);
        let _ = fw.lock().map(|f| f.shutdown(std::net::Shutdown::Both));
    })?;
    thread::Builder::new()
        .name("vu-relay-out".into())
        .spawn(move || {
            while let Ok(Some(m)) = recv(&mut back_r) {
                let w = front_w.lock().unwrap_or_else(|e| e.into_inner());
                if send(&w, &m).is_err() {
                    break;
                }
            }
            let _ = back_r.shutdown(std::net::Shutdown::Both);
            let _ = front_w.lock().map(|f| f.shutdown(std::net::Shutdown::Both));
            debug!(port = %name, "relay closed");
        })?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(req: u32, flags: u32, payload: &[u8]) -> Vec<u8> {
        let mut v = Vec::new();
        v.extend_from_slice(&req.to_le_bytes());
        v.extend_from_slice(&flags.to_le_bytes());
        v.extend_from_slice(&(payload.len() as u32).to_le_bytes());
        v.extend_from_slice(payload);
        v
    }

    #[test]
    fn early_enable_is_answered_and_the_rest_passes_with_fds() {
        let (mut qemu, front) = UnixStream::pair().unwrap();
        let (back, mut handler) = UnixStream::pair().unwrap();
        spawn(front, back, "t".into()).unwrap();

        // Early enable with NEED_REPLY: answered by the relay, not forwarded yet.
        qemu.write_all(&msg(
            SET_VRING_ENABLE,
            FLAG_VERSION | FLAG_NEED_REPLY,
            &[1, 0, 0, 0, 1, 0, 0, 0],
        ))
        .unwrap();
        let mut reply = [0u8; 20];
        qemu.read_exact(&mut reply).unwrap();
        assert_eq!(
            u32::from_le_bytes(reply[4..8].try_into().unwrap()),
            FLAG_VERSION | FLAG_REPLY
        );
        assert_eq!(&reply[12..], &[0; 8]);

        // A message with a descriptor arrives whole, fd included.
        let (a, b) = UnixStream::pair().unwrap();
        let m = Msg {
            hdr: msg(12, FLAG_VERSION, &[1, 2, 3, 4, 5, 6, 7, 8])[..HDR]
                .try_into()
                .unwrap(),
            payload: vec![1, 2, 3, 4, 5, 6, 7, 8],
            fds: vec![OwnedFd::from(a)],
        };
        send(&qemu, &m).unwrap();
        let got = recv(&mut handler).unwrap().unwrap();
        assert_eq!(
            (got.request(), got.payload.clone(), got.fds.len()),
            (12, m.payload.clone(), 1)
        );
        let mut peer = UnixStream::from(got.fds.into_iter().next().unwrap());
        peer.write_all(b"x").unwrap();
        let mut one = [0u8; 1];
        (&b).read_exact(&mut one).unwrap();

        // SET_FEATURES is followed by the replayed enable; later enables go through.
        qemu.write_all(&msg(SET_FEATURES, FLAG_VERSION, &[0; 8]))
            .unwrap();
        qemu.write_all(&msg(SET_VRING_ENABLE, FLAG_VERSION, &[0; 8]))
            .unwrap();
        assert_eq!(recv(&mut handler).unwrap().unwrap().request(), SET_FEATURES);
        let replayed = recv(&mut handler).unwrap().unwrap();
        assert_eq!(
            (replayed.request(), replayed.flags()),
            (SET_VRING_ENABLE, FLAG_VERSION)
        );
        assert_eq!(replayed.payload, vec![1, 0, 0, 0, 1, 0, 0, 0]);
        assert_eq!(recv(&mut handler).unwrap().unwrap().payload, vec![0; 8]);
        handler
            .write_all(&msg(1, FLAG_VERSION | FLAG_REPLY, &[9; 8]))
            .unwrap();
        assert_eq!(recv(&mut qemu).unwrap().unwrap().payload, vec![9; 8]);

        // Closing one side closes the other.
        drop(handler);
        assert!(recv(&mut qemu).unwrap().is_none());
    }
}

//! The relay between a port's frontend (QEMU) and the vhost crate's request handler,
//! and the port's control-plane firewall: every request is checked (`firewall`) before
//! the crate sees it, and a refused one is counted, logged and ends the connection.
//!
//! Descriptors are checked for what they must be before they pass: kick, call and error
//! descriptors must be eventfds and are made non-blocking (no thread ever blocks
//! signalling a guest); memory files must be regular files at least as long as their
//! regions, and sealed against shrinking unless the port allows otherwise (a file that
//! shrinks under a mapping raises SIGBUS in whichever thread touches it).
//!
//! QEMU's virtio-net also sends SET_VRING_ENABLE at every device reset, before
//! SET_FEATURES, and does not repeat it when the device starts; the vhost crate treats
//! an early one as a fatal protocol error. The relay answers early requests itself,
//! keeps the last state asked for each ring, and replays it right after SET_FEATURES.
//!
//! Live migration: SET_LOG_BASE goes on to the crate (which maps the log) once its
//! file is checked like a memory file; SEND_RARP and SET_LOG_FD, which the crate does
//! not know, are answered here (`announce` sends the RARP).
//!
//! The device status (VHOST_USER_PROTOCOL_F_STATUS), which the crate does not know
//! either: SET_STATUS is answered here and kept by the ring resumer (`resume`: a
//! driver setting the device up starts new rings), GET_STATUS answered with it.

use std::io::{self, Read, Write};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex};
use std::thread;

use tracing::{debug, trace, warn};

use super::announce;
use super::backend::PROTOCOL_FEATURES;
use super::firewall::{
    req, FdCheck, Firewall, Header, Policy, Refusal, Region, Verdict, FLAG_REPLY, FLAG_VERSION,
    HDR, MAX_FDS, MAX_MEM_SLOTS,
};
use super::port::{Port, MEM_CHANGES_PER_SEC, RESETS_PER_SEC};
use super::resume::{self, Resumer};
use crate::backend::switch::Switch;
use crate::l2::Mac;
use crate::stats::DropReason;
use crate::sys::{fd, scm};

/// Largest payload of the handler's replies (the vhost crate's MAX_MSG_SIZE).
const MAX_REPLY: usize = 0x1000;

/// One message: header, payload and the descriptors that came with it.
struct Msg {
    hdr: Header,
    payload: Vec<u8>,
    fds: Vec<OwnedFd>,
}

/// Reads one header and the descriptors sent with it; Ok(None) at end of stream.
/// More than `max_fds` descriptors is an ENOBUFS error (and none are kept).
fn recv_header(s: &mut UnixStream, max_fds: usize) -> io::Result<Option<(Header, Vec<OwnedFd>)>> {
    let mut hdr = [0u8; HDR];
    let (n, fds) = scm::recv_with_fds(s, &mut hdr, max_fds)?;
    if n == 0 {
        return Ok(None);
    }
    if n < HDR {
        s.read_exact(&mut hdr[n..])?;
    }
    Ok(Some((Header::parse(&hdr), fds)))
}

/// Reads one of the handler's replies; Ok(None) at end of stream.
fn recv_reply(s: &mut UnixStream) -> io::Result<Option<Msg>> {
    let Some((hdr, fds)) = recv_header(s, MAX_FDS)? else {
        return Ok(None);
    };
    if hdr.size as usize > MAX_REPLY {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("vhost-user payload of {} bytes", hdr.size),
        ));
    }
    let mut payload = vec![0u8; hdr.size as usize];
    s.read_exact(&mut payload)?;
    Ok(Some(Msg { hdr, payload, fds }))
}

/// Writes one message in a single sendmsg, descriptors attached to its first byte.
fn send(s: &UnixStream, m: &Msg) -> io::Result<()> {
    let mut bytes = Vec::with_capacity(HDR + m.payload.len());
    bytes.extend_from_slice(&m.hdr.bytes());
    bytes.extend_from_slice(&m.payload);
    let fds: Vec<BorrowedFd<'_>> = m.fds.iter().map(|f| f.as_fd()).collect();
    let n = scm::send_with_fds(s, &bytes, &fds)?;
    if n < bytes.len() {
        (&*s).write_all(&bytes[n..])?;
    }
    Ok(())
}

/// The answer to an early SET_VRING_ENABLE that asked for one: success.
fn ack(req: &Header) -> Msg {
    reply_u64(req, 0)
}

/// A reply of one u64 to `req`.
fn reply_u64(req: &Header, v: u64) -> Msg {
    Msg {
        hdr: Header {
            request: req.request,
            flags: FLAG_VERSION | FLAG_REPLY,
            size: 8,
        },
        payload: v.to_le_bytes().to_vec(),
        fds: Vec::new(),
    }
}

/// Sends a recorded SET_VRING_ENABLE (no reply asked, so none comes back).
fn replay(back: &UnixStream, ring: u32, state: u32) -> io::Result<()> {
    let mut payload = ring.to_le_bytes().to_vec();
    payload.extend_from_slice(&state.to_le_bytes());
    send(
        back,
        &Msg {
            hdr: Header {
                request: req::SET_VRING_ENABLE,
                flags: FLAG_VERSION,
                size: 8,
            },
            payload,
            fds: Vec::new(),
        },
    )
}

/// Checks the descriptors of an admitted message against what it must carry; call,
/// kick and error eventfds come out non-blocking.
fn check_fds(check: &FdCheck, fds: &[OwnedFd], allow_unsealed: bool) -> Result<(), Refusal> {
    let cannot_tell =
        |reason, e: io::Error| Refusal::new(reason, format!("cannot inspect a descriptor: {e}"));
    match check {
        FdCheck::None | FdCheck::Close => {}
        FdCheck::Eventfd => {
            for f in fds {
                let not = DropReason::FrontendNotEventfd;
                if !fd::is_eventfd(f.as_fd()).map_err(|e| cannot_tell(not, e))? {
                    return Err(Refusal::new(
                        not,
                        "a kick, call or error descriptor that is not an eventfd",
                    ));
                }
                fd::set_nonblocking(f.as_fd()).map_err(|e| cannot_tell(not, e))?;
            }
        }
        FdCheck::Log(r) => {
            let Some(f) = fds.first() else {
                return Err(Refusal::new(
                    DropReason::FrontendBadFds,
                    "a log without its file",
                ));
            };
            check_file("the dirty log", r, f, allow_unsealed)?;
        }
        FdCheck::Memory(regions) => {
            for (i, (r, f)) in regions.iter().zip(fds).enumerate() {
                check_file(&format!("memory region {i}"), r, f, allow_unsealed)?;
            }
        }
    }
    Ok(())
}

/// A memory or log file: regular, reaching to the end of what is mapped of it, and
/// sealed against shrinking (a file that shrinks under a mapping raises SIGBUS in
/// whichever thread touches it) unless the port allows otherwise.
fn check_file(what: &str, r: &Region, f: &OwnedFd, allow_unsealed: bool) -> Result<(), Refusal> {
    let cannot_tell =
        |reason, e: io::Error| Refusal::new(reason, format!("cannot inspect a descriptor: {e}"));
    let bad = DropReason::FrontendBadMemory;
    let st = fd::stat(f.as_fd()).map_err(|e| cannot_tell(bad, e))?;
    if !st.regular {
        return Err(Refusal::new(
            bad,
            format!("{what} is not in a regular file"),
        ));
    }
    if r.end() > st.size {
        return Err(Refusal::new(
            bad,
            format!("{what} ends at byte {} of a {}-byte file", r.end(), st.size),
        ));
    }
    let unsealed = DropReason::FrontendUnsealedMemory;
    let seals = fd::seals(f.as_fd()).map_err(|e| cannot_tell(unsealed, e))?;
    if !allow_unsealed && !seals.no_shrink() {
        return Err(Refusal::new(
            unsealed,
            format!(
                "{what} is in a file not sealed against shrinking \
                 (seals {:#x}): use QEMU's memory-backend-memfd (it seals by \
                 default), or set allow_unsealed_memory=on on this port to trust \
                 the frontend never to truncate it",
                seals.bits()
            ),
        ));
    }
    Ok(())
}

/// How the frontend's side of a connection ended.
enum End {
    /// It closed, or a socket failed.
    Closed,
    /// The firewall refused a message (its header, when it was read).
    Refused(Option<Header>, Refusal),
}

/// Checks and forwards the frontend's requests until the connection ends.
fn inbound(
    front: &mut UnixStream,
    back: &UnixStream,
    front_w: &Mutex<UnixStream>,
    port: &Port,
    switch: &Switch,
    fw: &mut Firewall,
) -> End {
    let name = port.name();
    let mut resumer = Resumer::default();
    loop {
        let (hdr, fds) = match recv_header(front, MAX_FDS) {
            Ok(Some(m)) => m,
            Ok(None) => return End::Closed,
            Err(e) if e.raw_os_error() == Some(libc::ENOBUFS) => {
                let why = format!("more than {MAX_FDS} descriptors on one message");
                return End::Refused(None, Refusal::new(DropReason::FrontendBadFds, why));
            }
            Err(_) => return End::Closed,
        };
        trace!(port = %name, request = hdr.request, flags = hdr.flags, size = hdr.size, fds = fds.len(), "vhost-user request");
        // The header first: a bad size is refused before anything is read or allocated.
        if let Err(r) = fw.header(&hdr) {
            return End::Refused(Some(hdr), r);
        }
        let mut payload = vec![0u8; hdr.size as usize];
        if front.read_exact(&mut payload).is_err() {
            return End::Closed;
        }
        let check = match fw.admit(&hdr, &mut payload, fds.len()) {
            Ok(Verdict::Forward(check)) => check,
            Ok(Verdict::Early) => {
                debug!(port = %name, "answering SET_VRING_ENABLE sent before SET_FEATURES");
                if !answer(front_w, &hdr, fw) {
                    return End::Closed;
                }
                continue;
            }
            Ok(Verdict::Rarp(mac)) => {
                announce::announce(port, switch, Mac(mac));
                if !answer(front_w, &hdr, fw) {
                    return End::Closed;
                }
                continue;
            }
            Ok(Verdict::MaxMemSlots) => {
                if !answer_u64(front_w, &hdr, MAX_MEM_SLOTS as u64) {
                    return End::Closed;
                }
                continue;
            }
            Ok(Verdict::SetStatus(s)) => {
                debug!(port = %name, status = format_args!("{s:#x}"), "device status set");
                resumer.device_status(s);
                if !answer(front_w, &hdr, fw) {
                    return End::Closed;
                }
                continue;
            }
            Ok(Verdict::GetStatus) => {
                if !answer_u64(front_w, &hdr, u64::from(resumer.status())) {
                    return End::Closed;
                }
                continue;
            }
            Ok(Verdict::LogFd) => {
                // Checked, then closed: gsonet does not signal log writes.
                if let Err(r) = check_fds(&FdCheck::Eventfd, &fds, false) {
                    return End::Refused(Some(hdr), r);
                }
                drop(fds);
                if !answer(front_w, &hdr, fw) {
                    return End::Closed;
                }
                continue;
            }
            Err(r) => return End::Refused(Some(hdr), r),
        };
        if let Err(r) = check_fds(&check, &fds, port.cfg.allow_unsealed_memory) {
            return End::Refused(Some(hdr), r);
        }
        let fds = if check == FdCheck::Close {
            Vec::new()
        } else {
            fds
        };
        if hdr.request == req::SET_FEATURES {
            await_reset_token(port);
        }
        if matches!(hdr.request, req::ADD_MEM_REG | req::REM_MEM_REG) {
            await_mem_token(port);
        }
        if moves_rings(hdr.request) {
            // Frames written into the guest's RX queues are published at the end of
            // their sender's batch; a request that stops, moves or remaps a ring must
            // find them published already.
            port.publish_rx();
        }
        resumer.inbound(port, &hdr, &mut payload, &fds);
        if send(back, &Msg { hdr, payload, fds }).is_err() {
            return End::Closed;
        }
        if starts_rings(hdr.request) {
            port.wake_workers();
        }
        if hdr.request == req::SET_FEATURES
            && fw
                .early()
                .any(|(ring, state)| replay(back, ring, state).is_err())
        {
            return End::Closed;
        }
    }
}

/// Requests after which a ring may run (the device started, a ring got its kick or
/// call fd, or was enabled): what the start owes the guest is looked at.
fn starts_rings(request: u32) -> bool {
    matches!(
        request,
        req::SET_FEATURES | req::SET_VRING_KICK | req::SET_VRING_CALL | req::SET_VRING_ENABLE
    )
}

/// Requests after which the rings' used indexes must be final: they stop, reset,
/// move or remap a ring, or start logging its writes.
fn moves_rings(request: u32) -> bool {
    matches!(
        request,
        req::SET_FEATURES
            | req::RESET_OWNER
            | req::SET_MEM_TABLE
            | req::SET_LOG_BASE
            | req::SET_VRING_NUM
            | req::SET_VRING_ADDR
            | req::SET_VRING_BASE
            | req::GET_VRING_BASE
            | req::SET_VRING_ENABLE
            | req::ADD_MEM_REG
            | req::REM_MEM_REG
    )
}

/// Holds a device reset back until the port's reset budget allows it. Only this
/// connection's relay thread waits; it holds no lock.
fn await_reset_token(port: &Port) {
    if port.resets.take(1) {
        return;
    }
    if let Some(quiet) = port.log.allow() {
        warn!(port = %port.name(), suppressed = quiet, "frontend resets the device in a loop; held to {RESETS_PER_SEC} a second");
    }
    while !port.resets.take(1) {
        thread::sleep(RESET_POLL);
    }
}

/// Holds a memory change (ADD/REM_MEM_REG) back until the port's budget for them
/// allows it: each maps or unmaps a file and waits for the port's passes in flight,
/// so a frontend adding and removing regions in a loop is held to a pace that costs
/// its own port a little and the other ports nothing. Only this relay thread waits.
fn await_mem_token(port: &Port) {
    if port.mem_changes.take(1) {
        return;
    }
    if let Some(quiet) = port.log.allow() {
        warn!(port = %port.name(), suppressed = quiet, "frontend adds and removes memory in a loop; held to {MEM_CHANGES_PER_SEC} changes a second");
    }
    while !port.mem_changes.take(1) {
        thread::sleep(RESET_POLL);
    }
}

/// How often a held-back reset looks for its token.
const RESET_POLL: std::time::Duration = std::time::Duration::from_millis(5);

/// Acknowledges a request the relay handled itself, if the frontend asked for a reply
/// and negotiated REPLY_ACK; false if the frontend's socket failed.
fn answer(front_w: &Mutex<UnixStream>, hdr: &Header, fw: &Firewall) -> bool {
    if !(hdr.need_reply() && fw.reply_ack()) {
        return true;
    }
    let w = front_w.lock().unwrap_or_else(|e| e.into_inner());
    send(&w, &ack(hdr)).is_ok()
}

/// Answers a request the relay handled itself with `v` (GET_MAX_MEM_SLOTS,
/// GET_STATUS); false if the frontend's socket failed.
fn answer_u64(front_w: &Mutex<UnixStream>, hdr: &Header, v: u64) -> bool {
    let w = front_w.lock().unwrap_or_else(|e| e.into_inner());
    send(&w, &reply_u64(hdr, v)).is_ok()
}

/// GET_VRING_BASE's reply for a packed ring: the vhost crate replies the queue's
/// 16-bit avail position (index and wrap counter, `ring::packed::Pos::to_base`) and
/// leaves bits 16-31 zero, where the frontend reads the used position (QEMU takes
/// it as its own used index and wrap counter, and sends it back in the next
/// SET_VRING_BASE). A stopped ring of gsonet's has every buffer it took handed back
/// (`ring::vq`), so the used position is the avail one.
fn packed_base_reply(payload: &mut [u8]) {
    // struct vhost_vring_state: index u32, num u32.
    let Some(num) = payload.get_mut(4..8) else {
        return;
    };
    let avail = u32::from_le_bytes([num[0], num[1], num[2], num[3]]) & 0xffff;
    num.copy_from_slice(&(avail | avail << 16).to_le_bytes());
}

/// Relays between `front` (the frontend) and `back` (the vhost crate's handler) for
/// `port` until either side closes or the firewall refuses a request; returns at once,
/// the work happens in two threads.
pub fn spawn(
    front: UnixStream,
    back: UnixStream,
    port: Arc<Port>,
    switch: Arc<Switch>,
) -> io::Result<()> {
    let front_w = Arc::new(Mutex::new(front.try_clone()?));
    let (mut front_r, back_w) = (front, back.try_clone()?);
    let mut back_r = back;
    let fw_lock = front_w.clone();
    let policy = Policy {
        queues: (port.queue_pairs() * 2) as u32,
        protocol_features: PROTOCOL_FEATURES.bits(),
    };
    let p = port.clone();
    thread::Builder::new().name("vu-relay-in".into()).spawn(move || {
        let mut fw = Firewall::new(policy);
        if let End::Refused(hdr, r) =
            inbound(&mut front_r, &back_w, &fw_lock, &p, &switch, &mut fw)
        {
            p.stats.drop(r.reason);
            // A frontend can reconnect in a loop: the line is rate-limited per port.
            if let Some(quiet) = p.log.allow() {
                warn!(port = %p.name(), request = hdr.map(|h| h.request), reason = %r.reason, suppressed = quiet,
                    "refused a vhost-user request: {}; closing the frontend's connection", r.why);
            }
        }
        let _ = back_w.shutdown(std::net::Shutdown::Both);
        let _ = fw_lock.lock().map(|f| f.shutdown(std::net::Shutdown::Both));
    })?;
    thread::Builder::new()
        .name("vu-relay-out".into())
        .spawn(move || {
            while let Ok(Some(mut m)) = recv_reply(&mut back_r) {
                if m.hdr.request == req::GET_VRING_BASE && port.packed() {
                    packed_base_reply(&mut m.payload);
                    resume::outbound(&port, &m.hdr, &m.payload);
                }
                let w = front_w.lock().unwrap_or_else(|e| e.into_inner());
                if send(&w, &m).is_err() {
                    break;
                }
            }
            let _ = back_r.shutdown(std::net::Shutdown::Both);
            let _ = front_w.lock().map(|f| f.shutdown(std::net::Shutdown::Both));
            debug!(port = %port.name(), "relay closed");
        })?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::vhost::firewall::tests::reg;
    use crate::config::PortConfig;
    use crate::sys::fd::is_nonblocking;
    use std::fs::File;
    use std::time::Duration;

    const REPLY_ACK: u64 = 1 << 3;

    fn port(opts: &str) -> Arc<Port> {
        Arc::new(
            Port::new(
                0,
                PortConfig::parse(&format!("socket=/t,packed=off{opts}")).unwrap(),
            )
            .unwrap(),
        )
    }

    /// A relay for `port`: (the frontend's end, the handler's end).
    fn relay(port: Arc<Port>) -> (UnixStream, UnixStream) {
        let (qemu, front) = UnixStream::pair().unwrap();
        let (back, handler) = UnixStream::pair().unwrap();
        let ports: Vec<Arc<dyn crate::backend::switch::SwitchPort>> = vec![port.clone()];
        let switch = Arc::new(Switch::new(ports, vec![], Duration::from_secs(300)));
        spawn(front, back, port, switch).unwrap();
        qemu.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        handler
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        (qemu, handler)
    }

    fn msg(request: u32, flags: u32, payload: &[u8], fds: Vec<OwnedFd>) -> Msg {
        Msg {
            hdr: Header {
                request,
                flags,
                size: payload.len() as u32,
            },
            payload: payload.to_vec(),
            fds,
        }
    }

    fn pair(a: u32, b: u32) -> Vec<u8> {
        [a.to_le_bytes(), b.to_le_bytes()].concat()
    }

    fn eventfd() -> OwnedFd {
        fd::test_eventfd()
    }

    fn memfd(size: u64, seal: bool) -> OwnedFd {
        fd::guest_memfd(size, seal).expect("memfd").into()
    }

    /// Whether the relay closed the frontend's end (EOF) within the read timeout.
    fn closed(qemu: &mut UnixStream) -> bool {
        let mut b = [0u8; 64];
        loop {
            match qemu.read(&mut b) {
                Ok(0) => return true,
                Ok(_) => continue,
                // Closed with our message unread.
                Err(e) => return e.kind() == io::ErrorKind::ConnectionReset,
            }
        }
    }

    #[test]
    fn early_enable_is_answered_and_the_rest_passes_with_fds() {
        let p = port("");
        let (mut qemu, mut handler) = relay(p.clone());

        // REPLY_ACK acked (the handler sees the masked value).
        send(
            &qemu,
            &msg(
                req::SET_PROTOCOL_FEATURES,
                FLAG_VERSION,
                &(REPLY_ACK | 1 << 14).to_le_bytes(),
                vec![],
            ),
        )
        .unwrap();
        let got = recv_reply(&mut handler).unwrap().unwrap();
        assert_eq!(got.payload, REPLY_ACK.to_le_bytes());

        // Early enable with NEED_REPLY: answered by the relay, not forwarded yet.
        qemu.write_all(
            &[
                &msg(
                    req::SET_VRING_ENABLE,
                    FLAG_VERSION | 0x8,
                    &pair(1, 1),
                    vec![],
                )
                .hdr
                .bytes()[..],
                &pair(1, 1),
            ]
            .concat(),
        )
        .unwrap();
        let mut reply = [0u8; 20];
        qemu.read_exact(&mut reply).unwrap();
        assert_eq!(
            u32::from_le_bytes(reply[4..8].try_into().unwrap()),
            FLAG_VERSION | FLAG_REPLY
        );
        assert_eq!(&reply[12..], &[0; 8]);

        // A call eventfd arrives whole, made non-blocking.
        let e = eventfd();
        let mine = e.try_clone().unwrap();
        send(
            &qemu,
            &msg(
                req::SET_VRING_CALL,
                FLAG_VERSION,
                &1u64.to_le_bytes(),
                vec![e],
            ),
        )
        .unwrap();
        let got = recv_reply(&mut handler).unwrap().unwrap();
        assert_eq!(
            (got.hdr.request, got.payload.clone(), got.fds.len()),
            (req::SET_VRING_CALL, 1u64.to_le_bytes().to_vec(), 1)
        );
        assert!(is_nonblocking(got.fds[0].as_fd()).unwrap());
        File::from(mine).write_all(&5u64.to_le_bytes()).unwrap();
        let mut count = [0u8; 8];
        File::from(got.fds.into_iter().next().unwrap())
            .read_exact(&mut count)
            .unwrap();
        assert_eq!(u64::from_le_bytes(count), 5);

        // SET_FEATURES is followed by the replayed enable; later enables go through.
        send(
            &qemu,
            &msg(req::SET_FEATURES, FLAG_VERSION, &[0; 8], vec![]),
        )
        .unwrap();
        send(
            &qemu,
            &msg(req::SET_VRING_ENABLE, FLAG_VERSION, &[0; 8], vec![]),
        )
        .unwrap();
        assert_eq!(
            recv_reply(&mut handler).unwrap().unwrap().hdr.request,
            req::SET_FEATURES
        );
        let replayed = recv_reply(&mut handler).unwrap().unwrap();
        assert_eq!(
            (replayed.hdr.request, replayed.hdr.flags),
            (req::SET_VRING_ENABLE, FLAG_VERSION)
        );
        assert_eq!(replayed.payload, pair(1, 1));
        assert_eq!(
            recv_reply(&mut handler).unwrap().unwrap().payload,
            vec![0; 8]
        );
        send(
            &handler,
            &msg(1, FLAG_VERSION | FLAG_REPLY, &[9; 8], vec![]),
        )
        .unwrap();
        assert_eq!(recv_reply(&mut qemu).unwrap().unwrap().payload, vec![9; 8]);

        // Closing one side closes the other.
        drop(handler);
        assert!(recv_reply(&mut qemu).unwrap().is_none());
        assert_eq!(p.stats.snapshot().drops.len(), 0);
    }

    /// Sends `m` on a fresh relay; the relay must close the connection, forward nothing
    /// and count `reason`.
    fn refused(opts: &str, m: Msg, reason: DropReason) {
        refused_acking(opts, 1 | REPLY_ACK, m, reason)
    }

    /// `refused`, with protocol features `acked` acked first.
    fn refused_acking(opts: &str, acked: u64, m: Msg, reason: DropReason) {
        let p = port(opts);
        let (mut qemu, mut handler) = relay(p.clone());
        let r = msg(
            req::SET_PROTOCOL_FEATURES,
            FLAG_VERSION,
            &acked.to_le_bytes(),
            vec![],
        );
        send(&qemu, &r).unwrap();
        assert_eq!(
            recv_reply(&mut handler).unwrap().unwrap().hdr.request,
            req::SET_PROTOCOL_FEATURES
        );
        let _ = send(&qemu, &m);
        assert!(closed(&mut qemu), "{reason}: still open");
        assert!(
            recv_reply(&mut handler).unwrap().is_none(),
            "{reason}: forwarded"
        );
        assert_eq!(p.stats.drops(reason), 1, "{reason}");
    }

    #[test]
    fn refused_messages_end_the_connection_and_are_counted() {
        use DropReason::*;
        refused(
            "",
            msg(
                req::ADD_MEM_REG,
                FLAG_VERSION,
                &[0; 40],
                vec![memfd(4096, true)],
            ),
            FrontendRequestRefused,
        );
        refused(
            "",
            msg(99, FLAG_VERSION, &[], vec![]),
            FrontendRequestRefused,
        );
        refused(
            "",
            msg(req::GET_FEATURES, FLAG_VERSION | FLAG_REPLY, &[], vec![]),
            FrontendRequestRefused,
        );
        refused(
            "",
            msg(req::SET_VRING_ENABLE, FLAG_VERSION, &[1, 0, 0, 0], vec![]),
            FrontendBadPayload,
        );
        refused(
            "",
            msg(req::SET_VRING_ENABLE, FLAG_VERSION, &pair(2, 1), vec![]),
            FrontendBadPayload,
        );
        refused(
            "",
            msg(req::GET_FEATURES, FLAG_VERSION, &[0; 100], vec![]),
            FrontendBadPayload,
        );
        refused(
            "",
            msg(req::GET_FEATURES, FLAG_VERSION, &[], vec![eventfd()]),
            FrontendBadFds,
        );
        let nine: Vec<OwnedFd> = (0..MAX_FDS + 1).map(|_| eventfd()).collect();
        refused(
            "",
            msg(req::SET_OWNER, FLAG_VERSION, &[], nine),
            FrontendBadFds,
        );
        let (a, _b) = UnixStream::pair().unwrap();
        refused(
            "",
            msg(
                req::SET_VRING_KICK,
                FLAG_VERSION,
                &0u64.to_le_bytes(),
                vec![a.into()],
            ),
            FrontendNotEventfd,
        );
    }

    fn table(size: u64) -> Vec<u8> {
        let mut p = pair(1, 0);
        for v in [0u64, size, 0x7000_0000_0000, 0] {
            p.extend_from_slice(&v.to_le_bytes());
        }
        p
    }

    #[test]
    fn memory_files_must_cover_their_regions_and_be_sealed() {
        use DropReason::*;
        let t = |size| msg(req::SET_MEM_TABLE, FLAG_VERSION, &table(size), vec![]);
        let with = |mut m: Msg, f: OwnedFd| {
            m.fds.push(f);
            m
        };
        refused(
            "",
            with(t(2 << 20), memfd(1 << 20, true)),
            FrontendBadMemory,
        );
        refused(
            "",
            with(t(1 << 20), memfd(1 << 20, false)),
            FrontendUnsealedMemory,
        );
        refused(
            ",allow_unsealed_memory=on",
            with(t(2 << 20), memfd(1 << 20, false)),
            FrontendBadMemory,
        );
        let (a, _b) = UnixStream::pair().unwrap();
        refused("", with(t(4096), a.into()), FrontendBadMemory);

        for (opts, seal) in [("", true), (",allow_unsealed_memory=on", false)] {
            let (qemu, mut handler) = relay(port(opts));
            send(&qemu, &with(t(1 << 20), memfd(1 << 20, seal))).unwrap();
            let got = recv_reply(&mut handler).unwrap().unwrap();
            assert_eq!(
                (got.hdr.request, got.fds.len()),
                (req::SET_MEM_TABLE, 1),
                "{opts}"
            );
        }
    }

    const MEM_SLOTS: u64 = 1 << 15;

    #[test]
    fn mem_slots_are_answered_here_and_added_files_checked() {
        use DropReason::*;
        let acked = 1 | REPLY_ACK | MEM_SLOTS;
        let add = |size, offset, f| {
            msg(
                req::ADD_MEM_REG,
                FLAG_VERSION,
                &reg(1 << 32, size, 1 << 40, offset),
                vec![f],
            )
        };
        refused_acking(
            "",
            acked,
            add(1 << 20, 0, memfd(1 << 20, false)),
            FrontendUnsealedMemory,
        );
        refused_acking(
            "",
            acked,
            add(1 << 20, 4096, memfd(1 << 20, true)),
            FrontendBadMemory,
        );
        let (a, _b) = UnixStream::pair().unwrap();
        refused_acking("", acked, add(4096, 0, a.into()), FrontendBadMemory);
        let rem = msg(
            req::REM_MEM_REG,
            FLAG_VERSION,
            &reg(1 << 32, 4096, 1 << 40, 0),
            vec![],
        );
        refused_acking("", acked, rem, FrontendBadPayload);

        let p = port("");
        let (mut qemu, mut handler) = relay(p.clone());
        ack_protocol(&qemu, &mut handler, acked);
        // Our bound, not the crate's 509.
        send(
            &qemu,
            &msg(req::GET_MAX_MEM_SLOTS, FLAG_VERSION, &[], vec![]),
        )
        .unwrap();
        let got = recv_reply(&mut qemu).unwrap().unwrap();
        assert_eq!(
            (got.hdr.request, got.hdr.flags),
            (req::GET_MAX_MEM_SLOTS, FLAG_VERSION | FLAG_REPLY)
        );
        assert_eq!(got.payload, (MAX_MEM_SLOTS as u64).to_le_bytes());
        // A fitting region goes on with its file; its removal with a stray file goes
        // on without it.
        send(&qemu, &add(1 << 20, 4096, memfd(2 << 20, true))).unwrap();
        let got = recv_reply(&mut handler).unwrap().unwrap();
        assert_eq!((got.hdr.request, got.fds.len()), (req::ADD_MEM_REG, 1));
        let rem = reg(1 << 32, 1 << 20, 1 << 40, 0);
        send(
            &qemu,
            &msg(
                req::REM_MEM_REG,
                FLAG_VERSION,
                &rem,
                vec![memfd(4096, true)],
            ),
        )
        .unwrap();
        let got = recv_reply(&mut handler).unwrap().unwrap();
        assert_eq!(
            (got.hdr.request, got.payload, got.fds.len()),
            (req::REM_MEM_REG, rem, 0)
        );
        assert_eq!(p.stats.snapshot().drops.len(), 0);
    }

    const LOG_SHMFD: u64 = 1 << 1;
    const RARP: u64 = 1 << 2;
    const STATUS: u64 = 1 << 16;

    fn log(size: u64, offset: u64) -> Vec<u8> {
        [size.to_le_bytes(), offset.to_le_bytes()].concat()
    }

    #[test]
    fn migration_requests_need_their_features_and_a_fitting_log() {
        use DropReason::*;
        let base =
            |size, offset, f| msg(req::SET_LOG_BASE, FLAG_VERSION, &log(size, offset), vec![f]);
        // Logging without LOG_SHMFD negotiated, a RARP without RARP: refused.
        refused("", base(4096, 0, memfd(4096, true)), FrontendRequestRefused);
        let rarp = |mac: [u8; 8]| msg(req::SEND_RARP, FLAG_VERSION, &mac, vec![]);
        refused("", rarp([2, 0, 0, 0, 0, 1, 0, 0]), FrontendRequestRefused);
        let both = 1 | REPLY_ACK | LOG_SHMFD | RARP;
        refused_acking("", both, rarp([1, 0, 0, 0, 0, 1, 0, 0]), FrontendBadPayload);
        refused_acking("", both, rarp([0; 8]), FrontendBadPayload);
        // A log beyond its file, unaligned, empty, unsealed, or not a file.
        refused_acking(
            "",
            both,
            base(8192, 0, memfd(4096, true)),
            FrontendBadMemory,
        );
        refused_acking(
            "",
            both,
            base(4096, 4096, memfd(4096, true)),
            FrontendBadMemory,
        );
        refused_acking(
            "",
            both,
            base(4096, 100, memfd(8192, true)),
            FrontendBadPayload,
        );
        refused_acking("", both, base(0, 0, memfd(4096, true)), FrontendBadPayload);
        refused_acking(
            "",
            both,
            base(4096, 0, memfd(4096, false)),
            FrontendUnsealedMemory,
        );
        let (a, _b) = UnixStream::pair().unwrap();
        refused_acking("", both, base(4096, 0, a.into()), FrontendBadMemory);
        let no_fd = msg(req::SET_LOG_BASE, FLAG_VERSION, &log(4096, 0), vec![]);
        refused_acking("", both, no_fd, FrontendBadFds);
        let (a, _b) = UnixStream::pair().unwrap();
        let not_eventfd = msg(req::SET_LOG_FD, FLAG_VERSION, &[], vec![a.into()]);
        refused_acking("", both, not_eventfd, FrontendNotEventfd);
    }

    /// Acks protocol features `acked` through the relay, which passes them on.
    fn ack_protocol(qemu: &UnixStream, handler: &mut UnixStream, acked: u64) {
        let m = msg(
            req::SET_PROTOCOL_FEATURES,
            FLAG_VERSION,
            &acked.to_le_bytes(),
            vec![],
        );
        send(qemu, &m).unwrap();
        assert_eq!(
            recv_reply(handler).unwrap().unwrap().payload,
            acked.to_le_bytes()
        );
    }

    #[test]
    fn the_device_status_is_kept_and_answered_here() {
        let p = port("");
        let (mut qemu, mut handler) = relay(p.clone());
        ack_protocol(&qemu, &mut handler, REPLY_ACK | STATUS);
        let need = FLAG_VERSION | 0x8;
        let get = |qemu: &mut UnixStream| {
            send(qemu, &msg(req::GET_STATUS, FLAG_VERSION, &[], vec![])).unwrap();
            let got = recv_reply(qemu).unwrap().unwrap();
            assert_eq!(got.hdr.request, req::GET_STATUS);
            u64::from_le_bytes(got.payload.try_into().unwrap())
        };
        assert_eq!(get(&mut qemu), 0);
        for status in [0xb_u64, 0xf, 0] {
            send(
                &qemu,
                &msg(req::SET_STATUS, need, &status.to_le_bytes(), vec![]),
            )
            .unwrap();
            let got = recv_reply(&mut qemu).unwrap().unwrap();
            assert_eq!(
                (got.hdr.request, got.payload),
                (req::SET_STATUS, vec![0; 8])
            );
            assert_eq!(get(&mut qemu), status);
        }
        // Never shown to the crate: the next request it sees is the next one sent.
        send(&qemu, &msg(req::GET_FEATURES, FLAG_VERSION, &[], vec![])).unwrap();
        assert_eq!(
            recv_reply(&mut handler).unwrap().unwrap().hdr.request,
            req::GET_FEATURES
        );
        assert_eq!(p.stats.snapshot().drops.len(), 0);
    }

    #[test]
    fn a_fitting_log_goes_on_and_rarp_and_log_fd_are_answered_here() {
        let p = port("");
        let (mut qemu, mut handler) = relay(p.clone());
        let acked = REPLY_ACK | LOG_SHMFD | RARP;
        ack_protocol(&qemu, &mut handler, acked);
        // Answered by the relay (REPLY_ACK), never shown to the crate, which does not
        // know them.
        let need = FLAG_VERSION | 0x8;
        send(
            &qemu,
            &msg(req::SEND_RARP, need, &[2, 0, 0, 0, 0, 7, 0, 0], vec![]),
        )
        .unwrap();
        let got = recv_reply(&mut qemu).unwrap().unwrap();
        assert_eq!((got.hdr.request, got.payload), (req::SEND_RARP, vec![0; 8]));
        send(&qemu, &msg(req::SET_LOG_FD, need, &[], vec![eventfd()])).unwrap();
        let got = recv_reply(&mut qemu).unwrap().unwrap();
        assert_eq!(
            (got.hdr.request, got.payload),
            (req::SET_LOG_FD, vec![0; 8])
        );
        // A log covering the (empty) memory, in a sealed file: passed on with its file.
        send(
            &qemu,
            &msg(
                req::SET_LOG_BASE,
                FLAG_VERSION,
                &log(4096, 4096),
                vec![memfd(8192, true)],
            ),
        )
        .unwrap();
        let got = recv_reply(&mut handler).unwrap().unwrap();
        assert_eq!(
            (got.hdr.request, got.payload, got.fds.len()),
            (req::SET_LOG_BASE, log(4096, 4096), 1)
        );
        assert_eq!(p.stats.snapshot().drops.len(), 0);
    }
}

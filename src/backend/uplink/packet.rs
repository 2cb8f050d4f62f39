//! Packet uplink: an existing host interface (a NIC, a veth, a bridge port) through
//! AF_PACKET sockets (SOCK_RAW, ETH_P_ALL, bound to the interface) with PACKET_VNET_HDR,
//! so GSO frames reach a TSO-capable device intact and the frames the kernel hands us
//! keep their GSO and checksum metadata.
//!
//! - Header size: PACKET_VNET_HDR_SZ (Linux 6.2+) sets the 12-byte virtio 1.x header
//!   the rest of gsonet speaks; older kernels only know PACKET_VNET_HDR, the 10-byte
//!   legacy header (no num_buffers). Both are handled; `hdr_len` tells which.
//! - Promiscuous membership (PACKET_MR_PROMISC) so frames for the guests' MACs arrive.
//! - Frames we send are not read back: PACKET_IGNORE_OUTGOING where the kernel has it,
//!   and every frame whose sll_pkttype is PACKET_OUTGOING is skipped regardless.
//! - `queues=N` opens N sockets in one PACKET_FANOUT (hash) group: each received frame
//!   reaches one of them.
//! - PACKET_QDISC_BYPASS (`bypass=on`) hands our frames straight to the driver queue.

use std::ffi::CString;
use std::io;
use std::mem;
use std::ops::Range;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

use thiserror::Error;
use tracing::{debug, warn};

use super::{writev, UplinkDevice};
use crate::features::Caps;
use crate::vnet_hdr::{HDR_LEN, LEGACY_HDR_LEN};

// <linux/if_packet.h>, <linux/if_ether.h>: stable ABI values.
const SOL_PACKET: libc::c_int = 263;
const PACKET_ADD_MEMBERSHIP: libc::c_int = 1;
const PACKET_AUXDATA: libc::c_int = 8;
const TP_STATUS_VLAN_VALID: u32 = 1 << 4;
const TP_STATUS_VLAN_TPID_VALID: u32 = 1 << 6;
/// Room kept in front of a received frame to put back a VLAN tag the kernel took off.
const TAG: usize = 4;
const PACKET_VNET_HDR: libc::c_int = 15;
const PACKET_FANOUT: libc::c_int = 18;
const PACKET_QDISC_BYPASS: libc::c_int = 20;
const PACKET_IGNORE_OUTGOING: libc::c_int = 23;
const PACKET_VNET_HDR_SZ: libc::c_int = 24;
const PACKET_MR_PROMISC: libc::c_ushort = 1;
const PACKET_FANOUT_HASH: u32 = 0;
const PACKET_OUTGOING: u8 = 4;
const ETH_P_ALL: u16 = 0x0003;
/// Socket buffers: a few 64 KiB frames in flight are not enough.
const SOCK_BUF: libc::c_int = 4 << 20;

#[derive(Debug, Error)]
pub enum PacketError {
    #[error("interface name {0:?} is not valid (1-15 bytes)")]
    BadName(String),
    #[error("no interface {0} on this host (see `ip link`): dev= takes an existing interface; tap= creates one")]
    NoSuchInterface(String),
    #[error(
        "cannot open an AF_PACKET socket: {0} (gsonet needs root or CAP_NET_RAW for a dev= uplink)"
    )]
    Socket(io::Error),
    #[error("dev {name}: {what} failed: {err}{hint}")]
    Setup {
        name: String,
        what: &'static str,
        err: io::Error,
        hint: &'static str,
    },
}

#[repr(C)]
struct PacketMreq {
    mr_ifindex: libc::c_int,
    mr_type: libc::c_ushort,
    mr_alen: libc::c_ushort,
    mr_address: [u8; 8],
}

/// AF_PACKET sockets on one interface: one per queue.
pub struct PacketSocket {
    name: String,
    ifindex: i32,
    hdr_len: usize,
    socks: Vec<OwnedFd>,
}

fn setsockopt<T>(fd: RawFd, level: libc::c_int, opt: libc::c_int, val: &T) -> io::Result<()> {
    // SAFETY: `val` is a live value of the size we pass.
    let r = unsafe {
        libc::setsockopt(
            fd,
            level,
            opt,
            val as *const T as *const libc::c_void,
            mem::size_of::<T>() as libc::socklen_t,
        )
    };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// The interface's flags (SIOCGIFFLAGS), to warn when it is down.
fn if_flags(name: &str) -> io::Result<libc::c_short> {
    // SAFETY: plain socket() call; OwnedFd closes it.
    let s = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if s < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `s` is a fresh fd we own.
    let sock = unsafe { OwnedFd::from_raw_fd(s) };
    // SAFETY: an all-zero ifreq is valid.
    let mut req: libc::ifreq = unsafe { mem::zeroed() };
    for (d, b) in req.ifr_name.iter_mut().zip(name.bytes()) {
        *d = b as libc::c_char;
    }
    // SAFETY: SIOCGIFFLAGS reads and writes an ifreq.
    if unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCGIFFLAGS, &mut req) } < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: SIOCGIFFLAGS filled the flags member of the union.
    Ok(unsafe { req.ifr_ifru.ifru_flags })
}

impl PacketSocket {
    /// Opens `queues` sockets on the existing interface `name`.
    pub fn open(name: &str, queues: usize, bypass: bool) -> Result<PacketSocket, PacketError> {
        Self::open_with(name, queues, bypass, false)
    }

    /// `legacy`: use the 10-byte header even where the kernel offers 12 (for tests).
    fn open_with(
        name: &str,
        queues: usize,
        bypass: bool,
        legacy: bool,
    ) -> Result<PacketSocket, PacketError> {
        if name.is_empty() || name.len() >= libc::IFNAMSIZ || name.contains('\0') {
            return Err(PacketError::BadName(name.to_string()));
        }
        let c = CString::new(name).map_err(|_| PacketError::BadName(name.to_string()))?;
        // SAFETY: c is a valid NUL-terminated string.
        let ifindex = unsafe { libc::if_nametoindex(c.as_ptr()) } as i32;
        if ifindex == 0 {
            return Err(PacketError::NoSuchInterface(name.to_string()));
        }
        let queues = queues.max(1);
        let mut s = PacketSocket {
            name: name.to_string(),
            ifindex,
            hdr_len: HDR_LEN,
            socks: Vec::with_capacity(queues),
        };
        // A fanout group id unique to this process and interface.
        let group = (std::process::id() ^ (ifindex as u32).rotate_left(8)) & 0xffff;
        for _ in 0..queues {
            let fd = s.open_one(bypass, (queues > 1).then_some(group), legacy)?;
            s.socks.push(fd);
        }
        match if_flags(name) {
            Ok(f) if f & libc::IFF_UP as libc::c_short == 0 => {
                warn!(dev = name, "interface is down: frames sent to it are dropped until `ip link set {name} up`")
            }
            Ok(_) => {}
            Err(e) => debug!(dev = name, "SIOCGIFFLAGS: {e}"),
        }
        Ok(s)
    }

    fn err(&self, what: &'static str, err: io::Error) -> PacketError {
        let hint = if matches!(err.raw_os_error(), Some(libc::EPERM) | Some(libc::EACCES)) {
            " (are you root?)"
        } else {
            ""
        };
        PacketError::Setup {
            name: self.name.clone(),
            what,
            err,
            hint,
        }
    }

    fn open_one(
        &mut self,
        bypass: bool,
        fanout: Option<u32>,
        legacy: bool,
    ) -> Result<OwnedFd, PacketError> {
        // Protocol 0: nothing is queued to the socket before it is bound below.
        // SAFETY: plain socket() call; OwnedFd closes it.
        let raw = unsafe {
            libc::socket(
                libc::AF_PACKET,
                libc::SOCK_RAW | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
                0,
            )
        };
        if raw < 0 {
            return Err(PacketError::Socket(io::Error::last_os_error()));
        }
        // SAFETY: `raw` is a fresh fd we own.
        let sock = unsafe { OwnedFd::from_raw_fd(raw) };
        let fd = sock.as_raw_fd();

        // The 12-byte header where the kernel can (6.2+), else the legacy 10 bytes.
        let want = HDR_LEN as libc::c_int;
        let sz = if legacy {
            Err(io::Error::from_raw_os_error(libc::ENOPROTOOPT))
        } else {
            setsockopt(fd, SOL_PACKET, PACKET_VNET_HDR_SZ, &want)
        };
        match sz {
            Ok(()) => self.hdr_len = HDR_LEN,
            Err(e) if e.raw_os_error() == Some(libc::ENOPROTOOPT) => {
                setsockopt(fd, SOL_PACKET, PACKET_VNET_HDR, &(1 as libc::c_int))
                    .map_err(|e| self.err("PACKET_VNET_HDR", e))?;
                if self.hdr_len != LEGACY_HDR_LEN {
                    debug!(dev = %self.name, "no PACKET_VNET_HDR_SZ: using the 10-byte virtio_net_hdr");
                }
                self.hdr_len = LEGACY_HDR_LEN;
            }
            Err(e) => return Err(self.err("PACKET_VNET_HDR_SZ", e)),
        }
        // Skip our own (and the host's) outgoing frames in the kernel (4.20+); `recv`
        // checks sll_pkttype as well.
        if let Err(e) = setsockopt(fd, SOL_PACKET, PACKET_IGNORE_OUTGOING, &(1 as libc::c_int)) {
            debug!(dev = %self.name, "PACKET_IGNORE_OUTGOING: {e}");
        }
        // VLAN tags the kernel takes off on receive come back through PACKET_AUXDATA.
        setsockopt(fd, SOL_PACKET, PACKET_AUXDATA, &(1 as libc::c_int))
            .map_err(|e| self.err("PACKET_AUXDATA", e))?;
        if bypass {
            setsockopt(fd, SOL_PACKET, PACKET_QDISC_BYPASS, &(1 as libc::c_int))
                .map_err(|e| self.err("PACKET_QDISC_BYPASS", e))?;
        }
        for (force, plain) in [
            (libc::SO_SNDBUFFORCE, libc::SO_SNDBUF),
            (libc::SO_RCVBUFFORCE, libc::SO_RCVBUF),
        ] {
            if setsockopt(fd, libc::SOL_SOCKET, force, &SOCK_BUF).is_err() {
                let _ = setsockopt(fd, libc::SOL_SOCKET, plain, &SOCK_BUF);
            }
        }

        // SAFETY: an all-zero sockaddr_ll is valid.
        let mut sll: libc::sockaddr_ll = unsafe { mem::zeroed() };
        sll.sll_family = libc::AF_PACKET as libc::c_ushort;
        sll.sll_protocol = ETH_P_ALL.to_be();
        sll.sll_ifindex = self.ifindex;
        // SAFETY: binds to a sockaddr_ll of the size we pass.
        let r = unsafe {
            libc::bind(
                fd,
                &sll as *const libc::sockaddr_ll as *const libc::sockaddr,
                mem::size_of::<libc::sockaddr_ll>() as libc::socklen_t,
            )
        };
        if r < 0 {
            return Err(self.err("bind", io::Error::last_os_error()));
        }

        let mreq = PacketMreq {
            mr_ifindex: self.ifindex,
            mr_type: PACKET_MR_PROMISC,
            mr_alen: 0,
            mr_address: [0; 8],
        };
        setsockopt(fd, SOL_PACKET, PACKET_ADD_MEMBERSHIP, &mreq)
            .map_err(|e| self.err("PACKET_ADD_MEMBERSHIP (promiscuous)", e))?;

        if let Some(group) = fanout {
            // Joining a fanout group needs a bound socket.
            let arg = (group | (PACKET_FANOUT_HASH << 16)) as libc::c_int;
            setsockopt(fd, SOL_PACKET, PACKET_FANOUT, &arg)
                .map_err(|e| self.err("PACKET_FANOUT", e))?;
        }
        Ok(sock)
    }

    fn sock(&self, queue: usize) -> RawFd {
        self.socks[queue % self.socks.len()].as_raw_fd()
    }
}

impl UplinkDevice for PacketSocket {
    fn name(&self) -> String {
        format!("dev={}", self.name)
    }

    fn thread_prefix(&self) -> &'static str {
        "pkt"
    }

    fn queues(&self) -> usize {
        self.socks.len()
    }

    fn fd(&self, queue: usize) -> RawFd {
        self.sock(queue)
    }

    fn hdr_len(&self) -> usize {
        self.hdr_len
    }

    /// The kernel hands an AF_PACKET socket VLAN frames with the tag taken off (it
    /// is in PACKET_AUXDATA). The frame is read with a 4-byte gap after the MAC
    /// addresses; the tag goes back into the gap, or, untagged, the addresses (and the
    /// header before them) move up over it.
    fn recv(&self, queue: usize, buf: &mut [u8]) -> io::Result<Option<Range<usize>>> {
        let head = self.hdr_len + 12;
        if buf.len() < 2 * TAG + head {
            return Err(io::Error::from_raw_os_error(libc::EINVAL));
        }
        let (front, rest) = buf.split_at_mut(TAG + head + TAG);
        let mut iov = [
            libc::iovec {
                iov_base: front[TAG..].as_mut_ptr().cast(),
                iov_len: head,
            },
            libc::iovec {
                iov_base: rest.as_mut_ptr().cast(),
                iov_len: rest.len(),
            },
        ];
        let mut cbuf = [0u64; 8]; // room for one tpacket_auxdata message
                                  // SAFETY: all-zero sockaddr_ll and msghdr are valid.
        let mut sll: libc::sockaddr_ll = unsafe { mem::zeroed() };
        // SAFETY: as above.
        let mut msg: libc::msghdr = unsafe { mem::zeroed() };
        msg.msg_name = &mut sll as *mut libc::sockaddr_ll as *mut libc::c_void;
        msg.msg_namelen = mem::size_of::<libc::sockaddr_ll>() as libc::socklen_t;
        msg.msg_iov = iov.as_mut_ptr();
        msg.msg_iovlen = 2;
        msg.msg_control = cbuf.as_mut_ptr().cast();
        msg.msg_controllen = mem::size_of_val(&cbuf);
        // SAFETY: msg points at live buffers of the lengths given.
        let n = unsafe { libc::recvmsg(self.sock(queue), &mut msg, libc::MSG_DONTWAIT) };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        let n = n as usize;
        if sll.sll_pkttype == PACKET_OUTGOING {
            return Ok(None);
        }
        if msg.msg_flags & libc::MSG_TRUNC != 0 {
            // Larger than 64 KiB (BIG TCP GRO, jumbo GSO): we cannot carry it.
            return Err(io::Error::from_raw_os_error(libc::EMSGSIZE));
        }
        let vlan = aux_vlan(&msg);
        match vlan {
            Some((tpid, tci)) if n >= head => {
                buf[TAG + head..TAG + head + 2].copy_from_slice(&tpid.to_be_bytes());
                buf[TAG + head + 2..TAG + head + 4].copy_from_slice(&tci.to_be_bytes());
                shift_csum(&mut buf[TAG..TAG + self.hdr_len]);
                Ok(Some(TAG..TAG + n + TAG))
            }
            _ => {
                buf.copy_within(TAG..TAG + head, 2 * TAG);
                Ok(Some(2 * TAG..2 * TAG + n))
            }
        }
    }

    fn send(&self, queue: usize, iov: &[&[u8]]) -> io::Result<usize> {
        // A bound packet socket sends to its interface without an address.
        writev(self.sock(queue), iov)
    }

    fn set_offload(&self, caps: Caps) -> Result<Caps, String> {
        // There is no TUNSETOFFLOAD for a packet socket: the kernel hands us frames as
        // the device (and GRO) built them, and `deliver` segments or completes the
        // checksum for guests that cannot take them.
        debug!(dev = %self.name, ?caps, "guests' offloads noted (not programmable on AF_PACKET)");
        Ok(caps)
    }
}

/// The VLAN tag (TPID, TCI) PACKET_AUXDATA reports for a received frame, if any.
fn aux_vlan(msg: &libc::msghdr) -> Option<(u16, u16)> {
    // SAFETY: walking the control messages the kernel wrote into msg's buffer.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(msg);
        while !c.is_null() {
            if (*c).cmsg_level == SOL_PACKET && (*c).cmsg_type == PACKET_AUXDATA {
                let aux =
                    std::ptr::read_unaligned(libc::CMSG_DATA(c) as *const libc::tpacket_auxdata);
                if aux.tp_status & TP_STATUS_VLAN_VALID == 0 {
                    return None;
                }
                let tpid = if aux.tp_status & TP_STATUS_VLAN_TPID_VALID != 0 {
                    aux.tp_vlan_tpid
                } else {
                    0x8100
                };
                return Some((tpid, aux.tp_vlan_tci));
            }
            c = libc::CMSG_NXTHDR(msg, c);
        }
    }
    None
}

/// A tag put back in front of the L3 header moves the checksum start by 4 (and a
/// header-length hint with it). `vnet` is the 10- or 12-byte virtio_net_hdr.
fn shift_csum(vnet: &mut [u8]) {
    let le = |b: &[u8], i: usize| u16::from_le_bytes([b[i], b[i + 1]]);
    let hdr_len = le(vnet, 2);
    if hdr_len != 0 {
        vnet[2..4].copy_from_slice(&hdr_len.saturating_add(TAG as u16).to_le_bytes());
    }
    if vnet[0] & crate::vnet_hdr::F_NEEDS_CSUM != 0 {
        let start = le(vnet, 6).saturating_add(TAG as u16);
        vnet[6..8].copy_from_slice(&start.to_le_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn put_back_tag_moves_csum_start_and_hdr_len() {
        let mut h = crate::vnet_hdr::VirtioNetHdr {
            flags: crate::vnet_hdr::F_NEEDS_CSUM,
            hdr_len: 54,
            csum_start: 34,
            csum_offset: 16,
            ..Default::default()
        }
        .to_bytes();
        shift_csum(&mut h);
        let got = crate::vnet_hdr::VirtioNetHdr::from_bytes(&h).unwrap();
        assert_eq!((got.csum_start, got.hdr_len, got.csum_offset), (38, 58, 16));
        // Without NEEDS_CSUM or a length hint, nothing moves.
        let mut plain = crate::vnet_hdr::VirtioNetHdr::default().to_bytes();
        shift_csum(&mut plain);
        assert_eq!(plain, crate::vnet_hdr::VirtioNetHdr::default().to_bytes());
    }

    #[test]
    fn bad_and_missing_names() {
        assert!(matches!(
            PacketSocket::open("", 1, false),
            Err(PacketError::BadName(_))
        ));
        assert!(matches!(
            PacketSocket::open("a-name-that-is-far-too-long", 1, false),
            Err(PacketError::BadName(_))
        ));
        assert!(matches!(
            PacketSocket::open("gsonet-none0", 1, false),
            Err(PacketError::NoSuchInterface(_))
        ));
    }

    #[test]
    fn opens_loopback_with_a_vnet_header() {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("skipped: needs root");
            return;
        }
        let s = PacketSocket::open("lo", 2, true).unwrap();
        assert_eq!(s.queues(), 2);
        assert!(s.hdr_len() == HDR_LEN || s.hdr_len() == LEGACY_HDR_LEN);
        assert_eq!(s.name(), "dev=lo");
    }

    /// A frame through lo between a 10-byte-header socket and a 12-byte one, both ways:
    /// the frame bytes must come out where they went in.
    #[test]
    fn legacy_and_12_byte_headers_interoperate() {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("skipped: needs root");
            return;
        }
        let legacy = PacketSocket::open_with("lo", 1, false, true).unwrap();
        let modern = PacketSocket::open("lo", 1, false).unwrap();
        assert_eq!(legacy.hdr_len(), LEGACY_HDR_LEN);
        if modern.hdr_len() != HDR_LEN {
            eprintln!("kernel without PACKET_VNET_HDR_SZ: only the legacy header");
        }
        let zero = [0u8; HDR_LEN];
        for (tag, from, to) in [(1u8, &legacy, &modern), (2u8, &modern, &legacy)] {
            // Local experimental ethertype 0x88b5, a marker byte and a pid to match on.
            let mut frame = vec![0u8; 200];
            frame[12..14].copy_from_slice(&[0x88, 0xb5]);
            frame[14] = tag;
            frame[15..19].copy_from_slice(&std::process::id().to_be_bytes());
            for (i, b) in frame[19..].iter_mut().enumerate() {
                *b = i as u8;
            }
            from.send(0, &[&zero[..from.hdr_len()], &frame]).unwrap();
            let mut buf = vec![0u8; 70_000];
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
            let got = loop {
                assert!(
                    std::time::Instant::now() < deadline,
                    "frame {tag} not received"
                );
                match to.recv(0, &mut buf) {
                    Ok(Some(at)) => {
                        let f = &buf[at.start + to.hdr_len()..at.end];
                        if f.len() >= 19 && f[12..15] == frame[12..15] && f[15..19] == frame[15..19]
                        {
                            break f.to_vec();
                        }
                    }
                    Ok(None) => {}
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                        std::thread::sleep(std::time::Duration::from_millis(5))
                    }
                    Err(e) => panic!("recv: {e}"),
                }
            };
            assert_eq!(got, frame, "frame {tag}");
        }
    }
}

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

use std::io::{self, IoSliceMut};
use std::ops::Range;
use std::os::fd::{AsFd, BorrowedFd};

use thiserror::Error;
use tracing::{debug, warn};

use super::UplinkDevice;
use crate::features::Caps;
use crate::sys::netdev::{self, IfFlags};
use crate::sys::packet::Socket;
use crate::vnet_hdr::{HDR_LEN, LEGACY_HDR_LEN};

/// Room kept in front of a received frame to put back a VLAN tag the kernel took off.
const TAG: usize = 4;
/// Socket buffers: a few 64 KiB frames in flight are not enough.
const SOCK_BUF: usize = 4 << 20;

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

/// AF_PACKET sockets on one interface: one per queue.
pub struct PacketSocket {
    name: String,
    ifindex: i32,
    hdr_len: usize,
    socks: Vec<Socket>,
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
        if !netdev::valid_name(name) {
            return Err(PacketError::BadName(name.to_string()));
        }
        let ifindex =
            netdev::index(name).map_err(|_| PacketError::NoSuchInterface(name.to_string()))?;
        let queues = queues.max(1);
        let mut s = PacketSocket {
            name: name.to_string(),
            ifindex,
            hdr_len: HDR_LEN,
            socks: Vec::with_capacity(queues),
        };
        // A fanout group id unique to this process and interface.
        let group = (std::process::id() ^ (ifindex as u32).rotate_left(8)) as u16;
        for _ in 0..queues {
            let sock = s.open_one(bypass, (queues > 1).then_some(group), legacy)?;
            s.socks.push(sock);
        }
        match netdev::flags(name) {
            Ok(f) if !f.contains(IfFlags::UP) => {
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
        fanout: Option<u16>,
        legacy: bool,
    ) -> Result<Socket, PacketError> {
        // Protocol 0: nothing is queued to the socket before it is bound below.
        let sock = Socket::open(true).map_err(PacketError::Socket)?;

        // The 12-byte header where the kernel can (6.2+), else the legacy 10 bytes.
        let sz = if legacy {
            Err(io::Error::from_raw_os_error(libc::ENOPROTOOPT))
        } else {
            sock.set_vnet_hdr_len(HDR_LEN)
        };
        match sz {
            Ok(()) => self.hdr_len = HDR_LEN,
            Err(e) if e.raw_os_error() == Some(libc::ENOPROTOOPT) => {
                sock.enable_vnet_hdr()
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
        if let Err(e) = sock.ignore_outgoing() {
            debug!(dev = %self.name, "PACKET_IGNORE_OUTGOING: {e}");
        }
        // VLAN tags the kernel takes off on receive come back through PACKET_AUXDATA.
        sock.enable_auxdata()
            .map_err(|e| self.err("PACKET_AUXDATA", e))?;
        if bypass {
            sock.bypass_qdisc()
                .map_err(|e| self.err("PACKET_QDISC_BYPASS", e))?;
        }
        let _ = sock.set_send_buffer(SOCK_BUF);
        let _ = sock.set_recv_buffer(SOCK_BUF);

        sock.bind(self.ifindex).map_err(|e| self.err("bind", e))?;
        sock.add_promisc_membership(self.ifindex)
            .map_err(|e| self.err("PACKET_ADD_MEMBERSHIP (promiscuous)", e))?;
        if let Some(group) = fanout {
            // Joining a fanout group needs a bound socket.
            sock.join_fanout_hash(group)
                .map_err(|e| self.err("PACKET_FANOUT", e))?;
        }
        Ok(sock)
    }

    fn sock(&self, queue: usize) -> &Socket {
        &self.socks[queue % self.socks.len()]
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

    fn fd(&self, queue: usize) -> BorrowedFd<'_> {
        self.sock(queue).as_fd()
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
            IoSliceMut::new(&mut front[TAG..TAG + head]),
            IoSliceMut::new(rest),
        ];
        let got = self.sock(queue).recv(&mut iov)?;
        if got.outgoing() {
            return Ok(None);
        }
        if got.truncated {
            // Larger than 64 KiB (BIG TCP GRO, jumbo GSO): we cannot carry it.
            return Err(io::Error::from_raw_os_error(libc::EMSGSIZE));
        }
        let n = got.len;
        match got.vlan {
            Some(vlan) if n >= head => {
                buf[TAG + head..TAG + head + 2].copy_from_slice(&vlan.tpid.to_be_bytes());
                buf[TAG + head + 2..TAG + head + 4].copy_from_slice(&vlan.tci.to_be_bytes());
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
        self.sock(queue).send(iov)
    }

    fn set_offload(&self, caps: Caps) -> Result<Caps, String> {
        // There is no TUNSETOFFLOAD for a packet socket: the kernel hands us frames as
        // the device (and GRO) built them, and `deliver` segments or completes the
        // checksum for guests that cannot take them.
        debug!(dev = %self.name, ?caps, "guests' offloads noted (not programmable on AF_PACKET)");
        Ok(caps)
    }
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
        if !crate::testkit::can_run(crate::sys::is_root(), "root") {
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
        if !crate::testkit::can_run(crate::sys::is_root(), "root") {
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

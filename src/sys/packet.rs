//! AF_PACKET sockets: open, bind to one interface for every protocol, the SOL_PACKET
//! options gsonet uses, and a recvmsg that returns the VLAN tag from PACKET_AUXDATA.

use std::io::{self, IoSliceMut};
use std::mem;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

use super::{check, check_len, io as sysio};

/// The TPID the kernel means when PACKET_AUXDATA has a tag but no TPID.
const TPID_8021Q: u16 = 0x8100;

/// An AF_PACKET SOCK_RAW socket; closed on drop.
#[derive(Debug)]
pub struct Socket(OwnedFd);

/// A VLAN tag the kernel took off a received frame (reported in PACKET_AUXDATA).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Vlan {
    pub tpid: u16,
    pub tci: u16,
}

/// What one `recv` read.
#[derive(Clone, Copy, Debug)]
pub struct Received {
    /// Bytes written into the buffers.
    pub len: usize,
    /// The frame was longer than the buffers; the rest is lost.
    pub truncated: bool,
    /// sll_pkttype: PACKET_HOST, PACKET_OTHERHOST, ..., PACKET_OUTGOING.
    pub pkttype: u8,
    /// The VLAN tag taken off the frame, when PACKET_AUXDATA is on and it had one.
    pub vlan: Option<Vlan>,
}

impl Received {
    /// A frame sent on the interface (by us or the host), not one it received.
    pub fn outgoing(&self) -> bool {
        self.pkttype == libc::PACKET_OUTGOING
    }
}

impl Socket {
    /// A new SOCK_RAW socket with protocol 0: nothing is queued to it before `bind`.
    pub fn open(nonblocking: bool) -> io::Result<Socket> {
        let mut ty = libc::SOCK_RAW | libc::SOCK_CLOEXEC;
        if nonblocking {
            ty |= libc::SOCK_NONBLOCK;
        }
        // SAFETY: socket() takes no pointers; a non-negative result is a fresh fd.
        let fd = check(unsafe { libc::socket(libc::AF_PACKET, ty, 0) })?;
        // SAFETY: `fd` was just returned by socket() and nothing else owns it.
        Ok(Socket(unsafe { OwnedFd::from_raw_fd(fd) }))
    }

    fn setsockopt<T: Copy>(&self, level: libc::c_int, opt: libc::c_int, val: &T) -> io::Result<()> {
        let len = mem::size_of::<T>() as libc::socklen_t;
        // SAFETY: `val` points at a live, initialised value of exactly `len` bytes,
        // which the kernel only reads.
        check(unsafe {
            libc::setsockopt(
                self.0.as_raw_fd(),
                level,
                opt,
                (val as *const T).cast(),
                len,
            )
        })?;
        Ok(())
    }

    fn enable(&self, opt: libc::c_int) -> io::Result<()> {
        self.setsockopt(libc::SOL_PACKET, opt, &(1 as libc::c_int))
    }

    /// PACKET_VNET_HDR_SZ (Linux 6.2+): a virtio_net_hdr of `len` bytes (10 or 12)
    /// in front of every frame; ENOPROTOOPT on older kernels.
    pub fn set_vnet_hdr_len(&self, len: usize) -> io::Result<()> {
        let len =
            libc::c_int::try_from(len).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
        self.setsockopt(libc::SOL_PACKET, libc::PACKET_VNET_HDR_SZ, &len)
    }

    /// PACKET_VNET_HDR: the 10-byte legacy virtio_net_hdr in front of every frame.
    pub fn enable_vnet_hdr(&self) -> io::Result<()> {
        self.enable(libc::PACKET_VNET_HDR)
    }

    /// PACKET_IGNORE_OUTGOING (4.20+): frames sent on the interface are not read back.
    pub fn ignore_outgoing(&self) -> io::Result<()> {
        self.enable(libc::PACKET_IGNORE_OUTGOING)
    }

    /// PACKET_AUXDATA: `recv` learns the VLAN tag the kernel took off a frame.
    pub fn enable_auxdata(&self) -> io::Result<()> {
        self.enable(libc::PACKET_AUXDATA)
    }

    /// PACKET_QDISC_BYPASS: frames sent go straight to the driver queue.
    pub fn bypass_qdisc(&self) -> io::Result<()> {
        self.enable(libc::PACKET_QDISC_BYPASS)
    }

    /// The send buffer: SO_SNDBUFFORCE (may exceed wmem_max), else SO_SNDBUF.
    pub fn set_send_buffer(&self, bytes: usize) -> io::Result<()> {
        self.set_buffer(libc::SO_SNDBUFFORCE, libc::SO_SNDBUF, bytes)
    }

    /// The receive buffer: SO_RCVBUFFORCE (may exceed rmem_max), else SO_RCVBUF.
    pub fn set_recv_buffer(&self, bytes: usize) -> io::Result<()> {
        self.set_buffer(libc::SO_RCVBUFFORCE, libc::SO_RCVBUF, bytes)
    }

    fn set_buffer(&self, force: libc::c_int, plain: libc::c_int, bytes: usize) -> io::Result<()> {
        let v = libc::c_int::try_from(bytes).unwrap_or(libc::c_int::MAX);
        self.setsockopt(libc::SOL_SOCKET, force, &v)
            .or_else(|_| self.setsockopt(libc::SOL_SOCKET, plain, &v))
    }

    /// Binds to interface `ifindex` for every protocol (ETH_P_ALL); a bound socket
    /// sends to its interface without an address.
    pub fn bind(&self, ifindex: i32) -> io::Result<()> {
        let sll = libc::sockaddr_ll {
            sll_family: libc::AF_PACKET as libc::c_ushort,
            sll_protocol: (libc::ETH_P_ALL as u16).to_be(),
            sll_ifindex: ifindex,
            sll_hatype: 0,
            sll_pkttype: 0,
            sll_halen: 0,
            sll_addr: [0; 8],
        };
        let len = mem::size_of::<libc::sockaddr_ll>() as libc::socklen_t;
        // SAFETY: `sll` is a live sockaddr_ll of `len` bytes, which bind only reads.
        check(unsafe {
            libc::bind(
                self.0.as_raw_fd(),
                (&sll as *const libc::sockaddr_ll).cast(),
                len,
            )
        })?;
        Ok(())
    }

    /// PACKET_ADD_MEMBERSHIP with PACKET_MR_PROMISC: the interface passes frames for
    /// any MAC while this socket is open.
    pub fn add_promisc_membership(&self, ifindex: i32) -> io::Result<()> {
        let mreq = libc::packet_mreq {
            mr_ifindex: ifindex,
            mr_type: libc::PACKET_MR_PROMISC as libc::c_ushort,
            mr_alen: 0,
            mr_address: [0; 8],
        };
        self.setsockopt(libc::SOL_PACKET, libc::PACKET_ADD_MEMBERSHIP, &mreq)
    }

    /// PACKET_FANOUT with PACKET_FANOUT_HASH: joins fanout group `group`, so each
    /// received flow reaches one socket of the group. Needs a bound socket.
    pub fn join_fanout_hash(&self, group: u16) -> io::Result<()> {
        let arg = (u32::from(group) | (libc::PACKET_FANOUT_HASH << 16)) as libc::c_int;
        self.setsockopt(libc::SOL_PACKET, libc::PACKET_FANOUT, &arg)
    }

    /// Sends one frame, gathered from `iov`, with one writev.
    pub fn send(&self, iov: &[&[u8]]) -> io::Result<usize> {
        sysio::writev(self.as_fd(), iov)
    }

    /// Receives one frame into `iov` without blocking (WouldBlock when none is
    /// queued), with its packet type and the VLAN tag from PACKET_AUXDATA.
    pub fn recv(&self, iov: &mut [IoSliceMut<'_>]) -> io::Result<Received> {
        // SAFETY: sockaddr_ll is plain integers; all-zero is a valid value.
        let mut sll: libc::sockaddr_ll = unsafe { mem::zeroed() };
        // Room for one tpacket_auxdata message: CMSG_SPACE(20) is 40 bytes on 64-bit.
        let mut cbuf = [0u64; 8];
        // SAFETY: msghdr is plain C data (integers and nullable pointers); all-zero
        // is a valid, empty message.
        let mut msg: libc::msghdr = unsafe { mem::zeroed() };
        msg.msg_name = (&mut sll as *mut libc::sockaddr_ll).cast();
        msg.msg_namelen = mem::size_of::<libc::sockaddr_ll>() as libc::socklen_t;
        // IoSliceMut is ABI-compatible with struct iovec on Unix.
        msg.msg_iov = iov.as_mut_ptr().cast();
        msg.msg_iovlen = iov.len() as _;
        msg.msg_control = cbuf.as_mut_ptr().cast();
        msg.msg_controllen = mem::size_of_val(&cbuf) as _;
        // SAFETY: every pointer in `msg` (address, iovecs and the buffers they name,
        // control buffer) refers to memory exclusively borrowed here, of the lengths
        // given, and it all outlives the call.
        let n =
            check_len(unsafe { libc::recvmsg(self.0.as_raw_fd(), &mut msg, libc::MSG_DONTWAIT) })?;
        Ok(Received {
            len: n,
            truncated: msg.msg_flags & libc::MSG_TRUNC != 0,
            pkttype: sll.sll_pkttype,
            vlan: aux_vlan(&msg),
        })
    }
}

/// The VLAN tag PACKET_AUXDATA reports in the control messages of `msg`, if any.
fn aux_vlan(msg: &libc::msghdr) -> Option<Vlan> {
    // SAFETY: `msg` is the header recvmsg just filled: msg_control points at our
    // control buffer and msg_controllen is how much of it the kernel wrote.
    let mut c = unsafe { libc::CMSG_FIRSTHDR(msg) };
    while !c.is_null() {
        // SAFETY: a non-null cmsghdr from CMSG_FIRSTHDR/CMSG_NXTHDR lies wholly
        // inside the control data the kernel wrote; it may be unaligned.
        let h = unsafe { c.read_unaligned() };
        if h.cmsg_level == libc::SOL_PACKET && h.cmsg_type == libc::PACKET_AUXDATA {
            // SAFETY: a PACKET_AUXDATA message carries one tpacket_auxdata right
            // after its header, within the control data; it is read unaligned.
            let aux = unsafe {
                libc::CMSG_DATA(c)
                    .cast::<libc::tpacket_auxdata>()
                    .read_unaligned()
            };
            if aux.tp_status & libc::TP_STATUS_VLAN_VALID == 0 {
                return None;
            }
            let tpid = if aux.tp_status & libc::TP_STATUS_VLAN_TPID_VALID != 0 {
                aux.tp_vlan_tpid
            } else {
                TPID_8021Q
            };
            return Some(Vlan {
                tpid,
                tci: aux.tp_vlan_tci,
            });
        }
        // SAFETY: `c` is a valid control message header inside `msg`'s buffer;
        // CMSG_NXTHDR returns the next one or null at the end.
        c = unsafe { libc::CMSG_NXTHDR(msg, c) };
    }
    None
}

impl AsFd for Socket {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.0.as_fd()
    }
}

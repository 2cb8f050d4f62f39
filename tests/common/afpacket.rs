//! The host side of a tap in end-to-end tests: an AF_PACKET socket bound to the tap
//! (ETH_P_ALL), optionally with PACKET_VNET_HDR so GSO metadata is visible on what the
//! kernel received from gsonet and can be attached to what the test sends into it.
//!
//! Frames gsonet writes into the tap are *received* by the kernel on that interface
//! (`PACKET_HOST`/`PACKET_OTHERHOST`...); frames the test sends here go *out* of the
//! tap (to gsonet) and show up as `PACKET_OUTGOING` on other sockets.

#![allow(dead_code)]

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use gsonet::vnet_hdr::{GsoType, VirtioNetHdr};

const ETH_P_ALL: u16 = 0x0003;
const SOL_PACKET: libc::c_int = 263;
const PACKET_VNET_HDR: libc::c_int = 15;
pub const PACKET_OUTGOING: u8 = 4;
/// struct virtio_net_hdr as packet sockets use it (no num_buffers).
pub const PKT_VNET_LEN: usize = 10;

/// A frame seen on the tap.
#[derive(Clone, Debug)]
pub struct Seen {
    pub pkttype: u8,
    /// The packet socket's virtio_net_hdr, when PACKET_VNET_HDR is on.
    pub vnet: Option<VirtioNetHdr>,
    pub frame: Vec<u8>,
}

pub struct PacketSock {
    fd: OwnedFd,
    ifindex: i32,
    vnet: bool,
}

fn ifindex(name: &str) -> io::Result<i32> {
    let c = std::ffi::CString::new(name).map_err(io::Error::other)?;
    // SAFETY: valid NUL-terminated string.
    let i = unsafe { libc::if_nametoindex(c.as_ptr()) };
    if i == 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(i as i32)
    }
}

fn sockaddr(ifindex: i32) -> libc::sockaddr_ll {
    // SAFETY: all-zero is a valid sockaddr_ll.
    let mut a: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
    a.sll_family = libc::AF_PACKET as u16;
    a.sll_protocol = ETH_P_ALL.to_be();
    a.sll_ifindex = ifindex;
    a.sll_halen = 6;
    a
}

fn setsockopt_int(fd: i32, level: i32, name: i32, v: i32) -> io::Result<()> {
    // SAFETY: passes a pointer to a live int of the given size.
    let r = unsafe {
        libc::setsockopt(
            fd,
            level,
            name,
            &v as *const i32 as *const libc::c_void,
            std::mem::size_of::<i32>() as u32,
        )
    };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

impl PacketSock {
    /// Binds to interface `name`; `vnet`: exchange a 10-byte virtio_net_hdr with
    /// every frame (PACKET_VNET_HDR).
    pub fn bind(name: &str, vnet: bool) -> Result<PacketSock> {
        let idx = ifindex(name)?;
        // SAFETY: plain socket call.
        let fd = unsafe {
            libc::socket(
                libc::AF_PACKET,
                libc::SOCK_RAW | libc::SOCK_CLOEXEC,
                ETH_P_ALL.to_be() as i32,
            )
        };
        if fd < 0 {
            bail!("AF_PACKET socket: {}", io::Error::last_os_error());
        }
        // SAFETY: fresh fd we own.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let raw = fd.as_raw_fd();
        if vnet {
            setsockopt_int(raw, SOL_PACKET, PACKET_VNET_HDR, 1)?;
        }
        // Room for many 64 KiB frames (root may exceed rmem_max).
        let _ = setsockopt_int(raw, libc::SOL_SOCKET, libc::SO_RCVBUFFORCE, 32 << 20);
        let _ = setsockopt_int(raw, libc::SOL_SOCKET, libc::SO_SNDBUFFORCE, 4 << 20);
        let a = sockaddr(idx);
        // SAFETY: binds to a valid sockaddr_ll.
        let r = unsafe {
            libc::bind(
                raw,
                &a as *const libc::sockaddr_ll as *const libc::sockaddr,
                std::mem::size_of::<libc::sockaddr_ll>() as u32,
            )
        };
        if r < 0 {
            bail!("bind AF_PACKET to {name}: {}", io::Error::last_os_error());
        }
        Ok(PacketSock {
            fd,
            ifindex: idx,
            vnet,
        })
    }

    /// Sends `frame` out of the interface (towards gsonet). With PACKET_VNET_HDR,
    /// `hdr` describes it (GSO, partial checksum); otherwise it is ignored.
    pub fn send(&self, hdr: &VirtioNetHdr, frame: &[u8]) -> Result<()> {
        let mut buf = Vec::with_capacity(PKT_VNET_LEN + frame.len());
        if self.vnet {
            buf.extend_from_slice(&hdr.to_bytes()[..PKT_VNET_LEN]);
        }
        buf.extend_from_slice(frame);
        let a = sockaddr(self.ifindex);
        // SAFETY: sends from a live buffer to a valid address.
        let n = unsafe {
            libc::sendto(
                self.fd.as_raw_fd(),
                buf.as_ptr() as *const libc::c_void,
                buf.len(),
                0,
                &a as *const libc::sockaddr_ll as *const libc::sockaddr,
                std::mem::size_of::<libc::sockaddr_ll>() as u32,
            )
        };
        if n < 0 {
            bail!("AF_PACKET send: {}", io::Error::last_os_error());
        }
        if n as usize != buf.len() {
            bail!("AF_PACKET short send {n} of {}", buf.len());
        }
        Ok(())
    }

    /// Next frame within `timeout` (any direction), or None.
    pub fn recv(&self, timeout: Duration) -> Result<Option<Seen>> {
        let deadline = Instant::now() + timeout;
        let mut buf = vec![0u8; 70000 + PKT_VNET_LEN];
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let mut pfd = libc::pollfd {
                fd: self.fd.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one valid pollfd.
            let r = unsafe { libc::poll(&mut pfd, 1, left.as_millis() as i32) };
            if r < 0 {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                bail!("poll: {e}");
            }
            if r == 0 {
                return Ok(None);
            }
            // SAFETY: all-zero is a valid sockaddr_ll.
            let mut from: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
            let mut flen = std::mem::size_of::<libc::sockaddr_ll>() as u32;
            // SAFETY: receives into live buffers of the given sizes.
            let n = unsafe {
                libc::recvfrom(
                    self.fd.as_raw_fd(),
                    buf.as_mut_ptr() as *mut libc::c_void,
                    buf.len(),
                    libc::MSG_DONTWAIT | libc::MSG_TRUNC,
                    &mut from as *mut libc::sockaddr_ll as *mut libc::sockaddr,
                    &mut flen,
                )
            };
            if n < 0 {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::WouldBlock {
                    continue;
                }
                bail!("recvfrom: {e}");
            }
            let n = n as usize;
            if n > buf.len() {
                bail!("frame of {n} bytes truncated");
            }
            let (vnet, frame) = if self.vnet {
                if n < PKT_VNET_LEN {
                    bail!("{n} bytes: shorter than the vnet header");
                }
                let mut h = [0u8; 12];
                h[..PKT_VNET_LEN].copy_from_slice(&buf[..PKT_VNET_LEN]);
                let mut v = VirtioNetHdr::from_bytes(&h)?;
                v.num_buffers = 0;
                (Some(v), buf[PKT_VNET_LEN..n].to_vec())
            } else {
                (None, buf[..n].to_vec())
            };
            return Ok(Some(Seen {
                pkttype: from.sll_pkttype,
                vnet,
                frame,
            }));
        }
    }

    /// Frames that came *from gsonet* (not ones going out of the tap) for which
    /// `want` is true, until `done` says enough or `timeout` passes.
    pub fn collect(
        &self,
        timeout: Duration,
        mut want: impl FnMut(&Seen) -> bool,
        mut done: impl FnMut(&[Seen]) -> bool,
    ) -> Result<Vec<Seen>> {
        let deadline = Instant::now() + timeout;
        let mut out = Vec::new();
        while !done(&out) {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            match self.recv(left)? {
                Some(s) if s.pkttype != PACKET_OUTGOING && want(&s) => out.push(s),
                Some(_) => {}
                None => break,
            }
        }
        Ok(out)
    }
}

/// Whether a header from a packet socket asks for GSO.
pub fn is_gso(h: &Option<VirtioNetHdr>) -> bool {
    h.map(|h| h.gso != GsoType::NONE).unwrap_or(false)
}

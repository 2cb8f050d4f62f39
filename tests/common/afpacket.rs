//! The host side of a tap in end-to-end tests: an AF_PACKET socket bound to the tap
//! (ETH_P_ALL), optionally with PACKET_VNET_HDR so GSO metadata is visible on what the
//! kernel received from gsonet and can be attached to what the test sends into it.
//!
//! Frames gsonet writes into the tap are *received* by the kernel on that interface
//! (`PACKET_HOST`/`PACKET_OTHERHOST`...); frames the test sends here go *out* of the
//! tap (to gsonet) and show up as `PACKET_OUTGOING` on other sockets.

#![allow(dead_code)]

use std::io::{self, IoSliceMut};
use std::os::fd::AsFd;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use gsonet::sys::{io::poll_readable, netdev, packet::Socket};
use gsonet::vnet_hdr::{GsoType, VirtioNetHdr};

pub const PACKET_OUTGOING: u8 = libc::PACKET_OUTGOING;
/// struct virtio_net_hdr as packet sockets use it (no num_buffers).
pub const PKT_VNET_LEN: usize = 10;

/// A frame seen on the tap.
#[derive(Clone, Debug)]
pub struct Seen {
    pub pkttype: u8,
    /// The packet socket's virtio_net_hdr, when PACKET_VNET_HDR is on.
    pub vnet: Option<VirtioNetHdr>,
    pub frame: Vec<u8>,
    /// A VLAN tag the kernel took out of the frame (hardware-accelerated VLAN on
    /// receive), from PACKET_AUXDATA: (TPID, TCI).
    pub vlan: Option<(u16, u16)>,
}

impl Seen {
    /// The frame as it was on the wire: an accelerated tag put back after the MACs.
    pub fn wire(&self) -> Vec<u8> {
        match self.vlan {
            Some((tpid, tci)) if self.frame.len() >= 12 => {
                let mut f = self.frame[..12].to_vec();
                f.extend_from_slice(&tpid.to_be_bytes());
                f.extend_from_slice(&tci.to_be_bytes());
                f.extend_from_slice(&self.frame[12..]);
                f
            }
            _ => self.frame.clone(),
        }
    }
}

pub struct PacketSock {
    sock: Socket,
    vnet: bool,
}

impl PacketSock {
    /// Binds to interface `name`; `vnet`: exchange a 10-byte virtio_net_hdr with
    /// every frame (PACKET_VNET_HDR).
    pub fn bind(name: &str, vnet: bool) -> Result<PacketSock> {
        let idx = netdev::index(name)?;
        let sock = Socket::open(false).map_err(|e| anyhow::anyhow!("AF_PACKET socket: {e}"))?;
        if vnet {
            sock.enable_vnet_hdr()?;
        }
        sock.enable_auxdata()?;
        // Room for many 64 KiB frames (root may exceed rmem_max).
        let _ = sock.set_recv_buffer(32 << 20);
        let _ = sock.set_send_buffer(4 << 20);
        if let Err(e) = sock.bind(idx) {
            bail!("bind AF_PACKET to {name}: {e}");
        }
        Ok(PacketSock { sock, vnet })
    }

    /// Sends `frame` out of the interface (towards gsonet). With PACKET_VNET_HDR,
    /// `hdr` describes it (GSO, partial checksum); otherwise it is ignored.
    pub fn send(&self, hdr: &VirtioNetHdr, frame: &[u8]) -> Result<()> {
        let hb = super::wire_hdr::encode(hdr);
        let vnet: &[u8] = if self.vnet { &hb[..PKT_VNET_LEN] } else { &[] };
        let want = vnet.len() + frame.len();
        let n = match self.sock.send(&[vnet, frame]) {
            Ok(n) => n,
            Err(e) => bail!("AF_PACKET send: {e}"),
        };
        if n != want {
            bail!("AF_PACKET short send {n} of {want}");
        }
        Ok(())
    }

    /// Next frame within `timeout` (any direction), or None.
    pub fn recv(&self, timeout: Duration) -> Result<Option<Seen>> {
        let deadline = Instant::now() + timeout;
        let mut buf = vec![0u8; 70000 + PKT_VNET_LEN];
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match poll_readable(self.sock.as_fd(), left) {
                Ok(true) => {}
                Ok(false) => return Ok(None),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => bail!("poll: {e}"),
            }
            let got = match self.sock.recv(&mut [IoSliceMut::new(&mut buf)]) {
                Ok(got) => got,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(e) => bail!("recvfrom: {e}"),
            };
            if got.truncated {
                bail!("frame of more than {} bytes truncated", buf.len());
            }
            let n = got.len;
            let (vnet, frame) = if self.vnet {
                if n < PKT_VNET_LEN {
                    bail!("{n} bytes: shorter than the vnet header");
                }
                let mut h = [0u8; 12];
                h[..PKT_VNET_LEN].copy_from_slice(&buf[..PKT_VNET_LEN]);
                let mut v = super::wire_hdr::decode(&h)?;
                v.num_buffers = 0;
                (Some(v), buf[PKT_VNET_LEN..n].to_vec())
            } else {
                (None, buf[..n].to_vec())
            };
            return Ok(Some(Seen {
                pkttype: got.pkttype,
                vnet,
                frame,
                vlan: got.vlan.map(|v| (v.tpid, v.tci)),
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

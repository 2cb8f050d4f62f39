//! Tap uplink: /dev/net/tun with IFF_TAP|IFF_NO_PI|IFF_VNET_HDR|IFF_MULTI_QUEUE, a
//! 12-byte vnet header, and TUNSETOFFLOAD programmed from what the guests behind it
//! accept. Frames we write keep their GSO header: the kernel segments if it must.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::OpenOptionsExt;

use thiserror::Error;
use tracing::{debug, warn};

use super::{writev, UplinkDevice};
use crate::features::Caps;
use crate::vnet_hdr::HDR_LEN;

const TUNSETIFF: libc::c_ulong = 0x4004_54ca;
const TUNSETOFFLOAD: libc::c_ulong = 0x4004_54d0;
const TUNSETVNETHDRSZ: libc::c_ulong = 0x4004_54d8;
const IFF_TAP: libc::c_short = 0x0002;
const IFF_NO_PI: libc::c_short = 0x1000;
const IFF_VNET_HDR: libc::c_short = 0x4000;
const IFF_MULTI_QUEUE: libc::c_short = 0x0100;

const TUN_F_CSUM: u32 = 0x01;
const TUN_F_TSO4: u32 = 0x02;
const TUN_F_TSO6: u32 = 0x04;
const TUN_F_TSO_ECN: u32 = 0x08;
const TUN_F_UFO: u32 = 0x10;
const TUN_F_USO4: u32 = 0x20;
const TUN_F_USO6: u32 = 0x40;

#[derive(Debug, Error)]
pub enum TapError {
    #[error("tap name {0:?} is not a valid interface name (1-15 bytes)")]
    BadName(String),
    #[error("cannot open /dev/net/tun: {0} (gsonet needs root or CAP_NET_ADMIN for a tap uplink)")]
    Open(io::Error),
    #[error("cannot create tap {name}: {err} (is it in use by another program without multiqueue, or are you not root?)")]
    Create { name: String, err: io::Error },
    #[error("tap {name}: {what} failed: {err}")]
    Ioctl {
        name: String,
        what: &'static str,
        err: io::Error,
    },
}

#[repr(C)]
struct IfReq {
    name: [u8; libc::IFNAMSIZ],
    flags: libc::c_short,
    _pad: [u8; 22],
}

impl IfReq {
    fn new(name: &str) -> IfReq {
        let mut r = IfReq {
            name: [0; libc::IFNAMSIZ],
            flags: 0,
            _pad: [0; 22],
        };
        r.name[..name.len()].copy_from_slice(name.as_bytes());
        r
    }
}

/// A tap device: one fd per queue.
pub struct Tap {
    name: String,
    queues: Vec<File>,
}

fn tun_flags(c: Caps) -> u32 {
    let mut f = 0;
    if c.csum {
        f |= TUN_F_CSUM;
        if c.tso4 {
            f |= TUN_F_TSO4;
        }
        if c.tso6 {
            f |= TUN_F_TSO6;
        }
        if c.ecn && (c.tso4 || c.tso6) {
            f |= TUN_F_TSO_ECN;
        }
        if c.ufo {
            f |= TUN_F_UFO;
        }
        if c.uso4 {
            f |= TUN_F_USO4;
        }
        if c.uso6 {
            f |= TUN_F_USO6;
        }
    }
    f
}

impl Tap {
    /// Creates (or attaches to) tap `name` with `queues` queues and brings it up.
    pub fn open(name: &str, queues: usize) -> Result<Tap, TapError> {
        if name.is_empty() || name.len() >= libc::IFNAMSIZ || name.contains('\0') {
            return Err(TapError::BadName(name.to_string()));
        }
        let mut fds = Vec::new();
        for _ in 0..queues.max(1) {
            let f = OpenOptions::new()
                .read(true)
                .write(true)
                .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
                .open("/dev/net/tun")
                .map_err(TapError::Open)?;
            let mut req = IfReq::new(name);
            req.flags = IFF_TAP | IFF_NO_PI | IFF_VNET_HDR | IFF_MULTI_QUEUE;
            // SAFETY: TUNSETIFF reads and writes an ifreq, which `req` is.
            if unsafe { libc::ioctl(f.as_raw_fd(), TUNSETIFF, &mut req) } < 0 {
                return Err(TapError::Create {
                    name: name.into(),
                    err: io::Error::last_os_error(),
                });
            }
            let sz: libc::c_int = HDR_LEN as libc::c_int;
            // SAFETY: TUNSETVNETHDRSZ reads one int.
            if unsafe { libc::ioctl(f.as_raw_fd(), TUNSETVNETHDRSZ, &sz) } < 0 {
                return Err(TapError::Ioctl {
                    name: name.into(),
                    what: "TUNSETVNETHDRSZ",
                    err: io::Error::last_os_error(),
                });
            }
            fds.push(f);
        }
        let tap = Tap {
            name: name.to_string(),
            queues: fds,
        };
        tap.set_up()?;
        tap.set_offload(Caps::default())?;
        Ok(tap)
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn queues(&self) -> usize {
        self.queues.len()
    }

    pub fn fd(&self, queue: usize) -> RawFd {
        self.queues[queue % self.queues.len()].as_raw_fd()
    }

    fn set_up(&self) -> Result<(), TapError> {
        let err = |what, e| TapError::Ioctl {
            name: self.name.clone(),
            what,
            err: e,
        };
        // SAFETY: plain socket() call; the fd is closed by File's drop.
        let s = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
        if s < 0 {
            return Err(err("socket", io::Error::last_os_error()));
        }
        // SAFETY: `s` is a fresh fd we own.
        let sock = unsafe { <File as std::os::fd::FromRawFd>::from_raw_fd(s) };
        let mut req = IfReq::new(&self.name);
        // SAFETY: SIOCGIFFLAGS/SIOCSIFFLAGS read/write an ifreq.
        unsafe {
            if libc::ioctl(sock.as_raw_fd(), libc::SIOCGIFFLAGS, &mut req) < 0 {
                return Err(err("SIOCGIFFLAGS", io::Error::last_os_error()));
            }
            req.flags |= libc::IFF_UP as libc::c_short;
            if libc::ioctl(sock.as_raw_fd(), libc::SIOCSIFFLAGS, &req) < 0 {
                return Err(err("SIOCSIFFLAGS", io::Error::last_os_error()));
            }
        }
        Ok(())
    }

    /// Programs what the kernel may send us. Flags the kernel refuses (UFO on some
    /// kernels, USO on older ones) are dropped one at a time; returns what was applied.
    pub fn set_offload(&self, want: Caps) -> Result<Caps, TapError> {
        let mut caps = want;
        loop {
            let flags = tun_flags(caps);
            let mut ok = true;
            for q in &self.queues {
                // SAFETY: TUNSETOFFLOAD takes the flags by value.
                if unsafe { libc::ioctl(q.as_raw_fd(), TUNSETOFFLOAD, flags as libc::c_ulong) } < 0
                {
                    let e = io::Error::last_os_error();
                    if e.raw_os_error() != Some(libc::EINVAL) {
                        return Err(TapError::Ioctl {
                            name: self.name.clone(),
                            what: "TUNSETOFFLOAD",
                            err: e,
                        });
                    }
                    ok = false;
                    break;
                }
            }
            if ok {
                debug!(tap = %self.name, flags = format_args!("{flags:#x}"), "tap offloads set");
                return Ok(caps);
            }
            // Give up the most exotic offload first.
            let before = caps;
            if caps.ufo {
                caps.ufo = false;
            } else if caps.uso4 || caps.uso6 {
                caps.uso4 = false;
                caps.uso6 = false;
            } else if caps.ecn {
                caps.ecn = false;
            } else {
                caps = Caps::default();
            }
            warn!(tap = %self.name, ?before, ?caps, "kernel refused tap offloads, retrying with fewer");
            if before == caps {
                return Err(TapError::Ioctl {
                    name: self.name.clone(),
                    what: "TUNSETOFFLOAD",
                    err: io::Error::from_raw_os_error(libc::EINVAL),
                });
            }
        }
    }

    /// Writes one frame (vnet header first) with a single writev.
    pub fn write(&self, queue: usize, iov: &[&[u8]]) -> io::Result<usize> {
        writev(self.fd(queue), iov)
    }

    /// Reads one frame (vnet header first); WouldBlock when the queue is empty.
    pub fn read(&self, queue: usize, buf: &mut [u8]) -> io::Result<usize> {
        // SAFETY: reads into a live, writable buffer of the given length.
        let n = unsafe {
            libc::read(
                self.fd(queue),
                buf.as_mut_ptr() as *mut libc::c_void,
                buf.len(),
            )
        };
        if n < 0 {
            Err(io::Error::last_os_error())
        } else {
            Ok(n as usize)
        }
    }
}

impl UplinkDevice for Tap {
    fn name(&self) -> String {
        format!("tap={}", self.name)
    }

    fn thread_prefix(&self) -> &'static str {
        "tap"
    }

    fn queues(&self) -> usize {
        self.queues.len()
    }

    fn fd(&self, queue: usize) -> RawFd {
        Tap::fd(self, queue)
    }

    fn hdr_len(&self) -> usize {
        HDR_LEN
    }

    fn recv(&self, queue: usize, buf: &mut [u8]) -> io::Result<Option<std::ops::Range<usize>>> {
        self.read(queue, buf).map(|n| Some(0..n))
    }

    fn send(&self, queue: usize, iov: &[&[u8]]) -> io::Result<usize> {
        self.write(queue, iov)
    }

    fn set_offload(&self, caps: Caps) -> Result<Caps, String> {
        Tap::set_offload(self, caps).map_err(|e| e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_follow_caps() {
        assert_eq!(tun_flags(Caps::default()), 0);
        assert_eq!(tun_flags(Caps::ALL), 0x7f);
        // Without csum nothing else may be set.
        assert_eq!(
            tun_flags(Caps {
                csum: false,
                ..Caps::ALL
            }),
            0
        );
        let tso4 = Caps {
            csum: true,
            tso4: true,
            ..Caps::default()
        };
        assert_eq!(tun_flags(tso4), TUN_F_CSUM | TUN_F_TSO4);
    }

    #[test]
    fn bad_names_are_refused() {
        assert!(matches!(Tap::open("", 1), Err(TapError::BadName(_))));
        assert!(matches!(
            Tap::open("a-name-that-is-far-too-long", 1),
            Err(TapError::BadName(_))
        ));
    }
}

//! Tap uplink: /dev/net/tun with IFF_TAP|IFF_NO_PI|IFF_VNET_HDR|IFF_MULTI_QUEUE, a
//! 12-byte vnet header, and TUNSETOFFLOAD programmed from what the guests behind it
//! accept. Frames we write keep their GSO header: the kernel segments if it must.
//! The tap is persistent by default with a stable MAC, so it (and the host's addresses,
//! routes and bridge port on it) outlives a gsonet restart; a new gsonet reattaches.

use std::fs::File;
use std::io;
use std::os::fd::{AsFd, BorrowedFd};

use thiserror::Error;
use tracing::{debug, warn};

use super::UplinkDevice;
use crate::features::Caps;
use crate::l2::Mac;
use crate::sys::io as sysio;
use crate::sys::netdev::{self, IfFlags};
use crate::sys::tun::{self, Existing, Offload, TunFlags};
use crate::vnet_hdr::HDR_LEN;

#[derive(Debug, Error)]
pub enum TapError {
    #[error("tap name {0:?} is not a valid interface name (1-15 bytes)")]
    BadName(String),
    #[error("cannot open /dev/net/tun: {0} (gsonet needs root or CAP_NET_ADMIN for a tap uplink)")]
    Open(io::Error),
    #[error("cannot create tap {name}: {err} (is it in use by another program without multiqueue, or are you not root?)")]
    Create { name: String, err: io::Error },
    #[error(
        "interface {name} exists and is not a tap: choose another tap= name (gsonet \
         reattaches only to a tap it can use)"
    )]
    NotATap { name: String },
    #[error(
        "tap {name} exists without multi_queue (flags {flags:#x}): delete it (`ip link del \
         {name}`) or create it with `ip tuntap add {name} mode tap multi_queue vnet_hdr`"
    )]
    WrongFlags { name: String, flags: u32 },
    #[error("tap {name}: {what} failed: {err}")]
    Ioctl {
        name: String,
        what: &'static str,
        err: io::Error,
    },
}

/// A tap device: one fd per queue.
pub struct Tap {
    name: String,
    queues: Vec<File>,
    /// Whether it was there already (a persistent tap of an earlier gsonet or one the
    /// host made) and gsonet attached to it rather than creating it.
    reattached: bool,
}

/// How a tap uplink is set up besides its queues.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TapOptions {
    /// `mac=`: the tap's address; unset, a new tap gets `derived_mac(name)` and an
    /// existing one keeps its own.
    pub mac: Option<Mac>,
    /// `persist=` (default on): the tap outlives gsonet (TUNSETPERSIST); off, it goes
    /// away with the process, even a tap that was persistent before.
    pub persist: bool,
}

/// A stable MAC for tap `name`: locally administered, unicast, the same on every
/// start and every host (FNV-1a of the name), so neighbours' ARP entries stay right
/// across a restart.
pub fn derived_mac(name: &str) -> Mac {
    use std::hash::Hasher;
    let mut h = fnv::FnvHasher::default();
    h.write(name.as_bytes());
    let b = h.finish().to_be_bytes();
    Mac([(b[2] & 0xfc) | 0x02, b[3], b[4], b[5], b[6], b[7]])
}

fn tun_flags(c: Caps) -> Offload {
    let mut f = Offload::NONE;
    if c.csum {
        f |= Offload::CSUM;
        if c.tso4 {
            f |= Offload::TSO4;
        }
        if c.tso6 {
            f |= Offload::TSO6;
        }
        if c.ecn && (c.tso4 || c.tso6) {
            f |= Offload::TSO_ECN;
        }
        if c.ufo {
            f |= Offload::UFO;
        }
        if c.uso4 {
            f |= Offload::USO4;
        }
        if c.uso6 {
            f |= Offload::USO6;
        }
    }
    f
}

impl Tap {
    /// Creates tap `name`, or attaches to an existing tap of that name (its addresses,
    /// routes and bridge port untouched), with `queues` queues; sets its persistence
    /// and MAC as `opts` says and brings it up.
    pub fn open(name: &str, queues: usize, opts: TapOptions) -> Result<Tap, TapError> {
        if !netdev::valid_name(name) {
            return Err(TapError::BadName(name.to_string()));
        }
        let ioctl = |what, err| TapError::Ioctl {
            name: name.into(),
            what,
            err,
        };
        let reattached = match tun::existing(name).map_err(|e| ioctl("reading tun_flags", e))? {
            Existing::Nothing => false,
            Existing::Other => return Err(TapError::NotATap { name: name.into() }),
            Existing::Tun(f) if !f.is_tap() => return Err(TapError::NotATap { name: name.into() }),
            Existing::Tun(f) if !f.multi_queue() => {
                return Err(TapError::WrongFlags {
                    name: name.into(),
                    flags: f.0,
                })
            }
            Existing::Tun(_) => true,
        };
        let mut fds = Vec::new();
        for _ in 0..queues.max(1) {
            let f = tun::open().map_err(TapError::Open)?;
            tun::attach_tap_queue(&f, name).map_err(|err| TapError::Create {
                name: name.into(),
                err,
            })?;
            tun::set_vnet_hdr_len(&f, HDR_LEN).map_err(|err| TapError::Ioctl {
                name: name.into(),
                what: "TUNSETVNETHDRSZ",
                err,
            })?;
            fds.push(f);
        }
        let first = &fds[0];
        let flags = tun::attached_flags(first).map_err(|e| ioctl("TUNGETIFF", e))?;
        if !flags.contains(TunFlags::TAP_UPLINK) {
            return Err(TapError::WrongFlags {
                name: name.into(),
                flags: flags.0,
            });
        }
        if flags.persistent() != opts.persist {
            tun::set_persist(first, opts.persist).map_err(|e| ioctl("TUNSETPERSIST", e))?;
        }
        let tap = Tap {
            name: name.to_string(),
            queues: fds,
            reattached,
        };
        let want = match (opts.mac, reattached) {
            (Some(m), _) => Some(m),
            (None, false) => Some(derived_mac(name)),
            (None, true) => None,
        };
        if let Some(Mac(m)) = want {
            let have = netdev::hw_addr(name).map_err(|e| ioctl("SIOCGIFHWADDR", e))?;
            if have != m {
                netdev::set_hw_addr(name, m).map_err(|e| ioctl("SIOCSIFHWADDR", e))?;
            }
        }
        if opts.persist {
            // The carrier drops while no gsonet holds the tap. Without this the host
            // forgets the guests' addresses then, and its first ARP request after a
            // restart, sent before the guest is back, costs a 1 s retransmit.
            if let Err(e) = netdev::keep_neighbours_without_carrier(name) {
                warn!(
                    tap = name,
                    "cannot keep neighbour entries across restarts: {e}"
                );
            }
        }
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

    /// Whether it existed before and gsonet attached to it.
    pub fn reattached(&self) -> bool {
        self.reattached
    }

    pub fn fd(&self, queue: usize) -> BorrowedFd<'_> {
        self.queue(queue).as_fd()
    }

    fn queue(&self, queue: usize) -> &File {
        &self.queues[queue % self.queues.len()]
    }

    fn set_up(&self) -> Result<(), TapError> {
        let err = |what, e| TapError::Ioctl {
            name: self.name.clone(),
            what,
            err: e,
        };
        let flags = netdev::flags(&self.name).map_err(|e| err("SIOCGIFFLAGS", e))?;
        netdev::set_flags(&self.name, flags | IfFlags::UP).map_err(|e| err("SIOCSIFFLAGS", e))
    }

    /// Programs what the kernel may send us. Flags the kernel refuses (UFO on some
    /// kernels, USO on older ones) are dropped one at a time; returns what was applied.
    pub fn set_offload(&self, want: Caps) -> Result<Caps, TapError> {
        let mut caps = want;
        loop {
            let flags = tun_flags(caps);
            let mut ok = true;
            for q in &self.queues {
                if let Err(e) = tun::set_offload(q, flags) {
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
                debug!(tap = %self.name, flags = format_args!("{:#x}", flags.bits()), "tap offloads set");
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
        sysio::writev(self.fd(queue), iov)
    }

    /// Reads one frame (vnet header first); WouldBlock when the queue is empty.
    pub fn read(&self, queue: usize, buf: &mut [u8]) -> io::Result<usize> {
        sysio::read(self.fd(queue), buf)
    }
}

impl UplinkDevice for Tap {
    fn name(&self) -> String {
        format!("tap={}", self.name)
    }

    /// A removed uplink's tap is not kept: persistence is for restarts, not for an
    /// uplink the operator took away.
    fn release(&self) -> io::Result<()> {
        match self.queues.first() {
            Some(q) => tun::set_persist(q, false),
            None => Ok(()),
        }
    }

    fn thread_prefix(&self) -> &'static str {
        "tap"
    }

    fn queues(&self) -> usize {
        self.queues.len()
    }

    fn fd(&self, queue: usize) -> BorrowedFd<'_> {
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

    fn batchable(&self) -> bool {
        true
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
        assert_eq!(tun_flags(Caps::default()), Offload::NONE);
        assert_eq!(tun_flags(Caps::ALL).bits(), 0x7f);
        // Without csum nothing else may be set.
        assert_eq!(
            tun_flags(Caps {
                csum: false,
                ..Caps::ALL
            }),
            Offload::NONE
        );
        let tso4 = Caps {
            csum: true,
            tso4: true,
            ..Caps::default()
        };
        assert_eq!(tun_flags(tso4), Offload::CSUM | Offload::TSO4);
    }

    #[test]
    fn bad_names_are_refused() {
        let o = TapOptions::default();
        assert!(matches!(Tap::open("", 1, o), Err(TapError::BadName(_))));
        assert!(matches!(
            Tap::open("a-name-that-is-far-too-long", 1, o),
            Err(TapError::BadName(_))
        ));
    }

    #[test]
    fn derived_macs_are_stable_local_unicast() {
        let a = derived_mac("gsonet0");
        assert_eq!(a, derived_mac("gsonet0"));
        assert_ne!(a, derived_mac("gsonet1"));
        for n in ["a", "gsonet0", "tap-with-15-chr"] {
            let Mac(m) = derived_mac(n);
            assert_eq!(m[0] & 0x03, 0x02, "{n}: locally administered unicast");
        }
        // FNV-1a is fixed: the address of a name never changes between versions
        // (this value computed independently of the crate).
        assert_eq!(derived_mac("gsonet0").to_string(), "2a:40:a0:cb:73:81");
    }
}

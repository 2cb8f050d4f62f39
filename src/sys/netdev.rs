//! Network interfaces by name: validity, index (if_nametoindex), flags
//! (SIOCGIFFLAGS/SIOCSIFFLAGS through a short-lived AF_INET datagram socket) and the
//! per-interface neighbour sysctls.

use std::ffi::CString;
use std::io;
use std::mem;
use std::ops::BitOr;
use std::os::fd::{FromRawFd, OwnedFd};

use vmm_sys_util::ioctl::{ioctl_with_mut_ref, ioctl_with_ref};

use super::check;

/// Whether `name` fits an interface name: 1 to IFNAMSIZ-1 bytes, no NUL.
pub fn valid_name(name: &str) -> bool {
    !name.is_empty() && name.len() < libc::IFNAMSIZ && !name.contains('\0')
}

/// An `ifreq` naming `name`, everything else zero; InvalidInput for a bad name.
pub(super) fn ifreq(name: &str) -> io::Result<libc::ifreq> {
    if !valid_name(name) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("bad interface name {name:?}"),
        ));
    }
    // SAFETY: ifreq is plain C data (a name array and a union of integers and
    // addresses) for which all-zero bytes are a valid value.
    let mut req: libc::ifreq = unsafe { mem::zeroed() };
    for (d, b) in req.ifr_name.iter_mut().zip(name.bytes()) {
        *d = b as libc::c_char;
    }
    Ok(req)
}

/// The index of interface `name`; an error (ENODEV) when there is none.
pub fn index(name: &str) -> io::Result<i32> {
    let c = CString::new(name).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
    // SAFETY: `c` is a NUL-terminated string that outlives the call.
    let i = unsafe { libc::if_nametoindex(c.as_ptr()) };
    if i == 0 {
        return Err(io::Error::last_os_error());
    }
    i32::try_from(i).map_err(|_| io::Error::from_raw_os_error(libc::ERANGE))
}

/// Interface flags (IFF_UP and friends) as SIOCGIFFLAGS reports them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IfFlags(libc::c_short);

impl IfFlags {
    pub const UP: IfFlags = IfFlags(libc::IFF_UP as libc::c_short);
    /// Operationally up: a carrier (for a tap, a process holds it open).
    pub const RUNNING: IfFlags = IfFlags(libc::IFF_RUNNING as libc::c_short);

    pub fn contains(self, other: IfFlags) -> bool {
        self.0 & other.0 == other.0
    }
}

impl BitOr for IfFlags {
    type Output = IfFlags;
    fn bitor(self, rhs: IfFlags) -> IfFlags {
        IfFlags(self.0 | rhs.0)
    }
}

/// A datagram socket to address interface ioctls to; closed on drop.
fn control_socket() -> io::Result<OwnedFd> {
    // SAFETY: socket() takes no pointers; a non-negative result is a fresh fd.
    let fd =
        check(unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) })?;
    // SAFETY: `fd` was just returned by socket() and nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// The flags of interface `name` (SIOCGIFFLAGS).
pub fn flags(name: &str) -> io::Result<IfFlags> {
    let mut req = ifreq(name)?;
    let sock = control_socket()?;
    // SAFETY: SIOCGIFFLAGS reads the name from and writes the flags into an ifreq,
    // which `req` is, exclusively borrowed for the call.
    check(unsafe { ioctl_with_mut_ref(&sock, libc::SIOCGIFFLAGS, &mut req) })?;
    // SAFETY: SIOCGIFFLAGS succeeded, so it set the union's `ifru_flags` member; all
    // of its bit patterns are valid.
    Ok(IfFlags(unsafe { req.ifr_ifru.ifru_flags }))
}

/// Sets the flags of interface `name` (SIOCSIFFLAGS).
pub fn set_flags(name: &str, flags: IfFlags) -> io::Result<()> {
    let mut req = ifreq(name)?;
    req.ifr_ifru.ifru_flags = flags.0;
    let sock = control_socket()?;
    // SAFETY: SIOCSIFFLAGS only reads an ifreq, which `req` is.
    check(unsafe { ioctl_with_ref(&sock, libc::SIOCSIFFLAGS, &req) })?;
    Ok(())
}

/// The hardware address of interface `name` (SIOCGIFHWADDR).
pub fn hw_addr(name: &str) -> io::Result<[u8; 6]> {
    let mut req = ifreq(name)?;
    let sock = control_socket()?;
    // SAFETY: SIOCGIFHWADDR reads the name from and writes a sockaddr into an ifreq,
    // which `req` is, exclusively borrowed for the call.
    check(unsafe { ioctl_with_mut_ref(&sock, libc::SIOCGIFHWADDR, &mut req) })?;
    // SAFETY: SIOCGIFHWADDR succeeded, so it set the union's `ifru_hwaddr` member, a
    // plain sockaddr whose every bit pattern is valid.
    let sa = unsafe { req.ifr_ifru.ifru_hwaddr };
    let mut mac = [0u8; 6];
    for (m, b) in mac.iter_mut().zip(sa.sa_data.iter()) {
        *m = *b as u8;
    }
    Ok(mac)
}

/// Sets the hardware address of Ethernet interface `name` (SIOCSIFHWADDR).
pub fn set_hw_addr(name: &str, mac: [u8; 6]) -> io::Result<()> {
    let mut req = ifreq(name)?;
    // SAFETY: sockaddr is plain C data for which all-zero bytes are a valid value.
    let mut sa: libc::sockaddr = unsafe { mem::zeroed() };
    sa.sa_family = libc::ARPHRD_ETHER;
    for (d, b) in sa.sa_data.iter_mut().zip(mac) {
        *d = b as libc::c_char;
    }
    req.ifr_ifru.ifru_hwaddr = sa;
    let sock = control_socket()?;
    // SAFETY: SIOCSIFHWADDR only reads an ifreq, which `req` is.
    check(unsafe { ioctl_with_ref(&sock, libc::SIOCSIFHWADDR, &req) })?;
    Ok(())
}

/// Makes the host keep its ARP and NDP entries on `name` when the carrier drops
/// (`arp_evict_nocarrier`, `ndisc_evict_nocarrier`: Linux 5.16 and later; a kernel
/// without them, or without IPv6, is left as it is).
pub fn keep_neighbours_without_carrier(name: &str) -> io::Result<()> {
    if !valid_name(name) || name.contains('/') || name == "." || name == ".." {
        return Err(io::Error::from_raw_os_error(libc::EINVAL));
    }
    for knob in [
        format!("/proc/sys/net/ipv4/conf/{name}/arp_evict_nocarrier"),
        format!("/proc/sys/net/ipv6/conf/{name}/ndisc_evict_nocarrier"),
    ] {
        match std::fs::write(&knob, "0") {
            Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
            _ => {}
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_loopback() {
        assert!(valid_name("lo"));
        assert!(!valid_name(""));
        assert!(!valid_name("a-name-that-is-far-too-long"));
        assert!(!valid_name("a\0b"));
        assert_eq!(ifreq("").unwrap_err().kind(), io::ErrorKind::InvalidInput);
        assert!(index("lo").unwrap() > 0);
        assert!(index("gsonet-none0").is_err());
        assert!(flags("gsonet-none0").is_err());
        assert!(flags("lo").is_ok());
        assert!((IfFlags(0) | IfFlags::UP).contains(IfFlags::UP));
        assert_eq!(hw_addr("lo").unwrap(), [0; 6]);
        assert!(hw_addr("gsonet-none0").is_err());
    }
}

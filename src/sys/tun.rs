//! /dev/net/tun: open a queue of a multiqueue tap that puts a virtio_net_hdr in front
//! of every frame, set that header's size, and the offloads the kernel may hand us.

use std::fs::{File, OpenOptions};
use std::io;
use std::ops::{BitOr, BitOrAssign};
use std::os::unix::fs::OpenOptionsExt;

use vmm_sys_util::ioctl::{ioctl_with_mut_ref, ioctl_with_ref, ioctl_with_val};

use super::{check, netdev};

/// TUN_F_* offload flags for TUNSETOFFLOAD.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Offload(libc::c_uint);

impl Offload {
    pub const NONE: Offload = Offload(0);
    pub const CSUM: Offload = Offload(libc::TUN_F_CSUM);
    pub const TSO4: Offload = Offload(libc::TUN_F_TSO4);
    pub const TSO6: Offload = Offload(libc::TUN_F_TSO6);
    pub const TSO_ECN: Offload = Offload(libc::TUN_F_TSO_ECN);
    pub const UFO: Offload = Offload(libc::TUN_F_UFO);
    pub const USO4: Offload = Offload(libc::TUN_F_USO4);
    pub const USO6: Offload = Offload(libc::TUN_F_USO6);

    pub fn bits(self) -> u32 {
        self.0
    }
}

impl BitOr for Offload {
    type Output = Offload;
    fn bitor(self, rhs: Offload) -> Offload {
        Offload(self.0 | rhs.0)
    }
}

impl BitOrAssign for Offload {
    fn bitor_assign(&mut self, rhs: Offload) {
        self.0 |= rhs.0;
    }
}

/// Opens /dev/net/tun for reading and writing, non-blocking and close-on-exec; the
/// fd is not attached to any device yet.
pub fn open() -> io::Result<File> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open("/dev/net/tun")
}

/// TUNSETIFF: attaches `tun` as one more queue of tap `name` (created if missing),
/// with IFF_TAP | IFF_NO_PI | IFF_VNET_HDR | IFF_MULTI_QUEUE.
pub fn attach_tap_queue(tun: &File, name: &str) -> io::Result<()> {
    let mut req = netdev::ifreq(name)?;
    req.ifr_ifru.ifru_flags =
        (libc::IFF_TAP | libc::IFF_NO_PI | libc::IFF_VNET_HDR | libc::IFF_MULTI_QUEUE)
            as libc::c_short;
    // SAFETY: TUNSETIFF reads an ifreq and writes the final name back into it; `req`
    // is one, exclusively borrowed for the call.
    check(unsafe { ioctl_with_mut_ref(tun, libc::TUNSETIFF, &mut req) })?;
    Ok(())
}

/// TUNSETVNETHDRSZ: the size of the virtio_net_hdr in front of every frame.
pub fn set_vnet_hdr_len(tun: &File, len: usize) -> io::Result<()> {
    let len = libc::c_int::try_from(len).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
    // SAFETY: TUNSETVNETHDRSZ reads one int through the pointer; `len` is one.
    check(unsafe { ioctl_with_ref(tun, libc::TUNSETVNETHDRSZ, &len) })?;
    Ok(())
}

/// TUNSETOFFLOAD: what the kernel may send us (EINVAL for flags it does not know).
pub fn set_offload(tun: &File, flags: Offload) -> io::Result<()> {
    // SAFETY: TUNSETOFFLOAD takes its flags by value and touches no memory of ours.
    check(unsafe { ioctl_with_val(tun, libc::TUNSETOFFLOAD, libc::c_ulong::from(flags.0)) })?;
    Ok(())
}

/// TUNSETPERSIST: whether the device outlives the last fd attached to it (a
/// persistent tap keeps its addresses, routes and bridge port while no one holds it).
pub fn set_persist(tun: &File, persist: bool) -> io::Result<()> {
    // SAFETY: TUNSETPERSIST takes its flag by value and touches no memory of ours.
    check(unsafe { ioctl_with_val(tun, libc::TUNSETPERSIST, libc::c_ulong::from(persist)) })?;
    Ok(())
}

/// IFF_* flags of a tun/tap device as the kernel keeps them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TunFlags(pub u32);

impl TunFlags {
    /// What a tap uplink needs: a tap, no packet info, a vnet header, multiqueue.
    pub const TAP_UPLINK: TunFlags = TunFlags(
        (libc::IFF_TAP | libc::IFF_NO_PI | libc::IFF_VNET_HDR | libc::IFF_MULTI_QUEUE) as u32,
    );

    pub fn contains(self, other: TunFlags) -> bool {
        self.0 & other.0 == other.0
    }

    pub fn is_tap(self) -> bool {
        self.0 & libc::IFF_TAP as u32 != 0
    }

    pub fn multi_queue(self) -> bool {
        self.0 & libc::IFF_MULTI_QUEUE as u32 != 0
    }

    pub fn persistent(self) -> bool {
        self.0 & libc::IFF_PERSIST as u32 != 0
    }
}

/// TUNGETIFF: the flags of the device `tun` is attached to (IFF_PERSIST included).
pub fn attached_flags(tun: &File) -> io::Result<TunFlags> {
    // Any valid name: TUNGETIFF writes the attached device's over it.
    let mut req = netdev::ifreq("x")?;
    // SAFETY: TUNGETIFF writes the device's name and flags into an ifreq; `req` is
    // one, exclusively borrowed for the call.
    check(unsafe { ioctl_with_mut_ref(tun, libc::TUNGETIFF, &mut req) })?;
    // SAFETY: TUNGETIFF succeeded, so it set the union's `ifru_flags` member; all of
    // its bit patterns are valid.
    let f = unsafe { req.ifr_ifru.ifru_flags };
    Ok(TunFlags(u32::from(f as u16)))
}

/// What already goes by an interface name, before gsonet attaches to it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Existing {
    Nothing,
    /// A tun or tap device with these flags (`tun_flags` in sysfs).
    Tun(TunFlags),
    /// Some other kind of interface (a NIC, a bridge, a veth).
    Other,
}

/// Whether an interface `name` exists and whether it is a tun/tap device (only those
/// have `/sys/class/net/NAME/tun_flags`).
pub fn existing(name: &str) -> io::Result<Existing> {
    if !netdev::valid_name(name) || name.contains('/') || name == "." || name == ".." {
        return Err(io::Error::from_raw_os_error(libc::EINVAL));
    }
    if netdev::index(name).is_err() {
        return Ok(Existing::Nothing);
    }
    match std::fs::read_to_string(format!("/sys/class/net/{name}/tun_flags")) {
        Ok(s) => {
            let s = s.trim();
            let hex = s.strip_prefix("0x").unwrap_or(s);
            u32::from_str_radix(hex, 16)
                .map(|f| Existing::Tun(TunFlags(f)))
                .map_err(|_| io::Error::other(format!("unreadable tun_flags {s:?}")))
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(Existing::Other),
        Err(e) => Err(e),
    }
}

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

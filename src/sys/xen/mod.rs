//! The Xen device files a userspace netback needs in dom0: grant copies and ring
//! mappings (`gntdev`, the ring pages `shared_page`), interdomain event channels
//! (`evtchn`), the xenstore wire protocol (`xenstore`), and pages of our own granted
//! out (`gntalloc`): to ourselves as copy buffers (`granted`), and to dom0 by the
//! rig's test netfront.

pub mod evtchn;
pub mod gntalloc;
pub mod gntdev;
pub mod granted;
pub mod shared_page;
pub mod xenstore;

/// A Xen domain id.
pub type DomId = u16;
/// A grant reference.
pub type GrantRef = u32;
/// Size of a Xen page: one grant, one ring.
pub const PAGE_SIZE: usize = 4096;

/// An ioctl number with no direction bits (`_IOC(_IOC_NONE, ty, nr, size)`), as the
/// Xen device headers define theirs.
const fn ioc_none(ty: u8, nr: u8, size: usize) -> libc::c_ulong {
    ((size as libc::c_ulong) << 16) | ((ty as libc::c_ulong) << 8) | nr as libc::c_ulong
}

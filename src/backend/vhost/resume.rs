//! Where a packed ring starts after a restart of gsonet (or any connection that
//! ended without GET_VRING_BASE): the relay's part of `ring::packed::record`.
//!
//! QEMU restarts a ring at the vring base it sends in SET_VRING_BASE. For a split
//! ring that is the guest's used index, read back from guest memory when the
//! backend went away. For a packed ring QEMU has nothing to read
//! (hw/virtio/virtio.c, `virtio_queue_packed_restore_last_avail_idx`) and sends the
//! base of the ring's last start again. The relay follows the connection (the
//! features, the memory files, each ring's size) and, at a packed ring's
//! SET_VRING_BASE, puts the position the port's record holds in its place when the
//! record says the ring ran under a gsonet whose frontend never read it back, for
//! this frontend (the same memory files), ring size and stale base. Otherwise the
//! frontend's base stands. Either way the record starts the ring from there; a
//! GET_VRING_BASE reply marks it read back (the frontend then knows the position).

use std::os::fd::{AsFd, OwnedFd};

use tracing::{info, warn};

use super::firewall::{req, Header};
use super::port::Port;
use crate::features::RING_PACKED;
use crate::ring::host::HostMem;
use crate::ring::packed::record::{mem_id, Owner};
use crate::ring::packed::Pos;
use crate::sys::fd;

/// What one connection told the relay so far.
#[derive(Debug, Default)]
pub struct Resumer {
    packed: bool,
    /// The smallest (device, inode) of the memory files seen (`record::mem_id`).
    mem: Option<u64>,
    /// Each ring's size, from SET_VRING_NUM.
    sizes: Vec<u16>,
}

/// A vhost_vring_state payload: (index, num).
fn vring_state(payload: &[u8]) -> Option<(usize, u32)> {
    let index = u32::from_le_bytes(payload.get(0..4)?.try_into().ok()?);
    let num = u32::from_le_bytes(payload.get(4..8)?.try_into().ok()?);
    Some((index as usize, num))
}

impl Resumer {
    /// Looks at a request of the frontend's on its way to the vhost crate (checked
    /// by the firewall); a packed ring's SET_VRING_BASE may leave with another base.
    pub fn inbound(&mut self, port: &Port, hdr: &Header, payload: &mut [u8], fds: &[OwnedFd]) {
        let Some(rec) = port.rings.as_ref() else {
            return;
        };
        match hdr.request {
            req::SET_FEATURES => {
                if let Some(b) = payload.get(0..8) {
                    let f = u64::from_le_bytes(b.try_into().unwrap_or_default());
                    self.packed = f & RING_PACKED != 0;
                }
            }
            req::SET_MEM_TABLE | req::ADD_MEM_REG => {
                let ids = fds
                    .iter()
                    .filter_map(|f| fd::identity(f.as_fd()).ok())
                    .chain(self.mem.map(|m| (0, m)));
                self.mem = Some(mem_id(ids));
            }
            req::SET_VRING_NUM => {
                if let Some((q, num)) = vring_state(payload) {
                    if q < 2 * usize::from(port.cfg.queues) {
                        if self.sizes.len() <= q {
                            self.sizes.resize(q + 1, 0);
                        }
                        self.sizes[q] = num as u16;
                    }
                }
            }
            req::SET_VRING_BASE if self.packed => {
                let Some((q, base)) = vring_state(payload) else {
                    return;
                };
                let size = self.sizes.get(q).copied().unwrap_or(0);
                let owner = Owner {
                    mem: self.mem.unwrap_or(0),
                    size,
                    qemu_base: base,
                };
                let given = Pos::from_base(base as u16, size.max(1));
                let at = match rec.resume(q, owner) {
                    Some(r) => {
                        let mem = port.memory();
                        let at = r.resolve(mem.as_deref().map(HostMem::new).as_ref());
                        let b = u32::from(at.to_base());
                        payload[4..8].copy_from_slice(&(b | b << 16).to_le_bytes());
                        if given != Some(at) {
                            info!(port = %port.name(), queue = q, frontend_base = format_args!("{base:#x}"), resumed = format_args!("{:#x}", at.to_base()),
                                "packed ring resumed where this port's record has it: the frontend's base is that of the ring's last start (QEMU cannot read a packed ring's position back from guest memory)");
                        }
                        Some(at)
                    }
                    None => given,
                };
                match at {
                    Some(at) => rec.started(q, owner, at),
                    None => {
                        warn!(port = %port.name(), queue = q, base, size, "packed ring started at a base outside it")
                    }
                }
            }
            _ => {}
        }
    }
}

/// Looks at a reply of the vhost crate's on its way to the frontend: a
/// GET_VRING_BASE reply hands the ring's position back.
pub fn outbound(port: &Port, hdr: &Header, payload: &[u8]) {
    if hdr.request != req::GET_VRING_BASE {
        return;
    }
    if let (Some(rec), Some((q, _))) = (port.rings.as_ref(), vring_state(payload)) {
        rec.handed_back(q);
    }
}

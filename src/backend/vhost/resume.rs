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
//!
//! A driver that sets the device up afresh sets up new rings too (virtio 1.2, 3.1.1:
//! ACKNOWLEDGE, DRIVER, FEATURES_OK, then its virtqueues, then DRIVER_OK), and its
//! base is that of the new rings. DPDK's virtio_user resets its packed rings on a
//! reconnect in server mode and sends the same stale-looking base QEMU does, but with
//! VHOST_USER_PROTOCOL_F_STATUS it passes its driver's status on: ACKNOWLEDGE, DRIVER
//! and FEATURES_OK without DRIVER_OK (0xb) before the rings. So that status, until
//! the next, makes the frontend's base stand. QEMU 10 reports the vhost device's
//! progress instead: FEATURES_OK alone at SET_FEATURES (0x8, what GET_STATUS said
//! or'ed with it), ACKNOWLEDGE, DRIVER and DRIVER_OK once the rings run (0xf); its
//! rings after a restart of gsonet are the guest's live ones and are resumed.

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
    /// The device status the driver last set (SET_STATUS; GET_STATUS answers it).
    status: u8,
}

/// VIRTIO_CONFIG_S_ACKNOWLEDGE, _DRIVER, _DRIVER_OK and _FEATURES_OK.
const ACKNOWLEDGE: u8 = 1;
const DRIVER: u8 = 2;
const DRIVER_OK: u8 = 4;
const FEATURES_OK: u8 = 8;

/// A vhost_vring_state payload: (index, num).
fn vring_state(payload: &[u8]) -> Option<(usize, u32)> {
    let index = u32::from_le_bytes(payload.get(0..4)?.try_into().ok()?);
    let num = u32::from_le_bytes(payload.get(4..8)?.try_into().ok()?);
    Some((index as usize, num))
}

impl Resumer {
    /// Takes note of the device status the driver set (SET_STATUS).
    pub fn device_status(&mut self, status: u8) {
        self.status = status;
    }

    /// The device status the driver last set on this connection (0 before any).
    pub fn status(&self) -> u8 {
        self.status
    }

    /// The driver is setting the device up (its last status: ACKNOWLEDGE, DRIVER
    /// and FEATURES_OK, not DRIVER_OK): the rings it starts now are new ones.
    fn setting_up(&self) -> bool {
        let steps = ACKNOWLEDGE | DRIVER | FEATURES_OK | DRIVER_OK;
        self.status & steps == ACKNOWLEDGE | DRIVER | FEATURES_OK
    }

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
                let resumed = if self.setting_up() {
                    None
                } else {
                    rec.resume(q, owner)
                };
                let at = match resumed {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::vhost::firewall::FLAG_VERSION;
    use crate::config::PortConfig;

    const WRAP: u32 = 0x8000;

    fn request(r: &mut Resumer, port: &Port, request: u32, payload: &mut [u8]) {
        let hdr = Header {
            request,
            flags: FLAG_VERSION,
            size: payload.len() as u32,
        };
        r.inbound(port, &hdr, payload, &[]);
    }

    /// A connection's start up to ring 0's SET_VRING_BASE of `base` (after
    /// SET_STATUS `status`, if any); the base the vhost crate is handed.
    fn start(port: &Port, status: Option<u8>, base: u32) -> u32 {
        let mut r = Resumer::default();
        request(
            &mut r,
            port,
            req::SET_FEATURES,
            &mut RING_PACKED.to_le_bytes(),
        );
        if let Some(s) = status {
            r.device_status(s);
        }
        let mut num = [0u32.to_le_bytes(), 8u32.to_le_bytes()].concat();
        request(&mut r, port, req::SET_VRING_NUM, &mut num);
        let mut state = [0u32.to_le_bytes(), base.to_le_bytes()].concat();
        request(&mut r, port, req::SET_VRING_BASE, &mut state);
        u32::from_le_bytes(state[4..8].try_into().unwrap())
    }

    #[test]
    fn a_driver_setting_the_device_up_starts_its_rings_at_its_own_base() {
        let sock = std::env::temp_dir().join(format!("gsonet-resume-{}.sock", std::process::id()));
        let cfg = PortConfig::parse(&format!("socket={},packed=on", sock.display())).unwrap();
        let port = Port::new(0, cfg).unwrap();
        let rec = port.rings.clone().expect("a record beside the socket");
        // The first connection starts ring 0 at the frontend's base; the ring then
        // publishes up to 3 and gsonet goes away without GET_VRING_BASE.
        assert_eq!(start(&port, None, WRAP) & 0xffff, WRAP);
        let to = Pos { idx: 3, wrap: true };
        let slot = rec.slot_of(0).unwrap();
        slot.begin(0x1000, Pos::START, to);
        slot.commit(to);
        // A frontend that sends the base of the ring's last start again (QEMU) is
        // resumed where the record has it.
        let resumed = u32::from(to.to_base());
        assert_eq!(start(&port, None, WRAP), resumed | resumed << 16);
        // One whose driver sets the device up first (ACKNOWLEDGE, DRIVER and
        // FEATURES_OK, not DRIVER_OK, as virtio_user after resetting its rings)
        // starts at its own base, and the record starts again from there.
        assert_eq!(start(&port, Some(0xb), WRAP), WRAP);
        assert_eq!(start(&port, None, WRAP) & 0xffff, WRAP);
        // QEMU's FEATURES_OK alone, and a status with DRIVER_OK, are no setting up.
        for status in [0x8, 0xf] {
            slot.begin(0x1000, Pos::START, to);
            slot.commit(to);
            assert_eq!(start(&port, Some(status), WRAP), resumed | resumed << 16);
        }
        drop((slot, rec, port));
        let mut record = sock.into_os_string();
        record.push(".rings");
        std::fs::remove_file(record).unwrap();
    }
}

//! One vif as a switch port: its counters, its place in the switch, and while a
//! netfront is connected, the connection (rings, event channels) and the RX side.
//! Frames for the netfront are staged (one copy out of the sender's buffers) and
//! grant-copied into its RX buffers with one ioctl per batch, when the sender signals
//! at the end of its batch.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use tracing::debug;

use crate::backend::switch::deliver::Destination;
use crate::backend::switch::SwitchPort;
use crate::config::XenVifConfig;
use crate::features::Caps;
use crate::l2::{Mac, Vid};
use crate::netif::{self, RxSlot, RX_RING_SIZE};
use crate::stats::{Counters, DropReason};
use crate::sys::xen::evtchn::EvtchnDev;
use crate::sys::xen::gntdev::{CopyOp, Gntdev, MappedPage};
use crate::sys::xen::DomId;
use crate::vnet_hdr::VirtioNetHdr;

/// Staged RX bytes after which a sender's batch is copied at once.
const STAGE_MAX: usize = 1 << 20;
/// Room for the staged bytes: a frame more than STAGE_MAX and each frame's padding,
/// reserved once so the buffer never moves (its frames' page alignment holds).
const STAGE_ROOM: usize = STAGE_MAX + 2 * (65536 + netif::PAGE);

/// The frontend end of one connection.
pub struct Conn {
    pub dom: DomId,
    pub gnt: Arc<Gntdev>,
    pub evt: EvtchnDev,
    /// Local event channel ports (the same one unless split).
    pub tx_port: u32,
    pub rx_port: u32,
    pub tx_ring: MappedPage,
    pub rx: Mutex<RxSide>,
    /// What the netfront accepts from us.
    pub rx_caps: Caps,
    /// Set to stop the worker.
    pub stop: AtomicBool,
}

/// The RX ring and the batch staged for it.
pub struct RxSide {
    pub ring: MappedPage,
    req_cons: u32,
    broken: bool,
    staged: Vec<u8>,
    ops: Vec<CopyOp>,
    /// Responses to write at flush: ring index, bytes, and the copy that fills it.
    resps: Vec<(u32, [u8; netif::RX_SLOT], Option<usize>)>,
    status: Vec<i16>,
    slots: Vec<RxSlot>,
}

impl RxSide {
    pub fn new(ring: MappedPage) -> RxSide {
        RxSide {
            ring,
            req_cons: 0,
            broken: false,
            staged: Vec::with_capacity(STAGE_ROOM),
            ops: Vec::new(),
            resps: Vec::new(),
            status: Vec::new(),
            slots: Vec::new(),
        }
    }
}

impl Conn {
    /// Copies the staged batch into the netfront's buffers (one ioctl), writes the
    /// responses in the slots of their requests and signals it if it asked.
    fn flush(&self, rx: &mut RxSide, stats: &Counters) {
        if rx.resps.is_empty() {
            return;
        }
        let RxSide {
            ring,
            staged,
            ops,
            resps,
            status,
            ..
        } = rx;
        let ok = match self.gnt.copy_out(staged, ops, status) {
            Ok(()) => true,
            Err(e) => {
                debug!(dom = self.dom, "grant copy to the netfront failed: {e}");
                false
            }
        };
        let mut last = None;
        for (idx, bytes, op) in resps.iter_mut() {
            if let Some(op) = *op {
                if !ok || status.get(op).is_none_or(|&s| s != 0) {
                    stats.drop(DropReason::XenBadGrant);
                    bytes[6..8].copy_from_slice(&netif::RSP_ERROR.to_le_bytes());
                }
            }
            ring.write(netif::rx_slot_off(*idx), bytes);
            last = Some(*idx);
        }
        if let Some(last) = last {
            let new = last.wrapping_add(1);
            let old = ring.load(netif::RSP_PROD);
            ring.store(netif::RSP_PROD, new);
            ring.full_fence();
            let event = ring.load(netif::RSP_EVENT);
            if new.wrapping_sub(event) < new.wrapping_sub(old) {
                stats.rx_calls.fetch_add(1, Ordering::Relaxed);
                if let Err(e) = self.evt.notify(self.rx_port) {
                    debug!(dom = self.dom, "RX notify: {e}");
                }
            }
        }
        staged.clear();
        ops.clear();
        resps.clear();
    }

    /// Stages one frame for the netfront.
    fn stage(
        &self,
        rx: &mut RxSide,
        hdr: &VirtioNetHdr,
        parts: &[&[u8]],
    ) -> Result<(), DropReason> {
        if rx.broken {
            return Err(DropReason::XenRingBroken);
        }
        let len: usize = parts.iter().map(|p| p.len()).sum();
        let gso = if hdr.gso.is_gso() {
            // `deliver` passes only what rx_caps accepts: TCP GSO.
            Some((
                netif::gso_type(hdr.gso.kind).ok_or(DropReason::SegmentError)?,
                hdr.gso_size,
            ))
        } else {
            None
        };
        let mut slots = std::mem::take(&mut rx.slots);
        netif::rx_slots(len, gso.is_some(), &mut slots);
        let need = slots.len() as u32;
        let prod = rx.ring.load(netif::REQ_PROD);
        let mut avail = prod.wrapping_sub(rx.req_cons);
        if avail > RX_RING_SIZE {
            rx.broken = true;
            rx.slots = slots;
            return Err(DropReason::XenRingBroken);
        }
        if avail < need {
            // Ask to be told when there is room, then look once more.
            rx.ring
                .store(netif::REQ_EVENT, rx.req_cons.wrapping_add(need));
            rx.ring.full_fence();
            avail = rx.ring.load(netif::REQ_PROD).wrapping_sub(rx.req_cons);
            if avail < need || avail > RX_RING_SIZE {
                rx.slots = slots;
                return Err(DropReason::RxQueueFull);
            }
        }
        // Each frame starts on a page of ours: its page-sized slots are then one page
        // each side, one copy op each (a slot straddling two of our pages costs
        // gntdev two ops, two page pins and twice the hypercall entries).
        let base = page_aligned(&rx.staged);
        rx.staged.resize(base, 0);
        for p in parts {
            rx.staged.extend_from_slice(p);
        }
        let data_slots = slots
            .iter()
            .filter(|s| matches!(s, RxSlot::Data { .. }))
            .count();
        let mut data_seen = 0;
        for (k, s) in slots.iter().enumerate() {
            let idx = rx.req_cons.wrapping_add(k as u32);
            let mut req = [0u8; netif::RX_SLOT];
            rx.ring.read(netif::rx_slot_off(idx), &mut req);
            let (id, gref) = netif::rx_request(&req);
            match *s {
                RxSlot::Data { at, len } => {
                    data_seen += 1;
                    let mut flags = 0;
                    if at == 0 {
                        flags |= netif::rx_flags(hdr);
                        if gso.is_some() {
                            flags |= netif::RXF_EXTRA_INFO;
                        }
                    }
                    if data_seen < data_slots {
                        flags |= netif::RXF_MORE_DATA;
                    }
                    rx.ops.push(CopyOp {
                        dom: self.dom,
                        gref,
                        guest_off: 0,
                        len: len as u16,
                        local_off: base + at,
                    });
                    let resp = netif::rx_response(id, 0, flags, len as i16);
                    rx.resps.push((idx, resp, Some(rx.ops.len() - 1)));
                }
                RxSlot::Gso => {
                    let (ty, size) = gso.unwrap_or_default();
                    rx.resps
                        .push((idx, netif::gso_extra(size, ty, false), None));
                }
            }
        }
        rx.req_cons = rx.req_cons.wrapping_add(need);
        rx.slots = slots;
        Ok(())
    }
}

/// The first offset at or after `buf`'s end whose address starts a page.
fn page_aligned(buf: &[u8]) -> usize {
    let end = buf.as_ptr() as usize + buf.len();
    buf.len() + (end.wrapping_neg() & (netif::PAGE - 1))
}

/// One vif's port in the switch.
pub struct VifPort {
    pub id: usize,
    pub cfg: XenVifConfig,
    pub stats: Counters,
    /// `vifD.N` while attached, else the slot's own name.
    name: Mutex<String>,
    idle_name: String,
    conn: RwLock<Option<Arc<Conn>>>,
    connected: AtomicBool,
}

impl VifPort {
    pub fn new(id: usize, cfg: XenVifConfig, idle_name: String) -> VifPort {
        VifPort {
            id,
            cfg,
            stats: Counters::default(),
            name: Mutex::new(idle_name.clone()),
            idle_name,
            conn: RwLock::new(None),
            connected: AtomicBool::new(false),
        }
    }

    pub fn name(&self) -> String {
        self.name.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    pub fn set_name(&self, name: Option<String>) {
        *self.name.lock().unwrap_or_else(|e| e.into_inner()) =
            name.unwrap_or_else(|| self.idle_name.clone());
    }

    pub fn conn(&self) -> Option<Arc<Conn>> {
        self.conn.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// A netfront connected (`Some`) or went away (`None`).
    pub fn set_conn(&self, c: Option<Arc<Conn>>) {
        self.connected.store(c.is_some(), Ordering::Release);
        *self.conn.write().unwrap_or_else(|e| e.into_inner()) = c;
    }

    /// What the netfront may send us: what we advertised.
    pub fn tx_caps(&self) -> Caps {
        netif::tx_caps(self.cfg.csum, self.cfg.tso)
    }
}

impl Destination for VifPort {
    fn caps(&self) -> Caps {
        self.conn().map(|c| c.rx_caps).unwrap_or_default()
    }

    fn max_burst(&self) -> Option<usize> {
        None
    }

    fn send(&self, _queue: usize, hdr: &VirtioNetHdr, parts: &[&[u8]]) -> Result<(), DropReason> {
        let Some(conn) = self.conn() else {
            return Err(DropReason::RxQueueFull);
        };
        let mut rx = conn.rx.lock().unwrap_or_else(|e| e.into_inner());
        conn.stage(&mut rx, hdr, parts)?;
        if rx.staged.len() >= STAGE_MAX || rx.resps.len() >= RX_RING_SIZE as usize / 2 {
            conn.flush(&mut rx, &self.stats);
        }
        Ok(())
    }

    fn stats(&self) -> &Counters {
        &self.stats
    }
}

impl SwitchPort for VifPort {
    fn vlan(&self) -> Option<Vid> {
        None
    }

    fn mac(&self) -> Option<Mac> {
        self.cfg.mac
    }

    fn is_connected(&self) -> bool {
        self.connected.load(Ordering::Acquire)
    }

    fn rx_caps(&self) -> Option<Caps> {
        self.conn().map(|c| c.rx_caps)
    }

    fn signal_rx(&self, _queue: usize) {
        if let Some(conn) = self.conn() {
            let mut rx = conn.rx.lock().unwrap_or_else(|e| e.into_inner());
            conn.flush(&mut rx, &self.stats);
        }
    }
}

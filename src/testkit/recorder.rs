//! A switch port (or uplink) for tests that records every frame it is handed, with
//! the port settings the switch asks about as plain fields.

use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::Mutex;
use std::time::Instant;

use crate::backend::ratelimit::{ByteRate, RateAdmit};
use crate::backend::switch::deliver::Destination;
use crate::backend::switch::{stable, SwitchPort, SwitchUplink};
use crate::features::Caps;
use crate::l2::{Mac, Vid, VlanSet};
use crate::stats::{Counters, DropReason};
use crate::vnet_hdr::VirtioNetHdr;

#[derive(Default)]
pub struct Recorder {
    /// Its RX queue is full: every frame is refused.
    pub full: AtomicBool,
    /// Frames its RX queue still takes before it is full (None: no bound).
    pub room: Mutex<Option<usize>>,
    /// No guest behind it: the switch floods nothing to it.
    pub disconnected: bool,
    pub vlan: Option<Vid>,
    pub trunk: Option<VlanSet>,
    pub mac: Option<Mac>,
    pub mac_lock: bool,
    pub gro: bool,
    pub rx_rate: Option<ByteRate>,
    /// What it was handed, header and bytes, in order.
    pub sent: Mutex<Vec<(VirtioNetHdr, Vec<u8>)>>,
    /// For each frame handed over, whether its sender had declared all its bytes
    /// stable (`switch::stable`).
    pub stable: Mutex<Vec<bool>>,
    pub stats: Counters,
}

impl Recorder {
    /// What it was handed since the last `take`.
    pub fn take(&self) -> Vec<(VirtioNetHdr, Vec<u8>)> {
        std::mem::take(&mut *self.sent.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// The bytes of what it was handed so far (kept).
    pub fn frames(&self) -> Vec<Vec<u8>> {
        let sent = self.sent.lock().unwrap_or_else(|e| e.into_inner());
        sent.iter().map(|(_, f)| f.clone()).collect()
    }

    /// Frames it counted as dropped, for any reason.
    pub fn drops(&self) -> u64 {
        DropReason::ALL.iter().map(|&r| self.stats.drops(r)).sum()
    }
}

impl Destination for Recorder {
    fn caps(&self) -> Caps {
        Caps::ALL
    }
    fn max_burst(&self) -> Option<usize> {
        None
    }
    fn gro(&self) -> bool {
        self.gro
    }
    fn rx_rate(&self, wire: usize, may_wait: bool) -> RateAdmit {
        self.rx_rate.as_ref().map_or(RateAdmit::Now, |r| {
            r.admit_at(wire as u64, Instant::now(), may_wait)
        })
    }
    fn send(&self, _: usize, hdr: &VirtioNetHdr, parts: &[&[u8]]) -> Result<(), DropReason> {
        if self.full.load(Relaxed) {
            return Err(DropReason::RxQueueFull);
        }
        if let Some(n) = self.room.lock().unwrap_or_else(|e| e.into_inner()).as_mut() {
            *n = n.checked_sub(1).ok_or(DropReason::RxQueueFull)?;
        }
        self.sent
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push((*hdr, parts.concat()));
        self.stable
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(parts.iter().all(|p| stable::holds(p)));
        Ok(())
    }
    fn stats(&self) -> &Counters {
        &self.stats
    }
}

impl SwitchPort for Recorder {
    fn vlan(&self) -> Option<Vid> {
        self.vlan
    }
    fn trunk(&self) -> Option<VlanSet> {
        self.trunk.clone()
    }
    fn mac(&self) -> Option<Mac> {
        self.mac
    }
    fn mac_lock(&self) -> bool {
        self.mac_lock
    }
    fn mac_limit(&self) -> usize {
        8
    }
    fn is_connected(&self) -> bool {
        !self.disconnected
    }
    fn rx_caps(&self) -> Option<Caps> {
        (!self.disconnected).then_some(Caps::ALL)
    }
    fn signal_rx(&self, _: usize) {}
}

impl SwitchUplink for Recorder {
    fn name(&self) -> String {
        "recorder".into()
    }
    fn set_rx_offload(&self, caps: Caps) -> Result<Caps, String> {
        Ok(caps)
    }
}

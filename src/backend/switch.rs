//! The L2 learning switch joining all ports and uplinks of one gsonet: learns source
//! MACs, forwards known unicast to one endpoint, floods the rest, never hairpins.

use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use tracing::warn;

use super::deliver::{deliver, DeliverCtx, Destination, Frame, Path, Pending};
use super::port::Port;
use super::stats::Counters;
use super::uplink::Uplink;
use crate::features::Caps;
use crate::vnet_hdr::VirtioNetHdr;

/// Where a frame came from or goes to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Endpoint {
    Port(usize),
    Uplink(usize),
}

pub type Mac = [u8; 6];

/// MAC learning table with aging.
pub struct Fdb {
    entries: HashMap<Mac, (Endpoint, Instant)>,
    /// Addresses the operator configured: never aged, never moved by learning.
    pinned: HashMap<Mac, Endpoint>,
    aging: Duration,
}

impl Fdb {
    pub fn new(aging: Duration) -> Fdb {
        Fdb {
            entries: HashMap::new(),
            pinned: HashMap::new(),
            aging,
        }
    }

    pub fn pin(&mut self, mac: Mac, at: Endpoint) {
        self.pinned.insert(mac, at);
    }

    /// Learns `mac` at `at` (multicast sources are never learned).
    pub fn learn(&mut self, mac: Mac, at: Endpoint, now: Instant) {
        if mac[0] & 1 == 0 && !self.pinned.contains_key(&mac) {
            self.entries.insert(mac, (at, now));
        }
    }

    pub fn lookup(&mut self, mac: &Mac, now: Instant) -> Option<Endpoint> {
        if let Some(&e) = self.pinned.get(mac) {
            return Some(e);
        }
        match self.entries.get(mac) {
            Some(&(e, seen)) if now.duration_since(seen) <= self.aging => Some(e),
            Some(_) => {
                self.entries.remove(mac);
                None
            }
            None => None,
        }
    }

    /// Forgets everything learned on `at` (its guest went away).
    pub fn forget(&mut self, at: Endpoint) {
        self.entries.retain(|_, (e, _)| *e != at);
    }
}

pub struct Switch {
    ports: Vec<Arc<Port>>,
    uplinks: Vec<Arc<dyn Uplink>>,
    fdb: Mutex<Fdb>,
    /// Bumped when any guest adds RX buffers; uplink readers holding a frame wait on it.
    rx_room: (Mutex<u64>, Condvar),
}

impl Destination for Arc<Port> {
    fn caps(&self) -> Caps {
        self.negotiated().map(|n| n.rx).unwrap_or_default()
    }

    fn max_burst(&self) -> Option<usize> {
        Port::max_burst(self)
    }

    fn send(
        &self,
        queue: usize,
        hdr: &VirtioNetHdr,
        parts: &[&[u8]],
        pending: &mut Pending,
    ) -> Result<(), &'static str> {
        match self.receive(queue, hdr, parts) {
            Ok(()) => {
                pending.rx_written(self, queue % self.queue_pairs());
                Ok(())
            }
            Err(e) => Err(e.reason()),
        }
    }

    fn stats(&self) -> &Counters {
        &self.stats
    }
}

impl Switch {
    pub fn new(ports: Vec<Arc<Port>>, uplinks: Vec<Arc<dyn Uplink>>, aging: Duration) -> Switch {
        Switch {
            ports,
            uplinks,
            fdb: Mutex::new(Fdb::new(aging)),
            rx_room: (Mutex::new(0), Condvar::new()),
        }
    }

    pub fn ports(&self) -> &[Arc<Port>] {
        &self.ports
    }

    pub fn uplinks(&self) -> &[Arc<dyn Uplink>] {
        &self.uplinks
    }

    /// Forwards one frame from `src` (arriving on its queue `queue`). For a known
    /// unicast destination, returns how it went.
    pub fn forward(
        &self,
        src: Endpoint,
        queue: usize,
        frame: &Frame,
        ctx: &mut DeliverCtx,
    ) -> Option<Path> {
        let Some(head) = frame.parts.first().filter(|p| p.len() >= 12) else {
            // The Ethernet addresses straddle slices: gather them.
            let mut addr = [0u8; 12];
            let mut n = 0;
            for p in frame.parts {
                let take = (12 - n).min(p.len());
                addr[n..n + take].copy_from_slice(&p[..take]);
                n += take;
                if n == 12 {
                    break;
                }
            }
            return self.forward_addrs(src, queue, frame, &addr, ctx);
        };
        let mut addr = [0u8; 12];
        addr.copy_from_slice(&head[..12]);
        self.forward_addrs(src, queue, frame, &addr, ctx)
    }

    fn forward_addrs(
        &self,
        src: Endpoint,
        queue: usize,
        frame: &Frame,
        addr: &[u8; 12],
        ctx: &mut DeliverCtx,
    ) -> Option<Path> {
        let dst_mac: Mac = addr[..6].try_into().unwrap_or_default();
        let src_mac: Mac = addr[6..].try_into().unwrap_or_default();
        let now = Instant::now();
        let known = {
            let mut fdb = self.fdb.lock().unwrap_or_else(|e| e.into_inner());
            fdb.learn(src_mac, src, now);
            if dst_mac[0] & 1 == 0 {
                fdb.lookup(&dst_mac, now)
            } else {
                None
            }
        };
        match known {
            Some(dst) if dst == src => None,
            Some(dst) => self.deliver_to(dst, queue, frame, ctx),
            None => {
                // A flooded frame is never retried (the caller gets no Path back), so a
                // full RX queue loses it here and must count it.
                let defer = std::mem::replace(&mut ctx.defer_full, false);
                for i in 0..self.ports.len() {
                    let e = Endpoint::Port(i);
                    if e != src && self.ports[i].is_connected() {
                        self.deliver_to(e, queue, frame, ctx);
                    }
                }
                for i in 0..self.uplinks.len() {
                    let e = Endpoint::Uplink(i);
                    if e != src {
                        self.deliver_to(e, queue, frame, ctx);
                    }
                }
                ctx.defer_full = defer;
                None
            }
        }
    }

    fn deliver_to(
        &self,
        dst: Endpoint,
        queue: usize,
        frame: &Frame,
        ctx: &mut DeliverCtx,
    ) -> Option<Path> {
        match dst {
            Endpoint::Port(i) => self.ports.get(i).map(|p| deliver(frame, p, queue, ctx)),
            Endpoint::Uplink(i) => self
                .uplinks
                .get(i)
                .map(|u| deliver(frame, u.as_destination(), queue, ctx)),
        }
    }

    /// Sends frames for `mac` to port `id` from the start.
    pub fn pin_mac(&self, mac: Mac, id: usize) {
        self.fdb
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .pin(mac, Endpoint::Port(id));
    }

    /// A port's guest is gone: forget its addresses.
    pub fn port_down(&self, id: usize) {
        self.fdb
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .forget(Endpoint::Port(id));
        self.caps_changed();
    }

    /// What the connected guests accept, together: uplinks program their device from it.
    pub fn caps_changed(&self) {
        let union = self
            .ports
            .iter()
            .filter_map(|p| p.negotiated().map(|n| n.rx))
            .fold(Caps::default(), Caps::or);
        for u in &self.uplinks {
            if let Err(e) = u.set_rx_offload(union) {
                warn!(uplink = %u.name(), "cannot program uplink offloads: {e}");
            }
        }
    }

    /// Called when port `_id` got RX buffers.
    pub fn rx_space(&self, _id: usize) {
        let (m, cv) = &self.rx_room;
        *m.lock().unwrap_or_else(|e| e.into_inner()) += 1;
        cv.notify_all();
    }

    /// Current RX-room generation, to wait on with `wait_rx_space`.
    pub fn rx_generation(&self) -> u64 {
        *self.rx_room.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Waits until some guest added RX buffers after generation `seen`, or `timeout`.
    pub fn wait_rx_space(&self, seen: u64, timeout: Duration) {
        let (m, cv) = &self.rx_room;
        let g = m.lock().unwrap_or_else(|e| e.into_inner());
        let _ = cv.wait_timeout_while(g, timeout, |g| *g == seen);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fdb_learns_ages_and_forgets() {
        let t0 = Instant::now();
        let mut f = Fdb::new(Duration::from_secs(10));
        let a = [2, 0, 0, 0, 0, 1];
        f.learn(a, Endpoint::Port(1), t0);
        assert_eq!(
            f.lookup(&a, t0 + Duration::from_secs(5)),
            Some(Endpoint::Port(1))
        );
        assert_eq!(f.lookup(&a, t0 + Duration::from_secs(11)), None);
        f.learn(a, Endpoint::Uplink(0), t0);
        f.forget(Endpoint::Uplink(0));
        assert_eq!(f.lookup(&a, t0), None);
        // Moves follow the latest source.
        f.learn(a, Endpoint::Port(1), t0);
        f.learn(a, Endpoint::Port(2), t0);
        assert_eq!(f.lookup(&a, t0), Some(Endpoint::Port(2)));
    }

    #[test]
    fn pinned_addresses_win_over_learning() {
        let t0 = Instant::now();
        let mut f = Fdb::new(Duration::from_secs(1));
        let a = [2, 0, 0, 0, 0, 9];
        f.pin(a, Endpoint::Port(3));
        f.learn(a, Endpoint::Uplink(0), t0);
        assert_eq!(
            f.lookup(&a, t0 + Duration::from_secs(100)),
            Some(Endpoint::Port(3))
        );
    }

    #[test]
    fn multicast_sources_are_not_learned() {
        let t0 = Instant::now();
        let mut f = Fdb::new(Duration::from_secs(10));
        let m = [1, 0, 0x5e, 0, 0, 1];
        f.learn(m, Endpoint::Port(0), t0);
        assert_eq!(f.lookup(&m, t0), None);
    }
}

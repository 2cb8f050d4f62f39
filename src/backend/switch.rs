//! The L2 learning switch joining all ports and uplinks of one gsonet: learns source
//! MACs per VLAN, forwards known unicast to one endpoint, floods the rest within the
//! frame's VLAN, never hairpins. Access ports (`vlan=N`) see their VLAN untagged;
//! uplinks are trunks and see it tagged (the tag views come from `vlan`).

use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use tracing::warn;

use super::deliver::{deliver, DeliverCtx, Destination, Frame, Path, Pending, RX_STALLED};
use super::port::Port;
use super::stats::Counters;
use super::uplink::Uplink;
use super::vlan::{self, Domain, Tag, Vid};
use crate::features::Caps;
use crate::ring::rx::RxError;
use crate::segment::parse::gather;
use crate::vnet_hdr::VirtioNetHdr;

/// Where a frame came from or goes to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Endpoint {
    Port(usize),
    Uplink(usize),
}

pub type Mac = [u8; 6];

/// An address within its broadcast domain: the same MAC may live in several VLANs.
pub type FdbKey = (Domain, Mac);

/// MAC learning table with aging, one address space per VLAN.
/// Most addresses the learning table holds.
pub const FDB_MAX: usize = 8192;

pub struct Fdb {
    entries: HashMap<FdbKey, (Endpoint, Instant)>,
    /// Addresses the operator configured: never aged, never moved by learning.
    pinned: HashMap<FdbKey, Endpoint>,
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

    pub fn pin(&mut self, key: FdbKey, at: Endpoint) {
        self.pinned.insert(key, at);
    }

    /// Learns `key` at `at` (multicast sources are never learned). The table holds at
    /// most `FDB_MAX` addresses, so a guest sending from random source addresses
    /// cannot grow it without bound: when full, aged entries go first, and if none
    /// have aged, new addresses are not learned (frames to them are flooded).
    pub fn learn(&mut self, key: FdbKey, at: Endpoint, now: Instant) {
        if key.1[0] & 1 != 0 || self.pinned.contains_key(&key) {
            return;
        }
        if self.entries.len() >= FDB_MAX && !self.entries.contains_key(&key) {
            let aging = self.aging;
            self.entries
                .retain(|_, (_, seen)| now.duration_since(*seen) <= aging);
            if self.entries.len() >= FDB_MAX {
                return;
            }
        }
        self.entries.insert(key, (at, now));
    }

    pub fn lookup(&mut self, key: &FdbKey, now: Instant) -> Option<Endpoint> {
        if let Some(&e) = self.pinned.get(key) {
            return Some(e);
        }
        match self.entries.get(key) {
            Some(&(e, seen)) if now.duration_since(seen) <= self.aging => Some(e),
            Some(_) => {
                self.entries.remove(key);
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
    /// The ports' access VLANs, sorted: a tagged uplink frame with one of these VIDs
    /// belongs to that VLAN; any other uplink frame to the untagged domain.
    access: Vec<Vid>,
    /// Bumped when any guest adds RX buffers; uplink readers holding a frame wait on it.
    rx_room: (Mutex<u64>, Condvar),
}

/// How a frame's source attaches to the switch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Attach {
    /// A port of this access VLAN.
    Access(Vid),
    /// A port without a VLAN (the untagged domain).
    Untagged,
    /// An uplink: a trunk carrying every VLAN tagged and the untagged domain as is.
    Trunk,
}

/// The domain a frame entered and whether it still carries that domain's tag.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ingress {
    pub domain: Domain,
    pub tagged: bool,
}

impl Ingress {
    const UNTAGGED: Ingress = Ingress {
        domain: None,
        tagged: false,
    };
}

/// Which domain a frame with `tag` entering at `at` belongs to, or the drop reason.
/// `access`: every access VLAN in use, sorted.
pub fn classify(at: Attach, tag: Tag, access: &[Vid]) -> Result<Ingress, &'static str> {
    let is_access = |vid: u16| Vid::new(vid).is_some_and(|v| access.binary_search(&v).is_ok());
    match (at, tag) {
        (_, Tag::Short) if !access.is_empty() => Err("too_short"),
        (Attach::Access(_), Tag::Dot1q(_) | Tag::Other) => Err("tagged_on_access_port"),
        (Attach::Access(v), _) => Ok(Ingress {
            domain: Some(v),
            tagged: false,
        }),
        // An untagged-domain guest must not speak for an access VLAN on the trunk.
        (Attach::Untagged, Tag::Dot1q(vid)) if is_access(vid) => Err("tagged_with_access_vlan"),
        (Attach::Trunk, Tag::Dot1q(vid)) if is_access(vid) => Ok(Ingress {
            domain: Vid::new(vid),
            tagged: true,
        }),
        _ => Ok(Ingress::UNTAGGED),
    }
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
            // Not worth waiting for: the guest has not read its queue for a while.
            Err(RxError::NoBuffers) if self.rx_stalled() => Err(RX_STALLED),
            Err(e) => Err(e.reason()),
        }
    }

    fn stats(&self) -> &Counters {
        &self.stats
    }
}

impl Switch {
    pub fn new(ports: Vec<Arc<Port>>, uplinks: Vec<Arc<dyn Uplink>>, aging: Duration) -> Switch {
        let mut access: Vec<Vid> = ports.iter().filter_map(|p| p.cfg.vlan).collect();
        access.sort_unstable();
        access.dedup();
        Switch {
            ports,
            uplinks,
            fdb: Mutex::new(Fdb::new(aging)),
            access,
            rx_room: (Mutex::new(0), Condvar::new()),
        }
    }

    pub fn ports(&self) -> &[Arc<Port>] {
        &self.ports
    }

    pub fn uplinks(&self) -> &[Arc<dyn Uplink>] {
        &self.uplinks
    }

    fn attach(&self, e: Endpoint) -> Attach {
        match e {
            Endpoint::Port(i) => match self.ports.get(i).and_then(|p| p.cfg.vlan) {
                Some(v) => Attach::Access(v),
                None => Attach::Untagged,
            },
            Endpoint::Uplink(_) => Attach::Trunk,
        }
    }

    /// Whether `e` takes part in `domain`: ports of that VLAN; uplinks always.
    fn in_domain(&self, e: Endpoint, domain: Domain) -> bool {
        match e {
            Endpoint::Port(i) => self.ports.get(i).is_some_and(|p| p.cfg.vlan == domain),
            Endpoint::Uplink(i) => i < self.uplinks.len(),
        }
    }

    fn counters(&self, e: Endpoint) -> Option<&Counters> {
        match e {
            Endpoint::Port(i) => self.ports.get(i).map(|p| &p.stats),
            Endpoint::Uplink(i) => self.uplinks.get(i).map(|u| u.stats()),
        }
    }

    /// Where a frame of `domain` from `src` is flooded: every other connected port of
    /// the domain and every other uplink.
    fn flood_targets(&self, src: Endpoint, domain: Domain) -> impl Iterator<Item = Endpoint> + '_ {
        let ports = (0..self.ports.len())
            .filter(|&i| self.ports[i].is_connected())
            .map(Endpoint::Port);
        let uplinks = (0..self.uplinks.len()).map(Endpoint::Uplink);
        ports
            .chain(uplinks)
            .filter(move |&e| e != src && self.in_domain(e, domain))
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
        let mut addr = [0u8; 12];
        gather(frame.parts, &mut addr);
        let ingress = if self.access.is_empty() {
            Ingress::UNTAGGED
        } else {
            match classify(self.attach(src), vlan::tag(frame.parts), &self.access) {
                Ok(i) => i,
                Err(reason) => {
                    if let Some(c) = self.counters(src) {
                        c.drop(reason);
                    }
                    return None;
                }
            }
        };
        let dst_mac: Mac = addr[..6].try_into().unwrap_or_default();
        let src_mac: Mac = addr[6..].try_into().unwrap_or_default();
        let domain = ingress.domain;
        let now = Instant::now();
        let known = {
            let mut fdb = self.fdb.lock().unwrap_or_else(|e| e.into_inner());
            fdb.learn((domain, src_mac), src, now);
            if dst_mac[0] & 1 == 0 {
                fdb.lookup(&(domain, dst_mac), now)
            } else {
                None
            }
        };
        // Which views of the frame its destinations need: ports of the domain see it
        // untagged, uplinks tagged with its VLAN (as is for the untagged domain).
        let (to_ports, to_uplinks) = match known {
            Some(dst) if dst == src || !self.in_domain(dst, domain) => return None,
            Some(Endpoint::Port(_)) => (true, false),
            Some(Endpoint::Uplink(_)) => (false, true),
            None => self
                .flood_targets(src, domain)
                .fold((false, false), |(p, u), e| match e {
                    Endpoint::Port(_) => (true, u),
                    Endpoint::Uplink(_) => (p, true),
                }),
        };
        let mut head = [0u8; 16];
        let mut parts = Vec::new();
        let retagged = match (domain, ingress.tagged) {
            (Some(vid), false) if to_uplinks => Some(vlan::push(frame, vid, &mut head, &mut parts)),
            (Some(_), true) if to_ports => Some(vlan::pop(frame, &mut head, &mut parts)),
            _ => None,
        };
        let retagged = match retagged.transpose() {
            Ok(r) => r,
            Err(reason) => {
                if let Some(c) = self.counters(src) {
                    c.drop(reason);
                }
                return None;
            }
        };
        let (for_ports, for_uplinks) = match (domain, ingress.tagged) {
            (None, _) => (Some(frame), Some(frame)),
            (Some(_), false) => (Some(frame), retagged.as_ref()),
            (Some(_), true) => (retagged.as_ref(), Some(frame)),
        };
        let view = |e: Endpoint| match e {
            Endpoint::Port(_) => for_ports,
            Endpoint::Uplink(_) => for_uplinks,
        };
        match known {
            Some(dst) => view(dst).and_then(|f| self.deliver_to(dst, queue, f, ctx)),
            None => {
                // A flooded frame is never retried (the caller gets no Path back), so a
                // full RX queue loses it here and must count it.
                let defer = std::mem::replace(&mut ctx.defer_full, false);
                for e in self.flood_targets(src, domain) {
                    if let Some(f) = view(e) {
                        self.deliver_to(e, queue, f, ctx);
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
        let domain = self.ports.get(id).and_then(|p| p.cfg.vlan);
        self.fdb
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .pin((domain, mac), Endpoint::Port(id));
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
        f.learn((None, a), Endpoint::Port(1), t0);
        assert_eq!(
            f.lookup(&(None, a), t0 + Duration::from_secs(5)),
            Some(Endpoint::Port(1))
        );
        assert_eq!(f.lookup(&(None, a), t0 + Duration::from_secs(11)), None);
        f.learn((None, a), Endpoint::Uplink(0), t0);
        f.forget(Endpoint::Uplink(0));
        assert_eq!(f.lookup(&(None, a), t0), None);
        // Moves follow the latest source.
        f.learn((None, a), Endpoint::Port(1), t0);
        f.learn((None, a), Endpoint::Port(2), t0);
        assert_eq!(f.lookup(&(None, a), t0), Some(Endpoint::Port(2)));
    }

    #[test]
    fn pinned_addresses_win_over_learning() {
        let t0 = Instant::now();
        let mut f = Fdb::new(Duration::from_secs(1));
        let a = [2, 0, 0, 0, 0, 9];
        f.pin((None, a), Endpoint::Port(3));
        f.learn((None, a), Endpoint::Uplink(0), t0);
        assert_eq!(
            f.lookup(&(None, a), t0 + Duration::from_secs(100)),
            Some(Endpoint::Port(3))
        );
    }

    #[test]
    fn table_is_bounded_and_makes_room_from_aged_entries() {
        let t0 = Instant::now();
        let mut f = Fdb::new(Duration::from_secs(10));
        let key = |i: usize| -> FdbKey {
            let b = (i as u32).to_be_bytes();
            (None, [2, 0, b[0], b[1], b[2], b[3]])
        };
        for i in 0..FDB_MAX + 100 {
            f.learn(key(i), Endpoint::Port(1), t0);
        }
        assert_eq!(f.entries.len(), FDB_MAX);
        assert_eq!(
            f.lookup(&key(FDB_MAX + 50), t0),
            None,
            "learned past the limit"
        );
        assert_eq!(f.lookup(&key(5), t0), Some(Endpoint::Port(1)));
        // Known addresses still move; once entries age, new ones are learned again.
        f.learn(key(5), Endpoint::Port(2), t0);
        assert_eq!(f.lookup(&key(5), t0), Some(Endpoint::Port(2)));
        let later = t0 + Duration::from_secs(11);
        f.learn(key(FDB_MAX + 50), Endpoint::Port(3), later);
        assert_eq!(f.lookup(&key(FDB_MAX + 50), later), Some(Endpoint::Port(3)));
    }

    #[test]
    fn multicast_sources_are_not_learned() {
        let t0 = Instant::now();
        let mut f = Fdb::new(Duration::from_secs(10));
        let m = [1, 0, 0x5e, 0, 0, 1];
        f.learn((None, m), Endpoint::Port(0), t0);
        assert_eq!(f.lookup(&(None, m), t0), None);
    }

    #[test]
    fn same_mac_in_two_vlans_is_two_addresses() {
        let t0 = Instant::now();
        let mut f = Fdb::new(Duration::from_secs(10));
        let a = [2, 0, 0, 0, 0, 1];
        let (v10, v20) = (Vid::new(10), Vid::new(20));
        f.learn((v10, a), Endpoint::Port(0), t0);
        f.learn((v20, a), Endpoint::Uplink(0), t0);
        assert_eq!(f.lookup(&(v10, a), t0), Some(Endpoint::Port(0)));
        assert_eq!(f.lookup(&(v20, a), t0), Some(Endpoint::Uplink(0)));
        assert_eq!(f.lookup(&(None, a), t0), None);
    }

    #[test]
    fn classify_by_attachment_and_tag() {
        let v = |n| Vid::new(n).unwrap();
        let access = [v(10), v(20)];
        let c = |at, tag| classify(at, tag, &access);
        let vlan = |n, tagged| {
            Ok(Ingress {
                domain: Vid::new(n),
                tagged,
            })
        };
        assert_eq!(c(Attach::Access(v(10)), Tag::Untagged), vlan(10, false));
        for t in [Tag::Dot1q(10), Tag::Dot1q(0), Tag::Other] {
            assert_eq!(c(Attach::Access(v(10)), t), Err("tagged_on_access_port"));
        }
        assert_eq!(c(Attach::Access(v(10)), Tag::Short), Err("too_short"));
        assert_eq!(c(Attach::Untagged, Tag::Untagged), Ok(Ingress::UNTAGGED));
        assert_eq!(c(Attach::Untagged, Tag::Dot1q(30)), Ok(Ingress::UNTAGGED));
        assert_eq!(c(Attach::Untagged, Tag::Other), Ok(Ingress::UNTAGGED));
        assert_eq!(
            c(Attach::Untagged, Tag::Dot1q(20)),
            Err("tagged_with_access_vlan")
        );
        assert_eq!(c(Attach::Trunk, Tag::Dot1q(20)), vlan(20, true));
        assert_eq!(c(Attach::Trunk, Tag::Dot1q(30)), Ok(Ingress::UNTAGGED));
        assert_eq!(c(Attach::Trunk, Tag::Dot1q(0)), Ok(Ingress::UNTAGGED));
        assert_eq!(c(Attach::Trunk, Tag::Other), Ok(Ingress::UNTAGGED));
        assert_eq!(c(Attach::Trunk, Tag::Untagged), Ok(Ingress::UNTAGGED));
    }
}

#[cfg(test)]
mod vlan_forwarding {
    //! The switch with unconnected-queue ports (every delivery attempt shows up as an
    //! `rx_queue_full` drop on the port) and an uplink that records what it is sent.
    use super::*;
    use crate::config::{GsoMode, PortConfig};
    use crate::vnet_hdr::{GsoKind, GsoType, F_NEEDS_CSUM};

    #[derive(Default)]
    struct Recorder {
        sent: Mutex<Vec<(VirtioNetHdr, Vec<u8>)>>,
        stats: Counters,
    }

    impl Recorder {
        fn take(&self) -> Vec<(VirtioNetHdr, Vec<u8>)> {
            std::mem::take(&mut *self.sent.lock().unwrap())
        }
    }

    impl Destination for Recorder {
        fn caps(&self) -> Caps {
            Caps::ALL
        }
        fn max_burst(&self) -> Option<usize> {
            None
        }
        fn send(
            &self,
            _: usize,
            hdr: &VirtioNetHdr,
            parts: &[&[u8]],
            _: &mut Pending,
        ) -> Result<(), &'static str> {
            self.sent.lock().unwrap().push((*hdr, parts.concat()));
            Ok(())
        }
        fn stats(&self) -> &Counters {
            &self.stats
        }
    }

    impl Uplink for Recorder {
        fn name(&self) -> String {
            "recorder".into()
        }
        fn as_destination(&self) -> &dyn Destination {
            self
        }
        fn set_rx_offload(&self, caps: Caps) -> Result<Caps, String> {
            Ok(caps)
        }
        fn stats(&self) -> &Counters {
            &self.stats
        }
        fn gso_mode(&self) -> GsoMode {
            GsoMode::Pass
        }
        fn set_gso_mode(&self, _: GsoMode) {}
        fn set_max_burst(&self, _: Option<usize>) {}
        fn start(self: Arc<Self>, _: usize, _: Arc<Switch>) -> std::io::Result<()> {
            Ok(())
        }
    }

    const P10A: usize = 0;
    const P10B: usize = 1;
    const P20: usize = 2;
    const UNTAGGED: usize = 3;

    /// Ports: two on VLAN 10, one on VLAN 20, one untagged; one recording uplink.
    fn setup() -> (Switch, Arc<Recorder>) {
        let ports = ["vlan=10", "vlan=10", "vlan=20", ""]
            .iter()
            .enumerate()
            .map(|(i, extra)| {
                let cfg = PortConfig::parse(&format!("socket=p{i},{extra}")).unwrap();
                let p = Arc::new(Port::new(i, cfg));
                p.set_connected(true);
                p
            })
            .collect();
        let up = Arc::new(Recorder::default());
        let uplinks: Vec<Arc<dyn Uplink>> = vec![up.clone()];
        (Switch::new(ports, uplinks, Duration::from_secs(60)), up)
    }

    /// Delivery attempts per port since the last call (`seen`: the totals then).
    fn attempts(sw: &Switch, seen: &mut [u64; 4]) -> [u64; 4] {
        let mut out = [0; 4];
        for (i, p) in sw.ports().iter().enumerate() {
            let n = drops(&p.stats, "rx_queue_full");
            out[i] = n - seen[i];
            seen[i] = n;
        }
        out
    }

    fn mac(n: u8) -> Mac {
        [2, 0, 0, 0, 0, n]
    }

    /// An IPv4/TCP-looking frame, optionally tagged (VID `vid`, priority 5).
    fn frame(dst: Mac, src: Mac, vid: Option<u16>) -> Vec<u8> {
        let mut f = [dst, src].concat();
        if let Some(v) = vid {
            f.extend_from_slice(&[0x81, 0x00]);
            f.extend_from_slice(&(0xa000 | v).to_be_bytes());
        }
        f.extend_from_slice(&[0x08, 0x00]);
        f.extend((0..80u8).map(|i| i.wrapping_mul(3)));
        f
    }

    fn send(sw: &Switch, src: Endpoint, bytes: &[u8], hdr: VirtioNetHdr) {
        let parts = [&bytes[..7], &bytes[7..15], &bytes[15..]];
        let f = Frame {
            hdr,
            parts: &parts,
            len: bytes.len(),
        };
        sw.forward(src, 0, &f, &mut DeliverCtx::default());
    }

    fn plain(sw: &Switch, src: Endpoint, bytes: &[u8]) {
        send(sw, src, bytes, VirtioNetHdr::default());
    }

    fn drops(c: &Counters, reason: &str) -> u64 {
        c.snapshot().drops.get(reason).copied().unwrap_or(0)
    }

    #[test]
    fn broadcasts_stay_in_their_vlan() {
        let (sw, up) = setup();
        let mut seen = [0; 4];
        let bc = [0xff; 6];
        plain(&sw, Endpoint::Port(P10A), &frame(bc, mac(1), None));
        assert_eq!(attempts(&sw, &mut seen), [0, 1, 0, 0]);
        let got = up.take();
        assert_eq!(got.len(), 1);
        let mut want = frame(bc, mac(1), Some(10));
        want[14] &= 0x0f; // inserted with priority 0
        assert_eq!(got[0].1, want);

        plain(&sw, Endpoint::Port(P20), &frame(bc, mac(2), None));
        assert_eq!(attempts(&sw, &mut seen), [0, 0, 0, 0]);
        assert_eq!(vlan::tag(&[&up.take()[0].1]), Tag::Dot1q(20));

        plain(&sw, Endpoint::Port(UNTAGGED), &frame(bc, mac(3), None));
        assert_eq!(attempts(&sw, &mut seen), [0, 0, 0, 0]);
        assert_eq!(up.take()[0].1, frame(bc, mac(3), None));

        // From the trunk: VLAN 10 to both VLAN-10 ports, an unknown VID and untagged
        // frames to the untagged domain only.
        plain(&sw, Endpoint::Uplink(0), &frame(bc, mac(4), Some(10)));
        assert_eq!(attempts(&sw, &mut seen), [1, 1, 0, 0]);
        plain(&sw, Endpoint::Uplink(0), &frame(bc, mac(4), Some(20)));
        assert_eq!(attempts(&sw, &mut seen), [0, 0, 1, 0]);
        plain(&sw, Endpoint::Uplink(0), &frame(bc, mac(4), Some(30)));
        assert_eq!(attempts(&sw, &mut seen), [0, 0, 0, 1]);
        plain(&sw, Endpoint::Uplink(0), &frame(bc, mac(4), None));
        assert_eq!(attempts(&sw, &mut seen), [0, 0, 0, 1]);
        assert!(up.take().is_empty(), "hairpin to the uplink");
    }

    #[test]
    fn tagged_frames_from_guests_are_dropped_where_they_would_leak() {
        let (sw, up) = setup();
        let mut seen = [0; 4];
        let bc = [0xff; 6];
        plain(&sw, Endpoint::Port(P10A), &frame(bc, mac(1), Some(10)));
        plain(&sw, Endpoint::Port(P10A), &frame(bc, mac(1), Some(20)));
        plain(&sw, Endpoint::Port(UNTAGGED), &frame(bc, mac(3), Some(20)));
        assert_eq!(attempts(&sw, &mut seen), [0, 0, 0, 0]);
        assert!(up.take().is_empty());
        assert_eq!(drops(&sw.ports()[P10A].stats, "tagged_on_access_port"), 2);
        assert_eq!(
            drops(&sw.ports()[UNTAGGED].stats, "tagged_with_access_vlan"),
            1
        );
        // A VID no access port uses stays the untagged guest's business.
        plain(&sw, Endpoint::Port(UNTAGGED), &frame(bc, mac(3), Some(30)));
        assert_eq!(up.take().len(), 1);
    }

    #[test]
    fn learning_is_per_vlan() {
        let (sw, up) = setup();
        let mut seen = [0; 4];
        let x = mac(9);
        // X answers from the trunk in VLAN 10.
        plain(&sw, Endpoint::Uplink(0), &frame([0xff; 6], x, Some(10)));
        attempts(&sw, &mut seen);
        // VLAN 10 finds X on the uplink: unicast, tagged, no flood to the other port.
        plain(&sw, Endpoint::Port(P10A), &frame(x, mac(1), None));
        assert_eq!(attempts(&sw, &mut seen), [0, 0, 0, 0]);
        assert_eq!(vlan::tag(&[&up.take()[0].1]), Tag::Dot1q(10));
        // The untagged domain has not seen X: flooded there (uplink and nobody else).
        plain(&sw, Endpoint::Port(UNTAGGED), &frame(x, mac(3), None));
        assert_eq!(attempts(&sw, &mut seen), [0, 0, 0, 0]);
        assert_eq!(up.take()[0].1, frame(x, mac(3), None));
        // X moving to a VLAN-10 port moves it in VLAN 10 only.
        plain(&sw, Endpoint::Port(P10B), &frame([0xff; 6], x, None));
        attempts(&sw, &mut seen);
        up.take();
        plain(&sw, Endpoint::Port(P10A), &frame(x, mac(1), None));
        assert_eq!(attempts(&sw, &mut seen), [0, 1, 0, 0]);
        assert!(up.take().is_empty());
        // A pinned-less VLAN-20 guest asking for X floods in VLAN 20.
        plain(&sw, Endpoint::Port(P20), &frame(x, mac(2), None));
        assert_eq!(attempts(&sw, &mut seen), [0, 0, 0, 0]);
        assert_eq!(up.take().len(), 1);
    }

    #[test]
    fn gso_headers_follow_the_tag() {
        let (sw, up) = setup();
        let mut seen = [0; 4];
        let hdr = VirtioNetHdr {
            flags: F_NEEDS_CSUM,
            gso: GsoType::new(GsoKind::TcpV4),
            hdr_len: 54,
            gso_size: 1448,
            csum_start: 34,
            csum_offset: 16,
            num_buffers: 1,
        };
        send(
            &sw,
            Endpoint::Port(P10A),
            &frame([0xff; 6], mac(1), None),
            hdr,
        );
        let (h, _) = up.take().remove(0);
        assert_eq!((h.csum_start, h.hdr_len, h.gso_size), (38, 58, 1448));
        assert_eq!(h.gso.kind, GsoKind::TcpV4);
        // A frame whose checksum would start inside the tag cannot be untagged.
        let bad = VirtioNetHdr {
            csum_start: 14,
            ..hdr
        };
        send(
            &sw,
            Endpoint::Uplink(0),
            &frame([0xff; 6], mac(4), Some(10)),
            bad,
        );
        assert_eq!(attempts(&sw, &mut seen), [0, 0, 0, 0]);
        assert_eq!(drops(&up.stats, "vlan_bad_offsets"), 1);
    }
}

//! The L2 learning switch joining all ports and uplinks of one gsonet: learns source
//! MACs per VLAN, forwards known unicast to one endpoint, floods the rest within the
//! frame's VLAN, never hairpins. Access ports (`vlan=N`) see their VLAN untagged;
//! uplinks are trunks and see it tagged. Forwarding is two steps: `route` (learn,
//! classify, build the views each kind of destination needs) and `send` (deliver),
//! so a retry re-delivers without routing again.

pub mod backpressure;
pub mod deliver;
pub mod fdb;
pub mod vlan;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tracing::warn;

use crate::features::Caps;
use crate::frame::Frame;
use crate::l2::{Domain, Mac, Vid};
use crate::stats::{Counters, DropReason};
use backpressure::RxRoom;
use deliver::{deliver, DeliverCtx, Destination, OnFull, Outcome};
use fdb::Fdb;
use vlan::{classify, Attach, Ingress, ViewBuf};

/// Where a frame came from or goes to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Endpoint {
    Port(usize),
    Uplink(usize),
}

/// What the switch needs of a guest port.
pub trait SwitchPort: Destination + Send + Sync {
    /// Its access VLAN; `None`: the untagged domain.
    fn vlan(&self) -> Option<Vid>;
    fn is_connected(&self) -> bool;
    /// What its guest accepts, if a guest is there.
    fn rx_caps(&self) -> Option<Caps>;
    /// Signals the guest for RX queue `queue` if its ring asks for it.
    fn signal_rx(&self, queue: usize);
}

/// What the switch needs of an uplink.
pub trait SwitchUplink: Destination + Send + Sync {
    /// `kind=NAME`, as on the command line.
    fn name(&self) -> String;
    /// Tells the device which offloads the guests behind it accept, so it hands us
    /// frames no larger than needed; returns what it applied.
    fn set_rx_offload(&self, caps: Caps) -> Result<Caps, String>;
}

pub struct Switch {
    ports: Vec<Arc<dyn SwitchPort>>,
    uplinks: Vec<Arc<dyn SwitchUplink>>,
    fdb: Mutex<Fdb>,
    /// The ports' access VLANs, sorted: a tagged uplink frame with one of these VIDs
    /// belongs to that VLAN; any other uplink frame to the untagged domain.
    access: Vec<Vid>,
    rx_room: RxRoom,
    /// What the uplinks were last programmed with.
    programmed: Mutex<Option<Caps>>,
}

/// Where one frame goes, decided once: its source, its destination (or none: flood
/// within `domain`) and the view of it each kind of destination gets.
pub struct Route<'a> {
    src: Endpoint,
    known: Option<Endpoint>,
    domain: Domain,
    for_ports: Option<Frame<'a>>,
    for_uplinks: Option<Frame<'a>>,
}

impl<'a> Route<'a> {
    /// The one destination of a known unicast frame.
    pub fn unicast(&self) -> Option<Endpoint> {
        self.known
    }

    /// The view of the frame destination `e` gets.
    pub fn view(&self, e: Endpoint) -> Option<&Frame<'a>> {
        match e {
            Endpoint::Port(_) => self.for_ports.as_ref(),
            Endpoint::Uplink(_) => self.for_uplinks.as_ref(),
        }
    }
}

impl Switch {
    pub fn new(
        ports: Vec<Arc<dyn SwitchPort>>,
        uplinks: Vec<Arc<dyn SwitchUplink>>,
        aging: Duration,
    ) -> Switch {
        let mut access: Vec<Vid> = ports.iter().filter_map(|p| p.vlan()).collect();
        access.sort_unstable();
        access.dedup();
        Switch {
            ports,
            uplinks,
            fdb: Mutex::new(Fdb::new(aging)),
            access,
            rx_room: RxRoom::default(),
            programmed: Mutex::new(None),
        }
    }

    pub fn rx_room(&self) -> &RxRoom {
        &self.rx_room
    }

    fn attach(&self, e: Endpoint) -> Attach {
        match e {
            Endpoint::Port(i) => match self.ports.get(i).and_then(|p| p.vlan()) {
                Some(v) => Attach::Access(v),
                None => Attach::Untagged,
            },
            Endpoint::Uplink(_) => Attach::Trunk,
        }
    }

    /// Whether `e` takes part in `domain`: ports of that VLAN; uplinks always.
    fn in_domain(&self, e: Endpoint, domain: Domain) -> bool {
        match e {
            Endpoint::Port(i) => self.ports.get(i).is_some_and(|p| p.vlan() == domain),
            Endpoint::Uplink(i) => i < self.uplinks.len(),
        }
    }

    fn counters(&self, e: Endpoint) -> Option<&Counters> {
        match e {
            Endpoint::Port(i) => self.ports.get(i).map(|p| p.stats()),
            Endpoint::Uplink(i) => self.uplinks.get(i).map(|u| u.stats()),
        }
    }

    /// Counts a drop on endpoint `e`.
    pub fn count_drop(&self, e: Endpoint, reason: DropReason) {
        if let Some(c) = self.counters(e) {
            c.drop(reason);
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

    /// Routes one frame from `src`: classifies it into its VLAN, learns its source,
    /// looks up its destination and builds the tagged or untagged view the
    /// destinations need (`views` holds it). `None`: nowhere to go (dropped and
    /// counted at the source, or a hairpin).
    pub fn route<'a>(
        &self,
        src: Endpoint,
        frame: &Frame<'a>,
        views: &'a mut ViewBuf<'a>,
    ) -> Option<Route<'a>> {
        let ingress = if self.access.is_empty() {
            Ingress::UNTAGGED
        } else {
            match classify(self.attach(src), frame.tag, &self.access) {
                Ok(i) => i,
                Err(reason) => {
                    self.count_drop(src, reason);
                    return None;
                }
            }
        };
        let domain = ingress.domain;
        let now = Instant::now();
        let known = {
            let mut fdb = self.fdb.lock().unwrap_or_else(|e| e.into_inner());
            fdb.learn((domain, frame.src), src, now);
            if frame.dst.is_multicast() {
                None
            } else {
                fdb.lookup(&(domain, frame.dst), now)
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
        let retagged = match (domain, ingress.tagged) {
            (Some(vid), false) if to_uplinks => Some(vlan::push(frame, vid, views)),
            (Some(_), true) if to_ports => Some(vlan::pop(frame, views)),
            _ => None,
        };
        let retagged = match retagged.transpose() {
            Ok(r) => r,
            Err(reason) => {
                self.count_drop(src, reason);
                return None;
            }
        };
        let (for_ports, for_uplinks) = match (domain, ingress.tagged) {
            (None, _) => (Some(*frame), Some(*frame)),
            (Some(_), false) => (Some(*frame), retagged),
            (Some(_), true) => (retagged, Some(*frame)),
        };
        Some(Route {
            src,
            known,
            domain,
            for_ports,
            for_uplinks,
        })
    }

    /// Delivers a routed frame through queue `queue`. For a known unicast
    /// destination, returns how it went; a flood is never retried, so its full
    /// queues are always counted.
    pub fn send(
        &self,
        route: &Route,
        queue: usize,
        ctx: &mut DeliverCtx,
        on_full: OnFull,
    ) -> Option<Outcome> {
        match route.known {
            Some(dst) => route
                .view(dst)
                .and_then(|f| self.deliver_to(dst, queue, f, ctx, on_full, 0)),
            None => {
                for e in self.flood_targets(route.src, route.domain) {
                    if let Some(f) = route.view(e) {
                        self.deliver_to(e, queue, f, ctx, OnFull::Count, 0);
                    }
                }
                None
            }
        }
    }

    /// Routes and delivers one frame from `src` (arriving on its queue `queue`);
    /// nothing waits for a full RX queue.
    pub fn forward(&self, src: Endpoint, queue: usize, frame: &Frame, ctx: &mut DeliverCtx) {
        let mut views = ViewBuf::default();
        if let Some(route) = self.route(src, frame, &mut views) {
            self.send(&route, queue, ctx, OnFull::Count);
        }
    }

    /// Delivers `frame` (the view for `dst`) to the one destination `dst`, skipping
    /// the first `skip` frames an earlier attempt delivered.
    pub fn deliver_to(
        &self,
        dst: Endpoint,
        queue: usize,
        frame: &Frame,
        ctx: &mut DeliverCtx,
        on_full: OnFull,
        skip: usize,
    ) -> Option<Outcome> {
        match dst {
            Endpoint::Port(i) => {
                let port = self.ports.get(i)?;
                let out = deliver(
                    frame,
                    port.as_ref(),
                    queue,
                    &mut ctx.segmenter,
                    on_full,
                    skip,
                );
                if out.sent > skip {
                    ctx.pending.rx_written(port, queue);
                }
                Some(out)
            }
            Endpoint::Uplink(i) => {
                let up = self.uplinks.get(i)?;
                Some(deliver(
                    frame,
                    up.as_ref(),
                    queue,
                    &mut ctx.segmenter,
                    on_full,
                    skip,
                ))
            }
        }
    }

    /// Sends frames for `mac` to port `id` from the start.
    pub fn pin_mac(&self, mac: Mac, id: usize) {
        let domain = self.ports.get(id).and_then(|p| p.vlan());
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
    /// Devices are programmed only when the union changes, so a guest resetting its
    /// device in a loop costs no ioctls.
    pub fn caps_changed(&self) {
        let union = self
            .ports
            .iter()
            .filter_map(|p| p.rx_caps())
            .fold(Caps::default(), Caps::or);
        {
            let mut last = self.programmed.lock().unwrap_or_else(|e| e.into_inner());
            if *last == Some(union) {
                return;
            }
            *last = Some(union);
        }
        for u in &self.uplinks {
            if let Err(e) = u.set_rx_offload(union) {
                warn!(uplink = %u.name(), "cannot program uplink offloads: {e}");
            }
        }
    }

    /// Some guest added RX buffers: senders holding a frame try again.
    pub fn rx_space(&self) {
        self.rx_room.added();
    }
}

#[cfg(test)]
mod vlan_forwarding {
    //! The switch with recording ports and a recording uplink: every delivery
    //! attempt shows up in the recorder of its destination.
    use super::*;
    use crate::l2::{Tag, ETHERTYPE_VLAN};
    use crate::testkit::frames::{ethernet, pattern};
    use crate::vnet_hdr::{GsoKind, GsoType, VirtioNetHdr, F_NEEDS_CSUM};

    #[derive(Default)]
    struct Recorder {
        vlan: Option<Vid>,
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
        fn send(&self, _: usize, hdr: &VirtioNetHdr, parts: &[&[u8]]) -> Result<(), DropReason> {
            self.sent.lock().unwrap().push((*hdr, parts.concat()));
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
        fn is_connected(&self) -> bool {
            true
        }
        fn rx_caps(&self) -> Option<Caps> {
            Some(Caps::ALL)
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

    struct Net {
        sw: Switch,
        ports: Vec<Arc<Recorder>>,
        up: Arc<Recorder>,
    }

    const P10A: usize = 0;
    const P10B: usize = 1;
    const P20: usize = 2;
    const UNTAGGED: usize = 3;

    /// Ports: two on VLAN 10, one on VLAN 20, one untagged; one recording uplink.
    fn setup() -> Net {
        let ports: Vec<Arc<Recorder>> = [Vid::new(10), Vid::new(10), Vid::new(20), None]
            .into_iter()
            .map(|vlan| {
                Arc::new(Recorder {
                    vlan,
                    ..Recorder::default()
                })
            })
            .collect();
        let up = Arc::new(Recorder::default());
        let sw = Switch::new(
            ports
                .iter()
                .map(|p| p.clone() as Arc<dyn SwitchPort>)
                .collect(),
            vec![up.clone() as Arc<dyn SwitchUplink>],
            Duration::from_secs(60),
        );
        Net { sw, ports, up }
    }

    /// Delivery attempts per port since the last call.
    fn attempts(net: &Net) -> [usize; 4] {
        let mut out = [0; 4];
        for (i, p) in net.ports.iter().enumerate() {
            out[i] = p.take().len();
        }
        out
    }

    fn mac(n: u8) -> Mac {
        Mac([2, 0, 0, 0, 0, n])
    }

    /// An IPv4-looking frame, optionally tagged (VID `vid`, priority 5).
    fn frame(dst: Mac, src: Mac, vid: Option<u16>) -> Vec<u8> {
        let tag = vid.map(|v| (ETHERTYPE_VLAN, 0xa000 | v));
        ethernet(dst.0, src.0, tag.as_slice(), 0x0800, &pattern(80))
    }

    fn send(net: &Net, src: Endpoint, bytes: &[u8], hdr: VirtioNetHdr) {
        let parts = [bytes];
        let f = Frame::new(hdr, &parts, None).unwrap();
        net.sw.forward(src, 0, &f, &mut DeliverCtx::default());
    }

    fn plain(net: &Net, src: Endpoint, bytes: &[u8]) {
        send(net, src, bytes, VirtioNetHdr::default());
    }

    fn tag_of(bytes: &[u8]) -> Tag {
        Tag::read(bytes)
    }

    #[test]
    fn broadcasts_stay_in_their_vlan() {
        let net = setup();
        let bc = Mac::BROADCAST;
        plain(&net, Endpoint::Port(P10A), &frame(bc, mac(1), None));
        assert_eq!(attempts(&net), [0, 1, 0, 0]);
        let got = net.up.take();
        assert_eq!(got.len(), 1);
        let mut want = frame(bc, mac(1), Some(10));
        want[14] &= 0x0f; // inserted with priority 0
        assert_eq!(got[0].1, want);

        plain(&net, Endpoint::Port(P20), &frame(bc, mac(2), None));
        assert_eq!(attempts(&net), [0, 0, 0, 0]);
        assert_eq!(tag_of(&net.up.take()[0].1), Tag::Dot1q(20));

        plain(&net, Endpoint::Port(UNTAGGED), &frame(bc, mac(3), None));
        assert_eq!(attempts(&net), [0, 0, 0, 0]);
        assert_eq!(net.up.take()[0].1, frame(bc, mac(3), None));

        // From the trunk: VLAN 10 to both VLAN-10 ports, an unknown VID and untagged
        // frames to the untagged domain only.
        plain(&net, Endpoint::Uplink(0), &frame(bc, mac(4), Some(10)));
        assert_eq!(attempts(&net), [1, 1, 0, 0]);
        plain(&net, Endpoint::Uplink(0), &frame(bc, mac(4), Some(20)));
        assert_eq!(attempts(&net), [0, 0, 1, 0]);
        plain(&net, Endpoint::Uplink(0), &frame(bc, mac(4), Some(30)));
        assert_eq!(attempts(&net), [0, 0, 0, 1]);
        plain(&net, Endpoint::Uplink(0), &frame(bc, mac(4), None));
        assert_eq!(attempts(&net), [0, 0, 0, 1]);
        assert!(net.up.take().is_empty(), "hairpin to the uplink");
    }

    #[test]
    fn tagged_frames_from_guests_are_dropped_where_they_would_leak() {
        let net = setup();
        let bc = Mac::BROADCAST;
        plain(&net, Endpoint::Port(P10A), &frame(bc, mac(1), Some(10)));
        plain(&net, Endpoint::Port(P10A), &frame(bc, mac(1), Some(20)));
        plain(&net, Endpoint::Port(UNTAGGED), &frame(bc, mac(3), Some(20)));
        assert_eq!(attempts(&net), [0, 0, 0, 0]);
        assert!(net.up.take().is_empty());
        assert_eq!(
            net.ports[P10A].stats.drops(DropReason::TaggedOnAccessPort),
            2
        );
        assert_eq!(
            net.ports[UNTAGGED]
                .stats
                .drops(DropReason::TaggedWithAccessVlan),
            1
        );
        // A VID no access port uses stays the untagged guest's business.
        plain(&net, Endpoint::Port(UNTAGGED), &frame(bc, mac(3), Some(30)));
        assert_eq!(net.up.take().len(), 1);
    }

    #[test]
    fn learning_is_per_vlan() {
        let net = setup();
        let x = mac(9);
        // X answers from the trunk in VLAN 10.
        plain(
            &net,
            Endpoint::Uplink(0),
            &frame(Mac::BROADCAST, x, Some(10)),
        );
        attempts(&net);
        // VLAN 10 finds X on the uplink: unicast, tagged, no flood to the other port.
        plain(&net, Endpoint::Port(P10A), &frame(x, mac(1), None));
        assert_eq!(attempts(&net), [0, 0, 0, 0]);
        assert_eq!(tag_of(&net.up.take()[0].1), Tag::Dot1q(10));
        // The untagged domain has not seen X: flooded there (uplink and nobody else).
        plain(&net, Endpoint::Port(UNTAGGED), &frame(x, mac(3), None));
        assert_eq!(attempts(&net), [0, 0, 0, 0]);
        assert_eq!(net.up.take()[0].1, frame(x, mac(3), None));
        // X moving to a VLAN-10 port moves it in VLAN 10 only.
        plain(&net, Endpoint::Port(P10B), &frame(Mac::BROADCAST, x, None));
        attempts(&net);
        net.up.take();
        plain(&net, Endpoint::Port(P10A), &frame(x, mac(1), None));
        assert_eq!(attempts(&net), [0, 1, 0, 0]);
        assert!(net.up.take().is_empty());
        // A pinned-less VLAN-20 guest asking for X floods in VLAN 20.
        plain(&net, Endpoint::Port(P20), &frame(x, mac(2), None));
        assert_eq!(attempts(&net), [0, 0, 0, 0]);
        assert_eq!(net.up.take().len(), 1);
    }

    #[test]
    fn gso_headers_follow_the_tag() {
        let net = setup();
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
            &net,
            Endpoint::Port(P10A),
            &frame(Mac::BROADCAST, mac(1), None),
            hdr,
        );
        let (h, _) = net.up.take().remove(0);
        attempts(&net);
        assert_eq!((h.csum_start, h.hdr_len, h.gso_size), (38, 58, 1448));
        assert_eq!(h.gso.kind, GsoKind::TcpV4);
        // A frame whose checksum would start inside the tag cannot be untagged.
        let bad = VirtioNetHdr {
            csum_start: 14,
            ..hdr
        };
        send(
            &net,
            Endpoint::Uplink(0),
            &frame(Mac::BROADCAST, mac(4), Some(10)),
            bad,
        );
        assert_eq!(attempts(&net), [0, 0, 0, 0]);
        assert_eq!(net.up.stats.drops(DropReason::VlanBadOffsets), 1);
    }
}

//! The L2 learning switch joining all ports and uplinks of one gsonet: learns source
//! MACs per VLAN (each port and uplink within its own quota), forwards known unicast
//! to one endpoint, floods the rest within the frame's VLAN, never hairpins. Access
//! ports (`vlan=N`) see their VLAN untagged; trunk ports (`trunk=on`) and uplinks see
//! VLANs tagged; untagged ports send untagged frames only. Port security (`mac_lock`,
//! pinned `mac=`, counted and rate-limited moves) is enforced before learning.
//! Forwarding is two steps: `route` (check, classify, learn, build the views each
//! kind of destination needs) and `send` (deliver), so a retry re-delivers without
//! routing again.

pub mod backpressure;
pub mod deliver;
pub mod fdb;
pub mod memo;
pub mod run;
pub mod stable;
pub mod vlan;
pub mod write_batch;

use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering::{Acquire, Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use arc_swap::{ArcSwap, Guard};

use tracing::warn;

use crate::config::PORT_MAC_LIMIT;
use crate::features::Caps;
use crate::frame::Frame;
use crate::l2::{Domain, Mac, Tag, Vid, VlanSet};
use crate::stats::{Counters, DropReason};
use crate::vnet_hdr::VirtioNetHdr;
use backpressure::RxRoom;
use deliver::{deliver, Again, DeliverCtx, Destination, OnFull, Outcome, FIRST};
use fdb::{Fdb, FdbMemo, Learned, MemoKey, UPLINK_MAC_LIMIT};
use memo::{JoinAt, JoinKey, Joined};
use run::{Run, RunFrame, Stable};
use vlan::{classify, Attach, ViewBuf};

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
    /// `trunk=on`: the VLANs its guest sends and receives tagged, besides the
    /// untagged domain. `None`: it sends untagged frames only.
    fn trunk(&self) -> Option<VlanSet> {
        None
    }
    /// Its configured address (`mac=`): pinned to it, never moved by learning.
    fn mac(&self) -> Option<Mac> {
        None
    }
    /// Port security: frames from any source address but `mac()` are dropped.
    fn mac_lock(&self) -> bool {
        false
    }
    /// Most addresses the switch learns on it at once.
    fn mac_limit(&self) -> usize {
        PORT_MAC_LIMIT
    }
    fn is_connected(&self) -> bool;
    /// What its guest accepts, if a guest is there.
    fn rx_caps(&self) -> Option<Caps>;
    /// Signals the guest for RX queue `queue` if its ring asks for it.
    fn signal_rx(&self, queue: usize);
    /// A clean stop: write no ring again, once the writes in progress are done.
    fn quiesce(&self) {}
}

/// What the switch needs of an uplink.
pub trait SwitchUplink: Destination + Send + Sync {
    /// `kind=NAME`, as on the command line.
    fn name(&self) -> String;
    /// Tells the device which offloads the guests behind it accept, so it hands us
    /// frames no larger than needed; returns what it applied.
    fn set_rx_offload(&self, caps: Caps) -> Result<Caps, String>;
    /// Most addresses the switch learns behind it at once.
    fn mac_limit(&self) -> usize {
        UPLINK_MAC_LIMIT
    }
    /// A sender that wrote to its queue `queue` ends its batch and offers its thread
    /// to read what came back on that queue (see `uplink::reader::reap`).
    fn reap(&self, _queue: usize) {}
    /// Whether the calling thread now serves queue `queue`: it polls `queue_fd` with
    /// its own fds, calls `serve` when it is readable, and `disown` when it stops or
    /// `serve` says so; the uplink's reader thread waits meanwhile (`uplink::reader`).
    fn own(&self, _queue: usize) -> bool {
        false
    }
    fn queue_fd(&self, _queue: usize) -> Option<std::os::fd::BorrowedFd<'_>> {
        None
    }
    /// The header to write before a frame sent with `hdr` when a sender batches its
    /// writes here: one writev of header and frame to `queue_fd` (`write_batch`).
    /// None: it takes frames only one at a time, through `send`.
    fn batched_header(&self, _hdr: &VirtioNetHdr) -> Option<write_batch::WireHdr> {
        None
    }
    /// Reads and forwards what the owned queue holds; false: let go of it now.
    fn serve(&self, _queue: usize) -> bool {
        false
    }
    fn disown(&self, _queue: usize) {}
}

/// A port's place in the switch, read once from its configuration.
#[derive(Clone)]
struct PortRole {
    vlan: Option<Vid>,
    trunk: Option<VlanSet>,
    mac: Option<Mac>,
    mac_lock: bool,
}

impl PortRole {
    fn of(p: &dyn SwitchPort) -> PortRole {
        PortRole {
            vlan: p.vlan(),
            trunk: p.trunk(),
            mac: p.mac(),
            mac_lock: p.mac_lock(),
        }
    }

    /// The domains the port takes part in: its access VLAN (or the untagged domain)
    /// and its trunk's VLANs.
    fn domains(&self) -> impl Iterator<Item = Domain> + '_ {
        std::iter::once(self.vlan).chain(self.trunk.iter().flat_map(|t| t.iter().map(Some)))
    }
}

#[derive(Clone)]
struct PortSlot {
    id: usize,
    port: Arc<dyn SwitchPort>,
    role: PortRole,
}

#[derive(Clone)]
struct UplinkSlot {
    id: usize,
    uplink: Arc<dyn SwitchUplink>,
}

/// The ports and uplinks of the switch at one moment, sorted by id. Frames read it
/// without a lock (`ArcSwap`); a change builds a new one and swaps it in, so a frame
/// being routed keeps the set it started with.
struct Topology {
    /// Unique to this set in the process: what a sender's `JoinMemo` names it by.
    serial: u64,
    ports: Vec<PortSlot>,
    uplinks: Vec<UplinkSlot>,
    /// Every VLAN some port uses (access VLANs and trunk ports' allowed VIDs),
    /// sorted: a tagged uplink frame with one of these VIDs belongs to that VLAN; any
    /// other uplink frame to the untagged domain.
    vlans: Vec<Vid>,
}

impl Topology {
    fn new(mut ports: Vec<PortSlot>, mut uplinks: Vec<UplinkSlot>) -> Topology {
        ports.sort_by_key(|p| p.id);
        uplinks.sort_by_key(|u| u.id);
        let mut used = VlanSet::default();
        for p in &ports {
            for v in p.role.domains().flatten() {
                used.insert(v);
            }
        }
        static SERIALS: AtomicU64 = AtomicU64::new(0);
        Topology {
            serial: SERIALS.fetch_add(1, Relaxed),
            ports,
            uplinks,
            vlans: used.iter().collect(),
        }
    }

    /// Where port `id` is in `ports`.
    fn port_slot(&self, id: usize) -> Option<usize> {
        self.ports.binary_search_by_key(&id, |p| p.id).ok()
    }

    fn port(&self, id: usize) -> Option<&PortSlot> {
        Some(&self.ports[self.port_slot(id)?])
    }

    fn uplink(&self, id: usize) -> Option<&UplinkSlot> {
        let i = self.uplinks.binary_search_by_key(&id, |u| u.id).ok()?;
        Some(&self.uplinks[i])
    }

    fn role(&self, id: usize) -> Option<&PortRole> {
        self.port(id).map(|p| &p.role)
    }

    fn has(&self, e: Endpoint) -> bool {
        match e {
            Endpoint::Port(i) => self.port(i).is_some(),
            Endpoint::Uplink(i) => self.uplink(i).is_some(),
        }
    }

    /// Whether a one-copy frame from `src` goes on as it is (its views are the frame
    /// itself): `forward` makes it whole first otherwise.
    fn untagged_source(&self, src: Endpoint) -> bool {
        matches!(self.attach(src), Attach::Untagged)
    }

    fn attach(&self, e: Endpoint) -> Attach<'_> {
        match e {
            Endpoint::Port(i) => match self.role(i) {
                Some(PortRole { trunk: Some(t), .. }) => Attach::TrunkPort(t),
                Some(PortRole { vlan: Some(v), .. }) => Attach::Access(*v),
                _ => Attach::Untagged,
            },
            Endpoint::Uplink(_) => Attach::Trunk,
        }
    }

    fn is_trunk_port(&self, e: Endpoint) -> bool {
        match e {
            Endpoint::Port(i) => self.role(i).is_some_and(|r| r.trunk.is_some()),
            Endpoint::Uplink(_) => false,
        }
    }

    /// Whether `e` carries VLANs tagged: uplinks and trunk ports.
    fn sees_tags(&self, e: Endpoint) -> bool {
        matches!(e, Endpoint::Uplink(_)) || self.is_trunk_port(e)
    }

    /// Whether `e` takes part in `domain`: access ports of that VLAN, trunk ports that
    /// allow it, untagged and trunk ports for the untagged domain; uplinks always.
    fn in_domain(&self, e: Endpoint, domain: Domain) -> bool {
        match e {
            Endpoint::Port(i) => self.role(i).is_some_and(|r| match (&r.trunk, domain) {
                (Some(_), None) => true,
                (Some(t), Some(v)) => t.contains(v.get()),
                (None, d) => r.vlan == d,
            }),
            Endpoint::Uplink(i) => self.uplink(i).is_some(),
        }
    }

    /// Whether a frame of `domain` (`foreign`: carrying a tag no port uses) may go to
    /// `e`.
    fn reaches(&self, e: Endpoint, domain: Domain, foreign: bool) -> bool {
        self.in_domain(e, domain) && !(foreign && self.is_trunk_port(e))
    }

    fn counters(&self, e: Endpoint) -> Option<&Counters> {
        match e {
            Endpoint::Port(i) => self.port(i).map(|p| p.port.stats()),
            Endpoint::Uplink(i) => self.uplink(i).map(|u| u.uplink.stats()),
        }
    }

    /// Where a frame of `domain` from `src` is flooded: every other connected port of
    /// the domain and every other uplink.
    fn flood_targets(
        &self,
        src: Endpoint,
        domain: Domain,
        foreign: bool,
    ) -> impl Iterator<Item = Endpoint> + '_ {
        let ports = self
            .ports
            .iter()
            .filter(|p| p.port.is_connected())
            .map(|p| Endpoint::Port(p.id));
        let uplinks = self.uplinks.iter().map(|u| Endpoint::Uplink(u.id));
        ports
            .chain(uplinks)
            .filter(move |&e| e != src && self.reaches(e, domain, foreign))
    }
}

/// Ports and uplinks one switch holds at once at most: each port has its serving
/// thread, per-connection queue workers and up to `mac_limit` FDB entries, each
/// uplink a reader thread per queue and 8192 FDB entries, and a flood visits every
/// one of them. These keep the threads, the table (256 x 256 + 16 x 8192 entries at
/// the defaults) and the cost of one flood bounded.
pub const MAX_PORTS: usize = 256;
pub const MAX_UPLINKS: usize = 16;

/// Why a port or uplink could not be added to or removed from the switch.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MemberError {
    #[error("the switch holds {0} ports at most")]
    TooManyPorts(usize),
    #[error("the switch holds {0} uplinks at most")]
    TooManyUplinks(usize),
    #[error("{0:?} is already in the switch")]
    Taken(Endpoint),
    #[error("{0:?} is not in the switch")]
    Missing(Endpoint),
    #[error("{0:?} was used before: ids are never reused")]
    Reused(Endpoint),
}

/// Whether `e` may join `cur`: not there already, its id above every id given
/// before (`next`, moved past it), and its kind not `full`.
fn claim(
    cur: &Topology,
    e: Endpoint,
    next: &mut usize,
    full: Option<MemberError>,
) -> Result<(), MemberError> {
    let id = match e {
        Endpoint::Port(i) | Endpoint::Uplink(i) => i,
    };
    if cur.has(e) {
        return Err(MemberError::Taken(e));
    }
    if id < *next {
        return Err(MemberError::Reused(e));
    }
    if let Some(full) = full {
        return Err(full);
    }
    *next = id + 1;
    Ok(())
}

/// The switch. Endpoint ids are never reused within one process: a frame routed or
/// held for a port that is gone names an id nothing else will ever have, so it is
/// dropped, never delivered to a newcomer (the id is its own generation).
pub struct Switch {
    topo: ArcSwap<Topology>,
    /// Serialises changes of the topology, and holds the lowest port and uplink ids
    /// not used yet; frames never take it.
    change: Mutex<(usize, usize)>,
    fdb: Mutex<Fdb>,
    /// The FDB's change counter, read without its lock (`FdbMemo`).
    fdb_changes: Arc<AtomicU64>,
    rx_room: RxRoom,
    /// What the uplinks were last programmed with.
    programmed: Mutex<Option<Caps>>,
}

/// The topology a sender holds for one batch (`Switch::batch_topology`).
pub struct BatchTopology(Guard<Arc<Topology>>);

/// Where one frame goes, decided once: its source, its destination (or none: flood
/// within `domain`) and the view of it each kind of destination gets.
pub struct Route<'a> {
    topo: &'a Topology,
    src: Endpoint,
    known: Option<Endpoint>,
    domain: Domain,
    /// An untagged-domain frame carrying a tag no port uses (from an uplink): trunk
    /// ports, which take tagged frames of their allowed VLANs only, do not get it.
    foreign: bool,
    /// The frame as it came, which destinations that see its VLAN the way it came
    /// (tagged or not) get, and everyone in the untagged domain.
    frame: &'a Frame<'a>,
    /// The frame with its tag pushed or popped, for the other destinations; `None`
    /// where none of them gets it. (Held by reference and made only when needed:
    /// most frames are routed as they came, and a `Frame` is 176 bytes.)
    retagged: Option<Frame<'a>>,
    /// Whether the frame came with its VLAN's tag (from a trunk port or an uplink).
    came_tagged: bool,
}

impl<'a> Route<'a> {
    /// The one destination of a known unicast frame.
    pub fn unicast(&self) -> Option<Endpoint> {
        self.known
    }

    /// The view of the frame destination `e` gets.
    pub fn view(&self, e: Endpoint) -> Option<&Frame<'a>> {
        if self.domain.is_none() || self.topo.sees_tags(e) == self.came_tagged {
            Some(self.frame)
        } else {
            self.retagged.as_ref()
        }
    }
}

impl Switch {
    /// A switch of `ports` (ids 0..) and `uplinks` (ids 0..).
    pub fn new(
        ports: Vec<Arc<dyn SwitchPort>>,
        uplinks: Vec<Arc<dyn SwitchUplink>>,
        aging: Duration,
    ) -> Switch {
        let port_limits: Vec<usize> = ports.iter().map(|p| p.mac_limit()).collect();
        let uplink_limits: Vec<usize> = uplinks.iter().map(|u| u.mac_limit()).collect();
        let ports: Vec<PortSlot> = ports
            .into_iter()
            .enumerate()
            .map(|(id, port)| PortSlot {
                id,
                role: PortRole::of(port.as_ref()),
                port,
            })
            .collect();
        let uplinks = uplinks
            .into_iter()
            .enumerate()
            .map(|(id, uplink)| UplinkSlot { id, uplink })
            .collect();
        let fdb = Fdb::new(aging, &port_limits, &uplink_limits);
        let sw = Switch {
            topo: ArcSwap::from_pointee(Topology::new(ports, uplinks)),
            change: Mutex::new((port_limits.len(), uplink_limits.len())),
            fdb_changes: fdb.changes(),
            fdb: Mutex::new(fdb),
            rx_room: RxRoom::default(),
            programmed: Mutex::new(None),
        };
        let pins: Vec<(Mac, usize)> = sw
            .topo
            .load()
            .ports
            .iter()
            .filter_map(|p| p.role.mac.map(|m| (m, p.id)))
            .collect();
        for (mac, id) in pins {
            sw.pin_mac(mac, id);
        }
        sw
    }

    pub fn rx_room(&self) -> &RxRoom {
        &self.rx_room
    }

    /// Whether endpoint `e` is in the switch now.
    pub fn has(&self, e: Endpoint) -> bool {
        self.topo.load().has(e)
    }

    /// The ids of the ports and of the uplinks in the switch now.
    pub fn members(&self) -> (Vec<usize>, Vec<usize>) {
        let t = self.topo.load();
        (
            t.ports.iter().map(|p| p.id).collect(),
            t.uplinks.iter().map(|u| u.id).collect(),
        )
    }

    /// Adds port `id` (an id never used before in this switch). Other endpoints'
    /// frames are not held up: they go on with the set they loaded, and the table lock
    /// is taken for O(1) steps.
    pub fn add_port(&self, id: usize, port: Arc<dyn SwitchPort>) -> Result<(), MemberError> {
        let mut next = self.change.lock().unwrap_or_else(|e| e.into_inner());
        let cur = self.topo.load_full();
        let e = Endpoint::Port(id);
        let full = (cur.ports.len() >= MAX_PORTS).then_some(MemberError::TooManyPorts(MAX_PORTS));
        claim(&cur, e, &mut next.0, full)?;
        let role = PortRole::of(port.as_ref());
        let mac = role.mac;
        self.fdb
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .add(e, port.mac_limit());
        let mut ports = cur.ports.clone();
        ports.push(PortSlot { id, port, role });
        self.topo
            .store(Arc::new(Topology::new(ports, cur.uplinks.clone())));
        if let Some(mac) = mac {
            self.pin_mac(mac, id);
        }
        Ok(())
    }

    /// Takes port `id` out: no frame is routed to or from it from now on, its learned
    /// and pinned addresses go (O(its own)), frames held for it are let go by their
    /// holders, and the uplinks are programmed for the guests that remain.
    pub fn remove_port(&self, id: usize) -> Result<Arc<dyn SwitchPort>, MemberError> {
        let _change = self.change.lock().unwrap_or_else(|e| e.into_inner());
        let cur = self.topo.load_full();
        let e = Endpoint::Port(id);
        let slot = cur.port(id).cloned().ok_or(MemberError::Missing(e))?;
        let ports = cur.ports.iter().filter(|p| p.id != id).cloned().collect();
        self.topo
            .store(Arc::new(Topology::new(ports, cur.uplinks.clone())));
        {
            let mut fdb = self.fdb.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(mac) = slot.role.mac {
                for d in slot.role.domains() {
                    fdb.unpin(&(d, mac), e);
                }
            }
            fdb.remove(e);
        }
        self.caps_changed();
        // Holders of frames for it look again, and let them go.
        self.rx_room.added();
        Ok(slot.port)
    }

    /// Adds uplink `id` (an id never used before in this switch) and programs its
    /// device with what the connected guests accept.
    pub fn add_uplink(&self, id: usize, uplink: Arc<dyn SwitchUplink>) -> Result<(), MemberError> {
        let mut next = self.change.lock().unwrap_or_else(|e| e.into_inner());
        let cur = self.topo.load_full();
        let e = Endpoint::Uplink(id);
        let full =
            (cur.uplinks.len() >= MAX_UPLINKS).then_some(MemberError::TooManyUplinks(MAX_UPLINKS));
        claim(&cur, e, &mut next.1, full)?;
        let union = cur
            .ports
            .iter()
            .filter_map(|p| p.port.rx_caps())
            .fold(Caps::default(), Caps::or);
        if let Err(err) = uplink.set_rx_offload(union) {
            warn!(uplink = %uplink.name(), "cannot program uplink offloads: {err}");
        }
        self.fdb
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .add(e, uplink.mac_limit());
        let mut uplinks = cur.uplinks.clone();
        uplinks.push(UplinkSlot { id, uplink });
        self.topo
            .store(Arc::new(Topology::new(cur.ports.clone(), uplinks)));
        Ok(())
    }

    /// Takes uplink `id` out; its learned addresses go (O(its own)).
    pub fn remove_uplink(&self, id: usize) -> Result<Arc<dyn SwitchUplink>, MemberError> {
        let _change = self.change.lock().unwrap_or_else(|e| e.into_inner());
        let cur = self.topo.load_full();
        let e = Endpoint::Uplink(id);
        let slot = cur.uplink(id).cloned().ok_or(MemberError::Missing(e))?;
        let uplinks = cur.uplinks.iter().filter(|u| u.id != id).cloned().collect();
        self.topo
            .store(Arc::new(Topology::new(cur.ports.clone(), uplinks)));
        self.fdb.lock().unwrap_or_else(|e| e.into_inner()).remove(e);
        self.rx_room.added();
        Ok(slot.uplink)
    }

    /// Addresses learned on `e` now.
    pub fn learned_on(&self, e: Endpoint) -> usize {
        self.fdb
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .learned_on(e)
    }

    /// Counts a drop on endpoint `e`.
    pub fn count_drop(&self, e: Endpoint, reason: DropReason) {
        if let Some(c) = self.topo.load().counters(e) {
            c.drop(reason);
        }
    }

    /// Routes one frame from `src`: checks port security, classifies it into its
    /// VLAN, learns its source, looks up its destination and builds the tagged or
    /// untagged view the destinations need (`views` holds it). `None`: nowhere to go
    /// (dropped and counted at the source, a hairpin, or a source no longer in the
    /// switch). `now` dates what the FDB learns and looks up; `memo` is the sender's
    /// last answer from it.
    fn route<'a>(
        &'a self,
        topo: &'a Topology,
        src: Endpoint,
        frame: &'a Frame<'a>,
        views: &'a mut ViewBuf<'a>,
        now: Instant,
        memo: &mut FdbMemo,
    ) -> Option<Route<'a>> {
        let t = topo;
        if !t.has(src) {
            return None;
        }
        let counters = t.counters(src);
        let count = |reason| {
            if let Some(c) = counters {
                c.drop(reason);
            }
        };
        if let Endpoint::Port(i) = src {
            if let Some(r) = t.role(i) {
                if r.mac_lock && r.mac != Some(frame.src) {
                    count(DropReason::MacSpoofed);
                    return None;
                }
            }
        }
        let ingress = match classify(t.attach(src), frame.tag, &t.vlans) {
            Ok(i) => i,
            Err(reason) => {
                count(reason);
                return None;
            }
        };
        let domain = ingress.domain;
        let foreign = domain.is_none() && frame.tag != Tag::Untagged;
        let mut key = MemoKey {
            src,
            domain,
            from: frame.src,
            to: frame.dst,
            now,
            generation: self.fdb_changes.load(Acquire),
        };
        let (learned, known) = match memo.get(&key) {
            Some(known) => (Learned::Known, known),
            None => {
                let mut fdb = self.fdb.lock().unwrap_or_else(|e| e.into_inner());
                let learned = fdb.learn((domain, frame.src), src, now);
                let known = match learned {
                    Learned::Refused(_) => None,
                    _ if frame.dst.is_multicast() => None,
                    _ => fdb.lookup(&(domain, frame.dst), now),
                };
                if matches!(learned, Learned::Known | Learned::New) {
                    key.generation = fdb.generation();
                    memo.set(key, known);
                }
                (learned, known)
            }
        };
        match learned {
            Learned::Refused(reason) => {
                count(reason);
                return None;
            }
            Learned::Moved { .. } => {
                if let Some(c) = counters {
                    c.mac_moves.fetch_add(1, Relaxed);
                }
            }
            Learned::Known | Learned::New => {}
        }
        // Which views of the frame its destinations need: access ports of the VLAN
        // see it untagged, trunk ports and uplinks tagged with its VLAN (everyone sees
        // an untagged-domain frame as it is).
        let (to_untagged, to_tagged) = match known {
            Some(dst) if dst == src || !t.reaches(dst, domain, foreign) => return None,
            Some(dst) => (!t.sees_tags(dst), t.sees_tags(dst)),
            None => t
                .flood_targets(src, domain, foreign)
                .fold((false, false), |(u, tg), e| {
                    if t.sees_tags(e) {
                        (u, true)
                    } else {
                        (true, tg)
                    }
                }),
        };
        let retagged = match (domain, ingress.tagged) {
            (Some(vid), false) if to_tagged => Some(vlan::push(frame, vid, views)),
            (Some(_), true) if to_untagged => Some(vlan::pop(frame, views)),
            _ => None,
        };
        let retagged = match retagged.transpose() {
            Ok(r) => r,
            Err(reason) => {
                count(reason);
                return None;
            }
        };
        Some(Route {
            topo,
            src,
            known,
            domain,
            foreign,
            frame,
            retagged,
            came_tagged: ingress.tagged,
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
        let t: &Topology = route.topo;
        match route.known {
            Some(dst) => route
                .view(dst)
                .and_then(|f| Self::deliver_in(t, dst, queue, f, ctx, on_full, FIRST)),
            None => {
                for e in t.flood_targets(route.src, route.domain, route.foreign) {
                    if let Some(f) = route.view(e) {
                        Self::deliver_in(t, e, queue, f, ctx, OnFull::Count, FIRST);
                    }
                }
                None
            }
        }
    }

    /// Routes and delivers one frame from `src` (arriving on its queue `queue`);
    /// nothing waits for a full RX queue.
    ///
    /// A one-copy frame (`Frame::guest`) is routed by the headers it keeps and goes
    /// on as it is to a guest that takes it intact; it is made whole once here for a
    /// flood or a source whose frames may be retagged, and in `deliver_in` for any
    /// other destination.
    pub fn forward(&self, src: Endpoint, queue: usize, frame: &Frame, ctx: &mut DeliverCtx) {
        let topo = self.topo.load();
        if frame.guest.is_some() && !topo.untagged_source(src) {
            Self::made_whole(frame, ctx, |whole, ctx| {
                self.forward(src, queue, whole, ctx);
                Some(())
            });
            return;
        }
        let mut views = ViewBuf::default();
        let now = ctx.now();
        let Some(route) = self.route(&topo, src, frame, &mut views, now, &mut ctx.fdb_memo) else {
            return;
        };
        self.send_routed(route, queue, frame, ctx);
    }

    /// The topology as it is now, for a sender to route a whole batch by
    /// (`forward_in_run`): one load per batch, not per frame. A change made
    /// meanwhile applies from the next batch.
    pub fn batch_topology(&self) -> BatchTopology {
        BatchTopology(self.topo.load())
    }

    /// `forward`, for a sender whose frame's bytes stay put for its whole batch
    /// (`bytes`: the same bytes as `frame`'s): a frame that goes intact and as it is
    /// to one guest joins the sender's `run` for that guest's queue, written with
    /// the frames next to it; any other is delivered now, after the run.
    ///
    /// Inlined into the sender's loop: most frames find the decision of the frame
    /// before them (`JoinMemo`) and join its run here; the rest are routed out of
    /// line (`forward_routed`), whose frame and spills the common case does not pay.
    #[allow(clippy::too_many_arguments)]
    #[inline]
    pub fn forward_in_run<'a>(
        &self,
        topo: &BatchTopology,
        src: Endpoint,
        queue: usize,
        frame: &Frame,
        bytes: Stable<'a>,
        ctx: &mut DeliverCtx,
        run: &mut Run<'a>,
    ) {
        let topo: &Topology = &topo.0;
        if frame.guest.is_some() && !topo.untagged_source(src) {
            run.flush(ctx);
            return match run.held() {
                Some(held) => backpressure::forward_holding(self, src, queue, frame, ctx, held),
                None => self.forward(src, queue, frame, ctx),
            };
        }
        let now = ctx.now();
        let at = JoinAt {
            topology: topo.serial,
            src,
            queue,
            generation: self.fdb_changes.load(Acquire),
        };
        if let Some(j) = ctx.join_memo.get(at, frame) {
            if !Self::waits(run, j.dst) {
                return Self::join(&topo.ports[j.slot].port, j, frame, bytes, queue, ctx, run);
            }
        }
        self.forward_routed(topo, frame, bytes, (now, at), ctx, run);
    }

    /// Whether the sender holds frames for `dst`: they come first, and a frame for
    /// it is routed to go after them.
    fn waits(run: &mut Run, dst: Endpoint) -> bool {
        run.held().is_some_and(|h| h.has_for(dst))
    }

    /// `forward_in_run` for a frame the memo does not decide, from where `at`
    /// says, at the batch's time `now`.
    #[inline(never)]
    fn forward_routed<'a>(
        &self,
        topo: &Topology,
        frame: &Frame,
        bytes: Stable<'a>,
        (now, at): (Instant, JoinAt),
        ctx: &mut DeliverCtx,
        run: &mut Run<'a>,
    ) {
        let JoinAt { src, queue, .. } = at;
        let mut views = ViewBuf::default();
        let Some(route) = self.route(topo, src, frame, &mut views, now, &mut ctx.fdb_memo) else {
            return;
        };
        let joins = match route.unicast() {
            Some(dst) if Self::waits(run, dst) => None,
            _ => Self::joins_run(&route, queue, frame),
        };
        match joins {
            Some(j) => {
                ctx.join_memo.set(JoinKey::of(at, frame), j);
                Self::join(&topo.ports[j.slot].port, j, frame, bytes, queue, ctx, run);
            }
            None => {
                run.flush(ctx);
                match run.held() {
                    Some(held) => backpressure::send_holding(self, route, queue, frame, ctx, held),
                    None => self.send_routed(route, queue, frame, ctx),
                }
            }
        }
    }

    /// Adds `frame` (`bytes`) to `run`, for the guest port `port` `joined` names.
    fn join<'a>(
        port: &Arc<dyn SwitchPort>,
        joined: Joined,
        frame: &Frame,
        bytes: Stable<'a>,
        queue: usize,
        ctx: &mut DeliverCtx,
        run: &mut Run<'a>,
    ) {
        if ctx.rx_admit(port.as_ref(), frame) {
            let f = RunFrame {
                hdr: joined.hdr,
                head: bytes.head,
                tail: bytes.tail,
            };
            run.push((port, joined.dst), queue, f, frame.hdr, ctx);
        }
    }

    /// Where `route` sends `frame`, and the frame's RX header, if the frame goes as
    /// it is (not retagged, not cut, not coalesced) to one guest port, through
    /// `queue`.
    fn joins_run(route: &Route, queue: usize, frame: &Frame) -> Option<Joined> {
        let dst @ Endpoint::Port(i) = route.known? else {
            return None;
        };
        let view = route.view(dst)?;
        if !std::ptr::eq(view.parts, frame.parts) {
            return None;
        }
        let slot = route.topo.port_slot(i)?;
        let port = &route.topo.ports[slot].port;
        let caps = port.caps();
        let intact =
            deliver::choose(&frame.hdr, caps, port.max_burst().is_some()) == deliver::Path::Intact;
        let takes = frame.guest.is_none() || port.takes_guest_bytes(queue);
        (intact && takes && !deliver::gro_applies(port.as_ref(), caps)).then(|| Joined {
            slot,
            dst,
            hdr: deliver::rx_header(&frame.hdr, caps),
        })
    }

    /// Sends a routed frame on: the rest of `forward`.
    fn send_routed(&self, route: Route, queue: usize, frame: &Frame, ctx: &mut DeliverCtx) {
        if frame.guest.is_some() && route.known.is_none() {
            Self::made_whole(frame, ctx, move |whole, ctx| {
                // An untagged-domain frame: every destination sees it as it is.
                let route = Route {
                    frame: whole,
                    retagged: Some(*whole),
                    ..route
                };
                self.send(&route, queue, ctx, OnFull::Count)
            });
            return;
        }
        self.send(&route, queue, ctx, OnFull::Count);
    }

    /// Runs `then` with `frame` made whole in the sender's `DeliverCtx::whole`.
    /// `None` if the sender's buffers could not be read.
    fn made_whole<T>(
        frame: &Frame,
        ctx: &mut DeliverCtx,
        then: impl FnOnce(&Frame, &mut DeliverCtx) -> Option<T>,
    ) -> Option<T> {
        ctx.made_whole += 1;
        let mut buf = std::mem::take(&mut ctx.whole);
        let out = match frame.gather(&mut buf) {
            Ok(()) => {
                let parts = [&buf[..frame.len]];
                then(&frame.made_whole(&parts), ctx)
            }
            Err(_) => None,
        };
        ctx.whole = buf;
        out
    }

    /// Delivers `frame` (the view for `dst`) to the one destination `dst`, after what
    /// an earlier attempt did (`again`; `FIRST` for none). `None`: `dst` is not in
    /// the switch (any more).
    pub fn deliver_to(
        &self,
        dst: Endpoint,
        queue: usize,
        frame: &Frame,
        ctx: &mut DeliverCtx,
        on_full: OnFull,
        again: Again,
    ) -> Option<Outcome> {
        Self::deliver_in(&self.topo.load(), dst, queue, frame, ctx, on_full, again)
    }

    fn deliver_in(
        t: &Topology,
        dst: Endpoint,
        queue: usize,
        frame: &Frame,
        ctx: &mut DeliverCtx,
        on_full: OnFull,
        again: Again,
    ) -> Option<Outcome> {
        if frame.guest.is_some() && !Self::takes_as_is(t, dst, queue, frame) {
            let out = Self::made_whole(frame, ctx, |whole, ctx| {
                Self::deliver_in(t, dst, queue, whole, ctx, on_full, again)
            });
            return out.or_else(|| {
                let reason = DropReason::BadAddress;
                t.counters(dst)?.drop(reason);
                Some(Outcome {
                    path: deliver::Path::Dropped(reason),
                    sent: 0,
                })
            });
        }
        let skip = again.sent;
        match dst {
            Endpoint::Port(i) => {
                let port = &t.port(i)?.port;
                if !again.admitted && !ctx.rx_admit(port.as_ref(), frame) {
                    return Some(Outcome {
                        path: deliver::Path::Dropped(DropReason::RateLimited),
                        sent: 0,
                    });
                }
                if !again.admitted && !ctx.segments_allowed(port.as_ref(), frame) {
                    return Some(Outcome {
                        path: deliver::Path::Dropped(DropReason::SegmentBudget),
                        sent: 0,
                    });
                }
                if !again.admitted && ctx.gro_offer(port, queue, frame) {
                    return Some(Outcome {
                        path: deliver::Path::Intact,
                        sent: 1,
                    });
                }
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
                let up = &t.uplink(i)?.uplink;
                if !again.admitted && !ctx.rx_admit(up.as_ref(), frame) {
                    return Some(Outcome {
                        path: deliver::Path::Dropped(DropReason::RateLimited),
                        sent: 0,
                    });
                }
                if !again.admitted && !ctx.segments_allowed(up.as_ref(), frame) {
                    return Some(Outcome {
                        path: deliver::Path::Dropped(DropReason::SegmentBudget),
                        sent: 0,
                    });
                }
                // A write to a tap may wait for the flush (`write_batch`) when the
                // frame goes intact.
                let caps = up.caps();
                let put_off = skip == 0
                    && ctx.writes.is_some()
                    && deliver::choose(&frame.hdr, caps, up.max_burst().is_some())
                        == deliver::Path::Intact
                    && ctx.writes.as_mut().is_some_and(|w| {
                        w.put_off(up, queue, &deliver::rx_header(&frame.hdr, caps), frame)
                    });
                let out = if put_off {
                    Outcome {
                        path: deliver::Path::Intact,
                        sent: 1,
                    }
                } else {
                    // A write made now must not overtake those put off.
                    if let Some(w) = ctx.writes.as_mut() {
                        w.submit();
                    }
                    deliver(frame, up.as_ref(), queue, &mut ctx.segmenter, on_full, skip)
                };
                if out.sent > skip && ctx.reap_uplinks {
                    ctx.pending.uplink_written(up, queue);
                }
                Some(out)
            }
        }
    }

    /// Whether `dst` takes the one-copy `frame` as it is: a guest port it goes to
    /// intact without a pacer holding it, and that GRO does not coalesce it into (a
    /// GSO frame never is: GRO reads its headers only, which its head holds).
    fn takes_as_is(t: &Topology, dst: Endpoint, queue: usize, frame: &Frame) -> bool {
        let Endpoint::Port(i) = dst else { return false };
        let Some(slot) = t.port(i) else { return false };
        let port = slot.port.as_ref();
        let caps = port.caps();
        deliver::choose(&frame.hdr, caps, port.max_burst().is_some()) == deliver::Path::Intact
            && (frame.hdr.gso.is_gso() || !deliver::gro_applies(port, caps))
            && port.takes_guest_bytes(queue)
    }

    /// Sends frames for `mac` to port `id` from the start, in every domain the port
    /// takes part in; learning never moves it.
    pub fn pin_mac(&self, mac: Mac, id: usize) {
        let topo = self.topo.load();
        let Some(r) = topo.role(id) else { return };
        let mut fdb = self.fdb.lock().unwrap_or_else(|e| e.into_inner());
        for d in r.domains() {
            fdb.pin((d, mac), Endpoint::Port(id));
        }
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
        let topo = self.topo.load();
        let union = topo
            .ports
            .iter()
            .filter_map(|p| p.port.rx_caps())
            .fold(Caps::default(), Caps::or);
        {
            let mut last = self.programmed.lock().unwrap_or_else(|e| e.into_inner());
            if *last == Some(union) {
                return;
            }
            *last = Some(union);
        }
        for u in &topo.uplinks {
            if let Err(e) = u.uplink.set_rx_offload(union) {
                warn!(uplink = %u.uplink.name(), "cannot program uplink offloads: {e}");
            }
        }
    }

    /// A clean stop: every port stops writing its guest's rings (frames for it are
    /// dropped from now on), so the rings are final before the frontends are closed.
    pub fn quiesce_ports(&self) {
        for p in self.topo.load().ports.iter() {
            p.port.quiesce();
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
    use crate::l2::{Tag, ETHERTYPE_QINQ, ETHERTYPE_QINQ_OLD, ETHERTYPE_VLAN};
    use crate::testkit::frames::{ethernet, pattern};
    use crate::vnet_hdr::{GsoKind, GsoType, VirtioNetHdr, F_NEEDS_CSUM};

    use crate::testkit::recorder::Recorder;

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
        net([Vid::new(10), Vid::new(10), Vid::new(20), None]
            .into_iter()
            .map(|vlan| Recorder {
                vlan,
                ..Recorder::default()
            })
            .collect())
    }

    fn net(ports: Vec<Recorder>) -> Net {
        let ports: Vec<Arc<Recorder>> = ports.into_iter().map(Arc::new).collect();
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
        for (i, p) in net.ports.iter().enumerate().take(4) {
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
        // Any other tag from an untagged port is dropped too: a VID no port uses, a
        // priority tag, 802.1ad, 0x9100, and double tags whatever their inner VID.
        let dot1ad = |outer: u16, inner: Option<u16>| {
            let mut tags = vec![(outer, 30)];
            tags.extend(inner.map(|v| (ETHERTYPE_VLAN, v)));
            ethernet(bc.0, mac(3).0, &tags, 0x0800, &pattern(80))
        };
        for f in [
            frame(bc, mac(3), Some(30)),
            frame(bc, mac(3), Some(0)),
            dot1ad(ETHERTYPE_QINQ, None),
            dot1ad(ETHERTYPE_QINQ, Some(10)),
            dot1ad(ETHERTYPE_QINQ_OLD, Some(20)),
            dot1ad(ETHERTYPE_VLAN, Some(10)),
        ] {
            plain(&net, Endpoint::Port(UNTAGGED), &f);
        }
        assert_eq!(attempts(&net), [0, 0, 0, 0]);
        assert!(net.up.take().is_empty());
        assert_eq!(
            net.ports[UNTAGGED]
                .stats
                .drops(DropReason::TaggedOnUntaggedPort),
            6
        );
        // Untagged, it goes out.
        plain(&net, Endpoint::Port(UNTAGGED), &frame(bc, mac(3), None));
        assert_eq!(net.up.take().len(), 1);
    }

    const TRUNK: usize = 4;

    /// `setup()` plus a trunk port of VLANs 10 and 30.
    fn with_trunk() -> Net {
        let mut ports: Vec<Recorder> = [Vid::new(10), Vid::new(10), Vid::new(20), None]
            .into_iter()
            .map(|vlan| Recorder {
                vlan,
                ..Recorder::default()
            })
            .collect();
        ports.push(Recorder {
            trunk: Some("10:30".parse().unwrap()),
            ..Recorder::default()
        });
        net(ports)
    }

    #[test]
    fn trunk_ports_carry_their_allowed_vlans_tagged() {
        let net = with_trunk();
        let bc = Mac::BROADCAST;
        let t = Endpoint::Port(TRUNK);
        let trunk_got = |net: &Net| net.ports[TRUNK].take();
        // VLAN 10 from the trunk port: the access ports of 10 untagged, the uplink
        // tagged as sent.
        let f10 = frame(bc, mac(5), Some(10));
        plain(&net, t, &f10);
        assert_eq!(attempts(&net), [1, 1, 0, 0]);
        assert_eq!(net.up.take()[0].1, f10);
        // VLAN 30 (no access port): the uplink only.
        plain(&net, t, &frame(bc, mac(5), Some(30)));
        assert_eq!(attempts(&net), [0, 0, 0, 0]);
        assert_eq!(tag_of(&net.up.take()[0].1), Tag::Dot1q(30));
        // Untagged: the untagged domain.
        plain(&net, t, &frame(bc, mac(5), None));
        assert_eq!(attempts(&net), [0, 0, 0, 1]);
        assert_eq!(net.up.take()[0].1, frame(bc, mac(5), None));
        // Anything else is refused.
        for vid in [20, 0, 31] {
            plain(&net, t, &frame(bc, mac(5), Some(vid)));
        }
        plain(
            &net,
            t,
            &ethernet(
                bc.0,
                mac(5).0,
                &[(ETHERTYPE_QINQ, 10)],
                0x0800,
                &pattern(80),
            ),
        );
        assert_eq!(attempts(&net), [0, 0, 0, 0]);
        assert!(net.up.take().is_empty());
        assert_eq!(net.ports[TRUNK].stats.drops(DropReason::VlanNotAllowed), 4);

        // Towards the trunk port: VLAN 10 from an access port arrives tagged; from
        // the uplink, 10 and 30 tagged and untagged frames as they are; VLAN 20 and a
        // VID no port uses never.
        plain(&net, Endpoint::Port(P10A), &frame(bc, mac(1), None));
        let got = trunk_got(&net);
        assert_eq!(got.len(), 1);
        let mut want = frame(bc, mac(1), Some(10));
        want[14] &= 0x0f;
        assert_eq!(got[0].1, want);
        attempts(&net);
        net.up.take();
        for (vid, arrives) in [
            (Some(10), true),
            (Some(30), true),
            (None, true),
            (Some(20), false),
            (Some(40), false),
        ] {
            let f = frame(bc, mac(9), vid);
            plain(&net, Endpoint::Uplink(0), &f);
            let got = trunk_got(&net);
            if arrives {
                assert_eq!(got.len(), 1, "{vid:?}");
                assert_eq!(got[0].1, f, "{vid:?}");
            } else {
                assert!(got.is_empty(), "{vid:?} reached the trunk port");
            }
        }
        // VID 40 (no port uses it) is the untagged port's, tag kept, as before.
        assert_eq!(attempts(&net), [1, 1, 1, 2]);
        // The trunk learns per VLAN: unicast to mac(5) in VLAN 30 goes to it alone.
        plain(&net, Endpoint::Uplink(0), &frame(mac(5), mac(9), Some(30)));
        assert_eq!(trunk_got(&net).len(), 1);
        assert_eq!(attempts(&net), [0, 0, 0, 0]);
    }

    #[test]
    fn mac_lock_and_pinned_addresses() {
        let mut ports: Vec<Recorder> = (0..4).map(|_| Recorder::default()).collect();
        ports[0].mac = Some(mac(1));
        ports[0].mac_lock = true;
        ports[1].mac = Some(mac(2));
        let net = net(ports);
        let bc = Mac::BROADCAST;
        // Port 0 sends from its own address only.
        plain(&net, Endpoint::Port(0), &frame(bc, mac(1), None));
        assert_eq!(attempts(&net), [0, 1, 1, 1]);
        for src in [mac(2), mac(7), Mac([3, 0, 0, 0, 0, 1])] {
            plain(&net, Endpoint::Port(0), &frame(bc, src, None));
        }
        assert_eq!(attempts(&net), [0, 0, 0, 0]);
        assert_eq!(net.ports[0].stats.drops(DropReason::MacSpoofed), 3);
        // Port 1's pinned address from port 2 or the uplink: refused.
        plain(&net, Endpoint::Port(2), &frame(bc, mac(2), None));
        plain(&net, Endpoint::Uplink(0), &frame(bc, mac(2), None));
        assert_eq!(attempts(&net), [0, 0, 0, 0]);
        assert_eq!(net.ports[2].stats.drops(DropReason::MacPinnedElsewhere), 1);
        assert_eq!(net.up.stats.drops(DropReason::MacPinnedElsewhere), 1);
        net.up.take();
        // And frames for it still go to port 1 only.
        plain(&net, Endpoint::Port(3), &frame(mac(2), mac(4), None));
        assert_eq!(attempts(&net), [0, 1, 0, 0]);
    }

    #[test]
    fn moves_are_counted_and_held() {
        let net = setup();
        let bc = Mac::BROADCAST;
        let x = mac(7);
        plain(&net, Endpoint::Port(P10A), &frame(bc, x, None));
        plain(&net, Endpoint::Port(P10B), &frame(bc, x, None));
        assert_eq!(net.ports[P10B].stats.mac_moves.load(Relaxed), 1);
        // Moving back at once is refused and counted; frames for X stay with B.
        plain(&net, Endpoint::Port(P10A), &frame(bc, x, None));
        assert_eq!(net.ports[P10A].stats.drops(DropReason::MacMoveRefused), 1);
        attempts(&net);
        net.up.take();
        plain(&net, Endpoint::Uplink(0), &frame(x, mac(9), Some(10)));
        assert_eq!(attempts(&net), [0, 1, 0, 0]);
        assert_eq!(net.ports[P10A].stats.mac_moves.load(Relaxed), 0);
    }

    /// One sender's batch (one `DeliverCtx`, one clock reading): the FDB's answer is
    /// reused between the same two addresses, and still every change made meanwhile
    /// (an address learnt elsewhere, a port's addresses forgotten) counts at once.
    #[test]
    fn a_batch_reuses_the_fdb_answer_only_while_the_fdb_is_unchanged() {
        let net = setup();
        let bc = Mac::BROADCAST;
        let (a, x) = (mac(1), mac(2));
        let mut batch = DeliverCtx::default();
        let to_x = frame(x, a, None);
        let parts = [&to_x[..]];
        let f = Frame::new(VirtioNetHdr::default(), &parts, None).unwrap();
        let from_a = |batch: &mut DeliverCtx| net.sw.forward(Endpoint::Port(P10A), 0, &f, batch);
        // X unknown: flooded within VLAN 10, twice (the second from the memo).
        from_a(&mut batch);
        from_a(&mut batch);
        assert_eq!(attempts(&net), [0, 2, 0, 0]);
        net.up.take();
        // X shows up behind the uplink: the same batch's next frame goes there only.
        plain(&net, Endpoint::Uplink(0), &frame(bc, x, Some(10)));
        attempts(&net);
        from_a(&mut batch);
        from_a(&mut batch);
        assert_eq!(attempts(&net), [0, 0, 0, 0]);
        assert_eq!(net.up.take().len(), 2);
        // The uplink's addresses are forgotten: flooded again.
        net.sw.fdb.lock().unwrap().forget(Endpoint::Uplink(0));
        from_a(&mut batch);
        assert_eq!(attempts(&net), [0, 1, 0, 0]);
        assert_eq!(net.up.take().len(), 1);
    }

    #[test]
    fn a_source_flood_evicts_only_the_flooders_own_addresses() {
        let net = setup();
        let bc = Mac::BROADCAST;
        // The two VLAN-10 ports know each other; P10A floods 10,000 source addresses
        // (its quota is 8 here).
        plain(&net, Endpoint::Port(P10A), &frame(bc, mac(1), None));
        plain(&net, Endpoint::Port(P10B), &frame(bc, mac(2), None));
        for i in 0..10_000u32 {
            let b = i.to_be_bytes();
            let src = Mac([2, 0x77, b[0], b[1], b[2], b[3]]);
            plain(&net, Endpoint::Port(P10A), &frame(mac(2), src, None));
        }
        assert_eq!(
            net.sw.fdb.lock().unwrap().learned_on(Endpoint::Port(P10A)),
            8
        );
        attempts(&net);
        net.up.take();
        // A new host on the uplink is learned, and unicast between the others is
        // still unicast.
        plain(&net, Endpoint::Uplink(0), &frame(mac(2), mac(9), Some(10)));
        plain(&net, Endpoint::Port(P10B), &frame(mac(9), mac(2), None));
        assert_eq!(attempts(&net), [0, 1, 0, 0]);
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

    #[test]
    fn gro_builds_one_frame_per_batch_for_a_guest_that_asks() {
        use crate::testkit::gro::{segment, Flow, Twist};
        let ports = [true, false]
            .into_iter()
            .map(|gro| Recorder {
                gro,
                ..Recorder::default()
            })
            .collect();
        let net = net(ports);
        let flow = |sport, udp| Flow {
            udp,
            v6: false,
            vlan: false,
            timestamps: true,
            sport,
            mss: 1448,
            full: false,
            valid: false,
            seq0: 7,
            id0: 1,
        };
        for (port, dst) in [(0, 0xb0), (1, 0xb1)] {
            let me = Mac([2, 0, 0, 0, 0, dst]);
            plain(&net, Endpoint::Port(port), &frame(Mac::BROADCAST, me, None));
            net.up.take();
            attempts(&net);
            // TCP segments, then UDP datagrams (the receiver takes TSO and USO).
            for (udp, kind) in [(false, GsoKind::TcpV4), (true, GsoKind::UdpL4)] {
                let s0 = net.ports[port].stats.snapshot();
                let mut ctx = DeliverCtx::default();
                for i in 0..10 {
                    let fl = flow(1000 + port as u16, udp);
                    let (hdr, mut f) = segment(&fl, i, i * 1448, 1448, Twist::None);
                    f[5] = dst;
                    let parts = [&f[..]];
                    let fr = Frame::new(hdr, &parts, None).unwrap();
                    net.sw.forward(Endpoint::Uplink(0), 0, &fr, &mut ctx);
                }
                let before = net.ports[port].take().len();
                ctx.flush();
                let after = net.ports[port].take();
                let s = net.ports[port].stats.snapshot();
                let d = (
                    s.gro_frames - s0.gro_frames,
                    s.gro_segments - s0.gro_segments,
                    s.rx_frames - s0.rx_frames,
                );
                if port == 0 {
                    // Held within the batch, one GSO frame at its end.
                    assert_eq!((before, after.len()), (0, 1));
                    assert_eq!(after[0].0.gso.kind, kind);
                    assert_eq!(d, (1, 10, 1));
                } else {
                    assert_eq!((before, after.len()), (10, 0));
                    assert_eq!(d, (0, 0, 10));
                }
            }
        }
    }

    #[test]
    fn rx_rate_holds_a_guest_sender_and_drops_an_uplinks_frames() {
        use crate::backend::ratelimit::ByteRate;
        // 1 Mbit/s, 1 KiB burst: one 60 KB frame puts the port in debt for half a second.
        let limited = || Recorder {
            rx_rate: Some(ByteRate::new(1, 1)),
            ..Recorder::default()
        };
        let net = net(vec![limited(), Recorder::default()]);
        let me = Mac([2, 0, 0, 0, 0, 0xb0]);
        plain(&net, Endpoint::Port(0), &frame(Mac::BROADCAST, me, None));
        attempts(&net);
        net.up.take();
        let big = ethernet(me.0, mac(9).0, &[], 0x0800, &pattern(60000));
        let parts = [&big[..]];
        let f = Frame::new(VirtioNetHdr::default(), &parts, None).unwrap();
        // From a guest (a sender that can be held): delivered, and the sender is
        // asked to wait before its next frame, once.
        let mut ctx = DeliverCtx::holding();
        net.sw.forward(Endpoint::Port(1), 0, &f, &mut ctx);
        assert_eq!(net.ports[0].take().len(), 1);
        assert_eq!(ctx.take_hold(), None, "within the burst");
        net.sw.forward(Endpoint::Port(1), 0, &f, &mut ctx);
        assert_eq!(net.ports[0].take().len(), 1);
        assert!(ctx.take_hold().is_some(), "over the rate: hold the sender");
        assert_eq!(ctx.take_hold(), None);
        // From an uplink (cannot be held): dropped at the tail and counted.
        net.sw
            .forward(Endpoint::Uplink(0), 0, &f, &mut DeliverCtx::default());
        assert!(net.ports[0].take().is_empty());
        assert_eq!(net.ports[0].stats.drops(DropReason::RateLimited), 1);
    }

    #[test]
    fn ports_come_and_go_without_touching_the_others() {
        let net = setup();
        // P10A and P10B and something behind the uplink (VLAN 10) are learned.
        plain(&net, Endpoint::Port(P10A), &frame(mac(2), mac(1), None));
        plain(&net, Endpoint::Port(P10B), &frame(mac(1), mac(2), None));
        plain(&net, Endpoint::Uplink(0), &frame(mac(1), mac(9), Some(10)));
        attempts(&net);
        net.up.take();
        let before = net.sw.learned_on(Endpoint::Port(P10A));
        assert_eq!(before, 1);

        // A new port on VLAN 10 with a pinned address, id 4.
        let newcomer = Arc::new(Recorder {
            vlan: Vid::new(10),
            mac: Some(mac(7)),
            ..Recorder::default()
        });
        net.sw
            .add_port(4, newcomer.clone() as Arc<dyn SwitchPort>)
            .unwrap();
        assert_eq!(
            net.sw.add_port(4, newcomer.clone() as Arc<dyn SwitchPort>),
            Err(MemberError::Taken(Endpoint::Port(4)))
        );
        // Its pinned address is known at once: unicast from P10A reaches it only.
        plain(&net, Endpoint::Port(P10A), &frame(mac(7), mac(1), None));
        assert_eq!(newcomer.take().len(), 1);
        assert_eq!(attempts(&net), [0, 0, 0, 0]);
        assert!(net.up.take().is_empty());
        // It sends, and P10A (known) gets it; learning went on for the others.
        plain(&net, Endpoint::Port(4), &frame(mac(1), mac(7), None));
        assert_eq!(attempts(&net), [1, 0, 0, 0]);
        assert_eq!(net.sw.learned_on(Endpoint::Port(P10A)), before);

        // P10B goes: its address is forgotten, the others' are not.
        net.sw.remove_port(P10B).unwrap();
        assert_eq!(net.sw.learned_on(Endpoint::Port(P10B)), 0);
        assert_eq!(net.sw.learned_on(Endpoint::Port(P10A)), before);
        assert_eq!(net.sw.learned_on(Endpoint::Uplink(0)), 1);
        assert!(!net.sw.has(Endpoint::Port(P10B)));
        // A frame for its address is flooded in VLAN 10 now, never delivered to it.
        plain(&net, Endpoint::Port(P10A), &frame(mac(2), mac(1), None));
        assert_eq!(attempts(&net), [0, 0, 0, 0]);
        assert_eq!(newcomer.take().len(), 1);
        assert_eq!(net.up.take().len(), 1);
        // What it still sends (a worker finishing its batch) goes nowhere and teaches
        // the table nothing.
        plain(
            &net,
            Endpoint::Port(P10B),
            &frame(frames_bcast(), mac(2), None),
        );
        assert_eq!(attempts(&net), [0, 0, 0, 0]);
        assert_eq!(newcomer.take().len(), 0);
        assert_eq!(net.sw.learned_on(Endpoint::Port(P10B)), 0);
        // Its id is never given again, nor an id below the highest given.
        assert_eq!(
            net.sw
                .add_port(P10B, Arc::new(Recorder::default()) as Arc<dyn SwitchPort>),
            Err(MemberError::Reused(Endpoint::Port(P10B)))
        );
        // The pinned address of a removed port is free for the next one.
        net.sw.remove_port(4).unwrap();
        assert_eq!(
            net.sw.remove_port(4).err(),
            Some(MemberError::Missing(Endpoint::Port(4)))
        );
        let heir = Arc::new(Recorder {
            vlan: Vid::new(10),
            ..Recorder::default()
        });
        net.sw
            .add_port(5, heir.clone() as Arc<dyn SwitchPort>)
            .unwrap();
        plain(&net, Endpoint::Port(5), &frame(mac(1), mac(7), None));
        assert_eq!(attempts(&net), [1, 0, 0, 0]);
        assert_eq!(net.sw.learned_on(Endpoint::Port(5)), 1);
        let (ports, uplinks) = net.sw.members();
        assert_eq!(ports, vec![P10A, P20, UNTAGGED, 5]);
        assert_eq!(uplinks, vec![0]);
        // Counters of the others are their own, untouched by the changes.
        assert_eq!(net.ports[P10A].stats.drops(DropReason::RxQueueFull), 0);
    }

    fn frames_bcast() -> Mac {
        Mac([0xff; 6])
    }

    #[test]
    fn uplinks_come_and_go_and_the_switch_is_bounded() {
        let net = setup();
        plain(&net, Endpoint::Uplink(0), &frame(mac(1), mac(9), None));
        assert_eq!(net.sw.learned_on(Endpoint::Uplink(0)), 1);
        let second = Arc::new(Recorder::default());
        net.sw
            .add_uplink(1, second.clone() as Arc<dyn SwitchUplink>)
            .unwrap();
        plain(
            &net,
            Endpoint::Port(UNTAGGED),
            &frame(frames_bcast(), mac(3), None),
        );
        assert_eq!(net.up.take().len(), 1);
        assert_eq!(second.take().len(), 1);
        net.sw.remove_uplink(0).unwrap();
        assert_eq!(net.sw.learned_on(Endpoint::Uplink(0)), 0);
        // mac(9) was behind uplink 0: now a frame for it floods (to uplink 1 only).
        plain(&net, Endpoint::Port(UNTAGGED), &frame(mac(9), mac(3), None));
        assert!(net.up.take().is_empty());
        assert_eq!(second.take().len(), 1);
        assert_eq!(
            net.sw
                .add_uplink(0, net.up.clone() as Arc<dyn SwitchUplink>),
            Err(MemberError::Reused(Endpoint::Uplink(0)))
        );
        for id in 2..=MAX_UPLINKS {
            net.sw
                .add_uplink(id, Arc::new(Recorder::default()) as Arc<dyn SwitchUplink>)
                .unwrap();
        }
        assert_eq!(
            net.sw.add_uplink(
                MAX_UPLINKS + 1,
                Arc::new(Recorder::default()) as Arc<dyn SwitchUplink>
            ),
            Err(MemberError::TooManyUplinks(MAX_UPLINKS))
        );
        for id in 4..MAX_PORTS {
            net.sw
                .add_port(id, Arc::new(Recorder::default()) as Arc<dyn SwitchPort>)
                .unwrap();
        }
        assert_eq!(
            net.sw.add_port(
                MAX_PORTS,
                Arc::new(Recorder::default()) as Arc<dyn SwitchPort>
            ),
            Err(MemberError::TooManyPorts(MAX_PORTS))
        );
    }

    /// The guest on P10A is known and its queue full; `n` frames for it from the
    /// uplink are held. Returns the switch, the sender's state and the frame's bytes.
    fn held_for_full_port(n: usize) -> (Net, super::backpressure::Held, DeliverCtx, Vec<u8>) {
        use super::backpressure::{forward_holding, Held};
        let net = setup();
        plain(&net, Endpoint::Port(P10A), &frame(mac(9), mac(1), None));
        net.up.take();
        net.ports[P10A].full.store(true, Relaxed);
        let mut held = Held::default();
        let mut ctx = DeliverCtx::default();
        let bytes = frame(mac(1), mac(9), Some(10));
        let parts = [&bytes[..]];
        let f = Frame::new(VirtioNetHdr::default(), &parts, None).unwrap();
        for _ in 0..n {
            forward_holding(&net.sw, Endpoint::Uplink(0), 0, &f, &mut ctx, &mut held);
        }
        assert!(!held.is_empty(), "frames for a full queue are held");
        (net, held, ctx, bytes)
    }

    /// A sender stops reading while all it read went to full queues, and only then.
    #[test]
    fn reads_pause_only_while_every_frame_went_to_a_full_queue() {
        use super::backpressure::forward_holding;
        let (net, mut held, mut ctx, bytes) = held_for_full_port(2);
        assert!(held.pause_reads(), "all of the round was held for P10A");
        let send = |held: &mut super::backpressure::Held, ctx: &mut DeliverCtx, b: &[u8]| {
            let parts = [b];
            let f = Frame::new(VirtioNetHdr::default(), &parts, None).unwrap();
            forward_holding(&net.sw, Endpoint::Uplink(0), 0, &f, ctx, held);
        };
        // P10B's guest is known and has room: a frame for it in the round.
        plain(&net, Endpoint::Port(P10B), &frame(mac(9), mac(2), None));
        net.up.take();
        net.ports[P10B].take(); // P10A's first frame, flooded
        send(&mut held, &mut ctx, &frame(mac(2), mac(9), Some(10)));
        assert_eq!(net.ports[P10B].take().len(), 1);
        assert!(!held.pause_reads(), "another guest took a frame this round");
        // A new round: for the full guest only, then a flood.
        held.begin_round();
        assert!(!held.pause_reads(), "nothing read yet");
        send(&mut held, &mut ctx, &bytes);
        assert!(held.pause_reads());
        send(
            &mut held,
            &mut ctx,
            &frame(Mac([0xff; 6]), mac(9), Some(10)),
        );
        assert!(!held.pause_reads(), "a flood went to others");
        // Room: the retry delivers what was held, and nothing is paused for.
        held.begin_round();
        send(&mut held, &mut ctx, &bytes);
        net.ports[P10A].full.store(false, Relaxed);
        net.sw.rx_space();
        held.retry(&net.sw, &mut ctx);
        assert!(held.is_empty());
        assert!(!held.pause_reads(), "P10A has nothing held any more");
    }

    #[test]
    fn frames_held_for_a_removed_port_are_let_go() {
        let (net, mut held, mut ctx, _) = held_for_full_port(3);
        held.retry(&net.sw, &mut ctx);
        assert!(!held.is_empty(), "still held while the port is there");
        net.sw.remove_port(P10A).unwrap();
        held.retry(&net.sw, &mut ctx);
        assert!(
            held.is_empty(),
            "frames held for a removed port are released"
        );
        assert!(net.ports[P10A].take().is_empty());
    }

    /// A held frame delivered on a retry stays where it is until the sender's next
    /// retry (after its flush), so the destination may keep its address.
    #[test]
    fn held_frames_delivered_on_a_retry_are_stable_for_the_destination() {
        let (net, mut held, mut ctx, bytes) = held_for_full_port(1);
        net.ports[P10A].full.store(false, Relaxed);
        net.sw.rx_space();
        held.retry(&net.sw, &mut ctx);
        assert!(held.is_empty(), "delivered once there is room");
        assert_eq!(net.ports[P10A].take().len(), 1);
        assert_eq!(
            *net.ports[P10A].stable.lock().unwrap(),
            vec![true],
            "the held copy was declared stable while it was delivered"
        );
        // A frame sent straight from a buffer nobody declared is not.
        plain(&net, Endpoint::Uplink(0), &bytes);
        assert_eq!(*net.ports[P10A].stable.lock().unwrap(), vec![true, false]);
    }
}

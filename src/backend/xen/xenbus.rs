//! The xenstore side of every vif, in one thread: finds the vifs to serve under
//! backend/vif/, offers our features (InitWait), connects when the netfront is ready
//! (maps its rings, binds its event channels, starts the worker), and disconnects on
//! Closing or when either end goes away (Closing -> Closed), so `xl destroy`, a domU
//! reboot and a netfront reload all end cleanly. It reconciles every vif with what
//! xenstore says on each watch event (and once a second), so a missed event costs a
//! second, never a stuck vif.

use std::collections::BTreeSet;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::thread::{self, JoinHandle};
use std::time::Duration;

use thiserror::Error;
use tracing::{info, warn};

use super::tx;
use super::vif::{Conn, Queue, RxSide, VifPort};
use crate::backend::switch::{Switch, SwitchPort};
use crate::config::XenVifTarget;
use crate::netif::{self, FrontFeatures};
use crate::sys::xen::evtchn::EvtchnDev;
use crate::sys::xen::gntdev::Gntdev;
use crate::sys::xen::xenstore::{Xenstore, XsError};
use crate::sys::xen::DomId;

const BACKEND_ROOT: &str = "/local/domain/0/backend/vif";
/// XenbusState values.
const INITIALISING: u32 = 1;
const INIT_WAIT: u32 = 2;
const INITIALISED: u32 = 3;
const CONNECTED: u32 = 4;
const CLOSING: u32 = 5;
const CLOSED: u32 = 6;

#[derive(Debug, Error)]
enum ConnectError {
    #[error(transparent)]
    Xs(#[from] XsError),
    #[error("frontend key {0}: {1}")]
    Key(String, String),
    #[error("the netfront does not request-rx-copy (page flipping is not supported)")]
    NoRxCopy,
    #[error("the netfront asks for {0} queues; 1 to {1} are offered (multi-queue-max-queues)")]
    Queues(u32, usize),
    #[error("{0}")]
    Shared(String),
    #[error("{0}: {1}")]
    Io(&'static str, std::io::Error),
}

/// One vif slot: what it serves and, while attached, to whom.
struct Slot {
    port: Arc<VifPort>,
    /// Fixed (domid, devid) for `domid=`; `None` for an `auto` slot.
    fixed: Option<(DomId, u32)>,
    attached: Option<Attached>,
}

struct Attached {
    dom: DomId,
    devid: u32,
    frontend: Option<String>,
    /// The connection and its workers, one per queue.
    worker: Option<(Arc<Conn>, Vec<JoinHandle<()>>)>,
}

impl Attached {
    fn be(&self) -> String {
        format!("{BACKEND_ROOT}/{}/{}", self.dom, self.devid)
    }
}

/// Starts the xenstore thread for `ports` (their targets in `targets`, in order).
pub fn start(ports: Vec<(Arc<VifPort>, XenVifTarget)>, switch: Arc<Switch>) -> std::io::Result<()> {
    let slots: Vec<Slot> = ports
        .into_iter()
        .map(|(port, t)| Slot {
            port,
            fixed: match t {
                XenVifTarget::One { domid, devid } => Some((domid, devid)),
                XenVifTarget::Auto { .. } => None,
            },
            attached: None,
        })
        .collect();
    let gnt = Arc::new(Mutex::new(None::<Arc<Gntdev>>));
    thread::Builder::new()
        .name("xenbus".into())
        .spawn(move || run(slots, switch, gnt))
        .map(|_| ())
}

fn run(mut slots: Vec<Slot>, switch: Arc<Switch>, gnt: Arc<Mutex<Option<Arc<Gntdev>>>>) {
    let mut warned = false;
    loop {
        let mut xs = match Xenstore::open().and_then(|mut xs| {
            xs.watch(BACKEND_ROOT, "backend")?;
            Ok(xs)
        }) {
            Ok(xs) => xs,
            Err(e) => {
                if !warned {
                    warn!("cannot reach xenstore ({e}); retrying every second");
                    warned = true;
                }
                thread::sleep(Duration::from_secs(1));
                continue;
            }
        };
        info!("xenstore connected; serving vifs under {BACKEND_ROOT}");
        loop {
            if let Err(e) = reconcile_all(&mut xs, &mut slots, &switch, &gnt) {
                warn!("xenstore: {e}; reconnecting");
                break;
            }
            match xs.next_event(Duration::from_secs(1)) {
                Ok(_) => {
                    // One rescan covers every event queued meanwhile.
                    thread::sleep(Duration::from_millis(20));
                    while let Ok(Some(_)) = xs.next_event(Duration::ZERO) {}
                    xs.clear_events();
                }
                Err(e) => {
                    warn!("xenstore: {e}; reconnecting");
                    break;
                }
            }
        }
        thread::sleep(Duration::from_secs(1));
    }
}

fn reconcile_all(
    xs: &mut Xenstore,
    slots: &mut [Slot],
    switch: &Arc<Switch>,
    gnt: &Arc<Mutex<Option<Arc<Gntdev>>>>,
) -> Result<(), XsError> {
    // Attach fixed slots whose backend exists, and auto slots to new vifs.
    let mut present = BTreeSet::new();
    for d in xs.directory(BACKEND_ROOT)? {
        let Ok(dom) = d.parse::<DomId>() else {
            continue;
        };
        for n in xs.directory(&format!("{BACKEND_ROOT}/{d}"))? {
            if let Ok(devid) = n.parse::<u32>() {
                present.insert((dom, devid));
            }
        }
    }
    let taken: BTreeSet<(DomId, u32)> = slots
        .iter()
        .filter_map(|s| s.attached.as_ref().map(|a| (a.dom, a.devid)))
        .chain(slots.iter().filter_map(|s| s.fixed))
        .collect();
    for s in slots.iter_mut().filter(|s| s.attached.is_none()) {
        let want = match s.fixed {
            Some(f) => present.contains(&f).then_some(f),
            None => present.iter().find(|v| !taken.contains(v)).copied(),
        };
        if let Some((dom, devid)) = want {
            s.attached = Some(Attached {
                dom,
                devid,
                frontend: None,
                worker: None,
            });
            s.port.set_name(Some(format!("vif{dom}.{devid}")));
            info!(vif = %s.port.name(), "vif found");
            // Auto slots take one new vif per rescan each; `taken` is recomputed next time.
            if s.fixed.is_none() {
                break;
            }
        }
    }
    for s in slots.iter_mut() {
        if s.attached.is_some() {
            reconcile(xs, s, switch, gnt)?;
        }
    }
    Ok(())
}

fn read_u32(xs: &mut Xenstore, path: &str) -> Result<Option<u32>, XsError> {
    Ok(xs.try_read(path)?.and_then(|v| v.trim().parse().ok()))
}

fn flag(xs: &mut Xenstore, path: &str) -> Result<bool, XsError> {
    Ok(read_u32(xs, path)? == Some(1))
}

/// Steps one attached vif towards what both ends' states ask.
fn reconcile(
    xs: &mut Xenstore,
    s: &mut Slot,
    switch: &Arc<Switch>,
    gnt: &Arc<Mutex<Option<Arc<Gntdev>>>>,
) -> Result<(), XsError> {
    let Some(a) = s.attached.as_mut() else {
        return Ok(());
    };
    let be = a.be();
    let Some(frontend) = xs.try_read(&format!("{be}/frontend"))? else {
        // The backend directory is gone (the toolstack removed the vif).
        disconnect(s, switch);
        if let Some(a) = s.attached.take() {
            info!(vif = %format!("vif{}.{}", a.dom, a.devid), "vif removed");
        }
        s.port.set_name(None);
        return Ok(());
    };
    if a.frontend.as_deref() != Some(frontend.as_str()) {
        if let Some(old) = a.frontend.take() {
            let _ = xs.unwatch(&format!("{old}/state"), "frontend");
        }
        xs.watch(&format!("{frontend}/state"), "frontend")?;
        a.frontend = Some(frontend.clone());
    }
    let state = read_u32(xs, &format!("{be}/state"))?.unwrap_or(0);
    let fe_state = read_u32(xs, &format!("{frontend}/state"))?.unwrap_or(0);
    let online = xs.try_read(&format!("{be}/online"))?.as_deref() != Some("0");
    let connected = a.worker.is_some();
    match state {
        0 | INITIALISING => {
            advertise(xs, &be, s)?;
            xs.write(&format!("{be}/state"), &INIT_WAIT.to_string())?;
        }
        INIT_WAIT | INITIALISED if matches!(fe_state, INITIALISED | CONNECTED) => {
            let hotplug_ok = xs.try_read(&format!("{be}/script"))?.is_none()
                || xs.try_read(&format!("{be}/hotplug-status"))?.as_deref() == Some("connected");
            if !hotplug_ok {
                return Ok(());
            }
            match connect(xs, s, &frontend, switch, gnt) {
                Ok(()) => {
                    xs.write(&format!("{be}/state"), &CONNECTED.to_string())?;
                    info!(vif = %s.port.name(), caps = ?s.port.rx_caps(), "netfront connected");
                }
                Err(ConnectError::Xs(e)) => return Err(e),
                Err(e) => {
                    warn!(vif = %s.port.name(), "cannot connect the netfront: {e}");
                    let _ = xs.write(&format!("{be}/error"), &e.to_string());
                    xs.write(&format!("{be}/state"), &CLOSING.to_string())?;
                }
            }
        }
        CONNECTED if !matches!(fe_state, CONNECTED | INITIALISED) || !connected => {
            disconnect(s, switch);
            xs.write(&format!("{be}/state"), &CLOSING.to_string())?;
            if !matches!(fe_state, CONNECTED) {
                xs.write(&format!("{be}/state"), &CLOSED.to_string())?;
            }
        }
        CLOSING => {
            disconnect(s, switch);
            xs.write(&format!("{be}/state"), &CLOSED.to_string())?;
        }
        CLOSED => {
            if connected {
                disconnect(s, switch);
            }
            // A netfront starting over (driver reload, kexec) gets a fresh InitWait.
            if online && matches!(fe_state, INITIALISING | INIT_WAIT) {
                advertise(xs, &be, s)?;
                xs.write(&format!("{be}/state"), &INIT_WAIT.to_string())?;
            }
        }
        _ => {}
    }
    Ok(())
}

/// The keys a netfront reads in InitWait.
fn advertise(xs: &mut Xenstore, be: &str, s: &Slot) -> Result<(), XsError> {
    let tso = if s.port.cfg.tso { "1" } else { "0" };
    let csum = s.port.cfg.csum;
    for (k, v) in [
        ("feature-sg", "1"),
        ("feature-gso-tcpv4", tso),
        ("feature-gso-tcpv6", tso),
        ("feature-ipv6-csum-offload", if csum { "1" } else { "0" }),
        ("feature-no-csum-offload", if csum { "0" } else { "1" }),
        ("feature-rx-copy", "1"),
        ("feature-rx-flip", "0"),
        ("feature-split-event-channels", "1"),
    ] {
        xs.write(&format!("{be}/{k}"), v)?;
    }
    xs.write(
        &format!("{be}/multi-queue-max-queues"),
        &s.port.max_queues().to_string(),
    )?;
    Ok(())
}

fn front_key(xs: &mut Xenstore, fe: &str, key: &str) -> Result<u32, ConnectError> {
    let path = format!("{fe}/{key}");
    let v = xs
        .try_read(&path)?
        .ok_or_else(|| ConnectError::Key(key.into(), "missing".into()))?;
    v.trim()
        .parse()
        .map_err(|_| ConnectError::Key(key.into(), format!("{v:?} is not a number")))
}

/// What one queue's keys say: its rings and the netfront's event channels (one, or
/// TX and RX when split).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct QueueKeys {
    tx_ref: u32,
    rx_ref: u32,
    tx_evt: u32,
    rx_evt: Option<u32>,
}

/// Reads the keys of each queue: at the frontend's top level for one queue, under
/// `queue-N/` for more (netif.h, "Multi-queue support").
fn queue_keys(xs: &mut Xenstore, fe: &str, n: u32) -> Result<Vec<QueueKeys>, ConnectError> {
    let mut out = Vec::with_capacity(n as usize);
    for i in 0..n {
        let (dir, name) = if n == 1 {
            (fe.to_string(), String::new())
        } else {
            (format!("{fe}/queue-{i}"), format!("queue-{i}/"))
        };
        let key = |xs: &mut Xenstore, k: &str| {
            front_key(xs, &dir, k).map_err(|e| match e {
                ConnectError::Key(k, why) => ConnectError::Key(format!("{name}{k}"), why),
                e => e,
            })
        };
        let tx_ref = key(xs, "tx-ring-ref")?;
        let rx_ref = key(xs, "rx-ring-ref")?;
        let (tx_evt, rx_evt) = match read_u32(xs, &format!("{dir}/event-channel"))? {
            Some(p) => (p, None),
            None => (
                key(xs, "event-channel-tx")?,
                Some(key(xs, "event-channel-rx")?),
            ),
        };
        out.push(QueueKeys {
            tx_ref,
            rx_ref,
            tx_evt,
            rx_evt,
        });
    }
    Ok(out)
}

/// Refuses rings or event channels that two places name: two queues' (or one
/// queue's TX and RX) rings in one page would have two workers, or both ends of a
/// ring, write the same slots; a channel bound twice would mix two queues' events.
fn check_distinct(queues: &[QueueKeys]) -> Result<(), ConnectError> {
    let mut rings: Vec<(u32, String)> = Vec::new();
    let mut evts: Vec<(u32, String)> = Vec::new();
    for (i, q) in queues.iter().enumerate() {
        for (r, what) in [(q.tx_ref, "tx-ring-ref"), (q.rx_ref, "rx-ring-ref")] {
            let name = format!("queue {i}'s {what}");
            if let Some((_, other)) = rings.iter().find(|(x, _)| *x == r) {
                return Err(ConnectError::Shared(format!(
                    "{name} {r} is {other} too: rings shared between queues are refused"
                )));
            }
            rings.push((r, name));
        }
        let split = q.rx_evt.map(|p| (p, "event-channel-rx"));
        for (p, what) in std::iter::once((q.tx_evt, "event channel")).chain(split) {
            let name = format!("queue {i}'s {what}");
            if let Some((_, other)) = evts.iter().find(|(x, _)| *x == p) {
                return Err(ConnectError::Shared(format!(
                    "{name} {p} is {other} too: event channels shared between queues are refused"
                )));
            }
            evts.push((p, name));
        }
    }
    Ok(())
}

fn connect(
    xs: &mut Xenstore,
    s: &mut Slot,
    fe: &str,
    switch: &Arc<Switch>,
    gnt_cache: &Arc<Mutex<Option<Arc<Gntdev>>>>,
) -> Result<(), ConnectError> {
    disconnect(s, switch);
    let max = s.port.max_queues();
    let Some(a) = s.attached.as_mut() else {
        return Ok(());
    };
    let n = match xs.try_read(&format!("{fe}/multi-queue-num-queues"))? {
        None => 1,
        Some(v) => v.trim().parse::<u32>().map_err(|_| {
            ConnectError::Key(
                "multi-queue-num-queues".into(),
                format!("{v:?} is not a number"),
            )
        })?,
    };
    if n == 0 || n as usize > max {
        return Err(ConnectError::Queues(n, max));
    }
    if !flag(xs, &format!("{fe}/request-rx-copy"))? {
        return Err(ConnectError::NoRxCopy);
    }
    let keys = queue_keys(xs, fe, n)?;
    check_distinct(&keys)?;
    let features = FrontFeatures {
        sg: flag(xs, &format!("{fe}/feature-sg"))?,
        gso_tcpv4: flag(xs, &format!("{fe}/feature-gso-tcpv4"))?,
        gso_tcpv6: flag(xs, &format!("{fe}/feature-gso-tcpv6"))?,
        no_csum_offload: flag(xs, &format!("{fe}/feature-no-csum-offload"))?,
        ipv6_csum_offload: flag(xs, &format!("{fe}/feature-ipv6-csum-offload"))?,
    };
    let gnt = {
        let mut g = gnt_cache.lock().unwrap_or_else(|e| e.into_inner());
        match &*g {
            Some(g) => g.clone(),
            None => {
                let n =
                    Arc::new(Gntdev::open().map_err(|e| ConnectError::Io("/dev/xen/gntdev", e))?);
                *g = Some(n.clone());
                n
            }
        }
    };
    let dom = a.dom;
    let mut queues = Vec::with_capacity(keys.len());
    for (index, k) in keys.iter().enumerate() {
        let tx_ring = gnt
            .map(dom, k.tx_ref)
            .map_err(|e| ConnectError::Io("mapping a TX ring", e))?;
        let rx_ring = gnt
            .map(dom, k.rx_ref)
            .map_err(|e| ConnectError::Io("mapping an RX ring", e))?;
        let evt = EvtchnDev::open().map_err(|e| ConnectError::Io("/dev/xen/evtchn", e))?;
        let tx_port = evt
            .bind_interdomain(dom, k.tx_evt)
            .map_err(|e| ConnectError::Io("binding an event channel", e))?;
        let rx_port = match k.rx_evt {
            Some(p) => evt
                .bind_interdomain(dom, p)
                .map_err(|e| ConnectError::Io("binding an RX event channel", e))?,
            None => tx_port,
        };
        queues.push(Queue {
            index,
            dom,
            gnt: gnt.clone(),
            evt,
            tx_port,
            rx_port,
            tx_ring,
            rx: Mutex::new(RxSide::new(rx_ring)),
        });
    }
    let cfg = &s.port.cfg;
    let conn = Arc::new(Conn::new(
        dom,
        netif::rx_caps(features, cfg.csum, cfg.tso),
        queues,
    ));
    let mut workers = Vec::with_capacity(conn.queues.len());
    for q in 0..conn.queues.len() {
        let (p, c, sw) = (s.port.clone(), conn.clone(), switch.clone());
        // vifD.N for the first queue (as with one), vifD.N-qK for the others.
        let name = match q {
            0 => format!("vif{}.{}", a.dom, a.devid),
            _ => format!("vif{}.{}-q{q}", a.dom, a.devid),
        };
        match thread::Builder::new()
            .name(name)
            .spawn(move || tx::run(p, c, q, sw))
        {
            Ok(h) => workers.push(h),
            Err(e) => {
                conn.stop.store(true, Ordering::Release);
                for h in workers {
                    let _ = h.join();
                }
                return Err(ConnectError::Io("starting a worker", e));
            }
        }
    }
    info!(vif = %s.port.name(), queues = conn.queues.len(), "netfront queues mapped");
    a.worker = Some((conn.clone(), workers));
    s.port.set_conn(Some(conn));
    switch.caps_changed();
    Ok(())
}

/// Stops the workers, forgets the connection (rings unmapped and ports unbound when
/// the last sender lets go of it) and the vif's addresses.
fn disconnect(s: &mut Slot, switch: &Arc<Switch>) {
    let Some(a) = s.attached.as_mut() else { return };
    let Some((conn, workers)) = a.worker.take() else {
        return;
    };
    conn.stop.store(true, Ordering::Release);
    for h in workers {
        let _ = h.join();
    }
    s.port.set_conn(None);
    switch.port_down(s.port.id);
    info!(vif = %s.port.name(), "netfront disconnected");
}

#[cfg(test)]
mod tests {
    use super::*;

    fn q(tx_ref: u32, rx_ref: u32, tx_evt: u32, rx_evt: Option<u32>) -> QueueKeys {
        QueueKeys {
            tx_ref,
            rx_ref,
            tx_evt,
            rx_evt,
        }
    }

    #[test]
    fn rings_and_channels_named_twice_are_refused() {
        assert!(check_distinct(&[q(8, 9, 5, Some(6)), q(10, 11, 7, Some(12))]).is_ok());
        assert!(check_distinct(&[q(8, 9, 5, None)]).is_ok());
        for bad in [
            vec![q(8, 9, 5, None), q(8, 11, 7, None)],
            vec![q(8, 9, 5, None), q(10, 9, 7, None)],
            vec![q(8, 9, 5, None), q(9, 11, 7, None)],
            vec![q(8, 8, 5, None)],
            vec![q(8, 9, 5, None), q(10, 11, 5, None)],
            vec![q(8, 9, 5, Some(6)), q(10, 11, 7, Some(6))],
            vec![q(8, 9, 5, Some(5))],
        ] {
            let e = check_distinct(&bad).expect_err("shared accepted");
            assert!(e.to_string().contains("shared between queues"), "{e}");
        }
    }
}

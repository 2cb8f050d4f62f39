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
use super::vif::{Conn, RxSide, VifPort};
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
    #[error("the netfront asks for {0} queues; one is offered")]
    Queues(u32),
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
    worker: Option<(Arc<Conn>, JoinHandle<()>)>,
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

fn connect(
    xs: &mut Xenstore,
    s: &mut Slot,
    fe: &str,
    switch: &Arc<Switch>,
    gnt_cache: &Arc<Mutex<Option<Arc<Gntdev>>>>,
) -> Result<(), ConnectError> {
    disconnect(s, switch);
    let Some(a) = s.attached.as_mut() else {
        return Ok(());
    };
    if let Some(q) = read_u32(xs, &format!("{fe}/multi-queue-num-queues"))? {
        if q > 1 {
            return Err(ConnectError::Queues(q));
        }
    }
    if !flag(xs, &format!("{fe}/request-rx-copy"))? {
        return Err(ConnectError::NoRxCopy);
    }
    let tx_ref = front_key(xs, fe, "tx-ring-ref")?;
    let rx_ref = front_key(xs, fe, "rx-ring-ref")?;
    let (tx_evt, rx_evt) = match read_u32(xs, &format!("{fe}/event-channel"))? {
        Some(p) => (p, None),
        None => (
            front_key(xs, fe, "event-channel-tx")?,
            Some(front_key(xs, fe, "event-channel-rx")?),
        ),
    };
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
    let tx_ring = gnt
        .map(dom, tx_ref)
        .map_err(|e| ConnectError::Io("mapping the TX ring", e))?;
    let rx_ring = gnt
        .map(dom, rx_ref)
        .map_err(|e| ConnectError::Io("mapping the RX ring", e))?;
    let evt = EvtchnDev::open().map_err(|e| ConnectError::Io("/dev/xen/evtchn", e))?;
    let tx_port = evt
        .bind_interdomain(dom, tx_evt)
        .map_err(|e| ConnectError::Io("binding the event channel", e))?;
    let rx_port = match rx_evt {
        Some(p) => evt
            .bind_interdomain(dom, p)
            .map_err(|e| ConnectError::Io("binding the RX event channel", e))?,
        None => tx_port,
    };
    let cfg = &s.port.cfg;
    let conn = Arc::new(Conn {
        dom,
        gnt,
        evt,
        tx_port,
        rx_port,
        tx_ring,
        rx: Mutex::new(RxSide::new(rx_ring)),
        rx_caps: netif::rx_caps(features, cfg.csum, cfg.tso),
        stop: Default::default(),
    });
    let (p, c, sw) = (s.port.clone(), conn.clone(), switch.clone());
    let h = thread::Builder::new()
        .name(format!("vif{}.{}", a.dom, a.devid))
        .spawn(move || tx::run(p, c, sw))
        .map_err(|e| ConnectError::Io("starting the worker", e))?;
    a.worker = Some((conn.clone(), h));
    s.port.set_conn(Some(conn));
    switch.caps_changed();
    Ok(())
}

/// Stops the worker, forgets the connection (rings unmapped and ports unbound when
/// the last sender lets go of it) and the vif's addresses.
fn disconnect(s: &mut Slot, switch: &Arc<Switch>) {
    let Some(a) = s.attached.as_mut() else { return };
    let Some((conn, h)) = a.worker.take() else {
        return;
    };
    conn.stop.store(true, Ordering::Release);
    let _ = h.join();
    s.port.set_conn(None);
    switch.port_down(s.port.id);
    info!(vif = %s.port.name(), "netfront disconnected");
}

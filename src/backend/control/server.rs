//! The control socket's server: reports counters and applies `gsonet ctl` settings
//! to the ports and uplinks it was given.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::Arc;
use std::thread;

use tracing::{debug, info};

use super::protocol::{Applied, PortReport, Reply, Request, StatsReport, UplinkReport};
use crate::backend::socket::bind_exclusive;
use crate::backend::uplink::Uplink;
use crate::backend::vhost::port::Port;
use crate::config::{parse_max_burst, parse_on_off};

/// Everything the control socket reports on and changes.
pub struct Registry {
    pub ports: Vec<Arc<Port>>,
    pub uplinks: Vec<Arc<dyn Uplink>>,
}

pub fn report(r: &Registry) -> StatsReport {
    StatsReport {
        ports: r
            .ports
            .iter()
            .map(|p| {
                let n = p.negotiated();
                PortReport {
                    id: p.id,
                    name: p.name(),
                    connected: p.is_connected(),
                    guest_rx: n.map(|n| n.rx),
                    guest_tx: n.map(|n| n.tx),
                    mrg_rxbuf: n.map(|n| n.mrg_rxbuf),
                    max_burst: p.max_burst(),
                    vlan: p.cfg.vlan.map(|v| v.get()),
                    stats: p.stats.snapshot(),
                }
            })
            .collect(),
        uplinks: r
            .uplinks
            .iter()
            .enumerate()
            .map(|(i, u)| UplinkReport {
                id: i,
                name: u.name(),
                gso: u.gso_mode(),
                stats: u.counters().snapshot(),
            })
            .collect(),
    }
}

const TARGETS: &str = "target is port:N|SOCKET or uplink:N|NAME";

fn apply(r: &Registry, target: &str, settings: &[(String, String)]) -> Result<Applied, String> {
    let (kind, which) = target.split_once(':').ok_or(TARGETS)?;
    match kind {
        "port" => {
            let p = r
                .ports
                .iter()
                .find(|p| {
                    p.id.to_string() == which
                        || p.name() == which
                        || p.name().ends_with(&format!("/{which}"))
                })
                .ok_or_else(|| format!("no port {which}"))?;
            let mut mask = p.mask();
            let mut burst = p.max_burst();
            for (k, v) in settings {
                if k == "max_burst" {
                    burst = parse_max_burst(v).map_err(|e| format!("max_burst={v}: {e}"))?;
                } else {
                    let on = parse_on_off(v).map_err(|e| format!("{k}={v}: {e}"))?;
                    if !mask.set(k, on) {
                        return Err(format!("unknown port setting {k}"));
                    }
                }
            }
            p.set_mask(mask);
            p.set_max_burst(burst);
            Ok(Applied::Port {
                port: p.name(),
                offer: format!("{:#x}", p.offered()),
                max_burst: burst,
                note: "offload changes apply to the next frontend connection (QEMU reads a \
                       backend's features once per connection)"
                    .into(),
            })
        }
        "uplink" => {
            let u = r
                .uplinks
                .iter()
                .enumerate()
                .find(|(i, u)| {
                    i.to_string() == which
                        || u.name() == which
                        || u.name().ends_with(&format!("={which}"))
                })
                .map(|(_, u)| u)
                .ok_or_else(|| format!("no uplink {which}"))?;
            let mut burst = crate::backend::switch::deliver::Destination::max_burst(u.as_ref());
            for (k, v) in settings {
                match k.as_str() {
                    "gso" => u.set_gso_mode(v.parse()?),
                    "max_burst" => {
                        burst = parse_max_burst(v).map_err(|e| format!("max_burst={v}: {e}"))?;
                        u.set_max_burst(burst);
                    }
                    _ => return Err(format!("unknown uplink setting {k} (gso, max_burst)")),
                }
            }
            Ok(Applied::Uplink {
                uplink: u.name(),
                gso: u.gso_mode(),
                max_burst: burst,
            })
        }
        _ => Err(TARGETS.into()),
    }
}

fn answer(r: &Registry, line: &str) -> Reply {
    match serde_json::from_str::<Request>(line) {
        Ok(Request::Stats) => Reply::Stats(report(r)),
        Ok(Request::Set { target, settings }) => match apply(r, &target, &settings) {
            Ok(ok) => Reply::Ok { ok },
            Err(error) => Reply::Error { error },
        },
        Err(e) => Reply::Error {
            error: format!("bad request: {e}"),
        },
    }
}

fn client(r: Arc<Registry>, s: UnixStream) {
    let Ok(mut w) = s.try_clone() else { return };
    for line in BufReader::new(s).lines() {
        let Ok(line) = line else { return };
        let Ok(mut out) = serde_json::to_string(&answer(&r, &line)) else {
            return;
        };
        out.push('\n');
        if w.write_all(out.as_bytes()).is_err() {
            return;
        }
    }
}

/// Serves the control socket forever.
pub fn serve(path: &Path, registry: Registry) -> std::io::Result<()> {
    let l = bind_exclusive(path)?;
    info!(control = %path.display(), "control socket ready");
    let registry = Arc::new(registry);
    for s in l.incoming() {
        match s {
            Ok(s) => {
                let r = registry.clone();
                let _ = thread::Builder::new()
                    .name("control".into())
                    .spawn(move || client(r, s));
            }
            Err(e) => debug!("control accept: {e}"),
        }
    }
    Ok(())
}

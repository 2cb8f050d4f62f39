//! The control socket: one JSON request per line, one JSON answer per line. `gsonet
//! stats` and `gsonet ctl` are its clients.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::sync::Arc;
use std::thread;

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use tracing::{debug, info};

use super::stats::Snapshot;
use super::switch::Switch;
use super::DaemonError;
use crate::config::GsoMode;
use crate::features::Caps;

#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "cmd", rename_all = "lowercase")]
pub enum Request {
    Stats,
    /// Changes a port (`port:N` or `port:SOCKET`) or an uplink (`uplink:N` or its name).
    Set {
        target: String,
        #[serde(default)]
        settings: Vec<(String, String)>,
    },
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PortReport {
    pub id: usize,
    pub name: String,
    pub connected: bool,
    /// What the guest accepts from gsonet (GUEST_* acked).
    pub guest_rx: Option<Caps>,
    /// What the guest may send (HOST_* acked).
    pub guest_tx: Option<Caps>,
    pub mrg_rxbuf: Option<bool>,
    pub max_burst: Option<usize>,
    /// Access VLAN; absent: the untagged domain.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vlan: Option<u16>,
    pub stats: Snapshot,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct UplinkReport {
    pub id: usize,
    pub name: String,
    pub gso: GsoMode,
    pub stats: Snapshot,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StatsReport {
    pub ports: Vec<PortReport>,
    pub uplinks: Vec<UplinkReport>,
}

pub fn report(sw: &Switch) -> StatsReport {
    StatsReport {
        ports: sw
            .ports()
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
        uplinks: sw
            .uplinks()
            .iter()
            .enumerate()
            .map(|(i, u)| UplinkReport {
                id: i,
                name: u.name(),
                gso: u.gso_mode(),
                stats: u.stats().snapshot(),
            })
            .collect(),
    }
}

fn parse_burst(v: &str) -> Result<Option<usize>, String> {
    match v {
        "off" | "none" | "0" => Ok(None),
        _ => v
            .parse::<usize>()
            .ok()
            .filter(|&n| (68..=65535).contains(&n))
            .map(Some)
            .ok_or_else(|| format!("max_burst={v}: expected 68..65535 or off")),
    }
}

fn apply(sw: &Switch, target: &str, settings: &[(String, String)]) -> Result<Value, String> {
    let (kind, which) = target
        .split_once(':')
        .ok_or("target is port:N|SOCKET or uplink:N|NAME")?;
    match kind {
        "port" => {
            let p = sw
                .ports()
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
                    burst = parse_burst(v)?;
                } else {
                    let on = match v.as_str() {
                        "on" => true,
                        "off" => false,
                        _ => return Err(format!("{k}={v}: expected on or off")),
                    };
                    if !mask.set(k, on) {
                        return Err(format!("unknown port setting {k}"));
                    }
                }
            }
            p.set_mask(mask);
            p.set_max_burst(burst);
            Ok(
                json!({"port": p.name(), "offer": format!("{:#x}", p.offered()), "max_burst": burst,
                      "note": "offload changes apply to the next frontend connection (QEMU reads a backend's features once per connection)"}),
            )
        }
        "uplink" => {
            let u = sw
                .uplinks()
                .iter()
                .enumerate()
                .find(|(i, u)| {
                    i.to_string() == which
                        || u.name() == which
                        || u.name().ends_with(&format!("={which}"))
                })
                .map(|(_, u)| u)
                .ok_or_else(|| format!("no uplink {which}"))?;
            for (k, v) in settings {
                match k.as_str() {
                    "gso" => u.set_gso_mode(v.parse()?),
                    "max_burst" => u.set_max_burst(parse_burst(v)?),
                    _ => return Err(format!("unknown uplink setting {k} (gso, max_burst)")),
                }
            }
            Ok(json!({"uplink": u.name(), "gso": u.gso_mode()}))
        }
        _ => Err("target is port:N|SOCKET or uplink:N|NAME".into()),
    }
}

fn answer(sw: &Switch, line: &str) -> Value {
    match serde_json::from_str::<Request>(line) {
        Ok(Request::Stats) => serde_json::to_value(report(sw)).unwrap_or(Value::Null),
        Ok(Request::Set { target, settings }) => match apply(sw, &target, &settings) {
            Ok(v) => json!({"ok": v}),
            Err(e) => json!({"error": e}),
        },
        Err(e) => json!({"error": format!("bad request: {e}")}),
    }
}

fn client(sw: Arc<Switch>, s: UnixStream) {
    let Ok(mut w) = s.try_clone() else { return };
    for line in BufReader::new(s).lines() {
        let Ok(line) = line else { return };
        let mut out = answer(&sw, &line).to_string();
        out.push('\n');
        if w.write_all(out.as_bytes()).is_err() {
            return;
        }
    }
}

/// Serves the control socket forever.
pub fn serve(path: &Path, sw: Arc<Switch>) -> Result<(), DaemonError> {
    let err = |e| DaemonError::Control {
        path: path.display().to_string(),
        err: e,
    };
    if path.exists() {
        if UnixStream::connect(path).is_ok() {
            return Err(err(std::io::Error::new(
                std::io::ErrorKind::AddrInUse,
                "in use by a running gsonet",
            )));
        }
        let _ = std::fs::remove_file(path);
    }
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(err)?;
    }
    let l = UnixListener::bind(path).map_err(err)?;
    info!(control = %path.display(), "control socket ready");
    for s in l.incoming() {
        match s {
            Ok(s) => {
                let sw = sw.clone();
                let _ = thread::Builder::new()
                    .name("control".into())
                    .spawn(move || client(sw, s));
            }
            Err(e) => debug!("control accept: {e}"),
        }
    }
    Ok(())
}

/// Client side: one request, one answer.
pub fn request(path: &Path, req: &Request) -> std::io::Result<Value> {
    let mut s = UnixStream::connect(path)?;
    let mut line = serde_json::to_string(req).map_err(std::io::Error::other)?;
    line.push('\n');
    s.write_all(line.as_bytes())?;
    let mut answer = String::new();
    BufReader::new(s).read_line(&mut answer)?;
    serde_json::from_str(&answer).map_err(std::io::Error::other)
}

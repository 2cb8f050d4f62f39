//! What the control socket speaks: requests, replies and the stats report, as serde
//! types shared by the daemon, the CLI and the tests.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::config::GsoMode;
use crate::features::Caps;
use crate::stats::{QueueSnapshot, Snapshot};

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
    /// Adds a port (`kind` "port", `spec` as `--port` takes it) or an uplink (`kind`
    /// "uplink", `spec` as `--uplink` takes it).
    Add {
        kind: String,
        spec: String,
    },
    /// Removes a port (by id, socket path or file name) or an uplink (by id or name).
    Del {
        kind: String,
        which: String,
    },
    /// Reads the `--config` file again and applies the difference.
    Reload,
}

/// One answer line.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Reply {
    Error { error: String },
    Ok { ok: Applied },
    Stats(StatsReport),
}

/// What a `Set` changed.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Applied {
    Port {
        port: String,
        /// The feature word offered to the next frontend, in hex.
        offer: String,
        max_burst: Option<usize>,
        /// RX interrupt moderation now in force (0: off).
        #[serde(default)]
        rx_coalesce_usecs: u32,
        #[serde(default)]
        rx_coalesce_frames: u32,
        /// TX completion moderation now in force (0: off).
        #[serde(default)]
        tx_coalesce_usecs: u32,
        note: String,
    },
    Uplink {
        uplink: String,
        gso: GsoMode,
        max_burst: Option<usize>,
        /// `rate=` and `rx_rate=` now in force, in Mbit/s (none: unlimited).
        #[serde(default)]
        rate_mbit: Option<u64>,
        #[serde(default)]
        rx_rate_mbit: Option<u64>,
    },
    /// A port or uplink added: its id (as in `port:N`, never reused) and name.
    Added { added: String, id: usize },
    /// A port or uplink removed.
    Removed { removed: String, id: usize },
    /// What a reload did.
    Reloaded { reloaded: ReloadReport },
}

/// What a reload of the configuration file changed, each port by its socket path and
/// each uplink by its name.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct ReloadReport {
    pub added: Vec<String>,
    pub removed: Vec<String>,
    /// Changed in settings that apply live (as `gsonet ctl` applies them).
    pub changed: Vec<String>,
    /// Changed in settings that need a new port or uplink: removed and added again.
    pub recreated: Vec<String>,
    pub unchanged: usize,
    /// Settings of the file that a reload does not apply (they need a restart).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub not_applied: Vec<String>,
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
    /// The feature word the frontend acked (vhost-user ports).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub acked: Option<u64>,
    /// The feature word offered to the next frontend (vhost-user ports).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub offered: Option<u64>,
    /// Why `packed=auto` does not offer packed rings (no record of their positions).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub packed_refused: Option<String>,
    pub max_burst: Option<usize>,
    /// Access VLAN; absent: the untagged domain.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vlan: Option<u16>,
    /// Guest memory mapped now: regions (SET_MEM_TABLE, ADD/REM_MEM_REG) and bytes.
    #[serde(default)]
    pub mem_regions: usize,
    #[serde(default)]
    pub mem_bytes: u64,
    pub stats: Snapshot,
    /// Each queue's own counters, where a queue has a worker of its own (a Xen
    /// vif's); absent for other ports.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub queues: Vec<QueueSnapshot>,
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

/// Client side: one request, one answer.
pub fn request(path: &Path, req: &Request) -> std::io::Result<Reply> {
    let mut s = UnixStream::connect(path)?;
    let mut line = serde_json::to_string(req).map_err(std::io::Error::other)?;
    line.push('\n');
    s.write_all(line.as_bytes())?;
    let mut answer = String::new();
    BufReader::new(s).read_line(&mut answer)?;
    serde_json::from_str(&answer).map_err(std::io::Error::other)
}

#[cfg(test)]
mod tests {
    use super::*;

    use std::mem::discriminant;

    /// `r` sent and read back: the same variant (the enums are untagged, so a reply
    /// that parses as another variant is the failure to catch), nested variant too,
    /// and every field (the read-back value writes the same JSON).
    fn reads_back(r: &Reply) -> String {
        let text = serde_json::to_string(r).unwrap();
        let back: Reply = serde_json::from_str(&text).unwrap();
        assert_eq!(discriminant(&back), discriminant(r), "{text}");
        if let (Reply::Ok { ok: a }, Reply::Ok { ok: b }) = (r, &back) {
            assert_eq!(discriminant(a), discriminant(b), "{text}");
        }
        assert_eq!(
            serde_json::to_value(&back).unwrap(),
            serde_json::to_value(r).unwrap(),
            "{text}"
        );
        text
    }

    #[test]
    fn replies_read_back_as_what_was_sent() {
        let err = Reply::Error {
            error: "no port 9".into(),
        };
        assert_eq!(reads_back(&err), r#"{"error":"no port 9"}"#);
        let up = Reply::Ok {
            ok: Applied::Uplink {
                uplink: "tap=x".into(),
                gso: GsoMode::Software,
                max_burst: None,
                rate_mbit: Some(100),
                rx_rate_mbit: None,
            },
        };
        assert_eq!(
            reads_back(&up),
            r#"{"ok":{"uplink":"tap=x","gso":"software","max_burst":null,"rate_mbit":100,"rx_rate_mbit":null}}"#
        );
        let port = Reply::Ok {
            ok: Applied::Port {
                port: "port:1".into(),
                offer: "0x1".into(),
                max_burst: Some(64),
                rx_coalesce_usecs: 50,
                rx_coalesce_frames: 8,
                tx_coalesce_usecs: 20,
                note: "applied".into(),
            },
        };
        reads_back(&port);
        for ok in [
            Applied::Added {
                added: "a.sock".into(),
                id: 3,
            },
            Applied::Removed {
                removed: "a.sock".into(),
                id: 3,
            },
            Applied::Reloaded {
                reloaded: ReloadReport {
                    added: vec!["a".into()],
                    removed: vec!["b".into()],
                    changed: vec!["c".into()],
                    recreated: vec!["d".into()],
                    unchanged: 2,
                    not_applied: vec!["control_mode".into()],
                },
            },
        ] {
            reads_back(&Reply::Ok { ok });
        }
        let stats = Reply::Stats(StatsReport {
            ports: vec![PortReport {
                id: 0,
                name: "vm1.sock".into(),
                connected: true,
                guest_rx: Some(Caps::default()),
                guest_tx: None,
                mrg_rxbuf: Some(true),
                acked: Some(0x1_3000_0000),
                offered: Some(0x5_3000_0000),
                packed_refused: None,
                max_burst: None,
                vlan: Some(10),
                mem_regions: 3,
                mem_bytes: 1 << 30,
                stats: Snapshot::default(),
                queues: vec![QueueSnapshot {
                    queue: 1,
                    rx_full: 2,
                    ..QueueSnapshot::default()
                }],
            }],
            uplinks: vec![UplinkReport {
                id: 0,
                name: "tap=x".into(),
                gso: GsoMode::Pass,
                stats: Snapshot::default(),
            }],
        });
        reads_back(&stats);
    }
}

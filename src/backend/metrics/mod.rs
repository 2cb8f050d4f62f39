//! Prometheus metrics: every counter of `gsonet stats`, read at scrape time from the
//! same report the control socket sends, encoded by the `prometheus` crate in the text
//! format, served over HTTP at `/metrics` (`http`). docs/operations.md lists them.

pub mod http;

use prometheus::{CounterVec, Encoder, IntCounterVec, IntGaugeVec, Opts, Registry, TextEncoder};

use crate::backend::control::protocol::StatsReport;
use crate::backend::control::server::report;
use crate::backend::control::Registry as Endpoints;
use crate::config::GsoMode;
use crate::features::Caps;
use crate::stats::{DropReason, QueueSnapshot, Snapshot};
use crate::sys::netdev;

/// The labels naming one port or uplink: `kind` (port|uplink), `id` (its index, as in
/// `gsonet ctl port:N`) and `name` (the socket path, or `tap=NAME`/`dev=NAME`).
const ENDPOINT: [&str; 3] = ["kind", "id", "name"];

/// The offloads in `caps`, space-separated (`csum tso4 tso6`); empty for none.
pub fn caps_list(caps: &Caps) -> String {
    [
        ("csum", caps.csum),
        ("tso4", caps.tso4),
        ("tso6", caps.tso6),
        ("ecn", caps.ecn),
        ("ufo", caps.ufo),
        ("uso4", caps.uso4),
        ("uso6", caps.uso6),
    ]
    .iter()
    .filter(|(_, on)| *on)
    .map(|(n, _)| *n)
    .collect::<Vec<_>>()
    .join(" ")
}

/// The interface behind an uplink's name (`tap=gs0`, `dev=eth1`).
fn ifname(uplink: &str) -> &str {
    uplink.split_once('=').map_or(uplink, |(_, n)| n)
}

/// A series read from each of a kind of snapshot: an endpoint's `Snapshot`, or a
/// queue's `QueueSnapshot`.
struct Family<S> {
    name: &'static str,
    help: &'static str,
    value: fn(&S) -> u64,
}

/// A counter read from every endpoint's `Snapshot`.
type CounterFamily = Family<Snapshot>;

/// Every per-endpoint counter; names as exported, after the `gsonet_` prefix.
const COUNTERS: &[CounterFamily] = &[
    CounterFamily {
        name: "tx_frames_total",
        help:
            "Frames that entered gsonet from the endpoint (a guest's TX queue, an uplink's reads).",
        value: |s| s.tx_frames,
    },
    CounterFamily {
        name: "tx_bytes_total",
        help: "Bytes (after the virtio_net_hdr) that entered gsonet from the endpoint.",
        value: |s| s.tx_bytes,
    },
    CounterFamily {
        name: "rx_frames_total",
        help: "Frames gsonet delivered to the endpoint (a guest's RX queue, an uplink's writes).",
        value: |s| s.rx_frames,
    },
    CounterFamily {
        name: "rx_bytes_total",
        help: "Bytes (after the virtio_net_hdr) gsonet delivered to the endpoint.",
        value: |s| s.rx_bytes,
    },
    CounterFamily {
        name: "gso_passed_frames_total",
        help: "GSO frames handed to the endpoint intact, with their GSO header.",
        value: |s| s.gso_passed,
    },
    CounterFamily {
        name: "gso_segmented_frames_total",
        help: "GSO frames segmented in software for the endpoint.",
        value: |s| s.gso_segmented,
    },
    CounterFamily {
        name: "segments_out_total",
        help: "Segments software segmentation produced for the endpoint.",
        value: |s| s.segments_out,
    },
    CounterFamily {
        name: "segmented_bytes_total",
        help: "Bytes of the GSO frames segmented in software for the endpoint.",
        value: |s| s.bytes_segmented,
    },
    CounterFamily {
        name: "csum_completed_frames_total",
        help: "Frames whose partial checksum gsonet completed for the endpoint.",
        value: |s| s.csum_completed,
    },
    CounterFamily {
        name: "mac_moves_total",
        help: "Learned MAC addresses that moved to the endpoint from another.",
        value: |s| s.mac_moves,
    },
    CounterFamily {
        name: "tx_kick_wakeups_total",
        help: "Wake-ups on a port's TX kick fds (one may carry several of the guest's kicks).",
        value: |s| s.tx_kicks,
    },
    CounterFamily {
        name: "rx_kick_wakeups_total",
        help: "Wake-ups on a port's RX kick fds (the guest added receive buffers).",
        value: |s| s.rx_kicks,
    },
    CounterFamily {
        name: "tx_calls_total",
        help: "Interrupts requested for a port's TX completions.",
        value: |s| s.tx_calls,
    },
    CounterFamily {
        name: "rx_calls_total",
        help: "Interrupts requested for frames delivered to a port.",
        value: |s| s.rx_calls,
    },
    CounterFamily {
        name: "gro_frames_total",
        help: "GSO frames GRO built for a guest from in-order TCP segments or UDP datagrams.",
        value: |s| s.gro_frames,
    },
    CounterFamily {
        name: "gro_segments_total",
        help: "Segments GRO coalesced into those frames.",
        value: |s| s.gro_segments,
    },
    CounterFamily {
        name: "rx_one_copy_total",
        help: "Frames written into a guest straight from another guest's buffers (one copy).",
        value: |s| s.rx_one_copy,
    },
    CounterFamily {
        name: "tx_holds_total",
        help: "Times a port's TX queue was held for its rate= or a destination's rx_rate=.",
        value: |s| s.tx_holds,
    },
    CounterFamily {
        name: "tx_polls_total",
        help: "Looks at a port's TX queue by the tx_poll_us timer, kicks being off; for an uplink, reads of its queue by a sender.",
        value: |s| s.tx_polls,
    },
    CounterFamily {
        name: "rx_held_total",
        help: "An uplink's frames set aside for a full guest RX queue, re-sent as it adds buffers.",
        value: |s| s.rx_held,
    },
    CounterFamily {
        name: "rx_pauses_total",
        help: "Times an uplink's reads paused (1 ms at most) because all they got went to full guests.",
        value: |s| s.rx_pauses,
    },
    CounterFamily {
        name: "tx_held_total",
        help: "A port's TX frames set aside for a full guest RX queue, re-sent as it adds buffers.",
        value: |s| s.tx_held,
    },
    CounterFamily {
        name: "tx_pauses_total",
        help: "Times a port's TX queue was left alone (1 ms at most) because all a batch held went to full guests.",
        value: |s| s.tx_pauses,
    },
];

/// Gauges read from every endpoint's `Snapshot`.
const GAUGES: &[CounterFamily] = &[
    CounterFamily {
        name: "tx_max_frame_bytes",
        help: "Largest frame that entered gsonet from the endpoint.",
        value: |s| s.tx_max_frame,
    },
    CounterFamily {
        name: "segment_mss_max_bytes",
        help: "Largest MSS (payload per segment) software segmentation used for the endpoint; 0: none yet.",
        value: |s| s.max_mss,
    },
    CounterFamily {
        name: "segment_mss_min_bytes",
        help: "Smallest MSS software segmentation used for the endpoint; 0: none yet.",
        value: |s| s.min_mss,
    },
    CounterFamily {
        name: "segments_per_frame_max",
        help: "Most segments one GSO frame was cut into for the endpoint.",
        value: |s| s.max_segments,
    },
];

/// A counter read from each queue's `QueueSnapshot` (a Xen vif's queues).
type QueueFamily = Family<QueueSnapshot>;

/// Every per-queue counter, labelled as the endpoint's plus `queue`.
const QUEUE_COUNTERS: &[QueueFamily] = &[
    QueueFamily {
        name: "queue_tx_frames_total",
        help: "Frames that entered gsonet from one queue of a port (a Xen vif's queue).",
        value: |q| q.tx_frames,
    },
    QueueFamily {
        name: "queue_tx_bytes_total",
        help: "Bytes of the frames that entered gsonet from one queue of a port.",
        value: |q| q.tx_bytes,
    },
    QueueFamily {
        name: "queue_rx_frames_total",
        help: "Frames gsonet staged for one queue of a port (steered by their flow's hash).",
        value: |q| q.rx_frames,
    },
    QueueFamily {
        name: "queue_rx_bytes_total",
        help: "Bytes of the frames gsonet staged for one queue of a port.",
        value: |q| q.rx_bytes,
    },
    QueueFamily {
        name: "queue_tx_kick_wakeups_total",
        help: "Wake-ups of a queue's worker by its TX event channel.",
        value: |q| q.tx_kicks,
    },
    QueueFamily {
        name: "queue_rx_kick_wakeups_total",
        help: "Wake-ups of a queue's worker by its RX event channel (the frontend added receive buffers).",
        value: |q| q.rx_kicks,
    },
    QueueFamily {
        name: "queue_tx_calls_total",
        help: "Events sent to the frontend after a queue's TX responses.",
        value: |q| q.tx_calls,
    },
    QueueFamily {
        name: "queue_rx_calls_total",
        help: "Events sent to the frontend after a queue's RX responses.",
        value: |q| q.rx_calls,
    },
    QueueFamily {
        name: "queue_tx_polls_total",
        help: "Times a queue's worker found TX packets by its 200 ms look, without an event.",
        value: |q| q.tx_polls,
    },
    QueueFamily {
        name: "queue_rx_full_total",
        help: "Frames for a queue that found its RX ring without room (held by the sender, or dropped as rx_queue_full).",
        value: |q| q.rx_full,
    },
];

/// Every endpoint of a report with its label values and counters.
fn endpoints(r: &StatsReport) -> Vec<([String; 3], &Snapshot)> {
    let ports = r
        .ports
        .iter()
        .map(|p| (["port".into(), p.id.to_string(), p.name.clone()], &p.stats));
    let uplinks = r.uplinks.iter().map(|u| {
        (
            ["uplink".into(), u.id.to_string(), u.name.clone()],
            &u.stats,
        )
    });
    ports.chain(uplinks).collect()
}

fn gauge(i: u64) -> i64 {
    i64::try_from(i).unwrap_or(i64::MAX)
}

/// A registry holding the values of one report (a fresh one per scrape: the values are
/// the daemon's own atomics, read once).
fn registry(r: &StatsReport) -> prometheus::Result<Registry> {
    let reg = Registry::new_custom(Some("gsonet".into()), None)?;
    let all = endpoints(r);
    for f in COUNTERS {
        let c = IntCounterVec::new(Opts::new(f.name, f.help), &ENDPOINT)?;
        for (l, s) in &all {
            c.get_metric_with_label_values(l)?.inc_by((f.value)(s));
        }
        reg.register(Box::new(c))?;
    }
    // In base units (seconds), so a float; counted in µs.
    let throttled = CounterVec::new(
        Opts::new(
            "tx_throttled_seconds_total",
            "Planned hold time of a port's TX queue for rate limits, in all.",
        ),
        &ENDPOINT,
    )?;
    for (l, s) in &all {
        throttled
            .get_metric_with_label_values(l)?
            .inc_by(s.tx_throttled_us as f64 / 1e6);
    }
    reg.register(Box::new(throttled))?;
    for f in GAUGES {
        let g = IntGaugeVec::new(Opts::new(f.name, f.help), &ENDPOINT)?;
        for (l, s) in &all {
            g.get_metric_with_label_values(l)?.set(gauge((f.value)(s)));
        }
        reg.register(Box::new(g))?;
    }

    // Drops: every reason of every endpoint, zeros included, so that rate() and
    // increase() see each series from its first scrape on.
    let drops = IntCounterVec::new(
        Opts::new(
            "drops_total",
            "Frames dropped, by endpoint and reason (docs/configuration.md lists the reasons).",
        ),
        &["kind", "id", "name", "reason"],
    )?;
    for (l, s) in &all {
        for reason in DropReason::ALL {
            let v = s.drops.get(reason.name()).copied().unwrap_or(0);
            let labels = [&l[0], &l[1], &l[2], reason.name()];
            drops.get_metric_with_label_values(&labels)?.inc_by(v);
        }
    }
    reg.register(Box::new(drops))?;

    for f in QUEUE_COUNTERS {
        let c = IntCounterVec::new(Opts::new(f.name, f.help), &["kind", "id", "name", "queue"])?;
        for p in &r.ports {
            let id = p.id.to_string();
            for q in &p.queues {
                let queue = q.queue.to_string();
                c.get_metric_with_label_values(&["port", &id, &p.name, &queue])?
                    .inc_by((f.value)(q));
            }
        }
        reg.register(Box::new(c))?;
    }

    let connected = IntGaugeVec::new(
        Opts::new(
            "port_connected",
            "1 while a frontend (QEMU, DPDK) is connected to the port, else 0.",
        ),
        &ENDPOINT,
    )?;
    // Info metrics are gauges of value 1 whose labels carry the information.
    let features = IntGaugeVec::new(
        Opts::new(
            "port_features_info",
            "Offloads the connected guest negotiated: guest_rx what it accepts from gsonet (GUEST_*), guest_tx what it may send (HOST_*).",
        ),
        &["kind", "id", "name", "guest_rx", "guest_tx", "mrg_rxbuf"],
    )?;
    for p in &r.ports {
        let id = p.id.to_string();
        connected
            .get_metric_with_label_values(&["port", &id, &p.name])?
            .set(i64::from(p.connected));
        if let (Some(rx), Some(tx)) = (p.guest_rx, p.guest_tx) {
            let mrg = if p.mrg_rxbuf == Some(true) {
                "on"
            } else {
                "off"
            };
            let labels = ["port", &id, &p.name, &caps_list(&rx), &caps_list(&tx), mrg];
            features.get_metric_with_label_values(&labels)?.set(1);
        }
    }
    reg.register(Box::new(connected))?;
    reg.register(Box::new(features))?;

    let info = IntGaugeVec::new(
        Opts::new(
            "uplink_info",
            "An uplink's GSO mode: pass (GSO frames go to the device intact) or software (segmented in gsonet).",
        ),
        &["kind", "id", "name", "gso"],
    )?;
    let link = IntGaugeVec::new(
        Opts::new(
            "uplink_link_up",
            "1 while the uplink's interface is up and running (IFF_UP and IFF_RUNNING), else 0.",
        ),
        &ENDPOINT,
    )?;
    for u in &r.uplinks {
        let id = u.id.to_string();
        let gso = match u.gso {
            GsoMode::Pass => "pass",
            GsoMode::Software => "software",
        };
        info.get_metric_with_label_values(&["uplink", &id, &u.name, gso])?
            .set(1);
        let up = netdev::flags(ifname(&u.name))
            .is_ok_and(|f| f.contains(netdev::IfFlags::UP | netdev::IfFlags::RUNNING));
        link.get_metric_with_label_values(&["uplink", &id, &u.name])?
            .set(i64::from(up));
    }
    reg.register(Box::new(info))?;
    reg.register(Box::new(link))?;
    Ok(reg)
}

/// The content type of what `render` writes (the Prometheus text format 0.0.4).
pub fn content_type() -> String {
    TextEncoder::new().format_type().to_string()
}

/// The metrics text of the endpoints' counters as they are now.
pub fn render(e: &Endpoints) -> prometheus::Result<String> {
    let reg = registry(&report(e))?;
    let mut out = Vec::new();
    TextEncoder::new().encode(&reg.gather(), &mut out)?;
    String::from_utf8(out).map_err(|e| prometheus::Error::Msg(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn offload_lists_and_interface_names() {
        assert_eq!(caps_list(&Caps::default()), "");
        assert_eq!(caps_list(&Caps::ALL), "csum tso4 tso6 ecn ufo uso4 uso6");
        let c = Caps {
            csum: true,
            tso6: true,
            ..Caps::default()
        };
        assert_eq!(caps_list(&c), "csum tso6");
        assert_eq!(ifname("tap=gs0"), "gs0");
        assert_eq!(ifname("dev=eth1"), "eth1");
    }

    #[test]
    fn a_vif_s_queues_are_series_of_their_own() {
        use crate::backend::control::protocol::PortReport;
        let queue = |q, rx_frames| QueueSnapshot {
            queue: q,
            rx_frames,
            tx_frames: 10 + rx_frames,
            ..QueueSnapshot::default()
        };
        let port = |id, name: &str, queues| PortReport {
            id,
            name: name.into(),
            connected: true,
            guest_rx: None,
            guest_tx: None,
            mrg_rxbuf: None,
            acked: None,
            offered: None,
            packed_refused: None,
            max_burst: None,
            vlan: None,
            mem_regions: 0,
            mem_bytes: 0,
            stats: Snapshot::default(),
            queues,
        };
        let r = StatsReport {
            ports: vec![
                port(0, "vm1.sock", vec![]),
                port(3, "vif1.0", vec![queue(0, 5), queue(1, 7)]),
            ],
            uplinks: vec![],
        };
        let reg = registry(&r).unwrap();
        let mut out = Vec::new();
        TextEncoder::new().encode(&reg.gather(), &mut out).unwrap();
        let text = String::from_utf8(out).unwrap();
        for line in [
            r#"gsonet_queue_rx_frames_total{id="3",kind="port",name="vif1.0",queue="0"} 5"#,
            r#"gsonet_queue_rx_frames_total{id="3",kind="port",name="vif1.0",queue="1"} 7"#,
            r#"gsonet_queue_tx_frames_total{id="3",kind="port",name="vif1.0",queue="1"} 17"#,
        ] {
            assert!(text.lines().any(|l| l == line), "{line} missing:\n{text}");
        }
        // A port without queues of its own has no queue series.
        assert!(!text
            .lines()
            .any(|l| l.starts_with("gsonet_queue_") && l.contains("vm1.sock")));
    }

    #[test]
    fn an_empty_registry_renders_the_families() {
        let e = Arc::new(Endpoints::new(vec![], vec![]));
        let text = render(&e).unwrap();
        // No endpoint, no series: the text format leaves such families out.
        assert_eq!(text, "");
    }
}

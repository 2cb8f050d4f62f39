//! `gsonet stats --watch`: per-second rates of every port and uplink, one line each,
//! every interval, like ifstat. Rates are counter differences between two reports
//! divided by the time between them.

use std::io::Write;
use std::path::Path;
use std::time::{Duration, Instant};

use gsonet::backend::control::protocol::StatsReport;
use gsonet::stats::Snapshot;

/// One endpoint's rates over one interval.
#[derive(Debug, PartialEq)]
pub struct Rates {
    pub endpoint: String,
    pub in_fps: f64,
    pub in_mbps: f64,
    pub out_fps: f64,
    pub out_mbps: f64,
    pub gso_passed: f64,
    pub gso_segmented: f64,
    pub csum_completed: f64,
    pub drops: f64,
}

fn endpoints(r: &StatsReport) -> Vec<(String, &Snapshot)> {
    let ports = r.ports.iter().map(|p| {
        let short = p.name.rsplit('/').next().unwrap_or(&p.name);
        (format!("port {} {short}", p.id), &p.stats)
    });
    let uplinks = r
        .uplinks
        .iter()
        .map(|u| (format!("uplink {} {}", u.id, u.name), &u.stats));
    ports.chain(uplinks).collect()
}

/// Rates between two reports `secs` apart, for the endpoints in both. A counter that
/// went down (a restarted gsonet) counts from 0.
pub fn rates(prev: &StatsReport, cur: &StatsReport, secs: f64) -> Vec<Rates> {
    let before = endpoints(prev);
    endpoints(cur)
        .into_iter()
        .filter_map(|(name, c)| {
            let (_, p) = before.iter().find(|(n, _)| *n == name)?;
            let d = |a: u64, b: u64| if b >= a { (b - a) as f64 } else { b as f64 } / secs;
            let drops = |s: &Snapshot| s.drops.values().sum::<u64>();
            Some(Rates {
                in_fps: d(p.tx_frames, c.tx_frames),
                in_mbps: d(p.tx_bytes, c.tx_bytes) * 8.0 / 1e6,
                out_fps: d(p.rx_frames, c.rx_frames),
                out_mbps: d(p.rx_bytes, c.rx_bytes) * 8.0 / 1e6,
                gso_passed: d(p.gso_passed, c.gso_passed),
                gso_segmented: d(p.gso_segmented, c.gso_segmented),
                csum_completed: d(p.csum_completed, c.csum_completed),
                drops: d(drops(p), drops(c)),
                endpoint: name,
            })
        })
        .collect()
}

pub const HEADER: &str = "endpoint                        in frames/s   in Mbit/s  out frames/s  out Mbit/s  gso pass/s   gso seg/s    csum/s   drops/s";

pub fn line(r: &Rates) -> String {
    format!(
        "{:<30} {:>12.0} {:>11.2} {:>13.0} {:>11.2} {:>11.0} {:>11.0} {:>9.0} {:>9.0}",
        r.endpoint,
        r.in_fps,
        r.in_mbps,
        r.out_fps,
        r.out_mbps,
        r.gso_passed,
        r.gso_segmented,
        r.csum_completed,
        r.drops
    )
}

/// Prints rates every `interval` seconds until `count` reports (or forever).
pub fn run<F>(
    control: &Path,
    interval: f64,
    count: Option<u64>,
    mut ask: F,
) -> Result<(), (u8, String)>
where
    F: FnMut(&Path) -> Result<StatsReport, (u8, String)>,
{
    let every = Duration::from_secs_f64(interval);
    let mut prev = ask(control)?;
    let mut at = Instant::now();
    let mut next = at + every;
    let mut out = std::io::stdout().lock();
    let mut printed = 0u64;
    while count.is_none_or(|n| printed < n) {
        std::thread::sleep(next.saturating_duration_since(Instant::now()));
        next += every;
        let cur = ask(control)?;
        let now = Instant::now();
        let rows = rates(&prev, &cur, now.duration_since(at).as_secs_f64());
        // A header every 20 reports.
        if printed.is_multiple_of(20) {
            let _ = writeln!(out, "{HEADER}");
        }
        for r in &rows {
            let _ = writeln!(out, "{}", line(r));
        }
        if rows.len() > 1 {
            let _ = writeln!(out);
        }
        let _ = out.flush();
        printed += 1;
        prev = cur;
        at = now;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use gsonet::backend::control::protocol::UplinkReport;
    use gsonet::config::GsoMode;

    fn report(tx_frames: u64, tx_bytes: u64, drops: u64) -> StatsReport {
        let mut stats = Snapshot {
            tx_frames,
            tx_bytes,
            gso_passed: tx_frames / 2,
            ..Snapshot::default()
        };
        if drops > 0 {
            stats.drops.insert("too_short".into(), drops);
        }
        StatsReport {
            ports: vec![],
            uplinks: vec![UplinkReport {
                id: 0,
                name: "tap=gs0".into(),
                gso: GsoMode::Pass,
                stats,
            }],
        }
    }

    #[test]
    fn rates_are_differences_per_second() {
        let r = rates(&report(100, 1_000_000, 1), &report(300, 3_500_000, 5), 2.0);
        assert_eq!(r.len(), 1);
        assert_eq!(r[0].endpoint, "uplink 0 tap=gs0");
        assert_eq!(r[0].in_fps, 100.0);
        assert_eq!(r[0].in_mbps, 10.0);
        assert_eq!(r[0].gso_passed, 50.0);
        assert_eq!(r[0].drops, 2.0);
        assert_eq!(r[0].out_fps, 0.0);
        // A counter that went down (gsonet restarted) counts from zero.
        let r = rates(&report(300, 0, 0), &report(10, 0, 0), 1.0);
        assert_eq!(r[0].in_fps, 10.0);
        let text = line(&rates(&report(0, 0, 0), &report(7, 0, 0), 1.0)[0]);
        assert!(
            text.starts_with("uplink 0 tap=gs0") && text.contains(" 7 "),
            "{text}"
        );
    }
}

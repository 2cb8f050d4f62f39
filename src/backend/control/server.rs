//! The control socket's server: reports counters and applies `gsonet ctl` settings
//! to the ports and uplinks it was given. A client gets bounded room: one request line
//! of at most `MAX_LINE` bytes at a time, `IDLE` to send it or take the answer, and at
//! most `MAX_CLIENTS` connections are served at once.

use std::io::{self, BufRead, BufReader, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};
use std::thread;
use std::time::{Duration, Instant};

use tracing::{debug, warn};

use super::protocol::{Applied, PortReport, Reply, Request, StatsReport, UplinkReport};
use crate::backend::ratelimit::LogLimit;
use crate::backend::uplink::Uplink;
use crate::backend::vhost::port::Port;
use crate::backend::xen::VifPort;
use crate::config::{
    parse_max_burst, parse_on_off, parse_rate, RateLimit, BURST_KB_MAX, MAX_RX_COALESCE_FRAMES,
    MAX_RX_COALESCE_USECS, MAX_TX_COALESCE_USECS,
};

/// The ports and uplinks there are now, each uplink with its id in the switch.
#[derive(Default, Clone)]
pub struct Members {
    pub ports: Vec<Arc<Port>>,
    pub uplinks: Vec<(usize, Arc<dyn Uplink>)>,
    /// Xen vifs (`vifD.N`), reported as ports after the vhost-user ones.
    pub vifs: Vec<Arc<VifPort>>,
}

/// Adding and removing ports and uplinks, and reloading the configuration file: the
/// daemon's, which owns their threads.
pub trait Lifecycle: Send + Sync {
    fn add(&self, kind: &str, spec: &str) -> Result<Applied, String>;
    fn del(&self, kind: &str, which: &str) -> Result<Applied, String>;
    fn reload(&self) -> Result<Applied, String>;
}

/// Everything the control socket reports on and changes. `members` is written by the
/// lifecycle only (under its own lock) and read here; no frame ever takes it.
pub struct Registry {
    pub members: Arc<RwLock<Members>>,
    pub lifecycle: Option<Arc<dyn Lifecycle>>,
}

impl Registry {
    /// A fixed set of ports and uplinks (ids 0..), without a lifecycle.
    pub fn new(ports: Vec<Arc<Port>>, uplinks: Vec<Arc<dyn Uplink>>) -> Registry {
        Registry {
            members: Arc::new(RwLock::new(Members {
                ports,
                uplinks: uplinks.into_iter().enumerate().collect(),
                vifs: Vec::new(),
            })),
            lifecycle: None,
        }
    }

    /// The members now (a copy of the lists: the lock is not held while they are used).
    pub fn members(&self) -> Members {
        self.members
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

pub fn report(reg: &Registry) -> StatsReport {
    let r = reg.members();
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
                    acked: n.map(|n| n.acked),
                    offered: Some(p.offered()),
                    packed_refused: p.packed_refused.clone(),
                    max_burst: p.max_burst(),
                    vlan: p.cfg.vlan.map(|v| v.get()),
                    mem_regions: p.mem_mapped().0,
                    mem_bytes: p.mem_mapped().1,
                    stats: p.stats.snapshot(),
                    queues: Vec::new(),
                }
            })
            .chain(r.vifs.iter().map(vif_report))
            .collect(),
        uplinks: r
            .uplinks
            .iter()
            .map(|(i, u)| UplinkReport {
                id: *i,
                name: u.name(),
                gso: u.gso_mode(),
                stats: u.counters().snapshot(),
            })
            .collect(),
    }
}

fn vif_report(v: &Arc<VifPort>) -> PortReport {
    use crate::backend::switch::SwitchPort;
    let rx = v.rx_caps();
    PortReport {
        id: v.id,
        name: v.name(),
        connected: v.is_connected(),
        guest_rx: rx,
        guest_tx: rx.map(|_| v.tx_caps()),
        mrg_rxbuf: None,
        acked: None,
        offered: None,
        packed_refused: None,
        max_burst: None,
        vlan: None,
        mem_regions: 0,
        mem_bytes: 0,
        stats: v.stats.snapshot(),
        queues: v.queue_snapshots(),
    }
}

const TARGETS: &str = "target is port:N|SOCKET or uplink:N|NAME";

/// A number in 0..=`max` for setting `k`.
fn bounded(k: &str, v: &str, max: u32) -> Result<u32, String> {
    v.parse::<u32>()
        .ok()
        .filter(|&n| n <= max)
        .ok_or_else(|| format!("{k}={v}: expected a number from 0 to {max}"))
}

/// The `rate=`/`burst=` and `rx_rate=`/`rx_burst=` settings of one request, for a
/// port or an uplink; checked whole before anything changes.
struct RateEdit {
    tx: (Option<u64>, Option<u64>, bool),
    rx: (Option<u64>, Option<u64>, bool),
}

impl RateEdit {
    fn new(tx: Option<RateLimit>, rx: Option<RateLimit>) -> RateEdit {
        let now = |r: Option<RateLimit>| (r.map(|r| r.mbit), r.map(|r| r.burst_kb), false);
        RateEdit {
            tx: now(tx),
            rx: now(rx),
        }
    }

    /// Takes `k=v` if it is one of the four settings: true if it did.
    fn take(&mut self, k: &str, v: &str) -> Result<bool, String> {
        let (dir, is_rate) = match k {
            "rate" => (&mut self.tx, true),
            "burst" => (&mut self.tx, false),
            "rx_rate" => (&mut self.rx, true),
            "rx_burst" => (&mut self.rx, false),
            _ => return Ok(false),
        };
        if is_rate {
            dir.0 = parse_rate(v).map_err(|e| format!("{k}={v}: {e}"))?;
        } else {
            dir.1 = Some(
                v.parse()
                    .ok()
                    .filter(|n| (1..=BURST_KB_MAX).contains(n))
                    .ok_or_else(|| format!("{k}={v}: must be 1..{BURST_KB_MAX} (KiB)"))?,
            );
        }
        dir.2 = true;
        Ok(true)
    }

    /// The new `rate=` and `rx_rate=`; `None` for a direction the request left alone.
    #[allow(clippy::type_complexity)]
    fn finish(self) -> Result<(Option<Option<RateLimit>>, Option<Option<RateLimit>>), String> {
        let one = |(rate, burst, set): (Option<u64>, Option<u64>, bool)| {
            set.then(|| RateLimit::with_burst(rate, if rate.is_some() { burst } else { None }))
                .transpose()
        };
        Ok((one(self.tx)?, one(self.rx)?))
    }
}

/// The port `which` names: its id, its socket path or the path's file name.
pub fn find_port<'a>(ports: &'a [Arc<Port>], which: &str) -> Option<&'a Arc<Port>> {
    ports.iter().find(|p| {
        p.id.to_string() == which || p.name() == which || p.name().ends_with(&format!("/{which}"))
    })
}

/// The uplink `which` names: its id, its name (`tap=NAME`) or the interface's name.
pub fn find_uplink<'a>(
    uplinks: &'a [(usize, Arc<dyn Uplink>)],
    which: &str,
) -> Option<&'a (usize, Arc<dyn Uplink>)> {
    uplinks.iter().find(|(i, u)| {
        i.to_string() == which || u.name() == which || u.name().ends_with(&format!("={which}"))
    })
}

fn apply(reg: &Registry, target: &str, settings: &[(String, String)]) -> Result<Applied, String> {
    let (kind, which) = target.split_once(':').ok_or(TARGETS)?;
    let r = reg.members();
    match kind {
        "port" => {
            let p = find_port(&r.ports, which).ok_or_else(|| format!("no port {which}"))?;
            let mut mask = p.mask();
            let mut burst = p.max_burst();
            let (mut usecs, mut frames) = p.rx_coalesce.settings();
            let mut tx_usecs = p.tx_coalesce_usecs();
            let mut gro = None;
            let mut rates = RateEdit::new(p.rate(), p.rx_rate());
            for (k, v) in settings {
                if rates.take(k, v)? {
                } else if k == "max_burst" {
                    burst = parse_max_burst(v).map_err(|e| format!("max_burst={v}: {e}"))?;
                } else if k == "rx_coalesce_usecs" {
                    usecs = bounded(k, v, MAX_RX_COALESCE_USECS)?;
                } else if k == "rx_coalesce_frames" {
                    frames = bounded(k, v, MAX_RX_COALESCE_FRAMES)?;
                } else if k == "tx_coalesce_usecs" {
                    tx_usecs = bounded(k, v, MAX_TX_COALESCE_USECS)?;
                } else if k == "gro" {
                    gro = Some(parse_on_off(v).map_err(|e| format!("{k}={v}: {e}"))?);
                } else {
                    let on = parse_on_off(v).map_err(|e| format!("{k}={v}: {e}"))?;
                    if !mask.set(k, on) {
                        return Err(format!("unknown port setting {k}"));
                    }
                }
            }
            // Everything is checked before anything changes.
            let (rate, rx_rate) = rates.finish()?;
            p.set_mask(mask);
            p.set_max_burst(burst);
            p.rx_coalesce.set(usecs, frames);
            p.set_tx_coalesce_usecs(tx_usecs);
            if let Some(on) = gro {
                p.set_gro(on);
            }
            if let Some(r) = rate {
                p.set_rate(r);
            }
            if let Some(r) = rx_rate {
                p.set_rx_rate(r);
            }
            Ok(Applied::Port {
                port: p.name(),
                offer: format!("{:#x}", p.offered()),
                max_burst: burst,
                rx_coalesce_usecs: usecs,
                rx_coalesce_frames: frames,
                tx_coalesce_usecs: tx_usecs,
                note: "offload changes apply to the next frontend connection (QEMU reads a \
                       backend's features once per connection)"
                    .into(),
            })
        }
        "uplink" => {
            let (_, u) =
                find_uplink(&r.uplinks, which).ok_or_else(|| format!("no uplink {which}"))?;
            let mut burst = crate::backend::switch::deliver::Destination::max_burst(u.as_ref());
            let mut gso = None;
            let (tx, rx) = u.rates();
            let mut rates = RateEdit::new(tx, rx);
            for (k, v) in settings {
                match k.as_str() {
                    "gso" => gso = Some(v.parse()?),
                    "max_burst" => {
                        burst = parse_max_burst(v).map_err(|e| format!("max_burst={v}: {e}"))?
                    }
                    _ if rates.take(k, v)? => {}
                    _ => {
                        return Err(format!(
                            "unknown uplink setting {k} (gso, max_burst, rate, burst, rx_rate, \
                             rx_burst)"
                        ))
                    }
                }
            }
            // Everything is checked before anything changes.
            let (rate, rx_rate) = rates.finish()?;
            if let Some(g) = gso {
                u.set_gso_mode(g);
            }
            u.set_max_burst(burst);
            if let Some(r) = rate {
                u.set_rate(r);
            }
            if let Some(r) = rx_rate {
                u.set_rx_rate(r);
            }
            let (rate, rx_rate) = u.rates();
            Ok(Applied::Uplink {
                uplink: u.name(),
                gso: u.gso_mode(),
                max_burst: burst,
                rate_mbit: rate.map(|r| r.mbit),
                rx_rate_mbit: rx_rate.map(|r| r.mbit),
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
        Ok(Request::Add { kind, spec }) => lifecycle(r, |l| l.add(&kind, &spec)),
        Ok(Request::Del { kind, which }) => lifecycle(r, |l| l.del(&kind, &which)),
        Ok(Request::Reload) => lifecycle(r, |l| l.reload()),
        Err(e) => Reply::Error {
            error: format!("bad request: {e}"),
        },
    }
}

fn lifecycle(r: &Registry, f: impl FnOnce(&dyn Lifecycle) -> Result<Applied, String>) -> Reply {
    match r.lifecycle.as_deref() {
        None => Reply::Error {
            error: "ports and uplinks cannot be added or removed here".into(),
        },
        Some(l) => match f(l) {
            Ok(ok) => Reply::Ok { ok },
            Err(error) => Reply::Error { error },
        },
    }
}

/// Longest request line (without its newline); a longer one is answered with an error
/// and the connection closed.
pub const MAX_LINE: usize = 4096;
/// Connections served at once; one more is answered with an error and closed at once.
pub const MAX_CLIENTS: usize = 16;
/// Time a client has to send a whole request line, or to take a whole answer; then
/// its connection is closed and its slot freed.
pub const IDLE: Duration = Duration::from_secs(10);

/// One of at most `max` connection slots counted in `open`, given back on drop (the
/// control socket's and the metrics endpoint's).
pub struct Slot(Arc<AtomicUsize>);

impl Slot {
    pub fn take(open: &Arc<AtomicUsize>, max: usize) -> Option<Slot> {
        open.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
            (n < max).then_some(n + 1)
        })
        .ok()
        .map(|_| Slot(open.clone()))
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

enum Line {
    Request(String),
    TooLong,
    End,
}

/// Reads one request line, giving the client `IDLE` for all of it; `buf` is reused.
fn read_line(r: &mut BufReader<UnixStream>, buf: &mut Vec<u8>) -> io::Result<Line> {
    buf.clear();
    let deadline = Instant::now() + IDLE;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::ErrorKind::TimedOut.into());
        }
        r.get_ref().set_read_timeout(Some(left))?;
        let avail = match r.fill_buf() {
            Ok(b) => b,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        if avail.is_empty() {
            // End of stream; a last line without its newline still counts.
            return Ok(if buf.is_empty() {
                Line::End
            } else {
                Line::Request(String::from_utf8_lossy(buf).into_owned())
            });
        }
        let (take, done) = match avail.iter().position(|&b| b == b'\n') {
            Some(i) => (i, true),
            None => (avail.len(), false),
        };
        if buf.len() + take > MAX_LINE {
            return Ok(Line::TooLong);
        }
        buf.extend_from_slice(&avail[..take]);
        r.consume(take + usize::from(done));
        if done {
            return Ok(Line::Request(String::from_utf8_lossy(buf).into_owned()));
        }
    }
}

/// Writes one answer line, giving the client `IDLE` to take all of it.
fn send(mut w: &UnixStream, reply: &Reply) -> io::Result<()> {
    let mut out = serde_json::to_vec(reply).map_err(io::Error::other)?;
    out.push(b'\n');
    let deadline = Instant::now() + IDLE;
    let mut rest = &out[..];
    while !rest.is_empty() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::ErrorKind::TimedOut.into());
        }
        w.set_write_timeout(Some(left))?;
        match w.write(rest) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => rest = &rest[n..],
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

fn client(r: Arc<Registry>, s: UnixStream, _slot: Slot) {
    let Ok(w) = s.try_clone() else { return };
    let mut rd = BufReader::new(s);
    let mut buf = Vec::new();
    loop {
        let reply = match read_line(&mut rd, &mut buf) {
            Ok(Line::Request(line)) => answer(&r, &line),
            Ok(Line::TooLong) => {
                let _ = send(
                    &w,
                    &Reply::Error {
                        error: format!("request line longer than {MAX_LINE} bytes"),
                    },
                );
                return;
            }
            Ok(Line::End) => return,
            Err(e) => {
                debug!("control client: {e}");
                return;
            }
        };
        if send(&w, &reply).is_err() {
            return;
        }
    }
}

/// Serves the control socket (bound by the caller) forever.
pub fn serve(l: UnixListener, registry: Registry) {
    serve_shared(l, Arc::new(registry))
}

/// `serve`, with a registry others (the metrics endpoint) read as well.
pub fn serve_shared(l: UnixListener, registry: Arc<Registry>) {
    let open = Arc::new(AtomicUsize::new(0));
    let log = LogLimit::default();
    for s in l.incoming() {
        let s = match s {
            Ok(s) => s,
            Err(e) => {
                debug!("control accept: {e}");
                // EMFILE and the like: give the system a moment instead of spinning.
                thread::sleep(Duration::from_millis(10));
                continue;
            }
        };
        let Some(slot) = Slot::take(&open, MAX_CLIENTS) else {
            if let Some(suppressed) = log.allow() {
                warn!(
                    suppressed,
                    "control socket: {MAX_CLIENTS} connections open; refusing another"
                );
            }
            // A fresh socket takes one short line without blocking.
            let _ = s.set_nonblocking(true);
            let busy =
                format!("{{\"error\":\"busy: {MAX_CLIENTS} control connections are open\"}}\n");
            let _ = (&s).write_all(busy.as_bytes());
            continue;
        };
        let r = registry.clone();
        let _ = thread::Builder::new()
            .name("control".into())
            .spawn(move || client(r, s, slot));
    }
}

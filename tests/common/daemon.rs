//! A real `gsonet serve` process for end-to-end tests: spawned from the binary cargo
//! built, with unique socket paths (and tap name), killed on drop. Counters are read
//! through `gsonet stats --json`, the same way an operator reads them.
//!
//! ```ignore
//! let d = Daemon::start(&DaemonSpec::ports(2))?;          // two vhost-user ports
//! let d = Daemon::start(&DaemonSpec::ports(1).with_tap("gso=pass"))?;
//! let fe = TestFrontend::connect(&d.sockets[0], opts)?;
//! let s = d.stats()?;                                       // serde_json::Value
//! assert_eq!(port_counter(&s, 1, "gso_passed"), 1);
//! ```
//!
//! Tap tests need root: start them with `require_tun!()`, which fails the test where
//! no tap can be made (unless `GSONET_ALLOW_SKIP=1`).

#![allow(dead_code)]

use std::fs::{File, OpenOptions};
use std::io::Read;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde_json::Value;

static SEQ: AtomicU32 = AtomicU32::new(0);

/// A tag unique to this test process and call: `<pid>-<n>`.
pub fn unique_tag() -> String {
    format!(
        "{}-{}",
        std::process::id(),
        SEQ.fetch_add(1, Ordering::Relaxed)
    )
}

/// A tap name unique to this test process and call (at most 15 bytes).
pub fn unique_tap_name() -> String {
    let n = SEQ.fetch_add(1, Ordering::Relaxed);
    format!("gse{}x{}", std::process::id() % 1_000_000, n % 1000)
}

/// Deletes a link (a tap the test or gsonet made) when the test ends, however it ends.
pub struct Link(pub String);

impl Drop for Link {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["link", "del", &self.0])
            .stderr(Stdio::null())
            .status();
    }
}

const TUNSETIFF: libc::c_ulong = 0x4004_54ca;
const IFF_TAP: libc::c_short = 0x0002;
const IFF_NO_PI: libc::c_short = 0x1000;

/// Whether this process can create a tap (opens /dev/net/tun and creates a throwaway,
/// non-persistent tap, which goes away when the fd is closed).
pub fn tun_available() -> bool {
    let Ok(f) = OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/net/tun")
    else {
        return false;
    };
    #[repr(C)]
    struct IfReq {
        name: [u8; 16],
        flags: libc::c_short,
        _pad: [u8; 22],
    }
    let mut req = IfReq {
        name: [0; 16],
        flags: IFF_TAP | IFF_NO_PI,
        _pad: [0; 22],
    };
    let name = unique_tap_name();
    req.name[..name.len()].copy_from_slice(name.as_bytes());
    // SAFETY: TUNSETIFF reads and writes an ifreq, which `req` is laid out as.
    unsafe { libc::ioctl(f.as_raw_fd(), TUNSETIFF, &mut req) == 0 }
}

/// Fails the calling test when taps cannot be created, or returns from it when
/// `GSONET_ALLOW_SKIP=1` ([`gsonet::testkit::can_run`]).
#[macro_export]
macro_rules! require_tun {
    () => {
        if !gsonet::testkit::can_run(
            $crate::common::daemon::tun_available(),
            "a tap via /dev/net/tun (root / CAP_NET_ADMIN)",
        ) {
            return;
        }
    };
}

/// What to start.
#[derive(Clone, Debug, Default)]
pub struct DaemonSpec {
    /// Extra `--port` options per port (after `socket=PATH`), e.g. `"mtu=1500"`.
    pub ports: Vec<String>,
    /// `Some(opts)`: one tap uplink with a unique name, `--uplink tap=NAME[,opts]`.
    pub tap: Option<String>,
}

impl DaemonSpec {
    pub fn ports(n: usize) -> Self {
        DaemonSpec {
            ports: vec![String::new(); n],
            tap: None,
        }
    }
    pub fn with_tap(mut self, opts: &str) -> Self {
        self.tap = Some(opts.to_string());
        self
    }
}

/// A running `gsonet serve`.
pub struct Daemon {
    child: Child,
    pub sockets: Vec<PathBuf>,
    pub control: PathBuf,
    pub tap: Option<String>,
    log: PathBuf,
}

pub fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_gsonet")
}

impl Daemon {
    pub fn start(spec: &DaemonSpec) -> Result<Daemon> {
        Self::start_with(spec, &[])
    }

    /// `start`, with more `gsonet serve` arguments (e.g. `--metrics ADDR:PORT`).
    pub fn start_with(spec: &DaemonSpec, extra: &[&str]) -> Result<Daemon> {
        let tag = unique_tag();
        let dir = std::env::temp_dir();
        let sockets: Vec<PathBuf> = (0..spec.ports.len())
            .map(|i| dir.join(format!("gsonet-e2e-{tag}-p{i}.sock")))
            .collect();
        let control = dir.join(format!("gsonet-e2e-{tag}-ctl.sock"));
        let log = dir.join(format!("gsonet-e2e-{tag}.log"));
        let tap = spec.tap.as_ref().map(|_| unique_tap_name());

        let mut cmd = Command::new(bin());
        cmd.arg("serve");
        for (s, extra) in sockets.iter().zip(&spec.ports) {
            let mut p = format!("socket={}", s.display());
            if !extra.is_empty() {
                p.push(',');
                p.push_str(extra);
            }
            cmd.arg("--port").arg(p);
        }
        if let (Some(name), Some(opts)) = (&tap, &spec.tap) {
            let mut u = format!("tap={name}");
            if !opts.is_empty() {
                u.push(',');
                u.push_str(opts);
            }
            cmd.arg("--uplink").arg(u);
        }
        cmd.arg("--control").arg(&control);
        cmd.args(extra);
        let logf = File::create(&log).context("daemon log file")?;
        cmd.stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(logf)
            .env(
                "RUST_LOG",
                std::env::var("GSONET_E2E_LOG").unwrap_or_else(|_| "gsonet=debug".into()),
            );
        let child = cmd.spawn().context("spawn gsonet serve")?;
        let mut d = Daemon {
            child,
            sockets,
            control,
            tap,
            log,
        };
        d.wait_ready(Duration::from_secs(10))?;
        Ok(d)
    }

    /// Waits until the control socket answers and every port socket exists.
    fn wait_ready(&mut self, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(st) = self.child.try_wait()? {
                bail!("gsonet exited early ({st}):\n{}", self.log_text());
            }
            let socks = self.sockets.iter().all(|s| s.exists());
            if socks && self.control.exists() && self.stats().is_ok() {
                if let Some(t) = &self.tap {
                    // Less noise from the host's own IPv6 (router solicitations, MLD).
                    let _ =
                        std::fs::write(format!("/proc/sys/net/ipv6/conf/{t}/disable_ipv6"), "1");
                }
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("gsonet did not become ready:\n{}", self.log_text());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The daemon's log so far.
    pub fn log_text(&self) -> String {
        let mut s = String::new();
        if let Ok(mut f) = File::open(&self.log) {
            let _ = f.read_to_string(&mut s);
        }
        s
    }

    /// The daemon's process id (for /proc/PID/status and /proc/PID/stat).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Lines in the daemon's log so far.
    pub fn log_lines(&self) -> usize {
        self.log_text().lines().count()
    }

    /// Whether the process is still running.
    pub fn alive(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// How the process ended, if it did.
    pub fn exit_status(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    /// `gsonet stats --json` against this daemon.
    pub fn stats(&self) -> Result<Value> {
        stats_json(&self.control)
    }

    /// One counter of port `port` (e.g. "gso_passed", "rx_frames").
    pub fn port_counter(&self, port: usize, name: &str) -> Result<u64> {
        Ok(port_counter(&self.stats()?, port, name))
    }

    /// Runs `gsonet ctl ARGS` against this daemon.
    pub fn ctl(&self, args: &[&str]) -> std::process::Output {
        std::process::Command::new(bin())
            .arg("ctl")
            .arg("--control")
            .arg(&self.control)
            .args(args)
            .output()
            .expect("gsonet ctl")
    }

    /// Sum of all drop reasons on port `port`.
    pub fn port_drops(&self, port: usize) -> Result<u64> {
        Ok(drops_total(&self.stats()?["ports"][port]["stats"]))
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "---- gsonet log ({}) ----\n{}",
                self.log.display(),
                tail(&self.log_text(), 60)
            );
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        for s in &self.sockets {
            remove_socket(s);
        }
        let _ = std::fs::remove_file(&self.control);
        // The tap is persistent (it outlives gsonet by design): remove it with the test.
        if let Some(t) = &self.tap {
            let _ = Command::new("ip")
                .args(["link", "del", t])
                .stderr(Stdio::null())
                .status();
        }
        if !std::thread::panicking() {
            let _ = std::fs::remove_file(&self.log);
        }
    }
}

/// A port's socket path under the temp dir (`gsonet-TAG-UNIQUE.sock`) for a port
/// a test adds itself; the socket and its record (`SOCKET.rings`) go when it drops.
pub struct TempSocket(PathBuf);

impl TempSocket {
    pub fn new(tag: &str) -> Self {
        TempSocket(std::env::temp_dir().join(format!("gsonet-{tag}-{}.sock", unique_tag())))
    }
}

impl std::ops::Deref for TempSocket {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.0
    }
}

impl AsRef<Path> for TempSocket {
    fn as_ref(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempSocket {
    fn drop(&mut self) {
        remove_socket(&self.0);
    }
}

/// Removes a port's socket and the record of its packed rings beside it
/// (`SOCKET.rings`, which a default port keeps).
pub fn remove_socket(socket: &Path) {
    let _ = std::fs::remove_file(socket);
    let mut rings = socket.as_os_str().to_owned();
    rings.push(".rings");
    let _ = std::fs::remove_file(rings);
}

fn tail(s: &str, lines: usize) -> String {
    let v: Vec<&str> = s.lines().collect();
    v[v.len().saturating_sub(lines)..].join("\n")
}

/// Runs `gsonet stats --json --control PATH` and parses its output.
pub fn stats_json(control: &Path) -> Result<Value> {
    let out = Command::new(bin())
        .arg("stats")
        .arg("--json")
        .arg("--control")
        .arg(control)
        .output()
        .context("run gsonet stats")?;
    if !out.status.success() {
        bail!(
            "gsonet stats failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    serde_json::from_slice(&out.stdout).context("parse gsonet stats --json")
}

pub fn port_counter(stats: &Value, port: usize, name: &str) -> u64 {
    stats["ports"][port]["stats"][name].as_u64().unwrap_or(0)
}

pub fn uplink_counter(stats: &Value, uplink: usize, name: &str) -> u64 {
    stats["uplinks"][uplink]["stats"][name]
        .as_u64()
        .unwrap_or(0)
}

/// TX drop reasons that mean "the chain itself was unreadable": counted instead of a
/// TX frame (every other reason on a sender's counters comes after its frame was
/// counted), on a split ring as on a packed one.
pub const CHAIN_REASONS: [&str; 7] = [
    "bad_address",
    "writable_descriptor",
    "too_short",
    "too_long",
    "bad_header",
    "too_many_descriptors",
    "broken_chain",
];

/// One drop reason of a `stats` object (a port's or an uplink's).
pub fn drop_count(stats: &Value, reason: &str) -> u64 {
    stats["drops"][reason].as_u64().unwrap_or(0)
}

/// All drops of a `stats` object.
pub fn drops_total(stats: &Value) -> u64 {
    stats["drops"]
        .as_object()
        .map(|m| m.values().filter_map(|v| v.as_u64()).sum())
        .unwrap_or(0)
}

/// Resident memory of process `pid` in bytes (VmRSS of /proc/PID/status).
pub fn rss_bytes(pid: u32) -> Result<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let kb = s
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
        .context("VmRSS in /proc/PID/status")?;
    Ok(kb * 1024)
}

/// CPU time (user + system, all threads) process `pid` has used so far.
pub fn cpu_time(pid: u32) -> Result<Duration> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // Fields after the command name (which may hold spaces): state is field 3,
    // utime and stime fields 14 and 15.
    let rest = s.rsplit_once(')').context("/proc/PID/stat")?.1;
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = f[11].parse::<u64>()? + f[12].parse::<u64>()?;
    // SAFETY: sysconf has no memory effects.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
    Ok(Duration::from_millis(ticks * 1000 / hz))
}

/// `systemd-analyze verify --man=no` of `units` (name, text) written into a fresh
/// directory, with the unit's `/usr/local/bin/gsonet` pointed at the binary cargo
/// built (verify wants ExecStart's binary to exist). `None` where systemd-analyze is
/// not installed; else whether it passed and everything it said (it warns and goes on
/// for unknown settings, so any word is a finding).
pub fn systemd_verify(units: &[(&str, &str)]) -> Option<(bool, String)> {
    if std::process::Command::new("systemd-analyze")
        .arg("--version")
        .output()
        .is_err()
    {
        assert!(!gsonet::testkit::can_run(false, "systemd-analyze"));
        return None;
    }
    let dir = std::env::temp_dir().join(format!("gsonet-sd-{}", unique_tag()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut cmd = std::process::Command::new("systemd-analyze");
    // --man=no: the man page is built by `make man`, not installed here.
    cmd.args(["verify", "--man=no"]);
    for (name, text) in units {
        let path = dir.join(name);
        std::fs::write(&path, text.replace("/usr/local/bin/gsonet", bin())).unwrap();
        cmd.arg(path);
    }
    let out = cmd.output().unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Some((out.status.success(), said))
}

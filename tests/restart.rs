//! Restarting gsonet: a tap uplink outlives the process (persistent, a MAC derived
//! from its name) and the next gsonet reattaches to it with the host's address kept;
//! sockets a killed gsonet left behind are taken over, live ones refused; a clean stop
//! (SIGTERM) exits 0 and removes its sockets; listening sockets come from a service
//! manager (LISTEN_FDS through `systemd-socket-activate`). Tap tests need root.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use common::daemon::{bin, systemd_verify, tun_available, unique_tag, unique_tap_name, Link};
use gsonet::testkit::can_run;

const T: Duration = Duration::from_secs(15);

/// One `gsonet serve` with its log in a file; killed on drop if still running.
struct Serve {
    child: Child,
    log: PathBuf,
}

impl Serve {
    fn spawn(args: &[String], log: &Path) -> Serve {
        Serve::spawn_cmd(Command::new(bin()).arg("serve").args(args), log)
    }

    fn spawn_cmd(cmd: &mut Command, log: &Path) -> Serve {
        let f = std::fs::File::create(log).unwrap();
        let child = cmd
            .env("RUST_LOG", "gsonet=info")
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .stdout(f.try_clone().unwrap())
            .stderr(f)
            .spawn()
            .unwrap();
        Serve {
            child,
            log: log.to_path_buf(),
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Until the log shows `what`, or the process ended (false).
    fn wait_log(&mut self, what: &str) -> bool {
        let end = Instant::now() + T;
        while Instant::now() < end {
            if self.log().contains(what) {
                return true;
            }
            if self.child.try_wait().unwrap().is_some() {
                return self.log().contains(what);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        false
    }

    fn wait_ready(&mut self) {
        assert!(
            self.wait_log("control socket ready"),
            "not ready:\n{}",
            self.log()
        );
    }

    fn signal(&mut self, sig: &str) -> ExitStatus {
        let pid = self.child.id().to_string();
        assert!(Command::new("kill")
            .args([sig, &pid])
            .status()
            .unwrap()
            .success());
        let end = Instant::now() + T;
        loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                return s;
            }
            assert!(Instant::now() < end, "still running after {sig}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Exit status of a gsonet expected to refuse to start.
    fn wait_exit(&mut self) -> ExitStatus {
        let end = Instant::now() + T;
        loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                return s;
            }
            assert!(Instant::now() < end, "still running:\n{}", self.log());
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.log);
    }
}

fn dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("gsonet-restart-{tag}"));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn ip(args: &[&str]) -> String {
    let o = Command::new("ip").args(args).output().unwrap();
    assert!(o.status.success(), "ip {args:?}: {:?}", o);
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn link_exists(name: &str) -> bool {
    Path::new("/sys/class/net").join(name).exists()
}

fn mac_of(name: &str) -> String {
    std::fs::read_to_string(format!("/sys/class/net/{name}/address"))
        .unwrap()
        .trim()
        .to_string()
}

fn tun_flags(name: &str) -> u32 {
    let s = std::fs::read_to_string(format!("/sys/class/net/{name}/tun_flags")).unwrap();
    u32::from_str_radix(s.trim().trim_start_matches("0x"), 16).unwrap()
}

/// FNV-1a of the name, bytes 2..8 with the locally administered bit set and the
/// group bit clear: the MAC gsonet gives a new tap without `mac=` (computed here
/// independently of the `fnv` crate gsonet uses).
fn expected_mac(name: &str) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in name.bytes() {
        h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
    }
    let b = h.to_be_bytes();
    let m = [(b[2] & 0xfc) | 0x02, b[3], b[4], b[5], b[6], b[7]];
    m.iter()
        .map(|x| format!("{x:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

const IFF_PERSIST: u32 = 0x0800;

#[test]
fn a_tap_outlives_gsonet_and_the_next_one_reattaches() {
    if !can_run(tun_available(), "root and /dev/net/tun") {
        return;
    }
    let tag = unique_tag();
    let d = dir(&tag);
    let tap = unique_tap_name();
    let _cleanup = Link(tap.clone());
    let args = |extra: &str| {
        vec![
            "--port".to_string(),
            format!("socket={}", d.join("p0.sock").display()),
            "--uplink".to_string(),
            format!("tap={tap}{extra}"),
            "--control".to_string(),
            d.join("ctl.sock").display().to_string(),
        ]
    };
    let mut s = Serve::spawn(&args(""), &d.join("1.log"));
    s.wait_ready();
    assert!(tun_flags(&tap) & IFF_PERSIST != 0, "persistent by default");
    assert_eq!(mac_of(&tap), expected_mac(&tap));
    assert!(s.log().contains("reattached=false"), "{}", s.log());
    ip(&["addr", "add", "10.253.7.1/24", "dev", &tap]);
    // replace: a route left by a run that was killed must not fail this one.
    ip(&["route", "replace", "10.253.8.0/24", "dev", &tap]);
    // A guest the host has resolved (not a permanent entry: those always stay).
    ip(&[
        "neigh",
        "replace",
        "10.253.7.9",
        "lladdr",
        "02:00:00:00:00:09",
        "dev",
        &tap,
    ]);
    ip(&[
        "neigh",
        "change",
        "10.253.7.9",
        "dev",
        &tap,
        "nud",
        "reachable",
    ]);

    // Killed: the tap stays, with the host's address, route and neighbour entry (the
    // carrier drops until the next gsonet; a forgotten guest costs a 1 s ARP retry).
    assert!(!s.signal("-KILL").success());
    assert!(link_exists(&tap));
    assert!(ip(&["addr", "show", "dev", &tap]).contains("10.253.7.1/24"));
    let neigh = ip(&["neigh", "show", "dev", &tap]);
    assert!(
        neigh.contains("10.253.7.9"),
        "the host forgot its neighbour: {neigh:?}"
    );

    // The next gsonet attaches to it: same device, address, route, MAC.
    let mut s = Serve::spawn(&args(""), &d.join("2.log"));
    s.wait_ready();
    assert!(s.log().contains("reattached=true"), "{}", s.log());
    assert_eq!(mac_of(&tap), expected_mac(&tap));
    assert!(ip(&["addr", "show", "dev", &tap]).contains("10.253.7.1/24"));
    assert!(ip(&["route", "show", "dev", &tap]).contains("10.253.8.0/24"));
    assert!(ip(&["link", "show", "dev", &tap]).contains(",UP"));

    // A clean stop keeps it too (the default, so an upgrade keeps the host's setup).
    assert!(s.signal("-TERM").success(), "{}", s.log());
    assert!(link_exists(&tap));
    assert!(ip(&["addr", "show", "dev", &tap]).contains("10.253.7.1/24"));

    // mac= is applied to an existing tap; persist=off makes it go with the process.
    let mut s = Serve::spawn(
        &args(",mac=02:11:22:33:44:55,persist=off"),
        &d.join("3.log"),
    );
    s.wait_ready();
    assert_eq!(mac_of(&tap), "02:11:22:33:44:55");
    assert_eq!(tun_flags(&tap) & IFF_PERSIST, 0);
    assert!(s.signal("-TERM").success(), "{}", s.log());
    let end = Instant::now() + T;
    while link_exists(&tap) {
        assert!(Instant::now() < end, "a persist=off tap stays after gsonet");
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn interfaces_that_are_no_usable_tap_are_refused() {
    if !can_run(tun_available(), "root and /dev/net/tun") {
        return;
    }
    let tag = unique_tag();
    let d = dir(&tag);
    let (br, single) = (unique_tap_name(), unique_tap_name());
    let _b = Link(br.clone());
    let _s = Link(single.clone());
    ip(&["link", "add", &br, "type", "bridge"]);
    ip(&["tuntap", "add", &single, "mode", "tap"]);
    for (name, want) in [
        (&br, "exists and is not a tap"),
        (&single, "without multi_queue"),
    ] {
        let mut s = Serve::spawn(
            &[
                "--port".into(),
                format!("socket={}", d.join("p.sock").display()),
                "--uplink".into(),
                format!("tap={name}"),
                "--control".into(),
                d.join("c.sock").display().to_string(),
            ],
            &d.join(format!("{name}.log")),
        );
        let st = s.wait_exit();
        assert!(!st.success(), "{}", s.log());
        assert!(s.log().contains(want), "{}", s.log());
        // Left as it was: still there, still not gsonet's.
        assert!(link_exists(name));
        assert!(!d.join("p.sock").exists() && !d.join("c.sock").exists());
    }
    let _ = std::fs::remove_dir_all(&d);
}

/// A TCP port free at the moment.
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn http_get_ok(port: u16) -> bool {
    let Ok(mut c) = TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let _ = c.set_read_timeout(Some(T));
    let _ = c.write_all(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n");
    let mut out = String::new();
    let _ = c.read_to_string(&mut out);
    out.starts_with("HTTP/1.1 200") || out.starts_with("HTTP/1.0 200")
}

#[test]
fn stale_sockets_are_taken_over_live_ones_refused_and_a_clean_stop_removes_them() {
    let tag = unique_tag();
    let d = dir(&tag);
    let port = free_port();
    let socks = [d.join("a.sock"), d.join("b.sock"), d.join("ctl.sock")];
    let args = vec![
        "--port".to_string(),
        format!("socket={}", socks[0].display()),
        "--port".to_string(),
        format!("socket={}", socks[1].display()),
        "--control".to_string(),
        socks[2].display().to_string(),
        "--metrics".to_string(),
        format!("127.0.0.1:{port}"),
    ];
    let mut s = Serve::spawn(&args, &d.join("1.log"));
    s.wait_ready();
    // A client of the metrics listener: its connection is open when gsonet dies.
    let _held = TcpStream::connect(("127.0.0.1", port)).unwrap();
    assert!(!s.signal("-KILL").success());
    assert!(socks.iter().all(|p| p.exists()), "SIGKILL leaves the files");
    assert!(socks.iter().all(|p| UnixStream::connect(p).is_err()));

    let mut s2 = Serve::spawn(&args, &d.join("2.log"));
    s2.wait_ready();
    assert!(socks.iter().all(|p| UnixStream::connect(p).is_ok()));
    assert!(http_get_ok(port), "{}", s2.log());

    // A third one must not steal the sockets of the live second one.
    let mut s3 = Serve::spawn(&args, &d.join("3.log"));
    assert!(!s3.wait_exit().success());
    assert!(s3.log().contains("in use"), "{}", s3.log());
    assert!(socks.iter().all(|p| UnixStream::connect(p).is_ok()));

    // A clean stop: exit 0, no socket left.
    assert!(s2.signal("-TERM").success(), "{}", s2.log());
    assert!(s2.log().contains("stopped cleanly"), "{}", s2.log());
    for p in &socks {
        assert!(!p.exists(), "{} left behind", p.display());
    }
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn listening_sockets_from_the_service_manager() {
    let Some(activate) = [
        "/usr/bin/systemd-socket-activate",
        "/bin/systemd-socket-activate",
    ]
    .into_iter()
    .find(|p| Path::new(p).exists()) else {
        assert!(!can_run(false, "systemd-socket-activate (package systemd)"));
        return;
    };
    let tag = unique_tag();
    let d = dir(&tag);
    let (p0, p1, ctl) = (d.join("p0.sock"), d.join("p1.sock"), d.join("ctl.sock"));
    let port = free_port();
    // p0 and the control socket and metrics come from the manager; p1 gsonet binds.
    let mut cmd = Command::new(activate);
    cmd.arg("-l")
        .arg(&p0)
        .arg("-l")
        .arg(&ctl)
        .arg("-l")
        .arg(format!("127.0.0.1:{port}"))
        .arg("--fdname=vm0:control:metrics")
        .arg(bin())
        .arg("serve")
        .arg("--port")
        .arg(format!("socket={}", p0.display()))
        .arg("--port")
        .arg(format!("socket={}", p1.display()))
        .arg("--control")
        .arg(&ctl)
        .arg("--metrics")
        .arg(format!("127.0.0.1:{port}"));
    let mut s = Serve::spawn_cmd(&mut cmd, &d.join("1.log"));
    let end = Instant::now() + T;
    while !p0.exists() {
        assert!(Instant::now() < end, "{}", s.log());
        std::thread::sleep(Duration::from_millis(20));
    }
    // The first connection starts the service and waits in the backlog meanwhile.
    let _front = UnixStream::connect(&p0).unwrap();
    s.wait_ready();
    let log = s.log();
    assert_eq!(
        log.matches("listening socket from the service manager")
            .count(),
        2,
        "{log}"
    );
    assert!(s.wait_log("frontend connected"), "{}", s.log());
    assert!(UnixStream::connect(&p1).is_ok());
    let stats = Command::new(bin())
        .args(["stats", "--json", "--control"])
        .arg(&ctl)
        .output()
        .unwrap();
    assert!(stats.status.success(), "{stats:?}");
    assert!(http_get_ok(port), "{}", s.log());
    // A clean stop removes what gsonet bound, not what the manager owns.
    assert!(s.signal("-TERM").success(), "{}", s.log());
    assert!(!p1.exists());
    assert!(p0.exists() && ctl.exists());

    // Variables meant for another process are ignored: gsonet binds itself.
    let _ = std::fs::remove_file(&p0);
    let _ = std::fs::remove_file(&ctl);
    let mut cmd = Command::new(bin());
    cmd.args(["serve", "--port"])
        .arg(format!("socket={}", p0.display()))
        .arg("--control")
        .arg(&ctl)
        .env("LISTEN_PID", "1")
        .env("LISTEN_FDS", "1")
        .env("LISTEN_FDNAMES", "vm0");
    let mut s = Serve::spawn_cmd(&mut cmd, &d.join("2.log"));
    s.wait_ready();
    assert!(!s.log().contains("from the service manager"), "{}", s.log());
    assert!(UnixStream::connect(&p0).is_ok());
    assert!(s.signal("-TERM").success());
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn the_socket_unit_passes_systemd_analyze_verify_and_lists_the_example_ports() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let socket = std::fs::read_to_string(root.join("contrib/systemd/gsonet.socket")).unwrap();
    let cfg = gsonet::config::Config::from_file(&root.join("contrib/gsonet.toml")).unwrap();
    let listed: Vec<&str> = socket
        .lines()
        .filter_map(|l| l.strip_prefix("ListenStream="))
        .collect();
    let ports: Vec<String> = cfg
        .ports
        .iter()
        .filter(|p| !p.client)
        .map(|p| p.socket.display().to_string())
        .collect();
    assert_eq!(
        listed, ports,
        "gsonet.socket lists the example's port sockets"
    );
    let service = std::fs::read_to_string(root.join("contrib/systemd/gsonet.service")).unwrap();
    let units = [
        ("gsonet.socket", socket.as_str()),
        ("gsonet.service", &service),
    ];
    let Some((ok, said)) = systemd_verify(&units) else {
        return;
    };
    assert!(ok && said.trim().is_empty(), "{said}");
}

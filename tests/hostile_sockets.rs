//! Local users against gsonet's sockets (issue 9, item 5): nothing but a stale socket
//! is ever removed at a socket path; port and control sockets get the mode and group
//! configured; the relay uses no abstract socket anyone could connect to; who
//! connects is logged; the control socket bounds request lines, connections and
//! idle clients. Real `gsonet serve` processes over real Unix sockets.

mod common;

use std::fs::{self, File};
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::daemon::{bin, stats_json, unique_tag, Daemon, DaemonSpec};
use common::frontend::{FrontendOpts, TestFrontend};

/// A `gsonet serve` started with exactly the arguments given, killed on drop.
struct Serve {
    child: Child,
    log: PathBuf,
    dir: PathBuf,
}

impl Serve {
    /// Starts gsonet in its own scratch directory `dir` (removed on drop); `args` may
    /// name paths inside it.
    fn start(dir: &Path, args: &[String]) -> Serve {
        let log = dir.with_extension("log");
        let child = Command::new(bin())
            .arg("serve")
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(File::create(&log).unwrap())
            .env("RUST_LOG", "gsonet=info")
            .spawn()
            .unwrap();
        Serve {
            child,
            log,
            dir: dir.to_path_buf(),
        }
    }

    fn log_text(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits until `gsonet stats` answers on `control`.
    fn wait_ready(&mut self, control: &Path) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while stats_json(control).is_err() {
            if let Ok(Some(st)) = self.child.try_wait() {
                panic!("gsonet exited ({st}):\n{}", self.log_text());
            }
            assert!(
                Instant::now() < deadline,
                "gsonet not ready:\n{}",
                self.log_text()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            eprintln!("---- gsonet log ----\n{}", self.log_text());
        }
        let _ = fs::remove_file(&self.log);
        let _ = fs::remove_dir_all(&self.dir);
    }
}

/// A fresh scratch directory for one test.
fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("gsonet-hs-{name}-{}", unique_tag()));
    let _ = fs::remove_dir_all(&d);
    fs::create_dir_all(&d).unwrap();
    d
}

fn s(p: &Path) -> String {
    p.display().to_string()
}

/// Runs `gsonet serve args`, expecting it to exit within 20 s; its code and stderr.
/// A gsonet still running then is killed and reported as `None`.
fn serve_exits(args: &[String]) -> (Option<i32>, String) {
    let mut child = Command::new(bin())
        .arg("serve")
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    let code = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st.code();
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut err = String::new();
    if let Some(mut e) = child.stderr.take() {
        let _ = e.read_to_string(&mut err);
    }
    (code, err)
}

fn mode_of(p: &Path) -> u32 {
    fs::symlink_metadata(p).unwrap().mode() & 0o7777
}

/// A group of the group database other than gid 0: (name, gid).
fn some_group() -> Option<(String, u32)> {
    let text = fs::read_to_string("/etc/group").ok()?;
    text.lines().find_map(|l| {
        let mut f = l.split(':');
        let name = f.next()?;
        let gid: u32 = f.nth(1)?.parse().ok()?;
        (gid != 0 && !name.is_empty()).then(|| (name.to_string(), gid))
    })
}

#[test]
fn only_a_stale_socket_is_ever_replaced() {
    let dir = scratch("notsock");
    let ctl = dir.join("ctl.sock");
    let target = dir.join("precious.txt");
    fs::write(&target, b"keep me").unwrap();

    let file = dir.join("file.sock");
    fs::write(&file, b"not a socket").unwrap();
    let link = dir.join("link.sock");
    std::os::unix::fs::symlink(&target, &link).unwrap();
    let dangling = dir.join("dangling.sock");
    std::os::unix::fs::symlink(dir.join("nothing-here"), &dangling).unwrap();
    let subdir = dir.join("dir.sock");
    fs::create_dir(&subdir).unwrap();

    for (path, what) in [
        (&file, "regular file"),
        (&link, "symbolic link"),
        (&dangling, "symbolic link"),
        (&subdir, "directory"),
    ] {
        let (code, err) = serve_exits(&[
            "--port".into(),
            format!("socket={}", s(path)),
            "--control".into(),
            s(&ctl),
        ]);
        assert_eq!(code, Some(2), "{}: {err}", path.display());
        assert!(
            err.contains(&s(path)) && err.contains(what) && err.contains("not a socket"),
            "{}: the message should name the path and what is there: {err}",
            path.display()
        );
        assert!(!ctl.exists(), "no control socket is left behind");
    }
    assert_eq!(fs::read(&file).unwrap(), b"not a socket");
    assert_eq!(fs::read_link(&link).unwrap(), target);
    assert_eq!(fs::read(&target).unwrap(), b"keep me");
    assert_eq!(fs::read_link(&dangling).unwrap(), dir.join("nothing-here"));
    assert!(subdir.is_dir());

    // The same at the control socket's path.
    let port = dir.join("vm.sock");
    let (code, err) = serve_exits(&[
        "--port".into(),
        format!("socket={}", s(&port)),
        "--control".into(),
        s(&file),
    ]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("not a socket"), "{err}");
    assert_eq!(fs::read(&file).unwrap(), b"not a socket");

    // A stale socket is still replaced.
    drop(std::os::unix::net::UnixListener::bind(&port).unwrap());
    let mut d = Serve::start(
        &dir,
        &[
            "--port".into(),
            format!("socket={}", s(&port)),
            "--control".into(),
            s(&ctl),
        ],
    );
    d.wait_ready(&ctl);
    assert!(UnixStream::connect(&port).is_ok());
}

#[test]
fn sockets_get_the_mode_and_group_configured() {
    let dir = scratch("mode");
    let ctl = dir.join("run/ctl.sock");
    let plain = dir.join("plain.sock");
    let moded = dir.join("moded.sock");
    let nested = dir.join("new/deeper/vm.sock");
    let named = dir.join("named.sock");
    let open_dir = dir.join("open");
    fs::create_dir(&open_dir).unwrap();
    fs::set_permissions(&open_dir, fs::Permissions::from_mode(0o777)).unwrap();
    let in_open = open_dir.join("vm.sock");
    let tight_dir = dir.join("tight");
    fs::create_dir(&tight_dir).unwrap();
    fs::set_permissions(&tight_dir, fs::Permissions::from_mode(0o700)).unwrap();
    let in_tight = tight_dir.join("vm.sock");
    let group = some_group();

    let mut args = vec![
        "--control".into(),
        s(&ctl),
        "--port".into(),
        format!("socket={}", s(&plain)),
        "--port".into(),
        format!("socket={},socket_mode=0640,socket_group=4321", s(&moded)),
        "--port".into(),
        format!("socket={},socket_mode=0600,socket_group=4322", s(&nested)),
        "--port".into(),
        format!("socket={}", s(&in_open)),
        "--port".into(),
        format!("socket={}", s(&in_tight)),
    ];
    if let Some((name, _)) = &group {
        args.push("--port".into());
        args.push(format!("socket={},socket_group={name}", s(&named)));
    }
    let mut d = Serve::start(&dir, &args);
    d.wait_ready(&ctl);

    // SAFETY: getegid has no preconditions and cannot fail.
    let my_gid = unsafe { libc::getegid() };
    let meta = |p: &Path| {
        let m = fs::symlink_metadata(p).unwrap();
        assert!(m.file_type().is_socket(), "{} is a socket", p.display());
        (m.mode() & 0o7777, m.gid())
    };
    assert_eq!(meta(&plain), (0o660, my_gid), "the default port socket");
    assert_eq!(meta(&moded), (0o640, 4321));
    assert_eq!(meta(&nested), (0o600, 4322));
    assert_eq!(meta(&ctl), (0o600, my_gid), "the default control socket");
    if let Some((name, gid)) = &group {
        assert_eq!(meta(&named), (0o660, *gid), "socket_group={name}");
    }
    // Directories gsonet created: 0750 and the socket's group, so it can reach it.
    for d in [dir.join("new"), dir.join("new/deeper")] {
        let m = fs::metadata(&d).unwrap();
        assert_eq!(
            (m.mode() & 0o7777, m.gid()),
            (0o750, 4322),
            "{}",
            d.display()
        );
    }
    assert_eq!(mode_of(&dir.join("run")), 0o750);
    // Existing directories are never changed, not even loosened for the group.
    assert_eq!(mode_of(&tight_dir), 0o700);
    assert_eq!(mode_of(&open_dir), 0o777);
    // No staging directory is left beside any socket.
    for d in [&dir, &open_dir, &tight_dir, &dir.join("new/deeper")] {
        for e in fs::read_dir(d).unwrap() {
            let n = e.unwrap().file_name().to_string_lossy().into_owned();
            assert!(!n.starts_with(".gsonet-"), "{n} left in {}", d.display());
        }
    }
    let log = d.log_text();
    assert!(
        log.contains("world-writable without the sticky bit") && log.contains(&s(&open_dir)),
        "a world-writable directory is warned about:\n{log}"
    );

    // --control-mode / --control-group, and bad values (exit 2, the reason named).
    let dir2 = scratch("ctlmode");
    let ctl2 = dir2.join("ctl.sock");
    let mut d2 = Serve::start(
        &dir2,
        &[
            "--port".into(),
            format!("socket={}", s(&dir2.join("vm.sock"))),
            "--control".into(),
            s(&ctl2),
            "--control-mode".into(),
            "0660".into(),
            "--control-group".into(),
            "4323".into(),
        ],
    );
    d2.wait_ready(&ctl2);
    assert_eq!(meta(&ctl2), (0o660, 4323));
    drop(d2);

    let vm = format!("socket={}", s(&dir.join("never.sock")));
    let cases: &[(&[&str], &str)] = &[
        (&["--control-mode", "0999"], "octal"),
        (&["--control-mode", "4755"], "0777"),
        (&["--control-group", "no-such-group-gsonet"], "no group"),
    ];
    for (extra, want) in cases {
        let mut a: Vec<String> = vec!["--port".into(), vm.clone(), "--control".into()];
        a.push(s(&dir.join("never-ctl.sock")));
        a.extend(extra.iter().map(|x| x.to_string()));
        let (code, err) = serve_exits(&a);
        assert_eq!(code, Some(2), "{extra:?}: {err}");
        assert!(err.contains(want), "{extra:?}: {err}");
    }
    for (spec, want) in [
        ("socket_mode=0o1777", "0777"),
        ("socket_mode=abc", "octal"),
        ("socket_group=no-such-group-gsonet", "no group"),
        ("client,socket_mode=0600", "client port"),
    ] {
        let (code, err) = serve_exits(&[
            "--port".into(),
            format!("{vm},{spec}"),
            "--control".into(),
            s(&dir.join("never-ctl.sock")),
        ]);
        assert_eq!(code, Some(2), "{spec}: {err}");
        assert!(err.contains(want), "{spec}: {err}");
    }
    assert!(!dir.join("never.sock").exists());
}

/// Addresses of the Unix sockets process `pid` holds, from its fds and
/// `/proc/net/unix` (abstract names start with '@'; unnamed sockets are left out).
fn unix_socket_names(pid: i32) -> Vec<String> {
    let inodes: std::collections::HashSet<String> = fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .filter_map(|e| fs::read_link(e.ok()?.path()).ok())
        .filter_map(|l| {
            let l = l.to_string_lossy().into_owned();
            Some(l.strip_prefix("socket:[")?.strip_suffix(']')?.to_string())
        })
        .collect();
    assert!(!inodes.is_empty(), "the daemon has sockets");
    fs::read_to_string("/proc/net/unix")
        .unwrap()
        .lines()
        .skip(1)
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.len() >= 8 && inodes.contains(f[6])).then(|| f[7].to_string())
        })
        .collect()
}

/// The pid of the process listening on `control` (the daemon), from SO_PEERCRED.
fn daemon_pid(control: &Path) -> i32 {
    use std::os::fd::AsRawFd;
    let s = UnixStream::connect(control).unwrap();
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: SO_PEERCRED writes at most `len` bytes into `cred`, which is exclusively
    // borrowed for the call.
    let r = unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    assert_eq!(r, 0, "SO_PEERCRED: {}", std::io::Error::last_os_error());
    cred.pid
}

#[test]
fn a_connected_frontend_leaves_no_abstract_socket_and_is_logged() {
    let d = Daemon::start(&DaemonSpec::ports(2)).expect("start gsonet");
    let pid = daemon_pid(&d.control);
    let a = TestFrontend::connect(&d.sockets[0], FrontendOpts::default()).expect("frontend");
    let b = TestFrontend::connect(&d.sockets[1], FrontendOpts::default()).expect("frontend");
    let names = unix_socket_names(pid);
    let abstract_names: Vec<&String> = names.iter().filter(|n| n.starts_with('@')).collect();
    assert!(
        abstract_names.is_empty(),
        "the daemon holds abstract sockets anyone may connect to: {abstract_names:?}"
    );
    assert!(
        names.iter().any(|n| *n == s(&d.sockets[0])),
        "the port's own socket is seen: {names:?}"
    );
    // The relay's private directories are gone once the connection is made.
    let prefix = format!("gsonet-relay-{pid}-");
    let left: Vec<String> = fs::read_dir(std::env::temp_dir())
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(&prefix))
        .collect();
    assert!(left.is_empty(), "relay directories left: {left:?}");

    // Who connected, as the kernel saw it: this test process.
    // SAFETY: geteuid and getegid have no preconditions and cannot fail.
    let (uid, gid) = unsafe { (libc::geteuid(), libc::getegid()) };
    let want = format!("pid={} uid={uid} gid={gid}", std::process::id());
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let log = d.log_text();
        let lines: Vec<&str> = log
            .lines()
            .filter(|l| l.contains("frontend connected") && l.contains(&want))
            .collect();
        if lines.len() >= 2 {
            assert!(lines.iter().any(|l| l.contains(&s(&d.sockets[0]))));
            assert!(lines.iter().any(|l| l.contains(&s(&d.sockets[1]))));
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no credentials line ({want}) for both ports:\n{log}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(d.stats().unwrap()["ports"][0]["connected"], true);
    drop((a, b));
}

#[test]
fn reconnecting_in_a_loop_does_not_flood_the_log() {
    let d = Daemon::start(&DaemonSpec::ports(1)).expect("start gsonet");
    for _ in 0..60 {
        let mut c = UnixStream::connect(&d.sockets[0]).unwrap();
        let _ = c.write_all(b"x");
        drop(c);
        std::thread::sleep(Duration::from_millis(5));
    }
    let connect_lines = |log: &str| {
        log.lines()
            .filter(|l| l.contains("frontend connected"))
            .map(str::to_string)
            .collect::<Vec<_>>()
    };
    // Let the daemon work through them, then a window (10 s) pass.
    let t0 = Instant::now();
    while connect_lines(&d.log_text()).is_empty() {
        assert!(t0.elapsed() < Duration::from_secs(10), "no connect line");
        std::thread::sleep(Duration::from_millis(50));
    }
    std::thread::sleep(Duration::from_secs(11));
    let before = connect_lines(&d.log_text()).len();
    // Ten lines per ten seconds per port, connects and disconnects together; the
    // loop above may span two windows.
    assert!(
        (1..=20).contains(&before),
        "{before} connect lines for 60 connections:\n{}",
        d.log_text()
    );
    // A frontend after the flood is still served, and logged with the count of
    // lines left out.
    let deadline = Instant::now() + Duration::from_secs(30);
    let _fe = loop {
        match TestFrontend::connect(&d.sockets[0], FrontendOpts::default()) {
            Ok(f) => break f,
            Err(e) => assert!(Instant::now() < deadline, "port never came back: {e:#}"),
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let want = format!("pid={}", std::process::id());
    let t0 = Instant::now();
    loop {
        let lines = connect_lines(&d.log_text());
        if let Some(last) = lines.iter().rev().find(|l| l.contains(&want)) {
            assert!(
                !last.contains("suppressed=0"),
                "the line after the flood counts what was left out: {last}"
            );
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(10), "{lines:#?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn control_client(ctl: &Path) -> UnixStream {
    let c = UnixStream::connect(ctl).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    c
}

/// Reads one answer line; None at end of stream or on a read error.
fn read_answer(r: &mut BufReader<UnixStream>) -> Option<String> {
    let mut line = String::new();
    match r.read_line(&mut line) {
        Ok(0) | Err(_) => None,
        Ok(_) => Some(line),
    }
}

/// Whether the server closed `c` (end of stream; an error counts as closed too).
fn closed(c: &mut UnixStream) -> bool {
    let mut b = [0u8; 64];
    loop {
        match c.read(&mut b) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e) => return e.kind() != std::io::ErrorKind::WouldBlock,
        }
    }
}

#[test]
fn the_control_socket_is_private_and_bounded() {
    // Enough ports for a stats answer far longer than a request may be.
    let d = Daemon::start(&DaemonSpec::ports(24)).expect("start gsonet");
    let ctl = d.control.clone();
    assert_eq!(
        mode_of(&ctl),
        0o600,
        "the control socket is the owner's only"
    );

    // A line over 4 KiB: an error naming the bound, then the connection is closed.
    let mut c = control_client(&ctl);
    let long = format!("{{\"cmd\":\"stats\",\"pad\":\"{}\"}}\n", "x".repeat(8192));
    let _ = c.write_all(long.as_bytes());
    let mut r = BufReader::new(c.try_clone().unwrap());
    let answer = read_answer(&mut r).expect("an answer to the long line");
    assert!(answer.contains("4096"), "{answer}");
    assert!(read_answer(&mut r).is_none(), "closed after the long line");

    // A line of exactly 4096 bytes is read (and refused as a request), and the
    // connection goes on.
    let mut c = control_client(&ctl);
    let mut line = "{\"cmd\":\"stats\"}".to_string();
    line.push_str(&" ".repeat(4096 - line.len()));
    assert_eq!(line.len(), 4096);
    c.write_all(format!("{line}\n{{\"cmd\":\"stats\"}}\n").as_bytes())
        .unwrap();
    let mut r = BufReader::new(c.try_clone().unwrap());
    let first = read_answer(&mut r).unwrap();
    let v: serde_json::Value = serde_json::from_str(&first).unwrap();
    assert!(v["ports"].is_array() || v["error"].is_string(), "{first}");
    let second = read_answer(&mut r).unwrap();
    let v: serde_json::Value = serde_json::from_str(&second).unwrap();
    assert_eq!(v["ports"].as_array().map(|p| p.len()), Some(24));
    drop(r);
    drop(c);

    // Sixteen clients hold every slot: one idle, one trickling a byte at a time.
    std::thread::sleep(Duration::from_millis(200));
    let held: Vec<UnixStream> = (0..16).map(|_| control_client(&ctl)).collect();
    let trickle = held[0].try_clone().unwrap();
    let trickler = std::thread::spawn(move || {
        let mut t = trickle;
        for _ in 0..60 {
            if t.write_all(b" ").is_err() {
                return;
            }
            std::thread::sleep(Duration::from_millis(500));
        }
    });
    std::thread::sleep(Duration::from_millis(300));
    // The seventeenth is refused at once, with a reason.
    let t0 = Instant::now();
    let extra = control_client(&ctl);
    extra
        .set_read_timeout(Some(Duration::from_secs(3)))
        .unwrap();
    let mut r = BufReader::new(extra);
    let answer = read_answer(&mut r).expect("the 17th connection is answered at once");
    assert!(answer.contains("busy"), "{answer}");
    assert!(read_answer(&mut r).is_none(), "and closed");
    assert!(t0.elapsed() < Duration::from_secs(3));

    // Idle clients cannot keep their slots: within the idle time (10 s) they are cut
    // and `gsonet stats` answers again, for every port.
    let t0 = Instant::now();
    let stats = loop {
        if let Ok(v) = stats_json(&ctl) {
            if v["ports"].is_array() {
                break v;
            }
        }
        assert!(
            t0.elapsed() < Duration::from_secs(40),
            "stats never answered again"
        );
        std::thread::sleep(Duration::from_millis(250));
    };
    assert_eq!(stats["ports"].as_array().unwrap().len(), 24);
    for mut h in held {
        h.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        assert!(closed(&mut h), "an idle client was cut");
    }
    trickler.join().unwrap();
}

//! When a port offers VIRTIO_F_RING_PACKED (bit 34), against the real daemon:
//! `packed=auto` (the default) offers it when the record of the packed rings'
//! positions (`SOCKET.rings`, which a restarted gsonet resumes them from) can be
//! kept beside the socket, and offers split rings only when it cannot, saying so in
//! its log and in `gsonet stats`; `packed=on` offers it either way; `packed=off`
//! never, and keeps no record.
//!
//! The record is made impossible with a directory where the file would be: opening
//! a directory for writing fails for root too.

mod common;

use std::path::{Path, PathBuf};

use common::daemon::{bin, unique_tag, Daemon, DaemonSpec};
use common::frontend::{feat, FrontendOpts, TestFrontend};
use serde_json::Value;

const RING_PACKED: u64 = 1 << 34;

/// A fresh directory of the test's own, removed with what is in it when dropped.
struct Dir(PathBuf);

impl Dir {
    fn new() -> Dir {
        let d = std::env::temp_dir().join(format!("gsonet-packed-offer-{}", unique_tag()));
        std::fs::create_dir_all(&d).unwrap();
        Dir(d)
    }

    fn join(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn rings(socket: &Path) -> PathBuf {
    let mut p = socket.to_path_buf().into_os_string();
    p.push(".rings");
    PathBuf::from(p)
}

/// The daemon with one port (0, socket in the temp directory) with `opts0`, and
/// one more port (1) on `socket` with `opts1`.
fn start(opts0: &str, socket: &Path, opts1: &str) -> Daemon {
    let mut p = format!("socket={}", socket.display());
    if !opts1.is_empty() {
        p.push(',');
        p.push_str(opts1);
    }
    Daemon::start_with(
        &DaemonSpec {
            ports: vec![opts0.into()],
            tap: None,
        },
        &["--port", &p],
    )
    .expect("daemon")
}

fn offered(stats: &Value, port: usize) -> u64 {
    stats["ports"][port]["offered"]
        .as_u64()
        .unwrap_or_else(|| panic!("no offered features for port {port}: {stats}"))
}

/// What a frontend that does not ask for packed rings is offered on `socket`.
fn offer_seen(socket: &Path) -> u64 {
    let fe = TestFrontend::connect(socket, FrontendOpts::default()).expect("frontend");
    assert!(!fe.is_packed(), "packed rings without asking");
    fe.offered_features()
}

/// A frontend asking for packed rings (required) on `socket`.
fn packed_frontend(socket: &Path) -> anyhow::Result<TestFrontend> {
    TestFrontend::connect(
        socket,
        FrontendOpts {
            features: feat::LINUX_DEFAULT | RING_PACKED,
            require_features: true,
            ..Default::default()
        },
    )
}

fn stats_text(d: &Daemon) -> String {
    let out = std::process::Command::new(bin())
        .arg("stats")
        .arg("--control")
        .arg(&d.control)
        .output()
        .expect("gsonet stats");
    assert!(out.status.success(), "{out:?}");
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn a_default_port_offers_packed_rings_where_it_keeps_their_record() {
    let dir = Dir::new();
    let sock = dir.join("a.sock");
    let d = start("", &sock, "");
    for (port, socket) in [(0, d.sockets[0].clone()), (1, sock.clone())] {
        let st = d.stats().unwrap();
        assert_ne!(offered(&st, port) & RING_PACKED, 0, "port {port}: {st}");
        assert!(st["ports"][port].get("packed_refused").is_none(), "{st}");
        assert!(
            rings(&socket).is_file(),
            "no record beside {}",
            socket.display()
        );
        assert_ne!(offer_seen(&socket) & RING_PACKED, 0, "port {port}");
        // A frontend that asks gets packed rings.
        let fe = packed_frontend(&socket).expect("packed frontend");
        assert!(fe.is_packed());
        assert_ne!(fe.acked_features() & RING_PACKED, 0);
    }
    let text = stats_text(&d);
    assert!(text.contains("(packed or split rings)"), "{text}");
}

#[test]
fn a_default_port_offers_split_rings_only_where_it_cannot_keep_their_record() {
    let dir = Dir::new();
    let sock = dir.join("a.sock");
    std::fs::create_dir(rings(&sock)).unwrap();
    let d = start("", &sock, "");
    let st = d.stats().unwrap();
    assert_eq!(offered(&st, 1) & RING_PACKED, 0, "{st}");
    let why = st["ports"][1]["packed_refused"]
        .as_str()
        .unwrap_or_else(|| panic!("no reason given: {st}"));
    assert!(why.contains(&rings(&sock).display().to_string()), "{why}");
    // The other port is not affected.
    assert_ne!(offered(&st, 0) & RING_PACKED, 0, "{st}");
    // Everything else is offered as before.
    assert_eq!(offered(&st, 1), offered(&st, 0) & !RING_PACKED, "{st}");

    assert_eq!(offer_seen(&sock) & RING_PACKED, 0);
    let err = packed_frontend(&sock).err().expect("packed rings refused");
    assert!(err.to_string().contains("does not offer"), "{err:#}");
    // A frontend that does not ask is served as ever: split rings.
    let fe = TestFrontend::connect(&sock, FrontendOpts::default()).expect("split frontend");
    assert!(!fe.is_packed());

    let log = d.log_text();
    assert!(
        log.contains("packed=auto") && log.contains("split rings only"),
        "{log}"
    );
    let text = stats_text(&d);
    assert!(
        text.contains("(split rings only: cannot keep the packed rings' positions in"),
        "{text}"
    );
}

#[test]
fn packed_on_offers_packed_rings_even_without_their_record() {
    let dir = Dir::new();
    let sock = dir.join("a.sock");
    std::fs::create_dir(rings(&sock)).unwrap();
    let d = start("packed=on", &sock, "packed=on");
    let st = d.stats().unwrap();
    assert_ne!(offered(&st, 1) & RING_PACKED, 0, "{st}");
    assert!(st["ports"][1].get("packed_refused").is_none(), "{st}");
    assert!(packed_frontend(&sock).expect("packed frontend").is_packed());
    let log = d.log_text();
    assert!(
        log.contains("after a restart of gsonet a packed guest's queues stop"),
        "{log}"
    );
}

#[test]
fn packed_off_never_offers_packed_rings_and_keeps_no_record() {
    let dir = Dir::new();
    let sock = dir.join("a.sock");
    let d = start("packed=off", &sock, "packed=off");
    let st = d.stats().unwrap();
    for port in [0, 1] {
        assert_eq!(offered(&st, port) & RING_PACKED, 0, "{st}");
        assert!(st["ports"][port].get("packed_refused").is_none(), "{st}");
    }
    assert_eq!(offer_seen(&sock) & RING_PACKED, 0);
    assert!(!rings(&sock).exists());
    assert!(!rings(&d.sockets[0]).exists());
    let text = stats_text(&d);
    assert!(text.contains("(split rings only)"), "{text}");
}

#[test]
fn a_default_port_in_a_directory_gsonet_makes_keeps_its_record_there() {
    // The socket's directory does not exist yet: gsonet makes it when it listens,
    // and the record is opened after that.
    let dir = Dir::new();
    let sock = dir.join("new/sub/a.sock");
    let d = start("", &sock, "");
    let st = d.stats().unwrap();
    assert_ne!(offered(&st, 1) & RING_PACKED, 0, "{st}");
    assert!(rings(&sock).is_file());
    // The same for a port added at runtime.
    let added = dir.join("later/b.sock");
    let out = d.ctl(&["port", "add", &format!("socket={}", added.display())]);
    assert!(out.status.success(), "{out:?}");
    let st = d.stats().unwrap();
    assert_ne!(offered(&st, 2) & RING_PACKED, 0, "{st}");
    assert!(rings(&added).is_file());
    assert_ne!(offer_seen(&added) & RING_PACKED, 0);
}

/// VIRTIO_F_IN_ORDER (bit 35) is offered by default, as DPDK's vhost library offers
/// it, and acked by a frontend that asks; `in_order=off` stops the offer.
#[test]
fn in_order_is_offered_by_default_and_not_with_in_order_off() {
    const IN_ORDER: u64 = 1 << 35;
    let dir = Dir::new();
    let sock = dir.join("a.sock");
    let d = start("", &sock, "in_order=off");
    let st = d.stats().unwrap();
    assert_ne!(offered(&st, 0) & IN_ORDER, 0, "{st}");
    assert_eq!(offered(&st, 1) & IN_ORDER, 0, "{st}");
    assert_eq!(offer_seen(&sock) & IN_ORDER, 0);
    let fe = TestFrontend::connect(
        &d.sockets[0],
        FrontendOpts {
            features: feat::LINUX_DEFAULT | IN_ORDER,
            require_features: true,
            ..Default::default()
        },
    )
    .expect("in-order frontend");
    assert_ne!(fe.acked_features() & IN_ORDER, 0);
}

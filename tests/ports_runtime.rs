//! Ports and uplinks at runtime against a real `gsonet serve`: `gsonet ctl port
//! add/del`, `uplink add/del`, `reload` and SIGHUP. Frames keep flowing between two
//! test frontends while a third port comes and goes; bad specs and files are refused
//! and change nothing.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::daemon::{bin, drops_total, unique_tag, Daemon, DaemonSpec, TempSocket};
use common::frames::{self, Flow, Ips, UdpGso};
use common::frontend::{feat, FrontendOpts, TestFrontend, TxLayout};
use common::rx::recv_where;
use serde_json::Value;
use vhost::VhostBackend;

const T: Duration = Duration::from_secs(5);

/// `gsonet ctl --control C ARGS...`: the answer's JSON, or the error line.
fn ctl(d: &Daemon, args: &[&str]) -> Result<Value, String> {
    let out = Command::new(bin())
        .arg("ctl")
        .arg("--control")
        .arg(&d.control)
        .args(args)
        .output()
        .expect("run gsonet ctl");
    if out.status.success() {
        Ok(serde_json::from_slice(&out.stdout).expect("ctl prints JSON"))
    } else {
        assert_eq!(out.status.code(), Some(2), "a refused change exits 2");
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}

fn connect(path: &Path) -> TestFrontend {
    let opts = FrontendOpts {
        features: feat::RINGS,
        mem_size: 64 << 20,
        ..Default::default()
    };
    let mut fe = TestFrontend::connect(path, opts).expect("frontend");
    fe.post_rx(256, 2048).expect("post rx");
    fe
}

fn temp_sock(what: &str) -> TempSocket {
    TempSocket::new(&format!("rt-{what}"))
}

/// (id, name) of every port in a stats report.
fn ports(s: &Value) -> Vec<(u64, String)> {
    s["ports"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            (
                p["id"].as_u64().unwrap(),
                p["name"].as_str().unwrap().into(),
            )
        })
        .collect()
}

fn port_named<'a>(s: &'a Value, name: &Path) -> Option<&'a Value> {
    let name = name.display().to_string();
    s["ports"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == name.as_str())
}

fn is_socket(p: &Path) -> bool {
    std::fs::symlink_metadata(p)
        .is_ok_and(|m| std::os::unix::fs::FileTypeExt::is_socket(&m.file_type()))
}

fn udp(src: frames::Mac, dst: frames::Mac, seq: u32) -> (gsonet::vnet_hdr::VirtioNetHdr, Vec<u8>) {
    let flow = Flow::new(src, dst, Ips::v4()).ports(4000, 9);
    frames::udp(&flow, &seq.to_be_bytes(), UdpGso::None)
}

/// A unicast stream A -> B, every frame checked at B, while a third port is added,
/// used and removed: the stream loses nothing, the newcomer reaches B and hears A,
/// the removed one's frontend sees its connection closed and its socket goes.
#[test]
fn a_port_added_and_removed_while_others_carry_frames() {
    let d = Daemon::start(&DaemonSpec::ports(2)).expect("start gsonet");
    let (a_mac, b_mac, c_mac) = (frames::mac(0xa), frames::mac(0xb), frames::mac(0xc));
    let mut a = connect(&d.sockets[0]);
    let mut b = connect(&d.sockets[1]);
    // Each learns where the other is.
    let (h, f) = udp(a_mac, frames::BROADCAST, 0);
    a.send(&h, &f, TxLayout::Single).unwrap();
    recv_where(&mut b, T, |x| x.frame == f).expect("A's broadcast at B");
    let (h, f) = udp(b_mac, frames::BROADCAST, 0);
    b.send(&h, &f, TxLayout::Single).unwrap();
    recv_where(&mut a, T, |x| x.frame == f).expect("B's broadcast at A");

    let stop = Arc::new(AtomicBool::new(false));
    let from_c = Arc::new(AtomicUsize::new(0));
    let sent = Arc::new(AtomicUsize::new(0));
    let stream = {
        let (stop, from_c, sent) = (stop.clone(), from_c.clone(), sent.clone());
        std::thread::spawn(move || {
            let mut lost = Vec::new();
            let mut seq = 1u32;
            while !stop.load(Ordering::Relaxed) {
                let (h, f) = udp(a_mac, b_mac, seq);
                a.send(&h, &f, TxLayout::Single).unwrap();
                let got = recv_where(&mut b, T, |x| {
                    if x.frame[6..12] == c_mac {
                        from_c.fetch_add(1, Ordering::Relaxed);
                    }
                    x.frame == f
                });
                if got.is_none() {
                    lost.push(seq);
                }
                if seq.is_multiple_of(8) {
                    // Heard by whoever else is in the untagged domain.
                    let (h, f) = udp(a_mac, frames::BROADCAST, seq);
                    a.send(&h, &f, TxLayout::Single).unwrap();
                }
                a.reclaim_tx().unwrap();
                sent.fetch_add(1, Ordering::Relaxed);
                seq += 1;
            }
            lost
        })
    };
    let wait_more = |n: usize| {
        let until = sent.load(Ordering::Relaxed) + n;
        let deadline = Instant::now() + T;
        while sent.load(Ordering::Relaxed) < until && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
    };
    wait_more(50);

    let path = temp_sock("c");
    let spec = format!("socket={}", path.display());
    let added = ctl(&d, &["port", "add", &spec]).expect("port add");
    assert_eq!(added["ok"]["id"], 2, "{added}");
    assert!(is_socket(&path));
    let mut c = connect(&path);
    // C reaches B (known to the switch) and hears A's broadcasts.
    let (h, f) = udp(c_mac, b_mac, 1);
    c.send(&h, &f, TxLayout::Single).unwrap();
    let deadline = Instant::now() + T;
    while from_c.load(Ordering::Relaxed) == 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(
        from_c.load(Ordering::Relaxed),
        1,
        "C's frame reached B once"
    );
    recv_where(&mut c, T, |x| {
        x.frame[..6] == frames::BROADCAST && x.frame[6..12] == a_mac
    })
    .expect("A's broadcast at C");
    wait_more(50);

    let removed = ctl(
        &d,
        &["port", "del", path.file_name().unwrap().to_str().unwrap()],
    )
    .expect("port del");
    assert_eq!(removed["ok"]["id"], 2, "{removed}");
    assert!(!path.exists(), "the removed port's socket file is gone");
    assert!(
        c.vhost().get_features().is_err(),
        "the removed port's frontend sees its connection closed"
    );
    wait_more(50);
    stop.store(true, Ordering::Relaxed);
    let lost = stream.join().unwrap();
    assert!(lost.is_empty(), "frames A -> B lost: {lost:?}");

    let s = d.stats().unwrap();
    assert_eq!(
        ports(&s).iter().map(|p| p.0).collect::<Vec<_>>(),
        vec![0, 1],
        "{s:#}"
    );
    let total = sent.load(Ordering::Relaxed) as u64;
    // Counters of the others went on through the changes, never reset.
    assert!(s["ports"][0]["stats"]["tx_frames"].as_u64().unwrap() > total);
    assert!(s["ports"][1]["stats"]["rx_frames"].as_u64().unwrap() >= total);
    assert_eq!(drops_total(&s["ports"][0]["stats"]), 0, "{s:#}");
    assert_eq!(drops_total(&s["ports"][1]["stats"]), 0, "{s:#}");
    // A port added after gets a new id: 2 is never given again.
    let again = ctl(&d, &["port", "add", &spec]).expect("port add again");
    assert_eq!(again["ok"]["id"], 3, "{again}");
}

#[test]
fn bad_changes_are_refused_and_change_nothing() {
    let d = Daemon::start(&DaemonSpec::ports(1)).expect("start gsonet");
    let before = ports(&d.stats().unwrap());
    let path = temp_sock("bad");
    let bad = [
        (
            vec!["port", "add", "socket=/tmp/x.sock,turbo=on"],
            "unknown key",
        ),
        (vec!["port", "add", "queues=2"], "socket"),
        (vec!["port", "add", "socket=/tmp/y.sock,vlan=5000"], "vlan"),
        (vec!["port", "del", "9"], "no port 9"),
        (vec!["uplink", "del", "0"], "no uplink 0"),
        (vec!["uplink", "add", "tap="], "tap"),
        (vec!["port", "frob", "x"], "port add SPEC"),
        (vec!["reload"], "--config"),
    ];
    for (args, why) in &bad {
        let e = ctl(&d, args).expect_err("refused");
        assert!(e.contains(why), "{args:?}: {e}");
    }
    // The socket of a port that exists, and a file that is not a socket.
    let dup = format!("socket={}", d.sockets[0].display());
    let e = ctl(&d, &["port", "add", &dup]).expect_err("a second port on one socket");
    assert!(e.contains("exists already"), "{e}");
    std::fs::write(&path, b"keep me").unwrap();
    let e = ctl(&d, &["port", "add", &format!("socket={}", path.display())])
        .expect_err("a regular file is no socket");
    assert!(e.contains("socket"), "{e}");
    assert_eq!(std::fs::read(&path).unwrap(), b"keep me");
    std::fs::remove_file(&path).unwrap();
    assert_eq!(ports(&d.stats().unwrap()), before);
    // The failed attempts used no id the next port could not have.
    let ok = ctl(&d, &["port", "add", &format!("socket={}", path.display())]).unwrap();
    assert!(ok["ok"]["id"].as_u64().unwrap() >= 1);
    ctl(&d, &["port", "del", &path.display().to_string()]).unwrap();
}

fn write(path: &Path, text: &str) {
    std::fs::write(path, text).unwrap();
}

fn port_toml(sock: &Path, extra: &str) -> String {
    format!("[[port]]\nsocket = \"{}\"\n{extra}\n", sock.display())
}

/// Polls the stats until `want` holds.
fn until(d: &Daemon, want: impl Fn(&Value) -> bool) -> Value {
    let deadline = Instant::now() + T;
    loop {
        let s = d.stats().unwrap();
        if want(&s) || Instant::now() > deadline {
            return s;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn reload_applies_the_difference_and_a_bad_file_changes_nothing() {
    let file = std::env::temp_dir().join(format!("gsonet-rt-{}.toml", unique_tag()));
    let [fa, fb, fc, fd] = ["fa", "fb", "fc", "fd"].map(temp_sock);
    write(
        &file,
        &[
            port_toml(&fa, ""),
            port_toml(&fb, ""),
            port_toml(&fd, "vlan = 10"),
        ]
        .concat(),
    );
    let d = Daemon::start_with(&DaemonSpec::ports(1), &["--config", file.to_str().unwrap()])
        .expect("start gsonet");
    let cli = d.sockets[0].clone();
    let s = d.stats().unwrap();
    assert_eq!(ports(&s).len(), 4, "{s:#}");
    let id_of = |s: &Value, p: &Path| port_named(s, p).map(|v| v["id"].as_u64().unwrap());
    let (id_a, id_d) = (id_of(&s, &fa).unwrap(), id_of(&s, &fd).unwrap());
    // A frontend on fa stays connected through a live change of fa.
    let mut on_a = connect(&fa);

    // fa: a live setting; fb: gone; fc: new; fd: another VLAN (a new port).
    write(
        &file,
        &[
            port_toml(&fa, "max_burst = 1400"),
            port_toml(&fc, ""),
            port_toml(&fd, "vlan = 20"),
        ]
        .concat(),
    );
    let r = ctl(&d, &["reload"]).expect("reload");
    let rep = &r["ok"]["reloaded"];
    let names = |v: &Value| -> Vec<String> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_str().unwrap().to_string())
            .collect()
    };
    let shown = |p: &Path| p.display().to_string();
    assert_eq!(names(&rep["added"]), vec![shown(&fc)], "{r}");
    assert_eq!(names(&rep["removed"]), vec![shown(&fb)], "{r}");
    assert_eq!(names(&rep["changed"]), vec![shown(&fa)], "{r}");
    assert_eq!(names(&rep["recreated"]), vec![shown(&fd)], "{r}");
    let s = d.stats().unwrap();
    assert_eq!(id_of(&s, &fa), Some(id_a), "a live change keeps the port");
    assert_eq!(port_named(&s, &fa).unwrap()["max_burst"], 1400);
    assert!(port_named(&s, &fa).unwrap()["connected"].as_bool().unwrap());
    assert!(
        on_a.vhost().get_features().is_ok(),
        "fa's frontend still served"
    );
    assert!(
        id_of(&s, &fd).unwrap() > id_d,
        "a re-created port is a new port"
    );
    assert_eq!(port_named(&s, &fd).unwrap()["vlan"], 20);
    assert!(port_named(&s, &fb).is_none() && !fb.exists());
    assert!(is_socket(&fc));
    assert!(
        port_named(&s, &cli).is_some(),
        "the command line's port stays"
    );

    // What a reload does not apply is named, each by its key; the ports stay.
    write(
        &file,
        &[
            "control_mode = \"0640\"\nmac_aging = 100\n".to_string(),
            port_toml(&fa, "max_burst = 1400"),
            port_toml(&fc, ""),
            port_toml(&fd, "vlan = 20"),
            "[[xen_vif]]\ndomid = 5\n".to_string(),
        ]
        .concat(),
    );
    let r = ctl(&d, &["reload"]).expect("reload");
    assert_eq!(
        names(&r["ok"]["reloaded"]["not_applied"]),
        vec!["control_mode", "mac_aging", "xen_vif"],
        "{r}"
    );
    assert_eq!(ports(&d.stats().unwrap()), ports(&s));

    // Bad files: nothing changes, and the reply says why.
    let before = ports(&s);
    for (text, why) in [
        ("[[port]\nsocket = 1".to_string(), "TOML"),
        (
            [port_toml(&fa, ""), port_toml(&fa, "")].concat(),
            "named twice",
        ),
        (port_toml(&cli, ""), "named twice"),
        (port_toml(&fa, "queues = 99"), "queues"),
    ] {
        write(&file, &text);
        let e = ctl(&d, &["reload"]).expect_err("a bad file");
        assert!(
            e.contains(why) || e.to_lowercase().contains(&why.to_lowercase()),
            "{e}"
        );
        assert!(e.contains("nothing changed"), "{e}");
        assert_eq!(ports(&d.stats().unwrap()), before);
    }

    // SIGHUP does the same; a bad file on SIGHUP leaves gsonet running as it was.
    write(&file, "[[port]\n");
    let hup = |d: &Daemon| {
        let st = Command::new("kill")
            .args(["-HUP", &d.pid().to_string()])
            .status()
            .unwrap();
        assert!(st.success());
    };
    hup(&d);
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(ports(&d.stats().unwrap()), before);
    write(&file, &port_toml(&fa, "max_burst = 1400"));
    hup(&d);
    let s = until(&d, |s| ports(s).len() == 2);
    assert_eq!(
        ports(&s).iter().map(|p| p.1.clone()).collect::<Vec<_>>(),
        vec![shown(&fa), shown(&cli)],
        "{s:#}"
    );
    assert!(!fc.exists() && !fd.exists());
    assert!(d.log_text().contains("configuration reload"));
    let _ = std::fs::remove_file(&file);
}

#[test]
fn uplinks_come_and_go() {
    require_tun!();
    let tap = common::daemon::unique_tap_name();
    // The tap added again at the end is persistent: it outlives the daemon (dropped
    // after it).
    let _cleanup = common::daemon::Link(tap.clone());
    let d = Daemon::start(&DaemonSpec::ports(1)).expect("start gsonet");
    let sys = PathBuf::from(format!("/sys/class/net/{tap}"));
    let r = ctl(&d, &["uplink", "add", &format!("tap={tap},gso=software")]).expect("add");
    assert_eq!(r["ok"]["id"], 0, "{r}");
    assert!(sys.exists(), "the tap is there");
    let e = ctl(&d, &["uplink", "add", &format!("tap={tap}")]).expect_err("twice");
    assert!(e.contains("exists already"), "{e}");
    // Frames from the guest reach it.
    let mut fe = connect(&d.sockets[0]);
    let (h, f) = udp(frames::mac(0xa), frames::BROADCAST, 1);
    fe.send(&h, &f, TxLayout::Single).unwrap();
    let s = until(&d, |s| {
        s["uplinks"][0]["stats"]["rx_frames"].as_u64() >= Some(1)
    });
    assert_eq!(s["uplinks"][0]["name"], format!("tap={tap}"));
    assert!(
        s["uplinks"][0]["stats"]["rx_frames"].as_u64() >= Some(1),
        "{s:#}"
    );
    let r = ctl(&d, &["uplink", "del", &tap]).expect("del");
    assert_eq!(r["ok"]["removed"], format!("tap={tap}"));
    assert!(!sys.exists(), "the tap went with the uplink");
    assert!(d.stats().unwrap()["uplinks"].as_array().unwrap().is_empty());
    assert!(fe.vhost().get_features().is_ok(), "the port is undisturbed");
    let r = ctl(&d, &["uplink", "add", &format!("tap={tap}")]).expect("add again");
    assert_eq!(r["ok"]["id"], 1, "ids are never reused: {r}");
}

/// The number of queues a tap has (tun sets the device's queue count to the fds
/// attached to it).
fn tap_queues(tap: &str) -> usize {
    std::fs::read_dir(format!("/sys/class/net/{tap}/queues"))
        .expect("the tap's queues in sysfs")
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().starts_with("rx-"))
        .count()
}

/// A tap added at run time without `queues=` gets as many queues as the port or Xen
/// vif with the most, as one given at start-up does: a vif's worker K writes and
/// reads tap queue K. The vif here offers 3 queues and waits for a xenstore that
/// never answers; the port has 1 pair.
#[test]
fn a_tap_added_at_run_time_counts_the_xen_vifs_queues() {
    require_tun!();
    let (at_start, added, pinned) = (
        common::daemon::unique_tap_name(),
        common::daemon::unique_tap_name(),
        common::daemon::unique_tap_name(),
    );
    let _cleanup = [&at_start, &added, &pinned].map(|t| common::daemon::Link(t.clone()));
    let d = Daemon::start_with(
        &DaemonSpec::ports(1),
        &[
            "--xen-vif",
            "domid=7,queues=3",
            "--uplink",
            &format!("tap={at_start}"),
        ],
    )
    .expect("start gsonet");
    assert_eq!(tap_queues(&at_start), 3, "{}", d.log_text());
    ctl(&d, &["uplink", "add", &format!("tap={added}")]).expect("add");
    assert_eq!(tap_queues(&added), 3, "{}", d.log_text());
    // `queues=` still decides where given.
    ctl(&d, &["uplink", "add", &format!("tap={pinned},queues=2")]).expect("add");
    assert_eq!(tap_queues(&pinned), 2);
}

//! Hostile guests against the switch itself (issue 9, items 7 and 9), on a real
//! `gsonet serve` over real sockets: a guest flooding source MACs must not make two
//! other guests' unicast flood or slow down; a guest claiming another's MAC is dropped
//! (`mac_lock=on`, or the victim's `mac=`) or, on a plain learning port, moves it at
//! most once a second and is counted; and an untagged port sends untagged frames only
//! (802.1ad, 0x9100, any 802.1Q VID, double tags) while a `trunk=on` port passes
//! exactly its `allowed_vlans`. The VLAN cases watch the tap uplink with AF_PACKET
//! (root only; fails without /dev/net/tun unless GSONET_ALLOW_SKIP=1).

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::afpacket::{PacketSock, Seen};
use common::daemon::{drop_count, port_counter, tun_available, Daemon, DaemonSpec};
use common::frames::{self, Flow, Ips, UdpGso};
use common::frontend::{feat, FrontendOpts, RxFrame, TestFrontend, TxLayout};
use common::rx::{l4_ports, recv_all_where, recv_where};
use gsonet::vnet_hdr::VirtioNetHdr;

const T: Duration = Duration::from_secs(5);
const QUIET: Duration = Duration::from_millis(300);
const FEATS: u64 = feat::RINGS | feat::HOST_ALL;

/// Source addresses the flooding guest sends from.
const FLOOD: usize = 100_000;
/// Of which this many go before the honest guests first speak (more than the old
/// global table held, so a shared table is full by then).
const FLOOD_FIRST: usize = 20_000;

fn connect(d: &Daemon, port: usize) -> TestFrontend {
    let opts = FrontendOpts {
        features: FEATS,
        require_features: true,
        mem_size: 128 << 20,
        ..Default::default()
    };
    let mut fe = TestFrontend::connect(&d.sockets[port], opts).expect("frontend");
    fe.post_rx(256, 2048).expect("post rx");
    fe
}

fn start(ports: &[&str], tap: bool) -> Daemon {
    let mut spec = DaemonSpec {
        ports: ports.iter().map(|s| s.to_string()).collect(),
        tap: None,
    };
    if tap {
        spec = spec.with_tap("gso=pass");
    }
    Daemon::start(&spec).expect("start gsonet")
}

/// A small UDP frame from `src` to `dst`, told apart by its source port.
fn udp(src: frames::Mac, dst: frames::Mac, sport: u16) -> (VirtioNetHdr, Vec<u8>) {
    let flow = Flow::new(src, dst, Ips::v4()).ports(sport, 9);
    let mut data = b"hostile-switch ".to_vec();
    data.extend_from_slice(&sport.to_be_bytes());
    frames::udp(&flow, &data, UdpGso::None)
}

fn send(fe: &mut TestFrontend, src: frames::Mac, dst: frames::Mac, sport: u16) -> Vec<u8> {
    let (h, f) = udp(src, dst, sport);
    fe.send(&h, &f, TxLayout::Single).unwrap();
    f
}

/// Whether a received frame is the one sent with `sport` (tagged or not).
fn is(sport: u16) -> impl Fn(&RxFrame) -> bool {
    let m = marker(sport);
    move |f| f.frame.windows(m.len()).any(|w| w == m)
}

fn got(fe: &mut TestFrontend, sport: u16) -> bool {
    recv_where(fe, T, is(sport)).is_some()
}

fn nothing(fe: &mut TestFrontend, sport: u16) -> bool {
    recv_where(fe, QUIET, is(sport)).is_none()
}

fn port_drop(d: &Daemon, port: usize, reason: &str) -> u64 {
    drop_count(&d.stats().unwrap()["ports"][port]["stats"], reason)
}

/// A random unicast, locally administered address (xorshift over `state`).
fn random_mac(state: &mut u64) -> frames::Mac {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    let b = state.to_be_bytes();
    [(b[0] & 0xfe) | 0x02, b[1], b[2], b[3], b[4], b[5]]
}

// ---------------------------------------------------------------------------------------
// Item 7: MAC learning.

/// Sends frames from random source addresses to `dst` (the flooder's own pinned
/// address, so they go nowhere and cost the switch only their learning): at least
/// `n`, and on until `stop` is set. Waits until the daemon has taken every one and
/// returns how many it sent and how long that took.
fn flood(
    c: &mut TestFrontend,
    dst: frames::Mac,
    n: usize,
    stop: &AtomicBool,
    seed: &mut u64,
) -> (usize, Duration) {
    let t0 = Instant::now();
    let (h, mut f) = udp(frames::mac(0xc), dst, 999);
    let mut sent = 0;
    while sent < n || !stop.load(Ordering::Relaxed) {
        f[6..12].copy_from_slice(&random_mac(seed));
        c.send(&h, &f, TxLayout::Single).unwrap();
        c.reclaim_tx().unwrap();
        sent += 1;
    }
    c.wait_tx_done(Duration::from_secs(120)).unwrap();
    (sent, t0.elapsed())
}

/// Sets its flag when dropped, also when the test fails, so the flooder stops.
struct StopOnDrop<'a>(&'a AtomicBool);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

#[test]
fn a_source_mac_flood_does_not_make_others_flood_or_wait() {
    let c_mac = frames::mac(0xc);
    let d = start(&["", "", &format!("mac={}", mac_text(c_mac))], false);
    let mut a = connect(&d, 0);
    let mut b = connect(&d, 1);
    let mut c = connect(&d, 2);
    let (a_mac, b_mac) = (frames::mac(0xa), frames::mac(0xb));
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;

    // The first part of the flood, before A and B speak.
    let go_on = AtomicBool::new(true);
    let (_, first) = flood(&mut c, c_mac, FLOOD_FIRST, &go_on, &mut seed);

    // The rest of the flood runs while A and B announce themselves and talk (and on
    // until they are done).
    let stop = AtomicBool::new(false);
    let ((rest_n, rest), rounds, c_seen, c_during) = std::thread::scope(|s| {
        let flooder = s.spawn(|| flood(&mut c, c_mac, FLOOD - FLOOD_FIRST, &stop, &mut seed));
        let _stop = StopOnDrop(&stop);
        send(&mut a, a_mac, frames::BROADCAST, 100);
        assert!(got(&mut b, 100), "A's hello at B\n{:#}", d.stats().unwrap());
        send(&mut b, b_mac, frames::BROADCAST, 101);
        assert!(got(&mut a, 101), "B's hello at A\n{:#}", d.stats().unwrap());
        let c_seen = |d: &Daemon| {
            let s = d.stats().unwrap();
            let full = drop_count(&s["ports"][2]["stats"], "rx_queue_full");
            port_counter(&s, 2, "rx_frames") + full
        };
        let c_tx = |d: &Daemon| port_counter(&d.stats().unwrap(), 2, "tx_frames");
        let before = c_seen(&d);
        let c_tx0 = c_tx(&d);
        let mut rounds = Vec::new();
        for i in 0..100u16 {
            let t0 = Instant::now();
            send(&mut a, a_mac, b_mac, 1000 + i);
            assert!(
                got(&mut b, 1000 + i),
                "A -> B {i}\n{:#}",
                d.stats().unwrap()
            );
            send(&mut b, b_mac, a_mac, 3000 + i);
            assert!(
                got(&mut a, 3000 + i),
                "B -> A {i}\n{:#}",
                d.stats().unwrap()
            );
            rounds.push(t0.elapsed());
        }
        let after = c_seen(&d);
        let c_during = c_tx(&d) - c_tx0;
        drop(_stop);
        (flooder.join().unwrap(), rounds, after - before, c_during)
    });
    let worst = rounds.iter().max().copied().unwrap_or_default();
    let total: Duration = rounds.iter().sum();
    eprintln!(
        "flood of source MACs: first {FLOOD_FIRST} at {:.0}/s, then {rest_n} at {:.0}/s; \
         100 A<->B round trips during it ({c_during} flood frames meanwhile): {total:?} \
         (worst {worst:?})",
        FLOOD_FIRST as f64 / first.as_secs_f64(),
        rest_n as f64 / rest.as_secs_f64(),
    );
    let s = d.stats().unwrap();
    assert_eq!(
        c_seen, 0,
        "A and B's unicast was flooded to the flooding guest\n{s:#}"
    );
    // Nobody waited for the flood: it runs until the round trips are done (each
    // within T), and the switch took flood frames between them. The times above
    // are printed, not bounded: a busy machine moves them.
    assert!(c_during > 0, "no flood frame during the round trips\n{s:#}");
    // The flood cost its sender only: no drops at A or B, and nothing reached C.
    assert_eq!(
        d.port_drops(0).unwrap() + d.port_drops(1).unwrap(),
        0,
        "{s:#}"
    );
    assert_eq!(
        port_counter(&s, 2, "tx_frames"),
        (FLOOD_FIRST + rest_n) as u64,
        "{s:#}"
    );
    assert!(nothing(&mut c, 1000));
}

fn mac_text(m: frames::Mac) -> String {
    gsonet::l2::Mac(m).to_string()
}

/// A: an honest guest. V: the victim. X: the guest that claims V's address.
struct Trio {
    d: Daemon,
    a: TestFrontend,
    v: TestFrontend,
    x: TestFrontend,
}

fn trio(v_opts: &str, x_opts: &str) -> Trio {
    let d = start(&["", v_opts, x_opts], false);
    let mut a = connect(&d, 0);
    let mut v = connect(&d, 1);
    let mut x = connect(&d, 2);
    // Everyone announces itself; the hellos are consumed.
    send(&mut a, frames::mac(0xa), frames::BROADCAST, 10);
    send(&mut v, frames::mac(0x1), frames::BROADCAST, 11);
    send(&mut x, frames::mac(0x2), frames::BROADCAST, 12);
    for (fe, sports) in [(&mut a, [11, 12]), (&mut v, [10, 12]), (&mut x, [10, 11])] {
        // Senders run in their own threads: the hellos may come in any order.
        let mut left = sports.to_vec();
        while !left.is_empty() {
            let f = recv_where(fe, T, |f| {
                l4_ports(&f.frame).is_some_and(|p| left.contains(&p.0))
            });
            let sp = f.and_then(|f| l4_ports(&f.frame)).map(|p| p.0);
            let sp = sp.unwrap_or_else(|| panic!("hellos {left:?}\n{:#}", d.stats().unwrap()));
            left.retain(|&x| x != sp);
        }
    }
    Trio { d, a, v, x }
}

const A: frames::Mac = [0x02, 0x00, 0x5e, 0x10, 0x00, 0x0a];
const VICTIM: frames::Mac = [0x02, 0x00, 0x5e, 0x10, 0x00, 0x01];
const X_OWN: frames::Mac = [0x02, 0x00, 0x5e, 0x10, 0x00, 0x02];

/// X sends from the victim's address (to A and to everyone); then A writes to the
/// victim. Returns whether anything of X's reached A.
fn spoof_then_check_victim(t: &mut Trio, base: u16) -> bool {
    send(&mut t.x, VICTIM, A, base);
    send(&mut t.x, VICTIM, frames::BROADCAST, base + 1);
    let reached = !nothing(&mut t.a, base) || !nothing(&mut t.a, base + 1);
    assert!(
        nothing(&mut t.v, base + 1),
        "X's broadcast from V's MAC at V"
    );
    // The victim keeps receiving what is sent to it, and X does not.
    send(&mut t.a, A, VICTIM, base + 2);
    assert!(
        got(&mut t.v, base + 2),
        "A -> V after X's spoof\n{:#}",
        t.d.stats().unwrap()
    );
    assert!(nothing(&mut t.x, base + 2), "V's traffic reached X");
    reached
}

#[test]
fn mac_lock_drops_a_spoofed_source_and_the_victim_keeps_its_traffic() {
    let mut t = trio("", &format!("mac={},mac_lock=on", mac_text(X_OWN)));
    assert!(
        !spoof_then_check_victim(&mut t, 200),
        "X's spoofed frame reached A"
    );
    assert_eq!(port_drop(&t.d, 2, "mac_spoofed"), 2);
    // Any other source is refused too; X's own address works.
    send(&mut t.x, [0x02, 0, 0, 0, 0, 0x77], A, 210);
    assert!(nothing(&mut t.a, 210));
    assert_eq!(port_drop(&t.d, 2, "mac_spoofed"), 3);
    send(&mut t.x, X_OWN, A, 211);
    assert!(got(&mut t.a, 211), "X's own frame at A");
    assert_eq!(port_counter(&t.d.stats().unwrap(), 2, "mac_moves"), 0);
}

#[test]
fn a_pinned_address_never_moves() {
    let mut t = trio(&format!("mac={}", mac_text(VICTIM)), "");
    assert!(
        !spoof_then_check_victim(&mut t, 300),
        "X's frame from V's pinned MAC reached A"
    );
    assert_eq!(port_drop(&t.d, 2, "mac_pinned_elsewhere"), 2);
}

#[test]
fn a_learned_address_moves_counted_and_at_most_once_a_second() {
    let mut t = trio("", "");
    // X takes V's learned address: a move, counted at X.
    send(&mut t.x, VICTIM, A, 400);
    assert!(got(&mut t.a, 400), "X's frame at A");
    // V and X then fight over it: the address moved less than a second ago, so it
    // stays put and V's frames are dropped and counted; the table is not thrashed.
    for i in 0..20 {
        send(&mut t.v, VICTIM, A, 410 + i);
        send(&mut t.x, VICTIM, A, 440 + i);
    }
    let s = t.d.stats().unwrap();
    assert_eq!(port_counter(&s, 2, "mac_moves"), 1, "{s:#}");
    assert_eq!(port_counter(&s, 1, "mac_moves"), 0, "{s:#}");
    assert_eq!(
        drop_count(&s["ports"][1]["stats"], "mac_move_refused"),
        20,
        "{s:#}"
    );
    // A learning switch follows the one move it made.
    send(&mut t.a, A, VICTIM, 401);
    assert!(got(&mut t.x, 401), "A -> V's address after the move");
    // A second later V may take it back.
    std::thread::sleep(Duration::from_millis(1100));
    send(&mut t.v, VICTIM, A, 470);
    assert!(got(&mut t.a, 470), "V's frame at A after the hold");
    send(&mut t.a, A, VICTIM, 471);
    assert!(got(&mut t.v, 471), "A -> V after V took its address back");
    assert!(nothing(&mut t.x, 471));
    assert_eq!(port_counter(&t.d.stats().unwrap(), 1, "mac_moves"), 1);
}

#[test]
fn port_security_configuration_mistakes_exit_2() {
    let help = std::process::Command::new(common::daemon::bin())
        .args(["serve", "--help"])
        .output()
        .unwrap();
    let help = String::from_utf8_lossy(&help.stdout);
    for word in [
        "mac_lock=on",
        "mac_limit=N",
        "trunk=on",
        "allowed_vlans=LIST",
    ] {
        assert!(help.contains(word), "serve --help lacks {word}");
    }
    for (spec, words) in [
        ("socket=/tmp/gsonet-hs-x.sock,mac_lock=on", "mac_lock"),
        (
            "socket=/tmp/gsonet-hs-x.sock,trunk=on,allowed_vlans=10,vlan=10",
            "trunk",
        ),
        ("socket=/tmp/gsonet-hs-x.sock,trunk=on", "allowed_vlans"),
        ("socket=/tmp/gsonet-hs-x.sock,allowed_vlans=10", "trunk"),
        (
            "socket=/tmp/gsonet-hs-x.sock,trunk=on,allowed_vlans=0",
            "allowed_vlans",
        ),
        (
            "socket=/tmp/gsonet-hs-x.sock,trunk=on,allowed_vlans=20-10",
            "allowed_vlans",
        ),
        ("socket=/tmp/gsonet-hs-x.sock,mac_limit=0", "mac_limit"),
    ] {
        let o = std::process::Command::new(common::daemon::bin())
            .args(["serve", "--control", "/tmp/gsonet-hs-x.ctl", "--port", spec])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{spec}: {err}");
        assert!(err.contains(words), "{spec}: {err}");
    }
}

// ---------------------------------------------------------------------------------------
// Item 9: tagged frames from untagged ports, and trunk ports.

/// `f` with tags `(tpid, tci)` inserted after its MACs, outermost first.
fn with_tags(f: &[u8], tags: &[(u16, u16)]) -> Vec<u8> {
    let mut t = f[..12].to_vec();
    for (tpid, tci) in tags {
        t.extend_from_slice(&tpid.to_be_bytes());
        t.extend_from_slice(&tci.to_be_bytes());
    }
    t.extend_from_slice(&f[12..]);
    t
}

/// Frames seen on the tap whose bytes contain `marker` (a frame's UDP payload).
fn on_tap(host: &PacketSock, wait: Duration, marker: &[u8]) -> Vec<Vec<u8>> {
    host.collect(
        wait,
        |s: &Seen| s.wire().windows(marker.len()).any(|w| w == marker),
        |v| !v.is_empty(),
    )
    .unwrap()
    .iter()
    .map(Seen::wire)
    .collect()
}

fn marker(sport: u16) -> Vec<u8> {
    let mut m = b"hostile-switch ".to_vec();
    m.extend_from_slice(&sport.to_be_bytes());
    m
}

/// Every kind of tag an untagged port may not send, as (name, tags).
fn forbidden_tags() -> Vec<(&'static str, Vec<(u16, u16)>)> {
    vec![
        ("802.1Q, access VID", vec![(0x8100, 10)]),
        ("802.1Q, VID no port uses", vec![(0x8100, 30)]),
        ("802.1Q, priority tag", vec![(0x8100, 0xa000)]),
        ("802.1ad", vec![(0x88a8, 30)]),
        (
            "802.1ad + inner access VID",
            vec![(0x88a8, 30), (0x8100, 10)],
        ),
        ("0x9100", vec![(0x9100, 10)]),
        (
            "QinQ 802.1Q + inner access VID",
            vec![(0x8100, 30), (0x8100, 10)],
        ),
    ]
}

#[test]
fn an_untagged_port_sends_untagged_frames_only() {
    if !gsonet::testkit::can_run(tun_available(), "a tap (root)") {
        return;
    }
    // Port 0 untagged, port 1 an access port of VLAN 10.
    let d = start(&["", "vlan=10"], true);
    let mut u = connect(&d, 0);
    let mut p = connect(&d, 1);
    let host = PacketSock::bind(d.tap.as_ref().unwrap(), true).expect("AF_PACKET on the tap");
    let u_mac = frames::mac(0x5);
    // An untagged frame goes out (the listener works).
    send(&mut u, u_mac, frames::BROADCAST, 500);
    assert_eq!(
        on_tap(&host, T, &marker(500)).len(),
        1,
        "untagged frame on the tap"
    );
    let kinds = forbidden_tags();
    for (i, (name, tags)) in kinds.iter().enumerate() {
        let sport = 510 + i as u16;
        let (h, f) = udp(u_mac, frames::BROADCAST, sport);
        u.send(&h, &with_tags(&f, tags), TxLayout::Single).unwrap();
        let seen = on_tap(&host, QUIET, &marker(sport));
        assert!(
            seen.is_empty(),
            "{name} from an untagged port reached the uplink: {seen:02x?}"
        );
        assert!(
            nothing(&mut p, sport),
            "{name} from an untagged port reached VLAN 10"
        );
    }
    let s = d.stats().unwrap();
    let st = &s["ports"][0]["stats"];
    assert_eq!(
        drop_count(st, "tagged_on_untagged_port") + drop_count(st, "tagged_with_access_vlan"),
        kinds.len() as u64,
        "{s:#}"
    );
}

#[test]
fn a_trunk_port_passes_exactly_its_allowed_vlans() {
    if !gsonet::testkit::can_run(tun_available(), "a tap (root)") {
        return;
    }
    // Port 0 a trunk of VLANs 10, 20 and 21; port 1 an access port of VLAN 10; port 2
    // untagged.
    let d = start(&["trunk=on,allowed_vlans=10:20-21", "vlan=10", ""], true);
    let mut t = connect(&d, 0);
    let mut p = connect(&d, 1);
    let mut u = connect(&d, 2);
    let host = PacketSock::bind(d.tap.as_ref().unwrap(), true).expect("AF_PACKET on the tap");
    let t_mac = frames::mac(0x7);
    let outer = |w: &[u8]| {
        (
            u16::from_be_bytes([w[12], w[13]]),
            u16::from_be_bytes([w[14], w[15]]),
        )
    };

    // Allowed VIDs leave tagged, as sent; VLAN 10 also reaches the access port untagged.
    for (i, vid) in [10u16, 20, 21].into_iter().enumerate() {
        let sport = 600 + i as u16;
        let (h, f) = udp(t_mac, frames::BROADCAST, sport);
        t.send(&h, &with_tags(&f, &[(0x8100, vid)]), TxLayout::Single)
            .unwrap();
        let seen = on_tap(&host, T, &marker(sport));
        assert_eq!(
            seen.len(),
            1,
            "VID {vid} from the trunk port\n{:#}",
            d.stats().unwrap()
        );
        assert_eq!(outer(&seen[0]), (0x8100, vid));
        assert_eq!(seen[0][16..], f[12..]);
        if vid == 10 {
            let r = recv_where(&mut p, T, is(sport)).expect("VLAN 10 at the access port");
            assert_eq!(r.frame, f);
        } else {
            assert!(nothing(&mut p, sport));
        }
        assert!(nothing(&mut u, sport), "VID {vid} at the untagged port");
    }
    // Untagged frames are the trunk's untagged domain.
    send(&mut t, t_mac, frames::BROADCAST, 610);
    let seen = on_tap(&host, T, &marker(610));
    assert_eq!(seen.len(), 1, "untagged frame from the trunk port");
    assert_eq!(u16::from_be_bytes([seen[0][12], seen[0][13]]), 0x0800);
    assert!(
        got(&mut u, 610),
        "the trunk's untagged frame at the untagged port"
    );
    // Anything else is dropped and counted.
    let refused: Vec<(&str, Vec<(u16, u16)>)> = vec![
        ("VID 30", vec![(0x8100, 30)]),
        ("VID 11", vec![(0x8100, 11)]),
        ("priority tag", vec![(0x8100, 0)]),
        ("802.1ad", vec![(0x88a8, 10)]),
        ("0x9100", vec![(0x9100, 20)]),
    ];
    for (i, (name, tags)) in refused.iter().enumerate() {
        let sport = 620 + i as u16;
        let (h, f) = udp(t_mac, frames::BROADCAST, sport);
        t.send(&h, &with_tags(&f, tags), TxLayout::Single).unwrap();
        assert!(
            on_tap(&host, QUIET, &marker(sport)).is_empty(),
            "{name} reached the uplink"
        );
        assert!(
            nothing(&mut p, sport) && nothing(&mut u, sport),
            "{name} reached a port"
        );
    }
    assert_eq!(port_drop(&d, 0, "vlan_not_allowed"), refused.len() as u64);

    // From the uplink: allowed VIDs reach the trunk port tagged; others do not.
    let far = frames::mac(0x99);
    for (sport, vid, to_trunk) in [(640u16, 20u16, true), (641, 30, false), (642, 10, true)] {
        let (h, f) = udp(far, frames::BROADCAST, sport);
        let wire = with_tags(&f, &[(0x8100, vid)]);
        host.send(&h, &wire).unwrap();
        if to_trunk {
            let r = recv_where(&mut t, T, is(sport))
                .unwrap_or_else(|| panic!("VID {vid} at the trunk\n{:#}", d.stats().unwrap()));
            assert_eq!(r.frame, wire);
        } else {
            assert!(
                nothing(&mut t, sport),
                "VID {vid} (not allowed) at the trunk port"
            );
        }
    }
    let r = recv_where(&mut p, T, is(642)).expect("VID 10 at the access port");
    assert_eq!(r.frame, udp(far, frames::BROADCAST, 642).1);
    // The untagged port gets only the VID no port uses (tag kept, as before).
    let ours = |f: &RxFrame| f.frame.windows(15).any(|w| w == b"hostile-switch ");
    let at_u: Vec<bool> = recv_all_where(&mut u, QUIET, ours)
        .iter()
        .map(|f| is(641)(f))
        .collect();
    assert_eq!(at_u, [true], "frames at the untagged port from the uplink");
}

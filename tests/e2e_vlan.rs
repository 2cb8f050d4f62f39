//! End to end with access VLANs: a real `gsonet serve` with three ports, A and B on
//! VLAN 10 and C untagged, one test frontend each. Checks isolation both ways
//! (broadcasts included), GSO between the VLAN-10 ports (intact to A, which takes it;
//! segmented for B, which does not), and with a tap uplink (root only) that VLAN 10
//! leaves tagged with VID 10 and tagged frames come back untagged to VLAN 10 only.

mod common;

use std::time::Duration;

use common::afpacket::{PacketSock, Seen};
use common::daemon::{port_counter, Daemon, DaemonSpec};
use common::frames::{self, Flow, Ips, UdpGso, MSS4};
use common::frontend::{feat, FrontendOpts, RxFrame, TestFrontend, TxLayout};
use common::rx::{l4_ports, recv_all_where, recv_where};
use gsonet::vnet_hdr::{GsoKind, VirtioNetHdr, F_NEEDS_CSUM};

const T: Duration = Duration::from_secs(5);
const QUIET: Duration = Duration::from_millis(300);

/// Takes everything large.
const FEATS_A: u64 = feat::RINGS | feat::HOST_ALL | feat::GUEST_CSUM | feat::GUEST_GSO;
/// Sends large, takes only wire-size frames with full checksums.
const FEATS_B: u64 = feat::RINGS | feat::HOST_ALL;

const VID: u16 = 10;
const PORTS: [&str; 3] = ["vlan=10", "vlan=10", ""];

fn a_mac() -> frames::Mac {
    frames::mac(0xa)
}
fn b_mac() -> frames::Mac {
    frames::mac(0xb)
}
fn c_mac() -> frames::Mac {
    frames::mac(0xc)
}
fn far_mac() -> frames::Mac {
    frames::mac(0x99)
}

fn spec() -> DaemonSpec {
    DaemonSpec {
        ports: PORTS.iter().map(|s| s.to_string()).collect(),
        tap: None,
    }
}

fn connect(d: &Daemon, port: usize, features: u64) -> TestFrontend {
    let opts = FrontendOpts {
        features,
        require_features: true,
        mem_size: 128 << 20,
        ..Default::default()
    };
    let mut fe = TestFrontend::connect(&d.sockets[port], opts).expect("frontend");
    fe.post_rx(256, 2048).expect("post rx");
    fe
}

struct Rig {
    d: Daemon,
    a: TestFrontend,
    b: TestFrontend,
    c: TestFrontend,
}

fn rig(spec: &DaemonSpec) -> Rig {
    let d = Daemon::start(spec).expect("start gsonet");
    let a = connect(&d, 0, FEATS_A);
    let b = connect(&d, 1, FEATS_B);
    let c = connect(&d, 2, FEATS_B);
    Rig { d, a, b, c }
}

/// A small UDP frame from `src` to `dst` with `tag` as its payload.
fn small(src: frames::Mac, dst: frames::Mac, sport: u16) -> (VirtioNetHdr, Vec<u8>) {
    let flow = Flow::new(src, dst, Ips::v4()).ports(sport, 9);
    frames::udp(&flow, b"vlan test", UdpGso::None)
}

fn is(sport: u16) -> impl Fn(&RxFrame) -> bool {
    move |f| l4_ports(&f.frame).map(|p| p.0) == Some(sport)
}

/// `f` with an 802.1Q tag (priority 0) after the MACs, as gsonet puts it on a trunk.
fn tagged(f: &[u8], vid: u16) -> Vec<u8> {
    let mut t = f[..12].to_vec();
    t.extend_from_slice(&[0x81, 0x00]);
    t.extend_from_slice(&vid.to_be_bytes());
    t.extend_from_slice(&f[12..]);
    t
}

fn nothing_at(fe: &mut TestFrontend, who: &str, sport: u16) {
    assert!(
        recv_where(fe, QUIET, is(sport)).is_none(),
        "{who} got a frame of another VLAN (sport {sport})"
    );
}

#[test]
fn vlans_are_isolated_both_ways() {
    let Rig {
        d,
        mut a,
        mut b,
        mut c,
    } = rig(&spec());
    let bc = frames::BROADCAST;

    // A's broadcast: B (same VLAN) gets it untagged, C does not.
    let (h, f) = small(a_mac(), bc, 1001);
    a.send(&h, &f, TxLayout::HeaderSeparate).unwrap();
    let got = recv_where(&mut b, T, is(1001))
        .unwrap_or_else(|| panic!("A's broadcast at B\n{:#}", d.stats().unwrap()));
    assert_eq!(got.frame, f);
    nothing_at(&mut c, "C", 1001);

    // C's broadcast: neither A nor B.
    let (h, f) = small(c_mac(), bc, 1002);
    c.send(&h, &f, TxLayout::Single).unwrap();
    nothing_at(&mut a, "A", 1002);
    nothing_at(&mut b, "B", 1002);

    // B's broadcast: A, not C.
    let (h, f) = small(b_mac(), bc, 1003);
    b.send(&h, &f, TxLayout::Single).unwrap();
    assert_eq!(recv_where(&mut a, T, is(1003)).expect("at A").frame, f);
    nothing_at(&mut c, "C", 1003);

    // C knows A's MAC but not its VLAN: unicast to A goes nowhere.
    let (h, f) = small(c_mac(), a_mac(), 1004);
    c.send(&h, &f, TxLayout::Single).unwrap();
    nothing_at(&mut a, "A", 1004);
    nothing_at(&mut b, "B", 1004);
    // And A to C's MAC (learnt in the untagged domain only) floods VLAN 10: B only.
    let (h, f) = small(a_mac(), c_mac(), 1005);
    a.send(&h, &f, TxLayout::Single).unwrap();
    assert_eq!(
        recv_where(&mut b, T, is(1005)).expect("flood at B").frame,
        f
    );
    nothing_at(&mut c, "C", 1005);
    // Known unicast within the VLAN.
    let (h, f) = small(b_mac(), a_mac(), 1006);
    b.send(&h, &f, TxLayout::Single).unwrap();
    assert_eq!(
        recv_where(&mut a, T, is(1006)).expect("unicast at A").frame,
        f
    );

    // A guest on an access port sending a tagged frame: dropped and counted.
    let (h, f) = small(a_mac(), bc, 1007);
    a.send(&h, &tagged(&f, VID), TxLayout::Single).unwrap();
    let (h, f) = small(a_mac(), bc, 1008);
    a.send(&h, &tagged(&f, 20), TxLayout::Single).unwrap();
    assert!(
        b.recv(QUIET).is_none(),
        "a tagged frame passed the access port"
    );
    assert!(
        c.recv(QUIET).is_none(),
        "a tagged frame reached the untagged port"
    );
    let s = d.stats().unwrap();
    assert_eq!(
        s["ports"][0]["stats"]["drops"]["tagged_on_access_port"], 2,
        "{s:#}"
    );
    assert_eq!(s["ports"][0]["vlan"], VID);
    assert!(s["ports"][2].get("vlan").is_none(), "{s:#}");
}

#[test]
fn tso_between_vlan_ports_intact_or_segmented() {
    let Rig {
        d,
        mut a,
        mut b,
        mut c,
    } = rig(&spec());
    // Announce A and B.
    let (h, f) = small(a_mac(), frames::BROADCAST, 2001);
    a.send(&h, &f, TxLayout::Single).unwrap();
    recv_where(&mut b, T, is(2001)).expect("A's hello at B");
    let (h, f) = small(b_mac(), frames::BROADCAST, 2002);
    b.send(&h, &f, TxLayout::Single).unwrap();
    recv_where(&mut a, T, is(2002)).expect("B's hello at A");

    // B -> A: 64 KiB TSO, A takes TSO4: one frame, byte for byte, as GSO.
    let data = frames::payload(65535 - 20 - 32, 41);
    let flow = Flow::new(b_mac(), a_mac(), Ips::v4()).ports(2100, 2101);
    let (h, f) = frames::tcp(&flow, 1, &data, Some(MSS4));
    b.send(&h, &f, TxLayout::HeaderThenChunks(4096)).unwrap();
    let mut got = recv_where(&mut a, T, is(2100))
        .unwrap_or_else(|| panic!("TSO frame at A\n{:#}", d.stats().unwrap()));
    assert_eq!(got.hdr.gso.kind, GsoKind::TcpV4, "{:?}", got.hdr);
    assert_eq!(got.hdr.gso_size, MSS4);
    assert_eq!(got.hdr.csum_start, 34);
    assert!(got.frame == f, "frame bytes changed on the way");
    frames::finish_if_partial(&got.hdr, &mut got.frame).unwrap();
    let seg = frames::parse_tcp(&got.frame).expect("etherparse");
    assert!(seg.payload == data);

    // A -> B: B takes nothing large: wire-size segments with full checksums.
    let len = 45 * MSS4 as usize + 1;
    let data = frames::payload(len, 42);
    let seq0 = 0xffff_f000;
    let flow = Flow::new(a_mac(), b_mac(), Ips::v4()).ports(2200, 2201);
    let (h, f) = frames::tcp_with_flags(&flow, seq0, frames::ACK | frames::PSH, &data, Some(MSS4));
    a.send(&h, &f, TxLayout::HeaderThenChunks(4096)).unwrap();
    let segs: Vec<_> = recv_all_where(&mut b, Duration::from_millis(500), is(2200))
        .into_iter()
        .map(|x| {
            assert_eq!(x.hdr.gso.kind, GsoKind::None, "GSO to B: {:?}", x.hdr);
            assert!(!x.hdr.needs_csum(), "partial checksum to B");
            assert!(x.frame.len() <= 1514, "{}-byte frame", x.frame.len());
            frames::parse_tcp(&x.frame).expect("etherparse, checksums")
        })
        .collect();
    assert_eq!(segs.len(), len.div_ceil(MSS4 as usize));
    assert!(frames::reassemble_tcp(&segs, seq0).unwrap() == data);
    nothing_at(&mut c, "C", 2100);
    nothing_at(&mut c, "C", 2200);
    let s = d.stats().unwrap();
    assert_eq!(port_counter(&s, 0, "gso_passed"), 1, "{s:#}");
    assert_eq!(port_counter(&s, 1, "gso_segmented"), 1, "{s:#}");
}

// ---------------------------------------------------------------------------------------
// With a tap uplink (trunk).

/// The VID and untagged bytes of a frame seen on the tap, whether the kernel left the
/// tag in the frame or moved it to PACKET_AUXDATA.
fn untag(s: &Seen) -> (Option<u16>, Vec<u8>) {
    let w = s.wire();
    if w.len() >= 18 && w[12..14] == [0x81, 0x00] {
        let vid = u16::from_be_bytes([w[14], w[15]]) & 0x0fff;
        let mut f = w[..12].to_vec();
        f.extend_from_slice(&w[16..]);
        (Some(vid), f)
    } else {
        (None, w)
    }
}

fn tap_rig() -> Option<(Rig, PacketSock)> {
    if !gsonet::testkit::can_run(common::daemon::tun_available(), "a tap (root)") {
        return None;
    }
    let r = rig(&spec().with_tap("gso=pass"));
    let host = PacketSock::bind(r.d.tap.as_ref().unwrap(), true).expect("AF_PACKET on the tap");
    Some((r, host))
}

#[test]
fn tap_trunk_carries_vlan_10_tagged() {
    let Some((mut r, host)) = tap_rig() else {
        return;
    };
    let from_sport = |sp: u16| move |s: &Seen| l4_ports(&untag(s).1).map(|p| p.0) == Some(sp);

    // A's frame leaves on the tap with VID 10, the same bytes otherwise.
    let (h, f) = small(a_mac(), frames::BROADCAST, 3001);
    r.a.send(&h, &f, TxLayout::HeaderSeparate).unwrap();
    let seen = host
        .collect(T, from_sport(3001), |v| !v.is_empty())
        .unwrap();
    assert_eq!(
        seen.len(),
        1,
        "A's frame on the tap\n{:#}",
        r.d.stats().unwrap()
    );
    assert_eq!(untag(&seen[0]), (Some(VID), f.clone()));
    assert_eq!(seen[0].wire(), tagged(&f, VID));
    // C's leaves untagged.
    let (h, f) = small(c_mac(), frames::BROADCAST, 3002);
    r.c.send(&h, &f, TxLayout::Single).unwrap();
    let seen = host
        .collect(T, from_sport(3002), |v| !v.is_empty())
        .unwrap();
    assert_eq!(seen.len(), 1, "C's frame on the tap");
    assert_eq!(untag(&seen[0]), (None, f));

    // A 64 KiB TSO frame from A leaves tagged (as GSO or segments), payload intact.
    let data = frames::payload(40000, 51);
    let flow = Flow::new(a_mac(), far_mac(), Ips::v4()).ports(3003, 3004);
    let (h, f) = frames::tcp(&flow, 9, &data, Some(MSS4));
    r.a.send(&h, &f, TxLayout::HeaderThenChunks(4096)).unwrap();
    let seen = host
        .collect(T, from_sport(3003), |v| {
            v.iter()
                .map(|s| common::rx::tcp_payload_len(&untag(s).1).unwrap_or(0))
                .sum::<usize>()
                >= data.len()
        })
        .unwrap();
    assert!(!seen.is_empty(), "TSO frame on the tap");
    let mut segs = Vec::new();
    for s in &seen {
        let (vid, mut fr) = untag(s);
        assert_eq!(vid, Some(VID));
        if let Some(v) = s.vnet.filter(|v| v.flags & F_NEEDS_CSUM != 0) {
            // The packet socket's csum_start counts from the frame it hands us.
            let mut v = v;
            if s.vlan.is_none() {
                v.csum_start -= 4;
            }
            frames::finish_if_partial(&v, &mut fr).unwrap();
        }
        segs.push(frames::parse_tcp(&fr).expect("etherparse"));
    }
    assert!(frames::reassemble_tcp(&segs, 9).unwrap() == data);
}

#[test]
fn tap_tagged_frames_reach_only_their_vlan_untagged() {
    let Some((mut r, host)) = tap_rig() else {
        return;
    };
    // A tagged broadcast from the host, VID 10: A and B get it untagged; C nothing.
    let (h, f) = small(far_mac(), frames::BROADCAST, 4001);
    host.send(&h, &tagged(&f, VID)).unwrap();
    for (fe, who) in [(&mut r.a, "A"), (&mut r.b, "B")] {
        let got = recv_where(fe, T, is(4001))
            .unwrap_or_else(|| panic!("VLAN-10 frame at {who}\n{:#}", r.d.stats().unwrap()));
        assert_eq!(got.frame, f, "{who}");
    }
    nothing_at(&mut r.c, "C", 4001);
    // Untagged and another VID: C only.
    let (h, f) = small(far_mac(), frames::BROADCAST, 4002);
    host.send(&h, &f).unwrap();
    assert_eq!(recv_where(&mut r.c, T, is(4002)).expect("at C").frame, f);
    let (h, f2) = small(far_mac(), frames::BROADCAST, 4003);
    host.send(&h, &tagged(&f2, 30)).unwrap();
    let want = tagged(&f2, 30);
    recv_where(&mut r.c, T, |x| x.frame == want).expect("VID 30 at C, tag kept");
    nothing_at(&mut r.a, "A", 4002);
    nothing_at(&mut r.b, "B", 4002);
    nothing_at(&mut r.a, "A", 4003);

    // A tagged TSO frame from the host to A (learnt in VLAN 10 from its hello): the
    // tag comes off, csum_start moves back, A gets it whole.
    let (h, f) = small(a_mac(), frames::BROADCAST, 4004);
    r.a.send(&h, &f, TxLayout::Single).unwrap();
    recv_where(&mut r.b, T, is(4004)).expect("A's hello at B");
    let data = frames::payload(30000, 52);
    let flow = Flow::new(far_mac(), a_mac(), Ips::v4()).ports(4005, 4006);
    let (mut h, f) = frames::tcp(&flow, 77, &data, Some(MSS4));
    h.csum_start += 4;
    host.send(&h, &tagged(&f, VID)).unwrap();
    let mut got = recv_where(&mut r.a, T, is(4005))
        .unwrap_or_else(|| panic!("tagged TSO frame at A\n{:#}", r.d.stats().unwrap()));
    assert_eq!(got.hdr.gso.kind, GsoKind::TcpV4, "{:?}", got.hdr);
    assert_eq!(got.hdr.csum_start, 34);
    frames::finish_if_partial(&got.hdr, &mut got.frame).unwrap();
    let seg = frames::parse_tcp(&got.frame).expect("etherparse");
    assert_eq!(seg.seq, 77);
    assert!(seg.payload == data);
    nothing_at(&mut r.b, "B", 4005);
    nothing_at(&mut r.c, "C", 4005);
}

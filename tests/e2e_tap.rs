//! End to end through a tap: a real `gsonet serve` process with one vhost-user port
//! and a tap uplink, driven by the in-process test frontend over the real socket.
//! The host side of the tap is an AF_PACKET socket with PACKET_VNET_HDR, so the test
//! sees exactly the skb the kernel got from gsonet (GSO metadata included) and can
//! inject GSO frames into the tap. Every frame is checked with etherparse.
//!
//! Needs root (creates taps); each test skips with a message otherwise.

mod common;

use std::time::Duration;

use common::afpacket::{is_gso, PacketSock, Seen};
use common::daemon::{drop_count, drops_total, port_counter, uplink_counter, Daemon, DaemonSpec};
use common::frames::{self, Flow, Ips, UdpGso, MSS4, MSS6};
use common::frontend::{feat, BadTx, FrontendOpts, RxFrame, TestFrontend, TxLayout};
use common::rx::{l4_ports, recv_where, tcp_payload_len};
use gsonet::vnet_hdr::{GsoKind, VirtioNetHdr, F_NEEDS_CSUM, HDR_LEN};

const T: Duration = Duration::from_secs(5);
const QUIET: Duration = Duration::from_millis(400);

/// What a Linux guest with TSO/UFO on acks.
const FEATS: u64 = feat::VERSION_1
    | feat::CSUM
    | feat::HOST_TSO4
    | feat::HOST_TSO6
    | feat::HOST_ECN
    | feat::HOST_UFO
    | feat::GUEST_CSUM
    | feat::GUEST_TSO4
    | feat::GUEST_TSO6
    | feat::MRG_RXBUF
    | feat::EVENT_IDX
    | feat::INDIRECT_DESC;

/// The guest's MAC and a destination that is neither the guest nor the tap (the
/// kernel drops such frames as PACKET_OTHERHOST after AF_PACKET has seen them).
fn guest_mac() -> frames::Mac {
    frames::mac(0x01)
}
fn far_mac() -> frames::Mac {
    frames::mac(0x99)
}

struct Rig {
    d: Daemon,
    fe: TestFrontend,
    host: PacketSock,
}

fn opts(features: u64) -> FrontendOpts {
    FrontendOpts {
        features,
        require_features: true,
        queue_size: 256,
        mem_size: 128 << 20,
        ..Default::default()
    }
}

fn rig(features: u64) -> Rig {
    rig_with(features, "gso=pass")
}

fn rig_with(features: u64, uplink_opts: &str) -> Rig {
    let d = Daemon::start(&DaemonSpec::ports(1).with_tap(uplink_opts)).expect("start gsonet");
    let host = PacketSock::bind(d.tap.as_ref().unwrap(), true).expect("AF_PACKET on the tap");
    let mut fe = TestFrontend::connect(&d.sockets[0], opts(features)).expect("frontend");
    fe.post_rx(256, 2048).expect("post rx");
    // Announce the guest as a guest would (ARP): gsonet learns its MAC, so frames
    // from the tap to it are unicast (held and retried while its RX queue is busy).
    announce(&mut fe, &host);
    Rig { d, fe, host }
}

fn announce(fe: &mut TestFrontend, host: &PacketSock) {
    let flow = Flow::new(guest_mac(), frames::BROADCAST, Ips::v4()).ports(68, 67);
    let (h, f) = frames::udp(&flow, b"hello", UdpGso::None);
    fe.send(&h, &f, TxLayout::Single).unwrap();
    let seen = host
        .collect(T, |s| s.frame == f, |v| !v.is_empty())
        .unwrap();
    assert_eq!(seen.len(), 1, "announcement did not reach the tap");
}

/// Frames of `flow` seen on the tap until `want_bytes` of TCP payload arrived.
fn tap_tcp(host: &PacketSock, flow: &Flow, want_bytes: usize) -> Vec<Seen> {
    let (sp, dp) = (flow.sport, flow.dport);
    host.collect(
        T,
        |s| l4_ports(&s.frame) == Some((sp, dp)),
        |v| {
            v.iter()
                .map(|s| tcp_payload_len(&s.frame).unwrap_or(0))
                .sum::<usize>()
                >= want_bytes
        },
    )
    .expect("read the tap")
}

/// Checks tap frames of one TCP flow: finishes partial checksums as the kernel
/// would, validates with etherparse, reassembles by sequence number.
fn check_tcp_on_tap(seen: &[Seen], seq0: u32, data: &[u8], ipv6: bool) {
    assert!(!seen.is_empty(), "nothing arrived on the tap");
    let mut segs = Vec::new();
    for s in seen {
        let mut f = s.frame.clone();
        if let Some(h) = &s.vnet {
            frames::finish_if_partial(h, &mut f).expect("csum_start/offset");
            if is_gso(&s.vnet) {
                let kind = if ipv6 { GsoKind::TcpV6 } else { GsoKind::TcpV4 };
                assert_eq!(h.gso.kind, kind, "GSO type on the tap");
                assert!(h.needs_csum(), "GSO frame without NEEDS_CSUM");
                assert_eq!(h.csum_offset, 16);
            }
        }
        segs.push(frames::parse_tcp(&f).expect("etherparse accepts the frame"));
    }
    let got = frames::reassemble_tcp(&segs, seq0).expect("reassemble");
    assert_eq!(got.len(), data.len(), "payload length");
    assert!(got == data, "payload differs");
}

fn tso_to_tap(ips: Ips, mss: u16, len: usize) {
    require_tun!();
    let mut r = rig(FEATS);
    let flow = Flow::new(guest_mac(), far_mac(), ips).ports(40001, 5201);
    let data = frames::payload(len, 7);
    let seq0 = 0x1000_0000;
    let (hdr, frame) = frames::tcp(&flow, seq0, &data, Some(mss));
    r.fe.send(&hdr, &frame, TxLayout::HeaderThenChunks(4096))
        .unwrap();
    r.fe.wait_tx_done(T).unwrap();
    let seen = tap_tcp(&r.host, &flow, data.len());
    check_tcp_on_tap(&seen, seq0, &data, ips.is_v6());
    // With gso=pass the kernel received the frame in one piece, as sent.
    assert_eq!(seen.len(), 1, "expected one GSO frame on the tap");
    let h = seen[0].vnet.unwrap();
    assert!(is_gso(&seen[0].vnet), "the tap got no GSO metadata: {h:?}");
    assert_eq!(h.gso_size, mss);
    assert_eq!(h.csum_start as usize, 14 + ips.ip_len());
    let s = r.d.stats().unwrap();
    assert_eq!(uplink_counter(&s, 0, "gso_passed"), 1, "{s:#}");
    assert_eq!(uplink_counter(&s, 0, "gso_segmented"), 0);
}

#[test]
fn tso4_64k_from_guest_reaches_tap_intact() {
    // 45 full segments and a short last one (323 bytes).
    tso_to_tap(Ips::v4(), MSS4, 65535 - 20 - 32);
}

#[test]
fn tso6_64k_from_guest_reaches_tap_intact() {
    // 45 full segments and a 1-byte last one (the Linux 6.6.44 case).
    tso_to_tap(Ips::v6(), MSS6, 45 * MSS6 as usize + 1);
}

/// Frames the host writes into the tap reach the guest: plain, and TSO kept whole
/// (the guest acked GUEST_TSO4/6) with a header the guest accepts.
#[test]
fn frames_written_into_tap_reach_guest() {
    require_tun!();
    let mut r = rig(FEATS);

    // Plain UDP, no offload.
    let flow = Flow::new(far_mac(), guest_mac(), Ips::v4()).ports(6000, 6001);
    let data = frames::payload(300, 1);
    let (h, f) = frames::udp(&flow, &data, UdpGso::None);
    r.host.send(&h, &f).unwrap();
    let got = recv_where(&mut r.fe, T, |x| l4_ports(&x.frame) == Some((6000, 6001)))
        .unwrap_or_else(|| panic!("plain frame from the tap\n{:#}", r.d.stats().unwrap()));
    assert_eq!(got.hdr.gso.kind, GsoKind::None);
    assert!(!got.hdr.needs_csum());
    assert_eq!(got.hdr.num_buffers, 1);
    assert_eq!(got.buffers, 1);
    assert_eq!(got.frame, f, "frame bytes");
    assert_eq!(frames::parse_udp(&got.frame).unwrap().payload, data);

    // TSO, IPv4 and IPv6, with partial checksums: must arrive as one GSO frame.
    for (i, (ips, mss)) in [(Ips::v4(), MSS4), (Ips::v6(), MSS6)]
        .into_iter()
        .enumerate()
    {
        let flow = Flow::new(far_mac(), guest_mac(), ips).ports(6100 + i as u16, 6200);
        let data = frames::payload(30000 + 77 * i, 2 + i as u32);
        let seq0 = 777 + i as u32;
        let (h, f) = frames::tcp(&flow, seq0, &data, Some(mss));
        r.host.send(&h, &f).unwrap();
        let mut got = recv_where(&mut r.fe, T, |x| {
            l4_ports(&x.frame) == Some((flow.sport, flow.dport))
        })
        .expect("GSO frame from the tap");
        let kind = if ips.is_v6() {
            GsoKind::TcpV6
        } else {
            GsoKind::TcpV4
        };
        assert_eq!(got.hdr.gso.kind, kind, "{:?}", got.hdr);
        assert_eq!(got.hdr.gso_size, mss);
        assert_eq!(got.hdr.flags & F_NEEDS_CSUM, F_NEEDS_CSUM);
        assert_eq!(got.hdr.csum_start as usize, 14 + ips.ip_len());
        assert_eq!(got.hdr.csum_offset, 16);
        // 2048-byte buffers: the frame spans several, and num_buffers says so.
        let need = (HDR_LEN + got.frame.len()).div_ceil(2048) as u16;
        assert_eq!(got.hdr.num_buffers, need);
        assert_eq!(got.buffers, need);
        frames::finish_if_partial(&got.hdr, &mut got.frame).unwrap();
        let seg = frames::parse_tcp(&got.frame).expect("etherparse");
        assert_eq!(seg.seq, seq0);
        assert!(seg.payload == data, "payload differs");
    }
}

/// A guest that acked no GUEST_* offload gets what the host writes into the tap as
/// wire-size frames with full checksums (the tap's offloads follow the guest).
#[test]
fn guest_without_offloads_gets_no_gso_from_tap() {
    require_tun!();
    let feats = feat::VERSION_1 | feat::MRG_RXBUF | feat::EVENT_IDX;
    let mut r = rig(feats);
    let flow = Flow::new(far_mac(), guest_mac(), Ips::v4()).ports(6300, 6301);
    let data = frames::payload(20000, 3);
    let (h, f) = frames::tcp(&flow, 5, &data, Some(MSS4));
    r.host.send(&h, &f).unwrap();
    let mut segs = Vec::new();
    let mut bytes = 0;
    while bytes < data.len() {
        let got = recv_where(&mut r.fe, T, |x| l4_ports(&x.frame) == Some((6300, 6301)))
            .unwrap_or_else(|| {
                panic!(
                    "only {bytes} of {} bytes arrived\n{:#}",
                    data.len(),
                    r.d.stats().unwrap()["ports"][0]["stats"]
                )
            });
        assert_eq!(got.hdr.gso.kind, GsoKind::None, "{:?}", got.hdr);
        assert!(
            !got.hdr.needs_csum(),
            "partial checksum to a guest without GUEST_CSUM"
        );
        assert!(got.frame.len() <= 1514, "{}-byte frame", got.frame.len());
        let s = frames::parse_tcp(&got.frame).expect("etherparse, checksum");
        bytes += s.payload.len();
        segs.push(s);
    }
    assert!(frames::reassemble_tcp(&segs, 5).unwrap() == data);
}

/// Every way of spreading header and frame over descriptors delivers the same frame.
#[test]
fn every_tx_layout_reaches_tap() {
    require_tun!();
    let mut r = rig(FEATS);
    let layouts = TxLayout::matrix();
    let mut sent = Vec::new();
    for (i, l) in layouts.iter().enumerate() {
        let flow = Flow::new(guest_mac(), far_mac(), Ips::v4()).ports(42000 + i as u16, 80);
        let data = frames::payload(9000 + i * 13, 100 + i as u32);
        let (h, f) = frames::tcp(&flow, 1000 * i as u32, &data, Some(MSS4));
        r.fe.send(&h, &f, l.clone()).unwrap();
        sent.push((flow, data));
    }
    r.fe.wait_tx_done(T).unwrap();
    let n = layouts.len();
    let seen = r
        .host
        .collect(
            T,
            |s| l4_ports(&s.frame).is_some_and(|(sp, _)| (42000..42000 + n as u16).contains(&sp)),
            |v| v.len() >= n,
        )
        .unwrap();
    for (i, (flow, data)) in sent.iter().enumerate() {
        let mine: Vec<Seen> = seen
            .iter()
            .filter(|s| l4_ports(&s.frame).map(|p| p.0) == Some(flow.sport))
            .cloned()
            .collect();
        assert!(!mine.is_empty(), "layout {:?}: nothing arrived", layouts[i]);
        check_tcp_on_tap(&mine, 1000 * i as u32, data, false);
    }
    let s = r.d.stats().unwrap();
    assert_eq!(drops_total(&s["ports"][0]["stats"]), 0, "{s:#}");
}

fn send_good_and_see_it(fe: &mut TestFrontend, host: &PacketSock, sport: u16) {
    let flow = Flow::new(guest_mac(), far_mac(), Ips::v4()).ports(sport, 9);
    let data = frames::payload(200, sport as u32);
    let (h, f) = frames::udp(&flow, &data, UdpGso::None);
    fe.send(&h, &f, TxLayout::HeaderSeparate).unwrap();
    let seen = host
        .collect(
            T,
            |s| l4_ports(&s.frame) == Some((sport, 9)),
            |v| !v.is_empty(),
        )
        .unwrap();
    assert_eq!(seen.len(), 1, "good frame after bad ones");
    assert_eq!(seen[0].frame, f);
}

/// Malformed descriptor chains are returned, dropped and counted; nothing of them
/// reaches the tap; the queue keeps working.
#[test]
fn malformed_chains_are_dropped_and_counted() {
    require_tun!();
    let mut r = rig(FEATS);
    let mut uncounted = Vec::new();
    for bad in BadTx::ALL {
        let before = r.d.port_drops(0).unwrap();
        r.fe.send_bad(bad).unwrap();
        r.fe.wait_tx_done(T)
            .unwrap_or_else(|e| panic!("{bad:?} not returned: {e:#}"));
        // Counters are bumped before the chain is returned, but poll briefly anyway.
        let mut after = before;
        for _ in 0..50 {
            after = r.d.port_drops(0).unwrap();
            if after > before {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        if after != before + 1 {
            uncounted.push((bad, after - before));
        }
    }
    // send_bad frames are 64 bytes of 0x5a after the header.
    let leaked = r
        .host
        .collect(QUIET, |s| s.frame.starts_with(&[0x5a; 6]), |_| false)
        .unwrap();
    assert!(
        leaked.is_empty(),
        "{} malformed frames reached the tap",
        leaked.len()
    );
    assert!(
        uncounted.is_empty(),
        "not counted exactly once: {uncounted:?}\n{:#}",
        r.d.stats().unwrap()
    );
    assert!(r.d.alive());
    send_good_and_see_it(&mut r.fe, &r.host, 7001);
}

/// Headers the guest may not send: unknown gso_type, and a GSO type it did not ack.
#[test]
fn bad_gso_headers_are_dropped_and_counted() {
    require_tun!();
    let mut r = rig(FEATS);
    let flow = Flow::new(guest_mac(), far_mac(), Ips::v4()).ports(7100, 9);
    let (_, f) = frames::tcp(&flow, 1, &frames::payload(5000, 9), Some(MSS4));
    let (hdr, _) = frames::tcp(&flow, 1, &frames::payload(5000, 9), Some(MSS4));
    for bad_type in [2u8, 6, 0x7f, 0x82] {
        let mut bytes = common::wire_hdr::encode(&hdr).to_vec();
        bytes[1] = bad_type;
        bytes.extend_from_slice(&f);
        r.fe.send_bytes(&bytes, TxLayout::HeaderSeparate).unwrap();
    }
    // USO was not acked (no HOST_USO).
    let uflow = Flow::new(guest_mac(), far_mac(), Ips::v4()).ports(7101, 9);
    let (uh, uf) = frames::udp(&uflow, &frames::payload(5000, 10), UdpGso::Uso(1472));
    r.fe.send(&uh, &uf, TxLayout::Single).unwrap();
    r.fe.wait_tx_done(T).unwrap();
    let leaked = r
        .host
        .collect(
            QUIET,
            |s| matches!(l4_ports(&s.frame), Some((7100 | 7101, _))),
            |_| false,
        )
        .unwrap();
    assert!(
        leaked.is_empty(),
        "{} bad frames reached the tap",
        leaked.len()
    );
    let s = r.d.stats().unwrap();
    let port = &s["ports"][0]["stats"];
    assert_eq!(drop_count(port, "bad_header"), 4, "{s:#}");
    assert_eq!(drop_count(port, "gso_not_negotiated"), 1, "{s:#}");
    send_good_and_see_it(&mut r.fe, &r.host, 7102);
}

/// The daemon outlives its frontend and serves the next one on the same socket.
#[test]
fn survives_frontend_disconnect_and_accepts_a_new_one() {
    require_tun!();
    let Rig {
        mut d,
        mut fe,
        host,
    } = rig(FEATS);
    send_good_and_see_it(&mut fe, &host, 7200);
    let sock = d.sockets[0].clone();
    for round in 0..2u16 {
        // Leave with a frame in flight on TX and buffers posted on RX.
        let flow = Flow::new(guest_mac(), far_mac(), Ips::v4()).ports(7300, 9);
        let (h, f) = frames::udp(&flow, &frames::payload(100, 1), UdpGso::None);
        fe.send(&h, &f, TxLayout::Single).unwrap();
        drop(fe);
        fe = TestFrontend::connect(&sock, opts(FEATS)).expect("reconnect");
        fe.post_rx(256, 2048).unwrap();
        announce(&mut fe, &host);
        assert!(d.alive(), "gsonet died after a disconnect");
        send_good_and_see_it(&mut fe, &host, 7210 + round);
        // And the new frontend receives from the tap.
        let flow = Flow::new(far_mac(), guest_mac(), Ips::v4()).ports(7400 + round, 9);
        let (_, f) = frames::udp(&flow, &frames::payload(100, 2), UdpGso::None);
        host.send(&VirtioNetHdr::default(), &f).unwrap();
        let got = recv_where(&mut fe, T, |x| {
            l4_ports(&x.frame) == Some((7400 + round, 9))
        })
        .expect("frame from the tap after reconnect");
        assert_eq!(got.frame, f);
    }
    let s = d.stats().unwrap();
    assert_eq!(s["ports"][0]["connected"], true, "{s:#}");
}

/// With gso=software gsonet segments before the tap: the kernel gets wire-size
/// frames (checksums partial or complete, never GSO) that reassemble exactly.
#[test]
fn tso4_to_tap_with_software_gso_is_segmented() {
    require_tun!();
    let mut r = rig_with(FEATS, "gso=software");
    let flow = Flow::new(guest_mac(), far_mac(), Ips::v4()).ports(40002, 5201);
    let len = 45 * MSS4 as usize + 1;
    let data = frames::payload(len, 8);
    let (hdr, frame) = frames::tcp(&flow, 9, &data, Some(MSS4));
    r.fe.send(&hdr, &frame, TxLayout::HeaderThenChunks(4096))
        .unwrap();
    r.fe.wait_tx_done(T).unwrap();
    let seen = tap_tcp(&r.host, &flow, len);
    assert_eq!(
        seen.len(),
        len.div_ceil(MSS4 as usize),
        "segments on the tap"
    );
    for s in &seen {
        assert!(
            !is_gso(&s.vnet),
            "GSO frame with gso=software: {:?}",
            s.vnet
        );
        assert!(s.frame.len() <= 1514, "{}-byte frame", s.frame.len());
    }
    check_tcp_on_tap(&seen, 9, &data, false);
    let s = r.d.stats().unwrap();
    assert_eq!(uplink_counter(&s, 0, "gso_segmented"), 1, "{s:#}");
    assert_eq!(uplink_counter(&s, 0, "gso_passed"), 0, "{s:#}");
}

/// Two guests behind one tap: A with `a_rx` RX buffers, B with plenty; each has said
/// hello (so the switch knows both MACs), and the host then sent 40 UDP frames to
/// each (A's to port 7000, B's to 7001), interleaved or, with `a_first`, all of A's
/// before B's. Each frame's payload is made from its number.
struct TwoBehindTap {
    d: Daemon,
    host: PacketSock,
    a: TestFrontend,
    b: TestFrontend,
    /// When the host started sending the 80 frames.
    sent_at: std::time::Instant,
}

fn two_behind_tap(a_rx: usize, a_first: bool) -> TwoBehindTap {
    let d = Daemon::start(&DaemonSpec::ports(2).with_tap("")).expect("start gsonet");
    let host = PacketSock::bind(d.tap.as_ref().unwrap(), true).expect("AF_PACKET on the tap");
    let (mac_a, mac_b) = (frames::mac(0x1a), frames::mac(0x1b));
    // A's buffers are the ones the test posts, not re-posted as frames arrive.
    let a_opts = FrontendOpts {
        auto_repost: false,
        ..opts(FEATS)
    };
    let mut a = TestFrontend::connect(&d.sockets[0], a_opts).expect("frontend A");
    let mut b = TestFrontend::connect(&d.sockets[1], opts(FEATS)).expect("frontend B");
    a.post_rx(a_rx, 2048).unwrap();
    b.post_rx(256, 2048).unwrap();
    for (fe, mac) in [(&mut a, mac_a), (&mut b, mac_b)] {
        let (h, f) = frames::udp(
            &Flow::new(mac, frames::BROADCAST, Ips::v4()).ports(68, 67),
            b"hi",
            UdpGso::None,
        );
        fe.send(&h, &f, TxLayout::Single).unwrap();
        host.collect(T, |s| s.frame == f, |v| !v.is_empty())
            .unwrap();
    }
    let mut order: Vec<(u32, [u8; 6], u16)> = Vec::new();
    for i in 0..40 {
        for (mac, port) in [(mac_a, 7000), (mac_b, 7001)] {
            order.push((i, mac, port));
        }
    }
    if a_first {
        order.sort_by_key(|&(i, _, port)| (port, i));
    }
    let sent_at = std::time::Instant::now();
    for (i, mac, port) in order {
        let flow = Flow::new(far_mac(), mac, Ips::v4()).ports(port, 9);
        let (h, f) = frames::udp(&flow, &frames::payload(200, i), UdpGso::None);
        host.send(&h, &f).unwrap();
    }
    TwoBehindTap {
        d,
        host,
        a,
        b,
        sent_at,
    }
}

/// Posts one RX buffer to `fe` once `next` has come, and the next one `every` later.
fn trickle_buffer(fe: &mut TestFrontend, next: &mut std::time::Instant, every: Duration) {
    if std::time::Instant::now() >= *next {
        fe.post_rx(1, 2048).unwrap();
        *next += every;
    }
}

/// The next of the host's UDP frames to `port` (from port 9) on `fe`, within `within`.
fn udp_to(fe: &mut TestFrontend, port: u16, within: Duration) -> Option<RxFrame> {
    recv_where(fe, within, |x| l4_ports(&x.frame) == Some((port, 9)))
}

/// A guest that stops reading its RX queue may cost frames for itself, never a stall
/// for the others behind the same tap: after `RX_STALL` the tap reader stops waiting
/// for it and drops its frames at once (`rx_queue_stalled`).
#[test]
fn a_guest_that_stops_reading_does_not_hold_up_the_others() {
    require_tun!();
    let TwoBehindTap {
        d,
        host: _host,
        a: _a,
        mut b,
        sent_at: start,
    } = two_behind_tap(4, false);
    // 40 frames for A (which never reads again) came interleaved with 40 for B.
    let n = 40;
    let mut got = 0;
    while got < n as usize && start.elapsed() < Duration::from_secs(10) {
        if udp_to(&mut b, 7001, Duration::from_millis(200)).is_some() {
            got += 1;
        }
    }
    let took = start.elapsed();
    let s = d.stats().unwrap();
    assert_eq!(got, n as usize, "B got {got} of {n}\n{s:#}");
    let settled = |s: &serde_json::Value| {
        let p = &s["ports"][0]["stats"];
        drop_count(p, "rx_queue_full")
            + drop_count(p, "rx_queue_stalled")
            + port_counter(s, 0, "rx_frames")
    };
    // A's frames settled when B had all of its own (its hello included).
    let a_settled = settled(&s).saturating_sub(1);
    eprintln!("B's 40 frames took {took:?}; {a_settled} of A's settled by then");
    // A's frames beyond its 4 buffers are held at most RX_STALL, then counted:
    // every frame for A (its 40 and B's broadcast hello) is delivered or counted.
    let accounted = settled;
    let deadline = std::time::Instant::now() + Duration::from_secs(3);
    let mut s = d.stats().unwrap();
    while accounted(&s) < n as u64 + 1 && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
        s = d.stats().unwrap();
    }
    assert_eq!(accounted(&s), n as u64 + 1, "{s:#}");
    assert_eq!(port_counter(&s, 0, "rx_frames"), 4, "{s:#}");
    // Counted, not timed: a reader that waited for A would settle each of A's frames
    // (deliver or drop it) before the B frame behind it, so by B's last frame most of
    // A's would be settled; this one had set A's aside and settled few.
    assert!(
        a_settled <= n as u64 / 2,
        "{a_settled} of A's frames settled before B had its 40\n{s:#}"
    );
}

/// A guest that trickles one RX buffer every 100 ms (so its queue never counts as
/// stalled) gets its frames as buffers come, and still costs the others nothing: the
/// tap reader holds its frames aside instead of waiting for it.
#[test]
fn a_guest_that_trickles_buffers_does_not_slow_the_others() {
    require_tun!();
    let TwoBehindTap {
        d,
        host: _host,
        mut a,
        mut b,
        sent_at: start,
    } = two_behind_tap(1, false);
    let n = 40;
    let (mut got_b, mut got_a) = (0, 0);
    let mut next_buffer = std::time::Instant::now();
    let mut buffers = 0;
    while got_b < n as usize && start.elapsed() < Duration::from_secs(10) {
        if std::time::Instant::now() >= next_buffer {
            buffers += 1;
        }
        trickle_buffer(&mut a, &mut next_buffer, Duration::from_millis(100));
        if udp_to(&mut b, 7001, Duration::from_millis(20)).is_some() {
            got_b += 1;
        }
        if udp_to(&mut a, 7000, Duration::from_millis(1)).is_some() {
            got_a += 1;
        }
    }
    let took = start.elapsed();
    let s = d.stats().unwrap();
    assert_eq!(got_b, n as usize, "B got {got_b} of {n}\n{s:#}");
    // Waiting for A, the reader would deliver about one frame of B's per buffer A
    // posts: B would need ~40 of A's buffers. Counted in buffers, not time.
    eprintln!("B's 40 frames took {took:?}, {buffers} of A's buffers (A got {got_a})");
    assert!(
        buffers <= n / 2,
        "B's 40 frames needed {buffers} of A's buffers (A got {got_a})\n{s:#}"
    );
}

/// A burst for a guest whose queue is full, then frames for another: while all it
/// read went to the full guest, the tap reader leaves the rest in the tap's queue
/// (no copy aside) until room comes, for a millisecond at most, so B's frames behind
/// the burst still come at once; A, adding a buffer every 10 ms, gets every one of
/// its frames in order.
#[test]
fn a_burst_for_a_full_guest_does_not_delay_the_next_guest() {
    require_tun!();
    let mut t = two_behind_tap(1, true);
    let start = t.sent_at;
    let n = 40;
    let mut got_a = Vec::new();
    let mut b_done = None;
    let mut got_b = 0;
    let mut next_buffer = std::time::Instant::now();
    while got_a.len() < n && start.elapsed() < Duration::from_secs(10) {
        trickle_buffer(&mut t.a, &mut next_buffer, Duration::from_millis(10));
        while got_b < n && udp_to(&mut t.b, 7001, Duration::from_millis(1)).is_some() {
            got_b += 1;
            if got_b == n {
                b_done = Some((start.elapsed(), got_a.len()));
            }
        }
        if let Some(x) = udp_to(&mut t.a, 7000, Duration::from_millis(1)) {
            got_a.push(x.frame);
        }
    }
    let s = t.d.stats().unwrap();
    assert_eq!(got_b, n, "B got {got_b} of {n}\n{s:#}");
    // Waiting for A's buffers, B's frames would come one per frame of A's, after
    // about 40 of them; counted in A's frames, not time.
    let (b_took, a_by_then) = b_done.unwrap();
    eprintln!("B's 40 frames took {b_took:?}, A had {a_by_then} by then");
    assert!(
        a_by_then <= n / 2,
        "B's frames came after {a_by_then} of A's ({b_took:?})\n{s:#}"
    );
    assert_eq!(got_a.len(), n, "A got {} of {n}\n{s:#}", got_a.len());
    for (i, f) in got_a.iter().enumerate() {
        let want = frames::payload(200, i as u32);
        assert!(f.ends_with(&want), "A's frame {i} out of order\n{s:#}");
    }
    assert_eq!(
        drop_count(&s["ports"][0]["stats"], "rx_queue_full"),
        0,
        "{s:#}"
    );
    // The reader held what it had read for A, and paused.
    assert!(uplink_counter(&s, 0, "rx_held") > 0, "{s:#}");
    assert!(uplink_counter(&s, 0, "rx_pauses") > 0, "{s:#}");
}

/// A tap deleted under a running gsonet leaves its reader with a descriptor that is
/// always readable and fails every read: the reader backs off instead of spinning, so
/// the daemon stays near idle and the failures are counted about once a second.
#[test]
fn a_deleted_tap_costs_next_to_nothing() {
    require_tun!();
    let mut d = Daemon::start(&DaemonSpec::ports(1).with_tap("")).expect("start gsonet");
    let tap = d.tap.clone().unwrap();
    let out = std::process::Command::new("ip")
        .args(["link", "del", &tap])
        .output()
        .expect("ip link del");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Let the back-off reach its ceiling, then watch for two seconds.
    std::thread::sleep(Duration::from_millis(2500));
    let read_errors = |d: &Daemon| {
        let s = d.stats().unwrap();
        drop_count(&s["uplinks"][0]["stats"], "uplink_read_error")
    };
    let cpu0 = common::daemon::cpu_time(d.pid()).unwrap();
    let n0 = read_errors(&d);
    std::thread::sleep(Duration::from_secs(2));
    let cpu = common::daemon::cpu_time(d.pid()).unwrap() - cpu0;
    let n = read_errors(&d) - n0;
    assert!(d.alive(), "gsonet died:\n{}", d.log_text());
    assert!(n0 > 0, "the failing reads are counted");
    assert!(n <= 10, "{n} failed reads in 2 s: no back-off");
    assert!(cpu < Duration::from_millis(500), "{cpu:?} of CPU in 2 s");
}

/// `rx_rate=` on the uplink limits what gsonet sends into it: a guest sending over
/// it is held (its TX queue waits, nothing is dropped), so 16 TSO frames of 64 KiB
/// take at least their wire time at the rate, less the burst.
#[test]
fn uplink_rx_rate_holds_a_guest_sending_to_it() {
    require_tun!();
    let mut r = rig_with(FEATS, "gso=pass,rx_rate=20,rx_burst=64");
    let flow = Flow::new(guest_mac(), far_mac(), Ips::v4()).ports(40002, 5202);
    let data = frames::payload(45 * MSS4 as usize, 9);
    let frames_n = 16;
    let mut wire = 0;
    let started = std::time::Instant::now();
    for i in 0..frames_n {
        let seq = 0x2000_0000 + (i * data.len()) as u32;
        let (hdr, frame) = frames::tcp(&flow, seq, &data, Some(MSS4));
        // On the wire: 45 segments, each with the frame's headers.
        wire = frame.len() + 44 * (frame.len() - data.len());
        r.fe.send(&hdr, &frame, TxLayout::Single).unwrap();
    }
    r.fe.wait_tx_done(Duration::from_secs(20)).unwrap();
    let took = started.elapsed();
    let seen = r
        .host
        .collect(
            T,
            |s| l4_ports(&s.frame) == Some((40002, 5202)),
            |v| v.len() == frames_n,
        )
        .unwrap();
    assert_eq!(seen.len(), frames_n, "frames on the tap");
    // The sender waits off each frame's debt before its next one: the first 64 KiB
    // go on the burst, the last frame is not waited for. 20 Mbit/s = 2,500,000
    // bytes a second.
    let owed = (frames_n - 1) * wire - 64 * 1024;
    let at_rate = Duration::from_secs_f64(owed as f64 / 2.5e6);
    assert!(
        took >= at_rate.mul_f64(0.9),
        "16 frames done in {took:?}; at 20 Mbit/s they need {at_rate:?}"
    );
    let s = r.d.stats().unwrap();
    let holds = port_counter(&s, 0, "tx_holds");
    assert!(holds > 0, "{s:#}");
    assert_eq!(drops_total(&s["uplinks"][0]["stats"]), 0, "{s:#}");
    assert_eq!(drops_total(&s["ports"][0]["stats"]), 0, "{s:#}");

    // Lifted at runtime: the same frames go without a hold.
    let o =
        r.d.ctl(&["uplink:0", "rx_rate=off", "rate=500", "burst=64"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let reply = String::from_utf8_lossy(&o.stdout);
    assert!(reply.contains("\"rate_mbit\": 500"), "{reply}");
    assert!(reply.contains("\"rx_rate_mbit\": null"), "{reply}");
    std::thread::sleep(at_rate / 10); // the last frame's debt, on the old bucket
    for i in 0..frames_n {
        let seq = 0x3000_0000 + (i * data.len()) as u32;
        let (hdr, frame) = frames::tcp(&flow, seq, &data, Some(MSS4));
        r.fe.send(&hdr, &frame, TxLayout::Single).unwrap();
    }
    r.fe.wait_tx_done(T).unwrap();
    let s = r.d.stats().unwrap();
    assert_eq!(
        port_counter(&s, 0, "tx_holds"),
        holds,
        "held after rx_rate=off\n{s:#}"
    );
    let o = r.d.ctl(&["uplink:0", "rx_burst=0"]);
    assert!(!o.status.success(), "rx_burst=0 accepted");
}

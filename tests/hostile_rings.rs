//! A malicious frontend against the real daemon, one case per attack of issue 9 that
//! works at the ring level: an RX ring built to make every frame expensive (item 1),
//! a guest whose call path is slow (item 2), a guest that trickles buffers while a
//! software-segmented frame waits for it (item 6), a jumped avail index (item 10),
//! gso_size 1 and ring-sized segments to a victim that reads, and device resets in a
//! loop (item 11).
//!
//! Every case checks the same three things: the daemon lives, two honest ports keep
//! forwarding to each other in bounded time, and the attacker's port recovers or is
//! cut off cleanly (a new honest frontend on its socket is served). The cases run one
//! at a time (they measure time, CPU and memory of the daemon). Needs root only for
//! the tap case.

mod common;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use common::afpacket::PacketSock;
use common::daemon::{cpu_time, drop_count, port_counter, rss_bytes, Daemon, DaemonSpec};
use common::frames::{self, Flow, Ips, Mac, UdpGso, MSS4};
use common::frontend::{feat, FrontendOpts, RawDesc, TestFrontend, TxLayout, RX_QUEUE, TX_QUEUE};
use common::rx::{l4_ports, recv_where};
use gsonet::backend::vhost::port::{SEGMENTS_BURST, SEGMENTS_PER_SEC};
use gsonet::vnet_hdr::{GsoKind, VirtioNetHdr, F_NEEDS_CSUM};
use vhost::VhostBackend;

const T: Duration = Duration::from_secs(5);

/// What an honest Linux guest acks; it may send TSO.
const HONEST: u64 = feat::LINUX_DEFAULT;
/// A guest that takes no GSO from gsonet: GSO frames for it are segmented in software.
const NO_GUEST_GSO: u64 = feat::RINGS | feat::CSUM | feat::HOST_TSO4 | feat::HOST_TSO6;

/// One case at a time: they measure the daemon's time, CPU and memory.
fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

fn opts(features: u64, queue_size: u16) -> FrontendOpts {
    FrontendOpts {
        features,
        queue_size,
        mem_size: 128 << 20,
        ..Default::default()
    }
}

fn attacker_mac() -> Mac {
    frames::mac(0xa0)
}
fn b_mac() -> Mac {
    frames::mac(0xb0)
}
fn c_mac() -> Mac {
    frames::mac(0xc0)
}

/// An ARP request from `src` (broadcast): what every guest sends first.
fn arp(src: Mac, target_ip: u8) -> Vec<u8> {
    let mut f = Vec::with_capacity(42);
    f.extend_from_slice(&frames::BROADCAST);
    f.extend_from_slice(&src);
    f.extend_from_slice(&[0x08, 0x06, 0, 1, 0x08, 0x00, 6, 4, 0, 1]);
    f.extend_from_slice(&src);
    f.extend_from_slice(&[192, 0, 2, 1]);
    f.extend_from_slice(&[0; 6]);
    f.extend_from_slice(&[192, 0, 2, target_ip]);
    f
}

/// A broadcast from `fe`, so that the switch learns `mac` there.
fn hello(fe: &mut TestFrontend, mac: Mac) {
    fe.send(&VirtioNetHdr::default(), &arp(mac, 9), TxLayout::Single)
        .expect("hello");
}

/// The two honest ports B and C, connected, announced and their hellos consumed.
fn honest_pair(d: &Daemon, b: usize, c: usize) -> (TestFrontend, TestFrontend) {
    let mut fb = TestFrontend::connect(&d.sockets[b], opts(HONEST, 256)).expect("B");
    let mut fc = TestFrontend::connect(&d.sockets[c], opts(HONEST, 256)).expect("C");
    fb.post_rx(256, 2048).unwrap();
    fc.post_rx(256, 2048).unwrap();
    hello(&mut fb, b_mac());
    recv_where(&mut fc, T, |f| f.frame[6..12] == b_mac()).expect("B's hello at C");
    hello(&mut fc, c_mac());
    recv_where(&mut fb, T, |f| f.frame[6..12] == c_mac()).expect("C's hello at B");
    (fb, fc)
}

/// `n` unicast frames B -> C in batches; how long until C has them all (panics if
/// some never arrive within `bound`).
fn forward_unicast(
    d: &Daemon,
    fb: &mut TestFrontend,
    fc: &mut TestFrontend,
    n: usize,
    bound: Duration,
) -> Duration {
    let start = Instant::now();
    let mut got = 0;
    let mut i = 0;
    while got < n {
        let batch = (n - i).min(32);
        for _ in 0..batch {
            let flow = Flow::new(b_mac(), c_mac(), Ips::v4()).ports(5000, 9);
            let (h, f) = frames::udp(&flow, &frames::payload(1000, i as u32), UdpGso::None);
            fb.send(&h, &f, TxLayout::Single).unwrap();
            i += 1;
        }
        let want = got + batch;
        while got < want {
            let left = bound.saturating_sub(start.elapsed());
            if recv_where(fc, left, |x| l4_ports(&x.frame) == Some((5000, 9))).is_none() {
                panic!(
                    "C got {got} of {n} frames from B within {bound:?}\n{:#}",
                    d.stats().unwrap()
                );
            }
            got += 1;
        }
        let _ = fb.reclaim_tx();
    }
    start.elapsed()
}

/// B's broadcast reaches C (and whoever else is on the switch) within `bound`.
fn broadcast_reaches(
    d: &Daemon,
    fb: &mut TestFrontend,
    fc: &mut TestFrontend,
    ip: u8,
    bound: Duration,
) {
    let f = arp(b_mac(), ip);
    fb.send(&VirtioNetHdr::default(), &f, TxLayout::Single)
        .unwrap();
    if recv_where(fc, bound, |x| x.frame == f).is_none() {
        panic!(
            "B's broadcast did not reach C in {bound:?}\n{:#}",
            d.stats().unwrap()
        );
    }
}

/// The attacker's socket serves a new, honest frontend: it announces itself, B's
/// unicast frame reaches it and its frame reaches B.
fn port_serves_again(d: &mut Daemon, port: usize, fb: &mut TestFrontend) {
    assert!(d.alive(), "gsonet died\n{}", d.log_text());
    let mut fresh = TestFrontend::connect(&d.sockets[port], opts(HONEST, 256))
        .unwrap_or_else(|e| panic!("a new frontend on the attacker's socket: {e:#}"));
    fresh.post_rx(256, 2048).unwrap();
    let mac = frames::mac(0xa1);
    hello(&mut fresh, mac);
    recv_where(fb, T, |f| f.frame[6..12] == mac)
        .unwrap_or_else(|| panic!("the new frontend's hello at B\n{:#}", d.stats().unwrap()));
    let flow = Flow::new(b_mac(), mac, Ips::v4()).ports(5100, 9);
    let (h, f) = frames::udp(&flow, &frames::payload(500, 7), UdpGso::None);
    fb.send(&h, &f, TxLayout::Single).unwrap();
    let got = recv_where(&mut fresh, T, |x| l4_ports(&x.frame) == Some((5100, 9)))
        .unwrap_or_else(|| panic!("B's frame at the new frontend\n{:#}", d.stats().unwrap()));
    assert_eq!(got.frame, f);
    assert!(d.alive(), "gsonet died\n{}", d.log_text());
}

// ---------------------------------------------------------------------------------------
// Item 1: unbounded RX work

/// What the attacker fills its RX ring with.
#[derive(Clone, Copy, Debug)]
enum RxBait {
    /// Every chain: one indirect descriptor, a table of 16,384 empty writable
    /// descriptors (INDIRECT_DESC acked or not).
    EmptyIndirect { negotiated: bool },
    /// 1-byte buffers: a 1,400-byte frame would need 1,412 of them.
    TinyBuffers,
}

const RX_QUEUE_SIZE: u16 = 1024;
const TABLE_ENTRIES: u16 = 16384;

fn post_bait(a: &mut TestFrontend, bait: RxBait) {
    match bait {
        RxBait::EmptyIndirect { .. } => {
            let buf = a.alloc_guest(&[0u8; 64]).unwrap();
            let table: Vec<RawDesc> = (0..TABLE_ENTRIES)
                .map(|i| {
                    let d = RawDesc::new(buf, 0).write();
                    if i + 1 < TABLE_ENTRIES {
                        d.next(i + 1)
                    } else {
                        d
                    }
                })
                .collect();
            let t = a.alloc_table(&table).unwrap();
            for _ in 0..RX_QUEUE_SIZE {
                a.push_raw(
                    RX_QUEUE,
                    &[RawDesc::new(t, 16 * u32::from(TABLE_ENTRIES)).indirect()],
                )
                .unwrap();
            }
        }
        RxBait::TinyBuffers => a.post_rx_chains(RX_QUEUE_SIZE as usize, &[1]).unwrap(),
    }
}

/// An attacker on port 0 posts `bait`; B broadcasts (ARP and 1,400-byte frames, each
/// also offered to the attacker) and unicasts to C. Every broadcast reaches C in
/// bounded time, the daemon grows less than 50 MB, the bad buffers are counted under
/// `reason`, and the attacker's socket serves a new frontend once it leaves.
fn rx_bait(bait: RxBait, reason: &str) {
    let _one = serial();
    let mut d = Daemon::start(&DaemonSpec::ports(3)).expect("start gsonet");
    let (mut fb, mut fc) = honest_pair(&d, 1, 2);
    let features = match bait {
        RxBait::EmptyIndirect { negotiated: false } => HONEST & !feat::INDIRECT_DESC,
        _ => HONEST,
    };
    let mut a =
        TestFrontend::connect(&d.sockets[0], opts(features, RX_QUEUE_SIZE)).expect("attacker");
    assert_eq!(
        a.has(feat::INDIRECT_DESC),
        features & feat::INDIRECT_DESC != 0
    );
    post_bait(&mut a, bait);
    hello(&mut a, attacker_mac());
    recv_where(&mut fb, T, |f| f.frame[6..12] == attacker_mac()).expect("attacker's hello at B");
    let rss0 = rss_bytes(d.pid()).unwrap();

    // Every frame B broadcasts is offered to the attacker's ring first or last.
    let start = Instant::now();
    for i in 0..20u8 {
        broadcast_reaches(&d, &mut fb, &mut fc, 10 + i, Duration::from_secs(2));
        let flow = Flow::new(b_mac(), frames::BROADCAST, Ips::v4()).ports(5200, 9);
        let (h, f) = frames::udp(&flow, &frames::payload(1400, i.into()), UdpGso::None);
        fb.send(&h, &f, TxLayout::Single).unwrap();
        recv_where(&mut fc, Duration::from_secs(2), |x| x.frame == f)
            .unwrap_or_else(|| panic!("B's large broadcast at C\n{:#}", d.stats().unwrap()));
        let _ = fb.reclaim_tx();
    }
    let took = start.elapsed();
    forward_unicast(&d, &mut fb, &mut fc, 200, Duration::from_secs(5));
    let grew = rss_bytes(d.pid()).unwrap().saturating_sub(rss0);
    let s = d.stats().unwrap();
    // Each broadcast had its 2 s; the total is printed, not bounded (a busy machine
    // moves it): the bait's cost shows as its drop count and the memory it did not
    // take.
    eprintln!("40 broadcasts past the bait took {took:?}");
    assert!(grew < 50 << 20, "the daemon grew by {} MB", grew >> 20);
    assert!(
        drop_count(&s["ports"][0]["stats"], reason) >= 1,
        "{reason} not counted\n{s:#}"
    );

    drop(a);
    port_serves_again(&mut d, 0, &mut fb);
}

#[test]
fn empty_indirect_rx_chains_without_indirect_desc_cost_bounded_work() {
    rx_bait(RxBait::EmptyIndirect { negotiated: false }, "rx_bad_chain");
}

#[test]
fn empty_indirect_rx_chains_with_indirect_desc_cost_bounded_work() {
    rx_bait(RxBait::EmptyIndirect { negotiated: true }, "rx_bad_chain");
}

#[test]
fn one_byte_rx_buffers_cost_bounded_work() {
    rx_bait(RxBait::TinyBuffers, "rx_too_fragmented");
}

// ---------------------------------------------------------------------------------------
// Item 2: a guest that never takes its interrupts

/// B floods broadcasts while port 0's guest never reads its queue and never takes
/// its interrupts (its call eventfd is full, so every signal finds it so): C gets
/// B's frames about as fast as without that guest on the switch.
#[test]
fn a_guest_that_never_reads_costs_the_others_nothing() {
    let _one = serial();
    let mut d = Daemon::start(&DaemonSpec::ports(3)).expect("start gsonet");
    let (mut fb, mut fc) = honest_pair(&d, 1, 2);
    let flood = |d: &Daemon, fb: &mut TestFrontend, fc: &mut TestFrontend, round: u32| {
        let start = Instant::now();
        for k in 0..40u32 {
            let mut sent = Vec::new();
            for j in 0..32u32 {
                let flow = Flow::new(b_mac(), frames::BROADCAST, Ips::v4()).ports(5300, 9);
                let (h, f) = frames::udp(
                    &flow,
                    &frames::payload(1000, round * 10_000 + k * 32 + j),
                    UdpGso::None,
                );
                fb.send(&h, &f, TxLayout::Single).unwrap();
                sent.push(f);
            }
            for f in sent {
                recv_where(fc, T, |x| x.frame == f)
                    .unwrap_or_else(|| panic!("B's broadcast at C\n{:#}", d.stats().unwrap()));
            }
            let _ = fb.reclaim_tx();
        }
        start.elapsed()
    };
    let alone = flood(&d, &mut fb, &mut fc, 0);

    let mut a = TestFrontend::connect(&d.sockets[0], opts(HONEST, 256)).expect("attacker");
    a.post_rx(256, 2048).unwrap();
    a.fill_call(RX_QUEUE).unwrap();
    a.fill_call(TX_QUEUE).unwrap();
    hello(&mut a, attacker_mac());
    recv_where(&mut fb, T, |f| f.frame[6..12] == attacker_mac()).expect("attacker's hello at B");
    let with = flood(&d, &mut fb, &mut fc, 1);
    let s = d.stats().unwrap();
    // 1,280 broadcasts each way; the attacker's 256 buffers fill, the rest is counted.
    assert!(
        drop_count(&s["ports"][0]["stats"], "rx_queue_full")
            + drop_count(&s["ports"][0]["stats"], "rx_queue_stalled")
            > 0,
        "{s:#}"
    );
    // Nothing of B's waited for A: B's queue was never held, and C got every frame
    // (each within T) while A's were dropped. The times are printed; the bound below
    // is only the one a guest that made the switch wait for it would break (1,280
    // frames held for it would add minutes, not seconds).
    eprintln!("1,280 broadcasts: {alone:?} without a guest that never reads, {with:?} with");
    assert_eq!(port_counter(&s, 1, "tx_holds"), 0, "B was held\n{s:#}");
    assert!(
        with < alone * 5 + Duration::from_secs(20),
        "1,280 broadcasts took {with:?} with a guest that never reads, {alone:?} without\n{s:#}"
    );
    drop(a);
    port_serves_again(&mut d, 0, &mut fb);
}

// ---------------------------------------------------------------------------------------
// Item 6: a software-segmented frame for a guest whose queue fills mid-frame

/// A TSO frame from the tap for a guest without GUEST_TSO (gsonet segments it) whose
/// queue holds 5 of its 14 segments: the rest wait for its next buffers and arrive,
/// every segment exactly once.
#[test]
fn a_segmented_frame_for_a_full_queue_arrives_exactly_once() {
    require_tun!();
    let _one = serial();
    let d = Daemon::start(&DaemonSpec::ports(2).with_tap("")).expect("start gsonet");
    let host = PacketSock::bind(d.tap.as_ref().unwrap(), true).expect("AF_PACKET on the tap");
    let (mac_b, mac_d) = (frames::mac(0x3b), frames::mac(0x3d));
    // D takes TSO, so the tap hands gsonet whole TSO frames; B does not.
    let mut fd = TestFrontend::connect(&d.sockets[1], opts(HONEST, 256)).expect("D");
    fd.post_rx(256, 2048).unwrap();
    let mut o = opts(NO_GUEST_GSO, 256);
    o.auto_repost = false;
    let mut fbk = TestFrontend::connect(&d.sockets[0], o).expect("B");
    for (fe, mac) in [(&mut fd, mac_d), (&mut fbk, mac_b)] {
        let (h, f) = frames::udp(
            &Flow::new(mac, frames::BROADCAST, Ips::v4()).ports(68, 67),
            b"hi",
            UdpGso::None,
        );
        fe.send(&h, &f, TxLayout::Single).unwrap();
        host.collect(T, |s| s.frame == f, |v| !v.is_empty())
            .unwrap();
    }
    let mut segs = BTreeMap::new();
    let mut dups = Vec::new();
    fbk.post_rx(5, 2048).unwrap();
    let flow = Flow::new(frames::mac(0x99), mac_b, Ips::v4()).ports(6500, 6501);
    let data = frames::payload(20000, 11);
    let seq0 = 1000;
    let (h, f) = frames::tcp(&flow, seq0, &data, Some(MSS4));
    assert_eq!(h.gso.kind, GsoKind::TcpV4);
    host.send(&h, &f).unwrap();
    // Counted, not timed: wait until its 5 buffers are used (or T); it has no more.
    let start = Instant::now();
    while segs.len() < 5 && start.elapsed() < T {
        take_segments(&mut fbk, Duration::from_millis(10), &mut segs, &mut dups);
    }
    let first = segs.len();
    // More buffers, well within the 200 ms a held frame waits.
    fbk.post_rx(64, 2048).unwrap();
    take_segments(&mut fbk, Duration::from_millis(500), &mut segs, &mut dups);
    let s = d.stats().unwrap();
    assert!(
        dups.is_empty(),
        "segments arrived twice (seq {dups:?})\n{s:#}"
    );
    assert_eq!(first, 5, "the first buffers took {first} segments\n{s:#}");
    assert_eq!(segs.len(), data.len().div_ceil(MSS4 as usize), "{s:#}");
    let v: Vec<_> = segs.into_values().collect();
    assert!(
        frames::reassemble_tcp(&v, seq0).unwrap() == data,
        "payload differs"
    );
}

/// The TCP segments of flow 6500 -> 6501 that arrive until `idle` passes without
/// one, by sequence number; a sequence number seen before goes to `dups`.
fn take_segments(
    fe: &mut TestFrontend,
    idle: Duration,
    segs: &mut BTreeMap<u32, frames::TcpSeg>,
    dups: &mut Vec<u32>,
) {
    while let Some(x) = recv_where(fe, idle, |x| l4_ports(&x.frame) == Some((6500, 6501))) {
        assert_eq!(x.hdr.gso.kind, GsoKind::None, "{:?}", x.hdr);
        assert_eq!(x.hdr.flags & F_NEEDS_CSUM, 0, "{:?}", x.hdr);
        let s = frames::parse_tcp(&x.frame).expect("etherparse, checksums");
        if segs.insert(s.seq, s.clone()).is_some() {
            dups.push(s.seq);
        }
    }
}

// ---------------------------------------------------------------------------------------
// Item 10: a jumped avail index

/// The attacker publishes a TX avail index 5,000 ahead and keeps kicking: the daemon
/// does not spin (well under one core over 2 s), counts `tx_ring_broken`, forwards
/// between B and C meanwhile, and serves a new frontend once the attacker leaves.
#[test]
fn a_jumped_tx_avail_index_is_counted_and_never_spun_on() {
    let _one = serial();
    let mut d = Daemon::start(&DaemonSpec::ports(3)).expect("start gsonet");
    let (mut fb, mut fc) = honest_pair(&d, 1, 2);
    let mut a = TestFrontend::connect(&d.sockets[0], opts(HONEST, 256)).expect("attacker");
    a.post_rx(64, 2048).unwrap();
    a.jump_avail(TX_QUEUE, 5000).unwrap();
    std::thread::sleep(Duration::from_millis(200));

    let cpu0 = cpu_time(d.pid()).unwrap();
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(2) {
        a.kick(TX_QUEUE).unwrap();
        std::thread::sleep(Duration::from_millis(100));
    }
    let cpu = cpu_time(d.pid()).unwrap() - cpu0;
    let wall = t0.elapsed();
    let s = d.stats().unwrap();
    eprintln!("daemon CPU with a jumped avail index: {cpu:?} in {wall:?}");
    // A spinning worker takes a core (less on a loaded machine, still far above this).
    assert!(
        cpu.as_secs_f64() < 0.2 * wall.as_secs_f64(),
        "the daemon used {cpu:?} of CPU in {wall:?}\n{s:#}"
    );
    assert!(
        drop_count(&s["ports"][0]["stats"], "tx_ring_broken") >= 1,
        "{s:#}"
    );
    forward_unicast(&d, &mut fb, &mut fc, 200, Duration::from_secs(5));
    broadcast_reaches(&d, &mut fb, &mut fc, 3, T);

    drop(a);
    port_serves_again(&mut d, 0, &mut fb);
}

// ---------------------------------------------------------------------------------------
// Item 11: cost amplification and log floods

/// Frames/s C receives from B over `secs`.
fn honest_rate(d: &Daemon, fb: &mut TestFrontend, fc: &mut TestFrontend, secs: f64) -> f64 {
    let start = Instant::now();
    let mut n = 0;
    while start.elapsed().as_secs_f64() < secs {
        forward_unicast(d, fb, fc, 64, Duration::from_secs(10));
        n += 64;
    }
    n as f64 / start.elapsed().as_secs_f64()
}

/// What one software-segmentation attack left the attacker, beside the honest pair.
struct SegmentAttack {
    /// Frames/s B -> C without the attack and under it.
    alone: f64,
    under: f64,
    /// gsonet's CPU (cores) in the windows without the attack and under it.
    cpu_alone: f64,
    cpu_under: f64,
    /// Attack segments the victim read, and the seconds of attack windows.
    read: u64,
    secs: f64,
    /// Attack frames sent, dropped for the sender's segment budget, and held for
    /// the victim's full queue (`tx_held`).
    sent: u64,
    over_budget: u64,
    held: u64,
}

/// The attacker (port 0) sends 64 KB TSO frames with `gso_size` to a victim that
/// did not ack GUEST_TSO (port 3), so gsonet segments them in software; one every
/// `pause` (none: as fast as it can). The victim reads and gives its buffers back
/// as fast as it can, so gsonet segments all its ring takes while the budget lets
/// frames through. B -> C's rate is taken in alternating windows of the same run
/// (attacker paused, then sending), so that a machine busy with something else slows
/// both alike. B -> C must keep `floor` of its rate, the daemon and the attacker's
/// port must survive.
fn segment_attack(gso_size: u16, pause: Option<Duration>, floor: f64) -> SegmentAttack {
    let mut d = Daemon::start(&DaemonSpec::ports(4)).expect("start gsonet");
    let (mut fb, mut fc) = honest_pair(&d, 1, 2);
    let mut victim = TestFrontend::connect(&d.sockets[3], opts(NO_GUEST_GSO, 256)).expect("victim");
    victim.post_rx(256, 2048).unwrap();
    let victim_mac = frames::mac(0xd0);
    hello(&mut victim, victim_mac);
    let mut a = TestFrontend::connect(&d.sockets[0], opts(HONEST, 256)).expect("attacker");
    assert!(a.has(feat::HOST_TSO4));
    a.post_rx(64, 2048).unwrap();
    hello(&mut a, attacker_mac());
    recv_where(&mut fb, T, |f| f.frame[6..12] == attacker_mac()).expect("attacker's hello at B");

    let stop = Arc::new(AtomicBool::new(false));
    let attacking = Arc::new(AtomicBool::new(false));
    let read = Arc::new(AtomicU64::new(0));
    let reader = {
        let (stop, read) = (stop.clone(), read.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                // Each read gives the buffer back at once (auto_repost).
                if let Ok(Some(f)) = victim.try_recv(Duration::from_millis(10)) {
                    if l4_ports(&f.frame) == Some((6600, 6601)) {
                        read.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
            victim
        })
    };
    let attacker = {
        let (stop, attacking) = (stop.clone(), attacking.clone());
        std::thread::spawn(move || {
            let flow = Flow::new(attacker_mac(), victim_mac, Ips::v4()).ports(6600, 6601);
            let data = frames::payload(64000, 3);
            let (h, f) = frames::tcp(&flow, 1, &data, Some(gso_size));
            let mut sent = 0u64;
            while !stop.load(Ordering::Relaxed) {
                if !attacking.load(Ordering::Relaxed) {
                    std::thread::sleep(Duration::from_millis(1));
                    continue;
                }
                let _ = a.reclaim_tx();
                if a.send(&h, &f, TxLayout::HeaderThenChunks(4096)).is_ok() {
                    sent += 1;
                } else {
                    // The TX ring is full: gsonet has not taken the last ones yet.
                    std::thread::yield_now();
                }
                if let Some(p) = pause {
                    std::thread::sleep(p);
                }
            }
            (a, sent)
        })
    };
    // Per window kind (alone, under attack): frames/s B -> C (mean of the windows),
    // wall time, gsonet's CPU time, attack segments the victim read.
    let mut w = [(0.0, Duration::ZERO, Duration::ZERO, 0); 2];
    for _ in 0..4 {
        for (k, on) in [false, true].into_iter().enumerate() {
            attacking.store(on, Ordering::Relaxed);
            let t0 = Instant::now();
            let (cpu0, read0) = (cpu_time(d.pid()).unwrap(), read.load(Ordering::Relaxed));
            std::thread::sleep(Duration::from_millis(50));
            w[k].0 += honest_rate(&d, &mut fb, &mut fc, 0.5) / 4.0;
            w[k].1 += t0.elapsed();
            w[k].2 += cpu_time(d.pid()).unwrap() - cpu0;
            w[k].3 += read.load(Ordering::Relaxed) - read0;
        }
    }
    stop.store(true, Ordering::Relaxed);
    let (a, sent) = attacker.join().unwrap();
    let victim = reader.join().unwrap();
    let s = d.stats().unwrap();
    let cores = |k: usize| w[k].2.as_secs_f64() / w[k].1.as_secs_f64();
    let r = SegmentAttack {
        alone: w[0].0,
        under: w[1].0,
        cpu_alone: cores(0),
        cpu_under: cores(1),
        read: w[1].3,
        secs: w[1].1.as_secs_f64(),
        sent,
        over_budget: drop_count(&s["ports"][0]["stats"], "segment_budget"),
        held: port_counter(&s, 0, "tx_held"),
    };
    let budget = SEGMENTS_PER_SEC as f64 * r.secs + SEGMENTS_BURST as f64;
    eprintln!(
        "gso_size {gso_size}: B -> C {:.0} frames/s alone, {:.0} under attack; gsonet \
         CPU {:.2} cores alone, {:.2} under attack; the victim read {} attack segments \
         in {:.2} s ({:.0}/s; the budget allows {budget:.0} in that time); {} attack \
         frames, segment_budget {}, victim rx_queue_full {}",
        r.alone,
        r.under,
        r.cpu_alone,
        r.cpu_under,
        r.read,
        r.secs,
        r.read as f64 / r.secs,
        r.sent,
        r.over_budget,
        drop_count(&s["ports"][3]["stats"], "rx_queue_full"),
    );
    assert!(
        r.read > 0,
        "the victim read no attack segment: nothing was segmented for it\n{s:#}"
    );
    // Whatever the attacker sends, the victim is made to read no more than the
    // budget lets through.
    assert!(
        r.read as f64 <= budget,
        "the victim read {} attack segments, over the budget's {budget:.0}\n{s:#}",
        r.read
    );
    assert!(
        r.under >= floor * r.alone,
        "B -> C fell from {:.0} to {:.0} frames/s under the gso_size {gso_size} attack\n{s:#}",
        r.alone,
        r.under
    );
    drop(a);
    drop(victim);
    port_serves_again(&mut d, 0, &mut fb);
    r
}

/// gso_size 1 (about 64,000 segments a frame), 200 frames a second: 12.8 million
/// segments asked for a second, three times the budget. A frame's segments stop at
/// the victim's full ring and the rest of it waits in the attacker's TX worker
/// (`tx_held`), going on as the victim gives its buffers back; frames behind it wait
/// too, or are dropped at the hold bounds, uncut. So the victim's reads pace the
/// attack, and the budget counts the frames that would go past it
/// (`segment_budget`) when the victim reads faster than the budget.
#[test]
fn gso_size_1_costs_the_sender_not_the_others() {
    let _one = serial();
    let r = segment_attack(1, Some(Duration::from_millis(5)), 0.5);
    assert!(
        r.over_budget > 0 || r.held > 0,
        "neither held for the full victim nor counted over the budget"
    );
}

/// Frames that fill the victim's ring exactly (250-byte segments: 256 a frame), as
/// fast as the attacker can send them (15-51 thousand frames a second here, 3.8-13
/// million segments asked for): the budget, not the ring, bounds the frames let
/// through, and each is segmented as far as the victim's ring takes it. On a loaded
/// 2-core machine B -> C kept 0.51-0.96 of its rate in five runs (the attacker's
/// worker takes its share of the CPU); the floor is a quarter, so that only a much
/// larger loss fails.
#[test]
fn ring_sized_segments_as_fast_as_they_go_cost_the_sender_not_the_others() {
    let _one = serial();
    segment_attack(250, None, 0.25);
}

/// Lines of `log` at the daemon's default level (info) or above.
fn loud_lines(log: &str) -> usize {
    log.lines()
        .filter(|l| !l.contains("DEBUG") && !l.contains("TRACE"))
        .count()
}

/// The attacker acks its features 200 times in a row (each SET_FEATURES is a device
/// reset to gsonet) and sends 3,000 malformed chains: the resets are held to the
/// port's budget (40 at once, then 20 a second), at the default level (info) the log
/// grows by far fewer lines than there were resets, and the others keep forwarding.
#[test]
fn resets_and_bad_chains_in_a_loop_do_not_flood_the_log() {
    let _one = serial();
    let mut d = Daemon::start(&DaemonSpec::ports(3)).expect("start gsonet");
    let (mut fb, mut fc) = honest_pair(&d, 1, 2);
    let mut a = TestFrontend::connect(&d.sockets[0], opts(HONEST, 256)).expect("attacker");
    let acked = a.acked_features();
    let lines0 = loud_lines(&d.log_text());
    let start = std::time::Instant::now();
    for i in 0..200 {
        a.vhost().set_features(acked).expect("SET_FEATURES");
        if i % 50 == 0 {
            forward_unicast(&d, &mut fb, &mut fc, 32, Duration::from_secs(5));
        }
    }
    // The connection's first reset and 39 more came from the burst; the other 160
    // waited for 20 a second (less a margin for the clock).
    let took = start.elapsed();
    assert!(
        took >= Duration::from_millis(7_500),
        "200 resets in {took:?}: not held to the budget"
    );
    for bad in common::frontend::BadTx::ALL.iter().cycle().take(3000) {
        let _ = a.send_bad(*bad);
        let _ = a.reclaim_tx();
    }
    std::thread::sleep(Duration::from_millis(300));
    let log = d.log_text();
    let grew = loud_lines(&log) - lines0;
    assert!(
        grew < 100,
        "the log grew by {grew} lines; last ones:\n{}",
        log.lines()
            .filter(|l| loud_lines(l) == 1)
            .rev()
            .take(20)
            .collect::<Vec<_>>()
            .join("\n")
    );
    forward_unicast(&d, &mut fb, &mut fc, 200, Duration::from_secs(5));
    drop(a);
    port_serves_again(&mut d, 0, &mut fb);
}

/// A frontend that acks VIRTIO_F_IN_ORDER on split rings (`in_order=on`) but lays
/// its chains out wherever its free list has room, not in table order as the spec
/// asks of an in-order driver, with every kind of malformed chain between good
/// frames, some of them behind indirect tables: gsonet hands every chain back in the
/// order it was made available, the dropped ones in their place, and C still gets
/// B's frames.
#[test]
fn in_order_split_chains_come_back_in_the_order_they_were_made_available() {
    let _s = serial();
    let mut d = Daemon::start(&DaemonSpec {
        ports: vec!["in_order=on".into(), String::new(), String::new()],
        tap: None,
    })
    .expect("daemon");
    let (mut fb, mut fc) = honest_pair(&d, 1, 2);
    let mut a = TestFrontend::connect(
        &d.sockets[0],
        FrontendOpts {
            require_features: true,
            ..opts(HONEST | feat::IN_ORDER, 64)
        },
    )
    .expect("A");
    assert_ne!(a.acked_features() & feat::IN_ORDER, 0);
    let layouts = [
        TxLayout::Single,
        TxLayout::HeaderThenChunks(100),
        TxLayout::indirect(TxLayout::Chunks(64)),
    ];
    let mut made = Vec::new();
    for round in 0..6usize {
        for (i, bad) in common::frontend::BadTx::ALL.iter().enumerate() {
            made.push(a.send_bad(*bad).expect("bad chain"));
            let (h, f) = frames::udp(
                &Flow::new(attacker_mac(), frames::BROADCAST, Ips::v4()).ports(7, 9),
                &frames::payload(300, (round * 100 + i) as u32),
                UdpGso::None,
            );
            let layout = layouts[(round + i) % layouts.len()].clone();
            made.push(a.send(&h, &f, layout).expect("good frame"));
        }
    }
    a.wait_tx_done(T).expect("every chain handed back");
    let back: Vec<u16> = a.tx_completions().iter().map(|&(id, _)| id).collect();
    assert_eq!(back, made, "handed back out of order");
    assert!(d.alive(), "{}", d.log_text());
    forward_unicast(&d, &mut fb, &mut fc, 32, T);
}

//! End to end between guests: a real `gsonet serve` process with several vhost-user
//! ports and no uplink, one test frontend per port over the real sockets.
//!
//! Port A acks every GUEST_* offload; port B acks the HOST_* ones (it may send GSO)
//! but no GUEST_CSUM, so nothing may reach it with a GSO type or a partial checksum:
//! gsonet must segment for it in software, with full checksums. Everything that
//! arrives is checked with etherparse. No root needed.

mod common;

use std::time::{Duration, Instant};

use common::daemon::{drop_count, port_counter, Daemon, DaemonSpec};
use common::frames::{self, Flow, Ips, UdpGso, MSS4, MSS6};
use common::frontend::{self, feat, FrontendOpts, RxFrame, TestFrontend, TxLayout};
use common::rx::{recv_all_where, recv_where};
use gsonet::vnet_hdr::GsoKind;

const T: Duration = Duration::from_secs(5);
const QUIET: Duration = Duration::from_millis(300);

/// Takes everything large.
const FEATS_A: u64 = feat::RINGS | feat::HOST_ALL | feat::GUEST_CSUM | feat::GUEST_GSO;
/// Sends large, takes only wire-size frames with full checksums.
const FEATS_B: u64 = feat::RINGS | feat::HOST_ALL;

fn a_mac() -> frames::Mac {
    frames::mac(0xa)
}
fn b_mac() -> frames::Mac {
    frames::mac(0xb)
}

fn connect(d: &Daemon, port: usize, features: u64) -> TestFrontend {
    connect_with(d, port, features, 256, 2048)
}

/// A guest B (FEATS_B) on `port` with only `bufs` RX buffers of `size` bytes: a
/// queue that fills.
fn connect_short(d: &Daemon, port: usize, bufs: usize, size: u32) -> TestFrontend {
    connect_with(d, port, FEATS_B, bufs, size)
}

/// A guest on `port` acking `features`, with `bufs` RX buffers of `size` bytes.
fn connect_with(d: &Daemon, port: usize, features: u64, bufs: usize, size: u32) -> TestFrontend {
    let opts = FrontendOpts {
        features,
        require_features: true,
        mem_size: 128 << 20,
        ..Default::default()
    };
    let mut fe = TestFrontend::connect(&d.sockets[port], opts).expect("frontend");
    fe.post_rx(bufs, size).expect("post rx");
    fe
}

/// A (port 0) and a B with `bufs` RX buffers of `size` bytes (port 1, `connect_short`)
/// on a new two-port gsonet, B's address learnt.
fn a_and_short_b(bufs: usize, size: u32) -> (Daemon, TestFrontend, TestFrontend) {
    let d = Daemon::start(&DaemonSpec::ports(2)).expect("start gsonet");
    let mut a = connect(&d, 0, FEATS_A);
    let mut b = connect_short(&d, 1, bufs, size);
    let hb = hello(&mut b, b_mac());
    recv_where(&mut a, T, |f| f.frame == hb).expect("B's hello at A");
    (d, a, b)
}

/// A small frame from `mac` to everyone, so the switch learns where `mac` is.
fn hello(fe: &mut TestFrontend, mac: frames::Mac) -> Vec<u8> {
    let flow = Flow::new(mac, frames::BROADCAST, Ips::v4()).ports(68, 67);
    let (h, f) = frames::udp(&flow, &mac, UdpGso::None);
    fe.send(&h, &f, TxLayout::Single).unwrap();
    f
}

fn is_hello(f: &RxFrame) -> bool {
    f.frame.starts_with(&frames::BROADCAST)
}

/// Daemon with A (port 0) and B (port 1), both announced and their hellos consumed.
fn two() -> (Daemon, TestFrontend, TestFrontend) {
    two_with(&DaemonSpec::ports(2))
}

/// `two` with the ports' options of `spec`.
fn two_with(spec: &DaemonSpec) -> (Daemon, TestFrontend, TestFrontend) {
    let d = Daemon::start(spec).expect("start gsonet");
    let mut a = connect(&d, 0, FEATS_A);
    let mut b = connect(&d, 1, FEATS_B);
    let ha = hello(&mut a, a_mac());
    if recv_where(&mut b, T, |f| f.frame == ha).is_none() {
        panic!("A's hello did not reach B\n{:#}", d.stats().unwrap());
    }
    let hb = hello(&mut b, b_mac());
    recv_where(&mut a, T, |f| f.frame == hb).expect("B's hello at A");
    (d, a, b)
}

#[test]
fn learning_flooding_and_broadcast() {
    let d = Daemon::start(&DaemonSpec::ports(3)).expect("start gsonet");
    let mut a = connect(&d, 0, FEATS_A);
    let mut b = connect(&d, 1, FEATS_B);
    let mut c = connect(&d, 2, FEATS_B);
    let flow = |src, dst, sport| Flow::new(src, dst, Ips::v4()).ports(sport, 9);

    // B's address is unknown yet: A's frame to it is flooded to B and C, not to A.
    let (h, f1) = frames::udp(&flow(a_mac(), b_mac(), 1), b"one", UdpGso::None);
    a.send(&h, &f1, TxLayout::HeaderSeparate).unwrap();
    assert_eq!(
        recv_where(&mut b, T, |_| true).expect("flood at B").frame,
        f1
    );
    assert_eq!(
        recv_where(&mut c, T, |_| true).expect("flood at C").frame,
        f1
    );

    // B answers A (known since A sent): only A gets it.
    let (h, f2) = frames::udp(&flow(b_mac(), a_mac(), 2), b"two", UdpGso::None);
    b.send(&h, &f2, TxLayout::Single).unwrap();
    assert_eq!(
        recv_where(&mut a, T, |_| true).expect("unicast at A").frame,
        f2
    );

    // Now B is known: A to B reaches B only.
    let (h, f3) = frames::udp(&flow(a_mac(), b_mac(), 3), b"three", UdpGso::None);
    a.send(&h, &f3, TxLayout::Single).unwrap();
    assert_eq!(
        recv_where(&mut b, T, |_| true).expect("unicast at B").frame,
        f3
    );

    // Broadcast from A reaches B and C and never comes back to A.
    let (h, f4) = frames::udp(&flow(a_mac(), frames::BROADCAST, 4), b"four", UdpGso::None);
    a.send(&h, &f4, TxLayout::Single).unwrap();
    assert_eq!(
        recv_where(&mut b, T, |_| true).expect("bcast at B").frame,
        f4
    );
    assert_eq!(
        recv_where(&mut c, T, |_| true).expect("bcast at C").frame,
        f4
    );

    // Nothing else anywhere: no echo to A, no unicast leaked to C.
    assert!(a.recv(QUIET).is_none(), "a frame came back to A");
    assert!(c.recv(QUIET).is_none(), "C got a frame for A or B");
    assert!(b.recv(QUIET).is_none(), "B got an extra frame");
}

/// A guest whose queue stayed full long enough to count as stalled, and that then
/// adds buffers without a kick (it looked at gsonet's wish for one before gsonet made
/// it), gets frames again: its ring is still looked at, one load a frame, not given
/// up until a kick that may never come.
#[test]
fn a_stalled_guest_that_refills_without_a_kick_gets_frames_again() {
    let (d, mut a, mut b) = a_and_short_b(1, 2048);
    let udp = |sport: u16| {
        let flow = Flow::new(a_mac(), b_mac(), Ips::v4()).ports(sport, 9);
        frames::udp(&flow, b"to b", UdpGso::None)
    };
    // The first frame takes B's one buffer; the next ones find its queue full until
    // it counts as stalled (RX_STALL, 200 ms).
    let (h, first) = udp(1000);
    a.send(&h, &first, TxLayout::Single).unwrap();
    let mut sport = 1001;
    let deadline = Instant::now() + Duration::from_secs(10);
    let stalled = || drop_count(&d.stats().unwrap()["ports"][1]["stats"], "rx_queue_stalled");
    while stalled() == 0 {
        assert!(
            Instant::now() < deadline,
            "B never counted as stalled\n{:#}",
            d.stats().unwrap()
        );
        let (h, f) = udp(sport);
        a.send(&h, &f, TxLayout::Single).unwrap();
        sport += 1;
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(
        recv_where(&mut b, T, |_| true)
            .expect("the first frame")
            .frame,
        first
    );
    b.post_rx_unkicked(4, 2048).unwrap();
    let later: Vec<Vec<u8>> = (0..4)
        .map(|i| {
            let (h, f) = udp(5000 + i);
            a.send(&h, &f, TxLayout::Single).unwrap();
            f
        })
        .collect();
    for f in &later {
        let got = recv_where(&mut b, T, |_| true)
            .unwrap_or_else(|| panic!("B got nothing after it refilled\n{:#}", d.stats().unwrap()));
        assert_eq!(&got.frame, f);
    }
}

/// Frames for a guest whose RX queue is full wait in their sender's TX worker
/// (`tx_held`) instead of being dropped (`rx_queue_full`), and arrive in order as
/// the guest reads and gives its buffers back, four at a time here.
#[test]
fn frames_for_a_full_guest_are_held_and_arrive_in_order_as_it_reads() {
    let (d, mut a, mut b) = a_and_short_b(4, 2048);
    let sent: Vec<_> = (0..48u16)
        .map(|i| {
            let flow = Flow::new(a_mac(), b_mac(), Ips::v4()).ports(2000 + i, 9);
            frames::udp(&flow, &i.to_be_bytes(), UdpGso::None)
        })
        .collect();
    // One batch: its first four frames fill B's queue, the rest find it full.
    a.send_batch(&sent, TxLayout::Single).unwrap();
    let mut got = Vec::new();
    while got.len() < sent.len() {
        let f = recv_where(&mut b, T, |_| true).unwrap_or_else(|| {
            panic!(
                "B got {} of {} frames\n{:#}",
                got.len(),
                sent.len(),
                d.stats().unwrap()
            )
        });
        got.push(f.frame);
        if got.len() % 4 == 0 {
            b.post_rx(4, 2048).unwrap();
        }
    }
    let want: Vec<_> = sent.iter().map(|(_, f)| f.clone()).collect();
    assert!(got == want, "B got the frames out of order");
    let s = d.stats().unwrap();
    assert_eq!(
        drop_count(&s["ports"][1]["stats"], "rx_queue_full"),
        0,
        "{s:#}"
    );
    assert!(port_counter(&s, 0, "tx_held") >= 40, "{s:#}");
}

/// A guest that never reads costs the other guests of its sender nothing: frames for
/// it are held only while it might read (`RX_STALL`) and then dropped and counted,
/// and the sender's frames for another guest, in the same batches, all arrive.
#[test]
fn a_full_guest_that_never_reads_does_not_hold_up_its_senders_other_frames() {
    let d = Daemon::start(&DaemonSpec::ports(3)).expect("start gsonet");
    let mut a = connect(&d, 0, FEATS_A);
    let mut b = connect_short(&d, 1, 2, 2048);
    let mut c = connect(&d, 2, FEATS_B);
    let c_mac = frames::mac(0xc);
    for (fe, mac) in [(&mut b, b_mac()), (&mut c, c_mac)] {
        let h = hello(fe, mac);
        recv_where(&mut a, T, |f| f.frame == h).expect("hello at A");
    }
    let frame = |to: frames::Mac, i: u16| {
        let flow = Flow::new(a_mac(), to, Ips::v4()).ports(3000 + i, 9);
        frames::udp(&flow, &i.to_be_bytes(), UdpGso::None)
    };
    // Batches of frames for B and C in turn, for longer than B may keep its queue
    // full; C reads all the while, B never.
    let mut for_c = Vec::new();
    let start = Instant::now();
    let mut i = 0u16;
    while start.elapsed() < Duration::from_millis(600) {
        let batch: Vec<_> = (0..16)
            .map(|k| frame(if k % 2 == 0 { b_mac() } else { c_mac }, i + k))
            .collect();
        i += 16;
        for_c.extend(batch.iter().skip(1).step_by(2).map(|(_, f)| f.clone()));
        a.send_batch(&batch, TxLayout::Single).unwrap();
        a.wait_tx_done(T).expect("A's batch taken");
        std::thread::sleep(Duration::from_millis(20));
    }
    let got: Vec<_> = recv_all_where(&mut c, QUIET, |f| !is_hello(f))
        .into_iter()
        .map(|f| f.frame)
        .collect();
    assert!(
        got == for_c,
        "C got {} of {} frames, or out of order",
        got.len(),
        for_c.len()
    );
    // B's two buffers took C's hello and A's first frame for B; every other one was
    // dropped, counted, once it had waited its time or B counted as stalled.
    let s = d.stats().unwrap();
    let b_stats = &s["ports"][1]["stats"];
    let lost = drop_count(b_stats, "rx_queue_full") + drop_count(b_stats, "rx_queue_stalled");
    assert_eq!(lost, u64::from(i) / 2 - 1, "{s:#}");
}

/// An RX queue whose buffers are too few for a frame (MRG_RXBUF) asks its guest to
/// kick once it adds more. With EVENT_IDX the wish goes past the buffers the guest
/// has: a wish at the first buffer not taken is behind them, and the guest would
/// never kick again.
#[test]
fn a_queue_too_short_for_a_frame_asks_for_a_kick_past_its_buffers() {
    let d = Daemon::start(&DaemonSpec::ports(2)).expect("start gsonet");
    let mut a = connect(&d, 0, FEATS_A);
    let opts = FrontendOpts {
        features: FEATS_B,
        require_features: true,
        mem_size: 128 << 20,
        ..Default::default()
    };
    let mut b = TestFrontend::connect(&d.sockets[1], opts).expect("frontend B");
    assert!(b.has(feat::MRG_RXBUF) && b.has(feat::EVENT_IDX));
    b.post_rx(4, 1024).unwrap();
    let hb = hello(&mut b, b_mac());
    recv_where(&mut a, T, |f| f.frame == hb).expect("B's hello at A");
    // 6000 bytes: six of B's 1024-byte buffers, where it has four.
    let flow = Flow::new(a_mac(), b_mac(), Ips::v4()).ports(4000, 9);
    let (h, big) = frames::udp(&flow, &[7u8; 5958], UdpGso::None);
    assert_eq!(big.len(), 6000);
    a.send(&h, &big, TxLayout::Single).unwrap();
    let deadline = Instant::now() + T;
    while d.port_counter(0, "tx_held").unwrap() == 0 {
        assert!(
            Instant::now() < deadline,
            "the frame never found B's queue short"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let kicks = b.stats(frontend::RX_QUEUE).kicks;
    b.post_rx(4, 1024).unwrap();
    assert_eq!(
        b.stats(frontend::RX_QUEUE).kicks,
        kicks + 1,
        "B's next buffers did not kick"
    );
    let got = recv_where(&mut b, T, |_| true).expect("the frame at B");
    assert!(got.frame == big && got.buffers == 6);
}

/// Every kick wakes a TX worker and is counted, and every frame delivered to a guest
/// that asked for interrupts is announced with a call: the figures `make bench` divides
/// by the bytes moved.
#[test]
fn kicks_and_calls_are_counted() {
    let (d, _a, _b) = two();
    let s = d.stats().unwrap();
    for port in [0, 1] {
        assert!(port_counter(&s, port, "tx_kicks") >= 1, "{s:#}");
        assert!(port_counter(&s, port, "tx_calls") >= 1, "{s:#}");
        assert!(port_counter(&s, port, "rx_calls") >= 1, "{s:#}");
    }
}

/// Each device start owes the guest one call per queue, whatever its used_event says:
/// an earlier gsonet (or connection) may have published used entries and gone before
/// calling, and a driver with EVENT_IDX then waits for that call forever. Here the
/// guest's used_event asks for no call at all (nothing is published), and the call
/// still comes once the queues run.
#[test]
fn a_device_start_owes_the_guest_a_call_on_each_queue() {
    let d = Daemon::start(&DaemonSpec::ports(1)).expect("start gsonet");
    let mut a = connect(&d, 0, FEATS_A);
    let end = std::time::Instant::now() + T;
    while a.calls(0) == 0 || a.calls(1) == 0 {
        assert!(
            std::time::Instant::now() < end,
            "no call after the start: rx {} tx {}\n{:#}",
            a.calls(0),
            a.calls(1),
            d.stats().unwrap()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    // Owed once: a guest that then takes nothing gets no more.
    std::thread::sleep(QUIET);
    assert_eq!((a.calls(0), a.calls(1)), (1, 1));
}

/// With `tx_coalesce_usecs`, the call announcing used TX chains waits that long: none
/// comes sooner and one comes after it; and none at all when the guest reclaimed the
/// chains meanwhile and asks only for later ones, as Linux virtio-net's RX poll does
/// with its TX ring.
#[test]
fn tx_completion_calls_wait_for_tx_coalesce_usecs() {
    const WAIT: Duration = Duration::from_millis(10);
    let mut spec = DaemonSpec::ports(2);
    spec.ports[0] = "tx_coalesce_usecs=10000".into();
    let (d, mut a, mut b) = two_with(&spec);
    let to_b = |a: &mut TestFrontend, i: u8| {
        let flow = Flow::new(a_mac(), b_mac(), Ips::v4()).ports(7000, 7001);
        let (h, f) = frames::udp(&flow, &[i; 64], UdpGso::None);
        a.send(&h, &f, TxLayout::Single).unwrap();
        f
    };
    a.wait_tx_done(T).unwrap();
    std::thread::sleep(QUIET); // the hello's call has gone out

    // Announced, but only once the wait is over.
    let before = a.calls(1);
    a.ask_call(1).unwrap();
    let sent = Instant::now();
    let f = to_b(&mut a, 1);
    recv_where(&mut b, T, |x| x.frame == f).expect("frame at B");
    while a.calls(1) == before {
        assert!(sent.elapsed() < T, "no TX call\n{:#}", d.stats().unwrap());
        std::thread::sleep(Duration::from_millis(1));
    }
    assert!(sent.elapsed() >= WAIT, "called after {:?}", sent.elapsed());
    assert_eq!(a.reclaim_tx().unwrap(), 1);

    // Reclaimed within the wait: no call. A test thread slower than the wait can see
    // the call legitimately, so a few tries are allowed; a backend that always calls
    // fails every one.
    let quiet = (0..5u8).any(|i| {
        let before = a.calls(1);
        a.ask_call(1).unwrap();
        let sent = Instant::now();
        let f = to_b(&mut a, 2 + i);
        recv_where(&mut b, T, |x| x.frame == f).expect("frame at B");
        let mut taken = 0;
        while taken == 0 && sent.elapsed() < T {
            taken = a.reclaim_tx().unwrap();
        }
        a.ask_call(1).unwrap(); // only chains after these
        let in_time = sent.elapsed() < WAIT;
        std::thread::sleep(QUIET);
        in_time && a.calls(1) == before
    });
    assert!(
        quiet,
        "a call for reclaimed chains\n{:#}",
        d.stats().unwrap()
    );

    // Set at runtime, bounded like its config key.
    let o = ctl(&d, &["port:0", "tx_coalesce_usecs=0"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("\"tx_coalesce_usecs\": 0"), "{out}");
    let o = ctl(&d, &["port:0", "tx_coalesce_usecs=10001"]);
    assert!(!o.status.success(), "past the cap accepted");
}

/// With `tx_poll_us`, a sender's kicks stay off while it keeps sending and gsonet
/// looks at its queue by timer: every frame of a burst arrives, in order, the timer
/// did the looking, and a frame sent after the queue went idle (kicks back on) still
/// arrives: no frame is ever left in a ring nobody watches.
#[test]
fn tx_polling_delivers_every_frame_and_hands_back_to_kicks() {
    let mut spec = DaemonSpec::ports(2);
    spec.ports[1] = "tx_poll_us=300".into();
    let d = Daemon::start(&spec).expect("start gsonet");
    let mut a = connect(&d, 0, FEATS_A);
    let mut b = connect(&d, 1, FEATS_B);
    let ha = hello(&mut a, a_mac());
    recv_where(&mut b, T, |f| f.frame == ha).expect("A's hello at B");
    let sent: Vec<Vec<u8>> = (0..200u16)
        .map(|i| {
            let flow = Flow::new(b_mac(), a_mac(), Ips::v4()).ports(7000, 7001);
            let (h, f) = frames::udp(&flow, &i.to_be_bytes().repeat(100), UdpGso::None);
            b.send(&h, &f, TxLayout::Single).unwrap();
            f
        })
        .collect();
    for (i, f) in sent.iter().enumerate() {
        let got = recv_where(&mut a, T, |x| !is_hello(x))
            .unwrap_or_else(|| panic!("frame {i} of the burst missing\n{:#}", d.stats().unwrap()));
        assert!(got.frame == *f, "frame {i} out of order or changed");
    }
    // The poll timer is armed as the drain that delivered the last frame ends: it may
    // fire just after that frame arrives.
    let end = Instant::now() + T;
    while d.port_counter(1, "tx_polls").unwrap() == 0 {
        assert!(Instant::now() < end, "no poll\n{:#}", d.stats().unwrap());
        std::thread::sleep(Duration::from_millis(1));
    }
    // Idle long enough for a poll to find nothing and turn kicks back on.
    std::thread::sleep(Duration::from_millis(50));
    let flow = Flow::new(b_mac(), a_mac(), Ips::v4()).ports(7000, 7001);
    let (h, f) = frames::udp(&flow, b"after the pause", UdpGso::None);
    b.send(&h, &f, TxLayout::Single).unwrap();
    let got = recv_where(&mut a, T, |x| !is_hello(x)).expect("the frame after the pause");
    assert!(got.frame == f);
    assert_eq!(
        port_counter(&d.stats().unwrap(), 0, "tx_polls"),
        0,
        "port 0 does not poll"
    );
}

/// RX interrupt moderation: with `rx_coalesce_usecs` and no frame count, only the
/// port's timer announces frames. Ten frames sent while A is not waiting are all in
/// its ring, and A has been called for them once the timer ran (a timer nobody
/// watches would leave A uncalled). `gsonet ctl` changes the settings at once and
/// refuses values past the cap.
#[test]
fn rx_coalescing_announces_by_timer_and_is_set_at_runtime() {
    let mut spec = DaemonSpec::ports(2);
    spec.ports[0] = "rx_coalesce_usecs=5000".into();
    let d = Daemon::start(&spec).expect("start gsonet");
    let mut a = connect(&d, 0, FEATS_A);
    let mut b = connect(&d, 1, FEATS_B);
    let hb = hello(&mut b, b_mac());
    recv_where(&mut a, T, |f| f.frame == hb).expect("B's hello at A");
    let ha = hello(&mut a, a_mac());
    recv_where(&mut b, T, |f| f.frame == ha).expect("A's hello at B");
    let flow = Flow::new(b_mac(), a_mac(), Ips::v4()).ports(7100, 7101);
    let send = |b: &mut TestFrontend, i: u8| {
        let (h, f) = frames::udp(&flow, &[i; 64], UdpGso::None);
        b.send(&h, &f, TxLayout::Single).unwrap();
        f
    };
    // A waits once with nothing to take, which (EVENT_IDX) asks for a call at the next
    // used entry, as a driver re-enabling its callback does.
    assert!(
        a.recv(Duration::from_millis(20)).is_none(),
        "an unexpected frame at A"
    );
    let calls_before = a.stats(0).calls;
    let sent: Vec<_> = (0..10).map(|i| send(&mut b, i)).collect();
    // Well past the 5 ms the last frame may wait.
    std::thread::sleep(Duration::from_millis(300));
    for (i, f) in sent.iter().enumerate() {
        let got = recv_where(&mut a, T, |x| !is_hello(x))
            .unwrap_or_else(|| panic!("frame {i} missing\n{:#}", d.stats().unwrap()));
        assert!(got.frame == *f, "frame {i} changed or out of order");
    }
    assert!(
        a.stats(0).calls > calls_before,
        "no call for the frames: the coalescing timer never announced them\n{:#}",
        d.stats().unwrap()
    );

    let o = ctl(
        &d,
        &["port:0", "rx_coalesce_usecs=0", "rx_coalesce_frames=8"],
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("\"rx_coalesce_usecs\": 0"), "{out}");
    assert!(out.contains("\"rx_coalesce_frames\": 8"), "{out}");
    let f = send(&mut b, 99);
    assert!(
        recv_where(&mut a, T, |x| !is_hello(x))
            .expect("frame after ctl")
            .frame
            == f
    );
    let o = ctl(&d, &["port:0", "rx_coalesce_usecs=10001"]);
    assert!(!o.status.success(), "past the cap accepted");
}

/// A GSO frame from B reaches A (which takes that GSO type) as one frame, byte for
/// byte, with the header the guest needs.
fn gso_to_capable_peer(
    frame_of: impl Fn(&Flow) -> (gsonet::vnet_hdr::VirtioNetHdr, Vec<u8>),
    ips: Ips,
    kind: GsoKind,
) {
    let (d, mut a, mut b) = two();
    let flow = Flow::new(b_mac(), a_mac(), ips).ports(5000, 5001);
    let (h, f) = frame_of(&flow);
    b.send(&h, &f, TxLayout::HeaderThenChunks(4096)).unwrap();
    let mut got = recv_where(&mut a, T, |x| !is_hello(x)).expect("GSO frame at A");
    assert_eq!(got.hdr.gso.kind, kind, "{:?}", got.hdr);
    assert!(got.hdr.needs_csum(), "GSO frame without NEEDS_CSUM");
    assert_eq!(got.hdr.gso_size, h.gso_size);
    assert_eq!(got.hdr.csum_start as usize, 14 + ips.ip_len());
    let off = if matches!(kind, GsoKind::TcpV4 | GsoKind::TcpV6) {
        16
    } else {
        6
    };
    assert_eq!(got.hdr.csum_offset, off);
    assert_eq!(got.hdr.num_buffers, got.buffers);
    assert!(got.frame == f, "frame bytes changed on the way");
    frames::finish_if_partial(&got.hdr, &mut got.frame).unwrap();
    if off == 16 {
        frames::parse_tcp(&got.frame).expect("etherparse");
    } else if kind == GsoKind::UdpL4 {
        frames::parse_udp(&got.frame).expect("etherparse");
    }
    assert!(a.recv(QUIET).is_none(), "more than one frame at A");
    let s = d.stats().unwrap();
    assert_eq!(port_counter(&s, 0, "gso_passed"), 1, "{s:#}");
    assert_eq!(port_counter(&s, 0, "gso_segmented"), 0, "{s:#}");
    // Straight from B's buffers into A's: one copy.
    assert_eq!(port_counter(&s, 0, "rx_one_copy"), 1, "{s:#}");
}

#[test]
fn tso4_64k_to_gso_peer_arrives_whole() {
    let data = frames::payload(65535 - 20 - 32, 11);
    gso_to_capable_peer(
        |fl| frames::tcp(fl, 1, &data, Some(MSS4)),
        Ips::v4(),
        GsoKind::TcpV4,
    );
}

#[test]
fn tso6_64k_to_gso_peer_arrives_whole() {
    let data = frames::payload(45 * MSS6 as usize + 1, 12);
    gso_to_capable_peer(
        |fl| frames::tcp(fl, 1, &data, Some(MSS6)),
        Ips::v6(),
        GsoKind::TcpV6,
    );
}

#[test]
fn uso4_to_uso_peer_arrives_whole() {
    let data = frames::payload(40 * 1472 + 5, 13);
    gso_to_capable_peer(
        |fl| frames::udp(fl, &data, UdpGso::Uso(1472)),
        Ips::v4(),
        GsoKind::UdpL4,
    );
}

/// A burst of UDP datagrams of one flow from B reaches A, which acked GUEST_USO4, as
/// one USO frame gsonet built: the datagrams' payloads in order, one datagram's size
/// as gso_size, a partial checksum that completes right.
#[test]
fn a_burst_of_udp_datagrams_reaches_a_uso_peer_coalesced() {
    let (d, mut a, mut b) = two();
    let flow = Flow::new(b_mac(), a_mac(), Ips::v4()).ports(5300, 5301);
    let n = 12;
    let sent: Vec<_> = (0..n)
        .map(|i| {
            let data = frames::payload(if i + 1 == n { 300 } else { 1472 }, 30 + i as u32);
            let spec = gsonet::testkit::frames::FrameSpec {
                ip_id: 0x100 + i as u16,
                df: true,
                ..flow.spec(false, &data)
            };
            frames::build_with(&spec, None)
        })
        .collect();
    b.send_batch(&sent, TxLayout::Single).unwrap();
    let mut got = recv_where(&mut a, T, |x| !is_hello(x)).expect("frame at A");
    assert_eq!(got.hdr.gso.kind, GsoKind::UdpL4, "{:?}", got.hdr);
    assert_eq!((got.hdr.gso_size, got.hdr.csum_offset), (1472, 6));
    assert!(got.hdr.needs_csum());
    frames::finish_if_partial(&got.hdr, &mut got.frame).unwrap();
    let u = frames::parse_udp(&got.frame).expect("etherparse, checksums");
    let payloads: Vec<u8> = sent.iter().flat_map(|(_, f)| f[42..].to_vec()).collect();
    assert!(u.payload == payloads, "payload differs");
    assert_eq!(u.ip_id, Some(0x100));
    assert!(a.recv(QUIET).is_none(), "more than one frame at A");
    let s = d.stats().unwrap();
    assert_eq!(port_counter(&s, 0, "gro_frames"), 1, "{s:#}");
    assert_eq!(port_counter(&s, 0, "gro_segments"), n as u64, "{s:#}");
}

#[test]
fn ufo4_to_ufo_peer_arrives_whole() {
    let data = frames::payload(30000, 14);
    gso_to_capable_peer(
        |fl| frames::udp(fl, &data, UdpGso::Ufo(1480)),
        Ips::v4(),
        GsoKind::Udp,
    );
}

// ---------------------------------------------------------------------------------------
// A -> B: B takes nothing large, gsonet segments.

/// Frames at B until `idle`; each must be wire-size with no GSO and no partial csum.
fn wire_frames_at_b(b: &mut TestFrontend) -> Vec<Vec<u8>> {
    let got = recv_all_where(b, Duration::from_millis(500), |x| !is_hello(x));
    got.into_iter()
        .map(|x| {
            assert_eq!(x.hdr.gso.kind, GsoKind::None, "GSO to B: {:?}", x.hdr);
            assert!(!x.hdr.needs_csum(), "partial checksum to B: {:?}", x.hdr);
            assert!(x.frame.len() <= 1514, "{}-byte frame at B", x.frame.len());
            x.frame
        })
        .collect()
}

fn check_segmented_counters(d: &Daemon, segments: usize) {
    let s = d.stats().unwrap();
    assert_eq!(port_counter(&s, 1, "gso_segmented"), 1, "{s:#}");
    assert_eq!(port_counter(&s, 1, "gso_passed"), 0, "{s:#}");
    assert_eq!(
        port_counter(&s, 1, "segments_out"),
        segments as u64,
        "{s:#}"
    );
}

fn tso_to_plain_peer(ips: Ips, mss: u16, len: usize) {
    let (d, mut a, mut b) = two();
    let flow = Flow::new(a_mac(), b_mac(), ips).ports(5100, 5101);
    let data = frames::payload(len, 21);
    let seq0 = 0xffff_f000; // wraps during the stream
    let (h, f) = frames::tcp_with_flags(
        &flow,
        seq0,
        frames::ACK | frames::PSH | frames::FIN,
        &data,
        Some(mss),
    );
    a.send(&h, &f, TxLayout::HeaderThenChunks(4096)).unwrap();
    let frames_at_b = wire_frames_at_b(&mut b);
    let n = len.div_ceil(mss as usize);
    assert_eq!(frames_at_b.len(), n, "segments at B");
    let segs: Vec<_> = frames_at_b
        .iter()
        .map(|f| frames::parse_tcp(f).expect("etherparse, checksums"))
        .collect();
    for (i, s) in segs.iter().enumerate() {
        let last = i + 1 == n;
        assert_eq!(s.seq, seq0.wrapping_add((i * mss as usize) as u32));
        assert_eq!(
            s.payload.len(),
            if last {
                len - i * mss as usize
            } else {
                mss as usize
            }
        );
        assert_eq!(s.fin, last, "FIN on segment {i}");
        assert_eq!(s.psh, last, "PSH on segment {i}");
        assert_eq!(s.options, segs[0].options, "options differ on segment {i}");
        if let (Some(id), Some(id0)) = (s.ip_id, segs[0].ip_id) {
            assert_eq!(id, id0.wrapping_add(i as u16), "IP ID of segment {i}");
        }
    }
    assert_eq!(segs[0].options.len(), 12, "timestamp option lost");
    assert!(frames::reassemble_tcp(&segs, seq0).unwrap() == data);
    check_segmented_counters(&d, n);
    // Cut in software: made whole in gsonet first, never written from A's buffers.
    assert_eq!(d.port_counter(1, "rx_one_copy").unwrap(), 0);
}

/// Sends a 64 KiB TSO frame from A to B (which takes no GSO) and returns the
/// segments with the time each reached B.
fn segments_with_arrival(a: &mut TestFrontend, b: &mut TestFrontend) -> Vec<(Instant, Vec<u8>)> {
    let flow = Flow::new(a_mac(), b_mac(), Ips::v4()).ports(5200, 5201);
    let data = frames::payload(45 * MSS4 as usize, 3);
    let (h, f) = frames::tcp_with_flags(&flow, 1, frames::ACK, &data, Some(MSS4));
    a.send(&h, &f, TxLayout::HeaderThenChunks(4096)).unwrap();
    let mut got = Vec::new();
    while let Some(x) = recv_where(b, Duration::from_millis(500), |x| !is_hello(x)) {
        got.push((Instant::now(), x.frame));
    }
    assert_eq!(got.len(), 45, "segments at B");
    got
}

/// A frame gsonet segments for a guest with `rx_rate=` reaches it as segments spaced
/// at the rate (each one wire time after the one before), not as one burst; without
/// the limit the same frame arrives as a burst. The arrival times are the test
/// frontend's: it wakes at each call.
#[test]
fn segments_for_a_rate_limited_guest_leave_at_its_rate() {
    let mut spec = DaemonSpec::ports(2);
    // 10 Mbit/s: 1,250,000 bytes a second, a 1514-byte segment 1.2 ms.
    spec.ports[1] = "rx_rate=10,rx_burst=4".into();
    let (d, mut a, mut b) = two_with(&spec);
    let rate = 10e6 / 8.0;
    let paced = segments_with_arrival(&mut a, &mut b);
    // Segment i leaves when the ones before it have had their wire time.
    let wire: usize = paced[..paced.len() - 1].iter().map(|(_, f)| f.len()).sum();
    let expected = Duration::from_secs_f64(wire as f64 / rate);
    let span = paced.last().unwrap().0 - paced[0].0;
    // Not sooner than the rate allows (a slow machine only makes it later); the upper
    // bound is far, only a pacer stuck for whole hold periods breaks it.
    assert!(
        span >= expected.mul_f64(0.8) && span <= expected * 10,
        "45 segments over {span:?}, at the rate {expected:?}\n{:#}",
        d.stats().unwrap()
    );
    let gap = expected / (paced.len() as u32 - 1);
    let bunched = paced
        .windows(2)
        .filter(|w| w[1].0 - w[0].0 < gap / 4)
        .count();
    assert!(
        bunched < paced.len() / 2,
        "{bunched} of 44 gaps under a quarter of the {gap:?} a segment takes"
    );

    let o = ctl(&d, &["port:1", "rx_rate=off"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    // Let A's hold for the last frame's debt run out.
    std::thread::sleep(expected);
    // Unlimited, the same frame comes in well under the paced span of the same run
    // (a busy machine stretches both; still paced, it would take about as long).
    let burst = segments_with_arrival(&mut a, &mut b);
    let burst_span = burst.last().unwrap().0 - burst[0].0;
    eprintln!("45 segments: {span:?} at 10 Mbit/s, {burst_span:?} unlimited");
    assert!(
        burst_span < span / 2,
        "unlimited, the segments took {burst_span:?} (paced: {span:?})"
    );
    assert_eq!(d.port_drops(1).unwrap(), 0, "{:#}", d.stats().unwrap());
}

#[test]
fn tso4_64k_to_plain_peer_is_segmented() {
    // 45 full segments and a 1-byte last one.
    tso_to_plain_peer(Ips::v4(), MSS4, 45 * MSS4 as usize + 1);
}

#[test]
fn tso6_64k_to_plain_peer_is_segmented() {
    // The largest frame virtio lets a driver send is 65550 bytes (the spec's RX
    // buffer advice, 65562, less the 12-byte header).
    tso_to_plain_peer(Ips::v6(), MSS6, 65550 - 14 - 40 - 32);
}

#[test]
fn uso4_to_plain_peer_is_segmented() {
    let (d, mut a, mut b) = two();
    let flow = Flow::new(a_mac(), b_mac(), Ips::v4()).ports(5200, 5201);
    let mss = 1472usize;
    let len = 44 * mss + 100; // 65535 - 28 would be 44 full + 499
    let data = frames::payload(len, 22);
    let (h, f) = frames::udp(&flow, &data, UdpGso::Uso(mss as u16));
    a.send(&h, &f, TxLayout::HeaderThenChunks(4096)).unwrap();
    let got = wire_frames_at_b(&mut b);
    let n = len.div_ceil(mss);
    assert_eq!(got.len(), n, "datagrams at B");
    let mut all = Vec::new();
    let mut id0 = None;
    for (i, fr) in got.iter().enumerate() {
        let u = frames::parse_udp(fr).expect("etherparse, checksums");
        assert_eq!((u.sport, u.dport), (5200, 5201));
        let want = if i + 1 == n { len - i * mss } else { mss };
        assert_eq!(u.payload.len(), want, "datagram {i}");
        let id = u.ip_id.unwrap();
        let id0 = *id0.get_or_insert(id);
        assert_eq!(id, id0.wrapping_add(i as u16), "IP ID of datagram {i}");
        all.extend_from_slice(&u.payload);
    }
    assert!(all == data, "payload differs");
    check_segmented_counters(&d, n);
}

#[test]
fn ufo4_to_plain_peer_is_fragmented() {
    let (d, mut a, mut b) = two();
    let flow = Flow::new(a_mac(), b_mac(), Ips::v4()).ports(5300, 5301);
    let data = frames::payload(20000, 23);
    let (h, f) = frames::udp(&flow, &data, UdpGso::Ufo(1480));
    a.send(&h, &f, TxLayout::HeaderThenChunks(4096)).unwrap();
    let got = wire_frames_at_b(&mut b);
    let frags: Vec<_> = got
        .iter()
        .map(|fr| frames::parse_frag(fr).expect("etherparse"))
        .collect();
    assert!(
        frags.len() >= (8 + data.len()).div_ceil(1480),
        "{} fragments",
        frags.len()
    );
    for fr in &frags {
        assert_eq!(fr.proto, 17);
        assert!(fr.l3_len <= 1500, "{}-byte fragment", fr.l3_len);
    }
    let l4 = frames::reassemble_frags(&frags).expect("reassemble");
    let payload = frames::check_udp_datagram(&flow.ips, &l4).expect("UDP checksum");
    assert!(payload == data, "payload differs");
    check_segmented_counters(&d, frags.len());
}

fn ctl(d: &Daemon, args: &[&str]) -> std::process::Output {
    d.ctl(args)
}

#[test]
fn ctl_max_burst_caps_what_a_gso_peer_receives() {
    let (d, mut a, mut b) = two();
    // A takes GSO frames; capping it at 1000-byte packets forces software segments.
    let o = ctl(&d, &["port:0", "max_burst=1000"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let flow = Flow::new(b_mac(), a_mac(), Ips::v4()).ports(5400, 5401);
    let len = 20 * MSS4 as usize + 7;
    let data = frames::payload(len, 31);
    let (h, f) = frames::tcp(&flow, 7, &data, Some(MSS4));
    b.send(&h, &f, TxLayout::Single).unwrap();
    let got = recv_all_where(&mut a, Duration::from_millis(500), |x| !is_hello(x));
    let segs: Vec<_> = got
        .iter()
        .map(|x| {
            // Partial checksums are fine for A (GUEST_CSUM); parse after completing them.
            assert_eq!(x.hdr.gso.kind, GsoKind::None, "{:?}", x.hdr);
            assert!(x.frame.len() <= 14 + 1000, "{}-byte frame", x.frame.len());
            let mut fr = x.frame.clone();
            frames::finish_if_partial(&x.hdr, &mut fr).expect("csum_start/offset");
            frames::parse_tcp(&fr).expect("etherparse")
        })
        .collect();
    assert!(segs.len() > len / MSS4 as usize, "{} segments", segs.len());
    assert!(frames::reassemble_tcp(&segs, 7).unwrap() == data);
    let s = d.stats().unwrap();
    assert_eq!(s["ports"][0]["max_burst"], 1000);
    assert_eq!(port_counter(&s, 0, "gso_segmented"), 1, "{s:#}");

    // Lifting the cap restores pass-through.
    assert!(ctl(&d, &["port:0", "max_burst=off"]).status.success());
    b.send(&h, &f, TxLayout::Single).unwrap();
    let whole = recv_where(&mut a, T, |x| !is_hello(x)).expect("GSO frame at A");
    assert_eq!(whole.hdr.gso.kind, GsoKind::TcpV4);
    assert_eq!(port_counter(&d.stats().unwrap(), 0, "gso_passed"), 1);

    // Mistakes are refused with exit code 2.
    for bad in [
        &["port:9", "tso=off"][..],
        &["port:0", "turbo=on"],
        &["uplink:0", "gso=software"],
        &["port:0", "max_burst=10"],
    ] {
        let o = ctl(&d, bad);
        assert_eq!(
            o.status.code(),
            Some(2),
            "{bad:?}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
    }
}

/// What a restart owes a guest that kicks no more: a drain of its TX queue (a kick
/// an earlier gsonet took and never served), and a call on each queue even when the
/// call fds come after the rings started (QEMU sends them as the guest unmasks the
/// queues' vectors). Here A's device stops, a frame for B goes into A's TX ring
/// unkicked, and the device starts again with the call fds last; A never kicks, yet
/// the frame reaches B, its chain comes back and A is called on both queues.
#[test]
fn a_restart_serves_and_calls_a_guest_that_kicks_no_more() {
    let (d, mut a, mut b) = two();
    a.wait_tx_done(T).unwrap();
    let bases = a.stop().expect("stop");
    let flow = Flow::new(a_mac(), b_mac(), Ips::v4()).ports(7000, 7001);
    let (h, f) = frames::udp(&flow, b"waiting since the stop", UdpGso::None);
    a.send_unkicked(&[(h, f.clone())]).unwrap();
    let kicks = a.stats(1).kicks;
    let calls = (a.calls(0), a.calls(1));
    a.restart(bases).expect("restart");
    let got = recv_where(&mut b, T, |x| x.frame == f);
    assert!(
        got.is_some(),
        "the unkicked frame never left A\n{:#}",
        d.stats().unwrap()
    );
    assert_eq!(a.wait_tx_done(T).unwrap(), 1, "A's chain came back");
    let end = Instant::now() + T;
    while a.calls(0) == calls.0 || a.calls(1) == calls.1 {
        assert!(
            Instant::now() < end,
            "no call after the restart: rx {} tx {} (before it: {calls:?})\n{:#}",
            a.calls(0),
            a.calls(1),
            d.stats().unwrap()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(a.stats(1).kicks, kicks, "A kicked");
}

/// A frontend that starts its rings again at base 0 however far they have gone, as
/// DPDK's virtio_user in server mode does after it reconnects: gsonet starts each
/// split ring at the used index in guest memory instead. A's chains sent before the
/// restart are not sent again, the frame sent after it reaches B, and B's frame
/// reaches A.
#[test]
fn a_ring_started_again_at_base_zero_goes_on_from_its_used_index() {
    let (d, mut a, mut b) = two();
    let flow = Flow::new(a_mac(), b_mac(), Ips::v4()).ports(7000, 7001);
    let back = Flow::new(b_mac(), a_mac(), Ips::v4()).ports(7001, 7000);
    for i in 0..5u8 {
        let (h, f) = frames::udp(&flow, &[b'a', i], UdpGso::None);
        a.send(&h, &f, TxLayout::Single).unwrap();
        let (h, f) = frames::udp(&back, &[b'b', i], UdpGso::None);
        b.send(&h, &f, TxLayout::Single).unwrap();
    }
    assert_eq!(
        recv_all_where(&mut b, Duration::from_millis(300), |x| !is_hello(x)).len(),
        5
    );
    assert_eq!(
        recv_all_where(&mut a, Duration::from_millis(300), |x| !is_hello(x)).len(),
        5
    );
    a.wait_tx_done(T).unwrap();
    let bases = a.stop().expect("stop");
    assert!(bases.iter().all(|&b| b >= 5), "{bases:?}");
    a.restart([0, 0]).expect("restart");
    let (h, f) = frames::udp(&flow, b"after the restart", UdpGso::None);
    a.send(&h, &f, TxLayout::Single).unwrap();
    let got = recv_all_where(&mut b, Duration::from_millis(500), |x| !is_hello(x));
    let got: Vec<_> = got.iter().map(|x| x.frame.clone()).collect();
    assert_eq!(
        got,
        vec![f],
        "B got old frames again, or not the new one\n{:#}",
        d.stats().unwrap()
    );
    let (h, f) = frames::udp(&back, b"to A after its restart", UdpGso::None);
    b.send(&h, &f, TxLayout::Single).unwrap();
    assert!(
        recv_where(&mut a, T, |x| x.frame == f).is_some(),
        "{:#}",
        d.stats().unwrap()
    );
    let s = d.stats().unwrap();
    for c in ["tx_ring_broken", "rx_bad_chain"] {
        assert_eq!(port_counter(&s, 0, c), 0, "{c}\n{s:#}");
    }
}

//! Live migration against a real `gsonet serve`, driven by the test frontend as QEMU
//! drives a migration: the dirty log (SET_LOG_BASE with LOG_SHMFD, features with
//! LOG_ALL) must mark exactly the guest pages gsonet writes, from the moment the log is
//! set (also while frames are arriving) until features come without LOG_ALL again; a
//! frontend asking for logging it did not negotiate loses its connection, nothing
//! else; SEND_RARP announces the guest from its new port at once.
//!
//! "Exactly" is checked against the guest memory itself: every page whose bytes
//! changed while only gsonet wrote to it is marked, and nothing else is.

mod common;

use std::collections::BTreeSet;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::time::{Duration, Instant};

use common::daemon::{drop_count, Daemon, DaemonSpec};
use common::frames::{self, Flow, Ips, UdpGso};
use common::frontend::{feat, memfd, FrontendOpts, TestFrontend, TxLayout};
use vhost::vhost_user::message::VhostUserProtocolFeatures;
use vhost::{VhostBackend, VhostUserDirtyLogRegion};
use vm_memory::{Bytes, GuestAddress};

const T: Duration = Duration::from_secs(5);
const PAGE: u64 = 4096;
const MEM: u64 = 16 << 20;
const LOG_ALL: u64 = 1 << 26;
const SEND_RARP: u32 = 19;

fn opts(protocol: VhostUserProtocolFeatures) -> FrontendOpts {
    FrontendOpts {
        features: feat::RINGS,
        mem_size: MEM,
        protocol_features: protocol,
        ..Default::default()
    }
}

fn migrating() -> VhostUserProtocolFeatures {
    VhostUserProtocolFeatures::MQ
        | VhostUserProtocolFeatures::REPLY_ACK
        | VhostUserProtocolFeatures::LOG_SHMFD
        | VhostUserProtocolFeatures::RARP
}

fn mac(n: u8) -> frames::Mac {
    frames::mac(n)
}

/// A UDP frame of non-zero bytes from `src` to `dst` (each its own flow: nothing merges).
fn frame(src: frames::Mac, dst: frames::Mac, n: u16) -> (gsonet::vnet_hdr::VirtioNetHdr, Vec<u8>) {
    let flow = Flow::new(src, dst, Ips::v4()).ports(4000 + n, 5000);
    frames::udp(&flow, &[0x5a; 1200], UdpGso::None)
}

/// The whole guest memory of `fe`, page by page.
fn snapshot(fe: &TestFrontend) -> Vec<u8> {
    let mut m = vec![0u8; MEM as usize];
    fe.memory().read_slice(&mut m, GuestAddress(0)).unwrap();
    m
}

fn changed(a: &[u8], b: &[u8]) -> BTreeSet<u64> {
    a.chunks(PAGE as usize)
        .zip(b.chunks(PAGE as usize))
        .enumerate()
        .filter(|(_, (x, y))| x != y)
        .map(|(i, _)| i as u64)
        .collect()
}

/// A dirty log as QEMU makes one: a sealed memfd, one bit per 4 KiB page.
struct Log {
    file: File,
    size: u64,
}

impl Log {
    fn new() -> Log {
        let size = 4096;
        Log {
            file: memfd(size, true).unwrap(),
            size,
        }
    }

    fn set(&self, fe: &mut TestFrontend) -> vhost::Result<()> {
        fe.vhost().set_log_base(
            0,
            Some(VhostUserDirtyLogRegion {
                mmap_size: self.size,
                mmap_offset: 0,
                mmap_handle: self.file.as_raw_fd(),
            }),
        )
    }

    fn pages(&self) -> BTreeSet<u64> {
        let mut b = vec![0u8; self.size as usize];
        self.file.read_exact_at(&mut b, 0).unwrap();
        let mut out = BTreeSet::new();
        for (i, byte) in b.iter().enumerate() {
            for bit in 0..8 {
                if byte & (1 << bit) != 0 {
                    out.insert(i as u64 * 8 + bit);
                }
            }
        }
        out
    }

    fn clear(&self) {
        self.file
            .write_all_at(&vec![0u8; self.size as usize], 0)
            .unwrap();
    }
}

/// Logging on (or off) as QEMU does it: features again, with (without) LOG_ALL.
fn log_all(fe: &mut TestFrontend, on: bool) {
    let f = fe.acked_features();
    let f = if on { f | LOG_ALL } else { f & !LOG_ALL };
    fe.vhost().set_features(f).unwrap();
}

/// Waits until port `port` has delivered `n` frames to its guest.
fn wait_rx(d: &Daemon, port: usize, n: u64) {
    let until = Instant::now() + T;
    loop {
        let got = d.port_counter(port, "rx_frames").unwrap();
        if got >= n {
            assert_eq!(got, n, "more frames than sent reached port {port}");
            return;
        }
        assert!(Instant::now() < until, "port {port}: {got} of {n} frames");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Port 0 (the migrating guest, `a`) and port 1 (`b`, its peer); `a` is learned.
fn pair(protocol: VhostUserProtocolFeatures) -> (Daemon, TestFrontend, TestFrontend) {
    let d = Daemon::start(&DaemonSpec::ports(2)).expect("start gsonet");
    let mut a = TestFrontend::connect(&d.sockets[0], opts(protocol)).unwrap();
    let mut b = TestFrontend::connect(&d.sockets[1], opts(migrating())).unwrap();
    a.post_rx(128, 2048).unwrap();
    b.post_rx(128, 2048).unwrap();
    let (h, f) = frame(mac(0xa), frames::BROADCAST, 0);
    a.send(&h, &f, TxLayout::Single).unwrap();
    a.wait_tx_done(T).unwrap();
    b.recv(T).expect("a's hello at b");
    (d, a, b)
}

fn send_to_a(b: &mut TestFrontend, from: u16, n: u16) {
    for i in from..from + n {
        let (h, f) = frame(mac(0xb), mac(0xa), i);
        b.send(&h, &f, TxLayout::Single).unwrap();
    }
    b.wait_tx_done(T).unwrap();
}

#[test]
fn the_log_marks_exactly_the_pages_gsonet_writes_until_logging_is_off() {
    let (d, mut a, mut b) = pair(migrating());
    let log = Log::new();
    log.set(&mut a).unwrap();
    log_all(&mut a, true);
    assert!(log.pages().is_empty(), "pages marked before any write");

    let before = snapshot(&a);
    send_to_a(&mut b, 1, 20);
    wait_rx(&d, 0, 20);
    let written = changed(&before, &snapshot(&a));
    let dirty = log.pages();
    // 20 frames of ~1.2 KiB in 2 KiB buffers, and the used ring.
    assert!(written.len() >= 10, "only {} pages written", written.len());
    assert_eq!(dirty, written, "dirty log against the pages that changed");
    let data: Vec<(u16, Vec<u8>)> = (0..20)
        .map(|_| {
            let (h, f) = a.recv(T).expect("frame at a");
            (h.num_buffers, f)
        })
        .collect();
    assert!(data.iter().all(|(n, f)| *n == 1 && f.len() > 1200));

    // Logging off: nothing is marked any more, though frames keep arriving.
    log_all(&mut a, false);
    log.clear();
    let before = snapshot(&a);
    send_to_a(&mut b, 100, 10);
    wait_rx(&d, 0, 30);
    assert!(!changed(&before, &snapshot(&a)).is_empty());
    assert!(log.pages().is_empty(), "logged with LOG_ALL off");

    // And on again with a new log, as a second migration attempt does.
    let log2 = Log::new();
    log2.set(&mut a).unwrap();
    log_all(&mut a, true);
    let before = snapshot(&a);
    send_to_a(&mut b, 200, 5);
    wait_rx(&d, 0, 35);
    assert_eq!(log2.pages(), changed(&before, &snapshot(&a)));
    assert!(log.pages().is_empty(), "the old log was written");
    assert_eq!(d.port_drops(0).unwrap(), 0);
}

#[test]
fn a_log_set_while_frames_arrive_covers_every_write_after_it() {
    let (d, mut a, mut b) = pair(migrating());
    let start = snapshot(&a);
    // Frames on their way while the log is set: written before or after it.
    for i in 1..=40 {
        let (h, f) = frame(mac(0xb), mac(0xa), i);
        b.send(&h, &f, TxLayout::Single).unwrap();
    }
    let log = Log::new();
    log.set(&mut a).unwrap();
    log_all(&mut a, true);
    let after_set = snapshot(&a);
    b.wait_tx_done(T).unwrap();
    send_to_a(&mut b, 100, 20);
    wait_rx(&d, 0, 60);
    let end = snapshot(&a);
    let dirty = log.pages();
    let since_set = changed(&after_set, &end);
    let since_start = changed(&start, &end);
    assert!(!since_set.is_empty());
    assert!(
        since_set.is_subset(&dirty),
        "written after SET_LOG_BASE but not marked: {:?}",
        since_set.difference(&dirty).collect::<Vec<_>>()
    );
    assert!(
        dirty.is_subset(&since_start),
        "marked but never written: {:?}",
        dirty.difference(&since_start).collect::<Vec<_>>()
    );
    for _ in 0..60 {
        a.recv(T).expect("every frame arrives");
    }
    assert_eq!(d.port_drops(0).unwrap(), 0);
}

#[test]
fn logging_without_log_shmfd_ends_only_that_connection() {
    let no_log = VhostUserProtocolFeatures::MQ | VhostUserProtocolFeatures::REPLY_ACK;
    let (mut d, mut a, mut b) = pair(no_log);
    // Without LOG_SHMFD the frontend sends SET_LOG_BASE the kernel's way (an address,
    // no file): refused, the connection closed.
    let log = Log::new();
    let _ = log.set(&mut a);
    let until = Instant::now() + T;
    while drop_count(
        &d.stats().unwrap()["ports"][0]["stats"],
        "frontend_request_refused",
    ) == 0
    {
        assert!(Instant::now() < until, "SET_LOG_BASE not refused");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(d.alive(), "gsonet died");
    assert!(a.vhost().get_features().is_err(), "connection still open");
    // The other port goes on, and the port takes its next frontend.
    drop(a);
    let mut a = TestFrontend::connect(&d.sockets[0], opts(no_log)).unwrap();
    a.post_rx(16, 2048).unwrap();
    let (h, f) = frame(mac(0xb), frames::BROADCAST, 7);
    b.send(&h, &f, TxLayout::Single).unwrap();
    b.wait_tx_done(T).unwrap();
    assert_eq!(a.recv(T).expect("frame after reconnect").1, f);
}

#[test]
fn send_rarp_moves_the_guest_to_its_new_port_at_once() {
    let d = Daemon::start(&DaemonSpec::ports(3)).expect("start gsonet");
    let fe = |p: usize| {
        let mut f = TestFrontend::connect(&d.sockets[p], opts(migrating())).unwrap();
        f.post_rx(64, 2048).unwrap();
        f
    };
    let (mut a, mut b, mut c) = (fe(0), fe(1), fe(2));
    // The guest (mac a) lives on port 0; c talks to it there.
    let (h, f) = frame(mac(0xa), frames::BROADCAST, 0);
    a.send(&h, &f, TxLayout::Single).unwrap();
    a.wait_tx_done(T).unwrap();
    b.recv(T).expect("hello at b");
    c.recv(T).expect("hello at c");
    // It migrates to port 1, whose frontend announces it.
    let mut payload = mac(0xa).to_vec();
    payload.extend([0, 0]);
    b.send_request(SEND_RARP, &payload).unwrap();
    let (_, rarp) = c.recv(T).expect("the announce floods");
    assert_eq!(&rarp[..6], &[0xff; 6]);
    assert_eq!(&rarp[6..12], &mac(0xa));
    assert_eq!(&rarp[12..14], &[0x80, 0x35]);
    assert_eq!(rarp.len(), 60);
    // A broadcast: the old port hears it too (the source QEMU is paused by then).
    assert_eq!(a.recv(T).expect("the announce at port 0").1, rarp);
    assert!(
        b.recv(Duration::from_millis(300)).is_none(),
        "announce echoed to its own port"
    );
    let s = d.stats().unwrap();
    assert_eq!(s["ports"][1]["stats"]["mac_moves"].as_u64(), Some(1));
    // c's next frame to the guest goes to port 1 only.
    let (h, f) = frame(mac(0xc), mac(0xa), 1);
    c.send(&h, &f, TxLayout::Single).unwrap();
    c.wait_tx_done(T).unwrap();
    assert_eq!(b.recv(T).expect("unicast at the new port").1, f);
    assert!(
        a.recv(Duration::from_millis(300)).is_none(),
        "unicast at the old port"
    );
    assert_eq!(d.port_drops(1).unwrap(), 0);
}

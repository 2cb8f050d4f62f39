//! A malicious frontend with packed rings (VIRTIO_F_RING_PACKED) against the real
//! daemon: the attacks a packed ring has of its own (issue 30), each on the TX ring
//! of a `packed=on` port A written slot by slot (`TestFrontend::packed_put`), with an
//! honest split guest B on the same switch receiving A's broadcasts.
//!
//! - a wrap counter that lies: a head made available under the wrong wrap counter
//!   is not taken (and taken once it is right); a chain whose later descriptor lies
//!   ends there, counted, and the ring goes on from the slot after it; a chain that
//!   crosses the ring's end without flipping its wrap counter the same;
//! - a chain that crosses the ring's end, well made: read whole;
//! - an id reused while the first buffer of that id is in flight: each buffer is
//!   read and handed back with the id it gave;
//! - indirect tables in a packed ring: one is read; one nested in another, one of
//!   a length that is no multiple of 16, one chained on, one in the middle of a
//!   chain and one of more entries than gsonet takes are counted and cost nothing
//!   more;
//! - the split ring's bounds: a chain that points on through every slot of the
//!   ring, more descriptors than a frame may have, 4 GiB of length, an address
//!   outside memory; and a burst of such chains, which must all be answered in
//!   bounded time while B still gets A's good frames;
//! - VIRTIO_F_IN_ORDER acked (`in_order=on`): a batch of good and bad chains, with
//!   ids reused and ids outside the ring, goes back as one used descriptor at the
//!   batch's first slot with its last chain's id, the used position past all of
//!   them, and the ring goes on from there.
//!
//! Every chain is counted once: as a TX frame or as one drop reason.

mod common;

use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use common::daemon::{drop_count, port_counter, Daemon, DaemonSpec, CHAIN_REASONS};
use common::frontend::{feat, FrontendOpts, PackedRaw, TestFrontend, TX_QUEUE};
use serde_json::Value;

const T: Duration = Duration::from_secs(5);

/// A chain as a test writes it: (address, length, extra flags) per descriptor.
type Chain = Vec<(u64, u32, u16)>;
const AVAIL: u16 = 1 << 7;
const USED: u16 = 1 << 15;
const NEXT: u16 = 1;
const INDIRECT: u16 = 4;

fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// Flags that make a slot available under wrap counter `wrap`.
fn avail(wrap: bool) -> u16 {
    if wrap {
        AVAIL
    } else {
        USED
    }
}

/// Whether `flags` mark a used slot under wrap counter `wrap`.
fn used(flags: u16, wrap: bool) -> bool {
    (flags & AVAIL != 0) == wrap && (flags & USED != 0) == wrap
}

/// A broadcast from A with `marker` in its payload, behind a zero virtio-net header.
fn frame(marker: u8) -> (Vec<u8>, Vec<u8>) {
    let mut f = vec![0xff; 6];
    f.extend_from_slice(&[0x02, 0, 0, 0, 0, 0xa0]);
    f.extend_from_slice(&[0x88, 0xb5]);
    f.extend(std::iter::repeat_n(marker, 64));
    (vec![0u8; 12], f)
}

/// Port A (packed, TX ring of `size`) and B (split), one switch.
struct Rig {
    d: Daemon,
    a: TestFrontend,
    b: TestFrontend,
    size: u16,
    /// Where A's driver stands: slot and wrap counter.
    pos: u16,
    wrap: bool,
    /// Chains A made available so far.
    chains: u64,
    /// Chains are made available without a kick (`kick` sends it).
    quiet: bool,
}

impl Rig {
    fn new(size: u16) -> Rig {
        Rig::with(size, "packed=on", 0)
    }

    /// A on a port with `opts`, acking `features` on top of packed rings.
    fn with(size: u16, opts: &str, features: u64) -> Rig {
        let d = Daemon::start(&DaemonSpec {
            ports: vec![opts.into(), String::new()],
            tap: None,
        })
        .expect("daemon");
        let a = TestFrontend::connect(
            &d.sockets[0],
            FrontendOpts {
                features: feat::RINGS | feat::RING_PACKED | features,
                require_features: true,
                queue_size: size,
                ..Default::default()
            },
        )
        .expect("frontend A");
        assert!(a.is_packed(), "A acked packed rings");
        let mut b = TestFrontend::connect(&d.sockets[1], FrontendOpts::default()).expect("B");
        b.post_rx(64, 2048).expect("B's buffers");
        Rig {
            d,
            a,
            b,
            size,
            pos: 0,
            wrap: true,
            chains: 0,
            quiet: false,
        }
    }

    /// Guest memory holding `bytes` (never freed).
    fn put(&mut self, bytes: &[u8]) -> u64 {
        self.a.alloc_guest(bytes).expect("guest memory")
    }

    /// The slot `k` on from the driver's position, and its wrap counter.
    fn at(&self, k: u16) -> (u16, bool) {
        let i = self.pos + k;
        if i >= self.size {
            (i - self.size, !self.wrap)
        } else {
            (i, self.wrap)
        }
    }

    /// Writes a chain of `descs` (address, length, extra flags) with buffer id `id`
    /// from the driver's position on, each slot's flags from `flags(k, wrap)`, the
    /// head last; moves the position past it and kicks. Returns the head's slot and
    /// wrap counter.
    fn chain_with(
        &mut self,
        descs: &[(u64, u32, u16)],
        id: u16,
        flags: impl Fn(usize, bool) -> u16,
    ) -> (u16, bool) {
        let n = descs.len();
        for k in (0..n).rev() {
            let (slot, wrap) = self.at(k as u16);
            let (addr, len, extra) = descs[k];
            let next = if k + 1 < n { NEXT } else { 0 };
            let d = PackedRaw {
                addr,
                len,
                id,
                flags: flags(k, wrap) | extra | next,
            };
            self.a.packed_put(TX_QUEUE, slot, d).expect("put");
        }
        let head = self.at(0);
        let (p, w) = self.at(n as u16);
        (self.pos, self.wrap) = (p, w);
        self.chains += 1;
        if !self.quiet {
            self.a.kick(TX_QUEUE).expect("kick");
        }
        head
    }

    fn chain(&mut self, descs: &[(u64, u32, u16)], id: u16) -> (u16, bool) {
        self.chain_with(descs, id, |_, w| avail(w))
    }

    /// A good frame with `marker` in header + frame descriptors.
    fn good(&mut self, marker: u8, id: u16) -> (u16, bool) {
        let (h, f) = frame(marker);
        let (h, f) = (self.put(&h), (self.put(&f), f.len() as u32));
        self.chain(&[(h, 12, 0), (f.0, f.1, 0)], id)
    }

    /// A good frame with `marker` in one descriptor (one slot).
    fn good1(&mut self, marker: u8, id: u16) -> (u16, bool) {
        let (mut b, f) = frame(marker);
        b.extend_from_slice(&f);
        let len = b.len() as u32;
        let at = self.put(&b);
        self.chain(&[(at, len, 0)], id)
    }

    /// Waits until slot `at` is used (under its wrap counter); its id.
    fn wait_used(&self, at: (u16, bool)) -> u16 {
        let deadline = Instant::now() + T;
        loop {
            let d = self.a.packed_get(TX_QUEUE, at.0).expect("slot");
            if used(d.flags, at.1) {
                return d.id;
            }
            assert!(Instant::now() < deadline, "slot {at:?} never used: {d:?}");
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    /// The markers of the frames B receives until it has been quiet for a while.
    fn b_markers(&mut self) -> Vec<u8> {
        let mut got = Vec::new();
        while let Some((_, f)) = self.b.recv(Duration::from_millis(300)) {
            if f.len() > 14 && f[12..14] == [0x88, 0xb5] {
                got.push(f[14]);
            }
        }
        got
    }

    /// `b_markers` without waiting for quiet: what B has now.
    fn b_now(&mut self) -> Vec<u8> {
        let mut got = Vec::new();
        while let Some((_, f)) = self.b.recv(Duration::from_millis(1)) {
            if f.len() > 14 && f[12..14] == [0x88, 0xb5] {
                got.push(f[14]);
            }
        }
        got
    }

    fn stats(&self) -> Value {
        self.d.stats().expect("stats")
    }

    /// A's chain drops by reason.
    fn drops(&self) -> Vec<(&'static str, u64)> {
        let s = self.stats();
        let a = &s["ports"][0]["stats"];
        CHAIN_REASONS
            .iter()
            .map(|r| (*r, drop_count(a, r)))
            .filter(|(_, n)| *n > 0)
            .collect()
    }

    fn drop_of(&self, reason: &str) -> u64 {
        drop_count(&self.stats()["ports"][0]["stats"], reason)
    }

    /// Every chain A made available is a TX frame or one chain drop; the daemon lives.
    fn counted(&mut self) {
        assert!(self.d.alive(), "daemon died:\n{}", self.d.log_text());
        let s = self.stats();
        let tx = port_counter(&s, 0, "tx_frames");
        let dropped: u64 = self.drops().iter().map(|(_, n)| n).sum();
        assert_eq!(tx + dropped, self.chains, "{s:#}");
        assert!(!self.d.log_text().contains("panicked"));
    }
}

#[test]
fn a_chain_across_the_ring_end_is_read_whole() {
    let _s = serial();
    let mut r = Rig::new(8);
    // Three frames of two slots: the driver is at slot 6.
    for m in 1..=3 {
        let at = r.good(m, u16::from(m));
        r.wait_used(at);
    }
    assert_eq!((r.pos, r.wrap), (6, true));
    // Four descriptors from slot 6: slots 6, 7 under wrap 1, then 0, 1 under wrap 0.
    let (h, f) = frame(4);
    let h = r.put(&h);
    let f = r.put(&f);
    let at = r.chain(&[(h, 6, 0), (h + 6, 6, 0), (f, 40, 0), (f + 40, 38, 0)], 9);
    assert_eq!(r.wait_used(at), 9);
    assert_eq!((r.pos, r.wrap), (2, false));
    let at = r.good(5, 1);
    r.wait_used(at);
    assert_eq!(r.b_markers(), vec![1, 2, 3, 4, 5]);
    assert!(r.drops().is_empty(), "{:?}", r.drops());
    r.counted();
}

#[test]
fn a_wrap_counter_that_lies_is_not_believed() {
    let _s = serial();
    let mut r = Rig::new(8);
    // A head made available under wrap 0 where the ring is at wrap 1: nothing is
    // taken, however often it kicks.
    let (h, f) = frame(1);
    let (h, f) = (r.put(&h), r.put(&f));
    let at = r.chain_with(&[(h, 12, 0), (f, 78, 0)], 1, |_, w| avail(!w));
    for _ in 0..20 {
        r.a.kick(TX_QUEUE).unwrap();
    }
    std::thread::sleep(Duration::from_millis(300));
    assert!(!used(r.a.packed_get(TX_QUEUE, at.0).unwrap().flags, at.1));
    assert!(r.b_markers().is_empty());
    // Made right, it is taken.
    r.a.packed_put(
        TX_QUEUE,
        at.0,
        PackedRaw {
            addr: h,
            len: 12,
            id: 1,
            flags: avail(true) | NEXT,
        },
    )
    .unwrap();
    r.a.packed_put(
        TX_QUEUE,
        at.0 + 1,
        PackedRaw {
            addr: f,
            len: 78,
            id: 1,
            flags: avail(true),
        },
    )
    .unwrap();
    r.a.kick(TX_QUEUE).unwrap();
    r.wait_used(at);
    assert_eq!(r.b_markers(), vec![1]);

    // A chain whose second descriptor lies: it ends at its head, counted; the ring
    // goes on from the slot after the head.
    let before = r.drop_of("broken_chain");
    let (h, f) = frame(2);
    let (h, f) = (r.put(&h), r.put(&f));
    let at = r.chain_with(&[(h, 12, 0), (f, 78, 0), (f, 1, 0)], 2, |k, w| {
        if k == 1 {
            avail(!w)
        } else {
            avail(w)
        }
    });
    r.wait_used(at);
    assert_eq!(r.drop_of("broken_chain"), before + 1);
    // The driver's view: the device took one slot. Its next buffer goes there.
    (r.pos, r.wrap) = (at.0 + 1, at.1);
    let at = r.good(3, 3);
    r.wait_used(at);
    assert_eq!(r.b_markers(), vec![3]);

    // A chain across the ring's end that keeps its wrap counter past it: broken at
    // the end, counted; the next buffer is taken at slot 0 under the new lap.
    while r.pos != 6 {
        let at = r.good1(7, 7);
        r.wait_used(at);
    }
    r.b_markers();
    let before = r.drop_of("broken_chain");
    let (h, f) = frame(4);
    let (h, f) = (r.put(&h), r.put(&f));
    let lap = r.wrap;
    let at = r.chain_with(&[(h, 12, 0), (f, 40, 0), (f + 40, 38, 0)], 4, |_, _| {
        avail(lap)
    });
    r.wait_used(at);
    assert_eq!(r.drop_of("broken_chain"), before + 1);
    (r.pos, r.wrap) = (0, !lap);
    let at = r.good(5, 5);
    r.wait_used(at);
    assert_eq!(r.b_markers(), vec![5]);
    r.counted();
}

#[test]
fn an_id_reused_in_flight_is_handed_back_as_given() {
    let _s = serial();
    let mut r = Rig::new(16);
    // Two buffers with id 5, both available before the device looks.
    let (h1, f1) = frame(1);
    let (h2, f2) = frame(2);
    let (h1, f1, h2, f2) = (r.put(&h1), r.put(&f1), r.put(&h2), r.put(&f2));
    let second = r.at(2);
    for (k, (addr, len, flags)) in [(f2, 78, 0), (h2, 12, NEXT), (f1, 78, 0), (h1, 12, NEXT)]
        .into_iter()
        .enumerate()
    {
        let slot = 3 - k as u16;
        let d = PackedRaw {
            addr,
            len,
            id: 5,
            flags: avail(true) | flags,
        };
        r.a.packed_put(TX_QUEUE, slot, d).unwrap();
    }
    (r.pos, r.chains) = (4, 2);
    r.a.kick(TX_QUEUE).unwrap();
    assert_eq!(r.wait_used((0, true)), 5);
    assert_eq!(r.wait_used(second), 5);
    assert_eq!(r.b_markers(), vec![1, 2]);
    r.counted();
}

#[test]
fn indirect_tables_in_a_packed_ring() {
    let _s = serial();
    let mut r = Rig::new(16);
    let table = |entries: &[(u64, u32, u16)]| -> Vec<u8> {
        entries
            .iter()
            .flat_map(|&(addr, len, flags)| {
                let mut e = addr.to_le_bytes().to_vec();
                e.extend_from_slice(&len.to_le_bytes());
                e.extend_from_slice(&0u16.to_le_bytes());
                e.extend_from_slice(&flags.to_le_bytes());
                e
            })
            .collect()
    };
    let (h, f) = frame(1);
    let (h, f) = (r.put(&h), r.put(&f));
    // A table of two entries: read.
    let t = table(&[(h, 12, 0), (f, 78, 0)]);
    let t = r.put(&t);
    let at = r.chain(&[(t, 32, INDIRECT)], 1);
    r.wait_used(at);
    assert_eq!(r.b_markers(), vec![1]);

    let broken = |r: &Rig| r.drop_of("broken_chain");
    let cases: Vec<(&str, Chain)> = {
        let inner = r.put(&table(&[(h, 12, 0), (f, 78, 0)]));
        let nested = r.put(&table(&[(inner, 32, INDIRECT)]));
        vec![
            ("a table inside a table", vec![(nested, 16, INDIRECT)]),
            ("a table of 24 bytes", vec![(inner, 24, INDIRECT)]),
            (
                "a table chained on",
                vec![(inner, 32, INDIRECT), (h, 12, 0)],
            ),
            (
                "a table in the middle of a chain",
                vec![(h, 12, 0), (inner, 32, INDIRECT)],
            ),
            (
                "a table longer than the spec allows",
                vec![(inner, 16 << 16, INDIRECT)],
            ),
        ]
    };
    for (i, (what, descs)) in cases.into_iter().enumerate() {
        let before = broken(&r);
        let at = r.chain(&descs, 10 + i as u16);
        r.wait_used(at);
        assert_eq!(broken(&r), before + 1, "{what}");
        assert!(r.b_markers().is_empty(), "{what}");
    }
    // A table of 65535 one-byte entries: more descriptors than a frame may have.
    // A chain may have as many as the queue has slots (16), so the walk reads 17
    // entries and stops. Every entry after those is itself indirect: a walk that
    // read one more would end the chain as broken, not as too long.
    let big: Chain = (0..0xffff)
        .map(|i| (f + i % 64, 1, if i < 17 { 0 } else { INDIRECT }))
        .collect();
    let big = r.put(&table(&big));
    let (long, broke) = (r.drop_of("too_many_descriptors"), broken(&r));
    let at = r.chain(&[(big, 16 * 0xffff, INDIRECT)], 30);
    r.wait_used(at);
    assert_eq!(r.drop_of("too_many_descriptors"), long + 1);
    assert_eq!(broken(&r), broke, "the walk read past the 17th entry");
    let at = r.good(2, 2);
    r.wait_used(at);
    assert_eq!(r.b_markers(), vec![2]);
    r.counted();
}

#[test]
fn packed_chains_keep_the_split_rings_bounds() {
    let _s = serial();
    let mut r = Rig::new(8);
    let (h, f) = frame(1);
    let (h, f) = (r.put(&h), r.put(&f));
    let outside = r.a.mem_end() + 0x10_0000;
    // Every slot of the ring, and the last still points on.
    let before = r.drop_of("broken_chain");
    let all: Chain = (0..8).map(|i| (f + i, 1, 0)).collect();
    let at = r.chain_with(&all, 1, |_, w| avail(w) | NEXT);
    r.wait_used(at);
    assert_eq!(r.drop_of("broken_chain"), before + 1);
    assert_eq!((r.pos, r.wrap), (0, false));
    let total = |r: &Rig| r.drops().iter().map(|(_, n)| n).sum::<u64>();
    for (what, descs) in [
        (
            "4 GiB of length",
            vec![(h, 12, 0), (f, u32::MAX, 0), (f, 16, 0)],
        ),
        (
            "an address outside memory",
            vec![(h, 12, 0), (outside, 64, 0)],
        ),
        (
            "a header outside memory",
            vec![(outside, 12, 0), (f, 64, 0)],
        ),
    ] {
        let before = total(&r);
        let at = r.chain(&descs, 2);
        r.wait_used(at);
        assert_eq!(total(&r), before + 1, "{what}: {:?}", r.drops());
    }
    assert!(r.b_markers().is_empty());

    // A burst: the ring kept full of bad chains for a while (never more slots
    // outstanding than it has), a good frame after every three; all answered, every
    // good one delivered, in bounded time.
    let t0 = Instant::now();
    let mut good = 0;
    let mut got = Vec::new();
    for round in 0..200u32 {
        for k in 0..3u32 {
            let descs = match (round + k) % 3 {
                0 => vec![(outside, 64, 0)],
                1 => vec![(h, 12, 0), (f, u32::MAX, 0)],
                _ => vec![(h, 4, 0)],
            };
            r.chain(&descs, k as u16);
        }
        let at = r.good1(9, 7);
        r.wait_used(at);
        good += 1;
        got.extend(r.b_now());
    }
    let took = t0.elapsed();
    got.extend(r.b_markers());
    assert_eq!(got.len(), good, "every good frame reached B");
    assert!(took < Duration::from_secs(20), "800 chains took {took:?}");
    r.counted();
    // And an honest frontend on A's socket afterwards is served.
    drop(r.a);
    let mut a = TestFrontend::connect(
        &r.d.sockets[0],
        FrontendOpts {
            features: feat::RINGS | feat::RING_PACKED,
            queue_size: 8,
            ..Default::default()
        },
    )
    .expect("a new frontend on A");
    assert!(a.is_packed());
    let (hh, ff) = frame(0x42);
    let hh = a.alloc_guest(&hh).unwrap();
    let ff = a.alloc_guest(&ff).unwrap();
    a.packed_put(
        TX_QUEUE,
        1,
        PackedRaw {
            addr: ff,
            len: 78,
            id: 0,
            flags: avail(true),
        },
    )
    .unwrap();
    a.packed_put(
        TX_QUEUE,
        0,
        PackedRaw {
            addr: hh,
            len: 12,
            id: 0,
            flags: avail(true) | NEXT,
        },
    )
    .unwrap();
    a.kick(TX_QUEUE).unwrap();
    let deadline = Instant::now() + T;
    while !used(a.packed_get(TX_QUEUE, 0).unwrap().flags, true) {
        assert!(
            Instant::now() < deadline,
            "the new frontend's frame was not taken"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
    let mut b = r.b;
    let mut seen = false;
    while let Some((_, f)) = b.recv(Duration::from_millis(500)) {
        seen |= f.len() > 14 && f[14] == 0x42;
    }
    assert!(seen, "B got the new frontend's frame");
}

#[test]
fn in_order_a_batch_goes_back_as_one_used_descriptor() {
    let _s = serial();
    let mut r = Rig::with(16, "packed=on,in_order=on", feat::IN_ORDER);
    assert_ne!(r.a.acked_features() & feat::IN_ORDER, 0, "A acked IN_ORDER");
    let acked = r.stats()["ports"][0]["acked"].as_u64().unwrap();
    assert_ne!(acked & feat::IN_ORDER, 0, "gsonet reports IN_ORDER acked");
    let outside = r.a.mem_end() + 0x10_0000;
    for round in 0..3u8 {
        // Made available without a kick, so that one batch takes them all: a good
        // frame, a chain outside memory with the same id, a header too short, a
        // good frame in one slot with an id past the ring's size, a chain whose
        // second descriptor is device-writable.
        let (h, f) = frame(0);
        let (h, f) = (r.put(&h), r.put(&f));
        r.quiet = true;
        let first = r.good(10 * round + 1, 3);
        let bad = r.chain(&[(h, 12, 0), (outside, 64, 0)], 3);
        let short = r.chain(&[(h, 4, 0)], 4);
        let late = r.good1(10 * round + 2, 999);
        let writable = r.chain(&[(h, 12, 0), (f, 78, 2)], 5);
        r.quiet = false;
        let next = (r.pos, r.wrap);
        r.a.kick(TX_QUEUE).unwrap();
        // One used descriptor, at the first chain's slot, with the last chain's id.
        assert_eq!(r.wait_used(first), 5, "round {round}");
        std::thread::sleep(Duration::from_millis(50));
        for at in [bad, short, late, writable] {
            let d = r.a.packed_get(TX_QUEUE, at.0).unwrap();
            assert!(!used(d.flags, at.1), "round {round}: {at:?} written: {d:?}");
        }
        assert_eq!(r.b_markers(), vec![10 * round + 1, 10 * round + 2]);
        // The device's next used descriptor goes where the batch ended: a good frame
        // there is completed at that slot.
        let at = r.good1(10 * round + 3, 6);
        assert_eq!(at, next);
        assert_eq!(r.wait_used(at), 6);
        assert_eq!(r.b_markers(), vec![10 * round + 3]);
    }
    assert_eq!(r.drop_of("bad_address"), 3);
    r.counted();
}

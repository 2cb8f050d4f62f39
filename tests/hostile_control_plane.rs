//! A hostile vhost-user frontend against the real daemon: one case per attack on the
//! control plane (issue 9, items 2, 3 and 4). Each runs a 3-port `gsonet serve`: port A
//! (0) is attacked, B (1) and C (2) are honest guests. After each attack the daemon must
//! be alive, B and C must still exchange frames, and A must serve a new, honest
//! frontend. Attacks are raw vhost-user messages over the unix socket (`Raw`), or the
//! test frontend's own connection with one message swapped for a bad one.

mod common;

use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::atomic::{AtomicU16, Ordering};
use std::time::{Duration, Instant};

use common::daemon::{drop_count, Daemon, DaemonSpec};
use common::frames::{self, Flow, Ips, UdpGso};
use common::frontend::{feat, memfd, FrontendOpts, TestFrontend, TxLayout, RX_QUEUE, TX_QUEUE};
use common::rx::recv_where;
use vhost::VhostBackend;
use vm_memory::{GuestMemoryBackend, GuestMemoryRegion};
use vmm_sys_util::eventfd::EventFd;
use vmm_sys_util::sock_ctrl_msg::ScmSocket;

const T: Duration = Duration::from_secs(5);

// vhost-user requests and bits (the vhost-user spec).
const GET_FEATURES: u32 = 1;
const SET_FEATURES: u32 = 2;
const SET_OWNER: u32 = 3;
const SET_MEM_TABLE: u32 = 5;
const SET_VRING_NUM: u32 = 8;
const SET_VRING_ADDR: u32 = 9;
const SET_VRING_BASE: u32 = 10;
const SET_VRING_KICK: u32 = 12;
const SET_VRING_CALL: u32 = 13;
const GET_PROTOCOL_FEATURES: u32 = 15;
const SET_PROTOCOL_FEATURES: u32 = 16;
const SET_VRING_ENABLE: u32 = 18;
const ADD_MEM_REG: u32 = 37;
const VERSION: u32 = 0x1;
const NEED_REPLY: u32 = 0x8;
const PROTO_MQ: u64 = 1 << 0;
const PROTO_REPLY_ACK: u64 = 1 << 3;
const PROTO_CONFIGURE_MEM_SLOTS: u64 = 1 << 15;
const VRING_NOFD: u64 = 0x100;

// ---------------------------------------------------------------------------------------
// A raw vhost-user connection

struct Raw {
    s: UnixStream,
}

impl Raw {
    fn connect(path: &Path) -> Raw {
        let s = UnixStream::connect(path).expect("connect to the port");
        s.set_read_timeout(Some(T)).unwrap();
        Raw { s }
    }

    fn send(&self, req: u32, flags: u32, payload: &[u8], fds: &[RawFd]) -> io::Result<()> {
        self.send_sized(req, flags, payload.len() as u32, payload, fds)
    }

    /// A message whose header claims `size` bytes, followed by `payload`.
    fn send_sized(
        &self,
        req: u32,
        flags: u32,
        size: u32,
        payload: &[u8],
        fds: &[RawFd],
    ) -> io::Result<()> {
        let mut b = Vec::with_capacity(12 + payload.len());
        b.extend_from_slice(&req.to_le_bytes());
        b.extend_from_slice(&flags.to_le_bytes());
        b.extend_from_slice(&size.to_le_bytes());
        b.extend_from_slice(payload);
        let n = if fds.is_empty() {
            0
        } else {
            self.s.send_with_fds(&[&b[..]], fds)?
        };
        (&self.s).write_all(&b[n..])
    }

    fn request(&self, req: u32, payload: &[u8]) -> io::Result<()> {
        self.send(req, VERSION, payload, &[])
    }

    /// The next reply: (request, payload).
    fn reply(&mut self) -> io::Result<(u32, Vec<u8>)> {
        let mut h = [0u8; 12];
        self.s.read_exact(&mut h)?;
        let size = u32::from_le_bytes(h[8..12].try_into().unwrap()) as usize;
        let mut p = vec![0u8; size];
        self.s.read_exact(&mut p)?;
        Ok((u32::from_le_bytes(h[..4].try_into().unwrap()), p))
    }

    /// A request with NEED_REPLY (REPLY_ACK acked): Ok once gsonet acknowledged it
    /// with success.
    fn acked(&mut self, req: u32, payload: &[u8], fds: &[RawFd]) -> io::Result<()> {
        self.send(req, VERSION | NEED_REPLY, payload, fds)?;
        let (r, p) = self.reply()?;
        assert_eq!(r, req, "reply to another request");
        match u64::from_le_bytes(p[..8].try_into().unwrap()) {
            0 => Ok(()),
            v => Err(io::Error::other(format!("request {req} failed: {v}"))),
        }
    }

    fn get_u64(&mut self, req: u32) -> io::Result<u64> {
        self.request(req, &[])?;
        let (r, p) = self.reply()?;
        assert_eq!(r, req, "reply to another request");
        Ok(u64::from_le_bytes(p[..8].try_into().unwrap()))
    }

    /// The start of QEMU's handshake: features, protocol features `proto` (acked as
    /// given, whatever was offered), owner. Returns the virtio features offered.
    fn hello(&mut self, proto: u64) -> u64 {
        let offered = self.get_u64(GET_FEATURES).expect("GET_FEATURES");
        self.get_u64(GET_PROTOCOL_FEATURES)
            .expect("GET_PROTOCOL_FEATURES");
        self.request(SET_PROTOCOL_FEATURES, &proto.to_le_bytes())
            .unwrap();
        self.request(SET_OWNER, &[]).unwrap();
        offered
    }

    /// Whether gsonet closed this connection within `timeout`; replies that arrive in
    /// the meantime are skipped.
    fn closed_within(&mut self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        self.s
            .set_read_timeout(Some(Duration::from_millis(50)))
            .unwrap();
        let mut buf = [0u8; 4096];
        loop {
            match self.s.read(&mut buf) {
                Ok(0) => return true,
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::ConnectionReset => return true,
                Err(_) if Instant::now() < deadline => {}
                Err(_) => return false,
            }
        }
    }
}

fn u32s(a: u32, b: u32) -> Vec<u8> {
    let mut v = a.to_le_bytes().to_vec();
    v.extend_from_slice(&b.to_le_bytes());
    v
}

/// A memory region as SET_MEM_TABLE and ADD_MEM_REG carry it.
fn region(gpa: u64, size: u64, uaddr: u64, offset: u64) -> Vec<u8> {
    [gpa, size, uaddr, offset]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect()
}

/// A pipe (read end, write end) whose buffer is one page and already full, so a
/// blocking write to it blocks.
fn full_pipe() -> (OwnedFd, OwnedFd) {
    let mut fds = [0; 2];
    // SAFETY: pipe2 writes two descriptors into the array we pass.
    assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
    // SAFETY: both are fresh descriptors we own.
    let (r, w) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    // SAFETY: fcntl on descriptors we own, integer arguments only.
    unsafe {
        libc::fcntl(w.as_raw_fd(), libc::F_SETPIPE_SZ, 4096);
        libc::fcntl(w.as_raw_fd(), libc::F_SETFL, libc::O_NONBLOCK);
    }
    let mut f = File::from(w.try_clone().unwrap());
    while f.write(&[0u8; 512]).is_ok() {}
    // SAFETY: as above.
    unsafe { libc::fcntl(w.as_raw_fd(), libc::F_SETFL, 0) };
    (r, w)
}

/// An `EventFd` wrapper around any descriptor, for the vhost crate's frontend API
/// (which sends whatever descriptor it is given).
fn as_eventfd(fd: OwnedFd) -> EventFd {
    // SAFETY: ownership of the descriptor moves into the EventFd.
    unsafe { EventFd::from_raw_fd(std::os::fd::IntoRawFd::into_raw_fd(fd)) }
}

fn fd_count(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count())
        .unwrap_or(0)
}

fn rss_kib(pid: u32) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    s.lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

/// `f()` once it stops changing for 300 ms (or after 5 s).
fn settled(mut f: impl FnMut() -> u64) -> u64 {
    let deadline = Instant::now() + T;
    let mut last = f();
    loop {
        std::thread::sleep(Duration::from_millis(300));
        let now = f();
        if now == last || Instant::now() > deadline {
            return now;
        }
        last = now;
    }
}

// ---------------------------------------------------------------------------------------
// The three ports

const A: usize = 0;
const B: usize = 1;
const C: usize = 2;

fn mac(port: usize) -> frames::Mac {
    frames::mac(0xa + port as u8)
}

fn honest(d: &Daemon, port: usize, opts: FrontendOpts) -> anyhow::Result<TestFrontend> {
    // A read timeout, so that a port that never answers fails the test instead of
    // hanging it.
    let s = UnixStream::connect(&d.sockets[port])?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    let mut fe = TestFrontend::from_stream(s, opts)?;
    fe.post_rx(256, 2048)?;
    Ok(fe)
}

/// Honest guests' options: what Linux acks, without EVENT_IDX (so that every frame
/// written to an attacker's queue signals its call fd).
fn opts() -> FrontendOpts {
    FrontendOpts {
        features: feat::LINUX_DEFAULT & !feat::EVENT_IDX,
        ..Default::default()
    }
}

struct World {
    d: Daemon,
    b: TestFrontend,
    c: TestFrontend,
}

/// A daemon with `a` as port A's extra options, and honest guests on B and C.
fn world(a: &str) -> World {
    let spec = DaemonSpec {
        ports: vec![a.to_string(), String::new(), String::new()],
        tap: None,
    };
    let d = Daemon::start(&spec).expect("start gsonet");
    let b = honest(&d, B, opts()).expect("B");
    let c = honest(&d, C, opts()).expect("C");
    World { d, b, c }
}

static SPORT: AtomicU16 = AtomicU16::new(1000);

/// A frame from `src` to `dst` that no other call builds.
fn frame(src: usize, dst: frames::Mac) -> (gsonet::vnet_hdr::VirtioNetHdr, Vec<u8>) {
    let sport = SPORT.fetch_add(1, Ordering::Relaxed);
    let flow = Flow::new(mac(src), dst, Ips::v4()).ports(sport, 9);
    frames::udp(&flow, &[src as u8; 64], UdpGso::None)
}

/// Sends `n` frames `from` -> `to` (to its MAC) and checks each arrives.
fn exchange(from: &mut TestFrontend, to: &mut TestFrontend, src: usize, dst: usize, n: usize) {
    let mut sent = Vec::new();
    for _ in 0..n {
        let (h, f) = frame(src, mac(dst));
        from.send(&h, &f, TxLayout::Single).expect("send");
        sent.push(f);
    }
    for f in sent {
        assert!(
            recv_where(to, T, |r| r.frame == f).is_some(),
            "a frame from port {src} did not reach port {dst}"
        );
    }
}

impl World {
    fn counter(&self, port: usize, reason: &str) -> u64 {
        drop_count(&self.d.stats().unwrap()["ports"][port]["stats"], reason)
    }

    /// The daemon lives, B and C exchange frames, and A serves an honest frontend
    /// that exchanges frames with B.
    fn check_after(&mut self, what: &str) {
        assert!(
            self.d.alive(),
            "{what}: gsonet died: {:?}",
            self.d.exit_status()
        );
        exchange(&mut self.b, &mut self.c, B, C, 5);
        exchange(&mut self.c, &mut self.b, C, B, 5);
        let mut a = honest(&self.d, A, opts())
            .unwrap_or_else(|e| panic!("{what}: port A does not serve a new frontend: {e:#}"));
        exchange(&mut a, &mut self.b, A, B, 3);
        exchange(&mut self.b, &mut a, B, A, 3);
        assert!(
            self.d.alive(),
            "{what}: gsonet died: {:?}",
            self.d.exit_status()
        );
        assert!(
            !self.d.log_text().contains("panicked"),
            "{what}: a thread panicked"
        );
    }
}

// ---------------------------------------------------------------------------------------
// Item 3: protocol features, tables, sizes, descriptors

#[test]
fn unoffered_add_mem_reg_flood_keeps_fds_bounded() {
    let mut w = world("");
    let pid = w.d.pid();
    let before = fd_count(pid);
    let mut raw = Raw::connect(&w.d.sockets[A]);
    // CONFIGURE_MEM_SLOTS not acked: ADD_MEM_REG is not allowed at all.
    raw.hello(PROTO_MQ | PROTO_REPLY_ACK);
    let mut sent = 0;
    for i in 0..400u64 {
        let mem = memfd(1 << 20, true).unwrap();
        let mut p = 0u64.to_le_bytes().to_vec();
        p.extend(region(
            (i + 1) << 30,
            1 << 20,
            0x1000_0000_0000 + (i << 30),
            0,
        ));
        if raw
            .send(ADD_MEM_REG, VERSION, &p, &[mem.as_raw_fd()])
            .is_err()
        {
            break;
        }
        sent += 1;
    }
    let after = settled(|| fd_count(pid) as u64) as usize;
    eprintln!("ADD_MEM_REG sent: {sent}; gsonet fds: {before} -> {after}");
    assert!(
        after <= before + 16,
        "unoffered ADD_MEM_REG grew gsonet from {before} to {after} fds"
    );
    assert!(
        raw.closed_within(T),
        "the flooding frontend is still connected"
    );
    assert_eq!(w.counter(A, "frontend_request_refused"), 1);
    w.check_after("ADD_MEM_REG flood");
}

// ---------------------------------------------------------------------------------------
// CONFIGURE_MEM_SLOTS: memory added and removed while the device runs

/// Regions gsonet maps per port at most (GET_MAX_MEM_SLOTS).
const MAX_MEM_SLOTS: usize = 64;
const GET_MAX_MEM_SLOTS: u32 = 36;
const REM_MEM_REG: u32 = 38;

/// ADD/REM_MEM_REG's payload.
fn mem_reg(gpa: u64, size: u64, uaddr: u64, offset: u64) -> Vec<u8> {
    let mut p = 0u64.to_le_bytes().to_vec();
    p.extend(region(gpa, size, uaddr, offset));
    p
}

/// A hostile memory case: what it is, the regions added before, the message, whether
/// it is an ADD_MEM_REG (else a REM_MEM_REG), the counter it goes to.
type MemCase = (&'static str, Vec<Vec<u8>>, Vec<u8>, bool, &'static str);

fn mem_regions(w: &World, port: usize) -> u64 {
    w.d.stats().unwrap()["ports"][port]["mem_regions"]
        .as_u64()
        .unwrap()
}

#[test]
fn memory_added_at_run_time_carries_the_next_frames_and_removed_memory_is_let_go() {
    let mut w = world("");
    let pid = w.d.pid();
    let mut a = honest(&w.d, A, opts()).unwrap();
    assert_ne!(
        a.acked_protocol_features().bits() & PROTO_CONFIGURE_MEM_SLOTS,
        0
    );
    exchange(&mut a, &mut w.b, A, B, 3);
    let fds = fd_count(pid);
    assert_eq!(mem_regions(&w, A), 1);
    // A DIMM plugged: its very next chains are in it, TX and RX. The 256 RX buffers
    // posted before are used first and each is posted again in the new memory, so
    // the last 44 of the 300 frames to A land there.
    let dimm = 8u64 << 32;
    a.add_region(dimm, 16 << 20).unwrap();
    assert_eq!(mem_regions(&w, A), 2);
    a.pin_region(Some(dimm));
    exchange(&mut a, &mut w.b, A, B, 20);
    for _ in 0..6 {
        exchange(&mut w.b, &mut a, B, A, 50);
    }
    // The guest moves off it (every RX buffer posted there is used and posted again
    // in the boot memory), then it is unplugged.
    a.pin_region(Some(0));
    for _ in 0..6 {
        exchange(&mut w.b, &mut a, B, A, 50);
    }
    a.reclaim_tx().unwrap();
    a.remove_region(dimm).unwrap();
    assert_eq!(mem_regions(&w, A), 1);
    let after = settled(|| fd_count(pid) as u64) as usize;
    assert!(
        after <= fds,
        "gsonet holds {after} fds, {fds} before the DIMM"
    );
    // A chain still naming the removed memory is dropped and counted; the rest goes on.
    let bad = w.counter(A, "bad_address");
    a.push_raw(
        TX_QUEUE,
        &[common::frontend::RawDesc::new(dimm + 4096, 100)],
    )
    .unwrap();
    exchange(&mut a, &mut w.b, A, B, 3);
    assert_eq!(w.counter(A, "bad_address"), bad + 1);
    exchange(&mut w.b, &mut a, B, A, 3);
    drop(a);
    w.check_after("a region added and removed");
}

#[test]
fn hostile_memory_regions_are_refused_and_bounded() {
    let mut w = world("");
    let pid = w.d.pid();
    let proto = PROTO_MQ | PROTO_REPLY_ACK | PROTO_CONFIGURE_MEM_SLOTS;
    // (case, regions before it, the message, the counter it goes to)
    let u = 0x1000_0000_0000u64;
    let cases: [MemCase; 6] = [
        (
            "overlapping guest addresses",
            vec![mem_reg(1 << 32, 2 << 20, u, 0)],
            mem_reg((1 << 32) + (1 << 20), 2 << 20, u + (1 << 30), 0),
            true,
            "frontend_bad_payload",
        ),
        (
            "overlapping frontend addresses",
            vec![mem_reg(1 << 32, 2 << 20, u, 0)],
            mem_reg(2 << 32, 2 << 20, u + (1 << 20), 0),
            true,
            "frontend_bad_payload",
        ),
        (
            "wrapping",
            vec![],
            mem_reg(u64::MAX - (1 << 20) + 1, 2 << 20, u, 0),
            true,
            "frontend_bad_payload",
        ),
        (
            "removing a region never added",
            vec![mem_reg(1 << 32, 2 << 20, u, 0)],
            mem_reg(2 << 32, 2 << 20, u + (1 << 30), 0),
            false,
            "frontend_bad_payload",
        ),
        (
            "removing by the wrong size",
            vec![mem_reg(1 << 32, 2 << 20, u, 0)],
            mem_reg(1 << 32, 1 << 20, u, 0),
            false,
            "frontend_bad_payload",
        ),
        (
            "beyond its file",
            vec![],
            mem_reg(1 << 32, 2 << 20, u, 4096),
            true,
            "frontend_bad_memory",
        ),
    ];
    for (what, before, m, add, counter) in cases {
        let was = w.counter(A, counter);
        let mut raw = Raw::connect(&w.d.sockets[A]);
        raw.hello(proto);
        for r in &before {
            let f = memfd(2 << 20, true).unwrap();
            raw.acked(ADD_MEM_REG, r, &[f.as_raw_fd()])
                .unwrap_or_else(|e| panic!("{what}: an honest region refused: {e}"));
        }
        let f = memfd(2 << 20, true).unwrap();
        let fds: &[RawFd] = if add { &[f.as_raw_fd()] } else { &[] };
        let _ = raw.send(
            if add { ADD_MEM_REG } else { REM_MEM_REG },
            VERSION,
            &m,
            fds,
        );
        assert!(raw.closed_within(T), "{what}: still connected");
        assert_eq!(w.counter(A, counter), was + 1, "{what}");
    }
    // An unsealed file.
    let mut raw = Raw::connect(&w.d.sockets[A]);
    raw.hello(proto);
    let f = memfd(2 << 20, false).unwrap();
    let _ = raw.send(
        ADD_MEM_REG,
        VERSION,
        &mem_reg(1 << 32, 2 << 20, u, 0),
        &[f.as_raw_fd()],
    );
    assert!(raw.closed_within(T), "unsealed: still connected");
    assert_eq!(w.counter(A, "frontend_unsealed_memory"), 1);
    // As many regions as announced, and not one more: the fds held stay bounded.
    let before = fd_count(pid);
    let mut raw = Raw::connect(&w.d.sockets[A]);
    raw.hello(proto);
    assert_eq!(
        raw.get_u64(GET_MAX_MEM_SLOTS).unwrap(),
        MAX_MEM_SLOTS as u64
    );
    let connected = settled(|| fd_count(pid) as u64) as usize;
    for i in 0..MAX_MEM_SLOTS as u64 {
        let f = memfd(1 << 20, true).unwrap();
        raw.acked(
            ADD_MEM_REG,
            &mem_reg((i + 1) << 32, 1 << 20, u + (i << 30), 0),
            &[f.as_raw_fd()],
        )
        .unwrap_or_else(|e| panic!("region {i} refused: {e}"));
    }
    // Settled, as `connected` is: a connection the cases above closed may still
    // hold an fd for a moment on a busy machine.
    let full = settled(|| fd_count(pid) as u64) as usize;
    let f = memfd(1 << 20, true).unwrap();
    let _ = raw.send(
        ADD_MEM_REG,
        VERSION,
        &mem_reg(100 << 32, 1 << 20, u + (100 << 30), 0),
        &[f.as_raw_fd()],
    );
    assert!(raw.closed_within(T), "one region too many: still connected");
    let after = settled(|| fd_count(pid) as u64) as usize;
    eprintln!(
        "{MAX_MEM_SLOTS} regions: gsonet fds {before}, {connected} connected, {full} full, \
         {after} once closed"
    );
    assert!(
        full <= connected + MAX_MEM_SLOTS,
        "{connected} -> {full} fds"
    );
    assert!(
        after <= before + 8,
        "{after} fds after the connection closed"
    );
    w.check_after("hostile memory regions");
}

#[test]
fn a_memory_add_remove_storm_is_paced_and_costs_other_ports_nothing() {
    let mut w = world("");
    let proto = PROTO_MQ | PROTO_REPLY_ACK | PROTO_CONFIGURE_MEM_SLOTS;
    let path = w.d.sockets[A].clone();
    let quiet = {
        let t = Instant::now();
        let mut n = 0;
        while t.elapsed() < Duration::from_secs(3) {
            exchange(&mut w.b, &mut w.c, B, C, 20);
            exchange(&mut w.c, &mut w.b, C, B, 20);
            n += 1;
        }
        n
    };
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let s = stop.clone();
    let storm = std::thread::spawn(move || {
        let mut raw = Raw::connect(&path);
        raw.hello(proto);
        let f = memfd(64 << 20, true).unwrap();
        let r = mem_reg(1 << 32, 64 << 20, 0x1000_0000_0000, 0);
        let mut n = 0u64;
        let start = Instant::now();
        while !s.load(Ordering::Relaxed) {
            raw.acked(ADD_MEM_REG, &r, &[f.as_raw_fd()]).unwrap();
            raw.acked(REM_MEM_REG, &r, &[]).unwrap();
            n += 2;
        }
        (n, start.elapsed())
    });
    // B and C go on exchanging frames meanwhile, every one of them arriving (the
    // rounds they manage are printed against the same span without the storm).
    let rounds = |w: &mut World| {
        let t = Instant::now();
        let mut n = 0;
        while t.elapsed() < Duration::from_secs(3) {
            exchange(&mut w.b, &mut w.c, B, C, 20);
            exchange(&mut w.c, &mut w.b, C, B, 20);
            n += 1;
        }
        n
    };
    let rounds = rounds(&mut w);
    stop.store(true, Ordering::Relaxed);
    let (changes, took) = storm.join().unwrap();
    let rate = changes as f64 / took.as_secs_f64();
    eprintln!(
        "{changes} memory changes in {took:?} ({rate:.0}/s); B and C: {rounds} rounds of 40 frames in 3 s, {quiet} before it"
    );
    // Held to 100 a second after a burst of 128.
    assert!(
        changes as f64 <= 128.0 + 100.0 * took.as_secs_f64() + 20.0,
        "{changes} changes in {took:?}"
    );
    assert!(changes >= 128, "the storm made only {changes} changes");
    w.check_after("a memory storm");
}

#[test]
fn early_enable_stream_with_distinct_indexes_is_refused() {
    let mut w = world("");
    let pid = w.d.pid();
    let mut raw = Raw::connect(&w.d.sockets[A]);
    raw.hello(PROTO_MQ | PROTO_REPLY_ACK);
    let before = rss_kib(pid);
    // SET_VRING_ENABLE before SET_FEATURES, ring 2, 3, ... (the port has 2 rings).
    let mut index = 2u32;
    let mut sent = 0u64;
    'stream: for _ in 0..256 {
        let mut batch = Vec::with_capacity(4096 * 20);
        for _ in 0..4096 {
            batch.extend_from_slice(&SET_VRING_ENABLE.to_le_bytes());
            batch.extend_from_slice(&VERSION.to_le_bytes());
            batch.extend_from_slice(&8u32.to_le_bytes());
            batch.extend_from_slice(&u32s(index, 1));
            index += 1;
        }
        if (&raw.s).write_all(&batch).is_err() {
            break 'stream;
        }
        sent += 4096;
    }
    let after = settled(|| rss_kib(pid));
    eprintln!("early enables sent: {sent}; gsonet RSS: {before} -> {after} KiB");
    assert!(
        after < before + 16 * 1024,
        "early SET_VRING_ENABLE grew gsonet from {before} to {after} KiB"
    );
    assert!(raw.closed_within(T), "the frontend is still connected");
    assert_eq!(w.counter(A, "frontend_bad_payload"), 1);
    w.check_after("early enable stream");
}

#[test]
fn payloads_of_the_wrong_size_are_refused() {
    let mut w = world("");
    let region_table = {
        let mut p = u32s(2, 0); // two regions announced, one sent
        p.extend(region(0, 1 << 20, 0x7000_0000_0000, 0));
        p
    };
    // (what, request, flags, header size, payload)
    let cases: Vec<(&str, u32, u32, u32, Vec<u8>)> = vec![
        (
            "early SET_VRING_ENABLE, 4 bytes",
            SET_VRING_ENABLE,
            VERSION | NEED_REPLY,
            4,
            vec![0; 4],
        ),
        (
            "early SET_VRING_ENABLE, 16 bytes",
            SET_VRING_ENABLE,
            VERSION | NEED_REPLY,
            16,
            u32s(0, 1).repeat(2),
        ),
        (
            "SET_FEATURES, 4 bytes",
            SET_FEATURES,
            VERSION,
            4,
            vec![0; 4],
        ),
        (
            "GET_FEATURES, 4000 bytes",
            GET_FEATURES,
            VERSION,
            4000,
            vec![0; 4000],
        ),
        (
            "SET_OWNER claiming 4 GiB",
            SET_OWNER,
            VERSION,
            u32::MAX,
            vec![0; 64],
        ),
        (
            "SET_MEM_TABLE, size of one region, two announced",
            SET_MEM_TABLE,
            VERSION,
            40,
            region_table,
        ),
    ];
    for (i, (what, req, flags, size, payload)) in cases.into_iter().enumerate() {
        let mut raw = Raw::connect(&w.d.sockets[A]);
        raw.hello(PROTO_MQ | PROTO_REPLY_ACK);
        let _ = raw.send_sized(req, flags, size, &payload, &[]);
        assert!(
            raw.closed_within(T),
            "{what}: the frontend is still connected"
        );
        assert_eq!(
            w.counter(A, "frontend_bad_payload"),
            i as u64 + 1,
            "{what}: not counted"
        );
    }
    w.check_after("bad payload sizes");
}

#[test]
fn descriptors_on_messages_that_carry_none_are_refused() {
    let mut w = world("");
    let pid = w.d.pid();
    let before = fd_count(pid);
    let efd = |n: usize| -> Vec<EventFd> { (0..n).map(|_| EventFd::new(0).unwrap()).collect() };
    let raw_fds = |v: &[EventFd]| -> Vec<RawFd> { v.iter().map(|e| e.as_raw_fd()).collect() };
    // (what, request, flags, payload, descriptors)
    let cases: Vec<(&str, u32, u32, Vec<u8>, usize)> = vec![
        ("GET_FEATURES with one", GET_FEATURES, VERSION, vec![], 1),
        (
            "early SET_VRING_ENABLE with one",
            SET_VRING_ENABLE,
            VERSION | NEED_REPLY,
            u32s(0, 1),
            1,
        ),
        (
            "SET_VRING_CALL with two",
            SET_VRING_CALL,
            VERSION,
            0u64.to_le_bytes().to_vec(),
            2,
        ),
        (
            "SET_VRING_KICK flagged without one, with one",
            SET_VRING_KICK,
            VERSION,
            (1 | VRING_NOFD).to_le_bytes().to_vec(),
            1,
        ),
        ("SET_OWNER with 40", SET_OWNER, VERSION, vec![], 40),
    ];
    for (i, (what, req, flags, payload, n)) in cases.into_iter().enumerate() {
        let mut raw = Raw::connect(&w.d.sockets[A]);
        raw.hello(PROTO_MQ | PROTO_REPLY_ACK);
        let fds = efd(n);
        let _ = raw.send(req, flags, &payload, &raw_fds(&fds));
        assert!(
            raw.closed_within(T),
            "{what}: the frontend is still connected"
        );
        assert_eq!(
            w.counter(A, "frontend_bad_fds"),
            i as u64 + 1,
            "{what}: not counted"
        );
    }
    let after = settled(|| fd_count(pid) as u64) as usize;
    assert!(after <= before + 16, "gsonet fds: {before} -> {after}");
    w.check_after("descriptors on the wrong messages");
}

// ---------------------------------------------------------------------------------------
// Item 2 (the descriptor half): kick and call must be eventfds, calls never block

#[test]
fn a_pipe_as_call_fd_is_refused() {
    let mut w = world("");
    let mut a = honest(&w.d, A, opts()).expect("A");
    let (_r, wr) = full_pipe();
    // With REPLY_ACK the frontend waits for the answer: none, the connection is gone.
    let r = a.vhost().set_vring_call(RX_QUEUE, &as_eventfd(wr));
    // B floods: the frames for A would make B's worker write to A's call "eventfd".
    let mut sent = Vec::new();
    for _ in 0..20 {
        let (h, f) = frame(B, frames::BROADCAST);
        w.b.send(&h, &f, TxLayout::Single).unwrap();
        sent.push(f);
    }
    for f in sent {
        assert!(
            recv_where(&mut w.c, T, |r| r.frame == f).is_some(),
            "B's broadcast did not reach C: a sender is stuck on A's call pipe"
        );
    }
    assert!(r.is_err(), "gsonet took a pipe as call fd");
    assert_eq!(w.counter(A, "frontend_not_eventfd"), 1);
    drop(a);
    w.check_after("pipe as call fd");
}

#[test]
fn a_pipe_as_kick_fd_is_refused() {
    let mut w = world("");
    let mut a = honest(&w.d, A, opts()).expect("A");
    let (rd, wr) = full_pipe();
    let r = a.vhost().set_vring_kick(TX_QUEUE, &as_eventfd(rd));
    assert!(r.is_err(), "gsonet took a pipe as kick fd");
    drop(wr);
    assert_eq!(w.counter(A, "frontend_not_eventfd"), 1);
    drop(a);
    w.check_after("pipe as kick fd");
}

#[test]
fn a_full_eventfd_as_call_fd_does_not_stall_other_ports() {
    let mut w = world("");
    let mut a = honest(&w.d, A, opts()).expect("A");
    // A blocking eventfd at its maximum count: one more write would block.
    let call = EventFd::new(0).unwrap();
    call.write(u64::MAX - 1).unwrap();
    a.vhost()
        .set_vring_call(RX_QUEUE, &call)
        .expect("an eventfd is a valid call fd");
    // B floods 50 frames: each reaches A (whose call fd cannot take a signal) and C.
    let mut sent = Vec::new();
    for _ in 0..50 {
        let (h, f) = frame(B, frames::BROADCAST);
        w.b.send(&h, &f, TxLayout::Single).unwrap();
        sent.push(f);
    }
    for (i, f) in sent.into_iter().enumerate() {
        assert!(
            recv_where(&mut w.c, T, |r| r.frame == f).is_some(),
            "frame {i} of B's flood did not reach C: a sender is stuck on A's call fd"
        );
    }
    exchange(&mut w.c, &mut w.b, C, B, 5);
    drop(a);
    w.check_after("full eventfd as call fd");
}

// ---------------------------------------------------------------------------------------
// Item 4: memory files

/// Up to SET_MEM_TABLE: one region of `size` bytes at GPA 0 in `mem`.
fn map(raw: &mut Raw, mem: &File, size: u64) -> io::Result<()> {
    let offered = raw.hello(PROTO_MQ | PROTO_REPLY_ACK);
    let feats = offered & (feat::VERSION_1 | feat::PROTOCOL_FEATURES);
    raw.request(SET_FEATURES, &feats.to_le_bytes())?;
    let mut p = u32s(1, 0);
    p.extend(region(0, size, 0x7000_0000_0000, 0));
    raw.send(SET_MEM_TABLE, VERSION, &p, &[mem.as_raw_fd()])
}

#[test]
fn a_memfd_shorter_than_its_region_is_refused() {
    let mut w = world("");
    let mut raw = Raw::connect(&w.d.sockets[A]);
    let mem = memfd(1 << 20, true).unwrap();
    let _ = map(&mut raw, &mem, 16 << 20);
    // Rings past the end of the file: setting their address reads the used index.
    let base = 0x7000_0000_0000u64 + (8 << 20);
    let _ = raw.request(SET_VRING_NUM, &u32s(0, 256));
    let _ = raw.request(SET_VRING_BASE, &u32s(0, 0));
    let mut addr = u32s(0, 0);
    for a in [base, base + 0x2000, base + 0x1000, 0] {
        addr.extend_from_slice(&a.to_le_bytes());
    }
    let _ = raw.request(SET_VRING_ADDR, &addr);
    std::thread::sleep(Duration::from_millis(500));
    assert!(
        w.d.alive(),
        "gsonet died: {:?}\n{}",
        w.d.exit_status(),
        w.d.log_text()
    );
    assert!(raw.closed_within(T), "the frontend is still connected");
    assert_eq!(w.counter(A, "frontend_bad_memory"), 1);
    w.check_after("memfd shorter than its region");
}

#[test]
fn an_unsealed_memfd_is_refused_so_it_cannot_shrink_under_gsonet() {
    let mut w = world("");
    let unsealed = FrontendOpts {
        seal_memory: false,
        ..opts()
    };
    match honest(&w.d, A, unsealed) {
        Err(_) => {}
        Ok(a) => {
            // Accepted: shrink the memory under gsonet, and have B write into it.
            let region = a.memory().iter().next().unwrap();
            let file = region.file_offset().unwrap().file();
            file.set_len(0).unwrap();
            for _ in 0..5 {
                let (h, f) = frame(B, frames::BROADCAST);
                w.b.send(&h, &f, TxLayout::Single).unwrap();
            }
            std::thread::sleep(Duration::from_millis(500));
            assert!(w.d.alive(), "gsonet died: {:?}", w.d.exit_status());
            panic!("gsonet took an unsealed memfd");
        }
    }
    assert_eq!(w.counter(A, "frontend_unsealed_memory"), 1);
    w.check_after("unsealed memfd");
}

#[test]
fn unsealed_memory_is_taken_where_the_operator_allows_it() {
    let mut w = world("allow_unsealed_memory=on");
    let unsealed = FrontendOpts {
        seal_memory: false,
        ..opts()
    };
    let mut a = honest(&w.d, A, unsealed).expect("unsealed memory on an allowing port");
    exchange(&mut a, &mut w.b, A, B, 3);
    exchange(&mut w.b, &mut a, B, A, 3);
    // The size check still holds there.
    drop(a);
    let mut raw = Raw::connect(&w.d.sockets[A]);
    let mem = memfd(1 << 20, false).unwrap();
    let _ = map(&mut raw, &mem, 16 << 20);
    assert!(
        raw.closed_within(T),
        "a region past its file's end was taken"
    );
    assert_eq!(w.counter(A, "frontend_bad_memory"), 1);
    w.check_after("unsealed memory allowed");
}

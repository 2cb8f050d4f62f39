//! End to end through a `dev=` (AF_PACKET) uplink: a network namespace joined to the root
//! namespace by a veth pair; the root end is gsonet's uplink, the namespace end has an
//! address. The real gsonet binary serves one vhost-user port, driven by the in-process
//! test frontend. A raw AF_PACKET socket inside the namespace captures and injects frames.
//!
//! Needs root (network namespaces, veth, AF_PACKET); fails otherwise, unless
//! GSONET_ALLOW_SKIP=1.

mod common;

use std::fs::File;
use std::io;
use std::mem;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::frames::{self, Flow, Ips, UdpGso};
use common::frontend::{temp_socket_path, FrontendOpts, TestFrontend, TxLayout};
use etherparse::{NetSlice, SlicedPacket, TransportSlice};
use gsonet::testkit::frames::FrameSpec;
use gsonet::vnet_hdr::{GsoKind, GsoType, VirtioNetHdr};

const GUEST_MAC: [u8; 6] = [0x52, 0x54, 0x00, 0x12, 0x34, 0x56];
const PEER_MAC: [u8; 6] = [0x02, 0x00, 0x00, 0x77, 0x00, 0x02];
const GUEST_IP: [u8; 4] = [10, 77, 0, 1];
const PEER_IP: [u8; 4] = [10, 77, 0, 2];
const GUEST_PORT: u16 = 40000;
const PEER_PORT: u16 = 5001;
const MSS: u16 = 1460;
/// TCP payload of a maximal TSOv4 frame: IP total length 65535.
const MAX: usize = 65535 - 40;
/// TCP payload of the largest TSOv4 frame a device with the default gso_max_size
/// (65536) takes intact: the kernel segments any skb of 65536 bytes or more, and the
/// Ethernet header counts (`gso_features_check`). Linux guests stay below it.
const BIG: usize = 65535 - 54;
const MTU: usize = 1500;

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

fn ip(args: &[&str]) -> io::Result<()> {
    let out = Command::new("ip").args(args).output()?;
    if out.status.success() {
        Ok(())
    } else {
        Err(io::Error::other(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        )))
    }
}

/// A namespace and a veth pair: `host` in the root namespace, `peer` (10.77.0.2/24,
/// PEER_MAC) inside. Removed on drop.
struct Net {
    ns: String,
    host: String,
    peer: String,
}

impl Net {
    fn new(tag: &str) -> io::Result<Net> {
        let pid = std::process::id();
        let net = Net {
            ns: format!("gsonet-pkt-{pid}-{tag}"),
            host: format!("gp{pid}{tag}h"),
            peer: format!("gp{pid}{tag}p"),
        };
        let mac = fmt_mac(&PEER_MAC);
        let guest_mac = fmt_mac(&GUEST_MAC);
        ip(&["netns", "add", &net.ns])?;
        ip(&[
            "link", "add", &net.host, "type", "veth", "peer", "name", &net.peer, "netns", &net.ns,
        ])?;
        ip(&["link", "set", &net.host, "up"])?;
        let n = &net.ns;
        ip(&["-n", n, "link", "set", "lo", "up"])?;
        ip(&["-n", n, "link", "set", &net.peer, "address", &mac])?;
        ip(&["-n", n, "addr", "add", "10.77.0.2/24", "dev", &net.peer])?;
        ip(&["-n", n, "link", "set", &net.peer, "up"])?;
        // No ARP for the guest: the namespace's replies (RSTs) go straight to it.
        ip(&[
            "-n",
            n,
            "neigh",
            "add",
            "10.77.0.1",
            "lladdr",
            &guest_mac,
            "dev",
            &net.peer,
        ])?;
        Ok(net)
    }

    /// Runs `f` on a thread inside the namespace (sockets it opens stay there).
    fn within<T: Send>(&self, f: impl FnOnce() -> T + Send) -> T {
        let path = format!("/run/netns/{}", self.ns);
        std::thread::scope(|s| {
            s.spawn(|| {
                let ns = File::open(&path).expect("open netns");
                // SAFETY: setns on this thread only, with a namespace fd.
                let r = unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) };
                assert_eq!(r, 0, "setns: {}", io::Error::last_os_error());
                f()
            })
            .join()
            .expect("namespace thread")
        })
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        // Deleting either end removes the pair; the namespace goes with its name.
        let _ = ip(&["link", "del", &self.host]);
        let _ = ip(&["netns", "del", &self.ns]);
    }
}

fn fmt_mac(m: &[u8; 6]) -> String {
    m.iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

/// The gsonet binary, killed on drop; its log is printed if the test failed.
struct Daemon {
    child: Child,
    log: PathBuf,
    control: PathBuf,
    socket: PathBuf,
}

impl Daemon {
    fn start(tag: &str, uplink: &str) -> Daemon {
        Self::start_with(tag, "", uplink)
    }

    /// `port_extra`: more `--port` options, e.g. `",vlan=10"`.
    fn start_with(tag: &str, port_extra: &str, uplink: &str) -> Daemon {
        let socket = temp_socket_path(&format!("pkt-{tag}"));
        let control = temp_socket_path(&format!("pkt-ctl-{tag}"));
        let log = std::env::temp_dir().join(format!(
            "gsonet-e2e-packet-{}-{tag}.log",
            std::process::id()
        ));
        let child = Command::new(env!("CARGO_BIN_EXE_gsonet"))
            .args([
                "serve",
                "--port",
                &format!(
                    "socket={},mac={}{port_extra}",
                    socket.display(),
                    fmt_mac(&GUEST_MAC)
                ),
                "--uplink",
                uplink,
                "--control",
            ])
            .arg(&control)
            .env("RUST_LOG", "gsonet=debug")
            .stdout(Stdio::null())
            .stderr(File::create(&log).expect("log file"))
            .spawn()
            .expect("start gsonet");
        Daemon {
            child,
            log,
            control,
            socket,
        }
    }

    fn stats(&self) -> serde_json::Value {
        let out = Command::new(env!("CARGO_BIN_EXE_gsonet"))
            .args(["stats", "--json", "--control"])
            .arg(&self.control)
            .output()
            .expect("gsonet stats");
        serde_json::from_slice(&out.stdout).unwrap_or(serde_json::Value::Null)
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            eprintln!("---- gsonet log ----\n{}", self.log());
        }
        let _ = std::fs::remove_file(&self.log);
        common::daemon::remove_socket(&self.socket);
        let _ = std::fs::remove_file(&self.control);
    }
}

// ---------------------------------------------------------------------------------------
// A raw AF_PACKET socket with the legacy 10-byte vnet header, for the namespace side.

const SOL_PACKET: libc::c_int = 263;
const PACKET_VNET_HDR: libc::c_int = 15;
const PACKET_OUTGOING: u8 = 4;
const VNET10: usize = 10;

struct Raw {
    fd: OwnedFd,
}

impl Raw {
    fn open(ifname: &str) -> Raw {
        let c = std::ffi::CString::new(ifname).unwrap();
        // SAFETY: valid C string.
        let ifindex = unsafe { libc::if_nametoindex(c.as_ptr()) };
        assert!(ifindex != 0, "no interface {ifname}");
        let proto = (libc::ETH_P_ALL as u16).to_be() as libc::c_int;
        // SAFETY: plain socket() call.
        let fd =
            unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_RAW | libc::SOCK_CLOEXEC, proto) };
        assert!(fd >= 0, "socket: {}", io::Error::last_os_error());
        // SAFETY: fresh fd we own.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let one: libc::c_int = 1;
        set(fd.as_raw_fd(), SOL_PACKET, PACKET_VNET_HDR, &one);
        let big: libc::c_int = 8 << 20;
        set(fd.as_raw_fd(), libc::SOL_SOCKET, libc::SO_RCVBUFFORCE, &big);
        let tv = libc::timeval {
            tv_sec: 0,
            tv_usec: 200_000,
        };
        set(fd.as_raw_fd(), libc::SOL_SOCKET, libc::SO_RCVTIMEO, &tv);
        // SAFETY: zeroed sockaddr_ll is valid.
        let mut sll: libc::sockaddr_ll = unsafe { mem::zeroed() };
        sll.sll_family = libc::AF_PACKET as u16;
        sll.sll_protocol = (libc::ETH_P_ALL as u16).to_be();
        sll.sll_ifindex = ifindex as i32;
        // SAFETY: sockaddr_ll of the size passed.
        let r = unsafe {
            libc::bind(
                fd.as_raw_fd(),
                &sll as *const _ as *const libc::sockaddr,
                mem::size_of::<libc::sockaddr_ll>() as u32,
            )
        };
        assert_eq!(r, 0, "bind: {}", io::Error::last_os_error());
        Raw { fd }
    }

    /// Receives one incoming frame: (vnet header, frame). None after the timeout.
    fn recv(&self) -> Option<(VirtioNetHdr, Vec<u8>)> {
        let mut buf = vec![0u8; VNET10 + 70_000];
        loop {
            // SAFETY: zeroed sockaddr_ll is valid.
            let mut sll: libc::sockaddr_ll = unsafe { mem::zeroed() };
            let mut len = mem::size_of::<libc::sockaddr_ll>() as u32;
            // SAFETY: buffers of the lengths given.
            let n = unsafe {
                libc::recvfrom(
                    self.fd.as_raw_fd(),
                    buf.as_mut_ptr() as *mut libc::c_void,
                    buf.len(),
                    0,
                    &mut sll as *mut _ as *mut libc::sockaddr,
                    &mut len,
                )
            };
            if n < 0 {
                return None;
            }
            if sll.sll_pkttype == PACKET_OUTGOING {
                continue;
            }
            let n = n as usize;
            let mut h = [0u8; 12];
            h[..VNET10].copy_from_slice(&buf[..VNET10]);
            let hdr = common::wire_hdr::decode(&h).expect("kernel vnet header");
            return Some((hdr, buf[VNET10..n].to_vec()));
        }
    }

    fn send(&self, hdr: &VirtioNetHdr, frame: &[u8]) {
        let hb = common::wire_hdr::encode(hdr);
        let iov = [
            libc::iovec {
                iov_base: hb.as_ptr() as *mut libc::c_void,
                iov_len: VNET10,
            },
            libc::iovec {
                iov_base: frame.as_ptr() as *mut libc::c_void,
                iov_len: frame.len(),
            },
        ];
        // SAFETY: iovecs point into live buffers.
        let n = unsafe { libc::writev(self.fd.as_raw_fd(), iov.as_ptr(), 2) };
        assert_eq!(
            n as usize,
            VNET10 + frame.len(),
            "send: {}",
            io::Error::last_os_error()
        );
    }
}

fn set<T>(fd: RawFd, level: libc::c_int, opt: libc::c_int, v: &T) {
    // SAFETY: v is live and of the size passed.
    let r = unsafe {
        libc::setsockopt(
            fd,
            level,
            opt,
            v as *const T as *const libc::c_void,
            mem::size_of::<T>() as u32,
        )
    };
    assert_eq!(r, 0, "setsockopt {opt}: {}", io::Error::last_os_error());
}

// ---------------------------------------------------------------------------------------
// Frames

/// An Ethernet + IPv4 + TCP frame (no options) with a partial (pseudo-header)
/// checksum, as a guest with TSO hands it over, and its vnet header (TSOv4 when `data`
/// exceeds MSS).
#[allow(clippy::too_many_arguments)]
fn tcp4_frame(
    dst_mac: [u8; 6],
    src_mac: [u8; 6],
    src: [u8; 4],
    dst: [u8; 4],
    sport: u16,
    dport: u16,
    seq: u32,
    data: &[u8],
) -> (VirtioNetHdr, Vec<u8>) {
    let flow = Flow::new(src_mac, dst_mac, Ips::V4(src, dst)).ports(sport, dport);
    let spec = FrameSpec {
        seq,
        tcp_flags: frames::ACK | frames::PSH,
        ..flow.spec(true, data)
    };
    let (mut hdr, f) = frames::build_with(&spec, Some((GsoKind::TcpV4, MSS)));
    if data.len() <= MSS as usize {
        hdr.gso = GsoType::NONE;
        hdr.gso_size = 0;
    }
    hdr.num_buffers = 0;
    (hdr, f)
}

/// A plain UDP frame from PEER_PORT to GUEST_PORT with a full checksum.
fn udp4_frame(
    dst_mac: [u8; 6],
    src_mac: [u8; 6],
    src: [u8; 4],
    dst: [u8; 4],
    data: &[u8],
) -> Vec<u8> {
    let flow = Flow::new(src_mac, dst_mac, Ips::V4(src, dst)).ports(PEER_PORT, GUEST_PORT);
    frames::udp(&flow, data, UdpGso::None).1
}

/// Checks the L4 checksum of an IPv4 frame, completing it first when the header says
/// it is partial (NEEDS_CSUM): then the stored value must be the pseudo-header sum.
fn check_tcp4_csum(hdr: &VirtioNetHdr, frame: &[u8]) -> Result<(), String> {
    let mut f = frame.to_vec();
    frames::finish_if_partial(hdr, &mut f).map_err(|e| e.to_string())?;
    let ihl = (f[14] & 0x0f) as usize * 4;
    let src: [u8; 4] = f[26..30].try_into().unwrap();
    let dst: [u8; 4] = f[30..34].try_into().unwrap();
    let tot = u16::from_be_bytes([f[16], f[17]]) as usize;
    let l4 = &f[14 + ihl..14 + tot];
    let pseudo = frames::pseudo_sum(&Ips::V4(src, dst), 6, l4.len());
    let s = frames::fold(frames::sum16(l4, pseudo));
    if s != 0xffff {
        return Err(format!("bad TCP checksum (sum {s:#06x})"));
    }
    if frames::fold(frames::sum16(&f[14..14 + ihl], 0)) != 0xffff {
        return Err("bad IPv4 header checksum".into());
    }
    Ok(())
}

/// (src ip, dst ip, sport, dport, seq, payload) of an IPv4/TCP frame.
type Tcp = ([u8; 4], [u8; 4], u16, u16, u32, Vec<u8>);

fn parse_tcp4(frame: &[u8]) -> Option<Tcp> {
    let p = SlicedPacket::from_ethernet(frame).ok()?;
    let Some(NetSlice::Ipv4(ip)) = &p.net else {
        return None;
    };
    let Some(TransportSlice::Tcp(t)) = &p.transport else {
        return None;
    };
    Some((
        ip.header().source(),
        ip.header().destination(),
        t.source_port(),
        t.destination_port(),
        t.sequence_number(),
        t.payload().to_vec(),
    ))
}

/// Frames of the guest's connection seen in the namespace, until the payload is
/// complete or `timeout` passes: (header, frame) each.
fn capture_flow(
    raw: &Raw,
    seq0: u32,
    expect: usize,
    timeout: Duration,
) -> Vec<(VirtioNetHdr, Vec<u8>)> {
    let deadline = Instant::now() + timeout;
    let mut got = Vec::new();
    let mut bytes = 0;
    while Instant::now() < deadline && bytes < expect {
        let Some((h, f)) = raw.recv() else { continue };
        if let Some((src, _, sport, dport, seq, data)) = parse_tcp4(&f) {
            let off = seq.wrapping_sub(seq0) as usize;
            if src == GUEST_IP && sport == GUEST_PORT && dport == PEER_PORT && off < expect {
                bytes += data.len();
                got.push((h, f));
            }
        }
    }
    got
}

/// Reassembles the TCP payload of `frames` by sequence number.
fn reassemble(frames: &[(VirtioNetHdr, Vec<u8>)], seq0: u32) -> Vec<u8> {
    let mut segs: Vec<(u32, Vec<u8>)> = frames
        .iter()
        .filter_map(|(_, f)| parse_tcp4(f).map(|t| (t.4.wrapping_sub(seq0), t.5)))
        .collect();
    segs.sort_by_key(|s| s.0);
    segs.dedup_by_key(|s| s.0);
    let mut out = Vec::new();
    for (off, d) in segs {
        assert_eq!(off as usize, out.len(), "gap or overlap in the TCP stream");
        out.extend_from_slice(&d);
    }
    out
}

fn frontend(d: &Daemon) -> TestFrontend {
    let mut fe = TestFrontend::connect(&d.socket, FrontendOpts::default()).expect("connect");
    fe.post_rx(128, 4096).expect("post rx");
    fe
}

fn uplink_stats(d: &Daemon) -> serde_json::Value {
    d.stats()["uplinks"][0]["stats"].clone()
}

/// Sends a TSOv4 frame with `len` bytes of payload from the guest to the namespace,
/// checks that its payload arrives exactly, and returns the frames the namespace saw.
fn guest_to_ns(
    net: &Net,
    d: &Daemon,
    fe: &mut TestFrontend,
    len: usize,
    seq0: u32,
) -> Vec<(VirtioNetHdr, Vec<u8>)> {
    let raw = net.within(|| Raw::open(&net.peer));
    let data = frames::payload(len, seq0);
    let (hdr, frame) = tcp4_frame(
        PEER_MAC, GUEST_MAC, GUEST_IP, PEER_IP, GUEST_PORT, PEER_PORT, seq0, &data,
    );
    fe.send(&hdr, &frame, TxLayout::Single).expect("send");
    fe.wait_tx_done(Duration::from_secs(5)).expect("tx done");
    let got = capture_flow(&raw, seq0, len, Duration::from_secs(5));
    eprintln!(
        "{len}-byte payload: namespace saw {} frame(s): {:?}; uplink stats {}",
        got.len(),
        got.iter()
            .map(|(h, f)| (f.len(), h.gso.kind, h.gso_size, h.needs_csum()))
            .take(4)
            .collect::<Vec<_>>(),
        uplink_stats(d)
    );
    let stream = reassemble(&got, seq0);
    assert_eq!(stream.len(), data.len(), "reassembled payload length");
    assert!(stream == data, "reassembled payload differs");
    got
}

#[test]
fn dev_uplink_passes_gso_both_ways() {
    if !gsonet::testkit::can_run(is_root(), "root (netns, veth, AF_PACKET)") {
        return;
    }
    let net = Net::new("a").expect("namespace and veth");
    let d = Daemon::start("a", &format!("dev={},gso=pass", net.host));
    let mut fe = frontend(&d);

    // Guest -> namespace: a 64 KiB TSOv4 frame, handed to the veth intact.
    let got = guest_to_ns(&net, &d, &mut fe, BIG, 1_000_000);
    for (h, f) in &got {
        check_tcp4_csum(h, f).unwrap_or_else(|e| panic!("frame of {} bytes: {e}", f.len()));
    }
    let largest = got.iter().map(|(_, f)| f.len()).max().unwrap_or(0);
    assert!(
        largest > 14 + MTU,
        "gso=pass: expected the frame to cross intact, largest was {largest}"
    );
    let st = uplink_stats(&d);
    assert_eq!(st["gso_passed"], 1, "uplink stats: {st}");
    assert_eq!(st["gso_segmented"], 0, "uplink stats: {st}");

    // A maximal one (IP total length 65535) leaves gsonet intact too; the kernel then
    // segments it because it reaches the device's gso_max_size. Either way the payload
    // arrives exactly.
    let got = guest_to_ns(&net, &d, &mut fe, MAX, 2_000_000);
    for (h, f) in &got {
        check_tcp4_csum(h, f).unwrap_or_else(|e| panic!("frame of {} bytes: {e}", f.len()));
    }
    assert_eq!(uplink_stats(&d)["gso_passed"], 2);

    // Namespace -> guest: a plain UDP frame...
    let raw = net.within(|| Raw::open(&net.peer));
    let msg = b"hello from the namespace".to_vec();
    let udp = udp4_frame(GUEST_MAC, PEER_MAC, PEER_IP, GUEST_IP, &msg);
    raw.send(&VirtioNetHdr::default(), &udp);
    let (_, f) = recv_matching(&mut fe, |f| f == udp.as_slice())
        .expect("the UDP frame from the namespace reaches the guest");
    assert_eq!(f, udp);

    // ...and a 64 KiB TSOv4 frame, which keeps its GSO metadata on the way in.
    let data = frames::payload(BIG, 11);
    let (hdr, frame) = tcp4_frame(
        GUEST_MAC, PEER_MAC, PEER_IP, GUEST_IP, PEER_PORT, GUEST_PORT, 5, &data,
    );
    raw.send(&hdr, &frame);
    let (h, f) = recv_matching(&mut fe, |f| {
        matches!(
            parse_tcp4(f),
            Some((PEER_IP, GUEST_IP, PEER_PORT, GUEST_PORT, 5, _))
        )
    })
    .expect("the TSO frame from the namespace reaches the guest");
    eprintln!(
        "guest got {} bytes, gso {:?} size {} flags {:#x} csum {}+{}",
        f.len(),
        h.gso,
        h.gso_size,
        h.flags,
        h.csum_start,
        h.csum_offset
    );
    assert_eq!(f.len(), frame.len(), "arrives as one frame");
    assert_eq!(h.gso.kind, GsoKind::TcpV4);
    assert_eq!(h.gso_size, MSS);
    check_tcp4_csum(&h, &f).unwrap();
    assert_eq!(parse_tcp4(&f).unwrap().5, data);
    eprintln!("final stats: {}", d.stats());
}

/// Frames at the guest until one satisfies `want` (others — RSTs, neighbour
/// discovery — are skipped).
fn recv_matching(
    fe: &mut TestFrontend,
    want: impl Fn(&[u8]) -> bool,
) -> Option<(VirtioNetHdr, Vec<u8>)> {
    let deadline = Instant::now() + Duration::from_secs(5);
    while Instant::now() < deadline {
        if let Some((h, f)) = fe.recv(Duration::from_millis(200)) {
            if want(&f) {
                return Some((h, f));
            }
        }
    }
    None
}

#[test]
fn dev_uplink_software_gso_fits_the_mtu() {
    if !gsonet::testkit::can_run(is_root(), "root (netns, veth, AF_PACKET)") {
        return;
    }
    let net = Net::new("b").expect("namespace and veth");
    let d = Daemon::start("b", &format!("dev={},gso=software", net.host));
    let mut fe = frontend(&d);
    let got = guest_to_ns(&net, &d, &mut fe, BIG, 1_000_000);
    for (h, f) in &got {
        assert!(f.len() <= 14 + MTU, "segment of {} bytes", f.len());
        assert!(!h.gso.is_gso(), "segment still carries GSO {:?}", h.gso);
        check_tcp4_csum(h, f).unwrap_or_else(|e| panic!("segment of {} bytes: {e}", f.len()));
    }
    assert_eq!(got.len(), BIG.div_ceil(MSS as usize));
    let st = uplink_stats(&d);
    assert_eq!(st["gso_segmented"], 1, "uplink stats: {st}");
    assert_eq!(st["gso_passed"], 0, "uplink stats: {st}");
}

#[test]
fn dev_uplink_with_fanout_and_qdisc_bypass() {
    if !gsonet::testkit::can_run(is_root(), "root (netns, veth, AF_PACKET)") {
        return;
    }
    let net = Net::new("c").expect("namespace and veth");
    let d = Daemon::start("c", &format!("dev={},queues=2,bypass=on", net.host));
    let mut fe = frontend(&d);
    let got = guest_to_ns(&net, &d, &mut fe, BIG, 3_000_000);
    assert_eq!(got.len(), 1, "intact through the bypassed qdisc");
    // Each frame from the namespace reaches the guest once, whichever socket of the
    // fanout group reads it.
    let raw = net.within(|| Raw::open(&net.peer));
    for i in 0..20u8 {
        let udp = udp4_frame(GUEST_MAC, PEER_MAC, PEER_IP, GUEST_IP, &[i; 100]);
        raw.send(&VirtioNetHdr::default(), &udp);
    }
    let mut seen = vec![0; 20];
    while let Some((_, f)) = fe.recv(Duration::from_millis(500)) {
        if f.len() == 14 + 28 + 100 && f[12..14] == [0x08, 0x00] && f[23] == 17 {
            seen[f[42] as usize] += 1;
        }
    }
    assert_eq!(seen, vec![1; 20], "frames per payload byte");
}

/// The kernel takes VLAN tags off frames before an AF_PACKET socket sees them; the
/// uplink must put them back, or tagged traffic would land in the untagged domain.
#[test]
fn dev_uplink_keeps_vlan_tags_for_access_ports() {
    if !gsonet::testkit::can_run(is_root(), "root (netns, veth, AF_PACKET)") {
        return;
    }
    let net = Net::new("v").expect("netns + veth");
    let d = Daemon::start_with("v", ",vlan=10", &format!("dev={}", net.host));
    let mut fe = frontend(&d);
    let raw = net.within(|| Raw::open(&net.peer));
    let tagged = |vid: u16, data: &[u8]| {
        let plain = udp4_frame(GUEST_MAC, PEER_MAC, PEER_IP, GUEST_IP, data);
        let mut f = plain[..12].to_vec();
        f.extend_from_slice(&[0x81, 0x00]);
        f.extend_from_slice(&vid.to_be_bytes());
        f.extend_from_slice(&plain[12..]);
        (plain, f)
    };
    let (plain10, f10) = tagged(10, b"for vlan ten");
    let (_, f20) = tagged(20, b"for vlan twenty");
    let untagged = udp4_frame(GUEST_MAC, PEER_MAC, PEER_IP, GUEST_IP, b"untagged");
    let none = VirtioNetHdr::default();
    raw.send(&none, &f20);
    raw.send(&none, &untagged);
    raw.send(&none, &f10);
    // Only the VLAN-10 frame reaches the access port, and without its tag; nothing
    // from the untagged domain or VLAN 20 does.
    let mut got = Vec::new();
    let deadline = Instant::now() + Duration::from_millis(1500);
    while Instant::now() < deadline {
        if let Some((_, f)) = fe.recv(Duration::from_millis(100)) {
            got.push(f);
        }
    }
    assert_eq!(got, vec![plain10], "{}", d.log());
}

#[test]
fn dev_uplink_errors_are_clear() {
    let out = Command::new(env!("CARGO_BIN_EXE_gsonet"))
        .args([
            "serve",
            "--port",
            &format!("socket={}", temp_socket_path("pkt-err").display()),
            "--uplink",
            "dev=gsonet-none9",
            "--control",
        ])
        .arg(temp_socket_path("pkt-err-ctl"))
        .output()
        .expect("run gsonet");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("no interface gsonet-none9"),
        "unexpected error: {err}"
    );
    // Without root: says so. (`setpriv` drops to nobody when we are root.)
    if is_root() && Command::new("setpriv").arg("--help").output().is_ok() {
        let out = Command::new("setpriv")
            .args(["--reuid=65534", "--regid=65534", "--clear-groups"])
            .arg(env!("CARGO_BIN_EXE_gsonet"))
            .args([
                "serve",
                "--port",
                &format!("socket={}", temp_socket_path("pkt-nr").display()),
                "--uplink",
                "dev=lo",
                "--control",
            ])
            .arg(temp_socket_path("pkt-nr-ctl"))
            .output()
            .expect("run gsonet as nobody");
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("needs root"), "unexpected error: {err}");
    }
}

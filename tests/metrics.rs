//! The Prometheus endpoint of a real `gsonet serve`: scraped over TCP and read with an
//! independent parser (prometheus-parse), its counters must be `gsonet stats`'s; the
//! HTTP side answers only what it should and stays bounded. No root needed.

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::process::Command;
use std::time::{Duration, Instant};

use common::daemon::{bin, port_counter, Daemon, DaemonSpec, TempSocket};
use common::frames::{self, Flow, Ips, UdpGso};
use common::frontend::{feat, FrontendOpts, TestFrontend, TxLayout};
use common::rx::recv_where;
use gsonet::stats::DropReason;
use prometheus_parse::{Scrape, Value};

const T: Duration = Duration::from_secs(5);

/// A loopback address with a port free a moment ago.
fn free_addr() -> SocketAddr {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
}

/// One HTTP exchange: what was sent, everything answered until the server closed.
fn http(addr: SocketAddr, request: &[u8]) -> String {
    try_http(addr, request).unwrap()
}

/// `http`, an error where the server reset the connection (it turned the request
/// away unread, say).
fn try_http(addr: SocketAddr, request: &[u8]) -> std::io::Result<String> {
    let mut s = TcpStream::connect(addr)?;
    s.set_read_timeout(Some(T))?;
    s.write_all(request)?;
    let mut out = String::new();
    s.read_to_string(&mut out)?;
    Ok(out)
}

fn scrape(addr: SocketAddr) -> (String, Scrape) {
    let answer = http(addr, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
    let (head, body) = answer.split_once("\r\n\r\n").expect("an HTTP answer");
    assert!(head.starts_with("HTTP/1.1 200 "), "{head}");
    assert!(
        head.contains("Content-Type: text/plain; version=0.0.4"),
        "{head}"
    );
    let lines = body.lines().map(|l| Ok(l.to_string()));
    (body.to_string(), Scrape::parse(lines).expect("parses"))
}

/// The value of the one sample of `metric` whose labels include `labels`.
fn value(s: &Scrape, metric: &str, labels: &[(&str, &str)]) -> f64 {
    let found: Vec<_> = s
        .samples
        .iter()
        .filter(|x| x.metric == metric && labels.iter().all(|(k, v)| x.labels.get(k) == Some(v)))
        .collect();
    assert_eq!(found.len(), 1, "{metric} {labels:?}: {found:?}");
    match found[0].value {
        Value::Counter(v) => {
            assert!(metric.ends_with("_total"), "{metric} is a counter");
            v
        }
        Value::Gauge(v) => {
            assert!(!metric.ends_with("_total"), "{metric} is a gauge");
            v
        }
        ref other => panic!("{metric}: {other:?}"),
    }
}

fn connect(d: &Daemon, port: usize) -> TestFrontend {
    let opts = FrontendOpts {
        features: feat::RINGS | feat::HOST_ALL | feat::GUEST_CSUM | feat::GUEST_GSO,
        require_features: true,
        mem_size: 64 << 20,
        ..Default::default()
    };
    let mut fe = TestFrontend::connect(&d.sockets[port], opts).expect("frontend");
    fe.post_rx(64, 2048).expect("post rx");
    fe
}

#[test]
fn scraped_counters_are_the_stats_counters() {
    let addr = free_addr();
    let a = addr.to_string();
    let d = Daemon::start_with(&DaemonSpec::ports(3), &["--metrics", &a]).expect("gsonet");
    let mut p0 = connect(&d, 0);
    let mut p1 = connect(&d, 1);
    // Frames from port 0 to everyone reach port 1.
    for i in 0..5u8 {
        let flow = Flow::new(frames::mac(0xa), frames::BROADCAST, Ips::v4()).ports(68, 67);
        let (h, f) = frames::udp(&flow, &[i; 100], UdpGso::None);
        p0.send(&h, &f, TxLayout::Single).unwrap();
        recv_where(&mut p1, T, |x| x.frame == f).expect("the frame at port 1");
    }
    let stats = d.stats().unwrap();
    let (text, s) = scrape(addr);

    for (port, sock) in d.sockets.iter().enumerate() {
        let id = port.to_string();
        let name = sock.to_str().unwrap();
        let l = [("kind", "port"), ("id", id.as_str()), ("name", name)];
        for (metric, counter) in [
            ("gsonet_tx_frames_total", "tx_frames"),
            ("gsonet_tx_bytes_total", "tx_bytes"),
            ("gsonet_rx_frames_total", "rx_frames"),
            ("gsonet_rx_bytes_total", "rx_bytes"),
            ("gsonet_gso_passed_frames_total", "gso_passed"),
            ("gsonet_csum_completed_frames_total", "csum_completed"),
        ] {
            let want = port_counter(&stats, port, counter) as f64;
            assert_eq!(value(&s, metric, &l), want, "{metric} of port {port}");
        }
        let connected = if port < 2 { 1.0 } else { 0.0 };
        assert_eq!(value(&s, "gsonet_port_connected", &l), connected);
        // Every drop reason of every endpoint is there from the start, at 0 here.
        for r in DropReason::ALL {
            let mut l = l.to_vec();
            l.push(("reason", r.name()));
            assert_eq!(value(&s, "gsonet_drops_total", &l), 0.0, "{}", r.name());
        }
    }
    assert_eq!(
        value(
            &s,
            "gsonet_tx_frames_total",
            &[("kind", "port"), ("id", "0")]
        ),
        5.0
    );
    assert!(
        value(
            &s,
            "gsonet_rx_bytes_total",
            &[("kind", "port"), ("id", "1")]
        ) >= 500.0
    );
    // The negotiated offloads, as labels of an info gauge.
    let info = value(&s, "gsonet_port_features_info", &[("id", "0")]);
    assert_eq!(info, 1.0);
    let rx = s
        .samples
        .iter()
        .find(|x| x.metric == "gsonet_port_features_info" && x.labels.get("id") == Some("0"))
        .and_then(|x| x.labels.get("guest_rx"))
        .unwrap();
    assert!(
        rx.contains("csum") && rx.contains("tso4"),
        "{rx} {:#}",
        stats["ports"][0]
    );
    // The unconnected port has no features to show.
    let unconnected = s
        .samples
        .iter()
        .filter(|x| x.metric == "gsonet_port_features_info" && x.labels.get("id") == Some("2"));
    assert_eq!(unconnected.count(), 0);
    // Every family has its HELP and TYPE.
    for sample in &s.samples {
        assert!(
            s.docs.contains_key(&sample.metric),
            "{} has no HELP",
            sample.metric
        );
        assert!(
            text.contains(&format!("# TYPE {} ", sample.metric)),
            "{} has no TYPE",
            sample.metric
        );
    }

    // Counters only go up between scrapes: five more frames, five more counted.
    for i in 0..5u8 {
        let flow = Flow::new(frames::mac(0xa), frames::BROADCAST, Ips::v4()).ports(68, 67);
        let (h, f) = frames::udp(&flow, &[i; 60], UdpGso::None);
        p0.send(&h, &f, TxLayout::Single).unwrap();
        recv_where(&mut p1, T, |x| x.frame == f).expect("the frame at port 1");
    }
    let (_, s) = scrape(addr);
    assert_eq!(
        value(
            &s,
            "gsonet_tx_frames_total",
            &[("kind", "port"), ("id", "0")]
        ),
        10.0
    );
}

#[test]
fn the_http_side_answers_only_metrics_and_stays_bounded() {
    let addr = free_addr();
    let a = addr.to_string();
    let _d = Daemon::start_with(&DaemonSpec::ports(1), &["--metrics", &a]).expect("gsonet");
    assert!(http(addr, b"GET / HTTP/1.1\r\n\r\n").starts_with("HTTP/1.1 404 "));
    assert!(http(addr, b"POST /metrics HTTP/1.1\r\n\r\n").starts_with("HTTP/1.1 405 "));
    assert!(http(addr, b"nonsense\r\n\r\n").starts_with("HTTP/1.1 400 "));
    let head = http(addr, b"HEAD /metrics HTTP/1.0\r\n\r\n");
    assert!(
        head.starts_with("HTTP/1.1 200 ") && head.ends_with("\r\n\r\n"),
        "{head}"
    );
    // A request head that never ends is cut at 8 KiB.
    let mut big = b"GET /metrics HTTP/1.1\r\nX: ".to_vec();
    big.resize(20_000, b'a');
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(T)).unwrap();
    let _ = s.write_all(&big);
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    assert!(
        out.starts_with(b"HTTP/1.1 431 "),
        "{}",
        String::from_utf8_lossy(&out)
    );

    // Eight silent connections hold every slot: the ninth is turned away at once
    // (it sends nothing, so that the server closes without unread bytes).
    let idle: Vec<TcpStream> = (0..8).map(|_| TcpStream::connect(addr).unwrap()).collect();
    assert!(http(addr, b"").starts_with("HTTP/1.1 503 "));
    drop(idle);
    // Their slots come back as the server sees them close.
    let deadline = Instant::now() + T;
    loop {
        // Turned away while no slot is free: a 503, or a reset when the server
        // closes before it read the request.
        let answer =
            try_http(addr, b"GET /metrics HTTP/1.1\r\n\r\n").unwrap_or_else(|e| format!("{e}"));
        if answer.starts_with("HTTP/1.1 200 ") {
            break;
        }
        assert!(Instant::now() < deadline, "slots not given back: {answer}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_bad_or_busy_metrics_address_is_refused() {
    let out = Command::new(bin())
        .args(["serve", "--port", "socket=/tmp/gsonet-metrics-never.sock"])
        .args(["--metrics", "localhost"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("ADDR:PORT"), "{err}");

    let taken = TcpListener::bind("127.0.0.1:0").unwrap();
    let a = taken.local_addr().unwrap().to_string();
    let sock = TempSocket::new("metrics");
    let ctl = TempSocket::new("metrics-ctl");
    let out = Command::new(bin())
        .arg("serve")
        .arg("--port")
        .arg(format!("socket={}", sock.display()))
        .arg("--control")
        .arg(ctl.as_ref())
        .args(["--metrics", &a])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains(&format!("metrics address {a}")), "{err}");
    // Start-up failed: the sockets it had bound are gone again.
    assert!(!sock.exists() && !ctl.exists());
}

/// Port ids in the scrape (from the `id` label of `gsonet_tx_frames_total`).
fn scraped_ports(s: &Scrape) -> Vec<String> {
    let mut ids: Vec<String> = s
        .samples
        .iter()
        .filter(|x| x.metric == "gsonet_tx_frames_total" && x.labels.get("kind") == Some("port"))
        .filter_map(|x| x.labels.get("id").map(str::to_string))
        .collect();
    ids.sort();
    ids
}

#[test]
fn metrics_follow_ports_added_and_removed() {
    let addr = free_addr();
    let a = addr.to_string();
    let d = Daemon::start_with(&DaemonSpec::ports(1), &["--metrics", &a]).expect("gsonet");
    assert_eq!(scraped_ports(&scrape(addr).1), vec!["0"]);
    let sock = TempSocket::new("m");
    let ctl = |args: &[&str]| {
        let st = Command::new(bin())
            .arg("ctl")
            .arg("--control")
            .arg(&d.control)
            .args(args)
            .output()
            .unwrap();
        assert!(
            st.status.success(),
            "{}",
            String::from_utf8_lossy(&st.stderr)
        );
    };
    ctl(&["port", "add", &format!("socket={}", sock.display())]);
    let (_, s) = scrape(addr);
    assert_eq!(scraped_ports(&s), vec!["0", "1"]);
    let name = sock.display().to_string();
    assert_eq!(
        value(
            &s,
            "gsonet_tx_frames_total",
            &[("kind", "port"), ("id", "1"), ("name", &name)]
        ),
        0.0
    );
    ctl(&["port", "del", "0"]);
    assert_eq!(scraped_ports(&scrape(addr).1), vec!["1"]);
    let stats = d.stats().unwrap();
    assert_eq!(stats["ports"].as_array().unwrap().len(), 1);
    assert_eq!(stats["ports"][0]["id"], 1);
    ctl(&["port", "del", "1"]);
}

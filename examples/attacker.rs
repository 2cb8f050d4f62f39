//! A hostile vhost-user frontend for the noisy-neighbour benchmark (scripts/noisy.py):
//! it connects to one gsonet port socket and runs one attack of issue 9 until killed,
//! while honest guests on other ports are measured. Not part of gsonet.
//!
//! ```text
//! cargo build --release --example attacker
//! target/release/examples/attacker --attack rx-indirect --socket S2 --sink S3
//! ```
//!
//! `idle` is the control: connected, 256 RX buffers posted, nothing else.
//!
//! Attacks (`--sink` is a second port the attacker also controls: a peer that takes no
//! GSO, reads everything and, for the RX attacks, broadcasts `--broadcasts` ARP
//! requests a second so that every port's RX path is exercised):
//! - `rx-indirect`: RX ring of 1,024 chains, each an indirect table of 16,384 empty
//!   writable descriptors (INDIRECT_DESC acked); `rx-indirect-noneg` the same without
//!   INDIRECT_DESC; `rx-tiny`: 1,024 one-byte RX buffers. Re-armed (reconnect and
//!   post again) every `--rearm` seconds.
//! - `avail-jump`: the TX avail index 5,000 ahead, kicked every millisecond.
//! - `gso1`: 64 KB TSO frames with gso_size 1 to the sink (which did not ack
//!   GUEST_TSO, so gsonet would segment), `--rate` frames a second.
//! - `mac-flood`: 64-byte frames to the sink from a new source MAC each, `--rate` a
//!   second (fills the MAC table).
//! - `reset-loop`: SET_FEATURES (a device reset to gsonet) and a malformed TX chain,
//!   `--rate` times a second.
//! - `mem-storm`: a running device (RX buffers posted) whose frontend adds a 64 MiB
//!   memory region (ADD_MEM_REG, a new sealed memfd each time) and removes it again
//!   (REM_MEM_REG) as fast as gsonet acknowledges them, or `--rate` changes a second.

#[path = "../tests/common/frames.rs"]
mod frames;
#[path = "../tests/common/frontend.rs"]
mod frontend;
#[path = "../tests/common/wire_hdr.rs"]
mod wire_hdr;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use clap::{Parser, ValueEnum};
use frames::{Flow, Ips, Mac, UdpGso};
use frontend::{feat, BadTx, FrontendOpts, RawDesc, TestFrontend, TxLayout, RX_QUEUE, TX_QUEUE};
use gsonet::vnet_hdr::VirtioNetHdr;
use vhost::VhostBackend;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Attack {
    Idle,
    RxIndirect,
    RxIndirectNoneg,
    RxTiny,
    AvailJump,
    Gso1,
    MacFlood,
    ResetLoop,
    MemStorm,
}

#[derive(Parser, Debug)]
#[command(about = "A hostile vhost-user frontend: runs one attack on a gsonet port until killed")]
struct Args {
    #[arg(long, value_enum)]
    attack: Attack,
    /// The attacker's port socket.
    #[arg(long)]
    socket: PathBuf,
    /// A second port socket: the attacker's peer (needed by rx-*, gso1, mac-flood).
    #[arg(long)]
    sink: Option<PathBuf>,
    /// Frames (gso1, mac-flood), resets (reset-loop) or memory changes (mem-storm) a
    /// second; mem-storm's default is as fast as gsonet acknowledges.
    #[arg(long)]
    rate: Option<f64>,
    /// ARP broadcasts a second from the sink during the RX attacks.
    #[arg(long, default_value_t = 100.0)]
    broadcasts: f64,
    /// RX attacks: reconnect and post the bait again this often (seconds).
    #[arg(long, default_value_t = 2.0)]
    rearm: f64,
    /// Stop after this many seconds (default: run until killed).
    #[arg(long)]
    seconds: Option<f64>,
}

/// What an honest Linux guest acks.
const HONEST: u64 = feat::LINUX_DEFAULT;
/// A peer that takes no GSO: GSO frames for it are segmented in software.
const NO_GUEST_GSO: u64 = feat::RINGS | feat::CSUM;
const RX_QUEUE_SIZE: u16 = 1024;
const TABLE_ENTRIES: u16 = 16384;

fn attacker_mac() -> Mac {
    [0x02, 0xa7, 0x7a, 0xc0, 0x00, 0x01]
}
fn sink_mac() -> Mac {
    [0x02, 0xa7, 0x7a, 0xc0, 0x00, 0x02]
}

fn connect(socket: &PathBuf, features: u64, queue_size: u16) -> Result<TestFrontend> {
    let opts = FrontendOpts {
        features,
        queue_size,
        mem_size: 128 << 20,
        connect_timeout: Duration::from_secs(10),
        ..Default::default()
    };
    TestFrontend::connect(socket, opts).with_context(|| format!("connect {}", socket.display()))
}

/// An ARP request from `src` for 192.0.2.`target` (broadcast).
fn arp(src: Mac, target: u8) -> Vec<u8> {
    let mut f = Vec::with_capacity(42);
    f.extend_from_slice(&frames::BROADCAST);
    f.extend_from_slice(&src);
    f.extend_from_slice(&[0x08, 0x06, 0, 1, 0x08, 0x00, 6, 4, 0, 1]);
    f.extend_from_slice(&src);
    f.extend_from_slice(&[192, 0, 2, 1]);
    f.extend_from_slice(&[0; 6]);
    f.extend_from_slice(&[192, 0, 2, target]);
    f
}

/// Sends a frame, tolerating a TX queue the daemon is slow to complete.
fn send(fe: &mut TestFrontend, hdr: &VirtioNetHdr, f: &[u8], layout: TxLayout) {
    let _ = fe.reclaim_tx();
    let _ = fe.send(hdr, f, layout);
}

/// Sleeps until `n` events at `rate` a second have been due since `start`.
fn pace(start: Instant, n: u64, rate: f64) {
    let due = start + Duration::from_secs_f64(n as f64 / rate.max(0.001));
    std::thread::sleep(due.saturating_duration_since(Instant::now()));
}

/// The sink: announces itself, reads everything, and broadcasts `broadcasts` ARP
/// requests a second. Runs in its own thread until the process ends.
fn run_sink(socket: PathBuf, broadcasts: f64) -> Result<()> {
    let mut fe = connect(&socket, NO_GUEST_GSO, 256)?;
    fe.post_rx(256, 2048)?;
    let start = Instant::now();
    let mut n = 0u64;
    loop {
        if broadcasts > 0.0 && start.elapsed().as_secs_f64() * broadcasts >= n as f64 {
            send(
                &mut fe,
                &VirtioNetHdr::default(),
                &arp(sink_mac(), 200),
                TxLayout::Single,
            );
            n += 1;
        } else if n == 0 {
            // Announce the sink's MAC once even without broadcasts.
            send(
                &mut fe,
                &VirtioNetHdr::default(),
                &arp(sink_mac(), 200),
                TxLayout::Single,
            );
            n = 1;
        }
        // Read (and re-post) whatever arrived; errors are the daemon's business.
        while let Ok(Some(_)) = fe.try_recv(Duration::from_millis(1)) {}
        std::thread::sleep(Duration::from_millis(2));
    }
}

fn post_bait(fe: &mut TestFrontend, attack: Attack) -> Result<()> {
    if attack == Attack::RxTiny {
        return fe.post_rx_chains(RX_QUEUE_SIZE as usize, &[1]);
    }
    let buf = fe.alloc_guest(&[0u8; 64])?;
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
    let t = fe.alloc_table(&table)?;
    for _ in 0..RX_QUEUE_SIZE {
        fe.push_raw(
            RX_QUEUE,
            &[RawDesc::new(t, 16 * u32::from(TABLE_ENTRIES)).indirect()],
        )?;
    }
    Ok(())
}

fn main() -> Result<()> {
    let args = Args::parse();
    let needs_sink = !matches!(
        args.attack,
        Attack::Idle | Attack::AvailJump | Attack::ResetLoop | Attack::MemStorm
    );
    if needs_sink {
        let sink = args
            .sink
            .clone()
            .context("this attack needs --sink (a second port socket)")?;
        let b = if matches!(
            args.attack,
            Attack::RxIndirect | Attack::RxIndirectNoneg | Attack::RxTiny
        ) {
            args.broadcasts
        } else {
            0.0
        };
        std::thread::spawn(move || {
            if let Err(e) = run_sink(sink, b) {
                eprintln!("attacker: sink: {e:#}");
            }
        });
    }
    let end = args
        .seconds
        .map(|s| Instant::now() + Duration::from_secs_f64(s));
    let running = || end.is_none_or(|e| Instant::now() < e);
    let start = Instant::now();
    let mut n = 0u64;
    match args.attack {
        Attack::Idle => {
            let mut fe = connect(&args.socket, HONEST, 256)?;
            fe.post_rx(256, 2048)?;
            while running() {
                std::thread::sleep(Duration::from_millis(100));
            }
        }
        Attack::RxIndirect | Attack::RxIndirectNoneg | Attack::RxTiny => {
            let features = if args.attack == Attack::RxIndirectNoneg {
                HONEST & !feat::INDIRECT_DESC
            } else {
                HONEST
            };
            while running() {
                let mut fe = connect(&args.socket, features, RX_QUEUE_SIZE)?;
                post_bait(&mut fe, args.attack)?;
                send(
                    &mut fe,
                    &VirtioNetHdr::default(),
                    &arp(attacker_mac(), 201),
                    TxLayout::Single,
                );
                let armed = Instant::now();
                while running() && armed.elapsed().as_secs_f64() < args.rearm {
                    std::thread::sleep(Duration::from_millis(50));
                }
            }
        }
        Attack::AvailJump => {
            let mut fe = connect(&args.socket, HONEST, 256)?;
            fe.post_rx(64, 2048)?;
            fe.jump_avail(TX_QUEUE, 5000)?;
            while running() {
                fe.kick(TX_QUEUE)?;
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        Attack::Gso1 => {
            let mut fe = connect(&args.socket, HONEST, 256)?;
            fe.post_rx(64, 2048)?;
            // Let the sink announce itself first.
            std::thread::sleep(Duration::from_millis(500));
            let flow = Flow::new(attacker_mac(), sink_mac(), Ips::v4()).ports(6600, 6601);
            let (h, f) = frames::tcp(&flow, 1, &frames::payload(64000, 3), Some(1));
            let rate = args.rate.unwrap_or(200.0);
            while running() {
                send(&mut fe, &h, &f, TxLayout::HeaderThenChunks(4096));
                n += 1;
                pace(start, n, rate);
            }
        }
        Attack::MacFlood => {
            let mut fe = connect(&args.socket, HONEST, 256)?;
            std::thread::sleep(Duration::from_millis(500));
            let rate = args.rate.unwrap_or(5000.0);
            while running() {
                // 32 frames a batch, each from a MAC never seen before.
                for _ in 0..32 {
                    let b = (n as u32).to_be_bytes();
                    let src = [0x02, 0x66, b[0], b[1], b[2], b[3]];
                    let flow = Flow::new(src, sink_mac(), Ips::v4()).ports(6700, 6701);
                    let (h, f) = frames::udp(&flow, &[0u8; 18], UdpGso::None);
                    send(&mut fe, &h, &f, TxLayout::Single);
                    n += 1;
                }
                pace(start, n, rate);
            }
        }
        Attack::ResetLoop => {
            let mut fe = connect(&args.socket, HONEST, 256)?;
            let acked = fe.acked_features();
            let rate = args.rate.unwrap_or(1000.0);
            while running() {
                fe.vhost().set_features(acked).context("SET_FEATURES")?;
                let _ = fe.send_bad(BadTx::ALL[(n % BadTx::ALL.len() as u64) as usize]);
                let _ = fe.reclaim_tx();
                n += 1;
                pace(start, n, rate);
            }
        }
        Attack::MemStorm => {
            let mut fe = connect(&args.socket, HONEST, 256)?;
            fe.post_rx(256, 2048)?;
            // Above the boot memory (the test frontend's regions are 4 GiB apart);
            // every ADD and REM waits for gsonet's REPLY_ACK.
            const GPA: u64 = 1 << 32;
            let mut said = Instant::now();
            while running() {
                fe.add_region(GPA, 64 << 20)?;
                fe.remove_region(GPA)?;
                n += 2;
                if let Some(rate) = args.rate {
                    pace(start, n, rate);
                }
                // What gsonet let through, once a second (the log noisy.py keeps).
                if said.elapsed() >= Duration::from_secs(1) {
                    said = Instant::now();
                    let t = start.elapsed().as_secs_f64();
                    eprintln!("attacker: mem-storm: {n} changes in {t:.1} s");
                }
            }
        }
    }
    eprintln!("attacker: {:?} done after {n} rounds", args.attack);
    Ok(())
}

//! The gsonet command line: `serve` runs the backend, `stats` and `ctl` talk to a
//! running one over its control socket.

#![forbid(unsafe_code)]

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};
use gsonet::backend::{self, control};
use gsonet::config::{Config, PortConfig, UplinkConfig, DEFAULT_CONTROL};
use gsonet::stats::Snapshot;

mod watch;

#[derive(Parser)]
#[command(
    name = "gsonet",
    version = env!("GSONET_VERSION"),
    about = "vhost-user virtio-net backend with GSO negotiation",
    long_about = "A vhost-user virtio-net backend. QEMU guests attach with -netdev vhost-user; gsonet \
negotiates checksum and segmentation offloads with each guest, switches frames between guests and \
uplinks, passes large (GSO) frames intact to every destination that accepts them and segments \
them in software for those that do not."
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run the backend.
    #[command(after_help = "Examples:\n  \
gsonet serve --port socket=/run/gsonet/vm1.sock --port socket=/run/gsonet/vm2.sock --uplink tap=gsonet0\n  \
gsonet serve --port socket=/tmp/vm1.sock,queues=2,tso=off --uplink tap=gs0,gso=software\n  \
gsonet serve --port socket=/run/gsonet/vm1.sock --uplink dev=eth1,queues=2,bypass=on\n  \
gsonet serve --port socket=/tmp/web.sock,vlan=10 --port socket=/tmp/db.sock,vlan=20 --uplink tap=gs0\n  \
gsonet serve --port socket=/tmp/vm1.sock,mac=52:54:00:00:00:01,mac_lock=on --port socket=/tmp/rt.sock,trunk=on,allowed_vlans=10:20-29 --uplink tap=gs0\n  \
gsonet serve --config /etc/gsonet.toml\n\n\
Attach a guest (its RAM must be shared):\n  \
qemu-system-x86_64 ... -object memory-backend-memfd,id=mem,size=1G,share=on -numa node,memdev=mem \\\n    \
-chardev socket,id=c0,path=/run/gsonet/vm1.sock -netdev vhost-user,id=n0,chardev=c0 \\\n    \
-device virtio-net-pci,netdev=n0,mrg_rxbuf=on\n\n\
Logging: RUST_LOG=gsonet=debug")]
    Serve(ServeArgs),
    /// Print the counters of a running gsonet.
    Stats {
        #[arg(long, value_name = "PATH", default_value = DEFAULT_CONTROL)]
        control: PathBuf,
        /// Machine-readable output.
        #[arg(long, conflicts_with = "watch")]
        json: bool,
        /// Print per-second rates every --interval seconds, one line per port and
        /// uplink (like ifstat), until interrupted or --count reports.
        #[arg(long)]
        watch: bool,
        /// Seconds between two --watch reports.
        #[arg(long, value_name = "SECS", default_value_t = 1.0, requires = "watch",
              value_parser = parse_interval)]
        interval: f64,
        /// Stop --watch after N reports.
        #[arg(long, value_name = "N", requires = "watch")]
        count: Option<u64>,
    },
    /// Change, add or remove a port or uplink at runtime, or reload the --config file:
    /// `gsonet ctl uplink:0 gso=software`, `gsonet ctl port:vm1.sock tso=off
    /// max_burst=1400`, `gsonet ctl port add socket=/run/gsonet/vm3.sock,vlan=10`,
    /// `gsonet ctl port del vm3.sock`, `gsonet ctl uplink add tap=gs1`,
    /// `gsonet ctl uplink del 1`, `gsonet ctl reload`.
    #[command(after_help = "Ports and uplinks at runtime:
  port add SPEC        SPEC as --port takes it; the new port gets the next id (ids are never reused)
  port del N|NAME      by id, socket path or the path's file name: its guest's connection is
                       closed, its socket file removed; other ports are not disturbed
  uplink add SPEC      SPEC as --uplink takes it
  uplink del N|NAME    by id, name (tap=gs1) or interface name
  reload               read the --config file again and apply the difference (as SIGHUP does);
                       --port/--uplink entries and `ctl ... add` ones stay as they are

At most 256 ports and 16 uplinks. A bad spec or file is refused with its reason and changes
nothing. docs/operations.md, section Ports at runtime, has the details.")]
    Ctl {
        #[arg(long, value_name = "PATH", default_value = DEFAULT_CONTROL)]
        control: PathBuf,
        /// port:N|SOCKET or uplink:N|NAME; or `port`/`uplink` followed by add SPEC or
        /// del N|NAME; or `reload`.
        target: String,
        /// KEY=VALUE settings: ports take the offload switches (=on|off, applied to the
        /// next frontend connection, e.g. when its QEMU restarts), max_burst=N|off,
        /// gro=on|off, rate=MBIT|off, burst=KB, rx_rate=MBIT|off, rx_burst=KB,
        /// rx_coalesce_usecs=N, rx_coalesce_frames=N and tx_coalesce_usecs=N (at
        /// once); uplinks take gso=pass|software, max_burst=N|off, rate=MBIT|off,
        /// burst=KB, rx_rate=MBIT|off and rx_burst=KB (at once).
        settings: Vec<String>,
    },
    /// Write shell completions (bash, zsh, fish, elvish) or man pages into DIR
    /// (`make completions`, `make man`).
    #[command(hide = true)]
    Generate {
        #[arg(value_enum)]
        what: Generated,
        #[arg(value_name = "DIR")]
        dir: PathBuf,
    },
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum Generated {
    Completions,
    Man,
}

/// A --watch interval: positive seconds, at least 0.1.
fn parse_interval(v: &str) -> Result<f64, String> {
    match v.parse::<f64>() {
        Ok(s) if (0.1..=3600.0).contains(&s) => Ok(s),
        _ => Err("expected seconds between 0.1 and 3600".into()),
    }
}

/// Exit code for configuration mistakes.
const EXIT_CONFIG: u8 = 2;

/// What `gsonet serve` was given.
#[derive(Args)]
struct ServeArgs {
    /// A vhost-user port: socket=PATH[,client][,queues=N][,mac=MAC][,mac_lock=on][,mac_limit=N]
    /// [,mtu=N][,max_burst=N][,gro=on|off][,rate=MBIT[,burst=KB]][,rx_rate=MBIT[,rx_burst=KB]]
    /// [,vlan=N | ,trunk=on,allowed_vlans=LIST]
    /// [,socket_mode=MODE][,socket_group=GROUP][,tx_poll_us=N][,busy_poll_us=N][,one_copy=on|off][,packed=auto|on|off][,in_order=on|off]
    /// and offload switches offloads|csum|guest_csum|tso|ecn|ufo|uso|mrg_rxbuf|event_idx|indirect_desc=on|off.
    /// gsonet listens on PATH (QEMU connects); with `client` (or server=off) it connects to
    /// a QEMU started with server=on. path=PATH is the same as socket=PATH. Repeat for more
    /// guests. gro=on (default): in-order TCP segments (and UDP datagrams for a guest
    /// with USO) of one flow within a batch reach the guest as one GSO frame.
    /// rate=MBIT (off by default): what the guest may send, its TX queue held over it;
    /// burst=KB (default 128) what an idle guest saves up. rx_rate=MBIT and rx_burst=KB:
    /// the same for what it receives (a sending guest is held, a frame from an uplink
    /// dropped, rate_limited).
    /// mac=MAC is pinned to the port: frames from that address elsewhere are dropped.
    /// mac_lock=on (needs mac=): the guest may send only from its mac= (mac_spoofed).
    /// mac_limit=N (default 256): addresses learned on the port at once; past it the
    /// port's own oldest is forgotten. A learned address moves between ports at most
    /// once a second (mac_moves, mac_move_refused).
    /// vlan=N (1..4094) makes the port an 802.1Q access port of VLAN N: its guest sends
    /// and receives untagged frames, uplinks carry them tagged with VID N, and it sees
    /// only VLAN N. Tagged frames a guest sends on an access port are dropped
    /// (tagged_on_access_port).
    /// trunk=on,allowed_vlans=LIST (ids and ranges joined by ':', e.g. 10-20:30) makes
    /// it a trunk port: the guest sends and receives those VLANs 802.1Q-tagged and the
    /// untagged domain untagged; other tags are dropped (vlan_not_allowed). Not with vlan=.
    /// Ports with neither form the untagged domain and send untagged frames only: any
    /// tag, 802.1ad and double tags included, is dropped (tagged_on_untagged_port).
    /// allow_unsealed_memory=on takes guest memory in files not sealed against shrinking
    /// (hugetlbfs or /dev/shm files, DPDK); by default only sealed memfds are mapped.
    /// tx_poll_us=N (0..1000, default 0: off): after a TX batch, leave the guest's kicks
    /// off and look at its TX queue again N µs later (a timer), while each look finds
    /// frames; fewer kicks for a streaming guest, up to N µs more for its frames.
    /// busy_poll_us=N (0..1000, default 0: off; 50 for fast guests): after a TX drain that found 32
    /// frames or more, keep the guest's kicks off and watch its TX queue for up to N µs,
    /// yielding the CPU to anything runnable, before sleeping on its kick again: a
    /// fast guest's next frames are taken without a kick or a wake-up. An idle
    /// queue costs nothing.
    /// one_copy=on (default): a frame of 512 bytes or more this guest sends to another
    /// guest that takes it intact is copied once, from its buffers straight into the
    /// receiver's (rx_one_copy); off: through gsonet's memory, two copies.
    /// packed=auto|on|off (default auto): offer packed virtqueues (VIRTIO_F_RING_PACKED,
    /// which QEMU virtio-net-pci packed=on and DPDK virtio_user packed_vq=1 ask for); a
    /// frontend that does not ack them gets split rings. A packed port keeps its rings'
    /// positions in PATH.rings beside its socket, for a restarted gsonet to resume them
    /// from; auto offers packed rings only if that file can be kept (else split rings
    /// only, with a warning), on offers them without it too (a restart then leaves a
    /// packed guest's queues stopped), off never. `gsonet stats` shows what is offered
    /// and what was acked.
    /// in_order=on|off (default on): offer VIRTIO_F_IN_ORDER (bit 35, DPDK virtio_user
    /// in_order=1, its default; QEMU virtio-net-pci in_order=on): buffers are used in
    /// the order they were made available (gsonet always does), and a TX ring's
    /// chains go back with one used entry per batch. off stops offering the bit.
    /// rx_coalesce_usecs=N (0..10000, default 0: off) and rx_coalesce_frames=N
    /// (0..1024): RX interrupt moderation as `ethtool -C rx-usecs/rx-frames` means it: a
    /// frame is announced to the guest at most N µs after it was written, or at once
    /// when rx_coalesce_frames wait. Also set at runtime with `gsonet ctl`.
    /// tx_coalesce_usecs=N (0..10000, default 0: off): TX completion moderation as
    /// `ethtool -C tx-usecs` means it: the call announcing sent frames waits up to N µs,
    /// and is not made if the guest reclaimed them meanwhile (Linux does so while
    /// receiving); a ring half full of unannounced frames is announced at once. 0 calls
    /// at once. Also set at runtime with `gsonet ctl`.
    /// socket_mode=MODE (octal, default 0660) and socket_group=GROUP (a name or a gid,
    /// default gsonet's own) say who may connect to PATH, i.e. become this port's
    /// frontend; directories gsonet creates for it get 0750 and the same group. Only a
    /// stale socket at PATH is replaced: a file, symlink or directory there is an error.
    #[arg(long = "port", value_name = "SPEC")]
    ports: Vec<String>,
    /// An uplink: tap=NAME or dev=IFNAME, then [,queues=N][,gso=pass|software][,max_burst=N]
    /// (dev also [,bypass=on|off]; tap also [,mac=MAC][,persist=on|off]). Needs root.
    /// tap=NAME: gsonet creates the tap and brings it up; assign it an address yourself.
    /// The tap is persistent (persist=on, the default): it outlives gsonet with the
    /// host's addresses and routes, and the next gsonet reattaches to it. mac=MAC sets
    /// its address; without it a new tap gets a stable one derived from its name.
    /// dev=IFNAME: an existing interface (a NIC, a veth, a bond) through AF_PACKET sockets
    /// with vnet headers; gsonet puts it in promiscuous mode so the guests' frames arrive,
    /// and does not bring it up. queues=N opens N sockets in one fanout group.
    /// bypass=on sets PACKET_QDISC_BYPASS: our frames skip the device's qdisc (no tc
    /// shaping, no queueing: less CPU per frame, but frames are dropped, not queued, when
    /// the driver's TX ring is full). Default off.
    /// gso=pass hands GSO frames to the kernel intact (it or the NIC segments them);
    /// gso=software segments them in gsonet first.
    /// rate=MBIT[,burst=KB]: what the uplink may send into gsonet (the rest is dropped,
    /// rate_limited); rx_rate=MBIT[,rx_burst=KB]: what gsonet may send into it (a guest
    /// sending over it is held). Bytes on the wire, a GSO frame as its segments.
    #[arg(long = "uplink", value_name = "SPEC")]
    uplinks: Vec<String>,
    /// A Xen netback vif, served from dom0 (docs/xen.md): domid=D[,devid=N][,mac=MAC]
    /// [,tso=on|off][,csum=on|off][,uring=on|off][,nice=N] serves backend/vif/D/N;
    /// auto[,max=N] attaches every vif that appears under backend/vif/ (at most N at
    /// once, default 8). uring=on (default): a TX batch's frames go to a tap in one
    /// io_uring submission. nice=N (default -5): the vif worker threads' nice value.
    /// queues=N (1-8, default dom0's CPUs up to 8): most queues a netfront may open
    /// (multi-queue-max-queues), one worker thread each.
    /// The domU's vif uses script=vif-none, with the kernel's xen-netback not loaded.
    #[arg(long = "xen-vif", value_name = "SPEC")]
    xen_vifs: Vec<String>,
    /// A TOML file with [[port]], [[uplink]] and [[xen_vif]] tables (same keys as above),
    /// `control`, `control_mode`, `control_group`, `mac_aging` and `metrics`;
    /// --port/--uplink/--xen-vif add to it.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Control socket for `gsonet stats` and `gsonet ctl`.
    #[arg(long, value_name = "PATH")]
    control: Option<PathBuf>,
    /// Mode of the control socket, in octal (default 0600: only gsonet's user may read
    /// counters and change settings). Overrides the file's `control_mode`.
    #[arg(long, value_name = "MODE")]
    control_mode: Option<String>,
    /// Group of the control socket (a name or a gid); with --control-mode 0660 its
    /// members may use `gsonet stats` and `gsonet ctl`. Overrides `control_group`.
    #[arg(long, value_name = "GROUP")]
    control_group: Option<String>,
    /// Serve Prometheus metrics at http://ADDR:PORT/metrics (e.g. 127.0.0.1:9477;
    /// docs/operations.md lists them). Overrides the file's `metrics`. Off by default.
    #[arg(long, value_name = "ADDR:PORT")]
    metrics: Option<String>,
}

fn serve(args: ServeArgs) -> Result<(), (u8, String)> {
    let ServeArgs {
        ports,
        uplinks,
        xen_vifs,
        config,
        control,
        control_mode,
        control_group,
        metrics,
    } = args;
    let cfg_err = |e: gsonet::config::ConfigError| (EXIT_CONFIG, e.to_string());
    let mut cfg = match &config {
        Some(path) => Config::from_file(path).map_err(cfg_err)?,
        None => Config::from_toml("").map_err(cfg_err)?,
    };
    for p in &ports {
        cfg.ports.push(PortConfig::parse(p).map_err(cfg_err)?);
    }
    for u in &uplinks {
        cfg.uplinks.push(UplinkConfig::parse(u).map_err(cfg_err)?);
    }
    for x in &xen_vifs {
        cfg.xen_vifs
            .push(gsonet::config::XenVifConfig::parse(x).map_err(cfg_err)?);
    }
    if let Some(c) = control {
        cfg.control = c;
    }
    if let Some(m) = &metrics {
        cfg.metrics = Some(gsonet::config::parse_metrics_addr(m).map_err(cfg_err)?);
    }
    cfg.control_access = cfg
        .control_access
        .clone()
        .with(
            "serve",
            control_mode.as_deref().map(|v| ("--control-mode", v)),
            control_group.as_deref().map(|v| ("--control-group", v)),
        )
        .map_err(cfg_err)?;
    cfg.check().map_err(cfg_err)?;
    backend::run(cfg).map_err(|e| {
        let code = match e {
            backend::DaemonError::SocketInUse(_)
            | backend::DaemonError::Listen { .. }
            | backend::DaemonError::NotASocket { .. }
            | backend::DaemonError::NoSuchGroup { .. } => EXIT_CONFIG,
            _ => 1,
        };
        (code, e.to_string())
    })
}

fn print_stats(r: &control::protocol::StatsReport) {
    for p in &r.ports {
        let s = &p.stats;
        let vlan = p.vlan.map(|v| format!(" vlan {v}")).unwrap_or_default();
        println!(
            "port {} {}{vlan} ({})",
            p.id,
            p.name,
            if p.connected {
                "connected"
            } else {
                "waiting for a guest"
            }
        );
        if let Some(acked) = p.acked {
            let ring = if acked & gsonet::features::RING_PACKED != 0 {
                "packed"
            } else {
                "split"
            };
            let order = if acked & gsonet::features::IN_ORDER != 0 {
                ", in order"
            } else {
                ""
            };
            println!("  acked features: {acked:#x} ({ring} rings{order})");
        }
        if let Some(offered) = p.offered {
            let rings = match &p.packed_refused {
                _ if offered & gsonet::features::RING_PACKED != 0 => "packed or split rings".into(),
                Some(why) => format!("split rings only: {why}"),
                None => "split rings only".into(),
            };
            println!("  offered features: {offered:#x} ({rings})");
        }
        if let (Some(rx), Some(tx)) = (p.guest_rx, p.guest_tx) {
            println!("  guest sends: {tx:?}");
            println!("  guest takes: {rx:?}");
        }
        if p.mem_regions > 0 {
            println!(
                "  memory: {} regions, {} MiB mapped",
                p.mem_regions,
                p.mem_bytes >> 20
            );
        }
        print_counters(s);
        // One queue's counters would repeat the port's.
        if p.queues.len() > 1 {
            for q in &p.queues {
                print_queue(q);
            }
        }
    }
    for u in &r.uplinks {
        println!("uplink {} {} gso={:?}", u.id, u.name, u.gso);
        print_counters(&u.stats);
    }
}

fn print_queue(q: &gsonet::stats::QueueSnapshot) {
    println!(
        "  queue {}: from it {} frames {} bytes  to it {} frames {} bytes  kicks tx {} rx {}  calls tx {} rx {}  tx polls {}  rx ring full {}",
        q.queue,
        q.tx_frames,
        q.tx_bytes,
        q.rx_frames,
        q.rx_bytes,
        q.tx_kicks,
        q.rx_kicks,
        q.tx_calls,
        q.rx_calls,
        q.tx_polls,
        q.rx_full
    );
}

fn print_counters(s: &Snapshot) {
    println!(
        "  from it: {} frames {} bytes (largest {})   to it: {} frames {} bytes",
        s.tx_frames, s.tx_bytes, s.tx_max_frame, s.rx_frames, s.rx_bytes
    );
    println!(
        "  gso: passed {}  segmented {} -> {} segments ({} bytes, {}..{} per frame, mss {}..{})  csum completed {}",
        s.gso_passed,
        s.gso_segmented,
        s.segments_out,
        s.bytes_segmented,
        s.min_segments,
        s.max_segments,
        s.min_mss,
        s.max_mss,
        s.csum_completed
    );
    println!(
        "  notifications: kicks tx {} rx {}  calls tx {} rx {}  tx polls {}",
        s.tx_kicks, s.rx_kicks, s.tx_calls, s.rx_calls, s.tx_polls
    );
    if s.rx_held > 0 || s.rx_pauses > 0 {
        println!(
            "  backpressure: {} frames held for full guests, reads paused {} times",
            s.rx_held, s.rx_pauses
        );
    }
    if s.tx_held > 0 || s.tx_pauses > 0 {
        println!(
            "  backpressure: {} TX frames held for full guests, TX queue left {} times",
            s.tx_held, s.tx_pauses
        );
    }
    if s.tx_holds > 0 {
        println!(
            "  rate: TX queue held {} times, {} us in all",
            s.tx_holds, s.tx_throttled_us
        );
    }
    if s.gro_frames > 0 {
        println!(
            "  gro: {} frames from {} segments",
            s.gro_frames, s.gro_segments
        );
    }
    if s.mac_moves > 0 {
        println!("  mac moves to it: {}", s.mac_moves);
    }
    if !s.drops.is_empty() {
        let d: Vec<String> = s.drops.iter().map(|(k, v)| format!("{k}={v}")).collect();
        println!("  drops: {}", d.join(" "));
    }
}

/// One request to a running gsonet's control socket.
fn ask(control: &std::path::Path, req: &control::Request) -> Result<control::Reply, (u8, String)> {
    control::request(control, req).map_err(|e| {
        (
            1,
            format!("cannot reach gsonet at {}: {e}", control.display()),
        )
    })
}

fn pretty<T: serde::Serialize>(v: &T) -> Result<String, (u8, String)> {
    serde_json::to_string_pretty(v).map_err(|e| (1, e.to_string()))
}

/// One stats report from a running gsonet.
fn stats_report(control: &std::path::Path) -> Result<control::protocol::StatsReport, (u8, String)> {
    let reply = ask(control, &control::Request::Stats)?;
    let control::Reply::Stats(report) = reply else {
        return Err((1, format!("unexpected answer: {reply:?}")));
    };
    Ok(report)
}

/// Completions for every shell clap_complete knows well, or one man page per command.
fn generate(what: Generated, dir: &std::path::Path) -> Result<(), (u8, String)> {
    use clap::CommandFactory;
    let io = |e: std::io::Error| (1, format!("{}: {e}", dir.display()));
    std::fs::create_dir_all(dir).map_err(io)?;
    let mut cmd = Cli::command();
    match what {
        Generated::Completions => {
            use clap_complete::Shell;
            for shell in [Shell::Bash, Shell::Zsh, Shell::Fish, Shell::Elvish] {
                let path =
                    clap_complete::generate_to(shell, &mut cmd, "gsonet", dir).map_err(io)?;
                println!("{}", path.display());
            }
        }
        Generated::Man => {
            cmd.build();
            let mut pages = vec![("gsonet".to_string(), cmd.clone())];
            let shown = cmd
                .get_subcommands()
                .filter(|s| !s.is_hide_set() && s.get_name() != "help");
            for sub in shown {
                pages.push((format!("gsonet-{}", sub.get_name()), sub.clone()));
            }
            for (name, page) in pages {
                let page = page.name(name.clone());
                let path = dir.join(format!("{name}.1"));
                let mut out = Vec::new();
                clap_mangen::Man::new(page).render(&mut out).map_err(io)?;
                std::fs::write(&path, out).map_err(io)?;
                println!("{}", path.display());
            }
        }
    }
    Ok(())
}

fn run(cli: Cli) -> Result<(), (u8, String)> {
    match cli.cmd {
        Cmd::Serve(args) => serve(args),
        Cmd::Generate { what, dir } => generate(what, &dir),
        Cmd::Stats {
            control,
            watch: true,
            interval,
            count,
            ..
        } => watch::run(&control, interval, count, stats_report),
        Cmd::Stats { control, json, .. } => {
            let report = stats_report(&control)?;
            if json {
                println!("{}", pretty(&report)?);
            } else {
                print_stats(&report);
            }
            Ok(())
        }
        Cmd::Ctl {
            control,
            target,
            settings,
        } => {
            let req = match (target.as_str(), settings.as_slice()) {
                ("reload", []) => Some(control::Request::Reload),
                ("port" | "uplink", [op, arg]) if op == "add" => Some(control::Request::Add {
                    kind: target.clone(),
                    spec: arg.clone(),
                }),
                ("port" | "uplink", [op, arg]) if op == "del" => Some(control::Request::Del {
                    kind: target.clone(),
                    which: arg.clone(),
                }),
                ("port" | "uplink", _) => {
                    return Err((
                        EXIT_CONFIG,
                        format!("expected `{target} add SPEC` or `{target} del N|NAME`"),
                    ))
                }
                (_, []) => {
                    return Err((
                        EXIT_CONFIG,
                        format!("{target}: expected KEY=VALUE settings after it"),
                    ))
                }
                _ => None,
            };
            if let Some(req) = req {
                return match ask(&control, &req)? {
                    control::Reply::Error { error } => Err((EXIT_CONFIG, error)),
                    ok => {
                        println!("{}", pretty(&ok)?);
                        Ok(())
                    }
                };
            }
            let settings = settings
                .iter()
                .map(|s| {
                    s.split_once('=')
                        .map(|(k, v)| (k.to_string(), v.to_string()))
                        .ok_or((EXIT_CONFIG, format!("{s}: expected KEY=VALUE")))
                })
                .collect::<Result<Vec<_>, _>>()?;
            match ask(&control, &control::Request::Set { target, settings })? {
                control::Reply::Error { error } => Err((EXIT_CONFIG, error)),
                ok => {
                    println!("{}", pretty(&ok)?);
                    Ok(())
                }
            }
        }
    }
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("gsonet=info")),
        )
        .with_writer(std::io::stderr)
        // Plain text in log files and journals, where lines are grepped; colour on a terminal.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    match run(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err((code, msg)) => {
            eprintln!("gsonet: {msg}");
            ExitCode::from(code)
        }
    }
}

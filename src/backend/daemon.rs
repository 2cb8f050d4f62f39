//! Wiring: builds the ports, uplinks and switch from a `Config`, serves each port's
//! frontends one after another, starts the uplink readers and the control socket.

use std::io;
use std::os::fd::AsFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use thiserror::Error;
use tracing::{debug, error, info, warn};
use vhost::vhost_user::Listener;
use vhost_user_backend::VhostUserDaemon;
use vm_memory::GuestMemoryAtomic;

use super::control::protocol::{Applied, ReloadReport};
use super::control::server::{find_port, find_uplink};
use super::control::{self, Lifecycle, Members};
use super::lifecycle::{self, Activated, Stop};
use super::metrics;
use super::ratelimit::LogLimit;
use super::socket::{bind_exclusive, Access, BindError, PrivateDir};
use super::switch::{Switch, SwitchPort, SwitchUplink, MAX_PORTS, MAX_UPLINKS};
use super::uplink::device::{PacketUplink, TapUplink};
use super::uplink::packet::PacketError;
use super::uplink::reader;
use super::uplink::tap::TapError;
use super::uplink::Uplink;
use super::vhost::backend::PortBackend;
use super::vhost::port::Port;
use super::vhost::relay;
use super::xen::{xenbus, VifPort};
use crate::config::{
    Config, GroupSpec, PortConfig, SocketAccess, UplinkConfig, UplinkKind, XenVifConfig,
    XenVifTarget,
};
use crate::ring::GuestMem;
use crate::sys::cred::{group_id, peer_cred};
use crate::sys::io::poll_readable;
use crate::sys::sock::listen_unix;

#[derive(Debug, Error)]
pub enum DaemonError {
    #[error("socket {0} is in use by a running process (another gsonet?)")]
    SocketInUse(String),
    #[error("cannot listen on {path}: {err}")]
    Listen { path: String, err: String },
    #[error("cannot use {path} as a socket: {err}")]
    NotASocket { path: String, err: String },
    #[error(
        "{what}: no group {name:?} (socket_group/--control-group takes a group name or a gid)"
    )]
    NoSuchGroup { what: String, name: String },
    #[error(transparent)]
    Tap(#[from] TapError),
    #[error(transparent)]
    Packet(#[from] PacketError),
    #[error("control socket {path}: {err}")]
    Control { path: String, err: io::Error },
    #[error("metrics address {addr}: {err}")]
    Metrics { addr: String, err: io::Error },
    #[error("cannot start thread: {0}")]
    Thread(io::Error),
    #[error("cannot create a port's timers: {0}")]
    Timer(io::Error),
    #[error("sockets passed by the service manager (LISTEN_FDS): {0}")]
    Activation(io::Error),
}

/// The gid a socket's `group` names; an unknown name is a configuration error.
fn resolve(access: &SocketAccess, what: &Path) -> Result<Access, DaemonError> {
    let gid =
        match &access.group {
            None => None,
            Some(GroupSpec::Id(g)) => Some(*g),
            Some(GroupSpec::Name(name)) => Some(group_id(name).ok().flatten().ok_or_else(
                || DaemonError::NoSuchGroup {
                    what: what.display().to_string(),
                    name: name.clone(),
                },
            )?),
        };
    Ok(Access {
        mode: access.mode,
        gid,
    })
}

/// Binds a vhost-user listening socket, refusing to steal one a live process serves
/// or to remove anything at the path that is not a socket.
fn listen(path: &Path, access: Access) -> Result<UnixListener, DaemonError> {
    let shown = path.display().to_string();
    bind_exclusive(path, access).map_err(|e| match e {
        BindError::InUse => DaemonError::SocketInUse(shown),
        BindError::NotASocket(_) => DaemonError::NotASocket {
            path: shown,
            err: e.to_string(),
        },
        BindError::Io(err) => DaemonError::Listen {
            path: shown,
            err: err.to_string(),
        },
    })
}

/// Binds the control socket: like a port's, but a control socket in use or that
/// cannot be bound is a start-up failure of its own (exit 1).
fn listen_control(path: &Path, access: Access) -> Result<UnixListener, DaemonError> {
    let shown = path.display().to_string();
    bind_exclusive(path, access).map_err(|e| match e {
        BindError::NotASocket(_) => DaemonError::NotASocket {
            path: shown,
            err: e.to_string(),
        },
        BindError::InUse => DaemonError::Control {
            path: shown,
            err: io::Error::new(io::ErrorKind::AddrInUse, e.to_string()),
        },
        BindError::Io(err) => DaemonError::Control { path: shown, err },
    })
}

/// A served port's way out: `gsonet ctl port del` (or a reload) sets `stop`, closes
/// the connection being served and wakes the accept.
#[derive(Default)]
struct PortLife {
    stop: AtomicBool,
    /// The frontend connection being served now.
    conn: Mutex<Option<UnixStream>>,
}

impl PortLife {
    fn stopped(&self) -> bool {
        self.stop.load(Ordering::Acquire)
    }
}

/// First and longest wait between two connection attempts of a client-mode port.
const CONNECT_BACKOFF: (Duration, Duration) = (Duration::from_millis(20), Duration::from_secs(1));

/// Waits for the next frontend: accepted on our socket, or (client mode) connected
/// to QEMU's, retrying while it is not there: at once after a frontend left (QEMU
/// listens again within milliseconds), then backing off to once a second. `None`:
/// the port is being removed.
fn next_frontend(
    port: &Port,
    listener: Option<&UnixListener>,
    life: &PortLife,
) -> Option<UnixStream> {
    let mut wait = CONNECT_BACKOFF.0;
    loop {
        if life.stopped() {
            return None;
        }
        let r = match listener {
            Some(l) => l.accept().map(|(s, _)| s),
            None => UnixStream::connect(&port.cfg.socket),
        };
        match r {
            Ok(s) => return (!life.stopped()).then_some(s),
            Err(e) => {
                if listener.is_some() {
                    warn!(port = %port.name(), "accept failed: {e}");
                    thread::sleep(Duration::from_millis(100));
                } else {
                    thread::sleep(wait);
                    wait = (wait * 2).min(CONNECT_BACKOFF.1);
                }
            }
        }
    }
}

/// The connection between the relay and the vhost crate's request handler.
///
/// The handler (vhost-user-backend 0.24) takes its connection only from a listening
/// socket (`VhostUserDaemon::start`); there is no entry point for a connected stream
/// or a socket pair. So the listener is bound in a fresh 0700 directory with an
/// unguessable name, we connect to it, check with SO_PEERCRED that what answered is
/// this process, and remove the name at once: from then on nobody can connect. After
/// the handler accepted, `Inner::check_probe` makes sure it accepted ours (no other
/// connection waits behind it), or the connection is refused.
struct Inner {
    listener: Listener,
    /// The same listening socket, to see whether another connection is queued.
    probe: UnixListener,
    back: UnixStream,
}

impl Inner {
    fn open() -> io::Result<Inner> {
        let dir = PrivateDir::create(
            &std::env::temp_dir(),
            &format!("gsonet-relay-{}-", std::process::id()),
        )?;
        let path = dir.path().join("s");
        let l = listen_unix(&path, 0o600)?;
        let back = UnixStream::connect(&path)?;
        // Unlinks the socket and its directory: the listener keeps its one connection.
        drop(dir);
        let peer = peer_cred(back.as_fd())?;
        if u32::try_from(peer.pid).ok() != Some(std::process::id()) {
            return Err(io::Error::other(format!(
                "the relay's private socket was answered by pid {}",
                peer.pid
            )));
        }
        Ok(Inner {
            probe: l.try_clone()?,
            listener: Listener::from(l),
            back,
        })
    }

    /// After the handler accepted one connection from `probe`'s socket: nothing else
    /// may be queued, or the one it took may not be ours.
    fn check_probe(probe: &UnixListener) -> io::Result<()> {
        if poll_readable(probe.as_fd(), Duration::ZERO)? {
            return Err(io::Error::other(
                "another process connected to the relay's private socket",
            ));
        }
        Ok(())
    }
}

/// Serves one port until it is removed: one frontend at a time; after it goes away,
/// the next.
fn serve_port(
    port: Arc<Port>,
    switch: Arc<Switch>,
    listener: Option<UnixListener>,
    life: Arc<PortLife>,
    stop: Arc<Stop>,
) {
    let name = port.name();
    // Connect and disconnect lines of this port: a local user reconnecting in a loop
    // cannot flood the log. Kept apart from the guest's own lines (`Port::log`).
    let log = LogLimit::default();
    loop {
        let Some(front) = next_frontend(&port, listener.as_ref(), &life) else {
            debug!(port = %name, "port removed; its thread ends");
            return;
        };
        // Kept where a removal finds it (then checked again: a removal between the
        // accept and here has set `stop` already).
        *life.conn.lock().unwrap_or_else(|e| e.into_inner()) = front.try_clone().ok();
        if life.stopped() {
            return;
        }
        // Counted until this connection is cleaned up; none once gsonet is stopping.
        let Some(_serving) = stop.serve(port.id, &front) else {
            return;
        };
        if let Some(suppressed) = log.allow() {
            match peer_cred(front.as_fd()) {
                Ok(c) => info!(
                    port = %name,
                    pid = c.pid,
                    uid = c.uid,
                    gid = c.gid,
                    suppressed,
                    "frontend connected"
                ),
                Err(e) => {
                    info!(port = %name, suppressed, "frontend connected (credentials unknown: {e})")
                }
            }
        }
        let attempt = || -> Result<(VhostUserDaemon<PortBackend>, UnixListener), String> {
            let backend =
                PortBackend::new(port.clone(), switch.clone()).map_err(|e| e.to_string())?;
            let mem = GuestMemoryAtomic::new(GuestMem::default());
            let mut daemon =
                VhostUserDaemon::new(format!("gsonet-{}", port.id), backend.clone(), mem)
                    .map_err(|e| e.to_string())?;
            backend
                .introduce_workers(&daemon.get_epoll_handlers())
                .map_err(|e| e.to_string())?;
            // Serve the guest only once the workers have handed over the RX vrings, so
            // that frames for it never find the port without a queue.
            let deadline = std::time::Instant::now() + Duration::from_secs(2);
            while !port.rx_known() && std::time::Instant::now() < deadline {
                thread::sleep(Duration::from_millis(1));
            }
            if !port.rx_known() {
                warn!(port = %name, "queue workers slow to start; RX may drop at first");
            }
            let Inner {
                mut listener,
                probe,
                back,
            } = Inner::open().map_err(|e| format!("relay socket: {e}"))?;
            relay::spawn(front, back, port.clone(), switch.clone()).map_err(|e| e.to_string())?;
            daemon.start(&mut listener).map_err(|e| e.to_string())?;
            Ok((daemon, probe))
        };
        let (mut daemon, probe) = match attempt() {
            Ok(d) => d,
            Err(e) => {
                error!(port = %name, "cannot serve frontend: {e}");
                thread::sleep(Duration::from_millis(500));
                continue;
            }
        };
        if let Err(e) = Inner::check_probe(&probe) {
            error!(port = %name, "relay socket: {e}; closing this connection");
            daemon.request_shutdown();
        }
        drop(probe);
        debug!(port = %name, "frontend served");
        let r = daemon.wait();
        // Stop this connection's queue workers before forgetting the guest: the
        // daemon holds the last reference to its handler, whose drop joins them. A
        // worker still running could otherwise handle one more kick and put this
        // connection's RX vring back into the port after the cleanup, where the next
        // guest would inherit it.
        drop(daemon);
        *life.conn.lock().unwrap_or_else(|e| e.into_inner()) = None;
        port.set_connected(false);
        switch.port_down(port.id);
        if life.stopped() {
            info!(port = %name, "port removed; its frontend's connection is closed");
            return;
        }
        let Some(suppressed) = log.allow() else {
            continue;
        };
        match r {
            // Closing the socket is how a frontend leaves (QEMU quitting, DPDK's
            // virtio_user closing its port): not a fault.
            Ok(())
            | Err(vhost_user_backend::Error::HandleRequest(
                vhost::vhost_user::Error::Disconnected,
            )) => info!(port = %name, suppressed, "frontend disconnected; waiting for the next"),
            Err(e) => {
                warn!(port = %name, suppressed, "frontend connection ended: {e}; waiting for the next")
            }
        }
    }
}

/// Sockets bound so far at start-up (or for a port being added), and the records of
/// packed rings made fresh beside them, removed again if start-up fails later on.
/// A record that was there before is kept: it holds a previous gsonet's rings.
#[derive(Default)]
struct Bound {
    sockets: Vec<std::path::PathBuf>,
    records: Vec<std::path::PathBuf>,
}

impl Bound {
    fn socket(path: &std::path::Path) -> Bound {
        Bound {
            sockets: vec![path.to_path_buf()],
            records: Vec::new(),
        }
    }

    /// Before `Port::new` opens (or creates) port `cfg`'s record: notes it if new.
    fn note_record(&mut self, cfg: &PortConfig) {
        if let Some(path) = crate::backend::vhost::port::record_path(cfg) {
            if std::fs::symlink_metadata(&path).is_err() {
                self.records.push(path);
            }
        }
    }

    /// Start-up went through: everything stays.
    fn keep(&mut self) {
        self.sockets.clear();
        self.records.clear();
    }
}

impl Drop for Bound {
    fn drop(&mut self) {
        use std::os::unix::fs::FileTypeExt;
        let is = |p: &std::path::Path, f: fn(&std::fs::FileType) -> bool| {
            std::fs::symlink_metadata(p).is_ok_and(|m| f(&m.file_type()))
        };
        // Only what is still a socket, or a regular file: never what someone put
        // there since.
        for p in &self.sockets {
            if is(p, std::fs::FileType::is_socket) {
                let _ = std::fs::remove_file(p);
            }
        }
        for p in &self.records {
            if is(p, std::fs::FileType::is_file) {
                let _ = std::fs::remove_file(p);
            }
        }
    }
}

/// An uplink device opened, its readers not started yet.
enum Opened {
    Tap(Arc<TapUplink>),
    Packet(Arc<PacketUplink>),
}

impl Opened {
    /// Opens `u`'s device; `most_pairs` is its queue count unless `queues=` says.
    fn open(u: &UplinkConfig, most_pairs: u16) -> Result<Opened, DaemonError> {
        let u = &UplinkConfig {
            queues: Some(u.queues.unwrap_or(most_pairs)),
            ..u.clone()
        };
        Ok(match &u.kind {
            UplinkKind::Tap(name) => Opened::Tap(Arc::new(TapUplink::open(u, name)?)),
            UplinkKind::Dev { name, bypass } => {
                Opened::Packet(Arc::new(PacketUplink::open(u, name, *bypass)?))
            }
        })
    }

    fn uplink(&self) -> Arc<dyn Uplink> {
        match self {
            Opened::Tap(t) => t.clone(),
            Opened::Packet(p) => p.clone(),
        }
    }

    fn start(
        &self,
        id: usize,
        switch: &Arc<Switch>,
        stop: &Arc<AtomicBool>,
    ) -> io::Result<Vec<JoinHandle<()>>> {
        match self {
            Opened::Tap(t) => reader::start(t.clone(), id, switch.clone(), stop.clone()),
            Opened::Packet(p) => reader::start(p.clone(), id, switch.clone(), stop.clone()),
        }
    }
}

/// A port being served.
struct PortEntry {
    port: Arc<Port>,
    /// What it was configured with last (a reload compares the file with this).
    cfg: PortConfig,
    life: Arc<PortLife>,
    thread: JoinHandle<()>,
    /// From the `--config` file (a reload may change it) or the command line or
    /// `gsonet ctl port add` (a reload leaves it alone).
    from_file: bool,
}

/// An uplink being read.
struct UplinkEntry {
    id: usize,
    uplink: Arc<dyn Uplink>,
    cfg: UplinkConfig,
    stop: Arc<AtomicBool>,
    readers: Vec<JoinHandle<()>>,
    from_file: bool,
}

/// A port built and its socket bound, not yet in the switch.
struct PreparedPort {
    port: Arc<Port>,
    listener: Option<UnixListener>,
    /// Its socket, removed again if it never serves.
    bound: Bound,
}

struct State {
    ports: Vec<PortEntry>,
    uplinks: Vec<UplinkEntry>,
    /// Ids of the next port and uplink: never reused (see `Switch`).
    next_port: usize,
    next_uplink: usize,
    /// The file as last read: its global settings are compared with the next.
    file_globals: Option<Config>,
}

/// The ports and uplinks of a running gsonet and their threads; what `gsonet ctl port
/// add/del`, `uplink add/del` and `reload` (and SIGHUP) change. Its lock is the
/// control side's only: frames never take it.
struct Runtime {
    switch: Arc<Switch>,
    members: Arc<RwLock<Members>>,
    state: Mutex<State>,
    /// The configuration gsonet started with (its file, its global settings).
    started: Config,
    /// The clean stop (SIGTERM, SIGINT): what it drains and which sockets it removes.
    stop: Arc<Stop>,
}

/// How long a removal waits for a port's or uplink's threads to end.
const STOP_WAIT: Duration = Duration::from_secs(5);

/// Waits (polling, at most until `deadline`) for a thread to end; whether it did.
fn wait_finished(h: &JoinHandle<()>, deadline: Instant) -> bool {
    while !h.is_finished() {
        if Instant::now() >= deadline {
            return false;
        }
        thread::sleep(Duration::from_millis(5));
    }
    true
}

/// A port setting that changes without a new port: what `gsonet ctl port:N` sets.
fn port_live_only(old: &PortConfig, new: &PortConfig) -> bool {
    let same_rest = PortConfig {
        mask: old.mask,
        max_burst: old.max_burst,
        gro: old.gro,
        rate: old.rate,
        rx_rate: old.rx_rate,
        rx_coalesce_usecs: old.rx_coalesce_usecs,
        rx_coalesce_frames: old.rx_coalesce_frames,
        tx_coalesce_usecs: old.tx_coalesce_usecs,
        ..new.clone()
    };
    &same_rest == old
}

fn apply_port_live(p: &Port, c: &PortConfig) {
    p.set_mask(c.mask);
    p.set_max_burst(c.max_burst);
    p.set_gro(c.gro);
    p.set_rate(c.rate);
    p.set_rx_rate(c.rx_rate);
    p.rx_coalesce.set(c.rx_coalesce_usecs, c.rx_coalesce_frames);
    p.set_tx_coalesce_usecs(c.tx_coalesce_usecs);
}

/// An uplink setting that changes without a new uplink: `gso`, `max_burst` and the
/// rates.
fn uplink_live_only(old: &UplinkConfig, new: &UplinkConfig) -> bool {
    let same_rest = UplinkConfig {
        gso: old.gso,
        max_burst: old.max_burst,
        rate: old.rate,
        rx_rate: old.rx_rate,
        ..new.clone()
    };
    &same_rest == old
}

/// The most queue pairs of any port or Xen vif: the queues a tap without `queues=`
/// gets. A vif's queues count as a port's pairs: its worker K writes and reads tap
/// queue K, and the host's answers to a flow come back on the queue it was written on.
fn most_pairs<'a>(ports: impl Iterator<Item = &'a PortConfig>, vifs: &[XenVifConfig]) -> u16 {
    ports
        .map(|p| p.queues)
        .chain(
            vifs.iter()
                .map(|x| x.queues.min(usize::from(u16::MAX)) as u16),
        )
        .max()
        .unwrap_or(1)
}

impl Runtime {
    /// `most_pairs` of the ports there are now and the vifs gsonet started with (a
    /// reload does not change those).
    fn most_pairs(&self, st: &State) -> u16 {
        most_pairs(st.ports.iter().map(|p| &p.cfg), &self.started.xen_vifs)
    }

    fn members(&self) -> std::sync::RwLockWriteGuard<'_, Members> {
        self.members.write().unwrap_or_else(|e| e.into_inner())
    }

    /// Builds port `cfg` and binds its socket; nothing is served yet.
    fn prepare_port(&self, st: &mut State, cfg: PortConfig) -> Result<PreparedPort, String> {
        if st.ports.len() >= MAX_PORTS {
            return Err(format!("gsonet serves {MAX_PORTS} ports at most"));
        }
        if st.ports.iter().any(|p| p.cfg.socket == cfg.socket) {
            return Err(format!("a port on {} exists already", cfg.socket.display()));
        }
        let id = st.next_port;
        st.next_port += 1;
        let access = resolve(&cfg.access, &cfg.socket).map_err(|e| e.to_string())?;
        let mut bound = Bound::default();
        let listener = if cfg.client {
            None
        } else {
            let l = listen(&cfg.socket, access).map_err(|e| e.to_string())?;
            bound.sockets.push(cfg.socket.clone());
            self.stop.own_socket(&cfg.socket, &l);
            Some(l)
        };
        // After the listen, as at start-up (`run`): the record beside the socket.
        bound.note_record(&cfg);
        let port = Arc::new(Port::new(id, cfg).map_err(|e| DaemonError::Timer(e).to_string())?);
        Ok(PreparedPort {
            port,
            listener,
            bound,
        })
    }

    /// Puts a prepared port in the switch and starts serving it.
    fn commit_port(
        &self,
        st: &mut State,
        mut prep: PreparedPort,
        from_file: bool,
    ) -> Result<usize, String> {
        let port = prep.port.clone();
        let id = port.id;
        self.switch
            .add_port(id, port.clone())
            .map_err(|e| e.to_string())?;
        let life = Arc::new(PortLife::default());
        let thread = match spawn_port(
            port.clone(),
            self.switch.clone(),
            prep.listener.take(),
            life.clone(),
            self.stop.clone(),
        ) {
            Ok(h) => h,
            Err(e) => {
                let _ = self.switch.remove_port(id);
                return Err(e.to_string());
            }
        };
        prep.bound.keep();
        self.members().ports.push(port.clone());
        info!(port = %port.name(), id, mode = if port.cfg.client { "client" } else { "server" }, queues = port.cfg.queues, "port added");
        st.ports.push(PortEntry {
            cfg: port.cfg.clone(),
            port,
            life,
            thread,
            from_file,
        });
        Ok(id)
    }

    /// Takes port `st.ports[i]` out: out of the switch first (no frame goes to it
    /// any more), its rings left as they are, then its frontend's connection is
    /// closed, its thread ends and its socket file goes.
    fn remove_port(&self, st: &mut State, i: usize) -> (usize, String) {
        let e = st.ports.remove(i);
        let (id, name) = (e.port.id, e.port.name());
        self.members().ports.retain(|p| p.id != id);
        if let Err(err) = self.switch.remove_port(id) {
            warn!(port = %name, "{err}");
        }
        e.life.stop.store(true, Ordering::Release);
        if !e.cfg.client {
            // Wakes the accept: it sees `stop` and returns.
            let _ = UnixStream::connect(&e.cfg.socket);
            // Only what is still a socket (ours); in client mode the socket is QEMU's.
            drop(Bound::socket(&e.cfg.socket));
        }
        // Its rings stay as they are from here: QEMU reads the used indexes back when
        // the connection closes (a later write would leave the guest past them).
        e.port.quiesce();
        if let Some(c) = e.life.conn.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = c.shutdown(std::net::Shutdown::Both);
        }
        if !wait_finished(&e.thread, Instant::now() + STOP_WAIT) {
            warn!(port = %name, "the port's thread is slow to end; it ends on its own");
        }
        info!(port = %name, id, "port removed");
        (id, name)
    }

    /// Opens uplink `cfg`'s device; it reads nothing yet.
    fn prepare_uplink(&self, st: &State, cfg: &UplinkConfig) -> Result<Opened, String> {
        if st.uplinks.len() >= MAX_UPLINKS {
            return Err(format!("gsonet reads {MAX_UPLINKS} uplinks at most"));
        }
        let name = cfg.name();
        if st.uplinks.iter().any(|u| u.cfg.name() == name) {
            return Err(format!("uplink {name} exists already"));
        }
        Opened::open(cfg, self.most_pairs(st)).map_err(|e| e.to_string())
    }

    fn commit_uplink(
        &self,
        st: &mut State,
        opened: Opened,
        cfg: UplinkConfig,
        from_file: bool,
    ) -> Result<usize, String> {
        let id = st.next_uplink;
        st.next_uplink += 1;
        let uplink = opened.uplink();
        self.switch
            .add_uplink(id, uplink.clone())
            .map_err(|e| e.to_string())?;
        let stop = Arc::new(AtomicBool::new(false));
        let readers = match opened.start(id, &self.switch, &stop) {
            Ok(r) => r,
            Err(e) => {
                let _ = self.switch.remove_uplink(id);
                return Err(format!("cannot start the uplink's readers: {e}"));
            }
        };
        self.members().uplinks.push((id, uplink.clone()));
        info!(uplink = %uplink.name(), id, "uplink added");
        st.uplinks.push(UplinkEntry {
            id,
            uplink,
            cfg,
            stop,
            readers,
            from_file,
        });
        Ok(id)
    }

    /// Takes uplink `st.uplinks[i]` out and waits for its readers to end; its device
    /// closes with the last reference.
    fn remove_uplink(&self, st: &mut State, i: usize) -> (usize, String) {
        let e = st.uplinks.remove(i);
        let (id, name) = (e.id, e.uplink.name());
        if let Err(err) = e.uplink.release() {
            warn!(uplink = %name, "cannot drop the tap's persistence: {err}");
        }
        self.members().uplinks.retain(|(u, _)| *u != id);
        if let Err(err) = self.switch.remove_uplink(id) {
            warn!(uplink = %name, "{err}");
        }
        e.stop.store(true, Ordering::Release);
        let deadline = Instant::now() + STOP_WAIT;
        if !e.readers.iter().all(|h| wait_finished(h, deadline)) {
            warn!(uplink = %name, "the uplink's readers are slow to end; they end on their own");
        }
        info!(uplink = %name, id, "uplink removed");
        (id, name)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Reads the file again and applies the difference to its ports and uplinks.
    /// Everything that can be checked is checked before anything changes: a file that
    /// does not parse, names a socket or uplink twice, or adds one that cannot be
    /// bound or opened changes nothing.
    fn reload_file(&self) -> Result<ReloadReport, String> {
        let origin = self.started.file.as_ref().ok_or(
            "gsonet was started without --config: there is no file to read again".to_string(),
        )?;
        let nothing = |e: String| format!("{e}; nothing changed");
        let new = Config::from_file(&origin.path).map_err(|e| nothing(e.to_string()))?;
        let mut st = self.lock();
        // Checks.
        let mut sockets = std::collections::HashSet::new();
        for p in st.ports.iter().filter(|p| !p.from_file) {
            sockets.insert(p.cfg.socket.clone());
        }
        for p in &new.ports {
            if !sockets.insert(p.socket.clone()) {
                return Err(nothing(format!(
                    "socket {} is named twice (in the file, or by the command line or `ctl port add` too)",
                    p.socket.display()
                )));
            }
        }
        let mut names = std::collections::HashSet::new();
        for u in st.uplinks.iter().filter(|u| !u.from_file) {
            names.insert(u.cfg.name());
        }
        for u in &new.uplinks {
            if !names.insert(u.name()) {
                return Err(nothing(format!(
                    "uplink {} is named twice (in the file, or by the command line or `ctl uplink add` too)",
                    u.name()
                )));
            }
        }
        if sockets.len() > MAX_PORTS {
            return Err(nothing(format!("gsonet serves {MAX_PORTS} ports at most")));
        }
        if names.len() > MAX_UPLINKS {
            return Err(nothing(format!(
                "gsonet reads {MAX_UPLINKS} uplinks at most"
            )));
        }
        // The plan.
        let mut report = ReloadReport::default();
        let mut port_gone = Vec::new();
        let mut port_recreate = Vec::new();
        let mut port_live = Vec::new();
        for e in st.ports.iter().filter(|p| p.from_file) {
            match new.ports.iter().find(|p| p.socket == e.cfg.socket) {
                None => port_gone.push(e.port.id),
                Some(c) if *c == e.cfg => report.unchanged += 1,
                Some(c) if port_live_only(&e.cfg, c) => port_live.push((e.port.id, c.clone())),
                Some(c) => port_recreate.push((e.port.id, c.clone())),
            }
        }
        let port_new: Vec<PortConfig> = new
            .ports
            .iter()
            .filter(|c| !st.ports.iter().any(|p| p.cfg.socket == c.socket))
            .cloned()
            .collect();
        let mut up_gone = Vec::new();
        let mut up_recreate = Vec::new();
        let mut up_live = Vec::new();
        for e in st.uplinks.iter().filter(|u| u.from_file) {
            match new.uplinks.iter().find(|u| u.name() == e.cfg.name()) {
                None => up_gone.push(e.id),
                Some(c) if *c == e.cfg => report.unchanged += 1,
                Some(c) if uplink_live_only(&e.cfg, c) => up_live.push((e.id, c.clone())),
                Some(c) => up_recreate.push((e.id, c.clone())),
            }
        }
        let up_new: Vec<UplinkConfig> = new
            .uplinks
            .iter()
            .filter(|c| !st.uplinks.iter().any(|u| u.cfg.name() == c.name()))
            .cloned()
            .collect();
        // What is new is bound and opened before anything changes.
        let mut prepared = Vec::new();
        for c in port_new {
            let name = c.name();
            prepared.push(
                self.prepare_port(&mut st, c)
                    .map_err(|e| nothing(format!("port {name}: {e}")))?,
            );
        }
        let mut opened = Vec::new();
        for c in up_new {
            let o = self
                .prepare_uplink(&st, &c)
                .map_err(|e| nothing(format!("uplink {}: {e}", c.name())))?;
            opened.push((o, c));
        }
        // Changes.
        let mut errors = Vec::new();
        for id in port_gone {
            if let Some(i) = st.ports.iter().position(|p| p.port.id == id) {
                report.removed.push(self.remove_port(&mut st, i).1);
            }
        }
        for id in up_gone {
            if let Some(i) = st.uplinks.iter().position(|u| u.id == id) {
                report.removed.push(self.remove_uplink(&mut st, i).1);
            }
        }
        // New ports take their ids before re-created ones: ids only grow.
        for p in prepared {
            let name = p.port.name();
            match self.commit_port(&mut st, p, true) {
                Ok(_) => report.added.push(name),
                Err(e) => errors.push(format!("port {name}: {e}")),
            }
        }
        for (o, c) in opened {
            let name = c.name();
            match self.commit_uplink(&mut st, o, c, true) {
                Ok(_) => report.added.push(name),
                Err(e) => errors.push(format!("uplink {name}: {e}")),
            }
        }
        for (id, c) in port_recreate {
            if let Some(i) = st.ports.iter().position(|p| p.port.id == id) {
                let name = self.remove_port(&mut st, i).1;
                match self
                    .prepare_port(&mut st, c)
                    .and_then(|p| self.commit_port(&mut st, p, true))
                {
                    Ok(_) => report.recreated.push(name),
                    Err(e) => errors.push(format!("port {name} was removed, not added again: {e}")),
                }
            }
        }
        for (id, c) in up_recreate {
            if let Some(i) = st.uplinks.iter().position(|u| u.id == id) {
                let name = self.remove_uplink(&mut st, i).1;
                match self
                    .prepare_uplink(&st, &c)
                    .and_then(|o| self.commit_uplink(&mut st, o, c, true))
                {
                    Ok(_) => report.recreated.push(name),
                    Err(e) => {
                        errors.push(format!("uplink {name} was removed, not added again: {e}"))
                    }
                }
            }
        }
        for (id, c) in port_live {
            if let Some(e) = st.ports.iter_mut().find(|p| p.port.id == id) {
                apply_port_live(&e.port, &c);
                e.cfg = c;
                report.changed.push(e.port.name());
            }
        }
        for (id, c) in up_live {
            if let Some(e) = st.uplinks.iter_mut().find(|u| u.id == id) {
                e.uplink.set_gso_mode(c.gso);
                e.uplink.set_max_burst(c.max_burst);
                if e.uplink.rates() != (c.rate, c.rx_rate) {
                    e.uplink.set_rate(c.rate);
                    e.uplink.set_rx_rate(c.rx_rate);
                }
                e.cfg = c;
                report.changed.push(e.uplink.name());
            }
        }
        let s = st.file_globals.replace(new.clone()).unwrap_or(new.clone());
        for (key, differs) in [
            ("control", new.control != s.control),
            (
                "control_mode",
                new.control_access.mode != s.control_access.mode,
            ),
            (
                "control_group",
                new.control_access.group != s.control_access.group,
            ),
            ("mac_aging", new.mac_aging_secs != s.mac_aging_secs),
            ("metrics", new.metrics != s.metrics),
            // Vifs come and go with their domUs, not with a reload.
            ("xen_vif", new.xen_vifs != s.xen_vifs),
        ] {
            if differs {
                report.not_applied.push(key.to_string());
            }
        }
        if errors.is_empty() {
            Ok(report)
        } else {
            Err(format!(
                "reload applied in part ({}): {}",
                serde_json::to_string(&report).unwrap_or_default(),
                errors.join("; ")
            ))
        }
    }

    /// A reload, logged (SIGHUP has no other answer).
    fn reload_logged(&self) -> Result<ReloadReport, String> {
        let r = self.reload_file();
        match &r {
            Ok(rep) => info!(
                added = ?rep.added,
                removed = ?rep.removed,
                changed = ?rep.changed,
                recreated = ?rep.recreated,
                unchanged = rep.unchanged,
                not_applied = ?rep.not_applied,
                "configuration reloaded"
            ),
            Err(e) => warn!("configuration reload: {e}"),
        }
        r
    }
}

impl Lifecycle for Runtime {
    fn add(&self, kind: &str, spec: &str) -> Result<Applied, String> {
        let mut st = self.lock();
        match kind {
            "port" => {
                let cfg = PortConfig::parse(spec).map_err(|e| e.to_string())?;
                let name = cfg.name();
                let prep = self.prepare_port(&mut st, cfg)?;
                let id = self.commit_port(&mut st, prep, false)?;
                Ok(Applied::Added { added: name, id })
            }
            "uplink" => {
                let cfg = UplinkConfig::parse(spec).map_err(|e| e.to_string())?;
                let name = cfg.name();
                let opened = self.prepare_uplink(&st, &cfg)?;
                let id = self.commit_uplink(&mut st, opened, cfg, false)?;
                Ok(Applied::Added { added: name, id })
            }
            _ => Err(format!("add what? `port` or `uplink`, not {kind:?}")),
        }
    }

    fn del(&self, kind: &str, which: &str) -> Result<Applied, String> {
        let mut st = self.lock();
        let (id, name) = match kind {
            "port" => {
                let i = st
                    .ports
                    .iter()
                    .position(|p| find_port(std::slice::from_ref(&p.port), which).is_some())
                    .ok_or_else(|| format!("no port {which}"))?;
                self.remove_port(&mut st, i)
            }
            "uplink" => {
                let i = st
                    .uplinks
                    .iter()
                    .position(|u| find_uplink(&[(u.id, u.uplink.clone())], which).is_some())
                    .ok_or_else(|| format!("no uplink {which}"))?;
                self.remove_uplink(&mut st, i)
            }
            _ => return Err(format!("del what? `port` or `uplink`, not {kind:?}")),
        };
        Ok(Applied::Removed { removed: name, id })
    }

    fn reload(&self) -> Result<Applied, String> {
        self.reload_logged()
            .map(|reloaded| Applied::Reloaded { reloaded })
    }
}

fn spawn_port(
    port: Arc<Port>,
    switch: Arc<Switch>,
    listener: Option<UnixListener>,
    life: Arc<PortLife>,
    stop: Arc<Stop>,
) -> Result<JoinHandle<()>, DaemonError> {
    thread::Builder::new()
        .name(format!("port{}", port.id))
        .spawn(move || serve_port(port, switch, listener, life, stop))
        .map_err(DaemonError::Thread)
}

/// A port's or the control socket's listener: the one the service manager passed, or
/// bound here (then removed again on a clean stop).
fn listener_for(
    path: &Path,
    activated: &mut Activated,
    stop: &Stop,
    bind: impl FnOnce() -> Result<UnixListener, DaemonError>,
) -> Result<(UnixListener, bool), DaemonError> {
    if let Some(l) = activated.take_unix(path) {
        info!(socket = %path.display(), "listening socket from the service manager");
        return Ok((l, false));
    }
    let l = bind()?;
    stop.own_socket(path, &l);
    Ok((l, true))
}

/// Builds everything from `cfg` and serves until stopped (SIGTERM, SIGINT) or killed.
pub fn run(cfg: Config) -> Result<(), DaemonError> {
    // First, before any thread runs: the environment variables are cleared.
    let mut activated =
        Activated::new(crate::sys::activation::take().map_err(DaemonError::Activation)?);
    let stop = Arc::new(Stop::default());
    // SIGHUP reloads the file; caught from the start, so an early one cannot kill us.
    let mut hangups = signal_hook::iterator::Signals::new([signal_hook::consts::SIGHUP])
        .map_err(DaemonError::Thread)?;
    let most_pairs = most_pairs(cfg.ports.iter(), &cfg.xen_vifs);
    if !cfg.xen_vifs.is_empty() {
        // Before the uplinks' read arenas are made: Xen copies from them.
        super::xen::buffers::want_granted();
    }
    let opened = cfg
        .uplinks
        .iter()
        .map(|u| Opened::open(u, most_pairs))
        .collect::<Result<Vec<_>, _>>()?;
    // Listen on every socket before anything runs, so a bad path fails start-up; the
    // groups are looked up first, so a bad one leaves no socket behind.
    let access = cfg
        .ports
        .iter()
        .map(|p| resolve(&p.access, &p.socket))
        .collect::<Result<Vec<_>, _>>()?;
    let control_access = resolve(&cfg.control_access, &cfg.control)?;
    let mut bound = Bound::default();
    let mut listeners = Vec::new();
    for (p, access) in cfg.ports.iter().zip(access) {
        listeners.push(if p.client {
            None
        } else {
            let (l, own) = listener_for(&p.socket, &mut activated, &stop, || {
                listen(&p.socket, access)
            })?;
            if own {
                bound.sockets.push(p.socket.clone());
            }
            Some(l)
        });
    }
    // After the listen, which makes the socket's directory and fails if another
    // gsonet serves it: the port's record of its packed rings (`SOCKET.rings`) is
    // opened beside it, and `packed=auto` offers packed rings if it opens.
    for p in &cfg.ports {
        bound.note_record(p);
    }
    let ports: Vec<Arc<Port>> = cfg
        .ports
        .iter()
        .enumerate()
        .map(|(i, p)| Port::new(i, p.clone()).map(Arc::new))
        .collect::<io::Result<_>>()
        .map_err(DaemonError::Timer)?;
    let (control_listener, own) = listener_for(&cfg.control, &mut activated, &stop, || {
        listen_control(&cfg.control, control_access)
    })?;
    if own {
        bound.sockets.push(cfg.control.clone());
    }
    let metrics_listener = cfg
        .metrics
        .map(|addr| match activated.take_tcp(addr) {
            Some(l) => Ok(l),
            None => std::net::TcpListener::bind(addr).map_err(|err| DaemonError::Metrics {
                addr: addr.to_string(),
                err,
            }),
        })
        .transpose()?;
    for s in activated.unused() {
        warn!(socket = %s, "the service manager passed a socket no port uses; closing it");
    }
    drop(activated);
    bound.keep();
    let uplinks: Vec<Arc<dyn Uplink>> = opened.iter().map(Opened::uplink).collect();
    // Xen vifs take the port slots after the vhost-user ports: one per `domid=`, `max`
    // per `auto`, each disconnected until its netfront connects.
    let mut vifs: Vec<(Arc<VifPort>, XenVifTarget)> = Vec::new();
    for x in &cfg.xen_vifs {
        let n = match x.target {
            XenVifTarget::One { .. } => 1,
            XenVifTarget::Auto { max } => max,
        };
        for k in 0..n {
            let id = ports.len() + vifs.len();
            let idle = match x.target {
                XenVifTarget::One { domid, devid } => format!("vif{domid}.{devid}"),
                XenVifTarget::Auto { .. } => format!("vif-auto{k}"),
            };
            vifs.push((Arc::new(VifPort::new(id, x.clone(), idle)), x.target));
        }
    }
    let switch = Arc::new(Switch::new(
        ports
            .iter()
            .map(|p| p.clone() as Arc<dyn SwitchPort>)
            .chain(vifs.iter().map(|(v, _)| v.clone() as Arc<dyn SwitchPort>))
            .collect(),
        uplinks
            .iter()
            .map(|u| u.clone() as Arc<dyn SwitchUplink>)
            .collect(),
        Duration::from_secs(cfg.mac_aging_secs),
    ));
    let (file_ports, file_uplinks) = cfg.file.as_ref().map_or((0, 0), |f| (f.ports, f.uplinks));
    let mut st = State {
        ports: Vec::new(),
        uplinks: Vec::new(),
        // The vifs' slots follow the ports': a port added later gets an id past them.
        next_port: ports.len() + vifs.len(),
        next_uplink: uplinks.len(),
        file_globals: cfg
            .file
            .as_ref()
            .and_then(|f| Config::from_file(&f.path).ok()),
    };
    for (i, (p, l)) in ports.iter().zip(listeners).enumerate() {
        let life = Arc::new(PortLife::default());
        let thread = spawn_port(p.clone(), switch.clone(), l, life.clone(), stop.clone())?;
        st.ports.push(PortEntry {
            port: p.clone(),
            cfg: p.cfg.clone(),
            life,
            thread,
            from_file: i < file_ports,
        });
    }
    for (i, (o, c)) in opened.into_iter().zip(&cfg.uplinks).enumerate() {
        let stop = Arc::new(AtomicBool::new(false));
        let readers = o.start(i, &switch, &stop).map_err(DaemonError::Thread)?;
        st.uplinks.push(UplinkEntry {
            id: i,
            uplink: o.uplink(),
            cfg: c.clone(),
            stop,
            readers,
            from_file: i < file_uplinks,
        });
    }
    let vif_ports: Vec<Arc<VifPort>> = vifs.iter().map(|(v, _)| v.clone()).collect();
    if !vifs.is_empty() {
        xenbus::start(vifs, switch.clone()).map_err(DaemonError::Thread)?;
    }
    switch.caps_changed();
    for p in &ports {
        info!(port = %p.name(), mode = if p.cfg.client { "client" } else { "server" }, queues = p.cfg.queues, "port ready");
    }
    let control_path = cfg.control.display().to_string();
    let members = Arc::new(RwLock::new(Members {
        ports,
        uplinks: uplinks.into_iter().enumerate().collect(),
        vifs: vif_ports,
    }));
    let metrics_addr = cfg.metrics;
    let rings = switch.clone();
    stop.on_quiesce(move || rings.quiesce_ports());
    let runtime = Arc::new(Runtime {
        switch,
        members: members.clone(),
        state: Mutex::new(st),
        started: cfg,
        stop: stop.clone(),
    });
    let registry = Arc::new(control::Registry {
        members,
        lifecycle: Some(runtime.clone()),
    });
    if let (Some(l), Some(addr)) = (metrics_listener, metrics_addr) {
        let r = registry.clone();
        thread::Builder::new()
            .name("metrics".into())
            .spawn(move || metrics::http::serve(l, r))
            .map_err(DaemonError::Thread)?;
        info!(%addr, "metrics at http://{addr}/metrics");
    }
    thread::Builder::new()
        .name("sighup".into())
        .spawn(move || {
            for _ in hangups.forever() {
                info!("SIGHUP: reading the configuration file again");
                let _ = runtime.reload_logged();
            }
        })
        .map_err(DaemonError::Thread)?;
    lifecycle::stop_on_signals(stop).map_err(DaemonError::Thread)?;
    // Every socket listens and every thread runs: tell systemd (Type=notify).
    match crate::sys::notify::notify("READY=1\nSTATUS=serving") {
        Ok(true) => debug!("readiness sent to the service manager"),
        Ok(false) => {}
        Err(e) => warn!("cannot notify the service manager (NOTIFY_SOCKET): {e}"),
    }
    // Last, so that whoever waits for this line finds SIGTERM handled.
    info!(control = %control_path, "control socket ready");
    control::server::serve_shared(control_listener, registry);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn most_pairs_counts_the_xen_vifs_queues() {
        let port = |q| PortConfig {
            queues: q,
            ..PortConfig::parse("socket=/tmp/x.sock").unwrap()
        };
        let vif = |q: usize| XenVifConfig::parse(&format!("domid=3,queues={q}")).unwrap();
        assert_eq!(most_pairs([].iter(), &[]), 1);
        assert_eq!(most_pairs([port(2)].iter(), &[]), 2);
        assert_eq!(most_pairs([port(2)].iter(), &[vif(5)]), 5);
        assert_eq!(most_pairs([port(6)].iter(), &[vif(5), vif(1)]), 6);
        assert_eq!(most_pairs([].iter(), &[vif(4)]), 4);
    }

    #[test]
    fn the_relay_connection_is_private_and_checked() {
        let Inner {
            listener,
            probe,
            back,
        } = Inner::open().unwrap();
        // Its name is gone: nothing is left to connect to.
        let prefix = format!("gsonet-relay-{}-", std::process::id());
        let left = std::fs::read_dir(std::env::temp_dir())
            .unwrap()
            .filter_map(|e| e.ok())
            .any(|e| e.file_name().to_string_lossy().starts_with(&prefix));
        assert!(!left, "the private directory is removed");
        // The one queued connection is ours: after accepting it, nothing waits.
        let accepted = listener.accept().unwrap().unwrap();
        Inner::check_probe(&probe).unwrap();
        let me = peer_cred(accepted.as_fd()).unwrap();
        assert_eq!(me.pid as u32, std::process::id());
        drop(back);

        // A listener with a second connection behind the accepted one fails the check.
        let dir = PrivateDir::create(&std::env::temp_dir(), "gsonet-test-").unwrap();
        let path = dir.path().join("s");
        let l = listen_unix(&path, 0o600).unwrap();
        let _first = UnixStream::connect(&path).unwrap();
        let _intruder = UnixStream::connect(&path).unwrap();
        l.accept().unwrap();
        assert!(Inner::check_probe(&l).is_err());
    }
}

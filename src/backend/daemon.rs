//! Wiring: builds the ports, uplinks and switch from a `Config`, serves each port's
//! frontends one after another, starts the uplink readers and the control socket.

use std::io;
use std::os::fd::AsFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::sync::Arc;
use std::thread;
use std::time::Duration;

use thiserror::Error;
use tracing::{debug, error, info, warn};
use vhost::vhost_user::Listener;
use vhost_user_backend::VhostUserDaemon;
use vm_memory::GuestMemoryAtomic;

use super::control;
use super::metrics;
use super::ratelimit::LogLimit;
use super::socket::{bind_exclusive, Access, BindError, PrivateDir};
use super::switch::{Switch, SwitchPort, SwitchUplink};
use super::uplink::device::{PacketUplink, TapUplink};
use super::uplink::packet::PacketError;
use super::uplink::reader;
use super::uplink::tap::TapError;
use super::uplink::Uplink;
use super::vhost::backend::PortBackend;
use super::vhost::port::Port;
use super::vhost::relay;
use super::xen::{xenbus, VifPort};
use crate::config::{Config, GroupSpec, SocketAccess, UplinkConfig, UplinkKind, XenVifTarget};
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

/// Waits for the next frontend: accepted on our socket, or (client mode) connected
/// to QEMU's, retrying while it is not there.
fn next_frontend(port: &Port, listener: Option<&UnixListener>) -> UnixStream {
    loop {
        let r = match listener {
            Some(l) => l.accept().map(|(s, _)| s),
            None => UnixStream::connect(&port.cfg.socket),
        };
        match r {
            Ok(s) => return s,
            Err(e) => {
                if listener.is_some() {
                    warn!(port = %port.name(), "accept failed: {e}");
                }
                thread::sleep(Duration::from_millis(if listener.is_some() {
                    100
                } else {
                    500
                }));
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

/// Serves one port forever: one frontend at a time; after it goes away, the next.
fn serve_port(port: Arc<Port>, switch: Arc<Switch>, listener: Option<UnixListener>) {
    let name = port.name();
    // Connect and disconnect lines of this port: a local user reconnecting in a loop
    // cannot flood the log. Kept apart from the guest's own lines (`Port::log`).
    let log = LogLimit::default();
    loop {
        let front = next_frontend(&port, listener.as_ref());
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
            relay::spawn(front, back, port.clone()).map_err(|e| e.to_string())?;
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
        port.set_connected(false);
        switch.port_down(port.id);
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

/// Sockets bound so far at start-up, removed again if start-up fails later on.
struct Bound(Vec<std::path::PathBuf>);

impl Drop for Bound {
    fn drop(&mut self) {
        for p in &self.0 {
            // Only what is still a socket: never a file someone put there since.
            if std::fs::symlink_metadata(p)
                .is_ok_and(|m| std::os::unix::fs::FileTypeExt::is_socket(&m.file_type()))
            {
                let _ = std::fs::remove_file(p);
            }
        }
    }
}

/// Builds everything from `cfg` and serves until the process is killed.
pub fn run(cfg: Config) -> Result<(), DaemonError> {
    let ports: Vec<Arc<Port>> = cfg
        .ports
        .iter()
        .enumerate()
        .map(|(i, p)| Port::new(i, p.clone()).map(Arc::new))
        .collect::<io::Result<_>>()
        .map_err(DaemonError::Timer)?;
    let most_pairs = cfg.ports.iter().map(|p| p.queues).max().unwrap_or(1);
    let mut taps = Vec::new();
    let mut packets = Vec::new();
    let mut uplinks: Vec<Arc<dyn Uplink>> = Vec::new();
    for u in &cfg.uplinks {
        let u = &UplinkConfig {
            queues: Some(u.queues.unwrap_or(most_pairs)),
            ..u.clone()
        };
        match &u.kind {
            UplinkKind::Tap(name) => {
                let t = Arc::new(TapUplink::open(u, name)?);
                taps.push((uplinks.len(), t.clone()));
                uplinks.push(t);
            }
            UplinkKind::Dev { name, bypass } => {
                let p = Arc::new(PacketUplink::open(u, name, *bypass)?);
                packets.push((uplinks.len(), p.clone()));
                uplinks.push(p);
            }
        }
    }
    // Listen on every socket before anything runs, so a bad path fails start-up; the
    // groups are looked up first, so a bad one leaves no socket behind.
    let access = ports
        .iter()
        .map(|p| resolve(&p.cfg.access, &p.cfg.socket))
        .collect::<Result<Vec<_>, _>>()?;
    let control_access = resolve(&cfg.control_access, &cfg.control)?;
    let mut bound = Bound(Vec::new());
    let mut listeners = Vec::new();
    for (p, access) in ports.iter().zip(access) {
        listeners.push(if p.cfg.client {
            None
        } else {
            let l = listen(&p.cfg.socket, access)?;
            bound.0.push(p.cfg.socket.clone());
            Some(l)
        });
    }
    let control_listener = listen_control(&cfg.control, control_access)?;
    bound.0.push(cfg.control.clone());
    let metrics_listener = cfg
        .metrics
        .map(|addr| {
            std::net::TcpListener::bind(addr).map_err(|err| DaemonError::Metrics {
                addr: addr.to_string(),
                err,
            })
        })
        .transpose()?;
    bound.0.clear();
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
    for (p, l) in ports.iter().zip(listeners) {
        if let Some(mac) = p.cfg.mac {
            switch.pin_mac(mac, p.id);
        }
        let (p, sw) = (p.clone(), switch.clone());
        thread::Builder::new()
            .name(format!("port{}", p.id))
            .spawn(move || serve_port(p, sw, l))
            .map_err(DaemonError::Thread)?;
    }
    for (i, t) in taps {
        reader::start(t, i, switch.clone()).map_err(DaemonError::Thread)?;
    }
    for (i, p) in packets {
        reader::start(p, i, switch.clone()).map_err(DaemonError::Thread)?;
    }
    let vif_ports: Vec<Arc<VifPort>> = vifs.iter().map(|(v, _)| v.clone()).collect();
    if !vifs.is_empty() {
        xenbus::start(vifs, switch.clone()).map_err(DaemonError::Thread)?;
    }
    switch.caps_changed();
    for p in &ports {
        info!(port = %p.name(), mode = if p.cfg.client { "client" } else { "server" }, queues = p.cfg.queues, "port ready");
    }
    info!(control = %cfg.control.display(), "control socket ready");
    let registry = Arc::new(control::Registry {
        ports,
        uplinks,
        vifs: vif_ports,
    });
    if let (Some(l), Some(addr)) = (metrics_listener, cfg.metrics) {
        let r = registry.clone();
        thread::Builder::new()
            .name("metrics".into())
            .spawn(move || metrics::http::serve(l, r))
            .map_err(DaemonError::Thread)?;
        info!(%addr, "metrics at http://{addr}/metrics");
    }
    // Every socket listens and every thread runs: tell systemd (Type=notify).
    match crate::sys::notify::notify("READY=1\nSTATUS=serving") {
        Ok(true) => debug!("readiness sent to the service manager"),
        Ok(false) => {}
        Err(e) => warn!("cannot notify the service manager (NOTIFY_SOCKET): {e}"),
    }
    control::server::serve_shared(control_listener, registry);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

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

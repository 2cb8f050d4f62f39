//! Wiring: builds the ports, uplinks and switch from a `Config`, serves each port's
//! frontends one after another, starts the uplink readers and the control socket.

use std::io;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::Duration;

use thiserror::Error;
use tracing::{error, info, warn};
use vhost::vhost_user::Listener;
use vhost_user_backend::VhostUserDaemon;
use vm_memory::GuestMemoryAtomic;

use super::control;
use super::socket::bind_exclusive;
use super::switch::{Switch, SwitchPort, SwitchUplink};
use super::uplink::device::{PacketUplink, TapUplink};
use super::uplink::packet::PacketError;
use super::uplink::reader;
use super::uplink::tap::TapError;
use super::uplink::Uplink;
use super::vhost::backend::PortBackend;
use super::vhost::port::Port;
use super::vhost::relay;
use crate::config::{Config, UplinkConfig, UplinkKind};
use crate::ring::GuestMem;

#[derive(Debug, Error)]
pub enum DaemonError {
    #[error("socket {0} is in use by a running process (another gsonet?)")]
    SocketInUse(String),
    #[error("cannot listen on {path}: {err}")]
    Listen { path: String, err: String },
    #[error(transparent)]
    Tap(#[from] TapError),
    #[error(transparent)]
    Packet(#[from] PacketError),
    #[error("control socket {path}: {err}")]
    Control { path: String, err: io::Error },
    #[error("cannot start thread: {0}")]
    Thread(io::Error),
}

/// Binds a vhost-user listening socket, refusing to steal one a live process serves.
fn listen(path: &Path) -> Result<UnixListener, DaemonError> {
    let shown = path.display().to_string();
    bind_exclusive(path).map_err(|e| match e.kind() {
        io::ErrorKind::AddrInUse => DaemonError::SocketInUse(shown),
        _ => DaemonError::Listen {
            path: shown,
            err: e.to_string(),
        },
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

/// A private (abstract-namespace) socket the vhost crate's handler listens on; the
/// relay is its only client.
fn inner_listener(port: &Port) -> io::Result<(vhost::vhost_user::Listener, SocketAddr)> {
    static SEQ: AtomicU64 = AtomicU64::new(0);
    let name = format!(
        "gsonet-{}-{}-{}",
        std::process::id(),
        port.id,
        SEQ.fetch_add(1, Ordering::Relaxed)
    );
    let addr = SocketAddr::from_abstract_name(name.as_bytes())?;
    let l = UnixListener::bind_addr(&addr)?;
    Ok((Listener::from(l), addr))
}

/// Serves one port forever: one frontend at a time; after it goes away, the next.
fn serve_port(port: Arc<Port>, switch: Arc<Switch>, listener: Option<UnixListener>) {
    let name = port.name();
    loop {
        let front = next_frontend(&port, listener.as_ref());
        let attempt = || -> Result<VhostUserDaemon<PortBackend>, String> {
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
            let (mut inner, addr) = inner_listener(&port).map_err(|e| e.to_string())?;
            let back = UnixStream::connect_addr(&addr).map_err(|e| e.to_string())?;
            relay::spawn(front, back, port.clone()).map_err(|e| e.to_string())?;
            daemon.start(&mut inner).map_err(|e| e.to_string())?;
            Ok(daemon)
        };
        let mut daemon = match attempt() {
            Ok(d) => d,
            Err(e) => {
                error!(port = %name, "cannot serve frontend: {e}");
                thread::sleep(Duration::from_millis(500));
                continue;
            }
        };
        info!(port = %name, "frontend connected");
        let r = daemon.wait();
        // Stop this connection's queue workers before forgetting the guest: the
        // daemon holds the last reference to its handler, whose drop joins them. A
        // worker still running could otherwise handle one more kick and put this
        // connection's RX vring back into the port after the cleanup, where the next
        // guest would inherit it.
        drop(daemon);
        port.set_connected(false);
        switch.port_down(port.id);
        match r {
            // Closing the socket is how a frontend leaves (QEMU quitting, DPDK's
            // virtio_user closing its port): not a fault.
            Ok(())
            | Err(vhost_user_backend::Error::HandleRequest(
                vhost::vhost_user::Error::Disconnected,
            )) => info!(port = %name, "frontend disconnected; waiting for the next"),
            Err(e) => warn!(port = %name, "frontend connection ended: {e}; waiting for the next"),
        }
    }
}

/// Builds everything from `cfg` and serves until the process is killed.
pub fn run(cfg: Config) -> Result<(), DaemonError> {
    let ports: Vec<Arc<Port>> = cfg
        .ports
        .iter()
        .enumerate()
        .map(|(i, p)| Arc::new(Port::new(i, p.clone())))
        .collect();
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
    // Listen on every socket before anything runs, so a bad path fails start-up.
    let mut listeners = Vec::new();
    for p in &ports {
        listeners.push(if p.cfg.client {
            None
        } else {
            Some(listen(&p.cfg.socket)?)
        });
    }
    let switch = Arc::new(Switch::new(
        ports
            .iter()
            .map(|p| p.clone() as Arc<dyn SwitchPort>)
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
    switch.caps_changed();
    for p in &ports {
        info!(port = %p.name(), mode = if p.cfg.client { "client" } else { "server" }, queues = p.cfg.queues, "port ready");
    }
    control::serve(&cfg.control, control::Registry { ports, uplinks }).map_err(|err| {
        DaemonError::Control {
            path: cfg.control.display().to_string(),
            err,
        }
    })
}

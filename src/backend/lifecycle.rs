//! Starting over and stopping cleanly: listening sockets a service manager kept for
//! us (socket activation), and the stop on SIGTERM/SIGINT that drains the frontends'
//! connections and removes the sockets gsonet bound, so the next gsonet starts clean.

use std::net::{SocketAddr, TcpListener};
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tracing::{info, warn};

use crate::sys::activation::Inherited;

/// Sockets passed by the service manager, each taken by the port (or the control
/// socket, or the metrics listener) it belongs to.
#[derive(Default)]
pub struct Activated(Vec<Inherited>);

impl Activated {
    pub fn new(fds: Vec<Inherited>) -> Activated {
        Activated(fds)
    }

    /// The inherited Unix listener for `path`: bound there, or named after the whole
    /// path or its file name (`FileDescriptorName=vm1.sock`).
    pub fn take_unix(&mut self, path: &Path) -> Option<UnixListener> {
        let file = path.file_name().and_then(|f| f.to_str());
        let i = self.0.iter().position(|i| match i {
            Inherited::Unix { name, listener } => {
                listener
                    .local_addr()
                    .ok()
                    .and_then(|a| a.as_pathname().map(Path::to_path_buf))
                    == Some(path.to_path_buf())
                    || Path::new(name) == path
                    || Some(name.as_str()) == file
            }
            Inherited::Tcp { .. } => false,
        })?;
        match self.0.remove(i) {
            Inherited::Unix { listener, .. } => Some(listener),
            Inherited::Tcp { .. } => None,
        }
    }

    /// The inherited TCP listener bound to `addr` or named `metrics`.
    pub fn take_tcp(&mut self, addr: SocketAddr) -> Option<TcpListener> {
        let i = self.0.iter().position(|i| match i {
            Inherited::Tcp { name, listener } => {
                listener.local_addr().ok() == Some(addr) || name == "metrics"
            }
            Inherited::Unix { .. } => false,
        })?;
        match self.0.remove(i) {
            Inherited::Tcp { listener, .. } => Some(listener),
            Inherited::Unix { .. } => None,
        }
    }

    /// Names of sockets no port asked for (closed when this is dropped).
    pub fn unused(&self) -> Vec<String> {
        self.0
            .iter()
            .map(|i| match i {
                Inherited::Unix { name, listener } => format!(
                    "{name} ({})",
                    listener
                        .local_addr()
                        .ok()
                        .and_then(|a| a.as_pathname().map(|p| p.display().to_string()))
                        .unwrap_or_else(|| "unnamed".into())
                ),
                Inherited::Tcp { name, listener } => format!(
                    "{name} ({})",
                    listener
                        .local_addr()
                        .map(|a| a.to_string())
                        .unwrap_or_default()
                ),
            })
            .collect()
    }
}

/// A socket file gsonet bound: removed on a clean stop if it is still that socket.
struct Owned {
    path: PathBuf,
    dev: u64,
    ino: u64,
    listener: UnixListener,
}

impl Owned {
    /// Whether the path still leads to our listener: the same file, and no other
    /// listening socket bound to that path since (an inode number alone can be reused
    /// by a socket someone bound there after ours was removed).
    fn still_ours(&self) -> bool {
        let same_file = std::fs::symlink_metadata(&self.path).is_ok_and(|m| {
            std::os::unix::fs::FileTypeExt::is_socket(&m.file_type())
                && (m.dev(), m.ino()) == (self.dev, self.ino)
        });
        same_file
            && socket_inode(&self.listener)
                .is_some_and(|ours| listening_at(&self.path).is_ok_and(|all| all == [ours]))
    }
}

/// The socket inode of a listener (what /proc/net/unix lists), from its fd's link.
fn socket_inode(l: &UnixListener) -> Option<u64> {
    let link = std::fs::read_link(format!("/proc/self/fd/{}", l.as_raw_fd())).ok()?;
    link.to_str()?
        .strip_prefix("socket:[")?
        .strip_suffix(']')?
        .parse()
        .ok()
}

/// Inodes of the listening Unix sockets bound to `path` (in this network namespace).
fn listening_at(path: &Path) -> std::io::Result<Vec<u64>> {
    let want = path.to_str().unwrap_or_default();
    let table = std::fs::read_to_string("/proc/net/unix")?;
    // Num RefCount Protocol Flags Type St Inode Path; St 01 is listening.
    Ok(table
        .lines()
        .skip(1)
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.len() >= 8 && f[5] == "01" && f[7..].join(" ") == want)
                .then(|| f[6].parse().ok())
                .flatten()
        })
        .collect())
}

#[derive(Default)]
struct Live {
    /// The current frontend connection of each port (by port id), to shut down.
    fronts: Vec<Option<UnixStream>>,
    count: usize,
}

/// Whether gsonet is stopping, the frontends being served, the sockets it bound.
#[derive(Default)]
pub struct Stop {
    stopping: AtomicBool,
    /// Run before the frontends are closed: stops every write to the guests' rings.
    quiesce: Mutex<Option<Box<dyn Fn() + Send>>>,
    live: Mutex<Live>,
    ended: Condvar,
    owned: Mutex<Vec<Owned>>,
}

/// One frontend connection being served; leaving it (drop) counts it as drained.
pub struct Serving<'a> {
    stop: &'a Stop,
    port: usize,
}

impl Drop for Serving<'_> {
    fn drop(&mut self) {
        let mut l = self.stop.lock();
        if let Some(f) = l.fronts.get_mut(self.port) {
            *f = None;
        }
        l.count -= 1;
        self.stop.ended.notify_all();
    }
}

impl Stop {
    fn lock(&self) -> MutexGuard<'_, Live> {
        self.live.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn stopping(&self) -> bool {
        self.stopping.load(Ordering::Acquire)
    }

    /// What the clean stop runs before it closes the frontends' connections.
    pub fn on_quiesce(&self, f: impl Fn() + Send + 'static) {
        *self.quiesce.lock().unwrap_or_else(|e| e.into_inner()) = Some(Box::new(f));
    }

    /// Remembers the socket gsonet just bound at `path` with `listener`, to remove it
    /// on a clean stop.
    pub fn own_socket(&self, path: &Path, listener: &UnixListener) {
        if let (Ok(m), Ok(listener)) = (std::fs::symlink_metadata(path), listener.try_clone()) {
            self.owned
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(Owned {
                    path: path.to_path_buf(),
                    dev: m.dev(),
                    ino: m.ino(),
                    listener,
                });
        }
    }

    /// Port `port` starts serving `front`; `None` once stopping (the connection is
    /// then closed unserved, and the frontend reconnects to the next gsonet).
    pub fn serve(&self, port: usize, front: &UnixStream) -> Option<Serving<'_>> {
        let mut l = self.lock();
        if self.stopping() {
            return None;
        }
        if l.fronts.len() <= port {
            l.fronts.resize_with(port + 1, || None);
        }
        l.fronts[port] = front.try_clone().ok();
        l.count += 1;
        Some(Serving { stop: self, port })
    }

    /// The clean stop: no new frontends; the sockets gsonet bound are removed (only
    /// if each is still the one it bound), so a new gsonet can bind at once; the
    /// rings are left as they are once the writes in progress end (`on_quiesce`):
    /// QEMU reads the used indexes back when the connection closes and the next
    /// gsonet starts there; then every frontend connection is closed, and each
    /// port's queue workers end. Returns whether all were done within `grace`.
    pub fn drain(&self, grace: Duration) -> bool {
        self.stopping.store(true, Ordering::Release);
        for o in self
            .owned
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .drain(..)
        {
            if !o.still_ours() {
                warn!(path = %o.path.display(), "socket was replaced meanwhile; left alone");
            } else if let Err(e) = std::fs::remove_file(&o.path) {
                warn!(path = %o.path.display(), "cannot remove socket: {e}");
            }
        }
        let deadline = Instant::now() + grace;
        if let Some(q) = &*self.quiesce.lock().unwrap_or_else(|e| e.into_inner()) {
            q();
        }
        let mut l = self.lock();
        for f in l.fronts.iter().flatten() {
            let _ = f.shutdown(std::net::Shutdown::Both);
        }
        while l.count > 0 {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            l = self
                .ended
                .wait_timeout(l, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        true
    }
}

/// How long a clean stop waits for the frontends' connections to wind down.
pub const DRAIN_GRACE: Duration = Duration::from_secs(3);

/// Waits for SIGTERM or SIGINT on a thread of its own, then stops cleanly and exits
/// the process with status 0.
pub fn stop_on_signals(stop: std::sync::Arc<Stop>) -> std::io::Result<()> {
    use signal_hook::consts::{SIGINT, SIGTERM};
    let mut signals = signal_hook::iterator::Signals::new([SIGTERM, SIGINT])?;
    std::thread::Builder::new()
        .name("stop".into())
        .spawn(move || {
            if let Some(sig) = signals.forever().next() {
                info!(
                    signal = sig,
                    "stopping: draining frontends, removing sockets"
                );
                let _ = crate::sys::notify::notify("STOPPING=1");
                let done = stop.drain(DRAIN_GRACE);
                if done {
                    info!("stopped cleanly");
                } else {
                    warn!("stopped with frontend connections still winding down");
                }
                std::process::exit(0);
            }
        })?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drain_removes_own_sockets_only_and_waits_for_fronts() {
        let dir = std::env::temp_dir().join(format!("gsonet-stop-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let (a, b) = (dir.join("a.sock"), dir.join("b.sock"));
        let la = UnixListener::bind(&a).unwrap();
        let lb = UnixListener::bind(&b).unwrap();
        let stop = std::sync::Arc::new(Stop::default());
        stop.own_socket(&a, &la);
        stop.own_socket(&b, &lb);
        // b is replaced by another socket after gsonet bound it: not ours to remove.
        std::fs::remove_file(&b).unwrap();
        let _other = UnixListener::bind(&b).unwrap();

        let (front, mut peer) = UnixStream::pair().unwrap();
        let stop = &*stop;
        let serving = stop.serve(0, &front).unwrap();
        std::thread::scope(|s| {
            let port = s.spawn(move || {
                // The port's thread: its frontend goes away when the stop shuts it
                // down; then it cleans up (drops `serving`).
                use std::io::Read;
                let mut buf = [0u8; 1];
                assert_eq!(peer.read(&mut buf).unwrap(), 0);
                assert!(stop.stopping());
                drop(serving);
            });
            assert!(stop.drain(Duration::from_secs(10)));
            port.join().unwrap();
        });
        assert!(!a.exists(), "own socket removed");
        assert!(b.exists(), "a socket someone else bound is left alone");
        assert!(
            stop.serve(1, &front).is_none(),
            "no frontend served once stopping"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}

//! Running under systemd: readiness (READY=1 over `$NOTIFY_SOCKET`, path or abstract)
//! only once every socket listens, never from a start-up that fails; the shipped unit
//! passes `systemd-analyze verify` (which must be installed unless GSONET_ALLOW_SKIP=1); the
//! example /etc/gsonet.toml is a valid configuration. No root needed.

mod common;

use std::os::linux::net::SocketAddrExt;
use std::os::unix::fs::FileTypeExt;
use std::os::unix::net::{SocketAddr, UnixDatagram, UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::daemon::{bin, systemd_verify, unique_tag};

const T: Duration = Duration::from_secs(10);

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

struct Serve {
    child: Child,
    paths: Vec<PathBuf>,
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        for p in &self.paths {
            common::daemon::remove_socket(p);
        }
    }
}

/// `gsonet serve` with two ports and a control socket, told to notify `notify`.
fn serve(tag: &str, notify: &str, extra_port: Option<&Path>) -> Serve {
    let dir = std::env::temp_dir();
    let mut paths: Vec<PathBuf> = (0..2)
        .map(|i| dir.join(format!("gsonet-sd-{tag}-p{i}.sock")))
        .collect();
    paths.push(dir.join(format!("gsonet-sd-{tag}-ctl.sock")));
    let mut cmd = Command::new(bin());
    cmd.arg("serve");
    for p in &paths[..2] {
        cmd.arg("--port").arg(format!("socket={}", p.display()));
    }
    if let Some(p) = extra_port {
        cmd.arg("--port").arg(format!("socket={}", p.display()));
    }
    cmd.arg("--control").arg(&paths[2]);
    cmd.env("NOTIFY_SOCKET", notify)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    Serve {
        child: cmd.spawn().unwrap(),
        paths,
    }
}

fn receive(rx: &UnixDatagram) -> Option<String> {
    rx.set_read_timeout(Some(T)).unwrap();
    let mut buf = [0u8; 4096];
    let n = rx.recv(&mut buf).ok()?;
    Some(String::from_utf8_lossy(&buf[..n]).into_owned())
}

#[test]
fn ready_comes_once_every_socket_listens() {
    let tag = unique_tag();
    let notify = std::env::temp_dir().join(format!("gsonet-sd-{tag}-notify"));
    let rx = UnixDatagram::bind(&notify).unwrap();
    let s = serve(&tag, notify.to_str().unwrap(), None);
    let msg = receive(&rx).expect("READY=1 within 10 s");
    assert!(msg.lines().any(|l| l == "READY=1"), "{msg:?}");
    // At that moment every socket is there and takes connections.
    for p in &s.paths {
        let m = std::fs::symlink_metadata(p).expect("socket exists at READY");
        assert!(m.file_type().is_socket(), "{}", p.display());
        UnixStream::connect(p).expect("listening at READY");
    }
    let _ = std::fs::remove_file(&notify);
}

#[test]
fn ready_goes_to_an_abstract_socket() {
    let tag = unique_tag();
    let name = format!("gsonet-sd-{tag}");
    let rx =
        UnixDatagram::bind_addr(&SocketAddr::from_abstract_name(name.as_bytes()).unwrap()).unwrap();
    let s = serve(&tag, &format!("@{name}"), None);
    let msg = receive(&rx).expect("READY=1 within 10 s");
    assert!(msg.lines().any(|l| l == "READY=1"), "{msg:?}");
    assert!(s.paths.iter().all(|p| p.exists()));
}

#[test]
fn a_failed_start_never_says_ready() {
    let tag = unique_tag();
    let notify = std::env::temp_dir().join(format!("gsonet-sd-{tag}-notify"));
    let rx = UnixDatagram::bind(&notify).unwrap();
    // The third port's socket is served by a live process: start-up must fail.
    let busy = std::env::temp_dir().join(format!("gsonet-sd-{tag}-busy.sock"));
    let _live = UnixListener::bind(&busy).unwrap();
    let mut s = serve(&tag, notify.to_str().unwrap(), Some(&busy));
    let status = s.child.wait().unwrap();
    assert_eq!(status.code(), Some(2));
    rx.set_nonblocking(true).unwrap();
    let mut buf = [0u8; 64];
    assert!(
        rx.recv(&mut buf).is_err(),
        "no datagram from a failed start"
    );
    // The sockets it had bound before the failure are removed again.
    assert!(s.paths.iter().all(|p| !p.exists()));
    let _ = std::fs::remove_file(&notify);
    let _ = std::fs::remove_file(&busy);
}

#[test]
fn the_unit_passes_systemd_analyze_verify() {
    let unit = std::fs::read_to_string(root().join("contrib/systemd/gsonet.service")).unwrap();
    assert!(unit.contains("ExecStart=/usr/local/bin/gsonet serve --config /etc/gsonet.toml"));
    let Some((ok, said)) = systemd_verify(&[("gsonet.service", &unit)]) else {
        return;
    };
    assert!(ok && said.trim().is_empty(), "{said}");
}

#[test]
fn the_example_config_is_valid() {
    let c = gsonet::config::Config::from_file(&root().join("contrib/gsonet.toml")).unwrap();
    c.check().unwrap();
    assert_eq!(c.ports.len(), 2);
    assert_eq!(c.metrics, Some("127.0.0.1:9477".parse().unwrap()));
}

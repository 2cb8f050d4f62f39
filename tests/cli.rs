//! The command line as a user meets it: help text, configuration mistakes (exit code 2
//! with a message that names the problem), a socket another gsonet already serves.

use std::os::unix::net::UnixStream;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

fn gsonet(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_gsonet"))
        .args(args)
        .output()
        .expect("run gsonet")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn tmp(name: &str) -> String {
    format!("/tmp/gsonet-cli-{}-{name}", std::process::id())
}

struct Daemon(Child);

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn help_explains_ports_uplinks_and_offload_switches() {
    let o = gsonet(&["serve", "--help"]);
    assert!(o.status.success());
    let text = String::from_utf8_lossy(&o.stdout);
    for word in [
        "--port",
        "--uplink",
        "--config",
        "--control",
        "socket=PATH",
        "client",
        "queues=N",
        "gso=pass|software",
        "tso",
        "memory-backend-memfd",
    ] {
        assert!(text.contains(word), "serve --help lacks {word}:\n{text}");
    }
}

#[test]
fn configuration_mistakes_exit_2_with_the_reason() {
    let cases: &[(&[&str], &str)] = &[
        (&["serve"], "no --port"),
        (&["serve", "--port", "queues=2"], "missing socket="),
        (
            &["serve", "--port", "socket=/tmp/x.sock,turbo=on"],
            "unknown key \"turbo\"",
        ),
        (
            &["serve", "--port", "socket=/tmp/x.sock,queues=99"],
            "between 1 and 16",
        ),
        (
            &["serve", "--port", "socket=/tmp/x.sock,tso=maybe"],
            "expected on or off",
        ),
        (
            &["serve", "--port", "socket=/tmp/x.sock,packed=maybe"],
            "expected auto, on or off",
        ),
        (
            &[
                "serve",
                "--port",
                "socket=/tmp/x.sock",
                "--uplink",
                "tap=x,gso=fast",
            ],
            "expected pass or software",
        ),
        (
            &[
                "serve",
                "--port",
                "socket=/tmp/a.sock",
                "--port",
                "socket=/tmp/a.sock",
            ],
            "same socket",
        ),
        (
            &["serve", "--config", "/nonexistent/gsonet.toml"],
            "cannot read config file",
        ),
    ];
    for (args, want) in cases {
        let o = gsonet(args);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {}", stderr(&o));
        assert!(
            stderr(&o).contains(want),
            "{args:?}: stderr lacks {want:?}: {}",
            stderr(&o)
        );
    }
}

#[test]
fn bad_toml_names_the_file() {
    let path = tmp("bad.toml");
    std::fs::write(&path, "[[port]]\nsocket = \"/tmp/y.sock\"\nbogus = 1\n").unwrap();
    let o = gsonet(&["serve", "--config", &path]);
    let _ = std::fs::remove_file(&path);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("bogus"), "{}", stderr(&o));
}

#[test]
fn a_socket_in_use_is_refused_and_a_stale_one_reclaimed() {
    let sock = tmp("vm.sock");
    let ctl = tmp("ctl.sock");
    let ctl2 = tmp("ctl2.sock");
    let _ = std::fs::remove_file(&sock);
    // A stale socket file (nobody listening) is taken over.
    drop(std::os::unix::net::UnixListener::bind(&sock).unwrap());
    let first = Daemon(
        Command::new(env!("CARGO_BIN_EXE_gsonet"))
            .args([
                "serve",
                "--port",
                &format!("socket={sock}"),
                "--control",
                &ctl,
            ])
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    while UnixStream::connect(&ctl).is_err() {
        assert!(Instant::now() < deadline, "first gsonet never came up");
        std::thread::sleep(Duration::from_millis(50));
    }
    let o = gsonet(&[
        "serve",
        "--port",
        &format!("socket={sock}"),
        "--control",
        &ctl2,
    ]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("in use"), "{}", stderr(&o));
    // The running one still answers.
    let s = gsonet(&["stats", "--json", "--control", &ctl]);
    assert!(s.status.success(), "{}", stderr(&s));
    let v: serde_json::Value = serde_json::from_slice(&s.stdout).unwrap();
    assert_eq!(v["ports"][0]["connected"], false);
    drop(first);
    // The record of the port's packed rings, beside its socket.
    let _ = std::fs::remove_file(format!("{sock}.rings"));
}

#[test]
fn a_failed_start_up_leaves_no_socket_and_no_record_it_made() {
    // The metrics address is taken, which fails start-up after the ports' sockets
    // and records are made.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let (fresh, old) = (tmp("fresh.sock"), tmp("old.sock"));
    let (fresh_rec, old_rec) = (format!("{fresh}.rings"), format!("{old}.rings"));
    for p in [&fresh, &old, &fresh_rec, &old_rec] {
        let _ = std::fs::remove_file(p);
    }
    // A record a previous gsonet left: it holds that gsonet's rings, and stays.
    std::fs::write(&old_rec, b"").unwrap();
    let o = gsonet(&[
        "serve",
        "--port",
        &format!("socket={fresh}"),
        "--port",
        &format!("socket={old}"),
        "--control",
        &tmp("failed-ctl.sock"),
        "--metrics",
        &addr,
    ]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("metrics address"), "{}", stderr(&o));
    for gone in [&fresh, &old, &fresh_rec, &tmp("failed-ctl.sock")] {
        assert!(
            std::fs::symlink_metadata(gone).is_err(),
            "{gone} left behind"
        );
    }
    assert!(
        std::fs::symlink_metadata(&old_rec).is_ok(),
        "{old_rec} removed"
    );
    let _ = std::fs::remove_file(&old_rec);
}

#[test]
fn stats_without_a_daemon_says_so() {
    let o = gsonet(&["stats", "--control", &tmp("nobody.sock")]);
    assert_ne!(o.status.code(), Some(0));
    assert!(stderr(&o).contains("cannot reach gsonet"), "{}", stderr(&o));
}

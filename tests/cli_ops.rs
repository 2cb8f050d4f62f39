//! The finished-CLI parts: `--version` names the commit, completions and man pages
//! are generated from the command definitions, `stats --watch` prints rates of a
//! running gsonet. No root needed.

mod common;

use std::process::Command;

use common::daemon::{bin, Daemon, DaemonSpec};

fn gsonet(args: &[&str]) -> std::process::Output {
    Command::new(bin()).args(args).output().unwrap()
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

#[test]
fn version_names_the_commit() {
    let out = gsonet(&["--version"]);
    assert!(out.status.success());
    let v = text(&out.stdout);
    assert!(
        v.starts_with(&format!("gsonet {}", env!("CARGO_PKG_VERSION"))),
        "{v}"
    );
    let head = Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output();
    match head {
        Ok(h) if h.status.success() => {
            let hash = text(&h.stdout).trim().to_string();
            assert!(v.contains(&format!("(git {hash})")), "{v} vs HEAD {hash}");
        }
        _ => eprintln!("not a git checkout: the version alone is enough"),
    }
}

#[test]
fn completions_and_man_pages_are_generated() {
    let dir = std::env::temp_dir().join(format!("gsonet-gen-{}", common::daemon::unique_tag()));
    let d = dir.to_str().unwrap();
    assert!(gsonet(&["generate", "completions", d]).status.success());
    let bash = std::fs::read_to_string(dir.join("gsonet.bash")).unwrap();
    for word in ["serve", "stats", "ctl", "--metrics", "--watch"] {
        assert!(bash.contains(word), "bash completion lacks {word}");
    }
    for f in ["_gsonet", "gsonet.fish", "gsonet.elv"] {
        assert!(dir.join(f).exists(), "{f}");
    }
    assert!(gsonet(&["generate", "man", d]).status.success());
    let serve = std::fs::read_to_string(dir.join("gsonet-serve.1")).unwrap();
    assert!(serve.starts_with(".ie") || serve.contains(".TH"), "roff");
    assert!(
        serve.contains("metrics"),
        "serve's page documents --metrics"
    );
    for f in ["gsonet.1", "gsonet-stats.1", "gsonet-ctl.1"] {
        assert!(dir.join(f).exists(), "{f}");
    }
    assert!(!dir.join("gsonet-help.1").exists());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn stats_watch_prints_a_line_per_endpoint_per_report() {
    let d = Daemon::start(&DaemonSpec::ports(2)).expect("gsonet");
    let c = d.control.to_str().unwrap();
    let out = gsonet(&[
        "stats",
        "--control",
        c,
        "--watch",
        "--interval",
        "0.2",
        "--count",
        "3",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let s = text(&out.stdout);
    let header = s.lines().filter(|l| l.starts_with("endpoint")).count();
    assert_eq!(header, 1, "{s}");
    for port in ["port 0 ", "port 1 "] {
        let rows: Vec<_> = s.lines().filter(|l| l.starts_with(port)).collect();
        assert_eq!(rows.len(), 3, "{s}");
        // Nothing moves: every rate is 0.
        for r in rows {
            let nums: Vec<f64> = r
                .split_whitespace()
                .filter_map(|w| w.parse().ok())
                .collect();
            assert!(nums.iter().skip(1).all(|n| *n == 0.0), "{r}");
        }
    }
    // Bad intervals and a --count without --watch are refused (exit 2).
    for args in [
        vec!["stats", "--control", c, "--watch", "--interval", "0"],
        vec!["stats", "--control", c, "--count", "2"],
        vec!["stats", "--control", c, "--watch", "--json"],
    ] {
        assert_eq!(gsonet(&args).status.code(), Some(2), "{args:?}");
    }
}

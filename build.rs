//! Puts the git commit into `gsonet --version` (GSONET_VERSION, e.g. "0.1.0 (git
//! 1a2b3c4d5e6f)"); outside a git checkout, or without git, just the crate version.

use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    if !out.status.success() {
        return None;
    }
    let s = String::from_utf8(out.stdout).ok()?.trim().to_string();
    (!s.is_empty()).then_some(s)
}

fn main() {
    let version = env!("CARGO_PKG_VERSION");
    let full = match git(&["rev-parse", "--short=12", "HEAD"]) {
        Some(hash) => {
            // Rebuild when HEAD moves: a commit, a checkout, a branch update.
            for p in ["HEAD", "packed-refs"] {
                if let Some(path) = git(&["rev-parse", "--git-path", p]) {
                    println!("cargo:rerun-if-changed={path}");
                }
            }
            if let Some(r) = git(&["symbolic-ref", "-q", "HEAD"]) {
                if let Some(path) = git(&["rev-parse", "--git-path", &r]) {
                    println!("cargo:rerun-if-changed={path}");
                }
            }
            format!("{version} (git {hash})")
        }
        None => version.to_string(),
    };
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rustc-env=GSONET_VERSION={full}");
}

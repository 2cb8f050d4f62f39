//! The help text and docs/configuration.md against the parsers: every key a parser
//! accepts (read out of its source, the arms of its `match` on the key) must be named
//! in the `--help` of the option that takes it and in the docs section for it, so the
//! two cannot fall behind the code again. The keys come from the code, the help from
//! the built binary, the docs from the file: nothing here is a list kept by hand.

use std::collections::BTreeSet;
use std::path::Path;
use std::process::Command;

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn read(rel: &str) -> String {
    std::fs::read_to_string(root().join(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

/// The text of `src` from the first line containing `from` to the next line (after
/// it) containing `to`.
fn between<'a>(src: &'a str, from: &str, to: &str) -> &'a str {
    let a = src
        .find(from)
        .unwrap_or_else(|| panic!("{from:?} not found"));
    let rest = &src[a + from.len()..];
    let b = rest
        .find(to)
        .unwrap_or_else(|| panic!("{to:?} not after {from:?}"));
    &src[a..a + from.len() + b]
}

/// The string literals that start match arms (`"a" | "b" =>`) or are compared with
/// the key (`k == "a"`) in `code`.
fn keys_in(code: &str) -> BTreeSet<String> {
    let mut keys = BTreeSet::new();
    for line in code.lines() {
        let t = line.trim();
        if t.starts_with('"') {
            if let Some((arms, _)) = t.split_once("=>") {
                for arm in arms.split('|') {
                    let a = arm.trim();
                    if a.len() > 2 && a.starts_with('"') && a.ends_with('"') {
                        keys.insert(a[1..a.len() - 1].to_string());
                    }
                }
            }
        }
        let mut rest = t;
        while let Some(i) = rest.find("k == \"") {
            let after = &rest[i + 6..];
            let end = after.find('"').unwrap();
            keys.insert(after[..end].to_string());
            rest = &after[end..];
        }
    }
    assert!(!keys.is_empty(), "no keys found in:\n{code}");
    keys
}

/// Whether `key` is in `text` as a word of its own (not inside a longer name).
fn has_word(text: &str, key: &str) -> bool {
    let word = |c: char| c.is_ascii_alphanumeric() || c == '_';
    text.match_indices(key).any(|(i, _)| {
        let before = text[..i].chars().next_back();
        let after = text[i + key.len()..].chars().next();
        !before.is_some_and(word) && !after.is_some_and(word)
    })
}

fn missing(keys: &BTreeSet<String>, text: &str) -> Vec<String> {
    keys.iter()
        .filter(|k| !has_word(text, k))
        .cloned()
        .collect()
}

fn help(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_gsonet"))
        .args(args)
        .output()
        .unwrap();
    assert!(out.status.success(), "{args:?}");
    String::from_utf8(out.stdout).unwrap()
}

/// One option's paragraph of a clap help text (from `--name ` to the next option).
fn option_help(help: &str, name: &str) -> String {
    let start = help
        .find(&format!("--{name} "))
        .unwrap_or_else(|| panic!("--{name} not in the help"));
    let rest = &help[start..];
    let end = rest[2..].find("\n      --").map_or(rest.len(), |e| e + 2);
    rest[..end].to_string()
}

/// A section of a Markdown file: from its heading to the next heading of the same
/// level or higher.
fn section(doc: &str, heading: &str) -> String {
    let start = doc
        .find(&format!("\n{heading}\n"))
        .unwrap_or_else(|| panic!("{heading:?} not in the docs"))
        + 1;
    let level = heading.chars().take_while(|&c| c == '#').count();
    let rest = &doc[start + heading.len()..];
    let end = rest
        .lines()
        .scan(0usize, |at, l| {
            let here = *at;
            *at += l.len() + 1;
            Some((here, l))
        })
        .find(|(_, l)| {
            let n = l.chars().take_while(|&c| c == '#').count();
            n > 0 && n <= level && l.chars().nth(n) == Some(' ')
        })
        .map_or(rest.len(), |(i, _)| i);
    doc[start..start + heading.len() + end].to_string()
}

struct Keys {
    port: BTreeSet<String>,
    uplink: BTreeSet<String>,
    xen_vif: BTreeSet<String>,
    file: BTreeSet<String>,
    ctl_port: BTreeSet<String>,
    ctl_uplink: BTreeSet<String>,
}

fn parser_keys() -> Keys {
    let config = read("src/config.rs");
    let offloads: BTreeSet<String> = gsonet::features::FeatureMask::NAMES
        .iter()
        .map(|s| s.to_string())
        .collect();
    let mut port = keys_in(between(
        &config,
        "const W: &str = \"--port\";",
        "ConfigError::UnknownKey",
    ));
    port.extend(offloads.iter().cloned());
    let uplink = keys_in(between(
        &config,
        "const W: &str = \"--uplink\";",
        "ConfigError::UnknownKey",
    ));
    let mut xen_vif = keys_in(between(
        &config,
        "const W: &str = \"--xen-vif\";",
        "ConfigError::UnknownKey",
    ));
    // `auto` is a key too, the one without `=`.
    assert!(xen_vif.contains("auto"), "{xen_vif:?}");
    xen_vif.insert("domid".into());
    // The TOML file's own keys: the fields of FileConfig (deny_unknown_fields).
    let file_struct = between(&config, "struct FileConfig {", "\n}");
    let file: BTreeSet<String> = file_struct
        .lines()
        .skip(1)
        .filter_map(|l| l.trim().split_once(':'))
        .map(|(name, _)| name.trim().to_string())
        .filter(|n| !n.starts_with("#[") && !n.is_empty())
        .collect();
    let server = read("src/backend/control/server.rs");
    let rates = keys_in(between(
        &server,
        "fn take(&mut self, k: &str",
        "_ => return",
    ));
    let mut ctl_port = keys_in(between(&server, "\"port\" => {", "\"uplink\" => {"));
    ctl_port.retain(|k| k != "port");
    ctl_port.extend(rates.iter().cloned());
    let mut ctl_uplink = keys_in(between(&server, "\"uplink\" => {", "Err(TARGETS.into())"));
    ctl_uplink.retain(|k| k != "uplink");
    ctl_uplink.extend(rates.iter().cloned());
    Keys {
        port,
        uplink,
        xen_vif,
        file,
        ctl_port,
        ctl_uplink,
    }
}

#[test]
fn the_parsers_keys_are_found() {
    // The extraction itself: a few keys each parser is known to take, so a change in
    // the code's shape that hides the arms from it fails here, not silently.
    let k = parser_keys();
    for (set, some) in [
        (
            &k.port,
            &["socket", "path", "server", "gro", "rx_burst", "tso"][..],
        ),
        (&k.uplink, &["tap", "dev", "rate", "persist"]),
        (&k.xen_vif, &["domid", "auto", "queues", "nice"]),
        (&k.file, &["control", "metrics", "xen_vif", "port"]),
        (&k.ctl_port, &["gro", "rx_coalesce_frames", "burst"]),
        (&k.ctl_uplink, &["gso", "rx_rate"]),
    ] {
        for s in some {
            assert!(set.contains(*s), "{s} not in {set:?}");
        }
    }
    assert!(k.port.len() >= 30 && k.uplink.len() >= 11, "{:?}", k.port);
}

#[test]
fn serve_help_names_every_key() {
    let k = parser_keys();
    let h = help(&["serve", "--help"]);
    for (opt, keys) in [
        ("port", &k.port),
        ("uplink", &k.uplink),
        ("xen-vif", &k.xen_vif),
        ("config", &k.file),
    ] {
        let text = option_help(&h, opt);
        let gone = missing(keys, &text);
        assert!(
            gone.is_empty(),
            "serve --help, --{opt}, lacks {gone:?}:\n{text}"
        );
    }
}

#[test]
fn ctl_help_names_every_key() {
    let k = parser_keys();
    let h = help(&["ctl", "--help"]);
    let offloads = gsonet::features::FeatureMask::NAMES;
    let mut port = k.ctl_port.clone();
    port.retain(|x| !offloads.contains(&x.as_str()));
    assert!(h.contains("offload switches"), "{h}");
    let gone = missing(&port, &h);
    assert!(gone.is_empty(), "ctl --help lacks port keys {gone:?}:\n{h}");
    // The uplink keys in the part that speaks of uplinks.
    let up = &h[h.find("uplinks take").expect("uplinks take")..];
    let gone = missing(&k.ctl_uplink, up);
    assert!(
        gone.is_empty(),
        "ctl --help lacks uplink keys {gone:?}:\n{h}"
    );
}

#[test]
fn configuration_md_names_every_key() {
    let k = parser_keys();
    let doc = read("docs/configuration.md");
    for (heading, keys) in [
        ("### Port SPEC", &k.port),
        ("### Uplink SPEC", &k.uplink),
        ("### Xen vif SPEC", &k.xen_vif),
        ("### TOML file", &k.file),
    ] {
        let text = section(&doc, heading);
        let gone = missing(keys, &text);
        assert!(
            gone.is_empty(),
            "docs/configuration.md, {heading}, lacks {gone:?}"
        );
    }
    let ctl = section(&doc, "## `gsonet ctl`");
    let offloads = gsonet::features::FeatureMask::NAMES;
    let table: Vec<&str> = ctl.lines().filter(|l| l.starts_with("| ")).collect();
    for (target, keys) in [("port", &k.ctl_port), ("uplink", &k.ctl_uplink)] {
        let rows: String = table
            .iter()
            .filter(|l| l.starts_with(&format!("| {target} |")))
            .map(|l| format!("{l}\n"))
            .collect();
        let mut keys = keys.clone();
        if target == "port" {
            assert!(rows.contains("any offload switch"), "{rows}");
            keys.retain(|x| !offloads.contains(&x.as_str()));
        }
        let gone = missing(&keys, &rows);
        assert!(
            gone.is_empty(),
            "the ctl table lacks {target} keys {gone:?}:\n{rows}"
        );
    }
}

/// The serve synopsis names every option serve takes.
#[test]
fn configuration_md_synopsis_names_every_serve_option() {
    let doc = read("docs/configuration.md");
    let serve = section(&doc, "## `gsonet serve`");
    let h = help(&["serve", "--help"]);
    let opts: BTreeSet<String> = h
        .lines()
        .filter_map(|l| l.trim().strip_prefix("--"))
        .map(|l| l.split([' ', '<']).next().unwrap().to_string())
        .filter(|o| o != "help")
        .collect();
    assert!(
        opts.contains("xen-vif") && opts.contains("port"),
        "{opts:?}"
    );
    let synopsis = &serve[..serve.find("| option").unwrap_or(serve.len())];
    let gone: Vec<_> = opts
        .iter()
        .filter(|o| !synopsis.contains(&format!("--{o}")))
        .collect();
    assert!(
        gone.is_empty(),
        "the serve synopsis lacks {gone:?}:\n{synopsis}"
    );
    let table = &serve[serve.find("| option").unwrap()..];
    let gone: Vec<_> = opts
        .iter()
        .filter(|o| !table.contains(&format!("`--{o} ")))
        .collect();
    assert!(gone.is_empty(), "the serve table lacks {gone:?}");
}

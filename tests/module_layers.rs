//! The rooms of `src/` import downwards only: no circle of imports between modules,
//! at any level of the tree. Reads the sources (test code excluded) and fails naming
//! the circle if one comes back. Run alone: `cargo test --test module_layers`.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// A module path below the crate root, e.g. `["backend", "switch", "deliver"]`.
type ModPath = Vec<String>;

struct Module {
    path: ModPath,
    /// The source without comments, string contents and trailing test code.
    code: String,
}

/// Removes comments and the contents of string and char literals, so paths inside
/// them are not taken for imports.
fn strip(src: &str) -> String {
    let b = src.as_bytes();
    let mut out = String::with_capacity(src.len());
    let mut i = 0;
    while i < b.len() {
        if b[i..].starts_with(b"//") {
            while i < b.len() && b[i] != b'\n' {
                i += 1;
            }
        } else if b[i..].starts_with(b"/*") {
            i += 2;
            while i + 1 < b.len() && !b[i..].starts_with(b"*/") {
                i += 1;
            }
            i += 2;
        } else if b[i] == b'"' {
            i += 1;
            while i < b.len() && b[i] != b'"' {
                i += if b[i] == b'\\' { 2 } else { 1 };
            }
            i += 1;
            out.push_str("\"\"");
        } else if b[i] == b'\'' && i + 2 < b.len() && (b[i + 2] == b'\'' || b[i + 1] == b'\\') {
            // A char literal ('x' or '\n'); lifetimes ('a) are left alone.
            i += 1;
            while i < b.len() && b[i] != b'\'' {
                i += if b[i] == b'\\' { 2 } else { 1 };
            }
            i += 1;
        } else {
            out.push(b[i] as char);
            i += 1;
        }
    }
    out
}

/// Code before the first `#[cfg(test)]` item that is a module: test modules sit at
/// the end of a file.
fn without_tests(code: &str) -> &str {
    let mut from = 0;
    while let Some(at) = code[from..].find("#[cfg(test)]") {
        let at = from + at;
        let rest = code[at + 12..].trim_start();
        if rest.starts_with("mod ") || rest.starts_with("pub mod ") {
            // `#[cfg(test)] mod x;` declares a test-only file: not the tail.
            let line_end = rest.find('\n').unwrap_or(rest.len());
            if !rest[..line_end].trim_end().ends_with(';') {
                return &code[..at];
            }
        }
        from = at + 12;
    }
    code
}

/// Modules declared `#[cfg(test)] mod name;` in `code`.
fn test_only_children(code: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut rest = code;
    while let Some(at) = rest.find("#[cfg(test)]") {
        let after = rest[at + 12..].trim_start();
        let decl = after.strip_prefix("pub ").unwrap_or(after);
        if let Some(d) = decl.strip_prefix("mod ") {
            let name: String = d
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            if d[name.len()..].trim_start().starts_with(';') {
                out.insert(name);
            }
        }
        rest = &rest[at + 12..];
    }
    out
}

fn collect(dir: &Path, prefix: &ModPath, out: &mut Vec<Module>) {
    let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    entries.sort();
    let own = dir.join("mod.rs");
    let own = if prefix.is_empty() {
        dir.join("lib.rs")
    } else {
        own
    };
    let skip = std::fs::read_to_string(&own)
        .map(|s| test_only_children(&strip(&s)))
        .unwrap_or_default();
    for p in entries {
        let name = p.file_stem().unwrap().to_string_lossy().to_string();
        if skip.contains(&name) {
            continue;
        }
        let mut path = prefix.clone();
        if p.is_dir() {
            path.push(name);
            collect(&p, &path, out);
        } else if p.extension().is_some_and(|e| e == "rs") {
            if name == "main" {
                continue; // the binary is not part of the library's rooms
            }
            if name != "mod" && name != "lib" {
                path.push(name);
            }
            let code = strip(&std::fs::read_to_string(&p).unwrap());
            let code = without_tests(&code).to_string();
            out.push(Module { path, code });
        }
    }
}

/// Expands a `use` tree (`a::{b, c::{d, e}}`) into its paths.
fn expand(tree: &str) -> Vec<String> {
    let tree = tree.trim();
    let Some(open) = tree.find('{') else {
        let t = tree.split(" as ").next().unwrap_or(tree).trim();
        return vec![t.to_string()];
    };
    let head = tree[..open].trim_end_matches("::").trim();
    let inner = &tree[open + 1..tree.rfind('}').unwrap_or(tree.len())];
    let mut parts = Vec::new();
    let (mut depth, mut start) = (0, 0);
    for (i, c) in inner.char_indices() {
        match c {
            '{' => depth += 1,
            '}' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(&inner[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    parts.push(&inner[start..]);
    parts
        .into_iter()
        .filter(|p| !p.trim().is_empty())
        .flat_map(expand)
        .map(|p| {
            if p == "self" {
                head.to_string()
            } else if head.is_empty() {
                p
            } else {
                format!("{head}::{p}")
            }
        })
        .collect()
}

/// Every path starting with `crate::`, `super::` or `self::` in `code`: the trees of
/// `use` items, and paths written inline.
fn paths(code: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = code;
    // `use` trees first (they may span lines and braces).
    while let Some(at) = find_word(rest, "use") {
        let after = &rest[at + 3..];
        let end = after.find(';').unwrap_or(after.len());
        out.extend(expand(&after[..end]));
        rest = &after[end..];
    }
    // Inline paths anywhere.
    for start in ["crate::", "super::", "self::"] {
        let mut from = 0;
        while let Some(at) = code[from..].find(start) {
            let at = from + at;
            let boundary = at == 0 || {
                let c = code.as_bytes()[at - 1];
                !(c.is_ascii_alphanumeric() || c == b'_' || c == b':')
            };
            let p: String = code[at..]
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_' || *c == ':')
                .collect();
            if boundary {
                out.push(p.trim_end_matches(':').to_string());
            }
            from = at + start.len();
        }
    }
    out.into_iter()
        .filter(|p| p.starts_with("crate::") || p.starts_with("super") || p.starts_with("self"))
        .collect()
}

fn find_word(s: &str, w: &str) -> Option<usize> {
    let mut from = 0;
    while let Some(at) = s[from..].find(w) {
        let at = from + at;
        let before = at == 0 || !s.as_bytes()[at - 1].is_ascii_alphanumeric();
        let after = s
            .as_bytes()
            .get(at + w.len())
            .is_some_and(|c| c.is_ascii_whitespace());
        let before_ok = before && (at == 0 || s.as_bytes()[at - 1] != b'_');
        if before_ok && after {
            return Some(at);
        }
        from = at + w.len();
    }
    None
}

/// The module a path written in module `at` names: the longest known module prefix.
fn resolve(at: &ModPath, path: &str, known: &BTreeSet<ModPath>) -> ModPath {
    let mut segs: Vec<&str> = path.split("::").filter(|s| !s.is_empty()).collect();
    let mut base: ModPath = if segs.first() == Some(&"crate") {
        segs.remove(0);
        vec![]
    } else {
        at.clone()
    };
    while let Some(&s) = segs.first() {
        match s {
            "super" => {
                base.pop();
                segs.remove(0);
            }
            "self" => {
                segs.remove(0);
            }
            _ => break,
        }
    }
    let mut best = base.clone();
    let mut cur = base;
    for s in segs {
        cur.push(s.to_string());
        if known.contains(&cur) {
            best = cur.clone();
        } else {
            break;
        }
    }
    best
}

fn is_prefix(a: &ModPath, b: &ModPath) -> bool {
    a.len() <= b.len() && b[..a.len()] == a[..]
}

/// Finds a cycle in `edges`, if any.
fn cycle(edges: &BTreeMap<ModPath, BTreeSet<ModPath>>) -> Option<Vec<ModPath>> {
    fn visit(
        n: &ModPath,
        edges: &BTreeMap<ModPath, BTreeSet<ModPath>>,
        state: &mut BTreeMap<ModPath, u8>,
        stack: &mut Vec<ModPath>,
    ) -> Option<Vec<ModPath>> {
        state.insert(n.clone(), 1);
        stack.push(n.clone());
        for m in edges.get(n).into_iter().flatten() {
            match state.get(m) {
                Some(1) => {
                    let from = stack.iter().position(|x| x == m).unwrap_or(0);
                    let mut c = stack[from..].to_vec();
                    c.push(m.clone());
                    return Some(c);
                }
                Some(_) => {}
                None => {
                    if let Some(c) = visit(m, edges, state, stack) {
                        return Some(c);
                    }
                }
            }
        }
        stack.pop();
        state.insert(n.clone(), 2);
        None
    }
    let mut state = BTreeMap::new();
    for n in edges.keys() {
        if !state.contains_key(n) {
            if let Some(c) = visit(n, edges, &mut state, &mut Vec::new()) {
                return Some(c);
            }
        }
    }
    None
}

fn modules() -> Vec<Module> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut mods = Vec::new();
    collect(&src, &vec![], &mut mods);
    mods
}

/// Import edges between modules, each module collapsed to its ancestor of `depth`
/// names; edges between a module and its own ancestors (a room and its rooms) are
/// not circles.
fn edges_at(mods: &[Module], depth: usize) -> BTreeMap<ModPath, BTreeSet<ModPath>> {
    let known: BTreeSet<ModPath> = mods.iter().map(|m| m.path.clone()).collect();
    let cut = |p: &ModPath| p[..p.len().min(depth)].to_vec();
    let mut edges: BTreeMap<ModPath, BTreeSet<ModPath>> = BTreeMap::new();
    for m in mods {
        for p in paths(&m.code) {
            let to = resolve(&m.path, &p, &known);
            let (a, b) = (cut(&m.path), cut(&to));
            if a.is_empty() || b.is_empty() || is_prefix(&a, &b) || is_prefix(&b, &a) {
                continue;
            }
            edges.entry(a).or_default().insert(b);
        }
    }
    edges
}

#[test]
fn no_import_circles_at_any_depth() {
    let mods = modules();
    assert!(mods.len() > 20, "found only {} modules", mods.len());
    let deepest = mods.iter().map(|m| m.path.len()).max().unwrap_or(1);
    for depth in 1..=deepest {
        if let Some(c) = cycle(&edges_at(&mods, depth)) {
            let shown: Vec<String> = c.iter().map(|p| p.join("::")).collect();
            panic!(
                "import circle between rooms (depth {depth}): {}",
                shown.join(" -> ")
            );
        }
    }
}

#[test]
fn the_checker_sees_imports_and_circles() {
    // The parser finds use trees and inline paths, and the cycle search finds a
    // planted circle: a checker that sees nothing would pass every tree.
    let code = strip(
        "use crate::a::{b::{C, D}, e};\n// use crate::x::Y;\nfn f() { super::g::h(); let s = \"crate::q\"; }",
    );
    let found: BTreeSet<String> = paths(&code).into_iter().collect();
    for want in [
        "crate::a::b::C",
        "crate::a::b::D",
        "crate::a::e",
        "super::g::h",
    ] {
        assert!(found.contains(want), "{want} not seen in {found:?}");
    }
    assert!(
        !found.iter().any(|p| p.contains('x') || p.contains('q')),
        "{found:?}"
    );
    let p = |s: &str| -> ModPath { s.split("::").map(String::from).collect() };
    let mut e: BTreeMap<ModPath, BTreeSet<ModPath>> = BTreeMap::new();
    e.entry(p("a")).or_default().insert(p("b"));
    e.entry(p("b")).or_default().insert(p("c"));
    assert!(cycle(&e).is_none());
    e.entry(p("c")).or_default().insert(p("a"));
    assert_eq!(cycle(&e).map(|c| c.len()), Some(4));
    // And the real tree has the rooms the docs describe, with edges between them.
    let mods = modules();
    let top = edges_at(&mods, 1);
    assert!(top[&p("backend")].contains(&p("segment")) || top[&p("backend")].contains(&p("frame")));
    assert!(top[&p("frame")].contains(&p("segment")));
}

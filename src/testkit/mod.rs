//! Test support shared by unit tests, `tests/`, `benches/` and `fuzz/` (cargo feature
//! `testkit`); never part of the release library.

/// The tests every fuzz target's module has, given its `fuzz_one` and `seeds`:
/// `corpus_replays` (every file of `fuzz/corpus/<target>`, at least `min`),
/// `seeds_pass`, and the ignored `write_seeds` that writes the seed corpus
/// (`cargo test --lib <module>::target_tests::write_seeds -- --ignored`).
macro_rules! fuzz_target_tests {
    ($target:literal, $min:literal) => {
        #[cfg(test)]
        mod target_tests {
            use super::{fuzz_one, seeds};

            #[test]
            fn corpus_replays() {
                crate::testkit::replay($target, fuzz_one, $min);
            }

            #[test]
            fn seeds_pass() {
                for s in seeds() {
                    fuzz_one(&s);
                }
            }

            #[test]
            #[ignore]
            fn write_seeds() {
                crate::testkit::write_seeds($target, &seeds());
            }
        }
    };
}

pub mod frames;
pub mod fuzz;
pub mod fuzz_netif;
pub mod fuzz_packed;
pub mod fuzz_relay;
pub mod fuzz_ring;
pub mod fuzz_switch;
pub mod fuzz_vlan;
pub mod gro;
pub mod oracle;
pub mod packed_driver;
pub mod recorder;

/// Whether a test that needs `what` (root, a tap, io_uring, a tool) may run: true when
/// `ok`. When not, the test fails, since a test that did not run must not count as
/// passed, unless `GSONET_ALLOW_SKIP=1` is set; then it says SKIPPED and the caller
/// returns. `make unit` runs the tests as root, so none of them skips there.
#[must_use]
pub fn can_run(ok: bool, what: &str) -> bool {
    if ok {
        return true;
    }
    if std::env::var_os("GSONET_ALLOW_SKIP").is_some_and(|v| v == "1") {
        eprintln!("SKIPPED (GSONET_ALLOW_SKIP=1): needs {what}");
        return false;
    }
    panic!(
        "cannot run here: needs {what}. `make unit` runs the tests as root; \
         GSONET_ALLOW_SKIP=1 lets such a test skip instead of failing"
    );
}

/// `fuzz/corpus/<target>` in the source tree.
pub fn corpus_dir(target: &str) -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz/corpus")
        .join(target)
}

/// Runs every file of `fuzz/corpus/<target>` through `f` (the CI replay of a fuzz
/// target); at least `min` files must be there.
pub fn replay(target: &str, f: fn(&[u8]), min: usize) {
    let dir = corpus_dir(target);
    let mut n = 0;
    for e in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let path = e.expect("corpus entry").path();
        let data = std::fs::read(&path).expect("corpus file");
        f(&data);
        n += 1;
    }
    assert!(n >= min, "only {n} files in {}", dir.display());
}

/// Writes `seeds` into `fuzz/corpus/<target>` as `seed-NN` (the seed writers of the
/// fuzz targets' ignored tests).
pub fn write_seeds(target: &str, seeds: &[Vec<u8>]) {
    let dir = corpus_dir(target);
    std::fs::create_dir_all(&dir).unwrap();
    for (i, s) in seeds.iter().enumerate() {
        std::fs::write(dir.join(format!("seed-{i:02}")), s).unwrap();
    }
}

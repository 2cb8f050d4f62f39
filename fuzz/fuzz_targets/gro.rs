//! The GRO coalescer over fuzzer-built flows with gaps, repeats and rule breakers,
//! and over arbitrary frames (see `gsonet::testkit::gro`).
//! Run: `RUSTC_BOOTSTRAP=1 cargo fuzz run gro fuzz/corpus/gro` (fuzz/README.md).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    gsonet::testkit::gro::fuzz_one(data);
});

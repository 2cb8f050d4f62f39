//! Fuzzer-written packed rings through ring::packed::PackedRing
//! (see `gsonet::testkit::fuzz_packed`).
//! Run: `RUSTC_BOOTSTRAP=1 cargo fuzz run packed fuzz/corpus/packed` (fuzz/README.md).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    gsonet::testkit::fuzz_packed::fuzz_one(data);
});

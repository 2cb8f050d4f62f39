//! Switch::forward over fuzzer-chosen ports, uplinks and frames
//! (see `gsonet::testkit::fuzz_switch`).
//! Run: `RUSTC_BOOTSTRAP=1 cargo fuzz run switch fuzz/corpus/switch` (fuzz/README.md).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    gsonet::testkit::fuzz_switch::fuzz_one(data);
});

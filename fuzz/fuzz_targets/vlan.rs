//! vlan::classify and the push/pop views over arbitrary frames
//! (see `gsonet::testkit::fuzz_vlan`).
//! Run: `RUSTC_BOOTSTRAP=1 cargo fuzz run vlan fuzz/corpus/vlan` (fuzz/README.md).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    gsonet::testkit::fuzz_vlan::fuzz_one(data);
});

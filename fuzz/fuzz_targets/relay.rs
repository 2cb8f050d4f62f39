//! The relay's control-plane firewall over any offer and message sequence
//! (see `gsonet::testkit::fuzz_relay`).
//! Run: `RUSTC_BOOTSTRAP=1 cargo fuzz run relay fuzz/corpus/relay` (fuzz/README.md).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    gsonet::testkit::fuzz_relay::fuzz_one(data);
});

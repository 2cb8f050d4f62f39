//! Xen netif TX slots -> packet plan -> header -> TX policy
//! (see `gsonet::testkit::fuzz_netif`).
//! Run: `RUSTC_BOOTSTRAP=1 cargo fuzz run netif fuzz/corpus/netif` (fuzz/README.md).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    gsonet::testkit::fuzz_netif::fuzz_one(data);
});

//! Fuzzer-built split queues through ring::tx::TxBatch and ring::rx::write_frame
//! (see `gsonet::testkit::fuzz_ring`).
//! Run: `RUSTC_BOOTSTRAP=1 cargo fuzz run ring fuzz/corpus/ring` (fuzz/README.md).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    gsonet::testkit::fuzz_ring::fuzz_one(data);
});

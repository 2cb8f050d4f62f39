//! Arbitrary virtio_net_hdr + options + split points + frame bytes through
//! `frame::validate` and the segmenter (see `gsonet::testkit::fuzz`).
//! Run: `cargo +nightly fuzz run segment fuzz/corpus/segment`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    gsonet::testkit::fuzz::fuzz_one(data);
});

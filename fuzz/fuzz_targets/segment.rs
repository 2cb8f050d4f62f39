//! Arbitrary virtio_net_hdr + options + split points + frame bytes through
//! `vnet_hdr::validate` and `Segmenter::segment` (see `gsonet::segment::fuzz`).
//! Run: `cargo +nightly fuzz run segment fuzz/corpus/segment`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    gsonet::segment::fuzz::fuzz_one(data);
});

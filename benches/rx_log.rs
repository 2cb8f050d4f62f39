//! What the dirty-page log costs the RX path while no migration runs: the writes one
//! received frame makes into guest memory (virtio header, 1514-byte frame, used-ring
//! element, used index), through vm-memory with no bitmap at all (`()`, what gsonet
//! used before live migration) and with gsonet's `DirtyLog` switched off. Run:
//! `cargo bench --bench rx_log`.

use std::hint::black_box;
use std::sync::atomic::Ordering;

use criterion::{Criterion, Throughput};
use gsonet::ring::GuestMem;
use vm_memory::bitmap::Bitmap;
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

const FRAME: usize = 1514;
const SLOTS: u64 = 256;

/// The writes of one frame into RX buffer `slot` (2 KiB apart, from 64 KiB) and the
/// used ring (at 0).
fn write_one<B: Bitmap>(mem: &GuestMemoryMmap<B>, slot: u64, hdr: &[u8], frame: &[u8]) {
    let buf = GuestAddress(0x10000 + slot * 2048);
    mem.write_slice(hdr, buf).unwrap();
    mem.write_slice(frame, GuestAddress(buf.0 + hdr.len() as u64))
        .unwrap();
    mem.write_obj(
        [slot as u32, (hdr.len() + frame.len()) as u32],
        GuestAddress(4 + 8 * slot),
    )
    .unwrap();
    mem.store(
        (slot as u16).wrapping_add(1),
        GuestAddress(2),
        Ordering::Release,
    )
    .unwrap();
}

fn bench<B: Bitmap>(c: &mut Criterion, name: &str, mem: &GuestMemoryMmap<B>) {
    let hdr = [0u8; 12];
    let frame = vec![0x5au8; FRAME];
    let mut g = c.benchmark_group("rx_write_frame");
    g.throughput(Throughput::Elements(1));
    let mut slot = 0;
    g.bench_function(name, |b| {
        b.iter(|| {
            write_one(black_box(mem), slot, &hdr, &frame);
            slot = (slot + 1) % SLOTS;
        })
    });
    g.finish();
}

fn main() {
    let mut c = Criterion::default().configure_from_args();
    let ranges = [(GuestAddress(0), 1usize << 20)];
    let plain = GuestMemoryMmap::<()>::from_ranges(&ranges).unwrap();
    let logged = GuestMem::from_ranges(&ranges).unwrap();
    bench(&mut c, "no_bitmap", &plain);
    bench(&mut c, "dirty_log_off", &logged);
    bench(&mut c, "no_bitmap_again", &plain);
    c.final_summary();
}

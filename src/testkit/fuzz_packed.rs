//! Fuzz entry for the packed ring (`ring::packed`): a fuzzer-written descriptor ring
//! (any flags, wrap bits, ids, chains, indirect tables) in real guest memory, taken
//! in batches by `PackedRing::pop`, its used entries written and published, the
//! driver's event structure read by `wants_call`, all checked against a model
//! written from the spec over a copy of guest memory.
//!
//! Input layout: 1 byte mode (bit 0 EVENT_IDX, bit 1 every batch is given back once
//! and taken again, as an RX frame that did not fit, bit 2 VIRTIO_F_IN_ORDER's one
//! used descriptor per run of buffers, `PackedRing::batch_used`, bit 3 each buffer
//! is first asked of `take_single_writable`, as RX does, bit 4 each batch is handed
//! back with `put_used_in_order`, length 0, as TX does) | 1 byte queue
//! size (1 + b % 64, packed rings need not be a power of two) | 2 bytes start position (vring base,
//! LE; the index taken mod size) | 1 byte descriptor budget per buffer (1 + b % 64;
//! its top two bits: the bytes a single buffer must hold, 1 + 40 * b)
//! | 1 byte batch size (1 + b % 8) | 4 bytes driver event (off_wrap LE, flags LE) |
//! 8 bytes per ring descriptor (addr u16 LE, len u16 LE, id u8, flags: bit 0 NEXT,
//! bit 1 WRITE, bit 2 INDIRECT, bit 3 AVAIL, bit 4 USED, bit 5 len << 16, bit 6 len
//! 0x8000_0000) | the rest: bytes at `DATA` (indirect tables, 16 bytes per entry).
//!
//! Guest memory is `[0, 0xc000)` and `[0xd000, 0x10000)`: tables may point into the
//! hole or past the end. The ring is at 0, the driver area after it, the device
//! area after that.

use vm_memory::{Bytes, GuestAddress};

use crate::ring::host::HostMem;
use crate::ring::packed::{
    is_avail, PackedDesc, PackedRing, Popped, Pos, EVENT_DESC, EVENT_DISABLE, F_AVAIL, F_USED,
    MAX_INDIRECT,
};
use crate::ring::split::{Desc, WalkEnd};
use crate::ring::GuestMem;
use crate::testkit::packed_driver::driver_wants_call;

use super::fuzz_ring::{DATA, HOLE, MEM_END};

pub const PREFIX_LEN: usize = 10;

const NEXT: u16 = 1;
const WRITE: u16 = 2;
const INDIRECT: u16 = 4;

/// The split ring target's guest memory: `[0, HOLE.start)` and `[HOLE.end, MEM_END)`.
fn mem() -> GuestMem {
    GuestMem::from_ranges(&[
        (GuestAddress(0), HOLE.start as usize),
        (GuestAddress(HOLE.end), (MEM_END - HOLE.end) as usize),
    ])
    .expect("guest memory")
}

fn mapped(addr: u64, len: u64) -> bool {
    addr.checked_add(len)
        .is_some_and(|end| end <= MEM_END && (end <= HOLE.start || addr >= HOLE.end))
}

/// Every mapped byte, the hole read as zeros.
fn snapshot(m: &GuestMem) -> Vec<u8> {
    let mut v = vec![0u8; MEM_END as usize];
    for (from, to) in [(0, HOLE.start), (HOLE.end, MEM_END)] {
        m.read_slice(&mut v[from as usize..to as usize], GuestAddress(from))
            .expect("guest memory");
    }
    v
}

fn desc_at(snap: &[u8], at: u64) -> Option<PackedDesc> {
    if !mapped(at, 16) {
        return None;
    }
    let a = at as usize;
    Some(PackedDesc::parse(snap[a..a + 16].try_into().ok()?))
}

/// What the model expects of one `pop`.
#[derive(Debug, PartialEq, Eq)]
struct Expect {
    descs: Vec<Desc>,
    slots: u16,
    id: u16,
    end: WalkEnd,
    indirect: bool,
}

/// The spec's reading of the buffer at `at`, from a copy of memory: first the run
/// of ring slots the chain takes (available under the wrap counter of each slot,
/// chained by NEXT, at most a ring), then what those descriptors say.
fn model_pop(snap: &[u8], size: u16, at: Pos, max: usize) -> Option<Expect> {
    let head = desc_at(snap, 16 * u64::from(at.idx))?;
    if !is_avail(head.flags, at.wrap) {
        return None;
    }
    let mut run = Vec::new();
    let mut complete = false;
    let mut p = at;
    for _ in 0..size {
        let d = desc_at(snap, 16 * u64::from(p.idx)).expect("the ring is mapped");
        if !run.is_empty() && !is_avail(d.flags, p.wrap) {
            break;
        }
        run.push(d);
        p = p.advance(1, size);
        if d.flags & NEXT == 0 {
            complete = true;
            break;
        }
    }
    let slots = run.len() as u16;
    let id = run.last().expect("the head").id;
    let indirect = head.flags & INDIRECT != 0;
    let mut descs = Vec::new();
    let mut bytes = 0u64;
    let any_indirect = run.iter().any(|d| d.flags & INDIRECT != 0);
    let end = if indirect && run.len() == 1 && complete {
        model_table(snap, head, max, &mut descs)
    } else {
        let mut end = if complete {
            WalkEnd::Complete
        } else {
            WalkEnd::Broken
        };
        for d in &run {
            if d.flags & INDIRECT != 0 {
                end = WalkEnd::Broken;
                break;
            }
            bytes += u64::from(d.len);
            if bytes > u64::from(u32::MAX) {
                end = WalkEnd::Broken;
                break;
            }
            if descs.len() == max {
                end = if complete && !any_indirect {
                    WalkEnd::TooMany
                } else {
                    WalkEnd::Broken
                };
                break;
            }
            descs.push(Desc {
                addr: d.addr,
                len: d.len,
                flags: d.flags & (NEXT | WRITE | INDIRECT),
                next: 0,
            });
        }
        end
    };
    Some(Expect {
        descs,
        slots,
        id,
        end,
        indirect,
    })
}

fn model_table(snap: &[u8], head: PackedDesc, max: usize, out: &mut Vec<Desc>) -> WalkEnd {
    let len = u64::from(head.len);
    if len == 0 || len % 16 != 0 || len / 16 > MAX_INDIRECT {
        return WalkEnd::Broken;
    }
    let mut bytes = 0u64;
    for i in 0..len / 16 {
        let Some(e) = head.addr.checked_add(16 * i).and_then(|a| desc_at(snap, a)) else {
            return WalkEnd::Unreadable;
        };
        if e.flags & INDIRECT != 0 {
            return WalkEnd::Broken;
        }
        bytes += u64::from(e.len);
        if bytes > u64::from(u32::MAX) {
            return WalkEnd::Broken;
        }
        if out.len() == max {
            return WalkEnd::TooMany;
        }
        out.push(Desc {
            addr: e.addr,
            len: e.len,
            flags: e.flags & WRITE,
            next: 0,
        });
    }
    WalkEnd::Complete
}

/// Encodes a fuzz input (for seeds): `ring` is (addr, len, id, flag bits) per slot.
#[allow(clippy::too_many_arguments)]
pub fn encode(
    mode: u8,
    size: u8,
    start: u16,
    max: u8,
    batch: u8,
    event: (u16, u16),
    ring: &[(u16, u16, u8, u8)],
    data: &[u8],
) -> Vec<u8> {
    let mut v = vec![mode, size.wrapping_sub(1)];
    v.extend_from_slice(&start.to_le_bytes());
    v.extend_from_slice(&[max.wrapping_sub(1), batch.wrapping_sub(1)]);
    v.extend_from_slice(&event.0.to_le_bytes());
    v.extend_from_slice(&event.1.to_le_bytes());
    for i in 0..usize::from(size) {
        let (a, l, id, f) = ring.get(i).copied().unwrap_or_default();
        v.extend_from_slice(&a.to_le_bytes());
        v.extend_from_slice(&l.to_le_bytes());
        // Eight bytes a descriptor, as `fuzz_one` reads them: two unused.
        v.extend_from_slice(&[id, f, 0, 0]);
    }
    v.extend_from_slice(data);
    v
}

#[doc(hidden)]
pub fn fuzz_one(data: &[u8]) {
    if data.len() < PREFIX_LEN {
        return;
    }
    let event_idx = data[0] & 1 != 0;
    let retake = data[0] & 2 != 0;
    let in_order = data[0] & 4 != 0;
    let single_first = data[0] & 8 != 0;
    let tx_back = data[0] & 16 != 0;
    let need = 1 + 40 * usize::from(data[4] >> 6);
    let size = 1 + u16::from(data[1] % 64);
    let base = u16::from_le_bytes([data[2], data[3]]);
    let start = Pos {
        idx: (base & 0x7fff) % size,
        wrap: base & 0x8000 != 0,
    };
    let max = 1 + usize::from(data[4] % 64);
    let batch = 1 + usize::from(data[5] % 8);
    let event = (
        u16::from_le_bytes([data[6], data[7]]),
        u16::from_le_bytes([data[8], data[9]]),
    );
    let mut rest = &data[PREFIX_LEN..];
    let m = mem();
    let hm = HostMem::new(&m);
    for i in 0..u64::from(size) {
        let mut d = [0u8; 8];
        let k = rest.len().min(8);
        d[..k].copy_from_slice(&rest[..k]);
        rest = &rest[k..];
        let f = d[5];
        let mut len = u32::from(u16::from_le_bytes([d[2], d[3]]));
        if f & 0x20 != 0 {
            len <<= 16;
        }
        if f & 0x40 != 0 {
            len |= 0x8000_0000;
        }
        let flags = u16::from(f & 7)
            | if f & 8 != 0 { F_AVAIL } else { 0 }
            | if f & 16 != 0 { F_USED } else { 0 };
        let desc = PackedDesc {
            addr: u64::from(u16::from_le_bytes([d[0], d[1]])),
            len,
            id: u16::from(d[4]),
            flags,
        };
        m.write_slice(&desc.to_bytes(), GuestAddress(16 * i))
            .expect("ring");
    }
    let driver = 16 * u64::from(size);
    let device = driver + 4;
    m.write_obj(event.0, GuestAddress(driver))
        .expect("driver area");
    m.write_obj(event.1, GuestAddress(driver + 2))
        .expect("driver area");
    let n = rest.len().min((HOLE.start - DATA) as usize);
    m.write_slice(&rest[..n], GuestAddress(DATA)).expect("data");

    let mut r = PackedRing::new(0, driver, device, size, event_idx);
    r.batch_used = in_order;
    r.next_avail = start;
    r.next_used = start;
    let mut out = Vec::new();
    let mut taken_slots = 0u32;
    // Each slot is available under one wrap counter at a time, and a used entry
    // makes it available under neither: the ring runs dry within three laps.
    let mut rounds = 0;
    loop {
        rounds += 1;
        assert!(
            rounds <= 3 * usize::from(size) + 1,
            "the ring never runs dry"
        );
        let before = snapshot(&m);
        let since = r.next_used;
        let mark = r.used_mark();
        let mut popped: Vec<(Popped, Vec<Desc>)> = Vec::new();
        let mut at = r.next_avail;
        for _ in 0..batch {
            let want = model_pop(&before, size, at, max);
            out.clear();
            if single_first {
                // Taken in one step exactly when the buffer is one available slot
                // with one device-writable descriptor of `need` bytes or more.
                let one = want.as_ref().filter(|w| {
                    w.slots == 1
                        && !w.indirect
                        && w.end == WalkEnd::Complete
                        && w.descs.len() == 1
                        && w.descs[0].flags == WRITE
                        && w.descs[0].len as usize >= need
                });
                match r.take_single_writable(&hm, need) {
                    Some((pos, id, d)) => {
                        let w = one.expect("taken in one step, which the model refuses");
                        assert_eq!((pos, id, d), (at, w.id, w.descs[0]));
                        at = at.advance(1, size);
                        assert_eq!(r.next_avail, at);
                        let p = Popped {
                            at: pos,
                            id,
                            slots: 1,
                            end: WalkEnd::Complete,
                            indirect: false,
                        };
                        popped.push((p, vec![d]));
                        continue;
                    }
                    None => {
                        assert!(one.is_none(), "not taken in one step: {one:?}");
                        assert_eq!(r.next_avail, at);
                    }
                }
            }
            let got = r.pop(&hm, max, &mut out);
            let Some(p) = got else {
                assert!(want.is_none(), "the model takes {want:?}");
                break;
            };
            let want = want.expect("a buffer the model does not see");
            let mine = Expect {
                descs: out.clone(),
                slots: p.slots,
                id: p.id,
                end: p.end,
                indirect: p.indirect,
            };
            assert_eq!(mine, want, "buffer at {at:?}");
            assert_eq!(p.at, at);
            assert!(p.slots >= 1 && p.slots <= size);
            assert!(out.len() <= max);
            at = at.advance(p.slots, size);
            assert_eq!(r.next_avail, at);
            popped.push((p, out.clone()));
        }
        if popped.is_empty() {
            break;
        }
        if retake {
            // Given back before any entry is visible, and taken again alike.
            for (p, _) in &popped {
                assert!(r.put_used_popped(&hm, p, 0));
            }
            r.rewind_used(mark);
            r.rewind(popped[0].0.at);
            for (p, descs) in &popped {
                out.clear();
                assert_eq!(r.pop(&hm, max, &mut out).as_ref(), Some(p));
                assert_eq!(&out, descs);
            }
        }
        // What each buffer's used entry says it got: 0 for a TX batch.
        let len_of = |i: usize, descs: &[Desc]| {
            let len = descs.iter().map(|d| d.len).fold(0u32, u32::saturating_add);
            if tx_back {
                0
            } else {
                len ^ i as u32
            }
        };
        if tx_back {
            let heads = popped.iter().map(|(p, _)| (p.id, p.slots));
            assert_eq!(r.put_used_in_order(&hm, heads), 0);
        } else {
            for (i, (p, descs)) in popped.iter().enumerate() {
                assert!(r.put_used_popped(&hm, p, len_of(i, descs)));
            }
        }
        assert_eq!(r.next_used, r.next_avail, "the used side keeps step");
        assert!(r.publish_used(&hm));
        taken_slots += popped.iter().map(|(p, _)| u32::from(p.slots)).sum::<u32>();
        // The used entries (at, id, len, slots): one per buffer, or in order one per
        // run of buffers in consecutive slots, at most a ring of them, at its first
        // slot with its last buffer's id and len.
        let mut entries: Vec<(Pos, u16, u32, u16)> = Vec::new();
        let mut u = since;
        for (i, (p, descs)) in popped.iter().enumerate() {
            let len = len_of(i, descs);
            match entries.last_mut() {
                Some(run)
                    if in_order && u32::from(run.3) + u32::from(p.slots) <= u32::from(size) =>
                {
                    (run.1, run.2, run.3) = (p.id, len, run.3 + p.slots);
                }
                _ => entries.push((u, p.id, len, p.slots)),
            }
            u = u.advance(p.slots, size);
        }
        // Nothing changed but the used entries' len, id and flags.
        let after = snapshot(&m);
        let mut allowed = Vec::new();
        for &(u, id, len, _) in &entries {
            let s = 16 * usize::from(u.idx);
            let e = PackedDesc::parse(after[s..s + 16].try_into().expect("16 bytes"));
            let flags = if u.wrap { F_AVAIL | F_USED } else { 0 };
            assert_eq!(
                (e.id, e.len, e.flags),
                (id, len, flags),
                "used entry at {u:?}"
            );
            allowed.push(s + 8..s + 16);
        }
        let mut expected = before;
        for r in allowed {
            expected[r.clone()].copy_from_slice(&after[r]);
        }
        assert!(
            expected == after,
            "guest memory changed outside the used entries"
        );
        // The call decision, against the driver's own rule.
        let moved = since.distance(r.next_used, size);
        let off = Pos::from_base(event.0, size);
        let want = match event.1 {
            EVENT_DISABLE => false,
            EVENT_DESC if event_idx => match off {
                Some(e) if moved <= u32::from(size) => {
                    driver_wants_call(size, since, r.next_used, e)
                }
                _ => true,
            },
            _ => true,
        };
        let want = want && moved != 0;
        assert_eq!(r.wants_call(&hm, since), want, "since {since:?}");
    }
    assert!(taken_slots <= 3 * u32::from(size));
}

/// Seeds: well-formed chains, one across the ring's end, indirect tables, and the
/// hostile cases of the unit tests.
pub fn seeds() -> Vec<Vec<u8>> {
    const A: u8 = 8; // available in the first lap
    const U: u8 = 16;
    let n = NEXT as u8;
    let w = WRITE as u8;
    let i = INDIRECT as u8;
    let mut v = Vec::new();
    // Three buffers of 1, 2 and 3 descriptors; EVENT_IDX asking at slot 2.
    v.push(encode(
        1,
        8,
        0x8000,
        16,
        2,
        (0x8002, EVENT_DESC),
        &[
            (0x6000, 100, 0, A),
            (0x6100, 12, 1, A | n),
            (0x6200, 100, 1, A),
            (0x6300, 10, 2, A | n | w),
            (0x6400, 10, 2, A | n | w),
            (0x6500, 10, 2, A | w),
        ],
        &[],
    ));
    // A chain from slot 2 across the end (slot 0 available under the flipped
    // counter), given back and taken again; then the same with a lying wrap
    // counter at slot 0.
    for (mode, event, slot0) in [(2, 0, U), (0, 1, A)] {
        v.push(encode(
            mode,
            4,
            0x8002,
            16,
            4,
            (0, event),
            &[
                (0x6000, 30, 9, slot0),
                (0, 0, 0, 0),
                (0x6200, 10, 9, A | n),
                (0x6300, 20, 9, A | n),
            ],
            &[],
        ));
    }
    // An indirect table at DATA of three entries; one in a chain; one chained on.
    let mut table = Vec::new();
    for k in 0..3u64 {
        let e = PackedDesc {
            addr: 0x6000 + 0x100 * k,
            len: 64,
            id: 0,
            flags: if k == 2 { WRITE } else { 0 },
        };
        table.extend_from_slice(&e.to_bytes());
    }
    v.push(encode(
        3,
        4,
        0x8000,
        2,
        1,
        (0, 0),
        &[
            (DATA as u16, 48, 1, A | i),
            (0x6000, 10, 2, A | n),
            (DATA as u16, 48, 2, A | i),
            (DATA as u16, 48, 3, A | i | n),
        ],
        &table,
    ));
    // More than u32::MAX bytes; the same id twice; a chain that fills the ring.
    v.push(encode(
        1,
        3,
        0x8000,
        64,
        8,
        (0x8001, EVENT_DESC),
        &[
            (0x6000, 0x8000, 4, A | n | 0x60),
            (0x6000, 0x8000, 4, A | 0x60),
            (0x6000, 1, 4, A),
        ],
        &[],
    ));
    v.push(encode(
        0,
        2,
        0x8000,
        64,
        8,
        (0, 0),
        &[(0x6000, 1, 0, A | n), (0x6000, 1, 0, A | n)],
        &[],
    ));
    // In order: from slot 3 of 5 a buffer of one slot, one of three across the
    // end, and a chain that breaks at its second slot; the batch given back and
    // taken again, then one used descriptor for all five slots.
    v.push(encode(
        1 | 2 | 4,
        5,
        0x8003,
        16,
        8,
        (0x0001, EVENT_DESC),
        &[
            (0x6000, 10, 7, U | n),
            (0x6100, 10, 7, U),
            (0x6200, 10, 8, U | n),
            (0x6300, 100, 6, A),
            (0x6400, 10, 8, A | n),
        ],
        &[],
    ));
    // RX's one step first: a writable buffer of 100 bytes (need 41) taken in one,
    // then one too short, one readable, a chain and an indirect table by `pop`;
    // again given back and taken again, in order.
    for mode in [8, 8 | 2 | 4] {
        v.push(encode(
            mode,
            8,
            0x8000,
            0x40 | 16,
            8,
            (0, EVENT_DESC),
            &[
                (0x6000, 100, 0, A | w),
                (0x6100, 40, 1, A | w),
                (0x6200, 100, 2, A),
                (0x6300, 100, 3, A | n | w),
                (0x6400, 100, 3, A | w),
                (DATA as u16, 32, 4, A | i),
            ],
            &[],
        ));
    }
    // Handed back as TX does, in order and not: buffers of one, two and three
    // slots from slot 6 of 8, across the end, in batches of two.
    for mode in [16 | 4, 16] {
        v.push(encode(
            mode,
            8,
            0x8006,
            16,
            2,
            (0, 0),
            &[
                (0x6000, 10, 2, U | n),
                (0x6100, 10, 2, U),
                (0x6200, 10, 3, U | n),
                (0x6300, 10, 3, U | n),
                (0x6400, 10, 3, U),
                (0x6500, 10, 4, U),
                (0x6600, 10, 0, A),
                (0x6700, 10, 1, A | n),
            ],
            &[],
        ));
    }
    v
}

fuzz_target_tests!("packed", 7);

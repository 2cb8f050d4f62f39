//! `PackedRing` against a driver written from the spec (`testkit::packed_driver`),
//! and against hostile rings written by hand.

use super::*;
use crate::ring::GuestMem;
use crate::testkit::packed_driver::{driver_wants_call, Driver, Piece};
use vm_memory::{Bytes, GuestAddress};

const RING: u64 = 0x1000;
const BUFS: u64 = 0x10000;

fn mem() -> GuestMem {
    GuestMem::from_ranges(&[(GuestAddress(0), 0x40000)]).unwrap()
}

fn ring_of(d: &Driver, event_idx: bool) -> PackedRing {
    PackedRing::new(d.ring, d.driver_area, d.device_area, d.size, event_idx)
}

fn buf(i: u64, len: u32, write: bool) -> Piece {
    (BUFS + i * 0x1000, len, write)
}

fn pd(addr: u64, len: u32, id: u16, flags: u16) -> PackedDesc {
    PackedDesc {
        addr,
        len,
        id,
        flags,
    }
}

/// Writes a raw ring descriptor at `idx`.
fn raw(m: &GuestMem, idx: u16, d: PackedDesc) {
    m.write_slice(&d.to_bytes(), GuestAddress(RING + 16 * u64::from(idx)))
        .unwrap();
}

/// Flags that make a descriptor available under `wrap`.
fn avail(wrap: bool) -> u16 {
    if wrap {
        F_AVAIL
    } else {
        F_USED
    }
}

const N: u16 = 1;
const W: u16 = 2;
const I: u16 = 4;

#[test]
fn positions_wrap_and_travel_as_vring_bases() {
    let p = Pos::START;
    assert_eq!(p.advance(3, 4), Pos { idx: 3, wrap: true });
    assert_eq!(
        p.advance(4, 4),
        Pos {
            idx: 0,
            wrap: false
        }
    );
    assert_eq!(
        Pos {
            idx: 3,
            wrap: false
        }
        .advance(2, 4),
        Pos { idx: 1, wrap: true }
    );
    // The wrap counter in bit 15, as DPDK and QEMU put it in a vring base.
    assert_eq!(Pos { idx: 5, wrap: true }.to_base(), 0x8005);
    assert_eq!(
        Pos {
            idx: 5,
            wrap: false
        }
        .to_base(),
        5
    );
    for size in [1u16, 2, 256, 32768] {
        for idx in [0, size / 2, size - 1] {
            for wrap in [false, true] {
                let p = Pos { idx, wrap };
                assert_eq!(Pos::from_base(p.to_base(), size), Some(p));
            }
        }
        if size < 0x8000 {
            assert_eq!(Pos::from_base(size, size), None);
            assert_eq!(Pos::from_base(size | WRAP_BIT, size), None);
        }
        assert_eq!(
            Pos::from_base(0x7fff, size),
            (size == 0x8000).then_some(Pos {
                idx: 0x7fff,
                wrap: false
            })
        );
    }
    let s = 8;
    let a = Pos { idx: 6, wrap: true };
    assert_eq!(
        a.distance(
            Pos {
                idx: 1,
                wrap: false
            },
            s
        ),
        3
    );
    assert_eq!(a.distance(a, s), 0);
    assert_eq!(
        a.distance(
            Pos {
                idx: 6,
                wrap: false
            },
            s
        ),
        8
    );
}

#[test]
fn takes_and_completes_what_a_spec_driver_adds() {
    let m = mem();
    let h = HostMem::new(&m);
    let mut d = Driver::new(&m, RING, 8);
    let mut r = ring_of(&d, false);
    assert_eq!(r.has_avail(&h), Some(false));
    let a = d.add(&m, &[buf(0, 12, false), buf(1, 100, false)]);
    let b = d.add(&m, &[buf(2, 1500, true)]);
    let c = d.add(
        &m,
        &[buf(3, 10, false), buf(4, 20, false), buf(5, 30, true)],
    );
    let mut out = Vec::new();
    let pa = r.pop(&h, 64, &mut out).unwrap();
    assert_eq!(
        (pa.id, pa.slots, pa.end, pa.at),
        (a, 2, WalkEnd::Complete, Pos::START)
    );
    assert_eq!(
        out,
        vec![
            Desc {
                addr: BUFS,
                len: 12,
                flags: N,
                next: 0
            },
            Desc {
                addr: BUFS + 0x1000,
                len: 100,
                flags: 0,
                next: 0
            }
        ]
    );
    out.clear();
    let pb = r.pop(&h, 64, &mut out).unwrap();
    assert_eq!((pb.id, pb.slots, out[0].flags), (b, 1, W));
    out.clear();
    let pc = r.pop(&h, 64, &mut out).unwrap();
    assert_eq!((pc.id, pc.slots, out.len()), (c, 3, 3));
    assert!(out[2].is_write_only() && !out[2].has_next() && out[1].has_next());
    assert!(r.pop(&h, 64, &mut out).is_none());
    // Used entries in any completion order the device likes; here in order.
    for (p, len) in [(pa, 0), (pb, 1500), (pc, 30)] {
        assert!(r.put_used_popped(&h, &p, len));
    }
    // Nothing visible before the publish.
    assert_eq!(d.get_used(&m), None);
    assert!(r.publish_used(&h));
    assert_eq!(d.get_used(&m), Some((a, 0)));
    assert_eq!(d.get_used(&m), Some((b, 1500)));
    assert_eq!(d.get_used(&m), Some((c, 30)));
    assert_eq!(d.get_used(&m), None);
    assert_eq!(r.next_used, r.next_avail);
    assert_eq!(r.next_used, Pos { idx: 6, wrap: true });
}

#[test]
fn a_chain_across_the_ring_end_flips_the_wrap_counter_midway() {
    let m = mem();
    let h = HostMem::new(&m);
    let mut d = Driver::new(&m, RING, 4);
    let mut r = ring_of(&d, false);
    let mut out = Vec::new();
    // Two single buffers move both sides to slot 2.
    for i in 0..2 {
        d.add(&m, &[buf(i, 64, true)]);
        let p = r.pop(&h, 8, &mut out).unwrap();
        r.put_used_popped(&h, &p, 64);
    }
    r.publish_used(&h);
    assert!(d.get_used(&m).is_some() && d.get_used(&m).is_some());
    // Slots 2, 3, then 0 under the flipped wrap counter.
    let id = d.add(
        &m,
        &[buf(2, 10, false), buf(3, 20, false), buf(4, 30, false)],
    );
    out.clear();
    let p = r.pop(&h, 8, &mut out).unwrap();
    assert_eq!(
        (p.id, p.slots, p.end, out.len()),
        (id, 3, WalkEnd::Complete, 3)
    );
    assert_eq!(out[2].len, 30);
    assert_eq!(
        r.next_avail,
        Pos {
            idx: 1,
            wrap: false
        }
    );
    assert!(r.put_used_popped(&h, &p, 0));
    assert!(r.publish_used(&h));
    assert_eq!(d.get_used(&m), Some((id, 0)));
    assert_eq!((d.used_idx, d.used_wrap), (1, false));
    assert_eq!(
        r.next_used,
        Pos {
            idx: 1,
            wrap: false
        }
    );
}

#[test]
fn a_lying_wrap_counter_makes_nothing_available_or_ends_the_chain() {
    let m = mem();
    let h = HostMem::new(&m);
    let d = Driver::new(&m, RING, 4);
    // A head marked with the wrong wrap counter, one marked used, one with both
    // bits: none is available in the first lap.
    for flags in [avail(false), F_AVAIL | F_USED, 0] {
        raw(
            &m,
            0,
            PackedDesc {
                addr: BUFS,
                len: 64,
                id: 0,
                flags,
            },
        );
        let mut r = ring_of(&d, false);
        assert_eq!(r.has_avail(&h), Some(false), "{flags:#x}");
        assert!(r.pop(&h, 8, &mut Vec::new()).is_none());
        assert_eq!(r.next_avail, Pos::START);
    }
    // A chain from slot 2 across the end whose slot-0 descriptor keeps the old wrap
    // counter: the chain ends, broken, at slot 3 (the descriptors before are taken).
    let mut r = ring_of(&d, false);
    r.next_avail = Pos { idx: 2, wrap: true };
    r.next_used = r.next_avail;
    raw(&m, 2, pd(BUFS, 10, 7, avail(true) | N));
    raw(&m, 3, pd(BUFS, 10, 7, avail(true) | N));
    raw(&m, 0, pd(BUFS, 10, 7, avail(true)));
    let mut out = Vec::new();
    let p = r.pop(&h, 8, &mut out).unwrap();
    assert_eq!((p.end, p.slots, out.len()), (WalkEnd::Broken, 2, 2));
    assert_eq!(
        r.next_avail,
        Pos {
            idx: 0,
            wrap: false
        }
    );
    // Its used entry goes where the chain started, and the next buffer is sought
    // at slot 0 under the flipped counter: the liar's descriptor is not one.
    assert!(r.put_used_popped(&h, &p, 0));
    assert!(r.publish_used(&h));
    let f: u16 = m.read_obj(GuestAddress(RING + 16 * 2 + 14)).unwrap();
    assert_eq!(f, F_AVAIL | F_USED);
    assert_eq!(r.has_avail(&h), Some(false));
}

#[test]
fn a_head_made_available_before_its_chain_ends_where_the_chain_stops() {
    let m = mem();
    let h = HostMem::new(&m);
    let d = Driver::new(&m, RING, 8);
    let mut r = ring_of(&d, false);
    raw(&m, 0, pd(BUFS, 10, 1, avail(true) | N));
    raw(&m, 1, pd(BUFS, 10, 1, avail(true) | N));
    // Slot 2 not yet written.
    let mut out = Vec::new();
    let p = r.pop(&h, 8, &mut out).unwrap();
    assert_eq!((p.end, p.slots, p.id), (WalkEnd::Broken, 2, 1));
    assert_eq!(r.next_avail, Pos { idx: 2, wrap: true });
}

#[test]
fn a_chain_as_long_as_the_ring_that_points_on_is_broken() {
    let m = mem();
    let h = HostMem::new(&m);
    let d = Driver::new(&m, RING, 4);
    let mut r = ring_of(&d, false);
    for i in 0..4 {
        raw(&m, i, pd(BUFS, 10, 0, avail(true) | N));
    }
    let mut out = Vec::new();
    let p = r.pop(&h, 64, &mut out).unwrap();
    assert_eq!((p.end, p.slots, out.len()), (WalkEnd::Broken, 4, 4));
    // The whole ring taken once, not again: slot 0 under the flipped counter is not
    // available.
    assert_eq!(
        r.next_avail,
        Pos {
            idx: 0,
            wrap: false
        }
    );
    assert!(r.pop(&h, 64, &mut out).is_none());
}

#[test]
fn the_walk_budgets_take_the_whole_chain_but_keep_only_max() {
    let m = mem();
    let h = HostMem::new(&m);
    let mut d = Driver::new(&m, RING, 16);
    let mut r = ring_of(&d, false);
    let pieces: Vec<Piece> = (0..5).map(|i| buf(i, 10, false)).collect();
    let id = d.add(&m, &pieces);
    let next = d.add(&m, &[buf(9, 64, false)]);
    let mut out = Vec::new();
    let p = r.pop(&h, 3, &mut out).unwrap();
    assert_eq!(
        (p.end, p.slots, p.id, out.len()),
        (WalkEnd::TooMany, 5, id, 3)
    );
    out.clear();
    let q = r.pop(&h, 3, &mut out).unwrap();
    assert_eq!((q.end, q.id), (WalkEnd::Complete, next));
    // More than u32::MAX bytes: broken, taken whole.
    let big = d.add(
        &m,
        &[
            (BUFS, 0x8000_0000, false),
            (BUFS, 0x8000_0000, false),
            buf(0, 1, false),
        ],
    );
    out.clear();
    let p = r.pop(&h, 64, &mut out).unwrap();
    assert_eq!(
        (p.end, p.slots, p.id, out.len()),
        (WalkEnd::Broken, 3, big, 1)
    );
    // Exactly u32::MAX is a chain.
    let ok = d.add(
        &m,
        &[(BUFS, 0x8000_0000, false), (BUFS, 0x7fff_ffff, false)],
    );
    out.clear();
    let p = r.pop(&h, 64, &mut out).unwrap();
    assert_eq!((p.end, p.id), (WalkEnd::Complete, ok));
}

#[test]
fn indirect_tables_are_followed_once_and_only_alone() {
    let m = mem();
    let h = HostMem::new(&m);
    let mut d = Driver::new(&m, RING, 8);
    let mut r = ring_of(&d, false);
    let table = 0x30000;
    let id = d.add_indirect(
        &m,
        table,
        &[buf(0, 12, false), buf(1, 300, false), buf(2, 50, true)],
    );
    let mut out = Vec::new();
    let p = r.pop(&h, 64, &mut out).unwrap();
    assert_eq!(
        (p.id, p.slots, p.end, p.indirect),
        (id, 1, WalkEnd::Complete, true)
    );
    assert_eq!(
        out.iter().map(|d| (d.len, d.flags)).collect::<Vec<_>>(),
        [(12, 0), (300, 0), (50, W)]
    );
    // Over `max`: TooMany, one slot taken.
    d.add_indirect(
        &m,
        table,
        &[buf(0, 12, false), buf(1, 300, false), buf(2, 50, true)],
    );
    out.clear();
    let p = r.pop(&h, 2, &mut out).unwrap();
    assert_eq!((p.slots, p.end, out.len()), (1, WalkEnd::TooMany, 2));

    // Hostile: an indirect descriptor chained on, one inside a chain, a table of
    // bad length, an empty table, a table entry itself indirect, a table outside
    // memory.
    let cases: Vec<(Vec<PackedDesc>, WalkEnd, u16)> = vec![
        (
            vec![pd(table, 48, 3, I | N), pd(BUFS, 10, 3, 0)],
            WalkEnd::Broken,
            2,
        ),
        (
            vec![pd(BUFS, 10, 3, N), pd(table, 48, 3, I)],
            WalkEnd::Broken,
            2,
        ),
        (vec![pd(table, 40, 3, I)], WalkEnd::Broken, 1),
        (vec![pd(table, 0, 3, I)], WalkEnd::Broken, 1),
        (vec![pd(0x3fff0, 32, 3, I)], WalkEnd::Unreadable, 1),
        (vec![pd(u64::MAX - 15, 32, 3, I)], WalkEnd::Unreadable, 1),
    ];
    for (descs, want, slots) in cases {
        let mut r = ring_of(&d, false);
        r.next_avail = Pos {
            idx: 0,
            wrap: false,
        };
        for (i, mut x) in descs.into_iter().enumerate() {
            x.flags |= avail(false);
            raw(&m, i as u16, x);
        }
        out.clear();
        let p = r.pop(&h, 64, &mut out).unwrap();
        assert_eq!((p.end, p.slots), (want, slots));
        assert_eq!(
            r.next_avail,
            Pos {
                idx: slots,
                wrap: false
            }
        );
    }
    // A table whose second entry is itself indirect.
    m.write_slice(&pd(BUFS, 10, 0, 0).to_bytes(), GuestAddress(table))
        .unwrap();
    m.write_slice(&pd(table, 32, 0, I).to_bytes(), GuestAddress(table + 16))
        .unwrap();
    let mut r = ring_of(&d, false);
    r.next_avail = Pos {
        idx: 0,
        wrap: false,
    };
    raw(&m, 0, pd(table, 32, 3, I | avail(false)));
    out.clear();
    let p = r.pop(&h, 64, &mut out).unwrap();
    assert_eq!((p.end, p.slots), (WalkEnd::Broken, 1));
}

#[test]
fn an_id_reused_while_in_flight_is_handed_back_as_given() {
    let m = mem();
    let h = HostMem::new(&m);
    let d = Driver::new(&m, RING, 8);
    let mut r = ring_of(&d, false);
    // Two buffers, both id 5, the second of two slots.
    raw(&m, 0, pd(BUFS, 64, 5, avail(true)));
    raw(&m, 1, pd(BUFS, 64, 5, avail(true) | N));
    raw(&m, 2, pd(BUFS, 64, 5, avail(true)));
    let mut out = Vec::new();
    let a = r.pop(&h, 8, &mut out).unwrap();
    let b = r.pop(&h, 8, &mut out).unwrap();
    assert_eq!((a.id, a.slots, b.id, b.slots), (5, 1, 5, 2));
    assert!(r.put_used_popped(&h, &a, 1) && r.put_used_popped(&h, &b, 2));
    assert!(r.publish_used(&h));
    // Each buffer's entry where it started, the positions in step.
    for (slot, len) in [(0u64, 1u32), (1, 2)] {
        let e: [u8; 16] = m.read_obj(GuestAddress(RING + 16 * slot)).unwrap();
        let e = PackedDesc::parse(e);
        assert_eq!((e.id, e.len, e.flags), (5, len, F_AVAIL | F_USED));
    }
    assert_eq!(r.next_used, r.next_avail);
    assert_eq!(r.next_used, Pos { idx: 3, wrap: true });
}

#[test]
fn a_multi_buffer_frame_is_visible_whole_or_not_at_all() {
    // MRG_RXBUF: a frame in three buffers has three used entries, made visible
    // together; a frame given up before its publish leaves nothing behind.
    let m = mem();
    let h = HostMem::new(&m);
    let mut d = Driver::new(&m, RING, 4);
    let mut r = ring_of(&d, true);
    let mut out = Vec::new();
    for lap in 0..6 {
        let ids: Vec<u16> = (0..3).map(|i| d.add(&m, &[buf(i, 1000, true)])).collect();
        let mark = r.used_mark();
        let popped: Vec<Popped> = (0..3).map(|_| r.pop(&h, 8, &mut out).unwrap()).collect();
        for p in &popped {
            assert!(r.put_used_popped(&h, p, 1000));
        }
        assert_eq!(r.unpublished(), 3);
        if lap % 2 == 1 {
            // Given up: the used position goes back, the buffers are taken again.
            r.rewind_used(mark);
            r.rewind(popped[0].at);
            assert_eq!(r.unpublished(), 0);
            let again: Vec<Popped> = (0..3).map(|_| r.pop(&h, 8, &mut out).unwrap()).collect();
            assert_eq!(again, popped);
            for (p, len) in again.iter().zip([1000, 1000, 12]) {
                assert!(r.put_used_popped(&h, p, len));
            }
        }
        assert_eq!(d.get_used(&m), None);
        assert!(r.publish_used(&h));
        let got: Vec<(u16, u32)> = (0..3).map(|_| d.get_used(&m).unwrap()).collect();
        let lens: Vec<u32> = if lap % 2 == 1 {
            vec![1000, 1000, 12]
        } else {
            vec![1000; 3]
        };
        assert_eq!(got, ids.iter().copied().zip(lens).collect::<Vec<_>>());
        assert_eq!(d.in_flight(), 0);
    }
}

#[test]
fn many_laps_of_mixed_buffers_stay_in_step_with_the_driver() {
    let m = mem();
    let h = HostMem::new(&m);
    for size in [1u16, 2, 3, 8, 64] {
        let mut d = Driver::new(&m, RING, size);
        let mut r = ring_of(&d, true);
        let mut seed = 0x2545_f491u32 ^ u32::from(size);
        let mut rand = move |n: u32| {
            seed ^= seed << 13;
            seed ^= seed >> 17;
            seed ^= seed << 5;
            seed % n
        };
        let mut free = size;
        let mut expect = std::collections::VecDeque::new();
        let mut out = Vec::new();
        let mut done = 0usize;
        for _ in 0..2000 {
            // The driver adds what fits, the device takes a batch, the driver reaps.
            while free > 0 && rand(3) != 0 {
                let n = 1 + rand(u32::from(free.min(4))) as u16;
                let pieces: Vec<Piece> = (0..n)
                    .map(|i| buf(u64::from(i), 1 + rand(100), true))
                    .collect();
                let id = if rand(4) == 0 {
                    d.add_indirect(&m, 0x30000 + 0x100 * u64::from(d.avail_idx), &pieces)
                } else {
                    d.add(&m, &pieces)
                };
                expect.push_back((id, pieces));
                free = size - in_flight_slots(&d, size);
            }
            let batch = rand(5) as usize;
            for _ in 0..batch {
                out.clear();
                let Some(p) = r.pop(&h, 64, &mut out) else {
                    break;
                };
                let (id, pieces) = expect.pop_front().unwrap();
                assert_eq!(p.id, id);
                assert_eq!(p.end, WalkEnd::Complete);
                assert_eq!(
                    out.iter().map(|x| x.len).collect::<Vec<_>>(),
                    pieces.iter().map(|p| p.1).collect::<Vec<_>>()
                );
                assert!(r.put_used_popped(&h, &p, out.len() as u32));
                done += 1;
            }
            assert!(r.publish_used(&h));
            while d.get_used(&m).is_some() {}
            free = size - in_flight_slots(&d, size);
        }
        // Many laps of the ring, with the wrap counters flipped many times.
        assert!(
            done > 20 * usize::from(size) && done > 500,
            "{done} buffers"
        );
    }
}

#[test]
fn in_order_a_publish_is_one_used_descriptor_for_its_run_of_buffers() {
    let m = mem();
    let h = HostMem::new(&m);
    let mut d = Driver::new(&m, RING, 8);
    let mut r = ring_of(&d, false);
    r.batch_used = true;
    // Two, one and three slots: slots 0, 2 and 3 are heads.
    let a = d.add(&m, &[buf(0, 12, false), buf(1, 100, false)]);
    let b = d.add(&m, &[buf(2, 60, false)]);
    let c = d.add(
        &m,
        &[buf(3, 10, false), buf(4, 20, false), buf(5, 30, false)],
    );
    let mut out = Vec::new();
    let popped: Vec<Popped> = (0..3).map(|_| r.pop(&h, 64, &mut out).unwrap()).collect();
    let before = (0..8u16)
        .map(|i| {
            m.read_obj::<u16>(GuestAddress(RING + 16 * u64::from(i) + 14))
                .unwrap()
        })
        .collect::<Vec<_>>();
    // An entry recorded and taken back before the publish is not in the run.
    let mark = r.used_mark();
    for p in &popped {
        assert!(r.put_used_popped(&h, p, 0));
    }
    r.rewind_used(mark);
    for p in &popped {
        assert!(r.put_used_popped(&h, p, 0));
    }
    assert!(r.publish_used(&h));
    // One descriptor, at the run's first slot, with the last buffer's id.
    let first = PackedDesc::parse(m.read_obj(GuestAddress(RING)).unwrap());
    assert_eq!(
        (first.id, first.flags & (F_AVAIL | F_USED)),
        (c, F_AVAIL | F_USED)
    );
    for i in 1..8u16 {
        let f: u16 = m
            .read_obj(GuestAddress(RING + 16 * u64::from(i) + 14))
            .unwrap();
        assert_eq!(f, before[usize::from(i)], "slot {i} written");
    }
    assert_eq!(d.get_used_in_order(&m), Some((vec![a, b, c], 0)));
    assert_eq!(d.get_used_in_order(&m), None);
    assert_eq!(r.next_used, Pos { idx: 6, wrap: true });
    assert_eq!((d.used_idx, d.used_wrap), (6, true));
}

#[test]
fn in_order_runs_break_at_a_gap_and_at_a_ring_of_slots() {
    let m = mem();
    let h = HostMem::new(&m);
    let mut r = PackedRing::new(RING, RING + 16 * 4, RING + 16 * 4 + 4, 4, false);
    r.batch_used = true;
    // Four buffers of two slots, as a driver that laps the ring while the device
    // holds it (it can only lie to do so): runs of four slots at most, so two
    // runs, both at slot 0, the second lap's written first.
    for id in 1..=4u16 {
        assert!(r.put_used(&h, id, 2, u32::from(id)));
    }
    assert!(r.publish_used(&h));
    let d = PackedDesc::parse(m.read_obj(GuestAddress(RING)).unwrap());
    assert_eq!((d.id, d.len, d.flags), (2, 2, F_AVAIL | F_USED));
    assert_eq!(r.next_used, Pos::START);
    // A slot outside guest memory leaves a gap: the run stops before it.
    let mut r = PackedRing::new(0x3_fff0, 0, 0, 4, false);
    r.batch_used = true;
    assert!(r.put_used(&h, 7, 1, 0));
    assert!(!r.put_used(&h, 8, 1, 0));
    r.unpublished.push(Used {
        at: Pos { idx: 2, wrap: true },
        id: 9,
        len: 0,
        slots: 1,
    });
    r.batch_runs();
    assert_eq!(
        r.unpublished
            .iter()
            .map(|u| (u.id, u.slots))
            .collect::<Vec<_>>(),
        vec![(7, 1), (9, 1)]
    );
}

#[test]
fn in_order_laps_of_batches_stay_in_step_with_an_in_order_driver() {
    let m = mem();
    let h = HostMem::new(&m);
    for size in [1u16, 2, 3, 8, 64] {
        let mut d = Driver::new(&m, RING, size);
        let mut r = ring_of(&d, true);
        r.batch_used = true;
        let mut seed = 0x9e37_79b9u32 ^ u32::from(size);
        let mut rand = move |n: u32| {
            seed ^= seed << 13;
            seed ^= seed >> 17;
            seed ^= seed << 5;
            seed % n
        };
        let mut out = Vec::new();
        let mut done = 0usize;
        for _ in 0..2000 {
            while in_flight_slots(&d, size) < size && rand(3) != 0 {
                let free = size - in_flight_slots(&d, size);
                let n = 1 + rand(u32::from(free.min(4))) as u16;
                let pieces: Vec<Piece> = (0..n).map(|i| buf(u64::from(i), 64, false)).collect();
                d.add(&m, &pieces);
            }
            let mut ids = Vec::new();
            for _ in 0..rand(5) {
                out.clear();
                let Some(p) = r.pop(&h, 64, &mut out) else {
                    break;
                };
                assert!(r.put_used_popped(&h, &p, 0));
                ids.push(p.id);
            }
            assert!(r.publish_used(&h));
            if !ids.is_empty() {
                assert_eq!(d.get_used_in_order(&m), Some((ids.clone(), 0)));
                done += ids.len();
            }
            assert_eq!(d.get_used_in_order(&m), None);
            assert_eq!(
                (d.used_idx, d.used_wrap),
                (r.next_used.idx, r.next_used.wrap)
            );
        }
        assert!(done > 500, "{done} buffers");
    }
}

/// Slots the driver has made available that it has not had back.
fn in_flight_slots(d: &Driver, size: u16) -> u16 {
    let a = Pos {
        idx: d.avail_idx,
        wrap: d.avail_wrap,
    };
    let u = Pos {
        idx: d.used_idx,
        wrap: d.used_wrap,
    };
    u.distance(a, size) as u16
}

#[test]
fn event_idx_call_window_matches_the_drivers_rule() {
    let m = mem();
    let h = HostMem::new(&m);
    let size = 8u16;
    let d = Driver::new(&m, RING, size);
    let all: Vec<Pos> = (0..2 * size)
        .map(|i| Pos {
            idx: i % size,
            wrap: i < size,
        })
        .collect();
    let mut calls = 0;
    for &since in &all {
        for n in 1..=size {
            let now = since.advance(n, size);
            for &event in &all {
                d.set_event(&m, EVENT_DESC, event.idx, event.wrap);
                let mut r = ring_of(&d, true);
                r.next_used = now;
                let want = driver_wants_call(size, since, now, event);
                calls += usize::from(want);
                assert_eq!(
                    r.wants_call(&h, since),
                    want,
                    "since {since:?} now {now:?} event {event:?}"
                );
            }
        }
    }
    // Each of the n positions passed asks for exactly one event position.
    assert_eq!(
        calls,
        (2 * size as usize) * (1..=size as usize).sum::<usize>()
    );
    // Flags: DISABLE never, ENABLE always, DESC without EVENT_IDX always, a bad
    // event offset always; no movement never.
    let mut r = ring_of(&d, false);
    r.next_used = Pos { idx: 1, wrap: true };
    for (flags, want) in [
        (EVENT_DISABLE, false),
        (EVENT_ENABLE, true),
        (EVENT_DESC, true),
        (3, true),
    ] {
        d.set_event(&m, flags, 5, true);
        assert_eq!(r.wants_call(&h, Pos::START), want, "flags {flags}");
        assert!(!r.wants_call(&h, r.next_used));
    }
    r.event_idx = true;
    d.set_event(&m, EVENT_DESC, size + 1, true);
    assert!(r.wants_call(&h, Pos::START));
}

#[test]
fn kicks_are_asked_for_at_the_next_buffer_or_not_at_all() {
    let m = mem();
    let h = HostMem::new(&m);
    let mut d = Driver::new(&m, RING, 8);
    let mut r = ring_of(&d, true);
    r.next_avail = Pos {
        idx: 3,
        wrap: false,
    };
    assert_eq!(r.enable_kicks(&h), Some(false));
    assert_eq!(d.device_event(&m), (EVENT_DESC, 3));
    r.disable_kicks(&h).unwrap();
    assert_eq!(d.device_event(&m).0, EVENT_DISABLE);
    r.event_idx = false;
    r.next_avail = Pos::START;
    d.add(&m, &[buf(0, 10, false)]);
    assert_eq!(r.enable_kicks(&h), Some(true));
    assert_eq!(d.device_event(&m).0, EVENT_ENABLE);
    // A device area outside memory is a broken ring, not a crash.
    r.device = 0x40000;
    assert_eq!(r.enable_kicks(&h), None);
    assert_eq!(r.disable_kicks(&h), None);
}

#[test]
fn a_full_queue_asks_for_a_kick_past_the_buffers_it_has() {
    let m = mem();
    let h = HostMem::new(&m);
    let mut d = Driver::new(&m, RING, 8);
    let r = ring_of(&d, true);
    // Three buffers (one of two slots) from slot 0, too few for the device: the
    // kick is asked for at slot 4, the first the driver has not made available.
    d.add(&m, &[buf(0, 10, true)]);
    d.add(&m, &[buf(1, 10, true), buf(2, 10, true)]);
    d.add(&m, &[buf(3, 10, true)]);
    assert_eq!(r.ask_kick(&h), Some(false));
    assert_eq!(d.device_event(&m), (EVENT_DESC, 4 | WRAP_BIT));
    // The driver's next buffer lands there: it kicks (the wish is in what it
    // added), and a device asking now sees the buffer.
    let old = Pos { idx: 4, wrap: true };
    d.add(&m, &[buf(4, 10, true)]);
    let event = Pos::from_base(d.device_event(&m).1, 8).unwrap();
    assert!(driver_wants_call(8, old, old.advance(1, 8), event));
    assert_eq!(r.ask_kick(&h), Some(false));
    assert_eq!(d.device_event(&m), (EVENT_DESC, 5 | WRAP_BIT));
    // Past the ring's end, under the next lap's wrap counter.
    let mut r2 = ring_of(&d, true);
    r2.next_avail = Pos { idx: 5, wrap: true };
    for i in 5..8 {
        d.add(&m, &[buf(i, 10, true)]);
    }
    assert_eq!(r2.ask_kick(&h), Some(false));
    assert_eq!(d.device_event(&m), (EVENT_DESC, 0));
    // Without EVENT_IDX: a kick for every buffer.
    let r3 = ring_of(&d, false);
    assert_eq!(r3.ask_kick(&h), Some(true));
    assert_eq!(d.device_event(&m).0, EVENT_ENABLE);
}

#[test]
fn positions_go_through_the_vring_as_bases() {
    use virtio_queue::{Queue, QueueT};
    let m = mem();
    let h = HostMem::new(&m);
    let d = Driver::new(&m, RING, 8);
    let mut q = Queue::new(8).unwrap();
    q.set_desc_table_address(Some(RING as u32), Some(0));
    q.set_avail_ring_address(Some(d.driver_area as u32), Some(0));
    q.set_used_ring_address(Some(d.device_area as u32), Some(0));
    // SET_VRING_BASE as QEMU and DPDK send it: index 5, wrap counter 0.
    q.set_next_avail(5);
    q.set_next_used(5);
    let mut r = PackedRing::of(&q);
    assert_eq!(
        (r.desc, r.driver, r.device),
        (RING, d.driver_area, d.device_area)
    );
    assert_eq!(
        r.next_avail,
        Pos {
            idx: 5,
            wrap: false
        }
    );
    r.next_avail = Pos {
        idx: 7,
        wrap: false,
    }
    .advance(2, 8);
    r.next_used = r.next_avail;
    r.store(&mut q);
    // GET_VRING_BASE reads index 1 with the wrap counter set.
    assert_eq!(q.next_avail(), 0x8001);
    assert_eq!(PackedRing::of(&q).next_avail, Pos { idx: 1, wrap: true });
    // A base outside the ring: broken, nothing taken, nothing written.
    q.set_next_avail(9);
    let mut r = PackedRing::of(&q);
    assert_eq!(r.has_avail(&h), None);
    assert!(r.pop(&h, 8, &mut Vec::new()).is_none());
    q.set_next_used(0x8008);
    let mut r = PackedRing::of(&q);
    assert!(!r.put_used(&h, 0, 1, 0));
}

#[test]
fn a_ring_outside_memory_is_broken_not_a_crash() {
    // A hole at [0x20000, 0x20004): slot 0 of a ring at 0x1fff8 has its flags
    // mapped, not all of its bytes.
    let m = GuestMem::from_ranges(&[(GuestAddress(0), 0x20000), (GuestAddress(0x20004), 0x1000)])
        .unwrap();
    let h = HostMem::new(&m);
    m.write_obj(avail(true), GuestAddress(0x1fff8 + 14))
        .unwrap();
    let mut r = PackedRing::new(0x1fff8, 0x100, 0x104, 4, true);
    assert_eq!(r.has_avail(&h), Some(true));
    let p = r.pop(&h, 8, &mut Vec::new()).unwrap();
    // One slot taken, so that the ring moves on; its entry cannot be written.
    assert_eq!((p.end, p.slots), (WalkEnd::Unreadable, 1));
    assert_eq!(r.next_avail, Pos { idx: 1, wrap: true });
    assert!(!r.put_used_popped(&h, &p, 0));
    assert_eq!(r.next_used, r.next_avail);
    assert!(r.publish_used(&h));
    // A ring past the end of memory.
    let r = PackedRing::new(0x30000, 0x100, 0x104, 4, true);
    assert_eq!(r.has_avail(&h), None);
    // Slots outside 1..=size are refused.
    let mut r = PackedRing::new(0x1000, 0x100, 0x104, 4, true);
    assert!(!r.put_used(&h, 0, 0, 0));
    assert!(!r.put_used(&h, 0, 5, 0));
    assert!(r.put_used(&h, 0, 4, 0));
    assert_eq!(
        r.next_used,
        Pos {
            idx: 0,
            wrap: false
        }
    );
}

/// A prefetch ahead takes nothing and changes no position, whatever the slots
/// hold: buffers outside guest memory or as long as can be, a device-readable one,
/// and positions past the end of the ring.
#[test]
fn prefetching_ahead_takes_nothing_from_any_ring() {
    let m = mem();
    let h = HostMem::new(&m);
    let mut d = Driver::new(&m, RING, 8);
    d.add(&m, &[(u64::MAX - 8, 64, true)]);
    d.add(&m, &[(BUFS, u32::MAX, true)]);
    d.add(&m, &[buf(2, 64, false)]);
    d.add(&m, &[buf(3, 64, true)]);
    let r = ring_of(&d, false);
    let (avail, used) = (r.next_avail, r.next_used);
    for (skip, n) in [
        (0, 4),
        (0, 8),
        (7, 1),
        (3, 6),
        (8, 1),
        (u16::MAX, 2),
        (0, u16::MAX),
    ] {
        r.prefetch_writes(&h, skip, n);
    }
    assert_eq!((r.next_avail, r.next_used), (avail, used));
    let mut out = Vec::new();
    assert_eq!(
        r.clone().pop(&h, 8, &mut out).map(|p| p.at),
        Some(Pos::START)
    );
}

//! The slot rules against hand-made rings, and proptests: any run of slots is either
//! refused with a reason or yields fragments that add up to the packet; the header a
//! csum_blank packet stands for points where etherparse finds the L4 header.

use super::*;
use crate::testkit::frames::{build, FrameSpec};
use proptest::prelude::*;

fn req(gref: u32, offset: u16, flags: u16, id: u16, size: u16) -> [u8; TX_SLOT] {
    TxRequest {
        gref,
        offset,
        flags,
        id,
        size,
    }
    .encode()
}

fn extra(bytes: [u8; 8]) -> [u8; TX_SLOT] {
    let mut b = [0u8; TX_SLOT];
    b[..8].copy_from_slice(&bytes);
    b
}

fn parse(slots: &[[u8; TX_SLOT]]) -> TxParse {
    parse_tx(|i| slots[i as usize], slots.len() as u32)
}

fn run(slots: &[[u8; TX_SLOT]]) -> TxRun {
    match parse(slots) {
        TxParse::Run(r) => r,
        other => panic!("expected a run, got {other:?}"),
    }
}

#[test]
fn a_packet_in_three_slots_with_a_gso_extra() {
    let slots = [
        req(
            10,
            100,
            TXF_CSUM_BLANK | TXF_MORE_DATA | TXF_EXTRA_INFO,
            1,
            9000,
        ),
        extra(gso_extra(1448, GSO_TYPE_TCPV4, false)),
        req(11, 0, TXF_MORE_DATA, 2, 4096),
        req(12, 0, 0, 3, 1000),
    ];
    let r = run(&slots);
    assert_eq!(r.ids, vec![Some(1), None, Some(2), Some(3)]);
    let p = r.packet.unwrap();
    assert_eq!(p.len, 9000);
    assert_eq!(p.gso, Some((GsoKind::TcpV4, 1448)));
    let lens: Vec<u16> = p.frags.iter().map(|f| f.len).collect();
    assert_eq!(lens, vec![9000 - 4096 - 1000, 4096, 1000]);
    assert_eq!((p.frags[0].gref, p.frags[0].offset), (10, 100));
}

#[test]
fn a_run_past_the_producer_waits_and_a_full_ring_of_it_is_broken() {
    let slots = [
        req(1, 0, TXF_MORE_DATA, 1, 3000),
        req(2, 0, TXF_MORE_DATA, 2, 1000),
    ];
    assert_eq!(parse(&slots), TxParse::Incomplete);
    let endless = vec![req(1, 0, TXF_MORE_DATA, 1, 100); TX_RING_SIZE as usize];
    assert_eq!(parse(&endless), TxParse::RingBroken);
    assert_eq!(parse(&[]), TxParse::Incomplete);
    // An extra-info chain that runs past the producer waits too.
    let ex = [
        req(1, 0, TXF_EXTRA_INFO, 1, 100),
        extra([1, EXTRA_FLAG_MORE, 0, 1, 1, 0, 0, 0]),
    ];
    assert_eq!(parse(&ex), TxParse::Incomplete);
}

#[test]
fn bad_runs_are_refused_whole_with_their_reason() {
    let cases: Vec<(Vec<[u8; TX_SLOT]>, DropReason)> = vec![
        // 19 data slots.
        (
            (0..19)
                .map(|i| {
                    req(
                        i,
                        0,
                        if i < 18 { TXF_MORE_DATA } else { 0 },
                        i as u16,
                        if i == 0 { 1900 } else { 100 },
                    )
                })
                .collect(),
            DropReason::XenTooManySlots,
        ),
        // Later slots hold more than the packet.
        (
            vec![req(1, 0, TXF_MORE_DATA, 1, 100), req(2, 0, 0, 2, 200)],
            DropReason::XenSlotsMismatch,
        ),
        // A slot running past its page.
        (vec![req(1, 4000, 0, 1, 200)], DropReason::XenSlotsMismatch),
        (
            vec![req(1, 0, TXF_MORE_DATA, 1, 5000), req(2, 100, 0, 2, 4000)],
            DropReason::XenSlotsMismatch,
        ),
        // GSO extras: size 0, unknown type, twice; an unknown extra.
        (
            vec![
                req(1, 0, TXF_CSUM_BLANK | TXF_EXTRA_INFO, 1, 100),
                extra(gso_extra(0, GSO_TYPE_TCPV4, false)),
            ],
            DropReason::GsoSizeZero,
        ),
        (
            vec![
                req(1, 0, TXF_CSUM_BLANK | TXF_EXTRA_INFO, 1, 100),
                extra(gso_extra(1400, 9, false)),
            ],
            DropReason::XenBadGsoType,
        ),
        (
            vec![
                req(1, 0, TXF_CSUM_BLANK | TXF_EXTRA_INFO, 1, 100),
                extra(gso_extra(1400, GSO_TYPE_TCPV4, true)),
                extra(gso_extra(1400, GSO_TYPE_TCPV6, false)),
            ],
            DropReason::XenBadExtra,
        ),
        (
            vec![
                req(1, 0, TXF_EXTRA_INFO, 1, 100),
                extra([7, 0, 0, 0, 0, 0, 0, 0]),
            ],
            DropReason::XenBadExtra,
        ),
        (
            vec![
                req(1, 0, TXF_EXTRA_INFO, 1, 100),
                extra([0, 0, 0, 0, 0, 0, 0, 0]),
            ],
            DropReason::XenBadExtra,
        ),
        // GSO without csum_blank; a runt.
        (
            vec![
                req(1, 0, TXF_EXTRA_INFO, 1, 100),
                extra(gso_extra(1400, GSO_TYPE_TCPV4, false)),
            ],
            DropReason::XenGsoWithoutCsumBlank,
        ),
        (vec![req(1, 0, 0, 1, 13)], DropReason::TooShort),
    ];
    for (slots, reason) in cases {
        let r = run(&slots);
        assert_eq!(r.packet, Err(reason), "{slots:?}");
        assert_eq!(
            r.ids.len(),
            slots.len(),
            "the whole run is consumed: {reason:?}"
        );
    }
}

#[test]
fn responses_and_extras_have_the_netif_layout() {
    assert_eq!(
        tx_response(0x1234, RSP_ERROR)[..4],
        [0x34, 0x12, 0xff, 0xff]
    );
    assert_eq!(
        rx_response(5, 0, RXF_MORE_DATA, 4096),
        [5, 0, 0, 0, 4, 0, 0, 0x10]
    );
    assert_eq!(
        gso_extra(1448, GSO_TYPE_TCPV6, false),
        [1, 0, 0xa8, 0x05, 2, 0, 0, 0]
    );
    assert_eq!(
        rx_request(&[7, 0, 0, 0, 0x44, 0x33, 0x22, 0x11]),
        (7, 0x1122_3344)
    );
    assert_eq!((tx_slot_off(0), tx_slot_off(257)), (64, 76));
    assert_eq!(rx_slot_off(255), 64 + 8 * 255);
    // Every slot of both rings fits its page.
    assert!(tx_slot_off(TX_RING_SIZE - 1) + TX_SLOT <= PAGE);
    assert!(rx_slot_off(RX_RING_SIZE - 1) + RX_SLOT <= PAGE);
}

#[test]
fn rx_frames_take_page_slots_with_the_gso_extra_second() {
    let mut s = Vec::new();
    rx_slots(9000, true, &mut s);
    assert_eq!(
        s,
        vec![
            RxSlot::Data { at: 0, len: 4096 },
            RxSlot::Gso,
            RxSlot::Data {
                at: 4096,
                len: 4096
            },
            RxSlot::Data { at: 8192, len: 808 },
        ]
    );
    rx_slots(60, false, &mut s);
    assert_eq!(s, vec![RxSlot::Data { at: 0, len: 60 }]);
    rx_slots(65535 + 14, true, &mut s);
    assert!(s.len() <= NR_SLOTS_MIN + 1);
}

#[test]
fn netfront_features_map_to_caps() {
    let all = FrontFeatures {
        sg: true,
        gso_tcpv4: true,
        gso_tcpv6: true,
        no_csum_offload: false,
        ipv6_csum_offload: true,
    };
    let c = rx_caps(all, true, true);
    assert!(c.csum && c.tso4 && c.tso6 && !c.ufo && !c.uso4 && !c.uso6);
    let no4 = rx_caps(
        FrontFeatures {
            gso_tcpv4: false,
            ..all
        },
        true,
        true,
    );
    assert!(!no4.tso4 && no4.tso6);
    let nosg = rx_caps(FrontFeatures { sg: false, ..all }, true, true);
    assert!(nosg.csum && !nosg.tso4 && !nosg.tso6);
    let nocsum = rx_caps(
        FrontFeatures {
            no_csum_offload: true,
            ..all
        },
        true,
        true,
    );
    assert_eq!(nocsum, Caps::default());
    assert!(
        !rx_caps(
            FrontFeatures {
                ipv6_csum_offload: false,
                ..all
            },
            true,
            true
        )
        .csum
    );
    assert!(!rx_caps(all, true, false).tso4);
    assert_eq!(rx_caps(all, false, true), Caps::default());
    assert!(tx_caps(true, true).accepts(GsoType::new(GsoKind::TcpV6)));
    assert!(!tx_caps(true, true).accepts(GsoType::new(GsoKind::UdpL4)));
    assert!(!tx_caps(false, true).csum);
}

#[test]
fn rx_flags_follow_the_header() {
    let mut h = VirtioNetHdr {
        flags: F_NEEDS_CSUM,
        ..VirtioNetHdr::default()
    };
    assert_eq!(rx_flags(&h), RXF_CSUM_BLANK | RXF_DATA_VALIDATED);
    h.flags = F_DATA_VALID;
    assert_eq!(rx_flags(&h), RXF_DATA_VALIDATED);
    h.flags = 0;
    assert_eq!(rx_flags(&h), 0);
}

fn plan_of(flags: u16, gso: Option<(GsoKind, u16)>, len: usize) -> TxPlan {
    TxPlan {
        frags: Vec::new(),
        len,
        flags,
        gso,
    }
}

proptest! {
    /// Whatever the slots say, a run is consumed whole (ids for every slot up to the
    /// end of its chain), and an accepted packet's fragments stay within their pages,
    /// number at most 18 and add up to its size.
    #[test]
    fn any_slots_parse_into_a_consistent_run(
        raw in proptest::collection::vec((any::<u32>(), 0u16..4200, 0u16..16, any::<u16>(), 0u16..9000), 1..24),
        extras in proptest::collection::vec(any::<[u8; 8]>(), 0..3),
    ) {
        let mut slots: Vec<[u8; TX_SLOT]> = Vec::new();
        for (i, (g, o, f, id, s)) in raw.iter().enumerate() {
            slots.push(req(*g, *o, *f, *id, *s));
            if i == 0 {
                slots.extend(extras.iter().map(|e| extra(*e)));
            }
        }
        match parse(&slots) {
            TxParse::Run(r) => {
                prop_assert!(r.ids.len() <= slots.len());
                if let Ok(p) = r.packet {
                    prop_assert!(p.frags.len() <= NR_SLOTS_MIN);
                    let sum: usize = p.frags.iter().map(|f| usize::from(f.len)).sum();
                    prop_assert_eq!(sum, p.len);
                    for f in &p.frags {
                        prop_assert!(usize::from(f.offset) + usize::from(f.len) <= PAGE);
                    }
                    if let Some((_, size)) = p.gso {
                        prop_assert!(size > 0);
                        prop_assert!(p.flags & TXF_CSUM_BLANK != 0);
                    }
                }
            }
            TxParse::Incomplete => prop_assert!(slots.len() < TX_RING_SIZE as usize),
            TxParse::RingBroken => prop_assert!(slots.len() >= TX_RING_SIZE as usize),
        }
    }

    /// A csum_blank packet's header puts the checksum where etherparse finds the TCP
    /// or UDP header, and a GSO packet's hdr_len covers exactly the headers.
    #[test]
    fn csum_blank_points_at_the_l4_header(v6: bool, tcp: bool, n in 0usize..3000, mss in 500u16..1500) {
        let spec = FrameSpec { payload: vec![3; n], v6, tcp, ..FrameSpec::default() };
        let (f, _) = build(&spec);
        let kind = if v6 { GsoKind::TcpV6 } else { GsoKind::TcpV4 };
        let gso = (tcp && n > usize::from(mss)).then_some((kind, mss));
        let h = tx_header(&plan_of(TXF_CSUM_BLANK, gso, f.len()), &f).unwrap();
        let sliced = etherparse::SlicedPacket::from_ethernet(&f).unwrap();
        let payload_len = match sliced.transport {
            Some(etherparse::TransportSlice::Tcp(t)) => t.payload().len(),
            Some(etherparse::TransportSlice::Udp(u)) => u.payload().len(),
            _ => unreachable!(),
        };
        let l4_hdr = if tcp { f.len() - payload_len - usize::from(h.csum_start) } else { 8 };
        prop_assert_eq!(usize::from(h.csum_start) + l4_hdr + payload_len, f.len());
        prop_assert_eq!(h.csum_offset, if tcp { 16 } else { 6 });
        prop_assert!(h.needs_csum());
        if gso.is_some() {
            prop_assert_eq!(usize::from(h.hdr_len), f.len() - payload_len);
            prop_assert_eq!(h.gso_size, mss);
        } else {
            prop_assert!(!h.gso.is_gso());
        }
    }
}

#[test]
fn data_validated_and_blank_headers_on_other_protocols() {
    let (f, _) = build(&FrameSpec::tcp(false, 100));
    let h = tx_header(&plan_of(TXF_DATA_VALIDATED, None, f.len()), &f).unwrap();
    assert_eq!(h.flags, F_DATA_VALID);
    assert_eq!(
        tx_header(&plan_of(0, None, f.len()), &f).unwrap(),
        VirtioNetHdr::default()
    );
    // csum_blank on something that is not TCP or UDP (an ARP frame) is refused.
    let mut arp = vec![0xffu8; 6];
    arp.extend_from_slice(&[2, 0, 0, 0, 0, 1, 0x08, 0x06]);
    arp.resize(42, 0);
    assert_eq!(
        tx_header(&plan_of(TXF_CSUM_BLANK, None, arp.len()), &arp),
        Err(DropReason::BadHeaders)
    );
}

//! Fuzz entry for the netif TX path: any ring slots through `netif::parse_tx`, and an
//! accepted packet's bytes through `netif::tx_header` and the TX header policy, as a
//! netfront's packet goes before it reaches the switch. Also checks the RX slot plan
//! of every accepted packet covers its bytes once.
//!
//! Input layout: 1 byte slot count n | n * 12 bytes TX slots | packet bytes (repeated
//! to the packet's size).

use crate::frame::validate::tx_frame;
use crate::netif::{self, RxSlot, TxParse, NR_SLOTS_MIN, PAGE, TX_SLOT};

/// Encodes a fuzz input (for seed corpora).
pub fn encode(slots: &[[u8; TX_SLOT]], bytes: &[u8]) -> Vec<u8> {
    let mut v = vec![slots.len() as u8];
    for s in slots {
        v.extend_from_slice(s);
    }
    v.extend_from_slice(bytes);
    v
}

pub fn fuzz_one(data: &[u8]) {
    let Some((&n, rest)) = data.split_first() else {
        return;
    };
    let n = usize::from(n);
    if rest.len() < n * TX_SLOT {
        return;
    }
    let (raw, bytes) = rest.split_at(n * TX_SLOT);
    let slot = |i: u32| -> [u8; TX_SLOT] {
        let i = i as usize;
        raw[i * TX_SLOT..(i + 1) * TX_SLOT]
            .try_into()
            .unwrap_or([0; TX_SLOT])
    };
    let (mut ids, mut frags) = (Vec::new(), Vec::new());
    let run = match netif::parse_tx(slot, n as u32, &mut ids, &mut frags) {
        TxParse::Run(r) => r,
        TxParse::Incomplete | TxParse::RingBroken => {
            assert!(ids.is_empty() && frags.is_empty());
            return;
        }
    };
    assert!(!ids.is_empty() && ids.len() <= n && ids.len() == run.slots as usize);
    assert!(ids[0].is_some(), "a run starts with a request");
    let Ok(plan) = run.packet else {
        assert!(frags.is_empty());
        return;
    };
    assert!(frags.len() <= NR_SLOTS_MIN);
    let sum: usize = frags.iter().map(|f| usize::from(f.len)).sum();
    assert_eq!(sum, plan.len);
    for f in &frags {
        assert!(usize::from(f.offset) + usize::from(f.len) <= PAGE);
    }
    let frame: Vec<u8> = if bytes.is_empty() {
        vec![0; plan.len]
    } else {
        bytes.iter().copied().cycle().take(plan.len).collect()
    };
    let mut slots = Vec::new();
    netif::rx_slots(frame.len(), plan.gso.is_some(), &mut slots);
    let covered: usize = slots
        .iter()
        .map(|s| match s {
            RxSlot::Data { len, .. } => *len,
            RxSlot::Gso => 0,
        })
        .sum();
    assert_eq!(covered, frame.len());
    let Ok(hdr) = netif::tx_header(&plan, &[&frame]) else {
        return;
    };
    if hdr.needs_csum() {
        assert!(usize::from(hdr.csum_start) + usize::from(hdr.csum_offset) + 2 <= frame.len());
    }
    let parts = [&frame[..]];
    if let Ok(f) = tx_frame(netif::tx_caps(true, true), hdr, &parts) {
        assert_eq!(f.len, frame.len());
        assert_eq!(f.hdr.gso.is_gso(), plan.gso.is_some());
    }
}

/// Seeds: a plain frame, a TSO packet in three slots with its GSO extra, and the
/// malformed runs of the unit tests.
pub fn seeds() -> Vec<Vec<u8>> {
    use crate::netif::{
        gso_extra, TxRequest, GSO_TYPE_TCPV4, TXF_CSUM_BLANK, TXF_EXTRA_INFO, TXF_MORE_DATA,
    };
    use crate::testkit::frames::{build, pattern, FrameSpec};
    let req = |flags, id, size, offset| {
        TxRequest {
            gref: 8,
            offset,
            flags,
            id,
            size,
        }
        .encode()
    };
    let extra = |b: [u8; 8]| {
        let mut s = [0u8; TX_SLOT];
        s[..8].copy_from_slice(&b);
        s
    };
    let (small, _) = build(&FrameSpec::tcp(false, 100));
    let (big, _) = build(&FrameSpec {
        payload: pattern(6000),
        ..FrameSpec::default()
    });
    let big_len = big.len() as u16;
    vec![
        encode(&[req(TXF_CSUM_BLANK, 1, small.len() as u16, 0)], &small),
        encode(
            &[
                req(
                    TXF_CSUM_BLANK | TXF_EXTRA_INFO | TXF_MORE_DATA,
                    1,
                    big_len,
                    0,
                ),
                extra(gso_extra(1448, GSO_TYPE_TCPV4, false)),
                req(TXF_MORE_DATA, 2, 4000, 0),
                req(0, 3, big_len - 4000 - 1000, 96),
            ],
            &big,
        ),
        encode(&[req(TXF_MORE_DATA, 1, 100, 0), req(0, 2, 200, 0)], &small),
        encode(
            &[
                req(TXF_CSUM_BLANK | TXF_EXTRA_INFO, 1, 100, 0),
                extra(gso_extra(0, GSO_TYPE_TCPV4, false)),
            ],
            &small,
        ),
        encode(&[req(0, 1, 200, 4000)], &small),
    ]
}

fuzz_target_tests!("netif", 5);

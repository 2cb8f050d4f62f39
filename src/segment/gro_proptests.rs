//! Property tests of GRO: random flows (TCP or UDP, v4/v6, tags, timestamps, MSS,
//! partial or complete checksums), interleaved, with gaps, repeats and every rule breaker mixed
//! in. Every coalesced frame is checked by etherparse and cut again by the segmenter:
//! each flow's segments must come back in order, byte for byte.

use std::collections::BTreeMap;

use proptest::prelude::*;

use super::gro::{Coalescer, MAX_SEGS};
use crate::testkit::gro::*;

fn cases() -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(64)
}

fn flow(sport: u16) -> impl Strategy<Value = Flow> {
    (
        (any::<bool>(), any::<bool>(), any::<bool>()),
        (any::<bool>(), any::<bool>(), prop::bool::weighted(0.3)),
        prop_oneof![2 => 1usize..2000, 1 => 1400usize..1460, 1 => 8000usize..9000],
        any::<u32>(),
        any::<u16>(),
    )
        .prop_map(
            move |((v6, vlan, timestamps), (full, valid, udp), mss, seq0, id0)| Flow {
                udp,
                v6,
                vlan,
                timestamps,
                sport,
                mss,
                full,
                valid,
                seq0,
                id0,
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(cases()))]

    /// One flow in order: coalesced into as few frames as the limits allow, and the
    /// frames cut again give back every segment byte for byte.
    #[test]
    fn one_flow_round_trips(
        f in flow(1000),
        n in 1usize..150,
        last in any::<prop::sample::Index>(),
        end in prop_oneof![Just(Twist::None), Just(Twist::Psh), Just(Twist::Fin)],
        split in 0usize..200,
    ) {
        let last_len = 1 + last.index(f.mss);
        let inputs: Vec<_> = (0..n)
            .map(|i| {
                let (len, t) = if i + 1 == n { (last_len, end) } else { (f.mss, Twist::None) };
                segment(&f, i, i * f.mss, len, t)
            })
            .collect();
        let out = run(&mut Coalescer::new(), &inputs, split);
        let full = BTreeMap::from([(f.sport, f.full)]);
        prop_assert_eq!(expand(&out, &full), by_flow(&inputs));
        // As few frames as the limits allow: 64 segments and 64 KiB of L3 each.
        let l4 = match (f.udp, f.timestamps) {
            (true, _) => 8,
            (false, ts) => 20 + if ts { 12 } else { 0 },
        };
        let hdrs = if f.v6 { 40 } else { 20 } + l4;
        let per = MAX_SEGS.min((0xffff - hdrs) / f.mss).max(1);
        prop_assert_eq!(out.len(), n.div_ceil(per), "{:?}", out.iter().map(|o| o.2).collect::<Vec<_>>());
    }

    /// Three flows interleaved, with gaps, repeats and rule breakers: each flow comes
    /// back in order and byte for byte, and a rule breaker always leaves alone.
    #[test]
    fn mixed_flows_and_rule_breakers(
        flows in (flow(1000), flow(1001), flow(1002)),
        steps in prop::collection::vec((0usize..3, 0usize..Twist::ALL.len(), 0u8..8), 1..200),
        split in 0usize..200,
    ) {
        let flows = [flows.0, flows.1, flows.2];
        let mut next = [0usize; 3];
        let mut inputs = Vec::new();
        let mut breakers = Vec::new();
        for (fi, t, step) in steps {
            let fl = &flows[fi];
            // Mostly plain segments in order; now and then a twist, a gap, a repeat.
            let t = if step < 5 { Twist::None } else { Twist::ALL[t] };
            let i = match step {
                5 => next[fi] + 1,
                6 if next[fi] > 0 => next[fi] - 1,
                _ => next[fi],
            };
            let len = if t == Twist::Short { 1 + fl.mss / 3 } else { fl.mss };
            let id = repeat_id(fl, i, next[fi]);
            let seg = segment(fl, id, i * fl.mss, len, t);
            if t.breaks(fl) {
                breakers.push(seg.1.clone());
            }
            inputs.push(seg);
            next[fi] = id.max(i) + 1;
        }
        let out = run(&mut Coalescer::new(), &inputs, split);
        let full = flows.iter().map(|f| (f.sport, f.full)).collect();
        prop_assert_eq!(expand(&out, &full), by_flow(&inputs));
        for b in breakers {
            prop_assert!(
                out.iter().any(|(h, f, _)| !h.gso.is_gso() && *f == b),
                "a rule breaker did not leave alone"
            );
        }
    }
}

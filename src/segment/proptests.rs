//! Property tests: random frames (v4/v6, TCP/UDP, options, VLAN, extension headers,
//! payload sizes, gso sizes, caps, scatter split points) through the segmenter, every
//! output checked by the etherparse oracle. `PROPTEST_CASES` raises the case count.

use proptest::prelude::*;

use super::*;
use crate::frame::validate::validate;
use crate::testkit::frames::*;
use crate::testkit::oracle::*;

fn cases() -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(64)
}

#[derive(Clone, Debug)]
struct Case {
    spec: FrameSpec,
    kind: GsoKind,
    gso: u16,
    opts: SegmentOpts,
    points: Vec<usize>,
}

fn ip6_exts() -> impl Strategy<Value = Vec<(u8, u8)>> {
    prop_oneof![
        3 => Just(vec![]),
        1 => Just(vec![(0, 0)]),
        1 => Just(vec![(0, 1), (60, 0), (43, 0)]),
        1 => Just(vec![(0, 0), (60, 0)]),
        1 => Just(vec![(43, 0), (60, 1)]),
    ]
}

fn tcp_opts() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        2 => Just(vec![]),
        2 => Just(tcp_timestamps()),
        1 => (0usize..=40).prop_map(|n| vec![1u8; n]),
    ]
}

fn case() -> impl Strategy<Value = Case> {
    (
        (any::<bool>(), any::<bool>(), any::<bool>()),
        prop::collection::vec(prop_oneof![Just(0x8100u16), Just(0x88a8)], 0..=2),
        (0usize..=10).prop_map(|n| vec![1u8; n * 4]),
        ip6_exts(),
        tcp_opts(),
        (any::<u8>(), any::<u16>(), any::<u32>()),
        prop_oneof![3 => 0usize..3000, 1 => 0usize..65000],
        prop_oneof![2 => 1u16..9000, 1 => 1u16..64, 1 => 1400u16..1500],
        (any::<bool>(), prop::option::weighted(0.3, 576usize..9000)),
        prop::collection::vec(any::<prop::sample::Index>(), 0..8),
    )
        .prop_map(
            |(
                (v6, tcp, uso),
                vlans,
                ip4_opts,
                ip6_exts,
                tcp_opts,
                (flags, id, seq),
                len,
                gso,
                (partial, cap),
                idx,
            )| {
                // At most ~1000 segments per frame to keep debug runs quick.
                let len = len.min(usize::from(gso) * 1000);
                let spec = FrameSpec {
                    vlans,
                    v6,
                    ip4_opts,
                    ip6_exts,
                    tcp,
                    tcp_opts,
                    tcp_flags: flags,
                    ip_id: id,
                    seq,
                    payload: pattern(len),
                    ..FrameSpec::default()
                };
                let kind = match (tcp, v6, uso) {
                    (true, false, _) => GsoKind::TcpV4,
                    (true, true, _) => GsoKind::TcpV6,
                    (false, _, true) => GsoKind::UdpL4,
                    (false, _, false) => GsoKind::Udp,
                };
                let flen = build(&spec).0.len();
                let points = idx.iter().map(|i| i.index(flen + 1)).collect();
                let csum = if partial {
                    CsumMode::Partial
                } else {
                    CsumMode::Full
                };
                Case {
                    spec,
                    kind,
                    gso,
                    opts: SegmentOpts {
                        csum,
                        max_frame: cap,
                    },
                    points,
                }
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(cases()))]

    #[test]
    fn segments_check_out_with_etherparse(c in case()) {
        let (f, l4) = build(&c.spec);
        let hdr = gso_hdr(c.kind, c.gso, l4, c.spec.tcp);
        let frame = split(&f, &c.points);
        match run(&hdr, &frame, &c.opts) {
            Ok((sum, segs)) => {
                check(&c.spec, &hdr, &c.opts, &sum, &segs);
                let mss_bound = match c.kind {
                    GsoKind::Udp => usize::from(c.gso).max(f.len() - l4),
                    _ => usize::from(c.gso),
                };
                prop_assert!(sum.mss <= mss_bound);
                prop_assert!(sum.complete);
            }
            // Fragments of fewer than 8 bytes (or too small for the IPv6 headers
            // travelling in the first fragment) cannot be made.
            Err(SegmentError::FragmentTooSmall { .. }) if c.kind == GsoKind::Udp => {}
            Err(e) => prop_assert!(false, "unexpected error {e:?}"),
        }
        // What validate accepts, segment does (without a cap), and both count the
        // segments the oracle derives from the frame.
        if let Ok(v) = validate(&hdr, &frame) {
            let r = run(&hdr, &frame, &SegmentOpts::default());
            prop_assert!(r.is_ok(), "validated but {r:?}");
            let want = expect(&c.spec, &hdr, &SegmentOpts::default()).sizes.len();
            prop_assert_eq!(v.segments(), want);
            prop_assert_eq!(r.unwrap().0.segments, want);
        }
    }
}

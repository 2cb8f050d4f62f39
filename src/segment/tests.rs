//! Table tests of the segmenter: the boundary cases of Linux's udpgso.c and tap.c
//! selftests (MSS and MSS+1, gso_size 1 and 2, 128 segments, IPv6 extension headers),
//! checked with the etherparse oracle in `testkit::oracle`.

use super::*;
use crate::testkit::frames::*;
use crate::testkit::oracle::*;
use crate::vnet_hdr::{GsoType, F_DATA_VALID};

const MSS4: usize = 1472;
const MSS6: usize = 1452;

/// Builds, splits at `points`, segments, checks with the oracle; returns the sizes.
fn case_with(
    spec: &FrameSpec,
    kind: GsoKind,
    gso: u16,
    opts: SegmentOpts,
    points: &[usize],
) -> (SegmentSummary, Checked) {
    let (f, l4) = build(spec);
    let hdr = gso_hdr(kind, gso, l4, spec.tcp);
    let frame = split(&f, points);
    let (sum, segs) = run(&hdr, &frame, &opts).expect("segmentation failed");
    let checked = check(spec, &hdr, &opts, &sum, &segs);
    // Partial mode gives the same segmentation.
    let popts = SegmentOpts {
        csum: CsumMode::Partial,
        ..opts
    };
    let (psum, psegs) = run(&hdr, &frame, &popts).expect("partial segmentation failed");
    check(spec, &hdr, &popts, &psum, &psegs);
    (sum, checked)
}

fn case(spec: &FrameSpec, kind: GsoKind, gso: u16) -> Vec<usize> {
    case_with(
        spec,
        kind,
        gso,
        SegmentOpts::default(),
        &[7, 20, 40, 61, 1000],
    )
    .1
    .payloads
}

#[test]
fn uso_mss_boundaries_v4_and_v6() {
    for (v6, mss) in [(false, MSS4), (true, MSS6)] {
        let g = mss as u16;
        assert_eq!(case(&FrameSpec::udp(v6, mss), GsoKind::UdpL4, g), vec![mss]);
        assert_eq!(
            case(&FrameSpec::udp(v6, mss), GsoKind::UdpL4, g + 1),
            vec![mss]
        );
        assert_eq!(
            case(&FrameSpec::udp(v6, mss + 1), GsoKind::UdpL4, g),
            vec![mss, 1]
        );
        assert_eq!(
            case(&FrameSpec::udp(v6, 2 * mss), GsoKind::UdpL4, g),
            vec![mss, mss]
        );
        assert_eq!(
            case(&FrameSpec::udp(v6, 2 * mss + 1), GsoKind::UdpL4, g),
            vec![mss, mss, 1]
        );
    }
    let p = case(
        &FrameSpec::udp(false, 65535 - 28),
        GsoKind::UdpL4,
        MSS4 as u16,
    );
    assert_eq!(p.len(), 45);
    assert!(p[..44].iter().all(|&n| n == MSS4));
    assert_eq!(p[44], 65507 - 44 * MSS4);
}

#[test]
fn uso_tiny_gso_sizes() {
    assert_eq!(case(&FrameSpec::udp(false, 1), GsoKind::UdpL4, 1), vec![1]);
    assert_eq!(
        case(&FrameSpec::udp(false, 2), GsoKind::UdpL4, 1),
        vec![1, 1]
    );
    assert_eq!(
        case(&FrameSpec::udp(true, 128), GsoKind::UdpL4, 1),
        vec![1; 128]
    );
    assert_eq!(
        case(&FrameSpec::udp(false, 5), GsoKind::UdpL4, 2),
        vec![2, 2, 1]
    );
    // 129 segments: the segmenter itself has no policy limit; validate refuses it
    // (see vnet_hdr tests).
    assert_eq!(
        case(&FrameSpec::udp(false, 129), GsoKind::UdpL4, 1).len(),
        129
    );
}

#[test]
fn tcp_mss_boundaries_and_short_last_segment() {
    for v6 in [false, true] {
        assert_eq!(
            case(&FrameSpec::tcp(v6, 1448), GsoKind::TcpV4.v(v6), 1448),
            vec![1448]
        );
        assert_eq!(
            case(&FrameSpec::tcp(v6, 1449), GsoKind::TcpV4.v(v6), 1448),
            vec![1448, 1]
        );
        assert_eq!(
            case(
                &FrameSpec::tcp(v6, 2 * 1448 + 1),
                GsoKind::TcpV4.v(v6),
                1448
            ),
            vec![1448, 1448, 1]
        );
        assert_eq!(
            case(&FrameSpec::tcp(v6, 1000), GsoKind::TcpV4.v(v6), 1448),
            vec![1000]
        );
        assert_eq!(
            case(&FrameSpec::tcp(v6, 0), GsoKind::TcpV4.v(v6), 1448),
            vec![0]
        );
        let p = case(&FrameSpec::tcp(v6, 65535 - 80), GsoKind::TcpV4.v(v6), 1448);
        assert_eq!(p.len(), (65535 - 80usize).div_ceil(1448));
        assert_eq!(*p.last().unwrap(), (65535 - 80) % 1448);
    }
}

trait V6 {
    fn v(self, v6: bool) -> Self;
}
impl V6 for GsoKind {
    fn v(self, v6: bool) -> Self {
        match (self, v6) {
            (GsoKind::TcpV4, true) => GsoKind::TcpV6,
            (k, _) => k,
        }
    }
}

#[test]
fn tcp_flags_placement_and_ip_id_sequence() {
    // FIN|PSH|ACK|CWR|ECE on the input: FIN/PSH on the last only, CWR on the first.
    let mut s = FrameSpec::tcp(false, 5000);
    s.tcp_flags = 0x01 | 0x08 | 0x10 | 0x80 | 0x40;
    s.ip_id = 0xfffe; // wraps
    let (f, l4) = build(&s);
    let mut hdr = gso_hdr(GsoKind::TcpV4, 1448, l4, true);
    hdr.gso = GsoType {
        kind: GsoKind::TcpV4,
        ecn: true,
    };
    let (sum, segs) = run(&hdr, &[&f], &SegmentOpts::default()).unwrap();
    check(&s, &hdr, &SegmentOpts::default(), &sum, &segs);
    let flags: Vec<u8> = segs.iter().map(|(_, b)| b[14 + 20 + 13]).collect();
    assert_eq!(
        flags,
        vec![0x10 | 0x80 | 0x40, 0x50, 0x50, 0x10 | 0x40 | 0x01 | 0x08]
    );
    let ids: Vec<u16> = segs
        .iter()
        .map(|(_, b)| u16::from_be_bytes([b[18], b[19]]))
        .collect();
    assert_eq!(ids, vec![0xfffe, 0xffff, 0, 1]);
}

#[test]
fn tcp_with_timestamps_vlan_and_ip_options() {
    let mut s = FrameSpec::tcp(false, 4000);
    s.tcp_opts = tcp_timestamps();
    s.vlans = vec![0x88a8, 0x8100];
    s.ip4_opts = vec![0x94, 4, 0, 0]; // router alert
    assert_eq!(case(&s, GsoKind::TcpV4, 1448), vec![1448, 1448, 1104]);
    let mut s6 = FrameSpec::tcp(true, 3000);
    s6.tcp_opts = tcp_timestamps();
    s6.vlans = vec![0x8100];
    assert_eq!(case(&s6, GsoKind::TcpV6, 1428), vec![1428, 1428, 144]);
}

#[test]
fn ipv6_with_hop_by_hop_and_more_extension_headers() {
    let mut s = FrameSpec::tcp(true, 3000);
    s.ip6_exts = vec![(0, 0)];
    assert_eq!(case(&s, GsoKind::TcpV6, 1400), vec![1400, 1400, 200]);
    let mut u = FrameSpec::udp(true, 3000);
    u.ip6_exts = vec![(0, 1), (60, 0), (43, 0), (60, 2)];
    assert_eq!(case(&u, GsoKind::UdpL4, 1400), vec![1400, 1400, 200]);
    // UFO: the Fragment header goes after the routing header; the trailing
    // destination options travel in the first fragment.
    let p = case(&u, GsoKind::Udp, 1400);
    assert_eq!(p.iter().sum::<usize>(), 24 + 8 + 3000);
    let mut d = FrameSpec::udp(true, 3000);
    d.ip6_exts = vec![(0, 0), (60, 0)];
    case(&d, GsoKind::Udp, 1000);
}

#[test]
fn ufo_v4_and_v6_fragments() {
    // v4: fragment payload (UDP header + data) of gso_size rounded down to 8.
    assert_eq!(
        case(&FrameSpec::udp(false, 4000), GsoKind::Udp, 1480),
        vec![1480, 1480, 1048]
    );
    assert_eq!(
        case(&FrameSpec::udp(false, 4000), GsoKind::Udp, 1475),
        vec![1472, 1472, 1064]
    );
    assert_eq!(
        case(&FrameSpec::udp(true, 4000), GsoKind::Udp, 1448),
        vec![1448, 1448, 1112]
    );
    // Fits in one datagram: no fragmentation.
    assert_eq!(
        case(&FrameSpec::udp(false, 1472), GsoKind::Udp, 1480),
        vec![1472]
    );
    assert_eq!(
        case(&FrameSpec::udp(false, 65507), GsoKind::Udp, 1480).len(),
        65515usize.div_ceil(1480)
    );
    // gso_size < 8 cannot fragment.
    let (f, l4) = build(&FrameSpec::udp(false, 100));
    let hdr = gso_hdr(GsoKind::Udp, 7, l4, false);
    assert!(matches!(
        run(&hdr, &[&f], &SegmentOpts::default()),
        Err(SegmentError::FragmentTooSmall { .. })
    ));
}

#[test]
fn ufo_v4_strips_uncopied_options_after_first_fragment() {
    let mut s = FrameSpec::udp(false, 3000);
    s.ip4_opts = vec![7, 7, 4, 0, 0, 0, 0, 1, 0x94, 4, 0, 0]; // record route, NOP, router alert
    let (f, l4) = build(&s);
    let hdr = gso_hdr(GsoKind::Udp, 1400, l4, false);
    let (sum, segs) = run(&hdr, &[&f], &SegmentOpts::default()).unwrap();
    check(&s, &hdr, &SegmentOpts::default(), &sum, &segs);
    assert_eq!(segs[0].1[34..46], f[34..46]);
    assert_eq!(segs[1].1[34..46], [1, 1, 1, 1, 1, 1, 1, 1, 0x94, 4, 0, 0]);
}

#[test]
fn max_frame_caps_l3_size() {
    let opts = SegmentOpts {
        max_frame: Some(1500),
        ..SegmentOpts::default()
    };
    let (sum, c) = case_with(
        &FrameSpec::tcp(false, 9000),
        GsoKind::TcpV4,
        9000,
        opts,
        &[3],
    );
    assert_eq!(sum.mss, 1460);
    assert_eq!(c.payloads.len(), 7);
    let mut s = FrameSpec::tcp(true, 9000);
    s.tcp_opts = tcp_timestamps();
    let (sum, _) = case_with(&s, GsoKind::TcpV6, 8000, opts, &[]);
    assert_eq!(sum.mss, 1428);
    let (sum, _) = case_with(
        &FrameSpec::udp(false, 5000),
        GsoKind::UdpL4,
        4000,
        opts,
        &[],
    );
    assert_eq!(sum.mss, 1472);
    let (sum, _) = case_with(&FrameSpec::udp(true, 5000), GsoKind::Udp, 4000, opts, &[]);
    assert_eq!(sum.mss, 1448);
    let tiny = SegmentOpts {
        max_frame: Some(40),
        ..SegmentOpts::default()
    };
    let (f, l4) = build(&FrameSpec::tcp(false, 100));
    let hdr = gso_hdr(GsoKind::TcpV4, 50, l4, true);
    assert_eq!(
        run(&hdr, &[&f], &tiny).unwrap_err(),
        SegmentError::CapTooSmall {
            cap: 40,
            headers: 40
        }
    );
}

#[test]
fn every_split_point_gives_the_same_output() {
    let mut s = FrameSpec::tcp(false, 300);
    s.tcp_opts = tcp_timestamps();
    s.vlans = vec![0x8100];
    let (f, l4) = build(&s);
    let hdr = gso_hdr(GsoKind::TcpV4, 100, l4, true);
    let (_, want) = run(&hdr, &[&f], &SegmentOpts::default()).unwrap();
    for a in 0..f.len() {
        for b in [a, a + 1, a + 17, a + 101] {
            let frame = split(&f, &[a, b, b]);
            let (_, got) = run(&hdr, &frame, &SegmentOpts::default()).unwrap();
            assert_eq!(got, want, "split {a} {b}");
        }
    }
}

#[test]
fn payload_is_referenced_not_copied() {
    let s = FrameSpec::tcp(false, 3000);
    let (f, l4) = build(&s);
    let hdr = gso_hdr(GsoKind::TcpV4, 1448, l4, true);
    let range = f.as_ptr_range();
    let mut n = 0;
    Segmenter::new()
        .segment(&hdr, &[&f], &SegmentOpts::default(), |seg| {
            assert_eq!(seg.parts[0].len(), 54);
            for p in &seg.parts[1..] {
                assert!(range.contains(&p.as_ptr()));
            }
            n += 1;
            true
        })
        .unwrap();
    assert_eq!(n, 3);
}

/// Segmenting from segment k (what a frame partly delivered before asks for) gives
/// exactly segments k.. of the whole run, for TCP over both IP versions and USO
/// over IPv4, with the full and the partial checksum.
#[test]
fn segmenting_from_k_gives_the_whole_runs_tail() {
    for (tcp, kind) in [
        (true, GsoKind::TcpV4),
        (true, GsoKind::TcpV6),
        (false, GsoKind::UdpL4),
    ] {
        let v6 = kind == GsoKind::TcpV6;
        let spec = if tcp {
            FrameSpec::tcp(v6, 10_000)
        } else {
            FrameSpec::udp(v6, 10_000)
        };
        let (f, l4) = build(&spec);
        let hdr = gso_hdr(kind, 1000, l4, tcp);
        for csum in [CsumMode::Full, CsumMode::Partial] {
            let opts = SegmentOpts {
                csum,
                ..SegmentOpts::default()
            };
            let (whole, want) = run(&hdr, &[&f], &opts).unwrap();
            assert!(whole.segments >= 10);
            let h = parse::parse_headers(&[&f]).unwrap();
            let p = plan(hdr.gso.kind, hdr.gso_size, &h, None).unwrap();
            for k in [
                0,
                1,
                5,
                whole.segments - 1,
                whole.segments,
                whole.segments + 3,
            ] {
                let mut got = Vec::new();
                Segmenter::new()
                    .segment_planned_from(&hdr, Some((&h, &p)), &[&f], &opts, k, |s| {
                        got.push((s.vnet, s.to_vec()));
                        true
                    })
                    .unwrap();
                let tail = &want[k.min(want.len())..];
                assert!(got == tail, "{kind:?} {csum:?} from {k}");
            }
        }
    }
}

#[test]
fn emit_false_stops_early() {
    let (f, l4) = build(&FrameSpec::tcp(false, 10000));
    let hdr = gso_hdr(GsoKind::TcpV4, 1000, l4, true);
    let mut n = 0;
    let sum = Segmenter::new()
        .segment(&hdr, &[&f], &SegmentOpts::default(), |_| {
            n += 1;
            n < 3
        })
        .unwrap();
    assert_eq!((n, sum.segments, sum.complete), (3, 3, false));
}

#[test]
fn plain_frame_checksum_completion() {
    for (tcp_, v6) in [(true, false), (true, true), (false, false), (false, true)] {
        let s = FrameSpec {
            v6,
            tcp: tcp_,
            payload: pattern(777),
            ..FrameSpec::default()
        };
        let (f, l4) = build(&s);
        let mut hdr = gso_hdr(GsoKind::None, 0, l4, tcp_);
        hdr.gso = GsoType::NONE;
        let (sum, segs) =
            run(&hdr, &split(&f, &[5, 60, 61, 300]), &SegmentOpts::default()).unwrap();
        assert_eq!((sum.segments, sum.kind), (1, GsoKind::None));
        // The oracle with a gso_size large enough: one complete segment.
        let mut as_gso = hdr;
        as_gso.gso_size = 9000;
        as_gso.gso.kind = if tcp_ {
            GsoKind::TcpV4.v(v6)
        } else {
            GsoKind::UdpL4
        };
        check(&s, &as_gso, &SegmentOpts::default(), &sum, &segs);
        // Partial: passed through untouched with its header.
        let popts = SegmentOpts {
            csum: CsumMode::Partial,
            max_frame: None,
        };
        let (_, p) = run(&hdr, &split(&f, &[5, 60]), &popts).unwrap();
        assert_eq!(p, vec![(hdr, f.clone())]);
    }
    // No NEEDS_CSUM: passes as is, flags kept.
    let hdr = VirtioNetHdr {
        flags: F_DATA_VALID,
        ..VirtioNetHdr::default()
    };
    let arp = vec![0xffu8; 42];
    let (_, p) = run(&hdr, &[&arp], &SegmentOpts::default()).unwrap();
    assert_eq!(p, vec![(hdr, arp)]);
}

#[test]
fn malformed_frames_are_errors() {
    let opts = SegmentOpts::default();
    let (f, l4) = build(&FrameSpec::tcp(false, 3000));
    let hdr = gso_hdr(GsoKind::TcpV4, 1448, l4, true);
    assert!(matches!(
        run(&hdr, &[&f[..40]], &opts),
        Err(SegmentError::Parse(ParseError::Truncated { .. }))
    ));
    let h6 = VirtioNetHdr {
        gso: GsoType::new(GsoKind::TcpV6),
        ..hdr
    };
    assert_eq!(
        run(&h6, &[&f], &opts).unwrap_err(),
        SegmentError::L3Mismatch {
            gso: GsoKind::TcpV6,
            found: L3::Ipv4
        }
    );
    let hu = VirtioNetHdr {
        gso: GsoType::new(GsoKind::UdpL4),
        ..hdr
    };
    assert_eq!(
        run(&hu, &[&f], &opts).unwrap_err(),
        SegmentError::L4Mismatch {
            gso: GsoKind::UdpL4,
            proto: 6
        }
    );
    let h0 = VirtioNetHdr { gso_size: 0, ..hdr };
    assert_eq!(
        run(&h0, &[&f], &opts).unwrap_err(),
        SegmentError::GsoSizeZero
    );
    let mut frag = f.clone();
    frag[20] = 0x20; // MF
    assert_eq!(
        run(&hdr, &[&frag], &opts).unwrap_err(),
        SegmentError::Ipv4Fragment
    );
    let mut eth0 = f.clone();
    eth0[12..14].copy_from_slice(&[0, 0]);
    let hufo = VirtioNetHdr {
        gso: GsoType::new(GsoKind::Udp),
        ..hdr
    };
    assert_eq!(
        run(&hufo, &[&eth0], &opts).unwrap_err(),
        SegmentError::Parse(ParseError::UnsupportedEthertype(0))
    );
    let none = VirtioNetHdr {
        gso: GsoType::NONE,
        csum_start: 4000,
        ..hdr
    };
    assert!(matches!(
        run(&none, &[&f], &opts),
        Err(SegmentError::CsumOutOfFrame { .. })
    ));
    // A single segment larger than an IPv4 length can hold.
    let big = FrameSpec::tcp(false, 70000);
    let (bf, l4) = build(&big);
    let hb = gso_hdr(GsoKind::TcpV4, 65534, l4, true);
    assert!(matches!(
        run(&hb, &[&bf], &opts),
        Err(SegmentError::LengthOverflow(_))
    ));
}

#[test]
fn slice_list_allocation_is_reused() {
    let (f, l4) = build(&FrameSpec::tcp(false, 3000));
    let hdr = gso_hdr(GsoKind::TcpV4, 1448, l4, true);
    let mut s = Segmenter::new();
    s.segment(&hdr, &[&f], &SegmentOpts::default(), |_| true)
        .unwrap();
    let cap = s.spare.capacity();
    assert!(cap >= 2);
    s.segment(&hdr, &[&f], &SegmentOpts::default(), |_| true)
        .unwrap();
    assert_eq!(s.spare.capacity(), cap);
}

#[test]
fn complete_csum_matches_the_plain_path() {
    let s = FrameSpec {
        payload: pattern(999),
        ..FrameSpec::default()
    };
    let (f, l4) = build(&s);
    let mut hdr = gso_hdr(GsoKind::None, 0, l4, true);
    hdr.gso = GsoType::NONE;
    let (_, segs) = run(&hdr, &[&f], &SegmentOpts::default()).unwrap();
    let done = &segs[0].1;
    let v = complete_csum(&split(&f, &[3, 50, 51, 700]), l4 as u16, 16).unwrap();
    assert_eq!(v.to_be_bytes(), [done[l4 + 16], done[l4 + 17]]);
    assert!(matches!(
        complete_csum(&[&f], f.len() as u16, 0),
        Err(SegmentError::CsumOutOfFrame { .. })
    ));
}

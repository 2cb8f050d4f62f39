//! The fuzzing entry point, shared by `fuzz/fuzz_targets/segment.rs` and the corpus
//! replay test: arbitrary header, options, split points and bytes through
//! `frame::validate` and the segmenter. Panics only when an invariant breaks.
//!
//! Input layout: 12 bytes virtio_net_hdr | 1 byte options (bit 0 partial csum, bit 1
//! cap) | 2 bytes cap (LE) | 1 byte split count k (mod 9) | k * 2 bytes split points
//! (LE, modulo the frame length + 1) | frame bytes.

use crate::frame::validate::validate;
use crate::segment::{CsumMode, Segment, SegmentOpts, Segmenter};
use crate::vnet_hdr::{VirtioNetHdr, HDR_LEN};

/// Header-ish bytes before the frame.
pub const PREFIX_LEN: usize = HDR_LEN + 4;

/// Encodes a fuzz input (for seed corpora).
pub fn encode(
    hdr: &VirtioNetHdr,
    partial: bool,
    cap: Option<u16>,
    points: &[u16],
    frame: &[u8],
) -> Vec<u8> {
    let mut v = hdr.to_bytes().to_vec();
    v.push(u8::from(partial) | if cap.is_some() { 2 } else { 0 });
    v.extend_from_slice(&cap.unwrap_or(0).to_le_bytes());
    let k = points.len().min(8);
    v.push(k as u8);
    for p in &points[..k] {
        v.extend_from_slice(&p.to_le_bytes());
    }
    v.extend_from_slice(frame);
    v
}

#[doc(hidden)]
pub fn fuzz_one(data: &[u8]) {
    if data.len() < PREFIX_LEN {
        return;
    }
    let Ok(hdr) = VirtioNetHdr::from_bytes(&data[..HDR_LEN]) else {
        return;
    };
    let o = data[HDR_LEN];
    let cap = u16::from_le_bytes([data[HDR_LEN + 1], data[HDR_LEN + 2]]);
    let k = usize::from(data[HDR_LEN + 3] % 9);
    let rest = &data[PREFIX_LEN..];
    if rest.len() < 2 * k {
        return;
    }
    let (pts, frame) = rest.split_at(2 * k);
    let mut points: Vec<usize> = pts
        .chunks_exact(2)
        .map(|c| usize::from(u16::from_le_bytes([c[0], c[1]])) % (frame.len() + 1))
        .collect();
    points.sort_unstable();
    let mut parts: Vec<&[u8]> = Vec::new();
    let mut at = 0;
    for p in points {
        parts.push(&frame[at..p]);
        at = p;
    }
    parts.push(&frame[at..]);

    let opts = SegmentOpts {
        csum: if o & 1 == 1 {
            CsumMode::Partial
        } else {
            CsumMode::Full
        },
        max_frame: (o & 2 == 2).then_some(usize::from(cap)),
    };
    let mut seg = Segmenter::new();
    let mut emitted = 0usize;
    let mut bytes = 0usize;
    let r = seg.segment(&hdr, &parts, &opts, |s: &Segment<'_>| {
        emitted += 1;
        bytes += s.len();
        true
    });
    if let Ok(sum) = r {
        assert_eq!(sum.segments, emitted);
        assert_eq!(sum.bytes, bytes);
    }
    if let Ok(v) = validate(&hdr, &parts) {
        // A validated frame always segments from its carried plan, with the predicted
        // count, and as the segmenter's own parse would.
        let layout = v.layout.as_ref().map(|l| (&l.headers, &l.plan));
        let sum = seg
            .segment_planned(&hdr, layout, &parts, &SegmentOpts::default(), |_| true)
            .expect("validated frame failed to segment");
        assert_eq!(sum.segments, v.segments());
        if hdr.gso.is_gso() {
            let again = seg
                .segment(&hdr, &parts, &SegmentOpts::default(), |_| true)
                .expect("validated frame failed to segment");
            assert_eq!(again, sum);
        }
    }
}

/// The seed corpus of `fuzz/corpus/segment`: TSO, USO and UFO frames over IPv4 and
/// IPv6 with VLAN tags, extension headers and TCP options, split and whole.
pub fn seeds() -> Vec<Vec<u8>> {
    use crate::testkit::frames::{build, gso_hdr, pattern, FrameSpec};
    use crate::vnet_hdr::{GsoKind, GsoType};
    let mut seeds = Vec::new();
    for (i, (v6, tcp, kind, gso, n)) in [
        (false, true, GsoKind::TcpV4, 1448u16, 4000usize),
        (true, true, GsoKind::TcpV6, 1428, 3000),
        (false, false, GsoKind::UdpL4, 1472, 3000),
        (true, false, GsoKind::UdpL4, 2, 5),
        (false, false, GsoKind::Udp, 1480, 4000),
        (true, false, GsoKind::Udp, 1448, 3000),
        (false, true, GsoKind::None, 0, 100),
        (false, false, GsoKind::UdpL4, 1, 129),
    ]
    .into_iter()
    .enumerate()
    {
        let spec = FrameSpec {
            v6,
            tcp,
            vlans: if i % 3 == 0 { vec![0x8100] } else { vec![] },
            ip6_exts: if v6 && i % 2 == 1 {
                vec![(0, 0), (60, 0)]
            } else {
                vec![]
            },
            tcp_opts: if i % 2 == 0 {
                vec![1, 1, 8, 10, 0, 0, 0, 1, 0, 0, 0, 2]
            } else {
                vec![]
            },
            payload: pattern(n),
            ..FrameSpec::default()
        };
        let (f, l4) = build(&spec);
        let mut h = gso_hdr(kind, gso, l4, tcp);
        if kind == GsoKind::None {
            h.gso = GsoType::NONE;
        }
        seeds.push(encode(&h, false, None, &[3, 30, 61], &f));
        seeds.push(encode(&h, true, Some(1500), &[], &f));
    }
    seeds
}

fuzz_target_tests!("segment", 10);

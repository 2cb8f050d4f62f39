//! The independent oracle of the segmenter tests: runs the segmenter and checks every
//! output segment with `etherparse` (parser and checksums), never with our own parser.
//! What the segments must be (count, sizes, sequence numbers, offsets) comes from the
//! input frame, its header and the cap alone ([`expect`]), never from the segmenter.

use etherparse::{NetHeaders, PacketHeaders, TransportHeader};

use super::frames::{build, ip6_unfrag_end, pseudo_sum, FrameSpec};
use crate::segment::{CsumMode, Segment, SegmentError, SegmentOpts, SegmentSummary, Segmenter};
use crate::vnet_hdr::{GsoKind, GsoType, VirtioNetHdr, F_NEEDS_CSUM};

/// One emitted segment, copied out.
pub type Out = (VirtioNetHdr, Vec<u8>);

/// Runs the segmenter and collects its output.
#[allow(clippy::type_complexity)]
pub fn run(
    hdr: &VirtioNetHdr,
    frame: &[&[u8]],
    opts: &SegmentOpts,
) -> Result<(SegmentSummary, Vec<Out>), SegmentError> {
    let mut segs = Vec::new();
    let sum = Segmenter::new().segment(hdr, frame, opts, |s: &Segment<'_>| {
        segs.push((s.vnet, s.to_vec()));
        true
    })?;
    Ok((sum, segs))
}

/// The segments a GSO frame must become, by the rules of REFERENCES.md: TCP and USO cut
/// the L4 payload into pieces of gso_size (smaller when the L3 cap leaves less room
/// beside the headers), the last one the remainder; UFO sends one datagram when it fits
/// gso_size and the cap, else cuts everything after the unfragmentable headers into
/// fragments of a multiple of 8.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Expected {
    /// Payload of a full segment (TCP/USO: L4 payload; UFO: fragment data).
    pub mss: usize,
    /// Every segment's payload (or fragment data) length, in order.
    pub sizes: Vec<usize>,
    /// Whether the segments are IP fragments.
    pub fragments: bool,
}

/// [`Expected`] for the frame `spec` builds with `hdr` and `opts`: the header sizes
/// come from etherparse's parse of the input and the spec's own layout.
pub fn expect(spec: &FrameSpec, hdr: &VirtioNetHdr, opts: &SegmentOpts) -> Expected {
    let (input, _) = build(spec);
    let p = PacketHeaders::from_ethernet_slice(&input).expect("etherparse rejects the input");
    let l3_off = 14 + 4 * p.link_exts.len();
    let l4_off = l3_off
        + match &p.net {
            Some(NetHeaders::Ipv4(h, e)) => h.header_len() + e.header_len(),
            Some(NetHeaders::Ipv6(_, e)) => 40 + e.header_len(),
            other => panic!("input is not IP: {other:?}"),
        };
    let l4_hdr = match &p.transport {
        Some(TransportHeader::Tcp(t)) => t.header_len(),
        Some(TransportHeader::Udp(_)) => 8,
        other => panic!("input is not TCP or UDP: {other:?}"),
    };
    let gso = usize::from(hdr.gso_size);
    let cap = opts.max_frame.unwrap_or(usize::MAX);
    let cut = |total: usize, size: usize| -> Vec<usize> {
        assert!(size > 0, "no room for payload");
        if total == 0 {
            return vec![0];
        }
        (0..total)
            .step_by(size)
            .map(|o| size.min(total - o))
            .collect()
    };
    let payload = spec.payload.len();
    assert_eq!(
        input.len(),
        l4_off + l4_hdr + payload,
        "spec and parse disagree"
    );
    if hdr.gso.kind == GsoKind::Udp {
        if l4_hdr + payload <= gso && input.len() - l3_off <= cap {
            return Expected {
                mss: gso,
                sizes: vec![payload],
                fragments: false,
            };
        }
        // IPv6 adds an 8-byte Fragment header behind the unfragmentable part.
        let (unfrag, frag_hdr) = if spec.v6 {
            (ip6_unfrag_end(spec), 8)
        } else {
            (l4_off, 0)
        };
        let size = gso.min(cap - (unfrag - l3_off + frag_hdr)) / 8 * 8;
        return Expected {
            mss: size,
            sizes: cut(input.len() - unfrag, size),
            fragments: true,
        };
    }
    let mss = gso.min(cap - (l4_off + l4_hdr - l3_off));
    Expected {
        mss,
        sizes: cut(payload, mss),
        fragments: false,
    }
}

/// What the oracle learnt from the output.
#[derive(Debug, Default)]
pub struct Checked {
    pub payloads: Vec<usize>,
}

struct Parsed {
    l3: NetHeaders,
    l4: Option<TransportHeader>,
    /// L4 payload (or, for a fragment, the IP payload).
    payload: Vec<u8>,
    l4_off: usize,
    l3_len: usize,
}

/// A later IPv6 fragment whose Fragment header names an extension header (that sits
/// in the first fragment only): etherparse's strict parser reads the fragment data as
/// that header, so only the headers up to the Fragment header are taken, laxly.
fn parse_later_fragment(seg: &[u8]) -> Parsed {
    let p =
        etherparse::LaxPacketHeaders::from_ethernet(seg).expect("etherparse rejects a fragment");
    let net = p.net.clone().expect("no IP header");
    let l2 = 14 + 4 * p.link_exts.len();
    match &net {
        NetHeaders::Ipv6(_, e) => assert!(e.fragment.is_some(), "not a fragment"),
        _ => panic!("not IPv6"),
    }
    Parsed {
        l3: net,
        l4: None,
        payload: vec![],
        l4_off: 0,
        l3_len: seg.len() - l2,
    }
}

fn parse(seg: &[u8]) -> Parsed {
    let p = PacketHeaders::from_ethernet_slice(seg).expect("etherparse rejects a segment");
    let net = p.net.clone().expect("no IP header");
    let payload = match &p.payload {
        etherparse::PayloadSlice::Tcp(b) | etherparse::PayloadSlice::Udp(b) => b.to_vec(),
        etherparse::PayloadSlice::Ip(ip) => ip.payload.to_vec(),
        other => panic!("unexpected payload {other:?}"),
    };
    let l2 = 14 + 4 * p.link_exts.len();
    let (ip_hdr, ext) = match &net {
        NetHeaders::Ipv4(h, e) => (h.header_len(), e.header_len()),
        NetHeaders::Ipv6(_, e) => (40, e.header_len()),
        NetHeaders::Arp(_) => panic!("arp"),
    };
    Parsed {
        l3: net,
        l4: p.transport,
        payload,
        l4_off: l2 + ip_hdr + ext,
        l3_len: seg.len() - l2,
    }
}

fn addrs(n: &NetHeaders) -> (Vec<u8>, Vec<u8>) {
    match n {
        NetHeaders::Ipv4(h, _) => (h.source.to_vec(), h.destination.to_vec()),
        NetHeaders::Ipv6(h, _) => (h.source.to_vec(), h.destination.to_vec()),
        NetHeaders::Arp(_) => panic!("arp"),
    }
}

/// Checks every output segment of a GSO frame built from `spec` against the input:
/// parses, checksums, sizes, copied fields, and payload reassembly.
pub fn check(
    spec: &FrameSpec,
    hdr: &VirtioNetHdr,
    opts: &SegmentOpts,
    sum: &SegmentSummary,
    segs: &[(VirtioNetHdr, Vec<u8>)],
) -> Checked {
    let (input, l4_off) = build(spec);
    let l3_off = 14 + 4 * spec.vlans.len();
    let cap = opts.max_frame.unwrap_or(usize::MAX);
    let exp = expect(spec, hdr, opts);
    assert_eq!(sum.segments, segs.len());
    let sizes: Vec<usize> = segs.iter().map(|s| s.1.len()).collect();
    assert_eq!(
        segs.len(),
        exp.sizes.len(),
        "segment count {sizes:?} vs {exp:?}"
    );
    if sum.kind != GsoKind::None {
        assert_eq!(sum.mss, exp.mss, "mss");
    }
    assert_eq!(sum.bytes, segs.iter().map(|s| s.1.len()).sum::<usize>());
    let mut out = Checked { payloads: vec![] };
    let n = segs.len();
    let ufo = hdr.gso.kind == GsoKind::Udp;
    assert_eq!(ufo && n > 1, exp.fragments, "fragments or datagrams");
    let mut reasm = vec![None::<u8>; if ufo { 70000 } else { 0 }];
    let mut ufo_id = None;
    let mut next_off = 0usize;
    for (i, (vnet, seg)) in segs.iter().enumerate() {
        assert_eq!(vnet.gso, GsoType::NONE);
        let p = if ufo && i > 0 && spec.v6 && spec.ip6_exts.iter().any(|e| e.0 == 60) {
            parse_later_fragment(seg)
        } else {
            parse(seg)
        };
        // Every segment within the cap (L3 size).
        assert!(p.l3_len <= cap, "segment L3 {} > cap {cap}", p.l3_len);
        // L2 and the unfragmentable headers copied.
        assert_eq!(seg[..l3_off], input[..l3_off]);
        match &p.l3 {
            NetHeaders::Ipv4(h, _) => {
                assert_eq!(
                    h.calc_header_checksum(),
                    h.header_checksum,
                    "IPv4 header checksum"
                );
                assert_eq!(usize::from(h.total_len), p.l3_len);
                assert_eq!(h.time_to_live, 61);
                if ufo && n > 1 {
                    let id = *ufo_id.get_or_insert(h.identification);
                    assert_eq!(h.identification, id);
                    assert_eq!(h.identification, spec.ip_id);
                    assert_eq!(h.more_fragments, i + 1 < n);
                } else {
                    assert_eq!(
                        h.identification,
                        spec.ip_id.wrapping_add(i as u16),
                        "IPv4 ID"
                    );
                    assert!(!h.more_fragments);
                    assert_eq!(h.fragment_offset.value(), 0);
                }
                if i == 0 || !ufo {
                    assert_eq!(
                        h.options.as_slice(),
                        &input[l3_off + 20..l3_off + usize::from(h.ihl()) * 4]
                    );
                }
            }
            NetHeaders::Ipv6(h, e) => {
                assert_eq!(usize::from(h.payload_length) + 40, p.l3_len);
                assert_eq!(h.hop_limit, 63);
                assert_eq!(h.flow_label.value(), 0x12345);
                if ufo && n > 1 {
                    let f = e.fragment.clone().expect("no fragment header");
                    let id = *ufo_id.get_or_insert(f.identification as u16);
                    assert_eq!(f.identification as u16, id);
                    assert_eq!(f.more_fragments, i + 1 < n);
                } else {
                    assert!(e.fragment.is_none());
                    // Extension headers copied byte for byte.
                    assert_eq!(seg[l3_off + 40..p.l4_off], input[l3_off + 40..l4_off]);
                }
            }
            NetHeaders::Arp(_) => panic!("arp"),
        }
        if ufo && n > 1 {
            // A fragment: place the bytes after the fragmentation headers by offset.
            let (off, more, data) = match &p.l3 {
                NetHeaders::Ipv4(h, _) => (
                    usize::from(h.fragment_offset.value()) * 8,
                    h.more_fragments,
                    &seg[l3_off + usize::from(h.ihl()) * 4..],
                ),
                NetHeaders::Ipv6(_, e) => {
                    let f = e.fragment.clone().expect("no fragment header");
                    (
                        usize::from(f.fragment_offset.value()) * 8,
                        f.more_fragments,
                        &seg[ip6_unfrag_end(spec) + 8..],
                    )
                }
                _ => unreachable!(),
            };
            assert_eq!(data.len(), exp.sizes[i], "fragment {i} size");
            assert_eq!(off, i * exp.mss, "fragment {i} offset");
            if more {
                assert_eq!(data.len() % 8, 0);
            }
            assert_eq!(vnet.flags, 0);
            for (k, b) in data.iter().enumerate() {
                assert!(reasm[off + k].is_none(), "fragments overlap");
                reasm[off + k] = Some(*b);
            }
            out.payloads.push(data.len());
            continue;
        }
        let (src, dst) = addrs(&p.l3);
        let partial = opts.csum == CsumMode::Partial && !(ufo && n > 1);
        match (&p.l4, spec.tcp) {
            (Some(TransportHeader::Tcp(t)), true) => {
                let want = match &p.l3 {
                    NetHeaders::Ipv4(h, _) => t.calc_checksum_ipv4(h, &p.payload).unwrap(),
                    NetHeaders::Ipv6(h, _) => t.calc_checksum_ipv6(h, &p.payload).unwrap(),
                    _ => unreachable!(),
                };
                if partial {
                    assert_eq!(vnet.flags, F_NEEDS_CSUM);
                    assert_eq!(
                        (usize::from(vnet.csum_start), vnet.csum_offset),
                        (p.l4_off, 16)
                    );
                    let l4len = t.header_len() + p.payload.len();
                    assert_eq!(
                        t.checksum,
                        pseudo_sum(&src, &dst, 6, l4len),
                        "partial TCP csum"
                    );
                } else {
                    assert_eq!(vnet.flags, 0);
                    assert_eq!(t.checksum, want, "TCP checksum of segment {i}");
                }
                assert_eq!(p.payload.len(), exp.sizes[i], "TCP segment {i} size");
                let in_t = etherparse::TcpHeader::from_slice(&input[l4_off..])
                    .unwrap()
                    .0;
                assert_eq!(
                    t.sequence_number,
                    spec.seq.wrapping_add((i * exp.mss) as u32),
                    "sequence number of segment {i}"
                );
                assert_eq!(t.options.as_slice(), in_t.options.as_slice(), "TCP options");
                assert_eq!(
                    (t.source_port, t.destination_port),
                    (in_t.source_port, in_t.destination_port)
                );
                assert_eq!(
                    (t.acknowledgment_number, t.window_size),
                    (in_t.acknowledgment_number, in_t.window_size)
                );
                assert_eq!(
                    (t.ack, t.syn, t.rst, t.urg, t.ece),
                    (in_t.ack, in_t.syn, in_t.rst, in_t.urg, in_t.ece)
                );
                assert_eq!(t.fin, in_t.fin && i + 1 == n, "FIN only on the last");
                assert_eq!(t.psh, in_t.psh && i + 1 == n, "PSH only on the last");
                assert_eq!(t.cwr, in_t.cwr && i == 0, "CWR only on the first");
                let start = (t.sequence_number.wrapping_sub(spec.seq)) as usize;
                assert_eq!(start, next_off, "TCP segments in sequence");
                next_off += p.payload.len();
                out.payloads.push(p.payload.len());
                assert_eq!(p.payload[..], spec.payload[start..start + p.payload.len()]);
            }
            (Some(TransportHeader::Udp(u)), false) => {
                let want = match &p.l3 {
                    NetHeaders::Ipv4(h, _) => u.calc_checksum_ipv4(h, &p.payload).unwrap(),
                    NetHeaders::Ipv6(h, _) => u.calc_checksum_ipv6(h, &p.payload).unwrap(),
                    _ => unreachable!(),
                };
                assert_eq!(usize::from(u.length), 8 + p.payload.len());
                if partial {
                    assert_eq!(vnet.flags, F_NEEDS_CSUM);
                    assert_eq!(
                        (usize::from(vnet.csum_start), vnet.csum_offset),
                        (p.l4_off, 6)
                    );
                    assert_eq!(
                        u.checksum,
                        pseudo_sum(&src, &dst, 17, 8 + p.payload.len()),
                        "partial UDP csum"
                    );
                } else {
                    assert_eq!(vnet.flags, 0);
                    assert_eq!(u.checksum, want, "UDP checksum of segment {i}");
                }
                assert_eq!(p.payload.len(), exp.sizes[i], "UDP segment {i} size");
                assert_eq!((u.source_port, u.destination_port), spec.ports());
                out.payloads.push(p.payload.len());
                assert_eq!(
                    p.payload[..],
                    spec.payload[next_off..next_off + p.payload.len()]
                );
                next_off += p.payload.len();
            }
            other => panic!("unexpected L4 {other:?} in segment {i}"),
        }
    }
    if ufo && n > 1 {
        // Reassemble: the fragmentable part, then the datagram behind its headers.
        let total = reasm.iter().rposition(|b| b.is_some()).map_or(0, |p| p + 1);
        let bytes: Vec<u8> = reasm[..total]
            .iter()
            .map(|b| b.expect("hole in fragments"))
            .collect();
        let skip = bytes.len() - 8 - spec.payload.len();
        let dgram = &bytes[skip..];
        let u = etherparse::UdpHeader::from_slice(dgram).unwrap().0;
        assert_eq!(usize::from(u.length), dgram.len());
        assert_eq!(&dgram[8..], &spec.payload[..], "UFO reassembly");
        let (s, d) = addrs(&parse(&segs[0].1).l3);
        let want = if spec.v6 {
            u.calc_checksum_ipv6_raw(s.try_into().unwrap(), d.try_into().unwrap(), &dgram[8..])
                .unwrap()
        } else {
            u.calc_checksum_ipv4_raw(s.try_into().unwrap(), d.try_into().unwrap(), &dgram[8..])
                .unwrap()
        };
        assert_eq!(u.checksum, want, "UFO datagram checksum");
    } else {
        assert_eq!(next_off, spec.payload.len(), "payload reassembled in full");
    }
    out
}

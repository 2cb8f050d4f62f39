//! GRO test support: TCP segments and UDP datagrams of a few flows as senders hand
//! them over (partial or complete checksums, with rule breakers mixed in), the coalescer run over them,
//! and the check that every coalesced frame, parsed by etherparse and cut again by the
//! segmenter, gives back exactly the segments that went in. Also the fuzz entry.

use std::collections::BTreeMap;

use etherparse::checksum::Sum16BitWords;
use etherparse::{NetHeaders, PacketHeaders, PayloadSlice, TransportHeader};

use super::frames::{build, csum_offset, payload, pseudo_sum, tcp_timestamps, FrameSpec};
use super::oracle;
use crate::segment::gro::{Coalescer, Merged, Offer, MAX_SEGS};
use crate::segment::{CsumMode, SegmentOpts};
use crate::vnet_hdr::{VirtioNetHdr, F_DATA_VALID, F_NEEDS_CSUM};

/// One flow: its shape and how its sender leaves checksums.
#[derive(Clone, Debug)]
pub struct Flow {
    /// UDP datagrams (the TCP-only twists leave them plain); else TCP segments.
    pub udp: bool,
    pub v6: bool,
    pub vlan: bool,
    pub timestamps: bool,
    /// Source port, which names the flow in the checks.
    pub sport: u16,
    pub mss: usize,
    /// Complete checksums (flags 0, or DATA_VALID with `valid`); else NEEDS_CSUM.
    pub full: bool,
    pub valid: bool,
    pub seq0: u32,
    pub id0: u16,
}

/// What is done to one segment before it is offered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Twist {
    None,
    Psh,
    Fin,
    Urg,
    Rst,
    Syn,
    Cwr,
    /// ECN CE in the TOS / traffic class.
    Ce,
    /// Another window.
    Window,
    /// Another timestamp value.
    Tsval,
    /// A wrong TCP checksum (complete-checksum flows only).
    BadCsum,
    /// An IPv4 ID out of sequence.
    IdJump,
    /// IPv4 options (NOPs).
    IpOpts,
    /// A shorter payload than the MSS.
    Short,
}

impl Twist {
    pub const ALL: [Twist; 14] = [
        Twist::None,
        Twist::Psh,
        Twist::Fin,
        Twist::Urg,
        Twist::Rst,
        Twist::Syn,
        Twist::Cwr,
        Twist::Ce,
        Twist::Window,
        Twist::Tsval,
        Twist::BadCsum,
        Twist::IdJump,
        Twist::IpOpts,
        Twist::Short,
    ];

    /// Whether it changes a segment of `flow` (TCP flags, window and timestamps mean
    /// nothing to UDP).
    pub fn applies(self, flow: &Flow) -> bool {
        !flow.udp
            || matches!(
                self,
                Twist::Ce | Twist::BadCsum | Twist::IdJump | Twist::IpOpts
            )
    }

    /// A segment so twisted may never be part of a coalesced frame.
    pub fn breaks(self, flow: &Flow) -> bool {
        self.applies(flow)
            && match self {
                Twist::Urg | Twist::Rst | Twist::Syn | Twist::Cwr => true,
                Twist::BadCsum => flow.full && !flow.valid,
                Twist::IpOpts => !flow.v6,
                _ => false,
            }
    }
}

/// Completes the IPv4 header checksum at `l3` (etherparse's sum).
fn ip4_csum(f: &mut [u8], l3: usize) {
    let ihl = usize::from(f[l3] & 0x0f) * 4;
    f[l3 + 10..l3 + 12].fill(0);
    let c = Sum16BitWords::new()
        .add_slice(&f[l3..l3 + ihl])
        .ones_complement()
        .to_be();
    f[l3 + 10..l3 + 12].copy_from_slice(&(!c).to_be_bytes());
}

/// Completes the TCP or UDP checksum of `f`, computed by etherparse.
pub fn complete_l4(f: &mut [u8], l4: usize) {
    let p = PacketHeaders::from_ethernet_slice(f).expect("etherparse rejects a segment");
    let (c, at) = match (&p.transport, &p.payload, &p.net) {
        (Some(TransportHeader::Tcp(t)), PayloadSlice::Tcp(d), Some(NetHeaders::Ipv4(h, _))) => {
            (t.calc_checksum_ipv4(h, d).unwrap(), 16)
        }
        (Some(TransportHeader::Tcp(t)), PayloadSlice::Tcp(d), Some(NetHeaders::Ipv6(h, _))) => {
            (t.calc_checksum_ipv6(h, d).unwrap(), 16)
        }
        (Some(TransportHeader::Udp(u)), PayloadSlice::Udp(d), Some(NetHeaders::Ipv4(h, _))) => {
            (u.calc_checksum_ipv4(h, d).unwrap(), 6)
        }
        (Some(TransportHeader::Udp(u)), PayloadSlice::Udp(d), Some(NetHeaders::Ipv6(h, _))) => {
            (u.calc_checksum_ipv6(h, d).unwrap(), 6)
        }
        _ => panic!("not TCP or UDP over IP"),
    };
    f[l4 + at..l4 + at + 2].copy_from_slice(&c.to_be_bytes());
}

/// Segment `i` of `flow` (payload `len` bytes from sequence offset `off`), twisted.
pub fn segment(flow: &Flow, i: usize, off: usize, len: usize, t: Twist) -> (VirtioNetHdr, Vec<u8>) {
    let t = if t.applies(flow) { t } else { Twist::None };
    let mut opts = if flow.timestamps && !flow.udp {
        tcp_timestamps()
    } else {
        vec![]
    };
    if t == Twist::Tsval && flow.timestamps {
        opts[7] ^= 0x55;
    }
    let flags = 0x10
        | match t {
            Twist::Psh => 0x08,
            Twist::Fin => 0x01,
            Twist::Urg => 0x20,
            Twist::Rst => 0x04,
            Twist::Syn => 0x02,
            Twist::Cwr => 0x80,
            _ => 0,
        };
    let id = flow.id0.wrapping_add(i as u16);
    let spec = FrameSpec {
        v6: flow.v6,
        tcp: !flow.udp,
        vlans: if flow.vlan { vec![0x8100] } else { vec![] },
        ports: Some((flow.sport, 443)),
        tcp_opts: opts,
        tcp_flags: flags,
        ip_id: if t == Twist::IdJump { id ^ 0x100 } else { id },
        ip4_opts: if t == Twist::IpOpts {
            vec![1; 4]
        } else {
            vec![]
        },
        seq: flow.seq0.wrapping_add(off as u32),
        payload: payload(len, u32::from(flow.sport) << 16 ^ off as u32),
        ..FrameSpec::default()
    };
    let (mut f, l4) = build(&spec);
    let l3 = if flow.vlan { 18 } else { 14 };
    match t {
        Twist::Ce if flow.v6 => f[l3 + 1] |= 0x30,
        Twist::Ce => {
            f[l3 + 1] |= 0x03;
            ip4_csum(&mut f, l3);
        }
        Twist::Window => f[l4 + 14] ^= 0x01,
        _ => {}
    }
    let csum_at = csum_offset(!flow.udp);
    let hdr = if flow.full {
        complete_l4(&mut f, l4);
        if t == Twist::BadCsum && !flow.valid {
            f[l4 + csum_at + 1] ^= 0x5a;
        }
        VirtioNetHdr {
            flags: if flow.valid { F_DATA_VALID } else { 0 },
            ..VirtioNetHdr::default()
        }
    } else {
        VirtioNetHdr {
            flags: F_NEEDS_CSUM,
            csum_start: l4 as u16,
            csum_offset: csum_at as u16,
            ..VirtioNetHdr::default()
        }
    };
    (hdr, f)
}

/// The index whose IPv4 ID segment `i` of `fl` carries when `next` is due. A repeated
/// UDP datagram takes a fresh one: a repeated ID under DF reads as a fixed-ID train,
/// which joins (as in Linux) but comes back from the segmenter with incrementing IDs,
/// since virtio has no fixed-ID flag. TCP repeats keep theirs (their sequence number
/// keeps them apart).
pub fn repeat_id(fl: &Flow, i: usize, next: usize) -> usize {
    if fl.udp && i < next {
        next
    } else {
        i
    }
}

/// One frame offered: header and bytes.
pub type Input = (VirtioNetHdr, Vec<u8>);

/// One frame out of the coalescer: header, bytes, segments it holds.
pub type Out = (VirtioNetHdr, Vec<u8>, usize);

/// Offers `inputs` in order (each split at `split` when inside it) and flushes.
pub fn run(co: &mut Coalescer, inputs: &[(VirtioNetHdr, Vec<u8>)], split: usize) -> Vec<Out> {
    let mut out = Vec::new();
    for (h, f) in inputs {
        let at = split.min(f.len());
        let parts = [&f[..at], &f[at..]];
        let mut keep = |m: &Merged<'_>| out.push((m.vnet, m.bytes.to_vec(), m.segments));
        if co.offer(h, &parts, None, &mut keep) == Offer::Pass {
            out.push((*h, f.clone(), 1));
        }
    }
    co.flush(|m| out.push((m.vnet, m.bytes.to_vec(), m.segments)));
    assert!(co.is_empty());
    out
}

/// The source port of a frame (the flow's name), read by etherparse.
fn sport(f: &[u8]) -> u16 {
    let p = PacketHeaders::from_ethernet_slice(f).expect("etherparse rejects a frame");
    match p.transport {
        Some(TransportHeader::Tcp(t)) => t.source_port,
        Some(TransportHeader::Udp(u)) => u.source_port,
        _ => panic!("not TCP or UDP"),
    }
}

/// Checks one coalesced frame with etherparse (lengths, IPv4 header checksum, the
/// partial TCP or UDP checksum over the pseudo-header) and cuts it again with the
/// segmenter (`full`: complete checksums, as its segments came).
fn uncoalesce(
    hdr: &VirtioNetHdr,
    f: &[u8],
    segs: usize,
    full: bool,
) -> Vec<(VirtioNetHdr, Vec<u8>)> {
    let p = PacketHeaders::from_ethernet_slice(f).expect("etherparse rejects a coalesced frame");
    let (proto, l4_hdr, csum, data) = match (&p.transport, &p.payload) {
        (Some(TransportHeader::Tcp(t)), PayloadSlice::Tcp(d)) => {
            (6, t.header_len(), t.checksum, *d)
        }
        (Some(TransportHeader::Udp(u)), PayloadSlice::Udp(d)) => {
            assert_eq!(usize::from(u.length), 8 + d.len());
            (17, 8, u.checksum, *d)
        }
        _ => panic!("coalesced frame is not TCP or UDP"),
    };
    let l4_len = l4_hdr + data.len();
    let (src, dst) = match &p.net {
        Some(NetHeaders::Ipv4(h, _)) => {
            assert_eq!(h.calc_header_checksum(), h.header_checksum);
            assert_eq!(usize::from(h.total_len), h.header_len() + l4_len);
            (h.source.to_vec(), h.destination.to_vec())
        }
        Some(NetHeaders::Ipv6(h, _)) => {
            assert_eq!(usize::from(h.payload_length), l4_len);
            (h.source.to_vec(), h.destination.to_vec())
        }
        _ => panic!("not IP"),
    };
    assert_eq!(csum, pseudo_sum(&src, &dst, proto, l4_len));
    assert_eq!(usize::from(hdr.csum_start) + l4_hdr, f.len() - data.len());
    assert_eq!(usize::from(hdr.hdr_len), f.len() - data.len());
    assert!(segs <= MAX_SEGS && segs > 1);
    let opts = SegmentOpts {
        csum: if full {
            CsumMode::Full
        } else {
            CsumMode::Partial
        },
        max_frame: None,
    };
    let (sum, out) = oracle::run(hdr, &[f], &opts).expect("coalesced frame does not segment");
    assert_eq!(sum.segments, segs);
    out
}

/// Per flow (by source port), the segments the outputs stand for, in order: a
/// coalesced frame cut again, anything else as it is. `full`: the flows whose senders
/// complete checksums.
pub fn expand(out: &[Out], full: &BTreeMap<u16, bool>) -> BTreeMap<u16, Vec<Vec<u8>>> {
    let mut per: BTreeMap<u16, Vec<Vec<u8>>> = BTreeMap::new();
    for (h, f, segs) in out {
        let port = sport(f);
        let v = per.entry(port).or_default();
        if h.gso.is_gso() {
            for (sh, s) in uncoalesce(h, f, *segs, full[&port]) {
                if !full[&port] {
                    assert_eq!(sh.flags, F_NEEDS_CSUM);
                }
                v.push(s);
            }
        } else {
            assert_eq!(*segs, 1);
            v.push(f.clone());
        }
    }
    per
}

/// Per flow, the frames offered, in order.
pub fn by_flow(inputs: &[(VirtioNetHdr, Vec<u8>)]) -> BTreeMap<u16, Vec<Vec<u8>>> {
    let mut per: BTreeMap<u16, Vec<Vec<u8>>> = BTreeMap::new();
    for (_, f) in inputs {
        per.entry(sport(f)).or_default().push(f.clone());
    }
    per
}

/// Reads a little-endian number of `n` bytes from the front of `d` (0 past the end).
fn take(d: &mut &[u8], n: usize) -> u32 {
    let mut v = 0u32;
    for i in 0..n {
        let b = d.first().copied().unwrap_or(0);
        *d = d.get(1..).unwrap_or(&[]);
        v |= u32::from(b) << (8 * i);
    }
    v
}

/// Decodes fuzz input: up to 3 flows (a shape byte, an MSS, a sequence start each; a
/// shape with bit 5 is UDP),
/// then per segment (3 bytes): which flow, what twist, how to step (next, skip one,
/// repeat the last). Returns the flows and what is offered.
pub fn decode(mut d: &[u8]) -> (Vec<Flow>, Vec<Input>, usize) {
    let nflows = 1 + take(&mut d, 1) as usize % 3;
    let split = take(&mut d, 1) as usize;
    let flows: Vec<Flow> = (0..nflows)
        .map(|i| {
            let shape = take(&mut d, 1);
            Flow {
                udp: shape & 32 != 0,
                v6: shape & 1 != 0,
                vlan: shape & 2 != 0,
                timestamps: shape & 4 != 0,
                full: shape & 8 != 0,
                valid: shape & 16 != 0,
                sport: 1000 + i as u16,
                mss: 1 + take(&mut d, 2) as usize % 1600,
                seq0: take(&mut d, 4),
                id0: take(&mut d, 2) as u16,
            }
        })
        .collect();
    let mut next = vec![0usize; nflows];
    let mut inputs = Vec::new();
    while !d.is_empty() && inputs.len() < 200 {
        let fi = take(&mut d, 1) as usize % nflows;
        let t = Twist::ALL[take(&mut d, 1) as usize % Twist::ALL.len()];
        let step = take(&mut d, 1) % 4;
        let fl = &flows[fi];
        if step == 1 {
            next[fi] += 1; // a gap
        }
        let i = if step == 2 && next[fi] > 0 {
            next[fi] - 1 // a repeat
        } else {
            next[fi]
        };
        let len = if t == Twist::Short {
            1 + fl.mss / 2
        } else {
            fl.mss
        };
        let id = repeat_id(fl, i, next[fi]);
        inputs.push(segment(fl, id, i * fl.mss, len, t));
        next[fi] = id.max(i) + 1;
    }
    (flows, inputs, split)
}

/// The fuzz entry: decoded segments through the coalescer; each flow's segments come
/// back in order and byte for byte, and no rule breaker is ever coalesced. Then the
/// raw bytes as one frame under every header flag, which must not panic.
pub fn fuzz_one(data: &[u8]) {
    let (flows, inputs, split) = decode(data);
    let mut co = Coalescer::new();
    let out = run(&mut co, &inputs, split);
    let full = flows.iter().map(|f| (f.sport, f.full)).collect();
    assert_eq!(expand(&out, &full), by_flow(&inputs));
    for flags in [0, F_NEEDS_CSUM, F_DATA_VALID] {
        let hdr = VirtioNetHdr {
            flags,
            csum_start: 34,
            csum_offset: 16,
            ..VirtioNetHdr::default()
        };
        let parts = [data];
        let mut n = 0;
        let taken = co.offer(&hdr, &parts, None, |m| n += m.segments) == Offer::Taken;
        co.flush(|m| n += m.segments);
        assert_eq!(n, usize::from(taken));
    }
}

/// Seeds for `fuzz/corpus/gro`: each flow shape, every twist.
pub fn seeds() -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    for shape in [0u8, 1, 3, 4, 8, 13, 24, 31, 32, 33, 40, 57] {
        let mut s = vec![
            2,
            70,
            shape,
            0xa8,
            0x05,
            1,
            2,
            3,
            4,
            5,
            6,
            shape ^ 8,
            100,
            0,
        ];
        s.extend([0xff, 0xff, 0xff, 0xf0, 0, 0]);
        for (i, _) in Twist::ALL.iter().enumerate() {
            s.extend([0, 0, 0, 1, 0, 0, 0, i as u8, 0, 0, 0, 0, 1, 0, 1]);
        }
        out.push(s);
    }
    out
}

fuzz_target_tests!("gro", 8);

#[cfg(test)]
mod tests {
    use super::*;

    /// The seeds do reach the coalescing path: plain segments in order merge.
    #[test]
    fn seeds_coalesce() {
        let (_, inputs, split) = decode(&seeds()[0]);
        let out = run(&mut Coalescer::new(), &inputs, split);
        assert!(out.iter().any(|o| o.2 > 1), "nothing coalesced");
    }
}

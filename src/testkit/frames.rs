//! The one frame builder of the tests: Ethernet (+ VLAN tags) + IPv4/IPv6 (+ options,
//! extension headers) + TCP/UDP as a guest hands it over, and the header it sends.

use etherparse::checksum::Sum16BitWords;

use crate::vnet_hdr::{GsoKind, GsoType, VirtioNetHdr, F_NEEDS_CSUM};

/// Destination and source MAC of a built frame unless a spec says otherwise.
pub const DST_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0xbb];
pub const SRC_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0xaa];

#[derive(Clone, Debug)]
pub struct FrameSpec {
    /// Destination and source MAC.
    pub macs: ([u8; 6], [u8; 6]),
    /// TPIDs of the VLAN tags, outer first.
    pub vlans: Vec<u16>,
    pub v6: bool,
    /// IPv4 source and destination (when not `v6`).
    pub ip4: ([u8; 4], [u8; 4]),
    /// IPv6 source and destination (when `v6`).
    pub ip6: ([u8; 16], [u8; 16]),
    /// IPv4 Don't Fragment.
    pub df: bool,
    /// IPv4 options (padded with EOL to a multiple of 4).
    pub ip4_opts: Vec<u8>,
    /// IPv6 extension header types in order (0, 43, 60), each `8 * (1 + n)` bytes.
    pub ip6_exts: Vec<(u8, u8)>,
    pub tcp: bool,
    /// Source and destination port; `None`: 12345 to 443 (TCP) or 4444 (UDP).
    pub ports: Option<(u16, u16)>,
    /// TCP options (padded with EOL to a multiple of 4).
    pub tcp_opts: Vec<u8>,
    pub tcp_flags: u8,
    pub ip_id: u16,
    pub seq: u32,
    pub payload: Vec<u8>,
}

impl Default for FrameSpec {
    fn default() -> Self {
        FrameSpec {
            macs: (DST_MAC, SRC_MAC),
            vlans: vec![],
            v6: false,
            ip4: ([192, 0, 2, 1], [198, 51, 100, 7]),
            ip6: (
                std::array::from_fn(|i| 0x20 + i as u8),
                std::array::from_fn(|i| 0xfd - i as u8),
            ),
            df: true,
            ip4_opts: vec![],
            ip6_exts: vec![],
            tcp: true,
            ports: None,
            tcp_opts: vec![],
            tcp_flags: 0x10,
            ip_id: 0x1234,
            seq: 1000,
            payload: vec![],
        }
    }
}

impl FrameSpec {
    /// A TCP frame with `n` bytes of [`pattern`] payload.
    pub fn tcp(v6: bool, n: usize) -> FrameSpec {
        FrameSpec {
            v6,
            payload: pattern(n),
            ..FrameSpec::default()
        }
    }

    /// A UDP frame with `n` bytes of [`pattern`] payload.
    pub fn udp(v6: bool, n: usize) -> FrameSpec {
        FrameSpec {
            tcp: false,
            ..FrameSpec::tcp(v6, n)
        }
    }

    /// Source and destination port of the frame.
    pub fn ports(&self) -> (u16, u16) {
        self.ports.unwrap_or(if self.tcp {
            (12345, 443)
        } else {
            (12345, 4444)
        })
    }
}

/// Bytes that do not repeat within a segment: frames compare meaningfully.
pub fn pattern(n: usize) -> Vec<u8> {
    (0..n).map(|i| (i * 7 + (i >> 8) * 13 + 1) as u8).collect()
}

/// A seeded, random-looking payload (xorshift32): different seeds, different bytes.
pub fn payload(len: usize, seed: u32) -> Vec<u8> {
    let mut x = seed.wrapping_mul(2654435761).wrapping_add(0x9e37_79b9) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            (x >> 11) as u8
        })
        .collect()
}

/// TCP timestamps option (NOP NOP TS) as Linux sends it.
pub fn tcp_timestamps() -> Vec<u8> {
    vec![1, 1, 8, 10, 0, 0, 0, 1, 0, 0, 0, 2]
}

fn pad4(mut v: Vec<u8>) -> Vec<u8> {
    while !v.len().is_multiple_of(4) {
        v.push(0);
    }
    v
}

fn sum_fold_be(words: Sum16BitWords) -> u16 {
    !words.ones_complement().to_be()
}

/// The pseudo-header sum (folded, not inverted), as a guest leaves it in a partial
/// checksum field. Computed with etherparse.
pub fn pseudo_sum(src: &[u8], dst: &[u8], proto: u8, len: usize) -> u16 {
    let mut s = Sum16BitWords::new().add_slice(src).add_slice(dst);
    s = if src.len() == 4 {
        s.add_2bytes([0, proto])
            .add_2bytes((len as u16).to_be_bytes())
    } else {
        s.add_4bytes((len as u32).to_be_bytes())
            .add_4bytes([0, 0, 0, proto])
    };
    sum_fold_be(s)
}

/// An Ethernet frame: addresses, `tags` as (TPID, TCI) outer first, `ethertype`, then
/// `body` as it is. For tests of L2 code that does not look past the ethertype.
pub fn ethernet(
    dst: [u8; 6],
    src: [u8; 6],
    tags: &[(u16, u16)],
    ethertype: u16,
    body: &[u8],
) -> Vec<u8> {
    let mut f = Vec::with_capacity(14 + 4 * tags.len() + body.len());
    f.extend_from_slice(&dst);
    f.extend_from_slice(&src);
    for (tpid, tci) in tags {
        f.extend_from_slice(&tpid.to_be_bytes());
        f.extend_from_slice(&tci.to_be_bytes());
    }
    f.extend_from_slice(&ethertype.to_be_bytes());
    f.extend_from_slice(body);
    f
}

/// A `len`-byte frame: [`ethernet`] between the default addresses with `tags` and
/// `ethertype`, then [`pattern`] bytes; cut at `len`, even inside the header.
pub fn ethernet_len(tags: &[(u16, u16)], ethertype: u16, len: usize) -> Vec<u8> {
    let body = pattern(len.saturating_sub(14 + 4 * tags.len()));
    let mut f = ethernet(DST_MAC, SRC_MAC, tags, ethertype, &body);
    f.truncate(len);
    f
}

/// Builds a frame as a guest would hand it over: lengths set, IPv4 header checksum
/// valid, L4 checksum field holding the pseudo-header sum (CHECKSUM_PARTIAL).
/// Returns the frame and its L4 offset.
pub fn build(s: &FrameSpec) -> (Vec<u8>, usize) {
    let tags: Vec<(u16, u16)> = (s.vlans.iter().enumerate())
        .map(|(i, tpid)| (*tpid, 0x2005 | (i as u16) << 8))
        .collect();
    let ethertype = if s.v6 { 0x86dd } else { 0x0800 };
    let mut f = ethernet(s.macs.0, s.macs.1, &tags, ethertype, &[]);
    f.reserve(s.payload.len() + 200);
    let proto = if s.tcp { 6 } else { 17 };
    let l3_off = f.len();
    let (sport, dport) = s.ports();
    let mut l4 = Vec::new();
    l4.extend_from_slice(&sport.to_be_bytes());
    l4.extend_from_slice(&dport.to_be_bytes());
    if s.tcp {
        let opts = pad4(s.tcp_opts.clone());
        let doff = (20 + opts.len()) / 4;
        l4.extend_from_slice(&s.seq.to_be_bytes());
        l4.extend_from_slice(&0xabcd_0123u32.to_be_bytes());
        l4.extend_from_slice(&[(doff as u8) << 4, s.tcp_flags, 0x72, 0x10, 0, 0, 0, 0]);
        l4.extend(opts);
    } else {
        let ul = (8 + s.payload.len()) as u16;
        l4.extend_from_slice(&ul.to_be_bytes());
        l4.extend_from_slice(&[0, 0]);
    }
    let l4_len = l4.len() + s.payload.len();
    let (src, dst): (&[u8], &[u8]);
    if s.v6 {
        src = &s.ip6.0;
        dst = &s.ip6.1;
        let mut exts = Vec::new();
        let mut types: Vec<u8> = s.ip6_exts.iter().map(|e| e.0).collect();
        types.push(proto);
        for (i, (_, n)) in s.ip6_exts.iter().enumerate() {
            let mut e = vec![0u8; 8 * (1 + usize::from(*n))];
            e[0] = types[i + 1];
            e[1] = *n;
            if e.len() > 2 {
                e[2] = 1; // PadN covering the rest
                e[3] = (e.len() - 4) as u8;
            }
            exts.extend(e);
        }
        let plen = (exts.len() + l4_len) as u16;
        f.extend_from_slice(&[0x60, 0x01, 0x23, 0x45]);
        f.extend_from_slice(&plen.to_be_bytes());
        f.extend_from_slice(&[types[0], 63]);
        f.extend_from_slice(src);
        f.extend_from_slice(dst);
        f.extend(exts);
    } else {
        src = &s.ip4.0;
        dst = &s.ip4.1;
        let opts = pad4(s.ip4_opts.clone());
        let ihl = (20 + opts.len()) / 4;
        let tot = (ihl * 4 + l4_len) as u16;
        f.extend_from_slice(&[0x40 | ihl as u8, 0x28]);
        f.extend_from_slice(&tot.to_be_bytes());
        f.extend_from_slice(&s.ip_id.to_be_bytes());
        f.extend_from_slice(&[if s.df { 0x40 } else { 0 }, 0, 61, proto, 0, 0]);
        f.extend_from_slice(src);
        f.extend_from_slice(dst);
        f.extend(opts);
        let c = !sum_fold_be(Sum16BitWords::new().add_slice(&f[l3_off..]));
        f[l3_off + 10..l3_off + 12].copy_from_slice(&c.to_be_bytes());
    }
    let l4_off = f.len();
    let ps = pseudo_sum(src, dst, proto, l4_len);
    let co = csum_offset(s.tcp);
    l4[co..co + 2].copy_from_slice(&ps.to_be_bytes());
    f.extend(l4);
    f.extend_from_slice(&s.payload);
    (f, l4_off)
}

/// Where the L4 checksum sits in a TCP (`tcp`) or UDP header.
pub fn csum_offset(tcp: bool) -> usize {
    if tcp {
        16
    } else {
        6
    }
}

/// The header a guest sends with a GSO frame (NEEDS_CSUM, csum at the L4 header).
pub fn gso_hdr(kind: GsoKind, gso_size: u16, l4_off: usize, tcp: bool) -> VirtioNetHdr {
    VirtioNetHdr {
        flags: F_NEEDS_CSUM,
        gso: GsoType::new(kind),
        hdr_len: 0,
        gso_size,
        csum_start: l4_off as u16,
        csum_offset: csum_offset(tcp) as u16,
        num_buffers: 1,
    }
}

/// Splits `f` at the given points (sorted, clamped), keeping empty pieces.
pub fn split<'a>(f: &'a [u8], points: &[usize]) -> Vec<&'a [u8]> {
    let mut pts: Vec<usize> = points.iter().map(|p| (*p).min(f.len())).collect();
    pts.sort_unstable();
    let mut out = Vec::new();
    let mut at = 0;
    for p in pts {
        out.push(&f[at..p]);
        at = p;
    }
    out.push(&f[at..]);
    out
}

/// End of the IPv6 unfragmentable part of a frame built from `spec`.
pub fn ip6_unfrag_end(spec: &FrameSpec) -> usize {
    let mut at = 14 + 4 * spec.vlans.len() + 40;
    let mut end = at;
    for (t, n) in &spec.ip6_exts {
        at += 8 * (1 + usize::from(*n));
        if *t != 60 {
            end = at;
        }
    }
    end
}

//! Internet checksum (RFC 1071): a fast one's-complement sum over byte slices, partial
//! sums that combine across scattered slices, and the TCP/UDP pseudo-headers.

/// A running one's-complement sum. Slices may be added in pieces of any length: the
/// sum remembers whether the next byte sits at an odd position and swaps accordingly
/// (RFC 1071 §2(B): the sum is byte-order independent up to a swap).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Checksum {
    /// Big-endian 16-bit words accumulated without folding.
    sum: u64,
    /// The next byte added lands in the low half of a 16-bit word.
    odd: bool,
}

impl Checksum {
    pub const fn new() -> Self {
        Checksum { sum: 0, odd: false }
    }

    /// Adds `data`, which continues the byte stream summed so far.
    #[inline]
    pub fn add_bytes(&mut self, data: &[u8]) {
        if data.is_empty() {
            return;
        }
        let mut v = sum_be(data);
        if self.odd {
            v = v.swap_bytes();
        }
        self.sum += u64::from(v);
        if data.len() & 1 == 1 {
            self.odd = !self.odd;
        }
    }

    /// Adds a big-endian 16-bit word as if it were the next two bytes of the stream.
    #[inline]
    pub fn add_u16(&mut self, v: u16) {
        let v = if self.odd { v.swap_bytes() } else { v };
        self.sum += u64::from(v);
    }

    /// Adds a big-endian 32-bit word as if it were the next four bytes of the stream.
    #[inline]
    pub fn add_u32(&mut self, v: u32) {
        self.add_u16((v >> 16) as u16);
        self.add_u16(v as u16);
    }

    /// Appends the bytes summed by `other` (which started at an even position of its
    /// own) to this stream.
    #[inline]
    pub fn combine(&mut self, other: &Checksum) {
        let mut v = fold(other.sum);
        if self.odd {
            v = v.swap_bytes();
        }
        self.sum += u64::from(v);
        if other.odd {
            self.odd = !self.odd;
        }
    }

    /// The folded (not inverted) 16-bit sum: what a partial checksum field holds.
    #[inline]
    pub fn fold(&self) -> u16 {
        fold(self.sum)
    }

    /// The checksum to store: the inverted folded sum.
    #[inline]
    pub fn finish(&self) -> u16 {
        !self.fold()
    }
}

/// Folds a 64-bit accumulation of 16-bit words to 16 bits with end-around carry.
#[inline]
pub fn fold(mut s: u64) -> u16 {
    s = (s & 0xffff_ffff) + (s >> 32);
    s = (s & 0xffff_ffff) + (s >> 32);
    s = (s & 0xffff) + (s >> 16);
    s = (s & 0xffff) + (s >> 16);
    s = (s & 0xffff) + (s >> 16);
    s as u16
}

#[inline(always)]
fn word32(c: &[u8], i: usize) -> u64 {
    u64::from(u32::from_ne_bytes([c[i], c[i + 1], c[i + 2], c[i + 3]]))
}

/// The folded sum of `data` read as big-endian 16-bit words (odd tail padded with 0).
#[inline]
pub fn sum_be(data: &[u8]) -> u16 {
    // Words were read in native order; the folded sum is the big-endian one swapped
    // on little-endian machines.
    u16::from_be(fold(sum_ne(data)))
}

/// Unfolded sum of native-endian 32-bit words, picking the widest vector unit.
#[inline]
fn sum_ne(data: &[u8]) -> u64 {
    if data.len() < 64 {
        return sum_small(data);
    }
    #[cfg(target_arch = "x86_64")]
    if data.len() >= 128 && std::arch::is_x86_feature_detected!("avx2") {
        // The crate's one `unsafe` outside `sys`: calling a `target_feature` function
        // needs it, and the checksum is the hottest loop of software segmentation.
        #[allow(unsafe_code)]
        // SAFETY: the CPU supports AVX2, checked just above.
        return unsafe { sum_ne_avx2(data) };
    }
    sum_ne_portable(data)
}

/// Short slices (headers, tails): 8 bytes at a time, then 4, 2, 1. Native-endian
/// 16- and 32-bit words mix freely (2^16 = 1 in one's-complement arithmetic); a last
/// odd byte is padded with a zero after it.
#[inline(always)]
fn sum_small(data: &[u8]) -> u64 {
    let mut s = 0u64;
    let mut c = data.chunks_exact(8);
    for w in &mut c {
        let v = u64::from_ne_bytes([w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7]]);
        s += (v & 0xffff_ffff) + (v >> 32);
    }
    let r = c.remainder();
    let mut i = 0;
    if r.len() >= 4 {
        s += word32(r, 0);
        i = 4;
    }
    if r.len() >= i + 2 {
        s += u64::from(u16::from_ne_bytes([r[i], r[i + 1]]));
        i += 2;
    }
    if r.len() > i {
        s += u64::from(u16::from_ne_bytes([r[i], 0]));
    }
    s
}

/// The same loop compiled for AVX2 (256-bit lanes).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn sum_ne_avx2(data: &[u8]) -> u64 {
    sum_ne_portable(data)
}

/// Native-endian 32-bit words added into independent 64-bit accumulators (no carry
/// lost below 16 GiB); the unrolled loop is what the compiler vectorises.
#[inline(always)]
fn sum_ne_portable(data: &[u8]) -> u64 {
    let mut acc = [0u64; 4];
    let mut chunks = data.chunks_exact(64);
    for c in &mut chunks {
        for (j, a) in acc.iter_mut().enumerate() {
            *a += word32(c, j * 4)
                + word32(c, 16 + j * 4)
                + word32(c, 32 + j * 4)
                + word32(c, 48 + j * 4);
        }
    }
    sum_small(chunks.remainder()) + acc[0] + acc[1] + acc[2] + acc[3]
}

/// The Internet checksum of one contiguous buffer.
#[inline]
pub fn checksum(data: &[u8]) -> u16 {
    !sum_be(data)
}

/// The TCP/UDP pseudo-header over IPv4 (RFC 793): addresses, protocol, L4 length.
#[inline]
pub fn pseudo_v4(src: &[u8; 4], dst: &[u8; 4], proto: u8, l4_len: u32) -> Checksum {
    let mut c = Checksum::new();
    c.add_u32(u32::from_be_bytes(*src));
    c.add_u32(u32::from_be_bytes(*dst));
    c.add_u16(u16::from(proto));
    c.add_u16(l4_len as u16);
    c
}

/// The upper-layer pseudo-header over IPv6 (RFC 8200 §8.1).
#[inline]
pub fn pseudo_v6(src: &[u8; 16], dst: &[u8; 16], proto: u8, l4_len: u32) -> Checksum {
    let mut c = Checksum::new();
    for w in src.chunks_exact(2).chain(dst.chunks_exact(2)) {
        c.add_u16(u16::from_be_bytes([w[0], w[1]]));
    }
    c.add_u32(l4_len);
    c.add_u32(u32::from(proto));
    c
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testkit::frames::pattern;

    /// The textbook byte-at-a-time definition, as an oracle.
    fn naive(data: &[u8]) -> u16 {
        let mut s: u32 = 0;
        for c in data.chunks(2) {
            let w = if c.len() == 2 {
                u16::from_be_bytes([c[0], c[1]])
            } else {
                u16::from_be_bytes([c[0], 0])
            };
            s += u32::from(w);
            s = (s & 0xffff) + (s >> 16);
        }
        s as u16
    }

    #[test]
    fn rfc1071_example() {
        // RFC 1071 §3: 00 01 f2 03 f4 f5 f6 f7 sums to 0xddf2.
        assert_eq!(
            sum_be(&[0x00, 0x01, 0xf2, 0x03, 0xf4, 0xf5, 0xf6, 0xf7]),
            0xddf2
        );
        assert_eq!(
            checksum(&[0x00, 0x01, 0xf2, 0x03, 0xf4, 0xf5, 0xf6, 0xf7]),
            !0xddf2
        );
    }

    #[test]
    fn matches_naive_for_all_small_lengths() {
        for n in 0..300 {
            let d = pattern(n);
            assert_eq!(sum_be(&d), naive(&d), "len {n}");
        }
        let d = vec![0xffu8; 70000];
        assert_eq!(sum_be(&d), naive(&d));
    }

    #[test]
    fn split_anywhere_gives_same_sum() {
        let d = pattern(1000);
        let whole = naive(&d);
        for a in [0, 1, 2, 3, 63, 64, 65, 499, 999] {
            for b in [a, a + 1, a + 7, 1000] {
                let b = b.min(1000);
                let mut c = Checksum::new();
                c.add_bytes(&d[..a]);
                c.add_bytes(&d[a..b]);
                c.add_bytes(&d[b..]);
                assert_eq!(c.fold(), whole, "{a} {b}");
                // Combining independently computed partial sums.
                let mut x = Checksum::new();
                x.add_bytes(&d[..a]);
                let mut y = Checksum::new();
                y.add_bytes(&d[a..]);
                x.combine(&y);
                assert_eq!(x.fold(), whole, "combine at {a}");
            }
        }
    }

    #[test]
    fn pseudo_headers_match_layout() {
        let mut raw = Vec::new();
        raw.extend_from_slice(&[10, 0, 0, 1, 10, 0, 0, 2, 0, 6, 0x05, 0xdc]);
        assert_eq!(
            pseudo_v4(&[10, 0, 0, 1], &[10, 0, 0, 2], 6, 1500).fold(),
            naive(&raw)
        );
        let s = [0x20u8; 16];
        let d = [0xfeu8; 16];
        let mut raw6 = Vec::new();
        raw6.extend_from_slice(&s);
        raw6.extend_from_slice(&d);
        raw6.extend_from_slice(&70000u32.to_be_bytes());
        raw6.extend_from_slice(&[0, 0, 0, 17]);
        assert_eq!(pseudo_v6(&s, &d, 17, 70000).fold(), naive(&raw6));
    }
}

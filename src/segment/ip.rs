//! Per-segment edits of the IP layer in a copied header: length fields, IPv4 ID,
//! fragment field and header checksum, and the L4 pseudo-header from the addresses.

use super::csum::{self, Checksum};
use super::parse::{Headers, L3};

#[inline]
pub(crate) fn be16(b: &[u8], i: usize) -> u16 {
    u16::from_be_bytes([b[i], b[i + 1]])
}

#[inline]
pub(crate) fn be32(b: &[u8], i: usize) -> u32 {
    u32::from_be_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]])
}

#[inline]
pub(crate) fn put16(b: &mut [u8], i: usize, v: u16) {
    b[i..i + 2].copy_from_slice(&v.to_be_bytes());
}

#[inline]
pub(crate) fn put32(b: &mut [u8], i: usize, v: u32) {
    b[i..i + 4].copy_from_slice(&v.to_be_bytes());
}

/// IPv4 fragment field bits.
pub(crate) const IPV4_MF: u16 = 0x2000;

/// Rewrites the IP header at `h.l3_off` of `hdr` for a packet whose L3 part (IP
/// header + everything after it) is `l3_total` bytes. IPv4 also gets `id`, an optional
/// new fragment field, and a fresh header checksum. The caller guarantees
/// `l3_total <= 0xffff` (IPv4) / `l3_total - 40 <= 0xffff` (IPv6).
#[inline]
pub(crate) fn set_l3(hdr: &mut [u8], h: &Headers, l3_total: usize, id: u16, frag: Option<u16>) {
    let o = h.l3_off;
    match h.l3 {
        L3::Ipv4 => {
            put16(hdr, o + 2, l3_total as u16);
            put16(hdr, o + 4, id);
            if let Some(f) = frag {
                put16(hdr, o + 6, f);
            }
            put16(hdr, o + 10, 0);
            let c = csum::checksum(&hdr[o..o + h.l3_len]);
            put16(hdr, o + 10, c);
        }
        L3::Ipv6 => put16(hdr, o + 4, (l3_total - 40) as u16),
    }
}

/// The IPv4 header sum without the fields a segment changes (total length, ID,
/// checksum), taken once from the template so that per-segment checksums never
/// re-read freshly written bytes (a store-forwarding stall per segment otherwise).
#[inline]
pub(crate) fn ipv4_base(tmpl: &[u8], h: &Headers) -> Checksum {
    let o = h.l3_off;
    let mut c = Checksum::new();
    if h.l3 == L3::Ipv4 {
        c.add_bytes(&tmpl[o..o + 2]);
        c.add_bytes(&tmpl[o + 6..o + 10]);
        c.add_bytes(&tmpl[o + 12..o + h.l3_len]);
    }
    c
}

/// The IPv4 ID the first segment keeps (later ones count up from it); 0 for IPv6.
pub(crate) fn first_ip_id(tmpl: &[u8], h: &Headers) -> u16 {
    match h.l3 {
        L3::Ipv4 => be16(tmpl, h.l3_off + 4),
        L3::Ipv6 => 0,
    }
}

/// `set_l3` for TCP/USO segments: the IPv4 checksum from `base` (see `ipv4_base`).
#[inline]
pub(crate) fn set_l3_fast(hdr: &mut [u8], h: &Headers, base: &Checksum, l3_total: usize, id: u16) {
    let o = h.l3_off;
    match h.l3 {
        L3::Ipv4 => {
            let mut c = *base;
            c.add_u16(l3_total as u16);
            c.add_u16(id);
            put16(hdr, o + 2, l3_total as u16);
            put16(hdr, o + 4, id);
            put16(hdr, o + 10, c.finish());
        }
        L3::Ipv6 => put16(hdr, o + 4, (l3_total - 40) as u16),
    }
}

/// The pseudo-header sum for an L4 header of protocol `proto` and length `l4_len`,
/// addresses taken from the (copied) IP header.
#[inline]
pub(crate) fn pseudo(hdr: &[u8], h: &Headers, proto: u8, l4_len: usize) -> Checksum {
    let o = h.l3_off;
    match h.l3 {
        L3::Ipv4 => {
            let a = |i: usize| [hdr[i], hdr[i + 1], hdr[i + 2], hdr[i + 3]];
            csum::pseudo_v4(&a(o + 12), &a(o + 16), proto, l4_len as u32)
        }
        L3::Ipv6 => {
            let mut src = [0u8; 16];
            let mut dst = [0u8; 16];
            src.copy_from_slice(&hdr[o + 8..o + 24]);
            dst.copy_from_slice(&hdr[o + 24..o + 40]);
            csum::pseudo_v6(&src, &dst, proto, l4_len as u32)
        }
    }
}

/// Replaces the IPv4 options whose "copied" flag is clear with NOPs, as for every
/// fragment after the first (RFC 791; Linux `ip_options_fragment`). Stops at an
/// end-of-list or a malformed option.
pub(crate) fn ipv4_strip_uncopied_options(opts: &mut [u8]) {
    let mut i = 0;
    while i < opts.len() {
        match opts[i] {
            0 => break,
            1 => i += 1,
            kind => {
                let Some(&l) = opts.get(i + 1) else { break };
                let l = usize::from(l);
                if l < 2 || i + l > opts.len() {
                    break;
                }
                if kind & 0x80 == 0 {
                    opts[i..i + l].fill(1);
                }
                i += l;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strips_only_uncopied_options() {
        // Record route (7, not copied), NOP, security (130, copied), EOL.
        let mut o = [7, 3, 4, 1, 130, 3, 9, 0];
        ipv4_strip_uncopied_options(&mut o);
        assert_eq!(o, [1, 1, 1, 1, 130, 3, 9, 0]);
        // Malformed length: left alone from there.
        let mut o = [7, 1, 7, 3];
        ipv4_strip_uncopied_options(&mut o);
        assert_eq!(o, [7, 1, 7, 3]);
    }
}

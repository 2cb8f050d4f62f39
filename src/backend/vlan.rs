//! 802.1Q access VLANs: the VLAN id type, reading a frame's tag, and the zero-copy
//! views that add or remove a tag (a rewritten head, then slices of the original).

use std::fmt;

use serde::{Deserialize, Serialize};

use super::deliver::Frame;
use crate::segment::parse::gather;
use crate::vnet_hdr::VirtioNetHdr;

pub const TPID_8021Q: u16 = 0x8100;
/// Ethertypes that say a frame already carries a tag (802.1Q, 802.1ad, pre-standard QinQ).
const TAG_TYPES: [u16; 3] = [TPID_8021Q, 0x88a8, 0x9100];
pub const TAG_LEN: usize = 4;
/// Destination and source MAC: what stays in front of a tag.
const ADDRS: usize = 12;

/// A VLAN id an access port can belong to (1..=4094; 0 and 4095 are reserved).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "u16", into = "u16")]
pub struct Vid(u16);

impl Vid {
    pub const MIN: u16 = 1;
    pub const MAX: u16 = 4094;

    pub fn new(v: u16) -> Option<Vid> {
        (Self::MIN..=Self::MAX).contains(&v).then_some(Vid(v))
    }

    pub fn get(self) -> u16 {
        self.0
    }
}

impl TryFrom<u16> for Vid {
    type Error = String;
    fn try_from(v: u16) -> Result<Vid, String> {
        Vid::new(v).ok_or_else(|| format!("VLAN id {v} outside {}..{}", Vid::MIN, Vid::MAX))
    }
}

impl From<Vid> for u16 {
    fn from(v: Vid) -> u16 {
        v.0
    }
}

impl fmt::Display for Vid {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// The broadcast domain of a frame: an access VLAN, or (`None`) the untagged domain.
pub type Domain = Option<Vid>;

/// What follows a frame's MAC addresses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tag {
    /// Shorter than an Ethernet header.
    Short,
    Untagged,
    /// An 802.1Q tag with this 12-bit VLAN id (0: priority tag only).
    Dot1q(u16),
    /// Another tag type (802.1ad, 0x9100), or an 802.1Q tag cut short.
    Other,
}

/// Reads the tag of a frame split anywhere.
pub fn tag(parts: &[&[u8]]) -> Tag {
    let mut h = [0u8; ADDRS + TAG_LEN];
    let n = gather(parts, &mut h);
    if n < ADDRS + 2 {
        return Tag::Short;
    }
    let ethertype = u16::from_be_bytes([h[12], h[13]]);
    if !TAG_TYPES.contains(&ethertype) {
        Tag::Untagged
    } else if ethertype == TPID_8021Q && n == ADDRS + TAG_LEN {
        Tag::Dot1q(u16::from_be_bytes([h[14], h[15]]) & 0x0fff)
    } else {
        Tag::Other
    }
}

/// Appends the slices of `parts` that follow its first `skip` bytes.
fn tail<'a>(parts: &[&'a [u8]], mut skip: usize, out: &mut Vec<&'a [u8]>) {
    for p in parts {
        if skip >= p.len() {
            skip -= p.len();
        } else {
            out.push(&p[skip..]);
            skip = 0;
        }
    }
}

/// `frame` with an 802.1Q tag for `vid` after its addresses (priority 0): `head` gets
/// the addresses and the tag, `parts` the view. The header's offsets move by 4.
pub fn push<'a>(
    frame: &Frame<'a>,
    vid: Vid,
    head: &'a mut [u8; ADDRS + TAG_LEN],
    parts: &'a mut Vec<&'a [u8]>,
) -> Result<Frame<'a>, &'static str> {
    if gather(frame.parts, &mut head[..ADDRS]) < ADDRS {
        return Err("too_short");
    }
    let mut hdr = frame.hdr;
    if hdr.needs_csum() {
        hdr.csum_start = hdr.csum_start.checked_add(4).ok_or("vlan_bad_offsets")?;
    }
    if hdr.hdr_len != 0 {
        hdr.hdr_len = hdr.hdr_len.checked_add(4).ok_or("vlan_bad_offsets")?;
    }
    head[ADDRS..ADDRS + 2].copy_from_slice(&TPID_8021Q.to_be_bytes());
    head[ADDRS + 2..].copy_from_slice(&vid.get().to_be_bytes());
    parts.clear();
    parts.reserve(frame.parts.len() + 1);
    parts.push(&head[..]);
    tail(frame.parts, ADDRS, parts);
    Ok(Frame {
        hdr,
        parts,
        len: frame.len + TAG_LEN,
    })
}

/// `frame` without its (first) tag: `head` gets the addresses, `parts` the view. The
/// header's offsets move by -4; a checksum starting inside the tag is refused.
pub fn pop<'a>(
    frame: &Frame<'a>,
    head: &'a mut [u8; ADDRS + TAG_LEN],
    parts: &'a mut Vec<&'a [u8]>,
) -> Result<Frame<'a>, &'static str> {
    if frame.len < ADDRS + TAG_LEN + 2 || gather(frame.parts, &mut head[..ADDRS]) < ADDRS {
        return Err("too_short");
    }
    let mut hdr: VirtioNetHdr = frame.hdr;
    if hdr.needs_csum() {
        if usize::from(hdr.csum_start) < ADDRS + TAG_LEN {
            return Err("vlan_bad_offsets");
        }
        hdr.csum_start -= 4;
    }
    hdr.hdr_len = hdr.hdr_len.saturating_sub(4);
    parts.clear();
    parts.reserve(frame.parts.len() + 1);
    parts.push(&head[..ADDRS]);
    tail(frame.parts, ADDRS + TAG_LEN, parts);
    Ok(Frame {
        hdr,
        parts,
        len: frame.len - TAG_LEN,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vnet_hdr::{GsoKind, GsoType, F_NEEDS_CSUM};

    fn bytes(f: &Frame) -> Vec<u8> {
        f.parts.concat()
    }

    /// `data` cut at each of `cuts` (ascending).
    fn split<'a>(data: &'a [u8], cuts: &[usize]) -> Vec<&'a [u8]> {
        let mut out = Vec::new();
        let mut at = 0;
        for &c in cuts {
            out.push(&data[at..c]);
            at = c;
        }
        out.push(&data[at..]);
        out
    }

    fn sample(ethertype: u16, len: usize) -> Vec<u8> {
        let mut f: Vec<u8> = (0..len.max(14)).map(|i| (i * 7 + 3) as u8).collect();
        f[12..14].copy_from_slice(&ethertype.to_be_bytes());
        f.truncate(len);
        f
    }

    fn tso_hdr() -> VirtioNetHdr {
        VirtioNetHdr {
            flags: F_NEEDS_CSUM,
            gso: GsoType::new(GsoKind::TcpV4),
            hdr_len: 66,
            gso_size: 1448,
            csum_start: 34,
            csum_offset: 16,
            num_buffers: 1,
        }
    }

    #[test]
    fn vid_range() {
        assert!(Vid::new(0).is_none() && Vid::new(4095).is_none());
        assert_eq!(Vid::new(1).map(Vid::get), Some(1));
        assert_eq!(Vid::new(4094).map(Vid::get), Some(4094));
    }

    #[test]
    fn reads_tags_split_anywhere() {
        let mut t = sample(TPID_8021Q, 40);
        t[14..16].copy_from_slice(&0x600au16.to_be_bytes()); // PCP 3, VID 10
        for cut in 1..t.len() {
            assert_eq!(tag(&split(&t, &[cut])), Tag::Dot1q(10), "cut at {cut}");
        }
        assert_eq!(tag(&[&sample(0x0800, 60)]), Tag::Untagged);
        assert_eq!(tag(&[&sample(0x88a8, 60)]), Tag::Other);
        assert_eq!(tag(&[&sample(TPID_8021Q, 15)]), Tag::Other);
        assert_eq!(tag(&[&sample(0x0800, 60)[..13]]), Tag::Short);
        assert_eq!(tag(&[]), Tag::Short);
    }

    #[test]
    fn push_at_every_split() {
        let plain = sample(0x0800, 100);
        let vid = Vid::new(10).unwrap();
        let mut want = plain[..12].to_vec();
        want.extend_from_slice(&[0x81, 0x00, 0x00, 0x0a]);
        want.extend_from_slice(&plain[12..]);
        for a in 1..plain.len() - 1 {
            for b in [a + 1, plain.len() - 1] {
                let parts = split(&plain, &[a, b]);
                let f = Frame {
                    hdr: tso_hdr(),
                    parts: &parts,
                    len: plain.len(),
                };
                let (mut head, mut v) = ([0u8; 16], Vec::new());
                let t = push(&f, vid, &mut head, &mut v).unwrap();
                assert_eq!(bytes(&t), want, "split at {a},{b}");
                assert_eq!(t.len, want.len());
                assert!(t.parts.iter().all(|p| !p.is_empty()));
                // Past the new head, the view borrows the original bytes.
                let last = *t.parts.last().unwrap();
                assert_eq!(last.as_ptr(), plain[b.max(12)..].as_ptr());
                assert_eq!(t.hdr.csum_start, 38);
                assert_eq!(t.hdr.hdr_len, 70);
                assert_eq!((t.hdr.csum_offset, t.hdr.gso_size), (16, 1448));
                assert_eq!(tag(t.parts), Tag::Dot1q(10));
            }
        }
    }

    #[test]
    fn pop_at_every_split() {
        let mut tagged = sample(TPID_8021Q, 100);
        tagged[14..16].copy_from_slice(&0x000au16.to_be_bytes());
        let mut want = tagged[..12].to_vec();
        want.extend_from_slice(&tagged[16..]);
        let mut hdr = tso_hdr();
        hdr.csum_start = 38;
        hdr.hdr_len = 70;
        for a in 1..tagged.len() - 1 {
            for b in [a + 1, tagged.len() - 1] {
                let parts = split(&tagged, &[a, b]);
                let f = Frame {
                    hdr,
                    parts: &parts,
                    len: tagged.len(),
                };
                let (mut head, mut v) = ([0u8; 16], Vec::new());
                let u = pop(&f, &mut head, &mut v).unwrap();
                assert_eq!(bytes(&u), want, "split at {a},{b}");
                assert_eq!(u.len, want.len());
                assert!(u.parts.iter().all(|p| !p.is_empty()));
                assert_eq!((u.hdr.csum_start, u.hdr.hdr_len), (34, 66));
            }
        }
    }

    #[test]
    fn push_then_pop_is_identity() {
        let plain = sample(0x86dd, 300);
        let parts = split(&plain, &[5, 13, 14, 200]);
        let f = Frame {
            hdr: VirtioNetHdr::default(),
            parts: &parts,
            len: plain.len(),
        };
        let (mut h1, mut v1) = ([0u8; 16], Vec::new());
        let t = push(&f, Vid::new(4094).unwrap(), &mut h1, &mut v1).unwrap();
        assert_eq!(tag(t.parts), Tag::Dot1q(4094));
        let (mut h2, mut v2) = ([0u8; 16], Vec::new());
        let u = pop(&t, &mut h2, &mut v2).unwrap();
        assert_eq!(bytes(&u), plain);
        // Without NEEDS_CSUM and hdr_len the offsets are left alone.
        assert_eq!(u.hdr, VirtioNetHdr::default());
        assert_eq!(t.hdr, VirtioNetHdr::default());
    }

    #[test]
    fn refuses_what_cannot_be_rewritten() {
        let short = sample(0x0800, 11);
        let f = Frame {
            hdr: VirtioNetHdr::default(),
            parts: &[&short],
            len: short.len(),
        };
        let (mut h, mut v) = ([0u8; 16], Vec::new());
        assert_eq!(
            push(&f, Vid::new(1).unwrap(), &mut h, &mut v).err(),
            Some("too_short")
        );
        // A checksum that would start inside the removed tag.
        let tagged = sample(TPID_8021Q, 80);
        let mut hdr = tso_hdr();
        hdr.csum_start = 14;
        let f = Frame {
            hdr,
            parts: &[&tagged],
            len: tagged.len(),
        };
        let (mut h, mut v) = ([0u8; 16], Vec::new());
        assert_eq!(pop(&f, &mut h, &mut v).err(), Some("vlan_bad_offsets"));
        let mut hdr = tso_hdr();
        hdr.csum_start = u16::MAX - 1;
        let f = Frame {
            hdr,
            parts: &[&tagged],
            len: tagged.len(),
        };
        let (mut h, mut v) = ([0u8; 16], Vec::new());
        assert_eq!(
            push(&f, Vid::new(1).unwrap(), &mut h, &mut v).err(),
            Some("vlan_bad_offsets")
        );
    }
}

#[cfg(test)]
mod segment_tests {
    //! GSO frames through a tag view and the software segmenter, checked with the
    //! segmenter's etherparse oracle on the untagged bytes.
    use super::*;
    use crate::segment::testutil::{self, FrameSpec};
    use crate::segment::{CsumMode, SegmentOpts};
    use crate::vnet_hdr::GsoKind;

    fn spec(v6: bool) -> FrameSpec {
        FrameSpec {
            v6,
            tcp_opts: testutil::tcp_timestamps(),
            payload: testutil::pattern(45 * 1448 + 7),
            ..FrameSpec::default()
        }
    }

    /// Segments `f` to wire size, pops the tag of every segment (which must carry
    /// `vid`) and checks them against `plain`, the untagged frame's spec.
    fn segment_and_check(f: &Frame, vid: u16, plain: &FrameSpec, gso: &VirtioNetHdr) {
        let opts = SegmentOpts {
            csum: CsumMode::Full,
            max_frame: None,
        };
        let (sum, segs) = testutil::run(&f.hdr, f.parts, &opts).unwrap();
        assert_eq!(segs.len(), 46);
        let untagged: Vec<_> = segs
            .iter()
            .map(|(h, s)| {
                assert_eq!(tag(&[s]), Tag::Dot1q(vid));
                let t = Frame {
                    hdr: *h,
                    parts: &[s],
                    len: s.len(),
                };
                let (mut head, mut v) = ([0u8; 16], Vec::new());
                let u = pop(&t, &mut head, &mut v).unwrap();
                (u.hdr, u.parts.concat())
            })
            .collect();
        let mut sum = sum;
        sum.bytes -= 4 * segs.len();
        testutil::check(plain, gso, &opts, &sum, &untagged);
    }

    #[test]
    fn pushed_tso_frames_segment_correctly() {
        for v6 in [false, true] {
            let plain = spec(v6);
            let (bytes, l4_off) = testutil::build(&plain);
            let kind = if v6 { GsoKind::TcpV6 } else { GsoKind::TcpV4 };
            let hdr = testutil::gso_hdr(kind, 1448, l4_off, true);
            let parts = testutil::split(&bytes, &[7, 13, 40, 3000, 20000]);
            let parts: Vec<&[u8]> = parts.into_iter().filter(|p| !p.is_empty()).collect();
            let f = Frame {
                hdr,
                parts: &parts,
                len: bytes.len(),
            };
            let (mut head, mut v) = ([0u8; 16], Vec::new());
            let t = push(&f, Vid::new(10).unwrap(), &mut head, &mut v).unwrap();
            assert_eq!(usize::from(t.hdr.csum_start), l4_off + 4);
            crate::vnet_hdr::validate(&t.hdr, t.parts).expect("tagged view is a valid GSO frame");
            segment_and_check(&t, 10, &plain, &hdr);
        }
    }

    #[test]
    fn popped_tso_frames_segment_correctly() {
        let plain = spec(false);
        let tagged_spec = FrameSpec {
            vlans: vec![TPID_8021Q],
            ..plain.clone()
        };
        let (bytes, l4_off) = testutil::build(&tagged_spec);
        let hdr = testutil::gso_hdr(GsoKind::TcpV4, 1448, l4_off, true);
        let parts = testutil::split(&bytes, &[15, 17, 1000]);
        let f = Frame {
            hdr,
            parts: &parts,
            len: bytes.len(),
        };
        let (mut head, mut v) = ([0u8; 16], Vec::new());
        let u = pop(&f, &mut head, &mut v).unwrap();
        assert_eq!(usize::from(u.hdr.csum_start), l4_off - 4);
        assert_eq!(tag(u.parts), Tag::Untagged);
        let opts = SegmentOpts {
            csum: CsumMode::Full,
            max_frame: None,
        };
        let (sum, segs) = testutil::run(&u.hdr, u.parts, &opts).unwrap();
        let plain_hdr = testutil::gso_hdr(GsoKind::TcpV4, 1448, l4_off - 4, true);
        testutil::check(&plain, &plain_hdr, &opts, &sum, &segs);
        // And back: re-tagging the untagged view segments like the original.
        let (mut h2, mut v2) = ([0u8; 16], Vec::new());
        let t = push(&u, Vid::new(5).unwrap(), &mut h2, &mut v2).unwrap();
        segment_and_check(&t, 5, &plain, &plain_hdr);
    }
}

//! 802.1Q access VLANs in the switch: which broadcast domain a frame belongs to
//! (classify), and the zero-copy views that add or remove a tag (a rewritten head,
//! then slices of the original) with the frame's parsed offsets moved to match.

use crate::frame::{Frame, GsoLayout};
use crate::l2::{Domain, Tag, Vid, VlanSet, ADDRS_LEN, ETHERTYPE_VLAN, ETH_HDR_LEN, TAG_LEN};
use crate::segment::parse::{gather, MAX_HEADERS};
use crate::segment::L3;
use crate::stats::DropReason;

/// How a frame's source attaches to the switch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Attach<'a> {
    /// A port of this access VLAN.
    Access(Vid),
    /// A port without a VLAN (the untagged domain): untagged frames only.
    Untagged,
    /// A `trunk=on` port: these VLANs tagged, the untagged domain untagged.
    TrunkPort(&'a VlanSet),
    /// An uplink: a trunk carrying every VLAN tagged and the untagged domain as is.
    Trunk,
}

/// The domain a frame entered and whether it still carries that domain's tag.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ingress {
    pub domain: Domain,
    pub tagged: bool,
}

impl Ingress {
    pub const UNTAGGED: Ingress = Ingress {
        domain: None,
        tagged: false,
    };
}

/// Which domain a frame with `tag` entering at `at` belongs to, or the drop reason.
/// `vlans`: every VLAN some port uses (access VLANs, trunk ports' allowed VIDs),
/// sorted. Guests may send tags only on trunk ports, and only of their allowed VLANs:
/// an 802.1ad or 0x9100 tag, a priority tag or a double tag is never read as
/// untagged-domain traffic, so no guest can put a frame on the uplink that a switch
/// beyond would file under another VLAN.
pub fn classify(at: Attach, tag: Tag, vlans: &[Vid]) -> Result<Ingress, DropReason> {
    let in_use = |vid: u16| Vid::new(vid).is_some_and(|v| vlans.binary_search(&v).is_ok());
    let vlan = |vid: u16| Ingress {
        domain: Vid::new(vid),
        tagged: true,
    };
    match (at, tag) {
        (_, Tag::Short) => Err(DropReason::TooShort),
        (_, Tag::Untagged) => Ok(match at {
            Attach::Access(v) => Ingress {
                domain: Some(v),
                tagged: false,
            },
            _ => Ingress::UNTAGGED,
        }),
        (Attach::Access(_), _) => Err(DropReason::TaggedOnAccessPort),
        // An untagged-domain guest must not speak for any VLAN on the trunk.
        (Attach::Untagged, Tag::Dot1q(vid)) if in_use(vid) => Err(DropReason::TaggedWithAccessVlan),
        (Attach::Untagged, _) => Err(DropReason::TaggedOnUntaggedPort),
        (Attach::TrunkPort(allowed), Tag::Dot1q(vid)) if allowed.contains(vid) => Ok(vlan(vid)),
        (Attach::TrunkPort(_), _) => Err(DropReason::VlanNotAllowed),
        (Attach::Trunk, Tag::Dot1q(vid)) if in_use(vid) => Ok(vlan(vid)),
        // Tags no port uses stay the untagged domain's, kept as they are.
        (Attach::Trunk, _) => Ok(Ingress::UNTAGGED),
    }
}

/// Where a retagged view keeps its new head and slice list.
#[derive(Default)]
pub struct ViewBuf<'a> {
    head: [u8; ADDRS_LEN + TAG_LEN],
    parts: Vec<&'a [u8]>,
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

/// The parsed offsets of a GSO frame after `delta` bytes were inserted (+4) or
/// removed (-4) in front of its first ethertype.
fn shift(layout: GsoLayout, delta: isize) -> GsoLayout {
    let mv = |v: usize| v.saturating_add_signed(delta);
    let mut h = layout.headers;
    h.vlan_tags = h.vlan_tags.saturating_add_signed(delta.signum() as i8);
    h.l3_off = mv(h.l3_off);
    h.l4_off = mv(h.l4_off);
    h.frame_len = mv(h.frame_len);
    h.ip6_unfrag_end = mv(h.ip6_unfrag_end);
    if h.l3 == L3::Ipv6 {
        h.ip6_nexthdr_off = mv(h.ip6_nexthdr_off);
    }
    GsoLayout {
        headers: h,
        ..layout
    }
}

/// `frame` with an 802.1Q tag for `vid` after its addresses (priority 0). The header's
/// offsets and the parsed layout move by 4.
pub fn push<'a>(
    frame: &Frame<'a>,
    vid: Vid,
    buf: &'a mut ViewBuf<'a>,
) -> Result<Frame<'a>, DropReason> {
    if gather(frame.parts, &mut buf.head[..ADDRS_LEN]) < ADDRS_LEN {
        return Err(DropReason::TooShort);
    }
    let gso = frame.gso.map(|l| shift(l, TAG_LEN as isize));
    if gso.is_some_and(|l| l.headers.hdr_len() > MAX_HEADERS) {
        // Past what the segmenter (and any later parse) takes as headers.
        return Err(DropReason::VlanBadOffsets);
    }
    let mut hdr = frame.hdr;
    if hdr.needs_csum() {
        hdr.csum_start = hdr
            .csum_start
            .checked_add(4)
            .ok_or(DropReason::VlanBadOffsets)?;
    }
    if hdr.hdr_len != 0 {
        hdr.hdr_len = hdr
            .hdr_len
            .checked_add(4)
            .ok_or(DropReason::VlanBadOffsets)?;
    }
    buf.head[ADDRS_LEN..ADDRS_LEN + 2].copy_from_slice(&ETHERTYPE_VLAN.to_be_bytes());
    buf.head[ADDRS_LEN + 2..].copy_from_slice(&vid.get().to_be_bytes());
    let ViewBuf { head, parts } = buf;
    parts.clear();
    parts.reserve(frame.parts.len() + 1);
    parts.push(&head[..]);
    tail(frame.parts, ADDRS_LEN, parts);
    Ok(Frame {
        hdr,
        parts,
        len: frame.len + TAG_LEN,
        tag: Tag::Dot1q(vid.get()),
        gso,
        ..*frame
    })
}

/// `frame` without its (first) tag. The header's offsets and the parsed layout move
/// by -4; a checksum starting inside the tag is refused.
pub fn pop<'a>(frame: &Frame<'a>, buf: &'a mut ViewBuf<'a>) -> Result<Frame<'a>, DropReason> {
    if frame.len < ETH_HDR_LEN + TAG_LEN
        || gather(frame.parts, &mut buf.head[..ADDRS_LEN]) < ADDRS_LEN
    {
        return Err(DropReason::TooShort);
    }
    let mut hdr = frame.hdr;
    if hdr.needs_csum() {
        if usize::from(hdr.csum_start) < ADDRS_LEN + TAG_LEN {
            return Err(DropReason::VlanBadOffsets);
        }
        hdr.csum_start -= 4;
    }
    hdr.hdr_len = hdr.hdr_len.saturating_sub(4);
    let ViewBuf { head, parts } = buf;
    parts.clear();
    parts.reserve(frame.parts.len() + 1);
    parts.push(&head[..ADDRS_LEN]);
    tail(frame.parts, ADDRS_LEN + TAG_LEN, parts);
    // What follows the addresses now: 16 bytes are copied, nothing is parsed.
    let mut now = [0u8; ADDRS_LEN + TAG_LEN];
    let n = gather(parts, &mut now);
    Ok(Frame {
        hdr,
        parts,
        len: frame.len - TAG_LEN,
        tag: Tag::read(&now[..n]),
        gso: frame.gso.map(|l| shift(l, -(TAG_LEN as isize))),
        ..*frame
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::segment::{parse_headers, CsumMode, SegmentOpts, Segmenter};
    use crate::testkit::frames::{self, ethernet_len, pattern, FrameSpec};
    use crate::testkit::oracle;
    use crate::vnet_hdr::{GsoKind, GsoType, VirtioNetHdr, F_NEEDS_CSUM};

    /// A frame over `parts` as the datapath builds it, split anywhere (tests only).
    fn frame<'a>(hdr: VirtioNetHdr, parts: &'a [&'a [u8]]) -> Frame<'a> {
        let mut head = [0u8; 16];
        let n = gather(parts, &mut head);
        let gso = hdr.gso.is_gso().then(|| {
            let headers = parse_headers(parts).unwrap();
            let plan = crate::segment::plan(hdr.gso.kind, hdr.gso_size, &headers, None).unwrap();
            GsoLayout { headers, plan }
        });
        Frame {
            hdr,
            parts,
            guest: None,
            len: parts.iter().map(|p| p.len()).sum(),
            dst: Default::default(),
            src: Default::default(),
            tag: Tag::read(&head[..n]),
            gso,
        }
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

    fn plain_hdr() -> VirtioNetHdr {
        VirtioNetHdr {
            gso: GsoType::NONE,
            ..tso_hdr()
        }
    }

    #[test]
    fn classify_by_attachment_and_tag() {
        let v = |n| Vid::new(n).unwrap();
        // VLANs in use: access 10 and 20, and the trunk's 10 and 40-41.
        let vlans = [v(10), v(20), v(40), v(41)];
        let allowed: VlanSet = "10:40-41".parse().unwrap();
        let c = |at, tag| classify(at, tag, &vlans);
        let vlan = |n, tagged| {
            Ok(Ingress {
                domain: Vid::new(n),
                tagged,
            })
        };
        // Every kind of tag: untagged, 802.1Q with a VID in use / not in use / the
        // priority tag, and 802.1ad, 0x9100 or a cut-short 802.1Q (Other; double tags
        // are read by their outer tag, one of these).
        let tags = [
            Tag::Untagged,
            Tag::Dot1q(10),
            Tag::Dot1q(20),
            Tag::Dot1q(40),
            Tag::Dot1q(30),
            Tag::Dot1q(0),
            Tag::Dot1q(4095),
            Tag::Other,
        ];
        let want = |at: Attach, tag: Tag| -> Result<Ingress, DropReason> {
            use DropReason::*;
            match (at, tag) {
                (Attach::Access(_), Tag::Untagged) => vlan(10, false),
                (Attach::Access(_), _) => Err(TaggedOnAccessPort),
                (_, Tag::Untagged) => Ok(Ingress::UNTAGGED),
                (Attach::Untagged, Tag::Dot1q(10 | 20 | 40)) => Err(TaggedWithAccessVlan),
                (Attach::Untagged, _) => Err(TaggedOnUntaggedPort),
                (Attach::TrunkPort(_), Tag::Dot1q(n @ (10 | 40))) => vlan(n, true),
                (Attach::TrunkPort(_), _) => Err(VlanNotAllowed),
                (Attach::Trunk, Tag::Dot1q(n @ (10 | 20 | 40))) => vlan(n, true),
                (Attach::Trunk, _) => Ok(Ingress::UNTAGGED),
            }
        };
        let attachments = [
            Attach::Access(v(10)),
            Attach::Untagged,
            Attach::TrunkPort(&allowed),
            Attach::Trunk,
        ];
        for at in attachments {
            for tag in tags {
                assert_eq!(c(at, tag), want(at, tag), "{tag:?} from {at:?}");
            }
            assert_eq!(c(at, Tag::Short), Err(DropReason::TooShort), "{at:?}");
        }
        // Without any VLAN in use, tags from guests are still refused.
        assert_eq!(
            classify(Attach::Untagged, Tag::Dot1q(10), &[]),
            Err(DropReason::TaggedOnUntaggedPort)
        );
        assert_eq!(
            classify(Attach::Trunk, Tag::Dot1q(10), &[]),
            Ok(Ingress::UNTAGGED)
        );
    }

    #[test]
    fn a_trunk_port_takes_exactly_its_allowed_list() {
        let allowed: VlanSet = "1:100-199:4094".parse().unwrap();
        for vid in 0..=4095u16 {
            let ok = vid == 1 || (100..=199).contains(&vid) || vid == 4094;
            let r = classify(Attach::TrunkPort(&allowed), Tag::Dot1q(vid), &[]);
            if ok {
                assert_eq!(r.map(|i| i.domain), Ok(Vid::new(vid)), "{vid}");
            } else {
                assert_eq!(r, Err(DropReason::VlanNotAllowed), "{vid}");
            }
        }
    }

    #[test]
    fn push_at_every_split() {
        let plain = ethernet_len(&[], 0x0800, 100);
        let vid = Vid::new(10).unwrap();
        let mut want = plain[..12].to_vec();
        want.extend_from_slice(&[0x81, 0x00, 0x00, 0x0a]);
        want.extend_from_slice(&plain[12..]);
        for a in 1..plain.len() - 1 {
            for b in [a + 1, plain.len() - 1] {
                let parts = frames::split(&plain, &[a, b]);
                let f = frame(plain_hdr(), &parts);
                let mut buf = ViewBuf::default();
                let t = push(&f, vid, &mut buf).unwrap();
                assert_eq!(t.parts.concat(), want, "split at {a},{b}");
                assert_eq!(t.len, want.len());
                assert!(t.parts.iter().all(|p| !p.is_empty()));
                // Past the new head, the view borrows the original bytes.
                let last = *t.parts.last().unwrap();
                assert_eq!(last.as_ptr(), plain[b.max(12)..].as_ptr());
                assert_eq!(t.hdr.csum_start, 38);
                assert_eq!(t.hdr.hdr_len, 70);
                assert_eq!((t.hdr.csum_offset, t.hdr.gso_size), (16, 1448));
                assert_eq!(t.tag, Tag::Dot1q(10));
            }
        }
    }

    #[test]
    fn pop_at_every_split() {
        let tagged = ethernet_len(&[(ETHERTYPE_VLAN, 10)], 0x0800, 100);
        let mut want = tagged[..12].to_vec();
        want.extend_from_slice(&tagged[16..]);
        let mut hdr = plain_hdr();
        hdr.csum_start = 38;
        hdr.hdr_len = 70;
        for a in 1..tagged.len() - 1 {
            for b in [a + 1, tagged.len() - 1] {
                let parts = frames::split(&tagged, &[a, b]);
                let f = frame(hdr, &parts);
                assert_eq!(f.tag, Tag::Dot1q(10));
                let mut buf = ViewBuf::default();
                let u = pop(&f, &mut buf).unwrap();
                assert_eq!(u.parts.concat(), want, "split at {a},{b}");
                assert_eq!(u.len, want.len());
                assert!(u.parts.iter().all(|p| !p.is_empty()));
                assert_eq!((u.hdr.csum_start, u.hdr.hdr_len), (34, 66));
                assert_eq!(u.tag, Tag::Untagged);
            }
        }
    }

    #[test]
    fn push_then_pop_is_identity() {
        let plain = ethernet_len(&[], 0x86dd, 300);
        let parts = frames::split(&plain, &[5, 13, 14, 200]);
        let f = frame(VirtioNetHdr::default(), &parts);
        let mut b1 = ViewBuf::default();
        let t = push(&f, Vid::new(4094).unwrap(), &mut b1).unwrap();
        assert_eq!(t.tag, Tag::Dot1q(4094));
        let mut b2 = ViewBuf::default();
        let u = pop(&t, &mut b2).unwrap();
        assert_eq!(u.parts.concat(), plain);
        // Without NEEDS_CSUM and hdr_len the offsets are left alone.
        assert_eq!(u.hdr, VirtioNetHdr::default());
        assert_eq!(t.hdr, VirtioNetHdr::default());
    }

    #[test]
    fn refuses_what_cannot_be_rewritten() {
        let short = ethernet_len(&[], 0x0800, 11);
        let parts = [&short[..]];
        let f = frame(VirtioNetHdr::default(), &parts);
        let mut b = ViewBuf::default();
        assert_eq!(
            push(&f, Vid::new(1).unwrap(), &mut b).err(),
            Some(DropReason::TooShort)
        );
        // A checksum that would start inside the removed tag.
        let tagged = ethernet_len(&[(ETHERTYPE_VLAN, 10)], 0x0800, 80);
        let parts = [&tagged[..]];
        let mut hdr = plain_hdr();
        hdr.csum_start = 14;
        let f = frame(hdr, &parts);
        let mut b = ViewBuf::default();
        assert_eq!(pop(&f, &mut b).err(), Some(DropReason::VlanBadOffsets));
        hdr.csum_start = u16::MAX - 1;
        let f = frame(hdr, &parts);
        let mut b = ViewBuf::default();
        assert_eq!(
            push(&f, Vid::new(1).unwrap(), &mut b).err(),
            Some(DropReason::VlanBadOffsets)
        );
    }

    /// A TSO frame with 510 bytes of headers: IPv6, 432 bytes of destination options,
    /// TCP with 4 bytes of options.
    fn long_headers() -> (Vec<u8>, VirtioNetHdr) {
        let spec = FrameSpec {
            v6: true,
            ip6_exts: vec![(60, 53)],
            tcp_opts: vec![1, 1, 1, 1],
            payload: pattern(3000),
            ..FrameSpec::default()
        };
        let (bytes, l4) = frames::build(&spec);
        (bytes, frames::gso_hdr(GsoKind::TcpV6, 1000, l4, true))
    }

    #[test]
    fn a_tag_that_pushes_headers_past_the_parser_is_refused() {
        let (bytes, hdr) = long_headers();
        let parts = [&bytes[..]];
        let f = frame(hdr, &parts);
        assert_eq!(f.gso.unwrap().headers.hdr_len(), 510);
        let mut b = ViewBuf::default();
        assert_eq!(
            push(&f, Vid::new(10).unwrap(), &mut b).err(),
            Some(DropReason::VlanBadOffsets)
        );
    }

    #[test]
    fn a_carried_layout_longer_than_the_template_is_an_error_not_a_panic() {
        // What push used to hand the segmenter: the layout moved by 4, 514 bytes.
        let (bytes, hdr) = long_headers();
        let parts = [&bytes[..]];
        let l = shift(frame(hdr, &parts).gso.unwrap(), 4);
        let mut tagged = bytes[..12].to_vec();
        tagged.extend_from_slice(&[0x81, 0x00, 0x00, 0x0a]);
        tagged.extend_from_slice(&bytes[12..]);
        let hdr = VirtioNetHdr {
            csum_start: hdr.csum_start + 4,
            hdr_len: hdr.hdr_len + 4,
            ..hdr
        };
        let opts = SegmentOpts {
            csum: CsumMode::Full,
            max_frame: None,
        };
        let r = Segmenter::new().segment_planned(
            &hdr,
            Some((&l.headers, &l.plan)),
            &[&tagged[..]],
            &opts,
            |_| true,
        );
        assert!(r.is_err());
    }

    fn spec(v6: bool) -> FrameSpec {
        FrameSpec {
            v6,
            tcp_opts: frames::tcp_timestamps(),
            payload: pattern(45 * 1448 + 7),
            ..FrameSpec::default()
        }
    }

    /// Segments the view `f` with its carried layout (which must be what parsing the
    /// view finds), pops the tag of every segment (which must carry `vid`) and checks
    /// them against `plain`, the untagged frame's spec.
    fn segment_and_check(f: &Frame, vid: u16, plain: &FrameSpec, gso: &VirtioNetHdr) {
        let l = f.gso.unwrap();
        assert_eq!(l.headers, parse_headers(f.parts).unwrap(), "shifted layout");
        let opts = SegmentOpts {
            csum: CsumMode::Full,
            max_frame: None,
        };
        let mut segs = Vec::new();
        let mut sum = Segmenter::new()
            .segment_planned(&f.hdr, Some((&l.headers, &l.plan)), f.parts, &opts, |s| {
                segs.push((s.vnet, s.to_vec()));
                true
            })
            .unwrap();
        assert_eq!(segs.len(), 46);
        let untagged: Vec<_> = segs
            .iter()
            .map(|(h, s)| {
                assert_eq!(Tag::read(s), Tag::Dot1q(vid));
                let parts = [&s[..]];
                let t = frame(*h, &parts);
                let mut b = ViewBuf::default();
                let u = pop(&t, &mut b).unwrap();
                (u.hdr, u.parts.concat())
            })
            .collect();
        sum.bytes -= 4 * segs.len();
        oracle::check(plain, gso, &opts, &sum, &untagged);
    }

    #[test]
    fn pushed_tso_frames_segment_correctly() {
        for v6 in [false, true] {
            let plain = spec(v6);
            let (bytes, l4_off) = frames::build(&plain);
            let kind = if v6 { GsoKind::TcpV6 } else { GsoKind::TcpV4 };
            let hdr = frames::gso_hdr(kind, 1448, l4_off, true);
            let parts = frames::split(&bytes, &[7, 13, 40, 3000, 20000]);
            let parts: Vec<&[u8]> = parts.into_iter().filter(|p| !p.is_empty()).collect();
            let f = frame(hdr, &parts);
            let mut b = ViewBuf::default();
            let t = push(&f, Vid::new(10).unwrap(), &mut b).unwrap();
            assert_eq!(usize::from(t.hdr.csum_start), l4_off + 4);
            crate::frame::validate::validate(&t.hdr, t.parts)
                .expect("tagged view is a valid GSO frame");
            segment_and_check(&t, 10, &plain, &hdr);
        }
    }

    #[test]
    fn popped_tso_frames_segment_correctly() {
        let plain = spec(false);
        let tagged_spec = FrameSpec {
            vlans: vec![ETHERTYPE_VLAN],
            ..plain.clone()
        };
        let (bytes, l4_off) = frames::build(&tagged_spec);
        let hdr = frames::gso_hdr(GsoKind::TcpV4, 1448, l4_off, true);
        let parts = frames::split(&bytes, &[15, 17, 1000]);
        let f = frame(hdr, &parts);
        let mut b = ViewBuf::default();
        let u = pop(&f, &mut b).unwrap();
        assert_eq!(usize::from(u.hdr.csum_start), l4_off - 4);
        assert_eq!(u.tag, Tag::Untagged);
        let l = u.gso.unwrap();
        assert_eq!(l.headers, parse_headers(u.parts).unwrap(), "shifted layout");
        let opts = SegmentOpts {
            csum: CsumMode::Full,
            max_frame: None,
        };
        let (sum, segs) = oracle::run(&u.hdr, u.parts, &opts).unwrap();
        let plain_hdr = frames::gso_hdr(GsoKind::TcpV4, 1448, l4_off - 4, true);
        oracle::check(&plain, &plain_hdr, &opts, &sum, &segs);
        // And back: re-tagging the untagged view segments like the original.
        let mut b2 = ViewBuf::default();
        let t = push(&u, Vid::new(5).unwrap(), &mut b2).unwrap();
        segment_and_check(&t, 5, &plain, &plain_hdr);
    }
}

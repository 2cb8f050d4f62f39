//! Fuzz entry for the switch's VLAN code: `vlan::classify` over any attachment, tag
//! and set of access VLANs, and the zero-copy `push`/`pop` views over any frame, split
//! anywhere.
//!
//! Input layout: 1 byte attachment (b % 3: access, untagged, trunk) | 1 byte access
//! VLAN count n (mod 4) | n * 2 bytes VIDs (LE) | 2 bytes VID to push (LE) | 12 bytes
//! virtio_net_hdr | 1 byte split count k (mod 5) | k * 2 bytes split points (LE) |
//! frame bytes.

use crate::backend::switch::vlan::{classify, pop, push, Attach, Ingress, ViewBuf};
use crate::frame::validate::validate;
use crate::frame::Frame;
use crate::l2::{Tag, Vid, ADDRS_LEN, ETHERTYPE_VLAN, ETH_HDR_LEN, TAG_LEN};
use crate::segment::parse::MAX_HEADERS;
use crate::segment::{parse_headers, plan};
use crate::stats::DropReason;
use crate::vnet_hdr::{VirtioNetHdr, HDR_LEN};

/// Encodes a fuzz input (for seed corpora).
pub fn encode(
    attach: u8,
    access: &[u16],
    vid: u16,
    hdr: &VirtioNetHdr,
    points: &[u16],
    frame: &[u8],
) -> Vec<u8> {
    let n = access.len().min(3);
    let mut v = vec![attach, n as u8];
    for a in &access[..n] {
        v.extend_from_slice(&a.to_le_bytes());
    }
    v.extend_from_slice(&vid.to_le_bytes());
    v.extend_from_slice(&hdr.to_bytes());
    let k = points.len().min(4);
    v.push(k as u8);
    for p in &points[..k] {
        v.extend_from_slice(&p.to_le_bytes());
    }
    v.extend_from_slice(frame);
    v
}

/// Reads `n` bytes off the front of `data`.
fn eat<'a>(data: &mut &'a [u8], n: usize) -> Option<&'a [u8]> {
    if data.len() < n {
        return None;
    }
    let (a, b) = data.split_at(n);
    *data = b;
    Some(a)
}

fn u16_at(b: &[u8]) -> u16 {
    u16::from_le_bytes([b[0], b[1]])
}

/// The security properties of classification, whatever the policy's details.
fn check_classify(at: Attach, tag: Tag, access: &[Vid]) {
    let r = classify(at, tag, access);
    let is_access = |v: u16| Vid::new(v).is_some_and(|v| access.contains(&v));
    if let Ok(i) = r {
        if let (Some(d), false) = (i.domain, matches!(at, Attach::TrunkPort(_))) {
            assert!(access.contains(&d), "classified into VLAN {d} nobody uses");
        }
        if i.tagged {
            // Only a trunk frame carrying exactly that VLAN's 802.1Q tag.
            assert!(matches!(at, Attach::Trunk | Attach::TrunkPort(_)), "{at:?}");
            assert_eq!(Some(tag), i.domain.map(|d| Tag::Dot1q(d.get())));
        }
    }
    match (at, tag) {
        (Attach::Access(v), Tag::Untagged) => assert_eq!(
            r,
            Ok(Ingress {
                domain: Some(v),
                tagged: false
            })
        ),
        (Attach::Access(_), _) => assert!(r.is_err(), "{tag:?} accepted from an access port"),
        (Attach::Untagged, Tag::Untagged) => assert_eq!(r, Ok(Ingress::UNTAGGED)),
        (Attach::Untagged, Tag::Dot1q(v)) if is_access(v) => {
            assert!(r.is_err(), "an untagged port spoke for VLAN {v}")
        }
        (Attach::Untagged, _) => assert!(r.is_err() || r == Ok(Ingress::UNTAGGED)),
        (Attach::Trunk, Tag::Untagged) => assert_eq!(r, Ok(Ingress::UNTAGGED)),
        (Attach::Trunk, Tag::Dot1q(v)) if is_access(v) => assert_eq!(
            r,
            Ok(Ingress {
                domain: Vid::new(v),
                tagged: true
            })
        ),
        (Attach::Trunk, _) => {
            assert!(r.is_err() || r == Ok(Ingress::UNTAGGED), "{tag:?} -> {r:?}")
        }
        // A trunk port reaches only its allowed VLANs.
        (Attach::TrunkPort(allowed), Tag::Dot1q(v)) if !allowed.contains(v) => {
            assert!(
                r.is_err(),
                "VLAN {v} accepted from a trunk port not allowed it"
            )
        }
        (Attach::TrunkPort(_), _) => {}
    }
}

/// A view's carried GSO layout is what parsing the view finds, and plans the same.
fn check_layout(f: &Frame) {
    let Some(l) = f.gso else {
        return;
    };
    let fresh = parse_headers(f.parts).expect("a retagged GSO view no longer parses");
    assert_eq!(
        l.headers, fresh,
        "carried layout differs from a fresh parse"
    );
    let p = plan(f.hdr.gso.kind, f.hdr.gso_size, &fresh, None).expect("plan");
    assert_eq!(l.plan, p);
}

/// Header fields push and pop must leave alone.
fn same_but_offsets(a: &VirtioNetHdr, b: &VirtioNetHdr) -> bool {
    (a.flags, a.gso, a.gso_size, a.csum_offset, a.num_buffers)
        == (b.flags, b.gso, b.gso_size, b.csum_offset, b.num_buffers)
}

#[doc(hidden)]
pub fn fuzz_one(data: &[u8]) {
    let mut d = data;
    let Some(&[a, n]) = eat(&mut d, 2) else {
        return;
    };
    let Some(vids) = eat(&mut d, 2 * usize::from(n % 4)) else {
        return;
    };
    let mut access: Vec<Vid> = vids
        .chunks_exact(2)
        .filter_map(|c| Vid::new(u16_at(c) % 4096))
        .collect();
    let Some(v) = eat(&mut d, 2) else {
        return;
    };
    let vid = Vid::new(u16_at(v) % 4096).unwrap_or(Vid::new(1).expect("VID 1"));
    let Some(h) = eat(&mut d, HDR_LEN) else {
        return;
    };
    let Ok(hdr) = VirtioNetHdr::from_bytes(h) else {
        return;
    };
    let Some(&[k]) = eat(&mut d, 1) else {
        return;
    };
    let Some(pts) = eat(&mut d, 2 * usize::from(k % 5)) else {
        return;
    };
    let frame = d;
    let at = match a % 3 {
        0 => {
            // An access port's own VLAN is always among the access VLANs.
            access.push(vid);
            Attach::Access(vid)
        }
        1 => Attach::Untagged,
        _ => Attach::Trunk,
    };
    access.sort_unstable();
    access.dedup();
    check_classify(at, Tag::read(frame), &access);

    // The frame split anywhere past its first 18 bytes (the datapath reads the tag
    // from its first part).
    let first = frame.len().min(ADDRS_LEN + TAG_LEN + 2);
    let mut points: Vec<usize> = pts
        .chunks_exact(2)
        .map(|c| first + usize::from(u16_at(c)) % (frame.len() - first + 1))
        .collect();
    points.push(first);
    points.sort_unstable();
    let mut parts: Vec<&[u8]> = Vec::new();
    let mut from = 0;
    for p in points {
        parts.push(&frame[from..p]);
        from = p;
    }
    parts.push(&frame[from..]);
    let Ok(f) = Frame::from_device(hdr, &parts) else {
        return;
    };
    assert_eq!(f.tag, Tag::read(frame));

    // Push: the tag after the addresses, offsets +4, nothing else changed.
    let mut b1 = ViewBuf::default();
    match push(&f, vid, &mut b1) {
        Ok(t) => {
            let mut want = frame[..ADDRS_LEN].to_vec();
            want.extend_from_slice(&ETHERTYPE_VLAN.to_be_bytes());
            want.extend_from_slice(&vid.get().to_be_bytes());
            want.extend_from_slice(&frame[ADDRS_LEN..]);
            assert!(t.parts.concat() == want, "pushed view bytes");
            assert_eq!(t.len, f.len + TAG_LEN);
            assert_eq!(t.tag, Tag::Dot1q(vid.get()));
            assert_eq!((t.dst, t.src), (f.dst, f.src));
            assert!(same_but_offsets(&t.hdr, &f.hdr));
            if f.hdr.needs_csum() {
                assert_eq!(t.hdr.csum_start, f.hdr.csum_start + 4);
            } else {
                assert_eq!(t.hdr.csum_start, f.hdr.csum_start);
            }
            let hl = if f.hdr.hdr_len == 0 {
                0
            } else {
                f.hdr.hdr_len + 4
            };
            assert_eq!(t.hdr.hdr_len, hl);
            if f.tag == Tag::Untagged {
                // What an access port sends: the tagged view is what a parse finds,
                // and a valid frame stays valid.
                check_layout(&t);
                if let Ok(v) = validate(&f.hdr, f.parts) {
                    let tv = validate(&t.hdr, t.parts).expect("a valid frame, tagged");
                    assert_eq!(tv.segments(), v.segments());
                }
            }
            // And popping it again gives the frame back.
            let mut b2 = ViewBuf::default();
            match pop(&t, &mut b2) {
                Ok(u) => {
                    assert!(
                        u.parts.concat() == frame,
                        "push then pop is not the identity"
                    );
                    assert_eq!(u.len, f.len);
                    assert_eq!(u.tag, f.tag);
                    assert_eq!(u.hdr, f.hdr);
                    assert_eq!(u.gso, f.gso);
                }
                Err(r) => {
                    assert_eq!(r, DropReason::VlanBadOffsets);
                    assert!(f.hdr.needs_csum() && usize::from(f.hdr.csum_start) < ADDRS_LEN);
                }
            }
        }
        Err(r) => assert!(
            r == DropReason::VlanBadOffsets
                && (f.hdr.needs_csum() && f.hdr.csum_start > u16::MAX - 4
                    || f.hdr.hdr_len > u16::MAX - 4
                    || f.gso
                        .is_some_and(|l| l.headers.hdr_len() + TAG_LEN > MAX_HEADERS)),
            "push refused with {r:?}"
        ),
    }

    // Pop, for a frame carrying an 802.1Q tag as a trunk frame does.
    let Tag::Dot1q(_) = f.tag else {
        return;
    };
    let mut b3 = ViewBuf::default();
    match pop(&f, &mut b3) {
        Ok(u) => {
            let mut want = frame[..ADDRS_LEN].to_vec();
            want.extend_from_slice(&frame[ADDRS_LEN + TAG_LEN..]);
            assert!(u.parts.concat() == want, "popped view bytes");
            assert_eq!(u.len, f.len - TAG_LEN);
            assert_eq!(u.tag, Tag::read(&want));
            assert!(same_but_offsets(&u.hdr, &f.hdr));
            if f.hdr.needs_csum() {
                assert_eq!(u.hdr.csum_start + 4, f.hdr.csum_start);
            }
            assert_eq!(u.hdr.hdr_len, f.hdr.hdr_len.saturating_sub(4));
            check_layout(&u);
        }
        Err(r) => assert!(
            (r == DropReason::VlanBadOffsets
                && f.hdr.needs_csum()
                && usize::from(f.hdr.csum_start) < ADDRS_LEN + TAG_LEN)
                || (r == DropReason::TooShort && f.len < ETH_HDR_LEN + TAG_LEN),
            "pop refused with {r:?}"
        ),
    }
}

/// The seed corpus (written by the ignored `target_tests::write_seeds` test).
pub fn seeds() -> Vec<Vec<u8>> {
    use crate::testkit::frames::{build, ethernet_len, gso_hdr, pattern, FrameSpec};
    use crate::vnet_hdr::GsoKind;
    let mut out = Vec::new();
    let plain = ethernet_len(&[], 0x0800, 100);
    let tagged = ethernet_len(&[(ETHERTYPE_VLAN, 10)], 0x0800, 100);
    let qinq = ethernet_len(&[(0x88a8, 10), (ETHERTYPE_VLAN, 20)], 0x86dd, 60);
    let d = VirtioNetHdr::default();
    for at in 0..3u8 {
        out.push(encode(at, &[10, 20], 10, &d, &[5, 40], &plain));
        out.push(encode(at, &[10, 20], 20, &d, &[17], &tagged));
        out.push(encode(at, &[30], 10, &d, &[], &qinq));
    }
    for (v6, vlans, kind) in [
        (false, vec![], GsoKind::TcpV4),
        (true, vec![ETHERTYPE_VLAN], GsoKind::TcpV6),
        (false, vec![ETHERTYPE_VLAN], GsoKind::UdpL4),
    ] {
        let tcp = kind != GsoKind::UdpL4;
        let (f, l4) = build(&FrameSpec {
            v6,
            tcp,
            vlans,
            payload: pattern(3000),
            ..FrameSpec::default()
        });
        let h = gso_hdr(kind, 1400, l4, tcp);
        out.push(encode(2, &[1], 7, &h, &[30, 1000], &f));
        out.push(encode(0, &[1], 7, &h, &[], &f));
    }
    out
}

fuzz_target_tests!("vlan", 5);

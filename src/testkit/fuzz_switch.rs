//! Fuzz entry for `Switch::forward`: fuzzer-chosen ports (access VLAN or untagged,
//! connected or not) and uplinks, all recording what they are handed, then a sequence
//! of fuzzer-chosen frames from fuzzer-chosen endpoints. Checked after every frame:
//! no hairpin, no delivery outside the frame's VLAN, the exact bytes each kind of
//! destination gets (ports of a VLAN untagged, uplinks with the VLAN's tag), floods
//! complete, unicast only where that address was seen, a refused frame counted.
//!
//! Input layout: 1 byte port count p (mod 6, +1) | p bytes per port (bits 0-1 VLAN:
//! none, 10, 20, 4094; bit 2 disconnected) | 1 byte uplink count (mod 3) | frames,
//! 6 bytes each: source endpoint, destination MAC, source MAC (index into 8 addresses:
//! 6 unicast, broadcast, multicast), tag (bits 0-2: none, 802.1Q 10, 20, 30, 4094,
//! 0 (priority only), 802.1ad 10, 0x9100 20; bit 3 a second 802.1Q tag of VID 10;
//! bits 4-6 priority), checksum start (0: no NEEDS_CSUM), payload length.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use super::recorder::Recorder;
use crate::backend::switch::deliver::DeliverCtx;
use crate::backend::switch::{Endpoint, Switch, SwitchPort, SwitchUplink};
use crate::frame::Frame;
use crate::l2::{Mac, Tag, Vid, ADDRS_LEN, ETHERTYPE_VLAN, TAG_LEN};
use crate::vnet_hdr::{VirtioNetHdr, F_NEEDS_CSUM};

/// Bytes per frame in the input.
pub const FRAME_SPEC: usize = 6;
const VLANS: [Option<u16>; 4] = [None, Some(10), Some(20), Some(4094)];
const TAGS: [Option<(u16, u16)>; 8] = [
    None,
    Some((ETHERTYPE_VLAN, 10)),
    Some((ETHERTYPE_VLAN, 20)),
    Some((ETHERTYPE_VLAN, 30)),
    Some((ETHERTYPE_VLAN, 4094)),
    Some((ETHERTYPE_VLAN, 0)),
    Some((0x88a8, 10)),
    Some((0x9100, 20)),
];

fn mac(i: u8) -> Mac {
    match i % 8 {
        6 => Mac::BROADCAST,
        7 => Mac([0x01, 0x00, 0x5e, 0, 0, 1]),
        n => Mac([2, 0, 0, 0, 0, n + 1]),
    }
}

/// Encodes a fuzz input (for seed corpora): `ports` as (VLAN index, connected).
pub fn encode(ports: &[(u8, bool)], uplinks: u8, frames: &[[u8; FRAME_SPEC]]) -> Vec<u8> {
    let p = ports.len().clamp(1, 6);
    let mut v = vec![(p - 1) as u8];
    for i in 0..p {
        let (vlan, connected) = ports.get(i).copied().unwrap_or((0, true));
        v.push(vlan | if connected { 0 } else { 4 });
    }
    v.push(uplinks);
    for f in frames {
        v.extend_from_slice(f);
    }
    v
}

/// The frame a spec describes.
fn build(spec: &[u8]) -> (Vec<u8>, VirtioNetHdr) {
    let mut f = Vec::new();
    f.extend_from_slice(&mac(spec[1]).0);
    f.extend_from_slice(&mac(spec[2]).0);
    let t = spec[3];
    let pcp = u16::from((t >> 4) & 7) << 13;
    if let Some((tpid, vid)) = TAGS[usize::from(t & 7)] {
        f.extend_from_slice(&tpid.to_be_bytes());
        f.extend_from_slice(&(pcp | vid).to_be_bytes());
    }
    if t & 8 != 0 {
        f.extend_from_slice(&ETHERTYPE_VLAN.to_be_bytes());
        f.extend_from_slice(&10u16.to_be_bytes());
    }
    f.extend_from_slice(&0x0800u16.to_be_bytes());
    f.extend((0..spec[5]).map(|i| i.wrapping_mul(31)));
    let hdr = if spec[4] == 0 {
        VirtioNetHdr::default()
    } else {
        VirtioNetHdr {
            flags: F_NEEDS_CSUM,
            csum_start: u16::from(spec[4]),
            csum_offset: 0,
            ..VirtioNetHdr::default()
        }
    };
    (f, hdr)
}

#[doc(hidden)]
pub fn fuzz_one(data: &[u8]) {
    let Some((&p, rest)) = data.split_first() else {
        return;
    };
    let np = usize::from(p % 6) + 1;
    if rest.len() < np + 1 {
        return;
    }
    let (pspec, rest) = rest.split_at(np);
    let nu = usize::from(rest[0] % 3);
    let frames = &rest[1..];
    let ports: Vec<Arc<Recorder>> = pspec
        .iter()
        .map(|&b| {
            Arc::new(Recorder {
                vlan: VLANS[usize::from(b & 3)].and_then(Vid::new),
                disconnected: b & 4 != 0,
                ..Recorder::default()
            })
        })
        .collect();
    let uplinks: Vec<Arc<Recorder>> = (0..nu).map(|_| Arc::new(Recorder::default())).collect();
    let sw = Switch::new(
        ports
            .iter()
            .map(|p| p.clone() as Arc<dyn SwitchPort>)
            .collect(),
        uplinks
            .iter()
            .map(|u| u.clone() as Arc<dyn SwitchUplink>)
            .collect(),
        Duration::from_secs(3600),
    );
    let access: Vec<u16> = ports.iter().filter_map(|p| p.vlan.map(Vid::get)).collect();
    let all: Vec<(Endpoint, &Recorder)> = ports
        .iter()
        .enumerate()
        .map(|(i, p)| (Endpoint::Port(i), &**p))
        .chain(
            uplinks
                .iter()
                .enumerate()
                .map(|(i, u)| (Endpoint::Uplink(i), &**u)),
        )
        .collect();
    // Which (endpoint, source MAC) pairs have been sent from.
    let mut seen: HashSet<(Endpoint, Mac)> = HashSet::new();
    let mut ctx = DeliverCtx::default();

    for spec in frames.chunks_exact(FRAME_SPEC).take(64) {
        let (src, src_rec) = all[usize::from(spec[0]) % all.len()];
        if let Endpoint::Port(_) = src {
            if src_rec.disconnected {
                continue; // nobody there to send
            }
        }
        let (bytes, hdr) = build(spec);
        let parts = [&bytes[..]];
        let Ok(frame) = Frame::new(hdr, &parts, None) else {
            continue;
        };
        let drops_before = src_rec.drops();
        sw.forward(src, 0, &frame, &mut ctx);
        ctx.flush();
        seen.insert((src, frame.src));

        // The domain the frame belongs to if it is accepted, and whether it arrived
        // with that domain's tag.
        let src_vlan = match src {
            Endpoint::Port(_) => src_rec.vlan,
            Endpoint::Uplink(_) => None,
        };
        let (domain, tagged) = match (src, frame.tag) {
            (Endpoint::Port(_), _) => (src_vlan.map(Vid::get), false),
            (Endpoint::Uplink(_), Tag::Dot1q(v)) if access.contains(&v) => (Some(v), true),
            _ => (None, false),
        };
        let untagged_view = || {
            let mut v = bytes[..ADDRS_LEN].to_vec();
            v.extend_from_slice(&bytes[ADDRS_LEN + TAG_LEN..]);
            v
        };
        let tagged_view = |vid: u16| {
            let mut v = bytes[..ADDRS_LEN].to_vec();
            v.extend_from_slice(&ETHERTYPE_VLAN.to_be_bytes());
            v.extend_from_slice(&vid.to_be_bytes());
            v.extend_from_slice(&bytes[ADDRS_LEN..]);
            v
        };

        let mut receivers = Vec::new();
        for &(e, rec) in &all {
            let got = rec.take();
            if got.is_empty() {
                continue;
            }
            assert_ne!(e, src, "hairpin: {src:?} got its own frame back");
            assert_eq!(got.len(), 1, "{e:?} got one frame {} times", got.len());
            let (h, b) = &got[0];
            receivers.push(e);
            let delta: i32 = match e {
                Endpoint::Port(_) => {
                    assert!(!rec.disconnected, "a disconnected port was written to");
                    assert_eq!(
                        rec.vlan.map(Vid::get),
                        domain,
                        "{e:?} outside the frame's VLAN {domain:?} got it"
                    );
                    if tagged {
                        assert!(
                            *b == untagged_view(),
                            "{e:?} did not get the frame untagged"
                        );
                        -4
                    } else {
                        assert!(*b == bytes, "{e:?} got altered bytes");
                        0
                    }
                }
                Endpoint::Uplink(_) => match domain {
                    Some(v) if !tagged => {
                        assert!(*b == tagged_view(v), "uplink did not get VLAN {v}'s tag");
                        4
                    }
                    _ => {
                        assert!(*b == bytes, "uplink got altered bytes");
                        0
                    }
                },
            };
            if let (Endpoint::Port(_), Endpoint::Port(_), Some(_)) = (src, e, rec.vlan) {
                // Guest to guest, an access port never sees a tag.
                assert!(!matches!(Tag::read(b), Tag::Dot1q(_) | Tag::Other));
            }
            if hdr.needs_csum() {
                assert!(h.needs_csum());
                assert_eq!(i32::from(h.csum_start), i32::from(hdr.csum_start) + delta);
            }
        }

        // Floods reach every endpoint of the domain; unicast goes to one endpoint that
        // has used that address, or floods.
        let flood: Vec<Endpoint> = all
            .iter()
            .filter(|&&(e, rec)| {
                e != src
                    && match e {
                        Endpoint::Port(_) => !rec.disconnected && rec.vlan.map(Vid::get) == domain,
                        Endpoint::Uplink(_) => true,
                    }
            })
            .map(|&(e, _)| e)
            .collect();
        let dropped = src_rec.drops() > drops_before;
        if dropped {
            assert!(receivers.is_empty(), "a dropped frame was delivered");
            continue;
        }
        if frame.dst.is_multicast() {
            assert_eq!(receivers, flood, "incomplete flood");
        } else if receivers.len() == 1 && receivers != flood {
            assert!(
                seen.contains(&(receivers[0], frame.dst)),
                "unicast to {:?}, which never sent from {}",
                receivers[0],
                frame.dst
            );
        } else if !receivers.is_empty() {
            assert_eq!(receivers, flood, "partial flood");
        } else {
            // Nothing delivered and nothing counted: only a frame for an address
            // learnt on its own source (no hairpin), or nowhere to flood to.
            assert!(
                flood.is_empty() || seen.contains(&(src, frame.dst)),
                "a frame from {src:?} vanished uncounted"
            );
        }
    }
}

/// The seed corpus (written by the ignored `target_tests::write_seeds` test).
pub fn seeds() -> Vec<Vec<u8>> {
    let ports = [(1u8, true), (1, true), (2, true), (0, true), (3, false)];
    let two_uplinks = 2;
    vec![
        encode(
            &ports,
            1,
            &[
                [0, 6, 0, 0, 0, 40],  // broadcast from VLAN 10
                [5, 6, 4, 1, 0, 40],  // VLAN 10 from the trunk
                [1, 4, 1, 0, 0, 40],  // unicast to the trunk host
                [3, 6, 3, 3, 0, 40],  // untagged port, non-access tag
                [3, 6, 3, 2, 0, 40],  // untagged port, access tag: dropped
                [0, 6, 0, 1, 0, 40],  // tagged from an access port: dropped
                [5, 0, 4, 1, 38, 40], // to a learnt port, checksum moves
                [5, 0, 4, 1, 14, 40], // checksum inside the tag: dropped
                [5, 6, 4, 9, 0, 40],  // double tagged
            ],
        ),
        encode(
            &[(0, true), (0, true), (0, true)],
            two_uplinks,
            &[
                [0, 6, 0, 0, 0, 20],
                [1, 0, 1, 0, 0, 20],
                [3, 1, 5, 6, 34, 60],
                [4, 7, 5, 0, 0, 0],
                [2, 5, 2, 5, 0, 10],
            ],
        ),
        encode(
            &[(3, true), (3, true), (1, true)],
            1,
            &[
                [0, 6, 0, 0, 0, 1],
                [3, 6, 4, 4, 0, 30],
                [3, 0, 4, 0x7c, 0, 30],
                [1, 4, 1, 0, 0, 30],
            ],
        ),
    ]
}

fuzz_target_tests!("switch", 3);

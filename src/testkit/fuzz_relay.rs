//! Fuzz entry for the control-plane firewall the relay applies to every vhost-user
//! message (`backend::vhost::firewall`): any offer, then any sequence of headers,
//! payloads and descriptor counts. What must hold whatever a frontend sends:
//! - a header `Firewall::header` refuses is never admitted, and nothing admitted is
//!   larger than MAX_PAYLOAD or carries more than MAX_FDS descriptors;
//! - only the requests the spec lists for a backend like gsonet are admitted, with
//!   version 1 flags and no REPLY bit, and only when the protocol feature they need
//!   was both offered and acked;
//! - the protocol features in force never exceed the offer, and an admitted
//!   SET_PROTOCOL_FEATURES goes on carrying only offered bits;
//! - every ring index admitted is below the port's queue count, and the early
//!   SET_VRING_ENABLE table never holds more than one entry per queue;
//! - memory checks name exactly one region per descriptor, none empty or wrapping;
//!   the regions mapped (a table, then ADD_MEM_REG and REM_MEM_REG, modelled here on
//!   their own) never exceed MAX_MEM_SLOTS, never overlap in guest or frontend
//!   addresses, and a REM_MEM_REG is admitted only for a region mapped now (guest
//!   address, size and user address), with no descriptor or one that is closed;
//!   GET_MAX_MEM_SLOTS is answered by the relay;
//! - a refused message changes nothing (the regions included);
//! - migration: SET_LOG_BASE and SET_LOG_FD only with LOG_SHMFD, SEND_RARP only with
//!   RARP; a log admitted is non-empty, at most MAX_LOG, page-aligned, does not wrap
//!   and covers every region mapped since the last table (as the input itself
//!   counts them); a RARP names a unicast, non-zero address; the relay answers
//!   SEND_RARP and SET_LOG_FD itself (the crate never sees them).
//!
//! Input layout: 1 byte queue count (b % 32 + 1) | 8 bytes offered protocol features
//! (LE) | messages: 1 byte request | 1 byte flags | 2 bytes payload size (LE, mod
//! 600) | 1 byte: descriptor count (low nibble, mod 10), bit 4 "payload one byte
//! shorter than the header says" | the payload bytes (zero-padded at the end).

use crate::backend::vhost::firewall::{
    proto, req, FdCheck, Firewall, Header, Policy, Verdict, FLAG_REPLY, FLAG_VERSION, LOG_PAGE,
    MAX_FDS, MAX_LOG, MAX_MEM_SLOTS, MAX_PAYLOAD,
};

/// One message of an input (for seed corpora).
pub struct Msg {
    pub request: u8,
    pub flags: u8,
    pub payload: Vec<u8>,
    pub fds: u8,
}

/// Encodes a fuzz input.
pub fn encode(queues: u8, offered: u64, msgs: &[Msg]) -> Vec<u8> {
    let mut v = vec![queues.wrapping_sub(1)];
    v.extend_from_slice(&offered.to_le_bytes());
    for m in msgs {
        v.extend_from_slice(&[m.request, m.flags]);
        v.extend_from_slice(&(m.payload.len() as u16).to_le_bytes());
        v.push(m.fds & 0x0f);
        v.extend_from_slice(&m.payload);
    }
    v
}

/// Requests gsonet admits at all, with the protocol feature each needs (0: none).
fn needs(request: u32) -> Option<u64> {
    match request {
        req::GET_FEATURES
        | req::SET_FEATURES
        | req::SET_OWNER
        | req::RESET_OWNER
        | req::SET_MEM_TABLE
        | req::SET_VRING_NUM
        | req::SET_VRING_ADDR
        | req::SET_VRING_BASE
        | req::GET_VRING_BASE
        | req::SET_VRING_KICK
        | req::SET_VRING_CALL
        | req::SET_VRING_ERR
        | req::GET_PROTOCOL_FEATURES
        | req::SET_PROTOCOL_FEATURES
        | req::SET_VRING_ENABLE => Some(0),
        req::GET_QUEUE_NUM => Some(proto::MQ),
        req::GET_MAX_MEM_SLOTS | req::ADD_MEM_REG | req::REM_MEM_REG => {
            Some(proto::CONFIGURE_MEM_SLOTS)
        }
        req::SET_LOG_BASE | req::SET_LOG_FD => Some(proto::LOG_SHMFD),
        req::SEND_RARP => Some(proto::RARP),
        req::SET_STATUS | req::GET_STATUS => Some(proto::STATUS),
        _ => None,
    }
}

fn u64_at(p: &[u8], i: usize) -> u64 {
    p.get(i..i + 8)
        .map(|b| u64::from_le_bytes(b.try_into().unwrap()))
        .unwrap_or(u64::MAX)
}

/// Where the region at `b` ends in guest addresses.
fn end_of(b: &[u8]) -> u64 {
    u64_at(b, 0).saturating_add(u64_at(b, 8))
}

/// A region as the model keeps it: guest address, size, user address.
type Reg = (u64, u64, u64);

fn reg_at(b: &[u8]) -> Reg {
    (u64_at(b, 0), u64_at(b, 8), u64_at(b, 16))
}

/// Whether two regions share a guest or a frontend address (sizes checked to wrap
/// nothing).
fn overlap(a: Reg, b: Reg) -> bool {
    let meet = |x: u64, y: u64| {
        (x as u128) < y as u128 + b.1 as u128 && (y as u128) < x as u128 + a.1 as u128
    };
    meet(a.0, b.0) || meet(a.2, b.2)
}

/// Checks a region admitted into the map `mapped`: not empty, not wrapping, and
/// clear of every region mapped.
fn admit_region(r: Reg, offset: u64, mapped: &[Reg]) {
    assert!(r.1 > 0, "empty region {r:x?}");
    for a in [r.0, r.2, offset] {
        assert!(a.checked_add(r.1).is_some(), "wrapping region {r:x?}");
    }
    if let Some(o) = mapped.iter().find(|&&o| overlap(r, o)) {
        panic!("region {r:x?} overlaps {o:x?}");
    }
}

fn u32_at(p: &[u8], i: usize) -> u32 {
    p.get(i..i + 4)
        .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .unwrap_or(u32::MAX)
}

/// Runs one input; panics when an invariant above breaks.
pub fn fuzz_one(data: &[u8]) {
    if data.len() < 9 {
        return;
    }
    let policy = Policy {
        queues: u32::from(data[0] % 32) + 1,
        protocol_features: u64::from_le_bytes(data[1..9].try_into().unwrap()),
    };
    let mut fw = Firewall::new(policy);
    // The regions mapped: the last table's, then those added and not removed.
    let mut mapped: Vec<Reg> = Vec::new();
    // The highest guest address mapped since the last memory table.
    let mut mem_end: u64 = 0;
    let mut rest = &data[9..];
    while rest.len() >= 5 {
        let request = u32::from(rest[0]);
        let flags = u32::from(rest[1]);
        let size = usize::from(u16::from_le_bytes([rest[2], rest[3]])) % 600;
        let fds = usize::from(rest[4] & 0x0f) % 10;
        let short = rest[4] & 0x10 != 0;
        rest = &rest[5..];
        let take = size.min(rest.len());
        let mut payload = rest[..take].to_vec();
        payload.resize(size, 0);
        rest = &rest[take..];
        if short {
            payload.pop();
        }
        let h = Header {
            request,
            flags,
            size: size as u32,
        };
        let header_ok = fw.header(&h).is_ok();
        let acked_before = fw.acked_protocol();
        let verdict = fw.admit(&h, &mut payload, fds);
        let acked = fw.acked_protocol();
        assert_eq!(
            acked & !policy.protocol_features,
            0,
            "protocol features {acked:#x} beyond the offer {:#x}",
            policy.protocol_features
        );
        assert!(fw.early().count() <= policy.queues as usize);
        assert!(fw.early().all(|(i, s)| i < policy.queues && s <= 1));
        let Ok(verdict) = verdict else {
            assert_eq!(
                acked, acked_before,
                "a refused message changed the features"
            );
            assert_eq!(
                fw.regions(),
                mapped.len(),
                "a refused message changed the regions"
            );
            continue;
        };
        assert!(
            header_ok,
            "admitted a header the header check refused: {h:?}"
        );
        let need = needs(request).unwrap_or_else(|| panic!("request {request} admitted"));
        assert_eq!(
            need & !acked_before,
            0,
            "request {request} without its feature"
        );
        assert_eq!(flags & 0x3, FLAG_VERSION, "flags {flags:#x}");
        assert_eq!(flags & FLAG_REPLY, 0, "a reply admitted as a request");
        assert!(payload.len() <= MAX_PAYLOAD && payload.len() == size);
        assert!(fds <= MAX_FDS, "{fds} descriptors");
        match request {
            req::SET_PROTOCOL_FEATURES => {
                let v = u64::from_le_bytes(payload[..8].try_into().unwrap());
                assert_eq!(v & !policy.protocol_features, 0, "{v:#x} passed on");
                assert_eq!(v, acked);
            }
            req::SET_VRING_NUM
            | req::SET_VRING_BASE
            | req::GET_VRING_BASE
            | req::SET_VRING_ADDR
            | req::SET_VRING_ENABLE => {
                assert!(u32_at(&payload, 0) < policy.queues, "ring index");
            }
            req::SET_VRING_KICK | req::SET_VRING_CALL | req::SET_VRING_ERR => {
                assert!(u32_at(&payload, 0) & 0xff < policy.queues, "ring index");
                assert!(fds <= 1);
            }
            req::SET_MEM_TABLE => {
                mapped.clear();
                for k in 0..fds {
                    let b = &payload[8 + 32 * k..];
                    let r = reg_at(b);
                    admit_region(r, u64_at(b, 24), &mapped);
                    mapped.push(r);
                }
                mem_end = (0..fds)
                    .map(|k| end_of(&payload[8 + 32 * k..]))
                    .max()
                    .unwrap_or(0);
            }
            req::ADD_MEM_REG => {
                let r = reg_at(&payload[8..]);
                admit_region(r, u64_at(&payload, 32), &mapped);
                mapped.push(r);
                mem_end = mem_end.max(end_of(&payload[8..]));
                assert_eq!(fds, 1);
            }
            req::SET_LOG_BASE => {
                let (size, offset) = (u64_at(&payload, 0), u64_at(&payload, 8));
                assert!(size > 0 && size <= MAX_LOG, "log of {size} bytes");
                assert_eq!(offset % LOG_PAGE, 0, "log at {offset:#x}");
                assert!(offset.checked_add(size).is_some());
                // One bit per 4 KiB page: the last mapped page has its bit.
                if mem_end > 0 {
                    assert!(
                        (mem_end - 1) / LOG_PAGE / 8 < size,
                        "log of {size} bytes for memory to {mem_end:#x}"
                    );
                }
                assert_eq!(fds, 1);
            }
            req::REM_MEM_REG => {
                let r = reg_at(&payload[8..]);
                let k = mapped
                    .iter()
                    .position(|&m| m == r)
                    .unwrap_or_else(|| panic!("removed {r:x?}, which is not mapped"));
                mapped.swap_remove(k);
                assert!(fds <= 1);
                let close = Verdict::Forward(FdCheck::Close);
                assert_eq!(fds == 1, verdict == close, "{verdict:?} with {fds}");
            }
            _ => {}
        }
        assert!(
            mapped.len() <= MAX_MEM_SLOTS.max(MAX_FDS),
            "{} regions mapped",
            mapped.len()
        );
        assert_eq!(fw.regions(), mapped.len());
        match verdict {
            Verdict::Forward(FdCheck::Memory(regions)) => {
                assert!(matches!(request, req::SET_MEM_TABLE | req::ADD_MEM_REG));
                assert_eq!(regions.len(), fds, "one descriptor per region");
                for r in &regions {
                    assert!(
                        r.size > 0 && r.offset.checked_add(r.size).is_some(),
                        "{r:?}"
                    );
                }
            }
            Verdict::Forward(FdCheck::Eventfd) => assert!(fds <= 1),
            Verdict::Forward(FdCheck::Log(r)) => {
                assert_eq!(request, req::SET_LOG_BASE);
                assert_eq!(
                    (r.size, r.offset),
                    (u64_at(&payload, 0), u64_at(&payload, 8))
                );
            }
            Verdict::Rarp(mac) => {
                assert_eq!(request, req::SEND_RARP);
                assert_eq!(&mac[..], &payload[..6]);
                assert!(mac[0] & 1 == 0 && mac != [0; 6], "RARP for {mac:x?}");
                assert_eq!(fds, 0);
            }
            Verdict::LogFd => {
                assert_eq!(request, req::SET_LOG_FD);
                assert_eq!(fds, 1);
            }
            Verdict::Forward(FdCheck::None) => assert_eq!(fds, 0, "request {request}"),
            Verdict::Forward(FdCheck::Close) => {
                assert_eq!((request, fds), (req::REM_MEM_REG, 1))
            }
            Verdict::Early => assert_eq!(request, req::SET_VRING_ENABLE),
            Verdict::MaxMemSlots => {
                assert_eq!((request, fds), (req::GET_MAX_MEM_SLOTS, 0))
            }
            Verdict::SetStatus(status) => {
                assert_eq!((request, fds), (req::SET_STATUS, 0));
                assert_eq!(u64_at(&payload, 0), u64::from(status));
                assert_ne!(fw.acked_protocol() & proto::STATUS, 0);
            }
            Verdict::GetStatus => {
                assert_eq!((request, fds, payload.len()), (req::GET_STATUS, 0, 0));
                assert_ne!(fw.acked_protocol() & proto::STATUS, 0);
            }
        }
    }
}

/// A session as QEMU starts it, an ADD_MEM_REG flood with CONFIGURE_MEM_SLOTS offered,
/// ring indexes past the queues, a reply flag, unknown requests, and device status
/// requests with and without STATUS offered.
pub fn seeds() -> Vec<Vec<u8>> {
    let offer = proto::MQ | proto::REPLY_ACK;
    let all = u64::MAX.to_le_bytes();
    let state = |i: u32, n: u32| [i.to_le_bytes(), n.to_le_bytes()].concat();
    let region = |gpa: u64, size: u64| {
        [gpa, size, 0x7f00_0000_0000, 0]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect::<Vec<u8>>()
    };
    let mut table = state(1, 0);
    table.extend(region(0, 1 << 20));
    let mut add = vec![0u8; 8];
    add.extend(region(1 << 30, 4096));
    let m = |request: u32, payload: &[u8], fds: u8| Msg {
        request: request as u8,
        flags: FLAG_VERSION as u8,
        payload: payload.to_vec(),
        fds,
    };
    let log = |size: u64, offset: u64| [size.to_le_bytes(), offset.to_le_bytes()].concat();
    let migration_offer = offer | proto::LOG_SHMFD | proto::RARP;
    let migration = [
        m(req::SET_PROTOCOL_FEATURES, &all, 0),
        m(req::SET_MEM_TABLE, &table, 1),
        m(req::SET_LOG_BASE, &log(32, 0), 1),
        m(req::SET_LOG_BASE, &log(8, 0), 1),
        m(req::SET_LOG_BASE, &log(4096, 100), 1),
        m(req::SET_LOG_FD, &[], 1),
        m(req::SEND_RARP, &[0x52, 0x54, 0, 1, 2, 3, 0, 0], 0),
        m(req::SEND_RARP, &[0xff; 8], 0),
        m(req::SET_FEATURES, &(1u64 << 26).to_le_bytes(), 0),
    ];
    let qemu = [
        m(req::GET_FEATURES, &[], 0),
        m(req::GET_PROTOCOL_FEATURES, &[], 0),
        m(req::SET_PROTOCOL_FEATURES, &all, 0),
        m(req::SET_VRING_ENABLE, &state(0, 1), 0),
        m(req::SET_FEATURES, &1u64.to_le_bytes(), 0),
        m(req::SET_MEM_TABLE, &table, 1),
        m(req::SET_VRING_NUM, &state(0, 256), 0),
        m(req::SET_VRING_ADDR, &[0u8; 40], 0),
        m(req::SET_VRING_KICK, &0u64.to_le_bytes(), 1),
        m(req::SET_VRING_CALL, &0x100u64.to_le_bytes(), 0),
        m(req::GET_VRING_BASE, &state(1, 0), 0),
    ];
    let flood: Vec<Msg> = std::iter::once(m(req::SET_PROTOCOL_FEATURES, &all, 0))
        .chain((0..40).map(|_| m(req::ADD_MEM_REG, &add, 1)))
        .collect();
    // Hotplug as QEMU does it, then a storm: the same region added and removed,
    // one removed twice, one overlapping, one named by the wrong size, REM with a
    // descriptor, and adds past the bound.
    let reg = |gpa: u64, size: u64, uaddr: u64| {
        let mut p = vec![0u8; 8];
        p.extend([gpa, size, uaddr, 0].iter().flat_map(|x| x.to_le_bytes()));
        p
    };
    let dimm = reg(1 << 32, 128 << 20, 0x7f10_0000_0000);
    let mut storm = vec![
        m(req::SET_PROTOCOL_FEATURES, &all, 0),
        m(req::GET_MAX_MEM_SLOTS, &[], 0),
        m(req::ADD_MEM_REG, &reg(0, 512 << 20, 0x7f00_0000_0000), 1),
    ];
    for _ in 0..8 {
        storm.push(m(req::ADD_MEM_REG, &dimm, 1));
        storm.push(m(req::REM_MEM_REG, &dimm, 0));
    }
    storm.extend([
        m(req::ADD_MEM_REG, &dimm, 1),
        m(req::REM_MEM_REG, &dimm, 1),
        m(req::REM_MEM_REG, &dimm, 0),
        m(req::ADD_MEM_REG, &reg(1 << 32, 4096, 0x7f20_0000_0000), 1),
        m(req::ADD_MEM_REG, &reg(2 << 32, 4096, 0x7f10_0000_0000), 1),
        m(req::REM_MEM_REG, &reg(1 << 32, 8192, 0x7f20_0000_0000), 0),
    ]);
    storm.extend((3..80u64).map(|i| m(req::ADD_MEM_REG, &reg(i << 32, 4096, i << 40), 1)));
    let hostile = [
        m(req::SET_VRING_ENABLE, &state(4000, 1), 0),
        m(req::SET_VRING_KICK, &0xffu64.to_le_bytes(), 1),
        Msg {
            request: req::GET_FEATURES as u8,
            flags: (FLAG_VERSION | FLAG_REPLY) as u8,
            payload: vec![],
            fds: 0,
        },
        m(99, &[1, 2, 3], 2),
        m(req::SET_MEM_TABLE, &table, 0),
    ];
    // Status as virtio_user and QEMU set it, a value past a byte, and status
    // requests where STATUS is not offered (the same session below).
    let status = [
        m(req::SET_PROTOCOL_FEATURES, &all, 0),
        m(req::GET_STATUS, &[], 0),
        m(req::SET_STATUS, &0xbu64.to_le_bytes(), 0),
        m(req::SET_STATUS, &0x8u64.to_le_bytes(), 0),
        m(req::SET_STATUS, &0x10fu64.to_le_bytes(), 0),
        m(req::GET_STATUS, &0u64.to_le_bytes(), 0),
        m(req::SET_STATUS, &0xfu64.to_le_bytes(), 1),
        m(req::SET_STATUS, &0u64.to_le_bytes(), 0),
    ];
    vec![
        encode(2, offer | proto::STATUS, &status),
        encode(2, offer, &status),
        encode(2, offer, &qemu),
        encode(32, u64::MAX, &flood),
        encode(1, offer, &hostile),
        encode(4, 0, &qemu),
        encode(2, migration_offer, &migration),
        encode(2, offer, &migration),
        encode(2, offer | proto::CONFIGURE_MEM_SLOTS, &storm),
    ]
}

fuzz_target_tests!("relay", 4);

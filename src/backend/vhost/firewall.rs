//! The vhost-user control-plane firewall: which requests a frontend may send, with what
//! payload and how many descriptors, given what gsonet offered it. Pure checks on the
//! header, the payload and the descriptor count, made once per message by the relay,
//! which then asks `sys::fd` whether the descriptors are what `FdCheck` says.
//!
//! A frontend is not trusted: anything outside what was offered is refused, and the
//! relay ends that frontend's connection (the port then waits for the next one).

use crate::stats::DropReason;

pub const HDR: usize = 12;
pub const FLAG_VERSION: u32 = 0x1;
pub const FLAG_REPLY: u32 = 0x4;
pub const FLAG_NEED_REPLY: u32 = 0x8;
/// Version (bits 0-1), REPLY and NEED_REPLY; the other bits are reserved.
const FLAGS_KNOWN: u32 = 0xf;

/// Request numbers (vhost-user spec, "Front-end message types").
pub mod req {
    pub const GET_FEATURES: u32 = 1;
    pub const SET_FEATURES: u32 = 2;
    pub const SET_OWNER: u32 = 3;
    pub const RESET_OWNER: u32 = 4;
    pub const SET_MEM_TABLE: u32 = 5;
    pub const SET_LOG_BASE: u32 = 6;
    pub const SET_LOG_FD: u32 = 7;
    pub const SET_VRING_NUM: u32 = 8;
    pub const SET_VRING_ADDR: u32 = 9;
    pub const SET_VRING_BASE: u32 = 10;
    pub const GET_VRING_BASE: u32 = 11;
    pub const SET_VRING_KICK: u32 = 12;
    pub const SET_VRING_CALL: u32 = 13;
    pub const SET_VRING_ERR: u32 = 14;
    pub const GET_PROTOCOL_FEATURES: u32 = 15;
    pub const SET_PROTOCOL_FEATURES: u32 = 16;
    pub const GET_QUEUE_NUM: u32 = 17;
    pub const SET_VRING_ENABLE: u32 = 18;
    pub const SEND_RARP: u32 = 19;
    pub const GET_MAX_MEM_SLOTS: u32 = 36;
    pub const ADD_MEM_REG: u32 = 37;
    pub const REM_MEM_REG: u32 = 38;
    pub const SET_STATUS: u32 = 39;
    pub const GET_STATUS: u32 = 40;
}

/// Protocol feature bits the rules below depend on.
pub mod proto {
    pub const MQ: u64 = 1 << 0;
    pub const LOG_SHMFD: u64 = 1 << 1;
    pub const RARP: u64 = 1 << 2;
    pub const REPLY_ACK: u64 = 1 << 3;
    pub const CONFIGURE_MEM_SLOTS: u64 = 1 << 15;
    pub const STATUS: u64 = 1 << 16;
}

/// Regions one SET_MEM_TABLE may carry: VHOST_MEMORY_BASELINE_NREGIONS, the most QEMU
/// and DPDK send without CONFIGURE_MEM_SLOTS.
pub const MAX_TABLE_REGIONS: usize = 8;
/// Regions a port maps at once (CONFIGURE_MEM_SLOTS: GET_MAX_MEM_SLOTS answers it,
/// ADD_MEM_REG beyond it is refused). Each region holds one file descriptor and one
/// mapping for as long as it is mapped, so this bounds what a frontend makes a port
/// hold. 64, not the 509 of DPDK and the vhost crate: a guest needs one slot per
/// boot memory block (1 to 3), one per pc-dimm (QEMU's `slots=`, at most 256 and in
/// practice a few dozen), and virtio-mem with `dynamic-memslots=on` sizes its
/// memslots (at least 1 GiB each) to the smallest limit among the guest's vhost
/// devices, so a lower limit costs it nothing but larger slots.
pub const MAX_MEM_SLOTS: usize = 64;
/// struct vhost_user_memory_region: guest address, size, user address, mmap offset.
const REGION: usize = 32;
/// The largest payload of any request a frontend may send (a full SET_MEM_TABLE).
pub const MAX_PAYLOAD: usize = 8 + MAX_TABLE_REGIONS * REGION;
/// Most descriptors one message may carry (one per table region).
pub const MAX_FDS: usize = MAX_TABLE_REGIONS;
/// The dirty log is one bit per 4 KiB page (VHOST_LOG_PAGE), so a byte covers 32 KiB.
pub const LOG_PAGE: u64 = 0x1000;
const LOG_BYTE_COVERS: u64 = LOG_PAGE * 8;
/// The largest dirty log a frontend may hand over: 1 GiB covers 32 TiB of guest memory.
pub const MAX_LOG: u64 = 1 << 30;
/// SET_VRING_KICK/CALL/ERR: bits 0-7 the ring, bit 8 "no descriptor" (polling).
const VRING_INDEX: u64 = 0xff;
const VRING_NOFD: u64 = 0x100;

/// A message header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    pub request: u32,
    pub flags: u32,
    /// Payload bytes that follow.
    pub size: u32,
}

impl Header {
    pub fn parse(b: &[u8; HDR]) -> Header {
        let word = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        Header {
            request: word(0),
            flags: word(4),
            size: word(8),
        }
    }

    pub fn bytes(&self) -> [u8; HDR] {
        let mut b = [0u8; HDR];
        b[..4].copy_from_slice(&self.request.to_le_bytes());
        b[4..8].copy_from_slice(&self.flags.to_le_bytes());
        b[8..].copy_from_slice(&self.size.to_le_bytes());
        b
    }

    pub fn need_reply(&self) -> bool {
        self.flags & FLAG_NEED_REPLY != 0
    }
}

/// Why a message was refused: the port counter it goes to and a line for the log.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refusal {
    pub reason: DropReason,
    pub why: String,
}

impl Refusal {
    pub fn new(reason: DropReason, why: impl Into<String>) -> Refusal {
        Refusal {
            reason,
            why: why.into(),
        }
    }
}

fn not_permitted(why: impl Into<String>) -> Refusal {
    Refusal::new(DropReason::FrontendRequestRefused, why)
}

fn bad_payload(why: impl Into<String>) -> Refusal {
    Refusal::new(DropReason::FrontendBadPayload, why)
}

fn bad_fds(why: impl Into<String>) -> Refusal {
    Refusal::new(DropReason::FrontendBadFds, why)
}

/// What gsonet offers a frontend.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Policy {
    /// Virtqueues of the port (two per queue pair): every ring index is below it.
    pub queues: u32,
    /// The protocol features GET_PROTOCOL_FEATURES answers.
    pub protocol_features: u64,
}

/// Where a memory region's mapping lies in its file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Region {
    pub offset: u64,
    pub size: u64,
}

impl Region {
    /// The file size the mapping needs (offset + size, checked not to overflow).
    pub fn end(&self) -> u64 {
        self.offset.saturating_add(self.size)
    }
}

/// What the descriptors of an admitted message must be.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FdCheck {
    /// It carries none.
    None,
    /// A kick, call or error eventfd (or none, when the frontend asks for polling).
    Eventfd,
    /// One file per region, in order, each reaching at least to its region's end.
    Memory(Vec<Region>),
    /// The dirty log's file (SET_LOG_BASE), reaching at least to the log's end.
    Log(Region),
    /// One descriptor the request does not need (REM_MEM_REG from an older
    /// frontend): closed, not passed on.
    Close,
}

/// What the relay does with an admitted message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Pass it on, once its descriptors pass the check.
    Forward(FdCheck),
    /// A SET_VRING_ENABLE before SET_FEATURES, which the vhost crate would take for a
    /// protocol error: the relay answers it (if asked) and replays the last state of
    /// each ring after SET_FEATURES (`early`).
    Early,
    /// SEND_RARP (the vhost crate does not know it): the relay announces the guest of
    /// this MAC address from the port and answers the request itself.
    Rarp([u8; 6]),
    /// SET_LOG_FD (the vhost crate does not know it): an eventfd the frontend could
    /// be told of log writes through; gsonet does not need it, so the relay checks it,
    /// closes it and answers the request itself.
    LogFd,
    /// GET_MAX_MEM_SLOTS: the vhost crate would answer its own 509; the relay
    /// answers MAX_MEM_SLOTS, the bound ADD_MEM_REG is held to.
    MaxMemSlots,
    /// SET_STATUS (the vhost crate does not know it): the virtio device status the
    /// driver set. The relay keeps it for GET_STATUS and tells the ring resumer
    /// (`resume`), and answers the request itself.
    SetStatus(u8),
    /// GET_STATUS: the relay answers the status last set on this connection.
    GetStatus,
}

#[derive(Clone, Copy)]
enum Size {
    Exact(usize),
    /// SET_MEM_TABLE: 8 bytes, then 1 to MAX_TABLE_REGIONS regions.
    Table,
}

#[derive(Clone, Copy)]
enum Fds {
    None,
    /// SET_VRING_KICK/CALL/ERR: one, unless the payload says none.
    Vring,
    /// One per region of the table.
    PerRegion,
    One,
}

#[derive(Clone, Copy)]
struct Rule {
    size: Size,
    fds: Fds,
    /// The protocol feature that must have been acked (0: none).
    needs: u64,
}

/// The requests a frontend may send and their shape; every other request is refused.
fn rule(request: u32) -> Option<Rule> {
    let r = |size, fds, needs| Some(Rule { size, fds, needs });
    use Fds as F;
    use Size::Exact as E;
    match request {
        req::GET_FEATURES | req::SET_OWNER | req::RESET_OWNER | req::GET_PROTOCOL_FEATURES => {
            r(E(0), F::None, 0)
        }
        req::SET_FEATURES | req::SET_PROTOCOL_FEATURES => r(E(8), F::None, 0),
        req::GET_QUEUE_NUM => r(E(0), F::None, proto::MQ),
        req::SET_MEM_TABLE => r(Size::Table, F::PerRegion, 0),
        // struct vhost_vring_state: index, num.
        req::SET_VRING_NUM | req::SET_VRING_BASE | req::GET_VRING_BASE | req::SET_VRING_ENABLE => {
            r(E(8), F::None, 0)
        }
        // struct vhost_vring_addr: index, flags, desc, used, avail, log.
        req::SET_VRING_ADDR => r(E(40), F::None, 0),
        req::SET_VRING_KICK | req::SET_VRING_CALL | req::SET_VRING_ERR => r(E(8), F::Vring, 0),
        req::GET_MAX_MEM_SLOTS => r(E(0), F::None, proto::CONFIGURE_MEM_SLOTS),
        // struct vhost_user_log: mmap size, mmap offset; the log's file.
        req::SET_LOG_BASE => r(E(16), F::One, proto::LOG_SHMFD),
        req::SET_LOG_FD => r(E(0), F::One, proto::LOG_SHMFD),
        // The guest's MAC in the first 6 bytes of a u64.
        req::SEND_RARP => r(E(8), F::None, proto::RARP),
        // Padding, then one region.
        req::ADD_MEM_REG => r(E(8 + REGION), F::One, proto::CONFIGURE_MEM_SLOTS),
        req::REM_MEM_REG => r(E(8 + REGION), F::None, proto::CONFIGURE_MEM_SLOTS),
        // The status byte in a u64; GET_STATUS is answered with one.
        req::SET_STATUS => r(E(8), F::None, proto::STATUS),
        req::GET_STATUS => r(E(0), F::None, proto::STATUS),
        _ => None,
    }
}

fn u32_at(p: &[u8], i: usize) -> u32 {
    p.get(i..i + 4)
        .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .unwrap_or(0)
}

fn u64_at(p: &[u8], i: usize) -> u64 {
    p.get(i..i + 8)
        .and_then(|b| b.try_into().ok())
        .map(u64::from_le_bytes)
        .unwrap_or(0)
}

/// The state of one frontend's connection, as far as the rules need it.
pub struct Firewall {
    policy: Policy,
    acked_protocol: u64,
    features_set: bool,
    /// The last state an early SET_VRING_ENABLE asked for, per ring (one entry per queue
    /// the port has, however many indexes a frontend tries).
    early: Vec<Option<u32>>,
    /// Regions mapped now (SET_MEM_TABLE sets them, ADD/REM_MEM_REG change them).
    regions: Vec<Mapped>,
    /// The highest guest address end of any region mapped since the last table: a
    /// dirty log must cover it.
    mem_end: u64,
}

impl Firewall {
    pub fn new(policy: Policy) -> Firewall {
        Firewall {
            policy,
            acked_protocol: 0,
            features_set: false,
            early: vec![None; policy.queues as usize],
            regions: Vec::new(),
            mem_end: 0,
        }
    }

    /// The bytes a dirty log needs to cover every region mapped so far.
    pub fn log_bytes_needed(&self) -> u64 {
        self.mem_end.div_ceil(LOG_BYTE_COVERS)
    }

    /// Regions mapped now.
    pub fn regions(&self) -> usize {
        self.regions.len()
    }

    /// The protocol features in force: what the frontend acked of what was offered.
    pub fn acked_protocol(&self) -> u64 {
        self.acked_protocol
    }

    /// Whether the frontend negotiated REPLY_ACK (so NEED_REPLY gets an answer).
    pub fn reply_ack(&self) -> bool {
        self.acked_protocol & proto::REPLY_ACK != 0
    }

    /// The early SET_VRING_ENABLE states to replay after SET_FEATURES: (ring, state).
    pub fn early(&self) -> impl Iterator<Item = (u32, u32)> + '_ {
        self.early
            .iter()
            .enumerate()
            .filter_map(|(i, s)| s.map(|s| (i as u32, s)))
    }

    /// Checks a header before its payload is read: flags, a request that was offered,
    /// and a size that request can have (so no more than MAX_PAYLOAD is ever read).
    pub fn header(&self, h: &Header) -> Result<(), Refusal> {
        self.rule(h).map(|_| ())
    }

    fn rule(&self, h: &Header) -> Result<Rule, Refusal> {
        if h.flags & !FLAGS_KNOWN != 0 || h.flags & 0x3 != FLAG_VERSION {
            return Err(not_permitted(format!("header flags {:#x}", h.flags)));
        }
        if h.flags & FLAG_REPLY != 0 {
            return Err(not_permitted("a reply where a request belongs"));
        }
        let rule =
            rule(h.request).ok_or_else(|| not_permitted(format!("request {}", h.request)))?;
        if rule.needs & !self.acked_protocol != 0 {
            return Err(not_permitted(format!(
                "request {} needs protocol feature {:#x}, which was not negotiated",
                h.request, rule.needs
            )));
        }
        let size = h.size as usize;
        let fits = match rule.size {
            Size::Exact(n) => size == n,
            Size::Table => {
                size > 8
                    && (size - 8).is_multiple_of(REGION)
                    && (size - 8) / REGION <= MAX_TABLE_REGIONS
            }
        };
        if !fits {
            return Err(bad_payload(format!(
                "request {} with a {size}-byte payload",
                h.request
            )));
        }
        Ok(rule)
    }

    /// Checks a whole message (header again, payload fields, descriptor count) and
    /// updates the connection state. May rewrite the payload: SET_PROTOCOL_FEATURES
    /// goes on with only the offered features left.
    pub fn admit(
        &mut self,
        h: &Header,
        payload: &mut [u8],
        fds: usize,
    ) -> Result<Verdict, Refusal> {
        let rule = self.rule(h)?;
        if payload.len() != h.size as usize {
            return Err(bad_payload(format!(
                "request {}: {} payload bytes, header says {}",
                h.request,
                payload.len(),
                h.size
            )));
        }
        let ring = |i: u32| -> Result<u32, Refusal> {
            if i < self.policy.queues {
                Ok(i)
            } else {
                Err(bad_payload(format!(
                    "request {} for ring {i}; the port has {}",
                    h.request, self.policy.queues
                )))
            }
        };
        let mut check = FdCheck::None;
        let mut expect_fds = match rule.fds {
            Fds::None => 0,
            Fds::One | Fds::Vring => 1,
            Fds::PerRegion => 0,
        };
        let mut verdict_early = false;
        let mut verdict = None;
        // A refused message changes nothing: the state it may touch is put back.
        let saved = (
            self.acked_protocol,
            self.features_set,
            self.regions.clone(),
            self.mem_end,
        );
        let early_before = self.early.clone();
        match h.request {
            req::SET_FEATURES => self.features_set = true,
            req::SET_PROTOCOL_FEATURES => {
                let masked = u64_at(payload, 0) & self.policy.protocol_features;
                payload.copy_from_slice(&masked.to_le_bytes());
                self.acked_protocol = masked;
            }
            req::SET_VRING_NUM
            | req::SET_VRING_BASE
            | req::GET_VRING_BASE
            | req::SET_VRING_ADDR => {
                ring(u32_at(payload, 0))?;
            }
            req::SET_VRING_ENABLE => {
                let i = ring(u32_at(payload, 0))?;
                let state = u32_at(payload, 4);
                if state > 1 {
                    return Err(bad_payload(format!("ring {i} enable state {state}")));
                }
                if !self.features_set {
                    self.early[i as usize] = Some(state);
                    verdict_early = true;
                }
            }
            req::SET_VRING_KICK | req::SET_VRING_CALL | req::SET_VRING_ERR => {
                let v = u64_at(payload, 0);
                if v & !(VRING_INDEX | VRING_NOFD) != 0 {
                    return Err(bad_payload(format!("request {} value {v:#x}", h.request)));
                }
                ring((v & VRING_INDEX) as u32)?;
                if v & VRING_NOFD != 0 {
                    expect_fds = 0;
                }
                check = FdCheck::Eventfd;
            }
            req::SET_MEM_TABLE => {
                let n = u32_at(payload, 0) as usize;
                if n != (payload.len() - 8) / REGION || u32_at(payload, 4) != 0 {
                    return Err(bad_payload(format!(
                        "a memory table announcing {n} regions in {} bytes",
                        payload.len()
                    )));
                }
                let mapped = (0..n)
                    .map(|k| Mapped::parse(&payload[8 + k * REGION..8 + (k + 1) * REGION]))
                    .collect::<Result<Vec<_>, _>>()?;
                for (k, r) in mapped.iter().enumerate() {
                    if let Some(o) = mapped[..k].iter().find(|o| o.overlaps(r)) {
                        return Err(overlap(r, o));
                    }
                }
                expect_fds = n;
                self.mem_end = mapped.iter().map(Mapped::end).max().unwrap_or(0);
                check = FdCheck::Memory(mapped.iter().map(|m| m.file).collect());
                self.regions = mapped;
            }
            req::ADD_MEM_REG => {
                if self.regions.len() >= MAX_MEM_SLOTS {
                    return Err(bad_payload(format!(
                        "a memory region beyond the {MAX_MEM_SLOTS} a frontend may map"
                    )));
                }
                let r = Mapped::parse(&payload[8..])?;
                if let Some(o) = self.regions.iter().find(|o| o.overlaps(&r)) {
                    return Err(overlap(&r, o));
                }
                self.regions.push(r);
                self.mem_end = self.mem_end.max(r.end());
                check = FdCheck::Memory(vec![r.file]);
            }
            req::REM_MEM_REG => {
                // Named by guest address, size and user address (the offset is
                // ignored, as the spec says); it must be one mapped now.
                let r = Mapped::parse(&payload[8..])?;
                let Some(k) = self.regions.iter().position(|m| m.same(&r)) else {
                    return Err(bad_payload(format!(
                        "REM_MEM_REG of {}, which is not mapped",
                        r
                    )));
                };
                self.regions.swap_remove(k);
                // No descriptor is due; one is tolerated (the spec lets a backend
                // accept it from older frontends) and closed unused.
                if fds == 1 {
                    expect_fds = 1;
                    verdict = Some(Verdict::Forward(FdCheck::Close));
                }
            }
            req::SET_LOG_BASE => check = FdCheck::Log(self.log(payload)?),
            req::GET_MAX_MEM_SLOTS => verdict = Some(Verdict::MaxMemSlots),
            req::SET_LOG_FD => {
                check = FdCheck::Eventfd;
                verdict = Some(Verdict::LogFd);
            }
            req::SEND_RARP => {
                let mut mac = [0u8; 6];
                mac.copy_from_slice(&payload[..6]);
                // The guest's own address: unicast, not zero.
                if mac[0] & 1 != 0 || mac == [0; 6] {
                    return Err(bad_payload(format!(
                        "SEND_RARP for {}, not a unicast address",
                        crate::l2::Mac(mac)
                    )));
                }
                verdict = Some(Verdict::Rarp(mac));
            }
            req::SET_STATUS => {
                let v = u64_at(payload, 0);
                let status = u8::try_from(v)
                    .map_err(|_| bad_payload(format!("SET_STATUS {v:#x}, not a status byte")))?;
                verdict = Some(Verdict::SetStatus(status));
            }
            req::GET_STATUS => verdict = Some(Verdict::GetStatus),
            _ => {}
        }
        if fds != expect_fds {
            (
                self.acked_protocol,
                self.features_set,
                self.regions,
                self.mem_end,
            ) = saved;
            self.early = early_before;
            return Err(bad_fds(format!(
                "request {} with {fds} descriptors; it takes {expect_fds}",
                h.request
            )));
        }
        Ok(if verdict_early {
            Verdict::Early
        } else if let Some(v) = verdict {
            v
        } else {
            Verdict::Forward(check)
        })
    }

    /// SET_LOG_BASE's struct vhost_user_log: a log of some bytes, no more than
    /// MAX_LOG, at a page-aligned offset (it is mapped), covering every region mapped.
    fn log(&self, payload: &[u8]) -> Result<Region, Refusal> {
        let (size, offset) = (u64_at(payload, 0), u64_at(payload, 8));
        let need = self.log_bytes_needed();
        if size == 0
            || size > MAX_LOG
            || !offset.is_multiple_of(LOG_PAGE)
            || offset.checked_add(size).is_none()
            || size < need
        {
            return Err(bad_payload(format!(
                "a dirty log of {size} bytes at offset {offset:#x} (needs {need} to {MAX_LOG} \
                 bytes at a page-aligned offset)"
            )));
        }
        Ok(Region { offset, size })
    }
}

/// A memory region as the frontend described it (struct vhost_user_memory_region).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Mapped {
    gpa: u64,
    uaddr: u64,
    /// Where it lies in its file (its size is the region's).
    file: Region,
}

impl Mapped {
    /// One struct vhost_user_memory_region: no empty region, no address that wraps.
    fn parse(b: &[u8]) -> Result<Mapped, Refusal> {
        let (gpa, size, uaddr, offset) = (u64_at(b, 0), u64_at(b, 8), u64_at(b, 16), u64_at(b, 24));
        let m = Mapped {
            gpa,
            uaddr,
            file: Region { offset, size },
        };
        let wraps = |a: u64| a.checked_add(size).is_none();
        if size == 0 || wraps(gpa) || wraps(uaddr) || wraps(offset) {
            return Err(bad_payload(format!("{m}")));
        }
        Ok(m)
    }

    /// Where it ends in guest addresses.
    fn end(&self) -> u64 {
        self.gpa + self.file.size
    }

    /// Whether the two share a guest address or a frontend address: either would
    /// make a guest address, or a ring address QEMU gives in its own addresses,
    /// mean two places.
    fn overlaps(&self, o: &Mapped) -> bool {
        let meet = |a: u64, b: u64| a < b + o.file.size && b < a + self.file.size;
        meet(self.gpa, o.gpa) || meet(self.uaddr, o.uaddr)
    }

    /// The same region for REM_MEM_REG: guest address, size and user address.
    fn same(&self, o: &Mapped) -> bool {
        (self.gpa, self.file.size, self.uaddr) == (o.gpa, o.file.size, o.uaddr)
    }
}

impl std::fmt::Display for Mapped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "memory region of {:#x} bytes at guest {:#x}, user {:#x}, offset {:#x}",
            self.file.size, self.gpa, self.uaddr, self.file.offset
        )
    }
}

fn overlap(r: &Mapped, o: &Mapped) -> Refusal {
    bad_payload(format!("{r} overlaps the {o}"))
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    const POLICY: Policy = Policy {
        queues: 2,
        protocol_features: proto::MQ | proto::REPLY_ACK,
    };

    fn h(request: u32, size: usize) -> Header {
        Header {
            request,
            flags: FLAG_VERSION,
            size: size as u32,
        }
    }

    fn admit(
        fw: &mut Firewall,
        request: u32,
        mut p: Vec<u8>,
        fds: usize,
    ) -> Result<Verdict, DropReason> {
        fw.admit(&h(request, p.len()), &mut p, fds)
            .map_err(|r| r.reason)
    }

    fn pair(a: u32, b: u32) -> Vec<u8> {
        [a.to_le_bytes(), b.to_le_bytes()].concat()
    }

    fn table(regions: &[[u64; 4]]) -> Vec<u8> {
        let mut p = pair(regions.len() as u32, 0);
        for r in regions {
            p.extend(r.iter().flat_map(|v| v.to_le_bytes()));
        }
        p
    }

    const FWD: Result<Verdict, DropReason> = Ok(Verdict::Forward(FdCheck::None));

    #[test]
    fn header_round_trip_and_flags() {
        let hd = Header {
            request: 18,
            flags: FLAG_VERSION | FLAG_NEED_REPLY,
            size: 8,
        };
        assert_eq!(Header::parse(&hd.bytes()), hd);
        assert!(hd.need_reply());
        let fw = Firewall::new(POLICY);
        assert_eq!(fw.header(&hd), Ok(()));
        for flags in [
            0,
            0x2,
            FLAG_VERSION | FLAG_REPLY,
            FLAG_VERSION | 0x10,
            0x8000_0001,
        ] {
            let r = fw.header(&Header { flags, ..hd }).unwrap_err();
            assert_eq!(r.reason, DropReason::FrontendRequestRefused, "{flags:#x}");
        }
    }

    #[test]
    fn only_offered_requests_pass() {
        let mut fw = Firewall::new(POLICY);
        for unknown in [
            0,
            6,
            7,
            19,
            20,
            21,
            22,
            24,
            25,
            31,
            32,
            34,
            35,
            39,
            44,
            45,
            u32::MAX,
        ] {
            assert_eq!(
                fw.header(&h(unknown, 0)).unwrap_err().reason,
                DropReason::FrontendRequestRefused,
                "request {unknown}"
            );
        }
        // Requests of a protocol feature need it acked; acking one never offered does
        // not count: the ack is masked to the offer, and the masked value goes on.
        let mut ack = (proto::MQ | proto::REPLY_ACK | proto::CONFIGURE_MEM_SLOTS | 1 << 13)
            .to_le_bytes()
            .to_vec();
        assert_eq!(
            fw.header(&h(req::GET_QUEUE_NUM, 0)).unwrap_err().reason,
            DropReason::FrontendRequestRefused
        );
        assert_eq!(
            fw.admit(&h(req::SET_PROTOCOL_FEATURES, 8), &mut ack, 0),
            Ok(Verdict::Forward(FdCheck::None))
        );
        assert_eq!(
            u64::from_le_bytes(ack[..8].try_into().unwrap()),
            proto::MQ | proto::REPLY_ACK
        );
        assert_eq!(fw.acked_protocol(), proto::MQ | proto::REPLY_ACK);
        assert!(fw.reply_ack());
        assert_eq!(fw.header(&h(req::GET_QUEUE_NUM, 0)), Ok(()));
        for mem_slots in [req::GET_MAX_MEM_SLOTS, req::ADD_MEM_REG, req::REM_MEM_REG] {
            assert_eq!(
                admit(&mut fw, mem_slots, vec![0; 40], 1),
                Err(DropReason::FrontendRequestRefused)
            );
        }
    }

    #[test]
    fn every_payload_has_its_request_size() {
        let fw = Firewall::new(POLICY);
        let cases: &[(u32, &[usize])] = &[
            (req::GET_FEATURES, &[0]),
            (req::SET_OWNER, &[0]),
            (req::SET_FEATURES, &[8]),
            (req::SET_PROTOCOL_FEATURES, &[8]),
            (req::SET_VRING_NUM, &[8]),
            (req::SET_VRING_ENABLE, &[8]),
            (req::SET_VRING_ADDR, &[40]),
            (req::SET_VRING_CALL, &[8]),
            (req::SET_MEM_TABLE, &[40, 72, 8 + 32 * MAX_TABLE_REGIONS]),
        ];
        for &(request, good) in cases {
            for size in [0, 1, 4, 7, 8, 9, 16, 40, 41, 72, 264, 296, 4096, 1 << 31] {
                let r = fw.header(&h(request, size));
                if good.contains(&size) {
                    assert_eq!(r, Ok(()), "request {request}, {size} bytes");
                } else {
                    assert_eq!(
                        r.unwrap_err().reason,
                        DropReason::FrontendBadPayload,
                        "request {request}, {size} bytes"
                    );
                }
            }
        }
        const { assert!(MAX_PAYLOAD >= 8 + 32 * MAX_TABLE_REGIONS) };
        // The payload must be what the header said.
        let mut fw = Firewall::new(POLICY);
        let r = fw.admit(&h(req::SET_FEATURES, 8), &mut [0u8; 4], 0);
        assert_eq!(r.unwrap_err().reason, DropReason::FrontendBadPayload);
    }

    #[test]
    fn ring_indexes_are_below_the_port_queues() {
        let mut fw = Firewall::new(POLICY);
        for request in [req::SET_VRING_NUM, req::SET_VRING_BASE, req::GET_VRING_BASE] {
            assert_eq!(admit(&mut fw, request, pair(1, 256), 0), FWD);
            assert_eq!(
                admit(&mut fw, request, pair(2, 256), 0),
                Err(DropReason::FrontendBadPayload)
            );
        }
        let mut addr = pair(1, 0);
        addr.extend([0u8; 32]);
        assert_eq!(admit(&mut fw, req::SET_VRING_ADDR, addr.clone(), 0), FWD);
        addr[0] = 7;
        assert_eq!(
            admit(&mut fw, req::SET_VRING_ADDR, addr, 0),
            Err(DropReason::FrontendBadPayload)
        );
        let call = |v: u64| v.to_le_bytes().to_vec();
        let ev = Ok(Verdict::Forward(FdCheck::Eventfd));
        assert_eq!(admit(&mut fw, req::SET_VRING_CALL, call(1), 1), ev);
        assert_eq!(
            admit(&mut fw, req::SET_VRING_KICK, call(1 | VRING_NOFD), 0),
            ev
        );
        for bad in [2, 0xff, 1 << 9 | 1, 1 << 40] {
            assert_eq!(
                admit(&mut fw, req::SET_VRING_ERR, call(bad), 1),
                Err(DropReason::FrontendBadPayload),
                "{bad:#x}"
            );
        }
    }

    #[test]
    fn early_enables_are_kept_per_ring_and_bounded() {
        let mut fw = Firewall::new(POLICY);
        assert_eq!(
            admit(&mut fw, req::SET_VRING_ENABLE, pair(1, 1), 0),
            Ok(Verdict::Early)
        );
        assert_eq!(
            admit(&mut fw, req::SET_VRING_ENABLE, pair(0, 0), 0),
            Ok(Verdict::Early)
        );
        assert_eq!(
            admit(&mut fw, req::SET_VRING_ENABLE, pair(0, 1), 0),
            Ok(Verdict::Early)
        );
        for bad in [pair(2, 1), pair(u32::MAX, 1), pair(0, 2)] {
            assert_eq!(
                admit(&mut fw, req::SET_VRING_ENABLE, bad, 0),
                Err(DropReason::FrontendBadPayload)
            );
        }
        assert_eq!(fw.early.len(), 2);
        assert_eq!(fw.early().collect::<Vec<_>>(), vec![(0, 1), (1, 1)]);
        assert_eq!(admit(&mut fw, req::SET_FEATURES, vec![0; 8], 0), FWD);
        assert_eq!(admit(&mut fw, req::SET_VRING_ENABLE, pair(1, 0), 0), FWD);
        assert_eq!(fw.early().collect::<Vec<_>>(), vec![(0, 1), (1, 1)]);
    }

    #[test]
    fn descriptors_only_where_a_request_takes_them() {
        let mut fw = Firewall::new(POLICY);
        for (request, p) in [
            (req::GET_FEATURES, vec![]),
            (req::SET_OWNER, vec![]),
            (req::SET_FEATURES, vec![0; 8]),
            (req::SET_VRING_NUM, pair(0, 256)),
        ] {
            assert_eq!(
                admit(&mut fw, request, p, 1),
                Err(DropReason::FrontendBadFds),
                "request {request}"
            );
        }
        assert_eq!(
            admit(&mut fw, req::SET_VRING_ENABLE, pair(0, 1), 1),
            Err(DropReason::FrontendBadFds)
        );
        let call = |v: u64| v.to_le_bytes().to_vec();
        assert_eq!(
            admit(&mut fw, req::SET_VRING_CALL, call(0), 0),
            Err(DropReason::FrontendBadFds)
        );
        assert_eq!(
            admit(&mut fw, req::SET_VRING_CALL, call(0), 2),
            Err(DropReason::FrontendBadFds)
        );
        assert_eq!(
            admit(&mut fw, req::SET_VRING_KICK, call(VRING_NOFD), 1),
            Err(DropReason::FrontendBadFds)
        );
        let t = table(&[
            [0, 1 << 20, 0x7000_0000_0000, 0],
            [1 << 32, 1 << 20, 0x7100_0000_0000, 1 << 20],
        ]);
        assert_eq!(
            admit(&mut fw, req::SET_MEM_TABLE, t.clone(), 1),
            Err(DropReason::FrontendBadFds)
        );
        assert_eq!(
            admit(&mut fw, req::SET_MEM_TABLE, t.clone(), 3),
            Err(DropReason::FrontendBadFds)
        );
        assert_eq!(
            admit(&mut fw, req::SET_MEM_TABLE, t, 2),
            Ok(Verdict::Forward(FdCheck::Memory(vec![
                Region {
                    offset: 0,
                    size: 1 << 20
                },
                Region {
                    offset: 1 << 20,
                    size: 1 << 20
                }
            ])))
        );
    }

    #[test]
    fn memory_tables_are_bounded_and_consistent() {
        let mut fw = Firewall::new(POLICY);
        let r = [0u64, 4096, 0x7000_0000_0000, 0];
        // Announced count against size; padding; empty and wrapping regions.
        let mut two_in_one = table(&[r]);
        two_in_one[0] = 2;
        let mut padded = table(&[r]);
        padded[4] = 1;
        for bad in [
            two_in_one,
            padded,
            table(&[[0, 0, 0, 0]]),
            table(&[[u64::MAX - 10, 4096, 0, 0]]),
            table(&[[0, 4096, u64::MAX, 0]]),
            table(&[[0, 4096, 0, u64::MAX - 1]]),
        ] {
            assert_eq!(
                admit(&mut fw, req::SET_MEM_TABLE, bad, 1),
                Err(DropReason::FrontendBadPayload)
            );
        }
        let nine = table(&[r; MAX_TABLE_REGIONS + 1]);
        assert_eq!(
            fw.header(&h(req::SET_MEM_TABLE, nine.len()))
                .unwrap_err()
                .reason,
            DropReason::FrontendBadPayload
        );
        let apart: Vec<[u64; 4]> = (0..MAX_TABLE_REGIONS as u64)
            .map(|i| [i << 32, 4096, 0x7000_0000_0000 + (i << 32), 0])
            .collect();
        assert!(admit(
            &mut fw,
            req::SET_MEM_TABLE,
            table(&apart),
            MAX_TABLE_REGIONS
        )
        .is_ok());
    }

    #[test]
    fn added_regions_are_capped_where_mem_slots_are_offered() {
        let mut fw = slots();
        assert_eq!(
            admit(&mut fw, req::GET_MAX_MEM_SLOTS, vec![], 0),
            Ok(Verdict::MaxMemSlots)
        );
        let add = |i: u64| {
            let mut p = vec![0u8; 8];
            p.extend(
                [i << 30, 4096, i << 30, 0]
                    .iter()
                    .flat_map(|v| v.to_le_bytes()),
            );
            p
        };
        for i in 0..MAX_MEM_SLOTS as u64 {
            assert_eq!(
                admit(&mut fw, req::ADD_MEM_REG, add(i), 1),
                Ok(Verdict::Forward(FdCheck::Memory(vec![Region {
                    offset: 0,
                    size: 4096
                }])))
            );
        }
        assert_eq!(
            admit(&mut fw, req::ADD_MEM_REG, add(99), 1),
            Err(DropReason::FrontendBadPayload)
        );
        assert_eq!(admit(&mut fw, req::REM_MEM_REG, add(0), 0), FWD);
        assert!(admit(&mut fw, req::ADD_MEM_REG, add(0), 1).is_ok());
        assert_eq!(fw.regions(), MAX_MEM_SLOTS);
        assert_eq!(
            admit(&mut fw, req::ADD_MEM_REG, add(1), 0),
            Err(DropReason::FrontendBadPayload)
        );
    }

    #[test]
    fn status_requests_need_status_acked_and_carry_a_status_byte() {
        let mut fw = offering(proto::STATUS);
        let status = |v: u64| v.to_le_bytes().to_vec();
        assert_eq!(
            admit(&mut fw, req::SET_STATUS, status(0xb), 0),
            Err(DropReason::FrontendRequestRefused)
        );
        assert_eq!(
            admit(&mut fw, req::GET_STATUS, vec![], 0),
            Err(DropReason::FrontendRequestRefused)
        );
        ack(&mut fw, proto::STATUS);
        assert_eq!(
            admit(&mut fw, req::SET_STATUS, status(0xb), 0),
            Ok(Verdict::SetStatus(0xb))
        );
        assert_eq!(
            admit(&mut fw, req::SET_STATUS, status(0x10b), 0),
            Err(DropReason::FrontendBadPayload)
        );
        assert_eq!(
            admit(&mut fw, req::SET_STATUS, status(0xb), 1),
            Err(DropReason::FrontendBadFds)
        );
        assert_eq!(
            admit(&mut fw, req::GET_STATUS, vec![], 0),
            Ok(Verdict::GetStatus)
        );
        assert_eq!(
            admit(&mut fw, req::GET_STATUS, status(0), 0),
            Err(DropReason::FrontendBadPayload)
        );
    }

    /// A firewall whose policy offers `extra` too, not acked yet.
    fn offering(extra: u64) -> Firewall {
        Firewall::new(Policy {
            protocol_features: POLICY.protocol_features | extra,
            ..POLICY
        })
    }

    /// The frontend acks protocol features `bits`.
    fn ack(fw: &mut Firewall, bits: u64) {
        let mut ack = bits.to_le_bytes().to_vec();
        fw.admit(&h(req::SET_PROTOCOL_FEATURES, 8), &mut ack, 0)
            .unwrap();
    }

    /// A firewall with CONFIGURE_MEM_SLOTS acked.
    fn slots() -> Firewall {
        let mut fw = offering(proto::CONFIGURE_MEM_SLOTS);
        ack(&mut fw, proto::CONFIGURE_MEM_SLOTS);
        fw
    }

    /// ADD/REM_MEM_REG's payload: padding, then guest address, size, user address,
    /// offset (the relay's tests send it too).
    pub(in crate::backend::vhost) fn reg(gpa: u64, size: u64, uaddr: u64, offset: u64) -> Vec<u8> {
        let mut p = vec![0u8; 8];
        p.extend(
            [gpa, size, uaddr, offset]
                .iter()
                .flat_map(|v| v.to_le_bytes()),
        );
        p
    }

    #[test]
    fn added_regions_do_not_overlap_or_wrap_and_only_mapped_ones_are_removed() {
        use DropReason::FrontendBadPayload as Bad;
        let mut fw = slots();
        let one = |offset| {
            Ok(Verdict::Forward(FdCheck::Memory(vec![Region {
                offset,
                size: 1 << 20,
            }])))
        };
        let (g, u) = (1u64 << 32, 0x7f00_0000_0000u64);
        assert_eq!(
            admit(&mut fw, req::ADD_MEM_REG, reg(g, 1 << 20, u, 4096), 1),
            one(4096)
        );
        // Overlapping in guest addresses, or in the frontend's: refused.
        for (gpa, uaddr) in [
            (g, u + (1 << 30)),
            (g + (1 << 20) - 4096, u + (1 << 30)),
            (g - 4096, u + (1 << 30)),
            (g + (1 << 30), u),
            (g + (1 << 30), u - 4096),
        ] {
            let mut f = slots();
            admit(&mut f, req::ADD_MEM_REG, reg(g, 1 << 20, u, 0), 1).unwrap();
            assert_eq!(
                admit(&mut f, req::ADD_MEM_REG, reg(gpa, 1 << 20, uaddr, 0), 1),
                Err(Bad),
                "{gpa:#x} {uaddr:#x}"
            );
        }
        // Touching is not overlapping.
        assert_eq!(
            admit(
                &mut fw,
                req::ADD_MEM_REG,
                reg(g + (1 << 20), 1 << 20, u + (1 << 20), 0),
                1
            ),
            one(0)
        );
        // Empty, wrapping in any of its three addresses.
        for bad in [
            reg(0, 0, 0, 0),
            reg(u64::MAX - 4095, 8192, 0, 0),
            reg(0, 8192, u64::MAX - 4095, 0),
            reg(0, 8192, 0, u64::MAX - 4095),
        ] {
            assert_eq!(admit(&mut slots(), req::ADD_MEM_REG, bad, 1), Err(Bad));
        }
        // A region not mapped, or named by another size or user address: refused;
        // the offset does not name it.
        for bad in [
            reg(g + (2 << 20), 1 << 20, u + (2 << 20), 0),
            reg(g, 2 << 20, u, 4096),
            reg(g, 1 << 20, u + 4096, 4096),
            reg(g + 4096, 1 << 20, u, 4096),
        ] {
            let mut f = slots();
            admit(&mut f, req::ADD_MEM_REG, reg(g, 1 << 20, u, 4096), 1).unwrap();
            assert_eq!(admit(&mut f, req::REM_MEM_REG, bad, 0), Err(Bad));
        }
        assert_eq!(
            admit(&mut fw, req::REM_MEM_REG, reg(g, 1 << 20, u, 99), 0),
            FWD
        );
        assert_eq!(fw.regions(), 1);
        // Removed once: not again.
        assert_eq!(
            admit(&mut fw, req::REM_MEM_REG, reg(g, 1 << 20, u, 0), 0),
            Err(Bad)
        );
        // One descriptor on REM_MEM_REG is tolerated and closed; two are not.
        let second = reg(g + (1 << 20), 1 << 20, u + (1 << 20), 0);
        assert_eq!(
            admit(&mut fw, req::REM_MEM_REG, second.clone(), 2),
            Err(DropReason::FrontendBadFds)
        );
        assert_eq!(fw.regions(), 1, "a refused message changes nothing");
        assert_eq!(
            admit(&mut fw, req::REM_MEM_REG, second, 1),
            Ok(Verdict::Forward(FdCheck::Close))
        );
        assert_eq!(fw.regions(), 0);
        // The guest address space is free again.
        assert!(admit(&mut fw, req::ADD_MEM_REG, reg(g, 8 << 20, u, 0), 1).is_ok());
    }

    #[test]
    fn a_table_replaces_the_regions_and_its_own_may_not_overlap() {
        let mut fw = slots();
        let r = |gpa: u64, uaddr: u64| [gpa, 1 << 20, uaddr, 0];
        assert_eq!(
            admit(
                &mut fw,
                req::SET_MEM_TABLE,
                table(&[r(0, 1 << 40), r(1 << 19, 1 << 41)]),
                2
            ),
            Err(DropReason::FrontendBadPayload)
        );
        assert_eq!(
            admit(
                &mut fw,
                req::SET_MEM_TABLE,
                table(&[r(0, 1 << 40), r(1 << 30, (1 << 40) + 4096)]),
                2
            ),
            Err(DropReason::FrontendBadPayload)
        );
        assert!(admit(
            &mut fw,
            req::SET_MEM_TABLE,
            table(&[r(0, 1 << 40), r(1 << 30, 1 << 41)]),
            2
        )
        .is_ok());
        assert_eq!(fw.regions(), 2);
        assert_eq!(
            admit(&mut fw, req::ADD_MEM_REG, reg(0, 4096, 1 << 42, 0), 1),
            Err(DropReason::FrontendBadPayload)
        );
        assert_eq!(
            admit(
                &mut fw,
                req::REM_MEM_REG,
                reg(1 << 30, 1 << 20, 1 << 41, 0),
                0
            ),
            FWD
        );
        assert!(admit(
            &mut fw,
            req::SET_MEM_TABLE,
            table(&[r(1 << 30, 1 << 41)]),
            1
        )
        .is_ok());
        assert_eq!(fw.regions(), 1);
        assert_eq!(
            admit(&mut fw, req::REM_MEM_REG, reg(0, 1 << 20, 1 << 40, 0), 0),
            Err(DropReason::FrontendBadPayload)
        );
    }
}

//! The Xen netif protocol (xen/include/public/io/netif.h) as pure functions over ring
//! slots: a TX request run with its extra-info slots becomes a checked packet plan, a
//! plan and its bytes become the virtio_net_hdr the switch works with, and a frame for
//! a netfront becomes the RX response slots it takes. Nothing here touches a ring.

use crate::features::Caps;
use crate::segment::{parse, L4};
use crate::stats::DropReason;
use crate::vnet_hdr::{GsoKind, GsoType, VirtioNetHdr, F_DATA_VALID, F_NEEDS_CSUM};

/// Most data slots a packet may use (XEN_NETIF_NR_SLOTS_MIN).
pub const NR_SLOTS_MIN: usize = 18;
/// Bytes before the first slot of a shared ring (indexes and padding).
pub const RING_HDR: usize = 64;
pub const TX_SLOT: usize = 12;
pub const RX_SLOT: usize = 8;
/// Slots per ring in one 4 KiB page: (4096 - 64) / slot size, rounded down to a power of two.
pub const TX_RING_SIZE: u32 = 256;
pub const RX_RING_SIZE: u32 = 256;
/// Offsets of the shared ring's indexes.
pub const REQ_PROD: usize = 0;
pub const REQ_EVENT: usize = 4;
pub const RSP_PROD: usize = 8;
pub const RSP_EVENT: usize = 12;
pub const PAGE: usize = 4096;

pub const TXF_CSUM_BLANK: u16 = 1 << 0;
pub const TXF_DATA_VALIDATED: u16 = 1 << 1;
pub const TXF_MORE_DATA: u16 = 1 << 2;
pub const TXF_EXTRA_INFO: u16 = 1 << 3;

pub const RXF_DATA_VALIDATED: u16 = 1 << 0;
pub const RXF_CSUM_BLANK: u16 = 1 << 1;
pub const RXF_MORE_DATA: u16 = 1 << 2;
pub const RXF_EXTRA_INFO: u16 = 1 << 3;

pub const EXTRA_TYPE_GSO: u8 = 1;
pub const EXTRA_TYPE_MCAST_ADD: u8 = 2;
pub const EXTRA_TYPE_MCAST_DEL: u8 = 3;
pub const EXTRA_FLAG_MORE: u8 = 1;
pub const GSO_TYPE_TCPV4: u8 = 1;
pub const GSO_TYPE_TCPV6: u8 = 2;

pub const RSP_OKAY: i16 = 0;
pub const RSP_ERROR: i16 = -1;
pub const RSP_NULL: i16 = 1;

/// Offset of TX slot `idx` (free-running index) in its ring page.
pub fn tx_slot_off(idx: u32) -> usize {
    RING_HDR + TX_SLOT * (idx % TX_RING_SIZE) as usize
}

/// Offset of RX slot `idx` in its ring page.
pub fn rx_slot_off(idx: u32) -> usize {
    RING_HDR + RX_SLOT * (idx % RX_RING_SIZE) as usize
}

fn u16_at(b: &[u8], i: usize) -> u16 {
    u16::from_le_bytes([b[i], b[i + 1]])
}

/// `netif_tx_request`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TxRequest {
    pub gref: u32,
    pub offset: u16,
    pub flags: u16,
    pub id: u16,
    pub size: u16,
}

impl TxRequest {
    pub fn decode(b: &[u8; TX_SLOT]) -> TxRequest {
        TxRequest {
            gref: u32::from_le_bytes([b[0], b[1], b[2], b[3]]),
            offset: u16_at(b, 4),
            flags: u16_at(b, 6),
            id: u16_at(b, 8),
            size: u16_at(b, 10),
        }
    }

    pub fn encode(&self) -> [u8; TX_SLOT] {
        let mut b = [0u8; TX_SLOT];
        b[0..4].copy_from_slice(&self.gref.to_le_bytes());
        b[4..6].copy_from_slice(&self.offset.to_le_bytes());
        b[6..8].copy_from_slice(&self.flags.to_le_bytes());
        b[8..10].copy_from_slice(&self.id.to_le_bytes());
        b[10..12].copy_from_slice(&self.size.to_le_bytes());
        b
    }
}

/// A GSO extra-info slot (`netif_extra_info`, type GSO), as it sits in a TX or RX slot.
pub fn gso_extra(size: u16, ty: u8, more: bool) -> [u8; 8] {
    let s = size.to_le_bytes();
    [EXTRA_TYPE_GSO, u8::from(more), s[0], s[1], ty, 0, 0, 0]
}

/// A `netif_tx_response` (id, status), padded to the TX slot.
pub fn tx_response(id: u16, status: i16) -> [u8; TX_SLOT] {
    let mut b = [0u8; TX_SLOT];
    b[0..2].copy_from_slice(&id.to_le_bytes());
    b[2..4].copy_from_slice(&status.to_le_bytes());
    b
}

/// A `netif_rx_response`.
pub fn rx_response(id: u16, offset: u16, flags: u16, status: i16) -> [u8; RX_SLOT] {
    let mut b = [0u8; RX_SLOT];
    b[0..2].copy_from_slice(&id.to_le_bytes());
    b[2..4].copy_from_slice(&offset.to_le_bytes());
    b[4..6].copy_from_slice(&flags.to_le_bytes());
    b[6..8].copy_from_slice(&status.to_le_bytes());
    b
}

/// A `netif_rx_request`: (id, gref).
pub fn rx_request(b: &[u8; RX_SLOT]) -> (u16, u32) {
    (u16_at(b, 0), u32::from_le_bytes([b[4], b[5], b[6], b[7]]))
}

/// One data slot of a TX packet: `len` bytes at `offset` in grant `gref`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fragment {
    pub gref: u32,
    pub offset: u16,
    pub len: u16,
}

/// A TX packet that passed the slot rules: where its bytes are and what it asks for.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TxPlan {
    pub frags: Vec<Fragment>,
    /// Bytes in the packet (the first request's size).
    pub len: usize,
    /// The first request's NETTXF_* flags.
    pub flags: u16,
    /// From a GSO extra: the segment kind and size.
    pub gso: Option<(GsoKind, u16)>,
}

/// One run of TX slots read from the ring: the responses it needs (one per slot: the
/// request id, or `None` for an extra-info slot) and what it was.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TxRun {
    pub ids: Vec<Option<u16>>,
    pub packet: Result<TxPlan, DropReason>,
}

/// What the slots from the consumer index on hold.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TxParse {
    /// A whole run of slots (a packet, or one to drop and answer with errors).
    Run(TxRun),
    /// The run goes on past the producer index: wait for the rest.
    Incomplete,
    /// A run longer than the ring: the frontend is broken.
    RingBroken,
}

/// Reads one run of TX slots. `slot(i)` is the i-th slot from the consumer index,
/// `avail` how many the frontend produced (at most the ring size). The whole run is
/// consumed even when the packet is refused, so the next one starts where it should.
pub fn parse_tx(slot: impl Fn(u32) -> [u8; TX_SLOT], avail: u32) -> TxParse {
    let avail = avail.min(TX_RING_SIZE);
    if avail == 0 {
        return TxParse::Incomplete;
    }
    // A run that goes on past the producer: wait, unless it already fills the ring.
    let need_more = || {
        if avail >= TX_RING_SIZE {
            TxParse::RingBroken
        } else {
            TxParse::Incomplete
        }
    };
    let first = TxRequest::decode(&slot(0));
    let mut used = 1u32;
    let mut ids = vec![Some(first.id)];
    let mut err: Option<DropReason> = None;
    let mut gso = None;
    if first.flags & TXF_EXTRA_INFO != 0 {
        loop {
            if used >= avail {
                return need_more();
            }
            let e = slot(used);
            used += 1;
            ids.push(None);
            let (ty, flags) = (e[0], e[1]);
            match ty {
                EXTRA_TYPE_GSO if gso.is_some() => err = err.or(Some(DropReason::XenBadExtra)),
                EXTRA_TYPE_GSO => {
                    let size = u16_at(&e, 2);
                    let kind = match e[4] {
                        GSO_TYPE_TCPV4 => Some(GsoKind::TcpV4),
                        GSO_TYPE_TCPV6 => Some(GsoKind::TcpV6),
                        _ => None,
                    };
                    match kind {
                        None => err = err.or(Some(DropReason::XenBadGsoType)),
                        Some(_) if size == 0 => err = err.or(Some(DropReason::GsoSizeZero)),
                        Some(k) => gso = Some((k, size)),
                    }
                }
                EXTRA_TYPE_MCAST_ADD | EXTRA_TYPE_MCAST_DEL => {}
                _ => err = err.or(Some(DropReason::XenBadExtra)),
            }
            if flags & EXTRA_FLAG_MORE == 0 {
                break;
            }
        }
    }
    let mut frags = vec![(first.gref, first.offset, first.size)];
    let mut more = first.flags & TXF_MORE_DATA != 0;
    while more {
        if used >= avail {
            return need_more();
        }
        let r = TxRequest::decode(&slot(used));
        used += 1;
        ids.push(Some(r.id));
        frags.push((r.gref, r.offset, r.size));
        more = r.flags & TXF_MORE_DATA != 0;
    }
    let packet = match err {
        Some(e) => Err(e),
        None => check_frags(&frags, first.flags, gso),
    };
    TxParse::Run(TxRun { ids, packet })
}

/// The sizes rules (Linux netback's `xenvif_count_requests`): at most 18 data
/// slots, none crossing its page, the later slots adding up to no more than the
/// first's size (the packet's), and the first keeping the rest.
fn check_frags(
    raw: &[(u32, u16, u16)],
    flags: u16,
    gso: Option<(GsoKind, u16)>,
) -> Result<TxPlan, DropReason> {
    if raw.len() > NR_SLOTS_MIN {
        return Err(DropReason::XenTooManySlots);
    }
    let total = usize::from(raw[0].2);
    let rest: usize = raw[1..].iter().map(|f| usize::from(f.2)).sum();
    if rest > total {
        return Err(DropReason::XenSlotsMismatch);
    }
    let first_len = total - rest;
    let mut frags = Vec::with_capacity(raw.len());
    for (i, &(gref, offset, size)) in raw.iter().enumerate() {
        let len = if i == 0 { first_len } else { usize::from(size) };
        if usize::from(offset) + len > PAGE {
            return Err(DropReason::XenSlotsMismatch);
        }
        if len > 0 {
            frags.push(Fragment {
                gref,
                offset,
                len: len as u16,
            });
        }
    }
    if total < crate::l2::ETH_HDR_LEN {
        return Err(DropReason::TooShort);
    }
    if gso.is_some() && flags & TXF_CSUM_BLANK == 0 {
        return Err(DropReason::XenGsoWithoutCsumBlank);
    }
    Ok(TxPlan {
        frags,
        len: total,
        flags,
        gso,
    })
}

/// The virtio_net_hdr a netfront's packet stands for: `csum_blank` is a partial
/// checksum whose offsets come from the headers (netif carries none), `data_validated`
/// a checked one, the GSO extra a gso type and size. `frame` is our copy of its bytes.
pub fn tx_header(plan: &TxPlan, frame: &[u8]) -> Result<VirtioNetHdr, DropReason> {
    let mut hdr = VirtioNetHdr::default();
    if plan.flags & TXF_CSUM_BLANK != 0 {
        let h = parse::parse_bytes(frame).map_err(|_| DropReason::BadHeaders)?;
        let csum_offset = match h.l4 {
            L4::Tcp => 16,
            L4::Udp => 6,
            L4::Other(_) => return Err(DropReason::BadHeaders),
        };
        hdr.flags = F_NEEDS_CSUM;
        hdr.csum_start = u16::try_from(h.l4_off).map_err(|_| DropReason::BadHeaders)?;
        hdr.csum_offset = csum_offset;
        if let Some((kind, size)) = plan.gso {
            hdr.gso = GsoType::new(kind);
            hdr.gso_size = size;
            hdr.hdr_len = u16::try_from(h.hdr_len()).map_err(|_| DropReason::BadHeaders)?;
        }
    } else if plan.flags & TXF_DATA_VALIDATED != 0 {
        hdr.flags = F_DATA_VALID;
    }
    Ok(hdr)
}

/// One RX slot of a frame for a netfront: a run of its bytes, or the GSO extra.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RxSlot {
    Data { at: usize, len: usize },
    Gso,
}

/// The RX slots a `len`-byte frame takes: page-sized runs of its bytes, with the GSO
/// extra right after the first (netif.h: "Fragment 1, Extra 1, Fragment N").
pub fn rx_slots(len: usize, gso: bool, out: &mut Vec<RxSlot>) {
    out.clear();
    let mut at = 0;
    loop {
        let n = (len - at).min(PAGE);
        out.push(RxSlot::Data { at, len: n });
        if at == 0 && gso {
            out.push(RxSlot::Gso);
        }
        at += n;
        if at >= len {
            break;
        }
    }
}

/// RX flags of the first slot for a frame with header `hdr`.
pub fn rx_flags(hdr: &VirtioNetHdr) -> u16 {
    let mut f = 0;
    if hdr.needs_csum() {
        f |= RXF_CSUM_BLANK | RXF_DATA_VALIDATED;
    } else if hdr.flags & F_DATA_VALID != 0 {
        f |= RXF_DATA_VALIDATED;
    }
    f
}

/// The netif GSO type of a gso kind a netfront can take.
pub fn gso_type(kind: GsoKind) -> Option<u8> {
    match kind {
        GsoKind::TcpV4 => Some(GSO_TYPE_TCPV4),
        GsoKind::TcpV6 => Some(GSO_TYPE_TCPV6),
        _ => None,
    }
}

/// What a netfront wrote about itself (its `feature-*` keys), read at connect.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FrontFeatures {
    pub sg: bool,
    pub gso_tcpv4: bool,
    pub gso_tcpv6: bool,
    /// `feature-no-csum-offload`: it cannot take IPv4 partial checksums.
    pub no_csum_offload: bool,
    pub ipv6_csum_offload: bool,
}

/// What a netfront accepts from gsonet, as `Caps`: a partial checksum only if it
/// takes them for IPv4 and IPv6 alike (Caps has one bit for both), TSO only with
/// scatter-gather and checksums, never UDP GSO (netif has no UDP type). `tso`, `csum`:
/// the operator's switches for this vif.
pub fn rx_caps(f: FrontFeatures, csum: bool, tso: bool) -> Caps {
    let csum = csum && !f.no_csum_offload && f.ipv6_csum_offload;
    let tso = tso && csum && f.sg;
    Caps {
        csum,
        tso4: tso && f.gso_tcpv4,
        tso6: tso && f.gso_tcpv6,
        ..Caps::default()
    }
}

/// What gsonet takes from a netfront: what it advertised.
pub fn tx_caps(csum: bool, tso: bool) -> Caps {
    Caps {
        csum,
        tso4: csum && tso,
        tso6: csum && tso,
        ..Caps::default()
    }
}

#[cfg(test)]
mod tests;

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

/// Bytes from address `addr` to the next page boundary (0 on one).
pub fn to_page(addr: usize) -> usize {
    addr.wrapping_neg() & (PAGE - 1)
}

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

/// An extra-info slot's 8 bytes as they sit in a 12-byte TX slot.
pub fn tx_extra_slot(extra: [u8; 8]) -> [u8; TX_SLOT] {
    let mut b = [0u8; TX_SLOT];
    b[..8].copy_from_slice(&extra);
    b
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

/// A TX packet that passed the slot rules: what it asks for. Its fragments are
/// where `parse_tx` put them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TxPlan {
    /// Bytes in the packet (the first request's size).
    pub len: usize,
    /// The first request's NETTXF_* flags.
    pub flags: u16,
    /// From a GSO extra: the segment kind and size.
    pub gso: Option<(GsoKind, u16)>,
}

/// One run of TX slots read from the ring: how many slots it took (their responses:
/// the ids `parse_tx` appended) and what it was.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TxRun {
    pub slots: u32,
    pub packet: Result<TxPlan, DropReason>,
}

/// What the slots from the consumer index on hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
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
/// For a run, appends to `ids` what each slot is answered with (the request id, or
/// `None` for an extra-info slot) and, for an accepted packet, its data fragments to
/// `frags`; for anything else, leaves both as they were. Nothing is allocated once
/// the vectors have room (a batch's worth).
pub fn parse_tx(
    slot: impl Fn(u32) -> [u8; TX_SLOT],
    avail: u32,
    ids: &mut Vec<Option<u16>>,
    frags: &mut Vec<Fragment>,
) -> TxParse {
    let (ids0, frags0) = (ids.len(), frags.len());
    let out = parse_run(slot, avail, ids, frags);
    match out {
        TxParse::Run(TxRun { packet: Ok(_), .. }) => {}
        TxParse::Run(_) => frags.truncate(frags0),
        TxParse::Incomplete | TxParse::RingBroken => {
            ids.truncate(ids0);
            frags.truncate(frags0);
        }
    }
    out
}

fn parse_run(
    slot: impl Fn(u32) -> [u8; TX_SLOT],
    avail: u32,
    ids: &mut Vec<Option<u16>>,
    frags: &mut Vec<Fragment>,
) -> TxParse {
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
    ids.push(Some(first.id));
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
    // The data slots as the netfront wrote them (`len`: the request's size), fixed
    // up by check_frags.
    let at = frags.len();
    let raw = |r: &TxRequest| Fragment {
        gref: r.gref,
        offset: r.offset,
        len: r.size,
    };
    frags.push(raw(&first));
    let mut more = first.flags & TXF_MORE_DATA != 0;
    while more {
        if used >= avail {
            return need_more();
        }
        let r = TxRequest::decode(&slot(used));
        used += 1;
        ids.push(Some(r.id));
        frags.push(raw(&r));
        more = r.flags & TXF_MORE_DATA != 0;
    }
    let packet = match err {
        Some(e) => Err(e),
        None => check_frags(frags, at, first.flags, gso),
    };
    TxParse::Run(TxRun {
        slots: used,
        packet,
    })
}

/// The sizes rules (Linux netback's `xenvif_count_requests`): at most 18 data
/// slots, none crossing its page, the later slots adding up to no more than the
/// first's size (the packet's), and the first keeping the rest. `frags[at..]` are
/// the slots as written; on success they become the packet's fragments (the first
/// slot's length fixed, empty ones left out).
fn check_frags(
    frags: &mut Vec<Fragment>,
    at: usize,
    flags: u16,
    gso: Option<(GsoKind, u16)>,
) -> Result<TxPlan, DropReason> {
    let raw = &mut frags[at..];
    if raw.len() > NR_SLOTS_MIN {
        return Err(DropReason::XenTooManySlots);
    }
    let total = usize::from(raw[0].len);
    let rest: usize = raw[1..].iter().map(|f| usize::from(f.len)).sum();
    if rest > total {
        return Err(DropReason::XenSlotsMismatch);
    }
    // < 64 KiB: `total` is a u16.
    raw[0].len = (total - rest) as u16;
    if raw
        .iter()
        .any(|f| usize::from(f.offset) + usize::from(f.len) > PAGE)
    {
        return Err(DropReason::XenSlotsMismatch);
    }
    if total < crate::l2::ETH_HDR_LEN {
        return Err(DropReason::TooShort);
    }
    if gso.is_some() && flags & TXF_CSUM_BLANK == 0 {
        return Err(DropReason::XenGsoWithoutCsumBlank);
    }
    // Empty slots carry nothing to copy.
    let mut keep = at;
    for i in at..frags.len() {
        if frags[i].len > 0 {
            frags[keep] = frags[i];
            keep += 1;
        }
    }
    frags.truncate(keep);
    Ok(TxPlan {
        len: total,
        flags,
        gso,
    })
}

/// The virtio_net_hdr a netfront's packet stands for: `csum_blank` is a partial
/// checksum whose offsets come from the headers (netif carries none), `data_validated`
/// a checked one, the GSO extra a gso type and size. `frame` is our copy of its bytes
/// (in runs, split anywhere).
pub fn tx_header(plan: &TxPlan, frame: &[&[u8]]) -> Result<VirtioNetHdr, DropReason> {
    let mut hdr = VirtioNetHdr::default();
    if plan.flags & TXF_CSUM_BLANK != 0 {
        let h = parse::parse_headers(frame).map_err(|_| DropReason::BadHeaders)?;
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
mod tests {
    //! The slot rules against hand-made rings, and proptests: any run of slots is either
    //! refused with a reason or yields fragments that add up to the packet; the header a
    //! csum_blank packet stands for points where etherparse finds the L4 header.

    use super::*;
    use crate::testkit::frames::{build, FrameSpec};
    use proptest::prelude::*;

    fn req(gref: u32, offset: u16, flags: u16, id: u16, size: u16) -> [u8; TX_SLOT] {
        TxRequest {
            gref,
            offset,
            flags,
            id,
            size,
        }
        .encode()
    }

    fn extra(bytes: [u8; 8]) -> [u8; TX_SLOT] {
        tx_extra_slot(bytes)
    }

    fn parse(slots: &[[u8; TX_SLOT]]) -> TxParse {
        let (mut ids, mut frags) = (vec![None], Vec::new());
        let p = parse_tx(
            |i| slots[i as usize],
            slots.len() as u32,
            &mut ids,
            &mut frags,
        );
        if !matches!(p, TxParse::Run(_)) {
            assert_eq!((ids.len(), frags.len()), (1, 0), "left as they were");
        }
        p
    }

    /// A packet as a test looks at it: its plan and its fragments.
    #[derive(Debug, PartialEq, Eq)]
    struct Planned {
        frags: Vec<Fragment>,
        len: usize,
        flags: u16,
        gso: Option<(GsoKind, u16)>,
    }

    struct Parsed {
        ids: Vec<Option<u16>>,
        packet: Result<Planned, DropReason>,
    }

    fn run(slots: &[[u8; TX_SLOT]]) -> Parsed {
        // What was in the vectors before stays, the run's comes after it.
        let before = Fragment {
            gref: 99,
            offset: 0,
            len: 1,
        };
        let (mut ids, mut frags) = (vec![Some(77)], vec![before]);
        match parse_tx(
            |i| slots[i as usize],
            slots.len() as u32,
            &mut ids,
            &mut frags,
        ) {
            TxParse::Run(r) => {
                assert_eq!((ids[0], frags[0]), (Some(77), before));
                assert_eq!(ids.len() - 1, r.slots as usize);
                if r.packet.is_err() {
                    assert_eq!(frags.len(), 1, "a refused packet leaves no fragments");
                }
                Parsed {
                    ids: ids[1..].to_vec(),
                    packet: r.packet.map(|p| Planned {
                        frags: frags[1..].to_vec(),
                        len: p.len,
                        flags: p.flags,
                        gso: p.gso,
                    }),
                }
            }
            other => panic!("expected a run, got {other:?}"),
        }
    }

    #[test]
    fn a_packet_in_three_slots_with_a_gso_extra() {
        let slots = [
            req(
                10,
                100,
                TXF_CSUM_BLANK | TXF_MORE_DATA | TXF_EXTRA_INFO,
                1,
                9000,
            ),
            extra(gso_extra(1448, GSO_TYPE_TCPV4, false)),
            req(11, 0, TXF_MORE_DATA, 2, 4096),
            req(12, 0, 0, 3, 1000),
        ];
        let r = run(&slots);
        assert_eq!(r.ids, vec![Some(1), None, Some(2), Some(3)]);
        let p = r.packet.unwrap();
        assert_eq!(p.len, 9000);
        assert_eq!(p.gso, Some((GsoKind::TcpV4, 1448)));
        let lens: Vec<u16> = p.frags.iter().map(|f| f.len).collect();
        assert_eq!(lens, vec![9000 - 4096 - 1000, 4096, 1000]);
        assert_eq!((p.frags[0].gref, p.frags[0].offset), (10, 100));
    }

    #[test]
    fn a_run_past_the_producer_waits_and_a_full_ring_of_it_is_broken() {
        let slots = [
            req(1, 0, TXF_MORE_DATA, 1, 3000),
            req(2, 0, TXF_MORE_DATA, 2, 1000),
        ];
        assert_eq!(parse(&slots), TxParse::Incomplete);
        let endless = vec![req(1, 0, TXF_MORE_DATA, 1, 100); TX_RING_SIZE as usize];
        assert_eq!(parse(&endless), TxParse::RingBroken);
        assert_eq!(parse(&[]), TxParse::Incomplete);
        // An extra-info chain that runs past the producer waits too.
        let ex = [
            req(1, 0, TXF_EXTRA_INFO, 1, 100),
            extra([1, EXTRA_FLAG_MORE, 0, 1, 1, 0, 0, 0]),
        ];
        assert_eq!(parse(&ex), TxParse::Incomplete);
    }

    #[test]
    fn bad_runs_are_refused_whole_with_their_reason() {
        let cases: Vec<(Vec<[u8; TX_SLOT]>, DropReason)> = vec![
            // 19 data slots.
            (
                (0..19)
                    .map(|i| {
                        req(
                            i,
                            0,
                            if i < 18 { TXF_MORE_DATA } else { 0 },
                            i as u16,
                            if i == 0 { 1900 } else { 100 },
                        )
                    })
                    .collect(),
                DropReason::XenTooManySlots,
            ),
            // Later slots hold more than the packet.
            (
                vec![req(1, 0, TXF_MORE_DATA, 1, 100), req(2, 0, 0, 2, 200)],
                DropReason::XenSlotsMismatch,
            ),
            // A slot running past its page.
            (vec![req(1, 4000, 0, 1, 200)], DropReason::XenSlotsMismatch),
            (
                vec![req(1, 0, TXF_MORE_DATA, 1, 5000), req(2, 100, 0, 2, 4000)],
                DropReason::XenSlotsMismatch,
            ),
            // GSO extras: size 0, unknown type, twice; an unknown extra.
            (
                vec![
                    req(1, 0, TXF_CSUM_BLANK | TXF_EXTRA_INFO, 1, 100),
                    extra(gso_extra(0, GSO_TYPE_TCPV4, false)),
                ],
                DropReason::GsoSizeZero,
            ),
            (
                vec![
                    req(1, 0, TXF_CSUM_BLANK | TXF_EXTRA_INFO, 1, 100),
                    extra(gso_extra(1400, 9, false)),
                ],
                DropReason::XenBadGsoType,
            ),
            (
                vec![
                    req(1, 0, TXF_CSUM_BLANK | TXF_EXTRA_INFO, 1, 100),
                    extra(gso_extra(1400, GSO_TYPE_TCPV4, true)),
                    extra(gso_extra(1400, GSO_TYPE_TCPV6, false)),
                ],
                DropReason::XenBadExtra,
            ),
            (
                vec![
                    req(1, 0, TXF_EXTRA_INFO, 1, 100),
                    extra([7, 0, 0, 0, 0, 0, 0, 0]),
                ],
                DropReason::XenBadExtra,
            ),
            (
                vec![
                    req(1, 0, TXF_EXTRA_INFO, 1, 100),
                    extra([0, 0, 0, 0, 0, 0, 0, 0]),
                ],
                DropReason::XenBadExtra,
            ),
            // GSO without csum_blank; a runt.
            (
                vec![
                    req(1, 0, TXF_EXTRA_INFO, 1, 100),
                    extra(gso_extra(1400, GSO_TYPE_TCPV4, false)),
                ],
                DropReason::XenGsoWithoutCsumBlank,
            ),
            (vec![req(1, 0, 0, 1, 13)], DropReason::TooShort),
        ];
        for (slots, reason) in cases {
            let r = run(&slots);
            assert_eq!(r.packet, Err(reason), "{slots:?}");
            assert_eq!(
                r.ids.len(),
                slots.len(),
                "the whole run is consumed: {reason:?}"
            );
        }
    }

    #[test]
    fn responses_and_extras_have_the_netif_layout() {
        assert_eq!(
            tx_response(0x1234, RSP_ERROR)[..4],
            [0x34, 0x12, 0xff, 0xff]
        );
        assert_eq!(
            rx_response(5, 0, RXF_MORE_DATA, 4096),
            [5, 0, 0, 0, 4, 0, 0, 0x10]
        );
        assert_eq!(
            gso_extra(1448, GSO_TYPE_TCPV6, false),
            [1, 0, 0xa8, 0x05, 2, 0, 0, 0]
        );
        assert_eq!(
            rx_request(&[7, 0, 0, 0, 0x44, 0x33, 0x22, 0x11]),
            (7, 0x1122_3344)
        );
        assert_eq!((tx_slot_off(0), tx_slot_off(257)), (64, 76));
        assert_eq!(rx_slot_off(255), 64 + 8 * 255);
        // Every slot of both rings fits its page.
        assert!(tx_slot_off(TX_RING_SIZE - 1) + TX_SLOT <= PAGE);
        assert!(rx_slot_off(RX_RING_SIZE - 1) + RX_SLOT <= PAGE);
    }

    #[test]
    fn rx_frames_take_page_slots_with_the_gso_extra_second() {
        let mut s = Vec::new();
        rx_slots(9000, true, &mut s);
        assert_eq!(
            s,
            vec![
                RxSlot::Data { at: 0, len: 4096 },
                RxSlot::Gso,
                RxSlot::Data {
                    at: 4096,
                    len: 4096
                },
                RxSlot::Data { at: 8192, len: 808 },
            ]
        );
        rx_slots(60, false, &mut s);
        assert_eq!(s, vec![RxSlot::Data { at: 0, len: 60 }]);
        rx_slots(65535 + 14, true, &mut s);
        assert!(s.len() <= NR_SLOTS_MIN + 1);
    }

    #[test]
    fn netfront_features_map_to_caps() {
        let all = FrontFeatures {
            sg: true,
            gso_tcpv4: true,
            gso_tcpv6: true,
            no_csum_offload: false,
            ipv6_csum_offload: true,
        };
        let c = rx_caps(all, true, true);
        assert!(c.csum && c.tso4 && c.tso6 && !c.ufo && !c.uso4 && !c.uso6);
        let no4 = rx_caps(
            FrontFeatures {
                gso_tcpv4: false,
                ..all
            },
            true,
            true,
        );
        assert!(!no4.tso4 && no4.tso6);
        let nosg = rx_caps(FrontFeatures { sg: false, ..all }, true, true);
        assert!(nosg.csum && !nosg.tso4 && !nosg.tso6);
        let nocsum = rx_caps(
            FrontFeatures {
                no_csum_offload: true,
                ..all
            },
            true,
            true,
        );
        assert_eq!(nocsum, Caps::default());
        assert!(
            !rx_caps(
                FrontFeatures {
                    ipv6_csum_offload: false,
                    ..all
                },
                true,
                true
            )
            .csum
        );
        assert!(!rx_caps(all, true, false).tso4);
        assert_eq!(rx_caps(all, false, true), Caps::default());
        assert!(tx_caps(true, true).accepts(GsoType::new(GsoKind::TcpV6)));
        assert!(!tx_caps(true, true).accepts(GsoType::new(GsoKind::UdpL4)));
        assert!(!tx_caps(false, true).csum);
    }

    #[test]
    fn rx_flags_follow_the_header() {
        let mut h = VirtioNetHdr {
            flags: F_NEEDS_CSUM,
            ..VirtioNetHdr::default()
        };
        assert_eq!(rx_flags(&h), RXF_CSUM_BLANK | RXF_DATA_VALIDATED);
        h.flags = F_DATA_VALID;
        assert_eq!(rx_flags(&h), RXF_DATA_VALIDATED);
        h.flags = 0;
        assert_eq!(rx_flags(&h), 0);
    }

    fn plan_of(flags: u16, gso: Option<(GsoKind, u16)>, len: usize) -> TxPlan {
        TxPlan { len, flags, gso }
    }

    proptest! {
        /// Whatever the slots say, a run is consumed whole (ids for every slot up to the
        /// end of its chain), and an accepted packet's fragments stay within their pages,
        /// number at most 18 and add up to its size.
        #[test]
        fn any_slots_parse_into_a_consistent_run(
            raw in proptest::collection::vec((any::<u32>(), 0u16..4200, 0u16..16, any::<u16>(), 0u16..9000), 1..24),
            extras in proptest::collection::vec(any::<[u8; 8]>(), 0..3),
        ) {
            let mut slots: Vec<[u8; TX_SLOT]> = Vec::new();
            for (i, (g, o, f, id, s)) in raw.iter().enumerate() {
                slots.push(req(*g, *o, *f, *id, *s));
                if i == 0 {
                    slots.extend(extras.iter().map(|e| extra(*e)));
                }
            }
            match parse(&slots) {
                TxParse::Run(_) => {
                    let r = run(&slots);
                    prop_assert!(r.ids.len() <= slots.len());
                    if let Ok(p) = r.packet {
                        prop_assert!(p.frags.len() <= NR_SLOTS_MIN);
                        let sum: usize = p.frags.iter().map(|f| usize::from(f.len)).sum();
                        prop_assert_eq!(sum, p.len);
                        for f in &p.frags {
                            prop_assert!(usize::from(f.offset) + usize::from(f.len) <= PAGE);
                        }
                        if let Some((_, size)) = p.gso {
                            prop_assert!(size > 0);
                            prop_assert!(p.flags & TXF_CSUM_BLANK != 0);
                        }
                    }
                }
                TxParse::Incomplete => prop_assert!(slots.len() < TX_RING_SIZE as usize),
                TxParse::RingBroken => prop_assert!(slots.len() >= TX_RING_SIZE as usize),
            }
        }

        /// A csum_blank packet's header puts the checksum where etherparse finds the TCP
        /// or UDP header, and a GSO packet's hdr_len covers exactly the headers.
        #[test]
        fn csum_blank_points_at_the_l4_header(v6: bool, tcp: bool, n in 0usize..3000, mss in 500u16..1500) {
            let spec = FrameSpec { payload: vec![3; n], v6, tcp, ..FrameSpec::default() };
            let (f, _) = build(&spec);
            let kind = if v6 { GsoKind::TcpV6 } else { GsoKind::TcpV4 };
            let gso = (tcp && n > usize::from(mss)).then_some((kind, mss));
            let h = tx_header(&plan_of(TXF_CSUM_BLANK, gso, f.len()), &[&f]).unwrap();
            let sliced = etherparse::SlicedPacket::from_ethernet(&f).unwrap();
            let payload_len = match sliced.transport {
                Some(etherparse::TransportSlice::Tcp(t)) => t.payload().len(),
                Some(etherparse::TransportSlice::Udp(u)) => u.payload().len(),
                _ => unreachable!(),
            };
            let l4_hdr = if tcp { f.len() - payload_len - usize::from(h.csum_start) } else { 8 };
            prop_assert_eq!(usize::from(h.csum_start) + l4_hdr + payload_len, f.len());
            prop_assert_eq!(h.csum_offset, if tcp { 16 } else { 6 });
            prop_assert!(h.needs_csum());
            if gso.is_some() {
                prop_assert_eq!(usize::from(h.hdr_len), f.len() - payload_len);
                prop_assert_eq!(h.gso_size, mss);
            } else {
                prop_assert!(!h.gso.is_gso());
            }
        }
    }

    #[test]
    fn data_validated_and_blank_headers_on_other_protocols() {
        let (f, _) = build(&FrameSpec::tcp(false, 100));
        let h = tx_header(&plan_of(TXF_DATA_VALIDATED, None, f.len()), &[&f]).unwrap();
        assert_eq!(h.flags, F_DATA_VALID);
        assert_eq!(
            tx_header(&plan_of(0, None, f.len()), &[&f]).unwrap(),
            VirtioNetHdr::default()
        );
        // csum_blank on something that is not TCP or UDP (an ARP frame) is refused.
        let mut arp = vec![0xffu8; 6];
        arp.extend_from_slice(&[2, 0, 0, 0, 0, 1, 0x08, 0x06]);
        arp.resize(42, 0);
        assert_eq!(
            tx_header(&plan_of(TXF_CSUM_BLANK, None, arp.len()), &[&arp]),
            Err(DropReason::BadHeaders)
        );
    }
}

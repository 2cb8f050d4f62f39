//! virtio-net feature bits: what a port offers (after the operator's masks), the
//! dependency rules between bits, and the typed `Caps` the rest of gsonet works with.

use serde::{Deserialize, Serialize};
use virtio_bindings::virtio_config::{VIRTIO_F_IN_ORDER, VIRTIO_F_RING_PACKED, VIRTIO_F_VERSION_1};
use virtio_bindings::virtio_net::*;
use virtio_bindings::virtio_ring::{VIRTIO_RING_F_EVENT_IDX, VIRTIO_RING_F_INDIRECT_DESC};

use crate::vnet_hdr::{GsoKind, GsoType, HDR_LEN, LEGACY_HDR_LEN};

const fn bit(b: u32) -> u64 {
    1u64 << b
}

/// vhost-user's own bit 30 (VHOST_USER_F_PROTOCOL_FEATURES) rides on the feature word.
pub const PROTOCOL_FEATURES: u64 = bit(30);
/// VHOST_F_LOG_ALL: while acked, the backend marks every page it writes in the
/// frontend's dirty log (live migration; the log comes with SET_LOG_BASE).
pub const LOG_ALL: u64 = bit(26);

pub const CSUM: u64 = bit(VIRTIO_NET_F_CSUM);
pub const GUEST_CSUM: u64 = bit(VIRTIO_NET_F_GUEST_CSUM);
pub const MTU: u64 = bit(VIRTIO_NET_F_MTU);
pub const MAC: u64 = bit(VIRTIO_NET_F_MAC);
pub const GUEST_TSO4: u64 = bit(VIRTIO_NET_F_GUEST_TSO4);
pub const GUEST_TSO6: u64 = bit(VIRTIO_NET_F_GUEST_TSO6);
pub const GUEST_ECN: u64 = bit(VIRTIO_NET_F_GUEST_ECN);
pub const GUEST_UFO: u64 = bit(VIRTIO_NET_F_GUEST_UFO);
pub const HOST_TSO4: u64 = bit(VIRTIO_NET_F_HOST_TSO4);
pub const HOST_TSO6: u64 = bit(VIRTIO_NET_F_HOST_TSO6);
pub const HOST_ECN: u64 = bit(VIRTIO_NET_F_HOST_ECN);
pub const HOST_UFO: u64 = bit(VIRTIO_NET_F_HOST_UFO);
pub const MRG_RXBUF: u64 = bit(VIRTIO_NET_F_MRG_RXBUF);
pub const STATUS: u64 = bit(VIRTIO_NET_F_STATUS);
pub const MQ: u64 = bit(VIRTIO_NET_F_MQ);
/// The guest announces itself (gratuitous ARP/NA) when the device asks it to, after a
/// migration. QEMU's virtio-net does the asking and keeps the control queue it needs.
pub const GUEST_ANNOUNCE: u64 = bit(VIRTIO_NET_F_GUEST_ANNOUNCE);
pub const GUEST_USO4: u64 = bit(VIRTIO_NET_F_GUEST_USO4);
pub const GUEST_USO6: u64 = bit(VIRTIO_NET_F_GUEST_USO6);
pub const HOST_USO: u64 = bit(VIRTIO_NET_F_HOST_USO);
pub const INDIRECT_DESC: u64 = bit(VIRTIO_RING_F_INDIRECT_DESC);
pub const EVENT_IDX: u64 = bit(VIRTIO_RING_F_EVENT_IDX);
pub const VERSION_1: u64 = bit(VIRTIO_F_VERSION_1);
/// VIRTIO_F_RING_PACKED: the queues are packed rings (`ring::packed`). Offered only on
/// a port with `packed=on`.
pub const RING_PACKED: u64 = bit(VIRTIO_F_RING_PACKED);
/// VIRTIO_F_IN_ORDER: the device uses every ring's buffers in the order they were
/// made available (docs/architecture.md, "In-order use"). Offered only on a port
/// with `in_order=on`.
pub const IN_ORDER: u64 = bit(VIRTIO_F_IN_ORDER);

const HOST_OFFLOADS: u64 = HOST_TSO4 | HOST_TSO6 | HOST_ECN | HOST_UFO | HOST_USO;
const GUEST_OFFLOADS: u64 =
    GUEST_TSO4 | GUEST_TSO6 | GUEST_ECN | GUEST_UFO | GUEST_USO4 | GUEST_USO6;

/// Everything gsonet can do, before masks.
pub const ALL_OFFERED: u64 = VERSION_1
    | CSUM
    | GUEST_CSUM
    | HOST_OFFLOADS
    | GUEST_OFFLOADS
    | MRG_RXBUF
    | EVENT_IDX
    | INDIRECT_DESC
    | MAC
    | MTU
    | STATUS
    | MQ
    | GUEST_ANNOUNCE
    | LOG_ALL;

/// The operator's per-port switches. Each one removes bits from the offer; `offer`
/// then removes whatever lost the bit it depends on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FeatureMask {
    /// All checksum and segmentation offloads, both directions.
    pub offloads: bool,
    /// CSUM: the guest may hand us partially checksummed frames (and so any HOST_* GSO).
    pub csum: bool,
    /// GUEST_CSUM: we may hand the guest partially checksummed frames (and any GUEST_* GSO).
    pub guest_csum: bool,
    /// TCP segmentation both ways (HOST_TSO4/6, GUEST_TSO4/6 and their ECN bits).
    pub tso: bool,
    /// ECN-marked TCP segmentation both ways.
    pub ecn: bool,
    /// UDP fragmentation offload both ways.
    pub ufo: bool,
    /// UDP segmentation offload both ways.
    pub uso: bool,
    pub mrg_rxbuf: bool,
    pub event_idx: bool,
    pub indirect_desc: bool,
}

impl Default for FeatureMask {
    fn default() -> Self {
        FeatureMask {
            offloads: true,
            csum: true,
            guest_csum: true,
            tso: true,
            ecn: true,
            ufo: true,
            uso: true,
            mrg_rxbuf: true,
            event_idx: true,
            indirect_desc: true,
        }
    }
}

impl FeatureMask {
    /// Names accepted by `--port ...,NAME=on|off` and `gsonet ctl`.
    pub const NAMES: &'static [&'static str] = &[
        "offloads",
        "csum",
        "guest_csum",
        "tso",
        "ecn",
        "ufo",
        "uso",
        "mrg_rxbuf",
        "event_idx",
        "indirect_desc",
    ];

    /// Sets one switch by name; false if the name is unknown.
    pub fn set(&mut self, name: &str, on: bool) -> bool {
        let field = match name {
            "offloads" => &mut self.offloads,
            "csum" => &mut self.csum,
            "guest_csum" => &mut self.guest_csum,
            "tso" => &mut self.tso,
            "ecn" => &mut self.ecn,
            "ufo" => &mut self.ufo,
            "uso" => &mut self.uso,
            "mrg_rxbuf" => &mut self.mrg_rxbuf,
            "event_idx" => &mut self.event_idx,
            "indirect_desc" => &mut self.indirect_desc,
            _ => return false,
        };
        *field = on;
        true
    }

    fn removed_bits(&self) -> u64 {
        let mut off = 0;
        if !self.offloads {
            off |= CSUM | GUEST_CSUM | HOST_OFFLOADS | GUEST_OFFLOADS;
        }
        if !self.csum {
            off |= CSUM;
        }
        if !self.guest_csum {
            off |= GUEST_CSUM;
        }
        if !self.tso {
            off |= HOST_TSO4 | HOST_TSO6 | GUEST_TSO4 | GUEST_TSO6;
        }
        if !self.ecn {
            off |= HOST_ECN | GUEST_ECN;
        }
        if !self.ufo {
            off |= HOST_UFO | GUEST_UFO;
        }
        if !self.uso {
            off |= HOST_USO | GUEST_USO4 | GUEST_USO6;
        }
        if !self.mrg_rxbuf {
            off |= MRG_RXBUF;
        }
        if !self.event_idx {
            off |= EVENT_IDX;
        }
        if !self.indirect_desc {
            off |= INDIRECT_DESC;
        }
        off
    }
}

/// Drops every bit whose prerequisite is missing (virtio spec 5.1.3.1):
/// HOST_* offloads need CSUM, GUEST_* need GUEST_CSUM, ECN needs TSO in its direction.
pub fn with_dependencies(mut bits: u64) -> u64 {
    if bits & CSUM == 0 {
        bits &= !HOST_OFFLOADS;
    }
    if bits & (HOST_TSO4 | HOST_TSO6) == 0 {
        bits &= !HOST_ECN;
    }
    if bits & GUEST_CSUM == 0 {
        bits &= !GUEST_OFFLOADS;
    }
    if bits & (GUEST_TSO4 | GUEST_TSO6) == 0 {
        bits &= !GUEST_ECN;
    }
    bits
}

/// The feature word a port offers: everything, less the mask, less MQ for one queue
/// pair, closed under the dependency rules.
/// vhost-user protocol features are always offered: QEMU's vhost-user net cannot start
/// without them (it enables rings with SET_VRING_ENABLE).
pub fn offer(mask: &FeatureMask, queue_pairs: u16) -> u64 {
    let mut bits = ALL_OFFERED & !mask.removed_bits();
    if queue_pairs <= 1 {
        bits &= !MQ;
    }
    with_dependencies(bits) | PROTOCOL_FEATURES
}

/// What one side accepts: which GSO types, and partially checksummed frames.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Caps {
    pub csum: bool,
    pub tso4: bool,
    pub tso6: bool,
    pub ecn: bool,
    pub ufo: bool,
    pub uso4: bool,
    pub uso6: bool,
}

impl Caps {
    /// Takes every offload (a tap with vnet headers and all TUN_F_* set).
    pub const ALL: Caps = Caps {
        csum: true,
        tso4: true,
        tso6: true,
        ecn: true,
        ufo: true,
        uso4: true,
        uso6: true,
    };

    /// The flags in one byte (`from_bits` gives them back), for a copy read per
    /// frame with one plain load.
    pub fn to_bits(self) -> u8 {
        [
            self.csum, self.tso4, self.tso6, self.ecn, self.ufo, self.uso4, self.uso6,
        ]
        .iter()
        .enumerate()
        .fold(0, |b, (i, &on)| b | (u8::from(on) << i))
    }

    pub fn from_bits(b: u8) -> Caps {
        let on = |i: u8| b & (1 << i) != 0;
        Caps {
            csum: on(0),
            tso4: on(1),
            tso6: on(2),
            ecn: on(3),
            ufo: on(4),
            uso4: on(5),
            uso6: on(6),
        }
    }

    /// Whether a frame with this gso_type may go to this side intact.
    pub fn accepts(&self, gso: GsoType) -> bool {
        let kind_ok = match gso.kind {
            GsoKind::None => return true,
            GsoKind::TcpV4 => self.tso4,
            GsoKind::TcpV6 => self.tso6,
            GsoKind::Udp => self.ufo,
            GsoKind::UdpL4 => self.uso4 || self.uso6,
        };
        // GSO frames always carry a partial checksum, so csum is a prerequisite.
        kind_ok && self.csum && (!gso.ecn || self.ecn)
    }

    /// What the guest accepts from us (the GUEST_* bits it acked).
    pub fn guest_rx(acked: u64) -> Caps {
        let b = with_dependencies(acked);
        Caps {
            csum: b & GUEST_CSUM != 0,
            tso4: b & GUEST_TSO4 != 0,
            tso6: b & GUEST_TSO6 != 0,
            ecn: b & GUEST_ECN != 0,
            ufo: b & GUEST_UFO != 0,
            uso4: b & GUEST_USO4 != 0,
            uso6: b & GUEST_USO6 != 0,
        }
    }

    /// What the guest may send us (the HOST_* bits it acked).
    pub fn guest_tx(acked: u64) -> Caps {
        let b = with_dependencies(acked);
        Caps {
            csum: b & CSUM != 0,
            tso4: b & HOST_TSO4 != 0,
            tso6: b & HOST_TSO6 != 0,
            ecn: b & HOST_ECN != 0,
            ufo: b & HOST_UFO != 0,
            uso4: b & HOST_USO != 0,
            uso6: b & HOST_USO != 0,
        }
    }

    /// The union: what either accepts.
    pub fn or(self, o: Caps) -> Caps {
        Caps {
            csum: self.csum || o.csum,
            tso4: self.tso4 || o.tso4,
            tso6: self.tso6 || o.tso6,
            ecn: self.ecn || o.ecn,
            ufo: self.ufo || o.ufo,
            uso4: self.uso4 || o.uso4,
            uso6: self.uso6 || o.uso6,
        }
    }
}

/// Everything the datapath needs to know about what a guest acked.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Negotiated {
    /// Frames we may hand the guest.
    pub rx: Caps,
    /// Frames the guest may hand us.
    pub tx: Caps,
    pub mrg_rxbuf: bool,
    pub event_idx: bool,
    /// Descriptor chains may point at indirect tables.
    pub indirect_desc: bool,
    /// VERSION_1 or MRG_RXBUF: the header on the rings is 12 bytes, else 10.
    pub modern: bool,
    /// LOG_ALL: writes to guest memory are logged (a live migration is under way).
    pub log_all: bool,
    /// RING_PACKED: every queue of the device is a packed ring.
    pub packed: bool,
    /// IN_ORDER: buffers are used in the order they were made available, and a
    /// packed TX ring's may be completed with one used descriptor per publish.
    pub in_order: bool,
    /// The feature word as acked.
    pub acked: u64,
}

impl Negotiated {
    pub fn from_acked(acked: u64) -> Negotiated {
        Negotiated {
            rx: Caps::guest_rx(acked),
            tx: Caps::guest_tx(acked),
            mrg_rxbuf: acked & MRG_RXBUF != 0,
            event_idx: acked & EVENT_IDX != 0,
            indirect_desc: acked & INDIRECT_DESC != 0,
            modern: acked & (VERSION_1 | MRG_RXBUF) != 0,
            log_all: acked & LOG_ALL != 0,
            packed: acked & RING_PACKED != 0,
            in_order: acked & IN_ORDER != 0,
            acked,
        }
    }

    /// Length of the virtio_net_hdr on this guest's rings.
    pub fn hdr_len(&self) -> usize {
        if self.modern {
            HDR_LEN
        } else {
            LEGACY_HDR_LEN
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn caps_survive_their_byte() {
        for b in 0..128u8 {
            assert_eq!(Caps::from_bits(b).to_bits(), b);
        }
        assert_eq!(Caps::from_bits(Caps::ALL.to_bits()), Caps::ALL);
        let one = Caps {
            ufo: true,
            ..Caps::default()
        };
        assert_eq!(Caps::from_bits(one.to_bits()), one);
    }

    #[test]
    fn default_offer_has_every_listed_bit() {
        let o = offer(&FeatureMask::default(), 2);
        for b in [
            VERSION_1,
            CSUM,
            GUEST_CSUM,
            HOST_TSO4,
            HOST_TSO6,
            HOST_ECN,
            HOST_UFO,
            HOST_USO,
            GUEST_TSO4,
            GUEST_TSO6,
            GUEST_ECN,
            GUEST_UFO,
            GUEST_USO4,
            GUEST_USO6,
            MRG_RXBUF,
            EVENT_IDX,
            INDIRECT_DESC,
            MAC,
            MTU,
            STATUS,
            MQ,
            GUEST_ANNOUNCE,
            LOG_ALL,
            PROTOCOL_FEATURES,
        ] {
            assert_ne!(o & b, 0, "bit {:#x} missing", b);
        }
    }

    #[test]
    fn single_queue_pair_drops_mq() {
        let o = offer(&FeatureMask::default(), 1);
        assert_eq!(o & MQ, 0);
        assert_ne!(o & PROTOCOL_FEATURES, 0);
    }

    #[test]
    fn csum_off_removes_host_offloads_only() {
        let mut m = FeatureMask::default();
        m.set("csum", false);
        let o = offer(&m, 1);
        assert_eq!(o & (CSUM | HOST_OFFLOADS), 0);
        assert_eq!(o & GUEST_OFFLOADS, GUEST_OFFLOADS);
    }

    #[test]
    fn guest_csum_off_removes_guest_offloads() {
        let mut m = FeatureMask::default();
        m.set("guest_csum", false);
        let o = offer(&m, 1);
        assert_eq!(o & (GUEST_CSUM | GUEST_OFFLOADS), 0);
        assert_eq!(o & HOST_OFFLOADS, HOST_OFFLOADS);
    }

    #[test]
    fn tso_off_takes_ecn_with_it() {
        let mut m = FeatureMask::default();
        assert!(m.set("tso", false));
        let o = offer(&m, 1);
        assert_eq!(
            o & (HOST_TSO4 | HOST_TSO6 | HOST_ECN | GUEST_TSO4 | GUEST_TSO6 | GUEST_ECN),
            0
        );
        assert_ne!(o & HOST_USO, 0);
        assert_ne!(o & CSUM, 0);
    }

    #[test]
    fn offloads_off_leaves_plain_device() {
        let mut m = FeatureMask::default();
        m.set("offloads", false);
        let o = offer(&m, 1);
        assert_eq!(o & (CSUM | GUEST_CSUM | HOST_OFFLOADS | GUEST_OFFLOADS), 0);
        assert_ne!(o & MRG_RXBUF, 0);
        assert_ne!(o & VERSION_1, 0);
    }

    #[test]
    fn unknown_mask_name_is_refused() {
        assert!(!FeatureMask::default().set("turbo", false));
    }

    #[test]
    fn ack_without_prerequisite_gives_no_cap() {
        // A driver that acks HOST_TSO4 without CSUM may not send TSO frames.
        let tx = Caps::guest_tx(HOST_TSO4 | HOST_ECN);
        assert!(!tx.tso4 && !tx.ecn && !tx.csum);
        let rx = Caps::guest_rx(GUEST_CSUM | GUEST_ECN);
        assert!(rx.csum && !rx.ecn);
    }

    #[test]
    fn accepts_follows_kind_ecn_and_csum() {
        let rx = Caps::guest_rx(GUEST_CSUM | GUEST_TSO4);
        let tcp4 = GsoType::new(GsoKind::TcpV4);
        let tcp4_ecn = GsoType {
            kind: GsoKind::TcpV4,
            ecn: true,
        };
        assert!(rx.accepts(GsoType::NONE));
        assert!(rx.accepts(tcp4));
        assert!(!rx.accepts(tcp4_ecn));
        assert!(!rx.accepts(GsoType::new(GsoKind::TcpV6)));
        assert!(!rx.accepts(GsoType::new(GsoKind::UdpL4)));
        let no_csum = Caps {
            csum: false,
            ..Caps::ALL
        };
        assert!(!no_csum.accepts(tcp4));
        assert!(Caps::ALL.accepts(tcp4_ecn));
    }

    #[test]
    fn negotiated_reads_ring_bits() {
        let n = Negotiated::from_acked(VERSION_1 | MRG_RXBUF | CSUM | HOST_USO);
        assert!(n.mrg_rxbuf && !n.event_idx);
        assert!(n.tx.uso4 && n.tx.uso6 && !n.rx.csum);
        assert!(!n.log_all);
        assert!(Negotiated::from_acked(VERSION_1 | LOG_ALL).log_all);
    }

    #[test]
    fn migration_bits_stay_whatever_the_mask() {
        let mut m = FeatureMask::default();
        m.set("offloads", false);
        m.set("mrg_rxbuf", false);
        let o = offer(&m, 1);
        assert_eq!(o & (LOG_ALL | GUEST_ANNOUNCE), LOG_ALL | GUEST_ANNOUNCE);
    }
}

//! Why a frame was dropped: one variant per cause, each with the stable name shown in
//! `gsonet stats` and one documented meaning (docs/configuration.md lists them all).

use std::fmt;

macro_rules! drop_reasons {
    ($( $(#[doc = $doc:literal])+ $variant:ident = $name:literal, )+) => {
        /// Every cause of a dropped frame. The per-layer error types convert into it.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub enum DropReason {
            $( $(#[doc = $doc])+ $variant, )+
        }

        impl DropReason {
            /// Every reason, in counter order.
            pub const ALL: &'static [DropReason] = &[$(DropReason::$variant,)+];

            /// The counter's name in `gsonet stats` (stable).
            pub fn name(self) -> &'static str {
                match self {
                    $(DropReason::$variant => $name,)+
                }
            }

            /// What the counter means, for documentation and `--help`.
            pub fn meaning(self) -> &'static str {
                match self {
                    $(DropReason::$variant => concat!($($doc),+).trim_start(),)+
                }
            }
        }
    };
}

drop_reasons! {
    // Entry: a guest's TX descriptor chain, or a frame read from an uplink.
    /// A TX descriptor points outside guest memory.
    BadAddress = "bad_address",
    /// A TX chain holds a device-writable descriptor.
    WritableDescriptor = "writable_descriptor",
    /// The frame ends inside its Ethernet header (addresses, VLAN tags, ethertype).
    TooShort = "too_short",
    /// The frame is longer than the largest gsonet carries (a 64 KiB IP packet behind Ethernet and two tags).
    TooLong = "too_long",
    /// The virtio_net_hdr cannot be decoded: shorter than negotiated, or an unknown gso_type.
    BadHeader = "bad_header",
    /// A TX chain has more descriptors than its queue has entries.
    TooManyDescriptors = "too_many_descriptors",
    /// A TX chain ends at a descriptor that still points on (bad next index, loop, bad indirect table).
    BrokenChain = "broken_chain",
    /// A kick on a TX queue whose avail index is more than a queue ahead: the queue is left alone until it makes sense again.
    TxRingBroken = "tx_ring_broken",

    // A guest's TX header against its frame and what it negotiated (frame::validate); bad_headers and unsegmentable also for GSO frames from an uplink.
    /// A GSO frame of a type the guest did not negotiate (HOST_TSO4/6, HOST_ECN, HOST_UFO, HOST_USO).
    GsoNotNegotiated = "gso_not_negotiated",
    /// NEEDS_CSUM from a guest that did not negotiate CSUM.
    CsumNotNegotiated = "csum_not_negotiated",
    /// gso_size 0 on a GSO frame.
    GsoSizeZero = "gso_size_zero",
    /// gso_size 0xffff.
    GsoSizeMax = "gso_size_max",
    /// The checksum field (csum_start + csum_offset + 2) lies beyond the frame.
    CsumOutOfFrame = "csum_out_of_frame",
    /// csum_start of a GSO frame below the bare IPv4 (34) or IPv6 (54) minimum.
    CsumStartTooSmall = "csum_start_too_small",
    /// csum_start of a GSO frame is not where its L4 header is.
    CsumStartNotL4 = "csum_start_not_l4",
    /// NEEDS_CSUM on a plain frame whose checksum would land before its L4 header (in the MAC, VLAN or IP headers).
    CsumInHeaders = "csum_in_headers",
    /// The Ethernet/IP/TCP/UDP headers of a GSO frame, or of a frame with NEEDS_CSUM, cannot be parsed.
    BadHeaders = "bad_headers",
    /// A TCPv4/TCPv6 GSO type on a frame of the other IP version.
    GsoL3Mismatch = "gso_l3_mismatch",
    /// A GSO type on a frame of another L4 protocol (TSO on UDP, UFO/USO on TCP).
    GsoL4Mismatch = "gso_l4_mismatch",
    /// TSO with a partial checksum whose csum_offset is not 16.
    TsoCsumOffset = "tso_csum_offset",
    /// USO without NEEDS_CSUM.
    UsoNoCsum = "uso_no_csum",
    /// USO with a csum_offset other than 6.
    UsoCsumOffset = "uso_csum_offset",
    /// UFO with a partial checksum whose csum_offset is not 6.
    UfoCsumOffset = "ufo_csum_offset",
    /// USO with the ECN bit.
    UsoEcn = "uso_ecn",
    /// USO asking for more than 128 segments.
    UsoTooManySegments = "uso_too_many_segments",
    /// A GSO frame that could not be segmented (lengths, fragment sizes).
    Unsegmentable = "unsegmentable",
    /// A GSO frame whose IP or UDP length field disagrees with its size.
    LengthMismatch = "length_mismatch",
    /// The guest's GSO frames would cost more software segments than its budget (4 million a second, 262,144 at once): a guest asking for tiny gso_size cannot slow the others.
    SegmentBudget = "segment_budget",

    // The switch.
    /// A tagged frame from a guest on an access port.
    TaggedOnAccessPort = "tagged_on_access_port",
    /// A frame from a guest on an untagged port tagged with a VLAN some port uses (an access VLAN or a trunk port's allowed VID).
    TaggedWithAccessVlan = "tagged_with_access_vlan",
    /// Any other tagged frame (802.1Q with any VID, priority tags included, 802.1ad, 0x9100) from a guest on a port without vlan= or trunk=on: such ports send untagged frames only.
    TaggedOnUntaggedPort = "tagged_on_untagged_port",
    /// A frame from a trunk=on port tagged with a VID outside its allowed_vlans, with a priority tag, or with an 802.1ad/0x9100 outer tag.
    VlanNotAllowed = "vlan_not_allowed",
    /// A frame from a mac_lock=on port whose source MAC is not the port's mac=.
    MacSpoofed = "mac_spoofed",
    /// A frame whose source MAC is another port's mac= (in the same VLAN): a configured address never moves.
    MacPinnedElsewhere = "mac_pinned_elsewhere",
    /// A frame whose source MAC was learned on another port or uplink and moved there less than a second ago: an address moves at most once a second, so two endpoints claiming it cannot thrash the table.
    MacMoveRefused = "mac_move_refused",
    /// A checksum that would start inside the VLAN tag being removed, or offsets that overflow when one is added.
    VlanBadOffsets = "vlan_bad_offsets",

    // Delivery to a destination.
    /// Software segmentation or checksum completion failed for this destination (e.g. max_burst below the headers).
    SegmentError = "segment_error",
    /// The guest's RX queue had no room for the frame.
    RxQueueFull = "rx_queue_full",
    /// A frame over a rate limit where its sender cannot be held: from an uplink over its `rate=`, or from an uplink to a guest over its `rx_rate=` (dropped at the tail); or paced for a guest's `rx_rate=` when its pace line was full or the guest went away.
    RateLimited = "rate_limited",
    /// The guest has kept its RX queue full for 200 ms or more: its frames are dropped at once.
    RxQueueStalled = "rx_queue_stalled",
    /// An RX buffer too small for the frame, and no MRG_RXBUF.
    RxBufferTooSmall = "rx_buffer_too_small",
    /// An RX chain holds a device-readable descriptor.
    RxReadableDescriptor = "rx_readable_descriptor",
    /// An RX descriptor points outside guest memory.
    RxBadAddress = "rx_bad_address",
    /// A malformed RX chain (an indirect table without INDIRECT_DESC, an empty descriptor, more descriptors than the queue has entries), an avail index more than a queue ahead, or a queue already found broken.
    RxBadChain = "rx_bad_chain",
    /// The frame would need more than 256 RX buffers or 1024 descriptors.
    RxTooFragmented = "rx_too_fragmented",

    // The vhost-user control plane (backend::vhost::firewall): each refused request ends that frontend's connection; the port waits for the next.
    /// A vhost-user request gsonet did not offer (unknown, or of a protocol feature it never offered) or with bad header flags.
    FrontendRequestRefused = "frontend_request_refused",
    /// A vhost-user request whose payload does not have the request's size, or a field out of range (ring index, enable state, memory region count or bounds).
    FrontendBadPayload = "frontend_bad_payload",
    /// File descriptors on a vhost-user request that carries none, or more or fewer than it takes.
    FrontendBadFds = "frontend_bad_fds",
    /// A kick, call or error descriptor that is not an eventfd.
    FrontendNotEventfd = "frontend_not_eventfd",
    /// A guest memory region whose file is not a regular file or ends before the region does.
    FrontendBadMemory = "frontend_bad_memory",
    /// Guest memory in a file not sealed against shrinking (F_SEAL_SHRINK), on a port without allow_unsealed_memory.
    FrontendUnsealedMemory = "frontend_unsealed_memory",

    // Uplink devices.
    /// Reading from the uplink device failed.
    UplinkReadError = "uplink_read_error",
    /// The kernel refused the frame (EINVAL: a header it does not accept).
    UplinkRejected = "uplink_rejected",
    /// The device's queue was full (EAGAIN, ENOBUFS).
    UplinkBusy = "uplink_busy",
    /// Larger than the device takes (EMSGSIZE).
    UplinkTooBig = "uplink_too_big",
    /// The device is down or gone (ENETDOWN, ENXIO).
    UplinkDown = "uplink_down",
    /// Any other write error.
    UplinkError = "uplink_error",
    // Xen netfronts (backend::xen): slots a netfront's TX ring holds, and grant copies.
    /// A netfront's TX packet spread over more than 18 data slots (XEN_NETIF_NR_SLOTS_MIN).
    XenTooManySlots = "xen_too_many_slots",
    /// A netfront's TX slots do not add up: the later slots hold more than the packet's size, or a slot runs past its page.
    XenSlotsMismatch = "xen_slots_mismatch",
    /// A netfront's TX extra-info slot of an unknown type, or a second GSO extra on one packet.
    XenBadExtra = "xen_bad_extra",
    /// A netfront's GSO extra with a type other than TCPv4 or TCPv6.
    XenBadGsoType = "xen_bad_gso_type",
    /// A netfront's GSO packet without NETTXF_csum_blank: a GSO packet must leave its checksum to the backend.
    XenGsoWithoutCsumBlank = "xen_gso_without_csum_blank",
    /// A grant copy to or from the netfront failed (a bad grant reference, or a grant it does not give).
    XenBadGrant = "xen_bad_grant",
    /// A netfront's ring index jumped more than a ring ahead, or a packet never ended within the ring: the vif stops until the netfront reconnects.
    XenRingBroken = "xen_ring_broken",
}

impl DropReason {
    /// Finds a reason by its counter name.
    pub fn from_name(name: &str) -> Option<DropReason> {
        DropReason::ALL.iter().copied().find(|r| r.name() == name)
    }

    /// Why an uplink device refused a frame written to it.
    pub fn of_uplink_write(e: &std::io::Error) -> DropReason {
        match e.raw_os_error() {
            Some(libc::EINVAL) => DropReason::UplinkRejected,
            Some(libc::EAGAIN) | Some(libc::ENOBUFS) => DropReason::UplinkBusy,
            Some(libc::EMSGSIZE) => DropReason::UplinkTooBig,
            Some(libc::ENETDOWN) | Some(libc::ENXIO) => DropReason::UplinkDown,
            _ => DropReason::UplinkError,
        }
    }
}

impl fmt::Display for DropReason {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_distinct_and_documented() {
        let mut names: Vec<&str> = DropReason::ALL.iter().map(|r| r.name()).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), DropReason::ALL.len());
        for r in DropReason::ALL {
            assert!(!r.meaning().is_empty(), "{r}");
            assert_eq!(DropReason::from_name(r.name()), Some(*r));
        }
    }

    #[test]
    fn uplink_write_errors_have_reasons() {
        let r = |n| DropReason::of_uplink_write(&std::io::Error::from_raw_os_error(n));
        assert_eq!(r(libc::EINVAL), DropReason::UplinkRejected);
        assert_eq!(r(libc::ENOBUFS), DropReason::UplinkBusy);
        assert_eq!(r(libc::EAGAIN), DropReason::UplinkBusy);
        assert_eq!(r(libc::EMSGSIZE), DropReason::UplinkTooBig);
        assert_eq!(r(libc::ENXIO), DropReason::UplinkDown);
        assert_eq!(r(libc::EIO), DropReason::UplinkError);
    }

    #[test]
    fn configuration_docs_list_every_reason_with_its_meaning() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/docs/configuration.md");
        let docs = std::fs::read_to_string(path).unwrap();
        for r in DropReason::ALL {
            let row = format!("| `{}` | {} |", r.name(), r.meaning());
            assert!(docs.contains(&row), "docs/configuration.md lacks: {row}");
        }
    }
}

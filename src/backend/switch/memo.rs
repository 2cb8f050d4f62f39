//! A sender's memo of its last frame that joined a run (`Switch::forward_in_run`):
//! the next frames of its batch with the same addresses, tag and header, to the same
//! queue, join the same run without being routed again. Frames of one batch are
//! mostly one flow, so most frames skip the route (its checks, VLAN classing and
//! table memo) and the choice of path.
//!
//! The answer is the one routing would give: everything routing and the choice of
//! path read is in the key, the topology by its serial and the table by its
//! generation, or is read once per batch, as the topology already is: the
//! destination's offloads and the batch's time, which the table's answers are
//! dated by (the memo is forgotten at the end of each batch, `DeliverCtx::flush`,
//! and whenever the batch's time is read again, so it never outlives that time).

use super::Endpoint;
use crate::frame::Frame;
use crate::l2::{Mac, Tag};
use crate::vnet_hdr::VirtioNetHdr;

/// Where a frame is routed from and by what: the sender's queue, the topology and
/// the table's state.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct JoinAt {
    /// `Topology::serial` of the topology the batch routes by.
    pub topology: u64,
    pub src: Endpoint,
    pub queue: usize,
    /// The table's generation.
    pub generation: u64,
}

/// What the decision for a frame depends on.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct JoinKey {
    pub at: JoinAt,
    pub from: Mac,
    pub to: Mac,
    pub tag: Tag,
    pub hdr: VirtioNetHdr,
    /// A one-copy frame (part of it still in the sender's buffers).
    pub one_copy: bool,
}

impl JoinKey {
    /// The key of `frame`, routed as `at` says.
    pub fn of(at: JoinAt, frame: &Frame) -> JoinKey {
        JoinKey {
            at,
            from: frame.src,
            to: frame.dst,
            tag: frame.tag,
            hdr: frame.hdr,
            one_copy: frame.guest.is_some(),
        }
    }

    /// Whether this is the key `JoinKey::of` would make, compared where the
    /// fields lie: no key is made for a frame that finds its decision.
    fn is_of(&self, at: JoinAt, frame: &Frame) -> bool {
        // Field by field: `self.at == at` cost 24 instructions a frame more.
        self.at.topology == at.topology
            && self.at.generation == at.generation
            && self.at.src == at.src
            && self.at.queue == at.queue
            && self.to == frame.dst
            && self.from == frame.src
            && self.tag == frame.tag
            && self.one_copy == frame.guest.is_some()
            && self.hdr == frame.hdr
    }
}

/// Where such a frame goes: the guest port at `slot` of the topology's ports
/// (endpoint `dst`), with the RX header `hdr`.
#[derive(Clone, Copy)]
pub struct Joined {
    pub slot: usize,
    pub dst: Endpoint,
    pub hdr: VirtioNetHdr,
}

/// The sender's last decision, if it is still the batch's.
#[derive(Default)]
pub struct JoinMemo(Option<(JoinKey, Joined)>);

impl JoinMemo {
    /// The decision for the frame whose key `JoinKey::of(at, frame)` makes, if it
    /// is the one kept.
    pub fn get(&self, at: JoinAt, frame: &Frame) -> Option<Joined> {
        self.0
            .as_ref()
            .filter(|(k, _)| k.is_of(at, frame))
            .map(|(_, j)| *j)
    }

    pub fn set(&mut self, key: JoinKey, joined: Joined) {
        self.0 = Some((key, joined));
    }

    pub fn forget(&mut self) {
        self.0 = None;
    }
}

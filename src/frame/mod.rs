//! The typed frame every room after entry works with: the virtio_net_hdr, the bytes,
//! and what parsing them once found (addresses, VLAN tag and, for a GSO frame, where
//! its headers are and how it will be cut). Nothing downstream parses a frame again.

pub mod validate;

use crate::l2::{Mac, Tag, ADDRS_LEN, ETH_HDR_LEN};
use crate::ring::tx::GuestTail;
use crate::segment::{parse, plan, Headers, Plan};
use crate::stats::DropReason;
use crate::vnet_hdr::VirtioNetHdr;

/// Where a GSO frame's headers are and how it will be cut without an MTU cap.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GsoLayout {
    pub headers: Headers,
    pub plan: Plan,
}

/// A frame in flight: its header, its bytes (a private buffer, or a view that adds or
/// removes a VLAN tag in front of one) and what was learnt from them on entry.
#[derive(Clone, Copy)]
pub struct Frame<'a> {
    pub hdr: VirtioNetHdr,
    pub parts: &'a [&'a [u8]],
    /// A one-copy frame: the bytes after `parts`, still in the sending guest's
    /// buffers. Only the switch's forward sees such a frame; it hands it to a guest's
    /// RX queue as it is, or makes it whole (`made_whole`) for every other path.
    pub guest: Option<GuestTail<'a>>,
    /// Bytes in `parts` and `guest`.
    pub len: usize,
    pub dst: Mac,
    pub src: Mac,
    pub tag: Tag,
    /// GSO frames: parsed headers and plan. `None` for a frame without GSO.
    pub gso: Option<GsoLayout>,
}

impl<'a> Frame<'a> {
    /// A frame whose bytes are `bytes` (contiguous, at least an Ethernet header) and
    /// whose GSO layout, if any, is already known.
    pub fn new(
        hdr: VirtioNetHdr,
        parts: &'a [&'a [u8]],
        gso: Option<GsoLayout>,
    ) -> Result<Frame<'a>, DropReason> {
        let len = parse::frame_len(parts);
        let head = parts.first().copied().unwrap_or_default();
        if len < ETH_HDR_LEN || head.len() < ETH_HDR_LEN {
            return Err(DropReason::TooShort);
        }
        let addrs: &[u8; ADDRS_LEN] = head[..ADDRS_LEN]
            .try_into()
            .map_err(|_| DropReason::TooShort)?;
        let (dst, src) = Mac::pair(addrs);
        Ok(Frame {
            hdr,
            parts,
            guest: None,
            len,
            dst,
            src,
            tag: Tag::read(&head[..head.len().min(ADDRS_LEN + 4)]),
            gso,
        })
    }

    /// A one-copy frame: `parts` hold its first bytes (at least its Ethernet
    /// header; every header when `gso` is set) and `tail` the rest.
    pub fn with_tail(
        hdr: VirtioNetHdr,
        parts: &'a [&'a [u8]],
        tail: GuestTail<'a>,
        gso: Option<GsoLayout>,
    ) -> Result<Frame<'a>, DropReason> {
        let mut f = Frame::new(hdr, parts, gso)?;
        f.len += tail.len;
        f.guest = Some(tail);
        Ok(f)
    }

    /// Copies every byte of the frame into `buf` (grown to fit): the buffer a
    /// one-copy frame is made whole in.
    pub fn gather(&self, buf: &mut Vec<u8>) -> Result<(), DropReason> {
        gather_whole(self.parts, self.guest.as_ref(), buf).map(|_| ())
    }

    /// The same frame over `parts` (all its bytes, as `gather` left them).
    pub fn made_whole<'b>(&self, parts: &'b [&'b [u8]]) -> Frame<'b>
    where
        'a: 'b,
    {
        Frame {
            parts,
            guest: None,
            ..*self
        }
    }

    /// Bytes it puts on the wire: a GSO frame as the segments it becomes, each with
    /// its own headers (what rate limits count).
    pub fn wire_len(&self) -> usize {
        self.gso.map_or(self.len, |g| {
            self.len + (g.plan.segments - 1) * g.headers.hdr_len()
        })
    }

    /// A frame from an uplink device: the kernel built its header, so only what the
    /// datapath needs is checked (a GSO frame must parse and be cuttable).
    pub fn from_device(hdr: VirtioNetHdr, parts: &'a [&'a [u8]]) -> Result<Frame<'a>, DropReason> {
        let gso = if hdr.gso.is_gso() {
            let headers = parse::parse_headers(parts).map_err(|_| DropReason::BadHeaders)?;
            let plan = plan(hdr.gso.kind, hdr.gso_size, &headers, None)
                .map_err(|_| DropReason::Unsegmentable)?;
            Some(GsoLayout { headers, plan })
        } else {
            None
        };
        Frame::new(hdr, parts, gso)
    }
}

/// Copies `head`, then `tail` (a one-copy frame's bytes left in the guest's buffers)
/// if any, into `buf`, which then holds the frame made whole and nothing else (its
/// allocation is kept from call to call, and nothing is zero-filled first). Returns
/// its length; `BadAddress` if the tail could not be read.
pub fn gather_whole(
    head: &[&[u8]],
    tail: Option<&GuestTail>,
    buf: &mut Vec<u8>,
) -> Result<usize, DropReason> {
    buf.clear();
    let len = parse::frame_len(head) + tail.map_or(0, |t| t.len);
    buf.reserve(len);
    for p in head {
        buf.extend_from_slice(p);
    }
    if let Some(t) = tail {
        t.append_to(buf).map_err(|_| DropReason::BadAddress)?;
    }
    Ok(len)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testkit::frames::{build, gso_hdr, pattern, FrameSpec};
    use crate::vnet_hdr::GsoKind;

    #[test]
    fn device_frames_are_parsed_once_on_entry() {
        let (f, l4) = build(&FrameSpec {
            payload: pattern(3000),
            ..FrameSpec::default()
        });
        let parts = [&f[..]];
        let hdr = gso_hdr(GsoKind::TcpV4, 1448, l4, true);
        let frame = Frame::from_device(hdr, &parts).unwrap();
        let gso = frame.gso.unwrap();
        assert_eq!((gso.headers.l4_off, gso.plan.segments), (l4, 3));
        assert_eq!(frame.tag, Tag::Untagged);
        assert_eq!(frame.len, f.len());
        // Broken headers under a GSO type are refused; a plain frame is not parsed.
        let cut = [&f[..40]];
        assert_eq!(
            Frame::from_device(hdr, &cut).err(),
            Some(DropReason::BadHeaders)
        );
        assert!(Frame::from_device(VirtioNetHdr::default(), &cut).is_ok());
        let tiny = [&f[..13]];
        assert_eq!(
            Frame::from_device(VirtioNetHdr::default(), &tiny).err(),
            Some(DropReason::TooShort)
        );
    }
}

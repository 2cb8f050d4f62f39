//! RX: write one frame (virtio_net_hdr + bytes) into the guest's RX queue. With
//! MRG_RXBUF the frame spans as many chains as it needs and `num_buffers` says how
//! many; without it one chain must hold it all. Nothing is marked used unless the
//! whole frame fits, so a full queue costs the frame, never a half-written one, and
//! the used index moves once per frame, past all of its buffers.

use thiserror::Error;
use virtio_queue::QueueT;

use super::guest_mem::{BadRange, GuestMem};
use super::host::{HostMem, Writable};
use super::split::{Desc, WalkEnd};
use super::tx::GuestTail;
use super::vq::{Head, Vq};
use crate::stats::DropReason;
use crate::vnet_hdr::{VirtioNetHdr, HDR_LEN};

/// Most RX chains one frame may take (MRG_RXBUF): a guest posting tiny buffers
/// cannot make one frame cost more than this.
pub const MAX_CHAINS_PER_FRAME: usize = 256;
/// Most descriptors one frame may be written into (Linux's UIO_MAXIOV).
pub const MAX_DESCS_PER_FRAME: usize = 1024;

#[derive(Debug, Error, Clone, Copy, PartialEq, Eq)]
pub enum RxError {
    #[error("no RX buffers available")]
    NoBuffers,
    #[error("RX buffer of {have} bytes cannot hold a {need}-byte frame")]
    BufferTooSmall { have: usize, need: usize },
    #[error("RX chain has a device-readable descriptor")]
    ReadableDescriptor,
    #[error("RX descriptor points outside guest memory")]
    BadAddress,
    #[error("malformed RX chain (indirect without INDIRECT_DESC, empty descriptor, longer than the queue)")]
    BadChain,
    #[error("frame would need more than {MAX_CHAINS_PER_FRAME} RX buffers or {MAX_DESCS_PER_FRAME} descriptors")]
    TooFragmented,
}

impl From<RxError> for DropReason {
    fn from(e: RxError) -> DropReason {
        match e {
            RxError::NoBuffers => DropReason::RxQueueFull,
            RxError::BufferTooSmall { .. } => DropReason::RxBufferTooSmall,
            RxError::ReadableDescriptor => DropReason::RxReadableDescriptor,
            RxError::BadAddress => DropReason::RxBadAddress,
            RxError::BadChain => DropReason::RxBadChain,
            RxError::TooFragmented => DropReason::RxTooFragmented,
        }
    }
}

/// What the guest negotiated that shapes its RX queue.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RxFormat {
    /// Bytes of virtio_net_hdr in front of every frame (12, or 10 for legacy guests).
    pub hdr_len: usize,
    /// MRG_RXBUF: a frame may span several chains.
    pub mrg_rxbuf: bool,
    /// INDIRECT_DESC: chains may point at indirect tables.
    pub indirect: bool,
}

/// Per-call scratch, kept by the caller so the hot path does not allocate. Its size
/// is bounded by `MAX_DESCS_PER_FRAME` and `MAX_CHAINS_PER_FRAME`.
#[derive(Default)]
pub struct RxScratch {
    descs: Vec<(u64, usize)>,
    chains: Vec<(Head, usize)>, // head, number of descriptors
    written: Vec<usize>,
    /// One chain as walked (at most a queue's worth of descriptors).
    walk: Vec<Desc>,
    /// A frame's buffers when each is one descriptor (`spread_over_lone_buffers`).
    lone: Vec<(Head, Desc)>,
    /// The first buffer's bytes of the last frame written the long way, over
    /// claimed chains (0: none yet): a frame larger than that is not tried in one
    /// buffer first (8 KB frames into 2 KB buffers would read each buffer's
    /// descriptor twice).
    spread_from: usize,
}

impl RxScratch {
    /// The capacities of its buffers (descriptors, chains, per-chain counts), which
    /// stay bounded whatever the guest posts.
    pub fn capacity(&self) -> (usize, usize, usize) {
        (
            self.descs.capacity(),
            self.chains.capacity().max(self.lone.capacity()),
            self.written.capacity(),
        )
    }
}

/// Writes `hdr` (its first `fmt.hdr_len` bytes, with `num_buffers` filled in) and
/// `parts` into the queue. Returns how many chains were used. The work is bounded
/// whatever the guest posted: chains longer than the queue, indirect tables it did not
/// negotiate and empty descriptors are malformed; a frame takes at most
/// `MAX_CHAINS_PER_FRAME` chains and `MAX_DESCS_PER_FRAME` descriptors.
pub fn write_frame<Q: QueueT>(
    q: &mut Q,
    mem: &GuestMem,
    scratch: &mut RxScratch,
    hdr: &VirtioNetHdr,
    fmt: RxFormat,
    parts: &[&[u8]],
) -> Result<usize, RxError> {
    let hm = HostMem::new(mem);
    let mut ring = Vq::of(q, false);
    let r = write_frame_in(&mut ring, &hm, scratch, hdr, fmt, Source::Own(parts), true);
    ring.store(q);
    r
}

/// Where a frame's bytes (after the virtio_net_hdr) come from.
#[derive(Clone, Copy)]
pub enum Source<'a> {
    /// gsonet's own memory.
    Own(&'a [&'a [u8]]),
    /// Another guest's memory: `head` (headers gsonet copied and checked) then the
    /// rest straight from the sender's buffers, never staged.
    Guest {
        head: &'a [&'a [u8]],
        tail: &'a GuestTail<'a>,
    },
}

impl Source<'_> {
    fn len(&self) -> usize {
        // One part, as a run's frames come: no loop set up for it.
        let sum = |parts: &[&[u8]]| match parts {
            [one] => one.len(),
            parts => parts.iter().map(|p| p.len()).sum(),
        };
        match self {
            Source::Own(parts) => sum(parts),
            Source::Guest { head, tail } => sum(head) + tail.len,
        }
    }
}

/// `write_frame` on a ring already taken out of its vring (`Vq`): claims chains,
/// copies, records the frame's used entries and, with `publish`, makes them visible
/// at once (a split ring's used index moved past them with one store). Without it
/// the caller publishes later, at a frame boundary (`Vq::publish_used`), so a batch
/// of frames costs one store.
pub fn write_frame_in(
    ring: &mut Vq,
    hm: &HostMem<'_>,
    scratch: &mut RxScratch,
    hdr: &VirtioNetHdr,
    fmt: RxFormat,
    src: Source<'_>,
    publish: bool,
) -> Result<usize, RxError> {
    let need = fmt.hdr_len + src.len();
    ring.clear();
    let Some(avail) = ring.pending_cached(hm) else {
        return Err(RxError::BadChain);
    };
    if avail > 0 && (scratch.spread_from == 0 || need <= scratch.spread_from) {
        // The common case first: the next buffer alone holds the frame.
        if let Some((head, addr)) = ring.take_single_writable(hm, need) {
            let mut out = *hdr;
            out.num_buffers = 1;
            let hdr_bytes = out.to_bytes();
            let one = OneBuffer {
                head: &head,
                addr,
                need,
            };
            return fill_one(ring, hm, one, (&hdr_bytes, fmt.hdr_len), src, publish);
        }
    }
    let frame = (hdr, fmt, src, need);
    write_spread(ring, hm, scratch, frame, avail, publish)
}

/// `write_frame_in` for a frame the next buffer alone does not take (`frame`: its
/// header, the ring's format, its bytes and how many the buffers must hold), the
/// ring having `avail` buffers: out of line, so the common case keeps a small
/// frame.
#[inline(never)]
fn write_spread(
    ring: &mut Vq,
    hm: &HostMem<'_>,
    scratch: &mut RxScratch,
    (hdr, fmt, src, need): (&VirtioNetHdr, RxFormat, Source<'_>, usize),
    mut avail: u16,
    publish: bool,
) -> Result<usize, RxError> {
    scratch.descs.clear();
    scratch.chains.clear();
    let qsize = usize::from(ring.size());
    if fmt.mrg_rxbuf {
        if let Some(r) = spread_over_lone_buffers(ring, hm, scratch, hdr, fmt, src, avail, publish)
        {
            return r;
        }
    }

    // Claim chains until they can hold the frame.
    let mut have = 0usize;
    while have < need {
        if scratch.chains.len() == MAX_CHAINS_PER_FRAME {
            give_back_all(ring, &scratch.chains);
            return Err(RxError::TooFragmented);
        }
        if avail == 0 {
            // The index read last may be behind what the driver has posted since.
            avail = match ring.pending_fresh(hm) {
                Some(n) if n > 0 => n,
                Some(_) => {
                    give_back_all(ring, &scratch.chains);
                    return Err(RxError::NoBuffers);
                }
                None => {
                    give_back_all(ring, &scratch.chains);
                    return Err(RxError::BadChain);
                }
            };
        }
        avail -= 1;
        let Some(head) = ring.take_next(hm, qsize) else {
            give_back_all(ring, &scratch.chains);
            return Err(RxError::BadChain);
        };
        let start = scratch.descs.len();
        scratch.walk.clear();
        let mut bad = None;
        let (end, indirect) = ring.walk(hm, &head, qsize, &mut scratch.walk, !fmt.indirect);
        if !fmt.indirect && indirect {
            bad = Some(RxError::BadChain);
        } else {
            match end {
                WalkEnd::Complete if !scratch.walk.is_empty() => {}
                _ => bad = Some(RxError::BadChain),
            }
            for d in scratch.walk.iter() {
                if bad.is_some() {
                    break;
                }
                if d.len == 0 {
                    bad = Some(RxError::BadChain);
                } else if !d.is_write_only() {
                    bad = Some(RxError::ReadableDescriptor);
                } else if scratch.descs.len() == MAX_DESCS_PER_FRAME {
                    // A good chain, but one too many for this frame: leave it posted.
                    scratch.descs.truncate(start);
                    ring.rewind(scratch.chains.first().map_or(&head, |c| &c.0));
                    return Err(RxError::TooFragmented);
                } else {
                    scratch.descs.push((d.addr, d.len as usize));
                    have += d.len as usize;
                }
            }
        }
        if let Some(e) = bad {
            // A malformed chain is returned unused, after the chains claimed before
            // it (buffers go back in the order they were made available); the frame
            // is lost, the queue goes on. (A split head outside the table can never
            // be returned: it is skipped.)
            scratch.descs.truncate(start);
            scratch.chains.push((head, 0));
            return_unused(ring, hm, scratch.chains.iter().map(|(h, _)| h));
            return Err(e);
        }
        scratch.chains.push((head, scratch.descs.len() - start));
        if !fmt.mrg_rxbuf && have < need {
            ring.rewind(&head);
            return Err(RxError::BufferTooSmall { have, need });
        }
    }

    if let Some(&(_, first)) = scratch.descs.first() {
        scratch.spread_from = first;
    }
    let mut out = *hdr;
    out.num_buffers = scratch.chains.len() as u16;
    let hdr_bytes = out.to_bytes();

    if let ([(addr, _)], [(head, _)]) = (&scratch.descs[..], &scratch.chains[..]) {
        // One buffer holds the frame (a packed ring's, or behind an indirect table).
        let one = OneBuffer {
            head,
            addr: *addr,
            need,
        };
        return fill_one(ring, hm, one, (&hdr_bytes, fmt.hdr_len), src, publish);
    }

    // Copy, descriptor by descriptor, remembering how much each chain received.
    let RxScratch {
        descs,
        chains,
        written,
        ..
    } = scratch;
    written.clear();
    written.resize(chains.len(), 0);
    let mut dst = Filler {
        descs: descs.iter(),
        chain_of_desc: chains
            .iter()
            .enumerate()
            .flat_map(|(ci, &(_, n))| std::iter::repeat_n(ci, n)),
        cur: None,
        written,
    };
    let copied = dst
        .own(hm, &hdr_bytes[..fmt.hdr_len])
        .and_then(|()| match src {
            Source::Own(parts) => parts.iter().try_for_each(|p| dst.own(hm, p)),
            Source::Guest { head, tail } => {
                head.iter().try_for_each(|p| dst.own(hm, p))?;
                let from = HostMem::new(tail.mem);
                tail.pieces
                    .iter()
                    .try_for_each(|&(a, l)| dst.guest(hm, &from, a, l as usize))
            }
        });
    if copied.is_err() {
        return_unused(ring, hm, chains.iter().map(|(h, _)| h));
        return Err(RxError::BadAddress);
    }
    // Every entry first, then the index once, past all of them: the guest (or a
    // gsonet killed mid-frame) never sees a frame with fewer buffers than its
    // `num_buffers`.
    let base = ring.used_pos();
    for ((h, _), &w) in chains.iter().zip(written.iter()) {
        if !ring.put_used(hm, h, w as u32) {
            // The used ring is not writable guest memory: the queue is broken,
            // nothing was published.
            ring.rewind_used(base);
            return Err(RxError::BadAddress);
        }
    }
    if publish && !ring.publish_used(hm) {
        ring.rewind_used(base);
        return Err(RxError::BadAddress);
    }
    Ok(chains.len())
}

/// `write_frame_in` for a frame spread over several buffers (MRG_RXBUF) when each
/// is one writable descriptor, as nearly every driver posts them: each buffer is
/// taken in one step, translated once and filled from where the last one stopped,
/// without the general path's walk and per-descriptor bookkeeping. `None` if a
/// buffer is anything else or the ring runs short: all taken are given back and
/// the general path takes them again and judges them.
#[allow(clippy::too_many_arguments)]
fn spread_over_lone_buffers(
    ring: &mut Vq,
    hm: &HostMem<'_>,
    scratch: &mut RxScratch,
    hdr: &VirtioNetHdr,
    fmt: RxFormat,
    src: Source<'_>,
    mut avail: u16,
    publish: bool,
) -> Option<Result<usize, RxError>> {
    let need = fmt.hdr_len + src.len();
    let bufs = &mut scratch.lone;
    bufs.clear();
    let mut have = 0usize;
    while have < need {
        if avail == 0 {
            avail = ring.pending_fresh(hm).unwrap_or(0);
        }
        let taken = (avail > 0 && bufs.len() < MAX_CHAINS_PER_FRAME)
            .then(|| ring.take_lone_writable(hm))
            .flatten();
        let Some((head, d)) = taken else {
            if let Some((first, _)) = bufs.first() {
                ring.rewind(first);
            }
            return None;
        };
        avail -= 1;
        have += d.len as usize;
        bufs.push((head, d));
    }
    scratch.spread_from = bufs[0].1.len as usize;

    let mut out = *hdr;
    out.num_buffers = bufs.len() as u16;
    let hdr_bytes = out.to_bytes();
    let mut from = Cursor::new(&hdr_bytes[..fmt.hdr_len], src);
    let mut left = need;
    let copied = bufs.iter().try_for_each(|(_, d)| {
        let n = left.min(d.len as usize);
        left -= n;
        match hm.writable(d.addr, n) {
            Some(buf) => from.fill(&buf, n),
            None => from.fill(&Ranges { hm, addr: d.addr }, n),
        }
    });
    if copied.is_err() {
        return_unused(ring, hm, bufs.iter().map(|(h, _)| h));
        return Some(Err(RxError::BadAddress));
    }
    let base = ring.used_pos();
    let mut left = need;
    for (head, d) in bufs.iter() {
        let n = left.min(d.len as usize);
        left -= n;
        if !ring.put_used(hm, head, n as u32) {
            ring.rewind_used(base);
            return Some(Err(RxError::BadAddress));
        }
    }
    if publish && !ring.publish_used(hm) {
        ring.rewind_used(base);
        return Some(Err(RxError::BadAddress));
    }
    Some(Ok(bufs.len()))
}

/// A frame's bytes as they are written out, buffer by buffer: its header, then the
/// source's own parts, then its pieces of another guest's memory.
struct Cursor<'a> {
    /// The rest of the header or of the current own part.
    bytes: &'a [u8],
    own: &'a [&'a [u8]],
    pieces: &'a [(u64, u32)],
    /// Bytes of `pieces[0]` already written.
    piece_off: usize,
    from: Option<HostMem<'a>>,
}

impl<'a> Cursor<'a> {
    fn new(hdr: &'a [u8], src: Source<'a>) -> Cursor<'a> {
        let (own, pieces, from) = match src {
            Source::Own(parts) => (parts, &[][..], None),
            Source::Guest { head, tail } => (head, tail.pieces, Some(HostMem::new(tail.mem))),
        };
        Cursor {
            bytes: hdr,
            own,
            pieces,
            piece_off: 0,
            from,
        }
    }

    /// Writes the next `n` bytes into `to` from its start.
    fn fill(&mut self, to: &impl Sink, mut n: usize) -> Result<(), BadRange> {
        let mut at = 0;
        while n > 0 {
            if !self.bytes.is_empty() {
                let k = self.bytes.len().min(n);
                to.put(at, &self.bytes[..k])?;
                self.bytes = &self.bytes[k..];
                at += k;
                n -= k;
            } else if let Some((part, rest)) = self.own.split_first() {
                self.bytes = part;
                self.own = rest;
            } else if let (Some(&(a, l)), Some(from)) = (self.pieces.first(), &self.from) {
                let k = (l as usize - self.piece_off).min(n);
                to.put_guest(at, from, a + self.piece_off as u64, k)?;
                self.piece_off += k;
                if self.piece_off == l as usize {
                    self.pieces = &self.pieces[1..];
                    self.piece_off = 0;
                }
                at += k;
                n -= k;
            } else {
                unreachable!("a frame's buffers hold exactly its bytes");
            }
        }
        Ok(())
    }
}

/// A claimed chain whose one buffer, at `addr`, holds the whole `need` bytes.
struct OneBuffer<'h> {
    head: &'h Head,
    addr: u64,
    need: usize,
}

/// Writes a frame into one buffer front to back, without the bookkeeping of a frame
/// spread over buffers and chains, and records its used entry (published with
/// `publish`). A buffer found unmapped goes back unused, as in `write_frame_in`.
#[inline(always)]
fn fill_one(
    ring: &mut Vq,
    hm: &HostMem<'_>,
    one: OneBuffer<'_>,
    hdr: (&[u8; HDR_LEN], usize),
    src: Source<'_>,
    publish: bool,
) -> Result<usize, RxError> {
    if write_one_buffer(hm, one.addr, one.need, hdr, src).is_err() {
        ring.put_used(hm, one.head, 0);
        ring.publish_used(hm);
        return Err(RxError::BadAddress);
    }
    let base = ring.used_pos();
    if !ring.put_used(hm, one.head, one.need as u32) || (publish && !ring.publish_used(hm)) {
        ring.rewind_used(base);
        return Err(RxError::BadAddress);
    }
    Ok(1)
}

/// Writes the header (its first `hdr.1` bytes), then the frame (`need` bytes in
/// all), into the one buffer at `addr` that holds both: translated once when it
/// lies in one region (nearly always), else range by range.
fn write_one_buffer(
    hm: &HostMem<'_>,
    addr: u64,
    need: usize,
    hdr: (&[u8; HDR_LEN], usize),
    src: Source<'_>,
) -> Result<(), BadRange> {
    match hm.writable(addr, need) {
        Some(buf) => write_into(&buf, hdr, src),
        None => write_into(&Ranges { hm, addr }, hdr, src),
    }
}

/// Where `write_into` writes: a buffer found in one region, or guest ranges.
trait Sink {
    fn put(&self, off: usize, bytes: &[u8]) -> Result<(), BadRange>;
    /// Writes the first `len` bytes of `hdr` at the start.
    fn put_hdr(&self, hdr: &[u8; HDR_LEN], len: usize) -> Result<(), BadRange> {
        self.put(0, &hdr[..len])
    }
    fn put_guest(&self, off: usize, from: &HostMem<'_>, a: u64, len: usize)
        -> Result<(), BadRange>;
}

impl Sink for Writable<'_> {
    fn put(&self, off: usize, bytes: &[u8]) -> Result<(), BadRange> {
        self.write_at(off, bytes)
    }
    /// All of `hdr` in one move of known size where the range holds it, even for
    /// a 10-byte header: what follows the header is written next, over the rest.
    fn put_hdr(&self, hdr: &[u8; HDR_LEN], len: usize) -> Result<(), BadRange> {
        if self.size() >= HDR_LEN {
            self.write_array_at(0, hdr)
        } else {
            self.write_at(0, &hdr[..len])
        }
    }
    fn put_guest(
        &self,
        off: usize,
        from: &HostMem<'_>,
        a: u64,
        len: usize,
    ) -> Result<(), BadRange> {
        self.copy_from_guest_at(off, from, a, len)
    }
}

/// Guest memory from `addr` on, each write translated on its own.
struct Ranges<'h, 'm> {
    hm: &'h HostMem<'m>,
    addr: u64,
}

impl Sink for Ranges<'_, '_> {
    fn put(&self, off: usize, bytes: &[u8]) -> Result<(), BadRange> {
        self.hm.write(self.addr + off as u64, bytes)
    }
    fn put_guest(
        &self,
        off: usize,
        from: &HostMem<'_>,
        a: u64,
        len: usize,
    ) -> Result<(), BadRange> {
        self.hm
            .copy_from_guest(self.addr + off as u64, from, a, len)
    }
}

/// Writes `hdr` (its first `hdr.1` bytes), then `src`'s bytes, one after another
/// into `to`.
fn write_into(
    to: &impl Sink,
    (hdr, hdr_len): (&[u8; HDR_LEN], usize),
    src: Source<'_>,
) -> Result<(), BadRange> {
    to.put_hdr(hdr, hdr_len)?;
    let mut at = hdr_len;
    let own = |at: &mut usize, parts: &[&[u8]]| {
        parts.iter().try_for_each(|p| {
            to.put(*at, p)?;
            *at += p.len();
            Ok(())
        })
    };
    match src {
        Source::Own(parts) => own(&mut at, parts),
        Source::Guest { head, tail } => {
            own(&mut at, head)?;
            let from = HostMem::new(tail.mem);
            tail.pieces.iter().try_for_each(|&(a, l)| {
                to.put_guest(at, &from, a, l as usize)?;
                at += l as usize;
                Ok(())
            })
        }
    }
}

/// Walks the claimed RX descriptors while bytes are copied into them.
struct Filler<'s, D, C> {
    descs: D,
    chain_of_desc: C,
    /// addr, room left, chain index
    cur: Option<(u64, usize, usize)>,
    written: &'s mut Vec<usize>,
}

impl<'s, D, C> Filler<'s, D, C>
where
    D: Iterator<Item = &'s (u64, usize)>,
    C: Iterator<Item = usize>,
{
    /// The next stretch of room: (guest address, bytes), at most `want`.
    fn room(&mut self, want: usize) -> (u64, usize) {
        let (addr, room, ci) = match self.cur {
            Some(c) if c.1 > 0 => c,
            _ => {
                let (Some(&(a, l)), Some(ci)) = (self.descs.next(), self.chain_of_desc.next())
                else {
                    unreachable!("capacity was checked before copying");
                };
                (a, l, ci)
            }
        };
        let n = room.min(want);
        self.written[ci] += n;
        self.cur = Some((addr + n as u64, room - n, ci));
        (addr, n)
    }

    fn own(&mut self, hm: &HostMem<'_>, mut src: &[u8]) -> Result<(), BadRange> {
        while !src.is_empty() {
            let (addr, n) = self.room(src.len());
            hm.write(addr, &src[..n])?;
            src = &src[n..];
        }
        Ok(())
    }

    fn guest(
        &mut self,
        hm: &HostMem<'_>,
        from: &HostMem<'_>,
        mut at: u64,
        mut len: usize,
    ) -> Result<(), BadRange> {
        while len > 0 {
            let (addr, n) = self.room(len);
            hm.copy_from_guest(addr, from, at, n)?;
            at += n as u64;
            len -= n;
        }
        Ok(())
    }
}

/// Hands back claimed chains with nothing written, and publishes them.
fn return_unused<'h>(ring: &mut Vq, hm: &HostMem<'_>, heads: impl IntoIterator<Item = &'h Head>) {
    for head in heads {
        ring.put_used(hm, head, 0);
    }
    ring.publish_used(hm);
}

/// Gives claimed chains back to the ring untouched: the next frame claims them.
fn give_back_all(ring: &mut Vq, chains: &[(Head, usize)]) {
    if let Some((first, _)) = chains.first() {
        ring.rewind(first);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testkit::frames::pattern;
    use virtio_bindings::virtio_ring::{VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
    use virtio_queue::desc::{split::Descriptor, RawDescriptor};
    use virtio_queue::mock::MockSplitQueue;
    use virtio_queue::Queue;
    use vm_memory::{Bytes, GuestAddress};

    const W: u16 = VRING_DESC_F_WRITE as u16;
    const N: u16 = VRING_DESC_F_NEXT as u16;

    fn mem() -> GuestMem {
        GuestMem::from_ranges(&[(GuestAddress(0), 0x100000)]).unwrap()
    }

    /// Posts `count` chains of `per_chain` descriptors of `size` bytes each.
    fn post(mock: &MockSplitQueue<GuestMem>, count: u16, per_chain: u16, size: u32) {
        let mut descs = Vec::new();
        for c in 0..count {
            for d in 0..per_chain {
                let idx = c * per_chain + d;
                let flags = if d + 1 < per_chain { W | N } else { W };
                let addr = 0x10000 + idx as u64 * 0x1000;
                descs.push(RawDescriptor::from(Descriptor::new(
                    addr,
                    size,
                    flags,
                    idx + 1,
                )));
            }
        }
        mock.build_multiple_desc_chains(&descs).unwrap();
    }

    fn used(mock: &MockSplitQueue<GuestMem>, i: u16) -> (u32, u32) {
        let e = mock.used().ring().ref_at(i as usize).unwrap().load();
        (e.id(), e.len())
    }

    /// The bytes of the first `chains` buffers `post(.., 1, 1000)` posted, in order.
    fn posted_bytes(m: &GuestMem, chains: u64) -> Vec<u8> {
        let mut got = vec![0u8; chains as usize * 1000];
        for (c, piece) in got.chunks_mut(1000).enumerate() {
            m.read_slice(piece, GuestAddress(0x10000 + c as u64 * 0x1000))
                .unwrap();
        }
        got
    }

    /// Writes `parts` behind a default header, as a 12-byte-header guest sees them.
    fn put(q: &mut Queue, m: &GuestMem, parts: &[&[u8]], mrg: bool) -> Result<usize, RxError> {
        let fmt = RxFormat {
            hdr_len: 12,
            mrg_rxbuf: mrg,
            indirect: true,
        };
        write_frame(
            q,
            m,
            &mut RxScratch::default(),
            &VirtioNetHdr::default(),
            fmt,
            parts,
        )
    }

    #[test]
    fn mrg_rxbuf_spans_chains_and_counts_buffers() {
        let m = mem();
        let mock = MockSplitQueue::new(&m, 16);
        post(&mock, 4, 1, 1000);
        let mut q: Queue = mock.create_queue().unwrap();
        let data = pattern(2500);
        // Odd split of the source too.
        let n = put(&mut q, &m, &[&data[..7], &data[7..]], true).unwrap();
        assert_eq!(n, 3);
        assert_eq!(used(&mock, 0), (0, 1000));
        assert_eq!(used(&mock, 1), (1, 1000));
        assert_eq!(used(&mock, 2), (2, 512));
        let got = posted_bytes(&m, 3);
        let h = VirtioNetHdr::from_bytes(&got[..12]).unwrap();
        assert_eq!(h.num_buffers, 3);
        assert_eq!(&got[12..2512], &data[..]);
    }

    #[test]
    fn a_malformed_chain_goes_back_after_the_chains_claimed_before_it() {
        // Buffers are used in the order they were made available (VIRTIO_F_IN_ORDER
        // relies on it): a frame that claimed chain 0 and found chain 1 malformed
        // hands back 0, then 1.
        let m = mem();
        let mock = MockSplitQueue::new(&m, 16);
        let descs = [
            Descriptor::new(0x10000, 1000, W, 0),
            Descriptor::new(0x11000, 1000, 0, 0),
        ];
        mock.build_multiple_desc_chains(&descs.map(RawDescriptor::from))
            .unwrap();
        let mut q: Queue = mock.create_queue().unwrap();
        let r = put(&mut q, &m, &[&pattern(1500)], true);
        assert_eq!(r, Err(RxError::ReadableDescriptor));
        assert_eq!(mock.used().idx().load(), 2);
        assert_eq!((used(&mock, 0), used(&mock, 1)), ((0, 0), (1, 0)));
    }

    #[test]
    fn a_frame_from_another_guest_is_copied_straight_into_the_chains() {
        let m = mem();
        let mock = MockSplitQueue::new(&m, 16);
        post(&mock, 4, 1, 1000);
        let mut q: Queue = mock.create_queue().unwrap();
        // The sender: its headers already copied out (`head`), its payload in two
        // pieces of its own memory.
        let other = GuestMem::from_ranges(&[(GuestAddress(0x40000), 0x4000)]).unwrap();
        let data = pattern(2500);
        other
            .write_slice(&data[54..1054], GuestAddress(0x40100))
            .unwrap();
        other
            .write_slice(&data[1054..], GuestAddress(0x42000))
            .unwrap();
        let from = &other;
        let pieces = [(0x40100u64, 1000u32), (0x42000, 1446)];
        let tail = GuestTail {
            mem: from,
            pieces: &pieces,
            len: 2446,
        };
        let head = [&data[..54]];
        let src = Source::Guest {
            head: &head,
            tail: &tail,
        };
        let hm = HostMem::new(&m);
        let mut ring = Vq::of(&q, false);
        let fmt = RxFormat {
            hdr_len: 12,
            mrg_rxbuf: true,
            indirect: false,
        };
        let hdr = VirtioNetHdr::default();
        let r = write_frame_in(
            &mut ring,
            &hm,
            &mut RxScratch::default(),
            &hdr,
            fmt,
            src,
            true,
        );
        assert_eq!(r, Ok(3));
        ring.store(&mut q);
        let got = posted_bytes(&m, 3);
        assert_eq!(&got[12..2512], &data[..]);
        // A piece outside the sender's memory: nothing published, the chains handed
        // back empty.
        post(&mock, 4, 1, 1000);
        let bad = [(0x50000u64, 100u32)];
        let tail = GuestTail {
            mem: from,
            pieces: &bad,
            len: 100,
        };
        let src = Source::Guest {
            head: &head,
            tail: &tail,
        };
        let mut ring = Vq::of(&q, false);
        let r = write_frame_in(
            &mut ring,
            &hm,
            &mut RxScratch::default(),
            &hdr,
            fmt,
            src,
            true,
        );
        assert_eq!(r, Err(RxError::BadAddress));
    }

    #[test]
    fn multi_descriptor_chain_without_mrg() {
        let m = mem();
        let mock = MockSplitQueue::new(&m, 16);
        post(&mock, 1, 3, 100);
        let mut q: Queue = mock.create_queue().unwrap();
        let data = pattern(250);
        assert_eq!(put(&mut q, &m, &[&data], false), Ok(1));
        assert_eq!(used(&mock, 0), (0, 262));
    }

    #[test]
    fn too_small_without_mrg_leaves_buffer_in_place() {
        let m = mem();
        let mock = MockSplitQueue::new(&m, 16);
        post(&mock, 2, 1, 100);
        let mut q: Queue = mock.create_queue().unwrap();
        let data = pattern(200);
        assert_eq!(
            put(&mut q, &m, &[&data], false),
            Err(RxError::BufferTooSmall {
                have: 100,
                need: 212
            })
        );
        assert_eq!(q.next_avail(), 0);
        // A frame that fits still goes into that same first buffer.
        assert_eq!(put(&mut q, &m, &[&data[..50]], false), Ok(1));
        assert_eq!(used(&mock, 0), (0, 62));
    }

    #[test]
    fn not_enough_buffers_claims_nothing() {
        let m = mem();
        let mock = MockSplitQueue::new(&m, 16);
        post(&mock, 2, 1, 1000);
        let mut q: Queue = mock.create_queue().unwrap();
        let data = pattern(5000);
        assert_eq!(put(&mut q, &m, &[&data], true), Err(RxError::NoBuffers));
        assert_eq!(q.next_avail(), 0);
        assert_eq!(mock.used().idx().load(), 0);
    }

    #[test]
    fn buffer_outside_memory_is_dropped_and_returned() {
        let m = mem();
        let mock = MockSplitQueue::new(&m, 16);
        let d = Descriptor::new(0x200000, 2000, W, 0);
        mock.build_desc_chain(&[RawDescriptor::from(d)]).unwrap();
        let mut q: Queue = mock.create_queue().unwrap();
        assert_eq!(
            put(&mut q, &m, &[&pattern(100)], true),
            Err(RxError::BadAddress)
        );
        assert_eq!(mock.used().idx().load(), 1);
        assert_eq!(used(&mock, 0), (0, 0));
    }

    /// Posts one chain: a descriptor pointing at an indirect table of `n` writable
    /// descriptors of `len` bytes each.
    fn post_indirect(m: &GuestMem, mock: &MockSplitQueue<GuestMem>, n: u16, len: u32) {
        use virtio_bindings::virtio_ring::VRING_DESC_F_INDIRECT;
        let table = 0x80000u64;
        for i in 0..n {
            let flags = if i + 1 < n { W | N } else { W };
            let d = Descriptor::new(0x10000 + u64::from(i % 16) * 0x100, len, flags, i + 1);
            m.write_obj(
                RawDescriptor::from(d),
                GuestAddress(table + 16 * u64::from(i)),
            )
            .unwrap();
        }
        let ind = Descriptor::new(table, 16 * u32::from(n), VRING_DESC_F_INDIRECT as u16, 0);
        mock.build_desc_chain(&[RawDescriptor::from(ind)]).unwrap();
    }

    fn fmt(indirect: bool) -> RxFormat {
        RxFormat {
            hdr_len: 12,
            mrg_rxbuf: true,
            indirect,
        }
    }

    /// Writes `data` behind a default header with MRG_RXBUF.
    fn mrg_write(
        q: &mut Queue,
        m: &GuestMem,
        scratch: &mut RxScratch,
        indirect: bool,
        data: &[u8],
    ) -> Result<usize, RxError> {
        write_frame(
            q,
            m,
            scratch,
            &VirtioNetHdr::default(),
            fmt(indirect),
            &[data],
        )
    }

    #[test]
    fn hostile_chains_cost_bounded_work_and_are_consumed() {
        let m = mem();
        let data = pattern(100);
        // Indirect tables the guest did not negotiate; empty descriptors (indirect
        // negotiated); more descriptors than the queue has entries.
        for (indirect, n, len) in [(false, 4000u16, 0u32), (true, 4000, 0), (true, 100, 1)] {
            let mock = MockSplitQueue::new(&m, 16);
            post_indirect(&m, &mock, n, len);
            let mut q: Queue = mock.create_queue().unwrap();
            let mut scratch = RxScratch::default();
            let r = mrg_write(&mut q, &m, &mut scratch, indirect, &data);
            assert_eq!(r, Err(RxError::BadChain), "{indirect} {n} {len}");
            // The chain was consumed (returned used, empty): the ring goes on.
            assert_eq!(mock.used().idx().load(), 1);
            assert_eq!(used(&mock, 0), (0, 0));
            assert!(scratch.descs.capacity() <= MAX_DESCS_PER_FRAME);
        }
    }

    #[test]
    fn a_chain_without_descriptors_is_malformed() {
        let m = mem();
        let mock = MockSplitQueue::new(&m, 16);
        post(&mock, 1, 1, 1000);
        // The first avail entry names a head outside the 16-entry table; the second
        // is the good chain.
        mock.avail().ring().ref_at(0).unwrap().store(20);
        mock.avail().ring().ref_at(1).unwrap().store(0);
        mock.avail().idx().store(2);
        let mut q: Queue = mock.create_queue().unwrap();
        let data = pattern(100);
        // Before: written into the good chain with num_buffers 2, one used entry.
        assert_eq!(put(&mut q, &m, &[&data], true), Err(RxError::BadChain));
        assert_eq!(mock.used().idx().load(), 0);
        assert_eq!(put(&mut q, &m, &[&data], true), Ok(1));
        assert_eq!(used(&mock, 0), (0, 112));
        let mut h = [0u8; 12];
        m.read_slice(&mut h, GuestAddress(0x10000)).unwrap();
        assert_eq!(VirtioNetHdr::from_bytes(&h).unwrap().num_buffers, 1);
    }

    #[test]
    fn a_chain_longer_than_4_gib_is_malformed() {
        // An indirect table whose writable descriptors add up to more than
        // u32::MAX bytes (the first would take the whole frame): virtio-queue ends
        // the chain before the descriptor that passes it.
        use virtio_bindings::virtio_ring::VRING_DESC_F_INDIRECT;
        let m = mem();
        let mock = MockSplitQueue::new(&m, 16);
        let table = 0x80000u64;
        for (i, (len, flags)) in [(0x8000_0000u32, W | N), (0x8000_0000, W)]
            .into_iter()
            .enumerate()
        {
            let d = Descriptor::new(0x10000 + i as u64 * 0x1000, len, flags, i as u16 + 1);
            m.write_obj(RawDescriptor::from(d), GuestAddress(table + 16 * i as u64))
                .unwrap();
        }
        let ind = Descriptor::new(table, 32, VRING_DESC_F_INDIRECT as u16, 0);
        mock.build_desc_chain(&[RawDescriptor::from(ind)]).unwrap();
        let mut q: Queue = mock.create_queue().unwrap();
        let r = mrg_write(&mut q, &m, &mut RxScratch::default(), true, &pattern(100));
        // Before: claimed, the frame written into the first descriptor.
        assert_eq!(r, Err(RxError::BadChain));
        assert_eq!(mock.used().idx().load(), 1);
        assert_eq!(used(&mock, 0), (0, 0));
    }

    #[test]
    fn a_well_formed_indirect_chain_is_written() {
        let m = mem();
        let mock = MockSplitQueue::new(&m, 16);
        post_indirect(&m, &mock, 4, 64);
        let mut q: Queue = mock.create_queue().unwrap();
        let r = mrg_write(&mut q, &m, &mut RxScratch::default(), true, &pattern(100));
        assert_eq!(r, Ok(1));
        assert_eq!(used(&mock, 0), (0, 112));
    }

    #[test]
    fn tiny_buffers_cannot_make_one_frame_cost_more_than_the_cap() {
        let m = mem();
        let mock = MockSplitQueue::new(&m, 1024);
        post(&mock, 400, 1, 16);
        let mut q: Queue = mock.create_queue().unwrap();
        let mut scratch = RxScratch::default();
        let r = mrg_write(&mut q, &m, &mut scratch, false, &pattern(6000));
        assert_eq!(r, Err(RxError::TooFragmented));
        // Nothing claimed: the buffers stay posted for frames that fit.
        assert_eq!(q.next_avail(), 0);
        assert_eq!(mock.used().idx().load(), 0);
        assert!(scratch.chains.capacity() <= 2 * MAX_CHAINS_PER_FRAME);
        let r = mrg_write(&mut q, &m, &mut scratch, false, &pattern(200));
        assert_eq!(r, Ok(14));
    }

    #[test]
    fn a_frame_is_published_whole_or_not_at_all() {
        let m = mem();
        let mock = MockSplitQueue::new(&m, 16);
        post(&mock, 4, 1, 1000);
        let mut q: Queue = mock.create_queue().unwrap();
        // A used ring whose first entry is the last thing in guest memory: a
        // two-buffer frame can write its first entry, not its second.
        let used_at = 0x100000 - 4 - 8;
        q.set_used_ring_address(Some(used_at as u32), Some(0));
        let r = put(&mut q, &m, &[&pattern(1500)], true);
        assert_eq!(r, Err(RxError::BadAddress));
        // Before: the index moved to 1, a frame with num_buffers 2 and one buffer.
        let idx: u16 = m.read_obj(GuestAddress(used_at + 2)).unwrap();
        assert_eq!(idx, 0);
    }

    #[test]
    fn event_idx_counts_every_buffer_of_a_frame() {
        for (used_event, call) in [(0u16, true), (2, true), (3, false), (9, false)] {
            let m = mem();
            let mock = MockSplitQueue::new(&m, 16);
            post(&mock, 4, 1, 1000);
            let mut q: Queue = mock.create_queue().unwrap();
            q.set_event_idx(true);
            // The mock's used ring overlaps used_event (the guest wants a call once
            // the used index passes it, right after the avail ring): move it away.
            let used_at = 0x8000u64;
            q.set_used_ring_address(Some(used_at as u32), Some(0));
            m.write_obj(used_event, GuestAddress(q.avail_ring() + 4 + 2 * 16))
                .unwrap();
            assert_eq!(put(&mut q, &m, &[&pattern(2500)], true), Ok(3));
            let idx: u16 = m.read_obj(GuestAddress(used_at + 2)).unwrap();
            assert_eq!(idx, 3);
            let last: [u32; 2] = m.read_obj(GuestAddress(used_at + 4 + 2 * 8)).unwrap();
            assert_eq!(last, [2, 512]);
            let ring = crate::ring::split::SplitRing::of(&q);
            let since = std::num::Wrapping(0);
            assert_eq!(
                ring.wants_call(&HostMem::new(&m), since),
                call,
                "used_event {used_event}"
            );
        }
    }

    /// A packed RX ring of `size` at 0x8000 and the driver that posts into it.
    fn packed_rx(m: &GuestMem, size: u16) -> (crate::testkit::packed_driver::Driver, Vq) {
        let d = crate::testkit::packed_driver::Driver::new(m, 0x8000, size);
        let ring =
            crate::ring::packed::PackedRing::new(d.ring, d.driver_area, d.device_area, size, false);
        (
            d,
            Vq::Packed {
                ring,
                store: Vec::new(),
            },
        )
    }

    const MRG_FMT: RxFormat = RxFormat {
        hdr_len: 12,
        mrg_rxbuf: true,
        indirect: true,
    };

    #[test]
    fn packed_buffers_that_hold_a_frame_alone_and_all_others_are_written_as_they_allow() {
        let m = mem();
        let hm = HostMem::new(&m);
        let (mut d, mut vq) = packed_rx(&m, 8);
        let fmt = MRG_FMT;
        let mut scratch = RxScratch::default();
        let hdr = VirtioNetHdr::default();
        let mut put = |vq: &mut Vq, len: usize| {
            let frame = pattern(len);
            let src = Source::Own(&[&frame]);
            let r = write_frame_in(vq, &hm, &mut scratch, &hdr, fmt, src, true);
            (r, frame)
        };
        // One writable buffer that holds the frame.
        let a = d.add(&m, &[(0x10000, 2048, true)]);
        let (r, frame) = put(&mut vq, 100);
        assert_eq!(r, Ok(1));
        assert_eq!(d.get_used(&m), Some((a, 112)));
        let mut got = vec![0u8; 100];
        m.read_slice(&mut got, GuestAddress(0x10000 + 12)).unwrap();
        assert_eq!(got, frame);
        // A readable one of the same size is refused and given back empty.
        let b = d.add(&m, &[(0x11000, 2048, false)]);
        assert_eq!(put(&mut vq, 100).0, Err(RxError::ReadableDescriptor));
        assert_eq!(d.get_used(&m), Some((b, 0)));
        // A frame over two buffers, then a small one into one again.
        let c = d.add(&m, &[(0x12000, 2048, true)]);
        let e = d.add(&m, &[(0x13000, 2048, true)]);
        assert_eq!(put(&mut vq, 3000).0, Ok(2));
        assert_eq!(d.get_used(&m), Some((c, 2048)));
        assert_eq!(d.get_used(&m), Some((e, 964)));
        let f = d.add(&m, &[(0x14000, 2048, true)]);
        assert_eq!(put(&mut vq, 200).0, Ok(1));
        assert_eq!(d.get_used(&m), Some((f, 212)));
        // A frame larger than the buffers that last needed two, into one large one.
        let g = d.add(&m, &[(0x16000, 8192, true)]);
        let (r, frame) = put(&mut vq, 5000);
        assert_eq!(r, Ok(1));
        assert_eq!(d.get_used(&m), Some((g, 5012)));
        let mut got = vec![0u8; 5000];
        m.read_slice(&mut got, GuestAddress(0x16000 + 12)).unwrap();
        assert_eq!(got, frame);
        // Not posted yet: nothing is taken.
        assert_eq!(put(&mut vq, 100).0, Err(RxError::NoBuffers));
    }

    #[test]
    fn a_packed_ring_takes_frames_across_its_end_and_shows_them_at_the_publish() {
        let m = mem();
        let hm = HostMem::new(&m);
        // A ring of 4: the buffers of the second round sit across its end.
        let (mut d, mut vq) = packed_rx(&m, 4);
        let fmt = MRG_FMT;
        let mut scratch = RxScratch::default();
        let hdr = VirtioNetHdr::default();
        for round in 0..3u64 {
            // One buffer of two descriptors (500 + 500), then one of 1000.
            let base = 0x10000 + round * 0x4000;
            d.add(&m, &[(base, 500, true), (base + 0x1000, 500, true)]);
            d.add(&m, &[(base + 0x2000, 1000, true)]);
            let frame = pattern(1400 + round as usize);
            let src = Source::Own(&[&frame]);
            let r = write_frame_in(&mut vq, &hm, &mut scratch, &hdr, fmt, src, false);
            assert_eq!(r, Ok(2), "round {round}");
            // Recorded, not visible yet.
            assert_eq!(d.get_used(&m), None);
            assert!(vq.publish_used(&hm));
            let a = d.get_used(&m).expect("first buffer used");
            let b = d.get_used(&m).expect("second buffer used");
            assert_eq!((a.1, b.1), (1000, 412 + round as u32));
            let mut got = vec![0u8; 1412 + round as usize];
            m.read_slice(&mut got[..500], GuestAddress(base)).unwrap();
            m.read_slice(&mut got[500..1000], GuestAddress(base + 0x1000))
                .unwrap();
            m.read_slice(&mut got[1000..], GuestAddress(base + 0x2000))
                .unwrap();
            let h = VirtioNetHdr::from_bytes(got[..12].try_into().unwrap()).unwrap();
            assert_eq!(h.num_buffers, 2);
            assert_eq!(&got[12..], &frame[..]);
        }
        // Nothing posted: the frame is refused and nothing is taken.
        let frame = pattern(100);
        let src = Source::Own(&[&frame]);
        let r = write_frame_in(&mut vq, &hm, &mut scratch, &hdr, fmt, src, true);
        assert_eq!(r, Err(RxError::NoBuffers));
        // A buffer too small without MRG_RXBUF stays posted for the next frame.
        let id = d.add(&m, &[(0x30000, 64, true)]);
        let small = RxFormat {
            mrg_rxbuf: false,
            ..fmt
        };
        let r = write_frame_in(&mut vq, &hm, &mut scratch, &hdr, small, src, true);
        assert!(matches!(r, Err(RxError::BufferTooSmall { .. })));
        let tiny = pattern(40);
        let src = Source::Own(&[&tiny]);
        assert_eq!(
            write_frame_in(&mut vq, &hm, &mut scratch, &hdr, small, src, true),
            Ok(1)
        );
        assert_eq!(d.get_used(&m), Some((id, 52)));
    }
}

//! Walking a scatter list: a cursor handing out sub-slices, and the recycled slice
//! lists and header buffers the protocol loops build segments in.

use super::csum::Checksum;
use super::parse::Headers;
use super::truncated;
use super::SegmentError;

/// Walks a scatter list forward, handing out sub-slices.
pub(crate) struct Cursor<'f> {
    frame: &'f [&'f [u8]],
    idx: usize,
    off: usize,
}

impl<'f> Cursor<'f> {
    pub fn new(frame: &'f [&'f [u8]]) -> Self {
        Cursor {
            frame,
            idx: 0,
            off: 0,
        }
    }

    /// A cursor at the payload, past the frame's `h.hdr_len()` header bytes.
    pub fn at_payload(frame: &'f [&'f [u8]], h: &Headers) -> Result<Self, SegmentError> {
        Self::at_payload_from(frame, h, 0)
    }

    /// A cursor `skip` bytes into the payload (past segments that went out earlier).
    pub fn at_payload_from(
        frame: &'f [&'f [u8]],
        h: &Headers,
        skip: usize,
    ) -> Result<Self, SegmentError> {
        let mut cur = Cursor::new(frame);
        let at = h.hdr_len() + skip;
        if cur.skip(at) {
            Ok(cur)
        } else {
            Err(truncated(at, h.frame_len))
        }
    }

    /// Advances `n` bytes; false if the frame ends first.
    pub fn skip(&mut self, n: usize) -> bool {
        self.walk(n, |_| {})
    }

    /// Appends the next `n` bytes as sub-slices to `out`, adding them to `sum` if given.
    #[inline]
    pub fn take<'x>(
        &mut self,
        n: usize,
        out: &mut Vec<&'x [u8]>,
        sum: Option<&mut Checksum>,
    ) -> bool
    where
        'f: 'x,
    {
        match sum {
            Some(c) => self.walk(n, |s| {
                c.add_bytes(s);
                out.push(s);
            }),
            None => self.walk(n, |s| out.push(s)),
        }
    }

    /// Sums the next `n` bytes without handing them out.
    pub fn sum(&mut self, n: usize, c: &mut Checksum) -> bool {
        self.walk(n, |s| c.add_bytes(s))
    }

    #[inline]
    fn walk(&mut self, mut n: usize, mut f: impl FnMut(&'f [u8])) -> bool {
        while n > 0 {
            let Some(s) = self.frame.get(self.idx) else {
                return false;
            };
            let avail = &s[self.off.min(s.len())..];
            if avail.is_empty() {
                self.idx += 1;
                self.off = 0;
                continue;
            }
            let k = n.min(avail.len());
            f(&avail[..k]);
            self.off += k;
            n -= k;
        }
        true
    }
}

/// Reuses the allocation of a slice list across calls whose slices live for different
/// lifetimes (the list is always empty in between).
#[inline]
fn recycle<'a, 'b>(mut v: Vec<&'a [u8]>) -> Vec<&'b [u8]> {
    v.clear();
    v.into_iter().map(|_| -> &'b [u8] { &[] }).collect()
}

/// The per-call working buffers handed to the protocol loops.
pub(crate) struct Bufs<'s> {
    /// Copy of the input's headers (at least `Headers::hdr_len` bytes).
    pub tmpl: &'s [u8],
    /// Headers of the segment being built.
    pub hdr: &'s mut Vec<u8>,
    pub spare: &'s mut Vec<&'static [u8]>,
}

/// An empty slice list on the recycled allocation.
#[inline]
pub(crate) fn take_parts<'x>(spare: &mut Vec<&'static [u8]>) -> Vec<&'x [u8]> {
    recycle(std::mem::take(spare))
}

/// Returns a slice list's allocation for the next segment.
#[inline]
pub(crate) fn give_back(spare: &mut Vec<&'static [u8]>, parts: Vec<&[u8]>) {
    *spare = recycle(parts);
}

//! Software GSO engine: pure functions over bytes, no I/O.
// Interface only until the engine lands.
use crate::vnet_hdr::{GsoKind, VirtioNetHdr};
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum CsumMode {
    #[default]
    Full,
    Partial,
}
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SegmentOpts {
    pub csum: CsumMode,
    pub max_frame: Option<usize>,
}
pub struct Segment<'a> {
    pub vnet: VirtioNetHdr,
    pub parts: &'a [&'a [u8]],
}
pub struct SegmentSummary {
    pub kind: GsoKind,
    pub segments: usize,
    pub mss: usize,
    pub bytes: usize,
}
#[derive(Debug, thiserror::Error)]
#[error("not available")]
pub struct SegmentError;
#[derive(Default)]
pub struct Segmenter;
impl Segmenter {
    pub fn segment<F: FnMut(&Segment<'_>) -> bool>(
        &mut self,
        _h: &VirtioNetHdr,
        _f: &[&[u8]],
        _o: &SegmentOpts,
        _e: F,
    ) -> Result<SegmentSummary, SegmentError> {
        Err(SegmentError)
    }
}

//! Guest memory as byte slices: every guest address is checked against the memory
//! map; a range that is not fully mapped is an error, never a fault.

use thiserror::Error;
use vm_memory::{GuestAddress, GuestMemoryBackend, GuestMemoryMmap};

/// Guest memory as mapped from the frontend's memory table (no dirty bitmap).
pub type GuestMem = GuestMemoryMmap<()>;

#[derive(Debug, Error, Clone, Copy, PartialEq, Eq)]
#[error("guest range {addr:#x}+{len} is not mapped")]
pub struct BadRange {
    pub addr: u64,
    pub len: usize,
}

/// Appends the host views of `[addr, addr+len)` to `out`, one slice per memory region
/// the range crosses.
pub fn readable<'m>(
    mem: &'m GuestMem,
    addr: u64,
    len: usize,
    out: &mut Vec<&'m [u8]>,
) -> Result<(), BadRange> {
    let bad = BadRange { addr, len };
    let mut seen = 0;
    for slice in mem.get_slices(GuestAddress(addr), len) {
        let slice = slice.map_err(|_| bad)?;
        // SAFETY: the slice lies inside a mapping owned by `mem`, which outlives 'm.
        // The guest may write these bytes concurrently; we only read them (checksums,
        // copies, writev), and the header, the one part we act on, is copied out first.
        let bytes = unsafe { std::slice::from_raw_parts(slice.ptr_guard().as_ptr(), slice.len()) };
        seen += bytes.len();
        out.push(bytes);
    }
    if seen == len {
        Ok(())
    } else {
        Err(bad)
    }
}

/// Copies `data` into guest memory at `addr`; the whole range must be mapped.
pub fn write(mem: &GuestMem, addr: u64, data: &[u8]) -> Result<(), BadRange> {
    use vm_memory::Bytes;
    mem.write_slice(data, GuestAddress(addr))
        .map_err(|_| BadRange {
            addr,
            len: data.len(),
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn two_regions() -> GuestMem {
        GuestMem::from_ranges(&[(GuestAddress(0), 0x1000), (GuestAddress(0x1000), 0x1000)]).unwrap()
    }

    #[test]
    fn range_across_regions_gives_two_slices() {
        let mem = two_regions();
        let mut out = Vec::new();
        readable(&mem, 0xff0, 0x20, &mut out).unwrap();
        assert_eq!(
            out.iter().map(|s| s.len()).collect::<Vec<_>>(),
            vec![0x10, 0x10]
        );
    }

    #[test]
    fn unmapped_range_is_an_error() {
        let mem = two_regions();
        let mut out = Vec::new();
        assert!(readable(&mem, 0x1ff0, 0x20, &mut out).is_err());
        assert!(readable(&mem, 0x9000, 1, &mut out).is_err());
        assert!(readable(&mem, u64::MAX, 2, &mut out).is_err());
        assert!(write(&mem, 0x1fff, &[1, 2]).is_err());
    }
}

//! Guest memory as mapped from the frontend's memory table. It is only ever read and
//! written through vm-memory's accessors (volatile copies): the guest may change
//! these bytes at any time, so gsonet never holds a plain `&[u8]` over them.

use thiserror::Error;
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

/// Guest memory as mapped from the frontend's memory table (no dirty bitmap).
pub type GuestMem = GuestMemoryMmap<()>;

#[derive(Debug, Error, Clone, Copy, PartialEq, Eq)]
#[error("guest range {addr:#x}+{len} is not mapped")]
pub struct BadRange {
    pub addr: u64,
    pub len: usize,
}

/// Copies `data` into guest memory at `addr`; the whole range must be mapped.
pub fn write(mem: &GuestMem, addr: u64, data: &[u8]) -> Result<(), BadRange> {
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
    fn writes_across_regions_and_refuses_unmapped_ranges() {
        let mem = two_regions();
        write(&mem, 0xff0, &[7; 0x20]).unwrap();
        let mut back = [0u8; 0x20];
        mem.read_slice(&mut back, GuestAddress(0xff0)).unwrap();
        assert_eq!(back, [7; 0x20]);
        assert!(write(&mem, 0x1ff0, &[0; 0x20]).is_err());
        assert!(write(&mem, 0x9000, &[1]).is_err());
        assert!(write(&mem, u64::MAX, &[1, 2]).is_err());
    }
}

//! A port's packed rings' published used positions, kept in a small file mapped
//! shared, so that a gsonet started after one that died (or stopped, or closed the
//! connection) resumes each packed ring where the guest saw it last.
//!
//! A split ring does not need it: when its backend goes away without answering
//! GET_VRING_BASE, QEMU reads the used index back from guest memory
//! (hw/virtio/virtio.c, `virtio_queue_split_restore_last_avail_idx`). A packed ring
//! has no such index in memory, and QEMU keeps the position it sent at the ring's
//! last start (`virtio_queue_packed_restore_last_avail_idx` does nothing: "We don't
//! have a reference like avail idx in shared memory"). It sends that stale position
//! in the next SET_VRING_BASE; a device that starts there waits at a slot the
//! driver passed long ago, and the queue never moves again.
//!
//! Each queue's slot holds what identifies the ring's owner (the frontend's memory
//! files, the ring's size and descriptor ring, the base QEMU sent when the ring
//! started) and its used position as published: `begin` before a publish writes
//! the used entries (the position before and after), `commit` after it. The driver
//! sees a publish whole or not at all (its first entry's flags are written last),
//! so where the two differ, that first entry's flags in guest memory say which
//! side of the publish the guest is on (`Resume::resolve`). The writes are plain
//! stores into a shared mapping of a file: they outlive a SIGKILL.

use std::fs::OpenOptions;
use std::io;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::Path;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

use vm_memory::{FileOffset, MmapRegion, VolatileMemory};

use super::{is_used, Pos, DESC_SIZE, FLAGS_AT};
use crate::ring::host::HostMem;

const MAGIC: u32 = u32::from_le_bytes(*b"GSRR");
const VERSION: u32 = 1;
const HEADER: usize = 64;
const SLOT: usize = 32;
/// Offsets in a slot.
const MEM_ID: usize = 0;
const DESC: usize = 8;
const QEMU_BASE: usize = 16;
const POS: usize = 20;
const SIZE: usize = 24;
const STATE: usize = 28;

/// A slot's state.
const EMPTY: u32 = 0;
/// A ring gsonet runs: the frontend has not read its position back.
const RUNNING: u32 = 1;
/// The frontend read the position back (GET_VRING_BASE): it knows it.
const HANDED_BACK: u32 = 2;

/// The record file of a port.
pub struct RingRecord {
    map: MmapRegion<()>,
    queues: usize,
}

impl std::fmt::Debug for RingRecord {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RingRecord({} queues)", self.queues)
    }
}

/// What a ring's owner is, as the relay knows it when the ring starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Owner {
    /// The frontend's memory files (`mem_id`).
    pub mem: u64,
    pub size: u16,
    /// The vring base QEMU sent in SET_VRING_BASE (both halves).
    pub qemu_base: u32,
}

/// A ring's recorded position, to resume at.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Resume {
    /// The used position before the last publish begun, and after it.
    pub before: Pos,
    pub after: Pos,
    /// The descriptor ring the publish wrote into.
    pub desc: u64,
}

impl Resume {
    /// Where the ring stands: `after` if the last publish was made (its first
    /// entry, at `before`, is used under `before`'s wrap counter: the publish
    /// writes it last), else `before`. Without guest memory (or a ring outside it)
    /// `before`.
    pub fn resolve(&self, hm: Option<&HostMem<'_>>) -> Pos {
        if self.before == self.after {
            return self.before;
        }
        let slot = self.desc + u64::from(self.before.idx) * DESC_SIZE + FLAGS_AT;
        match hm.and_then(|hm| hm.load_u16(slot, Ordering::Acquire)) {
            Some(flags) if is_used(flags, self.before.wrap) => self.after,
            _ => self.before,
        }
    }
}

/// An identity for a set of memory files: the smallest (device, inode) of them,
/// which is the same for the same frontend process whatever order it sends them in.
pub fn mem_id(files: impl Iterator<Item = (u64, u64)>) -> u64 {
    files.map(|(dev, ino)| dev << 40 ^ ino).min().unwrap_or(0)
}

impl RingRecord {
    /// Opens (or creates) the record at `path` for `queues` queues. A file of
    /// another layout or size is started afresh. Only a regular file of gsonet's
    /// own user, with one name, not writable by others, is taken: whoever else put
    /// it there (the socket's directory may be another's, or world-writable) could
    /// otherwise point gsonet at a file to clobber, or tell it where to resume.
    pub fn open(path: &Path, queues: usize) -> io::Result<RingRecord> {
        let len = HEADER + SLOT * queues;
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            // Not through a symlink; a FIFO or device is refused below, not waited on.
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
            .open(path)?;
        let m = file.metadata()?;
        let refuse = |why: String| Err(io::Error::new(io::ErrorKind::InvalidInput, why));
        if !m.is_file() {
            return refuse("not a regular file".into());
        }
        if m.uid() != crate::sys::euid() {
            return refuse(format!("owned by uid {}, not gsonet's", m.uid()));
        }
        if m.nlink() != 1 {
            return refuse(format!("{} links to it", m.nlink()));
        }
        if m.mode() & 0o022 != 0 {
            return refuse(format!("writable by others (mode {:o})", m.mode() & 0o777));
        }
        let fresh = m.len() != len as u64;
        if fresh {
            file.set_len(0)?;
            file.set_len(len as u64)?;
        }
        let map = MmapRegion::<()>::from_file(FileOffset::new(file, 0), len)
            .map_err(|e| io::Error::other(e.to_string()))?;
        let rec = RingRecord { map, queues };
        let magic = rec.u32_at(0).map(|a| a.load(Ordering::Relaxed));
        let version = rec.u32_at(4).map(|a| a.load(Ordering::Relaxed));
        if fresh || magic != Some(MAGIC) || version != Some(VERSION) {
            for q in 0..queues {
                rec.set_state(q, EMPTY);
            }
            rec.store32(4, VERSION);
            rec.store32(8, queues as u32);
            rec.store32(0, MAGIC);
        }
        Ok(rec)
    }

    fn u32_at(&self, off: usize) -> Option<&AtomicU32> {
        self.map.get_atomic_ref::<AtomicU32>(off).ok()
    }

    fn u64_at(&self, off: usize) -> Option<&AtomicU64> {
        self.map.get_atomic_ref::<AtomicU64>(off).ok()
    }

    fn store32(&self, off: usize, v: u32) {
        if let Some(a) = self.u32_at(off) {
            a.store(v, Ordering::Release);
        }
    }

    fn load32(&self, off: usize) -> Option<u32> {
        self.u32_at(off).map(|a| a.load(Ordering::Acquire))
    }

    fn slot(&self, q: usize, field: usize) -> Option<usize> {
        (q < self.queues).then_some(HEADER + SLOT * q + field)
    }

    fn set_state(&self, q: usize, state: u32) {
        if let Some(off) = self.slot(q, STATE) {
            self.store32(off, state);
        }
    }

    /// Queue `q`'s recorded position, if the ring ran under a gsonet whose
    /// frontend never read it back and `owner` is the same frontend, ring and
    /// stale base: QEMU sends the base of the ring's last start again.
    pub fn resume(&self, q: usize, owner: Owner) -> Option<Resume> {
        let get = |f| self.slot(q, f).and_then(|o| self.load32(o));
        if get(STATE)? != RUNNING
            || get(SIZE)? != u32::from(owner.size)
            || get(QEMU_BASE)? != owner.qemu_base
            || self.u64_at(self.slot(q, MEM_ID)?)?.load(Ordering::Acquire) != owner.mem
        {
            return None;
        }
        let pos = get(POS)?;
        let desc = self.u64_at(self.slot(q, DESC)?)?.load(Ordering::Acquire);
        Some(Resume {
            before: Pos::from_base(pos as u16, owner.size)?,
            after: Pos::from_base((pos >> 16) as u16, owner.size)?,
            desc,
        })
    }

    /// Queue `q` starts at `at` for `owner`.
    pub fn started(&self, q: usize, owner: Owner, at: Pos) {
        let (Some(mem), Some(desc)) = (self.slot(q, MEM_ID), self.slot(q, DESC)) else {
            return;
        };
        self.set_state(q, EMPTY);
        if let (Some(m), Some(d)) = (self.u64_at(mem), self.u64_at(desc)) {
            m.store(owner.mem, Ordering::Release);
            d.store(0, Ordering::Release);
        }
        let base = u32::from(at.to_base());
        for (f, v) in [
            (SIZE, u32::from(owner.size)),
            (QEMU_BASE, owner.qemu_base),
            (POS, base | base << 16),
        ] {
            if let Some(o) = self.slot(q, f) {
                self.store32(o, v);
            }
        }
        self.set_state(q, RUNNING);
    }

    /// The frontend read queue `q`'s position back: it starts the ring there next.
    pub fn handed_back(&self, q: usize) {
        self.set_state(q, HANDED_BACK);
    }

    /// The handle a packed ring of queue `q` records its publishes through.
    pub fn slot_of(self: &Arc<Self>, q: usize) -> Option<RecordSlot> {
        (q < self.queues).then(|| RecordSlot {
            rec: self.clone(),
            q,
        })
    }
}

/// One queue's slot, as its packed ring writes it at each publish.
#[derive(Clone, Debug)]
pub struct RecordSlot {
    rec: Arc<RingRecord>,
    q: usize,
}

impl RecordSlot {
    fn pos(&self) -> Option<&AtomicU32> {
        self.rec.u32_at(self.rec.slot(self.q, POS)?)
    }

    /// A publish of the used entries from `from` to `to` in descriptor ring `desc`
    /// is about to write them.
    pub fn begin(&self, desc: u64, from: Pos, to: Pos) {
        if let Some(d) = self.rec.slot(self.q, DESC).and_then(|o| self.rec.u64_at(o)) {
            d.store(desc, Ordering::Relaxed);
        }
        if let Some(p) = self.pos() {
            p.store(
                u32::from(from.to_base()) | u32::from(to.to_base()) << 16,
                Ordering::Release,
            );
        }
    }

    /// The publish begun is written: the guest may see it.
    pub fn commit(&self, to: Pos) {
        if let Some(p) = self.pos() {
            let b = u32::from(to.to_base());
            p.store(b | b << 16, Ordering::Release);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ring::GuestMem;
    use vm_memory::GuestAddress;

    fn owner() -> Owner {
        Owner {
            mem: 7,
            size: 8,
            qemu_base: 0x8000_8000,
        }
    }

    #[test]
    fn a_record_outlives_its_mapping_and_resumes_only_its_owner() {
        let path = std::env::temp_dir().join(format!("gsonet-rings-{}", std::process::id()));
        let _ = std::fs::remove_file(&path);
        let rec = Arc::new(RingRecord::open(&path, 2).unwrap());
        assert_eq!(rec.resume(1, owner()), None);
        rec.started(1, owner(), Pos::START);
        let s = rec.slot_of(1).unwrap();
        let to = Pos {
            idx: 3,
            wrap: false,
        };
        s.begin(0x1000, Pos::START, to);
        s.commit(to);
        drop(s);
        drop(rec);
        // A new process maps the same file.
        let rec = RingRecord::open(&path, 2).unwrap();
        let r = rec.resume(1, owner()).unwrap();
        assert_eq!((r.before, r.after, r.desc), (to, to, 0x1000));
        assert_eq!(r.resolve(None), to);
        for other in [
            Owner { mem: 8, ..owner() },
            Owner {
                size: 16,
                ..owner()
            },
            Owner {
                qemu_base: 0x8003_8003,
                ..owner()
            },
        ] {
            assert_eq!(rec.resume(1, other), None);
        }
        assert_eq!(rec.resume(0, owner()), None);
        rec.handed_back(1);
        assert_eq!(rec.resume(1, owner()), None);
        // Another queue count: started afresh.
        let rec = RingRecord::open(&path, 4).unwrap();
        assert_eq!(rec.resume(1, owner()), None);
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    fn a_record_is_only_a_regular_file_of_gsonets_own() {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("gsonet-rings-own-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let refused = |name: &str, why: &str| {
            let e = RingRecord::open(&dir.join(name), 2).expect_err(name);
            assert!(e.to_string().contains(why), "{name}: {e}");
        };
        // A symlink to a file gsonet would clobber: not followed, the file untouched.
        let victim = dir.join("victim");
        std::fs::write(&victim, b"keep me").unwrap();
        std::os::unix::fs::symlink(&victim, dir.join("link")).unwrap();
        refused("link", "");
        assert_eq!(std::fs::read(&victim).unwrap(), b"keep me");
        // A second name for it.
        std::fs::hard_link(&victim, dir.join("hard")).unwrap();
        std::fs::set_permissions(&victim, std::fs::Permissions::from_mode(0o600)).unwrap();
        refused("hard", "2 links");
        assert_eq!(std::fs::read(&victim).unwrap(), b"keep me");
        // A directory, a FIFO (not waited on), a file others may write.
        std::fs::create_dir(dir.join("dir")).unwrap();
        refused("dir", "");
        assert!(std::process::Command::new("mkfifo")
            .arg(dir.join("fifo"))
            .status()
            .is_ok_and(|s| s.success()));
        refused("fifo", "not a regular file");
        let open = dir.join("open");
        std::fs::write(&open, b"").unwrap();
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o622)).unwrap();
        refused("open", "writable by others");
        // Another user's (only root can make one).
        let theirs = dir.join("theirs");
        std::fs::write(&theirs, b"").unwrap();
        std::fs::set_permissions(&theirs, std::fs::Permissions::from_mode(0o600)).unwrap();
        if std::os::unix::fs::chown(&theirs, Some(65534), None).is_ok() {
            refused("theirs", "owned by uid 65534");
        }
        // A fresh one, and the same again.
        assert!(RingRecord::open(&dir.join("mine"), 2).is_ok());
        assert!(RingRecord::open(&dir.join("mine"), 2).is_ok());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_publish_cut_short_resumes_on_the_side_the_guest_sees() {
        let m = GuestMem::from_ranges(&[(GuestAddress(0), 0x10000)]).unwrap();
        let hm = HostMem::new(&m);
        let before = Pos { idx: 2, wrap: true };
        let after = Pos { idx: 5, wrap: true };
        let r = Resume {
            before,
            after,
            desc: 0x1000,
        };
        let flags = 0x1000 + 2 * DESC_SIZE + FLAGS_AT;
        // Slot 2 still available (AVAIL = 1, USED = 0): not published.
        hm.store_u16(flags, super::super::F_AVAIL, Ordering::Relaxed);
        assert_eq!(r.resolve(Some(&hm)), before);
        // Used under wrap 1: published.
        hm.store_u16(
            flags,
            super::super::F_AVAIL | super::super::F_USED,
            Ordering::Relaxed,
        );
        assert_eq!(r.resolve(Some(&hm)), after);
        assert_eq!(r.resolve(None), before);
    }
}

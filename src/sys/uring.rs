//! Many reads or writes in one system call: an io_uring that takes a batch of
//! writev (a vif's TX batch to a tap) or of reads (a tap queue's next frames) and
//! submits it with one `io_uring_enter`, instead of one call per frame. It waits for
//! every completion, so each result is known, and each buffer free, when it returns.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};

use io_uring::{opcode, squeue, types, IoUring};

/// Bytes named by address, laid out as a `struct iovec`. The kernel only reads
/// there, and fails a write whose bytes are not mapped (EFAULT); which bytes go out
/// is the caller's business (see `switch::stable`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct Part {
    pub addr: usize,
    pub len: usize,
}

impl Part {
    pub fn of(bytes: &[u8]) -> Part {
        Part {
            addr: bytes.as_ptr() as usize,
            len: bytes.len(),
        }
    }
}

/// One frame to write with one writev.
pub struct Write<'a> {
    pub fd: BorrowedFd<'a>,
    pub parts: &'a [Part],
}

/// An io_uring for batches of reads or writes.
pub struct Ring {
    ring: IoUring,
    entries: usize,
    /// Tags each call's completions, so one a failed call left behind is never
    /// taken for a later call's.
    generation: u32,
}

/// Calls to `io_uring_enter` that may fail in a row, reads in flight, before the
/// process stops rather than return while the kernel may still write to a buffer.
const ENTER_TRIES: u32 = 1000;

impl Ring {
    /// A ring taking `entries` operations per submission. `one_thread`: only the
    /// creating thread submits, and its completions then run only when it waits for
    /// them (DEFER_TASKRUN), never by interrupting it. Fails where io_uring is not
    /// available (an old kernel, `kernel.io_uring_disabled`, a seccomp filter).
    pub fn new(entries: u32, one_thread: bool) -> io::Result<Ring> {
        let ring = if one_thread {
            // Kernels before 6.1 take the plain ring.
            IoUring::builder()
                .setup_single_issuer()
                .setup_defer_taskrun()
                .build(entries)
                .or_else(|_| IoUring::new(entries))?
        } else {
            IoUring::new(entries)?
        };
        Ok(Ring {
            entries: ring.params().sq_entries() as usize,
            ring,
            generation: 0,
        })
    }

    /// Writes each of `writes` with one writev, in order, up to the ring's size per
    /// system call, and sets `results[i]` to what write `i` returned.
    pub fn writev_all(&mut self, writes: &[Write<'_>], results: &mut Vec<io::Result<usize>>) {
        results.clear();
        results.extend(writes.iter().map(|_| Err(io::ErrorKind::Other.into())));
        let mut start = 0;
        for chunk in writes.chunks(self.entries) {
            let sqes = chunk.iter().map(|w| {
                // A tap is a stream: offset -1 means "the current position", i.e. none.
                let count = u32::try_from(w.parts.len()).unwrap_or(u32::MAX);
                opcode::Writev::new(types::Fd(w.fd.as_raw_fd()), w.parts.as_ptr().cast(), count)
                    .offset(u64::MAX)
                    .build()
            });
            // SAFETY: the kernel reads the iovec arrays (`Part` has the layout of
            // struct iovec) and, through them, only bytes the caller named by
            // address (see `Part`); the arrays and fds are borrowed for this call.
            unsafe { self.submit(sqes, &mut results[start..start + chunk.len()]) };
            start += chunk.len();
        }
    }

    /// Reads once from `fd` into each of `bufs` (one frame each from a tap), all in
    /// one system call when they fit the ring, and sets `results[i]` to what read `i`
    /// returned: WouldBlock when nothing was there, EOPNOTSUPP from a file that
    /// cannot be read without waiting. The reads run in order.
    pub fn read_each(
        &mut self,
        fd: BorrowedFd<'_>,
        bufs: &mut [&mut [u8]],
        results: &mut Vec<io::Result<usize>>,
    ) {
        results.clear();
        results.extend(bufs.iter().map(|_| Err(io::ErrorKind::Other.into())));
        let mut start = 0;
        for chunk in bufs.chunks_mut(self.entries) {
            let n = chunk.len();
            let sqes = chunk.iter_mut().map(|b| {
                let len = u32::try_from(b.len()).unwrap_or(u32::MAX);
                // RWF_NOWAIT: an empty queue answers EAGAIN; without it io_uring
                // would wait for the next frame.
                opcode::Read::new(types::Fd(fd.as_raw_fd()), b.as_mut_ptr(), len)
                    .offset(u64::MAX)
                    .rw_flags(libc::RWF_NOWAIT)
                    .build()
            });
            // SAFETY: each read writes at most its buffer's length into a buffer
            // exclusively borrowed for this call, and `submit` returns only once
            // every read it queued has completed.
            unsafe { self.submit(sqes, &mut results[start..start + n]) };
            start += n;
        }
    }

    /// Queues `sqes` (at most `entries`), submits them and waits for all their
    /// completions; `results[i]` gets the result of the i-th.
    ///
    /// # Safety
    /// Every buffer an entry names must stay valid until this returns.
    unsafe fn submit(
        &mut self,
        sqes: impl Iterator<Item = squeue::Entry>,
        results: &mut [io::Result<usize>],
    ) {
        self.generation = self.generation.wrapping_add(1);
        let tag = u64::from(self.generation) << 32;
        let mut sq = self.ring.submission();
        let mut queued = 0;
        for (i, sqe) in sqes.enumerate() {
            // SAFETY: the caller keeps what the entry names valid until we return,
            // and we return only after its completion (or the process stops).
            if unsafe { sq.push(&sqe.user_data(tag | i as u64)) }.is_err() {
                results[i] = Err(io::ErrorKind::WouldBlock.into());
                continue;
            }
            queued += 1;
        }
        drop(sq);
        let (mut reaped, mut failed) = (0, 0);
        while reaped < queued {
            // EINTR, EAGAIN and EBUSY (completions to reap first) only mean "again".
            if let Err(e) = self.ring.submit_and_wait(queued - reaped) {
                if !matches!(
                    e.raw_os_error(),
                    Some(libc::EINTR | libc::EAGAIN | libc::EBUSY)
                ) {
                    failed += 1;
                    if failed == ENTER_TRIES {
                        // Returning would free buffers the kernel may still write to.
                        eprintln!("io_uring_enter keeps failing with I/O in flight: {e}");
                        std::process::abort();
                    }
                    std::thread::yield_now();
                }
            }
            for cqe in self.ring.completion() {
                if cqe.user_data() & !0xffff_ffff != tag {
                    continue; // not this call's
                }
                let res = cqe.result();
                if let Some(slot) = results.get_mut((cqe.user_data() & 0xffff_ffff) as usize) {
                    *slot = usize::try_from(res).map_err(|_| io::Error::from_raw_os_error(-res));
                }
                reaped += 1;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    fn ring_or_skip() -> Option<Ring> {
        match Ring::new(4, true) {
            Ok(r) => Some(r),
            Err(e) => {
                assert!(!crate::testkit::can_run(false, &format!("io_uring ({e})")));
                None
            }
        }
    }

    #[test]
    fn writes_land_in_order_with_their_results_past_the_ring_size() {
        let Some(mut ring) = ring_or_skip() else {
            return;
        };
        let (rd, wr) = std::os::unix::net::UnixStream::pair().unwrap();
        let msgs: Vec<Vec<u8>> = (0..10u8).map(|i| vec![b'a' + i; 1 + i as usize]).collect();
        let head = [b'|'];
        let parts: Vec<[Part; 2]> = msgs
            .iter()
            .map(|m| [Part::of(&head), Part::of(m)])
            .collect();
        let writes: Vec<Write<'_>> = parts
            .iter()
            .map(|parts| Write {
                fd: wr.as_fd(),
                parts,
            })
            .collect();
        let mut results = Vec::new();
        ring.writev_all(&writes, &mut results);
        let lens: Vec<usize> = results.iter().map(|r| *r.as_ref().unwrap()).collect();
        assert_eq!(lens, (0..10).map(|i| 2 + i).collect::<Vec<_>>());
        drop(wr);
        let mut got = Vec::new();
        std::io::Read::read_to_end(&mut &rd, &mut got).unwrap();
        let want: Vec<u8> = msgs.iter().flat_map(|m| [&head[..], m].concat()).collect();
        assert_eq!(got, want);
    }

    #[test]
    fn a_failed_write_has_its_own_error_and_the_others_still_go() {
        let Some(mut ring) = ring_or_skip() else {
            return;
        };
        let (rd, wr) = std::os::unix::net::UnixStream::pair().unwrap();
        let closed = {
            let (a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
            a.shutdown(std::net::Shutdown::Write).unwrap();
            a
        };
        let data = [b"one".as_slice(), b"two"];
        let parts: Vec<[Part; 1]> = data.iter().map(|d| [Part::of(d)]).collect();
        let writes = [
            Write {
                fd: wr.as_fd(),
                parts: &parts[0],
            },
            Write {
                fd: closed.as_fd(),
                parts: &parts[1],
            },
            Write {
                fd: wr.as_fd(),
                parts: &parts[1],
            },
        ];
        let mut results = Vec::new();
        ring.writev_all(&writes, &mut results);
        assert_eq!(*results[0].as_ref().unwrap(), 3);
        assert_eq!(
            results[1].as_ref().unwrap_err().raw_os_error(),
            Some(libc::EPIPE)
        );
        assert_eq!(*results[2].as_ref().unwrap(), 3);
        drop(wr);
        let mut got = Vec::new();
        std::io::Read::read_to_end(&mut &rd, &mut got).unwrap();
        assert_eq!(got, b"onetwo");
    }

    #[test]
    fn reads_take_one_message_each_in_order_and_an_empty_socket_says_would_block() {
        let Some(mut ring) = ring_or_skip() else {
            return;
        };
        let (rd, wr) = std::os::unix::net::UnixDatagram::pair().unwrap();
        rd.set_nonblocking(true).unwrap();
        for m in [&b"alpha"[..], b"be", b"gamma!"] {
            wr.send(m).unwrap();
        }
        let mut arena = [0u8; 6 * 16];
        let mut bufs: Vec<&mut [u8]> = arena.chunks_mut(16).collect();
        let mut results = Vec::new();
        ring.read_each(rd.as_fd(), &mut bufs, &mut results);
        let lens: Vec<Option<usize>> = results.iter().map(|r| r.as_ref().ok().copied()).collect();
        assert_eq!(lens, [Some(5), Some(2), Some(6), None, None, None]);
        for r in &results[3..] {
            assert_eq!(r.as_ref().unwrap_err().kind(), io::ErrorKind::WouldBlock);
        }
        assert_eq!(&arena[..5], b"alpha");
        assert_eq!(&arena[16..18], b"be");
        assert_eq!(&arena[32..38], b"gamma!");
    }
}

//! Many writes in one system call: an io_uring that takes a batch of writev and
//! submits it with one `io_uring_enter` (a vif's TX batch to a tap: one call, not a
//! writev per frame). It waits for every completion, so each write's result is known
//! when it returns.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};

use io_uring::{opcode, types, IoUring};

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

/// An io_uring used from one thread for batches of writes.
pub struct WriteRing {
    ring: IoUring,
    entries: usize,
    /// Tags each call's completions, so one a failed call left behind is never
    /// taken for a later call's.
    generation: u32,
}

impl WriteRing {
    /// A ring taking `entries` writes per submission. Fails where io_uring is not
    /// available (an old kernel, `kernel.io_uring_disabled`, a seccomp filter).
    pub fn new(entries: u32) -> io::Result<WriteRing> {
        // Completions run only when this thread waits for them (DEFER_TASKRUN),
        // never by interrupting it; kernels before 6.1 take the plain ring.
        let ring = IoUring::builder()
            .setup_single_issuer()
            .setup_defer_taskrun()
            .build(entries)
            .or_else(|_| IoUring::new(entries))?;
        Ok(WriteRing {
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
            self.submit(chunk, &mut results[start..start + chunk.len()]);
            start += chunk.len();
        }
    }

    /// Submits `chunk` (at most `entries` writes) and waits for their completions.
    fn submit(&mut self, chunk: &[Write<'_>], results: &mut [io::Result<usize>]) {
        self.generation = self.generation.wrapping_add(1);
        let tag = u64::from(self.generation) << 32;
        let mut sq = self.ring.submission();
        let mut queued = 0;
        for (i, w) in chunk.iter().enumerate() {
            let Ok(count) = u32::try_from(w.parts.len()) else {
                results[i] = Err(io::Error::from_raw_os_error(libc::EINVAL));
                continue;
            };
            // A tap is a stream: offset -1 means "the current position", i.e. none.
            let sqe =
                opcode::Writev::new(types::Fd(w.fd.as_raw_fd()), w.parts.as_ptr().cast(), count)
                    .offset(u64::MAX)
                    .build()
                    .user_data(tag | i as u64);
            // SAFETY: the kernel reads the iovec array (`Part` has its layout) and,
            // through it, only bytes the caller named by address (see `Part`); the
            // array and the fd are borrowed until the completions are reaped below.
            if unsafe { sq.push(&sqe) }.is_err() {
                results[i] = Err(io::ErrorKind::WouldBlock.into());
                continue;
            }
            queued += 1;
        }
        drop(sq);
        let mut reaped = 0;
        while reaped < queued {
            // EINTR, EAGAIN and EBUSY (completions to reap first) mean "again".
            if let Err(e) = self.ring.submit_and_wait(queued - reaped) {
                if !matches!(
                    e.raw_os_error(),
                    Some(libc::EINTR | libc::EAGAIN | libc::EBUSY)
                ) {
                    let code = e.raw_os_error().unwrap_or(libc::EIO);
                    for r in results.iter_mut() {
                        if r.as_ref().is_err_and(|e| e.kind() == io::ErrorKind::Other) {
                            *r = Err(io::Error::from_raw_os_error(code));
                        }
                    }
                    return;
                }
            }
            for cqe in self.ring.completion() {
                if cqe.user_data() & !0xffff_ffff != tag {
                    continue; // left by a call that gave up
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

    fn ring_or_skip() -> Option<WriteRing> {
        match WriteRing::new(4) {
            Ok(r) => Some(r),
            Err(e) => {
                eprintln!("skipped: no io_uring here ({e})");
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
}

//! What a descriptor another process handed us really is: an eventfd or not, a regular
//! file of what size, sealed how; and the one flag gsonet sets on such descriptors.

use std::io;
use std::mem::MaybeUninit;
use std::os::fd::{AsRawFd, BorrowedFd};

use super::check;

/// What `fstat` says about a file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FileInfo {
    /// A regular file (memfd, tmpfs, hugetlbfs files are).
    pub regular: bool,
    /// Its size in bytes.
    pub size: u64,
}

/// `fstat` of `fd`.
pub fn stat(fd: BorrowedFd<'_>) -> io::Result<FileInfo> {
    let mut st = MaybeUninit::<libc::stat>::uninit();
    // SAFETY: fstat writes one `struct stat` into `st`, which is large enough and
    // exclusively borrowed for the call.
    check(unsafe { libc::fstat(fd.as_raw_fd(), st.as_mut_ptr()) })?;
    // SAFETY: fstat returned 0, so it filled `st`.
    let st = unsafe { st.assume_init() };
    Ok(FileInfo {
        regular: st.st_mode & libc::S_IFMT == libc::S_IFREG,
        size: u64::try_from(st.st_size).unwrap_or(0),
    })
}

/// The (device, inode) of `fd`'s file: the same for every descriptor of one open
/// file, from any process.
pub fn identity(fd: BorrowedFd<'_>) -> io::Result<(u64, u64)> {
    let mut st = MaybeUninit::<libc::stat>::uninit();
    // SAFETY: as in `stat`.
    check(unsafe { libc::fstat(fd.as_raw_fd(), st.as_mut_ptr()) })?;
    // SAFETY: fstat returned 0, so it filled `st`.
    let st = unsafe { st.assume_init() };
    Ok((st.st_dev, st.st_ino))
}

/// Whether `fd` is an eventfd: the kernel names every eventfd `anon_inode:[eventfd]` in
/// /proc/self/fd, a name no file on a filesystem can have (those start with `/`).
/// Other anonymous inodes (epoll, timerfd, signalfd) share the inode but not the name.
pub fn is_eventfd(fd: BorrowedFd<'_>) -> io::Result<bool> {
    let link = std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd()))?;
    Ok(link.as_os_str() == "anon_inode:[eventfd]")
}

/// Sets O_NONBLOCK on `fd`'s open file (shared with every process that holds it).
pub fn set_nonblocking(fd: BorrowedFd<'_>) -> io::Result<()> {
    // SAFETY: F_GETFL on a descriptor borrowed for the call; no pointers.
    let flags = check(unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GETFL) })?;
    if flags & libc::O_NONBLOCK == 0 {
        // SAFETY: F_SETFL with an int argument on a descriptor borrowed for the call.
        check(unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETFL, flags | libc::O_NONBLOCK) })?;
    }
    Ok(())
}

/// Whether O_NONBLOCK is set on `fd`'s open file.
pub fn is_nonblocking(fd: BorrowedFd<'_>) -> io::Result<bool> {
    // SAFETY: F_GETFL on a descriptor borrowed for the call; no pointers.
    let flags = check(unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GETFL) })?;
    Ok(flags & libc::O_NONBLOCK != 0)
}

/// The seals of a file (`F_GET_SEALS`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Seals(u32);

impl Seals {
    /// No one can make the file smaller (F_SEAL_SHRINK): a mapping of it cannot lose
    /// its pages under us.
    pub fn no_shrink(self) -> bool {
        self.0 & libc::F_SEAL_SHRINK as u32 != 0
    }

    pub fn bits(self) -> u32 {
        self.0
    }
}

/// The seals of `fd`'s file; `Seals(0)` for files that cannot be sealed (anything but
/// memfd and tmpfs files: EINVAL).
pub fn seals(fd: BorrowedFd<'_>) -> io::Result<Seals> {
    // SAFETY: F_GET_SEALS on a descriptor borrowed for the call; no pointers.
    match check(unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) }) {
        Ok(s) => Ok(Seals(s as u32)),
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => Ok(Seals(0)),
        Err(e) => Err(e),
    }
}

/// A memfd of `size` bytes to stand for a guest's memory (unit tests, the test
/// frontend, the load generator), sealed against shrinking and growing when `seal`,
/// as QEMU's memory-backend-memfd does (F_SEAL_SHRINK, F_SEAL_GROW, F_SEAL_SEAL).
#[cfg(any(test, feature = "testkit"))]
pub fn guest_memfd(size: u64, seal: bool) -> io::Result<std::fs::File> {
    use std::os::fd::FromRawFd;
    let flags = libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING;
    // SAFETY: plain syscall with a valid C string.
    let fd = unsafe { libc::memfd_create(c"gsonet-guest".as_ptr(), flags) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor we own.
    let f = unsafe { std::fs::File::from_raw_fd(fd) };
    f.set_len(size)?;
    if seal {
        let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
        // SAFETY: F_ADD_SEALS with an int argument on a descriptor we own.
        if unsafe { libc::fcntl(fd, libc::F_ADD_SEALS, seals) } != 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(f)
}

/// A blocking eventfd, for unit tests.
#[cfg(test)]
pub fn test_eventfd() -> std::os::fd::OwnedFd {
    use std::os::fd::FromRawFd;
    // SAFETY: plain syscall, no pointers.
    let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
    assert!(fd >= 0, "eventfd: {}", io::Error::last_os_error());
    // SAFETY: a fresh descriptor we own.
    unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs::File;
    use std::os::fd::{AsFd, FromRawFd, OwnedFd};
    use std::os::unix::net::UnixStream;

    fn memfd(flags: libc::c_uint) -> File {
        // SAFETY: plain syscall with a valid C string.
        let fd = unsafe { libc::memfd_create(c"gsonet-sys-test".as_ptr(), flags) };
        assert!(fd >= 0);
        // SAFETY: a fresh descriptor we own.
        unsafe { File::from_raw_fd(fd) }
    }

    #[test]
    fn eventfds_are_told_from_other_descriptors() {
        // SAFETY: plain syscall, no pointers.
        let e = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
        assert!(e >= 0);
        // SAFETY: a fresh descriptor we own.
        let e = unsafe { OwnedFd::from_raw_fd(e) };
        assert!(is_eventfd(e.as_fd()).unwrap());
        let (a, _b) = UnixStream::pair().unwrap();
        assert!(!is_eventfd(a.as_fd()).unwrap());
        assert!(!is_eventfd(memfd(libc::MFD_CLOEXEC).as_fd()).unwrap());
        // SAFETY: plain syscall, no pointers.
        let ep = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        // SAFETY: a fresh descriptor we own.
        let ep = unsafe { OwnedFd::from_raw_fd(ep) };
        assert!(!is_eventfd(ep.as_fd()).unwrap());

        assert!(!is_nonblocking(e.as_fd()).unwrap());
        set_nonblocking(e.as_fd()).unwrap();
        assert!(is_nonblocking(e.as_fd()).unwrap());
        let mut f = File::from(e);
        assert_eq!(
            std::io::Read::read(&mut f, &mut [0u8; 8])
                .unwrap_err()
                .kind(),
            io::ErrorKind::WouldBlock
        );
    }

    #[test]
    fn sizes_and_seals_of_memfds() {
        let f = memfd(libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING);
        f.set_len(8192).unwrap();
        assert_eq!(
            stat(f.as_fd()).unwrap(),
            FileInfo {
                regular: true,
                size: 8192
            }
        );
        assert!(!seals(f.as_fd()).unwrap().no_shrink());
        // SAFETY: F_ADD_SEALS with an int argument on a descriptor we own.
        let r = unsafe { libc::fcntl(f.as_raw_fd(), libc::F_ADD_SEALS, libc::F_SEAL_SHRINK) };
        assert_eq!(r, 0);
        assert!(seals(f.as_fd()).unwrap().no_shrink());
        assert!(f.set_len(4096).is_err(), "sealed against shrinking");

        // Without MFD_ALLOW_SEALING a memfd is born with F_SEAL_SEAL only.
        let plain = memfd(libc::MFD_CLOEXEC);
        assert!(!seals(plain.as_fd()).unwrap().no_shrink());
        let (a, _b) = UnixStream::pair().unwrap();
        assert!(!stat(a.as_fd()).unwrap().regular);
        assert_eq!(seals(a.as_fd()).unwrap(), Seals(0));
    }
}

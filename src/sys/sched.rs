//! The scheduling priority of the calling thread.

use std::io;

use super::check;

/// Sets the calling thread's nice value (-20 highest .. 19 lowest). Going below the
/// current value needs CAP_SYS_NICE or a high enough RLIMIT_NICE.
pub fn set_thread_nice(nice: i32) -> io::Result<()> {
    // SAFETY: gettid has no preconditions.
    let tid = unsafe { libc::gettid() };
    // PRIO_PROCESS with a thread id sets that one thread's priority on Linux.
    // SAFETY: plain integer arguments.
    check(unsafe { libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, nice) })?;
    Ok(())
}

/// The calling thread's nice value.
pub fn thread_nice() -> io::Result<i32> {
    // SAFETY: gettid has no preconditions.
    let tid = unsafe { libc::gettid() };
    // getpriority may return -1 as a value: errno, cleared first, tells.
    // SAFETY: errno's location is the calling thread's, valid while it lives.
    unsafe { *libc::__errno_location() = 0 };
    // SAFETY: plain integer arguments.
    let n = unsafe { libc::getpriority(libc::PRIO_PROCESS, tid as libc::id_t) };
    let e = io::Error::last_os_error();
    match (n, e.raw_os_error()) {
        (-1, Some(code)) if code != 0 => Err(e),
        _ => Ok(n),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_thread_sets_its_own_nice_only() {
        let before = thread_nice().unwrap();
        let lower = (before + 3).min(19);
        let other = std::thread::spawn(move || {
            set_thread_nice(lower).unwrap();
            thread_nice().unwrap()
        })
        .join()
        .unwrap();
        assert_eq!(other, lower, "the spawned thread's own value");
        assert_eq!(thread_nice().unwrap(), before, "this thread is untouched");
    }
}

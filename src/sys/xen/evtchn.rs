//! `/dev/xen/evtchn`: interdomain event channels bound to one open file. A port that
//! fires is read from the file and stays masked until it is written back (unmasked),
//! so a flooding guest costs one wake-up per pass, never a busy loop.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::os::unix::fs::OpenOptionsExt;
use std::time::Duration;

use super::{ioc_none, DomId};
use crate::sys::check;

const IOCTL_EVTCHN_BIND_INTERDOMAIN: libc::c_ulong = ioc_none(b'E', 1, 8);
const IOCTL_EVTCHN_BIND_UNBOUND_PORT: libc::c_ulong = ioc_none(b'E', 2, 4);
const IOCTL_EVTCHN_UNBIND: libc::c_ulong = ioc_none(b'E', 3, 4);
const IOCTL_EVTCHN_NOTIFY: libc::c_ulong = ioc_none(b'E', 4, 4);

#[repr(C)]
struct BindInterdomain {
    remote_domain: u32,
    remote_port: u32,
}

#[repr(C)]
struct BindUnbound {
    remote_domain: u32,
}

#[repr(C)]
struct PortArg {
    port: u32,
}

/// One open `/dev/xen/evtchn`: the ports bound through it fire on its fd.
pub struct EvtchnDev {
    file: File,
}

impl EvtchnDev {
    pub fn open() -> io::Result<EvtchnDev> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
            .open("/dev/xen/evtchn")?;
        Ok(EvtchnDev { file })
    }

    /// Binds the guest's `remote_port` of domain `dom`; returns our local port.
    pub fn bind_interdomain(&self, dom: DomId, remote_port: u32) -> io::Result<u32> {
        let mut arg = BindInterdomain {
            remote_domain: u32::from(dom),
            remote_port,
        };
        // SAFETY: the ioctl reads the 8-byte struct we pass, which lives across the call.
        let r = unsafe {
            libc::ioctl(
                self.file.as_raw_fd(),
                IOCTL_EVTCHN_BIND_INTERDOMAIN,
                &mut arg as *mut BindInterdomain,
            )
        };
        check(r).map(|p| p as u32)
    }

    /// A new local port that domain `remote` may bind (a frontend's side).
    pub fn bind_unbound(&self, remote: DomId) -> io::Result<u32> {
        let mut arg = BindUnbound {
            remote_domain: u32::from(remote),
        };
        // SAFETY: the ioctl reads the 4-byte struct we pass, which lives across the call.
        let r = unsafe {
            libc::ioctl(
                self.file.as_raw_fd(),
                IOCTL_EVTCHN_BIND_UNBOUND_PORT,
                &mut arg as *mut BindUnbound,
            )
        };
        check(r).map(|p| p as u32)
    }

    pub fn unbind(&self, port: u32) -> io::Result<()> {
        self.port_ioctl(IOCTL_EVTCHN_UNBIND, port)
    }

    /// Signals the guest end of local port `port`.
    pub fn notify(&self, port: u32) -> io::Result<()> {
        self.port_ioctl(IOCTL_EVTCHN_NOTIFY, port)
    }

    /// An evtchn ioctl whose argument is one port (UNBIND, NOTIFY).
    fn port_ioctl(&self, request: libc::c_ulong, port: u32) -> io::Result<()> {
        let mut arg = PortArg { port };
        // SAFETY: both requests read the 4-byte struct we pass, which lives across the
        // call.
        let r = unsafe { libc::ioctl(self.file.as_raw_fd(), request, &mut arg as *mut PortArg) };
        check(r).map(|_| ())
    }

    /// The ports that fired since the last call (at most `out.len()`), without
    /// waiting; each stays masked until [`EvtchnDev::unmask`]. The device hands out
    /// whole ports in native byte order, read straight into `out` (a worker calls this
    /// at every wake-up: nothing is allocated).
    pub fn pending(&self, out: &mut [u32]) -> io::Result<usize> {
        // SAFETY: reads at most size_of_val(out) bytes into `out`, which we borrow
        // mutably; any bytes are a valid u32.
        let r = unsafe {
            libc::read(
                self.file.as_raw_fd(),
                out.as_mut_ptr().cast(),
                std::mem::size_of_val(out),
            )
        };
        match crate::sys::check_len(r) {
            Ok(n) => Ok((n / 4).min(out.len())),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(0),
            Err(e) => Err(e),
        }
    }

    /// Lets `ports` fire again (written as they are, native byte order).
    pub fn unmask(&self, ports: &[u32]) -> io::Result<()> {
        // SAFETY: writes size_of_val(ports) bytes from the slice we borrow.
        let r = unsafe {
            libc::write(
                self.file.as_raw_fd(),
                ports.as_ptr().cast(),
                std::mem::size_of_val(ports),
            )
        };
        crate::sys::check_len(r).map(|_| ())
    }

    /// Waits up to `timeout` for a port to fire.
    pub fn wait(&self, timeout: Duration) -> io::Result<bool> {
        crate::sys::io::poll_readable(self.file.as_fd(), timeout)
    }
}

impl AsFd for EvtchnDev {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.file.as_fd()
    }
}

//! The reader threads of an uplink, one per device queue: read a frame, parse it once
//! into a typed frame, forward it (holding frames for a full guest queue aside, see
//! `backpressure`), and signal the guests written to once per batch.

use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::{self, JoinHandle};
use std::time::Duration;

use tracing::{debug, error, warn};

use super::device::DeviceUplink;
use super::UplinkDevice;
use crate::backend::switch::backpressure::{forward_holding, Held};
use crate::backend::switch::deliver::DeliverCtx;
use crate::backend::switch::{Endpoint, Switch};
use crate::frame::Frame;
use crate::l2::ETH_HDR_LEN;
use crate::stats::DropReason;
use crate::sys::io::poll_readable;
use crate::vnet_hdr::{VirtioNetHdr, HDR_LEN};

/// Frames read from one queue before pending guest signals are flushed.
const RX_BATCH: usize = 64;
/// Longest wait for a frame, with nothing held, before the queue is tried anyway.
const POLL_WAIT: Duration = Duration::from_secs(1);
/// Longest pause after failed reads: a device that fails every read (a tap deleted
/// under gsonet stays readable and answers EBADFD) costs about one read a second.
const MAX_BACKOFF: Duration = Duration::from_secs(1);

/// The pause after `failures` reads in a row failed: 1, 2, 4 ... ms, up to MAX_BACKOFF.
fn backoff(failures: u32) -> Duration {
    Duration::from_millis(1u64 << failures.min(10)).min(MAX_BACKOFF)
}

/// Starts one reader thread per device queue; `id` is the uplink's id in the switch.
/// The readers end within `POLL_WAIT` once `stop` is set (the uplink is removed).
pub fn start<D: UplinkDevice>(
    uplink: Arc<DeviceUplink<D>>,
    id: usize,
    switch: Arc<Switch>,
    stop: Arc<AtomicBool>,
) -> io::Result<Vec<JoinHandle<()>>> {
    let mut readers = Vec::new();
    for q in 0..uplink.dev.queues() {
        let me = uplink.clone();
        let sw = switch.clone();
        let halt = stop.clone();
        let spawned = thread::Builder::new()
            .name(format!("{}{q}-rx", uplink.dev.thread_prefix()))
            .spawn(move || read_loop(&me, id, q, &sw, &halt));
        match spawned {
            Ok(h) => readers.push(h),
            Err(e) => {
                // The readers already running end with the uplink.
                stop.store(true, Ordering::Relaxed);
                return Err(e);
            }
        }
    }
    Ok(readers)
}

fn read_loop<D: UplinkDevice>(
    up: &DeviceUplink<D>,
    id: usize,
    queue: usize,
    switch: &Switch,
    stop: &AtomicBool,
) {
    let mut buf = vec![0u8; HDR_LEN + 65535 + 64];
    let mut ctx = DeliverCtx::default();
    let mut held = Held::default();
    let fd = up.dev.fd(queue);
    let mut failures: u32 = 0;
    while !stop.load(Ordering::Relaxed) {
        if failures > 0 {
            thread::sleep(backoff(failures));
        }
        held.retry(switch, &mut ctx);
        // What GRO took from the retried frames leaves before the wait.
        ctx.flush();
        match poll_readable(fd, held.poll_timeout(POLL_WAIT)) {
            Err(e) if e.kind() != io::ErrorKind::Interrupted => {
                error!(uplink = %up.dev.name(), "poll failed: {e}");
                return;
            }
            _ => {}
        }
        for _ in 0..RX_BATCH {
            let at = match up.dev.recv(queue, &mut buf) {
                Ok(Some(at)) => at,
                Ok(None) => continue,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.raw_os_error() == Some(libc::EMSGSIZE) => {
                    up.stats.drop(DropReason::TooLong);
                    continue;
                }
                Err(e) => {
                    failures = failures.saturating_add(1);
                    if failures == 10 {
                        warn!(uplink = %up.dev.name(), "reads keep failing ({e}); retrying about once a second");
                    } else {
                        debug!(uplink = %up.dev.name(), "read: {e}");
                    }
                    up.stats.drop(DropReason::UplinkReadError);
                    break;
                }
            };
            failures = 0;
            handle_frame(up, id, queue, &buf[at], switch, &mut ctx, &mut held);
        }
        ctx.flush();
    }
}

/// One frame as read from the device, vnet header first.
fn handle_frame<D: UplinkDevice>(
    up: &DeviceUplink<D>,
    id: usize,
    queue: usize,
    bytes: &[u8],
    switch: &Switch,
    ctx: &mut DeliverCtx,
    held: &mut Held,
) {
    let hl = up.dev.hdr_len();
    if bytes.len() < hl + ETH_HDR_LEN {
        up.stats.drop(DropReason::TooShort);
        return;
    }
    // A 10-byte header is the 12-byte one without num_buffers.
    let mut raw = [0u8; HDR_LEN];
    raw[..hl].copy_from_slice(&bytes[..hl]);
    let Ok(hdr) = VirtioNetHdr::from_bytes(&raw) else {
        up.stats.drop(DropReason::BadHeader);
        return;
    };
    let parts = [&bytes[hl..]];
    up.stats.tx(bytes.len() - hl);
    match Frame::from_device(hdr, &parts) {
        Ok(frame) if !up.admit(frame.wire_len()) => up.stats.drop(DropReason::RateLimited),
        Ok(frame) => forward_holding(switch, Endpoint::Uplink(id), queue, &frame, ctx, held),
        Err(reason) => up.stats.drop(reason),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failing_reads_back_off_to_a_second() {
        assert_eq!(backoff(1), Duration::from_millis(2));
        assert!(backoff(5) > backoff(4));
        assert_eq!(backoff(40), MAX_BACKOFF);
    }
}

//! The TX loop of one queue pair: drain the guest's TX queue in batches, copy each
//! chain out, check it against what the guest negotiated, and hand the typed frame to
//! the switch; signal the guest and the destinations once per batch.

use std::time::Duration;

use tracing::{debug, warn};
use vhost_user_backend::VringT;
use virtio_queue::QueueT;
use vmm_sys_util::timerfd::TimerFd;

use super::port::{Port, Vring};
use crate::backend::switch::deliver::DeliverCtx;
use crate::backend::switch::{Endpoint, Switch};
use crate::frame::validate::tx_frame;
use crate::frame::Frame;
use crate::ring::avail_in_range;
use crate::ring::tx::{self, TxError};
use crate::stats::DropReason;

/// How many TX chains one pass handles before signalling the guest.
const TX_BATCH: usize = 256;

/// What one queue worker keeps between kicks: the buffer chains are copied into and
/// its delivery state.
pub struct TxWorker {
    buf: Vec<u8>,
    ctx: DeliverCtx,
    /// Wakes the worker when a queue held for its `rate=` may go on.
    pub wake: Option<TimerFd>,
}

impl Default for TxWorker {
    fn default() -> Self {
        TxWorker {
            buf: tx::tx_buffer(),
            ctx: DeliverCtx::holding(),
            wake: None,
        }
    }
}

impl TxWorker {
    /// A worker with its rate-limit timer (the daemon's workers).
    pub fn with_timer() -> std::io::Result<TxWorker> {
        Ok(TxWorker {
            wake: Some(crate::sys::fd::nonblocking_timer()?),
            ..TxWorker::default()
        })
    }
}

/// Over its `rate=`, the queue is held: nothing more is popped (the guest's own queue
/// backs up) and the worker's timer wakes it when the debt is paid; never a busy
/// wait. False: no timer to wake it, so the queue is not held.
fn hold(port: &Port, wake: &mut Option<TimerFd>, wait: Duration) -> bool {
    let Some(t) = wake else { return false };
    if t.reset(wait.max(Duration::from_micros(1)), None).is_err() {
        return false;
    }
    port.stats.throttled(wait.as_micros() as u64);
    true
}

/// What software segmentation of `frame` would cost at most: its planned segments.
fn segments(frame: &Frame) -> usize {
    frame.gso.map_or(1, |g| g.plan.segments)
}

/// Drains the TX queue of `pair`: every chain becomes a frame for the switch.
pub fn drain(port: &Port, switch: &Switch, pair: usize, txq: &Vring, w: &mut TxWorker) {
    let Some(mem) = port.memory() else {
        return;
    };
    let neg = port.negotiated().unwrap_or_default();
    let TxWorker { buf, ctx, wake } = w;
    // A kick on a queue not (or no longer) set up is not a broken ring: as before,
    // there is nothing to pop (a frontend killed and reattached can kick one).
    if !txq.get_ref().get_queue().ready() {
        return;
    }
    loop {
        let _ = txq.disable_notification();
        if !avail_in_range(txq.get_ref().get_queue(), &mem) {
            // Counted once per kick; the queue is not touched until it makes sense.
            port.stats.drop(DropReason::TxRingBroken);
            break;
        }
        let mut done = 0;
        let mut held = false;
        while done < TX_BATCH {
            // Its own `rate=`, or a destination's `rx_rate=` it went over.
            if let Some(wait) = port.tx_wait().max(ctx.take_hold()) {
                held = hold(port, wake, wait);
                if held {
                    break;
                }
            }
            let (chain, qsize) = {
                let mut st = txq.get_mut();
                let q = st.get_queue_mut();
                (q.pop_descriptor_chain(&*mem), q.size())
            };
            let Some(chain) = chain else { break };
            let head = chain.head_index();
            match tx::read_chain(&mem, chain, neg.hdr_len(), qsize as usize, buf) {
                Ok(f) => {
                    port.stats.tx(f.len);
                    let parts = [&buf[f.start..f.start + f.len]];
                    match tx_frame(neg.tx, f.hdr, &parts) {
                        Ok(frame) if !port.charge_segments(segments(&frame)) => {
                            port.stats.drop(DropReason::SegmentBudget)
                        }
                        Ok(frame) => {
                            port.tx_charge(frame.wire_len());
                            switch.forward(Endpoint::Port(port.id), pair, &frame, ctx)
                        }
                        Err(reason) => port.stats.drop(reason),
                    }
                }
                Err(e) => {
                    debug!(port = %port.name(), "dropping TX chain: {e}");
                    port.stats.drop(DropReason::from(&e as &TxError));
                }
            }
            if let Err(e) = txq.add_used(head, 0) {
                if let Some(quiet) = port.log.allow() {
                    warn!(port = %port.name(), suppressed = quiet, "add_used on TX failed: {e}");
                }
            }
            done += 1;
        }
        if done > 0 && txq.needs_notification().unwrap_or(true) {
            let _ = txq.signal_used_queue();
        }
        ctx.flush();
        if held {
            return; // the timer drains on, notifications stay off meanwhile
        }
        if done == TX_BATCH {
            continue;
        }
        match txq.enable_notification() {
            Ok(true) => continue, // more arrived while notifications were off
            _ => break,
        }
    }
}

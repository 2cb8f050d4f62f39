//! The TX loop of one queue pair: drain the guest's TX queue in batches, copy each
//! chain out, check it against what the guest negotiated, and hand the typed frame to
//! the switch; signal the guest and the destinations once per batch.

use std::time::Duration;

use tracing::{debug, warn};
use vhost_user_backend::VringT;
use virtio_queue::QueueT;

use super::completion::TxCompletion;
use super::port::{Port, Vring};
use crate::backend::switch::deliver::DeliverCtx;
use crate::backend::switch::{Endpoint, Switch};
use crate::frame::validate::tx_frame;
use crate::frame::Frame;
use crate::ring::tx::{self, TxError};
use crate::ring::{avail_in_range, GuestMem};
use crate::stats::DropReason;
use crate::sys::timer::OneShotTimer;

/// How many TX chains one pass handles before signalling the guest.
const TX_BATCH: usize = 256;

/// What one queue worker keeps between kicks: the buffer chains are copied into, its
/// delivery state, the timer that makes it look at the queue again without a kick
/// (`tx_poll_us`, or a queue held for its `rate=`) and its TX completions' call.
pub struct TxWorker {
    buf: Vec<u8>,
    ctx: DeliverCtx,
    pub timer: Option<OneShotTimer>,
    pub completion: TxCompletion,
}

impl Default for TxWorker {
    fn default() -> Self {
        TxWorker {
            buf: tx::tx_buffer(),
            ctx: DeliverCtx::holding(),
            timer: None,
            completion: TxCompletion::default(),
        }
    }
}

impl TxWorker {
    /// A worker with its timers (the daemon's workers).
    pub fn with_timer() -> std::io::Result<TxWorker> {
        Ok(TxWorker {
            timer: Some(OneShotTimer::new()?),
            completion: TxCompletion::with_timer()?,
            ..TxWorker::default()
        })
    }
}

/// Over its `rate=`, the queue is held: nothing more is popped (the guest's own queue
/// backs up) and the worker's timer wakes it when the debt is paid; never a busy
/// wait. False: no timer to wake it, so the queue is not held.
fn hold(port: &Port, timer: &Option<OneShotTimer>, wait: Duration) -> bool {
    let Some(t) = timer else { return false };
    if t.arm(wait.max(Duration::from_micros(1))).is_err() {
        return false;
    }
    port.stats.throttled(wait.as_micros() as u64);
    true
}

/// What software segmentation of `frame` would cost at most: its planned segments.
fn segments(frame: &Frame) -> usize {
    frame.gso.map_or(1, |g| g.plan.segments)
}

enum RingState {
    /// Not (or no longer) set up and enabled: nothing to pop, and not a fault.
    Stopped,
    /// The avail index is more than a queue ahead of what was popped.
    Broken,
    InRange,
}

/// Reads the ring's state under one guard: a frontend stopping the queue
/// (GET_VRING_BASE, SET_VRING_ENABLE 0) takes the write side, so either it is seen
/// stopped here, or the avail index is read before the frontend may reuse its memory.
fn ring_state(txq: &Vring, mem: &GuestMem) -> RingState {
    let st = txq.get_ref();
    let q = st.get_queue();
    if !q.ready() || !st.is_enabled() {
        RingState::Stopped
    } else if avail_in_range(q, mem) {
        RingState::InRange
    } else {
        RingState::Broken
    }
}

/// How a drain left the queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DrainEnd {
    /// The guest's kicks are on (or the queue is not running): the next kick wakes us.
    Kicks,
    /// Polling: the drain found frames and left the guest's kicks off, so the caller
    /// must look again after the port's `tx_poll_us`.
    Poll,
    /// Held for a `rate=`: kicks stay off and the worker's timer is armed already.
    Held,
}

/// Drains the TX queue of `pair`: every chain becomes a frame for the switch. With
/// `poll`, a drain that found frames leaves the guest's kicks off (a guest adding
/// frames meanwhile does not have to notify) and returns `DrainEnd::Poll`; one that
/// found none turns them back on, so an idle queue costs nothing.
pub fn drain(
    port: &Port,
    switch: &Switch,
    pair: usize,
    txq: &Vring,
    w: &mut TxWorker,
    poll: bool,
) -> DrainEnd {
    let Some(mem) = port.memory() else {
        return DrainEnd::Kicks;
    };
    let neg = port.negotiated().unwrap_or_default();
    let TxWorker {
        buf,
        ctx,
        timer,
        completion,
    } = w;
    let mut popped = 0;
    loop {
        let _ = txq.disable_notification();
        match ring_state(txq, &mem) {
            RingState::Stopped => return DrainEnd::Kicks,
            RingState::Broken => {
                // Counted once per kick; the queue is not touched until it makes sense.
                port.stats.drop(DropReason::TxRingBroken);
                return DrainEnd::Kicks;
            }
            RingState::InRange => {}
        }
        let mut done = 0;
        let mut held = false;
        while done < TX_BATCH {
            // Its own `rate=`, or a destination's `rx_rate=` it went over.
            if let Some(wait) = port.tx_wait().max(ctx.take_hold()) {
                held = hold(port, timer, wait);
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
            let read = tx::read_chain(&mem, chain, neg.hdr_len(), qsize as usize, buf);
            // The frame is in our own buffer now: hand the chain back before sending it.
            // If gsonet dies from here on, the guest's ring already says "sent" and the
            // frontend's rewind (to the used index) cannot send it a second time; a
            // frame is lost at worst, never duplicated.
            if let Err(e) = txq.add_used(head, 0) {
                if let Some(quiet) = port.log.allow() {
                    warn!(port = %port.name(), suppressed = quiet, "add_used on TX failed: {e}");
                }
            }
            match read {
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
            done += 1;
        }
        // Receivers first: their calls are on a request's path, the sender's TX
        // completion is not, and on a host with few CPUs the first thread woken runs
        // first.
        ctx.flush();
        completion.used(port, txq, done, port.tx_coalesce_usecs());
        if held {
            return DrainEnd::Held; // the timer drains on, notifications stay off meanwhile
        }
        popped += done;
        if done == TX_BATCH {
            continue;
        }
        if poll && popped > 0 {
            return DrainEnd::Poll;
        }
        match txq.enable_notification() {
            Ok(true) => continue, // more arrived while notifications were off
            _ => return DrainEnd::Kicks,
        }
    }
}

//! Receiving on a test frontend while ignoring unrelated traffic (a tap in the host's
//! namespace carries the host's own frames too).

#![allow(dead_code)]

use std::time::{Duration, Instant};

use super::frontend::{RxFrame, TestFrontend};

/// The next frame for which `want` holds, within `timeout`; others are discarded.
/// Panics on a device protocol violation (bad used entry, wrong num_buffers).
pub fn recv_where(
    fe: &mut TestFrontend,
    timeout: Duration,
    mut want: impl FnMut(&RxFrame) -> bool,
) -> Option<RxFrame> {
    let deadline = Instant::now() + timeout;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return None;
        }
        match fe.try_recv(left) {
            Ok(Some(f)) if want(&f) => return Some(f),
            Ok(Some(_)) => continue,
            Ok(None) => return None,
            Err(e) => panic!("device broke the RX protocol: {e:#}"),
        }
    }
}

/// Every frame for which `want` holds until `idle` passes without any frame.
pub fn recv_all_where(
    fe: &mut TestFrontend,
    idle: Duration,
    mut want: impl FnMut(&RxFrame) -> bool,
) -> Vec<RxFrame> {
    let mut v = Vec::new();
    loop {
        match fe.try_recv(idle) {
            Ok(Some(f)) => {
                if want(&f) {
                    v.push(f)
                }
            }
            Ok(None) => return v,
            Err(e) => panic!("device broke the RX protocol: {e:#}"),
        }
    }
}

/// Ethernet source and destination ports of a TCP/UDP frame (IPv4 or IPv6, no
/// extension headers), for filtering.
pub fn l4_ports(frame: &[u8]) -> Option<(u16, u16)> {
    let et = u16::from_be_bytes([*frame.get(12)?, *frame.get(13)?]);
    let l4 = match et {
        0x0800 => 14 + ((frame.get(14)? & 0x0f) as usize) * 4,
        0x86dd => 54,
        _ => return None,
    };
    let p = frame.get(l4..l4 + 4)?;
    Some((
        u16::from_be_bytes([p[0], p[1]]),
        u16::from_be_bytes([p[2], p[3]]),
    ))
}

/// TCP payload length from the IP and TCP headers (no extension headers).
pub fn tcp_payload_len(frame: &[u8]) -> Option<usize> {
    let et = u16::from_be_bytes([*frame.get(12)?, *frame.get(13)?]);
    let (l3_len, l4) = match et {
        0x0800 => {
            let ihl = ((frame.get(14)? & 0x0f) as usize) * 4;
            let tot = u16::from_be_bytes([*frame.get(16)?, *frame.get(17)?]) as usize;
            (tot, 14 + ihl)
        }
        0x86dd => {
            let pl = u16::from_be_bytes([*frame.get(18)?, *frame.get(19)?]) as usize;
            (40 + pl, 54)
        }
        _ => return None,
    };
    let doff = ((frame.get(l4 + 12)? >> 4) as usize) * 4;
    (14 + l3_len).checked_sub(l4 + doff)
}

//! A hostile netfront for the Xen rig (guest-tests/xen/scenarios/hostile-netfront.sh):
//! it runs in dom0, plays a guest's xen-netfront against gsonet's netback (its rings
//! and buffers are dom0 pages granted to dom0 itself, its event channel a loopback
//! one), and writes the malformed TX rings of issue 12's list one case at a time.
//! Not part of gsonet.
//!
//! ```text
//! cargo build --release --example xen_netfront
//! xen_netfront --devid 9 --mac 00:16:3e:99:00:99 --peer-ip 10.99.0.1
//! ```
//!
//! Each case prints `RESULT hostile.CASE=ok` when gsonet answered as netif.h says
//! (every slot of a refused packet answered `NETIF_RSP_ERROR`, an extra-info slot
//! `NETIF_RSP_NULL`, a good packet `NETIF_RSP_OKAY`), else `=fail:WHY`. The counters
//! each case must raise are checked by the test from gsonet's stats. The ring jump
//! comes last: it stops the vif, which then reconnects from scratch and must be
//! served again.

use std::net::Ipv4Addr;
use std::thread::sleep;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Parser;
use gsonet::netif::{self, TxRequest};
use gsonet::sys::xen::evtchn::EvtchnDev;
use gsonet::sys::xen::gntalloc::GrantedPages;
use gsonet::sys::xen::shared_page::SharedPage;
use gsonet::sys::xen::xenstore::Xenstore;

#[derive(Parser)]
struct Args {
    /// The vif's device id (backend/vif/0/DEVID).
    #[arg(long, default_value_t = 9)]
    devid: u32,
    #[arg(long, default_value = "00:16:3e:99:00:99")]
    mac: String,
    /// Our address in the ARP requests we send.
    #[arg(long, default_value = "10.99.0.9")]
    ip: Ipv4Addr,
    /// The address asked for (dom0's end of the uplink): its ARP reply comes back to us.
    #[arg(long, default_value = "10.99.0.1")]
    peer_ip: Ipv4Addr,
    /// Event channel notifications sent in the flood case.
    #[arg(long, default_value_t = 20_000)]
    flood: u32,
}

/// A grant ref no one granted.
const BAD_GREF: u32 = 0x0fff_fff0;
/// Pages: a TX ring and an RX ring per queue, then data.
const DATA_PAGES: usize = 17;
const T: Duration = Duration::from_secs(10);

struct Front {
    xs: Xenstore,
    fe: String,
    be: String,
    pages: GrantedPages,
    evt: EvtchnDev,
    /// The first queue's event channel; `ports` has every queue's.
    port: u32,
    ports: Vec<u32>,
    req_prod: u32,
    rsp_cons: u32,
    rx_req_prod: u32,
    rx_rsp_cons: u32,
    next_id: u16,
}

fn parse_mac(s: &str) -> Result<[u8; 6]> {
    let v: Vec<u8> = s
        .split(':')
        .map(|b| u8::from_str_radix(b, 16))
        .collect::<Result<_, _>>()
        .with_context(|| format!("mac {s}"))?;
    v.try_into()
        .map_err(|_| anyhow::anyhow!("mac {s}: six bytes"))
}

/// An Ethernet broadcast ARP request from `mac`/`ip` for `target`, padded to 60 bytes.
fn arp_request(mac: [u8; 6], ip: Ipv4Addr, target: Ipv4Addr) -> Vec<u8> {
    let mut f = vec![0xff; 6];
    f.extend_from_slice(&mac);
    f.extend_from_slice(&[0x08, 0x06, 0, 1, 0x08, 0x00, 6, 4, 0, 1]);
    f.extend_from_slice(&mac);
    f.extend_from_slice(&ip.octets());
    f.extend_from_slice(&[0; 6]);
    f.extend_from_slice(&target.octets());
    f.resize(60, 0);
    f
}

impl Front {
    fn tx(&self) -> &SharedPage {
        self.pages.page(0)
    }
    fn rx(&self) -> &SharedPage {
        self.pages.page(1)
    }
    fn data_gref(&self, i: usize) -> u32 {
        self.pages.gref(2 * self.ports.len() + i % DATA_PAGES)
    }

    /// Grants fresh rings, offers them under our xenstore keys, and waits for gsonet
    /// to connect (backend state 4).
    fn connect(devid: u32, mac: &str) -> Result<Front> {
        let mut f = Front::setup(devid, mac, 1)?;
        f.offer_rings()?;
        Ok(f)
    }

    /// Grants fresh rings for `queues` queues, writes the vif's directories and waits
    /// for gsonet's InitWait; the rings are not offered yet.
    fn setup(devid: u32, mac: &str, queues: usize) -> Result<Front> {
        let mut xs = Xenstore::open().context("xenstore")?;
        let fe = format!("/local/domain/0/device/vif/{devid}");
        let be = format!("/local/domain/0/backend/vif/0/{devid}");
        let pages = GrantedPages::alloc(0, 2 * queues + DATA_PAGES).context("gntalloc")?;
        for i in 0..2 * queues {
            // SHARED_RING_INIT: producers 0, event indexes 1.
            pages.page(i).store(netif::REQ_EVENT, 1);
            pages.page(i).store(netif::RSP_EVENT, 1);
        }
        let evt = EvtchnDev::open().context("/dev/xen/evtchn")?;
        let ports = (0..queues)
            .map(|_| evt.bind_unbound(0).context("unbound event channel"))
            .collect::<Result<Vec<u32>>>()?;
        let port = ports[0];
        let _ = xs.rm(&be);
        let _ = xs.rm(&fe);
        let handle = devid.to_string();
        write_keys(
            &mut xs,
            &fe,
            &[
                ("backend", &be),
                ("backend-id", "0"),
                ("handle", &handle),
                ("mac", mac),
                ("state", "1"),
            ],
        )?;
        write_keys(
            &mut xs,
            &be,
            &[
                ("frontend", &fe),
                ("frontend-id", "0"),
                ("handle", &handle),
                ("mac", mac),
                ("online", "1"),
            ],
        )?;
        let mut f = Front {
            xs,
            fe,
            be,
            pages,
            evt,
            port,
            ports,
            req_prod: 0,
            rsp_cons: 0,
            rx_req_prod: 0,
            rx_rsp_cons: 0,
            next_id: 0,
        };
        f.await_backend(2)?;
        Ok(f)
    }

    /// The keys an honest netfront writes for its queues (flat for one, under
    /// `queue-N/` for more), in order.
    fn ring_keys(&self) -> Vec<(String, String)> {
        let n = self.ports.len();
        let mut k = vec![("multi-queue-num-queues".to_string(), n.to_string())];
        for (q, port) in self.ports.iter().enumerate() {
            let dir = if n == 1 {
                String::new()
            } else {
                format!("queue-{q}/")
            };
            k.push((
                format!("{dir}tx-ring-ref"),
                self.pages.gref(2 * q).to_string(),
            ));
            k.push((
                format!("{dir}rx-ring-ref"),
                self.pages.gref(2 * q + 1).to_string(),
            ));
            k.push((format!("{dir}event-channel"), port.to_string()));
        }
        for f in [
            "request-rx-copy",
            "feature-rx-notify",
            "feature-sg",
            "feature-gso-tcpv4",
        ] {
            k.push((f.to_string(), "1".to_string()));
        }
        k
    }

    /// Writes `keys` and says Connected.
    fn offer(&mut self, keys: &[(String, String)]) -> Result<()> {
        for (k, v) in keys {
            self.xs.write(&format!("{}/{k}", self.fe), v)?;
        }
        self.xs.write(&format!("{}/state", self.fe), "4")?;
        Ok(())
    }

    fn offer_rings(&mut self) -> Result<()> {
        let keys = self.ring_keys();
        self.offer(&keys)?;
        self.await_backend(4)
    }

    fn await_backend(&mut self, want: u32) -> Result<()> {
        let start = Instant::now();
        loop {
            let state = self.xs.try_read(&format!("{}/state", self.be))?;
            if state.as_deref().map(str::trim) == Some(&want.to_string()) {
                return Ok(());
            }
            if start.elapsed() > Duration::from_secs(60) {
                let err = self.xs.try_read(&format!("{}/error", self.be))?;
                bail!("backend state {state:?}, not {want} (error: {err:?})");
            }
            sleep(Duration::from_millis(50));
        }
    }

    /// Closes (Closing, then Closed once gsonet has let go), and starts over with
    /// fresh rings and a fresh event channel.
    fn reconnect(mut self, devid: u32, mac: &str) -> Result<Front> {
        self.xs.write(&format!("{}/state", self.fe), "5")?;
        self.await_backend(6)?;
        self.xs.write(&format!("{}/state", self.fe), "6")?;
        drop(self);
        Front::connect(devid, mac)
    }

    fn id(&mut self) -> u16 {
        self.next_id = self.next_id.wrapping_add(1) % 256;
        self.next_id
    }

    /// Writes `slots` (requests or extras, 12 bytes each) and publishes them.
    fn push(&mut self, slots: &[[u8; netif::TX_SLOT]], notify: bool) -> Result<()> {
        for (i, s) in slots.iter().enumerate() {
            let at = netif::tx_slot_off(self.req_prod.wrapping_add(i as u32));
            self.tx().write(at, s);
        }
        self.req_prod = self.req_prod.wrapping_add(slots.len() as u32);
        self.tx().store(netif::REQ_PROD, self.req_prod);
        self.tx().full_fence();
        if notify {
            self.evt.notify(self.port)?;
        }
        Ok(())
    }

    /// The next `n` TX responses' statuses, or None if they do not come in `t`.
    fn responses(&mut self, n: u32, t: Duration) -> Option<Vec<i16>> {
        let start = Instant::now();
        while self.tx().load(netif::RSP_PROD).wrapping_sub(self.rsp_cons) < n {
            if start.elapsed() > t {
                return None;
            }
            sleep(Duration::from_millis(2));
        }
        let mut out = Vec::new();
        for _ in 0..n {
            let mut b = [0u8; 4];
            self.tx().read(netif::tx_slot_off(self.rsp_cons), &mut b);
            out.push(i16::from_le_bytes([b[2], b[3]]));
            self.rsp_cons = self.rsp_cons.wrapping_add(1);
        }
        Some(out)
    }

    fn req(&mut self, gref: u32, offset: u16, flags: u16, size: u16) -> [u8; netif::TX_SLOT] {
        let id = self.id();
        TxRequest {
            gref,
            offset,
            flags,
            id,
            size,
        }
        .encode()
    }

    /// One packet on queue `q`'s TX ring, notified on the queue's own event channel:
    /// whether its answer, on that ring, is `want`.
    fn expect_on_queue(&mut self, q: usize, slot: [u8; netif::TX_SLOT], want: i16) -> String {
        let port = self.ports[q];
        let ring = self.pages.page(2 * q);
        let prod = ring.load(netif::REQ_PROD);
        ring.write(netif::tx_slot_off(prod), &slot);
        ring.store(netif::REQ_PROD, prod.wrapping_add(1));
        ring.full_fence();
        if let Err(e) = self.evt.notify(port) {
            return format!("fail:notify:{e}");
        }
        let start = Instant::now();
        while ring.load(netif::RSP_PROD) != prod.wrapping_add(1) {
            if start.elapsed() > T {
                return format!("fail:no-answer-on-queue-{q}");
            }
            sleep(Duration::from_millis(2));
        }
        let mut b = [0u8; 4];
        ring.read(netif::tx_slot_off(prod), &mut b);
        match i16::from_le_bytes([b[2], b[3]]) {
            s if s == want => "ok".into(),
            s => format!("fail:queue-{q}-answer:{s}:want:{want}"),
        }
    }

    /// Says Closing, waits for the backend's Closed, says Closed.
    fn close(mut self) -> Result<()> {
        self.xs.write(&format!("{}/state", self.fe), "5")?;
        self.await_backend(6)?;
        self.xs.write(&format!("{}/state", self.fe), "6")?;
        Ok(())
    }

    /// Sends `slots` and checks that their answers are `want`.
    fn expect(&mut self, slots: &[[u8; netif::TX_SLOT]], notify: bool, want: &[i16]) -> String {
        if let Err(e) = self.push(slots, notify) {
            return format!("fail:push:{e}");
        }
        match self.responses(want.len() as u32, T) {
            None => "fail:no-answer".into(),
            Some(got) if got == want => "ok".into(),
            Some(got) => format!("fail:answers:{got:?}:want:{want:?}"),
        }
    }
}

/// Writes each `key = value` under the xenstore directory `dir`, in order.
fn write_keys(xs: &mut Xenstore, dir: &str, keys: &[(&str, &str)]) -> Result<()> {
    for (k, v) in keys {
        xs.write(&format!("{dir}/{k}"), v)?;
    }
    Ok(())
}

fn report(case: &str, outcome: &str) {
    println!("RESULT hostile.{case}={outcome}");
}

const OK: i16 = netif::RSP_OKAY;
const ERR: i16 = netif::RSP_ERROR;
const NULL: i16 = netif::RSP_NULL;

fn main() -> Result<()> {
    let args = Args::parse();
    let mac = parse_mac(&args.mac)?;
    let mut f = Front::connect(args.devid, &args.mac)?;
    println!("XT-NOTE hostile netfront connected as vif0.{}", args.devid);
    let arp = arp_request(mac, args.ip, args.peer_ip);
    f.pages.page(2).write(0, &arp);
    let d0 = f.data_gref(0);
    let arp_len = arp.len() as u16;

    let s = [f.req(d0, 0, 0, arp_len)];
    report("valid", &f.expect(&s, true, &[OK]));

    let s = [f.req(BAD_GREF, 0, 0, arp_len)];
    report("bad_grant", &f.expect(&s, true, &[ERR]));

    // 19 data slots of 64 bytes: one more than XEN_NETIF_NR_SLOTS_MIN.
    let mut s = vec![f.req(d0, 0, netif::TXF_MORE_DATA, 19 * 64)];
    for i in 1..19u16 {
        let more = if i < 18 { netif::TXF_MORE_DATA } else { 0 };
        s.push(f.req(d0, 64 * i, more, 64));
    }
    report("too_many_slots", &f.expect(&s, true, &[ERR; 19]));

    let s = [
        f.req(d0, 0, netif::TXF_MORE_DATA, 100),
        f.req(d0, 100, 0, 200),
    ];
    report("slots_mismatch", &f.expect(&s, true, &[ERR, ERR]));

    let s = [f.req(d0, 4000, 0, 200)];
    report("past_page", &f.expect(&s, true, &[ERR]));

    // 17 slots holding 4095 + 16 x 4096 bytes: more than the 16-bit size can say.
    let mut s = vec![f.req(d0, 0, netif::TXF_MORE_DATA, u16::MAX)];
    for i in 1..17 {
        let more = if i < 16 { netif::TXF_MORE_DATA } else { 0 };
        let g = f.data_gref(i);
        s.push(f.req(g, 0, more, 4096));
    }
    report("oversized", &f.expect(&s, true, &[ERR; 17]));

    let gso_flags = netif::TXF_EXTRA_INFO | netif::TXF_CSUM_BLANK;
    let cases: [(&str, u16, [u8; 8]); 4] = [
        (
            "gso_size_zero",
            gso_flags,
            netif::gso_extra(0, netif::GSO_TYPE_TCPV4, false),
        ),
        ("gso_bad_type", gso_flags, netif::gso_extra(1448, 9, false)),
        ("unknown_extra", gso_flags, [7, 0, 0, 0, 0, 0, 0, 0]),
        (
            "gso_without_csum_blank",
            netif::TXF_EXTRA_INFO,
            netif::gso_extra(1448, netif::GSO_TYPE_TCPV4, false),
        ),
    ];
    for (name, flags, extra) in cases {
        let s = [f.req(d0, 0, flags, arp_len), netif::tx_extra_slot(extra)];
        report(name, &f.expect(&s, true, &[ERR, NULL]));
    }

    let s = [f.req(d0, 0, 0, 10)];
    report("too_short", &f.expect(&s, true, &[ERR]));

    // A packet and no event: found by the worker's periodic look.
    let s = [f.req(d0, 0, 0, arp_len)];
    report("no_event", &f.expect(&s, false, &[OK]));

    // An event flood, then a packet: answered as usual.
    let start = Instant::now();
    let mut flood = "ok".to_string();
    for _ in 0..args.flood {
        if let Err(e) = f.evt.notify(f.port) {
            flood = format!("fail:notify:{e}");
            break;
        }
    }
    println!(
        "XT-NOTE hostile flood: {} notifications in {:.2} s",
        args.flood,
        start.elapsed().as_secs_f64()
    );
    let s = [f.req(d0, 0, 0, arp_len)];
    let after = f.expect(&s, true, &[OK]);
    report("flood", if flood == "ok" { &after } else { &flood });

    // RX buffers nobody granted, then an ARP request whose reply comes back to us:
    // gsonet's copy into them fails, and the response says so.
    for i in 0..16u32 {
        let mut r = [0u8; netif::RX_SLOT];
        r[0..2].copy_from_slice(&(i as u16).to_le_bytes());
        r[4..8].copy_from_slice(&BAD_GREF.to_le_bytes());
        f.rx().write(netif::rx_slot_off(f.rx_req_prod), &r);
        f.rx_req_prod = f.rx_req_prod.wrapping_add(1);
    }
    f.rx().store(netif::REQ_PROD, f.rx_req_prod);
    f.rx().full_fence();
    f.evt.notify(f.port)?;
    let s = [f.req(d0, 0, 0, arp_len)];
    let sent = f.expect(&s, true, &[OK]);
    let start = Instant::now();
    let rx = loop {
        if f.rx().load(netif::RSP_PROD) != f.rx_rsp_cons {
            let mut b = [0u8; netif::RX_SLOT];
            f.rx().read(netif::rx_slot_off(f.rx_rsp_cons), &mut b);
            f.rx_rsp_cons = f.rx_rsp_cons.wrapping_add(1);
            let status = i16::from_le_bytes([b[6], b[7]]);
            break if status == ERR {
                "ok".to_string()
            } else {
                format!("fail:rx-status:{status}")
            };
        }
        if start.elapsed() > T {
            break "fail:no-rx-answer".to_string();
        }
        sleep(Duration::from_millis(5));
    };
    report("rx_bad_grant", if sent == "ok" { &rx } else { &sent });

    // The producer index a thousand slots ahead: the vif stops (no answers)...
    f.req_prod = f.req_prod.wrapping_add(1000);
    f.tx().store(netif::REQ_PROD, f.req_prod);
    f.evt.notify(f.port)?;
    sleep(Duration::from_secs(1));
    let jumped = if f.tx().load(netif::RSP_PROD) == f.rsp_cons {
        "ok"
    } else {
        "fail:answered"
    };
    report("ring_jump", jumped);
    // ... until the netfront starts over, and is then served as any other.
    let mut f = f.reconnect(args.devid, &args.mac)?;
    f.pages.page(2).write(0, &arp);
    let d0 = f.data_gref(0);
    let s = [f.req(d0, 0, 0, arp_len)];
    report("reconnect", &f.expect(&s, true, &[OK]));
    f.close()?;
    queue_cases(args.devid, &args.mac, &arp)
}

/// A netfront with `queues` queues whose keys `edit` spoils: gsonet must refuse it
/// (Closing, then Closed, with an `error` key containing `want`), never Connected.
fn refused(
    devid: u32,
    mac: &str,
    queues: usize,
    want: &str,
    edit: impl FnOnce(&mut Vec<(String, String)>, u32),
) -> Result<String> {
    let mut f = Front::setup(devid, mac, queues)?;
    let max_key = format!("{}/multi-queue-max-queues", f.be);
    let Some(max) =
        f.xs.try_read(&max_key)?
            .and_then(|v| v.trim().parse::<u32>().ok())
    else {
        return Ok("fail:no-multi-queue-max-queues".into());
    };
    let mut keys = f.ring_keys();
    edit(&mut keys, max);
    f.offer(&keys)?;
    let start = Instant::now();
    let outcome = loop {
        let state = f.xs.try_read(&format!("{}/state", f.be))?;
        match state.as_deref().map(str::trim) {
            Some("4") => break "fail:connected".to_string(),
            Some("5" | "6") => {
                let err =
                    f.xs.try_read(&format!("{}/error", f.be))?
                        .unwrap_or_default();
                break if err.contains(want) {
                    "ok".to_string()
                } else {
                    format!("fail:error:{err:?}:want:{want:?}")
                };
            }
            _ if start.elapsed() > T => break format!("fail:state:{state:?}"),
            _ => sleep(Duration::from_millis(20)),
        }
    };
    println!("XT-NOTE hostile queues {queues} (max {max}): {outcome}");
    f.xs.write(&format!("{}/state", f.fe), "6")?;
    Ok(outcome)
}

fn set(keys: &mut [(String, String)], key: &str, value: String) {
    if let Some(k) = keys.iter_mut().find(|(k, _)| k == key) {
        k.1 = value;
    }
}

fn get(keys: &[(String, String)], key: &str) -> String {
    keys.iter()
        .find(|(k, _)| k == key)
        .map(|(_, v)| v.clone())
        .unwrap_or_default()
}

fn queue_cases(devid: u32, mac: &str, arp: &[u8]) -> Result<()> {
    let r = refused(devid, mac, 2, "queues; 1 to", |k, max| {
        set(k, "multi-queue-num-queues", (max + 1).to_string())
    })?;
    report("queues_too_many", &r);
    let r = refused(devid, mac, 2, "queues; 1 to", |k, _| {
        set(k, "multi-queue-num-queues", "0".into())
    })?;
    report("queues_zero", &r);
    let r = refused(devid, mac, 2, "queue-1/rx-ring-ref: missing", |k, _| {
        k.retain(|(k, _)| k != "queue-1/rx-ring-ref")
    })?;
    report("queue_keys_missing", &r);
    let r = refused(devid, mac, 2, "shared between queues", |k, _| {
        let tx0 = get(k, "queue-0/tx-ring-ref");
        set(k, "queue-1/tx-ring-ref", tx0)
    })?;
    report("queue_rings_shared", &r);
    let r = refused(devid, mac, 2, "shared between queues", |k, _| {
        let e0 = get(k, "queue-0/event-channel");
        set(k, "queue-1/event-channel", e0)
    })?;
    report("queue_evtchn_shared", &r);
    // Two honest queues: each served on its own ring and event channel.
    let mut f = Front::setup(devid, mac, 2)?;
    f.offer_rings()?;
    f.pages.page(4).write(0, arp);
    let d0 = f.data_gref(0);
    let mut outcome = "ok".to_string();
    for q in [1, 0] {
        let s = f.req(d0, 0, 0, arp.len() as u16);
        let r = f.expect_on_queue(q, s, OK);
        if r != "ok" {
            outcome = r;
        }
    }
    report("two_queues", &outcome);
    f.close()
}

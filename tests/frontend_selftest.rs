//! Self-test of the test frontend (tests/common/frontend.rs) against an independent
//! backend: a loopback built on rust-vmm's `vhost-user-backend` and `virtio-queue`,
//! which copies every TX chain (header included) into the RX queue, spanning several
//! buffers with MRG_RXBUF. This checks the frontend against the rust-vmm implementation
//! of the device side, not against itself.

mod common;

use std::collections::VecDeque;
use std::io;
use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::Duration;

use common::frontend::{
    feat, temp_socket_path, BadTx, FrontendOpts, TestFrontend, TxLayout, RX_QUEUE, TX_QUEUE,
};
use gsonet::testkit::frames::payload;
use gsonet::vnet_hdr::{GsoKind, GsoType, VirtioNetHdr, F_NEEDS_CSUM, HDR_LEN};
use vhost::vhost_user::message::VhostUserProtocolFeatures;
use vhost_user_backend::{VhostUserBackend, VhostUserDaemon, VringRwLock, VringT};
use virtio_queue::QueueT;
use vm_memory::{
    Address, Bytes, GuestAddress, GuestAddressSpace, GuestMemoryAtomic, GuestMemoryMmap,
};
use vmm_sys_util::epoll::EventSet;

type GM = GuestMemoryAtomic<GuestMemoryMmap<()>>;

const T: Duration = Duration::from_secs(3);

// ---------------------------------------------------------------------------------------
// Loopback backend

#[derive(Default)]
struct LoopState {
    mem: Option<GM>,
    acked: u64,
    event_idx: bool,
    pending: VecDeque<Vec<u8>>,
    forwarded: u64,
    dropped: u64,
}

struct Loopback {
    offered: u64,
    st: Mutex<LoopState>,
}

impl Loopback {
    fn new(offered: u64) -> Arc<Self> {
        Arc::new(Loopback {
            offered,
            st: Mutex::new(LoopState::default()),
        })
    }

    /// Pop every TX chain; valid ones are queued for RX, malformed ones dropped. All are
    /// returned as used (len 0).
    fn drain_tx(&self, st: &mut LoopState, vring: &VringRwLock) -> io::Result<()> {
        let mem = st.mem.clone().unwrap().memory();
        let mut v = vring.get_mut();
        let mut any = false;
        let qsize = v.get_queue().size() as usize;
        loop {
            if st.event_idx {
                v.disable_notification().map_err(io::Error::other)?;
            }
            while let Some(chain) = v.get_queue_mut().pop_descriptor_chain(mem.clone()) {
                let head = chain.head_index();
                let mut buf = Vec::new();
                let mut ok = true;
                let mut last_has_next = false;
                let mut count = 0;
                for d in chain.clone() {
                    count += 1;
                    last_has_next = d.has_next();
                    if d.is_write_only() || d.len() > 1 << 20 {
                        ok = false;
                        break;
                    }
                    let start = buf.len();
                    buf.resize(start + d.len() as usize, 0);
                    if mem.read_slice(&mut buf[start..], d.addr()).is_err() {
                        ok = false;
                        break;
                    }
                }
                // The chain iterator silently stops at loops, overlong chains and bad
                // indirect tables; a final descriptor that still has NEXT gives it away.
                // It accepts indirect tables longer than the queue: check the count.
                if last_has_next || count == 0 || count > qsize || buf.len() < HDR_LEN {
                    ok = false;
                }
                if ok {
                    st.pending.push_back(buf);
                } else {
                    st.dropped += 1;
                }
                v.add_used(head, 0).map_err(io::Error::other)?;
                any = true;
            }
            if !st.event_idx || !v.enable_notification().map_err(io::Error::other)? {
                break;
            }
        }
        if any && v.needs_notification().map_err(io::Error::other)? {
            v.signal_used_queue()?;
        }
        Ok(())
    }

    /// Copy pending frames into RX buffers (several per frame with MRG_RXBUF).
    fn fill_rx(&self, st: &mut LoopState, vring: &VringRwLock) -> io::Result<()> {
        let mem = st.mem.clone().unwrap().memory();
        let mrg = st.acked & feat::MRG_RXBUF != 0;
        let mut v = vring.get_mut();
        let mut any = false;
        'frames: while let Some(frame) = st.pending.front() {
            let saved = v.get_queue().next_avail();
            let mut used: Vec<(u16, u32)> = Vec::new();
            let mut off = 0usize;
            let mut nb_addr: [Option<GuestAddress>; 2] = [None, None];
            while off < frame.len() {
                let Some(chain) = v.get_queue_mut().pop_descriptor_chain(mem.clone()) else {
                    // Out of buffers: undo, ask to be kicked, retry if some appeared.
                    v.get_queue_mut().set_next_avail(saved);
                    if st.event_idx && v.enable_notification().map_err(io::Error::other)? {
                        continue 'frames;
                    }
                    break 'frames;
                };
                let head = chain.head_index();
                let mut written = 0u32;
                for d in chain.clone() {
                    if off == frame.len() {
                        break;
                    }
                    assert!(d.is_write_only(), "read-only descriptor in an RX chain");
                    let n = (d.len() as usize).min(frame.len() - off);
                    mem.write_slice(&frame[off..off + n], d.addr()).unwrap();
                    for (k, b) in [10usize, 11].into_iter().enumerate() {
                        if off <= b && b < off + n {
                            nb_addr[k] = Some(d.addr().unchecked_add((b - off) as u64));
                        }
                    }
                    off += n;
                    written += n as u32;
                }
                used.push((head, written));
                if !mrg && off < frame.len() {
                    // Does not fit one chain: drop it, consume the chain.
                    break;
                }
            }
            let nb = if mrg { used.len() as u16 } else { 1 };
            let nbb = nb.to_le_bytes();
            for (k, a) in nb_addr.iter().enumerate() {
                if let Some(a) = a {
                    mem.write_obj(nbb[k], *a).unwrap();
                }
            }
            for (h, l) in used {
                v.add_used(h, l).map_err(io::Error::other)?;
            }
            if off < frame.len() {
                st.dropped += 1;
            } else {
                st.forwarded += 1;
            }
            st.pending.pop_front();
            any = true;
        }
        if any && v.needs_notification().map_err(io::Error::other)? {
            v.signal_used_queue()?;
        }
        Ok(())
    }
}

impl VhostUserBackend for Loopback {
    type Bitmap = ();
    type Vring = VringRwLock;

    fn num_queues(&self) -> usize {
        2
    }
    fn max_queue_size(&self) -> usize {
        1024
    }
    fn features(&self) -> u64 {
        self.offered
    }
    fn acked_features(&self, features: u64) {
        self.st.lock().unwrap().acked = features;
    }
    fn protocol_features(&self) -> VhostUserProtocolFeatures {
        VhostUserProtocolFeatures::MQ
            | VhostUserProtocolFeatures::REPLY_ACK
            | VhostUserProtocolFeatures::CONFIG
    }
    fn set_event_idx(&self, enabled: bool) {
        self.st.lock().unwrap().event_idx = enabled;
    }
    fn update_memory(&self, mem: GM) -> io::Result<()> {
        self.st.lock().unwrap().mem = Some(mem);
        Ok(())
    }
    fn handle_event(
        &self,
        device_event: u16,
        _evset: EventSet,
        vrings: &[VringRwLock],
        _thread_id: usize,
    ) -> io::Result<()> {
        let mut st = self.st.lock().unwrap();
        if device_event as usize == TX_QUEUE {
            self.drain_tx(&mut st, &vrings[TX_QUEUE])?;
        }
        self.fill_rx(&mut st, &vrings[RX_QUEUE])
    }
}

const OFFERED: u64 = feat::VERSION_1
    | feat::CSUM
    | feat::GUEST_CSUM
    | feat::HOST_TSO4
    | feat::GUEST_TSO4
    | feat::MRG_RXBUF
    | feat::EVENT_IDX
    | feat::INDIRECT_DESC
    | feat::PROTOCOL_FEATURES;

/// Serve a loopback on a fresh socket (the backend listens).
fn spawn_loopback() -> (PathBuf, Arc<Loopback>) {
    let path = temp_socket_path("loop");
    let backend = Loopback::new(OFFERED);
    let mem = GuestMemoryAtomic::new(GuestMemoryMmap::<()>::new());
    let mut daemon = VhostUserDaemon::new("loopback".into(), backend.clone(), mem).unwrap();
    let p = path.clone();
    thread::spawn(move || {
        let _ = daemon.serve(&p);
    });
    (path, backend)
}

fn opts(features: u64) -> FrontendOpts {
    FrontendOpts {
        features,
        require_features: true,
        ..Default::default()
    }
}

fn connect(features: u64) -> (TestFrontend, Arc<Loopback>) {
    let (path, backend) = spawn_loopback();
    let fe = TestFrontend::connect(&path, opts(features)).expect("handshake");
    let _ = std::fs::remove_file(&path);
    (fe, backend)
}

fn tso_hdr() -> VirtioNetHdr {
    VirtioNetHdr {
        flags: F_NEEDS_CSUM,
        gso: GsoType {
            kind: GsoKind::TcpV4,
            ecn: false,
        },
        hdr_len: 54,
        gso_size: 1448,
        csum_start: 34,
        csum_offset: 16,
        num_buffers: 1,
    }
}

/// Send, reclaim, receive, compare byte-exact.
fn round_trip(fe: &mut TestFrontend, len: usize, layout: TxLayout, seed: u32) -> u16 {
    let frame = payload(len, seed);
    let hdr = tso_hdr();
    fe.send(&hdr, &frame, layout.clone()).unwrap();
    fe.wait_tx_done(T).unwrap();
    let got = fe
        .try_recv(T)
        .unwrap()
        .unwrap_or_else(|| panic!("no frame back: len {len} {layout:?}"));
    let mut expect = hdr;
    expect.num_buffers = got.hdr.num_buffers;
    assert_eq!(got.hdr, expect, "header, len {len} {layout:?}");
    assert_eq!(got.frame.len(), frame.len(), "length, {layout:?}");
    assert!(got.frame == frame, "payload differs, len {len} {layout:?}");
    assert_eq!(got.buffers, got.hdr.num_buffers);
    got.hdr.num_buffers
}

const SIZES: [usize; 3] = [60, 1514, 65536];

#[test]
fn handshake_negotiates_subset() {
    let want = feat::VERSION_1 | feat::MRG_RXBUF | feat::HOST_TSO6;
    let (path, _b) = spawn_loopback();
    let fe = TestFrontend::connect(
        &path,
        FrontendOpts {
            features: want,
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(
        fe.acked_features(),
        feat::VERSION_1 | feat::MRG_RXBUF | feat::PROTOCOL_FEATURES
    );
    assert_eq!(fe.offered_features(), OFFERED);
    assert!(fe
        .acked_protocol_features()
        .contains(VhostUserProtocolFeatures::REPLY_ACK | VhostUserProtocolFeatures::MQ));
    // require_features refuses what is not offered.
    let (path, _b) = spawn_loopback();
    let r = TestFrontend::connect(
        &path,
        FrontendOpts {
            features: want,
            require_features: true,
            ..Default::default()
        },
    );
    assert!(r.is_err());
}

#[test]
fn all_layouts_mrg_rxbuf() {
    let (mut fe, b) = connect(feat::LINUX_DEFAULT & OFFERED);
    assert!(fe.has(feat::MRG_RXBUF | feat::EVENT_IDX | feat::INDIRECT_DESC));
    fe.post_rx(256, 4096).unwrap();
    let mut seed = 0;
    for len in SIZES {
        for layout in TxLayout::matrix() {
            seed += 1;
            let nb = round_trip(&mut fe, len, layout, seed);
            assert_eq!(nb as usize, (len + HDR_LEN).div_ceil(4096));
        }
    }
    assert_eq!(b.st.lock().unwrap().dropped, 0);
    // Notification suppression was in effect and calls did arrive.
    assert!(fe.stats(RX_QUEUE).calls > 0 && fe.stats(TX_QUEUE).calls > 0);
}

#[test]
fn all_layouts_big_buffers_no_mrg_no_event_idx() {
    let (mut fe, _b) =
        connect(feat::VERSION_1 | feat::CSUM | feat::HOST_TSO4 | feat::INDIRECT_DESC);
    assert!(!fe.has(feat::MRG_RXBUF) && !fe.has(feat::EVENT_IDX));
    fe.post_rx(64, (65536 + HDR_LEN) as u32).unwrap();
    let mut seed = 100;
    for len in SIZES {
        for layout in TxLayout::matrix() {
            seed += 1;
            assert_eq!(round_trip(&mut fe, len, layout, seed), 1);
        }
    }
}

#[test]
fn rx_chains_big_packets_mode() {
    // Without MRG_RXBUF, Linux posts header + page-sized pieces in one chain.
    let (mut fe, _b) = connect(feat::VERSION_1 | feat::EVENT_IDX);
    let mut sizes = vec![HDR_LEN as u32];
    sizes.extend(std::iter::repeat_n(4096, 17));
    fe.post_rx_chains(12, &sizes).unwrap();
    for (i, len) in SIZES.into_iter().enumerate() {
        round_trip(&mut fe, len, TxLayout::HeaderThenChunks(4096), i as u32);
    }
}

#[test]
fn mrg_rxbuf_small_buffers_reassemble_64k() {
    let (mut fe, _b) = connect(feat::VERSION_1 | feat::MRG_RXBUF | feat::EVENT_IDX);
    fe.post_rx(256, 2048).unwrap();
    // Frame + 12-byte header in 2048-byte buffers: 2036 fills one exactly, 2037 needs
    // a second, 65536 (65548 with the header) needs 33.
    for (i, (len, want)) in [
        (60usize, 1u16),
        (1514, 1),
        (2036, 1),
        (2037, 2),
        (65536, 33),
    ]
    .into_iter()
    .enumerate()
    {
        let nb = round_trip(&mut fe, len, TxLayout::HeaderSeparate, i as u32);
        assert_eq!(nb, want, "len {len}");
    }
}

#[test]
fn many_frames_wrap_the_rings_with_reposting() {
    for features in [
        feat::VERSION_1 | feat::MRG_RXBUF | feat::EVENT_IDX,
        feat::VERSION_1 | feat::MRG_RXBUF,
    ] {
        let (path, _b) = spawn_loopback();
        let mut fe = TestFrontend::connect(
            &path,
            FrontendOpts {
                features,
                queue_size: 64,
                ..Default::default()
            },
        )
        .unwrap();
        fe.post_rx(64, 1536).unwrap();
        let hdr = VirtioNetHdr::default();
        let mut sent = Vec::new();
        for batch in 0..40u32 {
            for k in 0..16u32 {
                let len = 60 + ((batch * 16 + k) as usize * 97) % 3000;
                let f = payload(len, batch * 16 + k);
                fe.send(&hdr, &f, TxLayout::HeaderSeparate).unwrap();
                sent.push(f);
            }
            fe.wait_tx_done(T).unwrap();
            for f in sent.drain(..) {
                let (h, got) = fe.recv(T).expect("frame");
                assert_eq!(h.num_buffers as usize, (f.len() + HDR_LEN).div_ceil(1536));
                assert!(got == f);
            }
        }
        assert_eq!(fe.stats(TX_QUEUE).used, 640);
        if features & feat::EVENT_IDX != 0 {
            assert!(fe.stats(RX_QUEUE).kicks_suppressed > 0);
        }
    }
}

#[test]
fn multiple_memory_regions() {
    let (path, _b) = spawn_loopback();
    let mut fe = TestFrontend::connect(
        &path,
        FrontendOpts {
            mem_regions: 3,
            mem_size: 96 << 20,
            ..Default::default()
        },
    )
    .unwrap();
    fe.post_rx(128, 4096).unwrap();
    for (i, layout) in TxLayout::matrix().into_iter().enumerate() {
        round_trip(&mut fe, 65536, layout, i as u32);
    }
}

#[test]
fn always_kick_and_queue_size_1024() {
    let (path, _b) = spawn_loopback();
    let mut fe = TestFrontend::connect(
        &path,
        FrontendOpts {
            queue_size: 1024,
            always_kick: true,
            ..Default::default()
        },
    )
    .unwrap();
    fe.post_rx(1024, 2048).unwrap();
    for i in 0..8 {
        round_trip(&mut fe, 65536, TxLayout::Chunks(1000), i);
    }
    assert_eq!(fe.stats(TX_QUEUE).kicks_suppressed, 0);
}

#[test]
fn client_mode_backend_connects() {
    let path = temp_socket_path("client");
    let listener = UnixListener::bind(&path).unwrap();
    let backend = Loopback::new(OFFERED);
    let mem = GuestMemoryAtomic::new(GuestMemoryMmap::<()>::new());
    let mut daemon = VhostUserDaemon::new("loopback".into(), backend.clone(), mem).unwrap();
    let p = path.to_str().unwrap().to_owned();
    thread::spawn(move || {
        daemon.start_client(&p).unwrap();
        let _ = daemon.wait();
    });
    let mut fe = TestFrontend::accept(&listener, FrontendOpts::default()).unwrap();
    let _ = std::fs::remove_file(&path);
    fe.post_rx(64, 2048).unwrap();
    round_trip(&mut fe, 1514, TxLayout::Single, 7);
    round_trip(
        &mut fe,
        65536,
        TxLayout::indirect(TxLayout::Chunks(4096)),
        8,
    );
}

#[test]
fn malformed_chains_are_published_and_reclaimed() {
    let (mut fe, b) = connect(feat::LINUX_DEFAULT & OFFERED);
    fe.post_rx(64, 4096).unwrap();
    for (i, bad) in BadTx::ALL.into_iter().enumerate() {
        let head = fe.send_bad(bad).unwrap();
        fe.wait_tx_done(T)
            .unwrap_or_else(|e| panic!("{bad:?}: {e}"));
        assert_eq!(
            fe.raw_used().last().map(|r| (r.0, r.1)),
            Some((TX_QUEUE, head))
        );
        assert_eq!(
            b.st.lock().unwrap().dropped,
            i as u64 + 1,
            "{bad:?} not dropped"
        );
        // Nothing came through, and the queue still works.
        assert!(
            fe.recv(Duration::from_millis(20)).is_none(),
            "{bad:?} delivered"
        );
        round_trip(&mut fe, 1514, TxLayout::HeaderSeparate, i as u32);
    }
    // Unknown gso_type (2) can only be sent as raw bytes; the loopback forwards it and
    // the frontend reports the device header as bad.
    let mut bytes = common::wire_hdr::encode(&VirtioNetHdr::default()).to_vec();
    bytes[1] = 2;
    bytes.extend_from_slice(&payload(60, 1));
    fe.send_bytes(&bytes, TxLayout::Single).unwrap();
    fe.wait_tx_done(T).unwrap();
    assert!(fe.try_recv(T).is_err());
    let stopped = fe.stop().unwrap();
    assert_eq!(stopped[1] as u64, fe.stats(TX_QUEUE).published);
}

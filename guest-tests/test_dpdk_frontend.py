"""gsonet against a vhost-user frontend it did not write: DPDK's virtio_user.

``dpdk-testpmd --vdev net_virtio_user0,path=SOCK,queues=1`` drives a virtio-net
device over vhost-user from user space: a second, independent implementation of
the frontend side besides QEMU. No guest boots here; each test runs testpmd for
a few seconds (it busy-polls one core), reads its port statistics on its
interactive prompt, and compares them with ``gsonet stats --json``.

- txonly -> tap: DPDK's 64-byte UDP frames reach the tap, parse with scapy and
  are accepted by the host's UDP stack.
- tap -> rxonly: frames injected into the tap reach DPDK, byte for byte.
- two DPDK frontends on two ports: gsonet switches A's frames to B only; again
  with packed rings (``packed_vq=1``; gsonet ports offer them by default), and with
  VIRTIO_F_IN_ORDER (``in_order=1`` on ``in_order=on`` ports), split and packed.
- which offloads virtio_user acks, by default and when testpmd asks for them;
  with TSO acked, a 64 KiB TCP frame from the tap reaches DPDK as one buffer.
- killing testpmd leaves gsonet serving; a second testpmd attaches.

Skips with a reason when not root, /dev/net/tun or dpdk-testpmd is missing
(scripts/setup.sh installs the ``dpdk`` package).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import struct
import threading
import time
from pathlib import Path

import pytest

from harness.gsonet import Gsonet, counters_delta
from harness.hostnet import alloc_subnet, set_addr, tun_available, unique_name
from harness.paths import TESTPMD
from harness.testpmd import TestPmd

# DPDK's memory (a memfd without seals under --no-huge, hugetlbfs files otherwise)
# cannot be sealed against shrinking: gsonet takes it only where the port allows it.
UNSEALED = "allow_unsealed_memory=on"

ETH_P_ALL = 0x0003
PACKET_OUTGOING = 4
SOL_PACKET = 263
PACKET_VNET_HDR = 15


def _virtio_user(name: str, sock, fwd: str, *, mac: str | None = None,
                 args: list[str] | None = None, devargs: str = "") -> TestPmd:
    """testpmd with one net_virtio_user port on a gsonet socket, forwarding ``fwd``
    (txonly, rxonly) from the start; ``devargs`` go on its vdev."""
    vdev = f"net_virtio_user0,path={os.fspath(sock)},queues=1"
    if mac:
        vdev += f",mac={mac}"
    if devargs:
        vdev += f",{devargs}"
    return TestPmd(name, [vdev], [f"--forward-mode={fwd}", "--auto-start", *(args or [])])


# ---- helpers ---------------------------------------------------------------------


def _skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "DPDK frontend tests need root (taps, vhost-user sockets)"
    if not tun_available():
        return "/dev/net/tun is missing"
    if shutil.which(TESTPMD) is None:
        return f"{TESTPMD} not installed (scripts/setup.sh installs the dpdk package)"
    try:
        import scapy.all  # noqa: F401
    except ImportError:
        return "scapy not installed (scripts/setup.sh)"
    return None


@pytest.fixture(scope="module")
def dpdk_env():
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)


def _quiet_tap(tap: str) -> None:
    """No IPv6 on the tap: no router solicitations or MLD reports mixed into the
    counts."""
    Path(f"/proc/sys/net/ipv6/conf/{tap}/disable_ipv6").write_text("1\n")


def _caps_str(p: dict) -> str:
    def on(c):
        return ",".join(k for k, v in sorted(c.items()) if v) or "none"
    return f"rx={on(p['guest_rx'])} tx={on(p['guest_tx'])} mrg_rxbuf={p['mrg_rxbuf']}"


def _bad_drops(*deltas: dict, allowed=("rx_queue_full",)) -> dict:
    return {k: v for d in deltas for k, v in d["drops"].items() if k not in allowed}


class Capture:
    """AF_PACKET capture of the frames gsonet writes into a tap (not the host's own
    outgoing frames): counts those from ``src_mac``, keeps the first ``keep``."""

    def __init__(self, ifname: str, src_mac: str | None = None, keep: int = 200):
        self.s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
        self.s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
        self.s.bind((ifname, 0))
        self.s.settimeout(0.2)
        self.src = bytes.fromhex(src_mac.replace(":", "")) if src_mac else None
        self.keep = keep
        self.frames: list[bytes] = []
        self.count = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                data, addr = self.s.recvfrom(65536)
            except socket.timeout:
                continue
            except OSError:
                break
            if addr[2] == PACKET_OUTGOING:
                continue
            if self.src is not None and data[6:12] != self.src:
                continue
            self.count += 1
            if len(self.frames) < self.keep:
                self.frames.append(data)

    def close(self) -> None:
        self._stop.set()
        self._t.join(timeout=5)
        self.s.close()


def _settle(probe, timeout: float = 5.0):
    """Calls ``probe()`` until it returns (True, value) or ``timeout`` passes;
    returns the last value. For counters that catch up a moment after traffic stops
    (a worker or a polling frontend not yet scheduled on a busy machine)."""
    deadline = time.monotonic() + timeout
    while True:
        ok, value = probe()
        if ok or time.monotonic() > deadline:
            return value
        time.sleep(0.05)


def _settle_a_drained(gs, before: dict, a1: dict) -> None:
    """Waits until gsonet took from port 0 (frontend A) every frame A counted sent
    since ``before``."""
    def drained():
        st = gs.stats()
        n = st["ports"][0]["stats"]["tx_frames"] - before["ports"][0]["stats"]["tx_frames"]
        return n == a1["tx_packets"], st
    _settle(drained)


def _settle_b_caught_up(gs, b, before: dict, b0: dict):
    """Waits until frontend B counted every frame gsonet delivered to port 1 since
    ``before``/``b0``; returns gsonet's stats and B's port stats then."""
    def caught_up():
        st, bs = gs.stats(), b.port_stats()
        n = st["ports"][1]["stats"]["rx_frames"] - before["ports"][1]["stats"]["rx_frames"]
        return bs["rx_packets"] - b0["rx_packets"] == n, (st, bs)
    return _settle(caught_up)


def _tap_tx_dropped(tap: str) -> int:
    """Frames the kernel dropped because the tap's queue was full (gsonet not reading)."""
    return int(Path(f"/sys/class/net/{tap}/statistics/tx_dropped").read_text())


def _net():
    n = alloc_subnet()
    return f"10.77.{n}.1", f"10.77.{n}.2"


# ---- tests -------------------------------------------------------------------------


def test_txonly_to_tap(dpdk_env, tmp_path, record_measurement):
    """DPDK txonly -> gsonet port -> tap. Every frame gsonet took from DPDK's TX ring
    was written to the tap (port tx_frames == uplink rx_frames, no drops on that
    path); the frames parse as Ether/IPv4/UDP with scapy (valid IP checksum, lengths
    consistent, 64 bytes) and the host's UDP stack accepts them (a socket bound to
    the destination receives datagrams)."""
    from scapy.all import IP, UDP, Ether, raw

    host_ip, peer_ip = _net()
    tap, sock = unique_name("fe"), tmp_path / "a.sock"
    dport = 40000 + os.getpid() % 20000
    a_mac = "02:00:00:fe:0a:01"
    with Gsonet([f"socket={sock},{UNSEALED}"], [f"tap={tap}"], workdir=tmp_path,
                name="gsonet-dpdk-tx") as gs:
        try:
            _quiet_tap(tap)
            set_addr(tap, f"{host_ip}/24")
            tap_mac = Path(f"/sys/class/net/{tap}/address").read_text().strip()
            udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            udp.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
            udp.bind((host_ip, dport))
            udp.setblocking(False)
            cap = Capture(tap, a_mac)
            before = gs.stats()
            tp = _virtio_user("tx", sock, "txonly", mac=a_mac,
                              args=[f"--eth-peer=0,{tap_mac}", f"--tx-ip={peer_ip},{host_ip}",
                                    f"--tx-udp=9,{dport}"])
            with tp:
                p = gs.wait_port(0, True)
                record_measurement("dpdk.acked.default", _caps_str(p))
                t0 = time.monotonic()
                s0 = gs.stats()
                time.sleep(3)
                s1 = gs.stats()
                secs = time.monotonic() - t0
                tp.cmd("stop")
                tps = tp.port_stats()

                def drained():
                    st = gs.stats()
                    n = st["ports"][0]["stats"]["tx_frames"] - before["ports"][0]["stats"]["tx_frames"]
                    return n == tps["tx_packets"], st
                _settle(drained)
            after = _settle(lambda: (False, gs.stats()), 0.2)
            cap.close()
            got = 0
            while True:
                try:
                    udp.recv(2048)
                    got += 1
                except BlockingIOError:
                    break
            udp.close()
        except BaseException:
            print(gs.log()[-3000:])
            raise
    port = counters_delta(before["ports"][0]["stats"], after["ports"][0]["stats"])
    up = counters_delta(before["uplinks"][0]["stats"], after["uplinks"][0]["stats"])
    pps = (s1["ports"][0]["stats"]["tx_frames"] - s0["ports"][0]["stats"]["tx_frames"]) / secs
    record_measurement("dpdk.txonly_to_tap.kpps", pps / 1000)
    record_measurement("dpdk.txonly_to_tap.frames", port["tx_frames"])
    record_measurement("dpdk.txonly_to_tap.captured", cap.count)
    record_measurement("dpdk.txonly_to_tap.udp_received", got)

    assert port["tx_frames"] > 0, port
    # every frame DPDK's ring handed over went to the tap
    assert tps["tx_packets"] == port["tx_frames"], (tps, port)
    assert up["rx_frames"] == port["tx_frames"], (port, up)
    assert port["tx_max_frame"] == 64 and port["tx_bytes"] == 64 * port["tx_frames"], port
    assert not port["drops"] or set(port["drops"]) <= {"rx_queue_full"}, port
    assert not up["drops"], up
    assert port["gso_passed"] == 0 and port["gso_segmented"] == 0, port

    # an independent parser: scapy
    assert cap.count > 0 and cap.frames, "no frames from DPDK on the tap"
    for data in cap.frames:
        assert len(data) == 64, len(data)
        e = Ether(data)
        assert e.src == a_mac and e.dst == tap_mac, e.summary()
        assert IP in e and UDP in e, e.summary()
        ip = e[IP]
        assert ip.src == peer_ip and ip.dst == host_ip, e.summary()
        assert ip.len == 64 - 14 and ip[UDP].len == 64 - 14 - 20, e.summary()
        fixed = ip.copy()
        del fixed.chksum
        assert IP(raw(fixed)).chksum == ip.chksum, "bad IPv4 header checksum"
        assert ip[UDP].dport == dport, e.summary()
    # the kernel took them as valid UDP datagrams
    assert got > 0, "host UDP socket received nothing"


def test_tap_to_rxonly(dpdk_env, tmp_path, record_measurement):
    """Frames written into the tap from the host (an AF_PACKET socket) reach DPDK
    rxonly: testpmd's RX-packets equals what gsonet put into the port's RX ring;
    every frame sent is accounted for (delivered, rx_queue_full at the port, or
    dropped by the tap's own queue); testpmd's verbose dump shows our MACs,
    EtherType and length. The destination MAC is unknown to gsonet (rxonly never
    sends), so this is the flood path."""
    tap, sock = unique_name("fe"), tmp_path / "b.sock"
    b_mac = "02:00:00:fe:0b:01"
    src_mac = "02:00:00:fe:0b:99"
    n_frames = 2000
    with Gsonet([f"socket={sock},{UNSEALED}"], [f"tap={tap}"], workdir=tmp_path,
                name="gsonet-dpdk-rx") as gs:
        _quiet_tap(tap)
        with _virtio_user("rx", sock, "rxonly", mac=b_mac) as tp:
            gs.wait_port(0, True)
            assert tp.mac_addr() == b_mac
            before, tp0 = gs.stats(), tp.port_stats()
            tap_drops0 = _tap_tx_dropped(tap)
            s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
            s.bind((tap, 0))
            hdr = bytes.fromhex(b_mac.replace(":", "") + src_mac.replace(":", "")) + b"\x88\xb5"
            # a few frames with testpmd printing them, then a burst
            tp.cmd("set verbose 1")
            for i in range(5):
                s.send(hdr + struct.pack("!I", i) + bytes(range(256))[:96])
            out = tp.wait_for(r"(?:src=.*?length=\d+.*?){5}", 0, 10).group(0)
            tp.cmd("set verbose 0")
            for i in range(n_frames):
                s.send(hdr + struct.pack("!I", i) + bytes(60))
                if i % 32 == 31:
                    time.sleep(0.001)
            s.close()

            def all_in():
                st, ts, td = gs.stats(), tp.port_stats(), _tap_tx_dropped(tap) - tap_drops0
                u = st["uplinks"][0]["stats"]["tx_frames"] - before["uplinks"][0]["stats"]["tx_frames"]
                n = st["ports"][0]["stats"]["rx_frames"] - before["ports"][0]["stats"]["rx_frames"]
                return (u + td >= n_frames + 5 and ts["rx_packets"] - tp0["rx_packets"] == n,
                        (st, ts, td))
            after, tp1, tap_drops = _settle(all_in)
    port = counters_delta(before["ports"][0]["stats"], after["ports"][0]["stats"])
    up = counters_delta(before["uplinks"][0]["stats"], after["uplinks"][0]["stats"])
    rx = tp1["rx_packets"] - tp0["rx_packets"]
    record_measurement("dpdk.tap_to_rxonly.frames", rx)
    lines = re.findall(r"src=([0-9A-F:]{17}) - dst=([0-9A-F:]{17}) - pool=\S+ - "
                       r"type=(0x[0-9a-f]+) - length=(\d+)", out)
    assert len(lines) >= 5, out
    for src, dst, typ, length in lines[:5]:
        assert (src.lower(), dst.lower(), typ, int(length)) == (src_mac, b_mac, "0x88b5",
                                                                14 + 4 + 96), lines
    full = port["drops"].get("rx_queue_full", 0)
    record_measurement("dpdk.tap_to_rxonly.rx_queue_full", full)
    record_measurement("dpdk.tap_to_rxonly.tap_tx_dropped", tap_drops)
    assert not _bad_drops(port, up), (port, up)
    # what the host wrote: read by gsonet, or lost in the tap's own queue
    assert up["tx_frames"] + tap_drops >= n_frames + 5, (up, tap_drops)
    # unknown unicast is flooded: delivered to the port or counted as dropped there
    assert up["tx_frames"] == port["rx_frames"] + full, (up, port)
    # every frame gsonet put into the RX ring arrived in DPDK
    assert rx == port["rx_frames"] > 0, (rx, port)


def test_two_frontends_switched(dpdk_env, tmp_path, record_measurement):
    """Two independent DPDK frontends on two gsonet ports: A (txonly, --eth-peer B's
    MAC) -> B (rxonly). B's MAC is pinned to its port (port mac=), so A's frames go
    to B alone, not flooded to the uplink; B counts exactly what gsonet delivered.
    The offloads virtio_user acks when testpmd asks for csum/TSO/LRO are recorded."""
    tap = unique_name("fe")
    sa, sb = tmp_path / "a.sock", tmp_path / "b.sock"
    a_mac, b_mac = "02:00:00:fe:0c:0a", "02:00:00:fe:0c:0b"
    offl = ["--rx-offloads=0x1c", "--tx-offloads=0x2c"]  # tcp/udp csum + LRO; csum + TSO
    with Gsonet([f"socket={sa},{UNSEALED}", f"socket={sb},mac={b_mac},{UNSEALED}"], [f"tap={tap}"],
                workdir=tmp_path, name="gsonet-dpdk-ab") as gs:
        _quiet_tap(tap)
        with _virtio_user("b", sb, "rxonly", mac=b_mac, args=offl) as b:
            pb = gs.wait_port(1, True)
            before, b0 = gs.stats(), b.port_stats()
            with _virtio_user("a", sa, "txonly", mac=a_mac,
                              args=[f"--eth-peer=0,{b_mac}",
                                    "--tx-ip=10.77.250.1,10.77.250.2"]) as a:
                pa = gs.wait_port(0, True)
                time.sleep(3)
                a.cmd("stop")
                a1 = a.port_stats()

                _settle_a_drained(gs, before, a1)

            after, b1 = _settle_b_caught_up(gs, b, before, b0)
    record_measurement("dpdk.acked.offloads_requested", _caps_str(pb))
    pa_d = counters_delta(before["ports"][0]["stats"], after["ports"][0]["stats"])
    pb_d = counters_delta(before["ports"][1]["stats"], after["ports"][1]["stats"])
    up = counters_delta(before["uplinks"][0]["stats"], after["uplinks"][0]["stats"])
    rx = b1["rx_packets"] - b0["rx_packets"]
    record_measurement("dpdk.a_to_b.frames", rx)
    record_measurement("dpdk.a_to_b.kpps", rx / 3 / 1000)
    # virtio_user acks what testpmd configured
    assert pb["guest_rx"]["csum"] and pb["guest_rx"]["tso4"] and pb["guest_rx"]["tso6"], pb
    assert pb["guest_tx"]["csum"] and pb["guest_tx"]["tso4"] and pb["guest_tx"]["tso6"], pb
    assert not any(pa["guest_rx"].values()) and not any(pa["guest_tx"].values()), pa
    assert pa_d["tx_frames"] > 0 and pa_d["tx_frames"] == a1["tx_packets"], (pa_d, a1)
    assert rx > 0, (b0, b1)
    assert rx == pb_d["rx_frames"], (rx, pb_d)
    assert pa_d["tx_frames"] == pb_d["rx_frames"] + pb_d["drops"].get("rx_queue_full", 0), \
        (pa_d, pb_d)
    assert up["rx_frames"] == 0, ("A's frames were flooded to the uplink", up)
    assert not _bad_drops(pa_d, pb_d, up), gs.stats_text()


def _a_to_b(tmp_path, name: str, port_opts: str, devargs: str, txpkts: str, net: str):
    """Two DPDK frontends with ``devargs`` on two gsonet ports with ``port_opts``: A
    (txonly, ``txpkts``, 3 s) -> B (rxonly). Returns the feature words both acked,
    A's and B's counter deltas at gsonet, the frames B counted and A's port stats."""
    sa, sb = tmp_path / "a.sock", tmp_path / "b.sock"
    a_mac, b_mac = "02:00:00:fe:0e:0a", "02:00:00:fe:0e:0b"
    opts = f"{UNSEALED},{port_opts}"
    with Gsonet([f"socket={sa},{opts}", f"socket={sb},mac={b_mac},{opts}"],
                workdir=tmp_path, name=f"gsonet-dpdk-{name}") as gs:
        with _virtio_user(f"{name}b", sb, "rxonly", mac=b_mac, devargs=devargs) as b:
            gs.wait_port(1, True)
            before, b0 = gs.stats(), b.port_stats()
            with _virtio_user(f"{name}a", sa, "txonly", mac=a_mac, devargs=devargs,
                              args=[f"--eth-peer=0,{b_mac}",
                                    f"--tx-ip={net}.1,{net}.2",
                                    f"--txpkts={txpkts}"]) as a:
                gs.wait_port(0, True)
                time.sleep(3)
                a.cmd("stop")
                a1 = a.port_stats()

                _settle_a_drained(gs, before, a1)
                acked = [p["acked"] for p in gs.stats()["ports"]]

            after, b1 = _settle_b_caught_up(gs, b, before, b0)
            text = gs.stats_text()
    pa_d = counters_delta(before["ports"][0]["stats"], after["ports"][0]["stats"])
    pb_d = counters_delta(before["ports"][1]["stats"], after["ports"][1]["stats"])
    rx = b1["rx_packets"] - b0["rx_packets"]
    # gsonet took every frame A sent, B counted what gsonet delivered, and every
    # frame is delivered or counted
    assert pa_d["tx_frames"] > 0 and pa_d["tx_frames"] == a1["tx_packets"], (pa_d, a1)
    assert rx > 0, (b0, b1)
    assert rx == pb_d["rx_frames"], (rx, pb_d)
    assert pa_d["tx_frames"] == pb_d["rx_frames"] + pb_d["drops"].get("rx_queue_full", 0), \
        (pa_d, pb_d)
    assert not _bad_drops(pa_d, pb_d), text
    return acked, pa_d, pb_d, rx, text


@pytest.mark.parametrize("txpkts", ["64", "2048,2048,2048,2048"])
def test_packed_rings_switched(dpdk_env, tmp_path, record_measurement, txpkts):
    """Two DPDK frontends with ``packed_vq=1`` on two ports with the default
    ``packed=auto`` (their sockets' directory is gsonet's to write, so both offer
    packed rings): both ack VIRTIO_F_RING_PACKED (bit 34), and A's frames (txonly, 3 s; 64 bytes, and 8 KB
    in four segments, which virtio_user sends through indirect tables) reach B
    (rxonly, the 8 KB ones across several mergeable buffers) through packed rings:
    B counts what gsonet delivered, gsonet took every frame A sent and delivered or
    counted each."""
    acked, _, _, rx, _ = _a_to_b(tmp_path, "packed", "", "packed_vq=1", txpkts,
                                 "10.77.251")
    assert all(a >> 34 & 1 for a in acked), [hex(a) for a in acked]
    record_measurement(f"dpdk.packed.a_to_b.kpps.{txpkts}", rx / 3 / 1000)


@pytest.mark.parametrize("ring,txpkts", [
    ("split", "64"),
    ("packed", "64"),
    pytest.param("split", "2048,2048,2048,2048", marks=pytest.mark.full),
    pytest.param("packed", "2048,2048,2048,2048", marks=pytest.mark.full),
])
def test_in_order_switched(dpdk_env, tmp_path, record_measurement, ring, txpkts):
    """Two DPDK frontends with ``in_order=1`` (split rings, and packed rings with
    ``packed_vq=1``) on two ``in_order=on`` ports: both ack VIRTIO_F_IN_ORDER (bit
    35), which puts virtio_user on its in-order paths (split: TX reclaimed by the
    used index alone, RX read entry by entry in ring order; packed: TX reclaimed
    from the id of one used descriptor per batch, which is how gsonet hands a
    batch back), and A's frames (txonly, 3 s) reach B (rxonly) with every frame
    delivered or counted. ``gsonet stats`` says so beside the rings."""
    packed = ring == "packed"
    opts = "in_order=on" + (",packed=on" if packed else "")
    devargs = "in_order=1" + (",packed_vq=1" if packed else "")
    net = "10.77.253" if packed else "10.77.254"
    acked, _, _, rx, text = _a_to_b(tmp_path, f"io{ring}", opts, devargs, txpkts, net)
    assert all(a >> 35 & 1 for a in acked), [hex(a) for a in acked]
    assert all(bool(a >> 34 & 1) == packed for a in acked), [hex(a) for a in acked]
    assert f"({ring} rings, in order)" in text, text
    record_measurement(f"dpdk.in_order.{ring}.a_to_b.kpps.{txpkts}", rx / 3 / 1000)


def test_tso_frame_to_dpdk(dpdk_env, tmp_path, record_measurement):
    """With GUEST_TSO4 acked by virtio_user, a 64 KiB TCP frame from the tap (a
    PACKET_VNET_HDR socket hands the kernel a GSO frame) reaches DPDK as one
    frame: gsonet passes it intact (gso_passed), testpmd counts one packet of the
    whole length and its verbose dump shows the mbuf flagged RTE_MBUF_F_RX_LRO."""
    tap, sock = unique_name("fe"), tmp_path / "c.sock"
    b_mac, src_mac = "02:00:00:fe:0d:01", "02:00:00:fe:0d:99"
    payload = 60000
    with Gsonet([f"socket={sock},{UNSEALED}"], [f"tap={tap}"], workdir=tmp_path,
                name="gsonet-dpdk-tso") as gs:
        _quiet_tap(tap)
        with _virtio_user("tso", sock, "rxonly", mac=b_mac,
                          args=["--rx-offloads=0x1c", "--tx-offloads=0x2c"]) as tp:
            p = gs.wait_port(0, True)
            assert p["guest_rx"]["tso4"], p
            before, tp0 = gs.stats(), tp.port_stats()
            tp.cmd("set verbose 1")
            mark = len(tp.output())
            frame = _tcp4_frame(src_mac, b_mac, payload)
            s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
            s.setsockopt(SOL_PACKET, PACKET_VNET_HDR, 1)
            s.bind((tap, 0))
            # virtio_net_hdr: NEEDS_CSUM, GSO_TCPV4, hdr_len, gso_size 1448,
            # csum_start 34, csum_offset 16 (little endian, as the kernel expects)
            vh = struct.pack("<BBHHHH", 1, 1, 54, 1448, 34, 16)
            s.send(vh + frame)
            s.close()
            dump = tp.wait_for(r"src=02:00:00:FE:0D:99.*?ol_flags: [^\n]*", mark, 10).group(0)
            time.sleep(0.3)
            after, tp1 = gs.stats(), tp.port_stats()
    port = counters_delta(before["ports"][0]["stats"], after["ports"][0]["stats"])
    up = counters_delta(before["uplinks"][0]["stats"], after["uplinks"][0]["stats"])
    rx = tp1["rx_packets"] - tp0["rx_packets"]
    rx_bytes = tp1["rx_bytes"] - tp0["rx_bytes"]
    assert up["tx_frames"] >= 1 and up["tx_max_frame"] == len(frame), up
    assert port["gso_passed"] == 1 and port["gso_segmented"] == 0, port
    assert rx == port["rx_frames"] >= 1, (rx, port)
    assert rx_bytes >= len(frame), (tp0, tp1)
    # DPDK parsed the vnet header: one mbuf chain of the whole length, flagged LRO
    assert f"length={len(frame)} " in dump and "RTE_MBUF_F_RX_LRO" in dump, dump
    record_measurement("dpdk.tso_frame_bytes", len(frame))


def _tcp4_frame(src_mac: str, dst_mac: str, payload: int) -> bytes:
    from scapy.all import IP, TCP, Ether, raw
    pkt = (Ether(src=src_mac, dst=dst_mac) / IP(src="10.77.251.1", dst="10.77.251.2")
           / TCP(sport=40000, dport=5001, flags="A", seq=1) / (b"x" * payload))
    data = bytearray(raw(pkt))
    # partial checksum (pseudo header only), as a sender using NEEDS_CSUM leaves it
    data[50:52] = b"\0\0"
    return bytes(data)


def test_frontend_kill_and_reattach(dpdk_env, tmp_path, record_measurement):
    """SIGKILL testpmd mid-transmit (no vhost-user teardown): gsonet keeps running,
    marks the port disconnected, and a second testpmd attaches to the same socket,
    negotiates and moves frames."""
    tap, sock = unique_name("fe"), tmp_path / "d.sock"
    with Gsonet([f"socket={sock},{UNSEALED}"], [f"tap={tap}"], workdir=tmp_path,
                name="gsonet-dpdk-kill") as gs:
        _quiet_tap(tap)
        args = ["--eth-peer=0,02:00:00:fe:0e:ff", "--tx-ip=10.77.252.1,10.77.252.2"]
        first = _virtio_user("kill1", sock, "txonly", mac="02:00:00:fe:0e:01", args=args).start()
        try:
            gs.wait_port(0, True)
            time.sleep(1)
            n1 = gs.port_stats(0)["stats"]["tx_frames"]
            assert n1 > 0
        finally:
            first.kill(signal.SIGKILL)
        t0 = time.monotonic()
        gs.wait_port(0, False)
        record_measurement("dpdk.kill.disconnect_seconds", time.monotonic() - t0)
        assert gs.alive(), gs.log()[-2000:]
        with _virtio_user("kill2", sock, "txonly", mac="02:00:00:fe:0e:02", args=args):
            p = gs.wait_port(0, True)
            time.sleep(1)
            n2 = gs.port_stats(0)["stats"]["tx_frames"]
        time.sleep(0.3)
        assert gs.alive(), gs.log()[-2000:]
        final = gs.stats()
    assert p["guest_rx"] is not None, p
    assert n2 > n1, (n1, n2)
    port, up = final["ports"][0]["stats"], final["uplinks"][0]["stats"]
    # everything both frontends handed over reached the tap
    assert up["rx_frames"] == port["tx_frames"], (port, up)
    assert not _bad_drops(port, up), (port, up)


@pytest.mark.parametrize("ring", ["split", "packed"])
def test_gsonet_restart_under_server_mode_virtio_user(dpdk_env, tmp_path, record_measurement,
                                                      ring):
    """gsonet SIGKILLed and started again, twice, under two DPDK frontends in server
    mode (virtio_user ``server=1`` makes the sockets, gsonet's ports are ``client``
    ports and connect again), with ``packed_vq=1`` for packed rings on gsonet's default
    ports: both frontends come back, and A's frames (txonly, sending throughout) reach
    B (rxonly) after each restart. On a split ring virtio_user sends base 0, and
    gsonet starts the ring at its used index in guest memory (the log says so). Packed
    rings virtio_user resets, and sends base 0x8000, the base QEMU resends after a
    crash of gsonet; it sets FEATURES_OK before the rings (VHOST_USER_PROTOCOL_F_STATUS),
    so gsonet starts them at that base and not where SOCKET.rings has them."""
    packed = ring == "packed"
    sa, sb = tmp_path / "a.sock", tmp_path / "b.sock"
    a_mac, b_mac = "02:00:00:fe:0f:0a", "02:00:00:fe:0f:0b"
    net = "10.77.249" if packed else "10.77.248"
    devargs = "server=1" + (",packed_vq=1" if packed else "")
    ports = [f"socket={sa},client,{UNSEALED}", f"socket={sb},client,mac={b_mac},{UNSEALED}"]

    def serve(k: int) -> Gsonet:
        return Gsonet(ports, workdir=tmp_path, name=f"gsonet-dpdk-restart-{ring}-{k}").start()

    gs = serve(0)
    try:
        with _virtio_user(f"rs{ring}b", sb, "rxonly", mac=b_mac, devargs=devargs) as b, \
                _virtio_user(f"rs{ring}a", sa, "txonly", mac=a_mac, devargs=devargs,
                             args=[f"--eth-peer=0,{b_mac}", f"--tx-ip={net}.1,{net}.2"]):
            for k in range(3):
                if k:
                    gs.proc.kill()
                    gs.proc.wait()
                    gs.stop()
                    # The killed gsonet's control socket: the next one binds its own.
                    (tmp_path / "control.sock").unlink(missing_ok=True)
                    t0 = time.monotonic()
                    gs = serve(k)
                gs.wait_port(0, True, timeout=60)
                gs.wait_port(1, True, timeout=60)
                if k:
                    record_measurement(f"dpdk.restart.{ring}.reconnect_seconds.{k}",
                                       time.monotonic() - t0)
                acked = [p["acked"] for p in gs.stats()["ports"]]
                assert all(bool(a >> 34 & 1) == packed for a in acked), \
                    (k, [hex(a) for a in acked])
                r0 = b.port_stats()["rx_packets"]
                time.sleep(2)
                r1 = b.port_stats()["rx_packets"]
                record_measurement(f"dpdk.restart.{ring}.b_rx_2s.{k}", r1 - r0)
                assert r1 > r0, (k, r0, r1, [(p["stats"]["tx_frames"], p["stats"]["rx_frames"], p["stats"]["drops"]) for p in gs.stats()["ports"]])
            log = gs.log()
    finally:
        gs.stop()
    if packed:
        assert "packed ring resumed where this port's record has it" not in log
    else:
        assert "split ring started at the used index in guest memory" in log

"""gsonet against a vhost-user frontend it did not write: DPDK's virtio_user.

``dpdk-testpmd --vdev net_virtio_user0,path=SOCK,queues=1`` drives a virtio-net
device over vhost-user from user space: a second, independent implementation of
the frontend side besides QEMU. No guest boots here; each test runs testpmd for
a few seconds (it busy-polls one core), reads its port statistics on its
interactive prompt, and compares them with ``gsonet stats --json``.

- txonly -> tap: DPDK's 64-byte UDP frames reach the tap, parse with scapy and
  are accepted by the host's UDP stack.
- tap -> rxonly: frames injected into the tap reach DPDK, byte for byte.
- two DPDK frontends on two ports: gsonet switches A's frames to B only.
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
import subprocess
import threading
import time
from pathlib import Path

import pytest

import guest as G

TESTPMD = os.environ.get("GSONET_TESTPMD", "dpdk-testpmd")
PROMPT = "testpmd> "
ETH_P_ALL = 0x0003
PACKET_OUTGOING = 4
SOL_PACKET = 263
PACKET_VNET_HDR = 15

_seq = 0


def _uniq(tag: str) -> str:
    global _seq
    _seq += 1
    return f"gsn{tag}{os.getpid() % 100000}x{_seq}"


class PmdError(Exception):
    pass


class TestPmd:
    """One ``dpdk-testpmd`` with a single net_virtio_user port on a gsonet socket,
    in interactive mode (its stdin stays open; ``quit`` ends it).

        with TestPmd("a", sock, "txonly", mac="02:00:00:00:0a:01") as tp:
            tp.port_stats()   # {"rx_packets": .., "tx_packets": .., ...}
    """

    __test__ = False  # not a pytest class

    def __init__(self, name: str, sock: str | os.PathLike, fwd: str, *,
                 mac: str | None = None, args: list[str] | None = None,
                 vdev_args: str = "", log_dir: Path | str | None = None):
        self.name = name
        self.sock = os.fspath(sock)
        self.fwd = fwd
        self.mac = mac
        self.args = list(args or [])
        self.vdev_args = vdev_args
        self.prefix = _uniq("tp" + name)
        self.log_dir = Path(log_dir or G.LOG_DIR)
        self.proc: subprocess.Popen | None = None
        self._buf = ""
        self._cond = threading.Condition()
        self._log = None
        self.log_path: Path | None = None

    def cmdline(self) -> list[str]:
        vdev = f"net_virtio_user0,path={self.sock},queues=1"
        if self.mac:
            vdev += f",mac={self.mac}"
        if self.vdev_args:
            vdev += "," + self.vdev_args
        return ["stdbuf", "-oL", TESTPMD, "--no-huge", "-m", "1024", "--no-pci",
                "-l", "0-1", "--file-prefix", self.prefix, "--log-level", "*:notice",
                "--vdev", vdev, "--", "-i", f"--forward-mode={self.fwd}",
                "--auto-start"] + self.args

    def start(self, timeout: float = 30.0) -> "TestPmd":
        self.log_dir.mkdir(parents=True, exist_ok=True)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        self.log_path = self.log_dir / f"{stamp}-testpmd-{self.name}-{os.getpid()}.log"
        self._log = open(self.log_path, "w", encoding="utf-8", errors="replace")
        cmd = self.cmdline()
        self._log.write(" ".join(cmd) + "\n")
        self._log.flush()
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, bufsize=0,
                                     start_new_session=True)
        threading.Thread(target=self._read, daemon=True).start()
        try:
            self.wait_for(re.escape(PROMPT), 0, timeout)
            with self._cond:
                out = self._buf
            for bad in ("Fail to configure port", "Start ports failed", "Failed to",
                        "EAL: Error", "Cannot"):
                if bad in out:
                    raise PmdError(f"testpmd {self.name}: {bad!r}:\n{out[-3000:]}")
        except Exception:
            self.kill()
            raise
        return self

    def _read(self) -> None:
        assert self.proc and self.proc.stdout
        G.pump_output(self.proc.stdout.fileno(), self)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def output(self) -> str:
        with self._cond:
            return self._buf

    def wait_for(self, pattern: str, start: int, timeout: float) -> re.Match:
        rx = re.compile(pattern, re.S)
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                m = rx.search(self._buf, start)
                if m:
                    return m
                if not self.alive():
                    self._cond.wait(0.2)
                    m = rx.search(self._buf, start)
                    if m:
                        return m
                    raise PmdError(f"testpmd {self.name} exited rc={self.proc.returncode}:"
                                       f"\n{self._buf[-3000:]}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise PmdError(f"testpmd {self.name}: no {pattern!r} after {timeout}s:"
                                       f"\n{self._buf[-3000:]}")
                self._cond.wait(min(left, 0.5))

    def cmd(self, line: str, timeout: float = 15.0) -> str:
        """Run one prompt command; returns its output (up to the next prompt)."""
        with self._cond:
            start = len(self._buf)
        assert self.proc and self.proc.stdin
        self.proc.stdin.write(line.encode() + b"\n")
        self.proc.stdin.flush()
        m = self.wait_for(re.escape(PROMPT), start + 1, timeout)
        with self._cond:
            return self._buf[start:m.start()]

    def port_stats(self) -> dict:
        out = self.cmd("show port stats 0")
        m = re.search(r"RX-packets:\s*(\d+)\s+RX-missed:\s*(\d+)\s+RX-bytes:\s*(\d+).*?"
                      r"TX-packets:\s*(\d+)\s+TX-errors:\s*(\d+)\s+TX-bytes:\s*(\d+)", out, re.S)
        if not m:
            raise PmdError(f"testpmd {self.name}: cannot parse port stats:\n{out}")
        keys = ("rx_packets", "rx_missed", "rx_bytes", "tx_packets", "tx_errors", "tx_bytes")
        return dict(zip(keys, map(int, m.groups())))

    def mac_addr(self) -> str:
        out = self.cmd("show port info 0")
        m = re.search(r"MAC address:\s*([0-9A-Fa-f:]{17})", out)
        if not m:
            raise PmdError(f"testpmd {self.name}: no MAC in port info:\n{out}")
        return m.group(1).lower()

    def stop(self, timeout: float = 15.0) -> None:
        """``stop`` + ``quit``; forcibly ends testpmd if it does not leave in time."""
        if self.alive():
            try:
                self.cmd("stop", timeout=timeout)
                assert self.proc and self.proc.stdin
                self.proc.stdin.write(b"quit\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=timeout)
            except (PmdError, OSError, subprocess.TimeoutExpired):
                pass
        self.kill()

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Ends testpmd at once (no vhost-user teardown), cleans its runtime dir."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        if self._log:
            self._log.close()
            self._log = None
        shutil.rmtree(f"/var/run/dpdk/{self.prefix}", ignore_errors=True)

    def __enter__(self) -> "TestPmd":
        if self.proc is None:
            self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


# ---- helpers ---------------------------------------------------------------------


def _skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "DPDK frontend tests need root (taps, vhost-user sockets)"
    if not G.tun_available():
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
    return G


def _quiet_tap(tap: str) -> None:
    """No IPv6 on the tap: no router solicitations or MLD reports mixed into the
    counts."""
    Path(f"/proc/sys/net/ipv6/conf/{tap}/disable_ipv6").write_text("1\n")


def _wait_port(gs: G.Gsonet, i: int, want: bool, timeout: float = 20) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        p = gs.port_stats(i)
        # connected and negotiated (DPDK renegotiates when its port is configured)
        if p["connected"] == want and (not want or p["guest_rx"] is not None):
            return p
        if time.monotonic() > deadline:
            raise AssertionError(f"port {i} connected={p['connected']}, wanted {want}:\n"
                                 f"{gs.stats_text()}\n{gs.log()[-2000:]}")
        time.sleep(0.1)


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


def _tap_tx_dropped(tap: str) -> int:
    """Frames the kernel dropped because the tap's queue was full (gsonet not reading)."""
    return int(Path(f"/sys/class/net/{tap}/statistics/tx_dropped").read_text())


def _net():
    n = G.alloc_subnet()
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
    tap, sock = _uniq("fe"), tmp_path / "a.sock"
    dport = 40000 + os.getpid() % 20000
    a_mac = "02:00:00:fe:0a:01"
    with G.Gsonet([f"socket={sock}"], [f"tap={tap}"], workdir=tmp_path,
                  name="gsonet-dpdk-tx") as gs:
        try:
            _quiet_tap(tap)
            G.set_addr(tap, f"{host_ip}/24")
            tap_mac = Path(f"/sys/class/net/{tap}/address").read_text().strip()
            udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            udp.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
            udp.bind((host_ip, dport))
            udp.setblocking(False)
            cap = Capture(tap, a_mac)
            before = gs.stats()
            tp = TestPmd("tx", sock, "txonly", mac=a_mac,
                         args=[f"--eth-peer=0,{tap_mac}", f"--tx-ip={peer_ip},{host_ip}",
                               f"--tx-udp=9,{dport}"])
            with tp:
                p = _wait_port(gs, 0, True)
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
    port = G.counters_delta(before["ports"][0]["stats"], after["ports"][0]["stats"])
    up = G.counters_delta(before["uplinks"][0]["stats"], after["uplinks"][0]["stats"])
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
    tap, sock = _uniq("fe"), tmp_path / "b.sock"
    b_mac = "02:00:00:fe:0b:01"
    src_mac = "02:00:00:fe:0b:99"
    n_frames = 2000
    with G.Gsonet([f"socket={sock}"], [f"tap={tap}"], workdir=tmp_path,
                  name="gsonet-dpdk-rx") as gs:
        _quiet_tap(tap)
        with TestPmd("rx", sock, "rxonly", mac=b_mac) as tp:
            _wait_port(gs, 0, True)
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
    port = G.counters_delta(before["ports"][0]["stats"], after["ports"][0]["stats"])
    up = G.counters_delta(before["uplinks"][0]["stats"], after["uplinks"][0]["stats"])
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
    tap = _uniq("fe")
    sa, sb = tmp_path / "a.sock", tmp_path / "b.sock"
    a_mac, b_mac = "02:00:00:fe:0c:0a", "02:00:00:fe:0c:0b"
    offl = ["--rx-offloads=0x1c", "--tx-offloads=0x2c"]  # tcp/udp csum + LRO; csum + TSO
    with G.Gsonet([f"socket={sa}", f"socket={sb},mac={b_mac}"], [f"tap={tap}"],
                  workdir=tmp_path, name="gsonet-dpdk-ab") as gs:
        _quiet_tap(tap)
        with TestPmd("b", sb, "rxonly", mac=b_mac, args=offl) as b:
            pb = _wait_port(gs, 1, True)
            before, b0 = gs.stats(), b.port_stats()
            with TestPmd("a", sa, "txonly", mac=a_mac,
                         args=[f"--eth-peer=0,{b_mac}", "--tx-ip=10.77.250.1,10.77.250.2"]) as a:
                pa = _wait_port(gs, 0, True)
                time.sleep(3)
                a.cmd("stop")
                a1 = a.port_stats()

                def a_drained():
                    st = gs.stats()
                    n = st["ports"][0]["stats"]["tx_frames"] - before["ports"][0]["stats"]["tx_frames"]
                    return n == a1["tx_packets"], st
                _settle(a_drained)

            def b_caught_up():
                st, bs = gs.stats(), b.port_stats()
                n = st["ports"][1]["stats"]["rx_frames"] - before["ports"][1]["stats"]["rx_frames"]
                return bs["rx_packets"] - b0["rx_packets"] == n, (st, bs)
            after, b1 = _settle(b_caught_up)
    record_measurement("dpdk.acked.offloads_requested", _caps_str(pb))
    pa_d = G.counters_delta(before["ports"][0]["stats"], after["ports"][0]["stats"])
    pb_d = G.counters_delta(before["ports"][1]["stats"], after["ports"][1]["stats"])
    up = G.counters_delta(before["uplinks"][0]["stats"], after["uplinks"][0]["stats"])
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


def test_tso_frame_to_dpdk(dpdk_env, tmp_path, record_measurement):
    """With GUEST_TSO4 acked by virtio_user, a 64 KiB TCP frame from the tap (a
    PACKET_VNET_HDR socket hands the kernel a GSO frame) reaches DPDK as one
    frame: gsonet passes it intact (gso_passed), testpmd counts one packet of the
    whole length and its verbose dump shows the mbuf flagged RTE_MBUF_F_RX_LRO."""
    tap, sock = _uniq("fe"), tmp_path / "c.sock"
    b_mac, src_mac = "02:00:00:fe:0d:01", "02:00:00:fe:0d:99"
    payload = 60000
    with G.Gsonet([f"socket={sock}"], [f"tap={tap}"], workdir=tmp_path,
                  name="gsonet-dpdk-tso") as gs:
        _quiet_tap(tap)
        with TestPmd("tso", sock, "rxonly", mac=b_mac,
                     args=["--rx-offloads=0x1c", "--tx-offloads=0x2c"]) as tp:
            p = _wait_port(gs, 0, True)
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
    port = G.counters_delta(before["ports"][0]["stats"], after["ports"][0]["stats"])
    up = G.counters_delta(before["uplinks"][0]["stats"], after["uplinks"][0]["stats"])
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
    tap, sock = _uniq("fe"), tmp_path / "d.sock"
    with G.Gsonet([f"socket={sock}"], [f"tap={tap}"], workdir=tmp_path,
                  name="gsonet-dpdk-kill") as gs:
        _quiet_tap(tap)
        args = ["--eth-peer=0,02:00:00:fe:0e:ff", "--tx-ip=10.77.252.1,10.77.252.2"]
        first = TestPmd("kill1", sock, "txonly", mac="02:00:00:fe:0e:01", args=args).start()
        try:
            _wait_port(gs, 0, True)
            time.sleep(1)
            n1 = gs.port_stats(0)["stats"]["tx_frames"]
            assert n1 > 0
        finally:
            first.kill(signal.SIGKILL)
        t0 = time.monotonic()
        _wait_port(gs, 0, False)
        record_measurement("dpdk.kill.disconnect_seconds", time.monotonic() - t0)
        assert gs.alive(), gs.log()[-2000:]
        with TestPmd("kill2", sock, "txonly", mac="02:00:00:fe:0e:02", args=args):
            p = _wait_port(gs, 0, True)
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

"""Live migration of a guest between two ports of one gsonet, with real QEMU.

gsonet serves port A and port B and a tap uplink. A guest boots on port A; a second
QEMU with the same command line, its netdev on port B and ``-incoming defer``, waits
for it. While the guest sends with iperf3 (the host's client with -R) and fetches a
random file from the host with nc, QMP ``migrate`` moves it over a Unix socket: QEMU
sets gsonet's dirty log (LOG_SHMFD, LOG_ALL) and reads it until the last pass, so the
RX frames gsonet writes into guest memory during the migration must all be in it.

What must hold: the migration completes; the iperf3 stream survives it (the client
finishes without error and data flows after the switch-over); the file fetched
during the migration has the host's md5; port B learned the guest's MAC as a move.
Printed as result lines: QMP's downtime, and the time from the destination's RESUME
event to the first frame from the guest at the tap (through port B: the source is
stopped by then), and to its first ARP there (the announce).

The default device announces itself (GUEST_ANNOUNCE: the guest sends a gratuitous
ARP). ``guest_announce=off`` (full set) makes QEMU ask gsonet instead (SEND_RARP):
gsonet sends the RARP from port B.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import struct
import subprocess
import threading
import time
from pathlib import Path

import pytest

from harness.gsonet import Gsonet
from harness.hostnet import alloc_subnet, delete_link, set_addr
from harness.iperf import iperf3_guest_server
from harness.migration import MigGuest, Qmp, migrate, wait_resumed
from harness.qemu import mac_for, vhost_user_netdev
from harness.transfer import MIB, OneShotServer

ETH_P_ALL = 0x0003
SO_TIMESTAMPNS = 35


class Capture:
    """Frames from one source MAC on a host interface, kernel-timestamped. Kept: every
    ARP/RARP, and every frame that follows a silence of 20 ms or more (the first frame
    after a migration's downtime is one), not the bulk of a stream."""

    GAP = 0.02

    def __init__(self, ifname: str, mac: str):
        self.src = bytes.fromhex(mac.replace(":", ""))
        self.sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
        self.sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
        self.sock.bind((ifname, 0))
        self.sock.settimeout(0.2)
        self.seen: list[tuple[float, int]] = []  # (time, ethertype)
        self.last = 0.0
        self.running = True
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while self.running and len(self.seen) < 100000:
            try:
                data, anc, _, addr = self.sock.recvmsg(64, 64)
            except socket.timeout:
                continue
            except OSError:
                return
            # frames the host sends out of the tap are not the guest's
            if addr[2] == socket.PACKET_OUTGOING or data[6:12] != self.src:
                continue
            at = time.time()
            for level, kind, value in anc:
                if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS:
                    sec, nsec = struct.unpack("qq", value[:16])
                    at = sec + nsec / 1e9
            et = struct.unpack("!H", data[12:14])[0]
            if et in (0x0806, 0x8035) or at - self.last >= self.GAP:
                self.seen.append((at, et))
            self.last = at

    def first_after(self, t: float, ethertypes: tuple[int, ...] = ()) -> float | None:
        for at, et in self.seen:
            if at >= t and (not ethertypes or et in ethertypes):
                return at
        return None

    def close(self) -> None:
        self.running = False
        self.thread.join(2)
        self.sock.close()


def _migrate(tmp: Path, record_measurement, device_props: dict | None, tag: str,
             port_opts: str = "") -> dict:
    n = alloc_subnet()
    host_ip, guest_ip = f"10.77.{n}.1", f"10.77.{n}.2"
    tap = f"gsnm{os.getpid() % 10000}{tag[:1]}"
    sock_a, sock_b = str(tmp / "a.sock"), str(tmp / "b.sock")
    mig = str(tmp / "migrate.sock")
    gs = Gsonet([f"socket={sock_a}{port_opts}", f"socket={sock_b}{port_opts}"], [f"tap={tap}"],
                workdir=tmp,
                name=f"gsonet-migrate-{tag}")
    name = f"migrate-{tag}"
    mac = mac_for(name)
    src = MigGuest(name, vhost_user_netdev(sock_a), str(tmp / "src.qmp"),
                   device_props=device_props, ip=f"{guest_ip}/24")
    dst = MigGuest(name, vhost_user_netdev(sock_b), str(tmp / "dst.qmp"),
                   extra=["-incoming", "defer"], device_props=device_props, ip=f"{guest_ip}/24")
    dst.name = f"{name}-dst"  # its logs; the machine (and so the guest) is the same
    iperf = capture = None
    qs = qd = None
    out: dict = {}
    try:
        gs.start()
        set_addr(tap, f"{host_ip}/24")
        src.start()
        src.wait_booted()
        gs.wait_port(0)
        # The host and the guest know each other's address before iperf3 connects: a
        # host that asks for the guest's while the guest's link is coming up gives up
        # after three tries ("No route to host").
        src.run_ok(f"ping -c 3 -W 5 {host_ip}", timeout=60)
        dst.start()
        qs, qd = Qmp(src.qmp_path), Qmp(dst.qmp_path)
        qd.cmd("migrate-incoming", uri=f"unix:{mig}")
        for q in (qs, qd):
            q.cmd("migrate-set-parameters", **{"max-bandwidth": 4 << 30, "downtime-limit": 500})

        # Traffic across the migration: iperf3 guest->host, a file host->guest.
        iperf3_guest_server(src)
        iperf_start = time.time()
        iperf = subprocess.Popen(["iperf3", "-c", guest_ip, "-R", "-t", "45", "-i", "1", "-J"],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        # 16 MiB over about 20 s: written in the guest before, during and after.
        payload = os.urandom(16 * MIB)
        srv = OneShotServer(host_ip, payload, gap=0.08)
        # In a subshell, not as a job of the console's shell (Guest.run).
        src.run_ok(f"rm -f /tmp/mig.bin /tmp/mig.done; (setsid sh -c 'nc {host_ip} {srv.port} "
                   f"</dev/null > /tmp/mig.bin; touch /tmp/mig.done' >/dev/null 2>&1 &)")
        time.sleep(3)
        capture = Capture(tap, mac)
        before = gs.stats()
        info = migrate(qs, f"unix:{mig}", (src, dst))
        out["downtime_ms"] = info["downtime"]
        out["total_ms"] = info["total-time"]
        resumed = wait_resumed(qd)
        # The source stays (paused) until the guest was heard on port B, as a management
        # layer keeps it until the destination runs: its FDB entries then still point at
        # port A, and the guest's first frame through B is a move.
        deadline = time.monotonic() + 30
        while gs.stats()["ports"][1]["stats"]["tx_frames"] == 0:
            assert time.monotonic() < deadline, "nothing from the guest on port B"
            time.sleep(0.02)
        # The console now belongs to the destination.
        qs.cmd("quit")
        src.shutdown()
        gs.wait_port(1)

        rc, _ = dst.run("i=0; while [ ! -e /tmp/mig.done ] && [ $i -lt 1200 ]; do "
                        "usleep 100000; i=$((i+1)); done; [ -e /tmp/mig.done ]", timeout=180)
        assert rc == 0, "the fetch did not finish after the migration"
        srv.join(timeout=30)
        gmd5 = dst.run_ok("md5sum /tmp/mig.bin", timeout=120).split()[0]
        assert gmd5 == hashlib.md5(payload).hexdigest(), "file fetched across the migration differs"

        iout, ierr = iperf.communicate(timeout=120)
        result = json.loads(iout)
        assert "error" not in result, result.get("error")
        after_resume = [i["sum"]["bytes"] for i in result["intervals"]
                        if iperf_start + i["sum"]["start"] > resumed + 1]
        assert sum(after_resume) > 0, f"no iperf3 data after the migration: {result['intervals']}"
        out["iperf_gbps"] = result["end"]["sum_received"]["bits_per_second"] / 1e9

        after = gs.stats()
        first = capture.first_after(resumed)
        arp = capture.first_after(resumed, (0x0806, 0x8035))
        if first is not None:
            out["resume_to_first_frame_ms"] = (first - resumed) * 1000
        if arp is not None:
            out["resume_to_announce_ms"] = (arp - resumed) * 1000
        for k, v in out.items():
            record_measurement(f"migration.{tag}.{k}", v)
            print(f"result migration.{tag}.{k} = {v:.1f}" if isinstance(v, float)
                  else f"result migration.{tag}.{k} = {v}")
        out["gsonet_log"] = gs.log()
        # Port B's device as the destination's guest acked it (port A's frontend is gone).
        out["acked_b"] = after["ports"][1].get("acked", 0)
        b = after["ports"][1]["stats"]
        assert first is not None, "no frame from the guest at the tap after the migration"
        assert b["mac_moves"] >= 1, gs.stats_text()
        assert b["tx_frames"] > 0 and b["rx_frames"] > 0, gs.stats_text()
        assert after["ports"][0]["stats"]["tx_frames"] >= before["ports"][0]["stats"]["tx_frames"]
        return out
    finally:
        if capture:
            capture.close()
        if iperf and iperf.poll() is None:
            iperf.kill()
        for q in (qs, qd):
            if q:
                q.close()
        for g in (src, dst):
            g.shutdown()
        gs.stop()
        delete_link(tap)


@pytest.mark.slow
def test_migration_with_iperf_and_md5(guest_env, tmp_path, record_measurement):
    out = _migrate(tmp_path, record_measurement, None, "announce")
    # The guest announced itself (gratuitous ARP), so QEMU did not ask for a RARP.
    assert "resume_to_announce_ms" in out, "no gratuitous ARP after the migration"


@pytest.mark.slow
@pytest.mark.full
def test_migration_with_send_rarp(guest_env, tmp_path, record_measurement):
    """A device without GUEST_ANNOUNCE: QEMU sends SEND_RARP, gsonet announces."""
    out = _migrate(tmp_path, record_measurement, {"guest_announce": False}, "rarp")
    assert "announcing the guest (SEND_RARP)" in out["gsonet_log"], out["gsonet_log"][-2000:]


RING_PACKED = 34


@pytest.mark.slow
def test_migration_of_a_packed_guest(guest_env, tmp_path, record_measurement):
    """The same with packed rings on both sides (QEMU packed=on, ports packed=on): the
    source's GET_VRING_BASE gives QEMU both positions with their wrap counters, the
    destination starts there, and the dirty log holds gsonet's writes into the
    packed rings (used descriptors, event structures) and RX buffers."""
    out = _migrate(tmp_path, record_measurement, {"packed": True}, "packed",
                   port_opts=",packed=on")
    assert out["acked_b"] >> RING_PACKED & 1, hex(out["acked_b"])

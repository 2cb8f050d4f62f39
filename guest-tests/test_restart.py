"""gsonet restarted under running guests: killed (SIGKILL) or stopped (SIGTERM) and
started again while a guest moves data through it, with QEMU reconnecting
(`reconnect-ms`) or gsonet reconnecting to QEMU (client mode).

What each test shows: the guest is not rebooted (same QEMU, a marker in its tmpfs
survives); a 256 MiB host->guest stream piped into md5sum in the guest (or an iperf3
run) started before the restart finishes after it with the host's md5; the tap
uplink is the same device afterwards (MAC, address, route kept); after SIGTERM the
sockets are gone and the exit status is 0. The outage, the longest time without a
reply to a host ping flood (`ping -D -i 0.01`) around each restart, is printed and
recorded as `restart.<mode>.outage_ms` (median of the restarts in the test); the
status=off guest's median is held to the 1 s target (it was ~25 s while a new tap MAC
stalled the guest's ARP, then ~1.03 s while the host's own ARP entry for the guest went
with the carrier).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import threading
import time
from pathlib import Path

import pytest

from harness.gsonet import Gsonet
from harness.guest import Guest
from harness.hostnet import alloc_subnet, delete_link, set_addr
from harness.process import HarnessError
from harness.qemu import vhost_user_netdev

RECONNECT_MS = 100
MIB = 1 << 20
STREAM_MIB = 256


def reconnecting_netdev(sock: str) -> list[str]:
    """QEMU as the socket client, reconnecting every RECONNECT_MS when gsonet is gone."""
    return ["-chardev", f"socket,id=c0,path={sock},reconnect-ms={RECONNECT_MS}",
            "-netdev", "vhost-user,id=n0,chardev=c0"]


def derived_mac(name: str) -> str:
    """The MAC gsonet gives a tap it creates without mac=: FNV-1a of the name, bytes
    2..7, locally administered unicast (computed here independently)."""
    h = 0xcbf29ce484222325
    for b in name.encode():
        h = ((h ^ b) * 0x100000001b3) & 0xFFFFFFFFFFFFFFFF
    b = h.to_bytes(8, "big")
    return ":".join(f"{x:02x}" for x in [(b[2] & 0xfc) | 0x02, *b[3:8]])


def tap_state(tap: str) -> dict:
    """MAC, IPv4 addresses and routes of the tap, as `ip -j` reports them."""
    link = json.loads(subprocess.run(["ip", "-j", "addr", "show", "dev", tap],
                                     capture_output=True, text=True, check=True).stdout)[0]
    routes = json.loads(subprocess.run(["ip", "-j", "route", "show", "dev", tap],
                                       capture_output=True, text=True, check=True).stdout)
    return {
        "mac": link["address"],
        "addrs": sorted(a["local"] for a in link.get("addr_info", []) if a["family"] == "inet"),
        "routes": sorted(r["dst"] for r in routes),
    }


class PingFlood:
    """`ping -D -i 0.01` from the host to the guest; outage_ms(t0, t1) is the longest
    gap between two consecutive replies received between t0 and t1 (wall clock)."""

    def __init__(self, ip: str, log: Path):
        self.log = log
        self.out = open(log, "w")
        self.proc = subprocess.Popen(["ping", "-D", "-n", "-i", "0.01", "-W", "1", ip],
                                     stdout=self.out, stderr=subprocess.STDOUT)

    def replies(self) -> list[float]:
        text = self.log.read_text(errors="replace")
        return [float(m.group(1)) for m in re.finditer(r"^\[(\d+\.\d+)\] \d+ bytes from", text, re.M)]

    def wait_reply_after(self, t: float, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not any(r > t for r in self.replies()):
            if time.monotonic() > deadline:
                raise AssertionError(f"no ping reply {timeout}s after the restart")
            time.sleep(0.05)

    def outage_ms(self, t0: float, t1: float) -> float:
        r = [x for x in self.replies() if t0 <= x <= t1]
        assert len(r) >= 2, "no replies around the restart"
        return max(b - a for a, b in zip(r, r[1:])) * 1000

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)
        self.out.close()


class StreamToGuest:
    """STREAM_MIB of random bytes from a host socket, received in the guest by
    `nc | md5sum` in the background (nothing stored). ``sent`` grows as it goes."""

    def __init__(self, guest: Guest, host_ip: str, mib: int = STREAM_MIB):
        self.payload = os.urandom(mib * MIB)
        self.md5 = hashlib.md5(self.payload).hexdigest()
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host_ip, 0))
        self.sock.listen(1)
        self.sock.settimeout(120)
        self.sent = 0
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()
        self.guest = guest
        guest.run_ok("rm -f /tmp/stream.md5 /tmp/stream.done")
        guest.run_ok(f"setsid sh -c 'nc {host_ip} {self.sock.getsockname()[1]} </dev/null "
                     f"2>/dev/null | md5sum > /tmp/stream.md5; touch /tmp/stream.done'")

    def _serve(self) -> None:
        try:
            conn, _ = self.sock.accept()
            conn.settimeout(300)
            with conn:
                view = memoryview(self.payload)
                while self.sent < len(view):
                    conn.sendall(view[self.sent:self.sent + MIB])
                    self.sent += min(MIB, len(view) - self.sent)
                conn.shutdown(socket.SHUT_WR)
                while conn.recv(65536):
                    pass
        except BaseException as e:  # noqa: BLE001 - reported by finish()
            self.error = e
        finally:
            self.sock.close()

    def wait_sent(self, mib: int, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while self.sent < mib * MIB:
            assert self.error is None, self.error
            assert self.thread.is_alive(), "stream ended early"
            assert time.monotonic() < deadline, f"only {self.sent // MIB} MiB sent"
            time.sleep(0.02)

    def finish(self, timeout: float = 300) -> str:
        """Waits for the end of the stream; returns the guest's md5."""
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "stream still running"
        assert self.error is None, repr(self.error)
        rc, _ = self.guest.run("i=0; while [ ! -e /tmp/stream.done ] && [ $i -lt 600 ]; do "
                               "sleep 0.1; i=$((i+1)); done; [ -e /tmp/stream.done ]",
                               timeout=120)
        assert rc == 0, "md5sum in the guest did not finish"
        return self.guest.run_ok("cat /tmp/stream.md5").split()[0]


def wait_serving(gs: Gsonet, timeout: float = 30) -> None:
    """Until the (new) gsonet answers on its control socket."""
    deadline = time.monotonic() + timeout
    while True:
        assert gs.alive(), gs.log()[-2000:]
        try:
            gs.stats()
            return
        except HarnessError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def restart(gs: Gsonet, sig: int, name: str) -> tuple[Gsonet, float]:
    """Stops gsonet with ``sig`` and starts the same command line again at once.
    Returns the new one and the wall-clock time of the signal."""
    t = time.time()
    gs.proc.send_signal(sig)
    rc = gs.proc.wait(timeout=15)
    if sig == signal.SIGTERM:
        assert rc == 0, f"rc={rc}\n{gs.log()[-2000:]}"
        assert not gs.control.exists(), "a clean stop removes its control socket"
    gs.stop()
    new = Gsonet(gs.ports, gs.uplinks, workdir=gs.workdir, name=name, extra=gs.extra,
                 inherit=gs.inherit)
    new.start()
    wait_serving(new)
    return new, t


def _host_net(n: int) -> dict:
    return {"host_ip": f"10.77.{n}.1", "guest_ip": f"10.77.{n}.2"}


def _start_guest(name: str, netdev: list[str], net: dict, props: dict | None = None) -> Guest:
    g = Guest(name, netdev, props, ip=f"{net['guest_ip']}/24")
    g.start()
    g.wait_booted()
    g.run_ok("echo up > /tmp/not-rebooted")
    return g


def _check_not_rebooted(g: Guest) -> None:
    assert g.alive(), g.qemu_stderr()[-2000:]
    assert g.run_ok("cat /tmp/not-rebooted").strip() == "up"


def _outages(ping: PingFlood, times: list[float]) -> list[float]:
    """The outage of each restart: the longest gap in the replies from just before
    its signal to just before the next one (or the end)."""
    ends = [t - 0.05 for t in times[1:]] + [time.time()]
    return [ping.outage_ms(t - 0.05, end) for t, end in zip(times, ends)]


def _report(record, key: str, outages: list[float]) -> float:
    med = statistics.median(outages)
    print(f"\nRESULT {key}.outage_ms median={med:.0f} runs={[round(o) for o in outages]}")
    record(f"{key}.outage_ms", med)
    return med


def _carrier_changes(g) -> int:
    return int(g.run_ok("cat /sys/class/net/eth0/carrier_changes").strip())


def _run_server_mode(guest_env, tmp_path_factory, record, *, sig: int, key: str,
                     restarts: int, props: dict | None = None, iperf: bool = False,
                     stream: bool = True, activated: bool = False,
                     seen: dict | None = None, port_opts: str = "") -> list[float]:
    """The restarts; `seen` (if given) gets `carrier_changes`: how often the guest's
    eth0 saw its link go down or up over them."""
    n = alloc_subnet()
    net = _host_net(n)
    tap = f"gsrs{os.getpid() % 10000}{n % 100}"
    work = tmp_path_factory.mktemp(key.replace(".", "-"))
    sock = str(work / "vm.sock")
    # activated: this process holds the port's listening socket, as systemd would,
    # so QEMU's reconnect lands in its backlog while no gsonet runs.
    held = None
    if activated:
        held = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        held.bind(sock)
        held.listen(16)
    gs = Gsonet([f"socket={sock}{port_opts}"], [f"tap={tap},persist=on"], workdir=work,
                name=f"{key}-0",
                inherit=[held] if held else None)
    g = ping = None
    outages: list[float] = []
    try:
        gs.start()
        set_addr(tap, f"{net['host_ip']}/24")
        subprocess.run(["ip", "route", "add", f"10.79.{n}.0/24", "dev", tap], check=True)
        g = _start_guest(key.replace(".", "-"), reconnecting_netdev(sock), net, props)
        gs.wait_port(0, True)
        before = tap_state(tap)
        ping = PingFlood(net["guest_ip"], work / "ping.log")
        ping.wait_reply_after(time.time() - 1)
        carrier0 = _carrier_changes(g)
        if iperf:
            srv = subprocess.Popen(["iperf3", "-s", "-1", "-B", net["host_ip"], "-p", "5299"],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(0.5)
            g.run_ok(f"setsid sh -c 'iperf3 -c {net['host_ip']} -p 5299 "
                     f"-t {8 * restarts + 6} > /tmp/iperf.txt 2>&1; touch /tmp/iperf.done'")
        st = StreamToGuest(g, net["host_ip"]) if stream else None
        times = []
        for i in range(restarts):
            if st:
                st.wait_sent(16 + i * 64)
            else:
                time.sleep(3)
            gs, t = restart(gs, sig, f"{key}-{i + 1}")
            times.append(t)
            gs.wait_port(0, True, timeout=60)
            ping.wait_reply_after(t + 1.0)
        outages = _outages(ping, times)
        if seen is not None:
            seen["carrier_changes"] = _carrier_changes(g) - carrier0
            seen["log"] = gs.log()
        if st:
            assert st.finish() == st.md5, "the stream's md5 differs after the restarts"
        if iperf:
            rc, _ = g.run("i=0; while [ ! -e /tmp/iperf.done ] && [ $i -lt 1200 ]; do "
                          "sleep 0.1; i=$((i+1)); done; [ -e /tmp/iperf.done ]", timeout=180)
            out = g.run_ok("cat /tmp/iperf.txt")
            assert rc == 0 and "receiver" in out and "error" not in out.lower(), out
            srv.wait(timeout=30)
        _check_not_rebooted(g)
        after = tap_state(tap)
        assert after == before, (before, after)
        assert any(f"10.79.{n}.0/24" in r for r in after["routes"]), after
        return outages
    finally:
        if ping:
            ping.stop()
        if g:
            g.shutdown()
        gs.stop()
        delete_link(tap)
        if held:
            held.close()


@pytest.mark.slow
def test_sigkill_server_mode(guest_env, tmp_path_factory, record_measurement):
    """SIGKILL while a 256 MiB stream runs, restarted at once, three times: QEMU
    reconnects, the stream finishes with the host's md5, the tap is the same."""
    seen: dict = {}
    outages = _run_server_mode(guest_env, tmp_path_factory, record_measurement,
                               sig=signal.SIGKILL, key="restart.server_sigkill", restarts=3,
                               seen=seen)
    _report(record_measurement, "restart.server_sigkill", outages)
    # A guest with the link-status bit sees each restart as its link going down and up.
    assert seen["carrier_changes"] >= 2 * 3, seen


def test_sigterm_server_mode_with_iperf3(guest_env, tmp_path_factory, record_measurement):
    """SIGTERM (exit 0, sockets removed) and start again, three times, while the
    guest runs iperf3 to the host and a 256 MiB stream comes in: both finish."""
    outages = _run_server_mode(guest_env, tmp_path_factory, record_measurement,
                               sig=signal.SIGTERM, key="restart.server_sigterm", restarts=3,
                               iperf=True)
    _report(record_measurement, "restart.server_sigterm", outages)


def test_status_off_guest(guest_env, tmp_path_factory, record_measurement):
    """A guest without the link-status bit: it never sees the link go down, so it
    keeps the tap's MAC in its ARP cache. The tap keeps its MAC and the host keeps its
    ARP entry for the guest, so the gap is the restart itself: QEMU's reconnect-ms
    and the vhost-user set-up."""
    seen: dict = {}
    outages = _run_server_mode(guest_env, tmp_path_factory, record_measurement,
                               sig=signal.SIGKILL, key="restart.status_off", restarts=3,
                               props={"status": False}, seen=seen)
    _report(record_measurement, "restart.status_off", outages)
    # The behaviour, by count: the guest never saw its link change, so it kept its
    # neighbours (test_sigkill_server_mode shows the same count moving with status on).
    # The outage figure (~130 ms against ~1 s with status, docs/operations.md) is
    # recorded, not asserted: a busy machine moves it. 10 s means traffic never
    # came back by itself.
    assert seen["carrier_changes"] == 0, seen
    assert max(outages) < 10_000, outages


@pytest.mark.full
def test_status_off_guest_socket_activated(guest_env, tmp_path_factory, record_measurement):
    """The same with the listening socket held by a service manager (LISTEN_FDS):
    QEMU reconnects into its backlog at once instead of every reconnect-ms."""
    outages = _run_server_mode(guest_env, tmp_path_factory, record_measurement,
                               sig=signal.SIGKILL, key="restart.status_off_activated",
                               restarts=3, props={"status": False}, activated=True)
    med = _report(record_measurement, "restart.status_off_activated", outages)
    assert med <= 1000, f"outage median {med:.0f} ms over the 1 s target: {outages}"


@pytest.mark.full
def test_sigkill_client_mode(guest_env, tmp_path_factory, record_measurement):
    """QEMU listens (server=on,wait=off), gsonet connects: after SIGKILL and a start,
    gsonet reconnects by itself; the 256 MiB stream finishes with the host's md5."""
    n = alloc_subnet()
    net = _host_net(n)
    tap = f"gsrc{os.getpid() % 10000}{n % 100}"
    work = tmp_path_factory.mktemp("restart-client")
    sock = str(work / "qemu.sock")
    g = Guest("restart-client", vhost_user_netdev(sock, server=True),
              ip=f"{net['guest_ip']}/24")
    gs = Gsonet([f"socket={sock},client"], [f"tap={tap},persist=on"], workdir=work,
                name="restart.client-0")
    ping = None
    outages = []
    try:
        g.start()
        g.wait_socket(sock)
        gs.start()
        set_addr(tap, f"{net['host_ip']}/24")
        g.wait_booted()
        g.run_ok("echo up > /tmp/not-rebooted")
        gs.wait_port(0, True)
        before = tap_state(tap)
        ping = PingFlood(net["guest_ip"], work / "ping.log")
        ping.wait_reply_after(time.time() - 1)
        st = StreamToGuest(g, net["host_ip"])
        times = []
        for i in range(3):
            st.wait_sent(16 + i * 64)
            gs, t = restart(gs, signal.SIGKILL, f"restart.client-{i + 1}")
            times.append(t)
            gs.wait_port(0, True, timeout=60)
            ping.wait_reply_after(t + 1.0)
        outages = _outages(ping, times)
        assert st.finish() == st.md5
        _check_not_rebooted(g)
        assert tap_state(tap) == before
    finally:
        if ping:
            ping.stop()
        g.shutdown()
        gs.stop()
        delete_link(tap)
    _report(record_measurement, "restart.client_sigkill", outages)


def test_clean_stop_removes_sockets_and_keeps_the_tap(guest_env, tmp_path_factory):
    """No guest: SIGTERM exits 0 and removes the control and port sockets; the tap
    stays with its address and the MAC derived from its name; a start after SIGKILL
    takes over the stale sockets and the same tap."""
    n = alloc_subnet()
    tap = f"gsrt{os.getpid() % 10000}{n % 100}"
    work = tmp_path_factory.mktemp("restart-stop")
    socks = [work / "a.sock", work / "b.sock"]
    gs = Gsonet([f"socket={s}" for s in socks], [f"tap={tap},persist=on"], workdir=work,
                name="restart-stop-0")
    try:
        gs.start()
        set_addr(tap, f"10.77.{n}.1/24")
        before = tap_state(tap)
        assert before["mac"] == derived_mac(tap), before
        gs.proc.send_signal(signal.SIGKILL)
        gs.proc.wait(timeout=10)
        gs.stop()
        assert all(s.exists() for s in socks) and gs.control.exists(), "stale sockets"
        gs = Gsonet(gs.ports, gs.uplinks, workdir=work, name="restart-stop-1")
        gs.start()
        wait_serving(gs)
        assert tap_state(tap) == before
        assert "reattached=true" in gs.log()
        gs.proc.send_signal(signal.SIGTERM)
        assert gs.proc.wait(timeout=15) == 0, gs.log()[-2000:]
        assert not any(s.exists() for s in socks), "port sockets left behind"
        assert not gs.control.exists(), "control socket left behind"
        assert tap_state(tap) == before
    finally:
        gs.stop()
        delete_link(tap)


def _packed_restarts(guest_env, tmp_path_factory, record_measurement, sig, key: str,
                     **props) -> dict:
    """Three restarts by ``sig`` under a packed guest (QEMU packed=on, port
    packed=on, more device ``props``), the outages recorded under ``key``; what the
    runs saw (gsonet's log, carrier changes)."""
    seen: dict = {}
    outages = _run_server_mode(guest_env, tmp_path_factory, record_measurement,
                               sig=sig, key=key, restarts=3, props={"packed": True, **props},
                               port_opts=",packed=on", seen=seen)
    _report(record_measurement, key, outages)
    return seen


@pytest.mark.slow
def test_sigkill_packed_guest(guest_env, tmp_path_factory, record_measurement):
    """A guest with packed rings (QEMU packed=on, port packed=on): SIGKILL while the
    stream runs, restarted at once, three times; the stream finishes with the host's
    md5. QEMU cannot read a packed ring's position back and restarts each ring at
    the base of its first start: the new gsonet resumes the rings where the port's
    record (SOCKET.rings) has them, and says so. Without the record the queues never
    move again (no ping reply after the first restart)."""
    seen = _packed_restarts(guest_env, tmp_path_factory, record_measurement,
                            signal.SIGKILL, "restart.packed_sigkill")
    assert "packed ring resumed where this port's record has it" in seen["log"], \
        seen["log"][-3000:]


@pytest.mark.full
def test_status_off_packed_guest(guest_env, tmp_path_factory, record_measurement):
    """A packed guest without the link-status bit: it goes on sending during each
    outage, and QEMU, with no backend, drops those frames itself at its own (stale)
    position in the TX ring (docs/architecture.md, "Packed rings"). Three SIGKILLs
    with the stream running; traffic must come back after each."""
    seen = _packed_restarts(guest_env, tmp_path_factory, record_measurement,
                            signal.SIGKILL, "restart.packed_status_off", status=False)
    assert seen["carrier_changes"] == 0, seen


@pytest.mark.full
def test_sigterm_packed_guest(guest_env, tmp_path_factory, record_measurement):
    """A clean stop under a packed guest: gsonet closes the connection itself, so
    QEMU cannot read the rings back either; the next gsonet resumes them from the
    record. Three SIGTERMs with the stream running."""
    seen = _packed_restarts(guest_env, tmp_path_factory, record_measurement,
                            signal.SIGTERM, "restart.packed_sigterm")
    assert "packed ring resumed where this port's record has it" in seen["log"], \
        seen["log"][-3000:]

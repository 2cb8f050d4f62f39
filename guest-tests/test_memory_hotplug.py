"""Memory plugged into and out of a running guest on a gsonet port, with real QEMU.

The guest boots with ``-m 512M,slots=16,maxmem=4G``; QEMU then tells gsonet of each
DIMM plugged through QMP (``memory-backend-memfd,share=on`` + ``pc-dimm``) with
ADD_MEM_REG, and of each one unplugged with REM_MEM_REG (CONFIGURE_MEM_SLOTS). The
guest onlines new memory as movable (``memhp_default_state=online_movable``), so it
can give a DIMM back.

What must hold, while the guest sends with iperf3 (the host's client with -R): three
DIMMs plug, gsonet maps one more region each (``gsonet stats``), the guest fills its
page cache past its boot memory (so its socket buffers and the frames gsonet reads
come from the new memory too), one DIMM unplugs and gsonet maps one region fewer,
and the stream survives all of it with data in every second after the first plug.
Printed as result lines: the longest gap between iperf3 intervals with data, and the
throughput in the seconds around each plug and the unplug.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from harness.gsonet import Gsonet
from harness.hostnet import alloc_subnet, delete_link, set_addr
from harness.iperf import iperf3_guest_server
from harness.migration import MigGuest, Qmp
from harness.qemu import vhost_user_netdev

DIMM_MB = 256


class HotplugGuest(MigGuest):
    """A guest with room for DIMMs, onlining them as movable memory."""

    def cmdline(self) -> list[str]:
        argv = super().cmdline()
        i = argv.index("-m")
        argv[i + 1] = f"{self.machine.mem},slots=16,maxmem=4G"
        j = argv.index("-append")
        argv[j + 1] += " memhp_default_state=online_movable"
        return argv


def _regions(gs: Gsonet) -> int:
    return gs.port_stats(0)["mem_regions"]


def _wait_regions(gs: Gsonet, want: int, timeout: float = 30.0) -> int:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        n = _regions(gs)
        if n == want:
            return n
        time.sleep(0.2)
    return _regions(gs)


def test_dimm_hotplug_and_unplug_under_iperf(guest_env, tmp_path: Path, record_measurement):
    n = alloc_subnet()
    host_ip, guest_ip = f"10.77.{n}.1", f"10.77.{n}.2"
    tap = f"gsnh{os.getpid() % 10000}"
    sock = str(tmp_path / "a.sock")
    gs = Gsonet([f"socket={sock}"], [f"tap={tap}"], workdir=tmp_path, name="gsonet-hotplug")
    g = HotplugGuest("hotplug", vhost_user_netdev(sock), str(tmp_path / "qmp.sock"),
                     ip=f"{guest_ip}/24")
    iperf = None
    try:
        gs.start()
        set_addr(tap, f"{host_ip}/24")
        g.start()
        g.wait_booted()
        gs.wait_port(0)
        q = Qmp(g.qmp_path)
        boot = _regions(gs)
        assert boot >= 1, "no memory mapped"
        iperf3_guest_server(g)
        t0 = time.time()
        iperf = subprocess.Popen(["iperf3", "-c", guest_ip, "-R", "-t", "40", "-i", "1", "-J"],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        time.sleep(5)
        plugs = []
        for k in range(3):
            q.cmd("object-add", **{"qom-type": "memory-backend-memfd", "id": f"dimm{k}",
                                   "size": DIMM_MB << 20, "share": True})
            q.cmd("device_add", driver="pc-dimm", id=f"d{k}", memdev=f"dimm{k}")
            plugs.append(time.time() - t0)
            assert _wait_regions(gs, boot + k + 1) == boot + k + 1, f"DIMM {k} not mapped"
            time.sleep(2)
        # The guest uses the new memory: page cache past its 512 MiB of boot memory.
        total_kb = int(g.run_ok("awk '/MemTotal/ {print $2}' /proc/meminfo").strip())
        assert total_kb > (512 + 2 * DIMM_MB) * 1024, f"the guest sees {total_kb} kB"
        g.run_ok(f"dd if=/dev/zero of=/tmp/fill bs=1M count={512 + DIMM_MB} 2>/dev/null; "
                 "sync", timeout=120)
        # Give one DIMM back (its file is freed of the page cache first).
        g.run_ok("rm -f /tmp/fill; echo 3 > /proc/sys/vm/drop_caches")
        unplug = time.time() - t0
        q.cmd("device_del", id="d2")
        unplugged = _wait_regions(gs, boot + 2, timeout=30) == boot + 2
        out, err = iperf.communicate(timeout=90)
        assert iperf.returncode == 0, f"iperf3 failed: {err or out[-500:]}"
        intervals = json.loads(out)["intervals"]
        rates = [(i["sum"]["start"], i["sum"]["bits_per_second"] / 1e6) for i in intervals]
        after = [r for s, r in rates if s >= plugs[0]]
        assert after and all(r > 0 for r in after), f"seconds without data: {rates}"

        def around(t: float) -> str:
            return " ".join(f"{r:.0f}" for s, r in rates if t - 2 <= s <= t + 2)

        record_measurement("hotplug", {
            "boot_regions": boot,
            "plugs_s": [round(p, 1) for p in plugs],
            "mbit_around_plugs": [around(p) for p in plugs],
            "unplugged": unplugged,
            "mbit_around_unplug": around(unplug),
            "min_mbit_after_first_plug": round(min(after), 1),
        })
        print(f"RESULT hotplug: regions {boot} -> {boot + 3}; Mbit/s around the plugs "
              f"{[around(p) for p in plugs]}; unplug {'done' if unplugged else 'refused'} "
              f"({around(unplug)}); lowest second after the first plug {min(after):.0f} Mbit/s")
        assert unplugged, "the DIMM did not unplug (REM_MEM_REG not seen in gsonet stats)"
        assert gs.alive()
    finally:
        if iperf and iperf.poll() is None:
            iperf.kill()
        g.shutdown()
        gs.stop()
        delete_link(tap)


@pytest.mark.full
def test_live_migration_after_a_dimm_hotplug(guest_env, tmp_path: Path, record_measurement):
    """A guest with a DIMM plugged at run time migrates between two ports: the
    destination QEMU starts with that DIMM on its command line, gsonet maps it on port
    B as on port A, and the guest, sending with iperf3 as it moves, answers the host
    through port B."""
    n = alloc_subnet()
    host_ip, guest_ip = f"10.77.{n}.1", f"10.77.{n}.2"
    tap = f"gsnk{os.getpid() % 10000}"
    sock_a, sock_b = str(tmp_path / "a.sock"), str(tmp_path / "b.sock")
    mig = str(tmp_path / "migrate.sock")
    gs = Gsonet([f"socket={sock_a}", f"socket={sock_b}"], [f"tap={tap}"], workdir=tmp_path,
                name="gsonet-hotplug-migrate")
    name = "hotplug-migrate"
    dimm = ["-object", f"memory-backend-memfd,id=dimm0,size={DIMM_MB}M,share=on",
            "-device", "pc-dimm,id=d0,memdev=dimm0"]
    src = HotplugGuest(name, vhost_user_netdev(sock_a), str(tmp_path / "src.qmp"),
                       ip=f"{guest_ip}/24")
    dst = HotplugGuest(name, vhost_user_netdev(sock_b), str(tmp_path / "dst.qmp"),
                       extra=dimm + ["-incoming", "defer"], ip=f"{guest_ip}/24")
    dst.name = f"{name}-dst"
    iperf = None
    try:
        gs.start()
        set_addr(tap, f"{host_ip}/24")
        src.start()
        src.wait_booted()
        gs.wait_port(0)
        qs = Qmp(src.qmp_path)
        boot = _regions(gs)
        qs.cmd("object-add", **{"qom-type": "memory-backend-memfd", "id": "dimm0",
                                "size": DIMM_MB << 20, "share": True})
        qs.cmd("device_add", driver="pc-dimm", id="d0", memdev="dimm0")
        assert _wait_regions(gs, boot + 1) == boot + 1, "the DIMM is not mapped on port A"
        src.run_ok(f"dd if=/dev/zero of=/tmp/fill bs=1M count={512 + DIMM_MB // 2} "
                   "2>/dev/null; sync", timeout=120)
        dst.start()
        qd = Qmp(dst.qmp_path)
        qd.cmd("migrate-incoming", uri=f"unix:{mig}")
        # The guest sends while it moves.
        iperf3_guest_server(src)
        iperf = subprocess.Popen(["iperf3", "-c", guest_ip, "-R", "-t", "20"],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(3)
        qs.cmd("migrate", uri=f"unix:{mig}")
        deadline = time.monotonic() + 120
        while True:
            info = qs.cmd("query-migrate")
            if info.get("status") == "completed":
                break
            assert info.get("status") not in ("failed", "cancelled"), info
            assert time.monotonic() < deadline, f"migration did not complete: {info}"
            time.sleep(0.5)
        on_b = gs.port_stats(1)["mem_regions"]
        # The guest answers through port B once it runs there.
        deadline = time.monotonic() + 60
        while qd.cmd("query-status").get("status") != "running":
            assert time.monotonic() < deadline, "the destination does not run"
            time.sleep(0.2)
        ping = subprocess.run(["ping", "-c", "5", "-W", "2", guest_ip],
                              capture_output=True, text=True)
        b_tx = gs.port_stats(1)["stats"]["tx_frames"]
        record_measurement("hotplug_migration", {"regions_a": boot + 1, "regions_b": on_b,
                                                 "downtime_ms": info.get("downtime"),
                                                 "port_b_tx_frames": b_tx})
        print(f"RESULT hotplug migration: port B maps {on_b} regions (port A had {boot + 1}); "
              f"downtime {info.get('downtime')} ms; {b_tx} frames from the guest on port B")
        assert on_b == boot + 1, f"port B maps {on_b} regions, port A had {boot + 1}"
        assert ping.returncode == 0, f"the migrated guest does not answer: {ping.stdout}"
        assert b_tx > 0, "nothing from the guest on port B"
        assert gs.alive()
    finally:
        if iperf and iperf.poll() is None:
            iperf.kill()
        src.shutdown()
        dst.shutdown()
        gs.stop()
        delete_link(tap)

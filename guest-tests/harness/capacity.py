"""The capacity of a vhost-user backend driven by fast frontends, the way DPDK's own
vhost tests measure it: no guest, one dpdk-testpmd with two ``net_virtio_user``
ports (one per backend socket) on CPU 0, the backend under test on CPU 1. Frames
circulate A -> backend -> B -> frontend -> A (and the other way round); what the
frontend receives per second is what the backend switched. The backend is gsonet
(``gsonet serve`` with two ports) or the reference, testpmd's vhost PMD
(two ``net_vhost`` ports, io forwarding). The 64 KB TSO row uses
examples/tso_loadgen.rs as the frontend of both sockets instead of testpmd.

Per measurement: frames and bytes the frontend received over the window, the
backend's CPU time (utime + stime of /proc/PID/stat), its system calls and the
frontend's (``perf stat -e raw_syscalls:sys_enter -p PID``), and for gsonet its kick
wake-ups and calls (``gsonet stats --json``)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from .cost import CLK_TCK, cpu_seconds, gsonet_counters
from .gsonet import Gsonet, counters_delta
from .paths import REPO, TESTPMD, open_log
from .process import HarnessError
from .testpmd import TestPmd

FRONTEND_CPU = 0
BACKEND_CPU = 1
# The frontend's two ports; each sends to the other's address (testpmd's eth-peer),
# so the backend switches unicast frames to an address it learned.
MAC0 = "02:00:00:ca:00:01"
MAC1 = "02:00:00:ca:00:02"
LOADGEN = os.environ.get("GSONET_TSO_LOADGEN",
                         str(REPO / "target" / "release" / "examples" / "tso_loadgen"))
LOADGEN_BUILD = "cargo build --release --example tso_loadgen"
# Nice value of the frontends and backends (0: as started). A negative one keeps other
# work on a shared machine (builds) from taking a share of the two CPUs, which costs
# a busy-polling backend more than one that sleeps. Each of them runs in a session of
# its own, so with autogroup scheduling the value is set on its autogroup as well
# (between autogroups only theirs counts).
NICE = 0

# name -> what the frontend sends: testpmd's txpkts (segment lengths of one frame),
# or a frame size for tso_loadgen
ROWS: dict[str, dict] = {
    "64": {"label": "64 B", "txpkts": "64"},
    "1518": {"label": "1518 B", "txpkts": "1518"},
    "8k": {"label": "8 KB (4 x 2048 B segments)", "txpkts": "2048,2048,2048,2048"},
    "64k-tso": {"label": "64 KB TSO (tso_loadgen)", "loadgen": 65536},
}


class NotBuilt(HarnessError):
    """A program the measurement needs has not been built."""


# ---- processes -----------------------------------------------------------------


def pinned(cpu: int) -> list[str]:
    """The command prefix that runs a program on CPU ``cpu`` only, at NICE."""
    return ["taskset", "-c", str(cpu)] + (["nice", "-n", str(NICE)] if NICE else [])


def prioritise(pid: int | None) -> None:
    """NICE for the autogroup of ``pid`` (a session leader the harness started)."""
    if not NICE or pid is None:
        return
    try:
        Path(f"/proc/{pid}/autogroup").write_text(f"{NICE}\n")
    except OSError:
        pass  # no autogroup scheduling: nice alone applies


class PinnedTestPmd(TestPmd):
    """TestPmd under ``taskset -c CPU`` with its lcores on that CPU too
    (``--lcores 0@CPU,1@CPU``: the prompt's lcore and one forwarding lcore)."""

    def __init__(self, name: str, vdevs: list[str], args: list[str] | None = None, *,
                 cpu: int, log_dir: Path | str | None = None):
        super().__init__(name, vdevs, args, log_dir=log_dir, hugepages=HUGEPAGES)
        self.cpu = cpu
        self.lcores = f"0@{cpu},1@{cpu}"

    def cmdline(self) -> list[str]:
        cmd = super().cmdline()
        i = cmd.index("-l")
        cmd[i:i + 2] = ["--lcores", self.lcores]
        return [*pinned(self.cpu), *cmd]

    def all_port_stats(self) -> dict[int, dict]:
        """``show port stats all``: {port: {"rx_packets": .., "rx_bytes": .., ...}}."""
        out = self.cmd("show port stats all")
        stats = {}
        for part in re.split(r"NIC statistics for port ", out)[1:]:
            m = re.match(r"(\d+).*?RX-packets:\s*(\d+)\s+RX-missed:\s*(\d+)\s+"
                         r"RX-bytes:\s*(\d+).*?TX-packets:\s*(\d+)\s+TX-errors:\s*(\d+)\s+"
                         r"TX-bytes:\s*(\d+)",
                         part, re.S)
            if m:
                keys = ("rx_packets", "rx_missed", "rx_bytes", "tx_packets", "tx_errors",
                        "tx_bytes")
                stats[int(m.group(1))] = dict(zip(keys, map(int, m.groups()[1:])))
        if not stats:
            raise HarnessError(f"testpmd {self.name}: cannot parse port stats:\n{out}")
        return stats

    def wait_link_up(self, ports: int, timeout: float = 15.0) -> None:
        deadline = time.monotonic() + timeout
        for p in range(ports):
            while "Link status: up" not in self.cmd(f"show port info {p}"):
                if time.monotonic() > deadline:
                    raise HarnessError(f"testpmd {self.name}: port {p} link down after "
                                       f"{timeout}s")
                time.sleep(0.2)


class PinnedGsonet(Gsonet):
    """Gsonet under ``taskset -c CPU`` (all its threads on that CPU)."""

    def __init__(self, *a, cpu: int, **k):
        super().__init__(*a, **k)
        self.cpu = cpu

    def cmdline(self) -> list[str]:
        return [*pinned(self.cpu), *super().cmdline()]


def task_cpu_ns(pid: int) -> int:
    """CPU time in ns of every thread of ``pid`` (/proc/PID/task/*/schedstat): finer
    than the clock ticks of /proc/PID/stat, for the idle check."""
    total = 0
    for t in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((t / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            pass
    return total


def cpu_times(cpu: int) -> dict[str, float]:
    """Seconds CPU ``cpu`` spent busy (anything but idle and iowait) and stolen by the
    hypervisor so far (/proc/stat's cpuN line)."""
    with open("/proc/stat") as f:
        for line in f:
            if line.startswith(f"cpu{cpu} "):
                v = [int(x) for x in line.split()[1:9]]
                # user nice system idle iowait irq softirq steal
                return {"busy": (sum(v) - v[3] - v[4] - v[7]) / CLK_TCK,
                        "steal": v[7] / CLK_TCK}
    return {"busy": 0.0, "steal": 0.0}


class SyscallCount:
    """``perf stat -e raw_syscalls:sys_enter -p PID`` from ``start()`` to ``stop()``,
    which returns (system calls, seconds perf counted), or None without perf."""

    def __init__(self, pid: int, out: Path):
        self.pid, self.out = pid, out
        self.proc: subprocess.Popen | None = None

    def start(self) -> "SyscallCount":
        if shutil.which("perf") is None:
            return self
        self.proc = subprocess.Popen(
            ["perf", "stat", "--no-big-num", "-e", "raw_syscalls:sys_enter", "-p",
             str(self.pid), "-o", str(self.out)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True)
        return self

    def stop(self) -> tuple[int, float] | None:
        if self.proc is None:
            return None
        try:
            self.proc.send_signal(signal.SIGINT)
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.kill()
            return None
        finally:
            self.proc = None
        try:
            text = self.out.read_text()
        except OSError:
            return None
        n = re.search(r"^\s*(\d+)\s+raw_syscalls:sys_enter", text, re.M)
        s = re.search(r"([\d.]+)\s+seconds time elapsed", text)
        if not n or not s or float(s.group(1)) <= 0:
            return None
        return int(n.group(1)), float(s.group(1))

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None


# ---- backends ------------------------------------------------------------------


class Sockets:
    """A fresh directory with the two vhost-user socket paths, removed on close."""

    def __init__(self):
        self.dir = Path(tempfile.mkdtemp(prefix="gsonet-cap-"))
        self.a = str(self.dir / "A.sock")
        self.b = str(self.dir / "B.sock")

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


class GsonetBackend:
    """``gsonet serve`` with one port per socket, pinned to BACKEND_CPU."""

    kind = "gsonet"

    def __init__(self, label: str, binary: str, socks: Sockets, queues: int,
                 log_dir: Path, opts: str = ""):
        self.label = label
        self.binary = binary
        self.queues = queues
        extra = opts
        opts = "allow_unsealed_memory=on" + (f",queues={queues}" if queues > 1 else "")
        if extra:
            opts += "," + extra
        self.gs = PinnedGsonet([f"socket={socks.a},{opts}", f"socket={socks.b},{opts}"],
                               workdir=socks.dir / "gsonet", binary=binary,
                               name=f"cap-{label}", log_dir=log_dir, cpu=BACKEND_CPU)

    def cmdline(self) -> list[str]:
        return self.gs.cmdline()

    def start(self) -> "GsonetBackend":
        self.gs.start()
        prioritise(self.pid)
        return self

    @property
    def pid(self) -> int:
        assert self.gs.proc
        return self.gs.proc.pid

    def wait_connected(self) -> None:
        self.gs.wait_port(0)
        self.gs.wait_port(1)

    def counters(self) -> dict:
        """Kicks and calls summed over the ports, and every port's counters."""
        stats = self.gs.stats()
        return {"notify": gsonet_counters(self.gs),
                "ports": [p["stats"] for p in stats["ports"]]}

    @staticmethod
    def counters_window(a: dict, b: dict) -> dict:
        notify = {k: b["notify"][k] - a["notify"][k] for k in a["notify"]}
        ports = [counters_delta(pa, pb) for pa, pb in zip(a["ports"], b["ports"])]
        drops: dict[str, int] = {}
        for p in ports:
            for r, n in p.get("drops", {}).items():
                drops[r] = drops.get(r, 0) + n
        return {"notify": notify, "drops": drops,
                "switched": sum(p.get("tx_frames", 0) for p in ports)}

    def stop(self) -> None:
        self.gs.stop()


class DpdkBackend:
    """testpmd's vhost PMD, two ``net_vhost`` ports, io forwarding on one lcore, all
    on BACKEND_CPU. ``tso``: the ports offer TSO and pass it on (legacy offload flags,
    as for guest-to-guest)."""

    kind = "dpdk"

    def __init__(self, socks: Sockets, queues: int, log_dir: Path, tso: bool = False):
        self.label = "dpdk"
        self.socks = socks
        extra = ",tso=1,legacy-ol-flags=1" if tso else ""
        vdevs = [f"net_vhost{i},iface={s},queues={queues}{extra}"
                 for i, s in enumerate((socks.a, socks.b))]
        args = ["--forward-mode=io", "--nb-cores=1", f"--rxq={queues}", f"--txq={queues}",
                "--auto-start"]
        self.tp = PinnedTestPmd("ref", vdevs, args, cpu=BACKEND_CPU, log_dir=log_dir)

    def cmdline(self) -> list[str]:
        return self.tp.cmdline()

    def start(self, timeout: float = 60.0, sockets_within: float = 15.0) -> "DpdkBackend":
        """Starts testpmd (its prompt within ``timeout`` s) and waits for both
        sockets (``sockets_within`` s more)."""
        self.tp.start(timeout=timeout)
        prioritise(self.pid)
        deadline = time.monotonic() + sockets_within
        while not (os.path.exists(self.socks.a) and os.path.exists(self.socks.b)):
            if time.monotonic() > deadline:
                raise HarnessError(f"testpmd vhost: sockets not created after "
                                   f"{sockets_within:g} s")
            time.sleep(0.05)
        return self

    @property
    def pid(self) -> int:
        assert self.tp.proc
        return self.tp.proc.pid

    def wait_connected(self) -> None:
        self.tp.wait_link_up(2)

    def counters(self) -> None:
        return None

    @staticmethod
    def counters_window(a, b) -> None:
        return None

    def stop(self) -> None:
        self.tp.stop()


# The frontend's and the reference PMD's memory on hugepages (2 MiB pages, as DPDK
# deployments and hugepage-backed guests run) instead of 4 KiB pages.
HUGEPAGES = False
# Free 2 MiB pages both testpmds need (-m 1024 each, and some to spare).
HUGEPAGES_NEEDED = 1100


def hugepages_missing() -> str | None:
    """Why testpmd cannot run on hugepages here, or None."""
    free = 0
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("HugePages_Free:"):
            free = int(line.split()[1])
    mounted = any(f.split()[2] == "hugetlbfs"
                  for f in Path("/proc/mounts").read_text().splitlines() if f.strip())
    if free < HUGEPAGES_NEEDED or not mounted:
        return (f"--hugepages needs {HUGEPAGES_NEEDED} free 2 MiB pages on a mounted "
                f"hugetlbfs (free: {free}, hugetlbfs mounted: {'yes' if mounted else 'no'}):"
                f" echo {HUGEPAGES_NEEDED} > /proc/sys/vm/nr_hugepages; mkdir -p "
                f"/dev/hugepages; mount -t hugetlbfs nodev /dev/hugepages")
    return None


# More virtio_user devargs for the testpmd frontend's ports (``packed_vq=1``: it
# asks for packed rings, which a backend gives if it offers them).
FRONTEND_DEVARGS = ""


def frontend(socks: Sockets, queues: int, log_dir: Path) -> PinnedTestPmd:
    """The testpmd frontend: two net_virtio_user ports, pinned to FRONTEND_CPU; not
    forwarding until ``start_loop``."""
    extra = f",{FRONTEND_DEVARGS}" if FRONTEND_DEVARGS else ""
    vdevs = [f"net_virtio_user{i},path={s},queues={queues},mac={m}{extra}"
             for i, (s, m) in enumerate(((socks.a, MAC0), (socks.b, MAC1)))]
    return PinnedTestPmd("fe", vdevs, ["--nb-cores=1", f"--rxq={queues}", f"--txq={queues}"],
                         cpu=FRONTEND_CPU, log_dir=log_dir)


def loop_commands(txpkts: str, bursts: int) -> list[str]:
    """Prompt commands that start the loop: io forwarding (frames pass unchanged),
    each port's frames addressed to the other port, ``bursts`` bursts sent first."""
    return ["set fwd io", f"set eth-peer 0 {MAC1}", f"set eth-peer 1 {MAC0}",
            f"set txpkts {txpkts}", f"start tx_first {bursts}"]


# ---- one measurement ------------------------------------------------------------


class Window:
    """Everything read at the start and at the end of the measured window."""

    def __init__(self, backend, fe_pid: int | None, work: Path):
        self.backend = backend
        self.sys_be = SyscallCount(backend.pid, work / "perf-backend.txt")
        self.sys_fe = SyscallCount(fe_pid, work / "perf-frontend.txt") if fe_pid else None
        self.fe_pid = fe_pid

    def __enter__(self) -> "Window":
        self.sys_be.start()
        if self.sys_fe:
            self.sys_fe.start()
        time.sleep(0.2)  # perf attached
        self.cpu0 = cpu_seconds(self.backend.pid)
        self.fe_cpu0 = cpu_seconds(self.fe_pid)
        self.host0 = {c: cpu_times(c) for c in (FRONTEND_CPU, BACKEND_CPU)}
        self.n0 = self.backend.counters()
        self.t0 = time.monotonic()
        return self

    def close(self) -> dict:
        self.t1 = time.monotonic()
        cpu1 = cpu_seconds(self.backend.pid)
        fe_cpu1 = cpu_seconds(self.fe_pid)
        host1 = {c: cpu_times(c) for c in (FRONTEND_CPU, BACKEND_CPU)}
        n1 = self.backend.counters()
        el = self.t1 - self.t0
        # How busy each of the two CPUs was and how much the hypervisor took: the
        # backend's CPU busier than the backend itself means someone else ran there.
        host = {f"cpu{c}_{k}_share": (host1[c][k] - self.host0[c][k]) / el
                for c in host1 for k in ("busy", "steal")}
        if cpu1 is not None and self.cpu0 is not None:
            host["backend_cpu_others_share"] = max(
                0.0, host[f"cpu{BACKEND_CPU}_busy_share"] - (cpu1 - self.cpu0) / el)
        out = {"seconds": self.t1 - self.t0, "host": host,
               "cpu_s": (cpu1 - self.cpu0) if cpu1 is not None and self.cpu0 is not None
               else None,
               "frontend_cpu_s": (fe_cpu1 - self.fe_cpu0)
               if fe_cpu1 is not None and self.fe_cpu0 is not None else None,
               "backend": self.backend.counters_window(self.n0, n1)}
        be = self.sys_be.stop()
        fe = self.sys_fe.stop() if self.sys_fe else None
        out["syscalls_per_s"] = be[0] / be[1] if be else None
        out["frontend_syscalls_per_s"] = fe[0] / fe[1] if fe else None
        return out

    def __exit__(self, *exc) -> None:
        self.sys_be.kill()
        if self.sys_fe:
            self.sys_fe.kill()


def derive(frames_per_s: float, bytes_per_s: float, w: dict) -> dict:
    """The table's numbers from the rates and the window's costs."""
    res = {"mpps": frames_per_s / 1e6, "gbps": bytes_per_s * 8 / 1e9,
           "cpu_share": w["cpu_s"] / w["seconds"] if w["cpu_s"] is not None else None,
           "frontend_cpu_share": w["frontend_cpu_s"] / w["seconds"]
           if w.get("frontend_cpu_s") is not None else None,
           "others_on_backend_cpu": w["host"].get("backend_cpu_others_share"),
           "steal_backend_cpu": w["host"][f"cpu{BACKEND_CPU}_steal_share"]}
    cpu_per_s = res["cpu_share"]
    res["cpu_ns_per_frame"] = (cpu_per_s / frames_per_s * 1e9
                               if cpu_per_s is not None and frames_per_s else None)
    res["cpu_s_per_gb"] = (cpu_per_s / (bytes_per_s / 1e9)
                           if cpu_per_s is not None and bytes_per_s else None)
    for key, src in (("syscalls_per_kframe", "syscalls_per_s"),
                     ("frontend_syscalls_per_kframe", "frontend_syscalls_per_s")):
        res[key] = (w[src] / frames_per_s * 1000
                    if w.get(src) is not None and frames_per_s else None)
    bw = w.get("backend")
    if bw and frames_per_s:
        n = bw["notify"]
        frames = frames_per_s * w["seconds"]
        res["kicks_per_kframe"] = (n["tx_kicks"] + n["rx_kicks"]) / frames * 1000
        res["calls_per_kframe"] = (n["tx_calls"] + n["rx_calls"]) / frames * 1000
        res["notify_per_kframe"] = res["kicks_per_kframe"] + res["calls_per_kframe"]
        res["drops"] = bw["drops"]
        res["backend_switched"] = bw["switched"]
    return res


def measure_testpmd(backend, row: dict, queues: int, *, seconds: float, warmup: float,
                    bursts: int, socks: Sockets, log_dir: Path) -> dict:
    """One window of the testpmd loop through ``backend`` (started here, stopped after)."""
    fe = frontend(socks, queues, log_dir)
    res: dict = {"backend_cmd": backend.cmdline(), "frontend_cmd": fe.cmdline(),
                 "frontend_prompt": loop_commands(row["txpkts"], bursts)}
    try:
        backend.start()
        fe.start()
        try:
            prioritise(fe.proc.pid if fe.proc else None)
            backend.wait_connected()
            for c in res["frontend_prompt"]:
                out = fe.cmd(c)
                if "rror" in out or "nvalid" in out or "Bad arguments" in out:
                    raise HarnessError(f"testpmd frontend: {c!r}: {out.strip()[-500:]}")
            time.sleep(warmup)
            with Window(backend, fe.proc.pid if fe.proc else None, socks.dir) as w:
                s0 = fe.all_port_stats()
                t0 = time.monotonic()
                time.sleep(seconds)
                s1 = fe.all_port_stats()
                t1 = time.monotonic()
                win = w.close()
            frames = sum(s1[p]["rx_packets"] - s0[p]["rx_packets"] for p in s1)
            nbytes = sum(s1[p]["rx_bytes"] - s0[p]["rx_bytes"] for p in s1)
            if frames <= 0:
                raise HarnessError(f"no frames came round the loop in {seconds:g} s "
                                   f"(frontend stats {s1})")
            res.update(derive(frames / (t1 - t0), nbytes / (t1 - t0), win))
            res["frontend_stats"] = {"before": s0, "after": s1}
            res["window"] = win
        finally:
            fe.stop()
    finally:
        backend.stop()
    return res


def loadgen_cmdline(socks: Sockets, size: int, seconds: float, warmup: float) -> list[str]:
    return [*pinned(FRONTEND_CPU), LOADGEN, "--a", socks.a, "--b", socks.b,
            "--size", str(size), "--warmup", f"{warmup:g}", "--seconds", f"{seconds:g}",
            "--json"]


def measure_loadgen(backend, row: dict, *, seconds: float, warmup: float, socks: Sockets,
                    log_dir: Path) -> dict:
    """tso_loadgen as the frontend of both sockets (A sends, B receives): the rate is
    its own count of the TSO frames B received over its ``seconds`` after its
    ``warmup``; the backend's costs are read over the same span, give or take the
    moments the loadgen takes to connect."""
    if not os.access(LOADGEN, os.X_OK):
        raise NotBuilt(f"not built ({LOADGEN_BUILD})")
    cmd = loadgen_cmdline(socks, row["loadgen"], seconds, warmup)
    res: dict = {"backend_cmd": backend.cmdline(), "frontend_cmd": cmd}
    proc = None
    log = open_log(f"loadgen-{backend.label}", ".log", log_dir, " ".join(cmd))
    try:
        backend.start()
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=log, text=True, start_new_session=True)
        prioritise(proc.pid)
        time.sleep(max(0.0, warmup - 0.15))  # the window waits 0.2 s for perf
        with Window(backend, proc.pid, socks.dir) as w:
            end = time.monotonic() + seconds
            while time.monotonic() < end and proc.poll() is None:
                time.sleep(0.05)
            win = w.close()
        out, _ = proc.communicate(timeout=seconds + 60)
        if proc.returncode != 0:
            raise HarnessError(f"tso_loadgen rc={proc.returncode} (log {log.name})")
        line = [ln for ln in out.splitlines() if ln.strip().startswith("{")]
        if not line:
            raise HarnessError(f"tso_loadgen printed no JSON: {out[-500:]!r}")
        got = json.loads(line[-1])
        res["loadgen"] = got
        secs = float(got["seconds"])
        if not got.get("frames") or secs <= 0:
            raise HarnessError(f"tso_loadgen moved nothing: {got}")
        res.update(derive(got["frames"] / secs, got["bytes"] / secs, win))
        res["window"] = win
    finally:
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        log.close()
        backend.stop()
    return res


def measure_idle(label: str, binary: str, *, seconds: float, log_dir: Path,
                 opts: str = "") -> dict:
    """gsonet with both frontends connected and quiet (testpmd up, not forwarding) for
    ``seconds``: the share of one CPU it used, and its system calls."""
    socks = Sockets()
    try:
        be = GsonetBackend(label, binary, socks, 1, log_dir, opts=opts)
        fe = frontend(socks, 1, log_dir)
        try:
            be.start()
            with fe:
                be.wait_connected()
                time.sleep(1.0)
                sc = SyscallCount(be.pid, socks.dir / "perf-idle.txt").start()
                try:
                    time.sleep(0.2)
                    n0, c0, t0 = be.counters(), task_cpu_ns(be.pid), time.monotonic()
                    time.sleep(seconds)
                    n1, c1, t1 = be.counters(), task_cpu_ns(be.pid), time.monotonic()
                    calls = sc.stop()
                finally:
                    sc.kill()
        finally:
            be.stop()
        el = t1 - t0
        return {"seconds": el, "cpu_percent": (c1 - c0) / 1e9 / el * 100,
                "syscalls_per_s": calls[0] / calls[1] if calls else None,
                "backend": be.counters_window(n0, n1)}
    finally:
        socks.close()


def testpmd_missing() -> str | None:
    if shutil.which(TESTPMD) is None:
        return (f"{TESTPMD} not found: install DPDK (sudo make setup, i.e. scripts/setup.sh, "
                f"installs dpdk-dev which ships dpdk-testpmd)")
    return None

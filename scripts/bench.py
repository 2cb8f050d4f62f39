#!/usr/bin/env python3
"""Side-by-side iperf3 throughput: gsonet vs QEMU's built-in virtio-net vs DPDK
testpmd's vhost PMD, with TCG guests (1 vCPU, qemu64), in one interleaved run.

Topologies and backends:

  guest->host, host->guest (one guest, the host end on a tap):
    gsonet     gsonet serve --port socket=S --uplink tap=T
    qemu-tap   -netdev tap (QEMU's built-in virtio-net)
    dpdk       dpdk-testpmd net_vhost + net_tap, csum engine + tap TSO
  guest->guest (two guests):
    gsonet     gsonet serve --port socket=S0 --port socket=S1
    qemu-tap   two -netdev tap on a Linux bridge
    dpdk       dpdk-testpmd with two net_vhost ports, io forwarding

Each with the guests' offloads on (default) and with `ethtool -K eth0 tso off gso
off`. Rounds are interleaved (A B C A B C ...): round r sets up and measures every
backend before round r+1 starts, so slow drift of a noisy machine hits all
backends alike. A backend that fails is reported n/a with the reason.

    sudo scripts/bench.py                       # 10 s per test, median of 3
    sudo SECONDS=3 REPEATS=1 scripts/bench.py   # smoke run
    scripts/bench.py --backends gsonet,qemu-tap --topologies host

Output: a markdown table on stdout; results/bench-<timestamp>/ holds
results.json (every run, the exact commands), table.md and bench.png.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "guest-tests"))

import guest as G  # noqa: E402

BACKENDS = ["gsonet", "qemu-tap", "dpdk"]
TOPOLOGIES = ["host", "g2g"]
BASELINE = "qemu-tap"
LABEL = {"gsonet": "gsonet", "qemu-tap": "QEMU virtio-net + tap", "dpdk": "DPDK testpmd vhost"}
CASE_LABEL = {
    "g2h": "guest->host",
    "h2g": "host->guest",
    "g2g": "guest->guest",
}

# testpmd: guest<->host through net_tap with checksum offload and TSO done by the
# csum engine (ENVIRONMENT.md's recipe: 1434, not 1448, because net_tap counts the
# Ethernet header in its MTU check; mac-swap off or nothing arrives).
TESTPMD_HOST_CMDS = [
    "port stop all",
    "port config 0 rx_offload tcp_cksum on",
    "port config 0 rx_offload udp_cksum on",
    "set fwd csum",
    "csum mac-swap off 0",
    "csum mac-swap off 1",
    "csum set ip hw 1",
    "csum set tcp hw 1",
    "csum set udp hw 1",
    "csum parse-tunnel off 1",
    "tso set 1434 1",
    "port start all",
    "start",
]
TESTPMD_G2G_CMDS = ["set fwd io", "start"]


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


# ---- prerequisites ----------------------------------------------------------------


def ensure_dpdk() -> str | None:
    """dpdk-testpmd present, installing Debian's dpdk if it is not. None or a reason."""
    if shutil.which("dpdk-testpmd"):
        return None
    log("dpdk-testpmd missing: apt-get install dpdk")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for cmd in (["apt-get", "install", "-y", "-q", "--no-install-recommends", "dpdk"],
                ["apt-get", "update", "-q"],
                ["apt-get", "install", "-y", "-q", "--no-install-recommends", "dpdk"]):
        subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if shutil.which("dpdk-testpmd"):
            return None
    return "dpdk-testpmd not installed and apt-get install dpdk failed"


def ensure_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
        return True
    except ImportError:
        pass
    log("matplotlib missing: pip install matplotlib")
    for extra in (["--break-system-packages"], []):
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", *extra, "matplotlib"],
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            import matplotlib  # noqa: F401
            return True
        except ImportError:
            continue
    return False


# ---- testpmd ------------------------------------------------------------------------


class Testpmd:
    """dpdk-testpmd in interactive mode; stdin stays open (its prompt exits on EOF)."""

    def __init__(self, vdevs: list[str], commands: list[str], workdir: Path, name: str):
        self.args = ["stdbuf", "-oL", "dpdk-testpmd", "--no-huge", "-m", "1024", "--no-pci",
                     "-l", "0-1", "--file-prefix", f"gsb{os.getpid()}{name}"]
        for v in vdevs:
            self.args += ["--vdev", v]
        self.args += ["--", "-i", "--nb-cores=1", "--rxd=1024", "--txd=1024"]
        self.commands = commands
        self.log_path = workdir / f"testpmd-{name}.log"
        self.proc: subprocess.Popen | None = None
        self._out: list[str] = []
        self._cond = threading.Condition()

    def _reader(self):
        # Raw reads, not lines: the "testpmd> " prompt ends without a newline.
        assert self.proc and self.proc.stdout
        fd = self.proc.stdout.fileno()
        with open(self.log_path, "w") as f:
            while True:
                try:
                    data = os.read(fd, 65536)
                except OSError:
                    data = b""
                if not data:
                    break
                text = data.decode(errors="replace")
                f.write(text)
                f.flush()
                with self._cond:
                    self._out.append(text)
                    self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def _last_line(self) -> str:
        lines = [x for x in "".join(self._out).splitlines() if x.strip()]
        return lines[-1][:200] if lines else "no output"

    def _wait_prompt(self, count: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with self._cond:
            while "".join(self._out).count("testpmd>") < count:
                if self.proc and self.proc.poll() is not None:
                    raise RuntimeError(f"testpmd exited rc={self.proc.returncode} "
                                       f"(log: {self.log_path}): {self._last_line()}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RuntimeError(f"testpmd: no prompt after {timeout}s "
                                       f"(log: {self.log_path}): {self._last_line()}")
                self._cond.wait(min(left, 0.5))

    def start(self) -> "Testpmd":
        self.proc = subprocess.Popen(self.args, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, bufsize=0,
                                     start_new_session=True)
        threading.Thread(target=self._reader, daemon=True).start()
        self._wait_prompt(1, 60)
        # testpmd prints the prompt without a newline: send one command at a time
        # and count prompts.
        for i, c in enumerate(self.commands):
            self.proc.stdin.write(c.encode() + b"\n")
            self._wait_prompt(i + 2, 60)
        return self

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            try:
                self.proc.stdin.write(b"stop\nquit\n")
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired, ValueError):
                self.proc.terminate()
                try:
                    self.proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    self.proc.kill()

    def command_record(self) -> dict:
        return {"argv": " ".join(self.args), "interactive": self.commands}


# ---- one setup per (backend, topology) --------------------------------------------------


class Setup:
    """Brings up one backend in one topology; ``guests`` booted, ``host_ip`` and
    ``guest_ips`` known, ``commands`` the exact command lines used."""

    def __init__(self, backend: str, topo: str, work: Path, logs: Path):
        self.backend, self.topo, self.work, self.logs = backend, topo, work, logs
        self.guests: list[G.Guest] = []
        self.guest_ips: list[str] = []
        self.host_ip: str | None = None
        self.commands: dict = {}
        self.gsonet: G.Gsonet | None = None
        self._cleanup: list = []

    def _guest(self, name: str, netdev: list[str], ip: str) -> G.Guest:
        g = G.Guest(name, netdev, ip=f"{ip}/24")
        self._cleanup.append(g.shutdown)
        self.guests.append(g)
        self.guest_ips.append(ip)
        return g

    def __enter__(self) -> "Setup":
        try:
            self._up()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _up(self) -> None:
        n = G.alloc_subnet()
        net = f"10.77.{n}"
        tag = f"{os.getpid() % 1000}{n}"
        nguests = 1 if self.topo == "host" else 2
        socks = [str(self.work / f"{self.backend}-{self.topo}-{i}.sock") for i in range(nguests)]
        if self.backend == "gsonet":
            tap = f"gsbg{tag}"
            uplinks = [f"tap={tap}"] if self.topo == "host" else []
            gs = G.Gsonet([f"socket={s}" for s in socks], uplinks,
                          workdir=self.work / f"gsonet-{self.topo}", name=f"bench-{self.topo}")
            self._cleanup.append(lambda: G.delete_link(tap))
            self._cleanup.append(gs.stop)
            gs.start()
            self.gsonet = gs
            self.commands["gsonet"] = " ".join(gs.cmdline())
            if self.topo == "host":
                G.set_addr(tap, f"{net}.1/24")
                self.host_ip = f"{net}.1"
            for i, s in enumerate(socks):
                self._guest(f"bench-gsonet{i}", G.Guest.vhost_user(s), f"{net}.{i + 2}")
        elif self.backend == "qemu-tap":
            taps = [f"gsbq{tag}{i}" for i in range(nguests)]
            if self.topo == "host":
                self._cleanup.append(lambda: G.delete_link(taps[0]))
                G.create_tap(taps[0], f"{net}.1/24")
                self.host_ip = f"{net}.1"
                self.commands["host"] = f"ip tuntap add dev {taps[0]} mode tap vnet_hdr"
            else:
                br = f"gsbr{tag}"
                self._cleanup.append(lambda: [G.delete_link(x) for x in taps + [br]])
                G.create_bridge(br, taps)
                self.commands["host"] = (f"ip link add {br} type bridge; "
                                         + "; ".join(f"ip tuntap add dev {t} mode tap vnet_hdr; "
                                                     f"ip link set {t} master {br}" for t in taps))
            for i, t in enumerate(taps):
                self._guest(f"bench-qemu{i}", G.Guest.tap(t), f"{net}.{i + 2}")
        elif self.backend == "dpdk":
            reason = ensure_dpdk()
            if reason:
                raise RuntimeError(reason)
            if self.topo == "host":
                tap = f"gsbd{tag}"
                vdevs = [f"net_vhost0,iface={socks[0]},tso=1", f"net_tap0,iface={tap}"]
                tp = Testpmd(vdevs, TESTPMD_HOST_CMDS, self.logs, f"{self.topo}{n}")
                self._cleanup.append(lambda: G.delete_link(tap))
            else:
                vdevs = [f"net_vhost{i},iface={s},tso=1,legacy-ol-flags=1"
                         for i, s in enumerate(socks)]
                tp = Testpmd(vdevs, TESTPMD_G2G_CMDS, self.logs, f"{self.topo}{n}")
            self._cleanup.append(tp.stop)
            tp.start()
            self.commands["testpmd"] = tp.command_record()
            if self.topo == "host":
                for _ in range(100):
                    if G.link_exists(tap):
                        break
                    time.sleep(0.1)
                G.set_addr(tap, f"{net}.1/24")
                self.host_ip = f"{net}.1"
            for i, s in enumerate(socks):
                self._guest(f"bench-dpdk{i}", G.Guest.vhost_user(s), f"{net}.{i + 2}")
        else:
            raise ValueError(self.backend)
        for g in self.guests:
            g.start()
        for g in self.guests:
            g.wait_booted()
        self.commands["qemu"] = [" ".join(g.cmdline()) for g in self.guests]
        # Reachability first: a dead path should fail here, not as an iperf3 hang.
        peer = self.host_ip or self.guest_ips[1]
        rc, out = self.guests[0].run(f"ping -c 1 -W 10 {peer}", timeout=60)
        if rc != 0:
            raise RuntimeError(f"guest cannot reach {peer}: {out.strip()[-200:]}")

    def __exit__(self, *exc) -> None:
        for f in reversed(self._cleanup):
            try:
                f()
            except Exception:  # noqa: BLE001 - best-effort teardown
                pass
        self._cleanup.clear()

    def set_offloads(self, on: bool) -> None:
        v = "on" if on else "off"
        for g in self.guests:
            g.run_ok(f"ethtool -K eth0 tso {v} gso {v}")

    def measure(self, case: str, seconds: float) -> float:
        if case == "g2g":
            a, b = self.guests
            b.start_iperf3_server()
            return G.iperf3_guest_client(a, self.guest_ips[1], seconds=seconds)
        g = self.guests[0]
        g.start_iperf3_server()
        # server in the guest; -R makes the guest the sender
        return G.iperf3_host_client(self.guest_ips[0], seconds=seconds, reverse=(case == "g2h"))


# ---- the run ------------------------------------------------------------------------------


def key(topo_case: str, offloads: bool, backend: str) -> str:
    return f"{topo_case}|{'on' if offloads else 'off'}|{backend}"


def run(args) -> dict:
    cases = {"host": ["g2h", "h2g"], "g2g": ["g2g"]}
    res: dict = {"runs": {}, "errors": {}, "commands": {}}
    for r in range(args.repeats):
        for topo in args.topologies:
            for backend in args.backends:
                log(f"round {r + 1}/{args.repeats}: {backend} {topo}")
                with tempfile.TemporaryDirectory(prefix="gsonet-bench-") as tmp:
                    try:
                        with Setup(backend, topo, Path(tmp), args.out) as s:
                            res["commands"][f"{backend}|{topo}"] = s.commands
                            for on in (True, False):
                                s.set_offloads(on)
                                for case in cases[topo]:
                                    k = key(case, on, backend)
                                    try:
                                        gbps = s.measure(case, args.seconds)
                                        res["runs"].setdefault(k, []).append(gbps)
                                        log(f"  {k}: {gbps:.2f} Gbit/s")
                                    except Exception as e:  # noqa: BLE001
                                        res["errors"][k] = (f"{type(e).__name__}: "
                                                            f"{' '.join(str(e).split())[:300]}")
                                        log(f"  {k}: n/a ({res['errors'][k]})")
                                    time.sleep(0.5)
                            if s.gsonet is not None:
                                # drops and GSO counters explain a surprising number
                                try:
                                    res.setdefault("gsonet_stats", {})[f"{topo}|round{r + 1}"] = \
                                        s.gsonet.stats()
                                except Exception:  # noqa: BLE001
                                    pass
                    except Exception as e:  # noqa: BLE001 - one backend never stops the others
                        why = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
                        log(f"  {backend} {topo}: setup failed: {why}")
                        if args.verbose:
                            traceback.print_exc()
                        for case in cases[topo]:
                            for on in (True, False):
                                res["errors"].setdefault(key(case, on, backend), why)
    return res


def summarize(res: dict, args) -> list[dict]:
    rows = []
    order = [c for t in args.topologies for c in ({"host": ["g2h", "h2g"], "g2g": ["g2g"]}[t])]
    for case in order:
        for on in (True, False):
            row = {"case": case, "offloads": "on" if on else "tso/gso off", "backends": {}}
            base = None
            runs = res["runs"].get(key(case, on, BASELINE))
            if runs:
                base = statistics.median(runs)
            for b in args.backends:
                runs = res["runs"].get(key(case, on, b))
                if runs:
                    m = statistics.median(runs)
                    row["backends"][b] = {"gbps": m, "runs": runs,
                                          "ratio": (m / base) if base else None}
                else:
                    row["backends"][b] = {"gbps": None,
                                          "error": res["errors"].get(key(case, on, b), "not run")}
            rows.append(row)
    return rows


def markdown(rows: list[dict], args) -> str:
    head = ["direction", "guest offloads"]
    for b in args.backends:
        head.append(f"{LABEL[b]} Gbit/s")
        if b != BASELINE and BASELINE in args.backends:
            head.append(f"{b} / QEMU")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    notes = {}
    for row in rows:
        cells = [CASE_LABEL[row["case"]], row["offloads"]]
        for b in args.backends:
            v = row["backends"][b]
            if v["gbps"] is None:
                n = notes.setdefault(v["error"], len(notes) + 1)
                cells.append(f"n/a [{n}]")
            else:
                cells.append(f"{v['gbps']:.2f}")
            if b != BASELINE and BASELINE in args.backends:
                cells.append(f"{v['ratio']:.2f}x" if v.get("ratio") else "n/a")
        lines.append("| " + " | ".join(cells) + " |")
    for why, n in notes.items():
        lines.append(f"\n[{n}] {why}")
    return "\n".join(lines)


def chart(rows: list[dict], args, path: Path) -> str | None:
    if not ensure_matplotlib():
        return "matplotlib not available"
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{CASE_LABEL[r['case']]}\n{r['offloads']}" for r in rows]
    width = 0.8 / max(1, len(args.backends))
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(rows)), 4.5))
    for i, b in enumerate(args.backends):
        xs = [j + (i - (len(args.backends) - 1) / 2) * width for j in range(len(rows))]
        ys = [r["backends"][b]["gbps"] or 0 for r in rows]
        bars = ax.bar(xs, ys, width, label=LABEL[b])
        for x, r in zip(xs, rows):
            if r["backends"][b]["gbps"] is None:
                ax.text(x, 0.02, "n/a", ha="center", va="bottom", fontsize=7, rotation=90)
        del bars
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels(labels, fontsize=8)
    ax.set_ylabel("Gbit/s (iperf3 TCP, median)")
    ax.set_title(f"TCG guests, 1 vCPU: {args.seconds:g} s x {args.repeats} per point")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def env_number(names: tuple[str, ...], default: float) -> float:
    for n in names:
        v = os.environ.get(n)
        if v:
            try:
                return float(v)
            except ValueError:
                pass
    return default


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--seconds", type=float,
                    default=env_number(("BENCH_SECONDS", "SECONDS"), 10))
    ap.add_argument("--repeats", type=int,
                    default=int(env_number(("BENCH_REPEATS", "REPEATS"), 3)))
    ap.add_argument("--backends", default=",".join(BACKENDS),
                    help=f"comma-separated subset of {','.join(BACKENDS)}")
    ap.add_argument("--topologies", default=",".join(TOPOLOGIES),
                    help="host (guest<->host), g2g (guest<->guest)")
    ap.add_argument("--out", type=Path, default=None, help="results directory")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args()
    args.backends = [b for b in args.backends.split(",") if b]
    args.topologies = [t for t in args.topologies.split(",") if t]
    for b in args.backends:
        if b not in BACKENDS:
            ap.error(f"unknown backend {b}")
    for t in args.topologies:
        if t not in TOPOLOGIES:
            ap.error(f"unknown topology {t}")
    if os.geteuid() != 0:
        print("bench.py needs root (taps, bridges, QEMU networking)", file=sys.stderr)
        return 1
    if not G.image_ready():
        G.build_image()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = args.out or ROOT / "results" / f"bench-{stamp}"
    out.mkdir(parents=True, exist_ok=True)
    args.out = out

    t0 = time.monotonic()
    res = run(args)
    rows = summarize(res, args)
    table = markdown(rows, args)
    png_err = chart(rows, args, out / "bench.png")
    qemu_ver = subprocess.run([G.QEMU, "--version"], capture_output=True, text=True).stdout
    meta = {
        "timestamp": stamp,
        "seconds": args.seconds,
        "repeats": args.repeats,
        "wall_seconds": round(time.monotonic() - t0, 1),
        "host": platform.node(),
        "kernel": platform.release(),
        "cpus": os.cpu_count(),
        "qemu": qemu_ver.splitlines()[0] if qemu_ver else None,
        "guest": "TCG, 1 vCPU, -cpu qemu64, 512 MiB, 6.12 kernel, rx/tx rings 1024 "
                 "(tx 256 on QEMU's tap backend)",
        "offloads_off": "ethtool -K eth0 tso off gso off (in every guest)",
        "iperf3": "TCP, one stream, server in the receiving-side guest or guest A's peer; "
                  "guest->host uses -R",
        "loadavg": os.getloadavg(),
    }
    (out / "results.json").write_text(json.dumps(
        {"meta": meta, "rows": rows, "runs": res["runs"], "errors": res["errors"],
         "commands": res["commands"], "gsonet_stats": res.get("gsonet_stats", {})},
        indent=2) + "\n")
    (out / "table.md").write_text(table + "\n")
    print(f"\niperf3 TCP, {args.seconds:g} s per test, median of {args.repeats}; "
          f"ratio = backend / QEMU built-in, same run\n")
    print(table)
    print(f"\nresults: {out}/results.json, table.md"
          + ("" if png_err else ", bench.png") + (f" (no chart: {png_err})" if png_err else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())

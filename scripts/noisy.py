#!/usr/bin/env python3
"""The noisy-neighbour benchmark (`make bench` runs it after bench.py): two honest
QEMU guests move iperf3 TCP guest->guest through gsonet while a third party, the
attacker example (examples/attacker.rs), attacks from two other ports with each
attack in turn. Each attack's honest throughput is reported as a ratio to the same
run without an attack, measured interleaved (baseline, attack, baseline, attack...)
in the same guests and the same daemon; the target is >= 0.8 for every attack."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "guest-tests"))

from harness import hostnet, paths  # noqa: E402
from harness.gsonet import Gsonet  # noqa: E402
from harness.guest import Guest  # noqa: E402
from harness.iperf import iperf3_guest_client, iperf3_guest_server  # noqa: E402
from harness.knobs import env_number  # noqa: E402
from harness.process import HarnessError, stop  # noqa: E402
from harness.qemu import vhost_user_netdev  # noqa: E402

ATTACKS = ["idle", "rx-indirect", "rx-indirect-noneg", "rx-tiny", "avail-jump", "gso1",
           "mac-flood", "reset-loop", "mem-storm"]
ATTACKER = os.environ.get("GSONET_ATTACKER",
                          str(ROOT / "target" / "release" / "examples" / "attacker"))
TARGET = 0.8


def log(msg: str) -> None:
    print(f"[noisy] {msg}", file=sys.stderr, flush=True)




def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split()))
    ap.add_argument("--attacks", default=",".join(ATTACKS),
                    help=f"comma-separated subset of {','.join(ATTACKS)}")
    ap.add_argument("--seconds", type=float, default=env_number("NOISY_SECONDS", 5),
                    help="per iperf3 run (env NOISY_SECONDS, default 5)")
    ap.add_argument("--repeats", type=int, default=int(env_number("NOISY_REPEATS", 1)),
                    help="rounds over every attack (env NOISY_REPEATS, default 1)")
    ap.add_argument("--warmup", type=float, default=1.5,
                    help="seconds between starting an attack and measuring")
    ap.add_argument("--attacker-args", default=os.environ.get("NOISY_ATTACKER_ARGS", ""),
                    help="extra arguments for every attacker, e.g. \"--broadcasts 0\" "
                         "(see examples/attacker.rs --help)")
    ap.add_argument("--out", type=Path,
                    default=ROOT / "results" / f"noisy-{time.strftime('%Y%m%d-%H%M%S')}",
                    help="results.json, table.md and the logs go there")
    args = ap.parse_args(argv)
    args.attacks = [a for a in args.attacks.split(",") if a]
    for a in args.attacks:
        if a not in ATTACKS:
            ap.error(f"unknown attack {a}")
    return args


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system, all threads) process ``pid`` has used so far."""
    try:
        rest = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(rest[11]) + int(rest[12])) / os.sysconf("SC_CLK_TCK")


def drops(stats: dict, port: int) -> dict[str, int]:
    return stats["ports"][port]["stats"].get("drops", {})


def drop_delta(before: dict, after: dict, ports: tuple[int, ...]) -> dict[str, int]:
    """Drop reasons that moved on ``ports`` between two `gsonet stats` snapshots."""
    out: dict[str, int] = {}
    for p in ports:
        b, a = drops(before, p), drops(after, p)
        for reason, n in a.items():
            if n - b.get(reason, 0):
                out[reason] = out.get(reason, 0) + n - b.get(reason, 0)
    return out


class Rig:
    """gsonet with four ports (0, 1: the honest guests; 2: the attacker; 3: its
    sink) and the two guests booted and reachable."""

    def __init__(self, work: Path, logs: Path, attacker_args: list[str]):
        self.work, self.logs, self.attacker_args = work, logs, attacker_args
        self.socks = [str(work / f"p{i}.sock") for i in range(4)]
        self.gsonet = Gsonet([f"socket={s}" for s in self.socks], workdir=work / "gsonet",
                             name="noisy", log_dir=logs)
        self.guests: list[Guest] = []
        self.ips: list[str] = []

    def __enter__(self) -> "Rig":
        try:
            self.gsonet.start()
            net = f"10.77.{hostnet.alloc_subnet()}"
            for i in range(2):
                g = Guest(f"noisy{i}", vhost_user_netdev(self.socks[i]),
                          ip=f"{net}.{i + 2}/24", log_dir=self.logs)
                self.guests.append(g)
                self.ips.append(f"{net}.{i + 2}")
            for g in self.guests:
                g.start()
            for g in self.guests:
                g.wait_booted()
            rc, out = self.guests[0].run(f"ping -c 1 -W 10 {self.ips[1]}", timeout=60)
            if rc != 0:
                raise HarnessError(f"guest cannot reach {self.ips[1]}: {out.strip()[-200:]}")
            iperf3_guest_server(self.guests[1])
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        for g in self.guests:
            g.shutdown()
        self.gsonet.stop()

    def measure(self, seconds: float, attacker: subprocess.Popen | None = None) -> dict:
        """One iperf3 run, guest 0 -> guest 1 (server restarted on failure): Gbit/s,
        and the CPU share (1.0 = one core) gsonet and the attacker used meanwhile."""
        pids = {"gsonet": self.gsonet.proc.pid}
        if attacker is not None:
            pids["attacker"] = attacker.pid
        cpu0 = {k: cpu_seconds(p) for k, p in pids.items()}
        t0 = time.monotonic()
        try:
            gbps = iperf3_guest_client(self.guests[0], self.ips[1], seconds=seconds)
        except HarnessError:
            iperf3_guest_server(self.guests[1])
            cpu0 = {k: cpu_seconds(p) for k, p in pids.items()}
            t0 = time.monotonic()
            gbps = iperf3_guest_client(self.guests[0], self.ips[1], seconds=seconds)
        wall = time.monotonic() - t0
        out = {"gbps": gbps}
        for k, p in pids.items():
            out[f"{k}_cpu"] = (cpu_seconds(p) - cpu0[k]) / wall
        return out

    def attacker(self, attack: str) -> subprocess.Popen:
        out = paths.open_log(f"attacker-{attack}", ".log", self.logs)
        cmd = [ATTACKER, "--attack", attack, "--socket", self.socks[2], "--sink", self.socks[3],
               *self.attacker_args]
        out.write(" ".join(cmd) + "\n")
        out.flush()
        return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                start_new_session=True)

    def wait_attacker_gone(self, timeout: float = 15.0) -> None:
        """Ports 2 and 3 free again: the next attack gets them."""
        for p in (2, 3):
            try:
                self.gsonet.wait_port(p, connected=False, timeout=timeout)
            except AssertionError as e:
                raise HarnessError(f"port {p} still connected after the attacker left: "
                                   f"{str(e)[:300]}")


def run(args, rig: Rig) -> dict:
    res: dict = {"baseline": [], "baseline_gsonet_cpu": [],
                 "attacks": {a: [] for a in args.attacks}, "errors": {},
                 "cpu": {a: [] for a in args.attacks}, "drops": {a: {} for a in args.attacks},
                 "ratios": {a: [] for a in args.attacks}, "pending": []}
    for r in range(args.repeats):
        for attack in args.attacks:
            if not rig.gsonet.alive():
                raise HarnessError(f"gsonet died:\n{rig.gsonet.log()[-2000:]}")
            base = rig.measure(args.seconds)
            res["baseline"].append(base["gbps"])
            res["baseline_gsonet_cpu"].append(base["gsonet_cpu"])
            log(f"round {r + 1}/{args.repeats}: no attack {base['gbps']:.3f} Gbit/s, "
                f"gsonet CPU {base['gsonet_cpu']:.2f}")
            before = rig.gsonet.stats()
            proc = rig.attacker(attack)
            try:
                time.sleep(args.warmup)
                if proc.poll() is not None:
                    raise HarnessError(f"attacker exited rc={proc.returncode} (see its log)")
                m = rig.measure(args.seconds, proc)
                if proc.poll() is not None:
                    raise HarnessError(f"attacker exited rc={proc.returncode} during the run")
                res["attacks"][attack].append(m["gbps"])
                res["cpu"][attack].append((m["gsonet_cpu"], m["attacker_cpu"]))
                log(f"round {r + 1}/{args.repeats}: {attack} {m['gbps']:.3f} Gbit/s, "
                    f"gsonet CPU {m['gsonet_cpu']:.2f}, attacker CPU {m['attacker_cpu']:.2f}")
            except Exception as e:  # noqa: BLE001 - one attack never stops the others
                res["errors"][attack] = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
                log(f"  {attack}: n/a ({res['errors'][attack]})")
            finally:
                stop(proc)
            after = rig.gsonet.stats()
            for k, v in drop_delta(before, after, (2, 3)).items():
                res["drops"][attack][k] = res["drops"][attack].get(k, 0) + v
            rig.wait_attacker_gone()
            if attack in res["errors"]:
                continue
            # Bracketed: this run's ratio is to the mean of the no-attack runs just
            # before and just after it, so slow drift of a busy host cancels out.
            res["pending"].append((attack, res["attacks"][attack][-1], len(res["baseline"])))
    base = rig.measure(args.seconds)
    res["baseline"].append(base["gbps"])
    res["baseline_gsonet_cpu"].append(base["gsonet_cpu"])
    log(f"last no-attack run {base['gbps']:.3f} Gbit/s")
    for attack, gbps, k in res.pop("pending"):
        around = (res["baseline"][k - 1] + res["baseline"][k]) / 2
        res["ratios"][attack].append(gbps / around)
    return res


def summarize(res: dict, args) -> list[dict]:
    rows = []
    for a in args.attacks:
        runs = res["attacks"][a]
        m = statistics.median(runs) if runs else None
        cpu = res["cpu"][a]
        ratios = res["ratios"][a]
        rows.append({"attack": a, "gbps": m, "runs": runs, "ratios": ratios,
                     "gsonet_cpu": statistics.median(c[0] for c in cpu) if cpu else None,
                     "attacker_cpu": statistics.median(c[1] for c in cpu) if cpu else None,
                     "ratio": statistics.median(ratios) if ratios else None,
                     "error": res["errors"].get(a), "drops": res["drops"][a]})
    return rows


def markdown(rows: list[dict], res: dict) -> str:
    b = res["baseline"]
    lines = [f"no attack: median {statistics.median(b):.3f} Gbit/s over {len(b)} runs "
             f"(min {min(b):.3f}, max {max(b):.3f}); gsonet CPU "
             f"{statistics.median(res['baseline_gsonet_cpu']):.2f} cores", "",
             "| attack | honest Gbit/s | ratio to no attack (runs) | >= 0.8 | gsonet CPU (cores) "
             "| attacker CPU (cores) | counted on the attacker's ports |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        top = ", ".join(f"{k} {v}" for k, v in sorted(r["drops"].items(), key=lambda kv: -kv[1])[:3])
        if r["gbps"] is None:
            lines.append(f"| {r['attack']} | n/a | n/a | no | | | {r['error']} |")
        else:
            ok = "yes" if r["ratio"] >= TARGET else "NO"
            each = " ".join(f"{x:.2f}" for x in r["ratios"])
            lines.append(f"| {r['attack']} | {r['gbps']:.3f} | {r['ratio']:.2f} ({each}) | {ok} "
                         f"| {r['gsonet_cpu']:.2f} | {r['attacker_cpu']:.2f} | {top} |")
    return "\n".join(lines)


def main() -> int:
    args = parse_args()
    if os.geteuid() != 0:
        sys.exit("the noisy-neighbour bench needs root (QEMU networking)")
    if not os.access(ATTACKER, os.X_OK):
        sys.exit(f"{ATTACKER} missing: cargo build --release --example attacker")
    if not paths.image_ready():
        paths.build_image()
    logs = args.out / "logs"
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gsonet-noisy-") as tmp:
        with Rig(Path(tmp), logs, args.attacker_args.split()) as rig:
            res = run(args, rig)
            final = rig.gsonet.stats()
    rows = summarize(res, args)
    table = markdown(rows, res)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(
        {"meta": {"seconds": args.seconds, "repeats": args.repeats,
                  "attacker_args": args.attacker_args,
                  "wall_seconds": round(time.monotonic() - t0, 1), "cpus": os.cpu_count(),
                  "loadavg": os.getloadavg(),
                  "guests": "TCG, 1 vCPU, 512 MiB, iperf3 TCP one stream guest 0 -> guest 1"},
         "rows": rows, "baseline": res["baseline"],
         "baseline_gsonet_cpu": res["baseline_gsonet_cpu"], "final_stats": final},
        indent=2) + "\n")
    (args.out / "table.md").write_text(table + "\n")
    print(f"\nnoisy neighbour: iperf3 TCP guest->guest, {args.seconds:g} s per run, "
          f"{args.repeats} round(s); each attack run's ratio is to the mean of the "
          f"no-attack runs just before and after it; the median is shown\n")
    print(table)
    print(f"\nresults: {args.out}/results.json, table.md, logs/")
    return 0


if __name__ == "__main__":
    sys.exit(main())

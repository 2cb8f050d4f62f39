"""What moving bytes costs, read around one measurement: each guest's virtio-net
interrupts (its /proc/interrupts), kicks (``ethtool -S``), bytes (/proc/net/dev) and
its own account of its vCPU time (/proc/stat: user, system, irq, softirq, idle);
gsonet's kick wake-ups and calls per port; CPU seconds of gsonet and of each QEMU
process (/proc/PID/stat). ``per_gb`` divides the differences by the GB moved."""

from __future__ import annotations

import os
import re

from .guest import Guest

CLK_TCK = os.sysconf("SC_CLK_TCK")
GSONET_KEYS = ("tx_kicks", "rx_kicks", "tx_calls", "rx_calls")


def cpu_seconds(pid: int | None) -> float | None:
    """User + system CPU seconds of process ``pid`` (all its threads)."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    # fields[0] is field 3 (state); utime and stime are fields 14 and 15
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def parse_interrupts(text: str) -> dict[str, int]:
    """Sum of the virtio-net vectors of /proc/interrupts: "in" (…-input.N), "out"
    (…-output.N); a device without MSI-X shares one line, counted as "shared"."""
    out = {"in": 0, "out": 0, "shared": 0}
    for line in text.splitlines():
        name = line.split()[-1] if line.split() else ""
        m = re.match(r"^\s*\w+:\s+((?:\d+\s+)+)", line)
        if not m or "virtio" not in name:
            continue
        n = sum(int(x) for x in m.group(1).split())
        if "-input." in name:
            out["in"] += n
        elif "-output." in name:
            out["out"] += n
        elif re.fullmatch(r"virtio\d+", name):
            out["shared"] += n
    return out


def parse_ethtool_kicks(text: str) -> dict[str, int]:
    """Kicks from virtio_net's ``ethtool -S``, summed over queues: rxN_kicks and
    txN_kicks (rx_queue_N_kicks before Linux 6.10)."""
    kicks = {"rx": 0, "tx": 0}
    for m in re.finditer(r"^\s*(rx|tx)(?:_queue_)?\d+_kicks:\s+(\d+)", text, re.M):
        kicks[m.group(1)] += int(m.group(2))
    return kicks


def parse_net_dev(text: str, dev: str = "eth0") -> dict[str, int]:
    for line in text.splitlines():
        if line.strip().startswith(f"{dev}:"):
            f = line.split(":", 1)[1].split()
            return {"rx_bytes": int(f[0]), "rx_packets": int(f[1]),
                    "tx_bytes": int(f[8]), "tx_packets": int(f[9])}
    return {"rx_bytes": 0, "rx_packets": 0, "tx_bytes": 0, "tx_packets": 0}


# /proc/stat's cpu line, in the kernel's order (guest and guest_nice are inside user)
STAT_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def parse_proc_stat(text: str) -> dict[str, int]:
    """The guest's own account of its vCPU time, in USER_HZ ticks (the "cpu" line)."""
    for line in text.splitlines():
        f = line.split()
        if f and f[0] == "cpu":
            return dict(zip(STAT_FIELDS, map(int, f[1:9])))
    return dict.fromkeys(STAT_FIELDS, 0)


def guest_counters(g: Guest) -> dict:
    out = g.run_ok("cat /proc/interrupts; echo @@; ethtool -S eth0; echo @@; cat /proc/net/dev;"
                   " echo @@; cat /proc/stat")
    irq, kicks, dev, stat = (out.split("@@") + ["", "", ""])[:4]
    return {"irq": parse_interrupts(irq), "kicks": parse_ethtool_kicks(kicks),
            "bytes": parse_net_dev(dev), "stat": parse_proc_stat(stat)}


def gsonet_counters(gs) -> dict[str, int]:
    """Kicks and calls summed over gsonet's ports."""
    total = dict.fromkeys(GSONET_KEYS, 0)
    for p in gs.stats().get("ports", []):
        for k in GSONET_KEYS:
            total[k] += p["stats"].get(k, 0)
    return total


def host_busy_seconds() -> float:
    """CPU seconds the whole host spent not idle, over all its CPUs (its /proc/stat):
    guest-to-guest runs use every host CPU, so this, not one process, bounds them."""
    with open("/proc/stat") as f:
        t = parse_proc_stat(f.read())
    # steal is time this host's own CPUs were not running at all (it is a VM)
    return (sum(t.values()) - t["idle"] - t["iowait"] - t["steal"]) / CLK_TCK


def host_context_switches() -> int:
    """Context switches of the whole host so far (/proc/stat's ctxt): a request and
    its answer cost one per thread they wake on the way."""
    with open("/proc/stat") as f:
        for line in f:
            if line.startswith("ctxt "):
                return int(line.split()[1])
    return 0


class Snapshot:
    """Every counter at one instant: ``Snapshot.take(setup)``; ``b.minus(a)`` is the
    cost of what happened between a and b."""

    def __init__(self, guests: list[dict], gsonet: dict | None, cpu: dict):
        self.guests, self.gsonet, self.cpu = guests, gsonet, cpu

    @classmethod
    def take(cls, guests: list[Guest], gs=None) -> "Snapshot":
        cpu = {f"qemu{i}": cpu_seconds(g.proc.pid if g.proc else None)
               for i, g in enumerate(guests)}
        if gs is not None and gs.proc is not None:
            cpu["gsonet"] = cpu_seconds(gs.proc.pid)
        cpu["host"] = host_busy_seconds()
        return cls([guest_counters(g) for g in guests],
                   gsonet_counters(gs) if gs is not None else None, cpu)


def per_gb(a: Snapshot, b: Snapshot) -> dict:
    """Per GB moved between ``a`` and ``b``: each guest's interrupts in/out and kicks
    rx/tx, gsonet's kicks and calls (summed over ports), CPU seconds per process.
    GB moved is the largest byte count any guest's eth0 sent or received."""
    moved = 0
    for ga, gb in zip(a.guests, b.guests):
        for k in ("rx_bytes", "tx_bytes"):
            moved = max(moved, gb["bytes"][k] - ga["bytes"][k])
    gb_moved = moved / 1e9
    if gb_moved <= 0:
        return {"gb": 0.0}
    res: dict = {"gb": round(gb_moved, 4), "guests": []}
    for ga, gbb in zip(a.guests, b.guests):
        d = {f"irq_{k}": (gbb["irq"][k] - ga["irq"][k]) / gb_moved for k in ga["irq"]}
        d.update({f"kicks_{k}": (gbb["kicks"][k] - ga["kicks"][k]) / gb_moved
                  for k in ga["kicks"]})
        # frames as the guest's driver counts them: a GSO frame is one
        d.update({f"frames_{k}": (gbb["bytes"][f"{k}_packets"] - ga["bytes"][f"{k}_packets"])
                  / gb_moved for k in ("rx", "tx")})
        # where the guest's vCPU went, in seconds per GB (USER_HZ is 100 in the guest)
        ticks = {k: gbb["stat"][k] - ga["stat"][k] for k in STAT_FIELDS}
        d.update({f"cpu_{k}": ticks[k] / 100 / gb_moved
                  for k in ("user", "system", "irq", "softirq", "idle")})
        res["guests"].append({k: round(v, 3 if k.startswith("cpu_") else 1)
                              for k, v in d.items()})
    if a.gsonet is not None and b.gsonet is not None:
        res["gsonet"] = {k: round((b.gsonet[k] - a.gsonet[k]) / gb_moved, 1)
                         for k in GSONET_KEYS}
    res["cpu_s"] = {k: round((b.cpu[k] - a.cpu[k]) / gb_moved, 3)
                    for k in b.cpu if a.cpu.get(k) is not None and b.cpu[k] is not None}
    return res

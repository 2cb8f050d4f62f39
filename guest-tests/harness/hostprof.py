"""Where the whole host's CPU went during one measurement: `perf record -a` samples
every CPU, and each busy sample goes to a bucket by process (a guest's QEMU, the
backend's own process: gsonet or testpmd; anything else) and by code (user space or the host kernel working for it). For a TCG
guest, its QEMU process's user-space time is the guest running: the code TCG
generated, TCG's helpers and the device models. Guest-to-guest runs keep both host
CPUs busy, so these shares of the host's busy time say what each GB is made of."""

from __future__ import annotations

import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

BUCKETS = ("qemu_user", "qemu_kernel", "backend_user", "backend_kernel", "other")


def available() -> bool:
    return shutil.which("perf") is not None


class HostProfile:
    """``with HostProfile({"qemu": [pid, ...], "backend": [pid]}) as p: ...`` then
    ``p.shares``: each bucket's share of the busy samples (idle left out)."""

    def __init__(self, pids: dict[str, list[int]], hz: int = 199):
        self.pids = pids
        self.hz = hz
        self.shares: dict[str, float] | None = None
        self._dir = tempfile.TemporaryDirectory(prefix="gsonet-hostprof-")
        self._data = Path(self._dir.name) / "perf.data"
        self._proc: subprocess.Popen | None = None

    def __enter__(self) -> "HostProfile":
        self._proc = subprocess.Popen(
            ["perf", "record", "-a", "-F", str(self.hz), "-o", str(self._data)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return self

    def __exit__(self, *exc) -> None:
        try:
            if self._proc is not None:
                self._proc.send_signal(signal.SIGINT)
                self._proc.wait(timeout=60)
                self.shares = self._read()
        finally:
            self._dir.cleanup()

    def _read(self) -> dict[str, float] | None:
        out = subprocess.run(["perf", "script", "-i", str(self._data), "-F", "pid,ip,dso"],
                             capture_output=True, text=True).stdout
        return classify(out, self.pids)


def classify(script: str, pids: dict[str, list[int]]) -> dict[str, float] | None:
    """Shares of the busy samples of ``perf script -F pid,ip,dso`` output per bucket."""
    owner = {p: who for who, ps in pids.items() for p in ps if p}
    counts = dict.fromkeys(BUCKETS, 0)
    for line in script.splitlines():
        f = line.split(None, 2)
        if not f or not f[0].isdigit():
            continue
        pid = int(f[0])
        if pid == 0:
            continue  # the idle task
        kernel = "kernel.kallsyms" in line
        who = owner.get(pid)
        if who is None:
            counts["other"] += 1
        else:
            counts[f"{who}_{'kernel' if kernel else 'user'}"] += 1
    total = sum(counts.values())
    if total == 0:
        return None
    return {k: v / total for k, v in counts.items()}


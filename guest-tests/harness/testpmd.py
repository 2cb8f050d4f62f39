"""dpdk-testpmd driven on its interactive prompt: the one driver behind the DPDK
frontend tests (net_virtio_user) and the DPDK backend of the measurements (net_vhost)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
from pathlib import Path

from .hostnet import unique_name
from .paths import TESTPMD, open_log
from .process import HarnessError, Output

PROMPT = "testpmd> "
START_ERRORS = ("Fail to configure port", "Start ports failed", "Failed to", "EAL: Error",
                "Cannot")


class TestPmd:
    """One ``dpdk-testpmd --no-huge`` (or on hugepages) on two lcores with the given ``--vdev``s and
    application ``args`` after ``-- -i`` (context manager). Its stdin stays open (the
    prompt exits on EOF); ``cmd(line)`` runs one prompt command, ``stop()`` quits.

        with TestPmd("a", [f"net_virtio_user0,path={sock},queues=1"],
                     ["--forward-mode=txonly", "--auto-start"]) as tp:
            tp.port_stats()   # {"rx_packets": .., "tx_packets": .., ...}
    """

    __test__ = False  # not a pytest class

    def __init__(self, name: str, vdevs: list[str], args: list[str] | None = None, *,
                 log_dir: Path | str | None = None, hugepages: bool = False):
        self.name = name
        # Memory from hugetlbfs (one file per segment list, so that a vhost-user
        # frontend sends few regions) instead of --no-huge's 4 KiB pages.
        self.hugepages = hugepages
        self.vdevs = list(vdevs)
        self.args = list(args or [])
        self.prefix = unique_name("tp" + name)
        self.log_dir = log_dir
        self.proc: subprocess.Popen | None = None
        self.out: Output | None = None

    def cmdline(self) -> list[str]:
        memory = ["--in-memory", "--single-file-segments"] if self.hugepages else ["--no-huge"]
        cmd = ["stdbuf", "-oL", TESTPMD, *memory, "-m", "1024", "--no-pci", "-l", "0-1",
               "--file-prefix", self.prefix, "--log-level", "*:notice"]
        for v in self.vdevs:
            cmd += ["--vdev", v]
        return cmd + ["--", "-i", *self.args]

    def start(self, timeout: float = 60.0) -> "TestPmd":
        """Starts testpmd and waits for its first prompt; raises on a port or EAL error."""
        cmd = self.cmdline()
        log = open_log(f"testpmd-{self.name}", ".log", self.log_dir, " ".join(cmd))
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, bufsize=0,
                                     start_new_session=True)
        self.out = Output(f"testpmd {self.name}", self.proc, self.proc.stdout, log)
        try:
            self.wait_for(re.escape(PROMPT), 0, timeout)
            text = self.output()
            for bad in START_ERRORS:
                if bad in text:
                    raise HarnessError(f"testpmd {self.name}: {bad!r}:\n{text[-3000:]}")
        except Exception:
            self.kill()
            raise
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def output(self) -> str:
        return self.out.text() if self.out else ""

    def wait_for(self, pattern: str, start: int, timeout: float) -> re.Match:
        """The first match of ``pattern`` (re.S) in testpmd's output after ``start``."""
        assert self.out
        return self.out.wait_for(pattern, start, timeout)

    def cmd(self, line: str, timeout: float = 15.0) -> str:
        """Run one prompt command; returns its output (up to the next prompt)."""
        assert self.proc and self.proc.stdin
        start = len(self.output())
        self.proc.stdin.write(line.encode() + b"\n")
        self.proc.stdin.flush()
        m = self.wait_for(re.escape(PROMPT), start + 1, timeout)
        return self.output()[start:m.start()]

    def port_stats(self, port: int = 0) -> dict:
        out = self.cmd(f"show port stats {port}")
        m = re.search(r"RX-packets:\s*(\d+)\s+RX-missed:\s*(\d+)\s+RX-bytes:\s*(\d+).*?"
                      r"TX-packets:\s*(\d+)\s+TX-errors:\s*(\d+)\s+TX-bytes:\s*(\d+)", out, re.S)
        if not m:
            raise HarnessError(f"testpmd {self.name}: cannot parse port stats:\n{out}")
        keys = ("rx_packets", "rx_missed", "rx_bytes", "tx_packets", "tx_errors", "tx_bytes")
        return dict(zip(keys, map(int, m.groups())))

    def mac_addr(self, port: int = 0) -> str:
        out = self.cmd(f"show port info {port}")
        m = re.search(r"MAC address:\s*([0-9A-Fa-f:]{17})", out)
        if not m:
            raise HarnessError(f"testpmd {self.name}: no MAC in port info:\n{out}")
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
            except (HarnessError, OSError, subprocess.TimeoutExpired):
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
        if self.out:
            self.out.close()
        shutil.rmtree(f"/var/run/dpdk/{self.prefix}", ignore_errors=True)

    def __enter__(self) -> "TestPmd":
        if self.proc is None:
            self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

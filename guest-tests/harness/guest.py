"""A QEMU TCG guest booting the test image, driven over its serial console:
``run(cmd)`` returns (exit code, output); ethtool and listening-port helpers."""

from __future__ import annotations

import re
import subprocess
import time
import uuid
from pathlib import Path

from .paths import open_log
from .process import HarnessError, Output, WaitTimeout, stop
from .qemu import Machine, onoff

READY_MARK = "GSONET-GUEST-READY"


class Guest:
    """One guest (context manager): ``Guest(name, netdev, device_props, ip=...,
    ip6=..., smp=..., mac=...)``; the keyword arguments are those of qemu.Machine,
    and ``netns`` (QEMU runs in that network namespace).
    Console and QEMU logs go to ``log_dir`` (paths.LOG_DIR)."""

    def __init__(self, name: str, netdev: list[str] | None, device_props: dict | None = None,
                 *, log_dir: Path | str | None = None, netns: str | None = None, **machine):
        self.machine = Machine(name, netdev or [], device_props, **machine)
        self.netns = netns  # QEMU runs in this network namespace (its tap netdev there)
        self.name = name
        self.mac = self.machine.mac
        self.log_dir = log_dir
        self.proc: subprocess.Popen | None = None
        self.console: Output | None = None
        self._stderr: Output | None = None
        self.boot_seconds: float | None = None
        self._started_at = 0.0

    def cmdline(self) -> list[str]:
        prefix = ["ip", "netns", "exec", self.netns] if self.netns else []
        return prefix + self.machine.argv()

    def start(self) -> "Guest":
        m = self.machine
        if not (Path(m.kernel).exists() and Path(m.initrd).exists()):
            raise HarnessError(f"guest image missing ({m.kernel}); run scripts/setup.sh "
                               "or guest-tests/image/build.sh")
        cmd = self.cmdline()
        console_log = open_log(self.name, ".console.log", self.log_dir)
        qemu_log = open_log(self.name, ".qemu.log", self.log_dir, " ".join(cmd))
        self._started_at = time.monotonic()
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, bufsize=0, start_new_session=True)
        self.console = Output(self.name, self.proc, self.proc.stdout, console_log, strip_cr=True)
        self._stderr = Output(self.name, self.proc, self.proc.stderr, qemu_log)
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def qemu_stderr(self) -> str:
        return self._stderr.text() if self._stderr else ""

    def wait_socket(self, path: str, timeout: float = 30.0) -> None:
        """Wait until QEMU (a vhost-user server) has created its socket ``path``."""
        deadline = time.monotonic() + timeout
        while not Path(path).exists():
            if not self.alive() or time.monotonic() > deadline:
                raise HarnessError(f"{self.name}: no socket {path}\n"
                                   f"QEMU stderr:\n{self.qemu_stderr()[-2000:]}")
            time.sleep(0.05)

    def _wait_for(self, pattern: str, start: int, timeout: float) -> re.Match:
        assert self.console
        return self.console.wait_for(
            pattern, start, timeout, lambda: f"\nQEMU stderr:\n{self.qemu_stderr()[-2000:]}")

    def wait_booted(self, timeout: float = 180.0) -> float:
        """Wait for init's ready line and a responsive shell. Returns boot seconds."""
        if self.boot_seconds is None:
            self._wait_for(re.escape(READY_MARK), 0, timeout)
            self.boot_seconds = time.monotonic() - self._started_at
            # quiet prompts; make sure the shell answers
            self.run("PS1=''; PS2=''; stty -echo 2>/dev/null; true", timeout=60)
        return self.boot_seconds

    def _send(self, text: str) -> None:
        if not self.alive():
            raise HarnessError(f"{self.name}: QEMU is not running")
        assert self.proc and self.proc.stdin
        data = text.encode()
        # the tty line buffer holds 4095 bytes; feed it in pieces
        for i in range(0, len(data), 1024):
            self.proc.stdin.write(data[i : i + 1024])
            self.proc.stdin.flush()

    def run(self, cmd: str, timeout: float = 60.0, check: bool = False) -> tuple[int, str]:
        """Run a shell command on the guest console; returns (exit code, output).

        stdin is /dev/null, stderr is merged into the output. On timeout, ^C is
        sent and WaitTimeout raised. check=True raises HarnessError on rc != 0.

        Whatever runs on after the command goes in a subshell (`(cmd &)`) or its own
        session (`setsid`), never as a job of the console's shell (`cmd &`). When
        such a job ends, busybox ash waiting for input exits (init starts another
        shell, and a command sent meanwhile is lost), and ash reading a command's
        second line takes the line as ended ("syntax error: unexpected end of file
        (expecting "}")"). A job ending 0.2 s after it started made the shell exit
        in 20 of 20 rounds with nothing sent, and cut a command in 10 of 30 with
        `true` sent meanwhile, on the 6.1 and the 6.12 guest alike; in a subshell,
        in none. udp_recv as such a job is what killed the 6.1 guest's shell in
        test_uso_properties_and_udp_segment. A command that leaves such a job
        raises HarnessError.
        """
        assert self.console
        tag = uuid.uuid4().hex[:12]
        # Quotes split the markers so an echoed command line never matches. The
        # shell's jobs are listed after the command (ash's `jobs` in a command
        # substitution lists the shell's own): any means a job was left.
        line = (f"echo '@@S''{tag}'; {{ {cmd}\n}} </dev/null 2>&1; set -- $? $(jobs -p); "
                f"[ $# -gt 1 ] && echo '@@J''{tag}'; echo '@@E''{tag}':$1\n")
        start = len(self.console.text())
        self._send(line)
        m_start = self._wait_for(rf"@@S{tag}\n", start, timeout)
        try:
            m_end = self._wait_for(rf"@@E{tag}:(\d+)\n", m_start.end(), timeout)
        except WaitTimeout:
            try:
                self._send("\x03")
            except HarnessError:
                pass
            raise WaitTimeout(
                f"{self.name}: command timed out after {timeout}s: {cmd}\n"
                f"partial output:\n{self.console.text()[m_start.end():][-2000:]}")
        out = self.console.text()[m_start.end() : m_end.start()]
        rc = int(m_end.group(1))
        if f"@@J{tag}\n" in out:
            raise HarnessError(f"{self.name}: `{cmd}` left a job of the console's shell; "
                               "start it in a subshell, `(cmd &)` (see Guest.run)")
        if check and rc != 0:
            raise HarnessError(f"{self.name}: `{cmd}` failed rc={rc}:\n{out}")
        return rc, out

    def run_ok(self, cmd: str, timeout: float = 60.0) -> str:
        return self.run(cmd, timeout=timeout, check=True)[1]

    def ethtool_features(self, dev: str = "eth0") -> dict[str, str]:
        """`ethtool -k` as {feature: "on"|"off"} ("[fixed]" dropped)."""
        feats = {}
        for line in self.run_ok(f"ethtool -k {dev}").splitlines():
            m = re.match(r"^\s*([\w-]+):\s+(on|off)", line)
            if m:
                feats[m.group(1)] = m.group(2)
        return feats

    def ethtool_set(self, dev: str = "eth0", **features) -> None:
        """ethtool -K: guest.ethtool_set(tso=False, gso=False)."""
        args = " ".join(f"{k.replace('_', '-')} {onoff(v)}" for k, v in features.items())
        self.run_ok(f"ethtool -K {dev} {args}")

    def wait_listening(self, port: int, tries: int = 100) -> bool:
        """True once a TCP socket listens on ``port`` in the guest (0.1 s between tries)."""
        for _ in range(tries):
            if self.run(f"netstat -ltn | grep -q ':{port} '")[0] == 0:
                return True
            time.sleep(0.1)
        return False

    def shutdown(self) -> None:
        """Stop QEMU (always kills it) and close the logs."""
        if self.proc is not None:
            stop(self.proc)
            for s in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
                try:
                    if s:
                        s.close()
                except OSError:
                    pass
        for out in (self.console, self._stderr):
            if out:
                out.close()

    def __enter__(self) -> "Guest":
        if self.proc is None:
            self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __del__(self):
        try:
            if self.proc is not None and self.proc.poll() is None:
                self.proc.kill()
        except Exception:
            pass

"""Child processes of the harness: what they write, collected and waited on (guest
consoles, testpmd prompts), the harness's errors, and stopping a child."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import threading
import time
from typing import IO, Callable


class HarnessError(Exception):
    """A guest, gsonet, testpmd or a measurement did not do what was asked."""


class WaitTimeout(HarnessError):
    """An expected output did not show up in time."""


class Output:
    """Everything a child writes on one pipe, read by a thread into a buffer and a log
    file; ``wait_for`` blocks until a pattern shows up after a given offset."""

    def __init__(self, name: str, proc: subprocess.Popen, stream: IO[bytes],
                 log: IO[str] | None = None, strip_cr: bool = False):
        self.name = name
        self.proc = proc
        self._buf = ""
        self._cond = threading.Condition()
        self._log = log
        self._strip_cr = strip_cr
        self._thread = threading.Thread(target=self._pump, args=(stream.fileno(),), daemon=True)
        self._thread.start()

    def _pump(self, fd: int) -> None:
        while True:
            try:
                data = os.read(fd, 65536)
            except OSError:
                data = b""
            if not data:
                break
            text = data.decode("utf-8", errors="replace")
            if self._strip_cr:
                text = text.replace("\r", "")
            if self._log:
                try:
                    self._log.write(text)
                    self._log.flush()
                except ValueError:  # closed by close() while the child still writes
                    pass
            with self._cond:
                self._buf += text
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def text(self) -> str:
        with self._cond:
            return self._buf

    def wait_for(self, pattern: str | re.Pattern, start: int = 0, timeout: float = 60.0,
                 context: Callable[[], str] | None = None) -> re.Match:
        """The first match of ``pattern`` (a string is compiled with re.S) at or after
        ``start``. Raises HarnessError when the child exits without it, WaitTimeout
        after ``timeout`` seconds; ``context()`` is added to either message."""
        rx = re.compile(pattern, re.S) if isinstance(pattern, str) else pattern
        more = context or (lambda: "")
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                m = rx.search(self._buf, start)
                if m:
                    return m
                if self.proc.poll() is not None:
                    # drain: the reader may still be appending the last bytes
                    self._cond.wait(0.2)
                    m = rx.search(self._buf, start)
                    if m:
                        return m
                    raise HarnessError(f"{self.name} exited rc={self.proc.returncode}{more()}"
                                       f"\noutput tail:\n{self._buf[-3000:]}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise WaitTimeout(f"{self.name}: no {rx.pattern!r} after {timeout}s"
                                      f"{more()}\noutput tail:\n{self._buf[-2000:]}")
                self._cond.wait(min(left, 0.5))

    def close(self) -> None:
        """Wait briefly for the reader (the pipe is closed or the child gone), close the log."""
        self._thread.join(timeout=2)
        if self._log:
            try:
                self._log.close()
            except OSError:
                pass
            self._log = None


def stop(proc: subprocess.Popen | None, timeout: float = 5.0) -> None:
    """SIGTERM, then SIGKILL if the child is still there after ``timeout`` seconds."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=timeout)


def connect_unix(path: str, timeout: float = 30.0) -> socket.socket:
    """A connected Unix stream socket to ``path``, retried until a child (QEMU's
    monitor or QMP) has created and is listening on it, for at most ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        sock = socket.socket(socket.AF_UNIX)
        try:
            sock.connect(path)
            return sock
        except OSError:
            sock.close()
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)

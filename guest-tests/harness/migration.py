"""Live migration in the tests: a minimal QMP client, a guest with a QMP socket and
more QEMU arguments (``-incoming defer`` for a destination), and the migration itself
(``migrate``, ``wait_resumed``)."""

from __future__ import annotations

import json
import time

from .guest import Guest
from .process import HarnessError, connect_unix


class Qmp:
    """A minimal QMP client on a Unix socket: commands and the events seen so far."""

    def __init__(self, path: str, timeout: float = 30.0):
        self.sock = connect_unix(path, timeout)
        self.sock.settimeout(timeout)
        self.file = self.sock.makefile("rwb")
        self.events: list[dict] = []
        json.loads(self.file.readline())  # greeting
        self.cmd("qmp_capabilities")

    def cmd(self, name: str, **args) -> dict:
        msg = {"execute": name}
        if args:
            msg["arguments"] = args
        self.file.write(json.dumps(msg).encode() + b"\n")
        self.file.flush()
        while True:
            r = json.loads(self.file.readline())
            if "event" in r:
                self.events.append(r)
                continue
            if "error" in r:
                raise HarnessError(f"QMP {name}: {r['error']}")
            return r["return"]

    def event_time(self, name: str) -> float | None:
        for e in self.events:
            if e["event"] == name:
                ts = e["timestamp"]
                return ts["seconds"] + ts["microseconds"] / 1e6
        return None

    def close(self) -> None:
        try:
            self.file.close()
            self.sock.close()
        except OSError:
            pass


class MigGuest(Guest):
    """A test guest with a QMP socket and more QEMU arguments."""

    def __init__(self, name: str, netdev: list[str], qmp: str, extra: list[str] | None = None,
                 **kw):
        super().__init__(name, netdev, **kw)
        self.qmp_path = qmp
        self.extra = list(extra or [])

    def cmdline(self) -> list[str]:
        return super().cmdline() + ["-qmp", f"unix:{self.qmp_path},server=on,wait=off"] + self.extra


def migrate(qs: Qmp, uri: str, guests: tuple[Guest, ...] = (), timeout: float = 240.0) -> dict:
    """QMP ``migrate`` to ``uri`` (the destination already listens there, through
    ``migrate-incoming``) and wait until the source reports it completed. Returns the
    last ``query-migrate`` answer (downtime, total-time); a failed, cancelled or late
    migration raises AssertionError with the QEMU stderr of ``guests``."""
    qs.cmd("migrate", uri=uri)
    deadline = time.monotonic() + timeout
    while True:
        info = qs.cmd("query-migrate")
        if info.get("status") == "completed":
            return info
        if info.get("status") in ("failed", "cancelled") or time.monotonic() > deadline:
            tails = "".join(f"\n{g.name}: {g.qemu_stderr()[-2000:]}" for g in guests)
            raise AssertionError(f"migration {info}{tails}")
        time.sleep(0.2)


def wait_resumed(qd: Qmp, timeout: float = 60.0) -> float:
    """The time (host clock, from QEMU's event) at which the destination resumed the
    guest: it does so by itself (autostart) once the migration completes."""
    deadline = time.monotonic() + timeout
    while qd.event_time("RESUME") is None:
        assert time.monotonic() < deadline, f"no RESUME on the destination: {qd.events}"
        qd.cmd("query-status")
        time.sleep(0.05)
    return qd.event_time("RESUME")

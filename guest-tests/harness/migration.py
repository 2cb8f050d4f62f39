"""Live migration in the tests: a minimal QMP client and a guest with a QMP socket
and more QEMU arguments (``-incoming defer`` for a destination)."""

from __future__ import annotations

import json

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

"""A `gsonet serve` process for tests and measurements: started and waited for,
its stats and ctl, and waiting for a port's frontend to connect or leave."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from .hostnet import link_exists
from .paths import GSONET_BIN, open_log
from .process import HarnessError, stop


def _spec(spec: str) -> dict[str, str]:
    """'socket=PATH,client,queues=2' as {"socket": PATH, "client": "", "queues": "2"}."""
    return dict(item.partition("=")[::2] for item in spec.split(","))


# Puts the inherited sockets at fd 3.. and execs gsonet with LISTEN_PID set to itself.
_ACTIVATE = """
import os, sys
fds = [int(f) for f in sys.argv[1].split(",")]
moved = [os.dup(f) for f in fds]
for i, f in enumerate(moved):
    if f != 3 + i:
        os.dup2(f, 3 + i)
    os.set_inheritable(3 + i, True)
for f in set(fds + moved) - set(range(3, 3 + len(fds))):
    os.close(f)
os.environ["LISTEN_PID"] = str(os.getpid())
os.execvp(sys.argv[2], sys.argv[2:])
"""


class Gsonet:
    """A `gsonet serve` process (context manager).

        with Gsonet([f"socket={sock}"], [f"tap={tap}"], workdir=d) as gs:
            set_addr(tap, "10.77.5.1/24")
            gs.wait_port(0)
            gs.stats()["ports"][0]["stats"]["gso_passed"]

    ports / uplinks: the --port / --uplink specs; extra: more serve arguments
    (e.g. ``["--metrics", "127.0.0.1:9477"]``); transient_taps: give each tap uplink
    without a ``persist=`` option ``persist=off``, so a test leaves no tap behind;
    inherit: listening sockets handed over as a service manager does (LISTEN_FDS from
    fd 3, LISTEN_PID the gsonet process), which the caller keeps across restarts;
    netns: run gsonet in that network namespace (`ip netns exec`), its taps there.
    ``start()`` waits for the control socket, the listening sockets (client-mode ports
    only connect once QEMU's server socket exists) and the taps. Output goes to
    ``log_path``.
    """

    def __init__(self, ports: list[str], uplinks: list[str] | None = None, *,
                 workdir: str | os.PathLike, binary: str | None = None,
                 name: str = "gsonet", log_dir: Path | str | None = None,
                 extra: list[str] | None = None, transient_taps: bool = True,
                 inherit: list[socket.socket] | None = None, netns: str | None = None):
        self.ports = list(ports)
        self.extra = list(extra or [])
        self.uplinks = list(uplinks or [])
        self.transient_taps = transient_taps
        self.inherit = list(inherit or [])
        self.netns = netns
        self.workdir = Path(workdir)
        self.binary = binary or GSONET_BIN
        self.control = self.workdir / "control.sock"
        self.name = name
        self.log_dir = log_dir
        self.proc: subprocess.Popen | None = None
        self.log_path: Path | None = None
        self._log = None

    def cmdline(self) -> list[str]:
        cmd = ["ip", "netns", "exec", self.netns] if self.netns else []
        cmd += [self.binary, "serve"]
        for p in self.ports:
            cmd += ["--port", p]
        for u in self.uplinks:
            # A test's tap goes with its gsonet unless the test asks for persistence
            # (gsonet keeps taps by default, for restarts).
            if self.transient_taps and u.startswith("tap=") and "persist=" not in u:
                u += ",persist=off"
            cmd += ["--uplink", u]
        return cmd + ["--control", str(self.control)] + self.extra

    def start(self, timeout: float = 15.0) -> "Gsonet":
        if not os.access(self.binary, os.X_OK):
            raise HarnessError(f"gsonet binary {self.binary} missing (cargo build --release)")
        self.workdir.mkdir(parents=True, exist_ok=True)
        cmd = self.cmdline()
        self._log = open_log(self.name, ".gsonet.log", self.log_dir, " ".join(cmd))
        self.log_path = Path(self._log.name)
        env = dict(os.environ)
        env.setdefault("RUST_LOG", "gsonet=info")
        env["NO_COLOR"] = "1"
        fds = tuple(s.fileno() for s in self.inherit)
        if fds:
            env["LISTEN_FDS"] = str(len(fds))
            cmd = [sys.executable, "-c", _ACTIVATE, ",".join(map(str, fds)), *cmd]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=self._log,
                                     stderr=subprocess.STDOUT, env=env, pass_fds=fds,
                                     start_new_session=True)
        specs = [_spec(p) for p in self.ports]
        waits = [self.control] + [Path(s["socket"]) for s in specs if "client" not in s]
        taps = [s["tap"] for s in map(_spec, self.uplinks) if "tap" in s]
        deadline = time.monotonic() + timeout
        while not (all(w.exists() for w in waits) and all(link_exists(t, self.netns) for t in taps)):
            if self.proc.poll() is not None:
                raise HarnessError(f"gsonet exited rc={self.proc.returncode}:\n"
                                   f"{self.log()[-2000:]}")
            if time.monotonic() > deadline:
                raise HarnessError(f"gsonet not ready after {timeout}s:\n{self.log()[-2000:]}")
            time.sleep(0.05)
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace") if self.log_path else ""
        except OSError:
            return ""

    def _cli(self, *args: str) -> subprocess.CompletedProcess:
        """`gsonet ARGS[0] --control CONTROL ARGS[1:]`."""
        return subprocess.run([self.binary, args[0], "--control", str(self.control), *args[1:]],
                              capture_output=True, text=True, timeout=10)

    def stats(self) -> dict:
        """`gsonet stats --json` as a dict: {"ports": [...], "uplinks": [...]}."""
        p = self._cli("stats", "--json")
        if p.returncode != 0:
            raise HarnessError(f"gsonet stats failed rc={p.returncode}: {p.stderr}")
        return json.loads(p.stdout)

    def stats_text(self) -> str:
        return self._cli("stats").stdout

    def ctl(self, target: str, *settings: str) -> dict:
        """`gsonet ctl TARGET KEY=VALUE...`; raises on a refusal."""
        p = self._cli("ctl", target, *settings)
        if p.returncode != 0:
            raise HarnessError(f"gsonet ctl {target} {settings} failed rc={p.returncode}: "
                               f"{p.stderr}")
        return json.loads(p.stdout)

    def port_stats(self, i: int = 0) -> dict:
        return self.stats()["ports"][i]

    def wait_port(self, i: int, connected: bool = True, timeout: float = 30.0) -> dict:
        """Port ``i``'s stats once its frontend is connected and has negotiated
        features (``connected=True``), or once it is gone (``False``)."""
        deadline = time.monotonic() + timeout
        while True:
            p = self.port_stats(i)
            if p["connected"] == connected and (not connected or p["guest_rx"] is not None):
                return p
            if time.monotonic() > deadline:
                raise AssertionError(f"port {i} connected={p['connected']}, wanted {connected}:"
                                     f"\n{self.stats_text()}\n{self.log()[-2000:]}")
            time.sleep(0.1)

    def stop(self) -> None:
        stop(self.proc)
        if self._log:
            self._log.close()
            self._log = None

    def __enter__(self) -> "Gsonet":
        if self.proc is None:
            self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def counters_delta(before: dict, after: dict) -> dict:
    """after - before for the numeric counters of one stats snapshot (max/min kept
    from ``after``); drops as a dict of the non-zero differences."""
    out = {}
    for k, v in after.items():
        if k == "drops":
            out[k] = {r: n - before.get(k, {}).get(r, 0) for r, n in v.items()
                      if n - before.get(k, {}).get(r, 0)}
        elif k.startswith(("max_", "min_", "tx_max")):
            out[k] = v
        else:
            out[k] = v - before.get(k, 0)
    return out

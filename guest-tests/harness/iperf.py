"""iperf3 TCP throughput in Gbit/s as received: the server in a guest or on the host,
the client on the host or in a guest."""

from __future__ import annotations

import json
import socket
import subprocess
import time

from .guest import Guest
from .process import HarnessError, stop


def _gbps(result: dict) -> float:
    end = result.get("end", {})
    for key in ("sum_received", "sum"):
        if key in end and "bits_per_second" in end[key]:
            return end[key]["bits_per_second"] / 1e9
    raise HarnessError(f"iperf3: no result: {json.dumps(result)[:500]}")


def iperf3_guest_server(guest: Guest, port: int = 5201) -> None:
    """(Re)starts ``iperf3 -s -D`` in the guest and waits until it listens."""
    guest.run("killall iperf3 2>/dev/null; true")
    guest.run_ok(f"iperf3 -s -D -p {port}")
    if not guest.wait_listening(port):
        raise HarnessError(f"{guest.name}: iperf3 server did not start")


def iperf3_host_client(server_ip: str, seconds: float = 3, reverse: bool = False,
                       port: int = 5201, retries: int = 3) -> float:
    """Host iperf3 client against a server in a guest. reverse=False: host->guest;
    reverse=True (-R): guest->host. Control-channel failures (a server still closing
    the previous test) are retried."""
    cmd = ["iperf3", "-c", server_ip, "-p", str(port), "-t", str(seconds), "-J"]
    if reverse:
        cmd.append("-R")
    last = ""
    for attempt in range(retries):
        if attempt:
            time.sleep(1.0)
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds * 4 + 60)
        try:
            result = json.loads(p.stdout)
        except json.JSONDecodeError:
            last = f"iperf3 failed rc={p.returncode}: {p.stdout[-1000:]} {p.stderr[-1000:]}"
            continue
        if "error" in result:
            last = f"iperf3: {result['error']}"
            continue
        return _gbps(result)
    raise HarnessError(last)


def iperf3_guest_client(guest: Guest, server_ip: str, seconds: float = 3,
                        reverse: bool = False, port: int = 5201, extra: str = "") -> float:
    """iperf3 client in a guest (server on the host or in another guest).
    reverse=False: the guest sends."""
    return _gbps(iperf3_guest_client_json(guest, server_ip, seconds, reverse, port, extra))


def iperf3_guest_client_json(guest: Guest, server_ip: str, seconds: float = 3,
                             reverse: bool = False, port: int = 5201, extra: str = "") -> dict:
    """`iperf3_guest_client`'s whole result (``end.sum_sent.retransmits``: the
    sender's TCP retransmits)."""
    r = "-R" if reverse else ""
    rc, out = guest.run(f"iperf3 -c {server_ip} -p {port} -t {seconds} -J {r} {extra}",
                        timeout=seconds * 4 + 60)
    try:
        result = json.loads(out[out.find("{"):])
    except (json.JSONDecodeError, ValueError):
        raise HarnessError(f"iperf3 in {guest.name} rc={rc}: {out[-1000:]}")
    if "error" in result:
        raise HarnessError(f"iperf3 in {guest.name}: {result['error']}")
    return result


class HostIperfServer:
    """iperf3 -s on the host (context manager), for guest-client measurements."""

    def __init__(self, bind: str | None = None, port: int = 5201):
        self.bind, self.port = bind, port
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "HostIperfServer":
        cmd = ["iperf3", "-s", "-p", str(self.port)]
        if self.bind:
            cmd += ["-B", self.bind]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex((self.bind or "127.0.0.1", self.port)) == 0:
                    break
            time.sleep(0.05)
        return self

    def __exit__(self, *exc) -> None:
        stop(self.proc)

"""Bulk transfers of random data with md5 on both ends: guest->host and host->guest
through a one-shot host socket, guest->guest with busybox nc."""

from __future__ import annotations

import hashlib
import os
import socket
import threading
import time

from .guest import Guest
from .process import HarnessError

MIB = 1048576


class OneShotServer:
    """Accepts one TCP connection on (bind, port 0); either receives until EOF
    (recording md5 and length) or sends ``payload`` and closes. ``gap`` > 0 sends
    the payload in 64 KiB pieces that many seconds apart (a transfer that is still
    running while something else happens, e.g. a migration)."""

    def __init__(self, bind: str, payload: bytes | None = None, timeout: float = 300,
                 gap: float = 0.0):
        fam = socket.AF_INET6 if ":" in bind else socket.AF_INET
        self.sock = socket.socket(fam, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((bind, 0))
        self.sock.listen(1)
        self.sock.settimeout(timeout)
        self.port = self.sock.getsockname()[1]
        self.payload = payload
        self.gap = gap
        self.md5 = None
        self.length = 0
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        try:
            conn, _ = self.sock.accept()
            conn.settimeout(self.sock.gettimeout())
            with conn:
                if self.payload is None:
                    h = hashlib.md5()
                    while b := conn.recv(1 << 20):
                        h.update(b)
                        self.length += len(b)
                    self.md5 = h.hexdigest()
                else:
                    step = 65536 if self.gap > 0 else max(len(self.payload), 1)
                    for i in range(0, len(self.payload), step):
                        conn.sendall(self.payload[i:i + step])
                        if self.gap > 0:
                            time.sleep(self.gap)
                    conn.shutdown(socket.SHUT_WR)
                    while conn.recv(65536):  # wait for the peer to close
                        pass
        except BaseException as e:  # noqa: BLE001 - reported to the caller
            self.error = e
        finally:
            self.sock.close()

    def join(self, timeout: float) -> None:
        self.thread.join(timeout)
        if self.thread.is_alive():
            raise HarnessError("file transfer server still running")
        if self.error:
            raise HarnessError(f"file transfer server: {self.error!r}")


def _md5(guest: Guest, path: str, timeout: float = 300) -> str:
    return guest.run_ok(f"md5sum {path}", timeout=timeout).split()[0]


def _size(guest: Guest, path: str) -> int:
    return int(guest.run_ok(f"wc -c < {path}").strip())


def _random_file(guest: Guest, path: str, mib: int, timeout: float) -> str:
    """``mib`` MiB from /dev/urandom at ``path`` in the guest's tmpfs; returns its md5."""
    guest.run_ok(f"head -c {mib * MIB} /dev/urandom > {path}", timeout=timeout)
    return _md5(guest, path, timeout)


def transfer_guest_to_host(guest: Guest, host_ip: str, mib: int = 32,
                           timeout: float = 600) -> dict:
    """A random file made in the guest, sent with busybox nc to a host socket.
    Returns {"ok", "guest_md5", "host_md5", "bytes", "seconds"}."""
    path = "/tmp/xfer.out"
    gmd5 = _random_file(guest, path, mib, timeout)
    srv = OneShotServer(host_ip, None, timeout=timeout)
    t0 = time.monotonic()
    guest.run_ok(f"nc {host_ip} {srv.port} < {path}", timeout=timeout)
    srv.join(timeout=30)
    secs = time.monotonic() - t0
    guest.run(f"rm -f {path}")
    return {"ok": srv.md5 == gmd5 and srv.length == mib * MIB,
            "guest_md5": gmd5, "host_md5": srv.md5, "bytes": srv.length, "seconds": secs}


def transfer_host_to_guest(guest: Guest, host_ip: str, mib: int = 32,
                           timeout: float = 600) -> dict:
    """Random data from a host socket, fetched by the guest with busybox nc into
    tmpfs. Same result dict as transfer_guest_to_host."""
    path = "/tmp/xfer.in"
    payload = os.urandom(mib * MIB)
    hmd5 = hashlib.md5(payload).hexdigest()
    srv = OneShotServer(host_ip, payload, timeout=timeout)
    t0 = time.monotonic()
    guest.run_ok(f"nc {host_ip} {srv.port} </dev/null > {path}", timeout=timeout)
    srv.join(timeout=30)
    secs = time.monotonic() - t0
    gmd5 = _md5(guest, path, timeout)
    size = _size(guest, path)
    guest.run(f"rm -f {path}")
    return {"ok": gmd5 == hmd5 and size == len(payload),
            "guest_md5": gmd5, "host_md5": hmd5, "bytes": size, "seconds": secs}


def transfer_guest_to_guest(src: Guest, dst: Guest, dst_ip: str, mib: int = 32,
                            port: int = 5301, timeout: float = 600) -> dict:
    """A random file from ``src``'s tmpfs to ``dst`` (``nc -l -p PORT`` there).
    Returns {"ok", "src_md5", "dst_md5", "bytes", "seconds"}."""
    spath, dpath = "/tmp/g2g.out", "/tmp/g2g.in"
    smd5 = _random_file(src, spath, mib, timeout)
    dst.run(f"rm -f {dpath} {dpath}.done")
    # The listener runs in its own session (setsid), not as a job of the console
    # shell. busybox nc exits as soon as the peer half-closes, so its stdin must
    # stay open (a pipe from sleep), or the sender would quit mid-file.
    dst.run_ok(f"setsid sh -c 'sleep 3600 | {{ nc -l -p {port} > {dpath}; touch {dpath}.done; }}'"
               " >/dev/null 2>&1")
    dst.wait_listening(port)
    t0 = time.monotonic()
    src.run_ok(f"nc {dst_ip} {port} < {spath}", timeout=timeout)
    # the listener exits when the sender closes
    dst.run_ok(f"i=0; while [ ! -e {dpath}.done ] && [ $i -lt 300 ]; do usleep 100000;"
               f" i=$((i+1)); done; killall sleep 2>/dev/null; [ -e {dpath}.done ]",
               timeout=60)
    secs = time.monotonic() - t0
    dmd5 = _md5(dst, dpath, timeout)
    size = _size(dst, dpath)
    src.run(f"rm -f {spath}")
    dst.run(f"rm -f {dpath} {dpath}.done")
    return {"ok": smd5 == dmd5 and size == mib * MIB,
            "src_md5": smd5, "dst_md5": dmd5, "bytes": size, "seconds": secs}

"""QEMU guest harness for gsonet's guest tests and demo (stdlib only).

A Guest is a TCG QEMU VM booting the image built by guest-tests/image/build.sh
(6.12 kernel + busybox initramfs) with one virtio-net-pci NIC attached to any
netdev: gsonet over vhost-user, or QEMU's built-in tap backend. Its serial
console is a pipe this module drives: ``run(cmd)`` returns (rc, output).

    with Guest("vm1", Guest.tap("gsntap0"), ip="10.77.0.2/24") as g:
        g.wait_booted()
        rc, out = g.run("ethtool -k eth0")

Host helpers create taps and bridges, run iperf3 and move files with md5 checks.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import os
import re
import shutil
import socket
import subprocess
import threading
import time
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
CACHE = HERE / ".cache"
KERNEL = CACHE / "bzImage"
INITRD = CACHE / "initramfs.cpio.gz"
LOG_DIR = Path(os.environ.get("GSONET_LOG_DIR", REPO / "results" / "guest-logs"))
QEMU = os.environ.get("GSONET_QEMU", "qemu-system-x86_64")

READY_MARK = "GSONET-GUEST-READY"


class GuestError(Exception):
    pass


class GuestTimeout(GuestError):
    pass


def build_image() -> None:
    """Build (or confirm up to date) the guest kernel + initramfs."""
    subprocess.run([str(HERE / "image" / "build.sh")], check=True)


def image_ready() -> bool:
    return KERNEL.exists() and INITRD.exists()


def _mac_for(name: str) -> str:
    h = hashlib.sha256(name.encode()).digest()
    return "52:54:00:%02x:%02x:%02x" % (h[0], h[1], h[2])


def _prop(v) -> str:
    if v is True:
        return "on"
    if v is False:
        return "off"
    return str(v)


def pump_output(fd: int, into, strip_cr: bool = False) -> None:
    """Reads a child's output until EOF into ``into._buf`` (under ``into._cond``,
    waking waiters) and its ``into._log`` file, if open. Guest consoles and testpmd
    prompts are read this way."""
    while True:
        try:
            data = os.read(fd, 65536)
        except OSError:
            data = b""
        if not data:
            break
        text = data.decode("utf-8", errors="replace")
        if strip_cr:
            text = text.replace("\r", "")
        if into._log:
            try:
                into._log.write(text)
                into._log.flush()
            except ValueError:
                pass
        with into._cond:
            into._buf += text
            into._cond.notify_all()
    with into._cond:
        into._cond.notify_all()


class Guest:
    """One QEMU TCG guest with one virtio-net-pci NIC (netdev id ``n0``).

    netdev_args: QEMU arguments defining netdev ``n0`` (see ``Guest.vhost_user``
    and ``Guest.tap``), or None/[] for no NIC.
    device_props: extra virtio-net-pci properties, e.g. {"host_tso4": False,
    "guest_uso4": True}; booleans become on/off. They override the defaults
    (mrg_rxbuf=on, rx_queue_size=1024, and tx_queue_size=1024 on vhost-user
    netdevs: QEMU 10 rejects tx_queue_size > 256 for other backends).
    ip / ip6: guest eth0 addresses ("10.77.0.2/24", "fd00:77::2/64").
    """

    DEFAULT_DEVICE_PROPS = {
        "mrg_rxbuf": True,
        "rx_queue_size": 1024,
        "tx_queue_size": 1024,
    }

    def __init__(
        self,
        name: str,
        netdev_args: list[str] | None,
        device_props: dict | None = None,
        mem: str = "512M",
        smp: int = 1,
        *,
        mac: str | None = None,
        ip: str | None = None,
        ip6: str | None = None,
        gw: str | None = None,
        mtu: int | None = None,
        append: str = "",
        extra_args: list[str] | None = None,
        cpu: str = "qemu64",
        log_dir: Path | str | None = None,
        kernel: Path | str | None = None,
        initrd: Path | str | None = None,
        qemu: str | None = None,
    ):
        self.name = name
        self.netdev_args = list(netdev_args or [])
        self.device_props = dict(self.DEFAULT_DEVICE_PROPS)
        if not any(a.startswith("vhost-user") for a in self.netdev_args):
            del self.device_props["tx_queue_size"]
        self.device_props.update(device_props or {})
        self.mem = mem
        self.smp = smp
        self.mac = mac or _mac_for(name)
        self.ip = ip
        self.ip6 = ip6
        self.gw = gw
        self.mtu = mtu
        self.append = append
        self.extra_args = list(extra_args or [])
        self.cpu = cpu
        self.kernel = Path(kernel or KERNEL)
        self.initrd = Path(initrd or INITRD)
        self.qemu = qemu or QEMU
        self.log_dir = Path(log_dir or LOG_DIR)
        self.proc: subprocess.Popen | None = None
        self.boot_seconds: float | None = None
        self._buf = ""
        self._cond = threading.Condition()
        self._reader: threading.Thread | None = None
        self._err_reader: threading.Thread | None = None
        self._log = None
        self._qemu_log = None
        self._started_at = 0.0
        self._booted = False
        self._workdir: Path | None = None
        self.qmp_path: Path | None = None

    # ---- netdev builders -------------------------------------------------

    @staticmethod
    def vhost_user(
        socket_path: str | os.PathLike,
        *,
        server: bool = False,
        queues: int | None = None,
        reconnect_ms: int | None = None,
        chardev_id: str = "c0",
        netdev_id: str = "n0",
    ) -> list[str]:
        """-chardev socket + -netdev vhost-user. server=False: QEMU connects to
        the backend's listening socket (gsonet serve --port socket=...)."""
        chardev = f"socket,id={chardev_id},path={os.fspath(socket_path)}"
        if server:
            chardev += ",server=on,wait=off"
        elif reconnect_ms is not None:
            chardev += f",reconnect-ms={reconnect_ms}"
        netdev = f"vhost-user,id={netdev_id},chardev={chardev_id}"
        if queues:
            netdev += f",queues={queues}"
        return ["-chardev", chardev, "-netdev", netdev]

    @staticmethod
    def tap(ifname: str, *, netdev_id: str = "n0", vhost: bool = False) -> list[str]:
        """QEMU's built-in tap backend on an existing (or new) tap ``ifname``."""
        v = "on" if vhost else "off"
        return [
            "-netdev",
            f"tap,id={netdev_id},ifname={ifname},script=no,downscript=no,vhost={v}",
        ]

    # ---- lifecycle --------------------------------------------------------

    def cmdline(self) -> list[str]:
        kargs = [
            "console=ttyS0",
            "quiet",
            "loglevel=1",
            "panic=-1",
            "mitigations=off",
            f"gsonet.hostname={self.name}",
        ]
        if self.ip:
            kargs.append(f"gsonet.ip={self.ip}")
        if self.ip6:
            kargs.append(f"gsonet.ip6={self.ip6}")
        if self.gw:
            kargs.append(f"gsonet.gw={self.gw}")
        if self.mtu:
            kargs.append(f"gsonet.mtu={self.mtu}")
        if self.append:
            kargs.append(self.append)
        args = [
            self.qemu,
            "-name", self.name,
            "-accel", "tcg",
            "-cpu", self.cpu,
            "-m", self.mem,
            "-smp", str(self.smp),
            "-object", f"memory-backend-memfd,id=mem,size={self.mem},share=on",
            "-numa", "node,memdev=mem",
            "-kernel", str(self.kernel),
            "-initrd", str(self.initrd),
            "-append", " ".join(kargs),
            "-nodefaults",
            "-nographic",
            "-serial", "stdio",
            "-monitor", "none",
            "-no-reboot",
        ]
        if self.qmp_path:
            args += ["-qmp", f"unix:{self.qmp_path},server=on,wait=off"]
        if self.netdev_args:
            props = ",".join(f"{k}={_prop(v)}" for k, v in self.device_props.items())
            args += self.netdev_args
            args += ["-device", f"virtio-net-pci,netdev=n0,mac={self.mac},{props}"]
        args += self.extra_args
        return args

    def start(self) -> "Guest":
        if not (self.kernel.exists() and self.initrd.exists()):
            raise GuestError(
                f"guest image missing ({self.kernel}); run scripts/setup.sh "
                "or guest-tests/image/build.sh"
            )
        self.log_dir.mkdir(parents=True, exist_ok=True)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        base = self.log_dir / f"{stamp}-{self.name}-{os.getpid()}"
        self.console_log_path = base.with_suffix(".console.log")
        self.qemu_log_path = base.with_suffix(".qemu.log")
        import tempfile

        self._workdir = Path(tempfile.mkdtemp(prefix=f"gsonet-{self.name}-"))
        self.qmp_path = self._workdir / "qmp.sock"
        cmd = self.cmdline()
        self._log = open(self.console_log_path, "w", encoding="utf-8", errors="replace")
        self._qemu_log = open(self.qemu_log_path, "w", encoding="utf-8", errors="replace")
        self._qemu_log.write(" ".join(cmd) + "\n")
        self._qemu_log.flush()
        self._started_at = time.monotonic()
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            bufsize=0,
            start_new_session=True,
        )
        self._reader = threading.Thread(target=self._read_console, daemon=True)
        self._reader.start()
        self._err_reader = threading.Thread(target=self._read_stderr, daemon=True)
        self._err_reader.start()
        return self

    def _read_console(self) -> None:
        assert self.proc and self.proc.stdout
        pump_output(self.proc.stdout.fileno(), self, strip_cr=True)

    def _read_stderr(self) -> None:
        assert self.proc and self.proc.stderr
        for line in iter(self.proc.stderr.readline, b""):
            if self._qemu_log:
                try:
                    self._qemu_log.write(line.decode(errors="replace"))
                    self._qemu_log.flush()
                except ValueError:
                    pass

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def qemu_stderr(self) -> str:
        try:
            return Path(self.qemu_log_path).read_text(errors="replace")
        except OSError:
            return ""

    def _wait_for(self, pattern: re.Pattern, start: int, timeout: float):
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                m = pattern.search(self._buf, start)
                if m:
                    return m
                if not self.alive():
                    # drain: the reader may still be appending the last bytes
                    self._cond.wait(0.2)
                    m = pattern.search(self._buf, start)
                    if m:
                        return m
                    raise GuestError(
                        f"{self.name}: QEMU exited (rc={self.proc.returncode if self.proc else None})."
                        f" stderr:\n{self.qemu_stderr()[-2000:]}\nconsole tail:\n{self._buf[-2000:]}"
                    )
                left = deadline - time.monotonic()
                if left <= 0:
                    raise GuestTimeout(
                        f"{self.name}: timeout waiting for {pattern.pattern!r}; console tail:\n"
                        f"{self._buf[-1500:]}"
                    )
                self._cond.wait(min(left, 0.5))

    def wait_booted(self, timeout: float = 180.0) -> float:
        """Wait for init's ready line and a responsive shell. Returns boot seconds."""
        if self._booted:
            return self.boot_seconds or 0.0
        self._wait_for(re.compile(re.escape(READY_MARK)), 0, timeout)
        self.boot_seconds = time.monotonic() - self._started_at
        self._booted = True
        # quiet prompts; make sure the shell answers
        self.run("PS1=''; PS2=''; stty -echo 2>/dev/null; true", timeout=60)
        return self.boot_seconds

    def send_raw(self, text: str) -> None:
        if not self.alive():
            raise GuestError(f"{self.name}: QEMU is not running")
        assert self.proc and self.proc.stdin
        data = text.encode()
        # the tty line buffer holds 4095 bytes; feed it in pieces
        for i in range(0, len(data), 1024):
            self.proc.stdin.write(data[i : i + 1024])
            self.proc.stdin.flush()

    def run(self, cmd: str, timeout: float = 60.0, check: bool = False) -> tuple[int, str]:
        """Run a shell command on the guest console; returns (exit code, output).

        stdin is /dev/null, stderr is merged into the output. On timeout, ^C is
        sent and GuestTimeout raised. check=True raises GuestError on rc != 0.
        """
        tag = uuid.uuid4().hex[:12]
        # Quotes split the markers so an echoed command line never matches.
        line = f"echo '@@S''{tag}'; {{ {cmd}\n}} </dev/null 2>&1; echo '@@E''{tag}':$?\n"
        with self._cond:
            start = len(self._buf)
        self.send_raw(line)
        m_start = self._wait_for(re.compile(rf"@@S{tag}\n"), start, timeout)
        try:
            m_end = self._wait_for(re.compile(rf"@@E{tag}:(\d+)\n"), m_start.end(), timeout)
        except GuestTimeout:
            try:
                self.send_raw("\x03")
            except GuestError:
                pass
            raise GuestTimeout(
                f"{self.name}: command timed out after {timeout}s: {cmd}\n"
                f"partial output:\n{self._buf[m_start.end():][-2000:]}"
            )
        with self._cond:
            out = self._buf[m_start.end() : m_end.start()]
        rc = int(m_end.group(1))
        if check and rc != 0:
            raise GuestError(f"{self.name}: `{cmd}` failed rc={rc}:\n{out}")
        return rc, out

    def run_ok(self, cmd: str, timeout: float = 60.0) -> str:
        return self.run(cmd, timeout=timeout, check=True)[1]

    def console(self) -> str:
        with self._cond:
            return self._buf

    def qmp(self, command: str, arguments: dict | None = None, timeout: float = 10.0) -> dict:
        """Run one QMP command (e.g. "set_link", {"name": "n0", "up": False})."""
        if not self.qmp_path:
            raise GuestError("no QMP socket")
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(timeout)
        s.connect(str(self.qmp_path))
        f = s.makefile("rwb")

        def recv():
            while True:
                line = f.readline()
                if not line:
                    raise GuestError("QMP closed")
                msg = json.loads(line)
                if "event" not in msg:
                    return msg

        try:
            recv()  # greeting
            f.write(b'{"execute":"qmp_capabilities"}\n')
            f.flush()
            recv()
            req = {"execute": command}
            if arguments:
                req["arguments"] = arguments
            f.write(json.dumps(req).encode() + b"\n")
            f.flush()
            resp = recv()
        finally:
            f.close()
            s.close()
        if "error" in resp:
            raise GuestError(f"QMP {command}: {resp['error']}")
        return resp.get("return", {})

    def shutdown(self) -> None:
        """Stop QEMU (always kills it) and close the logs."""
        if self.proc is not None:
            if self.proc.poll() is None:
                try:
                    self.proc.terminate()
                    self.proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait(timeout=5)
            for s in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
                try:
                    if s:
                        s.close()
                except OSError:
                    pass
        for t in (self._reader, self._err_reader):
            if t:
                t.join(timeout=2)
        for f in (self._log, self._qemu_log):
            if f:
                try:
                    f.close()
                except OSError:
                    pass
        self._log = self._qemu_log = None
        if self._workdir:
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None

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

    # ---- guest-side conveniences -----------------------------------------

    def ethtool_features(self, dev: str = "eth0") -> dict[str, str]:
        """`ethtool -k` as {feature: "on"|"off"} ("[fixed]" dropped)."""
        out = self.run_ok(f"ethtool -k {dev}")
        feats = {}
        for line in out.splitlines():
            m = re.match(r"^\s*([\w-]+):\s+(on|off)", line)
            if m:
                feats[m.group(1)] = m.group(2)
        return feats

    def ethtool_set(self, dev: str = "eth0", **features) -> None:
        """ethtool -K: guest.ethtool_set(tso=False, gso=False)."""
        args = " ".join(f"{k.replace('_', '-')} {_prop(v)}" for k, v in features.items())
        self.run_ok(f"ethtool -K {dev} {args}")

    def iface_stats(self, dev: str = "eth0") -> dict[str, int]:
        """rx/tx bytes and packets from /proc/net/dev."""
        out = self.run_ok("cat /proc/net/dev")
        for line in out.splitlines():
            if line.strip().startswith(dev + ":"):
                f = line.split(":", 1)[1].split()
                return {
                    "rx_bytes": int(f[0]),
                    "rx_packets": int(f[1]),
                    "tx_bytes": int(f[8]),
                    "tx_packets": int(f[9]),
                }
        raise GuestError(f"{dev} not in /proc/net/dev")

    def start_iperf3_server(self, port: int = 5201) -> None:
        self.run(f"killall iperf3 2>/dev/null; true")
        self.run_ok(f"iperf3 -s -D -p {port}")
        for _ in range(100):
            rc, out = self.run(f"netstat -ltn | grep -q ':{port} '")
            if rc == 0:
                return
            time.sleep(0.1)
        raise GuestError(f"{self.name}: iperf3 server did not start")


# ---- host-side helpers ----------------------------------------------------


def sh(cmd: list[str] | str, check: bool = True, **kw) -> subprocess.CompletedProcess:
    if isinstance(cmd, str):
        cmd = cmd.split()
    return subprocess.run(cmd, check=check, capture_output=True, text=True, **kw)


def link_exists(name: str) -> bool:
    return Path("/sys/class/net", name).exists()


def delete_link(name: str) -> None:
    if link_exists(name):
        sh(["ip", "link", "del", name], check=False)


def _add_addrs(name: str, addr: str | None, addr6: str | None) -> None:
    if addr:
        sh(["ip", "addr", "add", addr, "dev", name])
    if addr6:
        sh(["sysctl", "-qw", f"net.ipv6.conf.{name}.accept_dad=0"], check=False)
        sh(["ip", "-6", "addr", "add", addr6, "dev", name, "nodad"])


def create_tap(name: str, addr: str | None = None, addr6: str | None = None,
               mtu: int | None = None) -> str:
    """Persistent tap (ip tuntap, vnet_hdr) with optional addresses, set up."""
    delete_link(name)
    sh(["ip", "tuntap", "add", "dev", name, "mode", "tap", "vnet_hdr"])
    if mtu:
        sh(["ip", "link", "set", name, "mtu", str(mtu)])
    _add_addrs(name, addr, addr6)
    sh(["ip", "link", "set", name, "up"])
    return name


def create_bridge(name: str, taps: list[str], addr: str | None = None,
                  addr6: str | None = None) -> str:
    """Linux bridge ``name`` enslaving new taps ``taps``; the address goes on the bridge."""
    delete_link(name)
    sh(["ip", "link", "add", name, "type", "bridge"])
    sh(["ip", "link", "set", name, "type", "bridge", "stp_state", "0", "forward_delay", "0"],
       check=False)
    for t in taps:
        create_tap(t)
        sh(["ip", "link", "set", t, "master", name])
    _add_addrs(name, addr, addr6)
    sh(["ip", "link", "set", name, "up"])
    return name


def set_addr(name: str, addr: str | None = None, addr6: str | None = None) -> None:
    """Add addresses to an existing link (e.g. the tap gsonet created) and set it up."""
    _add_addrs(name, addr, addr6)
    sh(["ip", "link", "set", name, "up"])


def used_ipv4_nets() -> list[ipaddress.IPv4Network]:
    out = sh(["ip", "-o", "-4", "addr", "show"], check=False).stdout
    nets = []
    for m in re.finditer(r"inet (\S+)", out):
        nets.append(ipaddress.ip_interface(m.group(1)).network)
    return nets


def alloc_subnet(prefix: str = "10.77", start: int = 0) -> int:
    """Pick N so that PREFIX.N.0/24 is not configured on any host interface."""
    used = used_ipv4_nets()
    for n in range(start, 256):
        net = ipaddress.ip_network(f"{prefix}.{n}.0/24")
        if not any(net.overlaps(u) for u in used):
            return n
    raise RuntimeError(f"no free {prefix}.N.0/24")


def tun_available() -> bool:
    return os.path.exists("/dev/net/tun")


# ---- iperf3 -----------------------------------------------------------------


def _iperf_gbps(result: dict) -> float:
    end = result.get("end", {})
    for key in ("sum_received", "sum"):
        if key in end and "bits_per_second" in end[key]:
            return end[key]["bits_per_second"] / 1e9
    raise GuestError(f"iperf3: no result: {json.dumps(result)[:500]}")


def iperf3_host_client(server_ip: str, seconds: float = 3, reverse: bool = False,
                       port: int = 5201, extra: list[str] | None = None,
                       timeout: float | None = None, retries: int = 3) -> float:
    """Host iperf3 client against a server in a guest. reverse=False: host->guest;
    reverse=True (-R): guest->host. Returns Gbit/s as received. Control-channel
    failures (a server still closing the previous test) are retried."""
    cmd = ["iperf3", "-c", server_ip, "-p", str(port), "-t", str(seconds), "-J"]
    if reverse:
        cmd.append("-R")
    cmd += extra or []
    last = ""
    for attempt in range(retries):
        if attempt:
            time.sleep(1.0)
        p = subprocess.run(cmd, capture_output=True, text=True,
                           timeout=timeout or seconds * 4 + 60)
        try:
            result = json.loads(p.stdout)
        except json.JSONDecodeError:
            last = f"iperf3 failed rc={p.returncode}: {p.stdout[-1000:]} {p.stderr[-1000:]}"
            continue
        if "error" in result:
            last = f"iperf3: {result['error']}"
            continue
        return _iperf_gbps(result)
    raise GuestError(last)


def iperf3_guest_client(guest: Guest, server_ip: str, seconds: float = 3,
                        reverse: bool = False, port: int = 5201, extra: str = "") -> float:
    """iperf3 client in a guest (server on the host or in another guest).
    reverse=False: guest sends. Returns Gbit/s as received."""
    r = "-R" if reverse else ""
    rc, out = guest.run(f"iperf3 -c {server_ip} -p {port} -t {seconds} -J {r} {extra}",
                        timeout=seconds * 4 + 60)
    i = out.find("{")
    try:
        result = json.loads(out[i:])
    except (json.JSONDecodeError, ValueError):
        raise GuestError(f"iperf3 in {guest.name} rc={rc}: {out[-1000:]}")
    if "error" in result:
        raise GuestError(f"iperf3 in {guest.name}: {result['error']}")
    return _iperf_gbps(result)


class HostIperfServer:
    """iperf3 -s on the host (context manager), for guest-client measurements."""

    def __init__(self, bind: str | None = None, port: int = 5201):
        self.bind, self.port = bind, port
        self.proc: subprocess.Popen | None = None

    def __enter__(self):
        cmd = ["iperf3", "-s", "-p", str(self.port)]
        if self.bind:
            cmd += ["-B", self.bind]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 10
        while time.time() < deadline:
            with socket.socket() as s:
                if s.connect_ex((self.bind or "127.0.0.1", self.port)) == 0:
                    break
            time.sleep(0.05)
        return self

    def __exit__(self, *exc):
        if self.proc:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def measure_iperf(guest: Guest, guest_ip: str, seconds: float = 3, port: int = 5201) -> dict:
    """Both directions with the server in the guest and the client on the host.
    Returns {"guest_to_host": Gbit/s, "host_to_guest": Gbit/s}."""
    guest.start_iperf3_server(port)
    g2h = iperf3_host_client(guest_ip, seconds, reverse=True, port=port)
    time.sleep(0.5)  # let the guest's server finish the previous test
    h2g = iperf3_host_client(guest_ip, seconds, reverse=False, port=port)
    return {"guest_to_host": g2h, "host_to_guest": h2g}


# ---- file transfer with md5 -------------------------------------------------


class _OneShotServer:
    """Accept one TCP connection on (bind, port 0); either receive until EOF
    (recording md5/length) or send ``payload`` and close."""

    def __init__(self, bind: str, payload: bytes | None = None, timeout: float = 300):
        fam = socket.AF_INET6 if ":" in bind else socket.AF_INET
        self.sock = socket.socket(fam, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((bind, 0))
        self.sock.listen(1)
        self.sock.settimeout(timeout)
        self.port = self.sock.getsockname()[1]
        self.payload = payload
        self.md5 = None
        self.length = 0
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        try:
            conn, _ = self.sock.accept()
            conn.settimeout(self.sock.gettimeout())
            with conn:
                if self.payload is None:
                    h = hashlib.md5()
                    while True:
                        b = conn.recv(1 << 20)
                        if not b:
                            break
                        h.update(b)
                        self.length += len(b)
                    self.md5 = h.hexdigest()
                else:
                    conn.sendall(self.payload)
                    conn.shutdown(socket.SHUT_WR)
                    # wait for the peer to close
                    while conn.recv(65536):
                        pass
        except BaseException as e:  # noqa: BLE001 - reported to the caller
            self.error = e
        finally:
            self.sock.close()

    def join(self, timeout: float):
        self.thread.join(timeout)
        if self.thread.is_alive():
            raise GuestError("file transfer server still running")
        if self.error:
            raise GuestError(f"file transfer server: {self.error!r}")


def _guest_md5(guest: Guest, path: str, timeout: float = 300) -> str:
    out = guest.run_ok(f"md5sum {path}", timeout=timeout)
    return out.split()[0]


def transfer_guest_to_host(guest: Guest, host_ip: str, mib: int = 32,
                           timeout: float = 600) -> dict:
    """Random file of ``mib`` MiB made in the guest's tmpfs, sent with busybox nc
    to a host socket. Returns {"ok", "guest_md5", "host_md5", "bytes", "seconds"}."""
    path = "/tmp/xfer.out"
    guest.run_ok(f"head -c {mib * 1048576} /dev/urandom > {path}", timeout=timeout)
    gmd5 = _guest_md5(guest, path, timeout)
    srv = _OneShotServer(host_ip, None, timeout=timeout)
    t0 = time.monotonic()
    guest.run_ok(f"nc {host_ip} {srv.port} < {path}", timeout=timeout)
    srv.join(timeout=30)
    secs = time.monotonic() - t0
    guest.run(f"rm -f {path}")
    return {"ok": srv.md5 == gmd5 and srv.length == mib * 1048576,
            "guest_md5": gmd5, "host_md5": srv.md5, "bytes": srv.length, "seconds": secs}


def transfer_host_to_guest(guest: Guest, host_ip: str, mib: int = 32,
                           timeout: float = 600) -> dict:
    """Random ``mib`` MiB from the host, fetched by the guest with busybox nc
    into tmpfs, md5 compared. Same result dict as transfer_guest_to_host."""
    path = "/tmp/xfer.in"
    payload = os.urandom(mib * 1048576)
    hmd5 = hashlib.md5(payload).hexdigest()
    srv = _OneShotServer(host_ip, payload, timeout=timeout)
    t0 = time.monotonic()
    guest.run_ok(f"nc {host_ip} {srv.port} </dev/null > {path}", timeout=timeout)
    srv.join(timeout=30)
    secs = time.monotonic() - t0
    gmd5 = _guest_md5(guest, path, timeout)
    size = int(guest.run_ok(f"wc -c < {path}").strip())
    guest.run(f"rm -f {path}")
    return {"ok": gmd5 == hmd5 and size == len(payload),
            "guest_md5": gmd5, "host_md5": hmd5, "bytes": size, "seconds": secs}


# ---- QEMU built-in tap baseline ----------------------------------------------


def measure_qemu_tap(seconds: float = 3, repeats: int = 1, tap: str | None = None,
                     subnet: int | None = None, device_props: dict | None = None,
                     guest_offloads_off: bool = False) -> dict:
    """Boot a guest on QEMU's built-in virtio-net + tap and measure iperf3 both
    ways. Returns {"guest_to_host": [Gbit/s...], "host_to_guest": [...],
    "boot_seconds": s}."""
    n = alloc_subnet() if subnet is None else subnet
    tap = tap or f"gsnqt{os.getpid() % 100000}"
    host_ip, guest_ip = f"10.77.{n}.1", f"10.77.{n}.2"
    create_tap(tap, f"{host_ip}/24")
    res = {"guest_to_host": [], "host_to_guest": [], "boot_seconds": None}
    try:
        with Guest("qemutap", Guest.tap(tap), device_props, ip=f"{guest_ip}/24") as g:
            res["boot_seconds"] = g.wait_booted()
            if guest_offloads_off:
                g.ethtool_set(tso=False, gso=False)
            for _ in range(repeats):
                r = measure_iperf(g, guest_ip, seconds)
                res["guest_to_host"].append(r["guest_to_host"])
                res["host_to_guest"].append(r["host_to_guest"])
    finally:
        delete_link(tap)
    return res


def measure_vhost_user(socket_path: str | os.PathLike, host_ip: str, guest_ip: str,
                       prefix: int = 24, seconds: float = 3, repeats: int = 1,
                       name: str = "vhostuser", device_props: dict | None = None,
                       queues: int | None = None) -> dict:
    """Boot a guest on a vhost-user backend listening at ``socket_path`` (gsonet
    serve --port socket=...), whose uplink already has ``host_ip``; measure iperf3
    both ways. Same result dict as measure_qemu_tap."""
    res = {"guest_to_host": [], "host_to_guest": [], "boot_seconds": None}
    with Guest(name, Guest.vhost_user(socket_path, queues=queues), device_props,
               ip=f"{guest_ip}/{prefix}") as g:
        res["boot_seconds"] = g.wait_booted()
        rc, out = g.run(f"ping -c 1 -W 10 {host_ip}", timeout=60)
        if rc != 0:
            raise GuestError(f"guest cannot reach {host_ip} over vhost-user:\n{out}")
        for _ in range(repeats):
            r = measure_iperf(g, guest_ip, seconds)
            res["guest_to_host"].append(r["guest_to_host"])
            res["host_to_guest"].append(r["host_to_guest"])
    return res


# ---- gsonet daemon -------------------------------------------------------------

GSONET_BIN = os.environ.get("GSONET_BIN", str(REPO / "target" / "release" / "gsonet"))


class Gsonet:
    """A `gsonet serve` process (context manager).

        with Gsonet([f"socket={sock}"], [f"tap={tap}"], workdir=d) as gs:
            set_addr(tap, "10.77.5.1/24")
            ...
            gs.stats()["ports"][0]["stats"]["gso_passed"]

    ports / uplinks: the --port / --uplink specs. Listening sockets and the taps
    are waited for in ``start()``; client-mode ports only connect once QEMU's
    server socket exists. stderr goes to ``log_path``.
    """

    def __init__(self, ports: list[str], uplinks: list[str] | None = None, *,
                 workdir: str | os.PathLike, binary: str | None = None,
                 name: str = "gsonet", log_dir: Path | str | None = None,
                 env: dict | None = None):
        self.ports = list(ports)
        self.uplinks = list(uplinks or [])
        self.workdir = Path(workdir)
        self.binary = binary or GSONET_BIN
        self.control = self.workdir / "control.sock"
        self.name = name
        self.log_dir = Path(log_dir or LOG_DIR)
        self.env = env
        self.proc: subprocess.Popen | None = None
        self.log_path: Path | None = None
        self._log = None

    def cmdline(self) -> list[str]:
        cmd = [self.binary, "serve"]
        for p in self.ports:
            cmd += ["--port", p]
        for u in self.uplinks:
            cmd += ["--uplink", u]
        return cmd + ["--control", str(self.control)]

    @staticmethod
    def _spec(spec: str) -> dict[str, str]:
        out = {}
        for item in spec.split(","):
            k, _, v = item.partition("=")
            out[k] = v
        return out

    def start(self, timeout: float = 15.0) -> "Gsonet":
        if not os.access(self.binary, os.X_OK):
            raise GuestError(f"gsonet binary {self.binary} missing (cargo build --release)")
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        self.log_path = self.log_dir / f"{stamp}-{self.name}-{os.getpid()}.gsonet.log"
        self._log = open(self.log_path, "w")
        cmd = self.cmdline()
        self._log.write(" ".join(cmd) + "\n")
        self._log.flush()
        env = dict(os.environ)
        env.setdefault("RUST_LOG", "gsonet=info")
        env["NO_COLOR"] = "1"
        env.update(self.env or {})
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=self._log,
                                     stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        waits = [self.control]
        for p in self.ports:
            s = self._spec(p)
            if "client" not in s:
                waits.append(Path(s["socket"]))
        taps = [self._spec(u)["tap"] for u in self.uplinks if "tap" in self._spec(u)]
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise GuestError(f"gsonet exited rc={self.proc.returncode}:\n{self.log()[-2000:]}")
            if all(w.exists() for w in waits) and all(link_exists(t) for t in taps):
                return self
            if time.monotonic() > deadline:
                raise GuestError(f"gsonet not ready after {timeout}s:\n{self.log()[-2000:]}")
            time.sleep(0.05)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log(self) -> str:
        try:
            return Path(self.log_path).read_text(errors="replace") if self.log_path else ""
        except OSError:
            return ""

    def stats(self) -> dict:
        """`gsonet stats --json` as a dict: {"ports": [...], "uplinks": [...]}."""
        p = subprocess.run([self.binary, "stats", "--control", str(self.control), "--json"],
                           capture_output=True, text=True, timeout=10)
        if p.returncode != 0:
            raise GuestError(f"gsonet stats failed rc={p.returncode}: {p.stderr}")
        return json.loads(p.stdout)

    def ctl(self, target: str, *settings: str) -> dict:
        """`gsonet ctl TARGET KEY=VALUE...`; raises on a refusal."""
        p = subprocess.run([self.binary, "ctl", "--control", str(self.control), target, *settings],
                           capture_output=True, text=True, timeout=10)
        if p.returncode != 0:
            raise GuestError(f"gsonet ctl {target} {settings} failed rc={p.returncode}: {p.stderr}")
        return json.loads(p.stdout)

    def stats_text(self) -> str:
        return subprocess.run([self.binary, "stats", "--control", str(self.control)],
                              capture_output=True, text=True, timeout=10).stdout

    def port_stats(self, i: int = 0) -> dict:
        return self.stats()["ports"][i]

    def uplink_stats(self, i: int = 0) -> dict:
        return self.stats()["uplinks"][i]

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
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
    from ``after``); drops as a dict of differences."""
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


def transfer_guest_to_guest(src: Guest, dst: Guest, dst_ip: str, mib: int = 32,
                            port: int = 5301, timeout: float = 600) -> dict:
    """Random ``mib`` MiB from ``src``'s tmpfs to ``dst`` with busybox nc
    (``nc -l -p PORT`` in dst), md5 on both sides. Same result dict as
    transfer_guest_to_host."""
    spath, dpath = "/tmp/g2g.out", "/tmp/g2g.in"
    src.run_ok(f"head -c {mib * 1048576} /dev/urandom > {spath}", timeout=timeout)
    smd5 = _guest_md5(src, spath, timeout)
    dst.run(f"rm -f {dpath} {dpath}.done")
    # The listener runs in its own session (setsid), not as a job of the console
    # shell. busybox nc exits as soon as the peer half-closes, so its stdin must
    # stay open (a pipe from sleep), or the sender would quit mid-file.
    dst.run_ok(f"setsid sh -c 'sleep 3600 | {{ nc -l -p {port} > {dpath}; touch {dpath}.done; }}'"
               " >/dev/null 2>&1")
    for _ in range(100):
        rc, _ = dst.run(f"netstat -ltn | grep -q ':{port} '")
        if rc == 0:
            break
        time.sleep(0.1)
    t0 = time.monotonic()
    src.run_ok(f"nc {dst_ip} {port} < {spath}", timeout=timeout)
    # the listener exits when the sender closes
    dst.run_ok(f"i=0; while [ ! -e {dpath}.done ] && [ $i -lt 300 ]; do usleep 100000;"
               f" i=$((i+1)); done; killall sleep 2>/dev/null; [ -e {dpath}.done ]",
               timeout=60)
    secs = time.monotonic() - t0
    dmd5 = _guest_md5(dst, dpath, timeout)
    size = int(dst.run_ok(f"wc -c < {dpath}").strip())
    src.run(f"rm -f {spath}")
    dst.run(f"rm -f {dpath} {dpath}.done")
    return {"ok": smd5 == dmd5 and size == mib * 1048576,
            "src_md5": smd5, "dst_md5": dmd5, "bytes": size, "seconds": secs}

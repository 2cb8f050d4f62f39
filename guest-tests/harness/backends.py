"""The backends scripts/measure.py compares (gsonet, QEMU's tap, DPDK testpmd), each
brought up in one topology (guest<->host or guest<->guest) with its guests booted."""

from __future__ import annotations

import re
import shutil
import subprocess
from contextlib import nullcontext
from pathlib import Path

from . import cost, evpn, hostnet
from .gsonet import Gsonet
from .guest import Guest
from .hostprof import HostProfile
from .iperf import iperf3_guest_client, iperf3_guest_server, iperf3_host_client
from .paths import TCP_RR, TESTPMD
from .process import HarnessError
from .qemu import tap_netdev, vhost_user_netdev
from .testpmd import TestPmd

BACKENDS = ["gsonet", "qemu-tap", "dpdk"]
TOPOLOGIES = ["host", "g2g", "g2g-soft", "multihost"]
# g2g-soft: guest->guest with the receiver's device lacking guest TSO (QEMU's
# guest_tso4/6=off on it, for every backend), so the sender's TSO frames are segmented
# on the way: by gsonet, or by the kernel (bridge to a tap without TSO).
NO_GUEST_TSO = {"guest_tso4": "off", "guest_tso6": "off"}
# multihost: guest->guest across two hosts of an EVPN-VXLAN fabric (harness/evpn.py,
# docs/multihost.md), each guest on its host's backend whose tap is in the host's
# bridge; the guests' MTU is the overlay's (VXLAN's 50 bytes under the underlay's).
MULTIHOST_MTU = 1450
BASELINE = "qemu-tap"
LABEL = {"gsonet": "gsonet", "qemu-tap": "QEMU virtio-net + tap", "dpdk": "DPDK testpmd vhost"}


def label(backend: str) -> str:
    """A backend's name in tables; "gsonet:OPTS" is gsonet with port options OPTS."""
    kind, _, opts = backend.partition(":")
    return f"{LABEL[kind]} ({opts})" if opts else LABEL[kind]


def known(backend: str) -> bool:
    """One of BACKENDS, or "gsonet:K=V[,K=V...]" (gsonet with those port options, so a
    knob is measured against the defaults in the same run)."""
    kind, sep, opts = backend.partition(":")
    return kind in BACKENDS and (not sep or (kind == "gsonet" and "=" in opts))

# testpmd: guest<->host through net_tap with checksum offload and TSO done by the
# csum engine (1434, not 1448, because net_tap counts the Ethernet header in its MTU
# check; mac-swap off or nothing arrives). Guest<->guest: io forwarding.
TESTPMD_ARGS = ["--nb-cores=1", "--rxd=1024", "--txd=1024"]
TESTPMD_HOST_CMDS = [
    "port stop all",
    "port config 0 rx_offload tcp_cksum on",
    "port config 0 rx_offload udp_cksum on",
    "set fwd csum",
    "csum mac-swap off 0",
    "csum mac-swap off 1",
    "csum set ip hw 1",
    "csum set tcp hw 1",
    "csum set udp hw 1",
    "csum parse-tunnel off 1",
    "tso set 1434 1",
    "port start all",
    "start",
]
TESTPMD_G2G_CMDS = ["set fwd io", "start"]


class Setup:
    """One backend in one topology (context manager): ``guests`` booted, ``host_ip``
    (guest<->host) and ``guest_ips`` known, ``commands`` the exact command lines used;
    ``gsonet`` is the daemon when the backend is gsonet."""

    def __init__(self, backend: str, topo: str, work: Path, logs: Path | None = None):
        self.backend, self.topo, self.work, self.logs = backend, topo, work, logs
        self.guests: list[Guest] = []
        self.guest_ips: list[str] = []
        self.host_ip: str | None = None
        self.commands: dict = {}
        self.gsonet: Gsonet | None = None
        self.fabric: evpn.Fabric | None = None  # multihost
        self.backend_pid: int | None = None  # gsonet's or testpmd's process
        self._host_link: str | None = None  # where host_ip goes (guest<->host)
        self._cleanup: list = []

    def __enter__(self) -> "Setup":
        try:
            self._up()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        for f in reversed(self._cleanup):
            try:
                f()
            except Exception:  # noqa: BLE001 - best-effort teardown
                pass
        self._cleanup.clear()

    def _up(self) -> None:
        n = hostnet.alloc_subnet()
        net = f"10.77.{n}"
        nguests = 1 if self.topo == "host" else 2
        kind, _, opts = self.backend.partition(":")
        socks = [str(self.work / f"{kind}-{self.topo}-{i}.sock") for i in range(nguests)]
        guest_ns: list[str | None] = [None] * nguests
        props = [None] * nguests
        if self.topo == "multihost":
            netdevs = self._multihost(kind, socks, opts)
            if kind == "qemu-tap":
                guest_ns = [h.ns for h in self.fabric.hosts]
            props = [{"host_mtu": MULTIHOST_MTU}] * nguests
        elif kind == "gsonet":
            netdevs = self._gsonet(socks, opts)
        elif self.backend == "qemu-tap":
            netdevs = self._qemu_tap(nguests)
        elif self.backend == "dpdk":
            netdevs = self._dpdk(socks)
        else:
            raise ValueError(self.backend)
        if self.topo == "host":
            hostnet.set_addr(self._host_link, f"{net}.1/24")
            self.host_ip = f"{net}.1"
        for i, netdev in enumerate(netdevs):
            if self.topo == "g2g-soft" and i == 1:
                props[i] = NO_GUEST_TSO
            g = Guest(f"bench-{kind}{i}", netdev, props[i], ip=f"{net}.{i + 2}/24",
                      log_dir=self.logs, netns=guest_ns[i])
            self._cleanup.append(g.shutdown)
            self.guests.append(g)
            self.guest_ips.append(f"{net}.{i + 2}")
        for g in self.guests:
            g.start()
        for g in self.guests:
            g.wait_booted()
        self.commands["qemu"] = [" ".join(g.cmdline()) for g in self.guests]
        # Reachability first: a dead path should fail here, not as an iperf3 hang.
        peer = self.host_ip or self.guest_ips[1]
        rc, out = self.guests[0].run(f"ping -c 1 -W 10 {peer}", timeout=60)
        if rc != 0:
            raise HarnessError(f"guest cannot reach {peer}: {out.strip()[-200:]}")

    def _gsonet(self, socks: list[str], opts: str = "") -> list[list[str]]:
        uplinks = []
        if self.topo == "host":
            self._host_link = hostnet.unique_name("bg")
            uplinks = [f"tap={self._host_link}"]
            self._cleanup.append(lambda: hostnet.delete_link(self._host_link))
        # bin=PATH is not a port option: it runs another build (an A/B of two builds
        # in one interleaved run).
        given = [o for o in opts.split(",") if o]
        binary = next((o[4:] for o in given if o.startswith("bin=")), None)
        opts = ",".join(o for o in given if not o.startswith("bin="))
        gs = Gsonet([f"socket={s}" + (f",{opts}" if opts else "") for s in socks], uplinks,
                    workdir=self.work / f"gsonet-{self.topo}", name=f"bench-{self.topo}",
                    log_dir=self.logs, binary=binary)
        self._cleanup.append(gs.stop)
        gs.start()
        self.gsonet = gs
        self.backend_pid = gs.proc.pid if gs.proc else None
        self.commands["gsonet"] = " ".join(gs.cmdline())
        return [vhost_user_netdev(s) for s in socks]

    def _multihost(self, kind: str, socks: list[str], opts: str) -> list[list[str]]:
        """Two hosts of an EVPN fabric, BGP up; guest i on host i: on that host's own
        gsonet (run in its namespace) or on a tap of QEMU's there, in the bridge."""
        if kind not in ("gsonet", "qemu-tap"):
            raise HarnessError(f"{kind}: no multihost set-up (gsonet and qemu-tap only)")
        reason = evpn.skip_reason()
        if reason:
            raise HarnessError(reason)
        fab = evpn.Fabric(hosts=2)
        self._cleanup.append(fab.stop)
        fab.start()
        self.fabric = fab
        self.commands["fabric"] = "docs/multihost.md (guest-tests/harness/evpn.py)"
        netdevs = []
        for i, h in enumerate(fab.hosts):
            tap = "gsn0"
            if kind == "gsonet":
                spec = f"socket={socks[i]},mtu={MULTIHOST_MTU}" + (f",{opts}" if opts else "")
                gs = Gsonet([spec], [f"tap={tap}"], workdir=self.work / f"gsonet-{h.name}",
                            name=f"bench-{h.name}", log_dir=self.logs, netns=h.ns)
                self._cleanup.append(gs.stop)
                gs.start()
                if i == 0:  # the sender's: its counters and CPU are the ones costed
                    self.gsonet = gs
                    self.backend_pid = gs.proc.pid if gs.proc else None
                self.commands[f"gsonet-{h.name}"] = " ".join(gs.cmdline())
                netdevs.append(vhost_user_netdev(socks[i]))
            else:
                h.ip("tuntap", "add", "dev", tap, "mode", "tap", "vnet_hdr")
                netdevs.append(tap_netdev(tap))
            fab.attach(i, tap)
        fab.wait_established()
        return netdevs

    def _qemu_tap(self, nguests: int) -> list[list[str]]:
        taps = [hostnet.unique_name("bq") for _ in range(nguests)]
        self._cleanup.append(lambda: [hostnet.delete_link(t) for t in taps])
        if self.topo == "host":
            self._host_link = hostnet.create_tap(taps[0])
            self.commands["host"] = f"ip tuntap add dev {taps[0]} mode tap vnet_hdr"
        else:
            br = hostnet.unique_name("br")
            self._cleanup.append(lambda: hostnet.delete_link(br))
            hostnet.create_bridge(br, taps)
            self.commands["host"] = (f"ip link add {br} type bridge; "
                                     + "; ".join(f"ip tuntap add dev {t} mode tap vnet_hdr; "
                                                 f"ip link set {t} master {br}" for t in taps))
        return [tap_netdev(t) for t in taps]

    def _dpdk(self, socks: list[str]) -> list[list[str]]:
        if shutil.which(TESTPMD) is None:
            raise HarnessError(f"{TESTPMD} not installed (scripts/setup.sh installs dpdk-dev)")
        if self.topo == "host":
            self._host_link = hostnet.unique_name("bd")
            vdevs = [f"net_vhost0,iface={socks[0]},tso=1", f"net_tap0,iface={self._host_link}"]
            cmds = TESTPMD_HOST_CMDS
            self._cleanup.append(lambda: hostnet.delete_link(self._host_link))
        else:
            vdevs = [f"net_vhost{i},iface={s},tso=1,legacy-ol-flags=1"
                     for i, s in enumerate(socks)]
            cmds = TESTPMD_G2G_CMDS
        tp = TestPmd(f"bench-{self.topo}", vdevs, TESTPMD_ARGS, log_dir=self.logs)
        self._cleanup.append(tp.stop)
        tp.start()
        self.backend_pid = tp.proc.pid if tp.proc else None
        for c in cmds:
            tp.cmd(c, timeout=60)
        self.commands["testpmd"] = {"argv": " ".join(tp.cmdline()), "interactive": cmds}
        if self.topo == "host" and not hostnet.wait_link(self._host_link):
            raise HarnessError(f"testpmd did not create tap {self._host_link}")
        return [vhost_user_netdev(s) for s in socks]

    def set_offloads(self, on: bool) -> None:
        """ethtool -K eth0 tso/gso on or off in every guest."""
        for g in self.guests:
            g.ethtool_set(tso=on, gso=on)

    def measure(self, case: str, seconds: float,
                profile: bool = False) -> tuple[float, dict]:
        """Gbit/s of one iperf3 run: "g2h", "h2g" (server in the guest; -R makes the
        guest the sender) or "g2g"/"g2g-soft" (guest 0 sends to guest 1); and what it cost per GB
        (harness.cost.per_gb: guest interrupts and kicks, gsonet's kicks and calls,
        CPU seconds). With ``profile``, a host-wide `perf` sample splits the host's
        busy CPU seconds per GB by process and code ("host_split")."""
        g2g = case in ("g2g", "g2g-soft", "multihost")
        iperf3_guest_server(self.guests[1] if g2g else self.guests[0])
        pids = {"qemu": [g.proc.pid for g in self.guests if g.proc],
                "backend": [self.backend_pid] if self.backend_pid else []}
        prof = HostProfile(pids) if profile else nullcontext()
        before = cost.Snapshot.take(self.guests, self.gsonet)
        with prof:
            if g2g:
                gbps = iperf3_guest_client(self.guests[0], self.guest_ips[1], seconds=seconds)
            else:
                gbps = iperf3_host_client(self.guest_ips[0], seconds=seconds,
                                          reverse=(case == "g2h"))
        per_gb = cost.per_gb(before, cost.Snapshot.take(self.guests, self.gsonet))
        busy = per_gb.get("cpu_s", {}).get("host")
        if profile and prof.shares and busy is not None:
            per_gb["host_split"] = {k: round(v * busy, 3) for k, v in prof.shares.items()}
        return gbps, per_gb

    def latency(self, round_trips: int = 2000, port: int = 7007) -> dict:
        """1-byte TCP request/response (tcp_rr, TCP_NODELAY): {"p50_us", "p90_us",
        "p99_us", "host_ctxt_per_rt"} (the host's context switches per round trip).
        The server runs in the last guest; the client on the host (guest<->host) or
        in guest 0 (guest<->guest)."""
        server = self.guests[-1]
        server.run("killall tcp_rr 2>/dev/null; true")
        # In a subshell: the server is init's child, not a job of the console's shell,
        # whose line reading a job's end can cut in two (a half-read command).
        server.run_ok(f"(tcp_rr -s {port} >/dev/null 2>&1 &)")
        if not server.wait_listening(port):
            raise HarnessError(f"{server.name}: tcp_rr server did not start")
        ip = self.guest_ips[-1]
        ctxt = cost.host_context_switches()
        try:
            if self.topo != "host":
                out = self.guests[0].run_ok(f"tcp_rr -c {ip} -p {port} -n {round_trips}",
                                            timeout=120)
            else:
                if not TCP_RR.exists():
                    raise HarnessError(f"{TCP_RR} missing (guest-tests/image/build.sh)")
                out = subprocess.run([str(TCP_RR), "-c", ip, "-p", str(port), "-n",
                                      str(round_trips)], capture_output=True, text=True,
                                     timeout=120, check=True).stdout
            ctxt = (cost.host_context_switches() - ctxt) / round_trips
        finally:
            server.run("killall tcp_rr 2>/dev/null; true")
        m = re.search(r"p50_us ([\d.]+) p90_us ([\d.]+) p99_us ([\d.]+)", out)
        if not m:
            raise HarnessError(f"tcp_rr: no result: {out[-300:]}")
        lat = dict(zip(("p50_us", "p90_us", "p99_us"), map(float, m.groups())))
        lat["host_ctxt_per_rt"] = round(ctxt, 2)
        return lat

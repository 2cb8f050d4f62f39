"""Hosts of an EVPN-VXLAN fabric on one machine: each host a network namespace with
a bridge, a VXLAN device (learning off) and FRR's zebra + bgpd (iBGP, l2vpn evpn,
advertise-all-vni), all on one underlay: a bridge in its own namespace with a veth
to each host. The layout is docs/multihost.md's, with the host names and addresses
below.

    with Fabric(hosts=3) as fab:          # namespaces, underlay, bridges, FRR up
        fab.wait_established()             # every BGP session up, every VTEP known
        fab.attach(0, "gsntap")            # an interface in host 0's namespace -> br0
        fab.macs(1)                        # `show evpn mac vni all json` on host 1

Host i (0-based): namespace ``{prefix}h{i+1}``, underlay address 192.168.77.{i+1}/24
on ``und`` (also its VTEP address and BGP router id), bridge ``br0`` with ``vx{vni}``.
FRR's files (configs, vty sockets, logs) live in a directory frr may read, the
daemons run as frr, in the foreground, started and stopped here.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from .paths import open_log
from .process import HarnessError, stop

FRR_DIR = Path("/usr/lib/frr")
VTYSH = "vtysh"
AS = 65000
BRIDGE = "br0"
UNDERLAY_IF = "und"


def skip_reason() -> str | None:
    """Why the fabric cannot be built here, or None."""
    if os.geteuid() != 0:
        return "the EVPN fabric needs root (namespaces, FRR)"
    for prog in (FRR_DIR / "zebra", FRR_DIR / "bgpd"):
        if not os.access(prog, os.X_OK):
            return f"{prog} missing: FRR not installed (scripts/setup.sh installs frr)"
    if shutil.which(VTYSH) is None:
        return "vtysh missing (frr)"
    try:
        pwd.getpwnam("frr")
    except KeyError:
        return "no frr user (the frr package makes it)"
    return None


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run(list(args), capture_output=True, text=True)
    if check and p.returncode != 0:
        raise HarnessError(f"{' '.join(args)}: rc={p.returncode} {p.stderr.strip()}")
    return p


def netns_exec(ns: str) -> list[str]:
    """The prefix running a command in namespace ``ns``."""
    return ["ip", "netns", "exec", ns]


class Host:
    """One host of the fabric: its namespace, VTEP address, FRR directory."""

    def __init__(self, fabric: "Fabric", index: int):
        self.fabric = fabric
        self.index = index
        self.name = f"{fabric.prefix}h{index + 1}"
        self.ns = self.name
        self.vtep = f"192.168.77.{index + 1}"
        self.dir = fabric.workdir / self.name
        self.procs: list[subprocess.Popen] = []
        self._logs: list = []

    def ip(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return _run("ip", "-n", self.ns, *args, check=check)

    def sh(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return _run(*netns_exec(self.ns), *args, check=check)

    def vtysh(self, *commands: str) -> str:
        cmd = [VTYSH, "--vty_socket", str(self.dir)]
        for c in commands:
            cmd += ["-c", c]
        p = _run(*cmd, check=False)
        if p.returncode != 0:
            raise HarnessError(f"{self.name}: vtysh {commands}: rc={p.returncode} "
                               f"{p.stdout[-500:]} {p.stderr[-500:]}")
        return p.stdout

    def vtysh_json(self, command: str) -> dict:
        return json.loads(self.vtysh(command + " json") or "{}")

    def link_stats(self, ifname: str) -> dict:
        """`ip -s` counters of ``ifname`` in this host: {"rx_packets", "rx_bytes",
        "tx_packets", "tx_bytes"}."""
        info = json.loads(self.ip("-s", "-j", "link", "show", "dev", ifname).stdout)[0]
        s = info["stats64"]
        return {"rx_packets": s["rx"]["packets"], "rx_bytes": s["rx"]["bytes"],
                "tx_packets": s["tx"]["packets"], "tx_bytes": s["tx"]["bytes"]}

    def frr_config(self, peers: list[str]) -> tuple[str, str]:
        log = self.dir
        zebra = f"hostname {self.name}\nlog file {log}/zebra.log\n"
        bgp = [f"hostname {self.name}", f"log file {log}/bgpd.log",
               f"router bgp {AS}",
               f" bgp router-id {self.vtep}",
               " no bgp default ipv4-unicast"]
        bgp += [f" neighbor {p} remote-as {AS}" for p in peers]
        # updates go out at once (the iBGP default is 0 s; stated, not assumed)
        bgp += [f" neighbor {p} advertisement-interval 0" for p in peers]
        bgp += [" address-family l2vpn evpn"]
        bgp += [f"  neighbor {p} activate" for p in peers]
        bgp += ["  advertise-all-vni", " exit-address-family", ""]
        return zebra, "\n".join(bgp)

    def start_frr(self, peers: list[str]) -> None:
        frr = pwd.getpwnam("frr")
        self.dir.mkdir(parents=True, exist_ok=True)
        os.chown(self.dir, frr.pw_uid, frr.pw_gid)
        zebra, bgpd = self.frr_config(peers)
        for daemon, text in (("zebra", zebra), ("bgpd", bgpd)):
            conf = self.dir / f"{daemon}.conf"
            conf.write_text(text)
            os.chown(conf, frr.pw_uid, frr.pw_gid)
        zserv = str(self.dir / "zserv.api")
        for daemon in ("zebra", "bgpd"):
            cmd = [*netns_exec(self.ns), str(FRR_DIR / daemon), "-u", "frr", "-g", "frr",
                   "-P", "0", "--vty_socket", str(self.dir), "-z", zserv,
                   "-i", str(self.dir / f"{daemon}.pid"), "-f", str(self.dir / f"{daemon}.conf")]
            log = open_log(f"{self.name}-{daemon}", ".log", None, " ".join(cmd))
            self._logs.append(log)
            self.procs.append(subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log,
                                               stderr=subprocess.STDOUT,
                                               start_new_session=True))
            # bgpd connects to zebra's socket: wait for it
            if daemon == "zebra":
                deadline = time.monotonic() + 20
                while not Path(zserv).exists():
                    if self.procs[-1].poll() is not None or time.monotonic() > deadline:
                        raise HarnessError(f"{self.name}: zebra did not start "
                                           f"(log {log.name})")
                    time.sleep(0.05)

    def stop_frr(self) -> None:
        for p in reversed(self.procs):
            stop(p)
        self.procs = []
        for log in self._logs:
            log.close()
        self._logs = []
        # FRR's own log files go with the fabric's directory: keep a copy
        for daemon in ("zebra", "bgpd"):
            src = self.dir / f"{daemon}.log"
            if src.exists():
                with open_log(f"{self.name}-{daemon}", ".frr.log") as dst:
                    dst.write(src.read_text(errors="replace"))


class Fabric:
    """``hosts`` namespaced hosts on one underlay, one VNI (context manager).
    ``underlay_mtu``: the MTU of the underlay links (the VXLAN device gets 50 less)."""

    def __init__(self, hosts: int = 2, vni: int = 100, underlay_mtu: int = 1500,
                 prefix: str | None = None):
        self.prefix = prefix or f"gsnev{os.getpid() % 10000}"
        self.vni = vni
        self.vxlan = f"vx{vni}"
        self.underlay_mtu = underlay_mtu
        self.underlay_ns = f"{self.prefix}u"
        # frr (the daemons' user) must reach its files: a 0755 directory of our own
        self.workdir = Path(tempfile.mkdtemp(prefix="gsonet-evpn-", dir="/run"))
        os.chmod(self.workdir, 0o755)
        self.hosts = [Host(self, i) for i in range(hosts)]
        self.endpoints: list[str] = []

    # -- building ---------------------------------------------------------------

    def start(self) -> "Fabric":
        try:
            self._underlay()
            for h in self.hosts:
                self._host(h)
            for h in self.hosts:
                h.start_frr([o.vtep for o in self.hosts if o is not h])
        except BaseException:
            self.stop()
            raise
        return self

    def _underlay(self) -> None:
        _run("ip", "netns", "add", self.underlay_ns)
        u = ["ip", "-n", self.underlay_ns]
        _run(*u, "link", "set", "lo", "up")
        _run(*u, "link", "add", "ul", "type", "bridge", "stp_state", "0", "forward_delay", "0")
        _run(*u, "link", "set", "ul", "mtu", str(self.underlay_mtu), "up")

    def _host(self, h: Host) -> None:
        _run("ip", "netns", "add", h.ns)
        h.ip("link", "set", "lo", "up")
        port = f"p{h.index + 1}"  # the underlay switch's port to this host
        _run("ip", "link", "add", UNDERLAY_IF, "netns", h.ns, "mtu", str(self.underlay_mtu),
             "type", "veth", "peer", "name", port, "netns", self.underlay_ns,
             "mtu", str(self.underlay_mtu))
        _run("ip", "-n", self.underlay_ns, "link", "set", port, "master", "ul", "up")
        h.ip("addr", "add", f"{h.vtep}/24", "dev", UNDERLAY_IF)
        h.ip("link", "set", UNDERLAY_IF, "up")
        # One bridge per VNI, the VXLAN device a port of it: the kernel here has no
        # bridge VLAN filtering (docs/multihost.md).
        h.ip("link", "add", BRIDGE, "type", "bridge", "stp_state", "0", "forward_delay", "0")
        h.ip("link", "add", self.vxlan, "type", "vxlan", "id", str(self.vni),
             "local", h.vtep, "dstport", "4789", "nolearning")
        h.ip("link", "set", self.vxlan, "master", BRIDGE, "addrgenmode", "none")
        h.sh("bridge", "link", "set", "dev", self.vxlan, "learning", "off", "neigh_suppress", "on")
        h.ip("link", "set", self.vxlan, "up")
        h.ip("link", "set", BRIDGE, "up")

    def attach(self, host: int, ifname: str) -> None:
        """Put ``ifname`` (in host ``host``'s namespace) into the bridge, up."""
        h = self.hosts[host]
        h.ip("link", "set", ifname, "master", BRIDGE)
        h.ip("link", "set", ifname, "up")

    def add_endpoint(self, host: int, name: str, ip: str, ip6: str, mtu: int) -> str:
        """A namespace ``{prefix}{name}`` with a veth ``eth0`` into host ``host``'s
        bridge, with ``ip`` and ``ip6`` (no DAD): a machine on the host's segment
        that is not a guest (a container, a bare-metal server). Returns the namespace."""
        ns = f"{self.prefix}{name}"
        h = self.hosts[host]
        _run("ip", "netns", "add", ns)
        self.endpoints.append(ns)
        peer = f"ep{name}"[:15]
        _run("ip", "link", "add", "eth0", "netns", ns, "mtu", str(mtu), "type", "veth",
             "peer", "name", peer, "netns", h.ns)
        self.attach(host, peer)
        _run("ip", "-n", ns, "link", "set", "lo", "up")
        _run(*netns_exec(ns), "sysctl", "-qw", "net.ipv6.conf.eth0.accept_dad=0")
        _run("ip", "-n", ns, "addr", "add", ip, "dev", "eth0")
        _run("ip", "-n", ns, "-6", "addr", "add", ip6, "dev", "eth0", "nodad")
        _run("ip", "-n", ns, "link", "set", "eth0", "up")
        return ns

    def wait_established(self, timeout: float = 60.0) -> float:
        """Wait until every host has every BGP session Established and knows every
        other VTEP for the VNI. Returns the seconds it took."""
        t0 = time.monotonic()
        deadline = t0 + timeout
        others = len(self.hosts) - 1
        while True:
            ready = True
            for h in self.hosts:
                try:
                    summ = h.vtysh_json("show bgp l2vpn evpn summary")
                    peers = summ.get("peers", {})
                    vni = h.vtysh_json(f"show evpn vni {self.vni}")
                except (HarnessError, ValueError):
                    ready = False
                    break
                up = [p for p in peers.values() if p.get("state") == "Established"]
                # FRR 8.4 lists the addresses under this name
                vteps = vni.get("numRemoteVteps", 0)
                vteps = len(vteps) if isinstance(vteps, list) else vteps
                if len(up) < others or vteps != others:
                    ready = False
                    break
            if ready:
                return time.monotonic() - t0
            if time.monotonic() > deadline:
                raise HarnessError("EVPN fabric not up after "
                                   f"{timeout}s:\n{self.describe()}")
            time.sleep(0.25)

    # -- reading ----------------------------------------------------------------

    def macs(self, host: int) -> dict[str, dict]:
        """`show evpn mac vni all json` for our VNI on host ``host``: {mac: entry}
        (entry: type local/remote, intf or remoteVtep, localSequence, remoteSequence)."""
        data = self.hosts[host].vtysh_json("show evpn mac vni all")
        return data.get(str(self.vni), {}).get("macs", {})

    def type2_routes(self, host: int) -> str:
        """The BGP EVPN type-2 (MAC/IP) routes host ``host`` holds, as vtysh prints them."""
        return self.hosts[host].vtysh("show bgp l2vpn evpn route type macip")

    def fdb(self, host: int) -> str:
        """`bridge fdb show` of the VXLAN device on host ``host``."""
        return self.hosts[host].sh("bridge", "fdb", "show", "dev", self.vxlan).stdout

    def describe(self) -> str:
        out = []
        for h in self.hosts:
            for c in ("show bgp l2vpn evpn summary", "show evpn vni",
                      "show evpn mac vni all"):
                try:
                    out.append(f"--- {h.name}: {c}\n{h.vtysh(c)}")
                except HarnessError as e:
                    out.append(f"--- {h.name}: {c}: {e}")
            out.append(f"--- {h.name}: bridge fdb\n"
                       f"{h.sh('bridge', 'fdb', 'show', check=False).stdout}")
        return "\n".join(out)

    # -- tearing down -------------------------------------------------------------

    def stop(self) -> None:
        for h in self.hosts:
            h.stop_frr()
        for ns in self.endpoints + [h.ns for h in self.hosts] + [self.underlay_ns]:
            _run("ip", "netns", "del", ns, check=False)
        self.endpoints = []
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> "Fabric":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

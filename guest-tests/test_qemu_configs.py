"""qemu-configs/*.sh checked against QEMU and gsonet themselves, not against the builder
that writes their command lines: each script prints its commands (PRINT_ONLY=1), the
test starts them (QEMU paused with -S, before the guest runs a single instruction) and
asks what they made of them. QEMU's QMP gives the shared memory, the vhost-user
chardev, the virtio-net-pci properties and the feature bits the device offers the
guest; gsonet's control socket gives its ports and uplink. The expectations are the
ones the scripts document (qemu-configs/common.sh), written out here."""

import json
import os
import subprocess
from pathlib import Path

import pytest

from harness import paths
from harness.process import connect_unix, stop

NET = "10.77.0"
MIB = 1 << 20

# What every script gives every guest (common.sh): mergeable RX buffers and
# 1024-entry rings, and QEMU's defaults for the offloads.
COMMON_PROPS = {"mrg_rxbuf": True, "rx_queue_size": 1024, "tx_queue_size": 1024}
DEFAULT_FEATURES = {"CSUM", "GUEST_CSUM", "HOST_TSO4", "HOST_TSO6", "GUEST_TSO4",
                    "GUEST_TSO6", "MRG_RXBUF", "MAC"}


def _script(name: str, work: Path, **env) -> dict[str, list[str]]:
    """Runs qemu-configs/NAME in print mode; {"gsonet": argv, "qemu vm1": argv, ...}."""
    clean = {k: v for k, v in os.environ.items()
             if k not in ("KERNEL", "INITRD", "MEM", "ACCEL", "NET", "CONSOLE", "OFFLOADS",
                          "EXTRA_QEMU", "TAP", "QUEUES", "PORT_OPTS", "UPLINK_OPTS",
                          "VM2_OFFLOADS")}
    out = subprocess.run(["bash", str(paths.REPO / "qemu-configs" / name)], check=True,
                         capture_output=True, text=True, timeout=60,
                         env={**clean, "PRINT_ONLY": "1", "WORK": str(work),
                              "GSONET": paths.GSONET_BIN, "KERNEL": str(paths.KERNEL),
                              "INITRD": str(paths.INITRD), **env}).stdout
    cmds: dict[str, list[str]] = {}
    for line in out.splitlines():
        if line.startswith("--- "):
            cur = cmds.setdefault(line[4:], [])
        else:
            cur.append(line)
    return cmds


class Qmp:
    """A minimal QMP client: one command at a time, events skipped."""

    def __init__(self, path: Path):
        self.sock = connect_unix(str(path), timeout=30)
        self.f = self.sock.makefile("rw")
        json.loads(self.f.readline())  # greeting
        self("qmp_capabilities")

    def __call__(self, cmd: str, **args):
        self.f.write(json.dumps({"execute": cmd, "arguments": args}) + "\n")
        self.f.flush()
        while True:
            r = json.loads(self.f.readline())
            if "error" in r:
                raise AssertionError(f"{cmd} {args}: {r['error']}")
            if "return" in r:
                return r["return"]

    def close(self):
        self.sock.close()


class Paused:
    """The QEMU of one script command line, started with -S and a QMP socket."""

    def __init__(self, name: str, argv: list[str], work: Path):
        self.qmp_path = work / f"{name}.qmp"
        self.log = open(work / f"{name}.qemu.log", "w")
        self.proc = subprocess.Popen(
            argv + ["-S", "-qmp", f"unix:{self.qmp_path},server=on,wait=off"],
            stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT)
        self.qmp = None

    def connect(self) -> Qmp:
        try:
            self.qmp = Qmp(self.qmp_path)
        except OSError:
            self.log.flush()
            raise AssertionError(f"QEMU did not start: {self.proc.poll()}\n"
                                 f"{Path(self.log.name).read_text()}")
        return self.qmp

    def device(self, prop: str):
        """A property of the (only) virtio-net-pci device."""
        return self.qmp("qom-get", path=self._dev(), property=prop)

    def _dev(self) -> str:
        kids = self.qmp("qom-list", path="/machine/peripheral-anon")
        nets = [k["name"] for k in kids if k["type"] == "child<virtio-net-pci>"]
        assert len(nets) == 1, kids
        return f"/machine/peripheral-anon/{nets[0]}"

    def features(self) -> set[str]:
        """The VIRTIO_NET_F_* bits the device offers the guest (names without prefix)."""
        st = self.qmp("x-query-virtio-status", path=f"{self._dev()}/virtio-backend")
        return {f.split(":")[0].removeprefix("VIRTIO_NET_F_")
                for f in st["host-features"]["dev-features"]
                if f.startswith("VIRTIO_NET_F_")}

    def chardev(self, label: str) -> dict:
        devs = {c["label"]: c for c in self.qmp("query-chardev")}
        return devs[label]

    def close(self):
        if self.qmp:
            try:
                self.qmp("quit")
            except (OSError, ValueError, AssertionError):
                pass
            self.qmp.close()
        stop(self.proc)
        self.log.close()


class Rig:
    """gsonet and the paused guests of one script, started from its printed commands."""

    def __init__(self, script: str, work: Path, gsonet_first: bool = True, **env):
        self.tap = f"gsqc{os.getpid() % 10000}"
        self.work = work
        self.cmds = _script(script, work, TAP=self.tap, **env)
        self.gsonet = None
        self.guests: dict[str, Paused] = {}
        self.glog = open(work / "gsonet.log", "w")
        if gsonet_first:
            self._start_gsonet()
        for key, argv in self.cmds.items():
            if key.startswith("qemu "):
                self.guests[key[5:]] = Paused(key[5:], argv, work)
        if not gsonet_first:
            self._start_gsonet()
        for g in self.guests.values():
            g.connect()

    def _start_gsonet(self):
        self.gsonet = subprocess.Popen(self.cmds["gsonet"], stdin=subprocess.DEVNULL,
                                       stdout=self.glog, stderr=subprocess.STDOUT)
        control = self.work / "control.sock"
        connect_unix(str(control), timeout=15).close()

    def stats(self) -> dict:
        out = subprocess.run([paths.GSONET_BIN, "stats", "--json", "--control",
                              str(self.work / "control.sock")],
                             check=True, capture_output=True, text=True, timeout=30)
        return json.loads(out.stdout)

    def close(self):
        for g in self.guests.values():
            g.close()
        stop(self.gsonet)
        self.glog.close()
        # The scripts keep gsonet's default, a persistent tap: remove it.
        subprocess.run(["ip", "link", "del", self.tap], capture_output=True)


@pytest.fixture
def rig(guest_env, tmp_path):
    made = []

    def make(script: str, **kw) -> Rig:
        r = Rig(script, tmp_path, **kw)
        made.append(r)
        return r
    yield make
    for r in made:
        r.close()


def _check_guest(g: Paused, sock: Path, mem_mib: int = 512, server: bool = False,
                 props: dict | None = None, features_off: set[str] = frozenset(),
                 features_on: set[str] = frozenset()):
    mem = g.qmp("query-memdev")
    assert [(m["id"], m["size"], m["share"]) for m in mem] == [("mem", mem_mib * MIB, True)]
    c0 = g.chardev("c0")
    assert c0["filename"] == f"unix:{sock}" + (",server=on" if server else ""), c0
    assert c0["frontend-open"], c0
    for k, v in {**COMMON_PROPS, **(props or {})}.items():
        assert g.device(k) == v, k
    feats = g.features()
    want = (DEFAULT_FEATURES - features_off) | features_on
    assert want <= feats, f"missing {want - feats}"
    assert not feats & features_off, f"offered although off: {feats & features_off}"


def _check_console_file(g: Paused, path: Path):
    """A console in a file: QMP names only the backend; QEMU made the file."""
    assert g.chardev("serial0")["filename"] == "file"
    assert path.exists()


def _check_gsonet(r: Rig, sockets: list[Path], tap_queues: int = 1):
    s = r.stats()
    assert [p["name"] for p in s["ports"]] == [str(p) for p in sockets]
    assert [u["name"] for u in s["uplinks"]] == [f"tap={r.tap}"]
    queues = sorted(q.name for q in Path(f"/sys/class/net/{r.tap}/queues").iterdir()
                    if q.name.startswith("rx-"))
    assert queues == [f"rx-{i}" for i in range(tap_queues)]


def test_one_guest_tap(rig, tmp_path):
    r = rig("one-guest-tap.sh")
    sock = tmp_path / "vm1.sock"
    assert set(r.guests) == {"vm1"}
    _check_guest(r.guests["vm1"], sock)
    _check_gsonet(r, [sock])


@pytest.mark.parametrize("vm2_props", ["", "guest_tso4=off"])
def test_two_guests(rig, tmp_path, vm2_props):
    r = rig("two-guests.sh", VM2_OFFLOADS=vm2_props)
    s1, s2 = tmp_path / "vm1.sock", tmp_path / "vm2.sock"
    assert set(r.guests) == {"vm1", "vm2"}
    _check_guest(r.guests["vm1"], s1)
    off = {"GUEST_TSO4"} if vm2_props else set()
    _check_guest(r.guests["vm2"], s2, props={"guest_tso4": not vm2_props},
                 features_off=off)
    # Each guest's console: vm1 in a file (in the background), vm2 on stdio.
    _check_console_file(r.guests["vm1"], tmp_path / "vm1.console")
    assert r.guests["vm2"].chardev("serial0")["filename"] == "stdio"
    _check_gsonet(r, [s1, s2])


def test_multiqueue(rig, tmp_path):
    r = rig("multiqueue.sh")
    sock = tmp_path / "mq.sock"
    g = r.guests["mq"]
    _check_guest(g, sock, props={"mq": True, "vectors": 6}, features_on={"MQ", "CTRL_VQ"})
    assert len(g.qmp("query-cpus-fast")) == 2
    _check_gsonet(r, [sock], tap_queues=2)


def test_client_mode(rig, tmp_path):
    r = rig("client-mode.sh", gsonet_first=False)
    sock = tmp_path / "qemu-srv.sock"
    _check_guest(r.guests["vm1"], sock, server=True)
    _check_gsonet(r, [sock])


def test_environment_reaches_the_command_line(rig, tmp_path):
    """CONSOLE=file, MEM, OFFLOADS and EXTRA_QEMU as the scripts document them."""
    uuid = "6d3a0f7e-5b1c-4c2e-9a51-0123456789ab"
    r = rig("one-guest-tap.sh", CONSOLE="file", MEM="1G",
            OFFLOADS="host_tso4=off,guest_csum=off", EXTRA_QEMU=f"-uuid {uuid}")
    g = r.guests["vm1"]
    _check_guest(g, tmp_path / "vm1.sock", mem_mib=1024,
                 props={"host_tso4": False, "guest_csum": False},
                 features_off={"HOST_TSO4", "GUEST_CSUM"})
    _check_console_file(g, tmp_path / "vm1.console")
    assert g.qmp("query-uuid")["UUID"] == uuid

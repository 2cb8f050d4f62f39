"""libvirt's vhostuser interface on gsonet: qemu-configs/libvirt-gsonet.xml validates
against libvirt's schema (virt-xml-validate), and a libvirtd started by the test
(Debian's libvirt 9.0, qemu:///system on a private socket) defines and starts that
domain, with this tree's guest image, on a running gsonet: QEMU 10 connects as
libvirt-qemu through a socket of group kvm, the guest negotiates the offloads the
<driver> element leaves on, and frames cross both ways.

libvirt 9.0 and QEMU 10 need one change to the domain: <features><acpi/></features>
(without it libvirt passes -no-acpi, which QEMU 10 removed).
"""

import os
import shutil
import socket
import subprocess
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from harness.gsonet import Gsonet
from harness.hostnet import alloc_subnet, delete_link, set_addr
from harness.paths import INITRD, KERNEL, LOG_DIR
from harness.process import stop

XML = Path(__file__).resolve().parent.parent / "qemu-configs" / "libvirt-gsonet.xml"


def test_domain_xml_validates():
    if shutil.which("virt-xml-validate") is None or shutil.which("xmllint") is None:
        pytest.skip("virt-xml-validate/xmllint not installed (run scripts/setup.sh)")
    p = subprocess.run(["virt-xml-validate", str(XML), "domain"], capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    dom = ET.parse(XML).getroot()
    iface = dom.find("devices/interface[@type='vhostuser']")
    assert iface.find("source").get("mode") == "client"
    assert iface.find("source/reconnect").get("enabled") == "yes"
    assert dom.find("memoryBacking/source").get("type") == "memfd"
    assert dom.find("memoryBacking/access").get("mode") == "shared"
    assert iface.find("driver/host").get("tso4") == "on"
    assert iface.find("driver/guest").get("tso4") == "on"
    # The same schema refuses a broken interface: the check can fail.
    bad = XML.read_text().replace("tso4='on' tso6='on' ecn='on' ufo='on' mrg_rxbuf",
                                  "tso4='maybe' tso6='on' ecn='on' ufo='on' mrg_rxbuf")
    with tempfile.NamedTemporaryFile("w", suffix=".xml") as f:
        f.write(bad)
        f.flush()
        p = subprocess.run(["virt-xml-validate", f.name, "domain"], capture_output=True,
                           text=True, timeout=60)
    assert p.returncode != 0


def _live(sock: str) -> bool:
    with socket.socket(socket.AF_UNIX) as s:
        return s.connect_ex(sock) == 0


class Libvirtd:
    """libvirtd (and virtlogd, unless one runs) on a private control socket."""

    def __init__(self, work: Path):
        self.work = work
        self.sock_dir = work / "sock"
        self.uri = f"qemu+unix:///system?socket={self.sock_dir}/libvirt-sock"
        self.procs: list[subprocess.Popen] = []
        self.log = LOG_DIR / f"libvirtd-{os.getpid()}.log"

    def start(self) -> None:
        self.sock_dir.mkdir(mode=0o700)
        conf = self.work / "libvirtd.conf"
        conf.write_text(
            f'unix_sock_dir = "{self.sock_dir}"\nunix_sock_rw_perms = "0700"\n'
            'auth_unix_rw = "none"\nauth_unix_ro = "none"\n'
            f'log_outputs = "2:file:{self.log}"\n')
        LOG_DIR.mkdir(parents=True, exist_ok=True)
        if not _live("/run/libvirt/virtlogd-sock"):
            self.procs.append(subprocess.Popen(["virtlogd"], stdout=subprocess.DEVNULL,
                                               stderr=subprocess.DEVNULL,
                                               start_new_session=True))
        self.procs.append(subprocess.Popen(
            ["libvirtd", "-f", str(conf), "-p", str(self.work / "libvirtd.pid")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True))
        deadline = time.monotonic() + 30
        while self.virsh("version", check=False).returncode != 0:
            if self.procs[-1].poll() is not None or time.monotonic() > deadline:
                pytest.skip(f"libvirtd did not start here (log: {self.log})")
            time.sleep(0.2)

    def virsh(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        p = subprocess.run(["virsh", "-c", self.uri, *args], capture_output=True, text=True,
                           timeout=120)
        if check:
            assert p.returncode == 0, f"virsh {' '.join(args)}: {p.stdout}{p.stderr}"
        return p

    def stop(self) -> None:
        for p in reversed(self.procs):
            stop(p)


def _domain(name: str, sock: str, img: Path, guest_ip: str) -> str:
    dom = ET.parse(XML).getroot()
    dom.find("name").text = name
    dom.find("os/kernel").text = str(img / "bzImage")
    dom.find("os/initrd").text = str(img / "initramfs.cpio.gz")
    dom.find("os/cmdline").text = f"console=ttyS0 gsonet.ip={guest_ip}/24 gsonet.hostname={name}"
    dom.find("devices/emulator").text = shutil.which("qemu-system-x86_64")
    dom.find("devices/interface/source").set("path", sock)
    return ET.tostring(dom, encoding="unicode")


def test_libvirt_starts_a_guest_on_gsonet(guest_env):
    if shutil.which("libvirtd") is None or shutil.which("virsh") is None:
        pytest.skip("libvirtd not installed (scripts/setup.sh installs libvirt-daemon-system)")
    # Everything QEMU (libvirt-qemu, group kvm) opens must be reachable by it: not
    # under pytest's 0700 temporary directories.
    work = Path(tempfile.mkdtemp(prefix="gsonet-libvirt-"))
    work.chmod(0o755)
    img = work / "img"
    img.mkdir(mode=0o755)
    for f in (KERNEL, INITRD):
        shutil.copy(f, img / f.name)
        (img / f.name).chmod(0o644)
    n = alloc_subnet()
    tap = f"gsnlv{os.getpid() % 100000}"
    sock = str(work / "run" / "vm1.sock")
    name = f"gsonet-test-{os.getpid()}"
    gs = Gsonet([f"socket={sock},socket_group=kvm,socket_mode=0660"], [f"tap={tap}"],
                workdir=work, name="gsonet-libvirt")
    lv = Libvirtd(work)
    defined = False
    try:
        gs.start()
        set_addr(tap, f"10.77.{n}.1/24")
        lv.start()
        xml = work / "domain.xml"
        xml.write_text(_domain(name, sock, img, f"10.77.{n}.2"))
        lv.virsh("define", str(xml))
        defined = True
        lv.virsh("start", name)
        p = gs.wait_port(0, timeout=120)
        assert p["guest_tx"]["tso4"] and p["guest_rx"]["tso4"], p
        # Frames both ways: the guest answers a TCP SYN to a closed port with a RST
        # (its init is up once it has an address; retry until then).
        deadline = time.monotonic() + 120
        while True:
            with socket.socket() as s:
                s.settimeout(2)
                r = s.connect_ex((f"10.77.{n}.2", 5201))
            if r == 111:  # ECONNREFUSED: the guest's RST came back
                break
            assert time.monotonic() < deadline, f"no answer from the guest (errno {r})"
            time.sleep(1)
        st = gs.port_stats(0)["stats"]
        assert st["tx_frames"] > 0 and st["rx_frames"] > 0, st
    finally:
        if defined:
            lv.virsh("destroy", name, check=False)
            lv.virsh("undefine", name, check=False)
        lv.stop()
        gs.stop()
        delete_link(tap)
        shutil.rmtree(work, ignore_errors=True)

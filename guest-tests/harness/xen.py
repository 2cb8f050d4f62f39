"""The nested Xen rig (guest-tests/xen/): Xen 4.17 + a PV dom0 under QEMU TCG, booted
with a dom0 script; the script's `RESULT key=value` and `XT-STATS tag {json}` lines
are collected from the serial console.

The rig's images are built once by guest-tests/xen/build.sh. What changes per run
(the script, the gsonet binary under test and its libraries) goes into a small cpio
concatenated to dom0's initramfs, so a new gsonet needs no image rebuild.

    from harness.xen import XenRig
    run = XenRig("kernel-netback", SCRIPT).run()     # raises XenRunError on failure
    run.results["dom0_to_domu_mbps"]
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from . import paths
from .process import HarnessError, Output, WaitTimeout, stop

XEN_DIR = paths.GUEST_TESTS / "xen"
XEN_OUT = paths.GUEST_TESTS / ".cache" / "xen" / "out"
XEN_ELF = XEN_OUT / "xen.elf"
DOM0_KERNEL = XEN_OUT / "vmlinuz"
DOM0_INITRD = XEN_OUT / "dom0.cpio.gz"
QEMU_MODULE = XEN_OUT / "qemu.cpio.gz"
SCENARIOS = XEN_DIR / "scenarios"

# dom0 gets one of the two emulated CPUs, the domU the other. GSONET_XEN_DOM0_VCPUS=2
# gives dom0 both (shared with the domU), to measure what a userspace netback gains.
DOM0_VCPUS = int(os.environ.get("GSONET_XEN_DOM0_VCPUS", "1"))
XEN_ARGS = (f"dom0_mem=1024M,max:1024M dom0_max_vcpus={DOM0_VCPUS} console=com1 "
            "com1=115200,8n1 loglvl=warning guest_loglvl=warning noreboot")
DOM0_ARGS = "console=hvc0 earlyprintk=xen loglevel=4"

RESULT = re.compile(r"^RESULT ([A-Za-z0-9_.:-]+)=(.*?)\s*$", re.M)
STATS = re.compile(r"^XT-STATS (\S+) (\{.*\})\s*$", re.M)
FAILED = re.compile(r"^XT-FAIL (.*)$", re.M)
DONE = re.compile(r"^XT-DONE rc=(\d+)", re.M)


class XenRunError(HarnessError):
    """The rig did not boot, the script failed, or it ran out of time; the message
    names the console log."""


def rig_ready() -> bool:
    return all(p.exists() for p in (XEN_ELF, DOM0_KERNEL, DOM0_INITRD, QEMU_MODULE))


def skip_reason() -> str | None:
    """Why the rig cannot run here, or None."""
    if os.geteuid() != 0:
        return "the Xen rig needs root (its images are built from apt packages)"
    if shutil.which(paths.QEMU) is None:
        return f"{paths.QEMU} not installed (run scripts/setup.sh)"
    for tool in ("cpio", "gzip", "ldd"):
        if shutil.which(tool) is None:
            return f"{tool} not installed (run scripts/setup.sh)"
    return None


def build_rig() -> None:
    """Build (or confirm up to date) the rig's images."""
    subprocess.run([str(XEN_DIR / "build.sh")], check=True)


def gsonet_has_xen(binary: str | None = None) -> bool:
    """Whether the gsonet binary knows `serve --xen-vif`."""
    try:
        p = subprocess.run([binary or paths.GSONET_BIN, "serve", "--help"],
                           capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "--xen-vif" in p.stdout


@dataclass
class XenRun:
    """What one boot of the rig reported."""
    rc: int
    results: dict[str, str]
    stats: dict[str, dict]
    failures: list[str]
    console: str
    log_path: str
    seconds: float
    notes: list[str] = field(default_factory=list)

    def number(self, key: str) -> float:
        """A RESULT as a float; XenRunError when it is missing or not a number."""
        try:
            return float(self.results[key])
        except (KeyError, ValueError):
            raise XenRunError(f"no numeric RESULT {key} (have {self.results}); "
                              f"console: {self.log_path}") from None


def needed_libs(binary: str) -> list[str]:
    out = subprocess.run(["ldd", binary], capture_output=True, text=True, check=True).stdout
    libs = []
    for line in out.splitlines():
        m = re.search(r"=> (/\S+)", line) or re.match(r"\s*(/\S+)", line)
        if m:
            libs.append(m.group(1))
    return libs


def _cpio_gz(tree: Path, dest: Path) -> None:
    """TREE as a gzipped newc cpio (owned by root) at DEST."""
    names = sorted(str(p.relative_to(tree)) for p in tree.rglob("*"))
    data = subprocess.run(["cpio", "-o", "-H", "newc", "--owner=0:0", "--quiet"],
                          input=("\n".join(names) + "\n").encode(), cwd=tree,
                          capture_output=True, check=True).stdout
    dest.write_bytes(subprocess.run(["gzip", "-1"], input=data, capture_output=True,
                                    check=True).stdout)


def scenario(*names: str, **env: object) -> str:
    """A dom0 script: ``env`` exported, then guest-tests/xen/scenarios/NAME.sh for
    each name in turn (each ends with `teardown`, so several share one boot)."""
    head = "".join(f"export {k}={shlex.quote(str(v))}\n" for k, v in env.items())
    return head + "\n".join((SCENARIOS / f"{n}.sh").read_text() for n in names)


class XenRig:
    """One boot of the rig running ``script`` (a POSIX shell script run by dom0's
    /init as /xt/test.sh, with /xt/lib.sh to source and /xt/gsonet when ``gsonet``).

    ``files``: more files for /xt (name -> bytes or str). ``qemu``: add QEMU's Xen
    device model (for the userspace netback baseline). ``timeout``: seconds for the
    whole run, boot included. ``dom0_args``: more words for dom0's command line.
    ``monitor``: a Unix socket path for QEMU's human monitor (scripts/xen_profile.py
    samples the vCPUs' registers through it). ``xen_args``: more words for Xen's own
    command line (e.g. ``dom0_vcpus_pin``)."""

    def __init__(self, name: str, script: str, *, gsonet: bool = True,
                 gsonet_bin: str | None = None, qemu: bool = False,
                 files: dict[str, bytes | str] | None = None, timeout: float = 2400,
                 dom0_args: str = "", log_dir: Path | str | None = None,
                 monitor: str | None = None, xen_args: str = ""):
        self.name = name
        self.xen_args = xen_args
        self.script = script
        self.gsonet = gsonet
        self.gsonet_bin = gsonet_bin or paths.GSONET_BIN
        self.qemu = qemu
        self.files = files or {}
        self.timeout = timeout
        self.dom0_args = dom0_args
        self.log_dir = log_dir
        self.monitor = monitor

    def _overlay(self, work: Path) -> Path:
        tree = work / "overlay"
        xt = tree / "xt"
        xt.mkdir(parents=True)
        (xt / "test.sh").write_text(self.script)
        shutil.copy2(XEN_DIR / "lib.sh", xt / "lib.sh")
        for name, content in self.files.items():
            data = content.encode() if isinstance(content, str) else content
            (xt / name).write_bytes(data)
        if self.gsonet:
            if not Path(self.gsonet_bin).is_file():
                raise XenRunError(f"gsonet binary {self.gsonet_bin} missing "
                                  "(cargo build --release)")
            shutil.copy2(self.gsonet_bin, xt / "gsonet")
            for lib in needed_libs(self.gsonet_bin):
                dest = tree / lib.lstrip("/")
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(os.path.realpath(lib), dest)
        out = work / "overlay.cpio.gz"
        _cpio_gz(tree, out)
        # one initrd: the kernel unpacks concatenated archives in order
        initrd = work / "initrd.cpio.gz"
        with open(initrd, "wb") as f:
            parts = [DOM0_INITRD] + ([QEMU_MODULE] if self.qemu else []) + [out]
            for part in parts:
                f.write(Path(part).read_bytes())
        return initrd

    def argv(self, initrd: Path) -> list[str]:
        dom0 = f"{DOM0_KERNEL} {DOM0_ARGS} {self.dom0_args}".strip()
        return [paths.QEMU, "-accel", "tcg", "-M", "pc", "-cpu", "qemu64,+svm",
                "-m", "2G", "-smp", "2", "-nographic", "-monitor",
                f"unix:{self.monitor},server=on,wait=off" if self.monitor else "none",
                "-serial", "stdio", "-no-reboot", "-nodefaults",
                "-kernel", str(XEN_ELF), "-append", f"{XEN_ARGS} {self.xen_args}".strip(),
                # multiboot modules: "file args,file"; a comma inside is doubled
                "-initrd", f"{dom0.replace(',', ',,')},{str(initrd).replace(',', ',,')}"]

    def run(self, check: bool = True) -> XenRun:
        """Boot, run the script, collect. With ``check`` (default), a non-zero script
        exit, an XT-FAIL line or a timeout raises XenRunError naming the console log."""
        if not rig_ready():
            raise XenRunError(f"Xen rig not built in {XEN_OUT} (guest-tests/xen/build.sh)")
        start = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="gsonet-xen-") as tmp:
            initrd = self._overlay(Path(tmp))
            argv = self.argv(initrd)
            log = paths.open_log(f"xen-{self.name}", ".console.log", self.log_dir,
                                 " ".join(argv))
            log_path = log.name
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            out = Output(f"xen-{self.name}", proc, proc.stdout, log, strip_cr=True)
            rc = -1
            error: str | None = None
            try:
                out.wait_for(r"XT-DOM0-READY", timeout=min(self.timeout, 400))
                left = self.timeout - (time.monotonic() - start)
                m = out.wait_for(DONE, timeout=max(left, 1))
                rc = int(m.group(1))
                try:
                    proc.wait(timeout=60)  # dom0 powers the machine off
                except subprocess.TimeoutExpired:
                    pass
            except WaitTimeout as e:
                error = f"timed out: {str(e).splitlines()[0]}"
            except HarnessError as e:
                error = f"QEMU ended early: {str(e).splitlines()[0]}"
            finally:
                stop(proc, timeout=5)
                out.close()
            text = out.text()
        run = XenRun(
            rc=rc,
            results={k: v for k, v in RESULT.findall(text)},
            stats={},
            failures=FAILED.findall(text),
            console=text,
            log_path=log_path,
            seconds=time.monotonic() - start,
            notes=re.findall(r"^XT-NOTE (.*)$", text, re.M),
        )
        for tag, blob in STATS.findall(text):
            try:
                run.stats[tag] = json.loads(blob)
            except json.JSONDecodeError as e:
                run.failures.append(f"stats {tag} not JSON ({e})")
        if check:
            if error:
                raise XenRunError(f"xen rig {self.name}: {error}; console: {log_path}\n"
                                  f"{text[-3000:]}")
            if rc != 0 or run.failures:
                raise XenRunError(f"xen rig {self.name}: script rc={rc}, "
                                  f"failures={run.failures}; console: {log_path}\n"
                                  f"{text[-4000:]}")
        return run

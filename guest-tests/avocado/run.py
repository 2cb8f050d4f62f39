#!/usr/bin/env python3
"""`make avocado`: tp-qemu's own network tests, unmodified, run by avocado-vt on a
QEMU 10 guest attached to a running gsonet with -netdev vhost-user.

1. avocado-framework and avocado-vt at fixed versions in a virtualenv
   (guest-tests/.cache/avocado/venv), from pip's configured index;
2. tp-qemu as avocado-vt's qemu test provider: AVOCADO_TP_QEMU=PATH (a checkout,
   used in place, or a tarball), else ../shared/avocado/tp-qemu.tar.xz beside the
   repository; `avocado vt-bootstrap --vt-no-downloads` (nothing is fetched);
3. the guest (guest-tests/avocado/image/build.sh, cached);
4. gsonet with one vhost-user port and a tap uplink carrying the host's address;
5. `avocado run` with guest-tests/avocado/gsonet.cfg and the values of this run.

Results: results/avocado-<timestamp>/ (avocado's job folder: results.json,
results.html, job.log, each test's debug.log), gsonet's log and counters beside it.
Exit status: avocado's (0 only when every test passed).

Env: AVOCADO_TESTS (default "ethtool"; names of tp-qemu test entries), AVOCADO_TP_QEMU,
     GSONET_BIN, GSONET_QEMU.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from harness import paths  # noqa: E402
from harness.gsonet import Gsonet  # noqa: E402
from harness.hostnet import alloc_subnet, set_addr, unique_name  # noqa: E402

AVOCADO_VERSION = "113.0"
PIP_PACKAGES = [f"avocado-framework=={AVOCADO_VERSION}",
                f"avocado-framework-plugin-vt=={AVOCADO_VERSION}",
                f"avocado-framework-plugin-result-html=={AVOCADO_VERSION}"]
CACHE = paths.GUEST_TESTS / ".cache" / "avocado"
VENV = CACHE / "venv"
# avocado keeps its data (test providers, backend configs) under ~/avocado: a home of
# its own keeps that in the cache and leaves the user's untouched.
HOME = CACHE / "home"
DATA = HOME / "avocado" / "data" / "avocado-vt"
PROVIDER = "io-github-autotest-qemu"
PROVIDERS_DIR = DATA / "virttest" / "test-providers.d"
PROVIDER_DIR = PROVIDERS_DIR / "downloads" / PROVIDER
CFG_DIR = DATA / "backends" / "qemu" / "cfg"
SHARED_TARBALL = paths.REPO.parent / "shared" / "avocado" / "tp-qemu.tar.xz"
DEFAULT_TESTS = "ethtool"


def say(msg: str) -> None:
    print(f"[avocado] {msg}", flush=True)


def avocado_env() -> dict:
    env = dict(os.environ, HOME=str(HOME))
    env["PATH"] = f"{VENV / 'bin'}:{env.get('PATH', '')}"
    return env


def run_logged(cmd: list, log: Path, env: dict | None = None, cwd: Path | None = None) -> None:
    with open(log, "a", encoding="utf-8") as out:
        out.write("$ " + " ".join(map(str, cmd)) + "\n")
        out.flush()
        rc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd).returncode
    if rc != 0:
        sys.stdout.write(log.read_text(errors="replace")[-4000:])
        raise SystemExit(f"[avocado] failed ({rc}): {' '.join(map(str, cmd))}; log: {log}")


# What avocado-vt's bootstrap and the tests run on the host, by the Debian package
# that has it (the image build needs mmdebstrap).
HOST_COMMANDS = {"mmdebstrap": "mmdebstrap", "nc": "netcat-openbsd", "arping": "iputils-arping",
                 "netstat": "net-tools", "ssh": "openssh-client", "scp": "openssh-client",
                 "tcpdump": "tcpdump", "git": "git"}


def ensure_packages(log: Path) -> None:
    missing = sorted({pkg for cmd, pkg in HOST_COMMANDS.items() if shutil.which(cmd) is None})
    probe = subprocess.run([sys.executable, "-m", "venv", "--help"], capture_output=True)
    if probe.returncode != 0:
        missing.append("python3-venv")
    if not missing:
        return
    say(f"apt-get install {' '.join(missing)}")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    cmd = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *missing]
    if subprocess.run(cmd, stdout=open(log, "a"), stderr=subprocess.STDOUT, env=env).returncode:
        run_logged(["apt-get", "update", "-q"], log, env=env)
        run_logged(cmd, log, env=env)


def ensure_venv(log: Path) -> None:
    stamp = VENV / "gsonet-packages"
    if stamp.exists() and stamp.read_text() == "\n".join(PIP_PACKAGES):
        say(f"avocado {AVOCADO_VERSION}: installed ({VENV})")
        return
    say(f"installing {', '.join(PIP_PACKAGES)} into {VENV}")
    shutil.rmtree(VENV, ignore_errors=True)
    run_logged([sys.executable, "-m", "venv", str(VENV)], log)
    run_logged([str(VENV / "bin" / "pip"), "install", "-q", *PIP_PACKAGES], log)
    stamp.write_text("\n".join(PIP_PACKAGES))


def provider_source() -> Path:
    given = os.environ.get("AVOCADO_TP_QEMU")
    if given:
        src = Path(given).expanduser().resolve()
        if not src.exists():
            raise SystemExit(f"[avocado] AVOCADO_TP_QEMU={given}: no such file or folder")
        return src
    if SHARED_TARBALL.exists():
        return SHARED_TARBALL
    raise SystemExit(
        "[avocado] no tp-qemu: avocado-vt's qemu tests come from tp-qemu "
        "(autotest/tp-qemu on GitHub), which this machine cannot clone. Either "
        f"put its tarball at {SHARED_TARBALL} (the shared folder beside the repository "
        "has one, at a fixed commit), or point AVOCADO_TP_QEMU at a checkout or a "
        "tarball of it: AVOCADO_TP_QEMU=~/src/tp-qemu make avocado")


def register_provider(src: Path, log: Path) -> str:
    """Make PROVIDER_DIR the provider avocado-vt loads (it expects a git repository
    there, which `vt-bootstrap --vt-no-downloads` then leaves alone): a checkout is
    linked in place, so its working tree is what runs; a tarball is unpacked and
    committed once, again only when the tarball changes."""
    PROVIDER_DIR.parent.mkdir(parents=True, exist_ok=True)
    if src.is_dir():
        if not (src / "generic" / "tests").is_dir():
            raise SystemExit(f"[avocado] {src} does not look like tp-qemu (no generic/tests)")
        if not (src / ".git").exists():
            raise SystemExit(f"[avocado] {src}: avocado-vt wants tp-qemu as a git checkout")
        if PROVIDER_DIR.is_symlink() or PROVIDER_DIR.exists():
            if PROVIDER_DIR.is_symlink() and PROVIDER_DIR.resolve() == src:
                return f"{src} (checkout)"
            remove(PROVIDER_DIR)
        PROVIDER_DIR.symlink_to(src)
        return f"{src} (checkout)"
    digest = hashlib.sha256(src.read_bytes()).hexdigest()
    stamp = PROVIDER_DIR / ".gsonet-source"
    if not PROVIDER_DIR.is_symlink() and stamp.exists() and stamp.read_text() == digest:
        return f"{src} (unpacked)"
    remove(PROVIDER_DIR)
    with tempfile.TemporaryDirectory(dir=PROVIDER_DIR.parent) as tmp:
        run_logged(["tar", "-xf", str(src), "-C", tmp, "--no-same-owner"], log)
        tops = list(Path(tmp).iterdir())
        top = tops[0] if len(tops) == 1 and tops[0].is_dir() else Path(tmp)
        git = ["git", "-C", str(top), "-c", "user.name=gsonet", "-c", "user.email=gsonet@localhost"]
        run_logged(git[:3] + ["init", "-q"], log)
        run_logged(git[:3] + ["add", "-A"], log)
        run_logged(git + ["commit", "-q", "-m", f"tp-qemu from {src.name}"], log)
        top.rename(PROVIDER_DIR)
    stamp.write_text(digest)
    return f"{src} (unpacked)"


def remove(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)


def bootstrap(log: Path) -> None:
    run_logged([str(VENV / "bin" / "avocado"), "vt-bootstrap", "--vt-type", "qemu",
                "--vt-no-downloads", "--yes-to-all"], log, env=avocado_env(), cwd=CACHE)
    # bootstrap copies avocado-vt's provider list back each time; only tp-qemu is here
    for ini in PROVIDERS_DIR.glob("*.ini"):
        if ini.stem != PROVIDER:
            ini.unlink()


def job_cfg(tests: list[str], image: Path, n: int, tap: str, sock: Path, mac: str) -> Path:
    cfg = CFG_DIR / "gsonet-run.cfg"
    lines = [
        "include tests-shared.cfg",
        f"include {HERE / 'gsonet.cfg'}",
        "only " + ", ".join(tests),
        f"qemu_binary = {shutil.which(paths.QEMU) or paths.QEMU}",
        f"kernel = {image / 'bzImage'}",
        f"initrd = {image / 'initramfs.cpio.gz'}",
        f"kernel_params = console=ttyS0 gsonet.ip=10.77.{n}.2/24 gsonet.hostname=avocado-vm1",
        f"netdst = {tap}",
        f"mac_nic1 = {mac}",
        f"ip_nic1 = 10.77.{n}.2",
        f"extra_params += \" -chardev socket,id=gsonet_port0,path={sock}\"",
    ]
    cfg.write_text("\n".join(lines) + "\n")
    return cfg


def summary(job_dir: Path) -> tuple[str, list[tuple[str, str, float]]]:
    data = json.loads((job_dir / "results.json").read_text())
    tests = [(t["name"], t["status"], t.get("time_elapsed", 0.0)) for t in data["tests"]]
    counts = {k: data.get(k.lower(), 0) for k in ("PASS", "FAIL", "ERROR", "SKIP", "CANCEL", "INTERRUPT", "WARN")}
    line = "RESULTS    : " + " | ".join(f"{k} {v}" for k, v in counts.items())
    return line, tests


def main() -> int:
    if os.geteuid() != 0:
        raise SystemExit("[avocado] run as root (taps, QEMU networking)")
    CACHE.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = paths.REPO / "results" / f"avocado-{stamp}"
    out.mkdir(parents=True, exist_ok=True)
    log = out / "setup.log"
    tests = (os.environ.get("AVOCADO_TESTS") or DEFAULT_TESTS).split()

    src = provider_source()
    ensure_packages(log)
    ensure_venv(log)
    say(f"tp-qemu: {register_provider(src, log)}")
    bootstrap(log)
    say("vt-bootstrap --vt-no-downloads: done")
    run_logged([str(HERE / "image" / "build.sh")], log)
    image = paths.GUEST_TESTS / ".cache" / "avocado"
    say(f"guest: {image / 'initramfs.cpio.gz'}")

    n = alloc_subnet()
    tap = unique_name("avo")
    mac = "52:54:00:77:%02x:02" % n
    workdir = Path(tempfile.mkdtemp(prefix="gsonet-avocado-"))
    sock = workdir / "vm1.sock"
    with Gsonet([f"socket={sock}"], [f"tap={tap}"], workdir=workdir, log_dir=out) as gs:
        set_addr(tap, f"10.77.{n}.1/24")
        say(f"gsonet: port {sock}, uplink {tap} 10.77.{n}.1/24; log {gs.log_path}")
        cfg = job_cfg(tests, image, n, tap, sock, mac)
        shutil.copy(cfg, out / "gsonet-run.cfg")
        cmd = [str(VENV / "bin" / "avocado"), "run", "--vt-config", str(cfg),
               "--job-results-dir", str(out), "--html", str(out / "results.html")]
        say(f"avocado run: {' '.join(tests)} (tp-qemu generic/tests, unmodified)")
        t0 = time.monotonic()
        rc = subprocess.run(cmd, env=avocado_env(), cwd=CACHE).returncode
        elapsed = time.monotonic() - t0
        stats = gs.stats()
        (out / "gsonet-stats.json").write_text(json.dumps(stats, indent=2) + "\n")
    shutil.rmtree(workdir, ignore_errors=True)

    latest = out / "latest"
    job_dir = latest.resolve() if latest.exists() else None
    if job_dir is None or not (job_dir / "results.json").exists():
        say(f"no avocado results under {out}")
        return rc or 1
    line, results = summary(job_dir)
    port, uplink = stats["ports"][0]["stats"], stats["uplinks"][0]["stats"]
    say(f"{elapsed:.0f} s; gsonet: guest -> tap {uplink.get('rx_frames')} frames, "
        f"{uplink.get('gso_passed')} of them GSO frames passed intact (largest "
        f"{port.get('tx_max_frame')} bytes); tap -> guest {port.get('rx_frames')} frames")
    for name, status, secs in results:
        say(f"{status:6} {secs:6.0f} s  {name}")
    say(line)
    say(f"results: {job_dir} (results.json, results.html, job.log)")
    return rc


if __name__ == "__main__":
    sys.exit(main())

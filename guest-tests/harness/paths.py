"""Where the harness finds its programs and the guest image (built on demand), and
where it writes its logs; programs and the log folder can be set from the environment."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

GUEST_TESTS = Path(__file__).resolve().parent.parent
REPO = GUEST_TESTS.parent
KERNEL = GUEST_TESTS / ".cache" / "bzImage"
INITRD = GUEST_TESTS / ".cache" / "initramfs.cpio.gz"
LOG_DIR = Path(os.environ.get("GSONET_LOG_DIR", REPO / "results" / "guest-logs"))
QEMU = os.environ.get("GSONET_QEMU", "qemu-system-x86_64")
GSONET_BIN = os.environ.get("GSONET_BIN", str(REPO / "target" / "release" / "gsonet"))
TESTPMD = os.environ.get("GSONET_TESTPMD", "dpdk-testpmd")


def image_ready() -> bool:
    return KERNEL.exists() and INITRD.exists()


def build_image() -> None:
    """Build (or confirm up to date) the guest kernel + initramfs."""
    subprocess.run([str(GUEST_TESTS / "image" / "build.sh")], check=True)


def log_path(name: str, suffix: str, log_dir: Path | str | None = None) -> Path:
    """A new log file name: LOG_DIR/<timestamp>-<name>-<pid><suffix>."""
    folder = Path(log_dir or LOG_DIR)
    folder.mkdir(parents=True, exist_ok=True)
    return folder / f"{time.strftime('%Y%m%d-%H%M%S')}-{name}-{os.getpid()}{suffix}"

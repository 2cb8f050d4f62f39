"""Where the harness finds its programs and the guest image (built on demand), and
where it writes its logs; programs and the log folder can be set from the environment."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import IO

GUEST_TESTS = Path(__file__).resolve().parent.parent
REPO = GUEST_TESTS.parent
# The guest kernel series: 6.12 (bookworm-backports, the default) or 6.1 (Debian 12's
# stable kernel, no USO), chosen with GSONET_GUEST_KERNEL; image/build.sh builds each.
GUEST_KERNEL = os.environ.get("GSONET_GUEST_KERNEL", "6.12")
IMAGE_DIR = GUEST_TESTS / ".cache" / ("" if GUEST_KERNEL == "6.12" else f"kernel-{GUEST_KERNEL}")
KERNEL = IMAGE_DIR / "bzImage"
INITRD = IMAGE_DIR / "initramfs.cpio.gz"
TCP_RR = IMAGE_DIR / "tcp_rr"  # the host end of the latency test
LOG_DIR = Path(os.environ.get("GSONET_LOG_DIR", REPO / "results" / "guest-logs"))
QEMU = os.environ.get("GSONET_QEMU", "qemu-system-x86_64")
GSONET_BIN = os.environ.get("GSONET_BIN", str(REPO / "target" / "release" / "gsonet"))
TESTPMD = os.environ.get("GSONET_TESTPMD", "dpdk-testpmd")


def image_ready() -> bool:
    return KERNEL.exists() and INITRD.exists()


def build_image() -> None:
    """Build (or confirm up to date) the guest kernel + initramfs."""
    subprocess.run([str(GUEST_TESTS / "image" / "build.sh")], check=True)


def open_log(name: str, suffix: str, log_dir: Path | str | None = None,
             first_line: str | None = None) -> IO[str]:
    """A new log file LOG_DIR/<timestamp>-<name>-<pid><suffix>, open for writing,
    starting with ``first_line`` (a command line) if given."""
    folder = Path(log_dir or LOG_DIR)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{time.strftime('%Y%m%d-%H%M%S')}-{name}-{os.getpid()}{suffix}"
    log = open(path, "w", encoding="utf-8", errors="replace")
    if first_line is not None:
        log.write(first_line + "\n")
        log.flush()
    return log

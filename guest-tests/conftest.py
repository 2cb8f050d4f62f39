"""Shared fixtures for gsonet's QEMU guest tests.

Markers: ``slow`` (iperf3 runs, file transfers; deselect with -m "not slow");
``full`` (extra guest boots and side-by-side comparisons: QEMU restarts, the
bridge baseline, the receiver without GUEST_TSO). ``-m "not full"`` is the
representative set (`make test`), ``-m "not slow"`` the quick smoke set.
Tests skip with a reason when not root, /dev/net/tun or QEMU is missing.
Console and QEMU logs of every guest go to results/guest-logs/.
"""

import json
import os
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import paths  # noqa: E402
from harness.guest import Guest  # noqa: E402
from harness.hostnet import alloc_subnet, create_tap, delete_link, tun_available  # noqa: E402
from harness.qemu import tap_netdev  # noqa: E402

MEASUREMENTS: dict = {}


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: throughput or bulk transfer under TCG (tens of seconds)")
    config.addinivalue_line("markers", "full: extra guest boots / comparisons, left out of the quick "
                            "representative run (-m 'not full')")


def record(key: str, value) -> None:
    """Keep a measurement; printed at the end and written to results/. Keys of a
    run on the second guest kernel (GSONET_GUEST_KERNEL=6.1) start with `k6.1.`."""
    if paths.GUEST_KERNEL != "6.12":
        key = f"k{paths.GUEST_KERNEL}.{key}"
    MEASUREMENTS[key] = value


@pytest.fixture
def record_measurement():
    """record_measurement(key, value): keep a number for the end-of-run summary
    and results/guest-measurements.json."""
    return record


DESELECTED: list = []


def pytest_deselected(items):
    DESELECTED.extend(items)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    _measurements_summary(terminalreporter)
    _closing_summary(terminalreporter, config)


def _closing_summary(tr, config) -> None:
    """What ran, what was skipped and why, what was deselected and why, in a few
    lines before pytest's own last line."""
    stats = tr.stats
    n = {k: len([r for r in stats.get(k, []) if getattr(r, "when", "call") in ("call", "setup")])
         for k in ("passed", "failed", "error", "skipped")}
    tr.section("what ran")
    tr.write_line(f"guest tests ({paths.GUEST_KERNEL} guest): {n['passed']} passed, "
                  f"{n['failed']} failed, {n['error']} errors, {n['skipped']} skipped; "
                  f"logs: {paths.LOG_DIR}")
    reasons: dict[str, int] = {}
    for rep in stats.get("skipped", []):
        why = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
        why = why.removeprefix("Skipped: ")
        reasons[why] = reasons.get(why, 0) + 1
    for why, count in sorted(reasons.items(), key=lambda kv: -kv[1]):
        tr.write_line(f"  skipped {count}: {why}")
    if DESELECTED:
        expr = config.getoption("markexpr") or config.getoption("keyword") or ""
        modules: dict[str, int] = {}
        for item in DESELECTED:
            modules[item.module.__name__] = modules.get(item.module.__name__, 0) + 1
        per = ", ".join(f"{m} {c}" for m, c in sorted(modules.items()))
        why = (" (marked `full`: extra guest boots and variants; `make test-full` runs "
               "them, then the 6.1 guest and `make avocado`)" if "not full" in expr else "")
        tr.write_line(f"deselected {len(DESELECTED)} by -m \"{expr}\"{why}: {per}")


def _measurements_summary(terminalreporter) -> None:
    if not MEASUREMENTS:
        return
    # gsonet next to QEMU's built-in tap from the same run (test_baseline.py)
    for key in ("guest_to_host_gbps", "host_to_guest_gbps"):
        g, t = MEASUREMENTS.get(f"gsonet.{key}"), MEASUREMENTS.get(f"qemu_tap.{key}")
        if g and t:
            MEASUREMENTS[f"ratio.gsonet_vs_qemu_tap.{key[:-5]}"] = g / t
    terminalreporter.section("guest measurements")
    for k, v in MEASUREMENTS.items():
        terminalreporter.write_line(f"{k}: {v:.3f}" if isinstance(v, float) else f"{k}: {v}")
    out = paths.REPO / "results"
    try:
        out.mkdir(parents=True, exist_ok=True)
        suffix = "" if paths.GUEST_KERNEL == "6.12" else f"-{paths.GUEST_KERNEL}"
        (out / f"guest-measurements{suffix}.json").write_text(json.dumps(MEASUREMENTS, indent=2) + "\n")
    except OSError:
        pass


def _skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "guest tests need root (taps, QEMU networking)"
    if not tun_available():
        return "/dev/net/tun is missing"
    if shutil.which(paths.QEMU) is None:
        return f"{paths.QEMU} not installed (run scripts/setup.sh)"
    if shutil.which("iperf3") is None:
        return "iperf3 not installed (run scripts/setup.sh)"
    return None


@pytest.fixture(scope="session")
def guest_env():
    """Root + tun + QEMU present, guest image built (build.sh is a no-op when current)."""
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    if not paths.image_ready() or os.environ.get("GSONET_SKIP_IMAGE_BUILD") != "1":
        paths.build_image()


@pytest.fixture(scope="session")
def xen_env():
    """The nested Xen rig (guest-tests/xen/), built if it is not; skips where it
    cannot run."""
    from harness import xen
    reason = xen.skip_reason()
    if reason:
        pytest.skip(reason)
    xen.build_rig()


@pytest.fixture(scope="module")
def tap_guest(guest_env):
    """A guest on QEMU's built-in virtio-net + a host tap with 10.77.N.1/24 and
    fd00:77:N::1/64; the guest has .2. Yields a namespace with guest, tap,
    host_ip, guest_ip, host_ip6, guest_ip6, boot_seconds."""
    n = alloc_subnet()
    tap = f"gsnbt{os.getpid() % 100000}"
    ns = SimpleNamespace(
        tap=tap,
        host_ip=f"10.77.{n}.1", guest_ip=f"10.77.{n}.2",
        host_ip6=f"fd00:77:{n}::1", guest_ip6=f"fd00:77:{n}::2",
    )
    create_tap(tap, f"{ns.host_ip}/24", f"{ns.host_ip6}/64")
    g = Guest("baseline", tap_netdev(tap), ip=f"{ns.guest_ip}/24", ip6=f"{ns.guest_ip6}/64")
    try:
        g.start()
        ns.boot_seconds = g.wait_booted()
        ns.guest = g
        yield ns
    finally:
        g.shutdown()
        delete_link(tap)

"""Baselines on the nested Xen rig (guest-tests/xen/, harness/xen.py): Linux's
kernel netback (vifs on a bridge in dom0) and QEMU's userspace netback
(xen-net-device), the two peers gsonet's Xen ports are measured against.

Numbers are recorded (`xen.kernel.*`, `xen.qemu.*`, Mbit/s) for the end-of-run
summary; only ratios from one run mean anything (scripts/xen_bench.py). Each test
is one boot of the rig (about a minute on an idle machine, several when it is busy).
"""

import pytest

from harness import xen

pytestmark = pytest.mark.slow


def _record_all(run, record, prefix):
    for key, value in run.results.items():
        if key.startswith(prefix) and key.endswith("_mbps"):
            record(f"xen.{key}", float(value))


def test_kernel_netback_dom0_domu(xen_env, record_measurement):
    """dom0 <-> domU through xen-netback and a bridge: ping, iperf3 both ways."""
    run = xen.XenRig("kernel-netback", xen.scenario("kernel-netback", XT_SECONDS=5),
                     gsonet=False).run()
    _record_all(run, record_measurement, "kernel.")
    assert run.results["kernel.ping"] == "ok", run.log_path
    assert run.number("kernel.dom0_to_domu_mbps") > 0.1, run.results
    assert run.number("kernel.domu_to_dom0_mbps") > 0.1, run.results


@pytest.mark.full
def test_kernel_netback_two_domus(xen_env, record_measurement):
    """Two domUs on the bridge: domU -> domU iperf3, dom0 <-> domU both ways, and
    16 MiB md5-checked each way between dom0 and a domU."""
    run = xen.XenRig("kernel-netback-2", xen.scenario(
        "kernel-netback", XT_SECONDS=5, XT_DOMUS=2, XT_MD5_MIB=16), gsonet=False).run()
    _record_all(run, record_measurement, "kernel.")
    assert run.number("kernel.domu_to_domu_mbps") > 0.1, run.results
    assert run.results.get("kernel.md5_to_domu") == "ok", run.log_path
    assert run.results.get("kernel.md5_from_domu") == "ok", run.log_path


@pytest.mark.full
def test_qemu_netback(xen_env, record_measurement):
    """dom0 <-> domU through QEMU's xen-net-device on a tap: ping, iperf3 both ways."""
    run = xen.XenRig("qemu-netback", xen.scenario("qemu-netback", XT_SECONDS=5),
                     gsonet=False, qemu=True).run()
    _record_all(run, record_measurement, "qemu.")
    assert run.results["qemu.ping"] == "ok", run.log_path
    assert run.number("qemu.dom0_to_domu_mbps") > 0.01, run.results
    assert run.number("qemu.domu_to_dom0_mbps") > 0.01, run.results

"""The offload matrix (test_offload_matrix.py) with packed virtqueues: both guests
run `-device virtio-net-pci,...,packed=on` on `packed=on` ports, so every transfer
crosses packed rings (TX chains or indirect tables, MRG_RXBUF used entries, the
event structures). The same cases and checks as the split matrix: md5 across each
transfer, large frames with TSO on and none with it off, gsonet segmenting for a
guest that takes no TSO.

Representative here (`make test`): the defaults, TSO on/off over IPv4 and IPv6 and
guest to guest, and a device that takes no TSO4 from gsonet. The rest under `full`.
A module of its own, so its two guests never run beside the split matrix's.
"""

from __future__ import annotations

import os

import pytest

from harness.pair import guest_pair
from test_offload_matrix import DEVICE_CASES, _device_case, _ethtool_case

RING_PACKED = 34
PACKED = {"packed": True}


@pytest.fixture(scope="module")
def mxp(guest_env, tmp_path_factory):
    """As the split matrix's `mx`, with packed rings on both ports and guests; B is
    rebooted with packed=on added to each set of device properties."""
    with guest_pair(tmp_path_factory.mktemp("matrix-packed"), "mxp",
                    tap=f"gsnp{os.getpid() % 100000}",
                    port_opts=(",packed=on", ",packed=on"),
                    props=(PACKED, PACKED)) as ns:
        boot = ns.boot_b
        ns.boot_b = lambda props=None: boot({**PACKED, **(props or {})})
        yield ns


def test_packed_defaults_negotiate_tso_both_ways(mxp):
    for i in (0, 1):
        p = mxp.gs.port_stats(i)
        assert p["acked"] >> RING_PACKED & 1, (i, hex(p["acked"]))
        for side in ("guest_tx", "guest_rx"):
            c = p[side]
            assert c["csum"] and c["tso4"] and c["tso6"] and c["ecn"], (i, side, p)


@pytest.mark.slow
def test_packed_ethtool_tso_on_off_ipv4_ipv6_guest_to_guest(mxp):
    _ethtool_case(mxp, "tso", ipv6=True, g2g=True)


@pytest.mark.slow
@pytest.mark.full
@pytest.mark.parametrize("feature", ["tx", "sg", "gso", "gro"])
def test_packed_ethtool_on_off_ipv6_guest_to_guest(mxp, feature):
    _ethtool_case(mxp, feature, ipv6=True, g2g=True)


REPRESENTATIVE = {"guest_tso4_off"}


@pytest.mark.slow
@pytest.mark.parametrize(
    "props,g2g",
    [pytest.param(props, g2g, id=i, marks=() if i in REPRESENTATIVE else (pytest.mark.full,))
     for i, props, g2g, _ in DEVICE_CASES],
)
def test_packed_device_property(mxp, props, g2g):
    _device_case(mxp, props, g2g)

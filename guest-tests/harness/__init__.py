"""Harness for gsonet's guest tests and measurements: QEMU guests, host networking,
the gsonet process, dpdk-testpmd, iperf3 and md5-checked transfers, one module each."""

# gsonet: the two commands in README.md are `make demo` and `make test`.
# Both install what is missing (scripts/setup.sh: QEMU 10, the 6.12 guest image, tools).

CARGO ?= cargo
PYTEST ?= python3 -m pytest
GSONET_BIN ?= $(CURDIR)/target/release/gsonet
export GSONET_BIN

.PHONY: demo test test-full unit guest-tests bench setup build lint

setup:
	bash scripts/setup.sh

build:
	$(CARGO) build --release

demo:
	bash scripts/demo.sh

# Unit, ring, segmentation, in-process end-to-end tests, then the representative
# QEMU guest tests. `make test-full` runs every guest variant.
test: setup build unit guest-tests

unit:
	$(CARGO) test --release

guest-tests: build
	$(PYTEST) -q guest-tests -m "not full"

test-full: setup build unit
	$(PYTEST) -q guest-tests

# Micro-benchmark of the segmentation engine, then the side-by-side iperf3 run
# (gsonet vs QEMU virtio-net + tap vs DPDK testpmd; SECONDS=3 REPEATS=1 for a smoke
# run), then the noisy-neighbour run (two honest guests, one attacker with each
# attack of examples/attacker.rs in turn; NOISY_SECONDS, NOISY_REPEATS).
# Results: results/bench-<timestamp>/, results/noisy-<timestamp>/.
bench: setup build
	$(CARGO) bench --bench segment
	python3 scripts/bench.py
	$(CARGO) build --release --example attacker
	python3 scripts/noisy.py

lint:
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --all-targets -- -D warnings

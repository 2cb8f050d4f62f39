# gsonet: the two commands in README.md are `make demo` and `make test`.
# Both install what is missing (scripts/setup.sh: QEMU 10, the 6.12 guest image, tools).

CARGO ?= cargo
PYTEST ?= python3 -m pytest
GSONET_BIN ?= $(CURDIR)/target/release/gsonet
export GSONET_BIN

# Packages, taps and QEMU networking need root. As root (a root shell, `sudo make`)
# everything runs directly; as another user those steps go through sudo and the build
# stays the user's own.
SUDO := $(if $(filter 0,$(shell id -u)),,sudo env GSONET_BIN=$(GSONET_BIN))

.PHONY: demo test test-full avocado unit guest-tests bench capacity setup build lint completions man

# Each step prints one line; its full output goes to results/logs/<step>.log, printed
# when it fails (scripts/step.sh). CI=true or VERBOSE=1 keeps it all on the console.
STEP := bash scripts/step.sh

setup:
	@$(STEP) setup "packages, QEMU 10, guest images (scripts/setup.sh)" -- $(SUDO) bash scripts/setup.sh

# The hostile netfront of the Xen rig's test (examples/xen_netfront.rs) is built too.
build:
	@$(STEP) build "cargo build --release" -- sh -c '$(CARGO) build --release && $(CARGO) build --release --example xen_netfront'

demo: setup build
	@$(SUDO) env SKIP_SETUP=1 SKIP_BUILD=1 $(if $(VERBOSE),VERBOSE=$(VERBOSE)) bash scripts/demo.sh

# Shell completions (bash, zsh, fish, elvish) and man pages, from the command
# definitions: target/completions/, target/man/.
completions: build
	$(GSONET_BIN) generate completions target/completions

man: build
	$(GSONET_BIN) generate man target/man

# Unit, ring, segmentation, in-process end-to-end tests, then the representative
# QEMU guest tests. `make test-full` runs every guest variant.
test: setup build unit guest-tests

# Tests that need root (taps, namespaces, AF_PACKET, io_uring) fail where they cannot
# run, rather than pass without running (GSONET_ALLOW_SKIP=1 lets them skip). As
# another user, cargo builds as that user and runs each test binary through sudo.
UNIT_ENV := PATH GSONET_ALLOW_SKIP GSONET_FUZZ_SEED GSONET_FUZZ_SECS PROPTEST_CASES \
	RUST_BACKTRACE RUST_LOG
UNIT_RUNNER_VAR := CARGO_TARGET_$(shell rustc -vV 2>/dev/null | sed -n 's/^host: //p' | tr 'a-z-' 'A-Z_')_RUNNER
UNIT_RUNNER := $(if $(SUDO),$(UNIT_RUNNER_VAR)="sudo env $(foreach v,$(UNIT_ENV),$(if $($(v)),$(v)=$($(v))))")

# `cargo test` relinks target/release/gsonet against the library with `testkit` on
# (Cargo.toml's dev-dependency); the last line puts back the binary `make build`
# made, so that the guest tests and whoever runs it next have the one users get.
unit:
	@$(STEP) build-tests "cargo test --release --no-run" -- $(CARGO) test --release --no-run
	$(UNIT_RUNNER) $(CARGO) test --release
	@$(STEP) rebuild "cargo build --release (the binary without testkit)" -- $(CARGO) build --release

# The USO test runs on the 6.1 guest too: its shell died there (twice out of two,
# 2026-11-23) while udp_recv ran as a job of the console's shell, whose end makes the
# shell exit or cuts the harness's next command in two (harness/guest.py, Guest.run);
# 45-60 s.
GUEST_TESTS_6_1_QUICK ?= guest-tests/test_offload_matrix.py::test_uso_properties_and_udp_segment

guest-tests: build
	$(SUDO) $(PYTEST) guest-tests -m "not full"
	$(SUDO) env GSONET_GUEST_KERNEL=6.1 $(PYTEST) $(GUEST_TESTS_6_1_QUICK)

# test-full also runs the representative guest tests (negotiation, ethtool toggles,
# iperf3 both ways, md5 transfers) on the second guest kernel, Debian 12's 6.1, all of
# them.
GUEST_TESTS_6_1 ?= guest-tests/test_gsonet.py guest-tests/test_offload_matrix.py

test-full: setup build unit
	$(SUDO) $(PYTEST) guest-tests
	$(SUDO) env GSONET_GUEST_KERNEL=6.1 $(PYTEST) $(GUEST_TESTS_6_1)
	$(SUDO) python3 guest-tests/avocado/run.py

# tp-qemu's own ethtool, jumbo and mac_change tests, unmodified, run by avocado-vt
# (pinned, in guest-tests/.cache/avocado/venv) on a guest attached to gsonet with
# -netdev vhost-user: guest-tests/avocado/. tp-qemu comes from AVOCADO_TP_QEMU=PATH
# or ../shared/avocado/tp-qemu.tar.xz. Results: results/avocado-<timestamp>/.
avocado: setup build
	$(SUDO) $(if $(AVOCADO_TP_QEMU),env AVOCADO_TP_QEMU=$(AVOCADO_TP_QEMU)) python3 guest-tests/avocado/run.py

# Micro-benchmark of the segmentation engine, then the side-by-side iperf3 run
# (gsonet vs QEMU virtio-net + tap vs DPDK testpmd; SECONDS=3 REPEATS=1 for a smoke
# run), then the noisy-neighbour run (two honest guests, one attacker with each
# attack of examples/attacker.rs in turn; NOISY_SECONDS, NOISY_REPEATS).
# Then the Xen rig: gsonet vs the kernel netback vs QEMU's netback in one boot, 3
# rounds each: the floor (1 dom0 vCPU, 1-vCPU domUs, one stream), then the headline
# (2 dom0 vCPUs, 2-vCPU domUs with two queues each, 4 streams).
# Then the capacity benchmark (below).
# Results: results/bench-<timestamp>/, results/noisy-<timestamp>/, results/xen-bench-*.json,
# results/capacity-<timestamp>/.
bench: setup build
	$(CARGO) bench --bench segment
	$(SUDO) python3 scripts/bench.py
	$(CARGO) build --release --example attacker
	$(SUDO) python3 scripts/noisy.py
	$(SUDO) python3 scripts/xen_bench.py
	$(SUDO) env GSONET_XEN_DOM0_VCPUS=2 python3 scripts/xen_bench.py
	-$(CARGO) build --release --example tso_loadgen
	$(SUDO) python3 scripts/capacity.py $(CAPACITY_ARGS)

# Capacity with fast frontends instead of TCG guests: one dpdk-testpmd (two
# net_virtio_user ports) on CPU 0 loops frames through gsonet on CPU 1, next to
# testpmd's vhost PMD; 64 B, 1518 B, 8 KB, 64 KB TSO (examples/tso_loadgen.rs), 2 queues,
# idle CPU. CAPACITY_ROUNDS, CAPACITY_SECONDS (2 x 8 s); CAPACITY_HUGEPAGES=1 puts both
# testpmds on 2 MiB pages (1100 free, hugetlbfs mounted); results/capacity-<timestamp>/.
# dpdk-testpmd comes from `make setup`. Without tso_loadgen the 64 KB row says "not built".
CAPACITY_ARGS ?= $(if $(CAPACITY_ROUNDS),--rounds $(CAPACITY_ROUNDS)) \
	$(if $(CAPACITY_SECONDS),--seconds $(CAPACITY_SECONDS)) \
	$(if $(CAPACITY_HUGEPAGES),--hugepages)
capacity: build
	-$(CARGO) build --release --example tso_loadgen
	$(SUDO) python3 scripts/capacity.py $(CAPACITY_ARGS)

lint:
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --all-targets -- -D warnings

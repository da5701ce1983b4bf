# troupe — the two commands of the README, and the steps they are made of.
#
#   make demo   provision libtorch (once), build, train gpt-tiny for 200 steps on an embedded local cluster
#               of two daemons (DDP over QUIC on loopback): the loss falls
#   make test   provision libtorch (once), build, run the whole test suite
#
# libtorch (torch==2.11.0 from PyPI) lives in a venv under $(TROUPE_CACHE), and cargo builds into
# $(TROUPE_CACHE)/target unless CARGO_TARGET_DIR is set, so a fresh clone reuses both. `make build`
# also copies the binary to target/release/troupe in the clone.

SHELL := /bin/bash
TROUPE_CACHE ?= $(HOME)/.cache/troupe
export TROUPE_CACHE
CARGO_TARGET_DIR ?= $(TROUPE_CACHE)/target
export CARGO_TARGET_DIR
TORCH_ENV := $(TROUPE_CACHE)/libtorch-2.11.0.env
CARGO := source $(TORCH_ENV) && cargo
DEMO_STEPS ?= 200

.PHONY: all provision build demo test bench-train fmt clippy

all: build

provision:
	@scripts/provision-host.sh
	@scripts/provision-libtorch.sh >/dev/null

build: provision
	$(CARGO) build --release --locked --bin troupe --bin troupe-chaos
	@# Decided when the recipe runs (the target directory may not exist when make expands the recipe).
	@mkdir -p target/release; \
	for bin in troupe troupe-chaos; do \
		[ "$(CARGO_TARGET_DIR)/release/$$bin" -ef "target/release/$$bin" ] || cp -f "$(CARGO_TARGET_DIR)/release/$$bin" target/release/ || exit 1; \
	done
	@echo "built target/release/troupe"

demo: build
	target/release/troupe train --nodes 2 --steps $(DEMO_STEPS)

TEST_LOG := $(TROUPE_CACHE)/last-test.log

# cargo-nextest runs every test in its own process with a time limit (.config/nextest.toml); the doc
# tests, which nextest does not run, follow.
test: provision
	@set -o pipefail; ( $(CARGO) nextest run --release --locked --workspace --no-fail-fast \
		&& $(CARGO) test --release --locked --workspace --doc ) 2>&1 | tee $(TEST_LOG); \
		status=$$?; scripts/test-summary.sh $(TEST_LOG); exit $$status

bench-train: build
	target/release/troupe bench train --world 1 --steps 20 --peer --json

fmt:
	cargo fmt --all

clippy: provision
	$(CARGO) clippy --release --workspace --all-targets

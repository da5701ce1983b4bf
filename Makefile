# troupe — the two commands of the README, and the steps they are made of.
#
#   make demo   provision libtorch (once), build, train gpt-tiny for 200 steps on an embedded local cluster
#               of two daemons (DDP over QUIC on loopback): the loss falls
#   make test   provision libtorch (once), build, run the whole test suite
#
# libtorch (torch==2.11.0 from PyPI) lives in a venv under $(TROUPE_CACHE), and cargo builds into
# $(TROUPE_CACHE)/target unless CARGO_TARGET_DIR is set, so a fresh clone reuses both (the dependencies
# built there; troupe's own crates it rebuilds, see target-dir). `make build` also copies the binary to
# target/release/troupe in the clone.

SHELL := /bin/bash
TROUPE_CACHE ?= $(HOME)/.cache/troupe
export TROUPE_CACHE
CARGO_TARGET_DIR ?= $(TROUPE_CACHE)/target
export CARGO_TARGET_DIR
TORCH_ENV := $(TROUPE_CACHE)/libtorch-2.11.0.env
CARGO := source $(TORCH_ENV) && cargo
DEMO_STEPS ?= 200
# Extra flags for the demo's `troupe train`, e.g. --json (scripts/fresh-machine-check.sh reads the losses).
DEMO_FLAGS ?=
# Minutes on 2 cores of the first cargo build (scripts/fresh-machine-check.sh times the whole first run),
# and of the rebuild of troupe's own crates when another clone built into the target directory last.
FIRST_BUILD_MINUTES := 6
CLONE_BUILD_MINUTES := 3
# Steps of the job API example (make example-job-api).
JOB_API_STEPS ?= 10

.PHONY: all provision provision-test-runner target-dir build demo test example-job-api sim-replay bench-train fmt clippy

all: build

provision:
	@scripts/provision-host.sh
	@scripts/provision-libtorch.sh >/dev/null

# cargo-nextest, the runner of make test (the demo does not need it).
provision-test-runner: provision
	@scripts/provision-host.sh --test-runner

# The target directory is shared by every clone, so the dependency tree builds once. But cargo takes a
# workspace crate for fresh when its source files are older than its last build, whichever clone those
# files are in: a clone whose files are older than another clone's last build would run that clone's
# code. So the target directory records which clone built into it last (troupe-clone), and another
# clone's first build cleans the workspace's own crates (the dependencies stay).
CLONE_STAMP := $(CARGO_TARGET_DIR)/troupe-clone
target-dir:
	@if [ "$$(cat "$(CLONE_STAMP)" 2>/dev/null)" != "$(CURDIR)" ]; then \
		if [ -d "$(CARGO_TARGET_DIR)/release" ]; then \
			echo "$(CARGO_TARGET_DIR) was last built from $$(cat "$(CLONE_STAMP)" 2>/dev/null || echo 'a clone it did not record'):" \
				"rebuilding troupe's crates from this one (~$(CLONE_BUILD_MINUTES) minutes on 2 cores; the dependencies stay built)"; \
			members=$$(cargo metadata --no-deps --format-version 1 | python3 -c 'import json, sys; print(*("-p " + p["name"] for p in json.load(sys.stdin)["packages"]))') \
				&& cargo clean --quiet --release $$members && cargo clean --quiet $$members || exit 1; \
		fi; \
		mkdir -p "$(CARGO_TARGET_DIR)" && echo "$(CURDIR)" > "$(CLONE_STAMP)"; \
	fi

build: provision target-dir
	@[ -d "$(CARGO_TARGET_DIR)/release/deps" ] || echo "building troupe (the first time: ~$(FIRST_BUILD_MINUTES) minutes on 2 cores) ..."
	$(CARGO) build --release --locked --bin troupe --bin troupe-chaos
	@# Decided when the recipe runs (the target directory may not exist when make expands the recipe).
	@mkdir -p target/release; \
	for bin in troupe troupe-chaos; do \
		[ "$(CARGO_TARGET_DIR)/release/$$bin" -ef "target/release/$$bin" ] || cp -f "$(CARGO_TARGET_DIR)/release/$$bin" target/release/ || exit 1; \
	done
	@echo "built target/release/troupe"

demo: build
	target/release/troupe train --nodes 2 --steps $(DEMO_STEPS) $(DEMO_FLAGS)

TEST_LOG := $(TROUPE_CACHE)/last-test.log

# cargo-nextest runs every test in its own process with a time limit (.config/nextest.toml); the doc
# tests, which nextest does not run, follow.
test: provision-test-runner target-dir
	@set -o pipefail; ( $(CARGO) nextest run --release --locked --workspace --no-fail-fast \
		&& $(CARGO) test --release --locked --workspace --doc \
		&& python3 scripts/module-cycles.py actors/src kernels/model/src ) 2>&1 | tee $(TEST_LOG); \
		status=$$?; scripts/test-summary.sh $(TEST_LOG); exit $$status

# examples/job_api.rs: the job API on a local cluster in one process (JOB_API_STEPS steps).
example-job-api: provision target-dir
	$(CARGO) run --release --locked -p troupe-examples --example job_api -- $(JOB_API_STEPS)

# One seed of the deterministic simulation replayed with its whole trace: make sim-replay SIM_SEED=n
# (SIM_PLANTED, SIM_NETWORK, SIM_LOADED as in chaos-tests/tests/simulation.rs).
sim-replay: provision target-dir
	@[ -n "$(SIM_SEED)" ] || { echo "make sim-replay needs the seed: make sim-replay SIM_SEED=n" >&2; exit 2; }
	export SIM_SEED=$(SIM_SEED) && $(CARGO) test --release --locked -p troupe-chaos --test simulation replay_one_seed -- --nocapture

bench-train: build
	target/release/troupe bench train --world 1 --steps 20 --peer --json

fmt:
	cargo fmt --all

clippy: provision target-dir
	$(CARGO) clippy --release --workspace --all-targets

#!/usr/bin/env bash
# Checks the host tools the build needs (a Rust toolchain, a C++ compiler for torch-sys, python3 with
# venv) and installs the missing Debian packages when run as root. Quiet when everything is present.
# With --test-runner it also installs cargo-nextest, the runner of make test (make demo does not need it).
set -euo pipefail
test_runner=0
[[ "${1:-}" == --test-runner ]] && test_runner=1

missing=()
command -v c++ >/dev/null || missing+=(g++)
command -v python3 >/dev/null || missing+=(python3)
python3 -c 'import venv, ensurepip' 2>/dev/null || missing+=(python3-venv)
command -v pkg-config >/dev/null || missing+=(pkg-config)
# The chaos harness's network faults: namespaces (iproute2) and link cuts and losses (iptables).
command -v ip >/dev/null || missing+=(iproute2)
command -v iptables >/dev/null || missing+=(iptables)
if ((${#missing[@]})); then
  if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null; then
    echo "host: installing ${missing[*]}" >&2
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  else
    echo "host: missing ${missing[*]}; install them (e.g. sudo apt-get install ${missing[*]})" >&2
    exit 1
  fi
fi
if ! command -v cargo >/dev/null; then
  echo "host: cargo not found; install Rust from rustup (https://rustup.rs) and rerun" >&2
  exit 1
fi
# The Slurm tests (actors/tests/slurm.rs) start a real slurmctld, two slurmd and munged: Debian's slurm-wlm
# and munge, installed for the test runner when run as root (the tests skip, saying so, without them).
if ((test_runner)) && [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null; then
  slurm=()
  for tool in slurmctld:slurmctld slurmd:slurmd sbatch:slurm-client munged:munge; do
    command -v "${tool%%:*}" >/dev/null || [[ -x /usr/sbin/${tool%%:*} ]] || slurm+=("${tool#*:}")
  done
  if ((${#slurm[@]})); then
    echo "host: installing ${slurm[*]} (a real Slurm for the Slurm tests)" >&2
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      "${slurm[@]}" >/dev/null
  fi
fi
# The dashboard and metrics tests (actors/tests/dashboard.rs, telemetry.rs) drive headless Chromium and check
# /metrics with promtool and a real Prometheus server: Debian's chromium and prometheus, installed for the
# test runner when run as root (the tests skip, saying so, without them).
if ((test_runner)) && [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null; then
  web=()
  command -v chromium >/dev/null || web+=(chromium)
  command -v promtool >/dev/null || web+=(prometheus)
  if ((${#web[@]})); then
    echo "host: installing ${web[*]} (a real browser and Prometheus for the dashboard and metrics tests)" >&2
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      "${web[@]}" >/dev/null
  fi
fi
if ((test_runner)) && ! cargo nextest --version >/dev/null 2>&1; then
  echo "host: installing cargo-nextest (the test runner of make test; once, a few minutes)" >&2
  cargo install cargo-nextest --locked --quiet
fi

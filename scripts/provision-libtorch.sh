#!/usr/bin/env bash
# Installs torch==2.11.0 (the libtorch that tch 0.24 binds) from PyPI into a cached venv outside the clone,
# and writes an env file the build sources. Idempotent: a second run finds the venv and says so.
#
#   TROUPE_CACHE   where the venv lives (default ~/.cache/troupe)
#
# Prints the path of the env file on its last line.
set -euo pipefail

TORCH_VERSION=2.11.0
# The external test oracles, pinned: transformers (model maths, Hugging Face's file layout) brings its
# tokenizers and safetensors; peft (LoRA adapters in Hugging Face PEFT's format, kernels/model/tests/peft_hf.rs).
TEST_PACKAGES=("transformers==5.24.0" "tokenizers==0.23.3" "kubernetes-validate==1.31.0" "peft==0.21.2")
cache="${TROUPE_CACHE:-$HOME/.cache/troupe}"
venv="$cache/venv-torch-$TORCH_VERSION"
stamp="$venv/.troupe-provisioned"
envfile="$cache/libtorch-$TORCH_VERSION.env"

write_env() {
  local torch_lib
  torch_lib="$("$venv/bin/python" -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "lib"))')"
  cat >"$envfile" <<ENV
# written by scripts/provision-libtorch.sh; source before cargo build
export LIBTORCH_USE_PYTORCH=1
export PATH="$venv/bin:\$PATH"
export TROUPE_TORCH_LIB="$torch_lib"
ENV
}

if [[ -f "$stamp" ]] && "$venv/bin/python" -c "import numpy, torch, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION')" 2>/dev/null; then
  # Every pin of TEST_PACKAGES, at its version (a pin added later reaches provisioned venvs too).
  if ! "$venv/bin/python" -c "import sys, importlib.metadata as m; sys.exit(any(m.version(p.split('==')[0]) != p.split('==')[1] for p in sys.argv[1:]))" "${TEST_PACKAGES[@]}" 2>/dev/null; then
    echo "libtorch: installing the test oracles ${TEST_PACKAGES[*]} into $venv" >&2
    "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-cache-dir "${TEST_PACKAGES[@]}" >&2
  fi
  echo "libtorch: torch==$TORCH_VERSION already provisioned in $venv; nothing to do." >&2
  [[ -f "$envfile" ]] || write_env
  echo "$envfile"
  exit 0
fi

command -v python3 >/dev/null || { echo "libtorch: python3 not found; install python3 (with venv and pip) first" >&2; exit 1; }
mkdir -p "$cache"
if ! python3 -m venv "$venv" 2>/dev/null; then
  echo "libtorch: python3 -m venv failed; installing python3-venv" >&2
  apt-get update -qq && apt-get install -y -qq python3-venv >/dev/null
  python3 -m venv "$venv"
fi
echo "libtorch: installing torch==$TORCH_VERSION into $venv (about 80 s and 4.6 GB the first time)" >&2
# On a terminal pip shows what it downloads with progress bars; in a log (CI) one line per package is noise.
if [[ -t 2 ]]; then quiet=(); else quiet=(-q); fi
"$venv/bin/python" -m pip install "${quiet[@]}" --disable-pip-version-check --no-cache-dir "torch==$TORCH_VERSION" numpy "${TEST_PACKAGES[@]}" >&2
write_env
touch "$stamp"
echo "libtorch: provisioned torch==$TORCH_VERSION in $venv" >&2
echo "$envfile"

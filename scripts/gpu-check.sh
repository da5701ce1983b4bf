#!/usr/bin/env bash
# The device check (issue 31): what one lent H100/H200 must show, prepared on this machine and run on
# the device in one call. The device has torch with CUDA (/opt/torch/.venv) but no network and no cargo,
# so the binaries are built here, stripped and packed into gpu-carry/ (ignored by git), carried over,
# and pointed at the device's libtorch there.
#
#   scripts/gpu-check.sh prepare     here: build troupe and the CUDA test binaries, strip and pack them
#                                    into gpu-carry/ (well under the 64 MiB a call may carry)
#   scripts/gpu-check.sh run         on the device (or here: every GPU check then says "skipped, no CUDA
#                                    device"): the checks below, one JSON line each, also written to
#                                    $OUT/gpu-check.jsonl when OUT is set; `run --only A,B` runs the
#                                    checks named A and B alone (a rerun within the device's time)
#
# The device call: command "bash scripts/gpu-check.sh run", carry ["gpu-carry"], timeout_s 540; the
# checks keep to about 8 minutes together (each has its own limit, scripts/gpu_check.py).
#
# Checks, in order (scripts/gpu_check.py lists them): the CUDA reference trainer against the CPU's (fp32
# losses within 1e-4 relative, bf16 trains); AdamW on CUDA parameters through troupe's fused kernel; the
# NCCL world-1 communicator (create, every collective, abort, rebuild); daemons' GPU slots (DDP over NCCL,
# two ranks sharing the GPU over host memory, ZeRO over NCCL and host memory, a tensor group of two
# and DiLoCo replicas sharing the GPU); the fused kernels' bandwidth beside the device's own copy; tokens/s and MFU of SmolLM2-135M in bf16 beside PyTorch eager
# and torch.compile (transformers) on the same GPU in the same command, and of TinyLlama-1.1B beside eager
# and, fine-tuned with LoRA, beside transformers + PEFT.
# Checks whose runtime support is not built yet say "not_built" and why, rather than being left out.
set -euo pipefail

cd "$(dirname "$0")/.."
CARRY=gpu-carry

prepare() {
  local cache="${TROUPE_CACHE:-$HOME/.cache/troupe}"
  # shellcheck disable=SC1091
  [ -f "$cache/libtorch-2.11.0.env" ] && source "$cache/libtorch-2.11.0.env"
  export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$cache/target}"
  cargo build --release --locked --bin troupe
  # The test binaries' paths, from cargo's own report of what it built.
  local tests
  # --workspace: the features `make test` builds with, so nothing already built is built again.
  tests=$(cargo test --release --locked --workspace --test cuda_trainer --test cuda_storage --test nccl --test gpu_slots --no-run --message-format=json |
    python3 -c 'import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["test"]:
        print(m["target"]["name"], m["executable"])')
  rm -rf "$CARRY" && mkdir -p "$CARRY"
  strip -o "$CARRY/troupe" "$CARGO_TARGET_DIR/release/troupe"
  while read -r name exe; do
    strip -o "$CARRY/$name" "$exe"
  done <<<"$tests"
  for f in "$CARRY"/*; do xz -T0 -6 "$f"; done
  # The commit the binaries were built from ("-dirty": with changes not committed).
  echo "$(git rev-parse HEAD)$(git diff --quiet HEAD -- . ':!gpu-carry' || echo -dirty)" >"$CARRY/commit"
  echo "packed into $CARRY/ (commit $(cut -c1-12 "$CARRY/commit")):"
  du -b "$CARRY"/* | awk '{ printf "  %-40s %6.1f MiB\n", $2, $1 / 1048576; total += $1 } END { printf "  together %.1f MiB\n", total / 1048576 }'
  echo 'device call: command "bash scripts/gpu-check.sh run", carry ["gpu-carry"], timeout_s 540'
}

run() {
  [ -d "$CARRY" ] || { echo "gpu-check: no $CARRY/: run 'scripts/gpu-check.sh prepare' here first" >&2; exit 2; }
  local python="${TROUPE_TORCH_PYTHON:-}"
  for candidate in /opt/torch/.venv/bin/python3 "${TROUPE_CACHE:-$HOME/.cache/troupe}/venv-torch-2.11.0/bin/python" python3; do
    [ -n "$python" ] && break
    if command -v "$candidate" >/dev/null && "$candidate" -c 'import torch' 2>/dev/null; then python=$candidate; fi
  done
  [ -n "$python" ] || { echo "gpu-check: no python with torch (set TROUPE_TORCH_PYTHON)" >&2; exit 2; }
  bin=$(mktemp -d /tmp/troupe-gpu-check.XXXXXX)
  trap 'rm -rf "$bin"' EXIT
  for f in "$CARRY"/*.xz; do xz -dc "$f" >"$bin/$(basename "$f" .xz)"; done
  chmod +x "$bin"/*
  # The binaries link libtorch_cpu; libtorch_cuda is preloaded so that its kernels register (the troupe
  # binary does not link it itself). The CUDA libraries torch's wheel brought (nvidia/*/lib: NCCL, cuBLAS,
  # ...) go on the library path too: the NCCL backend opens libnccl by name.
  local lib dirs
  lib=$("$python" -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "lib"))')
  dirs=$("$python" -c 'import glob, os, sys; print(":".join(sorted(glob.glob(os.path.join(sys.argv[1], "..", "..", "nvidia", "*", "lib")))))' "$lib")
  export LD_LIBRARY_PATH="$bin:$lib${dirs:+:$dirs}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  # cudarc opens libnccl.so (or .so.1, .so.<CUDA major>); NCCL's wheel ships only libnccl.so.2.
  local nccl
  nccl=$(IFS=:; for d in $dirs; do ls "$d"/libnccl.so.2* 2>/dev/null || true; done | head -1)
  if [ -n "$nccl" ]; then ln -sf "$nccl" "$bin/libnccl.so"; fi
  if [ -f "$lib/libtorch_cuda.so" ]; then export LD_PRELOAD="$lib/libtorch_cuda.so"; fi
  # The daemon-level tests (gpu_slots) start daemons from the carried troupe binary.
  export TROUPE_TORCH_PYTHON="$python" TROUPE_PYTHON="$python" TROUPE_BIN="$bin/troupe"
  "$python" scripts/gpu_check.py --bin "$bin" --commit "$(cat "$CARRY/commit")" "$@"
}

case "${1:-}" in
  prepare) prepare ;;
  run) shift; run "$@" ;;
  -h | --help | "") sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; [ -n "${1:-}" ] ;;
  *) echo "gpu-check: unknown command $1 (prepare or run; see --help)" >&2; exit 2 ;;
esac

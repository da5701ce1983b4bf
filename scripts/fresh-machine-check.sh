#!/usr/bin/env bash
# The README's two commands as a new user meets them: clones this repository's HEAD commit into a
# temporary directory and runs `make demo` and `make test` there with a libtorch cache and a cargo target
# directory of their own, both empty (the crates cargo downloaded before stay in ~/.cargo). Checks that
# the demo's loss falls, that target/release/troupe exists in the clone and runs with no environment
# variables set, and that the test suite passes. Prints how long each step took.
#
#   scripts/fresh-machine-check.sh [--demo-only] [--steps N] [--keep]
#
#   --demo-only   skip make test
#   --steps N     the demo's steps (DEMO_STEPS; default 40)
#   --keep        keep the temporary directory (the clone, its cache, its target directory); the logs
#                 are kept in any case, in a directory of their own
#
# The first run downloads torch (about 4.6 GB) into the empty cache and builds everything from scratch:
# about as long as a fresh machine's first `make demo`, plus the whole test suite. Only committed changes
# are checked: the clone is of HEAD.
set -euo pipefail

demo_only=0 keep=0 steps=40
while (($#)); do
  case "$1" in
    --demo-only) demo_only=1 ;;
    --keep) keep=1 ;;
    --steps) steps="${2:?--steps needs a number}"; shift ;;
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "fresh-machine-check: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
[[ "$steps" =~ ^[1-9][0-9]*$ ]] || { echo "fresh-machine-check: --steps $steps: use a number of at least 1" >&2; exit 2; }

repo="$(cd "$(dirname "$0")/.." && pwd -P)"
commit="$(git -C "$repo" rev-parse HEAD)"
if [[ -n "$(git -C "$repo" status --porcelain --untracked-files=no)" ]]; then
  echo "fresh-machine-check: $repo has uncommitted changes; only the commit ${commit:0:12} is checked" >&2
fi
work="$(mktemp -d "${TMPDIR:-/tmp}/troupe-fresh.XXXXXX")"
# The logs live beside it and stay: they are small, and what a failure leaves to read.
logs="$(mktemp -d "${TMPDIR:-/tmp}/troupe-fresh-logs.XXXXXX")"
finish() {
  if ((keep)); then
    echo "fresh-machine-check: kept $work (the clone, its cache and target directory)"
  else
    rm -rf "$work"
  fi
}
trap finish EXIT

fail() {
  echo "fresh-machine-check: FAILED: $*" >&2
  exit 1
}

# The steps' durations, printed at the end.
timings=()
timed() {
  local name="$1" start=$SECONDS status=0
  shift
  "$@" || status=$?
  timings+=("$(printf '%-36s %5d s' "$name" $((SECONDS - start)))")
  return $status
}

clone="$work/troupe"
git clone --quiet "$repo" "$clone"
git -C "$clone" checkout --quiet --detach "$commit" || fail "commit $commit is not on a branch of $repo"
echo "fresh-machine-check: $commit cloned into $clone"

# A fresh machine: an empty libtorch cache and target directory, none of the build's variables set.
export TROUPE_CACHE="$work/cache" CARGO_TARGET_DIR="$work/target"
unset LIBTORCH LIBTORCH_INCLUDE LIBTORCH_LIB LIBTORCH_USE_PYTORCH LD_LIBRARY_PATH TROUPE_TORCH_PYTHON \
  TROUPE_TORCH_LIB CARGO_BUILD_TARGET_DIR
# Nor a torch venv on PATH (a sourced env file puts one there).
PATH="$(tr ':' '\n' <<<"$PATH" | grep -v '/venv-torch-' | paste -sd: -)"
cd "$clone"

demo_log="$logs/demo.log"
run_demo() {
  make demo DEMO_STEPS="$steps" DEMO_FLAGS=--json 2>&1 | tee "$demo_log"
}
timed "make demo (provision, build, train)" run_demo || fail "make demo exited with an error (log: $demo_log)"

# The demo's step events: as many as it was asked for, finite losses, the last ones well below the first.
python3 - "$demo_log" "$steps" <<'PY' || fail "the demo's loss did not fall (log: $demo_log)"
import json, math, sys
log, steps = sys.argv[1], int(sys.argv[2])
losses = []
for line in open(log):
    if line.startswith("{"):
        event = json.loads(line)
        if event.get("event") == "step":
            losses.append(event["loss"])
if len(losses) != steps or not all(math.isfinite(l) for l in losses):
    sys.exit(f"expected {steps} step events with finite losses, got {len(losses)}: {losses}")
tail = losses[-min(5, steps):]
mean = sum(tail) / len(tail)
print(f"demo: loss {losses[0]:.4f} at step 1, {mean:.4f} over the last {len(tail)} steps")
if not mean < 0.9 * losses[0]:
    sys.exit(f"the loss did not fall: {losses}")
PY

[[ -x target/release/troupe ]] || fail "make demo left no target/release/troupe in the clone"
version="$(env -i "$clone/target/release/troupe" --version)" || fail "target/release/troupe --version fails with no environment variables set"
echo "target/release/troupe runs with no environment: $version"

if ((!demo_only)); then
  timed "make test" make test TEST_LOG="$logs/test.log" || fail "make test failed (log: $logs/test.log)"
fi

echo "fresh-machine-check: passed ($commit; logs in $logs)"
printf '  %s\n' "${timings[@]}"

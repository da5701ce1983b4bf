#!/usr/bin/env bash
# Sums a `make test` log into one closing line:  tests: N passed, N failed, N skipped
# It reads cargo-nextest's "Summary [...] N tests run: N passed, N failed, N skipped" line and cargo test's
# per-binary "test result:" lines (the doc tests).
set -euo pipefail
sed 's/\x1b\[[0-9;]*m//g' "$1" | awk '
  /^ *Summary \[/ {
    for (i = 1; i <= NF; i++) {
      w = $(i); gsub(/[,;]/, "", w)
      if (w == "passed") passed += $(i - 1)
      if (w == "failed") failed += $(i - 1)
      if (w == "skipped") ignored += $(i - 1)
      if (w == "timed" && $(i + 1) ~ /^out/) failed += $(i - 1)
    }
  }
  /^test result:/ {
    for (i = 1; i <= NF; i++) {
      if ($(i) ~ /^passed;?$/) passed += $(i - 1)
      if ($(i) ~ /^failed;?$/) failed += $(i - 1)
      if ($(i) ~ /^ignored;?$/) ignored += $(i - 1)
    }
  }
  END { printf "tests: %d passed, %d failed, %d skipped\n", passed, failed, ignored }'

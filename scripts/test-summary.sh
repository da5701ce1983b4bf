#!/usr/bin/env bash
# Sums cargo test's per-binary "test result:" lines from a log into one closing line:
#   tests: N passed, N failed, N skipped
set -euo pipefail
awk '/^test result:/ {
       for (i = 1; i <= NF; i++) {
         if ($(i) ~ /^passed;?$/) passed += $(i - 1)
         if ($(i) ~ /^failed;?$/) failed += $(i - 1)
         if ($(i) ~ /^ignored;?$/) ignored += $(i - 1)
       }
     }
     END { printf "tests: %d passed, %d failed, %d skipped\n", passed, failed, ignored }' "$1"

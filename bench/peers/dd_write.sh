#!/usr/bin/env bash
# The peer of `troupe bench checkpoint`: the same number of bytes written to the same directory by dd
# (8 MiB blocks from /dev/zero, conv=fsync: one fsync before dd exits), timed around dd.
# Prints one JSON object: {"peer":"dd","bytes":...,"seconds":...,"MBps":...}.
#
#     bench/peers/dd_write.sh DIR BYTES
set -euo pipefail
dir=$1
bytes=$2
bs=$((8 << 20))
count=$(((bytes + bs - 1) / bs))
file="$dir/.dd-peer-$$.bin"
trap 'rm -f "$file"' EXIT
t0=$(date +%s.%N)
dd if=/dev/zero of="$file" bs="$bs" count="$count" conv=fsync status=none
t1=$(date +%s.%N)
awk -v b="$((count * bs))" -v t0="$t0" -v t1="$t1" \
  'BEGIN { s = t1 - t0; printf "{\"peer\":\"dd\",\"bytes\":%d,\"seconds\":%.6f,\"MBps\":%.1f}\n", b, s, b / s / 1e6 }'

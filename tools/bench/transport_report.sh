#!/bin/bash
# Runs tutti-transport-bench over shm and over tcp (2 processes each) and prints both tables; the
# shm table ends with the ratio the foundation issue asks for (shm stream 16 MiB / memcpy).
set -euo pipefail
build=${1:-build}
for t in shm tcp; do
  TUTTI_TRANSPORT=$t "$build/bin/tutti-run" -n 2 --no-prefix "$build/bin/tutti-transport-bench"
  echo
done

#!/bin/bash
# The calibrated cost model against measurement: for 2 and 4 processes, calibrates (tutti-tune
# --calibrate into a temporary file), predicts all_reduce with tutti-sim --topo live, measures the
# same plan with tutti-perf (TUTTI_ALGO), and prints the error per size, 4 KiB to 64 MiB.
#   tools/bench/compare_model.sh [build-dir] [algorithm (ring|rhd|allpairs)]
set -euo pipefail
build=${1:-build}
algo=${2:-ring}
export TUTTI_CALIBRATION_FILE=$(mktemp -d)/calibration.json
for n in 2 4; do
  "$build/bin/tutti-run" -n $n --no-prefix "$build/bin/tutti-tune" --calibrate | sed -n 2p
  p=$(mktemp) m=$(mktemp)
  "$build/bin/tutti-sim" --builtin ${algo}_allreduce --ranks $n --topo live --sizes 4K:64M -f 4 | awk '/^ +[0-9]/ {print $1, $3}' > "$p"
  TUTTI_ALGO=$algo "$build/bin/tutti-run" -n $n --no-prefix "$build/bin/tutti-perf" all_reduce -b 4K -e 64M -f 4 -n 10 -w 3 -c 0 |
    awk '/^ +[0-9]/ {print $6}' > "$m"
  echo "## ${algo}_allreduce, $n processes"
  paste -d" " "$p" "$m" | awk '{printf "%10d predicted %10.1f us  measured %10.1f us  error %+5.0f%%\n", $1, $2, $3, ($2 / $3 - 1) * 100}'
  rm -f "$p" "$m"
done

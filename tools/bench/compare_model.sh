#!/bin/bash
# The calibrated cost model against measurement: for 2 and 4 processes, calibrates (tutti-tune
# --calibrate into a temporary file), predicts all_reduce with tutti-sim --topo live, measures the
# same plan with tutti-perf (TUTTI_ALGO; its out-of-place column, so the out-of-place plan is the
# one predicted), and prints the error per size, 4 KiB to 64 MiB.
# The VM's two cores are not always the same two: a cache-line round trip between them flips
# between about 150 and 560 ns every few seconds as the host moves them (docs/PERFORMANCE.md), and
# every shared-memory time moves with it; and each launch gets its own physical pages, whose cache
# placement moves mid-size calls (a 64 KiB all-reduce took 6.8 or 11 us from one launch to the
# next). So each of `rounds` rounds calibrates, measures (one tutti-perf launch per size band, each
# with enough iterations to last a while), and calibrates again; its prediction is the mean of the
# two calibrations' (the machine as it stood around the measurement), its error that against its
# own measurement. The table gives medians over rounds, and how many rounds were within 25 %.
#   tools/bench/compare_model.sh [build-dir] [algorithm (ring|rhd|allpairs)] [rounds]
set -euo pipefail
build=${1:-build}
algo=${2:-ring}
rounds=${3:-7}
[[ $rounds =~ ^[0-9]+$ ]] && ((rounds >= 1)) || { echo "compare_model.sh: rounds must be a whole number >= 1 (got '$rounds')" >&2; exit 2; }
work=$(mktemp -d)
# size bands: first size, last size, iterations, warm-up
bands=("4K 64K 200 20" "256K 1M 50 5" "4M 64M 10 2")
export TUTTI_CALIBRATION_FILE=$work/cal.json
# predict FILE: calibrates $n ranks afresh, writes the predicted time per size to FILE
predict() {
  rm -f "$TUTTI_CALIBRATION_FILE"
  "$build/bin/tutti-run" -n $n --no-prefix "$build/bin/tutti-tune" --calibrate | sed -n 2p > "$work/c$k"
  "$build/bin/tutti-sim" --builtin ${algo}_allreduce -p inplace=0 --ranks $n --topo live --sizes 4K:64M -f 4 |
    awk '/^ +[0-9]/ {print $3}' > "$1"
}
for n in 2 4; do
  for ((k = 0; k < rounds; ++k)); do
    predict "$work/before"
    : > "$work/m$k"
    for band in "${bands[@]}"; do
      read -r lo hi iters warm <<< "$band"
      TUTTI_ALGO=$algo "$build/bin/tutti-run" -n $n --no-prefix "$build/bin/tutti-perf" all_reduce -b $lo -e $hi -f 4 \
        -n $iters -w $warm -c 0 | awk '/^ +[0-9]/ {print $1, $6}' >> "$work/m$k"
    done
    predict "$work/after"
    paste -d" " "$work/before" "$work/after" | awk '{print ($1 + $2) / 2}' > "$work/p$k"
    paste -d" " "$work/m$k" "$work/p$k" > "$work/r$k"  # size measured predicted
  done
  echo "## ${algo}_allreduce, $n processes: $rounds rounds, each measured between two calibrations; the first round's last:"
  cat "$work/c0"
  # per size: each round's (measured, predicted); medians, median error, rounds within 25 %
  paste -d" " "$work"/r* | awk -v R=$rounds '
    function median(a, n,   i, j, x) {
      for (i = 2; i <= n; ++i) for (j = i; j > 1 && a[j - 1] > a[j]; --j) { x = a[j]; a[j] = a[j - 1]; a[j - 1] = x }
      return n % 2 ? a[(n + 1) / 2] : (a[n / 2] + a[n / 2 + 1]) / 2 }
    { ok = 0
      for (k = 0; k < R; ++k) { m[k + 1] = $(3 * k + 2); p[k + 1] = $(3 * k + 3); e[k + 1] = p[k + 1] / m[k + 1] - 1
        if (e[k + 1] <= 0.25 && e[k + 1] >= -0.25) ++ok }
      printf "%10d predicted %10.1f us  measured %10.1f us  error %+5.0f%%  within 25%%: %d of %d rounds\n", $1, median(p, R), median(m, R), 100 * median(e, R), ok, R }'
  rm -f "$work"/*
done
rmdir "$work"

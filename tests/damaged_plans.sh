#!/bin/bash
# Damaged plan files in TUTTI_PLAN_DIR: each is skipped with a warning naming the file and the
# reason, and the other plans and the built-ins keep serving calls (tutti-perf checks every result).
#   damaged_plans.sh BIN_DIR
set -uo pipefail
bin=$1
d=$(mktemp -d)
trap 'rm -rf "$d"' EXIT
"$bin/tutti-compile" --builtin ring_allreduce --ranks 2 -o "$d/good.json" > /dev/null || exit 1
head -c 300 "$d/good.json" > "$d/cut.json"                                           # cut short
sed 's/"input_chunks": \([0-9]*\)/"input_chunks": [\1]/' "$d/good.json" > "$d/types.json"  # a number made an array
sed 's/"channel": 0/"channel": 1e300/' "$d/good.json" > "$d/huge.json"               # a float past any int
sed 's/"nranks": 2/"nranks": 100000/' "$d/good.json" > "$d/ranks.json"               # past the rank limit
TUTTI_PLAN_DIR=$d "$bin/tutti-perf" all_reduce -b 8 -e 64K -f 8 -n 1 -w 0 -c 1 -t 2 > "$d/out.log" 2>&1
rc=$?
cat "$d/out.log"
[ $rc = 0 ] || { echo "tutti-perf exited with $rc"; exit 1; }
for want in "cut.json: plan JSON: not valid JSON" "types.json: plan JSON: rank 0: 'input_chunks' is \[" \
            "huge.json: plan JSON: rank 0 block 0: 'channel' is 1e+300, not an integer" \
            "ranks.json: plan JSON: nranks is 100000 (allowed 1..4096)" "Out of bounds values : 0 OK"; do
  grep -qF -- "${want//\\/}" "$d/out.log" || { echo "missing: $want"; exit 1; }
done
echo ok

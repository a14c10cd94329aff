#!/bin/bash
# Damaged plan files in TUTTI_PLAN_DIR (JSON) and MSCCL_ALGO_DIR (MSCCL XML): each is skipped with a
# warning naming the file and the reason, and the other plans and the built-ins keep serving calls
# (tutti-perf checks every result).
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
mkdir "$d/msccl"
"$bin/tutti-compile" --builtin ring_allreduce --ranks 2 -o "$d/msccl/good.xml" > /dev/null || exit 1
sed '0,/i_chunks="[0-9]*"/s//i_chunks="100000000"/' "$d/msccl/good.xml" > "$d/msccl/chunks.xml"  # 25 s and 4.6 GB before
sed '0,/chan="0"/s//chan="1000000"/' "$d/msccl/good.xml" > "$d/msccl/channels.xml"            # 16,355 segments before
sed '0,/chan="0"/s//chan="-1"/' "$d/msccl/good.xml" > "$d/msccl/negative.xml"                 # failed at run time before
head -c 200 "$d/msccl/good.xml" > "$d/msccl/cut.xml"
# Entries that are not plan files at all, or plans no rank could run: read without blocking, skipped
# by name (a FIFO blocked every rank in open(); /dev/zero was read whole into memory).
mkfifo "$d/fifo.json"
ln -s /dev/zero "$d/zero.json"
mkdir "$d/folder.json"
# A verified plan asking for 2^20 scratch chunks, under the good plan's name and sorted first: it
# was chosen and failed "out of memory" on one rank while its peers waited out the timeout.
sed 's/"scratch_chunks": [0-9]*/"scratch_chunks": 1048576/' "$d/good.json" > "$d/a_scratch.json"
cp "$d/good.json" "$d/good_copy.json"  # the same plan twice: the warning names both files
TUTTI_PLAN_DIR=$d MSCCL_ALGO_DIR=$d/msccl "$bin/tutti-perf" all_reduce -b 8 -e 64K -f 8 -n 1 -w 0 -c 1 -t 2 > "$d/out.log" 2>&1
rc=$?
cat "$d/out.log"
[ $rc = 0 ] || { echo "tutti-perf exited with $rc"; exit 1; }
for want in "cut.json: plan JSON: not valid JSON" "types.json: plan JSON: rank 0: 'input_chunks' is \[" \
            "huge.json: plan JSON: rank 0 block 0: 'channel' is 1e+300, not an integer" \
            "ranks.json: plan JSON: nranks is 100000 (allowed 1..4096)" "chunks.xml: plan 'ring_allreduce': rank 0 input_chunks is 100000000" \
            "channels.xml: MSCCL XML line" "<tb chan=1000000> (allowed 0..31)" "negative.xml: MSCCL XML line" \
            "<tb chan=-1> (allowed 0..31)" "cut.xml: MSCCL XML line 2: malformed XML" "Out of bounds values : 0 OK" \
            "fifo.json is not a regular file (a FIFO)" "zero.json is not a regular file (a character device)" \
            "folder.json is not a regular file (a directory)" "a_scratch.json: plan 'ring_allreduce': rank 0 scratch_chunks (per chunk" \
            "is in $d/good.json and in $d/good_copy.json; the one from $d/good.json is used"; do
  grep -qF -- "${want//\\/}" "$d/out.log" || { echo "missing: $want"; exit 1; }
done
echo ok

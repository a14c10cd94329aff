#!/bin/bash
# TUTTI_TRACE writes a Chrome trace with the instructions of every rank (here: 2 ranks as threads).
set -u
perf=$1
out=$(mktemp -d)/trace.json
TUTTI_TRACE=$out "$perf" all_reduce -b 1K -e 64K -f 8 -n 1 -w 0 -t 2 > /dev/null || { echo "tutti-perf failed"; exit 1; }
[ -s "$out" ] || { echo "no trace written to $out"; exit 1; }
head -c 40 "$out" | grep -q '"traceEvents"' || { echo "not a Chrome trace"; exit 1; }
tail -c 4 "$out" | grep -q ']}' || { echo "trace not closed"; exit 1; }
for r in 0 1; do
  n=$(grep -c "\"pid\":$r," "$out")
  [ "$n" -gt 0 ] || { echo "no events of rank $r"; exit 1; }
done
grep -q '"name":"send"\|"name":"recv' "$out" || { echo "no transfer instructions traced"; exit 1; }
echo "trace ok: $(grep -c '"ph":"X"' "$out") events"
rm -f "$out"

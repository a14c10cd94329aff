#!/usr/bin/env bash
# Pipeline schedules and parallel layouts of tutti-train on CPU ranks, from the trainer's own timing:
#   - per schedule: the measured bubble (time ranks wait on neighbouring stages, mean over ranks,
#     median over the second half of the steps) beside the schedule checker's prediction and
#     1F1B's formula (p-1)/(m+p-1), and the activation slots held against the predicted peak;
#   - per layout: the exposed communication, the share of a step spent blocked on tp, dp, ep and pp
#     communication (median over the second half of the steps).
#   tools/trainer/bench_layouts.sh [build/bin] [steps]      (ONLY_EP=1: the expert-parallel lines only)
# Ranks get one compute thread each; on a machine with fewer cores than ranks the figures include
# waiting for a core.
set -euo pipefail
BIN=${1:-build/bin}
STEPS=${2:-30}
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
MODEL=(--layers 8 --channels 128 --heads 4 --seq 64 --batch 16 --steps "$STEPS" --eval-every 0 --threads 1)

run() {  # ranks, label, flags...
  local n=$1 label=$2
  shift 2
  "$BIN/tutti-run" -n "$n" "$BIN/tutti-train" "${MODEL[@]}" --out "$OUT/run" "$@" > "$OUT/log" 2>&1 || {
    echo "$label: failed"; tail -5 "$OUT/log"; return 1; }
  python3 - "$OUT/run/metrics.jsonl" "$label" "$n" "$OUT/log" <<'PY'
import json, statistics, sys, re
rows = [json.loads(l) for l in open(sys.argv[1]) if '"loss"' in l]
late = rows[len(rows) // 2:]
comm = statistics.median(r["comm_wait_s"] / r["step_s"] for r in late)
step = statistics.median(r["step_s"] for r in late)
line = f"{sys.argv[2]:<34} {sys.argv[3]:>5} ranks  step {1e3*step:7.1f} ms  exposed communication {100*comm:5.1f}%"
for l in open(sys.argv[4]):
    m = re.match(r"pipeline \S+: measured bubble ([\d.]+).*predicts ([\d.]+).*formula ([\d.]+); activation slots (\d+) \(predicted peak (\d+)\)", l)
    if m:
        line += f"  bubble {m[1]} (checker {m[2]}, 1F1B formula {m[3]})  activation slots {m[4]} (predicted {m[5]})"
print(line, flush=True)
PY
}

[ "${ONLY_EP:-}" = 1 ] || {
echo "== pipeline schedules, pp 2, 8 micro-batches =="
run 2 "pp2 gpipe" --pp 2 --schedule gpipe --microbatches 8
run 2 "pp2 1f1b" --pp 2 --schedule 1f1b --microbatches 8
run 2 "pp2 interleaved vp2" --pp 2 --schedule interleaved --vp 2 --microbatches 8
run 2 "pp2 zb-h1" --pp 2 --schedule zb-h1 --microbatches 8
echo "== pipeline schedules, pp 4, 8 micro-batches =="
run 4 "pp4 gpipe" --pp 4 --schedule gpipe --microbatches 8
run 4 "pp4 1f1b" --pp 4 --schedule 1f1b --microbatches 8
run 4 "pp4 interleaved vp2" --pp 4 --schedule interleaved --vp 2 --microbatches 8
run 4 "pp4 zb-h1" --pp 4 --schedule zb-h1 --microbatches 8
echo "== layouts =="
run 2 "dp2" --dp 2
run 2 "dp2 zero1" --dp 2 --zero 1
run 2 "tp2" --tp 2
run 2 "tp2 sp" --tp 2 --sp
}
run 2 "dp2 ep2 (4 experts, top-2)" --dp 2 --ep 2 --experts 4 --top-k 2
[ "${ONLY_EP:-}" = 1 ] || run 4 "tp2 dp2" --tp 2 --dp 2
[ "${ONLY_EP:-}" = 1 ] || run 4 "tp2 pp2 1f1b m8" --tp 2 --pp 2 --schedule 1f1b --microbatches 8
[ "${ONLY_EP:-}" = 1 ] || run 4 "dp2 pp2 1f1b m4" --dp 2 --pp 2 --schedule 1f1b --microbatches 4
run 4 "dp4 ep2 (4 experts, top-2, cap 1.25)" --dp 4 --ep 2 --experts 4 --top-k 2 --capacity 1.25

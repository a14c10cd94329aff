#!/bin/bash
# tutti-train end to end on the Jargon File: two ranks (tp 2 with sequence parallelism) under
# tutti-run, its loss falls; the checkpoint resumes at one rank and keeps going;
# `sample` prints text; metrics.jsonl and loss.png are written; bad flags and impossible layouts
# are refused before any work.
#   trainer_smoke.sh BIN_DIR
set -euo pipefail
bin=$1
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
small=(--layers 2 --heads 4 --channels 64 --seq 32 --batch 8 --eval-every 10 --eval-batches 2 --threads 1)

"$bin/tutti-run" -n 2 "$bin/tutti-train" "${small[@]}" --tp 2 --sp --steps 30 --out "$out/a" > "$out/a.log"
first=$(grep -o '"loss":[0-9.]*' "$out/a/metrics.jsonl" | head -1 | cut -d: -f2)
last=$(grep -o '"loss":[0-9.]*' "$out/a/metrics.jsonl" | tail -1 | cut -d: -f2)
echo "2 ranks (tp2 sp): loss $first -> $last"
awk -v a="$first" -v b="$last" 'BEGIN { exit !(b < a - 0.3) }' || { echo "loss did not fall"; exit 1; }
test "$(grep -c '"loss"' "$out/a/metrics.jsonl")" = 30
grep -q val_loss "$out/a/metrics.jsonl"
test -s "$out/a/loss.png"
test -s "$out/a/checkpoint_000030/manifest.json"

# Resume at one rank for 10 more steps (same schedule length: it continues where it stopped).
"$bin/tutti-train" "${small[@]}" --steps 40 --resume "$out/a/checkpoint_000030" --out "$out/a" > "$out/b.log"
grep -q "step    31/40" "$out/b.log"
test "$(grep -c '"loss"' "$out/a/metrics.jsonl")" = 40

"$bin/tutti-train" sample --checkpoint "$out/a/checkpoint_000040" --tokens 40 --prompt "hacker" > "$out/sample.txt"
test "$(wc -c < "$out/sample.txt")" -ge 40

# A pipeline (zero-bubble, micro-batches) and a mixture of experts over expert-parallel ranks train;
# the schedule tool prints and draws a checked schedule.
"$bin/tutti-run" -n 2 "$bin/tutti-train" "${small[@]}" --pp 2 --schedule zb-h1 --microbatches 4 --steps 10 \
  --out "$out/p" > "$out/p.log"
grep -q "^pipeline zb-h1: measured bubble" "$out/p.log"
test "$(grep -c '"loss"' "$out/p/metrics.jsonl")" = 10
"$bin/tutti-run" -n 2 "$bin/tutti-train" "${small[@]}" --dp 2 --ep 2 --experts 4 --top-k 2 --capacity 1.25 --steps 10 \
  --out "$out/e" > "$out/e.log"
grep -q "E4 top2 cap1.25" "$out/e.log"
test "$(grep -c '"loss"' "$out/e/metrics.jsonl")" = 10
"$bin/tutti-train" schedule --pp 4 --schedule interleaved --vp 2 --svg "$out/s.svg" > "$out/s.log"
grep -q "bubble 0.158" "$out/s.log"
grep -q "<svg" "$out/s.svg"

# Refusals, each naming the problem.
expect_error() {
  local want=$1; shift
  if "$@" > "$out/err.log" 2>&1; then echo "accepted: $*"; exit 1; fi
  grep -q -- "$want" "$out/err.log" || { echo "no '$want' in:"; cat "$out/err.log"; exit 1; }
}
expect_error "does not divide 4 heads" "$bin/tutti-run" -n 3 "$bin/tutti-train" "${small[@]}" --tp 3 --steps 1 --out "$out/c"
expect_error "2 ranks, but --tp 1 x --dp 1 x --pp 1 = 1" "$bin/tutti-run" -n 2 "$bin/tutti-train" "${small[@]}" --steps 1 --out "$out/c"
expect_error "2 layers do not split into --pp 4" "$bin/tutti-run" -n 4 "$bin/tutti-train" "${small[@]}" --pp 4 --steps 1 --out "$out/c"
expect_error "--ep 2 needs --experts" "$bin/tutti-run" -n 2 "$bin/tutti-train" "${small[@]}" --dp 2 --ep 2 --steps 1 --out "$out/c"
expect_error "'pipedream' is not one of" "$bin/tutti-train" schedule --pp 2 --schedule pipedream
expect_error "--zero 1 needs --dp" "$bin/tutti-train" "${small[@]}" --zero 1 --steps 1 --out "$out/c"
expect_error "cannot open" "$bin/tutti-train" "${small[@]}" --data /nonexistent --steps 1 --out "$out/c"
expect_error "model.layers is 2, this run's is 3" "$bin/tutti-train" --layers 3 --heads 4 --channels 64 --seq 32 --batch 8 \
  --threads 1 --steps 41 --resume "$out/a/checkpoint_000040" --out "$out/c"
echo "ok"

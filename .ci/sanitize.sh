#!/bin/bash
# The sanitizer jobs and fuzz smoke runs of `make test` (so CI runs them):
#   1. AddressSanitizer + UndefinedBehaviorSanitizer (clang): the in-process test programs below
#      and the five libFuzzer targets (tests/fuzz/), each fuzzed for TUTTI_FUZZ_SECONDS (default 12)
#      from its seed corpus. The library is built with -fsanitize=fuzzer-no-link too, so one build
#      serves both.
#   2. ThreadSanitizer (clang): the programs whose ranks are threads of one process, where a data
#      race between ranks would be (the fault-injection tests too: failures cross threads).
#   Both also run a short collective storm (tutti-storm) as 4 thread ranks.
# Any sanitizer report fails the job (halt_on_error). Leak detection is off: the abort and failure
# tests leave a failed communicator's memory to the process's end on purpose (docs/ARCHITECTURE.md,
# "Lifetime of FIFOs"). Subsets, not the whole suite, because both builds and their runs must fit in
# CI's 30 minutes beside the normal build on 2 cores: the programs chosen cover the code that decodes
# input (plans, topologies, bootstrap), computes (reductions, kernels, fused operations), and runs
# plans (CPU executor, one-shot path, communicators, C++ API, emulated device executor).
#   bash .ci/sanitize.sh [--fuzz-only | --asan-only | --tsan-only]
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:-all}
JOBS=${JOBS:-$(nproc)}
export TUTTI_FUZZ_SECONDS=${TUTTI_FUZZ_SECONDS:-12}
asan_tests=(test_executor test_compiler test_fused test_bootstrap test_device_fused test_reduce test_oneshot
            test_msccl_xml test_schedule test_kernels test_simulate test_cpp_api test_topology test_datatype test_env
            test_dsl)
tsan_tests=(test_device_executor test_faults test_executor test_transport test_device_fused test_fused test_oneshot
            test_communicator test_cpp_api)
fuzz_targets=(fuzz_msccl_xml fuzz_plan_json fuzz_nccl_topology_xml fuzz_topology_json fuzz_bootstrap_peer_info)
# Line tables are all a sanitizer report needs (file:line in every frame); full debug information
# made the builds a fifth slower.
common=(-G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DTUTTI_WITH_CUDA=OFF -DTUTTI_WITH_IBVERBS=OFF -DTUTTI_WERROR=OFF
        -DCMAKE_C_COMPILER=clang-14 -DCMAKE_CXX_COMPILER=clang++-14
        "-DCMAKE_C_FLAGS_RELWITHDEBINFO=-O2 -gline-tables-only -DNDEBUG"
        "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O2 -gline-tables-only -DNDEBUG")
failed=()

# Runs the test programs JOBS at a time (longest first in the lists below: several wait on
# timeouts more than they compute, so two at once nearly halve the job), then reports each.
run_tests() {  # build dir, env..., -- tests...
  local dir=$1; shift
  local envs=()
  while [ "$1" != -- ]; do envs+=("$1"); shift; done
  shift
  local t
  for t in "$@"; do
    while [ "$(jobs -pr | wc -l)" -ge "$JOBS" ]; do wait -n || true; done
    (rc=0; env "${envs[@]}" "$dir/bin/$t" --gtest_brief=1 > "$dir/$t.log" 2>&1 || rc=$?; echo $rc > "$dir/$t.rc") &
  done
  wait
  for t in "$@"; do
    if [ "$(cat "$dir/$t.rc")" = 0 ]; then
      echo "PASS $dir $t $(grep -oE '[0-9]+ ms total' "$dir/$t.log" | tail -1)"
    else
      echo "FAIL $dir $t"; grep -E "ERROR: |SUMMARY|runtime error|FAILED|Failure" "$dir/$t.log" | head -20 | sed 's/^/    /'
      failed+=("$dir/$t")
    fi
  done
}

# A short collective storm (tests/storm.cpp) as 4 thread ranks: every collective, type and op
# through the NCCL API, on split communicators, grouped and not.
run_storm() {  # build dir, env...
  local dir=$1; shift
  if env "$@" "$dir/bin/tutti-storm" --threads 4 --calls 60 --max-bytes 1048576 > "$dir/storm.log" 2>&1; then
    echo "PASS $dir tutti-storm"
  else
    echo "FAIL $dir tutti-storm"; grep -E "ERROR: |SUMMARY|runtime error|wrong|failed" "$dir/storm.log" | head -20 | sed 's/^/    /'
    failed+=("$dir/tutti-storm")
  fi
}

if [ "$mode" = all ] || [ "$mode" = --asan-only ] || [ "$mode" = --fuzz-only ]; then
  flags="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer"
  cmake -S . -B build-sanitize "${common[@]}" -DTUTTI_FUZZ=ON -DTUTTI_FUZZ_SECONDS="$TUTTI_FUZZ_SECONDS" \
    -DCMAKE_C_FLAGS="$flags" -DCMAKE_CXX_FLAGS="$flags -fsanitize=fuzzer-no-link" \
    -DCMAKE_EXE_LINKER_FLAGS="$flags" -DCMAKE_SHARED_LINKER_FLAGS="$flags" > build-sanitize.cmake.log
  targets=("${fuzz_targets[@]}")
  [ "$mode" = --fuzz-only ] || targets+=("${asan_tests[@]}" tutti-run tutti-test-rank tutti-storm)
  cmake --build build-sanitize -j "$JOBS" --target "${targets[@]}" > build-sanitize.build.log 2>&1 ||
    { tail -30 build-sanitize.build.log; exit 1; }
  if [ "$mode" != --fuzz-only ]; then
    run_tests build-sanitize ASAN_OPTIONS=detect_leaks=0:halt_on_error=1:abort_on_error=1 \
      UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 -- "${asan_tests[@]}"
    run_storm build-sanitize ASAN_OPTIONS=detect_leaks=0:halt_on_error=1:abort_on_error=1 \
      UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
  fi
  (cd build-sanitize && ctest -L fuzz -j "$JOBS" --output-on-failure) || failed+=("fuzz")
fi

if [ "$mode" = all ] || [ "$mode" = --tsan-only ]; then
  flags="-fsanitize=thread -fno-omit-frame-pointer"
  cmake -S . -B build-tsan "${common[@]}" -DCMAKE_C_FLAGS="$flags" -DCMAKE_CXX_FLAGS="$flags" \
    -DCMAKE_EXE_LINKER_FLAGS="$flags" -DCMAKE_SHARED_LINKER_FLAGS="$flags" > build-tsan.cmake.log
  cmake --build build-tsan -j "$JOBS" --target "${tsan_tests[@]}" tutti-run tutti-test-rank tutti-fault-rank tutti-storm \
    > build-tsan.build.log 2>&1 ||
    { tail -30 build-tsan.build.log; exit 1; }
  run_tests build-tsan TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1 -- "${tsan_tests[@]}"
  run_storm build-tsan TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1
fi

if [ ${#failed[@]} -gt 0 ]; then
  echo "sanitizer jobs failed: ${failed[*]}"
  exit 1
fi
echo "sanitizer jobs passed"

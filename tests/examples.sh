#!/bin/bash
# Installs the build into a fresh prefix and builds and runs examples/ against it, as a user of the
# install would: only the prefix, no source tree on any include path.
#   tests/examples.sh <build dir> <source dir>
set -euo pipefail
build=$1
src=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cmake --install "$build" --prefix "$work/prefix" > /dev/null
for ex in nccl_c cpp_api custom_collective; do
  cmake -S "$src/examples/$ex" -B "$work/$ex" -G Ninja -DCMAKE_PREFIX_PATH="$work/prefix" > /dev/null
  cmake --build "$work/$ex" > /dev/null
done
"$work/nccl_c/nccl_c_example"
"$work/cpp_api/cpp_api_example"
"$work/custom_collective/custom_collective_example"
# pkg-config finds both libraries too, where the prefix is now (the .pc files are relocatable).
flags=$(PKG_CONFIG_PATH="$work/prefix/lib/pkgconfig" pkg-config --cflags --libs tutti nccl)
echo "$flags"
case "$flags" in *"$work/prefix/lib/pkgconfig/../../include"*) ;; *) echo "pkg-config points elsewhere: $flags"; exit 1;; esac

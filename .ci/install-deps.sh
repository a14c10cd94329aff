#!/bin/bash
# Installs the Debian packages tutti builds with. Idempotent: does nothing when all are present.
# The CUDA toolkit is not a Debian package here; it is used when found under /usr/local/cuda.
set -euo pipefail
packages=(cmake ninja-build g++ make pkg-config libfmt-dev libhwloc-dev libhwy-dev nlohmann-json3-dev
          libopenblas-dev zlib1g-dev jargon-text gnuplot-nox
          libpugixml-dev libcli11-dev libibverbs-dev libgtest-dev libgmock-dev libbenchmark-dev iproute2
          clang-14 libclang-rt-14-dev libssl-dev)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then exit 0; fi
echo "installing: ${missing[*]}"
if [ "$(id -u)" != 0 ]; then SUDO=sudo; else SUDO=; fi
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"

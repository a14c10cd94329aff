#!/bin/bash
# Regenerates the model's decision tables checked in beside the presets (topologies/tuning/), for
# every collective from 8 B to 1 GiB. tests/test_tuner.cpp checks that they are current and sane.
#   tools/tune/preset_tables.sh [build-dir]
set -euo pipefail
build=${1:-build}
here=$(cd "$(dirname "$0")/../.." && pwd)
for preset in dgx1 dgx-a100 ndv4 dgx-h100 ndv5 ncv4 pcie8 cpu-tcp; do
  "$build/bin/tutti-tune" --topo "$preset" --collective all -b 8 -e 1G -f 4 -o "$here/topologies/tuning/$preset.json" > /dev/null
  echo "topologies/tuning/$preset.json"
done

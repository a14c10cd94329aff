#!/bin/bash
# A user clones the repository and nothing else: no tracked file may refer to the developers' folder
# beside the checkout (where test inputs once lived). docs/PERFORMANCE.md is exempt: its records quote
# the commands that were run at the time. The pattern is assembled so this script does not match it.
#   check_self_contained.sh SOURCE_DIR
set -uo pipefail
cd "${1:?usage: check_self_contained.sh SOURCE_DIR}" || exit 1
if ! git rev-parse --is-inside-work-tree > /dev/null 2>&1; then
  echo "not a git checkout: cannot list the tracked files"
  exit 1
fi
outside=$(printf '../%s' shared)
hits=$(git ls-files -z | grep -zv '^docs/PERFORMANCE.md$' | xargs -0 grep -n -F "$outside" 2>/dev/null)
if [ -n "$hits" ]; then
  echo "tracked files refer to $outside, outside the repository:"
  echo "$hits"
  exit 1
fi
echo "ok: no tracked file refers to $outside"

#!/bin/bash
# A user clones the repository and nothing else: no tracked file may refer to a path beside it
# (../shared, where the developers' test inputs once lived). docs/PERFORMANCE.md is exempt: its
# records quote the commands that were run at the time.
#   check_self_contained.sh SOURCE_DIR
set -uo pipefail
cd "${1:?usage: check_self_contained.sh SOURCE_DIR}" || exit 1
if ! git rev-parse --is-inside-work-tree > /dev/null 2>&1; then
  echo "not a git checkout: cannot list the tracked files"
  exit 1
fi
hits=$(git ls-files -z | grep -zv '^docs/PERFORMANCE.md$' | grep -zv '^tests/check_self_contained.sh$' |
       xargs -0 grep -n -F '../shared' 2>/dev/null)
if [ -n "$hits" ]; then
  echo "tracked files refer to ../shared, outside the repository:"
  echo "$hits"
  exit 1
fi
echo "ok: no tracked file refers to ../shared"

#!/bin/bash
# Two builds of tutti side by side: tutti-perf of each, alternating, ROUNDS times, ranks as processes
# under each build's own tutti-run. Prints, per collective and size, the median out-of-place time of
# each build and the ratio (old / new: above 1, the new build is faster). For changes that must cost
# nothing measurable (a wider transport header, a check on every call).
#
#   compare_builds.sh OLD_BUILD NEW_BUILD [ROUNDS] [PROCS] [COLLECTIVES] [-- tutti-perf flags]
#
# e.g. compare_builds.sh /tmp/old/build build 5 2 "all_reduce all_gather" -- -b 8 -e 1M -f 4
# Environment (TUTTI_MAILBOX_SIZE=0 to take the plan path for small calls, ...) applies to both.
set -euo pipefail
old=${1:?usage: compare_builds.sh OLD_BUILD NEW_BUILD [ROUNDS] [PROCS] [COLLECTIVES] [-- tutti-perf flags]}
new=${2:?usage: compare_builds.sh OLD_BUILD NEW_BUILD [ROUNDS] [PROCS] [COLLECTIVES] [-- tutti-perf flags]}
rounds=${3:-5}
procs=${4:-2}
colls=${5:-all_reduce}
shift $(( $# < 5 ? $# : 5 ))
[ "${1:-}" = "--" ] && shift
flags=("$@")
[ ${#flags[@]} -gt 0 ] || flags=(-b 8 -e 1M -f 4 -n 200 -w 20)
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
for coll in $colls; do
  for r in $(seq 1 "$rounds"); do
    for which in old new; do
      dir=$old
      [ "$which" = new ] && dir=$new
      "$dir/bin/tutti-run" -n "$procs" "$dir/bin/tutti-perf" "$coll" "${flags[@]}" 2>/dev/null |
        awk -v r="$r" -v w="$which" -v c="$coll" '$1 ~ /^[0-9]+$/ && NF >= 9 { print c, w, r, $1, $6, $10 }' >> "$out/times"
    done
  done
done
echo "# $procs processes, $rounds alternating rounds; median out-of-place / in-place time (us); ratio old/new"
echo "# collective       bytes    old-oop   new-oop  ratio    old-ip    new-ip  ratio"
python3 - "$out/times" <<'EOF'
import statistics, sys
from collections import defaultdict
t = defaultdict(list)
for line in open(sys.argv[1]):
    c, w, r, size, oop, ip = line.split()
    for kind, v in (('oop', oop), ('ip', ip)):
        try:
            t[(c, int(size), w, kind)].append(float(v))
        except ValueError:  # N/A: no in-place form (alltoall)
            pass
keys = sorted({(c, s) for (c, s, _, _) in t})
ratios = []
for c, s in keys:
    cells = []
    for kind in ('oop', 'ip'):
        old, new = t.get((c, s, 'old', kind)), t.get((c, s, 'new', kind))
        if not old or not new:
            cells.append(f"{'-':>9} {'-':>9} {'-':>6}")
            continue
        o, n = statistics.median(old), statistics.median(new)
        ratios.append(o / n)
        cells.append(f"{o:>9.2f} {n:>9.2f} {o / n:>6.2f}")
    print(f"{c:<14} {s:>10} {cells[0]} {cells[1]}")
g = statistics.geometric_mean(ratios)
print(f"# geometric mean of old/new over {len(ratios)} points: {g:.3f}")
EOF

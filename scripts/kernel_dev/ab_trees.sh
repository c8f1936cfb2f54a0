#!/usr/bin/env bash
# One command run in several source trees one after the other, on one machine: an A/B of kernel
# branches in a single device call (timings compare only within a call: kernels/LOG.md).
#
#   bash scripts/kernel_dev/ab_trees.sh make main exp2-fma     # here: .ab/main, .ab/exp2-fma from those refs
#   bash scripts/kernel_dev/ab_trees.sh run main exp2-fma -- python3 scripts/bench/bench_attention_scores.py \
#       --cases none,softcap --out '$OUT/{}'                  # on the device: {} is the tree's name
#
# `make` writes each ref's tracked files (git archive) under .ab/<ref>, which .git/info/exclude
# keeps out of the working tree that travels; name .ab in the device call's carry. `run` runs the
# command from inside each tree, with that tree first on PYTHONPATH (before what PYTHONPATH holds
# already, e.g. wheels installed to /tmp/site), and goes on to the next tree if one fails.
set -euo pipefail
cd "$(dirname "$0")/../.."
mode=${1:-}; shift || true
case "$mode" in
make)
  grep -qx '/.ab/' .git/info/exclude 2>/dev/null || echo '/.ab/' >> .git/info/exclude
  for ref in "$@"; do
    dir=.ab/${ref//\//_}
    rm -rf "$dir" && mkdir -p "$dir"
    git archive "$ref" | tar -x -C "$dir"
    echo "$dir: $(git rev-parse --short "$ref")" | tee "$dir/AB_COMMIT"
  done
  ;;
run)
  trees=()
  while (( $# )) && [[ $1 != -- ]]; do trees+=("$1"); shift; done
  [[ ${1:-} == -- ]] || { echo "usage: $0 run TREE... -- COMMAND (see the header)" >&2; exit 2; }
  shift
  for name in "${trees[@]}"; do
    dir=.ab/${name//\//_}
    [[ -d $dir ]] || { echo "no tree $dir: make it first ($0 make $name) and carry .ab" >&2; exit 2; }
    command=("${@//\{\}/$name}")
    echo "=== $(date +%T) $name ($(cat "$dir/AB_COMMIT")): ${command[*]}"
    (cd "$dir" && PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" FLASHTRAIN_COMMIT="$(cut -d' ' -f2 AB_COMMIT)" \
      bash -c "${command[*]}") || echo "=== $name: exit $?"
  done
  ;;
*)
  echo "usage: $0 make REF... | run TREE... -- COMMAND (see the header)" >&2; exit 2 ;;
esac

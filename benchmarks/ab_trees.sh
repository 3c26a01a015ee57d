#!/usr/bin/env bash
# Run one benchmark script alternately from two checkouts of this repository
# (an older and a newer revision, each with its own `make setup` .venv), with
# the same options, ROUNDS pairs, so that a change is compared with what it
# replaced on the same machine, one after the other. Each run's output goes to
# $OUT_DIR/<script>-<old|new>-<round>.log; compare the tables across them.
#
#   OLD_TREE=/work/old NEW_TREE=$PWD ROUNDS=3 benchmarks/ab_trees.sh \
#       bench_save_load.py --size-scale 0.5 --repeat 3 --wait-idle 10
#
# ORDER="new old" runs the newer tree first in each round (to see order effects).
set -u
: "${OLD_TREE:?set OLD_TREE to the older checkout (with its .venv)}"
: "${NEW_TREE:?set NEW_TREE to the newer checkout (with its .venv)}"
ROUNDS=${ROUNDS:-3}
OUT_DIR=$(realpath -m "${OUT_DIR:-bench_out/ab}")
mkdir -p "$OUT_DIR"
script=$1
shift
for round in $(seq 1 "$ROUNDS"); do
    for side in ${ORDER:-old new}; do
        if [ "$side" = old ]; then tree=$OLD_TREE; else tree=$NEW_TREE; fi
        # From a neutral directory: each interpreter imports its own tree's package.
        (cd /tmp && "$tree/.venv/bin/python" "$tree/benchmarks/$script" \
            --root "$OUT_DIR/scratch-$side" "$@") >"$OUT_DIR/${script%.py}-$side-$round.log" 2>&1
        echo "round $round $side rc=$?"
    done
done

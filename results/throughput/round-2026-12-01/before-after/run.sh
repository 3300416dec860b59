#!/usr/bin/env bash
# Before/after side by side: this round's start (249c0fa, "$OLD") and its end ("$NEW"), one repeat
# of benchmarks/train_throughput.py each, alternating, five times; k = 1 and 2, the default MLP run.
# OLD: a worktree at 249c0fa; NEW: one at the commit measured (git worktree add --detach DIR COMMIT)
OLD=${OLD:?a worktree at 249c0fa} NEW=${NEW:?a worktree at the commit measured}
set -u
OUT=$(realpath -m "${OUT:-results/throughput/round-2026-12-01/before-after}")
mkdir -p "$OUT"
export MPISGD_PLAN_FILE=off
for i in 1 2 3 4 5; do
  for side in old new; do
    if [ $side = old ]; then dir="$OLD"; extra=(); else dir="$NEW"; extra=(--replicated); fi
    ( cd "$dir" && PYTHONPATH="$dir" python benchmarks/train_throughput.py --ks 1,2 --repeats 1 "${extra[@]}" \
        --max-others 0.5 --json "$OUT/$side-$i.json" > "$OUT/$side-$i.txt" 2>&1 )
    echo "$side $i done: $(grep -E '^mpisgd k=2 ' "$OUT/$side-$i.txt" | head -2 | tr -s ' ' | tr '\n' ';')"
  done
done
echo "then: python3 $(dirname "$0")/summarize.py, from $OUT"

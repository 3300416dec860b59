"""How much a synchronous step loses to the slowest rank, from a training timeline.

    mpiexec -n 2 python -m mpisgd.train --epochs 2 --threads 1 --timeline t.json
    python benchmarks/step_skew.py t.json [--skip 250]

Reads every rank's timeline (t.json.rank0.json, ...), adds forward and backward
per step (the work each rank does on its own between two collectives), and
prints per rank the mean and standard deviation of that time, then the mean
and median over steps of (slowest rank - mean of the ranks): what every step
waits for its straggler. With one rank's timeline it prints the spread alone,
and what two independent ranks with that spread would lose: the mean of
(max - mean) over random pairs of its steps. The first --skip steps (the
warm-up epoch) are left out.
"""

from __future__ import annotations

import argparse
import glob
import json
import random
import statistics


def work_per_step(path: str) -> list[float]:
    events = json.load(open(path))["traceEvents"]
    fwd = [e["dur"] / 1e3 for e in events if e.get("ph") == "X" and e["name"] == "forward"]
    bwd = [e["dur"] / 1e3 for e in events if e.get("ph") == "X" and e["name"] == "backward"]
    return [f + b for f, b in zip(fwd, bwd)]


def straggler_ms(per_rank: list[list[float]]) -> list[float]:
    """Per step: the slowest rank's work minus the ranks' mean (the wait at the next collective)."""
    return [max(step) - statistics.mean(step) for step in zip(*per_rank)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("timeline", help="the --timeline PATH given to mpisgd.train")
    parser.add_argument("--skip", type=int, default=250, help="leave out the first steps (warm-up)")
    args = parser.parse_args()
    files = sorted(glob.glob(f"{args.timeline}.rank*.json"), key=lambda f: int(f.rsplit("rank", 1)[1][:-5]))
    if not files:
        raise SystemExit(f"no timeline files {args.timeline}.rank*.json")
    per_rank = [work_per_step(f)[args.skip:] for f in files]
    if min(len(w) for w in per_rank) < 2:
        raise SystemExit(f"fewer than 2 steps after --skip {args.skip}")
    for r, w in enumerate(per_rank):
        print(f"rank {r}: forward+backward {statistics.mean(w):.2f} ms per step, sd {statistics.pstdev(w):.2f} ms "
              f"({len(w)} steps)")
    if len(per_rank) > 1:
        lost = straggler_ms(per_rank)
        print(f"slowest rank - mean, per step: mean {statistics.mean(lost):.2f} ms, median "
              f"{statistics.median(lost):.2f} ms")
    else:
        w, rng = per_rank[0], random.Random(0)
        pairs = [straggler_ms([[rng.choice(w)], [rng.choice(w)]])[0] for _ in range(20000)]
        print(f"two independent ranks with this spread: slowest - mean {statistics.mean(pairs):.2f} ms per step")


if __name__ == "__main__":
    main()

"""What a k-rank step spends beyond one rank's work: the reduction's arithmetic, and waiting for peers.

    mpiexec -n 2 python benchmarks/sync_costs.py [--skip 234] [-- TRAIN OPTIONS]

Runs ``mpisgd.train`` (default options ``--epochs 2 --threads 1 --progress
off``) with timers wrapped around the data-parallel step's parts, and prints,
per rank, the mean milliseconds per step after the first ``--skip`` steps (the
warm-up epoch at k = 2):

- the whole step (``DataParallel.train_step``), its forward, its backward
  (which includes the polls between layers, "hooks") and the optimizer;
- the final wait for the gradient buckets, the parameter all-gather (sharded
  step), the per-step check-in, and the finite check (local arithmetic when
  replicated; sharded, each rank checks its chunks and the ranks vote);
- "sums": the rank-order adds of the direct and shared-memory operations
  (mpisgd.comm.direct, mpisgd.comm.shared), wherever they ran: in a hook or
  in the final wait. This is the reduction's own arithmetic;
- "copies": the shared-memory all-reduce's copies of the peers' reduced
  chunks; the direct operations and the all-gather leave copying to MPI, so
  there it counts as waiting;
- "waiting": everything spent in hooks, the final wait, the all-gather and
  the check-in that is not a sum or a copy: posting messages and, mostly,
  waiting for the slower rank.

Per-step compute varies by itself (see step_skew.py), and every collective
waits for the slowest rank: "waiting" is that price, "sums" the price of
averaging. The one-rank counterpart is profile_step.py.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from mpisgd import parallel, train
from mpisgd.comm import direct, shared
from mpisgd.nn.sequential import Sequential
from mpisgd.optim import SGD

PARTS = ("step", "forward", "backward", "hooks", "final wait", "all-gather", "check-in", "finite check",
         "optimizer", "sums in hooks", "sums in wait", "copies")
acc: dict[str, float] = defaultdict(float)
where: list[str] = []  # the timed part we are inside, innermost last
state = {"skip": 0}


def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        where.append(name)
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            acc[name] += time.perf_counter() - t0
            where.pop()
    return wrapper


def timed_work(fn: Callable[..., Any], copy: bool = False) -> Callable[..., Any]:
    """A sum (booked by where it ran) or a copy of the peers' reduced or gathered chunks."""
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            key = "copies" if copy else "sums in hooks" if "hooks" in where else "sums in wait"
            acc[key] += time.perf_counter() - t0
    return wrapper


def in_step(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """Timed only inside a training step (evaluation runs forward too, checkpoints an all-gather)."""
    inner = timed(name, fn)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return (inner if "step" in where else fn)(*args, **kwargs)
    return wrapper


def counted_step(fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(self: parallel.DataParallel, *args: Any, **kwargs: Any) -> Any:
        if self.step_count == state["skip"]:  # warm-up over: count from here
            acc.clear()
        return fn(self, *args, **kwargs)
    return wrapper


def reporting_close(fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(self: parallel.DataParallel) -> Any:
        steps = self.step_count - state["skip"]
        rows = self.comm.gather({p: acc.get(p, 0.0) / max(steps, 1) * 1e3 for p in PARTS}, root=0)
        if self.rank == 0:
            report(rows, steps)
        return fn(self)
    return wrapper


def report(rows: list[dict[str, float]], steps: int) -> None:
    print(f"\nms per step, mean over {steps} steps after the first {state['skip']}")
    cols = [*PARTS, "waiting"]
    print(f"{'rank':>4} " + "".join(f"{c:>14}" for c in cols))
    for r, row in enumerate(rows):
        sums = row["sums in hooks"] + row["sums in wait"] + row["copies"]
        sync = sum(row[p] for p in ("hooks", "final wait", "all-gather", "check-in"))
        row["waiting"] = sync - sums
        print(f"{r:>4} " + "".join(f"{row[c]:14.3f}" for c in cols))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--skip", type=int, default=234, help="steps left out at the start (warm-up)")
    parser.add_argument("train_args", nargs=argparse.REMAINDER, help="after --: options for mpisgd.train")
    args = parser.parse_args()
    train_args = [a for a in args.train_args if a != "--"] or ["--epochs", "2", "--threads", "1",
                                                               "--progress", "off"]
    state["skip"] = args.skip
    dp = parallel.DataParallel
    dp.train_step = counted_step(timed("step", dp.train_step))
    Sequential.forward = in_step("forward", Sequential.forward)
    Sequential.backward = in_step("backward", Sequential.backward)
    dp._on_layer_done = timed("hooks", dp._on_layer_done)
    dp.finish_gradients = timed("final wait", dp.finish_gradients)
    dp.gather_ = in_step("all-gather", dp.gather_)  # not the momentum's, gathered for a checkpoint
    dp.check_in_step = timed("check-in", dp.check_in_step)
    dp.grads_finite = timed("finite check", dp.grads_finite)
    SGD.step = timed("optimizer", SGD.step)
    SGD.step_shards = timed("optimizer", SGD.step_shards)
    shared.SharedOp._sum = timed_work(shared.SharedOp._sum)
    shared.SharedOp._copy = timed_work(shared.SharedOp._copy, copy=True)
    direct.DirectOp._sum = timed_work(direct.DirectOp._sum)
    dp.close = reporting_close(dp.close)
    return train.main(train_args)


if __name__ == "__main__":
    sys.exit(main())

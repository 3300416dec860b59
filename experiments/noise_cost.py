"""What the gradient noise scale adds to a step: one squared norm of this rank's own gradient (the
finite check already gives the averaged one's), on every ``--noise-scale-every``-th step.

Times mpisgd.blas.finite_sq_norm over a model's flat gradient, one call per bucket as the overlapped
step makes them, and prints the time per measured step and per step at the given interval; set it
against a step time from benchmarks/train_throughput.py to get the share (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from mpisgd.blas import finite_sq_norm
from mpisgd.config import at_least
from mpisgd.nn import models


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", default="1024,1024", help="the MLP's hidden widths")
    parser.add_argument("--every", type=at_least(1), default=4, help="--noise-scale-every of the run")
    parser.add_argument("--bucket-mb", type=float, default=4.04, help="the first bucket's size (the rest is one)")
    parser.add_argument("--repeats", type=at_least(1), default=400)
    args = parser.parse_args(argv)
    model = models.mlp(tuple(int(h) for h in args.hidden.split(","))).materialize(np, "float32", seed=0)
    grads = np.random.default_rng(0).standard_normal(model.flat.size).astype(np.float32)
    cut = max(0, grads.size - int(args.bucket_mb * 2**20 / grads.itemsize))
    pieces = [p for p in (grads[cut:], grads[:cut]) if p.size]  # backward fills the last layers first
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        for piece in pieces:
            finite_sq_norm(piece)
        times.append((time.perf_counter() - t0) * 1e3)
    kept = sorted(times[len(times) // 8:])  # the first passes warm the caches
    median = statistics.median(kept)
    p10, p90 = kept[len(kept) // 10], kept[9 * len(kept) // 10]
    print(f"{model.flat.size:,} float32 parameters in {len(pieces)} bucket(s): the squared norm takes "
          f"{median:.3f} ms per measured step (p10 {p10:.3f}, p90 {p90:.3f}; {len(kept)} passes)")
    print(f"every {args.every} steps: {median / args.every:.3f} ms per step")


if __name__ == "__main__":
    main()

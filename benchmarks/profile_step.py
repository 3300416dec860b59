"""Where one training step's time goes, on one rank (no MPI), and how close its GEMMs run to the BLAS.

    OMP_NUM_THREADS=1 python benchmarks/profile_step.py [--hidden 1024,1024] [--batch-size 128] [--steps 200]

Prints the median time of each phase of mpisgd's step (data, forward, backward,
finite check, optimizer) and peak memory (ru_maxrss) against the bytes the step
must hold. Then, alternating one training step with one pass of the same GEMMs
alone (same shapes, layouts and out=, the same BLAS), so that machine noise
hits both alike: "GEMM efficiency" = median isolated GEMM time / median time of
forward+backward (everything else in forward/backward counts against it), and
the spread (sd) of each from pass to pass.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

import numpy as np
from threadpoolctl import threadpool_limits

from mpisgd.blas import all_finite
from mpisgd.data import BatchLoader, GlobalBatches, epoch_permutation, load_fashion_mnist
from mpisgd.nn import SoftmaxCrossEntropy, mlp
from mpisgd.optim import SGD


def gemm_set(hidden: list[int], b: int) -> tuple[list[tuple[np.ndarray, np.ndarray, np.ndarray]], int]:
    """The step's GEMMs as (a, b, out) operands, and their FLOPs: forward y = x W, backward
    dW = x^T dy and dx = dy W^T (not for the first layer, whose input gradient is skipped)."""
    sizes = [784, *hidden, 10]
    rng = np.random.default_rng(0)
    ops, flops = [], 0
    for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        x = rng.standard_normal((b, n_in), dtype=np.float32)
        w = rng.standard_normal((n_in, n_out), dtype=np.float32)
        dy = rng.standard_normal((b, n_out), dtype=np.float32)
        ops += [(x, w, np.empty((b, n_out), np.float32)), (x.T, dy, np.empty((n_in, n_out), np.float32))]
        flops += 4 * b * n_in * n_out
        if i:
            ops.append((dy, w.T, np.empty_like(x)))
            flops += 2 * b * n_in * n_out
    return ops, flops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=lambda s: tuple(map(int, s.split(","))), default=(1024, 1024))
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    threadpool_limits(args.threads)
    train, _, _ = load_fashion_mnist(None)
    b = args.batch_size
    model = mlp(args.hidden).materialize(np, "float32", seed=0)
    opt = SGD(model.flat, momentum=0.9)
    loss = SoftmaxCrossEntropy()
    loader = BatchLoader(train, np, "float32")
    batches = GlobalBatches(len(train), b, 0, 1)
    perm = epoch_permutation(len(train), 0, 0)
    names = ("data", "forward", "backward", "finite check", "optimizer")

    def timed_step(step: int) -> list[float]:
        """One training step; the milliseconds of each phase in ``names``."""
        t = [time.perf_counter()]
        x, y = loader.batch(batches.indices(perm, step % batches.steps_per_epoch, 0))
        t.append(time.perf_counter())
        loss.forward_array(model.forward(x), y)
        t.append(time.perf_counter())
        model.backward(loss.backward(1.0 / b))
        t.append(time.perf_counter())
        all_finite(model.flat.grads)
        t.append(time.perf_counter())
        opt.step(0.05)
        t.append(time.perf_counter())
        return [1e3 * (t1 - t0) for t0, t1 in zip(t, t[1:])]

    phases: dict[str, list[float]] = {k: [] for k in names}
    for step in range(args.steps):
        ms = timed_step(step)
        if step >= 20:  # warm-up
            for name, v in zip(names, ms):
                phases[name].append(v)
    med = {k: statistics.median(v) for k, v in phases.items()}
    total = sum(med.values())
    print(f"MLP 784-{'-'.join(map(str, args.hidden))}-10, b={b}, float32, {args.threads} BLAS thread(s): "
          f"median step {total:.2f} ms")
    for k, v in med.items():
        print(f"  {k:<13}{v:8.2f} ms  {100 * v / total:5.1f} %")

    flat = model.flat
    need = 3 * flat.nbytes + train.images.nbytes + train.labels.nbytes + sum(
        b * h * 4 * 2 for h in [784, *args.hidden, 10])
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # before the GEMM operands below
    print(f"peak RSS {peak / 2**20:.0f} MiB; parameters+gradients+momentum+activations+data set "
          f"{need / 2**20:.0f} MiB (the interpreter and libraries account for the rest)")

    ops, flops = gemm_set(args.hidden, b)
    fb_ms, gemm_ms = [], []
    for step in range(args.steps):
        ms = timed_step(step)
        t0 = time.perf_counter()
        for a, w, out in ops:
            np.matmul(a, w, out=out)
        gemm_ms.append(1e3 * (time.perf_counter() - t0))
        fb_ms.append(ms[1] + ms[2])
    fb, gemm = statistics.median(fb_ms), statistics.median(gemm_ms)
    print(f"alternating {args.steps} steps with the same GEMMs alone: GEMMs alone {gemm:.2f} ms "
          f"({flops / gemm / 1e6:.1f} GFLOP/s); the step's forward+backward {fb:.2f} ms "
          f"({flops / fb / 1e6:.1f} GFLOP/s); GEMM efficiency {gemm / fb:.3f}")
    # how much the same fixed work varies from one pass to the next: at k ranks, every step waits for the
    # slowest rank's draw, so this spread (the machine's, not the code's) sets the straggler's cost
    sd, sd_fb = statistics.stdev(gemm_ms), statistics.stdev(fb_ms)
    print(f"spread from pass to pass (sd): GEMMs alone {sd:.2f} ms ({100 * sd / gemm:.1f} % of the median), "
          f"forward+backward {sd_fb:.2f} ms ({100 * sd_fb / fb:.1f} %)")


if __name__ == "__main__":
    main()

"""Where one training step's time goes, on one rank (no MPI), and how close its GEMMs run to the BLAS.

    OMP_NUM_THREADS=1 python benchmarks/profile_step.py [--hidden 1024,1024] [--batch-size 128] [--steps 200]

Prints the median time of each phase of mpisgd's step (data, forward, backward,
finite check, optimizer) and, for the same GEMM shapes, the time the same BLAS
takes for them alone: "GEMM efficiency" = isolated GEMM time / time of
forward+backward (everything else in forward/backward counts against it).
Also prints peak memory (ru_maxrss) against the bytes the step must hold.
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


def matmul_ms(a: np.ndarray, b: np.ndarray, out: np.ndarray, repeats: int = 50) -> float:
    """Median time of one GEMM with the same shapes, layout and out= as the step uses."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.matmul(a, b, out=out)
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


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
    phases: dict[str, list[float]] = {k: [] for k in ("data", "forward", "backward", "finite check", "optimizer")}
    for step in range(args.steps):
        t0 = time.perf_counter()
        x, y = loader.batch(batches.indices(perm, step % batches.steps_per_epoch, 0))
        t1 = time.perf_counter()
        loss.forward_array(model.forward(x), y)
        t2 = time.perf_counter()
        model.backward(loss.backward(1.0 / b))
        t3 = time.perf_counter()
        all_finite(model.flat.grads)
        t4 = time.perf_counter()
        opt.step(0.05)
        t5 = time.perf_counter()
        if step >= 20:  # warm-up
            for name, dt in zip(phases, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4)):
                phases[name].append(1e3 * dt)
    med = {k: statistics.median(v) for k, v in phases.items()}
    total = sum(med.values())
    print(f"MLP 784-{'-'.join(map(str, args.hidden))}-10, b={b}, float32, {args.threads} BLAS thread(s): "
          f"median step {total:.2f} ms")
    for k, v in med.items():
        print(f"  {k:<13}{v:8.2f} ms  {100 * v / total:5.1f} %")

    # the same GEMMs alone: forward y = x W, backward dW = x^T dy, dx = dy W^T (not for the first layer)
    sizes = [784, *args.hidden, 10]
    rng = np.random.default_rng(0)
    gemm_ms, flops = 0.0, 0
    for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        x = rng.standard_normal((b, n_in), dtype=np.float32)
        w = rng.standard_normal((n_in, n_out), dtype=np.float32)
        dy = rng.standard_normal((b, n_out), dtype=np.float32)
        y, dw, dx = np.empty((b, n_out), np.float32), np.empty((n_in, n_out), np.float32), np.empty_like(x)
        gemm_ms += matmul_ms(x, w, y) + matmul_ms(x.T, dy, dw)
        flops += 4 * b * n_in * n_out
        if i:
            gemm_ms += matmul_ms(dy, w.T, dx)
            flops += 2 * b * n_in * n_out
    fb = med["forward"] + med["backward"]
    print(f"GEMMs alone: {gemm_ms:.2f} ms ({flops / gemm_ms / 1e6:.1f} GFLOP/s); in the step's forward+backward: "
          f"{fb:.2f} ms ({flops / fb / 1e6:.1f} GFLOP/s); GEMM efficiency {gemm_ms / fb:.3f}")
    flat = model.flat
    need = 3 * flat.nbytes + train.images.nbytes + train.labels.nbytes + sum(
        b * h * 4 * 2 for h in [784, *args.hidden, 10])
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(f"peak RSS {peak / 2**20:.0f} MiB; parameters+gradients+momentum+activations+data set "
          f"{need / 2**20:.0f} MiB (the interpreter and libraries account for the rest)")


if __name__ == "__main__":
    main()

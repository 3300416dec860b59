"""Where the portable level's step goes, on one rank: its products against the BLAS alone.

The experiment behind docs/reproducible.md's "Cost" (results/portable/throughput-compiled-passes-*.md,
results/portable/step-split-*.md):

    OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 python experiments/portable_products.py [--batch-size 128] [--repeats 30]
    OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 python experiments/portable_products.py --model cnn

For the MLP (784-1024-1024-10), first each of its five large products at batch b (x @ W1, h @ W2, their
weight gradients, dy @ W2.T): the median time of the portable product with its splits, of the product of
operands split beforehand, of one float64 GEMM of the same shapes and of the float32 GEMM the default
runs. Then, for the MLP, LeNet-5 (``--model cnn``) or ResNet-20, the whole forward and backward of one
step (fast, then portable kernels, alternating so that machine noise hits both alike), each with the time
its BLAS calls took inside it (NumPy's matmul, timed call by call in place), and two ceilings: the ratio
the portable step would reach with every pass but its float64 GEMMs free, and with its passes as cheap
as the default's (the default's step less its GEMMs, plus the portable GEMMs).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from mpisgd.config import at_least
from mpisgd.kernels import kernels_for
from mpisgd.nn import SoftmaxCrossEntropy, build_model
from mpisgd.portable import gemm


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1000 * float(np.median(times))


def products(b: int) -> list[tuple[str, tuple[int, int], tuple[int, int]]]:
    return [("x @ W1", (b, 784), (784, 1024)), ("h @ W2", (b, 1024), (1024, 1024)),
            ("x.T @ dy (dW1)", (784, b), (b, 1024)), ("h.T @ dy (dW2)", (1024, b), (b, 1024)),
            ("dy @ W2.T", (b, 1024), (1024, 1024))]


def product_times(rng: np.random.Generator, sa: tuple[int, int], sb: tuple[int, int], repeats: int) -> np.ndarray:
    """ms: the portable product with its splits, of split operands, float64 dgemm, float32 sgemm."""
    a, b = rng.standard_normal(sa).astype(np.float32), rng.standard_normal(sb).astype(np.float32)
    ws = gemm.Workspace()
    a_split, b_split = gemm.split(a, "left", ws, "a"), gemm.split(b, "right", ws, "b")
    out, out64 = np.empty((sa[0], sb[1]), np.float32), np.empty((sa[0], sb[1]))
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    return np.array([median_ms(lambda: gemm.matmul(a, b, out=out, ws=ws), repeats),
                     median_ms(lambda: gemm.matmul(a_split, b_split, out=out, ws=ws), repeats),
                     median_ms(lambda: np.matmul(a64, b64, out=out64), repeats),
                     median_ms(lambda: np.matmul(a, b, out=out), repeats)])


class BlasClock:
    """Time spent in NumPy's matmul while on: both kernels' products call it (the portable ones in
    float64, on integers), so it is the step's BLAS time, measured in place."""

    def __init__(self) -> None:
        self.ms = 0.0
        self._matmul: Any = np.matmul

    def __enter__(self) -> BlasClock:
        self.ms = 0.0
        matmul = self._matmul

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return matmul(*args, **kwargs)
            finally:
                self.ms += 1000 * (time.perf_counter() - t0)

        np.matmul = timed  # type: ignore[assignment]  # a function in the ufunc's place, while on
        return self

    def __exit__(self, *exc: object) -> None:
        np.matmul = self._matmul


def product_table(rng: np.random.Generator, batch: int, repeats: int) -> None:
    """The MLP's five products, each timed four ways."""
    rows, total = [], np.zeros(4)
    for name, sa, sb in products(batch):
        t = product_times(rng, sa, sb, repeats)
        total += t
        rows.append((f"{sa[0]}x{sa[1]} @ {sb[0]}x{sb[1]} ({name})", t))
    rows.append(("sum", total))
    print(f"{'product (ms, median of ' + str(repeats) + ')':<40} {'split+product':>13} {'of splits':>10} "
          f"{'dgemm':>8} {'sgemm':>8}")
    for name, t in rows:
        print(f"{name:<40} {t[0]:>13.2f} {t[1]:>10.2f} {t[2]:>8.2f} {t[3]:>8.2f}")
    print()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=["mlp", "cnn", "resnet"], default="mlp")
    p.add_argument("--batch-size", type=at_least(1), default=128)
    p.add_argument("--repeats", type=at_least(1), default=30)
    args = p.parse_args()
    rng = np.random.default_rng(0)
    if args.model == "mlp":
        product_table(rng, args.batch_size, args.repeats)

    x = rng.standard_normal((args.batch_size, 1, 28, 28)).astype(np.float32)
    y = rng.integers(0, 10, args.batch_size)
    steps = {}
    for kind in ("fast", "portable"):
        model = build_model(args.model, (1, 28, 28), 10).materialize(np, "float32", seed=0)
        model.ctx.kernels = kernels_for(kind)
        loss = SoftmaxCrossEntropy(model.ctx.kernels)

        def step(model=model, loss=loss) -> None:
            loss.forward_array(model.forward(x), y)
            model.backward(loss.backward())

        steps[kind] = step
        step()  # the workspaces made, untimed
    clock = BlasClock()
    times: dict[str, list[float]] = {k: [] for k in ("fast", "portable")}
    blas: dict[str, list[float]] = {k: [] for k in ("fast", "portable")}
    for _ in range(args.repeats):  # alternating
        for kind, step in steps.items():
            with clock:
                t0 = time.perf_counter()
                step()
                times[kind].append(1000 * (time.perf_counter() - t0))
            blas[kind].append(clock.ms)
    fast, portable = (float(np.median(times[k])) for k in ("fast", "portable"))
    fast_gemm, portable_gemm = (float(np.median(blas[k])) for k in ("fast", "portable"))
    print(f"{args.model}, b={args.batch_size}: forward and backward, ms (median of {args.repeats}, alternating): "
          f"default {fast:.2f} (its BLAS calls {fast_gemm:.2f}), portable {portable:.2f} (its float64 BLAS calls "
          f"{portable_gemm:.2f}, the rest {portable - portable_gemm:.2f} against the default's "
          f"{fast - fast_gemm:.2f}): {fast / portable:.3f}x")
    print(f"with every pass but the float64 GEMMs free: {fast / portable_gemm:.3f}x")
    print(f"with the portable passes as cheap as the default's: {fast / (fast - fast_gemm + portable_gemm):.3f}x")


if __name__ == "__main__":
    main()

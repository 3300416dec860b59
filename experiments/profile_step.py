"""Where one training step's time goes, on one rank (no MPI), and how close its GEMMs run to the BLAS.

The experiment behind docs/benchmarks.md ("Where a step's time goes (one rank)"); its runs are in
results/throughput/profile-*.txt and results/cnn/profile-*.txt.

    OMP_NUM_THREADS=1 python experiments/profile_step.py [--hidden 1024,1024] [--batch-size 128] [--steps 200]
    OMP_NUM_THREADS=1 python experiments/profile_step.py --model cnn [--lines 15] [--kernels portable]
    OMP_NUM_THREADS=1 python experiments/profile_step.py --model gpt [--data kjv.txt --batch-size 32 --context 64]
    OMP_NUM_THREADS=1 python experiments/profile_step.py --model resnet --steps 40

Prints the median time of each phase of mpisgd's step (data, forward, backward,
finite check, optimizer) and peak memory (ru_maxrss) against the bytes the step
must hold. Then, alternating one training step with one pass of the same GEMMs
alone (same shapes, layouts and out=, the same BLAS), so that machine noise
hits both alike: "GEMM efficiency" = median isolated GEMM time / median time of
forward+backward (everything else in forward/backward counts against it), and
the spread (sd) of each from pass to pass.

`--model cnn` (LeNet-5) replaces the GEMM comparison by a per-layer table:
the median milliseconds of each layer's forward and backward (im2col and the
input gradient dx, where a layer has them, also shown on their own), the loss
and the optimizer. `--model resnet` (ResNet-20) shows the same per kind of
layer (its 60 layers summed by kind: 3x3 and 1x1 convolutions per stage,
BatchNorm, ReLU, pooling), and "containers" for the rest of forward and
backward: the residual additions and the transposes into and out of the
batch-last run. `--lines N` (either model) adds the N costliest lines of
mpisgd/nn/layers.py, timed with sys.settrace (whose own cost, about a
microsecond per line, inflates lines that are cheap anyway).

`--kernels portable` runs the layers on `--reproducible portable`'s kernels (exact slice products,
fixed-order sums: docs/reproducible.md) instead of the default's, for the same tables; the MLP's GEMM
comparison is left out then (experiments/portable_products.py breaks those products down).

`--model gpt` (docs/gpt.md) trains the GPT recipe's model (AdamW) on windows of
`--data` (the King James Bible by default) and prints the median
milliseconds per step of each kind of layer, forward and backward, each
module's own time only (a container's, a residual block's additions; the
attention's own part is its scores, softmax and weighted sums, its two Linear
projections count as GEMMs), the loss and the optimizer.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

import numpy as np
from threadpoolctl import threadpool_limits

from mpisgd.blas import finite_sq_norm
from mpisgd.config import at_least
from mpisgd.data import BatchLoader, GlobalBatches, epoch_permutation, load_fashion_mnist
from mpisgd.kernels import kernels_for
from mpisgd.nn import SoftmaxCrossEntropy, build_model
from mpisgd.optim import SGD

WARMUP_STEPS = 20  # untimed steps before the medians
clock = time.perf_counter  # --cpu-time: time.thread_time


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
    parser.add_argument("--model", choices=["mlp", "cnn", "resnet", "gpt"], default="mlp")
    parser.add_argument("--data", default="/usr/local/share/mpisgd/kjv.txt", help="--model gpt: the text")
    parser.add_argument("--context", type=at_least(1), default=64, help="--model gpt: tokens per window")
    parser.add_argument("--hidden", type=lambda s: tuple(map(int, s.split(","))), default=(1024, 1024))
    parser.add_argument("--batch-size", type=at_least(1), default=None, help="default: 128, 32 for --model gpt")
    parser.add_argument("--steps", type=at_least(1), default=200)
    parser.add_argument("--threads", type=at_least(1), default=1)
    parser.add_argument("--kernels", choices=["fast", "portable"], default="fast",
                        help="the layers' kernels: fast (the default run's) or portable (--reproducible portable's)")
    parser.add_argument("--lines", type=at_least(0), default=0, help="also show the N costliest lines of the layers")
    parser.add_argument("--cpu-time", action="store_true",
                        help="time with this thread's CPU clock: on a machine shared with others, the time the "
                             "process waits for a core is left out")
    args = parser.parse_args()
    global clock
    clock = time.thread_time if args.cpu_time else time.perf_counter
    if args.steps <= WARMUP_STEPS:
        parser.error(f"--steps must be > {WARMUP_STEPS} (the warm-up steps, not timed), got {args.steps}")
    threadpool_limits(args.threads)
    args.batch_size = args.batch_size or (32 if args.model == "gpt" else 128)
    if args.model == "gpt":
        profile_gpt(args)
        return
    train, _, _ = load_fashion_mnist(None)
    b = args.batch_size
    model = build_model(args.model, (1, 28, 28), 10, args.hidden).materialize(np, "float32", seed=0)
    model.ctx.kernels = kernels_for(args.kernels)
    opt = SGD(model.flat, momentum=0.9)
    loss = SoftmaxCrossEntropy(model.ctx.kernels)
    loader = BatchLoader(train, np, "float32")
    batches = GlobalBatches(len(train), b, 0, 1)
    perm = epoch_permutation(len(train), 0, 0)
    names = ("data", "forward", "backward", "finite check", "optimizer")

    def timed_step(step: int) -> list[float]:
        """One training step; the milliseconds of each phase in ``names``."""
        t = [clock()]
        x, y = loader.batch(batches.indices(perm, step % batches.steps_per_epoch, 0))
        t.append(clock())
        loss.forward_array(model.forward(x), y)
        t.append(clock())
        model.backward(loss.backward(1.0 / b))
        t.append(clock())
        finite_sq_norm(model.flat.grads)
        t.append(clock())
        opt.step(0.05)
        t.append(clock())
        return [1e3 * (t1 - t0) for t0, t1 in zip(t, t[1:])]

    # per-layer timers for the CNN's table only: the MLP's figures stay comparable with earlier runs
    layer_ms = LayerTimes(model, loss, opt, by_kind=args.model == "resnet") if args.model != "mlp" else None
    phases: dict[str, list[float]] = {k: [] for k in names}
    for step in range(args.steps):
        ms = timed_step(step)
        if layer_ms:
            layer_ms.end_step(keep=step >= WARMUP_STEPS)
        if step >= WARMUP_STEPS:
            for name, v in zip(names, ms):
                phases[name].append(v)
    med = {k: statistics.median(v) for k, v in phases.items()}
    total = sum(med.values())
    mlp = f"MLP 784-{'-'.join(map(str, args.hidden))}-10"
    workload = {"cnn": "LeNet-5", "resnet": "ResNet-20"}.get(args.model, mlp)
    print(f"{workload}, b={b}, float32, {args.threads} BLAS thread(s)"
          + (", portable kernels" if args.kernels == "portable" else "") + f": median step {total:.2f} ms"
          + (" (CPU time of this thread)" if args.cpu_time else ""))
    for k, v in med.items():
        print(f"  {k:<13}{v:8.2f} ms  {100 * v / total:5.1f} %")

    if layer_ms:
        layer_ms.report(total, med["forward"] + med["backward"])
        layer_ms.remove()
    if args.lines:
        line_profile(timed_step, args.lines)
    if args.model != "mlp" or args.kernels != "fast":
        return
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


class LayerTimes:
    """Timers around each layer's forward and backward (and the methods in PARTS, where a layer has them),
    the loss and the optimizer step: the milliseconds of each, summed per step. ``by_kind``: layers of one
    kind (class and shape of the work) share one row."""

    PARTS = ("_im2col", "_input_grad")  # Conv2d's own steps, shown apart too

    def __init__(self, model: object, loss: object, opt: object, by_kind: bool = False) -> None:
        self.names: dict[int, str] = {}
        self.step_s: dict[tuple[int, str], float] = {}  # this step's seconds so far (im2col runs per chunk)
        self.ms: dict[tuple[int, str], list[float]] = {}
        self._wrapped: list[tuple[object, str]] = []
        kinds: dict[str, int] = {}
        for layer in (m for m in model.modules() if not m.children()):  # type: ignore[attr-defined]
            name = kind_of(layer) if by_kind else f"{len(self.names)} {layer!r}"
            i = kinds.setdefault(name, len(kinds))
            self.names[i] = name
            for method in ("forward", "backward", *self.PARTS):
                if hasattr(layer, method):
                    self._wrap(layer, method, (i, method))
        self.names[-2], self.names[-1] = "loss (softmax cross-entropy)", "optimizer (SGD step)"
        self._wrap(loss, "forward_array", (-2, "forward"))
        self._wrap(loss, "backward", (-2, "backward"))
        self._wrap(opt, "step", (-1, "backward"))

    def _wrap(self, obj: object, method: str, key: tuple[int, str]) -> None:
        inner = getattr(obj, method)
        self.step_s.setdefault(key, 0.0)
        self.ms.setdefault(key, [])

        def timed(*a: object, **kw: object) -> object:
            t0 = clock()
            out = inner(*a, **kw)
            self.step_s[key] += clock() - t0
            return out

        setattr(obj, method, timed)  # an instance attribute, in front of the class's method
        self._wrapped.append((obj, method))

    def end_step(self, keep: bool) -> None:
        for key, sec in self.step_s.items():
            if keep:
                self.ms[key].append(1e3 * sec)
            self.step_s[key] = 0.0

    def remove(self) -> None:
        for obj, method in self._wrapped:
            delattr(obj, method)

    def report(self, step_ms: float, fwd_bwd_ms: float) -> None:
        med = {key: statistics.median(v) for key, v in self.ms.items() if v}
        print("\nper layer, median ms per step (im2col, forward and backward, and dx, the input gradient, are part "
              "of their layer's forward/backward):")
        print(f"  {'layer':<46}{'forward':>9}{'backward':>10}{'im2col':>8}{'dx':>8}{'share':>8}")
        layers_ms = 0.0
        for i in [*sorted(k for k in self.names if k >= 0), -2, -1]:
            fwd, bwd = med.get((i, "forward"), 0.0), med.get((i, "backward"), 0.0)
            layers_ms += fwd + bwd if i >= 0 else 0.0
            parts = "".join(f"{med[(i, p)]:>8.2f}" if (i, p) in med else f"{'':>8}" for p in self.PARTS)
            print(f"  {self.names[i]:<46}{fwd:>9.2f}{bwd:>10.2f}{parts}{100 * (fwd + bwd) / step_ms:>7.1f}%")
        rest = fwd_bwd_ms - layers_ms
        label = "containers (residual adds, layout transposes)"
        print(f"  {label:<46}{rest:>19.2f}{'':>16}{100 * rest / step_ms:>7.1f}%")


def kind_of(layer: object) -> str:
    """A row of the by-kind table: the class, and for convolutions their kernel, stride and channels."""
    from mpisgd.nn import Conv2d  # noqa: PLC0415

    if isinstance(layer, Conv2d):
        return f"Conv2d {layer.k}x{layer.k} stride {layer.stride}, {layer.c_in}->{layer.c_out} ch"
    if hasattr(layer, "C"):
        return f"{type(layer).__name__} {layer.C} ch"  # type: ignore[attr-defined]
    return type(layer).__name__


class KindTimes:
    """Each module's own time (its calls minus the wrapped calls nested in them), summed per kind of module
    and per step: forward and backward."""

    def __init__(self, model: object) -> None:
        self.kinds: dict[str, list[float]] = {}  # kind -> this step's [forward s, backward s]
        self.ms: dict[str, list[list[float]]] = {}
        self._stack: list[float] = []  # the nested calls' time, per open call
        for m in model.modules():  # type: ignore[attr-defined]
            kind = self.kind(m)
            for i, method in enumerate(("forward", "backward")):
                self._wrap(m, method, kind, i)

    @staticmethod
    def kind(m: object) -> str:
        name = type(m).__name__
        if name == "Linear":
            return "Linear (GEMMs)"
        if name == "CausalSelfAttention":
            return "attention: scores, softmax, sums"
        if name in ("Sequential", "Residual"):
            return "containers, residual additions"
        return name

    def _wrap(self, obj: object, method: str, kind: str, i: int) -> None:
        inner = getattr(obj, method)
        self.kinds.setdefault(kind, [0.0, 0.0])

        def timed(*a: object, **kw: object) -> object:
            self._stack.append(0.0)
            t0 = time.perf_counter()
            out = inner(*a, **kw)
            elapsed = time.perf_counter() - t0
            nested = self._stack.pop()
            self.kinds[kind][i] += elapsed - nested
            if self._stack:
                self._stack[-1] += elapsed
            return out

        setattr(obj, method, timed)

    def end_step(self, keep: bool) -> None:
        for kind, (f, b) in self.kinds.items():
            if keep:
                self.ms.setdefault(kind, []).append([1e3 * f, 1e3 * b])
            self.kinds[kind] = [0.0, 0.0]


def profile_gpt(args: argparse.Namespace) -> None:
    """The GPT's step, by kind of layer (docs/gpt.md)."""
    from mpisgd.nn import TokenCrossEntropy  # noqa: PLC0415
    from mpisgd.nn.gpt import GPTShape, gpt  # noqa: PLC0415
    from mpisgd.optim.adam import AdamW, matrices  # noqa: PLC0415
    from mpisgd.text import load_tokens  # noqa: PLC0415

    d = load_tokens(args.data, args.context, 0.05)
    b = args.batch_size
    model = gpt(GPTShape(d.vocab.size, args.context)).materialize(np, "float32", seed=0)
    model.ctx.kernels = kernels_for(args.kernels)
    opt = AdamW(model.flat, (0.9, 0.99), 1e-8, 0.1, decay_mask=matrices(model.flat))
    loss = TokenCrossEntropy(kernels=model.ctx.kernels)
    loader = BatchLoader(d.train, np, "float32")
    batches = GlobalBatches(len(d.train), b, 0, 1)
    perm = epoch_permutation(len(d.train), 0, 0)
    kinds = KindTimes(model)
    step_ms, loss_ms, opt_ms = [], [], []
    for step in range(args.steps):
        t0 = time.perf_counter()
        x, y = loader.batch(batches.indices(perm, step % batches.steps_per_epoch, 0))
        logits = model.forward(x)
        t1 = time.perf_counter()
        loss.forward_array(logits, y)
        dy = loss.backward()
        t2 = time.perf_counter()
        model.backward(dy)
        t3 = time.perf_counter()
        opt.step(1e-3)
        t4 = time.perf_counter()
        kinds.end_step(keep=step >= WARMUP_STEPS)
        if step >= WARMUP_STEPS:
            step_ms.append(1e3 * (t4 - t0))
            loss_ms.append(1e3 * (t2 - t1))
            opt_ms.append(1e3 * (t4 - t3))
    total = statistics.median(step_ms)
    print(f"GPT {model.flat.size:,} parameters (4 layers, 4 heads, 128 dims), b={b}, T={args.context}, float32, "
          f"{args.threads} BLAS thread(s){', portable kernels' if args.kernels == 'portable' else ''}: "
          f"median step {total:.1f} ms, {b * args.context / total * 1e3:.0f} tokens/s")
    print(f"  {'kind of layer (its own time)':<36}{'forward':>9}{'backward':>10}{'share':>8}")
    rows = [(k, statistics.median(f for f, _ in v), statistics.median(bw for _, bw in v)) for k, v in kinds.ms.items()]
    rows += [("loss (softmax cross-entropy)", statistics.median(loss_ms), 0.0),
             ("optimizer (AdamW)", 0.0, statistics.median(opt_ms))]
    for kind, f, bw in sorted(rows, key=lambda r: -(r[1] + r[2])):
        print(f"  {kind:<36}{f:>9.2f}{bw:>10.2f}{100 * (f + bw) / total:>7.1f}%")
    attention_parts(b, args.context, 4, 128 // 4, layers=4, steps=args.steps)


def attention_parts(n: int, t: int, h: int, d: int, layers: int, steps: int) -> None:
    """The attention's own work split in two, on its shapes, each alone (alternated, medians): its six
    batched GEMMs (scores, weighted sums; and backward's four) and its masked softmax (forward, and
    backward's dS = P * (dP - rowsum(dP * P))), times the layers."""
    rng = np.random.default_rng(0)
    q, k, v, dy = (rng.standard_normal((n, h, t, d), dtype=np.float32) for _ in range(4))
    p, dp, tmp = (np.empty((n, h, t, t), np.float32) for _ in range(3))
    out = np.empty((n, h, t, d), np.float32)
    mask = np.triu(np.full((t, t), -np.inf, np.float32), k=1)
    gemm_ms, soft_ms = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        for _ in range(layers):
            np.matmul(q, k.swapaxes(-1, -2), out=p)
            np.matmul(p, v, out=out)
            np.matmul(p.swapaxes(-1, -2), dy, out=out)
            np.matmul(dy, v.swapaxes(-1, -2), out=dp)
            np.matmul(dp, k, out=out)
            np.matmul(dp.swapaxes(-1, -2), q, out=out)
        gemm_ms.append(1e3 * (time.perf_counter() - t0))
        soft = 0.0
        for _ in range(layers):
            np.matmul(q, k.swapaxes(-1, -2), out=p)  # fresh scores, not timed
            np.matmul(dy, v.swapaxes(-1, -2), out=dp)
            t0 = time.perf_counter()
            p += mask
            p -= p.max(axis=-1, keepdims=True)
            np.exp(p, out=p)
            p /= p.sum(axis=-1, keepdims=True)
            np.multiply(dp, p, out=tmp)
            dp -= tmp.sum(axis=-1, keepdims=True)
            dp *= p
            soft += time.perf_counter() - t0
        soft_ms.append(1e3 * soft)
    print(f"  the attention's own time, alone on its shapes ({layers} layers, forward + backward): batched GEMMs "
          f"{statistics.median(gemm_ms):.2f} ms, masked softmax {statistics.median(soft_ms):.2f} ms")


def line_profile(timed_step: object, n_lines: int, steps: int = 30) -> None:
    """The costliest lines of mpisgd/nn/layers.py over ``steps`` steps, per step."""
    import sys  # noqa: PLC0415
    from collections import defaultdict  # noqa: PLC0415

    from mpisgd.nn import layers  # noqa: PLC0415

    spent: dict[tuple[str, int], float] = defaultdict(float)
    last: dict[int, tuple[tuple[str, int], float]] = {}

    def local(frame: object, event: str, arg: object) -> object:
        now = time.perf_counter()
        prev = last.pop(id(frame), None)
        if prev is not None:
            spent[prev[0]] += now - prev[1]
        if event == "line":
            last[id(frame)] = ((frame.f_code.co_name, frame.f_lineno), time.perf_counter())  # type: ignore[attr-defined]
        return local

    def tracer(frame: object, event: str, arg: object) -> object:
        return local if frame.f_code.co_filename == layers.__file__ else None  # type: ignore[attr-defined]

    sys.settrace(tracer)
    for step in range(steps):
        timed_step(step)  # type: ignore[operator]
    sys.settrace(None)
    source = open(layers.__file__).read().splitlines()
    print(f"\nthe {n_lines} costliest lines of mpisgd/nn/layers.py, ms per step (under sys.settrace):")
    for (func, line), sec in sorted(spent.items(), key=lambda kv: -kv[1])[:n_lines]:
        print(f"  {1e3 * sec / steps:7.3f}  {func}:{line}  {source[line - 1].strip()[:80]}")


if __name__ == "__main__":
    main()

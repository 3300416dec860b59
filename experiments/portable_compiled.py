"""What the portable level's C extensions save, on one rank: a model's step with NumPy's forms of the passes
and functions against the compiled ones, in one process, alternating step by step.

The experiment behind docs/reproducible.md's "Cost" (results/portable/compiled-functions-2026-12-03.md):

    OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 python experiments/portable_compiled.py --model cnn [--steps 60]
    OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 python experiments/portable_compiled.py --model gpt --steps 10

Each step runs the model's forward and backward (b = 128 images, or 32 windows of 64 tokens of the King
James Bible for the GPT) on the portable kernels, with either strategy, swapping which goes first every
step so that machine noise hits both alike. Prints each strategy's median step, the median of the paired
differences with its quartiles, and whether the two gave the same loss and gradients bit for bit (they
must: the compiled passes and functions make the same IEEE operations, mpisgd.portable.native). `--only
passes` or `--only functions` swaps one extension and keeps the other compiled.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np
from threadpoolctl import threadpool_limits

from mpisgd.config import at_least
from mpisgd.kernels import kernels_for
from mpisgd.portable import elementwise, passes


def model_step(name: str, batch: int, data: str) -> Any:
    """A function running one forward and backward of ``name`` on fixed data; returns its loss and gradients."""
    from mpisgd.nn import SoftmaxCrossEntropy, TokenCrossEntropy, build_model  # noqa: PLC0415

    kernels = kernels_for("portable")
    if name == "gpt":
        from mpisgd.data import BatchLoader  # noqa: PLC0415
        from mpisgd.nn.gpt import GPTShape, gpt  # noqa: PLC0415
        from mpisgd.text import load_tokens  # noqa: PLC0415

        tokens = load_tokens(data, 64, 0.05)
        model = gpt(GPTShape(tokens.vocab.size, 64)).materialize(np, "float32", seed=0)
        x, y = BatchLoader(tokens.train, np, "float32").batch(np.arange(batch))  # the first windows
        loss: Any = TokenCrossEntropy(kernels=kernels)
    else:
        rng = np.random.default_rng(0)
        model = build_model(name).materialize(np, "float32", seed=0)
        x = np.maximum(rng.standard_normal((batch, 1, 28, 28)), -0.8).astype(np.float32)  # images' floor
        y = rng.integers(0, 10, batch)
        loss = SoftmaxCrossEntropy(kernels)
    model.ctx.kernels = kernels

    def step() -> bytes:
        value = loss.forward_array(model.forward(x), y)
        model.backward(loss.backward())
        return np.asarray(value).tobytes() + np.asarray(model.flat.grads).tobytes()

    return step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=["mlp", "cnn", "resnet", "gpt"], default="cnn")
    p.add_argument("--steps", type=at_least(1), default=60, help="steps per strategy (after one of each untimed)")
    p.add_argument("--batch-size", type=at_least(1), default=None, help="default: 128, 32 for the GPT")
    p.add_argument("--only", choices=["passes", "functions"], default=None)
    p.add_argument("--data", default="/usr/local/share/mpisgd/kjv.txt", help="--model gpt: the text")
    args = p.parse_args()
    compiled: dict[str, Any] = {"passes": passes.passes_for(np), "functions": elementwise.functions_for(np)}
    if any(s.name != "compiled" for s in compiled.values()):
        p.error("the compiled passes and functions are not built, or MPISGD_PORTABLE_PASSES=ufunc: nothing to compare")
    ufunc: dict[str, Any] = {"passes": passes.UfuncPasses(), "functions": elementwise.UfuncFunctions()}
    if args.only:  # the other extension stays compiled on both sides
        ufunc = {k: (v if k == args.only else compiled[k]) for k, v in ufunc.items()}
    sides = {"NumPy's": ufunc, "compiled": compiled}
    step = model_step(args.model, args.batch_size or (32 if args.model == "gpt" else 128), args.data)
    times: dict[str, list[float]] = {k: [] for k in sides}
    results: dict[str, bytes] = {}
    with threadpool_limits(1):
        for i in range(args.steps + 1):
            for side in sorted(sides, reverse=bool(i % 2)):
                passes._CHOSEN[np.__name__] = sides[side]["passes"]
                elementwise._CHOSEN[np.__name__] = sides[side]["functions"]
                t0 = time.perf_counter()
                results[side] = step()
                if i:  # the first of each: untimed (buffers, caches)
                    times[side].append(1000 * (time.perf_counter() - t0))
    slow, fast = np.array(times["NumPy's"]), np.array(times["compiled"])
    saved = slow - fast
    what = args.only or "passes and functions"
    print(f"{args.model}, portable kernels, forward and backward, {args.steps} steps each, alternating ({what}):")
    print(f"  NumPy's {np.median(slow):.2f} ms, compiled {np.median(fast):.2f} ms: "
          f"{np.median(slow) / np.median(fast):.2f}x; paired saving {np.median(saved):.2f} ms "
          f"[quartiles {np.percentile(saved, 25):.2f}, {np.percentile(saved, 75):.2f}]")
    same = results["NumPy's"] == results["compiled"]
    print(f"  the same loss and gradients, bit for bit: {'yes' if same else 'NO'}")
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()

"""How accurate the portable kernels are: per layer against float64, and the trained model's accuracy.

The experiment behind docs/reproducible.md ("Accuracy"); its runs are in results/portable/.

    python experiments/portable_accuracy.py layers [--steps 300] [--out results/portable]
    python experiments/portable_accuracy.py training [--seeds 0,1,2] [--epochs 3] [--out results/portable]

``layers``: the MLP (784-1024-1024-10) and LeNet-5 are trained ``--steps`` steps on Fashion-MNIST (the
default path), so that their weights, activations and gradients are a trained model's; then, for one
batch of 128, every layer with parameters and the loss is computed again alone from the same float32
inputs (its input, parameters and output gradient) with the fast kernels, with the portable ones, and
in float64 (the reference). The table gives each quantity's relative error ||got - ref|| / ||ref||
(Frobenius): the forward output y, the gradients dW, db and dx.

``training``: ``mpiexec -n 2 python -m mpisgd.train`` for each seed, the default run against
``--reproducible portable``: the final test accuracy of each, for the MLP and LeNet-5 (the portable
level's accuracy against the default's run-to-run noise).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mpisgd.config import at_least  # noqa: E402
from mpisgd.data import BatchLoader, load_fashion_mnist  # noqa: E402
from mpisgd.kernels import kernels_for  # noqa: E402
from mpisgd.nn import Conv2d, Linear, Sequential, SoftmaxCrossEntropy, cnn, mlp  # noqa: E402
from mpisgd.optim import SGD  # noqa: E402

QUANTITIES = ("y", "dW", "db", "dx")


def train(model_name: str, steps: int) -> tuple[Any, dict[int, tuple[Any, Any]], Any]:
    """The model trained ``steps`` steps (fast path), and for one batch each parameter layer's input and
    output gradient, and the loss's logits and labels."""
    train_set, _, _ = load_fashion_mnist()
    model = (mlp((1024, 1024)) if model_name == "mlp" else cnn()).materialize(np, "float32", seed=0)
    opt, loss = SGD(model.flat, momentum=0.9), SoftmaxCrossEntropy()
    loader, rng = BatchLoader(train_set, np, "float32"), np.random.default_rng(0)
    lr = 0.05 if model_name == "mlp" else 0.02
    for _ in range(steps):
        x, y = loader.batch(rng.integers(0, len(train_set), 128))
        loss.forward_array(model.forward(x), y)
        model.backward(loss.backward())
        opt.step(lr)
    seen: dict[int, list[Any]] = {}
    layers = [m for m in model.modules() if isinstance(m, Linear | Conv2d)]
    for layer in layers:  # capture each layer's input and output gradient
        forward, backward = layer.forward, layer.backward

        def spy_f(x: Any, f: Any = forward, i: int = layer.index) -> Any:
            seen.setdefault(i, [None, None])[0] = np.array(x)
            return f(x)

        def spy_b(dy: Any, need_dx: bool = True, b: Any = backward, i: int = layer.index) -> Any:
            seen[i][1] = np.array(dy)
            return b(dy, need_dx)

        layer.forward, layer.backward = spy_f, spy_b  # type: ignore[method-assign]
    x, y = loader.batch(rng.integers(0, len(train_set), 128))
    logits = np.array(model.forward(x))
    loss.forward_array(model.forward(x), y)
    model.backward(loss.backward())
    return model, {i: (v[0], v[1]) for i, v in seen.items()}, (logits, np.array(y))


def clone(layer: Any) -> Any:
    if isinstance(layer, Linear):
        return Linear(layer.n_in, layer.n_out)
    return Conv2d(layer.c_in, layer.c_out, layer.k, layer.stride, layer.pad)


def one_layer(layer: Any, x: Any, dy: Any, dtype: str, kernels: str) -> dict[str, Any]:
    """The layer alone, on ``x`` and ``dy`` (float32 values), computed in ``dtype`` with ``kernels``."""
    model = Sequential(clone(layer)).materialize(np, dtype, seed=0)
    model.ctx.kernels = kernels_for(kernels)
    only = model.modules()[1]
    for name, p in only.params.items():
        p[...] = layer.params[name]
    y = np.array(model.forward(x.astype(dtype)))
    dx = only.backward(dy.astype(dtype).copy(), need_dx=True)
    return {"y": y, "dW": np.array(only.grads["W"]), "db": np.array(only.grads["b"]), "dx": np.array(dx)}


def rel(got: Any, ref: Any) -> float:
    return float(np.linalg.norm(got.astype(np.float64) - ref)) / max(float(np.linalg.norm(ref)), 1e-300)


def layers(steps: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in ("mlp", "cnn"):
        model, seen, (logits, labels) = train(name, steps)
        for layer in (m for m in model.modules() if isinstance(m, Linear | Conv2d)):
            x, dy = seen[layer.index]
            if isinstance(layer, Conv2d) and layer.batch_last:  # captured inside the model's batch-last run
                x = x.transpose(3, 0, 1, 2)  # the layer alone takes NCHW (its backward, dy as captured)
            ref = one_layer(layer, x, dy, "float64", "fast")
            got = {k: one_layer(layer, x, dy, "float32", k) for k in ("fast", "portable")}
            out[f"{name} {layer!r}"] = {k: {q: rel(got[k][q], ref[q]) for q in QUANTITIES} for k in got}
        z = logits.astype(np.float64)  # the loss: its value and gradient
        p = np.exp(z - z.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        want_loss = -np.mean(np.log(p[np.arange(len(labels)), labels]))
        want_grad = (p - np.eye(p.shape[1])[labels]) / len(labels)
        row = {}
        for k in ("fast", "portable"):
            loss = SoftmaxCrossEntropy(kernels_for(k))
            value = float(loss.forward_array(logits.copy(), labels))
            row[k] = {"loss": abs(value - want_loss) / abs(want_loss), "dlogits": rel(loss.backward(), want_grad)}
        out[f"{name} softmax cross-entropy"] = row
    return out


def final_accuracy(model: str, seed: int, level: str, epochs: int, tmp: str) -> float:
    metrics = os.path.join(tmp, f"{model}-{seed}-{level}.jsonl")
    args = ["-m", "mpisgd.train", "--epochs", str(epochs), "--seed", str(seed), "--progress", "off",
            "--metrics-file", metrics, *(("--model", "cnn") if model == "cnn" else ())]
    if level == "portable":
        args += ["--reproducible", "portable"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
           "MPISGD_PLAN_FILE": "off"}
    r = subprocess.run([shutil.which("mpiexec") or "mpiexec", "-n", "2", sys.executable, *args], env=env,
                       capture_output=True, text=True, timeout=7200)
    if r.returncode:
        raise RuntimeError(f"{model} seed {seed} {level}: {r.stderr[-2000:]}")
    epochs_seen = [json.loads(line) for line in Path(metrics).read_text().splitlines()]
    return float([e for e in epochs_seen if e.get("kind") == "epoch"][-1]["test_acc"])


def training(seeds: list[int], epochs: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for model in ("mlp", "cnn"):
            for level in ("default", "portable"):
                accs = [final_accuracy(model, s, level, epochs, tmp) for s in seeds]
                out[f"{model} {level}"] = {"seeds": seeds, "test_acc": accs, "mean": statistics.mean(accs),
                                           "stdev": statistics.stdev(accs) if len(accs) > 1 else 0.0}
                print(model, level, accs, flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=["layers", "training"])
    parser.add_argument("--steps", type=at_least(1), default=300)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--epochs", type=at_least(1), default=3)
    parser.add_argument("--out", default=str(ROOT / "results" / "portable"))
    args = parser.parse_args(argv)
    date = datetime.date.today().isoformat()
    if args.what == "layers":
        result: dict[str, Any] = {"date": date, "command": " ".join(sys.argv), "steps": args.steps,
                                  "layers": layers(args.steps)}
        text = layers_table(result)
    else:
        result = {"date": date, "command": " ".join(sys.argv), "epochs": args.epochs,
                  "training": training([int(s) for s in args.seeds.split(",")], args.epochs)}
        text = training_table(result)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"accuracy-{args.what}-{date}.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / f"accuracy-{args.what}-{date}.md").write_text(text)
    print(text)
    return 0


def layers_table(result: dict[str, Any]) -> str:
    lines = [f"# Per-layer error against float64 ({result['date']})", "", f"    {result['command']}", "",
             "Relative error ||got - ref|| / ||ref|| of each quantity, fast / portable kernels, float32; the "
             f"models trained {result['steps']} steps on Fashion-MNIST, one batch of 128.", "",
             "| layer | y | dW | db | dx |", "|---|---|---|---|---|"]
    for name, r in result["layers"].items():
        if "loss" in r["fast"]:
            lines.append(f"| {name} | loss {r['fast']['loss']:.1e} / {r['portable']['loss']:.1e} | "
                         f"dlogits {r['fast']['dlogits']:.1e} / {r['portable']['dlogits']:.1e} | | |")
            continue
        cells = [f"{r['fast'][q]:.1e} / {r['portable'][q]:.1e}" for q in QUANTITIES]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def training_table(result: dict[str, Any]) -> str:
    lines = [f"# Final test accuracy, default against --reproducible portable ({result['date']})", "",
             f"    {result['command']}", "",
             f"`mpiexec -n 2 python -m mpisgd.train --epochs {result['epochs']} --seed S [--model cnn] "
             "[--reproducible portable]`, Fashion-MNIST.", "", "| model, level | seeds | test accuracy | mean ± sd |",
             "|---|---|---|---|"]
    for name, r in result["training"].items():
        accs = ", ".join(f"{a:.4f}" for a in r["test_acc"])
        lines.append(f"| {name} | {','.join(map(str, r['seeds']))} | {accs} | {r['mean']:.4f} ± {r['stdev']:.4f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())

"""mpisgd's GPT against its PyTorch twin on the King James Bible: the same architecture, initial parameters,
data order and recipe, trained side by side; the plot and the numbers of docs/gpt.md.

    python experiments/gpt_quality.py run --out results/gpt [training options, e.g. --limit-train 8000 --epochs 4]
    python experiments/gpt_quality.py plot --out results/gpt

``run`` starts ``python -m mpisgd.train --model gpt`` and ``benchmarks/gpt_torch.py train`` at once, one
thread each, with the same options (and --data, the Bible by default), and writes their metrics files
(mpisgd.jsonl, torch.jsonl), mpisgd's model (gpt-kjv.npz) and logs into --out. ``plot`` draws both
training losses (per step, a running mean over 25 steps) and validation losses (per epoch) on one
figure (docs/gpt-vs-torch.png), writes the epoch and test records of both into summary.json and prints
the final validation and test losses and how far apart they are.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
KJV = "/usr/local/share/mpisgd/kjv.txt"


def run(out: Path, options: list[str]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    if "--data" not in options:
        options = ["--data", KJV, *options]
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    ours = [sys.executable, "-m", "mpisgd.train", "--model", "gpt", *options, "--progress", "off",
            "--metrics-file", str(out / "mpisgd.jsonl"), "--save-model", str(out / "gpt-kjv.npz")]
    twin = [sys.executable, str(ROOT / "benchmarks" / "gpt_torch.py"), "train", *options,
            "--metrics-file", str(out / "torch.jsonl")]
    with open(out / "mpisgd.log", "w") as a, open(out / "torch.log", "w") as b:
        procs = [subprocess.Popen(ours, stdout=a, stderr=subprocess.STDOUT, env=env, cwd=ROOT),
                 subprocess.Popen(twin, stdout=b, stderr=subprocess.STDOUT, env=env, cwd=ROOT)]
        codes = [p.wait() for p in procs]
    if any(codes):
        sys.exit(f"a training failed (exit codes {codes}): see {out}/mpisgd.log and {out}/torch.log")


def records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def running_mean(values: list[float], n: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - n] if i >= n else 0.0)
        out.append(total / min(i + 1, n))
    return out


def plot(out: Path, figure: Path) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    runs = {"mpisgd": records(out / "mpisgd.jsonl"), "PyTorch": records(out / "torch.jsonl")}
    fig, (ax, diff) = plt.subplots(2, 1, figsize=(7, 5.6), sharex=True, gridspec_kw={"height_ratios": [3, 1.3]})
    summary: dict[str, Any] = {}
    smooth: dict[str, dict[int, float]] = {}
    val: dict[str, dict[int, float]] = {}
    style = {"mpisgd": ("tab:blue", "-", 2.4), "PyTorch": ("tab:orange", "--", 1.2)}  # PyTorch on top, dashed
    for name, recs in runs.items():
        color, dash, width = style[name]
        steps = [r for r in recs if r["kind"] == "step"]
        epochs = [r for r in recs if r["kind"] == "epoch"]
        smooth[name] = dict(zip([r["step"] for r in steps], running_mean([r["loss"] for r in steps], 25), strict=True))
        val[name] = {r["step"]: r["val_loss"] for r in epochs}
        ax.plot(list(smooth[name]), list(smooth[name].values()), dash, color=color, lw=width,
                label=f"{name}: training loss (running mean of 25 steps)")
        ax.plot(list(val[name]), list(val[name].values()), "o", color=color, ms=8 if name == "mpisgd" else 4,
                label=f"{name}: validation loss (each epoch)")
        keep = ("epoch", "step", "train_loss", "val_loss", "val_acc", "val_bits_per_token", "tokens_per_s",
                "epoch_time_s", "test_loss", "test_acc", "test_bits_per_token")
        summary[name] = [{k: r[k] for k in keep if k in r} for r in recs if r["kind"] in ("epoch", "test")]
    both = sorted(set(smooth["mpisgd"]) & set(smooth["PyTorch"]))
    diff.plot(both, [100 * (smooth["mpisgd"][t] / smooth["PyTorch"][t] - 1) for t in both], color="tab:green", lw=1,
              label="training loss (running means)")
    at = sorted(set(val["mpisgd"]) & set(val["PyTorch"]))
    diff.plot(at, [100 * (val["mpisgd"][t] / val["PyTorch"][t] - 1) for t in at], "o", color="tab:red",
              label="validation loss")
    diff.axhline(0, color="gray", lw=0.8)
    diff.set_ylabel("mpisgd / PyTorch - 1, %", fontsize=8)
    diff.set_xlabel("optimizer step")
    diff.legend(fontsize=7)
    diff.grid(alpha=0.3)
    ax.set_ylabel("cross-entropy, nats per character")
    ax.set_ylim(1.0, 3.5)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("GPT (4 x 128, context 64) on the King James Bible: mpisgd and its PyTorch twin", fontsize=9)
    fig.tight_layout()
    fig.savefig(figure, dpi=110)
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    last = {name: [r for r in recs if r["kind"] == "epoch"][-1] for name, recs in runs.items()}
    test = {name: [r for r in recs if r["kind"] == "test"][-1] for name, recs in runs.items()}
    a, b = last["mpisgd"]["val_loss"], last["PyTorch"]["val_loss"]
    print(f"final validation loss: mpisgd {a:.4f}, PyTorch {b:.4f} nats/char: mpisgd is {100 * (a / b - 1):+.2f} %")
    a, b = test["mpisgd"]["test_loss"], test["PyTorch"]["test_loss"]
    print(f"test loss: mpisgd {a:.4f}, PyTorch {b:.4f} nats/char: {100 * (a / b - 1):+.2f} %")
    print(f"wrote {figure} and {out / 'summary.json'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=("run", "plot"))
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "gpt")
    parser.add_argument("--figure", type=Path, default=ROOT / "docs" / "gpt-vs-torch.png")
    args, rest = parser.parse_known_args()
    if args.mode == "run":
        run(args.out, rest)
    else:
        plot(args.out, args.figure)


if __name__ == "__main__":
    main()

"""PyTorch models side by side: DistributedDataParallel (gloo) against mpisgd, at k ranks, one thread each.

    python benchmarks/torch_vs_ddp.py [--models mlp,resnet,gpt] [--k 2] [--repeats 5] [--json PATH]

For each model, launches interleaved within each repeat (the order rotated by one each repeat, so that
machine noise and drift hit every side alike):

- `ddp`: `benchmarks/baselines.py torch-ddp`, a plain DDP loop (torch SGD, momentum 0.9);
- `wrap`: `benchmarks/baselines.py torch-mpisgd`, the same loop with `mpisgd.torch.wrap` in place of DDP;
- `cli`: `python -m mpisgd.train --model examples.torch_models:NAME` (its defaults, overlap on unless
  `--cli-no-overlap`; samples/s of the second of two epochs), the same model and batch.

Models (examples/torch_models.py): `mlp` 784-1024-1024-10 (the reference W1 of docs/benchmarks.md), b =
128 per rank; `resnet`, the small ResNet with BatchNorm and Dropout, b = 32; `gpt`, the decoder over image
rows, b = 64. Each launch trains on --limit samples of Fashion-MNIST (one timed epoch after a warm-up). The
table gives each side's median samples/s and the paired ratios to DDP within each repeat: median, range,
and a 95 % bootstrap interval of the median. Each launch records how many cores other processes kept busy
meanwhile (from /proc/stat); the machine's load average is printed with the table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_throughput import ENV, ROOT, launch_measured, median_ci, mpiexec  # noqa: E402

from mpisgd.config import at_least  # noqa: E402

BATCH = {"mlp": 128, "resnet": 32, "gpt": 64}
LIMIT = {"mlp": 16384, "resnet": 2048, "gpt": 4096}  # samples per epoch: a timed epoch of tens of steps at k = 2
SIDES = ("ddp", "wrap", "cli")


def baseline(impl: str, model: str, k: int, limit: int) -> dict:
    cmd = mpiexec(k) + [str(ROOT / "benchmarks" / "baselines.py"), impl, "--model", model, "--threads", "1",
                        "--batch-size", str(BATCH[model]), "--limit", str(limit), "--warmup-steps", "10"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=1800)
    if r.returncode:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def cli(model: str, k: int, limit: int, tmp: str, overlap: bool) -> dict:
    metrics = os.path.join(tmp, "cli.jsonl")
    if os.path.exists(metrics):
        os.unlink(metrics)
    cmd = mpiexec(k) + ["-m", "mpisgd.train", "--model", f"examples.torch_models:{model}", "--epochs", "2",
                        "--batch-size", str(BATCH[model]), "--limit-train", str(limit), "--limit-test", "500",
                        "--progress", "off", "--metrics-file", metrics, *([] if overlap else ["--no-overlap"])]
    r = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=1800, cwd=ROOT)
    if r.returncode:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{r.stderr[-2000:]}")
    last = [json.loads(line) for line in open(metrics) if '"kind":"epoch"' in line][-1]
    return {"impl": "mpisgd.train", "k": k, "samples_per_s": last["samples_per_s"], "step_ms": last["step_ms"]}


def loadavg() -> str:
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "?"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="mlp,resnet,gpt")
    p.add_argument("--k", type=at_least(1), default=2)
    p.add_argument("--repeats", type=at_least(1), default=5)
    p.add_argument("--cli-no-overlap", action="store_true", help="the CLI with --no-overlap (as measured before "
                   "2026-12-04, when overlap was not yet safe for every module)")
    p.add_argument("--limit", type=at_least(0), default=0, help="samples per epoch (0: the model's default)")
    p.add_argument("--json", default=None, help="write every launch here")
    args = p.parse_args()
    models = args.models.split(",")
    runs: list[dict] = []
    print(f"# load average before: {loadavg()}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            for model in models:
                limit = args.limit or LIMIT[model]
                order = SIDES[rep % 3:] + SIDES[:rep % 3]
                for side in order:
                    if side == "cli":
                        res, others = launch_measured(lambda m=model, n=limit, o=not args.cli_no_overlap:
                                                      cli(m, args.k, n, tmp, o))
                    else:
                        impl = "torch-ddp" if side == "ddp" else "torch-mpisgd"
                        res, others = launch_measured(lambda i=impl, m=model, n=limit: baseline(i, m, args.k, n))
                    assert res is not None
                    runs.append({"repeat": rep, "model": model, "side": side, "samples_per_s": res["samples_per_s"],
                                 "others_cores": others, "load": loadavg()})
                    print(f"# repeat {rep} {model:6s} {side:4s} {res['samples_per_s']:9.0f} samples/s "
                          f"(other processes: {others:.2f} cores; load {loadavg()})", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(runs, indent=1))
    print(f"\nk = {args.k}, one thread per rank; CLI {'--no-overlap' if args.cli_no_overlap else 'with overlap'}; "
          f"load average after: {loadavg()}\n")
    print("| model | b | DDP samples/s | wrap samples/s | CLI samples/s | wrap / DDP (median, range [95 % CI]) "
          "| CLI / DDP |")
    print("|---|---|---|---|---|---|---|")
    for model in models:
        by = {side: {r["repeat"]: r["samples_per_s"] for r in runs if r["model"] == model and r["side"] == side}
              for side in SIDES}
        cells = [f"{statistics.median(by[s].values()):,.0f}" for s in SIDES]
        ratios = []
        for side in ("wrap", "cli"):
            rs = [by[side][i] / by["ddp"][i] for i in by["ddp"]]
            lo, hi = median_ci(rs)
            ratios.append(f"{statistics.median(rs):.2f}× ({min(rs):.2f}–{max(rs):.2f}) [{lo:.2f}, {hi:.2f}]")
        print(f"| {model} | {BATCH[model]} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")


if __name__ == "__main__":
    main()

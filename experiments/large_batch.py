"""Test error against effective batch size for learning-rate recipes (Goyal et al. 2017, Fig. 1), LARS and LAMB.

The experiment behind docs/large_batch.md; its runs are in results/large_batch/.

Every point is one real training run, ``mpiexec -n K python -m mpisgd.train ...
--metrics-file``, run sequentially. For each effective batch B = k*b*m
(k ranks, per-rank micro-batch b <= --max-micro, m accumulation steps):

  none           SGD, eta = eta0 for every B (no scaling), no warmup
  linear         SGD, eta = (B/B0)*eta0, no warmup
  linear+warmup  SGD, eta = (B/B0)*eta0, reached by per-iteration linear warmup from eta0
                 over --warmup-epochs (the same number of epochs for every B)
  lars+warmup    LARS (--optimizer lars, --trust-coef), its own base rate --lars-lr scaled by
                 --lars-scaling, with the same warmup
  lamb+warmup    LAMB (--optimizer lamb: Adam's update with the layer-wise trust ratio), its own base
                 rate --lamb-lr scaled by --lamb-scaling, with the same warmup

Everything else is the same for every point (model, epochs, momentum, weight
decay, cosine decay, seed): nothing is tuned per point. A run that stops on a
non-finite gradient is recorded as diverged, its error counted at chance (90 %).
Runs that vary a setting at one B (LARS's rate or trust coefficient, the warmup
length) go to their own --out directory, so that each table has one setting per recipe.

Output in --out: large_batch.json (every run: command, per-epoch test accuracy,
wall time), large_batch.md and large_batch.csv (the table) and large_batch.png
(test error against B, log2 axis, one line per recipe). Points already in the
JSON with the same command are not rerun (delete the file or pass --force).

    python experiments/large_batch.py                       # the full sweep (~30-45 min on 2 cores)
    python experiments/large_batch.py --quick               # smoke run: synthetic data, tiny budget
    python experiments/large_batch.py --report-only         # rewrite table and plot from the JSON
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RECIPES = {  # name -> train flags; the only thing that differs between the lines of the plot
    "none": ["--lr-scaling", "none"],
    "linear": ["--lr-scaling", "linear"],
    "linear+warmup": ["--lr-scaling", "linear"],  # + --warmup-epochs, added in point_command
    "lars+warmup": ["--optimizer", "lars"],  # + its scaling, trust coefficient and rate, from the --lars-* flags
    "lamb+warmup": ["--optimizer", "lamb"],  # + its scaling and rate, from the --lamb-* flags
}
CHANCE_ERROR = 0.9  # 10 classes
# the LARS recipe, chosen by the grid at one large B in docs/large_batch.md ("LARS"), then fixed for every B
LARS_LR, LARS_SCALING, TRUST_COEF = 0.014142, "sqrt", 0.1
# the LAMB recipe, chosen by the grid at B = 2048 ... 8192 in docs/large_batch.md ("LAMB")
LAMB_LR, LAMB_SCALING = 0.0070711, "sqrt"


def split_batch(batch: int, ranks: int, max_micro: int) -> tuple[int, int]:
    """Per-rank micro-batch b and accumulation steps m with k*b*m = B and b <= max_micro."""
    if batch % ranks:
        raise ValueError(f"batch {batch} is not a multiple of {ranks} ranks")
    per_rank = batch // ranks
    b = min(per_rank, max_micro)
    while per_rank % b:
        b -= 1
    return b, per_rank // b


def point_command(batch: int, recipe: str, args: argparse.Namespace, metrics: str) -> list[str]:
    """The train flags of one point (without the mpiexec prefix)."""
    b, m = split_batch(batch, args.ranks, args.max_micro)
    warmup = args.warmup_epochs if recipe.endswith("+warmup") else 0
    lars, lamb = recipe.startswith("lars"), recipe.startswith("lamb")
    flags = RECIPES[recipe] + (["--lr-scaling", args.lars_scaling, "--trust-coef", str(args.trust_coef)] if lars
                               else ["--lr-scaling", args.lamb_scaling] if lamb else [])
    lr = args.lars_lr if lars else args.lamb_lr if lamb else args.lr
    return ["-m", "mpisgd.train", *args.train_args, *flags,
            "--lr", str(lr), "--base-batch", str(args.base_batch),
            "--batch-size", str(b), "--accum-steps", str(m), "--epochs", str(args.epochs),
            "--warmup-epochs", str(warmup), "--progress", "off", "--metrics-file", metrics]


def mpiexec() -> list[str]:
    exe = shutil.which("mpiexec")
    if exe is None:
        sys.exit("large_batch: no mpiexec on PATH")
    version = subprocess.run([exe, "--version"], capture_output=True, text=True).stdout
    return [exe, "--oversubscribe"] if "Open MPI" in version else [exe]


def run_point(batch: int, recipe: str, args: argparse.Namespace) -> dict[str, Any]:
    """Run one training job; return its record (raises on anything but success or divergence)."""
    with tempfile.TemporaryDirectory(prefix="mpisgd_lb_") as tmp:
        metrics = os.path.join(tmp, "metrics.jsonl")
        cmd = point_command(batch, recipe, args, metrics)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
               "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        t0 = time.perf_counter()
        proc = subprocess.run([*mpiexec(), "-n", str(args.ranks), sys.executable, *cmd], capture_output=True,
                              text=True, timeout=args.timeout, env=env, cwd=ROOT)
        wall = time.perf_counter() - t0
        epochs: list[dict[str, Any]] = []
        if os.path.exists(metrics):
            with open(metrics) as f:
                epochs = [r for r in map(json.loads, filter(str.strip, f)) if r.get("kind") == "epoch"]
    diverged = proc.returncode == 1 and "non-finite" in proc.stderr
    if proc.returncode != 0 and not diverged:
        raise RuntimeError(f"point B={batch} {recipe} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    match = re.search(r"non-finite gradient at step (\d+)", proc.stderr)
    b, m = split_batch(batch, args.ranks, args.max_micro)
    lr_line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("lr:")), "")
    return {
        "batch": batch, "recipe": recipe, "ranks": args.ranks, "micro_batch": b, "accum_steps": m,
        "command": "mpiexec -n {} python {}".format(args.ranks, " ".join(cmd[:-2])),
        "lr_banner": lr_line, "epochs_budget": args.epochs, "epochs_done": len(epochs),
        "test_acc": [r["test_acc"] for r in epochs], "train_loss": [r["train_loss"] for r in epochs],
        "steps": epochs[-1]["step"] if epochs else 0,
        "diverged": diverged, "diverged_at_step": int(match.group(1)) if match else None,
        "wall_s": round(wall, 2),
    }


def settings(rec: dict[str, Any]) -> dict[str, str]:
    """The recipe's settings, read back from the run's command: scaling, eta0, trust coefficient, warmup, seed."""
    words = rec["command"].split()

    def flag(name: str, default: str) -> str:
        return words[len(words) - 1 - words[::-1].index(name) + 1] if name in words else default

    return {"scaling": flag("--lr-scaling", "linear"), "eta0": flag("--lr", "0.1"),
            "c": flag("--trust-coef", "-") if "lars" in words else "-", "warmup_ep": flag("--warmup-epochs", "0"),
            "seed": flag("--seed", "0")}


def summarize(rec: dict[str, Any]) -> dict[str, Any]:
    """Final and best test error of a run (chance for a diverged run or one with no epoch)."""
    errors = [1.0 - a for a in rec["test_acc"]]
    final = CHANCE_ERROR if rec["diverged"] or not errors else errors[-1]
    best = min(errors) if errors else CHANCE_ERROR
    return {"final_error": final, "best_error": best if not rec["diverged"] else min(best, CHANCE_ERROR)}


def write_report(records: list[dict[str, Any]], out: Path, title: str) -> None:
    """large_batch.md/.csv (the table) and large_batch.png (error against B) from the run records."""
    out.mkdir(parents=True, exist_ok=True)
    order = {r: i for i, r in enumerate(RECIPES)}
    records = sorted(records, key=lambda r: (r["batch"], order.get(r["recipe"], 99)))
    rows = []
    for r in records:
        s = summarize(r)
        status = f"diverged at step {r['diverged_at_step']}" if r["diverged"] else "ok"
        rows.append({"B": r["batch"], "recipe": r["recipe"], **settings(r),
                     "k x b x m": f"{r['ranks']}x{r['micro_batch']}x"
                     f"{r['accum_steps']}", "final_error_pct": round(100 * s["final_error"], 2),
                     "best_error_pct": round(100 * s["best_error"], 2),
                     "epochs": f"{r['epochs_done']}/{r['epochs_budget']}",
                     "steps": r["diverged_at_step"] if r["diverged"] else r["steps"],
                     "wall_s": round(r["wall_s"], 1), "status": status})
    if not rows:
        return
    with open(out / "large_batch.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    head = list(rows[0])
    lines = [f"<!-- {title} -->", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(str(row[h]) for h in head) + " |" for row in rows]
    (out / "large_batch.md").write_text("\n".join(lines) + "\n")
    if len({r["batch"] for r in records}) < 2:  # a grid at one B: nothing to draw against B
        return
    from mpisgd.app.plot import plot_error_vs_batch

    seen: dict[str, dict[str, set[str]]] = {}  # recipe -> setting -> its values: one line per variant
    for r in records:
        for key, value in settings(r).items():
            seen.setdefault(r["recipe"], {}).setdefault(key, set()).add(value)
    series: dict[str, list[tuple[int, float, bool]]] = {}
    for r in records:
        varied = [f"{k}={v}" for k, v in settings(r).items() if len(seen[r["recipe"]][k]) > 1]
        series.setdefault(" ".join([r["recipe"], *varied]), []).append(
            (r["batch"], summarize(r)["final_error"], r["diverged"]))
    plot_error_vs_batch(series, str(out / "large_batch.png"), title=title)


def load_records(path: Path) -> list[dict[str, Any]]:
    return json.loads(path.read_text())["runs"] if path.exists() else []


def save_records(path: Path, records: list[dict[str, Any]], meta: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"meta": meta, "runs": records}, indent=1))
    os.replace(tmp, path)  # a crash mid-sweep keeps every finished point


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default=None,
                   help="effective batch sizes B, comma-separated (default 64,...,16384; --quick: 64,256,1024)")
    p.add_argument("--recipes", default=",".join(RECIPES), help="subset of " + ", ".join(RECIPES))
    p.add_argument("--epochs", type=int, default=5, help="epoch budget of every run")
    p.add_argument("--warmup-epochs", type=float, default=1.0, help="warmup of the +warmup recipes")
    p.add_argument("--lr", type=float, default=0.1, help="eta0 of the SGD recipes")
    p.add_argument("--lars-lr", type=float, default=LARS_LR, help="eta0 of the LARS recipe (docs/large_batch.md)")
    p.add_argument("--lars-scaling", default=LARS_SCALING, choices=("linear", "sqrt", "none"),
                   help="how the LARS recipe's rate follows B")
    p.add_argument("--trust-coef", type=float, default=TRUST_COEF, help="the LARS recipe's trust coefficient")
    p.add_argument("--lamb-lr", type=float, default=LAMB_LR, help="eta0 of the LAMB recipe (docs/large_batch.md)")
    p.add_argument("--lamb-scaling", default=LAMB_SCALING, choices=("linear", "sqrt", "none"),
                   help="how the LAMB recipe's rate follows B")
    p.add_argument("--base-batch", type=int, default=256, help="B0 that eta0 belongs to")
    p.add_argument("--ranks", type=int, default=2, help="MPI ranks k")
    p.add_argument("--max-micro", type=int, default=512, help="largest per-rank micro-batch b")
    p.add_argument("--train", default="--hidden 1024,1024 --weight-decay 1e-4 --momentum 0.9 --decay cosine",
                   help="further train flags, shared by every point")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per point before it is killed")
    p.add_argument("--out", default=str(ROOT / "results" / "large_batch"), help="output directory")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: synthetic data, B in 64..1024, 1 epoch, small model; writes to results/tmp")
    p.add_argument("--force", action="store_true", help="rerun points already in the JSON")
    p.add_argument("--report-only", action="store_true", help="only rewrite table and plot from the JSON")
    args = p.parse_args(argv)
    if args.quick:
        args.batches = args.batches or "64,256,1024"
        args.epochs, args.warmup_epochs = 2, 1.0
        args.train = "--dataset synthetic --synthetic-samples 4096 --hidden 32 --limit-test 500"
        if args.out == p.get_default("out"):
            args.out = str(ROOT / "results" / "tmp" / "large_batch_quick")
    args.batches = args.batches or ",".join(str(2**i) for i in range(6, 15))
    args.batch_list = [int(x) for x in args.batches.split(",")]
    args.recipe_list = args.recipes.split(",")
    bad = [r for r in args.recipe_list if r not in RECIPES]
    if bad:
        p.error(f"unknown recipe(s) {bad}: use {', '.join(RECIPES)}")
    if any(b < 1 or b & (b - 1) for b in args.batch_list):
        p.error("batch sizes must be powers of 2")
    args.train_args = args.train.split()
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    path = out / "large_batch.json"
    # what every row shares; each row's recipe settings are columns of the table (an out directory may
    # hold runs of several invocations)
    title = (f"Fashion-MNIST MLP, {args.epochs} epochs, k={args.ranks}, B0={args.base_batch}" if not args.quick
             else "quick smoke run")
    records = load_records(path)
    before = json.loads(path.read_text())["meta"] if path.exists() else None  # earlier invocations' argv and time
    earlier = [] if before is None else before.pop("earlier", []) + [before]
    meta = {"title": title, "argv": sys.argv[1:] if argv is None else argv, "host_cores": os.cpu_count(),
            "earlier": earlier}
    if not args.report_only:
        t_sweep = time.perf_counter()
        for batch in args.batch_list:
            for recipe in args.recipe_list:
                cmd = "mpiexec -n {} python {}".format(args.ranks, " ".join(point_command(batch, recipe, args,
                                                                                         "X")[:-2]))
                done = [r for r in records if r["command"] == cmd]
                if done and not args.force:
                    print(f"B={batch:>6} {recipe:<14} already in {path.name}, skipped", flush=True)
                    continue
                records = [r for r in records if r["command"] != cmd]
                rec = run_point(batch, recipe, args)
                records.append(rec)
                save_records(path, records, meta)
                s = summarize(rec)
                print(f"B={batch:>6} {recipe:<14} final error {100 * s['final_error']:5.2f}%  best "
                      f"{100 * s['best_error']:5.2f}%  {'DIVERGED ' if rec['diverged'] else ''}"
                      f"{rec['wall_s']:.0f}s", flush=True)
        meta["sweep_wall_s"] = round(time.perf_counter() - t_sweep, 1)
        save_records(path, records, meta)
    write_report(records, out, title)
    print(f"wrote {out}/large_batch.{{json,md,csv,png}}")
    return 0 if records and not math.isnan(sum(summarize(r)["final_error"] for r in records)) else 1


if __name__ == "__main__":
    sys.exit(main())

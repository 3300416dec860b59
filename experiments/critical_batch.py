"""Steps and samples to a fixed training loss against the batch size: McCandlish et al.'s S-E trade-off and
the critical batch, beside the gradient noise scale measured in the same runs. Feeds docs/large_batch.md
("The critical batch size").

For every effective batch B (default 64, 128, ..., 8192) and a small grid of learning rates, one training
run from the same initialisation goes until the training loss reaches each target in --targets. The loss
is that of a fixed subset of the training set (--eval-samples images drawn once with a fixed seed),
evaluated with the current parameters every --eval-every samples, the same way at every B; the steps S
and samples E at which it first reaches a target are interpolated between evaluations (linear in
log loss). At each B the best rate (fewest steps) counts, as in McCandlish et al. 2018 (*An Empirical
Model of Large-Batch Training*, section 2). The trade-off (S/S_min - 1)(E/E_min - 1) = 1, i.e.
S(B) = S_min + E_min/B, is fitted per target (least squares in log S), and B_crit = E_min/S_min.

The recipe at each B is docs/large_batch.md's: SGD with linear scaling from (eta0 = 0.1, B0 = 256) and a
per-iteration warmup of --warmup-epochs up to --lars-from, LARS (c = 0.1, sqrt scaling from
eta0 = 0.014142, no warmup: its warmup table) from there on, both at the B's in --both; the grid
multiplies eta0 by --mults and is extended by --extend factors of 2 while the best rate is at its edge.
The rate is constant after warmup (--decay none): a decay would tie S to a planned budget. Momentum 0.9,
weight decay 1e-4, seed 0: the same initial parameters and sample order at every point.

The noise scale (McCandlish et al., Appendix A) comes from the same steps: each run is one rank (k = 1,
the number of ranks changes neither S nor E) accumulating m >= 2 micro-batches of b = min(B/2, 512), and
the micro-batch gradients (b samples) are the small batch, their mean (B) the big one:
    |G|^2 ~ (B|G_B|^2 - b|G_b|^2)/(B - b),   tr(Sigma) ~ (|G_b|^2 - |G_B|^2)/(1/b - 1/B),
both averaged separately over the last fifth of the steps before a target was reached (at least one
evaluation interval), B_simple = their ratio: this script's own estimate. (Each run stores exponential
averages of the two at every evaluation, --noise-tau samples long, from which the interval means are
recovered exactly; the averages themselves carry the first steps' huge |G|^2 far too long to be used.)
Beside it, real `mpiexec -n 2 python -m mpisgd.train` runs at the B of --trainer-batches (the sweep's best
rate there, --trainer-epochs long) give the trainer's own `noise_scale` at each target (--noise-metrics
reads it from other metrics files).

The step is the CLI's at k = 1 (each run's record holds the equivalent `mpisgd.train` command): the same
model, SGD/LARS, Schedule and sample order; gradients are accumulated in the same order. Each (B,
optimizer, rate) run is kept in --out/runs/ as it finishes, so an interrupted sweep continues where it
stopped; --report-only redoes the fit, the tables and the plot from those files.

    nice -n 15 python experiments/critical_batch.py --jobs 2     # the sweep (resumable)
    python experiments/critical_batch.py --report-only           # fit, tables, plot from results/critical_batch
    python experiments/critical_batch.py --quick                 # smoke run: synthetic data, seconds
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

import numpy as np  # noqa: E402

from mpisgd.config import at_least  # noqa: E402
from mpisgd.data import BatchLoader, Dataset, epoch_permutation, load_fashion_mnist, synthetic  # noqa: E402
from mpisgd.nn import SoftmaxCrossEntropy, scoring  # noqa: E402
from mpisgd.nn.models import cnn, mlp  # noqa: E402
from mpisgd.optim import SGD  # noqa: E402
from mpisgd.optim.lars import LARS  # noqa: E402
from mpisgd.schedule import Schedule, scaled_lr  # noqa: E402

# the two recipes of docs/large_batch.md: eta0 for B0 = 256 (--sgd-lr, --lars-lr), its scaling, and (LARS) the
# trust coefficient
RECIPES = {"sgd": {"eta0": 0.1, "scaling": "linear"},
           "lars": {"eta0": 0.014142, "scaling": "sqrt", "trust_coef": 0.1}}
BASE_BATCH = 256
DIVERGED_LOSS = 10.0  # an evaluated loss above this counts as diverged (chance is ln 10 = 2.30; He init starts at ~2.9)


@dataclass(frozen=True)
class Point:
    """One training run: the effective batch, the optimizer and the multiple of its recipe's eta0."""

    batch: int
    optimizer: str
    mult: float

    @property
    def key(self) -> str:
        return f"B{self.batch:05d}-{self.optimizer}-x{self.mult:g}"


def split_batch(batch: int, max_micro: int) -> tuple[int, int]:
    """Micro-batch b and accumulation steps m at k = 1: b = min(B/2, max_micro), so that m >= 2 micro-batches
    give the noise scale its small batch."""
    if batch < 2 or batch & (batch - 1):
        raise ValueError(f"B must be a power of 2 >= 2, got {batch}")
    b = min(batch // 2, max_micro)
    return b, batch // b


def point_settings(p: Point, args: argparse.Namespace) -> dict[str, Any]:
    """Everything that decides a run's trajectory (compared when a sweep resumes)."""
    rec = RECIPES[p.optimizer]
    b, m = split_batch(p.batch, args.max_micro)
    eta0 = round((args.sgd_lr if p.optimizer == "sgd" else args.lars_lr) * p.mult, 8)
    warmup = args.warmup_epochs if p.optimizer == "sgd" else args.lars_warmup_epochs
    return {"batch": p.batch, "optimizer": p.optimizer, "mult": p.mult, "eta0": eta0, "scaling": rec["scaling"],
            "peak_lr": scaled_lr(eta0, BASE_BATCH, p.batch, rec["scaling"]), "trust_coef": rec.get("trust_coef"),
            "warmup_epochs": warmup, "micro_batch": b, "accum_steps": m, **shared_settings(args)}


def shared_settings(args: argparse.Namespace) -> dict[str, Any]:
    return {"model": args.model, "hidden": args.hidden, "momentum": args.momentum, "weight_decay": args.weight_decay,
            "seed": args.seed, "dataset": "synthetic" if args.quick else "fashion-mnist",
            "train_samples": args.train_samples, "eval_samples": args.eval_samples, "eval_every": args.eval_every,
            "targets": args.target_list, "max_epochs": args.max_epochs, "noise_tau": args.noise_tau}


def train_command(s: dict[str, Any]) -> str:
    """The CLI run whose steps these are (at k = 1; the experiment stops it at the targets instead)."""
    return "python -m mpisgd.train " + " ".join(train_flags(s))


def train_flags(s: dict[str, Any], ranks: int = 1) -> list[str]:
    """mpisgd.train's options for these settings on ``ranks`` ranks (the same B: b*m = B/ranks)."""
    b = min(s["micro_batch"], s["batch"] // ranks)
    m = s["batch"] // (ranks * b)
    flags = ["--model", s["model"]] + (["--hidden", s["hidden"]] if s["model"] == "mlp" else [])
    flags += ["--momentum", f"{s['momentum']:g}", "--weight-decay", f"{s['weight_decay']:g}", "--decay", "none",
              "--lr", f"{s['eta0']:g}", "--base-batch", str(BASE_BATCH), "--lr-scaling", s["scaling"],
              "--warmup-epochs", f"{s['warmup_epochs']:g}", "--batch-size", str(b), "--accum-steps", str(m),
              "--seed", str(s["seed"])]
    if s["optimizer"] == "lars":
        flags += ["--optimizer", "lars", "--trust-coef", f"{s['trust_coef']:g}"]
    if s["dataset"] == "synthetic":
        flags += ["--dataset", "synthetic", "--synthetic-samples", str(s["train_samples"])]
    elif s["train_samples"] < 60000:
        flags += ["--limit-train", str(s["train_samples"])]
    return flags


# -- one run ---------------------------------------------------------------------------------------
class Data:
    """The training set, the fixed evaluation subset of it and the test set, as batch loaders."""

    def __init__(self, train: Dataset, test: Dataset, eval_samples: int, seed: int) -> None:
        self.train, self.test = train, test
        self.loader = BatchLoader(train, np, "float32")
        self.eval_idx = np.sort(np.random.default_rng([seed, 12345]).permutation(len(train))[:eval_samples])
        self.eval_x, self.eval_y = BatchLoader(train, np, "float32").batch(self.eval_idx)
        self.eval_x, self.eval_y = self.eval_x.copy(), self.eval_y.copy()
        self.test_x, self.test_y = (a.copy() for a in BatchLoader(test, np, "float32").batch(np.arange(len(test))))


def evaluate(model: Any, x: np.ndarray, y: np.ndarray, chunk: int = 1000) -> tuple[float, float]:
    """Mean loss and error of the current parameters on (x, y)."""
    t = scoring.score(model, ((x[i:i + chunk], y[i:i + chunk]) for i in range(0, len(y), chunk)))
    return t.mean_loss, 1.0 - t.accuracy


def build(s: dict[str, Any], in_shape: tuple[int, ...]) -> tuple[Any, SGD]:
    if s["model"] == "cnn":
        model = cnn(10, in_shape)
    else:
        model = mlp(tuple(int(h) for h in s["hidden"].split(",")), n_in=int(np.prod(in_shape)))
    model = model.materialize(np, "float32", seed=s["seed"])
    if s["optimizer"] == "lars":
        return model, LARS(model.flat, s["momentum"], weight_decay=s["weight_decay"], trust_coef=s["trust_coef"])
    return model, SGD(model.flat, s["momentum"], weight_decay=s["weight_decay"])


def run_point(s: dict[str, Any], data: Data, best_steps: float | None, prune: float,
              verbose: bool = False) -> dict[str, Any]:
    """Train one point until the lowest target, divergence, the epoch budget, or (with ``best_steps``, the
    fewest steps another rate at this B needed for the lowest target) ``prune`` times that many steps."""
    B, b, m = s["batch"], s["micro_batch"], s["accum_steps"]
    n = s["train_samples"]
    spe = n // B
    budget = s["max_epochs"] * spe
    model, opt = build(s, data.train.images.shape[1:])
    sched = Schedule(base_lr=s["eta0"], peak_lr=s["peak_lr"], warmup_steps=round(s["warmup_epochs"] * spe),
                     total_steps=budget, decay="none")
    loss_fn = SoftmaxCrossEntropy()
    flat = model.flat
    acc = np.empty_like(flat.grads)
    targets = sorted(s["targets"], reverse=True)
    reached: dict[str, Any] = {}
    every = max(1, math.ceil(s["eval_every"] / B))
    beta = math.exp(-B / s["noise_tau"])  # per-step decay of the noise averages: a time constant in samples
    ema = np.zeros(3)  # |G|^2 estimate, tr(Sigma) estimate, weight (bias correction)
    evals: list[list[float]] = []
    status, t0, c0 = "budget", time.perf_counter(), time.process_time()

    def record(step: int) -> float:
        loss, _ = evaluate(model, data.eval_x, data.eval_y)
        gsq, trs = (ema[:2] / ema[2]) if ema[2] > 0 else (float("nan"), float("nan"))
        evals.append([step, step * B, loss, float(gsq), float(trs)])
        if verbose:
            print(f"  B={B} {s['optimizer']} x{s['mult']:g} step {step} samples {step * B} loss {loss:.4f} "
                  f"B_simple {trs / gsq if gsq > 0 else float('nan'):.0f}", flush=True)
        for tgt in targets:
            if f"{tgt:g}" not in reached and loss <= tgt:  # test error at the first evaluation past the target
                reached[f"{tgt:g}"] = {"eval_step": step, "test_error": evaluate(model, data.test_x, data.test_y)[1]}
        return loss

    record(0)
    step = 0
    while step < budget:
        epoch, pos = divmod(step, spe)
        perm = epoch_permutation(n, s["seed"], epoch)
        small = 0.0
        finite = True
        for i in range(m):
            start = pos * B + i * b
            x, y = data.loader.batch(perm[start:start + b], slot=i)
            logits = model.forward(x)
            loss = float(loss_fn.forward_array(logits, y))
            model.backward(loss_fn.backward(1.0 / (b * m)))  # as DataParallel at k = 1: the sum is the B-mean
            g = flat.grads
            small += float(np.dot(g, g)) * m * m  # |G_b|^2 of this micro-batch (its mean gradient)
            if i == 0:
                acc[...] = g
            else:
                acc += g
            finite = finite and math.isfinite(loss)
        g = flat.grads
        g[...] = acc
        big = float(np.dot(g, g))
        if not (finite and math.isfinite(big)):
            status = "diverged"
            break
        small /= m
        gsq = (B * big - b * small) / (B - b)
        trs = (small - big) / (1.0 / b - 1.0 / B)
        ema[:] = beta * ema + (1 - beta) * np.array([gsq, trs, 1.0])
        opt.step(sched(step))
        step += 1
        if step % every == 0 or step == budget:
            loss = record(step)
            if not math.isfinite(loss) or loss > DIVERGED_LOSS:
                status = "diverged"
                break
            if all(f"{t:g}" in reached for t in targets):
                status = "reached"
                break
            if best_steps is not None and step > prune * best_steps:
                status = "pruned"
                break
    return {"settings": s, "command": train_command(s), "status": status, "steps_done": step,
            "samples_done": step * B, "evals": evals, "reached": reached,
            "wall_s": round(time.perf_counter() - t0, 1), "cpu_s": round(time.process_time() - c0, 1)}


# -- reading runs --------------------------------------------------------------------------------------
def crossing(evals: list[list[float]], target: float) -> tuple[float, int] | None:
    """(steps, index of the evaluation after it) at which the evaluated loss first reaches ``target``, linear
    in log loss between the two evaluations around it; None when it never does."""
    for i, (step, _, loss, *_) in enumerate(evals):
        if loss <= target:
            if i == 0:
                return 0.0, 0
            s0, l0 = evals[i - 1][0], evals[i - 1][2]
            f = (math.log(l0) - math.log(target)) / (math.log(l0) - math.log(loss)) if l0 > loss else 1.0
            return s0 + f * (step - s0), i
    return None


def intervals(rec: dict[str, Any]) -> list[tuple[int, int, float, float, float]]:
    """(first step, last step, loss at its end, mean |G|^2 estimate, mean tr(Sigma) estimate) per evaluation
    interval: the raw estimates' means over its steps, recovered exactly from the exponential averages the
    run stored at each evaluation (U_t = beta*U_(t-1) + (1-beta)*x_t is the average times 1 - beta^t; an
    interval's U_z - beta^n U_a is (1-beta) times its beta-weighted sum, weights within exp(-eval_every/
    noise_tau) of each other). The averages themselves are not used as estimates: the first steps' huge
    |G|^2 stays in them for thousands of steps and drags B_simple down."""
    s = rec["settings"]
    beta = math.exp(-s["batch"] / s["noise_tau"])
    out = []

    def unnorm(e: list[float]) -> np.ndarray:
        if e[0] == 0 or not (math.isfinite(e[3]) and math.isfinite(e[4])):
            return np.zeros(2)
        return np.array([e[3], e[4]]) * (1 - beta ** e[0])

    for a, z in zip(rec["evals"], rec["evals"][1:], strict=False):
        n = int(z[0] - a[0])
        if n < 1 or not (math.isfinite(z[3]) and math.isfinite(z[4])):
            continue
        gsq, trs = (unnorm(z) - beta**n * unnorm(a)) / (1 - beta**n)
        out.append((int(a[0]) + 1, int(z[0]), z[2], float(gsq), float(trs)))
    return out


def noise_at(rec: dict[str, Any], steps: float, window: float = 0.2) -> float:
    """B_simple where the run reached a loss at ``steps``: the |G|^2 and tr(Sigma) estimates averaged
    separately over the steps of the last ``window`` of the run up to the evaluation after ``steps`` (at
    least the interval holding ``steps``), then their ratio, as McCandlish et al. and the trainer do."""
    rows = intervals(rec)
    hold = next((r for r in rows if r[0] - 1 < steps <= r[1]), None)
    if hold is None:
        return float("nan")
    lo = min(hold[0], (1 - window) * steps)
    sel = [r for r in rows if r[0] >= lo and r[1] <= hold[1]]
    n = np.array([r[1] - r[0] + 1 for r in sel], float)
    gsq = float(np.dot(n, [r[3] for r in sel]))
    trs = float(np.dot(n, [r[4] for r in sel]))
    return trs / gsq if gsq > 0 else float("nan")


def steps_to(rec: dict[str, Any], target: float) -> float | None:
    c = crossing(rec["evals"], target)
    return None if c is None else c[0]


def best_per_batch(runs: list[dict[str, Any]], target: float) -> dict[int, dict[str, Any]]:
    """Per B, the run that reached ``target`` in the fewest steps (any optimizer, any rate)."""
    best: dict[int, dict[str, Any]] = {}
    for rec in runs:
        c = crossing(rec["evals"], target)
        if c is None:
            continue
        B = rec["settings"]["batch"]
        steps = c[0]
        if B not in best or steps < best[B]["steps"]:
            err = rec["reached"].get(f"{target:g}", {}).get("test_error")
            best[B] = {"steps": steps, "samples": steps * B, "run": rec, "test_error": err,
                       "noise_scale": noise_at(rec, steps)}
    return dict(sorted(best.items()))


def fit_tradeoff(batches: list[int], steps: list[float]) -> dict[str, float]:
    """S(B) = S_min (1 + B_crit/B), least squares in log S: for each B_crit on a fine log grid the best S_min
    is closed-form (the mean log residual); the grid point with the least squared error wins (the first of
    equals), the whole grid at once."""
    Bs, S = np.array(batches, float), np.log(np.array(steps, float))
    grid = np.exp(np.linspace(math.log(1.0), math.log(1e7), 4001))
    shape = np.log1p(grid[:, None] / Bs)  # (grid, points)
    log_smin = np.mean(S - shape, axis=1)
    errs = np.sum((S - log_smin[:, None] - shape) ** 2, axis=1)
    i = int(np.argmin(errs))
    err, bc, s_min = float(errs[i]), float(grid[i]), math.exp(float(log_smin[i]))
    return {"B_crit": bc, "S_min": s_min, "E_min": s_min * bc,
            "rms_log_residual": math.sqrt(err / len(Bs)), "points": len(Bs)}


def bootstrap_bcrit(batches: list[int], steps: list[float], n: int = 400, seed: int = 0) -> tuple[float, float]:
    """A 90 % interval for B_crit, resampling the (B, S) points with replacement."""
    rng = np.random.default_rng(seed)
    vals = []
    for _ in range(n):
        idx = rng.integers(0, len(batches), len(batches))
        if len(set(idx.tolist())) < 3:
            continue
        vals.append(fit_tradeoff([batches[i] for i in idx], [steps[i] for i in idx])["B_crit"])
    if not vals:
        return float("nan"), float("nan")
    return float(np.percentile(vals, 5)), float(np.percentile(vals, 95))


def noise_from_metrics(paths: list[str], target: float) -> list[tuple[str, float | None, float | None]]:
    """(file, its epoch-mean train_loss, noise_scale) at the first epoch record whose train_loss <= target:
    the trainer's own estimate (mpisgd.train's `noise_scale` field), where the metrics file has one."""
    out = []
    for path in paths:
        with open(path) as f:
            epochs = [r for r in map(json.loads, filter(str.strip, f)) if r.get("kind") == "epoch"]
        hit = next((r for r in epochs if r.get("train_loss") is not None and r["train_loss"] <= target), None)
        out.append((path, hit and hit["train_loss"], hit and hit.get("noise_scale")))
    return out


def trainer_noise(args: argparse.Namespace, out: Path, run: bool) -> list[dict[str, Any]]:
    """The trainer's own noise scale (mpisgd.train's `noise_scale`, each epoch's estimate from each rank's
    gradient against the averaged one) at each target, from a real `mpiexec -n --trainer-ranks` run at each
    B of --trainer-batches with the sweep's best settings there (fewest steps to the lowest target; the
    recipe at rate multiple 1 before the sweep has any), --trainer-epochs long; interpolated in log noise
    scale against the epoch-mean training loss between the epochs around the target. With ``run``, runs
    the ones whose metrics file is missing or short."""
    found = []
    runs = [r for r in load_runs(out) if r["settings"].get("targets") == args.target_list]
    for B in args.trainer_batch_list:
        best = best_per_batch([r for r in runs if r["settings"]["batch"] == B], min(args.target_list)).get(B)
        if best is not None:
            opt, mult = best["run"]["settings"]["optimizer"], best["run"]["settings"]["mult"]
        else:
            opt, mult = "sgd" if B < args.lars_from else "lars", 1.0
        s = point_settings(Point(B, opt, mult), args)
        path = out / "trainer" / f"{Point(B, opt, mult).key}-k{args.trainer_ranks}.jsonl"
        flags = [*train_flags(s, args.trainer_ranks), "--epochs", str(args.trainer_epochs), "--limit-test", "2000",
                 "--progress", "off", "--threads", str(args.threads)]
        command = f"mpiexec -n {args.trainer_ranks} python -m mpisgd.train " + " ".join(flags)
        epochs = [] if not path.exists() else [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
        if run and len(epochs) < args.trainer_epochs:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.unlink(missing_ok=True)
            import shutil  # noqa: PLC0415 - only here
            import subprocess  # noqa: PLC0415

            env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "OPENBLAS_NUM_THREADS": str(args.threads),
                   "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
            exe = shutil.which("mpiexec") or "mpiexec"
            r = subprocess.run([exe, "-n", str(args.trainer_ranks), sys.executable, "-m", "mpisgd.train", *flags,
                                "--metrics-file", str(tmp)], capture_output=True, text=True, env=env, cwd=ROOT)
            epochs = [e for e in map(json.loads, tmp.read_text().splitlines()) if e.get("kind") == "epoch"] \
                if tmp.exists() else []
            if r.returncode:
                print(f"trainer B={B}: {command} failed (exit {r.returncode}): "
                      f"{(r.stderr.strip().splitlines() or [''])[-1]}", flush=True)
                if not epochs:
                    continue
            path.write_text("".join(json.dumps(e) + "\n" for e in epochs))  # the epoch records only
            tmp.unlink(missing_ok=True)
            print(f"trainer B={B}: {command}", flush=True)
        if not epochs:
            continue
        at = {}
        for tgt in args.target_list:
            i = next((j for j, e in enumerate(epochs) if e["train_loss"] <= tgt), None)
            ns = [e.get("noise_scale") for e in epochs]
            if i is None or not ns[i] or (i > 0 and not ns[i - 1]):
                at[f"{tgt:g}"] = None
                continue
            if i == 0:
                at[f"{tgt:g}"] = ns[0]
                continue
            l0, l1 = epochs[i - 1]["train_loss"], epochs[i]["train_loss"]
            f = (l0 - tgt) / (l0 - l1) if l0 > l1 else 1.0
            at[f"{tgt:g}"] = math.exp(math.log(ns[i - 1]) + f * (math.log(ns[i]) - math.log(ns[i - 1])))
        found.append({"B": B, "optimizer": opt, "mult": mult, "command": command,
                      "metrics": str(path.relative_to(out)),
                      "epochs": [[e["epoch"], e["train_loss"], e.get("noise_scale")] for e in epochs],
                      "noise_scale_at": at})
    return found


# -- the sweep -----------------------------------------------------------------------------------------
def load_runs(out: Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted((out / "runs").glob("*.json"))]


def hardest_reached(results: dict[float, dict[str, Any]], targets: list[float]) -> tuple[float, float] | None:
    """(mult of the best run, its steps) for the lowest target any of ``results`` reached."""
    for tgt in sorted(targets):
        hits = {mult: steps_to(r, tgt) for mult, r in results.items()}
        hits = {mult: st for mult, st in hits.items() if st is not None}
        if hits:
            mult = min(hits, key=hits.__getitem__)
            return mult, hits[mult]
    return None


def sweep_group(batch: int, optimizer: str, args: argparse.Namespace, data: Data) -> list[str]:
    """The rate grid at one (B, optimizer): --mults, from 1 outwards, then extended by factors of 2 while the
    best rate (fewest steps to the lowest target reached) is at an edge. Returns one line per run."""
    lines: list[str] = []
    results: dict[float, dict[str, Any]] = {}
    lowest = min(args.target_list)

    def one(mult: float) -> None:
        p = Point(batch, optimizer, mult)
        path = Path(args.out) / "runs" / f"{p.key}.json"
        s = point_settings(p, args)
        if path.exists():
            rec = json.loads(path.read_text())
            if rec["settings"] == s:
                results[mult] = rec
                lines.append(f"{p.key:<22} already in {path.parent.name}/, skipped")
                return
            if not args.force:
                raise SystemExit(f"critical_batch: {path} was run with other settings; use another --out or --force")
        best = [steps_to(r, lowest) for r in results.values()]
        best = [x for x in best if x is not None]
        rec = run_point(s, data, min(best) if best else None, args.prune, args.verbose)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(rec, indent=None, separators=(",", ":")))
        os.replace(tmp, path)  # a finished run is never half written
        results[mult] = rec
        hit = {t: steps_to(rec, t) for t in args.target_list}
        shown = " ".join(f"L{t:g}:{'-' if v is None else f'{v:.0f}'}" for t, v in hit.items())
        line = (f"{p.key:<22} {rec['status']:<8} steps {rec['steps_done']:>6} ({shown})  final loss "
                f"{rec['evals'][-1][2]:.4f}  cpu {rec['cpu_s']:.0f}s")
        lines.append(line)
        print(line, flush=True)

    for mult in sorted(args.mult_list, key=lambda x: (abs(math.log(x)), -x)):
        one(mult)
    for _ in range(args.extend):
        best = hardest_reached(results, args.target_list)
        if best is None:  # nothing reached any target: follow the lowest final loss
            ok = {mu: r["evals"][-1][2] for mu, r in results.items() if r["status"] != "diverged"}
            if not ok:
                one(min(results) / 2)
                continue
            best = (min(ok, key=ok.__getitem__), 0.0)
        mult = best[0]
        if mult == max(results) and results[mult]["status"] != "diverged":
            one(mult * 2)
        elif mult == min(results):
            one(mult / 2)
        else:
            break
    return lines


def groups(args: argparse.Namespace) -> list[tuple[int, str]]:
    out = []
    for B in args.batch_list:
        opts = ["sgd" if B < args.lars_from else "lars"]
        if B in args.both_list:
            opts = ["sgd", "lars"]
        out += [(B, o) for o in opts]
    return sorted(out, key=lambda g: -g[0])  # the largest B first: the longest runs start early


_DATA: Data | None = None


def _work(job: tuple[int, str, argparse.Namespace]) -> list[str]:
    batch, opt, args = job
    assert _DATA is not None
    return sweep_group(batch, opt, args, _DATA)


def load_data(args: argparse.Namespace) -> Data:
    if args.quick:
        train, test = synthetic(args.train_samples, seed=0), synthetic(1000, split=1)
    else:
        train, test, _ = load_fashion_mnist(args.data_dir)
        if args.train_samples < len(train):
            train = train.head(args.train_samples)
    return Data(train, test, args.eval_samples, args.seed)


# -- the report ----------------------------------------------------------------------------------------
def analyse(runs: list[dict[str, Any]], targets: list[float]) -> dict[str, Any]:
    out: dict[str, Any] = {"targets": {}}
    for tgt in sorted(targets, reverse=True):
        best = best_per_batch(runs, tgt)
        if not best:
            out["targets"][f"{tgt:g}"] = {"points": []}
            continue
        entry: dict[str, Any] = {"points": [
            {"B": B, "steps": round(v["steps"], 1), "samples": round(v["samples"]),
             "optimizer": v["run"]["settings"]["optimizer"], "eta0": v["run"]["settings"]["eta0"],
             "peak_lr": v["run"]["settings"]["peak_lr"], "test_error": v["test_error"],
             "noise_scale": None if not math.isfinite(v["noise_scale"]) else round(v["noise_scale"], 1)}
            for B, v in best.items()]}
        if len(best) >= 3:
            fit = fit_tradeoff(list(best), [v["steps"] for v in best.values()])
            lo, hi = bootstrap_bcrit(list(best), [v["steps"] for v in best.values()])
            entry["fit"] = {**{k: round(v, 4) for k, v in fit.items()}, "B_crit_90": [round(lo, 1), round(hi, 1)]}
            ns = [p["noise_scale"] for p in entry["points"] if p["noise_scale"]]
            entry["noise_scale_median"] = float(np.median(ns)) if ns else None
            entry["noise_scale_range"] = [min(ns), max(ns)] if ns else None
        out["targets"][f"{tgt:g}"] = entry
    return out


def markdown(summary: dict[str, Any], runs: list[dict[str, Any]], title: str) -> str:
    lines = [f"<!-- {title} -->", "", "## Fits", "",
             "| target loss | B with the target | S_min | E_min | **B_crit** = E_min/S_min (90 % bootstrap) | "
             "rms log residual | B_simple at the target (median over B; range) | B_simple / B_crit |",
             "|---|---|---|---|---|---|---|---|"]
    for tgt, e in summary["targets"].items():
        if "fit" not in e:
            lines.append(f"| {tgt} | {len(e['points'])} | | | too few points | | | |")
            continue
        f, ns = e["fit"], e.get("noise_scale_median")
        rng = e.get("noise_scale_range") or [float("nan")] * 2
        ratio = f"{ns / f['B_crit']:.2f}" if ns else ""
        lines.append(f"| {tgt} | {len(e['points'])} | {f['S_min']:.0f} | {f['E_min']:.0f} | **{f['B_crit']:.0f}** "
                     f"({f['B_crit_90'][0]:.0f}-{f['B_crit_90'][1]:.0f}) | {f['rms_log_residual']:.3f} | "
                     f"{ns:.0f} ({rng[0]:.0f}-{rng[1]:.0f}) | {ratio} |" if ns else
                     f"| {tgt} | {len(e['points'])} | {f['S_min']:.0f} | {f['E_min']:.0f} | **{f['B_crit']:.0f}** "
                     f"| {f['rms_log_residual']:.3f} | | |")
    if summary.get("trainer"):
        lines += ["", "## The trainer's noise scale at the targets", "",
                  "mpisgd.train's `noise_scale` (each epoch's; interpolated against the epoch-mean training loss) "
                  "in a real run at each B with that B's recipe:", "",
                  "| B | optimizer | " + " | ".join(f"at loss {t}" for t in summary["targets"]) + " | command |",
                  "|---|---|" + "---|" * len(summary["targets"]) + "---|"]
        for t in summary["trainer"]:
            cells = ["-" if t["noise_scale_at"].get(x) is None else f"{t['noise_scale_at'][x]:.0f}"
                     for x in summary["targets"]]
            lines.append(f"| {t['B']} | {t['optimizer']} | " + " | ".join(cells) + f" | `{t['command']}` |")
    for tgt, e in summary["targets"].items():
        lines += ["", f"## Target loss {tgt}: the best rate at each B", "",
                  "| B | optimizer | eta0 | peak rate | steps S | samples E | S / S(fit) | test error at target "
                  "| B_simple at target |", "|---|---|---|---|---|---|---|---|---|"]
        f = e.get("fit")
        for p in e["points"]:
            ratio = p["steps"] / (f["S_min"] * (1 + f["B_crit"] / p["B"])) if f else float("nan")
            err = "" if p["test_error"] is None else f"{100 * p['test_error']:.2f} %"
            lines.append(f"| {p['B']} | {p['optimizer']} | {p['eta0']:g} | {p['peak_lr']:.4g} | {p['steps']:.0f} | "
                         f"{p['samples']:,} | {ratio:.2f} | {err} | {p['noise_scale'] or ''} |")
    lines += ["", "## Every run", "",
              "| run | status | steps | samples | final loss | " + " | ".join(
                  f"S to {t}" for t in summary["targets"]) + " | cpu s | command |",
              "|---|---|---|---|---|" + "---|" * len(summary["targets"]) + "---|---|"]
    for rec in sorted(runs, key=lambda r: (r["settings"]["batch"], r["settings"]["optimizer"],
                                           r["settings"]["mult"])):
        s = rec["settings"]
        hits = [steps_to(rec, float(t)) for t in summary["targets"]]
        lines.append(f"| {Point(s['batch'], s['optimizer'], s['mult']).key} | {rec['status']} | {rec['steps_done']} | "
                     f"{rec['samples_done']:,} | {rec['evals'][-1][2]:.4f} | "
                     + " | ".join("-" if h is None else f"{h:.0f}" for h in hits)
                     + f" | {rec['cpu_s']:.0f} | `{rec['command']}` |")
    return "\n".join(lines) + "\n"


def plot(summary: dict[str, Any], runs: list[dict[str, Any]], path: Path) -> None:
    import matplotlib  # noqa: PLC0415 - only for the report

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.6))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for c, (tgt, e) in zip(colors, summary["targets"].items(), strict=False):
        if not e["points"]:
            continue
        S = [p["steps"] for p in e["points"]]
        E = [p["samples"] for p in e["points"]]
        ax1.scatter(S, E, color=c, s=18, zorder=3)
        for p in e["points"]:
            ax1.annotate(str(p["B"]), (p["steps"], p["samples"]), fontsize=6, xytext=(3, 2),
                         textcoords="offset points")
        f = e.get("fit")
        label = f"loss {tgt}"
        if f:
            bs = np.exp(np.linspace(math.log(min(p["B"] for p in e["points"]) / 2),
                                    math.log(max(p["B"] for p in e["points"]) * 2), 200))
            s_fit = f["S_min"] * (1 + f["B_crit"] / bs)
            ax1.plot(s_fit, s_fit * bs, color=c, lw=1, label=f"{label}: B_crit = {f['B_crit']:.0f}")
        else:
            ax1.plot([], [], color=c, label=label)
    ax1.set_xscale("log")
    ax1.set_yscale("log")
    ax1.set_xlabel("optimizer steps S to the target")
    ax1.set_ylabel("training samples E to the target")
    ax1.set_title("S-E trade-off (best rate per B) and the fit (S/Smin-1)(E/Emin-1)=1", fontsize=9)
    ax1.grid(True, which="both", alpha=0.3)
    ax1.legend(fontsize=7)
    # B_simple against the evaluated loss, for the best run at each B of the lowest target
    last = list(summary["targets"].values())[-1]
    keys = {(p["B"], p["optimizer"], p["eta0"]) for p in last["points"]}
    for rec in runs:
        s = rec["settings"]
        if (s["batch"], s["optimizer"], s["eta0"]) not in keys:
            continue
        rows = intervals(rec)
        pts = []  # groups of 3 intervals: ratio of their sums, at the last one's loss
        for j in range(2, len(rows)):
            g = sum((r[1] - r[0] + 1) * r[3] for r in rows[j - 2:j + 1])
            t = sum((r[1] - r[0] + 1) * r[4] for r in rows[j - 2:j + 1])
            if g > 0 and t > 0:
                pts.append((rows[j][2], t / g))
        if pts:
            ax2.plot(*zip(*pts), lw=0.8, alpha=0.7, label=f"B={s['batch']}")
    fits = [(float(t), e["fit"]["B_crit"], e["fit"]["B_crit_90"]) for t, e in summary["targets"].items()
            if e.get("fit")]
    if fits:
        ax2.errorbar([f[0] for f in fits], [f[1] for f in fits],
                     yerr=[[max(0, f[1] - f[2][0]) for f in fits], [max(0, f[2][1] - f[1]) for f in fits]],
                     fmt="ks", ms=6, capsize=3, label="B_crit (S-E fit)", zorder=4)
    med = [(float(t), e["noise_scale_median"], e["noise_scale_range"]) for t, e in summary["targets"].items()
           if e.get("noise_scale_median")]
    if med:
        ax2.errorbar([m[0] + 0.004 for m in med], [m[1] for m in med],
                     yerr=[[m[1] - m[2][0] for m in med], [m[2][1] - m[1] for m in med]], fmt="o", mfc="white",
                     mec="k", ecolor="k", ms=6, capsize=3, label="B_simple at the target (median, range over B)",
                     zorder=4)
    for j, t in enumerate(summary.get("trainer", [])):
        pts = [(float(x), v) for x, v in t["noise_scale_at"].items() if v]
        if pts:
            ax2.plot(*zip(*pts), "^v<>"[j % 4], color=("C3", "C1", "C2", "C4")[j % 4], mec="k", ms=7, zorder=5,
                     label=f"mpisgd.train's noise_scale, B={t['B']}")
    lo = min(summary["targets"], key=float)
    ax2.set_xlim(1.0, float(lo) * 0.92)
    ax2.set_yscale("log")
    ax2.set_xlabel("training loss (fixed subset), falling ->")
    ax2.set_ylabel("B_simple = tr(Sigma)/|G|^2 (samples)")
    ax2.set_title("noise scale measured in training, and B_crit", fontsize=9)
    ax2.grid(True, which="both", alpha=0.3)
    ax2.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def report(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    runs = [r for r in load_runs(out) if r["settings"].get("targets") == args.target_list]
    summary = analyse(runs, args.target_list)
    summary["trainer"] = trainer_noise(args, out, run=False)
    summary["runs"] = len(runs)
    summary["cpu_s"] = round(sum(r["cpu_s"] for r in runs), 1)
    title = ("quick smoke run" if args.quick else
             f"Fashion-MNIST {args.model} {args.hidden if args.model == 'mlp' else ''}, k=1, b=min(B/2,"
             f"{args.max_micro}), loss on {args.eval_samples} fixed training images")
    (out / "critical_batch.json").write_text(json.dumps({"title": title, **summary}, indent=1))
    (out / "critical_batch.md").write_text(markdown(summary, runs, title))
    if runs:
        plot(summary, runs, out / "critical_batch.png")
    for tgt, e in summary["targets"].items():
        if "fit" in e:
            f = e["fit"]
            ns = e.get("noise_scale_median")
            print(f"target {tgt}: B_crit = {f['B_crit']:.0f} (90 % {f['B_crit_90'][0]:.0f}-{f['B_crit_90'][1]:.0f}), "
                  f"S_min {f['S_min']:.0f}, E_min {f['E_min']:.0f}; B_simple at the target "
                  f"{'n/a' if ns is None else f'{ns:.0f}'} ({len(e['points'])} B)")
        else:
            print(f"target {tgt}: {len(e['points'])} B reached it: too few to fit")
    for t in summary["trainer"]:
        shown = ", ".join(f"{k}: {'-' if v is None else f'{v:.0f}'}" for k, v in t["noise_scale_at"].items())
        print(f"trainer's noise_scale at B={t['B']} ({t['optimizer']}), at each target loss: {shown}")
    for path, loss, ns in noise_from_metrics(args.noise_metrics, min(args.target_list)) if args.noise_metrics else []:
        print(f"{path}: noise_scale {ns} at epoch-mean train_loss {loss} (first epoch <= {min(args.target_list)})")
    print(f"wrote {out}/critical_batch.{{json,md,png}} from {len(runs)} runs ({summary['cpu_s'] / 3600:.2f} CPU-h)")
    return summary


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="64,128,256,512,1024,2048,4096,8192", help="effective batches B")
    p.add_argument("--lars-from", type=at_least(1), default=2048, help="B from which the recipe is LARS instead of SGD")
    p.add_argument("--both", default="2048", help="B at which both optimizers get a grid (the switch)")
    p.add_argument("--mults", default="0.5,1,2", help="the rate grid: multiples of the recipe's eta0")
    p.add_argument("--extend", type=at_least(0), default=2,
                   help="factors of 2 the grid may grow by while the best is at an edge")
    p.add_argument("--targets", default="0.45,0.4,0.35,0.3", help="training-loss targets (the lowest ends a run)")
    p.add_argument("--max-epochs", type=at_least(1), default=40, help="epoch budget of a run that does not reach them")
    p.add_argument("--prune", type=float, default=2.0,
                   help="stop a run past this many times the steps another rate at its B needed")
    p.add_argument("--warmup-epochs", type=float, default=0.5, help="SGD's warmup (from eta0 up to the scaled rate)")
    p.add_argument("--lars-warmup-epochs", type=float, default=0.0, help="LARS's warmup")
    p.add_argument("--eval-samples", type=at_least(1), default=5000, help="size of the fixed training subset evaluated")
    p.add_argument("--eval-every", type=at_least(1), default=7500, help="samples between evaluations (at least a step)")
    p.add_argument("--noise-tau", type=float, default=15000, help="time constant of the noise averages, samples")
    p.add_argument("--max-micro", type=at_least(1), default=512, help="largest micro-batch b")
    p.add_argument("--model", default="mlp", choices=("mlp", "cnn"))
    p.add_argument("--hidden", default="1024,1024", help="MLP widths")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--weight-decay", type=float, default=1e-4)
    p.add_argument("--sgd-lr", type=float, default=RECIPES["sgd"]["eta0"], help="SGD's eta0 for B0 = 256 (the grid "
                                                                             "multiplies it)")
    p.add_argument("--lars-lr", type=float, default=RECIPES["lars"]["eta0"], help="LARS's eta0 for B0 = 256")
    p.add_argument("--seed", type=at_least(0), default=0)
    p.add_argument("--train-samples", type=at_least(1), default=60000, help="use the first N training images")
    p.add_argument("--data-dir", default=None, help="Fashion-MNIST IDX directory (default: mpisgd's search)")
    p.add_argument("--jobs", type=at_least(1), default=1,
                   help="(B, optimizer) grids run side by side, one process each")
    p.add_argument("--threads", type=at_least(1), default=1, help="BLAS threads per process")
    p.add_argument("--out", default=str(ROOT / "results" / "critical_batch"), help="output directory")
    p.add_argument("--trainer-batches", default="256,1024",
                   help="B at which a real mpisgd.train run measures the trainer's own noise scale (empty: none)")
    p.add_argument("--trainer-ranks", type=at_least(1), default=2, help="ranks of those runs")
    p.add_argument("--trainer-epochs", type=at_least(1), default=8, help="epochs of those runs")
    p.add_argument("--trainer-only", action="store_true", help="skip the sweep: only the trainer's runs, then the "
                                                               "report")
    p.add_argument("--noise-metrics", nargs="*", default=[],
                   help="metrics files of mpisgd.train runs: print their noise_scale at the lowest target")
    p.add_argument("--quick", action="store_true", help="smoke run: synthetic data, a small MLP, 3 B, seconds")
    p.add_argument("--force", action="store_true", help="rerun points whose stored settings differ")
    p.add_argument("--verbose", action="store_true", help="print every evaluation")
    p.add_argument("--report-only", action="store_true", help="only the fit, the tables and the plot")
    args = p.parse_args(argv)
    if args.quick:
        args.batches, args.both, args.hidden, args.train_samples = "64,256,1024", "", "32", 4096
        args.targets, args.max_epochs, args.eval_samples, args.eval_every = "0.8,0.6", 20, 500, 1024
        args.noise_tau, args.lars_from = 2048, 1024
        args.trainer_batches, args.trainer_epochs = "256", 3
        if args.out == p.get_default("out"):
            args.out = str(ROOT / "results" / "tmp" / "critical_batch_quick")
    try:
        args.batch_list = [int(x) for x in args.batches.split(",")]
        args.trainer_batch_list = [int(x) for x in args.trainer_batches.split(",") if x]
        args.both_list = [int(x) for x in args.both.split(",") if x]
        args.mult_list = [float(x) for x in args.mults.split(",")]
        args.target_list = sorted((float(x) for x in args.targets.split(",")), reverse=True)
    except ValueError as exc:
        p.error(f"lists are comma-separated numbers: {exc}")
    for B in args.batch_list:
        try:
            split_batch(B, args.max_micro)
        except ValueError as exc:
            p.error(str(exc))
    if any(m <= 0 for m in args.mult_list) or any(t <= 0 for t in args.target_list):
        p.error("rate multiples and targets must be > 0")
    return args


def main(argv: list[str] | None = None) -> int:
    global _DATA
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not args.report_only and not args.trainer_only:
        from mpisgd.backend import set_threads  # noqa: PLC0415

        set_threads(args.threads)
        meta = {"argv": sys.argv[1:] if argv is None else argv, "settings": shared_settings(args),
                "host_cores": os.cpu_count(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
        with open(out / "invocations.jsonl", "a") as f:
            f.write(json.dumps(meta) + "\n")
        _DATA = load_data(args)
        jobs = [(B, o, args) for B, o in groups(args)]
        t0 = time.perf_counter()
        if args.jobs > 1:
            with multiprocessing.get_context("fork").Pool(args.jobs, maxtasksperchild=1) as pool:
                for lines in pool.imap_unordered(_work, jobs):
                    for line in lines:
                        if "skipped" in line:
                            print(line, flush=True)
        else:
            for job in jobs:
                for line in _work(job):
                    if "skipped" in line:
                        print(line, flush=True)
        print(f"sweep: {time.perf_counter() - t0:.0f} s wall", flush=True)
    if not args.report_only:
        trainer_noise(args, out, run=True)
    report(args, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

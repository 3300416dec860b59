"""Plots: the learning-rate schedule of a training command, training curves from metrics files.

    python -m mpisgd.plot lr [--ranks K] [--out lr.png] [train options...]
    python -m mpisgd.plot curves METRICS.jsonl [MORE.jsonl ...] [--labels a,b] [--out curves.png]
                                 (loss, test error, the gradient noise scale, learning rate)

``lr`` takes the same options as ``python -m mpisgd.train`` and evaluates the very
Schedule the run would use (for K ranks), with no MPI and no training. matplotlib
(Agg backend) is imported only when a figure is drawn. Exit 2 on bad input.
"""

from __future__ import annotations

import argparse
import io
import math
import os
import sys
from collections.abc import Sequence
from typing import Any

from mpisgd.app.options import add_version, parse_config
from mpisgd.app.records import EpochRecord
from mpisgd.config import Config
from mpisgd.errors import UsageError
from mpisgd.files import atomic_write, figure_problem
from mpisgd.schedule import Schedule, effective_batch, total_steps

FASHION_MNIST_TRAIN = 60000


def check_out(out: str) -> str:
    """--out's file type (png, pdf or svg: by its name), UsageError in one line for another or a directory."""
    problem = figure_problem(out, "--out")
    if problem:
        raise UsageError(problem)
    return os.path.splitext(out)[1][1:].lower()


def save_figure(fig: Any, out: str) -> None:
    """``fig`` into ``out`` all or nothing (mpisgd.files.atomic_write), in the type its name gives; the figure
    is closed. UsageError naming --out where it cannot be written."""
    image = io.BytesIO()
    fig.savefig(image, format=check_out(out), dpi=100)
    _pyplot().close(fig)
    try:
        atomic_write(out, lambda f: f.write(image.getvalue()))
    except OSError as exc:
        raise UsageError(f"--out {out}: not written ({exc.strerror or exc})") from None


def _pyplot() -> Any:
    import matplotlib  # noqa: PLC0415 - lazy: only plotting needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    return plt


def train_samples(cfg: Config) -> int:
    """How many training samples the run would see per epoch (without loading the data)."""
    n = cfg.synthetic_samples if cfg.dataset == "synthetic" else FASHION_MNIST_TRAIN
    return min(n, cfg.limit_train) if cfg.limit_train else n


def schedule_for(cfg: Config, ranks: int, samples: int | None = None) -> tuple[Schedule, int]:
    """The run's Schedule and steps per epoch, computed as the trainer does."""
    batch = effective_batch(cfg.batch_size, ranks, cfg.accum_steps)
    n = train_samples(cfg) if samples is None else samples
    spe = n // batch
    if spe < 1:
        raise UsageError(f"{n} training samples make no step of B={batch}")
    total = total_steps(cfg.epochs, spe, cfg.max_steps)
    sched, warnings = Schedule.for_run(cfg, ranks, spe, total)
    for warning in warnings:
        print(f"mpisgd.plot: warning: {warning}", file=sys.stderr, flush=True)
    return sched, spe


def plot_lr(cfg: Config, ranks: int, out: str, samples: int | None = None) -> str:
    sched, spe = schedule_for(cfg, ranks, samples)
    steps = list(range(sched.total_steps))
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    ax.plot([s / spe for s in steps], [sched(s) for s in steps], lw=1.5)
    if sched.warmup_steps:
        ax.axvline(sched.warmup_steps / spe, color="gray", ls=":", lw=1, label="end of warmup")
        ax.legend()
    batch = effective_batch(cfg.batch_size, ranks, cfg.accum_steps)
    ax.set(xlabel="epoch", ylabel="learning rate",
           title=f"B={batch} (k={ranks}, b={cfg.batch_size}, m={cfg.accum_steps}), {cfg.lr_scaling} scaling, "
                 f"peak {sched.peak_lr:.3g}, decay {cfg.decay}")
    ax.title.set_fontsize(9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    save_figure(fig, out)
    return out


def noise_points(epochs: Sequence[EpochRecord]) -> tuple[list[int], list[float]]:
    """(steps, noise scales) of the epoch records that carry a finite, positive one: early and late in a
    run the estimate can be inf (|G|^2 estimated <= 0; null in the file) or missing (--noise-scale-every 0)."""
    kept = [(r.step, r.noise_scale) for r in epochs
            if r.noise_scale is not None and math.isfinite(r.noise_scale) and r.noise_scale > 0]
    return [p[0] for p in kept], [p[1] for p in kept]


def curves_figure(paths: Sequence[str], labels: Sequence[str] | None = None) -> Any:
    """Per-step loss, per-epoch test error, the gradient noise scale beside them (it grows as the loss
    falls: the batch that still pays grows with it) and the learning rate, one line per metrics file (a
    file several runs appended to: its last run)."""
    from mpisgd.app.metrics import read_metrics  # noqa: PLC0415

    if labels is not None and len(labels) != len(paths):
        raise UsageError(f"{len(labels)} label(s) for {len(paths)} metrics file(s)")
    plt = _pyplot()
    fig, (a_loss, a_err, a_noise, a_lr) = plt.subplots(1, 4, figsize=(17, 3.6))
    for i, path in enumerate(paths):
        runs = read_metrics(path)  # MetricsError is a UsageError: one line
        steps, epochs = (runs[-1].steps, runs[-1].epochs) if runs else ([], [])
        if not steps and not epochs:
            raise UsageError(f"{path} holds no step or epoch records (write one with --metrics-file)")
        label = labels[i] if labels else path
        if steps:
            a_loss.plot([r.step for r in steps], [r.loss for r in steps], lw=0.8, label=label)
            a_lr.plot([r.step for r in steps], [r.lr for r in steps], lw=1.2, label=label)
        scored = [r for r in epochs if r.test_acc is not None]
        if scored:
            a_err.plot([r.epoch for r in scored], [100 * (1 - float(r.test_acc or 0)) for r in scored], "o-",
                       label=label)
        at, noise = noise_points(epochs)
        if noise:
            a_noise.plot(at, noise, "o-", label=label)
    a_loss.set(xlabel="step", ylabel="training loss (mean over B)", yscale="log")
    a_err.set(xlabel="epoch", ylabel="test error (%)")
    a_noise.set(xlabel="step", ylabel="gradient noise scale (samples)")
    if a_noise.lines:
        a_noise.set_yscale("log")
    else:
        a_noise.text(0.5, 0.5, "no noise scale recorded", ha="center", va="center", transform=a_noise.transAxes)
    a_lr.set(xlabel="step", ylabel="learning rate")
    for a in (a_loss, a_err, a_noise, a_lr):
        a.grid(alpha=0.3)
    for a in (a_loss, a_err):  # a file has step records, epoch records or both
        if a.lines:
            a.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_curves(paths: Sequence[str], out: str, labels: Sequence[str] | None = None) -> str:
    fig = curves_figure(paths, labels)
    save_figure(fig, out)
    return out


def plot_error_vs_batch(series: dict[str, list[tuple[int, float, bool]]], out: str, title: str = "") -> str:
    """Final test error against effective batch B (log2 axis): recipe -> [(B, error, diverged)].

    Diverged runs are drawn as crosses on a band at the top of the axes, so the
    interesting range of errors is not squashed by the 90 % of chance level.
    """
    plt = _pyplot()
    ok = [100 * e for pts in series.values() for _, e, d in pts if not d]
    cap = max(ok) * 1.15 if ok else 100.0  # the band of diverged runs
    any_diverged = any(d for pts in series.values() for _, _, d in pts)
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for i, (name, unsorted) in enumerate(series.items()):
        points = sorted(unsorted)
        xs = [p[0] * (1 + 0.04 * (i - 1)) for p in points]  # a small offset keeps overlapping lines visible
        ys = [cap if p[2] else 100 * p[1] for p in points]
        line = ax.plot(xs, ys, marker="osd^v"[i % 5], ls="-", label=name)[0]
        bad = [(x, y) for x, y, p in zip(xs, ys, points) if p[2]]
        if bad:
            ax.plot(*zip(*bad), "x", ms=11, mew=2.5, color=line.get_color())
    if any_diverged:
        ax.axhspan(cap * 0.97, cap * 1.05, color="0.9", zorder=0)
        ax.text(0.01, cap * 1.0, " diverged (x)", transform=ax.get_yaxis_transform(), va="center", fontsize=8)
        ax.set_ylim(0, cap * 1.05)
    else:
        ax.set_ylim(bottom=0)
    ax.set_xscale("log", base=2)
    ax.set(xlabel="effective batch size B = k*b*m", ylabel="final test error (%)", title=title)
    ax.title.set_fontsize(8)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8, loc="center left")
    fig.tight_layout()
    save_figure(fig, out)
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(prog="python -m mpisgd.plot", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    add_version(p)
    sub = p.add_subparsers(dest="what", required=True)
    p_lr = sub.add_parser("lr", allow_abbrev=False, help="the learning-rate schedule of a training command")
    p_lr.add_argument("--ranks", type=int, default=1, help="ranks k the run would use (B = k*b*m)")
    p_lr.add_argument("--train-samples", type=int, default=None,
                      help="training samples per epoch (default: from --dataset/--limit-train)")
    p_lr.add_argument("--out", default="lr.png", help="the figure to write: .png, .pdf or .svg")
    p_c = sub.add_parser("curves", allow_abbrev=False, help="training curves from --metrics-file outputs")
    p_c.add_argument("metrics", nargs="+", help="metrics JSONL file(s)")
    p_c.add_argument("--labels", default=None, help="comma-separated legend labels, one per file")
    p_c.add_argument("--out", default="curves.png", help="the figure to write: .png, .pdf or .svg")
    try:
        if argv[:1] == ["lr"]:
            ns, rest = p.parse_known_args(argv)
            check_out(ns.out)
            if ns.ranks < 1:
                raise UsageError(f"--ranks must be >= 1, got {ns.ranks}")
            cfg = parse_config(rest)
            out = plot_lr(cfg, ns.ranks, ns.out, ns.train_samples)
        else:
            ns = p.parse_args(argv)
            check_out(ns.out)
            out = plot_curves(ns.metrics, ns.out, ns.labels.split(",") if ns.labels else None)
    except UsageError as exc:
        print(f"mpisgd.plot: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0

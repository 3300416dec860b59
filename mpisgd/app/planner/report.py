"""What the planner prints and writes: the table, the JSON, the plot."""

from __future__ import annotations

import io
import json
import os
from collections.abc import Sequence
from dataclasses import asdict
from typing import IO, Any

from mpisgd.app.planner.errors import PlanError
from mpisgd.app.planner.model import Recommendation, Row
from mpisgd.app.planner.topology import Cluster, size_text
from mpisgd.app.planner.workload import Rules, Workload
from mpisgd.files import atomic_write, figure_problem


def _duration(s: float | None) -> str:
    if s is None:
        return "-"
    return f"{s:.1f} s" if s < 120 else f"{s / 60:.1f} min" if s < 7200 else f"{s / 3600:.1f} h"


def table(w: Workload, net: Cluster, rows: Sequence[Row], rec: Recommendation, rules: Rules,
          target_samples: float | None) -> str:
    nodes_col = any(r.nodes > 1 for r in rows)
    head = ["k", *(["nodes"] if nodes_col else []), "b", "m", "B", "lr", "step ms", "(compute", "exposed)",
            "samples/s", "scal eff", "stat eff", "goodput", "steps", "to target", "speedup"]
    mem = f", {w.memory_mib:.0f} MiB per rank" if w.memory_mib else ""
    out = [
        f"workload: {w.source}: k={w.k} x b={w.b} x m={w.m} = B0={w.B}, {w.step_ms:.2f} ms/step "
        f"({w.samples_per_s:.0f} samples/s), {w.device}, gradient {size_text(w.grad_nbytes)} in "
        f"{len(w.bucket_nbytes)} bucket(s) ({', '.join(size_text(x) for x in w.bucket_nbytes[:6])}"
        f"{', ...' if len(w.bucket_nbytes) > 6 else ''}; {w.buckets_from}), overlap {'on' if w.overlap else 'off'}"
        f"{mem}",
        (f"noise scale B_noise = {w.noise_scale:.0f} samples" + (
            f" (end of the run, train loss {w.train_loss:.4f})" if w.train_loss is not None else "")
         if w.noise_scale else "noise scale: none given: samples/s only, no statistical efficiency"),
    ]
    if target_samples:
        epochs = f" ({target_samples / (w.steps_per_epoch * w.B):.3g} epochs)" if w.steps_per_epoch else ""
        out.append(f"target: the loss B0 reaches after {target_samples:,.0f} samples{epochs}")
    out += [f"rate: lr {rules.lr:g} for B0={rules.base_batch}, {rules.scaling} scaling, {rules.optimizer} "
            f"(from {rules.source})",
            f"cluster: {net.describe()} (from {net.source})"]
    out += [f"note: {n}" for n in w.notes]
    out += ["", "  ".join(f"{h:>9}" for h in head)]
    for r in rows:
        cells = [str(r.k), *([str(r.nodes)] if nodes_col else []), str(r.b), str(r.m), str(r.B), f"{r.lr:.4g}",
                 f"{r.step_ms:.2f}", f"{r.compute_ms:.2f}", f"{r.exposed_comm_ms:.2f}", f"{r.samples_per_s:.0f}",
                 f"{r.scaling_efficiency:.3f}",
                 "-" if r.statistical_efficiency is None else f"{r.statistical_efficiency:.3f}",
                 f"{r.goodput:.0f}", "-" if r.steps_to_target is None else f"{r.steps_to_target:.0f}",
                 _duration(r.time_to_target_s), "-" if r.speedup is None else f"{r.speedup:.2f}x"]
        mark = "  <- recommended" if r is rec.row else ("  (does not fit in memory)" if not r.fits else "")
        out.append("  ".join(f"{c:>9}" for c in cells) + mark)
    p = rec.row
    out += ["", f"recommended: k={p.k}" + (f" ({p.nodes} nodes x {p.ranks_per_node})" if p.nodes > 1 else "") +
            f", b={p.b}, m={p.m}, B={p.B}, lr {p.lr:.4g} ({rules.optimizer}); chosen by {rec.constraint}: "
            f"{rec.reason}" + (f"; {_duration(p.time_to_target_s)} to the target" if p.time_to_target_s else "")]
    if w.noise_scale and any(r.B > 4 * w.noise_scale for r in rows):
        out.append(f"note: rows with B well above B_noise ({w.noise_scale:.0f}) buy little: each doubling of B there "
                   "nearly doubles the samples to the target")
    if any(r.B > 4 * rules.base_batch for r in rows):
        advice = {"sgd": "plain SGD may need warmup or LARS there", "adamw": "AdamW may need warmup or LAMB there"}
        out.append(f"note: the rates above {4 * rules.base_batch} samples are the scaling rule's, not tested ones: "
                   f"{advice.get(rules.optimizer, f'{rules.optimizer} may need warmup there')} (docs/large_batch.md)")
    return "\n".join(out)


def result(w: Workload, net: Cluster, rows: Sequence[Row], rec: Recommendation, rules: Rules,
           target_samples: float | None, margin: float) -> dict[str, Any]:
    """What --json writes."""
    return {"workload": asdict(w), "rules": asdict(rules),
            "cluster": {"intra": asdict(net.intra), "inter": asdict(net.inter) if net.inter else None,
                        "ranks_per_node": net.per_node, "library": net.library, "algorithm": net.algorithm,
                        "overlap": net.overlap, "nodes": net.nodes, "node_memory_gib": net.node_memory_gib,
                        "source": net.source},
            "target_samples": target_samples, "margin": margin, "rows": [asdict(r) for r in rows],
            "recommended": {**asdict(rec.row), "constraint": rec.constraint, "reason": rec.reason}}


PLAN_KEYS = {"workload", "rules", "cluster", "rows", "recommended"}  # what result() writes, and a plan's JSON holds
MAX_PLAN_BYTES = 64 * 2**20  # a plan's JSON is kilobytes; a larger file is not one (and is not read whole)
PLOT_MARKS = (b"matplotlib", b"Matplotlib")  # what matplotlib writes into a .png, .pdf or .svg it makes


def is_plan_json(f: IO[bytes]) -> bool:
    """Whether the open file holds a plan this tool wrote (--json): a JSON object with result()'s keys."""
    data = f.read(MAX_PLAN_BYTES + 1)
    if len(data) > MAX_PLAN_BYTES:
        return False
    try:
        value = json.loads(data)
    except (ValueError, RecursionError):
        return False
    return isinstance(value, dict) and PLAN_KEYS <= set(value)


def is_plot(f: IO[bytes]) -> bool:
    """Whether the open file is a plot matplotlib made (--plot): its name is in the file's first 64 KiB (a
    .png's Software text, a .pdf's Creator, an .svg's comment)."""
    head = f.read(64 * 1024)
    return any(mark in head for mark in PLOT_MARKS)


def _put(f: Any, data: bytes) -> None:
    f.write(data)


def write_json(path: str, data: dict[str, Any]) -> None:
    """All or nothing: a full disk or a directory at ``path`` is one line, and no half-written file stays."""
    text = json.dumps(data, indent=1, allow_nan=False).encode()
    if os.path.isdir(path):
        raise PlanError(f"--json {path} is a directory: give a file name")
    try:
        atomic_write(path, lambda f: _put(f, text))
    except OSError as exc:
        raise PlanError(f"--json {path}: not written ({exc.strerror or exc})") from None


def check_plot_path(path: str) -> None:
    """--plot's file type, and matplotlib, before any work."""
    problem = figure_problem(path, "--plot")
    if problem:
        raise PlanError(problem)
    try:
        import matplotlib  # noqa: F401, PLC0415 - only for --plot
    except ImportError:
        raise PlanError("--plot needs matplotlib: pip install matplotlib") from None


def plot(rows: Sequence[Row], rec: Recommendation, path: str, title: str) -> None:
    import matplotlib  # noqa: PLC0415 - only for --plot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(7, 4.2))
    ms = sorted({r.m for r in rows})
    for m in ms:
        rs = [r for r in rows if r.m == m]
        tag = f" (m={m})" if len(ms) > 1 else ""
        ax.plot([r.k for r in rs], [r.samples_per_s for r in rs], marker="o", ms=3, label="samples/s" + tag)
        ax.plot([r.k for r in rs], [r.goodput for r in rs], marker="s", ms=3, label="goodput" + tag)
    ax.plot([rec.row.k], [rec.row.goodput], "k*", ms=12, label="recommended")
    ax.set_xscale("log", base=2)
    ax.set(xlabel="ranks k", ylabel="samples/s (goodput: worth of B0's samples)", title=title)
    ax.title.set_fontsize(8)
    ax.set_ylim(bottom=0)
    ax.grid(True, which="both", alpha=0.3)
    ax2 = ax.twinx()
    for m in ms:
        rs = [r for r in rows if r.m == m]
        stat = [(r.k, r.statistical_efficiency) for r in rs if r.statistical_efficiency is not None]
        if stat:
            ax2.plot([k for k, _ in stat], [e for _, e in stat], ls=":", color="0.4")
        ax2.plot([r.k for r in rs], [r.scaling_efficiency for r in rs], ls="--", color="0.6")
    ax2.set_ylim(0, 1.05)
    ax2.set_ylabel("efficiency: statistical (dotted), scaling (dashed)")
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    image = io.BytesIO()
    fig.savefig(image, format=os.path.splitext(path)[1][1:].lower(), dpi=110)
    plt.close(fig)
    try:  # all or nothing, as --json
        atomic_write(path, lambda f: _put(f, image.getvalue()))
    except OSError as exc:
        raise PlanError(f"--plot {path}: not written ({exc.strerror or exc})") from None

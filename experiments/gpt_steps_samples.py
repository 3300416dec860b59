"""Steps and samples to a fixed training loss against the batch size, for the GPT: a small version of
experiments/critical_batch.py's study (docs/large_batch.md, "The GPT") on the character-level language model.

For each effective batch B (windows of --context characters), one `python -m mpisgd.train --model gpt` run
at k = 1 from the same initialisation and window order, AdamW at the rate --lr x sqrt(B / --base) (not tuned
per B: one rate each, so S is an upper bound on the best rate's), constant after --warmup-steps. The training
loss of each step (the step record's, this process's batch) is smoothed by a centred moving average of
--smooth steps; the first step at which it reaches each target gives S, and E = S B windows (x context for
tokens). Per target, S(B) = S_min + E_min / B is fitted by least squares in 1/B, and B_crit = E_min / S_min
(McCandlish et al. 2018). Each run's metrics file stays in --out/runs/ (an existing one is reused).

    python experiments/gpt_steps_samples.py --data /usr/local/share/mpisgd/kjv.txt --jobs 2
    python experiments/gpt_steps_samples.py --quick       # smoke run: README.md as text, seconds
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(args: argparse.Namespace, B: int) -> Path:  # noqa: N803 - the effective batch's name in the docs
    """One training run at effective batch B; its metrics file (reused when complete)."""
    out = Path(args.out) / "runs" / f"B{B}.jsonl"
    if out.with_suffix(".done").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.unlink(missing_ok=True)
    b = min(B, args.micro)
    cmd = [sys.executable, "-m", "mpisgd.train", "--model", "gpt", "--data", args.data, "--context", str(args.context),
           "--global-batch", str(B), "--batch-size", str(b), "--lr", f"{args.lr * math.sqrt(B / args.base):.6g}",
           "--lr-scaling", "none", "--warmup-steps", str(args.warmup_steps), "--decay", "none", "--epochs", "1",
           "--max-steps", str(max(args.min_steps, args.max_windows // B)), "--noise-scale-every", "1",
           "--limit-test", "64", "--progress", "off", "--seed", "0", "--metrics-file", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if r.returncode:
        raise SystemExit(f"B={B} failed: {' '.join(cmd)}\n{r.stderr[-2000:]}")
    out.with_suffix(".cmd").write_text(" ".join(cmd[1:]) + "\n")
    out.with_suffix(".done").write_text("")
    return out


def steps_to(losses: list[float], target: float, smooth: int) -> float | None:
    """The first (fractional) step at which the centred moving average of ``losses`` reaches ``target``."""
    h = smooth // 2
    avg = [sum(losses[i - h:i + h + 1]) / (2 * h + 1) for i in range(h, len(losses) - h)]
    for j in range(1, len(avg)):
        if avg[j] <= target < avg[j - 1]:
            return h + j - 1 + (avg[j - 1] - target) / (avg[j - 1] - avg[j]) + 1  # steps are counted from 1
    return None


def fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """S = S_min + E_min / B by least squares in x = 1/B: (S_min, E_min)."""
    xs, ys = [1 / b for b, _ in points], [s for _, s in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    return my - slope * mx, slope


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default="/usr/local/share/mpisgd/kjv.txt")
    p.add_argument("--batches", default="16,32,64,128,256", help="effective batches B, in windows")
    p.add_argument("--targets", default="2.6,2.4,2.2", help="training-loss targets, nats per character")
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW's rate at B = --base")
    p.add_argument("--base", type=int, default=32)
    p.add_argument("--micro", type=int, default=32, help="largest micro-batch b (m = B / b accumulated)")
    p.add_argument("--warmup-steps", type=int, default=10)
    p.add_argument("--max-windows", type=int, default=40960, help="samples budget of each run (windows)")
    p.add_argument("--min-steps", type=int, default=120)
    p.add_argument("--smooth", type=int, default=9, help="steps in the centred moving average of the loss")
    p.add_argument("--jobs", type=int, default=1)
    p.add_argument("--out", default=str(ROOT / "results" / "critical_batch_gpt"))
    p.add_argument("--quick", action="store_true", help="README.md as text, two small batches, a few steps")
    args = p.parse_args()
    if args.quick:
        args.data, args.batches, args.targets, args.context = str(ROOT / "README.md"), "8,16", "3.6,3.4", 16
        args.max_windows, args.min_steps, args.smooth, args.warmup_steps = 320, 20, 3, 2
    batches = [int(b) for b in args.batches.split(",")]
    targets = [float(t) for t in args.targets.split(",")]
    with ThreadPoolExecutor(args.jobs) as pool:
        files = dict(zip(batches, pool.map(lambda B: run(args, B), batches), strict=True))
    rows, fits = {}, {}
    for B, path in files.items():
        records = [json.loads(line) for line in path.read_text().splitlines()]
        losses = [r["loss"] for r in records if r.get("kind") == "step"]
        noise = [r.get("noise_scale") for r in records if r.get("kind") == "epoch"]
        rows[B] = {"steps_run": len(losses), "S": {t: steps_to(losses, t, args.smooth) for t in targets},
                   "noise_scale": noise[-1] if noise else None, "final_loss": losses[-1] if losses else None}
    for t in targets:
        points = [(B, r["S"][t]) for B, r in rows.items() if r["S"][t] is not None]
        if len(points) >= 3:
            s_min, e_min = fit(points)
            fits[t] = {"S_min": s_min, "E_min": e_min, "B_crit": e_min / s_min if s_min > 0 else None}
    lines = [f"# The GPT: steps and samples to a training loss against B ({' '.join(sys.argv[1:]) or 'defaults'})",
             "", f"`python experiments/gpt_steps_samples.py {' '.join(sys.argv[1:])}`; data {args.data}, context "
             f"{args.context}, AdamW at {args.lr:g} x sqrt(B/{args.base}), warmup {args.warmup_steps}, constant after; "
             f"S from a {args.smooth}-step centred mean of the step losses.", "",
             "| B (windows) | rate | " + " | ".join(f"S to {t:g}" for t in targets)
             + " | steps run | noise scale, end |",
             "|" + "---|" * (len(targets) + 4)]
    for B, r in rows.items():
        cells = [f"{r['S'][t]:.0f}" if r["S"][t] is not None else "—" for t in targets]
        ns = f"{r['noise_scale']:.0f}" if isinstance(r["noise_scale"], float) else "—"
        lines.append(f"| {B} | {args.lr * math.sqrt(B / args.base):.4g} | " + " | ".join(cells)
                     + f" | {r['steps_run']} | {ns} |")
    lines += ["", "| target | S_min | E_min (windows) | B_crit (windows) | B_crit (tokens) |", "|---|---|---|---|---|"]
    for t, f in fits.items():
        bc = f["B_crit"]
        lines.append(f"| {t:g} | {f['S_min']:.0f} | {f['E_min']:.0f} | {bc:.0f} | {bc * args.context:.0f} |"
                     if bc else f"| {t:g} | {f['S_min']:.0f} | {f['E_min']:.0f} | — | — |")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "summary.md").write_text("\n".join(lines) + "\n")
    (Path(args.out) / "summary.json").write_text(json.dumps({"rows": {str(b): r for b, r in rows.items()},
                                                             "fits": {str(t): f for t, f in fits.items()}},
                                                            indent=1, default=str))
    print("\n".join(lines))


if __name__ == "__main__":
    main()

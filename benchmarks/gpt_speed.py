"""Training speed of mpisgd's GPT against its PyTorch twin, side by side: the same model, batch, context and
data, one thread per process, k = 1, in interleaved repeats (docs/benchmarks.md, "The GPT").

    python benchmarks/gpt_speed.py compare [--repeats 5 --steps 15 --batch-size 32 --context 64]
    python benchmarks/gpt_speed.py mpisgd [...]      one measurement of mpisgd (one JSON line)

``compare`` alternates the two, each in a fresh process (``mpisgd``, then ``benchmarks/gpt_torch.py
speed``), ``--repeats`` times, so that a change of the machine's load hits both alike; each process
times ``--steps`` training steps after ``--warmup`` untimed ones and reports the median step. mpisgd's
step is the CLI's: ``DataParallel.train_step`` (k = 1) with AdamW and the token loss; PyTorch's is
forward, cross-entropy, backward and ``AdamW.step``. It prints every pair and the ratio
mpisgd/PyTorch in tokens/s: the median over the repeats and its range.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def mpisgd_speed(argv: list[str], steps: int, warmup: int) -> dict[str, Any]:
    sys.path.insert(0, ROOT)
    import numpy as np  # noqa: PLC0415
    from mpi4py import MPI  # noqa: PLC0415

    from mpisgd.app.options import parse_config  # noqa: PLC0415
    from mpisgd.data import BatchLoader, epoch_permutation  # noqa: PLC0415
    from mpisgd.nn import TokenCrossEntropy  # noqa: PLC0415
    from mpisgd.nn.gpt import GPTShape, gpt  # noqa: PLC0415
    from mpisgd.optim.adam import AdamW, matrices  # noqa: PLC0415
    from mpisgd.parallel import DataParallel  # noqa: PLC0415
    from mpisgd.text import load_tokens  # noqa: PLC0415

    cfg = parse_config(["--model", "gpt", *argv], quiet=True)
    assert cfg.data is not None
    d = load_tokens(cfg.data, cfg.context, cfg.val_split)
    s = GPTShape(d.vocab.size, cfg.context, cfg.gpt_layers, cfg.gpt_heads, cfg.gpt_width, cfg.dropout)
    model = gpt(s).materialize(np, "float32", cfg.seed)
    opt = AdamW(model.flat, (cfg.beta1, cfg.beta2), cfg.eps, cfg.weight_decay, decay_mask=matrices(model.flat))
    dp = DataParallel(model, opt, MPI.COMM_WORLD, loss=TokenCrossEntropy(), stall_timeout_s=0, stall_abort_s=0)
    loader = BatchLoader(d.train, np, "float32")
    b = cfg.batch_size
    perm = epoch_permutation(len(d.train), cfg.seed, 0)
    times = []
    for step in range(warmup + steps):
        t0 = time.perf_counter()
        x, y = loader.batch(perm[step * b:(step + 1) * b])
        dp.train_step([(x, y)], 1e-3)
        if step >= warmup:
            times.append(time.perf_counter() - t0)
    dp.close()
    med = statistics.median(times)
    return {"framework": "mpisgd", "batch": b, "context": cfg.context, "step_ms_median": 1e3 * med,
            "tokens_per_s": b * cfg.context / med, "steps": steps}


def run(cmd: list[str]) -> dict[str, Any]:
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1",
               PYTHONPATH=ROOT, MPISGD_PLAN_FILE="off")
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    sys.path.insert(0, ROOT)
    from mpisgd.config import at_least  # noqa: PLC0415

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=("compare", "mpisgd"))
    parser.add_argument("--repeats", type=at_least(1), default=5)
    parser.add_argument("--steps", type=at_least(1), default=15)
    parser.add_argument("--warmup", type=at_least(0), default=3)
    args, rest = parser.parse_known_args()
    if "--data" not in rest:
        rest += ["--data", "/usr/local/share/mpisgd/kjv.txt"]
    if args.mode == "mpisgd":
        print(json.dumps(mpisgd_speed(rest, args.steps, args.warmup)))
        return
    timing = ["--steps", str(args.steps), "--warmup", str(args.warmup)]
    ratios = []
    for r in range(args.repeats):
        ours = run([sys.executable, __file__, "mpisgd", *timing, *rest])
        theirs = run([sys.executable, os.path.join(HERE, "gpt_torch.py"), "speed", "--threads", "1", *timing, *rest])
        ratios.append(ours["tokens_per_s"] / theirs["tokens_per_s"])
        print(f"repeat {r + 1}: mpisgd {ours['tokens_per_s']:.0f} tokens/s ({ours['step_ms_median']:.1f} ms/step), "
              f"PyTorch {theirs['tokens_per_s']:.0f} tokens/s ({theirs['step_ms_median']:.1f} ms/step), "
              f"ratio {ratios[-1]:.3f}", flush=True)
    print(json.dumps({"ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
                      "repeats": args.repeats, "batch": ours["batch"], "context": ours["context"]}))


if __name__ == "__main__":
    main()

"""The optimizer state each rank holds, replicated against sharded (ZeRO stage 1), on the default MLP.

    mpiexec -n K python benchmarks/optimizer_state.py [--optimizers sgd,adamw] [--hidden 1024,1024]

For each optimizer: one training step through DataParallel with the sharded step (k >= 2), then the
bytes of the optimizer's own buffers on every rank (``Optimizer.buffer_nbytes``: momentum, Adam's two
moments, the update's scratch) against the replicated step's on one rank. Verified before it is
reported: the ranks' buffers must add up to the replicated step's exactly (the chunks tile the
parameters), and the checkpoint's gathered state must be whole; exit 1 otherwise. Rank 0 prints one
row per optimizer: k, the largest and smallest rank's bytes, the replicated bytes, and the saving.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
from mpi4py import MPI

from mpisgd.data import BatchLoader, synthetic
from mpisgd.nn import Sequential, mlp
from mpisgd.optim import SGD, AdamW, Optimizer
from mpisgd.parallel import DataParallel


def build(kind: str, hidden: tuple[int, ...]) -> tuple[Sequential, Optimizer]:
    model = mlp(hidden).materialize(np, "float32", seed=0)
    assert model.flat is not None
    opt: Optimizer = SGD(model.flat, momentum=0.9) if kind == "sgd" else AdamW(model.flat, weight_decay=1e-4)
    return model, opt


def measure(kind: str, hidden: tuple[int, ...], comm: MPI.Intracomm) -> tuple[list[int], int, bool]:
    """Every rank's optimizer bytes when sharded, the replicated bytes, and whether the gathered state is whole."""
    model, opt = build(kind, hidden)
    dp = DataParallel(model, opt, comm, shard_optimizer=True)
    x, y = BatchLoader(synthetic(64, seed=0), np, "float32").batch(np.arange(32))
    dp.train_step([(x, y)], lr=0.01)
    mine = opt.buffer_nbytes()
    gathered = dp.gather_optimizer_state()
    n = dp.flat.size
    dp.close()
    whole_ok = comm.Get_rank() != 0 or all(buf.shape == (n,) for buf in gathered.values())
    _, ref = build(kind, hidden)
    return comm.allgather(mine), ref.buffer_nbytes(), all(comm.allgather(whole_ok))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--optimizers", default="sgd,adamw", help="comma-separated: sgd (momentum 0.9), adamw")
    p.add_argument("--hidden", default="1024,1024", help="the MLP's hidden widths (default: the CLI's)")
    args = p.parse_args()
    comm = MPI.COMM_WORLD
    k, hidden = comm.Get_size(), tuple(int(h) for h in args.hidden.split(","))
    wrong = 0
    if comm.Get_rank() == 0:
        print(f"# optimizer state per rank, MLP {hidden}, float32; k={k} ({'sharded' if k > 1 else 'one rank'})")
        print(f"{'optimizer':>10} {'k':>3} {'largest MiB':>12} {'smallest MiB':>13} {'replicated MiB':>15} "
              f"{'saving':>7} {'#wrong':>6}")
    for kind in args.optimizers.split(","):
        every, whole, gathered_ok = measure(kind, hidden, comm)
        bad = int(sum(every) != whole) + int(not gathered_ok)
        wrong += bad
        if comm.Get_rank() == 0:
            print(f"{kind:>10} {k:>3} {max(every) / 2**20:>12.2f} {min(every) / 2**20:>13.2f} {whole / 2**20:>15.2f} "
                  f"{1 - max(every) / whole:>7.1%} {bad:>6}")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())

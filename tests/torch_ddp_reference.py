"""What `python -m mpisgd.train --dataset synthetic --model FACTORY --lr-scaling none --decay none` computes,
written as a plain DistributedDataParallel loop over gloo: the same data, order, initial values and SGD with
momentum 0.9. Prints rank 0's per-step losses as JSON (tests/test_torch_cli.py compares them with the CLI's
metrics file).

    mpiexec -n 2 python tests/torch_ddp_reference.py --model torch_factories:tiny_mlp --steps 8 ...
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np
import torch
from mpi4py import MPI
from torch_factories import gloo

from mpisgd.data import BatchLoader, GlobalBatches, epoch_permutation, synthetic
from mpisgd.nn.models import factory


def main() -> None:
    p = argparse.ArgumentParser()
    for name, kind in (("--model", str), ("--samples", int), ("--batch-size", int), ("--lr", float), ("--seed", int),
                       ("--steps", int), ("--dtype", str)):
        p.add_argument(name, type=kind, required=True)
    args = p.parse_args()
    comm = MPI.COMM_WORLD
    k, r = comm.Get_size(), comm.Get_rank()
    torch.set_num_threads(1)
    train = synthetic(args.samples, args.seed)
    in_shape, classes = tuple(train.images.shape[1:]), int(train.labels.max()) + 1
    module = factory(args.model)(in_shape, classes, seed=args.seed).to(getattr(torch, args.dtype))
    gloo(comm)
    model = torch.nn.parallel.DistributedDataParallel(module)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    loader = BatchLoader(train, np, args.dtype)
    batches = GlobalBatches(len(train), k * args.batch_size, r, k)
    losses = []
    for step in range(args.steps):
        epoch, s = divmod(step, batches.steps_per_epoch)
        x, y = loader.batch(batches.indices(epoch_permutation(len(train), args.seed, epoch), s, 0))
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(torch.from_numpy(x.copy())), torch.from_numpy(y.copy()))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    if r == 0:
        print(json.dumps(losses), flush=True)
    # gloo's threads are never joined (tests/torch_factories.py:gloo), and at interpreter teardown their
    # std::thread destructors can abort the process ("terminate called without an active exception", exit
    # 6, about one run in five here): finish MPI, then leave without that teardown
    MPI.Finalize()
    os._exit(0)


if __name__ == "__main__":
    main()

"""A PyTorch loop whose gradients mpisgd averages (CPU): examples/torch_ddp.py, a standard
DistributedDataParallel loop, with five lines changed (docs/torch.md shows the diff), launched with mpiexec:

    mpiexec -n 2 python examples/torch_model.py [--steps 300] [--synthetic]

The MLP of docs/benchmarks.md (784-1024-1024-10, ReLU) on Fashion-MNIST, b = 128 per rank, SGD with momentum
0.9, a DistributedSampler. mpisgd.torch.wrap keeps the parameters and gradients in its flat buffers and
all-reduces the gradients in buckets during backward. Prints rank 0's samples/s over the steps after the
first 20 (and, with --losses, its per-step losses as JSON).
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch
from mpi4py import MPI
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import mpisgd.torch
from mpisgd.data import PIXEL_MEAN, PIXEL_STD, load_fashion_mnist, synthetic


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=128, help="per rank")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--synthetic", action="store_true", help="no Fashion-MNIST needed")
    p.add_argument("--losses", action="store_true", help="print rank 0's per-step losses (JSON)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    comm = MPI.COMM_WORLD
    rank, k = comm.Get_rank(), comm.Get_size()
    train = synthetic(8192) if args.synthetic else load_fashion_mnist()[0]
    x = ((train.images.reshape(len(train), -1) / 255.0 - PIXEL_MEAN) / PIXEL_STD).astype(np.float32)
    data = TensorDataset(torch.from_numpy(x), torch.from_numpy(train.labels))
    sampler: DistributedSampler = DistributedSampler(data, num_replicas=k, rank=rank, seed=0, drop_last=True)
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(784, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024),
                              torch.nn.ReLU(), torch.nn.Linear(1024, 10))
    model = mpisgd.torch.wrap(net, comm)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses: list[float] = []
    t0, epoch = 0.0, 0
    while len(losses) < args.steps:
        sampler.set_epoch(epoch)
        for xb, yb in loader:
            if len(losses) == 20:
                t0 = time.perf_counter()
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(xb), yb)
            loss.backward()
            opt.step()
            losses.append(loss.item())
            if len(losses) == args.steps:
                break
        epoch += 1
    rate = k * (args.steps - 20) * args.batch_size / (time.perf_counter() - t0)
    if rank == 0:
        print(f"step {args.steps}  loss {losses[-1]:.4f} (rank 0's batch)")
        print(f"samples/s {rate:.0f} with k={k} (torch threads per rank: {args.threads})")
        if args.losses:
            print(json.dumps(losses))


if __name__ == "__main__":
    main()

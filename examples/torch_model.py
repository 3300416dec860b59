"""A PyTorch (CPU) model whose gradients mpisgd averages: PyTorch computes, mpisgd synchronises.

    mpiexec -n 2 python examples/torch_model.py [--steps 300] [--synthetic] [--threads 1]

The same MLP as `benchmarks/baselines.py torch-ddp` (784-1024-1024-10, ReLU, b = 128 per rank, SGD with
momentum 0.9), so that the two compare: DistributedDataParallel averages the gradients over gloo,
here mpisgd.GradientAverager does, through the tensors' own memory (DLPack, no copy). Prints the
samples/s of the steps after the first 20.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from mpi4py import MPI

import mpisgd
from mpisgd.data import PIXEL_MEAN, PIXEL_STD, load_fashion_mnist, synthetic


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=128, help="per rank")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--synthetic", action="store_true", help="no Fashion-MNIST needed")
    args = p.parse_args()
    comm = MPI.COMM_WORLD
    k, r = comm.Get_size(), comm.Get_rank()
    torch.set_num_threads(args.threads)
    with mpisgd.guard(comm):
        train = synthetic(8192) if args.synthetic else load_fashion_mnist()[0]
        x_all = torch.from_numpy(((train.images.reshape(len(train), -1) / 255.0 - PIXEL_MEAN) / PIXEL_STD)
                                 .astype(np.float32))
        y_all = torch.from_numpy(train.labels)
        model = torch.nn.Sequential(torch.nn.Linear(784, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024),
                                    torch.nn.ReLU(), torch.nn.Linear(1024, 10))
        mpisgd.broadcast_([q.data for q in model.parameters()], comm)  # every rank starts from rank 0's weights
        average = mpisgd.GradientAverager(comm)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        n = k * args.batch_size
        for step in range(args.steps):
            if step == 20:
                t0 = time.perf_counter()
            lo = (step * n) % (len(y_all) - n) + r * args.batch_size  # this rank's share of global batch `step`
            x, y = x_all[lo:lo + args.batch_size], y_all[lo:lo + args.batch_size]
            opt.zero_grad(set_to_none=False)  # the same gradient tensors every step
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            average.average_([q.grad for q in model.parameters()])  # in place: the mean over ranks
            opt.step()
            if r == 0 and step % 100 == 0:
                print(f"step {step:4d}  loss {loss.item():.4f} (this rank's batch)")
        rate = comm.allreduce((args.steps - 20) * args.batch_size / (time.perf_counter() - t0))
        average.close()
        if r == 0:
            print(f"samples/s {rate:.0f} with k={k} (torch threads per rank: {args.threads})")


if __name__ == "__main__":
    main()

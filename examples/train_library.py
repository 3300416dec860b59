"""mpisgd as a library: your own loop, Horovod-style.

    mpiexec -n 2 python examples/train_library.py [--steps 200] [--synthetic]

Each rank trains a replica on its share of every global batch; DataParallel
averages the gradients over the ranks before the identical SGD step.
"""

from __future__ import annotations

import argparse

import numpy as np
from mpi4py import MPI

import mpisgd
from mpisgd.config import at_least
from mpisgd.data import BatchLoader, GlobalBatches, epoch_permutation, load_fashion_mnist, synthetic


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=at_least(1), default=200)
    parser.add_argument("--batch-size", type=at_least(1), default=64, help="per rank")
    parser.add_argument("--synthetic", action="store_true", help="no Fashion-MNIST needed")
    args = parser.parse_args()

    ctx = mpisgd.init(MPI.COMM_WORLD, device="auto")  # node layout, GPU binding (local_rank % n_gpus)
    train, test = (synthetic(4096), synthetic(1000, split=1)) if args.synthetic else load_fashion_mnist()[:2]

    model = mpisgd.nn.mlp((256,)).materialize(ctx.xp, "float32", seed=0)
    optimizer = mpisgd.SGD(model.flat, momentum=0.9)
    dp = mpisgd.DataParallel(model, optimizer, ctx.comm)  # checks every rank built the same model, broadcasts rank 0's

    batches = GlobalBatches(len(train), ctx.size * args.batch_size, ctx.rank, ctx.size)
    schedule = mpisgd.Schedule(base_lr=0.1, peak_lr=mpisgd.scaled_lr(0.1, 256, ctx.size * args.batch_size, "linear"),
                               warmup_steps=0, total_steps=args.steps, decay="cosine")
    loader = BatchLoader(train, ctx.xp, "float32")
    for step in range(args.steps):
        epoch, pos = divmod(step, batches.steps_per_epoch)
        perm = epoch_permutation(len(train), seed=0, epoch=epoch)
        loss = dp.train_step([loader.batch(batches.indices(perm, pos, 0))], lr=schedule(step))
        if ctx.rank == 0 and step % 50 == 0:  # loss: this rank's batch (the gradient is averaged, the loss not)
            print(f"step {step:4d}  loss {float(loss):.4f}  lr {schedule(step):.4f}")
    dp.check_replicas()  # collective: raises on every rank if any replica drifted

    # evaluation: each rank scores part of the test set, the counts are summed
    mine = np.array_split(np.arange(len(test)), ctx.size)[ctx.rank]
    x, y = BatchLoader(test, ctx.xp, "float32").batch(mine)
    correct = ctx.comm.allreduce(mpisgd.nn.accuracy_count(model.forward(x), y))
    if ctx.rank == 0:
        print(f"test accuracy {correct / len(test):.4f} with k={ctx.size} ranks")
    dp.close()


if __name__ == "__main__":
    with mpisgd.guard(MPI.COMM_WORLD):  # an exception on one rank ends the job instead of hanging the others
        main()

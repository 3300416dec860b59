"""A model written by hand in NumPy (no mpisgd.nn), trained data-parallel with mpisgd's array API.

    mpiexec -n 2 python examples/numpy_model.py [--steps 300] [--synthetic]

mpisgd.broadcast_ gives every rank rank 0's initial weights; mpisgd.GradientAverager averages the
gradients over the ranks; every rank then takes the same step. mpisgd.guard ends the whole job if one
rank fails. The model: one hidden layer of 128 ReLUs and a softmax, its gradients written out below.
"""

from __future__ import annotations

import argparse
import hashlib

import numpy as np
from mpi4py import MPI

import mpisgd
from mpisgd.config import at_least
from mpisgd.data import load_fashion_mnist, synthetic


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=at_least(1), default=300)
    p.add_argument("--batch-size", type=at_least(1), default=64, help="per rank")
    p.add_argument("--synthetic", action="store_true", help="no Fashion-MNIST needed")
    args = p.parse_args()
    comm = MPI.COMM_WORLD
    k, r = comm.Get_size(), comm.Get_rank()
    with mpisgd.guard(comm):
        train = synthetic(4096) if args.synthetic else load_fashion_mnist()[0]
        x_all, y_all = (train.images.reshape(len(train), -1) / 255.0 - 0.286) / 0.353, train.labels  # standardised
        rng = np.random.default_rng(r)  # different on every rank: broadcast_ makes them rank 0's
        W1, b1 = rng.normal(0, 0.05, (784, 128)), np.zeros(128)
        W2, b2 = rng.normal(0, 0.05, (128, 10)), np.zeros(10)
        params = [W1, b1, W2, b2]
        mpisgd.broadcast_(params, comm)
        average = mpisgd.GradientAverager(comm)
        for step in range(args.steps):
            # global batch `step` (k * b samples, the same order on every rank); this rank takes its share
            idx = np.random.default_rng(step).choice(len(y_all), k * args.batch_size, replace=False)
            x, y = x_all[idx[r::k]], y_all[idx[r::k]]
            h = np.maximum(x @ W1 + b1, 0)
            z = h @ W2 + b2
            p_ = np.exp(z - z.max(axis=1, keepdims=True))
            p_ /= p_.sum(axis=1, keepdims=True)
            loss = -np.log(p_[np.arange(len(y)), y]).mean()
            dz = p_
            dz[np.arange(len(y)), y] -= 1
            dz /= len(y)
            dh = (dz @ W2.T) * (h > 0)
            grads = [x.T @ dh, dh.sum(axis=0), h.T @ dz, dz.sum(axis=0)]
            average.average_(grads)  # the mean over ranks: every rank now holds the same gradient
            for w, g in zip(params, grads):
                w -= 0.1 * g
            if r == 0 and step % 100 == 0:
                print(f"step {step:4d}  loss {loss:.4f} (this rank's batch)")
        average.close()
        digest = hashlib.sha256(b"".join(w.tobytes() for w in params)).hexdigest()
        assert len(set(comm.allgather(digest))) == 1, "the replicas differ"
        correct = np.count_nonzero((np.maximum(x_all[:2000] @ W1 + b1, 0) @ W2 + b2).argmax(axis=1) == y_all[:2000])
        if r == 0:
            print(f"training accuracy on 2,000 samples {correct / 2000:.3f} with k={k}; replicas identical")


if __name__ == "__main__":
    main()

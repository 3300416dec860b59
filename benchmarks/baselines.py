"""The obvious alternatives to mpisgd, on the reference workload, for side-by-side comparison.

    python benchmarks/baselines.py numpy --threads 1|2      # a plain one-process NumPy training loop
    mpiexec -n 2 python benchmarks/baselines.py torch-ddp   # PyTorch DDP, gloo, CPU (needs torch)
    python benchmarks/baselines.py numpy --device gpu       # the same loop on CuPy arrays
    mpiexec -n 2 python benchmarks/baselines.py torch-ddp --device gpu   # DDP on CUDA

Workload: Fashion-MNIST, MLP 784-H-H-10 (ReLU, softmax cross-entropy,
float32), SGD momentum 0.9, batch 128 per process. Prints one JSON line:
samples_per_s over one timed epoch after a warm-up of --warmup-steps steps.
On a GPU, DDP uses NCCL when every rank has a GPU of its own and gloo when
ranks share one (NCCL refuses two ranks on one device).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np


def load(limit: int | None) -> tuple[np.ndarray, np.ndarray]:
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from mpisgd.data import PIXEL_MEAN, PIXEL_STD, load_fashion_mnist

    train, _, _ = load_fashion_mnist(None)
    n = limit or len(train)
    x = ((train.images[:n].reshape(n, -1).astype(np.float32) / 255) - PIXEL_MEAN) / PIXEL_STD
    return x, train.labels[:n]


def numpy_loop(args: argparse.Namespace) -> dict:
    """What a careful user writes by hand: plain NumPy (or, on a GPU, CuPy) expressions, no framework."""
    from threadpoolctl import threadpool_limits

    threadpool_limits(args.threads)
    x, y = load(args.limit)
    if args.device == "gpu":
        import cupy as xp  # noqa: PLC0415 - GPU runs only

        x, y = xp.asarray(x), xp.asarray(y)
        sync = xp.cuda.Device().synchronize
    else:
        xp, sync = np, lambda: None
    rng = np.random.default_rng(0)
    sizes = [784, *args.hidden, 10]
    params = []
    for a, b in zip(sizes[:-1], sizes[1:]):
        params += [xp.asarray(rng.uniform(-np.sqrt(6 / a), np.sqrt(6 / a), (a, b)).astype(np.float32)),
                   xp.zeros(b, np.float32)]
    vel = [xp.zeros_like(p) for p in params]
    bsz, lr, mu = args.batch_size, 0.05, 0.9
    steps = len(x) // bsz

    def step(idx: np.ndarray) -> None:
        h = [x[idx]]
        for i in range(0, len(params) - 2, 2):
            h.append(xp.maximum(h[-1] @ params[i] + params[i + 1], 0))
        logits = h[-1] @ params[-2] + params[-1]
        p = xp.exp(logits - logits.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        p[xp.arange(len(idx)), y[idx]] -= 1
        d = p / len(idx)
        grads = [None] * len(params)
        for i in range(len(params) - 2, -1, -2):
            grads[i], grads[i + 1] = h[i // 2].T @ d, d.sum(0)
            if i:
                d = (d @ params[i].T) * (h[i // 2] > 0)
        for p_, v, g in zip(params, vel, grads):
            v *= mu
            v += g
            p_ -= lr * v

    perm = xp.asarray(np.random.default_rng(1).permutation(len(x)))
    for s in range(args.warmup_steps):
        step(perm[s * bsz:(s + 1) * bsz])
    sync()
    t0 = time.perf_counter()
    for s in range(steps):
        step(perm[s * bsz:(s + 1) * bsz])
    sync()
    dt = time.perf_counter() - t0
    impl = "cupy-loop" if args.device == "gpu" else f"numpy-loop-{args.threads}t"
    return {"impl": impl, "k": 1, "samples_per_s": steps * bsz / dt, "step_ms": 1e3 * dt / steps}


def torch_ddp(args: argparse.Namespace) -> dict:
    """PyTorch DistributedDataParallel: gloo on CPU; on a GPU, NCCL (gloo where ranks share a GPU)."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, k = comm.Get_rank(), comm.Get_size()
    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    local_rank, local_size = local.Get_rank(), local.Get_size()
    local.Free()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(comm.bcast(29500 + os.getpid() % 1000, root=0)))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(args.threads)
    if args.device == "gpu":
        ngpu = torch.cuda.device_count()
        dev = torch.device("cuda", local_rank % ngpu)
        torch.cuda.set_device(dev)
        backend = "nccl" if local_size <= ngpu else "gloo"  # NCCL: one GPU per rank
        sync = torch.cuda.synchronize
    else:
        dev, backend, sync = torch.device("cpu"), "gloo", lambda: None
    dist.init_process_group(backend, rank=rank, world_size=k)
    x, y = load(args.limit)
    xt, yt = torch.from_numpy(x).to(dev), torch.from_numpy(y).to(dev)
    torch.manual_seed(0)
    layers: list = []
    sizes = [784, *args.hidden, 10]
    for a, b in zip(sizes[:-1], sizes[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    model = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Sequential(*layers[:-1]).to(dev), device_ids=[dev.index] if dev.type == "cuda" else None)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    bsz = args.batch_size
    steps = len(x) // (bsz * k)
    perm = torch.from_numpy(np.random.default_rng(1).permutation(len(x))).to(dev)

    def step(s: int) -> None:
        idx = perm[(s * k + rank) * bsz:(s * k + rank + 1) * bsz]
        opt.zero_grad(set_to_none=False)
        loss_fn(model(xt[idx]), yt[idx]).backward()
        opt.step()

    for s in range(args.warmup_steps):
        step(s % steps)
    sync()
    comm.Barrier()
    t0 = time.perf_counter()
    for s in range(steps):
        step(s)
    sync()
    comm.Barrier()
    dt = time.perf_counter() - t0
    dist.destroy_process_group()
    return {"impl": f"torch-ddp-{backend}", "k": k, "samples_per_s": steps * bsz * k / dt, "step_ms": 1e3 * dt / steps,
            "rank": rank}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("impl", choices=["numpy", "torch-ddp"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--hidden", type=lambda s: tuple(map(int, s.split(","))), default=(1024, 1024))
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--warmup-steps", type=int, default=20)
    parser.add_argument("--limit", type=int, default=None, help="use only the first N training samples")
    parser.add_argument("--device", choices=["cpu", "gpu"], default="cpu")
    args = parser.parse_args()
    result = numpy_loop(args) if args.impl == "numpy" else torch_ddp(args)
    from mpisgd.report import peak_rss_mib  # noqa: PLC0415

    result["peak_rss_mib"] = peak_rss_mib()  # rank 0's (DDP ranks hold the same)
    if result.pop("rank", 0) == 0:
        print(json.dumps(result))


if __name__ == "__main__":
    main()

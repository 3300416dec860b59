"""The obvious alternatives to mpisgd, on the reference workloads, for side-by-side comparison.

    python benchmarks/baselines.py numpy --threads 1|2      # a plain one-process NumPy training loop (MLP)
    python benchmarks/baselines.py torch [--model cnn|resnet]   # PyTorch, one process, CPU (needs torch)
    mpiexec -n 2 python benchmarks/baselines.py torch-ddp [--model cnn]   # PyTorch DDP, gloo, CPU
    mpiexec -n 2 python benchmarks/baselines.py torch-mpisgd [--model resnet]   # the same loop, mpisgd.torch.wrap
    python benchmarks/baselines.py numpy --device gpu       # the same loop on CuPy arrays
    python benchmarks/baselines.py side-by-side --model resnet [--steps 40]   # mpisgd and PyTorch, alternating
    mpiexec -n 2 python benchmarks/baselines.py torch-ddp --device gpu   # DDP on CUDA

Workloads: Fashion-MNIST, float32, softmax cross-entropy, SGD momentum 0.9,
batch 128 per process; --model mlp (default): MLP 784-H-H-10, ReLU; --model
cnn: LeNet-5 as mpisgd's (conv 6@5x5 pad 2, max-pool 2, conv 16@5x5, max-pool
2, 120, 84, 10, ReLU); --model resnet: ResNet-20 as mpisgd's (conv 3x3 to 16,
three stages of three basic blocks with BatchNorm at 16, 32, 64 channels,
1x1 projection shortcuts, global average pooling, 10); --model gpt:
examples/torch_models.py's small GPT-style decoder over image rows; NCHW,
PyTorch's own CPU kernels (oneDNN), train mode. `torch-mpisgd` is the
`torch-ddp` loop with DistributedDataParallel replaced by mpisgd.torch.wrap (no
process group; the same data, order, model and optimizer). The NumPy loop is the
MLP only. Prints one JSON line: samples_per_s over one timed epoch
after a warm-up of --warmup-steps steps. On a GPU, DDP uses NCCL when every
rank has a GPU of its own and gloo when ranks share one (NCCL refuses two ranks
on one device).

`side-by-side` times mpisgd's training step (its model, SoftmaxCrossEntropy and
SGD on the flat buffers: what one rank computes) and PyTorch's (zero_grad,
forward, loss, backward, SGD) in one process on one thread each, alternately,
step after step, on the same batches: each pair runs a second apart, so a
machine shared with others slows both alike. Every step is timed with the wall
clock and with the thread's CPU clock (time.thread_time, which leaves out the
time the process waits for a core; it counts this thread only, so it is the
step's whole cost at --threads 1); the JSON line gives both sides' median
step, samples/s and the ratio mpisgd/PyTorch of samples/s per pair (median, its
95 % bootstrap interval, min and max).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

TORCH_HINT = "needs PyTorch: pip install torch (the CPU build is enough)"


def load(limit: int | None, model: str = "mlp") -> tuple[np.ndarray, np.ndarray]:
    """Standardised training images, flat (MLP) or NCHW (N, 1, 28, 28) (the others), and their labels."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from mpisgd.data import PIXEL_MEAN, PIXEL_STD, load_fashion_mnist

    train, _, _ = load_fashion_mnist(None)
    n = limit or len(train)
    x = ((train.images[:n].reshape(n, -1).astype(np.float32) / 255) - PIXEL_MEAN) / PIXEL_STD
    return (x.reshape(n, 1, 28, 28) if model != "mlp" else x), train.labels[:n]


def torch_resnet(torch: object, in_channels: int = 1, n_classes: int = 10, blocks: int = 3,
                 widths: tuple[int, ...] = (16, 32, 64)) -> object:
    """ResNet-20 (blocks = 3) as PyTorch users write it: mpisgd.nn.resnet's network, its parameters in the same
    order (tests/test_resnet.py checks they compute alike)."""
    nn = torch.nn  # type: ignore[attr-defined]

    class Block(nn.Module):  # type: ignore[name-defined,misc]
        def __init__(self, c_in: int, c_out: int, stride: int) -> None:
            super().__init__()
            self.c1, self.b1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False), nn.BatchNorm2d(c_out)
            self.c2, self.b2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False), nn.BatchNorm2d(c_out)
            self.sc = nn.Sequential() if stride == 1 and c_in == c_out else \
                nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))

        def forward(self, x: object) -> object:
            return torch.relu(self.b2(self.c2(torch.relu(self.b1(self.c1(x))))) + self.sc(x))  # type: ignore

    layers = [nn.Conv2d(in_channels, widths[0], 3, 1, 1, bias=False), nn.BatchNorm2d(widths[0]), nn.ReLU()]
    c = widths[0]
    for i, w in enumerate(widths):
        for j in range(blocks):
            layers.append(Block(c, w, 2 if i > 0 and j == 0 else 1))
            c = w
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, n_classes))


def torch_model(torch: object, args: argparse.Namespace) -> object:
    """The workload's model in PyTorch: the MLP, LeNet-5 (conv-ReLU-pool, as usually written), ResNet-20, or
    examples/torch_models.py's GPT."""
    nn = torch.nn  # type: ignore[attr-defined]
    if args.model == "resnet":
        return torch_resnet(torch)
    if args.model == "gpt":
        sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
        from examples import torch_models  # noqa: PLC0415 - torch runs only

        return torch_models.gpt((1, 28, 28), 10)
    if args.model == "cnn":
        return nn.Sequential(nn.Conv2d(1, 6, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
                             nn.Conv2d(6, 16, 5), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                             nn.Linear(400, 120), nn.ReLU(), nn.Linear(120, 84), nn.ReLU(), nn.Linear(84, 10))
    layers: list = []
    sizes = [784, *args.hidden, 10]
    for a, b in zip(sizes[:-1], sizes[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


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
    return {"impl": impl, "k": 1, "samples_per_s": steps * bsz / dt, "step_ms": 1e3 * dt / steps, "steps": steps}


def torch_loop(args: argparse.Namespace, model: object, dev: object, rank: int, k: int, sync: object,
               barrier: object) -> tuple[float, int]:
    """Train one timed epoch (after the warm-up); rank ``rank`` of ``k`` takes its share of each global
    batch. Returns the seconds and the steps. With --profile N, N more steps run under torch.profiler
    and rank 0 prints its per-operator table to stderr."""
    import torch

    x, y = load(args.limit, args.model)
    xt, yt = torch.from_numpy(x).to(dev), torch.from_numpy(y).to(dev)
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
    barrier()
    t0 = time.perf_counter()
    for s in range(steps):
        step(s)
    sync()
    barrier()
    dt = time.perf_counter() - t0
    if args.profile:
        from torch.profiler import profile  # noqa: PLC0415

        with profile() as prof:
            for s in range(args.profile):
                step(s % steps)
        if rank == 0:
            print(f"torch.profiler, {args.profile} steps (self times are per operator, over all steps):",
                  file=sys.stderr)
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20), file=sys.stderr)
    return dt, steps


def torch_single(args: argparse.Namespace) -> dict:
    """PyTorch in one process, no DDP: what the speed issue's k=1 targets compare against."""
    import torch

    torch.set_num_threads(args.threads)
    if args.device == "gpu":
        dev, sync = torch.device("cuda", 0), torch.cuda.synchronize
    else:
        dev, sync = torch.device("cpu"), lambda: None
    torch.manual_seed(0)
    model = torch_model(torch, args).to(dev)
    dt, steps = torch_loop(args, model, dev, 0, 1, sync, lambda: None)
    return {"impl": f"torch-{dev.type}", "k": 1, "samples_per_s": steps * args.batch_size / dt,
            "step_ms": 1e3 * dt / steps, "steps": steps}


def free_port() -> int:
    """A TCP port nobody listens on now (the system's choice for a bind to port 0)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def torch_ddp(args: argparse.Namespace) -> dict:
    """PyTorch DistributedDataParallel: gloo on CPU; on a GPU, NCCL (gloo where ranks share a GPU)."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, k = comm.Get_rank(), comm.Get_size()
    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    local_rank, local_size = local.Get_rank(), local.Get_size()
    local.Free()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    port = comm.bcast(free_port() if rank == 0 else None, root=0)  # every rank: a collective
    os.environ.setdefault("MASTER_PORT", str(port))  # free now on rank 0's host: two benchmarks may run at once
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
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(
        torch_model(torch, args).to(dev), device_ids=[dev.index] if dev.type == "cuda" else None)
    dt, steps = torch_loop(args, model, dev, rank, k, sync, comm.Barrier)
    dist.destroy_process_group()
    return {"impl": f"torch-ddp-{backend}", "k": k, "samples_per_s": steps * args.batch_size * k / dt,
            "step_ms": 1e3 * dt / steps, "steps": steps, "rank": rank}


def side_by_side(args: argparse.Namespace) -> dict:
    """mpisgd's and PyTorch's training steps alternately, one thread each, on the same batches."""
    import torch
    from threadpoolctl import threadpool_limits

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from mpisgd.nn import SoftmaxCrossEntropy, build_model
    from mpisgd.optim import SGD

    threadpool_limits(args.threads)
    torch.set_num_threads(args.threads)
    x, y = load(args.limit, args.model)
    b = args.batch_size
    model = build_model(args.model, tuple(x.shape[1:]), 10, args.hidden).materialize(np, "float32", seed=0)
    opt, loss = SGD(model.flat, momentum=0.9), SoftmaxCrossEntropy()
    torch.manual_seed(0)
    net = torch_model(torch, args)
    t_opt, t_loss = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9), torch.nn.CrossEntropyLoss()
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    perm = np.random.default_rng(1).permutation(len(x))
    steps = len(x) // b

    def ours(s: int) -> None:
        idx = np.sort(perm[(s % steps) * b:(s % steps + 1) * b])
        loss.forward_array(model.forward(x[idx]), y[idx])
        model.backward(loss.backward(1.0 / b))
        opt.step(0.05)

    def theirs(s: int) -> None:
        idx = torch.from_numpy(np.sort(perm[(s % steps) * b:(s % steps + 1) * b]))
        t_opt.zero_grad(set_to_none=False)
        t_loss(net(xt[idx]), yt[idx]).backward()
        t_opt.step()

    for s in range(args.warmup_steps):
        ours(s)
        theirs(s)
    wall: dict[str, list[float]] = {"mpisgd": [], "torch": []}
    cpu: dict[str, list[float]] = {"mpisgd": [], "torch": []}
    for s in range(args.steps):
        for name, step in (("mpisgd", ours), ("torch", theirs))[::1 if s % 2 == 0 else -1]:  # who goes first alternates
            w0, c0 = time.perf_counter(), time.thread_time()
            step(s)
            wall[name].append(time.perf_counter() - w0)
            cpu[name].append(time.thread_time() - c0)
    out: dict = {"impl": "side-by-side", "model": args.model, "batch": b, "threads": args.threads, "steps": args.steps,
                 "load_1min": os.getloadavg()[0]}
    for clock, times in (("cpu", cpu), ("wall", wall)):
        ratios = [t / m for m, t in zip(times["mpisgd"], times["torch"])]  # samples/s ratio of each pair
        lo, hi = median_ci(ratios)
        out[clock] = {"mpisgd_step_ms": 1e3 * float(np.median(times["mpisgd"])),
                      "torch_step_ms": 1e3 * float(np.median(times["torch"])),
                      "mpisgd_samples_per_s": b / float(np.median(times["mpisgd"])),
                      "torch_samples_per_s": b / float(np.median(times["torch"])),
                      "ratio_median": float(np.median(ratios)), "ratio_ci95": [lo, hi],
                      "ratio_min": float(min(ratios)), "ratio_max": float(max(ratios))}
    return out


def median_ci(values: list[float], level: float = 0.95, resamples: int = 4000) -> tuple[float, float]:
    """Percentile bootstrap interval of the median."""
    rng = np.random.default_rng(0)
    meds = np.sort(np.median(rng.choice(values, (resamples, len(values))), axis=1))
    tail = (1 - level) / 2
    return float(meds[int(tail * (resamples - 1))]), float(meds[int((1 - tail) * (resamples - 1) + 0.5)])


def torch_mpisgd(args: argparse.Namespace) -> dict:
    """torch_ddp's loop with mpisgd.torch.wrap in place of DistributedDataParallel (CPU)."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, k = comm.Get_rank(), comm.Get_size()
    import torch

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    import mpisgd.torch  # noqa: PLC0415

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = mpisgd.torch.wrap(torch_model(torch, args), comm)
    dt, steps = torch_loop(args, model, torch.device("cpu"), rank, k, lambda: None, comm.Barrier)
    model.close()
    return {"impl": "torch-mpisgd", "k": k, "samples_per_s": steps * args.batch_size * k / dt,
            "step_ms": 1e3 * dt / steps, "steps": steps, "rank": rank}


def torch_missing() -> str | None:
    """Why torch cannot be used here, or None when it imports."""
    try:
        import torch  # noqa: F401
    except Exception as exc:  # ImportError, or a broken install (a CUDA build without its libraries)
        return f"{type(exc).__name__}: {exc}"
    return None


def main() -> None:
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from mpisgd.config import at_least  # noqa: PLC0415

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("impl", choices=["numpy", "torch", "torch-ddp", "torch-mpisgd", "side-by-side"])
    parser.add_argument("--model", choices=["mlp", "cnn", "resnet", "gpt"], default="mlp")
    parser.add_argument("--threads", type=at_least(1), default=1)
    parser.add_argument("--hidden", type=lambda s: tuple(map(int, s.split(","))), default=(1024, 1024))
    parser.add_argument("--batch-size", type=at_least(1), default=128)
    parser.add_argument("--warmup-steps", type=at_least(0), default=20)
    parser.add_argument("--limit", type=at_least(1), default=None, help="use only the first N training samples")
    parser.add_argument("--device", choices=["cpu", "gpu"], default="cpu")
    parser.add_argument("--steps", type=at_least(1), default=40, help="side-by-side: the timed pairs of steps")
    parser.add_argument("--profile", type=at_least(0), default=0, metavar="N",
                        help="torch, torch-ddp: then N steps under torch.profiler, its table on stderr")
    args = parser.parse_args()
    # under mpiexec every rank gets here: only the first one speaks
    first = int(os.environ.get("PMI_RANK") or os.environ.get("OMPI_COMM_WORLD_RANK") or 0) == 0
    if args.impl == "numpy" and args.model != "mlp":
        if first:
            print(f"baselines.py numpy: the hand-written loop is the MLP only, not --model {args.model}",
                  file=sys.stderr)
        sys.exit(2)
    if args.impl.startswith("torch") or args.impl == "side-by-side":
        why = torch_missing()
        if why:
            if first:
                print(f"baselines.py {args.impl} {TORCH_HINT} ({why})", file=sys.stderr)
            sys.exit(2)
    if args.impl == "torch-mpisgd" and args.device != "cpu":
        if first:
            print("baselines.py torch-mpisgd: CPU only here (mpisgd.torch.wrap on CUDA tensors is untested)",
                  file=sys.stderr)
        sys.exit(2)
    run = {"numpy": numpy_loop, "torch": torch_single, "torch-ddp": torch_ddp, "torch-mpisgd": torch_mpisgd,
           "side-by-side": side_by_side}[args.impl]
    result = run(args)
    from mpisgd.backend import peak_rss_mib  # noqa: PLC0415

    result["peak_rss_mib"] = peak_rss_mib()  # rank 0's (DDP ranks hold the same)
    if result.pop("rank", 0) == 0:
        print(json.dumps(result))


if __name__ == "__main__":
    main()

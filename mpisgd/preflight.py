"""Checks before any work: what would otherwise fail after hours of training, or hang a collective.

Each check raises UsageError naming the problem; the trainer runs it on every rank through
``context.agree``, so that every rank stops together, exit 2, before the first step.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mpisgd.config import Config, UsageError
from mpisgd.data import available_bytes
from mpisgd.files import check_output_dir, check_output_file


def same_options(cfg: Config, comm: Any) -> None:
    """Every rank runs the same options (collective); names the options and ranks that differ."""
    if len(set(comm.allgather(cfg.digest()))) == 1:
        return
    configs = comm.allgather(cfg.to_dict())
    diffs = []
    for key in configs[0]:
        values = [c.get(key) for c in configs]
        odd = [r for r, v in enumerate(values) if v != values[0]]
        if odd:
            diffs.append(f"--{key.replace('_', '-')} is {values[0]!r} on rank 0 but "
                         + ", ".join(f"{values[r]!r} on rank {r}" for r in odd))
    raise UsageError("ranks were started with different options: " + "; ".join(diffs))


def device_options(cfg: Config, gpu: bool) -> None:
    if cfg.shard_optimizer and gpu:
        raise UsageError("--shard-optimizer runs on the CPU only (its all-gather takes host buffers); "
                         "drop it or pass --device cpu")


def outputs(cfg: Config, rank: int) -> None:
    """Every file this rank will write can be written: found now, not after the training."""
    if cfg.timeline:
        check_output_file(f"{cfg.timeline}.rank{rank}.json", "--timeline")
    if rank != 0:
        return
    if cfg.checkpoint_dir:
        check_output_dir(cfg.checkpoint_dir, "--checkpoint-dir")
    for path, what in ((cfg.save_model, "--save-model"), (cfg.metrics_file, "--metrics-file")):
        if path:
            check_output_file(path, what)


def same_data(identity: dict[str, Any], comm: Any) -> None:
    """Every rank trains on the same data (collective): different sets would end one rank's epoch
    early and leave the others waiting in a collective."""
    every = comm.allgather(identity)
    odd = [r for r, d in enumerate(every) if d != every[0]]
    if odd:
        raise UsageError(f"ranks {odd} loaded other data than rank 0 (rank 0: {every[0]}; rank {odd[0]}: "
                         f"{every[odd[0]]}): give every rank the same data set")


def memory(model: Any, dtype: str, data_nbytes: int, ranks_here: int) -> None:
    """A model that cannot fit is refused with an estimate, not a MemoryError on every rank (host memory;
    before the model is materialised). ``data_nbytes``: the data this rank holds in its own memory
    (data.resident_nbytes: a memory-mapped set is the page cache's, shared by the node's ranks and read
    as needed, so it does not count)."""
    n_params = sum(int(np.prod(shape)) for layer in model.layers for _, shape in layer.param_shapes)
    state = 3 * n_params * np.dtype(dtype).itemsize  # parameters, gradients, momentum
    need = state + data_nbytes
    available = available_bytes() / max(1, ranks_here)
    if need > 0.9 * available:
        data_part = f", {data_nbytes / 2**30:.1f} GiB for the data it holds" if data_nbytes >= 2**29 else ""
        raise UsageError(f"the run needs at least {need / 2**30:.1f} GiB per rank ({n_params:,} parameters: "
                         f"{state / 2**30:.1f} GiB for them, their gradients and momentum, before activations"
                         f"{data_part}), but this node has {available / 2**30:.1f} GiB available per rank "
                         f"({ranks_here} rank(s) here); use a smaller model or fewer ranks per node"
                         + ("" if not data_part else ", or a directory of .npy files (memory-mapped, shared)"))

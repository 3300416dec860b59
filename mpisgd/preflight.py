"""Checks before any work: what would otherwise fail after hours of training, or hang a collective.

Each check raises UsageError naming the problem; set-up (mpisgd.run) runs it on every rank through
``agreement.agree``, so that every rank stops together, exit 2, before the first step.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from mpisgd.agreement import name_differences
from mpisgd.config import Config, UsageError
from mpisgd.files import check_output_dir, check_output_file


def same_options(cfg: Config, comm: Any) -> None:
    """Every rank runs the same options (collective); names the options and ranks that differ."""
    if len(set(comm.allgather(cfg.digest()))) == 1:
        return
    diffs = name_differences(comm.allgather(cfg.to_dict()), flag=True)
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
    diffs = name_differences(every)
    if diffs:
        raise UsageError("ranks loaded different data (" + "; ".join(diffs) + "): give every rank the same data set")


def memory(model: Any, dtype: str, data_nbytes: int, ranks_here: int) -> None:
    """A model that cannot fit is refused with an estimate, not a MemoryError on every rank (host memory;
    before the model is materialised)."""
    n_params = sum(int(np.prod(shape)) for layer in model.layers for _, shape in layer.param_shapes)
    state = 3 * n_params * np.dtype(dtype).itemsize  # parameters, gradients, momentum
    need = state + data_nbytes
    available = _available_bytes() / max(1, ranks_here)
    if need > 0.9 * available:
        raise UsageError(f"the run needs at least {need / 2**30:.1f} GiB per rank ({n_params:,} parameters: "
                         f"{state / 2**30:.1f} GiB for them, their gradients and momentum, before activations), "
                         f"but this node has {available / 2**30:.1f} GiB available per rank "
                         f"({ranks_here} rank(s) here); use a smaller model or fewer ranks per node")


def _available_bytes() -> float:
    """Memory the node can still give (MemAvailable), or all of it where /proc does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))

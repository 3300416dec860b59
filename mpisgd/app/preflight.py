"""Checks before any work: what would otherwise fail after hours of training, or hang a collective.

Each check raises UsageError naming the problem; set-up (mpisgd.app.run) runs it on every rank through
``agreement.agree``, so that every rank stops together, exit 2, before the first step.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import IO, Any

import numpy as np

from mpisgd import model_file
from mpisgd.agreement import differing_ranks, name_differences
from mpisgd.app import run_files
from mpisgd.app.resume import structure_difference
from mpisgd.checkpoint import is_run_file
from mpisgd.config import Config
from mpisgd.data import available_bytes, input_files
from mpisgd.errors import UsageError
from mpisgd.files import check_output_dir, check_output_file, replaceable
from mpisgd.nn.module import parameter_shapes


def same_options(cfg: Config, comm: Any) -> None:
    """Every rank runs the same options (collective); names the options and ranks that differ."""
    if len(set(comm.allgather(cfg.digest()))) == 1:
        return
    diffs = name_differences(comm.allgather(cfg.to_dict()), flag=True)
    raise UsageError("ranks were started with different options: " + "; ".join(diffs))


def same_arithmetic(environment: dict[str, Any], keys: tuple[str, ...], comm: Any, what: str) -> None:
    """Every rank computes with the same arithmetic facts (collective): ``keys`` of mpisgd.backend.environment,
    those ``what`` depends on. Names the ranks and the settings that differ."""
    mine = {k: environment.get(k) for k in keys}
    diffs = name_differences(comm.allgather(mine))
    if diffs:
        raise UsageError(f"ranks compute with different arithmetic, so {what} cannot hold: " + "; ".join(diffs))


def pinned(environment: dict[str, Any], comm: Any) -> None:
    """The pinned level holds on every rank (collective): each rank is pinned (mpisgd.pinning.problem), and
    all pin the same kernels, threads and libraries. Names the first rank that is not, and why."""
    from mpisgd import pinning  # noqa: PLC0415
    from mpisgd.backend import bits_depend_on, numpy_simd  # noqa: PLC0415

    why = comm.allgather(pinning.problem(environment, pinning.pinned_variables(numpy_simd(enabled=False))))
    bad = [r for r, w in enumerate(why) if w]
    if bad:
        raise UsageError(f"--reproducible (pinned level): rank {bad[0]}: {why[bad[0]]}"
                         + (f" (also rank(s) {bad[1:]})" if len(bad) > 1 else ""))
    same_arithmetic(environment, bits_depend_on("pinned"), comm, "the pinned level's same bits")


def device_options(cfg: Config, gpu: bool) -> list[str]:
    """UsageError for an option the device cannot run; the warnings for those it would not read."""
    if cfg.shard_optimizer and gpu:
        raise UsageError("--shard-optimizer runs on the CPU only (its all-gather takes host buffers); "
                         "drop it or pass --device cpu")
    if cfg.cuda_aware != "auto" and not gpu:  # a GPU job's script on CPU nodes: it runs, and says so
        return [f"--cuda-aware {cfg.cuda_aware} has no effect on the CPU (host buffers go to MPI as they are)"]
    return []


def outputs(cfg: Config, rank: int) -> None:
    """Every file this rank will write can be written: found now, not after the training. On rank 0,
    first: no output is an input (the data, the checkpoint to resume) or another output, none lies among
    the checkpoint directory's own names, and none is one of the timeline's files."""
    if rank == 0:
        _no_collisions(cfg)
    if cfg.timeline:
        check_output_file(f"{cfg.timeline}.rank{rank}.json", "--timeline")
    if rank != 0:
        return
    if cfg.checkpoint_dir:
        check_output_dir(cfg.checkpoint_dir, "--checkpoint-dir")
    for path, what in ((cfg.save_model, "--save-model"), (cfg.metrics_file, "--metrics-file")):
        if path:
            check_output_file(path, what)
    if cfg.save_model and not model_file.replaceable(cfg.save_model):
        raise UsageError(f"--save-model {cfg.save_model} exists and is not a model mpisgd saved: the run would "
                         "replace it; remove it or choose another path")
    if cfg.metrics_file and not _metrics_or_empty(cfg.metrics_file):
        raise UsageError(f"--metrics-file {cfg.metrics_file} exists and is not a metrics file: the run would add "
                         "its records to it; remove it or choose another path")


def _metrics_or_empty(path: str) -> bool:
    """``path`` may take a run's records (appended): absent, empty, or starting with a record (a JSON object
    with a ``kind``: an earlier run's metrics file, which the next run continues)."""
    def metrics(f: IO[bytes]) -> bool:
        first = json.loads(f.readline(1 << 20))
        return isinstance(first, dict) and "kind" in first

    return replaceable(path, metrics)


def _same(a: str | Path, b: str | Path) -> bool:
    """The same file: one inode (a hard link, another spelling), or one resolved path (not yet there)."""
    try:
        if os.path.samefile(a, b):
            return True
    except OSError:
        pass
    return os.path.realpath(a) == os.path.realpath(b)


def _no_collisions(cfg: Config) -> None:
    """UsageError where an output would replace an input or another output (compared as resolved paths
    and inodes). The outputs: --save-model, --metrics-file and the configuration's copies (beside the
    metrics file, in the checkpoint directory); the inputs: the data, the checkpoint to resume, --config
    (which a copy may name: that copy is then not written, run_files.write_config)."""
    outs = [(what, str(p)) for what, p in (("--save-model", cfg.save_model), ("--metrics-file", cfg.metrics_file))
            if p]
    outs += [("the configuration's copy", str(p)) for p in run_files.copies(cfg)]
    ins = [] if cfg.dataset == "synthetic" else [("--data", str(p)) for p in input_files(cfg.data, cfg.data_dir)]
    if cfg.resume not in ("no", "auto"):
        ins.append(("--resume", cfg.resume))
    config_file = getattr(cfg, "config_file", None)
    if config_file:
        ins.append(("--config", config_file))
    for what, p in outs:
        for src, q in ins:
            if _same(p, q) and not (what == "the configuration's copy" and src == "--config"):
                raise UsageError(f"{what} {p} is the file {src} reads ({q}): the run would write over its own "
                                 "input; choose another path")
    for i, (what, p) in enumerate(outs):
        for other, q in outs[i + 1:]:
            if _same(p, q):
                raise UsageError(f"{what} and {other} name the same file ({p}): one would replace the other; give "
                                 "each its own path")
    if cfg.timeline:
        base = Path(cfg.timeline)
        ours = re.compile(re.escape(base.name) + r"\.rank\d+\.json")
        for what, p in outs + ins:
            if ours.fullmatch(Path(p).name) and _same(Path(p).parent, base.parent or "."):
                raise UsageError(f"{what} {p} is one of the files --timeline {cfg.timeline} writes "
                                 f"({base.name}.rankN.json): give them different paths")
    if cfg.checkpoint_dir:
        ck = Path(cfg.checkpoint_dir)
        for what, p in outs + [(w, q) for w, q in ins if w == "--data"]:
            if _same(p, ck):
                raise UsageError(f"{what} {p} is the --checkpoint-dir: choose another path")
            if is_run_file(Path(p).name) and _same(Path(p).parent, ck):
                raise UsageError(f"{what} {p} lies in --checkpoint-dir {ck} under a name of the checkpoints' (or "
                                 "their lock's): a checkpoint would replace it, or pruning delete it; choose "
                                 "another path")


def same_data(identity: dict[str, Any], comm: Any) -> None:
    """Every rank trains on the same data (collective): different sets would end one rank's epoch
    early and leave the others waiting in a collective."""
    every = comm.allgather(identity)
    diffs = name_differences(every)
    if diffs:
        raise UsageError("ranks loaded different data (" + "; ".join(diffs) + "): give every rank the same data set")


def state_buffers(cfg: Config) -> float:
    """Parameter-sized buffers of the run's training state, in units of one float buffer: parameters and
    gradients, the optimizer's state (momentum; Adam's two moments), the reproducible mode's int64 sums."""
    optimizer = 2 if cfg.optimizer in ("adamw", "lamb") else 1 if cfg.momentum else 0
    exact = 2 * 8 / np.dtype(cfg.dtype).itemsize if cfg.reproducible else 0  # the sum and a micro-batch's
    return 2 + optimizer + exact


def memory(model: Any, dtype: str, data_nbytes: int, ranks_here: int, buffers: float = 3) -> None:
    """A model that cannot fit is refused with an estimate, not a MemoryError on every rank (host memory;
    before the model is materialised). ``data_nbytes``: the data this rank holds in its own memory
    (data.resident_nbytes: a memory-mapped set is the page cache's, shared by the node's ranks and read
    as needed, so it does not count); ``buffers``: parameter-sized buffers of state (state_buffers)."""
    n_params = sum(int(np.prod(shape)) for _, shape in parameter_shapes(model))
    state = int(buffers * n_params * np.dtype(dtype).itemsize)  # parameters, gradients, optimizer state
    need = state + data_nbytes
    available = available_bytes() / max(1, ranks_here)
    if need > 0.9 * available:
        data_part = f", {data_nbytes / 2**30:.1f} GiB for the data it holds" if data_nbytes >= 2**29 else ""
        raise UsageError(f"the run needs at least {need / 2**30:.1f} GiB per rank ({n_params:,} parameters: "
                         f"{state / 2**30:.1f} GiB for them, their gradients and the optimizer's state, before "
                         "activations"
                         f"{data_part}), but this node has {available / 2**30:.1f} GiB available per rank "
                         f"({ranks_here} rank(s) here); use a smaller model or fewer ranks per node"
                         + ("" if not data_part else ", or a directory of .npy files (memory-mapped, shared)"))


def same_model(structure: dict[str, Any], comm: Any) -> None:
    """Every rank built the same layers (collective): a factory whose output depends on the rank (or the
    host) is refused naming the layer and the ranks, before any buffer is compared or broadcast."""
    every = comm.allgather(structure)
    odd = differing_ranks([json.dumps(s, sort_keys=True) for s in every])
    if odd:
        usual = next(r for r in range(len(every)) if r not in odd)
        diff = structure_difference(every[odd[0]], every[usual], f"on rank {odd[0]}", f"on rank {usual}")
        raise UsageError(f"ranks {odd} built another model than rank {usual} ({diff}): the model factory must build "
                         "the same layers on every rank")



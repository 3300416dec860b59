"""Files: final parameters, and checkpoints to resume from.

A checkpoint is one ``.npz`` (loaded with ``allow_pickle=False``: it never
executes data) holding the flat parameters, the momentum buffer, the position
(global step, epoch, step within the epoch: the data order is a pure function
of the seed and these) and the configuration as JSON. Rank 0 writes it to a
temporary file, fsyncs, renames, and keeps the newest few: a failed write
never replaces a good checkpoint.
"""

from __future__ import annotations

import json
import os
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mpisgd.backend import to_numpy
from mpisgd.config import UsageError

FORMAT = 1
_NAME = re.compile(r"^ckpt-(\d{9})\.npz$")
# what must match between a checkpoint and the run resuming it
MODEL_KEYS = ("model", "hidden", "dtype")


class CheckpointError(UsageError):
    """A checkpoint that cannot be used (corrupt, truncated, incompatible)."""


def atomic_savez(path: str | os.PathLike, **arrays: Any) -> None:
    """Write an .npz so that ``path`` is either absent/old or the complete new file."""
    path = str(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            np.savez(f, **arrays)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)  # make the rename itself durable
    finally:
        os.close(fd)


def save_params(path: str, model: Any) -> None:
    """The flat parameter vector and each named parameter, as NumPy arrays."""
    named = {name: to_numpy(p) for name, p in model.named_parameters()}
    atomic_savez(path, flat=to_numpy(model.flat.params), **named)


@dataclass
class TrainState:
    params: np.ndarray
    velocity: np.ndarray | None
    prev_lr: float
    global_step: int
    epoch: int  # 0-based epoch the next step belongs to
    step_in_epoch: int  # position of the next step within that epoch
    skipped_steps: int
    world_size: int
    effective_batch: int
    config: dict[str, Any]


def checkpoint_path(directory: str | os.PathLike, global_step: int) -> Path:
    return Path(directory) / f"ckpt-{global_step:09d}.npz"


def list_checkpoints(directory: str | os.PathLike) -> list[Path]:
    """Checkpoints in ``directory``, newest first."""
    d = Path(directory)
    if not d.is_dir():
        return []
    return sorted((p for p in d.iterdir() if _NAME.match(p.name)), reverse=True)


def save_checkpoint(directory: str | os.PathLike, state: TrainState, keep: int = 3) -> Path:
    path = checkpoint_path(directory, state.global_step)
    arrays: dict[str, Any] = {
        "format": np.int64(FORMAT), "params": state.params,
        "scalars": np.array([state.global_step, state.epoch, state.step_in_epoch, state.skipped_steps,
                             state.world_size, state.effective_batch], dtype=np.int64),
        "prev_lr": np.float64(state.prev_lr), "config": np.array(json.dumps(state.config, default=list)),
    }
    if state.velocity is not None:
        arrays["velocity"] = state.velocity
    atomic_savez(path, **arrays)
    for old in list_checkpoints(directory)[keep:]:
        old.unlink(missing_ok=True)
    return path


def load_checkpoint(path: str | os.PathLike) -> TrainState:
    """Read and validate one checkpoint; CheckpointError says what is wrong with it."""
    try:
        with np.load(path, allow_pickle=False) as z:
            if int(z["format"]) != FORMAT:
                raise CheckpointError(f"{path}: checkpoint format {int(z['format'])}, this mpisgd reads {FORMAT}")
            s = z["scalars"]
            return TrainState(
                params=z["params"], velocity=z["velocity"] if "velocity" in z.files else None,
                prev_lr=float(z["prev_lr"]), global_step=int(s[0]), epoch=int(s[1]), step_in_epoch=int(s[2]),
                skipped_steps=int(s[3]), world_size=int(s[4]), effective_batch=int(s[5]),
                config=json.loads(str(z["config"])))
    except CheckpointError:
        raise
    except (OSError, EOFError, KeyError, ValueError, IndexError, zipfile.BadZipFile) as exc:
        raise CheckpointError(f"{path} is not a usable checkpoint ({type(exc).__name__}: {exc})") from None


def find_resume(resume: str, directory: str | None) -> tuple[TrainState | None, str, list[str]]:
    """The state to resume from: (state or None, its path, warnings about skipped bad files).

    ``auto``: the newest checkpoint that loads, falling back past corrupt ones;
    none at all means a fresh start. A path: that file, or an error.
    """
    if resume == "no":
        return None, "", []
    if resume != "auto":
        return load_checkpoint(resume), resume, []
    warnings = []
    for path in list_checkpoints(directory or "."):
        try:
            return load_checkpoint(path), str(path), warnings
        except CheckpointError as exc:
            warnings.append(f"skipping {exc}")
    return None, "", warnings


def check_compatible(state: TrainState, config: dict[str, Any], effective_batch: int) -> None:
    """Refuse a resume that cannot continue the same run, naming what differs."""
    for key in MODEL_KEYS:
        if json.dumps(state.config.get(key), default=list) != json.dumps(config.get(key), default=list):
            raise CheckpointError(f"checkpoint was written with --{key} {state.config.get(key)}, "
                                  f"this run has {config.get(key)}")
    if state.effective_batch != effective_batch:
        raise CheckpointError(
            f"checkpoint was written with effective batch B={state.effective_batch} "
            f"(k={state.world_size} ranks), this run has B={effective_batch}: resuming needs the same "
            "B = k*b*m so that the data order and learning-rate schedule continue; "
            "change --batch-size or --accum-steps to match")

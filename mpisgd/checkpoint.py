"""Files: final parameters, and checkpoints to resume from.

A checkpoint is one ``.npz`` (loaded with ``allow_pickle=False``: it never
executes data) holding the flat parameters, the momentum buffer, the position
(global step, epoch, step within the epoch: the data order is a pure function
of the seed and these), the configuration as JSON and the data set's identity.
Rank 0 writes it all or nothing (mpisgd.files.atomic_write) and keeps the newest
few. A checkpoint directory belongs to one run: :class:`RunDirectory` locks it
for the run's life and refuses another run's checkpoints unless told to resume
or to start over.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from mpisgd.backend import to_numpy
from mpisgd.config import IDENTITY, STRUCTURE, UsageError
from mpisgd.files import atomic_write, remove_stale_temporaries

FORMAT = 1
_NAME = re.compile(r"^ckpt-(\d{9})\.npz$")
LOCK = ".mpisgd.lock"


class CheckpointError(UsageError):
    """A checkpoint that cannot be used (corrupt, truncated, incompatible)."""


def save_params(path: str, model: Any, meta: dict[str, Any] | None = None) -> None:
    """The flat parameter vector and each named parameter, as NumPy arrays, and ``meta``, what model it is
    (mpisgd.model_file.describe), as JSON: the file mpisgd.load_model reads (docs/api.md)."""
    named = {name: to_numpy(p) for name, p in model.named_parameters()}
    extra = {"meta": np.array(json.dumps(meta))} if meta else {}
    atomic_write(path, lambda f: np.savez(f, flat=to_numpy(model.flat.params), **named, **extra))


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
    data: dict[str, Any] = field(default_factory=dict)  # the data set: name, sizes, fingerprint
    model: dict[str, Any] = field(default_factory=dict)  # what model it is (mpisgd.model_file.describe)


def checkpoint_path(directory: str | os.PathLike, global_step: int) -> Path:
    return Path(directory) / f"ckpt-{global_step:09d}.npz"


def list_checkpoints(directory: str | os.PathLike) -> list[Path]:
    """Checkpoints in ``directory``, newest first."""
    d = Path(directory)
    if not d.is_dir():
        return []
    return sorted((p for p in d.iterdir() if _NAME.match(p.name)), reverse=True)


def save_checkpoint(directory: str | os.PathLike, state: TrainState, keep: int = 3) -> Path:
    """Write ``state``; only once it is complete are the oldest beyond ``keep`` removed. OSError (a full
    disk) leaves the earlier checkpoints as they were and no temporary file behind."""
    path = checkpoint_path(directory, state.global_step)
    arrays: dict[str, Any] = {
        "format": np.int64(FORMAT), "params": state.params,
        "scalars": np.array([state.global_step, state.epoch, state.step_in_epoch, state.skipped_steps,
                             state.world_size, state.effective_batch], dtype=np.int64),
        "prev_lr": np.float64(state.prev_lr), "config": np.array(json.dumps(state.config, default=list)),
        "data": np.array(json.dumps(state.data)),
    }
    if state.velocity is not None:
        arrays["velocity"] = state.velocity
    if state.model:
        arrays["model"] = np.array(json.dumps(state.model))
    atomic_write(path, lambda f: np.savez(f, **arrays))
    for old in list_checkpoints(directory)[keep:]:
        old.unlink(missing_ok=True)
    return path


def load_checkpoint(path: str | os.PathLike) -> TrainState:
    """Read and validate one checkpoint; CheckpointError says what is wrong with it."""
    if not zipfile.is_zipfile(path):
        raise CheckpointError(f"{path} is not a checkpoint (an .npz written by mpisgd): not a zip archive")
    try:
        with np.load(path, allow_pickle=False) as z:
            if int(z["format"]) != FORMAT:
                raise CheckpointError(f"{path}: checkpoint format {int(z['format'])}, this mpisgd reads {FORMAT}")
            s = z["scalars"]
            state = TrainState(
                params=z["params"], velocity=z["velocity"] if "velocity" in z.files else None,
                prev_lr=float(z["prev_lr"]), global_step=int(s[0]), epoch=int(s[1]), step_in_epoch=int(s[2]),
                skipped_steps=int(s[3]), world_size=int(s[4]), effective_batch=int(s[5]),
                config=json.loads(str(z["config"])), data=json.loads(str(z["data"])) if "data" in z.files else {},
                model=json.loads(str(z["model"])) if "model" in z.files else {})
    except CheckpointError:
        raise
    except (OSError, EOFError, KeyError, ValueError, IndexError, TypeError, zipfile.BadZipFile) as exc:
        raise CheckpointError(f"{path} is not a usable checkpoint ({type(exc).__name__}: {exc})") from None
    for name, a in (("params", state.params), ("velocity", state.velocity)):
        if a is not None and (a.ndim != 1 or a.dtype.kind != "f" or a.size != state.params.size):
            raise CheckpointError(f"{path}: {name} must be a 1-D float array of the parameters' size, "
                                  f"got {a.dtype} {a.shape}")
    if not (isinstance(state.config, dict) and state.global_step >= 0 and state.effective_batch >= 1):
        raise CheckpointError(f"{path}: inconsistent contents (config, step or batch)")
    return state


def find_resume(resume: str, directory: str | None) -> tuple[TrainState | None, str, list[str]]:
    """The state to resume from: (state or None, its path, warnings about skipped bad files).

    ``auto``: the newest checkpoint that loads, falling back past corrupt ones;
    none at all means a fresh start. A path: that file, or an error.
    """
    if resume == "no":
        return None, "", []
    if resume != "auto":
        if not Path(resume).is_file():
            raise CheckpointError(f"--resume {resume}: no such file")
        return load_checkpoint(resume), resume, []
    warnings = []
    for path in list_checkpoints(directory or "."):
        try:
            return load_checkpoint(path), str(path), warnings
        except CheckpointError as exc:
            warnings.append(f"skipping {exc}")
    return None, "", warnings


def identity_changes(saved: dict[str, Any], now: dict[str, Any], allowed: tuple[str, ...]) -> list[str]:
    """The differences between two runs' identities, as '--key OLD -> NEW'. Raises CheckpointError for
    any not in ``allowed`` (and always for the model's structure), naming every one."""
    def show(key: str, v: Any) -> str:
        if isinstance(v, dict):  # the data set
            return f"{v.get('name')} ({v.get('n_train')} train, {v.get('n_test')} test, {v.get('fingerprint')})"
        return ",".join(map(str, v)) if isinstance(v, list | tuple) else str(v)

    diffs = {k: (saved.get(k), now.get(k)) for k in IDENTITY
             if json.dumps(saved.get(k), default=list) != json.dumps(now.get(k), default=list)}
    text = {k: f"--{k.replace('_', '-')} {show(k, a)} -> {show(k, b)}" for k, (a, b) in diffs.items()}
    refused = [k for k in diffs if k in STRUCTURE or k not in allowed]
    if refused:
        hint = "" if all(k in STRUCTURE for k in refused) else \
            "; to continue with these changes on purpose pass --resume-allow " + ",".join(
                k for k in refused if k not in STRUCTURE)
        raise CheckpointError("this run differs from the checkpoint's: " + "; ".join(text[k] for k in refused)
                              + hint)
    return [text[k] for k in diffs]


class RunDirectory:
    """A checkpoint directory held by one run (rank 0): an exclusive lock for the run's life, and
    refusal of another run's checkpoints unless the run resumes them or starts over on purpose."""

    def __init__(self, directory: str, resume: str, overwrite: bool) -> None:
        self.path = Path(directory)
        self.path.mkdir(parents=True, exist_ok=True)
        self._lock = open(self.path / LOCK, "a+")  # noqa: SIM115 - held until close()
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self._lock.seek(0)
            holder = self._lock.read().strip() or "another process"
            self._lock.close()
            raise UsageError(f"--checkpoint-dir {directory} is in use by another run ({holder}); "
                             "give each run its own directory") from None
        self._lock.seek(0)
        self._lock.truncate()
        self._lock.write(f"pid {os.getpid()} on {os.uname().nodename}, job {os.environ.get('SLURM_JOB_ID', '-')}\n")
        self._lock.flush()
        remove_stale_temporaries(self.path, r"ckpt-\d{9}\.npz")
        existing = list_checkpoints(self.path)
        if existing and resume == "no":
            if not overwrite:
                raise UsageError(f"--checkpoint-dir {directory} holds another run's checkpoints ({existing[0].name}, "
                                 f"{len(existing)} in all): pass --resume auto to continue that run, or "
                                 "--overwrite-checkpoints to start over (they are deleted)")
            for p in existing:
                p.unlink()

    def close(self) -> None:
        if not self._lock.closed:
            fcntl.flock(self._lock, fcntl.LOCK_UN)
            self._lock.close()


@dataclass
class ResumePlan:
    """How a run continues from a checkpoint (decided on rank 0, then broadcast)."""

    path: str
    global_step: int
    epoch: int
    step_in_epoch: int
    skipped_steps: int
    prev_lr: float
    world_size: int  # the checkpoint's k
    batch_size: int  # this run's b and m: as given, or derived to keep the checkpoint's B
    accum_steps: int
    changes: list[str]  # differences from the checkpoint's run that --resume-allow accepted
    derived: str  # what was derived, for the banner ("" if nothing)


def plan_resume(state: TrainState, path: str, config: dict[str, Any], given: set[str], allowed: tuple[str, ...],
                k: int, data: dict[str, Any]) -> ResumePlan:
    """Check that this run (``config`` at k ranks, on ``data``) can continue the checkpoint's, and find its b
    and m: the same effective batch B = k*b*m keeps the data order and the schedule; where the user gave
    neither --batch-size nor --accum-steps they are derived from B. CheckpointError says what to change."""
    B, old_k = state.effective_batch, state.world_size
    old_b, old_m = state.config.get("batch_size"), state.config.get("accum_steps", 1)
    b, m, derived = config["batch_size"], config["accum_steps"], ""
    if k * b * m != B:
        if given & {"batch_size", "accum_steps"}:
            raise CheckpointError(
                f"the checkpoint's run has effective batch B={B} (k={old_k} x b={old_b} x m={old_m}), this run "
                f"k*b*m={k * b * m}: resuming needs the same B, so that the data order and the schedule continue; "
                f"pass --batch-size and --accum-steps with {k} x b x m = {B}, or neither, and they are derived")
        fits = [mm for mm in dict.fromkeys((old_m, 1)) if B % (k * mm) == 0]
        if not fits:
            ks = [d for d in range(1, B + 1) if B % d == 0]
            raise CheckpointError(f"the checkpoint's effective batch B={B} cannot be split over k={k} ranks: k must "
                                  f"divide B ({', '.join(map(str, ks[:16]))}{', ...' if len(ks) > 16 else ''})")
        b, m = B // (k * fits[0]), fits[0]
        derived = f"b={b}, m={m} derived to keep B={B} (the checkpoint's run: k={old_k}, b={old_b}, m={old_m})"
    saved = dict(state.config, data=state.data)
    now = dict(config, data=data if state.data else {})  # checkpoints of older versions hold no data identity
    changes = identity_changes(saved, now, allowed)
    return ResumePlan(path, state.global_step, state.epoch, state.step_in_epoch, state.skipped_steps, state.prev_lr,
                      old_k, b, m, changes, derived)

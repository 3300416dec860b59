"""Files: final parameters, and checkpoints to resume from.

A checkpoint is one ``.npz`` (loaded with ``allow_pickle=False``: it never
executes data) holding the flat parameters, the model's flat state (running
statistics, ``model_state``, when the model has any), the optimizer's state (each of its
parameter-sized buffers as ``state.NAME``: SGD's ``velocity``, Adam's
``exp_avg`` and ``exp_avg_sq``; its scalars as JSON: the previous rate, Adam's
step count), the position (global step, epoch, step within the epoch: the data
order is a pure function of the seed and these), the configuration as JSON and
the data set's identity, and the model's own state where it has one (``model_state``: BatchNorm's
running statistics, ``model.state``; checkpoints without it still load). Format 1 (before AdamW) kept the momentum as
``velocity`` and the rate as ``prev_lr``; it still loads.
Rank 0 writes it all or nothing (mpisgd.files.atomic_write) and keeps the newest
few. A checkpoint directory belongs to one run: :class:`RunDirectory` locks it
for the run's life and refuses another run's checkpoints unless told to resume
or to start over.

Every run has an identity, a run id recorded in each of its checkpoints and in
the lock: a fresh run makes one, a resumed run continues its checkpoint's. Pruning
deletes only checkpoints of this run that it superseded (whoever else wrote the
others); resuming into a directory that holds another run's checkpoints is
refused; resuming a checkpoint older than the run's newest (a roll-back) moves the
later ones to ``abandoned/`` in the directory before the run writes its first
checkpoint, so that ``--resume auto`` continues the new line. Nothing is deleted
unless the user says so (``--overwrite-checkpoints``).
"""

from __future__ import annotations

import json
import math
import os
import re
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from mpisgd.errors import UsageError
from mpisgd.exact import NO_EXPONENT
from mpisgd.files import TMP_SUFFIX, atomic_write, write_npz

FORMAT = 2
READS = (1, 2)  # the formats this version loads
BUFFER = "state."  # the key prefix of the optimizer's state buffers
_NAME = re.compile(r"^ckpt-(\d{9})\.npz$")
LOCK = ".mpisgd.lock"  # the lock file of a checkpoint directory (mpisgd.app.run_dir)
EXPONENT_RANGE = 1100  # frexp's exponents of finite float64 values lie in [-1073, 1024]
SCALARS = ("global_step", "epoch", "step_in_epoch", "skipped_steps", "world_size", "effective_batch")


class CheckpointError(UsageError):
    """A checkpoint that cannot be used (corrupt, truncated, incompatible)."""


class SaveError(CheckpointError):
    """The final model could be written nowhere (every place tried named)."""


def is_run_file(name: str) -> bool:
    """A name a checkpoint directory uses for its own files (checkpoints, their temporaries, the lock)."""
    return bool(_NAME.match(name.split(TMP_SUFFIX, 1)[0])) or name == LOCK


@dataclass
class TrainState:
    params: np.ndarray
    buffers: dict[str, np.ndarray]  # the optimizer's state_buffers(), by name
    optimizer_state: dict[str, float]  # the optimizer's state(): its scalars
    global_step: int
    epoch: int  # 0-based epoch the next step belongs to
    step_in_epoch: int  # position of the next step within that epoch
    skipped_steps: int
    world_size: int
    effective_batch: int
    config: dict[str, Any]
    data: dict[str, Any] = field(default_factory=dict)  # the data set: name, sizes, fingerprint
    grad_exponents: np.ndarray | None = None  # reproducible runs: the fixed-point exponents of the next step
    environment: dict[str, Any] = field(default_factory=dict)  # what the bits depend on (BLAS, threads, CPU)
    structure: dict[str, Any] = field(default_factory=dict)  # model_structure(); {} in older checkpoints
    run_id: str = ""  # the run's identity (RunDirectory sets it); "" in older checkpoints
    model: dict[str, Any] = field(default_factory=dict)  # what model it is (mpisgd.app.run.model_record)
    model_state: np.ndarray | None = None  # the model's buffers (model.state: running statistics); None: it has none


def checkpoint_path(directory: str | os.PathLike, global_step: int) -> Path:
    return Path(directory) / f"ckpt-{global_step:09d}.npz"


def list_checkpoints(directory: str | os.PathLike) -> list[Path]:
    """Checkpoints in ``directory``, newest first."""
    d = Path(directory)
    if not d.is_dir():
        return []
    return sorted((p for p in d.iterdir() if _NAME.match(p.name)), reverse=True)


def step_of(path: Path) -> int:
    return int(_NAME.match(path.name).group(1))  # type: ignore[union-attr]


def run_id_of(path: str | os.PathLike) -> str | None:
    """The run id a checkpoint records ("" for one older than run ids), or None where it cannot be read:
    a file whose run is unknown is never pruned."""
    try:
        with zipfile.ZipFile(path) as z:
            if "run.npy" not in z.namelist():
                return "" if "scalars.npy" in z.namelist() else None
            with z.open("run.npy") as f:
                return str(np.lib.format.read_array(f, allow_pickle=False))
    except Exception:  # noqa: BLE001 - whatever is wrong with the file, it is not provably this run's
        return None


def save_checkpoint(directory: str | os.PathLike, state: TrainState, keep: int = 3,
                    lineage: set[str] | None = None) -> Path:
    """Write ``state``; only once it is complete are this run's older checkpoints beyond the newest
    ``keep`` removed (this run: checkpoints whose run id is in ``lineage``, by default ``state.run_id``'s;
    never another run's, never an unreadable file, never a later step). OSError (a full disk) leaves the
    earlier checkpoints as they were and no temporary file behind."""
    path = checkpoint_path(directory, state.global_step)
    arrays: dict[str, Any] = {
        "format": np.int64(FORMAT), "params": state.params,
        "scalars": np.array([state.global_step, state.epoch, state.step_in_epoch, state.skipped_steps,
                             state.world_size, state.effective_batch], dtype=np.int64),
        "optimizer": np.array(json.dumps(state.optimizer_state)),
        "config": np.array(json.dumps(state.config, default=list)),
        "data": np.array(json.dumps(state.data)), "structure": np.array(json.dumps(state.structure)),
        "run": np.array(state.run_id), **{BUFFER + name: buf for name, buf in state.buffers.items()},
    }
    if state.model:
        arrays["model"] = np.array(json.dumps(state.model))
    if state.model_state is not None:
        arrays["model_state"] = state.model_state
    if state.grad_exponents is not None:
        arrays["grad_exponents"] = np.asarray(state.grad_exponents, dtype=np.int64)
    if state.environment:
        arrays["environment"] = np.array(json.dumps(state.environment))
    if state.model_state is not None:
        arrays["model_state"] = state.model_state
    atomic_write(path, lambda f: write_npz(f, arrays))
    ours = lineage if lineage is not None else {state.run_id}
    mine = [p for p in list_checkpoints(directory) if step_of(p) <= state.global_step and run_id_of(p) in ours]
    for old in mine[keep:]:
        old.unlink(missing_ok=True)
    return path


def load_checkpoint(path: str | os.PathLike) -> TrainState:
    """Read and validate one checkpoint; CheckpointError says what is wrong with it. Every scalar is
    checked, and the parameters and the optimizer's state must be finite: a hand-edited file is refused
    here, naming it."""
    if not Path(path).is_file():
        raise CheckpointError(f"{path} is not a regular file")
    if not zipfile.is_zipfile(path):
        raise CheckpointError(f"{path} is not a checkpoint (an .npz written by mpisgd): not a zip archive")
    try:
        with np.load(path, allow_pickle=False) as z:
            if "format" not in z.files and "flat" in z.files:
                raise CheckpointError(f"{path} is a --save-model file (the final parameters), not a checkpoint: it "
                                      "holds no optimizer state or position to continue from; --resume takes a "
                                      "checkpoint (ckpt-<step>.npz) or auto with --checkpoint-dir")
            version = int(z["format"])
            if version not in READS:
                raise CheckpointError(f"{path}: checkpoint format {version}, this mpisgd reads "
                                      f"{', '.join(map(str, READS))}")
            s = z["scalars"]
            if s.shape != (len(SCALARS),) or s.dtype.kind not in "iu":
                raise CheckpointError(f"{path}: scalars must be {len(SCALARS)} integers, got {s.dtype} {s.shape}")
            if version == 1:  # SGD's momentum and previous rate, under their own names
                buffers = {"velocity": z["velocity"]} if "velocity" in z.files else {}
                scalars = {"prev_lr": float(z["prev_lr"])}
            else:
                buffers = {k[len(BUFFER):]: z[k] for k in z.files if k.startswith(BUFFER)}
                scalars = json.loads(str(z["optimizer"]))
            state = TrainState(
                params=z["params"], buffers=buffers, optimizer_state=scalars,
                global_step=int(s[0]), epoch=int(s[1]), step_in_epoch=int(s[2]),
                skipped_steps=int(s[3]), world_size=int(s[4]), effective_batch=int(s[5]),
                config=json.loads(str(z["config"])), data=json.loads(str(z["data"])) if "data" in z.files else {},
                grad_exponents=z["grad_exponents"] if "grad_exponents" in z.files else None,
                environment=json.loads(str(z["environment"])) if "environment" in z.files else {},
                structure=json.loads(str(z["structure"])) if "structure" in z.files else {},
                run_id=str(z["run"]) if "run" in z.files else "",
                model=json.loads(str(z["model"])) if "model" in z.files else {},
                model_state=z["model_state"] if "model_state" in z.files else None)
    except CheckpointError:
        raise
    except (OSError, EOFError, KeyError, ValueError, IndexError, TypeError, zipfile.BadZipFile) as exc:
        raise CheckpointError(f"{path} is not a usable checkpoint ({type(exc).__name__}: {exc})") from None
    for name, a in (("params", state.params), *state.buffers.items()):
        if a.ndim != 1 or a.dtype.kind != "f" or a.size != state.params.size:
            raise CheckpointError(f"{path}: {name} must be a 1-D float array of the parameters' size, "
                                  f"got {a.dtype} {a.shape}")
        if not np.isfinite(a).all():
            raise CheckpointError(f"{path}: {name} hold {np.count_nonzero(~np.isfinite(a)):,} non-finite values "
                                  "(NaN or inf): not a state to continue from")
    ms = state.model_state
    if ms is not None and (ms.ndim != 1 or ms.dtype.kind != "f" or not np.isfinite(ms).all()):
        raise CheckpointError(f"{path}: model_state (the model's running statistics) must be a 1-D array of finite "
                              f"floats, got {ms.dtype} {ms.shape}")
    _check_scalars(path, state)
    return state


def _check_scalars(path: str | os.PathLike, st: TrainState) -> None:
    """Each scalar in range and consistent with the others (the run's own checks are in resume_point)."""
    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"{path}: inconsistent checkpoint: {what}")

    if not all(isinstance(r, dict) for r in (st.config, st.data, st.structure, st.environment, st.model)):
        raise bad("its configuration, data, structure, environment or model record is not a JSON object")
    layers, shapes = st.structure.get("layers", []), st.structure.get("shapes", [])
    if not (isinstance(layers, list) and all(isinstance(x, str) for x in layers) and isinstance(shapes, list)
            and all(isinstance(x, list) and len(x) == 2 and isinstance(x[0], str) and isinstance(x[1], list)
                    and all(_positive(d) for d in x[1]) for x in shapes)):
        raise bad("its model structure is not a list of layers and of [name, shape] pairs")
    for name in ("batch_size", "accum_steps"):  # resuming derives b and m from them
        if name in st.config and not _positive(st.config[name]):
            raise bad(f"its configuration's {name} is {json.dumps(st.config[name])[:40]}, not an integer >= 1")
    _check_exponents(st.grad_exponents, len(shapes) if shapes else None, bad)
    for name in SCALARS:
        if getattr(st, name) < 0:
            raise bad(f"{name} is {getattr(st, name)}")
    if st.world_size < 1 or st.effective_batch < 1:
        raise bad(f"world size {st.world_size} and effective batch {st.effective_batch} must be >= 1")
    if st.skipped_steps > st.global_step or st.step_in_epoch > st.global_step:
        raise bad(f"step {st.global_step} with {st.skipped_steps} skipped and {st.step_in_epoch} into its epoch")
    b, m = st.config.get("batch_size"), st.config.get("accum_steps", 1)
    if isinstance(b, int) and isinstance(m, int) and st.world_size * b * m != st.effective_batch:
        raise bad(f"effective batch {st.effective_batch} is not its k x b x m = {st.world_size} x {b} x {m}")
    opt = st.optimizer_state
    if not (isinstance(opt, dict) and all(isinstance(v, int | float) and not isinstance(v, bool)
                                          and math.isfinite(v) for v in opt.values())):
        raise bad(f"the optimizer's state must be a JSON object of finite numbers, got {opt!r}")
    prev_lr = opt.get("prev_lr", -1.0)
    if not (prev_lr == -1.0 or prev_lr > 0):
        raise bad(f"previous learning rate {prev_lr}")
    if opt.get("step", 0) < 0:
        raise bad(f"optimizer step count {opt['step']}")


def _positive(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 1


def _check_exponents(e: np.ndarray | None, n_tensors: int | None, bad: Any) -> None:
    """A reproducible run's fixed-point exponents: one integer per parameter tensor, each the exponent of a
    finite float64 norm or mpisgd.exact.NO_EXPONENT (a tensor whose gradient was zero)."""
    if e is None:
        return
    if e.ndim != 1 or e.dtype.kind not in "iu" or (n_tensors is not None and e.size != n_tensors):
        raise bad(f"its fixed-point exponents must be {n_tensors or 'one per parameter tensor'} integers, got "
                  f"{e.dtype} {e.shape}")
    wrong = e[(e != NO_EXPONENT) & ((e < -EXPONENT_RANGE) | (e > EXPONENT_RANGE))]
    if wrong.size:
        raise bad(f"a fixed-point exponent is {int(wrong[0])}, outside what a finite gradient needs "
                  f"(|e| <= {EXPONENT_RANGE})")


def find_resume(resume: str, directory: str | None, overwrite: bool = False
                ) -> tuple[TrainState | None, str, list[str]]:
    """The state to resume from: (state or None, its path, warnings about skipped bad files).

    ``auto``: the newest checkpoint that loads, falling back past corrupt ones; no checkpoint at all
    means a fresh start; checkpoints none of which loads are refused (CheckpointError) unless
    ``overwrite``: a damaged file or a downgrade must not start the run over behind the user's back.
    A path: that file, or an error.
    """
    if resume == "no":
        return None, "", []
    if resume != "auto":
        if not Path(resume).exists():
            raise CheckpointError(f"--resume {resume}: no such file")
        if Path(resume).is_dir():
            raise CheckpointError(f"--resume {resume} is a directory: give one of its checkpoints "
                                  f"(ckpt-<step>.npz), or --checkpoint-dir {resume} --resume auto for its newest")
        if not Path(resume).is_file():
            raise CheckpointError(f"--resume {resume}: not a regular file")
        return load_checkpoint(resume), resume, []
    warnings: list[str] = []
    reasons: list[str] = []
    found = list_checkpoints(directory or ".")
    for path in found:
        try:
            return load_checkpoint(path), str(path), warnings
        except CheckpointError as exc:
            warnings.append(f"skipping an unreadable checkpoint: {exc}")
            reasons.append(str(exc))
    if found and not overwrite:
        raise CheckpointError(f"--resume auto: none of the {len(found)} checkpoint(s) in {directory} can be read "
                              f"({reasons[0]}{'; ...' if len(reasons) > 1 else ''}); they are kept: repair or move "
                              "them, or pass --overwrite-checkpoints to start over (they are then deleted)")
    return None, "", warnings



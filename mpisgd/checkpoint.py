"""Files: final parameters, and checkpoints to resume from.

A checkpoint is one ``.npz`` (loaded with ``allow_pickle=False``: it never
executes data) holding the flat parameters, the optimizer's state (each of its
parameter-sized buffers as ``state.NAME``: SGD's ``velocity``, Adam's
``exp_avg`` and ``exp_avg_sq``; its scalars as JSON: the previous rate, Adam's
step count), the position (global step, epoch, step within the epoch: the data
order is a pure function of the seed and these), the configuration as JSON and
the data set's identity. Format 1 (before AdamW) kept the momentum as
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

import fcntl
import json
import math
import os
import re
import tempfile
import uuid
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from mpisgd.backend import to_numpy
from mpisgd.config import IDENTITY, OPTIMIZER_OPTIONS, STRUCTURE, Config, UsageError
from mpisgd.files import TMP_SUFFIX, atomic_write, free_bytes, remove_stale_temporaries, write_npz

FORMAT = 2
READS = (1, 2)  # the formats this version loads
BUFFER = "state."  # the key prefix of the optimizer's state buffers
_NAME = re.compile(r"^ckpt-(\d{9})\.npz$")
LOCK = ".mpisgd.lock"
ABANDONED = "abandoned"  # where a roll-back moves the later checkpoints it abandons (never deleted)
SCALARS = ("global_step", "epoch", "step_in_epoch", "skipped_steps", "world_size", "effective_batch")


class CheckpointError(UsageError):
    """A checkpoint that cannot be used (corrupt, truncated, incompatible)."""


class SaveError(CheckpointError):
    """The final model could be written nowhere (every place tried named)."""


def is_run_file(name: str) -> bool:
    """A name a checkpoint directory uses for its own files (checkpoints, their temporaries, the lock)."""
    return bool(_NAME.match(name.split(TMP_SUFFIX, 1)[0])) or name == LOCK


def save_params(path: str, model: Any, fallback_dirs: Sequence[str | os.PathLike] = (),
                meta: dict[str, Any] | None = None) -> str:
    """Write the final parameters (the flat vector and each named parameter, as NumPy arrays) and ``meta``,
    what model it is (mpisgd.model_file.describe; the file mpisgd.load_model reads, docs/api.md), to ``path``;
    where that fails (a full disk, a directory gone), to the first of ``fallback_dirs`` that takes them,
    under the same file name (never replacing a file there). Returns where they went; SaveError, naming
    every place tried and why, when nowhere."""
    named = {name: to_numpy(p) for name, p in model.named_parameters()}
    flat = to_numpy(model.flat.params)
    extra = {"meta": np.array(json.dumps(meta))} if meta else {}
    tried = []
    for target in [Path(path), *(_free_name(Path(d), Path(path).name) for d in fallback_dirs)]:
        try:
            atomic_write(target, lambda f: write_npz(f, {"flat": flat, **named, **extra}))
            return str(target)
        except OSError as exc:
            tried.append(f"{target} ({exc.strerror or exc}{_free(target)})")
    raise SaveError("the final model was not written: " + "; ".join(tried))


def model_fallbacks(checkpoint_dir: str | None) -> list[str]:
    """Where save_params tries when --save-model cannot be written: beside the checkpoints, then the
    temporary directory."""
    return [d for d in (checkpoint_dir, tempfile.gettempdir()) if d]


def _free_name(directory: Path, name: str) -> Path:
    p, n = directory / name, 1
    while p.exists():
        p, n = directory / f"{Path(name).stem}-{n}{Path(name).suffix}", n + 1
    return p


def _free(target: Path) -> str:
    try:
        return f"; {free_bytes(target.parent) / 2**20:.0f} MiB free there"
    except OSError:
        return ""


def model_structure(model: Any) -> dict[str, Any]:
    """The model's layer structure, for a checkpoint (JSON): each layer's repr and each parameter's
    name and shape. A resumed run must build the same (plan_resume)."""
    return {"layers": [repr(layer) for layer in model.layers],
            "shapes": [[f"{i}.{type(layer).__name__}.{name}", list(shape)]
                       for i, layer in enumerate(model.layers) for name, shape in layer.param_shapes]}


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
    model: dict[str, Any] = field(default_factory=dict)  # what model it is (mpisgd.model_file.describe)


def checkpoint_path(directory: str | os.PathLike, global_step: int) -> Path:
    return Path(directory) / f"ckpt-{global_step:09d}.npz"


def list_checkpoints(directory: str | os.PathLike) -> list[Path]:
    """Checkpoints in ``directory``, newest first."""
    d = Path(directory)
    if not d.is_dir():
        return []
    return sorted((p for p in d.iterdir() if _NAME.match(p.name)), reverse=True)


def _step(path: Path) -> int:
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
    if state.grad_exponents is not None:
        arrays["grad_exponents"] = np.asarray(state.grad_exponents, dtype=np.int64)
    if state.environment:
        arrays["environment"] = np.array(json.dumps(state.environment))
    atomic_write(path, lambda f: write_npz(f, arrays))
    ours = lineage if lineage is not None else {state.run_id}
    mine = [p for p in list_checkpoints(directory) if _step(p) <= state.global_step and run_id_of(p) in ours]
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
                model=json.loads(str(z["model"])) if "model" in z.files else {})
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
    _check_scalars(path, state)
    return state


def _check_scalars(path: str | os.PathLike, st: TrainState) -> None:
    """Each scalar in range and consistent with the others (the run's own checks are in plan_resume)."""
    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"{path}: inconsistent checkpoint: {what}")

    if not isinstance(st.config, dict) or not isinstance(st.data, dict) or not isinstance(st.structure, dict):
        raise bad("its configuration, data or structure record is not a JSON object")
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
        if not Path(resume).is_file():
            raise CheckpointError(f"--resume {resume}: not a regular file")
        return load_checkpoint(resume), resume, []
    warnings, reasons = [], []
    found = list_checkpoints(directory or ".")
    for path in found:
        try:
            return load_checkpoint(path), str(path), warnings
        except CheckpointError as exc:
            warnings.append(f"skipping {exc}")
            reasons.append(str(exc))
    if found and not overwrite:
        raise CheckpointError(f"--resume auto: none of the {len(found)} checkpoint(s) in {directory} can be read "
                              f"({reasons[0]}{'; ...' if len(reasons) > 1 else ''}); they are kept: repair or move "
                              "them, or pass --overwrite-checkpoints to start over (they are then deleted)")
    return None, "", warnings


def identity_changes(saved: dict[str, Any], now: dict[str, Any], allowed: tuple[str, ...]) -> list[str]:
    """The differences between two runs' identities, as '--key OLD -> NEW'. Raises CheckpointError for
    any not in ``allowed`` (and always for the model's structure), naming every one. A key the saved
    configuration lacks (an older mpisgd's) compares as that option's default; an option that neither
    run's optimizer reads (OPTIMIZER_OPTIONS: SGD's momentum in two AdamW runs) does not count."""
    def show(key: str, v: Any) -> str:
        if isinstance(v, dict):  # the data set
            return f"{v.get('name')} ({v.get('n_train')} train, {v.get('n_test')} test, {v.get('fingerprint')})"
        return ",".join(map(str, v)) if isinstance(v, list | tuple) else str(v)

    defaults = Config().to_dict()
    saved = {k: saved.get(k, defaults.get(k)) for k in IDENTITY}
    for k, readers in OPTIMIZER_OPTIONS.items():  # an option neither run's update rule reads may change
        if saved.get("optimizer") not in readers and now.get("optimizer") not in readers:
            saved[k] = now.get(k)
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


def structure_difference(saved: dict[str, Any], now: dict[str, Any]) -> str:
    """What differs between two model_structure() records, in words ("" if nothing)."""
    a, b = saved.get("layers", []), now.get("layers", [])
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return f"layer {i} is {y}, the checkpoint's {x}"
    if len(a) != len(b):
        extra = b[len(a)] if len(b) > len(a) else a[len(b)]
        return f"the model has {len(b)} layers, the checkpoint's {len(a)} (first unmatched: {extra})"
    for (name_a, shape_a), (name_b, shape_b) in zip(saved.get("shapes", []), now.get("shapes", []), strict=False):
        if (name_a, shape_a) != (name_b, shape_b):
            return f"parameter {name_b} has shape {tuple(shape_b)}, the checkpoint's {name_a} {tuple(shape_a)}"
    if len(saved.get("shapes", [])) != len(now.get("shapes", [])):
        return f"the model has {len(now.get('shapes', []))} parameter arrays, the checkpoint's " \
               f"{len(saved.get('shapes', []))}"
    return ""


class RunDirectory:
    """A checkpoint directory held by one run (rank 0): an exclusive lock for the run's life, the run's
    identity, and refusal of another run's checkpoints unless the run resumes them or starts over on
    purpose. What resuming decides to move aside or delete happens at the run's first checkpoint
    (:meth:`save`), so that a run refused during set-up leaves the directory as it was."""

    def __init__(self, directory: str, resume: str, overwrite: bool) -> None:
        self.path = Path(directory)
        self.overwrite = overwrite
        self.run_id = uuid.uuid4().hex[:12]
        self.lineage = {self.run_id}  # run ids whose checkpoints are this run's (pruned as it goes)
        self._pending: list[tuple[Path, Path | None]] = []  # (file, where it moves; None: deleted) at 1st save
        self.path.mkdir(parents=True, exist_ok=True)
        lock = self.path / LOCK
        if lock.exists() and not lock.is_file():
            raise UsageError(f"--checkpoint-dir {directory}: its lock file {lock} exists and is not a regular file; "
                             "remove it (mpisgd makes it)")
        try:
            self._lock = open(lock, "a+")  # noqa: SIM115 - held until close()
        except OSError as exc:
            raise UsageError(f"--checkpoint-dir {directory}: cannot open its lock file {lock} "
                             f"({exc.strerror or exc})") from None
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self._lock.seek(0)
            holder = self._lock.read().strip() or "another process"
            self._lock.close()
            raise UsageError(f"--checkpoint-dir {directory} is in use by another run ({holder}); "
                             "give each run its own directory") from None
        self._write_lock()
        remove_stale_temporaries(self.path, r"ckpt-\d{9}\.npz")
        existing = list_checkpoints(self.path)
        if existing and resume == "no":
            if not overwrite:
                raise UsageError(f"--checkpoint-dir {directory} holds another run's checkpoints ({existing[0].name}, "
                                 f"{len(existing)} in all): pass --resume auto to continue that run, or "
                                 "--overwrite-checkpoints to start over (they are deleted)")
            for p in existing:
                p.unlink()

    def _write_lock(self) -> None:
        self._lock.seek(0)
        self._lock.truncate()
        self._lock.write(f"pid {os.getpid()} on {os.uname().nodename}, job {os.environ.get('SLURM_JOB_ID', '-')}, "
                         f"run {self.run_id}\n")
        self._lock.flush()

    def find_resume(self, resume: str) -> tuple[TrainState | None, str, list[str]]:
        """find_resume() in this directory, then what continuing the state found means for it (adopt())."""
        state, path, warnings = find_resume(resume, str(self.path), self.overwrite)
        if state is not None:
            return state, path, warnings + self.adopt(state, path)
        found = list_checkpoints(self.path) if resume == "auto" else []
        if found:  # none loads, and --overwrite-checkpoints: the run starts over
            self._pending += [(p, None) for p in found]
            warnings.append(f"--overwrite-checkpoints: none of the {len(found)} checkpoint(s) in {self.path} can be "
                            "read; they are deleted when this run writes its first checkpoint")
        return state, path, warnings

    def adopt(self, state: TrainState, path: str) -> list[str]:
        """This run continues ``state`` (read from ``path``): it takes that run's identity. Refuses
        (CheckpointError) a directory holding another run's checkpoints, unless --overwrite-checkpoints
        (they are deleted); the run's own checkpoints later than ``state`` (a roll-back) are moved to
        ``abandoned/``. Returns what the user should be told."""
        if state.run_id:
            self.run_id, self.lineage = state.run_id, {state.run_id}
        else:  # a checkpoint older than run ids: its directory's other such checkpoints are the same run's
            self.lineage = {self.run_id, ""}
        self._write_lock()
        notes = []
        here = [(p, run_id_of(p)) for p in list_checkpoints(self.path)]
        others = [p for p, rid in here if rid is not None and rid not in self.lineage and not _same_file(p, path)]
        if others:
            if not self.overwrite:
                raise CheckpointError(
                    f"--checkpoint-dir {self.path} holds another run's checkpoints ({others[0].name}, {len(others)} "
                    f"in all), not those of the run {path} continues: give the resumed run its own --checkpoint-dir, "
                    "or pass --overwrite-checkpoints to delete them")
            self._pending += [(p, None) for p in others]
            notes.append(f"--overwrite-checkpoints: another run's {len(others)} checkpoint(s) in {self.path} are "
                         "deleted when this run writes its first checkpoint")
        later = [p for p, rid in here if rid in self.lineage and _step(p) > state.global_step]
        if later:
            dest = self.path / ABANDONED
            self._pending += [(p, dest) for p in later]
            notes.append(f"resume: rolling back to step {state.global_step}: this run's later checkpoints "
                         f"({', '.join(p.name for p in sorted(later))}) move to {dest}/ when it writes its first "
                         "checkpoint, so that --resume auto continues from here; nothing is deleted")
        return notes

    def save(self, state: TrainState, keep: int = 3) -> Path:
        """Write ``state`` as this run's checkpoint (save_checkpoint with this run's identity; pruning
        touches this run's own checkpoints only). A file of that name that is not this run's (unreadable,
        another version's) is moved to ``abandoned/``, never replaced."""
        self._apply_pending()
        state.run_id = self.run_id
        target = checkpoint_path(self.path, state.global_step)
        if target.exists() and run_id_of(target) not in self.lineage:
            _move(target, self.path / ABANDONED)
        return save_checkpoint(self.path, state, keep, lineage=self.lineage)

    def _apply_pending(self) -> None:
        while self._pending:
            p, dest = self._pending[0]
            if dest is None:
                p.unlink(missing_ok=True)
            elif p.exists():
                _move(p, dest)
            self._pending.pop(0)

    def close(self) -> None:
        if not self._lock.closed:
            fcntl.flock(self._lock, fcntl.LOCK_UN)
            self._lock.close()


def _same_file(a: Path, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _move(p: Path, directory: Path) -> Path:
    """Move ``p`` into ``directory`` under its name (name-1, name-2... if taken: nothing is replaced)."""
    directory.mkdir(exist_ok=True)
    dest = _free_name(directory, p.name)
    os.rename(p, dest)
    return dest


@dataclass
class ResumePlan:
    """How a run continues from a checkpoint (decided on rank 0, then broadcast)."""

    path: str
    global_step: int
    epoch: int
    step_in_epoch: int
    skipped_steps: int
    optimizer_state: dict[str, float]  # the optimizer's scalars (its buffers: rank 0 reads, then broadcasts)
    world_size: int  # the checkpoint's k
    batch_size: int  # this run's b and m: as given, or derived to keep the checkpoint's B
    accum_steps: int
    changes: list[str]  # differences from the checkpoint's run that --resume-allow accepted
    derived: str  # what was derived, for the banner ("" if nothing)
    grad_exponents: list[int] | None = None  # reproducible: the next step's fixed-point exponents
    environment: dict[str, Any] = field(default_factory=dict)  # the checkpoint's (BLAS, threads, CPU)


def divisors(n: int, limit: int = 1 << 20) -> tuple[list[int], bool]:
    """The divisors of ``n`` in increasing order, by trial division up to min(sqrt(n), limit); the flag
    says whether the list is complete (False: only those <= limit and their cofactors)."""
    small, large, d = [], [], 1
    root = math.isqrt(n)
    while d <= min(root, limit):
        if n % d == 0:
            small.append(d)
            if d != n // d:
                large.append(n // d)
        d += 1
    return small + large[::-1], root <= limit


def plan_resume(state: TrainState, path: str, config: dict[str, Any], given: set[str], allowed: tuple[str, ...],
                k: int, data: dict[str, Any], structure: dict[str, Any] | None = None) -> ResumePlan:
    """Check that this run (``config`` at k ranks, on ``data``, building the model ``structure``, from
    model_structure()) can continue the checkpoint's, and find its b and m: the same effective batch
    B = k*b*m keeps the data order and the schedule; where the user gave neither --batch-size nor
    --accum-steps they are derived from B (keeping b in a reproducible run, whose bits depend on it), and
    where --batch-size alone, m follows from B. CheckpointError says what to change. The model's structure is
    compared when both are known (older checkpoints hold none); the checkpoint's position must lie
    within this run."""
    B, old_k = state.effective_batch, state.world_size
    old_b, old_m = state.config.get("batch_size"), state.config.get("accum_steps", 1)
    b, m, derived = config["batch_size"], config["accum_steps"], ""
    if structure is not None and state.structure:
        diff = structure_difference(state.structure, structure)
        if diff:
            raise CheckpointError(f"this run's model differs from the checkpoint's ({path}): {diff}; a resumed run "
                                  "must build the same layers")
    n_train = data.get("n_train")
    if isinstance(n_train, int) and B > n_train:
        raise CheckpointError(f"{path}: the checkpoint's effective batch B={B} is larger than this run's training "
                              f"set ({n_train} samples)")
    if k * b * m != B and "batch_size" in given and "accum_steps" not in given and B % (k * b) == 0:
        m = B // (k * b)  # --batch-size given: the micro-batches follow from B and k
        derived = f"m={m} derived to keep B={B} (the checkpoint's run: k={old_k}, b={old_b}, m={old_m})"
    elif k * b * m != B:
        if given & {"batch_size", "accum_steps"}:
            raise CheckpointError(
                f"the checkpoint's run has effective batch B={B} (k={old_k} x b={old_b} x m={old_m}), this run "
                f"k*b*m={k * b * m}: resuming needs the same B, so that the data order and the schedule continue; "
                f"pass --batch-size and --accum-steps with {k} x b x m = {B}, or neither, and they are derived")
        if config.get("reproducible") and old_b and B % (k * old_b) == 0:
            fits = [B // (k * old_b)]  # the same micro-batches of b samples: the same bits on any k
        else:
            fits = [mm for mm in dict.fromkeys((old_m, 1)) if B % (k * mm) == 0]
        if not fits:
            ks, complete = divisors(B)
            more = ", ..." if len(ks) > 16 or not complete else ""
            raise CheckpointError(f"the checkpoint's effective batch B={B} cannot be split over k={k} ranks: k must "
                                  f"divide B ({', '.join(map(str, ks[:16]))}{more})")
        b, m = B // (k * fits[0]), fits[0]
        derived = f"b={b}, m={m} derived to keep B={B} (the checkpoint's run: k={old_k}, b={old_b}, m={old_m})"
    if isinstance(n_train, int):
        _check_position(state, path, config, n_train // B)
    saved_data, now_data = _comparable(state.data, data)
    saved = dict(state.config, data=saved_data)
    now = dict(config, data=now_data if state.data else {})  # checkpoints of older versions hold no data identity
    changes = identity_changes(saved, now, allowed)
    exponents = None if state.grad_exponents is None else [int(e) for e in state.grad_exponents]
    return ResumePlan(path, state.global_step, state.epoch, state.step_in_epoch, state.skipped_steps,
                      state.optimizer_state, old_k, b, m, changes, derived, exponents, state.environment)


def _check_position(st: TrainState, path: str, config: dict[str, Any], spe: int) -> None:
    """The checkpoint's place (epoch, step within it, step count) lies within this run of ``spe`` steps
    per epoch: a position past the last epoch with steps still to do would train nothing and report
    success."""
    epochs, max_steps = config.get("epochs"), config.get("max_steps")
    if st.step_in_epoch >= spe:
        raise CheckpointError(f"{path}: its position, step {st.step_in_epoch} of epoch {st.epoch + 1}, lies past the "
                              f"end of an epoch of this run ({spe} steps): a checkpoint edited by hand, or a smaller "
                              "data set?")
    if isinstance(epochs, int):
        total = epochs * spe if max_steps is None else min(max_steps, epochs * spe)
        if st.epoch >= epochs and st.global_step < total:
            raise CheckpointError(f"{path}: its position, epoch {st.epoch + 1}, is past this run's last epoch "
                                  f"({epochs}) although only {st.global_step} of its {total} steps are done: a "
                                  "checkpoint edited by hand?")


def _comparable(saved: dict[str, Any], now: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Two data identities to compare: fingerprints of different kinds (an older checkpoint's) are left
    out of both, so that the name and sizes still are compared."""
    if saved.get("fingerprint_version") == now.get("fingerprint_version"):
        return saved, now
    strip = ("fingerprint", "fingerprint_version")
    return ({k: v for k, v in saved.items() if k not in strip}, {k: v for k, v in now.items() if k not in strip})

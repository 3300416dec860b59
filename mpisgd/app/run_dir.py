"""A checkpoint directory that belongs to one run: locked, pruned only of its own checkpoints, and
rolled back without deleting anything (``RunDirectory``)."""

from __future__ import annotations

import fcntl
import os
import uuid
from pathlib import Path

from mpisgd.checkpoint import (
    LOCK,
    CheckpointError,
    TrainState,
    checkpoint_path,
    find_resume,
    list_checkpoints,
    run_id_of,
    save_checkpoint,
    step_of,
)
from mpisgd.errors import UsageError
from mpisgd.files import remove_stale_temporaries
from mpisgd.model_file import free_name

ABANDONED = "abandoned"  # where a roll-back moves the later checkpoints it abandons (never deleted)


class RunDirectory:
    """A checkpoint directory held by one run (rank 0): an exclusive lock for the run's life, the run's
    identity, and refusal of another run's checkpoints unless the run resumes them or starts over on
    purpose. What resuming decides to move aside or delete happens at the run's first checkpoint
    (:meth:`save`), so that a run refused during set-up leaves the directory as it was: :meth:`release`
    also removes the lock file and the directories it made."""

    def __init__(self, directory: str, resume: str, overwrite: bool) -> None:
        self.path = Path(directory)
        self.overwrite = overwrite
        self.run_id = uuid.uuid4().hex[:12]
        self.lineage = {self.run_id}  # run ids whose checkpoints are this run's (pruned as it goes)
        self._pending: list[tuple[Path, Path | None]] = []  # (file, where it moves; None: deleted) at 1st save
        self._made = [d for d in (self.path, *self.path.parents) if not d.exists()]  # deepest first
        self.path.mkdir(parents=True, exist_ok=True)
        lock = self._lock_path = self.path / LOCK
        self._made_lock = not lock.exists()
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
                self.release()
                raise UsageError(f"--checkpoint-dir {directory} holds another run's checkpoints ({existing[0].name}, "
                                 f"{len(existing)} in all): pass --resume auto to continue that run, or "
                                 "--overwrite-checkpoints to start over (they are deleted)")
            self._pending += [(p, None) for p in existing]  # at the first save: a run refused later deletes nothing

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
        later = [p for p, rid in here if rid in self.lineage and step_of(p) > state.global_step]
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

    def release(self) -> None:
        """The run was refused before its first checkpoint: let go of the directory and leave it as it
        was found. The lock file goes if this run made it (while still held, so no other run holds it),
        then the directories this run made, where they are still empty."""
        if self._made_lock and not self._lock.closed:
            self._lock_path.unlink(missing_ok=True)
        self.close()
        for d in self._made:
            try:
                d.rmdir()
            except OSError:  # not empty (someone else's files), or gone: left as it is
                break


def _same_file(a: Path, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _move(p: Path, directory: Path) -> Path:
    """Move ``p`` into ``directory`` under its name (name-1, name-2... if taken: nothing is replaced)."""
    directory.mkdir(exist_ok=True)
    dest = free_name(directory, p.name)
    os.rename(p, dest)
    return dest

"""Ending the whole job from one rank, without losing what that rank just printed."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

# MPICH 5's hydra can tear down a rank's stdio forwarding as soon as it hears of MPI_Abort, dropping
# the lines the rank wrote just before (docs/failures.md, "A rank that raises, disappears or stalls").
# A short pause lets the launcher forward them first; it costs nothing on the normal path.
GRACE_S = 1.0
# The last resort: a rank whose MPI_Abort has not ended it by then kills itself. The launcher
# (hydra, Open MPI's prterun, srun) sees a rank die by a signal and ends the others, so a stuck
# Abort (an MPI library lock held forever, a lost PMI connection) cannot become a hang.
DEADLINE_S = 10.0


def abort_job(comm: Any, code: int, *, grace_s: float | None = None, deadline_s: float | None = None) -> None:
    """Flush our streams, give the launcher ``grace_s`` to forward them, then ``MPI_Abort(comm, code)``;
    if this process still lives ``deadline_s`` after the pause, it SIGKILLs itself."""
    grace_s = GRACE_S if grace_s is None else grace_s
    deadline_s = DEADLINE_S if deadline_s is None else deadline_s
    _flush()
    reaper = threading.Timer(grace_s + deadline_s, _kill_self, args=(deadline_s,))
    reaper.daemon = True
    reaper.start()
    time.sleep(grace_s)
    comm.Abort(code)


def _kill_self(deadline_s: float) -> None:
    print(f"mpisgd: MPI_Abort did not end this rank within {deadline_s:g} s; killing it (SIGKILL) so "
          "that the launcher ends the job", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken stream must not stop the abort
            pass


def fail_alone(exc: BaseException, comm: Any, code: int = 1) -> None:
    """An error on this rank only: print it with the rank's name and traceback, then end the whole job,
    so that no other rank waits for ever in a collective this one will never reach."""
    rank, size = comm.Get_rank(), comm.Get_size()
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).rstrip()
    print(f"mpisgd: rank {rank} of {size} failed:\n{text}", file=sys.stderr, flush=True)
    if size > 1:
        print(f"mpisgd: rank {rank} aborts the job (MPI_Abort) so that no rank waits for ever",
              file=sys.stderr, flush=True)
        abort_job(comm, code)


@contextmanager
def guard(comm: Any) -> Iterator[None]:
    """For your own training script: an exception on any rank inside the block (a bad label, a shape
    error) ends the whole job with that rank's message instead of leaving the others waiting in the
    next collective. Use it around the whole script (``with mpisgd.guard(comm): ...``)."""
    try:
        yield
    except BaseException as exc:
        if comm.Get_size() > 1 and not (isinstance(exc, SystemExit) and exc.code in (0, None)):
            fail_alone(exc, comm)
        raise

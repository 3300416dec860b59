"""Ending the whole job from one rank, without losing what that rank just printed."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Any

# MPICH 5's hydra can tear down a rank's stdio forwarding as soon as it hears of MPI_Abort, dropping
# the lines the rank wrote just before (seen about 1 in 12 aborts on a loaded 2-core machine). A short
# pause lets the launcher forward them first; it costs nothing on the normal path.
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

"""Signals: Ctrl-C ends the job at once; SIGTERM (a scheduler's warning) stops it at a step, with a checkpoint.

Python runs signal handlers in the main thread between bytecodes only, and a
rank waiting inside an MPI call for a peer that has gone never returns to
bytecode: a handler could then never run, and the job would hang. So both
signals are blocked in every thread before MPI starts (its threads inherit the
mask), and one thread of ours waits for them (``sigwait``) and acts at once:

- SIGINT: this rank prints one line and ends the whole job (``MPI_Abort``),
  exit 130. When every rank got it (Ctrl-C to mpiexec, which forwards it),
  rank 0 speaks and aborts first, the others a moment later, so one line shows.
- SIGTERM (or SIGUSR1, which Open MPI's mpirun forwards without killing the
  ranks a second later): :attr:`Signals.stop_requested` is set; the per-step check-in tells
  every rank, and they stop together at the next step, write a checkpoint and
  exit with :data:`EXIT_PREEMPTED` (or 143 when no checkpoint of that step could
  be written). If the job makes no progress for ``TERM_GRACE_S`` (a peer stuck or
  gone: the loop calls :meth:`Signals.note_progress` at each step, evaluation
  batch and set-up stage, so a long evaluation is not "stuck"), or on a second
  SIGTERM, the rank aborts it, and the job's exit status is 143.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from typing import Any

from mpisgd.abort import abort_job

EXIT_INTERRUPTED = 128 + signal.SIGINT  # 130, the shell's code for Ctrl-C
EXIT_PREEMPTED = 75  # EX_TEMPFAIL: stopped on request, checkpoint written; run again with --resume auto
EXIT_TERMINATED = 128 + signal.SIGTERM  # 143: SIGTERM, and no clean stop was possible
TERM_GRACE_S = 25.0  # inside Slurm's default KillWait (30 s) before SIGKILL
# SIGUSR1 stops like SIGTERM: Open MPI's mpirun forwards a SIGTERM and SIGKILLs the ranks a second later,
# but passes SIGUSR1 on and keeps their exit status (docs/failures.md)
STOP = {signal.SIGTERM, signal.SIGUSR1}
WATCHED = {signal.SIGINT, *STOP}


class Signals:
    """Create with :meth:`block` before MPI is initialised, then :meth:`start` with the job's communicator."""

    def __init__(self) -> None:
        self.stop_requested = False
        self.stop_signal = "SIGTERM"  # which signal asked to stop (SIGTERM or SIGUSR1), for the message
        self.comm: Any = None
        self.exit_code: int | None = None  # set once this rank ends the job: what the process must exit with
        self._last_progress = time.monotonic()

    def note_progress(self) -> None:
        """The job is moving (a step, an evaluation batch, a set-up stage): a SIGTERM's grace restarts."""
        self._last_progress = time.monotonic()

    @classmethod
    def block(cls) -> Signals:
        signal.pthread_sigmask(signal.SIG_BLOCK, WATCHED)
        return cls()

    def start(self, comm: Any) -> None:
        self.comm = comm
        threading.Thread(target=self._watch, name="mpisgd-signals", daemon=True).start()

    def _watch(self) -> None:
        while True:
            sig = signal.sigwait(WATCHED)
            if sig in STOP and not self.stop_requested:
                self.stop_signal = signal.Signals(sig).name
                self._last_progress = time.monotonic()
                self.stop_requested = True
                threading.Thread(target=self._grace, name="mpisgd-term-grace", daemon=True).start()
            elif sig in STOP:
                self._end(EXIT_TERMINATED, f"a second {signal.Signals(sig).name}")
            else:
                self._end(EXIT_INTERRUPTED, "interrupted (SIGINT)")

    def _grace(self) -> None:
        """After a SIGTERM: end the job once it has made no progress for TERM_GRACE_S."""
        while True:
            idle = time.monotonic() - self._last_progress
            if idle > TERM_GRACE_S:
                self._end(EXIT_TERMINATED, f"SIGTERM: the job made no progress for {TERM_GRACE_S:g} s")
                return
            time.sleep(min(1.0, TERM_GRACE_S - idle + 0.01))

    def _end(self, code: int, why: str) -> None:
        self.exit_code = code
        rank = self.comm.Get_rank()
        if rank != 0:
            time.sleep(0.3)  # if rank 0 got the signal too, its abort ends us before we speak
        print(f"mpisgd: {why} on rank {rank}: ending the job (exit {code})", file=sys.stderr, flush=True)
        abort_job(self.comm, code, grace_s=0.2)

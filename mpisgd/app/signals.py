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
  every rank (:meth:`Signals.stop_word` travels in it, naming the signal), and they stop together at the
  next step, write a checkpoint and exit with :data:`EXIT_PREEMPTED` (or 143 when no checkpoint of that
  step could be written). The job's grace, ``TERM_GRACE_S`` without progress (a peer stuck or gone: the
  loop calls :meth:`Signals.note_progress` at each step and evaluation batch), runs from the end of
  set-up: a set-up stage may take longer (loading data, a checkpoint), and one that is stuck is the
  stall watchdog's (``--stall-abort-s``). Past the grace the rank aborts the job: 143 (not once every
  rank has agreed to stop: writing a large checkpoint may take longer; the watchdog bounds that).
- A second SIGTERM or SIGUSR1 before every rank has agreed to stop: the next check-in stops every rank
  at once, without a checkpoint, 143; a job that reaches no check-in within ``URGENT_S`` (a long step,
  set-up, a stuck rank) is aborted with 143. Once every rank has agreed to stop (:meth:`Signals.stopping`),
  further signals, SIGINT included, change nothing: every rank exits with that stop's code, so that no
  rank's 143 or 130 mixes with another's 75 (MPICH's launcher ORs the ranks' codes: 75 | 143 = 207).
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

from mpisgd.abort import abort_job

EXIT_INTERRUPTED = 128 + signal.SIGINT  # 130, the shell's code for Ctrl-C
EXIT_PREEMPTED = 75  # EX_TEMPFAIL: stopped on request, checkpoint written; run again with --resume auto
EXIT_TERMINATED = 128 + signal.SIGTERM  # 143: SIGTERM, and no clean stop was possible
TERM_GRACE_S = 25.0  # inside Slurm's default KillWait (30 s) before SIGKILL
URGENT_S = 2.0  # after a second stop signal: how long the job has to reach a check-in before it is aborted
URGENT = 1000  # added to a stop word after a second signal: stop at once, no checkpoint
# SIGUSR1 stops like SIGTERM: Open MPI's mpirun forwards a SIGTERM and SIGKILLs the ranks a second later,
# but passes SIGUSR1 on and keeps their exit status (docs/failures.md)
STOP = {signal.SIGTERM, signal.SIGUSR1}
WATCHED = {signal.SIGINT, *STOP}


@dataclass(frozen=True)
class Stop:
    """What the ranks agreed at a check-in: which signal asked, and whether a second one asked to end at once."""

    signal: str  # "SIGTERM" or "SIGUSR1"
    urgent: bool  # a second stop signal: stop without a checkpoint (143)

    @classmethod
    def of(cls, word: int) -> Stop:
        """The stop a check-in's largest stop word (Signals.stop_word, > 0) says."""
        return cls(signal.Signals(word % URGENT).name, word >= URGENT)


class Signals:
    """Create with :meth:`block` before MPI is initialised, then :meth:`start` with the job's communicator."""

    def __init__(self) -> None:
        self.stop_requested = False
        self.stop_signal = "SIGTERM"  # which signal asked to stop (SIGTERM or SIGUSR1), for the message
        self.urgent = False  # a second stop signal came before every rank agreed to stop
        self.comm: Any = None
        self.exit_code: int | None = None  # set once this rank ends the job: what the process must exit with
        self._last_progress = time.monotonic()
        self._setting_up = True  # the grace runs from the end of set-up (training())
        self._agreed = False  # every rank agreed to stop at a check-in (stopping())
        self._lock = threading.Lock()  # between the signal thread's aborts and the loop's agreement

    def note_progress(self) -> None:
        """The job is moving (a step, an evaluation batch, a set-up stage): a SIGTERM's grace restarts."""
        self._last_progress = time.monotonic()

    def training(self) -> None:
        """Set-up is over: from now on a stop signal's grace counts the time without progress."""
        self._setting_up = False
        self.note_progress()

    def stop_word(self) -> int:
        """What this rank brings to the check-in: 0, or the stop signal's number (+ URGENT after a second one).
        The largest over the ranks decides (Stop.of)."""
        if not self.stop_requested:
            return 0
        return signal.Signals[self.stop_signal].value + (URGENT if self.urgent else 0)

    def stopping(self) -> bool:
        """Every rank agreed, at a check-in, to stop: from now on no signal ends this rank on its own. False
        when this rank is already ending the job (an abort under way)."""
        with self._lock:
            self._agreed = self.exit_code is None
            return self._agreed

    @classmethod
    def block(cls) -> Signals:
        signal.pthread_sigmask(signal.SIG_BLOCK, WATCHED)
        return cls()

    def start(self, comm: Any) -> None:
        self.comm = comm
        threading.Thread(target=self._watch, name="mpisgd-signals", daemon=True).start()

    def _watch(self) -> None:
        while True:
            self.on_signal(signal.sigwait(WATCHED))

    def on_signal(self, sig: int) -> None:
        """What a signal does (the signal thread calls it; see the module's doc)."""
        name = signal.Signals(sig).name
        if self._agreed:
            _say(f"mpisgd: {name} on rank {self._rank()} while every rank is stopping: it changes nothing, the job "
                 "ends with its stop's exit code")
        elif sig in STOP and not self.stop_requested:
            self.stop_signal = name
            self._last_progress = time.monotonic()
            self.stop_requested = True
            threading.Thread(target=self._grace, name="mpisgd-term-grace", daemon=True).start()
        elif sig in STOP:
            self.urgent = True  # the next check-in stops every rank at once
            threading.Thread(target=self._end_unless_stopped, name="mpisgd-urgent", daemon=True).start()
        else:
            self._end(EXIT_INTERRUPTED, "interrupted (SIGINT)")

    def _end_unless_stopped(self) -> None:
        """After a second stop signal: abort the job unless a check-in stops it within URGENT_S."""
        time.sleep(URGENT_S)
        self._end(EXIT_TERMINATED, f"a second {self.stop_signal} and no step boundary within {URGENT_S:g} s")

    def _grace(self) -> None:
        """After a SIGTERM: end the job once it has made no progress for TERM_GRACE_S since set-up ended."""
        while True:
            if self._setting_up:
                self._last_progress = time.monotonic()
            idle = time.monotonic() - self._last_progress
            if idle > TERM_GRACE_S:
                self._end(EXIT_TERMINATED, f"{self.stop_signal}: the job made no progress for {TERM_GRACE_S:g} s")
                return
            time.sleep(min(1.0, TERM_GRACE_S - idle + 0.01))

    def _rank(self) -> int:
        return self.comm.Get_rank() if self.comm is not None else 0

    def _end(self, code: int, why: str) -> None:
        """Abort the job with ``code``, unless every rank has agreed to stop meanwhile."""
        with self._lock:
            if self._agreed or self.exit_code is not None:
                return
            self.exit_code = code
        rank = self._rank()
        if rank != 0:
            time.sleep(0.3)  # if rank 0 got the signal too, its abort ends us before we speak
        _say(f"mpisgd: {why} on rank {rank}: ending the job (exit {code})")
        abort_job(self.comm, code, grace_s=0.2)


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)

"""A stall watchdog for collectives, like Horovod's stall check.

``Watchdog(comm, timeout_s, abort)`` watches each blocking collective of the
training loop::

    with watchdog.watching("gradient all-reduce of step 12"):
        ...wait for the all-reduce...

Each rank numbers its collectives (1, 2, 3, ...); since all ranks run the same
collectives in the same order, equal numbers mean the same collective. On
``enter`` a rank other than 0 posts one small non-blocking message ("I entered
collective S") to rank 0 on a duplicate of ``comm``. A daemon thread on rank 0
receives them, so it knows how far each rank got. When the newest collective
has waited longer than ``timeout_s`` and some ranks have not entered it, rank 0
prints::

    mpisgd: stall: gradient all-reduce of step 12 waited 30.0 s; ranks [0, 2] reached it, ranks [1] have not

and calls ``Abort(1)`` if ``abort``; it tells the other ranks that it reported.
A rank that waits twice as long without hearing from rank 0 (rank 0 may itself
be stuck holding the GIL) reports its own wait and, with ``abort``, aborts the
job itself.

``watching`` (``enter``, then ``exit`` also when the block raises) never
blocks and never starts collectives: one ``isend`` on ranks > 0, a few
attribute writes on rank 0. The thread needs
``MPI_THREAD_MULTIPLE`` (what mpi4py asks for by default); with less, only the
local part (each rank timing its own wait) runs, and the report names no ranks.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from mpisgd.abort import abort_job

TAG = 7_340  # our own duplicate communicator: no other traffic can match it
PENDING_PRUNE = 64  # completed sends are dropped once this many accumulate
CLOSING_POLL_S = 0.001  # rank 0's thread, once closing, probes for the others' "close" this often


class Watchdog:
    def __init__(self, comm: Any, timeout_s: float, abort: bool = False, abort_comm: Any = None,
                 abort_after_s: float = 0.0) -> None:
        """``timeout_s`` (0: no report): report a collective that waited that long; ``abort``: end the job
        when the stall is reported; ``abort_after_s`` (0: never): end it when a rank has waited that long
        in one collective, reported or not (the bound on every wait). ``abort_comm``: what to MPI_Abort (the
        application's world communicator). Aborting a duplicate ends only the local rank when a node is
        unreachable, and the launcher then waits. :meth:`configure` changes the three later (the CLI makes
        its watchdog before it has read its options)."""
        _check_bounds(timeout_s, abort_after_s)
        from mpi4py import MPI  # noqa: PLC0415 - only needed once a watchdog is made

        self._MPI = MPI
        self.comm = comm.Dup()
        self.abort_comm = comm if abort_comm is None else abort_comm
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self.configure(timeout_s, abort, abort_after_s)
        self.threaded = MPI.Query_thread() >= MPI.THREAD_MULTIPLE  # may the thread call MPI?
        # this rank's current wait (written by the main thread, read by ours)
        self._seq = 0
        self._what = ""
        self._t_enter = 0.0
        self._waiting = False
        self._pending: list[Any] = []  # isend requests not yet known to be complete
        self._notices: list[Any] = []  # rank 0's "reported" messages to the others
        # rank 0's view: the last collective each rank entered, and when/what each collective was first seen
        self._entered = [0] * self.size
        self._where = [""] * self.size  # what each rank entered last, to say where a missing rank is
        self._first_seen: dict[int, tuple[float, str]] = {}
        self._closes = 0
        self._reported = 0  # the newest collective already reported (by number), by us or by rank 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if self.size > 1:
            self._thread = threading.Thread(target=self._run, name="mpisgd-watchdog", daemon=True)
            self._thread.start()

    def configure(self, timeout_s: float, abort: bool = False, abort_after_s: float = 0.0) -> None:
        """Set the bounds (this rank's; every rank keeps watching and reporting to rank 0 alike, so ranks
        given other bounds still agree on the protocol). Both 0: nothing is reported or aborted."""
        _check_bounds(timeout_s, abort_after_s)
        self.timeout_s, self.abort, self.abort_after_s = float(timeout_s), abort, float(abort_after_s)
        self._poll_s = min(0.2, max(0.01, (self.timeout_s or self.abort_after_s or 4.0) / 20))

    # -- called by the training loop (main thread) ----------------------------------------
    @contextmanager
    def watching(self, what: str) -> Iterator[None]:
        """Watch the collective(s) inside the block, described by ``what``."""
        self.enter(what)
        try:
            yield
        finally:
            self.exit()

    def enter(self, what: str) -> None:
        """This rank starts waiting in a collective described by ``what``."""
        now = time.monotonic()
        self._seq += 1
        self._what, self._t_enter, self._waiting = what, now, True
        if self.size == 1:
            return
        if self.rank == 0:
            with self._lock:
                self._entered[0], self._where[0] = self._seq, what
                self._first_seen.setdefault(self._seq, (now, what))
        elif self.threaded:
            self._pending.append(self.comm.isend(("enter", self._seq, what), 0, TAG))
            if len(self._pending) >= PENDING_PRUNE:
                self._pending = [r for r in self._pending if not r.Test()]

    def exit(self) -> None:
        """The collective entered last has finished on this rank."""
        self._waiting = False
        if self.rank == 0 and self._reported == self._seq:
            _say(f"mpisgd: stall resolved: {self._what} finished after {time.monotonic() - self._t_enter:.1f} s")

    def close(self) -> None:
        """Stop the thread and free the duplicate communicator (every rank calls this)."""
        if self._thread is not None:
            # rank 0 waits here for every rank's "close": watched like a collective, so a rank that
            # stops after the last collective is still named (and aborted) instead of hanging rank 0
            with self.watching("shutdown (every rank closing the watchdog)"):
                if self.rank != 0 and self.threaded:
                    self._pending.append(self.comm.isend(("close",), 0, TAG))
                    self._MPI.Request.waitall(self._pending)
                    self._pending.clear()
                self._stop.set()
                while self._thread.is_alive():  # rank 0's thread leaves once every rank said close
                    self._thread.join(1.0)
                self._settle_notices()
        self.comm.Free()

    def _settle_notices(self) -> None:
        """Rank 0: let its "reported" messages complete; cancel those nobody received."""
        deadline = time.monotonic() + 2.0
        while self._notices and time.monotonic() < deadline:
            self._notices = [r for r in self._notices if not r.Test()]
            time.sleep(0.01)
        for r in self._notices:
            r.Cancel()
            r.Wait()
        self._notices.clear()

    # -- the thread -----------------------------------------------------------------------
    def _run(self) -> None:
        MPI = self._MPI
        status = MPI.Status()
        last = time.monotonic()
        while True:
            now = time.monotonic()
            if now - last > 1.0 + 5 * self._poll_s:  # this process was stopped (SIGSTOP) or starved meanwhile:
                self._t_enter += now - last  # the time it did not run is not time it waited for its peers
            last = now
            if self.threaded:
                while self.comm.iprobe(source=MPI.ANY_SOURCE, tag=TAG, status=status):
                    self._receive(self.comm.recv(source=status.Get_source(), tag=TAG), status.Get_source())
            if self._stop.is_set() and (self.rank != 0 or not self.threaded or self._closes == self.size - 1):
                return
            self._check(time.monotonic())
            if self._stop.is_set():  # closing: rank 0 only waits for the others' "close", which come at once
                time.sleep(CLOSING_POLL_S)
            else:  # woken by close() at once, so that a run ends without waiting out a poll
                self._stop.wait(self._poll_s)

    def _receive(self, msg: tuple, source: int) -> None:
        if msg[0] == "close":
            self._closes += 1
            return
        if msg[0] == "reported":  # on ranks > 0: rank 0 has printed the report of this collective
            self._reported = max(self._reported, msg[1])
            return
        _, seq, what = msg
        with self._lock:
            if seq > self._entered[source]:
                self._where[source] = what
            self._entered[source] = max(self._entered[source], seq)
            self._first_seen.setdefault(seq, (time.monotonic(), what))
            oldest = min(self._entered)
            for s in [s for s in self._first_seen if s < oldest]:
                del self._first_seen[s]  # everybody is past these

    def _check(self, now: float) -> None:
        if self.timeout_s:
            self._check_report(now)
        waited = now - self._t_enter
        if self._waiting and self.abort_after_s and waited > self.abort_after_s:
            _say(f"mpisgd: stall: rank {self.rank} has waited {waited:.1f} s in {self._what}, longer than the bound "
                 f"of {self.abort_after_s:g} s (--stall-abort-s)")
            self._abort(why="--stall-abort-s")

    def _check_report(self, now: float) -> None:
        """The stall report after timeout_s (rank 0's, naming the ranks; a rank's own after twice that)."""
        if self.rank == 0 and self.threaded:
            report = self._stall_report(now)
            if report:
                _say(report)
                if self.abort:
                    self._abort()
                self._notices += [self.comm.isend(("reported", self._reported), r, TAG)
                                  for r in range(1, self.size)]
        waited = now - self._t_enter
        if self._waiting and waited > 2 * self.timeout_s and self._reported < self._seq \
                and (self.rank != 0 or not self.threaded):
            self._reported = self._seq
            _say(f"mpisgd: stall: rank {self.rank} has waited {waited:.1f} s in {self._what}"
                 + ("" if self.rank == 0 else " and rank 0 has not reported which ranks reached it"))
            if self.abort:
                self._abort()

    def _stall_report(self, now: float) -> str | None:
        """Rank 0: the stall message for the newest collective, once, when it is overdue."""
        with self._lock:
            entered = list(self._entered)
            newest = max(entered)
            if newest <= self._reported or newest not in self._first_seen:
                return None
            t_first, what = self._first_seen[newest]
            reached = [r for r, s in enumerate(entered) if s >= newest]
            missing = [r for r, s in enumerate(entered) if s < newest]
            if missing:
                waited = now - t_first
                if waited <= self.timeout_s:
                    return None
                self._reported = newest
                where = "; ".join(f"rank {r} last reached {self._where[r] or 'no collective yet'}" for r in missing)
                return (f"mpisgd: stall: {what} waited {waited:.1f} s; ranks {reached} reached it, "
                        f"ranks {missing} have not ({where})")
            # everybody reached it: only rank 0's own wait tells whether it is stuck inside
            if not (self._waiting and self._seq == newest and now - self._t_enter > self.timeout_s):
                return None
            self._reported = newest
            return (f"mpisgd: stall: {what} waited {now - self._t_enter:.1f} s; all ranks {reached} reached it, "
                    "it has not finished (a rank stopped or lost inside it, the network, or MPI progress)")

    def _abort(self, why: str = "--stall-abort") -> None:
        _say(f"mpisgd: rank {self.rank} aborts the job ({why})")
        abort_job(self.abort_comm, 1)


class NullWatchdog:
    """The watchdog's interface, watching nothing (a library user who turned it off, k = 1)."""

    @contextmanager
    def watching(self, what: str) -> Iterator[None]:
        yield

    def configure(self, timeout_s: float, abort: bool = False, abort_after_s: float = 0.0) -> None: ...

    def close(self) -> None: ...


def _check_bounds(timeout_s: float, abort_after_s: float) -> None:
    if not (timeout_s >= 0 and abort_after_s >= 0):  # NaN fails too
        raise ValueError(f"stall bounds must be >= 0 seconds, got {timeout_s} and {abort_after_s}")


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def default_watchdog(comm: Any, timeout_s: float, abort_after_s: float) -> Watchdog | NullWatchdog:
    """The library's own watchdog over ``comm`` (reports after ``timeout_s``, ends the job after
    ``abort_after_s``), or a null one at k = 1 or when both are 0."""
    if comm.Get_size() == 1 or not (timeout_s or abort_after_s):
        return NullWatchdog()
    return Watchdog(comm, timeout_s or abort_after_s, abort_comm=comm, abort_after_s=abort_after_s)

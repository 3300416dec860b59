"""``auto``, the default: the node-shared buffer where there is one, else mpi or ring, whichever measured faster.

Every path it takes (the table in :mod:`mpisgd.comm` says the same):

1. Every rank on one node: a buffer in the node-shared window (where data
   parallelism keeps its gradients) is summed there by ``shared``, all-reduce
   and reduce-scatter alike, in rank order.
2. Any other buffer takes ``mpi`` or ``ring`` per operation (all-reduce;
   reduce-scatter, where the ring's is a full all-reduce and a copy, but MPI's
   can still be the slower one), dtype and size class (2^(c-1) to 2^c - 1
   bytes), whichever measured faster there (below).
3. Nothing to choose, nothing measured: one rank (``mpi``); a dtype MPI cannot
   sum (``ring``); ``deterministic=True`` at k >= 3 (``deterministic`` for every
   buffer outside the window, whose sums are in the same rank order: the same
   bits).

Measuring a class, when it is first seen: both candidates run on that call's
data, alternating, :func:`trials_for` times each; each rank keeps each one's
median and the spread of its calls; the slowest rank's figures decide (one
small all-reduce, so every rank picks alike); the data are put back.
Non-blocking buffers are decided when data parallelism calls :meth:`tune`.

Choices persist in the tuning file (:mod:`mpisgd.comm.tuning`): a later run on the same
machines trusts a recent, clear choice made on a quiet machine, re-checks with a few calls one that is
old, was timed on a busy machine or comes from an older format, and re-measures one whose margin was
inside the noise (docs/allreduce.md, "The tuning file"). Rank 0 reads it at construction and writes it in
:meth:`AutoReducer.tune` and :meth:`AutoReducer.close`, never inside an all-reduce; the banner names
where the choices came from.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from mpi4py import MPI

from mpisgd.backend import sync, xp_of
from mpisgd.comm.base import Array, Handle, Reducer, chunk_counts, node_layout
from mpisgd.comm.deterministic import DeterministicReducer
from mpisgd.comm.mpi import MpiReducer, mpi_sum_type
from mpisgd.comm.ring import RingReducer
from mpisgd.comm.shared import SharedReducer
from mpisgd.comm.tuning import (
    BUSY_TASKS,
    CANDIDATES,
    TuningFile,
    is_clear,
    measured_on,
    rechecked,
    rounded,
    stamp,
    tuning_path,
)

RECHECK_TRIALS = 3  # calls of each candidate to re-check a choice
OPERATIONS = ("allreduce", "reduce_scatter")
_UNKNOWN = -1.0  # "the system does not say how busy it is", through a MAX all-reduce of non-negative loads


def trials_for(nbytes: int) -> int:
    """Timed calls of each candidate for a new class: most from 64 KiB to 16 MiB, where the two are closest
    and the machine's state moves them most, fewest above, where a call is long and the ring far ahead.
    A function of the size only, so that every rank makes the same calls."""
    return 11 if nbytes <= 64 << 10 else 21 if nbytes <= 16 << 20 else 3


def _human(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):g} {unit}"
    return f"{n} B"


def runnable_tasks() -> int | None:
    """Tasks running or ready to run on this machine now (Linux: /proc/loadavg), None where unknown."""
    try:
        with open("/proc/loadavg", "rb") as f:
            return int(f.read().split()[3].split(b"/")[0])
    except (OSError, ValueError, IndexError):
        return None


@dataclass(frozen=True)
class Timing:
    """Both candidates' median time (s) at the slowest rank, the widest relative spread of their calls
    (interquartile range over median, any rank), and the runnable tasks beyond the CPUs meanwhile (the
    busiest node's mean; None where the system does not say). The same on every rank."""

    median_s: tuple[float, float]
    spread: float
    overload: float | None

    @property
    def winner(self) -> str:
        return CANDIDATES[int(self.median_s[1] < self.median_s[0])]

    @property
    def ratio(self) -> float:
        return max(self.median_s) / min(self.median_s)

    @property
    def clear(self) -> bool:
        return is_clear(self.ratio, self.spread)

    @property
    def busy(self) -> bool:
        return self.overload is not None and self.overload > BUSY_TASKS

    def record(self, choice: str, trials: int, now: float) -> dict[str, Any]:
        """The tuning file's entry for a choice made on these figures."""
        return {"choice": choice, "measured": stamp(now), "trials": trials,
                "median_us": {c: round(t * 1e6, 3) for c, t in zip(CANDIDATES, self.median_s)},
                "ratio": round(self.ratio, 4), "spread": round(self.spread, 4),
                "overload": rounded(self.overload)}


class AutoReducer(Reducer):
    name = "auto"
    native_reduce_scatter = True  # MPI's true reduce-scatter is a candidate; the ring's runs where it measured faster

    def __init__(self, comm: Any, *, tuning_file: str | None = None, deterministic: bool = False) -> None:
        """``tuning_file``: the tuning file's path (:func:`mpisgd.comm.tuning.tuning_path`: by default
        $MPISGD_TUNING_FILE, else ~/.cache/mpisgd/allreduce-tuning.json; "off": none), rank 0's."""
        super().__init__(comm)
        _, self.local_size, _, nodes = node_layout(self.comm)
        self.mpi, self.ring = MpiReducer(self.comm), RingReducer(self.comm)
        self.det = DeterministicReducer(self.comm) if deterministic and self.size > 2 else None
        self.shared = SharedReducer(self.comm) if self.size > 1 and nodes == 1 else None
        self.by_name: dict[str, Reducer] = {"mpi": self.mpi, "ring": self.ring}
        if self.det is not None:
            self.by_name["deterministic"] = self.det
        self.routes: dict[int, tuple[Any, Reducer]] = {}  # all-reduce nbytes -> (dtype, reducer), as its class decided
        self.scatter_routes: dict[int, tuple[Any, Reducer]] = {}  # the same for reduce-scatter
        self.choices: dict[str, str] = {}  # "allreduce float32:23" -> "mpi" | "ring" | ...: this run's choices
        self.origin: dict[str, str] = {}  # -> "measured", "tuned", "re-checked", "re-measured" or "fixed: why"
        self.records: dict[str, dict[str, Any]] = {}  # -> what the tuning file keeps, for entries made in this run
        self.new_records = False  # records made since the last tune() (the same on every rank)
        self.unwritten = False  # records the tuning file does not hold yet (rank 0's concern)
        self.busy = False  # some timing in this run saw a busy machine
        hosts = ",".join(sorted(set(self.comm.allgather(MPI.Get_processor_name()))))
        self.tuning_key = f"{' '.join(MPI.Get_library_version().split()[:3])} | k={self.size} | {hosts}"
        self.tuning: TuningFile | None = None  # rank 0's, once read and found to be ours (or absent)
        loaded: tuple[dict[str, tuple[Any, str]], str] | None = None
        if self.rank == 0:  # rank 0's environment decides for every rank
            if self.size == 1 or self.det is not None:  # nothing that a tuning file would decide
                loaded = {}, ""
            else:
                self.tuning, entries, note = TuningFile.load(tuning_path(tuning_file), self.tuning_key)
                loaded = entries, note
        self.loaded, self.note = self.comm.bcast(loaded, root=0)

    def _save(self) -> None:
        """Rank 0 merges this run's entries into the tuning file (TuningFile.save)."""
        if self.rank != 0 or self.tuning is None or not self.unwritten:
            return
        note = self.tuning.save(self.records)
        if not self.tuning.ours:
            self.tuning = None
        if note:
            self.note = note
            return
        self.unwritten = False

    def _fixed(self, dtype: Any) -> tuple[str, str] | None:
        """(strategy, why) where there is nothing to measure."""
        if self.det is not None:
            return "deterministic", "deterministic"
        if self.size == 1:
            return "mpi", "one rank"
        if mpi_sum_type(dtype) is None:
            return "ring", f"MPI cannot sum {dtype}"
        return None

    def _decide(self, op: str, dtype: Any, nbytes: int, compare: Callable[[int], Timing]) -> str:
        """The strategy for op on a buffer of this dtype and size (collective the first time its class is
        seen: every rank makes the same calls and reads the same reduced figures, so all decide alike)."""
        name = f"{op} {dtype}:{nbytes.bit_length()}"
        choice = self.choices.get(name)
        if choice is not None:
            return choice
        fixed = self._fixed(dtype)
        if fixed is not None:
            choice, origin = fixed[0], f"fixed: {fixed[1]}"
        else:
            entry, status = self.loaded.get(name, (None, "measure"))
            choice, origin = self._settle(name, entry, status, compare, trials_for(nbytes))
        self.choices[name], self.origin[name] = choice, origin
        return choice

    def _settle(self, name: str, entry: Any, status: str, compare: Callable[[int], Timing],
                trials: int) -> tuple[str, str]:
        """(choice, origin) for a class that needs one: the tuning file's choice when trusted; re-checked with a
        few calls, kept unless clearly slower now; otherwise measured (a toss-up again keeps the file's choice)."""
        kept = "" if entry is None else entry if isinstance(entry, str) else entry["choice"]
        now = time.time()
        if status == "trust":
            return kept, "tuned"
        if status == "recheck":
            t = compare(RECHECK_TRIALS)
            if not (t.clear and t.winner != kept):
                if not t.busy:  # a busy machine cannot vouch for it: it is re-checked again next run
                    self._keep(name, rechecked(entry, t.record(kept, RECHECK_TRIALS, now), now))
                return kept, "re-checked"
        t = compare(trials)
        choice = t.winner if t.clear or not kept else kept
        self._keep(name, t.record(choice, trials, now))
        return choice, "measured" if entry is None else "re-measured"

    def _keep(self, name: str, record: dict[str, Any]) -> None:
        self.records[name] = record
        self.new_records = self.unwritten = True

    def _compare(self, run: Callable[[Reducer], Any], keep: list[Array], sync_on: Array, trials: int) -> Timing:
        """Time both candidates on this data (collective) and put the data back."""
        saved = [a.copy() for a in keep]
        times, overload = self._time_calls(run, sync_on, trials)
        for a, s in zip(keep, saved):
            a[...] = s
        med = np.maximum(np.median(times, axis=1), 1e-9)
        q25, q75 = np.percentile(times, [25, 75], axis=1)
        figures = np.array([med[0], med[1], float(np.max((q75 - q25) / med)),
                            _UNKNOWN if overload is None else max(0.0, overload)])
        self.comm.Allreduce(MPI.IN_PLACE, figures, op=MPI.MAX)
        t = Timing((float(figures[0]), float(figures[1])), float(figures[2]),
                   None if figures[3] == _UNKNOWN else float(figures[3]))
        self.busy |= t.busy
        return t

    def _time_calls(self, run: Callable[[Reducer], Any], sync_on: Array, trials: int) -> tuple[Any, float | None]:
        """(times, overload): per trial, each candidate's time for the second of two calls in a row (as a run
        of them goes), alternating which goes first; and the mean of the runnable tasks beyond this node's
        CPUs (our own ranks spin in MPI, so they count), None where unknown. The median, not the minimum,
        decides: a candidate with a few lucky calls is not the faster one in a run."""
        times = np.zeros((2, trials))
        running = []
        with np.errstate(over="ignore", invalid="ignore"):  # in place, values double at each call
            for trial in range(trials):
                for i in (0, 1) if trial % 2 == 0 else (1, 0):
                    red = self.by_name[CANDIDATES[i]]
                    for _ in range(2):
                        t0 = time.perf_counter()
                        run(red)
                        sync(sync_on)
                    times[i, trial] = time.perf_counter() - t0
                n = runnable_tasks()
                if n is not None:
                    running.append(n)
        if not running:
            return times, None
        return times, float(np.mean(running)) - max(os.cpu_count() or 1, self.local_size)

    def _route(self, src: Array, dst: Array) -> Reducer:
        """The all-reduce strategy for dst's class; the exact size is remembered too, so that the next call
        of it costs one dictionary look-up."""
        def compare(trials: int) -> Timing:
            return self._compare(lambda red: red.allreduce_(dst) if src is dst else red.allreduce(src, dst),
                                 [dst], dst, trials)

        red = self.by_name[self._decide("allreduce", dst.dtype, dst.nbytes, compare)]
        if len(self.routes) < 4096:
            self.routes[dst.nbytes] = (dst.dtype, red)
        return red

    def _scatter_route(self, buf: Array, out: Array, counts: list[int]) -> Reducer:
        """The reduce-scatter strategy for buf's class (as _route)."""
        def compare(trials: int) -> Timing:
            return self._compare(lambda red: red.start_reduce_scatter(buf, out, counts).wait(), [buf, out], out,
                                 trials)

        red = self.by_name[self._decide("reduce_scatter", buf.dtype, buf.nbytes, compare)]
        if len(self.scatter_routes) < 4096:
            self.scatter_routes[buf.nbytes] = (buf.dtype, red)
        return red

    def _known(self, buf: Array, routes: dict[int, tuple[Any, Reducer]]) -> Reducer | None:
        """The route of an exact size and dtype seen before (one dictionary look-up and an identity test)."""
        hit = routes.get(buf.nbytes)
        return hit[1] if hit is not None and hit[0] is buf.dtype else None

    # -- what it says ------------------------------------------------------------------------
    def choices_summary(self) -> str:
        """This run's choices in words: per operation and dtype, the byte ranges each strategy serves ("mpi
        4 B-1 MiB": from 4 B up to, not including, 1 MiB); all-reduce first, unnamed."""
        classes: dict[tuple[str, str], list[tuple[int, str]]] = {}
        for name, choice in self.choices.items():
            op, rest = name.split(" ", 1)
            dtype, size_class = rest.rsplit(":", 1)
            classes.setdefault((op, dtype), []).append((int(size_class), choice))
        out = []
        for op, dtype in sorted(classes, key=lambda k: (OPERATIONS.index(k[0]), k[1])):
            runs: list[list[Any]] = []  # [first class, last class, choice], neighbours with one choice merged
            for c, choice in sorted(classes[op, dtype]):
                if runs and runs[-1][2] == choice and runs[-1][1] == c - 1:
                    runs[-1][1] = c
                else:
                    runs.append([c, c, choice])
            label = "" if op == "allreduce" else "reduce-scatter "
            out.append(f"{label}{dtype} " + ", ".join(
                f"{v} {_human(1 << (a - 1)) if a else '0 B'}-{_human(1 << b)}" for a, b, v in runs))
        return "; ".join(out)

    def origin_summary(self) -> str:
        """Where this run's choices came from, in words: "measured now", "tuned <date>", "tuned <date>,
        re-checked", "tuned <date>, 1 of 3 re-measured, 2 measured now" (the date the plan file records)."""
        origins = {n: o for n, o in self.origin.items() if not o.startswith("fixed")}
        parts = []
        from_file = [n for n, o in origins.items() if o != "measured"]
        if from_file:
            dates = sorted(d for d in (measured_on(self.loaded[n][0]) for n in from_file) if d is not None)
            text = f"tuned {dates[0]}" if dates else "tuned by an older version"
            for what in ("re-checked", "re-measured"):
                n = sum(origins[name] == what for name in from_file)
                text += "" if not n else f", {what}" if n == len(from_file) else f", {n} of {len(from_file)} {what}"
            parts.append(text)
        measured = len(origins) - len(from_file)
        if measured:
            parts.append("measured now" if not from_file else f"{measured} measured now")
        fixed = sorted({o[len("fixed: "):] for o in self.origin.values() if o.startswith("fixed")})
        if fixed:
            parts.append("not measured: " + ", ".join(fixed))
        if self.busy:
            parts.append("timed on a busy machine")
        return ", ".join(parts)

    def describe(self) -> str:
        window = self.shared is not None and self.shared.win is not None
        if self.det is not None:
            head = "node-shared buffer on this node, deterministic elsewhere" if window \
                else "auto: deterministic (rank-order sums) for every buffer"
        else:
            chosen = f"{self.choices_summary()} ({self.origin_summary()})" if self.choices else \
                "mpi or ring per operation and size, whichever measures faster"
            if window:
                head = "node-shared buffer on this node" + (f"; other buffers: {chosen}" if self.choices else "")
            else:
                why = f" (no node-shared buffer: {self.shared.refused})" if self.shared and self.shared.refused \
                    else ""
                head = f"auto: {chosen}{why}"
        return f"{head}; {self.note}" if self.note else head

    # -- the Reducer interface -------------------------------------------------------------
    def allreduce_(self, buf: Array) -> None:
        hit = self.routes.get(buf.nbytes)  # _known(), inline: this is the latency path of small all-reduces
        (hit[1] if hit is not None and hit[0] is buf.dtype else self._route(buf, buf)).allreduce_(buf)

    def allreduce(self, src: Array, dst: Array) -> None:
        (self._known(dst, self.routes) or self._route(src, dst)).allreduce(src, dst)

    def _in_window(self, buf: Array) -> bool:
        return self.shared is not None and self.shared.offset_of(buf) is not None

    def start(self, buf: Array) -> Handle:
        if self._in_window(buf):
            return self.shared.start(buf)  # type: ignore[union-attr]
        return (self._known(buf, self.routes) or self._route(buf, buf)).start(buf)

    def start_reduce_scatter(self, buf: Array, out: Array, counts: list[int]) -> Handle:
        if self._in_window(buf):
            return self.shared.start_reduce_scatter(buf, out, counts)  # type: ignore[union-attr]
        red = self._known(buf, self.scatter_routes) or self._scatter_route(buf, out, counts)
        return red.start_reduce_scatter(buf, out, counts)

    def shared_buffer(self, n: int, dtype: Any) -> Array | None:
        return None if self.shared is None else self.shared.shared_buffer(n, dtype)

    def tune(self, bufs: list[Array], *, reduce_scatter: bool = False) -> None:
        """Collective: decide now for buffers like these (all-reduce, or with ``reduce_scatter`` a
        reduce-scatter into near-equal chunks in rank order, as data parallelism's sharded step makes),
        then save the tuning file if that measured or re-checked anything."""
        for buf in bufs:
            if self._in_window(buf):
                continue
            if reduce_scatter:
                counts = chunk_counts(buf.size, self.size)
                self._scatter_route(buf.reshape(-1), xp_of(buf).empty(counts[self.rank], buf.dtype), counts)
            else:
                self._route(buf, buf)
        if self.new_records:  # the same on every rank, so every rank reaches the broadcast or none does
            self._save()
            self.note = self.comm.bcast(self.note, root=0)  # every rank's describe() says what rank 0 found
            self.new_records = False

    def close(self) -> None:
        self._save()
        for red in (self.shared, self.det, self.ring, self.mpi):
            if red is not None:
                red.close()
        super().close()

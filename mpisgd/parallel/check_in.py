"""The per-step check-in: every rank at the same step, with the same buffers and as many micro-batches
and targets, at a check-in and not in another collective — one small Allgather before any bucket of the
step, so that a rank out of step is named on every rank instead of reducing the wrong data or hanging.
Each rank also says whether its micro-batches are ones the model can train on (:func:`batch_problem`), so
that a bad batch on one rank is refused on every rank, naming it, before any rank starts the step."""

from __future__ import annotations

import time
from collections.abc import Sequence
from enum import IntEnum

import numpy as np
from mpi4py import MPI

from mpisgd.agreement import ReplicaError, differing_ranks
from mpisgd.parallel.protocols import Array, Timeline, Watchdog
from mpisgd.parallel.stats import Meter

CHECK_IN = 0x6D70_7367_645F_636B  # first word of a step check-in, so a peer in another collective shows
CHECK_IN_WORDS = 9  # marker, step, gradient size, itemsize, buckets, micro-batches, targets, stop, batch problem


class BatchProblem(IntEnum):
    """What makes a rank's micro-batches untrainable (0: nothing)."""

    NONE = 0
    EMPTY = 1  # a micro-batch of no samples
    LENGTH = 2  # not one label (row of labels) per sample
    NOT_INTEGER = 3  # float (or other) labels: the loss indexes by them
    RANGE = 4  # a label outside 0..C-1 (and not the loss's ignore_index)

    def says(self, n_classes: int | None, ignore: int | None) -> str:
        top = f"0..{n_classes - 1}" if n_classes is not None else "0..C-1"
        skip = f" (or {ignore}, which the loss ignores)" if ignore is not None else ""
        return {BatchProblem.NONE: "nothing",
                BatchProblem.EMPTY: "an empty micro-batch (no samples)",
                BatchProblem.LENGTH: "a micro-batch whose labels are not one per sample (len(y) != len(x))",
                BatchProblem.NOT_INTEGER: "labels that are not integers (class indices: y.astype(np.int64))",
                BatchProblem.RANGE: f"labels outside {top}{skip}, the classes the model scores"}[self]


def batch_problem(batches: Sequence[tuple[Array, Array]], n_classes: int | None, ignore: int | None) -> BatchProblem:
    """The first problem of this rank's ``(x, y)`` micro-batches, or NONE. Labels must be integers in
    0..n_classes-1 (the upper bound where ``n_classes`` is known: after the first forward), or equal the
    loss's ``ignore``."""
    for x, y in batches:
        if len(x) == 0:
            return BatchProblem.EMPTY
        if y.ndim == 0 or len(y) != len(x):
            return BatchProblem.LENGTH
        if np.dtype(y.dtype).kind not in "iu":
            return BatchProblem.NOT_INTEGER
    for _, y in batches:
        scored = y if ignore is None else y[y != ignore]
        if scored.size and (int(scored.min()) < 0 or (n_classes is not None and int(scored.max()) >= n_classes)):
            return BatchProblem.RANGE
    return BatchProblem.NONE


def check_in(comm: MPI.Intracomm, watchdog: Watchdog, timeline: Timeline, meter: Meter, *, step: int, size: int,
             itemsize: int, buckets: int, micro_batches: int, targets: int, stop: int,
             problem: BatchProblem = BatchProblem.NONE, n_classes: int | None = None,
             ignore: int | None = None) -> int:
    """Collective. ``micro_batches``, ``targets``: how many this rank trains on in this step (0 and 0:
    the check-in between steps), ``problem``: what :func:`batch_problem` found in them (``n_classes``,
    ``ignore``: for its message). Returns the largest ``stop`` any rank passed (0: none; a signal's stop
    word, mpisgd.app.signals). Raises ReplicaError on every rank otherwise."""
    k = comm.Get_size()
    mine = np.array([CHECK_IN, step, size, itemsize, buckets, micro_batches, targets, int(stop), int(problem)],
                    dtype=np.int64)
    assert mine.size == CHECK_IN_WORDS
    every = np.zeros((k, mine.size), dtype=np.int64)
    meter.times.arrived_check_in.append(time.perf_counter())
    timeline.instant("arrive: step check-in")
    # watched like every blocking collective: a rank stopped between steps waits here
    with watchdog.watching(f"step check-in of step {step}"):
        try:
            comm.Allgather(mine, every)
        except MPI.Exception as exc:  # a peer in another collective whose message does not fit
            raise ReplicaError(f"the check-in of step {step} failed ({exc.Get_error_string()}): a rank is in another "
                               "collective; every rank must call DataParallel's methods in the same order") from None
    strangers = [r for r in range(k) if every[r, 0] != CHECK_IN]
    if strangers:
        raise ReplicaError(f"rank(s) {strangers} are not at the check-in of step {step} but in another collective "
                           "(a replica check, a checkpoint, close...): every rank must call DataParallel's methods "
                           "in the same order")
    rows = [tuple(int(v) for v in row[1:5]) for row in every]
    if len(set(rows)) > 1:
        raise ReplicaError(f"rank(s) {differing_ranks(rows)} out of step: (step, gradient size, itemsize, buckets) "
                           f"per rank {dict(enumerate(rows))}")
    if every[:, 8].any():
        found: dict[str, list[int]] = {}
        for r in range(k):
            if every[r, 8]:
                found.setdefault(BatchProblem(int(every[r, 8])).says(n_classes, ignore), []).append(r)
        raise ReplicaError(f"rank(s) {[r for r in range(k) if every[r, 8]]} passed micro-batches the model cannot "
                           "train on: " + "; ".join(f"rank(s) {ranks}: {what}" for what, ranks in found.items()))
    sizes = [tuple(int(v) for v in row[5:7]) for row in every]
    if len(set(sizes)) > 1:
        raise ReplicaError(f"rank(s) {differing_ranks(sizes)} passed other batches: (micro-batches, targets) per rank "
                           f"{dict(enumerate(sizes))}; every rank must train on as many of each, or the average "
                           "would weigh the ranks' samples unequally")
    return int(every[:, 7].max())

"""The per-step check-in: every rank at the same step, with the same buffers and as many micro-batches
and targets, at a check-in and not in another collective — one small Allgather before any bucket of the
step, so that a rank out of step is named on every rank instead of reducing the wrong data or hanging."""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
from mpi4py import MPI

from mpisgd.agreement import ReplicaError, differing_ranks
from mpisgd.parallel.protocols import Array, Timeline, Watchdog
from mpisgd.parallel.stats import Meter

CHECK_IN = 0x6D70_7367_645F_636B  # first word of a step check-in, so a peer in another collective shows
CHECK_IN_WORDS = 9  # marker, step, gradient size, itemsize, buckets, micro-batches, targets, stop, bad labels


def check_in(comm: MPI.Intracomm, watchdog: Watchdog, timeline: Timeline, meter: Meter, *, step: int, size: int,
             itemsize: int, buckets: int, labels: Sequence[Array], targets: int, stop: int,
             n_classes: int | None) -> int:
    """Collective. ``labels``: this rank's micro-batches' targets (none: the check-in between steps),
    ``targets``: how many the loss scores; labels outside 0..n_classes-1 are refused. Returns the largest
    ``stop`` any rank passed (0: none; a signal's stop word, mpisgd.app.signals). Raises ReplicaError on
    every rank otherwise."""
    k = comm.Get_size()
    low = min((int(y.min()) for y in labels if len(y)), default=0)
    high = max((int(y.max()) for y in labels if len(y)), default=0)
    bad = low < 0 or (n_classes is not None and high >= n_classes)
    mine = np.array([CHECK_IN, step, size, itemsize, buckets, len(labels), targets, int(stop), int(bad)],
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
    sizes = [tuple(int(v) for v in row[5:7]) for row in every]
    if len(set(sizes)) > 1:
        raise ReplicaError(f"rank(s) {differing_ranks(sizes)} passed other batches: (micro-batches, targets) per rank "
                           f"{dict(enumerate(sizes))}; every rank must train on as many of each, or the average "
                           "would weigh the ranks' samples unequally")
    if every[:, 8].any():
        raise ReplicaError(f"rank(s) {[r for r in range(k) if every[r, 8]]} passed labels outside "
                           f"0..{n_classes - 1 if n_classes else 'C-1'} (a negative label would silently score the "
                           "last class)")
    return int(every[:, 7].max())

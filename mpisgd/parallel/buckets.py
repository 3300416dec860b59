"""Gradient buckets: contiguous slices of the reduced buffer, reduced while backward still runs.

Parameters lie in model order, backward produces them roughly in reverse, so the buckets are cut in
reverse flat order by bytes (PyTorch DDP's rule): the first at ``FIRST_BUCKET_MB`` (communication starts
early), later ones at the cap, each ending at a leaf module's boundary. A bucket starts once every leaf
in it has reported its gradients final — arrivals are counted, as DDP's Reducer counts pending
gradients — so leaves may report in any order (a residual block's shortcut after its main branch).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from mpisgd.comm.base import Handle
from mpisgd.parallel.protocols import Array, LeafDone, Timeline, Watchdog
from mpisgd.parallel.stats import InFlight, Meter

FIRST_BUCKET_MB = 1.0  # as PyTorch DDP: a small first bucket starts communication early


@dataclass
class Bucket:
    start: int  # element range [start, stop) of the reduced buffer
    stop: int
    leaves: tuple[int, ...]  # the leaf modules whose parameters it holds
    index: int = 0  # position in the bucket list: the order buckets are cut (reverse flat order)
    name: str = ""  # for the timeline, made once (not per step)
    pending: int = 0  # leaves not yet reported in this backward
    handle: Handle | None = None
    t_start: float = 0.0  # when its reduction started; 0 once it is seen complete


def make_buckets(layer_ranges: list[tuple[int, int]], itemsize: int, bucket_cap_mb: float) -> list[Bucket]:
    """Group the leaves' parameter ranges (``(start, stop)`` per leaf in flat order, ``(-1, -1)`` for a leaf
    without parameters) into buckets of about ``bucket_cap_mb``, last leaf first."""
    ranges = [(i, a, b) for i, (a, b) in enumerate(layer_ranges) if a >= 0 and b > a]
    buckets: list[Bucket] = []
    cap = min(FIRST_BUCKET_MB, bucket_cap_mb) * 2**20
    current: list[tuple[int, int, int]] = []
    for leaf in reversed(ranges):
        current.append(leaf)
        if sum(y - x for _, x, y in current) * itemsize >= cap:
            buckets.append(_bucket(current))
            current, cap = [], bucket_cap_mb * 2**20
    if current:
        buckets.append(_bucket(current))
    for i, bucket in enumerate(buckets):
        bucket.index, bucket.name = i, f"allreduce b{i}"
    return buckets


def _bucket(leaves: list[tuple[int, int, int]]) -> Bucket:
    """The bucket of these leaves (in reverse flat order: the last one lies lowest)."""
    return Bucket(leaves[-1][1], leaves[0][2], tuple(sorted(i for i, _, _ in leaves)))


class BucketSchedule:
    """A step's buckets in flight over one reduced buffer: started when ready (or at the end), poked while
    backward runs (MPI progresses only inside MPI calls), waited for; their times go to ``meter``.
    ``on_start(bucket)`` runs just before a bucket's reduction starts (the reproducible mode encodes the
    bucket there; the float mode may measure it)."""

    def __init__(self, buckets: list[Bucket], k: int, meter: Meter, timeline: Timeline, watchdog: Watchdog) -> None:
        self.buckets, self.k, self.meter, self.timeline, self.watchdog = buckets, k, meter, timeline, watchdog
        self._of_leaf = {leaf: b for b in buckets for leaf in b.leaves}
        self._reduced: Array = None
        self._start: Callable[[int, Array], Handle] | None = None
        self._on_start: Callable[[Bucket], None] = _nothing
        self._in_flight = InFlight()  # the meter's comm_total_s: time with a bucket in flight, not their sum

    def bind(self, reduced: Array, start: Callable[[int, Array], Handle], on_start: Callable[[Bucket], None]) -> None:
        """Reduce slices of ``reduced`` with ``start(index, slice)``; call ``on_start`` before each."""
        self._reduced, self._start, self._on_start = reduced, start, on_start

    def armed(self) -> LeafDone:
        """The hook for a backward whose reports start buckets: every bucket waits for all its leaves."""
        for b in self.buckets:
            b.pending = len(b.leaves)
        return self._leaf_done

    def _leaf_done(self, leaf: int) -> None:
        bucket = self._of_leaf.get(leaf)  # None: a leaf without parameters
        if bucket is not None:
            if bucket.pending <= 0:
                raise RuntimeError(f"backward reported leaf {leaf} done twice in one pass: a model's backward must "
                                   "call on_layer_done once per leaf with parameters")
            bucket.pending -= 1
            if bucket.pending == 0 and bucket.handle is None:
                self.start(bucket)
        for b in self.buckets:  # MPI progresses only inside MPI calls: poke the open ones
            if b.handle is not None and b.t_start and b.handle.test():
                self._done(b)

    def start(self, bucket: Bucket) -> None:
        assert self._start is not None, "bind() the schedule first"
        self._on_start(bucket)
        self.timeline.begin(bucket.name, cat="comm")
        bucket.t_start = time.perf_counter()
        self._in_flight.started(bucket.t_start)
        bucket.handle = self._start(bucket.index, self._reduced[bucket.start:bucket.stop])

    def _done(self, bucket: Bucket) -> None:
        times = self.meter.times
        times.comm_total_s += self._in_flight.done(time.perf_counter())
        times.bytes_reduced += (bucket.stop - bucket.start) * self._reduced.dtype.itemsize
        self.timeline.end(bucket.name, cat="comm")
        bucket.t_start = 0.0  # marks it complete

    def finish(self, what: str, step: int) -> None:
        """Start the buckets not yet started, wait for all (at k = 1 there is nothing to reduce); afterwards
        the reduction's result is where the update put it. The wait is the step's exposed communication."""
        if self.k == 1:
            return
        t0 = time.perf_counter()
        self.meter.times.arrived_gradients.append(t0)
        self.timeline.instant("arrive: gradients")
        with self.watchdog.watching(f"gradient {what} of step {step}"), self.timeline.span("wait comm", cat="comm"):
            for b in self.buckets:
                if b.handle is None:
                    self.start(b)
            for b in self.buckets:
                assert b.handle is not None
                b.handle.wait()
                if b.t_start:
                    self._done(b)
                b.handle = None
        self.meter.times.comm_exposed_s += time.perf_counter() - t0


def _nothing(bucket: Bucket) -> None:
    return None

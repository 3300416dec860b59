"""The buckets' time in flight (StepStats.comm_total_s, the busbw of the closing line): the union of their
intervals, not their sum, where buckets overlap one another (a fake clock and fake handles)."""

from __future__ import annotations

import numpy as np
import pytest

from mpisgd.parallel import buckets as buckets_module
from mpisgd.parallel.buckets import Bucket, BucketSchedule
from mpisgd.parallel.stats import InFlight, Meter
from mpisgd.timeline import NullTimeline
from mpisgd.watchdog import NullWatchdog


def test_in_flight_counts_the_union_of_the_intervals():
    t = InFlight()
    t.started(0.0)
    t.started(1.0)  # [0, 3] and [1, 2] overlap: 3 s in flight, not 4
    assert t.done(2.0) == 0.0
    assert t.done(3.0) == 3.0
    t.started(10.0)  # apart: each counts whole
    assert t.done(10.5) == 0.5


class Clock:
    """Seconds from an arbitrary origin (a bucket's start time 0.0 means it is complete)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Handle:
    """Completes at ``at`` on ``clock``; ``wait`` moves the clock there if it is not yet."""

    def __init__(self, clock: Clock, at: float) -> None:
        self.clock, self.at = clock, at

    def test(self) -> bool:
        return self.clock.now >= self.at

    def wait(self) -> None:
        self.clock.now = max(self.clock.now, self.at)


@pytest.mark.parametrize("ends,in_flight", [({0: 3.0, 1: 3.0}, 3.0), ({0: 0.5, 1: 3.0}, 3.0)],
                         ids=["overlapping", "one after the other"])
def test_overlapping_buckets_count_once_in_the_time_in_flight(monkeypatch, ends, in_flight):
    """Bucket 0 starts at 0 s, bucket 1 at 1 s, both end at 3 s: 3 s in flight, where each bucket's own start
    to completion adds up to 5 s (the busbw would read 5/3 too low). Bucket 0 done at 0.5 s (observed at 1 s,
    when the next report pokes it): the union and the sum agree, 3 s."""
    clock = Clock()
    monkeypatch.setattr(buckets_module.time, "perf_counter", clock)
    meter = Meter()
    schedule = BucketSchedule([Bucket(2, 4, (1,), index=0), Bucket(0, 2, (0,), index=1)], 2, meter, NullTimeline(),
                              NullWatchdog())
    t0 = clock.now = 100.0
    schedule.bind(np.zeros(4), lambda index, view: Handle(clock, t0 + ends[index]), lambda bucket: None)
    done = schedule.armed()
    done(1)  # the last leaf reports first: bucket 0 starts at 0 s
    clock.now = t0 + 1.0
    done(0)  # bucket 1 starts at 1 s; bucket 0 is poked
    schedule.finish("all-reduce", 0)
    assert clock.now == t0 + 3.0 and meter.times.comm_total_s == pytest.approx(in_flight)

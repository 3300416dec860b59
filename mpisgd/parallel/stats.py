"""What DataParallel measures: seconds per phase, bytes reduced, the gradient-noise statistics, and when
this rank reached each step's synchronisation points — summed since the last reset (an epoch's)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class StepStats:
    """Seconds spent and gradient statistics, summed over steps since the last reset; and when this rank
    reached each step's synchronisation points (perf_counter), for the straggler report (mpisgd.app.straggler).

    The gradient noise scale (mpisgd.noise) compares, on every ``noise_every``-th step, the squared norm
    of a small-batch gradient with that of the averaged one, both in true units (the gradient of the mean
    loss over the batch's targets): ``small_sq`` sums this rank's small batch's (its own gradient before
    the reduction; at k = 1, and in the reproducible mode, a micro-batch's: ``b_small`` targets), and
    ``big_sq`` the averaged gradient's |G|^2, the same on every rank. Their means over the
    ``noise_steps`` measured steps (and, for ``small_sq``, over the ranks) are what mpisgd.noise.estimate takes."""

    forward_s: float = 0.0
    backward_s: float = 0.0
    comm_total_s: float = 0.0  # with a bucket in flight: from a start to the observed completion (InFlight)
    comm_exposed_s: float = 0.0  # time the step waited for communication
    optimizer_s: float = 0.0
    steps: int = 0
    bytes_reduced: int = 0
    noise_steps: int = 0  # steps whose gradient norms were measured
    small_sq: float = 0.0  # sum over those steps of this rank's small-batch |g|^2
    big_sq: float = 0.0  # sum over those steps of the averaged gradient's |G|^2
    b_small: int = 0  # targets behind one small-batch gradient (0: none measured)
    arrived_check_in: list[float] = field(default_factory=list)  # entering the step check-in
    arrived_gradients: list[float] = field(default_factory=list)  # backward done, waiting for the gradients

    def note_noise(self, small_sq_buffer: float, b_small: int, n_local: int, k: int, big_sq: float) -> None:
        """Add one step's squared norms. ``small_sq_buffer`` is in the gradient buffer's units: each target
        weighs 1/(k * n_local) there, so a b_small-target gradient is its true value times b_small / B
        (B = k * n_local). Nothing is added where the small batch is the whole batch (k = 1, m = 1) or a
        norm is not finite."""
        big_batch = k * n_local
        if big_batch == b_small or not (math.isfinite(small_sq_buffer) and math.isfinite(big_sq)):
            return
        self.noise_steps += 1
        self.small_sq += small_sq_buffer * (big_batch / b_small) ** 2
        self.big_sq += big_sq
        self.b_small = b_small


class InFlight:
    """The time during which at least one of some operations is in flight: the union of their intervals,
    from the start that found none in flight to the completion that leaves none. Buckets overlap one another;
    the sum of their own times would count the shared time twice and make an achieved bandwidth read low."""

    def __init__(self) -> None:
        self.count = 0
        self.since = 0.0

    def started(self, now: float) -> None:
        if self.count == 0:
            self.since = now
        self.count += 1

    def done(self, now: float) -> float:
        """One completed at ``now``: the seconds the union grew by (0 while others are still in flight)."""
        self.count -= 1
        return now - self.since if self.count == 0 else 0.0


class Meter:
    """The current :class:`StepStats`, shared by DataParallel and its strategies; :meth:`reset` starts new ones."""

    def __init__(self) -> None:
        self.times = StepStats()

    def reset(self) -> StepStats:
        done, self.times = self.times, StepStats()
        return done

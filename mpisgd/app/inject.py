"""Switches for the test suite and the experiments, never for users: a failure or a delay injected
at a step, so that the failure tests can check that the whole job ends, and the straggler experiment
can make one rank slow. The CLI reads them from the environment once (``from_environ``) and hands
the training loop a hooks object; a loop driven any other way gets :class:`NoHooks`. A value that does not
parse is bad input (one line, exit 2), not a traceback.

- ``MPISGD_FAIL_AT_STEP=STEP[:RANK]``: that rank (0 by default) raises at that global step.
- ``MPISGD_DELAY_RANK=RANK:MS``: that rank sleeps MS milliseconds before each step's compute.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass

from mpisgd.errors import UsageError


class NoHooks:
    """Nothing injected."""

    def before_step(self, step: int, rank: int) -> None: ...


@dataclass(frozen=True)
class Injected:
    fail_at: tuple[int, int] | None = None  # (global step, rank)
    delay: tuple[int, float] | None = None  # (rank, seconds)

    @classmethod
    def from_environ(cls, env: Mapping[str, str] = os.environ) -> Injected | NoHooks:
        fail, delay = env.get("MPISGD_FAIL_AT_STEP", ""), env.get("MPISGD_DELAY_RANK", "")
        if not (fail or delay):
            return NoHooks()
        fail_at, slow = None, None
        try:
            if fail:
                step, _, rank = fail.partition(":")
                fail_at = (int(step), int(rank or 0))
        except ValueError:
            raise UsageError(f"MPISGD_FAIL_AT_STEP={fail!r}: expected STEP or STEP:RANK (integers), a test "
                             "switch: unset it") from None
        try:
            if delay:
                rank, _, ms = delay.partition(":")
                slow = (int(rank), float(ms) / 1e3)
                if not 0 <= slow[1] < 3600:  # NaN, inf and negative sleeps fail too
                    raise ValueError
        except ValueError:
            raise UsageError(f"MPISGD_DELAY_RANK={delay!r}: expected RANK:MS (an integer and milliseconds from 0 "
                             "to 3600000), a test switch: unset it") from None
        return cls(fail_at, slow)

    def before_step(self, step: int, rank: int) -> None:
        if self.fail_at == (step, rank):
            raise RuntimeError(f"injected failure at step {step} ($MPISGD_FAIL_AT_STEP)")
        if self.delay is not None and self.delay[0] == rank:
            time.sleep(self.delay[1])

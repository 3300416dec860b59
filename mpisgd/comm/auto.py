"""``auto``, the default: the node-shared buffer where there is one, else mpi or ring, whichever is faster.

1. Every rank on one node: data parallelism keeps its gradients in the
   ``shared`` strategy's buffer, and their buckets are summed there.
2. Any other buffer takes ``mpi`` or ``ring`` by its size class (2^(c-1) to
   2^c - 1 bytes, per dtype). The first time a class is seen, both run on
   that buffer's data, alternating, 11 to 21 times as the size needs; the
   slowest rank's median decides (one small all-reduce, so every rank picks
   alike), and the class keeps the choice.
   Non-blocking buffers are decided when data parallelism calls :meth:`tune`.

Why measure: the two cross at sizes that move with the caches and the MPI
library from machine to machine (docs/allreduce.md). Choices are kept in a
plan file (``$MPISGD_PLAN_FILE``, default ``~/.cache/mpisgd/allreduce-plans.json``,
``off`` for none) under the MPI library, k and the hosts, so later runs there
choose the same and give the same bits; the banner and metrics show the plan.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
from mpi4py import MPI

from mpisgd.backend import sync
from mpisgd.comm.base import Array, Handle, Reducer, on_one_node
from mpisgd.comm.mpi import MpiReducer, mpi_sum_type
from mpisgd.comm.ring import RingReducer
from mpisgd.comm.shared import SharedReducer

PLAN_FILE = "~/.cache/mpisgd/allreduce-plans.json"


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


class AutoReducer(Reducer):
    name = "auto"
    native_reduce_scatter = True

    def __init__(self, comm: Any, *, plan_file: str | None = None) -> None:
        super().__init__(comm)
        self.mpi, self.ring = MpiReducer(self.comm), RingReducer(self.comm)
        self.shared = SharedReducer(self.comm) if self.size > 1 and on_one_node(self.comm) else None
        self.routes: dict[int, tuple[Any, Reducer]] = {}  # nbytes -> (dtype, mpi or ring), as its class decided
        self.plan: dict[str, str] = {}  # "dtype:class" -> "mpi" | "ring": this run's choices
        path = os.environ.get("MPISGD_PLAN_FILE", PLAN_FILE) if plan_file is None else plan_file
        self.plan_file = None if path in ("", "off") else Path(path).expanduser()
        hosts = ",".join(sorted(set(self.comm.allgather(MPI.Get_processor_name()))))
        self.plan_key = f"{' '.join(MPI.Get_library_version().split()[:3])} | k={self.size} | {hosts}"
        self.known: dict[str, str] = self.comm.bcast(self._plans().get(self.plan_key, {}) if self.rank == 0
                                                     else None, root=0)

    # -- the plan ------------------------------------------------------------------------
    def _plans(self) -> dict[str, Any]:
        try:
            return json.loads(self.plan_file.read_text()) if self.plan_file else {}
        except (OSError, ValueError):
            return {}

    def _save(self) -> None:
        if self.plan_file is None or self.rank != 0:
            return
        plans = self._plans()
        plans[self.plan_key] = {**plans.get(self.plan_key, {}), **self.plan}
        try:
            self.plan_file.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.plan_file.with_suffix(f".tmp.{os.getpid()}")
            tmp.write_text(json.dumps(plans, indent=1, sort_keys=True))
            tmp.replace(self.plan_file)
        except OSError:
            pass  # a plan that cannot be kept is measured again next time

    def _route(self, src: Array, dst: Array) -> Reducer:
        """mpi or ring for dst's class (decided now, on this call's data, when the class is new); the exact
        size is remembered too, so that the next call of it costs one dictionary look-up."""
        name = f"{dst.dtype}:{dst.nbytes.bit_length()}"
        choice = self.plan.get(name)
        if choice is None:
            if self.size == 1 or mpi_sum_type(dst.dtype) is None:  # nothing to choose; a dtype MPI cannot sum
                choice = "mpi" if self.size == 1 else "ring"
            else:
                choice = self.known.get(name) or self._measure(src, dst)
            self.plan[name] = choice
            if name not in self.known:
                self._save()
        red = self.mpi if choice == "mpi" else self.ring
        if len(self.routes) < 4096:
            self.routes[dst.nbytes] = (dst.dtype, red)
        return red

    def _known(self, buf: Array) -> Reducer | None:
        """The route of an exact size and dtype seen before (one dictionary look-up and an identity test)."""
        hit = self.routes.get(buf.nbytes)
        return hit[1] if hit is not None and hit[0] is buf.dtype else None

    def _measure(self, src: Array, dst: Array) -> str:
        """Time mpi and ring alternately on this data, each the second of two calls in a row; the lower median
        at the slowest rank wins (collective): the median, not the minimum, since a candidate with a few lucky
        calls is not the faster one in a run. The data are put back before the call is made for real."""
        keep = dst.copy()
        times = np.zeros((2, trials_for(dst.nbytes)))
        with np.errstate(over="ignore", invalid="ignore"):  # in place, values double at each call
            for trial in range(times.shape[1]):
                for i in (0, 1) if trial % 2 == 0 else (1, 0):
                    red = (self.mpi, self.ring)[i]
                    for _ in range(2):  # time the second of two calls in a row: as a run of them goes
                        t0 = time.perf_counter()
                        red.allreduce_(dst) if src is dst else red.allreduce(src, dst)
                        sync(dst)
                    times[i, trial] = time.perf_counter() - t0
        dst[...] = keep
        typical = np.median(times, axis=1)
        self.comm.Allreduce(MPI.IN_PLACE, typical, op=MPI.MAX)
        return "ring" if typical[1] < typical[0] else "mpi"

    def plan_summary(self) -> str:
        """The plan in words: per dtype, the byte ranges each strategy serves ("mpi 4 B-1 MiB": from 4 B
        up to, not including, 1 MiB)."""
        out = []
        for dtype in sorted({name.split(":")[0] for name in self.plan}):
            runs: list[list[Any]] = []  # [first class, last class, choice], neighbours with one choice merged
            for c, choice in sorted((int(n.split(":")[1]), v) for n, v in self.plan.items()
                                    if n.split(":")[0] == dtype):
                if runs and runs[-1][2] == choice and runs[-1][1] == c - 1:
                    runs[-1][1] = c
                else:
                    runs.append([c, c, choice])
            out.append(f"{dtype} " + ", ".join(f"{v} {_human(1 << (a - 1)) if a else '0 B'}-{_human(1 << b)}"
                                               for a, b, v in runs))
        return "; ".join(out)

    # -- the Reducer interface -------------------------------------------------------------
    def allreduce_(self, buf: Array) -> None:
        hit = self.routes.get(buf.nbytes)  # _known(), inline: this is the latency path of small all-reduces
        (hit[1] if hit is not None and hit[0] is buf.dtype else self._route(buf, buf)).allreduce_(buf)

    def allreduce(self, src: Array, dst: Array) -> None:
        (self._known(dst) or self._route(src, dst)).allreduce(src, dst)

    def _in_window(self, buf: Array) -> bool:
        return self.shared is not None and self.shared.offset_of(buf) is not None

    def start(self, buf: Array) -> Handle:
        if self._in_window(buf):
            return self.shared.start(buf)  # type: ignore[union-attr]
        return (self._known(buf) or self._route(buf, buf)).start(buf)

    def start_reduce_scatter(self, buf: Array, out: Array, counts: list[int]) -> Handle:
        if self._in_window(buf):
            return self.shared.start_reduce_scatter(buf, out, counts)  # type: ignore[union-attr]
        red = self.mpi if mpi_sum_type(buf.dtype) is not None else self.ring
        return red.start_reduce_scatter(buf, out, counts)

    def shared_buffer(self, n: int, dtype: Any) -> Array | None:
        return None if self.shared is None else self.shared.shared_buffer(n, dtype)

    def tune(self, bufs: list[Array]) -> None:
        for buf in bufs:
            if not self._in_window(buf):
                self._route(buf, buf)

    def describe(self) -> str:
        if self.shared is not None and self.shared.win is not None:
            return self.shared.describe()
        why = f" (no node-shared buffer: {self.shared.refused})" if self.shared and self.shared.refused else ""
        return f"auto: {self.plan_summary() or 'mpi or ring per size, whichever is faster when first seen'}{why}"

    def close(self) -> None:
        for red in (self.shared, self.ring, self.mpi):
            if red is not None:
                red.close()
        super().close()

"""A Chrome-trace timeline (chrome://tracing, Perfetto): complete events per rank.

Disabled timelines cost one attribute check per span. ``save`` writes all or nothing (OSError on a
full disk, and no temporary file left behind).
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from mpisgd.files import atomic_write


class Timeline:
    def __init__(self, enabled: bool = True, rank: int = 0) -> None:
        self.enabled = enabled
        self.rank = rank
        self.events: list[dict[str, Any]] = []
        self._open: dict[str, float] = {}
        self._t0 = time.perf_counter()

    def _now_us(self) -> float:
        return (time.perf_counter() - self._t0) * 1e6

    def begin(self, name: str, cat: str = "compute") -> None:
        if self.enabled:
            self._open[name] = self._now_us()

    def end(self, name: str, cat: str = "compute", **args: Any) -> None:
        if self.enabled and name in self._open:
            start = self._open.pop(name)
            # comm events on their own row (tid 1) so they can overlap compute (tid 0)
            self.events.append({"name": name, "cat": cat, "ph": "X", "ts": start, "dur": self._now_us() - start,
                                "pid": self.rank, "tid": 1 if cat == "comm" else 0, "args": args})

    def instant(self, name: str, cat: str = "sync") -> None:
        """A moment, e.g. this rank reaching a synchronisation point (shown on the communication row)."""
        if self.enabled:
            self.events.append({"name": name, "cat": cat, "ph": "i", "s": "t", "ts": self._now_us(),
                                "pid": self.rank, "tid": 1})

    @contextmanager
    def span(self, name: str, cat: str = "compute") -> Iterator[None]:
        if not self.enabled:
            yield
            return
        self.begin(name, cat)
        try:
            yield
        finally:
            self.end(name, cat)

    def save(self, path: str) -> None:
        meta = [{"name": "process_name", "ph": "M", "pid": self.rank, "args": {"name": f"rank {self.rank}"}},
                {"name": "thread_name", "ph": "M", "pid": self.rank, "tid": 0, "args": {"name": "compute"}},
                {"name": "thread_name", "ph": "M", "pid": self.rank, "tid": 1, "args": {"name": "communication"}}]
        text = json.dumps({"traceEvents": meta + self.events, "displayTimeUnit": "ms"}).encode()
        atomic_write(path, lambda f: f.write(text))  # all or nothing: a full disk leaves no temporary file


class NullTimeline:
    """The timeline's interface, recording nothing: what data parallelism uses when given none."""

    def begin(self, name: str, cat: str = "compute") -> None: ...

    def end(self, name: str, cat: str = "compute") -> None: ...

    def span(self, name: str, cat: str = "compute") -> contextlib.nullcontext:
        return contextlib.nullcontext()

    def instant(self, name: str) -> None: ...

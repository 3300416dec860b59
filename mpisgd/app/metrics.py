"""The JSON-lines metrics file (rank 0): one record per step and one per epoch."""

from __future__ import annotations

import json
import math
import os
from typing import Any


def _clean(value: Any) -> Any:
    """JSON has no NaN or Infinity: non-finite floats become null, so every line is valid JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value


class MetricsWriter:
    """Appends one JSON object per line; a no-op on ranks other than 0 or without a path.

    A write that fails (a full disk, the file system gone) warns once, on stdout, and the run goes on
    without metrics: the lines already written stay, the training is not lost for its log. ``failed``
    then says why (None while every write succeeded)."""

    def __init__(self, path: str | None, enabled: bool = True) -> None:
        self.path = path if enabled else None
        self._f: Any = None
        self.failed: str | None = None
        if self.path:
            try:
                os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
                self._f = open(self.path, "a", buffering=1)  # noqa: SIM115 - line-buffered: a crash keeps lines
            except OSError as exc:
                self._fail(exc)

    def write(self, record: dict[str, Any]) -> None:
        if self._f is not None:
            try:
                self._f.write(json.dumps(_clean(record), separators=(",", ":"), allow_nan=False) + "\n")
            except OSError as exc:
                self._fail(exc)

    def _fail(self, exc: OSError) -> None:
        self.failed = f"{exc.strerror or exc}"
        print(f"warning: --metrics-file {self.path}: write failed ({self.failed}); no more metrics are written, "
              "training goes on", flush=True)
        f, self._f = self._f, None
        if f is not None:
            try:
                f.close()
            except OSError:
                pass  # the unwritten tail is lost; what was written stays

    def close(self) -> None:
        if self._f is not None:
            try:
                self._f.close()
            except OSError as exc:
                self._f = None
                self._fail(exc)
            self._f = None


def read_metrics(path: str, kind: str = "epoch") -> list[dict[str, Any]]:
    """The records of one kind ("epoch" or "step") from a metrics file."""
    with open(path) as f:
        return [r for r in map(json.loads, filter(str.strip, f)) if r.get("kind", "epoch") == kind]

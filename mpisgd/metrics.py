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
    """Appends one JSON object per line; a no-op on ranks other than 0 or without a path."""

    def __init__(self, path: str | None, enabled: bool = True) -> None:
        self.path = path if enabled else None
        self._f = None
        if self.path:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            self._f = open(self.path, "a", buffering=1)  # line-buffered: a crash keeps finished lines

    def write(self, record: dict[str, Any]) -> None:
        if self._f is not None:
            self._f.write(json.dumps(_clean(record), separators=(",", ":"), allow_nan=False) + "\n")

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


def read_metrics(path: str, kind: str = "epoch") -> list[dict[str, Any]]:
    """The records of one kind ("epoch" or "step") from a metrics file."""
    with open(path) as f:
        return [r for r in map(json.loads, filter(str.strip, f)) if r.get("kind", "epoch") == kind]

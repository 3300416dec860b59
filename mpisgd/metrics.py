"""Progress, per-epoch lines and the JSON-lines metrics file (rank 0 only)."""

from __future__ import annotations

import json
import os
import sys
from typing import Any


def peak_rss_mib() -> float:
    """This process's peak resident memory so far, in MiB (0.0 where the OS does not say)."""
    try:
        import resource  # noqa: PLC0415 - Unix only
    except ImportError:
        return 0.0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024  # bytes on macOS, KiB on Linux


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
            self._f.write(json.dumps(record, separators=(",", ":")) + "\n")

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


def read_metrics(path: str, kind: str = "epoch") -> list[dict[str, Any]]:
    """The records of one kind ("epoch" or "step") from a metrics file."""
    with open(path) as f:
        return [r for r in map(json.loads, filter(str.strip, f)) if r.get("kind", "epoch") == kind]


def progress_bar(total: int, enabled: bool, desc: str) -> Any:
    """A tqdm bar on a TTY, else an object whose update/close do nothing."""
    show = enabled and sys.stderr.isatty()
    if show:
        from tqdm import tqdm  # noqa: PLC0415 - optional at import time

        return tqdm(total=total, desc=desc, leave=False, dynamic_ncols=True, file=sys.stderr)

    class _Null:
        def update(self, n: int = 1) -> None: ...
        def set_postfix_str(self, s: str) -> None: ...
        def close(self) -> None: ...

    return _Null()


def format_epoch(r: dict[str, Any], epochs: int) -> str:
    return (f"epoch {r['epoch']:>3}/{epochs}  loss {r['train_loss']:.4f}  test_acc {r['test_acc']:.4f}  "
            f"samples/s {r['samples_per_s']:>8.0f}  comm {100 * r['comm_frac']:4.1f}%  "
            f"lr {r['lr']:.4g}  {r['epoch_time_s']:.1f}s")

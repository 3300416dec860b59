"""The JSON-lines metrics file (rank 0): the run's typed records (mpisgd.app.records) written one per line,
and read back as runs. docs/metrics.md is its schema.
"""

from __future__ import annotations

import json
import math
import os
import stat
from dataclasses import dataclass, field
from typing import Any

from mpisgd.app.records import (
    READABLE,
    EpochRecord,
    Record,
    RecordError,
    RunRecord,
    StepRecord,
    TestRecord,
    from_json,
    to_json,
)
from mpisgd.errors import UsageError


class MetricsError(UsageError):
    """A metrics file that cannot be read: the message names the file and the line."""


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
    """Appends one record per line; a no-op on ranks other than 0 or without a path.

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

    def write(self, record: Record) -> None:
        if self._f is not None:
            try:
                self._f.write(json.dumps(_clean(to_json(record)), separators=(",", ":"), allow_nan=False) + "\n")
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


# -- reading -----------------------------------------------------------------------------------------
def read_text(path: str, what: str) -> str:
    """The text of a regular file ``path``; MetricsError (one line, naming ``what`` it should be) where it
    is missing, not a regular file (a FIFO or a terminal would block the read for ever), or not text."""
    try:
        st = os.stat(path)
    except OSError as exc:
        raise MetricsError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    if not stat.S_ISREG(st.st_mode):
        raise MetricsError(f"{path} is not a regular file (a pipe, a device or a directory): give {what}")
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise MetricsError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    try:
        return data.decode()
    except UnicodeDecodeError:
        raise MetricsError(f"{path} is not text: not {what}") from None


def json_lines(path: str, what: str) -> list[tuple[int, Any]]:
    """(line number, value) of each non-empty line of a JSON-lines file; MetricsError naming ``what`` the
    file should have been where it cannot be read or a line is not JSON."""
    values = []
    for i, line in enumerate(read_text(path, what).splitlines(), 1):
        if not line.strip():
            continue
        try:
            values.append((i, json.loads(line)))
        except (json.JSONDecodeError, RecursionError):
            raise MetricsError(f"{path}: line {i} is not JSON: not {what}") from None
    return values


@dataclass
class RunLog:
    """One run's records in a metrics file: its run record (None in files of schema 0, which had none) and
    what followed it."""

    first_line: int  # where the run's records begin in the file
    run: RunRecord | None = None
    steps: list[StepRecord] = field(default_factory=list)
    epochs: list[EpochRecord] = field(default_factory=list)
    test: TestRecord | None = None

    @property
    def schema(self) -> int:
        return self.run.schema if self.run is not None else 0


WHAT = "an mpisgd.train --metrics-file"


def read_metrics(path: str) -> list[RunLog]:
    """The runs a metrics file holds, in order: a run record starts a run; in a file of schema 0 (no run
    records) a record whose step is below the one before it does (a second run appended). MetricsError
    on a line that is no JSON object, a record that lacks a field, or a schema version this mpisgd does
    not read."""
    runs: list[RunLog] = []
    last_step = -1
    for i, obj in json_lines(path, WHAT):
        if not isinstance(obj, dict):
            raise MetricsError(f"{path}: line {i} is not a JSON object: not {WHAT}")
        if obj.get("kind") == "run":
            version = obj.get("schema")
            if isinstance(version, bool) or not isinstance(version, int) or version not in READABLE:
                raise MetricsError(f"{path}: line {i}: metrics schema {version!r}; this mpisgd reads schema "
                                   f"{', '.join(map(str, READABLE))} (docs/metrics.md): upgrade mpisgd")
        try:
            record = from_json(obj)
        except RecordError as exc:
            raise MetricsError(f"{path}: line {i}: {exc}: not {WHAT} of schema "
                               f"{' or '.join(map(str, READABLE))} (docs/metrics.md)") from None
        if record is None:
            continue  # a kind this version does not know: a later minor addition
        step = getattr(record, "step", None)
        new = isinstance(record, RunRecord) or not runs or (runs[-1].run is None and step is not None and
                                                             step < last_step)
        if new:
            runs.append(RunLog(first_line=i))
            last_step = -1
        log = runs[-1]
        if isinstance(record, RunRecord):
            log.run = record
        elif isinstance(record, StepRecord):
            log.steps.append(record)
        elif isinstance(record, EpochRecord):
            log.epochs.append(record)
        else:
            log.test = record
        if step is not None:
            last_step = step
    return runs

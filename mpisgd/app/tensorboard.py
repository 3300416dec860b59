"""TensorBoard event files from the metrics records (``--tensorboard DIR``, rank 0).

The events are TensorBoard's protocol buffers from tensorboardX (``pip install 'mpisgd[tensorboard]'``:
pure Python on protobuf, no TensorFlow or PyTorch), imported only when the option is given; without it,
:func:`open_writer` returns a writer that does nothing. Each record the loop writes to the metrics file
(mpisgd.app.records, read by field name) is also a set of scalars here, against the optimizer step:

* step records: ``step/loss`` (rank 0's batch), ``step/lr``, ``step/step_ms``, ``step/grad_norm`` (when
  the step has one);
* epoch records: ``epoch/train_loss``, ``epoch/val_loss``, ``epoch/val_acc``, ``epoch/test_acc`` (those
  measured), ``epoch/lr``, ``epoch/samples_per_s``, ``epoch/comm_frac`` (the share of the step spent
  waiting for communication), ``epoch/step_ms``, ``epoch/noise_scale`` (when measured);
* the test record: ``test/acc``, ``test/loss`` (with --val-split, the test set scored once, after training).

:class:`TensorBoardWriter` writes the event file itself, in the loop's thread, rather than through
tensorboardX's ``SummaryWriter``: that one's writer thread dies of a full disk and the next write then
waits for ever on its queue, and it names its file by the second and the host only, opening it for
writing, so that two runs started together in one directory write one file. Here each run's file has a
name of its own (its process and a random part) and is created, never opened over another; a write that
fails (a full disk) warns once and TensorBoard is written no more, as the metrics file; training goes on.
"""

from __future__ import annotations

import math
import os
import socket
import struct
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from mpisgd.app.records import Record
from mpisgd.errors import UsageError

MISSING = "--tensorboard needs the tensorboardX package: pip install 'mpisgd[tensorboard]' (or tensorboardX)"
SCALARS = {
    "step": ("loss", "lr", "step_ms", "grad_norm"),
    "epoch": ("train_loss", "val_loss", "val_acc", "test_acc", "lr", "samples_per_s", "comm_frac", "step_ms",
              "noise_scale"),
    "test": ("test_acc", "test_loss"),
}
_TAGS = {("test", "test_acc"): "test/acc", ("test", "test_loss"): "test/loss"}


def check_installed() -> None:
    """UsageError (one line, at set-up) when the writer library is missing or does not import."""
    _summary_writer()


def _summary_writer() -> Any:
    """tensorboardX's SummaryWriter class, imported without PyTorch: tensorboardX imports torch, where it
    is installed, only to accept its tensors (0.5 GiB and seconds on rank 0), and this writer passes
    floats. An import of torch during it fails, and tensorboardX goes on without."""
    hide = "torch" not in sys.modules
    if hide:
        sys.modules["torch"] = None  # type: ignore[assignment]  # Python's own mark for "cannot be imported"
    try:
        from tensorboardX import SummaryWriter  # noqa: PLC0415 - only when asked
    except ImportError:
        raise UsageError(MISSING) from None
    finally:
        if hide:
            del sys.modules["torch"]
    return SummaryWriter


class NullWriter:
    def write(self, record: Record) -> None: ...

    def close(self) -> None: ...


class TensorBoardWriter:
    """Scalars of each record into an event file of this run's own in ``logdir`` (created if needed),
    flushed at each epoch's end. ``failed`` says why writing stopped (None while every write succeeded)."""

    def __init__(self, logdir: str) -> None:
        _summary_writer()  # the library, or UsageError
        from tensorboardX.proto import event_pb2, summary_pb2  # noqa: PLC0415
        from tensorboardX.record_writer import masked_crc32c  # noqa: PLC0415

        self._event, self._summary, self._crc = event_pb2.Event, summary_pb2.Summary, masked_crc32c
        self.failed: str | None = None
        self._f: Any = None
        unique = f"{socket.gethostname()}.{os.getpid()}.{uuid.uuid4().hex[:8]}"  # this run's, whoever else writes
        self.path = Path(logdir) / f"events.out.tfevents.{int(time.time()):010d}.{unique}"
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._f = open(self.path, "xb")  # noqa: SIM115 - held for the run; "x": never another's file
            self._write(self._event(wall_time=time.time(), file_version="brain.Event:2"))
            self._f.flush()
        except OSError as exc:
            self._fail(exc)

    def write(self, record: Record) -> None:
        if self._f is None:
            return
        kind = record.kind
        step = int(getattr(record, "step", 0))  # a run record has none, and no scalars
        values = []
        for key in SCALARS.get(kind, ()):
            value = getattr(record, key, None)
            if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
                values.append(self._summary.Value(tag=_TAGS.get((kind, key), f"{kind}/{key}"), simple_value=value))
        try:
            if values:
                self._write(self._event(wall_time=time.time(), step=step, summary=self._summary(value=values)))
            if kind != "step":  # an epoch's end: on disk now
                self._f.flush()
        except OSError as exc:
            self._fail(exc)

    def _write(self, event: Any) -> None:
        """One event as a TFRecord: length, its masked CRC-32C, the event, its masked CRC-32C."""
        data = event.SerializeToString()
        header = struct.pack("<Q", len(data))
        self._f.write(header + struct.pack("<I", self._crc(header)) + data + struct.pack("<I", self._crc(data)))

    def _fail(self, exc: OSError) -> None:
        self.failed = f"{exc.strerror or exc}"
        print(f"warning: --tensorboard {self.path.parent}: write failed ({self.failed}); no more TensorBoard "
              "events are written, training goes on", flush=True)
        f, self._f = self._f, None
        if f is not None:
            try:
                f.close()
            except OSError:
                pass  # the unwritten tail is lost; the events written stay

    def close(self) -> None:
        if self._f is not None:
            try:
                self._f.close()
            except OSError as exc:
                self._fail(exc)
            self._f = None


def open_writer(logdir: str | None, enabled: bool = True) -> Any:
    """A TensorBoardWriter for ``logdir`` on the rank that writes, a NullWriter otherwise."""
    return TensorBoardWriter(logdir) if logdir and enabled else NullWriter()

"""TensorBoard event files from the metrics records (``--tensorboard DIR``, rank 0).

The writer is tensorboardX's ``SummaryWriter`` (``pip install 'mpisgd[tensorboard]'``): pure Python on
protobuf, no TensorFlow or PyTorch. It is imported only when the option is given; without it,
:func:`open_writer` returns a writer that does nothing. Each record the loop writes to the metrics file
(mpisgd.app.metrics) is also a set of scalars here, against the optimizer step:

* step records: ``step/loss`` (rank 0's batch), ``step/lr``, ``step/step_ms``, ``step/grad_norm`` (when
  the step has one);
* epoch records: ``epoch/train_loss``, ``epoch/val_loss``, ``epoch/val_acc``, ``epoch/test_acc`` (those
  measured), ``epoch/lr``, ``epoch/samples_per_s``, ``epoch/comm_frac`` (the share of the step spent
  waiting for communication), ``epoch/step_ms``, ``epoch/noise_scale`` (when measured);
* the test record: ``test/acc``, ``test/loss`` (with --val-split, the test set scored once, after training).
"""

from __future__ import annotations

import math
import sys
from typing import Any

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
    def write(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class TensorBoardWriter:
    """Scalars of each record into event files in ``logdir`` (created if needed)."""

    def __init__(self, logdir: str) -> None:
        self._w = _summary_writer()(logdir=logdir, flush_secs=30)

    def write(self, record: dict[str, Any]) -> None:
        kind = record.get("kind", "epoch")
        step = int(record.get("step", 0))
        for key in SCALARS.get(kind, ()):
            value = record.get(key)
            if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
                self._w.add_scalar(_TAGS.get((kind, key), f"{kind}/{key}"), float(value), step)
        if kind != "step":  # an epoch's end: on disk now, not at the next timed flush
            self._w.flush()

    def close(self) -> None:
        self._w.close()


def open_writer(logdir: str | None, enabled: bool = True) -> Any:
    """A TensorBoardWriter for ``logdir`` on the rank that writes, a NullWriter otherwise."""
    return TensorBoardWriter(logdir) if logdir and enabled else NullWriter()

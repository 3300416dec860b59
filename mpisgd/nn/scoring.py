"""Scoring a model on held-out data: the one loop behind the trainer's test and validation scores,
``python -m mpisgd.evaluate`` and the experiments.

The model runs in eval mode (running statistics, no dropout) and is put back in the mode it was in.
Targets are the labels of the last axis of the logits: one per sample for classification, one per
position for a language model; labels equal to ``ignore_index`` are not scored. What comes back are
sums (:class:`Tally`), so that ranks that scored disjoint parts can add them (mpisgd.app does, with
one all-reduce).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mpisgd.backend import to_numpy, xp_of


@dataclass
class Tally:
    """Sums over the scored targets."""

    targets: int = 0  # labels scored (ignored ones excluded)
    correct: int = 0  # those whose arg-max logit is the label
    loss_sum: float = 0.0  # summed softmax cross-entropy, in nats
    per_class: np.ndarray | None = field(default=None)  # (classes, 3): targets, correct, summed loss per label

    @property
    def accuracy(self) -> float:
        return self.correct / self.targets if self.targets else float("nan")

    @property
    def mean_loss(self) -> float:
        return self.loss_sum / self.targets if self.targets else float("nan")

    def to_array(self) -> np.ndarray:
        """float64 [targets, correct, loss_sum, per-class ...]: what ranks add with one all-reduce."""
        head = np.array([self.targets, self.correct, self.loss_sum], dtype=np.float64)
        return head if self.per_class is None else np.concatenate([head, self.per_class.reshape(-1)])

    @classmethod
    def from_array(cls, a: np.ndarray, n_classes: int | None = None) -> Tally:
        per_class = None if n_classes is None else np.array(a[3:3 + 3 * n_classes]).reshape(n_classes, 3)
        return cls(int(round(a[0])), int(round(a[1])), float(a[2]), per_class)


def score(model: Any, batches: Iterable[tuple[Any, Any]], n_classes: int | None = None,
          ignore_index: int | None = None, on_batch: Callable[[], None] | None = None) -> Tally:
    """Tally ``model``'s predictions over ``batches`` of (inputs, labels), in eval mode. ``n_classes``:
    also count per label; ``on_batch()`` is called after each batch (a long scoring is progress)."""
    was_training = model.training
    model.eval()
    tally = Tally(per_class=None if n_classes is None else np.zeros((n_classes, 3)))
    try:
        for x, y in batches:
            logits = model.forward(x)
            _add(tally, logits, y, ignore_index)
            if on_batch is not None:
                on_batch()
    finally:
        model.train(was_training)
    return tally


def _add(tally: Tally, logits: Any, y: Any, ignore_index: int | None) -> None:
    xp = xp_of(logits)
    z = logits.reshape(-1, logits.shape[-1])
    labels = y.reshape(-1)
    if ignore_index is not None:
        keep = labels != ignore_index
        z, labels = z[keep], labels[keep]
    z = z - z.max(axis=1, keepdims=True)  # cross-entropy per target, stable: log sum exp(z) - z[label]
    losses = xp.log(xp.exp(z).sum(axis=1)) - z[xp.arange(len(labels)), labels]
    right = z.argmax(axis=1) == labels
    tally.targets += int(len(labels))
    tally.correct += int(right.sum())
    tally.loss_sum += float(losses.astype(np.float64).sum())
    if tally.per_class is not None:
        lab = to_numpy(labels)
        np.add.at(tally.per_class[:, 0], lab, 1)
        np.add.at(tally.per_class[:, 1], lab, to_numpy(right))
        np.add.at(tally.per_class[:, 2], lab, to_numpy(losses).astype(np.float64))

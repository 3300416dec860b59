"""Softmax cross-entropy: one label per sample (classification) or one target per position (language models)."""

from __future__ import annotations

from mpisgd.kernels import FAST, Kernels
from mpisgd.nn.layers import Array, xp_of


class SoftmaxCrossEntropy:
    """Mean negative log-likelihood of integer labels under softmax(logits).

    ``backward(scale)`` returns d(sum of per-sample losses)/d(logits) times
    ``scale``; the default scale 1/n gives the gradient of the mean. Data
    parallelism passes 1/(k*b*m) so that the all-reduce *sum* is already the
    mean over the whole effective batch (the pre-scaled form of "sum, then / k").

    ``kernels`` computes its exp, log and sums (mpisgd.kernels; the model's, so that a portable model's
    loss is portable too).
    """

    def __init__(self, kernels: Kernels = FAST) -> None:
        self.kernels = kernels
        self._p: Array = None
        self._labels: Array = None

    def forward(self, logits: Array, labels: Array) -> float:
        return float(self.forward_array(logits, labels))

    def forward_array(self, logits: Array, labels: Array) -> Array:
        """The mean loss as a 0-d array (no device-to-host sync on GPU)."""
        xp, ops = xp_of(logits), self.kernels
        n = logits.shape[0]
        p = logits - logits.max(axis=1, keepdims=True)  # stable: exp of <= 0
        ops.exp(p, out=p)
        p /= ops.sum(p, axis=1, keepdims=True)
        self._p, self._labels = p, labels
        picked = p[xp.arange(n), labels]
        return -ops.mean(ops.log(xp.maximum(picked, xp.finfo(p.dtype).tiny)))

    def count(self, labels: Array) -> int:
        """How many targets a micro-batch scores: one per label (data parallelism weighs each target
        1 / (k * the step's count over the rank))."""
        return int(labels.size)

    def backward(self, scale: float | None = None) -> Array:
        xp = xp_of(self._p)
        n = self._p.shape[0]
        grad = self._p  # consumed once: reuse the probabilities' memory
        grad[xp.arange(n), self._labels] -= 1.0
        grad *= (1.0 / n) if scale is None else scale
        return grad


def accuracy_count(logits: Array, labels: Array) -> int:
    """Number of samples whose arg-max logit is the label."""
    return int((logits.argmax(axis=1) == labels).sum())


class TokenCrossEntropy:
    """Softmax cross-entropy at every position: logits (..., C), integer targets (...) — a language
    model's (N, T, vocabulary) and (N, T). Targets equal to ``ignore_index`` are not scored.

    ``forward_array`` gives the mean over the scored targets; ``count(y)`` how many a batch has; and
    ``backward(scale)`` d(sum of the scored targets' losses)/d(logits) times ``scale`` (default
    1/count: the gradient of the mean). Data parallelism passes 1/(k * the step's summed counts), so
    every token of the effective batch weighs the same whatever the rank or micro-batch it is in.
    """

    def __init__(self, ignore_index: int = -1, kernels: Kernels = FAST) -> None:
        self.ignore_index = ignore_index
        self.kernels = kernels  # exp, log and sums (mpisgd.kernels), as SoftmaxCrossEntropy's
        self._p: Array = None
        self._rows: Array = None  # the flat rows of the scored targets
        self._labels: Array = None  # and their labels
        self._keep: Array = None  # per flat row: scored or not
        self._shape: tuple[int, ...] = ()
        self._count = 0

    def count(self, labels: Array) -> int:
        """The targets scored in ``labels`` (those not equal to ignore_index)."""
        return int((labels != self.ignore_index).sum())

    def forward(self, logits: Array, labels: Array) -> float:
        return float(self.forward_array(logits, labels))

    def forward_array(self, logits: Array, labels: Array) -> Array:
        """The mean loss over the scored targets, as a 0-d array (no device-to-host sync on GPU)."""
        xp, ops = xp_of(logits), self.kernels
        c = logits.shape[-1]
        z = logits.reshape(-1, c)
        flat = labels.reshape(-1)
        if z.shape[0] != flat.shape[0]:
            raise ValueError(f"TokenCrossEntropy: logits {tuple(logits.shape)} for targets {tuple(labels.shape)}")
        p = z - z.max(axis=1, keepdims=True)  # stable: exp of <= 0
        ops.exp(p, out=p)
        p /= ops.sum(p, axis=1, keepdims=True)
        keep = flat != self.ignore_index
        rows = xp.flatnonzero(keep)
        picked = p[rows, flat[rows]]
        self._p, self._rows, self._labels, self._keep = p, rows, flat[rows], keep
        self._count, self._shape = int(rows.size), tuple(logits.shape)
        return -ops.sum(ops.log(xp.maximum(picked, xp.finfo(p.dtype).tiny)), axis=0) / max(1, self._count)

    def backward(self, scale: float | None = None) -> Array:
        """The logits' gradient (of their shape), times ``scale``."""
        grad = self._p  # consumed once: reuse the probabilities' memory
        grad[self._rows, self._labels] -= 1.0
        if self._count != grad.shape[0]:
            grad *= self._keep[:, None]  # ignored targets give no gradient
        grad *= (1.0 / max(1, self._count)) if scale is None else scale
        return grad.reshape(self._shape)

"""Softmax cross-entropy: the loss of every model here."""

from __future__ import annotations

from mpisgd.nn.layers import Array, xp_of


class SoftmaxCrossEntropy:
    """Mean negative log-likelihood of integer labels under softmax(logits).

    ``backward(scale)`` returns d(sum of per-sample losses)/d(logits) times
    ``scale``; the default scale 1/n gives the gradient of the mean. Data
    parallelism passes 1/(k*b*m) so that the all-reduce *sum* is already the
    mean over the whole effective batch (the pre-scaled form of "sum, then / k").
    """

    def __init__(self) -> None:
        self._p: Array = None
        self._labels: Array = None

    def forward(self, logits: Array, labels: Array) -> float:
        return float(self.forward_array(logits, labels))

    def forward_array(self, logits: Array, labels: Array) -> Array:
        """The mean loss as a 0-d array (no device-to-host sync on GPU)."""
        xp = xp_of(logits)
        n = logits.shape[0]
        p = logits - logits.max(axis=1, keepdims=True)  # stable: exp of <= 0
        xp.exp(p, out=p)
        p /= p.sum(axis=1, keepdims=True)
        self._p, self._labels = p, labels
        picked = p[xp.arange(n), labels]
        return -xp.log(xp.maximum(picked, xp.finfo(p.dtype).tiny)).mean()

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

"""Softmax cross-entropy: the loss of every model here."""

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

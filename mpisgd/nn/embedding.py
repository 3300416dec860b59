"""Embeddings: token ids to vectors (:class:`Embedding`) and a learned vector per position added to them
(:class:`PositionEmbedding`), the two inputs of a GPT.

Token ids arrive as an integer (N, T) array (mpisgd.data.BatchLoader delivers int64) and have no
gradient: ``Embedding.backward`` returns None. Its weight gradient adds, for every vocabulary row, the
output gradients of the positions holding that token. For a small vocabulary (a character-level
model's few dozen symbols) that is one GEMM, onehot(ids)^T dy, which BLAS runs faster than any
scatter (0.7 ms against np.add.at's 3.6 ms for 4096 tokens x 128 dimensions, vocabulary 73, one
core); where the one-hot matrix would be large (ONEHOT_MAX_BYTES), ``add.at`` scatters instead.
"""

from __future__ import annotations

import numpy as np

from mpisgd.backend import xp_of
from mpisgd.nn.module import Array, Module

ONEHOT_MAX_BYTES = 16 << 20  # the largest one-hot (tokens x vocabulary) matrix the weight gradient builds


class Embedding(Module):
    """y[n, t] = W[ids[n, t]]: (..., ) integer ids in 0..vocab-1 to (..., dim) vectors, W ~ N(0, init_std^2)."""

    # the one-hot product goes through ctx.kernels; add.at (a one-hot over ONEHOT_MAX_BYTES) adds in index
    # order on NumPy, but with atomics on CuPy, where its bits are not portable
    portable = True

    def __init__(self, vocab: int, dim: int, init_std: float = 0.02) -> None:
        super().__init__()
        if vocab < 1 or dim < 1:
            raise ValueError(f"Embedding({vocab}, {dim}): the vocabulary and the width must be >= 1")
        self.vocab, self.dim, self.init_std = vocab, dim, init_std
        self.param_shapes = [("W", (vocab, dim))]
        self._ids: Array = None

    def init_params(self, rng: np.random.Generator, dtype: np.dtype) -> dict[str, np.ndarray]:
        return {"W": rng.normal(0.0, self.init_std, (self.vocab, self.dim)).astype(dtype)}

    def forward(self, ids: Array) -> Array:
        xp = xp_of(ids)
        if ids.dtype.kind not in "iu":
            raise TypeError(f"Embedding takes integer token ids, got {ids.dtype} (the data must be token ids: "
                            "a text file or an .npz of tokens, docs/data.md)")
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= self.vocab):  # take would wrap a negative id
            raise ValueError(f"{self!r} takes token ids 0..{self.vocab - 1}, got {int(ids.min())}..{int(ids.max())}: "
                             "ids from another vocabulary?")
        self._ids = ids.reshape(-1)
        W = self.params["W"]
        y = self._buf("y", (*ids.shape, self.dim), W)
        xp.take(W, self._ids, axis=0, out=y.reshape(-1, self.dim))
        return y

    def backward(self, dy: Array, need_dx: bool = True) -> None:
        xp = xp_of(dy)
        dy2 = dy.reshape(-1, self.dim)
        dW = self._grad_out("W", (self.vocab, self.dim), dy)
        n = len(self._ids)
        if n * self.vocab * dy.itemsize <= ONEHOT_MAX_BYTES:
            onehot = self._buf("onehot", (self.vocab, n), dy)  # (vocab, tokens): row v marks token v's positions
            onehot.fill(0)
            onehot[self._ids, xp.arange(n)] = 1
            self.ctx.kernels.matmul(onehot, dy2, out=dW)
        else:
            dW.fill(0)
            xp.add.at(dW, self._ids, dy2)
        self._grad_done("W", dW)
        # token ids have no gradient

    def extra_repr(self) -> str:
        return f"{self.vocab}, {self.dim}"


class PositionEmbedding(Module):
    """y[n, t] = x[n, t] + P[t]: a learned vector per position 0..context-1 added to (N, T, dim) inputs,
    T <= context; P ~ N(0, init_std^2)."""

    portable = True  # through ctx.kernels, or elementwise only

    def __init__(self, context: int, dim: int, init_std: float = 0.02) -> None:
        super().__init__()
        self.context, self.dim, self.init_std = context, dim, init_std
        self.param_shapes = [("P", (context, dim))]
        self._t = 0

    def init_params(self, rng: np.random.Generator, dtype: np.dtype) -> dict[str, np.ndarray]:
        return {"P": rng.normal(0.0, self.init_std, (self.context, self.dim)).astype(dtype)}

    def forward(self, x: Array) -> Array:
        if x.ndim != 3 or x.shape[-1] != self.dim:
            raise ValueError(f"PositionEmbedding takes (N, T, {self.dim}) inputs, got shape {tuple(x.shape)}: the "
                             "model takes a batch of windows of token ids, (N, T)")
        t = x.shape[1]
        if t > self.context:
            raise ValueError(f"PositionEmbedding: {t} positions, more than the model's context of {self.context}")
        self._t = t
        y = self._buf("y", x.shape, x)
        xp_of(x).add(x, self.params["P"][:t], out=y)
        return y

    def backward(self, dy: Array, need_dx: bool = True) -> Array | None:
        dP = self._grad_out("P", (self.context, self.dim), dy)
        self.ctx.kernels.sum(dy, axis=0, out=dP[:self._t])
        dP[self._t:] = 0
        self._grad_done("P", dP)
        return dy if need_dx else None  # the input's gradient is the output's

    def extra_repr(self) -> str:
        return f"{self.context}, {self.dim}"

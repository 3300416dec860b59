"""Causal multi-head self-attention (Vaswani et al. 2017), as GPT-2 and nanoGPT write it.

For an input x of (N, T, D) and H heads of d = D/H dimensions:

    q, k, v = split(x Wqkv + bqkv)                      one GEMM, (N, T, 3D), then heads (3, N, H, T, d)
    A = softmax(q k^T / sqrt(d) + causal mask)          (N, H, T, T); position t sees positions <= t
    y = merge(A v) Wo + bo                              (N, T, D)

Written for speed on NumPy and CuPy alike: the projections are one GEMM each over all N*T rows
(mpisgd.nn.Linear), the scores and the weighted sums are batched GEMMs over the N*H heads
(``matmul`` of stacked matrices, transposed operands passed as views, never copied), 1/sqrt(d) is
folded into q (N*T*D multiplies instead of N*H*T*T), and the masked softmax is one run of in-place
ufuncs over the scores (add the mask, subtract the row maximum, exp, divide by the row sum), whose
result backward reuses.

Backward, with P the softmax and dP = dY v^T:

    dS = P * (dP - rowsum(dP * P)),   dq = dS k / sqrt(d),   dk = dS^T q',   dv = P^T dY

Activation memory per layer (float32, what forward keeps for backward): the heads 3*N*T*D, the
attention matrix N*H*T^2, the weighted sums N*T*D and their merge N*T*D, i.e. 4 * (5*N*T*D + N*H*T^2)
bytes; backward adds as much again in scratch (dP, dS and the heads' gradients), reused from step to
step. At the GPT recipe's N=32, T=64, D=128, H=4: 5.2 MB of heads and sums and 2.1 MB of attention
per layer (at T=128: 10.5 and 8.4 MB). The T^2 term is what grows: at T=1024 the attention weights
alone are 512 MiB per layer at this batch (there, a fused kernel that recomputes P in backward, as
FlashAttention does, would pay).
"""

from __future__ import annotations

import math

import numpy as np

from mpisgd.backend import xp_of
from mpisgd.nn.dropout import Dropout
from mpisgd.nn.layers import Linear
from mpisgd.nn.module import Array, Module


class CausalSelfAttention(Module):
    """Multi-head self-attention where each position attends to itself and the positions before it.

    Children: ``qkv`` (Linear dim -> 3*dim, the queries', keys' and values' projections side by side,
    as nanoGPT's ``c_attn``), ``drop`` (Dropout on the attention weights, only when ``dropout`` > 0)
    and ``proj`` (Linear dim -> dim, the output projection, initialised with ``proj_std``).
    """

    portable = True  # through ctx.kernels, or elementwise only

    def __init__(self, dim: int, heads: int, context: int, dropout: float = 0.0, init_std: float = 0.02,
                 proj_std: float | None = None) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"attention: {dim} dimensions do not split into {heads} heads")
        self.dim, self.heads, self.context, self.head_dim = dim, heads, context, dim // heads
        self.qkv = Linear(dim, 3 * dim, init_std=init_std)
        self.drop = Dropout(dropout) if dropout > 0 else None
        self.proj = Linear(dim, dim, init_std=init_std if proj_std is None else proj_std)
        for name, child in (("qkv", self.qkv), ("drop", self.drop), ("proj", self.proj)):
            if child is not None:
                self.add(name, child)
        self._p: Array = None  # the attention weights, softmax of the scores
        self._pd: Array = None  # the same after dropout (what multiplied v)
        self._heads: Array = None  # (3, N, H, T, d): q (scaled by 1/sqrt(d)), k, v

    def _mask(self, t: int, like: Array) -> Array:
        """(T, T): 0 where a position may attend, -inf after it."""
        mask = self._bufs.get(("mask", (t, t)))
        if mask is None or mask.dtype != like.dtype:
            xp = xp_of(like)
            mask = self._buf("mask", (t, t), like)
            mask[...] = xp.asarray(np.triu(np.full((t, t), -np.inf), k=1), dtype=like.dtype)
        return mask

    def forward(self, x: Array) -> Array:
        n, t, _ = x.shape
        h, d = self.heads, self.head_dim
        qkv = self.qkv.forward(x)  # (N, T, 3D)
        heads = self._buf("heads", (3, n, h, t, d), x)
        heads[...] = qkv.reshape(n, t, 3, h, d).transpose(2, 0, 3, 1, 4)
        q, k, v = heads
        q *= x.dtype.type(1.0 / math.sqrt(d))
        p = self._buf("att", (n, h, t, t), x)
        ops = self.ctx.kernels  # products, exp and sums: mpisgd.kernels
        ops.matmul(q, k.swapaxes(-1, -2), out=p)
        # softmax over the last axis, masked, in place: exp(s - max) / sum
        p += self._mask(t, x)
        p -= p.max(axis=-1, keepdims=True)
        ops.exp(p, out=p)
        p /= ops.sum(p, axis=-1, keepdims=True)
        self._p, self._heads = p, heads
        pd = self.drop.forward(p) if self.drop is not None else p
        self._pd = pd
        y = self._buf("y_heads", (n, h, t, d), x)
        ops.matmul(pd, v, out=y)
        merged = self._buf("merged", (n, t, self.dim), x)
        merged.reshape(n, t, h, d)[...] = y.transpose(0, 2, 1, 3)
        return self.proj.forward(merged)

    def backward(self, dy: Array, need_dx: bool = True) -> Array | None:
        xp = xp_of(dy)
        dmerged = self.backward_child(self.proj, dy)
        assert dmerged is not None
        n, t, _ = dmerged.shape
        h, d = self.heads, self.head_dim
        q, k, v = self._heads
        dyh = self._buf("dy_heads", (n, h, t, d), dy)
        dyh[...] = dmerged.reshape(n, t, h, d).transpose(0, 2, 1, 3)
        dheads = self._buf("dheads", (3, n, h, t, d), dy)
        dq, dk, dv = dheads
        ops = self.ctx.kernels
        ops.matmul(self._pd.swapaxes(-1, -2), dyh, out=dv)
        dp = self._buf("datt", (n, h, t, t), dy)
        ops.matmul(dyh, v.swapaxes(-1, -2), out=dp)
        if self.drop is not None:
            dp = self.backward_child(self.drop, dp)
            assert dp is not None
        # softmax backward: dS = P * (dP - rowsum(dP * P)), in place in dp
        p = self._p
        tmp = self._buf("tmp", p.shape, dy)
        xp.multiply(dp, p, out=tmp)
        dp -= ops.sum(tmp, axis=-1, keepdims=True)
        dp *= p
        ops.matmul(dp, k, out=dq)
        dq *= dy.dtype.type(1.0 / math.sqrt(d))
        ops.matmul(dp.swapaxes(-1, -2), q, out=dk)  # q is already scaled: dk = dS^T (q / sqrt(d))
        dqkv = self._buf("dqkv", (n, t, 3 * self.dim), dy)
        dqkv.reshape(n, t, 3, h, d)[...] = dheads.transpose(1, 3, 0, 2, 4)
        return self.backward_child(self.qkv, dqkv, need_dx)

    def extra_repr(self) -> str:
        return f"{self.dim}, heads={self.heads}, context={self.context}" + \
            (f", dropout={self.drop.p:g}" if self.drop is not None else "")

    def __repr__(self) -> str:
        return f"CausalSelfAttention({self.extra_repr()})"

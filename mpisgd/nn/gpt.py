"""A GPT: a decoder-only transformer language model, as nanoGPT's ``model.py`` (Radford et al. 2019).

    ids (N, T) -> Embedding + PositionEmbedding -> [Dropout] -> blocks -> LayerNorm -> Linear -> (N, T, vocab)
    block: x + Attention(LayerNorm(x)) [Dropout], then x + MLP(LayerNorm(x)) [Dropout]
    MLP:   Linear(D, 4D) -> GELU -> Linear(4D, D)

Pre-norm residual blocks, GELU in GPT-2's tanh form (mpisgd.nn.gelu says why), biases in every Linear
and LayerNorm. Initialisation as nanoGPT's: every weight matrix and both embeddings N(0, 0.02^2), the
two projections back into the residual stream (attention's ``proj``, the MLP's second Linear)
N(0, (0.02 / sqrt(2 * layers))^2), biases 0, LayerNorm 1 and 0.

One difference from nanoGPT: the output layer is not tied to the token embedding. Tying makes one
parameter two modules' weight, and a model's parameters are views of one flat buffer, each owned by
one module (mpisgd.nn.module.Model refuses a module twice); so the head has its own (D, vocab)
matrix and bias, vocab * (D + 1) more parameters (9,417 for 73 characters at D = 128).

Dropout modules (mpisgd.nn.dropout, keyed by sample: the same masks at any k) are in the tree only
where ``dropout`` > 0: after the embeddings, on the attention weights and after each block's two
branches, as nanoGPT places them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mpisgd.nn.attention import CausalSelfAttention
from mpisgd.nn.containers import Residual, Sequential
from mpisgd.nn.dropout import Dropout
from mpisgd.nn.embedding import Embedding, PositionEmbedding
from mpisgd.nn.gelu import GELU
from mpisgd.nn.layernorm import LayerNorm
from mpisgd.nn.layers import Linear
from mpisgd.nn.module import Module

INIT_STD = 0.02  # GPT-2's and nanoGPT's


@dataclass(frozen=True)
class GPTShape:
    """The sizes of a GPT (what --gpt-layers, --gpt-heads, --gpt-width, --dropout and --context set)."""

    vocab: int  # tokens the model reads and predicts
    context: int  # the longest sequence: positions 0..context-1
    layers: int = 4
    heads: int = 4
    width: int = 128  # D, the residual stream's dimensions
    dropout: float = 0.0

    def check(self) -> None:
        for name in ("vocab", "context", "layers", "heads", "width"):
            if getattr(self, name) < 1:
                raise ValueError(f"--model gpt: {name} must be >= 1, got {getattr(self, name)}")
        if self.width % self.heads:
            raise ValueError(f"--model gpt: --gpt-width {self.width} does not split into --gpt-heads {self.heads} "
                             "heads of equal size: choose a width divisible by the heads")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"--model gpt: --dropout must be in [0, 1), got {self.dropout}")


def _dropout(p: float) -> list[Module]:
    return [Dropout(p)] if p > 0 else []


def block(s: GPTShape) -> Sequential:
    """One transformer block: two pre-norm residual branches, attention then the MLP."""
    proj_std = INIT_STD / math.sqrt(2 * s.layers)
    attention = Sequential(LayerNorm(s.width), CausalSelfAttention(s.width, s.heads, s.context, s.dropout,
                                                                    INIT_STD, proj_std), *_dropout(s.dropout))
    mlp = Sequential(LayerNorm(s.width), Linear(s.width, 4 * s.width, init_std=INIT_STD), GELU(),
                     Linear(4 * s.width, s.width, init_std=proj_std), *_dropout(s.dropout))
    return Sequential(Residual(attention), Residual(mlp))


def gpt(s: GPTShape) -> Sequential:
    """The GPT of shape ``s``: token ids (N, T), T <= context, to logits (N, T, vocab)."""
    s.check()
    return Sequential(
        Embedding(s.vocab, s.width, INIT_STD), PositionEmbedding(s.context, s.width, INIT_STD),
        *_dropout(s.dropout),
        *(block(s) for _ in range(s.layers)),
        LayerNorm(s.width), Linear(s.width, s.vocab, init_std=INIT_STD),
    )

"""PyTorch models for `--model examples.torch_models:NAME` (any function of (input shape, classes) that
returns a torch.nn.Module is a model factory; docs/torch.md):

    python -m mpisgd.train --model examples.torch_models:resnet --epochs 1
    mpiexec -n 2 python -m mpisgd.train --model examples.torch_models:gpt --epochs 1

- `mlp`: 784-1024-1024-10 with ReLU, the reference MLP (W1) of docs/benchmarks.md;
- `resnet`: a small ResNet for C x H x W images: a 3x3 stem, three stages of two residual blocks (16,
  32, 64 channels, BatchNorm, the later stages strided with a 1x1 projection shortcut), global average
  pooling, Dropout, a linear classifier;
- `gpt`: a GPT-style decoder (nanoGPT's block: LayerNorm, causal multi-head self-attention, LayerNorm,
  a GELU MLP, residual connections, learned positions) over the rows of an image as a sequence of T
  tokens of W features (28 x 28 Fashion-MNIST: 28 tokens), classified from the last position;
- `gpt_tokens`: the same decoder over integer token ids (an embedding, weights tied with the output
  head), one next-token prediction per position: logits (N, T, vocabulary) for per-token targets.
- `lstm`: recurrent layers over the rows of an image (28 steps of 28 features for Fashion-MNIST): a
  two-layer LSTM, a bidirectional GRU, a linear classifier of the last step.

The same definitions serve benchmarks/baselines.py's DDP side of the comparison.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F  # noqa: N812 - torch's own spelling


def mlp(in_shape: tuple[int, ...], n_classes: int, hidden: tuple[int, ...] = (1024, 1024)) -> nn.Module:
    layers: list[nn.Module] = [nn.Flatten()]
    width = math.prod(in_shape)
    for h in hidden:
        layers += [nn.Linear(width, h), nn.ReLU()]
        width = h
    return nn.Sequential(*layers, nn.Linear(width, n_classes))


class Block(nn.Module):
    """conv-BN-ReLU-conv-BN, plus the input (projected by a strided 1x1 conv and BN where the shape
    changes), then ReLU."""

    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut = nn.Identity() if stride == 1 and c_in == c_out else \
            nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.shortcut(x))


class ResNet(nn.Module):
    def __init__(self, channels: int, n_classes: int, widths: tuple[int, ...] = (16, 32, 64), blocks: int = 2,
                 dropout: float = 0.1) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(channels, widths[0], 3, 1, 1, bias=False), nn.BatchNorm2d(widths[0]),
                                  nn.ReLU())
        stages, c = [], widths[0]
        for i, w in enumerate(widths):
            for j in range(blocks):
                stages.append(Block(c, w, 2 if (i > 0 and j == 0) else 1))
                c = w
        self.stages = nn.Sequential(*stages)
        self.drop = nn.Dropout(dropout)
        self.head = nn.Linear(c, n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.stages(self.stem(x))
        return self.head(self.drop(y.mean(dim=(2, 3))))


def resnet(in_shape: tuple[int, ...], n_classes: int) -> nn.Module:
    return ResNet(in_shape[0], n_classes)


class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.drop = nn.Dropout(dropout)  # on the output (keyed by mpisgd); no dropout inside attention

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(n, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.drop(self.proj(y.transpose(1, 2).reshape(n, t, d)))


class DecoderBlock(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads, dropout)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim), nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A decoder over T positions of ``features`` inputs each (``vocab``: integer token ids instead, with an
    embedding tied to the output head and logits at every position)."""

    def __init__(self, t: int, features: int, n_out: int, dim: int = 64, layers: int = 2, heads: int = 4,
                 dropout: float = 0.1, vocab: int = 0) -> None:
        super().__init__()
        self.vocab = vocab
        self.embed = nn.Embedding(vocab, dim) if vocab else nn.Linear(features, dim)
        self.pos = nn.Parameter(torch.zeros(1, t, dim))
        self.blocks = nn.Sequential(*(DecoderBlock(dim, heads, dropout) for _ in range(layers)))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, n_out, bias=not vocab)
        if vocab:
            self.head.weight = self.embed.weight  # tied, as GPT-2's
        for name, p in self.named_parameters():  # GPT-2's initialisation
            if name.endswith("weight") and p.dim() == 2:
                nn.init.normal_(p, 0.0, 0.02)
        nn.init.normal_(self.pos, 0.0, 0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.long() if self.vocab else x
        h = self.blocks(self.embed(tokens) + self.pos[:, :x.shape[1]])
        h = self.ln(h)
        return self.head(h) if self.vocab else self.head(h[:, -1])


def gpt(in_shape: tuple[int, ...], n_classes: int) -> nn.Module:
    """The decoder over an image's rows: (C x) H x W samples as H tokens of C*W features."""
    t, w = in_shape[-2], in_shape[-1] * (in_shape[0] if len(in_shape) == 3 else 1)
    model = GPT(t, w, n_classes)
    return nn.Sequential(Rows(), model)


class Rows(nn.Module):
    """(N, C, H, W) -> (N, H, C*W): the image's rows as a sequence."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 3:
            return x
        n, c, h, w = x.shape
        return x.permute(0, 2, 1, 3).reshape(n, h, c * w)


def gpt_tokens(in_shape: tuple[int, ...], n_classes: int) -> nn.Module:
    """Next-token prediction over sequences of ``in_shape[0]`` integer ids below ``n_classes``."""
    return GPT(in_shape[0], 0, n_classes, vocab=n_classes)


class Recurrent(nn.Module):
    """Recurrent layers over an image's rows: an LSTM of ``layers`` layers, then a bidirectional GRU, both
    batch first; the GRU's last position (both directions) classified by a linear head."""

    def __init__(self, features: int, n_classes: int, hidden: int = 128, layers: int = 2) -> None:
        super().__init__()
        self.rows = Rows()
        self.lstm = nn.LSTM(features, hidden, num_layers=layers, batch_first=True)
        self.gru = nn.GRU(hidden, hidden, batch_first=True, bidirectional=True)
        self.head = nn.Linear(2 * hidden, n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.lstm(self.rows(x))
        h, _ = self.gru(h)
        return self.head(h[:, -1])


def lstm(in_shape: tuple[int, ...], n_classes: int) -> nn.Module:
    """(C x) H x W samples as H steps of C*W features through LSTM and GRU layers (:class:`Recurrent`)."""
    return Recurrent(in_shape[-1] * (in_shape[0] if len(in_shape) == 3 else 1), n_classes)

"""Tiny PyTorch models for the torch tests: model factories (``--model torch_factories:NAME`` with tests/ on
PYTHONPATH) and modules the in-process tests build."""

from __future__ import annotations

import math

import torch
from torch import nn


class TinyResNet(nn.Module):
    """A stem conv with BatchNorm, one residual block with BatchNorm and a strided projection shortcut,
    global average pooling, Dropout, a linear head: every kind of module the adapter treats specially."""

    def __init__(self, channels: int = 1, n_classes: int = 10, width: int = 4, p: float = 0.25) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(channels, width, 3, padding=1, bias=False), nn.BatchNorm2d(width),
                                  nn.ReLU())
        self.conv1 = nn.Conv2d(width, 2 * width, 3, stride=2, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(2 * width)
        self.conv2 = nn.Conv2d(2 * width, 2 * width, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(2 * width)
        self.short = nn.Sequential(nn.Conv2d(width, 2 * width, 1, stride=2, bias=False), nn.BatchNorm2d(2 * width))
        self.drop = nn.Dropout(p)
        self.head = nn.Linear(2 * width, n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        y = torch.relu(self.bn1(self.conv1(x)))
        y = torch.relu(self.bn2(self.conv2(y)) + self.short(x))
        return self.head(self.drop(y.mean(dim=(2, 3))))


def tiny_resnet(in_shape: tuple[int, ...], n_classes: int) -> nn.Module:
    return TinyResNet(in_shape[0], n_classes)


def tiny_mlp(in_shape: tuple[int, ...], n_classes: int) -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(in_shape), 32), nn.ReLU(), nn.Linear(32, n_classes))


class TiedTokens(nn.Module):
    """Token ids -> embedding -> Linear -> logits at every position through the embedding's own weights
    (tied), with a parameter used only sometimes."""

    def __init__(self, vocab: int = 11, dim: int = 6) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.mix = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight
        self.spare = nn.Linear(dim, dim)  # never used in forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mix(self.embed(x.long()))))


class FunctionalDropout(nn.Module):
    """Draws from torch's generator in forward: refused under --reproducible."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(nn.functional.dropout(x.flatten(1), 0.5, self.training))


def functional_dropout(in_shape: tuple[int, ...], n_classes: int) -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(in_shape), 4), FunctionalDropout(), nn.Linear(3, n_classes))

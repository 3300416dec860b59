"""Tiny PyTorch models for the torch tests: model factories (``--model torch_factories:NAME`` with tests/ on
PYTHONPATH), modules the in-process tests build, and a gloo process group for DDP side by side."""

from __future__ import annotations

import math
import os
import socket
from typing import Any

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


def batchnorm_1d(in_shape: tuple[int, ...], n_classes: int) -> nn.Module:
    """BatchNorm1d over features: torch refuses to train it on one sample (no variance)."""
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(in_shape), 8), nn.BatchNorm1d(8), nn.ReLU(),
                         nn.Linear(8, n_classes))


class Pair(nn.Module):
    """Returns (scores, scores): not one tensor."""

    def __init__(self, in_shape: tuple[int, ...], n_classes: int) -> None:
        super().__init__()
        self.body = tiny_mlp(in_shape, n_classes)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.body(x)
        return y, y


class Total(Pair):
    """Returns one number for the whole batch: not a row per sample."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return self.body(x).sum()


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


def tiny_gpt(in_shape: tuple[int, ...], n_classes: int) -> nn.Module:
    """examples/torch_models.py's decoder over image rows, one layer of 16 dimensions."""
    from examples.torch_models import GPT, Rows  # noqa: PLC0415 - the repository root on PYTHONPATH

    t, w = in_shape[-2], in_shape[-1] * (in_shape[0] if len(in_shape) == 3 else 1)
    return nn.Sequential(Rows(), GPT(t, w, n_classes, dim=16, layers=1, heads=2))


def tiny_lstm(in_shape: tuple[int, ...], n_classes: int) -> nn.Module:
    """examples/torch_models.py's recurrent model (an LSTM of two layers, a bidirectional GRU), 8 wide."""
    from examples.torch_models import Recurrent  # noqa: PLC0415 - the repository root on PYTHONPATH

    return Recurrent(in_shape[-1] * (in_shape[0] if len(in_shape) == 3 else 1), n_classes, hidden=8)


def gloo(comm: Any) -> None:
    """One gloo process group over comm's ranks for the whole process (a free port chosen by rank 0). It is
    never destroyed: destroy_process_group can deadlock on a gloo thread that needs the GIL at teardown."""
    import torch.distributed as dist  # noqa: PLC0415

    if dist.is_initialized():
        return
    port = None
    if comm.Get_rank() == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(comm.bcast(port, root=0))
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # one host: the loopback, whatever the host name resolves to
    dist.init_process_group("gloo", rank=comm.Get_rank(), world_size=comm.Get_size())

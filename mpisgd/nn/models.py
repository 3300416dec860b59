"""The models the CLI offers. Built on the host; ``materialize`` puts them on a device."""

from __future__ import annotations

from mpisgd.nn.layers import Conv2d, Flatten, Linear, MaxPool2d, Permute, ReLU
from mpisgd.nn.sequential import Sequential


def mlp(hidden: tuple[int, ...] = (1024, 1024), n_in: int = 784, n_classes: int = 10) -> Sequential:
    """Flatten, then (Linear, ReLU) per hidden width, then a Linear classifier."""
    layers: list = [Flatten()]
    width = n_in
    for h in hidden:
        # ReLU may overwrite the Linear's own output buffer: it is not needed afterwards
        layers += [Linear(width, h), ReLU(inplace=True)]
        width = h
    layers.append(Linear(width, n_classes))
    return Sequential(*layers)


def cnn(n_classes: int = 10, in_channels: int = 1) -> Sequential:
    """LeNet-5 for 28x28 inputs: conv(6,5x5,pad 2)-pool-conv(16,5x5)-pool-120-84-classes, ReLU.

    The convolutional part runs batch last (CHWN, see Conv2d): one permutation of the NCHW input at the
    start, one back before Flatten, so the features reach the first Linear in NCHW's (c, h, w) order.
    Each max-pool comes before its ReLU: the two commute (both are monotone), so this is the same
    function and gradient as conv-ReLU-pool, with the ReLU on a quarter of the elements.
    """
    return Sequential(
        Permute((1, 2, 3, 0)),  # NCHW -> CHWN
        Conv2d(in_channels, 6, 5, padding=2), MaxPool2d(2), ReLU(inplace=True),
        Conv2d(6, 16, 5), MaxPool2d(2), ReLU(inplace=True),
        Permute((3, 0, 1, 2)),  # CHWN -> NCHW
        Flatten(),
        Linear(16 * 5 * 5, 120), ReLU(inplace=True),
        Linear(120, 84), ReLU(inplace=True),
        Linear(84, n_classes),
    )


def build_model(name: str, hidden: tuple[int, ...] = (1024, 1024)) -> Sequential:
    if name == "mlp":
        return mlp(hidden)
    if name == "cnn":
        return cnn()
    raise ValueError(f"unknown model {name!r}: use mlp or cnn")

"""A narrow ResNet-8 for the tests: residual blocks (one with a projection shortcut), BatchNorm, and
Dropout before the classifier (``--model residual_factory:f``, with tests/ on the path)."""

from __future__ import annotations

from mpisgd.nn import Sequential, resnet


def f(input_shape: tuple[int, ...], n_classes: int, dropout: float = 0.3) -> Sequential:
    return resnet(input_shape, n_classes, depth=8, widths=(4, 4, 8), dropout=dropout)


def no_dropout(input_shape: tuple[int, ...], n_classes: int) -> Sequential:
    return f(input_shape, n_classes, dropout=0.0)

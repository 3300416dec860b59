"""ResNet for small images (He et al. 2016, section 4.2, the CIFAR-10 networks): ``--model resnet``.

A 3 x 3 convolution to 16 channels, then three stages of n basic blocks at 16, 32 and 64 channels (the
first block of stages 2 and 3 halves the image with a stride-2 convolution), global average pooling and
a Linear classifier: 6n + 2 layers with weights (ResNet-20: n = 3, 0.27 M parameters). A basic block is
conv 3x3 - BN - ReLU - conv 3x3 - BN, added to its input, then ReLU; where a block changes the size,
its shortcut is a 1 x 1 stride-2 convolution with BN (the paper's option B projection). Convolutions
before a BatchNorm have no bias (BN's beta is the shift).
"""

from __future__ import annotations

from mpisgd.nn.containers import Residual, Sequential
from mpisgd.nn.dropout import Dropout
from mpisgd.nn.layers import Conv2d, Linear, ReLU, image_shape
from mpisgd.nn.module import Module
from mpisgd.nn.normalization import BatchNorm2d
from mpisgd.nn.pooling import GlobalAvgPool2d

WIDTHS = (16, 32, 64)  # the paper's channels per stage


def basic_block(c_in: int, c_out: int, stride: int = 1) -> Sequential:
    """Residual(conv-BN-ReLU-conv-BN, shortcut), then ReLU; the shortcut a 1 x 1 convolution with BN where
    the block changes the channels or the size, else the identity."""
    main = Sequential(Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False), BatchNorm2d(c_out),
                      ReLU(inplace=True),  # BN's output is its own: ReLU may overwrite it
                      Conv2d(c_out, c_out, 3, padding=1, bias=False), BatchNorm2d(c_out))
    shortcut = None if stride == 1 and c_in == c_out else \
        Sequential(Conv2d(c_in, c_out, 1, stride=stride, bias=False), BatchNorm2d(c_out))
    return Sequential(Residual(main, shortcut), ReLU(inplace=True))


def resnet(in_shape: tuple[int, ...] = (1, 28, 28), n_classes: int = 10, depth: int = 20,
           widths: tuple[int, int, int] = WIDTHS, dropout: float = 0.0) -> Sequential:
    """ResNet-``depth`` (depth = 6n + 2: 20, 32, 44, 56, 110) for C x H x W images; ``dropout`` > 0 puts a
    Dropout between the pooling and the classifier."""
    c = image_shape("resnet", in_shape)[0]
    if depth < 8 or (depth - 2) % 6:
        raise ValueError(f"resnet: depth must be 6n + 2 with n >= 1 (8, 14, 20, 32, ...), got {depth}")
    n = (depth - 2) // 6
    layers: list[Module] = [Conv2d(c, widths[0], 3, padding=1, bias=False), BatchNorm2d(widths[0]), ReLU(inplace=True)]
    width = widths[0]
    for stage, out in enumerate(widths):
        for block in range(n):
            layers.append(basic_block(width, out, stride=2 if stage > 0 and block == 0 else 1))
            width = out
    layers.append(GlobalAvgPool2d())
    if dropout:
        layers.append(Dropout(dropout))
    layers.append(Linear(width, n_classes))
    return Sequential(*layers)

"""A model of your own for the command line:

    mpiexec -n 2 python -m mpisgd.train --model examples.model_factory:small_convnet --data my_data.npz

``--model package.module:function`` imports the module (from the working directory or PYTHONPATH) and
calls the function with one sample's shape and the number of classes; it returns an mpisgd.nn.Module
(here a Sequential) whose output is one score per class. mpisgd checks that before training.
"""

from __future__ import annotations

from mpisgd.nn import BatchNorm2d, Conv2d, Flatten, Linear, MaxPool2d, ReLU, Sequential


def small_convnet(input_shape: tuple[int, ...], n_classes: int) -> Sequential:
    """Two 3x3 convolutions with 16 and 32 channels (size kept by padding), the first with BatchNorm, each
    halved by max-pooling, then a linear classifier: for C x H x W images with H and W from 4.

    The image layers take the batches as they come, N x C x H x W; they run batch last inside, with one
    transpose before the first convolution and one before Flatten (docs/modules.md)."""
    c, h, w = input_shape
    return Sequential(
        Conv2d(c, 16, 3, padding=1, bias=False), BatchNorm2d(16), ReLU(inplace=True), MaxPool2d(2),
        Conv2d(16, 32, 3, padding=1), ReLU(inplace=True), MaxPool2d(2),
        Flatten(),
        Linear(32 * (h // 4) * (w // 4), n_classes),
    )

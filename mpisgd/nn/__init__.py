"""Model replicas: layers, the loss, Sequential, and the stock models."""

from mpisgd.nn.layers import Conv2d, Flatten, Layer, Linear, MaxPool2d, Permute, ReLU
from mpisgd.nn.loss import SoftmaxCrossEntropy, accuracy_count
from mpisgd.nn.models import build_model, cnn, mlp
from mpisgd.nn.sequential import Sequential

__all__ = ["Conv2d", "Flatten", "Layer", "Linear", "MaxPool2d", "Permute", "ReLU", "Sequential",
           "SoftmaxCrossEntropy", "accuracy_count", "build_model", "cnn", "mlp"]

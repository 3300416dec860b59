"""Model replicas: modules that nest, layers, containers, the loss, and the stock models.

``module.materialize(xp, dtype, seed)`` turns a tree of modules into a :class:`Model`, whose
parameters, gradients and buffers are views of flat buffers (docs/modules.md: writing your own).
"""

from mpisgd.nn import scoring
from mpisgd.nn.attention import CausalSelfAttention
from mpisgd.nn.containers import Residual, Sequential
from mpisgd.nn.dropout import Dropout
from mpisgd.nn.embedding import Embedding, PositionEmbedding
from mpisgd.nn.gelu import GELU
from mpisgd.nn.gpt import GPTShape, gpt
from mpisgd.nn.layernorm import LayerNorm
from mpisgd.nn.layers import Conv2d, Flatten, Linear, MaxPool2d, Permute, ReLU
from mpisgd.nn.layout import SpatialModule
from mpisgd.nn.loss import SoftmaxCrossEntropy, TokenCrossEntropy, accuracy_count
from mpisgd.nn.models import build_model, cnn, mlp
from mpisgd.nn.module import Context, Layer, Model, Module
from mpisgd.nn.normalization import BatchNorm1d, BatchNorm2d, SyncBatchNorm
from mpisgd.nn.pooling import AvgPool2d, GlobalAvgPool2d
from mpisgd.nn.resnet import basic_block, resnet

__all__ = ["AvgPool2d", "BatchNorm1d", "BatchNorm2d", "CausalSelfAttention", "Context", "Conv2d", "Dropout",
           "Embedding", "Flatten", "GELU", "GPTShape", "GlobalAvgPool2d", "Layer", "LayerNorm", "Linear", "MaxPool2d",
           "Model", "Module", "Permute", "PositionEmbedding", "ReLU", "Residual", "Sequential", "SoftmaxCrossEntropy",
           "SpatialModule", "SyncBatchNorm", "TokenCrossEntropy", "accuracy_count", "basic_block", "build_model",
           "cnn", "gpt", "mlp", "resnet", "scoring"]

"""The local update rules, on flat buffers: SGD, LARS, AdamW and LAMB behind one protocol (``Optimizer``).

Optimizers never communicate: a rule that needs whole-tensor norms asks the :class:`TensorNorms` it is
given (in the sharded step, one that adds every rank's pieces).
"""

from mpisgd.optim.adam import LAMB, AdamW
from mpisgd.optim.base import Optimizer, Shards, StateLayout, clip_grad_norm_, grad_norm, load_buffers
from mpisgd.optim.lars import LARS
from mpisgd.optim.norms import BlockNorms, Norms, TensorNorms
from mpisgd.optim.sgd import SGD

__all__ = ["LAMB", "LARS", "SGD", "AdamW", "BlockNorms", "Norms", "Optimizer", "Shards", "StateLayout", "TensorNorms",
           "clip_grad_norm_", "grad_norm", "load_buffers"]

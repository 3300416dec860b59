"""mpisgd: synchronous data-parallel SGD over MPI, on NumPy or CuPy.

Library use, Horovod-style::

    from mpi4py import MPI
    import mpisgd
    with mpisgd.guard(MPI.COMM_WORLD):                      # an error on one rank ends the whole job
        ctx = mpisgd.init(MPI.COMM_WORLD, device="auto")    # node layout, GPU binding
        model = mpisgd.nn.mlp((256,)).materialize(ctx.xp, "float32", seed=0)
        opt = mpisgd.SGD(model.flat, momentum=0.9)
        dp = mpisgd.DataParallel(model, opt, ctx.comm)       # checks shapes, broadcasts rank 0's weights
        loss = dp.train_step([(x, y)], lr=0.1)               # this rank's loss; gradients averaged, same step
"""

__version__ = "0.1.0"

import importlib
from typing import Any

# Lazy attributes (PEP 562): `import mpisgd.config` or `python -m mpisgd.plot` must not start MPI,
# which importing mpi4py.MPI (through context/parallel) does.
_LAZY = {
    "nn": ("mpisgd.nn", None), "Context": ("mpisgd.context", "Context"), "init": ("mpisgd.context", "init"),
    "SGD": ("mpisgd.optim", "SGD"), "LARS": ("mpisgd.optim", "LARS"), "AdamW": ("mpisgd.optim", "AdamW"),
    "LAMB": ("mpisgd.optim", "LAMB"),
    "DataParallel": ("mpisgd.parallel", "DataParallel"),
    "NonFiniteError": ("mpisgd.parallel", "NonFiniteError"), "ReplicaError": ("mpisgd.parallel", "ReplicaError"),
    "Schedule": ("mpisgd.schedule", "Schedule"), "effective_batch": ("mpisgd.schedule", "effective_batch"),
    "scaled_lr": ("mpisgd.schedule", "scaled_lr"), "guard": ("mpisgd.abort", "guard"),
    "create_reducer": ("mpisgd.comm", "create_reducer"), "broadcast_": ("mpisgd.parallel", "broadcast_"),
    "GradientAverager": ("mpisgd.parallel", "GradientAverager"), "load_model": ("mpisgd.model_file", "load_model"),
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'mpisgd' has no attribute {name!r}")
    module, attr = _LAZY[name]
    value = importlib.import_module(module)
    return value if attr is None else getattr(value, attr)


__all__ = ["LAMB", "LARS", "SGD", "AdamW", "Context", "DataParallel", "GradientAverager", "NonFiniteError",
           "ReplicaError", "Schedule", "__version__", "broadcast_", "create_reducer", "effective_batch", "guard",
           "init", "load_model", "nn", "scaled_lr"]

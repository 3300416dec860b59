"""mpisgd: synchronous data-parallel SGD over MPI, on NumPy or CuPy.

Library use, Horovod-style::

    from mpi4py import MPI
    import mpisgd
    ctx = mpisgd.init(MPI.COMM_WORLD, device="auto")      # node layout, GPU binding
    model = mpisgd.nn.mlp((256,)).materialize(ctx.xp, "float32", seed=0)
    opt = mpisgd.SGD(model.flat, momentum=0.9)
    dp = mpisgd.DataParallel(model, opt, ctx.comm)         # checks shapes, broadcasts rank 0's weights
    loss = dp.train_step([(x, y)], lr=0.1)                 # grads averaged over ranks, then the step
"""

__version__ = "0.1.0"

from mpisgd import nn  # noqa: E402
from mpisgd.context import Context, init  # noqa: E402
from mpisgd.optim import SGD  # noqa: E402
from mpisgd.parallel import DataParallel, NonFiniteError, ReplicaError  # noqa: E402
from mpisgd.schedule import Schedule, effective_batch, scaled_lr  # noqa: E402

__all__ = ["SGD", "Context", "DataParallel", "NonFiniteError", "ReplicaError", "Schedule", "__version__",
           "effective_batch", "init", "nn", "scaled_lr"]

"""Data parallelism: start identical, produce the averaged gradient, overlap it with backward, step.

``DataParallel`` coordinates a model replica, an update rule and a reducer; the update is one of two
strategies (``ReplicatedStep``, ``ShardedStep``). ``broadcast_`` and ``GradientAverager`` do the same
for arrays that mpisgd.nn did not make.
"""

from mpisgd.agreement import ReplicaError
from mpisgd.parallel.data_parallel import DataParallel, NonFiniteError
from mpisgd.parallel.sync import GradientAverager, broadcast_

__all__ = ["DataParallel", "GradientAverager", "NonFiniteError", "ReplicaError", "broadcast_"]

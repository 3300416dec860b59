"""The seams of data parallelism, as typed protocols: what DataParallel needs of the objects it drives.

- :class:`ReplicaModel`: the model replica (mpisgd.nn's models; a model written elsewhere through an
  adapter), its loss (:class:`Loss`);
- :class:`Update`: the update, one of two strategies (``ReplicatedStep``, ``ShardedStep``): where the
  reduced gradient lands, whether it is finite, the optimizer's step, the optimizer state's layout;
- :class:`Gradients`: producing the averaged gradient, one of two strategies (``FloatGradients``,
  ``ExactGradients``): forward and backward over the micro-batches, the buckets' reductions, the
  verdict on the result, the mean of the models' statistics;
- :class:`Watchdog` and :class:`Timeline`: what every wait reports to, what every phase is recorded in
  (null ones by default).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

from mpisgd.comm.base import Handle
from mpisgd.flatbuf import FlatBuffer
from mpisgd.optim.base import Optimizer, Shards
from mpisgd.optim.norms import Norms

Array = Any  # numpy.ndarray or cupy.ndarray
LeafDone = Callable[[int], None]  # backward's report: the leaf module with this index has its gradients final


class Watchdog(Protocol):
    """The stall watchdog (mpisgd.watchdog): every blocking collective runs inside ``watching``."""

    def watching(self, what: str) -> AbstractContextManager[None]: ...

    def close(self) -> None: ...


class Timeline(Protocol):
    """Where the phases of a step are recorded (mpisgd.timeline; a null one records nothing)."""

    def begin(self, name: str, cat: str = "compute") -> None: ...

    def end(self, name: str, cat: str = "compute") -> None: ...

    def span(self, name: str, cat: str = "compute") -> AbstractContextManager[None]: ...

    def instant(self, name: str) -> None: ...


class Loss(Protocol):
    """A loss as DataParallel uses it (mpisgd.nn.SoftmaxCrossEntropy)."""

    def forward_array(self, logits: Array, labels: Array) -> Array:
        """The mean loss of a micro-batch as a 0-d array."""
        ...

    def backward(self, scale: float | None = None) -> Array:
        """d(sum of the per-target losses)/d(logits) times ``scale``."""
        ...

    def count(self, labels: Array) -> int:
        """How many targets a micro-batch scores: ``labels.size`` (one label per sample, or per token),
        less any the loss ignores. The loss scale is 1 / (k * the step's count over this rank)."""
        ...


class BasicModel(Protocol):
    """What a model replica offered before modules nested: parameters in one flat buffer, forward,
    backward reporting each leaf module's gradients final, accumulation."""

    @property
    def flat(self) -> FlatBuffer | None: ...

    def forward(self, x: Array) -> Array: ...

    def backward(self, dy: Array, on_layer_done: LeafDone | None = None) -> None: ...

    def set_accumulate(self, on: bool) -> None: ...

    def move_grads(self, buf: Array) -> None: ...

    def layer_param_ranges(self) -> list[tuple[int, int]]: ...


@runtime_checkable
class ReplicaModel(BasicModel, Protocol):
    """The model contract of DataParallel (mpisgd.nn's models nest; docs/api.md):

    - ``flat``: the parameters and gradients, one FlatBuffer (``materialize()`` first);
    - ``forward(x)``; ``backward(dy, on_layer_done)`` calls ``on_layer_done(i)`` once per leaf module
      *with parameters*, when its gradients are final, in any order (a residual block's shortcut may
      finish after its main branch): a bucket starts once every leaf in it has reported;
    - ``set_accumulate(on)``: backward adds into the gradients instead of writing them;
      ``move_grads(buf)``: keep the gradients in ``buf`` (node-shared memory) from now on;
    - ``layer_param_ranges()``: per leaf module in flat order, its ``(start, stop)`` element range, or
      ``(-1, -1)`` for a leaf without parameters;
    - ``train(mode=True)`` / ``eval()``: the mode reaches every nested module (train_step trains);
    - ``state``: a flat array (the model's dtype) of state that is not trained (BatchNorm's running
      statistics), or None: broadcast from rank 0 with the parameters, compared by ``check_replicas``;
    - ``stat_size``, ``begin_batch(step, sample_ids, stat_row)``, ``apply_stats(mean_row)``: before each
      micro-batch's forward the model learns the step, the micro-batch's global sample indices (Dropout
      keys its masks by them) and a float64 row of ``stat_size`` elements it fills during that forward;
      once the gradients are reduced, every rank gets the mean of the rows of every micro-batch of the
      global batch, identical bits on every rank (k-invariant in the reproducible mode).
    """

    @property
    def state(self) -> Array | None: ...

    @property
    def stat_size(self) -> int: ...

    def train(self, mode: bool = True) -> object: ...

    def eval(self) -> object: ...

    def begin_batch(self, step: int, sample_ids: Array, stat_row: np.ndarray) -> None: ...

    def apply_stats(self, mean_row: np.ndarray) -> None: ...


@dataclass
class Produced:
    """What producing a step's gradient gave, besides the reduced gradient itself."""

    loss_sum: Array  # the micro-batches' mean losses, summed (0-d array)
    small_sq: float | None = None  # noise statistics: a small batch's |g|^2 in the buffer's units (None: none)
    b_small: int = 0  # the targets behind that small batch


@dataclass
class Verdict:
    """Whether the averaged gradient is finite (every rank alike) and, when asked, its squared norm."""

    finite: bool
    sq_norm: float = float("nan")  # |G|^2 of the averaged gradient, true units (nan: not measured)


class Update(Protocol):
    """The update of one step on the reduced gradient: ReplicatedStep or ShardedStep."""

    what: str  # its reduction, for the watchdog: "all-reduce" or "reduce-scatter"

    @property
    def shards(self) -> Shards:
        """This rank's pieces of the averaged gradient: (lo, hi, g)."""
        ...

    def start(self, index: int, buf: Array) -> Handle:
        """Begin reducing bucket ``index`` (the slice ``buf`` of the reduced buffer)."""
        ...

    def landed(self, reduced: Array) -> list[tuple[int, int, Array, Array]]:
        """Where the reduction of ``reduced`` left this rank's sums, as (lo, hi, sums, gradient piece)."""
        ...

    def finite(self, watchdog: Watchdog, step: int) -> tuple[bool, float]:
        """Whether the averaged gradient is finite, and |G|^2 (collective when sharded)."""
        ...

    def sq_norm(self, watchdog: Watchdog, step: int) -> float:
        """|G|^2 of the averaged gradient (collective when sharded)."""
        ...

    def norms(self, watchdog: Watchdog, step: int) -> Norms:
        """Whole-tensor norms of the averaged gradient, for clipping and the update rules that need them."""
        ...

    def apply(self, optimizer: Optimizer, lr: float, watchdog: Watchdog, step: int) -> None:
        """The optimizer's step on this rank's pieces."""
        ...

    def after_step(self, watchdog: Watchdog, timeline: Timeline, step: int) -> float:
        """What every rank needs after the update (sharded: the parameters' all-gather); its seconds."""
        ...

    def own_state(self, optimizer: Optimizer) -> None:
        """Make ``optimizer`` keep the state this rank updates (sharded: its chunks only)."""
        ...

    def broadcast_state(self, optimizer: Optimizer, root: int) -> None:
        """Every rank takes ``root``'s optimizer state buffers where every rank holds them whole."""
        ...

    def gather_state(self, optimizer: Optimizer, watchdog: Watchdog, root: int) -> dict[str, np.ndarray]:
        """The whole optimizer state buffers on ``root`` (collective; {} elsewhere when sharded)."""
        ...

    def scatter_state(self, optimizer: Optimizer, buffers: Mapping[str, Array] | None, watchdog: Watchdog,
                      root: int) -> None:
        """``root``'s whole buffers into every rank's optimizer state (collective)."""
        ...

    def nbytes(self) -> int:
        """Bytes of the strategy's own buffers."""
        ...


MicroPass = Callable[[int, LeafDone | None], Array]  # forward and backward of micro-batch i: its mean loss


class Gradients(Protocol):
    """How a step's averaged gradient is produced: FloatGradients or ExactGradients, each made over the
    step's Update (which it reduces through) and the BucketSchedule (which it binds to its buffer)."""

    reduced: Array  # the buffer the buckets reduce: the gradients themselves, or their int64 integers

    def produce(self, run: MicroPass, counts: Sequence[int], step: int, measure: bool) -> Produced:
        """Forward and backward over step ``step``'s micro-batches (``run(i, hook)``; ``counts``: each
        one's targets) and the reduction; with ``measure``, a small batch's |g|^2."""
        ...

    def verdict(self, step: int, measure: bool) -> Verdict:
        """Whether the averaged gradient is finite (and, with ``measure``, |G|^2): every rank alike."""
        ...

    def mean_stats(self, rows: np.ndarray) -> np.ndarray:
        """The mean over every rank's micro-batches of the models' statistics rows: the same bits on every
        rank (collective)."""
        ...

    @property
    def exponents(self) -> np.ndarray | None:
        """The fixed-point exponents the next step uses (None: float sums, or no step yet)."""
        ...

    def restore(self, exponents: Sequence[int] | np.ndarray | None) -> None:
        """Continue with a checkpoint's exponents."""
        ...

    def describe(self) -> str:
        """What is summed, for the banner ("" for float sums)."""
        ...

    def nbytes(self) -> int:
        """Bytes of its buffers beyond the gradients."""
        ...

    def close(self) -> None:
        """Give the model private gradients back where they lived in the reducer's memory."""
        ...

"""Modules that nest, and the model they make once materialised in flat buffers.

A :class:`Module` is a piece of a model with an explicit ``forward`` and ``backward``. It *registers*
what it owns — parameters (``param_shapes``), non-trained state such as BatchNorm's running statistics
(``buffer_shapes``), per-micro-batch statistics that data parallelism averages over the global batch
(``stat_size``) — and its children (:meth:`Module.add`); nothing is discovered by inspecting
attributes. Containers (mpisgd.nn.containers: ``Sequential``, ``Residual``) are modules whose
forward and backward call their children's.

``module.materialize(xp, dtype, seed)`` makes a :class:`Model`: every parameter, gradient and buffer
of the tree becomes a view of one flat buffer each, in a fixed order — pre-order (a module's own
tensors, then its children's, in the order they were added) — and every module of the tree shares
one :class:`Context`, so flags such as train/eval and gradient accumulation reach every nested
module at once. The model is what data parallelism drives (mpisgd.parallel): it reports each
module's parameters final during backward (``on_layer_done``), so buckets can start reducing
while earlier layers still compute.

Writing your own module: docs/modules.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from mpisgd.backend import xp_of
from mpisgd.flatbuf import FlatBuffer
from mpisgd.kernels import FAST, Kernels

Array = Any  # numpy.ndarray or cupy.ndarray
Shapes = list[tuple[str, tuple[int, ...]]]


@dataclass
class Context:
    """What every module of one model shares: the mode, the flags, and the current micro-batch."""

    training: bool = True  # train mode: batch statistics, dropout on; eval mode: running statistics, dropout off
    accumulate: bool = False  # backward adds into the gradients instead of overwriting them
    on_layer_done: Callable[[int], None] | None = None  # called with a module's index when its gradients are final
    seed: int = 0  # the model's seed: random modules (Dropout) key their draws by it
    step: int = 0  # the optimizer step the current micro-batch belongs to
    sample_ids: Any = None  # int64 global index of each sample of the current micro-batch (None: unknown)
    stat_row: Any = None  # float64 row where modules write the current micro-batch's statistics (None: apply now)
    kernels: Kernels = FAST  # what matmul, sums and exp/log compute with: fast or portable (mpisgd.kernels)
    comm: Any = None  # the ranks' communicator, for modules that reduce across them (SyncBatchNorm); None: one process


class Module:
    """Base class of every layer and container. Subclasses set, per instance or per class:

    - ``param_shapes``: ``[(name, shape), ...]``, the parameters it owns (bound as ``self.params[name]``,
      their gradients as ``self.grads[name]``), initialised by :meth:`init_params`;
    - ``buffer_shapes``: non-trained state it owns (``self.buffers[name]``), initialised by
      :meth:`init_buffers`, broadcast, checkpointed and saved with the parameters;
    - ``stat_size``: floats of per-micro-batch statistics it writes in train mode at
      ``self.ctx.stat_row[self.stat_offset:]`` and reads back, averaged over every micro-batch of the
      global batch, in :meth:`apply_stats`.

    ``forward(x)`` returns the output (valid until the module's next call: buffers are reused);
    ``backward(dy, need_dx)`` writes the gradients of its own parameters (:meth:`_grad_out`,
    :meth:`_grad_done` honour accumulation) and returns dx, or None when ``need_dx`` is false. It may
    overwrite ``dy``. A container calls a child's backward through :meth:`backward_child`, which reports
    the child's parameters final.
    """

    param_shapes: Shapes = []
    buffer_shapes: Shapes = []
    stat_size: int = 0
    # Computes every matrix product, sum along an axis and transcendental function through ctx.kernels
    # (or needs none): its bits at --reproducible portable are the same on any machine. Modules that do not
    # say so are refused at that level (mpisgd.kernels says what a layer must route).
    portable: bool = False

    def __init__(self) -> None:
        self.params: dict[str, Array] = {}
        self.grads: dict[str, Array] = {}
        self.buffers: dict[str, Array] = {}
        self.ctx = Context()  # replaced by the model's shared one at materialize()
        self.index = -1  # this module's position in the model's pre-order (materialize())
        self.stat_offset = 0  # where its statistics start in the stat row (materialize())
        self._children: list[tuple[str, Module]] = []
        self._bufs: dict[tuple[str, tuple[int, ...]], Array] = {}

    # -- the tree --------------------------------------------------------------------------
    def add(self, name: str, module: Module) -> Module:
        """Register ``module`` as the child ``name`` (in order: the order of the flat buffers)."""
        if not isinstance(module, Module):
            raise TypeError(f"{type(self).__name__}.add({name!r}, ...) needs an mpisgd.nn.Module, got "
                            f"{type(module).__name__}")
        if any(n == name for n, _ in self._children):
            raise ValueError(f"{type(self).__name__} already has a child named {name!r}")
        self._children.append((name, module))
        return module

    def children(self) -> list[tuple[str, Module]]:
        return list(self._children)

    def named_modules(self, prefix: str = "") -> Iterator[tuple[str, Module]]:
        """This module and every descendant, pre-order, with their dotted paths ("" for this one)."""
        yield prefix, self
        for name, child in self._children:
            yield from child.named_modules(f"{prefix}.{name}" if prefix else name)

    # -- flags (shared by the whole model once materialised) ----------------------------------------
    @property
    def training(self) -> bool:
        return self.ctx.training

    @property
    def accumulate(self) -> bool:
        return self.ctx.accumulate

    # -- what a module computes ------------------------------------------------------------
    def init_params(self, rng: np.random.Generator, dtype: np.dtype) -> dict[str, np.ndarray]:
        """Initial values of the parameters it owns, drawn from ``rng`` (on the host)."""
        return {}

    def init_buffers(self, dtype: np.dtype) -> dict[str, np.ndarray]:
        """Initial values of the buffers it owns (zeros where not given)."""
        return {}

    def forward(self, x: Array) -> Array:
        raise NotImplementedError(f"{type(self).__name__}.forward")

    def backward(self, dy: Array, need_dx: bool = True) -> Array | None:
        raise NotImplementedError(f"{type(self).__name__}.backward")

    def apply_stats(self, stats: Array) -> None:
        """Take this module's part of the statistics, averaged over every micro-batch of the step (a
        float64 array of ``stat_size``); the same values on every rank."""

    def backward_child(self, child: Module, dy: Array, need_dx: bool = True) -> Array | None:
        """``child.backward``, then report the child's own parameters final (data parallelism starts
        reducing a bucket once all of its modules have reported)."""
        dx = child.backward(dy, need_dx)
        if child.param_shapes and child.ctx.on_layer_done is not None:
            child.ctx.on_layer_done(child.index)
        return dx

    # -- scratch memory, reused from call to call ---------------------------------------------------
    def _buf(self, name: str, shape: tuple[int, ...], like: Array, dtype: Any = None, zeroed: bool = False) -> Array:
        """The module's buffer ``name`` of this shape, on ``like``'s device, of ``like``'s dtype unless
        ``dtype`` is given; ``zeroed`` fills it with zeros when it is made (not on later calls)."""
        key = (name, shape)
        dtype = like.dtype if dtype is None else np.dtype(dtype)
        buf = self._bufs.get(key)
        if buf is None or buf.dtype != dtype:
            xp = xp_of(like)
            buf = (xp.zeros if zeroed else xp.empty)(shape, dtype=dtype)
            self._bufs[key] = buf
        return buf

    def _grad_out(self, name: str, value_shape: tuple[int, ...], like: Array) -> Array:
        """Where backward writes a gradient: the grad view itself, or scratch to add from."""
        return self._buf("acc_" + name, value_shape, like) if self.accumulate else self.grads[name]

    def _grad_done(self, name: str, out: Array) -> None:
        if self.accumulate:
            self.grads[name] += out

    def scratch_nbytes(self) -> int:
        """Bytes of the activation and scratch buffers this module keeps (not its children's)."""
        return sum(int(buf.nbytes) for buf in self._bufs.values())

    # -- making a model ----------------------------------------------------------------------
    @property
    def flat(self) -> Any:
        """A module has no flat buffers; the model it materialises does (a common slip, said plainly)."""
        raise AttributeError(f"{type(self).__name__} has no flat buffers: materialize() it first "
                             "(model = module.materialize(xp, dtype, seed); then model.flat)")

    def materialize(self, xp: Any, dtype: str | np.dtype = "float32", seed: int = 0) -> Model:
        """The model of this tree: flat buffers on ``xp``, parameters initialised from ``seed`` (drawn on
        the host with NumPy, in pre-order, so CPU and GPU runs with the same seed start alike)."""
        if np.dtype(dtype) not in (np.float32, np.float64):
            raise ValueError(f"materialize: the parameters' dtype is float32 or float64, got {np.dtype(dtype)}")
        return Model(self, xp, np.dtype(dtype), seed)

    def extra_repr(self) -> str:
        """What the repr shows between the parentheses (the constructor's arguments)."""
        return ""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.extra_repr()})"


Layer = Module  # the name of the base class before modules nested


class Model:
    """A module tree materialised: the parameters, their gradients and the buffers as views of one flat
    array each, and one :class:`Context` shared by every module. This is the replica data parallelism
    drives (the ``ReplicaModel`` protocol of mpisgd.parallel)."""

    def __init__(self, root: Module, xp: Any, dtype: np.dtype, seed: int) -> None:
        self.module = root
        self.ctx = Context(seed=seed)
        self._named = list(root.named_modules())
        self._modules = [m for _, m in self._named]
        if len({id(m) for m in self._modules}) != len(self._modules):
            raise ValueError("a module appears twice in the model: shared modules (weight tying) are not supported")
        from mpisgd.nn.layout import plan_layouts  # noqa: PLC0415 - the planner knows the containers and layers

        plan_layouts(root)  # where the batch axis is between modules: image layers run batch last inside
        stat_offset = 0
        for i, m in enumerate(self._modules):
            m.ctx, m.index, m.stat_offset = self.ctx, i, stat_offset
            stat_offset += m.stat_size
        self.stat_size = stat_offset
        self.flat = FlatBuffer([s for m in self._modules for _, s in m.param_shapes], dtype, xp)
        buffer_specs = [s for m in self._modules for _, s in m.buffer_shapes]
        self._buffer_offsets = [0]
        for s in buffer_specs:
            self._buffer_offsets.append(self._buffer_offsets[-1] + int(np.prod(s, dtype=np.int64)))
        self.state: Array | None = xp.zeros(self._buffer_offsets[-1], dtype=dtype) if buffer_specs else None
        self._bind()
        rng = np.random.default_rng(seed)
        for m in self._modules:  # pre-order: for a chain of layers, the order the layers were given
            init = m.init_params(rng, dtype)
            for name, p in m.params.items():
                p[...] = xp.asarray(init[name])
            values = m.init_buffers(dtype)
            for name, b in m.buffers.items():
                b[...] = xp.asarray(values[name]) if name in values else 0

    def _bind(self) -> None:
        """Hand every module its views of the flat buffers."""
        pviews = iter(zip(self.flat.param_views, self.flat.grad_views, strict=True))
        k = 0
        for m in self._modules:
            m.params, m.grads = {}, {}
            for name, _ in m.param_shapes:
                m.params[name], m.grads[name] = next(pviews)
            m.buffers = {}
            for name, shape in m.buffer_shapes:
                assert self.state is not None
                m.buffers[name] = self.state[self._buffer_offsets[k]:self._buffer_offsets[k + 1]].reshape(shape)
                k += 1

    # -- what data parallelism uses ----------------------------------------------------------------
    def forward(self, x: Array) -> Array:
        return self.module.forward(x)

    def backward(self, dy: Array, on_layer_done: Callable[[int], None] | None = None) -> None:
        """Gradients of every parameter from the output gradient ``dy`` (the input's is not needed).
        ``on_layer_done(i)`` is called once for each module ``i`` that owns parameters, when they are
        final: in reverse order along a chain, but a container's branches may report in another order."""
        self.ctx.on_layer_done = on_layer_done
        try:
            self.module.backward_child(self.module, dy, need_dx=False)  # the root is its own parent here
        finally:
            self.ctx.on_layer_done = None

    def layer_param_ranges(self) -> list[tuple[int, int]]:
        """Per module, pre-order, the [start, stop) element range of its own parameters in the flat
        buffer; (-1, -1) for a module that owns none."""
        ranges, k = [], 0
        for m in self._modules:
            n = len(m.param_shapes)
            ranges.append((self.flat.offsets[k], self.flat.offsets[k + n]) if n else (-1, -1))
            k += n
        return ranges

    def move_grads(self, buf: Array) -> None:
        """Keep the gradients in ``buf`` from now on (FlatBuffer.move_grads); the modules follow."""
        self.flat.move_grads(buf)
        self._bind()

    def set_accumulate(self, on: bool) -> None:
        self.ctx.accumulate = on

    @property
    def training(self) -> bool:
        return self.ctx.training

    def train(self, mode: bool = True) -> Model:
        """Train mode (batch statistics, dropout on) or, with ``mode`` false, eval mode; every module."""
        self.ctx.training = mode
        return self

    def eval(self) -> Model:
        return self.train(False)

    def begin_batch(self, step: int = 0, sample_ids: Any = None, stat_row: Array | None = None) -> None:
        """Before a micro-batch's forward: the step it belongs to, its samples' global indices (what
        random modules key their draws by) and the row where modules write its statistics."""
        self.ctx.step, self.ctx.sample_ids, self.ctx.stat_row = step, sample_ids, stat_row

    def apply_stats(self, mean_row: Array) -> None:
        """Every module takes its part of the statistics averaged over the step's micro-batches."""
        for m in self._modules:
            if m.stat_size:
                m.apply_stats(mean_row[m.stat_offset:m.stat_offset + m.stat_size])

    # -- what it holds -------------------------------------------------------------------------
    def modules(self) -> list[Module]:
        """Every module, pre-order (the root first)."""
        return list(self._modules)

    def named_modules(self) -> list[tuple[str, Module]]:
        return list(self._named)

    def named_parameters(self) -> Iterator[tuple[str, Array]]:
        """``("path.Class.name", view)`` for every parameter, in flat order; a chain's layers are
        numbered (``"1.Linear.W"``)."""
        for path, m in self._named:
            for name, _ in m.param_shapes:
                yield _qualified(path, m, name), m.params[name]

    def named_buffers(self) -> Iterator[tuple[str, Array]]:
        for path, m in self._named:
            for name, _ in m.buffer_shapes:
                yield _qualified(path, m, name), m.buffers[name]

    def parameter_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        return parameter_shapes(self.module)

    def buffer_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        return [(_qualified(p, m, n), tuple(s)) for p, m in self._named for n, s in m.buffer_shapes]

    def buffer_nbytes(self) -> int:
        """Bytes of the activation and scratch buffers the modules keep (allocated at the first step)."""
        return sum(m.scratch_nbytes() for m in self._modules)

    def __repr__(self) -> str:
        return repr(self.module)


def parameter_shapes(root: Module) -> list[tuple[str, tuple[int, ...]]]:
    """Every parameter's qualified name and shape, in flat order, before the model is materialised."""
    return [(_qualified(p, m, n), tuple(s)) for p, m in root.named_modules() for n, s in m.param_shapes]


def _qualified(path: str, module: Module, name: str) -> str:
    return f"{path}.{type(module).__name__}.{name}" if path else f"{type(module).__name__}.{name}"

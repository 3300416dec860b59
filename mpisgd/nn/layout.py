"""Where the batch axis is: image layers take (N, C, H, W) and run batch last (C, H, W, N) inside.

Batches arrive as (N, C, H, W), PyTorch's NCHW, and that is what a convolution, a pooling layer or a
BatchNorm2d takes and gives at its boundary. Their kernels run batch last (CHWN: see
mpisgd.nn.layers.Conv2d for why), so a layer on its own transposes its input in and its output back.
Along a chain that would be two copies of every activation per layer; instead, when a model is
materialised, :func:`plan_layouts` finds each **run** of consecutive layers that can all work batch
last — image layers (:class:`SpatialModule`), layers that do not care (``layout_free``: ReLU), and
containers made only of those (a residual block) — and lets the whole run work batch last: its
``Sequential`` transposes once at the run's start and once at its end (hidden steps, not children:
the parameters keep their names). A :class:`SpatialModule` that ends a run by itself
(``GlobalAvgPool2d``: its output is (N, C) in either layout) needs no transpose after it.

Models written for the batch-last layers of before (``Permute((1, 2, 3, 0))`` first, ``Permute((3, 0,
1, 2))`` before ``Flatten``, as LeNet-5 does) keep working with the same bits: the planner follows the
layout through those Permutes and runs the layers between them batch last, with no transpose of its
own.
"""

from __future__ import annotations

from typing import Any

from mpisgd.backend import xp_of
from mpisgd.nn.containers import Residual, Sequential
from mpisgd.nn.module import Array, Module

FIRST, LAST = "batch first", "batch last"
TO_LAST, TO_FIRST = (1, 2, 3, 0), (3, 0, 1, 2)  # NCHW -> CHWN and back


class SpatialModule(Module):
    """An image layer: (N, C, H, W) at its boundary, its kernels on (C, H, W, N) (``forward_bl``,
    ``backward_bl``). ``batch_last`` is set by the plan (:func:`plan_layouts`) when the layer sits in
    a run of batch-last layers; then it takes and gives CHWN and transposes nothing itself.
    ``ends_run``: the output has no spatial axes and is (N, ...) whatever the input layout."""

    ends_run = False

    def __init__(self) -> None:
        super().__init__()
        self.batch_last = False

    def forward_bl(self, x: Array) -> Array:
        raise NotImplementedError(f"{type(self).__name__}.forward_bl")

    def backward_bl(self, dy: Array, need_dx: bool = True) -> Array | None:
        raise NotImplementedError(f"{type(self).__name__}.backward_bl")

    def forward(self, x: Array) -> Array:
        if self.batch_last:
            return self.forward_bl(x)
        if x.ndim != 4:
            raise ValueError(f"{type(self).__name__} takes (N, C, H, W) batches, got shape {tuple(x.shape)}")
        y = self.forward_bl(_transposed(self, x, TO_LAST, "x_to_last"))
        return y if self.ends_run else _transposed(self, y, TO_FIRST, "y_to_first")

    def backward(self, dy: Array, need_dx: bool = True) -> Array | None:
        if self.batch_last:
            return self.backward_bl(dy, need_dx)
        dx = self.backward_bl(dy if self.ends_run else _transposed(self, dy, TO_LAST, "dy_to_last"), need_dx)
        return None if dx is None else _transposed(self, dx, TO_FIRST, "dx_to_first")


def _transposed(module: Module, a: Array, axes: tuple[int, ...], name: str) -> Array:
    """``a.transpose(axes)`` copied into the module's buffer ``name``."""
    out = module._buf(name, tuple(a.shape[i] for i in axes), a)
    xp_of(a).copyto(out, a.transpose(axes))
    return out


# -- the plan -----------------------------------------------------------------------------------------
def plan_layouts(root: Module) -> None:
    """Decide, for the whole tree, where the batch axis is between modules (Model does this when a tree is
    materialised; the plan is made again each time). The root takes batch-first input and gives
    batch-first output."""
    _plan(root, FIRST, FIRST)


def _is(module: Module, cls: type[Module]) -> bool:
    """``module`` is a ``cls`` that computes as ``cls`` does (a subclass that writes its own forward or
    backward may not follow the plan: it is planned as a module the plan does not know)."""
    kind = type(module)
    return isinstance(module, cls) and kind.forward is cls.forward and kind.backward is cls.backward


def runs_batch_last(module: Module) -> bool:
    """Whether ``module`` can take and give (C, H, W, N) arrays: an image layer that keeps the spatial axes,
    a layout-free layer, or a container made only of those."""
    if _is(module, Sequential) or _is(module, Residual):
        return all(runs_batch_last(child) for _, child in module.children())
    if _is(module, SpatialModule):
        return not module.ends_run  # type: ignore[attr-defined]
    return bool(getattr(module, "layout_free", False))


def _has_spatial(module: Module) -> bool:
    return any(_is(m, SpatialModule) and not m.ends_run for _, m in module.named_modules())  # type: ignore[attr-defined]


def _starts_run(layers: list[Module], i: int) -> bool:
    """Whether a batch-last run worth its two transposes starts at ``layers[i]``: the modules from ``i``
    that can run batch last include an image layer."""
    for m in layers[i:]:
        if _is(m, SpatialModule) and m.ends_run:  # type: ignore[attr-defined]
            return False
        if not runs_batch_last(m):
            return False
        if _has_spatial(m):
            return True
    return False


def _plan(module: Module, layout: str, want: str) -> str:
    """Plan ``module`` for input in ``layout``; returns its output's layout. ``want``: the layout its
    parent needs back (a Sequential transposes at its end to give it)."""
    from mpisgd.nn.layers import Permute  # noqa: PLC0415 - layers imports this module

    if _is(module, Sequential):
        return _plan_sequential(module, layout, want)
    if _is(module, Residual):
        for _, branch in module.children():
            _plan(branch, layout, layout)  # both branches give back what they got: their sum is in it
        return layout
    if _is(module, SpatialModule):
        module.batch_last = layout == LAST  # type: ignore[attr-defined]
        return FIRST if module.ends_run else layout  # type: ignore[attr-defined]
    for _, child in module.children():  # a module of its own: presumably it hands its children what it gets
        _plan(child, layout, layout)
    if isinstance(module, Permute):
        if module.axes == TO_LAST and layout == FIRST:
            return LAST
        if module.axes == TO_FIRST and layout == LAST:
            return FIRST
        return FIRST  # any other permutation: the user's own layout, treated as batch first
    return layout  # a module that is not layout-aware gets what comes, as it always did


def _plan_sequential(seq: Any, layout: str, want: str) -> str:
    from mpisgd.nn.layers import Permute  # noqa: PLC0415 - layers imports this module

    layers = seq.layers
    steps: list[Module] = []
    ours = False  # whether the current batch-last layout is the plan's (it then transposes back)
    for i, m in enumerate(layers):
        if layout == FIRST and _starts_run(layers, i):
            steps.append(Permute(TO_LAST))
            layout, ours = LAST, True
        elif layout == LAST and ours and not runs_batch_last(m) and not (_is(m, SpatialModule) and m.ends_run):
            steps.append(Permute(TO_FIRST))
            layout, ours = FIRST, False
        layout = _plan(m, layout, layout)
        if layout == FIRST:
            ours = False
        steps.append(m)
    if ours and layout == LAST and want == FIRST:
        steps.append(Permute(TO_FIRST))
        layout = FIRST
    seq.set_steps(steps)
    return layout

"""Containers: modules made of modules. ``Sequential`` applies its children in order; ``Residual``
adds a branch to a shortcut (the identity, or a projection), the block of ResNets and transformers.

Both call their children's backward through :meth:`Module.backward_child`, so each child reports its
parameters final as soon as they are, and data parallelism can start reducing them.
"""

from __future__ import annotations

from mpisgd.backend import xp_of
from mpisgd.nn.module import Array, Module


def owns_parameters(module: Module) -> bool:
    """Whether ``module`` or any module inside it has parameters."""
    return any(m.param_shapes for _, m in module.named_modules())


class Sequential(Module):
    """Children applied in order; they are named "0", "1", ... (the names parameters carry).

    What runs is the children and, where the model's layout plan put them (mpisgd.nn.layout), the
    transposes into and out of a run of batch-last image layers: hidden steps, not children."""

    portable = True  # through ctx.kernels, or elementwise only

    def __init__(self, *layers: Module) -> None:
        super().__init__()
        for i, layer in enumerate(layers):
            self.add(str(i), layer)
        self._steps: list[Module] | None = None

    @property
    def layers(self) -> list[Module]:
        return [m for _, m in self.children()]

    def set_steps(self, steps: list[Module]) -> None:
        """What forward runs, in order: the children, with the layout plan's transposes among them."""
        assert [m for m in steps if any(m is c for c in self.layers)] == self.layers, "steps must keep the children"
        self._steps = steps

    @property
    def steps(self) -> list[Module]:
        return self.layers if self._steps is None else self._steps

    def forward(self, x: Array) -> Array:
        for layer in self.steps:
            x = layer.forward(x)
        return x

    def scratch_nbytes(self) -> int:
        children = {id(m) for m in self.layers}
        return super().scratch_nbytes() + sum(m.scratch_nbytes() for m in self.steps if id(m) not in children)

    def backward(self, dy: Array, need_dx: bool = True) -> Array | None:
        layers = self.steps
        # where no gradient is wanted back, the layers before the first that owns parameters are skipped
        # (for the MLP, Flatten comes first: this saves a whole GEMM per step)
        first = 0 if need_dx else next((i for i, m in enumerate(layers) if owns_parameters(m)), len(layers))
        for i in range(len(layers) - 1, first - 1, -1):
            dy = self.backward_child(layers[i], dy, need_dx=need_dx or i > first)
        return dy if need_dx else None

    def __repr__(self) -> str:
        return "Sequential(" + ", ".join(map(repr, self.layers)) + ")"


class Residual(Module):
    """y = main(x) + shortcut(x), the shortcut the identity when not given (then main must keep x's
    shape). Neither branch may overwrite its input: both read the same x.

    Backward runs the shortcut's branch first: its parameters come after main's in the flat buffer, so
    the model still reports them final in reverse order.
    """

    portable = True  # through ctx.kernels, or elementwise only

    def __init__(self, main: Module, shortcut: Module | None = None) -> None:
        super().__init__()
        self.main = self.add("main", main)
        self.shortcut = self.add("shortcut", shortcut) if shortcut is not None else None

    def forward(self, x: Array) -> Array:
        y = self.main.forward(x)
        s = x if self.shortcut is None else self.shortcut.forward(x)
        if y.shape != s.shape:
            raise ValueError(f"Residual: the branch gives {tuple(y.shape)}, the shortcut {tuple(s.shape)}: "
                             "give a shortcut (projection) that matches")
        out = self._buf("y", y.shape, y)
        xp_of(y).add(y, s, out=out)
        return out

    def backward(self, dy: Array, need_dx: bool = True) -> Array | None:
        xp = xp_of(dy)
        if self.shortcut is None:
            keep = self._buf("dy", dy.shape, dy)  # the shortcut's gradient is dy itself: main may overwrite dy
            if need_dx:
                keep[...] = dy
            dx = self.backward_child(self.main, dy, need_dx)
            if not need_dx:
                return None
            out = self._buf("dx", keep.shape, dy)
            xp.add(dx, keep, out=out)
            return out
        mine = self._buf("dy", dy.shape, dy)
        mine[...] = dy  # each branch gets a dy it may overwrite
        d_short = self.backward_child(self.shortcut, mine, need_dx)
        d_main = self.backward_child(self.main, dy, need_dx)
        if not need_dx:
            return None
        assert d_main is not None and d_short is not None  # need_dx: both branches return one
        out = self._buf("dx", d_main.shape, dy)
        xp.add(d_main, d_short, out=out)
        return out

    def __repr__(self) -> str:
        return f"Residual({self.main!r}" + (f", shortcut={self.shortcut!r})" if self.shortcut is not None else ")")

"""A PyTorch module as an mpisgd model: its tensors are views of mpisgd's flat buffers, autograd does
the backward.

``TorchModule(module)`` is what ``--model package.module:function`` builds when the function returns a
``torch.nn.Module`` (mpisgd.nn.models); ``materialize(xp, dtype, seed)`` makes the :class:`TorchModel`
that data parallelism drives like any mpisgd model (docs/modules.md, "What the model offers"):

- every trained parameter of the torch module, its gradient and every persistent floating buffer (and
  every parameter that does not require a gradient) become views of ``model.flat.params``,
  ``model.flat.grads`` and ``model.state``, in torch's own order, in the run's dtype (float32 or
  float64). The optimizer, the all-reduce, checkpoints and ``--save-model`` work on those arrays;
  torch computes on the same memory (NumPy: ``torch.from_numpy``; CuPy: DLPack). Integer and boolean
  buffers (masks, position ids) stay torch's: they are taken as constants;
- one mpisgd module per torch module that owns parameters or state (a :class:`TorchPart`), so
  ``layer_param_ranges`` and ``on_layer_done`` work per torch module: a parameter's
  ``register_post_accumulate_grad_hook`` counts it final, and the module is reported once all its
  parameters are (in whatever order autograd finishes them). Parameters autograd never reached (unused in
  this forward) have zero gradients (added nothing, under accumulation) and are reported after it;
- BatchNorm and Dropout are swapped for mpisgd's rules (mpisgd.torch.modules): running statistics
  through the statistics row, dropout masks keyed by sample.

Gradients land in the flat buffer itself: before a step's first micro-batch ``param.grad`` is set to
None, autograd hands each gradient over whole and its hook copies it into the view and makes the view
``param.grad`` again (one pass, where zeroing and adding would take two); later micro-batches find the
view there and autograd adds into it (accumulation needs nothing more). Autograd computes
these gradients, so the start-up float64 gradient check of layers mpisgd did not write does not apply
(``TorchModule.autograd``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from mpisgd.errors import ModelOutputError
from mpisgd.nn.module import Model, Module
from mpisgd.torch.modules import SWAPPED, KeyedDropout, StatBatchNorm, UnsupportedModule, convert
from mpisgd.torch.views import as_array, as_tensor, device_of, same_memory


class UnkeyedRandomness(RuntimeError):
    """A train-mode forward drew from torch's random generator while keyed randomness was required."""


def _host(t: Any, dtype: np.dtype) -> np.ndarray:
    return t.detach().to("cpu", torch.float64).numpy().astype(dtype)


class TorchPart(Module):
    """The parameters and state of one torch module (not its children's), as one mpisgd module: its
    trained parameters (``param_shapes``), its state (``buffer_shapes``: persistent floating buffers and
    parameters that require no gradient) and, for a BatchNorm, its statistics (``stat_size``)."""

    def __init__(self, path: str, module: Any, trained: list[tuple[str, Any]], state: list[tuple[str, Any]]) -> None:
        super().__init__()
        self.path, self.torch_module = path, module
        self.trained, self.held = trained, state  # (name, tensor) in torch's order
        self.param_shapes = [(n, tuple(t.shape)) for n, t in trained]
        self.buffer_shapes = [(n, tuple(t.shape)) for n, t in state]
        self.stat_size = module.stat_size if isinstance(module, StatBatchNorm) else 0
        self.kind = module.kind if isinstance(module, StatBatchNorm) else type(module).__name__  # for the banner

    def init_params(self, rng: np.random.Generator, dtype: np.dtype) -> dict[str, np.ndarray]:
        return {n: _host(t, dtype) for n, t in self.trained}  # the factory's own initialisation

    def init_buffers(self, dtype: np.dtype) -> dict[str, np.ndarray]:
        return {n: _host(t, dtype) for n, t in self.held}

    def apply_stats(self, stats: Any) -> None:
        self.torch_module.apply_stats(stats)

    def extra_repr(self) -> str:
        return f"{self.path or 'root'}: {type(self.torch_module).__name__}({self.torch_module.extra_repr()})"


class TorchModule(Module):
    """A ``torch.nn.Module`` as an mpisgd module tree, before materialisation: one :class:`TorchPart` child
    per torch module that owns parameters or state, in torch's pre-order. Swaps BatchNorm and Dropout
    (mpisgd.torch.modules.convert) in the module it is given."""

    autograd = True  # gradients come from autograd: the float64 check of hand-written layers does not apply

    def __init__(self, module: Any) -> None:
        super().__init__()
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"TorchModule takes a torch.nn.Module, got {type(module).__name__}")
        root = torch.nn.Sequential(module) if type(module) in SWAPPED else module  # convert swaps children
        self.swapped = convert(root)
        self.torch_module = root
        seen: set[int] = set()  # a parameter shared by two modules (tied weights) belongs to the first
        for path, m in root.named_modules():
            trained: list[tuple[str, Any]] = []
            held: list[tuple[str, Any]] = []
            for name, p in m.named_parameters(recurse=False):
                if id(p) in seen:
                    continue
                seen.add(id(p))
                if not p.dtype.is_floating_point:
                    raise UnsupportedModule(f"{path}.{name} is a {p.dtype} parameter: mpisgd trains floating ones")
                (trained if p.requires_grad else held).append((name, p))
            for name, b in m.named_buffers(recurse=False):
                if id(b) in seen or name in m._non_persistent_buffers_set or not b.dtype.is_floating_point:
                    continue  # not state: recomputed (non-persistent) or a constant (integers, masks)
                seen.add(id(b))
                held.append((name, b))
            if trained or held or isinstance(m, StatBatchNorm):
                self.add(path or "root", TorchPart(path, m, trained, held))
        if not any(part.param_shapes for _, part in self.children()):
            raise UnsupportedModule("the model has no parameter that requires a gradient: nothing to train")

    def materialize(self, xp: Any, dtype: str | np.dtype = "float32", seed: int = 0) -> TorchModel:
        return TorchModel(self, xp, np.dtype(dtype), seed)

    def extra_repr(self) -> str:
        return type(self.torch_module).__name__


class TorchModel(Model):
    """A :class:`TorchModule` materialised: mpisgd's model contract (mpisgd.nn.module.Model) over a torch
    module whose parameters, gradients and state are views of the flat buffers (module docstring)."""

    framework = "torch"

    def __init__(self, root: TorchModule, xp: Any, dtype: np.dtype, seed: int) -> None:
        if np.dtype(dtype) not in (np.float32, np.float64):
            raise ValueError(f"a torch model trains in float32 or float64, not {dtype}")
        super().__init__(root, xp, dtype, seed)  # lays out the flat buffers, copies torch's values in
        self.torch_module = root.torch_module
        self.device = device_of(xp)
        self.parts = [m for m in self.modules() if isinstance(m, TorchPart)]
        self.keyed_randomness = False  # set by mpisgd.torch.runtime.prepare under --reproducible
        self._out: Any = None  # the last train-mode forward's output, which backward starts from
        self._left: list[int] | None = None  # per part, parameters whose gradient is not final yet
        self._grads: list[tuple[Any, Any, Any]] = []  # (parameter, its gradient view, as a tensor), flat order
        self.torch_module.to(self.device)  # what is not state (integer buffers, masks) goes there too
        self._bind_torch()
        self._hooks = []
        j = 0
        for i, part in enumerate(self.parts):
            for _ in part.trained:
                self._hooks.append(self._grads[j][0].register_post_accumulate_grad_hook(self._hook(i, j)))
                j += 1
        for m in self.torch_module.modules():
            if isinstance(m, StatBatchNorm):
                part = next(q for q in self.parts if q.torch_module is m)
                m.bind(self.ctx, part.stat_offset)
            elif isinstance(m, KeyedDropout):
                m.bind(self.ctx)
        self.torch_module.train(self.training)

    # -- the views ---------------------------------------------------------------------------
    def _bind_torch(self) -> None:
        """Point every torch tensor of the parts at its view of the flat buffers."""
        self._grads = []
        for part in self.parts:
            m = part.torch_module
            for name, p in part.trained:
                p.data = as_tensor(part.params[name])
                p.grad = as_tensor(part.grads[name])
                self._grads.append((p, part.grads[name], p.grad))
            for name, t in part.held:
                if isinstance(t, torch.nn.Parameter):
                    t.data = as_tensor(part.buffers[name])
                else:
                    m._buffers[name] = as_tensor(part.buffers[name])

    def views_ok(self) -> bool:
        """Whether every torch parameter, gradient and state tensor is a view of the flat buffers (the
        contract this adapter keeps; the tests assert it)."""
        for part in self.parts:
            for name, p in part.trained:
                if not (same_memory(p, part.params[name]) and p.grad is not None
                        and same_memory(p.grad, part.grads[name])):
                    return False
            for name, t in part.held:
                current = t if isinstance(t, torch.nn.Parameter) else part.torch_module._buffers[name]
                if not same_memory(current, part.buffers[name]):
                    return False
        return True

    def move_grads(self, buf: Any) -> None:
        super().move_grads(buf)
        self._grads = []
        for part in self.parts:
            for name, p in part.trained:
                p.grad = as_tensor(part.grads[name])
                self._grads.append((p, part.grads[name], p.grad))

    # -- forward and backward ----------------------------------------------------------------
    def forward(self, x: Any) -> Any:
        """The torch module on ``x`` (a view, no copy); returns its output as an array of the same memory.
        In train mode the graph is kept for :meth:`backward`; in eval mode none is built."""
        xt = as_tensor(x)
        if not self.training:
            with torch.no_grad():
                out = self.torch_module(xt)
            return as_array(self._check(out))
        before = self._rng_state() if self.keyed_randomness else None
        out = self._check(self.torch_module(xt))
        if before is not None and not all(torch.equal(a, b) for a, b in zip(before, self._rng_state(), strict=True)):
            raise UnkeyedRandomness(
                "the model drew from torch's random generator in forward (F.dropout, dropout_p=, a random module): "
                "--reproducible needs every random draw keyed by sample; use nn.Dropout modules (mpisgd keys "
                "their masks), or drop --reproducible")
        self._out = out
        return as_array(out)

    def _rng_state(self) -> list[Any]:
        states = [torch.random.get_rng_state()]
        if self.device.type == "cuda":
            states.append(torch.cuda.get_rng_state(self.device))
        return states

    @staticmethod
    def _check(out: Any) -> Any:
        if not isinstance(out, torch.Tensor):
            raise ModelOutputError(f"the torch module must return one tensor (the scores), got {type(out).__name__}")
        return out

    def backward(self, dy: Any, on_layer_done: Callable[[int], None] | None = None) -> None:
        """Autograd from the last train-mode forward's output with output gradient ``dy``, into the flat
        gradient buffer (overwritten, or added to under accumulation); ``on_layer_done(i)`` once per part
        as its gradients become final, unused parameters' parts last."""
        out, self._out = self._out, None
        if out is None:
            raise RuntimeError("backward needs a forward in train mode before it")
        fresh = not self.ctx.accumulate
        if fresh:  # autograd hands each gradient over whole; the hook copies it into the flat buffer
            for p, _, _ in self._grads:
                p.grad = None
        self.ctx.on_layer_done = on_layer_done
        self._left = [len(part.trained) for part in self.parts]
        try:
            torch.autograd.backward(out, as_tensor(dy).reshape(out.shape))
            for p, view, t in self._grads:  # autograd never reached these: zero (added nothing), final
                if p.grad is None:
                    view[...] = 0
                    p.grad = t
            for i, left in enumerate(self._left):
                if left and self.parts[i].trained:
                    self._report(i)
        finally:
            self._left = None
            self.ctx.on_layer_done = None

    def _hook(self, i: int, j: int) -> Callable[[Any], None]:
        """Parameter j (flat order) of part i has its final gradient."""
        def done(p: Any) -> None:
            if self._left is None:  # a backward that is not ours (the caller's own, on the torch module)
                return
            t = self._grads[j][2]
            if p.grad is not t:  # a new tensor (the first micro-batch's, or double backward's): into ours
                with torch.no_grad():
                    t.copy_(p.grad)
                p.grad = t
            self._left[i] -= 1
            if self._left[i] == 0:
                self._report(i)
        return done

    def _report(self, i: int) -> None:
        assert self._left is not None
        self._left[i] = 0
        if self.ctx.on_layer_done is not None:
            self.ctx.on_layer_done(self.parts[i].index)

    # -- mode ------------------------------------------------------------------------------
    def train(self, mode: bool = True) -> TorchModel:
        super().train(mode)
        self.torch_module.train(mode)
        return self

    # -- names, as torch gives them ----------------------------------------------------------
    def named_parameters(self) -> Any:
        """``(torch name, view)`` for every trained parameter, in flat order (``state_dict``'s names)."""
        for part in self.parts:
            for name, _ in part.param_shapes:
                yield (f"{part.path}.{name}" if part.path else name), part.params[name]

    def named_buffers(self) -> Any:
        for part in self.parts:
            for name, _ in part.buffer_shapes:
                yield (f"{part.path}.{name}" if part.path else name), part.buffers[name]

    def __repr__(self) -> str:
        return repr(self.torch_module)


def from_torch(module: Any, xp: Any = np, dtype: str = "float32", seed: int = 0) -> TorchModel:
    """``TorchModule(module).materialize(xp, dtype, seed)``: the torch module as an mpisgd model for
    ``mpisgd.DataParallel`` (its own initial values are kept; ``seed`` keys dropout)."""
    return TorchModule(module).materialize(xp, dtype, seed)

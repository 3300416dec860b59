"""Modules that nest: containers, the flat layout, flags that reach every module, gradients reported
final, buffers and statistics, and the float64 gradient check (mpisgd.nn.module, containers, gradcheck)."""

from __future__ import annotations

import numpy as np
import pytest

from mpisgd.model_file import model_structure
from mpisgd.nn import Flatten, Linear, Module, ReLU, Residual, Sequential, mlp
from mpisgd.nn.gradcheck import check_gradients
from mpisgd.nn.module import parameter_shapes


def nested() -> Sequential:
    """Containers inside containers: a residual block with an identity shortcut, one with a projection."""
    return Sequential(
        Flatten(),
        Linear(12, 8),
        Residual(Sequential(Linear(8, 8), ReLU(), Linear(8, 8))),
        ReLU(),
        Residual(Sequential(Linear(8, 6), ReLU()), shortcut=Linear(8, 6)),
        Linear(6, 3),
    )


class Scaled(Module):
    """y = a * x with one parameter; ``wrong`` gives a backward that is off by a factor on purpose."""

    def __init__(self, n: int, wrong: bool = False) -> None:
        super().__init__()
        self.param_shapes = [("a", (n,))]
        self.wrong = wrong

    def init_params(self, rng: np.random.Generator, dtype: np.dtype) -> dict[str, np.ndarray]:
        return {"a": rng.uniform(0.5, 1.5, self.param_shapes[0][1]).astype(dtype)}

    def forward(self, x: np.ndarray) -> np.ndarray:
        self._x = x
        return x * self.params["a"]

    def backward(self, dy: np.ndarray, need_dx: bool = True) -> np.ndarray | None:
        g = self._grad_out("a", self.params["a"].shape, dy)
        np.sum(dy * self._x, axis=0, out=g)
        if self.wrong:
            g *= 1.5
        self._grad_done("a", g)
        return dy * self.params["a"] if need_dx else None


def test_nested_containers_pass_the_float64_gradient_check():
    x = np.random.default_rng(0).standard_normal((5, 3, 4))
    errors = check_gradients(nested(), x)
    names = [e.name for e in errors]
    assert names[0] == "input" and "2.main.0.Linear.W" in names and "4.shortcut.Linear.b" in names, names
    assert all(e.ok for e in errors), [e for e in errors if not e.ok]


def test_the_gradient_check_catches_a_wrong_backward():
    x = np.random.default_rng(1).standard_normal((4, 6))
    good = check_gradients(Sequential(Linear(6, 6), Scaled(6)), x)
    bad = check_gradients(Sequential(Linear(6, 6), Scaled(6, wrong=True)), x)
    assert all(e.ok for e in good)
    assert [e.name for e in bad if not e.ok] == ["1.Scaled.a"], bad


def test_flat_order_is_pre_order_and_names_are_qualified():
    module = nested()
    before = parameter_shapes(module)
    model = module.materialize(np, "float32", seed=3)
    assert model.parameter_shapes() == before
    assert [n for n, _ in model.named_parameters()][:6] == [
        "1.Linear.W", "1.Linear.b", "2.main.0.Linear.W", "2.main.0.Linear.b", "2.main.2.Linear.W",
        "2.main.2.Linear.b"]
    # every view is a view of the flat buffers, at its offset
    offsets = model.flat.offsets
    for k, (_, p) in enumerate(model.named_parameters()):
        assert np.shares_memory(p, model.flat.params) and p.size == offsets[k + 1] - offsets[k]


def test_a_chain_keeps_the_names_and_structure_of_before():
    """Model files and checkpoints of the stock models name parameters "<layer>.<Class>.<name>"."""
    module = mlp((8,), n_in=12, n_classes=3)
    assert model_structure(module) == {
        "layers": ["Flatten()", "Linear(12, 8)", "ReLU()", "Linear(8, 3)"],
        "shapes": [["1.Linear.W", [12, 8]], ["1.Linear.b", [8]], ["3.Linear.W", [8, 3]], ["3.Linear.b", [3]]]}


def test_backward_reports_each_parameter_owner_once_in_reverse_order():
    model = nested().materialize(np, "float64", seed=0)
    owners = [i for i, (a, _) in enumerate(model.layer_param_ranges()) if a >= 0]
    seen: list[int] = []
    x = np.random.default_rng(2).standard_normal((4, 12))
    model.backward(np.ones_like(model.forward(x)), seen.append)
    assert sorted(seen) == owners and len(seen) == len(set(seen))
    assert seen == sorted(seen, reverse=True)  # the shortcut runs first: its parameters come last
    ranges = model.layer_param_ranges()
    assert ranges[owners[0]][0] == 0 and max(b for _, b in ranges) == model.flat.size


def test_flags_reach_every_nested_module():
    model = nested().materialize(np, "float64", seed=0)
    deep = [m for m in model.modules() if isinstance(m, Linear)]
    model.eval()
    assert not any(m.training for m in deep)
    model.train()
    assert all(m.training for m in deep)
    x = np.random.default_rng(3).standard_normal((4, 12))
    model.backward(np.ones_like(model.forward(x)))
    once = model.flat.grads.copy()
    model.set_accumulate(True)
    assert all(m.accumulate for m in deep)
    model.backward(np.ones_like(model.forward(x)))
    np.testing.assert_allclose(model.flat.grads, 2 * once, rtol=1e-12)


class Counter(Module):
    """A module with state (a running sum) and per-micro-batch statistics (the batch mean)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.buffer_shapes = [("total", (n,)), ("seen", (1,))]
        self.stat_size = n

    def init_buffers(self, dtype: np.dtype) -> dict[str, np.ndarray]:
        return {"seen": np.ones(1, dtype)}

    def forward(self, x: np.ndarray) -> np.ndarray:
        if self.training and self.ctx.stat_row is not None:
            self.ctx.stat_row[self.stat_offset:self.stat_offset + self.stat_size] = x.mean(axis=0)
        return x

    def backward(self, dy: np.ndarray, need_dx: bool = True) -> np.ndarray | None:
        return dy

    def apply_stats(self, stats: np.ndarray) -> None:
        self.buffers["total"] += stats
        self.buffers["seen"] += 1


def test_buffers_live_in_the_state_array_and_statistics_get_their_slice():
    module = Sequential(Linear(3, 4), Counter(4), Residual(Sequential(Counter(4))), Linear(4, 2))
    model = module.materialize(np, "float64", seed=0)
    assert model.state is not None and model.state.size == 2 * (4 + 1)
    assert [n for n, _ in model.named_buffers()] == ["1.Counter.total", "1.Counter.seen", "2.main.0.Counter.total",
                                                      "2.main.0.Counter.seen"]
    assert list(model.state) == [0, 0, 0, 0, 1, 0, 0, 0, 0, 1]  # init_buffers where given, zeros elsewhere
    assert model.stat_size == 8
    row = np.zeros(model.stat_size)
    x = np.random.default_rng(4).standard_normal((5, 3))
    model.begin_batch(step=7, sample_ids=np.arange(5), stat_row=row)
    model.forward(x)
    assert model.ctx.step == 7 and np.all(row[:4] == row[4:]) and np.any(row != 0)
    model.apply_stats(row)
    np.testing.assert_array_equal(model.state[:4], row[:4])
    np.testing.assert_array_equal(model.state[5:9], row[4:])
    assert model.state[4] == 2 and model.state[9] == 2


def test_a_module_twice_in_a_model_is_refused():
    shared = Linear(4, 4)
    with pytest.raises(ValueError, match="appears twice"):
        Sequential(shared, ReLU(), shared).materialize(np)


def test_residual_shapes_must_match():
    model = Sequential(Residual(Linear(4, 3))).materialize(np)
    with pytest.raises(ValueError, match="shortcut"):
        model.forward(np.zeros((2, 4)))


def test_scoring_runs_in_eval_mode_and_restores_the_mode():
    from mpisgd.nn import Dropout, scoring

    model = Sequential(Linear(4, 16), Dropout(0.5), Linear(16, 3)).materialize(np, "float64", seed=0)
    rng = np.random.default_rng(5)
    x, y = rng.standard_normal((10, 4)), rng.integers(0, 3, 10)
    first = scoring.score(model, [(x, y)], n_classes=3)
    assert model.training  # put back
    again = scoring.score(model, [(x[:5], y[:5]), (x[5:], y[5:])], n_classes=3)
    assert (first.targets, first.correct) == (again.targets, again.correct) == (10, first.correct)
    assert abs(first.loss_sum - again.loss_sum) < 1e-12  # no dropout: the same scores however batched
    np.testing.assert_array_equal(first.per_class[:, 0], np.bincount(y, minlength=3))
    logits = model.eval().forward(x)
    z = logits - logits.max(axis=1, keepdims=True)
    want = float(np.sum(np.log(np.exp(z).sum(axis=1)) - z[np.arange(10), y]))
    assert abs(first.loss_sum - want) < 1e-9 and first.correct == int((logits.argmax(1) == y).sum())
    tokens = scoring.score(model, [(x, np.where(np.arange(10) < 4, -1, y))], ignore_index=-1)
    assert tokens.targets == 6

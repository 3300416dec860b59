"""Dropout keyed by (seed, step, global sample, module, element): the same mask for the same sample at
any split of the batch, a fresh one each step, the identity in eval mode, and its gradient."""

from __future__ import annotations

import numpy as np
import pytest

from mpisgd.nn import Linear, Sequential
from mpisgd.nn.dropout import Dropout, keyed_uniform16
from mpisgd.nn.gradcheck import check_gradients


def masks(model, x: np.ndarray, step: int, ids: np.ndarray) -> np.ndarray:
    model.begin_batch(step=step, sample_ids=ids)
    return model.forward(x.copy()) != 0


def test_a_sample_gets_the_same_mask_whatever_batch_it_is_in():
    model = Sequential(Dropout(0.3)).materialize(np, "float32", seed=5)
    x = np.ones((8, 50), np.float32)
    whole = masks(model, x, step=3, ids=np.arange(100, 108))
    halves = np.concatenate([masks(model, x[:4], 3, np.arange(100, 104)), masks(model, x[4:], 3, np.arange(104, 108))])
    np.testing.assert_array_equal(whole, halves)
    shuffled = masks(model, x, 3, np.arange(107, 99, -1))
    np.testing.assert_array_equal(whole[::-1], shuffled)


def test_masks_change_with_step_seed_module_and_sample():
    x = np.ones((4, 4000), np.float32)
    model = Sequential(Dropout(0.5), Dropout(0.5)).materialize(np, "float32", seed=1)
    ids = np.arange(4)
    base = masks(model, x, 0, ids)
    assert abs(base.mean() - 0.25) < 0.01  # two dropouts of 0.5 in a row keep a quarter
    assert (masks(model, x, 1, ids) != base).mean() > 0.3
    assert (masks(model, x, 0, ids + 4) != base).mean() > 0.3
    other_seed = Sequential(Dropout(0.5), Dropout(0.5)).materialize(np, "float32", seed=2)
    assert (masks(other_seed, x, 0, ids) != base).mean() > 0.3
    a, b = keyed_uniform16(np, 1, 0, 1, ids, 4000), keyed_uniform16(np, 1, 0, 2, ids, 4000)
    assert (a != b).mean() > 0.99  # each module draws its own


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_the_drop_rate_and_the_scale(p):
    model = Sequential(Dropout(p)).materialize(np, "float64", seed=0)
    model.begin_batch(step=0, sample_ids=np.arange(64))
    y = model.forward(np.ones((64, 2000)))
    kept = y != 0
    assert abs(kept.mean() - (1 - p)) < 0.01
    np.testing.assert_allclose(y[kept], 1 / (1 - p))


def test_eval_mode_is_the_identity():
    model = Sequential(Dropout(0.5)).materialize(np, "float32", seed=0).eval()
    x = np.random.default_rng(0).standard_normal((3, 7)).astype(np.float32)
    np.testing.assert_array_equal(model.forward(x), x)


def test_dropout_passes_the_gradient_check_and_p_is_checked():
    x = np.random.default_rng(0).standard_normal((6, 5))
    errors = check_gradients(Sequential(Linear(5, 8), Dropout(0.4), Linear(8, 3)), x)
    assert all(e.ok for e in errors), errors
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        Dropout(1.0)

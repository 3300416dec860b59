"""The learning rate as a pure function: scale, per-iteration warmup, decay; bad input."""

from __future__ import annotations

import math

import pytest
from conftest import run_mpi

from mpisgd.app.options import parse_config
from mpisgd.errors import UsageError
from mpisgd.schedule import Schedule, effective_batch, scaled_lr


# -- phase 1: scale -----------------------------------------------------------------------
def test_effective_batch_is_k_b_m():
    assert effective_batch(32, 2, 4) == 256
    assert effective_batch(256, 1) == 256


@pytest.mark.parametrize("args", [(0, 2, 1), (32, 0, 1), (32, 2, 0)])
def test_effective_batch_rejects_non_positive(args):
    with pytest.raises(UsageError, match="must be >= 1"):
        effective_batch(*args)


@pytest.mark.parametrize(("scaling", "expected"), [("linear", 0.8), ("sqrt", 0.1 * math.sqrt(8)), ("none", 0.1)])
def test_scaled_lr(scaling, expected):
    assert scaled_lr(0.1, 256, 2048, scaling) == pytest.approx(expected, rel=1e-15)


def test_linear_scaling_below_base_batch_shrinks_the_rate():
    assert scaled_lr(0.1, 256, 64, "linear") == pytest.approx(0.025)


def test_scaled_lr_bad_input():
    with pytest.raises(UsageError, match="base batch must be >= 1, got 0"):
        scaled_lr(0.1, 0, 256, "linear")
    with pytest.raises(UsageError, match="unknown lr scaling"):
        scaled_lr(0.1, 256, 256, "cubic")


# -- phase 2: warmup, per iteration ---------------------------------------------------------
def test_warmup_rises_linearly_per_iteration_from_eta0_to_peak():
    s = Schedule(base_lr=0.1, peak_lr=3.2, warmup_steps=10, total_steps=100)
    values = [s(t) for t in range(11)]
    assert values[0] == pytest.approx(0.1)
    assert values[10] == pytest.approx(3.2)
    steps = [b - a for a, b in zip(values, values[1:])]
    assert all(d == pytest.approx(0.31) for d in steps), "one equal increment per iteration, not per epoch"


def test_warmup_is_flat_when_the_scaled_rate_is_below_eta0():
    s = Schedule(base_lr=0.1, peak_lr=0.025, warmup_steps=5, total_steps=20)
    assert [s(t) for t in range(6)] == [0.025] * 6


# -- phase 3: decay -------------------------------------------------------------------------
def test_cosine_decays_from_peak_after_warmup_to_near_zero():
    s = Schedule(base_lr=0.1, peak_lr=0.4, warmup_steps=10, total_steps=110, decay="cosine")
    assert s(10) == pytest.approx(0.4)
    assert s(60) == pytest.approx(0.2)  # halfway through the decay span
    after = [s(t) for t in range(10, 110)]
    assert all(b < a for a, b in zip(after, after[1:]))
    assert 0 < s(109) < 1e-3


def test_step_decay_at_milestones():
    s = Schedule(base_lr=0.1, peak_lr=0.1, warmup_steps=0, total_steps=100, decay="step",
                 milestones=(30, 60), decay_factor=0.1)
    assert [s(29), s(30), s(59), s(60), s(99)] == pytest.approx([0.1, 0.01, 0.01, 0.001, 0.001])


def test_no_decay_holds_the_peak():
    s = Schedule(base_lr=0.1, peak_lr=0.8, warmup_steps=4, total_steps=50, decay="none")
    assert {s(t) for t in range(4, 50)} == {0.8}


def test_pure_function_identical_values_for_identical_inputs():
    kw = dict(base_lr=0.1, peak_lr=1.6, warmup_steps=37, total_steps=500, decay="cosine")
    a, b = Schedule(**kw), Schedule(**kw)
    forward = [a(t) for t in range(500)]
    assert [b(t) for t in reversed(range(500))][::-1] == forward  # order of calls does not matter
    assert [a(t) for t in range(500)] == forward  # no state
    assert a == b and hash(a) == hash(b)


def test_from_config_all_phases():
    cfg = parse_config(["--lr", "0.1", "--base-batch", "256", "--batch-size", "64", "--accum-steps", "4",
                        "--warmup-epochs", "2", "--epochs", "10", "--decay", "step", "--decay-epochs", "6,8"])
    s = Schedule.from_config(cfg, world_size=2, steps_per_epoch=100, total_steps=1000)
    assert s.peak_lr == pytest.approx(0.2)  # B = 2*64*4 = 512 = 2*B0
    assert s.warmup_steps == 200 and s.milestones == (600, 800)
    assert s(0) == pytest.approx(0.1) and s(100) == pytest.approx(0.15) and s(200) == pytest.approx(0.2)
    assert s(600) == pytest.approx(0.02)


# -- bad input --------------------------------------------------------------------------------
def test_warmup_longer_than_the_run_is_a_usage_error():
    with pytest.raises(UsageError, match="longer than the run"):
        Schedule(base_lr=0.1, peak_lr=0.2, warmup_steps=11, total_steps=10)
    with pytest.raises(UsageError, match="longer than the run"):  # caught at parse time
        parse_config(["--warmup-epochs", "5", "--epochs", "3"], quiet=True)
    cfg = parse_config(["--warmup-steps", "40", "--epochs", "3"])  # in steps: known only with the data
    with pytest.raises(UsageError, match="longer than the run"):
        Schedule.from_config(cfg, 1, steps_per_epoch=10, total_steps=30)


def test_a_run_shorter_than_its_models_recipe_warmup_warms_up_over_the_whole_run():
    """The ResNet's recipe warms up for an epoch: a run of 2 steps takes them all, saying so; the same run
    with a warmup of one's own (or the recipe's value changed) is refused as before."""
    cfg = parse_config(["--model", "resnet", "--max-steps", "2"], quiet=True)
    sched, said = Schedule.for_run(cfg, 1, steps_per_epoch=468, total_steps=2)
    assert sched.warmup_steps == 2 and sched.total_steps == 2
    assert said == ["--model resnet's recipe warms up for longer (--warmup-epochs 1, 468 steps) than this run of 2 "
                    "step(s): the warmup takes the whole run (give --warmup-steps to choose)"]
    assert Schedule.for_run(cfg, 1, steps_per_epoch=2, total_steps=2)[1] == []  # it fits: nothing to say
    for own in (["--warmup-steps", "3"], ["--warmup-epochs", "0.5"]):
        with pytest.raises(UsageError, match="longer than the run"):
            Schedule.for_run(parse_config(["--model", "resnet", "--max-steps", "2", *own], quiet=True), 1, 468, 2)


@pytest.mark.parametrize("kw", [dict(total_steps=0), dict(warmup_steps=-1), dict(decay="linear"),
                                dict(decay_factor=0.0), dict(peak_lr=0.0)])
def test_schedule_rejects_bad_values(kw):
    args = dict(base_lr=0.1, peak_lr=0.2, warmup_steps=0, total_steps=10) | kw
    with pytest.raises(UsageError):
        Schedule(**args)


@pytest.mark.parametrize("argv", [["--base-batch", "0"], ["--accum-steps", "0"]])
def test_config_rejects_bad_batch_input(argv):
    with pytest.raises(UsageError, match="must be >= 1, got 0"):
        parse_config(argv, quiet=True)


SYNTH = ["-m", "mpisgd.train", "--dataset", "synthetic", "--synthetic-samples", "512", "--hidden", "8",
         "--batch-size", "32", "--progress", "off"]


@pytest.mark.parametrize(("extra", "message"), [
    (["--epochs", "2", "--warmup-epochs", "3"], "longer than the run"),
    (["--base-batch", "0"], "--base-batch must be >= 1"),
    (["--accum-steps", "0"], "--accum-steps must be >= 1"),
])
def test_cli_bad_schedule_input_exits_2_with_one_line(extra, message):
    r = run_mpi(2, *SYNTH, *extra, timeout=120)
    assert r.returncode == 2, r.stderr + r.stdout
    lines = [ln for ln in r.stderr.splitlines() if "error" in ln]
    assert len(lines) == 1 and message in lines[0], r.stderr


def test_a_global_batch_no_k_times_b_divides_names_the_k_and_the_b_that_would():
    from mpisgd.schedule import accum_steps_for

    assert accum_steps_for(64, 2, 16) == 2
    with pytest.raises(UsageError, match=r"^--global-batch 64 is not k\*b\*m for k=4 ranks and b=32: use k in 1, 2, "
                                         r"or at k=4 a --batch-size that divides 16$"):
        accum_steps_for(64, 4, 32)
    with pytest.raises(UsageError, match=r"for k=3 ranks and b=32: use k in 1, 2$"):  # 3 divides no b's multiple
        accum_steps_for(64, 3, 32)

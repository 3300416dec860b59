"""Strict parsing: unknown keys and wrong types are errors; every bad value names itself."""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

import pytest

from mpisgd.app.options import parse_config
from mpisgd.config import Config
from mpisgd.errors import UsageError


def test_defaults_are_valid():
    cfg = parse_config([])
    assert cfg == Config()
    assert cfg.model == "mlp" and cfg.hidden == (1024, 1024)


def test_flags_map_to_fields():
    cfg = parse_config(["--batch-size", "32", "--hidden", "64,32", "--nesterov", "--lr", "0.5"])
    assert (cfg.batch_size, cfg.hidden, cfg.nesterov, cfg.lr) == (32, (64, 32), True, 0.5)
    cfg = parse_config(["--optimizer", "lars", "--trust-coef", "0.02"])
    assert (cfg.optimizer, cfg.trust_coef) == ("lars", 0.02) and Config().optimizer == "sgd"
    cfg = parse_config(["--optimizer", "lamb", "--beta1", "0.8", "--beta2", "0.99", "--eps", "1e-6",
                        "--clip-grad-norm", "1.5"])
    assert (cfg.optimizer, cfg.beta1, cfg.beta2, cfg.eps, cfg.clip_grad_norm) == ("lamb", 0.8, 0.99, 1e-6, 1.5)
    assert (Config().beta1, Config().beta2, Config().eps, Config().clip_grad_norm) == (0.9, 0.999, 1e-8, 0.0)


@pytest.mark.parametrize("argv,match", [
    (["--batch-size", "0"], "batch-size must be >= 1, got 0"),
    (["--epochs", "-1"], "epochs must be >= 1"),
    (["--lr", "-0.1"], "lr must be > 0"),
    (["--momentum", "1.5"], "momentum"),
    (["--model", "vgg"], r"--model must be mlp, cnn, resnet, gpt or package.module:function, got 'vgg' \(the stock "
                         r"models: mlp, cnn for LeNet-5, resnet for ResNet-20, gpt for a language model on text; or "
                         r"a factory of your own\)"),
    (["--reproducible-level", "portable"], r"--reproducible-level portable without --reproducible: nothing would "
                                           r"be reproducible; pass --reproducible portable"),
    (["--model", "cnn", "--dropout", "0.5"], r"--dropout 0.5: for --model gpt only; --model cnn does not read it$"),
    (["--model", "t:f", "--gpt-heads", "7", "--dropout", "0.1"],
     r"--gpt-heads 7, --dropout 0.1: for --model gpt only; --model t:f does not read them \(a model of your own "),
    # options the run would not read (each passed silently before)
    (["--model", "cnn", "--hidden", "8"], r"^--hidden 8 \(the MLP's widths; --model cnn does not read them\) would "
                                          r"do nothing in this run: drop it, or choose what reads it$"),
    (["--optimizer", "adamw", "--momentum", "0.5", "--decay-epochs", "3"],
     r"^--momentum 0.5 \(for --optimizer sgd or lars, not adamw\) and --decay-epochs 3 \(for --decay step, not "
     r"cosine\) would do nothing in this run: drop them"),
    (["--beta1", "0.8"], r"--beta1 0.8 \(for --optimizer adamw or lamb, not sgd\)"),
    (["--trust-coef", "0.01", "--optimizer", "lamb"], r"--trust-coef 0.01 \(for --optimizer lars, not lamb\)"),
    (["--decay-factor", "0.5"], r"--decay-factor 0.5 \(for --decay step, not cosine\)"),
    (["--warmup-from", "zero"], r"--warmup-from zero \(there is no warmup\)"),
    (["--checkpoint-every", "3", "--checkpoint-keep", "5", "--overwrite-checkpoints"],
     r"--checkpoint-every 3 \(there is no --checkpoint-dir\) and --checkpoint-keep 5 \(there is no "
     r"--checkpoint-dir\) and --overwrite-checkpoints True \(there is no --checkpoint-dir\)"),
    (["--resume-allow", "lr"], r"--resume-allow lr \(there is no --resume\)"),
    (["--test-every-epoch"], r"--test-every-epoch True \(for runs with --val-split only"),
    (["--synthetic-samples", "100"], r"--synthetic-samples 100 \(for --dataset synthetic only\)"),
    (["--data-dir", "/d", "--data", "x.npz"], r"--data-dir /d \(with --data, that file is read\)"),
    (["--data-dir", "/d", "--dataset", "synthetic"], r"--data-dir /d \(Fashion-MNIST's directory; --dataset "
                                                     r"synthetic does not read it\)"),
    (["--config", "a.toml", "--config", "b.toml"], r"--config given 2 times \(a.toml, b.toml\): give one file"),
    (["--device", "tpu"], "invalid choice"),
    (["--batch-size", "ten"], "invalid int value"),
    (["--no-such-flag"], "unrecognized arguments"),
    (["--base-batch", "0"], "base-batch must be >= 1"),
    (["--accum-steps", "0"], "accum-steps must be >= 1"),
    (["--decay", "step"], "decay-epochs"),
    (["--hidden", "64,x"], "comma-separated"),
    (["--trust-coef", "0"], "trust-coef must be > 0"),
    (["--trust-coef", "nan"], "trust-coef must be a finite number"),
    (["--trust-coef", "inf"], "trust-coef must be a finite number"),
    (["--optimizer", "adam"], "invalid choice"),
    (["--beta1", "1"], r"--beta1 must be in \[0, 1\), got 1.0"),
    (["--beta2", "-0.1"], "--beta2 must be in"),
    (["--eps", "0"], "--eps must be > 0"),
    (["--clip-grad-norm", "-1"], "--clip-grad-norm must be >= 0"),
    (["--clip-grad-norm", "inf"], "--clip-grad-norm must be a finite number"),
    (["--optimizer", "adamw", "--nesterov"], "--nesterov is for --optimizer sgd or lars, not adamw"),
    (["--optimizer", "lamb", "--momentum-correction"], "--momentum-correction is for --optimizer sgd or lars"),
    # every bad number is refused before MPI does anything (the CLI's one line and exit 2 on every rank:
    # tests/test_failures.py, end to end and in process)
    (["--lr", "inf"], "--lr must be a finite number"),
    (["--lr", "nan"], "--lr must be a finite number"),
    (["--warmup-epochs", "nan"], "--warmup-epochs must be a finite number"),
    (["--weight-decay", "nan"], "--weight-decay must be a finite number"),
    (["--weight-decay", "inf"], "--weight-decay must be a finite number"),
    (["--bucket-cap-mb", "nan"], "--bucket-cap-mb must be a finite number"),
    (["--bucket-mb", "nan"], "--bucket-cap-mb must be a finite number"),  # the earlier spelling
    (["--stall-timeout-s", "nan"], "--stall-timeout-s must be a finite number"),
    (["--seed", "-1"], "--seed must be >= 0"),
    (["--resume-allow", "model"], "not an option a resumed run can change"),
    (["--epochs", "x"], "invalid int value: 'x'"),
    (["--model", "foo"], r"--model must be mlp, cnn, resnet, gpt or package.module:function, got 'foo'"),
])
def test_bad_values_raise_usage_error(argv, match):
    with pytest.raises(UsageError, match=match):
        parse_config(argv, quiet=True)


def changed(f: dataclasses.Field) -> Any:
    """A value of field f's type other than its default."""
    default, choices = f.default, f.metadata.get("choices")
    if choices:
        return next(c for c in choices if c != default)
    if default is None:  # an optional field: a value of its other type
        return {"int | None": 1, "str | None": "changed", "bool | None": True}[f.type]
    for kind, change in ((bool, operator.not_), (int, lambda v: v + 1), (float, lambda v: v + 0.5),
                         (str, lambda v: v + "-changed"), (tuple, lambda v: (*v, 7))):
        if isinstance(default, kind):
            return change(default)
    raise AssertionError(f"no changed value for {f.name}: {f.type}")


def test_digest_is_a_function_of_the_values():
    assert Config().digest() == Config().digest()
    assert Config(batch_size=64).digest() == parse_config(["--batch-size", "64"], quiet=True).digest()


@pytest.mark.parametrize("f", dataclasses.fields(Config), ids=lambda f: f.name)
def test_digest_changes_with_any_field(f):
    value = changed(f)
    assert type(value).__name__ in f.type and value != f.default  # a value of the field's type
    other = dataclasses.replace(Config(), **{f.name: value})
    assert other.digest() != Config().digest()
    assert other.digest(exclude=(f.name,)) == Config().digest(exclude=(f.name,))  # through that field only


def test_cnn_takes_its_own_recipe_where_the_command_line_is_silent():
    cfg = parse_config(["--model", "cnn", "--lr", "0.05"], quiet=True)
    assert (cfg.lr, cfg.weight_decay, cfg.epochs) == (0.05, 5e-4, 20)
    assert cfg.given == {"model", "lr"}
    mlp = parse_config([], quiet=True)
    assert (mlp.lr, mlp.weight_decay, mlp.epochs) == (0.1, 0.0, 12)


@pytest.mark.parametrize("flag", ["--data", "--data-dir", "--checkpoint-dir", "--save-model", "--metrics-file",
                                  "--timeline", "--resume", "--tensorboard"])
def test_an_empty_path_or_a_name_too_long_is_refused(flag):
    """`--data $DATA` with DATA unset: before, Fashion-MNIST was trained instead, with exit 0 (`--tensorboard ''`
    ran without TensorBoard). A name of 300 bytes: before, a traceback from the first check that touched it,
    or for --resume and --data from set-up (ENAMETOOLONG)."""
    with pytest.raises(UsageError, match=f"{flag} is empty: give a path"):
        parse_config([flag, ""], quiet=True)
    with pytest.raises(UsageError, match=f"{flag} is empty"):
        parse_config([flag, "  "], quiet=True)
    with pytest.raises(UsageError, match=f"{flag} /tmp/y+\\.\\.\\.: a name in it is 300 bytes long; file systems "
                                         "take at most 255"):
        parse_config([flag, "/tmp/" + "y" * 300 + "/x"], quiet=True)
    parse_config([flag, "/tmp/" + "y" * 255], quiet=True)  # the longest name there is


def test_the_optimizer_is_part_of_the_run_identity():
    from mpisgd.config import IDENTITY

    assert {"optimizer", "trust_coef"} <= set(IDENTITY)

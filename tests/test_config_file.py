"""--config FILE.toml: options by their long names, the command line over them, strict keys and types; the
effective configuration printed (--print-config) and written beside the outputs, read back to the same."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, TINY, clean_env, root_makes, serial_only, train_here, world
from test_config import changed

from mpisgd.app.options import parse_config, read_config, to_toml, values
from mpisgd.config import Config
from mpisgd.errors import UsageError


def toml(tmp_path: Path, text: str, name: str = "run.toml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_a_file_sets_options_by_their_long_names_and_the_command_line_overrides_it(tmp_path):
    path = toml(tmp_path, 'limit-train = 4096\nhidden = "512,256"\nnesterov = true\nlr = 1\n'
                          'decay-epochs = [3, 5]\ndecay = "step"\noptimizer = "lars"\nbucket-mb = 4\n')
    cfg = parse_config(["--config", path, "--lr", "0.3"], quiet=True)
    assert (cfg.limit_train, cfg.hidden, cfg.nesterov, cfg.lr, cfg.decay_epochs, cfg.optimizer,
            cfg.bucket_cap_mb) == (4096, (512, 256), True, 0.3, (3, 5), "lars", 4.0)
    assert isinstance(cfg.lr, float) and isinstance(cfg.bucket_cap_mb, float)
    # what resume derives b and m from: the file's keys count as given, like flags
    assert cfg.given == {"limit_train", "hidden", "nesterov", "lr", "decay_epochs", "decay", "optimizer",
                         "bucket_cap_mb"}
    assert cfg.config_file == path
    assert parse_config(["--config", toml(tmp_path, "hidden = [64, 32]\n", "b.toml")], quiet=True).hidden == (64, 32)
    assert parse_config([], quiet=True).config_file is None


def test_the_cnn_recipe_yields_to_the_file(tmp_path):
    cfg = parse_config(["--config", toml(tmp_path, 'model = "cnn"\nlr = 0.05\n')], quiet=True)
    assert (cfg.lr, cfg.weight_decay, cfg.epochs) == (0.05, 5e-4, 20)


@pytest.mark.parametrize("text,says", [
    ("limit_trian = 5\n", "'limit_trian' is not an option; did you mean 'limit-train'?"),
    ("learning-rate = 0.1\n", "'learning-rate' is not an option"),
    ("[optimizer]\nlr = 0.1\n", "[optimizer] is a table; options go at the top level"),
    ("epochs = 2.0\n", "epochs must be an integer, got float 2.0"),
    ('epochs = "2"\n', 'epochs must be an integer, got string "2"'),
    ("lr = true\n", "lr must be a number, got boolean true"),
    ("nesterov = 1\n", "nesterov must be true or false, got integer 1"),
    ('hidden = "64,x"\n', "hidden must be a list of integers"),
    ("hidden = [64, 1.5]\n", "hidden must be a list of integers"),
    ("data = 3\n", "data must be a string, got integer 3"),
    ('device = "tpu"\n', "device must be one of auto, cpu, gpu, got 'tpu'"),
    ("limit-train = 4\nlimit_train = 5\n", "'limit_train' sets 'limit-train' a second time"),
    ("lr = \n", "not valid TOML"),
    ("limit-train = 0\n", "--limit-train must be >= 1, got 0"),  # then the same checks as the flags
])
def test_bad_files_name_the_key_and_the_type(tmp_path, text, says):
    path = toml(tmp_path, text)
    with pytest.raises(UsageError) as exc:
        parse_config(["--config", path], quiet=True)
    assert says in str(exc.value)
    if "TOML" not in says and "--limit-train" not in says:
        assert str(exc.value).startswith(f"--config {path}: ")


def test_a_missing_file_is_one_line(tmp_path):
    with pytest.raises(UsageError, match="--config .*nope.toml: no such file"):
        parse_config(["--config", str(tmp_path / "nope.toml")], quiet=True)


def other(f: dataclasses.Field):
    """A value of field f's type other than its default (test_config's, and true for an unset flag)."""
    return True if f.type == "bool | None" and f.default is None else changed(f)


def test_every_option_round_trips_through_the_toml_it_prints():
    """Every field set to a value other than its default, written as TOML, read back: the same values."""
    every = dataclasses.replace(Config(), **{f.name: other(f) for f in dataclasses.fields(Config)})
    for cfg in (Config(), every, Config(hidden=(), data="/a \"quoted\" path\\x", lr=1e-5, decay_epochs=(6, 9))):
        import tomllib

        got = dataclasses.replace(Config(), **values(tomllib.loads(to_toml(cfg, "a header\nof two lines")), "t"))
        # with --global-batch, m is left to set-up (it follows from B, k and b): written as a comment
        assert got == (cfg if cfg.global_batch is None else dataclasses.replace(cfg, accum_steps=1))


def test_print_config_prints_what_config_reads_back(tmp_path, capsys):
    argv = ["--model", "cnn", "--batch-size", "64", "--limit-test", "100", "--no-overlap", "--data", "/x y/set.npz"]
    with pytest.raises(SystemExit) as exc:
        parse_config([*argv, "--print-config"])
    assert exc.value.code == 0
    printed = capsys.readouterr().out
    assert printed.startswith("# mpisgd's configuration") and 'model = "cnn"' in printed
    assert "# limit-train = (not set)" in printed and "lr = 0.02" in printed  # the recipe, as it takes effect
    path = toml(tmp_path, printed)
    assert parse_config(["--config", path], quiet=True) == parse_config(argv, quiet=True)
    with pytest.raises(SystemExit):
        parse_config(["--config", path, "--print-config"])
    assert capsys.readouterr().out == printed


def test_read_config_returns_field_names(tmp_path):
    assert read_config(toml(tmp_path, "stall-timeout = 5\ncheck_replicas = 3\n")) == \
        {"stall_timeout_s": 5.0, "check_replicas": 3}


@serial_only
def test_print_config_from_the_command_line(tmp_path):
    r = subprocess.run([sys.executable, "-m", "mpisgd.train", "--epochs", "3", "--print-config"], capture_output=True,
                       text=True, timeout=120, env={**clean_env(), "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0 and "epochs = 3\n" in r.stdout and "all-reduce" not in r.stdout, r.stderr


@serial_only  # one rank's run, in this process
def test_the_effective_configuration_is_written_beside_the_metrics_and_the_checkpoints(tmp_path):
    cfg_in = toml(tmp_path, 'dataset = "synthetic"\nsynthetic-samples = 512\nhidden = [16]\nprogress = "off"\n'
                            "max-steps = 3\nbatch-size = 32\n")
    metrics, ckpt = tmp_path / "out" / "m.jsonl", tmp_path / "ckpt"
    r = train_here(["--config", cfg_in, "--lr", "0.05", "--metrics-file", str(metrics), "--checkpoint-dir", str(ckpt)])
    assert r.status == 0, r
    written = [Path(f"{metrics}.config.toml"), ckpt / "config.toml"]
    assert written[0].read_text() == written[1].read_text()
    text = written[0].read_text()
    assert "hidden = [16]" in text and "lr = 0.05" in text and f'checkpoint-dir = "{ckpt}"' in text
    assert "k=1 rank(s)" in text and "global-batch = 32\n" in text and "# accum-steps = (follows" in text
    assert not list(tmp_path.rglob("*.tmp.*"))  # all or nothing: no temporary left
    # the copy runs the same configuration again (here: resuming the finished run)
    again = train_here(["--config", str(written[0]), "--resume", "auto"])
    assert again.status == 0 and "the run is finished" in again.out, again
    # a run whose --config is the checkpoint directory's copy leaves that file alone
    before = written[1].read_text()
    r = train_here(["--config", str(written[1]), "--resume", "auto", "--max-steps", "4", "--resume-allow",
                    "max_steps"])
    assert r.status == 0, r
    assert f"warning: {written[1]} is this run's --config: not replaced" in r.out
    assert written[1].read_text() == before and "max-steps = 4" in written[0].read_text()


@pytest.mark.mpi
def test_bad_config_is_one_line_exit_2_on_every_rank(shared_tmp):
    path = root_makes(lambda: toml(shared_tmp, "hiden = [4]\n"))
    r = train_here(["--config", path])
    assert r.statuses == (2,) * len(r.statuses), r
    assert "'hiden' is not an option; did you mean 'hidden'?" in r.error


def _returns_promptly(fn, timeout_s: float = 20):
    """fn() in a thread: its result or exception, or a failure if it blocks."""
    import threading

    out: dict = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout_s)
    assert not t.is_alive(), "blocked (every rank would hang before the watchdog exists)"
    return out


@pytest.mark.parametrize("kind", ["fifo", "stdin", "directory"])
def test_a_config_that_is_not_a_regular_file_is_refused_without_blocking(tmp_path, kind):
    """Every rank reads --config itself: a FIFO nobody writes, or /dev/stdin under mpiexec, blocked every rank
    for ever before any watchdog existed."""
    import os

    path = tmp_path / "run.toml"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    r, w = os.pipe()  # /dev/stdin as a pipe nobody writes to, as under mpiexec
    saved = os.dup(0)
    os.dup2(r, 0)
    try:
        out = _returns_promptly(lambda: read_config("/dev/stdin" if kind == "stdin" else str(path)))
    finally:
        os.dup2(saved, 0)
        for fd in (r, w, saved):
            os.close(fd)
    assert isinstance(out.get("error"), UsageError), out
    assert "is not a regular file" in str(out["error"]) or "cannot read it" in str(out["error"]), out["error"]


def test_a_config_that_is_not_utf8_is_one_line(tmp_path):
    path = tmp_path / "run.toml"
    path.write_bytes(b"hidden = [8]\n# caf\xe9\n")  # Latin-1
    with pytest.raises(UsageError, match=r"not UTF-8 text \(byte 0xe9 at offset 18\)"):
        read_config(str(path))


def test_print_config_of_a_global_batch_run_reads_back(tmp_path, capsys):
    """--global-batch sets m at start-up from B, k and b: the printed file leaves --accum-steps out (a comment),
    so that it reads back on any k. It printed accum-steps = 1, which --config then refused (B=256 with b=32
    means m=4 at k=2)."""
    with pytest.raises(SystemExit):
        parse_config(["--global-batch", "256", "--batch-size", "32", "--print-config"])
    text = capsys.readouterr().out
    assert "# accum-steps = (follows from global-batch" in text and "\naccum-steps" not in text
    path = toml(tmp_path, text)
    cfg = parse_config(["--config", path], quiet=True)
    assert (cfg.global_batch, cfg.batch_size) == (256, 32) and "accum_steps" not in cfg.given
    from mpisgd.app.run import _global_batch

    _global_batch(cfg, 2)  # what set-up does at k = 2: m follows, no contradiction
    assert cfg.accum_steps == 4


@pytest.mark.parametrize("threads", ["100000000000000000000", "1025"])
def test_an_absurd_thread_count_is_one_line(threads, monkeypatch):
    with pytest.raises(UsageError, match="--threads must be at most 1024"):
        parse_config(["--threads", threads], quiet=True)
    from mpisgd.context import blas_threads

    monkeypatch.setenv("OMP_NUM_THREADS", threads)  # the same number from the environment
    with pytest.raises(UsageError, match=f"OMP_NUM_THREADS={threads[:24]}: at most 1024"):
        blas_threads(None, 1)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert blas_threads(None, 1) == (3, "OMP_NUM_THREADS")


def test_a_file_that_contradicts_itself_is_refused_and_one_the_command_line_overrides_warns(tmp_path):
    """A file whose own optimizer does not read its momentum: refused, naming the file. The same value where the
    command line chose the optimizer: the file's value is put back to its default, with a warning."""
    path = toml(tmp_path, 'momentum = 0.5\noptimizer = "lamb"\n')
    with pytest.raises(UsageError, match=rf"^--momentum 0.5 \(from --config {re.escape(path)}; for --optimizer sgd "
                                         r"or lars, not lamb\) would do nothing"):
        parse_config(["--config", path], quiet=True)
    sgd = toml(tmp_path, "momentum = 0.5\n", "sgd.toml")
    assert parse_config(["--config", sgd], quiet=True).momentum == 0.5  # read by sgd
    lamb = parse_config(["--config", sgd, "--optimizer", "lamb"], quiet=True)
    assert lamb.momentum == 0.9 and "momentum" not in lamb.given
    assert lamb.option_warnings == [f"momentum = 0.5 from --config {sgd} is ignored, as the command line leaves it "
                                    "unread: for --optimizer sgd or lars, not lamb"]


@pytest.mark.parametrize("written,line,reset", [
    (["--hidden", "16"], ["--model", "cnn"], {"hidden": (1024, 1024)}),  # docs/api.md's --config mlp.toml --model cnn
    (["--model", "gpt"], ["--optimizer", "sgd"], {"beta2": 0.999, "weight_decay_on": "all"}),  # was refused twice
    (["--model", "gpt"], ["--model", "mlp"], {"context": 128}),  # the GPT's window, layers... left to the GPT
    (["--decay", "step", "--decay-epochs", "1"], ["--decay", "cosine"], {"decay_epochs": ()}),
    (["--checkpoint-dir", "ck", "--resume", "auto", "--resume-allow", "max-steps"], ["--resume", "no"],
     {"resume_allow": ""}),  # a resumed run's copy starting a fresh run (the Slurm script's MPISGD_RESUME=no)
])
def test_print_configs_file_reads_back_with_another_choice_on_the_command_line(tmp_path, capsys, written, line,
                                                                                reset):
    with pytest.raises(SystemExit):
        parse_config([*written, "--print-config"])
    path = toml(tmp_path, capsys.readouterr().out)
    cfg = parse_config(["--config", path, *line], quiet=True)
    assert {k: getattr(cfg, k) for k in reset} == reset and not set(reset) & cfg.given
    ignored = {w.split(" = ")[0].replace("-", "_") for w in cfg.option_warnings
               if f" from --config {path} is ignored, as the command line leaves it unread: " in w}
    assert ignored >= set(reset), cfg.option_warnings


def test_a_gpt_file_without_warmup_reads_back(tmp_path, capsys):
    """The GPT's recipe warms up from zero: its --print-config file without warmup says warmup-from = "zero",
    which is the GPT's own default, not a value the run would ignore."""
    with pytest.raises(SystemExit):
        parse_config(["--model", "gpt", "--warmup-steps", "0", "--print-config"])
    path = toml(tmp_path, capsys.readouterr().out)
    assert parse_config(["--config", path], quiet=True).warmup_from == "zero"
    assert parse_config(["--model", "gpt", "--warmup-steps", "0", "--warmup-from", "zero"], quiet=True).warmup_steps \
        == 0


def test_a_files_level_without_reproducible_is_refused_unless_the_file_or_line_sets_it(tmp_path):
    level_only = toml(tmp_path, 'reproducible-level = "portable"\n')
    with pytest.raises(UsageError, match="--reproducible-level portable without --reproducible"):
        parse_config(["--config", level_only], quiet=True)
    assert not parse_config(["--config", level_only, "--no-reproducible"], quiet=True).reproducible
    assert parse_config(["--config", level_only, "--reproducible"], quiet=True).reproducible_level == "portable"


def test_the_gpt_recipe_gives_adamw_options_only_to_an_optimizer_that_reads_them():
    lamb = parse_config(["--model", "gpt", "--optimizer", "lamb"], quiet=True)  # was refused: weight-decay-on
    assert (lamb.weight_decay_on, lamb.beta2, lamb.weight_decay) == ("all", 0.99, 0.1)
    sgd = parse_config(["--model", "gpt", "--optimizer", "sgd"], quiet=True)
    assert (sgd.weight_decay_on, sgd.beta2) == ("all", 0.999)
    assert parse_config(["--model", "gpt"], quiet=True).weight_decay_on == "matrices"


def test_another_models_file_warns_that_its_recipe_runs_with_this_model(tmp_path, capsys):
    """--print-config of the MLP, then --config it --model cnn: the MLP's lr, epochs and weight decay ran silently."""
    with pytest.raises(SystemExit):
        parse_config(["--print-config"])
    path = toml(tmp_path, capsys.readouterr().out)
    cfg = parse_config(["--config", path, "--model", "cnn", "--lr", "0.02"], quiet=True)
    assert (cfg.lr, cfg.epochs) == (0.02, 12)  # documented: a file's keys count as given
    assert cfg.option_warnings == [
        f"--config {path} is a --model mlp configuration: its weight-decay = 0.0, epochs = 12 run with --model cnn, "
        "whose own recipe is weight-decay = 0.0005, epochs = 20 (pass those on the command line, or drop them from "
        "the file)"]
    assert parse_config(["--config", path], quiet=True).option_warnings == []  # the file's own model: nothing
    assert parse_config(["--config", path, "--model", "cnn", "--lr", "0.02", "--weight-decay", "5e-4", "--epochs",
                         "20"], quiet=True).option_warnings == []


def test_a_path_that_is_not_utf8_leaves_no_unreadable_configuration_copy(tmp_path):
    """TOML holds UTF-8 only: the copy of a run whose --metrics-file is raw bytes was written and could not be
    read back; now it is not written, with a warning."""
    import os

    from mpisgd.app.run_files import write_config

    metrics = os.fsdecode(os.fsencode(tmp_path) + b"/\xff.jsonl")
    assert write_config(Config(metrics_file=metrics), 1) == [
        "warning: the effective configuration was not written: --metrics-file is not UTF-8 text, which a TOML "
        "file cannot hold"]
    assert list(tmp_path.iterdir()) == []
    assert write_config(Config(metrics_file=str(tmp_path / "m.jsonl")), 1) == []
    assert read_config(str(tmp_path / "m.jsonl.config.toml"))["metrics_file"] == str(tmp_path / "m.jsonl")


@pytest.mark.mpi(min_size=2)
def test_the_configuration_copy_continues_the_run_on_another_k(shared_tmp):
    """The checkpoint directory's config.toml holds the run's B as global-batch, so it continues the run on
    one rank (m = k micro-batches). It set batch-size and accum-steps, and a resume at another k was refused."""
    from mpi4py import MPI

    k, ck = world().Get_size(), shared_tmp / "ck"
    r = train_here([*TINY, "--batch-size", "16", "--max-steps", "4", "--checkpoint-dir", str(ck)])
    assert r.status == 0, r
    alone = train_here(["--config", str(ck / "config.toml"), "--resume", "auto", "--max-steps", "6",
                        "--resume-allow", "max_steps"], comm=MPI.COMM_SELF) if world().Get_rank() == 0 else None
    alone = world().bcast(alone, root=0)
    assert alone.status == 0 and f"now k=1 with the same B={16 * k}" in alone.out, alone

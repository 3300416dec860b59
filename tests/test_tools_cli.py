"""The small tools' hostile inputs: ``python -m mpisgd.sample`` (streamed text, Ctrl-C, a launch of several
ranks, an overflowing temperature, the default prompt), ``python -m mpisgd.evaluate`` (a language model with
image data, options that would be ignored, Ctrl-C under mpiexec). The planner's are in test_plan.py. Bad
input: one line, exit 2; Ctrl-C: one line, exit 130; no traceback, no hang."""

from __future__ import annotations

import importlib
import os
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

import numpy as np
import pytest
from conftest import (
    ONE_THREAD,
    ROOT,
    clean_env,
    launches,
    mpiexec_cmd,
    open_mpi_launcher,
    rank_pids,
    run_mpi,
    serial_only,
)

from mpisgd.app import evaluate, sample

pytestmark = serial_only  # in-process tools of one process, and jobs of their own: the serial pass


def gpt_file(path: Path, chars: str = "abc \n", context: int = 8, width: int = 8, layers: int = 1) -> str:
    """A tiny untrained GPT saved as --save-model does, its vocabulary ``chars`` (no training run needed)."""
    from mpisgd.model_file import save_params
    from mpisgd.nn import build_model

    arch = {"layers": layers, "heads": 1, "width": width, "dropout": 0.0}
    model = build_model("gpt", (context,), len(chars), (), arch=arch).materialize(np, "float32", seed=0)
    vocab = {"size": len(chars), "chars": "".join(sorted(chars))}
    meta = {"format": "mpisgd-model", "version": 1, "model": "gpt", "in_shape": [context], "classes": len(chars),
            "hidden": [], "dtype": "float32", "arch": arch, "data": {"name": "t.txt", "vocab": vocab}}
    return save_params(str(path), model, meta=meta)


def one_line(err: str, prefix: str, says: str) -> None:
    assert err.count("\n") == 1 and err.startswith(prefix) and says in err and "Traceback" not in err, err


@pytest.fixture
def no_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("PMI_SIZE", "PMI_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK"):
        monkeypatch.delenv(name, raising=False)


# -- sample --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("args,says", [
    (["", "--tokens", "3"], "PATH is empty: give a path (an unset shell variable?)"),
    (["/tmp/" + "y" * 300 + ".npz"], "y.npz: File name too long"),  # a traceback before
    (["MODEL", "--tokens", "1000000000000"], "--tokens must be from 0 to 1,000,000, got 1000000000000"),
    (["MODEL", "--tokens", "-1"], "--tokens must be from 0 to 1,000,000"),
    (["NO_NEWLINE", "--tokens", "3"], "the default prompt, a new line, is not in the model's vocabulary of 4 "
                                      "characters (its training text had none): give --prompt TEXT"),
    (["MODEL", "--prompt", "xyz"], "--prompt holds 3 character(s)"),
    (["MODEL", "--top-k", "-1"], "--top-k must be >= 0 (0: every token), got -1"),
])
def test_sample_refuses_in_one_line(tmp_path, capsys, monkeypatch, no_launcher, args, says):
    load = sample.load

    def never_drawn(path, factory=None):  # a refusal comes before the first token (--tokens 1e12 drew forever)
        model, vocab, context = load(path, factory)
        monkeypatch.setattr(model, "forward", lambda x: pytest.fail("a token was drawn"))
        return model, vocab, context

    monkeypatch.setattr(sample, "load", never_drawn)
    paths = {"MODEL": gpt_file(tmp_path / "g.npz"), "NO_NEWLINE": gpt_file(tmp_path / "n.npz", chars="abc ")}
    assert sample.main([paths.get(a, a) for a in args]) == 2
    one_line(capsys.readouterr().err, "mpisgd-sample: error: ", says)


def test_sample_with_a_subnormal_temperature_takes_the_most_likely_token(tmp_path, capsys, no_launcher):
    """--temperature 1e-320: logits / T overflowed to inf and the draw failed on NaN probabilities."""
    model = gpt_file(tmp_path / "g.npz")
    assert sample.main([model, "--prompt", "ab", "--tokens", "12", "--temperature", "0"]) == 0
    greedy = capsys.readouterr().out
    assert sample.main([model, "--prompt", "ab", "--tokens", "12", "--temperature", "1e-320"]) == 0
    assert capsys.readouterr().out == greedy and len(greedy) == 15


def test_top_k_draws_among_the_k_most_likely_tokens_only(tmp_path, capsys, no_launcher):
    """Over many draws: --top-k 3 gives only the three largest logits (the two tied at the third both kept), 0
    or a K of the whole vocabulary every token with the same draws as no --top-k; through the CLI --top-k 1 is
    the greedy text."""
    logits = np.array([0.5, 2.0, -1.0, 1.5, 1.0, 1.0, 0.0])
    def drawn(top_k, seed=0):
        rng = np.random.default_rng(seed)
        return [sample.next_token(logits, 2.0, rng, top_k) for _ in range(3000)]
    assert set(drawn(3)) == {1, 3, 4, 5} and set(drawn(2)) == {1, 3} and set(drawn(1)) == {1}
    assert set(drawn(0)) == set(range(7)) and drawn(0) == drawn(7) == drawn(100)
    model = gpt_file(tmp_path / "g.npz")
    assert sample.main([model, "--prompt", "ab", "--tokens", "12", "--temperature", "0"]) == 0
    greedy = capsys.readouterr().out
    assert sample.main([model, "--prompt", "ab", "--tokens", "12", "--top-k", "1", "--seed", "5"]) == 0
    assert capsys.readouterr().out == greedy


def test_sample_streams_each_token_and_ctrl_c_keeps_what_was_printed(tmp_path, capsys, monkeypatch, no_launcher):
    """Each token is written and flushed as it is drawn (the prompt first); a KeyboardInterrupt is one line and
    130, the text so far kept. Before: nothing until the end, and a traceback."""
    writes: list[str] = []
    monkeypatch.setattr(sys, "stdout", type("Out", (), {"write": lambda self, s: writes.append(s),
                                                        "flush": lambda self: writes.append("<flush>")})())
    load, calls = sample.load, []

    def interrupted_at_the_sixth_token(path, factory=None):
        model, vocab, context = load(path, factory)
        forward = model.forward

        def counted(x):
            calls.append(len(writes))
            if len(calls) == 6:
                raise KeyboardInterrupt
            return forward(x)

        monkeypatch.setattr(model, "forward", counted)
        return model, vocab, context

    monkeypatch.setattr(sample, "load", interrupted_at_the_sixth_token)
    try:
        assert sample.main([gpt_file(tmp_path / "g.npz"), "--prompt", "ab", "--tokens", "1000000"]) == 130
    except KeyboardInterrupt:  # pytest would take it for its own Ctrl-C
        pytest.fail("a KeyboardInterrupt traceback")
    tokens = writes[2:12:2]
    assert calls == [2, 4, 6, 8, 10, 12]  # each token out before the next is drawn
    assert writes == ["ab", "<flush>", *[w for t in tokens for w in (t, "<flush>")], "\n", "<flush>"], writes
    err = capsys.readouterr().err
    assert all(len(t) == 1 for t in tokens) and err == "mpisgd-sample: interrupted (SIGINT) (exit 130)\n", err


@pytest.mark.alone
def test_sample_ctrl_c_to_the_process_is_one_line_and_130(tmp_path):
    model = gpt_file(tmp_path / "g.npz")
    p = subprocess.Popen([sys.executable, "-m", "mpisgd.sample", model, "--prompt", "ab", "--tokens", "1000000"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=clean_env(), cwd=ROOT)
    assert p.stdout is not None
    try:
        seen = _read_within(p.stdout, 40, 60)  # streamed: the prompt and 38 tokens, long before the million
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=60)
    finally:
        p.kill()  # (only a sample that did not stream is still running here)
    assert seen.startswith(b"ab") and len(seen) == 40 and p.returncode == 130, (p.returncode, err)
    assert err.decode() == "mpisgd-sample: interrupted (SIGINT) (exit 130)\n"


def test_sample_into_a_pipe_closed_early_ends_quietly(tmp_path):
    """``mpisgd.sample ... | head -c 5``: the streamed text meets a closed pipe; no BrokenPipeError traceback."""
    model = gpt_file(tmp_path / "g.npz")
    p = subprocess.Popen([sys.executable, "-m", "mpisgd.sample", model, "--prompt", "ab", "--tokens", "1000000"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=clean_env(), cwd=ROOT)
    assert p.stdout is not None and p.stderr is not None
    try:
        seen = _read_within(p.stdout, 5, 60)
        p.stdout.close()
        err = p.stderr.read() if seen else b"nothing streamed"
        code = p.wait(timeout=60)
    finally:
        p.kill()
    assert seen.startswith(b"ab") and code == 0 and err == b"", (seen, err)


def _read_within(stream: IO[bytes], n: int, limit_s: float) -> bytes:
    """Up to ``n`` bytes of ``stream``, what came within ``limit_s``."""
    got = b""
    deadline = time.monotonic() + limit_s
    while len(got) < n and (left := deadline - time.monotonic()) > 0:
        if select.select([stream], [], [], left)[0]:
            chunk = os.read(stream.fileno(), n - len(got))
            if not chunk:
                break
            got += chunk
    return got


def test_sample_refuses_a_launch_of_several_ranks_on_every_rank(tmp_path, capsys, monkeypatch):
    model = gpt_file(tmp_path / "g.npz")
    for size, rank in (("PMI_SIZE", "PMI_RANK"), ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK")):
        monkeypatch.setenv(size, "2")
        monkeypatch.setenv(rank, "1")
        assert sample.main([model, "--tokens", "3"]) == 2
        assert capsys.readouterr() == ("", "")  # rank 1: refuses, says nothing
        monkeypatch.setenv(rank, "0")
        assert sample.main([model, "--tokens", "3"]) == 2
        one_line(capsys.readouterr().err, "mpisgd-sample: error: launched as 2 ranks (mpiexec)", "without mpiexec")
        monkeypatch.delenv(size)
        monkeypatch.delenv(rank)
    assert sample.launched_ranks({"PMI_SIZE": "1", "PMI_RANK": "0"}) == (1, 0)  # mpiexec -n 1: one process
    assert sample.launched_ranks({"PMI_SIZE": "x"}) == (1, 0)


def test_sample_under_mpiexec_prints_nothing_twice(tmp_path):
    r = run_mpi(2, "-m", "mpisgd.sample", gpt_file(tmp_path / "g.npz"), "--tokens", "5", timeout=120)
    assert r.returncode == 2 and r.stdout == "", (r.returncode, r.stdout)
    ours = [line for line in r.stderr.splitlines() if line.startswith("mpisgd-sample:")]
    assert len(ours) == 1 and "launched as 2 ranks" in ours[0] and "Traceback" not in r.stderr, r.stderr


# -- evaluate ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("data,given", [
    ([], "which Fashion-MNIST (no --data) cannot feed"),
    (["--dataset", "synthetic"], "which --dataset synthetic cannot feed"),
    (["--data", "IMAGES"], "images.npz cannot feed"),
])
def test_evaluate_says_a_language_model_needs_sequence_data_before_loading_any(tmp_path, capsys, monkeypatch,
                                                                              data, given):
    """It loaded Fashion-MNIST first, then said "takes samples of shape 16; this data's are 1x28x28"."""
    from mpisgd import data as data_module

    images = tmp_path / "images.npz"
    np.savez(images, x_train=np.zeros((4, 1, 28, 28), np.float32), y_train=np.arange(4) % 2,
             x_test=np.zeros((2, 1, 28, 28), np.float32), y_test=np.arange(2))
    monkeypatch.setattr(data_module, "load_fashion_mnist", lambda *a: pytest.fail("loaded Fashion-MNIST"))
    model = gpt_file(tmp_path / "g.npz")
    assert evaluate.main([model, *[str(images) if a == "IMAGES" else a for a in data]]) == 2
    err = capsys.readouterr().err
    one_line(err, "mpisgd-evaluate: error: ", f"{given}: give --data with a text file or a token .npz")
    assert "g.npz is a language model (--model gpt, a vocabulary of 5), which " in err, err


def test_evaluate_warns_of_options_its_data_ignores(tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text("abc \n" * 400)
    model = gpt_file(tmp_path / "g.npz")
    assert evaluate.main([model, "--data", str(text), "--seed", "5", "--data-dir", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    assert err.splitlines() == [
        "mpisgd-evaluate: warning: --seed has no effect with --data: it seeds --dataset synthetic's test set",
        "mpisgd-evaluate: warning: --data-dir has no effect with --data: it says where Fashion-MNIST's files are"]
    assert "bits/char" in out
    args = evaluate.build_parser().parse_args(["m.npz", "--dataset", "synthetic", "--data-dir", "d", "--seed", "1"])
    assert evaluate.ignored(args) == ["--data-dir has no effect with --dataset synthetic: it says where "
                                      "Fashion-MNIST's files are"]
    assert evaluate.ignored(evaluate.build_parser().parse_args(["m.npz", "--seed", "1"])) == [
        "--seed has no effect with --dataset fashion-mnist: it seeds --dataset synthetic's test set"]


@pytest.mark.parametrize("args,says", [
    (["--seed", "-1", "--dataset", "synthetic"], "--seed must be >= 0, got -1"),  # NumPy's traceback before
    (["--batch-size", "0"], "--batch-size must be >= 1, got 0"),
    (["--limit-test", "-1"], "--limit-test must be >= 1, got -1"),
])
def test_evaluate_refuses_numbers_out_of_range_in_one_line(tmp_path, capsys, args, says):
    assert evaluate.main([gpt_file(tmp_path / "g.npz"), *args]) == 2
    one_line(capsys.readouterr().err, "mpisgd-evaluate: error: ", says)


def test_evaluate_puts_the_signal_mask_back(tmp_path):
    """In-process, main blocks SIGINT only while it runs (its thread takes Ctrl-C meanwhile)."""
    before = signal.pthread_sigmask(signal.SIG_BLOCK, set())
    assert evaluate.main([gpt_file(tmp_path / "g.npz"), "--batch-size", "0"]) == 2
    assert signal.pthread_sigmask(signal.SIG_BLOCK, set()) == before


def _blocks_sigint(pid: int) -> bool:
    """Whether process ``pid``'s main thread blocks SIGINT (evaluate's Interrupts is in place)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    mask = next(line.split()[1] for line in status.splitlines() if line.startswith("SigBlk:"))
    return bool(int(mask, 16) & (1 << (signal.SIGINT - 1)))


def _ranks(tag: str) -> dict[int, int]:
    """{rank: pid} of the live evaluate processes carrying ``tag``."""
    return rank_pids(tag, "mpisgd.evaluate")


def _ready(p: subprocess.Popen, tag: str, k: int = 2) -> dict[int, int]:
    """{rank: pid} once the job's k ranks block SIGINT (evaluate's thread takes it), or 10 s after they started
    (an evaluate that never blocks it: the signal then finds it scoring)."""
    deadline, started = time.monotonic() + 60, None
    while True:
        ranks = _ranks(tag)
        if len(ranks) == k:
            started = started or time.monotonic()
            if all(map(_blocks_sigint, ranks.values())) or time.monotonic() - started > 10:
                return ranks
        if p.poll() is not None or time.monotonic() > deadline:
            p.kill()
            pytest.fail(f"evaluate did not get going (exit {p.returncode}): {p.communicate(timeout=30)}")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def long_evaluation(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """A model and text that take some seconds to score at batch 1 (k = 2)."""
    d = tmp_path_factory.mktemp("long")
    text = d / "long.txt"
    text.write_text("the quick brown fox.\n" * 50_000)
    return gpt_file(d / "g.npz", "".join(sorted(set("the quick brown fox.\n"))), 64, 256, 2), str(text)


@launches
@pytest.mark.alone
@pytest.mark.parametrize("target", ["mpiexec", "rank 1"])
def test_evaluate_ctrl_c_ends_every_rank_with_one_line_and_130(long_evaluation, target):
    """Before: a KeyboardInterrupt traceback on each rank that got it, then MPI_Abort, exit 1."""
    model, text = long_evaluation
    tag = f"evaluate-sigint-{os.getpid()}-{time.monotonic_ns()}"
    env = {**os.environ, **ONE_THREAD, "MPISGD_TEST_TAG": tag, "OMPI_ALLOW_RUN_AS_ROOT": "1",
           "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    p = subprocess.Popen(mpiexec_cmd(2, "-m", "mpisgd.evaluate", model, "--data", text, "--batch-size", "1"),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        ranks = _ready(p, tag)
        t0 = time.monotonic()
        os.kill(p.pid if target == "mpiexec" else ranks[1], signal.SIGINT)
        out, err = p.communicate(timeout=60)
    finally:
        p.kill()  # (only a job that did not end is still running here)
    assert time.monotonic() - t0 < 15 and "Traceback" not in err and "accuracy" not in out, (out, err[-2000:])
    if target == "mpiexec" and open_mpi_launcher():  # Open MPI: SIGTERM to the ranks, SIGKILL 1 s later, exit 1
        assert p.returncode == 1, (p.returncode, err[-2000:])
    else:
        assert p.returncode == 130, (p.returncode, err[-2000:])
        ours = [line for line in err.splitlines() if line.startswith("mpisgd")]
        rank = 0 if target == "mpiexec" else 1
        assert ours == [f"mpisgd: interrupted (SIGINT) on rank {rank}: ending the job (exit 130)"], err[-2000:]
    deadline = time.monotonic() + 5
    while _ranks(tag) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _ranks(tag), "ranks still running after mpiexec returned"


@pytest.mark.parametrize("command", ["train", "evaluate", "plan", "sample", "plot"])
def test_every_command_says_its_version_and_its_libraries(command):
    """--version: one line on standard output, exit 0, the version setup.py installs (one version, not two)
    and NumPy's; under mpiexec the training command says it once."""
    import re

    import mpisgd

    declared = re.search(r'version="([^"]+)"', (ROOT / "setup.py").read_text())
    assert declared and declared.group(1) == mpisgd.__version__
    r = subprocess.run([sys.executable, "-m", f"mpisgd.{command}", "--version"], capture_output=True, text=True,
                       timeout=60, env=clean_env(), cwd=ROOT)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert r.stdout.startswith(f"mpisgd {mpisgd.__version__} (Python ") and f"numpy {np.__version__}" in r.stdout
    assert r.stdout.count("\n") == 1, r.stdout
    if command == "train":
        r = run_mpi(2, "-m", "mpisgd.train", "--version", timeout=60)
        assert r.returncode == 0 and r.stdout.count(f"mpisgd {mpisgd.__version__} ") == 1, r.stdout + r.stderr


@pytest.mark.parametrize("tool", ["train", "evaluate", "plan", "sample", "plot"])
def test_every_python_m_tool_has_its_console_script_running_the_same_main(tool):
    """``pip install`` gives ``mpisgd-TOOL`` for each ``python -m mpisgd.TOOL``, and both run the same ``main``
    (read from setup.py: an installed script may be older)."""
    declared = dict(re.findall(r'"(mpisgd-\w+)=([\w.:]+)"', (ROOT / "setup.py").read_text()))
    assert f"mpisgd-{tool}" in declared, sorted(declared)
    module, function = declared[f"mpisgd-{tool}"].split(":")
    assert getattr(importlib.import_module(module), function) is importlib.import_module(f"mpisgd.{tool}").main

"""Sequence data (mpisgd.text) and --model gpt through the CLI: windows and splits, the checks with their
one-line errors, the vocabulary kept with the run and checked on resume, evaluation and sampling."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import drop, run_mpi, serial_only, train_here

from mpisgd.data import BatchLoader, DataError, GlobalBatches
from mpisgd.text import TEST_FRACTION, Vocabulary, check_same_vocabulary, load_tokens, read_stream, windows

TEXT = ("In the beginning God created the heaven and the earth. And the earth was without form, and void; "
        "and darkness was upon the face of the deep.\n") * 40  # 5,640 characters, 28 distinct


def write(tmp_path: Path, text: str = TEXT, name: str = "t.txt") -> str:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return str(path)


def test_the_vocabulary_is_the_sorted_characters_and_round_trips(tmp_path):
    stream, vocab, _ = read_stream(write(tmp_path))
    assert vocab.chars == "".join(sorted(set(TEXT))) and vocab.size == len(set(TEXT))
    assert stream.dtype == np.uint8 and len(stream) == len(TEXT)
    assert vocab.decode(stream) == TEXT
    np.testing.assert_array_equal(vocab.encode(TEXT, "x"), stream)


def test_windows_are_next_token_targets_at_fixed_offsets():
    stream = np.arange(23, dtype=np.uint8)
    d = windows(stream, 5)
    assert len(d) == 4 and d.tokens  # (23 - 1) // 5
    np.testing.assert_array_equal(d.images[2], stream[10:15])
    np.testing.assert_array_equal(d.labels[2], stream[11:16])
    assert not d.images.flags.writeable and np.shares_memory(d.images, stream)  # views, no copy


def test_splits_are_contiguous_in_order_and_the_batch_loader_gives_int64(tmp_path):
    d = load_tokens(write(tmp_path), context=16, val_fraction=0.1)
    stream, _, _ = read_stream(write(tmp_path))
    n = len(stream)
    n_test, n_val = round(TEST_FRACTION * n), round(0.1 * n)
    n_train = n - n_val - n_test
    assert (len(d.train), len(d.val), len(d.test)) == ((n_train - 1) // 16, (n_val - 1) // 16, (n_test - 1) // 16)
    np.testing.assert_array_equal(d.val.images[0], stream[n_train:n_train + 16])
    np.testing.assert_array_equal(d.test.labels[-1][-1:], stream[n - n_test + 16 * len(d.test):][:1])
    loader = BatchLoader(d.train, np, "float32")
    x, y = loader.batch(np.array([3, 0]))
    assert x.dtype == np.int64 and y.dtype == np.int64 and x.shape == y.shape == (2, 16)
    np.testing.assert_array_equal(x[0], stream[48:64])
    np.testing.assert_array_equal(y[0], stream[49:65])
    assert d.identity["vocab"]["chars"] == "".join(sorted(set(TEXT))) and d.identity["context"] == 16


def test_a_window_is_the_same_sample_at_any_k(tmp_path):
    """The windows do not depend on k, and the global batches deal them alike: k ranks' shares of a step
    are one rank's batch (the sample ids Dropout keys its masks by)."""
    d = load_tokens(write(tmp_path), context=16, val_fraction=0.1)
    perm = np.random.default_rng(0).permutation(len(d.train))
    one = GlobalBatches(len(d.train), 12, 0, 1).indices(perm, 2, 0)
    three = np.concatenate([GlobalBatches(len(d.train), 12, r, 3).indices(perm, 2, 0) for r in range(3)])
    np.testing.assert_array_equal(one, three)


@pytest.mark.parametrize("case,says", [
    ("empty", "is empty: a language model needs text to train on"),
    ("latin-1", "is not UTF-8 text: byte 0xe9 at offset 3 (invalid continuation byte)"),
    ("short", "--context 64 needs 65 tokens in each part of the data; the test part"),
    ("npz without tokens", "an .npz of tokens needs 'tokens' (it holds ids)"),
    ("negative ids", "token ids must be >= 0; token 1 is -3"),
    ("2-D tokens", "'tokens' must be a 1-D array of integer ids"),
    ("id past vocab_size", "token 2 is 9, not below vocab_size, 5"),
    ("id past vocab", "token 2 is 9, not below the number of characters 'vocab' lists, 2"),
    ("one character", "holds one distinct character ('a', 600 times): a language model needs at least two"),
    ("fractional vocab_size", "'vocab_size' must be one integer, got float64 65.5"),  # was cut to 65
    ("vocab_size list", "'vocab_size' must be one integer, got int64 [5, 6]"),
])
def test_bad_sequence_data_is_one_line(tmp_path, case, says):
    path = tmp_path / "d"
    if case == "empty":
        path.write_bytes(b"")
    elif case == "latin-1":
        path.write_bytes("Café au lait".encode("latin-1"))
    elif case == "short":
        path.write_text("xy" * 300)
    elif case == "one character":  # trained a one-token model to loss 0
        path.write_text("a" * 600)
    else:
        arrays = {"npz without tokens": {"ids": np.arange(5)}, "negative ids": {"tokens": np.array([1, -3, 2])},
                  "2-D tokens": {"tokens": np.zeros((3, 3), np.int64)},
                  "id past vocab_size": {"tokens": np.array([1, 2, 9]), "vocab_size": np.array(5)},
                  "id past vocab": {"tokens": np.array([1, 0, 9]), "vocab": np.array("ab")},
                  "fractional vocab_size": {"tokens": np.array([1, 2]), "vocab_size": np.array(65.5)},
                  "vocab_size list": {"tokens": np.array([1, 2]), "vocab_size": np.array([5, 6])}}[case]
        path = tmp_path / "d.npz"
        np.savez(path, **arrays)
    with pytest.raises(DataError) as err:
        load_tokens(str(path), context=64, val_fraction=0.0)
    assert says in str(err.value) and "\n" not in str(err.value), err.value


@pytest.mark.parametrize("val_fraction", [0.95, 0.99])
def test_a_validation_share_that_leaves_no_training_text_is_one_line(tmp_path, val_fraction):
    """--val-split 0.99 said the training part "has -1,200" tokens."""
    path = tmp_path / "t.txt"
    path.write_text("xy" * 3000)
    with pytest.raises(DataError) as err:
        load_tokens(str(path), context=8, val_fraction=val_fraction)
    says = str(err.value)
    assert f"--val-split {val_fraction:g} and the test part (the last 5%) take all 6,000 tokens" in says, says
    assert "below 0.95" in says and "has -" not in says and "\n" not in says


def test_an_npz_of_tokens_with_its_characters(tmp_path):
    stream, vocab, _ = read_stream(write(tmp_path))
    path = tmp_path / "tokens.npz"
    np.savez(path, tokens=stream.astype(np.int32), vocab=np.array(vocab.chars))
    d = load_tokens(str(path), context=16, val_fraction=0.0)
    assert d.vocab == vocab and d.val is None
    np.testing.assert_array_equal(d.train.images[1], stream[16:32])


def test_a_different_vocabulary_is_refused_and_the_same_is_not(tmp_path):
    a = load_tokens(write(tmp_path), 16, 0.0).identity
    b = load_tokens(write(tmp_path, TEXT + "Zebra!", "u.txt"), 16, 0.0).identity
    check_same_vocabulary(a, dict(a), "the checkpoint")
    with pytest.raises(DataError, match=r"is not the checkpoint's .*this data adds '!Z'"):
        check_same_vocabulary(a, b, "the checkpoint")
    with pytest.raises(DataError, match=r"lacks: 'é' \(the first at character 2\)"):
        Vocabulary(3, "abc").encode("abé", "--prompt")


# -- the CLI: a tiny GPT on a few KB of text, at k = 1 --------------------------------------------------------
TINY = ("--model", "gpt", "--gpt-layers", "2", "--gpt-width", "32", "--gpt-heads", "2", "--context", "32",
        "--batch-size", "16", "--warmup-steps", "2", "--progress", "off", "--lr", "3e-3")


def train(tmp_path: Path, *extra: str, data: str | None = None) -> tuple:
    data = data or write(tmp_path)
    return run_mpi(1, "-m", "mpisgd.train", *TINY, "--data", data, *extra)


@serial_only  # one rank's run, in this process
def test_a_run_shorter_than_the_recipes_warmup_warms_up_over_all_of_it(tmp_path):
    """--model gpt --max-steps 2: the recipe's 100 warmup steps are longer than the run. It was refused
    ("shorten --warmup-steps", which the user never gave); now the warmup takes the run, with a warning. A
    warmup of one's own longer than the run is still refused."""
    run = [*drop(TINY, "--warmup-steps"), "--data", write(tmp_path), "--max-steps", "2"]
    r = train_here(run)
    assert r.status == 0, r
    assert "warning: --model gpt's recipe warms up for longer (--warmup-steps 100) than this run of 2 step(s): " \
        "the warmup takes the whole run" in r.out, r.out
    r = train_here([*run, "--warmup-steps", "5"])
    assert r.status == 2 and "warmup of 5 steps is longer than the run (2 steps)" in r.error, r


def test_gpt_trains_through_the_cli_and_samples(tmp_path):
    model, metrics, ckpt = tmp_path / "m.npz", tmp_path / "m.jsonl", tmp_path / "ckpt"
    r = train(tmp_path, "--max-steps", "12", "--save-model", str(model), "--metrics-file", str(metrics),
              "--checkpoint-dir", str(ckpt))
    assert r.returncode == 0, r.stderr + r.stdout
    assert "windows of 32 tokens, a vocabulary of 28 chars" in r.stdout
    assert "bits/char" in r.stdout and "final test loss" in r.stdout, r.stdout
    epochs = [json.loads(line) for line in metrics.read_text().splitlines() if '"epoch"' in line]
    last = [e for e in epochs if e["kind"] == "epoch"][-1]
    assert last["val_loss"] < np.log(28)  # it learned something: below the uniform guess
    assert last["val_bits_per_token"] == pytest.approx(last["val_loss"] / np.log(2))
    assert last["tokens_per_s"] == pytest.approx(last["samples_per_s"] * 32)
    vocab = json.loads(Path(f"{metrics}.vocab.json").read_text())
    assert vocab == json.loads((ckpt / "vocab.json").read_text()) == {"size": 28, "chars": "".join(sorted(set(TEXT)))}

    from mpisgd.app.sample import main as sample

    for path in (model, ckpt):  # the saved model and the checkpoint directory
        assert sample([str(path), "--prompt", "And the", "--tokens", "20", "--seed", "1"]) == 0
    from mpisgd.app.sample import generate, load

    m, v, context = load(str(model))
    out = generate(m, v.encode("And the", "p"), 20, context, 1.0, np.random.default_rng(1))
    again = generate(m, v.encode("And the", "p"), 20, context, 1.0, np.random.default_rng(1))
    np.testing.assert_array_equal(out, again)  # the same seed: the same text
    assert len(out) == 27 and v.decode(out).startswith("And the")


def test_sampling_refuses_a_prompt_outside_the_vocabulary(tmp_path, capsys):
    model = tmp_path / "m.npz"
    assert train(tmp_path, "--max-steps", "2", "--save-model", str(model)).returncode == 0
    from mpisgd.app.sample import main as sample

    assert sample([str(model), "--prompt", "Zürich", "--tokens", "5"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "mpisgd-sample: error: --prompt holds" in err and "'Zü'" in err, err


def test_resuming_on_another_vocabulary_is_refused_in_one_line(tmp_path):
    ckpt = tmp_path / "ckpt"
    assert train(tmp_path, "--max-steps", "2", "--checkpoint-dir", str(ckpt)).returncode == 0
    other = write(tmp_path, TEXT.replace("void", "VOID"), "other.txt")
    r = train(tmp_path, "--max-steps", "4", "--checkpoint-dir", str(ckpt), "--resume", "auto", data=other)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "mpisgd: error:" in r.stderr and "this data adds 'DOV'" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_gpt_needs_sequence_data_and_token_data_needs_gpt(tmp_path):
    r = run_mpi(1, "-m", "mpisgd.train", *TINY, "--dataset", "synthetic", "--max-steps", "1")
    assert r.returncode == 2 and "--model gpt reads sequence data" in r.stderr, r.stderr
    r = run_mpi(1, "-m", "mpisgd.train", *TINY, "--data", str(tmp_path / "nowhere.txt"), "--max-steps", "1")
    assert r.returncode == 2 and "nowhere.txt: no such file or directory" in r.stderr, r.stderr
    tokens = tmp_path / "tokens.npz"
    np.savez(tokens, tokens=np.arange(4000) % 7)
    r = run_mpi(1, "-m", "mpisgd.train", "--model", "resnet", "--data", str(tokens), "--max-steps", "1",
                "--progress", "off")  # one rule for the image models (it said: use --model mlp)
    assert r.returncode == 2 and "which --model resnet cannot read: use --model gpt or a language model of your own" \
        in r.stderr, r.stderr


def test_evaluate_scores_the_test_part_in_the_models_vocabulary(tmp_path, capsys):
    model = tmp_path / "m.npz"
    data = write(tmp_path)
    assert train(tmp_path, "--max-steps", "3", "--save-model", str(model), data=data).returncode == 0
    from mpisgd.app.evaluate import main as evaluate

    assert evaluate([str(model), "--data", data]) == 0
    out = capsys.readouterr().out
    assert "bits/char | token accuracy" in out, out
    assert evaluate([str(model), "--data", write(tmp_path, TEXT + "Q", "q.txt")]) == 2
    assert "lacks: 'Q'" in capsys.readouterr().err


# -- data parallelism: the same bits at any k, resumed on another k -------------------------------------
PARALLEL = ("--batch-size", "4", "--global-batch", "24", "--epochs", "2", "--max-steps", "8", "--warmup-steps", "0",
            "--dropout", "0.1", "--noise-scale-every", "1")


def gpt_params(tmp_path: Path, k: int, tag: str, *extra: str, env: dict | None = None,
               status: int = 0) -> np.ndarray | None:
    out = tmp_path / f"{tag}-k{k}.npz"
    r = run_mpi(k, "-m", "mpisgd.train", *TINY, "--data", write(tmp_path), *PARALLEL, "--save-model", str(out),
                *extra, env=env, timeout=300)
    assert r.returncode == status, r.stderr[-3000:] + r.stdout
    return np.load(out)["flat"] if status == 0 else None


def test_a_reproducible_gpt_has_the_same_bits_at_k_1_2_3_and_resumed_on_another_k(tmp_path):
    """Attention, LayerNorm, GELU, Dropout (keyed by window) and the per-position loss, AdamW with decay on
    matrices: k = 1, 2, 3 end with the same parameters; a k = 2 run stopped after its checkpoint at step 4
    and resumed at k = 3 ends there too; the noise scale is measured per token at k >= 2. Control: without
    --reproducible, k = 1 and 3 differ."""
    runs = {k: gpt_params(tmp_path, k, "rep", "--reproducible", "--metrics-file", str(tmp_path / f"m{k}.jsonl"))
            for k in (1, 2, 3)}
    assert all(np.array_equal(runs[1], runs[k]) for k in (2, 3))
    ck = str(tmp_path / "ck")
    gpt_params(tmp_path, 2, "stopped", "--reproducible", "--checkpoint-dir", ck, "--checkpoint-every", "4",
               env={"MPISGD_FAIL_AT_STEP": "6"}, status=1)
    resumed = gpt_params(tmp_path, 3, "resumed", "--reproducible", "--checkpoint-dir", ck, "--checkpoint-every", "4",
                         "--resume", "auto")
    np.testing.assert_array_equal(resumed, runs[1])
    epochs = [json.loads(line) for line in (tmp_path / "m2.jsonl").read_text().splitlines() if '"epoch"' in line]
    last = [e for e in epochs if e.get("kind") == "epoch"][-1]
    assert last["noise_scale"] is not None and last["noise_scale"] > 0
    plain = [gpt_params(tmp_path, k, "plain") for k in (1, 3)]
    assert not np.array_equal(*plain)

"""Score a trained model: ``python -m mpisgd.evaluate PATH [data options]`` (or ``mpisgd-evaluate``).

PATH is a ``--save-model`` file, a checkpoint, or a checkpoint directory (its newest good checkpoint).
The data options are the training command's (``--data``, ``--data-dir``, ``--dataset``, ``--limit-test``,
``--seed`` for the synthetic set); the test set is scored. It prints the accuracy, the mean loss and a
table per class. On one process as it is; under ``mpiexec -n K`` every rank first checks that all hold
the same model and test set, then each scores 1/K of the samples and the counts are summed. Bad input:
one line from rank 0, exit 2; an option the data given makes useless (``--seed`` without ``--dataset
synthetic``, ``--data-dir`` with ``--data`` or ``--dataset synthetic``): a warning from rank 0. The file runs
no code: a model of the user's own is built only by the factory ``--model-factory`` names. Every check
across ranks and the sum are watched by the stall watchdog (docs/failures.md). Ctrl-C (SIGINT to mpiexec or
to any rank) ends every rank at once with one line and exit 130, as the training command does
(mpisgd.app.signals).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import signal
import sys
import threading
from typing import Any

import numpy as np

from mpisgd.app.options import _add_option, _Parser, add_version
from mpisgd.config import Config
from mpisgd.errors import ModelOutputError, UsageError
from mpisgd.model_file import ModelFileError
from mpisgd.nn import scoring

FASHION_CLASSES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag",
                   "Ankle boot")
DATA_OPTIONS = ("dataset", "data", "data_dir", "limit_test")
STALL_TIMEOUT_S, STALL_ABORT_S = 300.0, 1800.0  # the training command's defaults


def build_parser(quiet: bool = False) -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m mpisgd.evaluate", quiet=quiet, allow_abbrev=False,
                     description="Accuracy and a per-class table of a trained model on a test set.")
    parser.add_argument("path", metavar="PATH", help="a --save-model .npz, a checkpoint, or a checkpoint directory")
    fields = {f.name: f for f in dataclasses.fields(Config)}
    for name in DATA_OPTIONS:  # the training command's own options, help and defaults
        _add_option(parser, fields[name])
    parser.add_argument("--seed", type=int, default=None, help="--dataset synthetic: the seed its test set is made "
                        "from (default: the seed the model was trained with)")
    parser.add_argument("--batch-size", type=int, default=256, help="samples per forward pass (default: 256)")
    parser.add_argument("--model-factory", metavar="PACKAGE.MODULE:FUNCTION", default=None,
                        help="build a model of your own (a file whose model is package.module:function, PyTorch's "
                        "included) with this factory; it is imported and run, so name only code you trust (a file "
                        "never runs code by itself)")
    add_version(parser)
    return parser


def load_test_set(args: argparse.Namespace, seed: int = 0) -> tuple[Any, str, str, int]:
    """(test set, its name, where it came from, its classes) as the training command would load it."""
    from mpisgd import data  # noqa: PLC0415

    if args.dataset == "synthetic":
        test, name, source = data.synthetic(2000, seed, split=1), "synthetic", "synthetic"
        if args.limit_test:
            test = test.head(args.limit_test)
        classes = data.validate(test, test)
    else:
        train, test, name, source = data.load_data(args.data, args.data_dir)
        if args.limit_test:
            test = test.head(args.limit_test)
        classes = data.validate(train, test)
    return test, name, source, classes


def check_fit(meta: dict[str, Any], test: Any, name: str, classes: int, path: str) -> list[str]:
    """UsageError where the model cannot score these samples; warnings where it can but may not fit."""
    shape = tuple(test.images.shape[1:])
    want = tuple(meta["in_shape"])
    if shape != want and not (len(want) == 1 and int(np.prod(shape)) == want[0]):
        raise UsageError(f"{path} takes samples of shape {'x'.join(map(str, want))}; this data's are "
                         f"{'x'.join(map(str, shape))}")
    if classes > int(meta["classes"]):
        raise UsageError(f"{path} scores {meta['classes']} classes; this data has labels up to {classes - 1}")
    warnings = []
    trained = (meta.get("data") or {}).get("name")
    if trained and trained != name:
        warnings.append(f"warning: the model was trained on {trained}; this is {name}")
    scale, shift = meta.get("input_scale"), meta.get("input_shift")
    if scale is not None and shift is not None and (not np.isclose(scale, test.scale)
                                                    or not np.isclose(shift, test.shift)):
        warnings.append(f"warning: the model was trained on inputs scaled as x * {scale:.4g} + {shift:.4g}, these "
                        f"are scaled as x * {test.scale:.4g} + {test.shift:.4g}: pass the data options it was "
                        "trained with")
    return warnings


def score(model: Any, test: Any, n_classes: int, batch: int, rank: int, size: int) -> np.ndarray:
    """Per class: [samples, correct, summed loss] over this rank's share of the test set (eval mode)."""
    from mpisgd.data import BatchLoader  # noqa: PLC0415

    loader = BatchLoader(test, np, model.flat.dtype)
    mine = np.array_split(np.arange(len(test)), size)[rank]
    batches = (loader.batch(mine[start:start + batch]) for start in range(0, len(mine), batch))
    counts = scoring.score(model, batches, n_classes).per_class
    assert counts is not None
    return counts


def table(counts: np.ndarray, names: tuple[str, ...] | None) -> list[str]:
    n, right, loss = counts.sum(axis=0)
    lines = [f"accuracy {right / n:.4f} ({int(right):,} of {int(n):,}) | mean loss {loss / n:.4f}", "",
             f"{'class':>5}  {'name':<12}  {'samples':>7}  {'correct':>7}  {'accuracy':>8}"]
    for c, (samples, ok, _) in enumerate(counts):
        name = names[c] if names and c < len(names) else ""
        acc = f"{ok / samples:.4f}" if samples else "-"
        lines.append(f"{c:>5}  {name:<12}  {int(samples):>7,}  {int(ok):>7,}  {acc:>8}")
    return lines


class Interrupts:
    """Ctrl-C as the training command takes it (mpisgd.app.signals): SIGINT is blocked in every thread (MPI's
    too: create this before MPI starts), and a thread of ours waits for it, then prints one line and ends the
    whole job (MPI_Abort, exit 130), so that no rank is left waiting in a collective and no rank prints a
    traceback. SIGTERM keeps its default. :meth:`close` stops the thread and puts the signal mask back."""

    POLL_S = 0.2

    def __init__(self) -> None:
        self._mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, comm: Any) -> None:
        from mpisgd.app.signals import Signals  # noqa: PLC0415

        signals = Signals()
        signals.comm = comm
        self._thread = threading.Thread(target=self._watch, args=(signals,), name="mpisgd-evaluate-sigint",
                                        daemon=True)
        self._thread.start()

    def _watch(self, signals: Any) -> None:
        while not self._closed.is_set():
            if signal.sigtimedwait({signal.SIGINT}, self.POLL_S) is not None and not self._closed.is_set():
                signals.on_signal(signal.SIGINT)  # one line, MPI_Abort(130): the process ends there

    def close(self) -> None:
        self._closed.set()
        if self._thread is not None:
            if self._thread.ident is not None and self._thread.is_alive():
                with contextlib.suppress(OSError):  # it ended just now: nothing to wake
                    signal.pthread_kill(self._thread.ident, signal.SIGINT)  # wakes its wait now, not at the next poll
            self._thread.join()
        signal.pthread_sigmask(signal.SIG_SETMASK, self._mask)


def main(argv: list[str] | None = None) -> int:
    interrupts = Interrupts()  # before MPI starts its threads: they inherit the mask
    from mpi4py import MPI  # noqa: PLC0415

    from mpisgd.abort import guard  # noqa: PLC0415

    comm = MPI.COMM_WORLD
    interrupts.start(comm)
    try:
        with guard(comm):  # anything else that fails on one rank ends the job, rather than a wait in a collective
            return _main(argv, comm)
    finally:
        interrupts.close()


def _main(argv: list[str] | None, comm: Any) -> int:
    from mpi4py import MPI  # noqa: PLC0415

    from mpisgd.agreement import AgreedError, agree  # noqa: PLC0415
    from mpisgd.watchdog import default_watchdog  # noqa: PLC0415

    rank, size = comm.Get_rank(), comm.Get_size()
    # from the first collective on: a rank stuck reading its model or data is named, and the job ends
    watchdog = default_watchdog(comm, STALL_TIMEOUT_S, STALL_ABORT_S)

    def agreed(what: str, fn: Any) -> Any:
        error, result = None, None
        try:
            result = fn()
        except UsageError as exc:
            error = exc
        with watchdog.watching(f"evaluate: {what}"):
            agree(comm, error)
        return result

    try:
        args = agreed("the options", lambda: build_parser(quiet=rank != 0).parse_args(argv))
        if rank == 0:
            for line in ignored(args):
                print(f"mpisgd-evaluate: warning: {line}", file=sys.stderr, flush=True)
        saved, test, name, source, classes, warnings = agreed("the model and the data", lambda: _prepare(args))
        with watchdog.watching("evaluate: the same model and data on every rank"):
            every = comm.allgather(_identity(saved, test, name))
        agreed("the same model and data on every rank", lambda: _same_everywhere(every))
    except SystemExit as exc:  # --help, on every rank
        watchdog.close()
        return int(exc.code or 0)
    except AgreedError as exc:
        watchdog.close()
        if rank == 0:
            print(f"mpisgd-evaluate: error: {exc}", file=sys.stderr, flush=True)
        return exc.exit_code
    n_classes = int(saved.meta["classes"])
    counts = score(saved.model, test, n_classes, args.batch_size, rank, size)
    with watchdog.watching("evaluate: adding the counts"):
        comm.Allreduce(MPI.IN_PLACE, counts, op=MPI.SUM)
    watchdog.close()
    if rank == 0 and test.tokens:  # a language model: loss per token, not a table of its characters
        n, right, loss = counts.sum(axis=0)
        unit = "char" if (saved.meta.get("data") or {}).get("vocab", {}).get("chars") else "token"
        print(f"model: {saved.path} | {saved.meta['model']}, {saved.model.flat.size:,} parameters "
              f"{saved.meta.get('dtype')}, context {saved.meta['in_shape'][0]}, vocabulary {n_classes}")
        print(f"data: {source} | the test part: {len(test):,} windows, {int(n):,} tokens")
        print(f"loss {loss / n:.4f} nats/{unit} = {loss / n / np.log(2):.4f} bits/{unit} | token accuracy "
              f"{right / n:.4f} ({int(right):,} of {int(n):,})")
    elif rank == 0:
        meta = saved.meta
        trained = meta.get("data") or {}
        step = f", step {meta['step']}" if "step" in meta else ""
        print(f"model: {saved.path} | {meta['model']}, {saved.model.flat.size:,} parameters {meta.get('dtype')}"
              f" | trained on {trained.get('name', '?')} ({trained.get('n_train', '?')} train){step}")
        print(f"data: {source} | {len(test):,} test samples "
              f"{'x'.join(map(str, test.images.shape[1:]))} {test.images.dtype}, {classes} classes"
              + (f" | {size} ranks" if size > 1 else ""))
        for line in warnings:
            print(line)
        for line in table(counts, FASHION_CLASSES if name == "fashion-mnist" and n_classes == 10 else None):
            print(line)
    return 0


def _identity(saved: Any, test: Any, name: str) -> dict[str, str]:
    """What this rank scores, in a few comparable fields: the model (its description and a digest of its
    parameters) and the test set (its name, size and fingerprint)."""
    import hashlib  # noqa: PLC0415

    from mpisgd.data import identity  # noqa: PLC0415

    params = hashlib.blake2b(np.ascontiguousarray(saved.model.flat.params).tobytes(), digest_size=8).hexdigest()
    data = identity(name, test, test)
    return {"model": f"{saved.meta['model']}, {saved.meta['classes']} classes, parameters {params}",
            "test set": f"{name}, {data['n_test']} samples, fingerprint {data['fingerprint']}"}


def _same_everywhere(every: list[dict[str, str]]) -> None:
    """UsageError when the ranks would score different models or test sets (another file, other data options
    or --limit-test on some rank): their counts would be summed into one meaningless table."""
    from mpisgd.agreement import name_differences  # noqa: PLC0415

    diffs = name_differences(every)
    if diffs:
        raise UsageError("the ranks would score different things (" + "; ".join(diffs) + "): give every rank the "
                         "same model file and data options")


def ignored(args: argparse.Namespace) -> list[str]:
    """The options given that the data options make useless: each one line (a warning; the scoring goes on)."""
    lines = []
    synthetic = args.dataset == "synthetic"
    if args.seed is not None and not synthetic:
        source = "--data" if args.data is not None else f"--dataset {args.dataset}"
        lines.append(f"--seed has no effect with {source}: it seeds --dataset synthetic's test set")
    if args.data_dir is not None and (args.data is not None or synthetic):
        lines.append(f"--data-dir has no effect with {'--data' if args.data is not None else '--dataset synthetic'}"
                     ": it says where Fashion-MNIST's files are")
    return lines


def _prepare(args: argparse.Namespace) -> tuple[Any, ...]:
    for what, value in (("PATH", args.path), ("--data", args.data), ("--data-dir", args.data_dir),
                        ("--model-factory", args.model_factory)):
        if value is not None and not value.strip():  # an unset shell variable: never the default data instead
            raise UsageError(f"{what} is empty: give a path (an unset shell variable?)")
    if args.batch_size < 1:
        raise UsageError(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.limit_test is not None and args.limit_test < 1:
        raise UsageError(f"--limit-test must be >= 1, got {args.limit_test}")
    if args.seed is not None and args.seed < 0:
        raise UsageError(f"--seed must be >= 0, got {args.seed}")
    if args.data and args.dataset == "synthetic":
        raise UsageError("--data and --dataset synthetic: choose one")
    language = _language_model(args)
    if language is not None:
        return language
    saved = _read_before_data(args)
    if args.dataset == "synthetic":  # its samples depend on the seed: the model's own, unless given
        saved = saved or _read(args, in_shape=(1, 28, 28))
        seed = args.seed if args.seed is not None else int(saved.meta.get("seed", 0))
        test, name, source, classes = load_test_set(args, seed)
    else:
        test, name, source, classes = load_test_set(args)
        saved = saved or _read(args, in_shape=tuple(test.images.shape[1:]))
    warnings = check_fit(saved.meta, test, name, classes, saved.path)
    if args.model_factory is not None:
        _check_scores(saved, test, args.model_factory)
    return saved, test, name, source, classes, warnings


def _read_before_data(args: argparse.Namespace) -> Any:
    """PATH's model, read before the (image) data is loaded, where the file says its input shape; None where it
    does not (an older file: read once the data gives the shape, which reports any other fault then too).
    UsageError for a language model: it scores sequence data, not these images (said before loading them)."""
    from mpisgd.text import Vocabulary  # noqa: PLC0415

    try:
        saved = _read(args)
    except ModelFileError:
        return None
    vocab = Vocabulary.from_identity(saved.meta.get("data") or {})
    if saved.meta.get("model") == "gpt" or vocab is not None:
        given = (f"--data {args.data}" if args.data is not None else
                 "--dataset synthetic" if args.dataset == "synthetic" else "Fashion-MNIST (no --data)")
        raise UsageError(f"{saved.path} is a language model (--model {saved.meta.get('model')}"
                         + (f", a vocabulary of {vocab.size}" if vocab else "") + f"), which {given} cannot feed: "
                         "give --data with a text file or a token .npz (docs/data.md)")
    return saved


def _read(args: argparse.Namespace, in_shape: tuple[int, ...] | None = None) -> Any:
    """PATH's model, built by --model-factory where it is one of your own (:func:`read_with_factory`)."""
    return read_with_factory(args.path, args.model_factory, in_shape)


def read_with_factory(path: str, factory: str | None, in_shape: tuple[int, ...] | None = None) -> Any:
    """The model file's model, built by ``factory`` (--model-factory) where it is one of your own. UsageError
    when the factory is given for a file of one of mpisgd's own models: those are built by mpisgd's builders,
    and the factory would be ignored without a word."""
    from mpisgd.model_file import read_model  # noqa: PLC0415
    from mpisgd.nn.models import STOCK  # noqa: PLC0415

    saved = read_model(path, in_shape=in_shape, factory=factory)
    if factory is not None and saved.meta["model"] in STOCK:
        raise UsageError(f"{saved.path} holds mpisgd's own {saved.meta['model']} model, which needs no factory: "
                         f"drop --model-factory {factory} (it builds a model of your own, a PyTorch "
                         "module or an mpisgd.nn one)")
    return saved


def _check_scores(saved: Any, test: Any, factory: str) -> None:
    """The model --model-factory built, on two test samples as scoring gives them (eval mode): it must give one
    score per class. UsageError otherwise, with the user's module's error in one line (a forward that returns a
    tuple or a dict, not one tensor of scores), as the training command refuses it."""
    from mpisgd.data import BatchLoader  # noqa: PLC0415
    from mpisgd.nn.models import gives  # noqa: PLC0415

    x, _ = BatchLoader(test, np, saved.model.flat.dtype).batch(np.arange(min(2, len(test))))
    built = f"{saved.path}: the model --model-factory {factory} builds"
    try:
        out = saved.model.forward(x)
    except ModelOutputError as exc:  # a tuple or a dict: the message says it all, as the training command's does
        raise UsageError(f"{built} cannot score: {exc}") from None
    except Exception as exc:  # the user's code: say whose error it is, in one line
        raise UsageError(f"{built} cannot score samples of shape {'x'.join(map(str, x.shape[1:]))} "
                         f"({type(exc).__name__}: {exc})") from None
    n, classes = len(x), int(saved.meta["classes"])
    if tuple(out.shape) != (n, classes):
        raise UsageError(f"{built} {gives(tuple(out.shape), n)}; the file's model scores {classes} classes, so it "
                         "must give one score per class")


def _language_model(args: argparse.Namespace) -> tuple[Any, ...] | None:
    """A language model on sequence data: the test part of ``--data`` in the model's vocabulary and
    context (DataError where the text holds a character the model does not know); None when the data or
    the model is not one (the image path says what is wrong then)."""
    from mpisgd import text  # noqa: PLC0415

    if not text.is_token_data(args.data, text=True):
        return None
    saved = _read(args)
    vocab = text.Vocabulary.from_identity(saved.meta.get("data") or {})
    if vocab is None:
        return None
    d = text.load_tokens(args.data, int(saved.meta["in_shape"][0]), 0.0, vocab)
    test = d.test.head(args.limit_test) if args.limit_test else d.test
    return saved, test, d.name, d.source, vocab.size, []

"""Text from a trained language model: ``python -m mpisgd.sample PATH --prompt TEXT --tokens N``
(or ``mpisgd-sample``).

PATH is a ``--save-model`` file, a checkpoint or a checkpoint directory of a language model's run
(``--model gpt``, or a model of your own trained on sequence data: ``--model-factory`` builds it). The
prompt is encoded with the vocabulary the model was trained with (a prompt with a character it lacks
is refused, naming the character); then, N times, the model reads the last ``context`` tokens (eval
mode: no dropout) and the next token is drawn from softmax(logits / temperature) with a generator
seeded by --seed, among the --top-k most likely tokens where it is given (--temperature 0, or one so small
that logits / temperature overflows, or --top-k 1: the most likely token). It prints the prompt, then each
token as it is drawn (flushed), so a long run shows its progress; Ctrl-C stops it with one line and exit
130, what was printed kept. One process, no MPI: a launch of several ranks (mpiexec) is refused on every
rank. Bad input: one line, exit 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np

from mpisgd.app.signals import EXIT_INTERRUPTED
from mpisgd.errors import UsageError

PROG = "mpisgd-sample"
MAX_TOKENS = 1_000_000  # a million characters (a long book) per run: more is a typo (--tokens 1e12)
DEFAULT_PROMPT = "\n"
# what MPI launchers set in every rank's environment: the job's size (MPICH's hydra, Intel MPI and srun's PMI-2
# set PMI_SIZE; Open MPI sets OMPI_COMM_WORLD_SIZE), and the rank
LAUNCHER_SIZE = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE")
LAUNCHER_RANK = ("PMI_RANK", "OMPI_COMM_WORLD_RANK")


def build_parser() -> argparse.ArgumentParser:
    from mpisgd.app.options import _Parser, add_version  # noqa: PLC0415

    parser = _Parser(prog="python -m mpisgd.sample", allow_abbrev=False,
                     description="Generate text from a trained language model (--model gpt, or your own "
                     "trained on sequence data).")
    parser.add_argument("path", metavar="PATH", help="a --save-model .npz, a checkpoint, or a checkpoint directory")
    parser.add_argument("--prompt", default=None, help="the text to continue (default: a new line)")
    parser.add_argument("--tokens", type=int, default=200,
                        help=f"tokens (characters) to generate, at most {MAX_TOKENS:,} (default: 200)")
    parser.add_argument("--temperature", type=float, default=1.0, help="divides the logits before the softmax: "
                        "below 1 more likely tokens, above 1 more varied ones; 0 (or one so small that the "
                        "division overflows) takes the most likely (default: 1)")
    parser.add_argument("--top-k", type=int, default=0, metavar="K",
                        help="draw among the K most likely tokens only (those tied with the K-th kept too); 0: "
                        "among all (default: 0)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the draws (default: 0)")
    parser.add_argument("--model-factory", metavar="PACKAGE.MODULE:FUNCTION", default=None,
                        help="build a language model of your own (a file whose model is package.module:function, "
                        "PyTorch's included) with this factory; it is imported and run, so name only code you "
                        "trust (a file never runs code by itself)")
    add_version(parser)
    return parser


def launched_ranks(environ: Mapping[str, str] = os.environ) -> tuple[int, int]:
    """(ranks, this rank) of the MPI launch this process is part of, as the launcher's environment says: (1, 0)
    when none (a size that is missing or not a number counts as none)."""
    for size_var, rank_var in zip(LAUNCHER_SIZE, LAUNCHER_RANK):
        try:
            size = int(environ.get(size_var, ""))
        except ValueError:
            continue
        if size > 1:
            try:
                return size, int(environ.get(rank_var, "0"))
            except ValueError:
                return size, 0
    return 1, 0


def load(path: str, factory: str | None = None) -> tuple[Any, Any, int]:
    """(model, vocabulary, context) of a language model's file (a model of your own built by ``factory``);
    UsageError where it is not one."""
    from mpisgd.app.evaluate import read_with_factory  # noqa: PLC0415
    from mpisgd.text import Vocabulary  # noqa: PLC0415

    saved = read_with_factory(path, factory)
    vocab = Vocabulary.from_identity(saved.meta.get("data") or {})
    if vocab is None:
        raise UsageError(f"{saved.path} is not a language model (--model {saved.meta.get('model')}, no vocabulary): "
                         "sampling needs the model or checkpoint of a run on sequence data (--model gpt, or your "
                         "own)")
    return saved.model, vocab, int(saved.meta["in_shape"][0])


def next_token(logits: np.ndarray, temperature: float, rng: np.random.Generator, top_k: int = 0) -> int:
    """A draw from softmax(logits / temperature), over the ``top_k`` largest logits where it is > 0 (and those
    equal to the k-th: no tie is broken by position); the most likely token at 0, or where the division
    overflows (a temperature of 1e-320: inf / inf would make the probabilities NaN)."""
    if temperature > 0:
        with np.errstate(over="ignore"):
            z = logits / temperature
        if np.isfinite(z).all():
            p = np.exp(z - z.max())
            if 0 < top_k < len(logits):
                p[logits < np.partition(logits, -top_k)[-top_k]] = 0.0
            return int(rng.choice(len(p), p=p / p.sum()))
    return int(np.argmax(logits))


def draw(model: Any, prompt: np.ndarray, tokens: int, context: int, temperature: float,
         rng: np.random.Generator, top_k: int = 0) -> Iterator[int]:
    """The ``tokens`` ids that follow the prompt's, one at a time as each is drawn (eval mode; the mode is put
    back when the iterator ends or is closed). Keeps only the last ``context`` ids."""
    window: deque[int] = deque((int(i) for i in prompt), maxlen=context)
    was_training = model.training
    model.eval()
    try:
        for _ in range(tokens):
            logits = np.asarray(model.forward(np.asarray(window, dtype=np.int64)[None, :])[0, -1], dtype=np.float64)
            token = next_token(logits, temperature, rng, top_k)
            window.append(token)
            yield token
    finally:
        model.train(was_training)


def generate(model: Any, prompt: np.ndarray, tokens: int, context: int, temperature: float,
             rng: np.random.Generator, top_k: int = 0) -> np.ndarray:
    """The prompt's ids followed by ``tokens`` drawn one at a time (eval mode; the mode is put back)."""
    drawn = list(draw(model, prompt, tokens, context, temperature, rng, top_k))
    return np.asarray([*(int(i) for i in prompt), *drawn], dtype=np.int64)


def check_args(args: argparse.Namespace) -> None:
    """UsageError for options no model could take (before the model is read)."""
    if not args.path.strip():  # an unset shell variable: never the current directory instead
        raise UsageError("PATH is empty: give a path (an unset shell variable?)")
    if not 0 <= args.tokens <= MAX_TOKENS:
        raise UsageError(f"--tokens must be from 0 to {MAX_TOKENS:,}, got {args.tokens}")
    if not (args.temperature >= 0 and np.isfinite(args.temperature)):
        raise UsageError(f"--temperature must be a finite number >= 0, got {args.temperature}")
    if args.top_k < 0:
        raise UsageError(f"--top-k must be >= 0 (0: every token), got {args.top_k}")
    if args.seed < 0:
        raise UsageError(f"--seed must be >= 0, got {args.seed}")
    if args.prompt is not None and not args.prompt:
        raise UsageError("--prompt is empty: give at least one character to continue")


def encode_prompt(vocab: Any, prompt: str | None) -> np.ndarray:
    """The prompt's ids: --prompt's, or the default (a new line), refused as such where the vocabulary lacks it."""
    if prompt is not None:
        return np.asarray(vocab.encode(prompt, "--prompt"))
    if vocab.chars is not None and DEFAULT_PROMPT not in vocab.chars:
        shown = "".join(c for c in vocab.chars if c.isprintable())[:20]
        raise UsageError(f"the default prompt, a new line, is not in the model's vocabulary of {vocab.size} "
                         f"characters (its training text had none): give --prompt TEXT in characters it has "
                         f"({shown!r}{'...' if len(vocab.chars) > 20 else ''})")
    return np.asarray(vocab.encode(DEFAULT_PROMPT, "the default prompt (a new line)"))


def decoder(vocab: Any) -> Callable[[int], str]:
    """Text for one id as it is printed: its character, or for a vocabulary of bare ids the id after a space."""
    if vocab.chars is not None:
        return lambda token: str(vocab.chars[token])
    return lambda token: f" {token}"


def _say(msg: str) -> None:
    print(f"{PROG}: {msg}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:  # Ctrl-C: what was printed stays, one line says why it ends
        try:
            _write("\n")
        except (OSError, ValueError):
            pass
        _say(f"interrupted (SIGINT) (exit {EXIT_INTERRUPTED})")
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # the reader went away (| head): stop drawing, quietly
        _quiet_stdout()
        return 0


def _quiet_stdout() -> None:
    """Standard output to /dev/null, so that Python's last flush at exit does not fail on the closed pipe again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # no file descriptor (a test's stand-in): nothing to quiet
        pass


def _main(argv: list[str] | None) -> int:
    try:
        args = build_parser().parse_args(argv)
        ranks, rank = launched_ranks()
        if ranks > 1:
            if rank != 0:  # every rank refuses; one says why
                return 2
            raise UsageError(f"launched as {ranks} ranks (mpiexec): sampling is one process, with no MPI; run "
                             "python -m mpisgd.sample without mpiexec")
        check_args(args)
        model, vocab, context = load(args.path, args.model_factory)
        prompt = encode_prompt(vocab, args.prompt)
    except SystemExit as exc:  # --help
        return int(exc.code or 0)
    except UsageError as exc:
        _say(f"error: {exc}")
        return 2
    text = decoder(vocab)
    _write(vocab.decode(prompt))
    rng = np.random.default_rng(args.seed)
    for token in draw(model, prompt, args.tokens, context, args.temperature, rng, args.top_k):
        _write(text(token))
    _write("\n")
    return 0


def _write(text: str) -> None:
    """To standard output at once: a long run shows its progress, and Ctrl-C keeps what came."""
    sys.stdout.write(text)
    sys.stdout.flush()

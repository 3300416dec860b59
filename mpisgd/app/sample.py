"""Text from a trained language model: ``python -m mpisgd.sample PATH --prompt TEXT --tokens N``
(or ``mpisgd-sample``).

PATH is a ``--save-model`` file, a checkpoint or a checkpoint directory of a ``--model gpt`` run. The
prompt is encoded with the vocabulary the model was trained with (a prompt with a character it lacks
is refused, naming the character); then, N times, the model reads the last ``context`` tokens (eval
mode: no dropout) and the next token is drawn from softmax(logits / temperature) with a generator
seeded by --seed (--temperature 0: the most likely token). It prints the prompt and what follows. One
process, no MPI; bad input: one line, exit 2.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import numpy as np

from mpisgd.errors import UsageError


def build_parser() -> argparse.ArgumentParser:
    from mpisgd.app.options import _Parser  # noqa: PLC0415

    parser = _Parser(prog="python -m mpisgd.sample", allow_abbrev=False,
                     description="Generate text from a trained language model (--model gpt).")
    parser.add_argument("path", metavar="PATH", help="a --save-model .npz, a checkpoint, or a checkpoint directory")
    parser.add_argument("--prompt", default="\n", help="the text to continue (default: a new line)")
    parser.add_argument("--tokens", type=int, default=200, help="tokens (characters) to generate (default: 200)")
    parser.add_argument("--temperature", type=float, default=1.0, help="divides the logits before the softmax: "
                        "below 1 more likely tokens, above 1 more varied ones; 0 takes the most likely (default: 1)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the draws (default: 0)")
    return parser


def load(path: str) -> tuple[Any, Any, int]:
    """(model, vocabulary, context) of a language model's file; UsageError where it is not one."""
    from mpisgd.model_file import read_model  # noqa: PLC0415
    from mpisgd.text import Vocabulary  # noqa: PLC0415

    saved = read_model(path)
    vocab = Vocabulary.from_identity(saved.meta.get("data") or {})
    if vocab is None or saved.meta.get("model") != "gpt":
        raise UsageError(f"{saved.path} is not a language model (--model {saved.meta.get('model')}, no vocabulary): "
                         "sampling needs a --model gpt run's model or checkpoint")
    return saved.model, vocab, int(saved.meta["in_shape"][0])


def generate(model: Any, prompt: np.ndarray, tokens: int, context: int, temperature: float,
             rng: np.random.Generator) -> np.ndarray:
    """The prompt's ids followed by ``tokens`` drawn one at a time (eval mode; the mode is put back)."""
    ids = list(int(i) for i in prompt)
    was_training = model.training
    model.eval()
    try:
        for _ in range(tokens):
            window = np.asarray(ids[-context:], dtype=np.int64)[None, :]
            logits = np.asarray(model.forward(window)[0, -1], dtype=np.float64)
            if temperature == 0:
                ids.append(int(np.argmax(logits)))
                continue
            z = logits / temperature
            p = np.exp(z - z.max())
            ids.append(int(rng.choice(len(p), p=p / p.sum())))
    finally:
        model.train(was_training)
    return np.asarray(ids, dtype=np.int64)


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        if args.tokens < 0:
            raise UsageError(f"--tokens must be >= 0, got {args.tokens}")
        if not (args.temperature >= 0 and np.isfinite(args.temperature)):
            raise UsageError(f"--temperature must be a finite number >= 0, got {args.temperature}")
        if args.seed < 0:
            raise UsageError(f"--seed must be >= 0, got {args.seed}")
        if not args.prompt:
            raise UsageError("--prompt is empty: give at least one character to continue")
        model, vocab, context = load(args.path)
        prompt = vocab.encode(args.prompt, "--prompt")
    except SystemExit as exc:  # --help
        return int(exc.code or 0)
    except UsageError as exc:
        print(f"mpisgd-sample: error: {exc}", file=sys.stderr, flush=True)
        return 2
    ids = generate(model, prompt, args.tokens, context, args.temperature, np.random.default_rng(args.seed))
    sys.stdout.write(vocab.decode(ids) + "\n")
    sys.stdout.flush()
    return 0

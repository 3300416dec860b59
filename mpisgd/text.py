"""Sequence data for language models: a UTF-8 text file (character level) or an ``.npz`` of token ids.

* A **text file** becomes a stream of character ids: the vocabulary is every distinct character of the
  file, sorted by code point, and a character's id is its place in that list. The vocabulary is kept
  with the run (the data set's identity: the checkpoints, the saved model, ``vocab.json`` beside the
  metrics file), so that a resumed run, ``python -m mpisgd.evaluate`` and ``python -m mpisgd.sample``
  use the same ids, and refuse text with characters it lacks.
* An **.npz of tokens** holds ``tokens``, a 1-D array of integer ids >= 0 (any tokeniser's), and may
  hold ``vocab_size`` (else the largest id + 1) and ``vocab``, a string whose i-th character is token
  i's (then prompts can be encoded for sampling).

The stream is split into three contiguous parts, in order: training, validation (``--val-split`` of
it) and test (the last TEST_FRACTION), so the parts share no text and do not depend on k. Each part is
cut into windows of ``context`` tokens at fixed offsets: sample i is the window starting at i *
context, its targets the same window shifted by one token (next-token prediction at every position).
A window's index is its sample index (what Dropout keys its masks by, what the global batches
permute). The windows are views of the stream (``as_strided``, no copy): x of sample i is
stream[i*T : i*T+T], its targets stream[i*T+1 : i*T+T+1].
"""

from __future__ import annotations

import hashlib
import json
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mpisgd.data import DataError, Dataset

TEST_FRACTION = 0.05  # the last 5 % of the stream is the test set
VERSION = 1  # of the identity record below
FORMATS = ("a language model reads a UTF-8 text file or an .npz holding 'tokens' (1-D integer ids): docs/data.md")
_ZIP, _NPY = b"PK\x03\x04", b"\x93NUMPY"


@dataclass(frozen=True)
class Vocabulary:
    """Token ids 0..size-1 and, for text, the character of each (``chars[i]`` is token i's)."""

    size: int
    chars: str | None = None  # None: token ids with no characters known

    def encode(self, text: str, what: str) -> np.ndarray:
        """The ids of ``text``'s characters; DataError naming the first character the vocabulary lacks."""
        if self.chars is None:
            raise DataError(f"{what}: the model was trained on token ids without characters (an .npz with no "
                            "'vocab'), so text cannot be encoded for it")
        if not text:
            return np.zeros(0, np.int64)
        points = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
        known = np.frombuffer(self.chars.encode("utf-32-le"), dtype=np.uint32)  # sorted: built that way
        ids = np.minimum(np.searchsorted(known, points), len(known) - 1)
        bad = known[ids] != points
        if bad.any():
            missing = sorted(set(text[i] for i in np.flatnonzero(bad)[:10000]))
            first = int(np.argmax(bad))
            shown = "".join(missing[:20])
            raise DataError(f"{what} holds {len(missing)}{'+' if bad.sum() > 10000 else ''} character(s) the "
                            f"model's vocabulary of {self.size} lacks: {shown!r} (the first at character {first})")
        return ids.astype(np.int64)

    def decode(self, ids: Any) -> str:
        if self.chars is None:
            return " ".join(str(int(i)) for i in ids)
        return "".join(self.chars[int(i)] for i in ids)

    def to_json(self) -> dict[str, Any]:
        return {"size": self.size, "chars": self.chars}

    @classmethod
    def from_identity(cls, identity: dict[str, Any]) -> Vocabulary | None:
        """The vocabulary a data set's identity records (None: not sequence data)."""
        v = identity.get("vocab")
        if not isinstance(v, dict):
            return None
        return cls(int(v["size"]), v.get("chars"))


@dataclass
class TokenData:
    """The three parts of a token stream as data sets of windows, and what identifies them."""

    train: Dataset
    val: Dataset | None
    test: Dataset
    vocab: Vocabulary
    name: str
    source: str
    identity: dict[str, Any]


def is_token_data(path: str | None, text: bool) -> bool:
    """Whether ``--data path`` is sequence data: an .npz holding 'tokens', or, where ``text`` (a language
    model's run: --model gpt), any regular file that is neither a zip nor an .npy (it is read as text;
    for other models such a file stays an error of the data sets they read)."""
    if not path:
        return False
    p = Path(path)
    try:
        if not p.is_file():
            return False
        with open(p, "rb") as f:
            magic = f.read(6)
        if magic == _NPY:
            return False
        if magic[:4] != _ZIP:
            return text
        with zipfile.ZipFile(p) as z:
            return "tokens.npy" in z.namelist()
    except (OSError, zipfile.BadZipFile):
        return False


def read_stream(path: str, vocab: Vocabulary | None = None) -> tuple[np.ndarray, Vocabulary, str]:
    """(token ids, vocabulary, what it is) of ``--data path``: a text file's characters (with its own
    vocabulary, or ``vocab``'s: a trained model's), or an .npz's tokens. DataError in one line."""
    p = Path(path)
    try:
        with open(p, "rb") as f:
            raw = f.read()
    except OSError as exc:
        raise DataError(f"--data {path}: cannot read it ({exc.strerror or exc})") from None
    if raw[:4] == _ZIP:
        return _npz_stream(path, vocab)
    if not raw:
        raise DataError(f"--data {path} is empty: a language model needs text to train on")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(f"--data {path} is not UTF-8 text: byte 0x{raw[exc.start]:02x} at offset {exc.start} "
                        f"({exc.reason}); {FORMATS}") from None
    del raw
    if vocab is None:
        chars = "".join(sorted(set(text)))
        if len(chars) == 1:  # a model of one token predicts it with certainty: loss 0, nothing learnt
            raise DataError(f"--data {path} holds one distinct character ({chars!r}, {len(text):,} times): a "
                            "language model needs at least two to have anything to predict")
        vocab = Vocabulary(len(chars), chars)
    ids = vocab.encode(text, f"--data {path}")
    return ids.astype(_stream_dtype(vocab.size)), vocab, f"{len(text):,} characters of UTF-8 text"


def _npz_stream(path: str, vocab: Vocabulary | None) -> tuple[np.ndarray, Vocabulary, str]:
    try:
        with np.load(path, allow_pickle=False) as z:
            if "tokens" not in z.files:
                raise DataError(f"--data {path}: an .npz of tokens needs 'tokens' (it holds {', '.join(z.files)})")
            tokens = z["tokens"]
            size = _vocab_size(z["vocab_size"], path) if "vocab_size" in z.files else None
            chars = str(z["vocab"]) if "vocab" in z.files else None
    except DataError:
        raise
    except (OSError, ValueError, EOFError, TypeError, zipfile.BadZipFile) as exc:
        raise DataError(f"--data {path}: cannot read it ({type(exc).__name__}: {exc})") from None
    if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
        raise DataError(f"--data {path}: 'tokens' must be a 1-D array of integer ids, got {tokens.dtype} of shape "
                        f"{tokens.shape}")
    if tokens.size == 0:
        raise DataError(f"--data {path}: 'tokens' is empty")
    lo, hi = int(tokens.min()), int(tokens.max())
    if lo < 0:
        raise DataError(f"--data {path}: token ids must be >= 0; token {int(np.argmin(tokens))} is {lo}")
    bound = "vocab_size" if size is not None else "the number of characters 'vocab' lists"
    if chars is not None:
        if len(set(chars)) != len(chars) or list(chars) != sorted(chars):
            raise DataError(f"--data {path}: 'vocab' must list distinct characters in code-point order")
        size = size if size is not None else len(chars)
        if size != len(chars):
            raise DataError(f"--data {path}: 'vocab' has {len(chars)} characters but vocab_size is {size}")
    size = hi + 1 if size is None else size
    if hi >= size:
        raise DataError(f"--data {path}: token {int(np.argmax(tokens))} is {hi}, not below {bound}, {size}")
    found = Vocabulary(size, chars)
    if vocab is not None and vocab != found:
        raise DataError(f"--data {path}: its vocabulary ({_describe(found)}) is not the model's ({_describe(vocab)})")
    return tokens.astype(_stream_dtype(size)), found, f"{tokens.size:,} tokens"


def _vocab_size(value: np.ndarray, path: str) -> int:
    """An .npz's vocab_size: one integer (a float, even 65.0, or several values are refused, not cut)."""
    if value.size != 1 or value.dtype.kind not in "iu":
        shown = value.reshape(-1)[:3].tolist()
        raise DataError(f"--data {path}: 'vocab_size' must be one integer, got {value.dtype} "
                        f"{shown[0] if value.size == 1 else shown}")
    return int(value.reshape(-1)[0])


def _describe(v: Vocabulary) -> str:
    return f"{v.size} tokens" + (f", {v.chars[:20]!r}{'...' if len(v.chars) > 20 else ''}" if v.chars else "")


def _stream_dtype(size: int) -> np.dtype:
    """The smallest unsigned type that holds ids 0..size-1 (the stream's memory: 1 byte a character)."""
    return np.dtype(np.uint8 if size <= 1 << 8 else np.uint16 if size <= 1 << 16 else np.int64)


def windows(stream: np.ndarray, context: int) -> Dataset:
    """Sample i: inputs stream[i*T : i*T+T], targets stream[i*T+1 : i*T+T+1] (T = context), as read-only
    views of the stream; (len - 1) // T samples."""
    n = (len(stream) - 1) // context
    step = stream.strides[0]
    x = np.lib.stride_tricks.as_strided(stream, (n, context), (context * step, step), writeable=False)
    y = np.lib.stride_tricks.as_strided(stream[1:], (n, context), (context * step, step), writeable=False)
    return Dataset(x, y, tokens=True)


def split_sizes(n: int, val_fraction: float) -> tuple[int, int, int]:
    """Tokens of the training, validation and test parts of a stream of n (contiguous, in that order)."""
    n_test = max(1, round(TEST_FRACTION * n))
    n_val = round(val_fraction * n) if val_fraction else 0
    return n - n_val - n_test, n_val, n_test


def load_tokens(path: str, context: int, val_fraction: float, vocab: Vocabulary | None = None) -> TokenData:
    """The three parts of ``--data path`` as windows of ``context`` tokens (DataError where a part is too
    short for one window, naming it)."""
    stream, vocab, what = read_stream(path, vocab)
    sizes = split_sizes(len(stream), val_fraction)
    if sizes[0] <= 0:
        raise DataError(f"--val-split {val_fraction:g} and the test part (the last {TEST_FRACTION:.0%}) take all "
                        f"{len(stream):,} tokens of --data {path}: leave text for training (--val-split below "
                        f"{1 - TEST_FRACTION:g})")
    bounds = np.cumsum((0, *sizes))
    parts: list[Dataset | None] = []
    for name, size, lo in zip(("training", "validation", "test"), sizes, bounds, strict=False):
        if name == "validation" and not size:
            parts.append(None)
            continue
        if size < context + 1:
            share = {"training": "the rest", "validation": f"--val-split {val_fraction:g}",
                     "test": f"the last {TEST_FRACTION:.0%}"}[name]
            raise DataError(f"--context {context} needs {context + 1} tokens in each part of the data; the {name} part "
                            f"of --data {path} ({share} of its {len(stream):,} tokens) has {size:,}: use a shorter "
                            "--context, or more text")
        parts.append(windows(stream[lo:lo + size], context))
    train, val, test = parts
    assert train is not None and test is not None
    h = hashlib.blake2b(digest_size=8)
    h.update(repr((str(stream.dtype), len(stream), context, sizes)).encode())
    h.update(stream.tobytes())
    identity = {"name": Path(path).name, "kind": "tokens", "n_train": len(train), "n_val": len(val) if val else 0,
                "n_test": len(test), "context": context, "vocab": vocab.to_json(), "classes": vocab.size,
                "fingerprint": h.hexdigest(), "fingerprint_version": VERSION}
    return TokenData(train, val, test, vocab, Path(path).name, f"{path} ({what}, {vocab.size} tokens)", identity)


def check_same_vocabulary(saved: dict[str, Any], now: dict[str, Any], what: str) -> None:
    """DataError when a run's data (``now``, an identity) does not use the vocabulary ``saved`` records
    (a checkpoint's or a model's)."""
    a, b = Vocabulary.from_identity(saved), Vocabulary.from_identity(now)
    if a is not None and b is not None and a != b:
        extra = sorted(set(b.chars or "") - set(a.chars or ""))
        lacks = sorted(set(a.chars or "") - set(b.chars or ""))
        detail = (f"; this data adds {''.join(extra)[:20]!r}" if extra else "") + \
            (f"; it lacks {''.join(lacks)[:20]!r}" if lacks else "")
        raise DataError(f"the vocabulary of this data ({_describe(b)}) is not {what}'s ({_describe(a)}){detail}: token "
                        "ids would mean other characters; use the same text")


def vocab_json(vocab: Vocabulary) -> str:
    """The vocabulary as the JSON a run writes beside its metrics file."""
    return json.dumps(vocab.to_json(), ensure_ascii=False)

"""Whether the ranks agree, and what every rank does when they do not.

One place for the rules every check across ranks follows:

- :func:`agree`: each rank brings its own error (or None); if any rank has one,
  every rank raises the same :class:`AgreedError` with the lowest failing rank's
  message, so that all stop together and rank 0 can print what that rank saw.
- :func:`differing_ranks`: which ranks hold a value other than the others'
  (the most common value is the reference, rank 0's on a tie); every check of
  "the same on every rank" names those ranks.
- :func:`verify_same` / :func:`name_differences`: the check, raising on every rank.
- :func:`same_arithmetic`: every rank rounds alike (BLAS, threads, NumPy's SIMD, the level-1 switch).
- :func:`layout_digest`: a short digest of shapes and dtypes, compared before
  collectives on buffers of those shapes.
- :func:`bcast_`: a broadcast in place that stages device arrays through the host.

Everything here is collective: every rank calls it, in the same order.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np

from mpisgd.backend import is_device_array, to_numpy
from mpisgd.comm.base import byte_spec


class AgreedError(Exception):
    """An error every rank raises together (after :func:`agree`): exit cleanly, no abort needed."""

    def __init__(self, message: str, exit_code: int = 2) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class ReplicaError(RuntimeError):
    """Ranks disagree (configuration or shapes at start, parameters or step during training)."""


def agree(comm: Any, error: BaseException | None, exit_code: int = 2, on_root: bool = False) -> None:
    """If any rank had an error, raise AgreedError on every rank: the lowest failing rank's message,
    prefixed with its rank when not every rank failed (``on_root``: a check rank 0 makes for all, whose failure
    there is no rank's own: no prefix)."""
    errors = comm.allgather(None if error is None else str(error))
    failed = [r for r, e in enumerate(errors) if e is not None]
    if not failed:
        return
    first = failed[0]
    prefix = "" if len(failed) == len(errors) or (on_root and failed == [0]) else f"rank {first}: "
    raise AgreedError(prefix + str(errors[first]), exit_code)


def differing_ranks(values: Sequence[Any]) -> list[int]:
    """Ranks whose value differs from the most common one (rank 0's on a tie)."""
    reference = Counter(values).most_common(1)[0][0]  # ties go to the first seen: rank 0's
    return [r for r, v in enumerate(values) if v != reference]


def verify_same(comm: Any, value: Any, what: str, error: type[Exception] = ReplicaError) -> None:
    """Raise ``error`` on every rank when ``value`` differs between ranks, naming the odd ranks."""
    values = comm.allgather(value)
    bad = differing_ranks(values)
    if bad:
        raise error(f"{what} differs on rank(s) {bad} from the other ranks "
                    f"({len(values)} ranks; values: {dict(enumerate(values))})")


def verify_same_layout(comm: Any, layout: dict[str, Any] | list[Any], what: str, noun: str = "item",
                       error: type[Exception] = ReplicaError) -> None:
    """Raise ``error`` on every rank when ``layout`` (a dict of named parts, or a list of items called
    ``noun``) differs between ranks, naming the odd ranks and each one's first difference from the others ("dtype:
    rank 1 has 'float64' where rank 0 has 'float32'"). One small allgather of digests; the layouts
    themselves travel only when they differ (every rank then takes that path alike)."""
    digests = comm.allgather(layout_digest(layout))
    bad = differing_ranks(digests)
    if not bad:
        return
    every = comm.allgather(layout)
    usual = next(r for r in range(len(every)) if r not in bad)
    raise error(f"{what} differs on rank(s) {bad} from the other ranks: "
                + "; ".join(first_difference(every[usual], every[r], usual, r, noun) for r in bad))


def first_difference(a: dict[str, Any] | list[Any], b: dict[str, Any] | list[Any], ra: int, rb: int,
                     noun: str) -> str:
    """Where rank ``rb``'s layout ``b`` first differs from rank ``ra``'s ``a``, in words (values cut to 120
    characters)."""
    def cut(v: Any) -> str:
        text = repr(v)
        return text if len(text) <= 120 else text[:117] + "..."

    if isinstance(a, dict) and isinstance(b, dict):
        for key in a:
            if key not in b or a[key] != b[key]:
                va, vb = a[key], b.get(key)
                if isinstance(va, list | tuple) and isinstance(vb, list | tuple) and len(va) == len(vb):
                    i = next(i for i in range(len(va)) if va[i] != vb[i])
                    return f"{key} [{i}]: rank {rb} has {cut(vb[i])} where rank {ra} has {cut(va[i])}"
                return f"{key}: rank {rb} has {cut(vb)} where rank {ra} has {cut(va)}"
        return f"rank {rb} has parts rank {ra} lacks: {sorted(set(b) - set(a))}"
    for i, (va, vb) in enumerate(zip(a, b, strict=False)):
        if va != vb:
            return f"{noun} {i}: rank {rb} has {cut(vb)} where rank {ra} has {cut(va)}"
    return f"rank {rb} has {len(b)} {noun}s where rank {ra} has {len(a)}"


def name_differences(records: Sequence[dict[str, Any]], flag: bool = False) -> list[str]:
    """For per-rank dictionaries, one phrase per key whose value is not the same everywhere:
    "KEY is A on ranks [0, 1] but B on rank(s) [2]" (with ``flag``, KEY spelled as an option)."""
    out = []
    for key in records[0]:
        values = [r.get(key) for r in records]
        odd = differing_ranks([repr(v) for v in values])
        if not odd:
            continue
        usual = [r for r in range(len(values)) if r not in odd]
        name = f"--{key.replace('_', '-')}" if flag else key
        out.append(f"{name} is {values[usual[0]]!r} on rank(s) {usual} but "
                   + ", ".join(f"{values[r]!r} on rank {r}" for r in odd))
    return out


def same_arithmetic(comm: Any, record: dict[str, str], error: type[Exception] = ReplicaError) -> None:
    """Raise ``error`` on every rank when the ranks' arithmetic differs (mpisgd.backend.arithmetic), naming
    the ranks and the difference: they would round the same inputs differently, so replicas would drift
    apart silently and a reproducible run's bits would depend on which rank computed what."""
    diffs = name_differences(comm.allgather(record))
    if diffs:
        raise error("the ranks would round differently (" + "; ".join(diffs) + "): give every rank the same BLAS "
                    "kernel and threads (--threads; OPENBLAS_CORETYPE for OpenBLAS's kernel), NumPy and its SIMD "
                    "targets (NPY_DISABLE_CPU_FEATURES) and MPISGD_BLAS_LEVEL1")


def layout_digest(items: Any) -> str:
    """A short digest of ``repr(items)``: shapes, dtypes, layer lists to compare across ranks."""
    return hashlib.blake2b(repr(items).encode(), digest_size=8).hexdigest()


def bcast_(comm: Any, arr: Any, root: int = 0) -> None:
    """Every rank takes ``root``'s values of ``arr``, in place (contiguous). Device arrays go through
    a host copy, so no CUDA-aware MPI is needed (start-up and resume only)."""
    if is_device_array(arr):
        host = np.ascontiguousarray(to_numpy(arr))  # a copy after the kernels that wrote arr
        comm.Bcast(byte_spec(host), root=root)
        arr.set(host)
    else:
        comm.Bcast(byte_spec(arr), root=root)

"""The tuning file: ``auto``'s measured choices between ``mpi`` and ``ring``, kept from one run to the next.

Where: ``$MPISGD_TUNING_FILE`` (``$MPISGD_PLAN_FILE`` is its older name and still read), by default
``~/.cache/mpisgd/allreduce-tuning.json``; ``off`` (or empty) for none. It keeps each size class's choice
under the MPI library, k and the hosts (a *configuration*), with when it was measured, how clear its
margin was and how busy the machine was. :func:`status_of` says what a run does with an entry: trust
it, re-check it with a few calls, or re-measure it (docs/allreduce.md, "The tuning file").

Only rank 0 reads and writes it (:class:`TuningFile`): only a regular file, never one that is not a
tuning file (left as it is), never bigger than :data:`MAX_BYTES`; written all or nothing, merged with
the other configurations' entries, and through a symbolic link to the file it names (the link stays).
Nothing here communicates or raises for what is at the path: a file that cannot be used is a note for
the banner, and the run measures.
"""

from __future__ import annotations

import calendar
import json
import os
import re
import stat
import time
from pathlib import Path
from typing import IO, Any

from mpisgd.files import atomic_write

TUNING_FILE = "~/.cache/mpisgd/allreduce-tuning.json"
ENV, OLD_ENV = "MPISGD_TUNING_FILE", "MPISGD_PLAN_FILE"  # the variable, and its older name
FORMAT = "mpisgd allreduce tuning 3"
# format tag -> the key of its table of configurations; format 1 had no tag: {configuration: {"float32:23": "mpi"}}
TABLES = {FORMAT: "configurations", "mpisgd allreduce plans 2": "plans"}
MAX_BYTES = 1 << 20  # a tuning file is a few KiB: a larger file is not one of ours
MAX_AGE_DAYS = 7.0  # older choices are re-checked (docs/allreduce.md, "The tuning file")
CLOSE_MARGIN = 0.05  # a margin below this, or below the calls' own spread, is inside the noise: re-measured
BUSY_TASKS = 0.5  # runnable tasks beyond the CPUs, on average while timing: the machine was busy
CANDIDATES = ("mpi", "ring")
_STAMP = "%Y-%m-%dT%H:%M:%SZ"
_OLD_NAME = re.compile(r"^\w+:\d+$")  # format 1's "float32:23"


def tuning_path(explicit: str | None = None) -> str:
    """The tuning file's path as given: ``explicit``, else $MPISGD_TUNING_FILE, else the older
    $MPISGD_PLAN_FILE, else the default ("off" or "" mean none)."""
    if explicit is not None:
        return explicit
    return os.environ.get(ENV, os.environ.get(OLD_ENV, TUNING_FILE))


def stamp(t: float) -> str:
    return time.strftime(_STAMP, time.gmtime(t))


def parse_stamp(text: Any) -> float | None:
    try:
        return float(calendar.timegm(time.strptime(text, _STAMP)))
    except (TypeError, ValueError):
        return None


def number(x: Any) -> float | None:
    """A finite JSON number as a float; None for anything else."""
    ok = isinstance(x, (int, float)) and not isinstance(x, bool) and float("-inf") < x < float("inf")
    return float(x) if ok else None


def rounded(load: float | None) -> float | None:
    return None if load is None else round(load, 2)


def is_clear(ratio: float, spread: float) -> bool:
    """Whether the slower candidate's median over the faster's (``ratio``) stands out of the noise: the
    widest relative spread of the calls (interquartile range over median), and never less than CLOSE_MARGIN."""
    return ratio - 1.0 > max(spread, CLOSE_MARGIN)


def status_of(entry: Any, now: float) -> str | None:
    """What a run does with an entry: "trust" it, "recheck" it with a few calls, or "remeasure" it (its
    margin was inside the noise); None for something that is not an entry (ignored)."""
    if entry in CANDIDATES:
        return "recheck"  # format 1: a bare choice, with no date and no margin
    if not isinstance(entry, dict) or entry.get("choice") not in CANDIDATES:
        return None
    ratio, spread = number(entry.get("ratio")), number(entry.get("spread"))
    if ratio is not None and spread is not None and not is_clear(ratio, spread):
        return "remeasure"
    when = parse_stamp(entry.get("checked") or entry.get("measured"))
    overload = number(entry.get("overload"))
    if ratio is None or spread is None or when is None or not -86400 < now - when <= MAX_AGE_DAYS * 86400 \
            or (overload is not None and overload > BUSY_TASKS):
        return "recheck"  # no margin or no date, old, dated in the future (a wrong clock), or timed while busy
    return "trust"


def rechecked(entry: Any, record: dict[str, Any], now: float) -> dict[str, Any]:
    """The entry for a choice a re-check confirmed: ``entry`` dated now, with its margin as measured, or
    where it had none (format 1, not dated either) the re-check's own ``record``."""
    if isinstance(entry, dict) and number(entry.get("ratio")) is not None and number(entry.get("spread")) is not None:
        return {**entry, "checked": stamp(now), "overload": record.get("overload")}
    return {**record, "measured": None, "checked": stamp(now)}


def measured_on(entry: Any) -> str | None:
    """The day an entry was measured (YYYY-MM-DD), None where it does not say (format 1)."""
    if isinstance(entry, dict) and parse_stamp(entry.get("measured")) is not None:
        return str(entry["measured"])[:10]
    return None


def entries_of(doc: Any) -> dict[str, dict[str, Any]] | None:
    """The entries of a parsed tuning file, {configuration: {"allreduce float32:23": entry}}; None when the
    document is not a tuning file of a format this code knows."""
    if not isinstance(doc, dict):
        return None
    if "format" in doc:
        table = doc.get(TABLES.get(doc["format"], "")) if isinstance(doc["format"], str) else None
        if not isinstance(table, dict) or not all(isinstance(v, dict) for v in table.values()):
            return None
        return table
    if not all(" | k=" in key and isinstance(v, dict) and all(_OLD_NAME.match(n) and c in CANDIDATES
                                                              for n, c in v.items()) for key, v in doc.items()):
        return None  # format 1 exactly, or someone else's JSON: left alone
    return {key: {f"allreduce {name}": choice for name, choice in v.items()} for key, v in doc.items()}


def read_tuning(path: Path) -> tuple[dict[str, dict[str, Any]] | None, str]:
    """(entries, note): the entries in ``path`` ({} when there is no file), or None with a note saying why
    the file is not used and will not be written. Never opens anything but a regular file (a FIFO would
    block, a device could act on an open) and never raises for what is at the path."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return {}, ""
    except OSError as exc:
        return None, f"tuning file {path} not read ({exc.strerror or exc})"
    if not stat.S_ISREG(st.st_mode):
        return None, f"tuning file {path} not used: not a regular file"
    if st.st_size > MAX_BYTES:
        return None, f"tuning file {path} ignored: too large for a tuning file (left as it is)"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0))
    except OSError as exc:
        return None, f"tuning file {path} not read ({exc.strerror or exc})"
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # replaced since the stat above
            return None, f"tuning file {path} not used: not a regular file"
        raw = os.read(fd, MAX_BYTES + 1)
    except OSError as exc:
        return None, f"tuning file {path} not read ({exc.strerror or exc})"
    finally:
        os.close(fd)
    try:
        entries = entries_of(json.loads(raw)) if raw.strip() else {}
    except (ValueError, RecursionError):  # not JSON (UnicodeDecodeError is a ValueError), or absurdly nested
        entries = None
    if entries is None:
        return None, f"tuning file {path} ignored: not a tuning file this version reads (left as it is)"
    return entries, ""


class TuningFile:
    """Rank 0's tuning file for one configuration (``key``: the MPI library, k and the hosts)."""

    def __init__(self, path: Path, key: str) -> None:
        self.path, self.key = path, key
        self.ours = True  # False once what is at the path is found not to be a tuning file: never written then

    @classmethod
    def load(cls, path: str, key: str) -> tuple[TuningFile | None, dict[str, tuple[Any, str]], str]:
        """(the file, or None when there is none to write; this configuration's usable entries, each with
        its status_of(); a note for the banner). Never raises."""
        if path in ("", "off"):
            return None, {}, ""
        try:
            where = Path(path).expanduser()
            entries, note = read_tuning(where)
            if entries is None:
                return None, {}, note  # not ours: never written
            now = time.time()
            mine = {name: (e, status) for name, e in entries.get(key, {}).items()
                    if (status := status_of(e, now)) is not None}
            return cls(where, key), mine, ""
        except Exception as exc:  # noqa: BLE001 - whatever is at the path, the caller's broadcast must follow
            return None, {}, f"tuning file {path} ignored ({exc})"

    def save(self, records: dict[str, dict[str, Any]]) -> str:
        """Merge ``records`` into this configuration's entries, keeping the other configurations', all or
        nothing, through a symbolic link to its target. Returns a note ("" when saved); a file that cannot
        be written is measured again next time, not an error."""
        entries, note = read_tuning(self.path)
        if entries is None:  # it changed into something that is not ours since it was read
            self.ours = False
            return note
        entries[self.key] = {**entries.get(self.key, {}), **records}
        body = json.dumps({"format": FORMAT, TABLES[FORMAT]: entries}, indent=1, sort_keys=True).encode()

        def write(f: IO[bytes]) -> None:
            f.write(body)

        try:
            atomic_write(self.path, write)
        except OSError as exc:
            return f"tuning file not saved to {self.path} ({exc.strerror or exc})"
        return ""

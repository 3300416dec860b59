"""Output files: checked before any training, written so that a crash or a full disk never loses data.

Every output a run will write is checked at start-up (:func:`check_output_file`,
:func:`check_output_dir`), so a path that cannot be written fails in one line
before the work, not after it. :func:`atomic_write` writes a temporary file
beside the target, fsyncs it and renames it over the target, so the target is
either the old file or the complete new one; a target that exists but is not a
regular file (a device node, a directory) is refused rather than replaced, and a
symbolic link is written through (the file it names is replaced, not the link).
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import numpy as np

from mpisgd.errors import UsageError

TMP_SUFFIX = ".tmp."  # + pid: what an interrupted write leaves behind


FIGURE_TYPES = (".png", ".pdf", ".svg")  # the figures the tools write, by their names' type


def figure_problem(path: str, what: str) -> str:
    """Why ``path`` cannot take a figure ("" when it can): a type not among FIGURE_TYPES, or a directory;
    the line names ``what`` (an option). The caller raises it as its own error."""
    ext = os.path.splitext(path)[1].lower()
    if ext not in FIGURE_TYPES:
        return f"{what} {path}: the file type {ext or '(none)'!r} is not one of {', '.join(FIGURE_TYPES)}"
    if os.path.isdir(path):
        return f"{what} {path} is a directory: give a file name"
    return ""


def _not_regular(path: Path) -> bool:
    return path.exists() and not path.is_file()


def check_output_file(path: str, what: str) -> None:
    """``path`` can be created or replaced: its directory exists (or can be made) and is writable, and the
    path is not something other than a regular file. Raises UsageError naming ``what`` (an option)."""
    p = Path(path)
    try:
        not_regular = _not_regular(p)
    except OSError as exc:  # a name too long, a loop of links: what the file system says, in one line
        raise UsageError(f"{what} {path}: {exc.strerror or exc}") from None
    if not_regular:
        raise UsageError(f"{what} {path} exists and is not a regular file; choose another path")
    check_output_dir(str(p.parent) or ".", what)


def replaceable(path: str | os.PathLike, looks_ours: Callable[[IO[bytes]], bool]) -> bool:
    """``path`` may take a file this run writes (or appends to): nothing is there, an empty file, or a file
    ``looks_ours`` recognises from its bytes (an earlier run's). Anything else is someone's file, kept; a
    directory or a FIFO is check_output_file's to refuse."""
    p = Path(path)
    try:
        if not p.is_file() or p.stat().st_size == 0:
            return True
        with open(p, "rb") as f:
            return looks_ours(f)
    except (OSError, ValueError, zipfile.BadZipFile):
        return False


def check_output_dir(path: str, what: str) -> None:
    """``path`` is (or can be made) a directory this process can create files in. Nothing is made: a probe
    file is created and removed in ``path``, or where it does not exist yet in its nearest existing parent
    (making a directory takes what making a file there takes), so that a run refused later, or several
    ranks checking one place at once, leave the place as it was (the writers make the directories)."""
    try:
        _check_output_dir(Path(path), path, what)
    except OSError as exc:  # a name too long, a loop of links: what the file system says, in one line
        raise UsageError(f"{what} {path}: {exc.strerror or exc}") from None


def _check_output_dir(p: Path, path: str, what: str) -> None:
    if p.exists() and not p.is_dir():
        raise UsageError(f"{what} {path} exists and is not a directory")
    base, missing = p, []
    while not base.exists() and base != base.parent:
        if base.is_symlink():  # a link to nothing: no directory can be made there
            raise UsageError(f"{what} {path}: cannot create the directory ({base} is a symbolic link to "
                             f"{os.readlink(base)}, which does not exist)")
        missing.append(base.name)
        base = base.parent
    here = base == p
    if not base.is_dir():
        raise UsageError(f"{what} {path}: cannot create the directory ({os.strerror(errno.ENOTDIR)})")
    longest = max((len(os.fsencode(name)) for name in missing), default=0)
    if longest > _name_max(base):
        raise UsageError(f"{what} {path}: cannot create the directory ({os.strerror(errno.ENAMETOOLONG)})")
    probe = base / f".mpisgd-write-test{TMP_SUFFIX}{os.getpid()}"
    try:
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        # creating a file where the directory exists: ENOENT means a file system that takes no new files (/proc)
        why = "it takes no new files" if exc.errno == errno.ENOENT and base.is_dir() else exc.strerror
        raise UsageError(f"{what} {path}: " + ("cannot write there" if here else "cannot create the directory")
                         + f" ({why})") from None


def _name_max(directory: Path) -> int:
    """The longest file name ``directory``'s file system takes (255 where it does not say)."""
    try:
        return os.pathconf(directory, "PC_NAME_MAX")
    except (OSError, ValueError):
        return 255


def atomic_write(path: str | os.PathLike, write: Callable[[IO[bytes]], object]) -> None:
    """Write ``path`` through ``write(f)`` all or nothing: temporary file, fsync, rename, fsync of the
    directory. The temporary file is removed whatever happens (a full disk included). A symbolic link is
    written through: the file it names is replaced, the link stays (a rename onto the link would replace it)."""
    target = Path(os.path.realpath(path))
    if _not_regular(target):
        raise OSError(f"{target} exists and is not a regular file: not replaced")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f"{target.name}{TMP_SUFFIX}{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    fd = os.open(target.parent, os.O_RDONLY)
    try:
        os.fsync(fd)  # make the rename itself durable
    finally:
        os.close(fd)


def write_npz(f: IO[bytes], arrays: dict[str, Any]) -> None:
    """``numpy.savez`` into ``f``, but closing its zip archive even when a write fails: numpy leaves it to
    the garbage collector then (a full disk), whose late close writes to a file already closed and prints
    a traceback ("Exception ignored in ZipFile.__del__") after the failure was reported. np.load reads it."""
    with zipfile.ZipFile(f, mode="w", compression=zipfile.ZIP_STORED, allowZip64=True) as archive:
        for name, value in arrays.items():
            with archive.open(f"{name}.npy", mode="w", force_zip64=True) as member:
                np.lib.format.write_array(member, np.asanyarray(value), allow_pickle=False)


def remove_stale_temporaries(directory: str | os.PathLike, pattern: str = r".*") -> list[Path]:
    """Remove what interrupted writes left in ``directory`` (names matching ``pattern`` + .tmp.<pid>,
    whose writer is no longer running); returns what was removed."""
    found = re.compile(rf"^(?:{pattern}){re.escape(TMP_SUFFIX)}(\d+)$")
    removed = []
    for p in Path(directory).iterdir() if Path(directory).is_dir() else []:
        m = found.match(p.name)
        if m and not _alive(int(m.group(1))):
            p.unlink(missing_ok=True)
            removed.append(p)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return pid != os.getpid()  # our own leftovers cannot be in progress


def free_bytes(path: str | os.PathLike) -> int:
    return shutil.disk_usage(path).free

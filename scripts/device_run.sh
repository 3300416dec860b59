#!/usr/bin/env bash
# There (a bare GPU machine, .device/ from scripts/device_bundle.sh carried along): MPICH and mpi4py
# from the wheels into /tmp/mpi, Fashion-MNIST from .device, then scripts/gpu_check.sh; its results
# (and its log) are copied to $OUT when that is set.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=$(command -v python3)
"$PY" -m pip install -q --no-index --no-deps --ignore-installed --no-compile --prefix /tmp/mpi .device/whl/*.whl || exit 2
site=$("$PY" -c "import sysconfig; print(sysconfig.get_path('purelib', vars={'base': '/tmp/mpi'}))")
platsite=$("$PY" -c "import sysconfig; print(sysconfig.get_path('platlib', vars={'platbase': '/tmp/mpi'}))")
mkdir -p /tmp/mpi/bin
export PATH=/tmp/mpi/bin:$PATH LD_LIBRARY_PATH=/tmp/mpi/lib:${LD_LIBRARY_PATH:-}
export PYTHONPATH=$platsite:$site:$PWD MPI4PY_LIBMPI=/tmp/mpi/lib/libmpi.so.12
export MPISGD_DATA=$PWD/.device/fashion-mnist PYTHONUNBUFFERED=1
"$PY" -c "import cupy, mpi4py; from mpi4py import MPI; print('device_run:', mpi4py.__version__, \
MPI.Get_library_version().splitlines()[0], '| CuPy', cupy.__version__, cupy.cuda.runtime.getDeviceCount(), 'GPU(s)')" \
    || exit 2
mkdir -p results/tmp
PYTHON=$PY bash scripts/gpu_check.sh 2>&1 | tee results/tmp/gpu_check.log
rc=${PIPESTATUS[0]}
if [ -n "${OUT:-}" ]; then
  cp results/tmp/gpu_check.log "$OUT/" 2>/dev/null
  for f in results/allreduce/gpu-* results/throughput/gpu.json; do [ -f "$f" ] && cp "$f" "$OUT/"; done
fi
exit "$rc"

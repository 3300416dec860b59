#!/usr/bin/env bash
# There (a bare GPU machine without internet, .device/ from scripts/device_bundle.sh carried along): note
# what the machine has of its own, install the bundle's wheels under $DEVICE_PREFIX (/tmp/mpi), point
# MPISGD_DATA at the bundle's Fashion-MNIST, run scripts/gpu_check.sh, and copy its one results file, its log,
# its plots and JSON lines to $OUT (when set), whatever happened.
#   bash scripts/device_run.sh                     # the bundle's MPICH (not CUDA-aware: the staged path)
#   DEVICE_MPI=system bash scripts/device_run.sh   # the machine's own mpi4py and mpiexec (a CUDA-aware one
#                                                  # runs the direct path too); only the pure-Python wheels
# GPU_CHECK_* settings pass through (GPU_CHECK_DRY_RUN=1 checks all of this on a machine without a GPU).
# The whole stays under 8 minutes: gpu_check.sh's budget (420 s), under a hard limit of 450 s, plus the
# installs (seconds). DEVICE_NO_PIP=1 unpacks the wheels without pip, as it does where pip is missing.
# Exit status: gpu_check.sh's, or 2 if the bundle would not install.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
PY=${PYTHON:-$(command -v python3)}
MODE=${DEVICE_MPI:-bundle}
PREFIX=${DEVICE_PREFIX:-/tmp/mpi}  # where the wheels go
if [ "${GPU_CHECK_DRY_RUN:-0}" = 1 ]; then
  export GPU_CHECK_RESULTS=${GPU_CHECK_RESULTS:-results/tmp/gpu-check-dry-run.md}
else
  export GPU_CHECK_RESULTS=${GPU_CHECK_RESULTS:-results/gpu/gpu-check-$(date -u +%Y-%m-%d).md}
fi
export GPU_CHECK_WORK=${GPU_CHECK_WORK:-results/tmp/gpu-check}
export GPU_CHECK_NOTES=results/tmp/device-notes.md
LOG=results/tmp/gpu_check.log  # the installs' and gpu_check.sh's output
mkdir -p results/tmp "$(dirname "$GPU_CHECK_RESULTS")"
rm -f "$LOG" "$GPU_CHECK_NOTES"

# shellcheck disable=SC2329  # (called by the trap below)
copy_out() {  # on every exit: what there is goes to $OUT
  [ -n "${OUT:-}" ] || return 0
  local f
  for f in "$GPU_CHECK_RESULTS" "$LOG" "$GPU_CHECK_NOTES" "$GPU_CHECK_WORK"/*.png "$GPU_CHECK_WORK"/*.jsonl; do
    [ -f "$f" ] && cp "$f" "$OUT/"
  done
  return 0
}
trap copy_out EXIT

# what the machine brings, before the bundle's wheels hide it
{
  echo "device_run.sh (DEVICE_MPI=$MODE), before the bundle was installed:"
  echo "- python3: $PY, $("$PY" --version 2>&1)"
  echo "- its own mpi4py and MPI: $(PYTHONPATH=$PWD timeout 30 "$PY" -c "
import mpi4py
from mpi4py import MPI
from mpisgd.comm.cuda import library_query
print(mpi4py.__version__, '|', ' '.join(MPI.Get_library_version().splitlines()[0].split()),
      '| CUDA query: %s (%s)' % library_query())" 2>&1 | tail -n 1)"
  echo "- its own mpiexec: $(command -v mpiexec || echo none)"
  echo "- nvidia-smi -L: $(timeout 30 nvidia-smi -L 2>&1 | tr '\n' ';' || true)"
} >"$GPU_CHECK_NOTES"
cat "$GPU_CHECK_NOTES"

unpack_wheels() {  # without pip: a wheel is a zip; NAME.data/data/ goes to PREFIX, NAME.data/scripts/ to
  # PREFIX/bin, the rest to site-packages (which is what pip install --prefix does with these wheels)
  "$PY" - "$PREFIX" "$site" "$@" <<'EOF'
import os, sys, zipfile
prefix, site, wheels = sys.argv[1], sys.argv[2], sys.argv[3:]
for wheel in wheels:
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            if info.is_dir():
                continue
            top, _, rest = info.filename.partition("/")
            if top.endswith(".data"):
                kind, _, rest = rest.partition("/")
                base = {"data": prefix, "scripts": os.path.join(prefix, "bin")}.get(kind, site)
            else:
                base, rest = site, info.filename
            dest = os.path.join(base, rest)
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            with z.open(info) as src, open(dest, "wb") as out:
                out.write(src.read())
            os.chmod(dest, 0o755 if (info.external_attr >> 16) & 0o111 else 0o644)
EOF
}

# the bundle's wheels under $PREFIX (all of them, or only the pure-Python ones with DEVICE_MPI=system)
wheels=(.device/whl/*.whl)
[ "$MODE" = system ] && wheels=(.device/whl/pytest_mpi-*.whl .device/whl/threadpoolctl-*.whl .device/whl/tqdm-*.whl)
site=$("$PY" -c "import sys, sysconfig; print(sysconfig.get_path('purelib', vars={'base': sys.argv[1]}))" "$PREFIX")
platsite=$("$PY" -c "import sys, sysconfig; print(sysconfig.get_path('platlib', vars={'platbase': sys.argv[1]}))" \
    "$PREFIX")
if [ "${DEVICE_NO_PIP:-0}" != 1 ] && "$PY" -m pip --version >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --ignore-installed --no-compile --disable-pip-version-check \
      --prefix "$PREFIX" "${wheels[@]}" >>"$LOG" 2>&1
else
  echo "device_run: no pip here: unpacking the wheels" | tee -a "$LOG"
  unpack_wheels "${wheels[@]}" >>"$LOG" 2>&1
fi || {
  echo "device_run: the wheels in .device/whl would not install (run scripts/device_bundle.sh here first):" >&2
  tail -n 20 "$LOG" >&2
  exit 2
}
export PYTHONPATH=$platsite:$site${PYTHONPATH:+:$PYTHONPATH}
if [ "$MODE" != system ]; then
  export PATH=$PREFIX/bin:$PATH LD_LIBRARY_PATH=$PREFIX/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  export MPI4PY_LIBMPI=$PREFIX/lib/libmpi.so.12
fi
export MPISGD_DATA=$PWD/.device/fashion-mnist PYTHONUNBUFFERED=1
[ -w "${HOME:-/nonexistent}" ] || export CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-/tmp/cupy-kernel-cache}  # compiled kernels
echo "- the bundle's wheels (DEVICE_MPI=$MODE): ${wheels[*]##*/}" >>"$GPU_CHECK_NOTES"
echo "- Fashion-MNIST: $MPISGD_DATA" >>"$GPU_CHECK_NOTES"

# its steps write to files of their own, so nothing left behind by a stopped step can hold this pipe open
PYTHON=$PY timeout -k 10 450 bash scripts/gpu_check.sh 2>&1 | tee -a "$LOG"
rc=${PIPESTATUS[0]}
if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
  echo "device_run: gpu_check.sh ran past 450 s and was stopped" | tee -a "$LOG"
fi
echo "device_run: exit $rc; results in $GPU_CHECK_RESULTS${OUT:+, copied to $OUT}"
exit "$rc"

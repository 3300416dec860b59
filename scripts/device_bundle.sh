#!/usr/bin/env bash
# Here (with internet): gather into .device/ (git-ignored) what a bare GPU machine without internet lacks for
# scripts/gpu_check.sh, for its Python (3.12 unless DEVICE_PYTHON says otherwise):
#   whl/  mpich 5.0.2 (MPI library and mpiexec) and mpi4py 4.1.2, binary wheels; pytest-mpi 0.6 (the GPU
#         tests run under mpiexec with --with-mpi); threadpoolctl and tqdm (mpisgd's own requirements,
#         pure Python: the checkout is run from PYTHONPATH, not pip-installed)
#   fashion-mnist/  the four IDX files, from $MPISGD_DATA or the Debian package's directory
#   manifest.txt    each file's size and sha256
# About 45.7 MB (43.5 MiB); the device tool carries at most 64 MiB in all, so this stops above 60 MiB.
# Then, there, from the repository root with .device carried along:
#   bash scripts/device_run.sh     # installs the wheels under /tmp/mpi, runs gpu_check.sh, copies results to $OUT
# CuPy is not bundled: the GPU machine brings its own (cupy-cuda13x there; docs/gpu.md).
set -euo pipefail
cd "$(dirname "$0")/.." || exit 2
PY=${DEVICE_PYTHON:-3.12}
rm -rf .device/whl
mkdir -p .device/whl .device/fashion-mnist
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PY" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 -d .device/whl \
    mpich==5.0.2 mpi4py==4.1.2 pytest-mpi==0.6 threadpoolctl==3.8.0 tqdm==4.70.1
src=${MPISGD_DATA:-/usr/share/datasets/fashion-mnist}
for f in train-images-idx3-ubyte.gz train-labels-idx1-ubyte.gz t10k-images-idx3-ubyte.gz t10k-labels-idx1-ubyte.gz; do
  cp "$src/$f" .device/fashion-mnist/
done
(cd .device && find whl fashion-mnist -type f | sort | while read -r f; do
   printf '%10d  %s  %s\n' "$(stat -c %s "$f")" "$(sha256sum "$f" | cut -d' ' -f1)" "$f"
 done) >.device/manifest.txt
cat .device/manifest.txt
bytes=$(du -sb .device | cut -f1)
echo "device_bundle: .device holds $bytes bytes ($(du -sh .device | cut -f1))"
if [ "$bytes" -gt $((60 << 20)) ]; then
  echo "device_bundle: over 60 MiB: the device tool carries at most 64 MiB in all" >&2
  exit 1
fi

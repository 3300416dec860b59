#!/usr/bin/env bash
# Here (with internet): gather what a bare GPU machine lacks for scripts/gpu_check.sh into .device/
# (git-ignored): the MPICH and mpi4py wheels for its Python 3.12, and Fashion-MNIST. About 45 MB.
# Then run there, from the repository root, with .device carried along:
#   bash scripts/device_run.sh            # installs the wheels under /tmp, runs gpu_check.sh, copies results to $OUT
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${DEVICE_PYTHON:-3.12}
mkdir -p .device/whl .device/fashion-mnist
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PY" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 -d .device/whl mpich==5.0.2 mpi4py==4.1.2
src=${MPISGD_DATA:-/usr/share/datasets/fashion-mnist}
cp "$src"/*-ubyte.gz .device/fashion-mnist/
du -sh .device

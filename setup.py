from setuptools import Extension, find_packages, setup

# The portable level's memory-bound passes and elementwise functions in C (mpisgd/portable/_passes.c,
# _functions.c): optional, since NumPy gives the same bits more slowly (mpisgd.portable.passes, .elementwise).
# No contraction into fused multiply-adds, no reassociation: their results must be IEEE's, operation by operation.
IEEE = ["-O3", "-ffp-contract=off", "-fno-fast-math", "-fno-unsafe-math-optimizations"]
HEADERS = ["mpisgd/portable/_arrays.h", "mpisgd/portable/_ieee.h"]
PASSES = Extension("mpisgd.portable._passes", ["mpisgd/portable/_passes.c"], depends=HEADERS, optional=True,
                   extra_compile_args=IEEE)
FUNCTIONS = Extension("mpisgd.portable._functions", ["mpisgd/portable/_functions.c"], depends=HEADERS, optional=True,
                      extra_compile_args=IEEE)

setup(
    name="mpisgd",
    version="0.1.0",
    description="Synchronous data-parallel deep learning over MPI, on NumPy or CuPy",
    long_description=open("README.md").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    packages=find_packages(include=["mpisgd", "mpisgd.*"]),
    ext_modules=[PASSES, FUNCTIONS],
    python_requires=">=3.10",
    install_requires=["numpy>=1.24", "mpi4py>=3.1", "threadpoolctl>=3.1", "tqdm>=4.60"],
    extras_require={
        "mpich": ["mpich"],  # an MPI library from PyPI; omit it to use the system's MPICH or Open MPI
        "plot": ["matplotlib>=3.5"],
        # CuPy for --device gpu, one wheel per CUDA major version (docs/gpu.md); never two in one environment
        "gpu-cuda13": ["cupy-cuda13x>=14"],  # CUDA 13.x
        "gpu-cuda12": ["cupy-cuda12x>=13"],  # CUDA 12.x
        # --tensorboard's event files: tensorboardX is pure Python on protobuf (no TensorFlow, no PyTorch)
        "tensorboard": ["tensorboardX>=2.6"],
        # tensorboard: its EventAccumulator reads the events back in tests/test_tensorboard.py
        # mypy: scripts/test.sh type-checks the package (mypy.ini); pytest-xdist: its serial pass runs in two workers
        "test": ["pytest>=7", "pytest-mpi>=0.6", "pytest-xdist>=3", "ruff", "mypy>=1.8", "matplotlib>=3.5",
                 "tensorboardX>=2.6", "tensorboard>=2.14"],
        "torch": ["torch"],  # PyTorch models (mpisgd.torch, docs/torch.md) and the comparison benchmarks
    },
    entry_points={"console_scripts": ["mpisgd-train=mpisgd.train:main", "mpisgd-evaluate=mpisgd.app.evaluate:main",
                                      "mpisgd-plan=mpisgd.app.plan:main", "mpisgd-sample=mpisgd.app.sample:main",
                                      "mpisgd-plot=mpisgd.app.plot:main"]},
)

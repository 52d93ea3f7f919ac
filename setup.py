"""megatron_mok: build and install.

The package is pure Python plus one CUDA shared library, ``megatron_mok/_lib/libmok_cuda.so``,
built from ``csrc/`` by ``make -C csrc`` with nvcc alone. The library has a plain C ABI
(loaded through ctypes), so it needs no torch headers and does not depend on the torch
version. The build runs when nvcc is found; the package always installs and imports without
it (``backend="cuda"`` then raises with build instructions).

Beside it, optionally, the C++ host ops (``csrc/host_ops/``, megatron_mok/cuda/host_ops.py): a
small torch extension that does a dispatch's and a combine's host side in C++, built against the
installed torch when torch and a C++ compiler are there at build time (a build without
isolation; an editable install of this setup.py project is built in isolation by pip, so
``scripts/setup.sh`` builds them after it: ``python -m megatron_mok.cuda.host_ops``); without it
the same runs in Python.

Environment switches:
    MOK_SKIP_CUDA_BUILD=1   do not build the CUDA library
    MOK_SKIP_HOST_OPS_BUILD=1  do not build the C++ host ops
    MOK_CUDA_ARCH=90a       target(s): one or a list ("90a 100a": one library, a cubin each; the
                            kernels need sm_90; 100a, Blackwell, compiles but never ran)
    CUDA_HOME / PATH        where nvcc is looked up
"""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.dist import Distribution
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
MIN_NVCC = (12, 3)


def read_version() -> str:
    text = (ROOT / "megatron_mok" / "version.py").read_text()
    return re.search(r'__version__ = "([^"]+)"', text).group(1)


def find_nvcc():
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if cuda_home and (Path(cuda_home) / "bin" / "nvcc").exists():
        return str(Path(cuda_home) / "bin" / "nvcc")
    return shutil.which("nvcc")


def nvcc_version(nvcc: str):
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    m = re.search(r"release (\d+)\.(\d+)", out)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def _load_module(relpath: str):
    """A torch-free module of the package, loaded from its file: the package itself imports
    torch at once, which a build need not have."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_mok_build_" + Path(relpath).stem, ROOT / relpath)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build_cuda_library() -> None:
    """Builds megatron_mok/_lib/libmok_cuda.so in the source tree (editable installs use it in
    place; regular installs ship it as package data)."""
    if os.environ.get("MOK_SKIP_CUDA_BUILD", "0") == "1":
        print("[megatron_mok] MOK_SKIP_CUDA_BUILD=1: not building the CUDA library")
        return
    nvcc = find_nvcc()
    if nvcc is None:
        print("[megatron_mok] nvcc not found: the CUDA library is not built "
              "(backend='cuda' unavailable; set CUDA_HOME or put nvcc on PATH to build it)")
        return
    version = nvcc_version(nvcc)
    if version < MIN_NVCC:
        sys.exit(f"[megatron_mok] nvcc {version[0]}.{version[1]} is too old: the kernels need CUDA >= "
                 f"{MIN_NVCC[0]}.{MIN_NVCC[1]} for sm_90a. Set MOK_SKIP_CUDA_BUILD=1 to install without them.")
    try:
        archs = _load_module("megatron_mok/cuda/arch.py").build_archs(os.environ.get("MOK_CUDA_ARCH"))
    except ValueError as e:
        sys.exit(f"[megatron_mok] {e}")
    out = ROOT / "megatron_mok" / "_lib"
    cmd = ["make", "-C", str(ROOT / "csrc"), f"ARCH={' '.join(archs)}", f"OUT={out}", f"NVCC={nvcc}"]
    print("[megatron_mok] building the CUDA library:", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def build_host_ops() -> None:
    """Builds the C++ host ops for the torch this install runs with, in the source tree
    (megatron_mok/_lib/host_ops/torch-<version>/). host_ops.py is loaded from its file: the
    package itself (which imports torch at once) is not imported here. Where torch or a
    compiler is missing it says so and the Python path is used."""
    _load_module("megatron_mok/cuda/host_ops.py").build(strict=False, force=False)


class BuildPyWithCuda(build_py):
    def run(self):
        build_cuda_library()
        build_host_ops()
        super().run()


class BinaryDistribution(Distribution):
    """Not a pure-Python distribution: its wheel carries libmok_cuda.so (x86_64 or aarch64 code)
    and the host ops (built for one CPython and one torch), so the wheel must be tagged for this
    interpreter and platform, not py3-none-any (which pip's wheel cache would hand to any
    Python on any machine). Decided before the build runs, hence always."""

    def has_ext_modules(self):
        return True


setup(
    name="megatron_mok",
    version=read_version(),
    description="Pull-based, deterministic MoE token dispatcher for NVLink domains (Megatron-Core plugin)",
    long_description=(ROOT / "README.md").read_text(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_mok", "megatron_mok.*"]),
    package_data={"megatron_mok": ["_lib/*.so", "_lib/host_ops/*/*.so"]},
    install_requires=["torch>=2.6"],
    extras_require={
        "megatron": ["megatron-core>=0.16"],
        "test": ["pytest", "numpy"],
        "bench": ["numpy", "matplotlib"],
    },
    cmdclass={"build_py": BuildPyWithCuda},
    distclass=BinaryDistribution,
    entry_points={"console_scripts": ["mok-launch=megatron_mok.launch:main"]},
)

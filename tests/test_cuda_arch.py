"""MOK_CUDA_ARCH: the architectures the CUDA library is built for (CPU; no real compiler).

``megatron_mok/cuda/arch.py`` parses it; setup.py hands the list to ``make -C csrc``, whose
Makefile writes one ``-gencode`` per entry. Checked here: the parsing (lists, defaults, refusals
with a message), the Makefile's expansion, and setup.py's build end to end in a copy of the
tree with a stand-in nvcc that records its arguments.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

from megatron_mok.cuda.arch import DEFAULT, build_archs

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("value, archs", [
    (None, [DEFAULT]), ("", [DEFAULT]), ("  ", [DEFAULT]),
    ("90a", ["90a"]), ("90a 100a", ["90a", "100a"]), ("90a,100a", ["90a", "100a"]),
    (" 100a , 90a ,", ["100a", "90a"]), ("90a 90a 100f", ["90a", "100f"]), ("90 120a", ["90", "120a"]),
])
def test_build_archs_reads_one_or_a_list(value, archs):
    assert build_archs(value) == archs


@pytest.mark.parametrize("value, message", [
    ("sm_90a", "'sm_90a' is not an architecture"), ("compute_90", "is not an architecture"),
    ("9.0", "is not an architecture"), ("90a hopper", "'hopper' is not an architecture"),
    ("80", "sm_80 is older than sm_90"), ("90a 86a", "sm_86a is older than sm_90"),
])
def test_build_archs_refuses_what_nvcc_or_the_kernels_cannot_take(value, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        build_archs(value)


def _gencodes(arch: str):
    r = subprocess.run(["make", "-C", os.path.join(REPO, "csrc"), "-n", "-B", f"ARCH={arch}",
                        "NVCC=nvcc", "OUT=/nonexistent"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return re.findall(r"-gencode=\S+", r.stdout)


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_the_makefile_writes_one_gencode_per_architecture():
    assert _gencodes("90a") == ["-gencode=arch=compute_90a,code=sm_90a"]
    assert _gencodes("90a 100a") == ["-gencode=arch=compute_90a,code=sm_90a",
                                     "-gencode=arch=compute_100a,code=sm_100a"]


FAKE_NVCC = r"""#!/usr/bin/env bash
case " $* " in *" --version "*) echo "Cuda compilation tools, release 13.0, V13.0.88"; exit 0 ;; esac
echo "$*" > "$FAKE_NVCC_ARGS"
while [ $# -gt 0 ]; do [ "$1" = "-o" ] && out="$2"; shift; done
: > "$out"
"""


@pytest.fixture
def tree_copy(tmp_path):
    """setup.py, csrc/ and the package in a scratch folder (setup.py builds into its own tree),
    with a stand-in nvcc under CUDA_HOME."""
    if shutil.which("make") is None:
        pytest.skip("needs make")
    dst = tmp_path / "tree"
    shutil.copytree(REPO, dst, ignore=shutil.ignore_patterns(
        ".git", ".venv", ".whl", ".cuda12", ".carry", "_lib", "__pycache__", "tests", "benchmarks",
        "*.egg-info", ".mutants*", ".megatron_releases", "build", "docs", "examples", "scripts"))
    cuda = tmp_path / "cuda"
    (cuda / "bin").mkdir(parents=True)
    (cuda / "bin" / "nvcc").write_text(FAKE_NVCC)
    (cuda / "bin" / "nvcc").chmod(0o755)
    env = dict(os.environ, CUDA_HOME=str(cuda), MOK_SKIP_HOST_OPS_BUILD="1",
               FAKE_NVCC_ARGS=str(tmp_path / "nvcc_args"))
    return dst, env, tmp_path / "nvcc_args"


def _build(dst, env, **more):
    return subprocess.run([sys.executable, "setup.py", "-q", "build_py", "-d", str(dst / "out")],
                          cwd=dst, env=dict(env, **more), capture_output=True, text=True, timeout=300)


def test_setup_builds_every_architecture_of_the_list(tree_copy):
    dst, env, args = tree_copy
    r = _build(dst, env, MOK_CUDA_ARCH="90a,100a")
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.findall(r"-gencode=\S+", args.read_text()) == [
        "-gencode=arch=compute_90a,code=sm_90a", "-gencode=arch=compute_100a,code=sm_100a"]
    assert (dst / "megatron_mok" / "_lib" / "libmok_cuda.so").exists()


def test_setup_refuses_a_bad_architecture_before_compiling(tree_copy):
    dst, env, args = tree_copy
    r = _build(dst, env, MOK_CUDA_ARCH="sm_90a")
    assert r.returncode != 0
    assert "MOK_CUDA_ARCH: 'sm_90a' is not an architecture" in r.stderr
    assert not args.exists()

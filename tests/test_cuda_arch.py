"""MOK_CUDA_ARCH: the architectures the CUDA library is built for (CPU; no real compiler).

``megatron_mok/cuda/arch.py`` parses it; setup.py hands the list to ``make -C csrc``, whose
Makefile writes one ``-gencode`` per entry. Checked here: the parsing (lists, defaults, refusals
with a message) and the Makefile's expansion; setup.py's build with a list is in
test_build_from_source.py.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess

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

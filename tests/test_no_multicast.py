"""NVLink multicast (NVLS, ``multimem``, ``cuMulticastCreate``) must never be used: on the GPU
machines this project is developed on it can take the host's GPUs out of service for a day.
Every launcher keeps ``NCCL_NVLS_ENABLE=0``, ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` and
``NVSHMEM_DISABLE_NVLS=1`` set. These checks are static or CPU-only, so a new launcher that
forgets them fails CI before it ever reaches a GPU."""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WANT = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
# What sets them in Python: the package import (megatron_mok/__init__.py), the benchmarks'
# common module (its import), the named helpers, or the variable written out.
PY_SETTERS = re.compile(r"^\s*(import megatron_mok|from megatron_mok\b|import common\b|from harness import|"
                        r"import harness\b)|set_safe_env\(|disable_multicast_env\(|dist_env_defaults\(|"
                        r"NCCL_NVLS_ENABLE", re.M)
PY_LAUNCHES = re.compile(r"init_process_group|torch\.distributed\.run|\btorchrun\b|mp\.spawn\(")


def _clean_env():
    env = {k: v for k, v in os.environ.items() if k not in WANT}
    env["PYTHONPATH"] = os.pathsep.join([REPO, os.path.join(REPO, "benchmarks")])
    return env


@pytest.mark.parametrize("module", ["megatron_mok", "common"])
def test_importing_sets_every_variable(module):
    """``import megatron_mok`` and the benchmarks' ``common`` set all three (as defaults: a
    user's explicit value is theirs)."""
    code = f"import os, {module}; print([os.environ.get(k) for k in {sorted(WANT)!r}])"
    out = subprocess.run([sys.executable, "-c", code], env=_clean_env(), capture_output=True, text=True,
                         timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == str([WANT[k] for k in sorted(WANT)])


def test_the_device_scripts_common_file_exports_every_variable():
    text = open(os.path.join(REPO, "scripts", "device_runs", "common.sh")).read()
    for k, v in WANT.items():
        assert re.search(rf"^export .*\b{k}={v}\b", text, re.M), k


def _shell_launchers():
    files = sorted(glob.glob(os.path.join(REPO, "scripts", "device_runs", "*.sh"))
                   + glob.glob(os.path.join(REPO, "examples", "*.sh")))
    return [f for f in files if os.path.basename(f) != "common.sh"]


@pytest.mark.parametrize("path", _shell_launchers(), ids=os.path.basename)
def test_every_shell_launcher_sets_the_variables(path):
    text = open(path).read()
    if not re.search(r"\bpython3?\b|\btorchrun\b", text):
        return
    if re.search(r"^\s*(\.|source)\s+.*common\.sh", text, re.M):
        return
    missing = [k for k, v in WANT.items() if not re.search(rf"\b{k}={v}\b", text)]
    assert not missing, f"{os.path.relpath(path, REPO)} runs Python without {missing} (source common.sh)"


def _python_launchers():
    out = []
    for d in ("benchmarks", "scripts", "examples", "megatron_mok"):
        for f in sorted(glob.glob(os.path.join(REPO, d, "**", "*.py"), recursive=True)):
            if PY_LAUNCHES.search(open(f, errors="replace").read()):
                out.append(f)
    return out


def test_there_are_python_launchers_to_check():
    names = {os.path.relpath(f, REPO) for f in _python_launchers()}
    assert {"benchmarks/bench_dispatch_combine.py", "megatron_mok/bench.py", "examples/train_gpt_moe.py"} <= names


@pytest.mark.parametrize("path", _python_launchers(), ids=lambda p: os.path.relpath(p, REPO))
def test_every_python_launcher_sets_the_variables(path):
    text = open(path, errors="replace").read()
    if os.path.relpath(path, REPO).startswith("megatron_mok" + os.sep):
        return   # inside the package: its import has set them (test above)
    assert PY_SETTERS.search(text), (f"{os.path.relpath(path, REPO)} starts distributed work but neither "
                                     "imports megatron_mok / benchmarks' common nor sets the no-multicast "
                                     "variables")

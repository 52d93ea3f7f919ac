"""NVLink multicast (NVLS, ``multimem``, ``cuMulticastCreate``) must never be used: on the GPU
machines this project is developed on it can take the host's GPUs out of service for a day.
Every launcher keeps ``NCCL_NVLS_ENABLE=0``, ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` and
``NVSHMEM_DISABLE_NVLS=1`` set. These checks are static or CPU-only, so a new launcher that
forgets them fails CI before it ever reaches a GPU."""

from __future__ import annotations

import ast
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


# Device-side multicast has two doors: the PTX instructions (`multimem.ld_reduce`, `multimem.st`,
# `multimem.red`) and the driver / runtime calls that make a multicast object. Neither may appear
# in the compiled sources (csrc/ and the benchmarks' microbenchmarks), in any spelling.
_MULTICAST_IN_SOURCE = re.compile(r"multimem|Multicast|\bmc_ptr|multicast_ptr", re.I)


def _compiled_sources():
    exts = ("cu", "cuh", "h", "hpp", "cpp", "cc")
    return sorted(f for d in ("csrc", os.path.join("benchmarks", "micro"))
                  for ext in exts for f in glob.glob(os.path.join(REPO, d, "**", f"*.{ext}"), recursive=True))


def test_there_are_compiled_sources_to_check():
    names = {os.path.relpath(f, REPO) for f in _compiled_sources()}
    assert {"csrc/kernels/dispatch_transfer.cu", "csrc/host_ops/host_ops.cpp",
            "benchmarks/micro/sm_ceiling.cu"} <= names, names


@pytest.mark.parametrize("path", _compiled_sources(), ids=lambda p: os.path.relpath(p, REPO))
def test_no_compiled_source_names_multicast(path):
    hits = [f"{i}: {line.strip()}" for i, line in enumerate(open(path, errors="replace"), 1)
            if _MULTICAST_IN_SOURCE.search(line)]
    assert not hits, f"{os.path.relpath(path, REPO)} names NVLink multicast: {hits[:5]}"


def test_the_source_check_finds_a_planted_multimem_instruction():
    planted = 'asm volatile("multimem.ld_reduce.relaxed.sys.global.add.f32 %0, [%1];" : "=f"(v) : "l"(p));'
    assert _MULTICAST_IN_SOURCE.search(planted)
    assert _MULTICAST_IN_SOURCE.search("cuMulticastCreate(&handle, &prop);")
    assert not _MULTICAST_IN_SOURCE.search("ld.acquire.sys.global.u64 %0, [%1];")


# The Python side's doors: torch's symmetric-memory multicast ops (`multimem_all_reduce_`,
# `multimem_one_shot_all_reduce`, ...) and a rendezvous handle's `multicast_ptr`. Names and
# attributes only (the AST), so comments and messages that say what is never used stay free.
_MULTICAST_IN_PYTHON = re.compile(r"multimem|multicast_ptr|^mc_ptr$|multicast_create", re.I)


def _multicast_uses(text: str):
    out = []
    for node in ast.walk(ast.parse(text)):
        name = (node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name)
                else None)
        if name and _MULTICAST_IN_PYTHON.search(name):
            out.append(f"{node.lineno}: {name}")
    return out


def _python_sources():
    return sorted(f for d in ("megatron_mok", "benchmarks", "scripts", "examples")
                  for f in glob.glob(os.path.join(REPO, d, "**", "*.py"), recursive=True))


@pytest.mark.parametrize("path", _python_sources(), ids=lambda p: os.path.relpath(p, REPO))
def test_no_python_source_uses_multicast(path):
    uses = _multicast_uses(open(path, errors="replace").read())
    assert not uses, f"{os.path.relpath(path, REPO)} uses NVLink multicast: {uses[:5]}"


def test_the_python_check_finds_a_planted_multicast_use():
    assert _multicast_uses("ptr = handle.multicast_ptr\n") == ["1: multicast_ptr"]
    assert _multicast_uses("symm_mem.multimem_all_reduce_(t, 'sum', group)\n") == ["1: multimem_all_reduce_"]
    assert _multicast_uses("# never handle.multicast_ptr\nx = 'multimem'\n") == []

"""Markers, automatic skips and the end-of-session cleanup of the spawn harness.

Markers (also listed by ``pytest --markers``):

- ``gpu``: needs a CUDA device (skipped without one).
- ``multigpu``: needs at least 2 CUDA devices (skipped with fewer).
- ``megatron``: needs ``megatron.core`` importable (skipped without it).

Shared helpers live in ``harness.py`` (spawn harness, seeded inputs, bitwise asserts) and
``oracle.py`` (the independent oracle); this folder is on ``sys.path`` so tests, including
those in sub-folders, import them as ``from harness import ...``.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

# Loopback ranks (threads sharing this process's CUDA context, test_cuda_loopback.py) need
# every kernel loaded when the context starts: a lazy load can wait for peer kernels that
# spin until the loading rank launches (megatron_mok.loopback). Spawned ranks stay lazy.
os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")
# ... and a hardware work queue per stream: with CUDA's default of 8, the 16+ streams of an
# 8-rank loopback run share queues, and a rank's kernel can queue behind a peer's work that
# waits for it (megatron_mok.loopback; the W=8 stalls of session 5, benchmarks/NOTES.md).
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")

import harness  # noqa: E402  (sets the no-multicast environment before anything else runs)
import torch  # noqa: E402

# The tests use tiny tensors; with spawned ranks sharing the cores, more intra-op threads
# only oversubscribe the CPU (seen: 300x slower small ops under load).
if not torch.cuda.is_available():
    torch.set_num_threads(1)

MARKERS = {
    "gpu": "needs a CUDA device; skipped without one",
    "multigpu": "needs >= 2 CUDA devices; skipped with fewer",
    "megatron": "needs megatron-core (megatron.core importable); skipped without it",
}


def pytest_configure(config):
    for name, text in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {text}")


def _cuda_count() -> int:
    try:
        import torch
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:
        return 0


def _have_megatron() -> bool:
    try:
        return importlib.util.find_spec("megatron.core") is not None
    except (ImportError, ValueError):
        return False


def pytest_collection_modifyitems(config, items):
    n_gpu = _cuda_count()
    have_mcore = None
    for item in items:
        if "gpu" in item.keywords and n_gpu == 0:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU (none visible)"))
        # shared-GPU mode (harness.SHARED_GPU): the ranks run as processes on fewer GPUs
        if "multigpu" in item.keywords and n_gpu < 2 and not (harness.SHARED_GPU and n_gpu >= 1):
            item.add_marker(pytest.mark.skip(reason=f"needs >= 2 CUDA GPUs, found {n_gpu} "
                                                    f"(or MOK_TEST_SHARED_GPU=1 and one GPU)"))
        if "megatron" in item.keywords:
            if have_mcore is None:
                have_mcore = _have_megatron()
            if not have_mcore:
                item.add_marker(pytest.mark.skip(reason="needs megatron-core (pip install megatron-core)"))


_GPU_MEMORY_LOG = os.environ.get("MOK_TEST_LOG_GPU_MEMORY", "")


@pytest.hookimpl(trylast=True)
def pytest_runtest_logfinish(nodeid, location):
    """``MOK_TEST_LOG_GPU_MEMORY=PATH``: after each test, append the GPU memory each process
    holds (``nvidia-smi``; no CUDA context in this process) to PATH: where a device run's
    memory goes when tests run one after another (diagnostics, NOTES item 33)."""
    if not _GPU_MEMORY_LOG:
        return
    import subprocess
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True,
                             timeout=20).stdout
    except Exception as e:  # no nvidia-smi: say so in the log, never fail a test over it
        out = f"nvidia-smi failed: {e}"
    procs = [line.split(",") for line in out.strip().splitlines() if "," in line]
    total = sum(int(mib) for _, mib in procs if mib.strip().isdigit())
    with open(_GPU_MEMORY_LOG, "a") as f:
        f.write(f"{nodeid}\t{len(procs)} processes\t{total} MiB\t"
                f"{' '.join(f'{p.strip()}:{m.strip()}' for p, m in procs)}\n")


_EXIT_WATCHDOG_S = float(os.environ.get("MOK_TEST_EXIT_WATCHDOG_S", "0") or 0)


def pytest_sessionfinish(session, exitstatus):
    # ``MOK_TEST_EXIT_WATCHDOG_S=N``: a process still alive N s from here (the pools' shutdown,
    # the summary and the interpreter's exit included) reports its live children and thread
    # stacks and exits 86 (tests/exit_watchdog.py; s28-2 reached 100 % and did not exit).
    if _EXIT_WATCHDOG_S > 0:
        import exit_watchdog
        exit_watchdog.arm(_EXIT_WATCHDOG_S)
    harness.shutdown_pools()

"""Megatron integration tests: markers and import paths.

The spawn harness is the project's (``tests/harness.py``: ``run_distributed``, gloo on CPU,
NCCL on GPU, free ports); this folder adds its worker module to ``sys.path`` so spawned
ranks can import the functions by name.

Markers used here (registered again so this folder also runs on its own):

- ``megatron``: needs megatron-core.
- ``gpu`` / ``multigpu``: need 1 / 2 CUDA devices; skipped otherwise, with the reason.
- ``megatron_training``: needs ``megatron.training`` (Megatron-LM's argument parser): in the
  megatron-core 0.19 wheel, or a Megatron-LM checkout named by ``$MEGATRON_LM_PATH``.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

_HERE = os.path.dirname(os.path.abspath(__file__))
_TESTS = os.path.dirname(_HERE)
for p in (_TESTS, _HERE, os.path.dirname(_TESTS)):
    if p not in sys.path:
        sys.path.insert(0, p)

import harness  # noqa: E402  (tests/harness.py; the parent conftest imported it already)

_MARKERS = {
    "gpu": "needs a CUDA device; skipped without one",
    "multigpu": "needs >= 2 CUDA devices; skipped with fewer",
    "megatron": "needs megatron-core (megatron.core importable); skipped without it",
    "megatron_training": "needs megatron.training (0.19 wheel, or $MEGATRON_LM_PATH)",
}


def pytest_configure(config):
    known = "\n".join(config.getini("markers"))
    for name, text in _MARKERS.items():
        if f"{name}:" not in known:
            config.addinivalue_line("markers", f"{name}: {text}")


def megatron_lm_path():
    """A Megatron-LM checkout to take ``megatron.training`` from, if one is named."""
    path = os.environ.get("MEGATRON_LM_PATH")
    if path and os.path.isdir(os.path.join(path, "megatron", "training")):
        return path
    return None


def have_megatron_training() -> bool:
    if megatron_lm_path():
        return True
    try:
        return importlib.util.find_spec("megatron.training") is not None
    except (ImportError, ValueError):
        return False


def _cuda_count() -> int:
    try:
        import torch
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:
        return 0


def pytest_collection_modifyitems(config, items):
    n_gpu = None
    for item in items:
        if _HERE not in str(item.fspath):
            continue
        if "megatron_training" in item.keywords and not have_megatron_training():
            item.add_marker(pytest.mark.skip(
                reason="needs megatron.training: megatron-core 0.19 wheel, or set "
                       "MEGATRON_LM_PATH to a Megatron-LM checkout (core_r0.16.0 .. core_r0.19.0)"))
        if "gpu" in item.keywords or "multigpu" in item.keywords:
            n_gpu = _cuda_count() if n_gpu is None else n_gpu
            need = 2 if "multigpu" in item.keywords else 1
            if harness.SHARED_GPU:
                need = 1        # shared-GPU mode: ranks as processes on one GPU
            if n_gpu < need:
                item.add_marker(pytest.mark.skip(
                    reason=f"needs {need} CUDA GPU(s), found {n_gpu}: run on the GPU machine"))
        if "megatron" in item.keywords and importlib.util.find_spec("megatron") is None:
            item.add_marker(pytest.mark.skip(reason="needs megatron-core (pip install megatron-core)"))

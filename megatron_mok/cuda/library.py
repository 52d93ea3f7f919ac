"""Loads ``libmok_cuda.so``, the compiled kernels (``csrc/``), through ctypes.

The library exports a plain C ABI (``csrc/api/mok_api.h``): no torch headers, so one build
works with any torch version, and CI can compile it with nvcc alone. It is looked up in
``$MOK_CUDA_LIB``, then next to this package (``megatron_mok/_lib/``), where
``python setup.py build_ext --inplace`` or ``pip install .`` puts it.
"""

from __future__ import annotations

import ctypes
import os
import threading
from pathlib import Path
from typing import Optional

_LIB_NAME = "libmok_cuda.so"
_lib: Optional[ctypes.CDLL] = None
_load_error: Optional[str] = None
_load_lock = threading.Lock()
_arch: dict = {}          # device index -> (binaryVersion or None, why not)

BUILD_HINT = (
    "the MoK CUDA library is not built. Build it with nvcc >= 12.3 on PATH (or CUDA_HOME set): "
    "`pip install --no-build-isolation -e .` or `python setup.py build_ext --inplace` in the "
    "megatron_mok checkout (MOK_CUDA_ARCH=90a by default); or point MOK_CUDA_LIB at a built "
    f"{_LIB_NAME}.")


def library_path() -> Path:
    env = os.environ.get("MOK_CUDA_LIB")
    if env:
        return Path(env)
    return Path(__file__).resolve().parent.parent / "_lib" / _LIB_NAME


def _load() -> Optional[ctypes.CDLL]:
    # Locked, and published only once its signatures are declared: another thread (loopback
    # ranks) must never call an undeclared function (ctypes would truncate pointers to int).
    global _lib, _load_error
    with _load_lock:
        if _lib is not None or _load_error is not None:
            return _lib
        path = library_path()
        if not path.exists():
            _load_error = f"{path} does not exist"
            return None
        try:
            lib = ctypes.CDLL(str(path))
        except OSError as e:  # wrong arch, missing driver, ...
            _load_error = f"{path} failed to load: {e}"
            return None
        from .bindings import declare
        try:
            declare(lib)
        except OSError as e:  # a stale build (other ABI version)
            _load_error = f"{path} cannot be used: {e}"
            return None
        _lib = lib
        return _lib


def is_available() -> bool:
    """True when the compiled library loads (it does not need a GPU to load)."""
    return _load() is not None


def get() -> ctypes.CDLL:
    """The loaded library; raises ``RuntimeError`` with build instructions if absent."""
    lib = _load()
    if lib is None:
        raise RuntimeError(f"backend='cuda' is unavailable: {_load_error}. {BUILD_HINT}")
    return lib


def kernel_arch(device_index: int) -> tuple:
    """``(arch, why_not)`` of the library's code on GPU ``device_index``: ``arch`` is what that
    GPU runs (``mok_kernel_arch``, e.g. 90 for the default sm_90a build), ``None`` when the
    library holds no code it can run (built for another architecture: ``why_not`` says so) or
    does not load. Asked once per device (``auto`` asks it for every call)."""
    if device_index not in _arch:
        lib = _load()
        if lib is None:
            return None, f"backend='cuda' is unavailable: {_load_error}"
        arch = lib.mok_kernel_arch(int(device_index))
        _arch[device_index] = (arch, None) if arch > 0 else (None, lib.mok_last_error().decode())
    return _arch[device_index]


def unsupported_gpu_message(device_index: int, why_not: str) -> str:
    """The error of ``backend='cuda'`` on a GPU the library has no code for."""
    import torch

    name = torch.cuda.get_device_name(device_index)
    major, minor = torch.cuda.get_device_capability(device_index)
    return (f"backend='cuda' cannot run on cuda:{device_index} ({name}, compute capability "
            f"{major}.{minor}): the MoK CUDA library holds no code for it ({why_not}). Its kernels "
            f"are built for the architectures MOK_CUDA_ARCH names at build time (default sm_90a: "
            f"H100, H200, GH200; MOK_CUDA_ARCH='90a 100a' adds sm_100a: B200, GB200, compiled but "
            f"never run on one). Otherwise use backend='reference' (slow), or Megatron's "
            f"alltoall / flex dispatcher.")

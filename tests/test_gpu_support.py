"""Which GPUs the CUDA backend runs on, decided before anything is allocated (CPU, stand-ins).

The library is built for one architecture (sm_90a by default: Hopper). On another GPU (an A100,
a B200) its kernels cannot run; ``mok_kernel_arch`` says so, and then ``backend="auto"`` picks
the reference backend (the Megatron dispatcher warns) and ``backend="cuda"`` raises a message
naming the GPU, before any workspace or collective, instead of failing at its first launch.
The real library's answer: ``test_cuda_library_abi.py`` (no device here: -1 with a message; an
H200: 90, a GPU test).
"""

import types

import pytest
import torch

import megatron_mok as mok
from megatron_mok.cuda import library


class _Lib:
    """A library stand-in: ``mok_kernel_arch`` answers ``archs[device]`` (-1: no code)."""

    def __init__(self, archs):
        self.archs, self.asked = archs, []

    def mok_kernel_arch(self, device):
        self.asked.append(device)
        return self.archs.get(device, -1)

    def mok_last_error(self):
        return b"mok_kernel_arch: no code for device 1: no kernel image is available"


@pytest.fixture
def stand_in(monkeypatch):
    def install(archs):
        lib = _Lib(archs)
        monkeypatch.setattr(library, "_load", lambda: lib)
        monkeypatch.setattr(library, "_arch", {})
        return lib
    return install


def test_kernel_arch_is_asked_once_per_device(stand_in):
    lib = stand_in({0: 90})
    assert library.kernel_arch(0) == (90, None)
    assert library.kernel_arch(0) == (90, None)
    assert library.kernel_arch(1) == (None, "mok_kernel_arch: no code for device 1: no kernel "
                                            "image is available")
    assert library.kernel_arch(1)[0] is None
    assert lib.asked == [0, 1]


def test_kernel_arch_without_the_library(monkeypatch):
    monkeypatch.setattr(library, "_load", lambda: None)
    monkeypatch.setattr(library, "_load_error", "/x/libmok_cuda.so does not exist")
    monkeypatch.setattr(library, "_arch", {})
    arch, why = library.kernel_arch(0)
    assert arch is None and "does not exist" in why


def test_auto_picks_cuda_only_where_the_library_has_code(stand_in, monkeypatch):
    stand_in({0: 90})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(library, "is_available", lambda: True)
    assert mok.available_backends() == ["reference", "cuda"]
    assert mok.available_backends(torch.device("cuda", 1)) == ["reference"]
    assert mok.available_backends(1) == ["reference"]
    assert mok.available_backends(torch.device("cuda")) == ["reference", "cuda"]   # current: 0
    buf = mok.Buffer(None, num_experts=4, hidden=16, topk=2, max_tokens_per_rank=8,
                     device=torch.device("cuda", 1))
    assert buf.backend == "reference"
    buf.device = torch.device("cuda", 0)
    assert buf.backend == "cuda"
    monkeypatch.setattr(library, "is_available", lambda: False)
    assert mok.available_backends(0) == ["reference"]


def test_cuda_backend_names_the_gpu_it_cannot_run_on(stand_in, monkeypatch):
    stand_in({0: 90})
    from megatron_mok.cuda.backend import CudaBackend

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: "NVIDIA A100-SXM4-80GB")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: (8, 0))
    buf = types.SimpleNamespace(hidden=16, combine_partial_dtype=torch.bfloat16, dtype=torch.bfloat16,
                                world_size=2, topk=2, _cuda_device=lambda: torch.device("cuda", 1))
    # The refusal comes before anything is made: the stand-in has no mok_create, so a backend
    # that went on would raise AttributeError, not this RuntimeError.
    with pytest.raises(RuntimeError) as info:
        CudaBackend(buf)
    msg = str(info.value)
    for words in ("cuda:1 (NVIDIA A100-SXM4-80GB, compute capability 8.0)", "no kernel image",
                  "sm_90a", "backend='reference'", "alltoall / flex"):
        assert words in msg, words

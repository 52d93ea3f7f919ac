"""Where a CUDA-backend dispatch's arrays lie in their one allocation
(``CudaBackend._handle_arrays``, benchmarks/NOTES.md item 71), checked without a GPU: the
layout's scratch at the start (the library carves it from that pointer), the counts and the
rows' sources after it, each 256-byte aligned, none overlapping another or running past the
block; and the old one-tensor-each layout (``separate_allocations``) alike in shapes and dtypes.
The kernels writing them are compared with the reference on GPUs (``test_cuda_loopback.py``'s
one-block against separate-allocations test, and every CUDA test's dispatches)."""

import pytest
import torch

from harness import small_buffer
from megatron_mok.cuda import backend as cuda_backend


def bare_backend(scratch_bytes: int, num_experts: int, world_size: int = 1):
    """A CudaBackend without ``__init__``: only what ``_handle_arrays`` reads."""
    b = object.__new__(cuda_backend.CudaBackend)
    b.buf = small_buffer(num_experts=num_experts)
    b.buf.num_local_experts = num_experts // world_size
    b.scratch_bytes = scratch_bytes
    return b


def span(t: torch.Tensor):
    """``[start, end)`` bytes of ``t``'s elements in its storage (an empty view's data_ptr() is
    0, its storage offset is where it would start)."""
    start = t.storage_offset() * t.element_size()
    return start, start + t.numel() * t.element_size()


@pytest.mark.parametrize("scratch_bytes", [1, 64, 255, 256, 257, 4096 + 8])
@pytest.mark.parametrize("num_experts", [2, 4, 62, 64])
@pytest.mark.parametrize("rows", [None, 0, 1, 7, 1000])
def test_arrays_are_aligned_disjoint_and_inside_their_block(scratch_bytes, num_experts, rows):
    b = bare_backend(scratch_bytes, num_experts)
    scratch, tpe, src = b._handle_arrays(torch.device("cpu"), rows)
    E2 = num_experts + 2
    assert scratch.storage_offset() == 0   # the library's scratch pointer is the block's
    assert tpe.untyped_storage().data_ptr() == scratch.data_ptr()
    end = scratch.numel() * scratch.element_size()
    assert scratch.is_contiguous() and end >= scratch_bytes
    spans = [(0, scratch_bytes), span(tpe)]
    assert tpe.dtype == torch.int64 and tuple(tpe.shape) == (E2,) and tpe.is_contiguous()
    if rows is None:
        assert src is None
    else:
        assert src.dtype == torch.int64 and tuple(src.shape) == (2, rows) and src.is_contiguous()
        assert src.untyped_storage().data_ptr() == scratch.data_ptr()
        spans.append(span(src))
    for start, stop in spans:
        assert start % 256 == 0 and 0 <= start <= stop <= end, (start, stop, end)
    for (a0, a1), (b0, b1) in zip(spans, spans[1:]):
        assert a1 <= b0, f"arrays overlap: [{a0}, {a1}) and [{b0}, {b1})"
    # Every array is its own storage's part: writing one leaves the others as they were.
    scratch.view(torch.uint8)[:scratch_bytes].fill_(0xAB)
    tpe.fill_(-5)
    if src is not None:
        src.fill_(7)
        assert (src == 7).all()
    assert (tpe == -5).all() and (scratch.view(torch.uint8)[:scratch_bytes] == 0xAB).all()


@pytest.mark.parametrize("rows", [None, 0, 9])
def test_separate_allocations_give_the_same_shapes(rows):
    b = bare_backend(100, 4)
    one = b._handle_arrays(torch.device("cpu"), rows)
    b.separate_allocations = True
    sep = b._handle_arrays(torch.device("cpu"), rows)
    assert sep[0].dtype == torch.uint8 and sep[0].numel() == 100
    for a, s in zip(one[1:], sep[1:]):
        assert (a is None) == (s is None)
        if a is not None:
            assert a.shape == s.shape and a.dtype == s.dtype
    assert sep[0].data_ptr() != sep[1].data_ptr()

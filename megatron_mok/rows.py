"""Where a row source may start: the kernels, the copy-engine staging and the FP8 pair's in-place
read move rows as 16-byte vectors (int4 loads and stores), so every source of rows starts at a
multiple of 16 bytes (the rows themselves are multiples of 16 bytes: the CUDA backend checks
``hidden % 8 == 0`` when it is made, the FP8 pair checks its widths in ``fp8.dispatch_rows``)."""

from __future__ import annotations

import torch

ROW_ALIGN = 16


def aligned_rows(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a contiguous copy of it when its data pointer is not a multiple of
    ``ROW_ALIGN`` (16) bytes: a view at an element offset, e.g. ``big.view(-1)[1:].view(T, H)``
    or a slice of a gradient that autograd handed over (the allocator aligns the copy).

    Copied, not refused: a refusal on one rank would leave its peers, which go on into the
    call, waiting for it until their timeout, and the copy costs one read and one write of the
    rows on this rank alone (no peer needs to know: the rows' size and layout do not change).
    Tensors without elements are read by nobody (the library checks no pointer of a call
    without tokens) and pass as they are."""
    if t.numel() and t.data_ptr() % ROW_ALIGN:
        return t.clone(memory_format=torch.contiguous_format)
    return t

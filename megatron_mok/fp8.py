"""FP8 dispatch: tokens travel as FP8 with their per-block scales, about half the bytes of bf16.

``Buffer.dispatch((x_fp8, scales), topk_idx, topk_weights)`` takes DeepEP's FP8 input, a pair of

- ``x_fp8``: ``[T, H]`` ``torch.float8_e4m3fn`` (or ``float8_e5m2``), contiguous;
- ``scales``: ``[T, S]`` contiguous, ``float32`` (DeepSeek-V3 / DeepEP: one scale per 128
  columns, :func:`quantize`) or a one-byte dtype (``float8_e8m0fnu`` / ``uint8``: MXFP8's one
  scale per 32 columns),

and returns ``tokens = (rows_fp8 [R, H], row_scales [R, S])`` in the same expert-major order,
padding and layout as a bf16 dispatch of the same routing. Everything else (``probs``, counts,
handle, ``combine`` in the Buffer's dtype) is unchanged.

How: a dispatch moves rows as bytes, one byte row per token, ``[FP8 token | scales | zero
padding to 16 bytes]``. When the token row and the scale row are multiples of 16 bytes (DeepEP's
1x128 float32 scales for any ``H`` that is a multiple of 512), the dispatch reads the two in place
(:class:`PairRows`: the CUDA kernels and copy engine take each 16-byte vector from the source it
lies in; no pack); otherwise the pair is packed first (:func:`pack`). The received rows are
handed back as two views of the ``[R, P]`` byte rows (:func:`unpack`): no copy on the receiving
side, so ``rows_fp8`` has row stride ``P`` (the row's bytes), not ``H``. Call
``.contiguous()`` where a kernel needs dense rows. The packed row must fit the Buffer's token row
(``P <= H x`` the Buffer's element size): always true for a bf16 Buffer with 128-column float32
scales (``P = 1.03 H``).

Gradients: the FP8 pair is data, not differentiable. ``probs`` stays differentiable with respect
to ``topk_weights``: its backward is a combine that carries only the prob gradients (rows 8
zeros wide, ``CudaBackend.combine_prob_grads``), a small fraction of a full combine's time. The
usual FP8 training step dispatches FP8 forward and computes the gradient of the bf16 tokens with
``combine`` of the expert-side gradients, as DeepEP's users do.
"""

from __future__ import annotations

import os
from typing import Optional, Tuple

import torch

from .rows import ROW_ALIGN, aligned_rows

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# Scales: float32 (one per 128 columns, DeepEP) or one byte (MXFP8's E8M0 exponents).
SCALE_DTYPES = (torch.float32, torch.uint8) + (
    (torch.float8_e8m0fnu,) if hasattr(torch, "float8_e8m0fnu") else ())
E4M3_MAX = 448.0


def quantize(x: torch.Tensor, block: int = 128) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-token FP8 E4M3 with one float32 scale per ``block`` columns (DeepSeek-V3's
    activation format, DeepEP's ``per_token_cast_to_fp8``).

    Args:
        x: ``[T, H]`` bf16 / fp16 / fp32, ``H`` a multiple of ``block``.
        block: columns per scale.

    Returns:
        ``(x_fp8 [T, H] float8_e4m3fn, scales [T, H / block] float32)`` with
        ``x ~= x_fp8 * scale`` per block (:func:`dequantize`); a block's largest magnitude
        maps to 448 (an all-zero block gets scale 1e-4 / 448 and zeros).
    """
    if x.dim() != 2:
        raise ValueError(f"x must be [T, H], got {tuple(x.shape)}")
    T, H = x.shape
    if block <= 0 or H % block != 0:
        raise ValueError(f"hidden {H} is not a multiple of the scale block {block}")
    xv = x.float().view(T, H // block, block)
    amax = xv.abs().amax(dim=2).clamp(min=1e-4)
    q = (xv * (E4M3_MAX / amax).unsqueeze(2)).to(torch.float8_e4m3fn).view(T, H)
    return q, amax / E4M3_MAX


def dequantize(x_fp8: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``[T, H]`` in ``dtype`` from :func:`quantize`'s pair (or a dispatch's rows of it; strided
    views are fine). ``scales`` must be float32, ``H`` a multiple of its columns."""
    T, H = x_fp8.shape
    S = scales.shape[1]
    if S == 0 or H % S != 0:
        raise ValueError(f"hidden {H} is not a multiple of the {S} scale columns")
    blocks = x_fp8.float().view(T, S, H // S) * scales.float().unsqueeze(2)
    return blocks.view(T, H).to(dtype)


def packed_row_bytes(hidden: int, scale_cols: int, scale_dtype: torch.dtype) -> int:
    """``P``: bytes of one packed row (FP8 token, scales, zero padding to 16 bytes)."""
    raw = hidden + scale_cols * scale_dtype.itemsize
    return (raw + ROW_ALIGN - 1) // ROW_ALIGN * ROW_ALIGN


def pack(x_fp8: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``[T, P]`` uint8: each token's FP8 bytes, then its scales' bytes, then zeros.

    On a GPU with the compiled library and 16-byte widths (``H`` and the scale row multiples of
    16 bytes: DeepEP's 1x128 float32 scales whenever ``H`` is a multiple of 512) one kernel
    (``mok_pack_rows``); otherwise two strided copies in the widest integer type that divides
    the widths. Not ``torch.cat``: its CUDA path cost ~160-210 us of host time per call
    (run s22-5); the two torch copies ~20 us each at 128 tokens (s22-6), the kernel one launch."""
    T, H = x_fp8.shape
    scale_bytes = _bytes_of(scales.contiguous())  # [T, S x scale bytes]
    sb = scale_bytes.shape[1]
    P = packed_row_bytes(H, scales.shape[1], scales.dtype)
    out = torch.empty(T, P, dtype=torch.uint8, device=x_fp8.device)
    if T and x_fp8.is_cuda and _pack_on_device(out, x_fp8, scale_bytes, H, sb, P):
        return out
    unit = _copy_dtype(H, sb)
    out[:, :H].view(unit).copy_(x_fp8.view(torch.uint8).view(unit))
    out[:, H:H + sb].view(unit).copy_(scale_bytes.view(unit))
    if P > H + sb:
        out[:, H + sb:].zero_()
    return out


class PairRows:
    """An FP8 pair handed to a backend as the ``[T, P]`` byte rows it stands for, not packed:
    row ``t`` is ``fp8``'s row ``t`` (``H`` bytes) then ``scales``' row ``t`` (``P - H`` bytes).

    It answers what a backend asks of packed rows (``shape``, ``dtype`` uint8, ``device``,
    ``element_size()``, ``numel()``, ``data_ptr()``: the FP8 rows'), so sizes and allocations are
    unchanged. The CUDA backend gives the library both pointers and it reads the two sources in
    place (C ABI 15, NOTES #57): no pack kernel, no packed copy. The reference backend packs
    (:meth:`packed`). It holds the pair's own tensors (no byte views: pointers and widths are all
    a backend reads, and each view is host time per call, NOTES item 25). Built by
    :func:`dispatch_rows` only when both widths are multiples of 16 bytes, which depends on the
    shapes alone, so every rank of a call makes the same choice."""

    __slots__ = ("fp8", "scales", "shape", "device")
    dtype = torch.uint8

    def __init__(self, x_fp8: torch.Tensor, scales: torch.Tensor, scale_row_bytes: int):
        self.fp8, self.scales = x_fp8, scales
        self.shape = torch.Size((x_fp8.shape[0], x_fp8.shape[1] + scale_row_bytes))
        self.device = x_fp8.device

    def element_size(self) -> int:
        return 1

    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    def data_ptr(self) -> int:
        return self.fp8.data_ptr()

    def second_ptr(self) -> int:
        return self.scales.data_ptr()

    def tensors(self) -> Tuple[torch.Tensor, torch.Tensor]:
        return self.fp8, self.scales

    def packed(self) -> torch.Tensor:
        """The ``[T, P]`` uint8 rows themselves (a copy: :func:`pack` of the pair, whose widths
        are multiples of 16, so ``P`` is their sum)."""
        return pack(self.fp8, self.scales)


def pack_always() -> bool:
    """``MOK_FP8_PACK=1``: pack every pair (the A/B of NOTES #57). A Buffer reads it once, when it
    is made (an environment read is ~1 us of host time per call)."""
    return os.environ.get("MOK_FP8_PACK") == "1"


def dispatch_rows(x_fp8: torch.Tensor, scales: torch.Tensor, packed: Optional[bool] = None):
    """What a dispatch moves for the pair: :class:`PairRows` (read in place) when the FP8 row and
    the scale row are multiples of 16 bytes (DeepEP's 1x128 float32 scales whenever ``H`` is a
    multiple of 512; MXFP8's one-byte scales whenever ``H`` is a multiple of 512), else the
    packed rows (:func:`pack`). A source that is not 16-byte aligned (a view at an odd offset) is
    copied first, so the choice stays a function of the shapes only. ``packed=True`` packs
    always; ``None``: as :func:`pack_always` says now (``MOK_FP8_PACK=1``; every rank must set
    the same, else the rows' layouts differ and the dispatch raises a configuration mismatch)."""
    H = x_fp8.shape[1]
    sb = scales.shape[1] * scales.element_size()   # the scale row's bytes
    if packed is None:
        packed = pack_always()
    if H % ROW_ALIGN or sb % ROW_ALIGN or packed:
        return pack(x_fp8, scales)
    return PairRows(aligned_rows(x_fp8), aligned_rows(scales), sb)


def _pack_on_device(out, x_fp8, scale_bytes, H: int, sb: int, P: int) -> bool:
    """``mok_pack_rows`` into ``out`` when the widths and pointers allow it and the library
    loads; False (nothing done) otherwise."""
    if H % 16 or sb % 16 or (x_fp8.data_ptr() | scale_bytes.data_ptr()) & 15:
        return False
    from .cuda import library
    from .cuda.backend import current_stream_ptr
    if not library.is_available():
        return False
    lib = library.get()
    dev = x_fp8.device.index
    args = (out.data_ptr(), P, x_fp8.data_ptr(), H, scale_bytes.data_ptr(), sb, x_fp8.shape[0])
    if dev == torch.cuda.current_device():   # the usual case: no device switch around the launch
        rc = lib.mok_pack_rows(current_stream_ptr(dev), *args)
    else:
        with torch.cuda.device(dev):
            rc = lib.mok_pack_rows(current_stream_ptr(dev), *args)
    if rc != 0:
        raise RuntimeError(f"megatron_mok: FP8 pack failed: {lib.mok_last_error().decode()}")
    return True


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """``[T, C]`` contiguous rows as ``[T, C x element size]`` uint8 (a view). An empty tensor
    may carry any strides (``quantize`` of 0 tokens with one scale column gives (1, 0)), which
    ``view`` refuses: it gets a fresh empty byte tensor instead (there is nothing to view)."""
    if t.shape[0] == 0:
        return torch.empty(0, t.shape[1] * t.element_size(), dtype=torch.uint8, device=t.device)
    return t.view(torch.uint8)


def _copy_dtype(*widths: int) -> torch.dtype:
    """The widest of int64 / int32 / int16 / uint8 whose size divides every width in bytes
    (and so every offset and the packed row's stride, a multiple of 16)."""
    for dt in (torch.int64, torch.int32, torch.int16):
        if all(w % dt.itemsize == 0 for w in widths):
            return dt
    return torch.uint8


def unpack(rows: torch.Tensor, hidden: int, fp8_dtype: torch.dtype, scale_cols: int,
           scale_dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
    """Views of packed rows ``[R, P]`` uint8: ``(rows_fp8 [R, hidden], row_scales [R, scale_cols])``
    with row strides ``P`` and ``P / scale size`` (no copy; one ``as_strided`` each, about half
    the host time of slicing then viewing)."""
    R, P = rows.shape
    esize = scale_dtype.itemsize
    x = torch.as_strided(rows, (R, hidden), (P, 1)).view(fp8_dtype)
    s = torch.as_strided(rows.view(scale_dtype), (R, scale_cols), (P // esize, 1),
                         rows.storage_offset() // esize + hidden // esize)
    return x, s


def is_fp8_pair(x) -> bool:
    """Whether a dispatch's ``x`` is an FP8 pair (a tuple, as DeepEP takes it), not a token tensor."""
    return isinstance(x, tuple)

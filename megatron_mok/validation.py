"""Input checks shared by every backend. They run before any communication, so bad input
raises on the rank that passed it instead of hanging its peers."""

from __future__ import annotations

from typing import Optional

import torch

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)


def check_buffer_args(world_size: int, num_experts: int, hidden: int, topk: int,
                      max_tokens_per_rank: int, dtype: torch.dtype) -> None:
    if not isinstance(num_experts, int) or num_experts <= 0:
        raise ValueError(f"num_experts must be a positive int, got {num_experts!r}")
    if num_experts % world_size != 0:
        raise ValueError(
            f"num_experts={num_experts} is not divisible by the group size {world_size}: "
            "experts are split contiguously, E/W per rank")
    if not isinstance(hidden, int) or hidden <= 0:
        raise ValueError(f"hidden must be a positive int, got {hidden!r}")
    if not isinstance(topk, int) or not 1 <= topk <= num_experts:
        raise ValueError(f"topk must be an int in [1, num_experts={num_experts}], got {topk!r}")
    if not isinstance(max_tokens_per_rank, int) or max_tokens_per_rank < 0:
        raise ValueError(f"max_tokens_per_rank must be an int >= 0, got {max_tokens_per_rank!r}")
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"dtype must be one of {SUPPORTED_DTYPES}, got {dtype}")


def check_dispatch_inputs(buf, x: torch.Tensor, topk_idx: torch.Tensor,
                          topk_weights: torch.Tensor, check_values: bool = True,
                          fp8: bool = False) -> None:
    """Shape/dtype/device checks for ``Buffer.dispatch``.

    ``check_values`` reads ``topk_idx`` on the host to check the expert-id range; the CUDA
    backend passes False and checks the range on the device instead (no host sync).
    ``fp8``: ``x`` is the FP8 half of a pair :func:`check_fp8_pair` checked (any FP8 dtype).
    """
    _check_tensor("x", x)
    _check_tensor("topk_idx", topk_idx)
    _check_tensor("topk_weights", topk_weights)
    if not fp8 and x.dtype != buf.dtype:
        raise TypeError(f"x must have the Buffer's dtype {buf.dtype}, got {x.dtype}")
    if x.dim() != 2 or x.shape[1] != buf.hidden:
        raise ValueError(f"x must be [T, hidden={buf.hidden}], got {tuple(x.shape)}")
    num_tokens = x.shape[0]
    if num_tokens > buf.max_tokens_per_rank:
        raise ValueError(
            f"x has T={num_tokens} tokens, more than max_tokens_per_rank={buf.max_tokens_per_rank}")
    if not x.is_contiguous():
        raise ValueError("x must be contiguous (call .contiguous())")
    if topk_idx.dtype not in INDEX_DTYPES:
        raise TypeError(f"topk_idx must be int32 or int64, got {topk_idx.dtype}")
    if tuple(topk_idx.shape) != (num_tokens, buf.topk):
        raise ValueError(
            f"topk_idx must be [T={num_tokens}, topk={buf.topk}], got {tuple(topk_idx.shape)}")
    if topk_weights.dtype != torch.float32:
        raise TypeError(f"topk_weights must be float32, got {topk_weights.dtype}")
    if tuple(topk_weights.shape) != (num_tokens, buf.topk):
        raise ValueError(
            f"topk_weights must be [T={num_tokens}, topk={buf.topk}], got {tuple(topk_weights.shape)}")
    for name, t in (("topk_idx", topk_idx), ("topk_weights", topk_weights)):
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but x is on {x.device}")
    buf._check_device(x.device, "x")
    if check_values and num_tokens > 0:
        lo, hi = int(topk_idx.min()), int(topk_idx.max())
        if lo < -1 or hi >= buf.num_experts:
            raise ValueError(
                f"topk_idx holds expert ids in [{lo}, {hi}], outside [-1, num_experts={buf.num_experts})")


def check_rows_per_expert(buf, rows_per_expert) -> None:
    """``Buffer.dispatch(rows_per_expert=N)``: ``N`` rows for every local expert."""
    if rows_per_expert is None:
        return
    n = rows_per_expert
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise ValueError(f"rows_per_expert must be None or an int >= 0, got {n!r}")
    total = buf.num_local_experts * n
    if total >= 2 ** 31:
        raise ValueError(f"rows_per_expert={n} makes {total} rows (E_local={buf.num_local_experts} "
                         "x N), more than the layout's 32-bit row indices hold")
    if n % buf.expert_alignment != 0:
        raise ValueError(f"rows_per_expert={n} is not a multiple of the Buffer's "
                         f"expert_alignment={buf.expert_alignment}")
    if buf.max_recv_tokens is not None and total > buf.max_recv_tokens:
        raise ValueError(f"rows_per_expert={n} makes R = E_local x N = {total} rows, more than "
                         f"max_recv_tokens={buf.max_recv_tokens}")


def check_recv_budget(buf, recv_budget, rows_per_expert=None) -> None:
    """``Buffer.dispatch(recv_budget=M)``: at most ``M`` rows for this rank, the rest dropped."""
    if recv_budget is None:
        return
    m = recv_budget
    if not isinstance(m, int) or isinstance(m, bool) or m < 0:
        raise ValueError(f"recv_budget must be None or an int >= 0, got {m!r}")
    if m >= 2 ** 31:
        raise ValueError(f"recv_budget={m} is more rows than the layout's 32-bit row indices hold")
    if rows_per_expert is not None:
        raise ValueError("pass rows_per_expert or recv_budget, not both: rows_per_expert already "
                         "fixes the rows (E_local x N)")
    if m % buf.expert_alignment != 0:
        # Each expert's rows start at a multiple of A; a budget that is one too keeps every
        # count of the rows kept a multiple of A (what an FP8 grouped GEMM needs).
        raise ValueError(f"recv_budget={m} is not a multiple of the Buffer's "
                         f"expert_alignment={buf.expert_alignment}")


def check_cached_dispatch_inputs(buf, x: torch.Tensor, handle) -> None:
    """Checks for ``Buffer.dispatch(x, handle=...)``."""
    _check_handle(buf, handle)
    _check_tensor("x", x)
    if x.dtype != buf.dtype:
        raise TypeError(f"x must have the Buffer's dtype {buf.dtype}, got {x.dtype}")
    if tuple(x.shape) != (handle.num_tokens, buf.hidden):
        raise ValueError(f"x must be [T={handle.num_tokens}, hidden={buf.hidden}] (the handle's "
                         f"dispatch), got {tuple(x.shape)}")
    if not x.is_contiguous():
        raise ValueError("x must be contiguous (call .contiguous())")
    buf._check_device(x.device, "x")


def check_fp8_pair(buf, x, num_tokens=None):
    """Checks for an FP8 dispatch's ``x = (x_fp8, scales)`` (``megatron_mok/fp8.py``);
    returns the pair. ``num_tokens``: the ``T`` it must have (a cached dispatch's handle)."""
    from . import fp8

    if len(x) != 2:
        raise ValueError(f"an FP8 dispatch takes x = (x_fp8, scales), got a sequence of {len(x)}")
    x_fp8, scales = x
    _check_tensor("x_fp8", x_fp8)
    _check_tensor("scales", scales)
    if x_fp8.dtype not in fp8.FP8_DTYPES:
        raise TypeError(f"x_fp8 must be one of {fp8.FP8_DTYPES}, got {x_fp8.dtype}")
    if scales.dtype not in fp8.SCALE_DTYPES:
        raise TypeError(f"scales must be one of {fp8.SCALE_DTYPES}, got {scales.dtype}")
    if x_fp8.dim() != 2 or x_fp8.shape[1] != buf.hidden:
        raise ValueError(f"x_fp8 must be [T, hidden={buf.hidden}], got {tuple(x_fp8.shape)}")
    T = x_fp8.shape[0]
    if num_tokens is not None and T != num_tokens:
        raise ValueError(f"x_fp8 must be [T={num_tokens}, hidden={buf.hidden}] (the handle's "
                         f"dispatch), got {tuple(x_fp8.shape)}")
    if scales.dim() != 2 or scales.shape[0] != T or scales.shape[1] < 1:
        raise ValueError(f"scales must be [T={T}, S >= 1], got {tuple(scales.shape)}")
    for name, t in (("x_fp8", x_fp8), ("scales", scales)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous (call .contiguous())")
        if t.requires_grad:
            raise ValueError(f"{name} requires grad, but an FP8 dispatch is not differentiable with "
                             "respect to its tokens (dispatch bf16 tokens for that)")
    if scales.device != x_fp8.device:
        raise ValueError(f"scales is on {scales.device} but x_fp8 is on {x_fp8.device}")
    buf._check_device(x_fp8.device, "x_fp8")
    if buf.hidden % scales.dtype.itemsize:
        raise ValueError(f"hidden={buf.hidden} is not a multiple of the {scales.dtype} scales' "
                         f"{scales.dtype.itemsize} bytes: the packed row's scales would be misaligned")
    row = fp8.packed_row_bytes(buf.hidden, scales.shape[1], scales.dtype)
    token_row = buf.hidden * buf.dtype.itemsize
    if row > token_row:
        raise ValueError(
            f"an FP8 row with its {scales.shape[1]} {scales.dtype} scales packs into {row} bytes, "
            f"more than the Buffer's token row ({buf.hidden} x {buf.dtype} = {token_row} bytes) "
            "that the staging ring holds")
    return x_fp8, scales


def check_cached_fp8_inputs(buf, x, handle):
    """Checks for ``Buffer.dispatch((x_fp8, scales), handle=...)``; returns the pair."""
    _check_handle(buf, handle)
    return check_fp8_pair(buf, x, handle.num_tokens)


def _check_handle(buf, handle) -> None:
    """``handle`` is a :class:`DispatchHandle` made by ``buf``. Compared by ``Buffer.serial``,
    never reused, not by ``id(buf)``: a new Buffer at a freed Buffer's address would otherwise
    take that Buffer's stale handles (and combine along another layout, silently)."""
    from .handle import DispatchHandle

    if not isinstance(handle, DispatchHandle):
        raise TypeError(f"handle must be a DispatchHandle, got {type(handle).__name__}")
    if handle.buffer_id != buf.serial:
        raise ValueError(
            f"handle was made by another Buffer (serial {handle.buffer_id}; this Buffer's is "
            f"{buf.serial}): a handle is only valid with the Buffer whose dispatch made it, and "
            "not once that Buffer is destroyed")


def check_handle_backend(handle, backend_name: str) -> None:
    """``handle`` was made by the backend this call runs on (its ``state`` is that backend's
    layout). Not reachable through the API today: a Buffer keeps the device of its first call
    (``Buffer._check_device``) and picks its backend from the device, so all its calls use one
    backend; this keeps a handle from reaching the other backend's code if that ever changes
    (each backend reads its own layout class from ``handle.state``: the other's would fail deep
    inside with an AttributeError, or read the wrong data if the layouts ever share a field)."""
    if handle.backend != backend_name:
        raise ValueError(f"handle was made by this Buffer's {handle.backend!r} backend, but this "
                         f"call runs on its {backend_name!r} backend (tensors on another device "
                         "type than the dispatch's?)")


def check_combine_inputs(buf, expert_out: torch.Tensor, handle) -> None:
    _check_handle(buf, handle)
    _check_tensor("expert_out", expert_out)
    if expert_out.dtype != buf.dtype:
        raise TypeError(f"expert_out must have the Buffer's dtype {buf.dtype}, got {expert_out.dtype}")
    expected = (handle.num_out_rows, buf.hidden)
    if tuple(expert_out.shape) != expected:
        raise ValueError(f"expert_out must be {list(expected)} (rows of the dispatch), "
                         f"got {tuple(expert_out.shape)}")
    if not expert_out.is_contiguous():
        raise ValueError("expert_out must be contiguous (call .contiguous())")
    buf._check_device(expert_out.device, "expert_out")


def _check_tensor(name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")


def recv_overflow_message(rank: int, rows: int, max_recv_tokens: int) -> str:
    """A static-shape dispatch's error: rank ``rank`` received more rows than its capacity."""
    return (f"rank {rank} received {rows} rows, more than max_recv_tokens={max_recv_tokens}; "
            "raise max_recv_tokens (static-shape mode)")


def rows_per_expert_message(rank: int, expert: int, rows: int, rows_per_expert: int) -> str:
    """A drop-and-pad dispatch's error: a local expert of ``rank`` got more than ``N`` rows."""
    return (f"megatron_mok: rank {rank}: local expert {expert} received {rows} rows, more than "
            f"rows_per_expert={rows_per_expert}; the capacity must hold every routed row")


def ranks_text(ranks) -> str:
    """``0-3, 6`` for ``[0, 1, 2, 3, 6]`` (sorted ranks)."""
    ranks = list(ranks)
    parts, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            parts.append(str(start) if start == r else f"{start}-{r}")
            start = None
    return ", ".join(parts)


def disagreement(fields, every, show=None):
    """What differs between the ranks' values of ``fields`` (``every[r]``: rank ``r``'s values,
    in ``fields``' order; ``show(field, value)`` prints a value), one clause per field that
    differs: ``"hidden: 7168 on ranks 0-2, 4096 on rank 3"``; ``None`` when all agree."""
    show = show or (lambda field, value: str(value))
    clauses = []
    for i, name in enumerate(fields):
        by_value = {}
        for r, row in enumerate(every):
            by_value.setdefault(row[i], []).append(r)
        if len(by_value) > 1:
            clauses.append(f"{name}: " + ", ".join(
                f"{show(name, v)} on rank{'s' if len(rs) > 1 else ''} {ranks_text(rs)}"
                for v, rs in sorted(by_value.items(), key=lambda kv: kv[1][0])))
    return "; ".join(clauses) or None


def buffer_layout(buf) -> list:
    """``[(name, value, show)]``: the Buffer arguments that every rank of its group must share
    (its peers read its rows, partial sums and routing as their own arguments say), each as
    an int (dtypes as their index in :data:`SUPPORTED_DTYPES`) and how to print it."""
    def dtype_name(v):
        return str(SUPPORTED_DTYPES[v]).removeprefix("torch.")
    return [("num_experts", buf.num_experts, str), ("hidden", buf.hidden, str), ("topk", buf.topk, str),
            ("max_tokens_per_rank", buf.max_tokens_per_rank, str),
            ("dtype", SUPPORTED_DTYPES.index(buf.dtype), dtype_name),
            ("combine_partial_dtype", SUPPORTED_DTYPES.index(buf.combine_partial_dtype), dtype_name),
            ("expert_alignment", buf.expert_alignment, str)]


def layout_error(fields, every, also: str = "") -> Optional[str]:
    """The error every rank raises when the ranks' values of ``fields`` (``[(name, mine,
    show)]``; ``every[r]``: rank ``r``'s values in that order) differ, naming each field and
    which ranks hold which value; ``None`` when all agree. ``also``: what else must be the
    same, for the message (NOTES item 63)."""
    shows = {name: show for name, _, show in fields}
    diff = disagreement([name for name, _, _ in fields], every, lambda name, v: shows[name](v))
    if diff is None:
        return None
    return (f"megatron_mok: the ranks of this group made their Buffers with different workspace "
            f"layouts ({diff}); every rank must make it with the same num_experts, hidden, topk, "
            f"max_tokens_per_rank, dtype, combine_partial_dtype and expert_alignment{also} (in "
            f"Megatron: the same model config and MOK_* variables on every rank)")

"""Small, exact collectives used by the reference backend.

Everything travels as raw bytes (``uint8`` views), so gloo and NCCL both carry any dtype
bit-for-bit, and the reference backend needs nothing beyond ``all_gather``. A group may also
be a loopback rank (``megatron_mok.loopback``: ranks as threads of one process), whose
collectives go through its hub.
"""

from __future__ import annotations

from typing import List, Optional

import torch
import torch.distributed as dist

from .loopback import current as current_loopback
from .loopback import is_loopback


def resolve_group(group):
    """``group``, or for ``None`` inside a loopback run (``loopback.run``) the thread's
    loopback rank: there ``None`` means "the default group" as it does in a normal run."""
    return current_loopback() if group is None else group


def group_rank_size(group) -> tuple[int, int]:
    """``(rank, world_size)`` of ``group``; ``(0, 1)`` when torch.distributed is not initialised."""
    if is_loopback(group):
        return group.rank, group.world_size
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise ValueError("a process group was given but torch.distributed is not initialised")
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def all_gather_exact(t: torch.Tensor, group, world_size: int) -> torch.Tensor:
    """Gather ``t`` (same shape on every rank) into ``[W, *t.shape]``, bit-exact."""
    t = t.contiguous()
    if world_size == 1 or t.numel() == 0:   # nothing to exchange (T_max = 0 gives empty tensors)
        return t.unsqueeze(0).expand(world_size, *t.shape).clone()
    if is_loopback(group):
        return group.all_gather(t)
    flat = t.view(-1).view(torch.uint8) if t.numel() else t.new_empty(0, dtype=torch.uint8)
    outs: List[torch.Tensor] = [torch.empty_like(flat) for _ in range(world_size)]
    dist.all_gather(outs, flat, group=group)
    return torch.stack(outs).view(t.dtype).view(world_size, *t.shape)


def all_gather_ints(values: List[int], group, world_size: int, device) -> torch.Tensor:
    """Gather a short list of host ints from every rank: ``[W, len(values)]`` int64 on ``device``."""
    t = torch.tensor(values, dtype=torch.int64, device=device)
    return all_gather_exact(t, group, world_size)


def pad_rows(t: torch.Tensor, rows: int, fill: Optional[float] = 0) -> torch.Tensor:
    """Pad ``t`` along dim 0 to ``rows`` rows with ``fill``."""
    if t.shape[0] == rows:
        return t
    out = t.new_full((rows, *t.shape[1:]), fill)
    out[: t.shape[0]] = t
    return out

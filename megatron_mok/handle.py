"""Result and handle types returned by :meth:`megatron_mok.Buffer.dispatch`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Tuple, Union

import torch


@dataclass(eq=False)
class DispatchHandle:
    """The layout of one dispatch, reused by ``combine`` and by both backward passes.

    Attributes:
        buffer_id: ``Buffer.serial`` of the :class:`~megatron_mok.Buffer` that made it: a
            number unique in the process and never reused (``id(buf)`` would be: a Buffer
            made after that one is freed can get its address and would then take a stale
            handle, with wrong results). A handle is only valid with that Buffer, and not
            after its ``destroy()``; any other Buffer refuses it.
        backend: name of the backend that made it (``"reference"`` or ``"cuda"``): ``state``
            is that backend's, and only that backend of the Buffer takes the handle.
        num_tokens: ``T``, the number of tokens this rank passed to ``dispatch``.
        num_rows: ``R``, the number of expert-major rows this rank received, or ``None``
            in static-shape mode, where it stays on the device (see ``num_rows_device``).
        num_out_rows: rows of ``tokens`` as allocated (``R``, or ``max_recv_tokens`` in
            static-shape mode).
        src_rank: ``[num_out_rows]`` int64, source rank of each row (-1 for padding rows).
        src_token: ``[num_out_rows]`` int64, token index on the source rank (-1 for padding).
        tokens_per_expert: ``[E_local]`` int64, rows per local expert.
        num_rows_device: ``[1]`` int64 on the device, ``R`` (the rows written: with a receive
            budget at most ``M``).
        over_budget: ``[1]`` bool on the device for a dispatch with ``recv_budget=M``: True
            when this rank received more than ``M`` rows and dropped the rest; ``None``
            otherwise (nothing is ever dropped then).
        rows_received: ``[1]`` int64 on the device for a dispatch with ``recv_budget``: the
            rows this rank received before the budget (``R`` if nothing was dropped); ``None``
            otherwise.
        state: backend-private layout (index tensors, sequence numbers); not part of the API.
    """

    buffer_id: int
    backend: str
    num_tokens: int
    num_rows: Optional[int]
    num_out_rows: int
    src_rank: torch.Tensor
    src_token: torch.Tensor
    tokens_per_expert: torch.Tensor
    num_rows_device: torch.Tensor
    state: Any = field(repr=False, default=None)
    over_budget: Optional[torch.Tensor] = None
    rows_received: Optional[torch.Tensor] = None


@dataclass(eq=False)
class DispatchResult:
    """What :meth:`megatron_mok.Buffer.dispatch` returns.

    Attributes:
        tokens: ``[R, H]`` (``[max_recv_tokens, H]`` in static-shape mode), the Buffer's
            dtype; one row per routed slot whose expert lives on this rank, in contract
            order (local expert, source rank, source token, slot). Differentiable w.r.t. ``x``.
            For an FP8 dispatch the pair ``(rows_fp8 [R, H], row_scales [R, S])``
            (``megatron_mok/fp8.py``), not differentiable.
        probs: ``[R]`` float32, the router weight of each row's slot (0 on padding rows).
            Differentiable w.r.t. ``topk_weights``. ``None`` for a cached dispatch.
        tokens_per_expert: ``[E_local]`` int64 on ``x``'s device.
        src_rank: ``[R]`` int64, where each row came from.
        src_token: ``[R]`` int64, the token index on ``src_rank``.
        handle: the :class:`DispatchHandle` to pass to ``combine``.
    """

    tokens: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]
    probs: Optional[torch.Tensor]
    tokens_per_expert: torch.Tensor
    src_rank: torch.Tensor
    src_token: torch.Tensor
    handle: DispatchHandle

    @property
    def over_budget(self) -> Optional[torch.Tensor]:
        """``handle.over_budget``: ``[1]`` bool on the device, True when a dispatch with
        ``recv_budget`` dropped rows on this rank; ``None`` without a budget."""
        return self.handle.over_budget

"""Megatron-core 0.19's static per-rank receive budget (``moe_expert_rank_capacity_factor``)
with the ``mok`` dispatcher.

What Megatron does with it (0.19, HybridEP / NCCL EP ``flex`` backends): each dispatch gets a
fixed number of output rows, ``int(T x topk x factor)`` rounded up to Megatron's quantization
pad multiple (``_HybridEPManager.setup_metadata``), so it needs no host read; the routes past it
are dropped and an ``over_budget`` device flag accumulates (``check_over_budget()``).
``megatron.training`` wraps its forward-backward function in ``PagedStashRunner`` whenever the
factor is set: after each step it all-reduces every MoE layer's flag; if any rank dropped, it
clears ``token_dispatcher._comm_manager.moe_expert_rank_capacity_factor`` on every layer, calls
``reset_over_budget()``, zeroes the gradients, resets a full-iteration CUDA graph and reruns
the step dropless; after a step that dropped nothing it restores the factor from
``token_dispatcher.config``. ``moe_paged_stash`` (the fused TE experts' activation stash) sizes
its buffers from that static row count.

What MoK does (:class:`~megatron_mok.megatron.dispatcher.MokTokenDispatcher`): with the factor
set (and no drop-and-pad, whose ``rows_per_expert`` wins, as in HybridEP) every dispatch passes
``recv_budget=M`` to ``Buffer.dispatch`` (:func:`rank_budget`): ``M`` rows out, the received rows
first, zero rows after; rows past ``M`` are dropped and flagged in the handle's ``over_budget``,
which the dispatcher ORs into :attr:`RankBudget.over_budget` on the device (no host read).
:class:`RankBudget` is the dispatcher's ``_comm_manager``, the object ``PagedStashRunner``
reaches through; with its factor ``None`` (the rerun) the dispatch is MoK's dropless one.

The experts then get ``M`` rows and device counts that sum to the kept rows only
(:func:`expert_rows_mode`): experts that take that (``PADDED``: 0.19's fused ``TEGroupedMLP``,
``use_transformer_engine_op_fuser``, as HybridEP feeds it) get all ``M`` rows, and nothing of the
MoE layer reads the host (the full-iteration CUDA graph can capture it); experts that split
their rows by ``tokens_per_expert.tolist()`` (``EXACT``: ``SequentialMLP``, unfused
``TEGroupedMLP``, 0.16's legacy ``GroupedMLP``) get the kept rows only, one host read of the
handle's row count per layer and call (as a dropless dispatch has one), and their output is
padded back to ``M`` rows with zeros for the combine.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from .config import MokConfigError, rank_capacity_factor_problem

# What the experts are handed under a budget (MokTokenDispatcher.budget_rows).
PADDED = "padded"   # all M rows, device counts summing to the kept rows: no host read
EXACT = "exact"     # the kept rows only (one host read), output padded back to M rows

# An attribute an experts module may set to say which it takes (True: PADDED, False: EXACT),
# read by expert_rows_mode before its own rules (custom expert classes, tests).
TAKES_PADDED_ROWS_ATTR = "mok_takes_padded_rows"


class RankBudget:
    """The dispatcher's ``_comm_manager``: the per-rank budget's factor and its flag.

    Megatron's ``PagedStashRunner`` (0.19) reaches through ``token_dispatcher._comm_manager``
    (HybridEP's manager there): it sets ``moe_expert_rank_capacity_factor`` to ``None`` before
    its dropless rerun and back to ``token_dispatcher.config``'s after a step that dropped
    nothing. Every ``mok`` dispatcher has one, factor set or not, so that its ``hasattr`` checks
    never meet a missing attribute.

    Attributes:
        moe_expert_rank_capacity_factor: ``None`` (no budget: MoK's dropless dispatch) or the
            factor of :func:`rank_budget`, read at every dispatch.
        over_budget: ``[1]`` bool on the Buffer's device, ``True`` once a budgeted dispatch of
            this layer dropped rows on this rank since the last :meth:`reset`; ``None`` until
            the first budgeted dispatch (made eagerly then: see :meth:`accumulate`).
    """

    def __init__(self, factor: Optional[float]):
        self.moe_expert_rank_capacity_factor = factor
        self.over_budget: Optional[torch.Tensor] = None

    def accumulate(self, dropped: torch.Tensor) -> None:
        """``over_budget |= dropped`` in place on the device (``dropped``: a handle's ``[1]``
        bool ``over_budget``), so a CUDA graph that captured it ORs into the same tensor at
        every replay. The flag is made at the first call, which must run eagerly: made while a
        graph captures, its memory would be the graph's."""
        flag = self.over_budget
        if flag is None or flag.device != dropped.device:
            if dropped.is_cuda and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    "MoK: the first dispatch with moe_expert_rank_capacity_factor of this layer "
                    "runs inside a CUDA-graph capture, where its over-budget flag cannot be "
                    "made (its memory would be the graph's): run one eager step first "
                    "(cuda_graph_warmup_steps >= 1; PagedStashRunner's dropless rerun after a "
                    "graph reset needs that too)")
            fresh = torch.zeros(1, dtype=torch.bool, device=dropped.device)
            if flag is not None:        # (moved: keep what it held)
                fresh |= flag.to(dropped.device)
            self.over_budget = flag = fresh
        flag |= dropped.view(1)

    def flag(self) -> torch.Tensor:
        """:attr:`over_budget`, or a fresh ``[1]`` bool ``False`` on the CPU before any
        budgeted dispatch (``PagedStashRunner`` ORs ``flag.view(-1)[0]``, a 0-dim tensor, into
        its CUDA flag, which takes a CPU scalar)."""
        if self.over_budget is None:
            return torch.zeros(1, dtype=torch.bool)
        return self.over_budget

    def reset(self) -> None:
        """Clear the flag in place (``fill_(0)``, as HybridEP's ``reset_over_budget``)."""
        if self.over_budget is not None:
            self.over_budget.fill_(0)


def rank_budget(num_tokens: int, routes_per_token: int, factor: float, alignment: int) -> int:
    """``M``, the rows one rank's budgeted dispatch returns: HybridEP's formula
    (``_HybridEPManager.setup_metadata``, megatron-core 0.19)::

        M = int(num_tokens * routes_per_token * factor), rounded up to a multiple of alignment

    Args:
        num_tokens: ``T``, this call's tokens on this rank.
        routes_per_token: ``topk`` times the expert-TP size (with expert TP each route goes
            to every expert-TP rank: ``dispatcher.expand_routes_for_expert_tp``; NCCL EP counts
            ``tp_size x topk`` too, HybridEP ``topk`` alone).
        factor: ``moe_expert_rank_capacity_factor`` (> 0).
        alignment: a multiple of the Buffer's ``expert_alignment`` (``Buffer.dispatch``
            requires it) and of Megatron's pad multiple (:func:`budget_alignment`).

    Returns:
        ``M``, an int >= 0.
    """
    problem = rank_capacity_factor_problem(factor)
    if problem:
        raise MokConfigError(problem)
    rows = int(num_tokens * routes_per_token * factor)
    return rows + (-rows % alignment)


def budget_alignment(config, buffer_alignment: int) -> int:
    """The multiple :func:`rank_budget` rounds ``M`` up to: the Buffer's ``expert_alignment``
    (``Buffer.dispatch`` needs ``M`` to be a multiple of it) and HybridEP's pad multiple,
    megatron-core 0.19's ``get_align_size_for_quantization`` (256 with the TE op fuser, the
    FP8 / FP4 recipe's 16 or 32, else 0, which here is 1), so that ``M`` is HybridEP's. Read
    only with the op fuser, FP8 or FP4: 0.16's helper answers 16 for plain bf16, which HybridEP
    (without the factor in 0.16) never used for it."""
    quantized = (getattr(config, "use_transformer_engine_op_fuser", False)
                 or getattr(config, "fp8", None) or getattr(config, "fp4", None))
    pad = 1
    if quantized:
        from megatron.core.transformer.moe.moe_utils import get_align_size_for_quantization

        pad = max(1, int(get_align_size_for_quantization(config) or 0))
    return buffer_alignment * pad // math.gcd(buffer_alignment, pad)


def expert_rows_mode(experts, config) -> str:
    """:data:`PADDED` or :data:`EXACT`: what ``experts`` can take under a budget.

    ``PADDED`` (``M`` rows, device ``tokens_per_expert`` summing to the kept rows, no host
    read; a full-iteration CUDA graph can capture the layer): megatron-core 0.19's
    ``TEGroupedMLP`` with ``use_transformer_engine_op_fuser`` (``_with_fused_impl``; HybridEP
    hands it its static row count the same way), unless it pads for FP8 / FP4 itself (without
    ``moe_router_padding_for_quantization`` its ``Fp8Padding`` splits the rows by the counts on
    the host).

    ``EXACT`` (everything else): ``SequentialMLP`` (``torch.split`` by
    ``tokens_per_expert.tolist()``: the rows must add up), the unfused ``TEGroupedMLP`` (TE's
    ``GroupedLinear`` splits by the host counts too) and 0.16's legacy ``GroupedMLP``
    (``grouped_gemm`` over host batch sizes). Unknown classes get ``EXACT`` too: it is correct
    whatever the experts do with their rows.

    An experts module's own attribute ``mok_takes_padded_rows`` (``True`` / ``False``) wins.
    """
    declared = getattr(experts, TAKES_PADDED_ROWS_ATTR, None)
    if declared is not None:
        return PADDED if declared else EXACT
    try:
        from megatron.core.transformer.moe.experts import TEGroupedMLP
    except ImportError:         # (a megatron-core without it: nothing takes padded rows)
        return EXACT
    if not (isinstance(experts, TEGroupedMLP) and getattr(experts, "_with_fused_impl", False)):
        return EXACT
    quantized = bool(getattr(config, "fp8", None) or getattr(config, "fp4", None))
    if quantized and not getattr(config, "moe_router_padding_for_quantization", False):
        return EXACT
    return PADDED


def kept_rows(handle) -> int:
    """The rows a budgeted dispatch kept on this rank (``handle.num_rows_device``, ``[1]``
    int64 on the device): one host read, which a CUDA graph capture cannot do."""
    if handle.num_rows_device.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "MoK: these experts need exactly the kept rows under moe_expert_rank_capacity_factor "
            "(a host read of the row count), which cannot run while a CUDA graph is captured; "
            "only experts that take the budget's padded rows (megatron-core 0.19's TEGroupedMLP "
            "with use_transformer_engine_op_fuser) can be captured with it")
    return int(handle.num_rows_device.reshape(-1)[0])


def pad_rows(rows: torch.Tensor, num_rows: int) -> torch.Tensor:
    """``rows [n, H]`` followed by zero rows up to ``[num_rows, H]`` (``num_rows >= n``), for
    ``Buffer.combine``, which takes the budget's ``M`` rows (it never reads the zero ones).
    Differentiable: the gradient of the added rows is dropped."""
    extra = num_rows - rows.shape[0]
    if extra < 0:
        raise ValueError(f"MoK: the experts returned {rows.shape[0]} rows, more than the "
                         f"budget's {num_rows}")
    if extra == 0:
        return rows
    return torch.nn.functional.pad(rows, (0, 0, 0, extra))


def full_iteration_problem(config, rows_mode: str, counts_on_host: bool,
                           experts_name: str) -> Optional[str]:
    """Why a full-iteration CUDA graph cannot capture this layer's budgeted dispatch
    (``None``: it can). The budget's dispatch reads nothing on the host, but experts that need
    the exact rows read the row count, and host ``tokens_per_expert`` are a device-to-host copy:
    either inside a capture fails there (``cudaErrorStreamCaptureUnsupported``)."""
    from .versions import cuda_graph_impl

    if (cuda_graph_impl(config) != "full_iteration"
            or getattr(config, "moe_expert_rank_capacity_factor", None) is None
            or getattr(config, "moe_pad_expert_input_to_capacity", False)):
        return None
    if rows_mode == EXACT:
        return (f"a full-iteration CUDA graph with moe_expert_rank_capacity_factor needs experts "
                f"that take the budget's padded rows with device counts (megatron-core 0.19's "
                f"TEGroupedMLP with use_transformer_engine_op_fuser; with FP8 / FP4 also "
                f"moe_router_padding_for_quantization); {experts_name} needs the kept rows "
                f"exactly, a host read that a captured graph cannot make: use those experts, "
                f"drop-and-pad (moe_pad_expert_input_to_capacity), or no full-iteration graph")
    if counts_on_host:
        return ("a full-iteration CUDA graph with moe_expert_rank_capacity_factor: "
                "tokens_per_expert go to these experts on the host (MOK_TOKENS_PER_EXPERT=host, "
                "or experts that need host counts), a copy that a captured graph cannot make: "
                "unset MOK_TOKENS_PER_EXPERT (auto)")
    return None

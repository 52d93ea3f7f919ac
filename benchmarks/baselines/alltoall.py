"""Megatron-Core's ``alltoall`` token dispatcher (EP only, TP=1, dropless, no permute
fusion), re-implemented in plain torch so it runs without Megatron or Transformer Engine.

It follows ``MoEAlltoAllTokenDispatcher`` of megatron-core 0.16 step by step:

dispatch
  1. preprocess: ``routing_map.sum(0)`` per-expert counts; ``all_gather`` of the counts
     over the EP group; input/output split sizes; device-to-host copies of the splits on a
     side stream (the "before_permutation_1" D2H point).
  2. permute: argsort of the ``[E, T]`` routing map, ``index_select`` of one row per
     (token, expert) -- ``T*K`` copies, expert-major, rank-major across destinations.
  3. host sync on the D2H event (the "before_ep_alltoall" sync point: the split sizes must
     be on the host for NCCL), then ``all_to_all_single`` of the tokens and of the probs.
  4. ``sort_chunks_by_idxs``: split into (source rank, local expert) chunks and ``cat``
     them expert-major -- the contract row order (local expert, source rank, token).

combine is the reverse: ``sort_chunks_by_idxs`` back to rank-major, ``all_to_all_single``
with the cached splits (no host sync), ``unpermute`` = ``scatter_add_`` into ``[T, H]`` in
the token dtype (``index_add_`` when torch deterministic algorithms are on), as Megatron's
non-fused path does. Everything is autograd-differentiable the way Megatron's is
(``_AllToAll`` swaps the split sizes in backward).

The router hands Megatron a dense ``routing_map [T, E]`` (bool) and ``probs [T, E]``;
:func:`routing_from_topk` builds them from ``topk_idx``/``topk_weights`` outside the
timed region, since in Megatron the router produces them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.distributed as dist


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with split sizes; backward swaps them (Megatron ``_AllToAll``)."""

    @staticmethod
    def forward(ctx, group, inp, output_split_sizes, input_split_sizes):
        ctx.group = group
        ctx.output_split_sizes = output_split_sizes
        ctx.input_split_sizes = input_split_sizes
        if dist.get_world_size(group) == 1:
            return inp
        inp = inp.contiguous()
        out = inp.new_empty((sum(output_split_sizes), *inp.shape[1:]))
        dist.all_to_all_single(out, inp, output_split_sizes=output_split_sizes,
                               input_split_sizes=input_split_sizes, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return (None, _AllToAll.apply(ctx.group, grad, ctx.input_split_sizes, ctx.output_split_sizes),
                None, None)


def all_to_all(group, inp, output_split_sizes: List[int], input_split_sizes: List[int]):
    return _AllToAll.apply(group, inp, output_split_sizes, input_split_sizes)


def routing_from_topk(topk_idx: torch.Tensor, topk_weights: torch.Tensor, num_experts: int):
    """Router outputs in Megatron's form: ``routing_map [T, E]`` bool, ``probs [T, E]``
    float32 (0 where not routed). Slots with ``-1`` route nowhere."""
    T, K = topk_idx.shape
    valid = topk_idx >= 0
    e = topk_idx.clamp(min=0)
    # scatter_add (not scatter_): an unrouted slot, clamped to expert 0, must not overwrite
    # a routed slot of expert 0.
    hits = torch.zeros(T, num_experts, dtype=torch.int32, device=topk_idx.device)
    hits.scatter_add_(1, e, valid.to(torch.int32))
    routing_map = hits > 0
    # A token naming one expert twice cannot be expressed by a routing map (Megatron's
    # routers never do that); the benchmark routing has distinct experts per token.
    probs = torch.zeros(T, num_experts, dtype=topk_weights.dtype, device=topk_idx.device)
    probs.scatter_add_(1, e, torch.where(valid, topk_weights, torch.zeros_like(topk_weights)))
    return routing_map, probs


def permute(tokens: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor,
            num_out_tokens: int):
    """Megatron ``permute`` (argsort form, dropless): rows expert-major, token ascending."""
    num_tokens = tokens.shape[0]
    rm = routing_map.bool().T.contiguous()
    flat_sorted = rm.reshape(-1).argsort(descending=True, stable=True)[:num_out_tokens]
    sorted_indices = flat_sorted % num_tokens
    permuted_probs = probs.T.contiguous().reshape(-1)[flat_sorted]
    return tokens.index_select(0, sorted_indices), permuted_probs, sorted_indices


def unpermute(permuted_tokens: torch.Tensor, sorted_indices: torch.Tensor, restore_shape):
    """Megatron ``unpermute`` without probs: sum each token's rows in the token dtype."""
    hidden = restore_shape[1]
    out = torch.zeros(restore_shape, dtype=permuted_tokens.dtype, device=permuted_tokens.device)
    if torch.are_deterministic_algorithms_enabled():
        out.index_add_(0, sorted_indices, permuted_tokens)
    else:
        out.scatter_add_(0, sorted_indices.unsqueeze(1).expand(-1, hidden), permuted_tokens)
    return out


def sort_chunks_by_idxs(inp: torch.Tensor, split_sizes: torch.Tensor, sorted_idxs: torch.Tensor,
                        probs: Optional[torch.Tensor] = None):
    """Megatron ``sort_chunks_by_idxs`` (non-fused): host split sizes, ``split`` + ``cat``."""
    sizes = split_sizes.tolist()
    order = sorted_idxs.tolist()
    chunks = torch.split(inp, sizes, dim=0)
    out = torch.cat([chunks[i] for i in order], dim=0)
    out_probs = None
    if probs is not None:
        pchunks = torch.split(probs, sizes, dim=0)
        out_probs = torch.cat([pchunks[i] for i in order], dim=0)
    return out, out_probs


@dataclass(eq=False)
class AlltoAllHandle:
    input_splits: List[int]
    output_splits: List[int]
    num_global_tokens_per_local_expert: torch.Tensor  # host [W, E_local]
    sorted_indices: torch.Tensor                      # device [T*K]
    num_sent: int                                     # rows this rank sent (routed slots)
    restore_shape: tuple


@dataclass(eq=False)
class AlltoAllResult:
    tokens: torch.Tensor          # [R, H] expert-major (contract order)
    probs: torch.Tensor           # [R] float32
    tokens_per_expert: torch.Tensor  # host [E_local] int64 (Megatron keeps it on the host)
    handle: AlltoAllHandle


class AlltoAllDispatcher:
    """Megatron ``alltoall`` dispatch/combine over ``group`` for ``num_experts`` experts."""

    _dtoh_stream = None

    def __init__(self, group, num_experts: int, topk: int, device):
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        if num_experts % self.world:
            raise ValueError(f"num_experts={num_experts} not divisible by world size {self.world}")
        self.num_experts = num_experts
        self.topk = topk
        self.el = num_experts // self.world
        self.device = torch.device(device)
        self.is_cuda = self.device.type == "cuda"
        idx = torch.arange(num_experts)
        # chunks arrive (source rank, local expert); the experts want (local expert, rank)
        self.sort_input_by_local_experts = idx.reshape(-1, self.el).T.ravel()
        self.restore_output_by_local_experts = idx.reshape(self.el, -1).T.ravel()
        self.local_expert_lo = self.rank * self.el
        if self.is_cuda and AlltoAllDispatcher._dtoh_stream is None:
            AlltoAllDispatcher._dtoh_stream = torch.cuda.Stream(device=self.device)

    # ------------------------------------------------------------------ dispatch
    def _all_gather_counts(self, counts: torch.Tensor) -> torch.Tensor:
        # A flat output of world x numel: NCCL takes [W, E] as well, gloo (the CPU smoke, the
        # shared-GPU dry run) only chunks of the input's own shape.
        out = counts.new_empty(self.world * counts.numel())
        dist.all_gather_into_tensor(out, counts.contiguous().view(-1), group=self.group)
        return out.view(self.world, *counts.shape)

    def dispatch(self, x: torch.Tensor, routing_map: torch.Tensor,
                 probs: torch.Tensor) -> AlltoAllResult:
        T = x.shape[0]
        # 1. preprocess (metadata on the device)
        num_local_tokens_per_expert = routing_map.sum(dim=0).long()               # [E]
        input_splits = num_local_tokens_per_expert.reshape(self.world, self.el).sum(dim=1)
        ngte = self._all_gather_counts(num_local_tokens_per_expert)              # [W, E]
        ngtle = ngte[:, self.local_expert_lo:self.local_expert_lo + self.el].contiguous()
        output_splits = ngtle.sum(dim=1)
        tokens_per_expert = ngtle.sum(dim=0)
        # D2H copies on a side stream ("before_permutation_1"), waited for before the a2a
        if self.is_cuda:
            main = torch.cuda.current_stream(self.device)
            side = AlltoAllDispatcher._dtoh_stream
            side.wait_stream(main)
            with torch.cuda.stream(side):
                h_in = input_splits.to("cpu", non_blocking=True)
                h_out = output_splits.to("cpu", non_blocking=True)
                h_tpe = tokens_per_expert.to("cpu", non_blocking=True)
                h_ngtle = ngtle.to("cpu", non_blocking=True)
                for t in (input_splits, output_splits, tokens_per_expert, ngtle):
                    t.record_stream(side)
            d2h_event = side.record_event()
        else:
            h_in, h_out, h_tpe, h_ngtle = input_splits, output_splits, tokens_per_expert, ngtle
            d2h_event = None
        # 2. permute (overlaps the D2H copies); dropless: T*K output rows, static
        num_out_tokens = T * self.topk
        permuted, permuted_probs, sorted_indices = permute(x, routing_map, probs, num_out_tokens)
        # 3. host sync ("before_ep_alltoall"), then the all-to-all of tokens and probs
        if d2h_event is not None:
            d2h_event.synchronize()
        in_list, out_list = h_in.tolist(), h_out.tolist()
        num_sent = sum(in_list)
        if num_sent != num_out_tokens:   # unrouted (-1) slots: only the routed rows travel
            permuted = permuted.narrow(0, 0, num_sent)
            permuted_probs = permuted_probs.narrow(0, 0, num_sent)
        global_tokens = all_to_all(self.group, permuted, out_list, in_list)
        global_probs = all_to_all(self.group, permuted_probs, out_list, in_list)
        # 4. sort chunks to expert-major
        if self.el > 1:
            global_tokens, global_probs = sort_chunks_by_idxs(
                global_tokens, h_ngtle.ravel(), self.sort_input_by_local_experts, probs=global_probs)
        handle = AlltoAllHandle(in_list, out_list, h_ngtle, sorted_indices, num_sent, tuple(x.shape))
        return AlltoAllResult(global_tokens, global_probs, h_tpe, handle)

    # ------------------------------------------------------------------- combine
    def combine(self, expert_out: torch.Tensor, handle: AlltoAllHandle) -> torch.Tensor:
        hidden = expert_out
        if self.el > 1:
            hidden, _ = sort_chunks_by_idxs(hidden, handle.num_global_tokens_per_local_expert.T.ravel(),
                                            self.restore_output_by_local_experts)
        permuted = all_to_all(self.group, hidden, handle.input_splits, handle.output_splits)
        idx = handle.sorted_indices
        if handle.num_sent != idx.numel():
            idx = idx.narrow(0, 0, handle.num_sent)
        return unpermute(permuted, idx, handle.restore_shape)

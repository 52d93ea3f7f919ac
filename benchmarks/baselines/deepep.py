"""DeepEP v1 intranode ``Buffer`` (public Python API), used only when ``deep_ep`` imports.

Timed calls, as DeepEP's own tests time them:

- full dispatch: ``get_dispatch_layout`` + ``dispatch(topk_idx=..., topk_weights=...)``;
  the dispatch waits on the host for the received counts (its own host sync);
- cached dispatch: ``dispatch(x, handle=handle)`` (layout reused, no notify, no host wait);
- combine: ``combine(x_recv, handle)``, one row per (token, source rank).

DeepEP returns one row per (token, destination rank), not expert-major rows: Megatron's
``flex`` path adds a local permute on top. The helpers :meth:`DeepEP.rows` and
:meth:`DeepEP.combine_input` do that conversion outside the timed region, only to check
the results against the other systems.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import Unavailable


def import_deep_ep():
    try:
        import deep_ep  # noqa: F401
    except Exception as e:  # noqa: BLE001
        raise Unavailable(f"deep_ep not importable ({type(e).__name__}: {e})")
    if not hasattr(deep_ep, "Buffer") or not hasattr(deep_ep.Buffer, "get_dispatch_layout"):
        raise Unavailable("deep_ep has no v1 Buffer.get_dispatch_layout (unsupported DeepEP version)")
    return deep_ep


@dataclass(eq=False)
class DeepEPResult:
    recv_x: torch.Tensor
    recv_topk_idx: torch.Tensor
    recv_topk_weights: torch.Tensor
    num_recv_tokens_per_expert: list
    handle: tuple


class DeepEP:
    def __init__(self, group, num_experts: int, max_hidden: int, num_sms: int = 24):
        deep_ep = import_deep_ep()
        self.deep_ep = deep_ep
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.E = num_experts
        self.el = num_experts // self.world
        self.num_sms = num_sms
        deep_ep.Buffer.set_num_sms(num_sms)
        self.dispatch_config = deep_ep.Buffer.get_dispatch_config(self.world)
        self.combine_config = deep_ep.Buffer.get_combine_config(self.world)
        hidden_bytes = max_hidden * 2
        num_nvl_bytes = max(cfg.get_nvl_buffer_size_hint(hidden_bytes, self.world)
                            for cfg in (self.dispatch_config, self.combine_config))
        self.buffer = deep_ep.Buffer(group, num_nvl_bytes, 0)
        self.idx_dtype = getattr(deep_ep, "topk_idx_t", torch.int64)

    def convert_idx(self, topk_idx: torch.Tensor) -> torch.Tensor:
        return topk_idx.to(self.idx_dtype)

    # --------------------------------------------------------------- timed calls
    def dispatch(self, x, topk_idx, topk_weights) -> DeepEPResult:
        ntpr, ntprdma, ntpe, in_rank, _ = self.buffer.get_dispatch_layout(topk_idx, self.E)
        recv_x, recv_idx, recv_w, counts, handle, _ = self.buffer.dispatch(
            x, num_tokens_per_rank=ntpr, num_tokens_per_rdma_rank=ntprdma,
            is_token_in_rank=in_rank, num_tokens_per_expert=ntpe, topk_idx=topk_idx,
            topk_weights=topk_weights, config=self.dispatch_config)
        return DeepEPResult(recv_x, recv_idx, recv_w, counts, handle)

    def dispatch_cached(self, x, res: DeepEPResult) -> torch.Tensor:
        recv_x, _, _, _, _, _ = self.buffer.dispatch(x, handle=res.handle, config=self.dispatch_config)
        return recv_x

    def combine(self, x_recv: torch.Tensor, res: DeepEPResult) -> torch.Tensor:
        y, _, _ = self.buffer.combine(x_recv, res.handle, config=self.combine_config)
        return y

    # ----------------------------------------------------- checks (untimed)
    def _recv_meta(self, res: DeepEPResult):
        rank_prefix_matrix, _, _, recv_src_idx, _, _ = res.handle
        n = res.recv_x.shape[0]
        bounds = rank_prefix_matrix[:, self.rank].to(torch.int64)      # inclusive prefix by src
        src_rank = torch.searchsorted(bounds, torch.arange(n, device=bounds.device), right=True)
        ridx = res.recv_topk_idx.to(torch.int64)
        if ridx.numel() and int(ridx.max()) >= self.el:                # global ids: make local
            lo = self.rank * self.el
            ridx = torch.where((ridx >= lo) & (ridx < lo + self.el), ridx - lo, torch.full_like(ridx, -1))
        return src_rank, recv_src_idx.to(torch.int64), ridx

    def rows(self, res: DeepEPResult, t_max: int):
        """Expert-major rows (contract order) built from the per-rank rows: tokens, probs,
        tokens_per_expert, and the (recv row, k) of each."""
        src_rank, src_tok, ridx = self._recv_meta(res)
        K = ridx.shape[1]
        n_idx, k_idx = (ridx >= 0).nonzero(as_tuple=True)
        e = ridx[n_idx, k_idx]
        key = ((e * self.world + src_rank[n_idx]) * t_max + src_tok[n_idx]) * K + k_idx
        order = torch.argsort(key, stable=True)
        n_idx, k_idx, e = n_idx[order], k_idx[order], e[order]
        tokens = res.recv_x.index_select(0, n_idx)
        probs = res.recv_topk_weights[n_idx, k_idx].to(torch.float32)
        tpe = torch.bincount(e, minlength=self.el)[: self.el]
        return tokens, probs, tpe, n_idx

    def combine_input(self, res: DeepEPResult, expert_out: torch.Tensor, t_max: int) -> torch.Tensor:
        """Per received row, the fp32 sum of its expert rows (local expert asc, then k),
        rounded once to bf16: what Megatron's flex path hands DeepEP's combine."""
        _, _, _, n_idx = self.rows(res, t_max)
        part = torch.zeros(res.recv_x.shape, dtype=torch.float32, device=expert_out.device)
        part.index_add_(0, n_idx, expert_out.float())
        return part.to(expert_out.dtype)

    def destroy(self):
        if hasattr(self.buffer, "destroy"):
            try:
                self.buffer.destroy()
            except Exception:  # noqa: BLE001
                pass

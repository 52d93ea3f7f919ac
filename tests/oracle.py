"""An independent oracle for the dispatch/combine contract (docs/CONTRACT.md).

Written from the contract's text with plain Python loops; it shares no code with
``megatron_mok.backends.reference`` (which it is used to judge). Everything here runs in
one process on every rank's inputs (``harness.make_inputs`` gives each rank all of them),
so each rank computes what it should get locally.

- :func:`expected_dispatch`: every rank's rows (order: local expert, source rank, source
  token, slot), probs, tokens_per_expert, src_rank, src_token.
- :func:`expected_combine`: the bitwise combine result (per expert rank a float32 sum from
  +0.0 in row order, rounded to the partial dtype; the owner sums the partials of the ranks
  holding rows of the token in rank order, in float32 from +0.0, rounds to the dtype).
- :func:`pipeline_reference`: a differentiable single-process model of
  dispatch -> expert -> combine (float64 for the reference, or the test dtype for the
  "same-precision torch" baseline that sets the gradient tolerance).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch


@dataclass
class RankRows:
    """What one rank ``d`` must receive. ``rows[i] = (local_expert, s, t, k)``."""

    rows: List[Tuple[int, int, int, int]]
    tokens_per_expert: List[int]

    @property
    def num_rows(self) -> int:
        return len(self.rows)

    def src_rank(self) -> torch.Tensor:
        return torch.tensor([r[1] for r in self.rows], dtype=torch.int64)

    def src_token(self) -> torch.Tensor:
        return torch.tensor([r[2] for r in self.rows], dtype=torch.int64)

    def expert_of_row(self) -> List[int]:
        return [r[0] for r in self.rows]


def route(inputs: Sequence[tuple], num_experts: int) -> List[RankRows]:
    """Rows of every rank ``d``, in contract order, by nested loops in that order."""
    W = len(inputs)
    assert num_experts % W == 0
    el = num_experts // W
    idx = [inp[1].tolist() for inp in inputs]          # idx[s][t][k]
    out = []
    for d in range(W):
        rows = []
        tpe = []
        for e in range(el):
            g = d * el + e
            n = 0
            for s in range(W):
                for t in range(len(idx[s])):
                    for k in range(len(idx[s][t])):
                        if idx[s][t][k] == g:
                            rows.append((e, s, t, k))
                            n += 1
            tpe.append(n)
        out.append(RankRows(rows=rows, tokens_per_expert=tpe))
    return out


def expected_dispatch(inputs: Sequence[tuple], num_experts: int, rank: int,
                      routing: Optional[List[RankRows]] = None) -> Dict[str, torch.Tensor]:
    """``tokens, probs, tokens_per_expert, src_rank, src_token`` rank ``rank`` must get."""
    routing = routing or route(inputs, num_experts)
    rr = routing[rank]
    x0 = inputs[0][0]
    H, dtype = x0.shape[1], x0.dtype
    tokens = torch.zeros(rr.num_rows, H, dtype=dtype)
    probs = torch.zeros(rr.num_rows, dtype=torch.float32)
    for i, (_e, s, t, k) in enumerate(rr.rows):
        tokens[i] = inputs[s][0][t].cpu()
        probs[i] = inputs[s][2][t, k].cpu()
    return {
        "tokens": tokens,
        "probs": probs,
        "tokens_per_expert": torch.tensor(rr.tokens_per_expert, dtype=torch.int64),
        "src_rank": rr.src_rank(),
        "src_token": rr.src_token(),
    }


def expected_combine(routing: List[RankRows], expert_out: Sequence[torch.Tensor], owner: int,
                     num_tokens: int, dtype: torch.dtype, partial_dtype: torch.dtype) -> torch.Tensor:
    """``y [T, H]`` that rank ``owner`` must get from ``combine(expert_out[d])`` on every ``d``.

    ``expert_out[d]`` is rank ``d``'s ``[>= R_d, H]`` tensor (rows past ``R_d`` are padding
    and must be ignored).
    """
    W = len(routing)
    H = expert_out[0].shape[1]
    # rows_of[d][t]: the rows on rank d that came from token (owner, t), in row order
    rows_of = [[[] for _ in range(num_tokens)] for _ in range(W)]
    for d in range(W):
        for i, (_e, s, t, _k) in enumerate(routing[d].rows):
            if s == owner:
                rows_of[d][t].append(i)
    eo = [e.detach().cpu().float() for e in expert_out]
    y = torch.zeros(num_tokens, H, dtype=dtype)
    for t in range(num_tokens):
        acc = torch.zeros(H, dtype=torch.float32)             # +0.0
        for d in range(W):                                    # rank order
            if not rows_of[d][t]:
                continue                                      # no rows of t on rank d
            part = torch.zeros(H, dtype=torch.float32)        # +0.0
            for i in rows_of[d][t]:                           # row order
                part = part + eo[d][i]
            acc = acc + part.to(partial_dtype).float()
        y[t] = acc.to(dtype)
    return y


def expected_grad_topk_weights(routing: List[RankRows], grad_probs: Sequence[torch.Tensor],
                               owner: int, num_tokens: int, topk: int) -> torch.Tensor:
    """``grad_topk_weights[t, k] = grad_probs[row of (owner, t, k)]``, 0 for unrouted slots."""
    g = torch.zeros(num_tokens, topk, dtype=torch.float32)
    for d, rr in enumerate(routing):
        for i, (_e, s, t, k) in enumerate(rr.rows):
            if s == owner:
                g[t, k] = grad_probs[d][i].cpu().float()
    return g


def expected_dispatch_of(routing: List[RankRows], per_rank: Sequence[torch.Tensor], rank: int) -> torch.Tensor:
    """Rows of rank ``rank``: row ``i`` is ``per_rank[src_rank[i]][src_token[i]]``."""
    rr = routing[rank]
    H = per_rank[0].shape[1]
    out = torch.zeros(rr.num_rows, H, dtype=per_rank[0].dtype)
    for i, (_e, s, t, _k) in enumerate(rr.rows):
        out[i] = per_rank[s][t].cpu()
    return out


def routed_slots(topk_idx: torch.Tensor) -> torch.Tensor:
    """``[T]`` int64: slots of each token that name an expert (duplicates counted)."""
    return (topk_idx >= 0).sum(dim=1).to(torch.int64)


# -------------------------------------------------------------------------- pipeline model
def expert_scale(global_expert: int, num_experts: int) -> float:
    """The toy expert's per-expert factor (a power-of-two-free value, so rounding matters)."""
    return 1.0 + 0.37 * (global_expert + 1) / num_experts


def pipeline_reference(inputs: Sequence[tuple], num_experts: int, grad_y: Sequence[torch.Tensor],
                       compute_dtype: torch.dtype) -> Dict[str, List[torch.Tensor]]:
    """Gradients of ``loss = sum_s <combine(expert(dispatch(x)))_s, grad_y_s>`` in one process.

    ``expert(tokens, probs)[i] = tokens[i] * probs[i] * expert_scale(e_i)``, each product
    computed in ``compute_dtype`` (float64 for the reference). The per-token sum accumulates
    in float64 for the reference, else in float32 and is rounded once to ``compute_dtype``
    (as torch's own reductions over half types do): the "same-precision torch" baseline.
    Returns ``y``, ``grad_x`` and ``grad_topk_weights`` per rank.
    """
    W = len(inputs)
    el = num_experts // W
    routing = route(inputs, num_experts)
    xs = [inp[0].detach().cpu().to(compute_dtype).requires_grad_(True) for inp in inputs]
    ws = [inp[2].detach().cpu().to(compute_dtype).requires_grad_(True) for inp in inputs]
    acc_dtype = torch.float64 if compute_dtype == torch.float64 else torch.float32
    ys = [[torch.zeros(inputs[s][0].shape[1], dtype=acc_dtype) for _ in range(inputs[s][0].shape[0])]
          for s in range(W)]
    for d in range(W):
        for (e, s, t, k) in routing[d].rows:
            term = xs[s][t] * ws[s][t, k] * expert_scale(d * el + e, num_experts)
            ys[s][t] = ys[s][t] + term.to(acc_dtype)
    loss = torch.zeros((), dtype=torch.float64)
    y_out = []
    for s in range(W):
        T = inputs[s][0].shape[0]
        y = torch.stack(ys[s]).to(compute_dtype) if T else \
            torch.zeros(0, inputs[s][0].shape[1], dtype=compute_dtype)
        y_out.append(y.detach())
        loss = loss + (y.double() * grad_y[s].cpu().double()).sum()
    loss.backward()
    return {
        "y": y_out,
        "grad_x": [x.grad if x.grad is not None else torch.zeros_like(x) for x in xs],
        "grad_topk_weights": [w.grad if w.grad is not None else torch.zeros_like(w) for w in ws],
    }

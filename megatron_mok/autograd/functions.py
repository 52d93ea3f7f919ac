"""``torch.autograd.Function`` wrappers around a backend (as Megatron's ``fused_a2a.py``).

Both backward passes reuse the forward's :class:`~megatron_mok.DispatchHandle`, so they
communicate along the same layout with no new routing exchange:

- dispatch backward: ``grad_x = combine(grad_tokens)`` and the prob gradient of each row
  travels back to its slot (``grad_topk_weights [T, K]``).
- combine backward: ``grad_expert_out = dispatch_cached(grad_y)``.
"""

from __future__ import annotations

import torch


class DispatchFunction(torch.autograd.Function):
    """``(x [T,H], topk_weights [T,K]) -> (tokens [R,H], probs [R])``; the handle is
    returned through ``out_handle`` (a one-element list), since it is not a tensor."""

    @staticmethod
    def forward(ctx, backend, out_handle, x, topk_weights, topk_idx, rows_per_expert=None):
        tokens, probs, handle = backend.dispatch(x, topk_idx, topk_weights, rows_per_expert)
        ctx.backend, ctx.handle = backend, handle
        out_handle.append(handle)
        # Packed FP8 rows (megatron_mok/fp8.py) are data: only probs carries a gradient.
        ctx.packed = not tokens.is_floating_point()
        if ctx.packed:
            ctx.mark_non_differentiable(tokens)
        return tokens, probs

    @staticmethod
    def backward(ctx, grad_tokens, grad_probs):
        want_w = ctx.needs_input_grad[3]
        if ctx.packed:
            if not want_w:
                return None, None, None, None, None, None
            # Only the prob gradients travel back (the FP8 tokens have none): a combine whose
            # rows are 8 zeros wide, not a full one (benchmarks/NOTES.md #56).
            grad_w = ctx.backend.combine_prob_grads(ctx.handle, grad_probs.contiguous())
            return None, None, None, grad_w, None, None
        grad_x, grad_w = ctx.backend.combine(
            grad_tokens.contiguous(), ctx.handle,
            grad_probs=grad_probs.contiguous() if want_w else None)
        return None, None, grad_x, grad_w, None, None


class CombineFunction(torch.autograd.Function):
    """``expert_out [R,H] -> y [T,H]`` along ``handle``."""

    @staticmethod
    def forward(ctx, backend, handle, expert_out):
        y, _ = backend.combine(expert_out, handle)
        ctx.backend, ctx.handle = backend, handle
        return y

    @staticmethod
    def backward(ctx, grad_y):
        return None, None, ctx.backend.dispatch_cached(grad_y.contiguous(), ctx.handle)


class CachedDispatchFunction(torch.autograd.Function):
    """``x [T,H] -> tokens [R,H]`` along an existing handle (no routing exchange); its
    backward is a combine of the row gradients."""

    @staticmethod
    def forward(ctx, backend, handle, x):
        ctx.backend, ctx.handle = backend, handle
        return backend.dispatch_cached(x, handle)

    @staticmethod
    def backward(ctx, grad_tokens):
        grad_x, _ = ctx.backend.combine(grad_tokens.contiguous(), ctx.handle)
        return None, None, grad_x

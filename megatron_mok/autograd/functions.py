"""``torch.autograd.Function`` wrappers around a backend (as Megatron's ``fused_a2a.py``).

Both backward passes reuse the forward's :class:`~megatron_mok.DispatchHandle`, so they
communicate along the same layout with no new routing exchange:

- dispatch backward: ``grad_x = combine(grad_tokens)`` and the prob gradient of each row
  travels back to its slot (``grad_topk_weights [T, K]``).
- combine backward: ``grad_expert_out = dispatch_cached(grad_y)``.

Each backward first checks that its Buffer was not destroyed (:func:`_check_not_destroyed`):
the autograd graph keeps the backend object alive after ``Buffer.destroy()``, and a CUDA
backend called then would communicate through freed peer memory.

The backward passes are first-order only (:func:`_first_order_only`): they call the backend
directly (a library call on CUDA, collectives of raw bytes on the reference), which records no
autograd graph, or one that depends on the backend and the world size, so a double backward
(``create_graph=True``) through them would silently miss their part of the second derivative
(seen: the reference at W=2, the CUDA backend always). They raise instead, at the second
backward. Their gradients are linear in the incoming gradients and do not depend on the
forward's inputs, so the only second-order path through them runs through an incoming
gradient that requires grad: that is where the raising node goes.
"""

from __future__ import annotations

import functools

import torch


def _check_not_destroyed(backend, op: str) -> None:
    """Raise if ``backend`` (``ctx.backend`` of a forward of ``op``) was destroyed with its
    Buffer. Here, not only in the backends, so that no backend method is reached at all (the
    CUDA backend's would use freed peer memory), whatever the backend does itself."""
    if backend.destroyed:
        raise RuntimeError(
            f"megatron_mok: this Buffer was destroyed; the backward of a {op} made on it cannot "
            "run (it would communicate through the Buffer's workspace, which Buffer.destroy() "
            "released: peer memory on the CUDA backend). Run the backward before destroy().")


class _NoDoubleBackward(torch.autograd.Function):
    """Identity on a backward's results, as a node of the graph ``create_graph=True`` builds,
    whose inputs are the backward's incoming gradients too; differentiating through it raises.

    Not ``torch.autograd.function.once_differentiable``: its error node hangs off detached
    copies of the results, so ``torch.autograd.grad(loss, inputs=[x])`` prunes it (no path to
    ``x``) and returns a second derivative without this op's part, silently (``.backward()``
    does raise). Here the node's inputs are the incoming gradients, which lead back to ``x``."""

    @staticmethod
    def forward(ctx, op, num_results, *tensors):
        ctx.op = op
        # Copies, not the tensors themselves: an output that is an input would be a view of it,
        # and autograd restricts in-place updates of views of a custom Function's outputs.
        # Only on the create_graph path, so it costs nothing in training.
        return tuple(t.clone() for t in tensors[:num_results])

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(
            f"megatron_mok: the backward of {ctx.op} is not differentiable: a double backward "
            "(create_graph=True, then a gradient of the gradients) through it is not supported "
            "(it would silently miss this op's part of the second derivative)")


def _first_order_only(op: str):
    """Decorate the ``backward`` of a Function of ``op``: it runs without recording a graph, and
    under ``create_graph=True`` its results go through :class:`_NoDoubleBackward`, so that a
    double backward raises instead of silently dropping this op's part."""

    def wrap(backward):
        @functools.wraps(backward)
        def wrapper(ctx, *grads):
            with torch.no_grad():
                results = backward(ctx, *grads)
            incoming = [g for g in grads if isinstance(g, torch.Tensor) and g.requires_grad]
            if not torch.is_grad_enabled() or not incoming:   # a plain backward: as computed
                return results
            where = [i for i, r in enumerate(results) if isinstance(r, torch.Tensor)]
            if not where:
                return results
            tied = _NoDoubleBackward.apply(op, len(where), *(results[i] for i in where), *incoming)
            out = list(results)
            for i, t in zip(where, tied):
                out[i] = t
            return tuple(out)

        return wrapper

    return wrap


class DispatchFunction(torch.autograd.Function):
    """``(x [T,H], topk_weights [T,K]) -> (tokens [R,H], probs [R])``; the handle is
    returned through ``out_handle`` (a one-element list), since it is not a tensor."""

    @staticmethod
    def forward(ctx, backend, out_handle, x, topk_weights, topk_idx, rows_per_expert=None,
                recv_budget=None):
        tokens, probs, handle = backend.dispatch(x, topk_idx, topk_weights, rows_per_expert,
                                                 recv_budget)
        ctx.backend, ctx.handle = backend, handle
        out_handle.append(handle)
        # Packed FP8 rows (megatron_mok/fp8.py) are data: only probs carries a gradient.
        ctx.packed = not tokens.is_floating_point()
        if ctx.packed:
            ctx.mark_non_differentiable(tokens)
        return tokens, probs

    @staticmethod
    @_first_order_only("a dispatch")
    def backward(ctx, grad_tokens, grad_probs):
        _check_not_destroyed(ctx.backend, "dispatch")
        want_w = ctx.needs_input_grad[3]
        if ctx.packed:
            if not want_w:
                return None, None, None, None, None, None, None
            # Only the prob gradients travel back (the FP8 tokens have none): a combine whose
            # rows are 8 zeros wide, not a full one (benchmarks/NOTES.md #56).
            grad_w = ctx.backend.combine_prob_grads(ctx.handle, grad_probs.contiguous())
            return None, None, None, grad_w, None, None, None
        grad_x, grad_w = ctx.backend.combine(
            grad_tokens.contiguous(), ctx.handle,
            grad_probs=grad_probs.contiguous() if want_w else None)
        return None, None, grad_x, grad_w, None, None, None


class CombineFunction(torch.autograd.Function):
    """``expert_out [R,H] -> y [T,H]`` along ``handle``."""

    @staticmethod
    def forward(ctx, backend, handle, expert_out):
        y, _ = backend.combine(expert_out, handle)
        ctx.backend, ctx.handle = backend, handle
        return y

    @staticmethod
    @_first_order_only("a combine")
    def backward(ctx, grad_y):
        _check_not_destroyed(ctx.backend, "combine")
        return None, None, ctx.backend.dispatch_cached(grad_y.contiguous(), ctx.handle)


class CachedDispatchFunction(torch.autograd.Function):
    """``x [T,H] -> tokens [R,H]`` along an existing handle (no routing exchange); its
    backward is a combine of the row gradients."""

    @staticmethod
    def forward(ctx, backend, handle, x):
        ctx.backend, ctx.handle = backend, handle
        return backend.dispatch_cached(x, handle)

    @staticmethod
    @_first_order_only("a cached dispatch")
    def backward(ctx, grad_tokens):
        _check_not_destroyed(ctx.backend, "cached dispatch")
        grad_x, _ = ctx.backend.combine(grad_tokens.contiguous(), ctx.handle)
        return None, None, grad_x

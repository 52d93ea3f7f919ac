"""Cached dispatch: ``buf.dispatch(x, handle=h)`` sends new tokens along an earlier
dispatch's layout (no routing exchange). Rows, their order and the backward (a combine of
the row gradients) must be those of the original layout, bitwise."""

import pytest
import torch

import oracle
from harness import (DTYPES, _buffer, assert_bitwise, contract_cases, make_inputs, run_distributed,
                     seeded, spec_inputs)


def check_cached_case(rank, world_size, spec, seed, backend="reference", device="cpu", static_extra=None,
                      **buffer_kw):
    for di, dtype in enumerate(DTYPES):
        inputs = spec_inputs(spec, world_size, dtype, seed + di, device=device)
        routing = oracle.route([tuple(t.cpu() for t in inp) for inp in inputs], spec["E"])
        T = [inp[0].shape[0] for inp in inputs]
        H = spec["H"]
        # new tokens for every rank (same shapes), seeded so every rank knows all of them
        x_new = [seeded(seed * 11 + s + 100 * di, (T[s], H), dtype) for s in range(world_size)]
        R = routing[rank].num_rows
        extra = {}
        if static_extra is not None:
            extra["max_recv_tokens"] = max(rr.num_rows for rr in routing) + static_extra
        for partial in (None, torch.float32):
            tag = f"[{spec['case']} {dtype} partial={partial} rank {rank}]"
            buf = _buffer(spec, dtype, backend, partial, **extra, **buffer_kw)
            res = buf.dispatch(*inputs[rank])
            rows = res.tokens.shape[0]
            again = buf.dispatch(inputs[rank][0], handle=res.handle)
            assert again.probs is None and again.handle is res.handle, tag
            assert_bitwise(again.tokens, res.tokens, f"cached dispatch of the same x {tag}")
            x = x_new[rank].to(device).clone().requires_grad_(True)
            new = buf.dispatch(x, handle=res.handle)
            want = oracle.expected_dispatch_of(routing, x_new, rank)
            want = torch.cat([want, torch.zeros(rows - R, H, dtype=dtype)])
            assert_bitwise(new.tokens, want.to(device), f"cached dispatch of new x {tag}")
            assert_bitwise(new.src_rank, res.src_rank, f"src_rank {tag}")
            assert_bitwise(new.tokens_per_expert, res.tokens_per_expert, f"tokens_per_expert {tag}")
            # backward: a combine of the row gradients along the same layout
            G = [seeded(seed * 5 + d + 100 * di, (routing[d].num_rows, H)) for d in range(world_size)]
            g_rank = torch.cat([G[rank], torch.full((rows - R, H), 3.0)]).to(device)
            (new.tokens.float() * g_rank).sum().backward()
            pd = dtype if partial is None else partial
            want_gx = oracle.expected_combine(routing, [g.to(dtype) for g in G], rank, T[rank], dtype, pd)
            assert_bitwise(x.grad, want_gx.to(device), f"grad_x of cached dispatch {tag}")
            # and the layout still combines
            eo = seeded(seed * 7 + rank, (rows, H), dtype).to(device)
            eo_all = [seeded(seed * 7 + d, (routing[d].num_rows, H), dtype) for d in range(world_size)]
            y = buf.combine(eo, res.handle)
            assert_bitwise(y, oracle.expected_combine(routing, eo_all, rank, T[rank], dtype, pd).to(device),
                           f"combine after cached dispatch {tag}")
            buf.destroy()
    return True


def _cached(rank, world_size, name, static_extra):
    return check_cached_case(rank, world_size, contract_cases(world_size)[name], 61,
                             static_extra=static_extra)


@pytest.mark.parametrize("world_size", (1, 2, 4))
@pytest.mark.parametrize("name", ("random", "mixed", "t0_on_rank0", "same_expert_twice"))
def test_cached_dispatch(name, world_size):
    assert run_distributed(_cached, world_size, name, None) == [True] * world_size


@pytest.mark.parametrize("world_size", (2,))
def test_cached_dispatch_static_shape(world_size):
    assert run_distributed(_cached, world_size, "mixed", 3) == [True] * world_size


def test_cached_dispatch_errors():
    import megatron_mok as mok

    buf = mok.Buffer(num_experts=4, hidden=16, topk=2, max_tokens_per_rank=8, backend="reference")
    other = mok.Buffer(num_experts=4, hidden=16, topk=2, max_tokens_per_rank=8, backend="reference")
    (x, idx, w), = make_inputs(1, 1, [5], 4, 16, 2, torch.bfloat16)
    res = buf.dispatch(x, idx, w)
    with pytest.raises(ValueError, match=r"either \(topk_idx, topk_weights\) or handle="):
        buf.dispatch(x, idx, w, handle=res.handle)
    with pytest.raises(ValueError, match=r"needs topk_idx and topk_weights"):
        buf.dispatch(x)
    with pytest.raises(ValueError, match=r"x must be \[T=5, hidden=16\]"):
        buf.dispatch(x[:4].contiguous(), handle=res.handle)
    with pytest.raises(TypeError, match=r"x must have the Buffer's dtype"):
        buf.dispatch(x.float(), handle=res.handle)
    with pytest.raises(ValueError, match=r"x must be contiguous"):
        buf.dispatch(torch.zeros(5, 32, dtype=torch.bfloat16)[:, ::2], handle=res.handle)
    with pytest.raises(ValueError, match=r"handle was made by another Buffer"):
        other.dispatch(x, handle=res.handle)
    with pytest.raises(TypeError, match=r"handle must be a DispatchHandle"):
        buf.dispatch(x, handle="not a handle")

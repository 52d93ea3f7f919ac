"""Static-shape mode (``Buffer(max_recv_tokens=M)``): exactly M rows, the real ones first in
contract order, zero padding after them (probs 0, src -1), padding rows ignored by combine
and by the backward; more than M rows is an error, never silent loss."""

import pytest
import torch

import oracle
from harness import (DTYPES, _buffer, assert_bitwise, contract_cases, full_pass, make_inputs,
                     run_distributed, seeded, spec_inputs)


def check_static_case(rank, world_size, spec, seed, extra_rows, backend="reference", device="cpu",
                      **buffer_kw):
    """Static mode with ``M = max_d R_d + extra_rows`` rows, against the oracle, bitwise."""
    for di, dtype in enumerate(DTYPES):
        inputs = spec_inputs(spec, world_size, dtype, seed + di, device=device)
        routing = oracle.route(inputs, spec["E"])
        M = max(rr.num_rows for rr in routing) + extra_rows
        R = routing[rank].num_rows
        H, T = spec["H"], [inp[0].shape[0] for inp in inputs]
        exp = oracle.expected_dispatch(inputs, spec["E"], rank, routing)
        x0, idx, w0 = inputs[rank]
        for partial in (None, torch.float32):
            tag = f"[{spec['case']} {dtype} partial={partial} M={M} R={R} rank {rank}]"
            buf = _buffer(spec, dtype, backend, partial, max_recv_tokens=M, **buffer_kw)
            x = x0.clone().requires_grad_(True)
            w = w0.clone().requires_grad_(True)
            res = buf.dispatch(x, idx, w)
            pad = M - R
            want_tokens = torch.cat([exp["tokens"], torch.zeros(pad, H, dtype=dtype)])
            assert_bitwise(res.tokens, want_tokens.to(device), f"tokens (zero padding) {tag}")
            assert_bitwise(res.probs, torch.cat([exp["probs"], torch.zeros(pad)]).to(device), f"probs {tag}")
            minus = torch.full((pad,), -1, dtype=torch.int64)
            assert_bitwise(res.src_rank, torch.cat([exp["src_rank"], minus]).to(device), f"src_rank {tag}")
            assert_bitwise(res.src_token, torch.cat([exp["src_token"], minus]).to(device), f"src_token {tag}")
            assert_bitwise(res.tokens_per_expert, exp["tokens_per_expert"].to(device), f"tpe {tag}")
            assert res.handle.num_out_rows == M
            assert int(res.handle.num_rows_device.reshape(-1)[0]) == R, f"num_rows_device {tag}"

            # Expert outputs with poison in the padding rows: combine must not read them.
            eo_all = [seeded(seed * 13 + d + 100 * di, (routing[d].num_rows, H), dtype) for d in range(world_size)]
            poison = torch.full((pad, H), float("nan"), dtype=dtype)
            poison[::2] = 1e4
            eo = torch.cat([eo_all[rank], poison]).to(device).requires_grad_(True)
            y = buf.combine(eo, res.handle)
            pd = dtype if partial is None else partial
            assert_bitwise(y, oracle.expected_combine(routing, eo_all, rank, T[rank], dtype, pd).to(device),
                           f"combine ignores padding {tag}")

            # Backward: gradients arriving on padding rows must not reach x or topk_weights.
            G = [seeded(seed * 19 + d + 100 * di, (routing[d].num_rows + 3, H)) for d in range(world_size)]
            P = [seeded(seed * 23 + d + 100 * di, (routing[d].num_rows + 3,)) for d in range(world_size)]
            g_rank = torch.cat([G[rank][:R], G[rank][R:R + 1].expand(pad, H) + 5]).to(device)
            p_rank = torch.cat([P[rank][:R], torch.full((pad,), 7.0)]).to(device)
            Gy = seeded(seed * 29 + rank, (T[rank], H)).to(device)
            loss = ((res.tokens.float() * g_rank).sum() + (res.probs * p_rank).sum()
                    + (y.float() * Gy).sum())
            loss.backward()
            want_gx = oracle.expected_combine(routing, [g[:routing[d].num_rows].to(dtype) for d, g in enumerate(G)],
                                              rank, T[rank], dtype, pd)
            assert_bitwise(x.grad, want_gx.to(device), f"grad_x ignores padding {tag}")
            want_gw = oracle.expected_grad_topk_weights(
                routing, [p[:routing[d].num_rows] for d, p in enumerate(P)], rank, T[rank], spec["K"])
            assert_bitwise(w.grad, want_gw.to(device), f"grad_topk_weights ignores padding {tag}")
            Gy_all = [seeded(seed * 29 + s, (T[s], H)).to(dtype) for s in range(world_size)]
            want_geo = torch.cat([oracle.expected_dispatch_of(routing, Gy_all, rank),
                                  torch.zeros(pad, H, dtype=dtype)])
            assert_bitwise(eo.grad, want_geo.to(device), f"grad_expert_out (zero padding) {tag}")
            buf.destroy()

        # identity round trip in static mode: exact
        ints = spec_inputs(spec, world_size, dtype, seed + 500 + di, values="int", device=device)
        routing = oracle.route(ints, spec["E"])
        M = max(rr.num_rows for rr in routing) + extra_rows
        xi, ii, wi = ints[rank]
        n = oracle.routed_slots(ii.cpu()).to(device)
        want = torch.where((n > 0).view(-1, 1), xi.float() * n.view(-1, 1).float(),
                           torch.zeros((), device=device)).to(dtype)
        buf = _buffer(spec, dtype, backend, max_recv_tokens=M, **buffer_kw)
        res = buf.dispatch(xi, ii, wi)
        assert_bitwise(buf.combine(res.tokens, res.handle), want, f"static identity {dtype} rank {rank}")
        buf.destroy()
    return True


def _static(rank, world_size, name, extra_rows):
    spec = contract_cases(world_size)[name]
    return check_static_case(rank, world_size, spec, 41, extra_rows)


@pytest.mark.parametrize("world_size", (1, 2, 4))
@pytest.mark.parametrize("name,extra_rows", [("random", 5), ("unrouted_slots", 0),
                                              ("t0_on_rank0", 3), ("same_expert_twice", 1),
                                              ("experts_without_rows", 2), ("t0_everywhere", 0)])
def test_static_shape_against_oracle(name, extra_rows, world_size):
    assert run_distributed(_static, world_size, name, extra_rows) == [True] * world_size


def _overflow(rank, world_size, backend="reference", device="cpu"):
    """max_recv_tokens one short of the most-loaded rank's rows: that rank must raise. Its
    peers: on the reference backend the overflow is decided from the exchanged routing, so they
    raise ``MokPeerStopped`` naming it in the same dispatch ("told"); the CUDA backend's peers
    complete the call (the overflowing rank stops after it, at its host read)."""
    from megatron_mok.cuda.errors import MokPeerStopped

    spec = contract_cases(world_size)["all_to_one_expert"]       # every row lands on the last rank
    inputs = spec_inputs(spec, world_size, torch.bfloat16, 3, device=device)
    routing = oracle.route(inputs, spec["E"])
    R = [rr.num_rows for rr in routing]
    M = max(R) - 1
    buf = _buffer(spec, torch.bfloat16, backend, max_recv_tokens=M)
    if R[rank] > M:
        with pytest.raises(RuntimeError, match=rf"received {R[rank]} rows, more than max_recv_tokens={M}"):
            buf.dispatch(*inputs[rank])
            buf.check_errors()
        return "raised"
    if backend == "reference":
        last = world_size - 1
        with pytest.raises(MokPeerStopped, match=rf"rank {last} stopped.*rank {last} received {R[last]} rows"):
            buf.dispatch(*inputs[rank])
        return "told"
    res = buf.dispatch(*inputs[rank])
    buf.check_errors()
    assert res.tokens.shape[0] == M
    return "ok"


@pytest.mark.parametrize("world_size", (1, 2, 4))
def test_overflow_raises(world_size):
    got = run_distributed(_overflow, world_size)
    assert got == ["told"] * (world_size - 1) + ["raised"]


def test_zero_rows_static():
    buf = _buffer(dict(E=2, H=8, K=1, T_max=4), torch.float32, "reference", max_recv_tokens=0)
    (x, idx, w), = make_inputs(1, 1, [0], 2, 8, 1, torch.float32)
    res = buf.dispatch(x, idx, w)
    assert res.tokens.shape == (0, 8) and res.handle.num_out_rows == 0
    assert buf.combine(res.tokens, res.handle).shape == (0, 8)
    (x, idx, w), = make_inputs(1, 1, [1], 2, 8, 1, torch.float32)
    with pytest.raises(RuntimeError, match="max_recv_tokens=0"):
        buf.dispatch(x, idx, w)


def test_static_and_dynamic_agree_on_real_rows():
    spec = contract_cases(1)["mixed"]
    (x, idx, w), = spec_inputs(spec, 1, torch.bfloat16, 8)
    dyn = full_pass(_buffer(spec, torch.bfloat16, "reference"), x, idx, w, 4)
    R = dyn["tokens"].shape[0]
    sta = full_pass(_buffer(spec, torch.bfloat16, "reference", max_recv_tokens=R + 4), x, idx, w, 4)
    for k in ("tokens", "probs", "src_rank", "src_token", "grad_expert_out"):
        assert_bitwise(sta[k][:R], dyn[k], k)
    for k in ("tokens_per_expert",):
        assert_bitwise(sta[k], dyn[k], k)
    for k in ("y", "grad_x", "grad_topk_weights"):
        assert_bitwise(sta[k], dyn[k], k)

"""Receive budget: ``Buffer.dispatch(x, topk_idx, topk_weights, recv_budget=M)``.

``M`` rows out, as in static-shape mode (the CUDA backend reads nothing on the host); a rank
that receives more than ``M`` rows keeps the first ``M`` in contract order and drops the rest
**without an error**: never written, never combined, no gradient for their slots, and
``handle.over_budget`` says so (docs/CONTRACT.md, "Receive budget"). Megatron-core 0.19's
``moe_expert_rank_capacity_factor`` (HybridEP's static budget, rerun by ``PagedStashRunner``)
stands on it.

Every check runs on both backends: the reference on CPU (gloo), the CUDA backend on GPUs,
where it is also compared with the reference bitwise (forward and backward).
"""

import pytest
import torch

import megatron_mok as mok
from harness import (_buffer, assert_bitwise, assert_same_results, check_and_destroy,
                     contract_cases, full_pass, gpus_for, rank_device, run_distributed,
                     sample_expert, seeded, small_buffer, spec_inputs)

# Routing cases with their awkward ones: zero tokens on a rank or everywhere, unrouted slots,
# every token to one expert, experts without rows, odd T, more routes than the kernels keep in
# registers, a token naming one expert twice.
CASES = ("random", "t0_on_rank0", "t0_everywhere", "unrouted_slots", "all_to_one_expert",
         "experts_without_rows", "odd_t", "k16_duplicates", "mixed", "dsv3_like")
# The budget against this rank's rows R (each rank picks its own: only the receiver's rows
# depend on it): none kept, about half, exactly R (nothing dropped, the flag stays False), room.
BUDGETS = ("zero", "half", "exact", "room")

GPU_WORLDS = [pytest.param(1, marks=pytest.mark.gpu),
              pytest.param(2, marks=[pytest.mark.gpu, pytest.mark.multigpu,
                                     pytest.mark.skipif(not gpus_for(2), reason="needs 2 GPUs "
                                                        "(or MOK_TEST_SHARED_GPU=1)")])]


def budget_for(R: int, which: str, alignment: int) -> int:
    """``M`` for ``R`` received rows (a multiple of ``alignment``, as ``R`` is)."""
    return {"zero": 0, "half": R // 2 // alignment * alignment, "exact": R,
            "room": R + alignment}[which]


def _masked_pass(buf, x0, idx, w0, seed, keep):
    """``full_pass`` without a budget whose expert output is zero on the rows not in ``keep``
    (``[R]`` bool): what a budget's drop must equal (the dropped rows add +0.0 to every sum)."""
    x = x0.detach().clone().requires_grad_(True)
    w = w0.detach().clone().requires_grad_(True)
    res = buf.dispatch(x, idx, w)
    eo = sample_expert(res, res.tokens, res.probs, seed, buf.dtype)
    eo = torch.where(keep.view(-1, 1), eo, torch.zeros((), dtype=eo.dtype, device=eo.device))
    y = buf.combine(eo, res.handle)
    gy = seeded(seed + 1, tuple(y.shape), device=x0.device)
    (y.float() * gy).sum().backward()
    return y.detach(), x.grad, w.grad


def _budget_semantics(rank, world_size, name, seed, backend, alignment, which):
    """One case: the budget's outputs are the first ``M`` rows of the dispatch without one (zero
    rows after them), counts clamped to them, the flag, the rows received; combine and both
    gradients equal a pass without a budget whose dropped rows' expert output is zero; no error
    (``check_errors``). Returns ``(R, M)``."""
    dev = rank_device(rank)
    spec = contract_cases(world_size)[name]
    x, idx, w = spec_inputs(spec, world_size, torch.bfloat16, seed, device=dev)[rank]
    kw = dict(device=dev, expert_alignment=alignment, timeout_s=20)
    plain = _buffer(spec, torch.bfloat16, backend, **kw)
    p = plain.dispatch(x, idx, w)
    counts = [int(c) for c in p.tokens_per_expert.tolist()]
    R = sum(counts)
    M = budget_for(R, which, alignment)
    n = min(R, M)
    tag = f"[{name} rank {rank} A={alignment} R={R} M={M}]"
    buf = _buffer(spec, torch.bfloat16, backend, **kw)
    res = buf.dispatch(x, idx, w, recv_budget=M)
    assert res.tokens.shape == (M, spec["H"]) and res.handle.num_out_rows == M, tag
    for k, zero in (("tokens", 0), ("probs", 0), ("src_rank", -1), ("src_token", -1)):
        got, want = getattr(res, k), getattr(p, k)
        assert_bitwise(got[:n], want[:n], f"{k}: the first M rows {tag}")
        assert bool((got[n:] == zero).all()), f"{k}: rows past the kept ones {tag}"
    cum = [sum(counts[:e]) for e in range(len(counts) + 1)]
    want_tpe = [min(cum[e + 1], M) - min(cum[e], M) for e in range(len(counts))]
    assert res.tokens_per_expert.tolist() == want_tpe, f"tokens_per_expert {tag}"
    assert all(c % alignment == 0 for c in want_tpe), tag
    assert res.over_budget.dtype == torch.bool and res.over_budget.shape == (1,), tag
    assert bool(res.over_budget.item()) == (R > M), f"over_budget {tag}"
    assert res.over_budget.device == x.device, tag
    assert int(res.handle.rows_received.item()) == R, f"rows_received {tag}"
    assert int(res.handle.num_rows_device.reshape(-1)[0]) == n, f"num_rows_device {tag}"
    assert p.over_budget is None and p.handle.rows_received is None, "no budget, no flag"

    # Forward and backward against the pass without a budget whose dropped rows are zero.
    keep = torch.arange(R, device=dev) < M
    got = full_pass(buf, x, idx, w, seed, recv_budget=M)
    y, gx, gw = _masked_pass(plain, x, idx, w, seed, keep)
    assert torch.equal(got["y"], y.cpu()), f"combine after the drop {tag}"
    assert torch.equal(got["grad_x"], gx.cpu()), f"grad_x {tag}"
    assert torch.equal(got["grad_topk_weights"], gw.cpu()), f"grad_topk_weights {tag}"
    check_and_destroy(buf, plain)   # a drop is not an error
    return R, M


def _budget_cuda_vs_reference(rank, world_size, name, seed, alignment, which):
    """The CUDA backend's budget dispatch, combine and backward, bitwise the reference's on the
    same inputs (both on this rank's GPU), plus the flag and the rows received."""
    dev = rank_device(rank)
    spec = contract_cases(world_size)[name]
    x, idx, w = spec_inputs(spec, world_size, torch.bfloat16, seed, device=dev)[rank]
    kw = dict(device=dev, expert_alignment=alignment, timeout_s=20)
    cud = _buffer(spec, torch.bfloat16, "cuda", **kw)
    ref = _buffer(spec, torch.bfloat16, "reference", **kw)
    R = int(ref.dispatch(x, idx, w).tokens_per_expert.sum())
    cud.dispatch(x, idx, w)                 # the calls pair up across ranks on each Buffer
    M = budget_for(R, which, alignment)
    tag = f"[{name} rank {rank} A={alignment} R={R} M={M}]"
    a = full_pass(cud, x, idx, w, seed, recv_budget=M)
    b = full_pass(ref, x, idx, w, seed, recv_budget=M)
    assert_same_results(a, b, f"budget {tag}")
    rc, rr = cud.dispatch(x, idx, w, recv_budget=M), ref.dispatch(x, idx, w, recv_budget=M)
    for k in ("over_budget", "rows_received", "num_rows_device"):
        assert_bitwise(getattr(rc.handle, k), getattr(rr.handle, k), f"{k} {tag}")
    check_and_destroy(cud, ref)
    return R > M


def _budget_ring_reuse(rank, world_size, seed):
    """Budgets of 0, half, exact and none in turn on one CUDA Buffer whose ring holds two
    chunks, so every call reuses slots an earlier call wrote: each pass (forward and backward)
    bitwise the reference's. A rank whose budget is 0 has no rows yet receives some: its prob
    gradients' tensor is empty, and its side values (which its peers add into their
    grad_topk_weights) must still be written, not left as a slot's stale values (the fuzzer
    found that, s36-2; the fresh Buffers above never reuse a slot)."""
    from test_cuda_backend import ring_chunk_bytes

    dev = rank_device(rank)
    spec = dict(contract_cases(world_size)["random"], H=64)
    disp, comb = ring_chunk_bytes(spec["H"], spec["K"], 2, 2)
    kw = dict(device=dev, timeout_s=20)
    cud = _buffer(spec, torch.bfloat16, "cuda", ring_bytes=2 * max(disp, comb), **kw)
    ref = _buffer(spec, torch.bfloat16, "reference", **kw)
    dropped = 0
    for i, which in enumerate(("none", "zero", "half", "zero", "exact", "none", "zero")):
        x, idx, w = spec_inputs(spec, world_size, torch.bfloat16, seed + i, device=dev)[rank]
        R = int(ref.dispatch(x, idx, w).tokens_per_expert.sum())
        cud.dispatch(x, idx, w)             # (the calls pair up across ranks on each Buffer)
        # Rank 0 drops everything in the "zero" calls, the others keep half: the mix of an
        # empty rank and rows to combine that the fuzzer's cases had.
        M = None if which == "none" else budget_for(R, "half" if which == "zero" and rank else which, 1)
        a = full_pass(cud, x, idx, w, seed + i, recv_budget=M)
        b = full_pass(ref, x, idx, w, seed + i, recv_budget=M)
        assert_same_results(a, b, f"call {i} budget {which} (M={M}, R={R}) rank {rank}")
        dropped += M is not None and R > M
    check_and_destroy(cud, ref)
    return dropped


def _budget_cached_and_static(rank, world_size, backend):
    """A cached dispatch along a budget's handle writes the same kept rows (its backward is the
    budget's combine); on a static-shape Buffer the budget replaces ``max_recv_tokens`` for the
    call, above or below it, and a drop is still no error."""
    dev = rank_device(rank)
    spec = contract_cases(world_size)["mixed"]
    x, idx, w = spec_inputs(spec, world_size, torch.bfloat16, 5, device=dev)[rank]
    x2 = spec_inputs(spec, world_size, torch.bfloat16, 6, device=dev)[rank][0]
    buf = _buffer(spec, torch.bfloat16, backend, device=dev, timeout_s=20)
    R = int(buf.dispatch(x, idx, w).tokens_per_expert.sum())
    M = R * 2 // 3
    res = buf.dispatch(x, idx, w, recv_budget=M)
    again = buf.dispatch(x2, idx, w, recv_budget=M)
    cached = buf.dispatch(x2, handle=res.handle)
    assert_bitwise(cached.tokens, again.tokens, f"cached along a budget's handle rank {rank}")
    assert bool(res.over_budget.item()) == (R > M)
    for cap in (M // 2, R + 5):
        static = _buffer(spec, torch.bfloat16, backend, device=dev, max_recv_tokens=cap,
                         timeout_s=20)
        got = static.dispatch(x, idx, w, recv_budget=M)
        assert got.tokens.shape[0] == M, f"the budget, not max_recv_tokens={cap}"
        assert_bitwise(got.tokens, res.tokens, f"static Buffer (cap {cap}) with a budget rank {rank}")
        check_and_destroy(static)
    check_and_destroy(buf)
    return R > M


def _budget_fp8(rank, world_size, backend):
    """An FP8 pair with a budget: the first ``M`` rows' bytes of the pair dispatch without one."""
    dev = rank_device(rank)
    spec = dict(contract_cases(world_size)["random"], H=256)
    x, idx, w = spec_inputs(spec, world_size, torch.bfloat16, 12, device=dev)[rank]
    pair = mok.fp8.quantize(x)
    buf = _buffer(spec, torch.bfloat16, backend, device=dev, timeout_s=20)
    p = buf.dispatch(pair, idx, w)
    R = int(p.tokens_per_expert.sum())
    M = R // 2
    res = buf.dispatch(pair, idx, w, recv_budget=M)
    for got, want, what in zip(res.tokens, p.tokens, ("rows_fp8", "row_scales")):
        assert got.shape[0] == M
        assert_bitwise(got[:M].view(torch.uint8), want[:M].view(torch.uint8), f"{what} rank {rank}")
    assert bool(res.over_budget.item()) == (R > M)
    check_and_destroy(buf)
    return R > M


# ------------------------------------------------------------------------------- CPU (reference)
@pytest.mark.parametrize("which", BUDGETS)
@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("world_size", (1, 2, 3))
def test_budget_keeps_the_first_rows_and_flags_the_drop(world_size, name, which):
    got = run_distributed(_budget_semantics, world_size, name, 31, "reference", 1, which)
    if which == "half" and any(R >= 2 for R, _ in got):   # (no rows anywhere: nothing to drop)
        assert any(R > M for R, M in got), f"no rank dropped a row: proves nothing ({got})"
    if which in ("exact", "room"):
        assert not any(R > M for R, M in got)


@pytest.mark.parametrize("which", ("half", "exact"))
def test_budget_with_expert_alignment(which):
    got = run_distributed(_budget_semantics, 2, "mixed", 37, "reference", 16, which)
    assert which == "exact" or any(R > M for R, M in got)


def test_budget_cached_dispatch_and_static_buffer():
    assert any(run_distributed(_budget_cached_and_static, 2, "reference"))


def test_budget_fp8_pair():
    assert any(run_distributed(_budget_fp8, 2, "reference"))


@pytest.mark.parametrize("bad, message", [
    (-1, "recv_budget must be None or an int >= 0"),
    (True, "recv_budget must be None or an int >= 0"),
    (3.0, "recv_budget must be None or an int >= 0"),
    (1 << 31, "32-bit row indices"),
])
def test_bad_budget_is_refused(bad, message):
    buf = small_buffer()
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    idx = torch.tensor([[0, 1], [2, 3], [1, -1], [3, 0]])
    w = torch.rand(4, 2)
    with pytest.raises(ValueError, match=message):
        buf.dispatch(x, idx, w, recv_budget=bad)
    buf.dispatch(x, idx, w, recv_budget=2)     # (a world of one rank stays usable)


def test_budget_must_be_a_multiple_of_the_alignment_and_alone():
    buf = small_buffer(expert_alignment=4)
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    idx = torch.tensor([[0, 1], [2, 3], [1, -1], [3, 0]])
    w = torch.rand(4, 2)
    with pytest.raises(ValueError, match="not a multiple of the Buffer's expert_alignment=4"):
        buf.dispatch(x, idx, w, recv_budget=6)
    with pytest.raises(ValueError, match="rows_per_expert or recv_budget, not both"):
        buf.dispatch(x, idx, w, rows_per_expert=4, recv_budget=8)
    res = buf.dispatch(x, idx, w, recv_budget=8)
    with pytest.raises(ValueError, match="recv_budget is for routed dispatches"):
        buf.dispatch(x, handle=res.handle, recv_budget=8)


# ------------------------------------------------------------------------------------- GPUs
def _each(rank, world_size, worker, calls):
    """``worker(rank, world_size, *args)`` for every ``args`` in ``calls``, in one set of
    processes (a GPU process start per case would cost more than the cases)."""
    fn = globals()[worker]
    return [fn(rank, world_size, *args) for args in calls]


@pytest.mark.parametrize("world_size", GPU_WORLDS)
def test_cuda_budget_semantics(world_size):
    calls = [(name, 41, "cuda", 1, which) for name in CASES for which in ("zero", "half", "exact")]
    calls += [("mixed", 47, "cuda", 16, "half"), ("dsv3_like", 47, "cuda", 16, "room")]
    got = run_distributed(_each, world_size, "_budget_semantics", calls, backend="nccl",
                          timeout=600, fresh=True)
    assert any(R > M for per_rank in got for R, M in per_rank), "no case dropped a row"


@pytest.mark.parametrize("world_size", GPU_WORLDS)
def test_cuda_budget_bitwise_the_reference(world_size):
    calls = [(name, 43, alignment, which)
             for name in ("random", "mixed", "all_to_one_expert", "k16_duplicates", "t0_on_rank0",
                          "dsv3_like", "unrouted_slots")
             for alignment, which in ((1, "half"), (1, "room"), (16, "half"), (16, "exact"),
                                      (1, "zero"))]
    got = run_distributed(_each, world_size, "_budget_cuda_vs_reference", calls, backend="nccl",
                          timeout=600, fresh=True)
    assert any(any(per_rank) for per_rank in got), "no case dropped a row"


@pytest.mark.parametrize("world_size", GPU_WORLDS)
def test_cuda_budget_cached_dispatch_static_buffer_and_fp8(world_size):
    got = run_distributed(_each, world_size, "_budget_cached_and_static", [("cuda",)],
                          backend="nccl", timeout=300, fresh=True)
    assert any(any(r) for r in got)
    got = run_distributed(_each, world_size, "_budget_fp8", [("cuda",)], backend="nccl",
                          timeout=300, fresh=True)
    assert any(any(r) for r in got)


@pytest.mark.parametrize("world_size", GPU_WORLDS[1:] + [pytest.param(
    3, marks=[pytest.mark.gpu, pytest.mark.multigpu,
              pytest.mark.skipif(not gpus_for(3), reason="needs 3 GPUs (or MOK_TEST_SHARED_GPU=1)")])])
def test_cuda_budget_zero_beside_peers_reusing_ring_slots(world_size):
    got = run_distributed(_budget_ring_reuse, world_size, 61, backend="nccl", timeout=300,
                          fresh=True)
    assert all(d > 0 for d in got), f"calls that dropped rows per rank: {got}"

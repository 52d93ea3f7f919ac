"""The CUDA backend against the reference backend, BITWISE, forward and backward, on real
GPUs (NCCL, one process per GPU); plus repeatability, SM counts, ring wrap-around, CUDA
graphs of static-shape mode, a missing peer, and world size 1.

Skipped without GPUs (markers ``gpu``/``multigpu``, see conftest.py). The CPU tests at the
bottom run the same comparison code with the reference backend on both sides over gloo,
so the GPU tests' own logic is exercised on every CI run.

NVLink multicast stays off: ``harness`` forces NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and NVSHMEM_DISABLE_NVLS=1 before any process group.
"""

import os
import time
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

import oracle
from harness import (ALIGNMENT_CASES, DTYPES, _buffer, capture_in_turn, check_alignment_case, check_and_destroy, settle, assert_bitwise, assert_same_results, backward_by_hand,
                     contract_cases, full_pass, gpus_for, in_loopback, loopback_barrier, make_inputs, rank_device, run_distributed,
                     seeded, spec_inputs, sync_device)
from test_cached_dispatch import check_cached_case
from test_static_shape import _overflow, check_static_case

GPU_WORLD_SIZES = [
    pytest.param(2, marks=[pytest.mark.gpu, pytest.mark.multigpu]),
    pytest.param(4, marks=[pytest.mark.gpu, pytest.mark.multigpu, pytest.mark.skipif(
        not gpus_for(4), reason="needs 4 GPUs (or MOK_TEST_SHARED_GPU=1)")]),
]
CASE_NAMES = tuple(contract_cases(2))
# The layout's two paths: publish + count + scan fused into one launch (the default for
# layouts of at most 8192 groups) and the three kernels (MOK_LAYOUT_FUSED=0).
LAYOUT_PATHS = [pytest.param({}, id="fused_layout"),
                pytest.param({"MOK_LAYOUT_FUSED": "0"}, id="three_kernel_layout")]


# --------------------------------------------------------------------------- the comparisons
def _backend_vs_reference(rank, world_size, name, seed, backend="cuda", **kw):
    """Forward + backward of ``backend`` and of the reference on the same inputs: every
    output and gradient bitwise equal; dispatch fields also against the oracle; the
    identity round trip exact."""
    dev = rank_device(rank)
    spec = contract_cases(world_size)[name]
    for di, dtype in enumerate(DTYPES):
        inputs = spec_inputs(spec, world_size, dtype, seed + di, device=dev)
        exp = oracle.expected_dispatch([tuple(t.cpu() for t in inp) for inp in inputs], spec["E"], rank)
        ints = spec_inputs(spec, world_size, dtype, seed + 100 + di, values="int", device=dev)
        xi, ii, wi = ints[rank]
        n = oracle.routed_slots(ii.cpu())
        want_id = torch.where((n > 0).view(-1, 1), xi.cpu().float() * n.view(-1, 1).float(),
                              torch.zeros(())).to(dtype)
        for partial in (None, torch.float32):
            tag = f"[{name} {dtype} partial={partial} rank {rank}]"
            buf = _buffer(spec, dtype, backend, partial, device=dev, **kw)
            ref = _buffer(spec, dtype, "reference", partial, device=dev)
            got = full_pass(buf, *inputs[rank], seed)
            want = full_pass(ref, *inputs[rank], seed)
            assert_same_results(got, want, f"{backend} vs reference {tag}")
            for k in ("tokens", "probs", "tokens_per_expert", "src_rank", "src_token"):
                assert_bitwise(got[k], exp[k], f"{k} vs oracle {tag}")
            res = buf.dispatch(xi, ii, wi)
            assert_bitwise(buf.combine(res.tokens, res.handle), want_id, f"identity round trip {tag}")
            if hasattr(buf, "check_errors"):
                buf.check_errors()
            buf.destroy()
            ref.destroy()
    return True


def _repeats_and_sms(rank, world_size, name, seed, backend="cuda", sms_list=(4, 16, 24), repeats=20):
    dev = rank_device(rank)
    spec = contract_cases(world_size)[name]
    for di, dtype in enumerate((torch.bfloat16, torch.float32)):
        inputs = spec_inputs(spec, world_size, dtype, seed + di, device=dev)
        ref = _buffer(spec, dtype, "reference", device=dev)
        want = full_pass(ref, *inputs[rank], seed)
        ref.destroy()
        for sms in sms_list:
            buf = _buffer(spec, dtype, backend, device=dev, num_sms=sms)
            tag = f"[{name} {dtype} num_sms={sms} rank {rank}]"
            for i in range(repeats if sms == sms_list[-1] else 2):
                assert_same_results(full_pass(buf, *inputs[rank], seed), want, f"run {i} {tag}")
            buf.destroy()
    return True


def ring_chunk_bytes(H, K, elem=2, partial_elem=2):
    """Bytes of one dispatch / combine ring chunk of the CUDA backend (its chunk size)."""
    try:
        from megatron_mok.cuda.backend import DEFAULT_CHUNK_TOKENS, ring_chunk_bytes as chunk_bytes
    except Exception:       # the reference-only self-check does not need the CUDA module
        return 64 * H * elem, 64 * H * partial_elem + 64 * K * 4
    return chunk_bytes(DEFAULT_CHUNK_TOKENS, H, K, elem, partial_elem)


def _ring_wrap(rank, world_size, calls, backend="cuda", chunks=3, T_max=1024, require_big=True,
               dtype=torch.bfloat16, K=4, **buffer_kw):
    """``calls`` dispatch/combine calls of varying size through a ring of ``chunks`` chunks
    (wraps many times); one call larger than the whole ring (``require_big``; otherwise one
    call of T_max tokens); each checked bitwise against the reference, with a full backward
    every 50th call. ``E = 4 x world_size`` experts, top-``K``, rows of ``dtype``."""
    dev = rank_device(rank)
    H, E = 256, 4 * world_size
    elem = dtype.itemsize
    disp, comb = ring_chunk_bytes(H, K, elem, elem)
    ring = chunks * max(disp, comb)
    buf = mok_buffer(E, H, K, T_max, dtype, backend, dev, ring_bytes=ring, timeout_s=30, **buffer_kw)
    ref = mok_buffer(E, H, K, T_max, dtype, "reference", dev)
    g = torch.Generator().manual_seed(77)                      # same sequence on every rank
    cases = ("duplicate", "mixed", "skewed", "one_expert")
    big_call = calls // 2
    rows_seen = 0
    for i in range(calls):
        T_all = [int(v) for v in torch.randint(0, min(300, T_max + 1), (world_size,), generator=g)]
        if i == big_call:
            T_all = [T_max] * world_size                       # T_max * H * elem bytes > ring
            assert T_max * H * elem > ring or not require_big
        inputs = make_inputs(1000 + i, world_size, T_all, E, H, K, dtype, case=cases[i % 4], device=dev)
        tag = f"call {i} T={T_all} rank {rank}"
        if i % 50 == 7 or i == big_call:
            assert_same_results(full_pass(buf, *inputs[rank], i), full_pass(ref, *inputs[rank], i), tag)
            continue
        a, b = buf.dispatch(*inputs[rank]), ref.dispatch(*inputs[rank])
        try:
            assert_bitwise(a.tokens, b.tokens, f"tokens {tag}")
        except AssertionError as e:
            # A transfer that timed out leaves rows unwritten and reports at the next host read:
            # name that error here instead of only the wrong bits it left.
            raise AssertionError(f"{e}; {_describe_wrong_rows(a, b)}; device error: "
                                 f"{_device_error(buf)}") from None
        assert_bitwise(a.probs, b.probs, f"probs {tag}")
        assert_bitwise(a.src_token, b.src_token, f"src_token {tag}")
        eo = (a.tokens.float() * 1.25).to(dtype)
        assert_bitwise(buf.combine(eo, a.handle), ref.combine(eo, b.handle), f"combine {tag}")
        rows_seen += a.tokens.shape[0]
    if hasattr(buf, "check_errors"):
        buf.check_errors()
    buf.destroy()
    ref.destroy()
    return rows_seen, ring


def _ring_reused_every_call(rank, world_size, calls, backend="cuda"):
    """A dispatch ring of exactly one call's chunks (T_max = 192: 3 chunks of 64 tokens, ring of
    3): every call stages into every slot the call before it read, so each staging waits for
    the peers' releases of the previous call, which a call that fits in the ring makes once,
    from the grid's last warp (NOTES #30), rather than per task. Bitwise against the reference
    (the combine ring, W x 3 chunks per call, takes the role split)."""
    from megatron_mok.cuda.backend import DEFAULT_CHUNK_TOKENS as C
    assert C == 64, C
    return _ring_wrap(rank, world_size, calls, backend, 3, 3 * C, require_big=False)


def _device_error(buf) -> str:
    """The Buffer's pending device error report (raised by check_errors), or 'none'."""
    try:
        if hasattr(buf, "check_errors"):
            buf.check_errors()
    except Exception as e:      # the report itself is what we want
        return str(e)
    return "none"


def _describe_wrong_rows(a, b, chunk_tokens=64) -> str:
    """Which dispatched rows differ (same shapes assumed): counts by source rank and by
    (source, ring chunk of the source token), and how many are all-zero or hold another
    expected row's bits (a row never written, or written from the wrong place)."""
    settle(a.tokens.device)
    got, want = a.tokens.detach().cpu(), b.tokens.detach().cpu()
    if got.shape != want.shape:
        return f"shapes differ ({tuple(got.shape)} vs {tuple(want.shape)})"
    got_i, want_i = got.view(-1, got.shape[-1]).view(torch.int16), want.view(-1, want.shape[-1]).view(torch.int16)
    wrong = (got_i != want_i).any(1).nonzero().flatten().tolist()
    src_rank, src_token = b.handle.src_rank.cpu().tolist(), b.handle.src_token.cpu().tolist()
    by_src, by_chunk = {}, {}
    expected = {bytes(want_i[j].numpy().tobytes()) for j in range(want_i.shape[0])}
    zero = other_row = 0
    for r in wrong:
        s_, c_ = src_rank[r], src_token[r] // chunk_tokens
        by_src[s_] = by_src.get(s_, 0) + 1
        by_chunk[(s_, c_)] = by_chunk.get((s_, c_), 0) + 1
        row = got_i[r]
        zero += int(not bool(row.any()))
        other_row += int(bool(row.any()) and bytes(row.numpy().tobytes()) in expected)
    return (f"{len(wrong)} of {want_i.shape[0]} rows wrong (first {wrong[:6]}); by source rank {by_src}; "
            f"by (source, chunk) {dict(sorted(by_chunk.items()))}; {zero} all-zero, {other_row} hold "
            f"another expected row")


def test_describe_wrong_rows_names_sources_chunks_and_unwritten_rows():
    # CPU: the message a ring-wrap mismatch carries (a rare W=8 loopback failure, session 5,
    # left only "first at (20, 0)"; this says which peer's chunks and what the rows hold).
    want = torch.randn(6, 8).to(torch.bfloat16)
    got = want.clone()
    got[1] = 0            # never written
    got[4] = want[2]      # written from the wrong place
    h = SimpleNamespace(src_rank=torch.tensor([0, 1, 1, 0, 1, 0]), src_token=torch.tensor([3, 70, 5, 64, 2, 1]))
    msg = _describe_wrong_rows(SimpleNamespace(tokens=got), SimpleNamespace(tokens=want, handle=h))
    assert msg.startswith("2 of 6 rows wrong (first [1, 4])"), msg
    assert "by source rank {1: 2}" in msg and "(1, 0): 1, (1, 1): 1" in msg, msg
    assert "1 all-zero, 1 hold another expected row" in msg, msg
    short = _describe_wrong_rows(SimpleNamespace(tokens=got[:5]), SimpleNamespace(tokens=want, handle=h))
    assert short == "shapes differ ((5, 8) vs (6, 8))", short


def mok_buffer(E, H, K, T_max, dtype, backend, device, **kw):
    import megatron_mok as mok

    return mok.Buffer(None, num_experts=E, hidden=H, topk=K, max_tokens_per_rank=T_max, dtype=dtype,
                      backend=backend, device=device, **kw)


def _alignment_vs_reference(rank, world_size, name, seed, alignment, backend="cuda"):
    """``expert_alignment``: the CUDA backend's aligned dispatch is a relayout of its unaligned
    one (harness.check_alignment_case), equal to the aligned reference, also in static-shape
    mode."""
    spec = contract_cases(world_size)[name]
    return check_alignment_case(rank, world_size, spec, seed, backend, alignment,
                                device=rank_device(rank), ref_backend="reference", static_extra=5)


def _fixed_rows_vs_reference(rank, world_size, name, seed, alignment, extra, backend="cuda"):
    """``rows_per_expert``: the CUDA backend's fixed-rows dispatch is a relayout of its plain
    one (harness.check_alignment_case with capacity_extra), equal to the reference's, also in
    static-shape mode."""
    spec = contract_cases(world_size)[name]
    return check_alignment_case(rank, world_size, spec, seed, backend, alignment,
                                device=rank_device(rank), ref_backend="reference", static_extra=5,
                                capacity_extra=extra)


def _fixed_rows_separate_launches(rank, world_size, seed):
    """A static-shape dispatch with rows_per_expert through the backend's general path (one
    library call per step, as ``separate_launches`` and the copy-engine overlap take it) equals
    the reference's, bitwise, forward and backward, and knows R on the host."""
    dev = rank_device(rank)
    spec = contract_cases(world_size)["random"]
    x, idx, w = spec_inputs(spec, world_size, torch.bfloat16, seed, device=dev)[rank]
    n = spec["T_max"] * spec["K"] * world_size
    cap = spec["E"] // world_size * n + 7
    cud = _buffer(spec, torch.bfloat16, "cuda", device=dev, max_recv_tokens=cap)
    cud._get_backend("cuda").separate_launches = True
    ref = _buffer(spec, torch.bfloat16, "reference", device=dev, max_recv_tokens=cap)
    a = full_pass(cud, x, idx, w, seed, rows_per_expert=n)
    assert_same_results(a, full_pass(ref, x, idx, w, seed, rows_per_expert=n),
                        f"separate launches rank {rank}")
    assert cud.dispatch(x, idx, w, rows_per_expert=n).handle.num_rows == cap - 7
    check_and_destroy(cud)
    ref.destroy()
    return True


def _rows_overflow(rank, world_size, seed, backend="cuda"):
    """``rows_per_expert`` one short of this rank's fullest expert: a static-shape dispatch
    drops that expert's rows past N (each expert keeps its first N rows in contract order, the
    others are whole, zero rows after them), combine sums the kept rows only, and the error
    check names the expert; an eager dispatch raises the same error after its launch."""
    dev = rank_device(rank)
    spec = dict(T=[37, 51, 20, 44][:world_size], T_max=60, E=4 * world_size, H=72, K=3,
                case="random", idx_dtype=torch.int64)
    x, idx, w = spec_inputs(spec, world_size, torch.bfloat16, seed, device=dev)[rank]
    plain = _buffer(spec, torch.bfloat16, backend, device=dev)
    p = plain.dispatch(x, idx, w)
    counts = [int(c) for c in p.tokens_per_expert.tolist()]
    assert max(counts) > 0, "no rows on this rank: nothing could overflow"
    n = max(counts) - 1
    hot = counts.index(max(counts))
    static = _buffer(spec, torch.bfloat16, backend, device=dev,
                     max_recv_tokens=len(counts) * n + 3, timeout_s=20)
    res = static.dispatch(x, idx, w, rows_per_expert=n)
    assert res.handle.num_rows == len(counts) * n
    expect_tokens = torch.zeros_like(res.tokens)
    expect_src = torch.full_like(res.src_rank, -1)
    kept = torch.zeros(p.tokens.shape[0], dtype=torch.bool, device=dev)
    start = 0
    for e, c in enumerate(counts):
        keep = min(c, n)
        expect_tokens[e * n: e * n + keep] = p.tokens[start: start + keep]
        expect_src[e * n: e * n + keep] = p.src_rank[start: start + keep]
        kept[start: start + keep] = True
        start += c
    assert_bitwise(res.tokens, expect_tokens, f"rows with expert {hot} over N={n}")
    assert_bitwise(res.src_rank, expect_src, f"src_rank with expert {hot} over N={n}")
    y = static.combine(res.tokens, res.handle)
    y_expect = plain.combine(torch.where(kept.view(-1, 1), p.tokens, torch.zeros_like(p.tokens)),
                             p.handle)
    assert torch.equal(y, y_expect), "combine after the drop: not the kept rows' sum"
    message = rf"local expert {hot} received {max(counts)} rows, more than rows_per_expert={n}"
    with pytest.raises(RuntimeError, match=message):
        static.check_errors()
    eager = _buffer(spec, torch.bfloat16, backend, device=dev, timeout_s=20)
    with pytest.raises(RuntimeError, match=message):
        eager.dispatch(x, idx, w, rows_per_expert=n)
    check_and_destroy(plain)
    for b in (static, eager):
        b.destroy()
    return True


def _rows_overflow_on_rank0_only(rank, world_size):
    """An expert past rows_per_expert on one rank is that rank's error (_error_on_rank0_only)."""
    return _error_on_rank0_only(rank, world_size, 6, "more than rows_per_expert=0",
                                lambda idx, E: (idx, {"rows_per_expert": 0}),
                                {"rows_per_expert": 16 * world_size * 2})


def _alignment_big_layout(rank, world_size, env, alignment, backend="cuda", capacity_extra=None):
    """``expert_alignment`` on a layout of many groups: 128 local experts, hot ones (skewed),
    8-token chunks, so the scan runs over several tiles (past the fused layout's 8192 groups
    at 2+ ranks). Loopback ranks share one environment: the test sets MOK_CHUNK_TOKENS there."""
    spec = dict(T=[300, 250, 287, 199][:world_size] + [260] * max(0, world_size - 4), T_max=303,
                E=128 * world_size, H=64, K=8, case="skewed", idx_dtype=torch.int64)
    env = env if in_loopback() else {"MOK_CHUNK_TOKENS": "8", **env}
    return _with_env(env, check_alignment_case, rank, world_size, spec,
                     55 + alignment, backend, alignment, rank_device(rank), "reference", 4,
                     (torch.bfloat16,), capacity_extra)


# ------------------------------------------------------------------------------- GPU tests
@pytest.mark.parametrize("world_size", GPU_WORLD_SIZES)
@pytest.mark.parametrize("alignment", (16, 3))
@pytest.mark.parametrize("name", ALIGNMENT_CASES)
def test_cuda_expert_alignment(name, alignment, world_size):
    run_distributed(_alignment_vs_reference, world_size, name, 313, alignment, backend="nccl", timeout=300)


@pytest.mark.gpu
@pytest.mark.parametrize("alignment", (16, 32))
@pytest.mark.parametrize("name", ("random", "t_max_exact", "all_to_one_expert", "k16_duplicates"))
def test_cuda_expert_alignment_world_size_1(name, alignment):
    run_distributed(_alignment_vs_reference, 1, name, 314, alignment, backend="nccl", timeout=300)


def _alignment_ignores_speculative(rank, world_size):
    """MOK_EAGER_SPECULATIVE=1 with expert_alignment: a warning, eager dispatches that read R
    first, and the aligned results unchanged (bitwise = the aligned reference)."""
    import warnings

    def run():
        spec = contract_cases(world_size)["random"]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            probe = _buffer(spec, torch.bfloat16, "cuda", device=rank_device(rank), expert_alignment=16)
            be = probe._get_backend("cuda")
        assert not be.speculative and any("MOK_EAGER_SPECULATIVE" in str(w.message) for w in caught)
        probe.destroy()
        return _alignment_vs_reference(rank, world_size, "random", 316, 16)

    return _with_env({"MOK_EAGER_SPECULATIVE": "1"}, lambda r, w: run(), rank, world_size)


@pytest.mark.gpu
def test_cuda_expert_alignment_ignores_speculative():
    run_distributed(_alignment_ignores_speculative, 1, backend="nccl", timeout=300)


@pytest.mark.parametrize("world_size", [pytest.param(1, marks=pytest.mark.gpu)] + GPU_WORLD_SIZES)
@pytest.mark.parametrize("env", LAYOUT_PATHS)
def test_cuda_expert_alignment_big_layout(env, world_size):
    gaps = run_distributed(_alignment_big_layout, world_size, env, 16, backend="nccl", timeout=300)
    assert sum(gaps) > 0


FIXED_ROWS = [pytest.param(1, 0, id="N=max"), pytest.param(1, 3, id="N=max+3"),
              pytest.param(16, 5, id="A=16,N=max+5")]


@pytest.mark.parametrize("world_size", GPU_WORLD_SIZES)
@pytest.mark.parametrize("alignment,extra", FIXED_ROWS)
@pytest.mark.parametrize("name", ALIGNMENT_CASES)
def test_cuda_rows_per_expert(name, alignment, extra, world_size):
    run_distributed(_fixed_rows_vs_reference, world_size, name, 413, alignment, extra,
                    backend="nccl", timeout=300)


@pytest.mark.gpu
@pytest.mark.parametrize("alignment,extra", FIXED_ROWS)
@pytest.mark.parametrize("name", ("random", "t_max_exact", "t0_everywhere", "all_to_one_expert",
                                  "experts_without_rows", "k16_duplicates"))
def test_cuda_rows_per_expert_world_size_1(name, alignment, extra):
    run_distributed(_fixed_rows_vs_reference, 1, name, 414, alignment, extra, backend="nccl", timeout=300)


@pytest.mark.parametrize("world_size", [pytest.param(1, marks=pytest.mark.gpu)] + GPU_WORLD_SIZES)
@pytest.mark.parametrize("env", LAYOUT_PATHS)
def test_cuda_rows_per_expert_big_layout(env, world_size):
    gaps = run_distributed(_alignment_big_layout, world_size, env, 1, capacity_extra=2,
                           backend="nccl", timeout=300)
    assert min(gaps) >= 2 * 128


@pytest.mark.parametrize("world_size", [pytest.param(1, marks=pytest.mark.gpu)] + GPU_WORLD_SIZES)
def test_cuda_rows_per_expert_separate_launches(world_size):
    run_distributed(_fixed_rows_separate_launches, world_size, 91, backend="nccl", timeout=300)


@pytest.mark.parametrize("world_size", [pytest.param(1, marks=pytest.mark.gpu)] + GPU_WORLD_SIZES)
def test_cuda_rows_per_expert_overflow_drops_and_raises(world_size):
    run_distributed(_rows_overflow, world_size, 77, backend="nccl", timeout=300, fresh=True)


@pytest.mark.parametrize("world_size", GPU_WORLD_SIZES)
def test_cuda_rows_per_expert_overflow_on_one_rank_does_not_stall_its_peers(world_size):
    took = run_distributed(_rows_overflow_on_rank0_only, world_size, backend="nccl", timeout=120, fresh=True)
    assert max(took) < 8, f"a rank waited {max(took):.1f} s (its peer's transfer never ran?)"



@pytest.mark.parametrize("world_size", GPU_WORLD_SIZES)
@pytest.mark.parametrize("name", CASE_NAMES)
def test_cuda_matches_reference(name, world_size):
    run_distributed(_backend_vs_reference, world_size, name, 2024, backend="nccl", timeout=300)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ("random", "mixed", "t0_everywhere", "k1", "same_expert_twice", "narrow_rows"))
def test_cuda_world_size_1(name):
    run_distributed(_backend_vs_reference, 1, name, 99, backend="nccl", timeout=300)


@pytest.mark.parametrize("world_size", GPU_WORLD_SIZES)
@pytest.mark.parametrize("name", ("random", "dsv3_like", "mixed"))
def test_cuda_repeats_and_sm_counts_bitwise(name, world_size):
    run_distributed(_repeats_and_sms, world_size, name, 5, backend="nccl", timeout=300)


@pytest.mark.parametrize("world_size", GPU_WORLD_SIZES)
def test_cuda_dispatch_ring_reused_every_call(world_size):
    rows, ring = run_distributed(_ring_reused_every_call, world_size, 300, backend="nccl", timeout=600)[0]
    assert rows * 256 * 2 > 50 * ring, "the ring was not reused call after call"


@pytest.mark.parametrize("world_size", GPU_WORLD_SIZES)
def test_cuda_ring_wraps_1000_calls(world_size):
    out = run_distributed(_ring_wrap, world_size, 1000, backend="nccl", timeout=600)
    rows, ring = out[0]
    assert rows * 256 * 2 > 20 * ring, "the ring did not wrap many times"


# Alternative schedules, chosen by environment variables the backend reads when a Buffer is
# made (eager staging on a side stream before the host read, MOK_EAGER_STAGE_FIRST=1) or at
# each combine launch (role split instead of phases, MOK_COMBINE_PHASED=0; one warp per token
# and per task even when a call has fewer of them than warps, MOK_COMBINE_SPLIT=0; own expert
# rows loaded into registers instead of streamed through shared memory,
# MOK_COMBINE_STREAM_OWN=0; the dispatch's per-task chunk release accounting even when a
# call fits in the ring, MOK_DISPATCH_RELEASE_AT_END=0; SM staging blocks instead of the copy
# engine, MOK_DISPATCH_CE_STAGE=0; phased combine consumers taking every n-th token instead of
# runs of consecutive ones, MOK_COMBINE_TOKEN_RUNS=0; the same for the dispatch's pulling warps,
# MOK_DISPATCH_TASK_RUNS=0; the copy-engine staging forked onto a side stream beside the layout
# instead of queued on the dispatch's own stream, MOK_DISPATCH_CE_OVERLAP=1 (opt-in); phased
# combine consumers releasing the peers' partial chunks per token instead of once per call,
# MOK_COMBINE_RELEASE_AT_END=0; phased combine consumers summing their own expert rows in the
# consume loop instead of reading their own partials staged by the produce phase,
# MOK_COMBINE_OWN_STAGED=0; the phased produce phase taking every n-th task instead of runs of
# consecutive ones, MOK_COMBINE_PRODUCE_RUNS=0). Each must
# give the reference's bits; the ring test also runs the eager staging through a wrapping ring.
ALT_SCHEDULES = [
    pytest.param({"MOK_EAGER_STAGE_FIRST": "1"}, id="eager_stage_first"),
    pytest.param({"MOK_COMBINE_PHASED": "0"}, id="combine_role_split"),
    pytest.param({"MOK_COMBINE_SPLIT": "0"}, id="combine_no_split"),
    pytest.param({"MOK_EAGER_FILL_FIRST": "1"}, id="eager_fill_first"),
    pytest.param({"MOK_EAGER_SPECULATIVE": "1"}, id="eager_speculative"),
    pytest.param({"MOK_COMBINE_STREAM_OWN": "0"}, id="combine_own_rows_direct"),
    pytest.param({"MOK_DISPATCH_RELEASE_AT_END": "0"}, id="dispatch_release_per_task"),
    pytest.param({"MOK_DISPATCH_CE_STAGE": "0"}, id="dispatch_sm_staging"),
    pytest.param({"MOK_COMBINE_TOKEN_RUNS": "0"}, id="combine_strided_tokens"),
    pytest.param({"MOK_DISPATCH_TASK_RUNS": "0"}, id="dispatch_strided_tasks"),
    pytest.param({"MOK_DISPATCH_CE_OVERLAP": "1"}, id="dispatch_ce_copy_beside_layout"),
    pytest.param({"MOK_COMBINE_RELEASE_AT_END": "0"}, id="combine_release_per_token"),
    pytest.param({"MOK_COMBINE_OWN_STAGED": "0"}, id="combine_own_rows_in_consume"),
    pytest.param({"MOK_COMBINE_OWN_STAGED": "0", "MOK_COMBINE_RELEASE_AT_END": "0"},
                 id="combine_own_rows_in_consume_release_per_token"),
    pytest.param({"MOK_COMBINE_PRODUCE_RUNS": "0"}, id="combine_strided_produce"),
    # The layout's publish, count and scan as three kernels: the default fuses them into one
    # launch for layouts of at most 8192 groups, i.e. for every other entry of this list.
    pytest.param({"MOK_LAYOUT_FUSED": "0"}, id="layout_three_kernels"),
    # A separate SM budget for small calls, decided by each rank from its own token count: with
    # these thresholds some ranks launch 8 blocks while their peers launch num_sms (the
    # contract cases have 1-16 tokens per rank; the ring-wrap calls 0-300).
    pytest.param({"MOK_SMALL_CALL_SMS": "8", "MOK_SMALL_CALL_TOKENS": "8"}, id="small_call_sms_mixed_ranks"),
    pytest.param({"MOK_SMALL_CALL_SMS": "8", "MOK_SMALL_CALL_TOKENS": "150"}, id="small_call_sms_mixed_calls"),
    # Plain kernel launches instead of programmatic dependent launch (on by default where ranks
    # do not share a GPU, NOTES #48), and small calls on num_sms instead of their own 64-SM
    # budget (the default for Buffers given no num_sms, NOTES #49). Both are already the
    # defaults of loopback groups, so test_cuda_loopback.py leaves them out.
    pytest.param({"MOK_PDL": "0"}, id="plain_launches"),
    pytest.param({"MOK_SMALL_CALL_SMS": "0"}, id="small_calls_on_num_sms"),
    # 7-token chunks of 32-wide bf16 rows are 448 bytes in 512-byte ring slots: the copy engine
    # copies them with a pitch, then the partial last chunk.
    pytest.param({"MOK_CHUNK_TOKENS": "7"}, id="chunk7_padded_slots"),
]


def _with_env(env, fn, rank, world_size, *args):
    os.environ.update(env)
    try:
        return fn(rank, world_size, *args)
    finally:
        for k in env:
            os.environ.pop(k, None)


def _schedule_vs_reference(rank, world_size, env, name, seed):
    return _with_env(env, _backend_vs_reference, rank, world_size, name, seed)


def _schedule_ring_wrap(rank, world_size, env, calls):
    return _with_env(env, _ring_wrap, rank, world_size, calls)


@pytest.mark.parametrize("world_size", GPU_WORLD_SIZES)
@pytest.mark.parametrize("env", ALT_SCHEDULES)
@pytest.mark.parametrize("name", ("random", "mixed", "dsv3_like", "t0_everywhere"))
def test_cuda_alternative_schedules_match_reference(name, env, world_size):
    run_distributed(_schedule_vs_reference, world_size, env, name, 77, backend="nccl", timeout=300)


@pytest.mark.parametrize("world_size", GPU_WORLD_SIZES)
@pytest.mark.parametrize("env", ALT_SCHEDULES)
def test_cuda_alternative_schedules_wrap_the_ring(env, world_size):
    rows, ring = run_distributed(_schedule_ring_wrap, world_size, env, 200, backend="nccl", timeout=600)[0]
    assert rows * 256 * 2 > 4 * ring, "the ring did not wrap"


def _staging_settings_disagree(rank, world_size):
    """Rank 1 turns copy-engine staging off, the others keep it: the Buffer must refuse on
    every rank (peers would read tokens from other slots than the ones staged), not hang;
    every rank with the same words, before any workspace (NOTES item 65)."""
    env = {"MOK_DISPATCH_CE_STAGE": "0"} if rank == 1 else {}
    dev = rank_device(rank)
    with pytest.raises(ValueError, match="different workspace layouts") as e:
        _with_env(env, lambda r, w: mok_buffer(4 * w, 64, 2, 32, torch.bfloat16, "cuda", dev), rank, world_size)
    return str(e.value)


@pytest.mark.parametrize("world_size", GPU_WORLD_SIZES)
def test_cuda_ranks_with_different_staging_settings_are_refused(world_size):
    out = run_distributed(_staging_settings_disagree, world_size, backend="nccl", timeout=120)
    assert len(set(out)) == 1, out
    assert "copy-engine staging (MOK_DISPATCH_CE_STAGE): used on rank" in out[0], out


def _static_cuda(rank, world_size, name, extra_rows):
    spec = contract_cases(world_size)[name]
    return check_static_case(rank, world_size, spec, 41, extra_rows, backend="cuda",
                             device=rank_device(rank))


@pytest.mark.parametrize("world_size", GPU_WORLD_SIZES)
@pytest.mark.parametrize("name,extra_rows", [("random", 5), ("unrouted_slots", 0), ("t0_on_rank0", 3)])
def test_cuda_static_shape(name, extra_rows, world_size):
    run_distributed(_static_cuda, world_size, name, extra_rows, backend="nccl", timeout=300)


def _cached_cuda(rank, world_size, name, static_extra):
    return check_cached_case(rank, world_size, contract_cases(world_size)[name], 61, backend="cuda",
                             device=rank_device(rank), static_extra=static_extra)


@pytest.mark.parametrize("world_size", GPU_WORLD_SIZES)
@pytest.mark.parametrize("name,static_extra", [("random", None), ("mixed", None),
                                                ("t0_on_rank0", None), ("mixed", 3)])
def test_cuda_cached_dispatch(name, static_extra, world_size):
    run_distributed(_cached_cuda, world_size, name, static_extra, backend="nccl", timeout=300)


def _graph(rank, world_size, seed, backward, fixed_rows=None):
    """Capture dispatch -> expert -> combine (and optionally the backward) of static-shape
    mode in one CUDA graph; replay it on new inputs copied into the static tensors.
    ``fixed_rows``: the dispatch passes ``rows_per_expert`` (N = every row a local expert
    could get), with max_recv_tokens 3 rows past E_local * N (``"static"``) or on an eager
    Buffer, whose dispatch then reads nothing while captured (``"eager"``); ``"budget"``: the
    dispatch passes ``recv_budget`` = 7/8 T x K rows (under a rank's mean with every slot routed,
    over it with a quarter unrouted ("mixed"): some replays drop rows, some do not) on an eager Buffer, and the over-budget flag and the rows received are
    compared too. Returns True, or with a budget the replays that dropped rows on this rank."""
    dev = rank_device(rank)
    E, H, K, T, dtype = 4 * world_size, 128, 4, 64, torch.bfloat16
    M = T * K * world_size                                    # never overflows
    n = budget = None
    if fixed_rows == "budget":
        M, budget = None, T * K * 7 // 8
    elif fixed_rows:
        n = T * K * world_size
        M = 4 * n + 3 if fixed_rows == "static" else None
    buf = mok_buffer(E, H, K, T, dtype, "cuda", dev, max_recv_tokens=M, timeout_s=30)
    ref = mok_buffer(E, H, K, T, dtype, "reference", dev, max_recv_tokens=M)
    x_s = torch.zeros(T, H, dtype=dtype, device=dev, requires_grad=backward)
    w_s = torch.zeros(T, K, dtype=torch.float32, device=dev, requires_grad=backward)
    idx_s = torch.zeros(T, K, dtype=torch.int64, device=dev)
    gy_s = torch.zeros(T, H, dtype=torch.float32, device=dev)

    def load(it):
        x, idx, w = make_inputs(seed + it, world_size, [T] * world_size, E, H, K, dtype,
                                case=("random", "mixed", "duplicate")[it % 3], device=dev)[rank]
        with torch.no_grad():
            x_s.copy_(x)
            w_s.copy_(w)
            idx_s.copy_(idx)
            gy_s.copy_(torch.randn(T, H, generator=torch.Generator().manual_seed(seed * 3 + it)).to(dev))
        return x, idx, w

    def expert(tokens, probs):
        return (tokens.float() * probs[:, None] * 1.5).to(dtype)

    def step(b, x, idx, w):
        res = b.dispatch(x, idx, w, rows_per_expert=n, recv_budget=budget)
        y = b.combine(expert(res.tokens, res.probs), res.handle)
        outs = [res.tokens, res.probs, res.src_rank, res.src_token, res.tokens_per_expert, y]
        if backward:
            outs += list(torch.autograd.grad((y.float() * gy_s).sum(), (x, w)))
        if budget is not None:
            outs += [res.handle.over_budget, res.handle.rows_received]
        return [o.detach() for o in outs]

    load(0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step(buf, x_s, idx_s, w_s)
    torch.cuda.current_stream().wait_stream(side)
    sync_device()
    graph = torch.cuda.CUDAGraph()

    def capture():
        with torch.cuda.graph(graph):
            return step(buf, x_s, idx_s, w_s)

    outs_g = capture_in_turn(rank, world_size, capture)
    names = ["tokens", "probs", "src_rank", "src_token", "tokens_per_expert", "y"]
    names += ["grad_x", "grad_w"] if backward else []
    names += ["over_budget", "rows_received"] if budget is not None else []
    dropped = 0
    for it in range(1, 7):
        x, idx, w = load(it)
        graph.replay()
        sync_device()
        buf.check_errors()
        if backward and in_loopback():     # the reference's backward must not use autograd there
            r = backward_by_hand(ref, x, idx, w, lambda res, t, p: expert(t, p), gy_s, n)
            want = [r[k] for k in ("tokens", "probs", "src_rank", "src_token", "tokens_per_expert",
                                   "y", "grad_x", "grad_topk_weights")]
        else:
            want = step(ref, x.clone().requires_grad_(backward), idx, w.clone().requires_grad_(backward))
        assert len(outs_g) == len(want) == len(names)
        for nm, a, b in zip(names, outs_g, want):
            assert_bitwise(a, b, f"graph replay {it} {nm} rank {rank}")
        if budget is not None:
            dropped += int(outs_g[-2].item())
    buf.destroy()
    ref.destroy()
    return dropped if budget is not None else True


@pytest.mark.parametrize("world_size", GPU_WORLD_SIZES)
def test_cuda_graph_static_shape_forward(world_size):
    run_distributed(_graph, world_size, 5, False, backend="nccl", timeout=300, fresh=True)


@pytest.mark.parametrize("world_size", GPU_WORLD_SIZES)
def test_cuda_graph_static_shape_forward_backward(world_size):
    run_distributed(_graph, world_size, 6, True, backend="nccl", timeout=300, fresh=True)


@pytest.mark.parametrize("world_size", [pytest.param(1, marks=pytest.mark.gpu)] + GPU_WORLD_SIZES)
@pytest.mark.parametrize("mode", ("static", "eager"))
def test_cuda_graph_rows_per_expert(world_size, mode):
    run_distributed(_graph, world_size, 8, True, mode, backend="nccl", timeout=300, fresh=True)


@pytest.mark.parametrize("world_size", [pytest.param(1, marks=pytest.mark.gpu)] + GPU_WORLD_SIZES)
def test_cuda_graph_receive_budget(world_size):
    """A dispatch with ``recv_budget`` on an eager Buffer reads nothing on the host: captured
    with its combine and backward, replayed on new routings, bitwise the reference's, the
    over-budget flag included; some replays dropped rows, some did not."""
    dropped = run_distributed(_graph, world_size, 9, True, "budget", backend="nccl", timeout=300,
                              fresh=True)
    assert 0 < sum(dropped) < 6 * world_size, f"replays over budget per rank: {dropped}"


def _missing_peer(rank, world_size, timeout_s):
    """The last rank never calls dispatch: the others must raise a timeout error in about
    ``timeout_s``, not hang."""
    dev = rank_device(rank)
    buf = mok_buffer(2 * world_size, 64, 2, 32, torch.bfloat16, "cuda", dev, timeout_s=timeout_s)
    x, idx, w = make_inputs(1, world_size, [32] * world_size, 2 * world_size, 64, 2, torch.bfloat16,
                            device=dev)[rank]
    if in_loopback():                       # the "wait until the others are done" of each side
        wait_for_others = done = loopback_barrier
    else:
        store = dist.distributed_c10d._get_default_store()
        def wait_for_others():
            store.wait([f"mok_missing_peer_done_{r}" for r in range(world_size - 1)])
        def done():
            store.set(f"mok_missing_peer_done_{rank}", "1")
    if rank == world_size - 1:
        wait_for_others()
        return None
    t0 = time.monotonic()
    try:
        with pytest.raises(RuntimeError, match=r"(?i)time(d)?[ _]?out") as info:
            buf.dispatch(x, idx, w)
            buf.check_errors()
        return time.monotonic() - t0, str(info.value)
    finally:
        done()


def _lagging_reader(rank, world_size, timeout_s, lag_s):
    """The memory-model review's B1 (NOTES item 37), world size 2: rank 1's host stalls
    ``lag_s`` between its first call's layout and its transfer launch (its staged rows not yet
    published); rank 0's first transfer times out waiting for them, and in rank 0's second call
    the copy-engine staging, queued behind a slot check that gives up after the abort, overwrites
    the ring slot rank 1 has not read yet. Returns what each rank saw: rank 1 the source of the
    rows it received from rank 0 (its call 1 rows, its call 2 rows, or neither) and its error,
    rank 0 its error."""
    import megatron_mok.cuda.bindings as bindings
    dev = rank_device(rank)
    E, H, K, T = 2 * world_size, 64, 2, 64          # one 64-token chunk per rank and call
    buf = mok_buffer(E, H, K, T, torch.bfloat16, "cuda", dev, timeout_s=timeout_s)
    be = buf._get_backend("cuda")
    calls = [make_inputs(seed, world_size, [T] * world_size, E, H, K, torch.bfloat16, device=dev)
             for seed in (11, 12)]
    if not be.ce_stage:
        return {"skipped": "no copy-engine staging on this Buffer"}
    if rank == 0:
        buf.dispatch(*calls[0][0])                 # its transfer times out in the background
        try:
            buf.dispatch(*calls[1][0])
            buf.check_errors()
            return {"error": None}
        except RuntimeError as e:
            return {"error": str(e)[:1500]}
    def stall_before(launch, steps_at):
        def stalled(*args, **kwargs):
            if args[steps_at] & bindings.STEP_TRANSFER and not stalled.done:
                stalled.done = True
                time.sleep(lag_s)                   # the host stall: its rows are not published
            return launch(*args, **kwargs)
        stalled.done = False
        return stalled
    if be.host_ops is not None:
        # The eager call's fill and transfer go through the C++ host ops (NOTES item 76): stall
        # there (dispatch_rows(fn, ctx, stream, steps, ...)).
        ops = be.host_ops
        be.host_ops = SimpleNamespace(dispatch_layout=ops.dispatch_layout, combine=ops.combine,
                                      dispatch_rows=stall_before(ops.dispatch_rows, 3))
    else:
        be._launch = stall_before(be._launch, 0)
    try:
        res = buf.dispatch(*calls[0][1])
        sync_device()
        from_0 = (res.src_rank == 0).nonzero().flatten()
        got = res.tokens[from_0]
        src = res.src_token[from_0].long()
        seen = ("call 1" if torch.equal(got, calls[0][0][0][src]) else
                "call 2" if torch.equal(got, calls[1][0][0][src]) else "neither")
    except RuntimeError as e:
        return {"rows_from_0": None, "error": str(e)[:1500]}
    try:
        buf.check_errors()
        err = None
    except RuntimeError as e:
        err = str(e)[:1500]
    return {"rows_from_0": seen, "n_rows_from_0": int(from_0.numel()), "error": err}


def _reader_past_its_wait(rank, world_size, timeout_s, tokens, reader_sms):
    """NOTES item 41, world size 2: rank 0's ``tokens`` tokens all go to rank 1's experts (8 rows
    each), rank 1's one token to rank 0's. Rank 1 (static shape, ``reader_sms`` SMs, so its pull
    is long) waits for its chunks at the start, then reads them for tens of milliseconds: with one
    SM its 32 warps each take a run of ``tokens / 32`` consecutive tokens, one chunk when the test
    sets MOK_CHUNK_TOKENS to that (1024 for 32768 tokens), so each warp waits once. Meanwhile
    rank 0 (timeout ``timeout_s``) makes a second call; its layout gives up waiting for rank 1's
    second routing, and its copy-engine staging, queued behind a slot check that finds the rank
    aborted, overwrites the chunk rank 1 is still reading. Every wait of rank 1 ended before the
    poison, so only the re-read before its release can tell. Returns rank 1's rows' source
    (call 1, call 2, neither), its error and its call's time; rank 0's error."""
    from megatron_mok import loopback
    dev = rank_device(rank)
    E, H, K = 16, 7168, 8
    ring = 2 * tokens * H * 2 + (8 << 20)               # each ring holds a call (copy-engine staging)
    g = torch.Generator(device=dev).manual_seed(41)
    # Rank 0's two calls (every rank makes them, to compare): all tokens to experts 8..15.
    calls = [torch.randn(tokens, H, generator=g, device=dev).to(torch.bfloat16) for _ in range(2)]
    hub = loopback.current()
    if rank == 0:
        buf = mok_buffer(E, H, K, tokens, torch.bfloat16, "cuda", dev, timeout_s=timeout_s,
                         max_recv_tokens=K, ring_bytes=ring)
        if not buf._get_backend("cuda").ce_stage:
            return {"skipped": "no copy-engine staging on this Buffer"}
        idx = torch.arange(8, 16, device=dev).repeat(tokens, 1)
        w = torch.rand(tokens, K, generator=g, device=dev)
        hub.barrier()                              # rank 1's call is queued (static: no host sync)
        buf.dispatch(calls[0], idx, w)
        buf.dispatch(calls[1], idx, w)             # its layout times out: rank 1 never calls again
        try:
            buf.check_errors()
            out = {"error": None}
        except RuntimeError as e:
            out = {"error": str(e)[:1500]}
        hub.barrier()                              # keep this workspace until rank 1 is done with it
        return out
    buf = mok_buffer(E, H, K, tokens, torch.bfloat16, "cuda", dev, num_sms=reader_sms,
                     max_recv_tokens=tokens * K, ring_bytes=ring)
    if not buf._get_backend("cuda").ce_stage:
        return {"skipped": "no copy-engine staging on this Buffer"}
    x = torch.randn(1, H, generator=g, device=dev).to(torch.bfloat16)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    res = buf.dispatch(x, torch.arange(0, 8, device=dev).view(1, K), torch.rand(1, K, generator=g, device=dev))
    end.record()
    hub.barrier()
    sync_device()
    from_0 = (res.src_rank == 0).nonzero().flatten()
    got = res.tokens[from_0]
    src = res.src_token[from_0].long()
    seen = ("call 1" if torch.equal(got, calls[0][src]) else
            "call 2" if torch.equal(got, calls[1][src]) else "neither")
    try:
        buf.check_errors()
        err = None
    except RuntimeError as e:
        err = str(e)[:1500]
    out = {"rows_from_0": seen, "n_rows_from_0": int(from_0.numel()), "error": err,
           "call_ms": start.elapsed_time(end)}
    hub.barrier()
    return out


def _peer_mapping(rank, world_size):
    """How this rank's Buffer mapped its peers: (IPC reason or None, pointers, own pointer)."""
    buf = mok_buffer(2 * world_size, 64, 2, 32, torch.bfloat16, "cuda", rank_device(rank))
    mem = buf._get_backend("cuda").mem
    out = (mem.ipc_reason, list(mem.peer_ptrs), mem.tensor.data_ptr())
    buf.destroy()
    return out


@pytest.mark.parametrize("world_size", GPU_WORLD_SIZES)
def test_cuda_peer_mapping(world_size):
    """A GPU per rank: symmetric memory. Ranks as processes sharing a GPU (shared-GPU mode):
    CUDA IPC, which symmetric memory refuses. Either way every rank holds W distinct peer
    pointers, its own being its workspace."""
    shared = torch.cuda.device_count() < world_size
    for rank, (reason, ptrs, own) in enumerate(run_distributed(_peer_mapping, world_size, backend="nccl")):
        assert (reason is not None) == shared, (rank, reason)
        assert len(ptrs) == world_size and len(set(ptrs)) == world_size and ptrs[rank] == own


def _memory_after_buffers(rank, world_size, cycles):
    """This process's allocated bytes and the GPU's free bytes before and after ``cycles``
    Buffers, each used for one dispatch + combine and destroyed; measured once every rank has
    destroyed its Buffer (so peers have let go of its workspace) and collected IPC blocks."""
    import gc

    dev = rank_device(rank)

    def settled():
        torch.cuda.synchronize(dev)
        dist.barrier()
        torch.cuda.ipc_collect()
        torch.cuda.synchronize(dev)
        dist.barrier()
        return torch.cuda.memory_allocated(dev), torch.cuda.mem_get_info(dev)[0]

    def one(i):
        buf = mok_buffer(2 * world_size, 64, 2, 32, torch.bfloat16, "cuda", dev)
        x, idx, w = make_inputs(i, world_size, [32] * world_size, 2 * world_size, 64, 2, torch.bfloat16,
                                device=dev)[rank]
        res = buf.dispatch(x, idx, w)
        buf.combine(res.tokens, res.handle)
        nbytes = buf._get_backend("cuda").mem.tensor.numel()
        del res, x, idx, w
        buf.destroy()
        gc.collect()
        return nbytes

    nbytes = one(0)                 # the allocator's first blocks, kept cached afterwards
    before = settled()
    for i in range(cycles):
        one(i + 1)
    return nbytes, before, settled()


@pytest.mark.parametrize("world_size", GPU_WORLD_SIZES)
def test_cuda_ipc_workspaces_return_to_the_gpu(world_size):
    """Shared-GPU mode: a destroyed Buffer's IPC-shared workspace goes back to its owner's
    allocator and its peers' mappings close, at every world size (run s19-6: at W = 4 one share
    opened by three peers was never taken back, ~516 MiB per Buffer per rank)."""
    if torch.cuda.device_count() >= world_size:
        pytest.skip("a GPU per rank: workspaces are torch symmetric memory, whose lifetime is torch's")
    for rank, (nbytes, (alloc0, free0), (alloc1, free1)) in enumerate(
            run_distributed(_memory_after_buffers, world_size, 4, backend="nccl")):
        assert alloc1 <= alloc0, f"rank {rank}: {alloc1 - alloc0} bytes still allocated after 4 Buffers"
        assert free1 >= free0 - nbytes, (f"rank {rank}: the GPU lost {free0 - free1} free bytes over "
                                         f"4 Buffers of {nbytes}-byte workspaces")


@pytest.mark.parametrize("world_size", GPU_WORLD_SIZES)
def test_cuda_missing_peer_times_out(world_size):
    timeout_s = 2
    out = run_distributed(_missing_peer, world_size, timeout_s, backend="nccl", timeout=120, fresh=True)
    for took, msg in out[:-1]:
        assert took < timeout_s + 20, f"the timeout error came after {took:.1f} s: {msg}"
        assert "rank" in msg and "peer" in msg, f"the error should name rank and peer: {msg}"


def _small_cuda_case(rank, world_size, seed):
    """A small CUDA Buffer (2 experts per rank, H=64, K=2, 16 tokens, 10 s timeout) and this
    rank's inputs, for the error tests; also returns E."""
    dev = rank_device(rank)
    E = 2 * world_size
    buf = mok_buffer(E, 64, 2, 16, torch.bfloat16, "cuda", dev, timeout_s=10)
    x, idx, w = make_inputs(seed, world_size, [16] * world_size, E, 64, 2, torch.bfloat16, device=dev)[rank]
    return buf, x, idx, w, E


def _dispatch_raises(buf, x, idx, w, exc, match):
    """The dispatch, or the error check after it, raises ``exc`` matching ``match``."""
    with pytest.raises(exc, match=match):
        buf.dispatch(x, idx, w)
        buf.check_errors()
    return True


def _bad_expert_id_cuda(rank, world_size):
    buf, x, idx, w, E = _small_cuda_case(rank, world_size, 2)
    idx = idx.clone()
    idx[3, 1] = E                                             # one bad id on every rank
    return _dispatch_raises(buf, x, idx, w, (ValueError, RuntimeError), r"(?i)expert id|outside")


@pytest.mark.parametrize("world_size", GPU_WORLD_SIZES)
def test_cuda_bad_expert_id_is_an_error(world_size):
    run_distributed(_bad_expert_id_cuda, world_size, backend="nccl", timeout=120, fresh=True)


def _error_on_rank0_only(rank, world_size, seed, match, rank0, peer_kw):
    """A data error on one rank is that rank's error: it raises, and its peers' dispatch
    completes (its transfer still runs, so they do not wait for its tokens until their timeout).
    ``rank0(idx, E) -> (idx, dispatch kwargs)`` makes rank 0's error; the peers dispatch with
    ``peer_kw`` and make no combine (rank 0 raised at its dispatch and makes none). Returns the
    seconds this rank took."""
    buf, x, idx, w, E = _small_cuda_case(rank, world_size, seed)
    t0 = time.monotonic()
    if rank == 0:
        idx, kw = rank0(idx, E)
        with pytest.raises(RuntimeError, match=match):
            buf.dispatch(x, idx, w, **kw)
    else:
        buf.dispatch(x, idx, w, **peer_kw)
        buf.check_errors()
    return time.monotonic() - t0


def _bad_id_at_slot_5_0(idx, E):
    idx = idx.clone()
    idx[5, 0] = E
    return idx, {}


def _bad_expert_id_on_rank0_only(rank, world_size):
    """A bad id on one rank is that rank's error (_error_on_rank0_only)."""
    return _error_on_rank0_only(rank, world_size, 4, r"(?i)expert id", _bad_id_at_slot_5_0, {})


@pytest.mark.parametrize("world_size", GPU_WORLD_SIZES)
def test_cuda_bad_expert_id_on_one_rank_does_not_stall_its_peers(world_size):
    took = run_distributed(_bad_expert_id_on_rank0_only, world_size, backend="nccl", timeout=120, fresh=True)
    assert max(took) < 8, f"a rank waited {max(took):.1f} s (its peer's transfer never ran?)"


def _split_vs_reference(rank, world_size, env):
    """Calls with fewer tokens than combine warps at H = 1288 (S = 3 steps of 512, the last one
    partial) on 4 SMs: each token's steps are dealt to P warps (P = 3 at 20 tokens, P = 2 at
    25, which does not divide S), forward and backward (prob gradients included), token-dtype
    and fp32 partials, against the reference bitwise. The dispatch splits too (NOTES #47):
    its 128 pulling warps deal each task's 161 vectors in slices of 32-vector steps to
    min(6, 128 // virtual tasks) warps: 6 slices at 1 and 7 tokens, 2 at 20 tokens (W=3), 4
    at 28 tokens (W=1: the 4th slice is empty), none at 40."""
    return _with_env(env, _split_calls, rank, world_size)


def _split_calls(rank, world_size):
    dev = rank_device(rank)
    H, K, E, dtype = 1288, 4, 4 * world_size, torch.bfloat16
    calls = [(20, "random"), (25, "duplicate"), (1, "random"), (7, "unrouted"), (0, "random"), (40, "skewed"),
             (28, "random")]
    for partial in (None, torch.float32):
        kw = {} if partial is None else {"combine_partial_dtype": partial}
        buf = mok_buffer(E, H, K, 64, dtype, "cuda", dev, num_sms=4, timeout_s=30, **kw)
        ref = mok_buffer(E, H, K, 64, dtype, "reference", dev, **kw)
        for i, (t, case) in enumerate(calls):
            T_all = [max(0, t - r) for r in range(world_size)]
            inputs = make_inputs(900 + i, world_size, T_all, E, H, K, dtype, case=case, device=dev)
            assert_same_results(full_pass(buf, *inputs[rank], i), full_pass(ref, *inputs[rank], i),
                                f"split call {i} T={T_all} partial={partial} rank {rank}")
        buf.check_errors()
        buf.destroy()
        ref.destroy()
    return True


def _streamed_produce_calls(rank, world_size, backend="cuda", num_sms=2):
    """Calls with MORE remote tasks than combine warps (num_sms=2: 32 warps), so the phased
    produce phase reduces every warp's tasks through the shared-memory row stream (NOTES #26)
    rather than splitting them: H = 1288 (3 pieces per task, the last one partial, so dead
    groups are zero-filled), tasks with 0..K rows, K = 16 with duplicates (tasks with more rows
    than the ring streams, summed from global memory in the same loop), a rank with no tokens,
    token-dtype and fp32 partials; forward and backward against the reference, bitwise. A rank
    with more tokens than warps also stages its own partials in the produce phase (NOTES #38),
    so the same calls cover the consume loop that only sums partials (prob gradients too)."""
    dev = rank_device(rank)
    warps = num_sms * 16                        # kCombineThreads / 32 warps per block
    H, dtype = 1288, torch.bfloat16
    calls = [(4, 300, "random"), (4, 257, "unrouted"), (4, 301, "skewed"), (4, 263, "one_expert"),
             (16, 150, "duplicate"), (4, 0, "random")]
    for partial in (None, torch.float32):
        kw = {} if partial is None else {"combine_partial_dtype": partial}
        for i, (K, t, case) in enumerate(calls):
            E = 4 * world_size if K == 4 else 16 * world_size
            # Rank 1 has no tokens in the first call (its peers' tasks still flow to it).
            T_all = [0 if (i == 0 and r == 1) else max(0, t - 7 * r) for r in range(world_size)]
            buf = mok_buffer(E, H, K, 320, dtype, backend, dev, num_sms=num_sms, timeout_s=30, **kw)
            ref = mok_buffer(E, H, K, 320, dtype, "reference", dev, **kw)
            inputs = make_inputs(700 + i, world_size, T_all, E, H, K, dtype, case=case, device=dev)
            # Remote tasks (a peer's token with rows here) and rows per task of every rank, so
            # the test states the paths it covers: more tasks than warps on some rank is the
            # streamed produce phase; more than 8 rows in a task (K = 16) its global-memory sums.
            E_local = E // world_size
            hits = [[((inputs[s][1] >= d * E_local) & (inputs[s][1] < (d + 1) * E_local)).sum(dim=1)
                     for s in range(world_size)] for d in range(world_size)]
            tasks = [sum(int((hits[d][s] > 0).sum()) for s in range(world_size) if s != d) for d in range(world_size)]
            if t > 0:
                assert max(tasks) > warps, f"call {i}: remote tasks per rank {tasks}, not more than {warps} warps"
                # At least one token per warp on a rank: its own partials are staged by the
                # produce phase and its consumers only sum partials (NOTES #38, on by default).
                assert max(T_all) > warps, f"call {i}: tokens {T_all}, no rank with more than {warps}"
            if K == 16:
                assert max(int(h.max()) for d in range(world_size) for s, h in enumerate(hits[d])
                           if s != d and h.numel()) > 8, f"call {i}: no task with more than 8 rows"
            assert_same_results(full_pass(buf, *inputs[rank], i), full_pass(ref, *inputs[rank], i),
                                f"streamed produce call {i} K={K} T={T_all} partial={partial} rank {rank}")
            check_and_destroy(buf, ref)
    return True


def _scan_tiles_calls(rank, world_size, backend="cuda"):
    """Layouts with more (expert, source, chunk) groups than one tile of the layout scan
    (the scan kernel's 1024 threads x 4 = 4096 entries; the fused layout's 256 x 8 = 2048):
    65 local experts x W sources x enough 64-token chunks (4225 groups at W=1, 4290 at W=2,
    4485 at W=3), so the scan carries a prefix into a partial last tile (2 tiles of the scan
    kernel, 3 of the fused layout; few chunks, so that loopback worlds of 3-4 ranks still fit
    their routing kernels on one GPU); tokens per rank not multiples of anything, one rank
    nearly empty, skewed and unrouted routing; forward and backward against the reference,
    bitwise. The fused layout is the default at this size (<= 8192 groups);
    ``LAYOUT_PATHS`` runs the three-kernel layout too."""
    dev = rank_device(rank)
    H, K, dtype, E_local = 16, 5, torch.bfloat16, 65
    cpc = -(-4100 // (E_local * world_size)) + 1
    T_max, E = 64 * cpc, E_local * world_size
    groups = E_local * world_size * cpc
    assert groups > 4096 and groups % 4096, groups
    buf = mok_buffer(E, H, K, T_max, dtype, backend, dev, timeout_s=30)
    ref = mok_buffer(E, H, K, T_max, dtype, "reference", dev)
    for i, (T_all, case) in enumerate([([T_max - 1] + [T_max - 67] * (world_size - 1), "random"),
                                       ([1] + [T_max] * (world_size - 1), "skewed"),
                                       ([T_max - 13 * r - 5 for r in range(world_size)], "unrouted")]):
        inputs = make_inputs(600 + i, world_size, T_all, E, H, K, dtype, case=case, device=dev)
        assert_same_results(full_pass(buf, *inputs[rank], i), full_pass(ref, *inputs[rank], i),
                            f"scan tiles call {i} T={T_all} rank {rank}")
    check_and_destroy(buf, ref)
    return True


def _fill_passes_chunk_env(rank, world_size, K, chunk_tokens):
    """``_fill_passes_calls`` in a process with MOK_CHUNK_TOKENS set to ``chunk_tokens``."""
    env = {"MOK_CHUNK_TOKENS": chunk_tokens} if chunk_tokens is not None else {}
    return _with_env(env, _fill_passes_calls, rank, world_size, K, chunk_tokens)


# Threads of a fill block (csrc/include/mok/config.h kFillThreads): a chunk with more
# (token, k) slots than this takes several passes of the fill's row and task phases.
FILL_THREADS = 512
# (top-k, MOK_CHUNK_TOKENS) whose full chunks need several fill passes: 64 x 16 = 1024 and
# 64 x 32 = 2048 slots (2 and 4 passes of each phase), 100 x 8 = 800 slots (2 of each).
FILL_PASS_CONFIGS = [(16, None), (32, None), (8, "100")]


def _fill_passes_calls(rank, world_size, K, chunk_tokens, backend="cuda"):
    """Chunks with more (token, k) slots than a fill block has threads, so the fill hands out
    rows and writes tasks in several passes (the running row of each expert and the task
    number carried between them): full and partial chunks, tokens per rank not multiples of
    anything, a token's slots on one expert, skewed, unrouted and all-to-one routing, one
    rank nearly empty; forward and backward against the reference, bitwise. The caller sets
    MOK_CHUNK_TOKENS to ``chunk_tokens`` (None: the default, 64)."""
    C = int(chunk_tokens or 64)
    assert C * K > FILL_THREADS and (FILL_THREADS // K) < C, (C, K)
    dev = rank_device(rank)
    H, dtype, E_local, T_max = 16, torch.bfloat16, 40, 3 * C + 17
    E = E_local * world_size
    buf = mok_buffer(E, H, K, T_max, dtype, backend, dev, timeout_s=30)
    ref = mok_buffer(E, H, K, T_max, dtype, "reference", dev)
    calls = [([T_max] + [T_max - 29] * (world_size - 1), "duplicate"),
             ([1] + [2 * C + 5] * (world_size - 1), "skewed"),
             ([T_max - 11 * r - 3 for r in range(world_size)], "unrouted"),
             ([C + 1 + r for r in range(world_size)], "one_expert")]
    for i, (T_all, case) in enumerate(calls):
        assert max(T_all) >= C, T_all  # at least one full chunk somewhere
        inputs = make_inputs(700 + i, world_size, T_all, E, H, K, dtype, case=case, device=dev)
        assert_same_results(full_pass(buf, *inputs[rank], i), full_pass(ref, *inputs[rank], i),
                            f"fill passes call {i} K={K} C={C} T={T_all} {case} rank {rank}")
    check_and_destroy(buf, ref)
    return True




def _scan_tiles_env(rank, world_size, env):
    return _with_env(env, _scan_tiles_calls, rank, world_size)


@pytest.mark.parametrize("world_size", GPU_WORLD_SIZES)
@pytest.mark.parametrize("env", LAYOUT_PATHS)
def test_cuda_layout_scan_over_tiles_matches_reference(env, world_size):
    run_distributed(_scan_tiles_env, world_size, env, backend="nccl", timeout=300)


def _layout_paths_differ(rank, world_size, name):
    """Rank 1 runs the three-kernel layout, the others the fused one: both publish, wait and
    release the same flags, so a mix must give the same bits (README: ranks may differ)."""
    env = {"MOK_LAYOUT_FUSED": "0"} if rank == 1 else {}
    return _with_env(env, _backend_vs_reference, rank, world_size, name, 91)


@pytest.mark.parametrize("world_size", GPU_WORLD_SIZES)
@pytest.mark.parametrize("name", ("mixed", "t0_on_rank0"))
def test_cuda_ranks_with_different_layout_paths_match_reference(name, world_size):
    run_distributed(_layout_paths_differ, world_size, name, backend="nccl", timeout=300)


@pytest.mark.parametrize("world_size", GPU_WORLD_SIZES)
@pytest.mark.parametrize("K,chunk_tokens", FILL_PASS_CONFIGS)
def test_cuda_layout_fill_in_passes_matches_reference(K, chunk_tokens, world_size):
    run_distributed(_fill_passes_chunk_env, world_size, K, chunk_tokens, backend="nccl", timeout=300)


@pytest.mark.parametrize("world_size", GPU_WORLD_SIZES)
def test_cuda_streamed_produce_matches_reference(world_size):
    run_distributed(_streamed_produce_calls, world_size, backend="nccl", timeout=300)


# The small-call splits: the phased combine, the role-split combine, and the dispatch with
# one warp per task (MOK_DISPATCH_SPLIT=0; the other two split the dispatch's tasks).
SPLIT_SCHEDULES = [pytest.param({}, id="phased"), pytest.param({"MOK_COMBINE_PHASED": "0"}, id="role_split"),
                   pytest.param({"MOK_DISPATCH_SPLIT": "0"}, id="dispatch_unsplit")]


@pytest.mark.parametrize("world_size", GPU_WORLD_SIZES)
@pytest.mark.parametrize("env", SPLIT_SCHEDULES)
def test_cuda_combine_split_over_warps_matches_reference(env, world_size):
    run_distributed(_split_vs_reference, world_size, env, backend="nccl", timeout=300)


def _speculative_mismatch(rank, world_size):
    """Only rank 0 speculative (as if only it had set MOK_EAGER_SPECULATIVE=1): it would make
    two transfers where its peers make one, so every rank must stop with an error naming the
    setting, not pair one rank's transfer with another call's tokens."""
    buf, x, idx, w, _ = _small_cuda_case(rank, world_size, 3)
    backend = buf._get_backend("cuda")
    backend.speculative = backend.fill_first = rank == 0
    return _dispatch_raises(buf, x, idx, w, RuntimeError, "disagree on the speculative eager dispatch")


@pytest.mark.parametrize("world_size", GPU_WORLD_SIZES)
def test_cuda_speculative_on_some_ranks_only_is_an_error(world_size):
    run_distributed(_speculative_mismatch, world_size, backend="nccl", timeout=120, fresh=True)


def _overflow_cuda(rank, world_size):
    return _overflow(rank, world_size, backend="cuda", device=rank_device(rank))


@pytest.mark.parametrize("world_size", GPU_WORLD_SIZES)
def test_cuda_static_overflow_raises(world_size):
    got = run_distributed(_overflow_cuda, world_size, backend="nccl", timeout=120, fresh=True)
    assert got == ["ok"] * (world_size - 1) + ["raised"]


def _static_overflow_counts(rank, world_size, alignment, backend="cuda"):
    """Static shape with more rows than ``max_recv_tokens``: ``M = 5 R / 8`` on each rank (``R``
    this rank's rows, ``expert_alignment``'s zero rows included; at world size 1, inside the
    third expert's rows). The rows written are the first ``M`` in contract order, and what the user
    can read without the error check counts only those: ``tokens_per_expert`` (each expert's
    rows below ``M``; the kernel once reported every received row, their sum past ``M``, so an
    expert that trusted its count read past the rows) and ``num_rows_device`` (``M``). The
    overflow is still raised at the next host read (``check_errors``). The reference backend
    raises at the dispatch itself, its host read (docs/CONTRACT.md, "Static shape"). Returns
    whether this rank overflowed."""
    dev = rank_device(rank)
    spec = dict(T=([40, 33, 47, 21] * 2)[:world_size], T_max=48, E=4 * world_size, H=64, K=4,
                case="random", idx_dtype=torch.int64)
    x, idx, w = spec_inputs(spec, world_size, torch.bfloat16, 91 + alignment, device=dev)[rank]
    kw = dict(device=dev, expert_alignment=alignment, timeout_s=20)
    plain = _buffer(spec, torch.bfloat16, backend, **kw)
    p = plain.dispatch(x, idx, w)
    counts = [int(c) for c in p.tokens_per_expert.tolist()]
    R = sum(counts)
    M = R * 5 // 8
    over = R > M
    cum = [sum(counts[:e]) for e in range(len(counts) + 1)]
    want = [min(cum[e + 1], M) - min(cum[e], M) for e in range(len(counts))]
    static = _buffer(spec, torch.bfloat16, backend, max_recv_tokens=M, **kw)
    message = rf"received {R} rows, more than max_recv_tokens={M}"
    tag = f"[rank {rank} A={alignment} R={R} M={M}]"
    if backend == "reference" and over:
        with pytest.raises(RuntimeError, match=message):
            static.dispatch(x, idx, w)
    else:
        res = static.dispatch(x, idx, w)
        # Host reads of the outputs, not of the error report: the error is still pending.
        got = [int(c) for c in res.tokens_per_expert.tolist()]
        assert got == want, f"tokens_per_expert {got}, want the rows written {want} {tag}"
        assert sum(got) == min(R, M) <= res.tokens.shape[0] == M, tag
        assert int(res.handle.num_rows_device.reshape(-1)[0]) == min(R, M), f"num_rows_device {tag}"
        n = min(R, M)
        for k in ("tokens", "probs", "src_rank", "src_token"):
            assert_bitwise(getattr(res, k)[:n], getattr(p, k)[:n], f"{k}: the first M rows {tag}")
        if over:
            with pytest.raises(RuntimeError, match=message):
                static.check_errors()
        else:
            static.check_errors()
    plain.check_errors()
    for b in (plain, static):
        b.destroy()
    return over


def _tensors_on_another_gpu(rank, world_size):
    """A Buffer's CUDA workspace is on one GPU, and a tensor on another is refused before any
    launch, whichever way the Buffer got its device: ``device="cuda"`` (the current device at
    first use; it once accepted every GPU), ``backend="cuda"`` with no device (the current
    device when made), ``backend="auto"`` with no device (the first tensor's GPU: the workspace
    is made there, also while another device is current). The Buffer stays usable after a
    refusal. One process (world size 1), two GPUs."""
    d0, d1 = torch.device("cuda", 0), torch.device("cuda", 1)
    assert torch.cuda.current_device() == 0
    E, H, K, T = 4, 64, 2, 16
    x, idx, w = make_inputs(3, 1, [T], E, H, K, torch.bfloat16)[0]

    def on(d):
        return x.to(d), idx.to(d), w.to(d)

    def refused(arg, got, want):
        return pytest.raises(ValueError, match=rf"{arg} is on cuda:{got}, but this Buffer works on cuda:{want}")

    ref = mok_buffer(E, H, K, T, torch.bfloat16, "reference", "cpu")
    want = ref.dispatch(*on("cpu"))
    want_y = ref.combine(want.tokens, want.handle)

    def works(buf, d):
        res = buf.dispatch(*on(d))
        assert_bitwise(res.tokens, want.tokens.to(d), f"tokens on {d}")
        assert_bitwise(buf.combine(res.tokens, res.handle), want_y.to(d), f"y on {d}")
        return res

    buf = mok_buffer(E, H, K, T, torch.bfloat16, "auto", "cuda")
    with refused("x", 1, 0):
        buf.dispatch(*on(d1))
    assert buf.device == d0
    res = works(buf, d0)
    with refused("expert_out", 1, 0):
        buf.combine(res.tokens.to(d1), res.handle)
    with refused("x", 1, 0):
        buf.dispatch(x.to(d1), handle=res.handle)
    check_and_destroy(buf)

    buf = mok_buffer(E, H, K, T, torch.bfloat16, "cuda", None)
    assert buf.device == d0 and buf._get_backend("cuda").device == d0
    with refused("x", 1, 0):
        buf.dispatch(*on(d1))
    works(buf, d0)
    check_and_destroy(buf)

    buf = mok_buffer(E, H, K, T, torch.bfloat16, "auto", None)
    with torch.cuda.device(1):
        works(buf, d1)
    assert buf.device == d1 and buf._get_backend("cuda").device == d1
    with refused("x", 0, 1):
        buf.dispatch(*on(d0))
    check_and_destroy(buf)

    buf = mok_buffer(E, H, K, T, torch.bfloat16, "auto", None)
    works(buf, d0)
    with refused("x", 1, 0):
        buf.dispatch(*on(d1))
    check_and_destroy(buf)
    return True


def _fake_tensor_elsewhere(rank, world_size):
    """One GPU: a real CUDA Buffer on cuda:0 given (fake) tensors on cuda:1 refuses them, at the
    Buffer and at its backend's own guard, before anything is allocated or launched, and then
    still works. ``None`` if this torch cannot make fake tensors on cuda:1."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    d0 = torch.device("cuda", 0)
    E, H, K, T = 4, 64, 2, 16
    try:
        with FakeTensorMode():
            fx = torch.empty(T, H, dtype=torch.bfloat16, device="cuda:1")
            fi = torch.zeros(T, K, dtype=torch.int64, device="cuda:1")
            fw = torch.empty(T, K, dtype=torch.float32, device="cuda:1")
    except Exception:  # noqa: BLE001  (no fake device past the visible ones: nothing to test)
        return None
    buf = mok_buffer(E, H, K, T, torch.bfloat16, "cuda", "cuda")
    backend = buf._get_backend("cuda")
    with pytest.raises(ValueError, match=r"x is on cuda:1, but this Buffer works on cuda:0"):
        buf.dispatch(fx, fi, fw)
    with pytest.raises(ValueError, match=r"x is on cuda:1, but this Buffer's CUDA workspace is on cuda:0"):
        backend.dispatch(fx, fi, fw)
    with pytest.raises(ValueError, match=r"expert_out is on cuda:1, but this Buffer's CUDA workspace"):
        backend.combine(fx, None)
    x, idx, w = make_inputs(3, 1, [T], E, H, K, torch.bfloat16, device=d0)[0]
    res = buf.dispatch(x, idx, w)
    buf.combine(res.tokens, res.handle)
    check_and_destroy(buf)
    return True


def _off_by(t, elems):
    """``t``'s values in a contiguous view ``elems`` elements into a larger storage: its data
    pointer ``elems x`` the element size past the allocation's alignment."""
    big = torch.zeros(t.numel() + elems, dtype=t.dtype, device=t.device)
    view = big[elems:].view(t.shape)
    view.copy_(t)
    return view


def _misaligned_rows(rank, world_size, backend="cuda"):
    """Rows at addresses that are not multiples of 16 bytes: ``x`` of a dispatch and of a cached
    dispatch, ``expert_out`` of a combine, and the gradients the backward passes hand to the
    backend (a slice of ``torch.cat``'s gradient). The library's kernels move 16-byte vectors:
    it refused such an ``x`` only at its transfer step, after the layout had published the
    routing (the peers then waited until their timeout), and read ``expert_out`` misaligned.
    Each result must equal the aligned call's bitwise, eager and static shape (the CUDA backend
    copies such rows before its first launch: ``misaligned_copies`` counts them)."""
    dev = rank_device(rank)
    spec = contract_cases(world_size)["random"]
    dt = torch.bfloat16
    x, idx, w = spec_inputs(spec, world_size, dt, 17, device=dev)[rank]
    H = spec["H"]
    for extra in ({}, {"max_recv_tokens": spec["T_max"] * spec["K"] * world_size}):
        buf = _buffer(spec, dt, backend, device=dev, timeout_s=20, **extra)
        cuda_b = buf._get_backend("cuda") if backend == "cuda" else None

        def copies():
            return cuda_b.misaligned_copies if cuda_b is not None else None

        def copied(before, n):
            if cuda_b is not None:
                assert copies() - before == n, f"{copies() - before} copies, {n} expected {extra}"

        tag = f"[rank {rank} {extra}]"
        a = buf.dispatch(x, idx, w)
        c0 = copies()
        xm = _off_by(x, 1)
        assert xm.data_ptr() % 16 != 0 or x.numel() == 0
        b = buf.dispatch(xm, idx, w)
        copied(c0, int(x.numel() > 0))
        for k in ("tokens", "probs", "src_rank", "src_token", "tokens_per_expert"):
            assert_bitwise(getattr(b, k), getattr(a, k), f"dispatch {k} {tag}")
        eo = (a.tokens.float() * 1.5).to(dt)
        c0 = copies()
        assert_bitwise(buf.combine(_off_by(eo, 3), a.handle), buf.combine(eo, a.handle), f"combine {tag}")
        copied(c0, int(eo.numel() > 0))
        c0 = copies()
        assert_bitwise(buf.dispatch(xm, handle=a.handle).tokens, buf.dispatch(x, handle=a.handle).tokens,
                       f"cached dispatch {tag}")
        copied(c0, int(x.numel() > 0))

        # Backward: the tokens' gradient as a slice of cat's (1 element in: misaligned) reaches
        # the dispatch's backward (a combine); then y's reaches the combine's (a cached dispatch).
        grads = []
        for misaligned in (True, False):
            xg = x.clone().requires_grad_(True)
            r = buf.dispatch(xg, idx, w)
            gt = seeded(rank + 5, (r.tokens.numel() + 1,), device=dev)
            c0 = copies()
            if misaligned:
                loss = (torch.cat([r.tokens.new_zeros(1), r.tokens.flatten()]).float() * gt).sum()
            else:
                loss = (r.tokens.float() * gt[1:].view(r.tokens.shape)).sum()
            loss.backward()
            copied(c0, int(misaligned and r.tokens.numel() > 0))
            eg = eo.clone().requires_grad_(True)
            y = buf.combine(eg, a.handle)
            gy = seeded(rank + 7, (y.numel() + 1,), device=dev)
            c0 = copies()
            if misaligned:
                loss = (torch.cat([y.new_zeros(1), y.flatten()]).float() * gy).sum()
            else:
                loss = (y.float() * gy[1:].view(y.shape)).sum()
            loss.backward()
            copied(c0, int(misaligned and y.numel() > 0))
            grads.append((xg.grad, eg.grad))
        assert_bitwise(grads[0][0], grads[1][0], f"grad x through a misaligned grad_tokens {tag}")
        assert_bitwise(grads[0][1], grads[1][1], f"grad expert_out through a misaligned grad_y {tag}")
        assert H * dt.itemsize % 16 == 0
        check_and_destroy(buf)
    return True


def _cuda_input_errors(rank, world_size):
    dev = rank_device(rank)
    buf = mok_buffer(2 * world_size, 64, 2, 16, torch.bfloat16, "cuda", dev)
    x, idx, w = make_inputs(2, world_size, [16] * world_size, 2 * world_size, 64, 2, torch.bfloat16)[rank]
    with pytest.raises(ValueError, match=r"needs CUDA tensors"):
        buf.dispatch(x, idx, w)                               # CPU tensors
    with pytest.raises(ValueError, match=r"topk_idx is on"):
        buf.dispatch(x.to(dev), idx, w.to(dev))
    with pytest.raises(ValueError, match=r"hidden % 8"):
        mok_buffer(2 * world_size, 60, 2, 16, torch.bfloat16, "cuda", dev)
    buf.destroy()
    return True


# (world_size last in the id, as scripts/device_runs/common.sh's world_ids selects by it)
@pytest.mark.parametrize("world_size", [pytest.param(1, marks=pytest.mark.gpu)] + GPU_WORLD_SIZES)
@pytest.mark.parametrize("alignment", (1, 16))
def test_cuda_static_overflow_counts_match_written_rows(world_size, alignment):
    over = run_distributed(_static_overflow_counts, world_size, alignment, backend="nccl",
                           timeout=120, fresh=True)
    assert any(over), "no rank overflowed: the test proves nothing"


@pytest.mark.gpu
@pytest.mark.multigpu
def test_cuda_tensors_on_another_gpu_are_refused():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 visible GPUs in one process")
    run_distributed(_tensors_on_another_gpu, 1, backend="nccl", timeout=120, fresh=True)


@pytest.mark.gpu
def test_cuda_tensor_on_another_gpu_is_refused_before_any_launch():
    got = run_distributed(_fake_tensor_elsewhere, 1, backend="nccl", timeout=120, fresh=True)
    if got == [None]:
        pytest.skip("this torch makes no fake tensors on cuda:1 here")


@pytest.mark.parametrize("world_size", [pytest.param(1, marks=pytest.mark.gpu)] + GPU_WORLD_SIZES)
def test_cuda_misaligned_rows_are_copied(world_size):
    run_distributed(_misaligned_rows, world_size, backend="nccl", timeout=180, fresh=True)


@pytest.mark.gpu
def test_cuda_input_errors():
    run_distributed(_cuda_input_errors, 1, backend="nccl", timeout=120)


def _dispatch_outputs_are_plain_tensors(rank, world_size):
    dev = rank_device(rank)
    for fill_first in ("0", "1"):     # read when the Buffer's backend is made
        os.environ["MOK_EAGER_FILL_FIRST"] = fill_first
        try:
            buf = mok_buffer(8, 64, 2, 32, torch.bfloat16, "cuda", dev)
            assert buf._get_backend("cuda").fill_first == (fill_first == "1")
        finally:
            del os.environ["MOK_EAGER_FILL_FIRST"]
        g = torch.Generator().manual_seed(5)
        x = torch.randn(20, 64, generator=g).to(torch.bfloat16).to(dev).requires_grad_()
        idx = torch.randint(0, 8, (20, 2), generator=g).to(dev)
        w = torch.rand(20, 2, generator=g).to(dev).requires_grad_()
        out = buf.dispatch(x, idx, w)
        R = out.tokens.shape[0]
        assert R == 40 and out.probs.shape == (R,) and out.src_token.shape == (R,)
        # The fill-first dispatch writes into row outputs sized by a bound on R: probs must
        # still be its own tensor (not a slice), or autograd forbids updating it in place.
        assert out.probs._base is None
        out.probs.mul_(2.0)
        buf.destroy()
    return True


def _speculative_calls(rank, world_size, set_env=True):
    """Speculative eager dispatches whose guessed capacity is sometimes short (the first call,
    a jump in size): every call bitwise equal to the reference, full passes included, and the
    short calls redone on every rank together. Loopback ranks share one environment: their
    caller sets it (set_env=False), since every rank must make the same choice."""
    if set_env:
        os.environ["MOK_EAGER_SPECULATIVE"] = "1"
    try:
        dev = rank_device(rank)
        H, K, E, T_max, dtype = 256, 4, 4 * world_size, 512, torch.bfloat16
        buf = mok_buffer(E, H, K, T_max, dtype, "cuda", dev, timeout_s=30)
        ref = mok_buffer(E, H, K, T_max, dtype, "reference", dev)
        # Jumps at calls 3 and 7 (every rank's R grows). At call 10 the routing is skewed to
        # experts 0-4 (K=4 of them per token, 4 experts per rank): rank 0 receives ~3.2 rows per
        # token, about twice its largest R so far, while the other ranks receive less than before;
        # only rank 0's guess is short, and every rank must redo the transfer with it.
        calls = [(40, "mixed"), (40, "mixed"), (38, "mixed"), (300, "mixed"), (290, "mixed"),
                 (5, "mixed"), (0, "mixed"), (512, "mixed"), (100, "mixed"), (480, "mixed"),
                 (512, "skewed")]
        for i, (t, case) in enumerate(calls):
            T_all = [max(0, t - 3 * r) for r in range(world_size)]
            inputs = make_inputs(500 + i, world_size, T_all, E, H, K, dtype, case=case, device=dev)
            tag = f"call {i} T={T_all} rank {rank}"
            if i % 3 == 2:
                assert_same_results(full_pass(buf, *inputs[rank], i), full_pass(ref, *inputs[rank], i), tag)
                continue
            a, b = buf.dispatch(*inputs[rank]), ref.dispatch(*inputs[rank])
            assert_bitwise(a.tokens, b.tokens, f"tokens {tag}")
            assert_bitwise(a.probs, b.probs, f"probs {tag}")
            assert_bitwise(a.src_token, b.src_token, f"src_token {tag}")
            assert a.tokens._base is None and a.probs._base is None
            eo = (a.tokens.float() * 1.25).to(dtype)
            assert_bitwise(buf.combine(eo, a.handle), ref.combine(eo, b.handle), f"combine {tag}")
        fallbacks = buf._get_backend("cuda").spec_fallbacks
        buf.check_errors()
        buf.destroy()
        ref.destroy()
        return fallbacks
    finally:
        if set_env:
            os.environ.pop("MOK_EAGER_SPECULATIVE", None)


@pytest.mark.parametrize("world_size", GPU_WORLD_SIZES)
def test_cuda_speculative_dispatch_redoes_short_calls_on_every_rank(world_size):
    fallbacks = run_distributed(_speculative_calls, world_size, backend="nccl", timeout=300)
    # The first call has no guess; the jumps to 300 and 512 tokens exceed 1.1x the history; the
    # skewed call overflows rank 0 only, and every rank must have redone it.
    assert all(f == fallbacks[0] for f in fallbacks), f"ranks disagree on the redone calls: {fallbacks}"
    assert 4 <= fallbacks[0] < 11, f"{fallbacks[0]} calls were redone"


@pytest.mark.gpu
def test_cuda_dispatch_outputs_are_plain_tensors():
    run_distributed(_dispatch_outputs_are_plain_tensors, 1, backend="nccl", timeout=120)


# --------------------------------------------------- CPU self-checks of the comparison code
@pytest.mark.parametrize("name", ("mixed", "t0_on_rank0", "dsv3_like"))
def test_comparison_code_runs_on_cpu(name):
    """The GPU comparison with the reference on both sides (gloo): must pass, and proves the
    GPU tests' own code (inputs, oracle fields, identity, backward) is sound."""
    run_distributed(_backend_vs_reference, 2, name, 2024, "reference")


def test_repeat_and_ring_code_runs_on_cpu():
    run_distributed(_repeats_and_sms, 2, "random", 5, "reference", (4, 24), 3)
    rows = run_distributed(_ring_wrap, 2, 12, "reference")
    assert all(r[0] > 0 for r in rows)
    rows = run_distributed(_ring_reused_every_call, 2, 12, "reference")
    assert all(r[0] > 0 for r in rows)


def test_streamed_produce_code_runs_on_cpu():
    run_distributed(_streamed_produce_calls, 2, "reference")


def test_scan_tiles_code_runs_on_cpu():
    run_distributed(_scan_tiles_calls, 2, "reference")


def test_alignment_code_runs_on_cpu():
    run_distributed(_alignment_vs_reference, 2, "random", 313, 16, "reference")
    gaps = run_distributed(_alignment_big_layout, 2, {}, 16, "reference")
    assert sum(gaps) > 0


def test_rows_per_expert_code_runs_on_cpu():
    run_distributed(_fixed_rows_vs_reference, 2, "random", 413, 16, 5, "reference")
    gaps = run_distributed(_alignment_big_layout, 2, {}, 1, "reference", 2)
    assert min(gaps) >= 2 * 128


def test_static_overflow_counts_code_runs_on_cpu():
    """The reference raises at the overflowing rank's dispatch; the other ranks' checks run."""
    for alignment in (1, 16):
        over = run_distributed(_static_overflow_counts, 2, alignment, "reference")
        assert any(over)


def test_misaligned_rows_code_runs_on_cpu():
    run_distributed(_misaligned_rows, 2, "reference")

"""FP8 dispatch (``megatron_mok/fp8.py``): ``Buffer.dispatch((x_fp8, scales), ...)``.

The FP8 rows and their scales must arrive byte for byte: each received row is the packed row
of its source token (``src_rank``, ``src_token``), zero bytes on padding rows, and the layout
(``probs``, counts, sources, row count) is bitwise the one a token dispatch of the same
routing gives on the same Buffer. The expectation is built from every rank's packed inputs
and the token dispatch's sources only, so it holds any backend to the same bytes; the token
dispatch itself is held to the oracle by the contract tests.

CPU (every CI run): the reference backend over gloo at 1-3 ranks, every mode. GPU: the CUDA
backend at world size 1, as loopback ranks (2-4 threads on one GPU), as processes over NCCL
(2 GPUs, or shared-GPU mode), under each dispatch schedule, and through ring wrap-arounds
with a call larger than the ring.
"""

import pytest
import torch

import oracle
from harness import (_buffer, assert_bitwise, contract_cases, in_loopback, make_inputs, rank_device,
                     run_distributed, run_loopback, settle, spec_inputs)
import megatron_mok as mok
from megatron_mok import fp8

BLOCK = 16  # the contract cases have H = 32 or 64: two or four float32 scales per row
MODES = ("plain", "static", "aligned", "rows_per_expert")
# Routing cases with awkward shapes: no tokens on rank 0, -1 slots, every row to one expert,
# experts without rows, T not a multiple of anything, 16 slots per token.
FP8_CASES = ("random", "t0_on_rank0", "unrouted_slots", "all_to_one_expert", "experts_without_rows",
             "odd_t", "k16_duplicates")
SCALE_DTYPES = [pytest.param(torch.float32, id="f32_scales"),
                pytest.param(torch.uint8, id="byte_scales")]
# (scale dtype, block): scale rows of 16-byte multiples (f32, block 8 at H = 32 and 64; block 16
# at H = 64) are read in place from two sources (fp8.PairRows, NOTES #57); the others are packed
# first (torch copies).
GPU_SCALES = [pytest.param(torch.float32, BLOCK, id="f32_scales"),
              pytest.param(torch.float32, 8, id="f32_scales_two_sources"),
              pytest.param(torch.uint8, BLOCK, id="byte_scales")]


def fp8_pairs(inputs, seed, scale_dtype, block=BLOCK):
    """Every rank's ``(x_fp8, scales)``: :func:`fp8.quantize` of its tokens (float32 scales,
    one per ``block`` columns), or its tokens cast to FP8 with random one-byte scales (MXFP8's
    E8M0 exponents are bytes: every byte value must arrive, NaN patterns included). With
    ``block`` 8 the float32 scale rows of H = 32 or 64 are 16-byte multiples: the dispatch reads
    token and scale rows in place (``fp8.dispatch_rows``); the other widths are packed first."""
    out = []
    for s, (x, _idx, _w) in enumerate(inputs):
        settle(x.device)     # loopback ranks: no host-synchronising copy behind communication
        if scale_dtype == torch.float32:
            q, sc = fp8.quantize(x.cpu(), block)
        else:
            g = torch.Generator().manual_seed(seed * 31 + s)
            q = x.cpu().float().clamp(-448, 448).to(torch.float8_e4m3fn)
            sc = torch.randint(0, 256, (x.shape[0], max(1, x.shape[1] // 32)), generator=g,
                               dtype=torch.uint8).view(scale_dtype)
        out.append((q.to(x.device), sc.to(x.device)))
    return out


def expected_bytes(pairs, src_rank, src_token, rows):
    """``(fp8 bytes [rows, H], scale bytes [rows, S bytes])`` of a dispatch whose row ``i``
    came from ``(src_rank[i], src_token[i])`` (-1: a padding row, zero bytes)."""
    H = pairs[0][0].shape[1]
    sb = pairs[0][1].shape[1] * pairs[0][1].element_size()
    want_x = torch.zeros(rows, H, dtype=torch.uint8)
    want_s = torch.zeros(rows, sb, dtype=torch.uint8)
    for i, (s, t) in enumerate(zip(src_rank.tolist(), src_token.tolist())):
        if s >= 0:
            want_x[i] = pairs[s][0][t].cpu().view(torch.uint8)
            want_s[i] = pairs[s][1][t].cpu().contiguous().view(torch.uint8)
    return want_x, want_s


def assert_fp8_rows(tokens, pairs, src_rank, src_token, rows, what):
    """``tokens`` (the FP8 dispatch's pair of views) against :func:`expected_bytes`."""
    rows_fp8, row_scales = tokens
    # Loopback ranks: wait for this rank's stream before the .cpu() copies below (a pageable
    # copy queued behind the communication kernels stalls the peers' CUDA calls: loopback.settle).
    settle(rows_fp8.device)
    x0, s0 = pairs[0]
    assert rows_fp8.dtype == x0.dtype and row_scales.dtype == s0.dtype, what
    assert tuple(rows_fp8.shape) == (rows, x0.shape[1]), f"{what}: {tuple(rows_fp8.shape)}"
    assert tuple(row_scales.shape) == (rows, s0.shape[1]), f"{what}: {tuple(row_scales.shape)}"
    want_x, want_s = expected_bytes(pairs, src_rank.cpu(), src_token.cpu(), rows)
    assert_bitwise(rows_fp8.contiguous().view(torch.uint8), want_x.to(rows_fp8.device), f"fp8 rows {what}")
    assert_bitwise(row_scales.contiguous().view(torch.uint8), want_s.to(rows_fp8.device), f"scales {what}")


def prob_grad_signal(src_rank, src_token):
    """A gradient for each row's prob that names its source token (0 on padding rows): the
    gradient of ``topk_weights[t, k]`` must then be this value of ``(rank, t)`` on every
    routed slot, whichever rank holds the row."""
    g = ((src_rank * 131 + src_token * 7 + 3) % 17).float() / 16 + 0.5
    return torch.where(src_rank >= 0, g, torch.zeros_like(g))


def check_fp8_case(rank, world_size, name, seed, backend="reference", mode="plain",
                   scale_dtype=torch.float32, buffer_dtype=torch.bfloat16, compare_reference=False,
                   block=BLOCK):
    """One routing case of the FP8 dispatch in ``mode`` (module docstring). Returns the rows
    this rank received (so a caller can see what was covered)."""
    dev = rank_device(rank)
    spec = contract_cases(world_size)[name]
    inputs = spec_inputs(spec, world_size, buffer_dtype, seed, device=dev)
    pairs = fp8_pairs(inputs, seed, scale_dtype, block)
    routing = oracle.route([tuple(t.cpu() for t in inp) for inp in inputs], spec["E"])
    kw, rpe = {}, None
    if mode == "static":
        kw["max_recv_tokens"] = max(rr.num_rows for rr in routing) + 3
    elif mode == "aligned":
        kw["expert_alignment"] = 4
    elif mode == "rows_per_expert":
        rpe = max(max(rr.tokens_per_expert) for rr in routing) + 2
    buf = _buffer(spec, buffer_dtype, backend, device=dev, **kw)
    x, idx, w0 = inputs[rank]
    tag = f"[{name} {mode} {scale_dtype} block {block} {backend} rank {rank}/{world_size}]"

    w = w0.clone().requires_grad_(True)
    res8 = buf.dispatch(pairs[rank], idx, w, rows_per_expert=rpe)
    res = buf.dispatch(x, idx, w0, rows_per_expert=rpe)
    rows = res.tokens.shape[0]
    for k in ("probs", "tokens_per_expert", "src_rank", "src_token"):
        assert_bitwise(getattr(res8, k).detach(), getattr(res, k), f"{k} vs the token dispatch {tag}")
    assert res8.handle.num_rows == res.handle.num_rows, tag
    if mode == "plain":
        settle(dev)
        exp = oracle.expected_dispatch([tuple(t.cpu() for t in inp) for inp in inputs], spec["E"], rank, routing)
        assert_bitwise(res8.src_rank.cpu(), exp["src_rank"], f"src_rank vs oracle {tag}")
        assert_bitwise(res8.src_token.cpu(), exp["src_token"], f"src_token vs oracle {tag}")
    assert_fp8_rows(res8.tokens, pairs, res.src_rank, res.src_token, rows, tag)

    # A cached FP8 dispatch along either handle moves new pairs to the same rows.
    pairs2 = fp8_pairs(spec_inputs(spec, world_size, buffer_dtype, seed + 1, device=dev), seed + 1, scale_dtype,
                       block)
    for which, h in (("token handle", res.handle), ("fp8 handle", res8.handle)):
        cached = buf.dispatch(pairs2[rank], handle=h)
        assert cached.probs is None
        assert_fp8_rows(cached.tokens, pairs2, res.src_rank, res.src_token, rows, f"cached, {which} {tag}")

    # The prob gradients travel back through the FP8 dispatch's handle (a combine of zero rows);
    # autograd cannot run the reference backend's collectives inside loopback threads.
    if not (in_loopback() and backend == "reference"):
        gp = prob_grad_signal(res.src_rank, res.src_token)
        (res8.probs * gp).sum().backward()
        mine = prob_grad_signal(torch.full_like(idx, rank), torch.arange(idx.shape[0], device=dev).view(-1, 1).expand_as(idx))
        want = torch.where(idx >= 0, mine, torch.zeros_like(mine))
        assert_bitwise(w.grad, want, f"grad topk_weights {tag}")

    if compare_reference:
        ref = _buffer(spec, buffer_dtype, "reference", device=dev, **kw)
        r8 = ref.dispatch(pairs[rank], idx, w0, rows_per_expert=rpe)
        for a, b, what in zip(res8.tokens, r8.tokens, ("fp8 rows", "scales")):
            assert_bitwise(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8),
                           f"{what}: {backend} vs reference {tag}")
        ref.destroy()
    if hasattr(buf, "check_errors"):
        buf.check_errors()
    buf.destroy()
    return rows


def fp8_ring_wrap(rank, world_size, calls, chunks=3, T_max=512):
    """``calls`` FP8 dispatches of varying sizes through a ring of ``chunks`` chunks, one of
    them larger than the whole ring; every one byte-checked. Returns the rows and ring bytes."""
    from test_cuda_backend import mok_buffer, ring_chunk_bytes

    dev = rank_device(rank)
    H, K, E = 256, 4, 4 * world_size
    disp, comb = ring_chunk_bytes(H, K)
    ring = chunks * max(disp, comb)
    buf = mok_buffer(E, H, K, T_max, torch.bfloat16, "cuda", dev, ring_bytes=ring, timeout_s=30)
    g = torch.Generator().manual_seed(78)                      # the same sizes on every rank
    cases = ("duplicate", "mixed", "skewed", "one_expert")
    most = 0
    for i in range(calls):
        T_all = [int(v) for v in torch.randint(0, T_max + 1, (world_size,), generator=g)]
        if i == calls // 2:
            T_all = [T_max] * world_size
            assert T_max * fp8.packed_row_bytes(H, H // BLOCK, torch.float32) > ring
        inputs = make_inputs(2000 + i, world_size, T_all, E, H, K, torch.bfloat16, case=cases[i % 4], device=dev)
        pairs = fp8_pairs(inputs, i, torch.float32)
        res = buf.dispatch(pairs[rank], inputs[rank][1], inputs[rank][2])
        rows = res.src_rank.shape[0]
        most = max(most, rows)
        assert_fp8_rows(res.tokens, pairs, res.src_rank, res.src_token, rows, f"call {i} T={T_all} rank {rank}")
    buf.check_errors()
    buf.destroy()
    return most, ring


# ------------------------------------------------------------------------------ CPU (CI)
@pytest.mark.parametrize("world_size", (1, 2, 3))
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("scale_dtype", SCALE_DTYPES)
def test_reference_fp8_dispatch(mode, scale_dtype, world_size):
    for name in FP8_CASES:
        run_distributed(check_fp8_case, world_size, name, 11, "reference", mode, scale_dtype)


def test_reference_fp8_dispatch_on_a_float32_buffer():
    run_distributed(check_fp8_case, 2, "mixed", 12, "reference", "plain", torch.float32, torch.float32)


def test_fp8_byte_check_catches_a_wrong_row():
    """The row check is not vacuous: one byte changed, or two rows swapped, fails it."""
    x = torch.randn(5, 32)
    pairs = [fp8.quantize(x, BLOCK)]
    src_rank = torch.zeros(4, dtype=torch.int64)
    src_token = torch.tensor([3, 0, 0, 4])
    rows = fp8.unpack(fp8.pack(*pairs[0])[src_token], 32, torch.float8_e4m3fn, 2, torch.float32)
    assert_fp8_rows(rows, pairs, src_rank, src_token, 4, "unchanged")
    bad = rows[0].clone()
    bad.view(torch.uint8)[2, 5] ^= 1
    with pytest.raises(AssertionError, match="differ bitwise"):
        assert_fp8_rows((bad, rows[1]), pairs, src_rank, src_token, 4, "one byte")
    with pytest.raises(AssertionError, match="differ bitwise"):
        assert_fp8_rows(rows, pairs, src_rank, torch.tensor([0, 3, 0, 4]), 4, "swapped")


def test_quantize_matches_the_per_token_block_definition():
    """Each block's largest magnitude becomes +-448 (scale = amax / 448); every value is within
    half an E4M3 step of x / scale; dequantize multiplies back; an all-zero block stays zero."""
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(7, 256, generator=g) * torch.logspace(-3, 3, 7).view(-1, 1)).to(torch.bfloat16)
    x[2, 128:] = 0
    q, s = fp8.quantize(x, 128)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    assert tuple(q.shape) == (7, 256) and tuple(s.shape) == (7, 2)
    blocks = x.float().view(7, 2, 128)
    amax = blocks.abs().amax(dim=2)
    assert torch.equal(s, amax.clamp(min=1e-4) / 448)
    qb = q.float().view(7, 2, 128)
    live = amax > 0
    assert torch.equal(qb.abs().amax(dim=2)[live], torch.full_like(amax[live], 448.0))
    assert torch.equal(qb[~live], torch.zeros_like(qb[~live]))
    scaled = blocks / s.unsqueeze(2)
    # E4M3: 3 mantissa bits (half a step is 1/16 of the value), subnormal step 2^-9.
    assert bool(((qb - scaled).abs() <= torch.maximum(scaled.abs() / 16, torch.full_like(scaled, 2.0 ** -10)) * 1.0001).all())
    deq = fp8.dequantize(q, s, torch.float32)
    assert torch.equal(deq, (qb * s.unsqueeze(2)).view(7, 256))
    assert fp8.dequantize(q, s).dtype == torch.bfloat16


@pytest.mark.parametrize("shape,block,pattern", [((4, 8, 16), 8, r"x must be \[T, H\], got \(4, 8, 16\)"),
                                                 ((4, 96), 64, "hidden 96 is not a multiple of the scale block 64"),
                                                 ((4, 96), 0, "hidden 96 is not a multiple of the scale block 0"),
                                                 ((4, 96), -32, "hidden 96 is not a multiple of the scale block -32")])
def test_quantize_refuses_a_shape_it_cannot_block(shape, block, pattern):
    with pytest.raises(ValueError, match=pattern):
        fp8.quantize(torch.randn(*shape), block)


def test_dequantize_refuses_scales_that_do_not_divide_the_row():
    q, s = fp8.quantize(torch.randn(3, 96), 32)          # 3 scale columns
    with pytest.raises(ValueError, match="hidden 96 is not a multiple of the 5 scale columns"):
        fp8.dequantize(q, torch.ones(3, 5))
    with pytest.raises(ValueError, match="hidden 96 is not a multiple of the 0 scale columns"):
        fp8.dequantize(q, torch.ones(3, 0))
    # the pair quantize made is accepted
    assert torch.equal(fp8.dequantize(q, s, torch.float32), (q.float().view(3, 3, 32) * s.unsqueeze(2)).view(3, 96))


@pytest.mark.parametrize("H,S,scale_dtype,P", [(7168, 56, torch.float32, 7392), (640, 5, torch.float32, 672),
                                               (32, 1, torch.uint8, 48), (4096, 128, torch.uint8, 4224),
                                               (24, 3, torch.uint8, 32), (40, 3, torch.float32, 64)])
def test_pack_and_unpack_round_trip(H, S, scale_dtype, P):
    g = torch.Generator().manual_seed(H)
    q = torch.randint(0, 256, (3, H), generator=g, dtype=torch.uint8).view(torch.float8_e4m3fn)
    sc = torch.randint(0, 256, (3, S * torch.tensor([], dtype=scale_dtype).element_size()), generator=g,
                       dtype=torch.uint8).view(scale_dtype)
    assert fp8.packed_row_bytes(H, S, scale_dtype) == P
    packed = fp8.pack(q, sc)
    assert packed.dtype == torch.uint8 and tuple(packed.shape) == (3, P)
    assert torch.equal(packed[:, H + sc.view(torch.uint8).shape[1]:], torch.zeros(3, P - H - sc.view(torch.uint8).shape[1], dtype=torch.uint8))
    q2, s2 = fp8.unpack(packed, H, torch.float8_e4m3fn, S, scale_dtype)
    assert q2.data_ptr() == packed.data_ptr()            # views, no copy
    assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(s2.contiguous().view(torch.uint8), sc.view(torch.uint8))
    empty = fp8.pack(q[:0], sc[:0])
    assert tuple(empty.shape) == (0, P)


def _fp8_buffer(H=32, dtype=torch.bfloat16):
    import megatron_mok as mok
    return mok.Buffer(None, num_experts=4, hidden=H, topk=2, max_tokens_per_rank=8, dtype=dtype,
                      backend="reference")


def _ok_pair(T=3, H=32):
    return fp8.quantize(torch.randn(T, H), BLOCK)


@pytest.mark.parametrize("make,err,match", [
    (lambda q, s: (q,), ValueError, "x = \\(x_fp8, scales\\)"),
    (lambda q, s: (q.float(), s), TypeError, "x_fp8 must be one of"),
    (lambda q, s: (q, s.double()), TypeError, "scales must be one of"),
    (lambda q, s: (q[:, :16], s), ValueError, "x_fp8 must be \\[T, hidden=32\\]"),
    (lambda q, s: (q, s[:2]), ValueError, "scales must be \\[T=3"),
    (lambda q, s: (q, s.t().contiguous().t()), ValueError, "scales must be contiguous"),
    (lambda q, s: (q, s.clone().requires_grad_(True)), ValueError, "not differentiable"),
    (lambda q, s: (q, torch.zeros(3, 9)), ValueError, "more than the Buffer's token row"),
])
def test_fp8_input_errors(make, err, match):
    buf = _fp8_buffer()
    q, s = _ok_pair()
    idx = torch.tensor([[0, 1], [2, 3], [1, -1]])
    w = torch.rand(3, 2)
    with pytest.raises(err, match=match):
        buf.dispatch(make(q, s), idx, w)
    buf.dispatch((q, s), idx, w)                        # the pair itself is fine


def test_fp8_row_of_exactly_the_token_row_fits():
    """The packed row may fill the Buffer's token row exactly (the staging ring holds it):
    H = 32 FP8 bytes + 8 float32 scales = 64 bytes = 32 bf16 elements; 9 scales (80) do not."""
    buf = _fp8_buffer()
    q, s = fp8.quantize(torch.randn(3, 32), 4)
    assert tuple(s.shape) == (3, 8)
    assert fp8.packed_row_bytes(32, 8, torch.float32) == 64 == 32 * torch.bfloat16.itemsize
    idx = torch.tensor([[0, 1], [2, 3], [1, -1]])
    res = buf.dispatch((q, s), idx, torch.rand(3, 2))
    rows_fp8, row_scales = res.tokens
    src = [0, 0, 2, 1, 1]              # expert order: e0 <- t0; e1 <- t0, t2; e2 <- t1; e3 <- t1
    assert res.src_token.tolist() == src
    # (indexing the bytes: torch 2.6 has no CPU indexing of float8 tensors)
    assert torch.equal(rows_fp8.contiguous().view(torch.uint8), q.view(torch.uint8)[src])
    assert torch.equal(row_scales.contiguous(), s[src])
    with pytest.raises(ValueError, match="packs into 80 bytes, more than the Buffer's token row"):
        buf.dispatch((q, torch.ones(3, 9)), idx, torch.rand(3, 2))


def test_fp8_pair_of_non_tensors_is_a_type_error_with_the_auto_backend():
    import megatron_mok as mok
    buf = mok.Buffer(None, num_experts=4, hidden=32, topk=2, max_tokens_per_rank=8)   # backend="auto"
    q, s = _ok_pair()
    idx, w = torch.tensor([[0, 1], [2, 3], [1, -1]]), torch.rand(3, 2)
    with pytest.raises(TypeError, match="x_fp8 must be a torch.Tensor"):
        buf.dispatch(("not a tensor", s), idx, w)
    with pytest.raises(TypeError, match="scales must be a torch.Tensor"):
        buf.dispatch((q, [1.0]), idx, w)


def test_fp8_scales_must_start_aligned_in_the_packed_row():
    import megatron_mok as mok
    buf = mok.Buffer(None, num_experts=4, hidden=30, topk=2, max_tokens_per_rank=8, backend="reference")
    q = torch.zeros(3, 30, dtype=torch.uint8).view(torch.float8_e4m3fn)
    idx, w = torch.tensor([[0, 1], [2, 3], [1, -1]]), torch.rand(3, 2)
    with pytest.raises(ValueError, match="not a multiple of the torch.float32 scales' 4 bytes"):
        buf.dispatch((q, torch.ones(3, 2)), idx, w)
    res = buf.dispatch((q, torch.ones(3, 2, dtype=torch.uint8)), idx, w)   # one-byte scales: fine
    assert tuple(res.tokens[1].shape) == (res.src_rank.shape[0], 2)


def test_unpack_views_of_offset_rows():
    """Views of packed rows that do not start at their storage's beginning (a slice)."""
    q, s = fp8.quantize(torch.randn(6, 256), 128)
    packed = fp8.pack(q, s)
    x2, s2 = fp8.unpack(packed[2:5], 256, torch.float8_e4m3fn, 2, torch.float32)
    assert torch.equal(x2.view(torch.uint8), q[2:5].view(torch.uint8)) and torch.equal(s2, s[2:5])
    assert x2.stride() == (packed.shape[1], 1) and s2.stride() == (packed.shape[1] // 4, 1)


@pytest.mark.parametrize("H,S,scale_dtype,two", [
    (256, 16, torch.float32, True),      # 64-byte scale rows: read in place
    (64, 4, torch.float32, True),
    (32, 2, torch.float32, False),       # 8-byte scale rows: packed
    (512, 16, torch.uint8, True),        # MXFP8 at H = 512: 16 one-byte scales
    (64, 2, torch.uint8, False),
    (40, 4, torch.float32, False),       # FP8 rows of 40 bytes
])
def test_dispatch_rows_reads_in_place_exactly_when_the_widths_allow(H, S, scale_dtype, two):
    g = torch.Generator().manual_seed(H + S)
    q = torch.randint(0, 256, (5, H), generator=g, dtype=torch.uint8).view(torch.float8_e4m3fn)
    sc = torch.randint(0, 256, (5, S * scale_dtype.itemsize), generator=g, dtype=torch.uint8).view(scale_dtype)
    rows = fp8.dispatch_rows(q, sc)
    assert isinstance(rows, fp8.PairRows) == two
    want = fp8.pack(q, sc)
    assert tuple(rows.shape) == tuple(want.shape) and rows.dtype == torch.uint8
    got = rows.packed() if two else rows
    assert torch.equal(got, want)
    if two:   # no copy: the pair's own storage, both pointers handed to the library
        assert rows.data_ptr() == q.data_ptr() and rows.second_ptr() == sc.data_ptr()
        assert rows.numel() == want.numel() and rows.element_size() == 1


def test_fp8_pack_switch_is_read_when_the_buffer_is_made(monkeypatch):
    """``MOK_FP8_PACK=1`` packs every pair: ``dispatch_rows`` reads it per call unless told
    (``packed=``), a Buffer once when it is made (an environment read per call was ~1 us)."""
    q, s = fp8.quantize(torch.randn(4, 256), 16)        # 64-byte scale rows: in place by default
    monkeypatch.setenv("MOK_FP8_PACK", "1")
    packed_buf = mok.Buffer(None, num_experts=2, hidden=256, topk=1, max_tokens_per_rank=4)
    assert not isinstance(fp8.dispatch_rows(q, s), fp8.PairRows)
    assert isinstance(fp8.dispatch_rows(q, s, packed=False), fp8.PairRows)
    monkeypatch.delenv("MOK_FP8_PACK")
    plain_buf = mok.Buffer(None, num_experts=2, hidden=256, topk=1, max_tokens_per_rank=4)
    assert isinstance(fp8.dispatch_rows(q, s), fp8.PairRows)
    assert not isinstance(fp8.dispatch_rows(q, s, packed=True), fp8.PairRows)
    assert packed_buf._fp8_pack and not plain_buf._fp8_pack
    idx, w = torch.zeros(4, 1, dtype=torch.int64), torch.ones(4, 1)
    for buf in (packed_buf, plain_buf):   # the same received rows either way (reference backend)
        got = buf.dispatch((q, s), idx, w).tokens
        assert torch.equal(got[0].view(torch.uint8), q.view(torch.uint8)) and torch.equal(got[1], s)
        buf.destroy()


def test_dispatch_rows_copies_a_misaligned_source_and_keeps_reading_in_place():
    """A pair whose views start 8 bytes into their storage: the library needs 16-byte aligned
    rows, and falling back to the pack on one rank only would give its peers another row layout
    (a mismatch error), so the misaligned source is copied and the pair still read in place."""
    q, s = fp8.quantize(torch.randn(4, 256), 16)        # 16 float32 scales: 64-byte rows
    qs = torch.zeros(4 * 256 + 8, dtype=torch.uint8)
    qs[8:].copy_(q.view(torch.uint8).flatten())
    q_off = qs[8:].view(4, 256).view(torch.float8_e4m3fn)
    ss = torch.zeros(4 * 16 + 2, dtype=torch.float32)
    ss[2:].copy_(s.flatten())
    s_off = ss[2:].view(4, 16)
    assert q_off.data_ptr() % 16 == 8 and s_off.data_ptr() % 16 == 8
    rows = fp8.dispatch_rows(q_off, s_off)
    assert isinstance(rows, fp8.PairRows)
    assert rows.data_ptr() % 16 == 0 and rows.second_ptr() % 16 == 0
    assert torch.equal(rows.packed(), fp8.pack(q, s))


@pytest.mark.parametrize("H", (128, 512))
def test_fp8_dispatch_of_no_tokens_with_one_scale_column(H):
    """quantize of 0 tokens with block = H gives scales [0, 1] with strides (1, 0), which a byte
    view refuses: the dispatch (a 4-byte scale row: packed) must take it (found by
    scripts/fuzz_dispatch.py)."""
    import megatron_mok as mok
    buf = mok.Buffer(None, num_experts=4, hidden=H, topk=2, max_tokens_per_rank=8, backend="reference")
    q, s = fp8.quantize(torch.zeros(0, H, dtype=torch.bfloat16), H)
    assert tuple(s.shape) == (0, 1)
    res = buf.dispatch((q, s), torch.zeros(0, 2, dtype=torch.int64), torch.zeros(0, 2))
    assert res.tokens[0].shape == (0, H) and res.tokens[1].shape == (0, 1)
    assert fp8.pack(q, s).shape == (0, fp8.packed_row_bytes(H, 1, torch.float32))


def test_fp8_cached_dispatch_errors():
    buf = _fp8_buffer()
    q, s = _ok_pair()
    res = buf.dispatch((q, s), torch.tensor([[0, 1], [2, 3], [1, -1]]), torch.rand(3, 2))
    q4, s4 = _ok_pair(T=4)
    with pytest.raises(ValueError, match="the handle's dispatch"):
        buf.dispatch((q4, s4), handle=res.handle)
    with pytest.raises(TypeError, match="handle must be a DispatchHandle"):
        buf.dispatch((q, s), handle=object())


# -------------------------------------------------------------------------------- GPU
gpu = pytest.mark.gpu


@gpu
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("scale_dtype,block", GPU_SCALES)
def test_cuda_fp8_dispatch_world_size_1(mode, scale_dtype, block):
    for name in ("random", "t0_everywhere", "k1", "same_expert_twice", "mixed"):
        run_distributed(check_fp8_case, 1, name, 21, "cuda", mode, scale_dtype, compare_reference=True,
                        block=block, backend="nccl", timeout=300)


@gpu
@pytest.mark.parametrize("world_size", (2, 3, 4))
@pytest.mark.parametrize("mode", MODES)
def test_loopback_fp8_dispatch(mode, world_size):
    for name in FP8_CASES:
        for scale_dtype, block in ((torch.float32, BLOCK), (torch.float32, 8), (torch.uint8, BLOCK)):
            run_loopback(check_fp8_case, world_size, name, 31, "cuda", mode, scale_dtype,
                         compare_reference=mode == "plain", block=block, timeout=300)


@gpu
@pytest.mark.parametrize("H,S,scale_dtype", [(7168, 56, torch.float32), (4096, 32, torch.float32), (32, 4, torch.float32),
                                             (64, 16, torch.uint8), (640, 5, torch.float32), (24, 3, torch.uint8)])
@pytest.mark.parametrize("T", (0, 1, 37, 4096))
def test_cuda_pack_matches_the_cpu_pack(H, S, scale_dtype, T, monkeypatch):
    """The GPU pack (mok_pack_rows where the widths are 16-byte multiples, torch copies where
    not) gives the CPU pack's bytes; the kernel path is taken exactly where it should be."""
    taken = []
    real = fp8._pack_on_device
    monkeypatch.setattr(fp8, "_pack_on_device", lambda *a: taken.append(real(*a)) or taken[-1])
    g = torch.Generator().manual_seed(T * 7 + H)
    q = torch.randint(0, 256, (T, H), generator=g, dtype=torch.uint8).view(torch.float8_e4m3fn)
    sc = torch.randint(0, 256, (T, S * scale_dtype.itemsize), generator=g, dtype=torch.uint8).view(scale_dtype)
    want = fp8.pack(q, sc)
    got = fp8.pack(q.cuda(), sc.cuda())
    assert torch.equal(got.cpu(), want)
    kernel = H % 16 == 0 and (S * scale_dtype.itemsize) % 16 == 0
    assert taken == ([kernel] if T else [])


@gpu
@pytest.mark.parametrize("pad_bytes", (16, 48))
@pytest.mark.parametrize("T", (1, 37, 1100))
def test_cuda_pack_rows_zeroes_the_padding_of_dirty_memory(T, pad_bytes):
    """``mok_pack_rows`` with a packed row wider than the pair (the C ABI allows any
    ``dst_bytes >= a_bytes + b_bytes``; fp8.pack's own widths never pad on this path): the
    padding is zero even where the output memory held other bytes (filled with 0xAB first)."""
    from megatron_mok.cuda import library
    from megatron_mok.cuda.backend import current_stream_ptr
    g = torch.Generator().manual_seed(T + pad_bytes)
    a = torch.randint(0, 256, (T, 64), generator=g, dtype=torch.uint8).cuda()
    b = torch.randint(0, 256, (T, 32), generator=g, dtype=torch.uint8).cuda()
    P = 64 + 32 + pad_bytes
    out = torch.full((T, P), 0xAB, dtype=torch.uint8, device="cuda")
    lib = library.get()
    rc = lib.mok_pack_rows(current_stream_ptr(out.device.index), out.data_ptr(), P, a.data_ptr(), 64,
                           b.data_ptr(), 32, T)
    assert rc == 0, lib.mok_last_error().decode()
    want = torch.cat([a, b, torch.zeros(T, pad_bytes, dtype=torch.uint8, device="cuda")], dim=1)
    assert torch.equal(out, want)


def fp8_graph(rank, world_size, block):
    """A static-shape FP8 dispatch (pack included) captured in one CUDA graph, replayed on new
    pairs and routings copied into the captured tensors: every replay's rows byte-checked."""
    from harness import capture_in_turn, sync_device
    from test_cuda_backend import mok_buffer

    dev = rank_device(rank)
    E, H, K, T = 4 * world_size, 64, 2, 24
    buf = mok_buffer(E, H, K, T, torch.bfloat16, "cuda", dev, max_recv_tokens=T * K * world_size,
                     timeout_s=30)
    q_s = torch.zeros(T, H, dtype=torch.uint8, device=dev).view(torch.float8_e4m3fn)
    s_s = torch.zeros(T, H // block, dtype=torch.float32, device=dev)
    idx_s = torch.zeros(T, K, dtype=torch.int64, device=dev)
    w_s = torch.zeros(T, K, dtype=torch.float32, device=dev)

    def load(it):
        inputs = make_inputs(300 + it, world_size, [T] * world_size, E, H, K, torch.bfloat16,
                             case=("random", "mixed", "one_expert")[it % 3], device=dev)
        pairs = fp8_pairs(inputs, it, torch.float32, block)
        q_s.view(torch.uint8).copy_(pairs[rank][0].view(torch.uint8))
        s_s.copy_(pairs[rank][1])
        idx_s.copy_(inputs[rank][1])
        w_s.copy_(inputs[rank][2])
        return pairs

    load(0)
    buf.dispatch((q_s, s_s), idx_s, w_s)          # warm-up outside the capture
    sync_device()
    graph = torch.cuda.CUDAGraph()

    def capture():
        with torch.cuda.graph(graph):
            return buf.dispatch((q_s, s_s), idx_s, w_s)

    res = capture_in_turn(rank, world_size, capture)
    for it in range(1, 5):
        pairs = load(it)
        graph.replay()
        sync_device()
        buf.check_errors()
        rows = res.src_rank.shape[0]
        assert_fp8_rows(res.tokens, pairs, res.src_rank, res.src_token, rows, f"replay {it} rank {rank}")
    buf.destroy()
    return True


@gpu
@pytest.mark.parametrize("world_size", (1, 2, 3))
@pytest.mark.parametrize("block", (32, BLOCK), ids=("torch_copies_pack", "two_sources"))
def test_loopback_fp8_static_dispatch_in_a_cuda_graph(world_size, block):
    # H = 64: 1x32 blocks give 8-byte scale rows (packed by torch copies), 1x16 blocks 16-byte
    # ones (read in place: the captured graph holds the pair's own pointers)
    assert run_loopback(fp8_graph, world_size, block, timeout=300) == [True] * world_size


FP8_SCHEDULES = [pytest.param({"MOK_DISPATCH_CE_STAGE": "0"}, id="dispatch_sm_staging"),
                 pytest.param({"MOK_EAGER_STAGE_FIRST": "1"}, id="eager_stage_first"),
                 pytest.param({"MOK_EAGER_FILL_FIRST": "1"}, id="eager_fill_first"),
                 pytest.param({"MOK_EAGER_SPECULATIVE": "1"}, id="eager_speculative"),
                 pytest.param({"MOK_DISPATCH_CE_OVERLAP": "1"}, id="dispatch_ce_copy_beside_layout")]


@gpu
@pytest.mark.parametrize("env", FP8_SCHEDULES)
def test_loopback_fp8_dispatch_schedules(env, monkeypatch):
    """Every launch path that passes the row size: the SM staging, the stage/pull split, the
    fill-first and speculative eager dispatches, the side-stream copy."""
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    for name in ("mixed", "t0_on_rank0", "all_to_one_expert"):
        for mode in ("plain", "static", "rows_per_expert"):
            run_loopback(check_fp8_case, 3, name, 41, "cuda", mode, timeout=300)


@gpu
@pytest.mark.parametrize("env", [pytest.param({}, id="default"),
                                 pytest.param({"MOK_DISPATCH_CE_STAGE": "0"}, id="dispatch_sm_staging")])
def test_loopback_fp8_dispatch_wraps_the_ring(env, monkeypatch):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    rows, ring = run_loopback(fp8_ring_wrap, 3, 60, timeout=600)[0]
    assert rows > 0 and ring > 0


@pytest.mark.parametrize("world_size", [
    pytest.param(2, marks=[pytest.mark.gpu, pytest.mark.multigpu])])
@pytest.mark.parametrize("mode", MODES)
def test_cuda_fp8_dispatch(mode, world_size):
    for name in FP8_CASES:
        for block in (BLOCK, 8):
            run_distributed(check_fp8_case, world_size, name, 51, "cuda", mode, torch.float32,
                            compare_reference=True, block=block, backend="nccl", timeout=300)


def prob_grads_only(rank, world_size, calls, chunks=None, T_max=256, num_sms=None):
    """The narrow combine that carries only the prob gradients (``combine_prob_grads``: the FP8
    dispatch's backward) against a full combine's ``grad_topk_weights`` and against each slot's
    expected value, bitwise, over ``calls`` calls of varying sizes (a rank with no tokens, unrouted
    slots, one expert for every row, duplicate experts among them). ``chunks``: a combine ring of
    that many chunks, so that calls wrap it (the role split); else the phased combine, whose
    narrow call takes a lane per task and per token (the full one a warp). ``num_sms``: the
    Buffer's (1: 512 lanes, fewer than a large call's tokens, so lanes take several)."""
    from test_cuda_backend import mok_buffer, ring_chunk_bytes

    dev = rank_device(rank)
    H, K, E = 256, 4, 4 * world_size
    kw = {"ring_bytes": chunks * max(ring_chunk_bytes(H, K))} if chunks else {}
    if num_sms is not None:
        kw["num_sms"] = num_sms
    buf = mok_buffer(E, H, K, T_max, torch.bfloat16, "cuda", dev, timeout_s=30, **kw)
    g = torch.Generator().manual_seed(91)                      # the same sizes on every rank
    cases = ("mixed", "unrouted", "one_expert", "duplicate", "skewed")
    for i in range(calls):
        T_all = [int(v) for v in torch.randint(1, T_max + 1, (world_size,), generator=g)]
        T_all[0] = 0 if i % 4 == 1 else T_all[0]
        T_all = [T_max] * world_size if i == 2 else T_all
        x, idx, w = make_inputs(3000 + i, world_size, T_all, E, H, K, torch.bfloat16, case=cases[i % 5],
                                device=dev)[rank]
        res = buf.dispatch(x, idx, w)
        backend = buf._backend_for(x)
        # Each row's gradient: its prob times a value naming its source token, so a slot's
        # gradient names both the token and the slot (the weights differ across slots).
        gp = res.probs * prob_grad_signal(res.src_rank, res.src_token)
        narrow = backend.combine_prob_grads(res.handle, gp)
        _, full = backend.combine(res.tokens, res.handle, grad_probs=gp)
        mine = prob_grad_signal(torch.full_like(idx, rank), torch.arange(idx.shape[0], device=dev).view(-1, 1).expand_as(idx))
        want = torch.where(idx >= 0, w * mine, torch.zeros_like(mine))
        tag = f"call {i} T={T_all} rank {rank}/{world_size} ring chunks {chunks}"
        assert narrow.shape == (T_all[rank], K) and narrow.dtype == torch.float32, tag
        assert_bitwise(narrow, full, f"narrow vs full combine {tag}")
        assert_bitwise(narrow, want, f"narrow combine vs expected {tag}")
    buf.check_errors()
    buf.destroy()
    return True


@gpu
@pytest.mark.parametrize("world_size", (1, 2, 3))
@pytest.mark.parametrize("chunks", (None, 3), ids=("phased", "ring_wraps"))
def test_loopback_prob_grads_only_combine(world_size, chunks):
    assert run_loopback(prob_grads_only, world_size, 12, chunks, timeout=300) == [True] * world_size


@gpu
@pytest.mark.parametrize("world_size", (1, 3))
def test_loopback_prob_grads_only_combine_one_block(world_size):
    # 1 SM: 512 lanes for up to 1100 tokens per rank (and up to 2200 remote tasks at W = 3)
    assert run_loopback(prob_grads_only, world_size, 6, None, 1100, 1, timeout=300) == [True] * world_size


@gpu
def test_loopback_prob_grads_only_combine_role_split(monkeypatch):
    monkeypatch.setenv("MOK_COMBINE_PHASED", "0")
    assert run_loopback(prob_grads_only, 2, 8, timeout=300) == [True] * 2


def _mismatch_case(rank, world_size, max_recv_tokens=None):
    """The row-format mismatch tests' Buffer (H = 64, K = 2, two experts per rank; a 10 s
    timeout: a hang is the failure they look for) and this rank's 16 tokens of seed 4."""
    from test_cuda_backend import mok_buffer

    dev = rank_device(rank)
    E = 2 * world_size
    buf = mok_buffer(E, 64, 2, 16, torch.bfloat16, "cuda", dev, timeout_s=10, max_recv_tokens=max_recv_tokens)
    x, idx, w = make_inputs(4, world_size, [16] * world_size, E, 64, 2, torch.bfloat16, device=dev)[rank]
    return buf, x, idx, w


def fp8_on_one_rank_only(rank, world_size, static):
    """Rank 0 dispatches an FP8 pair while its peers dispatch bf16 tokens (a caller's bug: the
    ranks would read each other's rings at different row sizes). Every rank's layout compares
    the row size its peers published with the routing: every rank must raise, none hang."""
    buf, x, idx, w = _mismatch_case(rank, world_size, 16 * 2 * world_size if static else None)
    with pytest.raises(RuntimeError, match="rows of different sizes"):
        buf.dispatch(fp8.quantize(x, BLOCK) if rank == 0 else x, idx, w)
        buf.check_errors()
    return True


@gpu
@pytest.mark.parametrize("world_size", (2, 3))
@pytest.mark.parametrize("static", (False, True), ids=("eager", "static"))
def test_loopback_fp8_on_one_rank_only_is_an_error(world_size, static):
    assert run_loopback(fp8_on_one_rank_only, world_size, static, timeout=120) == [True] * world_size


def fp8_cached_on_one_rank_only(rank, world_size):
    """The same mistake in a cached dispatch, which runs no layout: every rank dispatches tokens,
    then rank 0 dispatches an FP8 pair along the handle while its peers dispatch tokens. The
    consumers compare the row size each dispatch ring slot was staged with (carried in the slot's
    ready value) with their own: every rank must raise, none hang."""
    buf, x, idx, w = _mismatch_case(rank, world_size)
    res = buf.dispatch(x, idx, w)
    settle(x.device)
    # The premise: rank 0 reads a peer's rows and every peer reads rank 0's, so every rank pulls
    # at least one chunk staged at a row size other than its own.
    src = res.src_rank.cpu()
    assert bool((src != 0).any()) if rank == 0 else bool((src == 0).any()), f"rank {rank}: {src.tolist()}"
    with pytest.raises(RuntimeError, match="rows of different sizes"):
        buf.dispatch(fp8.quantize(x, BLOCK) if rank == 0 else x, handle=res.handle)
        buf.check_errors()
    return True


@gpu
@pytest.mark.parametrize("world_size", (2, 3))
@pytest.mark.parametrize("env", [pytest.param({}, id="default"),
                                 pytest.param({"MOK_DISPATCH_CE_STAGE": "0"}, id="dispatch_sm_staging")])
def test_loopback_fp8_cached_on_one_rank_only_is_an_error(world_size, env, monkeypatch):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert run_loopback(fp8_cached_on_one_rank_only, world_size, timeout=120) == [True] * world_size


def fp8_sources_differ(rank, world_size, cached):
    """Every rank dispatches the same kind of FP8 pair with the same row size, but rank 0 hands
    its rows over packed (one source) while its peers' are read in place (two sources): the ring
    rows then lie in different layouts (packed rows against two planes per slot). The layout's
    published row format (routed) and each ring slot's tag (cached) carry the choice: every rank
    must raise, none hang. (The Buffer makes the same choice on every rank; this calls the
    autograd functions directly to break that.)"""
    from megatron_mok.autograd.functions import CachedDispatchFunction, DispatchFunction

    buf, x, idx, w = _mismatch_case(rank, world_size)
    q, s = fp8.quantize(x, BLOCK)                       # 64 + 16 bytes: two sources allowed
    rows = fp8.pack(q, s) if rank == 0 else fp8.dispatch_rows(q, s)
    assert isinstance(rows, fp8.PairRows) == (rank != 0)
    backend = buf._backend_for(x)
    with pytest.raises(RuntimeError, match="rows of different sizes or layouts"):
        if cached:
            res = buf.dispatch(x, idx, w)
            CachedDispatchFunction.apply(backend, res.handle, rows)
        else:
            DispatchFunction.apply(backend, [], rows, w, idx, None)
        buf.check_errors()
    return True


@gpu
@pytest.mark.parametrize("world_size", (2, 3))
@pytest.mark.parametrize("cached", (False, True), ids=("routed", "cached"))
def test_loopback_fp8_packed_on_one_rank_in_place_on_the_others_is_an_error(world_size, cached):
    assert run_loopback(fp8_sources_differ, world_size, cached, timeout=120) == [True] * world_size


def fp8_in_place_equals_packed(rank, world_size):
    """The same pairs dispatched read in place (two sources) and packed first (one source), on
    one Buffer, eager, static and cached: the received rows are bitwise the same. Ranks with no
    tokens and unrouted slots included (the case mix below)."""
    from megatron_mok.autograd.functions import CachedDispatchFunction, DispatchFunction
    from test_cuda_backend import mok_buffer

    dev = rank_device(rank)
    E, H, K = 4 * world_size, 256, 4
    T_all = [0, 37, 61, 1][:world_size] if world_size > 1 else [37]
    bufs = [mok_buffer(E, H, K, 64, torch.bfloat16, "cuda", dev, timeout_s=30, **kw)
            for kw in ({}, {"max_recv_tokens": 64 * K * world_size})]
    for it, case in enumerate(("random", "mixed", "one_expert")):
        inputs = make_inputs(900 + it, world_size, T_all, E, H, K, torch.bfloat16, case=case, device=dev)
        x, idx, w = inputs[rank]
        q, s = fp8.quantize(x, 16)
        assert isinstance(fp8.dispatch_rows(q, s), fp8.PairRows)
        for buf in bufs:
            backend = buf._backend_for(x)
            h1, h2 = [], []
            a, _ = DispatchFunction.apply(backend, h1, fp8.dispatch_rows(q, s), w, idx, None)
            b, _ = DispatchFunction.apply(backend, h2, fp8.pack(q, s), w, idx, None)
            c = CachedDispatchFunction.apply(backend, h1[0], fp8.dispatch_rows(q, s))
            settle(dev)
            assert_bitwise(a, b, f"in place vs packed, {case}, rank {rank}")
            assert_bitwise(c, b, f"cached in place vs packed, {case}, rank {rank}")
            buf.check_errors()
    for buf in bufs:
        buf.destroy()
    return True


@gpu
@pytest.mark.parametrize("world_size", (1, 2, 4))
@pytest.mark.parametrize("env", [pytest.param({}, id="default"),
                                 pytest.param({"MOK_DISPATCH_CE_STAGE": "0"}, id="dispatch_sm_staging")])
def test_loopback_fp8_in_place_equals_packed(world_size, env, monkeypatch):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert run_loopback(fp8_in_place_equals_packed, world_size, timeout=300) == [True] * world_size


# The process twins (2 GPUs, or shared-GPU mode): copy-engine staging across processes, IPC peers.
@pytest.mark.parametrize("world_size", [
    pytest.param(2, marks=[pytest.mark.gpu, pytest.mark.multigpu])])
@pytest.mark.parametrize("cached", (False, True), ids=("routed", "cached"))
def test_cuda_fp8_packed_on_one_rank_in_place_on_the_others_is_an_error(world_size, cached):
    run_distributed(fp8_sources_differ, world_size, cached, backend="nccl", timeout=120, fresh=True)


@pytest.mark.parametrize("world_size", [
    pytest.param(2, marks=[pytest.mark.gpu, pytest.mark.multigpu])])
def test_cuda_fp8_in_place_equals_packed(world_size):
    assert run_distributed(fp8_in_place_equals_packed, world_size, backend="nccl",
                           timeout=300) == [True] * world_size


@pytest.mark.parametrize("world_size", [
    pytest.param(2, marks=[pytest.mark.gpu, pytest.mark.multigpu])])
def test_cuda_fp8_on_one_rank_only_is_an_error(world_size):
    run_distributed(fp8_on_one_rank_only, world_size, False, backend="nccl", timeout=120, fresh=True)


@pytest.mark.parametrize("world_size", [
    pytest.param(2, marks=[pytest.mark.gpu, pytest.mark.multigpu])])
def test_cuda_fp8_cached_on_one_rank_only_is_an_error(world_size):
    run_distributed(fp8_cached_on_one_rank_only, world_size, backend="nccl", timeout=120, fresh=True)

"""Bad inputs raise before any communication, with the error type the contract names and a
message naming the argument (docs/CONTRACT.md, "Errors")."""

import time

import pytest
import torch

import megatron_mok as mok
from harness import make_inputs, run_distributed, small_buffer

E, H, K, T_MAX = 4, 16, 2, 8


make_buf = small_buffer  # bfloat16, E=4, H=16, K=2, T_max=8 (the constants above)


def good(T=5, dtype=torch.bfloat16):
    (x, idx, w), = make_inputs(11, 1, [T], E, H, K, dtype)
    return x, idx, w


# ------------------------------------------------------------------------------ dispatch
DISPATCH_BAD = {
    # name: (make (x, idx, w) from good ones, error type, message pattern)
    "x_dtype": (lambda x, i, w: (x.float(), i, w), TypeError, r"x must have the Buffer's dtype"),
    "x_not_tensor": (lambda x, i, w: (x.tolist(), i, w), TypeError, r"x must be a torch.Tensor"),
    "x_1d": (lambda x, i, w: (x.reshape(-1), i, w), ValueError, r"x must be \[T, hidden=16\]"),
    "x_hidden_differs": (lambda x, i, w: (torch.zeros(5, H + 1, dtype=x.dtype), i, w), ValueError,
                         r"x must be \[T, hidden=16\], got \(5, 17\)"),
    "x_too_many_tokens": (lambda x, i, w: (torch.zeros(T_MAX + 1, H, dtype=x.dtype),
                                           torch.zeros(T_MAX + 1, K, dtype=torch.int64),
                                           torch.zeros(T_MAX + 1, K)), ValueError,
                          r"x has T=9 tokens, more than max_tokens_per_rank=8"),
    "x_non_contiguous": (lambda x, i, w: (torch.zeros(5, 2 * H, dtype=x.dtype)[:, ::2], i, w),
                         ValueError, r"x must be contiguous"),
    "idx_float": (lambda x, i, w: (x, i.float(), w), TypeError, r"topk_idx must be int32 or int64"),
    "idx_int16": (lambda x, i, w: (x, i.to(torch.int16), w), TypeError, r"topk_idx must be int32 or int64"),
    "idx_rows_differ": (lambda x, i, w: (x, i[:4], w), ValueError, r"topk_idx must be \[T=5, topk=2\]"),
    "idx_topk_differs": (lambda x, i, w: (x, torch.cat([i, i[:, :1]], 1), w), ValueError,
                         r"topk_idx must be \[T=5, topk=2\], got \(5, 3\)"),
    "idx_expert_eq_E": (lambda x, i, w: (x, torch.where(i == i[0, 0], torch.full_like(i, E), i), w),
                        ValueError, r"topk_idx .*outside \[-1, num_experts=4\)"),
    "idx_expert_lt_minus1": (lambda x, i, w: (x, torch.where(i == i[0, 0], torch.full_like(i, -2), i), w),
                             ValueError, r"topk_idx .*outside \[-1, num_experts=4\)"),
    "w_bf16": (lambda x, i, w: (x, i, w.bfloat16()), TypeError, r"topk_weights must be float32"),
    "w_float64": (lambda x, i, w: (x, i, w.double()), TypeError, r"topk_weights must be float32"),
    "w_shape": (lambda x, i, w: (x, i, w[:, :1].contiguous()), ValueError,
                r"topk_weights must be \[T=5, topk=2\]"),
    "idx_device": (lambda x, i, w: (x, i.to("meta"), w), ValueError, r"topk_idx is on meta but x is on cpu"),
    "w_device": (lambda x, i, w: (x, i, w.to("meta")), ValueError, r"topk_weights is on meta but x is on cpu"),
}


@pytest.mark.parametrize("name", list(DISPATCH_BAD))
def test_dispatch_rejects(name):
    make, exc, pattern = DISPATCH_BAD[name]
    buf = make_buf()
    with pytest.raises(exc, match=pattern):
        buf.dispatch(*make(*good()))
    # the Buffer still works afterwards
    res = buf.dispatch(*good())
    assert res.tokens.shape == (10, H)


def test_dispatch_rejects_tensors_on_another_device_than_the_buffer():
    buf = make_buf(device=torch.device("meta"))
    with pytest.raises(ValueError, match=r"x is on cpu, but this Buffer works on meta"):
        buf.dispatch(*good())


def test_valid_edge_values_are_accepted():
    buf = make_buf()
    x, idx, w = good()
    idx = idx.clone()
    idx[0, 0], idx[1, 1] = -1, E - 1
    res = buf.dispatch(x, idx.to(torch.int32), w)
    assert res.tokens.shape[0] == 9
    res = buf.dispatch(torch.zeros(T_MAX, H, dtype=torch.bfloat16),
                       torch.zeros(T_MAX, K, dtype=torch.int64), torch.zeros(T_MAX, K))
    assert res.tokens.shape[0] == 2 * T_MAX


# ------------------------------------------------------------------------------- combine
def test_combine_rejects_bad_expert_out():
    buf = make_buf()
    res = buf.dispatch(*good())
    R = res.tokens.shape[0]
    cases = [
        (res.tokens.float(), TypeError, r"expert_out must have the Buffer's dtype"),
        (res.tokens.tolist(), TypeError, r"expert_out must be a torch.Tensor"),
        (res.tokens[:-1], ValueError, rf"expert_out must be \[{R}, 16\].*got \({R - 1}, 16\)"),
        (torch.zeros(R, H + 2, dtype=torch.bfloat16), ValueError, r"expert_out must be \[.*got"),
        (torch.zeros(H, R, dtype=torch.bfloat16).t(), ValueError, r"expert_out must be contiguous"),
        (res.tokens.to("meta"), ValueError, r"expert_out is on meta, but this Buffer works on cpu"),
    ]
    for eo, exc, pattern in cases:
        with pytest.raises(exc, match=pattern):
            buf.combine(eo, res.handle)
    y = buf.combine(res.tokens, res.handle)       # and the good call still works
    assert y.shape == (5, H)


def test_combine_rejects_handle_of_another_buffer():
    a, b = make_buf(), make_buf()
    res = a.dispatch(*good())
    with pytest.raises(ValueError, match=r"handle was made by another Buffer"):
        b.combine(res.tokens, res.handle)
    with pytest.raises(TypeError, match=r"handle must be a DispatchHandle"):
        a.combine(res.tokens, (res.src_rank, res.src_token))


def test_destroyed_buffer_raises():
    buf = make_buf()
    res = buf.dispatch(*good())
    buf.destroy()
    buf.destroy()                                   # idempotent
    with pytest.raises(RuntimeError, match=r"destroyed"):
        buf.dispatch(*good())
    with pytest.raises(RuntimeError, match=r"destroyed"):
        buf.combine(res.tokens, res.handle)


# -------------------------------------------------------------------------------- Buffer
BUFFER_BAD = [
    (dict(num_experts=0), ValueError, r"num_experts must be a positive int"),
    (dict(hidden=0), ValueError, r"hidden must be a positive int"),
    (dict(topk=0), ValueError, r"topk must be an int in \[1, num_experts=4\]"),
    (dict(topk=E + 1), ValueError, r"topk must be an int in \[1, num_experts=4\]"),
    (dict(max_tokens_per_rank=-1), ValueError, r"max_tokens_per_rank must be an int >= 0"),
    (dict(dtype=torch.float64), TypeError, r"dtype must be one of"),
    (dict(dtype=torch.int32), TypeError, r"dtype must be one of"),
    (dict(combine_partial_dtype=torch.float64), TypeError, r"combine_partial_dtype must be"),
    (dict(combine_partial_dtype=torch.float16), TypeError, r"combine_partial_dtype must be"),
    (dict(backend="nccl"), ValueError, r"backend must be one of"),
    (dict(max_recv_tokens=-1), ValueError, r"max_recv_tokens must be None or an int >= 0"),
]


@pytest.mark.parametrize("kw,exc,pattern", BUFFER_BAD, ids=[next(iter(c[0])) + "_" + str(i)
                                                          for i, c in enumerate(BUFFER_BAD)])
def test_buffer_rejects(kw, exc, pattern):
    with pytest.raises(exc, match=pattern):
        make_buf(**kw)


def test_group_without_torch_distributed():
    with pytest.raises(ValueError, match=r"torch.distributed is not initialised"):
        mok.Buffer(object(), num_experts=E, hidden=H, topk=K, max_tokens_per_rank=T_MAX)


# ----------------------------------------------------------------------- with real peers
def _experts_not_divisible(rank, world_size):
    for bad_e in (world_size + 1, 3 * world_size - 1):
        with pytest.raises(ValueError, match=rf"num_experts={bad_e} is not divisible by the "
                                             rf"group size {world_size}"):
            mok.Buffer(None, num_experts=bad_e, hidden=H, topk=1, max_tokens_per_rank=T_MAX)
    buf = mok.Buffer(None, num_experts=2 * world_size, hidden=H, topk=1, max_tokens_per_rank=T_MAX)
    return (buf.rank, buf.world_size, buf.num_local_experts)


@pytest.mark.parametrize("world_size", [2, 4])
def test_experts_not_divisible_by_world_size(world_size):
    got = run_distributed(_experts_not_divisible, world_size)
    assert got == [(r, world_size, 2) for r in range(world_size)]


def _bad_rank_raises_alone(rank, world_size):
    """The last rank passes bad input, its peers good input to the same dispatch: the bad rank
    raises the input error at once, naming the argument, before anything of its input is sent;
    it stops its Buffer in place of the call, so its peers raise ``MokPeerStopped`` naming it
    (the reference backend's first exchange, docs/CONTRACT.md "Errors") instead of waiting, and
    its next call refuses, naming the first error. A new Buffer on every rank then works (no
    collective was left pending)."""
    import torch.distributed as dist

    from megatron_mok.cuda.errors import MokPeerStopped

    def make():
        return mok.Buffer(None, num_experts=2 * world_size, hidden=H, topk=K,
                          max_tokens_per_rank=T_MAX, backend="reference")

    x, idx, w = make_inputs(3, world_size, [5] * world_size, 2 * world_size, H, K, torch.bfloat16)[rank]
    bad_rank = world_size - 1
    bad = [
        ((x.float(), idx, w), TypeError, "x must have"),
        ((x, idx, w[:, :1].contiguous()), ValueError, "topk_weights must be"),
        ((x, torch.full_like(idx, 2 * world_size), w), ValueError, "outside"),
        ((torch.zeros(T_MAX + 1, H, dtype=x.dtype), torch.zeros(T_MAX + 1, K, dtype=torch.int64),
          torch.zeros(T_MAX + 1, K)), ValueError, "max_tokens_per_rank"),
    ]
    t0 = time.monotonic()
    for args, exc, pattern in bad:
        buf = make()
        if rank == bad_rank:
            with pytest.raises(exc, match=pattern):
                buf.dispatch(*args)
            with pytest.raises(RuntimeError, match=f"stopped on rank {rank}.*{pattern}"):
                buf.dispatch(x, idx, w)      # refused at once (its peers know: no exchange)
        else:
            with pytest.raises(MokPeerStopped, match=f"rank {bad_rank} stopped this Buffer.*{pattern}"):
                buf.dispatch(x, idx, w)
    took = time.monotonic() - t0
    dist.barrier()
    # and everyone can still run a real dispatch/combine together, on a new Buffer
    buf = make()
    res = buf.dispatch(x, idx, w)
    y = buf.combine(res.tokens, res.handle)
    assert y.shape == x.shape
    return took


def test_errors_raise_before_communication():
    took = run_distributed(_bad_rank_raises_alone, 2, timeout=60)
    assert all(t < 10 for t in took), took


def _abort_in_world_of_one_keeps_the_buffer():
    buf = mok.Buffer(num_experts=E, hidden=H, topk=K, max_tokens_per_rank=T_MAX)
    x, idx, w = good()
    with pytest.raises(TypeError):
        buf.dispatch(x.float(), idx, w)
    buf.abort("asked")                 # nothing to stop: no peer
    return buf.dispatch(x, idx, w).tokens.shape


def test_an_error_in_a_world_of_one_does_not_stop_the_buffer():
    assert _abort_in_world_of_one_keeps_the_buffer() == (10, H)


def _combine_error_stops_the_rank(rank, world_size):
    """Rank 1's combine refuses its input (wrong R): its Buffer stops there, and rank 0, in the
    same combine, raises ``MokPeerStopped`` naming it (told in the combine's first exchange)."""
    import torch.distributed as dist

    from megatron_mok.cuda.errors import MokPeerStopped

    buf = mok.Buffer(None, num_experts=2 * world_size, hidden=H, topk=K, max_tokens_per_rank=T_MAX,
                     backend="reference")
    x, idx, w = make_inputs(4, world_size, [5] * world_size, 2 * world_size, H, K, torch.bfloat16)[rank]
    res = buf.dispatch(x, idx, w)
    out = None
    if rank == 1:
        with pytest.raises(ValueError):
            buf.combine(res.tokens[:-1] if res.tokens.shape[0] else res.tokens.new_zeros(1, H), res.handle)
        with pytest.raises(RuntimeError, match="stopped on rank 1"):
            buf.dispatch(x, idx, w)
        with pytest.raises(RuntimeError, match="stopped"):      # the backend refuses too (backward)
            buf._backends["reference"].combine(res.tokens, res.handle)
        buf.abort("again")                                         # idempotent
        out = buf._aborted
    else:
        with pytest.raises(MokPeerStopped, match="rank 1 stopped this Buffer.*ValueError"):
            buf.combine(res.tokens, res.handle)
    dist.barrier()
    return out


def test_a_combine_error_stops_the_buffer_on_that_rank():
    out = run_distributed(_combine_error_stops_the_rank, 2, timeout=60)
    assert out[1].startswith("ValueError: "), out


# ---------------------------------------------------------------------- CUDA not available
def test_cuda_backend_without_library_says_how_to_build():
    from megatron_mok.cuda import library

    if library.is_available():
        pytest.skip("the CUDA library is built here; see test_cuda_backend_without_gpu")
    with pytest.raises(RuntimeError, match=r"(?s)not built.*pip install --no-build-isolation -e \."):
        mok.Buffer(num_experts=E, hidden=H, topk=K, max_tokens_per_rank=T_MAX, backend="cuda")
    assert mok.available_backends() == ["reference"]
    # "auto" falls back to the reference backend instead of failing
    buf = mok.Buffer(num_experts=E, hidden=H, topk=K, max_tokens_per_rank=T_MAX, backend="auto")
    assert buf.backend == "reference"
    assert buf.dispatch(*good()).tokens.shape == (10, H)


def test_cuda_backend_without_gpu():
    from megatron_mok.cuda import library

    if not library.is_available():
        pytest.skip("the CUDA library is not built here; see test_cuda_backend_without_library_says_how_to_build")
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    with pytest.raises((RuntimeError, ValueError), match=r"(?i)cuda|gpu|device"):
        buf = mok.Buffer(num_experts=E, hidden=H, topk=K, max_tokens_per_rank=T_MAX, backend="cuda")
        buf.dispatch(*good())
    assert "cuda" not in mok.available_backends()

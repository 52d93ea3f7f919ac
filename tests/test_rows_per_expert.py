"""``Buffer.dispatch(rows_per_expert=N)``: every local expert gets exactly N rows, its received
rows then zero rows (docs/CONTRACT.md, "Fixed rows per expert"; Megatron's drop-and-pad).
Checked as a pure relayout of the plain dispatch, bitwise, forward and backward
(``harness.check_alignment_case`` with ``capacity_extra``), and the errors.

CPU (gloo, reference backend) here, at world sizes 1-3; the CUDA backend runs the same check
against its plain self and the reference in test_cuda_backend.py (world size 1, 2 GPUs) and
test_cuda_loopback.py (2-3 ranks on one GPU), with the overflow cases."""

import pytest
import torch

from harness import (ALIGNMENT_CASES, _buffer, check_alignment_case, contract_cases,
                     padded_row_positions, run_distributed, spec_inputs)

SEED = 8765


def _fixed_reference(rank, world_size, name, alignment, extra):
    spec = contract_cases(world_size)[name]
    return check_alignment_case(rank, world_size, spec, SEED + extra, "reference", alignment,
                                static_extra=2, capacity_extra=extra)


@pytest.mark.parametrize("alignment,extra", ((1, 0), (1, 5), (16, 0), (3, 7)))
@pytest.mark.parametrize("world_size", (1, 2, 3))
@pytest.mark.parametrize("name", ALIGNMENT_CASES)
def test_reference_rows_per_expert_is_a_relayout(name, world_size, alignment, extra):
    gaps = run_distributed(_fixed_reference, world_size, name, alignment, extra)
    if extra > 0:  # N is past every count: every expert of every rank has zero rows
        assert all(g >= extra for g in gaps), gaps


def test_padded_row_positions_fixed():
    pos, padded, R = padded_row_positions(torch.tensor([3, 0, 5]), 1, rows_per_expert=5)
    assert pos.tolist() == [0, 1, 2, 10, 11, 12, 13, 14]
    assert padded.tolist() == [5, 5, 5] and R == 15


def _case(name="random"):
    spec = contract_cases(1)[name]
    x, idx, w = spec_inputs(spec, 1, torch.float32, SEED)[0]
    return spec, x, idx, w


def test_every_expert_gets_n_rows_even_when_empty():
    spec, x, idx, w = _case()
    buf = _buffer(spec, torch.float32, "reference")
    res = buf.dispatch(x, idx, w, rows_per_expert=x.shape[0] * spec["K"])
    e_local = buf.num_local_experts
    assert res.tokens_per_expert.tolist() == [x.shape[0] * spec["K"]] * e_local
    assert res.tokens.shape[0] == e_local * x.shape[0] * spec["K"]
    # T = 0: every row is a zero row
    res0 = buf.dispatch(x[:0], idx[:0], w[:0], rows_per_expert=4)
    assert res0.tokens.shape[0] == 4 * e_local and not res0.tokens.any()
    assert (res0.src_rank == -1).all() and (res0.probs == 0).all()
    y = buf.combine(res0.tokens, res0.handle)
    assert y.shape == (0, spec["H"])


def test_overflow_is_an_error_naming_the_expert():
    spec, x, idx, w = _case("all_to_one_expert")
    buf = _buffer(spec, torch.float32, "reference")
    counts = buf.dispatch(x, idx, w).tokens_per_expert
    e = int(counts.argmax())
    with pytest.raises(RuntimeError, match=f"local expert {e} received {int(counts[e])} rows, more "
                                           f"than rows_per_expert={int(counts[e]) - 1}"):
        buf.dispatch(x, idx, w, rows_per_expert=int(counts[e]) - 1)
    # exactly the largest count fits
    res = buf.dispatch(x, idx, w, rows_per_expert=int(counts[e]))
    assert res.tokens_per_expert.tolist() == [int(counts[e])] * buf.num_local_experts


@pytest.mark.parametrize("bad", (-1, 2.0, True, "8"))
def test_bad_rows_per_expert_is_refused(bad):
    spec, x, idx, w = _case()
    buf = _buffer(spec, torch.float32, "reference")
    with pytest.raises(ValueError, match="rows_per_expert must be None or an int >= 0"):
        buf.dispatch(x, idx, w, rows_per_expert=bad)


def test_rows_per_expert_past_32_bit_row_indices_is_refused():
    spec, x, idx, w = _case()
    buf = _buffer(spec, torch.float32, "reference")
    e_local = buf.num_local_experts
    too_many = -(-2 ** 31 // e_local)                    # E_local x N >= 2^31
    with pytest.raises(ValueError, match=rf"rows_per_expert={too_many} makes {e_local * too_many} rows "
                                         rf"\(E_local={e_local} x N\), more than the layout's 32-bit"):
        buf.dispatch(x, idx, w, rows_per_expert=too_many)


def test_rows_per_expert_must_respect_alignment_and_static_capacity():
    spec, x, idx, w = _case()
    aligned = _buffer(spec, torch.float32, "reference", expert_alignment=16)
    with pytest.raises(ValueError, match="not a multiple of the Buffer's expert_alignment=16"):
        aligned.dispatch(x, idx, w, rows_per_expert=40)
    static = _buffer(spec, torch.float32, "reference", max_recv_tokens=10)
    with pytest.raises(ValueError, match="more than max_recv_tokens=10"):
        static.dispatch(x, idx, w, rows_per_expert=11)
    # E_local x N exactly max_recv_tokens fits (the bound is inclusive); one row less does not
    n = x.shape[0] * spec["K"]                      # room for every row on one expert
    e_local = spec["E"]                             # world size 1
    exact = _buffer(spec, torch.float32, "reference", max_recv_tokens=e_local * n)
    res = exact.dispatch(x, idx, w, rows_per_expert=n)
    assert res.tokens.shape[0] == e_local * n and res.tokens_per_expert.tolist() == [n] * e_local
    short = _buffer(spec, torch.float32, "reference", max_recv_tokens=e_local * n - 1)
    with pytest.raises(ValueError, match=f"more than max_recv_tokens={e_local * n - 1}"):
        short.dispatch(x, idx, w, rows_per_expert=n)


def test_cached_dispatch_takes_no_rows_per_expert():
    spec, x, idx, w = _case()
    buf = _buffer(spec, torch.float32, "reference")
    res = buf.dispatch(x, idx, w, rows_per_expert=64)
    with pytest.raises(ValueError, match="a cached dispatch reuses its handle's layout"):
        buf.dispatch(x, handle=res.handle, rows_per_expert=64)
    again = buf.dispatch(x, handle=res.handle)
    assert torch.equal(again.tokens, res.tokens)

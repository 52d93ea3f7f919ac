"""The reference backend against the independent oracle (docs/CONTRACT.md), bitwise, at
world sizes 1, 2 and 4 on CPU (gloo): rows and their order, probs, tokens_per_expert,
src_rank/src_token, combine in both partial-dtype modes for bf16/fp16/fp32, and
combine(dispatch(x)) == x * routed slots."""

import pytest
import torch

import oracle
from harness import (check_contract_case, contract_cases, make_inputs,
                     run_distributed)

WORLD_SIZES = (1, 2, 4)
CASE_NAMES = tuple(contract_cases(1))
SEED = 1234


def _run_case(rank, world_size, name, seed):
    spec = contract_cases(world_size)[name]
    return check_contract_case(rank, world_size, spec, seed, backend="reference")


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("name", CASE_NAMES)
def test_case_against_oracle(name, world_size):
    stats = run_distributed(_run_case, world_size, name, SEED + 17 * world_size)
    total = sum(s[str(torch.float32)] for s in stats)
    if sum(contract_cases(world_size)[name]["T"]) == 0:
        assert total == 0
    else:
        assert total > 0, "the case routed no row anywhere: it would test nothing"


def _odd_hidden(rank, world_size):
    # A hidden size no vector width divides (the reference has no alignment needs).
    spec = dict(T=[5, 8, 3, 6][:world_size], T_max=9, E=2 * world_size, H=7, K=2,
                case="mixed", idx_dtype=torch.int64)
    return check_contract_case(rank, world_size, spec, 99, backend="reference")


def test_odd_hidden_size():
    run_distributed(_odd_hidden, 2)


def _rows_come_from_the_right_tokens(rank, world_size):
    # Tokens carry their own identity, so a row holding another token's data is visible
    # even where random values might coincide.
    import megatron_mok as mok

    T, E, K, H = [6, 9, 4, 7][:world_size], 2 * world_size, 3, 4
    inputs = make_inputs(5, world_size, T, E, H, K, torch.float32, case="duplicate")
    x, idx, w = inputs[rank]
    x = torch.stack([torch.tensor([rank, t, 7.0, -1.0]) for t in range(T[rank])]) \
        if T[rank] else torch.zeros(0, H)
    buf = mok.Buffer(None, num_experts=E, hidden=H, topk=K, max_tokens_per_rank=max(T),
                     dtype=torch.float32, backend="reference")
    res = buf.dispatch(x, idx, w)
    assert res.tokens[:, 0].tolist() == res.src_rank.float().tolist()
    assert res.tokens[:, 1].tolist() == res.src_token.float().tolist()
    routing = oracle.route(inputs, E)
    # each row's expert really is in its source token's topk_idx, at the row's slot
    el = E // world_size
    for i, (e, s, t, k) in enumerate(routing[rank].rows):
        assert int(inputs[s][1][t, k]) == rank * el + e
        assert float(res.probs[i]) == float(inputs[s][2][t, k])
    assert int(res.tokens_per_expert.sum()) == res.tokens.shape[0] == res.handle.num_rows
    return res.tokens.shape[0]


@pytest.mark.parametrize("world_size", [2, 4])
def test_rows_come_from_the_right_tokens(world_size):
    rows = run_distributed(_rows_come_from_the_right_tokens, world_size)
    T = [6, 9, 4, 7][:world_size]
    # "duplicate" routes every slot: rows over all ranks == all slots
    assert sum(rows) == sum(T) * 3


def test_single_process_without_torch_distributed():
    """W = 1 with no process group at all (group=None, dist not initialised)."""
    import torch.distributed as dist

    import megatron_mok as mok

    assert not dist.is_initialized()
    spec = contract_cases(1)["mixed"]
    stats = check_contract_case(0, 1, spec, 7)
    assert stats[str(torch.float32)] > 0
    buf = mok.Buffer(num_experts=4, hidden=8, topk=2, max_tokens_per_rank=4)
    assert buf.backend == "reference" and buf.world_size == 1 and buf.rank == 0
    assert buf.dtype == torch.bfloat16 and buf.combine_partial_dtype == torch.bfloat16
    assert "reference" in mok.available_backends()


def test_zero_token_capacity_buffer():
    import megatron_mok as mok

    buf = mok.Buffer(num_experts=2, hidden=8, topk=1, max_tokens_per_rank=0, dtype=torch.float32)
    res = buf.dispatch(torch.zeros(0, 8), torch.zeros(0, 1, dtype=torch.int64), torch.zeros(0, 1))
    assert res.tokens.shape == (0, 8) and res.probs.shape == (0,)
    assert res.tokens_per_expert.tolist() == [0, 0]
    y = buf.combine(res.tokens, res.handle)
    assert y.shape == (0, 8) and y.dtype == torch.float32


def test_result_types_and_shapes():
    import megatron_mok as mok

    (x, idx, w), = make_inputs(3, 1, [10], 4, 16, 2, torch.bfloat16, idx_dtype=torch.int32)
    buf = mok.Buffer(num_experts=4, hidden=16, topk=2, max_tokens_per_rank=10)
    res = buf.dispatch(x, idx, w)
    assert isinstance(res, mok.DispatchResult) and isinstance(res.handle, mok.DispatchHandle)
    assert res.tokens.dtype == torch.bfloat16 and res.tokens.shape == (20, 16)
    assert res.probs.dtype == torch.float32 and res.probs.shape == (20,)
    for name in ("tokens_per_expert", "src_rank", "src_token"):
        assert getattr(res, name).dtype == torch.int64, name
    assert res.tokens_per_expert.tolist() == torch.bincount(idx.view(-1).long(), minlength=4).tolist()
    assert res.handle.num_tokens == 10 and res.handle.num_rows == 20
    # the inputs are not modified
    x2, idx2, w2 = make_inputs(3, 1, [10], 4, 16, 2, torch.bfloat16, idx_dtype=torch.int32)[0]
    assert torch.equal(x, x2) and torch.equal(idx, idx2) and torch.equal(w, w2)


def _zero_capacity(rank, world_size):
    import megatron_mok as mok

    buf = mok.Buffer(None, num_experts=2 * world_size, hidden=8, topk=1, max_tokens_per_rank=0,
                     dtype=torch.float32, backend="reference")
    x = torch.zeros(0, 8, requires_grad=True)
    res = buf.dispatch(x, torch.zeros(0, 1, dtype=torch.int64), torch.zeros(0, 1))
    y = buf.combine(res.tokens, res.handle)
    y.sum().backward()
    return (tuple(res.tokens.shape), res.tokens_per_expert.tolist(), tuple(y.shape), tuple(x.grad.shape))


def test_zero_token_capacity_with_peers():
    assert run_distributed(_zero_capacity, 2) == [((0, 8), [0, 0], (0, 8), (0, 8))] * 2

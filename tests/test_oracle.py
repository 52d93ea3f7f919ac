"""The oracle against values worked out by hand from docs/CONTRACT.md (it judges every
backend, so it is checked first), and the library against the same hand example."""

import pytest
import torch

import oracle
from harness import assert_bitwise, run_distributed

BF = torch.bfloat16

# W = 2, E = 4 (experts 0,1 on rank 0; 2,3 on rank 1), K = 3, T = 2 on each rank.
HAND_IDX = [
    torch.tensor([[3, 0, -1], [1, -1, -1]]),
    torch.tensor([[0, 0, 2], [2, 3, -1]]),      # token (1, 0) names expert 0 twice
]
HAND_ROWS = [
    # (local expert, src rank, src token, slot), in contract order
    [(0, 0, 0, 1), (0, 1, 0, 0), (0, 1, 0, 1), (1, 0, 1, 0)],
    [(0, 1, 0, 2), (0, 1, 1, 0), (1, 0, 0, 0), (1, 1, 1, 1)],
]
HAND_TPE = [[3, 1], [2, 2]]


def hand_inputs(dtype=BF, H=2):
    out = []
    for s in range(2):
        x = torch.tensor([[10.0 * s + t + 1] * H for t in range(2)]).to(dtype)
        w = (torch.arange(6, dtype=torch.float32).view(2, 3) + 1) / 8 + s
        out.append((x, HAND_IDX[s], w))
    return out


# Expert outputs chosen so the partial dtype decides the answer (bf16 ulp at 1.0 is 2^-7):
# token (1, 0) has rows 1, 2 on rank 0 (1.0 and 2^-8) and row 0 on rank 1 (2^-8).
#   default (bf16 partials): bf16(1 + 2^-8) ties to 1.0; y = bf16(1.0 + 2^-8) = 1.0
#   float32 partials:        y = bf16(1 + 2^-8 + 2^-8) = 1 + 2^-7 = 1.0078125
# Token (0, 1)'s only row is -0.0: summed from +0.0 it must come back as +0.0.
def hand_expert_out(dtype=BF, H=2):
    q = 2.0 ** -8
    eo0 = torch.tensor([[3.0] * H, [1.0] * H, [q] * H, [-0.0] * H]).to(dtype)
    eo1 = torch.tensor([[q] * H, [5.0] * H, [0.5] * H, [-2.0] * H]).to(dtype)
    return [eo0, eo1]


HAND_Y_DEFAULT = [
    [[0.5 + 3.0] * 2, [0.0] * 2],               # (0,0): rank0 row0 (3.0) + rank1 row2 (0.5)
    [[1.0] * 2, [5.0 - 2.0] * 2],               # (1,1): rank1 rows 1, 3
]
HAND_Y_FP32 = [
    [[3.5] * 2, [0.0] * 2],
    [[1.0078125] * 2, [3.0] * 2],
]


def test_route_by_hand():
    routing = oracle.route(hand_inputs(), 4)
    for d in range(2):
        assert routing[d].rows == HAND_ROWS[d]
        assert routing[d].tokens_per_expert == HAND_TPE[d]


def test_expected_dispatch_by_hand():
    inp = hand_inputs()
    exp = oracle.expected_dispatch(inp, 4, 0)
    assert exp["src_rank"].tolist() == [0, 1, 1, 0]
    assert exp["src_token"].tolist() == [0, 0, 0, 1]
    assert exp["tokens"][:, 0].tolist() == [1.0, 11.0, 11.0, 2.0]
    # probs: w[s][t, k] = (3t + k + 1) / 8 + s
    assert exp["probs"].tolist() == [2 / 8, 1 + 1 / 8, 1 + 2 / 8, 4 / 8]
    assert exp["tokens_per_expert"].tolist() == [3, 1]


@pytest.mark.parametrize("partial,want", [(BF, HAND_Y_DEFAULT), (torch.float32, HAND_Y_FP32)])
def test_expected_combine_by_hand(partial, want):
    routing = oracle.route(hand_inputs(), 4)
    eo = hand_expert_out()
    for s in range(2):
        y = oracle.expected_combine(routing, eo, s, 2, BF, partial)
        assert_bitwise(y, torch.tensor(want[s]).to(BF), f"owner {s}")
    assert_bitwise(oracle.expected_combine(routing, eo, 0, 2, BF, BF)[1], torch.zeros(2, dtype=BF),
                   "-0.0 row sums to +0.0")


def test_expected_grad_topk_weights_by_hand():
    routing = oracle.route(hand_inputs(), 4)
    gp = [torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([5.0, 6.0, 7.0, 8.0])]
    g0 = oracle.expected_grad_topk_weights(routing, gp, 0, 2, 3)
    g1 = oracle.expected_grad_topk_weights(routing, gp, 1, 2, 3)
    assert g0.tolist() == [[7.0, 1.0, 0.0], [4.0, 0.0, 0.0]]
    assert g1.tolist() == [[2.0, 3.0, 5.0], [6.0, 8.0, 0.0]]


def test_pipeline_reference_by_hand():
    inp = hand_inputs(torch.float32, H=1)
    gy = [torch.ones(2, 1), torch.ones(2, 1)]
    ref = oracle.pipeline_reference(inp, 4, gy, torch.float64)
    sc = [oracle.expert_scale(e, 4) for e in range(4)]
    w0 = inp[0][2].double().tolist()
    # y[0, 0] = x * (w[0,0,0] * scale(3) + w[0,0,1] * scale(0)); x[0, 0] = 1
    assert ref["y"][0][0, 0].item() == pytest.approx(w0[0][0] * sc[3] + w0[0][1] * sc[0], rel=1e-12)
    assert ref["grad_topk_weights"][0][0].tolist() == pytest.approx([sc[3], sc[0], 0.0], rel=1e-12)
    assert ref["grad_topk_weights"][0][1].tolist() == pytest.approx([2.0 * sc[1], 0.0, 0.0], rel=1e-12)
    assert ref["grad_x"][0][1, 0].item() == pytest.approx(w0[1][0] * sc[1], rel=1e-12)


# ---------------------------------------------------------------- the library, same example
def _hand_on_library(rank, world_size, partial):
    import megatron_mok as mok

    inp = hand_inputs()
    buf = mok.Buffer(None, num_experts=4, hidden=2, topk=3, max_tokens_per_rank=2, dtype=BF,
                     backend="reference", combine_partial_dtype=partial)
    res = buf.dispatch(*inp[rank])
    rows = HAND_ROWS[rank]
    assert res.src_rank.tolist() == [r[1] for r in rows]
    assert res.src_token.tolist() == [r[2] for r in rows]
    assert res.tokens_per_expert.tolist() == HAND_TPE[rank]
    y = buf.combine(hand_expert_out()[rank], res.handle)
    want = HAND_Y_DEFAULT if partial in (None, BF) else HAND_Y_FP32
    assert_bitwise(y, torch.tensor(want[rank]).to(BF), f"hand combine rank {rank}")
    buf.destroy()


@pytest.mark.parametrize("partial", [None, torch.float32])
def test_library_on_hand_example(partial):
    run_distributed(_hand_on_library, 2, partial)

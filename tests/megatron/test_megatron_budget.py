"""megatron-core 0.19's per-rank receive budget (``moe_expert_rank_capacity_factor``) with
``mok`` (``megatron_mok/megatron/budget.py``; workers: ``budget_workers.py``).

CPU (gloo, reference backend), megatron-core 0.16.1 and 0.19.2 (the factor set on the built
config: 0.16 has no such field):

- a full ``MoELayer`` at EP 2 (and EP 1) with the budget against the same layer without it,
  with Megatron's ``SequentialMLP`` (the kept rows only, output padded back) and with a
  stand-in for 0.19's fused ``TEGroupedMLP`` (all ``M`` rows, device counts; TE is not
  installable here): a generous factor gives bitwise the outputs and gradients without it; a
  tight one drops rows on EP rank 0 only, sets ``check_over_budget()`` there and not on rank
  1, and equals (1e-5) the layer without the budget whose experts' output rows past ``M`` are
  zeroed; ``reset_over_budget()`` clears the flag; with ``_comm_manager``'s factor ``None``
  (``PagedStashRunner``'s rerun) the step is bitwise the dropless one; every ``M`` is
  HybridEP's formula;
- megatron-core 0.19 only: Megatron's own ``PagedStashRunner`` around its schedule over a
  2-layer GPT with ``mok`` layers: the over-budget step is rerun without the budget, bitwise
  the step without the factor, the factor restored after; a generous step runs once. Its CUDA
  allocations and stream stood in on CPU (``budget_workers._paged_stash_on_cpu``).

GPU (``MOK_BACKEND=cuda``; written, not yet run): the same workers on one GPU (EP 1) and at EP
2 as two processes (two GPUs, or one with ``MOK_TEST_SHARED_GPU=1``).
"""

from __future__ import annotations

import importlib.util

import pytest

from harness import gpus_for, run_distributed

import budget_workers as BW

pytestmark = pytest.mark.megatron

_EP2_GPU = [pytest.mark.gpu, pytest.mark.multigpu,
            pytest.mark.skipif(not gpus_for(2), reason="needs 2 GPUs (or MOK_TEST_SHARED_GPU=1)")]


def _has_paged_stash() -> bool:
    try:
        return importlib.util.find_spec("megatron.core.transformer.moe.paged_stash") is not None
    except (ImportError, ValueError):
        return False


_NEEDS_RUNNER = pytest.mark.skipif(not _has_paged_stash(),
                                   reason="PagedStashRunner is megatron-core 0.19+")


def _check_layer(reports, world):
    _, tight = BW.factors(world)
    for r in reports:
        assert r["M"] == BW.hybridep_budget(40, 2, tight), r
    if world == 1:
        assert reports[0]["dropped"] and reports[0]["differs"], reports
        return
    # the skew: rank 0 receives more than its budget and drops, rank 1 fewer (but some) rows
    assert reports[0]["dropped"] and not reports[1]["dropped"], reports
    assert 0 < reports[1]["R"] < reports[1]["M"] < reports[0]["R"], reports
    # the drop shows in the outputs (rank 1's tokens among the dropped rows of rank 0)
    assert any(r["differs"] for r in reports), reports


@pytest.mark.parametrize("experts", ["sequential", "padded"])
@pytest.mark.parametrize("world", [1, 2])
def test_rank_budget_layer_cpu(world, experts):
    _check_layer(run_distributed(BW.layer_rank_budget, world, experts), world)


@_NEEDS_RUNNER
@pytest.mark.parametrize("world", [1, 2])
def test_paged_stash_runner_reruns_dropless_cpu(world):
    reports = run_distributed(BW.paged_stash_runner, world, backend="gloo", fresh=True,
                              timeout=300)
    for rank, r in enumerate(reports):
        # tight: budgeted attempt, then the rerun without the budget; generous: one attempt
        assert r["tight"]["attempts"] == 2 and r["generous"]["attempts"] == 1, r
        assert r["tight"]["budgets"] == [[True] * 4, [False] * 4], r   # 2 layers x 2 micro-batches
        assert r["generous"]["budgets"] == [[True] * 4], r
        assert not any(r["generous"]["flags"][0]), r
        first, rerun = r["tight"]["flags"]
        assert not any(rerun), r
        assert any(first) == (rank == 0), (rank, r)   # at EP 2 only rank 0 dropped


# ------------------------------------------------------------------------------- GPUs
@pytest.mark.parametrize("experts", ["sequential", "padded"])
@pytest.mark.parametrize("world", [pytest.param(1, marks=pytest.mark.gpu),
                                   pytest.param(2, marks=_EP2_GPU)])
def test_rank_budget_layer_gpu(world, experts):
    _check_layer(run_distributed(BW.layer_rank_budget, world, experts, "cuda", backend="nccl",
                                 fresh=True, timeout=300), world)


@_NEEDS_RUNNER
@pytest.mark.gpu
def test_paged_stash_runner_reruns_dropless_one_gpu():
    # the runner's own CUDA allocations (device='cuda') and stream, no stand-ins
    reports = run_distributed(BW.paged_stash_runner, 1, "cuda", backend="nccl", fresh=True,
                              timeout=300)
    r = reports[0]
    assert r["tight"]["attempts"] == 2 and r["generous"]["attempts"] == 1, r
    assert any(r["tight"]["flags"][0]) and not any(r["tight"]["flags"][1]), r


# The budget's helpers on their own (in-process, CPU): the layer tests above reach them only
# through workers, and never with a bad factor or experts that return too many rows.

@pytest.mark.parametrize("T,K,factor,align,want", [
    (10, 3, 1.5, 16, 48),          # int(45.0) = 45, up to 48
    (7, 2, 1.1, 4, 16),            # int(15.400000000000002) = 15, up to 16
    (64, 8, 1.0, 16, 512),         # already a multiple
    (0, 8, 2.0, 16, 0),            # no tokens: no rows
    (5, 1, 0.1, 1, 0),             # int(0.5) = 0
])
def test_rank_budget_is_int_then_rounded_up(T, K, factor, align, want):
    from megatron_mok.megatron.budget import rank_budget
    assert rank_budget(T, K, factor, align) == want


@pytest.mark.parametrize("factor", [0, -1.0, float("nan"), float("inf"), True, "1.5"])
def test_rank_budget_refuses_a_bad_factor(factor):
    from megatron_mok.megatron.budget import rank_budget
    from megatron_mok.megatron.config import MokConfigError
    with pytest.raises(MokConfigError, match="moe_expert_rank_capacity_factor must be"):
        rank_budget(10, 2, factor, 1)


def test_pad_rows_adds_zero_rows_and_drops_their_gradient():
    import torch
    from megatron_mok.megatron.budget import pad_rows
    rows = torch.randn(3, 4, requires_grad=True)
    assert pad_rows(rows, 3) is rows
    out = pad_rows(rows, 5)
    assert out.shape == (5, 4) and torch.equal(out[:3], rows) and not out[3:].any()
    grad = torch.randn(5, 4)
    out.backward(grad)
    assert torch.equal(rows.grad, grad[:3])
    with pytest.raises(ValueError, match=r"the experts returned 3 rows, more than the budget's 2"):
        pad_rows(rows, 2)

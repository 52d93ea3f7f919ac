"""The ``mok`` dispatcher in evaluation / generation-style use (workers: ``eval_workers.py``).

With ``transformer_impl="local"`` or ``"transformer_engine"`` Megatron keeps the configured
dispatcher for ``eval()`` / ``no_grad`` forwards (evaluation, RL rollouts); these check mok
there, as a full ``MoELayer`` against Megatron's ``alltoall`` (every expert local, same
weights), CPU (gloo, reference backend), EP = 2, fp32, within ``feature_workers.CPU_TOL``:

- a prefill, decode steps of 1-3 tokens (another count on each rank), a second prefill, each
  mok step bitwise its re-run; then a training step (output and every gradient) on the same
  Buffer. A 0-token step is run where Megatron's ``MoELayer`` takes a 0-token input; on
  0.16.1 / 0.19.2 it does not (its router's ``view(..., -1)`` fails on 0 elements, before
  the dispatcher), so those steps run 1 token;
- a decode step as the first dispatch fixes ``T_max`` small: a later prefill raises the
  ``ValueError`` naming ``MOK_MAX_TOKENS_PER_RANK``; with that set before the layer is built,
  the same sequence runs;
- each with its mutant (an alltoall expert weight x 1.001; the env var not set): must fail.

GPU (one GPU, world size 1, CUDA backend; run on the GPU machine): the same workers.
"""

from __future__ import annotations

import pytest

from harness import DistributedTestError, run_distributed

import eval_workers as W

pytestmark = pytest.mark.megatron


def _zero_ok() -> bool:
    ok, what = run_distributed(W.zero_token_input_accepted, 2)[0]
    return ok


def test_generation_eval_mok_vs_alltoall_cpu():
    zero_ok = _zero_ok()
    reports = run_distributed(W.layer_generation_vs_alltoall, 2, zero_ok=zero_ok)
    for rank, r in enumerate(reports):
        assert r["t_max"] == 24 and r["buffers"] == 1, r
        counts = [n for n, _, _ in r["steps"].values()]
        decode = [n if zero_ok else max(n, 1) for n in W.DECODE[rank]]
        assert counts == [24 - 4 * rank, *decode, 16 + 8 * rank], counts
        assert "grad:router.weight" in r["train_errors"]


def test_generation_eval_detects_a_wrong_expert_cpu():
    with pytest.raises(DistributedTestError, match="output, prefill"):
        run_distributed(W.layer_generation_vs_alltoall, 2, mutant=True)


def test_small_first_dispatch_then_prefill_cpu():
    reports = run_distributed(W.layer_small_first_dispatch, 2)
    for rank, r in enumerate(reports):
        assert "MOK_MAX_TOKENS_PER_RANK" in r["error"], r["error"]
        assert f"got {24 - 4 * rank} tokens on EP rank {rank}" in r["error"], r["error"]
        assert r["t_max"] == 24
        assert list(r["steps"]) == ["decode0", "prefill", "decode1", "prefill2"]


def test_small_first_dispatch_without_env_fails_cpu():
    with pytest.raises(DistributedTestError, match="MOK_MAX_TOKENS_PER_RANK"):
        run_distributed(W.layer_small_first_dispatch, 2, set_env=False)


@pytest.mark.gpu
def test_generation_eval_mok_vs_alltoall_one_gpu():
    reports = run_distributed(W.layer_generation_vs_alltoall, 1, "cuda", backend="nccl")
    assert reports[0]["t_max"] == 24 and reports[0]["buffers"] == 1


@pytest.mark.gpu
def test_small_first_dispatch_then_prefill_one_gpu():
    reports = run_distributed(W.layer_small_first_dispatch, 1, "cuda", backend="nccl")
    assert "MOK_MAX_TOKENS_PER_RANK" in reports[0]["error"] and reports[0]["t_max"] == 24


def test_one_rank_over_t_max_stops_its_peer_at_once_cpu():
    # The reference backend (gloo): rank 0 stops in place of the dispatch (the adapter's
    # Buffer.abort(skipped_call=True)); rank 1 finds that in the dispatch's first exchange and
    # raises MokPeerStopped with rank 0's reason, instead of waiting for gloo's timeout.
    reports = run_distributed(W.layer_one_rank_over_t_max, 2, timeout=240)
    (t0, m0), (t1, m1) = reports
    assert m0.startswith("ValueError") and "MOK_MAX_TOKENS_PER_RANK" in m0, m0
    assert m1.startswith("MokPeerStopped") and "rank 0 stopped this Buffer" in m1, m1
    assert "MOK_MAX_TOKENS_PER_RANK" in m1 and t1 < 20, (t1, m1)


@pytest.mark.multigpu
def test_one_rank_over_t_max_stops_its_peer_at_once_two_ranks():
    # Two processes (on one GPU in shared-GPU mode): rank 0 alone is over T_max. Its peer,
    # already in the dispatch, names it within seconds instead of timing out after 60 s.
    reports = run_distributed(W.layer_one_rank_over_t_max, 2, "cuda", backend="nccl", timeout=240)
    (t0, m0), (t1, m1) = reports
    assert m0.startswith("ValueError") and "MOK_MAX_TOKENS_PER_RANK" in m0, m0
    # A MokDevicePeerStopped (a MokDeviceError) quoting rank 0's own message (its stop note).
    assert m1.startswith("MokDevicePeerStopped"), m1
    assert "rank 0 stopped after an error of its own (MoK: this MoE layer got 24 tokens" in m1, m1
    assert "MOK_MAX_TOKENS_PER_RANK" in m1, m1
    assert "before publishing its routing" in m1 and t1 < 20, (t1, m1)

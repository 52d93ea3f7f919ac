"""Megatron-Core MoE features that change what the ``mok`` dispatcher is handed, each through
a full ``MoELayer`` against Megatron's ``alltoall`` (workers: ``feature_workers.py``).

CPU (gloo, reference backend), EP = 2, fp32; mok vs alltoall within 1e-5 as in
``test_megatron_dispatcher.py``'s full-layer test (another summation order; see
``feature_workers.CPU_TOL``):

- ``moe_latent_size`` (latent MoE): ``MoELayer`` projects hidden -> latent before the
  dispatch and back after the combine, so mok moves latent-width tokens and sizes its Buffer
  from them. Megatron builds the projections with TE's ``TELinear`` only; without TE a plain
  duplicated linear stands in (``feature_workers.DuplicatedLinear``): this tests the
  dispatcher's part, not TE.
- ``moe_apply_probs_on_input`` (top-1): the experts scale their input by ``permuted_probs``.
- ``moe_router_force_load_balancing`` and (0.19) ``moe_router_force_biased``: random router
  logits; the routing no longer depends on the input.
- ``moe_enable_routing_replay``: recorded and replayed top-k ids (a replayed step dispatches
  bitwise what the recorded one did; foreign ids reach the experts as given).
- ``moe_pad_experts_for_cuda_graph_inference``: Megatron's ``set_decode_expert_padding``
  switches a built dropless layer to drop-and-pad for graphed decode steps and back.

GPU (one GPU, world size 1, CUDA backend; run on the GPU machine): latent, top-1 probs on
the input and decode padding, the same workers.
"""

from __future__ import annotations

import pytest

from harness import run_distributed

import feature_workers as F

pytestmark = pytest.mark.megatron


def _skip_if_absent(reports):
    if "skipped" in reports[0]:
        pytest.skip(reports[0]["skipped"])


def test_latent_moe_mok_vs_alltoall_cpu():
    reports = run_distributed(F.layer_feature_vs_alltoall, 2, "latent")
    assert all(r["dispatched_width"] == 16 for r in reports)          # latent, not hidden (32)
    assert all("grad:fc2_latent_proj.weight" in r["errors"] for r in reports)


def test_apply_probs_on_input_mok_vs_alltoall_cpu():
    reports = run_distributed(F.layer_feature_vs_alltoall, 2, "apply_probs_on_input")
    # top-1: 8 x 3 tokens per rank, one route each
    assert sum(sum(r["tokens_per_expert"]) for r in reports) == 2 * 24


@pytest.mark.parametrize("feature", ["force_load_balancing", "force_biased"])
def test_random_router_logits_mok_vs_alltoall_cpu(feature):
    reports = run_distributed(F.layer_feature_vs_alltoall, 2, feature)
    _skip_if_absent(reports)
    assert sum(sum(r["tokens_per_expert"]) for r in reports) == 2 * 24 * 2


def test_routing_replay_cpu():
    reports = run_distributed(F.layer_routing_replay, 2)
    assert sum(sum(r["tokens_per_expert"]) for r in reports) == 2 * 24 * 2


def test_decode_expert_padding_cpu():
    reports = run_distributed(F.layer_decode_expert_padding, 2)
    assert all(r["N"] == 48 for r in reports)
    assert sum(r["routed_rows"] for r in reports) == 2 * 24 * 2


@pytest.mark.gpu
@pytest.mark.parametrize("feature", ["latent", "apply_probs_on_input"])
def test_feature_mok_vs_alltoall_one_gpu(feature):
    reports = run_distributed(F.layer_feature_vs_alltoall, 1, feature, "cuda", backend="nccl")
    assert reports[0]["errors"]


@pytest.mark.gpu
def test_decode_expert_padding_one_gpu():
    reports = run_distributed(F.layer_decode_expert_padding, 1, "cuda", backend="nccl")
    assert reports[0]["N"] == 24

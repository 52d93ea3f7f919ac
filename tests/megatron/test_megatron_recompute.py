"""Activation recomputation with the ``mok`` dispatcher (workers: ``recompute_workers.py``).

Recomputation re-runs a layer's forward, MoK's dispatch and combine included, inside the
backward pass, between the other layers' backward communication. Each test steps a 2-layer
bf16 ``GPTModel`` (local spec, a shared expert and a bf16 gate in both MoE layers) once with
``mok`` and no recomputation, once with ``mok`` and the recompute config, once with
``alltoall`` and the same config, and asserts:

- Megatron turned the config into that recompute (its per-layer flags);
- what ran again inside the backward pass: the dispatchers as often as the config re-runs MoE
  layers there (2 for ``recompute_modules=["moe"]`` (also with the shared expert overlapped),
  its deprecated spelling ``moe_layer_recompute`` and full/uniform; 1 for full/block with
  ``recompute_num_layers=1``; 0 for ``["shared_experts"]`` and ``["layernorm"]``, which do not
  re-run the dispatcher), and the shared experts, pre-MLP layernorms and (core) attentions as
  each config says (``RW.RERUN``); everything once per layer in the forward;
- ``mok`` with recompute: loss and every parameter gradient bitwise ``mok`` without;
- ``alltoall`` with the same recompute: bitwise on CPU (drop-and-pad: within bf16 tolerance),
  within bf16 tolerance on GPUs;
- negative controls (CPU): the same comparisons fail for a step on another batch or with one
  expert weight nudged, in the mok recompute model or in alltoall's (the bitwise comparisons
  and the drop-and-pad case's bf16 tolerance).

CPU: EP = 2 over gloo, MoK's reference backend. GPU (``MOK_BACKEND=cuda``): world size 1 on
one GPU (``gpu``) and EP = 2 (``multigpu``: two GPUs, or one with ``MOK_TEST_SHARED_GPU=1``),
through Megatron's ``forward_backward_no_pipelining``, the aux loss on. ``moe_act`` runs on
neither (grouped-GEMM experts only: the ``grouped_gemm`` package or Transformer Engine; see
``recompute_workers.py``).
"""

from __future__ import annotations

import pytest

from harness import run_distributed

import recompute_workers as RW

pytestmark = pytest.mark.megatron


def _check(reports, case):
    # what ran again in the backward (the worker asserts it too; here it shows in the report)
    for r in reports:
        back = {k.split(":")[0]: n for k, n in r["calls"].items() if k.endswith(":backward")}
        assert back == RW.RERUN[case], r
        assert r["calls"]["dispatch:forward"] == RW.NUM_LAYERS, r


@pytest.mark.parametrize("case", list(RW.CASES))
def test_recompute_cpu(case):
    reports = run_distributed(RW.gpt_recompute, 2, case, timeout=300)
    _check(reports, case)
    assert all(r["backend"] == "reference" for r in reports), reports


_EXPERT_W = "decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"


@pytest.mark.parametrize("case,control,expected", [
    ("selective_moe", {"batch_seed": 7}, "loss, mok with selective_moe vs without recompute"),
    ("selective_moe", {"perturb": ("mok_rc", _EXPERT_W)}, "vs without recompute"),
    ("selective_moe", {"perturb": ("a2a_rc", _EXPERT_W)},
     "alltoall vs mok, both with selective_moe (CPU)"),
    ("selective_moe_drop_and_pad", {"perturb": ("a2a_rc", _EXPERT_W, 1.25)},
     "mok vs alltoall (selective_moe_drop_and_pad)"),
], ids=["other-batch", "mok-weight-nudged", "alltoall-weight-nudged",
        "drop-and-pad-alltoall-weight-nudged"])
def test_recompute_cpu_negative_controls(case, control, expected):
    # The worker's comparisons do fail when the runs differ: the mok recompute step on another
    # batch, or one expert weight scaled by 1 + 2^-6 in the mok recompute model or in alltoall's;
    # the bf16 tolerance of the drop-and-pad case (rtol 1.6e-2) for a weight scaled by 1.25
    reports = run_distributed(RW.gpt_recompute, 2, case, timeout=300, **control)
    for r in reports:
        assert r["failed"] is not None and expected in r["failed"], r


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(RW.CASES))
def test_recompute_one_gpu(case):
    reports = run_distributed(RW.gpt_recompute, 1, case, "cuda", backend="nccl")
    _check(reports, case)
    assert reports[0]["backend"] == "cuda", reports


@pytest.mark.multigpu
@pytest.mark.parametrize("case", list(RW.CASES))
def test_recompute_gpu(case):
    reports = run_distributed(RW.gpt_recompute, 2, case, "cuda", backend="nccl")
    _check(reports, case)
    assert all(r["backend"] == "cuda" for r in reports), reports

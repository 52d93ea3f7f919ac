"""Megatron's stateful / combined load-balancing losses with the ``mok`` dispatcher:
``moe_router_load_balancing_type="global_aux_loss"`` (the router keeps running top-k token
counts over a global batch's micro-batches; ``finalize_model_grads`` resets them), alone and in
Megatron's list form together with ``"seq_aux_loss"`` (one coefficient per type; accepted by
megatron-core 0.16.1 and 0.19.2), through a full ``MoELayer`` against Megatron's ``alltoall``
(worker: ``aux_loss_workers.layer_aux_loss_vs_alltoall``).

What is compared, per micro-batch of 3 global batches x 2 micro-batches, with Megatron's
end-of-batch reset and an SGD step between global batches: output, input gradient, every
parameter gradient, each aux loss Megatron's log recorded, and (``global_aux_loss``) both
routers' running counts (bitwise, and against the recomputed top-k counts), ``ga_steps``, and
the logged loss against the switch loss of the running average; then the aux losses' gradient
alone (zero upstream gradient). Tolerances: ``feature_workers.CPU_TOL`` (1e-5) / ``GPU_TOL``
(1e-4) of each tensor's largest value, as the other full-layer feature tests.

GPU (one GPU, world size 1, NCCL, CUDA backend; run on the GPU machine; skipped without one):
``test_global_aux_loss_mok_vs_alltoall_one_gpu`` -- Megatron's own router, its buffers on the GPU
as it allocates them.

CPU (gloo, reference backend, EP = 1 and 2): the same worker. ``global_aux_loss``'s router
allocates its buffers on ``torch.cuda.current_device()`` in ``__init__``; on CPU the worker
makes that allocation land on the CPU while the layers are built (``router_buffers_on``), the
router's code otherwise Megatron's. ``seq_aux_loss`` alone needs no stand-in. Mutants of the mok
layer (a wrong probs gradient, the aux-loss gradient dropped, the router run twice per forward)
must make the same worker fail: the comparison is not vacuous.
"""

from __future__ import annotations

import pytest

from harness import run_distributed

import aux_loss_workers as A

pytestmark = pytest.mark.megatron

GLOBAL = "global_aux_loss"
SEQ_AND_GLOBAL = ("seq_aux_loss", "global_aux_loss")


def _check(reports, types, micro_batches=2, global_batches=3):
    types = [types] if isinstance(types, str) else list(types)
    names = sorted(A.TRACKED[t] for t in types)
    for r in reports:
        assert r["tracked_names"] == names, r["tracked_names"]
        assert len(r["tracked"]) == micro_batches * global_batches
        assert "grad:router.weight" in r["errors"] and "input_grad" in r["errors"], r["errors"]
        assert any(k.startswith("grad:experts.") for k in r["errors"]), sorted(r["errors"])
        assert all(f"tracked:{n}" in r["errors"] for n in names), sorted(r["errors"])
        if GLOBAL in types:
            assert r["ga_steps"] == [m + 1 for _ in range(global_batches)
                                     for m in range(micro_batches)], r["ga_steps"]


def test_balancing_config_forms_cpu():
    # the configs the tests build, as this megatron-core takes them (no process group needed):
    # a renamed or refused field fails here, not on the GPU machine
    from megatron_mok.megatron import harness as mh

    for types in (GLOBAL, list(SEQ_AND_GLOBAL), "seq_aux_loss"):
        for dispatcher in ("mok", "alltoall"):
            cfg = mh.moe_config(dispatcher, ep_size=1, num_experts=4, **A.balancing_kwargs(types))
            A.check_balancing_config(cfg, types)
    kw = A.balancing_kwargs(list(SEQ_AND_GLOBAL))
    assert kw["moe_aux_loss_coeff"] == [A.COEFF, A.COEFF]
    with pytest.raises(AssertionError, match="lost the balancing settings"):
        A.check_balancing_config(mh.moe_config("mok", ep_size=1, num_experts=4), GLOBAL)
    with pytest.raises(AssertionError, match="same length"):     # Megatron's own check
        mh.moe_config("mok", ep_size=1, num_experts=4, moe_aux_loss_coeff=[0.01],
                      moe_router_load_balancing_type=list(SEQ_AND_GLOBAL))


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("types", [GLOBAL, SEQ_AND_GLOBAL, "seq_aux_loss"],
                         ids=["global", "seq+global", "seq"])
def test_aux_loss_mok_vs_alltoall_cpu(world, types):
    _check(run_distributed(A.layer_aux_loss_vs_alltoall, world, types), types)


@pytest.mark.parametrize("mutant,fails_on", [
    # a gradient through the router reaches the input first (_compare's order)
    ("probs_grad", r"AssertionError: input_grad \(largest value"),
    ("aux_grad_dropped", r"AssertionError: input_grad \(largest value"),
    ("router_twice", r"AssertionError: tracked global_load_balancing_loss, step 0 micro 0"),
])
def test_aux_loss_comparison_catches_mutants_cpu(mutant, fails_on):
    # the worker the GPU test runs must fail when mok's layer is wrong (fresh ranks: a failed
    # comparison leaves them mid-test)
    with pytest.raises(AssertionError, match=fails_on):
        run_distributed(A.layer_aux_loss_vs_alltoall, 2, GLOBAL, None, mutant, fresh=True,
                        timeout=120)


@pytest.mark.gpu
@pytest.mark.parametrize("types", [GLOBAL, SEQ_AND_GLOBAL], ids=["global", "seq+global"])
def test_global_aux_loss_mok_vs_alltoall_one_gpu(types):
    reports = run_distributed(A.layer_aux_loss_vs_alltoall, 1, types, "cuda", backend="nccl")
    _check(reports, types)

"""Megatron's full-iteration CUDA graph (``FullCudaGraphWrapper``: one graph over the whole
forward-backward of a step) with ``mok`` drop-and-pad, which the adapter accepts
(``full_graph_workers.full_graph_train``: a 2-layer GPT, fresh batches every step, warm-up,
capture, replays, against the same model stepped by the bare schedule).

GPU (NCCL, CUDA backend): losses and every gradient bitwise equal to the eager steps at every
step, the dispatcher's Python never runs in a replay, the per-step device-error check runs
after each wrapper call, and a bad expert id planted in a replay is raised by that check.

CPU (gloo, reference backend): the same worker with ``torch.cuda``'s graph and stream pieces
stood in (a fake graph replays by calling the captured schedule again), so the plumbing runs
here; and the test of the test: one different batch in the graph run, or no capture at all,
fails the worker's assertions.
"""

from __future__ import annotations

import pytest

import harness
from harness import run_distributed

import full_graph_workers as FG

pytestmark = pytest.mark.megatron


@pytest.mark.parametrize("world", [1, 2])
def test_full_iteration_graph_plumbing_cpu(world):
    reports = run_distributed(FG.full_graph_train, world, backend="gloo", fresh=True, timeout=600)
    for r in reports:
        assert len(r["losses"]) == 7 and r["real_checks"] == [2, 2, 1, 1, 1, 1, 1], r
        assert r["error"].startswith("ValueError") and "outside [-1, num_experts" in r["error"], r


@pytest.mark.parametrize("case,needle", [
    (dict(perturb_step=4), "losses, step 4 (replay)"),    # one other batch in a replay step
    (dict(perturb_step=0), "losses, step 0 (warm-up)"),
    (dict(warmup=7), "dispatch calls per step"),           # the wrapper never captures
])
def test_full_iteration_graph_worker_can_fail_cpu(case, needle):
    with pytest.raises(AssertionError) as info:
        run_distributed(FG.full_graph_train, 1, backend="gloo", fresh=True, timeout=600, **case)
    assert needle in str(info.value), str(info.value)[-2000:]


# A MokDeviceError's type names as the workers record them (a peer's stop is its subclass).
DEVICE_ERRORS = ("MokDeviceError", "MokDevicePeerStopped")


@pytest.mark.gpu
def test_full_iteration_graph_one_gpu():
    reports = run_distributed(FG.full_graph_train, 1, backend_env="cuda", backend="nccl",
                              fresh=True, timeout=600)
    r = reports[0]
    assert r["dispatch_calls"] == [4, 4, 4, 0, 0, 0, 0], r     # none in the 4 replays
    assert r["error"].startswith(DEVICE_ERRORS), r


@pytest.mark.multigpu
@pytest.mark.skipif(harness.SHARED_GPU, reason="shared-GPU mode joins the ranks by gloo, whose "
                    "collectives (the loss's TP all-reduce) cannot be captured in a CUDA graph "
                    "(s34-1); needs 2 GPUs under NCCL")
def test_full_iteration_graph_gpu():
    reports = run_distributed(FG.full_graph_train, 2, backend_env="cuda", backend="nccl",
                              fresh=True, timeout=600)
    for r in reports:
        assert r["dispatch_calls"] == [4, 4, 4, 0, 0, 0, 0], r
        assert r["error"].startswith(DEVICE_ERRORS), r

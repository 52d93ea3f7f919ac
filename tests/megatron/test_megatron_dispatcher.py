"""Megatron's own dispatcher checks applied to ``mok``, and a full ``MoELayer`` A/B.

CPU (gloo, reference backend; runs in CI):
- Megatron's dropless round trip for EP = 1, 2, 4 (bitwise: topk is a power of two).
- The exact expert-major layout, ``tokens_per_expert`` and ``permuted_probs`` against every
  rank's seeded routing, and the gradients to ``x`` and the dense ``probs``.
- A full ``MoELayer`` with ``mok`` over EP=2 against Megatron's ``alltoall`` (EP=1, all
  experts local): outputs and all gradients agree; two ``mok`` runs are bitwise equal.
- ``moe_shared_expert_overlap``: the shared expert's overlap hooks are called in Megatron's
  order around the dispatch and the combine (a recording stand-in: CPU has no streams).
- The SM budget each layer gives its Buffer (48 without overlap, the Buffer default with it).
- ``moe_router_padding_for_quantization``: the Buffer pads each expert's rows to 16 (zero
  rows), the layer's output and gradients unchanged (bitwise on CPU; on GPUs below).

GPU (NCCL, CUDA backend; ``MOK_BACKEND=cuda`` so a missing build fails instead of falling
back): the same round trip and layout on 2 GPUs, and the full layer against ``alltoall`` over
the same EP=2 group in bf16. The same three at EP = 1 on ONE GPU (world size 1: every path of
the adapter and the CUDA backend except the NVLink exchange), for machines with one GPU.
Megatron's ``SharedExpertMLP`` overlapped on its own stream: bitwise the outputs and parameter
gradients of the unoverlapped layer, close to ``alltoall`` with the same overlap.
"""

from __future__ import annotations

import pytest

from harness import run_distributed

import mok_megatron_workers as W

pytestmark = pytest.mark.megatron


@pytest.mark.parametrize("ep_size,world", [(1, 2), (2, 2), (4, 4)])
def test_dropless_roundtrip_cpu(ep_size, world):
    rows = run_distributed(W.megatron_dropless_roundtrip, world, ep_size, "fp32", 2, 8)
    # 64 tokens x top-2 per rank: every routed row comes back to some rank
    assert sum(rows) == world * 64 * 2


def test_dropless_roundtrip_cpu_bf16_topk4():
    rows = run_distributed(W.megatron_dropless_roundtrip, 2, 2, "bf16", 4, 8)
    assert sum(rows) == 2 * 64 * 4


@pytest.mark.parametrize("ep_size,world,dtype", [(2, 2, "fp32"), (2, 2, "bf16"), (4, 4, "fp32")])
def test_dispatcher_layout_and_grads_cpu(ep_size, world, dtype):
    tpe = run_distributed(W.dispatcher_layout_and_grads, world, ep_size, dtype)
    assert all(len(t) == 4 for t in tpe)


def test_full_moe_layer_mok_vs_alltoall_cpu():
    names = run_distributed(W.layer_mok_vs_alltoall_cpu, 2)
    assert "router.weight" in names[0] and any("experts" in n for n in names[0])


@pytest.mark.parametrize("world", [1, 2])
def test_shared_expert_overlap_hooks_cpu(world):
    calls = run_distributed(W.shared_expert_overlap_hooks_cpu, world)
    assert all(c[2] == "mok.dispatch" for c in calls)


@pytest.mark.parametrize("world", [1, 2])
def test_layer_num_sms_cpu(world):
    sms = run_distributed(W.layer_num_sms_cpu, world)
    assert all(s == [48, None, 16, 48] for s in sms)


@pytest.mark.parametrize("world", [1, 2])
def test_router_padding_for_quantization_cpu(world):
    counts = run_distributed(W.layer_router_padding, world)
    assert all(c % 16 == 0 for per_rank in counts for c in per_rank)


@pytest.mark.multigpu
@pytest.mark.parametrize("topk", [2, 3])
def test_dropless_roundtrip_gpu(topk):
    run_distributed(W.megatron_dropless_roundtrip, 2, 2, "bf16", topk, 16, backend_env="cuda",
                    backend="nccl")


@pytest.mark.multigpu
def test_dispatcher_layout_and_grads_gpu():
    run_distributed(W.dispatcher_layout_and_grads, 2, 2, "bf16", backend_env="cuda",
                    backend="nccl")


@pytest.mark.multigpu
def test_full_moe_layer_mok_vs_alltoall_gpu():
    reports = run_distributed(W.layer_mok_vs_alltoall_gpu, 2, backend="nccl")
    assert "output" in reports[0]


@pytest.mark.gpu
@pytest.mark.parametrize("topk", [2, 3])
def test_dropless_roundtrip_one_gpu(topk):
    rows = run_distributed(W.megatron_dropless_roundtrip, 1, 1, "bf16", topk, 16, backend_env="cuda",
                           backend="nccl")
    assert rows == [64 * topk]


@pytest.mark.gpu
def test_dispatcher_layout_and_grads_one_gpu():
    tpe = run_distributed(W.dispatcher_layout_and_grads, 1, 1, "bf16", backend_env="cuda", backend="nccl")
    assert len(tpe[0]) == 4


@pytest.mark.gpu
def test_full_moe_layer_mok_vs_alltoall_one_gpu():
    reports = run_distributed(W.layer_mok_vs_alltoall_gpu, 1, backend="nccl")
    assert "output" in reports[0] and any(k.startswith("grad:") for k in reports[0])


@pytest.mark.gpu
@pytest.mark.parametrize("gate,comm_stream", [(False, "current"), (True, "current"), (False, "high")])
def test_shared_expert_overlap_one_gpu(gate, comm_stream):
    reports = run_distributed(W.layer_shared_expert_overlap_gpu, 1, gate, comm_stream, backend="nccl")
    assert "output" in reports[0] and any(k.startswith("grad:shared_experts.") for k in reports[0])


@pytest.mark.multigpu
@pytest.mark.parametrize("comm_stream", ["current", "high"])
def test_shared_expert_overlap_gpu(comm_stream):
    reports = run_distributed(W.layer_shared_expert_overlap_gpu, 2, False, comm_stream, backend="nccl")
    assert "output" in reports[0]


@pytest.mark.gpu
def test_router_padding_for_quantization_one_gpu():
    counts = run_distributed(W.layer_router_padding, 1, "cuda", backend="nccl")
    assert all(c % 16 == 0 for c in counts[0])


@pytest.mark.multigpu
def test_router_padding_for_quantization_gpu():
    counts = run_distributed(W.layer_router_padding, 2, "cuda", backend="nccl")
    assert all(c % 16 == 0 for per_rank in counts for c in per_rank)

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
- Drop-and-pad (``moe_pad_expert_input_to_capacity``) at EP = 1, 2, 4, capacity factors that
  drop routes (0.5) and that pad (2.0), both drop policies: the experts get ``capacity x EP``
  rows per local expert (the routed rows, then zero rows: the padding routes never cross the
  exchange) and ``tokens_per_expert`` on the host, as from Megatron's ``alltoall`` with
  drop-and-pad, whose outputs and gradients mok's match within 1e-5 (fp32). Not asserted
  bitwise, though they are on the CPU this was written on: alltoall's padding rows are real
  tokens with prob 0 placed among the routed rows (token order), mok's are zero rows after
  them, so each expert GEMM sees other rows and another row order, and nothing promises that
  a row's result or a weight-gradient sum is independent of those. Against mok with the same
  capacity factor and no padding (and with the padding rows aligned to 16 for FP8): bitwise,
  as long as every expert gets >= 4 rows (the worker checks it: CPU GEMMs of <= 3 rows take
  another kernel, whose rows differ in the last bit). A capacity above the token count
  (factor 5), which alltoall's permute cannot run, against the unpadded layer only.
- Expert tensor parallelism (EP x ETP = 1x2, 2x2, 1x4; dropless and drop-and-pad), and MoE
  layers under attention TP 2 with sequence parallelism (ETP = TP at EP 1 and 2, ETP 1 at
  EP 2): against the same layer with every expert whole on each rank and (dropless) against
  Megatron's own expert TP in ``alltoall``; the TPxEP group order check; the 1F1B EP overlap
  with expert TP (EP 2 x ETP 2, bitwise the plain steps).

GPU (NCCL, CUDA backend; ``MOK_BACKEND=cuda`` so a missing build fails instead of falling
back): the same round trip and layout on 2 GPUs, and the full layer against ``alltoall`` over
the same EP=2 group in bf16. The same three at EP = 1 on ONE GPU (world size 1: every path of
the adapter and the CUDA backend except the NVLink exchange), for machines with one GPU.
Megatron's ``SharedExpertMLP`` overlapped on its own stream: bitwise the outputs and parameter
gradients of the unoverlapped layer, close to ``alltoall`` with the same overlap. Drop-and-pad
on one GPU and on two (the CPU worker's code path, bf16 tolerances; needs the CUDA backend's
``Buffer.dispatch(rows_per_expert=)``). Expert TP with the CUDA backend (EP x ETP = 1x2, 2x2,
2x2 drop-and-pad; compared with ``alltoall``'s expert TP too under NCCL).
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


def test_full_moe_layer_context_parallel_cpu():
    # CP = 2 at world size 4: EP = 4 spans both CP ranks of each sequence (tokens of one
    # sequence's shards go to each other's experts); with the sequence-level balancing loss,
    # whose reductions run over Megatron's TP x CP group. (global_aux_loss: its router keeps
    # CUDA tensors from __init__, so it cannot be built on CPU.)
    names = run_distributed(W.layer_mok_vs_alltoall_cpu, 4, 2, "seq_aux_loss")
    assert "router.weight" in names[0] and any("experts" in n for n in names[0])


@pytest.mark.parametrize("world", [1, 2])
def test_shared_expert_overlap_hooks_cpu(world):
    calls = run_distributed(W.shared_expert_overlap_hooks_cpu, world)
    assert all(c[2] == "mok.dispatch" for c in calls)


@pytest.mark.parametrize("world", [1, 2])
def test_layer_num_sms_cpu(world):
    sms = run_distributed(W.layer_num_sms_cpu, world)
    assert all(s == [48, None, 16, 48, 20, 20, 16] for s in sms)


@pytest.mark.parametrize("world", [1, 2])
def test_router_padding_for_quantization_cpu(world):
    counts = run_distributed(W.layer_router_padding, world)
    assert all(c % 16 == 0 for per_rank in counts for c in per_rank)


def _check_drop_and_pad(reports, capacity_factor):
    """What the ranks' :func:`W.layer_drop_and_pad` saw: one ``N``, ``E_local x N`` rows per
    rank; a capacity below the load dropped routes (fewer rows than the ranks' T x K routes),
    one above it left zero rows on every rank. Returns the rows received by all ranks."""
    assert len({r["N"] for r in reports}) == 1, reports
    assert all(r["rows"] + r["zero_rows"] == r["N"] * r["local_experts"] for r in reports)
    rows = sum(r["rows"] for r in reports)
    if capacity_factor < 1:
        assert rows < sum(r["routes"] for r in reports), reports
    else:
        assert all(r["zero_rows"] > 0 for r in reports), reports
    return rows


@pytest.mark.parametrize("drop_policy", ["probs", "position"])
@pytest.mark.parametrize("capacity_factor", [0.5, 2.0])
@pytest.mark.parametrize("world", [1, 2, 4])
def test_drop_and_pad_mok_vs_alltoall_cpu(world, capacity_factor, drop_policy):
    reports = run_distributed(W.layer_drop_and_pad, world, capacity_factor, drop_policy)
    _check_drop_and_pad(reports, capacity_factor)
    assert all("grad:router.weight" in r["max_err_vs_alltoall"] for r in reports)


@pytest.mark.parametrize("world", [1, 2])
def test_drop_and_pad_capacity_above_tokens_cpu(world):
    # capacity ceil(T x 2 / 8 x 5) > T tokens: the router pads every expert with every token;
    # mok moves only the routed rows, and all of them (nothing is dropped)
    reports = run_distributed(W.layer_drop_and_pad, world, 5.0, "probs", False)
    assert all(r["N"] > r["tokens"] * world for r in reports), reports
    assert _check_drop_and_pad(reports, 5.0) == sum(r["routes"] for r in reports)


@pytest.mark.gpu
@pytest.mark.parametrize("capacity_factor", [0.5, 2.0])
def test_drop_and_pad_one_gpu(capacity_factor):
    reports = run_distributed(W.layer_drop_and_pad, 1, capacity_factor, "probs",
                              backend_env="cuda", backend="nccl")
    _check_drop_and_pad(reports, capacity_factor)


@pytest.mark.gpu
def test_drop_and_pad_layer_graph_capture_one_gpu():
    assert run_distributed(W.layer_drop_and_pad_graph_gpu, 1, backend="nccl") == [True]


def _check_expert_tp(reports, world, etp, drop_and_pad):
    """What the ranks of :func:`W.layer_expert_tp` report: EP = world / ETP; dropless, every
    route of every rank (40 tokens x top-2 each) is received ETP times, once per expert-TP
    rank of its expert; with drop-and-pad every rank's experts get as many rows."""
    assert [(r["ep"], r["etp"]) for r in reports] == [(world // etp, etp)] * world
    assert all(r["rows"] == sum(r["tokens_per_expert"]) for r in reports), reports
    if drop_and_pad:
        assert len({r["rows"] for r in reports}) == 1, reports
    else:
        assert sum(r["rows"] for r in reports) == etp * world * 40 * 2, reports


@pytest.mark.parametrize("drop_and_pad", [False, True])
@pytest.mark.parametrize("world,etp", [(2, 2), (4, 2), (4, 4)])
def test_expert_tensor_parallel_cpu(world, etp, drop_and_pad):
    # ETP > 1: routes widened to the TPxEP group, the combine sums the fc2 shards' partials;
    # against every expert whole on each rank
    reports = run_distributed(W.layer_expert_tp, world, etp, drop_and_pad, timeout=300)
    _check_expert_tp(reports, world, etp, drop_and_pad)
    assert all(r["alltoall"] != drop_and_pad for r in reports)    # compared where Megatron runs


@pytest.mark.multigpu
@pytest.mark.parametrize("world,etp,drop_and_pad,tp", [(2, 2, False, 1), (4, 2, False, 1),
                                                       (4, 2, True, 1), (4, 2, False, 2)])
def test_expert_tensor_parallel_gpu(world, etp, drop_and_pad, tp):
    from harness import gpus_for

    if not gpus_for(world):
        pytest.skip(f"needs {world} GPUs (or MOK_TEST_SHARED_GPU=1)")
    reports = run_distributed(W.layer_expert_tp, world, etp, drop_and_pad, "cuda", tp,
                              backend="nccl", timeout=300)
    _check_expert_tp(reports, world, etp, drop_and_pad)


@pytest.mark.parametrize("world,tp,etp", [(2, 2, 2), (4, 2, 2), (2, 2, 1)],
                         ids=["ETP=TP=2,EP=1", "ETP=TP=2,EP=2", "TP=2,ETP=1,EP=2"])
def test_attention_tensor_parallel_cpu(world, tp, etp):
    # Megatron's MoE under attention TP with sequence parallelism; ETP defaults to TP
    reports = run_distributed(W.layer_expert_tp, world, etp, False, None, tp, timeout=300)
    _check_expert_tp(reports, world, etp, False)
    assert all(r["alltoall"] for r in reports)


def test_expert_tensor_parallel_group_order_cpu():
    reports = run_distributed(W.expert_tp_group_order, 4, fresh=True)
    for rank, (ok, bad) in enumerate(reports):
        assert ok == [], (rank, ok)
        # every rank sees it, ranks 0 and 3 too (their own place is the same in both orders,
        # their group peers' are not)
        assert len(bad) == 1 and "not in Megatron's order" in bad[0], (rank, bad)


@pytest.mark.parametrize("drop_and_pad", [False, True])
@pytest.mark.parametrize("world", [1, 2])
def test_partial_capture_attrs_cpu(world, drop_and_pad):
    assert run_distributed(W.partial_capture_attrs_cpu, world, drop_and_pad) == [True] * world


@pytest.mark.parametrize("drop_and_pad", [False, True])
@pytest.mark.parametrize("world", [1, 2])
def test_te_partial_capture_cpu(world, drop_and_pad):
    # Megatron's TE-impl partial capture path (early-return signal, tensor store), no TE needed
    assert run_distributed(W.te_partial_capture_cpu, world, drop_and_pad) == [True] * world


@pytest.mark.gpu
@pytest.mark.parametrize("drop_and_pad,shared", [(False, None), (True, None), (False, "plain")])
def test_partial_cuda_graphs_one_gpu(drop_and_pad, shared):
    # Megatron's local CUDA graphs over the router + dispatch preprocess, MoK's dispatch eager
    reports = run_distributed(W.layer_partial_graphs_gpu, 1, drop_and_pad, shared, backend="nccl")
    assert reports[0]["calls"] == {"preprocess": 0, "dispatch": 4}, reports


@pytest.mark.multigpu
def test_partial_cuda_graphs_gpu():
    reports = run_distributed(W.layer_partial_graphs_gpu, 2, False, None, backend="nccl")
    assert all(r["calls"]["dispatch"] == 4 for r in reports), reports


@pytest.mark.multigpu
def test_drop_and_pad_gpu():
    reports = run_distributed(W.layer_drop_and_pad, 2, 0.5, "position", backend_env="cuda",
                              backend="nccl")
    _check_drop_and_pad(reports, 0.5)


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
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_full_moe_layer_mok_vs_alltoall_one_gpu(dtype):
    reports = run_distributed(W.layer_mok_vs_alltoall_gpu, 1, "cuda", dtype, backend="nccl")
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


@pytest.mark.parametrize("drop_and_pad", [False, True])
def test_ep_overlap_cpu(drop_and_pad):
    # Megatron's 1F1B EP overlap schedule with mok on CPU (streams stubbed, reference backend):
    # losses and gradients bitwise the plain steps
    reports = run_distributed(W.gpt_ep_overlap_cpu, 2, drop_and_pad, backend="gloo", fresh=True,
                              timeout=300)
    assert all(r["dispatches"] == 6 for r in reports), reports


def test_ep_overlap_cpu_expert_tp():
    # the same with expert tensor parallelism 2 (EP 2 x ETP 2: the Buffer over the TPxEP group)
    reports = run_distributed(W.gpt_ep_overlap_cpu, 4, False, 2, backend="gloo", fresh=True,
                              timeout=400)
    assert all(r["dispatches"] == 6 for r in reports), reports


@pytest.mark.parametrize("node", ["moe_dispatch", "mlp"])
def test_ep_overlap_cpu_fails_with_megatrons_free_rule(node):
    # why install() keeps these inputs for mok: with Megatron's rule for either node the same
    # run ends in an error (a freed tensor read by the backward; on a GPU it could be a silent
    # read of reused memory instead)
    errors = run_distributed(W.gpt_ep_overlap_cpu_with_megatron_rule, 2, node, backend="gloo",
                             fresh=True, timeout=300)
    assert all(e is not None and "not allocated" in e for e in errors), errors


@pytest.mark.parametrize("world", [1, 2])
def test_device_error_raised_before_the_optimizer_step_cpu(world):
    # The CUDA backend reads its device error report on the host only in an eager dispatch;
    # an error of a combine's backward would otherwise surface at the next step's first
    # dispatch, after the optimizer step had used the step's gradients. install() checks every
    # Buffer after Megatron's forward-backward schedule returns: the step that recorded the
    # error raises it from its own forward_backward_no_pipelining call. A reference backend
    # with the CUDA backend's error contract stands in for the kernels (CPU, gloo).
    reports = run_distributed(W.step_device_error_cpu, world, backend="gloo", fresh=True,
                              timeout=300)
    for rank, r in enumerate(reports):
        assert r["clean_checks"] == 1, r          # one check per step, after the schedule
        assert "(test) device error recorded in dispatch_cached" in r.get("raised", ""), r
        assert f"rank {rank}:" in r["raised"], r
        assert r["off_returned"], r               # MOK_CHECK_ERRORS=off: no check


@pytest.mark.parametrize("world", [1, 2])
def test_destroy_model_parallel_resets_the_buffers_cpu(world):
    # Buffers are cached per group; Megatron's destroy_model_parallel() drops the groups, so
    # install() destroys the Buffers first: a re-initialised model gets Buffers on its new
    # groups and the old ones (CUDA peer memory on GPUs) do not pile up (before: one more
    # cached Buffer, never destroyed, per re-initialisation).
    assert run_distributed(W.reinit_resets_buffers, world, backend="gloo", fresh=True) == [0] * world


@pytest.mark.multigpu
def test_ep_overlap_gpu():
    # Megatron's 1F1B EP overlap with mok: GPTModel, EP=2, 3 micro-batches
    reports = run_distributed(W.gpt_ep_overlap_gpu, 2, backend="nccl", fresh=True)
    assert all(len(r["losses"]) == 3 for r in reports), reports


@pytest.mark.gpu
def test_router_padding_for_quantization_one_gpu():
    counts = run_distributed(W.layer_router_padding, 1, "cuda", backend="nccl")
    assert all(c % 16 == 0 for c in counts[0])


@pytest.mark.multigpu
def test_router_padding_for_quantization_gpu():
    counts = run_distributed(W.layer_router_padding, 2, "cuda", backend="nccl")
    assert all(c % 16 == 0 for per_rank in counts for c in per_rank)

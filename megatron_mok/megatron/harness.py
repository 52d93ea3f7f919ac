"""Helpers shared by the tests, the layer benchmark and the example: build a Megatron
``MoELayer`` for a given dispatcher on CPU (gloo) or GPU (NCCL), with Megatron's local
(no TransformerEngine, no apex) ``SequentialMLP`` experts.

Also :func:`enable_cpu_alltoall`: Megatron's ``alltoall`` dispatcher copies its split sizes
to the host on a side CUDA stream, which does not exist on a CPU-only machine. On CPU the
counts are already on the host, so the same copies without streams are exact; this lets the
CPU tests compare ``mok`` against Megatron's real ``alltoall`` code (permute, all-to-all-v,
sort_chunks, unpermute). It changes nothing when CUDA is available.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional

import torch


def fix_megatron_without_te() -> None:
    """megatron-core 0.16.x without TransformerEngine: ``router_gating_linear`` reads the
    module global ``te_general_gemm``, which is only defined when TE imports (0.19 defines
    it as ``None``). Define it as ``None`` so the router takes its torch path. Harmless with
    TE installed; affects every dispatcher alike."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def init_parallel(ep_size: int, tp_size: int = 1, seed: int = 1234, etp_size: int = 1,
                  cp_size: int = 1) -> None:
    """``parallel_state.initialize_model_parallel`` for expert parallelism ``ep_size``, expert
    tensor parallelism ``etp_size``, tensor parallelism ``tp_size`` and context parallelism
    ``cp_size`` (torch.distributed must already be initialised)."""
    from megatron.core import parallel_state

    fix_megatron_without_te()
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    kwargs = dict(tensor_model_parallel_size=tp_size, pipeline_model_parallel_size=1,
                  expert_model_parallel_size=ep_size, expert_tensor_parallel_size=etp_size,
                  context_parallel_size=cp_size)
    parallel_state.initialize_model_parallel(**kwargs)
    if torch.cuda.is_available():
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed)


def destroy_parallel() -> None:
    """Tear down what :func:`init_parallel` and the layers set up in this process: the shared
    MoK Buffers, Megatron's parallel state, and Megatron's process-global aux-loss scale (a
    backward before any ``set_loss_scale`` makes it a 0-dim tensor, into which a later
    ``set_loss_scale(torch.ones(1))`` in the same process cannot copy)."""
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    from .dispatcher import reset_buffers

    reset_buffers()
    MoEAuxLossAutoScaler.main_loss_backward_scale = None
    _drop_moe_metrics()
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()


def _drop_moe_metrics() -> None:
    """Empty Megatron's process-global MoE metrics (the aux-loss logging). Each metric's tensor
    is sized by the layer count of the first model that records it; a later model with more
    layers in the same process would index past it (IndexError in the router, s34-1).
    0.19: ``moe_logging``'s tracker object; 0.16 / 0.17: a module-level dict in ``moe_utils``."""
    try:
        from megatron.core.transformer.moe import moe_logging
    except ImportError:
        from megatron.core.transformer.moe import moe_utils

        moe_utils.get_moe_layer_wise_logging_tracker().clear()
    else:
        moe_logging.set_moe_metrics_tracker(None)


def moe_config(dispatcher: str, *, ep_size: int, num_experts: int = 8, topk: int = 2,
               hidden: int = 32, ffn_hidden: int = 64, dtype=torch.float32, **overrides):
    """A ``TransformerConfig`` for one MoE layer (local spec, fp32 router)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    kw = dict(
        num_layers=1, hidden_size=hidden, ffn_hidden_size=ffn_hidden,
        moe_ffn_hidden_size=ffn_hidden, num_attention_heads=4,
        num_moe_experts=num_experts, moe_router_topk=topk,
        moe_token_dispatcher_type=dispatcher, moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=0.01, moe_router_dtype="fp32",
        expert_model_parallel_size=ep_size, tensor_model_parallel_size=1,
        expert_tensor_parallel_size=1, use_cpu_initialization=True,
        moe_grouped_gemm=False, add_bias_linear=False,
        bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16, params_dtype=dtype,
        gradient_accumulation_fusion=False, bias_activation_fusion=False,
        masked_softmax_fusion=False, persist_layer_norm=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, moe_permute_fusion=False,
    )
    kw.update(overrides)
    names = {f.name for f in dataclasses.fields(TransformerConfig)}
    return TransformerConfig(**{k: v for k, v in kw.items() if k in names})


def cpu_router_class():
    """Megatron's ``TopKRouter`` with its gate kept on the input's device.

    ``TopKRouter.gating`` moves a CPU gate weight to ``torch.cuda.current_device()``, which
    fails on a CPU-only build; this subclass computes the same ``router_gating_linear`` on
    CPU tensors and defers to Megatron's for CUDA input. Routing, score function, top-k and
    everything after are Megatron's own.
    """
    from megatron.core.transformer.moe.moe_utils import router_gating_linear
    from megatron.core.transformer.moe.router import TopKRouter

    class CpuTopKRouter(TopKRouter):
        def gating(self, input):
            if input.is_cuda:
                return super().gating(input)
            router_dtype = {"fp32": torch.float32, "fp64": torch.float64}.get(
                self.config.moe_router_dtype, input.dtype)
            return router_gating_linear(input, self.weight, self.bias, router_dtype)

    return CpuTopKRouter


def _mlp_submodules(mlp):
    """``MoESubmodules`` of a layer spec's ``mlp`` entry: a ``ModuleSpec`` (0.16) or a
    ``functools.partial(MoELayer, submodules=...)`` (0.19)."""
    if hasattr(mlp, "submodules"):
        return mlp.submodules
    return mlp.keywords["submodules"]


def local_layer_spec(num_experts: int, cpu_router: bool = False):
    """Megatron's local GPT layer spec (``SequentialMLP`` experts, no TE / apex); with
    ``cpu_router`` its MoE router is :func:`cpu_router_class`."""
    import functools

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False)
    if cpu_router:
        mlp = spec.submodules.mlp
        new = dataclasses.replace(_mlp_submodules(mlp), router=cpu_router_class())
        if hasattr(mlp, "submodules"):
            mlp.submodules = new
        else:
            spec.submodules.mlp = functools.partial(mlp.func, *mlp.args,
                                                    **{**mlp.keywords, "submodules": new})
    return spec


def moe_submodules(config, cpu_router: bool = False):
    """Megatron's local-spec ``MoESubmodules`` (``SequentialMLP`` experts)."""
    spec = local_layer_spec(config.num_moe_experts, cpu_router=cpu_router)
    return _mlp_submodules(spec.submodules.mlp)


def single_rank_pg_collection():
    """Megatron's default MoE process groups, with the expert-parallel and expert
    tensor-parallel groups replaced by this rank alone (EP = ETP = 1 while torch.distributed
    has W ranks). Collective: every rank must call it."""
    import torch.distributed as dist
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

    world = dist.get_world_size()
    mine = None
    for r in range(world):                 # new_group is collective over the world
        g = dist.new_group([r])
        if r == dist.get_rank():
            mine = g
    pgs = get_default_pg_collection()
    pgs.ep = mine
    pgs.tp_ep = mine
    pgs.expt_tp = mine
    return pgs


def build_moe_layer(config, device: Optional[torch.device] = None, dtype=None,
                    pg_collection=None):
    """``MoELayer`` with Megatron's local spec (``SequentialMLP`` experts) on ``device``
    (CPU when ``None``: then with :func:`cpu_router_class`)."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    on_cpu = device is None or torch.device(device).type == "cpu"
    layer = MoELayer(config, moe_submodules(config, cpu_router=on_cpu),
                     pg_collection=pg_collection)
    layer.set_layer_number(0)
    if device is not None:
        layer = layer.to(device)
    if dtype is not None:
        layer = layer.to(dtype)
    return layer


def build_moe_transformer_layer(config, device: torch.device, dtype=None):
    """Megatron's ``MoETransformerLayer`` (the layer class whose local CUDA graphs capture the
    MoE part partially: router + dispatch preprocess, and the postprocess) over the local GPT
    spec: local attention, ``SequentialMLP`` experts; every parameter in ``dtype`` (torch's
    LayerNorm is made in fp32)."""
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_layer import MoETransformerLayer

    spec = dataclasses.replace(local_layer_spec(config.num_moe_experts), module=MoETransformerLayer)
    layer = build_module(spec, config=config, layer_number=1).to(device)
    return layer.to(dtype) if dtype is not None else layer


def graph_scope_kwargs(scopes) -> dict:
    """``{field: scopes}`` for this megatron-core's CUDA-graph scope field (0.16
    ``cuda_graph_scope``, 0.19 ``cuda_graph_modules``)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    names = {f.name for f in dataclasses.fields(TransformerConfig)}
    return {"cuda_graph_modules" if "cuda_graph_modules" in names else "cuda_graph_scope": scopes}


def use_cudagraphable_rng(seed: int, on: bool = True) -> None:
    """Megatron's local CUDA graphs need a graph-safe RNG tracker (``on``); ``on=False`` puts a
    plain one back (the tracker is process-global)."""
    from megatron.core import tensor_parallel

    tensor_parallel.model_parallel_cuda_manual_seed(seed, use_cudagraphable_rng=on,
                                                    force_reset_rng=True)


def enable_cpu_alltoall() -> None:
    """Make Megatron's ``alltoall`` dispatcher construct and run without CUDA (see module doc).

    Idempotent. Device-aware: layers running on CUDA tensors keep Megatron's own code.
    """
    from megatron.core.transformer.moe import token_dispatcher as td
    from megatron.core.transformer.moe.moe_utils import maybe_move_tensor_to_cpu

    cls = td.MoEAlltoAllTokenDispatcher
    if getattr(cls, "_mok_cpu_compat", False):
        return
    if cls.cuda_dtoh_stream is None and not torch.cuda.is_available():
        cls.cuda_dtoh_stream = object()      # never used: the override below has no streams
    orig = cls._maybe_dtoh_and_synchronize

    def _maybe_dtoh_and_synchronize(self, point, tokens_per_expert=None):
        # NOTE: decide by the layer's device (routing_map stays there), not by
        # tokens_per_expert, which Megatron itself moves to the host mid-way.
        rmap = getattr(self, "routing_map", None)
        if isinstance(rmap, torch.Tensor) and rmap.is_cuda:
            return orig(self, point, tokens_per_expert)
        if getattr(self, "drop_and_pad", False) or point != self.cuda_dtoh_point:
            return tokens_per_expert
        # The same host copies Megatron makes on its DtoH stream, done in place on CPU.
        tokens_per_expert = maybe_move_tensor_to_cpu(tokens_per_expert)
        self.input_splits = maybe_move_tensor_to_cpu(self.input_splits, as_numpy=True)
        self.output_splits = maybe_move_tensor_to_cpu(self.output_splits, as_numpy=True)
        self.output_splits_tp = maybe_move_tensor_to_cpu(self.output_splits_tp, as_numpy=True)
        self.num_out_tokens = maybe_move_tensor_to_cpu(self.num_out_tokens)
        if self.num_local_experts > 1 and not self.config.moe_permute_fusion:
            self.num_global_tokens_per_local_expert = maybe_move_tensor_to_cpu(
                self.num_global_tokens_per_local_expert)
        return tokens_per_expert

    _maybe_dtoh_and_synchronize._orig = orig
    cls._maybe_dtoh_and_synchronize = _maybe_dtoh_and_synchronize
    cls._mok_cpu_compat = True

    # alltoall all-gathers the per-expert counts over the EP group; Megatron allocates the
    # output with device=torch.cuda.current_device(). Same gather, output on the input's device.
    from megatron.core.tensor_parallel import mappings

    orig_gather = mappings._gather_along_first_dim

    def _gather_along_first_dim(input_, group, output_split_sizes=None, use_global_buffer=False):
        if input_.is_cuda or group.size() == 1:
            return orig_gather(input_, group, output_split_sizes, use_global_buffer)
        sizes = output_split_sizes or [input_.shape[0]] * group.size()
        parts = [input_.new_empty((n, *input_.shape[1:])) for n in sizes]
        torch.distributed.all_gather(parts, input_.contiguous(), group=group)
        return torch.cat(parts, dim=0)

    mappings._gather_along_first_dim = _gather_along_first_dim

    # ... and its all-to-all-v allocates its output the same way.
    orig_a2a_forward = mappings._AllToAll.forward

    def _a2a_forward(ctx, group, input, output_split_sizes, input_split_sizes, *rest):
        # rest: 0.19's use_nccl_stream flag (CPU: no streams either way)
        if input.is_cuda or group.size() == 1 or output_split_sizes is None:
            return orig_a2a_forward(ctx, group, input, output_split_sizes, input_split_sizes,
                                    *rest)
        ctx.group, ctx.output_split_sizes, ctx.input_split_sizes = \
            group, output_split_sizes, input_split_sizes
        if rest:
            ctx.use_nccl_stream = rest[0]
        input = input.contiguous()
        output = input.new_empty([int(sum(output_split_sizes))] + list(input.size()[1:]))
        torch.distributed.all_to_all_single(
            output, input, output_split_sizes=[int(n) for n in output_split_sizes],
            input_split_sizes=[int(n) for n in input_split_sizes], group=group)
        return output

    mappings._AllToAll.forward = staticmethod(_a2a_forward)


# Whether the current run's tensors are on the CPU (enable_cpu_megatron): read by the patches
# below at every call, so one process can run on the CPU, then on a GPU.
_CPU_RUN = {"on": False}


def enable_cpu_megatron(on_cpu: Optional[bool] = None) -> None:
    """Everything a CPU run of the example / benchmark needs: :func:`fix_megatron_without_te`,
    :func:`enable_cpu_alltoall`, Megatron's ``GlobalMemoryBuffer`` (attention scratch)
    allocating on the CPU instead of ``torch.cuda.current_device()``, and the CUDA RNG
    tracker's ``fork`` as a no-op (CPU runs use no dropout). None of it touches the MoE
    dispatch path.

    ``on_cpu``: whether this run's tensors are on the CPU (default: no CUDA device). A gloo
    run on a machine with GPUs passes True: the scratch must follow the run's tensors, not the
    visible GPU (run s14-5: the example's CPU test on a GPU host failed in attention with
    "batch1 is on cpu, different from other tensors on cuda:0"). The patches are installed
    once and follow the latest ``on_cpu``: a later GPU run in the same process
    (``on_cpu=False``) gets Megatron's own allocation and RNG fork back."""
    fix_megatron_without_te()
    enable_cpu_alltoall()
    _CPU_RUN["on"] = (not torch.cuda.is_available()) if on_cpu is None else bool(on_cpu)
    from megatron.core import utils as mutils
    from megatron.core.tensor_parallel import random as mrandom

    cls = mutils.GlobalMemoryBuffer
    if getattr(cls, "_mok_cpu_compat", False):
        return
    orig_get, orig_fork = cls.get_tensor, mrandom.CudaRNGStatesTracker.fork

    def get_tensor(self, tensor_shape, dtype, name, *args, **kwargs):
        if not _CPU_RUN["on"]:
            return orig_get(self, tensor_shape, dtype, name, *args, **kwargs)
        n = 1
        for d in tensor_shape:
            n *= d
        buf = self.buffer.get((name, dtype))
        if buf is None or buf.numel() < n or buf.is_cuda:
            buf = self.buffer[(name, dtype)] = torch.empty(n, dtype=dtype)
        return buf[:n].view(*tensor_shape)

    def fork(self, *args, **kwargs):
        if not _CPU_RUN["on"]:
            return orig_fork(self, *args, **kwargs)
        import contextlib

        return contextlib.nullcontext()

    cls.get_tensor = get_tensor
    mrandom.CudaRNGStatesTracker.fork = fork
    cls._mok_cpu_compat = True


def mean_token_loss(per_token: torch.Tensor):
    """Megatron's loss-function contract for a ``GPTModel``'s per-token losses ``[b, s]``:
    ``(mean in fp32, {"lm loss": a copy})`` (the schedule divides the first in place)."""
    loss = per_token.float().mean()
    return loss, {"lm loss": loss.detach().clone()}


def gpt_forward_step(data_iterator, model, return_schedule_plan=False):
    """Megatron's forward-step contract for ``(tokens, position_ids, attention_mask, labels)``
    batches; the 1F1B EP overlap asks for the model's schedule plan instead of its output."""
    tokens, pos, mask, labels = next(data_iterator)
    if return_schedule_plan:
        return model.build_schedule_plan(tokens, pos, mask, labels=labels), mean_token_loss
    return model(tokens, pos, mask, labels=labels), mean_token_loss


def dist_env_defaults() -> None:
    """Quiet, CPU-friendly defaults for spawned test / benchmark processes."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")


def init_distributed() -> None:
    """Join torchrun's group (RANK/WORLD_SIZE/... in the environment), keep an already
    initialised one, or start a single-process group: NCCL with a GPU, gloo without."""
    import socket

    import torch.distributed as dist

    if dist.is_initialized():
        return
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                              MASTER_PORT=str(s.getsockname()[1]))
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl")
    else:
        dist.init_process_group("gloo")

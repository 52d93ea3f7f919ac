"""Config-time checks and the MoK knobs for Megatron.

:func:`check_config` runs inside ``TransformerConfig.__post_init__`` (once :func:`install`
has been called) whenever ``moe_token_dispatcher_type == "mok"``. A combination MoK does
not support fails there, with a message that says what to change; nothing falls back to
another dispatcher.

The MoK knobs (:class:`MokOptions`) are read from environment variables, so they work the
same from Megatron-LM, NeMo and Megatron-Bridge without new config fields; an attribute of
the same name in lower case with a ``moe_`` prefix set on the config object wins (e.g.
``config.moe_mok_backend = "reference"``).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Optional

import torch

from ..cuda.backend import MAX_RANKS as CUDA_MAX_RANKS, MAX_TOPK as CUDA_MAX_TOPK
from .versions import cuda_graph_impl, cuda_graph_scope_names

DISPATCHER_NAME = "mok"


class MokConfigError(ValueError):
    """A Megatron config combination MoK does not support (raised at config time)."""


def _effective_etp(config) -> int:
    etp = getattr(config, "expert_tensor_parallel_size", None)
    if etp is None:                       # Megatron defaults ETP to TP in __post_init__
        etp = getattr(config, "tensor_model_parallel_size", 1) or 1
    return int(etp)


def rank_capacity_factor_problem(factor) -> Optional[str]:
    """What is wrong with a ``moe_expert_rank_capacity_factor`` value (``None``: nothing): it
    must be ``None`` or a finite number > 0 (0 would drop every row of every step)."""
    if factor is None:
        return None
    if isinstance(factor, bool) or not isinstance(factor, (int, float)):
        return f"moe_expert_rank_capacity_factor must be a number > 0 or None, got {factor!r}"
    if not (math.isfinite(factor) and factor > 0):
        return f"moe_expert_rank_capacity_factor must be a finite number > 0, got {factor!r}"
    return None


def config_problems(config) -> list:
    """Everything about ``config`` that MoK cannot run, each as 'what; what to change'."""
    p = []
    if getattr(config, "num_moe_experts", None) is None:
        p.append("num_moe_experts is not set; moe_token_dispatcher_type='mok' needs an MoE "
                 "model (set num_moe_experts / --num-experts)")
    # Expert tensor parallelism works: each route goes to every expert-TP rank of its
    # expert, over the TPxEP group (dispatcher.expand_routes_for_expert_tp). The CUDA kernels
    # bound the routes per token and the ranks of one Buffer.
    etp = _effective_etp(config)
    topk = getattr(config, "moe_router_topk", 1) or 1
    ranks = etp * int(getattr(config, "expert_model_parallel_size", 1) or 1)
    if etp > 1 and MokOptions.from_config(config).backend != "reference":
        if topk * etp > CUDA_MAX_TOPK:
            p.append(f"moe_router_topk x expert_tensor_parallel_size = {topk} x {etp} = "
                     f"{topk * etp} routes per token; with expert TP each route goes to every "
                     f"expert-TP rank of its expert, and MoK's CUDA kernels take at most "
                     f"{CUDA_MAX_TOPK}: lower expert_tensor_parallel_size (or set it to 1)")
        if ranks > CUDA_MAX_RANKS:
            p.append(f"expert_model_parallel_size x expert_tensor_parallel_size = {ranks} ranks "
                     f"exchange tokens; MoK's CUDA kernels take at most {CUDA_MAX_RANKS}")
    # moe_pad_expert_input_to_capacity (drop-and-pad) works: the dispatcher drops the padding
    # routes and gives every local expert capacity x EP rows (MokTokenDispatcher); Megatron's
    # own check asks for moe_expert_capacity_factor.
    # Megatron's 1F1B EP overlap (overlap_moe_expert_parallel_comm) works: the config is
    # validated as alltoall's and install() keeps the schedule nodes' inputs that mok still
    # needs (_patch.py); without that wrap the config is refused there, naming why.
    # megatron-core 0.19's per-rank receive budget (moe_expert_rank_capacity_factor; a
    # 0.16 config has no such field): every dispatch returns a static row count and drops,
    # flagged, the rows over it; Megatron's PagedStashRunner reruns such a step dropless
    # (budget.py). Megatron itself accepts the factor only with moe_flex_dispatcher_backend
    # 'hybridep' (and use_transformer_engine_op_fuser) or 'ncclep'; that check is its own.
    factor = getattr(config, "moe_expert_rank_capacity_factor", None)
    problem = rank_capacity_factor_problem(factor)
    if problem:
        p.append(problem)
    if getattr(config, "moe_paged_stash", False) and factor is None:
        # (Megatron 0.19 refuses it too; this also catches a config edited after its check.)
        p.append("moe_paged_stash is set without moe_expert_rank_capacity_factor: the paged "
                 "stash sizes its buffers from the dispatch's static per-rank budget; set "
                 "moe_expert_rank_capacity_factor (or unset moe_paged_stash)")
    if getattr(config, "moe_enable_deepep", False):
        p.append("moe_enable_deepep is set; it selects DeepEP for the 'flex' dispatcher: unset "
                 "it to use MoK")
    impl = cuda_graph_impl(config)
    drop_and_pad = bool(getattr(config, "moe_pad_expert_input_to_capacity", False))
    if impl == "full_iteration" and not drop_and_pad and factor is None:
        # One graph over the whole forward-backward of a step (Megatron's FullCudaGraphWrapper),
        # so over every MoE dispatch too: a dropless dispatch reads its row count R on the host
        # (to size its output), which a capture can neither do nor replay. Drop-and-pad's
        # dispatch knows its rows (capacity x EP per expert) and the budget's has a static
        # row count (PagedStashRunner resets this graph before its dropless rerun): both read
        # nothing while captured. (With the budget the experts must take its padded rows:
        # checked when the layer is built, budget.full_iteration_problem.)
        p.append("CUDA graphs capture the whole training iteration (cuda_graph_impl="
                 "'full_iteration'; megatron-core 0.16 / 0.17: cuda_graph_impl='local' with the "
                 "scope 'full_iteration'), MoK's dropless dispatch included, which reads its row "
                 "count on the host and cannot be captured: use drop-and-pad "
                 "(moe_pad_expert_input_to_capacity with moe_expert_capacity_factor) or "
                 "megatron-core 0.19's per-rank budget (moe_expert_rank_capacity_factor, with "
                 "experts that take its padded rows), whose dispatches read nothing while "
                 "captured; or per-layer graphs that leave the "
                 "dispatch eager (cuda_graph_impl='local' / 'transformer_engine' over "
                 "'moe_router' / 'moe_preprocess' and attention scopes); or disable CUDA graphs")
    if impl in ("local", "transformer_engine"):
        scopes = cuda_graph_scope_names(config)
        # Partial capture (moe_router, moe_preprocess) works with and without drop-and-pad:
        # the router and dispatch_preprocess are captured, the dispatch runs eagerly after the
        # graph, and Megatron hands the top-k ids over through the dispatcher's cudagraph_attrs
        # (tests/megatron: test_partial_cuda_graphs_one_gpu).
        whole_layer = not scopes or "full" in scopes
        partial = bool(scopes & {"moe_router", "moe_preprocess"})
        if (partial and impl == "local"
                and getattr(config, "moe_shared_expert_overlap", False)):
            # Megatron's local impl captures combine_postprocess in a graph of its own; there
            # the overlapped shared expert's output, made eagerly beside the dispatch, is
            # fetched. Capturing it fails in Megatron's overlap state machine ("get_output must
            # be called from POST_FORWARD_COMM_DONE state", run s18-3); a replay would read the
            # capture-time tensor.
            p.append("moe_shared_expert_overlap with cuda_graph_impl='local' over 'moe_router' / "
                     "'moe_preprocess': Megatron's local graphs capture combine_postprocess, "
                     "which fetches the overlapped shared expert's output made outside the "
                     "graph: unset moe_shared_expert_overlap (the shared expert is then "
                     "captured with the router) or use cuda_graph_impl='transformer_engine'")
        if not drop_and_pad and (whole_layer or "moe" in scopes):
            # Drop-and-pad's dispatch knows its rows (capacity x EP per expert) and reads
            # nothing while captured, so there the MoE layer can be captured whole ('moe', or
            # the whole layer); a dropless dispatch reads its row count R on the host. The
            # per-rank budget does not lift this: PagedStashRunner resets only the
            # full-iteration graph before its dropless rerun, so a per-layer graph would
            # replay the budgeted dispatch in the rerun, dropping the same rows again.
            what = "the whole layer" if whole_layer else "scope 'moe'"
            budget = ("; moe_expert_rank_capacity_factor does not lift this: Megatron's "
                      "PagedStashRunner resets only a full-iteration graph before its dropless "
                      "rerun, so a per-layer graph would replay the budgeted dispatch there"
                      if factor is not None else "")
            p.append(f"CUDA graphs cover the MoE dispatch ({what}); MoK's dropless dispatch "
                     "reads its row count on the host: capture 'moe_router' / "
                     "'moe_preprocess' (the router and the dispatch preprocess; the dispatch "
                     "runs eagerly after them) and attention scopes, use drop-and-pad "
                     "(moe_pad_expert_input_to_capacity, with which 'moe' works), or disable "
                     f"CUDA graphs{budget}")
    return p


def check_config(config) -> None:
    """Raise :class:`MokConfigError` listing every unsupported setting (config time)."""
    if getattr(config, "moe_token_dispatcher_type", None) != DISPATCHER_NAME:
        return
    problems = config_problems(config)
    if problems:
        raise MokConfigError(
            "moe_token_dispatcher_type='mok' cannot run this config:\n  - "
            + "\n  - ".join(problems))


_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
           "float16": torch.float16, "fp32": torch.float32, "float32": torch.float32}


def _knob(config, name: str, default=None):
    attr = "moe_mok_" + name
    if config is not None and getattr(config, attr, None) is not None:
        return getattr(config, attr)
    env = os.environ.get("MOK_" + name.upper())
    return env if env not in (None, "") else default


# When the device errors of the shared Buffers are read (MOK_CHECK_ERRORS). Process-wide, so
# read from the environment only (no config attribute: the per-step check is not a layer's).
CHECK_ERRORS_ENV = "MOK_CHECK_ERRORS"
CHECK_ERRORS_MODES = ("step", "call", "off")


def error_check_mode() -> str:
    """``MOK_CHECK_ERRORS``: when the device-side errors of the CUDA kernels (timeouts, bad
    expert ids, overflows) are read besides each eager dispatch's own host read:

    - ``step`` (default): once per training step, after Megatron's forward-backward schedule
      returns and before the optimizer step (:func:`megatron_mok.megatron.check_errors`, hooked
      by :func:`~megatron_mok.megatron.install`): one device synchronisation per step;
    - ``call``: also after every forward ``token_dispatch`` and ``token_combine`` (a device
      synchronisation each; for finding the layer whose call failed), never while a CUDA graph
      is being captured;
    - ``off``: only at the eager dispatches' host reads; an error of a combine or a backward
      then surfaces at the next step's first dispatch, after the optimizer step.
    """
    mode = os.environ.get(CHECK_ERRORS_ENV) or "step"
    if mode not in CHECK_ERRORS_MODES:
        raise MokConfigError(f"{CHECK_ERRORS_ENV} must be one of {', '.join(CHECK_ERRORS_MODES)}, "
                             f"got {mode!r}")
    return mode


@dataclass(frozen=True)
class MokOptions:
    """Knobs of the Megatron dispatcher (env ``MOK_<NAME>`` or ``config.moe_mok_<name>``).

    Attributes:
        backend: ``MOK_BACKEND``: ``auto`` (CUDA kernels for CUDA tensors when built, else
            the reference), ``reference`` or ``cuda``.
        max_tokens_per_rank: ``MOK_MAX_TOKENS_PER_RANK``: ``T_max`` of the Buffer. Unset:
            the largest token count any EP rank passes to the first dispatch (one all-reduce,
            once per process). A later call with more tokens raises and names this knob.
        combine_partial_dtype: ``MOK_COMBINE_PARTIAL_DTYPE``: ``fp32`` rounds combine once
            (twice the combine bytes); unset = the token dtype.
        tokens_per_expert: ``MOK_TOKENS_PER_EXPERT``: where ``tokens_per_expert`` goes to the
            experts: ``auto`` (host only for experts that need it, see docs/MEGATRON.md),
            ``device`` or ``host``.
        num_sms: ``MOK_NUM_SMS``: SMs of MoK's kernels, passed to the Buffer. Unset: 48 in
            layers where nothing runs beside the dispatch and combine, the Buffer's default
            (24; 64 for calls of at most 1024 tokens per rank) with
            ``moe_shared_expert_overlap`` (``MokTokenDispatcher.num_sms``).
        ring_bytes, timeout_s: CUDA backend knobs, passed through to the Buffer.
        comm_stream: ``MOK_COMM_STREAM``: the stream MoK's kernels run on: ``current`` (the
            layer's stream; default) or ``high`` (a high-priority stream of the dispatcher's,
            joined to the layer's stream by events before and after each call, so MoK's blocks
            take SMs before other streams' pending blocks, e.g. an overlapped shared expert's
            GEMM). ``high`` measured no gain at world size 1 (benchmarks/NOTES.md (NN)); it is
            there for the 2-GPU A/B, where a rank's delayed kernel also delays its peers.
    """

    backend: str = "auto"
    max_tokens_per_rank: Optional[int] = None
    combine_partial_dtype: Optional[torch.dtype] = None
    tokens_per_expert: str = "auto"
    num_sms: Optional[int] = None
    ring_bytes: Optional[int] = None
    timeout_s: Optional[float] = None
    comm_stream: str = "current"

    @classmethod
    def from_config(cls, config=None) -> "MokOptions":
        def opt_int(name):
            v = _knob(config, name)
            return None if v is None else int(v)

        backend = str(_knob(config, "backend", "auto"))
        if backend not in ("auto", "reference", "cuda"):
            raise MokConfigError(f"MOK_BACKEND must be auto, reference or cuda, got {backend!r}")
        tpe = str(_knob(config, "tokens_per_expert", "auto"))
        if tpe not in ("auto", "device", "host"):
            raise MokConfigError(
                f"MOK_TOKENS_PER_EXPERT must be auto, device or host, got {tpe!r}")
        partial = _knob(config, "combine_partial_dtype")
        if isinstance(partial, str):
            if partial not in _DTYPES:
                raise MokConfigError(f"MOK_COMBINE_PARTIAL_DTYPE must be one of "
                                     f"{sorted(_DTYPES)}, got {partial!r}")
            partial = _DTYPES[partial]
        comm_stream = str(_knob(config, "comm_stream", "current"))
        if comm_stream not in ("current", "high"):
            raise MokConfigError(f"MOK_COMM_STREAM must be current or high, got {comm_stream!r}")
        timeout = _knob(config, "timeout_s")
        t_max = opt_int("max_tokens_per_rank")
        if t_max is not None and t_max <= 0:
            raise MokConfigError(f"MOK_MAX_TOKENS_PER_RANK must be > 0, got {t_max}")
        return cls(backend=backend, max_tokens_per_rank=t_max, combine_partial_dtype=partial,
                   tokens_per_expert=tpe, num_sms=opt_int("num_sms"),
                   ring_bytes=opt_int("ring_bytes"),
                   timeout_s=None if timeout is None else float(timeout),
                   comm_stream=comm_stream)

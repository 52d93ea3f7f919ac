"""``MokTokenDispatcher``: Megatron's ``MoETokenDispatcher`` interface over a MoK Buffer.

Megatron's ``MoELayer`` calls six hooks; this is what each does here::

    dispatch_preprocess(x [S,B,H], routing_map [T,E] bool, probs [T,E])
        -> x [T,H], topk_weights [T,K] f32     local: dense map -> top-k ids (-1 = none)
    token_dispatch(x, topk_weights)
        -> tokens [R,H], probs [R] f32          Buffer.dispatch: expert-major rows
    dispatch_postprocess(tokens, probs)
        -> tokens, tokens_per_expert [E_local], permuted_probs [R]   no data movement
    combine_preprocess(expert_out [R,H]) -> expert_out                no data movement
    token_combine(expert_out) -> y [T,H]        Buffer.combine: unweighted sum per token
    combine_postprocess(y) -> y [S,B,H]

There is no permute / unpermute around the communication: the Buffer already returns rows
in the order Megatron's experts want (local expert ascending, then source rank, token, slot)
and sums them back per token itself. Probabilities are applied by the experts (Megatron's
convention), so combine is unweighted.

With ``moe_shared_expert_overlap`` the shared experts run on their own stream: input copy and
fc1 beside the dispatch, fc2 beside the combine, their output added in ``combine_postprocess``
(Megatron's ``SharedExpertMLP`` overlap hooks, as its ``alltoall`` and ``flex`` dispatchers
call them).

One Buffer is shared by every MoE layer with the same (group, experts, hidden, top-k,
dtype) -- as Megatron's DeepEP path shares one ``deep_ep.Buffer`` -- so the CUDA workspace
is allocated once per process, not once per layer.

Drop-and-pad (``moe_pad_expert_input_to_capacity``): the router's map then selects, per
expert, exactly ``capacity`` tokens of this rank, the padding ones with prob 0. MoK drops the
padding routes before the exchange and asks the Buffer for ``N = capacity x EP`` rows per
local expert (``Buffer.dispatch(rows_per_expert=N)``: the received rows, then zero rows), the
shapes Megatron's ``alltoall`` gives its experts; ``tokens_per_expert`` is ``[N] * E_local``,
known on the host.

Expert tensor parallelism (ETP > 1): the Buffer spans Megatron's TPxEP group and each route
goes to every expert-TP rank of its expert (:func:`expand_routes_for_expert_tp`, as Megatron's
``flex`` dispatcher widens its routing); the combine's per-token sum then also adds up the fc2
shards' partial outputs, which ``alltoall`` reduce-scatters.

Megatron-core 0.19's per-rank budget (``moe_expert_rank_capacity_factor``, without
drop-and-pad): ``token_dispatch`` asks the Buffer for ``recv_budget=M`` rows,
``M = int(T x K x ETP x factor)`` rounded up as HybridEP rounds it (:meth:`recv_budget`); rows
over it are dropped and flagged on the device in ``_comm_manager`` (a :class:`RankBudget`:
Megatron's ``PagedStashRunner`` reaches the factor and the flag through it, reruns a step that
dropped without the factor, i.e. dropless). Experts that take the ``M`` rows with device counts
get them as they are (no host read); the others get the kept rows and their output is padded
back to ``M`` rows for the combine (``budget.py``, :meth:`configure_for_experts`).

Partial CUDA graphs (``moe_router`` + ``moe_preprocess``): ``dispatch_preprocess`` is
captured with the router, the dispatch runs eagerly after the graph; the top-k ids cross
from one to the other through ``cudagraph_attrs`` (see ``__init__``), dropless included.
"""

from __future__ import annotations

import threading
import warnings
from typing import Dict, List, Optional, Tuple

import torch

from megatron.core import utils as mcore_utils
from megatron.core.transformer.moe.moe_utils import get_capacity
from megatron.core.transformer.moe.token_dispatcher import MoETokenDispatcher

from ..comm import group_timeout_seconds
from . import budget
from .budget import RankBudget
from .config import MokConfigError, MokOptions, config_problems, error_check_mode

# SMs of MoK's kernels in a layer where nothing runs beside them (no shared-expert overlap):
# there the fused permute is bound by what one SM moves (~70 GB/s, benchmarks/NOTES.md "What
# #8 means"), and 24 SMs would leave ~108 idle. 2x H200, dsv3 (run s8-4): dispatch 635 -> 420 us,
# combine 750 -> 609 us from 24 to 48 SMs (NOTES (OO)). 48 leaves the rest of an H200 for the
# kernels other streams run meanwhile (NCCL's gradient reduce-scatter): every rank's MoK grid
# must be resident at once.
LAYER_NUM_SMS = 48

# (group, E, H, K, dtype, backend, partial dtype, T_max, device, Buffer knobs) -> Buffer,
# shared across layers. The group enters by identity (_GroupKey), never by id() alone: the key
# holds the group object, so a later group cannot take a dead one's id and be handed a Buffer
# bound to the dead group. Megatron's destroy_model_parallel() empties both caches first
# (install(): _patch.py), destroying the Buffers.
_BUFFERS: Dict[tuple, object] = {}
# group -> T_max agreed by the EP ranks (one all-reduce per group and process).
_T_MAX: Dict["_GroupKey", int] = {}
# device -> the high-priority stream MoK's kernels run on (MOK_COMM_STREAM=high), shared by layers.
_COMM_STREAMS: Dict[str, torch.cuda.Stream] = {}
_LOCK = threading.Lock()


def routing_map_to_topk(routing_map: torch.Tensor, probs: torch.Tensor,
                        topk: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Megatron's dense routing to MoK's top-k form.

    Args:
        routing_map: ``[T, E]`` bool, ``True`` where token ``t`` goes to expert ``e``
            (at most ``topk`` per row; fewer after router-side token dropping / padding masks).
        probs: ``[T, E]`` the router probabilities (zero off the map), any float dtype.
        topk: ``K``.

    Returns:
        ``topk_idx [T, K]`` int64: the routed expert ids of each token in ascending order,
        ``-1``-padded; ``topk_weights [T, K]`` float32: ``probs`` at those ids, 0 on padding.
        Differentiable w.r.t. ``probs`` (a gather).
    """
    num_tokens, num_experts = routing_map.shape
    # NOTE: keys are unique per row (expert ids, or E for "not routed"), so top-k of the
    # smallest is one exact, deterministic answer: routed ids ascending, then the E fillers.
    # Scalars instead of filled tensors, and a cached arange: every op here is a launch and
    # some host time per MoE layer.
    key = torch.where(routing_map, _expert_ids(num_experts, routing_map.device), num_experts)
    if num_tokens == 0:
        idx = key.new_empty(0, topk)
    else:
        k = min(topk, num_experts)
        idx = torch.topk(key, k, dim=1, largest=False, sorted=True).values
        if k < topk:
            idx = torch.cat([idx, idx.new_full((num_tokens, topk - k), num_experts)], dim=1)
        # A row with more than K experts would lose routes: check on the device (no sync).
        torch._assert_async((routing_map.sum(dim=1) <= topk).all(),
                            "MoK: a token is routed to more than moe_router_topk experts")
    valid = idx < num_experts
    topk_idx = torch.where(valid, idx, -1)
    gathered = probs.gather(1, torch.where(valid, idx, 0))
    topk_weights = torch.where(valid, gathered.float(), 0.0)
    return topk_idx, topk_weights


_EXPERT_IDS: Dict[tuple, torch.Tensor] = {}


def _expert_ids(num_experts: int, device: torch.device) -> torch.Tensor:
    """``arange(E)`` int64 on ``device``, made once (read-only). Not cached while a CUDA graph
    is captured: the arange would only be recorded then, its memory never written eagerly."""
    key = (num_experts, str(device))
    ids = _EXPERT_IDS.get(key)
    if ids is None:
        ids = torch.arange(num_experts, device=device, dtype=torch.int64)
        if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            _EXPERT_IDS[key] = ids
    return ids


def expand_routes_for_expert_tp(topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                                num_local_experts: int,
                                etp: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Routes over the EP group -> routes over the TPxEP group (expert tensor parallelism).

    With ETP > 1 every expert is split over the ETP ranks of its EP rank, and each of them
    needs every token routed to it (Megatron's ``alltoall`` all-gathers the received tokens
    over the expert-TP group; its ``flex`` dispatcher, like this, widens the routing to the
    TPxEP group). Rank ``g = ep * ETP + t`` of the TPxEP group (Megatron's order, checked by
    :func:`expert_tp_problems`) then owns the *virtual* experts ``[g * L, (g + 1) * L)``, its
    TP shard of the EP rank's experts ``[ep * L, (ep + 1) * L)``: a route to expert
    ``e = ep * L + l`` becomes the ETP routes to ``(ep * ETP + t) * L + l``, ``t = 0..ETP-1``,
    each with the same weight. The Buffer's rows on every rank are then its experts' rows in
    expert-major order, and its combine sums, per token and in a fixed rank order, the ETP
    ranks' partial outputs (a row-parallel fc2 leaves each TP shard's part of the sum) with
    the experts': ``alltoall``'s reduce-scatter over the expert-TP group, done by the combine.
    The weight's gradient is the sum over the ETP copies (each TP shard's part of it).

    Args:
        topk_idx: ``[T, K]`` int64 global expert ids, ``-1`` = not routed.
        topk_weights: ``[T, K]`` float32.
        num_local_experts: ``L``, experts per EP rank.
        etp: the expert tensor-parallel size.

    Returns:
        ``([T, K * ETP] int64 virtual expert ids (``-1`` kept), [T, K * ETP] float32)``, slot
        ``k * ETP + t`` holding route ``k``'s copy for TP rank ``t``. Differentiable w.r.t.
        ``topk_weights``.
    """
    num_tokens, topk = topk_idx.shape
    wide = (num_tokens, topk * etp)
    ep = topk_idx.div(num_local_experts, rounding_mode="floor")
    local = topk_idx.remainder(num_local_experts)
    shard = _expert_ids(etp, topk_idx.device)   # arange(ETP), made once per device
    virtual = (ep.unsqueeze(-1) * etp + shard) * num_local_experts + local.unsqueeze(-1)
    virtual = torch.where(topk_idx.unsqueeze(-1) >= 0, virtual, -1).reshape(wide)
    weights = topk_weights.unsqueeze(-1).expand(num_tokens, topk, etp).reshape(wide)
    return virtual, weights


def expert_tp_problems(ep_group, etp_group, tp_ep_group) -> list:
    """What keeps MoK from running expert tensor parallelism over these groups (empty: it
    can): the TPxEP group must hold the ranks in Megatron's order, EP rank ``e`` / expert-TP
    rank ``t`` at ``e * ETP + t``, which :func:`expand_routes_for_expert_tp` routes by.
    Checked on this rank's three groups, no communication. (The sizes the CUDA kernels take
    are checked at config time: :func:`config.config_problems`.)"""
    import torch.distributed as dist

    if not dist.is_initialized():
        return []
    me = dist.get_rank()
    tp_ep = dist.get_process_group_ranks(tp_ep_group)
    ep_ranks = dist.get_process_group_ranks(ep_group)
    tp_ranks = dist.get_process_group_ranks(etp_group)
    etp = len(tp_ranks)
    e, t = ep_ranks.index(me), tp_ranks.index(me)
    expected = {e2 * etp + t: r for e2, r in enumerate(ep_ranks)}
    expected.update({e * etp + t2: r for t2, r in enumerate(tp_ranks)})
    if len(tp_ep) == len(ep_ranks) * etp and all(tp_ep[i] == r for i, r in expected.items()):
        return []
    return [f"the TPxEP group's ranks {tp_ep} are not in Megatron's order for EP group "
            f"{ep_ranks} and expert-TP group {tp_ranks} (EP rank e, expert-TP rank t at "
            "e * ETP + t), which MoK's expert-TP routing assumes"]


class _GroupKey:
    """A process group as a dict key, by identity (``is``), holding the group: an ``id()``
    alone can be taken by a later group once the first is freed; held by the key, the group
    cannot be freed while its entry exists (``reset_buffers`` drops the entries)."""

    __slots__ = ("group",)

    def __init__(self, group):
        self.group = group

    def __hash__(self) -> int:
        return id(self.group)

    def __eq__(self, other) -> bool:
        return isinstance(other, _GroupKey) and other.group is self.group


def _capturing() -> bool:
    """Whether the current CUDA stream is being captured into a graph (no host sync allowed)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def check_errors() -> bool:
    """Raise :class:`~megatron_mok.cuda.errors.MokDeviceError` if a kernel of any Buffer shared
    by this process's MoK layers reported an error (``Buffer.check_errors`` on each: a device
    synchronisation per Buffer's device, then a 32-byte read). Returns ``False``, checking
    nothing, while the current CUDA stream is being captured into a graph (a sync would break
    the capture); ``True`` otherwise.

    Why a separate check: the CUDA backend reads its device error report on the host only in an
    eager dispatch (with the row count ``R``). A combine's or a backward's error (a timeout, a
    peer that stopped) is written on the device only, so without this it surfaces at the next
    step's first dispatch, after the optimizer step has used the step's gradients; and under
    CUDA graphs (drop-and-pad: ``rows_per_expert``) nothing of the dispatch reads at all.
    ``install()`` runs this after each of Megatron's forward-backward schedules
    (``MOK_CHECK_ERRORS``, :func:`~megatron_mok.megatron.config.error_check_mode`).
    """
    if _capturing():
        return False
    for buf in _live_buffers():
        buf.check_errors()
    return True


def _live_buffers() -> list:
    """The shared Buffers not destroyed, as a list taken under the lock (the caller acts on each
    outside it)."""
    with _LOCK:
        return [buf for buf in _BUFFERS.values() if not buf._destroyed]


def stop_buffers(exc: BaseException) -> None:
    """``Buffer.abort`` on every Buffer shared by this process's MoK layers, for ``exc`` that
    ended this rank's step (the forward-backward schedules' hook, ``_patch._checked_after``):
    its EP peers may be waiting for it in any layer's dispatch or combine. Nothing for a
    :class:`~megatron_mok.cuda.errors.MokDeviceError` (the CUDA backend stopped when it raised
    it) or in a world of one rank; a stop that fails warns and hides nothing."""
    for buf in _live_buffers():
        buf._abort_after(exc)


class MokTokenDispatcher(MoETokenDispatcher):
    """MoK token dispatcher for Megatron-Core's ``MoELayer`` (``moe_token_dispatcher_type="mok"``).

    Args:
        num_local_experts: experts on this rank (``num_moe_experts / EP``).
        local_expert_indices: their global ids; must be ``[r*E_local, (r+1)*E_local)`` for
            EP rank ``r`` (the layout the Buffer uses).
        config: the ``TransformerConfig``.
        pg_collection: Megatron's ``ProcessGroupCollection`` (``ep``, ``expt_tp``, ``tp_ep``);
            the Buffer's group is ``ep``, or ``tp_ep`` with expert TP.
    """

    def __init__(self, num_local_experts: int, local_expert_indices: List[int], config,
                 pg_collection=None) -> None:
        if pg_collection is None:
            from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

            pg_collection = get_default_pg_collection()
        super().__init__(config=config, pg_collection=pg_collection)
        # The per-step device-error check and the Buffer reset on destroy_model_parallel. Made
        # by install(); here too for a patched Megatron-LM tree (docs/MEGATRON.md, way 3),
        # which builds this class without install(). Idempotent.
        from . import _patch

        _patch.install_runtime_hooks()
        problems = config_problems(config)
        self.options = MokOptions.from_config(config)
        # MOK_CHECK_ERRORS=call: Buffer.check_errors after each forward dispatch and combine.
        self.check_each_call = error_check_mode() == "call"
        # Expert tensor parallelism (ETP = self.tp_size, Megatron's expt_tp group): see
        # expand_routes_for_expert_tp. The Buffer then spans the TPxEP group.
        self.etp = self.tp_size
        self.group = self.tp_ep_group if self.etp > 1 else self.ep_group
        if self.etp > 1:
            problems += expert_tp_problems(self.ep_group, self.tp_group, self.tp_ep_group)
        # Drop-and-pad (see the module docstring). Megatron's config check asks for the
        # capacity factor; this catches a config edited after that check.
        # Both are read at every dispatch, under alltoall's attribute names: Megatron's
        # inference (set_decode_expert_padding, for moe_pad_experts_for_cuda_graph_inference)
        # sets them on a built dispatcher to switch drop-and-pad on for CUDA-graphed decode
        # steps and off for prefill.
        self.drop_and_pad = bool(getattr(config, "moe_pad_expert_input_to_capacity", False))
        self.moe_expert_capacity_factor = getattr(config, "moe_expert_capacity_factor", None)
        if self.drop_and_pad and self.capacity_factor is None:
            problems.append("moe_pad_expert_input_to_capacity is set without "
                            "moe_expert_capacity_factor; set the capacity factor")
        if problems:
            raise MokConfigError("MokTokenDispatcher cannot run this config:\n  - "
                                 + "\n  - ".join(problems))
        self.num_local_experts = num_local_experts
        self.local_expert_indices = list(local_expert_indices)
        self.num_experts = config.num_moe_experts
        self.topk = config.moe_router_topk
        self.ep_rank = mcore_utils.get_pg_rank(self.ep_group)
        expected = list(range(self.ep_rank * num_local_experts,
                              (self.ep_rank + 1) * num_local_experts))
        if self.local_expert_indices != expected:
            raise ValueError(f"MoK needs local experts {expected} on EP rank {self.ep_rank}, got "
                             f"{self.local_expert_indices}")
        # "auto": device unless the experts read the counts on the host and cannot take a
        # device tensor (set by the MoELayer patch once the experts exist).
        self.tokens_per_expert_on_host = self.options.tokens_per_expert == "host"
        # Partial CUDA graphs (scopes moe_router + moe_preprocess; Megatron's local impl always
        # takes both): dispatch_preprocess runs inside the router's graph and token_dispatch
        # eagerly after it, and at replay no Python of the graph runs. Megatron then hands the
        # tensors named here from the graph's outputs back to this object before
        # token_dispatch (0.16 / 0.19: MoETransformerLayer, and the TE impl's early-return
        # signal). The top-k ids are the one tensor preprocess leaves for the dispatch, kept
        # as [*leading dims of the layer's input, K] so that the input's shape travels with
        # them; the rest is recomputed in token_dispatch (hidden_shape, the capacity) or the
        # same for every call of the layer (the probs dtype). An eager call of another shape
        # between the router's graph and the dispatch (evaluation) then changes nothing.
        self.cudagraph_attrs = ["_topk_idx"]
        # megatron-core 0.19's per-rank receive budget (budget.py): the factor, read at every
        # dispatch, and the over-budget flag live here, where Megatron's PagedStashRunner
        # reaches them (token_dispatcher._comm_manager, HybridEP's manager in 'flex'). Made
        # on every mok dispatcher: 0.16 configs have no such field (None: no budget).
        self._comm_manager = RankBudget(getattr(config, "moe_expert_rank_capacity_factor", None))
        # What the experts get under a budget: budget.EXACT (the kept rows, one host read) or
        # budget.PADDED (all M rows, device counts; no host read). Set by
        # configure_for_experts from the experts' class; may be set directly (tests).
        self.budget_rows = budget.EXACT
        self.buffer = None
        self.hidden_shape = None
        self._topk_idx: Optional[torch.Tensor] = None
        self._probs_dtype: Optional[torch.dtype] = None
        self._handle = None
        self._tokens_per_expert: Optional[torch.Tensor] = None
        # This call's budget M (token_dispatch -> dispatch_postprocess), and the rows the
        # experts' output is padded back to (dispatch_postprocess -> combine_preprocess).
        self._recv_budget: Optional[int] = None
        self._pad_output_to: Optional[int] = None

    # ------------------------------------------------------------------------- configuring
    def configure_for_experts(self, experts) -> None:
        """Fit the dispatcher to ``experts`` (called by the ``MoELayer`` patch once they exist).

        Where ``tokens_per_expert`` lives (``MOK_TOKENS_PER_EXPERT=auto``): Megatron 0.16's
        legacy ``GroupedMLP`` hands the counts to ``grouped_gemm``, which wants a host tensor;
        every other expert class takes a device tensor (SequentialMLP and unfused TEGroupedMLP
        call ``.tolist()`` themselves; 0.19's fused TEGroupedMLP uses it on the device with no
        host sync). With drop-and-pad the counts are known on the host and made there,
        whatever this picks (:meth:`token_dispatch`).

        What they get under the per-rank budget (:attr:`budget_rows`,
        :func:`budget.expert_rows_mode`): the budget's ``M`` rows (0.19's fused TEGroupedMLP,
        or experts that set ``mok_takes_padded_rows = True``) or the kept rows only. The
        latter read the row count on the host, so with a full-iteration CUDA graph and the
        budget they are refused here (:class:`MokConfigError`), as are host counts.
        """
        if self.options.tokens_per_expert == "auto":
            self.tokens_per_expert_on_host = type(experts).__name__ == "GroupedMLP"
        self.budget_rows = budget.expert_rows_mode(experts, self.config)
        problem = budget.full_iteration_problem(self.config, self.budget_rows,
                                                self.tokens_per_expert_on_host,
                                                type(experts).__name__)
        if problem:
            raise MokConfigError(f"MokTokenDispatcher cannot run this config:\n  - {problem}")

    def set_shared_experts(self, shared_experts):
        """``moe_shared_expert_overlap``: run ``shared_experts`` (Megatron's ``SharedExpertMLP``)
        on its own stream beside the dispatch and the combine (see :meth:`token_dispatch`)."""
        super().set_shared_experts(shared_experts)   # checks the config flag, keeps the module

    def num_sms(self) -> Optional[int]:
        """SMs of MoK's kernels in this layer: ``MOK_NUM_SMS`` when set; else Megatron's
        ``moe_flex_dispatcher_num_sms`` when set (megatron-core 0.19+: the SM budget of the flex
        dispatchers MoK replaces, so one recipe A/Bs both at the same budget); else
        :data:`LAYER_NUM_SMS` when nothing runs beside them, or ``None`` (the Buffer's default:
        24, 64 for calls of at most 1024 tokens per rank) with ``moe_shared_expert_overlap``,
        where the shared expert's GEMMs run beside the dispatch and the combine, and with
        ``overlap_moe_expert_parallel_comm``, where another micro-batch's compute does.
        (Older releases' ``moe_deepep_num_sms`` is not read: it defaults to 20, so a value there
        does not say that the user chose it.)"""
        if self.options.num_sms is not None:
            return self.options.num_sms
        flex = getattr(self.config, "moe_flex_dispatcher_num_sms", None)
        if flex is not None:
            if int(flex) <= 0:
                raise MokConfigError(f"moe_flex_dispatcher_num_sms must be > 0, got {flex}")
            return int(flex)
        return self._default_num_sms()

    def _default_num_sms(self) -> Optional[int]:
        """:meth:`num_sms` when neither knob is set."""
        if (getattr(self.config, "moe_shared_expert_overlap", False)
                or getattr(self.config, "overlap_moe_expert_parallel_comm", False)):
            return None
        return LAYER_NUM_SMS

    def expert_alignment(self) -> int:
        """Rows per local expert are padded to this multiple (zero rows, prob 0) with
        ``moe_router_padding_for_quantization``: Megatron's alignment for the FP8 / FP4 grouped
        GEMMs (16; 32 for MXFP8; 256 with TE's op fuser). The dispatch writes its rows there
        directly, so the experts skip their own padding copy (``skip_routed_expert_padding``).
        1 otherwise."""
        if not getattr(self.config, "moe_router_padding_for_quantization", False):
            return 1
        from megatron.core.transformer.moe.moe_utils import get_align_size_for_quantization

        return max(1, int(get_align_size_for_quantization(self.config)))

    def _get_buffer(self, hidden: torch.Tensor):
        import megatron_mok as mok

        opts = self.options
        group = self.group
        gkey = _GroupKey(group)
        num_tokens = hidden.shape[0]
        with _LOCK:
            t_max = opts.max_tokens_per_rank or _T_MAX.get(gkey)
        if t_max is None:
            # First dispatch in this process: agree on T_max across the Buffer's ranks (they
            # all reach their first MoE layer together). One all-reduce, never repeated.
            t = torch.tensor([num_tokens], dtype=torch.int64, device=hidden.device)
            if self.ep_size * self.etp > 1:
                torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=group)
            t_max = max(int(t.item()), 1)
            with _LOCK:
                _T_MAX[gkey] = t_max
        kwargs = {name: getattr(opts, name) for name in ("ring_bytes", "timeout_s")
                  if getattr(opts, name) is not None}
        if opts.timeout_s is None:
            # Neither MOK_TIMEOUT_S nor config.moe_mok_timeout_s: wait for a late EP peer as
            # long as the group's own collectives would (Megatron: --distributed-timeout-minutes,
            # 10 by default), so a straggler that alltoall's NCCL all-to-all would wait for does
            # not end the job under mok (NOTES item 61); the Buffer default (60 s) if unreadable.
            group_timeout = group_timeout_seconds(group)
            if group_timeout is not None:
                kwargs["timeout_s"] = group_timeout
        num_sms = self.num_sms()
        if num_sms is not None:
            kwargs["num_sms"] = num_sms
        alignment = self.expert_alignment()
        if alignment > 1:
            kwargs["expert_alignment"] = alignment
        # Layers whose knobs differ (config.moe_mok_<name>) get Buffers of their own.
        # With expert TP the Buffer sees E x ETP experts and K x ETP routes per token
        # (expand_routes_for_expert_tp).
        num_experts, topk = self.num_experts * self.etp, self.topk * self.etp
        key = (gkey, num_experts, hidden.shape[1], topk, hidden.dtype, opts.backend,
               opts.combine_partial_dtype, t_max, str(hidden.device), tuple(sorted(kwargs.items())))
        with _LOCK:
            buf = _BUFFERS.get(key)
        if buf is not None and buf._destroyed:
            buf = None          # destroyed behind the cache's back (Buffer.destroy): a new one
        if buf is None:
            buf = mok.Buffer(group, num_experts=num_experts, hidden=hidden.shape[1],
                             topk=topk, max_tokens_per_rank=t_max, dtype=hidden.dtype,
                             backend=opts.backend,
                             combine_partial_dtype=opts.combine_partial_dtype, **kwargs)
            with _LOCK:
                _BUFFERS[key] = buf
            flex = getattr(self.config, "moe_flex_dispatcher_num_sms", None)
            if opts.num_sms is None and flex is not None:
                # Not silent either: a recipe written for flex now also sets MoK's budget.
                warnings.warn(f"MoK: {num_sms} SMs from moe_flex_dispatcher_num_sms (the flex "
                              f"dispatchers' budget, so an A/B runs both at one budget); MOK_NUM_SMS "
                              f"sets MoK's own (its default here: {self._default_num_sms()})",
                              stacklevel=2)
            if (hidden.is_cuda and opts.backend == "auto"
                    and "cuda" not in mok.available_backends(hidden.device)):
                # Not silent: the reference backend is correct but slow (all-gathers tokens).
                warnings.warn("MoK: the CUDA backend is not built, or built for another GPU (its "
                              "kernels run on Hopper, sm_90a), so the Megatron dispatcher runs "
                              "the pure-torch reference backend on GPU tensors (correct, slow). "
                              "Build the extension, or set MOK_BACKEND=reference to say you mean it.",
                              stacklevel=2)
        if num_tokens > t_max:
            # This rank's alone: its EP peers are already in this dispatch, waiting for it.
            # The Buffer (made first: its creation is collective) is stopped in place of that
            # dispatch, so they raise at once, naming this rank, instead of waiting until their
            # timeout (the reference backend tells them in the dispatch's first exchange).
            msg = (f"MoK: this MoE layer got {num_tokens} tokens on EP rank {self.ep_rank}, more "
                   f"than the Buffer's max_tokens_per_rank={t_max} (fixed at the first dispatch). "
                   f"Set MOK_MAX_TOKENS_PER_RANK to the largest sequence_length * micro_batch_size "
                   f"/ TP (with sequence parallelism) any step will use.")
            buf.abort(msg, skipped_call=True)
            raise ValueError(msg)
        return buf

    @property
    def backend_name(self) -> Optional[str]:
        """The backend the shared Buffer runs (``None`` before the first dispatch)."""
        if self.buffer is None:
            return None
        return self.buffer.backend

    # ---------------------------------------------------------------------------- dispatch
    def dispatch_preprocess(self, hidden_states: torch.Tensor, routing_map: torch.Tensor,
                            probs: torch.Tensor):
        """``[S, B, H]`` (or ``[T, H]``) tokens + dense routing -> ``[T, H]`` and top-k weights.

        Returns ``(hidden_states [T, H], topk_weights [T, K] float32)``; the top-k expert ids
        are kept for :meth:`token_dispatch`.
        """
        if routing_map.dim() != 2 or routing_map.dtype != torch.bool:
            raise ValueError(f"routing_map must be a [T, E] bool tensor, got "
                             f"{tuple(routing_map.shape)} {routing_map.dtype}")
        if probs.shape != routing_map.shape:
            raise ValueError(f"probs {tuple(probs.shape)} must match routing_map "
                             f"{tuple(routing_map.shape)}")
        # token_dispatch takes the layer input's shape from the ids (see __init__).
        leading = hidden_states.shape[:-1]
        hidden_states = hidden_states.reshape(-1, hidden_states.shape[-1])
        self._probs_dtype = probs.dtype
        if self.drop_and_pad:
            # The router filled each expert's column up to `capacity` tokens with padding
            # routes of prob exactly 0 (its probs are 0 off the top-k). Drop them: they never
            # cross the exchange, the Buffer puts zero rows in their place. A real route has
            # prob > 0 for softmax / sigmoid scores; one that underflowed to 0 would add
            # nothing anyway: its output term and expert gradients are scaled by that 0, and
            # a score that is exactly 0 has zero derivative w.r.t. the router logits
            # (softmax: p_i (d_ij - p_j); sigmoid: p (1 - p)). (fp16 probs without an fp32
            # router dtype: a score below ~6e-8 rounds to 0 there, and its logit gradient is
            # scaled by that tiny score, not exactly 0.) After this mask each token has at most
            # K routes again.
            routing_map = routing_map & (probs != 0)
        topk_idx, topk_weights = routing_map_to_topk(routing_map, probs, self.topk)
        self._topk_idx = topk_idx.view(*leading, self.topk)
        return hidden_states, topk_weights

    def token_dispatch(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        """``Buffer.dispatch``: returns expert-major ``(tokens [R, H], probs [R] float32)``.

        Under the per-rank budget (:meth:`recv_budget` not ``None``): ``[M, H]`` and ``[M]``,
        the kept rows first, zero rows after; this rank's over-budget flag is ORed into
        ``_comm_manager.over_budget`` on the device (:meth:`check_over_budget`).

        With overlapped shared experts, their input copy and fc1 are queued on the shared
        experts' stream first: the eager dispatch blocks the host at its one read of ``R``,
        so work queued before it runs beside the layout and the transfer kernels (Megatron's
        ``alltoall`` queues fc1 after its token all-to-all, where the host does not block).
        MoK's kernels take ``num_sms`` SMs; the shared experts' GEMMs get the rest.
        """
        hidden_states = hidden_states.contiguous()
        ids = self._topk_idx
        if ids is None or ids[..., 0].numel() != hidden_states.shape[0]:
            raise RuntimeError(
                "MoK: token_dispatch needs the top-k ids of these tokens from dispatch_preprocess "
                f"({hidden_states.shape[0]} tokens; ids: "
                f"{None if ids is None else tuple(ids.shape)}). Under partial CUDA graphs "
                "(moe_router / moe_preprocess) Megatron restores them from the router graph's "
                "outputs through cudagraph_attrs; a custom layer must call dispatch_preprocess "
                "(or restore those attributes) before every token_dispatch.")
        # The layer input's shape, for the shared experts' input and combine_postprocess.
        self.hidden_shape = torch.Size((*ids.shape[:-1], hidden_states.shape[-1]))
        ids = ids.reshape(-1, self.topk)
        if self.etp > 1:
            ids, probs = expand_routes_for_expert_tp(ids, probs, self.num_local_experts, self.etp)
        # First: a call with too many tokens raises here, before the shared experts' hooks
        # start (Megatron 0.19 checks their order: a half-run forward would fail the next one).
        self.buffer = self._get_buffer(hidden_states)
        rows = self.rows_per_expert(hidden_states.shape[0]) if self.drop_and_pad else None
        recv_budget = self.recv_budget(hidden_states.shape[0])
        shared = self.shared_experts
        if shared is not None:
            # pre_forward_comm makes the shared stream wait for the current one (the input).
            shared.pre_forward_comm(hidden_states.view(self.hidden_shape))
            shared.linear_fc1_forward_and_act()
        with _CommStream(self._comm_stream(hidden_states)) as comm:
            res = self.buffer.dispatch(hidden_states, ids, probs, rows_per_expert=rows,
                                       recv_budget=recv_budget)
            comm.hand_over(res.tokens, res.probs, res.tokens_per_expert)
            if recv_budget is not None:
                comm.hand_over(res.over_budget)     # read by the current stream below
        self._topk_idx = None
        self._handle = res.handle
        self._recv_budget = recv_budget
        self._pad_output_to = None      # (set again by dispatch_postprocess for this call)
        if recv_budget is not None:
            # On the current stream, after it joined the dispatch's: in place, no host read.
            self._comm_manager.accumulate(res.over_budget)
        if self.check_each_call and not _capturing():
            self.buffer.check_errors()
        if rows is None:
            self._tokens_per_expert = res.tokens_per_expert
        else:
            # Known without reading the device (as alltoall's drop-and-pad counts): a host
            # tensor, which every expert class takes (SequentialMLP's .tolist() then costs no
            # sync); on the device only when MOK_TOKENS_PER_EXPERT=device asks (a fill kernel,
            # no host read).
            on_device = self.options.tokens_per_expert == "device"
            self._tokens_per_expert = torch.full(
                (self.num_local_experts,), rows, dtype=torch.long,
                device=res.tokens.device if on_device else "cpu")
        return res.tokens, res.probs

    def recv_budget(self, num_tokens: int) -> Optional[int]:
        """``M``, the rows this rank's dispatch of ``num_tokens`` tokens returns under
        megatron-core 0.19's per-rank budget (with :attr:`buffer` set); ``None`` without one:
        no factor (a 0.16 config; Megatron's ``PagedStashRunner`` clears it on
        ``_comm_manager`` for its dropless rerun) or drop-and-pad (whose
        :meth:`rows_per_expert` wins, as in HybridEP).

        HybridEP's ``int(T x topk x factor)`` (``_HybridEPManager.setup_metadata``), with
        ``topk x ETP`` routes per token (each route goes to every expert-TP rank,
        :func:`expand_routes_for_expert_tp`; NCCL EP also counts ``tp_size x topk``, HybridEP
        ``topk`` alone), rounded up to the Buffer's ``expert_alignment`` and to Megatron's
        quantization pad multiple (:func:`budget.budget_alignment`; HybridEP rounds to the
        latter). ``T`` is this call's token count on this rank.
        """
        factor = self._comm_manager.moe_expert_rank_capacity_factor
        if factor is None or self.drop_and_pad:
            return None
        align = budget.budget_alignment(self.config, self.buffer.expert_alignment)
        return budget.rank_budget(num_tokens, self.topk * self.etp, factor, align)

    def check_over_budget(self) -> torch.Tensor:
        """``[1]`` bool: ``True`` when a budgeted dispatch of this layer dropped rows on this
        rank since the last :meth:`reset_over_budget` (on the Buffer's device; a fresh ``False``
        on the CPU before the first budgeted dispatch). No host read: Megatron's
        ``PagedStashRunner`` ORs it over the layers and all-reduces it after the step, as for
        ``MoEFlexTokenDispatcher.check_over_budget``."""
        return self._comm_manager.flag()

    def reset_over_budget(self) -> None:
        """Clear :meth:`check_over_budget`'s flag in place (``PagedStashRunner`` before its
        dropless rerun)."""
        self._comm_manager.reset()

    @property
    def capacity_factor(self) -> Optional[float]:
        """Drop-and-pad's capacity factor: :attr:`moe_expert_capacity_factor` (see ``__init__``)."""
        return self.moe_expert_capacity_factor

    def rows_per_expert(self, num_tokens: int) -> int:
        """Drop-and-pad: ``N``, the rows every local expert gets when this rank dispatches
        ``num_tokens`` tokens (with :attr:`buffer` set).

        ``capacity x EP x ETP``, ``capacity`` being Megatron's for these tokens (the router's
        ``apply_router_token_dropping`` and alltoall's preprocess compute the same number).
        Taken from the dispatched token count, not in ``dispatch_preprocess``: under partial
        CUDA graphs that runs only while captured, and an eager call of another token count in
        between would leave its capacity. Each of the ranks exchanging tokens through the
        Buffer (the EP group, the TPxEP group with expert TP) sends an expert at most
        ``capacity`` routes (the router's per-column cap), so the rows fit when every rank has
        the same token count, which ``alltoall``'s drop-and-pad assumes too (a rank with more
        tokens, hence a larger capacity, could overflow a peer's expert: an error, raised by
        the reference backend at the dispatch, by the CUDA backend at its next host read). It
        is what ``alltoall`` gives (``capacity x tp_size x ep_size``).

        With ``moe_router_padding_for_quantization`` it is rounded up to the Buffer's
        ``expert_alignment`` (Megatron's FP8 / FP4 alignment): the Buffer needs ``N`` to be a
        multiple of it, and the experts, which then skip their own padding, need every
        expert's row count aligned for the quantized grouped GEMM. The extra rows are zero
        rows. Without that flag the alignment is 1.
        """
        if self.capacity_factor is None:    # set on a built dispatcher (see __init__)
            raise MokConfigError("MokTokenDispatcher: drop_and_pad is on but "
                                 "moe_expert_capacity_factor is None; set the capacity factor")
        capacity = get_capacity(num_tokens=num_tokens * self.topk, num_experts=self.num_experts,
                                capacity_factor=self.capacity_factor)
        n = capacity * self.buffer.world_size
        align = self.buffer.expert_alignment
        return -(-n // align) * align

    def dispatch_postprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        """No data movement: ``(tokens [R, H], tokens_per_expert [E_local] int64, probs [R])``.

        ``probs`` comes back in the router's dtype (as ``alltoall`` returns it);
        ``tokens_per_expert`` is on the device, or on the host for experts that need it
        (that copy is the one host sync of this dispatcher; see docs/MEGATRON.md). With
        drop-and-pad it is ``[N] * E_local`` made on the host (``R = E_local x N``): no copy.

        Under the per-rank budget: ``[M, H]`` / ``[M]`` with the counts of the kept rows for
        :data:`budget.PADDED` experts; for :data:`budget.EXACT` ones views of the ``n`` kept
        rows (``n`` read on the host), whose output :meth:`combine_preprocess` pads back.
        """
        tokens_per_expert = self._tokens_per_expert
        self._tokens_per_expert = None
        recv_budget, self._recv_budget = self._recv_budget, None
        if recv_budget is not None and self.budget_rows == budget.EXACT:
            kept = budget.kept_rows(self._handle)
            hidden_states, probs = hidden_states[:kept], probs[:kept]
            self._pad_output_to = recv_budget
        if self.tokens_per_expert_on_host and tokens_per_expert.device.type != "cpu":
            tokens_per_expert = tokens_per_expert.cpu()
        if self._probs_dtype is not None and probs.dtype != self._probs_dtype:
            probs = probs.to(self._probs_dtype)
        return hidden_states, tokens_per_expert, probs

    # ----------------------------------------------------------------------------- combine
    def combine_preprocess(self, hidden_states: torch.Tensor):
        """Expert output rows are already in dispatch order: nothing to undo. Under the
        per-rank budget with :data:`budget.EXACT` experts, their ``[n, H]`` output is padded
        with zero rows to the budget's ``[M, H]``, which the combine takes."""
        pad_to, self._pad_output_to = self._pad_output_to, None
        if pad_to is not None:
            hidden_states = budget.pad_rows(hidden_states, pad_to)
        return hidden_states.contiguous()

    def token_combine(self, hidden_states: torch.Tensor, *args, **kwargs):
        """``Buffer.combine``: unweighted per-token sum of the expert rows -> ``[T, H]``."""
        if self._handle is None:
            raise RuntimeError("MoK: token_combine called without a preceding token_dispatch")
        handle, self._handle = self._handle, None
        shared = self.shared_experts
        if shared is not None:
            # fc2 after the routed experts (they should not share the SMs with it: alltoall and
            # flex wait the same way), beside the combine kernel.
            _shared_stream_waits_for_current(shared)
            shared.linear_fc2_forward()
            shared.post_forward_comm()
        with _CommStream(self._comm_stream(hidden_states)) as comm:
            y = self.buffer.combine(hidden_states, handle)
            comm.hand_over(y)
        if self.check_each_call and not _capturing():
            self.buffer.check_errors()
        return y

    def _comm_stream(self, t: torch.Tensor) -> Optional[torch.cuda.Stream]:
        """The stream for MoK's kernels (``MOK_COMM_STREAM``), ``None`` for the current one."""
        if self.options.comm_stream == "current" or not t.is_cuda:
            return None
        key = str(t.device)
        with _LOCK:
            if key not in _COMM_STREAMS:
                lo, hi = torch.cuda.Stream.priority_range()   # hi: the most urgent (lowest)
                _COMM_STREAMS[key] = torch.cuda.Stream(device=t.device, priority=hi)
            return _COMM_STREAMS[key]

    def combine_postprocess(self, hidden_states: torch.Tensor):
        """Back to the layer's input shape, plus the overlapped shared experts' output (the
        current stream waits for theirs; the same sum as ``MoELayer``'s unoverlapped path)."""
        out = hidden_states.view(self.hidden_shape)
        if self.shared_experts is not None:
            out = out + self.shared_experts.get_output()
        return out


class _CommStream:
    """Runs the body on ``stream`` (``None``: on the current stream, nothing to do): the stream
    first waits for the current one (the inputs), and the current stream waits for it after.
    :meth:`hand_over` marks outputs made on ``stream`` as used by the current stream, so the
    caching allocator does not give their memory to later work of ``stream`` while the
    current stream may still read them. Autograd runs the backward of the calls made here on
    ``stream`` too (the stream of their forward) and joins the streams itself."""

    def __init__(self, stream: Optional[torch.cuda.Stream]):
        self.stream = stream
        self.outer = None
        self._ctx = None

    def __enter__(self):
        if self.stream is not None:
            self.outer = torch.cuda.current_stream(self.stream.device)
            self.stream.wait_stream(self.outer)
            self._ctx = torch.cuda.stream(self.stream)
            self._ctx.__enter__()
        return self

    def hand_over(self, *tensors) -> None:
        if self.stream is not None:
            for t in tensors:
                if t is not None and t.is_cuda:
                    t.record_stream(self.outer)

    def __exit__(self, *exc):
        if self.stream is not None:
            self._ctx.__exit__(*exc)
            self.outer.wait_stream(self.stream)
        return False


def _shared_stream_waits_for_current(shared) -> None:
    """``SharedExpertMLP.wait_current_stream()`` (megatron-core 0.19); 0.16 has no such method
    and its ``pre_forward_comm`` does the same inline."""
    wait = getattr(shared, "wait_current_stream", None)
    if wait is not None:
        wait()
    else:
        shared.stream.wait_stream(torch.cuda.current_stream())


def reset_buffers() -> None:
    """Destroy every shared Buffer and forget the agreed ``T_max`` (tests, re-initialisation).

    ``install()`` runs it at the start of Megatron's ``parallel_state.destroy_model_parallel()``
    (the Buffers are bound to the groups that drops; a re-initialised model then makes new
    Buffers on its new groups, and the old ones' CUDA peer memory is freed). A model built
    before must not run after it: its dispatchers would make Buffers on its dropped groups."""
    with _LOCK:
        bufs = list(_BUFFERS.values())
        _BUFFERS.clear()
        _T_MAX.clear()
        _COMM_STREAMS.clear()
    for b in bufs:
        b.destroy()

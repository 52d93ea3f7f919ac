"""The user-facing object: one :class:`Buffer` per expert-parallel process group."""

from __future__ import annotations

import atexit
import itertools
import sys
import warnings
import weakref
from typing import Optional

import torch

from . import fp8, validation
from .autograd import CachedDispatchFunction, CombineFunction, DispatchFunction
from .comm import group_rank_size, resolve_group
from .cuda.errors import MokDeviceError, MokPeerStopped
from .handle import DispatchHandle, DispatchResult

BACKENDS = ("auto", "reference", "cuda")
# Largest expert_alignment (kMaxExpertAlignment in csrc/include/mok/config.h).
MAX_EXPERT_ALIGNMENT = 1024
_LIVE_BUFFERS: "weakref.WeakSet[Buffer]" = weakref.WeakSet()
# Buffer.serial: handles name their Buffer by it. Not id(): CPython hands a freed Buffer's
# address to the next object of its size, so a handle that outlived its Buffer would be taken
# by a new Buffer at that address (and give wrong results, silently). next() on a count is one
# C call under the GIL, so loopback ranks (threads) making Buffers at once never share one.
_SERIALS = itertools.count(1)
_ANY_CUDA = torch.device("cuda")  # Buffer(device="cuda"): resolved at first use (_cuda_device)


def records_autograd(*args) -> bool:
    """Whether a call on ``args`` must go through its autograd Function: grad mode is on and a
    tensor among them requires grad. Otherwise the backend is called directly: the outputs are
    the same tensors (a Function's outputs carry no gradient then either), without the
    Function's own host time (~10 us per dispatch, ~6 per combine on one H200's host;
    benchmarks/NOTES.md item 73), e.g. in evaluation and inference under ``torch.no_grad()``."""
    return torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)


def _check_num_sms(num_sms) -> None:
    """``num_sms``: ``None`` or an int >= 1 (0 once meant the default, silently)."""
    if num_sms is not None and (not isinstance(num_sms, int) or isinstance(num_sms, bool) or num_sms < 1):
        raise ValueError(f"num_sms must be None or an int >= 1 (the SMs the CUDA backend's kernels "
                         f"may occupy; None: its default), got {num_sms!r}")


def uncaught_exception() -> Optional[BaseException]:
    """The exception the interpreter is exiting with: the one it printed last as uncaught
    (``sys.last_exc``, Python 3.12; ``sys.last_value`` before), else ``None``."""
    return getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)


def exit_reason(exc: BaseException) -> str:
    """What a rank's peers read when it exits with the uncaught ``exc`` (NOTES item 68)."""
    return f"its process is exiting after an uncaught {type(exc).__name__}: {exc}"


@atexit.register
def _destroy_live_buffers() -> None:
    """Free every Buffer's peer memory at exit, before torch tears down its allocators.

    When the process exits with an uncaught exception (raised outside the Buffer's own calls,
    which stop it themselves: an expert, the attention, the loss, the data loader), each
    CUDA-backend Buffer first stops its peers (:meth:`Buffer._stop_at_exit`): a peer waiting in
    a dispatch or combine for this rank raises at once, quoting the exception, instead of
    spinning until its timeout (the EP group's, 10 minutes under Megatron) where the launcher
    does not end it."""
    exc = uncaught_exception()
    for buf in list(_LIVE_BUFFERS):
        # Each step on its own: a stop that cannot launch (a broken CUDA context, say) must not
        # keep the workspace from being freed. Exiting: nothing useful to do with an error here.
        if exc is not None:
            try:
                buf._stop_at_exit(exit_reason(exc))
            except Exception:
                pass
        try:
            buf.destroy()
        except Exception:
            pass


def available_backends(device=None) -> list:
    """Backends usable in this process: always ``reference``; ``cuda`` when the compiled
    library loads and holds code for ``device`` (default: the current CUDA device; the
    default build runs on Hopper, sm_90a, only)."""
    names = ["reference"]
    if torch.cuda.is_available() and _cuda_runs_on(device):
        names.append("cuda")
    return names


def _cuda_runs_on(device=None) -> bool:
    """Whether the CUDA library loads and has code for ``device`` (a CUDA device or index;
    ``None``: the current one)."""
    from .cuda import library

    if not library.is_available():
        return False
    if device is None:
        index = torch.cuda.current_device()
    else:
        index = torch.device(device).index if not isinstance(device, int) else device
        index = torch.cuda.current_device() if index is None else index
    return library.kernel_arch(index)[0] is not None


class Buffer:
    """Dispatch/combine engine for one expert-parallel group (see ``docs/CONTRACT.md``).

    Args:
        group: the expert-parallel ``ProcessGroup`` (``None``: the default group, or a
            single process when torch.distributed is not initialised), or a
            ``megatron_mok.loopback`` rank (test ranks as threads on one device).
        num_experts: ``E``, global experts; rank ``r`` owns ``[r*E/W, (r+1)*E/W)``.
        hidden: ``H``, the token width.
        topk: ``K``, routed slots per token.
        max_tokens_per_rank: ``T_max``, the most tokens any rank passes to one dispatch.
        dtype: token dtype (bfloat16, float16 or float32).
        backend: ``"auto"`` (``cuda`` for CUDA tensors when the library is built, else
            ``reference``), ``"reference"`` or ``"cuda"``.
        combine_partial_dtype: dtype of the per-rank partial sums combine moves between
            ranks; ``None`` = ``dtype`` (half the bytes), ``torch.float32`` = round once.
        max_recv_tokens: static-shape mode: ``dispatch`` returns exactly this many rows
            (zero padding after the ``R`` real ones) and the CUDA path never syncs the host
            (CUDA-graph capturable); more than this many rows is an error, raised at the
            next host read, never silent loss (the CUDA backend raises at ``check_errors``;
            until then ``tokens_per_expert`` and ``num_rows_device`` count only the rows
            written, the first ``max_recv_tokens``: docs/CONTRACT.md, "Static shape").
        num_sms: CUDA backend: SMs its communication kernels may occupy. ``None`` (default):
            24 for calls of more than 1024 tokens on the rank, 64 for smaller calls, which are
            latency-bound (``MOK_SMALL_CALL_SMS`` / ``MOK_SMALL_CALL_TOKENS`` change that); a
            number given (an int >= 1; the kernels use at least 2 and at most the device's
            SMs) applies to every call. 0, negative numbers and bools are a ``ValueError``.
        ring_bytes: CUDA backend: size of each staging ring in bytes (default 256 MiB).
        timeout_s: CUDA backend: a spin-wait that sees no progress for this long reports
            rank, peer and what it waited for, and the call raises (default
            ``$MOK_TIMEOUT_S`` or 60 s). Reference backend: the longest any of its
            collectives waits for the group's other ranks, then ``MokTimeout``.
        expert_alignment: ``A >= 1``. With ``A > 1`` each local expert's rows are followed
            by zero rows up to a multiple of ``A`` rows (``probs`` 0, ``src_rank`` /
            ``src_token`` -1); ``R`` and ``tokens_per_expert`` count them, ``combine`` never
            reads them. FP8 grouped GEMMs want 16 (32 for MXFP8): the dispatch writes the rows
            in place, so the experts need no padding copy of their own (docs/CONTRACT.md).
        device: the device this Buffer works on; every tensor passed to it must be there
            (``ValueError`` otherwise, before any communication). ``None``: the first tensor's
            device, or for ``backend="cuda"`` the current CUDA device when the Buffer is made.
            ``"cuda"`` (no index): ``torch.cuda.current_device()`` when the Buffer is first used
            (made, for ``backend="cuda"``). Either way it is fixed from then on: the CUDA
            backend's workspace lives on that GPU, and a tensor on another GPU is refused.

    Attributes:
        serial: an int unique to this Buffer in the process, never reused (not even after
            ``destroy()`` and garbage collection); the handles of its dispatches carry it
            (``DispatchHandle.buffer_id``) and no other Buffer takes them.
    """

    def __init__(self, group=None, *, num_experts: int, hidden: int, topk: int,
                 max_tokens_per_rank: int, dtype: torch.dtype = torch.bfloat16,
                 backend: str = "auto", combine_partial_dtype: Optional[torch.dtype] = None,
                 max_recv_tokens: Optional[int] = None, num_sms: Optional[int] = None,
                 ring_bytes: Optional[int] = None, timeout_s: Optional[float] = None,
                 device: Optional[torch.device] = None, expert_alignment: int = 1):
        self.group = resolve_group(group)
        self.rank, self.world_size = group_rank_size(self.group)
        validation.check_buffer_args(self.world_size, num_experts, hidden, topk,
                                     max_tokens_per_rank, dtype)
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        partial = dtype if combine_partial_dtype is None else combine_partial_dtype
        if partial not in (dtype, torch.float32):
            raise TypeError(f"combine_partial_dtype must be None, the token dtype ({dtype}) or "
                            f"torch.float32, got {combine_partial_dtype}")
        if max_recv_tokens is not None and (not isinstance(max_recv_tokens, int) or max_recv_tokens < 0):
            raise ValueError(f"max_recv_tokens must be None or an int >= 0, got {max_recv_tokens!r}")
        _check_num_sms(num_sms)
        if (not isinstance(expert_alignment, int) or isinstance(expert_alignment, bool)
                or not 1 <= expert_alignment <= MAX_EXPERT_ALIGNMENT):
            raise ValueError(f"expert_alignment must be an int in [1, {MAX_EXPERT_ALIGNMENT}], "
                             f"got {expert_alignment!r}")
        self.num_experts = num_experts
        self.num_local_experts = num_experts // self.world_size
        self.hidden = hidden
        self.topk = topk
        self.max_tokens_per_rank = max_tokens_per_rank
        self.dtype = dtype
        self.combine_partial_dtype = partial
        self.max_recv_tokens = max_recv_tokens
        self.expert_alignment = expert_alignment
        self.requested_backend = backend
        self.num_sms, self.ring_bytes, self.timeout_s = num_sms, ring_bytes, timeout_s
        self.device = torch.device(device) if device is not None else None
        self._backends = {}
        self._destroyed = False
        self._aborted: Optional[str] = None   # abort()'s reason
        # Inside dispatch / combine, before the reference backend's first exchange of the call:
        # an error now means this rank skips a call its peers make (Buffer.abort tells them).
        self._status_due = False
        self.serial = next(_SERIALS)
        # MOK_FP8_PACK=1 (read once: fp8.pack_always) packs FP8 pairs instead of reading them in place.
        self._fp8_pack = fp8.pack_always()
        _LIVE_BUFFERS.add(self)
        if backend == "cuda":
            self._get_backend("cuda")   # fail early, with the build hint, if unavailable

    # ---------------------------------------------------------------------------- public API
    def dispatch(self, x, topk_idx: Optional[torch.Tensor] = None,
                 topk_weights: Optional[torch.Tensor] = None, *,
                 handle: Optional[DispatchHandle] = None,
                 rows_per_expert: Optional[int] = None,
                 recv_budget: Optional[int] = None) -> DispatchResult:
        """Send each routed token to the ranks of its experts.

        Args:
            x: ``[T, H]`` tokens, the Buffer's dtype, contiguous, on the Buffer's device;
                ``T`` may be 0. The CUDA backend copies an ``x`` whose data pointer is not a
                multiple of 16 bytes (a view at an element offset) before anything is sent:
                its kernels move 16-byte vectors (docs/CONTRACT.md, "Errors"). Or an FP8
                pair ``(x_fp8 [T, H] float8_e4m3fn, scales [T, S])`` (DeepEP's FP8 input,
                ``megatron_mok/fp8.py``): the rows travel as FP8 with their scales and
                ``tokens`` is the pair ``(rows_fp8 [R, H], row_scales [R, S])``, views of the
                received packed rows; not differentiable w.r.t. the pair.
            topk_idx: ``[T, K]`` int32/int64 global expert ids, ``-1`` = slot not routed.
            topk_weights: ``[T, K]`` float32 router weights.
            handle: instead of routing, reuse the layout of an earlier dispatch (a *cached*
                dispatch: no routing exchange, no host read). ``x`` must have that
                dispatch's ``T``. The result's ``probs`` is ``None`` and its handle is
                ``handle``; gradients flow to ``x``.
            rows_per_expert: ``N`` (fixed-shape expert inputs, Megatron's drop-and-pad): every
                local expert gets exactly ``N`` rows, its received rows then zero rows (as
                ``expert_alignment``'s: ``probs`` 0, ``src_rank`` / ``src_token`` -1), so
                ``R = E_local * N`` whatever the routing. An expert that receives more than
                ``N`` rows is an error (the reference backend raises; the CUDA backend drops
                the rows past ``N``, never writing outside the expert's rows, and raises at
                the next host read). A multiple of ``expert_alignment``; with
                ``max_recv_tokens``, ``E_local * N`` must fit in it. ``R`` being known, the
                CUDA backend's dispatch is CUDA-graph capturable on any Buffer (while captured
                it reads nothing: errors surface at ``check_errors``).
            recv_budget: ``M``, a receive budget for this call (Megatron's
                ``moe_expert_rank_capacity_factor``, HybridEP's static ``num_permuted_tokens``):
                ``tokens`` has exactly ``M`` rows, as in static-shape mode (the ``R`` received
                rows first, then zero rows; the CUDA backend reads nothing on the host, so the
                call is CUDA-graph capturable on any Buffer). When this rank receives more than
                ``M`` rows, the rows past ``M`` in contract order are **dropped, not an error**:
                never written, never combined, their slots get no gradient, and
                ``handle.over_budget`` (``[1]`` bool on the device, no host read) says so;
                ``handle.rows_received`` (``[1]`` int64) holds the rows before the budget. A
                caller that must not lose tokens checks the flag and redoes the step without a
                budget (Megatron's ``PagedStashRunner`` does). An int >= 0, a multiple of
                ``expert_alignment``; not with ``rows_per_expert`` or ``handle=``; on a
                static-shape Buffer it replaces ``max_recv_tokens`` for this call
                (docs/CONTRACT.md, "Receive budget").

        Returns:
            :class:`DispatchResult` with expert-major ``tokens [R, H]``, ``probs [R]``,
            ``tokens_per_expert [E_local]``, ``src_rank``/``src_token [R]`` and the handle.
            Gradients flow to ``x`` (through ``tokens``) and ``topk_weights`` (through ``probs``).

        Raises:
            ``TypeError`` / ``ValueError`` for bad input, ``MokDeviceError`` for a device error
            read here (docs/CONTRACT.md, "Errors"). In a group of two ranks or more any
            exception first stops the Buffer (:meth:`abort`): its peers raise too, and it can
            no longer be used. ``combine`` alike.
        """
        self._check_alive()
        self._status_due = True
        try:
            return self._dispatch(x, topk_idx, topk_weights, handle, rows_per_expert, recv_budget)
        except Exception as exc:
            self._abort_after(exc)
            raise
        finally:
            self._status_due = False

    def _dispatch(self, x, topk_idx, topk_weights, handle, rows_per_expert,
                  recv_budget=None) -> DispatchResult:
        """:meth:`dispatch` after the alive check (an exception here stops the Buffer)."""
        pair = fp8.is_fp8_pair(x)
        # (The pair's own checks, its length first, come below; the backend only looks at a tensor.)
        backend = self._backend_for(x[0] if pair and x else x, "x_fp8" if pair else "x")
        if handle is not None:
            if topk_idx is not None or topk_weights is not None:
                raise ValueError("pass either (topk_idx, topk_weights) or handle=, not both")
            if rows_per_expert is not None or recv_budget is not None:
                what = "rows_per_expert" if rows_per_expert is not None else "recv_budget"
                raise ValueError(f"{what} is for routed dispatches: a cached dispatch "
                                 "reuses its handle's layout")
            if pair:
                x = validation.check_cached_fp8_inputs(self, x, handle)
            else:
                validation.check_cached_dispatch_inputs(self, x, handle)
            validation.check_handle_backend(handle, backend.name)
            rows = fp8.dispatch_rows(*x, packed=self._fp8_pack) if pair else x
            if records_autograd(rows):
                tokens = CachedDispatchFunction.apply(backend, handle, rows)
            else:
                tokens = backend.dispatch_cached(rows, handle)
            return DispatchResult(tokens=self._fp8_rows(tokens, x) if pair else tokens, probs=None,
                                  tokens_per_expert=handle.tokens_per_expert,
                                  src_rank=handle.src_rank, src_token=handle.src_token, handle=handle)
        if topk_idx is None or topk_weights is None:
            raise ValueError("dispatch needs topk_idx and topk_weights (or handle= for a cached dispatch)")
        if pair:
            x = validation.check_fp8_pair(self, x)
        validation.check_dispatch_inputs(self, x[0] if pair else x, topk_idx, topk_weights,
                                         check_values=backend.name == "reference", fp8=pair)
        validation.check_rows_per_expert(self, rows_per_expert)
        validation.check_recv_budget(self, recv_budget, rows_per_expert)
        rows = fp8.dispatch_rows(*x, packed=self._fp8_pack) if pair else x
        if records_autograd(rows, topk_weights):
            out_handle = []
            tokens, probs = DispatchFunction.apply(backend, out_handle, rows, topk_weights, topk_idx,
                                                   rows_per_expert, recv_budget)
            h = out_handle[0]
        else:
            tokens, probs, h = backend.dispatch(rows, topk_idx, topk_weights, rows_per_expert, recv_budget)
        return DispatchResult(tokens=self._fp8_rows(tokens, x) if pair else tokens, probs=probs,
                              tokens_per_expert=h.tokens_per_expert,
                              src_rank=h.src_rank, src_token=h.src_token, handle=h)

    def combine(self, expert_out: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        """Sum each token's expert rows back on its own rank (unweighted).

        Args:
            expert_out: ``[R, H]`` (the dispatch's row count), the Buffer's dtype, contiguous,
                on the Buffer's device; copied first by the CUDA backend when its data pointer is
                not a multiple of 16 bytes, as ``x`` of a dispatch.
            handle: the :class:`DispatchHandle` of the matching dispatch.

        Returns:
            ``y [T, H]`` in the Buffer's dtype; differentiable w.r.t. ``expert_out``.
        """
        self._check_alive()
        self._status_due = True
        try:
            validation.check_combine_inputs(self, expert_out, handle)
            backend = self._backend_for(expert_out)
            validation.check_handle_backend(handle, backend.name)
            if records_autograd(expert_out):
                return CombineFunction.apply(backend, handle, expert_out)
            return backend.combine(expert_out, handle)[0]
        except Exception as exc:
            self._abort_after(exc)
            raise
        finally:
            self._status_due = False

    def abort(self, reason: str = "Buffer.abort() was called", *, skipped_call: bool = False) -> None:
        """Stop this Buffer on this rank, and make its peers' calls raise at once.

        For an error of this rank that its peers cannot see: they may already be inside the
        same dispatch or combine, waiting for this rank's routing, tokens or partial sums.
        ``dispatch`` and ``combine`` call it themselves before an exception leaves them in a
        group of two ranks or more (an input refused on this rank only, more tokens than
        ``max_tokens_per_rank``, a device error read here); the Megatron adapter calls it
        before its own per-rank errors. Call it yourself when this rank stops between a
        dispatch and its combine (an expert that raised).

        CUDA backend: one kernel on the current stream, after this rank's queued work, poisons
        every flag its peers wait on for it; a peer's wait ends there and its call raises
        :class:`~megatron_mok.cuda.errors.MokDeviceError` naming this rank (an eager dispatch
        at its host read, other calls at the next read or ``check_errors``) instead of timing
        out. Nothing is launched while a CUDA graph is captured (its peers are capturing too,
        not waiting).

        Reference backend (its collectives block: nothing can end a peer's wait but the
        collective it waits in): the rank tells its peers in place of a call they make, in that
        call's first exchange, and they raise :class:`~megatron_mok.cuda.errors.MokPeerStopped`
        naming it. That call is the one that raised here (``dispatch`` / ``combine`` call this
        before their own exchange), the one ``skipped_call=True`` says this rank will not make
        (the Megatron adapter's check before a dispatch), or else this rank's next call (which
        then raises). Aborted between calls and never calling again, a rank leaves its peers
        waiting in their next call until their ``timeout_s``: they raise
        :class:`~megatron_mok.cuda.errors.MokTimeout` (or, sooner, until its process exits:
        gloo then fails their collective).

        Afterwards every call on this rank raises, naming ``reason``; on every rank the Buffer
        can no longer be used (make a new one everywhere). Idempotent; nothing to stop in a
        world of one rank, where it does nothing and the Buffer stays usable."""
        if self._destroyed or self.world_size == 1:
            return
        if self._aborted is None:
            self._aborted = reason     # first: this rank refuses from now on, whatever follows
        for b in list(self._backends.values()):
            b.abort(reason)
        if skipped_call or self._status_due:
            self._tell_peers()

    def _stop_at_exit(self, reason: str) -> None:
        """:meth:`abort` at the exit of a process failing with an uncaught exception, for the
        CUDA backend only: its stop is one kernel that writes into the peers' workspaces and
        waits for nobody. The reference backend's stop is a collective its peers would have to
        join (they are in some other call, or gone): the exit would wait for it until
        ``timeout_s``; its peers' gloo / NCCL collectives fail once this process is gone.
        Not at a clean exit: a peer may still be finishing its last combine, reading flags this
        rank set, which the stop would overwrite. Not on loopback ranks (threads, all done)."""
        cuda = self._backends.get("cuda")
        if (cuda is None or self._aborted is not None
                or getattr(getattr(cuda, "mem", None), "loopback", True)):
            return
        self.abort(reason)          # no call is in progress: it tells nobody through a collective

    def _tell_peers(self) -> None:
        """After :meth:`abort`, in place of a call the peers make: the reference backend posts
        this rank's stop in that call's first exchange (once; the CUDA backend's stop already
        told them). Made first if this rank never got to a call (its first one was refused)."""
        self._status_due = False
        ref = self._backends.get("reference")
        if ref is None and self.backend == "reference" and not self._destroyed:
            ref = self._get_backend("reference")
            ref.abort(self._aborted)
        if ref is not None:
            ref.tell_peers()

    def _abort_after(self, exc: BaseException) -> None:
        """:meth:`abort` for ``exc`` leaving a call: it must not hide ``exc`` if it fails. Not
        for a :class:`MokDeviceError`: the CUDA backend stopped the rank when it raised it, and
        refuses every later call with it (the type a device error's callers expect)."""
        if isinstance(exc, MokDeviceError):
            return
        # A peer's stop: its backend refuses with the peer's reason already; the Buffer's too.
        reason = (f"rank {exc.rank} stopped it: {exc.reason}" if isinstance(exc, MokPeerStopped)
                  else f"{type(exc).__name__}: {exc}")
        try:
            self.abort(reason)
        except Exception as err:   # e.g. the launch failed: the peers time out instead
            warnings.warn(f"megatron_mok: rank {self.rank} could not stop its peers after an "
                          f"error ({err}); they will wait until their timeout")

    def check_errors(self) -> None:
        """Synchronise and raise if a CUDA kernel of this Buffer reported an error (timeout,
        bad expert id, static-shape overflow). Eager dispatches check at their one host read;
        static-shape (graph) users call this at a point of their choosing."""
        for b in self._backends.values():
            if hasattr(b, "check_errors"):
                b.check_errors()

    def destroy(self) -> None:
        """Free the workspace (peer memory on the CUDA backend). Idempotent.

        Afterwards every call refuses with a ``RuntimeError``: ``dispatch``, ``combine``, and
        the backward of any dispatch or combine made on this Buffer whose autograd graph is
        still alive (its backend is marked destroyed; on the CUDA backend it would otherwise
        communicate through freed peer memory). Its handles are refused by every Buffer."""
        # Marked first: a backend whose destroy raises half-way (a device error while it waits
        # for its kernels) may have freed memory already, so nothing may use this Buffer again.
        self._destroyed = True
        for b in self._backends.values():
            b.destroy()
        self._backends.clear()

    @property
    def backend(self) -> str:
        """The backend name ``auto`` resolves to for tensors on ``self.device`` (or CPU)."""
        if self.requested_backend != "auto":
            return self.requested_backend
        dev = self.device or torch.device("cpu")
        return "cuda" if dev.type == "cuda" and "cuda" in available_backends(dev) else "reference"

    def __repr__(self):
        return (f"Buffer(rank={self.rank}/{self.world_size}, experts={self.num_experts}, "
                f"hidden={self.hidden}, topk={self.topk}, T_max={self.max_tokens_per_rank}, "
                f"dtype={self.dtype}, backend={self.requested_backend}"
                + (f", expert_alignment={self.expert_alignment}" if self.expert_alignment > 1 else "")
                + ")")

    # ------------------------------------------------------------------------------ internal
    def _backend_for(self, t: torch.Tensor, arg: str = "x"):
        name = self.requested_backend
        is_tensor = isinstance(t, torch.Tensor)   # not one: the input checks raise the TypeError
        if name == "auto":
            name = "cuda" if is_tensor and t.is_cuda and "cuda" in available_backends(t.device) else "reference"
        if name == "cuda" and is_tensor and not t.is_cuda:
            raise ValueError(f"backend='cuda' needs CUDA tensors, got a tensor on {t.device}")
        if name == "cuda" and is_tensor and name not in self._backends:
            # Before the backend is made: it puts its workspace on the Buffer's device, which the
            # first tensor fixes when none was given (else an auto Buffer first used on cuda:1
            # would make it on the current device and read cuda:1 tensors from there). Later
            # calls: the input checks compare every tensor's device with the Buffer's.
            self._check_device(t.device, arg)
        return self._get_backend(name)

    def _get_backend(self, name: str):
        if name not in self._backends:
            if name == "reference":
                from .backends.reference import ReferenceBackend
                self._backends[name] = ReferenceBackend(self)
            else:
                from .cuda.backend import CudaBackend
                self._backends[name] = CudaBackend(self)
        return self._backends[name]

    def _check_device(self, device: torch.device, name: str) -> None:
        if self.device is None:
            self.device = device
        elif device.type == "cuda" and self.device == _ANY_CUDA:
            self._cuda_device()   # device="cuda": the current device, fixed at this first use
        if device != self.device:
            raise ValueError(f"{name} is on {device}, but this Buffer works on {self.device}")

    def _cuda_device(self) -> torch.device:
        """The GPU of this Buffer's CUDA workspace, fixed on first call: ``device`` when it names
        one; for ``None`` or ``"cuda"`` (no index) ``torch.cuda.current_device()`` now. The
        CUDA backend makes its workspace there, and every later tensor must be on it."""
        if self.device is None or self.device == _ANY_CUDA:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if self.device.type != "cuda":
            raise ValueError(f"backend='cuda' needs a CUDA device, but this Buffer works on {self.device}")
        return self.device

    def _out_rows(self, num_rows: int, recv_budget: Optional[int] = None) -> int:
        """Rows to allocate for ``R`` received rows: ``R``, ``max_recv_tokens``, or the call's
        ``recv_budget`` (rows past it are dropped, not an error: the caller truncates). The
        overflow error is a guard here: the reference dispatch checked every rank's ``R``
        first (``ReferenceBackend._check_rows_everywhere``), so that all raise together."""
        if recv_budget is not None:
            return recv_budget
        if self.max_recv_tokens is None:
            return num_rows
        if num_rows > self.max_recv_tokens:
            raise RuntimeError(validation.recv_overflow_message(self.rank, num_rows,
                                                                self.max_recv_tokens))
        return self.max_recv_tokens

    def _fp8_rows(self, rows: torch.Tensor, pair):
        """The received packed rows ``[R, P]`` as ``(rows_fp8 [R, H], row_scales [R, S])`` views,
        in the dtypes of the dispatched pair."""
        x_fp8, scales = pair
        return fp8.unpack(rows, self.hidden, x_fp8.dtype, scales.shape[1], scales.dtype)

    def _check_alive(self):
        if self._destroyed:
            raise RuntimeError("this Buffer was destroyed")
        if self._aborted is not None:
            self._tell_peers()        # this refused call is one its peers make: see abort()
            raise RuntimeError(
                f"megatron_mok: this Buffer was stopped on rank {self.rank} after an error "
                f"({self._aborted}); it can no longer be used on any rank of its group: make a "
                "new Buffer on every rank")

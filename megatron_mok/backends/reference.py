"""The pure-torch reference backend: the contract of ``docs/CONTRACT.md``, written plainly.

It runs anywhere torch.distributed runs (CPU + gloo, GPU + NCCL) and is the oracle the CUDA
backend is tested against, bitwise. It exchanges data only through ``all_gather`` of raw
bytes (see :mod:`megatron_mok.comm`), so it moves far more than it must: every rank gathers
every rank's padded tokens. It is for correctness, never for speed.

Every floating-point sum is written as an explicit loop in the contract's order (slot by
slot, rank by rank) in float32, so the result does not depend on how torch schedules a
reduction.
"""

from __future__ import annotations

import contextlib
import warnings
import zlib
from dataclasses import dataclass
from typing import Optional

import torch

from ..comm import (STATUS_VALUES, all_gather_exact, exchange_status, post_stop, status_device,
                    timeout_seconds)
from ..cuda.errors import MokPeerStopped, MokTimeout, stopped_message
from ..validation import buffer_layout, layout_error, recv_overflow_message, rows_per_expert_message
from ..fp8 import PairRows
from ..loopback import settle  # host-syncing ops below: wait for the stream first there
from ..handle import DispatchHandle


@dataclass
class ReferenceLayout:
    """Backend-private part of a :class:`DispatchHandle` (shapes for ``R`` rows, ``n`` tasks).

    A *task* is one source token ``(s, t)`` with at least one row on this rank.
    """

    counts: torch.Tensor        # [W] int64, tokens per source rank in this dispatch
    row_k: torch.Tensor         # [R] int64, the slot k of each row (-1: a zero row)
    task_key: torch.Tensor      # [n] int64, s * T_max + t of each task, ascending
    task_rows: torch.Tensor     # [n, K] int64, the task's rows in row order, -1 padded
    hit: torch.Tensor           # [W, T] bool, hit[d, t]: token t of this rank has rows on d


def build_layout(all_idx: torch.Tensor, counts: torch.Tensor, rank: int, num_local_experts: int):
    """The receiver-side layout from every rank's routing.

    Args:
        all_idx: ``[W, T_max, K]`` int64, every rank's ``topk_idx`` padded with -1.
        counts: ``[W]`` int64, tokens per rank.
        rank: this rank.
        num_local_experts: experts per rank.

    Returns:
        ``(row_e, row_s, row_t, row_k)``: ``[R]`` int64 each, rows in contract order.
    """
    world, t_max, topk = all_idx.shape
    dev = all_idx.device
    lo = rank * num_local_experts
    s_ix = torch.arange(world, device=dev).view(world, 1, 1).expand(world, t_max, topk)
    t_ix = torch.arange(t_max, device=dev).view(1, t_max, 1).expand(world, t_max, topk)
    k_ix = torch.arange(topk, device=dev).view(1, 1, topk).expand(world, t_max, topk)
    live = t_ix < counts.view(world, 1, 1)
    mine = live & (all_idx >= lo) & (all_idx < lo + num_local_experts)
    e, s, t, k = all_idx[mine] - lo, s_ix[mine], t_ix[mine], k_ix[mine]
    # Each (s, t, k) is one slot, so keys are unique and the sort order is unique too.
    key = ((e * world + s) * t_max + t) * topk + k
    order = torch.sort(key).indices
    return e[order], s[order], t[order], k[order]


def padded_counts(counts: torch.Tensor, alignment: int, rows_per_expert: Optional[int] = None,
                  rank: int = 0) -> torch.Tensor:
    """Each local expert's rows with the zero rows after them (``counts [E_local]`` int64, the
    rows it received): up to a multiple of ``alignment``, or exactly ``rows_per_expert`` ``N``.
    Raises ``RuntimeError`` naming ``rank`` and the first expert with more than ``N`` rows."""
    if rows_per_expert is not None:
        over = (counts > rows_per_expert).nonzero().flatten()
        if over.numel():
            e = int(over[0])
            raise RuntimeError(rows_per_expert_message(rank, e, int(counts[e]), rows_per_expert))
        return torch.full_like(counts, rows_per_expert)
    return (counts + alignment - 1) // alignment * alignment


def padded_positions(row_e: torch.Tensor, num_local_experts: int, alignment: int,
                     rows_per_expert: Optional[int] = None, rank: int = 0):
    """Where the rows of :func:`build_layout` go when each expert's rows are followed by zero
    rows: up to a multiple of ``alignment`` (``Buffer(expert_alignment=)``), or, with
    ``rows_per_expert`` ``N`` (``dispatch(rows_per_expert=)``), up to exactly ``N`` rows.

    Returns ``(pos [R0] int64, tokens_per_expert [E_local] int64, R)``: row ``i`` of the
    unpadded layout is row ``pos[i]``; the counts and ``R`` include the zero rows. Raises
    ``RuntimeError`` when an expert has more than ``N`` rows (a guard: the reference dispatch
    checked every rank's rows first, ``ReferenceBackend._check_rows_everywhere``)."""
    counts = torch.bincount(row_e, minlength=num_local_experts).to(torch.int64)
    padded = padded_counts(counts, alignment, rows_per_expert, rank)
    shift = (torch.cumsum(padded, 0) - padded) - (torch.cumsum(counts, 0) - counts)
    pos = torch.arange(row_e.numel(), dtype=torch.int64, device=row_e.device) + shift[row_e]
    return pos, padded, int(padded.sum())


def budget_counts(tokens_per_expert: torch.Tensor, budget: int) -> torch.Tensor:
    """Each expert's rows among the first ``budget`` rows (``tokens_per_expert [E_local]``
    counts a layout's rows, experts in order): the counts of a dispatch whose rows past the
    budget were dropped."""
    ends = torch.cumsum(tokens_per_expert, 0).clamp(max=budget)
    return ends - torch.cat([ends.new_zeros(1), ends[:-1]])


def group_rows_by_task(row_s: torch.Tensor, row_t: torch.Tensor, t_max: int, topk: int):
    """Group rows by source token, keeping row order inside each group.

    Returns ``(task_key [n], task_rows [n, K])``; ``task_rows`` lists each task's rows in
    row order (local expert ascending, then slot), padded with -1.
    """
    dev = row_s.device
    key = row_s * t_max + row_t
    sorted_key, perm = torch.sort(key, stable=True)   # stable: keeps row order per token
    task_key, sizes = torch.unique_consecutive(sorted_key, return_counts=True)
    starts = torch.cumsum(sizes, 0) - sizes
    pos = torch.arange(key.numel(), device=dev) - torch.repeat_interleave(starts, sizes)
    task_of = torch.repeat_interleave(torch.arange(task_key.numel(), device=dev), sizes)
    task_rows = torch.full((task_key.numel(), topk), -1, dtype=torch.int64, device=dev)
    task_rows[task_of, pos] = perm
    return task_key, task_rows


def _byte_rows(x):
    """A dispatch's rows as one tensor: an FP8 pair handed over unpacked (``fp8.PairRows``, the
    CUDA backend reads its two sources in place) is packed here: the reference copies anyway."""
    return x.packed() if isinstance(x, PairRows) else x


class ReferenceBackend:
    """The contract in plain torch. How a stop reaches the peers (its collectives block, so no
    rank can interrupt a peer's wait): every call's first collective is the status exchange
    (:func:`~megatron_mok.comm.exchange_status`, one fixed-size record per rank, whatever the
    call), and a rank that stops instead of making a call its peers make posts its record with
    the reason there (:meth:`tell_peers`): they raise :class:`MokPeerStopped` naming it. An error
    found after the exchange (an overflow of ``max_recv_tokens`` or ``rows_per_expert``) is
    decided from the exchanged routing on every rank alike, so all raise in the same call."""

    name = "reference"
    destroyed = False   # set by destroy(); every entry then raises, as the CUDA backend's does
    aborted = None      # abort()'s reason; every entry then raises, as the CUDA backend's does
    stopped_by = None   # the rank whose error stopped this Buffer (this one, or a peer)
    told = False        # every rank knows: this one posted its stop, or all found it in a call

    def __init__(self, buf):
        self.buf = buf
        self.timeout_s = timeout_seconds(buf.timeout_s)   # every collective's limit
        # The arguments every rank must share, and their fingerprint, sent in the last value
        # of every call's status exchange (NOTES item 63): a rank whose Buffer differs would
        # gather differently shaped or differently read routing, tokens and partial sums.
        self.layout = buffer_layout(buf)
        self.fingerprint = 1 + zlib.crc32(repr([v for _, v, _ in self.layout]).encode())

    def _alive(self, device=None) -> None:
        # Nothing is freed here, but a destroyed Buffer must refuse on every backend alike, so
        # code tested on the reference does not run on freed peer memory on the CUDA backend.
        if self.destroyed:
            raise RuntimeError("megatron_mok: this Buffer was destroyed (Buffer.destroy()); its "
                               "reference backend refuses every call; make a new Buffer")
        # Likewise after abort() (the CUDA backend's peers cannot go on with a stopped rank).
        # Every entry is a call the peers make too: if they do not know yet, tell them here.
        if self.aborted is not None:
            self.tell_peers(device)
            raise RuntimeError(stopped_message(self.stopped_by, self.aborted))

    def abort(self, reason: str, rank: Optional[int] = None) -> None:
        """Refuse every later call on this rank (:meth:`Buffer.abort`); ``rank``: the peer whose
        error it was (default: this rank). Tells nobody: a collective issued here would
        block this rank until its peers reach it, and they may be outside any call of this
        Buffer (:meth:`tell_peers` is for a rank that stops in place of a call)."""
        if self.aborted is None:
            self.aborted = reason
            self.stopped_by = self.buf.rank if rank is None else rank

    def tell_peers(self, device=None) -> None:
        """Post this rank's stop in place of the call its peers are making (once; see the class
        docstring). Waits for them up to the Buffer's ``timeout_s`` (default 60 s), then warns
        and leaves them waiting as before. Never raises: it runs on the way to this rank's own
        error, which must not be hidden (a failed post is a warning)."""
        b = self.buf
        if self.told or self.aborted is None or b.world_size == 1:
            return
        self.told = True
        try:
            dev = status_device(b.group, device if device is not None else b.device)
            why = None if post_stop(self.aborted, b.group, b.world_size, dev, self.timeout_s) else \
                f"none reached a call of this Buffer within {self.timeout_s} s"
        except Exception as err:        # e.g. the process group is gone
            why = f"{type(err).__name__}: {err}"
        if why is not None:
            warnings.warn(f"megatron_mok: rank {b.rank} could not tell its peers that it stopped "
                          f"({why}); they wait until their process group's timeout")

    def _gather(self, t: torch.Tensor, what: str) -> torch.Tensor:
        """``all_gather_exact`` of ``t`` over the group, waited for up to the Buffer's
        ``timeout_s``: past it, :class:`MokTimeout` (``what`` names the collective), and this
        rank refuses every later call (its collective stays queued, so it must not post a stop:
        the post would pair with a peer's next collective)."""
        b = self.buf
        with self._timing_out():
            return all_gather_exact(t, b.group, b.world_size, self.timeout_s, what)

    @contextlib.contextmanager
    def _timing_out(self):
        """A collective that may raise :class:`MokTimeout`: then this rank refuses every later
        call, and tells nobody (its collective stays queued: a post would pair with it)."""
        try:
            yield
        except MokTimeout as err:
            self.abort(str(err))
            self.told = True
            raise

    def _enter(self, device, call: str, values=()) -> torch.Tensor:
        """A call's first collective, the status exchange: ``values [W, STATUS_VALUES]``
        (int64, CPU) of every rank; raises :class:`MokPeerStopped` if a peer stopped in its
        place (then every rank knows: the lowest such rank is named everywhere), and
        :class:`MokTimeout` if a peer neither made the call (``call`` names it) nor posted a
        stop within ``timeout_s``."""
        self._alive(device)
        b = self.buf
        b._status_due = False          # from here an error of this call is not a skipped call
        values = list(values) + [0] * (STATUS_VALUES - 1 - len(values)) + [self.fingerprint]
        with self._timing_out():
            vals, stops = exchange_status(values, b.group, b.world_size, device,
                                          self.timeout_s, f"the status exchange of {call}")
        if stops:
            r = min(stops)
            self.abort(stops[r], rank=r)
            self.told = True
            raise MokPeerStopped(r, stops[r])
        if len(set(vals[:, STATUS_VALUES - 1].tolist())) > 1:
            self._layouts_differ(device)
        return vals

    def _layouts_differ(self, device) -> None:
        """Every rank found the fingerprints differ in the same exchange: all gather the
        arguments themselves (one bounded gather, every rank makes it), and all raise the same
        ``ValueError`` naming what differs on which ranks; the Buffer refuses from then on."""
        mine = torch.tensor([v for _, v, _ in self.layout], dtype=torch.int64, device=device)
        every = self._gather(mine, "the comparison of the ranks' Buffer arguments").tolist()
        problem = layout_error(self.layout, every) or (
            "megatron_mok: the ranks of this group sent different Buffer fingerprints with equal "
            "arguments (a different build of megatron_mok on some ranks?)")
        self.abort(problem)
        self.told = True                   # every rank raises here, in this call
        raise ValueError(problem)

    def _check_rows_everywhere(self, all_idx: torch.Tensor, counts: torch.Tensor,
                               vals: torch.Tensor) -> None:
        """Raise, on every rank alike, when any rank's dispatch overflows its
        ``rows_per_expert`` or ``max_recv_tokens``: ``vals [W, STATUS_VALUES]`` holds every
        rank's ``(T, max_recv_tokens, rows_per_expert, recv_budget, expert_alignment)`` (-1:
        none). The rank that overflowed raises its own ``RuntimeError``, its peers
        :class:`MokPeerStopped` naming it (on the CUDA backend it raises at its host read and
        stops, and its peers raise at theirs)."""
        b = self.buf
        W, t_max, _ = all_idx.shape
        E_l = b.num_local_experts
        live = (torch.arange(t_max, device=all_idx.device).view(1, t_max, 1)
                < counts.view(W, 1, 1)) & (all_idx >= 0)
        per_expert = torch.bincount(all_idx[live], minlength=W * E_l).view(W, E_l).cpu()
        errors = {}
        for d in range(W):
            cap, n, budget, align = (int(v) for v in vals[d, 1:5])
            try:                        # rank d's own layout rule (padded_positions')
                rows = int(padded_counts(per_expert[d], align, n if n >= 0 else None, d).sum())
            except RuntimeError as err:   # an expert of rank d over rows_per_expert
                errors[d] = str(err)
                continue
            if budget < 0 and cap >= 0 and rows > cap:
                errors[d] = recv_overflow_message(d, rows, cap)
        if not errors:
            return
        self.told = True                 # every rank raises here, in this call
        if b.rank in errors:
            raise RuntimeError(errors[b.rank])
        r = min(errors)
        self.abort(errors[r], rank=r)
        raise MokPeerStopped(r, errors[r])

    # ----------------------------------------------------------------------------- dispatch
    def dispatch(self, x, topk_idx, topk_weights, rows_per_expert=None, recv_budget=None):
        x = _byte_rows(x)
        settle(x.device)
        b = self.buf
        W, t_max, K = b.world_size, b.max_tokens_per_rank, b.topk
        T = x.shape[0]
        none = -1
        vals = self._enter(x.device, "a dispatch", [
            T, none if b.max_recv_tokens is None else b.max_recv_tokens,
            none if rows_per_expert is None else rows_per_expert,
            none if recv_budget is None else recv_budget, b.expert_alignment])
        counts = vals[:, 0].to(x.device)
        idx = torch.full((t_max, K), -1, dtype=torch.int64, device=x.device)
        idx[:T] = topk_idx.to(torch.int64)
        w = torch.zeros(t_max, K, dtype=torch.float32, device=x.device)
        w[:T] = topk_weights
        all_idx = self._gather(idx, "a dispatch's routing exchange")
        all_w = self._gather(w, "a dispatch's routing exchange")
        self._check_rows_everywhere(all_idx, counts, vals)
        all_x = self._gather_tokens(x)

        row_e, row_s, row_t, row_k = build_layout(all_idx, counts, b.rank, b.num_local_experts)
        # pos: each row's place (with expert_alignment or rows_per_expert, zero rows follow each
        # expert's rows)
        pos, tpe, R = padded_positions(row_e, b.num_local_experts, b.expert_alignment,
                                       rows_per_expert, b.rank)
        over_budget = rows_received = None
        if recv_budget is not None:
            # A receive budget: the rows past it in contract order are dropped (no error),
            # every output describes the rows kept (docs/CONTRACT.md, "Receive budget").
            rows_received = torch.tensor([R], dtype=torch.int64, device=x.device)
            over_budget = rows_received > recv_budget
            keep = pos < recv_budget
            row_e, row_s, row_t, row_k, pos = (v[keep] for v in (row_e, row_s, row_t, row_k, pos))
            tpe = budget_counts(tpe, recv_budget)
            R = min(R, recv_budget)
        out_rows = b._out_rows(R, recv_budget)
        tokens = x.new_zeros(out_rows, x.shape[1])  # token rows, or packed FP8 rows
        tokens[pos] = all_x[row_s, row_t]
        probs = torch.zeros(out_rows, dtype=torch.float32, device=x.device)
        probs[pos] = all_w[row_s, row_t, row_k]

        task_key, task_rows = group_rows_by_task(row_s, row_t, t_max, K)
        task_rows = torch.where(task_rows >= 0, pos[task_rows.clamp(min=0)], task_rows)
        my_idx = idx[:T]
        hit = torch.zeros(W, T, dtype=torch.bool, device=x.device)
        routed = my_idx >= 0
        dest = torch.where(routed, my_idx // b.num_local_experts, torch.zeros_like(my_idx))
        tok = torch.arange(T, device=x.device).view(T, 1).expand(T, K)
        hit[dest[routed], tok[routed]] = True

        src_rank = torch.full((out_rows,), -1, dtype=torch.int64, device=x.device)
        src_token = torch.full((out_rows,), -1, dtype=torch.int64, device=x.device)
        src_rank[pos], src_token[pos] = row_s, row_t
        row_k_out = torch.full((R,), -1, dtype=torch.int64, device=x.device)
        row_k_out[pos] = row_k
        layout = ReferenceLayout(counts=counts, row_k=row_k_out, task_key=task_key,
                                 task_rows=task_rows, hit=hit)
        handle = DispatchHandle(
            buffer_id=b.serial, backend=self.name, num_tokens=T, num_rows=R, num_out_rows=out_rows,
            src_rank=src_rank, src_token=src_token, tokens_per_expert=tpe,
            num_rows_device=torch.tensor([R], dtype=torch.int64, device=x.device),
            state=layout, over_budget=over_budget, rows_received=rows_received)
        return tokens, probs, handle

    def dispatch_cached(self, x, handle: DispatchHandle):
        """Rows of ``x`` (``[T, H]`` on every rank) in the layout of ``handle``."""
        x = _byte_rows(x)
        settle(x.device)
        self._enter(x.device, "a cached dispatch")
        all_x = self._gather_tokens(x)
        R = handle.num_rows
        out = x.new_zeros(handle.num_out_rows, x.shape[1])
        live = handle.src_rank[:R] >= 0          # not the zero rows of expert_alignment
        out[:R][live] = all_x[handle.src_rank[:R][live], handle.src_token[:R][live]]
        return out

    # ------------------------------------------------------------------------------ combine
    def combine(self, expert_out, handle: DispatchHandle, grad_probs: Optional[torch.Tensor] = None):
        """``y [T, H]`` per the contract; with ``grad_probs [R]`` also ``grad_topk_weights [T, K]``."""
        settle(expert_out.device)
        self._enter(expert_out.device, "a combine")
        b = self.buf
        W, t_max, K, H = b.world_size, b.max_tokens_per_rank, b.topk, b.hidden
        lay: ReferenceLayout = handle.state
        dev = expert_out.device
        T = handle.num_tokens

        # 1. Expert side: one partial per source token, rows summed in row order from +0.0.
        partial = torch.zeros(W * t_max, H, dtype=torch.float32, device=dev)
        for j in range(K):
            rows = lay.task_rows[:, j]
            live = rows >= 0
            partial[lay.task_key[live]] += expert_out[rows[live]].float()
        partial = partial.to(b.combine_partial_dtype)
        all_partial = self._gather(partial, "a combine's partial sums").view(W, W, t_max, H)
        mine = all_partial[:, b.rank, :T]                     # [W, T, H]

        # 2. Owner: the partials of the ranks holding rows of t, in rank order, from +0.0.
        y = torch.zeros(T, H, dtype=torch.float32, device=dev)
        for d in range(W):
            y[lay.hit[d]] += mine[d][lay.hit[d]].float()
        y = y.to(b.dtype)

        grad_w = None if grad_probs is None else self._prob_grads(handle, grad_probs)
        return y, grad_w

    def combine_prob_grads(self, handle: DispatchHandle, grad_probs: torch.Tensor) -> torch.Tensor:
        """``grad_topk_weights [T, K]`` float32 from ``grad_probs [R]``: each row's prob gradient
        back to its source slot (the side values of a combine, with no row data)."""
        settle(grad_probs.device)
        self._enter(grad_probs.device, "a prob-gradient combine")
        return self._prob_grads(handle, grad_probs)

    def _prob_grads(self, handle: DispatchHandle, grad_probs: torch.Tensor) -> torch.Tensor:
        """:meth:`combine_prob_grads` after the caller settled the device (combine did already)."""
        b = self.buf
        W, t_max, K = b.world_size, b.max_tokens_per_rank, b.topk
        lay: ReferenceLayout = handle.state
        dev, T, R = grad_probs.device, handle.num_tokens, handle.num_rows
        side = torch.zeros(W * t_max, K, dtype=torch.float32, device=dev)
        live = lay.row_k >= 0                # not the zero rows of expert_alignment
        key = handle.src_rank[:R][live] * t_max + handle.src_token[:R][live]
        side[key, lay.row_k[live]] = grad_probs[:R][live].float()
        all_side = self._gather(side, "a prob-gradient exchange").view(W, W, t_max, K)[:, b.rank, :T]
        grad_w = torch.zeros(T, K, dtype=torch.float32, device=dev)
        for d in range(W):              # exactly one rank holds each routed slot
            grad_w += all_side[d]
        return grad_w

    def destroy(self):
        self.destroyed = True

    # -------------------------------------------------------------------------------- utils
    def _gather_tokens(self, x):
        b = self.buf
        padded = x.new_zeros(b.max_tokens_per_rank, x.shape[1])
        padded[: x.shape[0]] = x
        return self._gather(padded, "a dispatch's token exchange")

"""Small, exact collectives used by the reference backend.

Everything travels as raw bytes (``uint8`` views), so gloo and NCCL both carry any dtype
bit-for-bit, and the reference backend needs nothing beyond ``all_gather``. A group may also
be a loopback rank (``megatron_mok.loopback``: ranks as threads of one process), whose
collectives go through its hub.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .cuda.errors import REASON_BYTES, MokTimeout, reason_bytes
from .loopback import current as current_loopback
from .loopback import is_loopback


def resolve_group(group):
    """``group``, or for ``None`` inside a loopback run (``loopback.run``) the thread's
    loopback rank: there ``None`` means "the default group" as it does in a normal run."""
    return current_loopback() if group is None else group


def group_rank_size(group) -> tuple[int, int]:
    """``(rank, world_size)`` of ``group``; ``(0, 1)`` when torch.distributed is not initialised."""
    if is_loopback(group):
        return group.rank, group.world_size
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise ValueError("a process group was given but torch.distributed is not initialised")
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


DEFAULT_TIMEOUT_S = 60.0


def timeout_seconds(timeout_s: Optional[float]) -> float:
    """A Buffer's ``timeout_s``: as given, else ``$MOK_TIMEOUT_S``, else 60 s (both backends)."""
    if timeout_s is not None:
        return float(timeout_s)
    return float(os.environ.get("MOK_TIMEOUT_S") or DEFAULT_TIMEOUT_S)


def group_timeout_seconds(group) -> Optional[float]:
    """The timeout ``group``'s own collectives run under (``init_process_group`` /
    ``new_group(timeout=...)``: Megatron sets its groups' from ``--distributed-timeout-minutes``),
    in seconds; ``None`` when it cannot be read (a loopback group, torch.distributed not
    initialised, a backend without options: torch keeps it in private fields)."""
    if is_loopback(group) or not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        pg = group if group is not None else dist.group.WORLD
        for device in (torch.device("cuda"), torch.device("cpu")):
            if device in pg._device_types:
                timeout = pg._get_backend(device).options._timeout
                if isinstance(timeout, timedelta) and timeout.total_seconds() > 0:
                    return timeout.total_seconds()
    except Exception:   # noqa: BLE001  (private fields: not readable -> the caller's default)
        return None
    return None


def wait_bounded(work, group, timeout_s: float) -> bool:
    """Wait for the async collective ``work`` up to ``timeout_s``: whether it completed (if not,
    it stays queued in the group). gloo waits with its own timeout; other backends (NCCL) are
    polled (their ``wait`` only orders the stream)."""
    if dist.get_backend(group) == "gloo":
        try:
            work.wait(timeout=timedelta(seconds=timeout_s))
            return True
        except RuntimeError as err:     # "Operation timed out!"; a peer gone raises otherwise
            if "timed out" in str(err).lower() and not work.is_completed():
                return False
            raise
    deadline = time.monotonic() + timeout_s
    while not work.is_completed():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.0005)
    work.wait()
    return True


def all_gather_exact(t: torch.Tensor, group, world_size: int, timeout_s: Optional[float] = None,
                     what: str = "a collective") -> torch.Tensor:
    """Gather ``t`` (same shape on every rank) into ``[W, *t.shape]``, bit-exact. With
    ``timeout_s``: raise :class:`~megatron_mok.cuda.errors.MokTimeout` (naming ``what``) when
    the group's other ranks have not all joined within it (not while a CUDA graph is captured,
    where nothing runs yet; a loopback group has its hub's own timeout)."""
    t = t.contiguous()
    if world_size == 1 or t.numel() == 0:   # nothing to exchange (T_max = 0 gives empty tensors)
        return t.unsqueeze(0).expand(world_size, *t.shape).clone()
    if is_loopback(group):
        return group.all_gather(t)
    flat = t.view(-1).view(torch.uint8) if t.numel() else t.new_empty(0, dtype=torch.uint8)
    outs: List[torch.Tensor] = [torch.empty_like(flat) for _ in range(world_size)]
    if timeout_s is None or (flat.is_cuda and torch.cuda.is_current_stream_capturing()):
        dist.all_gather(outs, flat, group=group)
    else:
        work = dist.all_gather(outs, flat, group=group, async_op=True)
        if not wait_bounded(work, group, timeout_s):
            raise MokTimeout(dist.get_rank(group), what, timeout_s)
    return torch.stack(outs).view(t.dtype).view(world_size, *t.shape)


# The status every reference-backend call exchanges first (``exchange_status``): one fixed-size
# int64 record per rank, whatever the call, so a rank that stops instead of making a call can
# post it in that call's place. Word 0: 0, or 1 + the byte length of a stop reason; words
# 1..STATUS_VALUES: the call's values (unused ones 0); then the reason's UTF-8 bytes.
STATUS_VALUES = 6
STATUS_REASON_BYTES = REASON_BYTES
_STATUS_WORDS = 1 + STATUS_VALUES + STATUS_REASON_BYTES // 8


def _status_record(values: Sequence[int], stop: Optional[str], device) -> torch.Tensor:
    if len(values) > STATUS_VALUES:
        raise ValueError(f"at most {STATUS_VALUES} status values, got {len(values)}")
    rec = torch.zeros(_STATUS_WORDS, dtype=torch.int64)
    rec[1:1 + len(values)] = torch.tensor([int(v) for v in values], dtype=torch.int64)
    if stop is not None:
        raw = reason_bytes(stop)
        rec[0] = 1 + len(raw)
        text = torch.zeros(STATUS_REASON_BYTES, dtype=torch.uint8)
        if raw:
            text[:len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        rec[1 + STATUS_VALUES:] = text.view(torch.int64)
    return rec.to(device)


def _read_status(all_rec: torch.Tensor) -> Tuple[torch.Tensor, Dict[int, str]]:
    all_rec = all_rec.cpu()
    stops = {}
    for r in range(all_rec.shape[0]):
        n = int(all_rec[r, 0])
        if n:
            raw = all_rec[r, 1 + STATUS_VALUES:].contiguous().view(torch.uint8)[:n - 1]
            stops[r] = bytes(raw.tolist()).decode("utf-8", "replace")
    return all_rec[:, 1:1 + STATUS_VALUES], stops


def exchange_status(values: Sequence[int], group, world_size: int, device,
                    timeout_s: Optional[float] = None,
                    what: str = "a status exchange",
                    stop: Optional[str] = None) -> Tuple[torch.Tensor, Dict[int, str]]:
    """The first collective of every reference-backend call: every rank's ``values`` (up to
    :data:`STATUS_VALUES` host ints) and which ranks stopped instead of making the call.

    Returns ``(values [W, STATUS_VALUES] int64 on the CPU, {rank: stop reason})``. A rank that
    stops posts the same record with its reason (:func:`post_stop`), so it matches this
    collective whatever call its peers are in. ``timeout_s``: as :func:`all_gather_exact`'s
    (a peer that never makes the call, nor posts a stop, ends in ``MokTimeout``). ``stop``:
    this rank's own reason, sent in this exchange (returned with the others', as its peers
    read it: cut to :data:`STATUS_REASON_BYTES`)."""
    rec = _status_record(values, stop, device)
    return _read_status(all_gather_exact(rec, group, world_size, timeout_s, what))


def post_stop(reason: str, group, world_size: int, device, timeout_s: float) -> bool:
    """This rank's status record with a stop ``reason``, in place of a call its peers make (they
    read it in :func:`exchange_status`). Returns whether every peer took part within
    ``timeout_s``; if not, the collective is left pending (the rank is failing anyway) and the
    peers wait for it as before."""
    rec = _status_record((), reason, device)
    try:                                   # (a loopback group: its hub's own timeout)
        all_gather_exact(rec, group, world_size, timeout_s, "a stop's post")
    except MokTimeout:
        return False
    return True


def status_device(group, hint=None) -> torch.device:
    """Where a status record must live for ``group``'s collectives: ``hint`` (the device of the
    call's tensors) when given, else a GPU for an NCCL group, else the CPU."""
    if hint is not None:
        return torch.device(hint)
    if (not is_loopback(group) and dist.is_available() and dist.is_initialized()
            and dist.get_backend(group) == "nccl"):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")

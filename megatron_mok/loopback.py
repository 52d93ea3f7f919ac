"""Loopback groups: ``W`` ranks as threads of one process, on one device.

For testing the multi-rank code paths (world sizes 2..8, odd ones included) where fewer
GPUs than ranks are available, e.g. on a one-GPU machine. Every rank is a Python thread with
its own CUDA stream; a rank's "peer memory" is an ordinary allocation of the shared device,
so the CUDA kernels run exactly as they would across GPUs (same pointers-to-peer code, same
flags and sequence numbers, same spin-waits), only over HBM instead of NVLink. Collectives
of the reference backend (``all_gather``) are exchanged through the hub in host memory.

What it does not show: anything specific to NVLink (bandwidth, remote-write visibility
across devices). Timings from a loopback group are not NVLink figures.

Usage::

    results = loopback.run(fn, world_size, *args, device="cuda")   # fn(rank, world_size, *args)

Inside ``fn``, ``Buffer(None, ...)`` joins the thread's loopback group (as ``None`` means
the default process group in a normal run), and the thread's current CUDA stream is its own.

Rules for code run this way (what would deadlock a single device): no device-wide
synchronisation (``torch.cuda.synchronize``, ``empty_cache``) while peers may have kernels
waiting on this rank (synchronise the current stream instead); CUDA-graph capture with
``capture_error_mode="thread_local"`` and a :meth:`LoopbackRank.barrier` before and after it.
The CUDA backend also keeps ``world_size * num_sms`` below the device's SM count (every
rank's transfer kernel must be resident at once): see :meth:`LoopbackRank.max_sms_per_rank`.
"""

from __future__ import annotations

import threading
import time
import traceback
from typing import Any, Callable, List, Optional

import torch

# SMs left free for the ranks' other kernels (layout, fill, torch ops) while every rank's
# transfer kernel is resident.
SPARE_SMS = 16

_local = threading.local()


class LoopbackError(AssertionError):
    """A loopback rank raised or did not finish; the message carries every rank's report."""


class LoopbackHub:
    """What the ranks of one loopback group share: a barrier and an exchange slot per rank."""

    def __init__(self, world_size: int, device: torch.device, timeout_s: float = 120.0):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.device = torch.device(device)
        self.timeout_s = timeout_s
        self._barrier = threading.Barrier(world_size, timeout=timeout_s)
        self._slots: List[Any] = [None] * world_size

    def barrier(self) -> None:
        try:
            self._barrier.wait()
        except threading.BrokenBarrierError:
            raise LoopbackError("loopback barrier broken: a peer rank failed or timed out") from None

    def exchange(self, rank: int, value: Any) -> List[Any]:
        """Every rank's ``value``, indexed by rank (a collective: every rank must call it)."""
        self._slots[rank] = value
        self.barrier()
        out = list(self._slots)
        self.barrier()          # nobody overwrites a slot before everyone has read it
        return out

    def abort(self) -> None:
        """Wake every rank waiting in a barrier with an error (a rank failed)."""
        self._barrier.abort()


class LoopbackRank:
    """One rank's view of a :class:`LoopbackHub`; pass it where a process group goes."""

    is_mok_loopback = True

    def __init__(self, hub: LoopbackHub, rank: int):
        self.hub, self.rank, self.world_size = hub, rank, hub.world_size

    def barrier(self) -> None:
        self.hub.barrier()

    def exchange(self, value: Any) -> List[Any]:
        return self.hub.exchange(self.rank, value)

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """``[W, *t.shape]``: every rank's ``t`` (same shape everywhere), bit-exact copies."""
        if t.is_cuda:
            torch.cuda.current_stream(t.device).synchronize()   # peers read it on their streams
        parts = self.exchange(t.contiguous())
        out = torch.stack([p.to(t.device) for p in parts])
        if t.is_cuda:
            torch.cuda.current_stream(t.device).synchronize()   # copied before peers move on
        self.barrier()
        return out

    def max_sms_per_rank(self, device_sms: int) -> int:
        """The most SMs one rank's transfer kernels may use so that every rank's are resident
        together with room (``SPARE_SMS``) for the other kernels."""
        return max(1, (device_sms - SPARE_SMS) // self.world_size)

    def __repr__(self):
        return f"LoopbackRank({self.rank}/{self.world_size} on {self.hub.device})"


def is_loopback(group) -> bool:
    return bool(getattr(group, "is_mok_loopback", False))


def current() -> Optional[LoopbackRank]:
    """The loopback rank this thread runs as (inside :func:`run`), else ``None``."""
    return getattr(_local, "rank", None)


def run(fn: Callable, world_size: int, *args, device="cuda", timeout_s: float = 300.0,
        **kwargs) -> List[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` threads, one loopback
    rank each, and return their results indexed by rank.

    Raises:
        LoopbackError: a rank raised (every rank's traceback is in the message) or did not
            finish within ``timeout_s`` (its thread is left running: a daemon thread).
    """
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    hub = LoopbackHub(world_size, device, timeout_s)
    results: List[Any] = [None] * world_size
    errors: dict = {}

    def body(rank: int) -> None:
        _local.rank = LoopbackRank(hub, rank)
        try:
            if device.type == "cuda":
                torch.cuda.set_device(device)
                with torch.cuda.stream(torch.cuda.Stream(device=device)):
                    results[rank] = fn(rank, world_size, *args, **kwargs)
                    torch.cuda.current_stream(device).synchronize()
            else:
                results[rank] = fn(rank, world_size, *args, **kwargs)
        except BaseException:
            errors[rank] = traceback.format_exc()
            hub.abort()
        finally:
            _local.rank = None

    threads = [threading.Thread(target=body, args=(r,), name=f"mok-loopback-rank{r}", daemon=True)
               for r in range(world_size)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout_s
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    hung = [r for r, t in enumerate(threads) if t.is_alive()]
    if hung:
        hub.abort()
        errors[-1] = f"ranks {hung} did not finish within {timeout_s:.0f} s (hang?)"
    if errors:
        name = getattr(fn, "__qualname__", repr(fn))
        report = "\n".join(f"--- rank {r} ---\n{msg}" for r, msg in sorted(errors.items()))
        raise LoopbackError(f"loopback run of {name} (world size {world_size}) failed:\n{report}")
    return results

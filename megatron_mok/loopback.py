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
the default process group in a normal run), and the thread's current CUDA stream is its own
(:class:`OwnStream`: never shared with another rank).

Rules for code run this way (what would deadlock a single device): the process must run
with ``CUDA_DEVICE_MAX_CONNECTIONS`` at least :func:`connections_needed` (32 covers 8 ranks)
set before CUDA initialises. The driver gives a context that many hardware work queues
(default 8) and maps streams onto them round robin; with more streams than queues, two ranks'
streams share a queue, whose commands run in order, so a rank's kernel can sit behind a peer's
kernel that waits, stream-ordered, for a kernel spinning until this rank's kernel runs: a
deadlock until the spin-waits time out (each rank uses two streams: its own and the CUDA
backend's side stream). Likewise ``CUDA_MODULE_LOADING=EAGER``, set before CUDA
initialises. With lazy loading (CUDA's default) the first launch of any kernel (torch's
included) may wait for the whole context to be idle, while peers' kernels spin waiting for
this rank: a deadlock until the spin-waits time out (CUDA programming guide, "Lazy
Loading", concurrent execution). No device-wide synchronisation (``torch.cuda.synchronize``,
``empty_cache``) while peers may have kernels waiting on this rank (synchronise the current
stream instead); CUDA-graph captures one rank at a time (:meth:`LoopbackRank.barrier` between
them), no replay before all captured; :func:`settle` before host-synchronising torch work
(:func:`run` makes torch's common host reads do it: :func:`settle_host_reads`).

The kernels are written for one rank per GPU, where a kernel that spins waiting for a peer
holds only its own GPU. Here every rank's spinning kernels share one GPU, so they must all
fit at once: the CUDA backend keeps ``world_size * num_sms`` transfer SMs below the device's
SM count less ``SPARE_SMS`` (:meth:`LoopbackRank.max_sms_per_rank`), and refuses calls whose
routing-count kernels (``W`` blocks per token chunk, each rank's spinning until its peers
publish) would not fit in the spare SMs (:meth:`LoopbackRank.check_layout_fits`): keep
``max_tokens_per_rank`` small at large world sizes.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from typing import Any, Callable, List, Optional

import torch

# SMs left free for the ranks' other kernels (layout, fill, torch ops) while every rank's
# transfer kernel is resident.
SPARE_SMS = 48
# Routing-count blocks (256 threads) one spare SM holds at once.
COUNT_BLOCKS_PER_SM = 8

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

    def check_layout_fits(self, device_sms: int, sms_per_rank: int, chunks_per_call: int) -> None:
        """Raise unless every rank's routing-count kernel (``chunks_per_call * W`` blocks
        that spin until the peers' routing is published) fits beside every rank's transfer
        kernel: otherwise a rank's kernel can wait for SMs held by peers that wait for it."""
        W = self.world_size
        need = W * W * chunks_per_call
        room = (device_sms - W * sms_per_rank) * COUNT_BLOCKS_PER_SM
        if need > room:
            raise ValueError(
                f"loopback group of {W} ranks on one GPU of {device_sms} SMs: the routing "
                f"kernels of a call need {need} resident blocks, only {room} fit beside the "
                f"transfer kernels; lower max_tokens_per_rank ({chunks_per_call} token chunks "
                f"per call now) or num_sms")

    def __repr__(self):
        return f"LoopbackRank({self.rank}/{self.world_size} on {self.hub.device})"


class OwnStream:
    """A CUDA stream that no other live rank holds (``.stream``, a torch stream object).

    torch's ``torch.cuda.Stream()`` takes streams from a pool of 32, round robin; two
    loopback ranks given the same one would queue kernels that wait for each other behind
    each other (a deadlock until the kernels time out). :meth:`close` hands the stream back
    for a later rank; streams are never destroyed, because torch may still record events on
    a stream after its last use (freeing a pinned buffer that a copy used does)."""

    _free: dict = {}
    _lock = threading.Lock()

    def __init__(self, device: torch.device):
        from .cuda import library

        index = device.index if device.index is not None else torch.cuda.current_device()
        self._index, self._ptr = index, None
        if not library.is_available():        # no CUDA backend to run: any stream will do
            self.stream = torch.cuda.Stream(device=device)
            return
        with OwnStream._lock:
            free = OwnStream._free.setdefault(index, [])
            self._ptr = free.pop() if free else None
        if self._ptr is None:
            lib = library.get()
            self._ptr = lib.mok_stream_create(index)
            if not self._ptr:
                raise RuntimeError(f"megatron_mok: {lib.mok_last_error().decode()}")
        self.stream = torch.cuda.ExternalStream(self._ptr, device=torch.device("cuda", index))

    def close(self) -> None:
        if self._ptr:
            self.stream.synchronize()
            with OwnStream._lock:
                OwnStream._free[self._index].append(self._ptr)
            self._ptr = None


def settle(device: torch.device) -> None:
    """In a loopback run on a GPU, wait for this thread's stream; elsewhere nothing.

    Call before host-synchronising torch work (``.cpu()``, boolean-mask indexing). Such a
    call queued behind this rank's communication kernels waits for them inside a pageable
    device-to-host copy, and seen on an H200: peer threads' CUDA calls (an event record)
    stalled behind it while their kernels were what this rank waited for."""
    if current() is not None and device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


# Tensor methods that read a CUDA tensor on the host (a pageable device-to-host copy behind the
# stream's kernels), settled first in loopback rank threads: see settle_host_reads.
_HOST_READS = ("tolist", "item", "cpu", "numpy", "nonzero", "equal", "allclose",
               "__bool__", "__int__", "__float__", "__index__")
_guards_installed = False


def _needs_settle(t) -> bool:
    return (isinstance(t, torch.Tensor) and t.is_cuda and current() is not None
            and not torch.cuda.is_current_stream_capturing())


def _settle_for(t) -> None:
    settle(t.device)


def _is_cpu_device(v) -> bool:
    return (isinstance(v, str) and v.split(":")[0] == "cpu") or (
        isinstance(v, torch.device) and v.type == "cpu")


def _settling(name: str, fn: Callable, reads: Callable[..., bool]) -> Callable:
    def read(*args, **kwargs):
        if reads(*args, **kwargs):
            t = args[0] if args else next(iter(kwargs.values()), None)   # torch.equal(input=...)
            if _needs_settle(t):
                _settle_for(t)
        return fn(*args, **kwargs)
    read.__name__ = read.__qualname__ = name
    read.__doc__ = fn.__doc__
    read.__wrapped__ = fn
    return read


def settle_host_reads() -> None:
    """Make torch's common host reads of a CUDA tensor :func:`settle` first in loopback rank
    threads (installed once, by the first :func:`run`; every other thread is left as it was).

    A host read (``.tolist()``, ``.item()``, ``.cpu()``, ``torch.equal``, ``bool(t)``, a
    boolean-mask index, ...) queued behind this rank's communication kernels waits for them
    inside a pageable device-to-host copy, and while it waits, peer threads' CUDA calls (an
    event record, a launch) stall behind it: if those calls are what this rank's kernels wait
    for, nothing moves until the kernels' timeouts (seen in s43-3 and s44-2: a worker's
    ``tokens_per_expert.tolist()`` right after an eager dispatch, while a slower peer was still
    inside its dispatch; 60 s, then timeout errors). Synchronising the stream first does not
    hold up peers' calls. Reads these wrappers do not cover (``torch.unique``, a
    ``repeat_interleave`` without its output size, ...) still need :func:`settle` by hand.
    Under CUDA-graph capture nothing is synchronised (no host read may be captured)."""
    global _guards_installed
    if _guards_installed:
        return
    always = lambda *a, **k: True                                           # noqa: E731
    for name in _HOST_READS:
        if hasattr(torch.Tensor, name):
            setattr(torch.Tensor, name, _settling(name, getattr(torch.Tensor, name), always))
    torch.equal = _settling("equal", torch.equal, always)
    torch.allclose = _settling("allclose", torch.allclose, always)
    to_cpu = lambda t, *a, **k: any(map(_is_cpu_device, a + tuple(k.values())))  # noqa: E731
    torch.Tensor.to = _settling("to", torch.Tensor.to, to_cpu)
    masked = lambda t, index, *a: any(                                       # noqa: E731
        isinstance(i, torch.Tensor) and i.dtype == torch.bool
        for i in (index if isinstance(index, tuple) else (index,)))
    torch.Tensor.__getitem__ = _settling("__getitem__", torch.Tensor.__getitem__, masked)
    _guards_installed = True


def is_loopback(group) -> bool:
    return bool(getattr(group, "is_mok_loopback", False))


def current() -> Optional[LoopbackRank]:
    """The loopback rank this thread runs as (inside :func:`run`), else ``None``."""
    return getattr(_local, "rank", None)


# CUDA_DEVICE_MAX_CONNECTIONS accepts 1..32.
MAX_CONNECTIONS = 32


def connections_needed(world_size: int) -> int:
    """Hardware work queues a GPU loopback run of ``world_size`` ranks needs: a stream of its
    own and the CUDA backend's side stream per rank, plus the default stream and one spare.
    Above 15 ranks no setting suffices (the driver allows 32) and :func:`run` refuses."""
    return 2 * world_size + 2


def run(fn: Callable, world_size: int, *args, device="cuda", timeout_s: float = 300.0,
        **kwargs) -> List[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` threads, one loopback
    rank each, and return their results indexed by rank.

    Raises:
        LoopbackError: a rank raised (every rank's traceback is in the message) or did not
            finish within ``timeout_s`` (its thread is left running: a daemon thread).
    """
    device = torch.device(device)
    if device.type == "cuda":
        if os.environ.get("CUDA_MODULE_LOADING", "").upper() != "EAGER":
            raise RuntimeError(
                "loopback ranks on a GPU need CUDA_MODULE_LOADING=EAGER, set before CUDA "
                "initialises: they share one CUDA context, where lazily loading a kernel can "
                "wait for peer kernels that spin until this rank launches (a deadlock)")
        need = connections_needed(world_size)
        have = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "8")
        if not have.isdigit() or int(have) < need:
            limit = ("" if need <= MAX_CONNECTIONS else
                     f"; the driver allows at most {MAX_CONNECTIONS}, so use at most "
                     f"{(MAX_CONNECTIONS - 2) // 2} loopback ranks")
            raise RuntimeError(
                f"{world_size} loopback ranks on a GPU need CUDA_DEVICE_MAX_CONNECTIONS >= {need} "
                f"(it is {have}), set before CUDA initialises: with fewer hardware work queues "
                "than streams, two ranks' streams share a queue, and a rank's kernel can wait "
                f"there behind work that waits for it (a deadlock until the timeout){limit}")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        from .cuda import library
        library.is_available()          # load it once here, not from every rank thread at once
    settle_host_reads()                 # (they act on CUDA tensors only)
    hub = LoopbackHub(world_size, device, timeout_s)
    results: List[Any] = [None] * world_size
    errors: dict = {}

    def body(rank: int) -> None:
        _local.rank = LoopbackRank(hub, rank)
        try:
            if device.type == "cuda":
                torch.cuda.set_device(device)
                own = OwnStream(device)
                try:
                    with torch.cuda.stream(own.stream):
                        results[rank] = fn(rank, world_size, *args, **kwargs)
                        torch.cuda.current_stream(device).synchronize()
                finally:
                    own.close()
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
    stalls = _watch(threads, time.monotonic() + timeout_s)
    hung = [r for r, t in enumerate(threads) if t.is_alive()]
    if hung:
        hub.abort()
        errors[-1] = f"ranks {hung} did not finish within {timeout_s:.0f} s (hang?)"
    if errors:
        name = getattr(fn, "__qualname__", repr(fn))
        report = "\n".join(f"--- rank {r} ---\n{msg}" for r, msg in sorted(errors.items()))
        if stalls:
            report += "\n--- host stalls seen while it ran ---\n" + "\n".join(stalls)
        raise LoopbackError(f"loopback run of {name} (world size {world_size}) failed:\n{report}")
    return results


STALL_S = 5.0


def _watch(threads: List[threading.Thread], deadline: float, every_s: float = 0.5) -> List[str]:
    """Wait for ``threads`` until ``deadline``, sampling their Python stacks; returns a line
    for every time a rank's host code stayed at one place for ``STALL_S`` or more (what a
    failure report needs: which rank was stuck where while its peers waited for it)."""
    since: dict = {}
    stalls: List[str] = []
    while time.monotonic() < deadline and any(t.is_alive() for t in threads):
        next(t for t in threads if t.is_alive()).join(every_s)
        frames = sys._current_frames()
        now = time.monotonic()
        for r, t in enumerate(threads):
            f = frames.get(t.ident) if t.is_alive() else None
            where = "".join(traceback.format_stack(f, limit=4)) if f is not None else None
            prev = since.get(r)
            if prev is None or prev[0] != where:
                since[r] = (where, now, False)
            elif where is not None and not prev[2] and now - prev[1] >= STALL_S:
                stalls.append(f"rank {r} stuck for {now - prev[1]:.0f}+ s at:\n{where}")
                _log_stall(stalls[-1])
                since[r] = (where, prev[1], True)
    return stalls


def _log_stall(line: str) -> None:
    """Append a stall to the file named by ``MOK_LOOPBACK_STALL_LOG`` as soon as it is seen.

    The report :func:`run` raises is lost when something outside kills the run first (a
    test selection's time limit: s43-3 saw a loopback test stall ~90 s and then be
    interrupted, with nothing to say where its ranks were); this file keeps it."""
    path = os.environ.get("MOK_LOOPBACK_STALL_LOG")
    if path:
        with open(path, "a") as f:
            f.write(f"[{time.strftime('%H:%M:%S')} pid {os.getpid()}] {line}\n")

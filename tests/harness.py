"""Multi-process test harness and seeded inputs.

``run_distributed(fn, world_size, *args)`` runs ``fn(rank, world_size, *args)`` on
``world_size`` processes joined by one process group (gloo on CPU, NCCL with one GPU per
rank), and returns the ranks' return values as a list. Any rank's exception fails the
calling test with that rank's traceback; a call that does not finish within ``timeout``
seconds fails the test instead of hanging CI. The processes are started with
``torch.multiprocessing`` (spawn) and meet at a ``TCPStore`` that the parent holds on a
free port chosen by the OS (never a fixed one).

Starting a rank costs seconds (importing torch), so by default the ranks are kept alive
and reused by later calls with the same ``(world_size, backend)``: a *pool*. A call in
which a rank died, hung, or was left inside a collective by a failing peer tears the pool
down, so the next call starts clean (when every rank returned or raised, the pool is
kept). Pass ``fresh=True`` for a call whose ``fn`` changes process-global state (Megatron's ``parallel_state``, a CUDA context that a trap
may have broken): it gets its own processes, ended after the call.

Shared-GPU mode (``MOK_TEST_SHARED_GPU=1``): a ``backend="nccl"`` call for more ranks than
visible GPUs puts rank ``r`` on ``cuda:(r % GPUs)`` and joins the ranks with gloo (NCCL
refuses two ranks on one GPU), so the multi-process tests run where one GPU is lent: the
ranks' Buffers then map each other's workspaces with CUDA IPC (``cuda/peer_memory.py``) and
the driver time-slices their kernels. The process-group path runs (separate processes and
contexts, IPC-mapped peers); NVLink does not. ``rank_device(rank)`` is a test's device.

``fn`` must be importable by name (a module-level function of a test module or of this
file), and its arguments and return value picklable.

``make_inputs(seed, world_size, T_per_rank, E, H, K, dtype, case=...)`` builds every rank's
``(x, topk_idx, topk_weights)`` from one seed, so each rank can compute every expected
output locally (see ``oracle.py``).
"""

from __future__ import annotations

import os
import pickle
import queue as queue_mod
import sys
import time
import traceback
from datetime import timedelta
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

# NVLink multicast (NVLS) can take a host's GPUs out of service on the lent machines; it
# must be off before any process group or symmetric memory exists. Forced, not defaulted.
_NO_MULTICAST_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
os.environ.update(_NO_MULTICAST_ENV)

from megatron_mok import loopback  # noqa: E402  (after the environment above)
from megatron_mok.loopback import settle  # noqa: E402

DEFAULT_TIMEOUT_S = float(os.environ.get("MOK_TEST_TIMEOUT", "180"))
_STARTUP_TIMEOUT_S = float(os.environ.get("MOK_TEST_STARTUP_TIMEOUT", "180"))
SHARED_GPU = os.environ.get("MOK_TEST_SHARED_GPU", "") == "1"
_RANK_DEVICE_ENV = "MOK_TEST_RANK_DEVICE"
_EXIT_GRACE_S = 10.0   # how long ranks told to stop get to exit before they are killed


def gpus_for(world_size: int) -> bool:
    """Whether a ``backend="nccl"`` call of ``world_size`` ranks can run here: a GPU per rank,
    or shared-GPU mode with at least one GPU."""
    n = torch.cuda.device_count()
    return n >= world_size or (SHARED_GPU and n >= 1)


def rank_device(rank: int) -> torch.device:
    """The device of this rank's tensors: its loopback hub's device, its GPU in a
    ``backend="nccl"`` call (``cuda:rank``, or ``cuda:(rank % GPUs)`` in shared-GPU mode), or
    the CPU in a gloo call."""
    import torch.distributed as dist

    group = loopback.current()
    if group is not None:                           # ranks as threads on one device
        return group.hub.device
    if os.environ.get(_RANK_DEVICE_ENV):
        return torch.device(os.environ[_RANK_DEVICE_ENV])
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", rank)
    return torch.device("cpu")


class DistributedTestError(AssertionError):
    """A rank raised, died or timed out; the message carries every rank's report."""


# ------------------------------------------------------------------------------- worker side
def _worker_main(rank: int, world_size: int, port: int, backend: str, env: Dict[str, str],
                 sys_path: List[str], task_q, result_q) -> None:
    os.environ.update(env)
    for p in reversed(sys_path):
        if p not in sys.path:
            sys.path.insert(0, p)
    import torch.distributed as dist

    # Ranks share 2 cores in CI: one intra-op thread each, or small ops crawl.
    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        elif backend == "shared":   # shared-GPU mode: this rank's GPU, joined by gloo
            device = torch.device("cuda", rank % torch.cuda.device_count())
            torch.cuda.set_device(device)
            os.environ[_RANK_DEVICE_ENV] = str(device)
        store = dist.TCPStore("127.0.0.1", port, is_master=False,
                              timeout=timedelta(seconds=_STARTUP_TIMEOUT_S))
        kwargs = {}
        if backend == "nccl":
            kwargs["device_id"] = torch.device("cuda", rank)
        dist.init_process_group("gloo" if backend == "shared" else backend, store=store, rank=rank,
                                world_size=world_size,
                                timeout=timedelta(seconds=DEFAULT_TIMEOUT_S), **kwargs)
        if backend != "nccl":
            _reduce_scatter_on_old_gloo()
    except BaseException:
        result_q.put((-1, rank, "err", "process-group init failed:\n" + traceback.format_exc()))
        return
    result_q.put((-1, rank, "ok", None))

    while True:
        msg = task_q.get()
        if msg is None:
            break
        call_id, payload, extra_path = msg
        for p in reversed(extra_path):
            if p not in sys.path:
                sys.path.insert(0, p)
        before = _process_groups()
        try:
            fn, args, kwargs = pickle.loads(payload)
            out = fn(rank, world_size, *args, **kwargs)
            try:
                blob = pickle.dumps(out)
            except Exception:
                blob = pickle.dumps(f"<unpicklable result {type(out).__name__}: {out!r:.200}>")
            _destroy_groups_made_since(before)
            reply = (call_id, rank, "ok", blob)
        except BaseException:
            reply = (call_id, rank, "err", traceback.format_exc())
        _release_cached_gpu_memory()      # before the reply: the next call may start at once
        result_q.put(reply)
    try:
        dist.destroy_process_group()
    except Exception:
        pass


def _reduce_scatter_on_old_gloo() -> None:
    """Let ``torch.distributed.reduce_scatter`` work on a gloo group of a torch whose gloo lacks it
    (torch 2.6: "ProcessGroupGloo does not support reduce_scatter"). Megatron's own dispatchers
    call it with expert / sequence parallelism (``_reduce_scatter_along_first_dim``), and the
    tests compare ``mok`` against them; megatron_mok itself never calls it. Where the real call
    works (newer torch, NCCL) it is what runs; otherwise each rank's chunk is all-reduced in
    turn and the rank keeps its own (synchronous calls only, as Megatron makes them)."""
    import torch.distributed as dist

    real = dist.reduce_scatter
    if getattr(real, "_mok_old_gloo", False):
        return

    def reduce_scatter(output, input_list, op=dist.ReduceOp.SUM, group=None, async_op=False):
        try:
            return real(output, input_list, op=op, group=group, async_op=async_op)
        except RuntimeError as e:
            if "does not support reduce_scatter" not in str(e) or async_op:
                raise
        me = dist.get_rank(group)
        for r, chunk in enumerate(input_list):
            total = chunk.clone()
            dist.all_reduce(total, op=op, group=group)
            if r == me:
                output.copy_(total)
        return None

    reduce_scatter._mok_old_gloo = True
    dist.reduce_scatter = reduce_scatter


def _release_cached_gpu_memory() -> None:
    """After each call of a pooled rank: give the GPU back what this process's caching
    allocator keeps (and the CUDA IPC shares its peers have closed). A pool outlives its call,
    and several pools (world sizes, backends) live at once: in shared-GPU mode every rank of
    every pool sits on the same GPU, and session 28's dry run of tests/megatron ran that GPU
    out of memory (a later test could not even create its CUDA context, NOTES item 33)."""
    if not torch.cuda.is_initialized():
        return
    try:
        torch.cuda.empty_cache()
        torch.cuda.ipc_collect()
    except Exception:       # a broken context (a trapped kernel): the pool is torn down anyway
        pass


def _process_groups() -> list:
    """The process groups this process holds (torch's registry; the default group among them)."""
    from torch.distributed import distributed_c10d as c10d

    return list(c10d._world.pg_map)


def _destroy_groups_made_since(before: list) -> None:
    """Destroy the groups a call made (Megatron's parallel state makes dozens per call and its
    teardown only drops them). A pooled rank runs many calls: each gloo group keeps three
    threads polling its sockets, and thousands of them slowed a 2-core CI machine ~100x."""
    import torch.distributed as dist

    for pg in _process_groups():
        if pg not in before:
            dist.destroy_process_group(pg)


# ------------------------------------------------------------------------------- parent side
class _Pool:
    """``world_size`` spawned ranks joined by one process group, fed calls by queue."""

    def __init__(self, world_size: int, backend: str):
        import torch.distributed as dist
        import torch.multiprocessing as mp

        self.world_size, self.backend = world_size, backend
        ctx = mp.get_context("spawn")
        # The parent owns the rendezvous store: port 0 lets the OS pick a free port, and
        # holding the socket open means no other run can take it between pick and use.
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                   timeout=timedelta(seconds=_STARTUP_TIMEOUT_S))
        env = dict(_NO_MULTICAST_ENV)
        if backend in ("gloo", "shared"):
            env.setdefault("GLOO_SOCKET_IFNAME", os.environ.get("GLOO_SOCKET_IFNAME", "lo"))
        env["OMP_NUM_THREADS"] = os.environ.get("OMP_NUM_THREADS", "1")
        # One process per rank: lazy kernel loading is safe and starts faster (conftest.py
        # makes the pytest process itself eager, for loopback ranks).
        env["CUDA_MODULE_LOADING"] = os.environ.get("MOK_RANK_MODULE_LOADING", "LAZY")
        self.result_q = ctx.Queue()
        self.task_qs = [ctx.Queue() for _ in range(world_size)]
        self.procs = []
        self.next_id = 0
        for r in range(world_size):
            p = ctx.Process(target=_worker_main, daemon=True,
                            args=(r, world_size, self.store.port, backend, env, list(sys.path),
                                  self.task_qs[r], self.result_q),
                            name=f"mok-test-rank{r}")
            p.start()
            self.procs.append(p)
        try:
            self._collect(-1, _STARTUP_TIMEOUT_S, what="process-group start-up")
        except BaseException:
            self.close(force=True)         # ranks that did start must not linger
            raise

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def call(self, fn, args, kwargs, timeout: float) -> List[Any]:
        try:
            payload = pickle.dumps((fn, args, kwargs))
        except Exception as e:  # fail here, not in a queue feeder thread
            raise TypeError(f"run_distributed: cannot pickle {fn!r} and its arguments: {e}") from e
        self.next_id += 1
        call_id = self.next_id
        for q in self.task_qs:
            q.put((call_id, payload, list(sys.path)))
        blobs = self._collect(call_id, timeout, what=getattr(fn, "__qualname__", repr(fn)))
        return [pickle.loads(b) for b in blobs]

    def _collect(self, call_id: int, timeout: float, what: str) -> List[Any]:
        results: Dict[int, Any] = {}
        errors: Dict[int, str] = {}
        deadline = time.monotonic() + timeout
        grace_deadline = None
        while len(results) + len(errors) < self.world_size:
            now = time.monotonic()
            if grace_deadline is not None and now > grace_deadline:
                break                          # peers of a failed rank may be stuck: stop
            if now > deadline:
                missing = sorted(set(range(self.world_size)) - set(results) - set(errors))
                errors.setdefault(-1, f"TIMEOUT: {what} did not finish within {timeout:.0f} s; "
                                      f"ranks {missing} never returned (hang?)")
                break
            try:
                cid, rank, status, data = self.result_q.get(timeout=0.2)
            except queue_mod.Empty:
                dead = [r for r, p in enumerate(self.procs)
                        if not p.is_alive() and r not in results and r not in errors]
                for r in dead:
                    errors[r] = f"rank {r} died (exit code {self.procs[r].exitcode})"
                if dead and grace_deadline is None:
                    grace_deadline = time.monotonic() + 2.0
                continue
            if cid != call_id:
                continue                       # a late answer from an earlier, failed call
            if status == "ok":
                results[rank] = data
            else:
                errors[rank] = data
                if grace_deadline is None:
                    grace_deadline = time.monotonic() + 2.0
        if errors:
            everyone_answered = (len(results) + len(errors) == self.world_size
                                 and -1 not in errors and self.alive())
            if not everyone_answered:
                # A rank still inside a collective, dead or hung: the pool is unusable.
                self.close(force=True)
            # else: each rank returned or raised at the top of its fn, so no collective is
            # half-done and the ranks can take the next call.
            lines = [f"run_distributed({what}, world_size={self.world_size}, "
                     f"backend={self.backend}) failed:"]
            for r in sorted(errors):
                head = "harness" if r < 0 else f"rank {r}"
                lines.append(f"----- {head} -----\n{errors[r]}")
            stuck = sorted(set(range(self.world_size)) - set(results) - set(errors))
            if stuck and -1 not in errors:
                lines.append(f"(ranks {stuck} had not returned; they were killed)")
            raise DistributedTestError("\n".join(lines))
        return [results[r] for r in range(self.world_size)]

    def ask_to_stop(self) -> None:
        """Tell every rank to leave its loop (it then destroys its process group and exits)."""
        for q in self.task_qs:
            try:
                q.put(None)
            except Exception:
                pass

    def reap(self, deadline: float) -> None:
        """Wait for the ranks until ``deadline`` (``time.monotonic()``), then kill the rest."""
        for p in self.procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
        self.procs = []

    def close(self, force: bool = False) -> None:
        if not force:
            self.ask_to_stop()
        self.reap(time.monotonic() + (0.0 if force else _EXIT_GRACE_S))


_POOLS: Dict[Tuple[int, str], _Pool] = {}


def run_distributed(fn, world_size: int, *args, backend: str = "gloo",
                    timeout: Optional[float] = None, fresh: bool = False, **kwargs) -> List[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` ranks.

    Args:
        fn: a module-level function (pickled by name).
        world_size: number of ranks.
        backend: ``"gloo"`` (CPU) or ``"nccl"`` (rank ``r`` on ``cuda:r``; in shared-GPU mode,
            with fewer GPUs than ranks, on ``cuda:(r % GPUs)`` over gloo: module docstring).
        timeout: seconds before the call counts as hung (default ``$MOK_TEST_TIMEOUT`` or 180).
        fresh: run on new processes, ended after the call (for ``fn``s with global state).

    Returns:
        The ranks' return values, indexed by rank.

    Raises:
        DistributedTestError (an ``AssertionError``): a rank raised (its traceback is in the
        message), died, or the call timed out.
    """
    timeout = DEFAULT_TIMEOUT_S if timeout is None else timeout
    if backend == "nccl" and torch.cuda.device_count() < world_size:
        if not gpus_for(world_size):
            raise RuntimeError(f"backend='nccl' with world_size={world_size} needs {world_size} "
                               f"GPUs, found {torch.cuda.device_count()} (MOK_TEST_SHARED_GPU=1 runs "
                               f"the ranks as processes sharing the GPUs there are)")
        backend = "shared"
    key = (world_size, backend)
    if fresh:
        pool = _Pool(world_size, backend)
        try:
            return pool.call(fn, args, kwargs, timeout)
        finally:
            pool.close(force=False)
    pool = _POOLS.get(key)
    if pool is not None and not pool.alive():
        pool.close(force=True)
        pool = None
    if pool is None:
        pool = _POOLS[key] = _Pool(world_size, backend)
    try:
        return pool.call(fn, args, kwargs, timeout)
    except BaseException:
        if not pool.procs or not pool.alive():
            _POOLS.pop(key, None)
            pool.close(force=True)
        raise


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a rendezvous of processes)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_rank_scripts(script: str, world_size: int, *args: str, env_for_rank=None,
                     timeout: float = 240) -> Tuple[List[int], List[str]]:
    """Run ``python tests/SCRIPT RANK WORLD PORT *ARGS`` once per rank, as processes of their
    own (for what a pooled rank cannot show: an interpreter really exiting, an environment set
    before CUDA starts). ``env_for_rank(r)``: extra environment of rank ``r``. Returns every
    rank's exit code and output; raises :class:`DistributedTestError` (killing them all) when
    one has not exited within ``timeout`` seconds."""
    import subprocess

    here = os.path.dirname(os.path.abspath(__file__))
    port = free_port()
    procs = []
    for r in range(world_size):
        env = {**os.environ, **((env_for_rank or (lambda _: {}))(r)),
               "PYTHONPATH": os.path.dirname(here) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        procs.append(subprocess.Popen([sys.executable, os.path.join(here, script), str(r), str(world_size),
                                       str(port), *args], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=timeout)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise DistributedTestError(f"{script}: a rank did not exit within {timeout:.0f} s (a hang?)")
    return [p.returncode for p in procs], logs


def run_loopback(fn, world_size: int, *args, device="cuda", timeout: Optional[float] = None,
                 **kwargs) -> List[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` loopback ranks:
    threads of this process on one device (``megatron_mok.loopback``), so multi-rank code
    runs where fewer GPUs than ranks exist. Same contract as :func:`run_distributed`."""
    timeout = DEFAULT_TIMEOUT_S if timeout is None else timeout
    try:
        return loopback.run(fn, world_size, *args, device=device, timeout_s=timeout, **kwargs)
    except loopback.LoopbackError as e:
        raise DistributedTestError(str(e)) from None


def in_loopback() -> bool:
    return loopback.current() is not None


def sync_device() -> None:
    """Wait for this rank's GPU work: the current stream in a loopback run (a device-wide
    wait there can wait for a peer's kernel that waits for this rank), else the device."""
    if in_loopback():
        torch.cuda.current_stream().synchronize()
    else:
        torch.cuda.synchronize()


def loopback_barrier() -> None:
    """Every loopback rank reaches this point before any goes on."""
    loopback.current().barrier()


def capture_in_turn(rank: int, world_size: int, capture):
    """``capture()`` (a CUDA-graph capture) on every rank; returns its result. Loopback ranks
    are threads of one process: they capture one at a time (torch synchronises the device and
    frees cached memory around a capture, and a global-mode capture forbids such calls on other
    threads), and none goes on to replay before all have captured."""
    if not in_loopback():
        return capture()
    loopback_barrier()
    out = None
    for r in range(world_size):
        if r == rank:
            out = capture()
        loopback_barrier()
    return out


def shutdown_pools(grace_s: Optional[float] = None) -> None:
    """End every pooled rank (called at the end of the pytest session): every pool is asked to
    stop first, then all get one shared ``grace_s`` (default 10 s) to exit before the rest are
    killed. One pool after another, each with its own grace, took up to 20 s a rank whose exit
    hung; a session with many pools could then outlast a device call's limit after its last
    test (session 28's s28-2 reached 100% and did not exit within the call; NOTES item 33)."""
    grace_s = _EXIT_GRACE_S if grace_s is None else grace_s
    pools = [_POOLS.pop(key) for key in list(_POOLS)]
    for pool in pools:
        pool.ask_to_stop()
    deadline = time.monotonic() + grace_s
    for pool in pools:
        pool.reap(deadline)


# ------------------------------------------------------------------------------ seeded inputs
CASES = ("random", "unrouted", "one_expert", "duplicate", "skewed", "mixed")


def make_inputs(seed: int, world_size: int, T_per_rank: Sequence[int], E: int, H: int, K: int,
                dtype: torch.dtype, case: str = "random", values: str = "normal",
                idx_dtype: torch.dtype = torch.int64, device="cpu"):
    """Every rank's ``(x [T_r, H], topk_idx [T_r, K], topk_weights [T_r, K])``, from one seed.

    Every rank calls this with the same arguments and gets the same list, so it knows what
    its peers send. Cases (routing):

    - ``random``: K distinct experts per token (as a top-k router picks them).
    - ``unrouted``: distinct experts, about a third of the slots ``-1`` (some tokens fully).
    - ``one_expert``: every token sends slot 0 to expert ``E-1`` (on the last rank) and
      leaves the other slots ``-1``; all other experts get no rows.
    - ``duplicate``: experts drawn with replacement, so a token may name one expert twice.
    - ``skewed``: distinct experts drawn from the lowest ``min(E, K+1)`` ids: most experts
      (and, for ``E > W``, whole ranks) get no rows.
    - ``mixed``: with replacement and about a quarter ``-1``.

    ``values="normal"`` draws ``x`` from N(0, 1) (rounded to ``dtype``); ``values="int"``
    draws multiples of 1/8 in [-2, 2], so sums of up to 8 copies are exact in every dtype.
    Weights are float32 in [0.05, 1).
    """
    if case not in CASES:
        raise ValueError(f"unknown case {case!r}; one of {CASES}")
    if len(T_per_rank) != world_size:
        raise ValueError("T_per_rank needs one entry per rank")
    g = torch.Generator().manual_seed(seed)
    out = []
    for T in T_per_rank:
        if values == "int":
            x = (torch.randint(-16, 17, (T, H), generator=g).float() / 8).to(dtype)
        else:
            x = torch.randn(T, H, generator=g).to(dtype)
        if case in ("random", "unrouted"):
            idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) \
                if T else torch.empty(0, K, dtype=torch.int64)
        elif case == "skewed":
            lim = min(E, K + 1)
            idx = torch.stack([torch.randperm(lim, generator=g)[:K] for _ in range(T)]) \
                if T else torch.empty(0, K, dtype=torch.int64)
        elif case == "one_expert":
            idx = torch.full((T, K), -1, dtype=torch.int64)
            idx[:, 0] = E - 1
        else:  # duplicate, mixed
            idx = torch.randint(0, E, (T, K), generator=g)
        if case in ("unrouted", "mixed"):
            drop = torch.rand(T, K, generator=g) < (0.34 if case == "unrouted" else 0.25)
            if T >= 2:
                drop[T // 2] = True            # at least one token with no routed slot
            idx = torch.where(drop, torch.full_like(idx, -1), idx)
        w = torch.rand(T, K, generator=g) * 0.95 + 0.05
        out.append((x.contiguous().to(device), idx.to(idx_dtype).contiguous().to(device),
                    w.float().contiguous().to(device)))
    return out


def seeded(seed: int, shape, dtype: torch.dtype = torch.float32, device="cpu") -> torch.Tensor:
    """A seeded N(0, 1) tensor (any rank can recreate any other rank's)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).to(device)


# --------------------------------------------------------------------------------- asserts
_INT_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16,
             torch.float64: torch.int64}


def assert_bitwise(actual: torch.Tensor, expected: torch.Tensor, what: str = "tensor") -> None:
    """Same dtype, shape and bits (``-0.0 != +0.0``, NaN payloads compared)."""
    assert isinstance(actual, torch.Tensor), f"{what}: not a tensor ({type(actual).__name__})"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert tuple(actual.shape) == tuple(expected.shape), \
        f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    for t in (actual, expected):
        settle(t.device)
    a, e = actual.detach().cpu().contiguous(), expected.detach().cpu().contiguous()
    if a.dtype in _INT_VIEW:
        a, e = a.view(_INT_VIEW[a.dtype]), e.view(_INT_VIEW[e.dtype])
    bad = (a != e)
    if bool(bad.any()):
        first = tuple(int(i) for i in bad.nonzero()[0])
        n = int(bad.sum())
        raise AssertionError(
            f"{what}: {n} of {a.numel()} elements differ bitwise; first at {first}: "
            f"got {actual.detach().cpu()[first].item()!r}, expected {expected.detach().cpu()[first].item()!r}")


# ------------------------------------------------------------------------------- case table
def _per_rank(values: Sequence[int], world_size: int) -> List[int]:
    return [values[r % len(values)] for r in range(world_size)]


def contract_cases(world_size: int) -> Dict[str, dict]:
    """The routing cases every backend is held to, sized for ``world_size`` ranks.

    Each spec: ``T`` (tokens per rank), ``T_max``, ``E``, ``H``, ``K``, ``case`` (see
    :func:`make_inputs`), ``idx_dtype``. Hidden sizes are multiples of 8 so the same table
    serves the CUDA backend.
    """
    W = world_size

    def spec(T, E, K, case="random", H=32, idx_dtype=torch.int64, slack=3):
        return dict(T=list(T), T_max=max(T) + slack, E=E, H=H, K=min(K, E), case=case,
                    idx_dtype=idx_dtype)

    return {
        "random": spec(_per_rank([11, 16, 5, 9], W), 4 * W, 4),
        "random_int32_idx": spec(_per_rank([12, 7], W), 4 * W, 3, idx_dtype=torch.int32),
        "t_max_exact": spec(_per_rank([8, 8], W), 2 * W, 2, slack=0),
        "t0_on_rank0": spec([0] + [9] * (W - 1), 2 * W, 2),
        "t0_everywhere": spec([0] * W, 2 * W, 2),
        "t_max_zero": spec([0] * W, 2 * W, 2, slack=0),
        "unrouted_slots": spec(_per_rank([10, 13, 6], W), 4 * W, 3, case="unrouted"),
        "all_to_one_expert": spec(_per_rank([9, 6, 12], W), 4 * W, 3, case="one_expert"),
        "experts_without_rows": spec(_per_rank([10, 7], W), 4 * W, 2, case="skewed"),
        "k1": spec(_per_rank([9, 14], W), 2 * W, 1),
        "e_equals_w": spec(_per_rank([7, 10], W), W, 2),
        "e_equals_w_duplicates": spec(_per_rank([7, 10], W), W, 2, case="duplicate"),
        "odd_t": spec(_per_rank([1, 3, 7, 5], W), 2 * W, 2),
        "same_expert_twice": spec(_per_rank([9, 12], W), 2 * W, 4, case="duplicate"),
        "mixed": spec(_per_rank([13, 4, 10, 7], W), 4 * W, 4, case="mixed"),
        "dsv3_like": spec(_per_rank([48, 40], W), 8 * W, 8, H=64),
        # More rows per token than the CUDA kernels keep in registers (8): their other path.
        "k16_duplicates": spec(_per_rank([21, 10], W), 16 * W, 16, case="duplicate"),
        # Rows of one 8-element vector (the width of the FP8 dispatch's prob-gradient combine):
        # the CUDA combine's lane-per-item path; a rank without tokens among them.
        "narrow_rows": spec(_per_rank([13, 0, 10, 7], W), 4 * W, 4, case="mixed", H=8),
        # Rows of two combine steps (1024 elements) and fewer tokens than warps: the CUDA combine
        # deals each token to several warps, and those sum the ranks' partials themselves (the
        # own-partial staging needs a token per warp). Its rank order is then only visible with
        # 3+ ranks holding a token and float32 rows (mutation audit, benchmarks/NOTES.md item 30).
        "wide_rows": spec(_per_rank([6, 3, 9, 4], W), 4 * W, 4, case="mixed", H=1024),
    }


DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _buffer(spec: dict, dtype, backend: str, partial=None, **kw):
    import megatron_mok as mok

    return mok.Buffer(None, num_experts=spec["E"], hidden=spec["H"], topk=spec["K"],
                      max_tokens_per_rank=spec["T_max"], dtype=dtype, backend=backend,
                      combine_partial_dtype=partial, **kw)


def small_buffer(dtype=torch.bfloat16, **kw):
    """A one-rank Buffer of the error tests' shape (E=4, H=16, K=2, T_max=8) on the reference
    backend; keyword arguments override any of it."""
    import megatron_mok as mok

    args = dict(num_experts=4, hidden=16, topk=2, max_tokens_per_rank=8, dtype=dtype,
                backend="reference")
    args.update(kw)
    return mok.Buffer(**args)


def spec_inputs(spec: dict, world_size: int, dtype, seed: int, values: str = "normal", device="cpu"):
    return make_inputs(seed, world_size, spec["T"], spec["E"], spec["H"], spec["K"], dtype,
                       case=spec["case"], values=values, idx_dtype=spec["idx_dtype"], device=device)


def check_contract_case(rank: int, world_size: int, spec: dict, seed: int,
                        backend: str = "reference", device="cpu",
                        dtypes: Sequence[torch.dtype] = DTYPES, **buffer_kw) -> Dict[str, int]:
    """Dispatch and combine of one case against the oracle, bitwise, for every dtype and
    both partial-dtype modes; plus combine(dispatch(x)) == x * routed slots on exact
    inputs. Returns the row counts (so a test can see what it covered)."""
    import oracle

    stats = {}
    for di, dtype in enumerate(dtypes):
        inputs = spec_inputs(spec, world_size, dtype, seed + di, device=device)
        routing = oracle.route(inputs, spec["E"])
        exp = oracle.expected_dispatch(inputs, spec["E"], rank, routing)
        x, idx, w = inputs[rank]
        tag = f"[{spec['case']} {dtype} rank {rank}]"
        # The expert outputs of every rank (seeded), for the combine check.
        eo_all = [seeded(seed * 7919 + 31 * d + di, (routing[d].num_rows, spec["H"]), dtype)
                  for d in range(world_size)]
        for partial in (None, torch.float32):
            buf = _buffer(spec, dtype, backend, partial, **buffer_kw)
            res = buf.dispatch(x, idx, w)
            ptag = f"{tag} partial={partial}"
            assert_bitwise(res.tokens, exp["tokens"].to(device), f"tokens {ptag}")
            assert_bitwise(res.probs, exp["probs"].to(device), f"probs {ptag}")
            assert_bitwise(res.tokens_per_expert, exp["tokens_per_expert"].to(device),
                           f"tokens_per_expert {ptag}")
            assert_bitwise(res.src_rank, exp["src_rank"].to(device), f"src_rank {ptag}")
            assert_bitwise(res.src_token, exp["src_token"].to(device), f"src_token {ptag}")
            assert res.tokens_per_expert.device == x.device, f"tokens_per_expert device {ptag}"
            y = buf.combine(eo_all[rank].to(device), res.handle)
            want = oracle.expected_combine(routing, eo_all, rank, x.shape[0], dtype,
                                           partial if partial is not None else dtype)
            assert_bitwise(y, want.to(device), f"combine {ptag}")
            buf.destroy()
        stats[str(dtype)] = routing[rank].num_rows

        # combine(dispatch(x)) with identity experts == x * (number of routed slots), exactly.
        ints = spec_inputs(spec, world_size, dtype, seed + 100 + di, values="int", device=device)
        xi, ii, wi = ints[rank]
        n = oracle.routed_slots(ii.cpu()).to(device)
        want = torch.where((n > 0).view(-1, 1), xi.float() * n.view(-1, 1).float(),
                           torch.zeros((), device=device)).to(dtype)
        for partial in (None, torch.float32):
            buf = _buffer(spec, dtype, backend, partial, **buffer_kw)
            res = buf.dispatch(xi, ii, wi)
            y = buf.combine(res.tokens, res.handle)
            assert_bitwise(y, want, f"identity round trip {tag} partial={partial}")
            buf.destroy()
    return stats


def check_and_destroy(buf, *others) -> None:
    """Raise ``buf``'s pending device error report, if any (CUDA backend); free every Buffer."""
    buf.check_errors()
    for b in (buf,) + others:
        b.destroy()


def sample_expert(res, tokens: torch.Tensor, probs: torch.Tensor, seed: int, dtype) -> torch.Tensor:
    """The expert of :func:`full_pass`: each row times its prob and a factor of its source.
    The factor depends on the row's source, not its position, so static and dynamic mode
    (or two backends) compute the same thing; no host sync."""
    key = (res.src_rank * 131 + res.src_token * 7 + seed) % 17
    scale = (1.0 + key.to(torch.float32) / 32).view(-1, 1)
    return (tokens.float() * scale * probs[:, None]).to(dtype).contiguous()


def full_pass(buf, x0: torch.Tensor, idx: torch.Tensor, w0: torch.Tensor, seed: int,
              expert_out_override: Optional[torch.Tensor] = None,
              by_hand: Optional[bool] = None,
              rows_per_expert: Optional[int] = None,
              recv_budget: Optional[int] = None) -> Dict[str, torch.Tensor]:
    """One forward + backward through ``buf``: dispatch, :func:`sample_expert`, combine, and a
    seeded upstream gradient. Returns every output and gradient (detached, on CPU) for
    bitwise comparisons between runs/backends. ``rows_per_expert`` / ``recv_budget``: the
    dispatch's (``by_hand`` takes no budget).

    ``by_hand`` (default: for the reference backend in a loopback run on a GPU) writes the
    chain rule out instead of calling autograd: see :func:`backward_by_hand`."""
    if by_hand is None:
        by_hand = in_loopback() and x0.is_cuda and buf.requested_backend == "reference"
    if by_hand:
        assert expert_out_override is None and recv_budget is None
        gy = seeded(seed + 1, (x0.shape[0], buf.hidden), device=x0.device)
        return _on_cpu(backward_by_hand(buf, x0, idx, w0,
                                        lambda r, t, p: sample_expert(r, t, p, seed, buf.dtype), gy,
                                        rows_per_expert))
    x = x0.detach().clone().requires_grad_(True)
    w = w0.detach().clone().requires_grad_(True)
    res = buf.dispatch(x, idx, w, rows_per_expert=rows_per_expert, recv_budget=recv_budget)
    eo = sample_expert(res, res.tokens, res.probs, seed, buf.dtype)
    if expert_out_override is not None:
        eo = expert_out_override
    eo.retain_grad() if eo.requires_grad else None
    y = buf.combine(eo, res.handle)
    gy = seeded(seed + 1, tuple(y.shape), device=x0.device)
    (y.float() * gy).sum().backward()
    out = dict(tokens=res.tokens, probs=res.probs, tokens_per_expert=res.tokens_per_expert,
               src_rank=res.src_rank, src_token=res.src_token, y=y, grad_x=x.grad,
               grad_topk_weights=w.grad, grad_expert_out=eo.grad)
    return _on_cpu(out)


def _on_cpu(out: Dict[str, Any]) -> Dict[str, Any]:
    """Detached CPU copies of a dict's tensors (other values as they are)."""
    for v in out.values():
        if isinstance(v, torch.Tensor):
            settle(v.device)
    return {k: (v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v) for k, v in out.items()}


def backward_by_hand(buf, x0, idx, w0, expert, gy: torch.Tensor,
                     rows_per_expert: Optional[int] = None) -> Dict[str, torch.Tensor]:
    """Dispatch, ``expert(res, tokens, probs) -> expert_out``, combine, and the backward of
    ``(y.float() * gy).sum()`` written out as the contract states it: combine's backward is
    a cached dispatch of ``grad_y``; dispatch's is a combine of the row gradients carrying
    the prob gradients. Only the local expert goes through autograd.

    Why: autograd runs the GPU backward nodes of every thread on one device thread. In a
    loopback run (ranks as threads) a backward op that blocks until its peers arrive (the
    reference backend's all_gather) would wait for peers queued behind it on that thread.
    The CUDA backend's backward ops only launch kernels, so they keep using autograd."""
    backend = buf._backend_for(x0)
    with torch.no_grad():
        res = buf.dispatch(x0.detach(), idx, w0.detach(), rows_per_expert=rows_per_expert)
    tokens = res.tokens.detach().requires_grad_(True)
    probs = res.probs.detach().requires_grad_(True)
    with torch.enable_grad():
        eo = expert(res, tokens, probs)
    y = buf.combine(eo.detach(), res.handle)
    grad_y = gy.to(y.dtype)                            # d/dy of (y.float() * gy).sum()
    grad_eo = buf.dispatch(grad_y, handle=res.handle).tokens
    grad_tokens, grad_probs = torch.autograd.grad(eo, (tokens, probs), grad_eo)
    grad_x, grad_w = backend.combine(grad_tokens.contiguous(), res.handle,
                                     grad_probs=grad_probs.contiguous())
    return dict(tokens=res.tokens, probs=res.probs, tokens_per_expert=res.tokens_per_expert,
                src_rank=res.src_rank, src_token=res.src_token, y=y, grad_x=grad_x,
                grad_topk_weights=grad_w, grad_expert_out=grad_eo)


def assert_same_results(a: Dict[str, Any], b: Dict[str, Any], what: str) -> None:
    assert a.keys() == b.keys(), f"{what}: fields {sorted(a)} != {sorted(b)}"
    for k in a:
        if a[k] is None or b[k] is None:
            assert a[k] is None and b[k] is None, f"{what}: {k} is None on one side only"
            continue
        assert_bitwise(a[k], b[k], f"{what}: {k}")


# ----------------------------------------------------------------------- expert alignment
ALIGNMENT_CASES = ("random", "t_max_exact", "t0_on_rank0", "t0_everywhere", "unrouted_slots", "all_to_one_expert",
                   "experts_without_rows", "e_equals_w_duplicates", "dsv3_like", "k16_duplicates")


def padded_row_positions(tokens_per_expert: torch.Tensor, alignment: int,
                         rows_per_expert: Optional[int] = None):
    """Where the rows of an unaligned dispatch (counts ``tokens_per_expert``) must land with
    ``expert_alignment`` (or ``rows_per_expert``): ``(pos [R0], padded counts [E_local], R)``.
    Written independently of the backends: expert e's rows start after every earlier expert's
    rows rounded up (or after e * N rows)."""
    counts = [int(c) for c in tokens_per_expert.tolist()]
    pos, start, padded = [], 0, []
    for c in counts:
        pos.extend(range(start, start + c))
        p = -(-c // alignment) * alignment if rows_per_expert is None else rows_per_expert
        assert p >= c
        padded.append(p)
        start += p
    return torch.tensor(pos, dtype=torch.int64), torch.tensor(padded, dtype=torch.int64), start


def check_alignment_case(rank: int, world_size: int, spec: dict, seed: int, backend: str,
                         alignment: int, device="cpu", ref_backend: Optional[str] = None,
                         static_extra: Optional[int] = None,
                         dtypes: Sequence[torch.dtype] = (torch.bfloat16, torch.float32),
                         capacity_extra: Optional[int] = None) -> int:
    """``Buffer(expert_alignment=A)`` is a pure relayout of the unaligned dispatch, bitwise:
    the same rows at :func:`padded_row_positions`, zero rows (prob 0, source -1) in between,
    padded counts; combine output and every gradient unchanged; the rows' gradient zero on the
    zero rows; combine never reads them (NaN there changes nothing). With ``ref_backend`` the
    aligned run also equals that backend's aligned run; with ``static_extra`` a static-shape
    Buffer (``max_recv_tokens = R + static_extra``) gives the same rows, zeros after ``R``.
    With ``capacity_extra`` the aligned Buffer's dispatches pass ``rows_per_expert = N``, this
    rank's largest expert count plus ``capacity_extra``, rounded up to ``alignment`` (so ranks
    may differ): every expert then has exactly N rows.
    Returns this rank's zero rows (so a test can see it covered some)."""
    gaps_total = 0
    for di, dtype in enumerate(dtypes):
        inputs = spec_inputs(spec, world_size, dtype, seed + di, device=device)
        x, idx, w = inputs[rank]
        tag = f"[{spec['case']} {dtype} A={alignment} rank {rank}]"
        plain = _buffer(spec, dtype, backend, device=device)
        aligned = _buffer(spec, dtype, backend, device=device, expert_alignment=alignment)
        p = full_pass(plain, x, idx, w, seed)
        n = None
        if capacity_extra is not None:
            most = int(p["tokens_per_expert"].max()) if p["tokens_per_expert"].numel() else 0
            n = -(-(most + capacity_extra) // alignment) * alignment
            tag = tag[:-1] + f" N={n}]"
        a = full_pass(aligned, x, idx, w, seed, rows_per_expert=n)
        pos, padded, R = padded_row_positions(p["tokens_per_expert"], alignment, n)
        assert_bitwise(a["tokens_per_expert"], padded, f"tokens_per_expert {tag}")
        assert a["tokens"].shape[0] == R, f"R {tag}: {a['tokens'].shape[0]} != {R}"
        gap = torch.ones(R, dtype=torch.bool)
        gap[pos] = False
        gaps_total += int(gap.sum())
        for k, fill in (("tokens", 0), ("probs", 0), ("src_rank", -1), ("src_token", -1),
                        ("grad_expert_out", 0)):
            assert_bitwise(a[k][pos], p[k], f"{k} rows {tag}")
            assert_bitwise(a[k][gap], torch.full_like(a[k][gap], fill), f"{k} zero rows {tag}")
        for k in ("y", "grad_x", "grad_topk_weights"):
            assert_bitwise(a[k], p[k], f"{k} {tag}")
        # combine never reads the zero rows
        res = aligned.dispatch(x, idx, w, rows_per_expert=n)
        eo = res.tokens.clone()
        eo[res.src_rank < 0] = float("nan")
        resp = plain.dispatch(x, idx, w)
        assert_bitwise(aligned.combine(eo, res.handle), plain.combine(resp.tokens, resp.handle),
                       f"combine with NaN in the zero rows {tag}")
        if ref_backend is not None:
            ref = _buffer(spec, dtype, ref_backend, device=device, expert_alignment=alignment)
            assert_same_results(a, full_pass(ref, x, idx, w, seed, rows_per_expert=n),
                                f"{backend} vs {ref_backend} {tag}")
            ref.destroy()
        if static_extra is not None:
            st = _buffer(spec, dtype, backend, device=device, expert_alignment=alignment,
                         max_recv_tokens=R + static_extra)
            s = full_pass(st, x, idx, w, seed, rows_per_expert=n)
            for k, fill in (("tokens", 0), ("probs", 0), ("src_rank", -1), ("src_token", -1)):
                assert_bitwise(s[k][:R], a[k], f"static {k} {tag}")
                assert_bitwise(s[k][R:], torch.full_like(s[k][R:], fill), f"static {k} past R {tag}")
            for k in ("y", "grad_x", "grad_topk_weights"):
                assert_bitwise(s[k], a[k], f"static {k} {tag}")
            check_and_destroy(st)
        for b in (plain, aligned):
            check_and_destroy(b)
    return gaps_total

"""Peer memory: one symmetric workspace per rank, every peer's base pointer known.

Built on PyTorch symmetric memory (``torch.distributed._symmetric_memory``: allocate,
rendezvous over the process group, read ``buffer_ptrs``), which handles the handle exchange
and works on NVLink fabrics beyond one host. NVLink multicast is never used: the
multicast-disabling variables are set before anything is allocated. A loopback group
(``megatron_mok.loopback``, test ranks as threads on one device) exchanges plain allocations.

Ranks that are processes sharing one GPU (torch symmetric memory refuses them: "allocations
from overlapping devices") map each other's workspaces with CUDA IPC instead, through torch's
own CUDA tensor sharing (``torch.multiprocessing.reductions``). The driver time-slices their
contexts, so each spin-wait on a peer lasts until the peer's context is scheduled: a mode for
running multi-rank code where fewer GPUs than ranks are at hand (tests, examples), not for
speed.
"""

from __future__ import annotations

import os
import socket
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..comm import exchange_status, status_device
from ..loopback import is_loopback
from .nvlink_domain import assumed as nvlink_assumed, domain_problem, fabric_of

NO_MULTICAST_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


def disable_multicast_env() -> None:
    """Set the variables that keep NCCL, torch symmetric memory and NVSHMEM off NVLink
    multicast (NVLS), unless the user set them already."""
    for k, v in NO_MULTICAST_ENV.items():
        os.environ.setdefault(k, v)


def device_key(device: torch.device) -> Tuple[str, str]:
    """``(host name, GPU UUID)``: equal for two processes exactly when they use the same GPU."""
    return socket.gethostname(), str(torch.cuda.get_device_properties(device).uuid)


def shared_device_ranks(keys: Sequence[Tuple[str, str]]) -> List[List[int]]:
    """Groups of ranks (by index into ``keys``, one :func:`device_key` per rank) that share a
    GPU, those of two or more ranks only; ``[]`` when every rank has a GPU of its own."""
    by_key: Dict[Tuple[str, str], List[int]] = {}
    for r, k in enumerate(keys):
        by_key.setdefault(tuple(k), []).append(r)
    return [ranks for ranks in by_key.values() if len(ranks) > 1]


def ipc_plan(keys: Sequence[Tuple[str, str]]) -> Optional[str]:
    """Why this group needs CUDA IPC instead of symmetric memory (``None``: it does not).

    Raises ValueError when some ranks share a GPU and the group spans several hosts (CUDA IPC
    maps memory within one host only)."""
    shared = shared_device_ranks(keys)
    if not shared:
        return None
    hosts = {k[0] for k in keys}
    if len(hosts) > 1:
        raise ValueError(f"megatron_mok: ranks {shared} share a GPU, which needs CUDA IPC, but the "
                         f"group spans hosts {sorted(hosts)}; CUDA IPC maps memory within one host")
    return f"ranks {shared} share a GPU"


def unreachable_peers(keys: Sequence[Tuple[str, str]], rank: int, local_index, can_access) -> List[int]:
    """Ranks whose GPU this rank's GPU cannot read directly: on this host, a different GPU,
    visible in this process (``local_index(uuid)`` gives its index, ``None`` when it is not
    visible: nothing to ask then), and ``can_access(mine, theirs)`` False (no NVLink or PCIe
    peer path: ``torch.cuda.can_device_access_peer``). The CUDA backend's kernels load from
    and store to peers' workspaces, so every pair of its GPUs needs one."""
    host, uuid = keys[rank]
    mine = local_index(uuid)
    if mine is None:
        return []
    out = []
    for r, (h, u) in enumerate(keys):
        if r == rank or h != host or u == uuid:
            continue
        theirs = local_index(u)
        if theirs is not None and not can_access(mine, theirs):
            out.append(r)
    return out


def peer_access_error(blocked: Sequence[Sequence[int]], keys: Sequence[Tuple[str, str]]) -> Optional[str]:
    """The error every rank raises when some rank cannot read a peer's GPU (``blocked[r]``:
    :func:`unreachable_peers` of rank ``r``, gathered from every rank so that all raise
    together instead of some waiting for the others in the rendezvous); ``None`` when none."""
    pairs = [(r, p) for r, ps in enumerate(blocked) for p in (ps or [])]
    if not pairs:
        return None
    shown = ", ".join(f"rank {r} -> rank {p}" for r, p in pairs[:8]) + (" ..." if len(pairs) > 8 else "")
    hosts = sorted({keys[r][0] for r, _ in pairs})
    return (f"megatron_mok: the CUDA backend needs direct peer access between every pair of its "
            f"GPUs on a host (its kernels read and write peers' memory: NVLink, or PCIe "
            f"peer-to-peer), and {len(pairs)} pair(s) have none: {shown} (host(s) "
            f"{', '.join(hosts)}; see `nvidia-smi topo -m`). Use backend='reference', or "
            "Megatron's alltoall dispatcher, on these GPUs.")


def _visible_index(uuid: str) -> Optional[int]:
    """This process's index of the GPU with ``uuid``; ``None`` when it is not visible."""
    for i in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(i).uuid) == uuid:
            return i
    return None


def _local_index_of(uuid: str, fallback: int) -> int:
    """This process's index of the GPU with ``uuid`` (``fallback`` when it is not visible)."""
    i = _visible_index(uuid)
    return fallback if i is None else i


def allocation_error(failed: Dict[int, str], nbytes: int) -> str:
    """The error every rank raises when the ranks in ``failed`` (``{rank: its error}``) could not
    allocate their ``nbytes`` workspace."""
    which = ", ".join(f"rank {r} ({why})" for r, why in sorted(failed.items()))
    return (f"megatron_mok: the CUDA backend's workspace ({nbytes / 2**20:.1f} MiB per rank) could "
            f"not be allocated on {len(failed)} rank(s) of this group: {which}; no rank made its "
            "Buffer. Free GPU memory on those ranks, or make the workspace smaller on every rank "
            "(ring_bytes / MOK_RING_BYTES, max_tokens_per_rank).")


def allocate_on_every_rank(alloc, nbytes: int, group, world_size: int, timeout_s: Optional[float]):
    """``alloc()`` (this rank's ``nbytes`` workspace) on every rank of ``group``, then one bounded
    exchange of the outcomes. If it failed on any rank (out of memory, typically: a rank's free
    memory depends on its own activations, e.g. after imbalanced routing), every rank raises the
    same ``RuntimeError`` naming those ranks and their errors, where the others would wait for it
    in the rendezvous (NOTES item 66). Returns this rank's tensor.

    The exchange is a small status record on the group's device (a GPU for NCCL): after a
    failed large allocation a small one still finds room."""
    tensor, failure, cause = None, None, None
    try:
        tensor = alloc()
    except Exception as e:  # noqa: BLE001  (whatever the allocator raised: the peers must hear it)
        failure, cause = f"{type(e).__name__}: {e}", e
    _, failed = exchange_status((), group, world_size, status_device(group), timeout_s,
                                "the workspace allocation", stop=failure)
    if failed:
        tensor = None                # the ranks that allocated free theirs: no Buffer is made
        raise RuntimeError(allocation_error(failed, nbytes)) from cause
    return tensor


class PeerMemory:
    """``nbytes`` of device memory on every rank of ``group``, zeroed, with peer pointers.

    Attributes:
        tensor: ``[nbytes]`` uint8, this rank's workspace.
        peer_ptrs: base address of every rank's workspace (index = group rank), valid in
            this process.
    """

    def __init__(self, nbytes: int, group, rank: int, world_size: int, device: torch.device,
                 timeout_s: Optional[float] = None):
        """``timeout_s``: how long a rank waits for its peers' allocation outcomes
        (:func:`allocate_on_every_rank`; ``None``: the group's own timeout)."""
        disable_multicast_env()
        self._handle = None
        self.ipc_reason: Optional[str] = None
        self._peer_tensors: List[torch.Tensor] = []
        self.loopback = is_loopback(group)
        if self.loopback:
            # Ranks are threads on one device: every rank holds every rank's tensor, so a
            # workspace is freed only once no rank can read it any more.
            self.tensor = torch.zeros(nbytes, dtype=torch.uint8, device=device)
            torch.cuda.current_stream(device).synchronize()
            self._peer_tensors = group.exchange(self.tensor)
            self.peer_ptrs = [t.data_ptr() for t in self._peer_tensors]
            return
        if world_size == 1:
            self.tensor = torch.zeros(nbytes, dtype=torch.uint8, device=device)
            self.peer_ptrs: List[int] = [self.tensor.data_ptr()]
            return
        group = group if group is not None else dist.group.WORLD
        keys: List = [None] * world_size
        dist.all_gather_object(keys, device_key(device), group=group)
        if len({k[0] for k in keys}) > 1:
            # Several hosts: one NVLink domain only on a multi-node NVLink system (NVML's GPU
            # fabric). Every rank makes this second gather (all saw the same hosts) and so all
            # raise together, before torch's symmetric memory tries to map across hosts.
            probe: List = [None] * world_size
            dist.all_gather_object(probe, (fabric_of(keys[rank][1]), nvlink_assumed()), group=group)
            problem = domain_problem(keys, [p[0] for p in probe], [p[1] for p in probe])
            if problem is not None:
                raise RuntimeError(problem)
        try:
            mine = unreachable_peers(keys, rank, _visible_index, torch.cuda.can_device_access_peer)
        except Exception as e:  # noqa: BLE001  (a preflight: never leave the peers in the gather)
            import warnings
            warnings.warn(f"megatron_mok: could not check peer access ({type(e).__name__}: {e}); "
                          "going on without the check")
            mine = []
        blocked: List = [None] * world_size
        dist.all_gather_object(blocked, mine, group=group)
        problem = peer_access_error(blocked, keys)
        if problem is not None:
            raise RuntimeError(problem)
        self.ipc_reason = ipc_plan(keys)
        if self.ipc_reason is not None:
            self._map_with_ipc(nbytes, group, rank, world_size, device, keys, timeout_s)
            return
        import torch.distributed._symmetric_memory as symm_mem

        self.tensor = allocate_on_every_rank(lambda: symm_mem.empty(nbytes, dtype=torch.uint8, device=device),
                                             nbytes, group, world_size, timeout_s)
        self._handle = symm_mem.rendezvous(self.tensor, group.group_name)
        # Only buffer_ptrs is used: never the handle's multicast_ptr (no NVLink multicast).
        self.peer_ptrs = [int(p) for p in self._handle.buffer_ptrs]
        if len(self.peer_ptrs) != world_size:
            raise RuntimeError(f"symmetric memory returned {len(self.peer_ptrs)} peer pointers "
                               f"for a group of {world_size}")
        # Flags must read zero on every rank before any rank's kernels look at them.
        self.tensor.zero_()
        torch.cuda.synchronize(device)
        dist.barrier(group=group)
        torch.cuda.synchronize(device)

    def _map_with_ipc(self, nbytes, group, rank, world_size, device, keys, timeout_s) -> None:
        """Each rank allocates its workspace, shares it as torch shares CUDA tensors between
        processes (an IPC handle plus a reference count the owner's allocator honours), and opens
        every peer's: ``peer_ptrs`` are then valid in this process as with symmetric memory.

        One share per peer: each share counts one consumer, and the owner's allocator takes
        the block back only once the count returns to zero (run s19-6: one share opened by
        three peers never did, and a pool of four ranks ran out of memory after ~15 tests)."""
        from torch.multiprocessing.reductions import reduce_tensor

        torch.cuda.ipc_collect()   # blocks of destroyed workspaces whose peers let go
        self.tensor = allocate_on_every_rank(lambda: torch.zeros(nbytes, dtype=torch.uint8, device=device),
                                             nbytes, group, world_size, timeout_s)
        torch.cuda.synchronize(device)
        rebuild = None
        shares: List = [None] * world_size
        for r in range(world_size):
            if r != rank:
                rebuild, shares[r] = reduce_tensor(self.tensor)
        every: List = [None] * world_size
        dist.all_gather_object(every, shares, group=group)
        self.peer_ptrs = []
        for r, their_shares in enumerate(every):
            if r == rank:
                self.peer_ptrs.append(self.tensor.data_ptr())
                continue
            peer_args = list(their_shares[rank])
            # Field 6 is the owner's device index; the GPU may have another index here.
            peer_args[6] = _local_index_of(keys[r][1], peer_args[6])
            t = rebuild(*peer_args)
            self._peer_tensors.append(t)
            self.peer_ptrs.append(t.data_ptr())
        torch.cuda.synchronize(device)
        dist.barrier(group=group)

    def free(self) -> None:
        self._handle = None
        self._peer_tensors = []
        self.tensor = None
        self.peer_ptrs = []
        if self.ipc_reason is not None:
            torch.cuda.ipc_collect()

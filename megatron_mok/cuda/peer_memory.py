"""Peer memory: one symmetric workspace per rank, every peer's base pointer known.

Built on PyTorch symmetric memory (``torch.distributed._symmetric_memory``: allocate,
rendezvous over the process group, read ``buffer_ptrs``), which handles the handle exchange
and works on NVLink fabrics beyond one host. NVLink multicast is never used: the
multicast-disabling variables are set before anything is allocated. A loopback group
(``megatron_mok.loopback``, test ranks as threads on one device) exchanges plain allocations.
"""

from __future__ import annotations

import os
from typing import List

import torch
import torch.distributed as dist

from ..loopback import is_loopback

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


class PeerMemory:
    """``nbytes`` of device memory on every rank of ``group``, zeroed, with peer pointers.

    Attributes:
        tensor: ``[nbytes]`` uint8, this rank's workspace.
        peer_ptrs: base address of every rank's workspace (index = group rank), valid in
            this process.
    """

    def __init__(self, nbytes: int, group, rank: int, world_size: int, device: torch.device):
        disable_multicast_env()
        self._handle = None
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
        import torch.distributed._symmetric_memory as symm_mem

        group = group if group is not None else dist.group.WORLD
        self.tensor = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
        self._handle = symm_mem.rendezvous(self.tensor, group.group_name)
        if getattr(self._handle, "multicast_ptr", 0):
            # Not used by any kernel; said here so that nobody starts relying on it.
            pass
        self.peer_ptrs = [int(p) for p in self._handle.buffer_ptrs]
        if len(self.peer_ptrs) != world_size:
            raise RuntimeError(f"symmetric memory returned {len(self.peer_ptrs)} peer pointers "
                               f"for a group of {world_size}")
        # Flags must read zero on every rank before any rank's kernels look at them.
        self.tensor.zero_()
        torch.cuda.synchronize(device)
        dist.barrier(group=group)
        torch.cuda.synchronize(device)

    def free(self) -> None:
        self._handle = None
        self._peer_tensors = []
        self.tensor = None
        self.peer_ptrs = []

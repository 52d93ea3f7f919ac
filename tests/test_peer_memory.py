"""Which way a process group's ranks map each other's workspaces (CPU, no GPU needed):
torch symmetric memory when every rank has a GPU of its own, CUDA IPC when processes share
one (symmetric memory refuses them), an error when they would have to share across hosts.
The GPU side (the IPC mapping itself, in shared-GPU mode) is test_cuda_backend.py's
``test_cuda_peer_mapping``; every multi-GPU test goes through it there."""

import pytest

from megatron_mok.cuda.peer_memory import ipc_plan, shared_device_ranks

A, B = "GPU-aaaa", "GPU-bbbb"


def test_a_gpu_per_rank_uses_symmetric_memory():
    assert shared_device_ranks([("h", A), ("h", B)]) == []
    assert ipc_plan([("h", A), ("h", B)]) is None
    assert ipc_plan([("h", A)]) is None
    # One GPU UUID on two hosts' names is two GPUs (UUIDs are per GPU; hosts differ).
    assert ipc_plan([("h1", A), ("h2", A)]) is None


def test_ranks_sharing_a_gpu_use_ipc():
    keys = [("h", A), ("h", B), ("h", A), ("h", B)]
    assert shared_device_ranks(keys) == [[0, 2], [1, 3]]
    reason = ipc_plan(keys)
    assert reason is not None and "[[0, 2], [1, 3]]" in reason
    assert shared_device_ranks([("h", A)] * 3) == [[0, 1, 2]]
    assert shared_device_ranks([("h", A), ("h", B), ("h", B)]) == [[1, 2]]


def test_sharing_a_gpu_across_hosts_is_an_error():
    with pytest.raises(ValueError, match="CUDA IPC maps memory within one host"):
        ipc_plan([("h1", A), ("h1", A), ("h2", B)])

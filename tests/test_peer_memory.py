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


def _index(mapping):
    return lambda uuid: mapping.get(uuid)


C = "GPU-cccc"


def test_peers_without_a_direct_path_are_found_on_this_host_only():
    keys = [("h", A), ("h", B), ("h", C), ("other", "GPU-dddd")]
    visible = _index({A: 0, B: 1, C: 2})
    no_path = {(0, 2), (2, 0)}
    can = lambda a, b: (a, b) not in no_path  # noqa: E731
    from megatron_mok.cuda.peer_memory import unreachable_peers
    assert unreachable_peers(keys, 0, visible, can) == [2]
    assert unreachable_peers(keys, 1, visible, can) == []
    assert unreachable_peers(keys, 2, visible, can) == [0]
    # Another host's rank is never asked about (no peer path query across hosts).
    assert unreachable_peers(keys, 3, visible, can) == []
    # A peer GPU this process cannot see, or this rank's own GPU not visible: nothing to ask.
    assert unreachable_peers(keys, 0, _index({A: 0, B: 1}), can) == []
    assert unreachable_peers(keys, 0, _index({B: 1, C: 2}), can) == []
    # Ranks sharing a GPU (CUDA IPC) are not a missing path.
    assert unreachable_peers([("h", A), ("h", A)], 0, visible, lambda a, b: False) == []


def test_every_rank_raises_the_same_error_naming_the_pairs():
    from megatron_mok.cuda.peer_memory import peer_access_error
    keys = [("h", A), ("h", B), ("h", C)]
    assert peer_access_error([[], [], []], keys) is None
    assert peer_access_error([None, [], []], keys) is None
    msg = peer_access_error([[2], [], [0]], keys)
    assert "2 pair(s) have none: rank 0 -> rank 2, rank 2 -> rank 0 (host(s) h;" in msg
    two_hosts = peer_access_error([[1], [], [], []], [("h1", A), ("h1", B), ("h2", A), ("h2", B)])
    assert "(host(s) h1;" in two_hosts
    assert "(host(s) h1, h2;" in peer_access_error([[1], [], [3], []],
                                                   [("h1", A), ("h1", B), ("h2", A), ("h2", B)])
    assert "backend='reference'" in msg and "alltoall" in msg
    many = peer_access_error([[1, 2]] * 3 + [[0]] * 3, keys * 2)
    assert many.count("->") == 8 and many.endswith("GPUs.") and " ..." in many

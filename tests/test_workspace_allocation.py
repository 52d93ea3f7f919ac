"""A rank that cannot allocate its CUDA-backend workspace stops its peers in the same words.

A rank's free GPU memory depends on its own activations (after imbalanced routing, one EP rank
holds more), so the workspace allocation can fail on one rank only. Its peers would then wait
for it in the symmetric-memory rendezvous (or the CUDA IPC exchange) until a store or NCCL
timeout, with an error naming neither the rank nor the cause. Instead every rank allocates,
then all exchange the outcomes in one bounded status exchange, and every rank raises the same
``RuntimeError`` naming the ranks that failed and their errors (NOTES item 66).

CPU: ``allocate_on_every_rank`` on gloo ranks with stand-in allocators. GPU: processes sharing
one GPU (rank 1's allocator capped below the workspace) or two GPUs (rank 1's GPU filled).
"""

import os

import pytest
import torch

from harness import gpus_for, rank_device, run_distributed
from megatron_mok.cuda.errors import MokTimeout
from megatron_mok.cuda.peer_memory import allocate_on_every_rank, allocation_error

OOM = "CUDA out of memory. Tried to allocate 1.00 GiB. GPU 1 has a total capacity of 139.81 GiB"


def _allocate(rank, world_size, failing, skip=()):
    """``allocate_on_every_rank`` where the ranks in ``failing`` raise torch's OOM error: the
    error's words and whether its cause is this rank's own (``None``: the tensor's size)."""
    def alloc():
        if rank in failing:
            raise torch.OutOfMemoryError(OOM)
        return torch.zeros(64, dtype=torch.uint8)

    if rank in skip:            # never takes part: its peers must not wait past their timeout
        return "skipped"
    try:
        t = allocate_on_every_rank(alloc, 1 << 30, None, world_size, 3.0)
    except MokTimeout as e:
        return f"MokTimeout: {e.what}"
    except RuntimeError as e:
        own = isinstance(e.__cause__, torch.OutOfMemoryError)
        return type(e).__name__, str(e), own
    return t.numel()


def test_the_words_name_each_failed_rank_and_the_size():
    msg = allocation_error({2: "OutOfMemoryError: no room", 0: "RuntimeError: driver"}, 3 << 29)
    assert ("workspace (1536.0 MiB per rank) could not be allocated on 2 rank(s) of this group: "
            "rank 0 (RuntimeError: driver), rank 2 (OutOfMemoryError: no room); no rank made its Buffer") in msg
    assert "ring_bytes / MOK_RING_BYTES" in msg


@pytest.mark.parametrize("world_size, failing", [(2, ()), (2, (1,)), (3, (0, 2)), (3, (0, 1, 2))])
def test_every_rank_raises_when_one_cannot_allocate(world_size, failing):
    out = run_distributed(_allocate, world_size, failing, timeout=60)
    if not failing:
        assert out == [64] * world_size             # each rank has its own workspace
        return
    assert len({o[:2] for o in out}) == 1, out      # the same type and words on every rank
    kind, msg, _ = out[0]
    assert kind == "RuntimeError"
    named = ", ".join(f"rank {r} (OutOfMemoryError: {OOM})" for r in failing)
    assert f"on {len(failing)} rank(s) of this group: {named}; no rank made its Buffer" in msg, msg
    # the failing ranks keep their own error as the cause; the others have none
    assert [o[2] for o in out] == [r in failing for r in range(world_size)]


def test_a_peer_that_never_allocates_ends_in_a_timeout():
    # fresh processes: rank 0's timed-out gather stays queued in its group (CONTRACT, "Errors"),
    # and a pooled group would pair it with a later test's collective (gloo aborts: run s40-2)
    out = run_distributed(_allocate, 2, (), (1,), timeout=60, fresh=True)
    assert out == ["MokTimeout: the workspace allocation", "skipped"], out


# ------------------------------------------------------------------------------------- GPU
def _buffer_with_rank1_short_of_memory(rank, world_size):
    """Rank 1 cannot hold a 1 GiB workspace (processes sharing one GPU: its allocator capped;
    GPUs of their own: its GPU filled); every rank's Buffer refuses in the same words. Then the
    memory comes back and both ranks make a Buffer and dispatch: nothing was left behind."""
    import megatron_mok as mok

    dev = rank_device(rank)
    torch.cuda.set_device(dev)
    shared = os.environ.get("MOK_TEST_SHARED_GPU") == "1"
    hog = None
    if rank == 1:
        if shared:       # the IPC path allocates through torch's caching allocator
            torch.cuda.set_per_process_memory_fraction(256 * 2**20 / torch.cuda.get_device_properties(dev).total_memory, dev)
        else:            # symmetric memory has its own allocator: leave it no room
            free, _ = torch.cuda.mem_get_info(dev)
            hog = torch.empty(free - 512 * 2**20, dtype=torch.uint8, device=dev)
    kw = dict(num_experts=4 * world_size, hidden=64, topk=2, max_tokens_per_rank=16, timeout_s=30)
    try:
        mok.Buffer(None, backend="cuda", device=dev, ring_bytes=1 << 30, **kw)
        words = None
    except RuntimeError as e:
        words = str(e)
    del hog
    if rank == 1 and shared:
        torch.cuda.set_per_process_memory_fraction(1.0, dev)
    torch.cuda.empty_cache()
    buf = mok.Buffer(None, backend="cuda", device=dev, ring_bytes=1 << 22, **kw)
    x = torch.randn(5, 64, device=dev, dtype=torch.bfloat16)
    idx = torch.tensor([[0, 1]] * 5, device=dev)
    res = buf.dispatch(x, idx, torch.ones(5, 2, device=dev))
    got = int(res.tokens_per_expert.sum())
    buf.destroy()
    return words, got


@pytest.mark.gpu
@pytest.mark.multigpu
def test_a_rank_short_of_memory_stops_every_rank():
    if not gpus_for(2):
        pytest.skip("needs 2 GPUs (or MOK_TEST_SHARED_GPU=1)")
    out = run_distributed(_buffer_with_rank1_short_of_memory, 2, backend="nccl", timeout=180)
    (w0, got0), (w1, got1) = out
    assert w0 == w1 and w0 is not None, out
    assert "could not be allocated on 1 rank(s) of this group: rank 1 (" in w0, w0
    assert "no rank made its Buffer" in w0
    # afterwards: experts 0 and 1 live on rank 0 (4 per rank), and both ranks send them 5 tokens
    assert (got0, got1) == (20, 0), out


# ------------------------------------------------------------------- what the docs state
def _workspace_bytes(T_max, K, ring=256 << 20, W=8, H=7168, E=256, C=64):
    """The CUDA library's workspace size for a bf16 Buffer, as the backend asks for it."""
    from megatron_mok.cuda import library
    from megatron_mok.cuda.backend import META_SLOTS, ring_chunk_bytes

    lib = library.get()
    disp, comb = ring_chunk_bytes(C, H, K, 2, 2)
    ctx = lib.mok_create(W, 0, H, 2, 2, K, E // W, T_max, C, META_SLOTS, ring // disp, ring // comb, 1)
    assert ctx, lib.mok_last_error()
    try:
        return lib.mok_workspace_bytes(ctx)
    finally:
        lib.mok_destroy(ctx)


@pytest.mark.parametrize("T_max, K, ring", [(4096, 8, 256 << 20), (16384, 4, 256 << 20),
                                            (65536, 8, 256 << 20), (4096, 8, 64 << 20)])
def test_the_workspace_size_the_docs_state(T_max, K, ring):
    """README / docs/MEGATRON.md: the workspace is about 2 x ring_bytes + 128 x topk x T_max
    bytes (515 MiB per rank at the standard shape), within 2 MiB (each ring is a whole number
    of chunks: up to one chunk, 0.9 MiB at hidden 7168, below ring_bytes)."""
    from megatron_mok.cuda import library

    if not library.is_available():
        pytest.skip("the CUDA library is not built")
    got = _workspace_bytes(T_max, K, ring)
    assert abs(got - (2 * ring + 128 * K * T_max)) < 2 * 2**20, got
    if (T_max, K, ring) == (4096, 8, 256 << 20):
        assert round(got / 2**20) == 515

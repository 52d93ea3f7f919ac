"""The dispatch ring protocol model (scripts/ring_protocol_model.py) on CPU: the kernel's
consumer order never stalls, even on a ring much smaller than a call; and the model does
find a stall where one exists (a consumer that takes the latest chunks first)."""
import os
import random
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))
import ring_protocol_model as model  # noqa: E402


def _calls(n, world, max_tokens, seed):
    rng = random.Random(seed)
    for _ in range(n):
        T = [rng.randrange(max_tokens + 1) for _ in range(world)]
        yield T, model.random_routing(T, world, 4, 4, rng, rng.choice(["random", "skewed"]))


def test_kernel_order_never_stalls_on_a_small_ring():
    # The shape of the session-5 W=8 loopback stall: up to 5 chunks per source, 3 slots.
    for warps in (64, 4, 1):
        for T, routing in _calls(25, 8, 300, seed=warps):
            assert model.finishes(T, routing, 64, 3, warps), (warps, T)


def test_model_finds_a_stall_when_there_is_one():
    # One warp taking the latest chunks first waits for a chunk whose slot is still held by
    # an earlier chunk that only it would read: every such call must stall.
    T = [300, 300]
    routing = [[{1 - s} for _ in range(300)] for s in range(2)]    # every token to the peer
    assert model.finishes(T, routing, 64, 3, 1)
    assert not model.finishes(T, routing, 64, 3, 1, order=model.descending_chunks)
    assert model.finishes(T, routing, 64, 5, 1, order=model.descending_chunks)  # ring fits the call

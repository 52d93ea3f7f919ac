"""The test machinery itself: the spawn harness reports failures and hangs, the seeded
inputs are what the case names promise, and the bitwise assert sees every bit."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from harness import (CASES, DistributedTestError, assert_bitwise, make_inputs,
                     run_distributed)


def _rank_info(rank, world_size, tag):
    return (rank, world_size, dist.get_rank(), dist.get_world_size(), tag)


def _all_reduce_sum(rank, world_size):
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    return float(t)


def _raise_on_rank1(rank, world_size):
    if rank == 1:
        raise ValueError("boom from rank one")
    return rank


def _raise_then_peer_hangs(rank, world_size):
    # rank 1 fails before a collective that rank 0 is already waiting in
    if rank == 1:
        raise KeyError("gone before the barrier")
    dist.barrier()


def _sleep_on_last_rank(rank, world_size, seconds):
    if rank == world_size - 1:
        time.sleep(seconds)
    return rank


def _die_on_last_rank(rank, world_size):
    if rank == world_size - 1:
        os._exit(7)
    return rank


def test_returns_every_rank_result():
    assert run_distributed(_rank_info, 2, "a") == [(0, 2, 0, 2, "a"), (1, 2, 1, 2, "a")]
    assert run_distributed(_all_reduce_sum, 2) == [3.0, 3.0]


def test_world_size_1_and_4():
    assert run_distributed(_all_reduce_sum, 1) == [1.0]
    assert run_distributed(_all_reduce_sum, 4) == [10.0] * 4


def test_exception_on_one_rank_fails_with_its_traceback():
    with pytest.raises(DistributedTestError, match=r"(?s)rank 1 -----.*ValueError: boom from rank one"):
        run_distributed(_raise_on_rank1, 2)
    # every rank answered, so the ranks are still in step and take the next call
    assert run_distributed(_all_reduce_sum, 2) == [3.0, 3.0]


def test_failure_while_peer_waits_in_collective_does_not_hang():
    t0 = time.monotonic()
    with pytest.raises(DistributedTestError, match=r"(?s)KeyError: 'gone before the barrier'"):
        run_distributed(_raise_then_peer_hangs, 2, timeout=100)
    # well under both the call timeout (100 s) and gloo's own (180 s): the harness stopped it
    assert time.monotonic() - t0 < 60
    assert run_distributed(_all_reduce_sum, 2) == [3.0, 3.0]


# One-rank pools for the tests that kill their pool: a restart costs one process, not two.
def test_hang_becomes_a_timeout_failure():
    t0 = time.monotonic()
    with pytest.raises(DistributedTestError, match=r"TIMEOUT.*within 2 s.*ranks \[0\]"):
        run_distributed(_sleep_on_last_rank, 1, 600, timeout=2)
    assert time.monotonic() - t0 < 60          # (includes starting the rank)


def test_dead_rank_is_reported():
    with pytest.raises(DistributedTestError, match=r"rank 0 died \(exit code 7\)"):
        run_distributed(_die_on_last_rank, 1, timeout=60)
    assert run_distributed(_all_reduce_sum, 1) == [1.0]


def test_fresh_processes():
    assert run_distributed(_all_reduce_sum, 1, fresh=True) == [1.0]


def test_unpicklable_function_is_a_clear_error():
    with pytest.raises(TypeError, match="cannot pickle"):
        run_distributed(lambda rank, ws: rank, 1)


def _exit_hangs(rank, world_size):
    # a non-daemon thread that outlives the rank's loop: the process cannot exit when told to
    import threading

    threading.Thread(target=time.sleep, args=(120,), daemon=False).start()
    return os.getpid()


def test_shutdown_gives_all_pools_one_grace_then_kills():
    # Two pools whose ranks cannot exit: shutdown_pools asks every pool to stop, then gives them
    # all ONE grace period before it kills them (one pool after another, each with its own grace,
    # took up to 20 s a stuck rank). Every rank process is gone afterwards.
    import harness

    harness.shutdown_pools(grace_s=0)            # start from no pools
    pids = run_distributed(_exit_hangs, 2) + run_distributed(_exit_hangs, 3)
    procs = [p for pool in harness._POOLS.values() for p in pool.procs]
    assert sorted(p.pid for p in procs) == sorted(pids) and len(procs) == 5
    t0 = time.monotonic()
    harness.shutdown_pools(grace_s=2.0)
    elapsed = time.monotonic() - t0
    assert not harness._POOLS
    assert not any(p.is_alive() for p in procs)
    assert elapsed < 2.0 + 1.5, f"shutdown took {elapsed:.1f} s for 5 stuck ranks with a 2 s grace"
    assert run_distributed(_rank_info, 2, "after") == [(r, 2, r, 2, "after") for r in range(2)]


# --------------------------------------------------------------------------- seeded inputs
@pytest.mark.parametrize("case", CASES)
def test_make_inputs_is_seeded_and_matches_its_case(case):
    T, E, H, K = [6, 0, 9], 6, 8, 3
    a = make_inputs(5, 3, T, E, H, K, torch.bfloat16, case=case)
    b = make_inputs(5, 3, T, E, H, K, torch.bfloat16, case=case)
    c = make_inputs(6, 3, T, E, H, K, torch.bfloat16, case=case)
    for (xa, ia, wa), (xb, ib, wb), t in zip(a, b, T):
        assert xa.shape == (t, H) and xa.dtype == torch.bfloat16 and xa.is_contiguous()
        assert ia.shape == (t, K) and ia.dtype == torch.int64
        assert wa.shape == (t, K) and wa.dtype == torch.float32
        assert torch.equal(xa, xb) and torch.equal(ia, ib) and torch.equal(wa, wb)
        if t:
            assert int(ia.min()) >= -1 and int(ia.max()) < E
    assert any(not torch.equal(p[0], q[0]) for p, q in zip(a, c) if p[0].numel())
    idx = torch.cat([i for _, i, _ in a])
    if case in ("random", "skewed"):
        assert all(len(set(r)) == K for r in idx.tolist()) and bool((idx >= 0).all())
    if case == "skewed":
        assert int(idx.max()) <= K
    if case in ("unrouted", "mixed"):
        assert bool((idx == -1).any()) and bool((idx == -1).all(dim=1).any())
    if case == "one_expert":
        assert bool((idx[:, 0] == E - 1).all()) and bool((idx[:, 1:] == -1).all())
    if case == "duplicate":
        assert any(len(set(r)) < K for r in idx.tolist())


def test_make_inputs_int_values_are_exact():
    (x, _, _), = make_inputs(1, 1, [50], 4, 16, 2, torch.bfloat16, values="int")
    assert bool(((x.float() * 8).round() == x.float() * 8).all())
    assert float(x.float().abs().max()) <= 2


def test_assert_bitwise_sees_signed_zero_and_dtype():
    assert_bitwise(torch.tensor([0.0, 1.5]), torch.tensor([0.0, 1.5]))
    with pytest.raises(AssertionError, match="differ bitwise"):
        assert_bitwise(torch.tensor([-0.0]), torch.tensor([0.0]))
    with pytest.raises(AssertionError, match="dtype"):
        assert_bitwise(torch.tensor([1.0]), torch.tensor([1.0], dtype=torch.float64))
    with pytest.raises(AssertionError, match="shape"):
        assert_bitwise(torch.zeros(2), torch.zeros(3))
    with pytest.raises(AssertionError, match="differ bitwise"):
        assert_bitwise(torch.tensor([1, 2]), torch.tensor([1, 3]))


def _reduce_scatter_where_gloo_lacks_it(rank, world_size):
    """As on torch 2.6's gloo: the real reduce_scatter refuses; the harness's stand-in sums."""
    import harness
    saved = dist.reduce_scatter

    def unsupported(*args, **kwargs):
        raise RuntimeError("ProcessGroupGloo does not support reduce_scatter")
    try:
        dist.reduce_scatter = unsupported
        harness._reduce_scatter_on_old_gloo()
        out = torch.empty(3)
        dist.reduce_scatter(out, [torch.full((3,), 10.0 * rank + r) for r in range(world_size)])
        with pytest.raises(RuntimeError, match="does not support"):
            dist.reduce_scatter(out, [torch.zeros(3)] * world_size, async_op=True)
        return out.tolist()
    finally:
        dist.reduce_scatter = saved


@pytest.mark.parametrize("world_size", [2, 3])
def test_reduce_scatter_stand_in_for_old_gloo(world_size):
    # rank r keeps chunk r summed over the ranks q: sum(10 q + r) = 10 W (W - 1) / 2 + W r
    got = run_distributed(_reduce_scatter_where_gloo_lacks_it, world_size)
    assert got == [[10.0 * world_size * (world_size - 1) / 2 + world_size * r] * 3
                   for r in range(world_size)]

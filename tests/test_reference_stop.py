"""The reference backend tells its peers when a rank stops (docs/CONTRACT.md, "Errors").

Its collectives block, so nothing can end a peer's wait but the collective it waits in. Every
reference call's first collective is therefore a fixed-size status exchange, and a rank that
stops instead of making a call its peers make posts its stop (with the reason) there: the
peers raise ``MokPeerStopped`` naming it, at once, and the process group is left healthy (no
collective pending anywhere). Before, they waited in their ``all_gather`` until the process
group's timeout (30 min for gloo). An overflow found after the exchange (``max_recv_tokens``,
``rows_per_expert``) is decided from the exchanged routing, so every rank raises in that call.

Each worker below: rank 1 stops (the way ``where`` names), every other rank makes the same call
with valid inputs and must raise ``MokPeerStopped`` naming rank 1 and its reason within
``FAST_S`` (the Buffer's timeout is ``TIMEOUT_S``, the group's 180 s); then every rank's next
call is refused without any exchange, and an ``all_reduce`` on the same group still works (no
collective was left pending).

A peer that never makes the call (a rank stopped between calls that does not call again, NOTES
item 58) ends every reference collective after the Buffer's ``timeout_s`` in ``MokTimeout``.
"""

import time
import warnings

import pytest
import torch
import torch.distributed as dist

import megatron_mok as mok
from harness import (gpus_for, in_loopback, loopback_barrier, make_inputs, rank_device,
                     run_distributed, run_loopback)
from megatron_mok.cuda.errors import MokPeerStopped, MokTimeout

TIMEOUT_S = 30.0
FAST_S = 10.0
E_PER_RANK, H, K, T = 2, 16, 2, 12
WORLDS = (2, 3)


def _buffer(world_size, rank=0, **kw):
    return mok.Buffer(None, num_experts=E_PER_RANK * world_size, hidden=H, topk=K,
                      max_tokens_per_rank=T, dtype=torch.float32, backend="reference",
                      device=rank_device(rank), timeout_s=kw.pop("timeout_s", TIMEOUT_S), **kw)


def _zeros(rank, *shape, dtype=torch.float32):
    return torch.zeros(*shape, dtype=dtype, device=rank_device(rank))


def _inputs(rank, world_size, grad=False):
    x, idx, w = make_inputs(11, world_size, [T - 1] * world_size, E_PER_RANK * world_size, H, K,
                            torch.float32, device=rank_device(rank))[rank]
    if grad:
        x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    return x, idx, w


def _group_still_works(rank, world_size):
    """Every rank's rank, summed over the default group: a collective left pending by the stop
    would pair with this one and break it (or hang)."""
    if in_loopback():
        loopback_barrier()
        return True
    t = torch.tensor([rank + 1.0], device=rank_device(rank))   # NCCL: on the GPU
    dist.all_reduce(t)
    return int(t) == world_size * (world_size + 1) // 2


def _aligned_capacity(rank, world_size, x, idx, w):
    """Rank 1's unpadded row count with ``expert_alignment`` 4, when its zero rows make more:
    a ``max_recv_tokens`` that only the alignment's zero rows overflow."""
    plain = _buffer(world_size, rank, expert_alignment=4)
    res = plain.dispatch(x, idx, w)
    rows, padded = int((res.src_rank >= 0).sum()), int(res.tokens_per_expert.sum())
    assert rank != 1 or rows < padded, "pick inputs whose alignment adds zero rows on rank 1"
    return rows


def _rank_1_stops(rank, world_size, where):
    x, idx, w = _inputs(rank, world_size, grad=where == "backward")
    kw = {}
    if where == "static":       # only rank 1's capacity is too small
        kw["max_recv_tokens"] = 0 if rank == 1 else world_size * T * K
    if where == "static_aligned":
        cap = _aligned_capacity(rank, world_size, x, idx, w)
        kw.update(expert_alignment=4, max_recv_tokens=cap if rank == 1 else world_size * T * K * 4)
    buf = _buffer(world_size, rank, **kw)
    res = y = None
    if where in ("cached", "combine", "next_call", "backward", "prob_grads"):
        res = buf.dispatch(x, idx, w)              # one good call on every rank first
        if where == "backward":
            y = buf.combine(res.tokens * 2, res.handle)
    t0 = time.monotonic()
    if rank == 1:
        with warnings.catch_warnings():   # "could not tell its peers" would be a failure here
            warnings.filterwarnings("error", message=".*could not (tell|stop) its peers")
            reason = _stop_rank_1(buf, where, x, idx, w, res, y, rank)
        took, message = time.monotonic() - t0, reason
    else:
        with pytest.raises(MokPeerStopped) as info:
            if where in ("dispatch", "static", "static_aligned", "skipped"):
                buf.dispatch(x, idx, w)
            elif where == "rows_per_expert":
                buf.dispatch(x, idx, w, rows_per_expert=world_size * T * K)
            elif where == "cached":
                buf.dispatch(x, handle=res.handle)
            elif where in ("combine", "next_call"):
                buf.combine(res.tokens, res.handle)
            elif where == "backward":
                y.sum().backward()
            else:
                buf._get_backend("reference").combine_prob_grads(res.handle, torch.ones_like(res.probs))
        took, message = time.monotonic() - t0, str(info.value)
        assert info.value.rank == 1, message
    # The peers were told in the call itself, not at rank 1's next one: the group is usable
    # now (a post still pending on rank 1 would pair with this all_reduce and break it).
    healthy = _group_still_works(rank, world_size)
    # Refused from now on, on every rank, without an exchange; rank 1 twice (a second post of
    # its stop would find no peer: it would wait for its timeout, then warn).
    for _ in range(2 if rank == 1 else 1):
        t1 = time.monotonic()
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=".*could not (tell|stop) its peers")
            with pytest.raises(RuntimeError, match="stopped"):
                buf.dispatch(x, idx, w)
        assert time.monotonic() - t1 < FAST_S
    return took, message, healthy and _group_still_works(rank, world_size)


def _stop_rank_1(buf, where, x, idx, w, res, y, rank):
    """Rank 1's side of :func:`_rank_1_stops`: stop as ``where`` says; returns the reason its
    peers must see."""
    if where == "dispatch":
        with pytest.raises(ValueError, match="max_tokens_per_rank"):
            buf.dispatch(_zeros(rank, T + 1, H), _zeros(rank, T + 1, K, dtype=torch.int64),
                         _zeros(rank, T + 1, K))
        reason = "ValueError: x has T=13"
    elif where == "cached":
        with pytest.raises(ValueError):
            buf.dispatch(x[:-1], handle=res.handle)
        reason = "ValueError"
    elif where == "combine":
        with pytest.raises(ValueError):
            buf.combine(res.tokens.new_zeros(res.tokens.shape[0] + 1, H), res.handle)
        reason = "ValueError"
    elif where == "static":
        with pytest.raises(RuntimeError, match=r"rank 1 received \d+ rows, more than max_recv_tokens=0"):
            buf.dispatch(x, idx, w)
        reason = "rank 1 received"
    elif where == "static_aligned":
        with pytest.raises(RuntimeError, match=r"rank 1 received \d+ rows, more than max_recv_tokens"):
            buf.dispatch(x, idx, w)
        reason = "rank 1 received"
    elif where == "rows_per_expert":
        with pytest.raises(RuntimeError, match="rank 1: local expert .* more than rows_per_expert=1"):
            buf.dispatch(x, idx, w, rows_per_expert=1)
        reason = "rank 1: local expert"
    elif where == "skipped":
        buf.abort("MoK: over T_max on purpose", skipped_call=True)
        reason = "MoK: over T_max on purpose"
    elif where in ("next_call", "backward", "prob_grads"):
        # Between calls (an expert raised): nobody is told yet; this rank's next call,
        # which its peers make too, refuses and tells them.
        buf.abort("an expert raised on purpose")
        reason = "an expert raised on purpose"
        with pytest.raises(RuntimeError, match="stopped"):
            if where == "next_call":
                buf.dispatch(x, idx, w)
            elif where == "backward":
                y.sum().backward()
            else:
                buf._get_backend("reference").combine_prob_grads(res.handle, torch.ones_like(res.probs))
    else:
        raise AssertionError(where)
    return reason


def _check(out, where):
    for rank, (took, message, healthy) in enumerate(out):
        assert healthy, f"rank {rank}: the group broke after the stop"
        assert took < FAST_S, f"rank {rank} took {took:.1f} s (timeout {TIMEOUT_S} s): {message}"
        if rank != 1:
            assert "rank 1 stopped this Buffer after an error" in message, message
            assert out[1][1] in message, (message, out[1][1])   # the reason travelled


STOPS = ("dispatch", "cached", "combine", "static", "static_aligned", "rows_per_expert", "skipped",
         "next_call", "backward", "prob_grads")


@pytest.mark.parametrize("world_size", WORLDS)
@pytest.mark.parametrize("where", STOPS)
def test_reference_peers_of_a_stopped_rank_raise_at_once(where, world_size):
    _check(run_distributed(_rank_1_stops, world_size, where, timeout=60), where)


# GPU tensors: over NCCL on 2 GPUs (the status records on the GPU, the post an NCCL all_gather
# polled for completion); in shared-GPU mode, processes on one GPU joined by gloo.
# (The world size as the ids' last part, [...-2], as scripts/device_runs' world_ids selects.)
@pytest.mark.gpu
@pytest.mark.multigpu
@pytest.mark.skipif(not gpus_for(2), reason="needs 2 GPUs (or MOK_TEST_SHARED_GPU=1)")
@pytest.mark.parametrize("world_size", (2,))
@pytest.mark.parametrize("where", ("dispatch", "static", "skipped", "next_call", "backward"))
def test_reference_peers_of_a_stopped_rank_raise_at_once_on_gpus(where, world_size):
    _check(run_distributed(_rank_1_stops, world_size, where, backend="nccl", timeout=120), where)


@pytest.mark.gpu
@pytest.mark.multigpu
@pytest.mark.skipif(not gpus_for(2), reason="needs 2 GPUs (or MOK_TEST_SHARED_GPU=1)")
@pytest.mark.parametrize("world_size", (2,))
def test_reference_stop_reaches_a_later_peer_on_gpus(world_size):
    assert run_distributed(_late_peer, world_size, backend="nccl", timeout=120,
                           fresh=True) == ["told", "warned"]


def test_reference_peers_raise_on_loopback_ranks():
    _check(run_loopback(_rank_1_stops, 3, "dispatch", device="cpu", timeout=60), "dispatch")


def _every_rank_fails(rank, world_size):
    """Every rank passes too many tokens: each raises its own error at once (each posts its
    stop; the posts pair with each other) and the group stays healthy."""
    buf = _buffer(world_size, rank)
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="max_tokens_per_rank"):
        buf.dispatch(_zeros(rank, T + 1 + rank, H), _zeros(rank, T + 1 + rank, K, dtype=torch.int64),
                     _zeros(rank, T + 1 + rank, K))
    return time.monotonic() - t0, _group_still_works(rank, world_size)


@pytest.mark.parametrize("world_size", WORLDS)
def test_reference_every_rank_failing_raises_its_own_error(world_size):
    for took, healthy in run_distributed(_every_rank_fails, world_size, timeout=60):
        assert healthy and took < FAST_S, took


def _overflow_everywhere(rank, world_size):
    """Each rank's own capacity too small (as test_cuda_backend's overflow counts): every rank
    raises its own overflow, none a peer's."""
    buf = _buffer(world_size, rank, max_recv_tokens=0)
    x, idx, w = _inputs(rank, world_size)
    with pytest.raises(RuntimeError) as info:
        buf.dispatch(x, idx, w)
    return type(info.value).__name__, str(info.value)


def test_reference_overflow_on_every_rank_names_each_own():
    for rank, (kind, message) in enumerate(run_distributed(_overflow_everywhere, 3, timeout=60)):
        assert kind == "RuntimeError" and message.startswith(f"rank {rank} received"), message


def _late_peer(rank, world_size):
    """Rank 1 stops in place of a dispatch its peer makes only after rank 1's wait for it ran out
    (``timeout_s`` = 1 s): rank 1 warns and goes on; the peer, arriving later, still finds the
    stop in its first exchange (the post stayed pending for it)."""
    buf = _buffer(world_size, rank, timeout_s=1.0)
    x, idx, w = _inputs(rank, world_size)
    if rank == 1:
        with pytest.warns(UserWarning, match="could not tell its peers"):
            buf.abort("late on purpose", skipped_call=True)
        return "warned"
    time.sleep(3.0)
    with pytest.raises(MokPeerStopped, match="late on purpose"):
        buf.dispatch(x, idx, w)
    return "told"


def test_reference_stop_reaches_a_peer_that_comes_later():
    assert run_distributed(_late_peer, 2, timeout=60, fresh=True) == ["told", "warned"]


def _never_calls_again(rank, world_size):
    """Rank 1 stops between calls (``abort()``: it tells nobody) and makes no MoK call for a
    while; its process goes on. Its peers' next dispatch ends in ``MokTimeout`` after the
    Buffer's ``timeout_s`` (2 s), not at the group's timeout (180 s here), naming the status
    exchange; then they refuse without any exchange. When rank 1 calls at last (refused, it
    posts its stop) its post completes the peers' queued exchange, so the group ends healthy."""
    buf = _buffer(world_size, rank, timeout_s=2.0)
    x, idx, w = _inputs(rank, world_size)
    assert _group_still_works(rank, world_size)   # every rank here: the good call's 2 s are its own
    buf.dispatch(x, idx, w)                       # one good call on every rank first
    if rank == 1:
        buf.abort("never calls again")
        time.sleep(5.0)
        with warnings.catch_warnings():           # its post must complete (pairs with theirs)
            warnings.filterwarnings("error", message=".*could not tell its peers")
            with pytest.raises(RuntimeError, match="never calls again"):
                buf.dispatch(x, idx, w)
        assert _group_still_works(rank, world_size)
        return None
    t0 = time.monotonic()
    with pytest.raises(MokTimeout, match=r"timed out after 2 s .* in the status exchange of a "
                                         r"dispatch \(a host-side collective\)") as info:
        buf.dispatch(x, idx, w)
    took = time.monotonic() - t0
    assert info.value.rank == rank and info.value.timeout_s == 2.0
    with pytest.raises(RuntimeError, match=f"stopped on rank {rank} .*MokTimeout"):
        buf.dispatch(x, idx, w)                   # refused, no exchange (it would pair wrongly)
    with pytest.raises(RuntimeError, match=f"rank {rank} stopped this Buffer .*timed out"):
        buf._get_backend("reference").combine_prob_grads(None, _zeros(rank, 1))
    assert _group_still_works(rank, world_size)
    return took


@pytest.mark.parametrize("world_size", WORLDS)
def test_reference_peers_of_a_rank_that_never_calls_again_time_out(world_size):
    out = run_distributed(_never_calls_again, world_size, timeout=60, fresh=True)
    assert out[1] is None
    for rank, took in enumerate(out):
        if rank != 1:
            assert 1.9 < took < FAST_S, f"rank {rank} raised after {took:.1f} s (timeout 2 s)"


@pytest.mark.gpu
@pytest.mark.multigpu
@pytest.mark.skipif(not gpus_for(2), reason="needs 2 GPUs (or MOK_TEST_SHARED_GPU=1)")
@pytest.mark.parametrize("world_size", (2,))
def test_reference_peers_of_a_rank_that_never_calls_again_time_out_on_gpus(world_size):
    out = run_distributed(_never_calls_again, world_size, backend="nccl", timeout=120, fresh=True)
    assert out[1] is None and 1.9 < out[0] < FAST_S, out


def _late_gather(rank, world_size, what):
    """``all_gather_exact`` with a timeout of 1 s where rank 1 joins after 3 s: rank 0 raises
    ``MokTimeout`` naming ``what``; its gather stays queued, and rank 1's completes it."""
    from megatron_mok.comm import all_gather_exact

    t = torch.full((5,), float(rank + 1))
    if rank == 1:
        time.sleep(3.0)
        got = all_gather_exact(t, None, world_size, 1.0, what)
    else:
        with pytest.raises(MokTimeout, match=f"rank 0 timed out after 1 s .* in {what} "):
            all_gather_exact(t, None, world_size, 1.0, what)
        got = None
    assert _group_still_works(rank, world_size)
    return None if got is None else got[:, 0].tolist()


def test_a_bounded_gather_times_out_and_stays_queued():
    assert run_distributed(_late_gather, 2, "a test gather", timeout=60, fresh=True) == [None, [1.0, 2.0]]


def test_a_timeout_in_a_later_collective_stops_the_rank(monkeypatch):
    # A MokTimeout past the status exchange (a peer that stalled inside the call): this rank
    # refuses from then on, naming the collective, and never posts a stop (it would pair with
    # the peers' next collective, its own being queued).
    import megatron_mok.backends.reference as ref

    buf = _buffer(1)
    be = buf._get_backend("reference")
    seen = []

    def stalled(t, group, world_size, timeout_s, what):
        seen.append((timeout_s, what))
        raise MokTimeout(0, what, timeout_s)

    monkeypatch.setattr(ref, "all_gather_exact", stalled)
    x, idx, w = _inputs(0, 1)
    with pytest.raises(MokTimeout, match="a dispatch's routing exchange"):
        buf.dispatch(x, idx, w)
    assert seen == [(TIMEOUT_S, "a dispatch's routing exchange")]
    assert be.told and "routing exchange" in be.aborted
    posted = []
    monkeypatch.setattr(ref, "post_stop", lambda *a: posted.append(a) or True)
    with pytest.raises(RuntimeError, match="rank 0 stopped this Buffer .*routing exchange"):
        buf.dispatch(x, idx, w)
    assert posted == []


def test_the_timeout_defaults_to_mok_timeout_s(monkeypatch):
    from megatron_mok.comm import timeout_seconds

    monkeypatch.delenv("MOK_TIMEOUT_S", raising=False)
    assert timeout_seconds(None) == 60.0 and timeout_seconds(3) == 3.0
    monkeypatch.setenv("MOK_TIMEOUT_S", "7.5")
    assert timeout_seconds(None) == 7.5 and timeout_seconds(2.0) == 2.0


def _world_of_one(rank, world_size):
    buf = _buffer(1)
    with pytest.raises(ValueError):
        buf.dispatch(torch.zeros(T + 1, H), torch.zeros(T + 1, K, dtype=torch.int64), torch.zeros(T + 1, K))
    x, idx, w = _inputs(0, 1)
    return int(buf.dispatch(x, idx, w).tokens.shape[0])   # a world of one is never stopped


def test_reference_world_of_one_is_not_stopped():
    assert run_distributed(_world_of_one, 1)[0] > 0


def test_an_error_after_the_exchange_is_not_a_skipped_call(monkeypatch):
    # Past a call's first exchange its peers are in the call's later collectives: an error of
    # this rank there must not post a stop (it would pair with one of those). The Buffer's
    # mark is cleared by the exchange (seen from build_layout, which runs after it).
    import megatron_mok.backends.reference as ref

    buf = _buffer(1)
    seen = []
    real = ref.build_layout

    def spy(*args, **kwargs):
        seen.append(buf._status_due)
        return real(*args, **kwargs)

    monkeypatch.setattr(ref, "build_layout", spy)
    x, idx, w = _inputs(0, 1)
    buf.dispatch(x, idx, w)
    assert seen == [False] and not buf._status_due


def test_status_record_round_trip():
    from megatron_mok.comm import STATUS_REASON_BYTES, _read_status, _status_record

    long = "ValueError: é" * 40                      # past the record: cut at a character
    recs = torch.stack([_status_record([3, -1, 5], None, "cpu"), _status_record([], long, "cpu")])
    vals, stops = _read_status(recs)
    assert vals[0, :3].tolist() == [3, -1, 5] and vals[1].tolist() == [0] * vals.shape[1]
    assert list(stops) == [1] and long.startswith(stops[1])
    assert len(stops[1].encode()) <= STATUS_REASON_BYTES and len(stops[1]) > 100
    with pytest.raises(ValueError, match="at most"):
        _status_record(list(range(20)), None, "cpu")


class _PolledWork:
    """A stand-in for an NCCL collective's work: complete after ``polls`` polls (never: None)."""

    def __init__(self, polls):
        self.polls, self.waited, self.cap = polls, False, 5000

    def is_completed(self):
        if self.polls is None:
            self.cap -= 1
            assert self.cap > 0, "polled far past the deadline"   # a wait that never gives up
            return False
        self.polls -= 1
        return self.polls < 0

    def wait(self, timeout=None):
        self.waited = True
        return True


def test_wait_bounded_polls_other_backends_until_the_deadline(monkeypatch):
    # Not gloo (NCCL: its wait only orders the stream): the work is polled; done within the
    # deadline is True (and waited for), never done is False once the deadline passed.
    from megatron_mok import comm

    monkeypatch.setattr(comm.dist, "get_backend", lambda group=None: "nccl")
    work = _PolledWork(3)
    assert comm.wait_bounded(work, None, 5.0) and work.waited
    work = _PolledWork(None)
    t0 = time.monotonic()
    assert not comm.wait_bounded(work, None, 0.05) and not work.waited
    assert 0.05 <= time.monotonic() - t0 < 2.0


def test_the_errors_are_exported_with_one_hierarchy():
    # One `except mok.MokPeerStopped` catches a peer's stop on either backend; the CUDA one is
    # also a MokDeviceError (what code written for the CUDA backend catches); all RuntimeErrors.
    from megatron_mok.cuda import errors

    for name in ("MokDeviceError", "MokDevicePeerStopped", "MokPeerStopped", "MokTimeout"):
        assert getattr(mok, name) is getattr(errors, name) and name in mok.__all__
    assert issubclass(mok.MokDevicePeerStopped, mok.MokPeerStopped)
    assert issubclass(mok.MokDevicePeerStopped, mok.MokDeviceError)
    assert not issubclass(mok.MokTimeout, (mok.MokPeerStopped, mok.MokDeviceError))
    assert all(issubclass(getattr(mok, n), RuntimeError) for n in ("MokDeviceError", "MokTimeout"))
    err = mok.MokDevicePeerStopped(2, "why", "message")
    assert (err.rank, err.reason, str(err)) == (2, "why", "message")


def _group_timeouts(rank, world_size):
    from datetime import timedelta

    from megatron_mok.comm import group_timeout_seconds

    sub = dist.new_group(list(range(world_size)), timeout=timedelta(minutes=7))
    return group_timeout_seconds(None), group_timeout_seconds(sub)


def test_a_groups_own_timeout_is_read(monkeypatch):
    # What the Megatron dispatcher's Buffers wait for a late peer without MOK_TIMEOUT_S: the EP
    # group's own timeout (NOTES item 61); the harness makes the world with DEFAULT_TIMEOUT_S.
    from harness import DEFAULT_TIMEOUT_S
    from megatron_mok.comm import group_timeout_seconds

    out = run_distributed(_group_timeouts, 2, fresh=True, timeout=60)
    assert out == [(float(DEFAULT_TIMEOUT_S), 420.0)] * 2, out
    assert group_timeout_seconds(None) is None          # torch.distributed not initialised here

    class NoOptions:                                    # a backend without readable options
        _device_types = [torch.device("cpu")]

        def _get_backend(self, device):
            raise RuntimeError("no backend")
    import megatron_mok.comm as comm
    monkeypatch.setattr(comm.dist, "is_initialized", lambda: True)
    assert group_timeout_seconds(NoOptions()) is None

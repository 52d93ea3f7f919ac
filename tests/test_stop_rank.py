"""A rank that raises stops its Buffer, and its peers raise at once (docs/CONTRACT.md, "Errors";
NOTES item 53).

An input refused on one rank only (here: more tokens than ``max_tokens_per_rank``, a cached
dispatch or a combine of the wrong shape) raises there before anything is published, while its
peers are already in the same call, waiting for that rank's routing, staged tokens or partial
sums. Before, they waited until their ``timeout_s`` (60 s by default) and then named a timeout.
Now the raising rank first stops the Buffer (``Buffer.abort``): on the CUDA backend a kernel
poisons every flag its peers wait on for it, and their waits end with ``MokDeviceError`` naming
it ("rank 1 stopped after an error of its own"): a ``MokDevicePeerStopped`` (also a
``MokPeerStopped``) quoting rank 1's reason, which its stop kernel left in its workspace, and
naming rank 1 even when a peer found another stopped peer first (NOTES item 57); and each
peer's own stop note, read back from its workspace, passes rank 1's on (origin 1, rank 1's
words): the link of a chain of stops, checked on every run whether or not a chain happened
(NOTES item 59).

GPU: loopback ranks (threads on one GPU, ``megatron_mok.loopback``) with a timeout of
``TIMEOUT_S``; each peer must raise in well under it, with the message that names rank 1, for
a refused eager dispatch (every layout and staging schedule), a static-shape dispatch, a cached
dispatch, a combine (both combine schedules) and a narrow prob-gradient combine after an
explicit ``abort()``. Also on two real GPUs (NCCL). CPU: what the Python side does (who calls
``abort``, what a stopped Buffer refuses, that a world of one rank is never stopped).
"""

import time

import pytest
import torch

import megatron_mok as mok
from harness import make_inputs, rank_device, run_distributed, run_loopback
from test_cuda_backend import GPU_WORLD_SIZES, mok_buffer

gpu = pytest.mark.gpu
# Long enough that a peer that waited for its timeout cannot pass the time check below.
TIMEOUT_S = 20.0
FAST_S = 8.0
E_PER_RANK, H, K, T = 2, 64, 2, 32


def _all_here():
    """Every rank reaches this point before any goes on: none frees its workspace (destroy) while
    a peer's kernels may still read it."""
    import torch.distributed as dist

    from harness import in_loopback, loopback_barrier

    torch.cuda.current_stream().synchronize()
    if in_loopback():
        loopback_barrier()
    else:
        dist.barrier()


def _one_rank_stops(rank, world_size, where, hidden=H):
    """Rank 1 raises in ``where``; every other rank makes the same call with valid inputs and
    must raise ``MokDeviceError`` naming rank 1. Returns ``(seconds, message)`` of each peer,
    ``None`` for rank 1 (which checks its own refusal)."""
    from megatron_mok.cuda.errors import MokDeviceError

    dev = rank_device(rank)
    E = E_PER_RANK * world_size
    kw = {"max_recv_tokens": world_size * T * K} if where == "static" else {}
    buf = mok_buffer(E, hidden, K, T, torch.bfloat16, "cuda", dev, timeout_s=TIMEOUT_S, **kw)
    x, idx, w = make_inputs(5, world_size, [T - 3] * world_size, E, hidden, K, torch.bfloat16,
                            device=dev)[rank]
    bad = rank == 1
    res = None
    if where in ("cached", "combine", "narrow"):
        res = buf.dispatch(x, idx, w)             # one good call on every rank first
        torch.cuda.current_stream().synchronize()
    t0 = time.monotonic()
    if where == "device_error":
        return _device_error_on_rank_1(buf, x, idx, w, bad, E, rank)
    if bad:
        if where in ("dispatch", "static"):
            big = torch.zeros(T + 1, hidden, dtype=torch.bfloat16, device=dev)
            with pytest.raises(ValueError, match="max_tokens_per_rank"):
                buf.dispatch(big, torch.zeros(T + 1, K, dtype=torch.int64, device=dev),
                             torch.zeros(T + 1, K, device=dev))
            first = "ValueError"
        elif where == "cached":
            with pytest.raises(ValueError):
                buf.dispatch(x[:-1], handle=res.handle)
            first = "ValueError"
        elif where == "combine":
            with pytest.raises(ValueError):
                buf.combine(res.tokens.new_zeros(res.tokens.shape[0] + 1, hidden), res.handle)
            first = "ValueError"
        else:
            buf.abort("an expert raised on purpose")
            first = "an expert raised on purpose"
        with pytest.raises(RuntimeError, match=f"stopped on rank 1.*{first}"):
            buf.dispatch(x, idx, w)
        with pytest.raises(RuntimeError, match=f"rank 1 stopped this Buffer.*{first}"):
            buf._get_backend("cuda").combine(res.tokens, res.handle) if res is not None \
                else buf._get_backend("cuda").check_errors()
        _all_here()
        buf.destroy()
        return None
    with pytest.raises(MokDeviceError) as info:
        if where in ("dispatch", "static"):
            buf.dispatch(x, idx, w)
        elif where == "cached":
            buf.dispatch(x, handle=res.handle)
        elif where == "combine":
            buf.combine(res.tokens, res.handle)
        else:
            buf._get_backend("cuda").combine_prob_grads(res.handle, torch.ones_like(res.probs))
        buf.check_errors()
    took = time.monotonic() - t0
    with pytest.raises(MokDeviceError) as again:   # refused from now on, naming the same stop
        buf.dispatch(x, idx, w)
    own = _own_note(buf, rank)
    _all_here()
    buf.destroy()
    return took, _peer_error(info.value), _peer_error(again.value), own


def _own_note(buf, rank):
    """``(origin, reason)`` of the stop note this peer's own stop kernel left in its workspace
    (read back through the library, as its peers would read it): a rank stopped by a peer
    passes that peer's note on, so this is the link of a chain of stops (NOTES item 59)."""
    return buf._get_backend("cuda")._peer_stop_note(rank)


def _peer_error(exc):
    """What a peer's check needs of its exception: picklable (the 2-GPU twin's processes)."""
    from megatron_mok.cuda.errors import MokPeerStopped

    return {"msg": str(exc), "peer_stopped": isinstance(exc, MokPeerStopped),
            "rank": getattr(exc, "rank", None), "reason": getattr(exc, "reason", None)}


def _device_error_on_rank_1(buf, x, idx, w, bad, E, rank):
    """A data error (a bad expert id) on rank 1, read at its dispatch's host read after its
    transfer was launched: the peers' call completes without an error (the stop waits for
    their reads of what rank 1 published), and their next dispatch raises at once."""
    from megatron_mok.cuda.errors import MokDeviceError

    if bad:
        idx = idx.clone()
        idx[2, 0] = E
        with pytest.raises(MokDeviceError, match="expert id"):
            buf.dispatch(x, idx, w)
        _all_here()
        buf.destroy()
        return None
    res = buf.dispatch(x, idx, w)
    buf.check_errors()                              # this call completed on every rank
    assert res.tokens.shape[0] > 0
    t0 = time.monotonic()
    with pytest.raises(MokDeviceError) as info:
        buf.dispatch(x, idx, w)
        buf.check_errors()
    took = time.monotonic() - t0
    with pytest.raises(MokDeviceError) as again:
        buf.dispatch(x, idx, w)
    own = _own_note(buf, rank)
    _all_here()
    buf.destroy()
    return took, _peer_error(info.value), _peer_error(again.value), own


# What rank 1's stop note says (its reason, without the package's prefix), per ``where``.
REASONS = {"dispatch": r"^ValueError: x has T=33 .*max_tokens_per_rank",
           "static": r"^ValueError: x has T=33 .*max_tokens_per_rank",
           "cached": r"^ValueError: ", "combine": r"^ValueError: ",
           "narrow": r"^an expert raised on purpose$",
           "device_error": r"^rank 1: topk_idx holds an expert id outside \[-1, num_experts\)"}


def _check_peers(out, where):
    import re

    from megatron_mok.cuda.errors import REASON_BYTES

    assert out[1] is None
    for rank, got in enumerate(out):
        if rank == 1:
            continue
        took, err, later, own = got
        msg = err["msg"]
        # Its own stop kernel wrote rank 1's note on, origin and words unchanged, whichever
        # peer it found first: a rank that reads this rank's note names rank 1.
        assert own == (1, err["reason"]), f"rank {rank}: its own note {own}, its error {err}"
        # The peer's error names rank 1 and quotes its reason (its stop note), as a
        # MokPeerStopped (also a MokDeviceError), and so does every later refusal.
        # With 3+ ranks a peer may find another peer's poison first (that peer stopped after
        # rank 1 did): the message then names both, "rank 0 stopped after rank 1's error (...)".
        for e in (err, later):
            assert e["peer_stopped"] and e["rank"] == 1, f"rank {rank}: {e}"
            assert e["reason"] and re.search(REASONS[where], e["reason"]), f"rank {rank}: {e}"
            assert len(e["reason"].encode()) <= REASON_BYTES
            assert re.search(r"rank (1 stopped after an error of its own|\d+ stopped after rank 1's "
                             r"error) \(" + re.escape(e["reason"]) + r"\)", e["msg"]), e["msg"]
        assert later["msg"] == msg
        print(f"[peer {rank}] {msg[:160]}")            # with -s: which peer each rank found
        assert took < FAST_S, f"rank {rank} raised after {took:.1f} s (timeout {TIMEOUT_S} s): {msg}"
        if where in ("dispatch", "static", "device_error"):
            assert "before publishing its routing" in msg, msg
        if where in ("combine", "narrow"):
            assert "before staging its partial sums" in msg, msg


DISPATCH_SCHEDULES = [pytest.param({}, id="default"),
                      pytest.param({"MOK_LAYOUT_FUSED": "0"}, id="three_kernel_layout"),
                      pytest.param({"MOK_EAGER_STAGE_FIRST": "1"}, id="eager_stage_first"),
                      pytest.param({"MOK_EAGER_SPECULATIVE": "1"}, id="eager_speculative")]


@gpu
@pytest.mark.parametrize("env", DISPATCH_SCHEDULES)
def test_loopback_dispatch_refused_on_one_rank_stops_its_peers_at_once(env, monkeypatch):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    _check_peers(run_loopback(_one_rank_stops, 3, "dispatch", timeout=120), "dispatch")


@gpu
@pytest.mark.parametrize("where", ("static", "cached", "narrow", "device_error"))
def test_loopback_other_calls_refused_on_one_rank_stop_their_peers_at_once(where):
    _check_peers(run_loopback(_one_rank_stops, 3, where, timeout=120), where)


@gpu
@pytest.mark.parametrize("env", [pytest.param({}, id="phased"),
                                 pytest.param({"MOK_COMBINE_PHASED": "0"}, id="role_split")])
def test_loopback_combine_refused_on_one_rank_stops_its_peers_at_once(env, monkeypatch):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    _check_peers(run_loopback(_one_rank_stops, 3, "combine", timeout=120), "combine")


@pytest.mark.parametrize("world_size", GPU_WORLD_SIZES)
@pytest.mark.parametrize("where", ("dispatch", "combine"))
def test_one_rank_stops_its_peers_on_gpus(where, world_size):
    _check_peers(run_distributed(_one_rank_stops, world_size, where, backend="nccl", timeout=120), where)


# ------------------------------------------------------------------------------------ CPU
class _Recorder:
    """A backend stand-in that records what the Buffer asks of it."""

    name = "reference"
    destroyed = False

    def __init__(self):
        self.aborted, self.told = [], 0

    def abort(self, reason):
        self.aborted.append(reason)

    def tell_peers(self):
        self.told += 1

    def destroy(self):
        self.destroyed = True


def _two_rank_buffer(monkeypatch):
    """A Buffer that believes it is rank 0 of 2 (nothing is exchanged: every call below raises
    before the backend is reached), with a recording backend."""
    monkeypatch.setattr(mok.buffer, "group_rank_size", lambda group: (0, 2))
    buf = mok.Buffer(None, num_experts=4, hidden=16, topk=2, max_tokens_per_rank=8, backend="reference")
    rec = _Recorder()
    buf._backends["reference"] = rec
    return buf, rec


def test_an_input_error_stops_the_buffer_and_names_itself(monkeypatch):
    buf, rec = _two_rank_buffer(monkeypatch)
    x = torch.zeros(9, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="max_tokens_per_rank"):
        buf.dispatch(x, torch.zeros(9, 2, dtype=torch.int64), torch.zeros(9, 2))
    assert len(rec.aborted) == 1 and rec.aborted[0].startswith("ValueError: x has T=9"), rec.aborted
    with pytest.raises(RuntimeError, match=r"stopped on rank 0 after an error \(ValueError: x has T=9"):
        buf.dispatch(x[:2], torch.zeros(2, 2, dtype=torch.int64), torch.zeros(2, 2))
    with pytest.raises(RuntimeError, match="stopped on rank 0"):
        buf.combine(x, None)
    buf.abort("later")
    assert buf._aborted.startswith("ValueError") and len(rec.aborted) == 2   # the first reason stays


def test_who_tells_the_reference_peers(monkeypatch):
    # An error inside a call, before the backend's first exchange: that call's peers are told
    # (tell_peers). A public abort between calls tells nobody; the next call, refused, does;
    # skipped_call=True tells at once.
    buf, rec = _two_rank_buffer(monkeypatch)
    with pytest.raises(ValueError):
        buf.dispatch(torch.zeros(9, 16, dtype=torch.bfloat16), torch.zeros(9, 2, dtype=torch.int64),
                     torch.zeros(9, 2))
    assert rec.told == 1 and not buf._status_due
    buf, rec = _two_rank_buffer(monkeypatch)
    buf.abort("between calls")
    assert rec.told == 0
    with pytest.raises(RuntimeError, match="between calls"):
        buf.combine(torch.zeros(3, 16), None)
    assert rec.told == 1
    buf, rec = _two_rank_buffer(monkeypatch)
    buf.abort("before a dispatch", skipped_call=True)
    assert rec.told == 1 and rec.aborted == ["before a dispatch"]


def test_a_combine_input_error_stops_the_buffer(monkeypatch):
    buf, rec = _two_rank_buffer(monkeypatch)
    with pytest.raises((TypeError, ValueError)):
        buf.combine(torch.zeros(3, 16), None)
    assert len(rec.aborted) == 1
    with pytest.raises(RuntimeError, match="stopped on rank 0"):
        buf.combine(torch.zeros(3, 16), None)


def test_a_device_error_leaves_the_stop_to_the_cuda_backend(monkeypatch):
    # The CUDA backend stopped the rank when it raised the MokDeviceError, and refuses later
    # calls with it: the Buffer adds no stop of its own (its refusal would be a RuntimeError).
    from megatron_mok.cuda.errors import MokDeviceError

    buf, rec = _two_rank_buffer(monkeypatch)
    buf._abort_after(MokDeviceError("megatron_mok: rank 0: rank 1 stopped ..."))
    assert buf._aborted is None and rec.aborted == []
    buf._abort_after(ValueError("bad"))
    assert buf._aborted == "ValueError: bad" and rec.aborted == ["ValueError: bad"]


def test_a_failing_abort_does_not_hide_the_error(monkeypatch):
    buf, rec = _two_rank_buffer(monkeypatch)

    def broken(reason):
        raise RuntimeError("launch failed")

    rec.abort = broken
    with pytest.warns(UserWarning, match="could not stop its peers"):
        with pytest.raises(ValueError, match="max_tokens_per_rank"):
            buf.dispatch(torch.zeros(9, 16, dtype=torch.bfloat16), torch.zeros(9, 2, dtype=torch.int64),
                         torch.zeros(9, 2))


def test_a_destroyed_buffer_is_not_stopped(monkeypatch):
    buf, rec = _two_rank_buffer(monkeypatch)
    buf.destroy()
    buf.abort("after destroy")
    assert rec.aborted == [] and buf._aborted is None


def test_cuda_backend_abort_marks_it_broken_before_it_launches():
    # The host half of CudaBackend.abort, without a GPU: the refusal message is set even when
    # nothing can be launched (world of one rank in the stand-in: _stop_rank returns at once).
    from types import SimpleNamespace

    from megatron_mok.cuda.backend import CudaBackend
    from megatron_mok.cuda.errors import MokDeviceError

    be = CudaBackend.__new__(CudaBackend)
    be.buf = SimpleNamespace(rank=3, world_size=1)
    be.broken = None
    be.abort("ValueError: bad")
    assert "rank 3 stopped this Buffer after an error (ValueError: bad)" in be.broken
    with pytest.raises(MokDeviceError, match="rank 3 stopped"):
        be._alive()
    assert not be.stopped                          # nothing launched in a world of one


def test_a_failed_stop_does_not_hide_the_device_error():
    # _raise_if_error stops the rank before it raises; here the stop itself fails (no GPU: the
    # stream calls raise). The device error must still be what the caller gets.
    from types import SimpleNamespace

    from megatron_mok.cuda.backend import CudaBackend
    from megatron_mok.cuda.errors import MokDeviceError

    be = CudaBackend.__new__(CudaBackend)
    be.buf = SimpleNamespace(rank=0, world_size=2, max_recv_tokens=None)
    be.broken, be.ctx, be.timeout_s, be.device = None, 1, 60.0, torch.device("cuda", 0)
    be.lib = SimpleNamespace(mok_stop_rank=lambda ctx, stream, note, n, origin: 1,
                             mok_last_error=lambda: b"launch failed")
    with pytest.warns(UserWarning, match="could not stop its peers after a device error"):
        with pytest.raises(MokDeviceError, match="expert id outside"):
            be._raise_if_error([2, 0, -1, 0, 7, 0, 0, 0])
    assert "expert id outside" in be.broken


def test_peer_stopped_messages_name_what_the_peer_did_not_do():
    from megatron_mok.cuda.errors import describe

    routing = describe([7, 0, 1, 1, 5, 0, 0, 0], 60.0, None)
    assert "rank 0: rank 1 stopped after an error of its own" in routing
    assert "before publishing its routing for this dispatch (routing call 5)" in routing
    partials = describe([7, 2, 1, 5, 9, 0, 0, 0], 60.0, None)
    assert "rank 2: rank 1 stopped" in partials and "partial sums" in partials and "generation 9" in partials
    own = describe([4, 1, -1, 0, 0, 0, 0, 0], 60.0, None)
    assert "rank 1 stopped this Buffer after an error of its own" in own


# ------------------------------------------------------- the stop note (CPU: the host half)
class _NoteLib:
    """A stand-in for the library's stop calls: records ``(note, bytes, origin)`` of each stop
    and serves ``notes[peer]`` (a reason of the peer's own, ``(origin, reason)`` passed on,
    absent: the peer left none; ``"fail"``: the read fails) to reads."""

    def __init__(self, notes=None):
        self.stops, self.notes = [], notes or {}

    def mok_stop_rank(self, ctx, stream, note, n, origin):
        self.stops.append((bytes(note), n, origin))
        return 0

    def mok_read_stop_note(self, ctx, peer, stream, text, length, origin):
        note = self.notes.get(peer)
        if note == "fail":
            return 1
        if note is not None and not isinstance(note, tuple):
            note = (peer, note)
        raw = b"" if note is None else note[1].encode()
        length._obj.value = -1 if note is None else len(raw)
        origin._obj.value = -1 if note is None else note[0]
        text.value = raw
        return 0

    def mok_last_error(self):
        return b"stand-in"


def _note_backend(monkeypatch, notes=None, rank=0):
    """A host-only CudaBackend of rank ``rank`` in a world of 3 whose launches go to a
    :class:`_NoteLib` (no GPU: the stream and capture queries are stubbed)."""
    from types import SimpleNamespace

    from megatron_mok.cuda.backend import CudaBackend

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    be = CudaBackend.__new__(CudaBackend)
    be.buf = SimpleNamespace(rank=rank, world_size=3, max_recv_tokens=None)
    be.broken, be.ctx, be.timeout_s, be.device = None, 1, 60.0, torch.device("cuda", 0)
    be.lib = _NoteLib(notes)
    be._stream = lambda: 0
    be._sync = lambda: None
    return be


def test_a_peer_stop_raises_with_the_reason_its_note_gives(monkeypatch):
    # Code 7 (kPeerStopped) from peer 2: the peer's note is read and quoted, the error is both
    # a MokDeviceError and a MokPeerStopped naming rank 2 with that reason, and so is every
    # later refusal; this rank's own stop leaves its own message (prefix cut) as its note.
    from megatron_mok.cuda.errors import MokDeviceError, MokDevicePeerStopped, MokPeerStopped

    be = _note_backend(monkeypatch, {2: "ValueError: x has T=9 > max_tokens_per_rank=8 \u00e9"})
    with pytest.raises(MokDevicePeerStopped) as info:
        be._raise_if_error([7, 0, 2, 1, 5, 0, 0, 0])
    err = info.value
    assert isinstance(err, MokDeviceError) and isinstance(err, MokPeerStopped)
    assert err.rank == 2 and err.reason == "ValueError: x has T=9 > max_tokens_per_rank=8 \u00e9"
    assert ("rank 0: rank 2 stopped after an error of its own (ValueError: x has T=9 > "
            "max_tokens_per_rank=8 \u00e9) before publishing its routing") in str(err)
    assert "see its message" not in str(err)
    with pytest.raises(MokPeerStopped) as later:
        be._alive()
    assert (later.value.rank, later.value.reason, str(later.value)) == (2, err.reason, str(err))
    # This rank's own stop passes the first rank's note on (a chain names rank 2 and its words).
    assert be.lib.stops == [(err.reason.encode(), len(err.reason.encode()), 2)]


def test_a_chain_of_stops_names_the_first_rank(monkeypatch):
    # Peer 1 stopped because rank 2 did, and passed rank 2's note on: the error names rank 2
    # (its reason), says peer 1 stopped after it, and this rank passes the same note on.
    from megatron_mok.cuda.errors import MokDevicePeerStopped

    be = _note_backend(monkeypatch, {1: (2, "an expert raised on rank 2")})
    with pytest.raises(MokDevicePeerStopped) as info:
        be._raise_if_error([7, 0, 1, 5, 3, 0, 0, 0])
    assert (info.value.rank, info.value.reason) == (2, "an expert raised on rank 2")
    assert ("rank 0: rank 1 stopped after rank 2's error (an expert raised on rank 2) before "
            "staging its partial sums") in str(info.value)
    assert be.lib.stops == [(b"an expert raised on rank 2", 26, 2)]


def test_a_peer_stop_without_a_readable_note_says_where_to_look(monkeypatch):
    from megatron_mok.cuda.errors import MokDevicePeerStopped

    for notes in ({}, {1: "fail"}):
        be = _note_backend(monkeypatch, notes)
        with pytest.raises(MokDevicePeerStopped) as info:
            be._raise_if_error([7, 0, 1, 5, 3, 0, 0, 0])
        assert info.value.rank == 1 and info.value.reason is None
        assert "rank 1 stopped after an error of its own (see its message" in str(info.value)
        assert "before staging its partial sums" in str(info.value)
        # This rank's own stop: its message, the first rank still named (peer 1).
        ((note, n, origin),) = be.lib.stops
        assert note.startswith(b"rank 0: rank 1 stopped after an error of its own") and origin == 1


def test_other_device_errors_are_not_peer_stops(monkeypatch):
    from megatron_mok.cuda.errors import MokDeviceError, MokPeerStopped

    be = _note_backend(monkeypatch, {1: "should not be read"})
    with pytest.raises(MokDeviceError) as info:
        be._raise_if_error([2, 0, -1, 0, 7, 0, 0, 0])        # a bad expert id of this rank
    assert not isinstance(info.value, MokPeerStopped)
    with pytest.raises(MokDeviceError) as later:
        be._alive()
    assert not isinstance(later.value, MokPeerStopped)
    ((note, n, origin),) = be.lib.stops
    assert note.startswith(b"rank 0: topk_idx holds an expert id outside") and n == len(note)
    assert not note.startswith(b"megatron_mok") and n <= 240 and origin == 0


def test_abort_leaves_its_reason_as_the_note_cut_to_240_bytes(monkeypatch):
    from megatron_mok.cuda.errors import REASON_BYTES

    be = _note_backend(monkeypatch, rank=1)
    reason = "an expert raised: " + "\u00e9" * 200             # 418 bytes of UTF-8
    be.abort(reason)
    be.abort("again")                                          # once is enough
    ((note, n, origin),) = be.lib.stops
    assert n == len(note) and REASON_BYTES - 1 <= n <= REASON_BYTES and origin == 1
    assert reason.startswith(note.decode("utf-8"))            # cut on a character boundary
    assert be.stopped and "an expert raised" in be.broken


def test_reason_bytes_cut_on_a_character_boundary():
    from megatron_mok.comm import STATUS_REASON_BYTES
    from megatron_mok.cuda.errors import REASON_BYTES, reason_bytes

    assert STATUS_REASON_BYTES == REASON_BYTES == 240
    assert reason_bytes("short") == b"short"
    for s in ("a" * 300, "\u00e9" * 130, "x" + "\u20ac" * 100, "\U0001F600" * 70):
        raw = reason_bytes(s)
        assert len(raw) <= REASON_BYTES and len(raw) > REASON_BYTES - 4
        assert s.startswith(raw.decode("utf-8"))

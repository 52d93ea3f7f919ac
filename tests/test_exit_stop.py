"""A rank whose process exits with an uncaught exception stops its peers first (NOTES item 68).

An exception raised outside the Buffer's own calls (an expert, the attention, the loss, the data
loader) ends the rank's process while its peers may be inside a dispatch or combine waiting for
it. Without a stop they spin until their ``timeout_s`` (the EP group's timeout, 10 minutes
under Megatron) where the launcher does not end them (srun without ``--kill-on-bad-exit``).
Now the exit hook that frees the Buffers first stops each CUDA-backend Buffer in a group, and a
waiting peer raises at once, naming the rank and quoting the exception.

CPU: the hook's decisions with stand-ins. GPU: two real processes (sharing a GPU, or one each);
rank 1 raises uncaught after a dispatch, rank 0's combine must raise quoting it.
"""

import json
import sys
import types
import weakref

import pytest

import megatron_mok.buffer as buffer_mod
from harness import gpus_for, run_rank_scripts


def test_the_reason_quotes_the_exception():
    assert (buffer_mod.exit_reason(RuntimeError("an expert blew up"))
            == "its process is exiting after an uncaught RuntimeError: an expert blew up")


def test_the_exception_is_the_one_the_interpreter_printed_last(monkeypatch):
    for name in ("last_exc", "last_value"):
        monkeypatch.delattr(sys, name, raising=False)
    assert buffer_mod.uncaught_exception() is None
    err = ValueError("bad")
    monkeypatch.setattr(sys, "last_value", err, raising=False)     # Python 3.11
    assert buffer_mod.uncaught_exception() is err
    newer = KeyError("k")
    monkeypatch.setattr(sys, "last_exc", newer, raising=False)     # Python 3.12
    assert buffer_mod.uncaught_exception() is newer


class _Live:
    def __init__(self, log, name, stop_fails=False):
        self.log, self.name, self.stop_fails = log, name, stop_fails

    def _stop_at_exit(self, reason):
        self.log.append((self.name, "stop", reason))
        if self.stop_fails:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    def destroy(self):
        self.log.append((self.name, "destroy"))


@pytest.mark.parametrize("uncaught", [None, OSError("disk full")])
def test_the_exit_hook_stops_the_buffers_only_after_an_uncaught_exception(monkeypatch, uncaught):
    for name in ("last_exc", "last_value"):
        monkeypatch.delattr(sys, name, raising=False)
    if uncaught is not None:
        monkeypatch.setattr(sys, "last_value", uncaught, raising=False)
    log = []
    live = [_Live(log, "a", stop_fails=True), _Live(log, "b")]   # a's stop cannot launch
    monkeypatch.setattr(buffer_mod, "_LIVE_BUFFERS", weakref.WeakSet(live))
    buffer_mod._destroy_live_buffers()
    for name in ("a", "b"):
        mine = [e for e in log if e[0] == name]
        if uncaught is None:        # a clean exit: a peer may still read this rank's flags
            assert mine == [(name, "destroy")]
        else:                       # stopped first, then freed (a stop that raised too)
            assert mine == [(name, "stop", "its process is exiting after an uncaught OSError: disk full"),
                            (name, "destroy")]


class _Backend:
    def __init__(self, loopback=False):
        self.mem = types.SimpleNamespace(loopback=loopback)
        self.reasons = []

    def abort(self, reason):
        self.reasons.append(reason)


def _buffer(backends, world_size=2, aborted=None, destroyed=False):
    buf = object.__new__(buffer_mod.Buffer)
    buf._backends, buf.world_size, buf._aborted, buf._destroyed = backends, world_size, aborted, destroyed
    buf._status_due = False                     # between calls, as at an exit
    return buf


def test_only_a_cuda_backend_of_a_group_is_stopped_at_exit():
    cuda = _Backend()
    buf = _buffer({"cuda": cuda})
    buf._stop_at_exit("exiting")
    assert cuda.reasons == ["exiting"] and buf._aborted == "exiting"     # later calls refuse too
    # a reference backend's stop is a collective: exiting would wait for its peers
    ref = _Backend()
    buf = _buffer({"reference": ref})
    buf._stop_at_exit("exiting")
    assert ref.reasons == [] and buf._aborted is None
    for buf in (_buffer({"cuda": _Backend()}, world_size=1),           # nobody to tell
                _buffer({"cuda": _Backend()}, aborted="earlier"),       # told already
                _buffer({"cuda": _Backend()}, destroyed=True),
                _buffer({"cuda": _Backend(loopback=True)})):             # threads: all done
        buf._stop_at_exit("exiting")
        assert buf._backends["cuda"].reasons == []


@pytest.mark.gpu
@pytest.mark.multigpu
def test_a_rank_exiting_with_an_uncaught_exception_stops_its_peer(tmp_path):
    if not gpus_for(2):
        pytest.skip("needs 2 GPUs (or MOK_TEST_SHARED_GPU=1)")
    out = str(tmp_path / "rank0.json")
    codes, logs = run_rank_scripts("exit_worker.py", 2, out)
    assert codes[1] == 1 and "an expert blew up on rank 1" in logs[1], logs[1][-2000:]
    assert codes[0] == 0, logs[0][-3000:]
    got = json.load(open(out))
    assert got["raised"] == "MokDevicePeerStopped" and got["rank"] == 1, got
    assert got["reason"] == ("its process is exiting after an uncaught RuntimeError: an expert blew "
                             "up on rank 1"), got
    assert got["seconds"] < got["timeout_s"] / 3, got      # stopped, not timed out

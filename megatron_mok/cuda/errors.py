"""Decoding of the device-side error report (``csrc/include/mok/config.h``: ErrorCode, WaitKind)."""

from __future__ import annotations

from typing import Optional

ERROR_CODES = {
    1: "timeout",
    2: "bad expert id",
    3: "receive overflow",
    4: "aborted",
    5: "configuration mismatch",
    6: "expert overflow",
    7: "peer stopped",
}

# A configuration mismatch's subject (csrc/include/mok/config.h ConfigMismatch), in `what`.
MISMATCH_SPECULATIVE, MISMATCH_ROW_BYTES = 0, 1
# A row-format mismatch's detail (config.h, row_format): 16-byte vectors per row, or'ed with this
# bit when the rows came from two sources (an FP8 pair read in place, fp8.PairRows).
ROW_TWO_SOURCES_BIT = 19

# A kPeerStopped found by the re-read before a release (NOTES item 41), not by a wait: its `what`
# (config.h, the wait kind of a release).
PEER_STOPPED_WHILE_READ = 4

WAIT_KINDS = {
    0: "nothing",
    1: "the peer's routing for this dispatch (did the peer call dispatch?)",
    2: "peers to finish reading this rank's previous routing in the slot",
    3: "the peer's staged tokens (dispatch ring chunk)",
    4: "peers to release this rank's dispatch ring slot",
    5: "the peer's partial sums (combine ring chunk)",
    6: "the owner to release this rank's combine ring slot",
}


# ErrorReport (csrc/include/mok/workspace.h): 32 bytes the host reads on every call, then one
# 16-byte AbandonedWait {int32 peer, int32 pad, int64 detail} per wait kind, read only to
# describe a timeout. The C side static_asserts the same offsets.
ABANDONED_OFFSET = 32
ABANDONED_ENTRY_BYTES = 16
WAIT_KIND_COUNT = 8


def _word64(lo, hi) -> int:
    """The 64-bit field stored as two int32 words (low first)."""
    return (int(lo) & 0xFFFFFFFF) | (int(hi) << 32)


def abandoned_waits(report, table_words) -> list:
    """``[(kind, peer, detail)]`` of the waits this rank gave up after the error, from the
    report (8 int32 words: ``waits_noted`` is words 6-7) and its table read as int32 words
    (4 per entry)."""
    noted = _word64(report[6], report[7]) & ((1 << 64) - 1)
    out = []
    for kind in range(WAIT_KIND_COUNT):
        if (noted >> kind) & 1:
            w = table_words[4 * kind: 4 * kind + 4]
            out.append((kind, int(w[0]), _word64(w[2], w[3])))
    return out


# Bytes of reason a rank that stops leaves its peers: the CUDA backend's stop note
# (csrc/include/mok/config.h kStopNoteBytes, workspace.h StopNote) and the reference backend's
# status record (megatron_mok/comm.py) alike.
REASON_BYTES = 240


def reason_bytes(reason: str) -> bytes:
    """``reason`` as UTF-8, cut to :data:`REASON_BYTES` on a character boundary (what a peer
    receives; the rank's own message keeps it whole)."""
    return reason.encode("utf-8")[:REASON_BYTES].decode("utf-8", "ignore").encode("utf-8")


def stopped_message(rank: int, reason: str) -> str:
    """What every backend of a Buffer stopped on this rank (``Buffer.abort``) raises at its later
    calls, the backward's included."""
    return (f"megatron_mok: rank {rank} stopped this Buffer after an error ({reason}); it can no "
            "longer be used on any rank of its group: make a new Buffer on every rank")


class MokPeerStopped(RuntimeError):
    """A peer's stop: rank ``rank`` stopped this Buffer after an error of its own, and
    ``reason`` is what it said (at most :data:`REASON_BYTES` of it; ``None`` where the CUDA
    backend could not read it). Reference backend: told in this call's first exchange (or
    every rank found it in the call's exchanged routing: another rank's overflow). CUDA
    backend: :class:`MokDevicePeerStopped`, which is also a :class:`MokDeviceError`."""

    def __init__(self, rank: int, reason, message: Optional[str] = None):
        super().__init__(message if message is not None else stopped_message(rank, reason))
        self.rank, self.reason = rank, reason


class MokDeviceError(RuntimeError):
    """An error reported by the MoK kernels (timeout, bad routing, overflow)."""


class MokTimeout(RuntimeError):
    """A host-side collective (``what``: a reference-backend call's, or the CUDA backend's at
    creation: its layout check, its workspace allocation) waited ``timeout_s`` (the Buffer's
    ``timeout_s``, the CUDA backend's spin-wait limit) for the other ranks of the group. The
    CUDA backend's kernels report theirs as a :class:`MokDeviceError`."""

    def __init__(self, rank: int, what: str, timeout_s: float):
        super().__init__(
            f"megatron_mok: rank {rank} timed out after {timeout_s:g} s waiting for the other ranks "
            f"of its group in {what} (a host-side collective). A peer is missing (stopped between "
            "calls without calling again, or its process stuck), hung, or made its Buffers or "
            "called dispatch/combine in a different order. Raise Buffer(timeout_s=...) (or "
            "MOK_TIMEOUT_S) if a peer is merely slow. This Buffer can no longer be used, and the unfinished collective stays "
            "queued in its process group (a rank that arrives late completes it, then times out in "
            "its next one): make a new group and Buffer, or end the job.")
        self.rank, self.what, self.timeout_s = rank, what, timeout_s


class MokDevicePeerStopped(MokDeviceError, MokPeerStopped):
    """The CUDA backend's peer error: this rank's kernels found a peer's flags poisoned (it
    stopped, ``Buffer.abort``); ``rank`` is the rank whose own error it was (that peer, or the
    first rank of a chain of stops: each stopped rank passes the note it read on) and ``reason``
    the note its stop kernel left in its workspace (``None`` if it could not be read). Caught as
    either parent: a device error to code written for the CUDA backend, a peer's stop to code
    written for both backends."""


def describe(report, timeout_s: float, max_recv_tokens, abandoned=(), note=None) -> str:
    """Human-readable message for an ``ErrorReport`` read as 8 int32 words; ``abandoned``:
    the other waits this rank gave up after a timeout (:func:`abandoned_waits`); ``note``:
    for a peer's stop (code 7), ``(origin, reason)`` from the note it left (the rank whose own
    error it was, and its reason, ``None`` if unread: :class:`MokDevicePeerStopped`)."""
    code, rank, peer, what = (int(v) for v in report[:4])
    detail = _word64(report[4], report[5])
    kind = ERROR_CODES.get(code, f"error code {code}")
    if code == 1:
        others = [(k, p, d) for k, p, d in abandoned if k != what]
        also = ""
        if others:
            also = (" Also stopped on this rank, still waiting: " + "; ".join(
                f"{WAIT_KINDS.get(k, k)} from peer {p} (detail {d})" for k, p, d in others) + ".")
        return (f"megatron_mok: rank {rank} timed out after {timeout_s:g} s waiting for peer {peer}: "
                f"{WAIT_KINDS.get(what, what)} (detail {detail}).{also} A peer is missing, hung, or "
                "called dispatch/combine in a different order. Raise Buffer(timeout_s=...) if a "
                "peer is merely slow. This Buffer can no longer be used.")
    if code == 2:
        return (f"megatron_mok: rank {rank}: topk_idx holds an expert id outside [-1, num_experts) "
                f"at flat slot {detail}; that slot was treated as unrouted. Fix the router output.")
    if code == 3:
        return (f"megatron_mok: rank {rank} received {detail} rows, more than max_recv_tokens="
                f"{max_recv_tokens} (static-shape mode); rows past it were not written. Raise "
                "max_recv_tokens.")
    if code == 5 and what == MISMATCH_ROW_BYTES:
        row = 16 * (detail & ((1 << ROW_TWO_SOURCES_BIT) - 1))
        how = "an FP8 pair read in place" if (detail >> ROW_TWO_SOURCES_BIT) & 1 else "one tensor"
        return (f"megatron_mok: rank {rank} and rank {peer} dispatched rows of different sizes or "
                f"layouts in the same call (rank {peer}'s rows are {row} bytes, from {how}): every "
                "rank must pass token tensors, or every rank an FP8 pair (x_fp8, scales) with the "
                "same scale width and dtype (docs/CONTRACT.md, \"FP8 dispatch\"). This Buffer can "
                "no longer be used.")
    if code == 5:
        return (f"megatron_mok: rank {rank} and rank {peer} disagree on the speculative eager "
                "dispatch (one publishes a speculative capacity, the other does not). It is on "
                "where MOK_EAGER_SPECULATIVE=1, MOK_EAGER_STAGE_FIRST is not 1 and "
                "max_recv_tokens is not set; every rank of "
                "the group must have the same. This Buffer can no longer be used.")
    if code == 6:
        return (f"megatron_mok: rank {rank}: local expert {peer} received {detail} rows, more than "
                f"rows_per_expert={what}; its rows past {what} were dropped (not written, not "
                "combined). The capacity must hold every routed row.")
    if code == 4:
        return (f"megatron_mok: rank {rank} stopped this Buffer after an error of its own (its "
                "first error said which); it can no longer be used on any rank of its group.")
    if code == 7:
        # The first rank's words where the stop note could be read, else where to look for them.
        origin, reason = note if note is not None else (peer, None)
        why = (f"({reason})" if reason else
               "(see its message: e.g. an input refused there, more tokens than "
               "max_tokens_per_rank, or a device error it read)")
        whose = "an error of its own" if origin == peer else f"rank {origin}'s error"
        stopped = f"megatron_mok: rank {rank}: rank {peer} stopped after {whose} {why}"
        if what in (1, 5):
            before = (f"publishing its routing for this dispatch (routing call {detail})" if what == 1
                      else f"staging its partial sums for this combine (combine ring generation {detail})")
            return (f"{stopped} before {before}, so this call's outputs are not valid. This Buffer "
                    "can no longer be used.")
        if what == PEER_STOPPED_WHILE_READ:
            return (f"{stopped} while this rank was reading its staged tokens (dispatch ring "
                    f"generation {detail}); its next staging may have overwritten them under this "
                    "rank's reads, so this call's outputs are not valid. This Buffer can no longer "
                    "be used.")
        return (f"{stopped} while this rank had not yet read its staged tokens (dispatch ring "
                f"generation {detail}); they may have been overwritten, so this rank did not read "
                "them and this call's outputs are not valid. This Buffer can no longer be used.")
    return f"megatron_mok: rank {rank}: {kind} (peer {peer}, wait kind {what}, detail {detail})"

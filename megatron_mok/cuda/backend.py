"""The CUDA backend: pull-based dispatch/combine over peer memory (kernels in ``csrc/``).

Per call, everything stays on the device except one host read per eager dispatch: the row
count ``R``, needed to allocate ``tokens [R, H]``. The host waits for the layout kernels only,
then allocates the rows and launches the transfer (static-shape mode, ``max_recv_tokens``,
reads nothing and never syncs). ``MOK_EAGER_STAGE_FIRST=1`` instead launches the staging
half of the transfer (copying my tokens into my ring for the peers, which needs no output)
on a side stream before the read, and the pulling half after it, so the GPU is not idle
during the read; measured on 2x H200 it is 50-90 us slower per dispatch than the default
(the second launch and the cross-stream events cost more than the gap they fill;
benchmarks/NOTES.md #13), so it is off by default. Call numbers (routing, dispatch ring, combine ring) live on the device and advance
identically on every rank, because every rank makes the same calls in the same order; being
on the device, they advance on CUDA-graph replays too.
"""

from __future__ import annotations

import ctypes
import os
import warnings
from dataclasses import dataclass
from typing import Optional

import torch

from ..comm import all_gather_exact, timeout_seconds
from ..fp8 import PairRows
from ..handle import DispatchHandle
from ..loopback import OwnStream, is_loopback
from ..rows import aligned_rows
from ..validation import buffer_layout, layout_error
from . import bindings, host_ops, library
from .launch_policy import env_int, launch_policy
from .errors import (ABANDONED_ENTRY_BYTES, ABANDONED_OFFSET, REASON_BYTES, WAIT_KIND_COUNT,
                     MokDeviceError, MokDevicePeerStopped, abandoned_waits, describe, reason_bytes,
                     stopped_message)
from .peer_memory import PeerMemory

DTYPE_CODES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
DEFAULT_NUM_SMS = 24
DEFAULT_RING_BYTES = 256 << 20
DEFAULT_CHUNK_TOKENS = 64
# Row width (elements) of the combine that carries only prob gradients (combine_prob_grads):
# the narrowest the combine kernels take (one 16-byte vector of bf16).
PROB_GRAD_HIDDEN = 8
# The eager fill-first dispatch keeps row outputs for a bound on R per handle (20 B per row);
# above this it falls back to filling after the host read (outputs of exactly R rows).
FILL_FIRST_MAX_BYTES = 64 << 20
TIMEOUT = 1     # ErrorCode kTimeout (csrc/include/mok/config.h)
BAD_EXPERT = 2  # ErrorCode kBadExpert (csrc/include/mok/config.h): a data error, not a protocol one
EXPERT_OVERFLOW = 6  # ErrorCode kExpertOverflow: rows_per_expert too small, a data error too
PEER_STOPPED = 7  # ErrorCode kPeerStopped: a peer stopped after an error of its own
# Data errors leave the ring protocol intact and only the reporting rank knows: it launches its
# transfer like its peers (they wait for its staged tokens), then raises.
DATA_ERRORS = (BAD_EXPERT, EXPERT_OVERFLOW)
# Speculative eager dispatch: rows allocated before R is known = this margin over the largest R
# of the last SPEC_HISTORY calls, plus one chunk of slack.
SPEC_MARGIN, SPEC_HISTORY = 1.10, 8
META_SLOTS = 16
# Most routes per token and ranks per Buffer (csrc/include/mok/config.h kMaxTopk, kMaxRanks).
MAX_TOPK, MAX_RANKS = 32, 64
_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def current_stream_ptr(device_index: int) -> int:
    """A device's current CUDA stream as an int for the library. The raw-pointer query skips
    building a Stream object (a few us per call); pointers go to the library as plain ints
    (ctypes converts them for its c_void_p arguments)."""
    if _RAW_STREAM is not None:
        return _RAW_STREAM(device_index)
    return torch.cuda.current_stream(device_index).cuda_stream


@dataclass
class CudaLayout:
    """Backend-private part of a handle: the device layout arrays (``csrc`` HandleArrays)."""

    scratch: torch.Tensor   # uint8, carved by HandleArrays::make


def ring_chunk_bytes(chunk_tokens: int, hidden: int, topk: int, elem: int, partial_elem: int):
    """``(dispatch, combine)`` bytes of one ring chunk: ``chunk_tokens`` token rows, and for the
    combine their partial sums plus each row's ``topk`` float32 weights. A ring of ``ring_bytes``
    holds ``ring_bytes // chunk`` whole chunks of each."""
    return (chunk_tokens * hidden * elem,
            chunk_tokens * hidden * partial_elem + chunk_tokens * topk * 4)


def _used(v: int) -> str:
    return "used" if v else "not used"


def _env_int(name: str, default: int) -> int:
    return env_int(os.environ, name, default)


def _roles_for(blocks: int):
    """(blocks, dispatch producers, combine producers) of a transfer kernel of ``blocks``
    blocks. Role split (benchmarks/NOTES.md #7, #9): dispatch staging needs ~1/6 of the
    blocks; combine producers reduce the remote tokens' rows (~45% of the combine's local
    bytes), consumers the own rows plus the pulled partials and the output."""
    return (blocks, _env_int("MOK_DISPATCH_PRODUCERS", max(1, blocks // 6)),
            _env_int("MOK_COMBINE_PRODUCERS", max(1, blocks * 11 // 24)))


class CudaBackend:
    name = "cuda"
    # True once destroy() began: the peer memory and the library context are gone, so every
    # entry raises (_alive) instead of handing the kernels freed pointers. A class attribute, so
    # it reads False on an instance whose __init__ raised part-way.
    destroyed = False
    stopped = False   # mok_stop_rank was launched (_stop_rank): once is enough
    # (origin, reason) of the stop note that broke this backend (the rank whose own error it
    # was, and its words): later calls raise the same MokDevicePeerStopped (_broken_error).
    broken_by: Optional[tuple] = None
    # The C++ host ops (host_ops.py, NOTES item 75), or None: the Python path. A class default
    # so that a backend made without __init__ (CPU tests) takes the Python path.
    host_ops = None

    def __init__(self, buf):
        self.buf = buf
        self.lib = library.get()
        if not torch.cuda.is_available():
            raise RuntimeError("backend='cuda' needs a CUDA device")
        if buf.hidden % 8 != 0:
            raise ValueError(f"the CUDA backend needs hidden % 8 == 0, got hidden={buf.hidden}")
        if buf.combine_partial_dtype not in (buf.dtype, torch.float32):
            raise TypeError("the CUDA backend needs combine_partial_dtype to be the token dtype or float32")
        if buf.world_size > MAX_RANKS or buf.topk > MAX_TOPK:
            raise ValueError(f"the CUDA backend supports up to {MAX_RANKS} ranks and topk <= "
                             f"{MAX_TOPK}, got {buf.world_size} ranks and topk {buf.topk}")
        # The workspace's GPU; the Buffer's device is fixed to it (device=None or "cuda": the
        # current device, now), so that a tensor on another GPU is refused from here on.
        dev = buf._cuda_device()
        self.device = dev
        arch, why_not = library.kernel_arch(dev.index)
        if arch is None:        # before any workspace: a clear error, not a failed first launch
            raise RuntimeError(library.unsupported_gpu_message(dev.index, why_not))
        self.misaligned_copies = 0  # inputs copied to a 16-byte aligned address (aligned_rows)
        elem = torch.tensor([], dtype=buf.dtype).element_size()
        pelem = torch.tensor([], dtype=buf.combine_partial_dtype).element_size()
        self.chunk_tokens = _env_int("MOK_CHUNK_TOKENS", DEFAULT_CHUNK_TOKENS)
        ring = buf.ring_bytes or DEFAULT_RING_BYTES
        C, H, K = self.chunk_tokens, buf.hidden, buf.topk
        disp_chunk, comb_chunk = ring_chunk_bytes(C, H, K, elem, pelem)
        disp_chunks, comb_chunks = ring // disp_chunk, ring // comb_chunk
        if disp_chunks < 1 or comb_chunks < 1:
            raise ValueError(f"ring_bytes={ring} is smaller than one ring chunk "
                             f"({max(disp_chunk, comb_chunk)} bytes = {C} rows)")
        self.ctx = self.lib.mok_create(buf.world_size, buf.rank, H, elem, pelem, K,
                                       buf.num_local_experts, buf.max_tokens_per_rank, C,
                                       META_SLOTS, disp_chunks, comb_chunks, buf.expert_alignment)
        if not self.ctx:
            raise ValueError(f"megatron_mok: {self.lib.mok_last_error().decode()}")
        self.timeout_s = timeout_seconds(buf.timeout_s)
        nbytes = self.lib.mok_workspace_bytes(self.ctx)
        # MOK_EAGER_STAGE_FIRST=1: the eager dispatch's staging kernel runs on the side stream
        # while the host reads R (module docstring). Events are reused: a wait binds to the
        # record made before it, so re-recording is safe.
        self.stage_first = _env_int("MOK_EAGER_STAGE_FIRST", 0) != 0
        # Copy-engine staging (NOTES #31, on unless MOK_DISPATCH_CE_STAGE=0): the copy engine
        # copies x into my dispatch ring before the transfer kernel, so all its blocks pull. Only
        # for a ring that holds a whole call (the slots are then fixed) and not with stage-first.
        # Both fix where the peers read a rank's tokens: decided here, before the layout check
        # compares them.
        self.ce_stage = (_env_int("MOK_DISPATCH_CE_STAGE", 1) != 0 and not self.stage_first
                         and bool(self.lib.mok_dispatch_ce_stage_supported(self.ctx)))
        self._check_layout_agrees(dev, disp_chunks, comb_chunks, nbytes)
        # The eager dispatch's host report (R, tasks, the speculative verdict, 0, then 8 error
        # words), written by the layout's scan kernel straight into mapped pinned memory: the
        # host reads plain ints after an event, no copy is queued. Pinned before the workspace
        # exists: on a loopback group (ranks as threads of one device) peers may already run
        # kernels once it does.
        self._host_report_t = torch.zeros(12, dtype=torch.int32, pin_memory=True)
        with torch.cuda.device(dev):
            self._check(self.lib.mok_set_host_report(self.ctx, self._host_report_t.data_ptr()))
        self.host_report = (ctypes.c_int32 * 12).from_address(self._host_report_t.data_ptr())
        # The side stream, also made before the workspace, for the same reason: a loopback
        # rank's stream creation (cudaStreamCreateWithFlags) waited, in s42-4, until peers that
        # had passed the workspace's rendezvous and queued their dispatch kernels (which wait for
        # this rank) timed out, 20 s later. (What held it up: those peers' unsettled host reads,
        # pageable copies behind their kernels; loopback.settle_host_reads, NOTES item 78.)
        self._own_side = None
        if is_loopback(buf.group):       # never the stream of another rank (loopback.OwnStream)
            self._own_side = OwnStream(dev)
            self.side_stream = self._own_side.stream
        else:
            self.side_stream = torch.cuda.Stream(device=dev)
        try:
            with torch.cuda.device(dev):
                self.mem = PeerMemory(nbytes, buf.group, buf.rank, buf.world_size, dev, self.timeout_s)
        except BaseException:
            self.lib.mok_destroy(self.ctx)   # no workspace was made: the context is all to free
            self.ctx = None
            if self._own_side is not None:
                self._own_side.close()
                self._own_side = None
            raise
        ptrs = (ctypes.c_uint64 * buf.world_size)(*self.mem.peer_ptrs)
        self._check(self.lib.mok_set_peers(self.ctx, ptrs, buf.world_size, float(self.timeout_s)))
        self.scratch_bytes = self.lib.mok_handle_scratch_bytes(self.ctx)
        err = self.lib.mok_error_offset(self.ctx)
        self.error_words = self.mem.tensor[err: err + 32].view(torch.int32)
        # Read only to describe a timeout: the other waits this rank's kernels gave up.
        table = err + ABANDONED_OFFSET
        self.abandoned_words = self.mem.tensor[table: table + WAIT_KIND_COUNT * ABANDONED_ENTRY_BYTES].view(torch.int32)
        sms = self.lib.mok_sm_count(dev.index)
        self.num_blocks = max(2, min(buf.num_sms or DEFAULT_NUM_SMS, sms))
        if self.mem.loopback:
            # Every rank's transfer kernel waits for its peers', so all must be resident.
            most = buf.group.max_sms_per_rank(sms)
            if buf.num_sms is not None and buf.num_sms > most:
                raise ValueError(f"loopback group of {buf.world_size} ranks on one GPU of {sms} SMs: "
                                 f"num_sms={buf.num_sms} is more than the {most} per rank that fit")
            self.num_blocks = max(2, min(self.num_blocks, most))
            buf.group.check_layout_fits(sms, self.num_blocks, -(-buf.max_tokens_per_rank // C))
        _, self.dispatch_producers, self.combine_producers = _roles_for(self.num_blocks)
        # Programmatic dependent launch (NOTES #48: each kernel of a call's chain is scheduled
        # while the one before it runs, and waits for it on the device; its blocks sit resident
        # but idle meanwhile) and the SM budget of small calls (NOTES #49: calls of at most
        # small_call_tokens tokens on this rank run their transfer kernels on small_call_sms
        # SMs; each rank decides from its own token count, and no kernel assumes that its peers
        # launch as many blocks as it does, tested with ranks that choose differently; not for
        # the eager stage-first split, whose two kernels share num_sms): launch_policy.py.
        policy = launch_policy(os.environ, buf.num_sms, self.mem.loopback and buf.world_size > 1)
        self.pdl = policy.pdl
        self._check(self.lib.mok_set_pdl(self.ctx, int(self.pdl)))
        small = policy.small_call_sms
        self.small_call_tokens = policy.small_call_tokens
        self.small_roles = (self.num_blocks, self.dispatch_producers, self.combine_producers)
        if small > 0:
            blocks = max(2, min(small, most if self.mem.loopback else sms))
            self.small_roles = _roles_for(blocks)
            if self.mem.loopback:
                buf.group.check_layout_fits(sms, blocks, -(-buf.max_tokens_per_rank // C))
        self.broken: Optional[str] = None
        # MOK_EAGER_FILL_FIRST=1: the eager dispatch queues the fill before the host reads R,
        # into per-row outputs sized by a bound on R (every slot of every source's tokens:
        # W * T_max * K rows, 20 bytes each; the handle keeps them, sliced to R), so the fill runs
        # while the host waits for R. Off by default: it measured no gain on 2x H200 (NOTES #20).
        # With expert_alignment each local expert may add up to A - 1 zero rows.
        self.rows_bound = (buf.world_size * buf.max_tokens_per_rank * buf.topk
                           + buf.num_local_experts * (buf.expert_alignment - 1))
        # The bound is ~W times R (R ~ T * K), so the handle holds 20 * W * T_max * K bytes where
        # R rows of tokens take R * H * elem: 10 * W / H of the token rows (1% at W=8, H=7168).
        # Large EP groups (an NVL72 domain: 72 x 16k x 8 rows) would hold too much per handle.
        bound_fits = not self.stage_first and self.rows_bound * 20 <= FILL_FIRST_MAX_BYTES
        # MOK_EAGER_SPECULATIVE=1: the eager dispatch also launches the transfer before the host
        # read, into rows allocated for a capacity guessed from recent calls (_dispatch_speculative);
        # it needs the fill before the read, so it turns fill-first on.
        # Not with expert_alignment: the scan's verdict sums every rank's rows from the routing,
        # and a rank's zero rows depend on its experts' counts, which the peers do not total.
        speculative = _env_int("MOK_EAGER_SPECULATIVE", 0) != 0
        self.speculative = speculative and bound_fits and buf.expert_alignment == 1
        if speculative and buf.expert_alignment > 1:
            warnings.warn("MOK_EAGER_SPECULATIVE=1 is ignored by a Buffer with expert_alignment > 1 "
                          "(its eager dispatches read R first); every rank's Buffers must agree",
                          stacklevel=3)
        self.fill_first = bound_fits and (_env_int("MOK_EAGER_FILL_FIRST", 0) != 0 or self.speculative)
        self._spec_recent: list = []
        self.spec_fallbacks = 0  # calls whose guess was short on some rank (all redid the transfer)
        # The transfer mode's copy-engine flag, for every transfer of this Buffer.
        self.ce_mode = bindings.TRANSFER_CE_STAGED if self.ce_stage else bindings.TRANSFER_BOTH
        self._side_raw = ctypes.c_void_p(self.side_stream.cuda_stream)
        self._layout_read = torch.cuda.Event()
        self._layout_done = torch.cuda.Event()
        self._staged = torch.cuda.Event()
        # MOK_DISPATCH_CE_OVERLAP=1 (opt-in): full dispatches run the copy-engine staging on the
        # side stream, beside the layout kernels (NOTES #35). Off by default: not yet measured on
        # 2 GPUs, and a one-GPU loopback benchmark hung once with it (NOTES #35, s9-9).
        self.ce_overlap = self.ce_stage and buf.world_size > 1 and _env_int("MOK_DISPATCH_CE_OVERLAP", 0) != 0
        # Diagnostics (scripts/profile_host_calls.py --ab): True issues a dispatch's launches one
        # library call each, as before NOTES #51, instead of mok_dispatch_launch's one call.
        self.separate_launches = False
        # A static dispatch's and a forward combine's host side in one C++ call each, an eager
        # dispatch's in two (NOTES items 75-76), when the extension is built for this torch and
        # this C ABI (else None: the Python path, which does the same; MOK_HOST_OPS=0 forces it).
        # The library's functions reach it as addresses.
        self.host_ops = host_ops.get(self.lib.mok_abi_version())
        self._launch_addr = ctypes.cast(self.lib.mok_dispatch_launch, ctypes.c_void_p).value
        self._layout_addr = ctypes.cast(self.lib.mok_dispatch_layout, ctypes.c_void_p).value
        self._combine_addr = ctypes.cast(self.lib.mok_combine, ctypes.c_void_p).value
        self._ce_fork = torch.cuda.Event()
        self._ce_done = torch.cuda.Event()

    def _check_layout_agrees(self, dev, disp_chunks: int, comb_chunks: int, nbytes: int) -> None:
        """Every rank reads its peers' workspaces at the offsets its own arguments give, so the
        arguments that shape a workspace (and how its rows are read) must be the same on every
        rank: a mismatch would make peers read each other's rows and flags at wrong offsets or
        in the wrong dtype (silently wrong results, or a wait that never ends). Checked before
        the workspace is allocated, in one bounded gather (a rank that failed before it: the
        others' MokTimeout), and every rank raises the same words (NOTES item 63)."""
        buf = self.buf
        if buf.world_size == 1:
            return                             # nobody to differ from
        fields = buffer_layout(buf) + [
            ("MOK_CHUNK_TOKENS", self.chunk_tokens, str),
            # where the peers read this rank's tokens: staged slots (fixed, chunk j in slot j)
            # or ring slots claimed per call; stage-first's two halves
            ("copy-engine staging (MOK_DISPATCH_CE_STAGE)", int(self.ce_stage), _used),
            ("MOK_EAGER_STAGE_FIRST", int(self.stage_first), str),
            ("dispatch ring chunks (ring_bytes)", disp_chunks, str),
            ("combine ring chunks (ring_bytes)", comb_chunks, str),
            ("workspace bytes", nbytes, str), ("C ABI version", bindings.ABI_VERSION, str)]
        t = torch.tensor([v for _, v, _ in fields], dtype=torch.int64, device=dev)
        try:
            every = all_gather_exact(t, buf.group, buf.world_size, self.timeout_s,
                                     "the CUDA backend's creation (its workspace layout)").tolist()
            problem = layout_error(fields, every, also=", the same ring_bytes, MOK_CHUNK_TOKENS, "
                                   "MOK_DISPATCH_CE_STAGE and MOK_EAGER_STAGE_FIRST, and the same "
                                   "build of the library")
            if problem is not None:
                raise ValueError(problem)
        except BaseException:
            self.lib.mok_destroy(self.ctx)   # nothing else was made yet
            self.ctx = None
            raise

    # ----------------------------------------------------------------------------- helpers
    def _check(self, rc: int) -> None:
        if rc != 0:
            raise RuntimeError(f"megatron_mok CUDA call failed: {self.lib.mok_last_error().decode()}")

    def _stream(self) -> int:
        return current_stream_ptr(self.device.index)

    @staticmethod
    def _ptr(t: Optional[torch.Tensor]) -> int:
        return t.data_ptr() if t is not None and t.numel() else 0

    @staticmethod
    def _row_ptrs(src: Optional[torch.Tensor]):
        """``(_ptr(src[0]), _ptr(src[1]))`` of a ``[2, n]`` tensor (the per-row source ranks and
        tokens), without the two indexing ops (host time per call; the handle takes the views)."""
        first = CudaBackend._ptr(src)
        return first, (first + src.stride(0) * src.element_size() if first else 0)

    def _alive(self):
        """Raise unless this backend may launch: not destroyed (its peer memory would be freed:
        the autograd Functions check ``destroyed`` too, with a message naming the backward), and
        no device error seen (``broken``)."""
        if self.destroyed:
            raise RuntimeError("megatron_mok: this Buffer was destroyed (Buffer.destroy() freed its "
                               "CUDA backend's peer memory); make a new Buffer")
        if self.broken:
            raise self._broken_error()

    def _broken_error(self) -> MokDeviceError:
        """The error every call raises once ``broken``: a :class:`MokDevicePeerStopped` where a
        peer's stop broke this backend (its rank and reason kept), else a :class:`MokDeviceError`."""
        if self.broken_by is not None:
            return MokDevicePeerStopped(*self.broken_by, self.broken)
        return MokDeviceError(self.broken)

    def _rows(self, t, name: str):
        """A tensor whose rows the kernels read (``x`` of a dispatch, ``expert_out`` of a combine,
        and the gradients the backward passes hand to them), checked before anything is
        allocated, queued or published: on this backend's GPU (else ``ValueError``: the kernels
        would read another device's memory at its addresses, or fault), and 16-byte aligned
        (else copied: :func:`aligned_rows`)."""
        if t.device != self.device:
            raise ValueError(f"{name} is on {t.device}, but this Buffer's CUDA workspace is on "
                             f"{self.device}: every tensor passed to it must be on that GPU")
        out = aligned_rows(t)
        if out is not t:
            self.misaligned_copies += 1
        return out

    def _raise_if_error(self, words) -> None:
        """Raise :class:`MokDeviceError` if ``words`` (the error report's first 8 int32, a list
        or a ctypes array) hold an error."""
        words = list(words)
        if words[0] != 0:
            abandoned = ()
            if words[0] == TIMEOUT:
                # Let this rank's kernels finish aborting (they record the waits they give up),
                # then name those waits too: a stall report should show every stuck party.
                self._sync()
                abandoned = abandoned_waits(self.error_words.cpu().tolist(),
                                            self.abandoned_words.cpu().tolist())
            note = None
            if words[0] == PEER_STOPPED:
                peer = int(words[2])
                origin, text = self._peer_stop_note(peer)
                note = (peer if origin is None else origin, text)
                self.broken_by = note
            self.broken = describe(words, self.timeout_s, self.buf.max_recv_tokens, abandoned, note)
            # This rank stops here: its peers, maybe waiting for it in this very call (a data
            # error is this rank's alone), must not wait until their timeout. A failed stop
            # must not hide the device error (the peers then time out, as before). After a
            # peer's stop, its note is passed on (a chain of stops names the first rank).
            try:
                self._stop_rank(self.broken if note is None or note[1] is None else note[1],
                                None if note is None else note[0])
            except Exception as err:
                warnings.warn(f"megatron_mok: rank {self.buf.rank} could not stop its peers after "
                              f"a device error ({err}); they will wait until their timeout")
            raise self._broken_error()

    def _peer_stop_note(self, peer: int) -> tuple:
        """``(origin, reason)`` that ``peer`` left in its workspace when it stopped
        (``mok_read_stop_note``): the rank whose own error it was (``peer``, or the first rank
        of a chain of stops) and its reason; ``(None, None)`` when it left none or the read
        failed (the message then says where to look). After this rank's kernels are done (they
        gave up their waits on the error): the copy waits for them on this rank's stream."""
        try:
            self._sync()
            text = ctypes.create_string_buffer(REASON_BYTES)
            n, origin = ctypes.c_int(-1), ctypes.c_int(-1)
            if self.lib.mok_read_stop_note(self.ctx, peer, self._stream(), text, ctypes.byref(n),
                                           ctypes.byref(origin)) != 0:
                return None, None
        except Exception:   # noqa: BLE001  (a message's detail: never hide the error itself)
            return None, None
        if n.value < 0:
            return None, None
        return origin.value, text.raw[:n.value].decode("utf-8", "replace")

    def abort(self, reason: str) -> None:
        """Stop this rank after an error of its own (:meth:`Buffer.abort`): every later call
        raises (``broken``), and its peers' waits for it end at once (:meth:`_stop_rank`)."""
        if self.broken is None and not self.destroyed:
            self.broken = stopped_message(self.buf.rank, reason)
        self._stop_rank(reason)

    def _stop_rank(self, reason: str, origin: Optional[int] = None) -> None:
        """``mok_stop_rank`` once, on the current stream after this rank's queued work (the side
        stream's too: nothing this rank publishes later may overwrite the poison): every flag a
        peer waits on for this rank becomes "stopped", so their waits end with an error naming
        this rank instead of a timeout. Not in a world of one rank, not while a CUDA graph is
        captured (the launch would only run at a replay; the peers are capturing, not waiting),
        not after destroy(). ``reason`` (its first :data:`REASON_BYTES` bytes, without the
        package's prefix) and ``origin`` (the rank whose own error it was; default this rank)
        are left in the workspace for the peers' messages."""
        if (self.stopped or self.destroyed or self.buf.world_size == 1 or not getattr(self, "ctx", None)
                or torch.cuda.is_current_stream_capturing()):
            return
        self.stopped = True
        main = torch.cuda.current_stream(self.device)
        if getattr(self, "side_stream", None) is not None:
            main.wait_stream(self.side_stream)
        note = reason_bytes(reason.removeprefix("megatron_mok: "))
        origin = self.buf.rank if origin is None else origin
        self._check(self.lib.mok_stop_rank(self.ctx, self._stream(), note, len(note), origin))

    def trace_view(self) -> torch.Tensor:
        """Diagnostics: ``[kTraceBlocks, 2]`` int64 view of the start/end times (globaltimer ns)
        each block of the latest transfer kernel recorded. Zero it before the kernel to trace."""
        off = self.lib.mok_trace_offset(self.ctx)
        return self.mem.tensor[off: off + 256 * 16].view(torch.int64).view(256, 2)

    def _sync(self) -> None:
        """Wait for this Buffer's kernels: the whole device, or on a loopback group (where
        a device-wide wait could wait for a peer's kernel that waits for this rank) the
        current and side streams."""
        if self.mem is not None and self.mem.loopback:
            torch.cuda.current_stream(self.device).synchronize()
            if getattr(self, "side_stream", None) is not None:
                self.side_stream.synchronize()
        else:
            torch.cuda.synchronize(self.device)

    def check_errors(self) -> None:
        """Synchronise this device and raise if any kernel reported an error."""
        self._alive()
        self._sync()
        self._raise_if_error(self.error_words.cpu().tolist())

    # ---------------------------------------------------------------------------- dispatch
    def dispatch(self, x, topk_idx, topk_weights, rows_per_expert=None, recv_budget=None):
        self._alive()
        x = self._rows(x, "x")  # before the layout publishes anything (a refusal or a copy)
        b = self.buf
        T = x.shape[0]
        stream = self._stream()
        # A receive budget is a static-shape call whose rows past the cap are dropped, not an
        # error (docs/CONTRACT.md, "Receive budget").
        drop = recv_budget is not None
        static_cap = recv_budget if drop else b.max_recv_tokens
        static = static_cap is not None
        fixed = bindings.NO_ROWS_PER_EXPERT if rows_per_expert is None else rows_per_expert
        known_R = None if rows_per_expert is None else b.num_local_experts * rows_per_expert
        ce_side = self.ce_overlap and not self.speculative
        if static and not ce_side and not self.separate_launches:
            return self._dispatch_static(x, T, topk_idx, topk_weights, stream, static_cap, drop,
                                         fixed, known_R)
        ops = self.host_ops
        if ops is not None and not static and not isinstance(x, PairRows) and not self.separate_launches:
            # The eager dispatch's host side in two C++ calls around the read of R (NOTES item 76).
            # (A static call reaches here only on the side-stream schedule: the Python path's.)
            if known_R is not None:
                return self._dispatch_fixed_ops(ops, x, T, topk_idx, topk_weights, stream, fixed, known_R)
            if not (self.speculative or ce_side or self.fill_first or self.stage_first):
                return self._dispatch_eager_ops(ops, x, T, topk_idx, topk_weights, stream)
        scratch = torch.empty(self.scratch_bytes, dtype=torch.uint8, device=x.device)
        # The counts, R (the rows written), then the rows received (a receive budget's flag).
        tpe = torch.empty(b.num_local_experts + 2, dtype=torch.int64, device=x.device)
        idx = topk_idx.contiguous()
        w = topk_weights.contiguous()
        if known_R is not None and not static:
            return self._dispatch_fixed(x, T, idx, w, scratch, tpe, stream, fixed, known_R)
        layout_cap = static_cap if static else (1 << 62)
        if self.speculative and not static:
            return self._dispatch_speculative(x, T, idx, w, scratch, tpe, stream)
        main = torch.cuda.current_stream(self.device)
        if static:
            # (A static dispatch staged beside the layout, MOK_DISPATCH_CE_OVERLAP=1: the transfer
            # waits for the side stream, so its launches stay separate.) Every output's size is
            # known before the layout: allocate now (NOTES (GG)).
            tokens = self._rows_like(x, static_cap)
            probs_all, src_all = self._row_outputs(static_cap, x.device)
        if ce_side:
            self._stage_copy_beside(x, T, main)
        self._layout(stream, scratch, idx, w, T, tpe, layout_cap, -1, not static, fixed, x, drop)
        staged = None
        fill_first = self.fill_first and not static
        if fill_first:
            probs_all, src_all = self._row_outputs(self.rows_bound, x.device)
        if static:
            R, cap = known_R, static_cap
        else:
            # The one host read of an eager dispatch: R (and the error report with it). The
            # host waits for the layout kernels only: the fill (fill-first) or the staging
            # (stage-first) queued behind them keeps the GPU busy meanwhile.
            if self.stage_first:
                staged = self._launch_staging(x, T, scratch, main)
            self._layout_read.record(main)  # the host report is written by the layout's last kernel
            if self.ce_stage and not ce_side:  # after the read's event: copies during the read
                self._stage_copy(x, T, stream)
            if fill_first:
                self._fill(stream, scratch, probs_all, src_all, self.rows_bound, pad=False)
            self._layout_read.synchronize()
            report = self.host_report
            if report[4] not in DATA_ERRORS:  # protocol errors: nothing more to launch
                self._raise_if_error(report[4:])
            R = cap = report[0]
            tokens = self._rows_like(x, cap)
        if fill_first:
            # probs shrunk in place, not sliced: an output that is a view would forbid in-place
            # updates of it downstream (autograd's rule for custom Functions' outputs).
            probs, src_rank, src_token = probs_all.resize_(R), src_all[0, :R], src_all[1, :R]
        else:
            if not static:
                probs_all, src_all = self._row_outputs(cap, x.device)
            probs, src_rank, src_token = probs_all, src_all[0], src_all[1]
        if not (static or fill_first or ce_side or self.stage_first or self.separate_launches):
            # The usual eager dispatch: fill and transfer in one library call (its copy-engine
            # staging, if any, was queued before the read).
            self._launch(bindings.STEP_FILL | bindings.STEP_TRANSFER, stream, scratch, x, T, None,
                         None, None, probs_all, src_all, tokens, cap, self.ce_mode)
        else:
            if not fill_first:
                # Written in full by the fill kernel (padding rows included): no memsets here.
                self._fill(stream, scratch, probs_all, src_all, cap, pad=True)
            if staged is None:
                if ce_side:
                    main.wait_event(self._ce_done)
                self._transfer(x, T, scratch, tokens, cap, staged=ce_side or (self.ce_stage and not static))
            else:
                self._check(self.lib.mok_dispatch_transfer(
                    self.ctx, stream, self._ptr(scratch), self._ptr(x), self._ptr2(x), T, self._ptr(tokens),
                    cap, self.num_blocks - self.dispatch_producers, 0, bindings.TRANSFER_PULL,
                    self._row_bytes(x), self._two(x)))
                # Later work on this stream (an in-place update of x, the next call) comes after
                # the staging.
                main.wait_event(staged)
        if not static and self.host_report[4] in DATA_ERRORS:
            # A bad expert id (dropped like -1) leaves the protocol intact and only this rank
            # knows: its transfer is launched like its peers' (they wait for its staged tokens),
            # then it raises. Raising before the launch would leave the peers to time out.
            self._raise_if_error(self.host_report[4:])
        return tokens, probs, self._handle(T, R, cap, src_rank, src_token, tpe, scratch, drop)

    def _dispatch_static(self, x, T, topk_idx, topk_weights, stream, cap, drop,
                         fixed=bindings.NO_ROWS_PER_EXPERT, known_R=None):
        """A static-shape dispatch (``max_recv_tokens``): every output is allocated first, then
        layout, fill, copy-engine staging and transfer are queued by ONE library call
        (``mok_dispatch_launch``): nothing but that call's own host time between the launches
        (NOTES #51). Reads nothing on the host; graph-capturable. With ``rows_per_expert``
        (``fixed`` >= 0) R = E_local * N is known here (``known_R``). ``cap``: the rows
        (``max_recv_tokens``, or the call's receive budget, ``drop``: rows past it dropped).
        With the C++ host ops (NOTES item 75) the allocations, the views and the library call
        are one C++ call, with the same arguments (an FP8 pair, ``PairRows``: the Python path)."""
        steps = bindings.STEP_LAYOUT | bindings.STEP_FILL | bindings.STEP_TRANSFER
        if self.ce_stage:
            steps |= bindings.STEP_STAGE_COPY
        ops = self.host_ops
        if ops is not None and not isinstance(x, PairRows):
            blocks, producers, _ = self._roles(T)
            rc, tokens, probs, src_rank, src_token, counts, rows_dev, received, scratch = ops.dispatch_static(
                self._launch_addr, self.ctx, stream, steps, self.scratch_bytes, x, topk_idx,
                topk_weights, self.buf.num_experts, self.buf.num_local_experts, cap, blocks, producers,
                self.ce_mode, fixed, drop)
            self._check(rc)
            return tokens, probs, self._handle_of(T, known_R, cap, src_rank, src_token, counts,
                                                  rows_dev, received, scratch)
        scratch = torch.empty(self.scratch_bytes, dtype=torch.uint8, device=x.device)
        tpe = torch.empty(self.buf.num_local_experts + 2, dtype=torch.int64, device=x.device)
        idx, w = topk_idx.contiguous(), topk_weights.contiguous()
        tokens = self._rows_like(x, cap)
        probs, src = self._row_outputs(cap, x.device)
        self._launch(steps, stream, scratch, x, T, idx, w, tpe, probs, src, tokens, cap, self.ce_mode,
                     fixed, drop)
        return tokens, probs, self._handle(T, known_R, cap, src[0], src[1], tpe, scratch, drop)

    def _dispatch_fixed(self, x, T, idx, w, scratch, tpe, stream, n, R):
        """``rows_per_expert`` on an eager Buffer: R = E_local * N is known before the layout, so
        the rows are allocated and every step is queued first (the issue's "allocate, launch,
        then read"); the host then reads the layout's report for errors only, while the fill and
        the transfer run. A data error (a bad expert id, an expert past N) raises after the
        launch, as in the eager dispatch; a protocol error stops the queued kernels on the
        device (they check the error report) and raises here. Under CUDA-graph capture nothing
        is read (no host sync may be captured): errors then surface at ``check_errors`` or at
        the next eager dispatch's read, as in static-shape mode."""
        read = not torch.cuda.is_current_stream_capturing()
        tokens = self._rows_like(x, R)
        probs, src = self._row_outputs(R, x.device)
        self._layout(stream, scratch, idx, w, T, tpe, R, -1, read, n, x)
        if read:
            self._layout_read.record(torch.cuda.current_stream(self.device))
        steps = bindings.STEP_FILL | bindings.STEP_TRANSFER
        if self.ce_stage:
            steps |= bindings.STEP_STAGE_COPY
        self._launch(steps, stream, scratch, x, T, None, None, None, probs, src, tokens, R, self.ce_mode)
        if read:
            self._layout_read.synchronize()
            self._raise_if_error(self.host_report[4:])
        return tokens, probs, self._handle(T, R, R, src[0], src[1], tpe, scratch)

    def _dispatch_eager_ops(self, ops, x, T, topk_idx, topk_weights, stream):
        """The usual eager dispatch (no stage-first, fill-first, speculative or side-stream
        schedule) with the C++ host ops: ``dispatch_layout`` queues the layout (scratch and
        counts allocated in C++), the host reads R as the Python path below does (with the
        copy-engine staging queued meanwhile), then ``dispatch_rows`` allocates the R rows and
        queues fill and transfer. The same library calls, arguments and read as that path."""
        scratch, counts, rows_dev = self._ops_layout(ops, x, topk_idx, topk_weights, stream, 1 << 62, True,
                                                     bindings.NO_ROWS_PER_EXPERT)
        self._layout_read.record(torch.cuda.current_stream(self.device))
        if self.ce_stage:   # after the read's event: copies during the read
            self._stage_copy(x, T, stream)
        self._layout_read.synchronize()
        report = self.host_report
        if report[4] not in DATA_ERRORS:  # protocol errors: nothing more to launch
            self._raise_if_error(report[4:])
        R = report[0]
        tokens, probs, src_rank, src_token = self._ops_rows(
            ops, x, T, stream, bindings.STEP_FILL | bindings.STEP_TRANSFER, scratch, R)
        if report[4] in DATA_ERRORS:   # launched like the peers' (they wait for it), then raise
            self._raise_if_error(report[4:])
        return tokens, probs, self._handle_of(T, R, R, src_rank, src_token, counts, rows_dev, None, scratch)

    def _dispatch_fixed_ops(self, ops, x, T, topk_idx, topk_weights, stream, n, R):
        """:meth:`_dispatch_fixed` (``rows_per_expert`` on an eager Buffer) with the C++ host ops:
        layout, then rows and launch, then the read of the layout's errors only (none under
        CUDA-graph capture), as there."""
        read = not torch.cuda.is_current_stream_capturing()
        scratch, counts, rows_dev = self._ops_layout(ops, x, topk_idx, topk_weights, stream, R, read, n)
        if read:
            self._layout_read.record(torch.cuda.current_stream(self.device))
        steps = bindings.STEP_FILL | bindings.STEP_TRANSFER
        if self.ce_stage:
            steps |= bindings.STEP_STAGE_COPY
        tokens, probs, src_rank, src_token = self._ops_rows(ops, x, T, stream, steps, scratch, R)
        if read:
            self._layout_read.synchronize()
            self._raise_if_error(self.host_report[4:])
        return tokens, probs, self._handle_of(T, R, R, src_rank, src_token, counts, rows_dev, None, scratch)

    def _ops_layout(self, ops, x, topk_idx, topk_weights, stream, cap, report, fixed):
        """The C++ ``dispatch_layout`` (``_layout``'s call, no speculative verdict, no budget):
        ``(scratch, counts, num_rows_device)``."""
        b = self.buf
        rc, scratch, counts, rows_dev = ops.dispatch_layout(
            self._layout_addr, self.ctx, stream, self.scratch_bytes, x, topk_idx, topk_weights,
            b.num_experts, b.num_local_experts, cap, -1, report, fixed)
        self._check(rc)
        return scratch, counts, rows_dev

    def _ops_rows(self, ops, x, T, stream, steps, scratch, R):
        """The C++ ``dispatch_rows``: R rows' outputs and ``steps`` queued, as ``_launch`` without
        routing or counts: ``(tokens, probs, src_rank, src_token)``."""
        blocks, producers, _ = self._roles(T)
        rc, tokens, probs, src_rank, src_token = ops.dispatch_rows(
            self._launch_addr, self.ctx, stream, steps, scratch, x, self.buf.num_experts, R, blocks,
            producers, self.ce_mode, bindings.NO_ROWS_PER_EXPERT, False)
        self._check(rc)
        return tokens, probs, src_rank, src_token

    def _layout(self, stream, scratch, idx, w, T, tpe, cap, spec_cap, report, fixed, x,
                drop=False) -> None:
        """``mok_dispatch_layout`` alone: counts, offsets and each row's source into ``scratch``
        and ``tpe`` for at most ``cap`` rows; ``spec_cap`` >= 0: the speculative verdict against
        that capacity; ``report``: the host report is written (for a read of R or errors);
        ``fixed``: rows_per_expert; ``x``: the rows, whose size and sources (one tensor, or an
        FP8 pair read in place) are published with the routing: every rank checks its peers'
        are the same; ``drop``: rows past ``cap`` are dropped without an error (a receive budget)."""
        self._check(self.lib.mok_dispatch_layout(
            self.ctx, stream, self._ptr(scratch), self._ptr(idx), int(idx.dtype == torch.int64),
            self._ptr(w), T, self.buf.num_experts, self._ptr(tpe), cap, spec_cap, int(report), fixed,
            self._row_bytes(x), self._two(x), int(drop)))

    def _launch(self, steps, stream, scratch, x, T, idx, w, tpe, probs, src, out, cap, mode,
                fixed=bindings.NO_ROWS_PER_EXPERT, drop=False) -> None:
        """``mok_dispatch_launch``: the ``steps`` of a dispatch (layout, fill, copy-engine
        staging, transfer; ``bindings.STEP_*``) queued by one library call. Fill pads rows
        [R, cap); the transfer's blocks come from the call's size (``_roles``); ``fixed``: the
        layout's rows_per_expert."""
        blocks, producers, _ = self._roles(T)
        ptr = self._ptr
        src_rank, src_token = self._row_ptrs(src)
        self._check(self.lib.mok_dispatch_launch(
            self.ctx, stream, steps, scratch.data_ptr(), ptr(idx),
            int(idx is not None and idx.dtype == torch.int64), ptr(w), T, self.buf.num_experts,
            ptr(tpe), src_rank, src_token, ptr(probs), 1, ptr(x), self._ptr2(x), ptr(out), cap, blocks,
            producers, mode, fixed, self._row_bytes(x), self._two(x), int(drop)))

    def _dispatch_speculative(self, x, T, idx, w, scratch, tpe, stream):
        """Eager dispatch in the issue's order: allocate, launch, then read R.

        The token rows are allocated for a capacity guessed from this rank's recent R (published
        with the routing), and layout, fill and transfer are all queued before the host waits,
        for the layout only. The transfer skips rows past the capacity. Every rank computes
        every rank's R from the published routing, so all reach the same verdict: if any rank's
        R exceeded its capacity, every rank runs the transfer again into exact rows (the ring
        protocol needs the same calls on every rank); otherwise the rows are shrunk to R while
        the transfer may still be running.
        """
        cap = self._spec_capacity()
        tokens = self._rows_like(x, cap)
        probs_all, src_all = self._row_outputs(self.rows_bound, x.device)
        self._layout(stream, scratch, idx, w, T, tpe, 1 << 62, cap, True, bindings.NO_ROWS_PER_EXPERT, x)
        main = torch.cuda.current_stream(self.device)
        self._layout_read.record(main)
        self._fill(stream, scratch, probs_all, src_all, self.rows_bound, pad=False)
        self._transfer(x, T, scratch, tokens, cap, pad=False)
        self._layout_read.synchronize()
        report = self.host_report
        bad_ids = report[4] == BAD_EXPERT  # only this rank knows: finish the call first
        if not bad_ids:
            self._raise_if_error(self.host_report[4:])
        R, short = report[0], report[2] != 0
        self._spec_recent = (self._spec_recent + [R])[-SPEC_HISTORY:]
        if short:
            self.spec_fallbacks += 1
            tokens = self._rows_like(x, R)
            self._transfer(x, T, scratch, tokens, R)
        else:
            tokens = tokens.resize_(R, x.shape[1])  # in place: outputs must not be views
        if bad_ids:  # the peers' redo (if any) is matched by this rank's: now raise
            self._raise_if_error(self.host_report[4:])
        handle = self._handle(T, R, R, src_all[0, :R], src_all[1, :R], tpe, scratch)
        return tokens, probs_all.resize_(R), handle

    def _handle(self, T, R, cap, src_rank, src_token, tpe, scratch, budget=False) -> DispatchHandle:
        """The handle of a dispatch of T tokens into ``cap`` rows (``R`` of them real, ``None``
        in static-shape mode): ``tpe`` holds the counts, R (the rows written), then the rows
        received, on the device. ``budget``: ``cap`` is the call's receive budget, whose
        over-budget flag is computed on the device (one small kernel, no host read)."""
        E = self.buf.num_local_experts
        return self._handle_of(T, R, cap, src_rank, src_token, tpe[:E], tpe[E:E + 1],
                               tpe[E + 1:E + 2] if budget else None, scratch)

    def _handle_of(self, T, R, cap, src_rank, src_token, counts, rows_dev, received, scratch):
        """:meth:`_handle` from the views of ``tpe``: ``counts`` [E_local], ``rows_dev`` (R) [1],
        ``received`` [1] (None without a receive budget)."""
        return DispatchHandle(
            buffer_id=self.buf.serial, backend=self.name, num_tokens=T, num_rows=R,
            num_out_rows=cap, src_rank=src_rank, src_token=src_token,
            tokens_per_expert=counts, num_rows_device=rows_dev,
            state=CudaLayout(scratch=scratch),
            over_budget=None if received is None else received > cap, rows_received=received)

    def _spec_capacity(self) -> int:
        """Rows to allocate before R is known: SPEC_MARGIN over the largest recent R plus one
        chunk, within the bound; 0 before the first call (which then always redoes the transfer)."""
        if not self._spec_recent:
            return 0
        guess = int(max(self._spec_recent) * SPEC_MARGIN) + self.chunk_tokens
        return min(guess, self.rows_bound)

    @staticmethod
    def _rows_like(x, rows: int):
        """``[rows, x.shape[1]]`` rows of ``x``'s dtype: token rows in the Buffer's dtype, or the
        FP8 dispatch's packed byte rows (``megatron_mok/fp8.py``); dispatch moves rows as bytes."""
        return torch.empty(rows, x.shape[1], dtype=x.dtype, device=x.device)

    @staticmethod
    def _row_bytes(x) -> int:
        """Bytes of one row of ``x`` (the library's ``row_bytes``)."""
        return x.shape[1] * x.element_size()

    # A dispatch's rows ``x``: a tensor, or an FP8 pair read in place (``fp8.PairRows``: the
    # library's two_sources, its second pointer the scale rows').
    @staticmethod
    def _two(x) -> int:
        return int(isinstance(x, PairRows))

    @staticmethod
    def _ptr2(x) -> int:
        return x.second_ptr() if isinstance(x, PairRows) and x.numel() else 0

    @staticmethod
    def _tensors(x):
        """The tensors holding ``x``'s rows (to keep alive for a side stream)."""
        return x.tensors() if isinstance(x, PairRows) else (x,)

    @staticmethod
    def _row_outputs(rows: int, device):
        """probs [rows] float32 and (src_rank, src_token) [2, rows] int64."""
        return (torch.empty(rows, dtype=torch.float32, device=device),
                torch.empty(2, rows, dtype=torch.int64, device=device))

    def _fill(self, stream, scratch, probs, src, cap: int, pad: bool) -> None:
        self._check(self.lib.mok_dispatch_fill(
            self.ctx, stream, self._ptr(scratch), self._ptr(src[0]), self._ptr(src[1]),
            self._ptr(probs), cap, int(pad)))

    def _transfer(self, x, T, scratch, out, cap, pad: bool = True, staged: bool = False):
        """Both halves of the transfer as one kernel, by its own library call: the schedules that
        launch their steps one call each (fill-first, side-stream staging, ``separate_launches``,
        speculative). A cached dispatch queues its transfer by ``_launch`` instead.
        ``pad=False``: rows [R, cap) are left unwritten (mode flag 4). With copy-engine staging
        the copy goes first on the stream (mode flag 8), unless the caller queued it already
        (``staged``)."""
        stream = self._stream()
        mode = (bindings.TRANSFER_BOTH if pad else bindings.TRANSFER_NO_PAD) | self.ce_mode
        if self.ce_stage and not staged:
            self._stage_copy(x, T, stream)
        blocks, producers, _ = self._roles(T)
        self._check(self.lib.mok_dispatch_transfer(
            self.ctx, stream, self._ptr(scratch), self._ptr(x), self._ptr2(x), T,
            self._ptr(out), cap, blocks, producers, mode, self._row_bytes(x), self._two(x)))

    def _roles(self, T: int):
        """(blocks, dispatch producers, combine producers) of a transfer kernel for a call
        with T tokens on this rank: the small-call SM budget (MOK_SMALL_CALL_SMS) or num_sms."""
        if T <= self.small_call_tokens:
            return self.small_roles
        return self.num_blocks, self.dispatch_producers, self.combine_producers

    def _stage_copy(self, x, T, stream) -> None:
        """Copy-engine staging: a one-block kernel checks my ring slots are free, then the copy
        engine copies x into them (no SM time); the transfer kernel after it publishes them.
        A world of one rank has no readers: nothing to copy (every block still pulls)."""
        if self.buf.world_size == 1:
            return
        self._check(self.lib.mok_dispatch_stage_copy(self.ctx, stream, self._ptr(x), self._ptr2(x), T,
                                                     self._row_bytes(x), self._two(x)))

    def _on_side_stream(self, main, fork, done, launch, *tensors) -> torch.cuda.Event:
        """Run ``launch()`` on the side stream after the work queued on ``main`` so far (event
        ``fork``); return ``done``, recorded on the side stream after it, for ``main`` to wait on.
        The caching allocator must not hand ``tensors`` to other work before the side stream is
        done with them (not needed, nor allowed, while a CUDA graph is captured: a fork and a
        join of the capturing stream)."""
        side = self.side_stream
        fork.record(main)
        side.wait_event(fork)
        launch()
        if not torch.cuda.is_current_stream_capturing():
            for t in tensors:
                t.record_stream(side)
        done.record(side)
        return done

    def _stage_copy_beside(self, x, T, main) -> None:
        """The copy-engine staging on the side stream, forked from ``main`` where the dispatch
        starts, so the copy (and its slot check) runs beside the layout kernels; the transfer
        waits for ``_ce_done``."""
        self._on_side_stream(main, self._ce_fork, self._ce_done,
                             lambda: self._stage_copy(x, T, self._side_raw), *self._tensors(x))

    def _launch_staging(self, x, T, scratch, main) -> torch.cuda.Event:
        """The staging half of an eager dispatch on the side stream, after the layout kernels
        queued on ``main``; returns the event that marks its end. Its blocks and the pulling
        kernel's add up to ``num_sms``."""
        return self._on_side_stream(main, self._layout_done, self._staged, lambda: self._check(
            self.lib.mok_dispatch_transfer(self.ctx, self._side_raw, self._ptr(scratch), self._ptr(x),
                                           self._ptr2(x), T, ctypes.c_void_p(0), 0, self.dispatch_producers, 0,
                                           bindings.TRANSFER_STAGE, self._row_bytes(x), self._two(x))),
            *self._tensors(x), scratch)

    def dispatch_cached(self, x, handle: DispatchHandle):
        """``x [T, H]`` -> rows ``[num_out_rows, H]`` along ``handle`` (the combine's backward):
        the transfer, after the copy-engine staging when on, queued by one library call on the
        handle's layout (its rows past R padded with zeros, as the forward's). With the C++ host
        ops (NOTES item 77) the allocation and the call are one C++ call with the same arguments
        (an FP8 pair, ``PairRows``: the Python path)."""
        self._alive()
        x = self._rows(x, "x")
        T, cap, scratch = handle.num_tokens, handle.num_out_rows, handle.state.scratch
        steps = bindings.STEP_TRANSFER | (bindings.STEP_STAGE_COPY if self.ce_stage else 0)
        ops = self.host_ops
        if ops is not None and not isinstance(x, PairRows):
            blocks, producers, _ = self._roles(T)
            rc, out = ops.dispatch_cached(self._launch_addr, self.ctx, self._stream(), steps, scratch, x, T,
                                          self.buf.num_experts, cap, blocks, producers, self.ce_mode,
                                          bindings.NO_ROWS_PER_EXPERT)
            self._check(rc)
            return out
        out = self._rows_like(x, cap)
        self._launch(steps, self._stream(), scratch, x, T, None, None, None, None, None, out, cap, self.ce_mode)
        return out

    # ----------------------------------------------------------------------------- combine
    def combine(self, expert_out, handle: DispatchHandle, grad_probs=None):
        self._alive()
        expert_out = self._rows(expert_out, "expert_out")  # the library does not check its alignment
        b = self.buf
        T = handle.num_tokens
        ops = self.host_ops
        if ops is not None:
            # One C++ call allocates y (and grad_w), converts grad_probs as below and calls
            # mok_combine with the arguments below (NOTES items 75, 77).
            blocks, _, producers = self._roles(T)
            rc, y, grad_w = ops.combine(self._combine_addr, self.ctx, self._stream(), self._ptr(handle.state.scratch),
                                        expert_out, T, b.dtype, handle.num_out_rows, DTYPE_CODES[b.dtype],
                                        DTYPE_CODES[b.combine_partial_dtype], blocks, producers, grad_probs,
                                        b.topk)
            self._check(rc)
            return y, grad_w
        y = torch.empty(T, expert_out.shape[1], dtype=b.dtype, device=expert_out.device)
        grad_w = None
        if grad_probs is not None:
            grad_w = torch.empty(T, b.topk, dtype=torch.float32, device=expert_out.device)
            grad_probs = grad_probs.float().contiguous()
            if grad_probs.numel() == 0:
                # No rows here (a receive budget of 0 on a rank that received rows): the kernels
                # read none, but a null pointer means "no prob gradients", and then this rank's
                # side values, which its peers sum into their grad_topk_weights, would never be
                # written: they would read a ring slot's stale values (fuzzer, run s36-2).
                grad_probs = torch.zeros(1, dtype=torch.float32, device=expert_out.device)
        # expert_out's width: the Buffer's hidden, or PROB_GRAD_HIDDEN (combine_prob_grads).
        self._check(self.lib.mok_combine(
            self.ctx, self._stream(), self._ptr(handle.state.scratch), self._ptr(expert_out),
            self._ptr(grad_probs), T, self._ptr(y), self._ptr(grad_w),
            handle.num_out_rows, DTYPE_CODES[b.dtype], DTYPE_CODES[b.combine_partial_dtype],
            *self._roles(T)[::2], expert_out.shape[1]))
        return y, grad_w

    def combine_prob_grads(self, handle: DispatchHandle, grad_probs):
        """``grad_topk_weights [T, K]`` float32 from ``grad_probs [R]``, with no row gradients
        (the FP8 dispatch's backward: its tokens have none). One combine of rows
        ``PROB_GRAD_HIDDEN`` elements wide: the prob gradients travel as the partials' side
        values, as in a full combine, and the rows (zeros) cost next to nothing. The kernel gives
        such narrow calls a lane per task and per token (``MOK_COMBINE_NARROW=0``: a warp; one
        H200, 4096 tokens: 13.6 vs 83.8 us, run s25-3)."""
        self._alive()
        rows = torch.zeros(handle.num_out_rows, PROB_GRAD_HIDDEN, dtype=self.buf.dtype,
                           device=grad_probs.device)
        return self.combine(rows, handle, grad_probs=grad_probs)[1]

    def destroy(self):
        # First: if a step below raises (a device error in the sync), what is freed stays unused.
        self.destroyed = True
        if getattr(self, "mem", None) is not None:
            self._sync()
            self.mem.free()
            self.mem = None
        if getattr(self, "_own_side", None) is not None:
            self._own_side.close()
            self._own_side = None
        if getattr(self, "ctx", None):
            self.lib.mok_destroy(self.ctx)
            self.ctx = None

"""Host-side input checks of the CUDA path that run without a GPU: which GPU a Buffer works on,
16-byte alignment of the rows the kernels read, and ``num_sms``.

The CUDA backend's own code runs here on fake objects: tensors of ``FakeTensorMode`` (a device
such as ``cuda:1`` with no GPU behind it), and a :class:`CudaBackend` made without its
``__init__`` whose library records its calls instead of launching. The same behaviour on real
GPUs: ``tests/test_cuda_backend.py`` (``test_cuda_tensors_on_another_gpu_are_refused``,
``test_cuda_misaligned_rows_are_copied``).
"""

import ctypes

import pytest
import torch

from harness import small_buffer
from megatron_mok import buffer as buffer_mod
from megatron_mok.cuda import backend as cuda_backend
from megatron_mok.cuda import library

E, H, K, T_MAX = 4, 16, 2, 8


make_buf = small_buffer  # bfloat16, E=4, H=16, K=2, T_max=8 (the constants above)


def fake_inputs(device, T=5):
    """``(x, topk_idx, topk_weights)`` as fake tensors on ``device`` (no memory, no GPU)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        return (torch.empty(T, H, dtype=torch.bfloat16, device=device),
                torch.zeros(T, K, dtype=torch.int64, device=device),
                torch.empty(T, K, dtype=torch.float32, device=device))


# These tests stand in for a second GPU with fake tensors and monkeypatched device queries, so
# they run where no GPU is (CI). On a machine with exactly one GPU torch checks a fake cuda:1
# tensor's ordinal against the real device count and refuses it ("invalid device ordinal",
# s33-2), and the backend's real GPU calls no longer stop where the test expects: there the
# real check runs in tests/test_cuda_backend.py (its two-GPU test).
no_gpu_or_two = pytest.mark.skipif(
    torch.cuda.is_available() and torch.cuda.device_count() < 2,
    reason="fake-tensor stand-in for a second GPU: runs with no GPU (CI) or with 2+ GPUs")


def cuda(i):
    return torch.device("cuda", i)


# --------------------------------------------------------------------- which GPU (item 4)
@no_gpu_or_two
def test_unindexed_cuda_device_is_fixed_to_the_current_device_at_first_use(monkeypatch):
    """``device="cuda"`` (no index) once accepted tensors on any GPU; it now means the current
    device when the Buffer is first used, and stays that device."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    buf = make_buf(device="cuda")
    assert buf.device == torch.device("cuda")          # not resolved before its first use
    with pytest.raises(ValueError, match=r"x is on cuda:1, but this Buffer works on cuda:0"):
        buf.dispatch(*fake_inputs(cuda(1)))
    assert buf.device == cuda(0)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)   # a later set_device: still cuda:0
    with pytest.raises(ValueError, match=r"x is on cuda:1, but this Buffer works on cuda:0"):
        buf.dispatch(*fake_inputs(cuda(1)))
    # a CPU tensor is refused without asking CUDA anything
    cpu_buf = make_buf(device="cuda")
    with pytest.raises(ValueError, match=r"x is on cpu, but this Buffer works on cuda"):
        cpu_buf.dispatch(*fake_inputs("cpu"))


def test_unindexed_cuda_device_resolution(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    for given in (None, "cuda", torch.device("cuda")):
        buf = make_buf(device=given)
        assert buf._cuda_device() == cuda(3) and buf.device == cuda(3)
    assert make_buf(device="cuda:1")._cuda_device() == cuda(1)
    with pytest.raises(ValueError, match=r"backend='cuda' needs a CUDA device, but this Buffer works on cpu"):
        make_buf(device="cpu")._cuda_device()


class _Stop(Exception):
    pass


class _RecordingBackend:
    """Stands in for CudaBackend: records the Buffer's device when it is made, stops a call."""

    name = "cuda"
    made_on = []

    def __init__(self, buf):
        self.made_on.append(buf.device)

    def dispatch(self, *args):
        raise _Stop()


@no_gpu_or_two
def test_auto_backend_is_made_on_the_first_tensors_gpu(monkeypatch):
    """``backend="auto"``, no device: the CUDA backend was made (on the current device) before
    the first tensor's device was recorded, so a Buffer first used with tensors on cuda:1 while
    cuda:0 was current put its workspace on cuda:0 and accepted cuda:1 tensors."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(buffer_mod, "available_backends", lambda device=None: ["reference", "cuda"])
    monkeypatch.setattr(cuda_backend, "CudaBackend", _RecordingBackend)
    _RecordingBackend.made_on = []
    buf = make_buf(backend="auto")
    with pytest.raises(_Stop):
        buf.dispatch(*fake_inputs(cuda(1)))
    assert _RecordingBackend.made_on == [cuda(1)], _RecordingBackend.made_on
    with pytest.raises(ValueError, match=r"x is on cuda:0, but this Buffer works on cuda:1"):
        buf.dispatch(*fake_inputs(cuda(0)))
    # device="cuda": the current device, whatever the first tensor's
    _RecordingBackend.made_on = []
    buf = make_buf(backend="auto", device="cuda")
    with pytest.raises(ValueError, match=r"x is on cuda:1, but this Buffer works on cuda:0"):
        buf.dispatch(*fake_inputs(cuda(1)))
    assert _RecordingBackend.made_on == [], "a backend was made for a refused tensor"


@pytest.mark.skipif(not library.is_available(), reason="libmok_cuda.so not built")
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks where the backend stops without a GPU")
def test_cuda_backend_fixes_the_buffers_device_when_made(monkeypatch):
    """``backend="cuda"`` with no device makes its workspace on the current GPU when the Buffer
    is made; the Buffer's device must then be that GPU (it stayed ``None``, and the first
    tensor's GPU, whichever it was, became the Buffer's while the workspace stayed put). The
    real ``CudaBackend.__init__`` runs until it needs a GPU (pinned memory)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(library, "kernel_arch", lambda index: (90, None))   # a Hopper GPU
    buf = make_buf()
    buf.requested_backend = "cuda"
    with pytest.raises(RuntimeError, match=r"(?i)pin"):   # no GPU here: stops at the pinned report
        buf._get_backend("cuda")
    assert buf.device == cuda(1)


def _bare_backend(device, buf=None):
    """A CudaBackend without ``__init__``: the attributes a static-shape dispatch, a cached
    dispatch and a combine read, and a library that records each call's row pointers (and the
    bytes there, read while the call's tensors are alive)."""
    b = object.__new__(cuda_backend.CudaBackend)
    b.buf = buf if buf is not None else make_buf(max_recv_tokens=64)
    b.device = torch.device(device)
    b.broken = None
    b.misaligned_copies = 0
    b.scratch_bytes = 64
    b.speculative = b.ce_overlap = b.separate_launches = b.ce_stage = b.stage_first = False
    b.fill_first = False
    b.ce_mode = 0
    b.small_call_tokens = -1
    b.num_blocks, b.dispatch_producers, b.combine_producers = 4, 1, 2
    b.ctx = 1
    b._stream = lambda: 0
    b.calls = []

    class Lib:
        def __getattr__(self, name):
            raise AssertionError(f"library call {name} (nothing may be launched)")

    class RecordingLib:
        def __init__(self, nbytes):
            self.nbytes = nbytes

        def _rows(self, name, ptr):
            data = bytes((ctypes.c_uint8 * self.nbytes).from_address(ptr)) if ptr else b""
            b.calls.append((name, ptr, data))
            return 0

        def mok_dispatch_launch(self, *a):        # x is argument 14
            return self._rows("mok_dispatch_launch", a[14])

        def mok_combine(self, *a):                # expert_out is argument 3
            return self._rows("mok_combine", a[3])

    b.lib = Lib()
    b.recording = RecordingLib
    return b


@no_gpu_or_two
def test_cuda_backend_refuses_tensors_on_another_gpu_before_any_launch():
    """The backend's own guard (every entry point: dispatch, cached dispatch, combine), before
    anything is allocated or launched on the tensors' device."""
    b = _bare_backend("cuda:0")
    x, idx, w = fake_inputs(cuda(1))
    with pytest.raises(ValueError, match=r"x is on cuda:1, but this Buffer's CUDA workspace is on cuda:0"):
        b.dispatch(x, idx, w)
    with pytest.raises(ValueError, match=r"x is on cuda:1, but this Buffer's CUDA workspace is on cuda:0"):
        b.dispatch_cached(x, None)
    with pytest.raises(ValueError, match=r"expert_out is on cuda:1, but this Buffer's CUDA workspace is on cuda:0"):
        b.combine(x, None)


# ----------------------------------------------------------- 16-byte alignment (item 5)
def _misaligned(t: torch.Tensor, offset_elems: int = 1) -> torch.Tensor:
    """A contiguous view of ``t``'s values at ``offset_elems`` elements into a larger storage."""
    big = torch.zeros(t.numel() + offset_elems, dtype=t.dtype)
    view = big[offset_elems:].view(t.shape)
    view.copy_(t)
    return view


@pytest.mark.parametrize("offset", (1, 3, 4))
def test_misaligned_rows_are_copied_before_the_library_sees_them(offset):
    """``x`` (dispatch, cached dispatch) and ``expert_out`` (combine) at an address that is not
    a multiple of 16 bytes (bf16: an offset of 1 to 7 elements). The library's kernels move
    16-byte vectors: the library refused such an ``x`` only at its transfer step, after the
    layout had published the routing (peers then time out), and did not check ``expert_out``
    at all (a misaligned vector load ends the CUDA context). The backend now hands the library
    an aligned copy, the same bytes, before its first call."""
    T = 5
    x0 = torch.randn(T, H).to(torch.bfloat16)
    xm = _misaligned(x0, offset)
    assert xm.is_contiguous() and xm.data_ptr() % 16 != 0
    idx = torch.randint(0, E, (T, K))
    w = torch.rand(T, K)

    b = _bare_backend("cpu")
    b.lib = b.recording(T * H * 2)
    _, _, handle = b.dispatch(xm, idx, w)                     # static shape: one library call
    b.dispatch_cached(xm, handle)
    b.combine(xm, handle)
    names = [c[0] for c in b.calls]
    assert names == ["mok_dispatch_launch", "mok_dispatch_launch", "mok_combine"], names
    for name, ptr, data in b.calls:
        assert ptr % 16 == 0, f"{name} got a pointer {ptr % 16} bytes past a 16-byte boundary"
        assert data == x0.view(torch.uint8).numpy().tobytes(), f"{name}: not the rows' bytes"
    assert b.misaligned_copies == 3

    # aligned rows go through as they are: no copy
    b.calls, b.misaligned_copies = [], 0
    xa = x0.clone()
    b.dispatch(xa, idx, w)
    assert b.calls[0][1] == xa.data_ptr() and b.misaligned_copies == 0


def test_aligned_rows_helper():
    x = torch.randn(4, 8).to(torch.bfloat16)
    assert cuda_backend.aligned_rows(x) is x
    rows = x[1:]                                       # whole rows of 16 bytes: still aligned
    assert rows.data_ptr() % 16 == 0 and cuda_backend.aligned_rows(rows) is rows
    m = _misaligned(x)
    c = cuda_backend.aligned_rows(m)
    assert c is not m and c.data_ptr() % 16 == 0 and torch.equal(c, m) and c.is_contiguous()
    empty = torch.zeros(9, dtype=torch.bfloat16)[1:1].view(0, 8)   # no rows: nothing to read
    assert cuda_backend.aligned_rows(empty) is empty


@pytest.mark.skipif(not library.is_available(), reason="libmok_cuda.so not built")
def test_hidden_whose_rows_are_not_16_byte_multiples_is_refused_when_the_backend_is_made(monkeypatch):
    """Rows must be 16-byte multiples too: the CUDA backend refuses ``hidden % 8 != 0`` (every
    token dtype has at least 2 bytes, so ``H % 8 == 0`` makes rows of 16-byte multiples) when
    it is made, before any allocation or communication: at ``Buffer(backend="cuda")``, or at
    the first CUDA call of an ``auto`` Buffer."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for hidden in (4, 12, 60, 100):
        with pytest.raises(ValueError, match=rf"hidden % 8 == 0, got hidden={hidden}"):
            make_buf(hidden=hidden, backend="cuda")


# --------------------------------------------------------------------------------- num_sms
@pytest.mark.parametrize("bad", (0, -1, -24, True, False, 1.5, 24.0, "24"))
def test_num_sms_must_be_none_or_a_positive_int(bad):
    """``num_sms=0`` was silently the default (``num_sms or 24``); a negative number became 2
    SMs and ``True`` one. All are refused when the Buffer is made, on every backend."""
    for backend in ("reference", "auto"):
        with pytest.raises(ValueError, match=r"num_sms must be None or an int >= 1"):
            make_buf(num_sms=bad, backend=backend)


@pytest.mark.parametrize("good", (None, 1, 2, 24, 132))
def test_num_sms_accepted(good):
    assert make_buf(num_sms=good).num_sms == good

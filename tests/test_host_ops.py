"""The C++ host ops (``csrc/host_ops/host_ops.cpp``, ``megatron_mok/cuda/host_ops.py``; NOTES
item 75) against the Python path they replace, on CPU (no GPU, no CUDA library).

A :class:`CudaBackend` made without ``__init__`` gets a stand-in library whose
``mok_dispatch_launch`` and ``mok_combine`` are ctypes callbacks: the Python path calls them
through ctypes, the C++ op through their addresses, exactly as it calls the real library's.
The stand-in records every argument and writes outputs computed from the inputs through the
pointers it is given (counts, R, each row's source and prob, the rows themselves), so the two
paths must agree argument for argument (each pointer the data of the output or input it
names) and bitwise in what they return: shapes, dtypes, strides, which views share a tensor,
and the bytes. The real library on a GPU: ``tests/test_cuda_loopback.py``
(``test_cuda_host_ops_are_the_python_path_bitwise``).
"""

import ctypes
import os
import warnings
from types import SimpleNamespace

import pytest
import torch

from harness import small_buffer
from megatron_mok.cuda import backend as cuda_backend
from megatron_mok.cuda import bindings, host_ops

E, H, K, T_MAX = 4, 16, 2, 8
SCRATCH_BYTES = 96

P, I32, I64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
# mok_api.h's signatures (a different one would fail the argument comparison below).
LAUNCH_T = ctypes.CFUNCTYPE(I32, P, P, I32, P, P, I32, P, I32, I32, P, P, P, P, I32, P, P, P, I64,
                            I32, I32, I32, I64, I32, I32, I32)
COMBINE_T = ctypes.CFUNCTYPE(I32, P, P, P, P, P, I32, P, P, I64, I32, I32, I32, I32, I32)
LAYOUT_T = ctypes.CFUNCTYPE(I32, P, P, P, P, I32, P, I32, I32, P, I64, I64, I32, I64, I32, I32, I32)
# Argument positions that are pointers (compared by what they point to, not by value).
LAUNCH_PTRS = {3: "scratch", 4: "idx", 6: "w", 9: "tpe", 10: "src_rank", 11: "src_token",
               12: "probs", 14: "x", 15: "x2", 16: "out"}
COMBINE_PTRS = {2: "scratch", 3: "expert_out", 4: "grad_probs", 6: "y", 7: "grad_w"}
LAYOUT_PTRS = {2: "scratch", 3: "idx", 5: "w", 8: "tpe"}


@pytest.fixture(scope="module")
def ops():
    """The extension for this torch, built here if missing or older than its sources (a compile
    error fails the test: CI must not land a broken source); skipped only where no C++
    compiler exists."""
    if host_ops.build(verbose=False, force=False) is None:
        pytest.skip("the C++ host ops cannot be built here (no C++ compiler or torch headers)")
    module = host_ops._import(host_ops.module_path())
    assert module.abi_version == bindings.ABI_VERSION, "rebuild: python -m megatron_mok.cuda.host_ops"
    return module


def _read(ptr, n, ctype):
    return list((ctype * n).from_address(ptr)) if ptr and n else []


class StandInLibrary:
    """``mok_dispatch_launch`` / ``mok_combine`` as ctypes callbacks that record their arguments
    and write outputs that depend on every input they read, so a wrong pointer, size or view
    shows in the results."""

    def __init__(self, num_local_experts, rc=0, report_error=0):
        self.E, self.rc, self.calls = num_local_experts, rc, []
        self.report_error = report_error     # the error code an eager layout reports
        self.report = [0] * 12               # the host report (the backend's host_report)
        self.mok_dispatch_launch = LAUNCH_T(self._launch)
        self.mok_dispatch_layout = LAYOUT_T(self._layout)
        self.mok_combine = COMBINE_T(self._combine)

    def mok_last_error(self):
        return b"stand-in library error"

    def _launch(self, ctx, stream, steps, scratch, idx, idx64, w, T, num_experts, tpe, src_rank,
                src_token, probs, pad, x, x2, out, cap, blocks, producers, mode, fixed, row_bytes,
                two, drop):
        self.calls.append(("launch", [ctx, stream, steps, scratch, idx, idx64, w, T, num_experts, tpe,
                                      src_rank, src_token, probs, pad, x, x2, out, cap, blocks, producers,
                                      mode, fixed, row_bytes, two, drop]))
        ids = _read(idx, T * K, ctypes.c_int64 if idx64 else ctypes.c_int32)
        weights = _read(w, T * K, ctypes.c_float)
        # (an FP8 pair's rows lie in two tensors: not read here)
        rows = bytes((ctypes.c_uint8 * (T * row_bytes)).from_address(x)) if x and T and not two else bytes(T * row_bytes)
        counts = [sum(1 for e in ids if e == j) for j in range(self.E)]
        R = sum(counts)
        if tpe:   # with the layout step: counts and all of the scratch written (compared)
            totals = (ctypes.c_int64 * (self.E + 2)).from_address(tpe)
            totals[:] = counts + [R, R + steps + 1000 * drop]
            ctypes.memset(scratch, (steps * 7 + mode) % 251, SCRATCH_BYTES)
        else:     # an eager call's fill and transfer: its layout wrote them; the scratch is read
            scratch_bytes = (ctypes.c_uint8 * SCRATCH_BYTES).from_address(scratch)
            scratch_bytes[:] = [(v + steps * 7 + mode) % 251 for v in scratch_bytes]
        for r in range(cap):
            if src_rank:     # (a cached dispatch has no per-row outputs)
                (ctypes.c_int64).from_address(src_rank + 8 * r).value = r % 3 - 1
                (ctypes.c_int64).from_address(src_token + 8 * r).value = ids[r % len(ids)] if ids else -1
                (ctypes.c_float).from_address(probs + 4 * r).value = weights[r % len(weights)] if weights else 0.0
            row = rows[(r % T) * row_bytes:(r % T + 1) * row_bytes] if T else bytes([r % 256]) * row_bytes
            ctypes.memmove(out + r * row_bytes, row, row_bytes)
        return self.rc

    def _layout(self, ctx, stream, scratch, idx, idx64, w, T, num_experts, tpe, cap, spec_cap, report,
                fixed, row_bytes, two, drop):
        self.calls.append(("layout", [ctx, stream, scratch, idx, idx64, w, T, num_experts, tpe, cap,
                                      spec_cap, report, fixed, row_bytes, two, drop]))
        ids = _read(idx, T * K, ctypes.c_int64 if idx64 else ctypes.c_int32)
        weights = _read(w, T * K, ctypes.c_float)
        counts = [sum(1 for e in ids if e == j) for j in range(self.E)]
        R = self.E * fixed if fixed >= 0 else sum(counts)
        totals = (ctypes.c_int64 * (self.E + 2)).from_address(tpe)
        totals[:] = counts + [R, int(sum(weights) * 1000) % 997]
        ctypes.memset(scratch, (T * 5 + R) % 251, SCRATCH_BYTES)
        if report:
            self.report[0], self.report[4] = R, self.report_error
        return self.rc

    def _combine(self, ctx, stream, scratch, expert_out, grad_probs, T, y, grad_w, cap, dtype_code,
                 partial_code, blocks, producers, hidden):
        self.calls.append(("combine", [ctx, stream, scratch, expert_out, grad_probs, T, y, grad_w, cap,
                                       dtype_code, partial_code, blocks, producers, hidden]))
        elem = {0: 2, 1: 2, 2: 4}[dtype_code]
        mark = (ctypes.c_uint8 * 16).from_address(scratch)[0] if scratch else 0
        src = bytes((ctypes.c_uint8 * (cap * hidden * elem)).from_address(expert_out)) if expert_out and cap else b""
        for t in range(T):
            row = src[(t % cap) * hidden * elem:(t % cap + 1) * hidden * elem] if cap else bytes(hidden * elem)
            ctypes.memmove(y + t * hidden * elem, bytes((b + mark) % 256 for b in row), hidden * elem)
        if grad_w:   # each (token, k) from the prob gradients (R of them; one zero for none)
            probs = _read(grad_probs, max(cap, 1), ctypes.c_float)
            for i in range(T * K):
                ctypes.c_float.from_address(grad_w + 4 * i).value = probs[(i * 7) % len(probs)] + i + mark
        return self.rc


def bare_backend(buf, lib, ops_module, ce_stage=False, small=False):
    """A CudaBackend without ``__init__``: what a static dispatch and a combine read."""
    b = object.__new__(cuda_backend.CudaBackend)
    b.buf, b.lib, b.device = buf, lib, torch.device("cpu")
    b.broken, b.misaligned_copies, b.scratch_bytes, b.ctx = None, 0, SCRATCH_BYTES, 0x5eed
    b.speculative = b.ce_overlap = b.separate_launches = b.stage_first = b.fill_first = False
    b.ce_stage = ce_stage
    b.ce_mode = bindings.TRANSFER_CE_STAGED if ce_stage else bindings.TRANSFER_BOTH
    b.num_blocks, b.dispatch_producers, b.combine_producers = 24, 4, 11
    b.small_call_tokens, b.small_roles = (64, (6, 1, 2)) if small else (-1, None)
    b._stream = lambda: 0xabc0
    b.host_report, b.timeout_s = lib.report, 60.0
    b._stop_rank = lambda *a, **k: None
    b._layout_read = SimpleNamespace(record=lambda stream: None, synchronize=lambda: None)
    b._layout_addr = ctypes.cast(lib.mok_dispatch_layout, ctypes.c_void_p).value
    b.host_ops = ops_module
    b._launch_addr = ctypes.cast(lib.mok_dispatch_launch, ctypes.c_void_p).value
    b._combine_addr = ctypes.cast(lib.mok_combine, ctypes.c_void_p).value
    return b


def _pointer_targets(args, names, tensors):
    """Each pointer argument as the name of the tensor whose data it is (``None``: null; "other":
    none of ``tensors``, e.g. a contiguous copy), so two calls with different allocations compare."""
    by_ptr = {t.data_ptr(): n for n, t in tensors.items() if t is not None and t.numel()}
    return {names[i]: (None if not args[i] else by_ptr.get(args[i], "other")) for i in names}


def _inputs(T, idx_dtype, x_dtype, contiguous, seed):
    """``(x, topk_idx, topk_weights)`` of T tokens, unrouted (-1) slots included."""
    g = torch.Generator().manual_seed(seed)
    width = H if x_dtype != torch.uint8 else 48     # packed FP8 rows: a plain uint8 tensor
    x = (torch.randn(T, width, generator=g) * 4).to(x_dtype)
    idx = torch.randint(-1, E, (T, K), generator=g).to(idx_dtype)
    w = torch.rand(T, K, generator=g)
    if not contiguous:    # the same values, column-major: both paths pass a contiguous copy
        idx, w = idx.t().contiguous().t(), w.t().contiguous().t()
    return x, idx, w


def _dispatch_both(ops, *, T, idx_dtype=torch.int64, x_dtype=torch.bfloat16, max_recv=40, budget=None,
                   rows_per_expert=None, ce_stage=False, small=False, contiguous=True, seed=0):
    buf = small_buffer(max_recv_tokens=max_recv)
    x, idx, w = _inputs(T, idx_dtype, x_dtype, contiguous, seed)
    out = {}
    for name, module in (("python", None), ("op", ops)):
        lib = StandInLibrary(E)
        be = bare_backend(buf, lib, module, ce_stage=ce_stage, small=small)
        tokens, probs, h = be.dispatch(x, idx, w, rows_per_expert=rows_per_expert, recv_budget=budget)
        (kind, args), = lib.calls
        assert kind == "launch"
        tensors = {"scratch": h.state.scratch, "tpe": h.tokens_per_expert, "src_rank": h.src_rank,
                   "src_token": h.src_token, "probs": probs, "x": x, "out": tokens}
        if idx.is_contiguous():
            tensors.update(idx=idx, w=w)
        out[name] = dict(tokens=tokens, probs=probs, h=h, args=args,
                         targets=_pointer_targets(args, LAUNCH_PTRS, tensors))
    return out


def _same_tensor(a, b, what):
    assert a.shape == b.shape and a.dtype == b.dtype and a.stride() == b.stride(), \
        f"{what}: {tuple(a.shape)} {a.dtype} {a.stride()} vs {tuple(b.shape)} {b.dtype} {b.stride()}"
    assert a.storage_offset() == b.storage_offset(), what
    assert torch.equal(a.view(torch.uint8) if a.dtype == torch.bfloat16 else a,
                       b.view(torch.uint8) if b.dtype == torch.bfloat16 else b), what



def _case_id(case: dict) -> str:
    """A parametrized case's test id: its keywords, dtypes by name."""
    return "-".join(f"{k}={getattr(v, '__name__', v)}" for k, v in case.items())


CASES = [
    dict(T=0), dict(T=1), dict(T=7), dict(T=8, idx_dtype=torch.int32), dict(T=5, contiguous=False),
    dict(T=6, budget=3), dict(T=6, budget=0), dict(T=4, rows_per_expert=5, max_recv=20),
    dict(T=3, ce_stage=True), dict(T=2, small=True), dict(T=5, x_dtype=torch.float32),
    dict(T=5, x_dtype=torch.uint8), dict(T=8, max_recv=0),
]


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_static_dispatch_op_is_the_python_path(ops, case):
    both = _dispatch_both(ops, **case)
    py, op = both["python"], both["op"]
    # Every argument: values equal; pointers to the same named tensor (or both null).
    for i, (a, b) in enumerate(zip(py["args"], op["args"])):
        if i not in LAUNCH_PTRS:
            assert a == b, f"argument {i}: {a} (python) vs {b} (op)"
    assert py["targets"] == op["targets"]
    # Only a non-contiguous idx / w is copied (then its values reach the outputs: compared below).
    copied = {"idx", "w"} if not case.get("contiguous", True) and case["T"] else set()
    assert {n for n, v in op["targets"].items() if v == "other"} == copied, op["targets"]
    if case["T"] and not copied:
        assert op["targets"]["x"] == "x" and op["targets"]["idx"] == "idx" and op["targets"]["w"] == "w"
    # The outputs, bitwise, with the same views.
    _same_tensor(py["tokens"], op["tokens"], "tokens")
    _same_tensor(py["probs"], op["probs"], "probs")
    hp, ho = py["h"], op["h"]
    for field in ("src_rank", "src_token", "tokens_per_expert", "num_rows_device"):
        _same_tensor(getattr(hp, field), getattr(ho, field), field)
    assert (hp.rows_received is None) == (ho.rows_received is None) == (case.get("budget") is None)
    if hp.rows_received is not None:
        _same_tensor(hp.rows_received, ho.rows_received, "rows_received")
        _same_tensor(hp.over_budget, ho.over_budget, "over_budget")
    _same_tensor(hp.state.scratch, ho.state.scratch, "scratch")
    for field in ("num_tokens", "num_rows", "num_out_rows", "backend", "buffer_id"):
        assert getattr(hp, field) == getattr(ho, field), field
    # The views share one tensor each, as the Python path's do (the handle keeps them alive).
    for h in (hp, ho):
        cap = h.num_out_rows
        if cap:
            assert h.src_token.data_ptr() - h.src_rank.data_ptr() == 8 * cap
        assert h.num_rows_device.data_ptr() - h.tokens_per_expert.data_ptr() == 8 * E


EAGER_CASES = [
    dict(T=0), dict(T=1), dict(T=7), dict(T=8, idx_dtype=torch.int32), dict(T=5, contiguous=False),
    dict(T=3, ce_stage=True), dict(T=2, small=True), dict(T=5, x_dtype=torch.uint8),
    dict(T=4, rows_per_expert=5), dict(T=4, rows_per_expert=0), dict(T=6, rows_per_expert=3, ce_stage=True),
]


@pytest.fixture
def no_cuda_streams(monkeypatch):
    """The eager path asks torch for the current stream and whether it is captured: on CPU
    these stand-ins (the stream pointer itself comes from the bare backend's ``_stream``)."""
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: "current stream")
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)


def _eager_both(ops, *, T, idx_dtype=torch.int64, x_dtype=torch.bfloat16, rows_per_expert=None,
                ce_stage=False, small=False, contiguous=True, report_error=0, seed=1):
    buf = small_buffer()          # eager: no max_recv_tokens
    x, idx, w = _inputs(T, idx_dtype, x_dtype, contiguous, seed)
    out = {}
    for name, module in (("python", None), ("op", ops)):
        lib = StandInLibrary(E, report_error=report_error)
        be = bare_backend(buf, lib, module, ce_stage=ce_stage, small=small)
        try:
            res = be.dispatch(x, idx, w, rows_per_expert=rows_per_expert)
        except Exception as e:  # compared below: both paths must raise alike, after the same calls
            res = e
        out[name] = dict(res=res, calls=lib.calls, backend=be, inputs=dict(x=x, idx=idx, w=w))
    return out


def _named_calls(calls, tensors):
    """Each recorded call as (kind, values with its pointers named)."""
    ptrs = {"launch": LAUNCH_PTRS, "layout": LAYOUT_PTRS, "combine": COMBINE_PTRS}
    named = []
    for kind, args in calls:
        targets = _pointer_targets(args, ptrs[kind], tensors)
        named.append((kind, [targets[ptrs[kind][i]] if i in ptrs[kind] else a for i, a in enumerate(args)]))
    return named


@pytest.mark.parametrize("case", EAGER_CASES, ids=_case_id)
def test_eager_dispatch_ops_are_the_python_path(ops, no_cuda_streams, case):
    """Item 76: the eager dispatch (layout, the host read of R, fill and transfer) and the eager
    ``rows_per_expert`` dispatch through ``dispatch_layout`` + ``dispatch_rows``: the same
    library calls in the same order with the same arguments, and bitwise the same outputs."""
    both = _eager_both(ops, **case)
    py, op = both["python"], both["op"]
    named = {}
    for name, r in both.items():
        tokens, probs, h = r["res"]
        named[name] = _named_calls(r["calls"], {
            "scratch": h.state.scratch, "tpe": h.tokens_per_expert, "src_rank": h.src_rank,
            "src_token": h.src_token, "probs": probs, "out": tokens, **r["inputs"]})
    kinds = [k for k, _ in named["python"]]
    assert kinds == ["layout", "launch"], kinds
    assert named["python"] == named["op"]
    layout, launch = named["op"][0][1], named["op"][1][1]
    copied = not case.get("contiguous", True)
    if case["T"]:
        assert layout[3] == ("other" if copied else "idx") and launch[14] == "x"
    assert launch[4] is None and launch[6] is None and launch[9] is None   # no routing, no counts
    (tp, pp, hp), (to, po, ho) = py["res"], op["res"]
    _same_tensor(tp, to, "tokens")
    _same_tensor(pp, po, "probs")
    for field in ("src_rank", "src_token", "tokens_per_expert", "num_rows_device"):
        _same_tensor(getattr(hp, field), getattr(ho, field), field)
    _same_tensor(hp.state.scratch, ho.state.scratch, "scratch")
    assert hp.rows_received is None and ho.rows_received is None
    for field in ("num_tokens", "num_rows", "num_out_rows"):
        assert getattr(hp, field) == getattr(ho, field), field
    R = hp.num_rows
    assert ho.num_out_rows == R and to.shape[0] == R
    if R:
        assert ho.src_token.data_ptr() - ho.src_rank.data_ptr() == 8 * R
    assert ho.num_rows_device.data_ptr() - ho.tokens_per_expert.data_ptr() == 8 * E


@pytest.mark.parametrize("code", ["bad_expert", "protocol"])
def test_eager_dispatch_errors_are_raised_alike(ops, no_cuda_streams, code):
    """A data error (a bad expert id: only this rank knows, so its transfer is still launched,
    then it raises) and a protocol error (nothing more launched) in the eager report: the op's
    path raises the same error after the same library calls as the Python path."""
    from megatron_mok.cuda.backend import BAD_EXPERT

    error = BAD_EXPERT if code == "bad_expert" else 5   # kConfigMismatch: a protocol error
    both = _eager_both(ops, T=5, report_error=error)
    kinds = {name: [k for k, _ in r["calls"]] for name, r in both.items()}
    want = ["layout", "launch"] if code == "bad_expert" else ["layout"]
    assert kinds["python"] == kinds["op"] == want, kinds
    py, op = both["python"]["res"], both["op"]["res"]
    assert isinstance(py, RuntimeError) and type(op) is type(py) and str(op) == str(py), (py, op)


class RecordingOps:
    """The real ops, each call's name recorded."""

    def __init__(self, ops):
        self.ops, self.called, self.abi_version = ops, [], ops.abi_version

    def __getattr__(self, name):
        fn = getattr(self.ops, name)

        def call(*args):
            self.called.append(name)
            return fn(*args)
        return call


@pytest.mark.parametrize("rows_per_expert", [None, 6])
def test_static_calls_on_the_side_stream_schedule_keep_the_python_path(ops, no_cuda_streams, monkeypatch,
                                                                       rows_per_expert):
    """A static call that is not ``_dispatch_static``'s (``MOK_DISPATCH_CE_OVERLAP=1``'s side-stream
    staging) takes the Python path, never the eager ops: its rows are ``max_recv_tokens``, not R
    (the fuzzer found the first version sending a static ``rows_per_expert`` call there, s42-2)."""
    buf = small_buffer(max_recv_tokens=40)
    lib = StandInLibrary(E)
    lib.mok_dispatch_fill = lambda *a: 0
    lib.mok_dispatch_transfer = lambda *a: 0
    rec = RecordingOps(ops)
    be = bare_backend(buf, lib, rec)
    be.ce_overlap, be.buf = True, buf
    be._stage_copy_beside = lambda x, T, main: None
    be._ce_done = "copy done"
    x, idx, w = torch.randn(5, H).to(torch.bfloat16), torch.randint(-1, E, (5, K)), torch.rand(5, K)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: SimpleNamespace(wait_event=lambda e: None))
    tokens, probs, h = be.dispatch(x, idx, w, rows_per_expert=rows_per_expert)
    assert rec.called == [] and [k for k, _ in lib.calls] == ["layout"]
    assert tokens.shape[0] == probs.shape[0] == h.num_out_rows == 40
    assert h.num_rows == (None if rows_per_expert is None else E * rows_per_expert)


def test_combine_op_is_the_python_path(ops):
    for T, small in ((0, False), (1, False), (7, True), (8, False)):
        buf = small_buffer(max_recv_tokens=24)
        g = torch.Generator().manual_seed(T)
        x = torch.randn(T, H, generator=g).to(torch.bfloat16)
        idx, w = torch.randint(-1, E, (T, K), generator=g), torch.rand(T, K, generator=g)
        res = {}
        for name, module in (("python", None), ("op", ops)):
            lib = StandInLibrary(E)
            be = bare_backend(buf, lib, module, small=small)
            tokens, _, h = be.dispatch(x, idx, w)
            expert_out = (tokens.float() * 3 - 1).to(torch.bfloat16)
            y, grad_w = be.combine(expert_out, h)
            (_, _), (kind, args) = lib.calls
            assert kind == "combine" and grad_w is None
            targets = _pointer_targets(args, COMBINE_PTRS, {"scratch": h.state.scratch,
                                                            "expert_out": expert_out, "y": y})
            res[name] = (y, args, targets)
        (yp, ap, tp), (yo, ao, to) = res["python"], res["op"]
        for i, (a, b) in enumerate(zip(ap, ao)):
            if i not in COMBINE_PTRS:
                assert a == b, f"T={T} argument {i}: {a} (python) vs {b} (op)"
        assert tp == to and to["y"] == ("y" if T else None), (tp, to)
        _same_tensor(yp, yo, f"y T={T}")


def test_library_errors_raise_on_both_paths(ops):
    """A non-zero return of the library raises the backend's error, with or without the op."""
    buf = small_buffer(max_recv_tokens=16)
    x, idx, w = torch.randn(3, H).to(torch.bfloat16), torch.randint(0, E, (3, K)), torch.rand(3, K)
    for module in (None, ops):
        ok = bare_backend(buf, StandInLibrary(E), module)
        _, _, h = ok.dispatch(x, idx, w)
        be = bare_backend(buf, StandInLibrary(E, rc=1), module)
        with pytest.raises(RuntimeError, match="stand-in library error"):
            be.dispatch(x, idx, w)
        with pytest.raises(RuntimeError, match="stand-in library error"):
            be.combine(torch.zeros(16, H, dtype=torch.bfloat16), h)


def test_fp8_pairs_keep_the_python_path(ops):
    """An FP8 pair read in place (routed or cached dispatch) is not the op's call: the op must not
    see it (its two sources are the Python path's)."""
    from megatron_mok.fp8 import PairRows

    class Refusing:
        abi_version = ops.abi_version

        def __getattr__(self, name):
            raise AssertionError(f"host op {name} called")

    buf = small_buffer(max_recv_tokens=16)
    lib = StandInLibrary(E)
    idx, w = torch.randint(0, E, (3, K)), torch.rand(3, K)
    be = bare_backend(buf, lib, Refusing())
    pair = PairRows(torch.zeros(3, 32, dtype=torch.uint8), torch.zeros(3, 4, dtype=torch.float32), 16)
    _, _, h = be.dispatch(pair, idx, w)
    assert lib.calls[-1][1][23] == 1     # two_sources: the Python path's call
    be.dispatch_cached(pair, h)
    assert lib.calls[-1][1][2] == bindings.STEP_TRANSFER and lib.calls[-1][1][23] == 1


CACHED_CASES = [dict(T=0), dict(T=1), dict(T=7), dict(T=5, ce_stage=True), dict(T=3, small=True),
                dict(T=5, x_dtype=torch.float32), dict(T=5, x_dtype=torch.uint8), dict(T=6, budget=2),
                dict(T=4, eager=True), dict(T=4, eager=True, ce_stage=True)]


@pytest.mark.parametrize("case", CACHED_CASES, ids=_case_id)
def test_cached_dispatch_op_is_the_python_path(ops, no_cuda_streams, case):
    """Item 77: a cached dispatch (the combine's backward) along a static or eager handle, through
    ``dispatch_cached`` and through the Python path: one ``mok_dispatch_launch`` each (the
    transfer, after the copy-engine staging when on) with the same arguments, pointer for
    pointer, and bitwise the same rows."""
    _check_cached_dispatch(ops, **case)


def _check_cached_dispatch(ops, *, T, eager=False, ce_stage=False, small=False, x_dtype=torch.bfloat16,
                           budget=None):
    buf = small_buffer() if eager else small_buffer(max_recv_tokens=40)
    x, idx, w = _inputs(T, torch.int64, x_dtype, True, seed=T + 5)
    x2 = (x.float() * 2 + 1).to(x_dtype) if x_dtype != torch.uint8 else x.flip(0).contiguous()
    res = {}
    for name, module in (("python", None), ("op", ops)):
        lib = StandInLibrary(E)
        be = bare_backend(buf, lib, module, ce_stage=ce_stage, small=small)
        _, _, h = be.dispatch(x, idx, w, recv_budget=budget)
        before = len(lib.calls)
        scratch_before = h.state.scratch.clone()
        out = be.dispatch_cached(x2, h)
        (kind, args), = lib.calls[before:]
        assert kind == "launch"
        named = _named_calls([(kind, args)], {"scratch": h.state.scratch, "x": x2, "out": out})[0][1]
        res[name] = (out, named, h, scratch_before)
    (op_out, op_args, ho, so), (py_out, py_args, hp, sp) = res["op"], res["python"]
    assert op_args == py_args, (op_args, py_args)
    steps = bindings.STEP_TRANSFER | (bindings.STEP_STAGE_COPY if ce_stage else 0)
    assert op_args[2] == steps and op_args[3] == "scratch" and op_args[7] == T
    assert [op_args[i] for i in (4, 6, 9, 10, 11, 12, 15)] == [None] * 7      # no routing, counts, rows
    assert op_args[14] == ("x" if T else None) and op_args[16] == ("out" if ho.num_out_rows else None)
    assert op_args[17] == ho.num_out_rows and op_args[20] == (bindings.TRANSFER_CE_STAGED if ce_stage else 0)
    _same_tensor(py_out, op_out, "tokens")
    _same_tensor(sp, so, "scratch before")
    _same_tensor(hp.state.scratch, ho.state.scratch, "scratch after")
    assert op_out.shape == (ho.num_out_rows, x.shape[1]) and op_out.dtype == x.dtype


GRAD_COMBINE_CASES = [dict(T=0), dict(T=1), dict(T=7, small=True), dict(T=8), dict(T=5, probs_dtype=torch.bfloat16),
                      dict(T=6, strided=True), dict(T=6, budget=0), dict(T=4, eager=True)]


@pytest.mark.parametrize("case", GRAD_COMBINE_CASES, ids=_case_id)
def test_prob_gradient_combine_op_is_the_python_path(ops, no_cuda_streams, case):
    """Item 77: the dispatch's backward (a combine with prob gradients) through the C++
    ``combine`` and the Python path: the same ``mok_combine`` arguments (the gradients converted
    to contiguous float32 alike, a copy only where needed; an empty one replaced by one zero:
    both pass a pointer to a zero, never null) and bitwise the same ``y`` and ``grad_w``.
    Also ``combine_prob_grads`` (the FP8 dispatch's backward), which calls it."""
    _check_prob_gradient_combine(ops, **case)


def _check_prob_gradient_combine(ops, *, T, eager=False, small=False, probs_dtype=torch.float32,
                                 strided=False, budget=None):
    buf = small_buffer() if eager else small_buffer(max_recv_tokens=24)
    x, idx, w = _inputs(T, torch.int64, torch.bfloat16, True, seed=T + 11)
    res = {}
    for name, module in (("python", None), ("op", ops)):
        lib = StandInLibrary(E)
        be = bare_backend(buf, lib, module, small=small)
        tokens, probs, h = be.dispatch(x, idx, w, recv_budget=budget)
        expert_out = (tokens.float() * 3 - 1).to(torch.bfloat16)
        R = h.num_out_rows
        gp = torch.linspace(-1, 1, 2 * R + 1)[:2 * R].view(R, 2)
        gp = (gp[:, 0] if strided else gp.reshape(-1)[:R].contiguous()).to(probs_dtype)
        before = len(lib.calls)
        y, grad_w = be.combine(expert_out, h, grad_probs=gp)
        only_w = be.combine_prob_grads(h, gp)
        calls = lib.calls[before:]
        assert [k for k, _ in calls] == ["combine", "combine"]
        tensors = {"scratch": h.state.scratch, "expert_out": expert_out, "y": y, "grad_w": grad_w,
                   "grad_probs": gp}
        res[name] = (y, grad_w, only_w, [_named_calls([c], tensors)[0][1] for c in calls])
    (yp, wp, op_, ap), (yo, wo, oo, ao) = res["python"], res["op"]
    # The second call's rows (combine_prob_grads' zeros) and its grad_w are its own: "other".
    assert ap == ao, (ap, ao)
    first = ao[0]
    direct = probs_dtype == torch.float32 and not strided and R > 0
    assert first[4] == ("grad_probs" if direct else "other")     # a converted copy, or the one zero
    assert first[7] == ("grad_w" if T else None) and first[6] == ("y" if T else None)
    _same_tensor(yp, yo, "y")
    _same_tensor(wp, wo, "grad_w")
    _same_tensor(op_, oo, "combine_prob_grads")
    assert wo.shape == (T, K) and wo.dtype == torch.float32


def test_loader_refuses_builds_for_another_torch_or_abi(ops, tmp_path, monkeypatch):
    built = host_ops.module_path()
    monkeypatch.setattr(host_ops, "_state", {})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert host_ops.get(ops.abi_version) is not None and host_ops.why_not() is None
    monkeypatch.setattr(host_ops, "_state", {})
    with pytest.warns(RuntimeWarning, match=r"C ABI .* rebuild"):
        assert host_ops.get(ops.abi_version + 1) is None
    assert "C ABI" in host_ops.why_not()
    # A build for another torch lies elsewhere and is never imported: the missing build is
    # the normal case (no compiler), said by why_not, not warned about.
    monkeypatch.setattr(host_ops, "_state", {})
    monkeypatch.setattr(host_ops, "module_path", lambda v=None: tmp_path / "missing.so")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert host_ops.get(ops.abi_version) is None
    assert "not built" in host_ops.why_not()
    # The file of another torch's build, found where this torch's should be: refused.
    monkeypatch.setattr(host_ops, "_state", {})
    monkeypatch.setattr(host_ops, "module_path", lambda v=None: built)
    monkeypatch.setattr(torch, "__version__", "0.0.0-other")
    with pytest.warns(RuntimeWarning, match="built for torch"):
        assert host_ops.get(ops.abi_version) is None
    monkeypatch.setattr(host_ops, "_state", {})
    monkeypatch.setenv("MOK_HOST_OPS", "0")
    assert host_ops.get(ops.abi_version) is None and host_ops.why_not() == "MOK_HOST_OPS=0"


def test_build_command_names_this_torch_and_the_c_abi_header():
    cmd = host_ops.build_command(host_ops.module_path())
    assert f'-DMOK_TORCH_VERSION="{torch.__version__}"' in cmd
    assert f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}" in cmd
    assert any(c.endswith(os.path.join("csrc", "api")) for c in cmd if c.startswith("-I"))
    assert str(host_ops.SOURCE) in cmd and host_ops.SOURCE.exists()
    assert host_ops.module_path().parent.name == f"torch-{torch.__version__}"


def test_a_build_is_kept_only_while_newer_than_its_source_and_the_abi_header(tmp_path, monkeypatch):
    """``setup.py`` (run by every ``scripts/setup.sh``) rebuilds only a stale build: one older
    than the C++ source or than ``mok_api.h`` (whose C ABI version it compiles in)."""
    src, hdr, so = tmp_path / "host_ops.cpp", tmp_path / "mok_api.h", tmp_path / "ops.so"
    for i, f in enumerate((src, hdr, so)):
        f.write_text("x")
        os.utime(f, (1000 + i, 1000 + i))
    monkeypatch.setattr(host_ops, "SOURCE", src)
    monkeypatch.setattr(host_ops, "HEADER", hdr)
    assert host_ops.up_to_date(so)
    os.utime(hdr, (5000, 5000))
    assert not host_ops.up_to_date(so)
    os.utime(hdr, (1001, 1001))
    os.utime(src, (5000, 5000))
    assert not host_ops.up_to_date(so)
    assert not host_ops.up_to_date(tmp_path / "missing.so")

"""Handles and autograd graphs that outlive their Buffer, or meet the wrong one.

- A handle names its Buffer by ``Buffer.serial`` (never reused), not by ``id()``: a new
  Buffer that gets a freed Buffer's address must refuse that Buffer's handles (it used to take
  them and combine along the stale layout: wrong results, no error).
- A handle is taken only by the backend that made it (``DispatchHandle.backend``).
- After ``Buffer.destroy()`` the backward of a dispatch / combine / cached dispatch made on it
  raises ``RuntimeError`` before any backend method runs (the CUDA backend's would use freed
  peer memory); every backend method refuses too. Checked on the reference backend, with a
  fake backend that records its calls, and on a ``CudaBackend`` shell with a fake library (no
  GPU needed).
- The backward passes are first order only: a double backward (``create_graph=True``) raises
  instead of silently missing their part of the second derivative, with ``.backward()`` and
  with ``torch.autograd.grad(inputs=...)`` alike (the latter is why it is not
  ``once_differentiable``: torch prunes that decorator's error node there).
"""

import dataclasses
import gc

import pytest
import torch

import megatron_mok as mok
from harness import assert_bitwise, make_inputs, run_distributed, small_buffer
from megatron_mok import fp8
from megatron_mok.autograd import CachedDispatchFunction, CombineFunction, DispatchFunction

E, H, K, T_MAX, T = 4, 16, 2, 8, 5
DESTROYED = r"this Buffer was destroyed; the backward of a {} made on it cannot run"
NOT_TWICE = r"the backward of a (cached dispatch|dispatch|combine) is not differentiable: a double backward"


def make_buf(**kw):
    return small_buffer(**({"dtype": torch.float32} | kw))


def inputs(seed=3, dtype=torch.float32):
    (x, idx, w), = make_inputs(seed, 1, [T], E, H, K, dtype)
    return x, idx, w


# ------------------------------------------------------------------- (A) handle identity
def test_handles_carry_the_buffers_serial():
    a, b = make_buf(), make_buf()
    assert isinstance(a.serial, int) and b.serial > a.serial      # unique, from one count
    res = a.dispatch(*inputs())
    assert res.handle.buffer_id == a.serial and res.handle.backend == "reference"
    msg = rf"handle was made by another Buffer \(serial {a.serial}; this Buffer's is {b.serial}\)"
    with pytest.raises(ValueError, match=msg):
        b.combine(res.tokens, res.handle)
    with pytest.raises(ValueError, match=msg):
        b.dispatch(inputs()[0], handle=res.handle)


def test_new_buffer_at_a_freed_buffers_address_refuses_its_handle():
    """review_host/e1: the handle of a destroyed, freed Buffer meets a new Buffer that CPython
    put at the same address (``id``). Before: accepted, and the combine gave wrong numbers."""
    b1 = make_buf()
    x, idx, w = inputs()
    res = b1.dispatch(x, idx, w)
    h = res.handle
    expert_out = torch.randn(h.num_out_rows, H, generator=torch.Generator().manual_seed(5))
    old_id = id(b1)
    b1.destroy()
    del b1, res
    gc.collect()
    # Find the address as Buffer() itself allocates (object.__new__, then __init__): only the
    # bare objects are allocated while searching, because the many small objects a whole
    # Buffer's __init__ makes (kept alive with it) would take the freed slot first. Each
    # candidate stays alive, so the next one is placed at another free address.
    keep = []
    for _ in range(100000):
        b2 = mok.Buffer.__new__(mok.Buffer)
        if id(b2) == old_id:
            break
        keep.append(b2)
    else:
        pytest.skip("no new Buffer got the freed Buffer's address in 100000 tries (allocator)")
    del keep
    # another routing width (topk=1): the stale layout does not even fit it
    b2.__init__(num_experts=E, hidden=H, topk=1, max_tokens_per_rank=T_MAX, dtype=torch.float32,
                backend="reference")
    assert id(b2) == old_id
    with pytest.raises(ValueError, match=r"handle was made by another Buffer"):
        b2.combine(expert_out, h)
    with pytest.raises(ValueError, match=r"handle was made by another Buffer"):
        b2.dispatch(x, handle=h)


def test_handle_of_another_backend_is_refused():
    """A Buffer's calls all run on one backend (it keeps its first call's device), so this
    cannot happen through the API today; the handle says which backend's layout it holds, and
    a call on another backend refuses it rather than reading a layout it does not know."""
    buf = make_buf()
    x, idx, w = inputs()
    res = buf.dispatch(x, idx, w)
    forged = dataclasses.replace(res.handle, backend="cuda")
    pattern = r"handle was made by this Buffer's 'cuda' backend, but this call runs on its 'reference'"
    with pytest.raises(ValueError, match=pattern):
        buf.combine(res.tokens, forged)
    with pytest.raises(ValueError, match=pattern):
        buf.dispatch(x, handle=forged)
    buf.combine(res.tokens, res.handle)       # the real handle still works


# --------------------------------------------------------- (B) backward after destroy
def _graph(op):
    """A Buffer, a loss whose backward runs only ``op``'s backward (plus plain torch ops), and
    the leaf that gets the gradient."""
    if op == "fp8 dispatch":
        # Its backward carries only the prob gradients (combine_prob_grads).
        buf = make_buf(hidden=128, dtype=torch.bfloat16)
        (x, idx, w), = make_inputs(3, 1, [T], E, 128, K, torch.bfloat16)
        w = w.clone().requires_grad_(True)
        res = buf.dispatch(fp8.quantize(x), idx, w)
        return buf, res.probs.sum(), w
    buf = make_buf()
    x, idx, w = inputs()
    if op == "dispatch":
        x = x.clone().requires_grad_(True)
        res = buf.dispatch(x, idx, w)
        return buf, (res.tokens ** 2).sum(), x
    if op == "dispatch probs":
        w = w.clone().requires_grad_(True)
        res = buf.dispatch(x, idx, w)
        return buf, (res.probs ** 2).sum(), w
    res = buf.dispatch(x, idx, w)
    if op == "combine":
        eo = res.tokens.clone().requires_grad_(True)
        return buf, (buf.combine(eo, res.handle) ** 2).sum(), eo
    assert op == "cached dispatch"
    x2 = (x * 2).requires_grad_(True)
    return buf, (buf.dispatch(x2, handle=res.handle).tokens ** 2).sum(), x2


OPS = ("dispatch", "dispatch probs", "combine", "cached dispatch", "fp8 dispatch")


@pytest.mark.parametrize("op", OPS)
def test_backward_after_destroy_raises(op):
    """review_host/e7: before, the backward ran on the destroyed Buffer's backend."""
    buf, loss, _ = _graph(op)
    buf.destroy()
    name = {"dispatch probs": "dispatch", "fp8 dispatch": "dispatch"}.get(op, op)
    with pytest.raises(RuntimeError, match=DESTROYED.format(name)):
        loss.backward()


@pytest.mark.parametrize("op", OPS)
def test_backward_before_destroy_still_works(op):
    buf, loss, leaf = _graph(op)
    loss.backward()
    assert leaf.grad is not None and leaf.grad.abs().sum() > 0
    buf.destroy()


def test_destroyed_reference_backend_refuses_every_method():
    buf = make_buf()
    x, idx, w = inputs()
    res = buf.dispatch(x, idx, w)
    be = buf._get_backend("reference")
    buf.destroy()
    calls = [lambda: be.dispatch(x, idx, w), lambda: be.dispatch_cached(x, res.handle),
             lambda: be.combine(res.tokens, res.handle),
             lambda: be.combine_prob_grads(res.handle, res.probs)]
    for call in calls:
        with pytest.raises(RuntimeError, match=r"this Buffer was destroyed"):
            call()
    assert be.destroyed      # what the autograd functions check
    with pytest.raises(RuntimeError, match=r"this Buffer was destroyed"):   # the Buffer itself
        buf.dispatch(x, handle=res.handle)


class FakeBackend:
    """A stand-in for a backend whose methods must not run once destroyed (the CUDA backend's
    would read freed peer memory): one rank, ``K = 1``, the identity layout. Records calls."""

    name = "fake"

    def __init__(self):
        self.destroyed = False
        self.calls = []

    def dispatch(self, x, topk_idx, topk_weights, rows_per_expert=None, recv_budget=None):
        self.calls.append("dispatch")
        return x.clone(), topk_weights[:, 0].clone(), "handle"

    def dispatch_cached(self, x, handle):
        self.calls.append("dispatch_cached")
        return x.clone()

    def combine(self, expert_out, handle, grad_probs=None):
        self.calls.append("combine")
        return expert_out.clone(), None if grad_probs is None else grad_probs[:, None].clone()

    def combine_prob_grads(self, handle, grad_probs):
        self.calls.append("combine_prob_grads")
        return grad_probs[:, None].clone()

    def destroy(self):
        self.destroyed = True


@pytest.mark.parametrize("fn", ("dispatch", "combine", "cached dispatch"))
def test_backward_after_destroy_calls_no_backend_method(fn):
    """The autograd functions check before they call the backend, whatever the backend checks
    itself: so the CUDA backend's freed memory is never reached from a backward."""
    be = FakeBackend()
    x = torch.randn(3, H, requires_grad=True)
    w = torch.rand(3, 1, requires_grad=True)
    if fn == "dispatch":
        tokens, probs = DispatchFunction.apply(be, [], x, w, torch.zeros(3, 1, dtype=torch.long))
        loss = tokens.sum() + probs.sum()
    elif fn == "combine":
        loss = CombineFunction.apply(be, "handle", x).sum()
    else:
        loss = CachedDispatchFunction.apply(be, "handle", x).sum()
    be.destroy()
    be.calls.clear()
    with pytest.raises(RuntimeError, match=DESTROYED.format(fn)):
        loss.backward()
    assert be.calls == [], f"a destroyed backend was called: {be.calls}"


class FakeLibrary:
    """Records every library function the CUDA backend looks up (any call would hand the
    kernels the destroyed context and freed peer pointers)."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        def call(*args):
            self.calls.append(name)
            return 0
        return call


def test_destroyed_cuda_backend_refuses_every_method_without_a_gpu():
    """``CudaBackend.destroy`` frees the peer memory and the library context: afterwards each
    method must raise before it reaches the library. A shell built without ``__init__`` (no GPU
    here) holding what ``destroy`` reads, destroyed through its Buffer as a real one is; reading
    any other attribute means the method went on towards a launch."""
    from megatron_mok.cuda.backend import CudaBackend

    class Shell(CudaBackend):
        def __getattr__(self, name):       # only for attributes the shell does not have
            raise AssertionError(f"the destroyed CUDA backend went on to read self.{name}")

    buf = make_buf(dtype=torch.bfloat16)
    x, idx, w = inputs(dtype=torch.bfloat16)
    res = buf.dispatch(x, idx, w)               # a (reference) handle to pass; never read
    be = object.__new__(Shell)
    be.buf, be.lib, be.ctx, be.mem, be._own_side, be.broken = buf, FakeLibrary(), 1, None, None, None
    buf._backends["cuda"] = be
    buf.destroy()
    assert be.ctx is None and be.lib.calls == ["mok_destroy"]
    calls = {"dispatch": lambda: be.dispatch(x, idx, w),
             "dispatch_cached": lambda: be.dispatch_cached(x, res.handle),
             "combine": lambda: be.combine(res.tokens, res.handle),
             "combine_prob_grads": lambda: be.combine_prob_grads(res.handle, res.probs),
             "check_errors": be.check_errors}
    for name, call in calls.items():
        with pytest.raises(RuntimeError, match=r"this Buffer was destroyed"):
            call()
    assert be.lib.calls == ["mok_destroy"], be.lib.calls
    assert be.destroyed      # what the autograd functions check


# ------------------------------------------------------------- (C) first order only
@pytest.mark.parametrize("how", ("backward", "autograd.grad"))
@pytest.mark.parametrize("op", OPS[:4])
def test_double_backward_raises(op, how):
    """Before: at W=1 the reference's torch ops happened to build a correct graph, at W=2 none
    (silently wrong, test below), the CUDA backend never: one rule for all, an error. With
    ``once_differentiable`` instead, ``autograd.grad`` returned the wrong number silently."""
    buf, loss, leaf = _graph(op)
    g, = torch.autograd.grad(loss, leaf, create_graph=True)
    assert g.requires_grad
    # the first-order gradient is the plain backward's, bit for bit
    _, loss2, leaf2 = _graph(op)
    loss2.backward()
    assert_bitwise(g, leaf2.grad, f"create_graph gradient of {op}")
    total = (g ** 2).sum() + (leaf ** 2).sum()   # a gradient penalty: d/dleaf goes through g
    with pytest.raises(RuntimeError, match=NOT_TWICE):
        if how == "backward":
            total.backward()
        else:
            torch.autograd.grad(total, leaf)
    buf.destroy()


def test_create_graph_without_a_second_order_path_still_works():
    """create_graph=True through a graph whose incoming gradients need no grad (a loss linear
    in the outputs): nothing to refuse, and the gradient is the plain one."""
    buf = make_buf()
    x, idx, w = inputs()
    x = x.clone().requires_grad_(True)
    res = buf.dispatch(x, idx, w)
    y = buf.combine(res.tokens, res.handle)
    g, = torch.autograd.grad(y.sum(), x, create_graph=True)
    res2 = buf.dispatch(x, idx, w)
    buf.combine(res2.tokens, res2.handle).sum().backward()
    assert_bitwise(g, x.grad, "gradient of a linear loss with create_graph=True")
    buf.destroy()


def _double_backward_distributed(rank, world_size):
    """dispatch -> weighted expert -> combine, a gradient penalty on x; returns the error text
    (or None when the second backward ran)."""
    buf = mok.Buffer(num_experts=E, hidden=H, topk=K, max_tokens_per_rank=T_MAX,
                     dtype=torch.float32, backend="reference")
    x, idx, w = make_inputs(9, world_size, [T] * world_size, E, H, K, torch.float32)[rank]
    x = x.clone().requires_grad_(True)
    res = buf.dispatch(x, idx, w)
    y = buf.combine(res.tokens * res.probs[:, None], res.handle)
    g, = torch.autograd.grad((y ** 2).sum(), x, create_graph=True)
    try:
        ((g ** 2).sum() + (x ** 2).sum()).backward()
    except RuntimeError as e:
        return str(e)
    finally:
        buf.destroy()
    return None


def test_double_backward_raises_on_every_rank():
    """At W=2 the reference's collectives (raw bytes) record no graph: before, the second
    backward ran and silently left out the dispatch/combine part of d(g^2)/dx."""
    errors = run_distributed(_double_backward_distributed, 2)
    for err in errors:
        assert err is not None and "is not differentiable: a double backward" in err, errors

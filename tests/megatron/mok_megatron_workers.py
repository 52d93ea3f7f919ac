"""Rank functions for the Megatron tests (run by ``harness.run_distributed``).

Each function initialises Megatron's ``parallel_state`` itself and tears it down (and the
shared MoK Buffers) in ``finally``, so pooled ranks can take the next call.
"""

from __future__ import annotations

import contextlib
import os
import re
import warnings

import pytest
import torch
import torch.distributed as dist

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _setup(ep_size: int, backend_env: str | None = None, etp_size: int = 1, tp_size: int = 1,
           cp_size: int = 1):
    warnings.filterwarnings("ignore")
    if backend_env:
        os.environ["MOK_BACKEND"] = backend_env
    else:
        os.environ.pop("MOK_BACKEND", None)
    os.environ.pop("MOK_MAX_TOKENS_PER_RANK", None)
    import megatron_mok.megatron as mm
    from megatron_mok.megatron import harness

    mm.install()
    harness.init_parallel(ep_size, tp_size=tp_size, etp_size=etp_size, cp_size=cp_size)
    harness.enable_cpu_alltoall()
    return harness


def _device():
    """This rank's device: its GPU under NCCL or in shared-GPU mode (ranks as processes on one
    GPU, joined by gloo: tests/harness.py), else the CPU."""
    if dist.get_backend() == "nccl" or os.environ.get("MOK_TEST_RANK_DEVICE"):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _assert_bitwise(a, b, what):
    from harness import assert_bitwise

    assert_bitwise(a, b, what)


def _assert_runs_bitwise(run, ref, what, input_grad=True):
    """Two ``_run_layer`` results ``(output, input grad, {param: grad})``: bitwise equal
    (the input gradient too unless ``input_grad=False``)."""
    _assert_bitwise(run[0], ref[0], f"output, {what}")
    if input_grad:
        _assert_bitwise(run[1], ref[1], f"input grad, {what}")
    for k in ref[2]:
        _assert_bitwise(run[2][k], ref[2][k], f"grad {k}, {what}")


def _ep_ranks():
    from megatron.core import parallel_state

    return dist.get_process_group_ranks(parallel_state.get_expert_model_parallel_group())


# ------------------------------------------------------------------------ dispatcher checks
def megatron_dropless_roundtrip(rank, world, ep_size, dtype_name, topk, num_experts,
                                backend_env=None):
    """Megatron's ``dispatcher_dropless_test``, applied to ``mok``: router probs replaced by
    1/topk, tokens scaled by ``permuted_probs``, combined: the output is the input and the
    input gradient is the upstream gradient. With topk a power of two every step is exact,
    so the check is bitwise."""
    h = _setup(ep_size, backend_env)
    try:
        dtype, dev = DTYPES[dtype_name], _device()
        cfg = h.moe_config("mok", ep_size=ep_size, num_experts=num_experts, topk=topk,
                           hidden=32, moe_router_load_balancing_type="none",
                           moe_aux_loss_coeff=0.0)
        layer = h.build_moe_layer(cfg, device=dev, dtype=dtype)
        disp = layer.token_dispatcher
        assert type(disp).__name__ == "MokTokenDispatcher", type(disp)
        g = torch.Generator().manual_seed(1000 + rank)
        x = torch.randn(16, 4, 32, generator=g).to(dtype).to(dev)
        ans = x.clone()
        x.requires_grad_(True)
        probs, routing_map = layer.router(x)
        probs = torch.ones_like(probs) / layer.router.topk

        hs, p = disp.dispatch_preprocess(x, routing_map, probs)
        hs, p = disp.token_dispatch(hs, p)
        hs, tokens_per_expert, permuted_probs = disp.dispatch_postprocess(hs, p)
        assert permuted_probs.dim() == 1 and permuted_probs.shape[0] == hs.shape[0]
        assert int(tokens_per_expert.sum()) == hs.shape[0]
        assert tokens_per_expert.shape == (num_experts // ep_size,)
        hs = (hs * permuted_probs.unsqueeze(-1)).to(dtype)
        out = disp.combine_postprocess(disp.token_combine(disp.combine_preprocess(hs)))
        assert out.shape == ans.shape and out.dtype == dtype
        if topk & (topk - 1) == 0:
            _assert_bitwise(out, ans, "restored hidden states")
        else:
            torch.testing.assert_close(out, ans)
        torch.autograd.backward(out, ans)
        if topk & (topk - 1) == 0:
            _assert_bitwise(x.grad, ans, "input gradient")
        else:
            torch.testing.assert_close(x.grad, ans)
        return int(hs.shape[0])
    finally:
        h.destroy_parallel()


def _seeded_routing(seed, ranks, num_tokens, num_experts, topk, hidden, dtype):
    """Every EP rank's ``(x, routing_map, probs)``, from one seed, so each rank knows all."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, _ in enumerate(ranks):
        T = num_tokens[i % len(num_tokens)]
        x = torch.randn(T, hidden, generator=g).to(dtype)
        rmap = torch.zeros(T, num_experts, dtype=torch.bool)
        for t in range(T):
            k = topk if t % 5 else max(topk - 1, 0)       # some tokens use fewer slots
            if t == 3:
                k = 0                                    # and one token none at all
            rmap[t, torch.randperm(num_experts, generator=g)[:k]] = True
        probs = (torch.rand(T, num_experts, generator=g) * 0.9 + 0.1) * rmap
        out.append((x, rmap, probs.float()))
    return out


def dispatcher_layout_and_grads(rank, world, ep_size, dtype_name, backend_env=None):
    """Exact expert-major layout (rows, ``tokens_per_expert``, ``permuted_probs``) against
    every rank's seeded routing; then combine of ``tokens * permuted_probs`` and its
    gradients to ``x`` and the dense ``probs`` against a local autograd reference."""
    h = _setup(ep_size, backend_env)
    try:
        dtype, dev = DTYPES[dtype_name], _device()
        E, K, H = 4 * ep_size, 3, 32
        cfg = h.moe_config("mok", ep_size=ep_size, num_experts=E, topk=K, hidden=H,
                           moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0)
        layer = h.build_moe_layer(cfg, device=dev, dtype=dtype)
        disp = layer.token_dispatcher
        ranks = _ep_ranks()
        me = ranks.index(rank)
        data = _seeded_routing(77, ranks, [10, 7, 12, 5], E, K, H, dtype)
        e_local = E // ep_size
        # expected rows: local expert, then source (EP) rank, then token
        exp_rows, exp_probs, exp_tpe = [], [], []
        for e in range(me * e_local, (me + 1) * e_local):
            n = 0
            for (xs, rm, ps) in data:
                sel = rm[:, e].nonzero().flatten()
                exp_rows.append(xs[sel])
                exp_probs.append(ps[sel, e])
                n += sel.numel()
            exp_tpe.append(n)
        exp_rows = torch.cat(exp_rows)
        exp_probs = torch.cat(exp_probs)

        x0, rmap, probs0 = data[me]
        x = x0.detach().clone().to(dev).requires_grad_(True)
        probs = probs0.detach().clone().to(dev).requires_grad_(True)
        hs, p = disp.dispatch_preprocess(x, rmap.to(dev), probs)
        hs, p = disp.token_dispatch(hs, p)
        tokens, tpe, pprobs = disp.dispatch_postprocess(hs, p)
        _assert_bitwise(tokens, exp_rows.to(dev), "expert-major rows")
        _assert_bitwise(pprobs, exp_probs.to(dev), "permuted_probs")
        assert tpe.dtype == torch.int64, tpe.dtype
        assert tpe.tolist() == exp_tpe, (tpe.tolist(), exp_tpe)

        y = disp.combine_postprocess(disp.token_combine(disp.combine_preprocess(
            (tokens.float() * pprobs.unsqueeze(-1)).to(dtype))))
        gy = torch.randn(y.shape, generator=torch.Generator().manual_seed(5 + rank)).to(dtype)
        y.backward(gy.to(dev))

        # local reference: y_t = sum_e probs[t, e] * x_t over routed e, in float32
        xr = x0.detach().float().clone().requires_grad_(True)
        pr = probs0.detach().clone().requires_grad_(True)
        yr = (pr * rmap).sum(1, keepdim=True) * xr
        yr.backward(gy.float())
        tol = dict(atol=2e-2, rtol=2e-2) if dtype != torch.float32 else dict(atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(y.float().cpu(), yr.detach(), **tol)
        torch.testing.assert_close(x.grad.float().cpu(), xr.grad, **tol)
        torch.testing.assert_close(probs.grad.float().cpu(), pr.grad * rmap, **tol)
        assert torch.all(probs.grad.cpu()[~rmap] == 0)

        # a token count above the agreed T_max fails before any communication, naming the knob
        big = disp.buffer.max_tokens_per_rank + 1
        xb = torch.zeros(big, H, dtype=dtype, device=dev)
        rb = torch.zeros(big, E, dtype=torch.bool, device=dev)
        hb, pb = disp.dispatch_preprocess(xb, rb, torch.zeros(big, E, device=dev))
        try:
            disp.token_dispatch(hb, pb)
        except ValueError as e:
            assert "MOK_MAX_TOKENS_PER_RANK" in str(e), str(e)
        else:
            raise AssertionError("T > T_max did not raise")
        return exp_tpe
    finally:
        h.destroy_parallel()


# ------------------------------------------------------------------------ full MoELayer
def _take_grads(layer):
    """``{name: grad}`` of every parameter (copies), each ``.grad`` cleared for the next run."""
    grads = {k: p.grad.detach().clone() for k, p in layer.named_parameters()}
    for p in layer.parameters():
        p.grad = None
    return grads


def _run_layer(layer, x, gy):
    xx = x.clone().requires_grad_(True)
    y, bias = layer(xx)
    assert bias is None
    y.backward(gy)
    return y.detach(), xx.grad.detach(), _take_grads(layer)


_EXPERT_KEY = re.compile(r"experts\.local_experts\.(\d+)\.(.*)")


def _full_state_dict(mok_layer, world: int, e_local: int) -> dict:
    """The state dict of the same layer with every expert local (EP = 1), from the mok
    layer's EP shards (collective: the ranks exchange their experts)."""
    shards = [None] * world
    dist.all_gather_object(shards, {k: v.cpu() if torch.is_tensor(v) else v
                                    for k, v in mok_layer.state_dict().items()})
    full = {}
    for r, sd in enumerate(shards):
        for k, v in sd.items():
            m = _EXPERT_KEY.match(k)
            if m:
                full[f"experts.local_experts.{r * e_local + int(m.group(1))}.{m.group(2)}"] = v
            elif r == 0:
                full[k] = v
    return full


_MISSING = object()


@contextlib.contextmanager
def patched_attrs(obj, **attrs):
    """Set ``obj``'s attributes for the duration, then restore them as they were (deleting
    those ``obj`` did not have)."""
    saved = {n: getattr(obj, n, _MISSING) for n in attrs}
    for n, v in attrs.items():
        setattr(obj, n, v)
    try:
        yield
    finally:
        for n, v in saved.items():
            if v is _MISSING:
                delattr(obj, n)
            else:
                setattr(obj, n, v)


def _compare(rank, run_m, run_a, e_local, tol) -> dict:
    """mok's ``(output, input grad, grads)`` against alltoall's (EP = 1), expert weight grads
    summed over the ranks first (each rank's alltoall layer saw only its own tokens). Returns
    ``{what: max abs difference / the reference's largest value}``; raises past ``tol`` times
    the largest value of the reference tensor (absolute) or of each element (relative). Scaled
    so: with Megatron's init the outputs are ~1e-3, where a fixed atol of 1e-5 would pass a
    1.001 scaling of the probs."""
    errs = {}

    def check(what, got, want):
        scale = float(want.abs().max())
        torch.testing.assert_close(got, want, atol=tol * scale, rtol=tol,
                                   msg=lambda s: f"{what} (largest value {scale:.3g}): {s}")
        errs[what] = (got.float() - want.float()).abs().max().item() / (scale or 1.0)

    check("output", run_m[0], run_a[0])
    check("input_grad", run_m[1], run_a[1])
    summed = {}
    for k in sorted(run_a[2]):           # every rank reduces every expert, in one order
        if k.startswith("experts."):
            summed[k] = run_a[2][k].clone()
            dist.all_reduce(summed[k])
    for k, v in run_m[2].items():
        m = _EXPERT_KEY.match(k)
        ref = summed[f"experts.local_experts.{rank * e_local + int(m.group(1))}.{m.group(2)}"] \
            if m else run_a[2][k]
        check(f"grad:{k}", v, ref)
    return errs


def layer_mok_vs_alltoall_cpu(rank, world, cp_size=1, balancing="none"):
    """Full ``MoELayer`` on CPU: ``mok`` over EP=W against Megatron's ``alltoall`` with every
    expert local (EP=1; its permute / unpermute path), same weights, same input: outputs and
    all gradients agree (expert grads summed over ranks); ``mok`` twice is bitwise equal.

    ``cp_size`` > 1: Megatron's parallel state with context parallelism (the EP group then
    spans CP ranks: each rank's tokens are its sequence shard); ``balancing``: the router's
    load-balancing loss (coefficient 0.01 unless ``"none"``), the same router for both."""
    h = _setup(world, cp_size=cp_size)
    try:
        E = 4 * world
        kw = dict(num_experts=E, topk=2, hidden=32, moe_router_load_balancing_type=balancing,
                  moe_aux_loss_coeff=0.0 if balancing == "none" else 0.01,
                  context_parallel_size=cp_size)
        from megatron.core import parallel_state

        assert parallel_state.get_context_parallel_world_size() == cp_size
        torch.manual_seed(0)
        mok_layer = h.build_moe_layer(h.moe_config("mok", ep_size=world, **kw))
        a2a_layer = h.build_moe_layer(h.moe_config("alltoall", ep_size=1, **kw),
                                      pg_collection=h.single_rank_pg_collection())
        assert type(mok_layer.token_dispatcher).__name__ == "MokTokenDispatcher"
        assert type(a2a_layer.token_dispatcher).__name__ == "MoEAlltoAllTokenDispatcher"
        e_local = E // world
        a2a_layer.load_state_dict(_full_state_dict(mok_layer, world, e_local), strict=True)

        g = torch.Generator().manual_seed(100 + rank)
        x = torch.randn(8, 3, 32, generator=g)
        gy = torch.randn(8, 3, 32, generator=g)
        y_m, dx_m, g_m = _run_layer(mok_layer, x, gy)
        _assert_runs_bitwise(_run_layer(mok_layer, x, gy), (y_m, dx_m, g_m), "mok run 2 vs run 1")
        _compare(rank, (y_m, dx_m, g_m), _run_layer(a2a_layer, x, gy), e_local, 1e-5)
        assert float(y_m.abs().sum()) > 0 and all(float(v.abs().sum()) > 0 for v in g_m.values())
        return sorted(g_m)
    finally:
        h.destroy_parallel()


def layer_mok_vs_alltoall_gpu(rank, world, backend_env="cuda", dtype_name="bf16"):
    """Full ``MoELayer`` in bf16 (or ``dtype_name="fp16"``) on GPUs: ``alltoall`` and ``mok``
    over the same EP group, same weights, same input. Outputs and every gradient agree within
    bf16 tolerance, and mok's error against an fp32 run of the same layer is at most 2x
    alltoall's (+ 1 bf16 ulp slack); ``mok`` twice is bitwise equal."""
    half = DTYPES[dtype_name]
    h = _setup(world, backend_env)
    try:
        dev = _device()
        kw = dict(num_experts=8 * world, topk=4, hidden=256, ffn_hidden=512,
                  moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-2)
        torch.manual_seed(0)
        a2a = h.build_moe_layer(h.moe_config("alltoall", ep_size=world, **kw), device=dev)
        mok = h.build_moe_layer(h.moe_config("mok", ep_size=world, **kw), device=dev)
        mok.load_state_dict(a2a.state_dict())
        a2a_half = h.build_moe_layer(h.moe_config("alltoall", ep_size=world,
                                                  dtype=half, **kw), device=dev)
        mok_half = h.build_moe_layer(h.moe_config("mok", ep_size=world,
                                                  dtype=half, **kw), device=dev)
        sd16 = {k: v.to(half) if torch.is_tensor(v) and v.is_floating_point() else v
                for k, v in a2a.state_dict().items()}
        a2a_half.load_state_dict(sd16)
        mok_half.load_state_dict(sd16)
        assert type(mok_half.token_dispatcher).__name__ == "MokTokenDispatcher"
        g = torch.Generator().manual_seed(100 + rank)
        x = torch.randn(512, 2, 256, generator=g).to(dev)
        gy = torch.randn(512, 2, 256, generator=g).to(dev)

        ref = _run_layer(a2a, x, gy)                       # fp32 alltoall: the reference
        ya, dxa, ga = _run_layer(a2a_half, x.to(half), gy.to(half))
        ym, dxm, gm = _run_layer(mok_half, x.to(half), gy.to(half))
        _assert_runs_bitwise(_run_layer(mok_half, x.to(half), gy.to(half)), (ym, dxm, gm),
                             "mok run 2 vs run 1")

        report = {}
        pairs = [("output", ym, ya, ref[0]), ("input_grad", dxm, dxa, ref[1])]
        pairs += [(f"grad:{k}", gm[k], ga[k], ref[2][k]) for k in gm]
        for name, m, a, r in pairs:
            torch.testing.assert_close(m.float(), a.float(), atol=2e-2, rtol=2e-2,
                                       msg=lambda s: f"{name}: mok vs alltoall: {s}")
            err_m = (m.float() - r.float()).abs().max().item()
            err_a = (a.float() - r.float()).abs().max().item()
            ulp = r.float().abs().max().item() * 2.0 ** -8
            assert err_m <= 2 * err_a + ulp, f"{name}: mok err {err_m} > 2x alltoall err {err_a}"
            report[name] = {"mok_vs_fp32": err_m, "alltoall_vs_fp32": err_a}
        return report
    finally:
        h.destroy_parallel()


# ------------------------------------------------------------- overlapped shared experts
class _RecordingSharedExpert(torch.nn.Module):
    """Stands in for Megatron's ``SharedExpertMLP`` overlap hooks (CPU: no streams): a small
    MLP computed across the hooks, each call appended to ``calls``."""

    def __init__(self, hidden, calls):
        super().__init__()
        g = torch.Generator().manual_seed(7)
        self.w1 = torch.nn.Parameter(torch.randn(hidden, 2 * hidden, generator=g) / hidden ** 0.5)
        self.w2 = torch.nn.Parameter(torch.randn(2 * hidden, hidden, generator=g) / hidden ** 0.5)
        self.calls = calls
        self._x = self._h = self._out = None

    def reference(self, x):
        return torch.relu(x @ self.w1) @ self.w2

    def wait_current_stream(self):
        self.calls.append("wait_current_stream")

    def pre_forward_comm(self, x):
        self.calls.append("pre_forward_comm")
        self._x = x

    def linear_fc1_forward_and_act(self, overlapped_comm_output=None):
        self.calls.append("fc1")
        self._h, self._x = torch.relu(self._x @ self.w1), None

    def linear_fc2_forward(self, overlapped_comm_output=None):
        self.calls.append("fc2")
        self._out, self._h = self._h @ self.w2, None

    def post_forward_comm(self):
        self.calls.append("post_forward_comm")

    def get_output(self):
        self.calls.append("get_output")
        out, self._out = self._out, None
        return out


def shared_expert_overlap_hooks_cpu(rank, world):
    """``moe_shared_expert_overlap`` on the reference backend: the dispatcher calls the shared
    expert's hooks in Megatron's order around its own communication (input copy and fc1
    before the dispatch, fc2 after the routed experts and before the combine, the output
    added last); the layer's output is the routed part plus the shared expert's, bitwise (the
    same sum as Megatron's unoverlapped path), and so is the input gradient up to the order
    of its terms."""
    import megatron_mok as mok

    h = _setup(world)
    try:
        kw = dict(num_experts=4 * world, topk=2, hidden=32, moe_router_load_balancing_type="none",
                  moe_aux_loss_coeff=0.0)
        torch.manual_seed(0)
        # The flag alone (no shared expert of Megatron's): the stub is handed over below.
        layer = h.build_moe_layer(h.moe_config("mok", ep_size=world, moe_shared_expert_overlap=True,
                                               **kw))
        disp = layer.token_dispatcher
        assert disp.shared_experts is None
        g = torch.Generator().manual_seed(100 + rank)
        x = torch.randn(8, 3, 32, generator=g)
        gy = torch.randn(8, 3, 32, generator=g)
        y_routed, dx_routed, _ = _run_layer(layer, x, gy)

        calls = []
        stub = _RecordingSharedExpert(32, calls)
        disp.set_shared_experts(stub)
        orig_dispatch, orig_combine = mok.Buffer.dispatch, mok.Buffer.combine

        def dispatch(self, *a, **k):
            calls.append("mok.dispatch")
            return orig_dispatch(self, *a, **k)

        def combine(self, *a, **k):
            calls.append("mok.combine")
            return orig_combine(self, *a, **k)

        mok.Buffer.dispatch, mok.Buffer.combine = dispatch, combine
        try:
            xx = x.clone().requires_grad_(True)
            y, _ = layer(xx)
            y.backward(gy)
        finally:
            mok.Buffer.dispatch, mok.Buffer.combine = orig_dispatch, orig_combine
        forward_calls = calls[:]
        expected = ["pre_forward_comm", "fc1", "mok.dispatch", "wait_current_stream", "fc2",
                    "post_forward_comm", "mok.combine", "get_output"]
        # the backward runs Megatron's own ops (combine backward = cached dispatch, etc.)
        assert forward_calls[:len(expected)] == expected, forward_calls
        assert "pre_forward_comm" not in forward_calls[len(expected):], forward_calls

        xs = x.clone().requires_grad_(True)
        shared_out = stub.reference(xs)
        _assert_bitwise(y.detach(), y_routed + shared_out.detach(), "output = routed + shared")
        shared_out.backward(gy)
        # x's gradient has three terms (router, routed experts, shared expert) that autograd
        # adds in its own order: equal up to that order (Megatron documents the same for
        # its overlap: TransformerConfig.moe_shared_expert_intermediate_size)
        torch.testing.assert_close(xx.grad, dx_routed + xs.grad, atol=1e-6, rtol=1e-6)
        assert stub.w1.grad is not None and float(stub.w1.grad.abs().sum()) > 0
        assert float(shared_out.abs().sum()) > 0

        # More tokens than the Buffer's T_max (fixed by the first dispatch: 24): the error
        # comes before the shared expert's hooks start. In a world of one rank the next forward
        # is unaffected; in a larger one the error stopped the group's Buffer (its peers would be
        # waiting in the dispatch: docs/CONTRACT.md "Errors"), and the next forward says so.
        del calls[:]
        with pytest.raises(ValueError, match="MOK_MAX_TOKENS_PER_RANK"):
            layer(torch.randn(9, 3, 32, generator=g))
        assert "pre_forward_comm" not in calls, calls
        if world == 1:
            y3, _ = layer(x.clone())
            _assert_bitwise(y3.detach(), y.detach(), "output after the rejected call")
        else:
            with pytest.raises(RuntimeError, match=f"stopped on rank {rank}.*MOK_MAX_TOKENS_PER_RANK"):
                layer(x.clone())
        return forward_calls
    finally:
        h.destroy_parallel()


def layer_num_sms_cpu(rank, world):
    """The dispatcher's SM budget (``MokTokenDispatcher.num_sms``): 48 in a layer where nothing
    runs beside MoK, the Buffer default (``None``) with overlapped shared experts, the knob
    when set, else Megatron's ``moe_flex_dispatcher_num_sms`` when set (0.19+; set here by hand
    on older configs), also with overlapped shared experts; layers whose budgets differ get
    Buffers of their own, equal ones share one. Returns the Buffers' ``num_sms`` in the order
    built."""
    from megatron_mok.megatron import dispatcher as D

    h = _setup(world)
    try:
        kw = dict(num_experts=4 * world, topk=2, hidden=32, moe_router_load_balancing_type="none",
                  moe_aux_loss_coeff=0.0)
        g = torch.Generator().manual_seed(7 + rank)
        x = torch.randn(8, 3, 32, generator=g)
        layers = []
        overlap = {"moe_shared_expert_overlap": True}
        for extra, knob, flex in (({}, None, None), (overlap, None, None), ({}, 16, None), ({}, None, None),
                                  ({}, None, 20), (overlap, None, 20), ({}, 16, 20)):
            torch.manual_seed(0)
            cfg = h.moe_config("mok", ep_size=world, **kw, **extra)
            if knob is not None:
                cfg.moe_mok_num_sms = knob        # MOK_NUM_SMS for this layer only
            if flex is not None:
                cfg.moe_flex_dispatcher_num_sms = flex
            layers.append(h.build_moe_layer(cfg))
        budgets = [layer.token_dispatcher.num_sms() for layer in layers]
        assert budgets == [D.LAYER_NUM_SMS, None, 16, D.LAYER_NUM_SMS, 20, 20, 16], budgets
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for layer in layers:
                layer(x.clone())
        # one Buffer takes its budget from the flex knob alone (layers 4 and 5 share it): it says so
        said = [str(w.message) for w in caught if "moe_flex_dispatcher_num_sms" in str(w.message)]
        assert len(said) == 1 and "20 SMs" in said[0] and "default here: 48" in said[0], said
        bufs = [layer.token_dispatcher.buffer for layer in layers]
        assert [b.num_sms for b in bufs] == budgets, [b.num_sms for b in bufs]
        assert bufs[0] is bufs[3] and bufs[2] is bufs[6] and bufs[4] is bufs[5]
        assert len({id(b) for b in bufs}) == 4
        cfg = h.moe_config("mok", ep_size=world, **kw)
        cfg.moe_flex_dispatcher_num_sms = 0
        with pytest.raises(D.MokConfigError, match="moe_flex_dispatcher_num_sms must be > 0"):
            h.build_moe_layer(cfg).token_dispatcher.num_sms()
        return [b.num_sms for b in bufs]
    finally:
        h.destroy_parallel()


def layer_router_padding(rank, world, backend_env=None):
    """``moe_router_padding_for_quantization`` through ``mok``: the dispatcher's Buffer pads
    each local expert's rows to Megatron's FP8 alignment (16) itself, so the experts see
    counts that are multiples of 16 (zero rows, prob 0, after each expert's rows); the
    layer's output and every gradient equal those of the same layer without the padding
    (bitwise on CPU; on GPUs up to the GEMMs' reduction over more rows). ``fp8`` is set on
    the config after it is built (no Transformer Engine here: the local experts do not read
    it; Megatron's alignment helper does). Returns the experts' counts seen per call."""
    h = _setup(world, backend_env)
    try:
        dev = _device()
        gpu = dev.type == "cuda"
        kw = dict(num_experts=4 * world, topk=2, hidden=64 if gpu else 32,
                  moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0)
        if gpu:
            kw["dtype"] = torch.bfloat16
        layers = []
        for pad in (False, True):
            torch.manual_seed(0)
            cfg = h.moe_config("mok", ep_size=world, **kw)
            if pad:
                cfg.moe_router_padding_for_quantization = True
                cfg.fp8 = "hybrid"
            layers.append(h.build_moe_layer(cfg, **({"device": dev, "dtype": torch.bfloat16} if gpu else {})))
        plain, padded = layers
        padded.load_state_dict(plain.state_dict())
        assert padded.token_dispatcher.expert_alignment() == 16
        assert plain.token_dispatcher.expert_alignment() == 1
        seen = []
        padded.experts.register_forward_pre_hook(
            lambda mod, args: seen.append([int(c) for c in args[1].tolist()]))
        g = torch.Generator().manual_seed(300 + rank)
        dt = torch.bfloat16 if gpu else torch.float32
        x = torch.randn(37, 1, kw["hidden"], generator=g).to(dt).to(dev)   # 37 tokens: odd counts
        gy = torch.randn(37, 1, kw["hidden"], generator=g).to(dt).to(dev)
        want = _run_layer(plain, x, gy)
        got = _run_layer(padded, x, gy)
        assert padded.token_dispatcher.buffer.expert_alignment == 16
        assert seen and all(c % 16 == 0 for c in seen[0]), seen
        assert sum(seen[0]) > 37 * 2 // world - 16 * len(seen[0]), seen   # real rows are in there
        if gpu:
            tol = dict(atol=2e-2, rtol=2e-2)
            torch.testing.assert_close(got[0].float(), want[0].float(), **tol)
            torch.testing.assert_close(got[1].float(), want[1].float(), **tol)
            for k in want[2]:
                torch.testing.assert_close(got[2][k].float(), want[2][k].float(), **tol,
                                           msg=lambda m: f"grad {k}: {m}")
        else:
            _assert_runs_bitwise(got, want, "padded vs plain")
        _assert_runs_bitwise(_run_layer(padded, x, gy), got, "padded run 2 vs run 1")
        return seen[0]
    finally:
        h.destroy_parallel()


def _gather_counts(routing_map, e_local):
    """Routes per local expert of this EP rank, summed over the EP ranks: ``[E_local]`` int64
    on the CPU (the rows each local expert receives in a dispatch of ``routing_map``)."""
    from megatron.core import parallel_state

    counts = routing_map.sum(dim=0).to(torch.int64)
    group = parallel_state.get_expert_model_parallel_group()
    if dist.get_world_size(group) > 1:
        dist.all_reduce(counts, group=group)      # [E]: every rank's routes to each expert
    me = dist.get_rank(group)
    return counts[me * e_local:(me + 1) * e_local].cpu()


def layer_drop_and_pad(rank, world, capacity_factor, drop_policy, with_alltoall=True,
                       backend_env=None):
    """Megatron's drop-and-pad (``moe_pad_expert_input_to_capacity``) through ``mok``.

    Layers with the same weights over the same EP group (EP = world size, 8 experts, top-2,
    61 tokens per rank): ``mok`` with drop-and-pad; Megatron's ``alltoall`` with drop-and-pad
    (``with_alltoall``: it cannot run a capacity above the token count, where its permute
    expects exactly ``capacity`` tokens per expert); ``mok`` with the same capacity factor and
    no padding (router-side dropping only); ``mok`` with drop-and-pad and
    ``moe_router_padding_for_quantization`` (``fp8`` set after the config is built, as in
    :func:`layer_router_padding`); ``mok`` with drop-and-pad and ``MOK_TOKENS_PER_EXPERT=device``
    (the counts on the layer's device instead of the host; the same rows and results). Checks:

    - the drop-and-pad layers' experts get ``N = capacity x EP`` rows per local expert
      (``capacity`` from Megatron's ``get_capacity``) and ``tokens_per_expert`` a host int64
      tensor ``[N] * E_local`` (alltoall's experts the same); with the alignment ``N`` rounded
      up to 16;
    - mok's rows of each expert are the unpadded layer's rows (the routes that survived the
      capacity, bitwise) then zero rows with prob 0: the router's padding routes never
      crossed the exchange;
    - output, input gradient and every parameter gradient: mok vs alltoall within 1e-5 in
      fp32 on CPU (see the test module for why not asserted bitwise), 2e-2 in bf16 on a GPU;
      mok with vs without the padding and with vs without the alignment bitwise on CPU (the
      same rows, zero rows appended; every expert gets >= 4 rows, see below), within bf16
      tolerance on a GPU (the GEMMs run over more rows); mok twice, and mok with the counts
      on the device, bitwise.

    Returns ``{"N", "rows" (routed rows received by this rank's experts), "zero_rows",
    "min_rows" (of one expert), "max_err_vs_alltoall" ({what: max abs difference}; empty
    without alltoall), "tokens" (T per rank), "routes" (T x K: this rank's routes before the
    capacity), "local_experts"}``.
    """
    from megatron.core.transformer.moe.moe_utils import get_capacity

    h = _setup(world, backend_env)
    try:
        dev = _device()
        gpu = dev.type == "cuda"
        E, K, T = 8, 2, 61                        # T odd: the capacity formula rounds up
        dt = torch.bfloat16 if gpu else torch.float32
        kw = dict(num_experts=E, topk=K, hidden=64 if gpu else 32,
                  moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
                  moe_expert_capacity_factor=capacity_factor, moe_token_drop_policy=drop_policy,
                  **({"dtype": dt} if gpu else {}))
        # name -> (dispatcher, drop-and-pad, moe_router_padding_for_quantization)
        variants = {"mok": ("mok", True, False), "mok_no_pad": ("mok", False, False),
                    "mok_aligned": ("mok", True, True), "mok_tpe_device": ("mok", True, False)}
        if with_alltoall:
            variants["alltoall"] = ("alltoall", True, False)
        layers = {}
        for name, (disp, pad, aligned) in variants.items():
            torch.manual_seed(0)
            cfg = h.moe_config(disp, ep_size=world, moe_pad_expert_input_to_capacity=pad, **kw)
            if aligned:
                cfg.moe_router_padding_for_quantization = True
                cfg.fp8 = "hybrid"
            if name == "mok_tpe_device":
                cfg.moe_mok_tokens_per_expert = "device"     # MOK_TOKENS_PER_EXPERT for it
            layers[name] = h.build_moe_layer(cfg, **({"device": dev, "dtype": dt} if gpu else {}))
            if name != "mok":
                layers[name].load_state_dict(layers["mok"].state_dict())
            want = "MoEAlltoAllTokenDispatcher" if disp == "alltoall" else "MokTokenDispatcher"
            assert type(layers[name].token_dispatcher).__name__ == want, name

        # what each layer's experts are handed, and its router's routing map
        seen = {name: [] for name in layers}
        routing = {name: [] for name in layers}
        for name, layer in layers.items():
            layer.experts.register_forward_pre_hook(
                lambda mod, args, name=name: seen[name].append(
                    (args[0].detach().clone(), args[1].clone(), args[2].detach().clone())))
            layer.router.register_forward_hook(
                lambda mod, args, out, name=name: routing[name].append(out[1].clone()))

        g = torch.Generator().manual_seed(300 + rank)
        x = torch.randn(T, 1, kw["hidden"], generator=g).to(dt).to(dev)
        gy = torch.randn(T, 1, kw["hidden"], generator=g).to(dt).to(dev)
        runs = {name: _run_layer(layer, x, gy) for name, layer in layers.items()}

        e_local = E // world
        cap = get_capacity(num_tokens=T * K, num_experts=E, capacity_factor=capacity_factor)
        n = cap * world
        n_aligned = -(-n // 16) * 16
        for name, rows in (("mok", n), ("alltoall", n), ("mok_aligned", n_aligned),
                           ("mok_tpe_device", n)):
            if name not in layers:
                continue
            tokens, tpe, probs = seen[name][0]
            on = dev.type if name == "mok_tpe_device" else "cpu"
            assert tpe.device.type == on and tpe.dtype == torch.int64, (name, tpe)
            assert tpe.tolist() == [rows] * e_local, (name, tpe.tolist(), rows)
            assert tokens.shape == (rows * e_local, kw["hidden"]), (name, tokens.shape)
            assert probs.shape == (rows * e_local,), (name, probs.shape)
        assert layers["mok_aligned"].token_dispatcher.buffer.expert_alignment == 16

        # The padded router's map has min(capacity, T) routes in every expert column; the
        # unpadded one's (the routes that survived the capacity) is inside it. mok's rows of
        # each expert: the unpadded layer's rows, then zero rows.
        pad_map, kept_map = routing["mok"][0], routing["mok_no_pad"][0]
        assert pad_map.sum(dim=0).tolist() == [min(cap, T)] * E, pad_map.sum(dim=0).tolist()
        assert not (kept_map & ~pad_map).any(), "a route kept without padding is not in the map"
        kept = _gather_counts(kept_map, e_local)
        k_tokens, k_tpe, k_probs = seen["mok_no_pad"][0]
        assert k_tpe.tolist() == kept.tolist(), (k_tpe.tolist(), kept.tolist())
        k_rows, k_pr = torch.split(k_tokens, kept.tolist()), torch.split(k_probs, kept.tolist())
        for name, rows in (("mok", n), ("mok_aligned", n_aligned)):
            tokens, _, probs = seen[name][0]
            for e in range(e_local):
                c = int(kept[e])
                t_e, p_e = tokens[e * rows:(e + 1) * rows], probs[e * rows:(e + 1) * rows]
                _assert_bitwise(t_e[:c], k_rows[e], f"{name}: expert {e}'s routed rows")
                _assert_bitwise(p_e[:c], k_pr[e], f"{name}: expert {e}'s routed probs")
                assert not t_e[c:].any() and not p_e[c:].any(), f"{name}: expert {e}'s zero rows"

        tol = dict(atol=2e-2, rtol=2e-2) if gpu else dict(atol=1e-5, rtol=1e-5)

        def parts(run):
            return {"output": run[0], "input_grad": run[1],
                    **{f"grad:{k}": v for k, v in run[2].items()}}

        def close(run, ref, what):
            got, want = parts(run), parts(ref)
            for k in want:
                torch.testing.assert_close(got[k].float(), want[k].float(), **tol,
                                           msg=lambda m: f"{k}, {what}: {m}")
            return {k: (got[k].float() - want[k].float()).abs().max().item() for k in want}

        err = close(runs["mok"], runs["alltoall"], "mok vs alltoall") if with_alltoall else {}
        if not gpu:
            # Precondition of the bitwise checks: CPU GEMMs of <= 3 rows take another kernel
            # (a GEMV-like path), whose rows differ in the last bit from the same rows in a
            # taller GEMM; with >= 4 rows each row's result does not depend on the row count.
            assert int(kept.min()) >= 4, f"an expert got {int(kept.min())} rows: use more tokens"
        for other in ("mok_no_pad", "mok_aligned"):
            if gpu:
                close(runs[other], runs["mok"], f"{other} vs mok")
            else:
                _assert_runs_bitwise(runs[other], runs["mok"], f"{other} vs mok")
        _assert_runs_bitwise(_run_layer(layers["mok"], x, gy), runs["mok"], "mok run 2 vs run 1")
        _assert_runs_bitwise(runs["mok_tpe_device"], runs["mok"], "counts on the device vs host")
        assert float(runs["mok"][0].abs().sum()) > 0
        assert all(float(v.abs().sum()) > 0 for v in runs["mok"][2].values())
        return {"N": n, "rows": int(kept.sum()), "zero_rows": int(n * e_local - kept.sum()),
                "min_rows": int(kept.min()), "max_err_vs_alltoall": err, "tokens": T,
                "routes": T * K, "local_experts": e_local}
    finally:
        h.destroy_parallel()


def layer_expert_tp(rank, world, etp, drop_and_pad=False, backend_env=None, tp=1):
    """Expert tensor parallelism through ``mok``: ``ETP = etp``, ``EP = world / etp``, each
    expert's fc1 split by rows and fc2 by columns over its ETP ranks (Megatron's
    ``SequentialMLP`` with ``expert_tensor_parallel_size``), against the same layer with every
    expert whole and local on each rank (``alltoall`` with EP = ETP = 1: no exchange), its
    weights put together from every rank's shards. Each rank's tokens through both layers:

    - the ETP ranks of one EP rank hand their experts bitwise the same rows, and as many per
      expert as all ranks route to it (the reference's counts summed over the ranks; with
      drop-and-pad ``capacity x EP x ETP`` each, ``alltoall``'s count);
    - output, input gradient and the router's gradient equal the reference's; each expert
      shard's weight gradient equals its slice of the reference's gradient summed over the
      ranks (within 1e-5 in fp32 on CPU, 2e-2 in bf16 on a GPU);
    - ``mok`` twice is bitwise equal;
    - Megatron's own expert TP (``alltoall`` with the same ETP: all-to-all over EP, all-gather
      and reduce-scatter over expert TP) with the same shards gives the same output and
      gradients (same tolerances). Not in shared-GPU mode (its gloo group and Megatron's CUDA
      collectives), nor with drop-and-pad on CPU (Megatron's reduce-scatter allocates on CUDA).

    With ``tp`` > 1 the layers also have attention tensor parallelism ``tp`` with sequence
    parallelism (each rank's tokens its sequence shard; the router's aux loss reduced over the
    TP group), as Megatron runs MoE layers under TP; ``etp = 1`` there is attention TP alone.

    Returns ``{"rows": rows this rank's experts got, "tokens_per_expert", "ep", "etp",
    "alltoall": whether Megatron's expert TP was compared}``.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe.moe_utils import get_capacity

    ep = world // etp
    h = _setup(ep, backend_env, etp_size=etp, tp_size=tp)
    try:
        dev = _device()
        gpu = dev.type == "cuda"
        dt = torch.bfloat16 if gpu else torch.float32
        E, K, T, H, F = 4 * ep, 2, 40, (64 if gpu else 32), 64
        L = E // ep
        kw = dict(num_experts=E, topk=K, hidden=H, ffn_hidden=F, add_bias_linear=False,
                  moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-2,
                  tensor_model_parallel_size=tp, sequence_parallel=tp > 1,
                  **({"dtype": dt} if gpu else {}))
        if drop_and_pad:
            kw.update(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True)
        on = {"device": dev, "dtype": dt} if gpu else {}
        torch.manual_seed(rank)       # each rank's own shards
        mok = h.build_moe_layer(h.moe_config("mok", ep_size=ep, expert_tensor_parallel_size=etp,
                                             **kw), **on)
        ref = h.build_moe_layer(h.moe_config("alltoall", ep_size=1, **kw),
                                pg_collection=h.single_rank_pg_collection(), **on)
        # Megatron's drop-and-pad reduce-scatter allocates on CUDA even for CPU tensors
        with_a2a = (not gpu and not drop_and_pad) or dist.get_backend() == "nccl"
        if with_a2a:
            a2a = h.build_moe_layer(h.moe_config("alltoall", ep_size=ep,
                                                 expert_tensor_parallel_size=etp, **kw), **on)
            a2a.load_state_dict(mok.state_dict())
        assert type(mok.token_dispatcher).__name__ == "MokTokenDispatcher"
        e_rank, t_rank = ps.get_expert_model_parallel_rank(), ps.get_expert_tensor_parallel_rank()
        assert mok.token_dispatcher.etp == etp

        # the reference's weights: every rank's expert shards put together, this rank's router
        own = {k: v.detach().cpu() for k, v in mok.state_dict().items() if torch.is_tensor(v)}
        shards = [None] * world
        dist.all_gather_object(shards, (e_rank, t_rank, {k: v for k, v in own.items()
                                                          if _EXPERT_KEY.match(k)}))
        pieces, full = {}, {k: v for k, v in own.items() if not _EXPERT_KEY.match(k)}
        for e, t, sd in shards:
            for k, v in sd.items():
                m = _EXPERT_KEY.match(k)
                pieces.setdefault(f"experts.local_experts.{e * L + int(m.group(1))}.{m.group(2)}",
                                  {})[t] = v
        for name, by_t in pieces.items():
            assert sorted(by_t) == list(range(etp)), (name, sorted(by_t))
            dim = 0 if "linear_fc1" in name else 1        # fc1 split by rows, fc2 by columns
            full[name] = torch.cat([by_t[t] for t in range(etp)], dim=dim)
        ref.load_state_dict({k: v.to(dev) for k, v in full.items()}, strict=True)

        seen = {"mok": [], "ref": []}     # what the experts are handed (a pre-hook returns None)
        for name, layer in (("mok", mok), ("ref", ref)):
            layer.experts.register_forward_pre_hook(
                lambda mod, args, name=name: seen[name].append(
                    (args[0].detach().float().cpu(), args[1].cpu())))
        g = torch.Generator().manual_seed(500 + rank)
        x = torch.randn(T, 1, H, generator=g).to(dt).to(dev)
        gy = torch.randn(T, 1, H, generator=g).to(dt).to(dev)
        y_m, dx_m, g_m = _run_layer(mok, x, gy)
        _assert_runs_bitwise(_run_layer(mok, x, gy), (y_m, dx_m, g_m), "mok run 2 vs run 1")
        y_r, dx_r, g_r = _run_layer(ref, x, gy)

        # rows: the same on every expert-TP rank of an EP rank; as many as all ranks route
        rows, tpe = seen["mok"][0]
        every = [None] * world
        dist.all_gather_object(every, (e_rank, t_rank, rows, tpe))
        for e, t, r2, c2 in every:
            if e == e_rank:
                _assert_bitwise(r2, rows, f"rows of EP rank {e}: expert-TP rank {t} vs {t_rank}")
                assert c2.tolist() == tpe.tolist(), (e, t, c2.tolist(), tpe.tolist())
        if drop_and_pad:
            cap = get_capacity(num_tokens=T * K, num_experts=E, capacity_factor=1.0)
            assert tpe.tolist() == [cap * world] * L, (tpe.tolist(), cap, world)
        else:
            routed = _sum_over_ranks(seen["ref"][0][1], dev)
            assert tpe.tolist() == routed[e_rank * L:(e_rank + 1) * L].tolist(), (tpe, routed)

        tol = dict(atol=2e-2, rtol=2e-2) if gpu else dict(atol=1e-5, rtol=1e-5)

        def close(a, b, what):
            torch.testing.assert_close(a.float().cpu(), b.float().cpu(), **tol,
                                       msg=lambda m: f"{what}: {m}")

        close(y_m, y_r, "output")
        close(dx_m, dx_r, "input grad")
        summed = {}
        for k in sorted(g_r):
            if _EXPERT_KEY.match(k):
                summed[k] = _sum_over_ranks(g_r[k].float(), dev)
        for k, v in g_m.items():
            m = _EXPERT_KEY.match(k)
            if not m:
                close(v, g_r[k], f"grad {k}")
                continue
            want = summed[f"experts.local_experts.{e_rank * L + int(m.group(1))}.{m.group(2)}"]
            dim = 0 if "linear_fc1" in k else 1
            close(v, want.chunk(etp, dim=dim)[t_rank], f"grad {k} (expert-TP shard {t_rank})")
        if with_a2a:
            y_a, dx_a, g_a = _run_layer(a2a, x, gy)
            close(y_m, y_a, "output vs alltoall's expert TP")
            close(dx_m, dx_a, "input grad vs alltoall's expert TP")
            for k, v in g_m.items():
                close(v, g_a[k], f"grad {k} vs alltoall's expert TP")
        assert float(y_m.float().abs().sum()) > 0
        assert all(float(v.abs().sum()) > 0 for v in g_m.values())
        return {"rows": int(rows.shape[0]), "tokens_per_expert": tpe.tolist(), "ep": ep, "etp": etp,
                "alltoall": with_a2a}
    finally:
        h.destroy_parallel()


def _sum_over_ranks(t, dev):
    """``t`` summed over the ranks (on ``dev``, which the backend can reduce), on the CPU."""
    t = t.to(dev).clone()
    dist.all_reduce(t)
    return t.cpu()


def expert_tp_group_order(rank, world):
    """:func:`expert_tp_problems` on 4 ranks: groups in Megatron's order (expert-TP rank
    fastest in the TPxEP group) pass; EP rank fastest instead is named (the routing would
    send each EP rank's tokens to the wrong ranks)."""
    from megatron_mok.megatron.dispatcher import expert_tp_problems

    def groups(fast):      # the groups of this rank when `fast` pairs vary fastest
        mine = None
        for pair in ([0, 1], [2, 3]) if fast else ([0, 2], [1, 3]):
            g = dist.new_group(pair)
            if rank in pair:
                mine = g
        return mine

    tp_ep = dist.new_group([0, 1, 2, 3])
    etp_fast, ep_slow = groups(True), groups(False)        # Megatron: etp [0,1], ep [0,2]
    ok = expert_tp_problems(ep_slow, etp_fast, tp_ep)
    bad = expert_tp_problems(etp_fast, ep_slow, tp_ep)     # ep [0,1], etp [0,2]
    return ok, bad


def layer_drop_and_pad_graph_gpu(rank, world, capacity_factor=1.0):
    """A Megatron MoE layer with drop-and-pad through ``mok`` captured whole (forward and
    backward) in one CUDA graph with ``torch.cuda.graph``, then replayed on new inputs copied
    into the static ones: output, input gradient and every parameter gradient bitwise equal to
    an eager run of the same layer on the same input. Checks that the dispatcher's
    drop-and-pad path is capture-safe (no host sync: the dispatch knows R = E_local x N and
    reads nothing while captured; the experts get host counts), the groundwork for Megatron's
    ``moe`` CUDA-graph scope (still refused at config time for mok). bf16, one GPU per rank."""
    h = _setup(world, "cuda")
    try:
        dev = _device()
        E, K, T, H, dt = 8, 2, 96, 64, torch.bfloat16
        cfg = h.moe_config("mok", ep_size=world, num_experts=E, topk=K, hidden=H, dtype=dt,
                           moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
                           moe_expert_capacity_factor=capacity_factor,
                           moe_pad_expert_input_to_capacity=True)
        torch.manual_seed(0)
        layer = h.build_moe_layer(cfg, device=dev, dtype=dt)
        x_s = torch.zeros(T, 1, H, dtype=dt, device=dev, requires_grad=True)
        gy_s = torch.zeros(T, 1, H, dtype=dt, device=dev)

        def load(it):
            g = torch.Generator().manual_seed(500 + 10 * rank + it)
            x = torch.randn(T, 1, H, generator=g).to(dt).to(dev)
            gy = torch.randn(T, 1, H, generator=g).to(dt).to(dev)
            with torch.no_grad():
                x_s.copy_(x)
                gy_s.copy_(gy)
            return x, gy

        def step():
            y, _ = layer(x_s)
            y.backward(gy_s)
            return y

        load(0)
        # The captured backward accumulates into these very tensors: keep them for the replays.
        grads = {k: torch.zeros_like(p) for k, p in layer.named_parameters()}
        params = dict(layer.named_parameters())
        for k, p in params.items():
            p.grad = grads[k]
        x_s.grad = torch.zeros_like(x_s)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):           # warm-up: the Buffer, caches, autograd state
            for _ in range(2):
                step()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y_g = step()
        for it in range(1, 5):
            x, gy = load(it)
            x_s.grad.zero_()
            for g in grads.values():
                g.zero_()
            graph.replay()
            torch.cuda.synchronize()
            layer.token_dispatcher.buffer.check_errors()
            got = (y_g.detach().clone(), x_s.grad.detach().clone(),
                   {k: g.clone() for k, g in grads.items()})
            for p in params.values():
                p.grad = None
            want = _run_layer(layer, x, gy)         # eager, into fresh .grad tensors
            for k, p in params.items():
                p.grad = grads[k]
            # The replay's gradients are 0 + g (accumulated into zeroed tensors): the same bits
            # as g, except that -0.0 becomes +0.0; give the eager ones that same step.
            want = (want[0], want[1] + 0, {k: g + 0 for k, g in want[2].items()})
            _assert_runs_bitwise(got, want, f"graph replay {it} vs eager, rank {rank}")
            assert float(want[0].abs().sum()) > 0
        return True
    finally:
        h.destroy_parallel()


def layer_shared_expert_overlap_gpu(rank, world, gate=False, comm_stream="current", backend_env="cuda"):
    """``moe_shared_expert_overlap`` with Megatron's ``SharedExpertMLP`` on its own CUDA stream,
    bf16: the ``mok`` layer with the overlap gives bitwise the output and parameter gradients
    of the same layer without it (the shared expert computes the same GEMMs, on another
    stream), its input gradient up to the order of its terms, bitwise again when repeated; and
    it agrees with Megatron's ``alltoall`` with the overlap within bf16 tolerance.
    ``comm_stream`` is the overlapped layer's ``MOK_COMM_STREAM`` (``high``: MoK's kernels on
    a high-priority stream of their own; the unoverlapped layer runs them on the current one)."""
    h = _setup(world, backend_env)
    try:
        dev = _device()
        kw = dict(num_experts=8 * world, topk=4, hidden=256, ffn_hidden=512,
                  moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-2,
                  moe_shared_expert_intermediate_size=384, moe_shared_expert_gate=gate,
                  dtype=torch.bfloat16)
        torch.manual_seed(0)
        layers = {}
        for name, disp, overlap in (("mok", "mok", False), ("mok_overlap", "mok", True),
                                    ("alltoall_overlap", "alltoall", True)):
            cfg = h.moe_config(disp, ep_size=world, moe_shared_expert_overlap=overlap, **kw)
            if name == "mok_overlap":
                cfg.moe_mok_comm_stream = comm_stream
            layers[name] = h.build_moe_layer(cfg, device=dev, dtype=torch.bfloat16)
        sd = layers["mok"].state_dict()
        for name in ("mok_overlap", "alltoall_overlap"):
            layers[name].load_state_dict(sd)
        over = layers["mok_overlap"]
        assert over.token_dispatcher.shared_experts is over.shared_experts is not None
        assert layers["mok"].token_dispatcher.shared_experts is None
        probe = torch.empty(1, device=dev)
        assert layers["mok"].token_dispatcher._comm_stream(probe) is None
        high = over.token_dispatcher._comm_stream(probe)
        assert (high is not None) == (comm_stream == "high"), comm_stream
        g = torch.Generator().manual_seed(100 + rank)
        x = torch.randn(512, 2, 256, generator=g).to(dev, torch.bfloat16)
        gy = torch.randn(512, 2, 256, generator=g).to(dev, torch.bfloat16)

        plain = _run_layer(layers["mok"], x, gy)
        y1, dx1, g1 = _run_layer(over, x, gy)
        ya, dxa, ga = _run_layer(layers["alltoall_overlap"], x, gy)
        _assert_runs_bitwise((y1, dx1, g1), plain, "mok, overlapped shared expert vs not",
                             input_grad=False)
        torch.testing.assert_close(dx1, plain[1], atol=2e-2, rtol=2e-2)
        _assert_runs_bitwise(_run_layer(over, x, gy), (y1, dx1, g1), "mok overlap run 2 vs run 1")
        report = {}
        for name, m, a in [("output", y1, ya), ("input_grad", dx1, dxa)] + \
                [(f"grad:{k}", g1[k], ga[k]) for k in g1]:
            torch.testing.assert_close(m.float(), a.float(), atol=2e-2, rtol=2e-2,
                                       msg=lambda s: f"{name}: mok vs alltoall (overlap): {s}")
            report[name] = (m.float() - a.float()).abs().max().item()
        assert any(k.startswith("shared_experts.") for k in g1), sorted(g1)
        assert all(float(v.abs().sum()) > 0 for k, v in g1.items() if k.startswith("shared_experts."))
        return report
    finally:
        h.destroy_parallel()


# ------------------------------------------------------------- 1F1B EP overlap
def _gpt_batches(rank, n, batch, seq, vocab, dev):
    """``n`` micro-batches of (tokens, positions, causal mask, labels), seeded per rank."""
    g = torch.Generator().manual_seed(500 + rank)
    causal = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1).view(1, 1, seq, seq)
    pos = torch.arange(seq).view(1, -1).expand(batch, seq).contiguous()
    out = []
    for _ in range(n):
        seqs = torch.randint(0, vocab, (batch, seq + 1), generator=g)
        out.append(tuple(t.to(dev) for t in (seqs[:, :-1].contiguous(), pos, causal,
                                              seqs[:, 1:].contiguous())))
    return out


def _pop_grads(model):
    """``{name: grad}`` of the parameters that have one (copies), every ``.grad`` cleared."""
    grads = {k: p.grad.detach().clone() for k, p in model.named_parameters() if p.grad is not None}
    for p in model.parameters():
        p.grad = None
    return grads


def _train_step(model, batches):
    """One ``forward_backward_no_pipelining`` over ``batches`` (the 1F1B EP overlap schedule
    when the model's config asks for it): ``(losses [n], {param: grad})``."""
    from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining

    from megatron_mok.megatron.harness import gpt_forward_step

    _pop_grads(model)
    store = forward_backward_no_pipelining(
        forward_step_func=gpt_forward_step, data_iterator=iter(batches), model=[model],
        num_microbatches=len(batches), seq_length=batches[0][0].shape[1],
        micro_batch_size=batches[0][0].shape[0], forward_only=False)
    losses = torch.stack([d["lm loss"].float().cpu() for d in store])
    grads = _pop_grads(model)
    return losses, grads


class _FakeStream:
    """A stand-in for ``torch.cuda.Stream`` / ``Event`` on CPU: every wait and record is a no-op
    (CPU work runs in program order, which is what the events order on a GPU)."""

    cuda_stream = 0

    def __init__(self, *a, **k):
        pass

    def record(self, *a, **k):
        pass

    def wait(self, *a, **k):
        pass

    def wait_event(self, *a, **k):
        pass

    def wait_stream(self, *a, **k):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True


@contextlib.contextmanager
def _cpu_cuda_streams():
    """Megatron's 1F1B EP overlap schedule on CPU tensors: its streams, events, NVTX ranges and
    ``record_stream`` calls become no-ops, so the schedule's data flow (the split nodes, the
    detached inputs, the freed ones, the interleaved micro-batches) runs as on a GPU, without
    the concurrency."""
    import torch.cuda.nvtx as nvtx

    saved = [(torch.cuda, n, getattr(torch.cuda, n)) for n in ("Event", "Stream", "stream", "current_stream")]
    saved += [(nvtx, n, getattr(nvtx, n)) for n in ("range_push", "range_pop", "range")]
    saved.append((torch.Tensor, "record_stream", torch.Tensor.record_stream))
    one = _FakeStream()
    torch.cuda.Event = torch.cuda.Stream = _FakeStream
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()
    torch.cuda.current_stream = lambda *a, **k: one
    nvtx.range_push = nvtx.range_pop = lambda *a, **k: None
    nvtx.range = lambda *a, **k: contextlib.nullcontext()
    torch.Tensor.record_stream = lambda self, *a, **k: None
    try:
        yield
    finally:
        for obj, name, val in saved:
            setattr(obj, name, val)


def _overlap_step_cpu(model, batches):
    """Megatron's ``combined_1f1b_schedule_for_no_pipelining`` over ``batches`` on CPU (under
    :func:`_cpu_cuda_streams`; ``forward_backward_no_pipelining`` itself allocates on CUDA):
    ``(losses [n], {param: grad})``."""
    import contextlib as _cl

    from megatron.core.pipeline_parallel.combined_1f1b import combined_1f1b_schedule_for_no_pipelining

    from megatron_mok.megatron.harness import gpt_forward_step

    _pop_grads(model)
    store = []
    combined_1f1b_schedule_for_no_pipelining(
        gpt_forward_step, iter(batches), model, len(batches), None, None, store, model.config,
        False, None, False, _cl.nullcontext, torch.zeros([], dtype=torch.int),
        lambda is_first: is_first)
    losses = torch.stack([d["lm loss"].float() for d in store])
    grads = _pop_grads(model)
    return losses, grads


def _plain_step_cpu(model, batches):
    """What ``forward_backward_no_pipelining`` does without the overlap, written out: each
    micro-batch's loss / n, backward; ``(losses [n], {param: grad})``."""
    _pop_grads(model)
    losses = []
    for tokens, pos, mask, labels in batches:
        loss = model(tokens, pos, mask, labels=labels).float().mean()
        (loss / len(batches)).backward()
        losses.append(loss.detach())
    grads = _pop_grads(model)
    return torch.stack(losses), grads


@contextlib.contextmanager
def _ep_overlap_spied(record):
    """Every ``MokTokenDispatcher.token_dispatch`` call reported to ``record(dispatcher)``
    first; undone on exit."""
    from megatron_mok.megatron import dispatcher as D

    orig = D.MokTokenDispatcher.token_dispatch

    def spy(self, *a, **k):
        record(self)
        return orig(self, *a, **k)

    D.MokTokenDispatcher.token_dispatch = spy
    try:
        yield
    finally:
        D.MokTokenDispatcher.token_dispatch = orig


def _ep_overlap_models(h, ep, variants, *, seq, vocab, hidden, ffn, cpu, **extra):
    """2-layer bf16 ``GPTModel`` s (local spec, EP = ``ep``, a shared expert and a bf16 gate in
    every MoE layer: both keep the layernorm output that mok's dispatch input is a view of, so
    the overlap must not free it), one per ``(name, dispatcher, overlap)`` of ``variants``,
    all with the first one's weights."""
    from megatron.core.models.gpt import GPTModel

    spec = h.local_layer_spec(4 * ep, cpu_router=cpu)
    dev = torch.device("cpu") if cpu else _device()
    models = {}
    for name, disp, overlap in variants:
        cfg = h.moe_config(disp, ep_size=ep, num_layers=2, num_experts=4 * ep, topk=2,
                           hidden=hidden, ffn_hidden=ffn, dtype=torch.bfloat16,
                           overlap_moe_expert_parallel_comm=overlap, hidden_dropout=0.0,
                           attention_dropout=0.0, init_method_std=0.02, moe_router_dtype=None,
                           moe_shared_expert_intermediate_size=hidden, **extra)
        torch.manual_seed(0)
        models[name] = GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=vocab,
                                max_sequence_length=seq, position_embedding_type="learned_absolute"
                                ).to(dev, torch.bfloat16)
    first = models[variants[0][0]].state_dict()
    for m in list(models.values())[1:]:
        m.load_state_dict(first)
    return models


def gpt_ep_overlap_cpu(rank, world, drop_and_pad=False, etp=1):
    """The 1F1B EP overlap's data flow with ``mok`` on CPU (reference backend, gloo, EP =
    world / etp): :func:`_ep_overlap_models`, 3 micro-batches through Megatron's
    ``combined_1f1b_schedule_for_no_pipelining`` (streams stubbed: :func:`_cpu_cuda_streams`)
    against the same model stepped plainly: losses and every gradient bitwise; every dispatch
    went through a split-schedule node. ``drop_and_pad``: the same with Megatron's drop-and-pad
    (capacity factor 1.0); ``etp``: with expert tensor parallelism (the Buffer over the TPxEP
    group). Returns ``{"dispatches": int, "losses": [float]}``."""
    from megatron_mok.megatron import dispatcher as D

    ep = world // etp
    h = _setup(ep, etp_size=etp)
    calls = []
    try:
        with _ep_overlap_spied(lambda d: calls.append(d.config.overlap_moe_expert_parallel_comm)):
            h.enable_cpu_megatron(on_cpu=True)
            seq, batch, vocab = 16, 2, 64
            models = _ep_overlap_models(
                h, ep, [("plain", "mok", False), ("overlap", "mok", True)], seq=seq, vocab=vocab,
                hidden=32, ffn=64, cpu=True, moe_router_load_balancing_type="none",
                moe_aux_loss_coeff=0.0, expert_tensor_parallel_size=etp,
                **({"moe_expert_capacity_factor": 1.0, "moe_pad_expert_input_to_capacity": True}
                   if drop_and_pad else {}))
            batches = _gpt_batches(rank, 3, batch, seq, vocab, torch.device("cpu"))
            l0, g0 = _plain_step_cpu(models["plain"], batches)
            calls.clear()
            with _cpu_cuda_streams():
                l1, g1 = _overlap_step_cpu(models["overlap"], batches)
        assert calls == [True] * 6, calls                   # 3 micro-batches x 2 MoE layers
        # MoK's SM budget: 48 alone, the Buffer default beside another micro-batch's compute
        budgets = {n: m.decoder.layers[0].mlp.token_dispatcher.buffer.num_sms for n, m in models.items()}
        assert budgets == {"plain": D.LAYER_NUM_SMS, "overlap": None}, budgets
        assert all(m.decoder.layers[0].mlp.token_dispatcher.buffer.world_size == world
                   for m in models.values())         # the TPxEP group with expert TP
        _assert_bitwise(l1, l0, "losses, mok with the 1F1B EP overlap (CPU) vs plain steps")
        assert g0.keys() == g1.keys() and len(g0) == len(list(models["plain"].parameters()))
        for k in g0:     # CPU ops in the same order: the schedule changes no sum here
            _assert_bitwise(g1[k], g0[k], f"grad {k}: overlap vs plain steps (CPU)")
        assert any(".experts." in k for k in g1) and any("shared_experts" in k for k in g1)
        assert all(float(v.float().abs().sum()) > 0 for v in g1.values())
        return {"dispatches": len(calls), "losses": l1.tolist()}
    finally:
        h.destroy_parallel()


def gpt_ep_overlap_cpu_with_megatron_rule(rank, world, node):
    """:func:`gpt_ep_overlap_cpu` with Megatron's own ``should_free_input`` for ``node`` (the
    rule ``install()`` overrides for mok): returns the error it ends in, or ``None``."""
    import megatron_mok.megatron as mm
    from megatron_mok.megatron import _patch

    mm.install()
    mod = _patch.free_input_module()
    patched = mod.should_free_input

    def rule(name, *a, **k):
        return (patched.__wrapped__ if name == node else patched)(name, *a, **k)

    mod.should_free_input = rule
    try:
        gpt_ep_overlap_cpu(rank, world)
        return None
    except (RuntimeError, AssertionError) as e:
        return f"{type(e).__name__}: {str(e).splitlines()[0]}"
    finally:
        mod.should_free_input = patched


def gpt_ep_overlap_gpu(rank, world):
    """Megatron's 1F1B EP overlap (``overlap_moe_expert_parallel_comm``) over :func:`_ep_overlap_models` on the GPU, 3 micro-batches: with
    ``mok`` the dispatch ran on Megatron's communication stream (the split schedule ran), the
    losses are bitwise those of the same model without the overlap (the forward does the same
    math), and the gradients agree with it and with ``alltoall`` under the overlap within bf16
    tolerance (the schedule sums some gradients in another order). Returns the largest
    differences and whether the mok gradients were bitwise equal."""
    h = _setup(world, "cuda")
    streams = []
    try:
        with _ep_overlap_spied(lambda d: streams.append(torch.cuda.current_stream().cuda_stream)):
            seq, batch, vocab = 64, 2, 256
            models = _ep_overlap_models(
                h, world, [("mok", "mok", False), ("mok_overlap", "mok", True),
                           ("alltoall_overlap", "alltoall", True)],
                seq=seq, vocab=vocab, hidden=128, ffn=256, cpu=False)
            layer = models["mok_overlap"].decoder.layers[0].mlp
            assert layer.token_dispatcher.num_sms() is None     # compute runs beside MoK here
            batches = _gpt_batches(rank, 3, batch, seq, vocab, _device())
            default = torch.cuda.current_stream().cuda_stream
            runs = {}
            for name in ("mok", "mok_overlap", "alltoall_overlap"):
                streams.clear()
                runs[name] = _train_step(models[name], batches)
                if name == "mok":
                    assert streams and all(s == default for s in streams), streams
                elif name == "mok_overlap":
                    # 3 micro-batches x 2 layers, each dispatch on Megatron's comm stream
                    assert len(streams) == 6 and all(s != default for s in streams), streams
        (l0, g0), (l1, g1), (la, ga) = runs["mok"], runs["mok_overlap"], runs["alltoall_overlap"]
        assert g0.keys() == g1.keys() == ga.keys() and len(g0) == len(list(models["mok"].parameters())), \
            (sorted(g0), sorted(g1), sorted(ga))
        _assert_bitwise(l1, l0, "losses, mok with the 1F1B EP overlap vs without")
        report = {"losses": l1.tolist(), "grads_bitwise_vs_no_overlap": True}
        for k in g0:
            if not torch.equal(g1[k], g0[k]):
                report["grads_bitwise_vs_no_overlap"] = False
            torch.testing.assert_close(g1[k].float(), g0[k].float(), atol=2e-2, rtol=2e-2,
                                       msg=lambda m: f"grad {k}: mok overlap vs no overlap: {m}")
            torch.testing.assert_close(g1[k].float(), ga[k].float(), atol=2e-2, rtol=2e-2,
                                       msg=lambda m: f"grad {k}: mok vs alltoall (overlap): {m}")
        torch.testing.assert_close(l1, la, atol=1e-2, rtol=1e-2)
        assert any(".experts." in k for k in g1) and all(float(v.abs().sum()) > 0 for v in g1.values())
        report["max_grad_diff_vs_alltoall"] = max((g1[k].float() - ga[k].float()).abs().max().item() for k in g1)
        return report
    finally:
        h.destroy_parallel()


# ------------------------------------------------------------- device errors, re-initialisation
def _device_error_backend_class():
    """The reference backend with the CUDA backend's error contract, for CPU tests: a kernel
    error is recorded "on the device" by the call that hits it, which returns normally (its
    outputs would be invalid), and is raised only by ``check_errors`` (the CUDA backend reads
    its device report there: a sync and a 32-byte copy). ``fail_in``: the method whose next
    call records the error (``"dispatch_cached"``: the combine's backward; ``"combine"``: a
    forward combine or the dispatch's backward); ``checks``: ``check_errors`` calls so far."""
    from megatron_mok.backends.reference import ReferenceBackend
    from megatron_mok.cuda.errors import MokDeviceError

    class DeviceErrorBackend(ReferenceBackend):
        def __init__(self, buf):
            super().__init__(buf)
            self.fail_in = None
            self.recorded = None
            self.checks = 0

        def _maybe_record(self, where):
            if self.fail_in == where and self.recorded is None:
                self.recorded = (f"megatron_mok: rank {self.buf.rank}: (test) device error "
                                 f"recorded in {where}")

        def dispatch_cached(self, x, handle):
            out = super().dispatch_cached(x, handle)
            self._maybe_record("dispatch_cached")
            return out

        def combine(self, expert_out, handle, grad_probs=None):
            out = super().combine(expert_out, handle, grad_probs)
            self._maybe_record("combine")
            return out

        def check_errors(self):
            self.checks += 1
            if self.recorded is not None:
                raise MokDeviceError(self.recorded)

    return DeviceErrorBackend


@contextlib.contextmanager
def _device_error_backend():
    """``Buffer``s made inside use :func:`_device_error_backend_class` as their reference backend
    (``Buffer._get_backend`` looks the class up at each new backend)."""
    from megatron_mok.backends import reference

    orig = reference.ReferenceBackend
    reference.ReferenceBackend = _device_error_backend_class()
    try:
        yield
    finally:
        reference.ReferenceBackend = orig


class _TorchCpuZeros(type(torch)):
    """``torch`` for Megatron's schedules module on CPU: ``zeros(..., device="cuda")`` (the
    token counter of ``forward_backward_no_pipelining``, its only CUDA allocation on this
    path) made on the CPU instead; everything else is torch's."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def zeros(*args, device=None, **kwargs):
        return torch.zeros(*args, device=None if device == "cuda" else device, **kwargs)


@contextlib.contextmanager
def _schedules_on_cpu():
    from megatron.core.pipeline_parallel import schedules

    orig = schedules.torch
    schedules.torch = _TorchCpuZeros("torch")
    try:
        yield
    finally:
        schedules.torch = orig


def step_device_error_cpu(rank, world):
    """The per-step device-error check (``install()``: item 6 of ``_patch.py``) on CPU, EP =
    world: a 2-layer ``GPTModel`` with ``mok`` layers stepped by Megatron's own
    ``forward_backward_no_pipelining`` (2 micro-batches) over a reference backend with the CUDA
    backend's error contract (:func:`_device_error_backend_class`).

    A clean step returns and checked the Buffer once; a step in which the combine's backward
    records an error raises it from that same ``forward_backward_no_pipelining`` call (after
    the whole backward, before it returns: the optimizer step after it never runs), not at the
    next step's dispatch. With ``MOK_CHECK_ERRORS=off`` the same step returns. Returns
    ``{"clean_checks", "raised", "off_returned"}``."""
    from megatron_mok.cuda.errors import MokDeviceError

    h = _setup(world)
    os.environ.pop("MOK_CHECK_ERRORS", None)
    try:
        with _device_error_backend(), _schedules_on_cpu():
            h.enable_cpu_megatron(on_cpu=True)
            model = _ep_overlap_models(
                h, world, [("mok", "mok", False)], seq=16, vocab=64, hidden=32, ffn=64, cpu=True,
                moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0)["mok"]
            batches = _gpt_batches(rank, 2, 2, 16, 64, torch.device("cpu"))
            _train_step(model, batches)
            buf = model.decoder.layers[0].mlp.token_dispatcher.buffer
            assert model.decoder.layers[1].mlp.token_dispatcher.buffer is buf   # one shared Buffer
            backend = buf._backends["reference"]
            report = {"clean_checks": backend.checks}
            # The combine's backward (a cached dispatch) records the error in the next step.
            backend.fail_in = "dispatch_cached"
            stepped = []
            try:
                _train_step(model, batches)
                stepped.append("optimizer step")       # where train_step would step
            except MokDeviceError as e:
                report["raised"] = str(e)
            assert not stepped, "the step with a device error reached the optimizer step"
            # MOK_CHECK_ERRORS=off: no check after the schedule (the error stays recorded)
            os.environ["MOK_CHECK_ERRORS"] = "off"
            checks = backend.checks
            _train_step(model, batches)
            report["off_returned"] = backend.checks == checks
        return report
    finally:
        os.environ.pop("MOK_CHECK_ERRORS", None)
        h.destroy_parallel()


def reinit_resets_buffers(rank, world, cycles=3):
    """Megatron's ``destroy_model_parallel()`` then ``initialize_model_parallel()`` (a
    re-initialised model, e.g. Megatron-LM's in-process restart), ``cycles`` times, a MoE
    layer run forward and backward in each: after each destroy the shared Buffers are destroyed
    and both caches are empty; each new layer gets a new Buffer, bound to its own (new) group.
    Returns the number of cached Buffers after the last cycle."""
    from megatron.core import parallel_state

    from megatron_mok.megatron import dispatcher as D

    h = _setup(world)
    try:
        old = None
        for _ in range(cycles):
            layer = h.build_moe_layer(h.moe_config("mok", ep_size=world, num_experts=4 * world,
                                                   topk=2, hidden=32))
            y, _ = layer(torch.randn(8, 1, 32, requires_grad=True))
            y.sum().backward()
            d = layer.token_dispatcher
            buf = d.buffer
            assert buf is not old and not buf._destroyed
            assert buf.group is d.group is parallel_state.get_expert_model_parallel_group()
            if old is not None:
                assert buf.group is not old.group
            assert len(D._BUFFERS) == 1, D._BUFFERS
            parallel_state.destroy_model_parallel()
            assert buf._destroyed, "destroy_model_parallel left the Buffer of its groups alive"
            assert not D._BUFFERS and not D._T_MAX, (D._BUFFERS, D._T_MAX)
            old = buf
            h.init_parallel(world)
        return len(D._BUFFERS)
    finally:
        h.destroy_parallel()


# ------------------------------------------------------------- partial CUDA graphs
def _split_forward(layer, x, attrs=None):
    """``MoELayer`` forward in the three pieces Megatron's partial CUDA graphs run it in
    (``fwd_execution_map``: route + preprocess, expert compute, postprocess). Between the first
    two, ``attrs`` (a callable) may replace the dispatcher's ``cudagraph_attrs`` tensors, as
    Megatron does from the router graph's outputs. Returns ``(y, route outputs, attrs seen)``."""
    disp = layer.token_dispatcher
    full = layer.fwd_execution_map
    try:
        layer.fwd_execution_map = "route"
        hidden, probs, shared = layer(x, intermediate_tensors=())
        seen = {n: getattr(disp, n) for n in disp.cudagraph_attrs
                if torch.is_tensor(getattr(disp, n, None))}
        if attrs is not None:
            layer.fwd_execution_map = full       # attrs may run whole calls of the layer
            attrs(seen)
        layer.fwd_execution_map = "expert_compute"
        out, bias = layer(None, intermediate_tensors=(hidden, probs))
        assert bias is None
        layer.fwd_execution_map = "postprocess"
        y = layer(None, intermediate_tensors=(out, shared))
    finally:
        layer.fwd_execution_map = full
    return y, seen


def _partial_capture_case(h, world, rank, drop_and_pad, seed, **config):
    """The CPU partial-capture checks' layer (mok, EP = ``world``, reference backend) and
    inputs: ``x1, gy1`` of 40 tokens, and ``x2``: fewer tokens (with drop-and-pad a smaller
    capacity) in another ``[S, B]`` shape, for an eager call between capture and replay."""
    kw = dict(num_experts=4 * world, topk=2, hidden=32, moe_router_load_balancing_type="none",
              moe_aux_loss_coeff=0.0, **config)
    if drop_and_pad:
        kw.update(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True)
    torch.manual_seed(0)
    layer = h.build_moe_layer(h.moe_config("mok", ep_size=world, **kw))
    g = torch.Generator().manual_seed(seed + rank)
    x1, gy1 = torch.randn(40, 1, 32, generator=g), torch.randn(40, 1, 32, generator=g)
    return layer, x1, gy1, torch.randn(12, 2, 32, generator=g)


def partial_capture_attrs_cpu(rank, world, drop_and_pad):
    """What Megatron's partial CUDA graphs (``moe_router`` + ``moe_preprocess``) do to the
    dispatcher, on CPU: the router and ``dispatch_preprocess`` run in one piece, the dispatch
    later, and between them Megatron may run other calls of the layer (an eager call of
    another token count) before it hands back the tensors the dispatcher names in
    ``cudagraph_attrs``. Checks: mok names exactly its top-k ids; with them handed back after
    an eager call of fewer tokens, the split forward (output, input and parameter gradients)
    is bitwise the whole forward of the same input, drop-and-pad included (its capacity comes
    from the dispatched token count, not from the last preprocess); without them the dispatch
    raises instead of using the other call's routing. The eager call in between has another
    ``[S, B]`` shape too: the input's shape must come back with the ids."""
    h = _setup(world)
    try:
        layer, x1, gy1, x2 = _partial_capture_case(h, world, rank, drop_and_pad, 40)
        disp = layer.token_dispatcher
        assert disp.cudagraph_attrs == ["_topk_idx"], disp.cudagraph_attrs

        want = _run_layer(layer, x1, gy1)

        def split_run(attrs):
            xx = x1.clone().requires_grad_(True)
            y, seen = _split_forward(layer, xx, attrs)
            y.backward(gy1)
            return (y.detach(), xx.grad.detach(), _take_grads(layer)), seen

        saved = {}

        def interleave(seen):
            # Keep the router piece's tensors (a graph's static outputs), run an eager call of
            # another token count, then hand them back.
            saved.update({n: t.clone() for n, t in seen.items()})
            with torch.no_grad():
                layer(x2)
            assert disp._topk_idx is None
            for n, t in saved.items():
                setattr(disp, n, t)

        got, seen = split_run(interleave)
        # [S, B, K]: the input's shape travels with the ids
        assert sorted(seen) == ["_topk_idx"] and seen["_topk_idx"].shape == (40, 1, 2), seen
        _assert_runs_bitwise(got, want, f"split forward with the ids handed back, rank {rank}")
        assert float(want[0].abs().sum()) > 0

        def lose(seen):
            with torch.no_grad():
                layer(x2)                       # consumes its own ids; x1's are not handed back

        with pytest.raises(RuntimeError, match="needs the top-k ids"):
            split_run(lose)
        return True
    finally:
        h.destroy_parallel()


def te_partial_capture_cpu(rank, world, drop_and_pad):
    """The Transformer Engine impl's partial capture (``cuda_graph_impl="transformer_engine"``,
    ``moe_router`` + ``moe_preprocess``) through Megatron's own code, on CPU without TE: while
    "capturing" (Megatron's ``is_graph_capturing`` made to say so) the ``MoELayer`` returns
    early after the preprocess with ``[hidden, probs, *dispatcher attrs]`` (its
    ``MoECudaGraphPartialCaptureSignal``), from which Megatron learns ``valid_cudagraph_attrs``;
    at "replay" ``TransformerLayer`` sets those attrs from the graph's outputs, puts hidden and
    probs in the layer's ``cudagraph_tensor_store`` and runs the layer, which skips router and
    preprocess. Here, with an eager call of another shape in between, that resumed forward
    (output, input and parameter gradients) is bitwise the plain forward of the same input."""
    h = _setup(world)
    from megatron.core.transformer.moe import moe_utils

    try:
        layer, x1, gy1, x2 = _partial_capture_case(
            h, world, rank, drop_and_pad, 60, cuda_graph_impl="transformer_engine",
            **h.graph_scope_kwargs(["moe_router", "moe_preprocess"]))
        disp = layer.token_dispatcher
        want = _run_layer(layer, x1, gy1)          # not capturing, empty store: plain forward

        xx = x1.clone().requires_grad_(True)
        capturing = moe_utils.is_graph_capturing
        moe_utils.is_graph_capturing = lambda: True
        try:
            outs = layer(xx)                        # the graph's outputs
        finally:
            moe_utils.is_graph_capturing = capturing
        assert disp.valid_cudagraph_attrs == ["_topk_idx"], disp.valid_cudagraph_attrs
        assert isinstance(outs, (list, tuple)) and len(outs) == 3, type(outs)
        hidden, probs, ids = outs
        assert ids.shape == (40, 1, 2) and ids.dtype == torch.int64, ids.shape
        with torch.no_grad():
            layer(x2)                               # an eager call of another shape
        for name, t in zip(disp.valid_cudagraph_attrs, [ids]):   # TransformerLayer's replay
            setattr(disp, name, t)
        layer.cudagraph_tensor_store.set(hidden_states=hidden, probs=probs)
        calls = []
        preprocess = disp.dispatch_preprocess
        disp.dispatch_preprocess = lambda *a, **k: calls.append(1) or preprocess(*a, **k)
        try:
            y, bias = layer(hidden)
        finally:
            layer.cudagraph_tensor_store.clear()
            del disp.dispatch_preprocess            # the class's method again
        assert bias is None and calls == [], calls   # router and preprocess were skipped
        y.backward(gy1)
        _assert_runs_bitwise((y.detach(), xx.grad.detach(), _take_grads(layer)), want,
                             f"TE-impl partial capture, resumed vs plain, rank {rank}")
        return True
    finally:
        h.destroy_parallel()


def layer_partial_graphs_gpu(rank, world, drop_and_pad=False, shared=None):
    """Megatron's own CUDA graphs (``cuda_graph_impl="local"``, scopes ``moe_router`` +
    ``moe_preprocess``) over a ``MoETransformerLayer`` with ``mok``, dropless or drop-and-pad:
    the router and ``dispatch_preprocess`` replay from a graph, MoK's dispatch, the experts and
    the combine run eagerly, ``combine_postprocess`` and the residual replay from a second
    graph. One recorded iteration, ``create_cudagraphs()``, then four on new inputs: output,
    input gradient and every parameter gradient (graphed parameters accumulate into
    ``main_grad``, as under Megatron's DDP) bitwise equal to an eager twin of the layer (same
    weights, no graphs). The replays must really replay: the dispatcher's Python
    ``dispatch_preprocess`` does not run in them while its ``token_dispatch`` runs in each.
    ``shared``: ``None``, or ``"plain"`` (a shared expert, computed inside the router graph),
    or ``"overlap"`` (``moe_shared_expert_overlap``: refused at config time with the local
    impl, see ``config_problems``). bf16, one GPU per rank."""
    h = _setup(world, "cuda")
    from megatron.core.transformer import cuda_graphs

    h.use_cudagraphable_rng(1234)       # the next worker gets a plain tracker back (finally)
    try:
        dev = _device()
        E, K, H, dt = 8, 2, 64, torch.bfloat16
        # No dropout: the twins would draw different masks.
        kw = dict(num_experts=E, topk=K, hidden=H, ffn_hidden=128, dtype=dt,
                  moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
                  hidden_dropout=0.0, attention_dropout=0.0)
        if drop_and_pad:
            kw.update(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True)
        if shared is not None:
            kw.update(moe_shared_expert_intermediate_size=96,
                      moe_shared_expert_overlap=shared == "overlap")
        torch.manual_seed(0)
        graphed = h.build_moe_transformer_layer(h.moe_config(
            "mok", ep_size=world, cuda_graph_impl="local",
            **h.graph_scope_kwargs(["moe_router", "moe_preprocess"]), **kw), dev, dt)
        eager = h.build_moe_transformer_layer(h.moe_config("mok", ep_size=world, **kw), dev, dt)
        eager.load_state_dict(graphed.state_dict())
        assert graphed.use_partial_cudagraphs and not getattr(eager, "use_partial_cudagraphs", False)
        disp = graphed.mlp.token_dispatcher
        assert type(disp).__name__ == "MokTokenDispatcher"
        params = dict(graphed.named_parameters())
        for p in params.values():
            p.main_grad = torch.zeros_like(p, dtype=torch.float32)

        S, B = 48, 2

        def run(layer, x, gy):
            xx = x.clone().requires_grad_(True)
            y, _ = layer(xx, attention_mask=None)
            if isinstance(y, tuple):
                # megatron-core 0.16.1's graph runner returns the replayed postprocess (the
                # layer's output) as a 1-tuple where its eager path returns the tensor (run
                # s18-3); 0.19 returns the tensor. Megatron's code, not MoK's.
                assert len(y) == 1 and layer is graphed, (type(y), len(y))
                y = y[0]
            y.backward(gy)
            grads = {}
            for k, p in layer.named_parameters():
                # The graphed parameters' gradients arrive in main_grad, the others' in .grad;
                # both sums also turn -0.0 into +0.0 alike.
                g = p.grad.float() if p.grad is not None else 0
                grads[k] = g + (p.main_grad if hasattr(p, "main_grad") else 0)
                p.grad = None
                if hasattr(p, "main_grad"):
                    p.main_grad.zero_()
            return y.detach(), xx.grad.detach(), grads

        def inputs(it):
            g = torch.Generator().manual_seed(700 + 10 * rank + it)
            return (torch.randn(S, B, H, generator=g).to(dt).to(dev),
                    torch.randn(S, B, H, generator=g).to(dt).to(dev))

        x, gy = inputs(0)
        _assert_runs_bitwise(run(graphed, x, gy), run(eager, x, gy), "recorded iteration vs eager")
        cuda_graphs.create_cudagraphs()
        runners = graphed.cudagraph_manager_router.cudagraph_runners
        assert runners and all(r.fwd_graph is not None and r.bwd_graph is not None for r in runners)

        calls = {"preprocess": 0, "dispatch": 0}

        def counted(name, fn):
            def wrapper(*a, **k):
                calls[name] += 1
                return fn(*a, **k)
            return wrapper

        disp.dispatch_preprocess = counted("preprocess", disp.dispatch_preprocess)
        disp.token_dispatch = counted("dispatch", disp.token_dispatch)
        for it in range(1, 5):
            x, gy = inputs(it)
            got, want = run(graphed, x, gy), run(eager, x, gy)
            _assert_runs_bitwise(got, want, f"replay {it} vs eager, rank {rank}")
            assert float(want[0].abs().sum()) > 0
        assert calls == {"preprocess": 0, "dispatch": 4}, calls
        disp.buffer.check_errors()
        return {"runners": len(runners), "calls": calls,
                "params": sorted(k for k in params if "router" in k or "shared" in k)}
    finally:
        cuda_graphs.delete_cuda_graphs()
        h.use_cudagraphable_rng(1234, on=False)
        h.destroy_parallel()


# ------------------------------------------------------------------- example and benchmark
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _load(relpath, name):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, os.path.join(_REPO, relpath))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def example_train(rank, world, dispatcher, out_json, extra=()):
    """``examples/train_gpt_moe.py`` at toy size, in this (pooled) process group."""
    train = _load("examples/train_gpt_moe.py", "mok_example_train_gpt_moe")
    summary = train.main(["--moe-token-dispatcher-type", dispatcher, "--train-iters", "5",
                          "--seq-length", "32", "--micro-batch-size", "2", "--hidden-size", "64",
                          "--ffn-hidden-size", "64", "--num-experts", "4", "--vocab-size", "128",
                          "--timing-warmup", "1", "--quiet", "--output-json", out_json, *extra])
    return summary["losses"]


def example_train_refused(rank, world, extra=()):
    """``examples/train_gpt_moe.py`` with arguments it must refuse in this group: the
    ``SystemExit`` message."""
    train = _load("examples/train_gpt_moe.py", "mok_example_train_refused")
    try:
        train.main(["--train-iters", "1", "--quiet", *extra])
    except SystemExit as e:
        return str(e)
    raise AssertionError(f"the example ran with {extra}")


def example_micro_batch_losses(rank, world, dispatcher):
    """The example's two step paths on one model (CPU, EP = world, no optimizer step between):
    ``(direct step's loss, the 3-micro-batch step's mean loss, each of its 3 micro-batches'
    loss computed directly)``."""
    from megatron_mok.megatron import harness

    train = _load("examples/train_gpt_moe.py", "mok_example_train_micro")
    base = ["--moe-token-dispatcher-type", dispatcher, "--seq-length", "32",
            "--micro-batch-size", "2", "--hidden-size", "64", "--ffn-hidden-size", "64",
            "--num-experts", "4", "--vocab-size", "128", "--expert-model-parallel-size", str(world)]
    args, args3 = train.parse_args(base), train.parse_args(base + ["--num-microbatches", "3"])
    if dispatcher == "mok":
        import megatron_mok.megatron

        megatron_mok.megatron.install()
    harness.init_parallel(world, seed=args.seed)
    harness.enable_cpu_megatron(on_cpu=True)
    dev = torch.device("cpu")
    try:
        torch.manual_seed(args.seed)
        model, _ = train.build_model(args, dev)
        direct = float(train.forward_backward(args, model, 0, rank, dev))
        mean3 = float(train.forward_backward(args3, model, 0, rank, dev))
        with torch.no_grad():
            each = [float(model(t, p, m, labels=lab).float().mean())
                    for t, p, m, lab in (train.mock_batch(args3, 0, rank, dev, micro=i)
                                         for i in range(3))]
        return direct, mean3, each
    finally:
        harness.destroy_parallel()


def bench_layer_tiny(rank, world, out_dir, extra=()):
    """``benchmarks/bench_layer.py --tiny`` in this (pooled) process group."""
    bench = _load("benchmarks/bench_layer.py", "mok_bench_layer")
    report = bench.run(bench.parse_args(["--tiny", "--iters", "20", "--warmup", "2",
                                         "--dispatchers", "alltoall,flex,mok,mok:sms=8",
                                         "--out-dir", out_dir, *extra]))
    return report["path"]

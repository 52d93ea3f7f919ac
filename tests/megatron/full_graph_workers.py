"""Rank functions: Megatron's full-iteration CUDA graph (``FullCudaGraphWrapper``) with mok.

One graph over the whole forward-backward of a step, every MoK dispatch and combine in it. mok
accepts it with drop-and-pad only (its dispatch then knows its row count before the layout and
reads nothing while captured); this module runs it the way ``megatron.training`` does
(``FullCudaGraphWrapper(get_forward_backward_func(), cuda_graph_warmup_steps=W)``, fresh
batches every step, each copied by the wrapper into its static buffers) against the same
model stepped by the bare schedule.

On CPU (gloo, reference backend) the CUDA pieces the wrapper calls are stand-ins
(:func:`_cpu_full_graph`): a "graph" records the forward-backward call made while it captures
and replays it by calling it again on the same static buffers, so the plumbing (schedule,
wrapper, static buffers, runtime hooks, comparison) runs here; only a GPU shows that the
replay itself runs no Python and gives the eager bits.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from mok_megatron_workers import (_assert_bitwise, _cpu_cuda_streams, _device, _ep_overlap_models,
                                  _ep_overlap_spied, _gpt_batches, _schedules_on_cpu, _setup)


def full_iteration_graph_kwargs() -> dict:
    """This megatron-core's spelling of the full-iteration graph as ``TransformerConfig``
    fields (tests/megatron/test_megatron_install.py lists them all): 0.18 / 0.19
    ``cuda_graph_impl="full_iteration"``; 0.16 / 0.17 ``cuda_graph_impl="local"`` with the
    scope ``full_iteration`` (which also keeps 0.16's per-layer graph managers and its
    schedule's ``create_cudagraphs()`` out)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    if "cuda_graph_modules" in {f.name for f in dataclasses.fields(TransformerConfig)}:
        return {"cuda_graph_impl": "full_iteration"}
    return {"cuda_graph_impl": "local", "cuda_graph_scope": ["full_iteration"]}


def _reset_wrapper_state() -> None:
    """``FullCudaGraphWrapper`` and ``StaticBufferLoader`` keep their graph, result, step count
    and static buffers in class attributes (process-global; 0.16 has no ``reset_cuda_graph``)."""
    from megatron.core import full_cuda_graph as F

    F.FullCudaGraphWrapper.curr_iteration = {"training": 0, "validation": 0}
    F.FullCudaGraphWrapper.cuda_graph = {"training": None, "validation": None}
    F.FullCudaGraphWrapper.result = {"training": None, "validation": None}
    F.StaticBufferLoader.static_buffers = {"training": [], "validation": []}
    if hasattr(F, "_shared_capture_stream"):        # 0.19: one capture stream per process
        F._shared_capture_stream = None


# ------------------------------------------------------------- CPU stand-ins
class _FakeGraph:
    """``torch.cuda.CUDAGraph`` on CPU: :func:`_cpu_full_graph`'s ``graph`` context hands it
    the forward-backward call made while it captures (``call``: ``fn``, its kwargs, the static
    micro-batch dicts); :meth:`replay` calls it again on those same dicts (refilled in place
    by the wrapper, as the GPU graph reads the same memory) and copies the losses into the
    captured result (a GPU graph's outputs are static tensors)."""

    state: dict = {}        # :func:`_cpu_full_graph`'s, set on a subclass

    def __init__(self):
        self.generators, self.call, self.result, self.replays = [], None, None, 0

    def register_generator_state(self, gen):
        self.generators.append(gen)

    def replay(self):
        fn, kwargs, items = self.call
        self.state["capturing"] = True     # no Python runs in a GPU replay; checks skip here too
        try:
            out = fn(**dict(kwargs, data_iterator=[iter(items)]))
        finally:
            self.state["capturing"] = False
        _copy_into(self.result, out)
        self.replays += 1


def _copy_into(dst, src):
    if isinstance(dst, torch.Tensor):
        dst.copy_(src)
    elif isinstance(dst, dict):
        for k in dst:
            _copy_into(dst[k], src[k])
    else:
        for d, s in zip(dst, src):
            _copy_into(d, s)


def _recording(fn, state):
    """The forward-backward function as the CPU wrapper gets it: while a fake graph captures,
    the call runs (Python can only record by running) but leaves every ``.grad`` as it was (a
    GPU capture computes nothing; the replay right after it does), and is recorded for
    replays."""

    def call(**kwargs):
        graph = state["graph"]
        if graph is None:
            return fn(**kwargs)
        items = list(kwargs["data_iterator"][0])
        kwargs = dict(kwargs, data_iterator=None)
        params = [p for m in kwargs["model"] for p in m.parameters()]
        saved = [p.grad.clone() for p in params]
        out = fn(**dict(kwargs, data_iterator=[iter(items)]))
        with torch.no_grad():
            for p, g in zip(params, saved):
                p.grad.copy_(g)
        graph.call, graph.result = (fn, kwargs, items), out
        return out

    return call


@contextlib.contextmanager
def _cpu_full_graph(state):
    """What ``FullCudaGraphWrapper`` and a 0.16 local-impl model build call on ``torch.cuda``,
    on CPU: streams and events (``_cpu_cuda_streams``), the schedule's one CUDA allocation
    (``_schedules_on_cpu``), ``CUDAGraph`` / ``graph`` (:class:`_FakeGraph`), ``synchronize``,
    pool handles, ``Tensor.cuda`` (the static-buffer copy: the tensor itself), the device
    capability and ``set_stream`` (0.16's ``CudaGraphManager``); the dispatcher's
    ``_capturing()`` reads ``state["capturing"]``."""
    from megatron_mok.megatron import dispatcher as D

    @contextlib.contextmanager
    def graph(g, *a, **k):
        state["graph"], state["capturing"] = g, True
        try:
            yield
        finally:
            state["graph"], state["capturing"] = None, False

    cu = torch.cuda
    saved = [(cu, n, getattr(cu, n)) for n in ("CUDAGraph", "graph", "synchronize",
                                                "graph_pool_handle", "get_device_capability",
                                                "set_stream")]
    saved += [(torch.Tensor, "cuda", torch.Tensor.cuda), (D, "_capturing", D._capturing)]
    with _cpu_cuda_streams(), _schedules_on_cpu():
        # a class: Megatron's graph-safe RNG tracker checks it has register_generator_state
        cu.CUDAGraph = type("CUDAGraph", (_FakeGraph,), {"state": state})
        cu.graph = graph
        cu.synchronize = cu.set_stream = lambda *a, **k: None
        cu.graph_pool_handle = lambda: None
        cu.get_device_capability = lambda *a, **k: (9, 0)
        torch.Tensor.cuda = lambda self, *a, **k: self
        D._capturing = lambda: state["capturing"]
        try:
            yield
        finally:
            for obj, name, val in saved:
                setattr(obj, name, val)


# ------------------------------------------------------------- the run
def _dict_forward_step(data_iterator, model):
    """Megatron's forward-step contract for the wrapper's static micro-batch dicts
    (``tokens`` / ``labels`` / ``position_ids`` ``[b, s]`` int64, ``attention_mask``
    ``[1, 1, s, s]`` bool): ``(per-token losses, loss_func)``."""
    from megatron_mok.megatron.harness import mean_token_loss

    b = next(data_iterator)
    return model(b["tokens"], b["position_ids"], b["attention_mask"], labels=b["labels"]), \
        mean_token_loss


def _step_batches(rank, steps, micro, batch, seq, vocab, dev, seed_shift=0):
    """``steps`` lists of ``micro`` dicts (see :func:`_dict_forward_step`), fresh every step."""
    flat = _gpt_batches(rank + seed_shift, steps * micro, batch, seq, vocab, dev)
    keys = ("tokens", "position_ids", "attention_mask", "labels")
    dicts = [dict(zip(keys, b)) for b in flat]
    return [dicts[i * micro:(i + 1) * micro] for i in range(steps)]


def _one_step(fbf, model, batches, cur, i, lr):
    """Step ``i``: ``.grad`` zeroed in place (the captured backward accumulates into these very
    tensors, as into DDP's grad buffer, which ``zero_grad_buffer`` zeroes), ``fbf`` over the
    micro-batches, then an SGD update in place (weights change between replays, the graph
    must read the new ones). Returns ``(losses [micro] fp32, {param: grad copy})``."""
    cur["step"] = i
    for p in model.parameters():
        p.grad.zero_()
    store = fbf(forward_step_func=_dict_forward_step, data_iterator=iter(batches), model=[model],
                num_microbatches=len(batches), seq_length=batches[0]["tokens"].shape[1],
                micro_batch_size=batches[0]["tokens"].shape[0], forward_only=False)
    losses = torch.stack([d["lm loss"].float().clone() for d in store])
    grads = {k: p.grad.detach().clone() for k, p in model.named_parameters()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(p.grad, alpha=-lr)
    return losses, grads


def full_graph_train(rank, world, backend_env=None, steps=7, warmup=2, micro=2,
                     perturb_step=None):
    """A 2-layer GPT (local spec, bf16, EP = world, ``4 x EP`` experts top-2, a shared expert,
    drop-and-pad with capacity factor 1.0, no dropout), stepped ``steps`` times by
    ``FullCudaGraphWrapper(get_forward_backward_func(), cuda_graph_warmup_steps=warmup)``
    (``warmup`` eager steps, a capture step, then replays; ``micro`` micro-batches a step)
    and, from the same weights on the same batches, by the bare schedule. Asserts per step:
    losses and every parameter's gradient bitwise equal; the graph exists after the capture
    step; where the dispatcher's Python ran (GPU: warm-up and capture steps only); the
    per-step device-error check ran after every wrapper call, outside any capture. Then one
    more replay with every expert id poisoned inside the graph: that step must raise the
    device's bad-expert error (GPU: from the check after the replay).

    ``backend_env=None``: CPU, gloo, reference backend, :func:`_cpu_full_graph`.
    ``perturb_step``: the graph run gets another batch at that step (the test of the test).
    Returns a report dict (losses, dispatch calls per step, checks per step, error)."""
    from megatron.core import full_cuda_graph as F
    from megatron.core import tensor_parallel
    from megatron.core.pipeline_parallel.schedules import get_forward_backward_func

    from megatron_mok.megatron import dispatcher as D
    from megatron_mok.cuda.errors import MokDeviceError

    cpu = backend_env is None
    h = _setup(world, backend_env)
    state = {"graph": None, "capturing": False}
    cur = {"step": None}
    log = {"dispatch": [], "check": []}
    poison = {}
    try:
        with contextlib.ExitStack() as stack:
            if cpu:
                stack.enter_context(_cpu_full_graph(state))
                h.enable_cpu_megatron(on_cpu=True)
                # graph-safe, as Megatron-LM makes it for any cuda_graph_impl (0.16's
                # CudaGraphManager asserts it); it holds no generators on CPU
                tensor_parallel.random.initialize_rng_tracker(use_cudagraphable_rng=True,
                                                              force_reset=True)
            else:
                # Megatron-LM makes a graph-safe tracker for any cuda_graph_impl; the wrapper
                # registers its generators with the graph (a plain tracker's are tensors)
                h.use_cudagraphable_rng(1234)
            _reset_wrapper_state()
            stack.callback(_reset_wrapper_state)
            dev = torch.device("cpu") if cpu else _device()
            seq, batch, vocab, hidden, ffn = (16, 2, 64, 32, 64) if cpu else (64, 2, 256, 64, 128)
            models = _ep_overlap_models(
                h, world, [("eager", "mok", False), ("graph", "mok", False)], seq=seq,
                vocab=vocab, hidden=hidden, ffn=ffn, cpu=cpu,
                moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
                moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True,
                **full_iteration_graph_kwargs())
            for m in models.values():
                for p in m.parameters():
                    p.grad = torch.zeros_like(p)
            data = _step_batches(rank, steps + 1, micro, batch, seq, vocab, dev)
            graph_data = list(data)
            if perturb_step is not None:
                graph_data[perturb_step] = _step_batches(rank, 1, micro, batch, seq, vocab, dev,
                                                         seed_shift=1000)[0]
            # Where the dispatcher's Python runs, and what the per-step check does, per step.
            stack.enter_context(_ep_overlap_spied(
                lambda d: log["dispatch"].append((cur["step"], bool(D._capturing())))))
            orig_dpp = D.MokTokenDispatcher.dispatch_preprocess

            def dispatch_preprocess(self, *a, **k):
                # + 0 (or + E: every id out of range) on the device, inside the graph
                out = orig_dpp(self, *a, **k)
                if "t" not in poison:       # made in the first (eager) step, not captured
                    poison["t"] = torch.zeros((), dtype=self._topk_idx.dtype, device=dev)
                self._topk_idx = self._topk_idx + poison["t"] * self.num_experts
                return out

            D.MokTokenDispatcher.dispatch_preprocess = dispatch_preprocess
            stack.callback(setattr, D.MokTokenDispatcher, "dispatch_preprocess", orig_dpp)
            orig_check = D.check_errors

            def check_errors():
                rec = {"step": cur["step"], "capturing": bool(D._capturing()), "raised": None}
                log["check"].append(rec)
                try:
                    return orig_check()
                except Exception as e:  # noqa: BLE001  (recorded, then raised as it was)
                    rec["raised"] = f"{type(e).__name__}: {e}"
                    raise

            D.check_errors = check_errors
            stack.callback(setattr, D, "check_errors", orig_check)

            lr = 0.05
            fbf = get_forward_backward_func()
            eager = [_one_step(fbf, models["eager"], data[i], cur, i, lr) for i in range(steps)]
            log["dispatch"].clear()
            log["check"].clear()
            wrapped = _recording(fbf, state) if cpu else fbf
            wrapper = F.FullCudaGraphWrapper(wrapped, cuda_graph_warmup_steps=warmup)
            graph_runs = []
            for i in range(steps):
                graph_runs.append(_one_step(wrapper, models["graph"], graph_data[i], cur, i, lr))
                assert (F.FullCudaGraphWrapper.cuda_graph["training"] is not None) == (i >= warmup), \
                    f"step {i}: graph captured = {F.FullCudaGraphWrapper.cuda_graph['training']}"
            graph = F.FullCudaGraphWrapper.cuda_graph["training"]
            if not cpu:
                torch.cuda.synchronize()
            report = _compare(eager, graph_runs, models, log, steps, warmup, micro, cpu, graph)
            # A device error inside a replay: every expert id out of range (the CUDA layout
            # kernel records it and drops the routes; nothing reads it in the graph).
            poison["t"].fill_(1)
            try:
                _one_step(wrapper, models["graph"], data[steps], cur, steps, lr)
                report["error"] = None
            except (MokDeviceError, ValueError) as e:
                report["error"] = f"{type(e).__name__}: {e}"
            _check_error_report(report, log, steps, cpu)
            return report
    finally:
        h.destroy_parallel()


def _compare(eager, graph_runs, models, log, steps, warmup, micro, cpu, graph):
    """The assertions of :func:`full_graph_train` on its finished runs (see there)."""
    n_params = len(list(models["graph"].parameters()))
    for i, ((l0, g0), (l1, g1)) in enumerate(zip(eager, graph_runs)):
        kind = "warm-up" if i < warmup else "capture" if i == warmup else "replay"
        _assert_bitwise(l1, l0, f"losses, step {i} ({kind}): full-iteration graph vs eager")
        assert len(g0) == len(g1) == n_params, (len(g0), len(g1), n_params)
        for k in g0:   # the same kernels in the same order: bit for bit
            _assert_bitwise(g1[k], g0[k], f"grad {k}, step {i} ({kind}): graph vs eager")
    # Fresh batches really differ, and the gradients reach the experts.
    assert len({tuple(l.tolist()) for l, _ in eager}) == steps, [l.tolist() for l, _ in eager]
    last = eager[-1][1]
    assert any(".experts." in k and float(v.float().abs().sum()) > 0 for k, v in last.items())
    assert all(torch.isfinite(v.float()).all() for v in last.values())
    # Where the dispatcher's Python ran: 2 MoE layers x micro-batches in each eager step and in
    # the capture (while capturing); never in a GPU replay (the CPU stand-in replays by running
    # the Python again, under its capture flag: also right after the capture, as the wrapper
    # replays the capture step).
    per_step = [[c for s, c in log["dispatch"] if s == i] for i in range(steps)]
    want = [[False] * 2 * micro] * warmup + [[True] * 2 * micro * (2 if cpu else 1)]
    want += [([True] * 2 * micro if cpu else []) for _ in range(warmup + 1, steps)]
    assert per_step == want, f"dispatch calls per step (capturing?): {per_step}, want {want}"
    assert graph is not None and (not cpu or graph.replays == steps - warmup), graph
    # The per-step check: after the schedule (eager steps; skipped inside the capture, where it
    # must not sync) and after every wrapper call (outside the capture: it ran and read).
    checks = [[(c["capturing"], c["raised"]) for c in log["check"] if c["step"] == i]
              for i in range(steps)]
    real = [[r for cap, r in c if not cap] for c in checks]
    assert real == [[None, None]] * warmup + [[None]] * (steps - warmup), checks
    return {"losses": [l.tolist() for l, _ in graph_runs],
            "dispatch_calls": [len(c) for c in per_step], "real_checks": [len(c) for c in real]}


def _check_error_report(report, log, step, cpu):
    """The poisoned replay's error: the bad-expert error (GPU: a ``MokDeviceError`` from the
    per-step check after the wrapper's replay; CPU: the reference backend's ``ValueError`` at
    the dispatch, since the stand-in replays by running it)."""
    err = report["error"]
    assert err is not None, "a replay with out-of-range expert ids raised nothing"
    assert "outside [-1, num_experts" in err, err
    raised = [c["raised"] for c in log["check"] if c["step"] == step and c["raised"]]
    if cpu:
        assert err.startswith("ValueError"), err
    else:
        assert err.startswith(("MokDeviceError", "MokDevicePeerStopped")) and raised == [err], \
            (err, log["check"])

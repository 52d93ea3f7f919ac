"""Rank functions for ``test_megatron_aux_loss.py``: Megatron's load-balancing losses that keep
state or combine types (``moe_router_load_balancing_type="global_aux_loss"``, alone or in a
list with ``"seq_aux_loss"``) through a full ``MoELayer`` with ``mok``, against Megatron's own
``alltoall``, over several training-like steps.

``global_aux_loss`` (the global-batch load-balancing loss): the router sums each micro-batch's
top-k token counts (all-reduced over Megatron's TP x DP x CP group) into a buffer
``global_tokens_per_expert`` and counts the micro-batches in ``ga_steps``; each micro-batch's
loss uses the running average of the counts; Megatron's ``finalize_model_grads`` zeroes both
at the end of every global batch (``reset_model_temporary_tensors`` ->
``TopKRouter.reset_global_aux_loss_tracker``). The router allocates those buffers with
``device=torch.cuda.current_device()`` in ``__init__``; on a CPU run :func:`router_buffers_on`
makes that allocation land on the CPU for the layers' construction only (a stand-in, as
``harness.cpu_router_class`` is for the gate: the router's code is Megatron's own, its buffers
just live on the run's device). On a GPU nothing is replaced.

The helpers of ``mok_megatron_workers`` / ``feature_workers`` (setup, one forward + backward,
``_compare``, the tolerances) are imported, not copied. Every function tears down the
parallel state, the shared MoK Buffers, Megatron's aux-loss scale and its MoE metrics in
``finally`` (``harness.destroy_parallel``): the ranks are pooled and take the next call.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from feature_workers import CPU_TOL, GPU_TOL, _build_pair, _nonzero
from mok_megatron_workers import (_compare, _device, _full_state_dict, _run_layer, _setup,
                                  patched_attrs)

COEFF = 1e-2
# Megatron's aux-loss log names, per load-balancing type (router.py's
# attach_and_log_load_balancing_loss calls).
TRACKED = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss",
           "global_aux_loss": "global_load_balancing_loss"}
# Both routers' weights are scaled up from Megatron's init (std 0.02: logits ~0.1, near-uniform
# scores, with which the switch loss is ~1 whatever the counts, so the running counts would
# hardly show): std 0.1, logits ~0.6, a router that prefers experts, as a trained one does.
ROUTER_SCALE = 5.0
SEQ, BATCH = 8, 3             # [S, B] tokens per rank and micro-batch (B > 1: seq_aux_loss
                              # folds the batch into the expert dim)


def balancing_kwargs(types) -> dict:
    """``moe_router_load_balancing_type`` / ``moe_aux_loss_coeff`` for one type (a string)
    or several (Megatron's list form: one coefficient per type, as its config requires)."""
    types = [types] if isinstance(types, str) else list(types)
    if len(types) == 1:
        return dict(moe_router_load_balancing_type=types[0], moe_aux_loss_coeff=COEFF)
    return dict(moe_router_load_balancing_type=types, moe_aux_loss_coeff=[COEFF] * len(types))


def check_balancing_config(config, types) -> None:
    """The built ``TransformerConfig`` carries the requested balancing (``harness.moe_config``
    drops fields this megatron-core does not know, so a renamed field would otherwise leave
    Megatron's default ``aux_loss`` in place and the test would check the wrong loss)."""
    want = balancing_kwargs(types)
    got = {k: getattr(config, k, "<absent>") for k in want}
    assert got == want, f"the config lost the balancing settings: {got} != {want}"


@contextlib.contextmanager
def router_buffers_on(dev: torch.device):
    """While the layers are built on a CPU run: ``torch.cuda.current_device()`` answers the
    CPU, so ``TopKRouter.__init__`` allocates its ``global_tokens_per_expert`` / ``ga_steps``
    buffers there (a CPU-only torch raises instead; on a GPU host a CPU run would get CUDA
    buffers next to CPU counts). Restored on exit; not used on GPU runs."""
    with patched_attrs(torch.cuda, current_device=lambda: dev):
        yield


def _take_tracked(h) -> dict:
    """Megatron's MoE aux-loss log, ``{name: per-layer values}``, then emptied (so the next
    layer's forward records into fresh entries). 0.19: ``moe_logging``'s metrics tracker;
    0.16 / 0.17: ``moe_utils``' module-level dict."""
    try:
        from megatron.core.transformer.moe import moe_logging
    except ImportError:
        from megatron.core.transformer.moe import moe_utils

        tracker = moe_utils.get_moe_layer_wise_logging_tracker()
        entries = {n: d["values"] for n, d in tracker.items()}
    else:
        entries = {n: e.values for n, e in moe_logging.get_moe_metrics_tracker().metrics.items()}
    out = {n: v.detach().clone() for n, v in entries.items()}
    h._drop_moe_metrics()
    return out


def _batch(rank, step, micro, dev, hidden):
    """``(x, upstream grad)`` of one micro-batch, ``[SEQ, BATCH, hidden]``, seeded by
    (rank, step, micro-batch). Each micro-batch's tokens share an offset (the same on every
    rank): the router prefers other experts in each, so a micro-batch's counts differ from
    the running ones (with centred tokens every micro-batch's expected counts are alike: the
    running average changed the loss by 1e-4 .. 1e-3 only, measured)."""
    shift = torch.Generator().manual_seed(50_000 + 10 * step + micro)
    offset = 0.4 * torch.randn(hidden, generator=shift)
    g = torch.Generator().manual_seed(1000 * step + 100 * micro + rank)
    x = torch.randn(SEQ, BATCH, hidden, generator=g) + offset
    return x.to(dev), torch.randn(SEQ, BATCH, hidden, generator=g).to(dev)


def _counts_and_scores(router, x, topk):
    """What ``TopKRouter.routing`` feeds the global aux loss, recomputed from Megatron's gate
    (``router.gating``, same weights): the top-k counts of this micro-batch summed over the
    ranks (every rank is in the TP x DP x CP group here) and this rank's softmax scores."""
    with torch.no_grad():
        # [S, B, H] as the layer's forward hands it (the same GEMM shape: the same logits)
        logits = router.gating(x).reshape(-1, router.config.num_moe_experts).float()
        scores = torch.softmax(logits, dim=-1)
        top = torch.topk(scores, k=topk, dim=1).indices
        counts = torch.zeros_like(scores).scatter(1, top, 1.0).sum(0)
        dist.all_reduce(counts)
    return counts, scores


def _global_aux_value(scores, tokens_per_expert, total_tokens, topk):
    """Megatron's switch load-balancing loss over the coefficient (what its log records):
    ``E / (K T^2) * sum_i (sum over local tokens of p_i) * tokens_i``."""
    E = scores.shape[1]
    return float((scores.sum(0) * tokens_per_expert).sum()) * E / (topk * total_tokens ** 2)


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the gradient scaled (a mutant's wrong gradient)."""

    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * ctx.factor, None


def _apply_mutant(mok, mutant) -> None:
    """Break the mok layer alone, the way an integration bug would (CPU tests: the comparison
    must then fail):

    - ``probs_grad``: the gradient reaching the router's probs through mok's dispatcher is
      1.001x too large (output unchanged);
    - ``aux_grad_dropped``: the router's aux losses are computed and logged, but their
      gradient is not attached to the probs (output unchanged);
    - ``router_twice``: the layer's router runs twice per forward (its running statistics and
      its log count each micro-batch twice; output unchanged).
    """
    if mutant is None:
        return
    if mutant == "probs_grad":
        disp = mok.token_dispatcher
        orig = disp.dispatch_preprocess
        disp.dispatch_preprocess = lambda hs, rmap, probs: orig(
            hs, rmap, _ScaleGrad.apply(probs, 1.001))
    elif mutant == "aux_grad_dropped":
        router = mok.router
        orig = router.attach_and_log_load_balancing_loss

        def attach(activation, *args, **kwargs):
            orig(activation.detach(), *args, **kwargs)      # logged, attached to nothing used
            return activation

        router.attach_and_log_load_balancing_loss = attach
    elif mutant == "router_twice":
        router = mok.router
        orig = router.forward

        def twice(*args, **kwargs):
            orig(*args, **kwargs)
            return orig(*args, **kwargs)

        router.forward = twice
    else:
        raise ValueError(mutant)


def _close(what, got, want, tol) -> float:
    """``got`` within ``tol`` of ``want`` relative to ``want``'s largest value (as
    ``_compare``); returns that relative difference."""
    scale = float(want.abs().max())
    torch.testing.assert_close(got, want, atol=tol * scale, rtol=tol,
                               msg=lambda s: f"{what} (largest value {scale:.3g}): {s}")
    return float((got.float() - want.float()).abs().max()) / (scale or 1.0)


def layer_aux_loss_vs_alltoall(rank, world, types, backend_env=None, mutant=None,
                               global_batches=3, micro_batches=2, lr=0.5):
    """A full ``MoELayer`` with ``mok`` over EP = world against Megatron's ``alltoall`` with
    every expert local (EP = 1), same weights, fp32, the load-balancing ``types`` (a string or
    a list, coefficient :data:`COEFF` each), trained like Megatron's schedule does it:
    ``global_batches`` global batches of ``micro_batches`` micro-batches each (aux-loss scale
    and upstream gradient 1 / ``micro_batches``), gradients accumulated, Megatron's
    end-of-batch hook ``reset_model_temporary_tensors`` (what ``finalize_model_grads`` calls),
    then an SGD step on mok's layer (non-expert gradients averaged over the ranks, as
    Megatron's DDP does), whose new weights the alltoall layer takes (so every step
    compares the dispatchers from equal weights; the routers' running statistics are
    non-persistent buffers, which ``load_state_dict`` leaves alone).

    Each micro-batch, within :data:`feature_workers.CPU_TOL` (``GPU_TOL`` on a GPU) of each
    tensor's largest value (``_compare``): output, input gradient, every parameter gradient
    (expert gradients summed over the ranks) and each aux loss Megatron's log recorded for the
    layer (the names of ``types``: no more, no fewer). With ``global_aux_loss``, also: both
    routers' ``global_tokens_per_expert`` bitwise equal, equal to this global batch's
    recomputed top-k counts so far (exact integers) and ``ga_steps`` the micro-batch count;
    the logged global loss equal (within the tolerance) to the switch loss over the running
    average of the counts, and (from the second micro-batch on) not to the one over this
    micro-batch's counts alone (the running statistics matter); after the hook, both
    routers' buffers zero. Last, one forward/backward with a zero upstream gradient: the
    router's gradient is then the aux losses' alone, and still nonzero and within the
    tolerance of alltoall's (the aux gradient reaches the router through mok's dispatcher).

    ``mutant``: see :func:`_apply_mutant` (CPU tests: must fail). Returns a report."""
    from megatron.core.distributed.finalize_model_grads import reset_model_temporary_tensors
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    h = _setup(world, backend_env)
    dev = _device()
    tol = GPU_TOL if dev.type == "cuda" else CPU_TOL
    types = [types] if isinstance(types, str) else list(types)
    with_global = "global_aux_loss" in types
    try:
        E, K, H = 4 * world, 2, 32
        e_local = E // world
        kw = dict(num_experts=E, topk=K, hidden=H, **balancing_kwargs(types))
        with router_buffers_on(dev) if dev.type == "cpu" else contextlib.nullcontext():
            mok, a2a = _build_pair(h, world, dev, **kw)
        with torch.no_grad():
            for layer in (mok, a2a):            # the same op on the same values: equal still
                layer.router.weight.mul_(ROUTER_SCALE)
        for layer in (mok, a2a):
            check_balancing_config(layer.config, types)
            assert layer.router.is_aux_loss_enabled() and layer.training
            if with_global:
                buf = layer.router.global_tokens_per_expert
                assert buf is not None and buf.device.type == dev.type, buf
                assert layer.router.tp_dp_cp_group.size() == world
            else:
                assert layer.router.global_tokens_per_expert is None
        _apply_mutant(mok, mutant)
        want_names = sorted(TRACKED[t] for t in types)
        T_total = SEQ * BATCH * world
        h._drop_moe_metrics()
        # Megatron's schedule: the aux losses' gradient scale is 1 / num_microbatches, as the
        # main loss's (each micro-batch's loss is divided by it)
        MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0 / micro_batches, device=dev))

        report = {"errors": {}, "tracked": [], "ga_steps": [], "running_vs_current": []}

        def note(errs):
            for k, v in errs.items():
                report["errors"][k] = max(report["errors"].get(k, 0.0), v)

        for step in range(global_batches):
            acc = {}
            running = torch.zeros(E, device=dev)
            for micro in range(micro_batches):
                x, gy = _batch(rank, step, micro, dev, H)
                gy = gy / micro_batches
                run_m = _run_layer(mok, x, gy)
                tracked_m = _take_tracked(h)
                run_a = _run_layer(a2a, x, gy)
                tracked_a = _take_tracked(h)
                note(_compare(rank, run_m, run_a, e_local, tol))
                assert sorted(tracked_m) == sorted(tracked_a) == want_names, \
                    (sorted(tracked_m), sorted(tracked_a), want_names)
                for name in want_names:
                    assert float(tracked_a[name].abs().sum()) > 0, (name, tracked_a[name])
                    note({f"tracked:{name}": _close(f"tracked {name}, step {step} micro {micro}",
                                                    tracked_m[name], tracked_a[name], tol)})
                report["tracked"].append({n: float(tracked_m[n].sum()) for n in want_names})
                for k, g in run_m[2].items():
                    acc[k] = acc[k] + g if k in acc else g

                if with_global:
                    counts, scores = _counts_and_scores(a2a.router, x, K)
                    running += counts
                    steps = [float(layer.router.ga_steps) for layer in (mok, a2a)]
                    assert steps == [micro + 1] * 2, f"ga_steps {steps}, micro-batch {micro}"
                    bufs = [layer.router.global_tokens_per_expert for layer in (mok, a2a)]
                    assert torch.equal(bufs[0], bufs[1]), ("mok's vs alltoall's running counts",
                                                           bufs)
                    assert torch.equal(bufs[1], running), ("running counts vs recomputed", bufs[1],
                                                           running)
                    assert float(running.sum()) == K * T_total * (micro + 1)
                    want = _global_aux_value(scores, running / (micro + 1), T_total, K)
                    got = float(tracked_m["global_load_balancing_loss"].sum())
                    assert abs(got - want) <= tol * abs(want), \
                        f"logged global aux loss {got} vs the running counts' switch loss {want}"
                    current = _global_aux_value(scores, counts, T_total, K)
                    rel = abs(current - want) / abs(want)
                    if micro > 0:
                        assert rel > 10 * tol, \
                            f"running and current counts give the same loss ({rel}): not exercised"
                    report["ga_steps"].append(steps[0])
                    report["running_vs_current"].append(rel)
                    report.setdefault("counts", []).append(counts.tolist())

            # every expert had tokens in the global batch: no gradient compared is all zeros
            _nonzero((run_m[0], None, acc))
            # end of the global batch: Megatron's finalize_model_grads hook, then the update
            for layer in (mok, a2a):
                reset_model_temporary_tensors(layer.config, [layer])
                if with_global:
                    assert float(layer.router.ga_steps) == 0, layer.router.ga_steps
                    assert not torch.any(layer.router.global_tokens_per_expert), \
                        layer.router.global_tokens_per_expert
            with torch.no_grad():
                for k, p in mok.named_parameters():
                    if not k.startswith("experts."):
                        # the router's gradient averaged over the data-parallel ranks (all of
                        # them here), as Megatron's DDP does; the experts' are whole per rank
                        dist.all_reduce(acc[k])
                        acc[k] /= world
                    p.add_(acc[k], alpha=-lr)
            a2a.load_state_dict(_full_state_dict(mok, world, e_local), strict=True)

        # the aux losses' gradient alone (zero upstream gradient): reaches the router through
        # mok's dispatcher, as through alltoall's
        x, _ = _batch(rank, global_batches, 0, dev, H)
        zero = torch.zeros_like(x)
        aux_m, aux_a = _run_layer(mok, x, zero), _run_layer(a2a, x, zero)
        _take_tracked(h)
        assert float(aux_m[2]["router.weight"].abs().sum()) > 0, "no aux-loss gradient"
        errs = _compare(rank, aux_m, aux_a, e_local, tol)
        report["errors"]["aux_only:grad:router.weight"] = errs["grad:router.weight"]
        report["tracked_names"] = want_names
        return report
    finally:
        h.destroy_parallel()

"""Rank functions for activation recomputation with the ``mok`` dispatcher
(``tests/megatron/test_megatron_recompute.py``; run by ``harness.run_distributed``).

Recomputation re-runs a layer's forward inside the backward pass, so with ``mok`` the
dispatcher's ``token_dispatch`` / ``token_combine`` run again there, between the other
layers' backward communication (the combine's backward is a cached dispatch, the dispatch's
backward a combine). Every worker steps the same 2-layer ``GPTModel`` (local spec, EP = world,
``mok_megatron_workers._ep_overlap_models``: a shared expert and a bf16 gate in each MoE
layer) once with ``mok`` without recompute, once with ``mok`` and the recompute config under
test, and once with ``alltoall`` and the same config, and counts the dispatches (and the
shared experts', layernorms' and attentions' forwards) made inside the backward pass, so that
a config under which Megatron silently recomputes nothing cannot pass for one that does.

The recompute configs (``CASES``; the spellings of megatron-core 0.16.1 and 0.19.2, which
are the same):

- ``selective_moe``: ``recompute_granularity="selective"``, ``recompute_modules=["moe"]``:
  ``MoELayer.forward`` runs route + shared expert + dispatch + experts + combine under
  ``tensor_parallel.checkpoint``: each MoE layer's dispatch runs again in the backward.
- ``selective_moe_shared_overlap``: the same with ``moe_shared_expert_overlap`` (MoK's
  dispatcher runs the shared expert's overlap hooks, in the checkpointed forward and again in
  the recompute); its baseline is the overlapped model without recompute.
- ``selective_moe_drop_and_pad``: the same with Megatron's drop-and-pad (capacity factor 1.0:
  MoK's dispatch with ``rows_per_expert``, ``tokens_per_expert`` made on the host).
- ``moe_layer_recompute``: the deprecated flag (0.16 and 0.19) that ``__post_init__`` turns into
  selective + ``"moe"`` (after the default ``["core_attn"]``).
- ``selective_shared_experts``: ``["shared_experts"]``, the entry that splits the MoE layer
  and runs here: the shared expert alone under a checkpoint; the dispatcher is *not* re-run.
- ``selective_layernorm``: ``["layernorm"]``: the pre-MLP layernorm's output (the tensor mok's
  dispatch input is a view of) is discarded after the forward and recomputed in the backward;
  the dispatcher is not re-run. Megatron's ``CheckpointWithoutOutput`` needs Transformer
  Engine for it whatever the dispatcher (:func:`_checkpoint_shims`); without TE the workers
  stand in TE's no-FP8 answers.
- ``full_uniform`` / ``full_block``: ``recompute_granularity="full"``,
  ``recompute_num_layers=1``: whole transformer layers (attention included) under the
  checkpoint, every layer (uniform) or the first one (block).

``moe_act`` (recompute the experts' activation, the other entry inside the MoE layer) needs
``moe_grouped_gemm`` (Megatron's config check), and only the grouped experts implement it:
0.16's legacy ``GroupedMLP`` (the ``grouped_gemm`` package's CUDA kernels: not installed here,
and GPU-only) and ``TEGroupedMLP`` (Transformer Engine, 0.16 and 0.19; TE is on neither this
machine nor our GPU machine). The local spec with ``moe_grouped_gemm=True`` builds
``GroupedMLP`` on 0.16.1 and ``SequentialMLP`` on 0.19.2, which has no activation recompute:
there Megatron accepts ``["moe_act"]`` and recomputes nothing (for every dispatcher). So no
worker runs it.
"""

from __future__ import annotations

import contextlib

import torch

import mok_megatron_workers as W

CASES = {
    "selective_moe": dict(recompute_granularity="selective", recompute_modules=["moe"]),
    "moe_layer_recompute": dict(moe_layer_recompute=True),
    "selective_shared_experts": dict(recompute_granularity="selective",
                                     recompute_modules=["shared_experts"]),
    "selective_layernorm": dict(recompute_granularity="selective", recompute_modules=["layernorm"]),
    "full_uniform": dict(recompute_granularity="full", recompute_method="uniform",
                         recompute_num_layers=1),
    "full_block": dict(recompute_granularity="full", recompute_method="block",
                       recompute_num_layers=1),
    "selective_moe_shared_overlap": dict(recompute_granularity="selective",
                                         recompute_modules=["moe"]),
    "selective_moe_drop_and_pad": dict(recompute_granularity="selective",
                                       recompute_modules=["moe"]),
}

# Settings of every model of a case, the one without recompute too (its baseline): the shared
# expert overlapped with the dispatch (moe_shared_expert_overlap: MoK's dispatcher runs the
# shared expert's hooks, inside the checkpointed forward and again in its recompute; the
# overlap sums the layer's input gradient in another order than the plain layer does), and
# drop-and-pad.
BASE = {"selective_moe_shared_overlap": dict(moe_shared_expert_overlap=True),
        "selective_moe_drop_and_pad": dict(moe_expert_capacity_factor=1.0,
                                           moe_pad_expert_input_to_capacity=True)}

# What runs again inside the backward pass, per step (2 layers, each with an MoE layer; one
# micro-batch): calls of each module (and of the dispatcher's token_dispatch) made while the
# autograd engine runs. Each also runs NUM_LAYERS times in the forward. Without recompute
# nothing runs in the backward.
COUNTED = ("dispatch", "shared_experts", "pre_mlp_layernorm", "core_attention", "self_attention")
RERUN = {
    # the MoE layer's whole forward (router, shared expert, dispatch, experts, combine)
    "selective_moe": dict(dispatch=2, shared_experts=2),
    # the deprecated flag appends "moe" to the default ["core_attn"]
    "moe_layer_recompute": dict(dispatch=2, shared_experts=2, core_attention=2),
    # splits the MoE layer: only the shared expert; the dispatcher is not re-run
    "selective_shared_experts": dict(shared_experts=2),
    # the dispatch input's producer only; the dispatcher is not re-run
    "selective_layernorm": dict(pre_mlp_layernorm=2),
    # whole layers: every layer (uniform), the first one (block, recompute_num_layers=1)
    "full_uniform": dict(dispatch=2, shared_experts=2, pre_mlp_layernorm=2, core_attention=2,
                         self_attention=2),
    "full_block": dict(dispatch=1, shared_experts=1, pre_mlp_layernorm=1, core_attention=1,
                       self_attention=1),
    "selective_moe_shared_overlap": dict(dispatch=2, shared_experts=2),
    "selective_moe_drop_and_pad": dict(dispatch=2, shared_experts=2),
}

NUM_LAYERS = 2


def _in_backward() -> bool:
    """Whether the autograd engine is running a backward pass on this thread now."""
    return torch._C._current_graph_task_id() != -1


@contextlib.contextmanager
def _call_counter(model, counts):
    """Count, in ``counts[(what, "forward" | "backward")]``, the ``token_dispatch`` calls of
    ``model``'s dispatchers (``mok`` or ``alltoall``: a class-level spy) and the forward calls
    of its shared experts' fc1 (called with and without the overlap), pre-MLP layernorms,
    attentions and core attentions (forward pre-hooks), each by whether the autograd engine was
    running a backward at the time."""
    from megatron.core.transformer.moe import token_dispatcher as td

    from megatron_mok.megatron import dispatcher as D

    def note(what):
        key = (what, "backward" if _in_backward() else "forward")
        counts[key] = counts.get(key, 0) + 1

    classes = [D.MokTokenDispatcher, td.MoEAlltoAllTokenDispatcher]
    saved = [(c, c.token_dispatch) for c in classes]

    def spy(orig):
        def token_dispatch(self, *a, **k):
            note("dispatch")
            return orig(self, *a, **k)
        return token_dispatch

    hooks = []
    for layer in model.decoder.layers:
        for what, mod in (("shared_experts", layer.mlp.shared_experts.linear_fc1),
                          ("pre_mlp_layernorm", layer.pre_mlp_layernorm),
                          ("core_attention", layer.self_attention.core_attention),
                          ("self_attention", layer.self_attention)):
            hooks.append(mod.register_forward_pre_hook(lambda *_, w=what: note(w)))
    for c, orig in saved:
        c.token_dispatch = spy(orig)
    try:
        yield
    finally:
        for c, orig in saved:
            c.token_dispatch = orig
        for hk in hooks:
            hk.remove()


def _expected_calls(case):
    """``counts`` of :func:`_call_counter` for one step with ``case`` (``None``: no recompute)."""
    want = {(w, "forward"): NUM_LAYERS for w in COUNTED}
    for w, n in (RERUN[case] if case else {}).items():
        want[(w, "backward")] = n
    return want


class _NoFp8:
    """Transformer Engine's ``FP8GlobalStateManager`` with FP8 off (what TE says outside an
    ``fp8_autocast``)."""

    @staticmethod
    def is_fp8_enabled():
        return False

    @staticmethod
    def get_fp8_recipe():
        return None


@contextlib.contextmanager
def _checkpoint_shims():
    """What Megatron's checkpoint functions need on this machine, for the test only:

    - ``tensor_parallel.checkpoint`` saves and restores the CUDA RNG state besides the CPU one
      (``_get_all_rng_states``), which a CPU-only torch cannot read: on such a build its CUDA
      half is a no-op (the CPU RNG state and the RNG tracker's are still saved and restored;
      the models here use no dropout).
    - ``CheckpointWithoutOutput`` (``"layernorm"`` and ``"moe_act"`` recompute) takes its TE
      path whatever its ``fp8`` argument (``self.fp8 = fp8 is not None``, 0.16.1 and 0.19.2:
      ``False`` counts as set), and there reads ``FP8GlobalStateManager``, which is defined
      only when Transformer Engine imports: without TE, a ``NameError``, whatever the
      dispatcher. Without TE, its three TE names become TE's own no-FP8 answers.
    """
    from megatron.core.tensor_parallel import random as mrandom

    shims = {}
    if not torch.cuda.is_available():
        shims.update(_get_cuda_rng_state=lambda *a, **k: None,
                     _set_cuda_rng_state=lambda *a, **k: None)
    if not getattr(mrandom, "HAVE_TE", True):
        shims.update(FP8GlobalStateManager=_NoFp8,
                     activation_recompute_forward=lambda *a, **k: contextlib.nullcontext(),
                     fp8_autocast=lambda *a, **k: contextlib.nullcontext())
    with W.patched_attrs(mrandom, **shims):
        yield


def _recompute_flags(model) -> dict:
    """What Megatron made of the config, per module: the MoE layers' ``moe_layer_recompute`` and
    ``shared_experts_recompute``, the transformer layers' ``recompute_pre_mlp_layernorm``, the
    block's granularity."""
    moe = [layer.mlp for layer in model.decoder.layers]
    return {
        "moe_layer_recompute": [bool(m.moe_layer_recompute) for m in moe],
        "shared_experts_recompute": [bool(m.shared_experts_recompute) for m in moe],
        "pre_mlp_layernorm": [bool(layer.recompute_pre_mlp_layernorm)
                              for layer in model.decoder.layers],
        "shared_expert_overlap": [m.token_dispatcher.shared_experts is not None for m in moe],
        "granularity": model.config.recompute_granularity,
        "modules": list(model.config.recompute_modules or []),
    }


EXPECTED_FLAGS = {
    "selective_moe": dict(moe_layer_recompute=[True] * 2, shared_experts_recompute=[False] * 2,
                          pre_mlp_layernorm=[False] * 2),
    "moe_layer_recompute": dict(moe_layer_recompute=[True] * 2,
                                shared_experts_recompute=[False] * 2,
                                pre_mlp_layernorm=[False] * 2),
    "selective_shared_experts": dict(moe_layer_recompute=[False] * 2,
                                     shared_experts_recompute=[True] * 2,
                                     pre_mlp_layernorm=[False] * 2),
    "selective_layernorm": dict(moe_layer_recompute=[False] * 2,
                                shared_experts_recompute=[False] * 2,
                                pre_mlp_layernorm=[True] * 2),
    "full_uniform": dict(moe_layer_recompute=[False] * 2, shared_experts_recompute=[False] * 2,
                         pre_mlp_layernorm=[False] * 2),
    "full_block": dict(moe_layer_recompute=[False] * 2, shared_experts_recompute=[False] * 2,
                       pre_mlp_layernorm=[False] * 2),
}
EXPECTED_FLAGS["selective_moe_drop_and_pad"] = EXPECTED_FLAGS["selective_moe"]
EXPECTED_FLAGS["selective_moe_shared_overlap"] = dict(EXPECTED_FLAGS["selective_moe"],
                                                      shared_expert_overlap=[True] * 2)


def _check_flags(models, case):
    for name, m in models.items():
        flags = _recompute_flags(m)
        overlap = bool(BASE.get(case, {}).get("moe_shared_expert_overlap"))
        assert flags["shared_expert_overlap"] == [overlap] * 2, (name, flags)
        if name == "mok":
            assert flags["moe_layer_recompute"] == [False] * 2, (name, flags)
            continue
        want = EXPECTED_FLAGS[case]
        got = {k: flags[k] for k in want}
        assert got == want, (name, case, flags)
        if case.startswith("full"):
            assert flags["granularity"] == "full", flags
        if case == "moe_layer_recompute":
            assert "moe" in flags["modules"], flags


def _models(h, world, case, *, cpu, perturb=None, **extra):
    """``{"mok": no recompute, "mok_rc": mok + CASES[case], "a2a_rc": alltoall + CASES[case]}``,
    every one with the same weights (:func:`W._ep_overlap_models`). ``perturb``: ``(model,
    parameter name[, factor])`` to scale by ``factor`` (default ``1 + 2^-6``) after the weights
    are copied (negative control)."""
    rc, base = CASES[case], BASE.get(case, {})
    seq, vocab = (16, 64) if cpu else (64, 256)
    hidden, ffn = (32, 64) if cpu else (128, 256)
    built = {}
    for name, disp in (("mok", "mok"), ("mok_rc", "mok"), ("a2a_rc", "alltoall")):
        cfg_extra = dict(extra, **base, **(rc if name != "mok" else {}))
        built.update(W._ep_overlap_models(h, world, [(name, disp, False)], seq=seq, vocab=vocab,
                                          hidden=hidden, ffn=ffn, cpu=cpu, **cfg_extra))
    first = built["mok"].state_dict()
    for name in ("mok_rc", "a2a_rc"):
        built[name].load_state_dict(first)
    if perturb is not None:
        model, param, *factor = perturb
        with torch.no_grad():
            dict(built[model].named_parameters())[param].mul_(factor[0] if factor else 1 + 2 ** -6)
    for m in built.values():
        m.train()
    return built, seq, vocab


# Cases compared with alltoall within bf16 tolerance on CPU too: with drop-and-pad alltoall's
# padding rows are real tokens with prob 0 placed among the routed rows, mok's are zero rows
# after them, so each expert GEMM sees other rows in another order (as the drop-and-pad layer
# test in test_megatron_dispatcher.py, which is not bitwise either).
NOT_BITWISE_VS_ALLTOALL = {"selective_moe_drop_and_pad"}


def _compare(runs, case, cpu) -> dict:
    """The three steps' losses and gradients (see :func:`gpt_recompute`); raises
    ``AssertionError`` at the first mismatch."""
    (l0, g0), (l1, g1), (la, ga) = runs["mok"], runs["mok_rc"], runs["a2a_rc"]
    assert all(float(v.float().abs().sum()) > 0 for v in g1.values()), \
        ("zero gradients, mok with recompute", [k for k, v in g1.items() if not v.any()])
    assert any(".experts." in k for k in g1) and any("shared_experts" in k for k in g1)
    W._assert_bitwise(l1, l0, f"loss, mok with {case} vs without recompute")
    for k in g0:
        W._assert_bitwise(g1[k], g0[k], f"grad {k}: mok with {case} vs without recompute")
    report = {"losses": l1.tolist()}
    if cpu and case not in NOT_BITWISE_VS_ALLTOALL:
        W._assert_bitwise(la, l1, f"loss, alltoall vs mok, both with {case} (CPU)")
        for k in g1:
            W._assert_bitwise(ga[k], g1[k], f"grad {k}: alltoall vs mok, both with {case} (CPU)")
    else:
        # bf16: torch.testing's bf16 tolerances on CPU (drop-and-pad); on GPUs 2e-2
        tol = {} if cpu else dict(atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(l1, la, **({} if cpu else dict(atol=1e-2, rtol=1e-2)),
                                   msg=lambda m: f"loss: mok vs alltoall ({case}): {m}")
        for k in g1:
            torch.testing.assert_close(g1[k], ga[k], **tol,
                                       msg=lambda m: f"grad {k}: mok vs alltoall ({case}): {m}")
        report["max_grad_diff_vs_alltoall"] = max(
            (g1[k].float() - ga[k].float()).abs().max().item() for k in g1)
        report["bitwise_vs_alltoall"] = torch.equal(l1, la) and all(
            torch.equal(g1[k], ga[k]) for k in g1)
    return report


def gpt_recompute(rank, world, case, backend_env=None, batch_seed=None, perturb=None):
    """One training step of the 2-layer bf16 ``GPTModel`` (EP = ``world``, local spec) with
    ``mok`` and no recomputation, with ``mok`` and ``CASES[case]``, and with ``alltoall`` and
    ``CASES[case]``; the same weights and batch (seeded per rank). On CPU (``backend_env``
    ``None``: MoK's reference backend, gloo) each step is the loss's backward written out
    (``W._plain_step_cpu``: Megatron's schedule allocates on CUDA); on GPUs Megatron's
    ``forward_backward_no_pipelining`` (``W._train_step``).

    Asserts: Megatron turned the config into the recompute of ``case`` (its flags on every
    layer); ``mok``'s and ``alltoall``'s dispatchers, and the shared experts, pre-MLP
    layernorms, attentions and core attentions, each ran ``NUM_LAYERS`` times in the forward
    and ``RERUN[case]`` times inside the backward pass (nothing there without recompute);
    ``mok`` with recompute gives every parameter a nonzero gradient, and its loss and every
    gradient are bitwise those without recompute (the same ops on the same data);
    ``alltoall`` with the same recompute: bitwise on CPU (as the GPT-level mok-vs-alltoall
    test of tests/megatron/test_megatron_bridge.py; top-2: each token's two expert outputs are
    summed in one bf16 addition, which is commutative, and the experts see the same rows in
    the same order), except with drop-and-pad (``NOT_BITWISE_VS_ALLTOALL``: torch.testing's
    bf16 tolerances, rtol 1.6e-2); within bf16 tolerance on GPUs (2e-2, as
    ``W.gpt_ep_overlap_gpu``: Megatron's unpermute sums with atomics there, and the GEMMs may
    take other kernels).

    ``backend_env``: ``MOK_BACKEND`` (``"cuda"`` on GPUs, so a missing build fails).
    Negative controls: ``batch_seed`` (the ``mok`` recompute step on another batch) or
    ``perturb`` (``(model, parameter)`` nudged): the same checks, which must now fail; returns
    ``{"failed": the AssertionError's first line}`` (``None`` if nothing failed).
    """
    cpu = backend_env is None
    h = W._setup(world, backend_env)
    try:
        if cpu:
            h.enable_cpu_megatron(on_cpu=True)
            extra = dict(moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0)
        else:
            extra = {}
        # CPU: the overlapped shared expert's streams and events as no-ops (program order)
        overlap = BASE.get(case, {}).get("moe_shared_expert_overlap")
        stubs = W._cpu_cuda_streams if cpu and overlap else contextlib.nullcontext
        with stubs():
            models, seq, vocab = _models(h, world, case, cpu=cpu, perturb=perturb, **extra)
        _check_flags(models, case)
        types = {n: type(m.decoder.layers[0].mlp.token_dispatcher).__name__
                 for n, m in models.items()}
        assert types == {"mok": "MokTokenDispatcher", "mok_rc": "MokTokenDispatcher",
                         "a2a_rc": "MoEAlltoAllTokenDispatcher"}, types
        dev = torch.device("cpu") if cpu else W._device()
        batches = W._gpt_batches(rank, 1, 2, seq, vocab, dev)
        step = W._plain_step_cpu if cpu else W._train_step
        runs, seen = {}, {}
        for name, m in models.items():
            b = batches
            if name == "mok_rc" and batch_seed is not None:
                b = W._gpt_batches(rank + batch_seed, 1, 2, seq, vocab, dev)
            counts = {}
            with _call_counter(m, counts), _checkpoint_shims(), stubs():
                runs[name] = step(m, b)
            seen[name] = counts
        want = {"mok": _expected_calls(None), "mok_rc": _expected_calls(case),
                "a2a_rc": _expected_calls(case)}
        assert seen == want, (case, seen, want)
        n_params = len(list(models["mok"].parameters()))
        assert all(len(g) == n_params for _, g in runs.values()), \
            {n: sorted(g) for n, (_, g) in runs.items()}     # every parameter has a gradient
        if batch_seed is not None or perturb is not None:
            try:
                _compare(runs, case, cpu)
            except AssertionError as e:
                return {"failed": str(e).strip().splitlines()[0]}
            return {"failed": None}
        report = _compare(runs, case, cpu)
        report["backend"] = models["mok_rc"].decoder.layers[0].mlp.token_dispatcher.backend_name
        report["calls"] = {f"{w}:{p}": n for (w, p), n in seen["mok_rc"].items()}
        return report
    finally:
        h.destroy_parallel()

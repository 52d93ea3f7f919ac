"""``megatron_mok.megatron.install()``: registration, version gate, config-time checks, the
dense-routing -> top-k conversion, and the dispatcher's hooks in one process (no
torch.distributed: every group ``None``) against hand-computed drop-and-pad layouts. Single
process, CPU."""

from __future__ import annotations

import dataclasses
import typing

import warnings

import pytest
import torch

pytestmark = pytest.mark.megatron

import megatron_mok.megatron as mm  # noqa: E402
from megatron_mok.megatron import versions  # noqa: E402


@pytest.fixture(autouse=True)
def installed():
    mm.install()
    yield


def _cfg(**kw):
    from megatron.core.transformer.transformer_config import TransformerConfig

    base = dict(num_layers=1, hidden_size=16, num_attention_heads=4, num_moe_experts=8,
                moe_router_topk=2, moe_token_dispatcher_type="mok", use_cpu_initialization=True)
    base.update(kw)
    return TransformerConfig(**base)


def test_install_is_idempotent_and_reports_version():
    v1 = mm.install()
    v2 = mm.install()
    assert v1 == v2 == versions.megatron_core_version()
    assert mm.is_installed()
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.transformer_config import TransformerConfig

    # patched once, not wrapped twice
    assert MoELayer.__init__._mok_patched
    assert not getattr(MoELayer.__init__.__wrapped__, "_mok_patched", False)
    assert not getattr(TransformerConfig.__post_init__.__wrapped__, "_mok_patched", False)


def test_mok_is_a_valid_config_value_and_choice():
    from megatron.core.transformer.transformer_config import (MLATransformerConfig,
                                                              TransformerConfig)

    for cls in (TransformerConfig, MLATransformerConfig):
        f = {x.name: x for x in dataclasses.fields(cls)}["moe_token_dispatcher_type"]
        assert typing.get_origin(f.type) is typing.Literal
        assert set(typing.get_args(f.type)) >= {"allgather", "alltoall", "flex", "mok"}
    cfg = _cfg()
    assert cfg.moe_token_dispatcher_type == "mok"
    # dataclasses.replace re-runs __post_init__ with the checks
    assert dataclasses.replace(cfg, moe_router_topk=4).moe_router_topk == 4


def test_uninstall_restores_and_reinstall_works():
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.transformer_config import TransformerConfig

    mm.uninstall()
    try:
        assert not mm.is_installed()
        f = TransformerConfig.__dataclass_fields__["moe_token_dispatcher_type"]
        assert "mok" not in typing.get_args(f.type)
        assert not getattr(MoELayer.__init__, "_mok_patched", False)
        assert not getattr(TransformerConfig.__post_init__, "_mok_patched", False)
    finally:
        mm.install()
    assert "mok" in typing.get_args(TransformerConfig.__dataclass_fields__[
        "moe_token_dispatcher_type"].type)


@pytest.mark.parametrize("overrides,needle", [
    # expert TP sends each route to every expert-TP rank: 8 x 8 routes per token is more than
    # the CUDA kernels take (32)
    (dict(moe_router_topk=8, expert_tensor_parallel_size=8, tensor_model_parallel_size=8,
          sequence_parallel=True, add_bias_linear=False), "8 x 8 = 64 routes per token"),
    (dict(moe_router_topk=8, tensor_model_parallel_size=8, sequence_parallel=True,
          add_bias_linear=False), "8 x 8 = 64 routes per token"),      # ETP defaults to TP
    (dict(num_moe_experts=128, expert_tensor_parallel_size=2, expert_model_parallel_size=64,
          add_bias_linear=False), "= 128 ranks"),
    (dict(num_moe_experts=None), "num_moe_experts"),
])
def test_unsupported_configs_fail_at_config_time(overrides, needle):
    with pytest.raises(mm.MokConfigError) as e:
        _cfg(**overrides)
    assert needle in str(e.value)
    assert "moe_token_dispatcher_type='mok'" in str(e.value)


def test_supported_variants_build_configs(monkeypatch):
    # router-side token dropping (capacity factor, no padding), drop-and-pad, and a
    # non-overlapped shared expert are fine: MoK just sees fewer routes / gives every expert
    # capacity x EP rows / Megatron runs the shared expert
    _cfg(moe_expert_capacity_factor=1.25)
    cfg = _cfg(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True)
    assert cfg.moe_pad_expert_input_to_capacity and cfg.moe_token_dispatcher_type == "mok"
    # ... and Megatron's own check that drop-and-pad needs a capacity factor still runs
    with pytest.raises(ValueError, match="moe_expert_capacity_factor must be set"):
        _cfg(moe_pad_expert_input_to_capacity=True)
    _cfg(moe_shared_expert_intermediate_size=32)
    # expert tensor parallelism (routes widened to the TPxEP group), also by default from TP
    # (Megatron allows MoE biases with ETP = 1 only)
    etp = dict(sequence_parallel=True, add_bias_linear=False)
    assert _cfg(expert_tensor_parallel_size=2, tensor_model_parallel_size=2,
                **etp).expert_tensor_parallel_size == 2
    _cfg(moe_router_topk=8, tensor_model_parallel_size=4, **etp)  # 32 routes
    # the reference backend has no bound on the routes per token
    monkeypatch.setenv("MOK_BACKEND", "reference")
    cfg = _cfg(moe_router_topk=8, expert_tensor_parallel_size=8, tensor_model_parallel_size=8,
               num_attention_heads=8, **etp)
    assert cfg.expert_tensor_parallel_size == 8
    monkeypatch.delenv("MOK_BACKEND")
    # other dispatchers are untouched by the MoK checks
    _cfg(moe_token_dispatcher_type="alltoall", moe_shared_expert_intermediate_size=32,
         moe_shared_expert_overlap=True)


def test_shared_expert_overlap_config_is_validated_as_alltoall():
    # Megatron allows the overlap for alltoall / flex only; a mok config passes its checks as
    # alltoall's and stays mok afterwards (also through dataclasses.replace)
    cfg = _cfg(moe_shared_expert_intermediate_size=32, moe_shared_expert_overlap=True)
    assert cfg.moe_token_dispatcher_type == "mok" and cfg.moe_shared_expert_overlap
    assert dataclasses.replace(cfg, moe_router_topk=4).moe_token_dispatcher_type == "mok"
    # ... and Megatron's own checks of the overlap still run: with the type left as 'mok'
    # Megatron would reject the overlap itself; as alltoall it rejects recomputing it
    with pytest.raises(ValueError, match="moe-shared-expert-overlap"):
        _cfg(moe_shared_expert_intermediate_size=32, moe_shared_expert_overlap=True,
             recompute_granularity="selective", recompute_modules=["shared_experts"])
    # a validation that fails inside Megatron's checks (run as alltoall's) leaves the config
    # mok: Megatron refuses both overlaps together
    cfg = _cfg(moe_shared_expert_intermediate_size=32, moe_shared_expert_overlap=True,
               expert_model_parallel_size=2, bf16=True, params_dtype=torch.bfloat16)
    cfg.overlap_moe_expert_parallel_comm = True
    with pytest.raises((ValueError, AssertionError), match="moe_shared_expert_overlap"):
        cfg.__post_init__()
    assert cfg.moe_token_dispatcher_type == "mok"


def _overlap_cfg(**kw):
    base = dict(overlap_moe_expert_parallel_comm=True, expert_model_parallel_size=2, bf16=True,
                params_dtype=torch.bfloat16)
    base.update(kw)
    return _cfg(**base)


def test_ep_overlap_config_is_validated_as_alltoall():
    # Megatron's 1F1B EP overlap with mok: the config is validated as alltoall's and stays mok
    cfg = _overlap_cfg()
    assert cfg.moe_token_dispatcher_type == "mok" and cfg.overlap_moe_expert_parallel_comm
    assert dataclasses.replace(cfg, moe_router_topk=4).moe_token_dispatcher_type == "mok"
    # Megatron's own checks of the overlap still run (as alltoall's): with the type left as
    # 'mok' it would reject the dispatcher; as alltoall it rejects fp32 and full recompute
    with pytest.raises((ValueError, AssertionError), match="bf16 or fp16"):
        _overlap_cfg(bf16=False, params_dtype=torch.float32)
    with pytest.raises((ValueError, AssertionError), match="recomput"):
        _overlap_cfg(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    # the MoK checks still come first: an unsupported setting beside the overlap is named
    with pytest.raises(mm.MokConfigError, match="64 routes per token"):
        _overlap_cfg(moe_router_topk=8, expert_tensor_parallel_size=8, tensor_model_parallel_size=8,
                     sequence_parallel=True, add_bias_linear=False)


def test_ep_overlap_keeps_the_inputs_mok_still_needs():
    # The overlap frees some schedule nodes' inputs after their forward. For mok the dispatch
    # input (a view of the layernorm output, which a bf16 gate or a shared expert keeps) and the
    # dispatched rows (which the experts keep) must stay; the combine input may go, as for
    # alltoall.
    from megatron_mok.megatron import _patch

    mod = _patch.free_input_module()
    assert mod is not None and mod.should_free_input._mok_patched
    mok = _overlap_cfg()
    a2a = _overlap_cfg(moe_token_dispatcher_type="alltoall")
    n_args = mod.should_free_input.__wrapped__.__code__.co_argcount
    extra = (4,) * (n_args - 3)                         # 0.19: num_local_experts
    call = lambda name, cfg: mod.should_free_input(name, True, cfg, *extra)  # noqa: E731
    orig = lambda name, cfg: mod.should_free_input.__wrapped__(name, True, cfg, *extra)  # noqa: E731
    assert not call("moe_dispatch", mok) and not call("mlp", mok)
    assert call("moe_combine", mok) == orig("moe_combine", mok) is True
    for name in ("moe_dispatch", "mlp", "moe_combine", "pre_dispatch_computation"):
        assert call(name, a2a) == orig(name, a2a), name       # other dispatchers: Megatron's rule
    assert orig("moe_dispatch", a2a) and orig("mlp", a2a)     # what mok must not inherit
    mm.uninstall()
    try:
        assert not getattr(mod.should_free_input, "_mok_patched", False)
    finally:
        mm.install()
    assert mod.should_free_input._mok_patched


def test_ep_overlap_is_refused_without_the_free_rule(monkeypatch):
    # a megatron-core where install() finds no should_free_input to wrap: the overlap is refused
    # for mok at config time (freeing mok's inputs would corrupt the backward), naming why
    from megatron_mok.megatron import _patch

    mm.uninstall()
    monkeypatch.setattr(_patch, "_FREE_INPUT_MODULES", ("megatron_mok_no_such_module",))
    try:
        mm.install()
        assert _patch.free_input_module() is None
        with pytest.raises(mm.MokConfigError, match="should_free_input"):
            _overlap_cfg()
        _cfg()                                   # everything else still works
    finally:
        mm.uninstall()
        monkeypatch.undo()
        mm.install()
    assert _patch.free_input_module() is not None


def _fake_bridge_source() -> str:
    """A stand-in for Bridge 0.3's ``training/comm_overlap.py``: the assertion it makes on the
    dispatcher when the user asks for the 1F1B EP overlap, and the record of what it saw."""
    return (
        "SEEN = []\n"
        "class CommOverlapConfig:\n"
        "    def __init__(self, overlap):\n"
        "        self.user_comm_overlap_cfg = type('U', (), {'overlap_moe_expert_parallel_comm': overlap})()\n"
        "    def _get_model_comm_overlap_cfgs(self, model_cfg, ddp_config=None):\n"
        "        SEEN.append(model_cfg.moe_token_dispatcher_type)\n"
        "        if self.user_comm_overlap_cfg.overlap_moe_expert_parallel_comm is True:\n"
        "            assert model_cfg.moe_token_dispatcher_type in ['alltoall', 'flex'], 'only alltoall or flex'\n"
        "        return 'cfgs'\n")


def test_bridge_comm_overlap_validates_mok_as_alltoall():
    # Item 5 of _patch's docstring on a stand-in module: with the overlap asked for, a mok model
    # config passes Bridge's dispatcher assertion as alltoall's and comes back as mok; without
    # it, Bridge's method sees mok itself; uninstall() restores Bridge's method
    import types

    from megatron_mok.megatron import _patch

    mod = types.ModuleType("fake_bridge_comm_overlap")
    exec(_fake_bridge_source(), mod.__dict__)
    orig = mod.CommOverlapConfig._get_model_comm_overlap_cfgs
    model = types.SimpleNamespace(moe_token_dispatcher_type="mok")
    with pytest.raises(AssertionError, match="only alltoall or flex"):
        mod.CommOverlapConfig(True)._get_model_comm_overlap_cfgs(model)   # Bridge as it is
    saved = {}
    _patch._patch_bridge_comm_overlap(mod, saved)
    _patch._patch_bridge_comm_overlap(mod, saved)                          # not wrapped twice
    assert mod.CommOverlapConfig._get_model_comm_overlap_cfgs.__wrapped__ is orig
    mod.SEEN.clear()
    assert mod.CommOverlapConfig(True)._get_model_comm_overlap_cfgs(model, None) == "cfgs"
    assert model.moe_token_dispatcher_type == "mok" and mod.SEEN == ["alltoall"]
    assert mod.CommOverlapConfig(False)._get_model_comm_overlap_cfgs(model) == "cfgs"
    assert mod.SEEN == ["alltoall", "mok"]
    other = types.SimpleNamespace(moe_token_dispatcher_type="allgather")   # not ours: Bridge's rule
    with pytest.raises(AssertionError, match="only alltoall or flex"):
        mod.CommOverlapConfig(True)._get_model_comm_overlap_cfgs(other)
    _patch._restore_bridge(saved)
    assert mod.CommOverlapConfig._get_model_comm_overlap_cfgs is orig


@pytest.mark.parametrize("when", ["after_install", "before_install"])
def test_bridge_module_is_patched_when_imported(when, tmp_path, monkeypatch):
    # install() imports nothing of Bridge: a finder patches the module when something imports it
    # later (the docs' order: install(), then Bridge's recipe); a module imported before
    # install() is patched at once. uninstall() removes the finder and restores the method.
    import importlib
    import sys
    import types

    from megatron_mok.megatron import _patch

    name = f"mok_fake_bridge_{when}"
    (tmp_path / f"{name}.py").write_text(_fake_bridge_source())
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(_patch, "BRIDGE_COMM_OVERLAP_MODULE", name)
    mm.uninstall()
    try:
        mod = importlib.import_module(name) if when == "before_install" else None
        mm.install()
        finder = _patch._STATE["saved"]["bridge_finder"]
        assert finder in sys.meta_path
        if mod is None:
            assert name not in sys.modules        # install() did not import it
            mod = importlib.import_module(name)
        method = mod.CommOverlapConfig._get_model_comm_overlap_cfgs
        assert method._mok_patched
        # the module's loader still answers what tools ask of it (tracebacks read the source)
        assert "class CommOverlapConfig" in mod.__loader__.get_source(name)
        model = types.SimpleNamespace(moe_token_dispatcher_type="mok")
        assert mod.CommOverlapConfig(True)._get_model_comm_overlap_cfgs(model) == "cfgs"
        assert model.moe_token_dispatcher_type == "mok" and mod.SEEN == ["alltoall"]
        mm.uninstall()
        assert finder not in sys.meta_path
        assert mod.CommOverlapConfig._get_model_comm_overlap_cfgs is method.__wrapped__
    finally:
        sys.modules.pop(name, None)
        mm.uninstall()
        monkeypatch.undo()
        mm.install()


def test_version_gate():
    assert versions.parse_version("0.19.2rc1") == (0, 19, 2)
    assert versions.parse_version("0.16") == (0, 16, 0)
    for ok in ("0.16.0", "0.16.1", "0.17.1", "0.18.2", "0.19.2"):
        assert versions.check_supported(ok) == ok
    for bad in ("0.15.3", "0.20.0", "1.0.0"):
        with pytest.raises(RuntimeError, match="MOK_MEGATRON_SKIP_VERSION_CHECK"):
            versions.check_supported(bad)


def test_version_gate_override(monkeypatch):
    monkeypatch.setenv(versions.SKIP_CHECK_ENV, "1")
    with pytest.warns(UserWarning, match="0.20.0"):
        assert versions.check_supported("0.20.0") == "0.20.0"
    for off in ("0", ""):                    # set to 0 or empty: the gate stays
        monkeypatch.setenv(versions.SKIP_CHECK_ENV, off)
        with pytest.raises(RuntimeError, match="MOK_MEGATRON_SKIP_VERSION_CHECK"):
            versions.check_supported("0.20.0")


def test_options_from_env_and_config(monkeypatch):
    monkeypatch.setenv("MOK_BACKEND", "reference")
    monkeypatch.setenv("MOK_MAX_TOKENS_PER_RANK", "4096")
    monkeypatch.setenv("MOK_COMBINE_PARTIAL_DTYPE", "fp32")
    o = mm.MokOptions.from_config(None)
    assert (o.backend, o.max_tokens_per_rank, o.combine_partial_dtype) == \
        ("reference", 4096, torch.float32)
    cfg = _cfg()
    cfg.moe_mok_backend = "cuda"                 # a config attribute wins over the env
    assert mm.MokOptions.from_config(cfg).backend == "cuda"
    monkeypatch.setenv("MOK_BACKEND", "nccl")
    with pytest.raises(mm.MokConfigError, match="MOK_BACKEND"):
        mm.MokOptions.from_config(None)
    monkeypatch.setenv("MOK_BACKEND", "auto")
    assert mm.MokOptions.from_config(None).comm_stream == "current"
    monkeypatch.setenv("MOK_COMM_STREAM", "high")
    assert mm.MokOptions.from_config(None).comm_stream == "high"
    monkeypatch.setenv("MOK_COMM_STREAM", "side")
    with pytest.raises(mm.MokConfigError, match="MOK_COMM_STREAM"):
        mm.MokOptions.from_config(None)


def test_routing_map_to_topk():
    from megatron_mok.megatron.dispatcher import routing_map_to_topk

    rmap = torch.tensor([[0, 1, 0, 1, 0, 0],
                         [1, 0, 0, 0, 0, 1],
                         [0, 0, 0, 0, 0, 0],
                         [0, 0, 1, 0, 0, 0]], dtype=torch.bool)
    probs = (torch.arange(24, dtype=torch.float32).view(4, 6) / 10 * rmap).requires_grad_(True)
    idx, w = routing_map_to_topk(rmap, probs, 2)
    assert idx.tolist() == [[1, 3], [0, 5], [-1, -1], [2, -1]]
    assert idx.dtype == torch.int64 and w.dtype == torch.float32
    torch.testing.assert_close(w, torch.tensor([[0.1, 0.3], [0.6, 1.1], [0, 0], [2.0, 0]]))
    w.sum().backward()
    assert torch.equal(probs.grad, rmap.float())
    # bf16 probs come through exactly as float32
    idx2, w2 = routing_map_to_topk(rmap, probs.detach().bfloat16(), 2)
    assert torch.equal(idx2, idx) and torch.equal(w2, w.detach().bfloat16().float())
    # empty input
    i0, w0 = routing_map_to_topk(rmap[:0], probs.detach()[:0], 2)
    assert i0.shape == (0, 2) and w0.shape == (0, 2)
    # more routes than top-k is an error, not a silent drop
    with pytest.raises(RuntimeError, match="more than moe_router_topk"):
        routing_map_to_topk(torch.ones(2, 6, dtype=torch.bool), torch.ones(2, 6), 2)


def test_expand_routes_for_expert_tp():
    from megatron_mok.megatron.dispatcher import expand_routes_for_expert_tp

    # 2 experts per EP rank, ETP 2: expert e = (ep, l) -> virtual (ep * 2 + t) * 2 + l
    idx = torch.tensor([[0, 3], [-1, 2], [1, -1]])
    w = torch.tensor([[0.5, 0.25], [0.0, 0.75], [1.0, 0.0]], requires_grad=True)
    v, vw = expand_routes_for_expert_tp(idx, w, 2, 2)
    assert v.tolist() == [[0, 2, 5, 7], [-1, -1, 4, 6], [1, 3, -1, -1]]
    assert v.dtype == torch.int64 and vw.dtype == torch.float32
    assert vw.tolist() == [[0.5, 0.5, 0.25, 0.25], [0.0, 0.0, 0.75, 0.75], [1.0, 1.0, 0.0, 0.0]]
    # each copy's gradient flows back to its route: the expert-TP shards' parts add up
    (vw * torch.arange(1.0, 13.0).view(3, 4)).sum().backward()
    assert w.grad.tolist() == [[3.0, 7.0], [11.0, 15.0], [19.0, 23.0]]
    # every virtual expert of EP rank ep's TP ranks holds EP rank ep's experts (ETP 3, L 4)
    idx = torch.arange(-1, 8).view(-1, 1)
    v, _ = expand_routes_for_expert_tp(idx, torch.ones(9, 1), 4, 3)
    for e, row in zip(range(-1, 8), v.tolist()):
        want = [-1] * 3 if e < 0 else [((e // 4) * 3 + t) * 4 + e % 4 for t in range(3)]
        assert row == want, (e, row)
    assert expand_routes_for_expert_tp(idx[:0], torch.ones(0, 1), 4, 3)[0].shape == (0, 3)


@pytest.mark.parametrize("scopes,drop_and_pad,needle", [
    (["moe"], False, "(scope 'moe')"),
    ([], False, "(the whole layer)"),
    ("full", False, "(the whole layer)"),                     # Megatron's default, unnormalised
    ("attn,moe", False, "(scope 'moe')"),                     # a comma-separated string
    (["moe_preprocess", "moe_router"], False, None),          # partial capture: dispatch eager
    (["moe_preprocess", "moe_router"], True, None),
    ("moe_router,moe_preprocess", False, None),
    (["moe"], True, None),
    ([], True, None),
    ("full", True, None),
    (["moe_router"], False, None),
    (["attn"], False, None),
])
@pytest.mark.parametrize("rank_budget", [None, 1.5])
def test_cuda_graph_scopes(scopes, drop_and_pad, needle, rank_budget):
    # CUDA graphs over the MoE layer: with drop-and-pad the dispatch reads nothing while
    # captured (tests/megatron: test_drop_and_pad_layer_graph_capture_one_gpu), so 'moe' and
    # the whole layer pass; a dropless dispatch reads R on the host, so only the partial
    # capture (router + preprocess, the dispatch eager: test_partial_cuda_graphs_one_gpu) does.
    # The per-rank budget (0.19) changes none of it: Megatron's PagedStashRunner resets only a
    # full-iteration graph before its dropless rerun, so a per-layer graph would replay the
    # budgeted dispatch there (the message says so).
    import types
    from megatron_mok.megatron.config import config_problems

    cfg = types.SimpleNamespace(moe_token_dispatcher_type="mok", num_moe_experts=8,
                                expert_tensor_parallel_size=1, tensor_model_parallel_size=1,
                                cuda_graph_impl="transformer_engine", cuda_graph_modules=scopes,
                                moe_pad_expert_input_to_capacity=drop_and_pad,
                                moe_expert_capacity_factor=1.0 if drop_and_pad else None,
                                moe_expert_rank_capacity_factor=rank_budget)
    problems = [q for q in config_problems(cfg) if "CUDA graph" in q]
    if needle is None:
        assert problems == []
    else:
        assert len(problems) == 1 and needle in problems[0], problems
        why = "PagedStashRunner resets only a full-iteration graph"
        assert (why in problems[0]) == (rank_budget is not None), problems


# The spellings of a full-iteration graph (one graph over the whole forward-backward, every
# dispatch in it), before and after Megatron's __post_init__ normalises them: 0.18 / 0.19
# cuda_graph_impl='full_iteration', to which the deprecated module name 'full_iteration'
# migrates from 'none' or 'local'; 0.16 / 0.17 cuda_graph_impl='local' with the scope
# 'full_iteration' (impl 'none' captures nothing there); the deprecated enable_cuda_graph flag
# counts as 'local'. A config with a cuda_graph_modules field follows 0.18 / 0.19.
_FULL_ITERATION = "CUDA graphs capture the whole training iteration"


@pytest.mark.parametrize("fields,full", [
    (dict(cuda_graph_impl="full_iteration", cuda_graph_modules=[]), True),         # 0.19
    (dict(cuda_graph_impl="full_iteration", cuda_graph_modules="full"), True),     # unnormalised
    (dict(cuda_graph_impl="local", cuda_graph_modules="full_iteration"), True),    # deprecated
    (dict(cuda_graph_impl="none", cuda_graph_modules=["full_iteration"]), True),
    (dict(cuda_graph_impl="none", cuda_graph_modules="full", cuda_graph_scope="full_iteration"),
     True),                                                   # 0.19's deprecated scope field
    (dict(cuda_graph_impl="local", cuda_graph_scope=["full_iteration"]), True),    # 0.16
    (dict(cuda_graph_impl="local", cuda_graph_scope="full_iteration"), True),
    (dict(cuda_graph_impl="local", cuda_graph_scope="full_iteration,attn"), True),
    (dict(cuda_graph_impl="none", enable_cuda_graph=True, cuda_graph_scope="full_iteration"),
     True),
    (dict(cuda_graph_impl="none", cuda_graph_scope="full_iteration"), False),      # 0.16: none
    (dict(cuda_graph_impl="local", cuda_graph_scope=["attn"]), False),
])
@pytest.mark.parametrize("drop_and_pad", [False, True])
@pytest.mark.parametrize("rank_budget", [None, 1.5])
def test_full_iteration_cuda_graph_needs_drop_and_pad(fields, full, drop_and_pad, rank_budget):
    # A dropless dispatch reads its row count on the host: it cannot be in a graph, and a
    # full-iteration graph has every dispatch in it. Drop-and-pad's dispatch reads nothing
    # while captured (as with the 'moe' scope), nor does the per-rank budget's (0.19's
    # moe_expert_rank_capacity_factor: PagedStashRunner resets this graph before its dropless
    # rerun), so with either it is not refused.
    import types
    from megatron_mok.megatron.config import config_problems

    cfg = types.SimpleNamespace(moe_token_dispatcher_type="mok", num_moe_experts=8,
                                expert_tensor_parallel_size=1, tensor_model_parallel_size=1,
                                moe_pad_expert_input_to_capacity=drop_and_pad,
                                moe_expert_capacity_factor=1.0 if drop_and_pad else None,
                                moe_expert_rank_capacity_factor=rank_budget, **fields)
    problems = [q for q in config_problems(cfg) if "CUDA graph" in q]
    if full and not drop_and_pad and rank_budget is None:
        assert len(problems) == 1 and _FULL_ITERATION in problems[0], problems
        # says what to use instead
        for hint in ("moe_pad_expert_input_to_capacity", "'moe_router' / 'moe_preprocess'",
                     "moe_expert_rank_capacity_factor", "disable CUDA graphs"):
            assert hint in problems[0], (hint, problems[0])
    else:
        assert problems == [], problems
    from megatron_mok.megatron.versions import cuda_graph_impl

    assert (cuda_graph_impl(cfg) == "full_iteration") == full


def test_full_iteration_cuda_graph_refused_by_this_megatron_core():
    # The installed release's own spelling, through TransformerConfig (the check runs before
    # and after its __post_init__): 0.18+ cuda_graph_impl='full_iteration', 0.16 / 0.17
    # cuda_graph_impl='local' with the scope 'full_iteration'.
    from megatron_mok.megatron.harness import graph_scope_kwargs

    fields = {f.name for f in dataclasses.fields(_cfg().__class__)}
    if "cuda_graph_modules" in fields:
        graph = dict(cuda_graph_impl="full_iteration")
    else:
        graph = dict(cuda_graph_impl="local", **graph_scope_kwargs(["full_iteration"]))
    with pytest.raises(mm.MokConfigError, match=_FULL_ITERATION):
        _cfg(**graph)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = _cfg(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True, **graph)
    assert mm.config_problems(cfg) == []
    # the normalised config is refused too (MoELayer checks it again when it builds the layer)
    cfg.moe_pad_expert_input_to_capacity = False
    assert any(_FULL_ITERATION in q for q in mm.config_problems(cfg))


@pytest.mark.parametrize("impl,scopes,ok", [
    ("local", ["moe_router", "moe_preprocess"], False),
    ("local", "moe_router", False),
    ("transformer_engine", ["moe_router", "moe_preprocess"], True),   # postprocess not captured
    ("local", ["attn"], True),
])
def test_cuda_graphs_with_shared_expert_overlap(impl, scopes, ok):
    import types
    from megatron_mok.megatron.config import config_problems

    cfg = types.SimpleNamespace(moe_token_dispatcher_type="mok", num_moe_experts=8,
                                expert_tensor_parallel_size=1, tensor_model_parallel_size=1,
                                cuda_graph_impl=impl, cuda_graph_modules=scopes,
                                moe_shared_expert_overlap=True)
    problems = [q for q in config_problems(cfg) if "moe_shared_expert_overlap" in q]
    assert (problems == []) == ok, problems


def test_rank_budget_is_used_and_the_paged_stash_accepted():
    # megatron-core 0.19's per-rank budget (moe_expert_rank_capacity_factor) is mok's
    # Buffer.dispatch(recv_budget=M) now (budget.py): no warning that it is ignored; the paged
    # stash, which Megatron builds on it, is accepted with it and refused without it (Megatron
    # 0.19 refuses that too; mok's check also runs on a config edited after Megatron's).
    import types
    from megatron_mok.megatron.config import check_config, config_problems

    base = dict(moe_token_dispatcher_type="mok", num_moe_experts=8, expert_tensor_parallel_size=1,
                tensor_model_parallel_size=1)
    for fields in (dict(moe_expert_rank_capacity_factor=1.5),
                   dict(moe_expert_rank_capacity_factor=1.5, moe_paged_stash=True),
                   dict(moe_expert_rank_capacity_factor=2),            # an int is a number too
                   {}):                                                # 0.16: no such field
        cfg = types.SimpleNamespace(**base, **fields)
        assert config_problems(cfg) == [], fields
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            check_config(cfg)
    stash = types.SimpleNamespace(moe_paged_stash=True, moe_expert_rank_capacity_factor=None, **base)
    with pytest.raises(mm.MokConfigError, match="moe_paged_stash is set without "
                                                "moe_expert_rank_capacity_factor"):
        check_config(stash)


@pytest.mark.parametrize("bad", [0, 0.0, -1.5, float("nan"), float("inf"), "1.5", True])
def test_rank_budget_factor_must_be_a_positive_number(bad):
    import types
    from megatron_mok.megatron.config import config_problems

    cfg = types.SimpleNamespace(moe_token_dispatcher_type="mok", num_moe_experts=8,
                                moe_expert_rank_capacity_factor=bad)
    problems = config_problems(cfg)
    assert len(problems) == 1 and "moe_expert_rank_capacity_factor must be" in problems[0], problems


def test_rank_budget_through_this_megatron_cores_config():
    # megatron-core 0.19 accepts the factor only with moe_flex_dispatcher_backend 'hybridep'
    # (and the TE op fuser) or 'ncclep' ('flex' only), even for mok: its own check, which mok
    # neither rewrites nor hides. 0.16 has no such field: set on a built config, it is used.
    fields = {f.name for f in dataclasses.fields(_cfg().__class__)}
    if "moe_expert_rank_capacity_factor" not in fields:
        cfg = _cfg()
        cfg.moe_expert_rank_capacity_factor = 1.5
        assert mm.config_problems(cfg) == []
        with pytest.raises(TypeError):
            _cfg(moe_expert_rank_capacity_factor=1.5)
        return
    with pytest.raises(ValueError, match="requires moe_flex_dispatcher_backend") as e:
        _cfg(moe_expert_rank_capacity_factor=1.5)
    assert not isinstance(e.value, mm.MokConfigError)
    megatron_says = dict(moe_flex_dispatcher_backend="hybridep", use_transformer_engine_op_fuser=True)
    cfg = _cfg(moe_expert_rank_capacity_factor=1.5, **megatron_says)
    assert cfg.moe_token_dispatcher_type == "mok" and cfg.moe_expert_rank_capacity_factor == 1.5
    assert cfg.moe_flex_dispatcher_backend == "hybridep"
    assert _cfg(moe_expert_rank_capacity_factor=1.5, moe_paged_stash=True,
                **megatron_says).moe_paged_stash
    # a full-iteration graph with the budget is accepted at config time (the experts are
    # checked when the layer is built: test_full_iteration_with_the_budget_needs_padded_experts)
    full = _cfg(moe_expert_rank_capacity_factor=1.5, cuda_graph_impl="full_iteration",
                **megatron_says)
    assert versions.cuda_graph_impl(full) == "full_iteration"


def _budget_dispatcher(factor, **cfg_kw):
    """:func:`_dispatcher` with ``moe_expert_rank_capacity_factor`` set on its config before the
    dispatcher is built (0.16 has no such field; 0.19's own check wants 'hybridep' for it)."""
    import types
    from megatron_mok.megatron.dispatcher import MokTokenDispatcher

    cfg = _cfg(**cfg_kw)
    cfg.moe_expert_rank_capacity_factor = factor
    pg = types.SimpleNamespace(ep=None, expt_tp=None, tp_ep=None)
    E = cfg.num_moe_experts
    return MokTokenDispatcher(E, list(range(E)), cfg, pg_collection=pg)


def test_every_dispatcher_has_the_budget_manager(fresh_buffers):
    # Megatron's PagedStashRunner reaches through token_dispatcher._comm_manager on every MoE
    # layer it tracks (hasattr ... moe_expert_rank_capacity_factor), and ORs
    # check_over_budget().view(-1)[0] over them: both exist before any dispatch, factor or not
    for d, factor in ((_dispatcher(), None), (_budget_dispatcher(1.25), 1.25)):
        assert hasattr(d._comm_manager, "moe_expert_rank_capacity_factor")
        assert d._comm_manager.moe_expert_rank_capacity_factor == factor
        flag = d.check_over_budget()
        assert flag.dtype == torch.bool and tuple(flag.shape) == (1,) and not bool(flag.view(-1)[0])
        d.reset_over_budget()
    assert _dispatcher().recv_budget(10) is None          # no factor: no budget


@pytest.mark.parametrize("fp8,fuser", [(False, False), (True, False), (False, True)])
def test_rank_budget_is_hybrideps_formula(fresh_buffers, fp8, fuser):
    # M = int(T x K x ETP x factor) rounded up to HybridEP's pad multiple and the Buffer's
    # alignment; on megatron-core 0.19 also against HybridEP's own setup_metadata (ETP = 1:
    # HybridEP counts topk alone, mok topk x ETP, as NCCL EP does).
    import types

    kw = {}
    if fuser:
        if "use_transformer_engine_op_fuser" not in {f.name for f in dataclasses.fields(
                _cfg().__class__)}:
            pytest.skip("no TE op fuser in this megatron-core (0.19+)")
        kw["use_transformer_engine_op_fuser"] = True
    d = _budget_dispatcher(1.0, **kw)
    pad = 256 if fuser else 1
    if fp8:
        d.config.fp8 = "hybrid"                # Megatron's FP8 pad multiple 16 (no TE needed)
        d.config.moe_router_padding_for_quantization = True
        pad = 16
    try:
        from megatron.core.transformer.moe.token_dispatcher import _HybridEPManager
    except ImportError:
        _HybridEPManager = None
    hybridep = (_HybridEPManager is not None
                and hasattr(_HybridEPManager, "setup_metadata")
                and "moe_expert_rank_capacity_factor" in {f.name for f in dataclasses.fields(
                    d.config.__class__)})
    compared = 0
    for T, factor, etp, buffer_align in ((37, 1.3, 1, 1), (61, 0.5, 1, 1), (1, 2.0, 1, 1),
                                          (0, 1.5, 1, 1), (40, 1.0, 2, 1), (33, 0.7, 4, 1),
                                          (37, 1.3, 1, pad)):
        d._comm_manager.moe_expert_rank_capacity_factor = factor
        d.etp = etp
        d.buffer = types.SimpleNamespace(expert_alignment=buffer_align)
        rows = int(T * 2 * etp * factor)
        want = rows + (-rows % pad)
        assert d.recv_budget(T) == want, (T, factor, etp, buffer_align, pad)
        if hybridep and etp == 1:
            d.config.moe_expert_rank_capacity_factor = factor
            stub = types.SimpleNamespace(config=d.config, num_experts=8, drop_and_pad=False,
                                         moe_expert_rank_capacity_factor=factor,
                                         capacity_factor=None, group=None)
            if pad == 1:            # HybridEP has no fp8 / fuser here: its pad multiple is 0
                continue            # and it divides by it (0.19 requires the fuser with it)
            _HybridEPManager.setup_metadata(stub, torch.zeros(T, 8, dtype=torch.bool),
                                            torch.zeros(T, 8))
            assert d.recv_budget(T) == stub.num_permuted_tokens, (T, factor)
            compared += 1
    assert compared == (5 if hybridep and pad > 1 else 0), compared   # (0.19: it ran)
    # drop-and-pad's rows_per_expert wins, as in HybridEP; no factor on _comm_manager (the
    # PagedStashRunner's rerun): no budget
    d.drop_and_pad = True
    assert d.recv_budget(37) is None
    d.drop_and_pad = False
    d._comm_manager.moe_expert_rank_capacity_factor = None
    assert d.recv_budget(37) is None


# The routing of test_drop_and_pad_hooks_hand_computed without its padding: 6 tokens, 4
# experts, top-2; t0 -> 0,1; t1 -> 0,2; t2 -> 0,3; t3 -> 1,2; t4 -> 1; t5 -> none. In contract
# order (one rank: expert, then token) the R = 9 rows are e0: t0 t1 t2 | e1: t0 t3 t4 |
# e2: t1 t3 | e3: t2.
_ROUTES = {0: (0, 1), 1: (0, 2), 2: (0, 3), 3: (1, 2), 4: (1,)}


def _budget_call(d, factor, x, routes=_ROUTES):
    """One forward + backward through the dispatcher's hooks with ``factor`` on
    ``_comm_manager``; experts: ``tokens * probs`` (so the probs get a gradient too). Returns
    ``(rows the experts got, their tokens_per_expert, y, x.grad, probs.grad, the Buffer's
    recv_budget)``."""
    d._comm_manager.moe_expert_rank_capacity_factor = factor
    rmap = torch.zeros(6, 4, dtype=torch.bool)
    probs = torch.zeros(6, 4)
    for t, es in routes.items():
        for e in es:
            rmap[t, e] = True
            probs[t, e] = 0.25 * (t + 1) + 0.125 * e       # exact in fp32 and bf16
    probs.requires_grad_(True)
    x = x.clone().requires_grad_(True)
    seen = {}
    orig = d._get_buffer

    def get_buffer(hidden):
        buf = orig(hidden)
        dispatch = buf.dispatch

        def spy(*a, **k):
            seen["recv_budget"] = k.get("recv_budget")
            return dispatch(*a, **k)

        buf.dispatch = spy
        return buf

    d._get_buffer = get_buffer
    try:
        h, w = d.dispatch_preprocess(x, rmap, probs)
        tokens, p = d.token_dispatch(h, w)
    finally:
        d._get_buffer = orig
        d.buffer.__dict__.pop("dispatch", None)
    tokens, tpe, p = d.dispatch_postprocess(tokens, p)
    out = tokens * p.unsqueeze(-1)
    y = d.combine_postprocess(d.token_combine(d.combine_preprocess(out)))
    y.sum().backward()
    return tokens.shape[0], tpe.tolist(), y.detach(), x.grad, probs.grad, seen["recv_budget"]


@pytest.mark.parametrize("rows_mode", ["exact", "padded"])
def test_budget_hooks_hand_computed(fresh_buffers, rows_mode):
    # T = 6 tokens x top-2: M = int(12 x factor) rows (alignment 1). factor 0.42: M = 5 keeps
    # e0's 3 rows and e1's first 2 (t0, t3), dropping t4 -> e1, t1 -> e2, t3 -> e2, t2 -> e3;
    # factor 1.0: M = 12 > R = 9, nothing dropped, 3 zero rows. EXACT experts get the kept
    # rows only (their output padded back to M for the combine), PADDED experts all M rows.
    from megatron_mok.megatron import budget

    d = _budget_dispatcher(0.42, num_moe_experts=4)
    d.budget_rows = getattr(budget, rows_mode.upper())
    x = (torch.arange(6 * 16, dtype=torch.float32).view(6, 1, 16) + 1) / 64
    probs_of = {(t, e): 0.25 * (t + 1) + 0.125 * e for t, es in _ROUTES.items() for e in es}

    def want(kept):
        w = torch.tensor([sum(probs_of[t, e] for e in _ROUTES.get(t, ()) if (t, e) in kept)
                          for t in range(6)])
        g = torch.zeros(6, 4)
        for t, e in kept:
            g[t, e] = float(x[t].sum())
        return x * w.view(6, 1, 1), w.view(6, 1, 1).expand(6, 1, 16), g

    everything = set(probs_of)
    kept5 = {(0, 0), (1, 0), (2, 0), (0, 1), (3, 1)}
    for factor, M, kept, rows, tpe, flag in (
            (0.42, 5, kept5, 5, [3, 2, 0, 0], True),
            (1.0, 12, everything, 9 if rows_mode == "exact" else 12, [3, 3, 2, 1], True),
    ):
        n, counts, y, gx, gp, asked = _budget_call(d, factor, x)
        assert asked == M and (n, counts) == (rows, tpe), (factor, asked, n, counts)
        wy, wgx, wgp = want(kept)
        assert torch.equal(y, wy) and torch.equal(gx, wgx) and torch.equal(gp, wgp), factor
        # the flag accumulates: still set after the call that dropped nothing; in place, one
        # tensor (a CUDA graph that captured the OR writes there at every replay)
        assert bool(d.check_over_budget().view(-1)[0]) is flag, factor
        if factor == 0.42:
            the_flag = d.check_over_budget()
        assert d.check_over_budget() is the_flag and d._comm_manager.over_budget is the_flag
    d.reset_over_budget()
    assert not bool(d.check_over_budget().view(-1)[0]) and d.check_over_budget() is the_flag
    # the PagedStashRunner's rerun: no factor on _comm_manager, the dropless dispatch (R rows)
    n, counts, y, gx, gp, asked = _budget_call(d, None, x)
    assert asked is None and (n, counts) == (9, [3, 3, 2, 1])
    wy, wgx, wgp = want(everything)
    assert torch.equal(y, wy) and torch.equal(gx, wgx) and torch.equal(gp, wgp)
    assert not bool(d.check_over_budget().view(-1)[0])
    # ... and back (PagedStashRunner restores it from the config): a drop sets the flag again
    _budget_call(d, d.config.moe_expert_rank_capacity_factor, x)
    assert bool(d.check_over_budget().view(-1)[0])


def test_expert_rows_mode():
    # Which experts take the budget's M rows with device counts (PADDED) and which need the
    # kept rows exactly (EXACT): only 0.19's fused TEGroupedMLP (TE op fuser) takes them, unless
    # it pads for FP8 itself; an experts module's own mok_takes_padded_rows wins.
    import types
    from megatron.core.transformer.moe import experts as E
    from megatron_mok.megatron import budget

    def bare(cls, **attrs):
        m = cls.__new__(cls)
        torch.nn.Module.__init__(m)
        for k, v in attrs.items():
            setattr(m, k, v)
        return m

    plain = types.SimpleNamespace(fp8=None, fp4=None, moe_router_padding_for_quantization=False)
    fp8 = types.SimpleNamespace(fp8="hybrid", fp4=None, moe_router_padding_for_quantization=False)
    fp8_padded = types.SimpleNamespace(fp8="hybrid", fp4=None,
                                       moe_router_padding_for_quantization=True)
    cases = [(bare(E.SequentialMLP), plain, budget.EXACT),
             (bare(E.TEGroupedMLP), plain, budget.EXACT),                 # 0.16: no fused impl
             (bare(E.TEGroupedMLP, _with_fused_impl=False), plain, budget.EXACT),
             (bare(E.TEGroupedMLP, _with_fused_impl=True), plain, budget.PADDED),
             (bare(E.TEGroupedMLP, _with_fused_impl=True), fp8, budget.EXACT),
             (bare(E.TEGroupedMLP, _with_fused_impl=True), fp8_padded, budget.PADDED),
             (bare(E.SequentialMLP, mok_takes_padded_rows=True), plain, budget.PADDED),
             (bare(E.TEGroupedMLP, _with_fused_impl=True, mok_takes_padded_rows=False), plain,
              budget.EXACT),
             (torch.nn.Linear(2, 2), plain, budget.EXACT)]                # unknown: exact
    if hasattr(E, "GroupedMLP"):                                          # 0.16's legacy class
        cases.append((bare(E.GroupedMLP), plain, budget.EXACT))
    for experts, cfg, want in cases:
        got = budget.expert_rows_mode(experts, cfg)
        assert got == want, (type(experts).__name__, vars(experts).get("_with_fused_impl"), cfg)


def test_full_iteration_with_the_budget_needs_padded_experts(fresh_buffers):
    # The budget's dispatch reads nothing while captured, but experts that need the kept rows
    # exactly read the row count on the host, and host counts are a copy: with a full-iteration
    # graph and the budget both are refused when the layer is built (configure_for_experts).
    from megatron.core.transformer.moe import experts as E
    from megatron_mok.megatron import budget

    d = _budget_dispatcher(1.5)
    if "cuda_graph_modules" in {f.name for f in dataclasses.fields(d.config.__class__)}:
        d.config.cuda_graph_impl = "full_iteration"                      # 0.18 / 0.19
    else:
        d.config.cuda_graph_impl, d.config.cuda_graph_scope = "local", ["full_iteration"]
    assert versions.cuda_graph_impl(d.config) == "full_iteration"
    assert mm.config_problems(d.config) == []
    exact = E.SequentialMLP.__new__(E.SequentialMLP)
    torch.nn.Module.__init__(exact)
    padded = torch.nn.Module()
    padded.mok_takes_padded_rows = True
    with pytest.raises(mm.MokConfigError, match="SequentialMLP needs the kept rows exactly"):
        d.configure_for_experts(exact)
    d.configure_for_experts(padded)
    assert d.budget_rows == budget.PADDED
    d.options = dataclasses.replace(d.options, tokens_per_expert="host")
    d.tokens_per_expert_on_host = True
    with pytest.raises(mm.MokConfigError, match="MOK_TOKENS_PER_EXPERT=host"):
        d.configure_for_experts(padded)
    # without the graph, or with drop-and-pad (whose rows_per_expert wins), both are fine
    d.config.moe_pad_expert_input_to_capacity, d.config.moe_expert_capacity_factor = True, 1.0
    d.configure_for_experts(exact)
    d.config.moe_pad_expert_input_to_capacity = False
    d.config.cuda_graph_impl = "none"
    d.configure_for_experts(exact)
    assert d.budget_rows == budget.EXACT


def test_max_tokens_per_rank_knob_must_be_positive(monkeypatch):
    # 0 would make a Buffer that takes no token at all: refused when the options are read
    for bad in ("0", "-4"):
        monkeypatch.setenv("MOK_MAX_TOKENS_PER_RANK", bad)
        with pytest.raises(mm.MokConfigError, match="MOK_MAX_TOKENS_PER_RANK must be > 0"):
            mm.MokOptions.from_config(None)
    monkeypatch.setenv("MOK_MAX_TOKENS_PER_RANK", "1")
    assert mm.MokOptions.from_config(None).max_tokens_per_rank == 1


def test_expert_tp_rank_bound_is_inclusive(monkeypatch):
    # The CUDA kernels take up to MAX_RANKS (64) ranks per Buffer: exactly 64 is fine, 66 not.
    import types
    from megatron_mok.cuda.backend import MAX_RANKS
    from megatron_mok.megatron.config import config_problems

    monkeypatch.delenv("MOK_BACKEND", raising=False)
    assert MAX_RANKS == 64

    def problems(ep):
        cfg = types.SimpleNamespace(moe_token_dispatcher_type="mok", num_moe_experts=2 * ep,
                                    expert_tensor_parallel_size=2, tensor_model_parallel_size=2,
                                    expert_model_parallel_size=ep, moe_router_topk=2)
        return [q for q in config_problems(cfg) if "ranks exchange tokens" in q]

    assert problems(32) == []
    assert len(problems(33)) == 1 and "= 66 ranks" in problems(33)[0]


# -------------------------------------------------- the dispatcher's hooks, in one process
def _dispatcher(local_expert_indices=None, **cfg_kw):
    """A ``MokTokenDispatcher`` in this process: no torch.distributed, every group ``None``
    (size 1), the reference backend on CPU tensors; its local experts all of them in order
    unless ``local_expert_indices`` says otherwise."""
    import types
    from megatron_mok.megatron.dispatcher import MokTokenDispatcher

    cfg = _cfg(**cfg_kw)
    pg = types.SimpleNamespace(ep=None, expt_tp=None, tp_ep=None)
    E = cfg.num_moe_experts
    local = list(range(E)) if local_expert_indices is None else local_expert_indices
    return MokTokenDispatcher(E, local, cfg, pg_collection=pg)


@pytest.fixture
def fresh_buffers(monkeypatch):
    from megatron_mok.megatron.dispatcher import reset_buffers

    for name in ("MOK_BACKEND", "MOK_MAX_TOKENS_PER_RANK", "MOK_TOKENS_PER_EXPERT"):
        monkeypatch.delenv(name, raising=False)
    reset_buffers()
    yield
    reset_buffers()


def test_drop_and_pad_hooks_hand_computed(fresh_buffers):
    # 6 tokens, 4 experts, top-2, capacity factor 1: capacity = ceil(6 x 2 / 4) = 3 rows per
    # expert (EP 1). Real routes (prob > 0): t0 -> 0,1; t1 -> 0,2; t2 -> 0,3; t3 -> 1,2;
    # t4 -> 1; t5 -> none. The router pads every expert's column to 3 with prob-0 routes:
    # t5 -> 2, t4 -> 3, t5 -> 3. Those must not be dispatched: expert e's rows are its real
    # routes in token order, then zero rows (prob 0).
    d = _dispatcher(num_moe_experts=4, moe_expert_capacity_factor=1.0,
                    moe_pad_expert_input_to_capacity=True)
    real = {0: (0, 1), 1: (0, 2), 2: (0, 3), 3: (1, 2), 4: (1,)}
    pads = [(5, 2), (4, 3), (5, 3)]
    rmap = torch.zeros(6, 4, dtype=torch.bool)
    probs = torch.zeros(6, 4, dtype=torch.bfloat16)
    for t, es in real.items():
        for e in es:
            rmap[t, e] = True
            probs[t, e] = 0.25 * (t + 1) + 0.125 * e       # exact in bf16
    for t, e in pads:
        rmap[t, e] = True                                   # prob stays 0
    x = (torch.arange(6 * 16, dtype=torch.float32).view(6, 1, 16) + 1)   # [S, B, H]
    h, w = d.dispatch_preprocess(x, rmap, probs)
    assert tuple(h.shape) == (6, 16) and w.dtype == torch.float32
    tokens, p = d.token_dispatch(h, w)
    tokens, tpe, p = d.dispatch_postprocess(tokens, p)
    assert tpe.tolist() == [3, 3, 3, 3], tpe
    assert tpe.dtype == torch.int64 and tpe.device.type == "cpu"
    assert p.dtype == torch.bfloat16, "probs come back in the router's dtype"
    want_rows = {0: [0, 1, 2], 1: [0, 3, 4], 2: [1, 3], 3: [2]}
    x2 = x.view(6, 16)
    for e in range(4):
        for i in range(3):
            r = 3 * e + i
            if i < len(want_rows[e]):
                t = want_rows[e][i]
                assert torch.equal(tokens[r], x2[t]), (e, i)
                assert float(p[r]) == float(probs[t, e]), (e, i)
            else:
                assert not tokens[r].any() and float(p[r]) == 0.0, (e, i, "zero row")
    # identity experts: each token comes back times its number of real routes
    y = d.combine_postprocess(d.token_combine(d.combine_preprocess(tokens)))
    n = torch.tensor([len(real.get(t, ())) for t in range(6)], dtype=torch.float32)
    assert tuple(y.shape) == (6, 1, 16)
    assert torch.equal(y.view(6, 16), x2 * n.view(6, 1))


def test_drop_and_pad_rows_per_expert_hand_computed(fresh_buffers):
    # N = capacity x (ranks of the Buffer), rounded UP to the Buffer's expert_alignment.
    # 61 tokens, top-2, 8 experts, factor 0.5: capacity = ceil(61 x 2 / 8 x 0.5) = 8.
    import types

    d = _dispatcher(moe_expert_capacity_factor=0.5, moe_pad_expert_input_to_capacity=True)
    for world, align, want in ((3, 16, 32), (3, 1, 24), (1, 16, 16), (2, 16, 16), (1, 1, 8)):
        d.buffer = types.SimpleNamespace(world_size=world, expert_alignment=align)
        assert d.rows_per_expert(61) == want, (world, align)


@pytest.mark.parametrize("where", ["auto", "device"])
def test_drop_and_pad_counts_on_the_host_unless_asked(fresh_buffers, where):
    # With drop-and-pad the counts are [N] * E_local, made on the host (no device read), or
    # on the tokens' device with MOK_TOKENS_PER_EXPERT=device; int64 either way. A stand-in
    # Buffer puts the rows on the meta device (a device that is not the host's).
    import types

    cfg = dict(num_moe_experts=4, moe_expert_capacity_factor=1.0,
               moe_pad_expert_input_to_capacity=True)
    d = _dispatcher(**cfg)
    d.options = dataclasses.replace(d.options, tokens_per_expert=where)
    stub = types.SimpleNamespace(world_size=1, expert_alignment=1, calls=[])

    def dispatch(x, ids, w, rows_per_expert=None, recv_budget=None):
        assert recv_budget is None, "drop-and-pad's rows_per_expert, never a budget"
        stub.calls.append(rows_per_expert)
        R = 4 * rows_per_expert
        return types.SimpleNamespace(tokens=torch.empty(R, 16, device="meta"),
                                     probs=torch.empty(R, device="meta"),
                                     tokens_per_expert=None, handle=object())

    stub.dispatch = dispatch
    d._get_buffer = lambda hidden: stub
    rmap = torch.zeros(6, 4, dtype=torch.bool)
    rmap[:, 0] = True
    h, w = d.dispatch_preprocess(torch.ones(6, 16), rmap, rmap.float())
    d.token_dispatch(h, w)
    assert stub.calls == [3]                      # ceil(6 x 2 / 4 x 1.0) x 1 rank
    tpe = d._tokens_per_expert
    assert tpe.dtype == torch.int64 and tuple(tpe.shape) == (4,)
    assert tpe.device.type == ("meta" if where == "device" else "cpu")
    if where == "auto":
        assert tpe.tolist() == [3] * 4            # (a meta tensor has no values to read)


def test_drop_and_pad_without_capacity_factor_is_refused(fresh_buffers):
    # Megatron's own check asks for the factor when the config is built; a config edited
    # after that check is caught by the dispatcher.
    import types
    from megatron_mok.megatron.dispatcher import MokTokenDispatcher

    cfg = _cfg(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True)
    cfg.moe_expert_capacity_factor = None
    pg = types.SimpleNamespace(ep=None, expt_tp=None, tp_ep=None)
    with pytest.raises(mm.MokConfigError, match="without moe_expert_capacity_factor"):
        MokTokenDispatcher(8, list(range(8)), cfg, pg_collection=pg)


def test_flex_num_sms_must_be_positive(fresh_buffers):
    d = _dispatcher()
    assert d.num_sms() == 48                      # LAYER_NUM_SMS: nothing runs beside it
    d.config.moe_flex_dispatcher_num_sms = 20
    assert d.num_sms() == 20
    d.config.moe_flex_dispatcher_num_sms = 0
    with pytest.raises(mm.MokConfigError, match="moe_flex_dispatcher_num_sms must be > 0"):
        d.num_sms()


# ------------------------------------------------------------------ device-error checks
class _ErrorBuffer:
    """A stand-in for a cached ``mok.Buffer`` whose kernels recorded a device error: its
    ``check_errors`` (the CUDA backend's: a sync, then the report) raises."""

    def __init__(self):
        self._destroyed = False
        self.checks = 0

    def check_errors(self):
        from megatron_mok.cuda.errors import MokDeviceError

        self.checks += 1
        raise MokDeviceError("megatron_mok: rank 0: (test) device error")

    def destroy(self):
        self._destroyed = True


@pytest.fixture
def error_buffer(fresh_buffers, monkeypatch):
    from megatron_mok.megatron import dispatcher as D

    monkeypatch.delenv("MOK_CHECK_ERRORS", raising=False)
    buf = _ErrorBuffer()
    D._BUFFERS[("test",)] = buf
    return buf


def test_check_errors_checks_every_cached_buffer(error_buffer):
    from megatron_mok.cuda.errors import MokDeviceError

    with pytest.raises(MokDeviceError, match=r"\(test\) device error"):
        mm.check_errors()
    assert error_buffer.checks == 1
    error_buffer._destroyed = True          # a destroyed Buffer has nothing left to check
    assert mm.check_errors() is True and error_buffer.checks == 1


def test_check_errors_never_syncs_while_a_graph_is_captured(error_buffer, monkeypatch):
    # A host sync inside a CUDA-graph capture would invalidate it: while the current stream
    # captures, the check does nothing (the replay's errors are read after it returns).
    from megatron_mok.cuda.errors import MokDeviceError
    from megatron_mok.megatron import _patch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert mm.check_errors() is False
    _patch.step_check()
    assert error_buffer.checks == 0
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    with pytest.raises(MokDeviceError):
        _patch.step_check()


def test_step_check_mode(error_buffer, monkeypatch):
    from megatron_mok.cuda.errors import MokDeviceError
    from megatron_mok.megatron import _patch

    for mode in ("", "step", "call"):
        monkeypatch.setenv("MOK_CHECK_ERRORS", mode)
        with pytest.raises(MokDeviceError):
            _patch.step_check()
    monkeypatch.setenv("MOK_CHECK_ERRORS", "off")
    _patch.step_check()
    monkeypatch.setenv("MOK_CHECK_ERRORS", "sometimes")
    with pytest.raises(mm.MokConfigError, match="MOK_CHECK_ERRORS must be one of step, call, off"):
        _patch.step_check()
    with pytest.raises(mm.MokConfigError, match="MOK_CHECK_ERRORS"):
        _dispatcher()                       # refused where the layer is built, too


class _StoppableBuffer:
    """A stand-in for a cached ``mok.Buffer`` that records what stops it."""

    def __init__(self, destroyed=False):
        self._destroyed = destroyed
        self.stopped_by = []

    def _abort_after(self, exc):
        self.stopped_by.append(exc)

    def check_errors(self):
        pass

    def destroy(self):
        self._destroyed = True


def test_a_step_that_raises_stops_every_shared_buffer(fresh_buffers, monkeypatch):
    # An error of this rank's own in the forward-backward (an expert out of memory on the rank
    # that got the most tokens) leaves its EP peers waiting for it in a dispatch or combine:
    # the schedule's hook stops every shared Buffer (Buffer.abort) before the error passes on.
    from megatron_mok.megatron import _patch
    from megatron_mok.megatron import dispatcher as D

    monkeypatch.delenv("MOK_CHECK_ERRORS", raising=False)
    live, gone = _StoppableBuffer(), _StoppableBuffer(destroyed=True)
    D._BUFFERS[("a",)], D._BUFFERS[("b",)] = live, gone
    oom = RuntimeError("CUDA out of memory (test)")

    def step(**kwargs):
        raise oom

    with pytest.raises(RuntimeError, match="out of memory"):
        _patch._checked_after(step)(forward_only=False)
    assert live.stopped_by == [oom] and gone.stopped_by == []
    assert _patch._checked_after(lambda: "losses")() == "losses" and live.stopped_by == [oom]


def test_a_step_error_stops_a_real_buffer_of_two_ranks(fresh_buffers, monkeypatch):
    # The same through Buffer._abort_after: a Buffer of a two-rank group is stopped and names
    # the error; one rank alone is not.
    import megatron_mok as mok
    from megatron_mok.megatron import _patch
    from megatron_mok.megatron import dispatcher as D

    monkeypatch.setattr(mok.buffer, "group_rank_size", lambda group: (1, 2))
    two = mok.Buffer(None, num_experts=4, hidden=16, topk=2, max_tokens_per_rank=8, backend="reference")
    monkeypatch.setattr(mok.buffer, "group_rank_size", lambda group: (0, 1))
    one = mok.Buffer(None, num_experts=4, hidden=16, topk=2, max_tokens_per_rank=8, backend="reference")
    D._BUFFERS[("two",)], D._BUFFERS[("one",)] = two, one

    def step():
        raise ValueError("expert failed (test)")

    with pytest.raises(ValueError):
        _patch._checked_after(step)()
    assert two._aborted == "ValueError: expert failed (test)" and one._aborted is None
    # The refused call tells its peers first (reference backend): there are none here (no
    # process group), which is a warning, never in place of the refusal.
    with pytest.warns(UserWarning, match="could not tell its peers"):
        with pytest.raises(RuntimeError, match="stopped on rank 1 after an error .ValueError: expert failed"):
            two.dispatch(torch.zeros(1, 16, dtype=torch.bfloat16), torch.zeros(1, 2, dtype=torch.int64),
                         torch.zeros(1, 2))


def test_runtime_hooks_installed_once_and_undone():
    # install() wraps Megatron's forward-backward schedules and the full-iteration graph's
    # __call__ (the per-step check after them) and destroy_model_parallel (the Buffers reset
    # first), once; uninstall() puts the originals back.
    from megatron.core import parallel_state
    from megatron.core.full_cuda_graph import FullCudaGraphWrapper
    from megatron.core.pipeline_parallel import schedules

    from megatron_mok.megatron import _patch, versions

    def hooked():
        return ([getattr(schedules, n) for n in versions.SCHEDULE_FUNCTIONS]
                + [FullCudaGraphWrapper.__call__, parallel_state.destroy_model_parallel])

    mm.install()
    for fn in hooked():
        assert fn._mok_patched and not getattr(fn.__wrapped__, "_mok_patched", False), fn
    assert schedules.get_forward_backward_func(pp_size=1, vp_size=None)._mok_patched
    assert len(_patch.runtime_hooks()) >= len(hooked())
    mm.uninstall()
    try:
        assert not any(getattr(fn, "_mok_patched", False) for fn in hooked())
        assert _patch.runtime_hooks() == []
    finally:
        mm.install()
    assert all(fn._mok_patched for fn in hooked())


def test_full_iteration_graph_replay_is_checked(error_buffer, monkeypatch):
    # Under Megatron's full-iteration CUDA graph the schedule's Python does not run at a
    # replay (and its check is skipped while captured): the check runs after the wrapper's
    # __call__ instead. A stand-in graph whose replay runs nothing; no warm-up left.
    from megatron.core.full_cuda_graph import FullCudaGraphWrapper

    from megatron_mok.cuda.errors import MokDeviceError

    replays = []
    monkeypatch.setitem(FullCudaGraphWrapper.cuda_graph, "training",
                        type("Graph", (), {"replay": lambda self: replays.append(1)})())
    monkeypatch.setitem(FullCudaGraphWrapper.curr_iteration, "training", 5)
    monkeypatch.setitem(FullCudaGraphWrapper.result, "training", ["losses"])
    wrapper = object.__new__(FullCudaGraphWrapper)      # its __init__ makes a CUDA stream
    wrapper.forward_backward_func = None
    wrapper.cuda_graph_warmup_steps = 1
    kwargs = dict(model=[torch.nn.Linear(1, 1)], data_iterator=None, num_microbatches=1,
                  seq_length=1, forward_only=False)
    with pytest.raises(MokDeviceError, match=r"\(test\) device error"):
        wrapper(**kwargs)
    assert replays == [1] and error_buffer.checks == 1
    monkeypatch.setenv("MOK_CHECK_ERRORS", "off")
    assert wrapper(**kwargs) == ["losses"] and replays == [1, 1]


def _recording_backend(monkeypatch, fail_in):
    """The reference backend, whose ``fail_in`` call records a device error that only
    ``check_errors`` raises (the CUDA backend's contract)."""
    from megatron_mok.backends import reference
    from megatron_mok.cuda.errors import MokDeviceError

    made = []

    class Recording(reference.ReferenceBackend):
        def __init__(self, buf):
            super().__init__(buf)
            self.recorded = None
            made.append(self)

        def combine(self, *args, **kwargs):
            out = super().combine(*args, **kwargs)
            if fail_in == "combine":
                self.recorded = "megatron_mok: rank 0: (test) error in combine"
            return out

        def check_errors(self):
            if self.recorded:
                raise MokDeviceError(self.recorded)

    monkeypatch.setattr(reference, "ReferenceBackend", Recording)
    return made


@pytest.mark.parametrize("mode", ["step", "call"])
def test_check_each_call_names_the_failing_combine(fresh_buffers, monkeypatch, mode):
    # MOK_CHECK_ERRORS=call: the forward combine whose kernel recorded the error raises it
    # itself (a sync per call, for finding the layer); by default the call returns and the
    # per-step check (here called by hand) raises it.
    from megatron_mok.cuda.errors import MokDeviceError

    monkeypatch.setenv("MOK_CHECK_ERRORS", mode)
    made = _recording_backend(monkeypatch, "combine")
    d = _dispatcher()
    rmap = torch.zeros(6, 8, dtype=torch.bool)
    rmap[:, :2] = True
    h, w = d.dispatch_preprocess(torch.ones(6, 1, 16), rmap, rmap.float())
    tokens, p = d.token_dispatch(h, w)
    assert len(made) == 1 and made[0].recorded is None
    if mode == "call":
        with pytest.raises(MokDeviceError, match="error in combine"):
            d.token_combine(tokens)
    else:
        d.token_combine(tokens)
        with pytest.raises(MokDeviceError, match="error in combine"):
            mm.check_errors()


def test_buffer_cache_holds_its_groups(fresh_buffers):
    # The caches key a group by identity and hold it: a group cannot be freed (and its id()
    # taken by a later group, which would then be handed the dead group's Buffer or T_max)
    # while an entry for it exists; reset_buffers() lets it go.
    import gc
    import weakref

    from megatron_mok.megatron import dispatcher as D

    class Group:
        pass

    g = Group()
    ref = weakref.ref(g)
    D._T_MAX[D._GroupKey(g)] = 8
    assert D._GroupKey(g) in D._T_MAX and D._GroupKey(Group()) not in D._T_MAX
    del g
    gc.collect()
    assert ref() is not None
    D.reset_buffers()
    gc.collect()
    assert ref() is None


def test_dispatcher_caches_by_group_key(fresh_buffers):
    # The dispatcher's own entries (T_max, Buffers) are keyed by _GroupKey, which holds the
    # group: an id()-keyed entry would neither keep the group alive nor be found by it.
    from megatron_mok.megatron import dispatcher as D

    d = _dispatcher()
    rmap = torch.zeros(6, 8, dtype=torch.bool)
    rmap[:, :2] = True
    h, w = d.dispatch_preprocess(torch.ones(6, 1, 16), rmap, rmap.float())
    d.token_dispatch(h, w)
    key = D._GroupKey(d.group)
    assert D._T_MAX.get(key) == 6
    assert [k[0] for k in D._BUFFERS] == [key]


def test_drop_and_pad_switched_on_without_a_factor_is_a_clear_error(fresh_buffers):
    # Megatron's inference switches drop-and-pad on a built dispatcher by setting attributes
    # (set_decode_expert_padding); a caller that forgets the factor gets MoK's message, not a
    # TypeError from inside Megatron's get_capacity.
    from megatron_mok.megatron.config import MokConfigError

    d = _dispatcher()
    d.drop_and_pad = True
    rmap = torch.zeros(6, 8, dtype=torch.bool)
    rmap[:, :2] = True
    h, w = d.dispatch_preprocess(torch.ones(6, 1, 16), rmap, rmap.float())
    with pytest.raises(MokConfigError, match="moe_expert_capacity_factor is None"):
        d.token_dispatch(h, w)
    d.moe_expert_capacity_factor = 4.0          # E / topk: nothing dropped
    tokens, _ = d.token_dispatch(h, w)
    assert tokens.shape[0] == 8 * 6             # every local expert gets T x EP rows


def _first_buffer(d):
    rmap = torch.zeros(6, 8, dtype=torch.bool)
    rmap[:, :2] = True
    h, w = d.dispatch_preprocess(torch.ones(6, 1, 16), rmap, rmap.float())
    d.token_dispatch(h, w)
    return d.buffer


def test_buffer_waits_as_long_as_the_ep_group(fresh_buffers, monkeypatch):
    # Without MOK_TIMEOUT_S a late EP peer is waited for as long as the group's own collectives
    # would (Megatron's --distributed-timeout-minutes; alltoall's NCCL all-to-all waits that
    # long), not the Buffer default of 60 s (NOTES item 61); MOK_TIMEOUT_S and the config knob win.
    from megatron_mok.megatron import dispatcher as D

    monkeypatch.delenv("MOK_TIMEOUT_S", raising=False)
    asked = []
    monkeypatch.setattr(D, "group_timeout_seconds", lambda g: asked.append(g) or 600.0)
    assert _first_buffer(_dispatcher()).timeout_s == 600.0 and len(asked) == 1
    D.reset_buffers()
    monkeypatch.setenv("MOK_TIMEOUT_S", "5")
    assert _first_buffer(_dispatcher()).timeout_s == 5.0 and len(asked) == 1
    D.reset_buffers()
    monkeypatch.delenv("MOK_TIMEOUT_S")
    d = _dispatcher()
    d.config.moe_mok_timeout_s = 7
    d.options = type(d.options).from_config(d.config)
    assert _first_buffer(d).timeout_s == 7.0
    D.reset_buffers()
    monkeypatch.setattr(D, "group_timeout_seconds", lambda g: None)   # unreadable: Buffer default
    assert _first_buffer(_dispatcher()).timeout_s is None


# Misuse of the dispatcher's hooks (in-process, CPU; found untested by a coverage run, NOTES
# item 79): each is a clear error, not a wrong answer or a crash further down.

def test_dispatch_preprocess_refuses_a_routing_map_it_cannot_read(fresh_buffers):
    d = _dispatcher()
    x = torch.randn(5, 1, 16)
    probs = torch.rand(5, 8)
    with pytest.raises(ValueError, match=r"routing_map must be a \[T, E\] bool tensor, got \(5, 8\) torch.int64"):
        d.dispatch_preprocess(x, torch.ones(5, 8, dtype=torch.int64), probs)
    with pytest.raises(ValueError, match=r"routing_map must be a \[T, E\] bool tensor, got \(5, 8, 1\)"):
        d.dispatch_preprocess(x, torch.ones(5, 8, 1, dtype=torch.bool), probs)
    with pytest.raises(ValueError, match=r"probs \(5, 7\) must match routing_map \(5, 8\)"):
        d.dispatch_preprocess(x, torch.ones(5, 8, dtype=torch.bool), probs[:, :7])


def test_hooks_called_out_of_order_are_errors(fresh_buffers):
    d = _dispatcher()
    x = torch.randn(5, 1, 16)
    with pytest.raises(RuntimeError, match="token_dispatch needs the top-k ids of these tokens"):
        d.token_dispatch(x.view(5, 16), torch.rand(5, 2))
    with pytest.raises(RuntimeError, match="token_combine called without a preceding token_dispatch"):
        d.token_combine(torch.randn(10, 16))
    rmap = torch.zeros(5, 8, dtype=torch.bool)
    rmap[:, :2] = True
    h, w = d.dispatch_preprocess(x, rmap, rmap.float() * 0.5)
    # the ids kept are those of 5 tokens: 4 tokens are refused too
    with pytest.raises(RuntimeError, match="token_dispatch needs the top-k ids of these tokens"):
        d.token_dispatch(h[:4], w[:4])
    assert d.backend_name is None                      # no Buffer before the first dispatch
    tokens, p = d.token_dispatch(h, w)
    assert d.backend_name == "reference"
    d.token_combine(tokens)
    with pytest.raises(RuntimeError, match="token_combine called without a preceding token_dispatch"):
        d.token_combine(tokens)                        # the handle is used once


def test_local_experts_other_than_the_ep_ranks_block_are_refused():
    with pytest.raises(ValueError, match=r"MoK needs local experts \[0, 1, 2, 3, 4, 5, 6, 7\] on EP rank 0"):
        _dispatcher(local_expert_indices=[1, 2, 3, 4, 5, 6, 7, 0])


def test_a_destroyed_shared_buffer_is_replaced(fresh_buffers):
    d = _dispatcher()
    x = torch.randn(5, 1, 16)
    rmap = torch.zeros(5, 8, dtype=torch.bool)
    rmap[:, 3:5] = True
    h, w = d.dispatch_preprocess(x, rmap, rmap.float() * 0.5)
    tokens, _ = d.token_dispatch(h, w)
    d.token_combine(tokens)
    first = d.buffer
    first.destroy()                                    # behind the cache's back
    h, w = d.dispatch_preprocess(x, rmap, rmap.float() * 0.5)
    tokens, _ = d.token_dispatch(h, w)
    assert d.buffer is not first and not d.buffer._destroyed
    assert torch.equal(d.token_combine(tokens), x.view(5, 16) * 2)


def test_routing_map_to_topk_with_fewer_experts_than_topk():
    from megatron_mok.megatron.dispatcher import routing_map_to_topk

    rmap = torch.tensor([[True, True], [False, True], [False, False]])
    probs = torch.tensor([[0.25, 0.5], [0.0, 0.75], [0.0, 0.0]])
    idx, w = routing_map_to_topk(rmap, probs, topk=4)
    assert idx.tolist() == [[0, 1, -1, -1], [1, -1, -1, -1], [-1, -1, -1, -1]]
    assert w.tolist() == [[0.25, 0.5, 0.0, 0.0], [0.75, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]


def test_extend_literal_covers_the_annotation_forms_a_release_may_use():
    # Both supported releases annotate moe_token_dispatcher_type as a plain Literal; the other
    # forms (inside Optional, a string under `from __future__ import annotations`) are what a
    # later release may write, and must still admit 'mok' (found untested by coverage, item 79).
    import typing
    from typing import Literal, Optional

    from megatron_mok.megatron._patch import _extend_literal

    plain = Literal["allgather", "alltoall", "flex"]
    assert typing.get_args(_extend_literal(plain)) == ("allgather", "alltoall", "flex", "mok")
    already = Literal["alltoall", "mok"]
    assert _extend_literal(already) is already
    opt = _extend_literal(Optional[Literal["alltoall", "flex"]])
    lit, none = typing.get_args(opt)
    assert typing.get_args(lit) == ("alltoall", "flex", "mok") and none is type(None)
    assert _extend_literal("Literal['allgather', 'flex']") == "Literal['allgather', 'flex', 'mok']"
    assert (_extend_literal("Optional[Literal['allgather']]")
            == "Optional[Literal['allgather', 'mok']]")
    assert _extend_literal("Literal['mok', 'flex']") == "Literal['mok', 'flex']"
    assert _extend_literal(str) is str and _extend_literal("str") == "str"

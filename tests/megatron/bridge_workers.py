"""Rank functions for ``test_megatron_bridge.py`` (run by ``harness.run_distributed(...,
fresh=True)``), and the import shims that let Megatron-Bridge 0.3.1 load on a CPU-only machine.

Importing this module changes nothing: the shims are put in place by :func:`cpu_bridge_shims`,
which only the rank functions call, each in processes of its own that end after the call
(``fresh=True``). They replace modules in ``sys.modules`` and Bridge's recipe loader, so they
must never reach the pytest process where the other tests run.

What the shims are for (Bridge 0.3.1 on megatron-core 0.16.1, torch CPU, no TransformerEngine,
no Triton; installed by ``scripts/setup.sh`` with ``--no-deps``):

1. ``megatron.bridge.peft.lora_layers`` and ``megatron.bridge.peft.lora`` subclass
   TransformerEngine's ``Linear`` classes at import time, and Bridge's model providers import
   them (PEFT hooks). Without TE both would fail to import; they become placeholders whose
   every attribute is a class that raises when constructed (no test uses LoRA).
2. ``megatron.core.inference.contexts.attention_context.triton.tensor_ops`` (megatron-core
   0.16.1) does a bare ``import triton``; Bridge's ``models/__init__`` imports the Mamba
   provider, whose ``mamba_mixer`` imports it. Inference-only kernels: a placeholder too.
3. ``megatron.bridge.recipes/__init__`` imports every recipe, the vision-language ones among
   them, which need ``megatron.energon``, ``qwen_vl_utils`` and more. The package is registered
   without running its ``__init__``, so single recipe modules import as usual.
4. A stand-in ``datasets`` module (only when Hugging Face ``datasets`` is not installed):
   ``megatron.bridge.training.config`` imports Bridge's fine-tuning data builders, which import
   ``datasets`` at module level (its install adds ~30 s and ~300 MB to CI). Nothing here builds
   a Hugging Face dataset; a call would raise.

Each placeholder is only put in where the real module cannot import (TE / Triton /
``datasets`` present: left alone).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.machinery
import importlib.util
import os
import sys
import types
import warnings

import torch

# (module, what it needs): placeholders for shims 1 and 2 of the module docstring.
_TE_OR_TRITON_MODULES = (
    ("megatron.bridge.peft.lora_layers", "transformer_engine"),
    ("megatron.bridge.peft.lora", "transformer_engine"),
    ("megatron.core.inference.contexts.attention_context.triton.tensor_ops", "triton"),
)


def _placeholder_module(name: str, needs: str) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__file__ = f"<placeholder for {name}: {needs} is not installed>"
    made = {}

    def __getattr__(attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        if attr not in made:
            def _unavailable(*a, **k):
                raise RuntimeError(f"{name}.{attr} is a CPU-test placeholder: {needs} is "
                                   f"not installed")
            # A class, since Bridge subclasses and isinstance-checks these names; constructing
            # it (or calling it as a function) raises.
            made[attr] = type(attr, (), {"__new__": _unavailable, "__module__": name})
        return made[attr]

    mod.__getattr__ = __getattr__
    return mod


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def cpu_bridge_shims() -> None:
    """Shims 1-4 of the module docstring. Idempotent. Call before importing ``megatron.bridge``
    (only in a process of its own)."""
    for name, needs in _TE_OR_TRITON_MODULES:
        if not _installed(needs):
            sys.modules.setdefault(name, _placeholder_module(name, needs))
    # 3. The recipes package, without its __init__.
    recipes = "megatron.bridge.recipes"
    if recipes not in sys.modules:
        spec = importlib.util.find_spec(recipes)
        pkg = types.ModuleType(recipes)
        pkg.__path__ = list(spec.submodule_search_locations)
        pkg.__spec__, pkg.__file__ = spec, spec.origin
        sys.modules[recipes] = pkg
    # 4. Hugging Face datasets.
    if not _installed("datasets") and "datasets" not in sys.modules:
        ds = types.ModuleType("datasets")
        ds.__spec__ = importlib.machinery.ModuleSpec("datasets", None)

        class _NotInstalled:
            def __init__(self, *a, **k):
                raise RuntimeError("Hugging Face datasets is not installed (CPU-test stand-in)")

        for n in ("Dataset", "DatasetDict", "IterableDataset", "load_dataset",
                  "concatenate_datasets"):
            setattr(ds, n, _NotInstalled)
        ds.builder = types.SimpleNamespace()
        sys.modules["datasets"] = ds


def _prepare(install: bool):
    """Shims, then ``install()`` (or ``uninstall()``: a fresh process has nothing installed,
    but the control must not depend on that), then the project's CPU-run patches."""
    warnings.filterwarnings("ignore")
    # Nothing here may reach the Hugging Face Hub (CI reaches only package registries): a
    # stray lookup fails at once instead of retrying over the network.
    os.environ["HF_HUB_OFFLINE"] = os.environ["TRANSFORMERS_OFFLINE"] = "1"
    os.environ.pop("MOK_BACKEND", None)
    os.environ.pop("MOK_MAX_TOKENS_PER_RANK", None)
    cpu_bridge_shims()
    import megatron_mok.megatron as mm
    from megatron_mok.megatron import harness

    if install:
        mm.install()
    else:
        mm.uninstall()
    harness.enable_cpu_megatron(on_cpu=True)
    return mm, harness


# ------------------------------------------------------------------- Bridge's Qwen3-MoE model
SEQ, BATCH, VOCAB = 16, 2, 128


def _cpu_layer_spec(config):
    """Bridge's own non-TE layer spec (``gpt_provider.local_layer_spec``) with the router
    swapped for the project's CPU ``TopKRouter`` subclass (Megatron's moves its gate to
    ``torch.cuda.current_device()``)."""
    from megatron.bridge.models.gpt_provider import local_layer_spec
    from megatron_mok.megatron import harness

    spec = local_layer_spec(config)
    mlp = spec.submodules.mlp
    mlp.submodules = dataclasses.replace(mlp.submodules, router=harness.cpu_router_class())
    return spec


def qwen3_moe_provider(dispatcher: str, ep_size: int):
    """Bridge's ``Qwen3MoEModelProvider`` shrunk to 2 layers x 8 experts (top-2), fp32, with
    the CPU settings: no fusions, local layer spec, learned positions (Megatron's RoPE puts its
    frequencies on ``torch.cuda.current_device()``). Everything else is Qwen3-MoE's
    (qk-layernorm, RMSNorm, SwiGLU, no biases, aux-loss routing)."""
    from megatron.bridge.models.qwen import Qwen3MoEModelProvider

    return Qwen3MoEModelProvider(
        num_layers=2, hidden_size=64, ffn_hidden_size=128, moe_ffn_hidden_size=32,
        num_attention_heads=4, num_query_groups=2, kv_channels=16,
        num_moe_experts=8, moe_router_topk=2, vocab_size=VOCAB, seq_length=SEQ,
        max_position_embeddings=SEQ, make_vocab_size_divisible_by=VOCAB,
        expert_model_parallel_size=ep_size, expert_tensor_parallel_size=1,
        moe_token_dispatcher_type=dispatcher,
        bf16=False, params_dtype=torch.float32, autocast_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        use_cpu_initialization=True, perform_initialization=True,
        moe_grouped_gemm=False, moe_permute_fusion=False, moe_router_fusion=False,
        gradient_accumulation_fusion=False, apply_rope_fusion=False, masked_softmax_fusion=False,
        bias_activation_fusion=False, bias_dropout_fusion=False, persist_layer_norm=False,
        cross_entropy_loss_fusion=False,
        transformer_layer_spec=_cpu_layer_spec,
        position_embedding_type="learned_absolute",
    )


def _train_step(dispatcher: str, ep_size: int, rank: int) -> dict:
    """Build the model through Bridge's provider (``finalize``, ``initialize_model_parallel``,
    ``provide_distributed_model``), run one forward + backward on a seeded batch (a different
    one per rank), tear the parallel state down. Returns the MoE layers' dispatcher classes,
    the loss and every parameter gradient."""
    from megatron.core import parallel_state
    from megatron_mok.megatron import harness

    provider = qwen3_moe_provider(dispatcher, ep_size)
    provider.finalize()                          # Bridge's deferred TransformerConfig.__post_init__
    provider.initialize_model_parallel(seed=None)      # torch.distributed is up (gloo)
    try:
        torch.manual_seed(1234)
        model = provider.provide_distributed_model(wrap_with_ddp=False,
                                                   use_cpu_initialization=True,
                                                   mixed_precision_wrapper=None)[0]
        moe_layers = [m for m in model.modules() if hasattr(m, "token_dispatcher")]
        g = torch.Generator().manual_seed(100 + rank)
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        pos = torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ)
        mask = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), diagonal=1)
        loss = model(tokens, pos, mask, labels=labels).float().mean()
        loss.backward()
        return dict(
            dispatchers=[type(m.token_dispatcher).__name__ for m in moe_layers],
            local_experts=[len(m.experts.local_experts) for m in moe_layers],
            ep_group_size=parallel_state.get_expert_model_parallel_world_size(),
            loss=loss.detach(),
            grads={n: p.grad.detach().clone() for n, p in model.named_parameters()
                   if p.grad is not None},
            params=sum(1 for _ in model.parameters()),
        )
    finally:
        harness.destroy_parallel()


def qwen3_moe_mok_and_alltoall(rank, world, ep_size):
    """With ``install()``: the same Qwen3-MoE build and step with ``mok``, then ``alltoall``."""
    _prepare(install=True)
    return {d: _train_step(d, ep_size, rank) for d in ("mok", "alltoall")}


# ----------------------------------------------------------------------- recipes and configs
def _olmoe_cfg(dispatcher: str | None, *, ep_overlap: bool = False):
    """Bridge's OLMoE-7B pretrain recipe (its provider is built offline, no Hugging Face
    download), ``moe_token_dispatcher_type`` set after the recipe returns (as the docs say),
    shrunk for a world-size-1 CPU process. ``ep_overlap``: plus Bridge's
    ``CommOverlapConfig(overlap_moe_expert_parallel_comm=True)`` at EP 2 (Bridge checks EP > 1
    on the model config; nothing is built), bf16 (the recipe's mixed precision)."""
    from megatron.bridge.recipes.olmoe.olmoe_7b import olmoe_7b_pretrain_config
    from megatron.bridge.training.comm_overlap import CommOverlapConfig

    cfg = olmoe_7b_pretrain_config()
    if dispatcher is not None:
        cfg.model.moe_token_dispatcher_type = dispatcher
    _shrink(cfg)
    if ep_overlap:
        cfg.comm_overlap = CommOverlapConfig(tp_comm_overlap=False,
                                             overlap_moe_expert_parallel_comm=True)
        cfg.model.expert_model_parallel_size = 2
        cfg.model.recompute_granularity = None
        cfg.model.recompute_method = None
        cfg.model.recompute_num_layers = None
        cfg.model.moe_shared_expert_overlap = False
    return cfg


def _shrink(cfg) -> None:
    m = cfg.model
    m.num_layers, m.hidden_size, m.ffn_hidden_size, m.moe_ffn_hidden_size = 2, 64, 128, 32
    m.num_attention_heads, m.num_query_groups, m.kv_channels = 4, 4, 16
    m.num_moe_experts, m.moe_router_topk, m.vocab_size, m.seq_length = 8, 2, VOCAB, SEQ
    m.tensor_model_parallel_size = m.pipeline_model_parallel_size = 1
    m.virtual_pipeline_model_parallel_size = None
    m.context_parallel_size = 1
    m.sequence_parallel = False
    m.expert_model_parallel_size = 1
    m.expert_tensor_parallel_size = 1
    m.pipeline_model_parallel_layout = None
    m.transformer_impl = "local"
    m.moe_grouped_gemm = False
    m.moe_permute_fusion = False
    m.cross_entropy_loss_fusion = False
    m.mtp_num_layers = None
    cfg.optimizer.use_precision_aware_optimizer = False    # needs TransformerEngine's FusedAdam
    cfg.optimizer.main_grads_dtype = torch.float32
    cfg.optimizer.exp_avg_dtype = cfg.optimizer.exp_avg_sq_dtype = torch.float32
    cfg.dataset.seq_length = SEQ
    cfg.tokenizer.vocab_size = VOCAB
    cfg.train.global_batch_size, cfg.train.micro_batch_size = 2, 1


def _outcome(fn) -> dict:
    """``{"ok": True, "value": fn()}``, or ``{"ok": False, ...}`` with the type and text of
    the exception ``fn`` raised."""
    try:
        return dict(ok=True, value=fn())
    except Exception as e:      # noqa: BLE001 - reported to the test
        return dict(ok=False, error_type=type(e).__name__, error=str(e)[:2000])


def _update(cfg) -> dict:
    """Bridge's ``runtime_config_update`` (mixed precision, comm-overlap setup, then
    ``cfg.validate()``, which finalizes the model provider: TransformerConfig.__post_init__)."""
    from megatron.bridge.training.config import runtime_config_update

    runtime_config_update(cfg)
    return dict(dispatcher=cfg.model.moe_token_dispatcher_type,
                overlap_moe_expert_parallel_comm=cfg.model.overlap_moe_expert_parallel_comm,
                bf16=cfg.model.bf16)


@contextlib.contextmanager
def _gpu_properties(major: int, name: str):
    """``torch.cuda.get_device_properties`` answering like a GPU of compute capability
    ``major`` (Bridge's ``apply_flex_dispatcher_backend`` reads it to decide; nothing else is
    faked). In this process only, undone on exit."""
    orig = torch.cuda.get_device_properties
    torch.cuda.get_device_properties = lambda *a, **k: types.SimpleNamespace(
        major=major, minor=0, name=name)
    try:
        yield
    finally:
        torch.cuda.get_device_properties = orig


@contextlib.contextmanager
def _local_hf_config():
    """Bridge's ``AutoBridge.from_hf_pretrained`` (which the Qwen3-MoE recipes call with a
    Hugging Face repo id: a download) answering with a small local ``Qwen3MoeConfig``."""
    from megatron.bridge import AutoBridge
    from transformers import Qwen3MoeConfig

    small = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                           moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=16, num_experts=8,
                           num_experts_per_tok=2, max_position_embeddings=64,
                           architectures=["Qwen3MoeForCausalLM"], torch_dtype="float32")
    orig = AutoBridge.__dict__["from_hf_pretrained"]
    AutoBridge.from_hf_pretrained = classmethod(lambda cls, path, **kw: cls.from_hf_config(small))
    try:
        yield
    finally:
        AutoBridge.from_hf_pretrained = orig


def _recipe_order() -> dict:
    """Bridge's Qwen3-30B-A3B recipe ends with ``apply_flex_dispatcher_backend(cfg.model,
    "deepep")``. Run it as on a Hopper GPU and as on a Volta one, and see what a ``mok`` set
    before that call, after the recipe, and as a Hydra command-line override becomes."""
    from megatron.bridge.recipes.qwen.qwen3_moe import qwen3_30b_a3b_pretrain_config
    from megatron.bridge.training.flex_dispatcher_backend import apply_flex_dispatcher_backend
    from megatron.bridge.training.utils.omegaconf_utils import process_config_with_overrides

    out = {}
    with _local_hf_config():
        with _gpu_properties(9, "NVIDIA H100 80GB HBM3"):
            cfg = qwen3_30b_a3b_pretrain_config()
            out["hopper_recipe"] = (cfg.model.moe_token_dispatcher_type,
                                    cfg.model.moe_flex_dispatcher_backend)
            # "mok" set before the call (as inside a recipe, or a recipe wrapper setting it
            # first): the call overwrites it, and turns the shared-expert overlap off.
            cfg.model.moe_token_dispatcher_type = "mok"
            cfg.model.moe_shared_expert_overlap = True
            apply_flex_dispatcher_backend(cfg.model, cfg.model.moe_flex_dispatcher_backend)
            out["mok_then_apply"] = (cfg.model.moe_token_dispatcher_type,
                                     cfg.model.moe_shared_expert_overlap)
            # "mok" set after the recipe returned: nothing calls it again.
            cfg = qwen3_30b_a3b_pretrain_config()
            cfg.model.moe_token_dispatcher_type = "mok"
            _shrink(cfg)
            out["mok_after_recipe"] = _outcome(lambda: _update(cfg))
            # The command-line override (run_recipe.py: `model.moe_token_dispatcher_type=mok`),
            # which Bridge applies to the config the recipe returned.
            cfg = qwen3_30b_a3b_pretrain_config()
            process_config_with_overrides(
                cfg, cli_overrides=["model.moe_token_dispatcher_type=mok"])
            _shrink(cfg)
            out["mok_cli_override"] = _outcome(lambda: _update(cfg))
        with _gpu_properties(7, "Tesla V100-SXM2-32GB"):
            cfg = qwen3_30b_a3b_pretrain_config()
            out["volta_recipe"] = (cfg.model.moe_token_dispatcher_type,
                                   cfg.model.moe_flex_dispatcher_backend)
    return out


def _mok_deepep():
    """A ``mok`` config that the project's own checks reject (``MokConfigError``) and that
    Megatron rejects otherwise (DeepEP is a ``flex`` backend)."""
    cfg = _olmoe_cfg("mok")
    cfg.model.moe_enable_deepep = True
    return _update(cfg)


def _comm_overlap_patched() -> bool:
    cls = sys.modules["megatron.bridge.training.comm_overlap"].CommOverlapConfig
    return bool(getattr(cls._get_model_comm_overlap_cfgs, "_mok_patched", False))


def bridge_configs_installed(rank, world):
    """Bridge's config path at world size 1 (no model is built), with ``install()`` called
    before anything imports Bridge (the docs' order: the comm-overlap patch goes in through
    the import finder)."""
    _prepare(install=True)
    import megatron_mok.megatron as mm

    report = dict(
        olmoe_mok=_outcome(lambda: _update(_olmoe_cfg("mok"))),
        olmoe_mok_ep_overlap=_outcome(lambda: _update(_olmoe_cfg("mok", ep_overlap=True))),
        olmoe_alltoall_ep_overlap=_outcome(
            lambda: _update(_olmoe_cfg("alltoall", ep_overlap=True))),
        olmoe_mok_deepep=_outcome(_mok_deepep),
        recipe_order=_outcome(_recipe_order),
    )
    report.update(installed=mm.is_installed(), comm_overlap_patched=_comm_overlap_patched())
    return report


def without_then_with_install(rank, world):
    """World size 1, one process. First with nothing installed (``uninstall()`` first): the
    ``mok`` Qwen3-MoE build, the OLMoE ``mok`` config with the EP overlap, and a ``mok`` config
    the project's checks reject. Then ``install()`` (Bridge's comm-overlap module is imported
    by now: patched in place) and the same again, plus ``alltoall``'s build for comparison."""
    mm, _ = _prepare(install=False)
    before = dict(installed=mm.is_installed())

    def _build_mok():
        return _train_step("mok", 1, rank)

    before["build_mok"] = _outcome(_build_mok)
    before["olmoe_mok_ep_overlap"] = _outcome(lambda: _update(_olmoe_cfg("mok", ep_overlap=True)))
    before["olmoe_mok_deepep"] = _outcome(_mok_deepep)
    before["comm_overlap_patched"] = _comm_overlap_patched()

    mm.install()
    after = dict(installed=mm.is_installed(), comm_overlap_patched=_comm_overlap_patched())
    after["olmoe_mok_ep_overlap"] = _outcome(lambda: _update(_olmoe_cfg("mok", ep_overlap=True)))
    after["steps"] = _outcome(lambda: {d: _train_step(d, 1, rank) for d in ("mok", "alltoall")})
    return dict(before=before, after=after)

"""What :func:`megatron_mok.megatron.install` changes in the running megatron-core.

Seven narrow, reversible changes, all on class or module attributes (no file is edited):

1. ``TransformerConfig.moe_token_dispatcher_type``'s field type becomes
   ``Literal['allgather', 'alltoall', 'flex', 'mok']``. Megatron-LM (0.16 - 0.19) derives
   ``--moe-token-dispatcher-type``'s choices from that annotation when it builds its argument
   parser (``ArgumentGroupFactory``), so ``mok`` becomes a valid command-line choice.
2. ``TransformerConfig.__post_init__`` runs :func:`~megatron_mok.megatron.config.check_config`
   first: unsupported combinations fail at config time with what to change. A ``mok`` config
   with ``moe_shared_expert_overlap`` is then validated as ``alltoall``'s (Megatron allows the
   overlap for its own two dispatchers only).
3. ``MoELayer.__init__`` builds the layer as for ``allgather`` (a dispatcher with no
   communication and no CUDA state in its constructor), then puts a ``MokTokenDispatcher`` in
   its place (handing it the shared experts when they overlap with the dispatch). Everything
   else in the layer (router, experts, shared experts) is Megatron's.
4. Megatron's ``should_free_input`` (the 1F1B EP overlap's rule for which schedule nodes free
   their inputs after the forward; ``models/common/utils.py`` in 0.19,
   ``models/gpt/fine_grained_callables.py`` in 0.16) keeps the inputs of a ``mok`` layer's
   ``moe_dispatch`` and ``mlp`` nodes. Megatron frees them for its ``alltoall``, whose
   preprocess and postprocess permute into new tensors; MoK's dispatch input is a view of the
   pre-MLP layernorm's output, which the router's gate (unless it computes in fp32) and a
   non-overlapped shared expert keep for their backward, and its dispatched rows go to the
   experts as they are, which keep them for theirs. Freeing either would
   corrupt the backward. (A ``mok`` config with ``overlap_moe_expert_parallel_comm`` is also
   validated as ``alltoall``'s, like ``moe_shared_expert_overlap``.)
5. Megatron-Bridge, when it is (or later gets) imported: its ``CommOverlapConfig`` validates a
   ``mok`` model config that asks for ``overlap_moe_expert_parallel_comm`` as ``alltoall``'s.
   Bridge (0.3) asserts the dispatcher is ``alltoall`` or ``flex`` there, in
   ``training/comm_overlap.py``, before the model config's own ``__post_init__`` (item 2) runs.
   Bridge is not imported by :func:`install`: a finder on ``sys.meta_path`` patches
   ``megatron.bridge.training.comm_overlap`` when something imports it (and the module itself
   at once when it is already imported), so Megatron-LM users pay nothing for it.
6. The per-step device-error check: Megatron's forward-backward schedules (the functions
   ``get_forward_backward_func()`` returns) and the full-iteration CUDA-graph wrapper's
   ``__call__`` run :func:`megatron_mok.megatron.dispatcher.check_errors` after they return,
   i.e. after every micro-batch's backward and the gradient reduction, before the optimizer
   step (``MOK_CHECK_ERRORS=off`` skips it). The CUDA backend reads its device error report
   on the host only in an eager dispatch, so without this a combine's or a backward's error
   would surface at the next step's first dispatch, after the optimizer step had consumed the
   step's gradients, and under CUDA graphs (drop-and-pad's capturable dispatch) never. The
   check synchronises the device once per step (Megatron's step synchronises anyway for its
   loss and gradient-norm checks) and is skipped while a graph is being captured; the
   full-iteration wrapper's replay is checked after it returns. When they raise instead (an
   expert out of memory on one rank, in the forward or the backward), the shared Buffers are
   stopped first (``Buffer.abort``), so EP peers waiting for this rank raise at once.
7. ``parallel_state.destroy_model_parallel`` first destroys the shared Buffers
   (:func:`~megatron_mok.megatron.dispatcher.reset_buffers`): they are bound to the groups it
   drops, and each holds CUDA peer memory.
Items 6 and 7 ("runtime hooks") are also made by the first ``MokTokenDispatcher`` built
without :func:`install` (a patched Megatron-LM tree), and also replace the original functions
in already-imported ``megatron`` modules that imported them by name (Megatron-LM's
``training.py`` imports ``destroy_model_parallel`` so).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.abc
import sys
import threading
import typing
import warnings
from typing import Literal

from . import versions
from .config import DISPATCHER_NAME, MokConfigError, check_config, error_check_mode

_STATE = {"installed": False, "saved": {}}
_TLS = threading.local()


def _config_classes():
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig


def _extend_literal(tp):
    """``Literal[a, b]`` -> ``Literal[a, b, 'mok']`` (also inside ``Optional``)."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        args = typing.get_args(tp)
        if DISPATCHER_NAME in args:
            return tp
        return Literal[args + (DISPATCHER_NAME,)]
    if origin is typing.Union:
        return typing.Union[tuple(_extend_literal(a) for a in typing.get_args(tp))]
    if isinstance(tp, str) and "Literal[" in tp and DISPATCHER_NAME not in tp:
        return tp.replace("]", f", '{DISPATCHER_NAME}']", 1)
    return tp


@contextlib.contextmanager
def _as_dispatcher(config, name: str):
    """Let Megatron's code take its ``name`` branch for a ``mok`` config, then restore it."""
    config.moe_token_dispatcher_type = name
    try:
        yield
    finally:
        config.moe_token_dispatcher_type = DISPATCHER_NAME


def _patch_config(saved):
    TransformerConfig = _config_classes()
    field = TransformerConfig.__dataclass_fields__["moe_token_dispatcher_type"]
    saved["field_type"] = field.type
    saved["annotation"] = TransformerConfig.__annotations__.get("moe_token_dispatcher_type")
    # NOTE: subclasses (MLATransformerConfig, Bridge's providers) share this Field object,
    # so one assignment reaches all of them.
    field.type = _extend_literal(field.type)
    if saved["annotation"] is not None:
        TransformerConfig.__annotations__["moe_token_dispatcher_type"] = field.type

    orig_post_init = TransformerConfig.__post_init__
    saved["post_init"] = orig_post_init

    def __post_init__(self, *args, **kwargs):
        check_config(self)
        is_mok = getattr(self, "moe_token_dispatcher_type", None) == DISPATCHER_NAME
        ep_overlap = getattr(self, "overlap_moe_expert_parallel_comm", False)
        if is_mok and ep_overlap and not saved.get("free_input"):
            why = saved.get("free_input_error") or ("this megatron-core has no should_free_input "
                                                    "where megatron_mok looks for it")
            raise MokConfigError(
                "overlap_moe_expert_parallel_comm with moe_token_dispatcher_type='mok' needs "
                f"Megatron's should_free_input wrapped by install() ({why}): unset "
                "overlap_moe_expert_parallel_comm")
        if is_mok and (ep_overlap or getattr(self, "moe_shared_expert_overlap", False)):
            # Megatron accepts moe_shared_expert_overlap and overlap_moe_expert_parallel_comm for
            # its alltoall and flex dispatchers only. MoK drives the same SharedExpertMLP
            # overlap hooks (dispatcher.py) and the same dispatch / combine stages as alltoall
            # under the 1F1B overlap, so the config is validated as alltoall's (which keeps
            # Megatron's own checks of both, e.g. against recomputation).
            with _as_dispatcher(self, "alltoall"):
                return orig_post_init(self, *args, **kwargs)
        return orig_post_init(self, *args, **kwargs)

    __post_init__.__wrapped__ = orig_post_init
    __post_init__._mok_patched = True
    TransformerConfig.__post_init__ = __post_init__


def _patch_moe_layer(saved):
    from megatron.core.transformer.moe import moe_layer as moe_layer_mod

    from .dispatcher import MokTokenDispatcher

    MoELayer = moe_layer_mod.MoELayer
    orig_init = MoELayer.__init__
    saved["moe_layer_init"] = orig_init

    def __init__(self, config, *args, **kwargs):
        if getattr(config, "moe_token_dispatcher_type", None) != DISPATCHER_NAME:
            return orig_init(self, config, *args, **kwargs)
        check_config(config)
        with _as_dispatcher(config, "allgather"):
            orig_init(self, config, *args, **kwargs)
        placeholder = self.token_dispatcher
        self.token_dispatcher = MokTokenDispatcher(
            self.num_local_experts, self.local_expert_indices, config=config,
            pg_collection=_pg_collection_of(placeholder))
        self.token_dispatcher.configure_for_experts(self.experts)
        # moe_shared_expert_overlap: Megatron gave the shared experts to the placeholder.
        if getattr(placeholder, "shared_experts", None) is not None:
            self.token_dispatcher.set_shared_experts(placeholder.shared_experts)
        # 0.19 inference-optimized layers keep the training dispatcher aside.
        if getattr(self, "_training_token_dispatcher", None) is placeholder:
            self._training_token_dispatcher = self.token_dispatcher

    __init__.__wrapped__ = orig_init
    __init__._mok_patched = True
    MoELayer.__init__ = __init__


# Where Megatron defines should_free_input (0.19, 0.16); the first that has it is patched.
_FREE_INPUT_MODULES = ("megatron.core.models.common.utils",
                       "megatron.core.models.gpt.fine_grained_callables")
_KEPT_NODES = ("moe_dispatch", "mlp")


def _patch_free_input(saved):
    """Item 4 of the module docstring. Leaves ``saved["free_input"]`` empty when no module has
    ``should_free_input`` (the config check then refuses the overlap for ``mok``)."""
    saved["free_input"] = []
    saved["free_input_error"] = None
    for name in _FREE_INPUT_MODULES:
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError:
            continue
        except Exception as e:  # noqa: BLE001  (an optional feature must not break install())
            saved["free_input_error"] = f"importing {name} failed: {type(e).__name__}: {e}"
            continue
        orig = getattr(mod, "should_free_input", None)
        if orig is None:
            continue

        def should_free_input(node_name, is_moe, config, *args, _orig=orig, **kwargs):
            if (node_name in _KEPT_NODES
                    and getattr(config, "moe_token_dispatcher_type", None) == DISPATCHER_NAME):
                return False
            return _orig(node_name, is_moe, config, *args, **kwargs)

        should_free_input.__wrapped__ = orig
        should_free_input._mok_patched = True
        mod.should_free_input = should_free_input
        saved["free_input"].append((mod, orig))
        return


def free_input_module():
    """The megatron-core module whose ``should_free_input`` :func:`install` wrapped (``None``:
    not installed, or no module has it)."""
    entries = _STATE["saved"].get("free_input") or []
    return entries[0][0] if entries else None


def _restore_free_input(saved):
    for mod, orig in saved.get("free_input", []):
        mod.should_free_input = orig


def _pg_collection_of(dispatcher):
    """The ProcessGroupCollection the placeholder dispatcher was built with."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    return ProcessGroupCollection(ep=dispatcher.ep_group, expt_tp=dispatcher.tp_group,
                                  tp_ep=dispatcher.tp_ep_group)


# Item 5 of the module docstring: Megatron-Bridge's comm-overlap validation.
BRIDGE_COMM_OVERLAP_MODULE = "megatron.bridge.training.comm_overlap"


def _patch_bridge_comm_overlap(mod, saved) -> None:
    """Wrap ``CommOverlapConfig._get_model_comm_overlap_cfgs`` of Bridge's module ``mod``: a
    ``mok`` model config asking for ``overlap_moe_expert_parallel_comm`` goes through it as
    ``alltoall``'s (all of Bridge's other checks of the overlap still apply). A Bridge without
    that method is left as it is."""
    cls = getattr(mod, "CommOverlapConfig", None)
    orig = getattr(cls, "_get_model_comm_overlap_cfgs", None) if cls is not None else None
    if orig is None or getattr(orig, "_mok_patched", False):
        return

    def _get_model_comm_overlap_cfgs(self, model_cfg, *args, **kwargs):
        user = getattr(self, "user_comm_overlap_cfg", None)
        if (getattr(model_cfg, "moe_token_dispatcher_type", None) == DISPATCHER_NAME
                and getattr(user, "overlap_moe_expert_parallel_comm", None) is True):
            with _as_dispatcher(model_cfg, "alltoall"):
                return orig(self, model_cfg, *args, **kwargs)
        return orig(self, model_cfg, *args, **kwargs)

    _get_model_comm_overlap_cfgs.__wrapped__ = orig
    _get_model_comm_overlap_cfgs._mok_patched = True
    cls._get_model_comm_overlap_cfgs = _get_model_comm_overlap_cfgs
    saved.setdefault("bridge_comm_overlap", []).append((cls, orig))


class _PatchingLoader(importlib.abc.Loader):
    """Runs a module's own loader, then patches the module (item 5)."""

    def __init__(self, loader, saved):
        self._loader, self._saved = loader, saved

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        _patch_bridge_comm_overlap(module, self._saved)

    def __getattr__(self, name):   # get_source, get_resource_reader, ...: the module's own loader
        return getattr(self._loader, name)


class _BridgeFinder(importlib.abc.MetaPathFinder):
    """Finds ``megatron.bridge.training.comm_overlap`` with the other finders and hands back its
    spec with a loader that patches the module once it has run."""

    def __init__(self, saved):
        self._saved = saved

    def find_spec(self, fullname, path, target=None):
        if fullname != BRIDGE_COMM_OVERLAP_MODULE:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _PatchingLoader(spec.loader, self._saved)
                return spec
        return None


def _patch_bridge(saved) -> None:
    mod = sys.modules.get(BRIDGE_COMM_OVERLAP_MODULE)
    if mod is not None:
        _patch_bridge_comm_overlap(mod, saved)
    finder = _BridgeFinder(saved)
    sys.meta_path.insert(0, finder)
    saved["bridge_finder"] = finder


def _restore_bridge(saved):
    finder = saved.get("bridge_finder")
    if finder is not None and finder in sys.meta_path:
        sys.meta_path.remove(finder)
    for cls, orig in saved.get("bridge_comm_overlap", []):
        cls._get_model_comm_overlap_cfgs = orig


# ----------------------------------------------------------- items 6 and 7: runtime hooks
_HOOKS = {"installed": False, "saved": {}}
_HOOKS_LOCK = threading.RLock()
_DISPATCHER_MODULE = __name__.rsplit(".", 1)[0] + ".dispatcher"


def step_check() -> None:
    """Item 6: the per-step check, unless ``MOK_CHECK_ERRORS=off``. Nothing to check before
    the dispatcher module has made a Buffer (it is imported with the first MoK layer)."""
    if error_check_mode() == "off":
        return
    mod = sys.modules.get(_DISPATCHER_MODULE)
    if mod is not None:
        mod.check_errors()


def _reset_buffers() -> None:
    mod = sys.modules.get(_DISPATCHER_MODULE)
    if mod is not None:
        mod.reset_buffers()


def _stop_buffers(exc: BaseException) -> None:
    """Item 6's other half: this rank's step raised (an expert out of memory on the rank that
    got the most tokens, any error of this rank's own), so every shared Buffer is stopped
    (``Buffer.abort``): EP peers waiting in a dispatch or combine for this rank raise at once,
    naming it, instead of timing out."""
    mod = sys.modules.get(_DISPATCHER_MODULE)
    if mod is not None:
        mod.stop_buffers(exc)


def _checked_after(fn):
    """``fn`` followed by :func:`step_check` when it returns; when it raises, the shared Buffers
    are stopped (:func:`_stop_buffers`) and the exception passes as it is."""

    @functools.wraps(fn)
    def checked(*args, **kwargs):
        try:
            out = fn(*args, **kwargs)
        except Exception as exc:
            _stop_buffers(exc)
            raise
        step_check()
        return out

    checked._mok_patched = True
    return checked


def _resetting_first(fn):
    """``fn`` (``destroy_model_parallel``) after the shared Buffers are destroyed."""

    @functools.wraps(fn)
    def destroy_model_parallel(*args, **kwargs):
        _reset_buffers()
        return fn(*args, **kwargs)

    destroy_model_parallel._mok_patched = True
    return destroy_model_parallel


def _replace_function(saved, module_name: str, name: str, wrap) -> bool:
    """Replace ``module_name.name`` by ``wrap(original)``, and the same original wherever an
    already-imported ``megatron`` module bound it by name. Records every replacement in
    ``saved["hooks"]``; ``False`` when the module or the function is not there."""
    try:
        mod = importlib.import_module(module_name)
    except Exception:  # noqa: BLE001  (an optional hook must not break install())
        return False
    orig = getattr(mod, name, None)
    if orig is None:
        return False
    if getattr(orig, "_mok_patched", False):
        return True
    new = wrap(orig)
    for other_name, other in list(sys.modules.items()):
        if other is None or not (other_name == "megatron" or other_name.startswith("megatron.")):
            continue
        # (the module's own dict: a module-level __getattr__ must not run here)
        if getattr(other, "__dict__", {}).get(name) is orig:
            setattr(other, name, new)
            saved.setdefault("hooks", []).append((other, name, orig))
    return True


def _hook_full_iteration_graph(saved) -> bool:
    mod_name, cls_name = versions.FULL_ITERATION_GRAPH
    try:
        cls = getattr(importlib.import_module(mod_name), cls_name, None)
    except Exception:  # noqa: BLE001
        return False
    orig = getattr(cls, "__call__", None) if cls is not None else None
    if orig is None:
        return False
    if not getattr(orig, "_mok_patched", False):
        cls.__call__ = _checked_after(orig)
        saved.setdefault("hooks", []).append((cls, "__call__", orig))
    return True


def install_runtime_hooks() -> None:
    """Items 6 and 7. Idempotent; a megatron-core without one of the hooked functions gets a
    warning that says what to call instead."""
    with _HOOKS_LOCK:
        if _HOOKS["installed"]:
            return
        saved = {}
        try:
            schedules = [_replace_function(saved, versions.SCHEDULES_MODULE, name, _checked_after)
                         for name in versions.SCHEDULE_FUNCTIONS]
            _hook_full_iteration_graph(saved)
            mod_name, fn_name = versions.DESTROY_MODEL_PARALLEL
            destroy = _replace_function(saved, mod_name, fn_name, _resetting_first)
        except Exception:
            _restore_runtime_hooks(saved)
            raise
        _HOOKS["saved"] = saved
        _HOOKS["installed"] = True
    if not any(schedules):
        warnings.warn("megatron_mok: no forward-backward schedule of megatron-core found to run "
                      "the per-step device-error check after; call "
                      "megatron_mok.megatron.check_errors() once per step, before the optimizer "
                      "step", stacklevel=3)
    if not destroy:
        warnings.warn("megatron_mok: megatron-core has no parallel_state.destroy_model_parallel "
                      "to hook; call megatron_mok.megatron.dispatcher.reset_buffers() before "
                      "re-initialising model parallelism", stacklevel=3)


def _restore_runtime_hooks(saved) -> None:
    for owner, name, orig in reversed(saved.get("hooks", [])):
        setattr(owner, name, orig)


def uninstall_runtime_hooks() -> None:
    with _HOOKS_LOCK:
        if not _HOOKS["installed"]:
            return
        _restore_runtime_hooks(_HOOKS["saved"])
        _HOOKS["saved"] = {}
        _HOOKS["installed"] = False


def runtime_hooks() -> list:
    """``[(owner, name)]`` of what :func:`install_runtime_hooks` replaced (tests, docs)."""
    return [(owner, name) for owner, name, _ in _HOOKS["saved"].get("hooks", [])]


def install() -> None:
    if _STATE["installed"]:
        return
    saved = {}
    _patch_config(saved)
    try:
        _patch_moe_layer(saved)
        _patch_free_input(saved)
        _patch_bridge(saved)
        install_runtime_hooks()
    except Exception:
        _restore(saved)
        raise
    _STATE["saved"] = saved
    _STATE["installed"] = True


def _restore(saved):
    """Undo whatever of :func:`install`'s changes ``saved`` records (all, or those made before
    one failed)."""
    _restore_config(saved)
    _restore_free_input(saved)
    _restore_bridge(saved)
    if "moe_layer_init" in saved:
        from megatron.core.transformer.moe.moe_layer import MoELayer

        MoELayer.__init__ = saved["moe_layer_init"]


def _restore_config(saved):
    TransformerConfig = _config_classes()
    field = TransformerConfig.__dataclass_fields__["moe_token_dispatcher_type"]
    if "field_type" in saved:
        field.type = saved["field_type"]
    if saved.get("annotation") is not None:
        TransformerConfig.__annotations__["moe_token_dispatcher_type"] = saved["annotation"]
    if "post_init" in saved:
        TransformerConfig.__post_init__ = saved["post_init"]


def uninstall() -> None:
    """Undo :func:`install` (tests)."""
    if not _STATE["installed"]:
        return
    _restore(_STATE["saved"])
    uninstall_runtime_hooks()
    _STATE["saved"] = {}
    _STATE["installed"] = False


def is_installed() -> bool:
    return _STATE["installed"]

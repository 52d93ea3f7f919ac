"""Which megatron-core releases the plugin knows, and the small differences between them.

Every version-specific branch in :mod:`megatron_mok.megatron` goes through this module, so
supporting a new release means reading its ``moe_layer.py`` / ``transformer_config.py`` /
``experts.py`` and editing one table here.
"""

from __future__ import annotations

import os
from typing import Tuple

# Releases whose MoELayer / TransformerConfig / argument parsing the patches were read
# against. 0.16.x runs in CI (CPU, gloo); 0.19.x on the GPU machine. 0.17 and 0.18 have the
# same dispatcher selection block, config field and argparse factory; 0.17.1 and 0.18.2 ran a
# subset of tests/megatron on one GPU (session 21: docs/MEGATRON.md).
MIN_SUPPORTED = (0, 16)
MAX_SUPPORTED = (0, 19)          # inclusive, on (major, minor)
TESTED = ("0.16.1", "0.17.1", "0.18.2", "0.19.2")

SKIP_CHECK_ENV = "MOK_MEGATRON_SKIP_VERSION_CHECK"


def megatron_core_version() -> str:
    """The installed megatron-core version string (``ImportError`` if it is not installed)."""
    from megatron.core import package_info

    return package_info.__version__


def parse_version(v: str) -> Tuple[int, int, int]:
    """``"0.19.2rc1"`` -> ``(0, 19, 2)``; unparsable parts count as 0."""
    out = []
    for part in v.split(".")[:3]:
        digits = ""
        for ch in part:
            if not ch.isdigit():
                break
            digits += ch
        out.append(int(digits) if digits else 0)
    while len(out) < 3:
        out.append(0)
    return tuple(out)


def installed_version_tuple() -> Tuple[int, int, int]:
    return parse_version(megatron_core_version())


def check_supported(version: str | None = None) -> str:
    """Raise ``RuntimeError`` unless ``version`` (default: the installed one) is supported.

    ``MOK_MEGATRON_SKIP_VERSION_CHECK=1`` turns the error into a warning, for trying a
    release the plugin was not read against; the patches then may or may not apply.
    """
    version = version or megatron_core_version()
    major_minor = parse_version(version)[:2]
    if MIN_SUPPORTED <= major_minor <= MAX_SUPPORTED:
        return version
    msg = (f"megatron_mok supports megatron-core {MIN_SUPPORTED[0]}.{MIN_SUPPORTED[1]}.x to "
           f"{MAX_SUPPORTED[0]}.{MAX_SUPPORTED[1]}.x (tested: {', '.join(TESTED)}); "
           f"megatron-core {version} is installed. Install a supported release, or set "
           f"{SKIP_CHECK_ENV}=1 to try anyway.")
    if os.environ.get(SKIP_CHECK_ENV, "") not in ("", "0"):
        import warnings

        warnings.warn(msg + " (continuing because " + SKIP_CHECK_ENV + " is set)")
        return version
    raise RuntimeError(msg)


def cuda_graph_scope_names(config) -> set:
    """Names of the CUDA-graph scopes in ``config`` (0.16: ``cuda_graph_scope``; 0.19:
    ``cuda_graph_modules``, or the deprecated ``cuda_graph_scope`` it migrates), as lower-case
    strings. Before Megatron's ``__post_init__`` normalises them a field may still be its
    default ``"full"`` (the whole layer, like an empty list), a comma-separated string, or
    enum members; a ``"full"`` default beside scopes set in the other field is not counted."""
    per_field = []
    for attr in ("cuda_graph_scope", "cuda_graph_modules"):
        val = getattr(config, attr, None)
        if val is None:
            continue
        if isinstance(val, str):
            val = val.split(",") if val else []     # Megatron takes "attn,moe_router" too
        elif not isinstance(val, (list, tuple)):
            val = [val]
        per_field.append({str(getattr(v, "name", v)).strip().lower() for v in val})
    specific = [s for s in per_field if s and s != {"full"}]
    return set().union(*(specific or per_field))


def cuda_graph_impl(config) -> str:
    """The CUDA-graph implementation ``config`` runs, before or after Megatron's
    ``__post_init__`` normalises it: ``"none"``, ``"local"``, ``"transformer_engine"`` or
    ``"full_iteration"`` (one graph over the whole forward-backward of a step).

    Spellings of the full-iteration graph:
      - 0.18, 0.19: ``cuda_graph_impl="full_iteration"``; the deprecated module name
        ``"full_iteration"`` in ``cuda_graph_modules`` / ``cuda_graph_scope`` migrates to it
        from ``"none"`` or ``"local"`` (``cuda_graph_config.CUDA_GRAPH_MODULES_DEPRECATIONS``);
      - 0.16, 0.17: ``cuda_graph_impl="local"`` with the scope ``"full_iteration"`` (an impl of
        ``"none"`` captures nothing, whatever the scope).
    The deprecated ``enable_cuda_graph`` / ``external_cuda_graph`` flags (both releases) count
    as ``"local"`` / ``"transformer_engine"``, as ``__post_init__`` turns them into those.
    Which release's rules apply is read from the config itself: a config with a
    ``cuda_graph_modules`` field is 0.18's or 0.19's (read in the 0.16.1, 0.17.1, 0.18.2 and
    0.19.2 wheels).
    """
    impl = getattr(config, "cuda_graph_impl", None) or "none"
    if impl == "none":
        if getattr(config, "enable_cuda_graph", False):
            impl = "local"
        elif getattr(config, "external_cuda_graph", False):
            impl = "transformer_engine"
    if "full_iteration" in cuda_graph_scope_names(config):
        if hasattr(config, "cuda_graph_modules"):
            if impl in ("none", "local"):
                impl = "full_iteration"
        elif impl == "local":
            impl = "full_iteration"
    return impl


# Where install() hooks megatron-core at run time (_patch.py, items 6 and 7): the same names in
# 0.16.1, 0.17.1, 0.18.2 and 0.19.2. A release that lacks one of them gets that hook left out,
# with a warning that says what to call instead.
#   - the forward-backward schedules that get_forward_backward_func() hands out, looked up as
#     module globals at each call: the per-step device-error check runs after each;
#   - the full-iteration CUDA-graph wrapper (its __call__ replays the captured step): the
#     check runs after each call, outside the capture;
#   - destroy_model_parallel: the shared Buffers (bound to the groups it drops) are destroyed
#     first.
SCHEDULES_MODULE = "megatron.core.pipeline_parallel.schedules"
SCHEDULE_FUNCTIONS = ("forward_backward_no_pipelining",
                      "forward_backward_pipelining_without_interleaving",
                      "forward_backward_pipelining_with_interleaving")
FULL_ITERATION_GRAPH = ("megatron.core.full_cuda_graph", "FullCudaGraphWrapper")
DESTROY_MODEL_PARALLEL = ("megatron.core.parallel_state", "destroy_model_parallel")

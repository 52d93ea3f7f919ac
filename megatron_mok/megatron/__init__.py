"""Megatron-Core integration: ``moe_token_dispatcher_type="mok"`` without forking Megatron.

Usage (before Megatron parses arguments or builds the model)::

    import megatron_mok.megatron
    megatron_mok.megatron.install()

or run an unchanged Megatron-LM script through the launcher::

    torchrun --nproc-per-node 8 -m megatron_mok.launch pretrain_gpt.py ... \\
        --moe-token-dispatcher-type mok

:func:`install` is idempotent and checks the installed megatron-core version (0.16.x to
0.19.x). See ``docs/MEGATRON.md`` for what it changes, the knobs and the limits.

Importing this module does not import megatron-core; :func:`install` does.
"""

from __future__ import annotations

from .config import DISPATCHER_NAME, MokConfigError, MokOptions, check_config, config_problems
from .versions import check_supported, megatron_core_version

__all__ = [
    "install", "uninstall", "is_installed", "check_errors", "MokTokenDispatcher", "MokConfigError",
    "MokOptions", "check_config", "config_problems", "megatron_core_version", "DISPATCHER_NAME",
]


def install() -> str:
    """Register the ``mok`` dispatcher with the installed megatron-core. Idempotent.

    After it: ``TransformerConfig(moe_token_dispatcher_type="mok", ...)`` is valid (and
    checked at config time), ``--moe-token-dispatcher-type mok`` parses in Megatron-LM, and
    ``MoELayer`` builds a :class:`MokTokenDispatcher`.

    Returns:
        The megatron-core version it was installed into.

    Raises:
        ImportError: megatron-core is not installed.
        RuntimeError: the megatron-core version is not supported (see
            :mod:`megatron_mok.megatron.versions`).
    """
    version = check_supported()
    from . import _patch

    _patch.install()
    return version


def uninstall() -> None:
    """Undo :func:`install` (for tests; a running model keeps the dispatchers it built)."""
    from . import _patch

    _patch.uninstall()


def is_installed() -> bool:
    from . import _patch

    return _patch.is_installed()


def __getattr__(name):
    if name == "MokTokenDispatcher":      # imports megatron-core: only on demand
        from .dispatcher import MokTokenDispatcher

        return MokTokenDispatcher
    raise AttributeError(name)


def check_errors() -> bool:
    """Raise :class:`~megatron_mok.cuda.errors.MokDeviceError` if a CUDA kernel of any MoK
    Buffer in this process reported an error (a timeout, a bad expert id, an overflow).

    :func:`install` already runs it after each of Megatron's forward-backward schedules, i.e.
    once per step before the optimizer step (``MOK_CHECK_ERRORS``, docs/MEGATRON.md "When a
    call fails"). Call it yourself where a training loop steps the model without Megatron's
    schedules: after the backward, before ``optimizer.step()``. Synchronises the device;
    returns ``False``, checking nothing, while a CUDA graph is being captured, else ``True``
    (also when no MoK layer has run yet). Does not import megatron-core.
    """
    import sys

    mod = sys.modules.get(__name__ + ".dispatcher")
    if mod is None:
        return True
    return mod.check_errors()

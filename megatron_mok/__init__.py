"""megatron_mok: a pull-based, deterministic MoE token dispatcher for NVLink domains.

The public surface is small:

- :class:`Buffer` -- one per expert-parallel process group; owns the workspace and runs
  ``dispatch`` / ``combine`` (differentiable) on the chosen backend.
- :class:`DispatchResult` -- what ``dispatch`` returns (expert-major rows and their layout).
- :class:`DispatchHandle` -- the layout, reused by ``combine`` and by both backward passes.
- :mod:`megatron_mok.fp8` -- the FP8 dispatch's input (``quantize``) and its packed rows.
- The errors a call raises besides ``TypeError`` / ``ValueError`` (docs/CONTRACT.md,
  "Errors"), all ``RuntimeError``: :class:`MokDeviceError` (a kernel's report: timeout, bad
  expert id, overflow), :class:`MokPeerStopped` (a peer stopped after an error of its own:
  ``.rank``, ``.reason``; on the CUDA backend it is :class:`MokDevicePeerStopped`, also a
  ``MokDeviceError``) and :class:`MokTimeout` (a reference-backend collective past
  ``timeout_s``).

``docs/CONTRACT.md`` states the semantics every backend implements. The package imports
without the compiled CUDA library; asking for ``backend="cuda"`` without it raises an error
that says how to build it.
"""

from .cuda.peer_memory import disable_multicast_env as _disable_multicast_env

_disable_multicast_env()  # before any NCCL / symmetric-memory initialisation we can precede

from .version import __version__
from .handle import DispatchHandle, DispatchResult
from .buffer import Buffer, available_backends
from .cuda.errors import MokDeviceError, MokDevicePeerStopped, MokPeerStopped, MokTimeout
from . import fp8

__all__ = ["Buffer", "DispatchHandle", "DispatchResult", "available_backends", "fp8", "__version__",
           "MokDeviceError", "MokDevicePeerStopped", "MokPeerStopped", "MokTimeout"]

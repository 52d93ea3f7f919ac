"""ctypes signatures of ``csrc/api/mok_api.h`` (keep the two in step)."""

from __future__ import annotations

import ctypes
from ctypes import c_double, c_int, c_int64, c_size_t, c_uint64, c_void_p, POINTER

# The C ABI version this file declares (MOK_ABI_VERSION in csrc/api/mok_api.h).
ABI_VERSION = 20

_SIGNATURES = {
    "mok_abi_version": (c_int, []),
    "mok_create": (c_void_p, [c_int] * 10 + [c_int64, c_int64, c_int]),
    "mok_destroy": (None, [c_void_p]),
    "mok_workspace_bytes": (c_size_t, [c_void_p]),
    "mok_handle_scratch_bytes": (c_size_t, [c_void_p]),
    "mok_error_offset": (c_size_t, [c_void_p]),
    "mok_handle_totals_offset": (c_size_t, [c_void_p]),
    "mok_trace_offset": (c_size_t, [c_void_p]),
    "mok_set_peers": (c_int, [c_void_p, POINTER(c_uint64), c_int, c_double]),
    "mok_set_host_report": (c_int, [c_void_p, c_void_p]),
    "mok_dispatch_layout": (c_int, [c_void_p, c_void_p, c_void_p, c_void_p, c_int, c_void_p, c_int,
                                    c_int, c_void_p, c_int64, c_int64, c_int, c_int64, c_int, c_int,
                                    c_int]),
    "mok_dispatch_fill": (c_int, [c_void_p, c_void_p, c_void_p, c_void_p, c_void_p, c_void_p, c_int64, c_int]),
    "mok_dispatch_transfer": (c_int, [c_void_p, c_void_p, c_void_p, c_void_p, c_void_p, c_int,
                                      c_void_p, c_int64, c_int, c_int, c_int, c_int, c_int]),
    "mok_dispatch_stage_copy": (c_int, [c_void_p, c_void_p, c_void_p, c_void_p, c_int, c_int, c_int]),
    "mok_dispatch_ce_stage_supported": (c_int, [c_void_p]),
    "mok_dispatch_launch": (c_int, [c_void_p, c_void_p, c_int, c_void_p, c_void_p, c_int, c_void_p,
                                    c_int, c_int, c_void_p, c_void_p, c_void_p, c_void_p, c_int,
                                    c_void_p, c_void_p, c_void_p, c_int64, c_int, c_int, c_int, c_int64, c_int,
                                    c_int, c_int]),
    "mok_layout_fused": (c_int, [c_void_p, c_int]),
    "mok_set_pdl": (c_int, [c_void_p, c_int]),
    "mok_pdl": (c_int, [c_void_p]),
    "mok_combine": (c_int, [c_void_p, c_void_p, c_void_p, c_void_p, c_void_p, c_int,
                            c_void_p, c_void_p, c_int64, c_int, c_int, c_int, c_int, c_int]),
    "mok_pack_rows": (c_int, [c_void_p, c_void_p, c_int64, c_void_p, c_int64, c_void_p, c_int64, c_int64]),
    "mok_stop_rank": (c_int, [c_void_p, c_void_p, ctypes.c_char_p, c_int, c_int]),
    "mok_read_stop_note": (c_int, [c_void_p, c_int, c_void_p, ctypes.c_char_p, POINTER(c_int),
                                   POINTER(c_int)]),
    "mok_last_error": (ctypes.c_char_p, []),
    "mok_sm_count": (c_int, [c_int]),
    "mok_kernel_arch": (c_int, [c_int]),
    "mok_stream_create": (c_void_p, [c_int]),
}


# mok_dispatch_launch's steps (MOK_STEP_* in csrc/api/mok_api.h).
STEP_LAYOUT, STEP_FILL, STEP_STAGE_COPY, STEP_TRANSFER = 1, 2, 4, 8
# mok_dispatch_transfer's modes: roles (both, stage only, pull only), or'ed with "rows [R, cap)
# not zeroed" and "the copy engine staged x" (see csrc/api/mok_api.h).
TRANSFER_BOTH, TRANSFER_STAGE, TRANSFER_PULL = 0, 1, 2
TRANSFER_NO_PAD, TRANSFER_CE_STAGED = 4, 8
# rows_per_expert off (mok_dispatch_layout / mok_dispatch_launch).
NO_ROWS_PER_EXPERT = -1


def declare(lib: ctypes.CDLL) -> None:
    """Declare every signature; raise OSError if the library lacks one or was built for
    another ABI version (a stale build: rebuild it)."""
    try:
        version = lib.mok_abi_version
    except AttributeError:
        raise OSError("it predates ABI versioning (no mok_abi_version): rebuild it") from None
    version.restype, version.argtypes = c_int, []
    if version() != ABI_VERSION:
        raise OSError(f"it was built for C ABI version {version()}, this package declares "
                      f"{ABI_VERSION}: rebuild it from this checkout's csrc/")
    for name, (restype, argtypes) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype = restype
        fn.argtypes = argtypes

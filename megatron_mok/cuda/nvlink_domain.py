"""Whether the ranks of a group that spans hosts share one NVLink domain.

The CUDA backend's kernels load from and store to every peer's workspace, so every pair of
its GPUs needs a direct path. On one host that is NVLink (or PCIe peer-to-peer), checked by
:func:`megatron_mok.cuda.peer_memory.unreachable_peers`. Across hosts such a path exists only
on a multi-node NVLink system (an NVLink network: GH200 NVL32, GB200 NVL72), where NVML
reports each GPU's fabric: the cluster UUID and clique id of its NVLink domain, which torch's
symmetric memory then uses (fabric handles). Hosts joined by InfiniBand or Ethernet are not
one domain, and there torch's symmetric memory would exchange its handles as POSIX file
descriptors over a local socket named after each peer's process id, which a process on
another host cannot reach: the ranks would fail with an unrelated-looking error, or wait.

So a group that spans hosts is refused on every rank at once (all of them decide from the
same gathered data), naming what to use instead, unless every rank's GPU reports one
completed fabric (the same non-zero cluster UUID and clique id), or ``MOK_MULTI_HOST_NVLINK=1``
says the GPUs are one NVLink domain that NVML cannot report.
"""

from __future__ import annotations

import ctypes
import os
from typing import Dict, List, Optional, Sequence, Tuple

from ..validation import ranks_text

# nvmlGpuFabricInfo_t (nvml.h, driver R530+): state NVML_GPU_FABRIC_STATE_COMPLETED once the
# GPU has joined its NVLink network; GPUs on no NVLink network (every single-host HGX board)
# report NVML_GPU_FABRIC_STATE_NOT_SUPPORTED (0) or fail the call.
FABRIC_STATE_COMPLETED = 3
ASSUME_ENV = "MOK_MULTI_HOST_NVLINK"


class _FabricInfo(ctypes.Structure):
    _fields_ = [("cluster_uuid", ctypes.c_ubyte * 16), ("status", ctypes.c_int),
                ("clique_id", ctypes.c_uint), ("state", ctypes.c_ubyte)]


_NVML: List = []   # [library or None], loaded and initialised once per process


def _nvml():
    """``libnvidia-ml.so.1``, initialised; ``None`` when it is missing or its init fails."""
    if not _NVML:
        try:
            lib = ctypes.CDLL("libnvidia-ml.so.1")
            _NVML.append(lib if lib.nvmlInit_v2() == 0 else None)
        except (OSError, AttributeError):
            _NVML.append(None)
    return _NVML[0]


def fabric_fields(uuid: str, nvml=None) -> dict:
    """What NVML says of the GPU with ``uuid`` (as torch prints it, with or without the ``GPU-``
    prefix): ``handle_rc`` (its lookup's return code), then ``info_rc`` and, when that is 0,
    ``state``, ``status``, ``clique`` and ``cluster`` (hex) of ``nvmlDeviceGetGpuFabricInfo``;
    ``{"error": ...}`` when NVML is missing or a call raised (a driver without the call).
    ``nvml``: a stand-in library (tests). ``scripts/probe_nvlink_fabric.py`` prints it."""
    try:
        lib = nvml if nvml is not None else _nvml()
        if lib is None:
            return {"error": "libnvidia-ml.so.1 not loaded (missing, or nvmlInit failed)"}
        handle = ctypes.c_void_p()
        out = {"handle_rc": -1}
        for name in ([uuid] if uuid.startswith("GPU-") else [uuid, "GPU-" + uuid]):
            out["handle_rc"] = lib.nvmlDeviceGetHandleByUUID(name.encode(), ctypes.byref(handle))
            if out["handle_rc"] == 0:
                break
        else:
            return out
        info = _FabricInfo()
        out["info_rc"] = lib.nvmlDeviceGetGpuFabricInfo(handle, ctypes.byref(info))
        if out["info_rc"] == 0:
            out.update(state=int(info.state), status=int(info.status), clique=int(info.clique_id),
                       cluster=bytes(info.cluster_uuid).hex())
        return out
    except Exception as e:   # noqa: BLE001  (a probe: any failure means "no NVLink network known")
        return {"error": f"{type(e).__name__}: {e}"}


def fabric_of(uuid: str, nvml=None) -> Optional[Tuple[str, int]]:
    """``(cluster UUID as hex, clique id)`` of the NVLink network the GPU with ``uuid`` has
    joined (:func:`fabric_fields`); ``None`` when NVML is missing, the GPU is on no NVLink
    network, its fabric is not ready, or any call fails (the caller then treats it as on no
    NVLink network)."""
    f = fabric_fields(uuid, nvml)
    if f.get("info_rc") != 0:
        return None
    if f["state"] != FABRIC_STATE_COMPLETED or f["status"] != 0 or not int(f["cluster"], 16):
        return None
    return f["cluster"], f["clique"]


def domain_problem(keys: Sequence[Tuple[str, str]], fabrics: Sequence[Optional[Tuple[str, int]]],
                   assumes: Optional[Sequence[bool]] = None) -> Optional[str]:
    """The error every rank raises when the group's ranks (``keys[r]``: ``(host, GPU UUID)``)
    span hosts that are not one NVLink domain (``fabrics[r]``: :func:`fabric_of` of rank
    ``r``'s GPU, ``assumes[r]``: its :func:`assumed`, both gathered from every rank); ``None``
    when they are on one host, report one NVLink network, or every rank sets
    ``MOK_MULTI_HOST_NVLINK=1`` (some ranks only: an error, since the others would refuse)."""
    by_host: Dict[str, List[int]] = {}
    for r, k in enumerate(keys):
        by_host.setdefault(k[0], []).append(r)
    if len(by_host) < 2:
        return None
    assumes = list(assumes) if assumes is not None else [False] * len(keys)
    if any(assumes):
        if all(assumes):
            return None
        return (f"megatron_mok: {ASSUME_ENV}=1 is set on ranks "
                f"{ranks_text([r for r, a in enumerate(assumes) if a])} only; set it the same "
                f"on every rank of the group")
    known = [tuple(f) if f is not None else None for f in fabrics]
    if None not in known and len(set(known)) == 1:
        return None
    placed = "; ".join(f"ranks {ranks_text(rs)} on {h}" for h, rs in sorted(by_host.items(),
                                                                            key=lambda kv: kv[1][0]))
    missing = [r for r, f in enumerate(known) if f is None]
    if missing:
        why = (f"NVML reports no multi-node NVLink network (GPU fabric) for the GPUs of ranks "
               f"{ranks_text(missing)}")
    else:
        domains = sorted({f for f in known})
        why = (f"their GPUs report {len(domains)} different NVLink domains (cluster, clique): "
               + ", ".join(f"({c[:8]}..., {q})" for c, q in domains[:4]))
    return (f"megatron_mok: the CUDA backend needs every rank of its group in one NVLink domain "
            f"(its kernels read and write the peers' GPU memory), and this group of "
            f"{len(keys)} ranks spans {len(by_host)} hosts ({placed}): {why}. For expert "
            f"parallelism across nodes joined by InfiniBand or Ethernet use Megatron's "
            f"alltoall or flex dispatcher, or make the group's ranks share one host "
            f"(expert_model_parallel_size x expert_tensor_parallel_size within a node), or use "
            f"backend='reference' (any process group; slow: for checking). On a multi-node "
            f"NVLink system whose fabric NVML cannot report, set {ASSUME_ENV}=1.")


def assumed() -> bool:
    """``MOK_MULTI_HOST_NVLINK=1``: the user says the hosts are one NVLink domain."""
    return os.environ.get(ASSUME_ENV, "0") not in ("", "0")

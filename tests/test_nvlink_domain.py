"""A CUDA-backend group that spans hosts must be one NVLink domain (CPU, no GPU needed).

Hosts joined by InfiniBand or Ethernet are not: torch's symmetric memory would try to exchange
its handles through a local socket named after each peer's process and fail or wait. Every
rank refuses such a group together, before any mapping, with what to use instead; a
multi-node NVLink system (NVML reports one completed GPU fabric for every GPU) passes, and so
does ``MOK_MULTI_HOST_NVLINK=1`` on every rank. The NVML probe runs against a stand-in library
here; on the GPU machine its answer for a single-host H200 is logged by the device script.
"""

import ctypes

import pytest

from harness import run_distributed
from megatron_mok.cuda import nvlink_domain
from megatron_mok.cuda.nvlink_domain import domain_problem, fabric_fields, fabric_of
from megatron_mok.validation import ranks_text

A, B, C, D = "GPU-aaaa", "GPU-bbbb", "GPU-cccc", "GPU-dddd"
TWO_HOSTS = [("h1", A), ("h1", B), ("h2", C), ("h2", D)]
NET = ("1f" * 16, 7)


def test_ranks_text():
    assert ranks_text([0, 1, 2, 3, 6]) == "0-3, 6"
    assert ranks_text([5]) == "5"
    assert ranks_text([0, 2, 3]) == "0, 2-3"


def test_one_host_needs_no_fabric():
    assert domain_problem([("h", A), ("h", B)], [None, None]) is None
    assert domain_problem([("h", A)], [None]) is None


def test_hosts_without_an_nvlink_network_are_refused_with_what_to_do():
    msg = domain_problem(TWO_HOSTS, [None] * 4)
    assert msg is not None
    assert "this group of 4 ranks spans 2 hosts (ranks 0-1 on h1; ranks 2-3 on h2)" in msg
    assert "no multi-node NVLink network (GPU fabric) for the GPUs of ranks 0-3" in msg
    for what in ("alltoall or flex", "backend='reference'", "MOK_MULTI_HOST_NVLINK=1",
                 "expert_model_parallel_size x expert_tensor_parallel_size"):
        assert what in msg, what
    # Ranks interleaved over hosts are listed per host.
    msg = domain_problem([("h1", A), ("h2", C), ("h1", B), ("h2", D)], [None] * 4)
    assert "(ranks 0, 2 on h1; ranks 1, 3 on h2)" in msg


def test_one_nvlink_network_passes_and_any_gap_is_named():
    assert domain_problem(TWO_HOSTS, [NET] * 4) is None
    assert domain_problem(TWO_HOSTS, [list(NET)] * 4) is None    # as a gather may hand it back
    msg = domain_problem(TWO_HOSTS, [NET, NET, None, NET])
    assert "for the GPUs of ranks 2" in msg
    msg = domain_problem(TWO_HOSTS, [NET, NET, (NET[0], 8), (NET[0], 8)])
    assert "2 different NVLink domains (cluster, clique): (1f1f1f1f..., 7), (1f1f1f1f..., 8)" in msg
    msg = domain_problem(TWO_HOSTS, [NET, NET, ("2e" * 16, 7), ("2e" * 16, 7)])
    assert "2 different NVLink domains" in msg


def test_the_override_must_be_set_on_every_rank():
    assert domain_problem(TWO_HOSTS, [None] * 4, [True] * 4) is None
    msg = domain_problem(TWO_HOSTS, [None] * 4, [True, False, True, False])
    assert msg == ("megatron_mok: MOK_MULTI_HOST_NVLINK=1 is set on ranks 0, 2 only; set it the "
                   "same on every rank of the group")
    # One host: the override changes nothing (nothing to check).
    assert domain_problem([("h", A), ("h", B)], [None, None], [True, False]) is None


def test_assumed_reads_the_environment(monkeypatch):
    monkeypatch.delenv("MOK_MULTI_HOST_NVLINK", raising=False)
    assert not nvlink_domain.assumed()
    monkeypatch.setenv("MOK_MULTI_HOST_NVLINK", "0")
    assert not nvlink_domain.assumed()
    monkeypatch.setenv("MOK_MULTI_HOST_NVLINK", "1")
    assert nvlink_domain.assumed()


class _Nvml:
    """A stand-in NVML: GPUs by UUID (with the ``GPU-`` prefix, as NVML names them), each with
    the fabric fields it reports; ``info_rc`` is what the fabric call returns."""

    def __init__(self, gpus, info_rc=0):
        self.gpus, self.info_rc, self.asked = gpus, info_rc, []

    def nvmlDeviceGetHandleByUUID(self, name, handle_ref):
        self.asked.append(name.decode())
        if name.decode() not in self.gpus:
            return 13                               # NVML_ERROR_NOT_FOUND
        handle_ref._obj.value = list(self.gpus).index(name.decode()) + 1
        return 0

    def nvmlDeviceGetGpuFabricInfo(self, handle, info_ref):
        cluster, status, clique, state = list(self.gpus.values())[handle.value - 1]
        info = info_ref._obj
        ctypes.memmove(info.cluster_uuid, bytes.fromhex(cluster), 16)
        info.status, info.clique_id, info.state = status, clique, state
        return self.info_rc


def test_fabric_probe_reads_nvml():
    done = ("1f" * 16, 0, 7, 3)
    nvml = _Nvml({A: done})
    assert fabric_of("aaaa", nvml) == NET          # torch's form without the prefix
    assert nvml.asked == ["aaaa", "GPU-aaaa"]
    assert fabric_of(A, nvml) == NET
    assert fabric_of("GPU-zzzz", nvml) is None     # not a GPU NVML knows
    # Not joined (state not supported / in progress), an error status, a zero cluster, a
    # failed call: no NVLink network known.
    for fields in (("1f" * 16, 0, 7, 0), ("1f" * 16, 0, 7, 2), ("1f" * 16, 1, 7, 3),
                   ("00" * 16, 0, 7, 3)):
        assert fabric_of(A, _Nvml({A: fields})) is None, fields
    assert fabric_of(A, _Nvml({A: done}, info_rc=3)) is None


def test_fabric_probe_without_nvml(monkeypatch):
    assert fabric_of(A, object()) is None           # a library without the calls (old driver)
    monkeypatch.setattr(nvlink_domain, "_NVML", [None])
    assert fabric_of(A) is None                     # libnvidia-ml missing or its init failed

    def no_library(name):
        raise OSError(f"{name}: cannot open shared object file")
    monkeypatch.setattr(nvlink_domain, "_NVML", [])
    monkeypatch.setattr(nvlink_domain.ctypes, "CDLL", no_library)
    assert nvlink_domain._nvml() is None and fabric_of(A) is None


# ------------------------------------------------------------ every rank refuses, together
class _Mapped(Exception):
    """Raised in place of the mapping: the check let the group through."""


def _make_peer_memory(rank, world_size, fabrics, assume_ranks):
    """``PeerMemory`` on ranks that believe they sit on two hosts (rank r on host ``r % 2``),
    with ``fabrics[r]`` as their GPU's fabric; the mapping itself is replaced by ``_Mapped``.
    Returns the error's text, or ``"mapped"``."""
    import os

    import torch

    from megatron_mok.cuda import peer_memory

    peer_memory.device_key = lambda device: (f"host{rank % 2}", f"GPU-{rank}")
    peer_memory.fabric_of = lambda uuid: fabrics[rank]
    if rank in assume_ranks:
        os.environ["MOK_MULTI_HOST_NVLINK"] = "1"

    def mapped(*a):
        raise _Mapped()
    peer_memory.peer_access_error = mapped
    try:
        peer_memory.PeerMemory(1024, None, rank, world_size, torch.device("cpu"))
    except _Mapped:
        return "mapped"
    except RuntimeError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("world_size", [2, 3])
def test_every_rank_refuses_a_group_across_hosts_together(world_size):
    out = run_distributed(_make_peer_memory, world_size, [None] * world_size, [], fresh=True,
                          timeout=60)
    assert len(set(out)) == 1, out                  # the same words on every rank
    assert "spans 2 hosts" in out[0] and "alltoall or flex" in out[0], out[0]


def test_a_group_on_one_nvlink_network_goes_on_to_map():
    assert run_distributed(_make_peer_memory, 2, [NET, NET], [], fresh=True, timeout=60) == \
        ["mapped", "mapped"]
    assert run_distributed(_make_peer_memory, 2, [None, None], [0, 1], fresh=True, timeout=60) == \
        ["mapped", "mapped"]
    out = run_distributed(_make_peer_memory, 2, [None, None], [1], fresh=True, timeout=60)
    assert out[0] == out[1] and "is set on ranks 1 only" in out[0], out


def test_fabric_fields_say_how_far_the_calls_got():
    nvml = _Nvml({A: ("1f" * 16, 0, 7, 0)})
    assert fabric_fields(A, nvml) == {"handle_rc": 0, "info_rc": 0, "state": 0, "status": 0,
                                      "clique": 7, "cluster": "1f" * 16}
    assert fabric_fields("zzzz", nvml) == {"handle_rc": 13}
    assert fabric_fields(A, _Nvml({A: ("1f" * 16, 0, 7, 3)}, info_rc=3)) == {"handle_rc": 0, "info_rc": 3}
    assert "AttributeError" in fabric_fields(A, object())["error"]


def test_the_probe_script_prints_each_gpu():
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(__file__), "..", "scripts", "probe_nvlink_fabric.py")
    spec = importlib.util.spec_from_file_location("probe_nvlink_fabric", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rows = mod.probe(["aaaa", "bbbb"], _Nvml({A: ("1f" * 16, 0, 7, 3), B: ("00" * 16, 0, 0, 0)}))
    assert [r["nvlink_network"] for r in rows] == [NET, None]
    assert [r["state_name"] for r in rows] == ["completed", "not supported"]

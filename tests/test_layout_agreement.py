"""The ranks of a CUDA-backend group must make their Buffers with one workspace layout.

Each rank reads its peers' workspaces at the offsets its own arguments give (rings, flags,
routing slots), in its own dtype. A rank whose Buffer differs (another ``hidden``, ``T_max``,
dtype, ``ring_bytes`` from a per-node environment, ``MOK_CHUNK_TOKENS``, a library of another
build) would read its peers' rows and flags at wrong offsets: silently wrong results, or a wait
that never ends. So the CUDA backend gathers those arguments before it allocates anything, and
every rank raises the same ``ValueError`` naming what differs on which ranks (NOTES item 63).

CPU: the comparison and its words (``validation.disagreement``), and the backend's check on
gloo ranks (the check itself is host code; a stand-in library records the context's release).
GPU: loopback ranks and processes sharing the GPU, before any workspace exists. The reference
backend sends a fingerprint of the same arguments in every call's status exchange: at the first
call of Buffers that differ, every rank raises the same words.
"""

import types

import pytest
import torch

from harness import rank_device, run_distributed, run_loopback
from megatron_mok.validation import disagreement

FIELDS = ("hidden", "topk", "dtype")


def test_disagreement_names_each_field_and_its_ranks():
    assert disagreement(FIELDS, [[7168, 8, 1]] * 4) is None
    msg = disagreement(FIELDS, [[7168, 8, 1], [7168, 8, 1], [7168, 8, 1], [4096, 8, 1]])
    assert msg == "hidden: 7168 on ranks 0-2, 4096 on rank 3"
    msg = disagreement(FIELDS, [[1, 8, 1], [1, 4, 2], [1, 8, 2]],
                       show=lambda name, v: {1: "bfloat16", 2: "float16"}[v] if name == "dtype" else str(v))
    assert msg == "topk: 8 on ranks 0, 2, 4 on rank 1; dtype: bfloat16 on rank 0, float16 on ranks 1-2"


class _Lib:
    def __init__(self):
        self.destroyed = []

    def mok_destroy(self, ctx):
        self.destroyed.append(ctx)


def _check_on_rank(rank, world_size, differ):
    """``CudaBackend._check_layout_agrees`` on a stand-in backend whose Buffer's arguments are
    the same on every rank except ``differ`` (``{rank: {name: value}}``); returns the error's
    words (``None``: no error), whether the context was released, and ``be.ctx``."""
    from megatron_mok.cuda.backend import CudaBackend

    args = dict(group=None, world_size=world_size, num_experts=8, hidden=64, topk=2,
                max_tokens_per_rank=32, dtype=torch.bfloat16, combine_partial_dtype=torch.bfloat16,
                expert_alignment=1)
    args.update(differ.get(rank, {}))
    ring = dict(disp=100, comb=90, nbytes=1 << 20)
    ring.update(differ.get(rank, {}).get("ring", {}))
    args.pop("ring", None)
    be = types.SimpleNamespace(buf=types.SimpleNamespace(**args), lib=_Lib(), ctx=1234,
                               chunk_tokens=args.pop("chunk_tokens", 64), timeout_s=30.0,
                               ce_stage=args.pop("ce_stage", True), stage_first=args.pop("stage_first", False))
    try:
        CudaBackend._check_layout_agrees(be, torch.device("cpu"), ring["disp"], ring["comb"], ring["nbytes"])
    except ValueError as e:
        return str(e), be.lib.destroyed, be.ctx
    return None, be.lib.destroyed, be.ctx


@pytest.mark.parametrize("differ, words", [
    ({}, None),
    ({1: {"hidden": 128}}, "hidden: 64 on rank 0, 128 on rank 1"),
    ({1: {"dtype": torch.float16, "combine_partial_dtype": torch.float32}},
     "dtype: bfloat16 on rank 0, float16 on rank 1; combine_partial_dtype: bfloat16 on rank 0, "
     "float32 on rank 1"),
    ({0: {"max_tokens_per_rank": 40}}, "max_tokens_per_rank: 40 on rank 0, 32 on rank 1"),
    ({1: {"ring": {"disp": 50, "nbytes": 1 << 19}}},
     "dispatch ring chunks (ring_bytes): 100 on rank 0, 50 on rank 1; workspace bytes: 1048576 "
     "on rank 0, 524288 on rank 1"),
    ({1: {"chunk_tokens": 128}}, "MOK_CHUNK_TOKENS: 64 on rank 0, 128 on rank 1"),
    # where the peers read a rank's tokens (NOTES item 65: was a second gather, after allocating)
    ({1: {"ce_stage": False}}, "copy-engine staging (MOK_DISPATCH_CE_STAGE): used on rank 0, not used on rank 1"),
    ({0: {"ce_stage": False, "stage_first": True}},
     "copy-engine staging (MOK_DISPATCH_CE_STAGE): not used on rank 0, used on rank 1; "
     "MOK_EAGER_STAGE_FIRST: 1 on rank 0, 0 on rank 1"),
])
def test_every_rank_refuses_another_layout_before_allocating(differ, words):
    out = run_distributed(_check_on_rank, 2, differ, timeout=60)
    assert out[0] == out[1], out                     # the same words on every rank
    msg, destroyed, ctx = out[0]
    if words is None:
        assert msg is None and destroyed == [] and ctx == 1234     # kept for the workspace
    else:
        assert destroyed == [1234] and ctx is None                 # released before raising
        assert f"different workspace layouts ({words})" in msg, msg
        assert "in Megatron: the same model config and MOK_* variables on every rank" in msg


def _make_buffer(rank, world_size, differ):
    """A CUDA-backend Buffer whose ``hidden`` or ``ring_bytes`` differ on rank 1; the error's
    words on every rank (before any workspace: nothing to free)."""
    import megatron_mok as mok

    kw = dict(num_experts=4 * world_size, hidden=64, topk=2, max_tokens_per_rank=16,
              ring_bytes=1 << 22)
    if rank == 1:
        kw.update(differ)
    try:
        buf = mok.Buffer(None, backend="cuda", device=rank_device(rank), timeout_s=20, **kw)
    except ValueError as e:
        return str(e)
    buf.destroy()
    return None


@pytest.mark.gpu
@pytest.mark.parametrize("differ, words", [({"hidden": 128}, "hidden: 64 on rank 0, 128 on rank 1"),
                                           ({"ring_bytes": 1 << 21}, "dispatch ring chunks (ring_bytes)")])
def test_loopback_ranks_refuse_another_layout(differ, words):
    out = run_loopback(_make_buffer, 2, differ, timeout=60)
    assert out[0] == out[1] and words in out[0], out
    assert run_loopback(_make_buffer, 2, {}, timeout=60) == [None, None]


@pytest.mark.gpu
@pytest.mark.multigpu
def test_processes_refuse_another_layout():
    from harness import gpus_for

    if not gpus_for(2):
        pytest.skip("needs 2 GPUs (or MOK_TEST_SHARED_GPU=1)")
    out = run_distributed(_make_buffer, 2, {"hidden": 128}, backend="nccl", timeout=120)
    assert out[0] == out[1] and "hidden: 64 on rank 0, 128 on rank 1" in out[0], out


# ------------------------------------------------------------------ the reference backend
def _reference_call(rank, world_size, differ):
    """A reference-backend Buffer whose arguments differ on rank 1 (``differ``), then its first
    dispatch: the words every rank raises there (``None``: the dispatch and a combine ran), and
    that the Buffer refuses from then on."""
    import megatron_mok as mok
    from harness import make_inputs

    kw = dict(num_experts=4 * world_size, hidden=16, topk=2, max_tokens_per_rank=8)
    if rank == 1:
        kw.update(differ)
    buf = mok.Buffer(None, backend="reference", timeout_s=20, **kw)
    x, idx, w = make_inputs(3, world_size, [5] * world_size, 4 * world_size, 16, 2, torch.bfloat16,
                            device="cpu")[rank]
    if rank == 1 and "dtype" in differ:
        x = x.to(differ["dtype"])
    try:
        res = buf.dispatch(x, idx, w)
    except ValueError as e:
        with pytest.raises(RuntimeError, match="different workspace layouts"):
            buf.dispatch(x, idx, w)          # refused from now on, naming the same problem
        return str(e)
    buf.combine(res.tokens, res.handle)
    return None


@pytest.mark.parametrize("differ, words", [
    ({}, None),
    ({"num_experts": 12}, "num_experts: 8 on rank 0, 12 on rank 1"),
    ({"max_tokens_per_rank": 9}, "max_tokens_per_rank: 8 on rank 0, 9 on rank 1"),
    ({"dtype": torch.float16}, "dtype: bfloat16 on rank 0, float16 on rank 1; combine_partial_dtype: "
                               "bfloat16 on rank 0, float16 on rank 1"),
    ({"combine_partial_dtype": torch.float32}, "combine_partial_dtype: bfloat16 on rank 0, float32 on rank 1"),
    ({"hidden": 16, "expert_alignment": 4}, "expert_alignment: 1 on rank 0, 4 on rank 1"),
])
def test_reference_ranks_refuse_another_layout_at_the_first_call(differ, words):
    out = run_distributed(_reference_call, 2, differ, timeout=60)
    assert out[0] == out[1], out
    if words is None:
        assert out[0] is None
    else:
        assert f"different workspace layouts ({words})" in out[0], out[0]

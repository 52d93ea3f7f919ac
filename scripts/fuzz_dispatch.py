"""Randomized differential fuzzer for Buffer.dispatch / Buffer.combine, bitwise.

    python scripts/fuzz_dispatch.py --seconds 240 --out DIR [--seed S] [--device cuda|cpu]
                                    [--max-world 4] [--cases N] [--max-tokens 600]
                                    [--no-schedules] [--no-graphs]
    python scripts/fuzz_dispatch.py --replay CASE_SEED [--max-world 4] [--device ...] --out DIR

Each case draws one configuration from its own case seed (printed before the case runs, so
a crash or a failure is reproducible with ``--replay CASE_SEED`` and the same ``--max-world``,
``--max-tokens`` and device): a world size of 1..max-world, one Buffer shape (hidden, topk
1..min(8, experts) and rarely up to 16, experts = world x 1..8 local experts, dtype, combine
partial dtype, T_max, expert_alignment, static-shape ``max_recv_tokens`` or eager, the default
ring or a small one that calls wrap and that a call can exceed, num_sms) and 2..4 consecutive
calls ("steps") on that one Buffer, so ring state carries over between them. Every step draws its own tokens per rank (0, odd, chunk boundaries, T_max),
routing (distinct top-k, duplicate experts in a row, skewed, everything to one expert or one
rank, -1 slots up to all of them, int32 ids), values, FP8 pair input (``fp8.quantize`` or raw
bytes with byte scales), ``rows_per_expert`` (drop-and-pad, capacity drawn at or above the
fullest expert), a receive budget (``recv_budget=M``, in about a quarter of the steps without
rows_per_expert, from a stream of its own: each rank's M against its own rows R, alignment
padding included: 0, below R so rows are dropped, exactly R, above R, or no budget on that
rank; a multiple of expert_alignment; on a static-shape Buffer it replaces max_recv_tokens for
that call, which then need not hold that rank's rows), a cached dispatch along the handle
(also a budget's), and a backward through autograd or the chain rule written out (dispatch
backward = combine of the row gradients + prob gradients, combine backward = cached dispatch of
grad_y). Invalid combinations are never drawn (they are excluded by construction, never by
catching errors): any exception is a failure.

The ranks run as threads on one device (``megatron_mok.loopback``), each case under a
timeout, so nothing can hang: a timeout is a failure, after which the run stops (hung
threads may still hold the device).

What is compared, per step and rank, bitwise (same dtype and bits; FP8 rows and scales as
bytes): dispatch ``tokens`` (or FP8 rows + scales), ``probs``, ``tokens_per_expert``,
``src_rank``, ``src_token``; ``combine`` output ``y``; the cached dispatch's rows and, with a
backward, the gradient of its input; ``grad_x``, ``grad_topk_weights`` and the gradient of the
expert output. The padding rows (expert_alignment, rows_per_expert, static shape) must be
zero rows with probs 0 and sources -1 (and zero gradient); NaN is written into the expert
output's padding rows in some steps, which combine must never read. With a receive budget
also ``over_budget``, ``rows_received`` and ``num_rows_device``, bitwise, and its invariants
from the draw alone (on both results of a GPU run, so they hold even where both backends agree
on a wrong answer): exactly M rows, the flag equal to R > M, the rows received R,
``num_rows_device`` min(R, M), ``tokens_per_expert`` the padded counts clamped to the first M
rows, no source on a row past min(R, M), and no error at the ``check_errors`` that ends every
case (a drop is not one). The CPU expectation of a budget is the oracle's layout without one
cut to its rows before row M, with the combine and every gradient summed over those kept rows
only (the dropped slots get +0.0).

- ``--device cuda``: the CUDA backend against the reference backend, both run on the same
  inputs in the same loopback ranks on one GPU (the reference's backward is written out by
  hand there: autograd would run its blocking collectives on one shared device thread).
- ``--device cpu``: no CUDA backend there; the reference backend against the independent
  oracle of ``tests/oracle.py`` (what CI runs, through tests/test_fuzz_dispatch.py).

Two more things only a ``--device cuda`` case draws (a CPU case never does; both come from
streams of their own, so the rest of a case's draw is the same on either device):

- Schedules (``--no-schedules`` turns them off): about half the cases run under one or two of
  the alternative schedules the CUDA backend picks from ``MOK_*`` environment variables
  (``SCHEDULES`` below: the entries of the test lists ALT_SCHEDULES / SPLIT_SCHEDULES in
  tests/test_cuda_backend.py, LOOPBACK_SCHEDULES in tests/test_cuda_loopback.py and
  FP8_SCHEDULES in tests/test_fp8_dispatch.py, each drawn only where its requirement holds:
  the speculative eager dispatch on eager Buffers with expert_alignment 1 and no step where
  only some ranks pass a receive budget, fill-first on eager Buffers, the copy staged beside
  the layout at world > 1 and never in a graph case, plain launches and small calls on num_sms
  at world 1, where loopback groups do not already do so, the 8-SM small-call budget where its
  routing kernels fit beside the transfers). They are
  set in ``os.environ`` for the whole case (every loopback rank is a thread of this process,
  so all make the same choice) and the previous values are put back afterwards, also when
  the case fails or times out. The case config records them (``schedule``: the entries' ids
  and the environment), the case line shows them, and ``schedule`` and
  ``schedule_<id>`` count as features.
- CUDA graphs (``--no-graphs``): about half the static-shape cases, and a quarter of the eager
  ones, end with a graph step on the same Buffer: new tokens per rank (each at most T_max),
  3..5 routings and inputs drawn for those token counts (max_recv_tokens raised, where needed,
  to the rows in every one of them of every rank without a budget), and as drawn an FP8 pair
  input (one kind for all of them) or a rows_per_expert that holds every one of them (not both;
  static-shape Buffers only), and a receive budget (never with rows_per_expert; on an eager
  Buffer always, on every rank: its call reads nothing on the host; on a static-shape one in 40%
  of the graph steps without rows_per_expert, on some ranks or all): one M per rank for every
  input, the captured call's argument, drawn against that rank's rows in the inputs so that
  some replays drop rows and some do not (its flag, rows received and num_rows_device come back
  from every replay). The dispatch + expert + combine of the first runs once outside the
  capture (compared too), is captured into one CUDA graph
  (one rank at a time, tests/harness.py ``capture_in_turn``, as tests/test_cuda_loopback.py
  does), then each other input is copied into the captured input tensors, the graph is
  replayed, and its outputs (dispatch rows, probs, counts, sources, combine output) are
  compared with the reference backend's eager run on that same input; ``check_errors`` after
  every replay. Features ``cuda_graph`` (and ``cuda_graph_fp8`` / ``cuda_graph_rows_per_expert``
  / ``cuda_graph_recv_budget`` / ``cuda_graph_eager_buffer``).
  On the CPU (tests only: a CPU draw has no graph) an eager stand-in runs the step at each
  "replay", which checks the fuzzer's own graph plumbing against the oracle.

Output: a case line each (seed, shape, receive budgets per step and rank, features, result), a
progress line every 10 cases, and ``DIR/fuzz.json`` (rewritten after every failure and at the
end): the arguments, the number of cases, per-feature case counts (``recv_budget``: cases with a
budget step; ``recv_budget_drop``: those where a rank received more rows than its budget; the
last line says both too), every failure (case seed, config, first mismatch, traceback) and the
elapsed time. Exit status 1 on any failure, 0 otherwise.

A case's draw depends on its seed, ``--max-world``, ``--max-tokens``, the device, the GPU's SM
count (num_sms is kept within what loopback ranks may take), ``MOK_CHUNK_TOKENS`` (ring sizes),
``--no-schedules`` and ``--no-graphs``: replay on the same kind of GPU with the same options
(each failure records the command).

Not covered: ranks as processes (NCCL, IPC, one GPU per rank; NVLink itself), the error paths
(bad expert ids, rows_per_expert or max_recv_tokens overflow, mismatched FP8 row sizes, input
validation), float8_e8m0fnu scales, NaN/inf token values (NaN payloads after a sum are not
specified), world sizes above --max-world, and calls larger than --max-tokens. Of the
schedules: ``MOK_CHUNK_TOKENS`` (the draw's ring sizes and routing-kernel bounds are counted
in its chunks: run the whole fuzzer with it set instead), ``MOK_PDL=1`` on shared-GPU groups
(not run forced by the tests either), ``MOK_FP8_PACK``, the role counts
(``MOK_DISPATCH_PRODUCERS`` / ``MOK_COMBINE_PRODUCERS``), ``MOK_LAYOUT_FUSED_MAX_GROUPS``, and
settings that differ between ranks. Of CUDA graphs: eager Buffers without a receive budget
(rows_per_expert graphs there), backward passes and cached dispatches in the graph, several
steps in one graph, replays with other token counts or another budget, FP8 with
rows_per_expert in a graph, and ``MOK_DISPATCH_CE_OVERLAP`` in a graph case (its side-stream
fork is not captured by any test). Of receive budgets: the refusals (with rows_per_expert or
``handle=``, not a multiple of the alignment), reading the flag on the host to rerun a step
(the caller's part), and, under ``MOK_EAGER_SPECULATIVE``, a step where some ranks pass a
budget and others do not (the speculative layout refuses such peers: not drawn).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import sys
import time
import traceback
from typing import Any, Dict, List, Optional

# Loopback ranks on a GPU need these before CUDA initialises (megatron_mok/loopback.py).
os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _p in (_ROOT, os.path.join(_ROOT, "tests")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import harness  # noqa: E402  (sets the no-multicast environment first)
import oracle  # noqa: E402
import torch  # noqa: E402

import megatron_mok as mok  # noqa: E402
from megatron_mok import fp8, loopback  # noqa: E402
from megatron_mok.cuda.backend import DEFAULT_CHUNK_TOKENS, ring_chunk_bytes  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# (hidden, weight): multiples of 8 (the CUDA backend's requirement), mostly small so a case
# stays fast; 7168 (DeepSeek-V3) rarely.
HIDDEN_CHOICES = [(8, 6), (16, 10), (24, 6), (40, 6), (64, 12), (72, 6), (128, 12), (136, 5),
                  (256, 10), (512, 6), (1024, 4), (2048, 2), (7168, 2)]
ROUTINGS = [("distinct", 35), ("duplicates", 20), ("skewed", 12), ("one_expert", 10),
            ("one_rank", 10), ("hot", 13)]
NUM_SMS_CHOICES = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 84]
CHUNK_BOUNDARIES = [63, 64, 65, 127, 128, 129, 191, 192, 193, 255, 256, 257]
NOMINAL_SMS = 132            # an H200; used for the draw where no GPU is asked about
# Features every test run should see both on and off (tests/test_fuzz_dispatch.py).
MAIN_FEATURES = ("world_1", "fp8", "fp8_byte_scales", "static_shape", "expert_alignment",
                 "rows_per_expert", "small_ring", "call_larger_than_ring", "num_sms_set",
                 "cached", "backward_autograd", "backward_by_hand", "cached_backward",
                 "nan_padding", "partial_fp32", "rank_with_zero_tokens", "unrouted_slots",
                 "duplicate_experts", "all_to_one_expert", "idx_int32", "dtype_bfloat16",
                 "dtype_float32", "t_max_exact", "recv_budget", "recv_budget_drop")
# Kinds of receive budget a test run should see at least once (case_features, _budget_features).
BUDGET_FEATURES = ("recv_budget_zero", "recv_budget_below", "recv_budget_exact", "recv_budget_above",
                   "recv_budget_mixed_ranks", "recv_budget_static", "recv_budget_past_max_recv",
                   "recv_budget_alignment", "recv_budget_fp8", "recv_budget_cached",
                   "recv_budget_backward")
# Features only a --device cuda case can have (shown on its case line too).
CUDA_FEATURES = ("schedule", "cuda_graph", "cuda_graph_recv_budget")

# Alternative schedules of the CUDA backend, chosen by MOK_* environment variables (read when a
# Buffer is made, megatron_mok/cuda/backend.py and launch_policy.py, or at each kernel launch,
# env_off in csrc/kernels): (id, environment, requirement). Only entries of the test lists
# (ids as there): ALT_SCHEDULES and SPLIT_SCHEDULES (tests/test_cuda_backend.py; the
# loopback runs of LOOPBACK_SCHEDULES, tests/test_cuda_loopback.py) and FP8_SCHEDULES
# (tests/test_fp8_dispatch.py, all of them in ALT_SCHEDULES too). Left out: chunk7_padded_slots
# (MOK_CHUNK_TOKENS: the draw counts ring sizes and routing-kernel bounds in its chunks; the
# tests run it on contract cases at one world size only). The requirement (see
# schedule_allowed) says where an entry is valid or does anything:
#   eager       an eager Buffer (no max_recv_tokens): the static dispatch ignores it
#   eager_a1    an eager Buffer with expert_alignment 1 (the speculative dispatch is turned off,
#               with a warning, by an alignment) and no step in which some ranks pass a receive
#               budget and others do not (a budget's call is not speculative, and the
#               speculative layout refuses peers that are not: kConfigMismatch)
#   multi_nograph  world > 1 (the backend ignores it at one rank) and no graph in the case
#               (the copy forked onto the side stream is not captured by any test)
#   world1      world 1: loopback groups of 2+ ranks already launch plainly
#   world1_auto world 1 and num_sms not given: the only Buffers with a small-call budget to drop
#   narrow      a combine of rows of one vector: hidden 8, or an FP8 case (its backward's
#               prob-gradient combine is 8 wide whatever the hidden size)
#   small8      an 8-SM small-call budget whose routing kernels fit beside every rank's
#               transfer kernels (loopback.LoopbackRank.check_layout_fits: the backend checks
#               that budget too, so a case drawn for fewer blocks could be refused)
SCHEDULES = [
    ("eager_stage_first", {"MOK_EAGER_STAGE_FIRST": "1"}, None),
    ("combine_role_split", {"MOK_COMBINE_PHASED": "0"}, None),
    ("combine_no_split", {"MOK_COMBINE_SPLIT": "0"}, None),
    ("eager_fill_first", {"MOK_EAGER_FILL_FIRST": "1"}, "eager"),
    ("eager_speculative", {"MOK_EAGER_SPECULATIVE": "1"}, "eager_a1"),
    ("combine_own_rows_direct", {"MOK_COMBINE_STREAM_OWN": "0"}, None),
    ("dispatch_release_per_task", {"MOK_DISPATCH_RELEASE_AT_END": "0"}, None),
    ("dispatch_sm_staging", {"MOK_DISPATCH_CE_STAGE": "0"}, None),
    ("combine_strided_tokens", {"MOK_COMBINE_TOKEN_RUNS": "0"}, None),
    ("dispatch_strided_tasks", {"MOK_DISPATCH_TASK_RUNS": "0"}, None),
    ("dispatch_ce_copy_beside_layout", {"MOK_DISPATCH_CE_OVERLAP": "1"}, "multi_nograph"),
    ("combine_release_per_token", {"MOK_COMBINE_RELEASE_AT_END": "0"}, None),
    ("combine_own_rows_in_consume", {"MOK_COMBINE_OWN_STAGED": "0"}, None),
    ("combine_own_rows_in_consume_release_per_token",
     {"MOK_COMBINE_OWN_STAGED": "0", "MOK_COMBINE_RELEASE_AT_END": "0"}, None),
    ("combine_strided_produce", {"MOK_COMBINE_PRODUCE_RUNS": "0"}, None),
    ("layout_three_kernels", {"MOK_LAYOUT_FUSED": "0"}, None),
    ("small_call_sms_mixed_ranks", {"MOK_SMALL_CALL_SMS": "8", "MOK_SMALL_CALL_TOKENS": "8"}, "small8"),
    ("small_call_sms_mixed_calls", {"MOK_SMALL_CALL_SMS": "8", "MOK_SMALL_CALL_TOKENS": "150"}, "small8"),
    ("plain_launches", {"MOK_PDL": "0"}, "world1"),
    ("small_calls_on_num_sms", {"MOK_SMALL_CALL_SMS": "0"}, "world1_auto"),
    ("dispatch_unsplit", {"MOK_DISPATCH_SPLIT": "0"}, None),          # SPLIT_SCHEDULES
    ("combine_narrow_off", {"MOK_COMBINE_NARROW": "0"}, "narrow"),    # NARROW_SCHEDULES
]
SCHEDULE_ENV = {sid: env for sid, env, _ in SCHEDULES}
# Entries whose requirement few cases meet are drawn more often where it holds (weight; else 1).
SCHEDULE_WEIGHT = {"eager_speculative": 3, "eager_fill_first": 2, "plain_launches": 2,
                   "small_calls_on_num_sms": 2, "dispatch_ce_copy_beside_layout": 2,
                   "combine_narrow_off": 2}
SCHEDULE_P = 0.5          # of --device cuda cases run under a schedule; of those, two settings:
TWO_SETTINGS_P = 0.35
GRAPH_P = 0.5             # of static-shape --device cuda cases that end with a graph step
GRAPH_EAGER_P = 0.25      # of eager --device cuda cases that end with one (a budget on every rank)
GRAPH_BUDGET_P = 0.4      # of static-shape graph steps without rows_per_expert that have a budget
# Receive budgets (dispatch(recv_budget=M)): of the steps without rows_per_expert, those that pass
# one; each rank's M against its own rows R (the rows it receives, alignment padding included):
# 0, below R (rows dropped), exactly R, above R, or no budget on that rank ("none", a peer that
# dispatches without one: only the receiver's rows depend on M).
BUDGET_P = 0.25
BUDGET_KINDS = [("zero", 10), ("below", 40), ("exact", 18), ("above", 22), ("none", 10)]
# A graph step's budget against its rank's rows in each of its inputs (one M for all of them,
# the captured call's argument): 0, within the inputs' fewest rows (every replay drops rows),
# between the fewest and the most (some do, some do not), the most (none does), above it.
GRAPH_BUDGET_KINDS = [("zero", 8), ("low", 22), ("mid", 40), ("most", 15), ("above", 15), ("none", 10)]


# ----------------------------------------------------------------------------- the draw
def _weighted(rng: random.Random, choices):
    return rng.choices([c for c, _ in choices], weights=[w for _, w in choices])[0]


def _mix(seed: int, *parts: int) -> int:
    """A generator seed from a seed and small ints (every rank/tensor its own stream)."""
    h = seed
    for p in parts:
        h = (h * 1000003 + p + 1) % (2 ** 61 - 1)
    return h


def chunk_tokens() -> int:
    """Rows per ring chunk of the CUDA backend (what the ring sizes below are counted in)."""
    return int(os.environ.get("MOK_CHUNK_TOKENS") or DEFAULT_CHUNK_TOKENS)


def _token_cap(hidden: int, max_tokens: int) -> int:
    """Fewer tokens for wide rows: a case stays well under a second or two."""
    if hidden <= 512:
        return max_tokens
    return min(max_tokens, 256 if hidden <= 2048 else 64)


def _layout_token_cap(world: int, blocks: int, device_sms: int, C: int) -> int:
    """The most tokens per rank whose routing kernels fit beside every rank's transfer kernel
    on one GPU (loopback.LoopbackRank.check_layout_fits): keeps large worlds valid."""
    room = (device_sms - world * blocks) * loopback.COUNT_BLOCKS_PER_SM
    return max(0, room // (world * world)) * C


def _draw_tokens(rng: random.Random, cap: int) -> int:
    r = rng.random()
    if r < 0.12 or cap == 0:
        return 0
    if r < 0.30:
        return rng.randint(1, min(9, cap))
    if r < 0.42:
        return min(cap, rng.choice(CHUNK_BOUNDARIES))
    if r < 0.50:
        return cap
    return rng.randint(1, cap)


def _fp8_choice(rng: random.Random, hidden: int, dtype: torch.dtype) -> Optional[Dict[str, Any]]:
    """An FP8 input whose packed row fits the Buffer's token row, or None if none does."""
    row = hidden * dtype.itemsize
    if rng.random() < 0.7:
        blocks = [b for b in (128, 64, 32, 16, 8) if hidden % b == 0
                  and fp8.packed_row_bytes(hidden, hidden // b, torch.float32) <= row]
        if blocks:
            return {"kind": "quantize", "block": rng.choice(blocks)}
    cols = [s for s in (1, 2, 3, max(1, hidden // 32)) if fp8.packed_row_bytes(hidden, s, torch.uint8) <= row]
    if not cols:
        return None
    return {"kind": "bytes", "scale_cols": rng.choice(cols),
            "fp8_dtype": rng.choice(["float8_e4m3fn", "float8_e5m2"])}


def _draw_step(rng: random.Random, cfg: dict, cap: int) -> dict:
    W, E = cfg["world_size"], cfg["num_experts"]
    return {
        "seed": rng.getrandbits(40),
        "tokens": [_draw_tokens(rng, cap) for _ in range(W)],
        "routing": _weighted(rng, ROUTINGS),
        "hot_expert": rng.randrange(E),
        "hot_rank": rng.randrange(W),
        "one_slot": rng.random() < 0.5,
        "unrouted": rng.choice([0.0] * 6 + [0.15, 0.5, 1.0]),
        "idx_dtype": "int32" if rng.random() < 0.2 else "int64",
        "values": _weighted(rng, [("normal", 70), ("int", 15), ("mixed", 15)]),
        "fp8": _fp8_choice(rng, cfg["hidden"], DTYPES[cfg["dtype"]]) if rng.random() < 0.25 else None,
        "rows_extra": [rng.choice([0, 0, 1, 3, 17]) for _ in range(W)] if rng.random() < 0.25 else None,
        "cached": rng.random() < 0.4,
        "grad": _weighted(rng, [("none", 45), ("autograd", 30), ("by_hand", 25)]),
        "nan_padding": rng.random() < 0.3,
    }


def draw_config(case_seed: int, max_world: int = 4, device_sms: int = NOMINAL_SMS,
                max_tokens: int = 600, device: str = "cpu", schedules: bool = True,
                graphs: bool = True) -> dict:
    """One case's configuration (JSON-serialisable), valid by construction: everything the
    Buffer and the loopback group would refuse is excluded here, not caught later. For
    ``device="cuda"`` also, as ``schedules`` / ``graphs`` allow, a graph step (``graph``) and
    MOK_* settings (``schedule``), each from a stream of its own: the rest of the draw is the
    same on either device (a graph step may raise ``max_recv_tokens``)."""
    rng = random.Random(case_seed)
    C = chunk_tokens()
    W = rng.randint(1, max_world)
    el = rng.randint(1, 8)
    E = W * el
    K = rng.randint(1, min(8, E))
    if E > 8 and rng.random() < 0.05:      # more slots than the kernels keep in registers
        K = rng.randint(9, min(16, E))
    hidden = _weighted(rng, HIDDEN_CHOICES)
    dtype = _weighted(rng, [("bfloat16", 55), ("float32", 30), ("float16", 15)])
    # Loopback ranks share one GPU: an explicit num_sms must fit (LoopbackRank.max_sms_per_rank).
    most = max(1, (device_sms - loopback.SPARE_SMS) // W)
    num_sms = None if rng.random() < 0.4 else min(rng.choice(NUM_SMS_CHOICES), most)
    # Transfer blocks per rank: num_sms, or the defaults (24; 64 for a rank alone on the GPU,
    # launch_policy's small-call budget), within that share.
    blocks = max(2, min(num_sms or (64 if W == 1 else 24), most))
    cap = min(_token_cap(hidden, max_tokens), _layout_token_cap(W, blocks, device_sms, C))
    cfg = {
        "case_seed": case_seed, "world_size": W, "num_experts": E, "topk": K, "hidden": hidden,
        "dtype": dtype, "partial_fp32": rng.random() < 0.3, "num_sms": num_sms,
        "expert_alignment": _weighted(rng, [(1, 55), (8, 15), (16, 15), (2, 4), (3, 4), (32, 4), (128, 3)]),
    }
    cfg["steps"] = [_draw_step(rng, cfg, cap) for _ in range(rng.randint(2, 4))]
    most_tokens = max(max(st["tokens"]) for st in cfg["steps"])
    slack = rng.choice([0, 0, 1, rng.randint(2, 200)])
    cfg["max_tokens_per_rank"] = min(cap, most_tokens + slack)
    cfg["ring_chunks"], cfg["ring_bytes"] = _draw_ring(rng, cfg, C)
    _derive_capacities(rng, cfg, random.Random(_mix(case_seed, 7003)))
    cfg["graph"] = cfg["schedule"] = None
    if device == "cuda":
        if graphs:
            cfg["graph"] = _draw_graph(random.Random(_mix(case_seed, 7001)), cfg,
                                       random.Random(_mix(case_seed, 7004)))
        if schedules:
            cfg["schedule"] = _draw_schedule(random.Random(_mix(case_seed, 7002)), cfg, device_sms)
    return cfg


def _draw_ring(rng: random.Random, cfg: dict, C: int):
    """``(chunks, ring_bytes)``: the default ring (None), or one of a few chunks, or exactly one
    call's chunks, or one fewer (a call then no longer fits and goes round the ring)."""
    if rng.random() < 0.45:
        return None, None
    fit = -(-cfg["max_tokens_per_rank"] // C)
    chunks = max(1, rng.choice([1, 2, 3, 4, fit, fit - 1]))
    elem = DTYPES[cfg["dtype"]].itemsize
    pelem = 4 if cfg["partial_fp32"] else elem
    return chunks, chunks * max(ring_chunk_bytes(C, cfg["hidden"], cfg["topk"], elem, pelem))


def _derive_capacities(rng: random.Random, cfg: dict, budget_rng: Optional[random.Random] = None) -> None:
    """rows_per_expert (per step and rank: at or above its fullest expert, a multiple of the
    alignment), the receive budgets (``recv_budget``, per step and rank, from ``budget_rng``, a
    stream of its own so the rest of the draw is what it was without budgets; None: no budget
    anywhere) and max_recv_tokens (at or above every rank's R in every step, except where
    that rank passes a budget, which replaces max_recv_tokens for its call), from the routing
    the steps will use."""
    A, W = cfg["expert_alignment"], cfg["world_size"]
    el = cfg["num_experts"] // W
    most_rows = 0
    for i, st in enumerate(cfg["steps"]):
        counts = expert_counts(cfg, i)                    # [W, E_local]
        if st["rows_extra"] is not None:
            st["rows_per_expert"] = [_round_up(int(counts[d].max()) + st["rows_extra"][d], A)
                                     for d in range(W)]
            rows = [el * n for n in st["rows_per_expert"]]
        else:
            st["rows_per_expert"] = None
            rows = [sum(_round_up(int(c), A) for c in counts[d]) for d in range(W)]
        st["recv_budget"] = None
        if budget_rng is not None and st["rows_per_expert"] is None and budget_rng.random() < BUDGET_P:
            budgets = [_draw_budget(budget_rng, rows[d], A) for d in range(W)]
            st["recv_budget"] = None if all(m is None for m in budgets) else budgets
        ms = step_budgets(cfg, st)
        most_rows = max([most_rows] + [rows[d] for d in range(W) if ms[d] is None])
    static = rng.random() < 0.3
    cfg["max_recv_tokens"] = most_rows + rng.choice([0, 1, 5, 100]) if static else None


def _round_up(n: int, a: int) -> int:
    return -(-n // a) * a


def _draw_budget(rng: random.Random, rows: int, A: int, allow_none: bool = True) -> Optional[int]:
    """A receive budget for a rank that receives ``rows`` rows (a multiple of ``A``, as every
    budget is): BUDGET_KINDS."""
    kind = _weighted(rng, [kw for kw in BUDGET_KINDS if allow_none or kw[0] != "none"])
    if kind == "zero":
        return 0
    if kind == "below":
        return A * rng.randint(0, (rows - 1) // A) if rows > 0 else 0
    if kind == "exact":
        return rows
    if kind == "above":
        return rows + _round_up(rng.choice([1, 1, 2, 5, rng.randint(1, 300)]), A)
    return None


def _draw_graph_budget(rng: random.Random, rows: List[int], A: int, allow_none: bool) -> Optional[int]:
    """A graph step's budget for a rank whose rows in the step's inputs are ``rows``
    (GRAPH_BUDGET_KINDS)."""
    kind = _weighted(rng, [kw for kw in GRAPH_BUDGET_KINDS if allow_none or kw[0] != "none"])
    lo, hi = min(rows), max(rows)
    if kind == "zero":
        return 0
    if kind == "low":
        return A * rng.randint(0, max(0, lo - 1) // A)
    if kind == "mid":
        return A * rng.randint(lo // A, hi // A)
    if kind == "most":
        return hi
    if kind == "above":
        return hi + _round_up(rng.choice([1, 2, rng.randint(1, 100)]), A)
    return None


def step_budgets(cfg: dict, st: dict) -> List[Optional[int]]:
    """Every rank's ``recv_budget`` in step (or graph input) ``st`` (None: that rank passes none)."""
    return list(st.get("recv_budget") or [None] * cfg["world_size"])


def _kept_counts(padded: List[int], budget: int) -> List[int]:
    """Each local expert's rows among the first ``budget`` rows of a layout whose experts have
    ``padded`` rows each (alignment padding included): a budget's ``tokens_per_expert``."""
    out, start = [], 0
    for n in padded:
        out.append(max(0, min(start + n, budget) - start))
        start += n
    return out


def budget_expectations(cfg: dict, st: dict) -> List[Optional[Dict[str, Any]]]:
    """What a budget's invariants say each rank of step (or graph input) ``st`` gets, from the
    draw alone (no backend, no oracle): ``{"R", "M", "tokens_per_expert"}`` for a rank with
    a budget (R: the rows it receives, padding included; never with rows_per_expert), None for
    a rank without one."""
    ms = step_budgets(cfg, st)
    if all(m is None for m in ms):
        return [None] * cfg["world_size"]
    A = cfg["expert_alignment"]
    counts = _expert_counts(cfg, st)
    out = []
    for d, M in enumerate(ms):
        if M is None:
            out.append(None)
            continue
        padded = [_round_up(int(c), A) for c in counts[d]]
        out.append({"R": sum(padded), "M": M, "tokens_per_expert": _kept_counts(padded, M)})
    return out


def mixed_budget(cfg: dict) -> bool:
    """Whether a step (or the graph step) has ranks with and without a budget (an eager Buffer
    then mixes static-path and eager calls across ranks: not with MOK_EAGER_SPECULATIVE, whose
    layout refuses peers that are not speculative, kConfigMismatch)."""
    sts = list(cfg["steps"]) + graph_steps(cfg)[:1]
    return any(len({m is None for m in step_budgets(cfg, st)}) > 1 for st in sts)


def _rows_of(cfg: dict, st: dict) -> List[int]:
    """Rows every rank receives in step (or graph input) ``st``: E_local x rows_per_expert, or
    its experts' counts each rounded up to the alignment."""
    A, W = cfg["expert_alignment"], cfg["world_size"]
    if st["rows_per_expert"] is not None:
        return [cfg["num_experts"] // W * n for n in st["rows_per_expert"]]
    counts = _expert_counts(cfg, st)
    return [sum(_round_up(int(c), A) for c in counts[d]) for d in range(W)]


# ------------------------------------------------------------------ the graph step (cuda)
# What the inputs of a graph step share (the captured call's shapes and arguments) and what
# each draws anew (routing, values).
GRAPH_SHARED = ("tokens", "idx_dtype", "fp8", "rows_per_expert", "recv_budget", "nan_padding", "expert_seed")


def _draw_graph(rng: random.Random, cfg: dict, budget_rng: random.Random) -> Optional[dict]:
    """A graph step (else None) for a static-shape case, or, less often, for an eager one with
    a receive budget on every rank (the budget's call reads nothing on the host: capturable on
    any Buffer): token counts (at most T_max), the input kind, and 3..5 inputs of those shapes
    (the first for the warm-up call and the capture, the others replayed). ``rows_per_expert``
    (only without FP8, only on a static-shape Buffer) holds every input's fullest expert;
    ``recv_budget`` (never with rows_per_expert; from ``budget_rng``) is one M per rank for all
    the inputs, so some replays drop rows and some do not; ``max_recv_tokens`` is raised to the
    rows in every input of every rank without a budget."""
    static = cfg["max_recv_tokens"] is not None
    if static and rng.random() >= GRAPH_P:
        return None
    if not static and budget_rng.random() >= GRAPH_EAGER_P:
        return None
    W, E, A = cfg["world_size"], cfg["num_experts"], cfg["expert_alignment"]
    T_max = cfg["max_tokens_per_rank"]
    g = {"tokens": [_draw_tokens(rng, T_max) for _ in range(W)],
         "idx_dtype": "int32" if rng.random() < 0.2 else "int64",
         "fp8": _fp8_choice(rng, cfg["hidden"], DTYPES[cfg["dtype"]]) if rng.random() < 0.25 else None,
         "rows_per_expert": None, "recv_budget": None, "nan_padding": rng.random() < 0.5,
         "expert_seed": rng.getrandbits(40)}
    fixed = g["fp8"] is None and rng.random() < 0.3 and static
    g["replays"] = [{"seed": rng.getrandbits(40), "routing": _weighted(rng, ROUTINGS),
                     "hot_expert": rng.randrange(E), "hot_rank": rng.randrange(W),
                     "one_slot": rng.random() < 0.5,
                     "unrouted": rng.choice([0.0] * 6 + [0.15, 0.5, 1.0]),
                     "values": _weighted(rng, [("normal", 70), ("int", 15), ("mixed", 15)])}
                    for _ in range(rng.randint(3, 5))]
    cfg["graph"] = g
    if fixed:
        counts = [_expert_counts(cfg, st) for st in graph_steps(cfg)]
        g["rows_per_expert"] = [_round_up(max(int(c[d].max()) for c in counts) + rng.choice([0, 0, 1, 3, 17]), A)
                                for d in range(W)]
    rows = [_rows_of(cfg, st) for st in graph_steps(cfg)]          # [input][rank]
    if not fixed and (not static or budget_rng.random() < GRAPH_BUDGET_P):
        budgets = [_draw_graph_budget(budget_rng, [r[d] for r in rows], A, allow_none=static)
                   for d in range(W)]
        g["recv_budget"] = None if all(m is None for m in budgets) else budgets
    if static:
        ms = step_budgets(cfg, g)
        most = max([0] + [r[d] for r in rows for d in range(W) if ms[d] is None])
        cfg["max_recv_tokens"] = max(cfg["max_recv_tokens"], most + rng.choice([0, 0, 1, 5]))
    return g


def graph_steps(cfg: dict) -> List[dict]:
    """The graph step's inputs as step dicts (the step functions' arguments): what they share,
    then each one's routing and values; no backward, no cached dispatch."""
    g = cfg.get("graph")
    if not g:
        return []
    shared = {k: (list(g[k]) if isinstance(g[k], list) else g[k]) for k in GRAPH_SHARED if k in g}
    return [dict(r, **shared, rows_extra=None, cached=False, grad="none") for r in g["replays"]]


# -------------------------------------------------------------------- schedules (cuda)
def _small_call_fits(cfg: dict, device_sms: int, small_sms: int) -> bool:
    """Whether a small-call budget of ``small_sms`` SMs passes the loopback layout check (the
    backend runs check_layout_fits for it too, with the blocks it gets: at most a rank's share)."""
    W = cfg["world_size"]
    most = max(1, (device_sms - loopback.SPARE_SMS) // W)
    blocks = max(2, min(small_sms, most))
    return cfg["max_tokens_per_rank"] <= _layout_token_cap(W, blocks, device_sms, chunk_tokens())


def schedule_allowed(sid: str, cfg: dict, device_sms: int = NOMINAL_SMS) -> bool:
    """Whether SCHEDULES entry ``sid`` may be drawn for ``cfg`` (its requirement, see SCHEDULES)."""
    need = {s: r for s, _, r in SCHEDULES}[sid]
    W, static = cfg["world_size"], cfg["max_recv_tokens"] is not None
    if need is None:
        return True
    if need == "eager":
        return not static
    if need == "eager_a1":
        return not static and cfg["expert_alignment"] == 1 and not mixed_budget(cfg)
    if need == "multi_nograph":
        return W > 1 and not cfg.get("graph")
    if need == "world1":
        return W == 1
    if need == "world1_auto":
        return W == 1 and cfg["num_sms"] is None
    if need == "narrow":
        return cfg["hidden"] == 8 or cfg.get("fp8") is not None
    if need == "small8":
        return _small_call_fits(cfg, device_sms, 8)
    raise ValueError(f"unknown schedule requirement {need!r}")


def _draw_schedule(rng: random.Random, cfg: dict, device_sms: int) -> Optional[dict]:
    """None, or one or two SCHEDULES entries allowed for ``cfg`` (two: no variable in common):
    ``{"ids": [...], "env": {variable: value}}``."""
    if rng.random() >= SCHEDULE_P:
        return None

    def pick(ids):
        return rng.choices(ids, weights=[SCHEDULE_WEIGHT.get(sid, 1) for sid in ids])[0]

    allowed = [sid for sid, _, _ in SCHEDULES if schedule_allowed(sid, cfg, device_sms)]
    ids = [pick(allowed)]
    if rng.random() < TWO_SETTINGS_P:
        more = [sid for sid in allowed if not set(SCHEDULE_ENV[sid]) & set(SCHEDULE_ENV[ids[0]])]
        if more:
            ids.append(pick(more))
    env: Dict[str, str] = {}
    for sid in ids:
        env.update(SCHEDULE_ENV[sid])
    return {"ids": ids, "env": dict(sorted(env.items()))}


@contextlib.contextmanager
def case_environment(cfg: dict, device: str):
    """The case's MOK_* settings in ``os.environ`` (a ``--device cuda`` case only: they are
    the CUDA backend's) while it runs, the previous environment put back afterwards, also when
    the case raises. Process-wide: every loopback rank is a thread of this process."""
    env = ((cfg.get("schedule") or {}).get("env") or {}) if device == "cuda" else {}
    saved = {k: os.environ.get(k) for k in env}
    try:
        os.environ.update(env)
        yield env
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# --------------------------------------------------------------------------------- inputs
def step_routing(cfg: dict, i: int, rank: int) -> torch.Tensor:
    """``topk_idx [T, K]`` of rank ``rank`` in step ``i`` (the same on every caller)."""
    return _routing(cfg, cfg["steps"][i], rank)


def _routing(cfg: dict, st: dict, rank: int) -> torch.Tensor:
    """``topk_idx [T, K]`` of rank ``rank`` in step (or graph input) ``st``."""
    T, E, K, W = st["tokens"][rank], cfg["num_experts"], cfg["topk"], cfg["world_size"]
    g = torch.Generator().manual_seed(_mix(st["seed"], rank, 1))
    style = st["routing"]
    if style == "distinct":
        idx = torch.rand(T, E, generator=g).argsort(dim=1)[:, :K]
    elif style == "skewed":       # distinct, from the lowest ids only: most experts get nothing
        idx = torch.rand(T, min(E, K + 1), generator=g).argsort(dim=1)[:, :K]
    elif style == "duplicates":
        idx = torch.randint(0, E, (T, K), generator=g)
    elif style == "one_expert":
        idx = torch.full((T, K), st["hot_expert"], dtype=torch.int64)
        if st["one_slot"]:
            idx[:, 1:] = -1
    elif style == "one_rank":
        el = E // W
        idx = st["hot_rank"] * el + torch.randint(0, el, (T, K), generator=g)
    else:  # "hot": most slots to one expert, duplicates included
        hot = torch.full((T, K), st["hot_expert"], dtype=torch.int64)
        idx = torch.where(torch.rand(T, K, generator=g) < 0.7, hot, torch.randint(0, E, (T, K), generator=g))
    if st["unrouted"] > 0:
        drop = torch.rand(T, K, generator=g) < st["unrouted"]
        idx = torch.where(drop, torch.full_like(idx, -1), idx)
    return idx.to(getattr(torch, st["idx_dtype"])).contiguous()


def expert_counts(cfg: dict, i: int) -> torch.Tensor:
    """``[W, E_local]``: rows each rank's local experts get in step ``i``."""
    return _expert_counts(cfg, cfg["steps"][i])


def _expert_counts(cfg: dict, st: dict) -> torch.Tensor:
    W, E = cfg["world_size"], cfg["num_experts"]
    ids = torch.cat([_routing(cfg, st, s).to(torch.int64).flatten() for s in range(W)])
    return torch.bincount(ids[ids >= 0], minlength=E).view(W, E // W)


def _values(kind: str, T: int, H: int, g: torch.Generator) -> torch.Tensor:
    if kind == "int":                  # multiples of 1/8: sums exact in every dtype
        return torch.randint(-16, 17, (T, H), generator=g).float() / 8
    x = torch.randn(T, H, generator=g)
    if kind == "mixed":                # magnitudes 2^-12..2^12 and signed zeros
        x = x * torch.pow(2.0, torch.randint(-12, 13, (T, 1), generator=g).float())
        x = torch.where(torch.rand(T, H, generator=g) < 0.05, torch.full_like(x, -0.0), x)
    return x


def _fp8_pair(spec: dict, x: torch.Tensor, g: torch.Generator):
    if spec["kind"] == "quantize":
        return fp8.quantize(x, spec["block"])
    T, H = x.shape
    q = torch.randint(0, 256, (T, H), generator=g).to(torch.uint8).view(getattr(torch, spec["fp8_dtype"]))
    s = torch.randint(0, 256, (T, spec["scale_cols"]), generator=g).to(torch.uint8)
    return q, s


def step_inputs(cfg: dict, i: int) -> List[Dict[str, Any]]:
    """Every rank's CPU tensors for step ``i``: x, idx, w, and as the step needs them the FP8
    pair, the cached dispatch's input (x2 / pair2) and the upstream gradient gy."""
    return _inputs(cfg, cfg["steps"][i])


def _inputs(cfg: dict, st: dict) -> List[Dict[str, Any]]:
    H, K, dtype = cfg["hidden"], cfg["topk"], DTYPES[cfg["dtype"]]
    out = []
    for s, T in enumerate(st["tokens"]):
        g = torch.Generator().manual_seed(_mix(st["seed"], s, 2))
        d = {"x": _values(st["values"], T, H, g).to(dtype).contiguous(),
             "idx": _routing(cfg, st, s),
             "w": (torch.rand(T, K, generator=g) * 0.95 + 0.05).contiguous()}
        if st["fp8"]:
            d["pair"] = _fp8_pair(st["fp8"], d["x"], g)
        if st["cached"]:
            d["x2"] = _values(st["values"], T, H, g).to(dtype).contiguous()
            if st["fp8"]:
                d["pair2"] = _fp8_pair(st["fp8"], d["x2"], g)
        if st["grad"] != "none":
            d["gy"] = torch.randn(T, H, generator=g)
        out.append(d)
    return out


def cached_grad(st: dict, rank: int, rows: int, hidden: int, device) -> torch.Tensor:
    """The upstream gradient of a cached dispatch's rows (float32 ``[rows, hidden]``), drawn on
    ``device``: its row count is known only after the dispatch, and a host-to-device copy
    then could wait behind this rank's communication kernels (loopback.settle). Both backends
    of a GPU run draw it on the GPU; the CPU run and its oracle on the CPU."""
    g = torch.Generator(device=device).manual_seed(_mix(st["seed"], rank, 3))
    return torch.randn(rows, hidden, generator=g, device=device)


# ------------------------------------------------------------------------ the local expert
def expert_seed(st: dict) -> int:
    """The local expert's seed in a step: its own, or the graph step's (one for all its inputs:
    the captured expert is the same at every replay)."""
    return st.get("expert_seed", st["seed"]) % 1000


def dense_rows(tokens, is_fp8: bool, dtype: torch.dtype) -> torch.Tensor:
    """The expert's input: the token rows, or for FP8 rows a finite function of their bytes
    (raw FP8 bytes may be NaN; NaN in a sum would compare payloads, not the dispatch)."""
    if not is_fp8:
        return tokens
    return ((tokens[0].view(torch.uint8).float() - 128) / 16).to(dtype)


def expert(src_rank, src_token, dense, probs, seed: int, dtype, nan_padding: bool) -> torch.Tensor:
    """Each row times its prob and a factor of its source (not its position, so any two
    layouts compute the same row), in float32, rounded to ``dtype``; NaN in the padding rows
    when asked (combine must never read them)."""
    key = (src_rank * 131 + src_token * 7 + seed) % 17
    scale = (1.0 + key.to(torch.float32) / 32).view(-1, 1)
    eo = (dense.float() * scale * probs[:, None]).to(dtype)
    if nan_padding:
        eo = torch.where((src_rank < 0).view(-1, 1), torch.full_like(eo, float("nan")), eo)
    return eo.contiguous()


# --------------------------------------------------------------------------- one rank
def make_buffer(cfg: dict, backend: str, device, timeout_s: float):
    return mok.Buffer(None, num_experts=cfg["num_experts"], hidden=cfg["hidden"], topk=cfg["topk"],
                      max_tokens_per_rank=cfg["max_tokens_per_rank"], dtype=DTYPES[cfg["dtype"]],
                      backend=backend, combine_partial_dtype=torch.float32 if cfg["partial_fp32"] else None,
                      max_recv_tokens=cfg["max_recv_tokens"], num_sms=cfg["num_sms"],
                      ring_bytes=cfg["ring_bytes"], timeout_s=timeout_s, device=device,
                      expert_alignment=cfg["expert_alignment"])


def _row_fields(tokens, is_fp8: bool, prefix: str) -> Dict[str, torch.Tensor]:
    """Dispatched rows as comparable tensors: the rows, or an FP8 pair's bytes."""
    if not is_fp8:
        return {prefix + "tokens": tokens}
    return {prefix + "fp8_bytes": tokens[0].contiguous().view(torch.uint8),
            prefix + "scale_bytes": tokens[1].contiguous().view(torch.uint8)}


def run_step(buf, cfg: dict, st: dict, data: Dict[str, Any], rank: int, grad: str) -> Dict[str, Any]:
    """One step on one rank: dispatch, expert, combine, then as drawn the backward (``grad``:
    "none", "autograd" or "by_hand") and a cached dispatch. Returns every output (device)."""
    dtype, is_fp8 = buf.dtype, st["fp8"] is not None
    n = st["rows_per_expert"][rank] if st["rows_per_expert"] else None
    budget = step_budgets(cfg, st)[rank]
    x, w = data["pair"] if is_fp8 else data["x"], data["w"]
    if grad == "autograd":
        x = x if is_fp8 else x.clone().requires_grad_(True)
        w = w.clone().requires_grad_(True)
    res = buf.dispatch(x, data["idx"], w, rows_per_expert=n, recv_budget=budget)
    out = dict(_row_fields(res.tokens, is_fp8, ""), probs=res.probs,
               tokens_per_expert=res.tokens_per_expert, src_rank=res.src_rank, src_token=res.src_token)
    out.update(_budget_fields(res, budget))
    dense, probs = dense_rows(res.tokens, is_fp8, dtype), res.probs
    if grad == "by_hand":           # leaves of the local expert's graph
        probs = probs.detach().requires_grad_(True)
        dense = dense if is_fp8 else dense.detach().requires_grad_(True)
    with torch.set_grad_enabled(grad != "none"):
        eo = expert(res.src_rank, res.src_token, dense, probs, expert_seed(st), dtype, st["nan_padding"])
    if grad == "autograd":
        eo.retain_grad()
        out["y"] = buf.combine(eo, res.handle)
        (out["y"].float() * data["gy"]).sum().backward()
        out.update(grad_w=w.grad, grad_eo=eo.grad)
        if not is_fp8:
            out["grad_x"] = x.grad
    elif grad == "by_hand":
        out.update(_backward_by_hand(buf, res, eo, dense, probs, data, is_fp8))
    else:
        out["y"] = buf.combine(eo, res.handle)
    if st["cached"]:
        out.update(_cached_step(buf, st, data, res.handle, rank, grad, is_fp8))
    return out


def _budget_fields(res, budget: Optional[int]) -> Dict[str, torch.Tensor]:
    """A budget's device outputs: ``over_budget`` (also ``res.over_budget``), ``rows_received``
    and ``num_rows_device``. Without a budget none (the first two must then be None: one that is
    not is recorded, and is a field the expectation lacks). One that is missing where a budget
    was passed is left out (budget_problems reports it)."""
    h = res.handle
    fields = {"over_budget": res.over_budget, "rows_received": h.rows_received}
    if budget is not None:
        fields["num_rows_device"] = h.num_rows_device
        if res.over_budget is not h.over_budget:
            fields["over_budget_of_result"] = res.over_budget
    return {k: v for k, v in fields.items() if v is not None}


def _backward_by_hand(buf, res, eo, dense, probs, data, is_fp8: bool) -> Dict[str, Any]:
    """The contract's chain rule: combine's backward is a cached dispatch of grad_y; dispatch's
    a combine of the row gradients carrying the prob gradients (for FP8 rows: the prob
    gradients only). Only the local expert goes through autograd."""
    backend = buf._backend_for(data["w"])
    y = buf.combine(eo.detach(), res.handle)
    grad_eo = buf.dispatch(data["gy"].to(buf.dtype), handle=res.handle).tokens
    if is_fp8:
        (grad_probs,) = torch.autograd.grad(eo, (probs,), grad_eo)
        return dict(y=y, grad_eo=grad_eo,
                    grad_w=backend.combine_prob_grads(res.handle, grad_probs.contiguous()))
    grad_tokens, grad_probs = torch.autograd.grad(eo, (dense, probs), grad_eo)
    grad_x, grad_w = backend.combine(grad_tokens.contiguous(), res.handle, grad_probs=grad_probs.contiguous())
    return dict(y=y, grad_eo=grad_eo, grad_w=grad_w, grad_x=grad_x)


def _cached_step(buf, st, data, handle, rank: int, grad: str, is_fp8: bool) -> Dict[str, Any]:
    """A cached dispatch of new inputs along ``handle``; with a backward (token input only)
    the gradient of its input, through autograd or as the combine the contract says it is."""
    x2 = data["pair2"] if is_fp8 else data["x2"]
    if grad == "autograd" and not is_fp8:
        x2 = x2.clone().requires_grad_(True)
    res2 = buf.dispatch(x2, handle=handle)
    out = _row_fields(res2.tokens, is_fp8, "cached_")
    if grad == "none" or is_fp8:
        return out
    g2 = cached_grad(st, rank, res2.tokens.shape[0], buf.hidden, res2.tokens.device)
    if grad == "autograd":
        (res2.tokens.float() * g2).sum().backward()
        out["grad_cached_x"] = x2.grad
    else:
        out["grad_cached_x"] = buf._backend_for(data["w"]).combine(g2.to(buf.dtype).contiguous(), handle)[0]
    return out


def _on_cpu(out: Dict[str, Any], device: torch.device) -> Dict[str, torch.Tensor]:
    loopback.settle(device)      # loopback rule: wait for this rank's stream before host reads
    return {k: v.detach().cpu().clone() for k, v in out.items()}


def _to_device(data: Dict[str, Any], device) -> Dict[str, Any]:
    return {k: (tuple(t.to(device) for t in v) if isinstance(v, tuple) else v.to(device))
            for k, v in data.items()}


def rank_main(rank: int, world_size: int, cfg: dict, inputs: List[List[dict]], backends: Dict[str, str],
              kernel_timeout_s: float, graph_inputs: Optional[List[List[dict]]] = None
              ) -> Dict[str, List[Dict[str, torch.Tensor]]]:
    """Every step on one loopback rank, on one Buffer per backend (``{"test": name, "ref":
    name}``), the Buffers living through all steps, then the graph step's inputs (if any;
    ``graph_inputs``, see :func:`run_graph_step`), whose results follow the steps'. The
    reference's backward on a GPU is always written out by hand (loopback.py: autograd's
    device thread is shared)."""
    device = loopback.current().hub.device
    # Every input on the device before any kernel runs: no host copy behind communication.
    on_device = [_to_device(step[rank], device) for step in inputs]
    graph_on_device = [_to_device(g[rank], device) for g in graph_inputs or []]
    bufs: Dict[str, Any] = {}
    results: Dict[str, List[Dict[str, torch.Tensor]]] = {role: [] for role in backends}
    try:
        for role, name in backends.items():
            bufs[role] = make_buffer(cfg, name, device, kernel_timeout_s)
        for st, data in zip(cfg["steps"], on_device):
            for role, buf in bufs.items():
                grad = st["grad"]
                if device.type == "cuda" and buf.requested_backend == "reference" and grad == "autograd":
                    grad = "by_hand"
                results[role].append(_on_cpu(run_step(buf, cfg, st, data, rank, grad), device))
        if graph_on_device:
            for role, outs in run_graph_step(bufs, cfg, graph_on_device, rank, world_size, device).items():
                results[role] += outs
        for buf in bufs.values():
            buf.check_errors()       # static-shape errors surface here, not at a host read
    finally:
        for buf in bufs.values():
            buf.destroy()
    return results


# ------------------------------------------------------------------------ the graph step
class _CudaGraph:
    """One CUDA graph: :meth:`capture` records ``fn()`` (returning its outputs, which every
    :meth:`replay` rewrites in place)."""

    def __init__(self):
        self.graph = torch.cuda.CUDAGraph()

    def capture(self, fn):
        with torch.cuda.graph(self.graph):
            return fn()

    def replay(self) -> None:
        self.graph.replay()


class _EagerStandIn:
    """The CPU stand-in of :class:`_CudaGraph` (tests of the fuzzer's graph plumbing; a CPU
    draw has no graph step): :meth:`capture` runs nothing and returns a dict that every
    :meth:`replay` fills with ``fn()``'s outputs on the current inputs."""

    def capture(self, fn):
        self.fn, self.outs = fn, {}
        return self.outs

    def replay(self) -> None:
        self.outs.update(self.fn())


def _static_like(data: Dict[str, Any]) -> Dict[str, Any]:
    """Fresh contiguous tensors of ``data``'s shapes and dtypes (the captured inputs)."""
    def like(t):
        return torch.empty(tuple(t.shape), dtype=t.dtype, device=t.device)
    return {k: (tuple(like(t) for t in v) if isinstance(v, tuple) else like(v)) for k, v in data.items()}


def _load(static: Dict[str, Any], data: Dict[str, Any]) -> None:
    """Copy ``data`` into the captured inputs (on this rank's stream; FP8 tensors as bytes)."""
    for k, dst in static.items():
        pairs = zip(dst, data[k]) if isinstance(dst, tuple) else ((dst, data[k]),)
        for d, src in pairs:
            if d.numel() == 0:
                continue
            if d.element_size() == 1:
                d.view(torch.uint8).copy_(src.view(torch.uint8))
            else:
                d.copy_(src)


def run_graph_step(bufs: Dict[str, Any], cfg: dict, graph_data: List[Dict[str, Any]], rank: int,
                   world_size: int, device: torch.device) -> Dict[str, List[Dict[str, torch.Tensor]]]:
    """The graph step on one rank (tests/test_cuda_backend.py ``_graph`` and
    tests/test_fp8_dispatch.py ``fp8_graph`` are the model). The backends not under test (the
    reference) run every input eagerly first, before any rank captures. The backend under
    test: the captured input tensors get the first input; one eager dispatch + expert +
    combine on them (the warm-up, outside the capture; its outputs are the first result);
    every rank captures that call in turn (harness.capture_in_turn: one rank at a time, none
    replays before all have captured); then each further input is copied into the captured
    tensors, the graph replayed, this rank's stream synchronised and ``check_errors`` called,
    and the captured outputs are that input's result. Returns ``{role: [result per input]}``."""
    steps = graph_steps(cfg)
    on_gpu = device.type == "cuda"
    results: Dict[str, List[Dict[str, torch.Tensor]]] = {role: [] for role in bufs}
    for role, buf in bufs.items():
        if role != "test":
            for st, data in zip(steps, graph_data):
                results[role].append(_on_cpu(run_step(buf, cfg, st, data, rank, "none"), device))
    buf, st0 = bufs["test"], steps[0]
    static = _static_like(graph_data[0])
    _load(static, graph_data[0])
    results["test"].append(_on_cpu(run_step(buf, cfg, st0, static, rank, "none"), device))
    if on_gpu:
        harness.sync_device()
    graph = _CudaGraph() if on_gpu else _EagerStandIn()
    outs = harness.capture_in_turn(rank, world_size,
                                   lambda: graph.capture(lambda: run_step(buf, cfg, st0, static, rank, "none")))
    for data in graph_data[1:]:
        _load(static, data)
        graph.replay()
        if on_gpu:
            harness.sync_device()
        buf.check_errors()
        results["test"].append(_on_cpu(outs, device))
    return results


# ------------------------------------------------------------------------------ the oracle
def _place(rows: torch.Tensor, pos: torch.Tensor, out_rows: int, fill) -> torch.Tensor:
    out = torch.full((out_rows, *rows.shape[1:]), fill, dtype=rows.dtype)
    out[pos] = rows
    return out


def expected_step(cfg: dict, i: int, inputs: List[dict]) -> List[Dict[str, torch.Tensor]]:
    """What every rank must return from :func:`run_step` in step ``i``, from the oracle of
    tests/oracle.py (routing and sums written from the contract), the padding as the contract
    places it, and the same local expert (a local op: same inputs, same bits)."""
    return _expected(cfg, cfg["steps"][i], inputs)


def _expected(cfg: dict, st: dict, inputs: List[dict]) -> List[Dict[str, torch.Tensor]]:
    W, E = cfg["world_size"], cfg["num_experts"]
    dtype, is_fp8 = DTYPES[cfg["dtype"]], st["fp8"] is not None
    partial = torch.float32 if cfg["partial_fp32"] else dtype
    plain = [(d["x"], d["idx"], d["w"]) for d in inputs]
    routing = oracle.route(plain, E)
    packed = [(fp8.pack(*d["pair"]), d["idx"], d["w"]) for d in inputs] if is_fp8 else None
    budgets = step_budgets(cfg, st)
    want, real_rows, kept_routing = [], [], []
    for d in range(W):
        exp = oracle.expected_dispatch(packed or plain, E, d, routing)
        n = st["rows_per_expert"][d] if st["rows_per_expert"] else None
        pos, tpe, R = harness.padded_row_positions(exp["tokens_per_expert"], cfg["expert_alignment"], n)
        rows = R if cfg["max_recv_tokens"] is None else cfg["max_recv_tokens"]
        M, kept = budgets[d], len(pos)
        if M is not None:
            # A receive budget: the first rows of the layout without one that lie before row M
            # (rows in contract order: a prefix), M rows out; the rest are never written,
            # combined or given a gradient (the routing the combine below sums is that prefix).
            kept, rows = int((pos < M).sum()), M
            pos, tpe = pos[:kept], torch.tensor(_kept_counts(tpe.tolist(), M), dtype=torch.int64)
            exp = {k: (v if k == "tokens_per_expert" else v[:kept]) for k, v in exp.items()}
        tokens = _place(exp["tokens"], pos, rows, 0)
        w = dict(_row_fields(_split_packed(tokens, inputs[0]["pair"]) if is_fp8 else tokens, is_fp8, ""),
                 probs=_place(exp["probs"], pos, rows, 0.0), tokens_per_expert=tpe,
                 src_rank=_place(exp["src_rank"], pos, rows, -1), src_token=_place(exp["src_token"], pos, rows, -1))
        if M is not None:
            w.update(over_budget=torch.tensor([R > M]), rows_received=torch.tensor([R], dtype=torch.int64),
                     num_rows_device=torch.tensor([min(R, M)], dtype=torch.int64))
        want.append(w)
        real_rows.append(pos)
        el = E // W
        kept_rows = routing[d].rows[:kept]
        kept_routing.append(oracle.RankRows(rows=kept_rows, tokens_per_expert=[
            sum(1 for r in kept_rows if r[0] == e) for e in range(el)]))
    routing = kept_routing
    _expected_combine_and_grads(cfg, st, inputs, routing, want, real_rows, dtype, partial, is_fp8)
    if st["cached"]:
        _expected_cached(cfg, st, inputs, routing, want, real_rows, dtype, partial, is_fp8)
    return want


def _split_packed(packed: torch.Tensor, pair):
    """Packed rows ``[R, P]`` as the pair of views a dispatch returns."""
    q, s = pair
    return fp8.unpack(packed, q.shape[1], q.dtype, s.shape[1], s.dtype)


def _expected_combine_and_grads(cfg, st, inputs, routing, want, real_rows, dtype, partial, is_fp8):
    """``y`` of every rank and, with a backward, grad_eo / grad_x / grad_w."""
    W, K = cfg["world_size"], cfg["topk"]
    seed = expert_seed(st)
    grad = st["grad"] != "none"
    eos, grad_tokens, grad_probs = [], [], []
    gys = [d["gy"].to(dtype) for d in inputs] if grad else None
    for d in range(W):
        w, pos = want[d], real_rows[d]
        dense = dense_rows((w["fp8_bytes"],) if is_fp8 else w["tokens"], is_fp8, dtype)
        if not grad:
            eos.append(expert(w["src_rank"], w["src_token"], dense, w["probs"], seed, dtype, st["nan_padding"]))
            continue
        probs = w["probs"].clone().requires_grad_(True)
        dense = dense if is_fp8 else dense.clone().requires_grad_(True)
        with torch.enable_grad():
            eo = expert(w["src_rank"], w["src_token"], dense, probs, seed, dtype, st["nan_padding"])
        w["grad_eo"] = _place(oracle.expected_dispatch_of(routing, gys, d), pos, eo.shape[0], 0).to(dtype)
        leaves = (probs,) if is_fp8 else (dense, probs)
        gs = torch.autograd.grad(eo, leaves, w["grad_eo"])
        eos.append(eo.detach())
        grad_probs.append(gs[-1][pos])
        if not is_fp8:
            grad_tokens.append(gs[0][pos])
    for s in range(W):
        T = inputs[s]["x"].shape[0]
        want[s]["y"] = oracle.expected_combine(routing, [eos[d][real_rows[d]] for d in range(W)], s, T, dtype, partial)
        if grad:
            want[s]["grad_w"] = oracle.expected_grad_topk_weights(routing, grad_probs, s, T, K)
            if not is_fp8:
                want[s]["grad_x"] = oracle.expected_combine(routing, grad_tokens, s, T, dtype, partial)


def _expected_cached(cfg, st, inputs, routing, want, real_rows, dtype, partial, is_fp8):
    """The cached dispatch's rows of every rank and, with a backward, its input's gradient."""
    W, H = cfg["world_size"], cfg["hidden"]
    sources = [fp8.pack(*d["pair2"]) if is_fp8 else d["x2"] for d in inputs]
    g2s = []
    for d in range(W):
        out_rows = want[d]["src_rank"].shape[0]
        got = _place(oracle.expected_dispatch_of(routing, sources, d), real_rows[d], out_rows, 0)
        want[d].update(_row_fields(_split_packed(got, inputs[0]["pair2"]) if is_fp8 else got, is_fp8, "cached_"))
        g2s.append(cached_grad(st, d, out_rows, H, "cpu").to(dtype)[real_rows[d]])
    if st["grad"] != "none" and not is_fp8:
        for s in range(W):
            T = inputs[s]["x"].shape[0]
            want[s]["grad_cached_x"] = oracle.expected_combine(routing, g2s, s, T, dtype, partial)


# ---------------------------------------------------------------------------- comparison
# Fields of a step's result that have one row per dispatched row, and what padding rows hold.
PADDING_FILL = {"tokens": 0, "fp8_bytes": 0, "scale_bytes": 0, "probs": 0, "src_token": -1,
                "cached_tokens": 0, "cached_fp8_bytes": 0, "cached_scale_bytes": 0, "grad_eo": 0}


def bitwise_mismatch(got: torch.Tensor, want: torch.Tensor, what: str) -> Optional[str]:
    """None if ``got`` and ``want`` have the same dtype, shape and bits, else the reason."""
    try:
        harness.assert_bitwise(got, want, what)
    except AssertionError as e:
        return str(e)
    return None


def compare_step(got: Dict[str, torch.Tensor], want: Dict[str, torch.Tensor], tag: str) -> List[str]:
    """Every field of one rank's step, bitwise; missing or extra fields are mismatches too."""
    problems = []
    for k in sorted(set(got) | set(want)):
        if k not in got or k not in want:
            problems.append(f"{tag} {k}: only in {'the result' if k in got else 'the expectation'}")
            continue
        msg = bitwise_mismatch(got[k], want[k], f"{tag} {k}")
        if msg:
            problems.append(msg)
    return problems


def padding_problems(got: Dict[str, torch.Tensor], tag: str) -> List[str]:
    """The contract's padding rows (src_rank -1): zero rows, probs 0, src_token -1, zero
    gradient; checked on a backend's own result, independently of any expectation."""
    pad = got["src_rank"] < 0
    if not bool(pad.any()):
        return []
    problems = []
    for k, fill in PADDING_FILL.items():
        if k in got:
            rows = got[k][pad]
            msg = bitwise_mismatch(rows, torch.full_like(rows, fill), f"{tag} {k} on padding rows")
            if msg:
                problems.append(msg)
    return problems


def budget_problems(got: Dict[str, torch.Tensor], exp: Optional[Dict[str, Any]], tag: str) -> List[str]:
    """A receive budget's invariants on one rank's result, from the draw alone (``exp``:
    :func:`budget_expectations`; None: no budget on that rank, nothing to check): exactly M
    rows; ``over_budget`` a ``[1]`` bool equal to R > M; ``rows_received`` ``[1]`` int64 R;
    ``num_rows_device`` ``[1]`` int64 min(R, M); ``tokens_per_expert`` the layout's padded
    counts clamped to the first M rows; every row past min(R, M) a padding row (source -1;
    :func:`padding_problems` then checks it is a zero row)."""
    if exp is None:
        return []
    R, M = exp["R"], exp["M"]
    n = min(R, M)
    wants = {"over_budget": torch.tensor([R > M]), "rows_received": torch.tensor([R], dtype=torch.int64),
             "num_rows_device": torch.tensor([n], dtype=torch.int64),
             "tokens_per_expert": torch.tensor(exp["tokens_per_expert"], dtype=torch.int64)}
    problems = []
    for k, w in wants.items():
        if k not in got:
            problems.append(f"{tag} {k}: missing from a dispatch with recv_budget={M}")
            continue
        msg = bitwise_mismatch(got[k], w, f"{tag} {k} (budget invariant, R={R} M={M})")
        if msg:
            problems.append(msg)
    rows = got["src_rank"].shape[0]
    if rows != M:
        problems.append(f"{tag}: {rows} rows returned for recv_budget={M} (R={R})")
    elif bool((got["src_rank"][n:] >= 0).any()):
        problems.append(f"{tag} src_rank: a row past the {n} kept rows has a source (R={R} M={M})")
    return problems


def result_budgets(cfg: dict) -> List[List[Optional[Dict[str, Any]]]]:
    """:func:`budget_expectations` of each of a case's results (:func:`result_labels`)."""
    return [budget_expectations(cfg, st) for st in list(cfg["steps"]) + graph_steps(cfg)]


def compare_case(got: List[List[dict]], want: List[List[dict]], want_is_backend: bool = False,
                 labels: Optional[List[str]] = None,
                 budgets: Optional[List[List[Optional[Dict[str, Any]]]]] = None) -> List[str]:
    """``got[i][r]`` (step i, rank r) against ``want[i][r]``, plus the padding rows of ``got``
    (and of ``want`` when it is a backend's result too: the reference is the yardstick).
    ``labels``: what each result is called (:func:`result_labels`; default "step i").
    ``budgets``: :func:`result_budgets`, whose invariants are checked on ``got`` (and ``want``
    when it is a backend's) on every rank with a receive budget."""
    problems = []
    if len(got) != len(want):
        return [f"{len(got)} steps returned, {len(want)} expected"]
    for i, (g_step, w_step) in enumerate(zip(got, want)):
        for r, (g, w) in enumerate(zip(g_step, w_step)):
            tag = f"{labels[i] if labels else f'step {i}'} rank {r}"
            exp = budgets[i][r] if budgets else None
            problems += compare_step(g, w, tag) + padding_problems(g, tag) + budget_problems(g, exp, tag)
            if want_is_backend:
                problems += padding_problems(w, f"reference {tag}") + budget_problems(w, exp, f"reference {tag}")
    return problems


# ------------------------------------------------------------------------------ one case
def execute_case(cfg: dict, device: str, case_timeout_s: float):
    """Run a case's steps (and graph step) on loopback ranks; returns ``(got, want)`` as
    ``[result][rank]`` lists of CPU tensor dicts (:func:`result_labels`): the backend under test
    and its expectation (the reference backend's results on a GPU, the oracle's on the CPU).
    Run it inside :func:`case_environment`."""
    W = cfg["world_size"]
    gsteps = graph_steps(cfg)
    inputs = [step_inputs(cfg, i) for i in range(len(cfg["steps"]))]
    graph_inputs = [_inputs(cfg, st) for st in gsteps]
    backends = {"test": "cuda", "ref": "reference"} if device == "cuda" else {"test": "reference"}
    per_rank = loopback.run(rank_main, W, cfg, inputs, backends, max(5.0, case_timeout_s / 3),
                            graph_inputs, device=device, timeout_s=case_timeout_s)
    results = range(len(inputs) + len(graph_inputs))
    got = [[per_rank[r]["test"][i] for r in range(W)] for i in results]
    if device == "cuda":
        want = [[per_rank[r]["ref"][i] for r in range(W)] for i in results]
    else:
        want = ([expected_step(cfg, i, inputs[i]) for i in range(len(inputs))]
                + [_expected(cfg, st, d) for st, d in zip(gsteps, graph_inputs)])
    return got, want


def result_labels(cfg: dict) -> List[str]:
    """What each of a case's results is: its steps, then the graph step's warm-up and replays."""
    return ([f"step {i}" for i in range(len(cfg["steps"]))]
            + [f"graph {'warm-up' if j == 0 else f'replay {j}'}" for j in range(len(graph_steps(cfg)))])


def run_case(cfg: dict, device: str, case_timeout_s: float) -> Optional[dict]:
    """None if the case passed, else a failure record: kind (mismatch / exception /
    timeout), the first mismatch or error line, up to 10 mismatches, the traceback. The case
    runs under its MOK_* settings (:func:`case_environment`), put back however it ends."""
    try:
        with case_environment(cfg, device):
            got, want = execute_case(cfg, device, case_timeout_s)
    except loopback.LoopbackError as e:
        text = str(e)
        kind = "timeout" if "did not finish within" in text else "exception"
        return {"kind": kind, "message": _first_error_line(text), "traceback": text}
    except Exception as e:  # noqa: BLE001  (any exception is a finding, recorded with its trace)
        return {"kind": "exception", "message": f"{type(e).__name__}: {e}".splitlines()[0],
                "traceback": traceback.format_exc()}
    problems = compare_case(got, want, want_is_backend=device == "cuda", labels=result_labels(cfg),
                            budgets=result_budgets(cfg))
    if not problems:
        return None
    return {"kind": "mismatch", "message": problems[0], "mismatches": problems[:10],
            "num_mismatches": len(problems), "traceback": None}


def _first_error_line(text: str) -> str:
    """The root cause in a loopback report: the exception line of the first rank that did not
    merely see a peer's failure (a broken barrier), else of the first rank."""
    blocks, current = [], None
    for line in text.splitlines():
        if line.startswith("--- "):
            current = [line.strip("- ")]
            blocks.append(current)
        elif current is not None and line.strip():
            current.append(line.strip())
    lines = [f"{b[0]}: {b[-1]}" for b in blocks if len(b) > 1]
    root = [l for l in lines if "barrier broken" not in l and not l.startswith("host stalls")]
    return (root or lines or [text.strip().splitlines()[0] if text.strip() else text])[0]


# ------------------------------------------------------------------------------ features
def case_features(cfg: dict) -> List[str]:
    """Names of the features a case exercises (a case has one if any of its steps does)."""
    C = chunk_tokens()
    f = {f"world_{cfg['world_size']}", f"dtype_{cfg['dtype']}"}
    flags = {
        "partial_fp32": cfg["partial_fp32"],
        "static_shape": cfg["max_recv_tokens"] is not None,
        "expert_alignment": cfg["expert_alignment"] > 1,
        "small_ring": cfg["ring_chunks"] is not None,
        "num_sms_set": cfg["num_sms"] is not None,
        "topk_gt_8": cfg["topk"] > 8,
        "hidden_ge_1024": cfg["hidden"] >= 1024,
        "t_max_exact": cfg["max_tokens_per_rank"] == max(max(st["tokens"]) for st in cfg["steps"]),
    }
    f |= {k for k, v in flags.items() if v}
    for i, st in enumerate(cfg["steps"]):
        f |= _step_features(cfg, i, st, C)
    sched, graph = cfg.get("schedule"), cfg.get("graph")
    if sched:
        f |= {"schedule"} | {f"schedule_{sid}" for sid in sched["ids"]}
    if graph:
        f.add("cuda_graph")
        f |= {"cuda_graph_fp8"} if graph["fp8"] else set()
        f |= {"cuda_graph_rows_per_expert"} if graph["rows_per_expert"] is not None else set()
        f |= {"cuda_graph_eager_buffer"} if cfg["max_recv_tokens"] is None else set()
        if graph.get("recv_budget"):
            f.add("cuda_graph_recv_budget")
            exps = [budget_expectations(cfg, st) for st in graph_steps(cfg)]
            drops = [any(e is not None and e["R"] > e["M"] for e in es) for es in exps]
            f |= {"cuda_graph_recv_budget_drop"} if any(drops) else set()
            f |= {"cuda_graph_recv_budget_drop_and_not"} if any(drops) and not all(drops) else set()
    return sorted(f)


def _budget_features(cfg: dict, st: dict) -> set:
    """A step's receive-budget features (none without a budget)."""
    exps = budget_expectations(cfg, st)
    budgeted = [e for e in exps if e is not None]
    if not budgeted:
        return set()
    cap = cfg["max_recv_tokens"]
    flags = {
        "recv_budget": True,
        "recv_budget_drop": any(e["R"] > e["M"] for e in budgeted),
        "recv_budget_zero": any(e["M"] == 0 for e in budgeted),
        "recv_budget_below": any(0 < e["M"] < e["R"] for e in budgeted),
        "recv_budget_exact": any(e["M"] == e["R"] > 0 for e in budgeted),
        "recv_budget_above": any(e["M"] > e["R"] for e in budgeted),
        "recv_budget_mixed_ranks": len(budgeted) < len(exps),
        "recv_budget_static": cap is not None,
        "recv_budget_past_max_recv": cap is not None and any(max(e["R"], e["M"]) > cap for e in budgeted),
        "recv_budget_alignment": cfg["expert_alignment"] > 1,
        "recv_budget_fp8": st["fp8"] is not None,
        "recv_budget_cached": st["cached"],
        "recv_budget_backward": st["grad"] != "none",
    }
    return {k for k, v in flags.items() if v}


def _step_features(cfg: dict, i: int, st: dict, C: int) -> set:
    idx = [step_routing(cfg, i, s).to(torch.int64) for s in range(cfg["world_size"])]
    f = {f"route_{st['routing']}", f"values_{st['values']}", f"grad_{st['grad']}"}
    flags = {
        "fp8": st["fp8"] is not None,
        "fp8_byte_scales": bool(st["fp8"]) and st["fp8"]["kind"] == "bytes",
        "rows_per_expert": st["rows_per_expert"] is not None,
        "cached": st["cached"],
        "backward_autograd": st["grad"] == "autograd",
        "backward_by_hand": st["grad"] == "by_hand",
        "cached_backward": st["cached"] and st["grad"] != "none" and st["fp8"] is None,
        "nan_padding": st["nan_padding"],
        "idx_int32": st["idx_dtype"] == "int32",
        "rank_with_zero_tokens": 0 in st["tokens"],
        "odd_tokens": any(t % 2 for t in st["tokens"]),
        "unrouted_slots": any(bool((t < 0).any()) for t in idx),
        "duplicate_experts": any(_has_duplicate(t) for t in idx),
        "all_to_one_expert": st["routing"] == "one_expert",
        "call_larger_than_ring": cfg["ring_chunks"] is not None
        and max(st["tokens"]) > cfg["ring_chunks"] * C,
    }
    return f | {k for k, v in flags.items() if v} | _budget_features(cfg, st)


def _has_duplicate(idx: torch.Tensor) -> bool:
    """Whether a token names one expert in two slots."""
    if idx.shape[0] == 0 or idx.shape[1] < 2:
        return False
    s = idx.sort(dim=1).values
    return bool(((s[:, 1:] == s[:, :-1]) & (s[:, 1:] >= 0)).any())


def describe(cfg: dict) -> str:
    """A one-line summary of a case's shape (with its graph step's token counts x inputs and
    its MOK_* settings, when it has them)."""
    text = (f"W={cfg['world_size']} E={cfg['num_experts']} K={cfg['topk']} H={cfg['hidden']} "
            f"{cfg['dtype']} T_max={cfg['max_tokens_per_rank']} steps={len(cfg['steps'])} "
            f"tokens={[st['tokens'] for st in cfg['steps']]}")
    budgets = [f"{i}:{_budget_text(st['recv_budget'])}" for i, st in enumerate(cfg["steps"])
               if st.get("recv_budget")]
    if budgets:
        text += f" budget={';'.join(budgets)}"
    if cfg.get("graph"):
        g = cfg["graph"]
        text += f" graph={g['tokens']}x{len(g['replays'])}"
        if g.get("recv_budget"):
            text += f" graph_budget={_budget_text(g['recv_budget'])}"
        if cfg["max_recv_tokens"] is None:
            text += " (eager Buffer)"
    if cfg.get("schedule"):
        text += " " + ",".join(f"{k}={v}" for k, v in cfg["schedule"]["env"].items())
    return text


def _budget_text(budgets: List[Optional[int]]) -> str:
    return "[" + ",".join("-" if m is None else str(m) for m in budgets) + "]"


# ---------------------------------------------------------------------------------- main
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=240.0, help="stop starting cases after this long")
    p.add_argument("--out", required=True, help="folder for fuzz.json")
    p.add_argument("--seed", type=int, default=None, help="master seed (default: from the clock)")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None,
                   help="cuda: CUDA backend vs reference; cpu: reference vs oracle (default: cuda if usable)")
    p.add_argument("--max-world", type=int, default=4, help="largest world size drawn (1..15)")
    p.add_argument("--cases", type=int, default=None, help="stop after this many cases")
    p.add_argument("--max-tokens", type=int, default=600, help="most tokens per rank drawn")
    p.add_argument("--case-timeout", type=float, default=120.0,
                   help="seconds a case may take before it counts as a hang (kernel timeouts: a third)")
    p.add_argument("--replay", type=int, default=None, metavar="CASE_SEED", help="run only this case")
    p.add_argument("--no-schedules", action="store_true",
                   help="--device cuda: draw no MOK_* schedule settings (every Buffer takes the defaults)")
    p.add_argument("--no-graphs", action="store_true", help="--device cuda: draw no CUDA-graph steps")
    args = p.parse_args(argv)
    if not 1 <= args.max_world <= 15:
        p.error("--max-world must be in 1..15 (loopback ranks on one GPU, loopback.py)")
    return args


def _gpu_environment_ok(max_world: int) -> bool:
    """Loopback ranks on a GPU need enough hardware work queues (loopback.run refuses every
    case otherwise): say so once instead of failing every case."""
    need = loopback.connections_needed(max_world)
    have = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "8")
    if have.isdigit() and int(have) >= need and os.environ.get("CUDA_MODULE_LOADING", "").upper() == "EAGER":
        return True
    print(f"fuzz_dispatch: --max-world {max_world} on a GPU needs CUDA_DEVICE_MAX_CONNECTIONS >= {need} "
          f"(it is {have}) and CUDA_MODULE_LOADING=EAGER (megatron_mok/loopback.py)", file=sys.stderr)
    return False


def _device_info(device: str):
    """``(description, SM count)``; the SM count bounds num_sms for loopback ranks."""
    if device == "cpu":
        return "cpu (reference backend vs tests/oracle.py)", NOMINAL_SMS
    from megatron_mok.cuda import library
    idx = torch.cuda.current_device()
    sms = int(library.get().mok_sm_count(idx))
    return f"{torch.cuda.get_device_name(idx)} ({sms} SMs; cuda backend vs reference)", sms


def _write_json(path: str, doc: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(doc, fh, indent=1)
    os.replace(tmp, path)


def _cuda_usable() -> bool:
    return "cuda" in mok.available_backends()


def main(argv=None) -> int:
    args = parse_args(argv)
    device = args.device or ("cuda" if _cuda_usable() else "cpu")
    if device == "cuda" and not _cuda_usable():
        print("fuzz_dispatch: --device cuda needs a GPU and the compiled library", file=sys.stderr)
        return 2
    if device == "cuda" and not _gpu_environment_ok(args.max_world):
        return 2
    if device == "cpu":
        torch.set_num_threads(1)    # loopback threads share the cores: no intra-op threads
    os.makedirs(args.out, exist_ok=True)
    out_path = os.path.join(args.out, "fuzz.json")
    seed = args.seed if args.seed is not None else int(time.time() * 1000) % (2 ** 31)
    master = random.Random(seed)
    info, sms = _device_info(device)
    plan = (f"replay of case {args.replay}" if args.replay is not None else
            f"seed {seed}, {args.seconds:.0f} s" + ("" if args.cases is None else f", at most {args.cases} cases"))
    print(f"fuzz_dispatch: {info}; {plan}, max world {args.max_world}", flush=True)
    doc = {"args": vars(args), "device": device, "device_info": info, "seed": seed, "cases": 0,
           "feature_counts": {}, "failures": [], "elapsed_s": 0.0, "stopped": None}
    counts: Dict[str, int] = {}
    t0 = time.monotonic()
    limit = 1 if args.replay is not None else args.cases
    while True:
        elapsed = time.monotonic() - t0
        if limit is not None and doc["cases"] >= limit:
            doc["stopped"] = "cases"
            break
        if args.replay is None and elapsed >= args.seconds:
            doc["stopped"] = "time"
            break
        case_seed = args.replay if args.replay is not None else master.getrandbits(48)
        if _run_one(doc, counts, case_seed, device, sms, args, t0, out_path) == "timeout":
            doc["stopped"] = "timeout (threads may still hold the device: run stopped)"
            break
        if doc["cases"] % 10 == 0:
            print(f"-- {doc['cases']} cases, {len(doc['failures'])} failures, "
                  f"{time.monotonic() - t0:.1f} s", flush=True)
    doc["elapsed_s"] = round(time.monotonic() - t0, 2)
    doc["feature_counts"] = dict(sorted(counts.items()))
    _write_json(out_path, doc)
    print(f"fuzz_dispatch: {doc['cases']} cases, {len(doc['failures'])} failures, "
          f"{doc['elapsed_s']} s ({doc['stopped']}); {counts.get('recv_budget', 0)} with a receive "
          f"budget, {counts.get('recv_budget_drop', 0)} of them dropping rows; {out_path}", flush=True)
    return 1 if doc["failures"] else 0


def _run_one(doc, counts, case_seed, device, sms, args, t0, out_path) -> str:
    """Draw, run and record one case; returns "ok", "failed" or "timeout"."""
    n, c0 = doc["cases"], time.monotonic()
    cfg, feats = None, []
    print(f"case {n} seed {case_seed}: ", end="", flush=True)   # a crash still names the seed
    try:
        cfg = draw_config(case_seed, args.max_world, sms, args.max_tokens, device,
                          schedules=not args.no_schedules, graphs=not args.no_graphs)
        feats = case_features(cfg)
        shown = [f for f in feats if f in MAIN_FEATURES or f in CUDA_FEATURES]
        print(f"{describe(cfg)} [{','.join(shown)}]", end="", flush=True)
        if args.replay is not None:
            print("\n" + json.dumps(cfg, indent=1), flush=True)
        failure = run_case(cfg, device, args.case_timeout)
    except Exception as e:  # noqa: BLE001  (a failure of the draw itself is a finding too)
        failure = {"kind": "exception", "message": f"{type(e).__name__}: {e}".splitlines()[0],
                   "traceback": traceback.format_exc()}
    doc["cases"] += 1
    for f in feats:
        counts[f] = counts.get(f, 0) + 1
    if failure is None:
        print(f" ok {time.monotonic() - c0:.2f} s", flush=True)
        return "ok"
    print(f" FAILED ({failure['kind']}): {failure['message']}", flush=True)
    failure.update(case_index=n, case_seed=case_seed, config=cfg,
                   replay=f"python scripts/fuzz_dispatch.py --replay {case_seed} --max-world {args.max_world} "
                          f"--max-tokens {args.max_tokens} --device {device}"
                          + (" --no-schedules" if args.no_schedules else "")
                          + (" --no-graphs" if args.no_graphs else "") + " --out DIR")
    doc["failures"].append(failure)
    doc["elapsed_s"] = round(time.monotonic() - t0, 2)
    doc["feature_counts"] = dict(sorted(counts.items()))
    _write_json(out_path, doc)        # a later crash keeps what was found so far
    return "timeout" if failure["kind"] == "timeout" else "failed"


if __name__ == "__main__":
    sys.exit(main())

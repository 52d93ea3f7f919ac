#!/usr/bin/env python3
"""Mutation audit of the Python logic against the CPU test suite.

Each mutant is one small semantic change a real bug could make (an off-by-one, a summation
order, a check dropped, a slot or rank mixed up). The tool copies the repository to a
temporary folder (no .git, no virtual environment, no build outputs), applies each mutant there
in turn, runs the pytest targets that should catch it (``-x``: the first failure ends the run),
restores the file, and prints a table:

- ``KILLED``: a target failed (the first failing test is named), or timed out;
- ``SURVIVED``: every target passed; a mutant marked ``equivalent=True`` (with its reason: the
  change cannot alter what the code does, or not on a machine without a GPU) is expected to
  survive and is reported as ``equivalent``.

Exit status: 0 when every non-equivalent mutant is killed, 1 otherwise (or when a snippet no
longer occurs exactly once in its file: the list has rotted; ``tests/test_mutation_audit_py.py``
checks that cheaply on every CPU test run).

Usage (from the repository root; ~6 min on 2 cores)::

    python scripts/mutation_audit_py.py                 # every mutant
    python scripts/mutation_audit_py.py ref_ val_       # mutants whose name starts so
    python scripts/mutation_audit_py.py --list          # the list, nothing run
    python scripts/mutation_audit_py.py --check         # the snippets only (what the test checks)

The same Python runs the tests (``sys.executable``); the copy goes first on ``PYTHONPATH`` so
the mutated ``megatron_mok`` is the one imported, by the test process and its spawned ranks.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

REF = "megatron_mok/backends/reference.py"
VAL = "megatron_mok/validation.py"
BUF = "megatron_mok/buffer.py"
AG = "megatron_mok/autograd/functions.py"
FP8 = "megatron_mok/fp8.py"
DISP = "megatron_mok/megatron/dispatcher.py"
CFG = "megatron_mok/megatron/config.py"
LP = "megatron_mok/cuda/launch_policy.py"
MAIN = "megatron_mok/bench.py"
SUITE = "benchmarks/bench_dispatch_combine.py"
BCOMMON = "benchmarks/common.py"
A2A = "benchmarks/baselines/alltoall.py"
ERR = "megatron_mok/cuda/errors.py"
CBE = "megatron_mok/cuda/backend.py"
VER = "megatron_mok/megatron/versions.py"
PM = "megatron_mok/cuda/peer_memory.py"
NVD_SRC = "megatron_mok/cuda/nvlink_domain.py"
LAUNCH = "megatron_mok/launch.py"
PATCH = "megatron_mok/megatron/_patch.py"
CB = "megatron_mok/cuda/backend.py"
BUD = "megatron_mok/megatron/budget.py"

# pytest targets, most likely killer first (-x stops at the first failure)
LOOP = "megatron_mok/loopback.py"
LOOPT = "tests/test_cuda_loopback.py"
LOOPT_READS = f"{LOOPT}::test_loopback_host_reads_settle_first_in_rank_threads_only"
CONTRACT = "tests/test_contract.py"
AUTOGRAD = "tests/test_autograd.py"
ALIGN = "tests/test_expert_alignment.py"
RPE = "tests/test_rows_per_expert.py"
CACHED = "tests/test_cached_dispatch.py"
STATIC = "tests/test_static_shape.py"
DETERM = "tests/test_determinism.py"
ERRORS = "tests/test_errors.py"
FP8T = "tests/test_fp8_dispatch.py"
LPT = "tests/test_launch_policy.py"
MG_INSTALL = "tests/megatron/test_megatron_install.py"
MG_DISP = "tests/megatron/test_megatron_dispatcher.py"
MG_FEAT = "tests/megatron/test_megatron_features.py"
MAINT = "tests/test_main_job.py"
BENCHT = "tests/test_benchmarks_cpu.py"
ERRT = "tests/test_device_errors.py"
BINDT = "tests/test_bindings_constants.py"
PMT = "tests/test_peer_memory.py"
NVD = "tests/test_nvlink_domain.py"
MG_ENTRY = "tests/megatron/test_megatron_entrypoints.py"
MG_BUDGET = "tests/megatron/test_megatron_budget.py"
SAFETY = "tests/test_handle_safety.py"
STOP = "tests/test_stop_rank.py"
REFSTOP = "tests/test_reference_stop.py"
INPUTS = "tests/test_input_checks.py"
HOSTOPS = "tests/test_host_ops.py"
BUDGET = "tests/test_recv_budget.py"
REF_ALL = [CONTRACT, AUTOGRAD, CACHED, STATIC, ALIGN, RPE, DETERM]


def mg(*names: str) -> List[str]:
    """Node ids of tests/megatron/test_megatron_dispatcher.py."""
    return [f"{MG_DISP}::{n}" for n in names]


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str               # file, relative to the repository root
    original: str           # exact snippet; must occur exactly once in the file
    replacement: str
    tests: Tuple[str, ...]  # pytest targets that should kill it
    equivalent: bool = False
    reason: str = ""        # why an equivalent mutant cannot change behaviour

    @property
    def line(self) -> Optional[int]:
        return self.line_in(ROOT)

    def line_in(self, root: str) -> Optional[int]:
        """The snippet's line in ``root``'s copy of the file (``None``: not there). An audit
        reads it from its own copy: the working tree may be edited while it runs."""
        try:
            with open(os.path.join(root, self.path)) as f:
                text = f.read()
        except OSError:
            return None
        i = text.find(self.original)
        return None if i < 0 else text.count("\n", 0, i) + 1


def M(name, path, original, replacement, tests, equivalent=False, reason=""):
    return Mutant(name, path, original, replacement, tuple(tests), equivalent, reason)


MUTANTS: List[Mutant] = [
    # ------------------------------------------------------------------ reference backend
    M("ref_live_bound", REF,
      "live = t_ix < counts.view(world, 1, 1)",
      "live = t_ix <= counts.view(world, 1, 1)",
      [CONTRACT, RPE], equivalent=True,
      reason="every rank pads its topk_idx with -1 past T before the all-gather, so slots past "
             "counts[s] never name a local expert: `mine` excludes them whatever `live` says "
             "(the mask is belt and braces)"),
    M("ref_mine_lo", REF, "(all_idx >= lo)", "(all_idx > lo)", [CONTRACT]),
    M("ref_mine_hi", REF, "(all_idx < lo + num_local_experts)",
      "(all_idx <= lo + num_local_experts)", [CONTRACT]),
    M("ref_order_source_first", REF,
      "key = ((e * world + s) * t_max + t) * topk + k",
      "key = ((s * num_local_experts + e) * t_max + t) * topk + k", [CONTRACT]),
    M("ref_order_slot_before_token", REF,
      "key = ((e * world + s) * t_max + t) * topk + k",
      "key = ((e * world + s) * topk + k) * t_max + t", [CONTRACT]),
    M("ref_align_off_by_one", REF,
      "return (counts + alignment - 1) // alignment * alignment",
      "return (counts + alignment) // alignment * alignment", [ALIGN, CONTRACT]),
    M("ref_capacity_boundary", REF, "over = (counts > rows_per_expert)",
      "over = (counts >= rows_per_expert)", [RPE]),
    M("ref_shift_inclusive", REF,
      "shift = (torch.cumsum(padded, 0) - padded) - (torch.cumsum(counts, 0) - counts)",
      "shift = torch.cumsum(padded - counts, 0)", [ALIGN, RPE]),
    M("ref_task_sort_unstable", REF, "torch.sort(key, stable=True)",
      "torch.sort(key, stable=False)", [CONTRACT, AUTOGRAD, CACHED, DETERM]),
    M("ref_combine_slot_order", REF, "for j in range(K):", "for j in reversed(range(K)):",
      [CONTRACT, AUTOGRAD]),
    M("ref_combine_unrouted_slot", REF, "live = rows >= 0", "live = rows >= -1",
      [CONTRACT, AUTOGRAD]),
    M("ref_combine_no_partial_rounding", REF,
      "partial = partial.to(b.combine_partial_dtype)", "partial = partial.to(torch.float32)",
      [CONTRACT, AUTOGRAD]),
    M("ref_owner_rank_order", REF,
      "for d in range(W):\n            y[lay.hit[d]]",
      "for d in reversed(range(W)):\n            y[lay.hit[d]]", [CONTRACT, AUTOGRAD]),
    M("ref_owner_no_hit_mask", REF,
      "y[lay.hit[d]] += mine[d][lay.hit[d]].float()", "y += mine[d].float()",
      [CONTRACT, AUTOGRAD, ALIGN], equivalent=True,
      reason="a rank holding no row of token t sends a partial of +0.0 for it (the partial "
             "starts at zeros), and y, a sum from +0.0, is never -0.0 (x + -x is +0.0 in "
             "round-to-nearest), so adding that +0.0 changes no bit; zero rows and NaN "
             "padding never reach a partial (task_rows only lists real rows)"),
    M("ref_hit_dest", REF, "my_idx // b.num_local_experts", "my_idx // b.world_size",
      [CONTRACT]),
    M("ref_probs_wrong_slot", REF, "probs[pos] = all_w[row_s, row_t, row_k]",
      "probs[pos] = all_w[row_s, row_t, 0]", [CONTRACT]),
    M("ref_prob_grad_wrong_slot", REF, "side[key, lay.row_k[live]] =",
      "side[key, (lay.row_k[live] + 1) % K] =", [AUTOGRAD]),
    M("ref_cached_skips_rank0", REF, "live = handle.src_rank[:R] >= 0",
      "live = handle.src_rank[:R] > 0", [CACHED, AUTOGRAD]),
    M("ref_destroy_not_marked", REF, "        self.destroyed = True\n", "        pass\n", [SAFETY]),
    M("ref_destroyed_called", REF, "        if self.destroyed:\n", "        if False:\n", [SAFETY]),
    M("ref_task_rows_unpadded", REF,
      "task_rows = torch.where(task_rows >= 0, pos[task_rows.clamp(min=0)], task_rows)",
      "task_rows = task_rows", [ALIGN, RPE]),
    # ------------------------------------------------------------------------ validation
    M("val_expert_hi", VAL, "hi >= buf.num_experts", "hi > buf.num_experts", [ERRORS]),
    M("val_expert_lo", VAL, "if lo < -1 or", "if lo < -2 or", [ERRORS]),
    M("val_tmax_boundary", VAL, "if num_tokens > buf.max_tokens_per_rank:",
      "if num_tokens >= buf.max_tokens_per_rank:", [ERRORS]),
    M("val_weights_dtype", VAL, "if topk_weights.dtype != torch.float32:",
      "if topk_weights.dtype not in (torch.float32, torch.float64):", [ERRORS]),
    M("val_rpe_alignment_dropped", VAL, "if n % buf.expert_alignment != 0:", "if False:",
      [RPE]),
    M("val_rpe_static_boundary", VAL, "total > buf.max_recv_tokens",
      "total >= buf.max_recv_tokens", [RPE, STATIC]),
    M("val_fp8_row_boundary", VAL, "if row > token_row:", "if row >= token_row:", [FP8T]),
    M("val_handle_of_other_buffer", VAL, "if handle.buffer_id != buf.serial:", "if False:",
      [ERRORS, CACHED, SAFETY]),
    M("val_handle_of_other_backend", VAL, "if handle.backend != backend_name:", "if False:",
      [SAFETY]),
    M("val_topk_equals_e", VAL, "not 1 <= topk <= num_experts", "not 1 <= topk < num_experts",
      [ERRORS, CONTRACT]),
    # ------------------------------------------------------------------------- Buffer
    M("buf_serial_is_id", BUF, "self.serial = next(_SERIALS)", "self.serial = id(self)",
      [SAFETY]),
    M("buf_out_rows_boundary", BUF, "if num_rows > self.max_recv_tokens:",
      "if num_rows >= self.max_recv_tokens:", [STATIC]),
    M("buf_check_values_inverted", BUF, 'check_values=backend.name == "reference"',
      'check_values=backend.name != "reference"', [ERRORS]),
    M("buf_partial_dtype_fp16_accepted", BUF, "if partial not in (dtype, torch.float32):",
      "if partial not in (dtype, torch.float32, torch.float16):", [ERRORS]),
    M("buf_num_sms_zero_accepted", BUF, "or isinstance(num_sms, bool) or num_sms < 1):",
      "or isinstance(num_sms, bool) or num_sms < 0):", [INPUTS]),
    M("buf_unindexed_cuda_not_resolved", BUF,
      "self._cuda_device()   # device=\"cuda\": the current device, fixed at this first use",
      "return", [INPUTS]),
    M("buf_backend_made_before_the_device_is_known", BUF,
      "if name == \"cuda\" and is_tensor and name not in self._backends:",
      "if False:", [INPUTS]),
    # Item 73: calls that need no gradient skip their autograd Function.
    M("buf_functions_always_skipped", BUF, "    return torch.is_grad_enabled() and any(",
      "    return False and any(", [f"{AUTOGRAD}::test_partial_requires_grad"]),
    M("buf_functions_never_skipped", BUF, "    return torch.is_grad_enabled() and any(",
      "    return True or any(", [f"{AUTOGRAD}::test_calls_without_gradients_skip_the_functions_bitwise"]),
    M("buf_grad_mode_ignored", BUF, "    return torch.is_grad_enabled() and any(",
      "    return any(", [f"{AUTOGRAD}::test_calls_without_gradients_skip_the_functions_bitwise"]),
    M("buf_weights_grad_ignored", BUF, "        if records_autograd(rows, topk_weights):",
      "        if records_autograd(rows):", [f"{AUTOGRAD}::test_partial_requires_grad"]),
    # ------------------------------------------------------------------- CUDA backend (host)
    M("cuda_other_gpu_accepted", CBE, "if t.device != self.device:", "if False:", [INPUTS]),
    M("cuda_misaligned_rows_passed", "megatron_mok/rows.py", "if t.numel() and t.data_ptr() % ROW_ALIGN:",
      "if False:", [INPUTS]),
    # The C++ host ops' routing in the backend (NOTES items 75-77): which calls take them, and
    # the arguments the backend hands them.
    M("cbe_host_ops_take_fp8_pairs", CBE,
      "        if ops is not None and not isinstance(x, PairRows):\n            blocks, producers, _ = self._roles(T)\n"
      "            rc, tokens, probs,",
      "        if ops is not None:\n            blocks, producers, _ = self._roles(T)\n            rc, tokens, probs,",
      [f"{HOSTOPS}::test_fp8_pairs_keep_the_python_path"]),
    M("cbe_host_ops_cached_take_fp8_pairs", CBE,
      "        if ops is not None and not isinstance(x, PairRows):\n            blocks, producers, _ = self._roles(T)\n"
      "            rc, out = ops.dispatch_cached(",
      "        if ops is not None:\n            blocks, producers, _ = self._roles(T)\n"
      "            rc, out = ops.dispatch_cached(",
      [f"{HOSTOPS}::test_fp8_pairs_keep_the_python_path"]),
    M("cbe_host_ops_take_static_side_stream", CBE,
      "if ops is not None and not static and not isinstance(x, PairRows)",
      "if ops is not None and not isinstance(x, PairRows)",
      [f"{HOSTOPS}::test_static_calls_on_the_side_stream_schedule_keep_the_python_path"]),
    M("cbe_host_ops_grad_probs_dropped", CBE, "DTYPE_CODES[b.combine_partial_dtype], blocks, producers, grad_probs,",
      "DTYPE_CODES[b.combine_partial_dtype], blocks, producers, None,",
      [f"{HOSTOPS}::test_prob_gradient_combine_op_is_the_python_path"]),
    M("cbe_host_ops_grad_w_width", CBE, "blocks, producers, grad_probs,\n                                        b.topk)",
      "blocks, producers, grad_probs,\n                                        b.topk + 1)",
      [f"{HOSTOPS}::test_prob_gradient_combine_op_is_the_python_path"]),
    M("cbe_cached_staging_dropped", CBE,
      "steps = bindings.STEP_TRANSFER | (bindings.STEP_STAGE_COPY if self.ce_stage else 0)",
      "steps = bindings.STEP_TRANSFER", [f"{HOSTOPS}::test_cached_dispatch_op_is_the_python_path"]),
    M("cbe_host_ops_cached_roles", CBE, "self.buf.num_experts, cap, blocks, producers, self.ce_mode,",
      "self.buf.num_experts, cap, blocks, blocks - 1, self.ce_mode,",
      [f"{HOSTOPS}::test_cached_dispatch_op_is_the_python_path"]),
    M("cbe_host_ops_data_error_before_launch", CBE,
      "\n        if report[4] not in DATA_ERRORS:  # protocol errors", "\n        if True:  # protocol errors",
      [f"{HOSTOPS}::test_eager_dispatch_errors_are_raised_alike"]),
    M("cbe_host_ops_fixed_rows_dropped", CBE, "topk_weights, stream, R, read, n)",
      "topk_weights, stream, R, read, bindings.NO_ROWS_PER_EXPERT)",
      [f"{HOSTOPS}::test_eager_dispatch_ops_are_the_python_path"]),
    M("cbe_host_ops_combine_roles", CBE,
      "            blocks, _, producers = self._roles(T)\n            rc, y, grad_w = ops.combine(",
      "            blocks, producers, _ = self._roles(T)\n            rc, y, grad_w = ops.combine(",
      [f"{HOSTOPS}::test_combine_op_is_the_python_path"]),
    # ------------------------------------------------------------------------ autograd
    M("ag_want_w_of_x", AG, "want_w = ctx.needs_input_grad[3]",
      "want_w = ctx.needs_input_grad[2]", [AUTOGRAD]),
    M("ag_prob_grads_dropped", AG,
      "grad_probs=grad_probs.contiguous() if want_w else None", "grad_probs=None", [AUTOGRAD]),
    M("ag_backward_after_destroy", AG, "    if backend.destroyed:\n", "    if False:\n",
      [SAFETY]),
    M("ag_double_backward_allowed", AG, "if not torch.is_grad_enabled() or not incoming:",
      "if True:", [SAFETY]),
    M("ag_fp8_prob_grads_inverted", AG,
      "if not want_w:\n                return None, None, None, None, None, None",
      "if want_w:\n                return None, None, None, None, None, None", [FP8T]),
    # ----------------------------------------------------------------------------- FP8
    M("fp8_row_align", FP8, "(raw + ROW_ALIGN - 1) // ROW_ALIGN * ROW_ALIGN",
      "(raw + ROW_ALIGN) // ROW_ALIGN * ROW_ALIGN", [FP8T]),
    M("fp8_quantize_no_abs", FP8, "amax = xv.abs().amax(dim=2)", "amax = xv.amax(dim=2)",
      [FP8T]),
    M("fp8_dequantize_wrong_block_scale", FP8, "scales.float().unsqueeze(2)",
      "scales.float().flip(1).unsqueeze(2)", [FP8T]),
    M("fp8_unpack_ignores_offset", FP8,
      "rows.storage_offset() // esize + hidden // esize", "hidden // esize", [FP8T]),
    M("fp8_in_place_ignores_scale_width", FP8, "if H % ROW_ALIGN or sb % ROW_ALIGN or packed:",
      "if H % ROW_ALIGN or packed:", [FP8T]),
    # ----------------------------------------------------------------- Megatron adapter
    M("mg_topk_largest", DISP, "largest=False", "largest=True", [MG_INSTALL]),
    M("mg_topk_valid_bound", DISP, "valid = idx < num_experts", "valid = idx <= num_experts",
      [MG_INSTALL]),
    M("mg_etp_virtual_order", DISP,
      "virtual = (ep.unsqueeze(-1) * etp + shard) * num_local_experts",
      "virtual = (shard * etp + ep.unsqueeze(-1)) * num_local_experts", [MG_INSTALL]),
    M("mg_dnp_padding_routes_kept", DISP, "routing_map = routing_map & (probs != 0)",
      "routing_map = routing_map",
      [MG_INSTALL] + mg("test_drop_and_pad_mok_vs_alltoall_cpu[2-2.0-probs]")),
    M("mg_rows_forget_ep", DISP, "n = capacity * self.buffer.world_size", "n = capacity",
      [MG_INSTALL] + mg("test_drop_and_pad_mok_vs_alltoall_cpu[2-0.5-probs]")),
    M("mg_rows_round_down", DISP, "return -(-n // align) * align", "return n // align * align",
      [MG_INSTALL] + mg("test_drop_and_pad_mok_vs_alltoall_cpu[1-0.5-probs]")),
    M("mg_dnp_tpe_int32", DISP, "rows, dtype=torch.long,", "rows, dtype=torch.int32,",
      [MG_INSTALL] + mg("test_drop_and_pad_mok_vs_alltoall_cpu[1-0.5-probs]")),
    M("mg_dnp_tpe_on_device", DISP, 'device=res.tokens.device if on_device else "cpu"',
      "device=res.tokens.device",
      [MG_INSTALL] + mg("test_drop_and_pad_mok_vs_alltoall_cpu[1-0.5-probs]")),
    M("mg_probs_dtype_kept", DISP,
      "probs = probs.to(self._probs_dtype)", "probs = probs",
      [MG_INSTALL] + mg("test_dispatcher_layout_and_grads_cpu[2-2-bf16]",
                      "test_dropless_roundtrip_cpu_bf16_topk4")),
    M("mg_capacity_factor_check_dropped", DISP,
      "if self.drop_and_pad and self.capacity_factor is None:", "if False:",
      [MG_INSTALL]),
    M("mg_tmax_boundary", DISP, "if num_tokens > t_max:", "if num_tokens >= t_max:",
      [MG_INSTALL] + mg("test_dropless_roundtrip_cpu[1-2]")),
    M("mg_flex_sms_zero_accepted", DISP, "if int(flex) <= 0:", "if int(flex) < 0:",
      [MG_INSTALL] + mg("test_layer_num_sms_cpu[1]")),
    # ------------------------------------- device errors and re-initialisation (install 6, 7)
    M("mg_check_while_capturing", DISP, "    if _capturing():\n        return False\n", "",
      [MG_INSTALL]),
    M("mg_group_key_by_id", DISP, "        gkey = _GroupKey(group)\n", "        gkey = id(group)\n",
      [MG_INSTALL]),
    # ------------------------------------- drop-and-pad switched on a built dispatcher (s34)
    # ---------------------------------------------- a rank's error stops its Buffer (item 53)
    M("buf_dispatch_error_not_stopping", BUF,
      "            return self._dispatch(x, topk_idx, topk_weights, handle, rows_per_expert, "
      "recv_budget)\n        except Exception as exc:\n            self._abort_after(exc)\n",
      "            return self._dispatch(x, topk_idx, topk_weights, handle, rows_per_expert, "
      "recv_budget)\n        except Exception as exc:\n            pass\n",
      [f"{STOP}::test_an_input_error_stops_the_buffer_and_names_itself"]),
    M("buf_world_of_one_stopped", BUF,
      "        if self._destroyed or self.world_size == 1:\n            return\n        if self._aborted",
      "        if self._destroyed:\n            return\n        if self._aborted",
      [f"{ERRORS}::test_an_error_in_a_world_of_one_does_not_stop_the_buffer"]),
    M("buf_stopped_buffer_still_used", BUF,
      "        if self._aborted is not None:\n            self._tell_peers()",
      "        if False:\n            self._tell_peers()",
      [f"{STOP}::test_an_input_error_stops_the_buffer_and_names_itself"]),
    M("ref_abort_not_refusing", REF,
      "        if self.aborted is not None:\n            self.tell_peers(device)",
      "        if False:\n            self.tell_peers(device)",
      [f"{ERRORS}::test_a_combine_error_stops_the_buffer_on_that_rank"]),
    # ------------------------------------ the reference backend tells its peers (item 56)
    M("ref_peer_stop_ignored", REF,
      "        if stops:\n            r = min(stops)", "        if False:\n            r = min(stops)",
      [f"{REFSTOP}::test_reference_peers_of_a_stopped_rank_raise_at_once[dispatch-2]"]),
    M("ref_stop_never_posted", REF,
      "        self.told = True\n        try:\n            dev = status_device(",
      "        self.told = True\n        return\n        try:\n            dev = status_device(",
      [f"{REFSTOP}::test_reference_peers_of_a_stopped_rank_raise_at_once[dispatch-2]"]),
    M("ref_stop_posted_every_refusal", REF,
      "        if self.told or self.aborted is None or b.world_size == 1:",
      "        if self.aborted is None or b.world_size == 1:",
      [f"{REFSTOP}::test_reference_peers_of_a_stopped_rank_raise_at_once[dispatch-2]"]),
    M("ref_overflow_checked_on_own_rank_only", REF,
      "        for d in range(W):\n            cap, n, budget, align",
      "        for d in [b.rank]:\n            cap, n, budget, align",
      [f"{REFSTOP}::test_reference_peers_of_a_stopped_rank_raise_at_once[static-2]",
       f"{REFSTOP}::test_reference_peers_of_a_stopped_rank_raise_at_once[rows_per_expert-2]"]),
    M("ref_overflow_ignores_alignment", REF,
      "rows = int(padded_counts(per_expert[d], align,",
      "rows = int(padded_counts(per_expert[d], 1,",
      [f"{REFSTOP}::test_reference_peers_of_a_stopped_rank_raise_at_once[static_aligned-2]"]),
    M("ref_overflow_budget_not_exempt", REF,
      "            if budget < 0 and cap >= 0 and rows > cap:",
      "            if cap >= 0 and rows > cap:", [BUDGET]),
    M("ref_overflow_names_the_lowest_rank_first", REF,
      "        if b.rank in errors:\n            raise RuntimeError(errors[b.rank])\n",
      "", [f"{REFSTOP}::test_reference_overflow_on_every_rank_names_each_own"]),
    M("buf_skipped_call_not_told", BUF, "        if skipped_call or self._status_due:",
      "        if self._status_due:",
      [f"{REFSTOP}::test_reference_peers_of_a_stopped_rank_raise_at_once[skipped-2]"]),
    M("buf_in_call_error_not_told", BUF, "        if skipped_call or self._status_due:",
      "        if skipped_call:",
      [f"{REFSTOP}::test_reference_peers_of_a_stopped_rank_raise_at_once[dispatch-2]"]),
    M("buf_status_due_never_cleared", REF,
      "        b._status_due = False          # from here", "        pass  # from here",
      [f"{REFSTOP}::test_an_error_after_the_exchange_is_not_a_skipped_call"]),
    M("buf_refusal_not_told", BUF,
      "        if self._aborted is not None:\n            self._tell_peers()",
      "        if self._aborted is not None:\n            pass",
      [f"{REFSTOP}::test_reference_peers_of_a_stopped_rank_raise_at_once[next_call-2]"]),
    M("buf_told_backend_not_aborted", BUF,
      "            ref = self._get_backend(\"reference\")\n            ref.abort(self._aborted)\n",
      "            ref = self._get_backend(\"reference\")\n",
      [f"{REFSTOP}::test_reference_peers_of_a_stopped_rank_raise_at_once[skipped-2]"]),
    M("comm_post_stop_without_reason", "megatron_mok/comm.py",
      "    rec = _status_record((), reason, device)\n", "    rec = _status_record((), None, device)\n",
      [f"{REFSTOP}::test_reference_peers_of_a_stopped_rank_raise_at_once[skipped-2]"]),
    M("comm_post_stop_gives_up_at_once", "megatron_mok/comm.py",
      "        if time.monotonic() > deadline:\n            return False",
      "        if True:\n            return False",
      [f"{REFSTOP}::test_wait_bounded_polls_other_backends_until_the_deadline"]),
    M("comm_poll_never_gives_up", "megatron_mok/comm.py",
      "        if time.monotonic() > deadline:\n            return False",
      "        if False:\n            return False",
      [f"{REFSTOP}::test_wait_bounded_polls_other_backends_until_the_deadline"]),
    # NOTES item 63: the ranks of a CUDA-backend group agree on the workspace layout.
    M("cuda_layout_mismatch_accepted", CB, "            if problem is not None:\n                raise ValueError(problem)",
      "            if False:\n                raise ValueError(problem)", ["tests/test_layout_agreement.py"]),
    M("layout_dtype_unchecked", VAL, '("dtype", SUPPORTED_DTYPES.index(buf.dtype), dtype_name)',
      '("dtype", 0, dtype_name)', ["tests/test_layout_agreement.py"]),
    M("ref_layout_unchecked", REF, "        if len(set(vals[:, STATUS_VALUES - 1].tolist())) > 1:",
      "        if False:", ["tests/test_layout_agreement.py"]),
    # NOTES item 65: the staging settings compared with the layout, before allocating.
    M("layout_staging_unchecked", CB,
      '("copy-engine staging (MOK_DISPATCH_CE_STAGE)", int(self.ce_stage), _used),',
      '("copy-engine staging (MOK_DISPATCH_CE_STAGE)", 1, _used),', ["tests/test_layout_agreement.py"]),
    # NOTES item 66: a rank that cannot allocate its workspace stops every rank.
    M("alloc_failure_kept_to_itself", PM,
      '"the workspace allocation", stop=failure)', '"the workspace allocation", stop=None)',
      ["tests/test_workspace_allocation.py"]),
    M("alloc_failed_peers_go_on", PM,
      "    if failed:\n        tensor = None", "    if failure is not None:\n        tensor = None",
      ["tests/test_workspace_allocation.py"]),
    # NOTES item 68: a rank exiting with an uncaught exception stops its peers first.
    M("exit_hook_never_stops", BUF, "        if exc is not None:\n            try:\n                buf._stop_at_exit",
      "        if False:\n            try:\n                buf._stop_at_exit", ["tests/test_exit_stop.py"]),
    M("exit_stop_on_loopback", BUF, '                or getattr(getattr(cuda, "mem", None), "loopback", True)):\n            return\n        self.abort',
      "                or False):\n            return\n        self.abort", ["tests/test_exit_stop.py"]),
    M("validation_disagreement_first_field_only", "megatron_mok/validation.py",
      "    return \"; \".join(clauses) or None\n", "    return clauses[0] if clauses else None\n",
      ["tests/test_layout_agreement.py"]),
    # NOTES item 62: the CUDA backend only on GPUs the library has code for.
    M("cuda_unsupported_gpu_let_through", CB,
      "        if arch is None:        # before any workspace", "        if False:        # before any workspace",
      ["tests/test_gpu_support.py::test_cuda_backend_names_the_gpu_it_cannot_run_on"]),
    M("auto_ignores_the_gpu_arch", BUF, "    return library.kernel_arch(index)[0] is not None\n",
      "    return True\n", ["tests/test_gpu_support.py::test_auto_picks_cuda_only_where_the_library_has_code"]),
    M("auto_asks_the_current_gpu_only", BUF,
      "        index = torch.device(device).index if not isinstance(device, int) else device\n",
      "        index = None\n", ["tests/test_gpu_support.py::test_auto_picks_cuda_only_where_the_library_has_code"]),
    # NOTES item 61: the Megatron dispatcher's Buffers wait as long as the EP group would.
    M("comm_group_timeout_unread", "megatron_mok/comm.py",
      "                    return timeout.total_seconds()\n", "                    return None\n",
      [f"{REFSTOP}::test_a_groups_own_timeout_is_read"]),
    M("mg_group_timeout_ignored", DISP, "        if opts.timeout_s is None:\n            # Neither",
      "        if False:\n            # Neither", [f"{MG_INSTALL}::test_buffer_waits_as_long_as_the_ep_group"]),
    M("mg_group_timeout_beats_the_variable", DISP, "        if opts.timeout_s is None:\n            # Neither",
      "        if True:\n            # Neither", [f"{MG_INSTALL}::test_buffer_waits_as_long_as_the_ep_group"]),
    M("cuda_device_error_not_stopping", CB,
      "            try:\n                self._stop_rank(self.broken if note is None or note[1] is None else note[1],\n"
      "                                None if note is None else note[0])\n            except Exception as err:\n"
      "                warnings.warn(f\"megatron_mok: rank {self.buf.rank} could not stop its peers after \"\n"
      "                              f\"a device error ({err}); they will wait until their timeout\")\n",
      "", [f"{STOP}::test_a_failed_stop_does_not_hide_the_device_error"]),
    M("cuda_failed_stop_hides_device_error", CB,
      "            try:\n                self._stop_rank(self.broken if note is None or note[1] is None else note[1],\n"
      "                                None if note is None else note[0])\n            except Exception as err:\n"
      "                warnings.warn(f\"megatron_mok: rank {self.buf.rank} could not stop its peers after \"\n"
      "                              f\"a device error ({err}); they will wait until their timeout\")\n",
      "            self._stop_rank(self.broken if note is None or note[1] is None else note[1],\n"
      "                            None if note is None else note[0])\n",
      [f"{STOP}::test_a_failed_stop_does_not_hide_the_device_error"]),
    # ------------------------------------------ the CUDA peers quote the reason (item 57)
    M("cuda_peer_note_not_read", CB, "                origin, text = self._peer_stop_note(peer)\n",
      "                origin, text = None, None\n",
      [f"{STOP}::test_a_peer_stop_raises_with_the_reason_its_note_gives"]),
    M("cuda_chain_names_the_peer_not_the_first_rank", CB,
      "                note = (peer if origin is None else origin, text)\n",
      "                note = (peer, text)\n",
      [f"{STOP}::test_a_chain_of_stops_names_the_first_rank"]),
    M("cuda_peer_stop_note_not_passed_on", CB,
      "                self._stop_rank(self.broken if note is None or note[1] is None else note[1],\n",
      "                self._stop_rank(self.broken,\n",
      [f"{STOP}::test_a_chain_of_stops_names_the_first_rank"]),
    M("cuda_stop_origin_dropped", CB,
      "        origin = self.buf.rank if origin is None else origin\n",
      "        origin = self.buf.rank\n",
      [f"{STOP}::test_a_chain_of_stops_names_the_first_rank"]),
    M("cuda_later_refusal_forgets_the_peer", CB, "        if self.broken_by is not None:\n", "        if False:\n",
      [f"{STOP}::test_a_peer_stop_raises_with_the_reason_its_note_gives"]),
    M("cuda_stop_note_empty", CB,
      "        note = reason_bytes(reason.removeprefix(\"megatron_mok: \"))\n", "        note = b\"\"\n",
      [f"{STOP}::test_abort_leaves_its_reason_as_the_note_cut_to_240_bytes"]),
    M("cuda_stop_note_keeps_the_prefix", CB,
      "        note = reason_bytes(reason.removeprefix(\"megatron_mok: \"))\n",
      "        note = reason_bytes(reason)\n",
      [f"{STOP}::test_other_device_errors_are_not_peer_stops"]),
    M("cuda_stop_note_not_cut", CB,
      "        note = reason_bytes(reason.removeprefix(\"megatron_mok: \"))\n",
      "        note = reason.removeprefix(\"megatron_mok: \").encode()\n",
      [f"{STOP}::test_abort_leaves_its_reason_as_the_note_cut_to_240_bytes"]),
    M("err_peer_reason_not_quoted", ERR, "        why = (f\"({reason})\" if reason else",
      "        why = (f\"({reason})\" if False else",
      [f"{STOP}::test_a_peer_stop_raises_with_the_reason_its_note_gives"]),
    M("err_chain_not_named", ERR,
      "        whose = \"an error of its own\" if origin == peer else f\"rank {origin}'s error\"\n",
      "        whose = \"an error of its own\"\n",
      [f"{STOP}::test_a_chain_of_stops_names_the_first_rank"]),
    # ------------------------------- the reference backend's collectives time out (item 58)
    M("ref_status_exchange_unbounded", REF,
      "                                          self.timeout_s, f\"the status exchange of {call}\")",
      "                                          None, f\"the status exchange of {call}\")",
      [f"{REFSTOP}::test_reference_peers_of_a_rank_that_never_calls_again_time_out[2]"]),
    M("ref_gather_unbounded", REF,
      "            return all_gather_exact(t, b.group, b.world_size, self.timeout_s, what)",
      "            return all_gather_exact(t, b.group, b.world_size, None, what)",
      [f"{REFSTOP}::test_a_timeout_in_a_later_collective_stops_the_rank"]),
    M("ref_timeout_posts_a_stop", REF,
      "            self.abort(str(err))\n            self.told = True\n            raise\n",
      "            self.abort(str(err))\n            raise\n",
      [f"{REFSTOP}::test_a_timeout_in_a_later_collective_stops_the_rank",
       f"{REFSTOP}::test_reference_peers_of_a_rank_that_never_calls_again_time_out[2]"]),
    M("ref_timeout_not_stopping", REF,
      "            self.abort(str(err))\n            self.told = True\n            raise\n",
      "            self.told = True\n            raise\n",
      [f"{REFSTOP}::test_reference_peers_of_a_rank_that_never_calls_again_time_out[2]",
       f"{REFSTOP}::test_a_timeout_in_a_later_collective_stops_the_rank"]),
    M("comm_gloo_timeout_never_fires", "megatron_mok/comm.py",
      "            work.wait(timeout=timedelta(seconds=timeout_s))\n",
      "            work.wait()\n",
      [f"{REFSTOP}::test_a_bounded_gather_times_out_and_stays_queued"]),
    M("comm_timeout_default_ignores_env", "megatron_mok/comm.py",
      "    return float(os.environ.get(\"MOK_TIMEOUT_S\") or DEFAULT_TIMEOUT_S)\n",
      "    return DEFAULT_TIMEOUT_S\n",
      [f"{REFSTOP}::test_the_timeout_defaults_to_mok_timeout_s"]),
    M("hook_step_error_not_stopping", PATCH, "            _stop_buffers(exc)\n            raise\n",
      "            raise\n", [f"{MG_INSTALL}::test_a_step_that_raises_stops_every_shared_buffer"]),
    M("mg_live_buffers_destroyed_too", DISP,
      "        return [buf for buf in _BUFFERS.values() if not buf._destroyed]\n",
      "        return list(_BUFFERS.values())\n",
      [f"{MG_INSTALL}::test_a_step_that_raises_stops_every_shared_buffer",
       f"{MG_INSTALL}::test_check_errors_checks_every_cached_buffer"]),
    M("mg_t_max_error_not_stopping", DISP, "            buf.abort(msg, skipped_call=True)\n", "",
      ["tests/megatron/test_megatron_eval.py::test_small_first_dispatch_then_prefill_cpu"]),
    M("err_peer_stopped_routing_unnamed", ERR, "        if what in (1, 5):",
      "        if what in (5,):", [f"{STOP}::test_peer_stopped_messages_name_what_the_peer_did_not_do"]),
    M("mg_capacity_factor_frozen", DISP, "        return self.moe_expert_capacity_factor\n",
      "        return self.__dict__.setdefault('_cf0', self.moe_expert_capacity_factor)\n",
      [f"{MG_FEAT}::test_decode_expert_padding_cpu"]),
    M("mg_missing_factor_unchecked", DISP,
      "        if self.capacity_factor is None:    # set on a built dispatcher (see __init__)\n",
      "        if False:\n", [MG_INSTALL]),
    M("mg_call_mode_combine_unchecked", DISP,
      "        if self.check_each_call and not _capturing():\n            self.buffer.check_errors()\n"
      "        return y\n", "        return y\n", [MG_INSTALL]),
    M("hook_step_check_skipped", PATCH, "            raise\n        step_check()\n",
      "            raise\n",
      [MG_INSTALL] + mg("test_device_error_raised_before_the_optimizer_step_cpu[1]")),
    M("hook_destroy_keeps_buffers", PATCH,
      "        _reset_buffers()\n        return fn(*args, **kwargs)\n",
      "        return fn(*args, **kwargs)\n",
      mg("test_destroy_model_parallel_resets_the_buffers_cpu[1]")),
    # ----------------------------------------------------------------- Megatron config
    M("cfg_topk_bound", CFG, "if topk * etp > CUDA_MAX_TOPK:", "if topk * etp >= CUDA_MAX_TOPK:",
      [MG_INSTALL]),
    M("cfg_ranks_bound", CFG, "if ranks > CUDA_MAX_RANKS:", "if ranks >= CUDA_MAX_RANKS:",
      [MG_INSTALL]),
    M("cfg_reference_bounded", CFG,
      'if etp > 1 and MokOptions.from_config(config).backend != "reference":', "if etp > 1:",
      [MG_INSTALL]),
    M("cfg_empty_scopes_not_whole_layer", CFG,
      'whole_layer = not scopes or "full" in scopes', 'whole_layer = "full" in scopes',
      [MG_INSTALL]),
    M("cfg_full_iteration_accepted", CFG,
      'if impl == "full_iteration" and not drop_and_pad and factor is None:', "if False:",
      [MG_INSTALL]),
    # ------------------------------------------- Megatron 0.19's per-rank budget (budget.py)
    M("cfg_budget_full_iteration_refused", CFG,
      'if impl == "full_iteration" and not drop_and_pad and factor is None:',
      'if impl == "full_iteration" and not drop_and_pad:', [MG_INSTALL]),
    M("cfg_paged_stash_refused_with_factor", CFG,
      'if getattr(config, "moe_paged_stash", False) and factor is None:',
      'if getattr(config, "moe_paged_stash", False):', [MG_INSTALL]),
    M("cfg_budget_factor_zero_accepted", CFG,
      "    if not (math.isfinite(factor) and factor > 0):",
      "    if not (math.isfinite(factor) and factor >= 0):", [MG_INSTALL]),
    M("mg_budget_without_etp", DISP, "self.topk * self.etp, factor, align",
      "self.topk, factor, align", [MG_INSTALL]),
    M("mg_budget_with_drop_and_pad", DISP,
      "        if factor is None or self.drop_and_pad:\n            return None",
      "        if factor is None:\n            return None", [MG_INSTALL]),
    M("mg_budget_factor_from_config", DISP,
      "        factor = self._comm_manager.moe_expert_rank_capacity_factor\n",
      "        factor = getattr(self.config, 'moe_expert_rank_capacity_factor', None)\n",
      [MG_INSTALL, MG_BUDGET]),
    M("mg_budget_flag_not_accumulated", DISP,
      "            self._comm_manager.accumulate(res.over_budget)", "            pass",
      [MG_INSTALL, MG_BUDGET]),
    M("mg_budget_rows_not_sliced", DISP,
      "            hidden_states, probs = hidden_states[:kept], probs[:kept]\n", "",
      [MG_INSTALL, MG_BUDGET]),
    M("mg_budget_output_not_padded", DISP,
      "            hidden_states = budget.pad_rows(hidden_states, pad_to)", "            pass",
      [MG_INSTALL, MG_BUDGET]),
    M("mg_budget_full_iteration_unchecked", DISP,
      "        if problem:\n            raise MokConfigError(f\"MokTokenDispatcher cannot run this "
      "config:\\n  - {problem}\")", "        pass", [MG_INSTALL]),
    M("bud_flag_overwritten", BUD, "        flag |= dropped.view(1)",
      "        flag.copy_(dropped.view(1))", [MG_INSTALL, MG_BUDGET]),
    M("bud_flag_replaced", BUD, "        flag |= dropped.view(1)",
      "        self.over_budget = flag | dropped.view(1)", [MG_INSTALL]),
    M("bud_reset_noop", BUD, "            self.over_budget.fill_(0)", "            pass",
      [MG_INSTALL, MG_BUDGET]),
    M("bud_budget_off_by_one", BUD, "    rows = int(num_tokens * routes_per_token * factor)",
      "    rows = int(num_tokens * routes_per_token * factor) + 1", [MG_INSTALL, MG_BUDGET]),
    M("bud_no_pad_multiple", BUD,
      "    return buffer_alignment * pad // math.gcd(buffer_alignment, pad)",
      "    return buffer_alignment", [MG_INSTALL]),
    M("bud_fused_experts_exact", BUD, "    return PADDED\n\n\ndef kept_rows",
      "    return EXACT\n\n\ndef kept_rows", [MG_INSTALL]),
    M("bud_declared_rows_ignored", BUD,
      "    if declared is not None:\n        return PADDED if declared else EXACT\n", "",
      [MG_INSTALL, MG_BUDGET]),
    M("bud_fp8_self_padding_padded", BUD,
      "    if quantized and not getattr(config, \"moe_router_padding_for_quantization\", False):\n"
      "        return EXACT\n", "", [MG_INSTALL]),
    M("bud_host_counts_captured", BUD, "    if counts_on_host:\n        return (",
      "    if False:\n        return (", [MG_INSTALL]),
    M("ver_full_iteration_016_without_impl", VER,
      '        elif impl == "local":\n            impl = "full_iteration"',
      '        else:\n            impl = "full_iteration"', [MG_INSTALL]),
    M("cfg_tmax_zero_accepted", CFG, "if t_max is not None and t_max <= 0:",
      "if t_max is not None and t_max < 0:", [MG_INSTALL]),
    # ---------------------------------------------------------------- launch policy
    M("lp_pdl_shares_gpu", LP, '(pdl_env[:1] != "0" and not shares_gpu)',
      '(pdl_env[:1] != "0" and shares_gpu)', [LPT]),
    M("lp_small_sms_or", LP, "if num_sms is None and not shares_gpu else 0",
      "if num_sms is None or not shares_gpu else 0", [LPT]),
    M("lp_small_tokens_threshold", LP, "if small > 0 else -1", "if small >= 0 else -1", [LPT]),
    M("lp_negative_sms_kept", LP, 'small = max(0, env_int(environ, "MOK_SMALL_CALL_SMS", default_small))',
      'small = env_int(environ, "MOK_SMALL_CALL_SMS", default_small)', [LPT]),
    # ------------------------------------- the correctness gates of the main job and the suite
    M("main_combine_unchecked", MAIN, "    ok &= torch.equal(y, y_ref)\n", "", [MAINT]),
    M("main_rows_unchecked", MAIN, "        ok &= torch.equal(res.tokens, all_x[s_t[:, 0], s_t[:, 1]])\n", "",
      [MAINT]),
    M("main_failure_exits_zero", MAIN, "    if int(flag) != 0:\n        sys.exit(1)", "    if False:\n        sys.exit(1)",
      [MAINT]),
    M("suite_rows_unchecked", SUITE, "ok_t = C.bitwise_equal(tokens, inp.exp_tokens)", "ok_t = True",
      [BENCHT]),
    M("suite_combine_contract_unchecked", SUITE,
      'C.bitwise_equal(y, orc["y_contract"]), f"rel err', 'True, f"rel err', [BENCHT]),
    M("suite_gate_ignores_failures", SUITE,
      '"checks_passed": all(c["passed"] for c in checks) and len(checks) > 0,',
      '"checks_passed": len(checks) > 0,', [BENCHT]),
    M("bitwise_equal_by_value", BCOMMON, "        it = _SAME_SIZE_INT[a.element_size()]\n"
      "        return bool(torch.equal(a.contiguous().view(it), b.contiguous().view(it)))\n",
      "        return bool(torch.equal(a, b))\n", [BENCHT]),
    M("a2a_counts_own_rank_only", A2A, "return out.view(self.world, *counts.shape)",
      "return counts.unsqueeze(0).expand(self.world, *counts.shape)", [BENCHT]),
    # -------------------------------------------------- device error reports (host decoding)
    M("err_word64_sign_extends", ERR, "(int(lo) & 0xFFFFFFFF) | (int(hi) << 32)", "int(lo) | (int(hi) << 32)",
      [ERRT]),
    M("err_noted_kind_zero", ERR, "if (noted >> kind) & 1:", "if (noted >> kind) & 1 or kind == 0:", [ERRT]),
    M("err_row_bytes_unmasked", ERR, "row = 16 * (detail & ((1 << ROW_TWO_SOURCES_BIT) - 1))",
      "row = 16 * detail", [ERRT, BINDT]),
    # ------------------------------------------------------------- megatron-core version gate
    M("ver_rc_digits_kept", VER, "            if not ch.isdigit():\n                break",
      "            if not ch.isdigit():\n                continue", [MG_INSTALL]),
    M("ver_max_exclusive", VER, "if MIN_SUPPORTED <= major_minor <= MAX_SUPPORTED:",
      "if MIN_SUPPORTED <= major_minor < MAX_SUPPORTED:", [MG_INSTALL]),
    M("ver_skip_env_zero_skips", VER, 'if os.environ.get(SKIP_CHECK_ENV, "") not in ("", "0"):',
      'if os.environ.get(SKIP_CHECK_ENV, "") not in ("",):', [MG_INSTALL]),
    # ------------------------------------ CUDA backend: the host logic a test reaches on a CPU
    M("cuda_destroy_not_marked", CB, "        self.destroyed = True\n", "        pass\n", [SAFETY]),
    M("cuda_destroyed_called", CB, "        if self.destroyed:\n", "        if False:\n", [SAFETY]),
    # ------------------------------------------------------------------------- peer memory
    M("pm_cross_host_sharing_allowed", PM, "    if len(hosts) > 1:\n", "    if len(hosts) > 2:\n", [PMT]),
    M("pm_shared_gpu_asked_for_a_path", PM, "if r == rank or h != host or u == uuid:",
      "if r == rank or h != host:", [PMT]),
    M("pm_error_on_no_pairs", PM, "    if not pairs:\n        return None\n", "", [PMT]),
    # -------------------------------------------- one NVLink domain across hosts (item 60)
    M("pm_hosts_never_checked", PM, "        if len({k[0] for k in keys}) > 1:\n",
      "        if len({k[0] for k in keys}) > 2:\n", [NVD]),
    M("nvd_one_host_refused", NVD_SRC, "    if len(by_host) < 2:\n        return None\n", "", [NVD]),
    M("nvd_gap_in_fabric_passes", NVD_SRC, "    if None not in known and len(set(known)) == 1:",
      "    if len(set(known) - {None}) == 1:", [NVD]),
    M("nvd_override_on_some_ranks", NVD_SRC, "        if all(assumes):", "        if any(assumes):", [NVD]),
    M("nvd_unjoined_fabric_counts", NVD_SRC,
      "if f[\"state\"] != FABRIC_STATE_COMPLETED or f[\"status\"] != 0 or not int(f[\"cluster\"], 16):",
      "if f[\"status\"] != 0 or not int(f[\"cluster\"], 16):", [NVD]),
    M("nvd_zero_cluster_counts", NVD_SRC,
      "if f[\"state\"] != FABRIC_STATE_COMPLETED or f[\"status\"] != 0 or not int(f[\"cluster\"], 16):",
      "if f[\"state\"] != FABRIC_STATE_COMPLETED or f[\"status\"] != 0:", [NVD]),
    # ------------------------------------------------------------------------------ launcher
    M("launch_path_is_cwd", LAUNCH, "sys.path[0:1] = [os.path.dirname(os.path.abspath(script))]",
      "sys.path[0:1] = [os.getcwd()]", [MG_ENTRY]),
    M("launch_rank0_any", LAUNCH, 'return os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")) == "0"',
      "return True", [MG_ENTRY]),
    # ------------------------------------------------------- Megatron-Bridge (install item 5)
    M("bridge_overlap_not_as_alltoall", PATCH,
      '            with _as_dispatcher(model_cfg, "alltoall"):\n                return orig(self, model_cfg, *args, **kwargs)',
      '            with contextlib.nullcontext():\n                return orig(self, model_cfg, *args, **kwargs)',
      [MG_INSTALL]),
    M("bridge_finder_not_installed", PATCH, "    sys.meta_path.insert(0, finder)\n",
      "    pass\n", [MG_INSTALL]),
    # ------------------------------------------------------------- receive budget (item 54)
    M("ref_budget_keeps_one_row_more", REF, "            keep = pos < recv_budget\n",
      "            keep = pos <= recv_budget\n", [BUDGET]),
    M("ref_budget_counts_unclamped", REF, "            tpe = budget_counts(tpe, recv_budget)\n", "",
      [BUDGET]),
    M("ref_budget_flag_off_by_one", REF, "            over_budget = rows_received > recv_budget\n",
      "            over_budget = rows_received >= recv_budget\n", [BUDGET]),
    M("ref_budget_rows_unclamped", REF, "            R = min(R, recv_budget)\n", "", [BUDGET]),
    M("val_budget_alignment_unchecked", VAL,
      "    if m % buf.expert_alignment != 0:\n        # Each expert's", "    if False:\n        # Each expert's",
      [BUDGET]),
    M("val_budget_with_rows_per_expert", VAL,
      "    if rows_per_expert is not None:\n        raise ValueError(\"pass rows_per_expert or recv_budget",
      "    if False:\n        raise ValueError(\"pass rows_per_expert or recv_budget", [BUDGET]),
    M("buf_budget_on_cached_dispatch", BUF,
      "            if rows_per_expert is not None or recv_budget is not None:\n",
      "            if rows_per_expert is not None:\n", [BUDGET]),
    # -------------------------------------------------- loopback host reads, stall log (item 78)
    M("loopback_reads_not_installed", LOOP, "    settle_host_reads()                 # (they act",
      "    pass                 # (they act", [f"{LOOPT}::test_loopback_run_installs_the_host_read_guards"]),
    M("loopback_mask_index_unguarded", LOOP, "isinstance(i, torch.Tensor) and i.dtype == torch.bool",
      "isinstance(i, torch.Tensor) and i.dtype == torch.uint8", [LOOPT_READS]),
    M("loopback_to_settles_always", LOOP, "any(map(_is_cpu_device, a + tuple(k.values())))", "True",
      [LOOPT_READS]),
    M("loopback_reads_wrapped_twice", LOOP, "    if _guards_installed:\n        return\n",
      "    if False:\n        return\n", [LOOPT_READS]),
    M("loopback_stall_not_logged", LOOP, "                _log_stall(stalls[-1])\n", "",
      [f"{LOOPT}::test_loopback_stall_log_written_while_the_run_is_still_going"]),
]


def snippet_problems(root: str = ROOT, mutants: Sequence[Mutant] = MUTANTS) -> List[str]:
    """Every way the list has rotted: a file gone, a snippet not exactly once in its file, a
    mutant that changes nothing, a duplicate name, an equivalent mutant without a reason, a
    test target that does not exist."""
    problems, names = [], set()
    for m in mutants:
        if m.name in names:
            problems.append(f"{m.name}: duplicate name")
        names.add(m.name)
        if m.original == m.replacement:
            problems.append(f"{m.name}: the replacement is the original")
        if m.equivalent and not m.reason.strip():
            problems.append(f"{m.name}: equivalent without a reason")
        if not m.tests:
            problems.append(f"{m.name}: no test target")
        for t in m.tests:
            if not os.path.isfile(os.path.join(root, t.split("::")[0])):
                problems.append(f"{m.name}: test target {t} does not exist")
        try:
            with open(os.path.join(root, m.path)) as f:
                text = f.read()
        except OSError as e:
            problems.append(f"{m.name}: {m.path}: {e}")
            continue
        n = text.count(m.original)
        if n != 1:
            problems.append(f"{m.name}: the original snippet occurs {n} times in {m.path}")
    return problems


_IGNORE = shutil.ignore_patterns(".git", ".venv", "venv", "__pycache__", ".pytest_cache", "build",
                                 "*.so", "*.egg-info", "results", "runs")


def _first_failure(output: str) -> str:
    for pat in (r"^(?:FAILED|ERROR) (\S+)", r"^_{3,} (\S.*?) _{3,}$"):
        m = re.search(pat, output, re.M)
        if m:
            return m.group(1)
    lines = [ln for ln in output.strip().splitlines() if ln.strip()]
    return lines[-1][:120] if lines else "(no output)"


def run_mutant(m: Mutant, copy_root: str, timeout: float) -> Tuple[str, str, float]:
    """Apply ``m`` in ``copy_root``, run its targets, restore. Returns (result, detail, seconds)."""
    path = os.path.join(copy_root, m.path)
    with open(path) as f:
        original_text = f.read()
    if original_text.count(m.original) != 1:
        return "ERROR", "snippet not found exactly once", 0.0
    env = dict(os.environ)
    env["PYTHONPATH"] = copy_root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *m.tests]
    t0 = time.time()
    try:
        with open(path, "w") as f:
            f.write(original_text.replace(m.original, m.replacement))
        try:
            p = subprocess.run(cmd, cwd=copy_root, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return "KILLED", f"timeout after {timeout:.0f} s", time.time() - t0
    finally:
        with open(path, "w") as f:
            f.write(original_text)
    dt = time.time() - t0
    if p.returncode == 0:
        return "SURVIVED", "", dt
    if p.returncode == 5:           # nothing collected: a bad target, not a kill
        return "ERROR", "no tests collected", dt
    return "KILLED", _first_failure(p.stdout), dt


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("prefixes", nargs="*", help="run only mutants whose name starts with one of these")
    ap.add_argument("--list", action="store_true", help="print the mutants and exit")
    ap.add_argument("--check", action="store_true", help="check the snippets and exit")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per mutant")
    ap.add_argument("--keep", action="store_true", help="keep the temporary copy")
    args = ap.parse_args(argv)

    problems = snippet_problems()
    if problems:
        print("the mutant list has rotted:\n  " + "\n  ".join(problems))
        return 1
    chosen = [m for m in MUTANTS if not args.prefixes or m.name.startswith(tuple(args.prefixes))]
    if args.check:
        print(f"{len(MUTANTS)} mutants, every snippet found exactly once")
        return 0
    if args.list:
        for m in chosen:
            eq = "  [equivalent]" if m.equivalent else ""
            print(f"{m.name:36s} {m.path}:{m.line}{eq}\n    - {m.original!r}\n    + {m.replacement!r}")
        return 0

    tmp = tempfile.mkdtemp(prefix="mok_mutation_")
    copy_root = os.path.join(tmp, "repo")
    shutil.copytree(ROOT, copy_root, ignore=_IGNORE)
    rows, bad = [], []
    try:
        for m in chosen:
            line = m.line_in(copy_root)
            result, detail, dt = run_mutant(m, copy_root, args.timeout)
            if m.equivalent and result == "SURVIVED":
                shown = "equivalent"
            elif m.equivalent and result == "KILLED":
                shown = "KILLED (marked equivalent: fix the list)"
                bad.append(m.name)
            else:
                shown = result
                if result != "KILLED":
                    bad.append(m.name)
            rows.append((m, line, shown, detail, dt))
            print(f"{m.name:36s} {m.path}:{line!s:<5} {shown:10s} {dt:6.1f}s  {detail}", flush=True)
    finally:
        if args.keep:
            print(f"copy kept at {copy_root}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)

    print("\n| mutant | where | change | result |\n|---|---|---|---|")
    for m, line, shown, detail, _ in rows:
        what = f"`{m.original.strip()[:60]}` -> `{m.replacement.strip()[:60]}`".replace("\n", " ")
        res = f"{shown} ({detail})" if detail else shown
        if m.equivalent:
            res += f": {m.reason}"
        print(f"| {m.name} | {m.path}:{line} | {what} | {res} |")
    killed = sum(1 for _, _, s, _, _ in rows if s == "KILLED")
    equiv = sum(1 for _, _, s, _, _ in rows if s == "equivalent")
    print(f"\n{killed} killed, {equiv} equivalent, {len(bad)} not accounted for: {bad}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

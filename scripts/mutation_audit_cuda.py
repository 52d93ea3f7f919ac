"""Mutation audit of the CUDA library: do the GPU tests fail when a kernel is wrong?

Each mutant below is one small change a real bug could make in ``csrc/`` (a row order, an
off-by-one, a missing zero, a check that no longer fires, a ring wait that no longer waits).
The audit builds one library per mutant, then runs the GPU tests that should catch it against
that library (``MOK_CUDA_LIB``) and, for a mutant the tests miss, the random fuzzer
(``scripts/fuzz_dispatch.py``). A mutant the tests miss is a hole in the tests, unless the
list marks it ``expected`` with the reason (e.g. a race one GPU cannot provoke).

    python scripts/mutation_audit_cuda.py check                       # CPU: the list matches csrc/
    python scripts/mutation_audit_cuda.py build --out .mutants [--only a,b]   # CPU with nvcc
    python scripts/mutation_audit_cuda.py run --libs .mutants --out DIR [--only a,b]
                                              [--fuzz-seconds 30]     # on a GPU

``build`` copies ``csrc/`` to a temporary folder per mutant, applies the change (each original
snippet must occur exactly once: ``check``), compiles with the Makefile and stores the library
xz-compressed (``NAME.so.xz``, ~1 MB) with ``manifest.json`` (commit, mutants). ``run`` first
runs every selection with the unmutated library (``megatron_mok/_lib``; every selection must
pass, or the audit stops: a red baseline proves nothing; tests that need 2+ GPUs skip there as
with the mutants), then each mutant (:func:`pytest_verdict`): a library that does not load is
``invalid``; a failed test (or the selection's time limit, for a mutant that hangs, or a crash)
is ``killed``; pytest passing with fewer tests passed than the baseline is ``invalid``, with as
many ``survived`` unless the fuzzer then finds it. Writes ``DIR/mutation_audit.json`` and
prints a table; exits 1 when a mutant that is not ``expected`` survived.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import lzma
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

ROOT = Path(__file__).resolve().parent.parent
CSRC = ROOT / "csrc"

# The CUDA regression sample of the session scripts (~106 tests, ~35 s on one H200): world size
# 1, loopback W = 2-4 bitwise against the reference, static shape, cached, graphs, ring wraps,
# alignment, rows_per_expert, the one-call launch.
SAMPLE = [
    "tests/test_cuda_backend.py", "tests/test_cuda_loopback.py", "-k",
    "world_size_1 or (loopback_matches_reference and 3]) or loopback_static_shape or loopback_cached"
    " or (loopback_matches_reference and wide_rows)"
    " or loopback_graph or (loopback_ring_wraps and 3-) or loopback_expert_alignment"
    " or loopback_rows_per_expert or launch_launches_nothing or one_call_dispatch",
]
NARROW = ["tests/test_fp8_dispatch.py", "tests/test_cuda_loopback.py", "tests/test_cuda_backend.py",
          "-k", "prob_grads_only or narrow_rows"]
FP8 = ["tests/test_fp8_dispatch.py", "-k", "cuda or loopback"]


@dataclasses.dataclass(frozen=True)
class Mutant:
    name: str
    file: str                                   # under csrc/
    edits: Tuple[Tuple[str, str], ...]          # (original, replacement), each original once
    tests: Tuple[str, ...]                      # pytest arguments (files, -k ...)
    what: str                                   # the bug it stands for
    timeout_s: int = 150                        # for the selection (a hang counts as killed)
    expected: str = ""                          # why surviving is expected ("" = must be killed)


MUTANTS: List[Mutant] = [
    Mutant("fill_task_rows_descending", "layout/dispatch_fill.cu",
           (("pos += e2 < e || (e2 == e && k2 < k);", "pos += e2 > e || (e2 == e && k2 < k);"),),
           tuple(SAMPLE), "a task lists its rows by descending expert: combine sums a token's rows "
           "in another order than the contract's"),
    Mutant("fill_padding_prob_kept", "layout/dispatch_fill.cu",
           (("  out.src_token[row] = -1;\n  out.probs[row] = 0.f;", "  out.src_token[row] = -1;"),),
           tuple(SAMPLE), "rows with no source keep whatever prob the memory held (static padding, "
           "zero rows)"),
    Mutant("fill_rows_per_expert_off_by_one", "layout/dispatch_fill.cu",
           (("row >= (e + 1) * fixed_rows) row = -1;", "row > (e + 1) * fixed_rows) row = -1;"),),
           ("tests/test_cuda_backend.py", "tests/test_cuda_loopback.py", "-k", "rows_per_expert"),
           "rows_per_expert N keeps N + 1 rows of an overflowing expert: its last row lands in the "
           "next expert's first row"),
    Mutant("layout_expert_id_E_accepted", "layout/dispatch_layout.cu",
           (("if (e < -1 || e >= r.num_experts) {", "if (e < -1 || e > r.num_experts) {"),),
           ("tests/test_cuda_backend.py", "tests/test_cuda_loopback.py", "-k", "bad_expert"),
           "an expert id equal to the number of experts is taken as valid (routes to a rank past "
           "the last)"),
    Mutant("layout_alignment_full_gap", "layout/dispatch_layout.cu",
           (("h.gap_len[e] = (A - count % A) % A;", "h.gap_len[e] = A - count % A;"),),
           ("tests/test_cuda_backend.py", "tests/test_cuda_loopback.py", "-k", "alignment"),
           "an expert whose rows are already a multiple of the alignment gets a whole block of zero "
           "rows"),
    # The receive budget (NOTES item 54; added in session 36, not yet run by an audit).
    Mutant("budget_drop_reported_as_error", "layout/dispatch_layout.cu",
           (("if (rows > out.row_cap && !out.drop_over_cap) report_error(c, kRecvOverflow",
             "if (rows > out.row_cap) report_error(c, kRecvOverflow"),),
           ("tests/test_recv_budget.py", "-k", "cuda_budget_semantics"),
           "a receive budget's drop is reported as a static-shape overflow: the Buffer breaks"),
    Mutant("budget_rows_received_clamped", "layout/dispatch_layout.cu",
           (("out.tokens_per_expert[E + 1] = rows;",
             "out.tokens_per_expert[E + 1] = min(static_cast<int64_t>(rows), out.row_cap);"),),
           ("tests/test_recv_budget.py", "-k", "cuda_budget_semantics"),
           "the rows received are clamped to the budget: the over-budget flag is never set and a "
           "caller that must not lose tokens never reruns the step"),
    Mutant("scan_overflow_by_one_unreported", "layout/dispatch_layout.cu",
           (("if (rows > out.row_cap && !out.drop_over_cap) report_error(c, kRecvOverflow",
             "if (rows > out.row_cap + 1 && !out.drop_over_cap) report_error(c, kRecvOverflow"),),
           ("tests/test_cuda_backend.py", "tests/test_cuda_loopback.py", "-k", "static_overflow or static_shape"),
           "a static-shape dispatch one row over max_recv_tokens is not reported (its last row is "
           "lost silently)"),
    Mutant("scan_overflow_counts_not_clamped", "layout/dispatch_layout.cu",
           (("      out.tokens_per_expert[e] = min(static_cast<int64_t>(next), out.row_cap) -\n"
             "                                 min(static_cast<int64_t>(first), out.row_cap);",
             "      out.tokens_per_expert[e] = next - first;"),),
           ("tests/test_cuda_backend.py", "tests/test_cuda_loopback.py", "-k", "static_overflow"),
           "a static-shape dispatch over max_recv_tokens reports counts of rows it did not write "
           "(their sum past max_recv_tokens): experts that read their counts run past the rows"),
    Mutant("api_combine_alignment_unchecked", "api/mok_api.cu",
           (("if ((row_cap > 0 && (eo == 0 || eo % 16 != 0)) || (num_tokens > 0 && (yp == 0 || yp % 16 != 0)))",
             "if (false)"),),
           ("tests/test_cuda_library_abi.py", "-k", "combine_refuses_misaligned"),
           "the combine launches on a misaligned expert_out or y (its 16-byte vector loads end the "
           "CUDA context) instead of refusing it"),
    Mutant("transfer_static_padding_not_zeroed", "kernels/dispatch_transfer.cu",
           (("       v += static_cast<size_t>(n_warps) * kWarpSize)\n    out[v] = zero;",
             "       v += static_cast<size_t>(n_warps) * kWarpSize)\n    (void)out[v];"),),
           tuple(SAMPLE), "static-shape rows past R keep old memory instead of zeros"),
    Mutant("transfer_expert_gap_not_zeroed", "kernels/dispatch_transfer.cu",
           (("for (int v = lane; v < sh.vec_per_row; v += kWarpSize) dst[v] = zero;",
             "for (int v = lane; v < sh.vec_per_row; v += kWarpSize) (void)dst[v];"),),
           ("tests/test_cuda_backend.py", "tests/test_cuda_loopback.py", "-k", "alignment or rows_per_expert"),
           "the zero rows after an expert's rows (alignment, rows_per_expert) keep old memory"),
    Mutant("combine_ranks_descending", "kernels/combine/consume.cuh",
           (("for (unsigned m = holders; m != 0; m &= m - 1) add_rank(__ffs(m) - 1);  // ascending ranks",
             "for (unsigned m = holders; m != 0; m &= ~(1u << (31 - __clz(m)))) add_rank(31 - __clz(m));"),
            ("        for (int d = 0; d < W; ++d)\n          if (pos(d) >= 0) add_rank(d);",
             "        for (int d = W - 1; d >= 0; --d)\n          if (pos(d) >= 0) add_rank(d);")),
           tuple(SAMPLE), "the owner sums the ranks' partials in descending rank order, where it sums "
           "them itself (calls split over warps, or own partials not staged): bitwise different "
           "from 3 ranks on, with float32 rows (2 partials add the same either way)"),
    Mutant("combine_staged_ranks_descending", "kernels/combine/consume.cuh",
           (("const int d = lane < n ? __fns(holders, 0, lane + 1) : 0;",
             "const int d = lane < n ? __fns(holders, 0, n - lane) : 0;"),),
           tuple(SAMPLE), "with the own partials staged (a token per warp), the owner sums the "
           "holders' partials in descending rank order"),
    Mutant("combine_prob_grad_last_rank_only", "kernels/combine/consume.cuh",
           (("          part = partial_side_value(c, sh, d, q, lane);\n        }\n        val += part;",
             "          part = partial_side_value(c, sh, d, q, lane);\n        }\n        val = part;"),),
           tuple(SAMPLE), "the prob gradient of a token held by several ranks keeps only the last "
           "rank's part"),
    Mutant("narrow_last_slot_grad_dropped", "kernels/combine/narrow.cuh",
           (("            if (kk < K) grad[kk] += side[kk];", "            if (kk < K - 1) grad[kk] += side[kk];"),),
           tuple(NARROW), "the narrow combine (hidden 8, FP8 backward) drops the last top-k slot's "
           "gradient from remote ranks"),
    Mutant("fp8_pair_scale_row_of_own_token", "kernels/dispatch_transfer.cu",
           (("src2 = b_vecs > 0 ? x2 + static_cast<size_t>(t) * b_vecs : src;",
             "src2 = b_vecs > 0 ? x2 + static_cast<size_t>(t / 2) * b_vecs : src;"),),
           tuple(FP8), "an FP8 pair read in place takes an own token's scales from another token's row"),
    Mutant("ring_format_tag_ignored", "kernels/dispatch_transfer.cu",
           (("if (dispatch_ready_format(ready) != sh.row_format) {",
             "if (false && dispatch_ready_format(ready) != sh.row_format) {"),),
           ("tests/test_fp8_dispatch.py", "-k", "one_rank"),
           "a rank reads a peer's ring slot staged in another row format (FP8 pair vs tokens) "
           "without noticing (the cached dispatch runs no layout to catch it)"),
    Mutant("ring_slot_index_not_wrapped", "include/mok/ring.h",
           (("    if (x >= n) x -= n;\n    if (x >= n) x %= n;", "    if (x > n) x -= n;\n    if (x > n) x %= n;"),),
           tuple(SAMPLE), "a call whose chunks cross the ring's end uses slot N (past the ring) "
           "once"),
    Mutant("ring_reuse_without_wait", "include/mok/ring.h",
           (("  if (prev != 0)\n    for (int reader", "  if (prev == ~0ull)\n    for (int reader"),),
           tuple(SAMPLE), "a producer overwrites a ring slot without waiting for its readers to "
           "release the previous generation"),
    # Added after session 26's device calls (built and CPU-checked; first GPU run: session 27).
    Mutant("dispatch_split_slice_short", "kernels/dispatch_transfer.cu",
           (("vec_hi = min(vec_lo + slice, sh.vec_per_row);", "vec_hi = min(vec_lo + slice - 1, sh.vec_per_row);"),),
           tuple(SAMPLE), "a small dispatch split over warps copies each slice but its last vector"),
    Mutant("combine_split_last_step_dropped", "kernels/combine/shape.cuh",
           (("count = (part + 1) * S / P - first;", "count = (part + 1) * S / P - first - (part + 1 == P ? 1 : 0);"),),
           tuple(SAMPLE), "a combine split over warps never sums the last part's last step (its "
           "outputs keep old memory)"),
    Mutant("scan_tile_carry_lost", "layout/dispatch_layout.cu",
           (("    Store(tmp.store).Store(a + base, v, valid);\n    __syncthreads();\n    carry += total;",
             "    Store(tmp.store).Store(a + base, v, valid);\n    __syncthreads();\n    carry = total;"),),
           ("tests/test_cuda_backend.py", "tests/test_cuda_loopback.py", "-k", "scan_over_tiles"),
           "the layout's scan over several tiles carries only the last tile's total"),
    Mutant("fill_pass_counts_not_reset", "layout/dispatch_fill.cu",
           (("      for (int x = tid; x < kFillWarps * E_local; x += kFillThreads) warp_row[x] = 0;\n", ""),),
           ("tests/test_cuda_backend.py", "tests/test_cuda_loopback.py", "-k", "fill_in_passes"),
           "a chunk filled in several passes counts each pass's rows on top of the last pass's"),
    Mutant("pack_padding_not_zeroed", "kernels/pack_rows.cu",
           (("(v < a_vec + b_vec ? rb[v - a_vec] : zero);", "(v < a_vec + b_vec ? rb[v - a_vec] : out[v]);"),),
           tuple(FP8), "the FP8 pack leaves a packed row's padding as the memory held it"),
    Mutant("ce_stage_scale_plane_off_by_a_row", "kernels/dispatch_transfer.cu",
           (("copy_into_slots(dst + static_cast<size_t>(C) * a_row,", "copy_into_slots(dst + static_cast<size_t>(C - 1) * a_row,"),),
           tuple(FP8), "the copy-engine staging puts an FP8 pair's scale rows one token row early "
           "(over the chunk's last token row)"),
    Mutant("wait_never_times_out", "include/mok/device.h",
           (("if (globaltimer_ns() - start > c.timeout_ns) {",
             "if (false && globaltimer_ns() - start > c.timeout_ns) {"),),
           ("tests/test_cuda_backend.py", "tests/test_cuda_loopback.py", "-k", "missing_peer_times_out"),
           "a wait for a peer that never comes spins forever instead of raising the timeout error "
           "(the loopback test reports a hang after its own 120 s)",
           timeout_s=165),
    # Added in session 29 (built and CPU-checked; first GPU run: session 29).
    Mutant("streamed_produce_rows_reversed", "kernels/combine/produce_streamed.cuh",
           (("        caddr = ring.sum_rows(acc, caddr, n_rows);",
             "        for (int jj = n_rows - 1; jj >= 0; --jj) ring.sum_rows(acc, ring.next(caddr, jj), 1);\n"
             "        caddr = ring.next(caddr, n_rows);"),),
           tuple(SAMPLE), "the streamed produce phase sums a task's expert rows last row first: a "
           "partial not bitwise the contract's (fp32 rows, 3+ rows of a token on one rank)"),
    Mutant("held_rows_batch_reversed", "include/mok/row_sum.h",
           (("    for (int r = 0; r < kBatch; ++r) {\n      const bool live = b + r < h.n && h.row[b + r] < row_cap;\n"
             "#pragma unroll\n      for (int u = 0; u < kU; ++u)\n        if (live && group_live(v0, u, H)) add_raw",
             "    for (int r = kBatch - 1; r >= 0; --r) {\n      const bool live = b + r < h.n && h.row[b + r] < row_cap;\n"
             "#pragma unroll\n      for (int u = 0; u < kU; ++u)\n        if (live && group_live(v0, u, H)) add_raw"),),
           ("tests/test_cuda_loopback.py", "-k",
            "(loopback_matches_reference and wide_rows) or split_over_warps or combine_role_split"
            " or ring_wraps_fp32"),
           "a task's held rows (produce_row: calls split over warps, the role split) are summed in "
           "reverse order within each load batch (2 rows for fp32, 4 for 16-bit rows)",
           timeout_s=300),
    Mutant("fill_prob_from_next_slot", "layout/dispatch_fill.cu",
           (("      wt = w[static_cast<size_t>(t0) * K + i];",
             "      wt = w[static_cast<size_t>(t0) * K + i - i % K + (i % K + 1) % K];"),),
           ("tests/test_cuda_backend.py", "tests/test_cuda_loopback.py", "-k", "world_size_1 or graph_rows_per_expert"),
           "a dispatched row's prob is the one of the next top-k slot of its token (k + 1 mod K)"),
    Mutant("scan_last_expert_count_short", "layout/dispatch_layout.cu",
           (("const int next = e + 1 < E ? h.chunk_rows[HandleArrays::group(c.ws.cfg, e + 1, 0, 0)] : rows;",
             "const int next = e + 1 < E ? h.chunk_rows[HandleArrays::group(c.ws.cfg, e + 1, 0, 0)] : rows - 1;"),),
           ("tests/test_cuda_backend.py", "tests/test_cuda_loopback.py", "-k", "world_size_1 or graph_rows_per_expert"),
           "tokens_per_expert of the last local expert is one short (R itself stays right)"),
    Mutant("fill_skips_pdl_wait", "layout/dispatch_fill.cu",
           (("  pdl_wait_then_release_dependents();  // before the first read of the layout's results",
             "#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900\n"
             "  asm volatile(\"griddepcontrol.launch_dependents;\" ::: \"memory\");  // no griddepcontrol.wait\n"
             "#endif"),),
           ("tests/test_cuda_backend.py", "tests/test_cuda_loopback.py", "-k", "world_size_1 or graph_rows_per_expert"),
           "the fill no longer waits for the layout kernel before it (programmatic dependent launch): "
           "where layout and fill are queued back to back with PDL on (world size 1, static shape, "
           "graphs, rows_per_expert) it reads the counts while the layout still writes them"),
    Mutant("ring_publish_relaxed_no_fence", "include/mok/ring.h",
           (("  __threadfence_system();\n  st_release_sys(r.ready + slot, ready);",
             "  *reinterpret_cast<volatile uint64_t*>(r.ready + slot) = ready;  // no fence, no release"),),
           tuple(SAMPLE), "a ring slot's ready flag is published with a relaxed store and no fence: a "
           "reader may see the flag before the block's staged rows",
           expected="a memory-ordering race one GPU can hardly provoke: every loopback rank's stores "
           "and loads meet in the same L2, and the window between the block's row stores landing and "
           "thread 0's flag store (after __syncthreads) is far shorter than a reader's flag poll plus "
           "its pull; the combine's writers also fence before their arrival count. Guarded by review "
           "(the release rule of ring.h) and by runs over NVLink, not by the one-GPU tests"),
    Mutant("dispatch_chunk_released_by_any_task", "kernels/dispatch_transfer.cu",
           (("      if (atomicAdd(done, 1) + 1 == h.chunk_tasks[s * sh.cpc + j]) {",
             "      if (atomicAdd(done, 1) + 1 >= 1) {"),),
           ("tests/test_cuda_loopback.py", "-k", "(loopback_ring_wraps and 3-) or dispatch_release_per_task"),
           "per-task release (calls larger than the ring): every finished task releases its chunk, so "
           "the producer may restage a slot while other warps still pull the chunk's other tasks",
           timeout_s=300),
    Mutant("streamed_prob_grad_slot_by_position", "kernels/combine/produce_streamed.cuh",
           (("        if (h.task_k[static_cast<size_t>(task) * sh.K + kk] == lane && row < a.row_cap) val = grad_probs[row];",
             "        if (kk == lane && row < a.row_cap) val = grad_probs[row];"),),
           tuple(SAMPLE), "the streamed produce phase (full-width rows) stages a row's prob gradient "
           "under its position in the task (expert order) instead of its top-k slot"),
    # The B1 fix (NOTES item 37): a copy-engine staging after a failed or aborted slot check.
    Mutant("stage_poison_skipped", "kernels/dispatch_transfer.cu",
           (("  if (!__syncthreads_or(!ok)) return;\n  for (int j = threadIdx.x; j < n_chunks; j += blockDim.x) "
             "st_release_sys(mine.ready + j, kReadyPoisoned);",
             "  (void)__syncthreads_or(!ok);"),),
           ("tests/test_cuda_loopback.py", "-k", "lagging"),
           "a staging check that failed or found the rank aborted does not poison its slots: a "
           "reader lagging past the timeout takes the copy's rows (its peer's next call) silently"),
    Mutant("reader_poison_as_rows", "kernels/dispatch_transfer.cu",
           (("        if (ready == kReadyPoisoned) {", "        if (false && ready == kReadyPoisoned) {"),),
           ("tests/test_cuda_loopback.py", "-k", "lagging"),
           "a reader whose wait ends on a poisoned slot does not say its peer stopped (it goes on "
           "to the row-format check, which reports a configuration mismatch instead)"),
    # NOTES item 41: the re-read of each source's slot 0 before the call's release.
    Mutant("ce_recheck_skipped", "kernels/dispatch_transfer.cu",
           (("  if (sh.ce_recheck) {\n    for (int s = threadIdx.x % kWarpSize;",
             "  if (false) {\n    for (int s = threadIdx.x % kWarpSize;"),),
           ("tests/test_cuda_loopback.py", "-k", "past_its_waits"),
           "a reader whose waits all ended before its peer's failed staging poisoned and overwrote "
           "the chunk it was reading returns the mix of both calls' rows without an error"),
    Mutant("ce_recheck_per_task_skipped", "kernels/dispatch_transfer.cu",
           (("        if (sh.ce_recheck && ld_acquire_sys(theirs.ready + slot) == kReadyPoisoned)",
             "        if (false && ld_acquire_sys(theirs.ready + slot) == kReadyPoisoned)"),),
           ("tests/test_cuda_loopback.py", "-k", "past_its_waits and release_per_task"),
           "the per-task release (MOK_DISPATCH_RELEASE_AT_END=0) does not re-read its chunk's slot: "
           "the same race as ce_recheck_skipped, on that schedule"),
    # NOTES item 43: a chunk's routing tables past a block's shared memory.
    Mutant("unfused_count_smem_not_raised", "layout/dispatch_layout.cu",
           (("  if (cudaError_t e = allow_dynamic_smem(count_kernel, count_smem)) return e;\n", ""),),
           ("tests/test_cuda_loopback.py", "-k", "chunks_past_48k"),
           "the unfused layout's count kernel does not ask for more than 48 KiB of shared memory: "
           "chunks of ~1500+ tokens at top-8 fail at its launch"),
    Mutant("create_chunk_smem_unchecked", "api/mok_api.cu",
           (("  if (routing_smem_bytes(num_local_experts, chunk_tokens, topk) > kMaxDynamicSmem) {",
             "  if (false) {"),),
           ("tests/test_cuda_library_abi.py", "-k", "refused_at_create"),
           "mok_create accepts a chunk whose routing tables exceed a block's shared memory: the "
           "first dispatch fails with CUDA's 'invalid argument' instead of a clear error at create"),
    # NOTES item 53: a rank that raises stops its peers at once (mok_stop_rank, wait_published).
    Mutant("stop_rank_poison_skipped", "kernels/stop_rank.cu",
           (("  fill(ws.meta_ready_at(me), M, kReadyPoisoned);\n  fill(RingView::dispatch(ws, me).ready, Nd, kReadyPoisoned);\n"
             "  fill(RingView::combine(ws, me).ready, Nc, kReadyPoisoned);\n", ""),),
           ("tests/test_stop_rank.py", "-k", "loopback and (default or static or phased)"),
           "a rank that stopped does not poison its flags: its peers wait for it until their timeout "
           "and name a timeout instead of the rank", timeout_s=400),
    Mutant("stop_rank_drain_skipped", "kernels/stop_rank.cu",
           (("  drain(c);\n", ""),),
           ("tests/test_stop_rank.py", "-k", "device_error"),
           "a rank stopping after a data error poisons its flags while its peers still read the call "
           "it completed: their call fails (or not) by timing instead of completing",
           expected="a race: the peers' reads must still be in flight when the stop kernel runs, "
                    "which loopback ranks on one GPU may or may not show"),
    Mutant("routing_wait_ignores_poison", "layout/dispatch_layout.cu",
           (("ok = wait_published(c, ws.meta_ready_at(peer) + slot,", "ok = wait_geq(c, ws.meta_ready_at(peer) + slot,"),),
           ("tests/test_stop_rank.py", "-k", "dispatch_refused and default"),
           "a peer's wait for a stopped rank's routing ends on the poison and reads the slot's stale "
           "routing as this call's"),
    Mutant("combine_wait_ignores_poison", "kernels/combine/consume.cuh",
           (("if (!wait_published(c, flag, g + 1, d, kWaitCombineReady, static_cast<int64_t>(g))) return -1;",
             "if (!wait_geq(c, flag, g + 1, d, kWaitCombineReady, static_cast<int64_t>(g))) return -1;"),),
           ("tests/test_stop_rank.py", "-k", "combine_refused and phased"),
           "the phased combine sums a stopped rank's stale partials as this call's, without an error"),
    Mutant("role_split_wait_ignores_poison", "kernels/combine/partials.cuh",
           (("if (!wait_published(c, theirs.ready + sh.slot(me, q / sh.C), g + 1, d, kWaitCombineReady,",
             "if (!wait_geq(c, theirs.ready + sh.slot(me, q / sh.C), g + 1, d, kWaitCombineReady,"),),
           ("tests/test_stop_rank.py", "-k", "combine_refused and role_split"),
           "the role-split combine sums a stopped rank's stale partials as this call's"),
    Mutant("narrow_wait_ignores_poison", "kernels/combine/narrow.cuh",
           (("if (!wait_published(c, RingView::combine(c.ws, c.peers.base[d]).ready",
             "if (!wait_geq(c, RingView::combine(c.ws, c.peers.base[d]).ready"),),
           ("tests/test_stop_rank.py", "-k", "narrow"),
           "the narrow (prob-gradient) combine takes a stopped rank's stale side values as this call's"),
    # NOTES item 57: the peers quote the stopping rank's reason (its stop note).
    Mutant("stop_note_not_written", "kernels/stop_rank.cu",
           (("i += blockDim.x) to[i] = from[i];", "i += blockDim.x) (void)to, (void)from;"),),
           ("tests/test_stop_rank.py", "-k", "loopback and (default or narrow)"),
           "the stop kernel leaves no note: the peers' errors say \"see its message\" and carry no "
           "reason, in a job where that message is in another rank's log"),
    Mutant("stop_note_read_from_self", "api/mok_api.cu",
           (("const char* src = ctx->comm.peers.base[peer] + ctx->comm.ws.stop_note;",
             "const char* src = ctx->comm.peers.base[ctx->comm.rank] + ctx->comm.ws.stop_note;"),),
           ("tests/test_stop_rank.py", "-k", "loopback and (default or narrow)"),
           "a peer reads its own (empty) note instead of the stopped rank's: no reason quoted"),
    # NOTES item 59: a rank stopped by a peer passes the peer's note on, origin included.
    Mutant("stop_note_origin_is_self", "api/mok_api.cu",
           (("  note.origin = origin;", "  note.origin = ctx->comm.rank;"),),
           ("tests/test_stop_rank.py", "-k", "loopback and (default or narrow)"),
           "a rank stopped by a peer's stop names itself as the origin: a chain of stops names the "
           "wrong rank (before item 59 only a chain, a race, showed it)"),
    # NOTES item 46: a protocol error replaces an unread data error in the report.
    Mutant("data_error_hides_timeout", "include/mok/device.h",
           (("  while (is_data_error(prev) && !is_data_error(code)) {",
             "  while (false) {"),),
           ("tests/test_cuda_loopback.py", "-k", "timeout_after_an_unread_data_error"),
           "a data error recorded first keeps the report: a later timeout does not abort this "
           "rank's other waits (each runs to its own timeout) and check_errors names the data error"),
]


def _apply(text: str, m: Mutant) -> str:
    for old, new in m.edits:
        n = text.count(old)
        if n != 1:
            raise ValueError(f"mutant {m.name}: the original snippet occurs {n} times in csrc/{m.file} "
                             f"(must be once): {old!r}")
        text = text.replace(old, new)
    return text


def check(mutants: List[Mutant]) -> List[str]:
    """Problems with the list against csrc/ as it is now (empty: every mutant applies)."""
    problems, names = [], set()
    for m in mutants:
        if m.name in names:
            problems.append(f"duplicate mutant name {m.name}")
        names.add(m.name)
        path = CSRC / m.file
        if not path.is_file():
            problems.append(f"{m.name}: no file csrc/{m.file}")
            continue
        text = path.read_text()
        try:
            mutated = _apply(text, m)
        except ValueError as e:
            problems.append(str(e))
            continue
        if mutated == text:
            problems.append(f"{m.name}: the change changes nothing")
        if not m.tests or not any(t.startswith("tests/") for t in m.tests):
            problems.append(f"{m.name}: no test file to run")
    return problems


def _select(names: Optional[str]) -> List[Mutant]:
    if not names:
        return list(MUTANTS)
    wanted = names.split(",")
    by_name = {m.name: m for m in MUTANTS}
    unknown = [n for n in wanted if n not in by_name]
    if unknown:
        raise SystemExit(f"unknown mutants: {unknown}; known: {sorted(by_name)}")
    return [by_name[n] for n in wanted]


def _commit() -> str:
    """The commit to record (the package's reader: ``MOK_COMMIT`` first, as the device scripts
    set it, else git's short HEAD)."""
    sys.path.insert(0, str(ROOT))
    try:
        from megatron_mok.version import source_commit
    finally:
        sys.path.remove(str(ROOT))
    return source_commit()


def build(out: Path, mutants: List[Mutant]) -> int:
    out.mkdir(parents=True, exist_ok=True)
    # Kept across builds of some mutants (--only): each entry records the commit it was built at.
    old = out / "manifest.json"
    manifest = json.loads(old.read_text()) if old.is_file() else {"mutants": {}}
    commit = _commit()
    failed = 0
    for i, m in enumerate(mutants, 1):
        t0 = time.monotonic()
        with tempfile.TemporaryDirectory() as tmp:
            src = Path(tmp) / "csrc"
            shutil.copytree(CSRC, src)
            f = src / m.file
            f.write_text(_apply(f.read_text(), m))
            lib_dir = Path(tmp) / "lib"
            r = subprocess.run(["make", "-C", str(src), "-s", f"OUT={lib_dir}"],  # one nvcc command
                               capture_output=True, text=True)
            if r.returncode != 0:
                failed += 1
                print(f"[{i}/{len(mutants)}] {m.name}: BUILD FAILED\n{r.stderr[-2000:]}", flush=True)
                continue
            data = (lib_dir / "libmok_cuda.so").read_bytes()
            (out / f"{m.name}.so.xz").write_bytes(lzma.compress(data, preset=6))
        manifest["mutants"][m.name] = {"file": m.file, "what": m.what, "commit": commit}
        print(f"[{i}/{len(mutants)}] {m.name}: built in {time.monotonic() - t0:.0f} s", flush=True)
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return 1 if failed else 0


# "108 passed, 562 deselected in 30.76s" (-q), or the same between "=" rules.
_SUMMARY = re.compile(r"^=*\s*(\d+ \w+(?:, \d+ \w+)*) in [0-9.]+s", re.M)


def _counts(output: str) -> Dict[str, int]:
    """pytest's final line, e.g. '3 failed, 100 passed, 2 skipped in 30.1s' -> counts."""
    found = _SUMMARY.findall(output)
    counts: Dict[str, int] = {}
    if found:
        for part in found[-1].split(","):
            words = part.strip().split()
            if len(words) >= 2 and words[0].isdigit():
                counts[words[1].rstrip(",")] = int(words[0])
    return counts


def _pytest(tests: Tuple[str, ...], lib: Optional[Path], timeout_s: int) -> Dict:
    env = dict(os.environ)
    if lib is not None:
        env["MOK_CUDA_LIB"] = str(lib)
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-rfEs", *tests]
    t0 = time.monotonic()
    try:
        r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
        out, rc, timed_out = r.stdout + r.stderr, r.returncode, False
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        rc, timed_out = None, True
    failed = [ln.split(" ", 1)[1].split(" - ")[0] for ln in out.splitlines()
              if ln.startswith(("FAILED ", "ERROR "))]
    return {"rc": rc, "timed_out": timed_out, "counts": _counts(out), "failed": failed[:3],
            "seconds": round(time.monotonic() - t0, 1), "tail": out[-1500:]}


def pytest_verdict(p: Dict, base_passed: int, timeout_s: int) -> Tuple[str, str]:
    """(verdict, by / detail) of a mutant's pytest run ``p`` (:func:`_pytest`'s record):
    - a failed test -> killed by it; a test that failed and then left the process hanging (a
      kernel still spinning at exit) is still killed by that test;
    - no failure, but the time limit or a non-zero exit -> killed by the hang / the crash;
    - passed, but fewer tests passed than with the unmutated library -> invalid (something
      skipped, so the run proves nothing);
    - else survived (``by`` empty)."""
    if p["failed"]:
        return "killed", p["failed"][0] + (" (then hung at exit)" if p["timed_out"] else "")
    if p["timed_out"]:
        return "killed", f"time limit {timeout_s} s (a hang)"
    if p["rc"] != 0:
        return "killed", f"pytest rc {p['rc']} (no test named: a crash?)"
    if p["counts"].get("passed", 0) < base_passed:
        return "invalid", f"only {p['counts']} against {base_passed} passed"
    return "survived", ""


def _loads(lib: Path) -> Tuple[bool, str]:
    env = dict(os.environ, MOK_CUDA_LIB=str(lib))
    code = "from megatron_mok.cuda import library; library.get(); print('ok')"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    return r.returncode == 0 and "ok" in r.stdout, (r.stdout + r.stderr)[-500:]


def _fuzz(lib: Path, seconds: int, out: Path) -> Dict:
    env = dict(os.environ, MOK_CUDA_LIB=str(lib))
    cmd = [sys.executable, "scripts/fuzz_dispatch.py", "--device", "cuda", "--seconds", str(seconds),
           "--max-world", "4", "--out", str(out), "--seed", "26"]
    try:
        r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=seconds + 180)
        rc = r.returncode
    except subprocess.TimeoutExpired:
        return {"rc": None, "timed_out": True, "failures": None}
    failures = None
    try:
        failures = len(json.loads((out / "fuzz.json").read_text()).get("failures") or [])
    except (OSError, ValueError):
        pass
    return {"rc": rc, "timed_out": False, "failures": failures}


def run(libs: Path, out: Path, mutants: List[Mutant], fuzz_seconds: int) -> int:
    out.mkdir(parents=True, exist_ok=True)
    manifest = libs / "manifest.json"  # written when a build ends (a partial build has none)
    result = {"commit": _commit(), "libs_manifest": json.loads(manifest.read_text()) if manifest.is_file() else None,
              "baseline": {}, "mutants": {}}
    # Baseline: every selection passes with the library under test, nothing skipped that ran
    # there (a selection that skips its GPU tests would let every mutant "survive").
    baseline: Dict[Tuple[str, ...], Dict] = {}
    for m in mutants:
        if m.tests in baseline:
            continue
        b = _pytest(m.tests, None, 600)
        baseline[m.tests] = b
        result["baseline"][" ".join(m.tests)] = b
        print(f"[baseline] {' '.join(m.tests)[:90]}: {b['counts']} in {b['seconds']} s", flush=True)
        if b["rc"] != 0 or not b["counts"].get("passed"):
            print("[baseline] FAILED: the audit needs a green baseline\n" + b["tail"], flush=True)
            (out / "mutation_audit.json").write_text(json.dumps(result, indent=1))
            return 2
    unexpected = 0
    for i, m in enumerate(mutants, 1):
        with tempfile.TemporaryDirectory() as tmp:
            lib = Path(tmp) / "libmok_cuda.so"
            lib.write_bytes(lzma.decompress((libs / f"{m.name}.so.xz").read_bytes()))
            ok, why = _loads(lib)
            rec: Dict = {"file": m.file, "what": m.what, "expected": m.expected}
            if not ok:
                rec.update(verdict="invalid", detail=why)
            else:
                p = _pytest(m.tests, lib, m.timeout_s)
                rec["pytest"] = {k: v for k, v in p.items() if k != "tail"}
                verdict, why = pytest_verdict(p, baseline[m.tests]["counts"].get("passed", 0), m.timeout_s)
                rec["verdict"], rec["by" if verdict == "killed" else "detail"] = verdict, why
                if verdict == "killed" and not p["failed"]:
                    rec["tail"] = p["tail"]  # a crash or a hang: what it printed
                if verdict == "survived":
                    if fuzz_seconds > 0:
                        f = _fuzz(lib, fuzz_seconds, out / f"fuzz_{m.name}")
                        rec["fuzz"] = f
                        if f["timed_out"] or (f["failures"] or 0) > 0 or f["rc"] != 0:
                            rec["verdict"], rec["by"] = "killed", f"fuzzer ({f})"
            if rec["verdict"] == "survived" and not m.expected:
                unexpected += 1
            result["mutants"][m.name] = rec
            print(f"[{i}/{len(mutants)}] {m.name}: {rec['verdict'].upper()}"
                  f"{' by ' + str(rec.get('by')) if rec.get('by') else ''}"
                  f"{' (expected: ' + m.expected[:60] + '...)' if rec['verdict'] == 'survived' and m.expected else ''}",
                  flush=True)
            (out / "mutation_audit.json").write_text(json.dumps(result, indent=1))
    killed = sum(r["verdict"] == "killed" for r in result["mutants"].values())
    print(f"== {killed} of {len(result['mutants'])} mutants killed; {unexpected} survived unexpectedly")
    return 1 if unexpected else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("check")
    b = sub.add_parser("build")
    b.add_argument("--out", required=True)
    b.add_argument("--only", default=None)
    r = sub.add_parser("run")
    r.add_argument("--libs", required=True)
    r.add_argument("--out", required=True)
    r.add_argument("--only", default=None)
    r.add_argument("--fuzz-seconds", type=int, default=30)
    a = ap.parse_args(argv)
    if a.cmd == "check":
        problems = check(MUTANTS)
        print("\n".join(problems) or f"{len(MUTANTS)} mutants apply to csrc/")
        return 1 if problems else 0
    if a.cmd == "build":
        return build(Path(a.out), _select(a.only))
    return run(Path(a.libs), Path(a.out), _select(a.only), a.fuzz_seconds)


if __name__ == "__main__":
    sys.exit(main())

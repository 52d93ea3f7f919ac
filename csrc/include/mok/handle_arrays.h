// Per-dispatch layout arrays (the device half of a DispatchHandle), carved from one scratch
// allocation that Python owns. Like Workspace, the carving lives here and nowhere else.
//
//   send_pos      [T_max, W] i32  index of my token t among my tokens OF ITS CHUNK that hit
//                                rank d, -1 if none (add send_base for the global index q)
//   send_base     [CPC, W]   i32  my tokens in chunks before this one that hit rank d
//   send_count    [W]        i32  my tokens that hit rank d
//   chunk_readers [CPC]      u64  remote ranks that read my dispatch chunk j (bit mask)
//   src_count     [W]        i32  tokens of each source in this dispatch
//   chunk_rows    [E_local, W, CPC] i32  rows of (expert, source, chunk), in contract order;
//                                after the scan, the first row of that group
//   chunk_tasks   [W, CPC]   i32  tasks (tokens with >=1 row here) in (source, chunk)
//   task_base     [W, CPC]   i32  first task of (source, chunk)
//   task_off      [W + 1]    i32  first task of each source; task_off[W] = number of tasks
//   totals        [4]        i32  R, number of tasks, speculative overflow (any rank), -
//   dest_total    [W]        i32  rows every rank receives in this dispatch (speculative eager
//                                dispatch: zeroed by publish, summed by count, read by scan)
//   fill_done     [W]        i32  fill blocks finished per source (releases the routing slot)
//   task_src, task_token [W * T_max] i32   the source token of each task
//   task_rows     [W * T_max, K] i32   the task's rows in row order (expert, then k), -1 pad
//   task_k        [W * T_max, K] i32   the slot k of each of those rows
//   gap_begin     [E_local]  i32  expert_alignment > 1: the first zero row after expert e's rows
//   gap_len       [E_local]  i32  ... and how many (< expert_alignment); written by the scan
#pragma once

#include "workspace.h"

namespace mok {

struct HandleArrays {
  int32_t* send_pos;
  int32_t* send_base;
  int32_t* send_count;
  uint64_t* chunk_readers;
  int32_t* src_count;
  int32_t* chunk_rows;
  int32_t* chunk_tasks;
  int32_t* task_base;
  int32_t* task_off;
  int32_t* totals;
  int32_t* fill_done;
  int32_t* task_src;
  int32_t* task_token;
  int32_t* task_rows;
  int32_t* task_k;
  int32_t* dest_total;
  int32_t* gap_begin;
  int32_t* gap_len;
  // Written by the layout's scan, for the fill and the transfers of this handle: [0] the zero
  // rows one expert may have (A - 1 with expert_alignment A, N with rows_per_expert N, else
  // 0), [1] rows_per_expert N or -1.
  int32_t* pad_info;
  size_t total_bytes;

  // At least one: every layout kernel launches one block per chunk, and T_max = 0 is legal.
  __host__ __device__ static int chunks_per_call(const WorkspaceConfig& c) {
    const int n = (c.max_tokens + c.chunk_tokens - 1) / c.chunk_tokens;
    return n > 0 ? n : 1;
  }

  // q: index of my token t among all my tokens that hit rank d, or -1.
  __host__ __device__ int send_index(const WorkspaceConfig& cfg, int t, int d) const {
    const int local = send_pos[static_cast<size_t>(t) * cfg.world_size + d];
    return local < 0 ? -1 : send_base[(t / cfg.chunk_tokens) * cfg.world_size + d] + local;
  }

  // The zero rows (expert_alignment A > 1, or rows_per_expert N) are E_local x width
  // candidates, width = pad_info[0] (A - 1 or N): expert e's o-th possible zero row is candidate
  // e * width + o. The row candidate i names, or -1 (none).
  __host__ __device__ static int64_t gap_candidates(const WorkspaceConfig& cfg, int width) {
    return static_cast<int64_t>(cfg.num_local_experts) * width;
  }
  __host__ __device__ int64_t gap_row(int width, int64_t i) const {
    const int e = static_cast<int>(i / width), o = static_cast<int>(i - static_cast<int64_t>(e) * width);
    return o < gap_len[e] ? static_cast<int64_t>(gap_begin[e]) + o : -1;
  }

  // Index of (local expert e, source s, chunk c) in chunk_rows.
  __host__ __device__ static size_t group(const WorkspaceConfig& cfg, int e, int s, int c) {
    return (static_cast<size_t>(e) * cfg.world_size + s) * chunks_per_call(cfg) + c;
  }

  __host__ __device__ static HandleArrays make(const WorkspaceConfig& c, char* base) {
    HandleArrays a{};
    const size_t W = c.world_size, T = c.max_tokens, K = c.topk, E = c.num_local_experts;
    const size_t cpc = chunks_per_call(c);
    size_t off = 0;
    auto take = [&](size_t bytes) { char* p = base + off; off = align_up(off + bytes, 256); return p; };
    a.send_pos = (int32_t*)take(T * W * 4);
    a.send_base = (int32_t*)take(cpc * W * 4);
    a.send_count = (int32_t*)take(W * 4);
    a.chunk_readers = (uint64_t*)take(cpc * 8);
    a.src_count = (int32_t*)take(W * 4);
    a.chunk_rows = (int32_t*)take(W * cpc * E * 4);
    a.chunk_tasks = (int32_t*)take(W * cpc * 4);
    a.task_base = (int32_t*)take(W * cpc * 4);
    a.task_off = (int32_t*)take((W + 1) * 4);
    a.totals = (int32_t*)take(4 * 4);
    a.fill_done = (int32_t*)take(W * 4);
    a.task_src = (int32_t*)take(W * T * 4);
    a.task_token = (int32_t*)take(W * T * 4);
    a.task_rows = (int32_t*)take(W * T * K * 4);
    a.task_k = (int32_t*)take(W * T * K * 4);
    a.dest_total = (int32_t*)take(W * 4);
    a.gap_begin = (int32_t*)take(E * 4);
    a.gap_len = (int32_t*)take(E * 4);
    a.pad_info = (int32_t*)take(2 * 4);
    a.total_bytes = off;
    return a;
  }
};

}  // namespace mok

// Fill step of the dispatch layout: one block per (source, chunk), one (token, k) slot per
// thread. Rows get their contract order ((token, k) within the chunk, per local expert) from
// ranks, not a walk: a slot's row is its expert's first row in the chunk + the slots of that
// expert in earlier warps (a per-expert prefix over the block's warps) + the slots of that
// expert before it in its warp (__match_any_sync). Then the chunk's tasks (one per token with
// rows here), one slot per thread again. The last block of a source releases that source's
// routing slot (a remote store: "done reading your routing").
//
// Why not one warp walking the chunk (the version before #42): that walk was a chain of
// dependent shared-memory steps (16 for 512 slots, then K^2 reads per token), ~14-16 us per
// chunk at every call size, the largest layout kernel (NOTES (U), (W)).
#include <cub/block/block_scan.cuh>

#include "mok/launch.h"

namespace mok {
namespace {

constexpr int kFillWarps = kFillThreads / kWarpSize;

// Dynamic shared memory of a fill block, in ints: the experts' running rows, the per-warp
// expert counts (then their prefixes) and the chunk's slot arrays.
__host__ __device__ inline size_t fill_smem_ints(int E_local, int C, int K) {
  return static_cast<size_t>(E_local) * (1 + kFillWarps) + 2 * static_cast<size_t>(C) * K;
}

// A row no token lands in (static-shape padding past R, or an expert's zero rows below R):
// the handle's src_rank / src_token say -1 and its prob is 0 (the contract for such rows).
__device__ inline void mark_no_source(const RowOutputs& out, int64_t row) {
  out.src_rank[row] = -1;
  out.src_token[row] = -1;
  out.probs[row] = 0.f;
}

__global__ void __launch_bounds__(kFillThreads) fill_kernel(CommContext c, HandleArrays h,
                                                             RoutingArgs r, RowOutputs out) {
  using Scan = cub::BlockScan<int, kFillThreads>;
  extern __shared__ int smem[];
  __shared__ typename Scan::TempStorage scan_tmp;
  __shared__ int token_task[kFillThreads];  // a tile's tokens: task index within the tile
  __shared__ bool stop;
  pdl_wait_then_release_dependents();  // before the first read of the layout's results
  layout_stamp(c, 1, kStEntry);
  const Workspace& ws = c.ws;
  const int chunk = blockIdx.x, s = blockIdx.y, tid = threadIdx.x, warp = tid / kWarpSize;
  const int K = ws.cfg.topk, C = ws.cfg.chunk_tokens, E_local = ws.cfg.num_local_experts;
  const int cpc = HandleArrays::chunks_per_call(ws.cfg);
  const uint64_t meta_seq = c.counters()->meta_seq;
  const int slot = static_cast<int>(meta_seq % ws.cfg.meta_slots);
  int* expert_row = smem;                          // [E_local] next row of each local expert
  int* warp_row = expert_row + E_local;            // [kFillWarps][E_local] counts, then first rows
  int* slot_e = warp_row + kFillWarps * E_local;   // [C * K] local expert of slot (j, k), or -1
  int* slot_row = slot_e + C * K;                  // [C * K] its row, or -1
  char* peer = c.peers.base[s];
  // The layout kernel before this one acquired the peer's routing slot (meta_ready) and the
  // kernel boundary carries that to this grid; one acquire of our own (the value is already
  // there, so it cannot wait) makes the fill's plain, L1-cached reads of the peer's routing
  // below correct by the memory model alone, not by the boundary's L1 invalidation
  // (session 29's memory-model review, B3). Another warp than `stop`'s, so the two loads
  // overlap; both before the barrier, which orders them before every thread's reads.
  if (tid == 0) stop = aborted(c);
  if (tid == kWarpSize) (void)ld_acquire_sys(ws.meta_ready_at(peer) + slot);
  const int32_t* idx = ws.meta_idx_at(peer, slot);
  const float* w = ws.meta_weights_at(peer, slot);
  const int lo = c.rank * E_local;
  const int t0 = chunk * C;
  const int n_tok = max(0, min(h.src_count[s], t0 + C) - t0);
  const int n_slots = n_tok * K;
  const int gap_width = h.pad_info[0];
  // rows_per_expert N: local expert e's rows are [e * N, (e + 1) * N) (the scan placed them);
  // its rows past N are dropped (reported by the scan): they get no row, and their tasks list
  // only the rows kept.
  const int fixed_rows = h.pad_info[1];
  for (int e = tid; e < E_local; e += kFillThreads)
    expert_row[e] = h.chunk_rows[HandleArrays::group(ws.cfg, e, s, chunk)];
  for (int i = tid; i < kFillWarps * E_local; i += kFillThreads) warp_row[i] = 0;
  __syncthreads();
  if (stop) return;
  layout_stamp(c, 1, kStFillLoaded);

  // Phase 1: rows, kFillThreads slots per pass (one pass at the default 64 tokens x top-8).
  for (int base = 0; base < n_slots; base += kFillThreads) {
    const int i = base + tid;
    const bool valid = i < n_slots;
    int e = -1;
    float wt = 0.f;
    if (valid) {
      e = idx[static_cast<size_t>(t0) * K + i] - lo;
      if (e < 0 || e >= E_local) e = -1;
      wt = w[static_cast<size_t>(t0) * K + i];
    }
    const unsigned same = __match_any_sync(0xffffffffu, e);
    const int rank_in = __popc(same & lanemask_lt());
    if (e >= 0 && rank_in == 0) warp_row[warp * E_local + e] = __popc(same);
    __syncthreads();
    // Per expert, an exclusive prefix over the warps (slot order = warp order), on top of the
    // rows earlier passes handed out.
    for (int x = tid; x < E_local; x += kFillThreads) {
      int run = expert_row[x];
      for (int v = 0; v < kFillWarps; ++v) {
        const int n = warp_row[v * E_local + x];
        warp_row[v * E_local + x] = run;
        run += n;
      }
      expert_row[x] = run;
    }
    __syncthreads();
    int row = e >= 0 ? warp_row[warp * E_local + e] + rank_in : -1;
    if (fixed_rows >= 0 && row >= (e + 1) * fixed_rows) row = -1;
    if (valid) {
      slot_e[i] = e;
      slot_row[i] = row;
    }
    if (row >= 0 && row < out.row_cap) {
      out.src_rank[row] = s;
      out.src_token[row] = t0 + i / K;
      out.probs[row] = wt;
    }
    if (base + kFillThreads < n_slots) {  // another pass: its counts start from zero
      __syncthreads();
      for (int x = tid; x < kFillWarps * E_local; x += kFillThreads) warp_row[x] = 0;
    }
    __syncthreads();
  }

  layout_stamp(c, 1, kStFillRows);
  // Phase 2: tasks, in token order, one slot per thread (kFillThreads / K tokens per pass). A
  // task lists its rows by (expert, k): the order in which combine sums them; -1 after them.
  int task = h.task_base[s * cpc + chunk];
  const int tokens_per_pass = kFillThreads / K;
  for (int jb = 0; jb < n_tok; jb += tokens_per_pass) {
    const int jj = tid / K, k = tid % K, j = jb + jj;
    const bool active = jj < tokens_per_pass && j < n_tok;
    // n: the token's slots here (a task whenever n > 0: the layout counted it so);
    // kept: those with a row (all of them unless rows_per_expert dropped some).
    int e = -1, pos = 0, n = 0, kept = 0;
    if (active) {
      e = slot_e[j * K + k];
      for (int k2 = 0; k2 < K; ++k2) {  // stable rank by expert: K is small, O(K^2) beats a sort
        const int e2 = slot_e[j * K + k2];
        if (e2 >= 0) {
          ++n;
          if (fixed_rows < 0 || slot_row[j * K + k2] >= 0) {
            ++kept;
            pos += e2 < e || (e2 == e && k2 < k);
          }
        }
      }
      if (e >= 0 && slot_row[j * K + k] < 0) e = -1;  // dropped: no row to list
    }
    const int opens = active && k == 0 && n > 0;  // one per token with rows here
    int before, pass_tasks;
    Scan(scan_tmp).ExclusiveSum(opens, before, pass_tasks);
    if (opens) token_task[jj] = before;
    __syncthreads();
    if (active && n > 0) {
      const int my_task = task + token_task[jj];
      const size_t at = static_cast<size_t>(my_task) * K;
      if (e >= 0) {
        h.task_rows[at + pos] = slot_row[j * K + k];
        h.task_k[at + pos] = k;
      }
      if (k >= kept) {  // positions kept..K-1 hold no row
        h.task_rows[at + k] = -1;
        h.task_k[at + k] = -1;
      }
      if (k == 0) {
        h.task_src[my_task] = s;
        h.task_token[my_task] = t0 + j;
      }
    }
    task += pass_tasks;
    __syncthreads();  // token_task and scan_tmp are reused
  }

  layout_stamp(c, 1, kStFillTasks);
  // Phase 3: the last chunk of source s done -> tell s its routing slot is free (every read of
  // it is behind the barriers above).
  if (tid == 0) {
    __threadfence();
    const int done = atomicAdd(&h.fill_done[s], 1) + 1;
    if (done == cpc) {
      __threadfence_system();
      st_release_sys(ws.meta_released_at(peer, c.rank) + slot, meta_seq + 1);
    }
  }
  layout_stamp(c, 1, kStFillReleased);
  // Padding rows (static-shape mode) say "no source": every fill block takes a share. An eager
  // dispatch's row outputs are a bound on R, sliced to R on the host: nothing to pad there.
  const int64_t n_rows = out.pad ? min(static_cast<int64_t>(h.totals[0]), out.row_cap) : out.row_cap;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * gridDim.y * kFillThreads;
  for (int64_t row = n_rows + (static_cast<int64_t>(blockIdx.y) * gridDim.x + blockIdx.x) * kFillThreads + tid;
       row < out.row_cap; row += stride) {
    mark_no_source(out, row);
  }
  // The zero rows after each expert's rows (expert_alignment > 1 or rows_per_expert) say "no
  // source" too, in every mode: they lie below R. The candidates over the grid's threads.
  for (int64_t i = (static_cast<int64_t>(blockIdx.y) * gridDim.x + blockIdx.x) * kFillThreads + tid;
       i < HandleArrays::gap_candidates(ws.cfg, gap_width); i += stride) {
    const int64_t row = h.gap_row(gap_width, i);
    if (row < 0 || row >= out.row_cap) continue;
    mark_no_source(out, row);
  }
  // The fill is the routing call's last reader of meta_seq: its last block advances it.
  __syncthreads();
  layout_stamp(c, 1, kStFillEnd);
  block_done_advance(&c.counters()->meta_blocks_done, &c.counters()->meta_seq);
}

}  // namespace

// The layout's publish (C masks) and count (E_local + C * K ints) need less than this:
// 8 * C * K + 4 * E_local * (1 + kFillWarps) bytes covers both.
size_t routing_smem_bytes(int num_local_experts, int chunk_tokens, int topk) {
  return fill_smem_ints(num_local_experts, chunk_tokens, topk) * sizeof(int);
}

cudaError_t launch_dispatch_fill(const CommContext& c, const HandleArrays& h, const RoutingArgs& r,
                                 const RowOutputs& out, cudaStream_t s) {
  const int cpc = HandleArrays::chunks_per_call(c.ws.cfg);
  const int C = c.ws.cfg.chunk_tokens, K = c.ws.cfg.topk;
  const size_t smem = fill_smem_ints(c.ws.cfg.num_local_experts, C, K) * sizeof(int);
  if (smem > kMaxDynamicSmem) return cudaErrorInvalidConfiguration;  // ~3.3 K experts per rank
  if (cudaError_t e = allow_dynamic_smem(fill_kernel, smem)) return e;
  return launch_kernel(c, fill_kernel, dim3(cpc, c.world), kFillThreads, smem, s, c, h, r, out);
}

}  // namespace mok

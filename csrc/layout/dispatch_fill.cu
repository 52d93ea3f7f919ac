// Fill step of the dispatch layout: one warp per (source, chunk) walks the chunk's slots in
// (token, k) order, so rows get their contract order without any sort, then writes the
// chunk's tasks (one per token with rows here). The last chunk of a source releases that
// source's routing slot (a remote store: "done reading your routing").
#include "mok/launch.h"

namespace mok {
namespace {

// Shared-memory stride between the k-columns of the fill's slot arrays: the chunk's tokens
// rounded up to an odd count, so phase 1's writes (consecutive slots = K columns x a few
// tokens) spread over the banks too.
__host__ __device__ inline int fill_slot_stride(int C) { return C | 1; }

__global__ void __launch_bounds__(kWarpSize) fill_kernel(CommContext c, HandleArrays h,
                                                          RoutingArgs r, RowOutputs out) {
  extern __shared__ int smem[];
  const Workspace& ws = c.ws;
  const int chunk = blockIdx.x, s = blockIdx.y, lane = threadIdx.x;
  const int K = ws.cfg.topk, C = ws.cfg.chunk_tokens, E_local = ws.cfg.num_local_experts;
  const int cpc = HandleArrays::chunks_per_call(ws.cfg);
  const uint64_t meta_seq = c.counters()->meta_seq;
  const int slot = static_cast<int>(meta_seq % ws.cfg.meta_slots);
  // Slot (token j, k) of the chunk's rows and local experts is at k * Cs + j (slot-major, odd
  // stride): phase 2's lanes are tokens, so a warp reading one k reads 32 consecutive words (the
  // token-major j * K + k had 8 lanes per bank at K = 8, and phase 2 reads K^2 of them per lane).
  const int Cs = fill_slot_stride(C);
  int* next_row = smem;              // [E_local] rows handed out so far per expert
  int* first_row = smem + E_local;   // [E_local] first row of (expert, s, chunk)
  int* slot_row = first_row + E_local;  // [K * Cs]
  int* slot_e = slot_row + K * Cs;   // [K * Cs]
  int* chunk_idx = slot_e + K * Cs;  // [C*K] this chunk's routing, copied once from the peer
  float* chunk_w = reinterpret_cast<float*>(chunk_idx + C * K);  // [C*K]
  if (aborted(c)) return;

  char* peer = c.peers.base[s];
  const int32_t* idx = ws.meta_idx_at(peer, slot);
  const float* w = ws.meta_weights_at(peer, slot);
  const int lo = c.rank * E_local;
  const int t0 = chunk * C;
  const int t1 = min(h.src_count[s], t0 + C);
  const int n_tok = max(0, t1 - t0);
  const int n_slots = n_tok * K;
  // The chunk's first rows, loaded once with all loads in flight (looked up per slot below,
  // they were a dependent global load in every step of the walk).
  for (int e = lane; e < E_local; e += kWarpSize) {
    next_row[e] = 0;
    first_row[e] = h.chunk_rows[HandleArrays::group(ws.cfg, e, s, chunk)];
  }
  // One coalesced pass over the peer's routing (all loads in flight at once).
  for (int i = lane; i < n_slots; i += kWarpSize) {
    chunk_idx[i] = idx[static_cast<size_t>(t0) * K + i];
    chunk_w[i] = w[static_cast<size_t>(t0) * K + i];
  }
  __syncwarp();

  // Phase 1: rows. Slots sharing an expert in one 32-slot step are ranked by __match_any.
  for (int base = 0; base < n_slots; base += kWarpSize) {
    const int i = base + lane;
    const bool valid = i < n_slots;
    const int t = t0 + i / K;
    int e = -1;
    if (valid) {
      e = chunk_idx[i] - lo;
      if (e < 0 || e >= E_local) e = -1;
    }
    const unsigned same = __match_any_sync(0xffffffffu, e);
    const int before = e >= 0 ? next_row[e] : 0;
    const int rank_in = __popc(same & lanemask_lt());
    __syncwarp();
    int row = -1;
    if (e >= 0) {
      row = first_row[e] + before + rank_in;
      if (rank_in == 0) next_row[e] = before + __popc(same);
    }
    __syncwarp();
    if (valid) {
      slot_row[(i % K) * Cs + i / K] = row;
      slot_e[(i % K) * Cs + i / K] = e;
    }
    if (row >= 0 && row < out.row_cap) {
      out.src_rank[row] = s;
      out.src_token[row] = t;
      out.probs[row] = chunk_w[i];
    }
  }
  __syncwarp();

  // Phase 2: tasks, in token order. A task lists its rows by (expert, k): the order in which
  // combine sums them.
  int task = h.task_base[s * cpc + chunk];
  for (int base = 0; base < n_tok; base += kWarpSize) {
    const int j = base + lane;
    bool has = false;
    if (j < n_tok)
      for (int k = 0; k < K; ++k) has |= slot_e[k * Cs + j] >= 0;
    const unsigned ballot = __ballot_sync(0xffffffffu, has);
    if (has) {
      const int my_task = task + __popc(ballot & lanemask_lt());
      int n = 0;
      for (int k = 0; k < K; ++k) {
        const int e = slot_e[k * Cs + j];
        if (e < 0) continue;
        int pos = 0;  // stable rank by expert: K is small, so O(K^2) beats a sort
        for (int k2 = 0; k2 < K; ++k2) {
          const int e2 = slot_e[k2 * Cs + j];
          pos += (e2 >= 0) && (e2 < e || (e2 == e && k2 < k));
        }
        h.task_rows[static_cast<size_t>(my_task) * K + pos] = slot_row[k * Cs + j];
        h.task_k[static_cast<size_t>(my_task) * K + pos] = k;
        ++n;
      }
      for (int p = n; p < K; ++p) {
        h.task_rows[static_cast<size_t>(my_task) * K + p] = -1;
        h.task_k[static_cast<size_t>(my_task) * K + p] = -1;
      }
      h.task_src[my_task] = s;
      h.task_token[my_task] = t0 + j;
    }
    task += __popc(ballot);
  }

  // Phase 3: the last chunk of source s done -> tell s its routing slot is free.
  __syncwarp();
  if (lane == 0) {
    __threadfence();
    const int done = atomicAdd(&h.fill_done[s], 1) + 1;
    if (done == cpc) {
      __threadfence_system();
      st_release_sys(ws.meta_released_at(peer, c.rank) + slot, meta_seq + 1);
    }
  }
  // Padding rows (static-shape mode) say "no source": every fill block takes a share. An eager
  // dispatch's row outputs are a bound on R, sliced to R on the host: nothing to pad there.
  const int64_t n_rows = out.pad ? min(static_cast<int64_t>(h.totals[0]), out.row_cap) : out.row_cap;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * gridDim.y * kWarpSize;
  for (int64_t row = n_rows + (static_cast<int64_t>(blockIdx.y) * gridDim.x + blockIdx.x) * kWarpSize + lane;
       row < out.row_cap; row += stride) {
    out.src_rank[row] = -1;
    out.src_token[row] = -1;
    out.probs[row] = 0.f;
  }
  // The fill is the routing call's last reader of meta_seq: its last warp advances it.
  warp_done_advance(&c.counters()->meta_warps_done, &c.counters()->meta_seq);
}

}  // namespace

cudaError_t launch_dispatch_fill(const CommContext& c, const HandleArrays& h, const RoutingArgs& r,
                                 const RowOutputs& out, cudaStream_t s) {
  const int cpc = HandleArrays::chunks_per_call(c.ws.cfg);
  const int C = c.ws.cfg.chunk_tokens, K = c.ws.cfg.topk;
  const size_t smem = (2 * c.ws.cfg.num_local_experts + 2 * fill_slot_stride(C) * K + 2 * C * K) * sizeof(int);
  fill_kernel<<<dim3(cpc, c.world), kWarpSize, smem, s>>>(c, h, r, out);
  return cudaGetLastError();
}

}  // namespace mok

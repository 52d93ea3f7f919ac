// Device-side layout of a dispatch: no host round-trip.
//
//   publish  (1 block)            my routing -> my meta slot (peers read it), send-side layout
//   count    (chunks x sources)   rows per (source, chunk, local expert), tasks per chunk
//   scan     (1 block)            first row of every group in contract order, first task of
//                                 every chunk, tokens_per_expert, R
//   fill     (chunks x sources)   per-row outputs and task lists (dispatch_fill.cu)
#include <cub/block/block_scan.cuh>

#include "mok/launch.h"

namespace mok {
namespace {

__device__ inline int64_t read_expert(const RoutingArgs& r, int64_t i) {
  return r.idx_is_64 ? static_cast<const int64_t*>(r.topk_idx)[i]
                     : static_cast<int64_t>(static_cast<const int32_t*>(r.topk_idx)[i]);
}

__global__ void __launch_bounds__(kScanThreads) publish_kernel(CommContext c, HandleArrays h,
                                                                RoutingArgs r) {
  using Scan = cub::BlockScan<int, kScanThreads>;
  __shared__ typename Scan::TempStorage scan_tmp;
  __shared__ int running[kMaxRanks];
  __shared__ bool ok;
  const Workspace& ws = c.ws;
  char* me = c.local();
  const int M = ws.cfg.meta_slots, W = c.world, K = ws.cfg.topk, C = ws.cfg.chunk_tokens;
  const int E_local = ws.cfg.num_local_experts, T = r.num_tokens;
  const uint64_t meta_seq = c.counters()->meta_seq;
  const int slot = static_cast<int>(meta_seq % M);
  const int cpc = HandleArrays::chunks_per_call(ws.cfg);

  // Phase 1: the slot's previous routing must have been read by every rank (lazy check:
  // only once the meta ring has wrapped).
  if (threadIdx.x == 0) ok = true;
  if (threadIdx.x < W) running[threadIdx.x] = 0;
  for (int j = threadIdx.x; j < cpc; j += blockDim.x) h.chunk_readers[j] = 0;
  __syncthreads();
  if (meta_seq >= static_cast<uint64_t>(M) && threadIdx.x < W) {
    const uint64_t need = meta_seq - M + 1;
    if (!wait_geq(c, ws.meta_released_at(me, threadIdx.x) + slot, need, threadIdx.x,
                  kWaitRoutingReleased, slot))
      ok = false;
  }
  __syncthreads();
  if (!ok) return;

  // Phase 2: copy the routing into the slot (ids checked), and the send-side layout: for each
  // destination d, the index of each of my tokens among those that go to d.
  int32_t* m_idx = ws.meta_idx_at(me, slot);
  float* m_w = ws.meta_weights_at(me, slot);
  for (int base = 0; base < T; base += blockDim.x) {
    const int t = base + threadIdx.x;
    uint64_t mask = 0;
    if (t < T) {
      for (int k = 0; k < K; ++k) {
        int64_t e = read_expert(r, (int64_t)t * K + k);
        if (e < -1 || e >= r.num_experts) {
          report_error(c, kBadExpert, -1, kWaitNone, (int64_t)t * K + k);
          e = -1;
        }
        m_idx[t * K + k] = static_cast<int32_t>(e);
        m_w[t * K + k] = r.topk_weights[t * K + k];
        if (e >= 0) mask |= 1ull << (e / E_local);
      }
      const uint64_t remote = mask & ~(1ull << c.rank);
      if (remote) atomicOr(reinterpret_cast<unsigned long long*>(&h.chunk_readers[t / C]), remote);
    }
    for (int d = 0; d < W; ++d) {
      int pos, total;
      const int hit = static_cast<int>((mask >> d) & 1);
      Scan(scan_tmp).ExclusiveSum(hit, pos, total);
      if (t < T) h.send_pos[t * W + d] = hit ? running[d] + pos : -1;
      __syncthreads();
      if (threadIdx.x == 0) running[d] += total;
      __syncthreads();
    }
  }
  if (threadIdx.x < W) h.send_count[threadIdx.x] = running[threadIdx.x];
  if (threadIdx.x == 0) *ws.meta_count_at(me, slot) = T;
  __syncthreads();
  // Phase 3: readiness flows producer -> consumer: one release store, nobody is waited for.
  if (threadIdx.x == 0) {
    __threadfence_system();
    st_release_sys(ws.meta_ready_at(me) + slot, meta_seq + 1);
  }
}

__global__ void __launch_bounds__(kLayoutThreads) count_kernel(CommContext c, HandleArrays h,
                                                                RoutingArgs r) {
  extern __shared__ int hist[];  // [E_local]
  __shared__ int tasks;
  __shared__ int src_tokens;
  __shared__ bool ok;
  const Workspace& ws = c.ws;
  const int chunk = blockIdx.x, s = blockIdx.y;
  const int K = ws.cfg.topk, C = ws.cfg.chunk_tokens, E_local = ws.cfg.num_local_experts;
  const int cpc = HandleArrays::chunks_per_call(ws.cfg);
  const uint64_t meta_seq = c.counters()->meta_seq;
  const int slot = static_cast<int>(meta_seq % ws.cfg.meta_slots);
  char* peer = c.peers.base[s];

  for (int e = threadIdx.x; e < E_local; e += blockDim.x) hist[e] = 0;
  if (threadIdx.x == 0) {
    tasks = 0;
    ok = wait_geq(c, ws.meta_ready_at(peer) + slot, meta_seq + 1, s, kWaitRoutingReady, meta_seq);
    src_tokens = ok ? *reinterpret_cast<volatile int32_t*>(ws.meta_count_at(peer, slot)) : 0;
    if (chunk == 0) h.src_count[s] = src_tokens;
  }
  __syncthreads();
  if (!ok) return;

  const int32_t* idx = ws.meta_idx_at(peer, slot);
  const int lo = c.rank * E_local;
  const int t_end = min(src_tokens, (chunk + 1) * C);
  for (int t = chunk * C + threadIdx.x; t < t_end; t += blockDim.x) {
    bool hit = false;
    for (int k = 0; k < K; ++k) {
      const int e = idx[t * K + k] - lo;
      if (e >= 0 && e < E_local) {
        atomicAdd(&hist[e], 1);  // integer counts: the result does not depend on order
        hit = true;
      }
    }
    if (hit) atomicAdd(&tasks, 1);
  }
  __syncthreads();
  int32_t* rows = h.chunk_rows + (static_cast<size_t>(s) * cpc + chunk) * E_local;
  for (int e = threadIdx.x; e < E_local; e += blockDim.x) rows[e] = hist[e];
  if (threadIdx.x == 0) h.chunk_tasks[s * cpc + chunk] = tasks;
}

// Exclusive scan of `n` ints read/written through `at(o)` in order o = 0..n-1; returns the total.
template <typename At>
__device__ int block_exclusive_scan(int n, At at) {
  using Scan = cub::BlockScan<int, kScanThreads>;
  __shared__ typename Scan::TempStorage tmp;
  __shared__ int running;
  if (threadIdx.x == 0) running = 0;
  __syncthreads();
  for (int base = 0; base < n; base += blockDim.x) {
    const int o = base + threadIdx.x;
    const int v = o < n ? *at(o) : 0;
    int pos, total;
    Scan(tmp).ExclusiveSum(v, pos, total);
    if (o < n) *at(o) = running + pos;
    __syncthreads();
    if (threadIdx.x == 0) running += total;
    __syncthreads();
  }
  return running;
}

__global__ void __launch_bounds__(kScanThreads) scan_kernel(CommContext c, HandleArrays h,
                                                             RowOutputs out) {
  if (aborted(c)) return;
  const int W = c.world, E = c.ws.cfg.num_local_experts;
  const int cpc = HandleArrays::chunks_per_call(c.ws.cfg);
  // tokens_per_expert before the rows are overwritten by their offsets.
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    int64_t n = 0;
    for (int g = 0; g < W * cpc; ++g) n += h.chunk_rows[static_cast<size_t>(g) * E + e];
    out.tokens_per_expert[e] = n;
  }
  __syncthreads();
  // Rows in contract order: expert, then source, then chunk (then token, then k: fill).
  const int rows = block_exclusive_scan(E * W * cpc, [&](int o) {
    const int e = o / (W * cpc), sc = o % (W * cpc);
    return h.chunk_rows + static_cast<size_t>(sc) * E + e;
  });
  // Tasks in (source, chunk) order.
  for (int i = threadIdx.x; i < W * cpc; i += blockDim.x) h.task_base[i] = h.chunk_tasks[i];
  __syncthreads();
  const int tasks = block_exclusive_scan(W * cpc, [&](int o) { return h.task_base + o; });
  for (int s = threadIdx.x; s < W; s += blockDim.x) {
    h.task_off[s] = h.task_base[s * cpc];
    h.fill_done[s] = 0;
  }
  if (threadIdx.x == 0) {
    h.task_off[W] = tasks;
    h.totals[0] = rows;
    h.totals[1] = tasks;
    if (rows > out.row_cap) report_error(c, kRecvOverflow, -1, kWaitNone, rows);
  }
}

}  // namespace

cudaError_t launch_dispatch_layout(const CommContext& c, const HandleArrays& h,
                                   const RoutingArgs& r, const RowOutputs& out, cudaStream_t s) {
  const int cpc = HandleArrays::chunks_per_call(c.ws.cfg);
  publish_kernel<<<1, kScanThreads, 0, s>>>(c, h, r);
  count_kernel<<<dim3(cpc, c.world), kLayoutThreads, c.ws.cfg.num_local_experts * sizeof(int), s>>>(c, h, r);
  scan_kernel<<<1, kScanThreads, 0, s>>>(c, h, out);
  return cudaGetLastError();
}

}  // namespace mok

// The combine data path: one persistent kernel, two roles (as dispatch_transfer.cu).
//
//   producer blocks  for every source s (me included), reduce each of its tasks' rows here in
//                    row order (fp32 from +0.0), round once to the partial dtype, and stage the
//                    partial in my combine ring, in s's region, at the token's index among s's
//                    tokens that come here (s knows that index: send_pos). The rows stream
//                    through shared memory with cp.async, kStages segments ahead, so each warp
//                    keeps many loads in flight without holding registers. Optional side
//                    values carry the prob gradients of the task's slots.
//   consumer warps   one of my tokens at a time: the partials of every rank holding rows of it
//                    (my own included) are copied into shared memory one token ahead; then
//                    they are summed in rank order in fp32 and rounded once.
// No floating-point atomics: every sum has one fixed order, so results are bitwise stable.
#include <algorithm>

#include "mok/launch.h"

namespace mok {
namespace {

constexpr int U = kCombineUnroll;  // 8-element groups per lane per step (consumer)
constexpr int kSegElems = kWarpSize * kCombineVec;  // elements of one row per pipeline segment

__device__ __forceinline__ void zero(float (&a)[U][kCombineVec]) {
#pragma unroll
  for (int u = 0; u < U; ++u)
#pragma unroll
    for (int e = 0; e < kCombineVec; ++e) a[u][e] = 0.f;
}

__device__ __forceinline__ bool group_live(int v0, int u, int H) {
  return v0 + u * kWarpSize * kCombineVec < H;
}

// Rows of one task held per pipeline stage (more rows than this go through registers).
template <typename T>
constexpr int slots_per_stage() { return sizeof(T) == 4 ? 4 : 8; }

struct CombineShape {
  uint64_t seq;      // this call's number on the combine ring (read at kernel start)
  int H, K, C, cps;  // hidden, topk, rows per chunk, chunks per source region
  int64_t cpc;       // chunks per call: W regions of cps chunks
};

// dst[0..H) = sum of the task's nr rows, in row order, fp32 from +0.0, rounded to P.
// Each lane owns 8 elements of every 256-element segment; its copies land in its own slice
// of `stages`, so no warp synchronisation is needed between the copy and the use.
template <typename T, typename P>
__device__ void reduce_rows(const T* base, const int32_t* rows, int nr, P* dst, T* stages, int H) {
  constexpr int kSlots = slots_per_stage<T>();
  const int lane = threadIdx.x % kWarpSize;
  const int nseg = (H + kSegElems - 1) / kSegElems;
  const int piped = min(nr, kSlots);
  auto issue = [&](int seg) {
    const int e0 = seg * kSegElems + lane * kCombineVec;
    if (seg < nseg && e0 < H) {
      T* st = stages + static_cast<size_t>(seg % kStages) * kSlots * kSegElems + lane * kCombineVec;
      for (int r = 0; r < piped; ++r) {
        const int4* src = reinterpret_cast<const int4*>(base + static_cast<size_t>(rows[r]) * H + e0);
        int4* d = reinterpret_cast<int4*>(st + r * kSegElems);
#pragma unroll
        for (int v = 0; v < Raw8<T>::kVecs; ++v) cp_async_16(d + v, src + v);
      }
    }
    cp_async_commit();  // possibly empty: keeps "group k = segment k"
  };
#pragma unroll
  for (int seg = 0; seg < kStages; ++seg) issue(seg);
  for (int seg = 0; seg < nseg; ++seg) {
    cp_async_wait<kStages - 1>();  // segment `seg` has landed
    const int e0 = seg * kSegElems + lane * kCombineVec;
    if (e0 < H) {
      float acc[kCombineVec];
#pragma unroll
      for (int e = 0; e < kCombineVec; ++e) acc[e] = 0.f;
      const T* st = stages + static_cast<size_t>(seg % kStages) * kSlots * kSegElems + lane * kCombineVec;
      for (int r = 0; r < piped; ++r) {
        Raw8<T> raw;
        load_raw_generic(raw, st + r * kSegElems);
        add_raw<T>(acc, raw);
      }
      for (int r = piped; r < nr; ++r) {  // rare: more rows here than pipeline slots
        Raw8<T> raw;
        load_raw(raw, base + static_cast<size_t>(rows[r]) * H + e0);
        add_raw<T>(acc, raw);
      }
      Vec8<P>::store(dst + e0, acc);
    }
    issue(seg + kStages);
  }
  cp_async_wait<0>();  // the stages are free for the next task
}

template <typename T, typename P>
__device__ void produce(const CommContext& c, const HandleArrays& h, const TransferArgs& a,
                        const CombineShape& sh, const T* expert_out, const float* grad_probs,
                        char* smem) {
  __shared__ bool ok;
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int n_warps = blockDim.x / kWarpSize;
  T* stages = reinterpret_cast<T*>(smem) + static_cast<size_t>(warp) * kStages * slots_per_stage<T>() * kSegElems;
  RingView mine = RingView::combine(c.ws, c.local());
  const int64_t N = mine.num_chunks;
  for (int s = 0; s < c.world; ++s) {
    const int first = h.task_off[s], n = h.task_off[s + 1] - first;
    for (int j = 0; j * sh.C < n; ++j) {
      const uint64_t g = sh.seq * sh.cpc + static_cast<uint64_t>(s) * sh.cps + j;
      const int64_t slot = static_cast<int64_t>(g % N);
      // A slot always belongs to the same producer block, so its generations are written in order.
      if (slot % a.num_producers != blockIdx.x) continue;
      if (threadIdx.x == 0) ok = true;
      __syncthreads();
      const uint64_t prev = mine.gen[slot], prev_readers = mine.readers[slot];
      if (prev != 0 && threadIdx.x < c.world && ((prev_readers >> threadIdx.x) & 1)) {
        if (!wait_geq(c, mine.released + threadIdx.x * N + slot, prev, threadIdx.x,
                      kWaitCombineReleased, static_cast<int64_t>(g)))
          ok = false;
      }
      __syncthreads();
      if (!ok) return;
      char* chunk = mine.ring + slot * mine.chunk_bytes;
      const int rows_here = min(sh.C, n - j * sh.C);
      for (int q = warp; q < rows_here; q += n_warps) {
        const int task = first + j * sh.C + q;
        const int32_t* rows = h.task_rows + static_cast<size_t>(task) * sh.K;
        int nr = 0;  // rows are packed first; one past row_cap only on a reported overflow
        while (nr < sh.K && rows[nr] >= 0 && rows[nr] < a.row_cap) ++nr;
        reduce_rows<T, P>(expert_out, rows, nr, reinterpret_cast<P*>(chunk) + static_cast<size_t>(q) * sh.H,
                          stages, sh.H);
        if (grad_probs != nullptr && lane < sh.K) {
          float val = 0.f;
          for (int k = 0; k < nr; ++k)
            if (h.task_k[static_cast<size_t>(task) * sh.K + k] == lane) val = grad_probs[rows[k]];
          reinterpret_cast<float*>(chunk + c.ws.comb_side_offset)[q * sh.K + lane] = val;
        }
      }
      __syncthreads();
      if (threadIdx.x == 0) {
        mine.gen[slot] = g + 1;
        mine.readers[slot] = 1ull << s;
        __threadfence_system();
        st_release_sys(mine.ready + slot, g + 1);
      }
    }
  }
}

// Where rank d staged the partial of my token whose index among my tokens sent to d is q.
template <typename P>
__device__ __forceinline__ const char* staged_chunk(const CommContext& c, const CombineShape& sh,
                                                    int64_t N, int d, int q) {
  const uint64_t g = sh.seq * sh.cpc + static_cast<uint64_t>(c.rank) * sh.cps + q / sh.C;
  return c.peers.base[d] + c.ws.comb_ring + (g % N) * c.ws.comb_chunk_bytes;
}

template <typename P>
__device__ __forceinline__ const P* staged_partial(const CommContext& c, const CombineShape& sh,
                                                   int64_t N, int d, int q) {
  return reinterpret_cast<const P*>(staged_chunk<P>(c, sh, N, d, q)) + static_cast<size_t>(q % sh.C) * sh.H;
}

// Waits until every partial of token t is staged and starts asynchronous copies of the first
// `pf` of them (in rank order) into `buf`: one commit group per token.
template <typename P>
__device__ bool prefetch_token(const CommContext& c, const HandleArrays& h, const CombineShape& sh,
                               int64_t N, SeenGens& seen, int t, P* buf, int pf) {
  const int lane = threadIdx.x % kWarpSize, W = c.world, me = c.rank;
  const int vecs = sh.H * static_cast<int>(sizeof(P)) / 16;
  int staged = 0;
  for (int d = 0; d < W; ++d) {
    const int q = h.send_index(c.ws.cfg, t, d);
    if (q < 0) continue;
    const uint64_t g = sh.seq * sh.cpc + static_cast<uint64_t>(me) * sh.cps + q / sh.C;
    if (!seen.has(d, g)) {
      RingView theirs = RingView::combine(c.ws, c.peers.base[d]);
      if (!wait_geq(c, theirs.ready + g % N, g + 1, d, kWaitCombineReady, static_cast<int64_t>(g)))
        return false;
      seen.set(d, g);
    }
    if (staged < pf) {
      const int4* src = reinterpret_cast<const int4*>(staged_partial<P>(c, sh, N, d, q));
      int4* dst = reinterpret_cast<int4*>(buf + static_cast<size_t>(staged) * sh.H);
      for (int v = lane; v < vecs; v += kWarpSize) cp_async_16(dst + v, src + v);
      ++staged;
    }
  }
  cp_async_commit();
  return true;
}

template <typename T, typename P>
__device__ void consume(const CommContext& c, const HandleArrays& h, const TransferArgs& a,
                        const CombineShape& sh, T* y, float* grad_w, char* smem, int pf) {
  const int lane = threadIdx.x % kWarpSize;
  const int warp_in_block = threadIdx.x / kWarpSize;
  if (warp_in_block >= kCombineConsumerWarps) return;  // the smem budget is theirs alone
  const int n_warps = (gridDim.x - a.num_producers) * kCombineConsumerWarps;
  const int warp = (blockIdx.x - a.num_producers) * kCombineConsumerWarps + warp_in_block;
  const int W = c.world, me = c.rank;
  const int64_t N = RingView::combine(c.ws, c.local()).num_chunks;
  // Two buffers per warp: token t is summed from one while token t + n_warps lands in the other.
  P* bufs[2];
  for (int i = 0; i < 2; ++i)
    bufs[i] = reinterpret_cast<P*>(smem) + (static_cast<size_t>(warp_in_block) * 2 + i) * pf * sh.H;
  SeenGens seen;
  int cur = 0;
  if (warp < a.num_tokens && !prefetch_token<P>(c, h, sh, N, seen, warp, bufs[0], pf)) return;

  for (int t = warp; t < a.num_tokens; t += n_warps) {
    auto pos = [&](int d) { return h.send_index(c.ws.cfg, t, d); };
    const int next = t + n_warps;
    if (next < a.num_tokens) {
      if (!prefetch_token<P>(c, h, sh, N, seen, next, bufs[cur ^ 1], pf)) return;
    } else {
      cp_async_commit();  // an empty group keeps "all but the newest" meaning token t
    }
    cp_async_wait<1>();
    __syncwarp();
    const P* staged = bufs[cur];
    for (int v0 = lane * kCombineVec; v0 < sh.H; v0 += kWarpSize * kCombineVec * U) {
      float acc[U][kCombineVec];
      zero(acc);
      int i = 0;  // index among t's partials, in rank order
      for (int d = 0; d < W; ++d) {
        const int q = pos(d);
        if (q < 0) continue;
        Raw8<P> r[U];
        const P* src = i < pf ? staged + static_cast<size_t>(i) * sh.H : staged_partial<P>(c, sh, N, d, q);
#pragma unroll
        for (int u = 0; u < U; ++u)
          if (group_live(v0, u, sh.H)) {
            if (i < pf)
              load_raw_generic(r[u], src + v0 + u * kWarpSize * kCombineVec);
            else
              load_raw(r[u], src + v0 + u * kWarpSize * kCombineVec);
          }
        ++i;
#pragma unroll
        for (int u = 0; u < U; ++u)
          if (group_live(v0, u, sh.H)) add_raw<P>(acc[u], r[u]);
      }
#pragma unroll
      for (int u = 0; u < U; ++u)
        if (group_live(v0, u, sh.H))
          Vec8<T>::store(y + static_cast<size_t>(t) * sh.H + v0 + u * kWarpSize * kCombineVec, acc[u]);
    }
    if (grad_w != nullptr && lane < sh.K) {
      float val = 0.f;
      for (int d = 0; d < W; ++d) {
        const int q = pos(d);
        if (q < 0) continue;
        const char* chunk = staged_chunk<P>(c, sh, N, d, q);
        val += reinterpret_cast<const volatile float*>(chunk + c.ws.comb_side_offset)[(q % sh.C) * sh.K + lane];
      }
      grad_w[static_cast<size_t>(t) * sh.K + lane] = val;
    }
    // Release: the last of my tokens in a (rank, chunk) frees that chunk of d's ring.
    __syncwarp();
    if (lane == 0) {
      __threadfence();
      for (int d = 0; d < W; ++d) {
        const int q = pos(d);
        if (q < 0) continue;
        const int j = q / sh.C;
        const uint64_t g = sh.seq * sh.cpc + static_cast<uint64_t>(me) * sh.cps + j;
        const int64_t slot = static_cast<int64_t>(g % N);
        const int expected = min(sh.C, h.send_count[d] - j * sh.C);
        int32_t* done = RingView::combine(c.ws, c.local()).done + static_cast<size_t>(d) * N + slot;
        if (atomicAdd(done, 1) + 1 == expected) {
          *done = 0;
          __threadfence_system();
          RingView theirs = RingView::combine(c.ws, c.peers.base[d]);
          st_release_sys(theirs.released + static_cast<size_t>(me) * N + slot, g + 1);
        }
      }
    }
    __syncwarp();  // every lane is done with bufs[cur] before the next prefetch refills it
    cur ^= 1;
  }
}

template <typename T, typename P>
__global__ void __launch_bounds__(kTransferThreads, 1)
    combine_transfer_kernel(CommContext c, HandleArrays h, TransferArgs a, CombineShape sh,
                            const T* expert_out, const float* grad_probs, T* y, float* grad_w,
                            int pf_rows) {
  extern __shared__ __align__(16) char smem[];
  sh.seq = c.counters()->comb_seq;
  if (blockIdx.x < a.num_producers)
    produce<T, P>(c, h, a, sh, expert_out, grad_probs, smem);
  else
    consume<T, P>(c, h, a, sh, y, grad_w, smem, pf_rows);
  warp_done_advance(&c.counters()->comb_warps_done, &c.counters()->comb_seq);
}

template <typename T, typename P>
cudaError_t launch_typed(const CommContext& c, const HandleArrays& h, const TransferArgs& t,
                         const CombineShape& sh, const void* expert_out, const float* grad_probs,
                         void* y, float* grad_w, cudaStream_t s) {
  // Shared memory: producers, kStages pipeline stages per warp; consumers, two prefetch
  // buffers of pf_rows partials per warp. A block is one or the other: take the larger.
  const size_t row_bytes = static_cast<size_t>(sh.H) * sizeof(P);
  const int pf_rows = static_cast<int>(
      std::min<size_t>(c.world, kMaxDynamicSmem / (kCombineConsumerWarps * 2 * row_bytes)));
  const size_t consumer_smem = kCombineConsumerWarps * 2 * pf_rows * row_bytes;
  const size_t producer_smem = static_cast<size_t>(kTransferThreads / kWarpSize) * kStages *
                               slots_per_stage<T>() * kSegElems * sizeof(T);
  const size_t smem = std::max(consumer_smem, producer_smem);
  auto kernel = combine_transfer_kernel<T, P>;
  if (cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(smem)))
    return e;
  kernel<<<t.num_blocks, kTransferThreads, smem, s>>>(
      c, h, t, sh, static_cast<const T*>(expert_out), grad_probs, static_cast<T*>(y), grad_w, pf_rows);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_partial(int partial_code, const CommContext& c, const HandleArrays& h,
                           const TransferArgs& t, const CombineShape& sh, const void* expert_out,
                           const float* grad_probs, void* y, float* grad_w, cudaStream_t s) {
  if (partial_code == kFP32)
    return launch_typed<T, float>(c, h, t, sh, expert_out, grad_probs, y, grad_w, s);
  return launch_typed<T, T>(c, h, t, sh, expert_out, grad_probs, y, grad_w, s);
}

}  // namespace

cudaError_t launch_combine_transfer(const CommContext& c, const HandleArrays& h,
                                    const TransferArgs& t, const void* expert_out,
                                    const float* grad_probs, void* y, float* grad_w,
                                    int dtype_code, int partial_code, cudaStream_t s) {
  CombineShape sh;
  sh.H = c.ws.cfg.hidden;
  sh.K = c.ws.cfg.topk;
  sh.C = c.ws.cfg.chunk_tokens;
  sh.cps = HandleArrays::chunks_per_call(c.ws.cfg);
  sh.cpc = static_cast<int64_t>(sh.cps) * c.world;
  switch (dtype_code) {
    case kBF16:
      return launch_partial<__nv_bfloat16>(partial_code, c, h, t, sh, expert_out, grad_probs, y, grad_w, s);
    case kFP16:
      return launch_partial<__half>(partial_code, c, h, t, sh, expert_out, grad_probs, y, grad_w, s);
    default:
      return launch_typed<float, float>(c, h, t, sh, expert_out, grad_probs, y, grad_w, s);
  }
}

}  // namespace mok

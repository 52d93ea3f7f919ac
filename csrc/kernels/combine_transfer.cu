// The combine data path: one persistent kernel, two kinds of work.
//
//   produce  for every remote source s, reduce each of its tasks' rows here in row order
//            (fp32 from +0.0), round once to the partial dtype, and stage the partial in my
//            combine ring, in s's region, at the token's index among s's tokens that come
//            here (s knows that index: send_pos). Optional side values carry the prob
//            gradients of the task's slots.
//   consume  one of my tokens at a time: for every rank d holding rows of it, in rank order,
//            add d's partial (pulled over NVLink, or reduced right here when d is me) in fp32;
//            round once to the output dtype.
// Schedule: when the call fits in the ring, every block produces, then consumes ("phased");
// otherwise producer and consumer blocks run side by side (docs/DESIGN.md, "One combine").
// No floating-point atomics: every sum has one fixed order, so results are bitwise stable.
#include <algorithm>
#include <cstdlib>

#include "mok/launch.h"
#include "mok/row_sum.h"

namespace mok {
namespace {

struct CombineShape {
  uint64_t seq;      // this call's number on the combine ring (read at kernel start)
  int H, K, C, cps;  // hidden, topk, rows per chunk, chunks per source region
  int64_t cpc;       // chunks per call: W regions of cps chunks
  int phased;        // every block produces, then consumes (the call fits in the ring)

  // Generation of chunk j of source region s (rank s's tokens) in this call.
  __device__ uint64_t gen(int s, int j) const { return seq * cpc + static_cast<uint64_t>(s) * cps + j; }
};

template <typename T, typename P>
__device__ void produce(const CommContext& c, const HandleArrays& h, const TransferArgs& a,
                        const CombineShape& sh, const Role& role, const T* expert_out,
                        const float* grad_probs) {
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int n_warps = blockDim.x / kWarpSize;
  RingView mine = RingView::combine(c.ws, c.local());
  const int64_t N = mine.num_chunks;
  for (int s = 0; s < c.world; ++s) {
    if (s == c.rank) continue;  // my own partials are reduced by my consumers directly
    const int first = h.task_off[s], n = h.task_off[s + 1] - first;
    for (int j = 0; j * sh.C < n; ++j) {
      const uint64_t g = sh.gen(s, j);
      const int64_t slot = static_cast<int64_t>(g % N);
      if (slot % role.count != role.index()) continue;
      if (!ring_slot_acquire(c, mine, slot, g, kWaitCombineReleased)) return;
      char* chunk = mine.ring + slot * mine.chunk_bytes;
      const int rows_here = min(sh.C, n - j * sh.C);
      for (int q = warp; q < rows_here; q += n_warps) {
        const int task = first + j * sh.C + q;
        const int32_t* rows = h.task_rows + static_cast<size_t>(task) * sh.K;
        P* dst = reinterpret_cast<P*>(chunk) + static_cast<size_t>(q) * sh.H;
        HeldRows held;
        const bool use_held = sh.K <= kHeldRows;
        if (use_held) held.load(rows, sh.K);
        for (int v0 = lane * kCombineVec; v0 < sh.H; v0 += kWarpSize * kCombineVec * U) {
          float acc[U][kCombineVec];
          zero(acc);
          if (use_held)
            sum_held_rows<T, (sizeof(T) == 4 ? 2 : 4)>(acc, expert_out, held, a.row_cap, v0, sh.H);
          else
            sum_rows<T, (sizeof(T) == 4 ? 2 : 4)>(acc, expert_out, rows, sh.K, a.row_cap, v0, sh.H);
#pragma unroll
          for (int u = 0; u < U; ++u)
            if (group_live(v0, u, sh.H)) Vec8<P>::store(dst + v0 + u * kWarpSize * kCombineVec, acc[u]);
        }
        if (grad_probs != nullptr && lane < sh.K) {
          float val = 0.f;
          for (int k = 0; k < sh.K; ++k) {
            const int row = rows[k];
            if (row < 0) break;
            if (h.task_k[static_cast<size_t>(task) * sh.K + k] == lane && row < a.row_cap)
              val = grad_probs[row];
          }
          reinterpret_cast<float*>(chunk + c.ws.comb_side_offset)[q * sh.K + lane] = val;
        }
      }
      __syncthreads();
      if (threadIdx.x == 0) ring_slot_publish(mine, slot, g, 1ull << s);
    }
  }
}

// Where rank d staged the partial of my token whose index among my tokens sent to d is q.
template <typename P>
__device__ __forceinline__ const P* remote_partial(const CommContext& c, const CombineShape& sh,
                                                   int64_t N, int d, int q) {
  const uint64_t g = sh.gen(c.rank, q / sh.C);
  const char* chunk = c.peers.base[d] + c.ws.comb_ring + (g % N) * c.ws.comb_chunk_bytes;
  return reinterpret_cast<const P*>(chunk) + static_cast<size_t>(q % sh.C) * sh.H;
}

// Waits until every remote partial of token t is staged (the warp's cache of ready chunks
// skips the flag read for tokens of a chunk already seen).
__device__ bool wait_token_partials(const CommContext& c, const HandleArrays& h, const CombineShape& sh,
                                    int64_t N, SeenGens& seen, int t) {
  const int W = c.world, me = c.rank;
  for (int d = 0; d < W; ++d) {
    const int q = h.send_index(c.ws.cfg, t, d);
    if (q < 0 || d == me) continue;
    const uint64_t g = sh.gen(me, q / sh.C);
    if (!seen.has(d, g)) {
      RingView theirs = RingView::combine(c.ws, c.peers.base[d]);
      if (!wait_geq(c, theirs.ready + g % N, g + 1, d, kWaitCombineReady, static_cast<int64_t>(g)))
        return false;
      seen.set(d, g);
    }
  }
  return true;
}

// Rank order's first remote rank holding a partial of token t, or -1.
__device__ __forceinline__ int first_remote(const CommContext& c, const HandleArrays& h, int t) {
  for (int d = 0; d < c.world; ++d)
    if (d != c.rank && h.send_index(c.ws.cfg, t, d) >= 0) return d;
  return -1;
}

// Steps of the per-warp partial stream kept in flight (shared memory: 16 warps x kDepth steps
// x 32 lanes x U x 16 B per bf16 group = 224 KB either way).
template <typename P>
struct PartialStream {
  static constexpr int kDepth = sizeof(P) == 4 ? 7 : 14;
  static constexpr size_t kSmemBytes =
      static_cast<size_t>(kCombineThreads / kWarpSize) * kDepth * U * kWarpSize * sizeof(Raw8<P>);
};

// Consumer warps: my tokens t = warp, warp + n_warps, ... Each token is summed in steps of
// U x 256 elements per warp (S steps per token). The first remote partial of every token is
// streamed into shared memory kDepth steps ahead of its use with 16-byte cp.async (one commit
// group per step, empty where there is nothing to fetch), so its NVLink latency hides behind
// the own-row reductions of the steps before; further remote partials (world > 2) are loaded
// when summed.
template <typename T, typename P, int kOwnRows>
__device__ void consume(const CommContext& c, const HandleArrays& h, const TransferArgs& a,
                        const CombineShape& sh, const Role& role, const T* expert_out,
                        const float* grad_probs,
                        T* y, float* grad_w, Raw8<P>* smem) {
  constexpr int D = PartialStream<P>::kDepth;
  constexpr int kStepElems = kWarpSize * kCombineVec * U;
  const int lane = threadIdx.x % kWarpSize;
  const int warps_per_block = blockDim.x / kWarpSize;
  const int n_warps = role.count * warps_per_block;
  // Warps numbered across blocks first (block b's warp w is w * blocks + b), so a call with
  // fewer work items than warps still spreads over every SM of the role (block-major numbering
  // put a 128-token call on 4 of 20 SMs: 65 us instead of ~15, benchmarks/NOTES.md #15).
  const int warp = static_cast<int>(threadIdx.x / kWarpSize) * role.count + role.index();
  const int W = c.world, me = c.rank;
  const int64_t N = RingView::combine(c.ws, c.local()).num_chunks;
  const int my_first_task = h.task_off[me];
  const int S = (sh.H + kStepElems - 1) / kStepElems;
  const int n_tok = a.num_tokens > warp ? (a.num_tokens - warp + n_warps - 1) / n_warps : 0;
  const int64_t n_pieces = static_cast<int64_t>(n_tok) * S;
  Raw8<P>* slots = smem + static_cast<size_t>(threadIdx.x / kWarpSize) * D * U * kWarpSize + lane;
  SeenGens seen;

  // Stream piece p = step p % S of the warp's token p / S. A token is streamed only if its
  // first remote partial is ready when its first piece is issued: the stream never WAITS, since
  // this warp has not yet released the chunks of the tokens before it, and a producer may be
  // waiting for exactly those slots (small rings). Unstreamed tokens load that partial when
  // summed. Always commits one group, so "all but the newest D - 1 groups complete" means
  // "piece p - D + 1 and everything before it landed".
  const P* issue_src = nullptr;
  uint64_t streamed = 0;  // bit k % 64: token k of this warp is streamed (D / S + 1 <= 15 in flight)
  auto issue = [&](int64_t p) {
    if (p < n_pieces) {
      const int k = static_cast<int>(p / S), st = static_cast<int>(p % S);
      if (st == 0) {
        const int t = warp + k * n_warps;
        const int d0 = first_remote(c, h, t);
        issue_src = nullptr;
        streamed &= ~(1ull << (k % 64));
        if (d0 >= 0) {
          const int q = h.send_index(c.ws.cfg, t, d0);
          const uint64_t g = sh.gen(me, q / sh.C);
          const uint64_t* flag = RingView::combine(c.ws, c.peers.base[d0]).ready + g % N;
          // Not seen.set: the cache may only record chunks checked in token order.
          if (seen.has(d0, g) || __shfl_sync(0xffffffffu, ld_acquire_sys(flag), 0) >= g + 1) {
            issue_src = remote_partial<P>(c, sh, N, d0, q);
            streamed |= 1ull << (k % 64);
          }
        }
      }
      if (issue_src != nullptr) {
        Raw8<P>* slot = slots + static_cast<size_t>(p % D) * U * kWarpSize;
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int v = st * kStepElems + u * kWarpSize * kCombineVec + lane * kCombineVec;
          if (v < sh.H)
#pragma unroll
            for (int i = 0; i < Raw8<P>::kVecs; ++i)
              cp_async_16(&slot[u * kWarpSize].v[i], reinterpret_cast<const int4*>(issue_src + v) + i);
        }
      }
    }
    cp_async_commit();
  };
  for (int64_t p = 0; p < D; ++p) issue(p);

  for (int k = 0; k < n_tok; ++k) {
    const int t = warp + k * n_warps;
    // q of t for rank d (index among my tokens sent to d), or -1: read where needed (L1 hits).
    auto pos = [&](int d) { return h.send_index(c.ws.cfg, t, d); };
    const int32_t* my_rows = nullptr;
    int my_task = -1;
    if (pos(me) >= 0) {
      my_task = my_first_task + pos(me);
      my_rows = h.task_rows + static_cast<size_t>(my_task) * sh.K;
    }
    if (!wait_token_partials(c, h, sh, N, seen, t)) { cp_async_wait<0>(); return; }
    // The streamed rank, or -1 when t's first remote partial was not ready in time (then it is
    // loaded like any further rank's).
    const int d0 = (streamed >> (k % 64)) & 1 ? first_remote(c, h, t) : -1;
    for (int st = 0; st < S; ++st) {
      const int64_t p = static_cast<int64_t>(k) * S + st;
      const int v0 = st * kStepElems + lane * kCombineVec;
      cp_async_wait<D - 1>();
      Raw8<P> pf[U];
      const Raw8<P>* slot = slots + static_cast<size_t>(p % D) * U * kWarpSize;
      if (d0 >= 0)
#pragma unroll
        for (int u = 0; u < U; ++u)
          if (group_live(v0, u, sh.H)) pf[u] = slot[u * kWarpSize];
      // My own partial, reduced here from my rows (same order and rounding as a producer).
      float part[U][kCombineVec], acc[U][kCombineVec];
      zero(part);
      if (my_rows != nullptr) {
        sum_rows<T, kOwnRows>(part, expert_out, my_rows, sh.K, a.row_cap, v0, sh.H);
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
          for (int e = 0; e < kCombineVec; ++e) part[u][e] = round_to<P>(part[u][e]);
      }
      // Sum in rank order.
      zero(acc);
      for (int d = 0; d < W; ++d) {
        const int q = pos(d);
        if (q < 0) continue;
        if (d == me) {
#pragma unroll
          for (int u = 0; u < U; ++u)
#pragma unroll
            for (int e = 0; e < kCombineVec; ++e) acc[u][e] += part[u][e];
        } else if (d == d0) {
#pragma unroll
          for (int u = 0; u < U; ++u)
            if (group_live(v0, u, sh.H)) add_raw<P>(acc[u], pf[u]);
        } else {
          const P* src = remote_partial<P>(c, sh, N, d, q);
          Raw8<P> r[U];
#pragma unroll
          for (int u = 0; u < U; ++u)
            if (group_live(v0, u, sh.H)) load_raw(r[u], src + v0 + u * kWarpSize * kCombineVec);
#pragma unroll
          for (int u = 0; u < U; ++u)
            if (group_live(v0, u, sh.H)) add_raw<P>(acc[u], r[u]);
        }
      }
#pragma unroll
      for (int u = 0; u < U; ++u)
        if (group_live(v0, u, sh.H))
          Vec8<T>::store(y + static_cast<size_t>(t) * sh.H + v0 + u * kWarpSize * kCombineVec, acc[u]);
      // The slot's values were used above; now refill it with the piece D steps ahead.
      issue(p + D);
    }
    if (grad_w != nullptr && lane < sh.K) {
      float val = 0.f;
      for (int d = 0; d < W; ++d) {
        const int q = pos(d);
        if (q < 0) continue;
        float part = 0.f;
        if (d == me) {
          for (int k = 0; k < sh.K; ++k) {
            const int row = my_rows[k];
            if (row < 0) break;
            if (h.task_k[static_cast<size_t>(my_task) * sh.K + k] == lane && row < a.row_cap)
              part = grad_probs[row];
          }
        } else {
          const uint64_t g = sh.gen(me, q / sh.C);
          const char* chunk = c.peers.base[d] + c.ws.comb_ring + (g % N) * c.ws.comb_chunk_bytes;
          part = reinterpret_cast<const volatile float*>(chunk + c.ws.comb_side_offset)[(q % sh.C) * sh.K + lane];
        }
        val += part;
      }
      grad_w[static_cast<size_t>(t) * sh.K + lane] = val;
    }
    // Release: the last of my tokens in a (rank, chunk) frees that chunk of d's ring.
    __syncwarp();
    if (lane == 0) {
      __threadfence();
      for (int d = 0; d < W; ++d) {
        const int q = pos(d);
        if (q < 0 || d == me) continue;
        const int j = q / sh.C;
        const uint64_t g = sh.gen(me, j);
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
  }
}

template <typename T, typename P, int kOwnRows>
__global__ void __launch_bounds__(kCombineThreads, 1)
    combine_transfer_kernel(CommContext c, HandleArrays h, TransferArgs a, CombineShape sh,
                            const T* expert_out, const float* grad_probs, T* y, float* grad_w) {
  extern __shared__ __align__(16) int4 smem[];
  if (aborted(c)) return;  // after a protocol error: touch nothing (see dispatch_transfer.cu)
  sh.seq = c.counters()->comb_seq;
  trace_warp(c, true);
  Raw8<P>* stream = reinterpret_cast<Raw8<P>*>(smem);
  if (sh.phased) {
    // The whole call fits in the ring, so producing never waits for this call's consumers:
    // every block reduces its share of the remote tasks first, then sums its share of my
    // tokens, by which time the peers' partials are (mostly) staged. No block idles while
    // the other role is the bottleneck, and the partial stream rarely finds a chunk unready.
    const Role all{0, static_cast<int>(gridDim.x)};
    produce<T, P>(c, h, a, sh, all, expert_out, grad_probs);
    trace_phase_end(c);
    consume<T, P, kOwnRows>(c, h, a, sh, all, expert_out, grad_probs, y, grad_w, stream);
  } else if (static_cast<int>(blockIdx.x) < a.num_producers) {
    // A call larger than the ring: producers must run alongside the consumers that free slots.
    produce<T, P>(c, h, a, sh, Role{0, a.num_producers}, expert_out, grad_probs);
  } else {
    consume<T, P, kOwnRows>(c, h, a, sh, Role{a.num_producers, a.num_blocks - a.num_producers},
                            expert_out, grad_probs, y, grad_w, stream);
  }
  trace_warp(c, false);
  warp_done_advance(&c.counters()->comb_warps_done, &c.counters()->comb_seq);
}

template <typename T, typename P>
cudaError_t launch_typed(const CommContext& c, const HandleArrays& h, const TransferArgs& t,
                         const CombineShape& sh, const void* expert_out, const float* grad_probs,
                         void* y, float* grad_w, cudaStream_t s) {
  constexpr size_t smem = PartialStream<P>::kSmemBytes;
  // Own rows loaded per batch by a consumer lane: 2 (1 for fp32 rows). 4 spills registers
  // and measured slower in both schedules (benchmarks/NOTES.md #10, #12).
  auto kernel = combine_transfer_kernel<T, P, (sizeof(T) == 4 ? 1 : 2)>;
  if (cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(smem)))
    return e;
  kernel<<<t.num_blocks, kCombineThreads, smem, s>>>(
      c, h, t, sh, static_cast<const T*>(expert_out), grad_probs, static_cast<T*>(y), grad_w);
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
  // MOK_COMBINE_PHASED=0 forces the role split (tests cover both schedules).
  const char* phased_env = getenv("MOK_COMBINE_PHASED");
  sh.phased = sh.cpc <= c.ws.cfg.comb_ring_chunks && !(phased_env != nullptr && phased_env[0] == '0');
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

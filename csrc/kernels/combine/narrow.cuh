// Included only from kernels/combine_transfer.cu; uses shape.cuh, produce.cuh, partials.cuh.
// Holds the narrow calls' paths (hidden 8, a lane per item): produce_narrow, consume_narrow.
#pragma once

namespace mok {
namespace {

// ---- Narrow calls: rows of one 8-element vector (hidden == kCombineVec), phased --------------
// The prob-gradient call (the FP8 dispatch's backward: zero rows of width 8, the gradients as side
// values) is latency-bound on the warp-per-item path: a warp walks ~11 tokens at 4096 tokens, each
// a chain of dependent loads (positions, row ids, rows, slot ids, gradients), with 31 lanes idle
// in the row sums (benchmarks/NOTES.md item 22). Here a lane takes a whole item, so the chains of
// the items run side by side. Same ring slots, same rows in the same order from +0.0, the same
// roundings and the same rank order as produce_row and consume: the bits are the same.

// acc += a task's rows of one vector each (`rows`: its K row ids), in row order. The live rows
// (0 <= row < row_cap) are a prefix and ascend (stream_rows), so the first dead one ends them.
template <typename T>
__device__ __forceinline__ void sum_narrow_rows(float (&acc)[kCombineVec], const T* expert_out,
                                                const int32_t* rows, int K, int64_t row_cap) {
  for (int k = 0; k < K; ++k) {
    const int row = rows[k];
    if (row < 0 || row >= row_cap) break;
    Raw8<T> r;
    load_raw(r, expert_out + static_cast<size_t>(row) * kCombineVec);
    add_raw<T>(acc, r);
  }
}

// Warp-wide: every lane with `active` set names ring slot `slot` (generation `g`); each distinct
// slot is checked once, as ring_slot_acquire_warp. False after a timeout or an abort.
__device__ __forceinline__ bool acquire_lane_slots(const CommContext& c, const RingView& mine, bool active,
                                                   int64_t slot, uint64_t g) {
  for (unsigned todo = __ballot_sync(0xffffffffu, active); todo != 0;) {
    const int leader = __ffs(todo) - 1;
    const int64_t sl = __shfl_sync(0xffffffffu, slot, leader);
    const uint64_t gl = __shfl_sync(0xffffffffu, g, leader);
    if (!ring_slot_acquire_warp(c, mine, sl, gl, kWaitCombineReleased)) return false;
    todo &= ~__ballot_sync(0xffffffffu, active && slot == sl);
  }
  return true;
}

// The produce phase of a narrow call: lane i of the grid (warps numbered across blocks first,
// a warp's lanes on consecutive tasks, so they share one or two chunks) reduces remote task i:
// its rows in row order from +0.0, rounded once to P, and its side values. Then, per chunk the
// warp wrote rows of, one count; the count that completes a chunk publishes it.
template <typename T, typename P>
__device__ void produce_narrow(const CommContext& c, const HandleArrays& h, const TransferArgs& a,
                               const CombineShape& sh, const T* expert_out, const float* grad_probs) {
  const int lane = threadIdx.x % kWarpSize;
  const int n_warps = gridDim.x * (blockDim.x / kWarpSize);
  const int warp = static_cast<int>(threadIdx.x / kWarpSize) * gridDim.x + blockIdx.x;
  RingView mine = RingView::combine(c.ws, c.local());
  int32_t* arrived = reinterpret_cast<int32_t*>(c.local() + c.ws.comb_arrived);
  const int total = remote_tasks(c, h);  // my own tokens' partials are summed by their consumers
  TaskCursor cur;
  for (int base = warp * kWarpSize; base < total; base += n_warps * kWarpSize) {
    const int i = base + lane;
    const bool active = i < total;
    int s = 0, q = 0;
    if (active) cur.seek(c, h, i, s, q);
    const int j = q / sh.C;
    const uint64_t g = sh.gen(s, j);
    const int64_t slot = active ? sh.slot(s, j) : -1;
    if (!acquire_lane_slots(c, mine, active, slot, g)) return;
    if (active) {
      const int task = h.task_off[s] + q;
      const int32_t* rows = h.task_rows + static_cast<size_t>(task) * sh.K;
      char* chunk = mine.ring + slot * mine.chunk_bytes;
      float acc[kCombineVec] = {};
      sum_narrow_rows<T>(acc, expert_out, rows, sh.K, a.row_cap);
      Vec8<P>::store(reinterpret_cast<P*>(chunk) + static_cast<size_t>(q % sh.C) * kCombineVec, acc);
      if (grad_probs != nullptr) {
        // Side value of slot k: the gradient of the task's row from slot k, else 0 (each slot
        // names at most one row of a task).
        float* side = reinterpret_cast<float*>(chunk + c.ws.comb_side_offset) + (q % sh.C) * sh.K;
        for (int k = 0; k < sh.K; ++k) side[k] = 0.f;
        for (int k = 0; k < sh.K; ++k) {
          const int row = rows[k];
          if (row < 0) break;
          if (row < a.row_cap) side[h.task_k[static_cast<size_t>(task) * sh.K + k]] = grad_probs[row];
        }
      }
    }
    // Count the rows per chunk: one atomic per distinct slot of the warp (produce_rows' rule).
    __syncwarp();
    const int n_s = active ? h.task_off[s + 1] - h.task_off[s] : 0;
    for (unsigned todo = __ballot_sync(0xffffffffu, active); todo != 0;) {
      const int leader = __ffs(todo) - 1;
      const int64_t sl = __shfl_sync(0xffffffffu, slot, leader);
      const unsigned same = __ballot_sync(0xffffffffu, active && slot == sl);
      if (lane == leader) chunk_rows_arrived(arrived, mine, slot, g, s, __popc(same), min(sh.C, n_s - j * sh.C));
      todo &= ~same;
    }
  }
}

// The consume phase of a narrow call: lane i of the grid sums my token i (a warp's lanes on
// consecutive tokens): waits for its holders' chunks (each lane acquires the flags of the
// partials it reads), reduces my own rows of it as a producer would (rounded once to P), adds
// the holders' partials in rank order from +0.0 and writes y; the prob gradients likewise, each
// slot's sum in registers. Chunks are released once per call by the grid's last warp (a narrow
// call is phased with release_at_end).
template <typename T, typename P>
__device__ void consume_narrow(const CommContext& c, const HandleArrays& h, const TransferArgs& a,
                               const CombineShape& sh, const T* expert_out, const float* grad_probs,
                               T* y, float* grad_w) {
  const int lane = threadIdx.x % kWarpSize;
  const int n_warps = gridDim.x * (blockDim.x / kWarpSize);
  const int warp = static_cast<int>(threadIdx.x / kWarpSize) * gridDim.x + blockIdx.x;
  const int W = c.world, me = c.rank, K = sh.K;
  for (int t = warp * kWarpSize + lane; t < a.num_tokens; t += n_warps * kWarpSize) {
    for (int d = 0; d < W; ++d) {
      const int q = h.send_index(c.ws.cfg, t, d);
      if (q < 0 || d == me) continue;
      const uint64_t g = sh.gen(me, q / sh.C);
      if (!wait_published(c, RingView::combine(c.ws, c.peers.base[d]).ready + sh.slot(me, q / sh.C), g + 1, d,
                          kWaitCombineReady, static_cast<int64_t>(g)))
        return;
    }
    float acc[kCombineVec] = {};
    float grad[kMaxTopk] = {};
    for (int d = 0; d < W; ++d) {
      const int q = h.send_index(c.ws.cfg, t, d);
      if (q < 0) continue;
      if (d == me) {
        const int task = h.task_off[me] + q;
        const int32_t* rows = h.task_rows + static_cast<size_t>(task) * K;
        float part[kCombineVec] = {};
        sum_narrow_rows<T>(part, expert_out, rows, K, a.row_cap);
#pragma unroll
        for (int e = 0; e < kCombineVec; ++e) acc[e] += round_to<P>(part[e]);
        if (grad_w != nullptr)
          for (int k = 0; k < K; ++k) {
            // The slot's gradient; slots with no row here add nothing (consume adds +0.0, which
            // leaves every sum that starts from +0.0 unchanged).
            const int row = rows[k];
            if (row < 0) break;
            if (row >= a.row_cap) continue;
            const int slot_k = h.task_k[static_cast<size_t>(task) * K + k];
            const float v = grad_probs[row];
#pragma unroll
            for (int kk = 0; kk < kMaxTopk; ++kk)
              if (kk == slot_k) grad[kk] += v;
          }
      } else {
        Raw8<P> r;
        load_raw(r, remote_partial<P>(c, sh, d, q));
        add_raw<P>(acc, r);
        if (grad_w != nullptr) {
          const volatile float* side = reinterpret_cast<const volatile float*>(
              partial_chunk(c, sh, d, q) + c.ws.comb_side_offset) + (q % sh.C) * K;
#pragma unroll
          for (int kk = 0; kk < kMaxTopk; ++kk)
            if (kk < K) grad[kk] += side[kk];
        }
      }
    }
    Vec8<T>::store(y + static_cast<size_t>(t) * kCombineVec, acc);
    if (grad_w != nullptr)
#pragma unroll
      for (int kk = 0; kk < kMaxTopk; ++kk)
        if (kk < K) grad_w[static_cast<size_t>(t) * K + kk] = grad[kk];
  }
}

}  // namespace
}  // namespace mok

// Included only from kernels/combine_transfer.cu; uses shape.cuh.
// Holds the warp-per-task producers: produce_row, produce_chunks, TaskCursor, produce_rows.
#pragma once

namespace mok {
namespace {

// One task's partial: its rows here summed in row order (fp32 from +0.0), rounded once to P,
// written by one warp to `dst`; lane k < K also writes the prob-gradient side value of slot k.
template <typename T, typename P>
__device__ __forceinline__ void produce_row(const HandleArrays& h, const TransferArgs& a,
                                            const CombineShape& sh, int task, const T* expert_out,
                                            const float* grad_probs, P* dst, float* side,
                                            int first_step = 0, int n_steps = 1 << 30) {
  constexpr int kStepElems = kWarpSize * kCombineVec * U;
  const int lane = threadIdx.x % kWarpSize;
  const int32_t* rows = h.task_rows + static_cast<size_t>(task) * sh.K;
  HeldRows held;
  const bool use_held = sh.K <= kHeldRows;
  if (use_held) held.load(rows, sh.K);
  const int v_end = static_cast<int>(min(static_cast<int64_t>(sh.H),
                                         (static_cast<int64_t>(first_step) + n_steps) * kStepElems));
  for (int v0 = first_step * kStepElems + lane * kCombineVec; v0 < v_end; v0 += kStepElems) {
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
  if (grad_probs != nullptr && first_step == 0 && lane < sh.K) {  // part 0 writes the side values
    float val = 0.f;
    for (int k = 0; k < sh.K; ++k) {
      const int row = rows[k];
      if (row < 0) break;
      if (h.task_k[static_cast<size_t>(task) * sh.K + k] == lane && row < a.row_cap) val = grad_probs[row];
    }
    side[lane] = val;
  }
}

// One lane's report that `n` rows of chunk `slot` (generation g, source s's region) are staged;
// the rows' writes come first. The chunk is complete when `expected` rows arrived: the arrival
// that completes it resets the count (the slot's next generation counts from zero) and publishes
// the slot to its one reader, s. Every producer path that deals a chunk's rows to several warps
// counts them here, so the reset and the publish stay one rule.
__device__ __forceinline__ void chunk_rows_arrived(int32_t* arrived, const RingView& mine, int64_t slot,
                                                   uint64_t g, int s, int n, int expected) {
  __threadfence();
  if (atomicAdd(arrived + slot, n) + n == expected) {
    arrived[slot] = 0;
    ring_slot_publish(mine, slot, g, 1ull << s);
  }
}

// Role split (a call larger than the ring): a chunk belongs to one block, which waits for its
// slot, reduces the chunk's tasks (one warp per task) and publishes it. A slot always belongs to
// the same block, so its generations are written in order even when the ring wraps in a call.
template <typename T, typename P>
__device__ void produce_chunks(const CommContext& c, const HandleArrays& h, const TransferArgs& a,
                               const CombineShape& sh, const Role& role, const T* expert_out,
                               const float* grad_probs) {
  const int warp = threadIdx.x / kWarpSize, n_warps = blockDim.x / kWarpSize;
  RingView mine = RingView::combine(c.ws, c.local());
  for (int s = 0; s < c.world; ++s) {
    if (s == c.rank) continue;  // my own partials are reduced by my consumers directly
    const int first = h.task_off[s], n = h.task_off[s + 1] - first;
    for (int j = 0; j * sh.C < n; ++j) {
      const uint64_t g = sh.gen(s, j);
      const int64_t slot = sh.slot(s, j);
      if (slot % role.count != role.index()) continue;
      if (!ring_slot_acquire(c, mine, slot, g, kWaitCombineReleased)) return;
      char* chunk = mine.ring + slot * mine.chunk_bytes;
      const int rows_here = min(sh.C, n - j * sh.C);
      for (int q = warp; q < rows_here; q += n_warps)
        produce_row<T, P>(h, a, sh, first + j * sh.C + q, expert_out, grad_probs,
                          reinterpret_cast<P*>(chunk) + static_cast<size_t>(q) * sh.H,
                          reinterpret_cast<float*>(chunk + c.ws.comb_side_offset) + q * sh.K);
      __syncthreads();
      if (threadIdx.x == 0) ring_slot_publish(mine, slot, g, 1ull << s);
    }
  }
}

// My tasks of every source but me: the produce phase's work unless my own partials are staged
// too (then my own tasks follow them: produce_tasks).
__device__ __forceinline__ int remote_tasks(const CommContext& c, const HandleArrays& h) {
  return h.task_off[c.world] - (h.task_off[c.rank + 1] - h.task_off[c.rank]);
}

// The produce phase's tasks: the remote ones, then (own_staged) my own tokens' tasks.
__device__ __forceinline__ int produce_tasks(const CommContext& c, const HandleArrays& h, bool own_staged) {
  return own_staged ? h.task_off[c.world] : remote_tasks(c, h);
}

// Virtual task i (the tasks of every source but me, back to back, then my own: produce_tasks)
// -> its source and its index among that source's tasks. Calls must come with ascending i.
// The peers' partials come first because the peers wait for them; my own wait only for me.
struct TaskCursor {
  int s = 0, s_first = 0;  // current source, and the virtual index of its first task
  __device__ void seek(const CommContext& c, const HandleArrays& h, int i, int& src, int& q) {
    const int own_first = remote_tasks(c, h);
    if (i >= own_first) {  // only when my own partials are staged (produce_tasks)
      src = c.rank;
      q = i - own_first;
      return;
    }
    while (s == c.rank || i >= s_first + (h.task_off[s + 1] - h.task_off[s])) {
      if (s != c.rank) s_first += h.task_off[s + 1] - h.task_off[s];
      ++s;
    }
    src = s;
    q = i - s_first;
  }
};

// Phased schedule (the call fits in the ring, so every slot is written at most once per call):
// the remote tasks are spread over every warp of the grid, numbered across blocks first, so a
// small call's few chunks still use every SM (one block per chunk left a 128-token call's
// partials to 2 of 24 SMs: benchmarks/NOTES.md #18). Each warp checks its chunk's slot before
// its first write there; the warp that stages a chunk's last row publishes it.
template <typename T, typename P>
__device__ void produce_rows(const CommContext& c, const HandleArrays& h, const TransferArgs& a,
                             const CombineShape& sh, const T* expert_out, const float* grad_probs,
                             bool own_staged) {
  const int lane = threadIdx.x % kWarpSize;
  const int n_warps = gridDim.x * (blockDim.x / kWarpSize);
  const int warp = static_cast<int>(threadIdx.x / kWarpSize) * gridDim.x + blockIdx.x;
  RingView mine = RingView::combine(c.ws, c.local());
  int32_t* arrived = reinterpret_cast<int32_t*>(c.local() + c.ws.comb_arrived);
  int64_t acquired = -1;  // the last slot this warp checked (its tasks ascend, so chunks do)
  TaskCursor cur;
  const int total = produce_tasks(c, h, own_staged);
  constexpr int kStepElems = kWarpSize * kCombineVec * U;
  const int S = (sh.H + kStepElems - 1) / kStepElems;
  // Few tasks (a small call): warp w takes steps of part w / total of task w % total, so
  // every warp has work; a chunk is then complete when all parts of all its rows arrived.
  const int Ps = split_factor(sh, n_warps, total, S);
  int first_step = 0, n_steps = S;
  if (Ps > 1) part_steps(S, Ps, warp / max(total, 1), first_step, n_steps);
  const int n_items = Ps > 1 ? total * Ps : total;
  for (int item = warp; item < n_items; item += n_warps) {
    // Ps > 1: at most one item per warp (items < n_warps), so i ascends either way.
    const int i = Ps > 1 ? item % total : item;
    int s, q;
    cur.seek(c, h, i, s, q);
    const int j = q / sh.C;
    const int n = h.task_off[s + 1] - h.task_off[s];
    const uint64_t g = sh.gen(s, j);
    const int64_t slot = sh.slot(s, j);
    if (slot != acquired) {
      if (!ring_slot_acquire_warp(c, mine, slot, g, kWaitCombineReleased)) return;
      acquired = slot;
    }
    char* chunk = mine.ring + slot * mine.chunk_bytes;
    const int r = q % sh.C;
    produce_row<T, P>(h, a, sh, h.task_off[s] + q, expert_out, grad_probs,
                      reinterpret_cast<P*>(chunk) + static_cast<size_t>(r) * sh.H,
                      reinterpret_cast<float*>(chunk + c.ws.comb_side_offset) + r * sh.K,
                      first_step, n_steps);
    __syncwarp();
    if (lane == 0) chunk_rows_arrived(arrived, mine, slot, g, s, 1, min(sh.C, n - j * sh.C) * Ps);
  }
}

}  // namespace
}  // namespace mok

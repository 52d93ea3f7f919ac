// Included only from kernels/combine_transfer.cu; uses shape.cuh, produce.cuh, row_stream.cuh.
// Holds produce_rows_streamed: the phased produce phase fed by the row stream.
#pragma once

namespace mok {
namespace {

// Phased produce phase with the consume loop's row stream (NOTES.md, next experiment (C)): each
// warp's tasks (i = warp, warp + n_warps, ...) are reduced piece by piece from its ring of
// shared-memory slots, their rows copied in with cp.async as many pieces ahead as the ring
// holds (a task has ~4 rows at world size 2, so ~3 pieces), instead of 2 rows x 2 groups of
// register loads per lane. Same rows, order and rounding as produce_row, so the partials are
// bitwise the same. Tasks with more rows than a ring holds are summed from global memory. A
// call with fewer tasks than warps splits tasks over warps and keeps produce_rows.
template <typename T, typename P, int kOwnRows>
__device__ void produce_rows_streamed(const CommContext& c, const HandleArrays& h, const TransferArgs& a,
                                      const CombineShape& sh, const T* expert_out, const float* grad_probs,
                                      int4* smem, bool own_staged) {
  using RS = RowStream<T, P>;
  constexpr int Uc = kConsumeUnroll;
  constexpr int kStepElems = kWarpSize * kCombineVec * Uc;
  const int lane = threadIdx.x % kWarpSize;
  const int n_warps = gridDim.x * (blockDim.x / kWarpSize);
  const int warp = static_cast<int>(threadIdx.x / kWarpSize) * gridDim.x + blockIdx.x;
  const int total = produce_tasks(c, h, own_staged);
  const int S = (sh.H + kStepElems - 1) / kStepElems;
  if (split_factor(sh, n_warps, total, (sh.H + kWarpSize * kCombineVec * U - 1) / (kWarpSize * kCombineVec * U)) > 1) {
    produce_rows<T, P>(c, h, a, sh, expert_out, grad_probs, own_staged);
    return;
  }
  RingView mine = RingView::combine(c.ws, c.local());
  int32_t* arrived = reinterpret_cast<int32_t*>(c.local() + c.ws.comb_arrived);
  const WarpRing<T, P> ring(smem);
  int n_mine = total > warp ? (total - warp + n_warps - 1) / n_warps : 0;
  int first_task = warp, task_stride = n_warps, n_first = n_mine, second_task = 0;
  if (sh.produce_runs) {
    // Runs of consecutive tasks per warp: they share ring chunks, so the slot check, the fence
    // and the arrival count are paid once per chunk of the run instead of once per task (NOTES
    // #39). Two runs: one of the remote tasks, then one of my own (own_staged), so the peers'
    // chunks are complete halfway through the phase; one run of all tasks left a 4-rank
    // loopback group's consumers waiting for peers' chunks that completed only at their end.
    auto run = [&](int n, int& first, int& len) {  // the first n % n_warps warps one more
      const int base = n / n_warps, extra = n % n_warps;
      len = base + (warp < extra ? 1 : 0);
      first = warp * base + min(warp, extra);
    };
    const int n_remote = remote_tasks(c, h);
    int n_second;
    run(n_remote, first_task, n_first);
    run(total - n_remote, second_task, n_second);
    second_task += n_remote;
    n_mine = n_first + n_second;
    task_stride = 1;
  }
  auto virtual_task = [&](int k) {
    return k < n_first ? first_task + k * task_stride : second_task + (k - n_first);
  };
  auto task_rows = [&](int task) { return h.task_rows + static_cast<size_t>(task) * sh.K; };

  // ---- issue side (StreamIssue: piece is.st of my task is.k is next)
  TaskCursor icur;
  StreamIssue is(ring);
  int ik = -1, in_rows = 0;    // task whose plan is below, and its rows streamed
  unsigned long long ibase = 0; // lane r: the address of that task's row r
  auto try_issue = [&]() {
    while (is.k < n_mine) {
      if (is.k != ik) {  // plan the task once, when its first piece comes up
        ik = is.k;
        int s, q, irow;
        icur.seek(c, h, virtual_task(is.k), s, q);
        const int n = stream_rows<RS::kMaxOwn>(task_rows(h.task_off[s] + q), sh.K, a.row_cap, irow);
        ibase = irow >= 0 ? reinterpret_cast<unsigned long long>(expert_out + static_cast<size_t>(irow) * sh.H) : 0;
        in_rows = n < 0 ? 0 : n;  // n < 0: too many rows for the ring, summed from global memory
      }
      if (in_rows > is.free_slots) return;
      is.piece<T>(ring, ibase, in_rows, S, sh.H);
    }
  };
  try_issue();

  // ---- reduce side
  TaskCursor ccur;
  int64_t acquired = -1;  // the last slot this warp checked (its tasks ascend, so chunks do)
  unsigned caddr = ring.begin;
  int arrivals = 0;       // tasks of the current chunk staged by this warp and not yet counted
  for (int k = 0; k < n_mine; ++k) {
    int s, q;
    ccur.seek(c, h, virtual_task(k), s, q);
    const int task = h.task_off[s] + q, j = q / sh.C, n_s = h.task_off[s + 1] - h.task_off[s];
    const uint64_t g = sh.gen(s, j);
    const int64_t slot = sh.slot(s, j);
    if (slot != acquired) {
      if (!ring_slot_acquire_warp(c, mine, slot, g, kWaitCombineReleased)) { cp_async_wait<0>(); return; }
      acquired = slot;
    }
    char* chunk = mine.ring + slot * mine.chunk_bytes;
    P* dst = reinterpret_cast<P*>(chunk) + static_cast<size_t>(q % sh.C) * sh.H;
    const int32_t* rows = task_rows(task);
    int lane_row;
    const int n_rows = stream_rows<RS::kMaxOwn>(rows, sh.K, a.row_cap, lane_row);  // as planned
    for (int st = 0; st < S; ++st) {
      const int v0 = st * kStepElems + lane * kCombineVec;
      try_issue();  // this piece is issued (the ring is free by now)
      cp_async_wait_at_most(is.ahead - 1);  // it has landed; the ahead - 1 after it may be in flight
      --is.ahead;
      float acc[Uc][kCombineVec];
      zero(acc);
      if (n_rows >= 0) {
        caddr = ring.sum_rows(acc, caddr, n_rows);
        is.free_slots += n_rows;
      } else {
        sum_rows<T, kOwnRows>(acc, expert_out, rows, sh.K, a.row_cap, v0, sh.H);
      }
#pragma unroll
      for (int u = 0; u < Uc; ++u)
        if (group_live(v0, u, sh.H)) Vec8<P>::store(dst + v0 + u * kWarpSize * kCombineVec, acc[u]);
    }
    if (grad_probs != nullptr && lane < sh.K) {  // the prob-gradient side values, as produce_row
      float val = 0.f;
      for (int kk = 0; kk < sh.K; ++kk) {
        const int row = rows[kk];
        if (row < 0) break;
        if (h.task_k[static_cast<size_t>(task) * sh.K + kk] == lane && row < a.row_cap) val = grad_probs[row];
      }
      reinterpret_cast<float*>(chunk + c.ws.comb_side_offset)[(q % sh.C) * sh.K + lane] = val;
    }
    // Count this warp's tasks of the chunk once it moves on to another chunk (or ends): in a
    // run that is once per chunk, in the strided order after every task.
    ++arrivals;
    if (!sh.produce_runs || k + 1 == n_mine || k + 1 == n_first || (q + 1) % sh.C == 0 || q + 1 == n_s) {
      __syncwarp();
      if (lane == 0) chunk_rows_arrived(arrived, mine, slot, g, s, arrivals, min(sh.C, n_s - j * sh.C));
      arrivals = 0;
    }
  }
  cp_async_wait<0>();  // the consume phase reuses the ring
}

}  // namespace
}  // namespace mok

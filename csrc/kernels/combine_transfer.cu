// The combine data path: one persistent kernel, two kinds of work.
//
//   produce  for every remote source s, reduce each of its tasks' rows here in row order
//            (fp32 from +0.0), round once to the partial dtype, and stage the partial in my
//            combine ring, in s's region, at the token's index among s's tokens that come
//            here (s knows that index: send_pos). Optional side values carry the prob
//            gradients of the task's slots. Phased calls with a token per warp (own_staged)
//            stage my own tokens' partials the same way, in my region.
//   consume  one of my tokens at a time: for every rank d holding rows of it, in rank order,
//            add d's partial (pulled over NVLink, read from my ring when d is me and it was
//            staged, or else reduced right here) in fp32; round once to the output dtype.
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
  int stream_own;    // consumers stream their own expert rows through shared memory (else they
                     // load them straight into registers and stream only the remote partials)
  int split;         // a token's (or a task's) steps may be dealt to several warps when the
                     // call has fewer of them than the grid has warps (MOK_COMBINE_SPLIT=0: never)
  int token_runs;    // phased consumers take runs of consecutive tokens (else every n_warps-th)
  int release_at_end; // phased calls: the grid's last warp releases the partial chunks read
  int produce_runs;  // the phased produce phase gives each warp a run of consecutive tasks
                     // (else every n_warps-th; MOK_COMBINE_PRODUCE_RUNS=0)
  int own_staged;    // phased calls, world > 1: my own partials are produced into my ring too and
                     // consumers only sum partials (consume_staged; MOK_COMBINE_OWN_STAGED=0: off)
  int narrow;        // phased calls whose rows are one 8-element vector (hidden == 8: the
                     // prob-gradient call): a lane per task and per token (produce_narrow,
                     // consume_narrow; MOK_COMBINE_NARROW=0: the warp-per-item path)

  CallSlots slots;   // this call's ring slots (N set by the host, the rest at kernel start)

  // Generation of chunk j of source region s (rank s's tokens) in this call.
  __device__ uint64_t gen(int s, int j) const { return seq * cpc + static_cast<uint64_t>(s) * cps + j; }
  // Its ring slot, gen(s, j) % N.
  __device__ int slot(int s, int j) const { return slots.slot(s * cps + j); }
  __device__ void start(uint64_t call) {
    seq = call;
    slots.start(call, cpc);
  }
};

// How many warps share one work item (a token to sum, a task to reduce): as many as the grid
// has warps per item, at most one per step. A small call (128 tokens on 384 warps) would
// otherwise leave most warps idle while each busy one walks all S steps of its item alone.
__device__ __forceinline__ int split_factor(const CombineShape& sh, int n_warps, int items, int S) {
  if (!sh.split || items <= 0) return 1;
  return max(1, min(S, n_warps / items));
}

// Steps [first, first + count) of part `part` of P: the S steps dealt as evenly as possible.
__device__ __forceinline__ void part_steps(int S, int P, int part, int& first, int& count) {
  first = part * S / P;
  count = (part + 1) * S / P - first;
}

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

// The chunk of rank d's combine ring that holds the partial of my token whose index among my
// tokens sent to d is q (row q % C of it).
__device__ __forceinline__ const char* partial_chunk(const CommContext& c, const CombineShape& sh, int d, int q) {
  return c.peers.base[d] + c.ws.comb_ring + static_cast<int64_t>(sh.slot(c.rank, q / sh.C)) * c.ws.comb_chunk_bytes;
}

// Where rank d staged that partial.
template <typename P>
__device__ __forceinline__ const P* remote_partial(const CommContext& c, const CombineShape& sh, int d, int q) {
  return reinterpret_cast<const P*>(partial_chunk(c, sh, d, q)) + static_cast<size_t>(q % sh.C) * sh.H;
}

// The prob-gradient side value of slot `lane` staged with that partial.
__device__ __forceinline__ float partial_side_value(const CommContext& c, const CombineShape& sh, int d, int q, int lane) {
  return reinterpret_cast<const volatile float*>(partial_chunk(c, sh, d, q) + c.ws.comb_side_offset)[(q % sh.C) * sh.K + lane];
}

// Lane 0, per-token release (MOK_COMBINE_RELEASE_AT_END=0): one more of my tokens (counted Pc
// times when split over warps) was read from chunk q / C of rank d's ring; the last frees it.
__device__ __forceinline__ void release_token_chunk(const CommContext& c, const HandleArrays& h,
                                                    const CombineShape& sh, int d, int q, int Pc) {
  const int64_t N = RingView::combine(c.ws, c.local()).num_chunks;
  const int j = q / sh.C;
  const int64_t slot = sh.slot(c.rank, j);
  const int expected = min(sh.C, h.send_count[d] - j * sh.C) * Pc;  // every part reads it
  int32_t* done = RingView::combine(c.ws, c.local()).done + static_cast<size_t>(d) * N + slot;
  if (atomicAdd(done, 1) + 1 == expected) {
    *done = 0;
    __threadfence_system();
    RingView theirs = RingView::combine(c.ws, c.peers.base[d]);
    st_release_sys(theirs.released + static_cast<size_t>(c.rank) * N + slot, sh.gen(c.rank, j) + 1);
  }
}

// Waits until every remote partial of token t is staged (the warp's cache of ready chunks
// skips the flag read for tokens of a chunk already seen).
__device__ bool wait_token_partials(const CommContext& c, const HandleArrays& h, const CombineShape& sh,
                                    SeenGens& seen, int t) {
  const int W = c.world, me = c.rank;
  for (int d = 0; d < W; ++d) {
    const int q = h.send_index(c.ws.cfg, t, d);
    if (q < 0 || d == me) continue;
    const uint64_t g = sh.gen(me, q / sh.C);
    if (!seen.has(d, g)) {
      RingView theirs = RingView::combine(c.ws, c.peers.base[d]);
      if (!wait_geq(c, theirs.ready + sh.slot(me, q / sh.C), g + 1, d, kWaitCombineReady, static_cast<int64_t>(g)))
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

// Shared memory of the consume loop (and of the streamed produce phase before it): per warp,
// a ring of row slots. A slot holds one row's (expert row or remote partial) data for one
// piece: kConsumeUnroll groups x 32 lanes x 16 B per bf16 group (32 B when the tokens or the
// partials are fp32). 16 warps x 14 KB = 224 KB.
template <typename T, typename P>
struct RowStream {
  static constexpr int kVecs = Raw8<T>::kVecs > Raw8<P>::kVecs ? Raw8<T>::kVecs : Raw8<P>::kVecs;
  static constexpr int kSlotInt4 = kConsumeUnroll * kWarpSize * kVecs;  // 16-byte words per slot
  static constexpr int kWarpBytes = 14 * 1024;
  static constexpr int kSlots = kWarpBytes / (kSlotInt4 * 16);  // 14 (16-bit data) or 7 at 2 groups
  // Own rows a token may have for them to be streamed (with its partial, within the ring).
  static constexpr int kMaxOwn = kHeldRows < kSlots - 1 ? kHeldRows : kSlots - 1;
  static constexpr size_t kSmemBytes = static_cast<size_t>(kCombineThreads / kWarpSize) * kWarpBytes;
};

// cp.async.wait_group takes an immediate: wait until at most `n` groups are pending (above 7
// it waits for 7, and below 0 for all: both only wait longer).
__device__ __forceinline__ void cp_async_wait_at_most(int n) {
  switch (n) {
    case 1: cp_async_wait<1>(); break;
    case 2: cp_async_wait<2>(); break;
    case 3: cp_async_wait<3>(); break;
    case 4: cp_async_wait<4>(); break;
    case 5: cp_async_wait<5>(); break;
    case 6: cp_async_wait<6>(); break;
    default:
      if (n >= 7) cp_async_wait<7>();
      else cp_async_wait<0>();
      break;
  }
}

// A warp's ring of RowStream slots in shared memory, as this lane's shared-memory addresses: a
// slot's group u starts kGroupBytes * u after the lane's address of the slot. Each side of a
// stream walks the ring with one 32-bit address (next), so a load or copy costs no address
// arithmetic beyond an immediate offset (the index-based version spent ~5 instructions per
// load: NOTES.md #24). Used by the consume loop and by the streamed produce phase.
template <typename T, typename P>
struct WarpRing {
  using RS = RowStream<T, P>;
  static constexpr int kSlots = RS::kSlots;
  static constexpr unsigned kSlotBytes = RS::kSlotInt4 * 16;
  static constexpr unsigned kGroupBytes = kWarpSize * RS::kVecs * 16;
  unsigned begin, end;
  __device__ explicit WarpRing(int4* smem) {
    begin = static_cast<unsigned>(__cvta_generic_to_shared(
                smem + static_cast<size_t>(threadIdx.x / kWarpSize) * kSlots * RS::kSlotInt4)) +
            (threadIdx.x % kWarpSize) * RS::kVecs * 16;
    end = begin + kSlots * kSlotBytes;
  }
  // The address n slots after `addr` (n <= kSlots), wrapped.
  __device__ unsigned next(unsigned addr, int n) const {
    addr += n * kSlotBytes;
    return addr >= end ? addr - kSlots * kSlotBytes : addr;
  }
  // Copies one piece (kConsumeUnroll groups at element v0 of this lane) of each of n rows into
  // the n slots from `dst`: lane r's `lane_base` is row r's address, so a row's copies are a
  // shuffle, one 64-bit add and unpredicated cp.asyncs with immediate offsets (dead groups are
  // zero-filled). E: the rows' element type (T for expert rows, P for staged partials). Returns
  // the slot after them.
  template <typename E = T>
  __device__ unsigned copy_rows(unsigned dst, unsigned long long lane_base, int n, int v0, int H) const {
    constexpr int Uc = kConsumeUnroll;
    const unsigned voff = static_cast<unsigned>(v0) * sizeof(E);  // a row is far shorter than 4 GiB
    bool live[Uc];
#pragma unroll
    for (int u = 0; u < Uc; ++u) live[u] = group_live(v0, u, H);
    for (int j = 0; j < n; ++j) {
      const char* row = reinterpret_cast<const char*>(__shfl_sync(0xffffffffu, lane_base, j)) + voff;
#pragma unroll
      for (int u = 0; u < Uc; ++u) {
        const int4* src = reinterpret_cast<const int4*>(row + u * kWarpSize * kCombineVec * sizeof(E));
#pragma unroll
        for (int w = 0; w < Raw8<E>::kVecs; ++w) cp_async_16_shared_if(dst + u * kGroupBytes + 16 * w, src + w, live[u]);
      }
      dst = next(dst, 1);
    }
    return dst;
  }
  // acc += the n rows' piece in the n slots from `src` (row order). Every group is summed, live
  // or not: a dead group's words were zero-filled by its copy and its sums are never stored, so
  // the loop needs no branch per group. E as in copy_rows. Returns the slot after them.
  template <typename E = T>
  __device__ unsigned sum_rows(float (&acc)[kConsumeUnroll][kCombineVec], unsigned src, int n) const {
    for (int j = 0; j < n; ++j) {
#pragma unroll
      for (int u = 0; u < kConsumeUnroll; ++u) {
        Raw8<E> r;
        load_raw_shared(r, src + u * kGroupBytes);
        add_raw<E>(acc[u], r);
      }
      src = next(src, 1);
    }
    return src;
  }
};

// The issue side of a warp's stream: the next piece is step `st` of item `k` (a task or a token of
// S steps), `ahead` pieces are issued and not yet summed, the ring's free slots start at `addr`.
struct StreamIssue {
  int k = 0, st = 0, ahead = 0, free_slots;
  unsigned addr;
  template <typename Ring>
  __device__ explicit StreamIssue(const Ring& ring) : free_slots(Ring::kSlots), addr(ring.begin) {}
  // Copies the next piece of n rows (lane j: row j's address) of element type E, commits it as
  // one group and moves on to the following piece.
  template <typename E, typename Ring>
  __device__ __forceinline__ void piece(const Ring& ring, unsigned long long lane_base, int n, int S, int H) {
    addr = ring.template copy_rows<E>(addr, lane_base, n, st * kWarpSize * kCombineVec * kConsumeUnroll +
                                                               static_cast<int>(threadIdx.x % kWarpSize) * kCombineVec, H);
    cp_async_commit();
    free_slots -= n;
    ++ahead;
    if (++st == S) {
      st = 0;
      ++k;
    }
  }
};

// The own rows of one of my tokens as the stream takes them, read by the whole warp at once:
// lane r gets row r in `lane_row`. The live rows (0 <= row < row_cap) are a prefix (rows are
// packed first and ascend), so these are the rows sum_rows adds, in its order. Returns their
// count, or -1 when there are more than kMax (then they are summed from global memory).
template <int kMax>
__device__ __forceinline__ int stream_rows(const int32_t* rows, int K, int64_t row_cap, int& lane_row) {
  const int lane = threadIdx.x % kWarpSize;
  lane_row = rows != nullptr && lane < K ? rows[lane] : -1;
  const bool live = lane_row >= 0 && lane_row < row_cap;
  const unsigned dead = __ballot_sync(0xffffffffu, !live);
  const int n = dead == 0 ? kWarpSize : __ffs(dead) - 1;
  return n > kMax ? -1 : n;
}

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

// Consumer warps: my tokens t = warp, warp + n_warps, ... Each token is summed in steps of
// U x 256 elements per warp (S steps per token; a "piece" is one step of one token). Every
// piece's own expert rows and its first remote partial are copied into the warp's ring of
// shared-memory slots with 16-byte cp.async, as many pieces ahead as the ring holds (one
// commit group per piece), so the SM keeps ~14 KB per warp in flight instead of the two rows
// a lane's registers hold. A partial is streamed only if its chunk is ready when its token's
// first piece is issued: the stream never WAITS, since this warp has not yet released the
// chunks of the tokens before it, and a producer may be waiting for exactly those slots
// (small rings). Unstreamed partials, partials of further ranks (world > 2) and the own rows
// of tokens with more than kMaxOwn of them are loaded when summed.
template <typename T, typename P, int kOwnRows, bool kSplit>
__device__ void consume(const CommContext& c, const HandleArrays& h, const TransferArgs& a,
                        const CombineShape& sh, const Role& role, const T* expert_out,
                        const float* grad_probs, T* y, float* grad_w, int4* smem) {
  using RS = RowStream<T, P>;
  // MOK_CONSUME_CLOCKS builds: this warp's cycles by kind (ConsumeClock; compiled out otherwise).
  [[maybe_unused]] long long clk[kCClockKinds] = {}, clk0 = 0, clk_t = 0;
  [[maybe_unused]] auto tick = [&](int kind) {
    if constexpr (kConsumeClocks) {
      const long long now = clock64();
      clk[kind] += now - clk_t;
      clk_t = now;
    }
  };
  if constexpr (kConsumeClocks) clk0 = clock64();
  constexpr int Uc = kConsumeUnroll;  // groups per piece (NOTES next experiment (A))
  constexpr int R = RS::kSlots;
  constexpr int kStepElems = kWarpSize * kCombineVec * Uc;
  const int lane = threadIdx.x % kWarpSize;
  const int warps_per_block = blockDim.x / kWarpSize;
  const int n_warps = role.count * warps_per_block;
  // Warps numbered across blocks first (block b's warp w is w * blocks + b), so a call with
  // fewer tokens than warps still spreads over every SM of the role.
  const int warp = static_cast<int>(threadIdx.x / kWarpSize) * role.count + role.index();
  const int W = c.world, me = c.rank;
  const int my_first_task = h.task_off[me];
  const int S = (sh.H + kStepElems - 1) / kStepElems;
  // Fewer tokens than warps: a token's S steps are dealt to P warps (warp w: part w / n_my
  // of token w % n_my, at most one item per warp). Every part waits for the token's partials and
  // sums its own steps in the same order, so the result does not depend on P.
  const int n_my = a.num_tokens;
  const int Pc = kSplit ? split_factor(sh, n_warps, n_my, S) : 1;
  int first_step = 0, n_steps = S;
  if (Pc > 1) part_steps(S, Pc, warp / n_my, first_step, n_steps);
  int n_tok = Pc > 1 ? (warp < n_my * Pc ? 1 : 0)
                     : (n_my > warp ? (n_my - warp + n_warps - 1) / n_warps : 0);
  // Phased calls: a warp's tokens are a run of consecutive ones (the first n_my % n_warps warps
  // one more), so their partials share ring chunks and one ready-flag check over NVLink covers
  // ~10 tokens instead of one per token (every n_warps-th token is ~6 chunks further:
  // benchmarks/NOTES.md #33). The role split keeps the strided order, whose warps all move
  // through the chunks in order (the progress argument of a ring smaller than a call).
  int first_tok = warp, tok_stride = n_warps;
  if (Pc == 1 && sh.token_runs) {
    const int base = n_my / n_warps, extra = n_my % n_warps;
    n_tok = base + (warp < extra ? 1 : 0);
    first_tok = warp * base + min(warp, extra);
    tok_stride = 1;
  }
  auto token_of = [&](int k) { return Pc > 1 ? warp % n_my : first_tok + k * tok_stride; };
  const WarpRing<T, P> ring(smem);
  constexpr unsigned kGroupBytes = WarpRing<T, P>::kGroupBytes;
  auto rows_of = [&](int t) -> const int32_t* {
    const int q = h.send_index(c.ws.cfg, t, me);
    return q < 0 ? nullptr : h.task_rows + static_cast<size_t>(my_first_task + q) * sh.K;
  };
  SeenGens seen;

  // ---- issue side: the next piece is token iss_k's step iss_st (counters, not a piece index
  // / n_steps: a 64-bit division per piece was a subroutine call, NOTES.md #22); the
  // ring's free slots start at address iaddr.
  int ahead = 0, iss_k = 0, iss_st = first_step;  // ahead: pieces issued and not yet summed
  unsigned iaddr = ring.begin;
  int free_slots = R;
  int ik = -1;                 // token whose plan is below
  int irow = -1;               // lane r: token ik's own row r
  unsigned long long ibase = 0; // lane r: the address of that row (a copy is then a shuffle and an add)
  int in_own = 0;              // own rows streamed for token ik (0 when summed directly)
  const P* ipartial = nullptr; // token ik's streamed partial, or null
  uint64_t streamed = 0;       // bit k % 64: token k's first remote partial is streamed
  int ck = 0;                  // the token being consumed
  auto try_issue = [&]() {
    while (n_steps > 0 && iss_k < n_tok) {
      const int k = iss_k, st = iss_st;
      // Pieces that need no slot (no own rows here, partial not ready) cost nothing, so
      // bound the look-ahead in tokens too: `streamed` keeps 64 tokens' bits.
      if (k - ck >= 32) return;
      if (k != ik) {  // plan the token once, when its first piece comes up
        ik = k;
        const int t = token_of(k);
        const int n = sh.stream_own ? stream_rows<RS::kMaxOwn>(rows_of(t), sh.K, a.row_cap, irow) : -1;
        ibase = irow >= 0 ? reinterpret_cast<unsigned long long>(expert_out + static_cast<size_t>(irow) * sh.H) : 0;
        in_own = n < 0 ? 0 : n;
        ipartial = nullptr;
        streamed &= ~(1ull << (k % 64));
        const int d0 = first_remote(c, h, t);
        if (d0 >= 0) {
          const int q = h.send_index(c.ws.cfg, t, d0);
          const uint64_t g = sh.gen(me, q / sh.C);
          const uint64_t* flag = RingView::combine(c.ws, c.peers.base[d0]).ready + sh.slot(me, q / sh.C);
          // Every lane acquires the flag itself before reading the data it guards. Not
          // seen.set: the cache may only record chunks checked in token order.
          if (seen.has(d0, g) || __all_sync(0xffffffffu, ld_acquire_sys(flag) >= g + 1)) {
            ipartial = remote_partial<P>(c, sh, d0, q);
            streamed |= 1ull << (k % 64);
          }
        }
      }
      const int need = in_own + (ipartial != nullptr ? 1 : 0);
      if (need > free_slots) return;
      const int v0 = st * kStepElems + lane * kCombineVec;
      const unsigned dst = ring.copy_rows(iaddr, ibase, in_own, v0, sh.H);
      if (ipartial != nullptr)
#pragma unroll
        for (int u = 0; u < Uc; ++u) {
          const int4* src = reinterpret_cast<const int4*>(ipartial + v0 + u * kWarpSize * kCombineVec);
#pragma unroll
          for (int w = 0; w < Raw8<P>::kVecs; ++w)
            cp_async_16_shared_if(dst + u * kGroupBytes + 16 * w, src + w, group_live(v0, u, sh.H));
        }
      cp_async_commit();
      iaddr = ring.next(iaddr, need);
      free_slots -= need;
      ++ahead;
      if (++iss_st == first_step + n_steps) {
        iss_st = first_step;
        ++iss_k;
      }
    }
  };
  try_issue();

  // ---- consume side
  unsigned caddr = ring.begin;  // the next piece's first slot
  for (int k = 0; k < n_tok; ++k) {
    if constexpr (kConsumeClocks) clk_t = clock64();
    ck = k;
    const int t = token_of(k);
    // q of t for rank d (index among my tokens sent to d), or -1: read where needed (L1 hits).
    auto pos = [&](int d) { return h.send_index(c.ws.cfg, t, d); };
    const int32_t* my_rows = rows_of(t);
    const int my_task = my_rows != nullptr ? my_first_task + pos(me) : -1;
    int lane_row;
    // Own rows streamed (their count), or -1: loaded straight into registers when summed (more
    // than kMaxOwn of them, or MOK_COMBINE_STREAM_OWN=0).
    const int n_own = sh.stream_own ? stream_rows<RS::kMaxOwn>(my_rows, sh.K, a.row_cap, lane_row)
                                    : (my_rows != nullptr ? -1 : 0);
    const int own_slots = n_own < 0 ? 0 : n_own;
    tick(kCClockTokenSetup);
    if (!wait_token_partials(c, h, sh, seen, t)) { cp_async_wait<0>(); return; }
    tick(kCClockPartialWait);
    // The streamed rank, or -1 when t's first remote partial was not ready in time (then it is
    // loaded like any further rank's).
    const int d0 = (streamed >> (k % 64)) & 1 ? first_remote(c, h, t) : -1;
    const int need = own_slots + (d0 >= 0 ? 1 : 0);
    // Lane d < W holds q of t for rank d and, for a remote rank, where its partial is staged,
    // so the steps below neither re-read the handle nor recompute slots (up to 32 ranks; a
    // wider world reads them per step).
    const bool lane_cache = W <= kWarpSize;
    int lane_q = -1;
    unsigned long long lane_src = 0;
    if (lane_cache && lane < W) {
      lane_q = pos(lane);
      if (lane_q >= 0 && lane != me)
        lane_src = reinterpret_cast<unsigned long long>(remote_partial<P>(c, sh, lane, lane_q));
    }
    const unsigned holders = __ballot_sync(0xffffffffu, lane_q >= 0);
    for (int st = first_step; st < first_step + n_steps; ++st) {
      const int v0 = st * kStepElems + lane * kCombineVec;
      tick(kCClockTokenSetup);                  // the lane cache above / the loop (first piece)
      try_issue();                              // this piece is issued (the ring is free by now)
      tick(kCClockIssue);
      cp_async_wait_at_most(ahead - 1);         // it has landed; later ones may be in flight
      tick(kCClockCopyWait);
      --ahead;
      // My own partial: my rows summed here (same rows, order and rounding as a producer).
      float part[Uc][kCombineVec], acc[Uc][kCombineVec];
      zero(part);
      unsigned src = caddr;
      if (n_own > 0) {
        src = ring.sum_rows(part, caddr, n_own);
      } else if (n_own < 0) {
        sum_rows<T, kOwnRows>(part, expert_out, my_rows, sh.K, a.row_cap, v0, sh.H);
      }
      if (my_rows != nullptr) {
#pragma unroll
        for (int u = 0; u < Uc; ++u)
#pragma unroll
          for (int e = 0; e < kCombineVec; ++e) part[u][e] = round_to<P>(part[u][e]);
      }
      if constexpr (kConsumeClocks) {  // the sums have landed once a register of each is read
        float sink = 0.f;
#pragma unroll
        for (int u = 0; u < Uc; ++u) sink += part[u][0];
        asm volatile("" ::"f"(sink));
      }
      tick(kCClockOwnSum);
      // Sum in rank order.
      zero(acc);
      auto add_rank = [&](int d) {
        if (d == me) {
#pragma unroll
          for (int u = 0; u < Uc; ++u)
#pragma unroll
            for (int e = 0; e < kCombineVec; ++e) acc[u][e] += part[u][e];
        } else if (d == d0) {  // its slot follows the own rows' (src)
#pragma unroll
          for (int u = 0; u < Uc; ++u) {
            Raw8<P> r;
            load_raw_shared(r, src + u * kGroupBytes);
            add_raw<P>(acc[u], r);
          }
        } else {
          const P* src = lane_cache ? reinterpret_cast<const P*>(__shfl_sync(0xffffffffu, lane_src, d))
                                    : remote_partial<P>(c, sh, d, pos(d));
          Raw8<P> r[Uc];
#pragma unroll
          for (int u = 0; u < Uc; ++u)
            if (group_live(v0, u, sh.H)) load_raw(r[u], src + v0 + u * kWarpSize * kCombineVec);
#pragma unroll
          for (int u = 0; u < Uc; ++u)
            if (group_live(v0, u, sh.H)) add_raw<P>(acc[u], r[u]);
        }
      };
      if (lane_cache) {
        for (unsigned m = holders; m != 0; m &= m - 1) add_rank(__ffs(m) - 1);  // ascending ranks
      } else {
        for (int d = 0; d < W; ++d)
          if (pos(d) >= 0) add_rank(d);
      }
#pragma unroll
      for (int u = 0; u < Uc; ++u)
        if (group_live(v0, u, sh.H))
          Vec8<T>::store(y + static_cast<size_t>(t) * sh.H + v0 + u * kWarpSize * kCombineVec, acc[u]);
      // The piece's slots were read above: hand them to the pieces ahead.
      caddr = ring.next(caddr, need);
      free_slots += need;
      tick(kCClockRankSum);
    }
    if (grad_w != nullptr && first_step == 0 && lane < sh.K) {  // part 0 writes the prob gradients
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
          part = partial_side_value(c, sh, d, q, lane);
        }
        val += part;
      }
      grad_w[static_cast<size_t>(t) * sh.K + lane] = val;
    }
    // Release: the last of my tokens in a (rank, chunk) frees that chunk of d's ring (unless
    // the grid's last warp releases them all at the end: release_partial_chunks).
    __syncwarp();
    if (!sh.release_at_end && lane == 0) {
      __threadfence();
      for (int d = 0; d < W; ++d) {
        const int q = pos(d);
        if (q >= 0 && d != me) release_token_chunk(c, h, sh, d, q, Pc);
      }
    }
    if constexpr (kConsumeClocks) __syncwarp();
    tick(kCClockTokenTail);
  }
  cp_async_wait<0>();
  if constexpr (kConsumeClocks) {
    clk[kCClockTotal] = clock64() - clk0;
    for (int kind = 0; kind < kCClockKinds; ++kind) clock_row_add(c, kCClockKinds, kind, clk[kind]);
  }
}

// Consumer warps of a phased call whose own partials were staged too (CombineShape::own_staged,
// benchmarks/NOTES.md #38): the produce phase reduced my own tokens' rows into my ring like the
// peers reduced theirs, so a token is its holders' partials (ranks in order, mine local, the
// rest over NVLink) summed, nothing else. A piece is then one slot per holder (2 at world size
// 2, so ~7 pieces in flight per warp instead of ~2 with ~4 own rows + 1 partial per piece), and
// every piece costs one copy and one sum per slot. Bitwise the same as consume: each partial is
// the same rows in the same order rounded once to P, and the sum runs from +0.0 in rank order.
// Only for calls with at least one token per warp (the kernel decides: combine_transfer_kernel).
// The issue side may wait for a partial to be staged: in a phased call every producer writes a
// slot of this call at most once and waits only for earlier calls' readers, which have all
// finished (their kernels came first on every rank), so waiting here cannot block a producer.
template <typename T, typename P>
__device__ void consume_staged(const CommContext& c, const HandleArrays& h, const TransferArgs& a,
                               const CombineShape& sh, const Role& role, T* y, float* grad_w, int4* smem) {
  constexpr int Uc = kConsumeUnroll;
  constexpr int kStepElems = kWarpSize * kCombineVec * Uc;
  const int lane = threadIdx.x % kWarpSize;
  const int n_warps = role.count * static_cast<int>(blockDim.x / kWarpSize);
  const int warp = static_cast<int>(threadIdx.x / kWarpSize) * role.count + role.index();
  const int W = c.world, me = c.rank;
  const int S = (sh.H + kStepElems - 1) / kStepElems;
  const int n_my = a.num_tokens;  // at least one per warp: calls split over warps keep consume
  int n_tok = n_my > warp ? (n_my - warp + n_warps - 1) / n_warps : 0;
  int first_tok = warp, tok_stride = n_warps;
  if (sh.token_runs) {  // runs of consecutive tokens, as in consume (NOTES #33)
    const int base = n_my / n_warps, extra = n_my % n_warps;
    n_tok = base + (warp < extra ? 1 : 0);
    first_tok = warp * base + min(warp, extra);
    tok_stride = 1;
  }
  auto token_of = [&](int k) { return first_tok + k * tok_stride; };
  // Lane d < W: q of token t for rank d (its index among my tokens sent to d), or -1.
  auto lane_pos = [&](int t) { return lane < W ? h.send_index(c.ws.cfg, t, lane) : -1; };
  const WarpRing<T, P> ring(smem);
  SeenGens seen;

  // Plans token t for the stream: lane j < n gets the address of its j-th holder's partial
  // (ranks ascending), once each of those is staged (every lane acquires the flag itself before
  // copying what it guards; the warp's cache skips chunks it already saw, in token order).
  // Returns n, or -1 after a timeout or an abort.
  auto plan = [&](int t, unsigned long long& lane_src) -> int {
    const int q = lane_pos(t);
    const unsigned holders = __ballot_sync(0xffffffffu, q >= 0);
    for (unsigned m = holders; m != 0; m &= m - 1) {
      const int d = __ffs(m) - 1;
      const int qd = __shfl_sync(0xffffffffu, q, d);
      const uint64_t g = sh.gen(me, qd / sh.C);
      if (!seen.has(d, g)) {
        const uint64_t* flag = RingView::combine(c.ws, c.peers.base[d]).ready + sh.slot(me, qd / sh.C);
        if (!wait_geq(c, flag, g + 1, d, kWaitCombineReady, static_cast<int64_t>(g))) return -1;
        seen.set(d, g);
      }
    }
    const int n = __popc(holders);
    const int d = lane < n ? __fns(holders, 0, lane + 1) : 0;
    const int qd = __shfl_sync(0xffffffffu, q, d);
    lane_src = lane < n ? reinterpret_cast<unsigned long long>(remote_partial<P>(c, sh, d, qd)) : 0;
    return n;
  };

  // ---- issue side (StreamIssue: piece is.st of token is.k is next)
  StreamIssue is(ring);
  int ik = -1, in_n = 0, ck = 0;
  bool failed = false;
  unsigned long long ibase = 0;  // lane j: token ik's j-th partial
  auto try_issue = [&]() {
    while (is.k < n_tok) {
      if (is.k - ck >= 32) return;  // tokens with no holders take no slot: bound the look-ahead
      if (is.k != ik) {
        ik = is.k;
        in_n = plan(token_of(is.k), ibase);
        if (in_n < 0) {
          failed = true;
          return;
        }
      }
      if (in_n > is.free_slots) return;
      is.piece<P>(ring, ibase, in_n, S, sh.H);
    }
  };
  try_issue();

  // ---- consume side
  unsigned caddr = ring.begin;
  for (int k = 0; k < n_tok && !failed; ++k) {
    ck = k;
    const int t = token_of(k);
    const int q = lane_pos(t);
    const unsigned holders = __ballot_sync(0xffffffffu, q >= 0);
    const int n = __popc(holders);
    for (int st = 0; st < S; ++st) {
      const int v0 = st * kStepElems + lane * kCombineVec;
      try_issue();  // this piece is issued (the ring is free by now), unless a wait failed
      if (failed) break;
      cp_async_wait_at_most(is.ahead - 1);
      --is.ahead;
      float acc[Uc][kCombineVec];
      zero(acc);
      caddr = ring.template sum_rows<P>(acc, caddr, n);  // rank order, from +0.0
      is.free_slots += n;
#pragma unroll
      for (int u = 0; u < Uc; ++u)
        if (group_live(v0, u, sh.H))
          Vec8<T>::store(y + static_cast<size_t>(t) * sh.H + v0 + u * kWarpSize * kCombineVec, acc[u]);
    }
    if (failed) break;
    if (grad_w != nullptr && lane < sh.K) {  // the prob gradients, in rank order
      float val = 0.f;
      for (unsigned m = holders; m != 0; m &= m - 1) {
        const int d = __ffs(m) - 1;
        val += partial_side_value(c, sh, d, h.send_index(c.ws.cfg, t, d), lane);
      }
      grad_w[static_cast<size_t>(t) * sh.K + lane] = val;
    }
    // MOK_COMBINE_RELEASE_AT_END=0: the last of my tokens in a (rank, chunk) frees that chunk of
    // d's ring, my own included (otherwise the grid's last warp releases them all at the end).
    __syncwarp();
    if (!sh.release_at_end && lane == 0) {
      __threadfence();
      for (unsigned m = holders; m != 0; m &= m - 1) {
        const int d = __ffs(m) - 1;
        release_token_chunk(c, h, sh, d, h.send_index(c.ws.cfg, t, d), 1);
      }
    }
  }
  cp_async_wait<0>();
}

// The split variant is a separate instance so that the usual path (at least one token per
// warp) keeps its registers: the split's extra live values cost the big calls spills.
template <typename T, typename P, int kOwnRows>
__device__ __forceinline__ void consume_any(const CommContext& c, const HandleArrays& h,
                                            const TransferArgs& a, const CombineShape& sh,
                                            const Role& role, const T* expert_out,
                                            const float* grad_probs, T* y, float* grad_w, int4* smem) {
  constexpr int kStepElems = kWarpSize * kCombineVec * kConsumeUnroll;
  const int n_warps = role.count * static_cast<int>(blockDim.x / kWarpSize);
  if (split_factor(sh, n_warps, a.num_tokens, (sh.H + kStepElems - 1) / kStepElems) > 1)
    consume<T, P, kOwnRows, true>(c, h, a, sh, role, expert_out, grad_probs, y, grad_w, smem);
  else
    consume<T, P, kOwnRows, false>(c, h, a, sh, role, expert_out, grad_probs, y, grad_w, smem);
}

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
      if (!wait_geq(c, RingView::combine(c.ws, c.peers.base[d]).ready + sh.slot(me, q / sh.C), g + 1, d,
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

// Phased calls (each slot written at most once per call): the grid's last warp, once every
// token of this call is summed, releases each chunk of partials this rank read from each peer,
// once, instead of a fence (waiting for the token's y stores) and an atomic round trip per
// token and remote rank on the consume loop's path (NOTES #36; #30 did the same for the
// dispatch). A peer's next call may then stage into those slots.
__device__ void release_partial_chunks(const CommContext& c, const HandleArrays& h, const CombineShape& sh,
                                       bool own_staged) {
  if (!begin_call_release(c)) return;
  const int me = c.rank;
  for (int d = 0; d < c.world; ++d) {
    if (d == me && !own_staged) continue;  // my own partials, when staged, are in my ring
    const int n_chunks = (h.send_count[d] + sh.C - 1) / sh.C;  // chunks of my partials in d's ring
    RingView theirs = RingView::combine(c.ws, c.peers.base[d]);
    for (int j = threadIdx.x % kWarpSize; j < n_chunks; j += kWarpSize)
      st_release_sys(theirs.released + static_cast<size_t>(me) * theirs.num_chunks + sh.slot(me, j),
                     sh.gen(me, j) + 1);
  }
}

template <typename T, typename P, int kOwnRows>
__global__ void __launch_bounds__(kCombineThreads, 1)
    combine_transfer_kernel(CommContext c, HandleArrays h, TransferArgs a, CombineShape sh,
                            const T* expert_out, const float* grad_probs, T* y, float* grad_w) {
  extern __shared__ __align__(16) int4 smem[];
  pdl_wait_then_release_dependents();
  if (aborted(c)) return;  // after a protocol error: touch nothing (see dispatch_transfer.cu)
  sh.start(c.counters()->comb_seq);
  trace_warp(c, true);
  int4* stream = smem;
  // Own partials staged (a choice each rank makes for itself: only it reads them) when a token's
  // holders fit in the ring, one slot each per piece (world <= 14, or 7 with fp32 partials), and
  // the call has at least one token per warp: a call split over warps (128 tokens) would give
  // each warp a whole task of twice the produce phase's tasks instead of part of one, and
  // measured slower (NOTES #38).
  constexpr int kStepElems = kWarpSize * kCombineVec * kConsumeUnroll;
  const bool own_staged = !sh.narrow && sh.phased && sh.own_staged && c.world <= RowStream<T, P>::kSlots &&
                          split_factor(sh, static_cast<int>(gridDim.x * (blockDim.x / kWarpSize)), a.num_tokens,
                                       (sh.H + kStepElems - 1) / kStepElems) == 1;
  if (sh.narrow) {
    // Rows of one vector, the call in the ring: a lane per task, then a lane per token.
    produce_narrow<T, P>(c, h, a, sh, expert_out, grad_probs);
    trace_phase_end(c);
    consume_narrow<T, P>(c, h, a, sh, expert_out, grad_probs, y, grad_w);
  } else if (sh.phased) {
    // The whole call fits in the ring, so producing never waits for this call's consumers:
    // every block reduces its share of the remote tasks first, then sums its share of my
    // tokens, by which time the peers' partials are (mostly) staged. No block idles while
    // the other role is the bottleneck, and the partial stream rarely finds a chunk unready.
    const Role all{0, static_cast<int>(gridDim.x)};
    produce_rows_streamed<T, P, kOwnRows>(c, h, a, sh, expert_out, grad_probs, stream, own_staged);
    trace_phase_end(c);
    if (own_staged)
      consume_staged<T, P>(c, h, a, sh, all, y, grad_w, stream);
    else
      consume_any<T, P, kOwnRows>(c, h, a, sh, all, expert_out, grad_probs, y, grad_w, stream);
  } else if (static_cast<int>(blockIdx.x) < a.num_producers) {
    // A call larger than the ring: producers must run alongside the consumers that free slots.
    produce_chunks<T, P>(c, h, a, sh, Role{0, a.num_producers}, expert_out, grad_probs);
  } else {
    consume_any<T, P, kOwnRows>(c, h, a, sh, Role{a.num_producers, a.num_blocks - a.num_producers},
                            expert_out, grad_probs, y, grad_w, stream);
  }
  trace_warp(c, false);
  if (warp_done_advance(&c.counters()->comb_warps_done, &c.counters()->comb_seq) && sh.release_at_end)
    release_partial_chunks(c, h, sh, own_staged);
}

template <typename T, typename P>
cudaError_t launch_typed(const CommContext& c, const HandleArrays& h, const TransferArgs& t,
                         const CombineShape& sh, const void* expert_out, const float* grad_probs,
                         void* y, float* grad_w, cudaStream_t s) {
  constexpr size_t smem = RowStream<T, P>::kSmemBytes;
  // Own rows loaded per batch by a consumer lane: 2 (1 for fp32 rows). 4 spills registers
  // and measured slower in both schedules (benchmarks/NOTES.md #10, #12).
  auto kernel = combine_transfer_kernel<T, P, (sizeof(T) == 4 ? 1 : 2)>;
  if (cudaError_t e = allow_dynamic_smem(kernel, smem)) return e;
  return launch_kernel(c, kernel, t.num_blocks, kCombineThreads, smem, s, c, h, t, sh,
                       static_cast<const T*>(expert_out), grad_probs, static_cast<T*>(y), grad_w);
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
                                    int dtype_code, int partial_code, int hidden, cudaStream_t s) {
  CombineShape sh;
  sh.H = hidden;  // every row pitch below (expert_out, partials in the ring chunk, y) is sh.H
  sh.K = c.ws.cfg.topk;
  sh.C = c.ws.cfg.chunk_tokens;
  sh.cps = HandleArrays::chunks_per_call(c.ws.cfg);
  sh.cpc = static_cast<int64_t>(sh.cps) * c.world;
  sh.slots.N = static_cast<int>(c.ws.cfg.comb_ring_chunks);
  // Alternative schedules, on unless the variable is set to 0 (tests cover each):
  // MOK_COMBINE_PHASED=0 forces the role split;
  sh.phased = sh.cpc <= c.ws.cfg.comb_ring_chunks && !env_off("MOK_COMBINE_PHASED");
  // MOK_COMBINE_SPLIT=0: one warp per token / task whatever the call size (A/B and bisection);
  sh.split = !env_off("MOK_COMBINE_SPLIT");
  // MOK_COMBINE_STREAM_OWN=0: own rows straight into registers, only partials streamed (NOTES #23).
  sh.stream_own = !env_off("MOK_COMBINE_STREAM_OWN");
  // MOK_COMBINE_TOKEN_RUNS=0: phased consumers take every n_warps-th token (NOTES #33).
  sh.token_runs = sh.phased && !env_off("MOK_COMBINE_TOKEN_RUNS");
  // MOK_COMBINE_RELEASE_AT_END=0: phased consumers release chunks per token (NOTES #36).
  sh.release_at_end = sh.phased && !env_off("MOK_COMBINE_RELEASE_AT_END");
  // MOK_COMBINE_PRODUCE_RUNS=0: the streamed produce phase takes every n_warps-th task (NOTES #39).
  sh.produce_runs = sh.phased && !env_off("MOK_COMBINE_PRODUCE_RUNS");
  // MOK_COMBINE_OWN_STAGED=0: phased consumers sum their own rows in the consume loop (NOTES #38).
  sh.own_staged = sh.phased && c.world > 1 && !env_off("MOK_COMBINE_OWN_STAGED");
  // MOK_COMBINE_NARROW=0: rows of one vector (the prob-gradient call) on the warp-per-item path.
  // The narrow path releases its chunks once per call, so it needs release_at_end.
  sh.narrow = sh.phased && sh.release_at_end && hidden == kCombineVec && !env_off("MOK_COMBINE_NARROW");
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

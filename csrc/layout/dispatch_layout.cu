// Device-side layout of a dispatch: no host round-trip.
//
//   publish  (1 block)            my routing -> my meta slot (peers read it), send-side layout
//   count    (chunks x sources)   rows per (source, chunk, local expert), tasks per chunk
//   scan     (1 block)            first row of every group in contract order, first task of
//                                 every chunk, tokens_per_expert, R
//   fill     (chunks x sources)   per-row outputs and task lists (dispatch_fill.cu)
//
// Small layouts (at most 8192 groups of (local expert, source, chunk)) run publish, count and
// scan as one kernel instead (layout_fused_kernel, NOTES #45).
#include <cub/block/block_load.cuh>
#include <cub/block/block_scan.cuh>
#include <cub/block/block_store.cuh>

#include "mok/launch.h"

namespace mok {
namespace {

__device__ inline int64_t read_expert(const RoutingArgs& r, int64_t i) {
  return r.idx_is_64 ? static_cast<const int64_t*>(r.topk_idx)[i]
                     : static_cast<int64_t>(static_cast<const int32_t*>(r.topk_idx)[i]);
}

// One block per chunk of my tokens; the last block to finish publishes the slot. Called by
// kLayoutThreads threads of block j of gridDim.x = chunks per call; token_ranks is [C] of
// dynamic shared memory. Returns early (every thread alike) when a wait failed.
__device__ void publish_block(const CommContext& c, const HandleArrays& h, const RoutingArgs& r,
                              unsigned long long* token_ranks /* [C] ranks holding rows of each token */) {
  using Scan = cub::BlockScan<int, kLayoutThreads>;
  __shared__ typename Scan::TempStorage scan_tmp;
  __shared__ unsigned long long readers;
  __shared__ int chunk_count[kMaxRanks];
  __shared__ bool ok, last;
  const Workspace& ws = c.ws;
  char* me = c.local();
  const int M = ws.cfg.meta_slots, W = c.world, K = ws.cfg.topk, C = ws.cfg.chunk_tokens;
  const int E_local = ws.cfg.num_local_experts, T = r.num_tokens, j = blockIdx.x;
  const uint64_t meta_seq = c.counters()->meta_seq;
  const int slot = static_cast<int>(meta_seq % M);

  // Phase 1: the slot's previous routing must have been read by every rank (lazy check:
  // only once the meta ring has wrapped).
  if (threadIdx.x == 0) {
    ok = true;
    readers = 0;
  }
  if (threadIdx.x < W) chunk_count[threadIdx.x] = 0;
  // Speculative: count's blocks add every rank's rows here (this kernel ends before count runs).
  if (r.spec_cap >= 0 && j == 0 && threadIdx.x < W) h.dest_total[threadIdx.x] = 0;
  __syncthreads();
  if (meta_seq >= static_cast<uint64_t>(M) && threadIdx.x < W) {
    if (!wait_geq(c, ws.meta_released_at(me, threadIdx.x) + slot, meta_seq - M + 1, threadIdx.x,
                  kWaitRoutingReleased, slot))
      ok = false;
  }
  __syncthreads();
  if (!ok) return;
  layout_stamp(c, 0, kStPubSlotFree);

  // Phase 2: copy this chunk's routing into the slot (ids checked), and its send-side layout:
  // for each destination d, the index of each token among this chunk's tokens that go to d.
  // The copy goes one (token, k) slot per thread, so every thread's loads are independent and
  // coalesced (a thread per token walked its K slots one dependent load after another: NOTES
  // #41); each slot marks its rank in the token's mask in shared memory.
  int32_t* m_idx = ws.meta_idx_at(me, slot);
  float* m_w = ws.meta_weights_at(me, slot);
  const int t_end = min(T, (j + 1) * C);
  for (int i = threadIdx.x; i < C; i += blockDim.x) token_ranks[i] = 0;
  __syncthreads();
  const int64_t s0 = static_cast<int64_t>(j) * C * K;  // the chunk's first slot
  const int n_slots = max(0, t_end - j * C) * K;        // 32-bit: i / K below is no subroutine
  for (int i = threadIdx.x; i < n_slots; i += blockDim.x) {
    int64_t e = read_expert(r, s0 + i);
    const float wt = r.topk_weights[s0 + i];
    if (e < -1 || e >= r.num_experts) {
      report_error(c, kBadExpert, -1, kWaitNone, s0 + i);
      e = -1;
    }
    m_idx[s0 + i] = static_cast<int32_t>(e);
    m_w[s0 + i] = wt;
    if (e >= 0) atomicOr(&token_ranks[i / K], 1ull << (e / E_local));
  }
  __syncthreads();
  layout_stamp(c, 0, kStPubCopied);
  for (int base = j * C; base < (j + 1) * C; base += blockDim.x) {
    const int t = base + threadIdx.x;
    uint64_t mask = 0;
    if (t < t_end) {
      mask = token_ranks[t - j * C];
      const uint64_t remote = mask & ~(1ull << c.rank);
      if (remote) atomicOr(&readers, static_cast<unsigned long long>(remote));
    }
    for (int d = 0; d < W; ++d) {
      int pos, total;
      const int hit = static_cast<int>((mask >> d) & 1);
      Scan(scan_tmp).ExclusiveSum(hit, pos, total);
      if (t < t_end) h.send_pos[static_cast<size_t>(t) * W + d] = hit ? chunk_count[d] + pos : -1;
      __syncthreads();
      if (threadIdx.x == 0) chunk_count[d] += total;
      __syncthreads();
    }
  }
  if (threadIdx.x < W) h.send_base[j * W + threadIdx.x] = chunk_count[threadIdx.x];  // counts for now
  if (threadIdx.x == 0) h.chunk_readers[j] = readers;

  // Phase 3: the last block turns chunk counts into prefixes and publishes. Readiness flows
  // producer -> consumer: one release store, nobody is waited for.
  __syncthreads();
  layout_stamp(c, 0, kStPubSendScan);
  if (threadIdx.x == 0) {
    __threadfence();
    const uint32_t done = atomicAdd(&c.counters()->publish_blocks_done, 1u) + 1;
    last = done == gridDim.x;
  }
  __syncthreads();
  if (!last) return;
  __threadfence();
  // Exclusive prefix over the chunks, per destination: a block scan per tile of chunks (one
  // thread walking all chunks was a chain of dependent loads and stores, ~6 us at 64 chunks).
  for (int d = 0; d < W; ++d) {
    int carry = 0;  // the same value in every thread
    for (int base = 0; base < static_cast<int>(gridDim.x); base += blockDim.x) {
      const int jj = base + threadIdx.x;
      const int n = jj < static_cast<int>(gridDim.x) ? h.send_base[jj * W + d] : 0;
      int pos, total;
      Scan(scan_tmp).ExclusiveSum(n, pos, total);
      if (jj < static_cast<int>(gridDim.x)) h.send_base[jj * W + d] = carry + pos;
      carry += total;
      __syncthreads();  // scan_tmp is reused
    }
    if (threadIdx.x == 0) h.send_count[d] = carry;
  }
  __syncthreads();
  layout_stamp(c, 0, kStPubPrefix);
  if (threadIdx.x == 0) {
    c.counters()->publish_blocks_done = 0;
    *ws.meta_count_at(me, slot) = T;
    *ws.meta_row_format_at(me, slot) = r.row_format;
    *ws.meta_spec_cap_at(me, slot) = r.spec_cap;
    __threadfence_system();
    st_release_sys(ws.meta_ready_at(me) + slot, meta_seq + 1);
  }
  layout_stamp(c, 0, kStPubReleased);
}

__global__ void __launch_bounds__(kLayoutThreads) publish_kernel(CommContext c, HandleArrays h,
                                                                  RoutingArgs r) {
  extern __shared__ unsigned long long token_ranks[];
  pdl_wait_then_release_dependents();
  publish_block(c, h, r, token_ranks);
}

// Rows per (local expert) of source s's chunk `chunk`, and its tasks. Called by every thread
// of a block; smem is [E_local + C * K] ints of dynamic shared memory.
__device__ void count_block(const CommContext& c, const HandleArrays& h, const RoutingArgs& r,
                            int chunk, int s, int* smem) {
  __shared__ int tasks;
  __shared__ int src_tokens;
  __shared__ bool ok;
  __shared__ int dest_hist[kMaxRanks];  // speculative: rows this chunk sends to each rank
  const Workspace& ws = c.ws;
  const int K = ws.cfg.topk, C = ws.cfg.chunk_tokens, E_local = ws.cfg.num_local_experts;
  const uint64_t meta_seq = c.counters()->meta_seq;
  const int slot = static_cast<int>(meta_seq % ws.cfg.meta_slots);
  char* peer = c.peers.base[s];
  int* hist = smem;                // [E_local]
  int* chunk_idx = smem + E_local; // [C * K] this chunk's routing, copied once from the peer

  for (int e = threadIdx.x; e < E_local; e += blockDim.x) hist[e] = 0;
  for (int d = threadIdx.x; d < c.world; d += blockDim.x) dest_hist[d] = 0;
  if (threadIdx.x == 0) {
    tasks = 0;
    ok = wait_published(c, ws.meta_ready_at(peer) + slot, meta_seq + 1, s, kWaitRoutingReady, meta_seq);
    src_tokens = ok ? *reinterpret_cast<volatile int32_t*>(ws.meta_count_at(peer, slot)) : 0;
    if (chunk == 0) h.src_count[s] = src_tokens;
  }
  __syncthreads();
  if (!ok) return;
  layout_stamp(c, 0, kStCountReady);

  // One coalesced pass over the peer's routing (all loads in flight at once), then local work.
  const int t0 = chunk * C;
  const int n_tok = max(0, min(src_tokens, t0 + C) - t0);
  const int32_t* idx = ws.meta_idx_at(peer, slot) + static_cast<size_t>(t0) * K;
  for (int i = threadIdx.x; i < n_tok * K; i += blockDim.x) chunk_idx[i] = idx[i];
  __syncthreads();
  layout_stamp(c, 0, kStCountCopied);
  const int lo = c.rank * E_local;
  const bool spec = r.spec_cap >= 0;
  for (int j = threadIdx.x; j < n_tok; j += blockDim.x) {
    bool hit = false;
    for (int k = 0; k < K; ++k) {
      const int g = chunk_idx[j * K + k];  // ids were checked when published: -1 or valid
      const int e = g - lo;
      if (e >= 0 && e < E_local) {
        atomicAdd(&hist[e], 1);  // integer counts: the result does not depend on order
        hit = true;
      }
      if (spec && g >= 0) atomicAdd(&dest_hist[g / E_local], 1);
    }
    if (hit) atomicAdd(&tasks, 1);
  }
  __syncthreads();
  if (spec)
    for (int d = threadIdx.x; d < c.world; d += blockDim.x)
      if (dest_hist[d] != 0) atomicAdd(&h.dest_total[d], dest_hist[d]);
  for (int e = threadIdx.x; e < E_local; e += blockDim.x)
    h.chunk_rows[HandleArrays::group(ws.cfg, e, s, chunk)] = hist[e];
  if (threadIdx.x == 0) h.chunk_tasks[s * HandleArrays::chunks_per_call(ws.cfg) + chunk] = tasks;
  layout_stamp(c, 0, kStCountDone);
}

__global__ void __launch_bounds__(kLayoutThreads) count_kernel(CommContext c, HandleArrays h,
                                                                RoutingArgs r) {
  extern __shared__ int smem[];
  pdl_wait_then_release_dependents();
  count_block(c, h, r, blockIdx.x, blockIdx.y, smem);
}

// In-place exclusive scan of a[0..n) by one block of kScanThreads threads, in tiles of
// kScanThreads x kScanItems: each tile is loaded coalesced (warp-striped, transposed through
// shared memory), scanned with the carry of the tiles before it, and stored the same way.
// The thread-contiguous version (each thread summing its own run of n / 1024 entries, then
// rewriting it) made every warp load 32 scattered words per step, one step after another:
// 25.7 us for the 16 K entries of the standard shape on 2 GPUs (run s8-1). Returns the total.
// THREADS is the block size, ITEMS the entries per thread of a tile.
constexpr int kScanItems = 4;
template <int THREADS, int ITEMS>
__device__ int block_exclusive_scan(int32_t* a, int n) {
  using Load = cub::BlockLoad<int, THREADS, ITEMS, cub::BLOCK_LOAD_WARP_TRANSPOSE>;
  using Store = cub::BlockStore<int, THREADS, ITEMS, cub::BLOCK_STORE_WARP_TRANSPOSE>;
  using Scan = cub::BlockScan<int, THREADS>;
  __shared__ union {
    typename Load::TempStorage load;
    typename Store::TempStorage store;
    typename Scan::TempStorage scan;
  } tmp;
  constexpr int kTile = THREADS * ITEMS;
  int carry = 0;
  for (int base = 0; base < n; base += kTile) {
    const int valid = min(kTile, n - base);
    int v[ITEMS];
    Load(tmp.load).Load(a + base, v, valid, 0);
    __syncthreads();
    int total;  // every thread gets the tile's total
    Scan(tmp.scan).ExclusiveSum(v, v, total);
    __syncthreads();
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) v[i] += carry;
    Store(tmp.store).Store(a + base, v, valid);
    __syncthreads();
    carry += total;
  }
  return carry;
}

// After the rows' scan (chunk_rows: each group's first row, unpadded; `rows` their total), the
// zero rows after each local expert's rows:
// - rows_per_expert N >= 0: up to exactly N rows; expert e's groups move to start at e * N. An
//   expert with more than N rows is reported (kExpertOverflow, a data error: the call
//   completes) and gets no zero rows; the fill drops its rows past N, so no row lands in the
//   next expert's rows.
// - else (expert_alignment A > 1): up to a multiple of A; expert e's groups move down by the
//   padding of the experts before it (a block scan). An expert with no rows stays empty.
// gap_begin / gap_len say where each expert's zero rows are (the fill marks them "no source",
// the transfer zeroes them). Returns R with the zero rows. Whole block, after a barrier.
template <int THREADS, int ITEMS>
__device__ int pad_experts(const CommContext& c, const HandleArrays& h, int rows, int N) {
  const int W = c.world, E = c.ws.cfg.num_local_experts, A = c.ws.cfg.expert_alignment;
  const int per_expert = W * HandleArrays::chunks_per_call(c.ws.cfg);
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    const int first = h.chunk_rows[static_cast<size_t>(e) * per_expert];
    const int next = e + 1 < E ? h.chunk_rows[static_cast<size_t>(e + 1) * per_expert] : rows;
    const int count = next - first;
    if (N >= 0) {
      if (count > N) report_error(c, kExpertOverflow, e, N, count);
      h.gap_len[e] = max(N - count, 0);
      h.gap_begin[e] = e * N - first;  // the shift of e's groups
    } else {
      h.gap_len[e] = (A - count % A) % A;
      h.gap_begin[e] = h.gap_len[e];  // scanned next: the padding of the experts before e
    }
  }
  __syncthreads();
  const int padding = N >= 0 ? E * N - rows : block_exclusive_scan<THREADS, ITEMS>(h.gap_begin, E);
  __syncthreads();
  for (int i = threadIdx.x; i < E * per_expert; i += blockDim.x) h.chunk_rows[i] += h.gap_begin[i / per_expert];
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    const int next = e + 1 < E ? h.chunk_rows[static_cast<size_t>(e + 1) * per_expert] : rows + padding;
    h.gap_begin[e] = next - h.gap_len[e];
  }
  __syncthreads();
  return rows + padding;
}

// The host report (RowOutputs::host_report): totals, then the error words as they stand now.
// Called by one thread after a block barrier, so every report_error of this kernel is in.
__device__ void write_host_report(const CommContext& c, int32_t* report, const int32_t* totals) {
  const volatile int32_t* err = reinterpret_cast<const volatile int32_t*>(c.error());
  volatile int32_t* out = report;
  for (int i = 0; i < 4; ++i) out[i] = totals[i];
  for (int i = 0; i < 8; ++i) out[4 + i] = err[i];
  __threadfence_system();
}

// The layout's scan, by one whole block of THREADS threads (ITEMS entries per thread per tile).
// Every exit goes through the host report at the end (an eager dispatch's host reads it
// instead of a copy): an aborted call must report its error, not the last call's R.
template <int THREADS, int ITEMS>
__device__ void scan_block(const CommContext& c, const HandleArrays& h, const RowOutputs& out, int spec) {
  __shared__ bool stop;
  __shared__ int over;
  __shared__ int32_t totals[4];
  if (threadIdx.x == 0) {
    stop = aborted(c);
    over = 0;
    // For the fill and the transfers of this handle (HandleArrays::pad_info), aborted or not:
    // the scratch is fresh memory.
    const int N = out.rows_per_expert;
    h.pad_info[0] = N >= 0 ? N : c.ws.cfg.expert_alignment - 1;
    h.pad_info[1] = N;
    for (int i = 0; i < 4; ++i) totals[i] = 0;
  }
  __syncthreads();
  if (!stop) {
    const int W = c.world, E = c.ws.cfg.num_local_experts;
    const int cpc = HandleArrays::chunks_per_call(c.ws.cfg);
    // Rows in contract order: expert, then source, then chunk (then token, then k: fill).
    int rows = block_exclusive_scan<THREADS, ITEMS>(h.chunk_rows, E * W * cpc);
    if (out.rows_per_expert >= 0 || c.ws.cfg.expert_alignment > 1)
      rows = pad_experts<THREADS, ITEMS>(c, h, rows, out.rows_per_expert);
    layout_stamp(c, 0, kStScanRows);
    // tokens_per_expert: the distance between consecutive experts' first rows, counting only
    // rows below row_cap: past it (static shape, more rows than max_recv_tokens: kRecvOverflow,
    // raised at the next host read) nothing is written, and counts that summed past the rows
    // the user holds would send an expert GEMM beyond them. Eager calls' row_cap bounds no row.
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
      const int first = h.chunk_rows[HandleArrays::group(c.ws.cfg, e, 0, 0)];
      const int next = e + 1 < E ? h.chunk_rows[HandleArrays::group(c.ws.cfg, e + 1, 0, 0)] : rows;
      out.tokens_per_expert[e] = min(static_cast<int64_t>(next), out.row_cap) -
                                 min(static_cast<int64_t>(first), out.row_cap);
    }
    // Tasks in (source, chunk) order.
    for (int i = threadIdx.x; i < W * cpc; i += blockDim.x) h.task_base[i] = h.chunk_tasks[i];
    __syncthreads();
    const int tasks = block_exclusive_scan<THREADS, ITEMS>(h.task_base, W * cpc);
    layout_stamp(c, 0, kStScanTasks);
    for (int s = threadIdx.x; s < W; s += blockDim.x) {
      h.task_off[s] = h.task_base[s * cpc];
      h.fill_done[s] = 0;
    }
    // Speculative eager dispatch: every rank sums every rank's rows from the same published
    // routing and reads every rank's published capacity, so every rank reaches the same verdict
    // on whether ANY rank's rows overflowed its capacity (then all redo the transfer together).
    // Every rank checks that all ranks made the same choice: a speculative rank may make two
    // transfers per dispatch, and the rings pair calls by number, so a mix would pair a rank's
    // transfer with another call's staged tokens. A mismatch stops every rank's kernels.
    {
      const uint64_t meta_seq = c.counters()->meta_seq;
      const int slot = static_cast<int>(meta_seq % c.ws.cfg.meta_slots);
      // Likewise the row format: a rank dispatching tokens while a peer dispatches FP8 rows
      // would read the peer's ring at the wrong pitch or layout (wrong rows, no other error).
      const int32_t mine = *reinterpret_cast<volatile int32_t*>(c.ws.meta_row_format_at(c.local(), slot));
      for (int d = threadIdx.x; d < W; d += blockDim.x) {
        const int64_t cap_d = *reinterpret_cast<volatile int64_t*>(c.ws.meta_spec_cap_at(c.peers.base[d], slot));
        const int32_t row_d = *reinterpret_cast<volatile int32_t*>(c.ws.meta_row_format_at(c.peers.base[d], slot));
        if (row_d != mine) {
          report_error(c, kConfigMismatch, d, kMismatchRowBytes, row_d);
          continue;
        }
        if ((cap_d >= 0) != (spec != 0)) {
          report_error(c, kConfigMismatch, d, kMismatchSpeculative, cap_d);
          continue;
        }
        if (spec && h.dest_total[d] > cap_d) atomicOr(&over, 1);
      }
    }
    __syncthreads();
    // A mismatch (here or on a peer): the fill and the transfers must not run either.
    if (threadIdx.x == 0 && !aborted(c)) {
      h.task_off[W] = tasks;
      h.totals[0] = rows;
      h.totals[1] = tasks;
      h.totals[2] = over;
      // R on the device, int64, after the E_local counts: the rows written (clamped as the
      // counts are; h.totals[0] and the error report keep the rows received).
      out.tokens_per_expert[E] = min(static_cast<int64_t>(rows), out.row_cap);
      // The rows received, for a receive budget's over-budget flag (read on the device).
      out.tokens_per_expert[E + 1] = rows;
      if (rows > out.row_cap && !out.drop_over_cap) report_error(c, kRecvOverflow, -1, kWaitNone, rows);
      totals[0] = rows;
      totals[1] = tasks;
      totals[2] = over;
    }
  }
  if (out.host_report != nullptr && threadIdx.x == 0) write_host_report(c, out.host_report, totals);
  layout_stamp(c, 0, kStScanEnd);
}

__global__ void __launch_bounds__(kScanThreads) scan_kernel(CommContext c, HandleArrays h,
                                                             RowOutputs out, int spec) {
  pdl_wait_then_release_dependents();
  scan_block<kScanThreads, kScanItems>(c, h, out, spec);
}

// Small layouts in one launch (NOTES #45): publish, count and scan of the three kernels above,
// in a grid of (chunks per call) x W blocks. Blocks (j, 0) first publish my chunk j; every
// block then counts source blockIdx.y's chunk blockIdx.x (waiting for that source's routing,
// its own rank's included: published by this grid's row 0, which asks nothing of the other
// blocks); the last block to finish counting scans (the last-block pattern: no grid barrier,
// no block waits for another to finish). Saves two kernel boundaries and launches, which is
// most of what a small call's layout costs (s11-3: publish 6.4, count 3.4, scan 5.5 us of
// kernel time at 128 tokens, each a short chain of dependent memory steps).
// Every block reaches the arrival count, also after a failed wait: the scan's block writes
// the host report on every path (the eager host waits for it).
constexpr int kFusedScanItems = 8;  // 2048 entries per tile at kLayoutThreads threads
__global__ void __launch_bounds__(kLayoutThreads) layout_fused_kernel(CommContext c, HandleArrays h,
                                                                       RoutingArgs r, RowOutputs out) {
  extern __shared__ unsigned long long dyn[];  // publish's [C] masks, then count's ints
  __shared__ bool last;
  pdl_wait_then_release_dependents();
  layout_stamp(c, 0, kStEntry);
  if (blockIdx.y == 0) publish_block(c, h, r, dyn);
  __syncthreads();  // dynamic shared memory changes hands
  count_block(c, h, r, blockIdx.x, blockIdx.y, reinterpret_cast<int*>(dyn));
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();  // my counts are visible before my arrival
    uint32_t* done = &c.counters()->count_blocks_done;
    last = atomicAdd(done, 1u) + 1 == gridDim.x * gridDim.y;
    if (last) *done = 0;  // every block has arrived: none reads it again in this launch
  }
  __syncthreads();
  if (!last) return;
  __threadfence();  // every block's counts, before any read of them
  scan_block<kLayoutThreads, kFusedScanItems>(c, h, out, 0);
}

}  // namespace

// The fused layout's limits: a scan of at most 8192 (expert, source, chunk) groups by one
// 256-thread block (4 tiles; the 1024-thread scan kernel does the standard shape's 16 K in 4
// tiles), and not for speculative calls (publish zeroes the speculative totals that count
// blocks of other sources add to: ordered only by the kernel boundary). MOK_LAYOUT_FUSED=0
// keeps the three kernels; MOK_LAYOUT_FUSED_MAX_GROUPS moves the limit (for A/B runs).

bool layout_is_fused(const WorkspaceConfig& cfg, bool speculative) {
  if (speculative || env_off("MOK_LAYOUT_FUSED")) return false;
  const char* v = getenv("MOK_LAYOUT_FUSED_MAX_GROUPS");
  const long long limit = v != nullptr && v[0] != 0 ? atoll(v) : 8192;
  const long long groups = static_cast<long long>(cfg.num_local_experts) * cfg.world_size *
                           HandleArrays::chunks_per_call(cfg);
  return groups <= limit;
}

cudaError_t launch_dispatch_layout(const CommContext& c, const HandleArrays& h,
                                   const RoutingArgs& r, const RowOutputs& out, cudaStream_t s) {
  const int cpc = HandleArrays::chunks_per_call(c.ws.cfg);
  const size_t publish_smem = c.ws.cfg.chunk_tokens * sizeof(unsigned long long);
  const size_t count_smem = (c.ws.cfg.num_local_experts + c.ws.cfg.chunk_tokens * c.ws.cfg.topk) * sizeof(int);
  if (layout_is_fused(c.ws.cfg, r.spec_cap >= 0)) {
    const size_t smem = publish_smem > count_smem ? publish_smem : count_smem;
    if (cudaError_t e = allow_dynamic_smem(layout_fused_kernel, smem)) return e;
    return launch_kernel(c, layout_fused_kernel, dim3(cpc, c.world), kLayoutThreads, smem, s, c, h, r, out);
  }
  // Past 48 KiB a kernel must ask for its shared memory (chunks of ~1500 tokens at top-8).
  if (cudaError_t e = allow_dynamic_smem(publish_kernel, publish_smem)) return e;
  if (cudaError_t e = allow_dynamic_smem(count_kernel, count_smem)) return e;
  if (cudaError_t e = launch_kernel(c, publish_kernel, cpc, kLayoutThreads, publish_smem, s, c, h, r)) return e;
  if (cudaError_t e = launch_kernel(c, count_kernel, dim3(cpc, c.world), kLayoutThreads, count_smem, s, c, h, r))
    return e;
  return launch_kernel(c, scan_kernel, 1, kScanThreads, 0, s, c, h, out, r.spec_cap >= 0 ? 1 : 0);
}

}  // namespace mok

// The dispatch data path: one persistent kernel, two roles.
//
//   producer blocks  stage my tokens, chunk by chunk, into my dispatch ring (local copy), and
//                    publish each chunk with one release store (its generation + 1). A slot
//                    is reused only after the readers of its previous generation released it:
//                    checked lazily, right before the overwrite.
//   consumer warps   one task (source token) at a time: wait for its chunk (cached per warp),
//                    pull the token ONCE from the source's ring over NVLink (16-byte loads,
//                    kCopyUnroll in flight per lane) and write it to every expert row it
//                    belongs to. The last task of a (source, chunk) releases the chunk.
//
// Both roles run in one grid whose blocks are all resident, so a call larger than the ring
// still progresses: producers wait for consumers on the other GPUs, never for themselves.
//
// Copy-engine staging (kTransferCeStaged, a call that fits in the ring): the copy engine stages
// my tokens into slots [0, chunks) before the kernel (launch_dispatch_stage_copy), so no SM
// spends time on the staging's ~117 MB of reads and writes at the standard shape; every block
// pulls and block 0's first warp only publishes the slots (NOTES #31).
//
// An FP8 pair is read in place from its two sources (launch.h, DispatchSource; NOTES #57): a
// row's first a_vecs vectors come from the token rows, the rest from the scale rows, and a ring
// slot holds the chunk's token rows, then its scale rows (two planes: each a contiguous copy).
#include "mok/launch.h"

namespace mok {
namespace {

struct DispatchShape {
  uint64_t seq;     // this call's number on the dispatch ring (read at kernel start)
  int vec_per_row;  // 16-byte vectors per token row
  int a_vecs;       // of them, from the first source (== vec_per_row with one source)
  int32_t row_format;  // published with each staged slot (config.h, row_format)
  int cpc;          // chunks per call
  int C;            // rows per chunk
  int K;
  CallSlots slots;  // this call's ring slots (N set by the host, the rest at kernel start)
  bool release_at_end;  // the call fits in the ring: chunks are released by the grid's last warp
  bool ce_staged;       // the copy engine staged my chunks into slots [0, chunks): fixed slots
  bool ce_recheck;      // ce_staged: re-read the sources' `ready` before releasing (item 41)
  bool task_runs;       // pulling warps take runs of consecutive (virtual) tasks, not every n-th
  bool split;           // a call with fewer tasks than pulling warps deals each task's row to
                        // several warps, a slice each (release_at_end calls; MOK_DISPATCH_SPLIT=0)

  // Generation and ring slot of this call's chunk j.
  __device__ uint64_t gen(int j) const { return seq * cpc + j; }
  __device__ int slot(int j) const { return slots.slot(j); }
  __device__ void start(uint64_t call) {
    seq = call;
    slots.start(call, cpc);
    if (ce_staged) slots.base = 0;  // every rank agrees: the mode is a property of the Buffer
  }
};

// Block-wide: n 16-byte vectors from src to dst, kCopyUnroll loads in flight per thread.
__device__ __forceinline__ void copy_vectors(const int4* src, int4* dst, int n) {
  for (int base = threadIdx.x; base < n; base += blockDim.x * kCopyUnroll) {
    int4 v[kCopyUnroll];
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u) {
      const int i = base + u * blockDim.x;
      if (i < n) v[u] = src[i];
    }
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u) {
      const int i = base + u * blockDim.x;
      if (i < n) dst[i] = v[u];
    }
  }
}

__device__ void produce(const CommContext& c, const HandleArrays& h, const TransferArgs& a,
                        const DispatchShape& sh, const Role& role, const int4* x, const int4* x2) {
  RingView mine = RingView::dispatch(c.ws, c.local());
  const int n_chunks = (a.num_tokens + sh.C - 1) / sh.C;
  for (int j = 0; j < n_chunks; ++j) {
    const uint64_t g = sh.gen(j);
    const int64_t slot = sh.slot(j);
    // A slot always belongs to the same producer block, so its generations are written in order.
    if (slot % role.count != role.index()) continue;
    const uint64_t readers = h.chunk_readers[j];
    if (readers == 0) continue;  // nobody else needs this chunk: skip the copy
    if (!ring_slot_acquire(c, mine, slot, g, kWaitDispatchReleased)) return;
    const int rows = min(sh.C, a.num_tokens - j * sh.C);
    int4* dst = reinterpret_cast<int4*>(mine.ring + slot * mine.chunk_bytes);
    // The chunk's rows of the first source (its token rows), then, for a pair, of the second
    // (its scale rows) after the slot's C first-source rows: two contiguous copies.
    copy_vectors(x + static_cast<size_t>(j) * sh.C * sh.a_vecs, dst, rows * sh.a_vecs);
    const int b_vecs = sh.vec_per_row - sh.a_vecs;
    if (b_vecs > 0)
      copy_vectors(x2 + static_cast<size_t>(j) * sh.C * b_vecs, dst + static_cast<size_t>(sh.C) * sh.a_vecs,
                   rows * b_vecs);
    __syncthreads();
    if (threadIdx.x == 0) ring_slot_publish(mine, slot, g, readers, dispatch_ready(g, sh.row_format));
  }
}

// kSplit: a task is `parts` work items, each a slice of its row (a multiple of 32 vectors);
// a separate instance, so that the usual path (at least one task per warp) keeps its registers.
template <bool kSplit>
__device__ void consume(const CommContext& c, const HandleArrays& h, const TransferArgs& a,
                        const DispatchShape& sh, const Role& role, const int4* x, const int4* x2,
                        int4* out, int n_virtual, int parts) {
  const int lane = threadIdx.x % kWarpSize;
  const int warps_per_block = blockDim.x / kWarpSize;
  const int n_warps = role.count * warps_per_block;
  // Warps numbered across blocks first (block b's warp w is w * blocks + b), so a call with
  // fewer work items than warps still spreads over every SM of the role (block-major numbering
  // put a 128-token call on 4 of 20 SMs: 65 us instead of ~15, benchmarks/NOTES.md #15).
  const int warp = static_cast<int>(threadIdx.x / kWarpSize) * role.count + role.index();
  const int n_rows = h.totals[0];
  RingView mine = RingView::dispatch(c.ws, c.local());
  const int64_t N = mine.num_chunks;
  // Interleave sources: virtual task v is task v / W of source (v + rank) % W, so at any time
  // the warps pull from every peer and copy local tokens together and every NVLink direction
  // stays busy (in plain task order, rank 0 would copy locally while rank 1 pulls, then swap).
  // n_virtual (max tasks of a source x W) comes from the caller. With kSplit the work items
  // are (virtual task, slice): item i is slice i % parts of virtual task i / parts.
  const int n_items = kSplit ? n_virtual * parts : n_virtual;
  // The slice length: the row's vectors dealt to `parts`, rounded up to whole 32-lane steps.
  const int slice = kSplit ? (sh.vec_per_row + parts * kWarpSize - 1) / (parts * kWarpSize) * kWarpSize : 0;
  SeenGens seen;
  // Which work items: every n_warps-th from `warp` (the chunks are then pulled in the order
  // staging blocks publish them), or, when the copy engine staged everything before the kernel,
  // a run of consecutive ones (the first n_items % n_warps warps one more): a warp's remote
  // tasks then share chunks, so one ready-flag check over NVLink covers several (NOTES #34).
  int v_begin = warp, v_end = n_items, v_step = n_warps;
  if (sh.task_runs) {
    const int base = n_items / n_warps, extra = n_items % n_warps;
    v_begin = warp * base + min(warp, extra);
    v_end = v_begin + base + (warp < extra ? 1 : 0);
    v_step = 1;
  }
  // v's quotient and remainder by W, advanced by v_step each task without a division (the
  // split instance divides instead).
  const int W = c.world, step_q = v_step / W, step_r = v_step % W;
  int local_i = v_begin / W, v_rem = v_begin % W;

  // MOK_DISPATCH_CLOCKS builds: this warp's cycles by kind (compiled out otherwise).
  [[maybe_unused]] long long clk[kDClockKinds] = {}, clk0 = 0, clk_t = 0;
  if constexpr (kDispatchClocks) clk0 = clock64();
  for (int v = v_begin; v < v_end; v += v_step) {
    if constexpr (kDispatchClocks) clk_t = clock64();
    int s, local_task, vec_lo = 0, vec_hi = sh.vec_per_row;
    if constexpr (kSplit) {  // small calls: the divisions cost nothing next to the copy
      const int vt = v / parts, part = v - vt * parts;
      s = vt % W + c.rank;
      local_task = vt / W;
      vec_lo = part * slice;
      vec_hi = min(vec_lo + slice, sh.vec_per_row);
      if (vec_lo >= vec_hi) continue;  // the rounding left the last slice empty
    } else {
      s = v_rem + c.rank;
      local_task = local_i;  // s's task this virtual task stands for (if it has one)
      local_i += step_q;
      v_rem += step_r;
      if (v_rem >= W) {
        v_rem -= W;
        ++local_i;
      }
    }
    if (s >= W) s -= W;
    if (local_task >= h.task_off[s + 1] - h.task_off[s]) continue;
    const int i = h.task_off[s] + local_task;
    const int t = h.task_token[i];
    const int j = t / sh.C;
    const uint64_t g = sh.gen(j);
    const int64_t slot = sh.slot(j);
    RingView theirs = RingView::dispatch(c.ws, c.peers.base[s]);
    // The row's vectors [0, a_vecs) are src[v], the rest src2[v - a_vecs] (one source: all src).
    const int4* src;
    const int4* src2;
    const int b_vecs = sh.vec_per_row - sh.a_vecs;
    if (s == c.rank) {  // my own tokens: no staging
      src = x + static_cast<size_t>(t) * sh.a_vecs;
      src2 = b_vecs > 0 ? x2 + static_cast<size_t>(t) * b_vecs : src;
    } else {
      if (!seen.has(s, g)) {
        uint64_t ready;
        if (!wait_geq(c, theirs.ready + slot, dispatch_ready_min(g), s, kWaitDispatchReady,
                      static_cast<int64_t>(g), &ready))
          return;
        if (ready == kReadyPoisoned) {  // the source stopped; its staging may overwrite the chunk
          report_error(c, kPeerStopped, s, kWaitDispatchReady, static_cast<int64_t>(g));
          return;
        }
        // The source staged this chunk's rows in its own row format (ring.h, dispatch_ready).
        if (dispatch_ready_format(ready) != sh.row_format) {
          report_error(c, kConfigMismatch, s, kMismatchRowBytes, dispatch_ready_format(ready));
          return;
        }
        seen.set(s, g);
      }
      // Diagnostic builds (MOK_DISPATCH_DIAG_LOCAL_SRC=1, WRONG DATA, timing only): read the
      // same slot of MY ring instead of the source's, so every load is local and the flags,
      // waits and releases are unchanged: how much of the pull is NVLink's.
      const char* ring = kDispatchDiagLocalSrc ? mine.ring : theirs.ring;
      const int4* chunk = reinterpret_cast<const int4*>(ring + slot * theirs.chunk_bytes);
      src = chunk + static_cast<size_t>(t % sh.C) * sh.a_vecs;
      src2 = b_vecs > 0 ? chunk + static_cast<size_t>(sh.C) * sh.a_vecs + static_cast<size_t>(t % sh.C) * b_vecs
                        : src;
    }
    // Lane k holds the task's row k (K <= 32), read once per task: the copy loop takes each
    // row id by a shuffle instead of re-reading it from global memory for every group of
    // vectors (the stores in between may alias it, so the compiler reloaded it each time).
    const int32_t* rows = h.task_rows + static_cast<size_t>(i) * sh.K;
    const int lane_row = lane < sh.K ? rows[lane] : -1;
    if constexpr (kDispatchClocks) {
      clk[s == c.rank ? kDClockSetupLocal : kDClockSetupRemote] += clock64() - clk_t;
    }
    // Every lane runs every round (the shuffles need the whole warp; the s8-5 build let lanes
    // past a short row's end leave the loop early and read garbage row ids).
    for (int base0 = vec_lo; base0 < vec_hi; base0 += kWarpSize * kCopyUnroll) {
      const int base = base0 + lane;
      if constexpr (kDispatchClocks) clk_t = clock64();
      int4 v[kCopyUnroll];
#pragma unroll
      for (int u = 0; u < kCopyUnroll; ++u) {
        const int vi = base + u * kWarpSize;
        if (vi < vec_hi) v[u] = ld_stream_16(vi < sh.a_vecs ? src + vi : src2 + (vi - sh.a_vecs));
      }
      if constexpr (kDispatchClocks) {  // the loads have landed once a register of each is read
        int sink = 0;
#pragma unroll
        for (int u = 0; u < kCopyUnroll; ++u) sink ^= v[u].x;
        asm volatile("" ::"r"(sink));
        const long long now = clock64();
        clk[s == c.rank ? kDClockLoadLocal : kDClockLoadRemote] += now - clk_t;
        clk_t = now;
      }
      for (int k = 0; k < sh.K; ++k) {
        const int row = __shfl_sync(0xffffffffu, lane_row, k);
        if (row < 0) break;  // rows are packed first, -1 after
        if (row >= a.row_cap) continue;  // overflow (reported by the layout): never write past
        int4* dst = out + static_cast<size_t>(row) * sh.vec_per_row;
#pragma unroll
        for (int u = 0; u < kCopyUnroll; ++u) {
          const int vi = base + u * kWarpSize;
          if (vi < vec_hi) st_16(dst + vi, v[u]);
        }
      }
      if constexpr (kDispatchClocks) clk[kDClockStore] += clock64() - clk_t;
    }
    __syncwarp();
    // Per-task release accounting only when a call spans more than the ring (then producers
    // need slots back during the call); otherwise release_call_chunks does it once per call.
    if (!kSplit && !sh.release_at_end && s != c.rank && lane == 0) {
      __threadfence();
      int32_t* done = mine.done + static_cast<size_t>(s) * N + slot;
      if (atomicAdd(done, 1) + 1 == h.chunk_tasks[s * sh.cpc + j]) {
        *done = 0;  // reset before the release: the next generation counts from zero
        __threadfence_system();
        // The chunk's re-read (release_call_chunks says why), here per chunk: its tasks' reads
        // come before it through their fences and this count.
        if (sh.ce_recheck && ld_acquire_sys(theirs.ready + slot) == kReadyPoisoned)
          report_error(c, kPeerStopped, s, kWaitDispatchReleased, static_cast<int64_t>(g));
        st_release_sys(theirs.released + static_cast<size_t>(c.rank) * N + slot, g + 1);
      }
    }
  }

  if constexpr (kDispatchClocks) {
    clk[kDClockTotal] = clock64() - clk0;
    for (int kind = 0; kind < kDClockKinds; ++kind) dispatch_clock_add(c, kind, clk[kind]);
  }
  const int4 zero = make_int4(0, 0, 0, 0);
  // The zero rows after each expert's rows (expert_alignment > 1 or rows_per_expert; below R,
  // so in every mode): one warp per candidate row (HandleArrays::gap_row).
  const int gap_width = h.pad_info[0];
  for (int64_t i = warp; i < HandleArrays::gap_candidates(c.ws.cfg, gap_width); i += n_warps) {
    const int64_t row = h.gap_row(gap_width, i);
    if (row < 0 || row >= a.row_cap) continue;
    int4* dst = out + static_cast<size_t>(row) * sh.vec_per_row;
    for (int v = lane; v < sh.vec_per_row; v += kWarpSize) dst[v] = zero;
  }
  // Static-shape mode: rows past R are zero (not when the host shrinks the rows to R).
  if (a.mode & kTransferNoPad) return;
  const size_t pad_begin = static_cast<size_t>(min(static_cast<int64_t>(n_rows), a.row_cap)) * sh.vec_per_row;
  const size_t pad_end = static_cast<size_t>(a.row_cap) * sh.vec_per_row;
  for (size_t v = pad_begin + static_cast<size_t>(warp) * kWarpSize + lane; v < pad_end;
       v += static_cast<size_t>(n_warps) * kWarpSize)
    out[v] = zero;
}

// The pulling role: counts the call's virtual tasks and picks the instance (split when the
// call has fewer tasks than the role has warps, as the combine does: NOTES #47).
__device__ void consume_any(const CommContext& c, const HandleArrays& h, const TransferArgs& a,
                            const DispatchShape& sh, const Role& role, const int4* x, const int4* x2,
                            int4* out) {
  int max_per_source = 0;
  for (int s = 0; s < c.world; ++s) max_per_source = max(max_per_source, h.task_off[s + 1] - h.task_off[s]);
  const int n_virtual = max_per_source * c.world;
  const int n_warps = role.count * static_cast<int>(blockDim.x / kWarpSize);
  const int max_parts = (sh.vec_per_row + kWarpSize - 1) / kWarpSize;  // >= 1 vector per lane
  const int parts = sh.split && n_virtual > 0 ? min(max_parts, n_warps / n_virtual) : 1;
  if (parts > 1)
    consume<true>(c, h, a, sh, role, x, x2, out, n_virtual, parts);
  else
    consume<false>(c, h, a, sh, role, x, x2, out, n_virtual, 1);
}

// One warp (copy-engine staging): my chunks are in slots [0, chunks) already (the copy came
// earlier on the stream); record each slot's generation and readers for the next reuse check
// and publish it, as a producer block would after copying.
__device__ void publish_ce_staged(const CommContext& c, const HandleArrays& h, const TransferArgs& a,
                                  const DispatchShape& sh) {
  RingView mine = RingView::dispatch(c.ws, c.local());
  const int n_chunks = (a.num_tokens + sh.C - 1) / sh.C;
  for (int j = threadIdx.x % kWarpSize; j < n_chunks; j += kWarpSize)
    ring_slot_publish(mine, j, sh.gen(j), h.chunk_readers[j], dispatch_ready(sh.gen(j), sh.row_format));
}

// The grid's last warp, once every pull of this call is done, tells each source that my reads
// of its chunks are over: one release store per (source, chunk) I read from, instead of a fence
// (waiting for the task's stores) and an atomic round trip per remote task on the pull's path
// (NOTES #30). Only when the call fits in the ring: a slot is then written once per call, and
// the source's next staging of it comes with a later call.
//
// With copy-engine staging it first re-reads, once per source it read from, that source's slot 0
// (NOTES item 41): a source whose next staging gave up waiting for my release (it timed out, or
// it had aborted) poisoned its slots before its copy overwrote them, and my warps may have been
// past their waits, reading, when the copy landed. The poison comes before the copy in stream
// order, and every row read of this call comes before these loads (each warp's fence before its
// count, the count this warp saw, begin_call_release's fence), so rows the copy wrote are seen
// only if the poison is seen too: then the call's rows are not valid, and it says so (kPeerStopped)
// instead of returning them. Slot 0 stands for every slot: a staging poisons all the slots it
// copies into, and every copy starts at slot 0. Only such a staging can write a slot I have not
// released: one whose check passes waited for my release, and SM staging stops on a failed check.
// One remote load per source, in parallel across lanes (W <= 64): about one NVLink round trip.
__device__ void release_call_chunks(const CommContext& c, const HandleArrays& h, const DispatchShape& sh) {
  if (!begin_call_release(c)) return;
  if (sh.ce_recheck) {
    for (int s = threadIdx.x % kWarpSize; s < c.world; s += kWarpSize) {
      if (s == c.rank || h.task_off[s + 1] == h.task_off[s]) continue;  // read nothing of s
      const RingView theirs = RingView::dispatch(c.ws, c.peers.base[s]);
      if (ld_acquire_sys(theirs.ready) == kReadyPoisoned)  // `what`: found at the release, not a wait
        report_error(c, kPeerStopped, s, kWaitDispatchReleased, static_cast<int64_t>(sh.gen(0)));
    }
  }
  for (int idx = threadIdx.x % kWarpSize; idx < c.world * sh.cpc; idx += kWarpSize) {
    const int s = idx / sh.cpc, j = idx - s * sh.cpc;
    if (s == c.rank || h.chunk_tasks[idx] == 0) continue;  // not a reader of that chunk
    RingView theirs = RingView::dispatch(c.ws, c.peers.base[s]);
    st_release_sys(theirs.released + static_cast<size_t>(c.rank) * theirs.num_chunks + sh.slot(j), sh.gen(j) + 1);
  }
}

__global__ void __launch_bounds__(kDispatchThreads, 1)
    dispatch_transfer_kernel(CommContext c, HandleArrays h, TransferArgs a, DispatchShape sh,
                             const int4* x, const int4* x2, int4* out) {
  // After a protocol error the layout arrays may be unfilled (the fill kernel stopped): touch
  // nothing. The Buffer is unusable from here on (the host raises at its next read).
  pdl_wait_then_release_dependents();
  if (aborted(c)) return;
  SeqCounters* n = c.counters();
  const int G = static_cast<int>(gridDim.x);
  trace_warp(c, true);
  const int mode = a.mode & ~kTransferNoPad;
  if (mode == kTransferStage) {
    sh.start(n->disp_seq);
    produce(c, h, a, sh, Role{0, G}, x, x2);
    trace_warp(c, false);
    warp_done_advance(&n->disp_warps_done, &n->disp_seq);
    return;
  }
  if (mode == kTransferPull) {
    sh.start(n->disp_pull_seq);
    consume_any(c, h, a, sh, Role{0, G}, x, x2, out);
    trace_warp(c, false);
    if (warp_done_advance(&n->disp_pull_warps_done, &n->disp_pull_seq) && sh.release_at_end)
      release_call_chunks(c, h, sh);
    return;
  }
  sh.start(n->disp_seq);
  if (sh.ce_staged) {
    if (blockIdx.x == 0 && threadIdx.x < kWarpSize) publish_ce_staged(c, h, a, sh);
    consume_any(c, h, a, sh, Role{0, G}, x, x2, out);
  } else if (static_cast<int>(blockIdx.x) < a.num_producers)
    produce(c, h, a, sh, Role{0, a.num_producers}, x, x2);
  else
    consume_any(c, h, a, sh, Role{a.num_producers, G - a.num_producers}, x, x2, out);
  trace_warp(c, false);
  if (warp_done_advance(&n->disp_warps_done, &n->disp_seq, &n->disp_pull_seq) && sh.release_at_end)
    release_call_chunks(c, h, sh);
}

}  // namespace

cudaError_t launch_dispatch_transfer(const CommContext& c, const HandleArrays& h,
                                     const TransferArgs& t, const DispatchSource& x, void* out_rows,
                                     cudaStream_t s) {
  DispatchShape sh;
  // Checked by the API: multiples of 16, within the ring's row; x_bytes == row_bytes, or a pair.
  sh.vec_per_row = x.row_bytes / 16;
  sh.a_vecs = x.x_bytes / 16;
  sh.row_format = row_format(x.row_bytes, x.two_sources());
  sh.cpc = HandleArrays::chunks_per_call(c.ws.cfg);
  sh.C = c.ws.cfg.chunk_tokens;
  sh.K = c.ws.cfg.topk;
  sh.slots.N = static_cast<int>(c.ws.cfg.disp_ring_chunks);
  // MOK_DISPATCH_RELEASE_AT_END=0 keeps the per-task release accounting (A/B; tests cover both).
  sh.release_at_end = sh.cpc <= sh.slots.N && !env_off("MOK_DISPATCH_RELEASE_AT_END");
  sh.ce_staged = (t.mode & kTransferCeStaged) != 0;
  // MOK_DISPATCH_RECHECK=0 leaves out item 41's re-read (A/B of its cost only: a reader past its
  // waits then takes rows a failed peer's staging overwrote without an error).
  sh.ce_recheck = sh.ce_staged && !env_off("MOK_DISPATCH_RECHECK");
  // MOK_DISPATCH_TASK_RUNS=0 keeps every n-th task with copy-engine staging too (A/B; tested).
  sh.task_runs = sh.ce_staged && !env_off("MOK_DISPATCH_TASK_RUNS");
  // MOK_DISPATCH_SPLIT=0: one warp per task whatever the call size (A/B; tested). Only when
  // chunks are released once per call: the per-task release counts whole tasks.
  sh.split = sh.release_at_end && !env_off("MOK_DISPATCH_SPLIT");
  if (sh.ce_staged && sh.cpc > sh.slots.N) return cudaErrorInvalidValue;  // checked by the API
  return launch_kernel(c, dispatch_transfer_kernel, t.num_blocks, kDispatchThreads, 0, s, c, h, t, sh,
                       static_cast<const int4*>(x.x), static_cast<const int4*>(x.x2),
                       static_cast<int4*>(out_rows));
}

bool dispatch_call_fits_ring(const Workspace& ws) {
  return HandleArrays::chunks_per_call(ws.cfg) <= static_cast<int>(ws.cfg.disp_ring_chunks);
}

// Before the copy engine overwrites slots [0, n_chunks): the readers of each slot's previous
// generation (recorded by its publisher) must have released it. One warp per slot in turn; a
// ring used only by copy-engine calls never wraps within a call, and its previous readers are
// the peers' pulls of an earlier call, which need nothing from this rank any more.
//
// When the rank has aborted, or a check gives up, the copy behind this kernel still runs (a
// kernel cannot cancel it), and a peer that has not read the slots' previous generation yet
// would read the copy's rows as if they were the ones it waits for, with no error of its own
// (NOTES item 37, B1; test_loopback_lagging_reader_*). So the slots are poisoned first: their
// `ready` becomes kReadyPoisoned (release store, before the copy in stream order), and a reader
// that comes to them later reports kPeerStopped instead of reading. A reader already past its
// wait when the copy lands finds the poison when it re-reads slot 0 before its release
// (release_call_chunks, NOTES item 41).
__global__ void __launch_bounds__(kStageAcquireThreads) stage_acquire_kernel(CommContext c, int n_chunks, int cpc) {
  pdl_wait_then_release_dependents();
  RingView mine = RingView::dispatch(c.ws, c.local());
  const uint64_t g0 = c.counters()->disp_seq * static_cast<uint64_t>(cpc);  // labels an error only
  const int n_warps = blockDim.x / kWarpSize;
  // One answer per warp: every lane of it must take the warp-wide check below together.
  bool ok = __shfl_sync(0xffffffffu, aborted(c) ? 0 : 1, 0) != 0;
  for (int j = threadIdx.x / kWarpSize; ok && j < n_chunks; j += n_warps)
    ok = ring_slot_acquire_warp(c, mine, j, g0 + j, kWaitDispatchReleased);
  // Did any warp's check fail? One answer for the whole block (a barrier, so every thread is here).
  if (!__syncthreads_or(!ok)) return;
  for (int j = threadIdx.x; j < n_chunks; j += blockDim.x) st_release_sys(mine.ready + j, kReadyPoisoned);
}

// Rows [0, num_tokens) of one source, `row` bytes each, into the slots from `dst` on (slot j's
// rows at dst + j * slot bytes, pitch `row`): one copy when the slots are exactly C rows long,
// else one pitched copy of the full chunks and one of the last, partial one.
static cudaError_t copy_into_slots(char* dst, size_t slot_bytes, const char* src, size_t row, int C,
                                   int num_tokens, cudaStream_t s) {
  const size_t chunk = static_cast<size_t>(C) * row;
  if (chunk == slot_bytes)
    return cudaMemcpyAsync(dst, src, static_cast<size_t>(num_tokens) * row, cudaMemcpyDeviceToDevice, s);
  const int full = num_tokens / C, tail = num_tokens - full * C;
  if (full > 0) {
    if (cudaError_t e = cudaMemcpy2DAsync(dst, slot_bytes, src, chunk, chunk, full, cudaMemcpyDeviceToDevice, s))
      return e;
  }
  if (tail > 0)
    return cudaMemcpyAsync(dst + full * slot_bytes, src + full * chunk, tail * row, cudaMemcpyDeviceToDevice, s);
  return cudaSuccess;
}

cudaError_t launch_dispatch_stage_copy(const CommContext& c, const DispatchSource& x, int num_tokens,
                                       cudaStream_t s) {
  const Workspace& ws = c.ws;
  if (!dispatch_call_fits_ring(ws)) return cudaErrorInvalidValue;
  const int C = ws.cfg.chunk_tokens;
  const int n_chunks = (num_tokens + C - 1) / C;
  if (n_chunks == 0) return cudaSuccess;  // nothing to stage, nothing to publish
  if (cudaError_t e = launch_kernel(c, stage_acquire_kernel, 1, kStageAcquireThreads, 0, s, c, n_chunks,
                                    HandleArrays::chunks_per_call(ws.cfg)))
    return e;
  // A slot may be longer than its C rows (aligned to 256 B, or rows shorter than the ring's, as
  // FP8 rows are). A pair's two sources go to the two planes of each slot (C token rows, then
  // C scale rows): two copies of each kind.
  char* dst = c.local() + ws.disp_ring;
  const size_t a_row = static_cast<size_t>(x.x_bytes);
  if (cudaError_t e = copy_into_slots(dst, ws.disp_chunk_bytes, static_cast<const char*>(x.x), a_row, C,
                                      num_tokens, s))
    return e;
  if (!x.two_sources()) return cudaSuccess;
  return copy_into_slots(dst + static_cast<size_t>(C) * a_row, ws.disp_chunk_bytes,
                         static_cast<const char*>(x.x2), static_cast<size_t>(x.row_bytes) - a_row, C,
                         num_tokens, s);
}

}  // namespace mok

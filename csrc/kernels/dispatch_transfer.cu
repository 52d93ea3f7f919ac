// The dispatch data path: one persistent kernel, two roles.
//
//   producer blocks  stage my tokens, chunk by chunk, into my dispatch ring (local copy), and
//                    publish each chunk with one release store (its generation + 1). A slot
//                    is reused only after the readers of its previous generation released it:
//                    checked lazily, right before the overwrite.
//   consumer warps   one task (source token) at a time: wait for its chunk (cached per warp),
//                    pull the token ONCE from the source's ring over NVLink with a bulk copy
//                    into shared memory (the next token's copy in flight meanwhile) and bulk-
//                    store it to every expert row it belongs to. The last task of a (source,
//                    chunk) releases the chunk.
// Both roles copy with the SM's bulk-copy engine (cp.async.bulk), issued by one lane per warp:
// whole rows in flight without registers, which 16-byte register copies could not match.
//
// Both roles run in one grid whose blocks are all resident, so a call larger than the ring
// still progresses: producers wait for consumers on the other GPUs, never for themselves.
#include "mok/bulk.h"
#include "mok/launch.h"

namespace mok {
namespace {

struct DispatchShape {
  uint64_t seq;         // this call's number on the dispatch ring (read at kernel start)
  int row_bytes;        // bytes of one token row
  int piece_bytes;      // bytes one bulk copy moves (a row, or a piece of a long row)
  int pieces;           // pieces per row
  int cpc;              // chunks per call
  int C;                // rows per chunk
  int K;
};

// Two shared-memory stages per warp, each with its mbarrier; only lane 0 touches them.
struct WarpStages {
  char* buf[2];
  uint64_t* bar;
  uint32_t phase[2];

  __device__ void init(char* smem, int piece_bytes, int warps_per_block) {
    const int w = threadIdx.x / kWarpSize;
    buf[0] = smem + static_cast<size_t>(2 * w) * piece_bytes;
    buf[1] = buf[0] + piece_bytes;
    bar = reinterpret_cast<uint64_t*>(smem + static_cast<size_t>(2 * warps_per_block) * piece_bytes) + 2 * w;
    phase[0] = phase[1] = 0;
    mbar_init(&bar[0], 1);
    mbar_init(&bar[1], 1);
    fence_mbar_init();
  }
  __device__ void load(int st, const void* src, uint32_t bytes) {
    mbar_expect_tx(&bar[st], bytes);
    bulk_load(buf[st], src, bytes, &bar[st]);
  }
  __device__ void wait(int st) {
    mbar_wait(&bar[st], phase[st]);
    phase[st] ^= 1;
  }
};

// Runs a warp's items through its two stages (lane 0 only): the load of item k+1 is in flight
// while item k's stores drain. next(it): the following item, false at the end. src(it, bytes):
// waits until the item's source is ready and returns it (nullptr: an error was reported, stop).
// done(it, smem, bytes): issues the item's stores and its bookkeeping.
template <typename Item, typename Next, typename Src, typename Done>
__device__ void pipe_items(WarpStages& ws, Item cur, Next next, Src src, Done done) {
  uint32_t cur_bytes = 0;
  const char* p = src(cur, cur_bytes);
  if (p == nullptr) return;
  int st = 0;
  ws.load(st, p, cur_bytes);
  while (true) {
    Item nx = cur;
    const bool more = next(nx);
    const char* np = nullptr;
    uint32_t nb = 0;
    if (more) {
      bulk_wait_read_all();  // the stores that read stage st^1 (item k-1) are done with it
      np = src(nx, nb);
      if (np != nullptr) ws.load(st ^ 1, np, nb);
    }
    ws.wait(st);
    done(cur, ws.buf[st], cur_bytes);
    bulk_commit();
    if (!more || np == nullptr) break;
    cur = nx;
    cur_bytes = nb;
    st ^= 1;
  }
  bulk_wait_all();
}

__device__ void produce(const CommContext& c, const HandleArrays& h, const TransferArgs& a,
                        const DispatchShape& sh, const char* x, WarpStages& stages) {
  __shared__ bool ok;
  const int lane = threadIdx.x % kWarpSize, wib = threadIdx.x / kWarpSize;
  const int warps = blockDim.x / kWarpSize;
  RingView mine = RingView::dispatch(c.ws, c.local());
  const int64_t N = mine.num_chunks;
  const int n_chunks = (a.num_tokens + sh.C - 1) / sh.C;
  for (int j = 0; j < n_chunks; ++j) {
    const uint64_t g = sh.seq * sh.cpc + j;
    const int64_t slot = static_cast<int64_t>(g % N);
    // A slot always belongs to the same producer block, so its generations are written in order.
    if (slot % a.num_producers != blockIdx.x) continue;
    const uint64_t readers = h.chunk_readers[j];
    if (readers == 0) continue;  // nobody else needs this chunk: skip the copy
    if (threadIdx.x == 0) ok = true;
    __syncthreads();
    const uint64_t prev = mine.gen[slot], prev_readers = mine.readers[slot];
    if (prev != 0 && threadIdx.x < c.world && ((prev_readers >> threadIdx.x) & 1)) {
      if (!wait_geq(c, mine.released + threadIdx.x * N + slot, prev, threadIdx.x,
                    kWaitDispatchReleased, static_cast<int64_t>(g)))
        ok = false;
    }
    __syncthreads();
    if (!ok) return;
    const int rows = min(sh.C, a.num_tokens - j * sh.C);
    const char* src = x + static_cast<size_t>(j) * sh.C * sh.row_bytes;
    char* dst = mine.ring + slot * mine.chunk_bytes;
    // Items: (row, piece) of this chunk, rows spread over the block's warps.
    struct Item { int row, piece; };
    if (lane == 0 && wib < rows) {
      auto next = [&](Item& it) {
        if (++it.piece < sh.pieces) return true;
        it.piece = 0;
        it.row += warps;
        return it.row < rows;
      };
      auto source = [&](const Item& it, uint32_t& bytes) -> const char* {
        bytes = min(sh.piece_bytes, sh.row_bytes - it.piece * sh.piece_bytes);
        return src + static_cast<size_t>(it.row) * sh.row_bytes + static_cast<size_t>(it.piece) * sh.piece_bytes;
      };
      auto done = [&](const Item& it, const char* smem, uint32_t bytes) {
        bulk_store(dst + static_cast<size_t>(it.row) * sh.row_bytes + static_cast<size_t>(it.piece) * sh.piece_bytes,
                   smem, bytes);
      };
      pipe_items(stages, Item{wib, 0}, next, source, done);
      fence_proxy_async_global();  // the bulk writes above, before the generic release below
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      mine.gen[slot] = g + 1;
      mine.readers[slot] = readers;
      __threadfence_system();
      st_release_sys(mine.ready + slot, g + 1);
    }
  }
}

__device__ void consume(const CommContext& c, const HandleArrays& h, const TransferArgs& a,
                        const DispatchShape& sh, const char* x, char* out, WarpStages& stages) {
  const int lane = threadIdx.x % kWarpSize;
  const int warps_per_block = blockDim.x / kWarpSize;
  const int n_warps = (gridDim.x - a.num_producers) * warps_per_block;
  const int warp = (blockIdx.x - a.num_producers) * warps_per_block + threadIdx.x / kWarpSize;
  const int n_rows = h.totals[0];
  RingView mine = RingView::dispatch(c.ws, c.local());
  const int64_t N = mine.num_chunks;
  // Interleave sources: virtual task v is task v / W of source (v + rank) % W, so at any time
  // the warps pull from every peer and copy local tokens together and every NVLink direction
  // stays busy (in plain task order, rank 0 would copy locally while rank 1 pulls, then swap).
  int max_per_source = 0;
  for (int s = 0; s < c.world; ++s) max_per_source = max(max_per_source, h.task_off[s + 1] - h.task_off[s]);
  const int64_t n_virtual = static_cast<int64_t>(max_per_source) * c.world;

  if (lane == 0) {
    SeenGens seen;
    // Each warp takes a contiguous run of virtual tasks: its tokens then share ring chunks, so
    // one readiness check covers many tasks (strided tasks would poll a peer flag per task).
    const int64_t run = (n_virtual + n_warps - 1) / n_warps;
    const int64_t v_end = min(n_virtual, (warp + 1) * run);
    int64_t v = warp * run - 1;  // the next virtual task is v + 1
    struct Item { int task, piece, s, t; };
    auto next_task = [&](Item& it) {
      for (++v; v < v_end; ++v) {
        const int s = static_cast<int>((v + c.rank) % c.world);
        const int li = static_cast<int>(v / c.world);
        if (li < h.task_off[s + 1] - h.task_off[s]) {
          it.task = h.task_off[s] + li;
          it.piece = 0;
          it.s = s;
          it.t = h.task_token[it.task];
          return true;
        }
      }
      return false;
    };
    auto next = [&](Item& it) { return ++it.piece < sh.pieces ? true : next_task(it); };
    auto source = [&](const Item& it, uint32_t& bytes) -> const char* {
      bytes = min(sh.piece_bytes, sh.row_bytes - it.piece * sh.piece_bytes);
      const size_t off = static_cast<size_t>(it.piece) * sh.piece_bytes;
      if (it.s == c.rank) return x + static_cast<size_t>(it.t) * sh.row_bytes + off;  // no staging
      const uint64_t g = sh.seq * sh.cpc + it.t / sh.C;
      RingView theirs = RingView::dispatch(c.ws, c.peers.base[it.s]);
      if (it.piece == 0 && !seen.has(it.s, g)) {
        if (!wait_geq(c, theirs.ready + g % N, g + 1, it.s, kWaitDispatchReady, static_cast<int64_t>(g)))
          return nullptr;
        seen.set(it.s, g);
        fence_proxy_async_global();  // acquired with generic loads, read by the copy engine
      }
      return theirs.ring + (g % N) * theirs.chunk_bytes + static_cast<size_t>(it.t % sh.C) * sh.row_bytes + off;
    };
    auto done = [&](const Item& it, const char* smem, uint32_t bytes) {
      const int32_t* rows = h.task_rows + static_cast<size_t>(it.task) * sh.K;
      const size_t off = static_cast<size_t>(it.piece) * sh.piece_bytes;
      for (int k = 0; k < sh.K; ++k) {
        const int row = rows[k];
        if (row < 0) break;               // rows are packed first, -1 after
        if (row >= a.row_cap) continue;   // overflow (reported by the layout): never write past
        bulk_store(out + static_cast<size_t>(row) * sh.row_bytes + off, smem, bytes);
      }
      if (it.piece == sh.pieces - 1 && it.s != c.rank) {
        // Every piece of this token has landed here: count it against its (source, chunk).
        const int j = it.t / sh.C;
        const uint64_t g = sh.seq * sh.cpc + j;
        const int64_t slot = static_cast<int64_t>(g % N);
        int32_t* d = mine.done + static_cast<size_t>(it.s) * N + slot;
        if (atomicAdd(d, 1) + 1 == h.chunk_tasks[it.s * sh.cpc + j]) {
          *d = 0;  // reset before the release: the next generation counts from zero
          __threadfence_system();
          RingView theirs = RingView::dispatch(c.ws, c.peers.base[it.s]);
          st_release_sys(theirs.released + static_cast<size_t>(c.rank) * N + slot, g + 1);
        }
      }
    };
    Item first{};
    if (next_task(first)) pipe_items(stages, first, next, source, done);
  }
  __syncwarp();

  // Static-shape mode: rows past R are zero.
  const int4 zero = make_int4(0, 0, 0, 0);
  const size_t vec_per_row = sh.row_bytes / 16;
  int4* out4 = reinterpret_cast<int4*>(out);
  const size_t pad_begin = static_cast<size_t>(min(static_cast<int64_t>(n_rows), a.row_cap)) * vec_per_row;
  const size_t pad_end = static_cast<size_t>(a.row_cap) * vec_per_row;
  for (size_t i = pad_begin + static_cast<size_t>(warp) * kWarpSize + lane; i < pad_end;
       i += static_cast<size_t>(n_warps) * kWarpSize)
    out4[i] = zero;
}

__global__ void __launch_bounds__(kDispatchThreads, 1)
    dispatch_transfer_kernel(CommContext c, HandleArrays h, TransferArgs a, DispatchShape sh,
                             const char* x, char* out) {
  extern __shared__ __align__(128) char smem[];
  WarpStages stages;
  if (threadIdx.x % kWarpSize == 0) stages.init(smem, sh.piece_bytes, blockDim.x / kWarpSize);
  __syncwarp();
  sh.seq = c.counters()->disp_seq;
  if (blockIdx.x < a.num_producers)
    produce(c, h, a, sh, x, stages);
  else
    consume(c, h, a, sh, x, out, stages);
  warp_done_advance(&c.counters()->disp_warps_done, &c.counters()->disp_seq);
}

}  // namespace

cudaError_t launch_dispatch_transfer(const CommContext& c, const HandleArrays& h,
                                     const TransferArgs& t, const void* x, void* out_rows,
                                     int elem_bytes, cudaStream_t s) {
  DispatchShape sh;
  sh.row_bytes = c.ws.cfg.hidden * elem_bytes;
  sh.pieces = (sh.row_bytes + kMaxPieceBytes - 1) / kMaxPieceBytes;
  sh.piece_bytes = (sh.row_bytes / sh.pieces + 15) / 16 * 16;
  sh.cpc = HandleArrays::chunks_per_call(c.ws.cfg);
  sh.C = c.ws.cfg.chunk_tokens;
  sh.K = c.ws.cfg.topk;
  constexpr int warps = kDispatchThreads / kWarpSize;
  const size_t smem = static_cast<size_t>(2 * warps) * sh.piece_bytes + 2 * warps * sizeof(uint64_t);
  if (cudaError_t e = cudaFuncSetAttribute(dispatch_transfer_kernel,
                                           cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)))
    return e;
  dispatch_transfer_kernel<<<t.num_blocks, kDispatchThreads, smem, s>>>(
      c, h, t, sh, static_cast<const char*>(x), static_cast<char*>(out_rows));
  return cudaGetLastError();
}

}  // namespace mok

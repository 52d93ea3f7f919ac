// Stopping a rank after an error of its own (mok_stop_rank; Buffer.dispatch / combine raising on
// this rank, or a device error this rank's host raised): without it, its peers, already inside the
// same call, would wait for it until their timeout (60 s by default) and only then raise, naming
// a timeout instead of the rank that failed (NOTES item 53).
//
// One block, on the rank's stream (after everything the rank queued before: nothing it
// publishes later can overwrite what is written here):
//  1. drain: it waits until the peers have read everything this rank published so far (each
//     routing slot's latest call, each ring slot's latest generation, by the readers recorded
//     with it). A data error (a bad expert id) is raised after the rank's transfer was launched,
//     so its peers complete that call: the poison must not land under their reads of it. After
//     a validation error nothing of the call was published and every earlier call was read, so
//     nothing is waited for; after a protocol error (a timeout, a peer stopped) this rank's
//     report already aborts every wait. Each wait has the usual timeout.
//  2. its own error report gets kAborted, so any kernel of this rank still to run gives up its
//     waits and skips its work (a replayed CUDA graph, a side stream's launch); its stop note
//     (workspace.h StopNote) gets the host's reason, which the peers' messages quote;
//  3. every flag a peer waits on for this rank's data becomes kReadyPoisoned (ring.h): the
//     routing slots (meta_ready), the dispatch ring's and the combine ring's slots. A peer's wait
//     ends on the poison at once (it is above every generation) and reports kPeerStopped naming
//     this rank (wait_published);
//  4. this rank's release counters in every peer's rings and routing slots become ~0: a peer
//     waiting to reuse a slot this rank would never read again (a call that wraps a ring within
//     itself) goes on instead of waiting; only this rank would have read what it overwrites.
#include "mok/launch.h"

namespace mok {
namespace {

constexpr int kStopThreads = 256;

__device__ void fill(uint64_t* p, int64_t n, uint64_t v) {
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) st_release_sys(p + i, v);
}

// Step 1: every reader of what this rank published last in each slot has released it.
__device__ void drain(const CommContext& c) {
  const Workspace& ws = c.ws;
  char* me = c.local();
  const int64_t M = ws.cfg.meta_slots;
  const uint64_t* meta_ready = ws.meta_ready_at(me);
  for (int64_t i = threadIdx.x; i < M * c.world; i += blockDim.x) {
    const int m = static_cast<int>(i % M), r = static_cast<int>(i / M);
    const uint64_t v = ld_acquire_sys(meta_ready + m);  // the call published in slot m, + 1
    if (r != c.rank && v != 0 && v != kReadyPoisoned)
      (void)wait_geq(c, ws.meta_released_at(me, r) + m, v, r, kWaitRoutingReleased, m);
  }
  const int warp = threadIdx.x / kWarpSize, n_warps = blockDim.x / kWarpSize;
  const RingView d = RingView::dispatch(ws, me), cb = RingView::combine(ws, me);
  for (int64_t j = warp; j < d.num_chunks; j += n_warps)
    (void)ring_slot_acquire_warp(c, d, j, 0, kWaitDispatchReleased);
  for (int64_t j = warp; j < cb.num_chunks; j += n_warps)
    (void)ring_slot_acquire_warp(c, cb, j, 0, kWaitCombineReleased);
}

__global__ void __launch_bounds__(kStopThreads) stop_rank_kernel(CommContext c, StopNote note) {
  pdl_wait_then_release_dependents();
  const Workspace& ws = c.ws;
  drain(c);
  __syncthreads();
  if (threadIdx.x == 0) report_error(c, kAborted, -1, kWaitNone, 0);
  char* me = c.local();
  // Step 2b: the note saying why, for the peers' messages (read by their hosts after their wait
  // ended on the poison): written before the fence, so it is whole wherever the poison is seen.
  const int32_t* from = reinterpret_cast<const int32_t*>(&note);
  int32_t* to = reinterpret_cast<int32_t*>(ws.stop_note_at(me));
  for (int i = threadIdx.x; i < static_cast<int>(sizeof(StopNote) / 4); i += blockDim.x) to[i] = from[i];
  __syncthreads();
  __threadfence_system();  // the report and the note before the poison: a kernel of mine or a
                           // peer's seeing the poison sees both
  const int64_t M = ws.cfg.meta_slots, Nd = ws.cfg.disp_ring_chunks, Nc = ws.cfg.comb_ring_chunks;
  fill(ws.meta_ready_at(me), M, kReadyPoisoned);
  fill(RingView::dispatch(ws, me).ready, Nd, kReadyPoisoned);
  fill(RingView::combine(ws, me).ready, Nc, kReadyPoisoned);
  for (int d = 0; d < c.world; ++d) {
    if (d == c.rank) continue;
    char* peer = c.peers.base[d];
    fill(ws.meta_released_at(peer, c.rank), M, ~0ull);
    fill(RingView::dispatch(ws, peer).released + static_cast<size_t>(c.rank) * Nd, Nd, ~0ull);
    fill(RingView::combine(ws, peer).released + static_cast<size_t>(c.rank) * Nc, Nc, ~0ull);
  }
}

}  // namespace

cudaError_t launch_stop_rank(const CommContext& c, const StopNote& note, cudaStream_t s) {
  return launch_kernel(c, stop_rank_kernel, 1, kStopThreads, 0, s, c, note);
}

cudaError_t stop_rank_kernel_attributes(cudaFuncAttributes* a) {
  return cudaFuncGetAttributes(a, stop_rank_kernel);
}

}  // namespace mok

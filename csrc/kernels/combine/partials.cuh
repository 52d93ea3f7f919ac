// Included only from kernels/combine_transfer.cu; uses shape.cuh.
// Holds where peers staged my partials, and their waits and per-token release.
#pragma once

namespace mok {
namespace {

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
      if (!wait_published(c, theirs.ready + sh.slot(me, q / sh.C), g + 1, d, kWaitCombineReady, static_cast<int64_t>(g)))
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

}  // namespace
}  // namespace mok

// Included only from kernels/combine_transfer.cu; uses shape.cuh.
// Holds release_partial_chunks: a phased call's once-per-call release of the chunks it read.
#pragma once

namespace mok {
namespace {

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

}  // namespace
}  // namespace mok

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
//
// Here: the kernel (combine_transfer_kernel), its launches and launch_combine_transfer. The
// device code it runs is in kernels/combine/, included below in dependency order (only here):
//   shape.cuh             CombineShape, split_factor, part_steps
//   produce.cuh           produce_row, produce_chunks (role split), TaskCursor, produce_rows
//   partials.cuh          where peers staged my partials; their waits and per-token release
//   row_stream.cuh        the shared-memory row stream (RowStream, WarpRing, StreamIssue)
//   produce_streamed.cuh  produce_rows_streamed (the phased produce phase)
//   consume.cuh           consume, consume_staged, consume_any
//   narrow.cuh            narrow calls: produce_narrow, consume_narrow
//   release.cuh           release_partial_chunks (phased calls, once per call)
#include <algorithm>
#include <cstdlib>

#include "mok/launch.h"
#include "mok/row_sum.h"

#include "kernels/combine/shape.cuh"
#include "kernels/combine/produce.cuh"
#include "kernels/combine/partials.cuh"
#include "kernels/combine/row_stream.cuh"
#include "kernels/combine/produce_streamed.cuh"
#include "kernels/combine/consume.cuh"
#include "kernels/combine/narrow.cuh"
#include "kernels/combine/release.cuh"

namespace mok {
namespace {

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

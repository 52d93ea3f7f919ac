// Included only from kernels/combine_transfer.cu; uses only the mok/ headers.
// Holds CombineShape (a call's geometry, switches, ring slots), split_factor, part_steps.
#pragma once

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

}  // namespace
}  // namespace mok

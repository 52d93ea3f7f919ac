// Host-side launchers of every kernel; the C API (api/mok_api.cu) calls these after
// checking its arguments. Each returns the cudaError_t of its launch.
#pragma once

#include <cuda_runtime.h>

#include <cstdlib>

#include "device.h"
#include "handle_arrays.h"
#include "ring.h"

namespace mok {

// True when environment variable `name` is set to a value starting with '0': how the launchers
// read their schedule switches (MOK_COMBINE_PHASED=0, MOK_DISPATCH_RELEASE_AT_END=0, ...).
inline bool env_off(const char* name) {
  const char* v = getenv(name);
  return v != nullptr && v[0] == '0';
}

// Routing of one full dispatch (all pointers device, `T` rows).
struct RoutingArgs {
  const void* topk_idx;       // [T, K] int32 or int64
  int32_t idx_is_64;
  const float* topk_weights;  // [T, K]
  int32_t num_tokens;         // T of this rank
  int32_t num_experts;        // E (global), for range checks
  int64_t spec_cap;           // speculative eager dispatch: rows allocated before the host
                              // read (published with the routing); -1: not speculative
  int32_t row_format;         // the call's row format (config.h, row_format: token rows, packed
                              // FP8 rows, or an FP8 pair's two sources), published with the
                              // routing: every reader checks it is its own
};

// Outputs of a dispatch that the user sees.
struct RowOutputs {
  int64_t* src_rank;          // [row_cap]
  int64_t* src_token;         // [row_cap]
  float* probs;               // [row_cap]
  int64_t* tokens_per_expert; // [E_local + 2]: the counts, then R (rows written), then the rows
                              // received (past row_cap with an overflow)
  int64_t row_cap;            // rows allocated (R, a bound on R, or max_recv_tokens)
  int pad;                    // fill: rows [R, row_cap) say "no source" (static shape); 0: untouched
  // Layout: the host report (pinned, mapped host memory, int32 [12]) the scan kernel writes at
  // its end: totals[0..3] (R, tasks, speculative verdict, 0), then the first 8 words of this
  // rank's ErrorReport. An eager dispatch reads it after an event, with no copy queued
  // (nullptr: static-shape and cached calls, which read nothing).
  int32_t* host_report = nullptr;
  // Layout: rows_per_expert N >= 0 gives every local expert exactly N rows (zero rows after its
  // received ones; rows past N dropped, error kExpertOverflow); -1: off.
  int32_t rows_per_expert = -1;
  // Layout: 1, rows past row_cap are dropped without an error (a receive budget: the caller
  // reads tokens_per_expert[E_local + 1] for the rows received); 0, they are kRecvOverflow.
  int32_t drop_over_cap = 0;
};

// Publish my routing (send-side layout included) and build the receive layout's counts.
cudaError_t launch_dispatch_layout(const CommContext& c, const HandleArrays& h,
                                   const RoutingArgs& r, const RowOutputs& out, cudaStream_t s);
// Whether launch_dispatch_layout fuses publish, count and scan into one kernel (NOTES #45).
bool layout_is_fused(const WorkspaceConfig& cfg, bool speculative);
// Dynamic shared memory, in bytes, of the routing kernel that needs the most per chunk (the
// fill's tables; the layout's are smaller): mok_create refuses a configuration past
// kMaxDynamicSmem, which would otherwise fail at its first launch with "invalid argument".
size_t routing_smem_bytes(int num_local_experts, int chunk_tokens, int topk);
// Fill the per-row outputs and the task lists, then release the routing slots.
cudaError_t launch_dispatch_fill(const CommContext& c, const HandleArrays& h, const RoutingArgs& r,
                                 const RowOutputs& out, cudaStream_t s);

struct TransferArgs {
  int32_t num_tokens;    // T of this rank (as in the dispatch)
  int32_t num_blocks;    // SMs used
  int32_t num_producers; // blocks that stage (the rest pull)
  int64_t row_cap;
  int32_t mode;          // dispatch only: TransferMode
};

// Which roles one dispatch transfer launch plays.
enum TransferMode : int32_t {
  kTransferBoth = 0,   // one kernel: num_producers blocks stage, the rest pull
  kTransferStage = 1,  // every block stages (stage-first eager dispatch: side stream, before the read)
  kTransferPull = 2,   // every block pulls (stage-first eager dispatch: after the read)
  // Flag or'ed into the mode: rows [R, row_cap) are left alone instead of zeroed (the
  // speculative eager dispatch, whose rows are shrunk to R on the host).
  kTransferNoPad = 4,
  // Flag or'ed into kTransferBoth: the copy engine already staged my tokens into slots
  // [0, chunks) of my dispatch ring (launch_dispatch_stage_copy, earlier on the stream), so
  // every block pulls and block 0 only publishes those slots (benchmarks/NOTES.md #31).
  kTransferCeStaged = 8,
};

// Where a dispatch reads its rows: x alone (rows of row_bytes: token rows in the Buffer's dtype,
// or packed FP8 rows), or, with two sources, an FP8 pair read in place (megatron_mok/fp8.py): row t is
// row t of x (x_bytes: the FP8 token), then row t of x2 (row_bytes - x_bytes: its scales). Every
// width a multiple of 16, pointers 16-byte aligned (checked by the API). Staged into a ring slot,
// a pair's rows lie as two planes: the chunk's C token rows, then its C scale rows.
struct DispatchSource {
  const void* x;
  const void* x2;  // the second source (null with one source, or on a rank without tokens)
  int row_bytes;
  int x_bytes;     // == row_bytes with one source, < row_bytes with two
  // Decided by the widths, not by x2: a rank without tokens has no pointers, yet its ring tags
  // and reads must use its peers' layout.
  __host__ __device__ bool two_sources() const { return x_bytes < row_bytes; }
};

// Stage the rows into my dispatch ring and pull every task's token into its expert-major rows
// (out_rows: row_bytes each, the received rows in the order of the source's row).
cudaError_t launch_dispatch_transfer(const CommContext& c, const HandleArrays& h,
                                     const TransferArgs& t, const DispatchSource& x, void* out_rows,
                                     cudaStream_t s);

// Copy-engine staging of a dispatch (kTransferCeStaged): a one-block kernel waits until the
// readers of slots [0, chunks) released their previous generation, then the copy engine copies
// x into those slots (no SM moves these bytes). Only when a call fits in the ring.
cudaError_t launch_dispatch_stage_copy(const CommContext& c, const DispatchSource& x, int num_tokens,
                                       cudaStream_t s);
bool dispatch_call_fits_ring(const Workspace& ws);

// Stop this rank after an error of its own: once its peers have read what it published last,
// poison every flag they wait on for it and give up its waits for their releases
// (kernels/stop_rank.cu). One block on `s`.
cudaError_t launch_stop_rank(const CommContext& c, const StopNote& note, cudaStream_t s);
// The stop kernel's attributes on the current device (mok_kernel_arch): fails when the library
// holds no code this device can run.
cudaError_t stop_rank_kernel_attributes(cudaFuncAttributes* a);

// rows x [a row | b row | zeros] into dst rows of dst_bytes (the FP8 dispatch's pack); every
// width a multiple of 16 bytes, a_bytes + b_bytes <= dst_bytes, pointers 16-byte aligned.
cudaError_t launch_pack_rows(void* dst, int64_t dst_bytes, const void* a, int64_t a_bytes, const void* b,
                             int64_t b_bytes, int64_t rows, cudaStream_t s);

// Reduce my rows per task into partials (staged), pull every rank's partials for my tokens.
// hidden: elements per row of expert_out, y and the partials (<= the Buffer's hidden; the ring
// chunk keeps its size, a narrower call uses its first bytes).
cudaError_t launch_combine_transfer(const CommContext& c, const HandleArrays& h,
                                    const TransferArgs& t, const void* expert_out,
                                    const float* grad_probs, void* y, float* grad_w,
                                    int dtype_code, int partial_code, int hidden, cudaStream_t s);

// Whether (kernel, current device) was already allowed at least `smem` bytes of dynamic shared
// memory; `remember` records a grant. A small locked table: the attribute call costs ~1.5 us of
// host time per launch (torch profiler, run s11-3) and its value never shrinks.
// Build switch MOK_CACHE_SMEM_GRANTS=0: ask on every launch, as before #51 (for A/Bs).
#ifndef MOK_CACHE_SMEM_GRANTS
#define MOK_CACHE_SMEM_GRANTS 1
#endif
bool smem_already_allowed(const void* kernel, size_t smem);
void remember_smem_allowed(const void* kernel, size_t smem);

// Lets `kernel` take `smem` bytes of dynamic shared memory: past the default 48 KB a kernel
// must ask for it (up to kMaxDynamicSmem on Hopper) before its launch, once per device.
template <typename Kernel>
inline cudaError_t allow_dynamic_smem(Kernel kernel, size_t smem) {
  if (smem <= 48 * 1024) return cudaSuccess;
  const void* key = reinterpret_cast<const void*>(kernel);
#if MOK_CACHE_SMEM_GRANTS
  if (smem_already_allowed(key, smem)) return cudaSuccess;
#endif
  const cudaError_t e =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  if (e == cudaSuccess) remember_smem_allowed(key, smem);
  return e;
}

// Launches `kernel` on `s`, with programmatic dependent launch when the context asks for it
// (c.pdl): the kernel may then be scheduled before the kernel ahead of it on the stream ends,
// and waits for it in pdl_wait_then_release_dependents (ptx.h), which every kernel calls first.
// CUDA graphs capture the attribute as a programmatic edge.
template <typename... Params, typename... Args>
inline cudaError_t launch_kernel(const CommContext& c, void (*kernel)(Params...), dim3 grid, dim3 block,
                                 size_t smem, cudaStream_t s, const Args&... args) {
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = s;
  cfg.attrs = c.pdl ? &attr : nullptr;
  cfg.numAttrs = c.pdl ? 1 : 0;
  if (cudaError_t e = cudaLaunchKernelEx(&cfg, kernel, static_cast<Params>(args)...)) return e;
  return cudaGetLastError();
}

// dtype codes shared with Python: 0 bf16, 1 fp16, 2 fp32.
enum DtypeCode : int { kBF16 = 0, kFP16 = 1, kFP32 = 2 };

}  // namespace mok

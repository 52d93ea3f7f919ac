// C ABI entry points: check arguments, build the kernel contexts, launch.
#include "api/mok_api.h"

#include <cstring>
#include <mutex>
#include <string>

#include "mok/launch.h"

using namespace mok;

namespace mok {

namespace {
struct SmemGrant {
  const void* kernel;
  int device;
  size_t smem;
};
std::mutex g_smem_mutex;
SmemGrant g_smem_grants[256];
int g_smem_count = 0;
}  // namespace

bool smem_already_allowed(const void* kernel, size_t smem) {
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return false;
  std::lock_guard<std::mutex> lock(g_smem_mutex);
  for (int i = 0; i < g_smem_count; ++i)
    if (g_smem_grants[i].kernel == kernel && g_smem_grants[i].device == dev) return g_smem_grants[i].smem >= smem;
  return false;
}

void remember_smem_allowed(const void* kernel, size_t smem) {
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return;
  std::lock_guard<std::mutex> lock(g_smem_mutex);
  for (int i = 0; i < g_smem_count; ++i) {
    if (g_smem_grants[i].kernel == kernel && g_smem_grants[i].device == dev) {
      if (smem > g_smem_grants[i].smem) g_smem_grants[i].smem = smem;
      return;
    }
  }
  if (g_smem_count < 256) g_smem_grants[g_smem_count++] = SmemGrant{kernel, dev, smem};  // full: ask each time
}

}  // namespace mok

struct MokContext {
  CommContext comm;
  bool peers_set = false;
  int32_t* host_report_dev = nullptr;  // the device's address of the host report (mok_set_host_report)
};

namespace {

thread_local std::string g_last_error;

int fail(const std::string& msg) {
  g_last_error = msg;
  return 1;
}

int check_launch(cudaError_t e, const char* what) {
  if (e != cudaSuccess) return fail(std::string(what) + ": " + cudaGetErrorString(e));
  return 0;
}

int check_ready(const MokContext* ctx) {
  if (ctx == nullptr) return fail("null MokContext");
  if (!ctx->peers_set) return fail("mok_set_peers was not called");
  return 0;
}

// Argument checks and launches of the dispatch steps, shared by the one-step entry points and
// mok_dispatch_launch (which checks every step before launching any).
int check_tokens(const MokContext* ctx, int num_tokens) {
  if (num_tokens < 0 || num_tokens > ctx->comm.ws.cfg.max_tokens)
    return fail("num_tokens outside [0, max_tokens]");
  return 0;
}

// Where a dispatch reads its rows and their size (launch.h, DispatchSource), for every dispatch
// entry point. row_bytes: 0 means the Buffer's token row (hidden x elem_bytes); else a multiple
// of 16 (the copies move 16-byte vectors) that fits the ring's row (FP8 rows). The rows are x's,
// or (two_sources) an FP8 pair read in place, x (hidden bytes per row: the FP8 token) and x2
// (row_bytes - hidden: its scales). The choice is explicit, not x2 != NULL: a rank without
// tokens has no pointers, and its choice must still match its peers' (the layout compares it).
// Pointers of a call with tokens are non-null and 16-byte aligned (a misaligned load would end
// the CUDA context); num_tokens 0 checks the size and the choice only.
int resolve_source(const MokContext* ctx, const void* x, const void* x2, int two_sources, int num_tokens,
                   int row_bytes, DispatchSource* out) {
  const int hidden = ctx->comm.ws.cfg.hidden;
  const int full = hidden * ctx->comm.ws.cfg.elem_bytes;
  if (row_bytes == 0) row_bytes = full;
  if (row_bytes < 16 || row_bytes % 16 != 0 || row_bytes > full)
    return fail("row_bytes must be 0 (the token row) or a multiple of 16 in [16, hidden x elem_bytes]");
  *out = DispatchSource{x, nullptr, row_bytes, row_bytes};
  if (two_sources != 0 && two_sources != 1) return fail("two_sources must be 0 or 1");
  if (two_sources) {
    if (hidden % 16 != 0 || row_bytes <= hidden)
      return fail("a dispatch from two sources needs hidden a multiple of 16 and row_bytes > hidden "
                  "(x: rows of hidden bytes, x2: rows of row_bytes - hidden bytes)");
    out->x2 = x2;
    out->x_bytes = hidden;
  }
  if (num_tokens == 0) return 0;
  const uintptr_t p = reinterpret_cast<uintptr_t>(x), p2 = reinterpret_cast<uintptr_t>(out->x2);
  if (p == 0 || (two_sources && p2 == 0) || (p | p2) % 16 != 0)
    return fail("the dispatch's x (and x2 with two sources) must be non-null and 16-byte aligned");
  return 0;
}

int check_layout(const MokContext* ctx, int num_tokens, int write_report) {
  if (int e = check_tokens(ctx, num_tokens)) return e;
  if (write_report && ctx->host_report_dev == nullptr)
    return fail("mok_dispatch_layout: write_report needs mok_set_host_report first");
  return 0;
}

int check_stage_copy(const MokContext* ctx, int num_tokens) {
  if (int e = check_tokens(ctx, num_tokens)) return e;
  if (!dispatch_call_fits_ring(ctx->comm.ws))
    return fail("copy-engine staging needs a dispatch ring that holds a whole call");
  return 0;
}

int check_transfer(const MokContext* ctx, int num_blocks, int num_producers, int mode) {
  const int roles = mode & ~(kTransferNoPad | kTransferCeStaged);
  const bool ce = (mode & kTransferCeStaged) != 0;
  if (roles != kTransferBoth && roles != kTransferStage && roles != kTransferPull)
    return fail("dispatch transfer mode must be 0 (both roles), 1 (stage) or 2 (pull), "
                "optionally | 4 (no zero padding); | 8 (copy-engine staged) only with 0");
  if (ce && roles != kTransferBoth)
    return fail("dispatch transfer mode 8 (copy-engine staged) only goes with 0 (both roles)");
  if (ce && !dispatch_call_fits_ring(ctx->comm.ws))
    return fail("copy-engine staging needs a dispatch ring that holds a whole call");
  if (roles == kTransferBoth && !ce && (num_producers < 1 || num_blocks <= num_producers))
    return fail("dispatch transfer needs 1 <= num_producers < num_blocks");
  if (num_blocks < 1) return fail("dispatch transfer needs num_blocks >= 1");
  return 0;
}

// rows_per_expert: -1 (off), or N >= 0 with E_local * N rows in 32-bit row indices, a multiple
// of the expert alignment, and no speculation (its verdict sums the peers' unpadded rows).
int check_rows_per_expert(const MokContext* ctx, int64_t rows_per_expert, int64_t spec_cap) {
  if (rows_per_expert == -1) return 0;
  const WorkspaceConfig& cfg = ctx->comm.ws.cfg;
  if (rows_per_expert < 0 || rows_per_expert * cfg.num_local_experts >= (int64_t{1} << 31))
    return fail("rows_per_expert must be -1 or in [0, 2^31 / num_local_experts)");
  if (rows_per_expert % cfg.expert_alignment != 0)
    return fail("rows_per_expert must be a multiple of expert_alignment");
  if (spec_cap >= 0) return fail("rows_per_expert does not go with a speculative layout");
  return 0;
}

// drop_over_cap (a receive budget): 0 or 1, and not for a speculative layout (its verdict
// redoes a short transfer instead of dropping).
int check_drop_over_cap(int drop_over_cap, int64_t spec_cap) {
  if (drop_over_cap != 0 && drop_over_cap != 1) return fail("drop_over_cap must be 0 or 1");
  if (drop_over_cap && spec_cap >= 0) return fail("drop_over_cap does not go with a speculative layout");
  return 0;
}

int layout(MokContext* ctx, void* stream, void* scratch, const void* topk_idx, int idx_is_64,
           const float* topk_weights, int num_tokens, int num_experts, int64_t* tokens_per_expert,
           int64_t row_cap, int64_t spec_cap, int write_report, int64_t rows_per_expert,
           const DispatchSource& rows, int drop_over_cap) {
  HandleArrays h = HandleArrays::make(ctx->comm.ws.cfg, static_cast<char*>(scratch));
  RoutingArgs r{topk_idx, idx_is_64, topk_weights, num_tokens, num_experts, spec_cap,
                row_format(rows.row_bytes, rows.two_sources())};
  RowOutputs out{nullptr, nullptr, nullptr, tokens_per_expert, row_cap, 0,
                 write_report ? ctx->host_report_dev : nullptr, static_cast<int32_t>(rows_per_expert),
                 drop_over_cap};
  return check_launch(launch_dispatch_layout(ctx->comm, h, r, out, static_cast<cudaStream_t>(stream)),
                      "dispatch layout launch");
}

int fill(MokContext* ctx, void* stream, void* scratch, int64_t* src_rank, int64_t* src_token,
         float* probs, int64_t row_cap, int pad) {
  HandleArrays h = HandleArrays::make(ctx->comm.ws.cfg, static_cast<char*>(scratch));
  RoutingArgs r{nullptr, 0, nullptr, 0, 0, -1, 0};
  RowOutputs out{src_rank, src_token, probs, nullptr, row_cap, pad};
  return check_launch(launch_dispatch_fill(ctx->comm, h, r, out, static_cast<cudaStream_t>(stream)),
                      "dispatch fill launch");
}

int stage_copy(MokContext* ctx, void* stream, const DispatchSource& x, int num_tokens) {
  return check_launch(launch_dispatch_stage_copy(ctx->comm, x, num_tokens, static_cast<cudaStream_t>(stream)),
                      "dispatch stage copy");
}

int transfer(MokContext* ctx, void* stream, void* scratch, const DispatchSource& x, int num_tokens,
             void* out_rows, int64_t row_cap, int num_blocks, int num_producers, int mode) {
  if ((mode & kTransferCeStaged) != 0) num_producers = 0;
  HandleArrays h = HandleArrays::make(ctx->comm.ws.cfg, static_cast<char*>(scratch));
  TransferArgs t{num_tokens, num_blocks, num_producers, row_cap, mode};
  return check_launch(launch_dispatch_transfer(ctx->comm, h, t, x, out_rows, static_cast<cudaStream_t>(stream)),
                      "dispatch transfer launch");
}

}  // namespace

extern "C" {

MokContext* mok_create(int world, int rank, int hidden, int elem_bytes, int partial_bytes, int topk,
                       int num_local_experts, int max_tokens, int chunk_tokens, int meta_slots,
                       int64_t disp_ring_chunks, int64_t comb_ring_chunks, int expert_alignment) {
  if (world < 1 || world > kMaxRanks) { fail("world size must be in [1, 64]"); return nullptr; }
  if (rank < 0 || rank >= world) { fail("rank outside [0, world)"); return nullptr; }
  if (topk < 1 || topk > kMaxTopk) { fail("topk must be in [1, 32]"); return nullptr; }
  if (hidden <= 0 || hidden % kCombineVec != 0) { fail("hidden must be a positive multiple of 8"); return nullptr; }
  if (elem_bytes < 1 || static_cast<int64_t>(hidden) * elem_bytes >= kMaxRowBytes) {
    fail("a token row (hidden x elem_bytes) must be under 8 MiB");
    return nullptr;
  }
  if (chunk_tokens < 1 || meta_slots < 1 || disp_ring_chunks < 1 || comb_ring_chunks < 1) {
    fail("chunk_tokens, meta_slots and both ring sizes must be >= 1");
    return nullptr;
  }
  if (expert_alignment < 1 || expert_alignment > kMaxExpertAlignment) {
    fail("expert_alignment must be in [1, 1024]");
    return nullptr;
  }
  if (num_local_experts < 1) { fail("num_local_experts must be >= 1"); return nullptr; }
  // A chunk's routing tables live in one block's shared memory (the layout's and the fill's).
  if (routing_smem_bytes(num_local_experts, chunk_tokens, topk) > kMaxDynamicSmem) {
    int most = 0;  // the largest chunk that fits with these experts and topk (0: none)
    while (routing_smem_bytes(num_local_experts, most + 1, topk) <= kMaxDynamicSmem) ++most;
    const std::string need = "chunk_tokens " + std::to_string(chunk_tokens) + " with topk " +
                             std::to_string(topk) + " and " + std::to_string(num_local_experts) +
                             " local experts needs " +
                             std::to_string(routing_smem_bytes(num_local_experts, chunk_tokens, topk)) +
                             " bytes of shared memory in the routing kernels, over the " +
                             std::to_string(kMaxDynamicSmem) + " a block can have: ";
    if (most > 0)
      fail(need + "at most " + std::to_string(most) + " tokens per chunk here (MOK_CHUNK_TOKENS)");
    else  // the experts' tables alone fill it: no chunk size helps
      fail(need + "no chunk fits beside the tables of " + std::to_string(num_local_experts) +
           " local experts; use fewer experts per rank (a larger expert-parallel group)");
    return nullptr;
  }
  auto* ctx = new MokContext();
  WorkspaceConfig cfg{};
  cfg.world_size = world;
  cfg.rank = rank;
  cfg.hidden = hidden;
  cfg.elem_bytes = elem_bytes;
  cfg.partial_bytes = partial_bytes;
  cfg.topk = topk;
  cfg.num_local_experts = num_local_experts;
  cfg.max_tokens = max_tokens;
  cfg.chunk_tokens = chunk_tokens;
  cfg.meta_slots = meta_slots;
  cfg.disp_ring_chunks = disp_ring_chunks;
  cfg.comb_ring_chunks = comb_ring_chunks;
  cfg.expert_alignment = expert_alignment;
  ctx->comm.ws = Workspace::make(cfg);
  ctx->comm.rank = rank;
  ctx->comm.world = world;
  ctx->comm.pdl = 0;
  return ctx;
}

void mok_destroy(MokContext* ctx) { delete ctx; }

int mok_set_host_report(MokContext* ctx, void* host_report) {
  if (ctx == nullptr) return fail("null MokContext");
  void* d = nullptr;
  if (host_report == nullptr) return fail("mok_set_host_report: null pointer");
  if (cudaError_t e = cudaHostGetDevicePointer(&d, host_report, 0))
    return fail(std::string("mok_set_host_report: not mapped, pinned host memory: ") + cudaGetErrorString(e));
  ctx->host_report_dev = static_cast<int32_t*>(d);
  return 0;
}

int mok_set_pdl(MokContext* ctx, int on) {
  if (ctx == nullptr) return fail("null MokContext");
  ctx->comm.pdl = on != 0 ? 1 : 0;
  return 0;
}

int mok_pdl(const MokContext* ctx) { return ctx != nullptr && ctx->comm.pdl != 0 ? 1 : 0; }

size_t mok_workspace_bytes(const MokContext* ctx) { return ctx->comm.ws.total_bytes; }

size_t mok_handle_scratch_bytes(const MokContext* ctx) {
  return HandleArrays::make(ctx->comm.ws.cfg, nullptr).total_bytes;
}

size_t mok_error_offset(const MokContext* ctx) { return ctx->comm.ws.error; }

size_t mok_trace_offset(const MokContext* ctx) { return ctx->comm.ws.trace; }

size_t mok_handle_totals_offset(const MokContext* ctx) {
  const HandleArrays h = HandleArrays::make(ctx->comm.ws.cfg, nullptr);
  return reinterpret_cast<size_t>(h.totals);
}

int mok_set_peers(MokContext* ctx, const uint64_t* peer_bases, int n, double timeout_s) {
  if (ctx == nullptr) return fail("null MokContext");
  if (n != ctx->comm.world) return fail("mok_set_peers: need one base pointer per rank");
  for (int i = 0; i < n; ++i) {
    if (peer_bases[i] == 0) return fail("mok_set_peers: null peer pointer");
    ctx->comm.peers.base[i] = reinterpret_cast<char*>(peer_bases[i]);
  }
  ctx->comm.timeout_ns = static_cast<uint64_t>(timeout_s * 1e9);
  ctx->peers_set = true;
  return 0;
}

int mok_dispatch_layout(MokContext* ctx, void* stream, void* scratch, const void* topk_idx,
                        int idx_is_64, const float* topk_weights, int num_tokens, int num_experts,
                        int64_t* tokens_per_expert, int64_t row_cap, int64_t spec_cap,
                        int write_report, int64_t rows_per_expert, int row_bytes, int two_sources,
                        int drop_over_cap) {
  if (int e = check_ready(ctx)) return e;
  if (int e = check_layout(ctx, num_tokens, write_report)) return e;
  if (int e = check_rows_per_expert(ctx, rows_per_expert, spec_cap)) return e;
  if (int e = check_drop_over_cap(drop_over_cap, spec_cap)) return e;
  DispatchSource src;  // the size and the choice only: the layout reads no rows
  if (int e = resolve_source(ctx, nullptr, nullptr, two_sources, 0, row_bytes, &src)) return e;
  return layout(ctx, stream, scratch, topk_idx, idx_is_64, topk_weights, num_tokens, num_experts,
                tokens_per_expert, row_cap, spec_cap, write_report, rows_per_expert, src, drop_over_cap);
}

int mok_dispatch_fill(MokContext* ctx, void* stream, void* scratch,
                      int64_t* src_rank, int64_t* src_token, float* probs, int64_t row_cap,
                      int pad) {
  if (int e = check_ready(ctx)) return e;
  return fill(ctx, stream, scratch, src_rank, src_token, probs, row_cap, pad);
}

int mok_dispatch_transfer(MokContext* ctx, void* stream, void* scratch, const void* x, const void* x2,
                          int num_tokens, void* out_rows, int64_t row_cap,
                          int num_blocks, int num_producers, int mode, int row_bytes, int two_sources) {
  if (int e = check_ready(ctx)) return e;
  if (int e = check_transfer(ctx, num_blocks, num_producers, mode)) return e;
  DispatchSource src;
  if (int e = resolve_source(ctx, x, x2, two_sources, num_tokens, row_bytes, &src)) return e;
  return transfer(ctx, stream, scratch, src, num_tokens, out_rows, row_cap, num_blocks, num_producers, mode);
}

int mok_dispatch_stage_copy(MokContext* ctx, void* stream, const void* x, const void* x2, int num_tokens,
                            int row_bytes, int two_sources) {
  if (int e = check_ready(ctx)) return e;
  if (int e = check_stage_copy(ctx, num_tokens)) return e;
  DispatchSource src;
  if (int e = resolve_source(ctx, x, x2, two_sources, num_tokens, row_bytes, &src)) return e;
  return stage_copy(ctx, stream, src, num_tokens);
}

int mok_dispatch_launch(MokContext* ctx, void* stream, int steps, void* scratch,
                        const void* topk_idx, int idx_is_64, const float* topk_weights,
                        int num_tokens, int num_experts, int64_t* tokens_per_expert,
                        int64_t* src_rank, int64_t* src_token, float* probs, int pad,
                        const void* x, const void* x2, void* out_rows, int64_t row_cap,
                        int num_blocks, int num_producers, int transfer_mode,
                        int64_t rows_per_expert, int row_bytes, int two_sources, int drop_over_cap) {
  if (int e = check_ready(ctx)) return e;
  if (steps <= 0 || (steps & ~(MOK_STEP_LAYOUT | MOK_STEP_FILL | MOK_STEP_STAGE_COPY | MOK_STEP_TRANSFER)) != 0)
    return fail("mok_dispatch_launch: steps must be a non-empty or of MOK_STEP_* flags");
  // Every check first: a call that fails launches nothing (a half-launched call would leave
  // this rank's ring out of step with its peers').
  if (steps & MOK_STEP_LAYOUT) {
    if (int e = check_layout(ctx, num_tokens, 0)) return e;
    if (int e = check_rows_per_expert(ctx, rows_per_expert, -1)) return e;
    if (int e = check_drop_over_cap(drop_over_cap, -1)) return e;
  }
  if (steps & MOK_STEP_STAGE_COPY)
    if (int e = check_stage_copy(ctx, num_tokens)) return e;
  if (steps & MOK_STEP_TRANSFER)
    if (int e = check_transfer(ctx, num_blocks, num_producers, transfer_mode)) return e;
  // The rows' pointers matter only to the steps that read them.
  const bool reads_rows = (steps & (MOK_STEP_STAGE_COPY | MOK_STEP_TRANSFER)) != 0;
  DispatchSource src;
  if (int e = resolve_source(ctx, x, x2, two_sources, reads_rows ? num_tokens : 0, row_bytes, &src)) return e;
  if (steps & MOK_STEP_LAYOUT)
    if (int e = layout(ctx, stream, scratch, topk_idx, idx_is_64, topk_weights, num_tokens, num_experts,
                       tokens_per_expert, row_cap, -1, 0, rows_per_expert, src, drop_over_cap))
      return e;
  if (steps & MOK_STEP_FILL)
    if (int e = fill(ctx, stream, scratch, src_rank, src_token, probs, row_cap, pad)) return e;
  // A world of one rank has no readers of its ring: nothing to copy (every block still pulls).
  if ((steps & MOK_STEP_STAGE_COPY) && ctx->comm.world > 1)
    if (int e = stage_copy(ctx, stream, src, num_tokens)) return e;
  if (steps & MOK_STEP_TRANSFER)
    return transfer(ctx, stream, scratch, src, num_tokens, out_rows, row_cap, num_blocks, num_producers,
                    transfer_mode);
  return 0;
}

int mok_dispatch_ce_stage_supported(const MokContext* ctx) {
  return ctx != nullptr && dispatch_call_fits_ring(ctx->comm.ws) ? 1 : 0;
}

int mok_combine(MokContext* ctx, void* stream, void* scratch, const void* expert_out,
                const float* grad_probs, int num_tokens, void* y, float* grad_w,
                int64_t row_cap, int dtype_code, int partial_code, int num_blocks,
                int num_producers, int hidden) {
  if (int e = check_ready(ctx)) return e;
  if (num_producers < 1 || num_blocks <= num_producers)
    return fail("combine needs 1 <= num_producers < num_blocks");
  if (hidden == 0) hidden = ctx->comm.ws.cfg.hidden;
  if (hidden < kCombineVec || hidden % kCombineVec != 0 || hidden > ctx->comm.ws.cfg.hidden)
    return fail("combine hidden must be 0 (the Buffer's hidden) or a multiple of 8 in [8, hidden]");
  if (partial_code != dtype_code && partial_code != kFP32)
    return fail("the combine partial dtype must be the token dtype or float32");
  // As the dispatch's rows (resolve_source): a misaligned vector load would end the CUDA context.
  const uintptr_t eo = reinterpret_cast<uintptr_t>(expert_out), yp = reinterpret_cast<uintptr_t>(y);
  if ((row_cap > 0 && (eo == 0 || eo % 16 != 0)) || (num_tokens > 0 && (yp == 0 || yp % 16 != 0)))
    return fail("the combine's expert_out and y must be non-null and 16-byte aligned");
  HandleArrays h = HandleArrays::make(ctx->comm.ws.cfg, static_cast<char*>(scratch));
  TransferArgs t{num_tokens, num_blocks, num_producers, row_cap, kTransferBoth};
  return check_launch(launch_combine_transfer(ctx->comm, h, t, expert_out, grad_probs, y, grad_w,
                                              dtype_code, partial_code, hidden,
                                              static_cast<cudaStream_t>(stream)),
                      "combine launch");
}

int mok_layout_fused(const MokContext* ctx, int speculative) {
  if (ctx == nullptr) return 0;
  return layout_is_fused(ctx->comm.ws.cfg, speculative != 0) ? 1 : 0;
}

int mok_stop_rank(MokContext* ctx, void* stream, const char* reason, int reason_bytes, int origin) {
  if (int e = check_ready(ctx)) return e;
  if (reason_bytes < 0 || reason_bytes > kStopNoteBytes || (reason_bytes > 0 && reason == nullptr))
    return fail("mok_stop_rank: reason_bytes must be in [0, " + std::to_string(kStopNoteBytes) +
                "] with a reason, got " + std::to_string(reason_bytes));
  if (origin < 0 || origin >= ctx->comm.world)
    return fail("mok_stop_rank: origin " + std::to_string(origin) + " outside [0, " +
                std::to_string(ctx->comm.world) + ")");
  StopNote note{};
  note.length_plus_one = 1 + reason_bytes;
  note.origin = origin;
  if (reason_bytes > 0) std::memcpy(note.text, reason, reason_bytes);
  return check_launch(launch_stop_rank(ctx->comm, note, static_cast<cudaStream_t>(stream)),
                      "stop_rank launch");
}

int mok_read_stop_note(const MokContext* ctx, int peer, void* stream, char* text, int* length,
                       int* origin) {
  if (int e = check_ready(ctx)) return e;
  if (peer < 0 || peer >= ctx->comm.world || text == nullptr || length == nullptr || origin == nullptr)
    return fail("mok_read_stop_note: peer " + std::to_string(peer) + " outside [0, " +
                std::to_string(ctx->comm.world) + ") or a null output");
  // A copy on the caller's stream (a loopback rank's own: the legacy stream would wait for the
  // other ranks' kernels), from the peer's workspace through its peer pointer.
  StopNote note{};
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  const char* src = ctx->comm.peers.base[peer] + ctx->comm.ws.stop_note;
  if (int e = check_launch(cudaMemcpyAsync(&note, src, sizeof(note), cudaMemcpyDefault, s), "stop note copy"))
    return e;
  if (int e = check_launch(cudaStreamSynchronize(s), "stop note copy")) return e;
  const int n = note.length_plus_one - 1;
  if (n > kStopNoteBytes) return fail("mok_read_stop_note: peer " + std::to_string(peer) +
                                      "'s note claims " + std::to_string(n) + " bytes");
  if (n >= 0 && (note.origin < 0 || note.origin >= ctx->comm.world))
    return fail("mok_read_stop_note: peer " + std::to_string(peer) + "'s note names rank " +
                std::to_string(note.origin));
  *length = n < 0 ? -1 : n;
  *origin = n < 0 ? -1 : note.origin;
  if (n > 0) std::memcpy(text, note.text, n);
  return 0;
}

int mok_pack_rows(void* stream, void* dst, int64_t dst_bytes, const void* a, int64_t a_bytes,
                  const void* b, int64_t b_bytes, int64_t rows) {
  auto aligned = [](const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; };
  if (rows < 0) return fail("mok_pack_rows: rows < 0");
  if (a_bytes < 0 || b_bytes < 0 || a_bytes % 16 || b_bytes % 16 || dst_bytes % 16 || a_bytes + b_bytes > dst_bytes ||
      dst_bytes / 16 > (int64_t{1} << 30))
    return fail("mok_pack_rows: widths must be multiples of 16 with a_bytes + b_bytes <= dst_bytes");
  if (rows > 0 && (!aligned(dst) || !aligned(a) || !aligned(b) || dst == nullptr || (a_bytes && a == nullptr) ||
                   (b_bytes && b == nullptr)))
    return fail("mok_pack_rows: pointers must be non-null and 16-byte aligned");
  return check_launch(launch_pack_rows(dst, dst_bytes, a, a_bytes, b, b_bytes, rows, static_cast<cudaStream_t>(stream)),
                      "mok_pack_rows launch");
}

const char* mok_last_error(void) { return g_last_error.c_str(); }

int mok_abi_version(void) { return MOK_ABI_VERSION; }

int mok_kernel_arch(int device) {
  int prev = -1;
  if (cudaGetDevice(&prev) != cudaSuccess || cudaSetDevice(device) != cudaSuccess) {
    cudaGetLastError();
    fail("mok_kernel_arch: device " + std::to_string(device) + " cannot be selected");
    return -1;
  }
  cudaFuncAttributes a{};
  const cudaError_t e = mok::stop_rank_kernel_attributes(&a);
  cudaSetDevice(prev);
  if (e != cudaSuccess) {
    cudaGetLastError();  // clear it: a later launch must not report this one
    fail(std::string("mok_kernel_arch: no code for device ") + std::to_string(device) + ": " +
         cudaGetErrorString(e));
    return -1;
  }
  return a.binaryVersion;
}

int mok_sm_count(int device) {
  int n = 0;
  if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) return -1;
  return n;
}

void* mok_stream_create(int device) {
  int prev = 0;
  if (cudaGetDevice(&prev) != cudaSuccess || cudaSetDevice(device) != cudaSuccess) {
    fail("cudaSetDevice failed");
    return nullptr;
  }
  cudaStream_t s = nullptr;
  const cudaError_t e = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  cudaSetDevice(prev);
  if (e != cudaSuccess) {
    fail(std::string("cudaStreamCreateWithFlags: ") + cudaGetErrorString(e));
    return nullptr;
  }
  return s;
}

}  // extern "C"

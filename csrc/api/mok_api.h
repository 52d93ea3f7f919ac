/* The C ABI of libmok_cuda.so (loaded by megatron_mok/cuda/library.py through ctypes).
 * Plain C types only: no torch headers, so one build serves every torch version.
 * Every int-returning call returns 0 on success, else non-zero with mok_last_error() set.
 * All tensor pointers are device pointers; `stream` is a cudaStream_t. */
#pragma once
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct MokContext MokContext;

/* Bumped whenever a signature below changes; megatron_mok/cuda/bindings.py refuses a library
 * of another version (a stale build would otherwise take the new arguments wrongly). */
#define MOK_ABI_VERSION 20
int mok_abi_version(void);

/* expert_alignment >= 1: each local expert's rows are followed by zero rows (no source, prob 0)
 * up to a multiple of it; R and tokens_per_expert count them (1: no padding). */
MokContext* mok_create(int world, int rank, int hidden, int elem_bytes, int partial_bytes, int topk,
                       int num_local_experts, int max_tokens, int chunk_tokens, int meta_slots,
                       int64_t disp_ring_chunks, int64_t comb_ring_chunks, int expert_alignment);
void mok_destroy(MokContext* ctx);
size_t mok_workspace_bytes(const MokContext* ctx);
size_t mok_handle_scratch_bytes(const MokContext* ctx);
size_t mok_error_offset(const MokContext* ctx);
size_t mok_handle_totals_offset(const MokContext* ctx);
size_t mok_trace_offset(const MokContext* ctx);
int mok_set_peers(MokContext* ctx, const uint64_t* peer_bases, int n, double timeout_s);
/* The eager dispatch's host report: 12 int32 of pinned host memory that the
 * caller owns and keeps alive (the device must be able to map it: cudaHostAlloc'd memory is,
 * under unified addressing). A mok_dispatch_layout with write_report = 1 makes its scan kernel
 * write there, at its end: R, tasks, the speculative verdict, 0, then the first 8 int32 of this
 * rank's error report. The host reads it after an event recorded behind the layout: no copy
 * is queued. */
int mok_set_host_report(MokContext* ctx, void* host_report);

/* spec_cap >= 0: a speculative eager dispatch allocated spec_cap rows before reading R; it is
 * published with the routing, and the scan sets totals[2] when ANY rank's rows exceed its
 * capacity (the same verdict on every rank). -1: not speculative.
 * rows_per_expert N >= 0: every local expert gets exactly N rows, its received rows then zero
 * rows (R = E_local * N; a multiple of expert_alignment; not speculative). An expert with more
 * than N rows: the rows past N are dropped (not written, not combined) and the error report
 * says so (code 6, a data error: the protocol goes on). -1: rows as received (or aligned).
 * tokens_per_expert [E_local + 2]: the rows of each local expert, then R, counting only rows
 * below row_cap: with more rows than row_cap (static shape: code 3 in the error report) the
 * counts are of the rows written, and sum to row_cap; then the rows received (row_cap or
 * fewer, or more with an overflow).
 * drop_over_cap 1: rows past row_cap are dropped without an error (a receive budget,
 * Buffer.dispatch(recv_budget=); the caller compares tokens_per_expert[E_local + 1] with
 * row_cap); 0: they are error 3. Not with spec_cap >= 0. */
int mok_dispatch_layout(MokContext* ctx, void* stream, void* scratch, const void* topk_idx,
                        int idx_is_64, const float* topk_weights, int num_tokens, int num_experts,
                        int64_t* tokens_per_expert, int64_t row_cap, int64_t spec_cap,
                        int write_report, int64_t rows_per_expert, int row_bytes, int two_sources,
                        int drop_over_cap);
/* Per-row outputs [row_cap]. pad 1: rows [R, row_cap) are written as "no source" (static
 * shape); pad 0: only rows < R are written (an eager dispatch passes a bound on R, so that
 * the fill can run before the host has read R). */
int mok_dispatch_fill(MokContext* ctx, void* stream, void* scratch,
                      int64_t* src_rank, int64_t* src_token, float* probs, int64_t row_cap,
                      int pad);
/* row_bytes (layout, transfer, stage copy, launch): bytes of one row of out_rows; 0 = the
 * Buffer's token row (hidden x elem_bytes), else a multiple of 16 no larger (the FP8 dispatch's
 * rows: the FP8 token, its scales, padding; megatron_mok/fp8.py).
 * two_sources (layout, transfer, stage copy, launch): 0, the rows are x's (rows of row_bytes; x2
 * unused); 1, an FP8 pair read in place, no pack: row t is x's row t (hidden bytes, the FP8
 * token) then x2's row t (row_bytes - hidden bytes, its scales); hidden a multiple of 16,
 * row_bytes > hidden. A rank without tokens passes the same choice as its peers (its pointers
 * may be NULL). With num_tokens > 0, x (and x2) are non-null and 16-byte aligned (else an
 * error, nothing launched).
 * Every rank of a group passes the same row_bytes and the same choice of one source or two in a
 * call (a peer's ring rows are read at this pitch and layout): the layout publishes both with the
 * routing and a rank whose peer's differ reports a configuration mismatch (error 5, detail the
 * peer's row format: size / 16, | 1 << 19 for two sources); the transfer checks them again for
 * every chunk it pulls (each dispatch ring slot is published with the format it was staged in),
 * which covers cached dispatches too.
 * mode 0: one kernel, num_producers blocks stage and the rest pull; 1: every block stages
 * (out_rows unused); 2: every block pulls; | 4: rows [R, row_cap) are not zeroed;
 * 0 | 8: mok_dispatch_stage_copy staged x earlier on the stream, every block pulls
 * (num_producers is ignored). With MOK_EAGER_STAGE_FIRST=1 an eager dispatch
 * launches 1 on a side stream before reading R, then 2 once the rows are allocated
 * (megatron_mok/cuda/backend.py); otherwise every dispatch uses 0. */
int mok_dispatch_transfer(MokContext* ctx, void* stream, void* scratch, const void* x, const void* x2,
                          int num_tokens, void* out_rows, int64_t row_cap,
                          int num_blocks, int num_producers, int mode, int row_bytes, int two_sources);
/* Copy-engine staging (mode 8 above): a one-block kernel waits for the readers of my dispatch
 * ring slots [0, ceil(num_tokens / chunk_tokens)) to release them, then the copy engine copies
 * x there. Only for a ring that holds a whole call (mok_dispatch_ce_stage_supported). Every
 * rank of a group must use it for every dispatch or for none (the slots are fixed with it). */
int mok_dispatch_stage_copy(MokContext* ctx, void* stream, const void* x, const void* x2, int num_tokens,
                            int row_bytes, int two_sources);
int mok_dispatch_ce_stage_supported(const MokContext* ctx);
/* Several steps of one dispatch queued by one call (benchmarks/NOTES.md #51): the steps or'ed
 * in `steps` run in the order layout, fill, copy-engine staging, transfer, each exactly as the
 * one-step function above with the same-named arguments (the layout with spec_cap = -1 and
 * write_report = 0, i.e. as a static-shape or fill-after-read dispatch; row_cap is the layout's,
 * the fill's and the transfer's). Every step's arguments are checked before the first launch,
 * so a call that fails launches nothing. Staging in a world of one rank copies nothing (no
 * peer reads the ring). The backend queues a static-shape dispatch (all four steps), the
 * second half of an eager one (fill and transfer: its staging was queued before the host read
 * of R) and a staged cached one (staging, transfer) with one host crossing each. */
#define MOK_STEP_LAYOUT 1
#define MOK_STEP_FILL 2
#define MOK_STEP_STAGE_COPY 4
#define MOK_STEP_TRANSFER 8
int mok_dispatch_launch(MokContext* ctx, void* stream, int steps, void* scratch,
                        const void* topk_idx, int idx_is_64, const float* topk_weights,
                        int num_tokens, int num_experts, int64_t* tokens_per_expert,
                        int64_t* src_rank, int64_t* src_token, float* probs, int pad,
                        const void* x, const void* x2, void* out_rows, int64_t row_cap,
                        int num_blocks, int num_producers, int transfer_mode,
                        int64_t rows_per_expert, int row_bytes, int two_sources, int drop_over_cap);
/* 1 when mok_dispatch_layout runs publish, count and scan as one kernel (small layouts: at most
 * MOK_LAYOUT_FUSED_MAX_GROUPS, default 8192, (local expert, source, chunk) groups; not for
 * speculative calls, spec_cap >= 0; never with MOK_LAYOUT_FUSED=0), 0 when as three. Reads the
 * environment now, as the launch does. */
int mok_layout_fused(const MokContext* ctx, int speculative);
/* Programmatic dependent launch of this context's kernels (benchmarks/NOTES.md #48): on = 1 lets
 * each kernel be scheduled while the one before it on the stream runs (it waits for it on the
 * device); 0 (the default of mok_create) launches plainly. Returns 0; mok_pdl reads it back. */
int mok_set_pdl(MokContext* ctx, int on);
int mok_pdl(const MokContext* ctx);
/* hidden (elements of expert_out's and y's rows): 0 = the Buffer's hidden; else a multiple of 8
 * no larger. Every rank of a group passes the same in a call (partials are read at this pitch).
 * A narrow call carries the prob gradients with next to no row data: the FP8 dispatch's
 * backward, whose tokens have no gradient, runs it with hidden = 8 and zero rows.
 * expert_out (with row_cap > 0 rows) and y (with num_tokens > 0) are non-null and 16-byte
 * aligned: the kernels move 16-byte vectors (refused before any launch otherwise). */
int mok_combine(MokContext* ctx, void* stream, void* scratch, const void* expert_out,
                const float* grad_probs, int num_tokens, void* y, float* grad_w,
                int64_t row_cap, int dtype_code, int partial_code, int num_blocks,
                int num_producers, int hidden);

/* The FP8 pack (megatron_mok/fp8.py: fp8.pack; a dispatch reads a pair whose widths allow it in place
 * from two sources, two_sources above): row r of dst (dst_bytes) = row r of a (a_bytes),
 * then row r of b (b_bytes), then zeros; rows rows, one kernel on `stream`. Every width a
 * multiple of 16, a_bytes + b_bytes <= dst_bytes, every pointer 16-byte aligned (else an error,
 * nothing launched). Needs no context. */
int mok_pack_rows(void* stream, void* dst, int64_t dst_bytes, const void* a, int64_t a_bytes,
                  const void* b, int64_t b_bytes, int64_t rows);

/* Stop this rank after an error of its own (the host raised in a dispatch or combine of this
 * rank, or a device error was read): one kernel on `stream` first waits (with the timeout)
 * until the peers have read what this rank published last (each routing slot's latest call,
 * each ring slot's latest generation: a call that completed on this rank completes on them),
 * then marks this rank's error report aborted (code 4), leaves `reason` (reason_bytes of UTF-8,
 * at most 240) and `origin` (the rank whose own error it was: this rank, or the first rank of a
 * chain of stops, whose note this rank passes on) in its workspace for the peers' messages
 * (mok_read_stop_note), poisons every flag its peers wait on for it (its routing slots, its
 * dispatch and combine ring slots) and sets its releases in every peer to their end, so that
 * peers inside the next call raise at once, naming this rank (code 7), instead of timing out.
 * The context cannot be used for communication afterwards, on any rank. */
int mok_stop_rank(MokContext* ctx, void* stream, const char* reason, int reason_bytes, int origin);
/* Why peer `peer` stopped (mok_stop_rank's reason and origin, which its kernel left in its
 * workspace before its poison): up to 240 bytes of UTF-8 into `text` (not terminated), their
 * count into `*length` and the origin rank into `*origin`, both -1 when the peer left no note
 * (it has not stopped). Read after this rank's kernels reported that peer stopped (code 7): a
 * copy on `stream`, waited for. */
int mok_read_stop_note(const MokContext* ctx, int peer, void* stream, char* text, int* length,
                       int* origin);
const char* mok_last_error(void);
int mok_sm_count(int device);
/* The architecture of the library's code that `device` runs (cudaFuncAttributes::binaryVersion of
 * one of its kernels, e.g. 90 for sm_90a), or -1 when the library holds none this device can run
 * (built for another GPU: mok_last_error says which device); asked before any workspace is made,
 * so an unsupported GPU is refused with a message instead of failing at its first launch. */
int mok_kernel_arch(int device);
/* A new CUDA stream (non-blocking) on `device`, or NULL. For loopback ranks (threads of one
 * process on one GPU): torch's stream pool hands its streams out round robin, so two ranks
 * could get the same stream and serialise kernels that wait for each other. Never destroyed
 * (megatron_mok/loopback.py reuses them). */
void* mok_stream_create(int device);

#ifdef __cplusplus
}
#endif

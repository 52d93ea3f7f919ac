// Launch constants and limits of the MoK kernels: the only place numbers like these live.
#pragma once

#include <cstddef>
#include <cstdint>

namespace mok {

// Threads of a layout block (count/fill kernels) and of the one-block scan kernels.
constexpr int kLayoutThreads = 256;
// The copy-engine staging's slot check (one small block, so it fits beside any other kernel).
constexpr int kStageAcquireThreads = 128;
constexpr int kScanThreads = 1024;
// Threads of a fill block: one (token, k) slot per thread, so the default chunk (64 tokens x
// top-8) is one pass; larger chunks take several.
constexpr int kFillThreads = 512;
// Threads of a combine block: 16 warps at up to 128 registers per lane (fp32 accumulators
// plus 2-4 rows x 2 groups of loads in flight); the SM-ceiling microbenchmark's reduction
// reached ~73 GB/s per SM with this shape (benchmarks/NOTES.md #8).
constexpr int kCombineThreads = 512;
constexpr int kWarpSize = 32;
// 16-byte vectors per lane in flight in the copy loops (MOK_BRIEF: >= 4 independent loads).
// Experiment builds may set MOK_COPY_UNROLL (benchmarks/NOTES.md, next experiments after
// session 8, item 1: is the 2-GPU pull bound by its loads in flight?).
#ifndef MOK_COPY_UNROLL
#define MOK_COPY_UNROLL 6
#endif
constexpr int kCopyUnroll = MOK_COPY_UNROLL;
// Elements per lane per step in the combine loops: one 16-byte bf16 vector.
constexpr int kCombineVec = 8;
// Bits of a dispatch ring slot's ready value that carry the staged rows' format (ring.h,
// dispatch_ready), the same value the layout publishes with the routing: the row's size in
// 16-byte vectors, or'ed with kRowTwoSources when the rows come from two sources (an FP8 pair's
// token rows and scale rows, staged as two planes). A token row is under 16 << (kRowTagBits - 1)
// bytes (8 MiB).
constexpr int kRowTagBits = 20;
constexpr int32_t kRowTwoSources = 1 << (kRowTagBits - 1);
constexpr int64_t kMaxRowBytes = 16ll << (kRowTagBits - 1);
// A dispatch's row format (see kRowTagBits): every rank of a call must pass the same.
__host__ __device__ constexpr int32_t row_format(int row_bytes, bool two_sources) {
  return row_bytes / 16 | (two_sources ? kRowTwoSources : 0);
}
// 8-element groups per lane in flight in the combine loops (one step of a task or token).
constexpr int kCombineUnroll = 2;
// The same for the combine's consume loop alone (a piece of its shared-memory row stream).
// Experiment builds may set MOK_CONSUME_UNROLL (benchmarks/NOTES.md, next experiment (A):
// 1 measured slower than 2, run s7-1).
#ifndef MOK_CONSUME_UNROLL
#define MOK_CONSUME_UNROLL 2
#endif
constexpr int kConsumeUnroll = MOK_CONSUME_UNROLL;
// Threads of a dispatch block: 32 warps, 4 loads in flight each (MOK_BRIEF section 3).
// Experiment builds may set MOK_DISPATCH_THREADS (with MOK_COPY_UNROLL: fewer, fuller warps).
#ifndef MOK_DISPATCH_THREADS
#define MOK_DISPATCH_THREADS 1024
#endif
constexpr int kDispatchThreads = MOK_DISPATCH_THREADS;
// Diagnostic builds may set MOK_DISPATCH_CLOCKS=1: the dispatch transfer's pulling warps sum
// their cycles by kind (task setup, waiting for local / NVLink loads, issuing stores) into the
// last rows of the trace region (benchmarks/NOTES.md, next experiments after session 8, item 1).
// Off (0) in every normal build: the code is compiled out.
#ifndef MOK_DISPATCH_CLOCKS
#define MOK_DISPATCH_CLOCKS 0
#endif
constexpr bool kDispatchClocks = MOK_DISPATCH_CLOCKS != 0;
// Diagnostic builds may set MOK_CONSUME_CLOCKS=1: the combine's consume loop sums, per warp, its
// cycles by kind (ConsumeClock in device.h) into the last rows of the trace region
// (benchmarks/NOTES.md, next experiments after session 9, item 3). Compiled out otherwise.
#ifndef MOK_CONSUME_CLOCKS
#define MOK_CONSUME_CLOCKS 0
#endif
constexpr bool kConsumeClocks = MOK_CONSUME_CLOCKS != 0;
// Diagnostic builds may set MOK_LAYOUT_STAMPS=1: thread 0 of every layout and fill block writes
// the globaltimer at each step's end into the trace region (layout_stamp in device.h; read by
// scripts/profile_layout_stamps.py). Compiled out otherwise.
#ifndef MOK_LAYOUT_STAMPS
#define MOK_LAYOUT_STAMPS 0
#endif
constexpr bool kLayoutStamps = MOK_LAYOUT_STAMPS != 0;
// Stamps per block; the trace region's 512 words hold 16 blocks of each kernel kind.
constexpr int kStampsPerBlock = 16;
// Diagnostic builds only, never for results: MOK_DISPATCH_DIAG_LOCAL_SRC=1 makes the dispatch
// pull read remote tasks' rows from the same slot of the local ring (wrong data, same protocol)
// to time the pull without NVLink (benchmarks/NOTES.md, next experiments after session 8).
#ifndef MOK_DISPATCH_DIAG_LOCAL_SRC
#define MOK_DISPATCH_DIAG_LOCAL_SRC 0
#endif
constexpr bool kDispatchDiagLocalSrc = MOK_DISPATCH_DIAG_LOCAL_SRC != 0;
// Dynamic shared memory a block may ask for on Hopper (227 KB), less 1 KB for static use.
constexpr size_t kMaxDynamicSmem = 226 * 1024;
// Largest world size: reader sets are 64-bit masks.
constexpr int kMaxRanks = 64;
// Largest topk a task can carry (rows of one token on one rank).
constexpr int kMaxTopk = 32;
// Largest expert_alignment (FP8 grouped GEMMs ask for 16-256 rows).
constexpr int kMaxExpertAlignment = 1024;
// Bytes of reason text a rank that stops leaves for its peers (workspace.h StopNote; the
// reference backend's status record carries as many: megatron_mok/comm.py).
constexpr int kStopNoteBytes = 240;
// Spin loops read the clock only every this many polls.
constexpr int kPollsPerClockRead = 16;
// Sleep between polls of a flag: doubles from the first to the second value.
constexpr unsigned kPollSleepMinNs = 32;
// (a build may set MOK_POLL_SLEEP_MAX_NS for an A/B: NOTES (FF))
#ifndef MOK_POLL_SLEEP_MAX_NS
#define MOK_POLL_SLEEP_MAX_NS 1024
#endif
constexpr unsigned kPollSleepMaxNs = MOK_POLL_SLEEP_MAX_NS;
// 1: a spin-wait's polls after the first are relaxed loads and only the poll that sees the
// target is followed by an acquire (one L1 invalidation per wait, not one per poll: the
// memory-ordering review's B4, NOTES item 37). Off until a 2-GPU A/B shows what it gives (a
// one-GPU run cannot: its waits are short and its ranks share one L2).
#ifndef MOK_POLL_RELAXED
#define MOK_POLL_RELAXED 0
#endif

// Error codes written to Workspace::error (first one wins); mirrored in Python
// (megatron_mok/cuda/errors.py).
enum ErrorCode : int32_t {
  kOk = 0,
  kTimeout = 1,         // a spin-wait saw no progress for timeout_ns
  kBadExpert = 2,       // topk_idx outside [-1, E)
  kRecvOverflow = 3,    // static-shape mode: more rows than max_recv_tokens
  kAborted = 4,         // stopped because another block reported an error
  kConfigMismatch = 5,  // ranks disagree (what = ConfigMismatch below): on the row size of a
                        // dispatch (tokens vs packed FP8 rows; detail = the peer's row bytes),
                        // or on MOK_EAGER_SPECULATIVE (their dispatches would make different
                        // numbers of transfers): a protocol error
  kExpertOverflow = 6,  // rows_per_expert: a local expert received more rows (peer = the
                        // expert, what = N, detail = its rows); the rows past N are dropped
  kPeerStopped = 7,     // a peer's dispatch ring slot says the peer stopped after an error and
                        // its copy-engine staging may have overwritten the chunk (ring.h,
                        // kReadyPoisoned; peer = it, detail = the chunk's generation; what =
                        // kWaitDispatchReady when a wait found it, before any read, and
                        // kWaitDispatchReleased when the re-read before the release did: the
                        // copy may have landed under this rank's reads, NOTES item 41)
};

// What a kConfigMismatch is about (the error report's `what`; mirrored in errors.py).
enum ConfigMismatch : int32_t {
  kMismatchSpeculative = 0,  // MOK_EAGER_SPECULATIVE differs
  kMismatchRowBytes = 1,     // the dispatch's row format differs (tokens vs FP8 rows: size, or
                             // one source vs two; detail = the peer's row_format)
};

// What a spin-wait was waiting for (Workspace::error.what).
enum WaitKind : int32_t {
  kWaitNone = 0,
  kWaitRoutingReady = 1,     // a peer's routing (meta slot) for this dispatch
  kWaitRoutingReleased = 2,  // peers to finish reading our previous routing in this slot
  kWaitDispatchReady = 3,    // a peer's staged tokens (dispatch ring chunk)
  kWaitDispatchReleased = 4, // peers to finish pulling the previous tokens in our ring slot
  kWaitCombineReady = 5,     // a peer's partial sums (combine ring chunk)
  kWaitCombineReleased = 6,  // the owner to finish pulling our previous partials
};
constexpr int kWaitKindCount = 8;  // ErrorReport::abandoned has one entry per kind

}  // namespace mok

// Where every region of a rank's symmetric workspace lives. One struct, used by the host
// (sizes, offsets for Python) and by every kernel (pointers): no pointer arithmetic elsewhere.
//
// A rank's workspace (same layout on every rank; peers reach it through peer pointers):
//
//   error        ErrorReport                     first error seen by this rank's kernels
//   counters     SeqCounters                     this rank's call numbers (private)
//   stop_note    StopNote                        why this rank stopped (mok_stop_rank writes it
//                                                before its poison; peers' hosts read it after)
//   trace        [kTraceBlocks][2] u64           first start / last end (globaltimer ns) of each
//                                                block of the last transfer kernel (diagnostics)
//   meta_ready   [M]      u64  routing slot m holds routing call g when == g+1 (owner writes)
//   meta_released[W][M]   u64  reader r finished routing call g in slot m: g+1 (r writes, remotely)
//   disp_ready   [Nd]     u64  dispatch ring chunk slot holds generation g when == g+1
//   disp_released[W][Nd]  u64  reader r finished generation g of the slot: g+1 (r writes remotely)
//   disp_gen     [Nd]     u64  producer-private: generation+1 last written to the slot (0: never)
//   disp_readers [Nd]     u64  producer-private: ranks that read that generation (bit mask)
//   disp_done    [W][Nd]  i32  consumer-private: tasks of (source, slot) pulled so far
//   comb_*                     the same five arrays for the combine ring (Nc slots)
//   comb_arrived [Nc]     i32  producer-private: rows of the slot's current generation staged
//                              so far (the phased combine spreads one chunk over many warps)
//   meta         [M] x MetaSlot  routing of one dispatch: T (i32), row bytes (i32), the speculative row
//                                capacity (i64 at +8, -1: none), then topk_idx [T_max, K]
//                                int32, then topk_weights [T_max, K] f32
//   disp_ring    [Nd] x chunk   C token rows of H elements (the Buffer's dtype)
//   comb_ring    [Nc] x chunk   C partial rows of H elements (partial dtype), then C x K f32
//                               prob-gradient side values
#pragma once

#include <cstddef>
#include <cstdint>

#include "config.h"

namespace mok {

// Blocks whose start/end times a transfer kernel records (diagnostics; see device.h).
constexpr int kTraceBlocks = 256;

// Diagnostics: the first wait of one kind that this rank's kernels gave up after the error.
struct AbandonedWait {
  int32_t peer;
  int32_t pad;
  int64_t detail;
};

struct ErrorReport {
  int32_t code;   // ErrorCode
  int32_t rank;   // this rank
  int32_t peer;   // the peer involved (-1: none)
  int32_t what;   // WaitKind
  int64_t detail; // slot / generation / token, depending on `what`
  uint64_t waits_noted;  // diagnostics: bit w set once a wait of kind w was recorded
  // Indexed by WaitKind: which other waits were in progress when the error stopped them (the
  // first timeout is usually a consumer; the producer it waited for shows up here, stuck in a
  // wait of its own). The host reads the first 32 bytes on every call, these only to describe
  // a timeout (megatron_mok/cuda/errors.py mirrors the layout).
  AbandonedWait abandoned[kWaitKindCount];
};
static_assert(sizeof(AbandonedWait) == 16, "errors.py reads 16-byte entries");
static_assert(offsetof(ErrorReport, abandoned) == 32, "errors.py reads the table at byte 32");

// Why this rank stopped after an error of its own (kernels/stop_rank.cu): written once, by the
// stop kernel, before the system fence that precedes its poison, so a peer whose wait ended on
// the poison finds the note complete when its host reads it (mok_read_stop_note). 256 bytes:
// megatron_mok/cuda/errors.py (REASON_BYTES) mirrors the text's size.
struct StopNote {
  int32_t length_plus_one;  // 0: no note (the workspace starts zeroed); else 1 + bytes of text
  int32_t origin;           // the rank whose own error it was: this rank, or the peer whose stop
                            // stopped it (its note passed on, so a chain names the first rank)
  int32_t pad[2];
  char text[kStopNoteBytes];  // UTF-8, not terminated
};
static_assert(sizeof(StopNote) == 256, "one 256-byte region");

// Call numbers live on the device, so CUDA-graph replays advance them like eager calls do.
// Every rank makes the same calls in the same order, so the numbers agree across ranks.
// An eager dispatch runs its staging and its pulls as two kernels on two streams (see
// dispatch_transfer.cu), so the dispatch ring has one call number per side: each kernel
// reads and advances its own; the one-kernel transfer advances both. Every call advances
// both once, so they agree whenever a call starts.
struct SeqCounters {
  uint64_t meta_seq;       // routing publications (full dispatches)
  uint64_t disp_seq;       // dispatch transfers, staging side (full and cached)
  uint64_t disp_pull_seq;  // dispatch transfers, pulling side
  uint64_t comb_seq;       // combines
  uint32_t meta_blocks_done, disp_warps_done, disp_pull_warps_done, comb_warps_done;
  uint32_t publish_blocks_done, count_blocks_done;  // the latter: the fused layout's arrivals
};

struct WorkspaceConfig {
  int32_t world_size;
  int32_t rank;
  int32_t hidden;          // H
  int32_t elem_bytes;      // bytes of one token element (2 for bf16)
  int32_t partial_bytes;   // bytes of one combine partial element
  int32_t topk;            // K
  int32_t num_local_experts;
  int32_t max_tokens;      // T_max
  int32_t chunk_tokens;    // C: rows per ring chunk (also the layout's token chunk)
  int32_t meta_slots;      // M
  int64_t disp_ring_chunks;  // Nd
  int64_t comb_ring_chunks;  // Nc
  // A >= 1: each local expert's rows are followed by zero rows up to a multiple of A (FP8
  // grouped GEMMs want aligned row counts; the layout's scan places them, HandleArrays' gaps).
  int32_t expert_alignment;
};

__host__ __device__ inline size_t align_up(size_t v, size_t a) { return (v + a - 1) / a * a; }

struct Workspace {
  WorkspaceConfig cfg;
  // Byte offsets of each region from the workspace base.
  size_t error, counters, stop_note, trace, meta_ready, meta_released;
  size_t disp_ready, disp_released, disp_gen, disp_readers, disp_done;
  size_t comb_ready, comb_released, comb_gen, comb_readers, comb_done, comb_arrived;
  size_t meta, meta_slot_bytes;
  size_t disp_ring, disp_chunk_bytes;
  size_t comb_ring, comb_chunk_bytes, comb_side_offset;
  size_t total_bytes;

  __host__ __device__ static Workspace make(const WorkspaceConfig& c) {
    Workspace w{};
    w.cfg = c;
    const size_t W = c.world_size, M = c.meta_slots, Nd = c.disp_ring_chunks, Nc = c.comb_ring_chunks;
    size_t off = 0;
    auto take = [&](size_t bytes) { size_t at = off; off = align_up(off + bytes, 256); return at; };
    w.error = take(sizeof(ErrorReport));
    w.counters = take(sizeof(SeqCounters));
    w.stop_note = take(sizeof(StopNote));
    // Stamp builds (MOK_LAYOUT_STAMPS, config.h) add a second 4 KB for the layout stamps, so the
    // transfer kernels' traces never overwrite them.
    w.trace = take(kTraceBlocks * 2 * 8 * (MOK_LAYOUT_STAMPS ? 2 : 1));
    w.meta_ready = take(M * 8);
    w.meta_released = take(W * M * 8);
    w.disp_ready = take(Nd * 8);
    w.disp_released = take(W * Nd * 8);
    w.disp_gen = take(Nd * 8);
    w.disp_readers = take(Nd * 8);
    w.disp_done = take(W * Nd * 4);
    w.comb_ready = take(Nc * 8);
    w.comb_released = take(W * Nc * 8);
    w.comb_gen = take(Nc * 8);
    w.comb_readers = take(Nc * 8);
    w.comb_done = take(W * Nc * 4);
    w.comb_arrived = take(Nc * 4);
    const size_t slots = (size_t)c.max_tokens * c.topk;
    w.meta_slot_bytes = align_up(16 + slots * 4 * 2, 256);
    w.meta = take(M * w.meta_slot_bytes);
    w.disp_chunk_bytes = align_up((size_t)c.chunk_tokens * c.hidden * c.elem_bytes, 256);
    w.disp_ring = take(Nd * w.disp_chunk_bytes);
    w.comb_side_offset = align_up((size_t)c.chunk_tokens * c.hidden * c.partial_bytes, 256);
    w.comb_chunk_bytes = align_up(w.comb_side_offset + (size_t)c.chunk_tokens * c.topk * 4, 256);
    w.comb_ring = take(Nc * w.comb_chunk_bytes);
    w.total_bytes = off;
    return w;
  }

  // Typed views into one rank's workspace (base = that rank's pointer).
  __host__ __device__ ErrorReport* error_at(char* base) const { return (ErrorReport*)(base + error); }
  __host__ __device__ SeqCounters* counters_at(char* base) const { return (SeqCounters*)(base + counters); }
  __host__ __device__ StopNote* stop_note_at(char* base) const { return (StopNote*)(base + stop_note); }
  __host__ __device__ uint64_t* meta_ready_at(char* base) const { return (uint64_t*)(base + meta_ready); }
  __host__ __device__ uint64_t* meta_released_at(char* base, int reader) const {
    return (uint64_t*)(base + meta_released) + (size_t)reader * cfg.meta_slots;
  }
  __host__ __device__ int32_t* meta_count_at(char* base, int slot) const {
    return (int32_t*)(base + meta + (size_t)slot * meta_slot_bytes);
  }
  // The row format of the slot owner's call (config.h, row_format).
  __host__ __device__ int32_t* meta_row_format_at(char* base, int slot) const {
    return (int32_t*)(base + meta + (size_t)slot * meta_slot_bytes + 4);
  }
  // Rows the slot's owner allocated before reading R (speculative eager dispatch), or -1.
  __host__ __device__ int64_t* meta_spec_cap_at(char* base, int slot) const {
    return (int64_t*)(base + meta + (size_t)slot * meta_slot_bytes + 8);
  }
  __host__ __device__ int32_t* meta_idx_at(char* base, int slot) const {
    return (int32_t*)(base + meta + (size_t)slot * meta_slot_bytes + 16);
  }
  __host__ __device__ float* meta_weights_at(char* base, int slot) const {
    return (float*)(base + meta + (size_t)slot * meta_slot_bytes + 16 +
                    (size_t)cfg.max_tokens * cfg.topk * 4);
  }
};

// The ring a transfer kernel works on: dispatch or combine share one shape.
struct RingView {
  char* ring;            // chunk slots
  size_t chunk_bytes;
  int64_t num_chunks;
  uint64_t* ready;       // [N]
  uint64_t* released;    // [W][N] (reader-major)
  uint64_t* gen;         // [N] producer-private
  uint64_t* readers;     // [N] producer-private
  int32_t* done;         // [W][N] consumer-private

  __host__ __device__ static RingView dispatch(const Workspace& w, char* base) {
    return {base + w.disp_ring, w.disp_chunk_bytes, w.cfg.disp_ring_chunks,
            (uint64_t*)(base + w.disp_ready), (uint64_t*)(base + w.disp_released),
            (uint64_t*)(base + w.disp_gen), (uint64_t*)(base + w.disp_readers),
            (int32_t*)(base + w.disp_done)};
  }
  __host__ __device__ static RingView combine(const Workspace& w, char* base) {
    return {base + w.comb_ring, w.comb_chunk_bytes, w.cfg.comb_ring_chunks,
            (uint64_t*)(base + w.comb_ready), (uint64_t*)(base + w.comb_released),
            (uint64_t*)(base + w.comb_gen), (uint64_t*)(base + w.comb_readers),
            (int32_t*)(base + w.comb_done)};
  }
};

}  // namespace mok
